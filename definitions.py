"""The composition root of this repository's reference code location: the invoice export, on export_ledger.

``dagster dev -w workspace.yaml`` loads ``defs`` below; tests and other deployments call ``build_definitions``.
Written only against export_ledger's public API, as a user's own code location would be.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence

import dagster as dg

from assets.invoices import invoice_export
from export_ledger import ConfigurationError, Destination, ExportSource, Settings, Tenant, validate_slug
from export_ledger.dagster import LedgerResource, SourceResource, ledgered_definitions, url_field
from export_ledger.settings import positive_int
from resources.invoices import InvoiceSourceResource, SampleInvoiceSource, sample_switches
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
#: it: a worker loads the location again and resolves its resources (the source's too) from its own environment, so
#: a launcher config that drops one runs another export, or fails naming the source setting it lacks.
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
#: The sample source's switches, to see each partition status from the UI (docs/ui.md: *See each status yourself*).
SAMPLE_SWITCHES = ("EXPORTS_SAMPLE_OUTAGE", "EXPORTS_SAMPLE_VOIDED")


def invoice_source_resource(env: Mapping[str, str], *, by_name: bool = True) -> InvoiceSourceResource:
    """The invoice source's resource, its fields the settings ``env`` gives (:data:`SOURCE_SETTINGS`, the sample's
    ``EXPORTS_SAMPLE_*``). The URL goes to Dagster by name, ``EnvVar("EXPORTS_SOURCE_URL")``: a run resolves it in its
    own worker, and the UI's resource config shows the variable, never the URL.

    A setting missing, two sources chosen or half of the SQL source's settings are not refused here: the location
    loads, and each run (tick, command) fails naming them where it resolves the resource
    (:meth:`InvoiceSourceResource.problem`), since which of them a process has depends on its own environment. A
    value malformed in itself is refused here, at load, without being quoted: ``EXPORTS_SOURCE`` other than
    ``sample``, a cadence that is not a positive integer, a sample switch without the sample. It is wrong in every
    process that reads it, and would otherwise be carried into the resource config the UI shows.

    Args:
        env: The settings.
        by_name: ``env`` is the process environment: the URL is passed as ``EnvVar``. Otherwise (a mapping given to
            :func:`build_definitions`) it is passed by name where the process environment holds the same value, as a
            value when it holds no password, and refused otherwise.

    Raises:
        ConfigurationError: a malformed value, named, never quoted.
    """
    choice = env.get("EXPORTS_SOURCE") or ""
    if choice not in ("", "sample"):
        raise ConfigurationError(
            "EXPORTS_SOURCE takes one value, 'sample'; a SQL source is chosen with EXPORTS_SOURCE_URL and "
            "EXPORTS_SOURCE_TABLE instead"
        )
    sample_only = [name for name in SAMPLE_SWITCHES if (env.get(name) or "").strip()]
    if sample_only and not choice:
        raise ConfigurationError(
            f"{' and '.join(sample_only)} {'apply' if len(sample_only) > 1 else 'applies'} to the sample source only "
            "(EXPORTS_SOURCE=sample)"
        )
    fields: dict = {"sample": bool(choice), "table": env.get("EXPORTS_SOURCE_TABLE") or ""}
    if choice:
        fields["sample_cadence_minutes"] = _sample_cadence(env)
        fields["sample_outage"] = env.get("EXPORTS_SAMPLE_OUTAGE") or ""
        fields["sample_voided"] = env.get("EXPORTS_SAMPLE_VOIDED") or ""
    fields["url"] = url_field(env.get("EXPORTS_SOURCE_URL") or "", "EXPORTS_SOURCE_URL", by_name=by_name)
    return InvoiceSourceResource(**fields)


def _sample_cadence(env: Mapping[str, str]) -> int:
    try:
        return positive_int("EXPORTS_SAMPLE_CADENCE_MINUTES", env.get("EXPORTS_SAMPLE_CADENCE_MINUTES", "15"))
    except ConfigurationError:  # the value is not quoted: a URL pasted into the wrong variable may carry a password
        raise ConfigurationError("EXPORTS_SAMPLE_CADENCE_MINUTES must be a positive integer of minutes") from None


def build_definitions(
    timezone: str = DEFAULT_TIMEZONE,
    start_date: str = DEFAULT_START_DATE,
    tenants: Sequence[str | Tenant] | Mapping[str, str | Tenant | None] | None = None,
    *,
    ledger_url: str | None = None,
    destination: Destination | str | None = None,
    source: ExportSource | SourceResource | None = None,
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
        source: Invoice source (an ``ExportSource``, or a ``SourceResource`` such as ``InvoiceSourceResource``);
            default the resource of the settings the environment gives (:func:`invoice_source_resource`), never
            implied: ``EXPORTS_SOURCE=sample``, or ``EXPORTS_SOURCE_URL`` and ``EXPORTS_SOURCE_TABLE``. Each run
            resolves it in its own worker; one that lacks a setting fails naming it, and the location still loads.
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
        source = invoice_source_resource(env, by_name=environ is None)
    spec = invoice_export(
        source=source,
        tenants=tenants,
        timezone=timezone,
        start_date=start_date,
        schedule_time=schedule_time,
        file_format=file_format or settings.file_format or "csv",
        deadline=deadline or env.get("EXPORTS_DEADLINE") or None,
    )
    if isinstance(source, InvoiceSourceResource) and source.sample:
        sample_switches(source.sample_outage, source.sample_voided, spec)  # a malformed switch is refused at load
    switched = env.get("EXPORTS_SOURCE") == "sample" and any((env.get(n) or "").strip() for n in SAMPLE_SWITCHES)
    if switched and isinstance(source, SampleInvoiceSource):  # a sample given in code takes the switches too
        source.outages, source.voided = sample_switches(
            env.get("EXPORTS_SAMPLE_OUTAGE") or "", env.get("EXPORTS_SAMPLE_VOIDED") or "", spec
        )  # business dates: each tenant's own window
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
