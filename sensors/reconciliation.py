"""The reconciliation sensor: finds stuck keys and resolves them from the destination's evidence.

The decisions live in :mod:`resources.reconcile` (plain Python); this module turns a report into Dagster's
vocabulary: materialization events for keys found completed, run requests for partitions whose write never
landed, a failing asset check while keys stay stuck too long, and a skip reason that says why nothing happened.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections import defaultdict

import dagster as dg

from assets.calendar import ExportCalendar
from assets.invoices import stuck_check_evaluation
from assets.windows import CalendarError, utc_iso
from resources.destinations import Destination
from resources.ledger import ExportLedger
from resources.ledger_resource import LedgerResource
from resources.reconcile import ReconcileReport, reconcile_batch
from resources.schema import ExportState

_NOTHING_STUCK = hashlib.sha256(b"").hexdigest()[:16]


def sensor_result(
    report: ReconcileReport,
    calendar: ExportCalendar,
    asset_key: dg.AssetKey,
    log,
) -> tuple[list[dg.RunRequest], list[dg.AssetMaterialization], list[str]]:
    """Run requests, materialization events and notes from one reconciliation pass. Pure apart from logging."""
    events = []
    for finding, record in report.resolved:
        if record.state is ExportState.COMPLETED:
            events.append(
                dg.AssetMaterialization(
                    asset_key=asset_key,
                    partition=record.business_date.isoformat(),
                    metadata={
                        "logical_key": record.logical_key,
                        "location": record.location,
                        "sha256": record.sha256,
                        "rows": record.row_count,
                        "committed_attempt": record.committed_attempt,
                        "reconciled": finding.detail,
                    },
                    description="recorded by reconciliation from the destination's evidence",
                )
            )
        elif record.state is ExportState.CONFLICT:
            log.error(f"{record.logical_key}: conflict at the destination, nothing overwritten: {finding.detail}")

    generations: dict[str, int] = defaultdict(int)
    for record in report.resolved_to(ExportState.FAILED):
        partition = record.business_date.isoformat()
        try:
            calendar.window(partition)  # Dagster does not validate partition keys in run requests: we do
        except CalendarError as exc:
            log.error(f"{record.logical_key}: not rerun: {exc}")
            continue
        generations[partition] = max(generations[partition], record.fencing_token)
    requests = [
        dg.RunRequest(
            partition_key=partition,
            # Dagster never relaunches a run key it has seen: the fencing token makes each retry's key new.
            run_key=f"reconcile/{asset_key.to_user_string()}/{partition}/{generation}",
            tags={"export-ledger/reconciled": "true"},
        )
        for partition, generation in sorted(generations.items())
    ]
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
    return requests, events, notes


def build_reconciliation_sensor(
    job: dg.UnresolvedAssetJobDefinition,
    calendar: ExportCalendar,
    asset_key: dg.AssetKey,
    *,
    batch_size: int = 100,
    stuck_after: dt.timedelta = dt.timedelta(hours=6),
    minimum_interval_seconds: int = 60,
) -> dg.SensorDefinition:
    """Each tick reconciles at most ``batch_size`` stuck keys, continuing where the previous tick stopped."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")

    @dg.sensor(
        name="reconciliation_sensor",
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Resolves remote_unknown and abandoned in_progress exports from the destination's evidence.",
    )
    def reconciliation_sensor(
        context: dg.SensorEvaluationContext, ledger: LedgerResource, destination: Destination
    ) -> dg.SensorResult:
        state = json.loads(context.cursor) if context.cursor else {}
        book: ExportLedger = ledger.get_ledger()
        report = reconcile_batch(
            book,
            destination,
            limit=batch_size,
            after=state.get("after"),
            reconciler=f"reconciliation_sensor@{utc_iso(book.now())}",
        )
        requests, events, notes = sensor_result(report, calendar, asset_key, context.log)

        stuck = book.stuck_longer_than(stuck_after)
        stuck_keys = sorted(r.logical_key for r in stuck)
        digest = hashlib.sha256("\n".join(stuck_keys).encode()).hexdigest()[:16]
        checks = []
        if stuck:
            context.log.error(
                f"{len(stuck)} export key(s) stuck longer than {stuck_after}: {', '.join(stuck_keys[:10])}"
            )
        if digest != state.get("stuck_digest", _NOTHING_STUCK):
            checks.append(stuck_check_evaluation(asset_key, stuck, stuck_after))  # only when the set changes

        cursor = json.dumps({"after": report.next_after, "stuck_digest": digest})
        if not requests and not events and not checks:
            looked = len(report.findings)
            reason = "; ".join(notes) if notes else f"no stuck export keys ({looked} examined)"
            return dg.SensorResult(skip_reason=reason, cursor=cursor)
        for note in notes:
            context.log.warning(note)
        return dg.SensorResult(run_requests=requests, asset_events=[*events, *checks], cursor=cursor)

    return reconciliation_sensor
