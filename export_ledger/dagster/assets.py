"""Asset and check factories: one ledgered export asset per declared export, its per-run check, and the
``no_stuck_exports`` and ``source_unchanged`` checks."""

import datetime as dt
import functools
import warnings
from collections.abc import Iterator, Sequence

import dagster as dg

from export_ledger.calendar import ExportCalendar, parse_business_date, utc_iso
from export_ledger.dagster.io_manager import LISTED_KEYS, status_command
from export_ledger.dagster.partitions import dagster_disagreement, partitions_def
from export_ledger.destinations import Destination, Verdict, place_of_location
from export_ledger.drift import describe
from export_ledger.frames import FrameBatches
from export_ledger.keys import LogicalKey
from export_ledger.ledger import (
    AttentionSummary,
    DriftRecord,
    Escalation,
    ExportLedger,
    ExportState,
    RestatementRefused,
)
from export_ledger.protocol import ExportBatch, ExportItem, ExportResult, target_for
from export_ledger.restate import request_each
from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup, zone_slug

CHECK_NAME = "export_matches_source_and_ledger"
STUCK_CHECK_NAME = "no_stuck_exports"
DRIFT_CHECK_NAME = "source_unchanged"
LEDGER_KEY = "ledger"


class ExportRunConfig(dg.Config):
    """Run config of an export asset: a restatement launched from the UI (the launchpad), with its reason required.

    Schedules, backfills and sensor runs pass no config: the defaults change nothing.

    Attributes:
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


def resource_keys(spec: ExportSpec) -> tuple[str, str]:
    """The resource keys of an export's destination and I/O manager."""
    return f"{spec.name}__destination", f"{spec.name}__io_manager"


def build_export_asset(
    spec: ExportSpec,
    *,
    pool: str,
    backfill_policy: dg.BackfillPolicy | None = None,
    group: TenantGroup | None = None,
) -> dg.AssetsDefinition:
    """The asset of one zone of the export (``group``; default its only one): for each partition in the run and each
    tenant of the zone, exactly the rows of the tenant's window.

    The asset plans (which keys, which windows, which are already done: those are skipped before the source is
    read) and reads the source; the export's I/O manager claims, publishes and records each key. A tenant whose
    calendar contract changed unaccepted is left out and the run fails naming it, after the others are exported.
    """
    if spec.source is None:
        raise ValueError(f"export {spec.name!r} has no source: declare its asset yourself with ledgered_io_manager")
    group = group or _only_group(spec)
    destination_key, io_manager_key = resource_keys(spec)
    calendar = ExportCalendar(group.timezone, spec.start_date)
    partitions = partitions_def(calendar, group.last_date)
    calendars = {tenant: spec.calendar_for(tenant) for tenant in group.tenants}
    contracts = {tenant: calendars[tenant].contract() for tenant in group.tenants}
    several = len(spec.groups) > 1

    # Backfill policies are a beta Dagster API; the chunking they give is the documented way to bound backfills.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        asset_decorator = dg.asset(
            name=group.asset_name,
            partitions_def=partitions,
            io_manager_key=io_manager_key,
            backfill_policy=backfill_policy,
            pool=pool,
            group_name=spec.name if several else None,
            tags={"export-ledger/export": spec.name, "export-ledger/zone": zone_slug(group.timezone)},
            required_resource_keys={LEDGER_KEY, destination_key},
            check_specs=[dg.AssetCheckSpec(CHECK_NAME, asset=group.asset_name)],
            description=_description(spec, group),
        )

    @asset_decorator
    def _export(context: dg.AssetExecutionContext, config: ExportRunConfig) -> Iterator:
        book = getattr(context.resources, LEDGER_KEY).get_ledger()
        destination = getattr(context.resources, destination_key).get_destination()
        restate_tenants = _restate_tenants(config, group)  # a bad config is refused before anything is done
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
                tenants=group.tenants if len(group.tenants) < len(spec.tenants) else (),
            )
        }
        # A completed key with an open restatement request is read again: its claim publishes the next revision.
        restating = {
            r.logical_key
            for r in book.restatements.requests(export=spec.name, date_from=first, date_to=last)
        }
        items: list[ExportItem] = []
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
            if skipped_day:
                context.log.warning(
                    f"{partition_key} does not exist in {calendar.timezone}: empty window, nothing to export for "
                    f"{len(skipped_day)} tenant(s)"
                )
            # Bounded: counts, and the first LISTED_KEYS keys; every key is in the ledger (status_command).
            context.add_asset_metadata(
                {
                    "business_date": partition_key,
                    "timezone": calendar.timezone,
                    "window_start_utc": utc_iso(window.start_utc),
                    "window_end_utc": utc_iso(window.end_utc),
                    "window_hours": window.duration.total_seconds() / 3600,
                    "partition_keys_count": len(here),
                    "partition_logical_keys": dg.MetadataValue.json([str(i.key) for i in here[:LISTED_KEYS]]),
                    "tenants_skipped_already_completed": dg.MetadataValue.json(planned_skips[:LISTED_KEYS]),
                    "tenants_restated": dg.MetadataValue.json(restated[:LISTED_KEYS]),
                    "streamed_keys": sum(isinstance(i.frame, FrameBatches) for i in here),
                    "every_key": dg.MetadataValue.text(status_command(spec.name, [partition_key])),
                },
                partition_key=partition_key,
            )
        batch = ExportBatch(spec.schema, items)
        yield dg.Output(batch)
        # The I/O manager has published and recorded every key by now: check what actually landed.
        yield export_check(spec, book, destination, batch.results, asset_key=group.asset_name)

    return _export


