"""The asset factory: one ledgered export asset per declared export (per zone of its tenants). Its checks are in
:mod:`export_ledger.dagster.checks`."""

import datetime as dt
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator

import dagster as dg

from export_ledger.calendar import ExportCalendar, parse_business_date, utc_iso
from export_ledger.dagster.checks import PARTITION_CHECKS, check_specs, partition_tenants, step_verdicts
from export_ledger.dagster.io_manager import LISTED_KEYS, status_command
from export_ledger.dagster.partitions import dagster_disagreement, partitions_def
from export_ledger.dagster.resources import LEDGER_KEY, SourceResource, resolved_spec, resource_keys, source_key
from export_ledger.errors import ConfigurationError, safe_message
from export_ledger.frames import FrameBatches
from export_ledger.keys import LogicalKey
from export_ledger.ledger import (
    ExportLedger,
    ExportState,
    RestatementRefused,
)
from export_ledger.protocol import ExportBatch, ExportItem
from export_ledger.restate import request_each
from export_ledger.sources import ResolvableSource, UnusableSource
from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup, run_scope, zone_slug

#: The run tag that scopes a run, or every run of a backfill, to some tenants of the asset: their ids separated by
#: commas. From the UI: the Materialize dialog's *Tags -> Add tags*. Same as the run config's ``tenants``.
TENANTS_TAG = "export-ledger/tenants"


class ExportRunConfig(dg.Config):
    """Run config of an export asset: a restatement launched from the UI (the launchpad), with its reason required.

    Schedules, backfills and sensor runs pass no config: the defaults change nothing.

    Attributes:
        tenants: Export only these tenants of the asset (each must be one, else the run is refused before anything
            is done); empty: every tenant. A backfill launched from the UI is scoped by the run tag
            :data:`TENANTS_TAG` instead (the Materialize dialog sets tags, not config); given both, they must agree.
            The partition's ``partition_health`` still judges every tenant of the date: a date exported for one
            tenant shows the others it is missing.
        restate_reason: Why the run's partitions are restated. Non-empty: before exporting, a restatement request
            (asked by this run's id) is recorded for each completed key of the run's partitions (only
            ``restate_tenants``' when listed), so the run publishes their next revision beside the current one. A key
            that is not completed is not restated (it has no revision yet: the run gives it its first export) and a
            key that already has an open request keeps that request and its reason; each is logged, not refused, so
            a partition with one failed tenant can still be restated and completed in one run.
        restate_tenants: Restate only these tenants' keys (each must be a tenant of this asset, else the run is
            refused before anything is done); empty: every tenant of the asset. Needs ``restate_reason``.
    """

    restate_reason: str = ""
    restate_tenants: list[str] = []
    tenants: list[str] = []


