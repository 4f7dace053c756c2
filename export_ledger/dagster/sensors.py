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

from export_ledger.calendar import ExportCalendar, utc_iso
from export_ledger.dagster.assets import LEDGER_KEY, resource_keys, stuck_check_evaluation
from export_ledger.dagster.io_manager import LISTED_KEYS, status_command
from export_ledger.errors import CalendarError
from export_ledger.ledger import ExportLedger, ExportRecord, ExportState, Restatement
from export_ledger.ledger.core import DEFAULT_MAX_ATTEMPTS
from export_ledger.reconcile import ReconcileReport, reconcile_batch
from export_ledger.restate import published_revisions, records_of
from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup

_NOTHING_STUCK = hashlib.sha256(b"").hexdigest()[:16]


def sensor_result(
    report: ReconcileReport,
    *,
    ledger: ExportLedger,
    exports: Mapping[str, ExportSpec],
    materialized: Callable[[dg.AssetKey, Sequence[str]], set[str]],
    log,
    failed: Sequence[ExportRecord] = (),
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> tuple[list[dg.RunRequest], list[dg.AssetMaterialization], list[str]]:
    """Run requests, materialization events and notes from one reconciliation pass over every export.

    ``failed`` are ``failed`` keys the tick looked at (besides those reconciliation just found failed): each partition
    holding one is rerun while the key has had fewer than ``max_attempts`` claims, whatever its siblings are doing
    (the ledger refuses what a rerun may not touch); past that the key is escalated, not rerun.
    """
    events: list[dg.AssetMaterialization] = []
    for name, spec in exports.items():
        mine = ReconcileReport(resolved=[(f, r) for f, r in report.resolved if r.export == name])
        if mine.resolved:
            events.extend(_materializations(mine, ledger=ledger, spec=spec, materialized=materialized, log=log))
    candidates = [*(r for _, r in report.resolved if r.state is ExportState.FAILED), *failed]
    bases = ledger.rerun_bases(sorted({r.logical_key for r in candidates}))
    requests = rerun_requests(candidates, exports, max_attempts=max_attempts, bases=bases, log=log)
    return requests, events, _notes(report)


def _still_exported_by(spec: ExportSpec, record: ExportRecord) -> bool:
    """Whether ``spec`` still exports ``record``'s key: the tenant is declared, in the zone the key was claimed in."""
    return (
        record.tenant in spec.tenants
        and spec.calendar_for(record.tenant).zone_on(record.business_date) == record.timezone
    )


def rerun_requests(
    failed: Sequence[ExportRecord],
    exports: Mapping[str, ExportSpec],
    *,
    max_attempts: int,
    log,
    bases: Mapping[str, int] | None = None,
) -> list[dg.RunRequest]:
    """One run request per partition holding a ``failed`` key with automatic reruns left (fewer than
    ``max_attempts`` claims since its last operator resolution, whose token ``bases`` gives).

    The run key names each such key with its fencing token (``tenant@token``). A key is ``failed`` with a given
    token at most once (every claim raises it), so a new failure always brings a new run key, while the same
    situation seen again on the next tick repeats the key and Dagster launches nothing twice.
    """
    by_partition: dict[tuple[str, str], dict[str, int]] = {}
    for record in failed:
        spec = exports.get(record.export)
        if spec is None or record.state is not ExportState.FAILED:
            continue
        if record.fencing_token - (bases or {}).get(record.logical_key, 0) >= max_attempts:
            continue  # escalated: needs_attention names it, a person decides
        if not _still_exported_by(spec, record):
            log.warning(
                f"{record.logical_key} is failed but its tenant or zone is no longer {spec.name}'s; not rerun "
                "(it is escalated once it waits longer than allowed)"
            )
            continue
        partition = record.business_date.isoformat()
        try:
            spec.calendar_for(record.tenant).window(partition)
        except CalendarError as exc:
            log.error(f"partition {partition!r} of {spec.name} not rerun: {exc}")
            continue
        asset_name = spec.group_of(record.tenant).asset_name  # the asset (zone) that exports this tenant
        by_partition.setdefault((asset_name, partition), {})[record.tenant] = record.fencing_token
    requests = []
    for (asset_name, partition), tokens in sorted(by_partition.items()):
        situation = ",".join(f"{tenant}@{token}" for tenant, token in sorted(tokens.items()))
        digest = hashlib.sha256(situation.encode()).hexdigest()[:16]
        requests.append(
            dg.RunRequest(
                partition_key=partition,
                run_key=f"rerun/{asset_name}/{partition}/{digest}",
                job_name=f"{asset_name}_job",
                tags={"export-ledger/reconciled": "true"},
            )
        )
    return requests


def restatement_requests(
    pending: Sequence[Restatement],
    records: Mapping[str, ExportRecord],
    exports: Mapping[str, ExportSpec],
    *,
    log,
) -> list[dg.RunRequest]:
    """One run request per partition (of one zone's asset) holding a ``completed`` key with an open restatement
    request: the run's claim restates every such key of the partition.

    A request nobody materializes would otherwise stay open for good. The run key names the partition's open requests
    (``restate/<asset>/<partition>/<request id>``, with a digest of the others when there are several): a request is
    launched once, and a new request brings a new key. A key whose restatement is under way, failed or unknown is
    left to the rest of the sensor (the run in flight, the reruns of failed keys, reconciliation).
    """
    by_partition: dict[tuple[str, str], list[int]] = {}
    for request in pending:
        record = records.get(request.logical_key)
        spec = exports.get(request.export)
        if record is None or spec is None or record.state is not ExportState.COMPLETED:
            continue
        if not _still_exported_by(spec, record):
            log.warning(
                f"{record.logical_key} has an open restatement but its tenant or zone is no longer {spec.name}'s; not "
                "launched (withdraw it: export-ledger restate --withdraw)"
            )
            continue
        partition = record.business_date.isoformat()
        by_partition.setdefault((spec.group_of(record.tenant).asset_name, partition), []).append(request.id)
    requests = []
    for (asset_name, partition), ids in sorted(by_partition.items()):
        ids.sort()
        suffix = str(ids[0])
        if len(ids) > 1:
            suffix += "-" + hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:12]
        requests.append(
            dg.RunRequest(
                partition_key=partition,
                run_key=f"restate/{asset_name}/{partition}/{suffix}",
                job_name=f"{asset_name}_job",
                tags={"export-ledger/restatement": "true"},
            )
        )
    return requests