def _restate_tenants(config: ExportRunConfig, group: TenantGroup) -> list[str] | None:
    """The tenants whose keys the run config asks to restate (None: no restatement asked)."""
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
    return list(config.restate_tenants) or list(group.tenants)


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


def export_check(
    spec: ExportSpec,
    ledger: ExportLedger,
    destination: Destination,
    results: list[ExportResult],
    *,
    asset_key: str | None = None,
) -> dg.AssetCheckResult:
    """Each key of the run: completed in the ledger, its current recorded revision intact where it was recorded
    (:meth:`~export_ledger.destinations.Destination.verify_recorded`: its manifest names the key, its data's sha256
    is the ledger's), and its row count the source's."""
    problems: list[str] = []
    for result in results:
        record = ledger.queries.get(result.logical_key)
        if record is None or record.state is not ExportState.COMPLETED:
            problems.append(f"{result.logical_key}: not completed in the ledger")
            continue
        current = ledger.restatements.current_revision(record.logical_key)
        target = target_for(
            LogicalKey(record.export, record.tenant, record.window), current.revision, place_of_location(current.location)
        )
        seen = destination.verify_recorded(target, logical_key=record.logical_key, sha256=current.sha256)
        if seen.verdict is not Verdict.PUBLISHED:
            problems.append(f"{record.logical_key}: {seen.detail}")
            continue
        expected_rows = spec.count(record.tenant, record.window_start_utc, record.window_end_utc)
        if expected_rows is not None and record.row_count != expected_rows:
            problems.append(f"{record.logical_key}: exported {record.row_count} rows, source has {expected_rows}")
    return dg.AssetCheckResult(
        check_name=CHECK_NAME,
        asset_key=asset_key or spec.name,
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"keys_checked": len(results), "problems": dg.MetadataValue.json(problems[:LISTED_KEYS])},
        description="exported row counts equal the source's for each window; each file's sha256 equals the ledger's",
    )


def stuck_check_evaluation(
    asset_key: dg.AssetKey, count: int, escalations: Sequence[Escalation], stuck_after: dt.timedelta
) -> dg.AssetCheckEvaluation:
    """The ``no_stuck_exports`` verdict for one export asset: fails while any of its keys (``count`` of them, the
    first ``escalations`` listed) waits for a person."""
    return dg.AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=STUCK_CHECK_NAME,
        passed=count == 0,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "stuck_keys": count,
            "threshold_hours": stuck_after.total_seconds() / 3600,
            "first_keys": dg.MetadataValue.json(
                [{"logical_key": e.name, "state": e.state, "since": utc_iso(e.since)} for e in escalations[:LISTED_KEYS]]
            ),
            "every_key": dg.MetadataValue.text("export-ledger status --needs-attention"),
        },
        description=(
            f"no key needs a person: none in conflict, none failed with its automatic reruns spent, none failed, "
            f"remote_unknown or abandoned in_progress longer than {stuck_after}, no tenant refused by its calendar"
        ),
    )


