"""``ledgered_definitions``: a whole code location of ledgered exports from a list of declared exports."""

from __future__ import annotations

import datetime as dt
import json
import os
import warnings
import weakref
from collections.abc import Mapping, Sequence

import dagster as dg

from export_ledger.dagster.assets import build_export_asset
from export_ledger.dagster.checks import HEALTH_CHECK_NAME, build_stuck_check
from export_ledger.dagster.drift_sensor import build_drift_sensor
from export_ledger.dagster.health_sensor import build_health_sensor, health_job_name
from export_ledger.dagster.io_manager import LedgeredExportIOManager
from export_ledger.dagster.resources import (
    LEDGER_KEY,
    DestinationResource,
    LedgerResource,
    SourceResource,
    is_secret,
    resource_keys,
    secret_by_name,
    source_key,
)
from export_ledger.dagster.schedules import build_nightly_schedule
from export_ledger.dagster.sensors import build_reconciliation_sensor, job_selection
from export_ledger.destinations import Destination, destination_from
from export_ledger.destinations.registry import scheme_of
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.drift import DEFAULT_DRIFT_BATCH, DEFAULT_LOOKBACK_DAYS
from export_ledger.errors import ConfigurationError
from export_ledger.lazy import require_frame_libraries
from export_ledger.ledger.urls import holds_secret, may_hold_secret, redact_url
from export_ledger.settings import LEDGER_URL_ENV, OPENLINEAGE_API_KEY_ENV, OPENLINEAGE_URL_ENV, Settings
from export_ledger.spec import ExportSpec

_FROM_SETTINGS = object()  # an argument left to the settings (where None has a meaning of its own)
#: The declared exports of each code location, by its reconciliation sensor: a sensor is carried whole into merged
#: Definitions, so :func:`declared_exports` finds them wherever the Definitions went (``export-ledger -f/-m``).
_DECLARED: weakref.WeakKeyDictionary[dg.SensorDefinition, tuple[ExportSpec, ...]] = weakref.WeakKeyDictionary()


