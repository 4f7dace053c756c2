"""Settings: read once from the environment, shared by the Dagster code location and the ``export-ledger`` CLI.

Plain Python. Defaults resolve from the working directory (``./var/ledger.sqlite3``, ``./var/exports``), never
from where a module is installed. The environment is kept whole (``Settings.environ``): secrets (a ledger URL with a
password, a destination's credentials, read by the variables its scheme declares) are known by *name* as well as
value, so the Dagster layer can hand them over as ``EnvVar`` and the UI shows names, never values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from export_ledger.errors import ConfigurationError
from export_ledger.frames import FILE_FORMATS
from export_ledger.keys import parse_tenants
from export_ledger.ledger.urls import is_plain_path

__all__ = [
    "DEFAULT_LEASE_TTL_SECONDS", "DEFAULT_MAX_PARTITIONS_PER_RUN", "DEFAULT_OPENLINEAGE_NAMESPACE", "DESTINATION_ENV",
    "LEDGER_URL_ENV", "OPENLINEAGE_API_KEY_ENV", "OPENLINEAGE_NAMESPACE_ENV", "OPENLINEAGE_URL_ENV", "Settings",
    "default_destination", "default_ledger_url", "http_url", "ledger_url_from", "positive_int",
]  # fmt: skip

DEFAULT_LEASE_TTL_SECONDS = 900
DEFAULT_MAX_PARTITIONS_PER_RUN = 31
LEDGER_URL_ENV = "EXPORTS_LEDGER_URL"
DESTINATION_ENV = "EXPORTS_DESTINATION"
#: Where OpenLineage run events go (an HTTP receiver such as Marquez); unset: no events. Our own name rather than the
#: client's ``OPENLINEAGE_URL``, which other tools in the same process read too: exports emit only when asked to.
OPENLINEAGE_URL_ENV = "EXPORTS_OPENLINEAGE_URL"
OPENLINEAGE_NAMESPACE_ENV = "EXPORTS_OPENLINEAGE_NAMESPACE"
#: A secret, read by name when an event is sent (never kept in ``Settings``' repr).
OPENLINEAGE_API_KEY_ENV = "EXPORTS_OPENLINEAGE_API_KEY"
DEFAULT_OPENLINEAGE_NAMESPACE = "export-ledger"


def default_ledger_url(base: Path | None = None) -> str:
    """``sqlite:///<working directory>/var/ledger.sqlite3``."""
    return f"sqlite:///{(base or Path.cwd()) / 'var' / 'ledger.sqlite3'}"


def ledger_url_from(text: str, base: Path | None = None) -> str:
    """``EXPORTS_LEDGER_URL`` as a URL: a plain path (``./var/ledger.sqlite3``, as the README's table writes the
    default) is a SQLite file relative to the working directory, so the CLI and the code location open the same file
    (the ledger's engine accepts a plain path too: :func:`export_ledger.ledger.urls.database_url`). Empty: the
    default."""
    if not text:
        return default_ledger_url(base)
    if not is_plain_path(text):
        return text
    return f"sqlite:///{(base or Path.cwd()) / Path(text).expanduser()}"


def default_destination(base: Path | None = None) -> str:
    """``<working directory>/var/exports``."""
    return str((base or Path.cwd()) / "var" / "exports")


def positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name} must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise ConfigurationError(f"{name} must be a positive integer, got {text!r}")
    return value


def http_url(name: str, text: str | None) -> str | None:
    """An ``http(s)://host...`` URL, or None when unset; anything else fails naming the variable (not its value,
    which may hold a token)."""
    if text is None:
        return None
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"{name} must be an http:// or https:// URL with a host")
    return text


