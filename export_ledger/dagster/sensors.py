"""The reconciliation sensor: finds stuck keys of this code location's exports and resolves them from the
destination's evidence, reruns failed partitions, launches restatements, and escalates what needs a person.

The decisions live in :mod:`export_ledger.reconcile` and :mod:`export_ledger.ledger.attention` (plain Python); this
module turns them into Dagster's vocabulary. Every read of a tick is a bounded page of this code location's exports
(another code location sharing the ledger sees only its own), so a tick costs what it acts on, whatever the backlog.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import dagster as dg

from export_ledger.calendar import ExportCalendar, utc_iso
from export_ledger.dagster.assets import TENANTS_TAG
from export_ledger.dagster.checks import (
    DRIFT_CHECK_NAME,
    STUCK_CHECK_NAME,
    asset_groups,
    late_by_asset,
    stuck_check_evaluation,
)
from export_ledger.dagster.io_manager import LISTED_KEYS, key_table, status_command
from export_ledger.dagster.resources import LEDGER_KEY, resource_keys
from export_ledger.dead_runs import Finding, Watch, judge_runs
from export_ledger.deadlines import late_keys, with_late
from export_ledger.errors import CalendarError, ConfigurationError
from export_ledger.ledger import DEFAULT_MAX_ATTEMPTS, ExportLedger, ExportState, PartitionWork, Restatement
from export_ledger.reconcile import ReconcileReport, reconcile_batch
from export_ledger.relaunch import Excluded, missing_keys, refused_dates
from export_ledger.restate import published_revisions
from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup, run_scope

#: The digest of an empty escalated set: a cursor that never saw an escalation saw this one.
NOTHING_ESCALATED = hashlib.sha256(b"").hexdigest()[:16]
#: The tag that names the situation a rerun was launched for: runs that failed before claiming anything leave the
#: situation as it was, and are counted by it, so that such a partition still gets its automatic reruns.
SITUATION_TAG = "export-ledger/rerun-of"
#: The tag of a run launched again for dates whose run failed before it claimed their keys: how many times they were
#: launched again (the first relaunch is 1), so that a partition whose runs always fail that way is given up on.
RELAUNCH_TAG = "export-ledger/relaunch"
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
#: Attempt rows a tick reads (from the primary key, after its cursor) to find runs that lost their keys.
ATTEMPTS_READ = 10_000
#: Dagster's statuses of a run in flight: the only ones a dead run is ended from.
IN_FLIGHT = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
#: Escalated keys of each kind a tick counts (:meth:`~export_ledger.ledger.attention.Attention.summary`'s ``cap``):
#: beyond it the count is "at least", so that a tick reads the same whatever the backlog waiting for a person.
ESCALATED_COUNTED = 1000


def _asset_for(spec: ExportSpec, work: PartitionWork, log) -> TenantGroup | None:
    """The asset (zone) whose partition ``work`` is, or None (logged) when this code location has none."""
    group = spec.group_of_zone(work.timezone)
    day = work.business_date
    if group is None or day < spec.calendar.first_date or (group.last_date is not None and day > group.last_date):
        log.warning(
            f"{work.export} has keys on {day.isoformat()} in {work.timezone} to rerun or restate, but no asset of this "
            "code location exports that zone on that date; they are escalated once they wait longer than allowed"
        )
        return None
    try:
        ExportCalendar(group.timezone, spec.start_date).window(day.isoformat())
    except CalendarError as exc:
        log.error(f"partition {day.isoformat()} of {group.asset_name} not launched: {exc}")
        return None
    return group


def rerun_requests(
    failed: Sequence[PartitionWork],
    exports: Mapping[str, ExportSpec],
    *,
    log,
    finished: Callable[[Sequence[str]], Mapping[str, int]] = lambda situations: {},
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> list[dg.RunRequest]:
    """One run request per partition holding ``failed`` keys with automatic reruns left.

    The run key names the partition's situation (a digest of its failed keys and their tokens): a key is ``failed``
    with a given token at most once (every claim raises it), so a new failure always brings a new run key, while the
    same situation seen again on the next tick repeats it and Dagster launches nothing twice. A run that failed before
    it claimed anything (its code location did not load, a resource failed) leaves the situation as it was:
    ``finished(situations)`` counts such runs of each (one read for the page), and the run key takes a generation
    from it, up to ``max_attempts``.
    """
    pages = []
    for work in failed:
        spec = exports.get(work.export)
        group = _asset_for(spec, work, log) if spec is not None else None
        if group is not None:
            pages.append((work, group, f"{group.asset_name}/{work.business_date.isoformat()}/{work.digest}"))
    ended = finished([situation for _, _, situation in pages]) if pages else {}
    requests = []
    for work, group, situation in pages:
        partition = work.business_date.isoformat()
        generation = ended.get(situation, 0)
        if generation >= max_attempts:
            continue  # its runs keep failing before they claim: escalated once it waits longer than allowed
        requests.append(
            dg.RunRequest(
                partition_key=partition,
                run_key=f"rerun/{situation}" + (f"/g{generation}" if generation else ""),
                job_name=f"{group.asset_name}_job",
                tags={"export-ledger/reconciled": "true", SITUATION_TAG: situation},
            )
        )
    return requests


def restatement_requests(
    pending: Sequence[PartitionWork], exports: Mapping[str, ExportSpec], *, log
) -> list[dg.RunRequest]:
    """One run request per partition (of one zone's asset) holding ``completed`` keys with open restatement requests:
    the run's claims restate every such key of the partition, however many tenants it has (one run, not one per page
    of keys). The run key names the partition's open requests: a request is launched once, and a new one brings a new
    key."""
    requests = []
    for work in pending:
        spec = exports.get(work.export)
        group = _asset_for(spec, work, log) if spec is not None else None
        if group is None:
            continue
        partition = work.business_date.isoformat()
        requests.append(
            dg.RunRequest(
                partition_key=partition,
                run_key=f"restate/{group.asset_name}/{partition}/{work.digest}",
                job_name=f"{group.asset_name}_job",
                tags={"export-ledger/restatement": "true"},
            )
        )
    return requests


def _dates_request(group: TenantGroup, days: Sequence[dt.date], run_key: str, tags: Mapping[str, str]) -> dg.RunRequest:
    """One run of ``group``'s asset over ``days``: a partition, or the range from the first to the last (the keys
    of the dates between that are done are skipped at claim)."""
    first, last = min(days).isoformat(), max(days).isoformat()
    if first == last:
        return dg.RunRequest(partition_key=first, run_key=run_key, job_name=f"{group.asset_name}_job", tags=dict(tags))
    return dg.RunRequest(
        run_key=run_key, job_name=f"{group.asset_name}_job", tags={**tags, RANGE_START: first, RANGE_END: last}
    )


def _run_days(run: dg.DagsterRun, group: TenantGroup, start_date: str, log) -> list[dt.date]:
    """The business dates a run of ``group``'s job was for: its partition, or every date of its range."""
    tags = run.tags
    calendar = ExportCalendar(group.timezone, start_date)
    try:
        if "dagster/partition" in tags:
            return [calendar.window(tags["dagster/partition"]).business_date]
        if RANGE_START in tags and RANGE_END in tags:
            first = calendar.window(tags[RANGE_START]).business_date
            last = calendar.window(tags[RANGE_END]).business_date
            return [first + dt.timedelta(days=n) for n in range((last - first).days + 1)]
    except CalendarError as exc:
        log.error(f"run {run.run_id} of {group.asset_name} names a partition that is not a date of it: {exc}")
    return []


