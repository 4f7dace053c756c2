"""The composition root: the one place that reads the environment and assembles Dagster definitions.

``dagster dev -w workspace.yaml`` loads ``defs`` below; tests and other deployments call ``build_definitions``.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import dagster as dg

from assets.calendar import DEFAULT_START_DATE, DEFAULT_TIMEZONE, ExportCalendar
from assets.invoices import EXPORT_NAME, STUCK_CHECK_NAME, build_invoice_export, build_stuck_check
from assets.keys import parse_tenants, validate_slug
from resources.destinations import Destination, LocalDestination
from resources.exportfile import data_file_name
from resources.io_manager import LedgeredExportIOManager
from resources.ledger_resource import LedgerResource
from resources.schema import metadata as ledger_metadata
from resources.sources import InvoiceSource, SampleInvoiceSource, SqlInvoiceSource
from sensors.reconciliation import build_reconciliation_sensor
from sensors.schedules import build_nightly_schedule

PROJECT_ROOT = Path(__file__).resolve().parent
DEFAULT_TENANTS = ("acme", "globex", "initech")
DEFAULT_LEDGER_URL = f"sqlite:///{PROJECT_ROOT / 'var' / 'ledger.sqlite3'}"
DEFAULT_DESTINATION = str(PROJECT_ROOT / "var" / "exports")
DEFAULT_SCHEDULE_TIME = "04:30"
DEFAULT_MAX_PARTITIONS_PER_RUN = 31
_FROM_ENVIRONMENT = object()  # an argument left to the environment (where None has a meaning of its own)


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_TABLE_RE = re.compile(r"[a-z_][a-z0-9_]{0,52}")
# The ledger's own tables, and the manifest tables a ledger-table destination would add beside them.
_LEDGER_TABLES = {*ledger_metadata.tables, *(f"{name}_manifests" for name in ledger_metadata.tables)}


class ConfigurationError(ValueError):
    """A setting (argument or environment variable) that cannot be used; the message names it."""


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"{name} must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise ConfigurationError(f"{name} must be a positive integer, got {text!r}")
    return value


def _secret_setting(env: Mapping[str, str], environ: Mapping[str, str] | None, name: str, default: str):
    """A setting that may hold a password: taken from the process environment as a Dagster ``EnvVar``, so the UI
    and run config show the variable's name, never its value."""
    if not env.get(name):
        return default
    return dg.EnvVar(name) if environ is None else env[name]


def _destination_from(
    spec: str, env: Mapping[str, str], environ: Mapping[str, str] | None, ledger: LedgerResource
) -> Destination:
    """``EXPORTS_DESTINATION``: a folder, ``s3://bucket/prefix``, or ``ledger-table:<table>``."""
    if spec.startswith("s3://"):
        bucket, _, prefix = spec.removeprefix("s3://").partition("/")
        if not _BUCKET_RE.fullmatch(bucket):
            raise ConfigurationError(f"EXPORTS_DESTINATION {spec!r}: {bucket!r} is not a valid S3 bucket name")
        from resources.s3_destination import S3Destination  # boto3 is the optional [s3] extra

        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        return S3Destination(
            bucket=bucket,
            prefix=prefix.strip("/"),
            endpoint_url=_secret_setting(env, environ, "AWS_ENDPOINT_URL", None),
            region_name=region,
            access_key_id=_secret_setting(env, environ, "AWS_ACCESS_KEY_ID", None),
            secret_access_key=_secret_setting(env, environ, "AWS_SECRET_ACCESS_KEY", None),
            session_token=_secret_setting(env, environ, "AWS_SESSION_TOKEN", None),
        )
    if spec.startswith("ledger-table:"):
        table = spec.removeprefix("ledger-table:")
        if not _TABLE_RE.fullmatch(table) or table in _LEDGER_TABLES:
            raise ConfigurationError(
                f"EXPORTS_DESTINATION {spec!r}: {table!r} is not a valid table name, or is one of the ledger's own "
                f"tables ({', '.join(sorted(ledger_metadata.tables))})"
            )
        from resources.sql_destination import SqlTableDestination

        return SqlTableDestination(url=ledger.url, table=table)
    if "://" in spec or spec.split(":", 1)[0] in ("s3", "gs", "ftp", "http", "https"):
        scheme = spec.split(":", 1)[0]
        raise ConfigurationError(
            f"EXPORTS_DESTINATION scheme {scheme!r} is not supported; use a folder path, s3://bucket/prefix or "
            "ledger-table:<table>"
        )
    return LocalDestination(root=spec)