@dataclass(frozen=True)
class Settings:
    """Everything export-ledger reads from the environment, parsed and checked.

    Attributes:
        ledger_url: SQLAlchemy URL of the ledger (``EXPORTS_LEDGER_URL``; a plain path is a SQLite file).
        ledger_url_from_env: True when it came from the environment (a secret to pass by name).
        destination: Destination spec: folder, ``s3://bucket/prefix`` or ``ledger-table:<table>``.
        tenants: ``EXPORTS_TENANTS``, or None when unset (the code decides).
        file_format: ``EXPORTS_FILE_FORMAT``, or None when unset.
        lease_ttl_seconds: ``EXPORTS_LEASE_TTL_SECONDS``.
        allow_below_low_water: ``EXPORTS_ALLOW_BELOW_LOW_WATER=1``.
        max_partitions_per_run: ``EXPORTS_MAX_PARTITIONS_PER_RUN``.
        openlineage_url: ``EXPORTS_OPENLINEAGE_URL``, or None when unset (no lineage events).
        openlineage_namespace: ``EXPORTS_OPENLINEAGE_NAMESPACE``: the OpenLineage job namespace.
        environ: The environment read. A destination's own settings (``AWS_SECRET_ACCESS_KEY``, ...) are read from
            it by the variables its scheme declares (:class:`export_ledger.destinations.registry.Setting`), when a
            destination is built from a spec: ``destination_from(spec, ..., environ=settings.environ)``.
        implicit_ledger_url: The URL ``ledger_url`` defaulted to (``./var/ledger.sqlite3``) when
            ``EXPORTS_LEDGER_URL`` was unset, else None: see :attr:`ledger_is_implicit`.
    """

    ledger_url: str
    destination: str
    tenants: tuple[str, ...] | None = None
    file_format: str | None = None
    lease_ttl_seconds: int = DEFAULT_LEASE_TTL_SECONDS
    allow_below_low_water: bool = False
    max_partitions_per_run: int = DEFAULT_MAX_PARTITIONS_PER_RUN
    ledger_url_from_env: bool = False
    openlineage_url: str | None = None
    openlineage_namespace: str = DEFAULT_OPENLINEAGE_NAMESPACE
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)
    implicit_ledger_url: str | None = None

    @property
    def ledger_is_implicit(self) -> bool:
        """The ledger is the local SQLite file nobody chose: ``EXPORTS_LEDGER_URL`` was unset and no other URL was
        given since (a ``dataclasses.replace`` of ``ledger_url`` makes it explicit). A file private to each host."""
        return self.implicit_ledger_url is not None and self.ledger_url == self.implicit_ledger_url

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *, base: Path | None = None) -> Settings:
        """Reads and checks every setting; a bad value fails here, naming the variable."""
        env = os.environ if environ is None else environ
        tenants = parse_tenants(env["EXPORTS_TENANTS"]) if env.get("EXPORTS_TENANTS") else None
        file_format = env.get("EXPORTS_FILE_FORMAT") or None
        if file_format is not None and file_format not in FILE_FORMATS:
            raise ConfigurationError(
                f"EXPORTS_FILE_FORMAT: unknown file format {file_format!r}: expected one of {sorted(FILE_FORMATS)}"
            )
        allow_below = env.get("EXPORTS_ALLOW_BELOW_LOW_WATER", "")
        if allow_below not in ("", "0", "1"):
            raise ConfigurationError(f"EXPORTS_ALLOW_BELOW_LOW_WATER must be 0 or 1, got {allow_below!r}")
        ledger_url = ledger_url_from(env.get(LEDGER_URL_ENV) or "", base)
        return cls(
            ledger_url=ledger_url,
            implicit_ledger_url=None if env.get(LEDGER_URL_ENV) else ledger_url,
            ledger_url_from_env=bool(env.get(LEDGER_URL_ENV)),
            destination=env.get(DESTINATION_ENV) or default_destination(base),
            tenants=tenants,
            file_format=file_format,
            lease_ttl_seconds=positive_int(
                "EXPORTS_LEASE_TTL_SECONDS", env.get("EXPORTS_LEASE_TTL_SECONDS", str(DEFAULT_LEASE_TTL_SECONDS))
            ),
            allow_below_low_water=allow_below == "1",
            max_partitions_per_run=positive_int(
                "EXPORTS_MAX_PARTITIONS_PER_RUN",
                env.get("EXPORTS_MAX_PARTITIONS_PER_RUN", str(DEFAULT_MAX_PARTITIONS_PER_RUN)),
            ),
            openlineage_url=http_url(OPENLINEAGE_URL_ENV, env.get(OPENLINEAGE_URL_ENV) or None),
            openlineage_namespace=env.get(OPENLINEAGE_NAMESPACE_ENV) or DEFAULT_OPENLINEAGE_NAMESPACE,
            environ=dict(env),
        )