def missed_requests(
    instance: dg.DagsterInstance,
    ledger: ExportLedger,
    exports: Mapping[str, ExportSpec],
    *,
    after: str | None,
    limit: int,
    max_attempts: int,
    log,
) -> tuple[list[dg.RunRequest], str | None]:
    """Runs of this code location's export jobs that failed, after the cursor ``after`` (their last update, oldest
    first, at most ``limit``): dates of theirs whose keys the ledger never heard of (the run failed before it claimed
    them) are launched again, up to ``max_attempts`` runs in all; beyond, the partition is noted missed in the
    ledger and escalated. Dates whose keys all exist are the other passes' (failed keys are rerun from the ledger).
    A canceled run is a person's decision: it is not launched again. Returns the requests and the new cursor."""
    jobs = {f"{group.asset_name}_job": (spec, group) for spec in exports.values() for group in spec.groups}
    since = dt.datetime.fromisoformat(after) if after else None
    records = instance.get_run_records(
        filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE], updated_after=since),
        limit=limit, order_by="update_timestamp", ascending=True,
    )  # fmt: skip
    requests: list[dg.RunRequest] = []
    excluded: dict[str, Excluded] = {}
    for record in records:
        run = record.dagster_run
        if run.job_name not in jobs:
            continue
        spec, group = jobs[run.job_name]
        days = _run_days(run, group, spec.start_date, log)
        if not days:
            continue
        if spec.name not in excluded:
            excluded[spec.name] = Excluded.read(ledger, spec.name)
        try:
            scope = _scope_of(run, spec, group)
        except ConfigurationError as exc:
            # Refused for its tenants before anything was done: launched again it would be refused again, and
            # launched without them it would export tenants the person left out. A person relaunches it.
            log.warning(f"run {run.run_id} of {group.asset_name} is not launched again: {exc}")
            continue
        missing = missing_keys(ledger, spec, group, days, excluded[spec.name], scope)
        if not missing:
            continue
        try:
            generation = int(run.tags.get(RELAUNCH_TAG, "0"))
        except ValueError:
            generation = max_attempts
        if generation + 1 < max_attempts:
            tags = {"export-ledger/reconciled": "true", RELAUNCH_TAG: str(generation + 1)}
            if scope is not None:
                tags[TENANTS_TAG] = ",".join(scope)  # launched again for the tenants it was launched for
            requests.append(_dates_request(group, list(missing), f"relaunch/{run.run_id}", tags))
            continue
        for day, count in sorted(missing.items()):
            ledger.attention.note_missed(
                spec.name, group.timezone, day, missing_keys=count, run_id=run.run_id, runs=generation + 1
            )
        log.error(
            f"{len(missing)} date(s) of {group.asset_name} from {min(missing).isoformat()} failed {generation + 1} "
            f"run(s) before claiming their keys (the last {run.run_id}): escalated (export-ledger status "
            "--needs-attention)"
        )
    cursor = after
    if records:
        last = records[-1].update_timestamp
        cursor = (last if last.tzinfo else last.replace(tzinfo=dt.UTC)).isoformat()
    return requests, cursor