def asset_groups(spec: ExportSpec, summary: AttentionSummary) -> dict[str, tuple[int, list[Escalation]]]:
    """A summary's escalations of one export by asset: a key counts on the asset of the zone it was claimed in; a key
    of a zone the export no longer has is reported on its first asset (never dropped)."""
    by_asset: dict[str, tuple[int, list[Escalation]]] = {group.asset_name: (0, []) for group in spec.groups}
    for (export, zone), (count, listed) in summary.groups.items():
        if export != spec.name:
            continue
        group = spec.group_of_zone(zone) if zone is not None else None
        name = (group or spec.groups[0]).asset_name
        before, shown = by_asset[name]
        by_asset[name] = (before + count, (shown + listed)[:LISTED_KEYS])
    return by_asset


def build_stuck_check(
    spec: ExportSpec, stuck_after: dt.timedelta, *, asset_name: str | None = None, max_attempts: int = 3
) -> dg.AssetChecksDefinition:
    """``no_stuck_exports`` of one export's asset (``asset_name``, default the export's) on demand from the UI; the
    reconciliation sensor reports the same verdict each time the set of escalated keys changes. Counted in the
    ledger, whatever the backlog."""
    asset_name = asset_name or spec.name

    @dg.asset_check(
        asset=asset_name,
        name=STUCK_CHECK_NAME,
        description="no export key stuck too long",
        required_resource_keys={LEDGER_KEY},
    )
    def _no_stuck_exports(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        ledger = getattr(context.resources, LEDGER_KEY).get_ledger()
        summary = ledger.attention.summary(stuck_after, max_attempts=max_attempts, exports=[spec.name])
        count, listed = asset_groups(spec, summary)[asset_name]
        evaluation = stuck_check_evaluation(dg.AssetKey(asset_name), count, listed, stuck_after)
        return dg.AssetCheckResult(
            passed=evaluation.passed,
            severity=evaluation.severity,
            metadata=evaluation.metadata,
            description=evaluation.description,
        )

    return _no_stuck_exports


def drift_check_evaluation(
    asset_key: dg.AssetKey, stale: Sequence[DriftRecord], counts: tuple[int, int, int] | None = None
) -> dg.AssetCheckEvaluation:
    """The ``source_unchanged`` verdict for one export asset: fails while any of its keys is stale (counts only:
    ``counts`` is (keys, rows added, rows removed) as the ledger counted them; default: those of ``stale``)."""
    keys, added, removed = counts or (len(stale), sum(r.rows_added for r in stale), sum(r.rows_removed for r in stale))
    return dg.AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=DRIFT_CHECK_NAME,
        passed=keys == 0,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "stale_keys": keys,
            "rows_added": added,
            "rows_removed": removed,
            "first_keys": dg.MetadataValue.json(
                [
                    {
                        "logical_key": r.logical_key,
                        "partition": r.business_date.isoformat(),
                        "rows": describe(r),
                        "since": utc_iso(r.detected_at),
                    }
                    for r in stale[:LISTED_KEYS]
                ]
            ),
            "every_key": dg.MetadataValue.text("export-ledger status --state stale"),
        },
        description=(
            "no completed key's source changed since it was exported (as last checked by drift_sensor); a stale "
            "key is fixed by a restatement (export-ledger restate, or restate_reason in the run config)"
        ),
    )


def build_drift_check(
    export: str, *, asset_name: str | None = None, tenants: Sequence[str] | None = None
) -> dg.AssetChecksDefinition:
    """``source_unchanged`` of one export's asset, on demand from the UI: the stale keys the ledger holds for the
    asset's tenants (what the drift sensor last found; running the check does not re-read the source)."""
    asset_name = asset_name or export
    members = None if tenants is None else set(tenants)

    @dg.asset_check(
        asset=asset_name,
        name=DRIFT_CHECK_NAME,
        description="no exported key's source changed since it was exported",
        required_resource_keys={LEDGER_KEY},
    )
    def _source_unchanged(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        drift = getattr(context.resources, LEDGER_KEY).get_ledger().drift
        tenants = sorted(members) if members is not None else ()
        listed = drift.open_records(export=export, tenants=tenants, limit=LISTED_KEYS)
        evaluation = drift_check_evaluation(dg.AssetKey(asset_name), listed, drift.open_count(export=export, tenants=tenants))
        return dg.AssetCheckResult(
            passed=evaluation.passed,
            severity=evaluation.severity,
            metadata=evaluation.metadata,
            description=evaluation.description,
        )

    return _source_unchanged