def build_export_asset(
    spec: ExportSpec,
    *,
    pool: str,
    backfill_policy: dg.BackfillPolicy | None = None,
    group: TenantGroup | None = None,
    stuck_after: dt.timedelta = dt.timedelta(hours=6),
    max_attempts: int = 3,
    destination_scheme: str | None = None,
) -> dg.AssetsDefinition:
    """The asset of one zone of the export (``group``; default its only one): for each partition in the run and each
    tenant of the zone, exactly the rows of the tenant's window.

    The asset plans (which keys, which windows, which are already done: those are skipped before the source is
    read) and reads the source; the export's I/O manager claims, publishes and records each key. A tenant whose
    calendar contract changed unaccepted is left out and the run fails naming it, after the others are exported.

    Its checks are its own (:func:`~export_ledger.dagster.checks.check_specs`), reported by its one step for the
    checks the run selected: once every key is recorded, each partition of the run gets its ``partition_health``
    verdict, judged from the ledger and from what the run read and wrote, and targeting the partition's
    materialization. A failed key fails the step (so Dagster marks its partitions
    failed), after every partition's verdicts are reported. Run for its checks alone (the health sensor's run, a
    check executed from the UI), the step exports nothing and judges from the ledger and the destination.
    """
    if spec.source is None:
        raise ValueError(f"export {spec.name!r} has no source: declare its asset yourself with ledgered_io_manager")
    group = group or _only_group(spec)
    destination_key, io_manager_key = resource_keys(spec)
    # A source declared as a resource is resolved in the step, by the run worker, from the settings it has.
    source_resource = source_key(spec) if isinstance(spec.source, SourceResource) else None
    calendar = ExportCalendar(group.timezone, spec.start_date)
    partitions = partitions_def(calendar, group.last_date)
    calendars = {tenant: spec.calendar_for(tenant) for tenant in group.tenants}
    several = len(spec.groups) > 1
    asset_key = dg.AssetKey(group.asset_name)

    # Backfill policies are a beta Dagster API; the chunking they give is the documented way to bound backfills.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        asset = dg.AssetSpec(
            key=asset_key,
            group_name=spec.name if several else None,
            tags={"export-ledger/export": spec.name, "export-ledger/zone": zone_slug(group.timezone)},
            description=_description(spec, group),
            kinds=asset_kinds(spec, destination_scheme),
            freshness_policy=freshness_policy(spec, group),
            owners=list(spec.owners) or None,
            metadata={"dagster/column_schema": column_schema(spec)},
        ).with_io_manager_key(io_manager_key)
        asset_decorator = dg.multi_asset(
            name=group.asset_name,
            specs=[asset],
            # Declared here, not as @asset_check definitions: a check defined apart is a step (and a process) of its
            # own in every run that selects the export, and judges later, apart from the run that knows the answer.
            check_specs=check_specs(asset_key, partitions),
            # Any subset of the asset and its checks runs as this one step: the export's job leaves out the whole
            # asset's checks (the sensors report them), the health sensor's job runs partition_health alone.
            can_subset=True,
            partitions_def=partitions,
            backfill_policy=backfill_policy,
            pool=pool,
            required_resource_keys={LEDGER_KEY, destination_key, *([source_resource] if source_resource else [])},
        )

    @asset_decorator
    def _export(context: dg.AssetExecutionContext, config: ExportRunConfig) -> Iterator:
        book = getattr(context.resources, LEDGER_KEY).get_ledger()
        destination = getattr(context.resources, destination_key).get_destination()
        selected = {key.name for key in context.selected_asset_check_keys}
        verdicts = functools.partial(
            step_verdicts, context.instance, spec, group, book, destination, selected, stuck_after=stuck_after,
            max_attempts=max_attempts,
        )  # fmt: skip
        if asset_key not in context.selected_asset_keys:
            # Its checks alone: nothing is exported, each selected check is judged from the ledger (and the
            # destination, for partition_health).
            _log_events(context, verdicts(_checked_days(context, spec, group, calendar, selected)))
            yield from _check_outputs(context)
            return
        try:
            _refuse_source_config(context, spec, source_resource)
            resource = None if source_resource is None else getattr(context.resources, source_resource)
            run_spec = spec if resource is None else resolved_spec(spec, resource)
            batch, tenants_by_day, only = _plan(context, run_spec, config, book, destination)
        except Exception:
            # Refused before anything was exported (a bad launchpad config, an unreadable ledger, a source that cannot
            # be resolved): the run's checks are planned for its partitions, and a check left planned shows each date
            # "execution failed" though nothing changed. The ledger holds the truth: its verdicts are reported, then
            # the error is raised.
            _report_or_warn(context, lambda: verdicts(_checked_days(context, spec, group, calendar, selected)))
            raise
        if only is not None:
            # A run of some tenants: each date of the run is judged for every tenant of it (the others' missing or
            # failed keys show there), a date where the run itself has no key too.
            days = [calendar.window(key).business_date for key in context.partition_keys]
            whole = {day: partition_tenants(spec, group, calendar, day) for day in days}
            verdicts = functools.partial(verdicts, health_days={day: ts for day, ts in whole.items() if ts})
        # A failed key fails the step inside the I/O manager, and this code never runs again: it reports the run's
        # verdicts from there first (every partition's, the finished ones' materializations recorded by then; the
        # ledger's, when it failed before exporting anything).
        batch.on_failure = lambda exported: _log_events(context, verdicts(tenants_by_day, batch if exported else None))
        yield dg.MaterializeResult(asset_key=asset_key, value=batch)
        # The I/O manager has published and recorded every key, and Dagster each partition's materialization.
        _log_events(context, verdicts(tenants_by_day, batch))
        yield from _check_outputs(context)

    def _plan(
        context, spec: ExportSpec, config: ExportRunConfig, book, destination
    ) -> tuple[ExportBatch, dict[dt.date, list[str]], tuple[str, ...] | None]:
        """The run's batch (which keys, which windows, which are already done), each date's tenants with a key, and
        the tenants the run is scoped to (None: every tenant of the asset). ``spec`` is the export with its source
        as this run resolved it."""
        # Checked at claim: what this run would export (its calendar, destination, format, schema, source) must be
        # the contract in force for each tenant, else its claims are refused and escalated.
        if isinstance(spec.source, UnusableSource):
            raise ConfigurationError(f"{spec.name}: nothing was exported: {spec.source.reason}")
        only = _scope(context, config, spec, group)  # a bad scope or config is refused before anything is done
        contracts = {tenant: spec.contract(tenant, destination) for tenant in (group.tenants if only is None else only)}
        restate_tenants = _restate_tenants(config, group, only)
        partition_keys = sorted(context.partition_keys)
        first, last = parse_business_date(partition_keys[0]), parse_business_date(partition_keys[-1])
        if restate_tenants is not None:
            _request_restatements(context, book, spec.name, partition_keys, restate_tenants, config)
        # One read for the whole run instead of one per key: a 31-day chunk of 10 tenants is 1 query, not 310.
        known = {
            (r.tenant, r.timezone, r.business_date): r
            for r in book.queries.records(
                export=spec.name,
                date_from=first,
                date_to=last,
                tenants=only if only else (group.tenants if len(group.tenants) < len(spec.tenants) else ()),
            )
        }
        # A completed key with an open restatement request is read again: its claim publishes the next revision.
        restating = {
            r.logical_key
            for r in book.restatements.requests(export=spec.name, date_from=first, date_to=last)
        }
        items: list[ExportItem] = []
        tenants_by_day: dict[dt.date, list[str]] = {}
        absent: list[str] = []  # dates of a scoped run where none of its tenants is this asset's
        for partition_key in partition_keys:
            day = parse_business_date(partition_key)
            window = calendar.window(partition_key)
            disagreement = dagster_disagreement(window, partitions.time_window_for_partition_key(partition_key))
            if disagreement:
                context.log.warning(disagreement)
            planned_skips, skipped_day, restated, here = [], [], [], []
            # The tenants whose business day this date is in this zone: a tenant that moved is exported by its
            # earlier zone's asset for the days before its move, whose windows end with that zone's days.
            for tenant in group.tenants_on(day):
                if only is not None and tenant not in only:
                    continue
                tenant_window = window if calendars[tenant] == calendar else calendars[tenant].window(partition_key)
                if tenant_window.is_empty:
                    # The zone skipped this calendar day; its empty window has no logical key of its own (it would
                    # share the next day's window start), and no event belongs to it.
                    skipped_day.append(tenant)
                    continue
                key = LogicalKey(spec.name, tenant, tenant_window)
                record = known.get((tenant, tenant_window.timezone, tenant_window.business_date))
                if record is not None:
                    key = LogicalKey(spec.name, tenant, record.window)  # the first claim's window is authoritative
                if record is not None and record.state is ExportState.COMPLETED:
                    if record.logical_key not in restating:
                        here.append(ExportItem(key, partition_key, None, contracts[tenant]))
                        planned_skips.append(tenant)
                        continue
                    restated.append(tenant)
                if spec.stream_rows:
                    # Read while it is exported, batch by batch: nothing of it is held here.
                    here.append(
                        ExportItem.streamed(
                            key, partition_key, spec.source, spec.schema, batch_rows=spec.stream_rows,
                            contract=contracts[tenant],
                        )
                    )  # fmt: skip
                    continue
                # Read after the key is claimed: a source failing for one tenant fails that tenant's key alone.
                reader = functools.partial(spec.read, tenant, key.window.start_utc, key.window.end_utc)
                here.append(ExportItem(key, partition_key, reader, contracts[tenant]))
            items.extend(here)
            if only is not None and not any(tenant in only for tenant in group.tenants_on(day)):
                absent.append(partition_key)
            if skipped_day:
                context.log.warning(
                    f"{partition_key} does not exist in {calendar.timezone}: empty window, nothing to export for "
                    f"{len(skipped_day)} tenant(s)"
                )
            # The partition's own window first; its keys' counts and table are added when they are recorded.
            metadata = {
                "business_date": partition_key,
                "timezone": calendar.timezone,
                "window_start_utc": utc_iso(window.start_utc),
                "window_end_utc": utc_iso(window.end_utc),
                "window_hours": window.duration.total_seconds() / 3600,
            }
            streamed = sum(isinstance(i.frame, FrameBatches) for i in here)
            if streamed:
                metadata["streamed_keys"] = streamed
            metadata["every_key"] = dg.MetadataValue.text(status_command(spec.name, [partition_key]))
            context.add_asset_metadata(metadata, asset_key=asset_key, partition_key=partition_key)
            if here:  # a day the zone skipped has no key, so no verdict
                tenants_by_day[day] = [item.key.tenant for item in here]
        if absent:
            shown = ", ".join(absent[:5]) + (f", ... ({len(absent)} dates)" if len(absent) > 5 else "")
            context.log.warning(
                f"nothing to export on {shown}: none of the run's tenants ({', '.join(only) or 'none of this asset'}) "
                f"has its business day in {group.timezone} then (a tenant in another zone on a date is exported by "
                "that zone's asset)"
            )
        return ExportBatch(spec.schema, items), tenants_by_day, only

    return _export