def _scope_of(run: dg.DagsterRun, spec: ExportSpec, group: TenantGroup) -> tuple[str, ...] | None:
    """The tenants a run of ``group``'s asset was scoped to (its tag or its config's ``tenants``); None: all."""
    config = ((run.run_config or {}).get("ops") or {}).get(group.asset_name) or {}
    configured = (config.get("config") or {}).get("tenants") or []
    return run_scope(run.tags.get(TENANTS_TAG), configured, group, spec.groups)


def refused_requests(
    ledger: ExportLedger, exports: Mapping[str, ExportSpec], *, limit: int, log
) -> list[dg.RunRequest]:
    """The dates refused by a calendar contract whose refusal has closed, launched again (one run per asset over
    the refused span); a refusal whose dates all have keys is done with."""
    requests: list[dg.RunRequest] = []
    for refusal in ledger.contracts.to_relaunch(exports=sorted(exports), limit=limit):
        spec = exports[refusal["export"]]
        pending = refused_dates(ledger, spec, refusal)
        if not pending:
            ledger.contracts.relaunched(refusal["id"])
            continue
        for group, days in sorted(pending.items(), key=lambda item: item[0].asset_name):
            run_key = f"refused/{refusal['id']}/{group.asset_name}/{min(days).isoformat()}/{max(days).isoformat()}"
            requests.append(_dates_request(group, days, run_key, {"export-ledger/reconciled": "true"}))
        log.info(
            f"{refusal['export']}: the contract refusal of tenant {refusal['tenant']} closed; launching its refused "
            f"dates again ({sum(len(d) for d in pending.values())} without a key)"
        )
    return requests