def build_definitions(
    timezone: str = DEFAULT_TIMEZONE,
    start_date: str = DEFAULT_START_DATE,
    tenants: Sequence[str] | None = None,
    *,
    ledger_url: str | None = None,
    destination: Destination | str | None = None,
    source: InvoiceSource | None = None,
    file_format: str | None = None,
    schedule_time: str = DEFAULT_SCHEDULE_TIME,
    lease_ttl_seconds: int | None = None,
    max_partitions_per_run: int | None | object = _FROM_ENVIRONMENT,
    ledger: LedgerResource | None = None,
    reconcile_batch_size: int = 100,
    stuck_after: dt.timedelta = dt.timedelta(hours=6),
    environ: Mapping[str, str] | None = None,
) -> dg.Definitions:
    """Assembles the export code location.

    Arguments left as None come from the environment (see the README's configuration table), then from defaults.

    Args:
        timezone: IANA zone of the business day, e.g. ``America/New_York``. Never implicit UTC.
        start_date: First partition, ``YYYY-MM-DD``.
        tenants: Tenant ids (slugs); default ``EXPORTS_TENANTS`` or three sample tenants.
        ledger_url: SQLAlchemy URL of the ledger; default ``EXPORTS_LEDGER_URL`` or a project-local SQLite file.
        destination: A destination resource or a folder path; default ``EXPORTS_DESTINATION`` or ``var/exports``.
        source: Invoice source; default ``EXPORTS_SOURCE_URL`` (SQL) or the sample source.
        file_format: ``csv`` or ``parquet``; default ``EXPORTS_FILE_FORMAT`` or ``csv``.
        schedule_time: Local ``HH:MM`` of the nightly run; must exist exactly once on every day of the zone.
        lease_ttl_seconds: Lease length of a claim; default ``EXPORTS_LEASE_TTL_SECONDS`` or 900.
        max_partitions_per_run: Backfills run in chunks of at most this many partitions; None for one single run;
            default ``EXPORTS_MAX_PARTITIONS_PER_RUN`` or 31.
        ledger: A ready ledger resource (tests pass one with a controlled clock); overrides ``ledger_url``.
        reconcile_batch_size: Stuck keys the reconciliation sensor examines per tick.
        stuck_after: Keys unresolved for longer fail the ``no_stuck_exports`` check and are logged as errors.
        environ: The environment to read; default ``os.environ``.

    Example:
        >>> defs = build_definitions("Europe/Dublin", "2026-01-01", ["acme"])  # doctest: +SKIP
    """
    env = os.environ if environ is None else environ
    calendar = ExportCalendar(timezone=timezone, start_date=start_date)

    if tenants is None:
        tenants = parse_tenants(env["EXPORTS_TENANTS"]) if env.get("EXPORTS_TENANTS") else DEFAULT_TENANTS
    tenants = [validate_slug(t, "tenant id") for t in tenants]
    if len(set(tenants)) != len(tenants):
        raise ConfigurationError(f"duplicate tenant ids in {tenants}")

    file_format = file_format or env.get("EXPORTS_FILE_FORMAT") or "csv"
    try:
        data_file_name(file_format)
    except ValueError as exc:
        raise ConfigurationError(f"EXPORTS_FILE_FORMAT: {exc}") from None

    if ledger is None:
        ttl = lease_ttl_seconds or _positive_int(
            "EXPORTS_LEASE_TTL_SECONDS", env.get("EXPORTS_LEASE_TTL_SECONDS", "900")
        )
        allow_below = env.get("EXPORTS_ALLOW_BELOW_LOW_WATER", "")
        if allow_below not in ("", "0", "1"):
            raise ConfigurationError(f"EXPORTS_ALLOW_BELOW_LOW_WATER must be 0 or 1, got {allow_below!r}")
        ledger = LedgerResource(
            url=ledger_url or _secret_setting(env, environ, "EXPORTS_LEDGER_URL", DEFAULT_LEDGER_URL),
            lease_ttl_seconds=ttl,
            allow_below_low_water=allow_below == "1",
        )

    if destination is None:
        destination = env.get("EXPORTS_DESTINATION") or DEFAULT_DESTINATION
    if isinstance(destination, str):
        destination = _destination_from(destination, env, environ, ledger)

    if source is None:
        if env.get("EXPORTS_SOURCE_URL"):
            source = SqlInvoiceSource(
                url=_secret_setting(env, environ, "EXPORTS_SOURCE_URL", ""),
                table=env.get("EXPORTS_SOURCE_TABLE", "invoices"),
            )
        else:
            cadence = _positive_int("EXPORTS_SAMPLE_CADENCE_MINUTES", env.get("EXPORTS_SAMPLE_CADENCE_MINUTES", "15"))
            source = SampleInvoiceSource(cadence_minutes=cadence)

    try:
        at = dt.time.fromisoformat(schedule_time)
    except ValueError:
        raise ConfigurationError(f"schedule_time must be HH:MM, got {schedule_time!r}") from None

    if max_partitions_per_run is _FROM_ENVIRONMENT:
        max_partitions_per_run = _positive_int(
            "EXPORTS_MAX_PARTITIONS_PER_RUN",
            env.get("EXPORTS_MAX_PARTITIONS_PER_RUN", str(DEFAULT_MAX_PARTITIONS_PER_RUN)),
        )
    policy = (
        dg.BackfillPolicy.single_run()
        if max_partitions_per_run is None
        else dg.BackfillPolicy.multi_run(max_partitions_per_run=max_partitions_per_run)
    )
    # One concurrency pool per destination kind (exports-local, exports-s3, exports-ledger-table): its limit bounds how
    # many export steps write to that destination at once (`dagster instance concurrency set exports-s3 2`).
    export_asset = build_invoice_export(calendar, tenants, pool=destination.pool, backfill_policy=policy)
    # The export and its per-run check; no_stuck_exports is reported by the reconciliation sensor, not every run.
    job = dg.define_asset_job(
        "invoice_export_job",
        selection=dg.AssetSelection.assets(EXPORT_NAME)
        - dg.AssetSelection.checks(dg.AssetCheckKey(dg.AssetKey(EXPORT_NAME), STUCK_CHECK_NAME)),
    )
    schedule = build_nightly_schedule(job, calendar, at)
    sensor = build_reconciliation_sensor(
        job, calendar, export_asset.key, tenants, batch_size=reconcile_batch_size, stuck_after=stuck_after
    )

    return dg.Definitions(
        assets=[export_asset],
        asset_checks=[build_stuck_check(stuck_after)],
        jobs=[job],
        schedules=[schedule],
        sensors=[sensor],
        resources={
            "ledger": ledger,
            "source": source,
            "destination": destination,
            "export_io_manager": LedgeredExportIOManager(
                ledger=ledger, destination=destination, file_format=file_format, tenants=list(tenants)
            ),
        },
    )


defs = build_definitions()
