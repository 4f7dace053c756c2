"""Database URLs as people write them, turned into SQLAlchemy URLs and engines in one place: the ledger, a
``ledger-table:`` destination (through the ledger's engine) and a :class:`~export_ledger.sources.SqlSource` all open
their databases through :func:`create_engine`.

* A plain path (``./var/ledger.sqlite3``, the default as the README's configuration table writes it) is a SQLite
  file, relative to the working directory.
* ``postgresql://`` names no driver, and SQLAlchemy 2.1 then picks psycopg 3; export-ledger installs psycopg2
  too, so such a URL is opened with whichever of the two is installed, psycopg 3 first.
* A driver that is named but not installed (``postgresql+asyncpg://``) is refused with the package to install and the
  scheme to write instead, never with a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url

from export_ledger.errors import SECRET_NAME, ConfigurationError, mask_userinfo, userinfo_end

#: ``scheme:`` at the start of a URL; a plain path has none (``./x``, ``/x``, ``var/x``, ``~/x``).
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
#: The package that provides a DBAPI module, where its name differs from the module's.
_PACKAGES = {
    "psycopg": "psycopg[binary]",
    "psycopg2": "psycopg2-binary",
    "MySQLdb": "mysqlclient",
    "pymysql": "PyMySQL",
}
_POSTGRES_HINT = "postgresql+psycopg2://user@host:5432/db (psycopg2 is installed with export-ledger)"


def is_plain_path(text: str) -> bool:
    """True for a file path written without a scheme, which :func:`database_url` opens as a SQLite file."""
    return bool(text) and not _SCHEME.match(text)


def redact_url(url: str) -> str:
    """The URL for messages: the password of its userinfo and every query parameter named like a secret
    (password, secret, token, key, sig) replaced by ``***``.

    The password is everything between the user name's ``:`` and the userinfo's last ``@``, so an un-encoded ``@``
    in it never shows its tail as the host (``postgresql://u:p@ss@db/x`` is shown ``postgresql://u:***@db/x``;
    SQLAlchemy itself would read the host ``ss@db``). A plain path holds no secret and is returned as it is. A string
    that starts like a URL but does not parse is shown by its scheme alone, with a note saying the rest is hidden:
    where its password is cannot be known. A fragment with a part named like a secret (``#password=...``) is shown
    as ``#***``. Surrounding whitespace is dropped first, as :func:`holds_secret` judges the URL without it.
    """
    url = url.strip()
    if is_plain_path(url):
        return url
    # The password first (it may hold a "#"), then the fragment, which SQLAlchemy would read into the database name.
    head, hashed, fragment = mask_userinfo(url).partition("#")
    try:
        parsed = make_url(head)
    except Exception:
        return f"{url.split(':', 1)[0]}:<rest hidden: not a valid URL>"
    query = {name: ("***" if SECRET_NAME.search(name) else value) for name, value in parsed.query.items()}
    shown = parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")
    if hashed:
        shown += "#***" if _names_a_secret(fragment) else f"#{fragment}"
    return shown


def _names_a_secret(parameters: str) -> bool:
    """Whether a URL's query or fragment (``a=1&password=...``) has a part named like a secret."""
    return any(SECRET_NAME.search(part.partition("=")[0]) for part in re.split(r"[?&;#]", parameters) if part)


def holds_secret(url: str) -> bool:
    """Whether a database URL carries a secret: a password in its userinfo (``user:password@``), or a query
    parameter named like one (``?password=``, ``?sslkey=``...), its fragment too. A plain path holds none. Judged on
    the text without surrounding whitespace (a pasted URL with a leading space is no path)."""
    url = url.strip()
    if is_plain_path(url):
        return False
    _, found, rest = url.partition("://")
    end = userinfo_end(rest) if found else -1
    if end >= 0 and ":" in rest[:end]:
        return True
    after = rest[end + 1 :] if end >= 0 else rest  # a user name may hold a "#" or "?"
    cut = [i for i in (after.find("?"), after.find("#")) if i >= 0]
    return bool(cut) and _names_a_secret(after[min(cut) + 1 :])


def may_hold_secret(url: str) -> bool:
    """Whether a URL that names no database may carry a secret: a password or a parameter named like one
    (:func:`holds_secret`), a user part alone (a token written as the user: ``https://t0ken@minio:9000``), or any
    query (``?auth=...``). An endpoint's or a lineage server's URL is judged so; a ledger URL's user name is none.
    Text without ``://`` (a plain path) holds none."""
    if holds_secret(url):
        return True
    _, found, rest = url.partition("://")
    return bool(found) and (userinfo_end(rest) >= 0 or "?" in rest)


def database_url(text: str, *, what: str = "database URL") -> URL:
    """The SQLAlchemy URL to open for ``text``: a plain path as a SQLite file, ``postgresql://`` with the installed
    driver, anything else as written.

    Raises:
        ConfigurationError: ``text`` is neither a path nor an SQLAlchemy URL; the message names ``what``.
    """
    if is_plain_path(text):
        return URL.create("sqlite", database=str(Path(text).expanduser().absolute()))
    scheme, _, rest = text.partition("://")
    end = userinfo_end(rest)
    if ":" in rest[: max(end, 0)] and "@" in rest[:end].split(":", 1)[1]:
        # SQLAlchemy would read the password's tail as the host and connect there.
        raise ConfigurationError(
            f"the password in the {what} {redact_url(text)!r} holds an un-encoded '@': write it as %40 "
            "(percent-encode the password: urllib.parse.quote(password, safe=''))"
        )
    try:
        parsed = make_url(text)
    except Exception as exc:  # SQLAlchemy's own message quotes the URL, password included
        raise ConfigurationError(
            f"invalid {what} {redact_url(text)!r}: {type(exc).__name__}; write a file path for SQLite "
            f"(./var/ledger.sqlite3) or an SQLAlchemy URL, for example {_POSTGRES_HINT}"
        ) from None
    if parsed.drivername == "postgresql" and not _installed("psycopg") and _installed("psycopg2"):
        return parsed.set(drivername="postgresql+psycopg2")
    return parsed


def create_engine(text: str, *, what: str = "database URL", **options) -> Engine:
    """``sqlalchemy.create_engine`` of :func:`database_url`, with errors that name the problem.

    Raises:
        ConfigurationError: the URL is invalid, names an unknown database or dialect, or a driver that is not
            installed (the message names the package to install and the scheme to write instead).
    """
    parsed = database_url(text, what=what)
    try:
        return sa.create_engine(parsed, **options)
    except ModuleNotFoundError as exc:
        module = (exc.name or "").split(".")[0]
        instead = f"write {_POSTGRES_HINT}" if parsed.get_backend_name() == "postgresql" else "name an installed driver"
        raise ConfigurationError(
            f"the {what} {redact_url(text)!r} uses the scheme {parsed.drivername}://, whose driver {module!r} is not "
            f"installed: install it (pip install {_PACKAGES.get(module, module)}) or {instead}"
        ) from None
    except sa.exc.NoSuchModuleError:
        raise ConfigurationError(
            f"the {what} {redact_url(text)!r} names an unknown database or driver ({parsed.drivername}://); "
            f"write a file path for SQLite or an SQLAlchemy URL, for example {_POSTGRES_HINT}"
        ) from None


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