def end_dead_runs(
    instance: dg.DagsterInstance,
    ledger: ExportLedger,
    exports: Sequence[str],
    watch: Watch,
    *,
    limit: int,
    log,
    attempts_read: int = ATTEMPTS_READ,
) -> tuple[Watch, list[str]]:
    """Marks failed in Dagster, at most ``limit`` a tick, the runs still ``STARTING`` or ``STARTED`` that the ledger
    knows have ended (:mod:`export_ledger.dead_runs`): their pool slots are freed (run monitoring frees a finished
    run's slots after ``free_slots_after_run_end_seconds``), Dagster's run retries and this sensor's reruns proceed.

    Reads the attempt rows of ``exports`` after ``watch.after`` (at most ``attempts_read``) and judges the runs
    that lost keys once it has read them all, none missing below the highest read (a run heard from in a row not read
    yet must not be ended). A run is ended only once it has been quiet for a lease (the ledger's) after its latest
    loss: a run whose loss is recent stays in the watch and is judged again; any other verdict takes it out of the
    watch, and the next key it loses brings it back. Returns the watch to keep and the runs ended.
    """
    page = ledger.queries.attempts_after(watch.after, limit=attempts_read, exports=exports)
    now = ledger.now()
    watch = watch.seen(page, now)
    if page.full or watch.waiting is not None or not watch.losing:
        return watch, []
    losing = sorted(watch.losing.values(), key=lambda run: run.last_lost_at)[:limit]  # the longest lost first
    records = instance.get_run_records(
        filters=dg.RunsFilter(run_ids=[run.run_id for run in losing], statuses=IN_FLIGHT), limit=len(losing)
    )
    in_flight = {record.dagster_run.run_id: record.dagster_run for record in records}
    held = ledger.queries.held_by_runs(sorted(in_flight))
    ended, recent = [], set()
    for verdict in judge_runs(watch, sorted(in_flight), held, now, ledger.lease_ttl):
        if verdict.ended:
            _mark_failed(instance, in_flight[verdict.run_id], verdict.why, log)
            ended.append(verdict.run_id)
        else:
            if verdict.finding is Finding.RECENT:
                recent.add(verdict.run_id)
            log.info(f"run {verdict.run_id} lost export keys but is not ended: {verdict.why}")
    judged = {run.run_id for run in losing} - recent
    return replace(watch, losing={run_id: run for run_id, run in watch.losing.items() if run_id not in judged}), ended


def _mark_failed(instance: dg.DagsterInstance, run: dg.DagsterRun, why: str, log) -> None:
    """Marks ``run`` failed, with ``why`` in the failure event of its own log.

    ``DagsterInstance.report_run_failed`` is not in Dagster's API reference, but it is what Dagster's own run
    monitoring calls on a run past ``max_runtime_seconds``, and no documented method marks a run failed (the UI's
    forced termination marks it canceled, which this sensor reads as a person's decision: never relaunched)."""
    message = (
        f"Marked failed by the export ledger's reconciliation_sensor: {why}. Dagster still had it "
        f"{run.status.value}, holding its pool slots until max_runtime_seconds; its keys are rerun."
    )
    instance.report_run_failed(run, message)
    log.warning(f"run {run.run_id} ({run.job_name}): {message}")


def merged(requests: Sequence[dg.RunRequest]) -> list[dg.RunRequest]:
    """One request per (job, partition or range), the first kept, and none for a partition a range request of the
    same job covers: a run of a partition claims every key of it (it reruns the failed ones and publishes the
    requested restatements alike), so two runs of one partition in one tick would compete for its keys. A relaunch
    scoped to some tenants (``export-ledger/tenants``) claims only theirs: a rerun or restatement of another tenant
    it drops here is requested again when its pass comes back to it (the next tick, unless a page was full)."""
    ranges = [(r.job_name, r.tags[RANGE_START], r.tags[RANGE_END]) for r in requests if RANGE_START in r.tags]
    seen: set[tuple] = set()
    kept = []
    for request in requests:
        where = (request.job_name, request.partition_key, request.tags.get(RANGE_START), request.tags.get(RANGE_END))
        covered = request.partition_key is not None and any(
            job == request.job_name and first <= request.partition_key <= last for job, first, last in ranges
        )
        if where not in seen and not covered:
            seen.add(where)
            kept.append(request)
    return kept