def _refuse_source_config(context: dg.AssetExecutionContext, spec: ExportSpec, key: str | None) -> None:
    """Refuses a run whose run config sets the source resource (the launchpad's ``resources.<export>__source``): the
    source is the code location's settings, recorded in each key's contract, not a run's choice; a run config could
    switch a tenant's first run to another source, and a URL typed there is stored in the run's config."""
    if key is None:
        return
    given = (context.run.run_config or {}).get("resources") or {}
    if key in given:
        raise ConfigurationError(
            f"{spec.name}: nothing was exported: the run's config sets resources.{key}, but the source comes from the "
            "code location's settings (the resource's fields, resolved in the run worker): launch the run without it"
        )


def _report_or_warn(context: dg.AssetExecutionContext, evaluations: Callable[[], Iterable[dg.AssetCheckEvaluation]]):
    """Reports the verdicts ``evaluations`` gives on a step about to fail; a failure to judge them is a warning in the
    library's words, never hiding the step's own error."""
    try:
        _log_events(context, evaluations())
    except Exception as exc:
        context.log.warning(f"the run's verdicts on its partitions could not be reported: {safe_message(exc)}")


def _checked_days(
    context: dg.AssetExecutionContext, spec: ExportSpec, group: TenantGroup, calendar: ExportCalendar, selected
) -> dict[dt.date, list[str]]:
    """The run's dates and each one's tenants with a key, for checks run alone; a partitioned check needs a date."""
    if not (context.has_partition_key or context.has_partition_key_range):
        if selected & set(PARTITION_CHECKS):
            raise dg.Failure(f"{', '.join(sorted(selected & set(PARTITION_CHECKS)))}: judged per partition, run them "
                             "for one or more partitions")  # fmt: skip
        return {}
    days = [calendar.window(key).business_date for key in context.partition_keys]
    return {day: partition_tenants(spec, group, calendar, day) for day in days}