def ledgered_definitions(
    exports: Sequence[ExportSpec],
    *,
    ledger: LedgerResource | None = None,
    destination: Destination | str | None = None,
    settings: Settings | None = None,
    max_partitions_per_run: int | None | object = _FROM_SETTINGS,
    reconcile_batch_size: int = 100,
    stuck_after: dt.timedelta = dt.timedelta(hours=6),
    drift_lookback_days: int = DEFAULT_LOOKBACK_DAYS,
    drift_batch_size: int = DEFAULT_DRIFT_BATCH,
    drift_sensor_running: bool = False,
    assets: Sequence = (),
    environ: Mapping[str, str] | None = None,
) -> dg.Definitions:
    """A code location: per export a pool and, per zone of its tenants, an asset with its checks, a job and a nightly
    schedule; one ledger, one reconciliation sensor and one drift sensor (stopped by default) for all of them.

    Args:
        exports: The declared exports (names unique). An export without a source is exported from an asset of your
            own, passed in ``assets``, whose ``io_manager_key`` is ``f"{name}__io_manager"``.
        ledger: A ready ledger resource; default from the settings (``EXPORTS_LEDGER_URL`` or ``./var/ledger.sqlite3``;
            that file is this host's alone, so it is refused beside a destination on an object store or a Delta
            table on a URL: set ``EXPORTS_LEDGER_URL`` or pass a ledger).
            ``EXPORTS_LEDGER_URL`` read from the process environment is passed to Dagster by name (``EnvVar``); a
            ledger URL with a password given as a value (a ``LedgerResource``'s url, or read from ``environ``) is
            refused, because Dagster shows resource config values in its UI.
        destination: The default destination (a spec or a destination object); default from the settings
            (``EXPORTS_DESTINATION`` or ``./var/exports``). An export's own ``destination`` wins over it. A
            destination object's secrets (``secret_access_key``, ``azure_account_key``, ``azure_sas_token``, a URL
            with a password, ...) are passed by name, as ``EnvVar`` of their variable (``AWS_SECRET_ACCESS_KEY``,
            ...), when the process environment holds the same value there, and refused otherwise.
        settings: Settings already read; default :meth:`Settings.from_environment` on ``environ``.
        max_partitions_per_run: Backfills run in chunks of at most this many partitions; None for one run per range;
            default ``EXPORTS_MAX_PARTITIONS_PER_RUN`` or 31.
        reconcile_batch_size: Stuck keys the reconciliation sensor examines per tick.
        stuck_after: Keys unresolved for longer fail ``no_stuck_exports`` and are logged as errors.
        drift_lookback_days: The drift sensor re-checks keys of the last this many business dates per export.
        drift_batch_size: Completed keys the drift sensor re-reads from their source per tick.
        drift_sensor_running: Start the drift sensor by default (it re-reads sources, so it starts stopped).
        assets: Further assets of your own (the producers of exports without a source, their upstreams).
        environ: The environment to read; default ``os.environ`` (secrets are then passed as ``EnvVar``). A secret
            read from a mapping is passed by name where the process environment holds the same value, and refused
            otherwise.

    Example:
        >>> defs = ledgered_definitions([orders, payments])  # doctest: +SKIP
    """
    require_frame_libraries()  # imported on first use (export_ledger.lazy): a missing one is refused here, by name
    if not exports:
        raise ConfigurationError("ledgered_definitions needs at least one export")
    names = [spec.name for spec in exports]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"export names must be unique, got {names}")
    settings = settings or Settings.from_environment(environ)
    secrets_by_name = environ is None  # reading the process environment: hand secrets over by name

    implicit_ledger = ledger is None and settings.ledger_is_implicit
    if ledger is None:
        url = settings.ledger_url
        if settings.ledger_url_from_env and (secrets_by_name or _held_by_process(LEDGER_URL_ENV, settings)):
            url = dg.EnvVar(LEDGER_URL_ENV)
        ledger = LedgerResource(
            url=url,
            lease_ttl_seconds=settings.lease_ttl_seconds,
            allow_below_low_water=settings.allow_below_low_water,
        )
    _refuse_secret_ledger_url(ledger.url)
    if max_partitions_per_run is _FROM_SETTINGS:
        max_partitions_per_run = settings.max_partitions_per_run
    policy = (
        dg.BackfillPolicy.single_run()
        if max_partitions_per_run is None
        else dg.BackfillPolicy.multi_run(max_partitions_per_run=max_partitions_per_run)
    )

    lineage = _lineage_fields(settings)
    resources: dict = {LEDGER_KEY: ledger}
    for spec in exports:
        _refuse_secret_source_fields(spec)
    # A source declared as a resource is one of the location's: each run, tick and command resolves it there.
    resources.update({source_key(spec): spec.source for spec in exports if isinstance(spec.source, SourceResource)})
    definitions: list = list(assets)
    checks, jobs, schedules, health_jobs = [], [], [], []
    ledger_tables: dict[str, list[tuple[str, str]]] = {}  # table -> (export, its role there)
    for spec in exports:
        spec_destination = spec.destination or destination or settings.destination
        what = (
            f"destination of export {spec.name}" if spec.destination
            else "the destination argument" if destination else "EXPORTS_DESTINATION"
        )  # fmt: skip
        resource = _destination_resource(spec_destination, ledger, settings, secrets_by_name, what)
        if implicit_ledger:
            _refuse_private_ledger(spec.name, resource.spec, what)
        table = resource.spec.removeprefix("ledger-table:") if resource.spec.startswith("ledger-table:") else None
        if table is not None:
            for role, name in SqlTableDestination(url="", table=table).tables_for(spec.name).items():
                ledger_tables.setdefault(name, []).append((spec.name, role))
        problem = SqlTableDestination.check_export(resource.spec, spec.name) if table is not None else None
        if problem:  # checked with the export's own name: every run would fail on it (issue 26)
            raise ConfigurationError(f"{what} {resource.spec!r}: {problem}")
        pool = f"{_pool_kind(spec_destination)}-{spec.name}"
        destination_key, io_manager_key = resource_keys(spec)
        resources[destination_key] = resource
        resources[io_manager_key] = LedgeredExportIOManager(
            ledger=ledger,
            destination=resource,
            file_format=spec.file_format,
            export=spec.name,
            tenants_by_asset=json.dumps({g.asset_name: _members(g) for g in spec.groups}),
            columns=dict(spec.schema.columns),
            time_column=spec.schema.time_column,
            id_columns=list(spec.schema.id_columns),
            tenant_column=spec.schema.tenant_column,
            order_by=list(spec.schema.order_by),
            nullable=sorted(spec.schema.nullable),
            timezone=spec.timezone,
            start_date=spec.start_date,
            version=None if spec.version is None else str(spec.version),
            **lineage,
        )
        # One asset, job and schedule per zone of the export: a Dagster partitions definition has one zone.
        for group in spec.groups:
            if spec.source is not None:
                definitions.append(
                    build_export_asset(
                        spec, pool=pool, backfill_policy=policy, group=group, stuck_after=stuck_after,
                        destination_scheme=_scheme(spec_destination),
                    )
                )  # fmt: skip
                # The export's step alone, for its partition_health check: nothing exported, judged from the ledger and
                # the destination.
                health_jobs.append(
                    dg.define_asset_job(
                        health_job_name(group.asset_name),
                        selection=dg.AssetSelection.checks(
                            dg.AssetCheckKey(dg.AssetKey(group.asset_name), HEALTH_CHECK_NAME)
                        ),
                        description=f"partition_health of {group.asset_name}, run by partition_health_sensor",
                    )
                )
            else:
                # An asset of the user's own: its no_stuck_exports can only be a check defined beside it.
                checks.append(build_stuck_check(spec, stuck_after, asset_name=group.asset_name))
            job = dg.define_asset_job(
                f"{group.asset_name}_job",
                selection=job_selection(group.asset_name, drift_check=spec.source is not None),
            )
            jobs.append(job)
            if group.schedule_time is not None:
                schedules.append(build_nightly_schedule(job, spec, group))
    _refuse_shared_tables(ledger_tables)
    sensor = build_reconciliation_sensor(exports, jobs, batch_size=reconcile_batch_size, stuck_after=stuck_after)
    _DECLARED[sensor] = tuple(exports)
    sensors = [sensor]
    if health_jobs:
        sensors.append(build_health_sensor(exports, health_jobs, stuck_after=stuck_after))
    if any(spec.source is not None for spec in exports):
        sensors.append(
            build_drift_sensor(
                exports, lookback_days=drift_lookback_days, batch_size=drift_batch_size, running=drift_sensor_running
            )
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        return dg.Definitions(
            assets=definitions,
            asset_checks=checks,
            jobs=[*jobs, *health_jobs],
            schedules=schedules,
            sensors=sensors,
            resources=resources,
        )


def declared_exports(defs: dg.Definitions) -> list[ExportSpec]:
    """The exports declared to :func:`ledgered_definitions` in ``defs`` (also after ``Definitions.merge``), in order.

    Raises:
        ConfigurationError: ``defs`` holds no export built by :func:`ledgered_definitions`.
    """
    found = [spec for sensor in defs.sensors or () if sensor in _DECLARED for spec in _DECLARED[sensor]]
    if not found:
        raise ConfigurationError("these Definitions declare no export: they were not built by ledgered_definitions")
    return found


def _scheme(spec: Destination | str) -> str:
    """The destination's scheme name (``local``, ``s3``, ``ledger-table``): the asset's kind of store."""
    return _pool_kind(spec).removeprefix("exports-")


def _members(group) -> list:
    """A group's tenants for the I/O manager's config: ``[tenant, first date or null, last date or null]``."""
    return [[tenant, first and first.isoformat(), last and last.isoformat()] for tenant, first, last in group.spans]


def _pool_kind(spec: Destination | str) -> str:
    """exports-local, exports-s3 or exports-ledger-table: one pool family per destination kind."""
    if isinstance(spec, Destination):
        return spec.pool
    return scheme_of(spec).load().pool


def _refuse_private_ledger(export: str, spec: str, what: str) -> None:
    """Refuses the implicit ledger (``./var/ledger.sqlite3``, a file of this host's) for a destination every host
    writes: an object store or a Delta table on a URL. A run worker whose environment lost ``EXPORTS_LEDGER_URL``
    would export there and record it in a ledger of its own, where no contract check, sensor or operator sees it.
    (A local folder is this host's too, and stays allowed: the Quickstart.)"""
    place = spec.removeprefix("delta:")
    if "://" not in place or place.startswith("file://"):
        return
    scheme = spec[: len(spec) - len(place)] + place.split("://", 1)[0] + "://"
    raise ConfigurationError(
        f"export {export} goes to {scheme} ({what}), a store every host writes, but {LEDGER_URL_ENV} is not set: "
        "the ledger would be ./var/ledger.sqlite3 in the working directory, a file of this host's alone, so a run "
        "worker would record its exports where no other worker, sensor or operator sees them. Set "
        f"{LEDGER_URL_ENV} to the shared ledger (the same in the code location, the daemon and every run worker), or "
        "pass ledger=LedgerResource(url=...) in code"
    )


def _refuse_shared_tables(ledger_tables: Mapping[str, Sequence[tuple[str, str]]]) -> None:
    """Refuses two exports whose ``ledger-table:`` destinations resolve to one table: a rows table, ``_manifests`` or
    ``_revisions`` table of one is one of the other's (``t_{export}`` for exports ``inv`` and ``inv_manifests``), and
    every run of both would fail on the other's table."""
    for table, users in ledger_tables.items():
        if len(users) > 1:
            roles = ", ".join(f"{export}'s {role} table" for export, role in users)
            raise ConfigurationError(
                f"exports {[export for export, _ in users]} would share the ledger table {table!r} ({roles}); give "
                "each export tables of its own (a rows table, with its _manifests and _revisions beside it): for "
                "example ledger-table:exported_{export}, and rename an export or give it a destination of its own "
                "where that still collides"
            )


def _lineage_fields(settings: Settings) -> dict:
    """The I/O managers' OpenLineage fields from the settings the location loads with (none: no events). The URL and
    the API key go to Dagster by name (``EnvVar``) wherever the process environment holds that very value, so the UI
    shows the variables. A URL read from an ``environ`` mapping alone is passed as a value only when it has neither a
    user part nor a query (either may be a token: ``https://t0ken@host/``, ``?auth=...``); otherwise it is refused
    without being quoted."""
    if settings.openlineage_url is None:
        return {}
    url: str | dg.EnvVar = settings.openlineage_url
    if os.environ.get(OPENLINEAGE_URL_ENV) == url:
        url = dg.EnvVar(OPENLINEAGE_URL_ENV)
    elif may_hold_secret(url):  # as an endpoint URL setting is judged (resources.is_secret)
        url = secret_by_name(url, OPENLINEAGE_URL_ENV, f"{OPENLINEAGE_URL_ENV} has a user part or a query")
    fields = {"openlineage_url": url, "openlineage_namespace": settings.openlineage_namespace}
    if settings.environ.get(OPENLINEAGE_API_KEY_ENV):
        fields["openlineage_api_key"] = secret_by_name(
            settings.environ[OPENLINEAGE_API_KEY_ENV], OPENLINEAGE_API_KEY_ENV, f"{OPENLINEAGE_API_KEY_ENV} is a secret"
        )
    return fields


def _held_by_process(variable: str, settings: Settings) -> bool:
    """Whether a secret read from an ``environ`` mapping is also the process environment's own value, so it can be
    passed by name like any secret read from there."""
    value = settings.environ.get(variable)
    return bool(value) and holds_secret(value) and os.environ.get(variable) == value


def _refuse_secret_ledger_url(url: str | dg.EnvVar) -> None:
    """Refuses a ledger URL with a password given as a value: Dagster shows every resource's config values in its UI
    (the ledger's, and each destination's ``ledger_url``), so a secret must reach it by name, as an ``EnvVar``."""
    if isinstance(url, str) and holds_secret(url):
        raise ConfigurationError(
            f"the ledger URL {redact_url(url)!r} holds a password, and given as a value (an argument, a "
            "LedgerResource's url, or EXPORTS_LEDGER_URL read from an environ mapping that the process environment "
            "does not hold) it would be shown in the "
            f"Dagster UI's resource config. Give it by name: set {LEDGER_URL_ENV} in the code location's environment "
            f"and pass neither a URL nor environ (it is then passed as EnvVar({LEDGER_URL_ENV!r})), or pass "
            "LedgerResource(url=dg.EnvVar('YOUR_VARIABLE')), or leave the password out of the URL and let the "
            "driver find it (PostgreSQL: PGPASSWORD or ~/.pgpass)"
        )


def _refuse_secret_source_fields(spec: ExportSpec) -> None:
    """Refuses a source resource's field that holds a password given as a value (``url="postgresql://u:pw@h/db"``):
    Dagster shows every resource's config values in its UI, so a secret must reach it by name, as an ``EnvVar``.
    The value is never quoted."""
    if not isinstance(spec.source, SourceResource):
        return
    for name, value in spec.source.__dict__.items():
        if isinstance(value, str) and not isinstance(value, dg.EnvVar) and holds_secret(value):
            raise ConfigurationError(
                f"export {spec.name}: {type(spec.source).__name__}'s {name} holds a password, and given as a value it "
                f"would be shown in the Dagster UI's resource config. Give it by name: set a variable to it in the "
                f"code location's environment and pass {name}=dg.EnvVar('YOUR_VARIABLE'), or leave the password out "
                "of the URL and let the driver find it (PostgreSQL: PGPASSWORD or ~/.pgpass)"
            )


def _destination_resource(
    spec: Destination | str, ledger: LedgerResource, settings: Settings, by_name: bool, what: str
) -> DestinationResource:
    """The destination's resource. The settings its scheme declares, read from the environment by their variables,
    go by name (``EnvVar``) when that is the process environment; read from an ``environ`` mapping, a secret goes by
    name only where the process environment holds the same value, and is refused otherwise (as the ledger URL is)."""
    if isinstance(spec, Destination):
        ledger_variable = ledger.url.env_var_name if isinstance(ledger.url, dg.EnvVar) else LEDGER_URL_ENV
        return DestinationResource.of(spec, what=what, ledger_variable=ledger_variable)
    # A bad spec or setting fails here, naming it; built with the settings it will run with (an az:// destination
    # needs its account or endpoint, which are settings, not part of the spec).
    destination_from(spec, ledger_url="", environ=settings.environ, what=what)
    given = {}
    for setting in scheme_of(spec).settings:
        found = setting.read(settings.environ)
        if found is None:
            continue
        variable, value = found
        if by_name:
            given[setting.name] = dg.EnvVar(variable)
        elif is_secret(setting, value):
            refusal = f"{variable} (read from the environ mapping) is a secret"
            given[setting.name] = secret_by_name(value, variable, refusal)
        else:
            given[setting.name] = value
    return DestinationResource(spec=spec, ledger_url=ledger.url, settings=given)