def sensor_result(
    report: ReconcileReport,
    *,
    ledger: ExportLedger,
    exports: Mapping[str, ExportSpec],
    materialized: Callable[[dg.AssetKey, Sequence[str]], set[str]],
    log,
) -> tuple[list[dg.AssetMaterialization], list[str]]:
    """Materialization events and notes from one reconciliation pass over this code location's exports."""
    events: list[dg.AssetMaterialization] = []
    for name, spec in exports.items():
        mine = ReconcileReport(resolved=[(f, r) for f, r in report.resolved if r.export == name])
        if mine.resolved:
            events.extend(_materializations(mine, ledger=ledger, spec=spec, materialized=materialized, log=log))
    return events, _notes(report)


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

    def asset(zone: str) -> str | None:
        group = spec.group_of_zone(zone)
        return group.asset_name if group is not None else None

    owners: set[str] = set()
    for finding, record in report.resolved:
        name = asset(record.timezone)
        if name is not None:
            touched.setdefault(name, set()).add(record.business_date.isoformat())
            if record.state is ExportState.COMPLETED and finding.evidence is not None and finding.evidence.revision > 1:
                # A restatement whose run died after publishing: the partition was materialized before (its earlier
                # revision), but this revision never was.
                partitions = restated.setdefault(name, {})
                partitions.setdefault(record.business_date.isoformat(), {})[record.logical_key] = (
                    finding.evidence.revision
                )
        owner = finding.record.lease_owner
        if owner and record.state in (ExportState.COMPLETED, ExportState.FAILED):
            # The attempt that left this key stuck may have completed other keys before its run failed: those
            # partitions were never recorded as materialized either (whatever became of this key: a failed one is
            # rerun, and the rerun records only its own partition).
            owners.add(owner)
        if record.state is ExportState.CONFLICT:
            log.error(f"{record.logical_key}: conflict at the destination, nothing overwritten: {finding.detail}")
    # One read for every such attempt of the batch, however many of their keys were stuck.
    for _, zone, day in ledger.queries.partitions_committed_by(sorted(owners), export=export, limit=1000):
        other_asset = asset(zone)
        if other_asset is not None:
            touched.setdefault(other_asset, set()).add(day.isoformat())
    events = []
    for group in spec.groups:
        if group.asset_name in touched:
            events.extend(
                _group_materializations(
                    group, touched[group.asset_name], ledger, spec, materialized, log,
                    restated.get(group.asset_name, {}),
                )
            )  # fmt: skip
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
    export = spec.name
    restated = restated or {}
    calendar = ExportCalendar(group.timezone, spec.start_date)
    asset_key = dg.AssetKey(group.asset_name)
    days: dict[str, dt.date] = {}
    for partition in sorted(touched):
        try:
            days[partition] = calendar.window(partition).business_date  # Dagster does not validate partition keys
        except CalendarError as exc:
            log.error(f"partition {partition!r} not recorded: {exc}")
    # Cheapest first, so that only the partitions an event is written for are counted: a day with a key not completed
    # is found from the index on the state (its completed keys unread); one Dagster already recorded (this revision)
    # needs nothing; the rest are counted in one grouped read.
    unfinished = ledger.queries.unfinished_days(
        export=export, timezone=group.timezone, days=list(days.values()), tenants=group.tenants
    )
    candidates = [p for p, day in days.items() if day not in unfinished and group.tenants_on(day)]
    seen = materialized(asset_key, candidates) if candidates else set()
    # Their run failed on some key: Dagster never recorded them (or never this revision of a restated key).
    unseen = [p for p in candidates if p not in seen or p in restated]
    summaries = ledger.queries.day_summaries(
        export=export, timezone=group.timezone, days=[days[p] for p in unseen], tenants=group.tenants
    )
    unrecorded = [
        partition
        for partition in unseen
        if (summary := summaries.get(days[partition])) is not None
        and summary.completed == len(group.tenants_on(days[partition])) > 0
    ]
    events = []
    reasons = published_revisions(ledger, sorted({key for p in unrecorded for key in restated.get(p, {})}))
    if unrecorded:
        listed = ledger.queries.first_keys(
            export=export, timezone=group.timezone, days=[days[p] for p in unrecorded], tenants=group.tenants,
            per_day=LISTED_KEYS,
        )  # fmt: skip
        for partition in unrecorded:
            summary, shown = summaries[days[partition]], listed.get(days[partition], [])
            events.append(
                dg.AssetMaterialization(
                    asset_key=asset_key,
                    partition=partition,
                    metadata={
                        "keys": summary.completed,
                        "dagster/row_count": summary.rows,
                        "key_table": key_table(
                            [
                                (
                                    r.tenant,
                                    "repaired" if r.logical_key in restated.get(partition, {}) else "completed",
                                    r.row_count,
                                    restated.get(partition, {}).get(r.logical_key),
                                    r.sha256,
                                    r.location,
                                )
                                for r in shown
                            ]
                        ),  # fmt: skip
                        "committed_attempts": dg.MetadataValue.json(sorted({r.committed_attempt for r in shown})),
                        "every_key": dg.MetadataValue.text(status_command(export, [partition])),
                        **_revision_metadata(ledger, restated.get(partition, {}), reasons),
                    },
                    description="recorded by reconciliation from the destination's evidence",
                )
            )
    return events