def _log_events(context: dg.AssetExecutionContext, evaluations: Iterable[dg.AssetCheckEvaluation]) -> None:
    for evaluation in evaluations:
        context.log_event(evaluation)


def _check_outputs(context: dg.AssetExecutionContext) -> Iterator[dg.Output]:
    """An output for each check the step was asked for: its verdicts were logged per partition (a check result has no
    partition of its own), and Dagster expects the outputs besides. Without them the run logs, every time, that the
    step "did not yield or return expected outputs"."""
    for key in sorted(context.selected_asset_check_keys, key=lambda k: k.name):
        # The output name of a check spec: AssetsDefinition's own mapping (not marked public in Dagster 1.13).
        yield dg.Output(None, output_name=context.assets_def.get_output_name_for_asset_check_key(key))


def _scope(
    context: dg.AssetExecutionContext, config: ExportRunConfig, spec: ExportSpec, group: TenantGroup
) -> tuple[str, ...] | None:
    """The tenants the run exports alone, from its config's ``tenants`` or its :data:`TENANTS_TAG` tag (None: every
    tenant of the asset). Refused, before anything is done, when a name is not the asset's or the two disagree."""
    try:
        only = run_scope(context.run.tags.get(TENANTS_TAG), config.tenants, group, spec.groups)
    except ConfigurationError as exc:
        raise ConfigurationError(f"the run's tenants ({TENANTS_TAG} tag or tenants config): {exc}") from None
    if only is not None:
        shown = ", ".join(only[:10]) + (", ..." if len(only) > 10 else "")
        context.log.info(f"this run exports {len(only)} of the asset's {len(group.tenants)} tenants: {shown or '-'}")
        elsewhere = sorted(set(_scope_names(context, config)) - set(only))
        if elsewhere:
            context.log.warning(
                f"{', '.join(elsewhere[:10])}: tenant(s) of {spec.name} in another zone, exported by that zone's "
                f"asset, not by {group.asset_name}"
            )
    return only