def _materializations(
    report: ReconcileReport,
    *,
    ledger: ExportLedger,
    spec: ExportSpec,
    materialized: Callable[[dg.AssetKey, Sequence[str]], set[str]],
    log,
) -> list[dg.AssetMaterialization]:
    """Decided per partition, since a partition is what Dagster materializes: once every tenant's key of a partition
    of one zone's asset is completed and Dagster never saw it materialized (its run failed on some key), one event
    records it."""
    export = spec.name
    touched: dict[str, set[str]] = {}  # asset name -> partitions
    restated: dict[str, dict[str, dict[str, int]]] = {}  # asset name -> partition -> key -> revision published
    for finding, record in report.resolved:
        if record.tenant in spec.tenants:
            touched.setdefault(spec.group_of(record.tenant).asset_name, set()).add(record.business_date.isoformat())
            if record.state is ExportState.COMPLETED and finding.evidence is not None and finding.evidence.revision > 1:
                # A restatement whose run died after publishing: the partition was materialized before (its earlier
                # revision), but this revision never was.
                partitions = restated.setdefault(spec.group_of(record.tenant).asset_name, {})
                partitions.setdefault(record.business_date.isoformat(), {})[record.logical_key] = (
                    finding.evidence.revision
                )
        if record.state is ExportState.COMPLETED and finding.record.lease_owner:
            # The attempt that left this key unknown may have completed other keys before its run failed: those
            # partitions were never recorded as materialized either.
            for other in ledger.committed_by(finding.record.lease_owner):
                if other.export == export and other.tenant in spec.tenants:
                    touched.setdefault(spec.group_of(other.tenant).asset_name, set()).add(
                        other.business_date.isoformat()
                    )
        elif record.state is ExportState.CONFLICT:
            log.error(f"{record.logical_key}: conflict at the destination, nothing overwritten: {finding.detail}")
    events = []
    for group in spec.groups:
        if group.asset_name in touched:
            events.extend(
                _group_materializations(
                    group,
                    touched[group.asset_name],
                    ledger,
                    spec,
                    materialized,
                    log,
                    restated.get(group.asset_name, {}),
                )
            )
    return events