def _revision_metadata(ledger: ExportLedger, revisions: Mapping[str, int], reasons: Mapping[str, Restatement]) -> dict:
    """``restated_keys`` and ``revisions`` of a partition's event, as a run's materialization names them."""
    if not revisions:
        return {}
    shown = sorted(revisions.items())[:LISTED_KEYS]
    current = {key: ledger.restatements.current_revision(key) for key, _ in shown}
    return {
        "restated_keys": len(revisions),
        "revisions": dg.MetadataValue.json(
            {
                key: {
                    "revision": revision,
                    "supersedes": current[key].supersedes_revision if current[key] is not None else None,
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
            f"destination unreachable for {len(report.unreachable)} stuck key(s), left remote_unknown: "
            f"{report.unreachable[0].detail}"
        )
    conflicts = report.resolved_to(ExportState.CONFLICT)
    if conflicts:
        notes.append(f"{len(conflicts)} key(s) found in conflict at the destination; an operator must resolve them")
    if report.changed_meanwhile:
        notes.append(f"{len(report.changed_meanwhile)} key(s) changed by another party meanwhile, left to it")
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


def _finished_reruns(instance: dg.DagsterInstance, limit: int) -> Callable[[Sequence[str]], Mapping[str, int]]:
    """How many runs launched for each rerun situation have ended without success: one read of the run storage for
    a page of situations (a tag matching any of them), at most ``limit`` runs per situation. (One read per
    situation was 6 ms each on SQLite: 300 ms for a page of 50 partitions.)"""
    ended = [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]

    def count(situations: Sequence[str]) -> dict[str, int]:
        records = instance.get_run_records(
            filters=dg.RunsFilter(tags={SITUATION_TAG: list(situations)}, statuses=ended),
            limit=limit * len(situations),
        )
        found: dict[str, int] = {}
        for record in records:
            situation = record.dagster_run.tags.get(SITUATION_TAG)
            found[situation] = found.get(situation, 0) + 1
        return found

    return count


def build_reconciliation_sensor(
    exports: Sequence[ExportSpec],
    jobs: Sequence[dg.UnresolvedAssetJobDefinition],
    *,
    batch_size: int = 100,
    stuck_after: dt.timedelta = dt.timedelta(hours=6),
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    minimum_interval_seconds: int = 60,
) -> dg.SensorDefinition:
    """One sensor for every export of the code location. Each tick, on this code location's exports only:

    1. reconciles at most ``batch_size`` stuck keys from their destination's evidence (hold, fence, judge, record),
       and marks failed in Dagster at most ``batch_size`` runs still in flight there that the ledger knows are dead
       (:func:`end_dead_runs`), so that their pool slots are freed;
    2. reruns at most ``batch_size`` partitions holding ``failed`` keys with automatic reruns left (one run per
       partition, whatever its number of failed keys), continuing where the previous tick stopped;
    3. launches at most ``batch_size`` partitions holding completed keys with an open restatement request, so that a
       recorded request is always published;
    4. escalates everything that needs a person (:meth:`~export_ledger.ledger.attention.Attention.summary`, counted in
       the ledger up to :data:`ESCALATED_COUNTED` keys of each kind, "at least" beyond): an error in the log each
       tick, and ``no_stuck_exports`` failing for its asset while it lasts.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    by_name = {spec.name: spec for spec in exports}
    names = sorted(by_name)
    destination_keys = {spec.name: resource_keys(spec)[0] for spec in exports}

    @dg.sensor(
        name="reconciliation_sensor",
        jobs=list(jobs),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        required_resource_keys={LEDGER_KEY, *destination_keys.values()},
        description="Resolves remote_unknown and abandoned in_progress exports from the destination's evidence, "
        "reruns failed partitions, publishes requested restatements, and escalates what needs a person.",
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
        # After reconciliation (its holds record the dead attempts abandoned), before the failed runs are read.
        watch, ended = end_dead_runs(
            context.instance, book, names, Watch.from_json(state.get("dead_runs")), limit=batch_size, log=context.log
        )
        attention = book.attention
        failed = attention.failed_partitions(
            max_attempts=max_attempts, limit=batch_size, after=state.get("failed_after"), exports=names
        )
        pending = attention.restating_partitions(limit=batch_size, after=state.get("restate_after"), exports=names)
        events, notes = sensor_result(
            report,
            ledger=book,
            exports=by_name,
            materialized=lambda key, partitions: _materialized(context.instance, key, partitions),
            log=context.log,
        )
        finished = _finished_reruns(context.instance, max_attempts)
        relaunched, runs_after = missed_requests(
            context.instance, book, by_name, after=state.get("runs_after"), limit=batch_size,
            max_attempts=max_attempts, log=context.log,
        )  # fmt: skip
        requests = merged(
            [
                *relaunched,
                *refused_requests(book, by_name, limit=batch_size, log=context.log),
                *rerun_requests(failed, by_name, log=context.log, finished=finished, max_attempts=max_attempts),
                *restatement_requests(pending, by_name, log=context.log),
            ]
        )

        # Counted every tick; the keys of each group are listed only when the escalated set changed (they go into
        # the checks' metadata, written then).
        summary = attention.summary(
            stuck_after, max_attempts=max_attempts, exports=names, listed=False, cap=ESCALATED_COUNTED
        )
        # Keys past their export's deadline and not completed (a key never attempted included): escalated too.
        late = late_keys(book, list(by_name.values()), limit=batch_size, beside=(stuck_after, max_attempts))
        digest = (
            summary.digest
            if not late
            else hashlib.sha256((summary.digest + "|" + ",".join(e.name for e in late)).encode()).hexdigest()[:16]
        )
        changed = digest != state.get("stuck_digest", NOTHING_ESCALATED)
        if changed and summary.total:
            summary = attention.summary(stuck_after, max_attempts=max_attempts, exports=names, cap=ESCALATED_COUNTED)
        checks = []
        if summary.total or late:
            # Ten late keys fill the line: no page of the rest is read then.
            escalated = [] if len(late) >= 10 else attention.needs_attention(
                stuck_after, max_attempts=max_attempts, exports=names, limit=10
            )  # fmt: skip
            first = with_late(late, escalated, 10)
            shown = "; ".join(f"{e.name}: {e.why}" for e in first)
            context.log.error(f"{'at least ' if summary.at_least else ''}{summary.total + len(late)} export key(s) "
                              f"need attention (export-ledger status --needs-attention): {shown}")  # fmt: skip
        if changed:
            # Only when the escalated set changes: one verdict per asset (asset events are not deduplicated).
            for spec in by_name.values():
                late_here = late_by_asset(spec, late)
                for asset_name, (count, listed) in asset_groups(spec, summary).items():
                    mine = late_here.get(asset_name, [])
                    listed = with_late(mine, listed, LISTED_KEYS)
                    checks.append(
                        stuck_check_evaluation(dg.AssetKey(asset_name), count + len(mine), listed, stuck_after)
                    )

        cursor = json.dumps(
            {
                "after": report.next_after,
                "failed_after": failed[-1].cursor if len(failed) == batch_size else None,
                "restate_after": pending[-1].cursor if len(pending) == batch_size else None,
                "stuck_digest": digest,
                "runs_after": runs_after,
                "dead_runs": watch.to_json(),
            }
        )
        if not requests and not events and not checks:
            looked = len(report.findings)
            if ended:
                notes.append(f"{len(ended)} run(s) the ledger knows are dead marked failed: {', '.join(ended)}")
            reason = "; ".join(notes) or (
                f"no stuck export keys ({looked} examined, {len(failed)} partition(s) with failed keys, "
                f"{len(pending)} with open restatements, {summary.total + len(late)} escalated)"
            )
            return dg.SensorResult(skip_reason=reason, cursor=cursor)
        for note in notes:
            context.log.warning(note)
        return dg.SensorResult(run_requests=requests, asset_events=[*events, *checks], cursor=cursor)

    return reconciliation_sensor


def job_selection(asset_name: str, *, drift_check: bool = False) -> dg.AssetSelection:
    """An export's asset (the export's name, or one zone's asset) and its partitioned checks: its run's one step
    reports ``partition_health`` for its own partitions. The whole asset's
    checks are left out, each reported by its sensor when it changes: ``no_stuck_exports`` (reconciliation) and
    ``source_unchanged`` (drift; ``drift_check``: the export has a source, so the check exists)."""
    whole = [STUCK_CHECK_NAME, *([DRIFT_CHECK_NAME] if drift_check else [])]
    return dg.AssetSelection.assets(asset_name) - dg.AssetSelection.checks(
        *(dg.AssetCheckKey(dg.AssetKey(asset_name), name) for name in whole)
    )