def _scope_names(context: dg.AssetExecutionContext, config: ExportRunConfig) -> list[str]:
    """The tenant names the run's tag and config give, as given (trimmed)."""
    tagged = context.run.tags.get(TENANTS_TAG)
    names = [*(tagged.split(",") if tagged is not None else ()), *config.tenants]
    return [name.strip() for name in names if name.strip()]


def _restate_tenants(
    config: ExportRunConfig, group: TenantGroup, only: tuple[str, ...] | None = None
) -> list[str] | None:
    """The tenants whose keys the run config asks to restate (None: no restatement asked), within the run's tenants
    (``only``; None: every tenant of the asset)."""
    reason = config.restate_reason.strip()
    if not reason:
        if config.restate_tenants:
            raise RestatementRefused(
                f"restate_tenants {config.restate_tenants} given without restate_reason: a restatement needs a reason"
            )
        return None
    unknown = [t for t in config.restate_tenants if t not in group.tenants]
    if unknown:
        raise RestatementRefused(
            f"restate_tenants {unknown} are not tenants of the asset {group.asset_name} (its tenants: "
            f"{', '.join(group.tenants[:10])}{', ...' if len(group.tenants) > 10 else ''}); nothing was restated"
        )
    if only is not None:
        outside = [t for t in config.restate_tenants if t not in only]
        if outside:
            raise RestatementRefused(
                f"restate_tenants {outside} are not among the run's tenants ({', '.join(only)}); nothing was restated"
            )
    return list(config.restate_tenants) or list(group.tenants if only is None else only)


def _request_restatements(
    context: dg.AssetExecutionContext,
    book: ExportLedger,
    export: str,
    partition_keys: list[str],
    tenants: list[str],
    config: ExportRunConfig,
) -> None:
    """Records the run config's restatement requests (asked by the run's id) before the run plans what it reads."""
    if not tenants:
        return
    records = book.queries.records(
        export=export,
        date_from=parse_business_date(partition_keys[0]),
        date_to=parse_business_date(partition_keys[-1]),
        tenants=tenants,
    )
    days = {parse_business_date(p) for p in partition_keys}
    ours = [record for record in records if record.business_date in days]
    left = [
        f"{r.logical_key} is {r.state.value}: exported by this run, not restated"
        for r in ours
        if r.state is not ExportState.COMPLETED
    ]
    # A key with an open request already is refused by the ledger: that request stands, with its own reason.
    report = request_each(
        book,
        [(r.logical_key, config.restate_reason) for r in ours if r.state is ExportState.COMPLETED],
        requested_by=context.run.run_id,
    )
    requested = [request.logical_key for request in report.requested]
    left += [why for _, why in report.refused]
    context.log.info(
        f"restatement requested for {len(requested)} key(s) ({config.restate_reason.strip()!r}): "
        f"{', '.join(requested[:5])}{', ...' if len(requested) > 5 else ''}"
    )
    for line in left[:LISTED_KEYS]:
        context.log.warning(f"not restated: {line}")
    if len(left) > LISTED_KEYS:
        context.log.warning(f"{len(left) - LISTED_KEYS} more key(s) not restated")


