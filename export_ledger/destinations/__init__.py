"""Destinations: publishing ones (a local folder, an S3-compatible store) and a transactional one (a table of the
ledger's own database), all built from one spec string by :func:`destination_from`."""

from __future__ import annotations

import re
from collections.abc import Mapping

from export_ledger.destinations.base import (
    Destination,
    DestinationConflict,
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    PublishedElsewhere,
    PublishingDestination,
    PublishOutcomeUnknown,
    StagedExport,
    TransactionalDestination,
)
from export_ledger.destinations.local import LocalDestination
from export_ledger.errors import ConfigurationError
from export_ledger.ledger.schema import metadata as ledger_metadata

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_TABLE_RE = re.compile(r"[a-z_][a-z0-9_]{0,52}")
# The ledger's own tables, and the manifest tables a ledger-table destination would add beside them.
_LEDGER_TABLES = {*ledger_metadata.tables, *(f"{name}_manifests" for name in ledger_metadata.tables)}


def destination_from(
    spec: str, *, ledger_url: str, credentials: Mapping[str, str | None] | None = None, what: str = "destination"
) -> Destination:
    """Builds a destination from its spec: a folder path, ``s3://bucket/prefix`` or ``ledger-table:<table>``.

    Args:
        spec: The spec (``EXPORTS_DESTINATION``).
        ledger_url: The ledger's URL; a ``ledger-table:`` destination lives in the ledger's database.
        credentials: For S3: ``endpoint_url``, ``region_name``, ``access_key_id``, ``secret_access_key``,
            ``session_token``, ``connect_timeout_seconds``, ``read_timeout_seconds`` (None: boto3's own lookup).
        what: The setting's name in error messages.

    Raises:
        ConfigurationError: naming the setting and what is wrong with it.
    """
    _check_spec(spec, what)
    if spec.startswith("s3://"):
        from export_ledger.destinations.s3 import S3Destination  # boto3 is the optional [s3] extra

        bucket, _, prefix = spec.removeprefix("s3://").partition("/")
        extra = {k: v for k, v in (credentials or {}).items() if v is not None}
        return S3Destination(bucket=bucket, prefix=prefix.strip("/"), **extra)
    if spec.startswith("ledger-table:"):
        from export_ledger.destinations.table import SqlTableDestination

        return SqlTableDestination(url=ledger_url, table=spec.removeprefix("ledger-table:"))
    return LocalDestination(root=spec)


def _check_spec(spec: str, what: str) -> None:
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError(f"{what} must be a folder path, s3://bucket/prefix or ledger-table:<table>")
    if spec.startswith("s3://"):
        bucket = spec.removeprefix("s3://").partition("/")[0]
        if not _BUCKET_RE.fullmatch(bucket):
            raise ConfigurationError(f"{what} {spec!r}: {bucket!r} is not a valid S3 bucket name")
        return
    if spec.startswith("ledger-table:"):
        table = spec.removeprefix("ledger-table:")
        if not _TABLE_RE.fullmatch(table.replace("{export}", "x")) or table in _LEDGER_TABLES:
            raise ConfigurationError(
                f"{what} {spec!r}: {table!r} is not a valid table name, or is one of the ledger's own "
                f"tables ({', '.join(sorted(ledger_metadata.tables))})"
            )
        return
    if "://" in spec or spec.split(":", 1)[0] in ("s3", "gs", "ftp", "http", "https"):
        scheme = spec.split(":", 1)[0]
        raise ConfigurationError(
            f"{what} scheme {scheme!r} is not supported; use a folder path, s3://bucket/prefix or ledger-table:<table>"
        )


__all__ = [
    "Destination",
    "DestinationConflict",
    "DestinationError",
    "DestinationUnreachable",
    "ExportTarget",
    "LocalDestination",
    "PublishOutcomeUnknown",
    "PublishedElsewhere",
    "PublishingDestination",
    "StagedExport",
    "TransactionalDestination",
    "destination_from",
]