def _group_materializations(
    group: TenantGroup,
    touched: set[str],
    ledger: ExportLedger,
    spec: ExportSpec,
    materialized: Callable[[dg.AssetKey, Sequence[str]], set[str]],
    log,
    restated: Mapping[str, Mapping[str, int]] | None = None,
) -> list[dg.AssetMaterialization]:
    export, tenants = spec.name, group.tenants
    restated = restated or {}
    calendar = ExportCalendar(group.timezone, spec.start_date)
    asset_key = dg.AssetKey(group.asset_name)
    # A tenant that moved zones has keys of its earlier zone: count keys by tenant and date, whatever their zone.
    zone = None if any(spec.tenant(t).moves for t in tenants) else group.timezone
    days: dict[str, dt.date] = {}
    for partition in sorted(touched):
        try:
            days[partition] = calendar.window(partition).business_date  # Dagster does not validate partition keys
        except CalendarError as exc:
            log.error(f"partition {partition!r} not recorded: {exc}")
    # One grouped read for every touched day, over the group's tenants only: a tick costs what it touched.
    summaries = ledger.day_summaries(export=export, timezone=zone, days=list(days.values()), tenants=tenants)
    complete = []
    for partition, day in days.items():
        summary = summaries.get(day)
        if summary is not None and summary.completed == len(tenants):
            complete.append(partition)

    events = []
    seen = materialized(asset_key, complete)
    # Their run failed on some key: Dagster never recorded them (or never this revision of a restated key).
    unrecorded = [p for p in complete if p not in seen or p in restated]
    reasons = published_revisions(ledger, sorted({key for p in unrecorded for key in restated.get(p, {})}))
    if unrecorded:
        # Counts come from the grouped read above; only the listed keys are read (a day of 1,000 tenants is 1,000
        # rows, and a tick touching 100 such days would otherwise read 100,000 records to show 20 keys of each).
        listed = ledger.first_records(
            export=export, timezone=zone, days=[days[p] for p in unrecorded], tenants=tenants, per_day=LISTED_KEYS
        )
        for partition in unrecorded:
            summary, shown = summaries[days[partition]], listed.get(days[partition], [])
            events.append(
                dg.AssetMaterialization(
                    asset_key=asset_key,
                    partition=partition,
                    metadata={
                        "keys": summary.completed,
                        "rows": summary.rows,
                        "logical_keys": dg.MetadataValue.json([r.logical_key for r in shown]),
                        "sha256": dg.MetadataValue.json({r.logical_key: r.sha256 for r in shown}),
                        "paths": dg.MetadataValue.json({r.logical_key: r.location for r in shown}),
                        "committed_attempts": dg.MetadataValue.json(sorted({r.committed_attempt for r in shown})),
                        "every_key": dg.MetadataValue.text(status_command(export, [partition])),
                        **_revision_metadata(restated.get(partition, {}), reasons),
                    },
                    description="recorded by reconciliation from the destination's evidence",
                )
            )
    return events