def _only_group(spec: ExportSpec) -> TenantGroup:
    if len(spec.groups) != 1:
        raise ValueError(
            f"export {spec.name!r} has tenants in {len(spec.groups)} zones: build one asset per group (spec.groups)"
        )
    return spec.groups[0]


def _description(spec: ExportSpec, group: TenantGroup) -> str:
    reason = spec.source.problem() if isinstance(spec.source, ResolvableSource) else None
    if reason is not None:
        # Known from the declared settings alone (no environment read): each run resolves them in its own worker.
        return (
            f"{_plain_description(spec, group)} Its source's settings, as this code location declares them, cannot "
            f"be used: {reason}. A run fails naming this unless its run worker has the setting."
        )
    if isinstance(spec.source, UnusableSource):
        # Shown on the asset's page before anyone launches a run that would fail for it. A run worker loads the
        # location again with its own environment: where it has the setting, its run reads the source.
        return (
            f"{_plain_description(spec, group)} Where this code location loaded, its source cannot be used: "
            f"{spec.source.reason}. A run fails naming this unless its run worker has the setting."
        )
    return _plain_description(spec, group)


def _plain_description(spec: ExportSpec, group: TenantGroup) -> str:
    if len(spec.groups) == 1:
        return (
            spec.description
            or f"{spec.name}: each tenant's rows inside the partition's business-day window, exported once."
        )
    shown = ", ".join(group.tenants[:10]) + (", ..." if len(group.tenants) > 10 else "")
    return (
        f"{spec.description or spec.name}. Tenants whose business day is {group.timezone}'s ({len(group.tenants)}: "
        f"{shown}); each tenant's rows inside its window, exported once."
    )


#: Dagster's kind of each column kind (``dagster/column_schema``).
_COLUMN_TYPES = {"string": "string", "float": "float", "int": "int", "timestamp": "timestamp", "bool": "bool"}


def column_schema(spec: ExportSpec) -> dg.TableSchema:
    """The export's columns as Dagster's column schema: file order, kinds, which may be null, which identify a row."""
    schema = spec.schema
    columns = []
    for name, kind in schema.columns.items():
        notes = []
        if name in schema.id_columns:
            notes.append("identifies a row")
        if name == schema.time_column:
            notes.append("places a row in its window")
        columns.append(
            dg.TableColumn(
                name,
                _COLUMN_TYPES.get(kind, kind),
                description="; ".join(notes) or None,
                constraints=dg.TableColumnConstraints(nullable=name in schema.nullable, unique=False),
            )
        )
    return dg.TableSchema(columns=columns)


def freshness_policy(spec: ExportSpec, group: TenantGroup) -> dg.FreshnessPolicy | None:
    """The export's deadline as Dagster's freshness policy of one zone's asset: materialized each day between local
    midnight (the window's end) and the deadline, in the zone. Dagster judges the asset as a whole; which tenant and
    date is late is the ledger's (``no_stuck_exports``, ``partition_health``)."""
    if spec.deadline is None:
        return None
    at = dt.time.fromisoformat(spec.deadline)
    return dg.FreshnessPolicy.cron(
        deadline_cron=f"{at.minute} {at.hour} * * *",
        lower_bound_delta=dt.timedelta(hours=at.hour, minutes=at.minute),
        timezone=group.timezone,
    )


def asset_kinds(spec: ExportSpec, destination_scheme: str | None) -> set[str]:
    """The asset's kinds in the UI: the file format (or ``table``) and where it lands (``s3``, ``file``, ...)."""
    kinds = set()
    if destination_scheme == "ledger-table":
        kinds.add("table")
    else:
        kinds.add(spec.file_format)
    if destination_scheme:
        kinds.add({"local": "file", "ledger-table": "sql"}.get(destination_scheme, destination_scheme))
    return kinds


