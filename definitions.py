"""The composition root of this repository's reference code location: the invoice export, on export_ledger.

``dagster dev -w workspace.yaml`` loads ``defs`` below; tests and other deployments call ``build_definitions``.
Written only against export_ledger's public API, as a user's own code location would be.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Mapping, Sequence

import dagster as dg

from assets.invoices import invoice_export
from export_ledger import (
    ConfigurationError,
    Destination,
    ExportSource,
    Settings,
    Tenant,
    UnusableSource,
    validate_slug,
)
from export_ledger.dagster import LedgerResource, ledgered_definitions
from export_ledger.settings import positive_int
from resources.invoices import InvoiceSource, SampleInvoiceSource, SqlInvoiceSource
from sensors import RECONCILE_BATCH_SIZE, STUCK_AFTER

DEFAULT_TIMEZONE = "America/New_York"  # set in code: a timezone change is a business change
DEFAULT_START_DATE = "2026-01-01"
DEFAULT_TENANTS = ("acme", "globex", "initech")
DEFAULT_SCHEDULE_TIME = "04:30"
_FROM_ENVIRONMENT = object()  # an argument left to the environment (where None has a meaning of its own)

#: The invoice source is chosen, never defaulted (issue 26): the sample with ``EXPORTS_SOURCE=sample``, a SQL table
#: with ``EXPORTS_SOURCE_URL`` and ``EXPORTS_SOURCE_TABLE``.
SOURCE_SETTINGS = {"sample": ("EXPORTS_SOURCE",), "sql": ("EXPORTS_SOURCE_URL", "EXPORTS_SOURCE_TABLE")}
#: What every run worker of this code location must be given besides its source's settings, as the code server has
#: it: a worker builds its export from its own environment, so a launcher config that drops one runs another export.
#: The launcher configs in deploy/ pass each of these, the source's, the instance's (``DAGSTER_PG_*``) and the
#: destination's credentials. Optional settings (``EXPORTS_DEADLINE``, ``EXPORTS_ALLOW_BELOW_LOW_WATER``,
#: ``EXPORTS_OPENLINEAGE_*``, ...) are passed by a deployment that sets them.
RUN_WORKER_SETTINGS = (
    "EXPORTS_LEDGER_URL",
    "EXPORTS_DESTINATION",
    "EXPORTS_TENANTS",
    "EXPORTS_FILE_FORMAT",
    "EXPORTS_LEASE_TTL_SECONDS",
)


def _check_sample_settings(env: Mapping[str, str]) -> None:
    """The sample's own settings, refused at load when malformed (a value given wrong, not a setting a run lacks):
    its switches without the sample, a cadence that is not a positive integer (its value never quoted)."""
    if env.get("EXPORTS_SOURCE") == "sample":
        _sample_cadence(env)
    sample_only = [name for name in SAMPLE_SWITCHES if (env.get(name) or "").strip()]
    if sample_only and env.get("EXPORTS_SOURCE") != "sample":
        raise ConfigurationError(
            f"{' and '.join(sample_only)} {'apply' if len(sample_only) > 1 else 'applies'} to the sample source only "
            "(EXPORTS_SOURCE=sample)"
        )


def _sample_cadence(env: Mapping[str, str]) -> int:
    try:
        return positive_int("EXPORTS_SAMPLE_CADENCE_MINUTES", env.get("EXPORTS_SAMPLE_CADENCE_MINUTES", "15"))
    except ConfigurationError:  # the value is not quoted: a URL pasted into the wrong variable may carry a password
        raise ConfigurationError("EXPORTS_SAMPLE_CADENCE_MINUTES must be a positive integer of minutes") from None


def invoice_source_from(env: Mapping[str, str]) -> InvoiceSource:
    """The invoice source the environment chooses (:data:`SOURCE_SETTINGS`).

    Nothing is implied: a process whose environment lost its source settings (a run worker whose launcher config does
    not pass them) never exports the sample invoices as if they were the real ones. :func:`build_definitions` then
    loads with an :class:`~export_ledger.UnusableSource`: the UI shows the export, and each run fails naming them.

    Raises:
        ConfigurationError: no source chosen, two chosen, or half of the SQL source's settings. Values are never quoted
            (the URL may carry a password).
    """
    choice = env.get("EXPORTS_SOURCE") or ""
    sql = {name: env.get(name) or "" for name in SOURCE_SETTINGS["sql"]}
    given = [name for name, value in sql.items() if value]
    if choice not in ("", "sample"):
        raise ConfigurationError(
            "EXPORTS_SOURCE takes one value, 'sample'; a SQL source is chosen with EXPORTS_SOURCE_URL and "
            "EXPORTS_SOURCE_TABLE instead"
        )
    if choice and given:
        raise ConfigurationError(f"EXPORTS_SOURCE=sample and {' and '.join(given)} choose two sources: set one")
    _check_sample_settings(env)
    if choice:
        cadence = _sample_cadence(env)
        return SampleInvoiceSource(cadence_minutes=cadence)
    if not given:
        raise ConfigurationError(
            "no invoice source: set EXPORTS_SOURCE=sample for the sample invoices, or EXPORTS_SOURCE_URL and "
            "EXPORTS_SOURCE_TABLE for a SQL table (a run worker gets them from its launcher config)"
        )
    if len(given) == 1:
        (missing,) = set(sql) - set(given)
        raise ConfigurationError(f"{given[0]} is set without {missing}: a SQL source needs both")
    return SqlInvoiceSource(url=sql["EXPORTS_SOURCE_URL"], table=sql["EXPORTS_SOURCE_TABLE"])


#: The sample source's switches, to see each partition status from the UI (docs/ui.md: *See each status yourself*).
SAMPLE_SWITCHES = ("EXPORTS_SAMPLE_OUTAGE", "EXPORTS_SAMPLE_VOIDED")


def _date(setting: str, text: str) -> dt.date:
    """One date written YYYY-MM-DD; anything else names the setting and the entry."""
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            return dt.date.fromisoformat(text)
    except ValueError:
        pass
    raise ConfigurationError(f"{setting}: {text!r} is not a date (YYYY-MM-DD)")


def _entries(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def sample_switches(env: Mapping[str, str], spec) -> tuple[frozenset, frozenset]:
    """``EXPORTS_SAMPLE_OUTAGE`` (``tenant@YYYY-MM-DD,...``) and ``EXPORTS_SAMPLE_VOIDED`` (``YYYY-MM-DD,...``) as the
    sample source takes them: ``(tenant, window start in UTC)`` of each business date in the tenant's own calendar
    (a tenant east of UTC+12 has its own day's window, not the next one's)."""
    outages = set()
    for entry in _entries(env.get("EXPORTS_SAMPLE_OUTAGE") or ""):
        tenant, at, day = entry.partition("@")
        if not at or not tenant or not day.strip():
            raise ConfigurationError(f"EXPORTS_SAMPLE_OUTAGE: {entry!r} is not tenant@YYYY-MM-DD")
        validate_slug(tenant, "EXPORTS_SAMPLE_OUTAGE tenant")
        if tenant not in spec.tenants:
            raise ConfigurationError(
                f"EXPORTS_SAMPLE_OUTAGE names {tenant}, not among the tenants ({', '.join(sorted(spec.tenants))})"
            )
        date = _date("EXPORTS_SAMPLE_OUTAGE", day.strip())
        outages.add((tenant, _window_start(spec, tenant, date, "EXPORTS_SAMPLE_OUTAGE")))
    voided = {
        (tenant, _window_start(spec, tenant, _date("EXPORTS_SAMPLE_VOIDED", day), "EXPORTS_SAMPLE_VOIDED"))
        for day in _entries(env.get("EXPORTS_SAMPLE_VOIDED") or "")
        for tenant in spec.tenants
    }
    return frozenset(outages), frozenset(voided)


def _window_start(spec, tenant: str, day: dt.date, setting: str) -> dt.datetime:
    calendar = spec.calendar_for(tenant)
    if day < calendar.first_date:
        raise ConfigurationError(f"{setting}: {day} is before the export's first business date ({calendar.start_date})")
    try:
        return calendar.window_of(day).start_utc
    except OverflowError:
        raise ConfigurationError(f"{setting}: {day} is out of the calendar's range") from None


def build_definitions(
    timezone: str = DEFAULT_TIMEZONE,
    start_date: str = DEFAULT_START_DATE,
    tenants: Sequence[str | Tenant] | Mapping[str, str | Tenant | None] | None = None,
    *,
    ledger_url: str | None = None,
    destination: Destination | str | None = None,
    source: ExportSource | None = None,
    file_format: str | None = None,
    schedule_time: str = DEFAULT_SCHEDULE_TIME,
    lease_ttl_seconds: int | None = None,
    max_partitions_per_run: int | None | object = _FROM_ENVIRONMENT,
    ledger: LedgerResource | None = None,
    reconcile_batch_size: int = RECONCILE_BATCH_SIZE,
    stuck_after: dt.timedelta = STUCK_AFTER,
    deadline: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dg.Definitions:
    """Assembles the invoice export code location.

    Arguments left as None come from the environment (see the README's configuration table), then from defaults.

    Args:
        timezone: IANA zone of the business day, e.g. ``America/New_York``. Never implicit UTC.
        start_date: First partition, ``YYYY-MM-DD``.
        tenants: Tenant ids (slugs) in ``timezone``; or a mapping of tenant id to the tenant's own zone, e.g.
            ``{"acme": "America/New_York", "bombay-traders": "Asia/Kolkata"}`` (or to a :class:`Tenant` with its own
            nightly time or earlier zones): one asset, job and schedule per zone. Default ``EXPORTS_TENANTS`` (ids)
            or three sample tenants.
        ledger_url: SQLAlchemy URL of the ledger; default ``EXPORTS_LEDGER_URL`` or ``./var/ledger.sqlite3``. A URL
            with a password is refused here (Dagster would show it in the UI's resource config): set
            ``EXPORTS_LEDGER_URL`` instead, which is passed by name, or leave the password to the driver
            (``PGPASSWORD``, ``~/.pgpass``).
        destination: A destination or its spec; default ``EXPORTS_DESTINATION`` or ``./var/exports``.
        source: Invoice source; default the one the environment chooses (:func:`invoice_source_from`), never
            implied: ``EXPORTS_SOURCE=sample``, or ``EXPORTS_SOURCE_URL`` and ``EXPORTS_SOURCE_TABLE``.
        file_format: ``csv`` or ``parquet``; default ``EXPORTS_FILE_FORMAT`` or ``csv``.
        schedule_time: Local ``HH:MM`` of the nightly run; must exist exactly once on every day of the zone.
        lease_ttl_seconds: Lease length of a claim; default ``EXPORTS_LEASE_TTL_SECONDS`` or 900.
        max_partitions_per_run: Backfills run in chunks of at most this many partitions; None for one single run;
            default ``EXPORTS_MAX_PARTITIONS_PER_RUN`` or 31.
        ledger: A ready ledger resource (tests pass one with a controlled clock); overrides ``ledger_url``.
        reconcile_batch_size: Stuck keys the reconciliation sensor examines per tick.
        stuck_after: Keys unresolved for longer fail the ``no_stuck_exports`` check and are logged as errors.
        deadline: Local ``HH:MM`` by which each tenant's export of a date is due the morning after, in the tenant's
            zone; later keys are escalated. Default ``EXPORTS_DEADLINE`` or none.
        environ: The environment to read; default ``os.environ``.

    Example:
        >>> defs = build_definitions("Europe/Dublin", "2026-01-01", ["acme"])  # doctest: +SKIP
        >>> defs = build_definitions(tenants={"acme": "America/New_York", "ap": "Pacific/Apia"})  # doctest: +SKIP
    """
    settings = Settings.from_environment(environ)
    env = settings.environ
    if tenants is None:
        tenants = list(settings.tenants or DEFAULT_TENANTS)
    elif not isinstance(tenants, Mapping):
        tenants = list(tenants)
        for tenant in tenants:
            if not isinstance(tenant, Tenant):
                validate_slug(tenant, "tenant id")
    # The ledger resource is made by ledgered_definitions from the settings, so that a URL read from the environment
    # stays an EnvVar (the UI shows names, never a password) whatever else is given here.
    if ledger_url is not None:
        settings = dataclasses.replace(settings, ledger_url=ledger_url, ledger_url_from_env=False)
    if lease_ttl_seconds is not None:
        settings = dataclasses.replace(
            settings, lease_ttl_seconds=positive_int("lease_ttl_seconds", str(lease_ttl_seconds))
        )
    if source is None:
        _check_sample_settings(env)
        try:
            source = invoice_source_from(env)
        except ConfigurationError as exc:
            # The location loads (the UI shows the export and its history); each run fails naming the settings, and
            # nothing is read from another source instead.
            source = UnusableSource(f"the invoice source cannot be used in this process: {exc}")
    spec = invoice_export(
        source=source,
        tenants=tenants,
        timezone=timezone,
        start_date=start_date,
        schedule_time=schedule_time,
        file_format=file_format or settings.file_format or "csv",
        deadline=deadline or env.get("EXPORTS_DEADLINE") or None,
    )
    switched = env.get("EXPORTS_SOURCE") == "sample" and any((env.get(n) or "").strip() for n in SAMPLE_SWITCHES)
    if switched and isinstance(source, SampleInvoiceSource):
        source.outages, source.voided = sample_switches(env, spec)  # business dates: each tenant's own window
    return ledgered_definitions(
        [spec],
        ledger=ledger,
        destination=destination,
        settings=settings,
        max_partitions_per_run=(
            settings.max_partitions_per_run if max_partitions_per_run is _FROM_ENVIRONMENT else max_partitions_per_run
        ),
        reconcile_batch_size=reconcile_batch_size,
        stuck_after=stuck_after,
        environ=environ,
    )


defs = build_definitions()
