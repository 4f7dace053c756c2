"""The reconciliation sensor: finds stuck keys of every export and resolves them from the destination's evidence.

The decisions live in :mod:`export_ledger.reconcile` (plain Python); this module turns a report into Dagster's
vocabulary: materialization events for keys found completed, run requests for partitions whose write never
landed, a failing asset check while keys stay stuck too long, and a skip reason that says why nothing happened.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence

import dagster as dg

from export_ledger.calendar import utc_iso
from export_ledger.dagster.assets import LEDGER_KEY, resource_keys, stuck_check_evaluation
from export_ledger.errors import CalendarError
from export_ledger.ledger import ExportLedger, ExportState
from export_ledger.reconcile import ReconcileReport, reconcile_batch
from export_ledger.spec import ExportSpec

_NOTHING_STUCK = hashlib.sha256(b"").hexdigest()[:16]


def sensor_result(
    report: ReconcileReport,
    *,
    ledger: ExportLedger,
    exports: Mapping[str, ExportSpec],
    materialized: Callable[[dg.AssetKey, Sequence[str]], set[str]],
    log,
) -> tuple[list[dg.RunRequest], list[dg.AssetMaterialization], list[str]]:
    """Run requests, materialization events and notes from one reconciliation pass over every export."""
    requests: list[dg.RunRequest] = []
    events: list[dg.AssetMaterialization] = []
    for name, spec in exports.items():
        mine = ReconcileReport(resolved=[(f, r) for f, r in report.resolved if r.export == name])
        if mine.resolved:
            more_requests, more_events = _export_result(
                mine, ledger=ledger, spec=spec, materialized=materialized, log=log
            )
            requests.extend(more_requests)
            events.extend(more_events)
    return requests, events, _notes(report)


def _export_result(
    report: ReconcileReport,
    *,
    ledger: ExportLedger,
    spec: ExportSpec,
    materialized: Callable[[dg.AssetKey, Sequence[str]], set[str]],
    log,
) -> tuple[list[dg.RunRequest], list[dg.AssetMaterialization]]:
    """Run requests, materialization events and notes from one reconciliation pass.

    Decided per partition, since a partition is what Dagster materializes: once every tenant's key of a partition is
    completed and Dagster never saw it materialized (its run failed on some key), one event records it; when a key
    was found never written, the partition is rerun (completed tenants are skipped by the run itself).
    """
    export, calendar, tenants = spec.name, spec.calendar, spec.tenants
    asset_key = dg.AssetKey(export)
    touched: set[str] = set()
    for finding, record in report.resolved:
        touched.add(record.business_date.isoformat())
        if record.state is ExportState.COMPLETED and finding.record.lease_owner:
            # The attempt that left this key unknown may have completed other keys before its run failed: those
            # partitions were never recorded as materialized either.
            touched.update(
                r.business_date.isoformat()
                for r in ledger.committed_by(finding.record.lease_owner)
                if r.export == export
            )
        elif record.state is ExportState.CONFLICT:
            log.error(f"{record.logical_key}: conflict at the destination, nothing overwritten: {finding.detail}")

    days: dict[str, dt.date] = {}
    for partition in sorted(touched):
        try:
            days[partition] = calendar.window(partition).business_date  # Dagster does not validate partition keys
        except CalendarError as exc:
            log.error(f"partition {partition!r} not rerun or recorded: {exc}")
    # One grouped read for every touched day, over the configured tenants only: a tick costs what it touched.
    summaries = ledger.day_summaries(
        export=export, timezone=calendar.timezone, days=list(days.values()), tenants=tenants, waiting=_WAIT_STATES
    )
    requests, complete = [], []
    for partition, day in days.items():
        summary = summaries.get(day)
        if summary is not None and summary.completed == len(tenants):
            complete.append(partition)
        elif summary is not None and summary.waiting:
            continue  # a run is in flight, an outcome is still unknown, or an operator must resolve a conflict
        else:
            # Dagster never relaunches a run key it has seen. Every claim raises a key's fencing token, so the sum over
            # the partition's keys grows with each attempt: a later failure of the same partition gets a new run key.
            generation = summary.tokens if summary is not None else 0
            requests.append(
                dg.RunRequest(
                    partition_key=partition,
                    run_key=f"reconcile/{asset_key.to_user_string()}/{partition}/{generation}",
                    job_name=f"{export}_job",
                    tags={"export-ledger/reconciled": "true"},
                )
            )

    events = []
    seen = materialized(asset_key, complete)
    unrecorded = [p for p in complete if p not in seen]  # their run failed on some key: Dagster never recorded them
    if unrecorded:
        order = {tenant: i for i, tenant in enumerate(tenants)}
        by_day: dict[dt.date, list] = {days[p]: [] for p in unrecorded}
        for record in ledger.records(
            export=export, timezone=calendar.timezone, business_dates=list(by_day), tenants=tenants
        ):
            by_day[record.business_date].append(record)
        for partition in unrecorded:
            done = sorted(by_day[days[partition]], key=lambda r: order[r.tenant])
            events.append(
                dg.AssetMaterialization(
                    asset_key=asset_key,
                    partition=partition,
                    metadata={
                        "logical_keys": dg.MetadataValue.json([r.logical_key for r in done]),
                        "rows": sum(r.row_count for r in done),
                        "sha256": dg.MetadataValue.json({r.logical_key: r.sha256 for r in done}),
                        "paths": dg.MetadataValue.json({r.logical_key: r.location for r in done}),
                        "committed_attempts": dg.MetadataValue.json(sorted({r.committed_attempt for r in done})),
                    },
                    description="recorded by reconciliation from the destination's evidence",
                )
            )

    return requests, events


def _notes(report: ReconcileReport) -> list[str]:
    notes = []
    if report.unreachable:
        notes.append(
            f"destination unreachable for {len(report.unreachable)} stuck key(s), left unchanged: "
            f"{report.unreachable[0].detail}"
        )
    conflicts = report.resolved_to(ExportState.CONFLICT)
    if conflicts:
        notes.append(f"{len(conflicts)} key(s) found in conflict at the destination; an operator must resolve them")
    if report.changed_meanwhile:
        notes.append(f"{len(report.changed_meanwhile)} key(s) changed by an attempt meanwhile, left to it")
    if report.unknown_exports:
        notes.append(
            f"{len(report.unknown_exports)} stuck key(s) belong to exports this code location does not declare "
            f"({', '.join(sorted(report.unknown_exports))}); left unchanged"
        )
    return notes


_WAIT_STATES = (ExportState.IN_PROGRESS, ExportState.REMOTE_UNKNOWN, ExportState.CONFLICT)


def _materialized(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partitions: Sequence[str]) -> set[str]:
    """Which of ``partitions`` Dagster has a materialization of: one paged read, not one query per partition."""
    found: set[str] = set()
    cursor = None
    while partitions:
        page = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=list(partitions)), limit=1000, cursor=cursor
        )
        found.update(record.partition_key for record in page.records)
        if not page.has_more:
            break
        cursor = page.cursor
    return found


def build_reconciliation_sensor(
    exports: Sequence[ExportSpec],
    jobs: Sequence[dg.UnresolvedAssetJobDefinition],
    *,
    batch_size: int = 100,
    stuck_after: dt.timedelta = dt.timedelta(hours=6),
    minimum_interval_seconds: int = 60,
) -> dg.SensorDefinition:
    """One sensor for every export of the code location. Each tick reconciles at most ``batch_size`` stuck keys,
    continuing where the previous tick stopped, probing each key's own export's destination."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    by_name = {spec.name: spec for spec in exports}
    destination_keys = {spec.name: resource_keys(spec)[0] for spec in exports}

    @dg.sensor(
        name="reconciliation_sensor",
        jobs=list(jobs),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        required_resource_keys={LEDGER_KEY, *destination_keys.values()},
        description="Resolves remote_unknown and abandoned in_progress exports from the destination's evidence.",
    )
    def reconciliation_sensor(context: dg.SensorEvaluationContext, **_resources) -> dg.SensorResult:
        # Resources come from context.resources; a direct call (tests) also passes them by key, unused here.
        state = json.loads(context.cursor) if context.cursor else {}
        book: ExportLedger = getattr(context.resources, LEDGER_KEY).get_ledger()
        destinations = {
            name: getattr(context.resources, key).get_destination() for name, key in destination_keys.items()
        }
        report = reconcile_batch(
            book,
            destinations,
            limit=batch_size,
            after=state.get("after"),
            reconciler=f"reconciliation_sensor@{utc_iso(book.now())}",
        )
        requests, events, notes = sensor_result(
            report,
            ledger=book,
            exports=by_name,
            materialized=lambda key, partitions: _materialized(context.instance, key, partitions),
            log=context.log,
        )

        stuck = [r for r in book.stuck_longer_than(stuck_after) if r.export in by_name]
        stuck_keys = sorted(r.logical_key for r in stuck)
        digest = hashlib.sha256("\n".join(stuck_keys).encode()).hexdigest()[:16]
        checks = []
        if stuck:
            context.log.error(
                f"{len(stuck)} export key(s) stuck longer than {stuck_after}: {', '.join(stuck_keys[:10])}"
            )
        if digest != state.get("stuck_digest", _NOTHING_STUCK):
            # Only when the set changes: one verdict per export.
            for name in by_name:
                mine = [r for r in stuck if r.export == name]
                checks.append(stuck_check_evaluation(dg.AssetKey(name), mine, stuck_after))

        cursor = json.dumps({"after": report.next_after, "stuck_digest": digest})
        if not requests and not events and not checks:
            looked = len(report.findings)
            reason = "; ".join(notes) if notes else f"no stuck export keys ({looked} examined)"
            return dg.SensorResult(skip_reason=reason, cursor=cursor)
        for note in notes:
            context.log.warning(note)
        return dg.SensorResult(run_requests=requests, asset_events=[*events, *checks], cursor=cursor)

    return reconciliation_sensor


def job_selection(export: str) -> dg.AssetSelection:
    """The export and its per-run check; ``no_stuck_exports`` is reported by the reconciliation sensor."""
    return dg.AssetSelection.assets(export) - dg.AssetSelection.checks(
        dg.AssetCheckKey(dg.AssetKey(export), "no_stuck_exports")
    )
