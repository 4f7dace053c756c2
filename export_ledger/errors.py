"""The library's errors: one root, so a caller can catch everything export-ledger refuses with one ``except``.

Each error is also an instance of the built-in class it always was (``ValueError`` for bad input, ``RuntimeError``
for a failed destination or source), so code written against those keeps working.
"""

from __future__ import annotations

import re

#: Names of URL query parameters (and settings) that hold secrets.
SECRET_NAME = re.compile(r"pass|secret|token|key|sig", re.IGNORECASE)
#: A URL in free text: ``scheme://`` up to the next blank or quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")
_SECRET_PARAMETER = re.compile(r"([?&;#\s](?:[\w.-]*(?:pass|secret|token|key|sig)[\w.-]*)=)[^&;\s'\"]+", re.IGNORECASE)


def userinfo_end(rest: str) -> int:
    """Where the userinfo of a URL ends (the index of its ``@``) in ``rest``, the URL after ``scheme://``; -1 when
    it has none.

    People write passwords un-encoded, with ``@``, ``:`` or ``/`` in them, so the userinfo ends at the *last* ``@``
    before the query (``u:p@ss@host`` has the password ``p@ss``, not the host ``ss@host``). Without an ``@`` before
    the query, the last ``@`` of all (a password holding ``?``): a query's own ``@`` may then hide the host too, which
    costs a message its host, never a password.
    """
    query = rest.find("?")
    end = rest.rfind("@", 0, query if query >= 0 else len(rest))
    return end if end >= 0 else rest.rfind("@")


def mask_userinfo(url: str) -> str:
    """``url`` with the password of its userinfo replaced by ``***``: ``postgresql://u:***@host/db``. Everything
    from the first ``:`` after the user name to the userinfo's last ``@`` is the password; a URL without a
    password (``postgresql://u@host/db``) or without a userinfo is returned as it is."""
    scheme, found, rest = url.partition("://")
    end = userinfo_end(rest) if found else -1
    if end < 0 or ":" not in rest[:end]:
        return url
    user = rest[:end].split(":", 1)[0]
    return f"{scheme}://{user}:***{rest[end:]}"


def redact_text(text: str) -> str:
    """Any text with URL passwords (``user:password@``, see :func:`mask_userinfo`) and secret-named query parameters
    replaced by ``***``."""
    return _SECRET_PARAMETER.sub(r"\1***", _URL_IN_TEXT.sub(lambda url: mask_userinfo(url.group()), text))


class ExportLedgerError(Exception):
    """Root of every error export-ledger raises on purpose. Messages name the problem, never customer values."""


class ConfigurationError(ExportLedgerError, ValueError):
    """A setting (argument, declaration or environment variable) that cannot be used; the message names it."""


class CalendarError(ExportLedgerError, ValueError):
    """A business date, zone or schedule time that the export calendar cannot accept."""


class InvalidIdentifier(ExportLedgerError, ValueError):
    """A tenant or export name that is not a safe slug."""


class FrameError(ExportLedgerError, ValueError):
    """Source data that cannot be exported as it is. Messages name columns and ids, never customer values."""


class ManifestError(ExportLedgerError, ValueError):
    """A manifest that is missing fields or does not describe the expected export."""


class SourceError(ExportLedgerError, RuntimeError):
    """The source could not be read."""


# Driver and library messages can quote the values they choked on (pyarrow quotes the cell, PostgreSQL's DETAIL
# quotes the failing row). What the library stores or logs about an error is therefore built from the error's class
# and, only for the library's own errors and the operating system's, its message.
_WITHHELD = "details withheld: the message of a driver or library may quote exported data"


def safe_message(exc: BaseException) -> str:
    """A message safe to store and log: the library's own words, the OS's ``strerror``, or the class alone."""
    if isinstance(exc, ExportLedgerError):
        return str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return type(exc).__name__
    return f"{type(exc).__name__} ({_WITHHELD})"