def _revision_metadata(revisions: Mapping[str, int], reasons: Mapping[str, Restatement]) -> dict:
    """``restated_keys`` and ``revisions`` of a partition's event, as a run's materialization names them."""
    if not revisions:
        return {}
    shown = sorted(revisions.items())[:LISTED_KEYS]
    return {
        "restated_keys": len(revisions),
        "revisions": dg.MetadataValue.json(
            {
                key: {
                    "revision": revision,
                    "supersedes": revision - 1,
                    "reason": reasons[key].reason if key in reasons else None,
                    "requested_by": reasons[key].requested_by if key in reasons else None,
                }
                for key, revision in shown
            }
        ),
    }


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
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    minimum_interval_seconds: int = 60,
) -> dg.SensorDefinition:
    """One sensor for every export of the code location. Each tick:

    1. reconciles at most ``batch_size`` stuck keys from their destination's evidence;
    2. reruns the partitions of at most ``batch_size`` ``failed`` keys (while a key has had fewer than
       ``max_attempts`` claims), each step continuing where the previous tick stopped;
    3. launches the partitions of at most ``batch_size`` completed keys with an open restatement request
       (:func:`restatement_requests`), so that a recorded request is always published;
    4. escalates every key that needs a person (:meth:`ExportLedger.needs_attention`): an error in the log each tick,
       and ``no_stuck_exports`` failing for its export while it lasts.
    """
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
        failed = book.failed(limit=batch_size, after=state.get("failed_after"), max_attempts=max_attempts)
        # Open restatement requests, a page per tick (in key order, continuing where the last tick stopped).
        pending = [
            r for r in book.restatements() if r.export in by_name and r.logical_key > (state.get("restate_after") or "")
        ]
        pending = pending[:batch_size]
        restate_after = pending[-1].logical_key if len(pending) == batch_size else None
        requests, events, notes = sensor_result(
            report,
            ledger=book,
            exports=by_name,
            materialized=lambda key, partitions: _materialized(context.instance, key, partitions),
            log=context.log,
            failed=failed,
            max_attempts=max_attempts,
        )
        requests += restatement_requests(pending, records_of(book, pending), by_name, log=context.log)

        attention = [(r, why) for r, why in book.needs_attention(stuck_after, max_attempts=max_attempts)]
        stuck = [r for r, _ in attention if r.export in by_name]
        stuck_keys = sorted(r.logical_key for r in stuck)
        digest = hashlib.sha256("\n".join(stuck_keys).encode()).hexdigest()[:16]
        checks = []
        if attention:
            shown = "; ".join(f"{r.logical_key}: {why}" for r, why in attention[:10])
            context.log.error(f"{len(attention)} export key(s) need attention (export-ledger status "
                              f"--needs-attention): {shown}")  # fmt: skip
        if digest != state.get("stuck_digest", _NOTHING_STUCK):
            # Only when the set changes: one verdict per export.
            for name, spec in by_name.items():
                mine = [r for r in stuck if r.export == name]
                for group in spec.groups:
                    # A tenant no longer declared is reported on the export's first asset: it is never dropped.
                    ours = [r for r in mine if _asset_of(spec, r.tenant) == group.asset_name]
                    checks.append(stuck_check_evaluation(dg.AssetKey(group.asset_name), ours, stuck_after))

        failed_after = failed[-1].logical_key if len(failed) == batch_size else None
        cursor = json.dumps(
            {
                "after": report.next_after,
                "failed_after": failed_after,
                "restate_after": restate_after,
                "stuck_digest": digest,
            }
        )
        if not requests and not events and not checks:
            looked = len(report.findings)
            reason = (
                "; ".join(notes)
                if notes
                else (
                    f"no stuck export keys ({looked} examined, {len(failed)} failed, {len(pending)} open restatements)"
                )
            )
            return dg.SensorResult(skip_reason=reason, cursor=cursor)
        for note in notes:
            context.log.warning(note)
        return dg.SensorResult(run_requests=requests, asset_events=[*events, *checks], cursor=cursor)

    return reconciliation_sensor


def _asset_of(spec: ExportSpec, tenant: str) -> str:
    return spec.group_of(tenant).asset_name if tenant in spec.tenants else spec.groups[0].asset_name


def job_selection(asset_name: str, *, drift_check: bool = False) -> dg.AssetSelection:
    """An export's asset (the export's name, or one zone's asset) and its per-run check; ``no_stuck_exports`` is
    reported by the reconciliation sensor and ``source_unchanged`` (``drift_check``: the export has a source, so the
    check exists) by the drift sensor."""
    reported = [dg.AssetCheckKey(dg.AssetKey(asset_name), "no_stuck_exports")]
    if drift_check:
        reported.append(dg.AssetCheckKey(dg.AssetKey(asset_name), "source_unchanged"))
    return dg.AssetSelection.assets(asset_name) - dg.AssetSelection.checks(*reported)
