"""The asset checks of an export's asset: their names and specs, and how each verdict is computed.

Every check of an export with a source is declared on its asset (:func:`check_specs`) and reported by the asset's
own step (:func:`step_verdicts`): selecting the export runs one step in one process. The per-partition checks are
judged by the run that exported the partition, from what it read and wrote; the whole asset's (``no_stuck_exports``,
``source_unchanged``) by the reconciliation and drift sensors, as runless evaluations when they change.
"""

import datetime as dt
import warnings
from collections.abc import Mapping, Sequence, Set

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (  # the target of a check's evaluation
    AssetCheckEvaluationTargetMaterializationData,
)

from export_ledger.calendar import ExportCalendar, utc_iso
from export_ledger.dagster.io_manager import LISTED_KEYS, status_command
from export_ledger.dagster.resources import LEDGER_KEY
from export_ledger.deadlines import due_at, late_keys, with_late
from export_ledger.destinations import Destination, DestinationUnreachable, ExportTarget, Verdict, place_of_location
from export_ledger.drift import describe
from export_ledger.errors import CalendarError
from export_ledger.health import SEVERE, STATUSES, Evidence, PartitionHealth, partition_health
from export_ledger.ledger import AttentionSummary, DriftRecord, Escalation, ExportLedger, ExportRecord
from export_ledger.placement import recorded_destinations
from export_ledger.protocol import ExportBatch
from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup

HEALTH_CHECK_NAME = "partition_health"
#: The metadata entry of a ``partition_health`` verdict that holds the ledger's side of it alone.
LEDGER_VERDICT = "ledger_verdict"
STUCK_CHECK_NAME = "no_stuck_exports"
DRIFT_CHECK_NAME = "source_unchanged"


def latest_materializations(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, partitions: Sequence[str]
) -> dict[str, AssetCheckEvaluationTargetMaterializationData]:
    """The latest materialization of each of ``partitions`` (one read, newest first), as a check's target."""
    if not partitions:
        return {}
    found: dict[str, AssetCheckEvaluationTargetMaterializationData] = {}
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=list(partitions)), limit=len(partitions) * 4
    ).records
    for record in records:
        if record.partition_key is not None and record.partition_key not in found:
            found[record.partition_key] = AssetCheckEvaluationTargetMaterializationData(
                storage_id=record.storage_id, run_id=record.run_id, timestamp=record.timestamp
            )
    return found


def targeting(
    evaluation: dg.AssetCheckEvaluation, target: AssetCheckEvaluationTargetMaterializationData | None
) -> dg.AssetCheckEvaluation:
    """``evaluation`` pointed at the materialization it judged (unchanged when the partition has none)."""
    if target is None:
        return evaluation
    return dg.AssetCheckEvaluation(
        asset_key=evaluation.asset_key, check_name=evaluation.check_name, passed=evaluation.passed,
        metadata=evaluation.metadata, target_materialization_data=target, severity=evaluation.severity,
        description=evaluation.description, partition=evaluation.partition,
    )  # fmt: skip


def destination_problems(
    ledger: ExportLedger,
    destination: Destination,
    records: Sequence[ExportRecord],
    read: Mapping[str, int] | None = None,
) -> Evidence:
    """What the destination says of each of ``records`` (completed keys), as :class:`~export_ledger.health.Evidence`:
    its current recorded revision intact where it was recorded and what readers see
    (:meth:`~export_ledger.destinations.Destination.verify_current`: its manifest names the key, its data's sha256 is
    the ledger's, the key's pointer names it), and its row count the one ``read`` says the run read from the source,
    else the one the ledger recorded. A key whose destination cannot be reached is unverified (and that destination
    is not asked about the others: a timeout each), never a failure of the whole verdict. The source is never read.
    Three ledger reads whatever the number of keys.

    Args:
        read: The rows the run read of each key it exported (a streamed callable source is a generator, read once:
            what the run read is what it counted, issue 26).
    """
    if not records:
        return Evidence()
    read = read or {}
    currents = ledger.restatements.current_revisions_of(list(records))
    # A key exported under an earlier contract (kept when the destination changed) is checked where it was exported.
    places = recorded_destinations(ledger, list(records), known=destination, fallback=lambda _: destination)
    matched, differs, unverified = set(), {}, {}
    silent: set[int] = set()  # destinations that did not answer: their other keys are not asked (a timeout each)
    for record in records:
        place = places[record.logical_key]
        if id(place) not in silent:
            try:
                problem = _key_problem(record, currents, places, read)
            except DestinationUnreachable:
                silent.add(id(place))
        if id(place) in silent:
            unverified[record.logical_key] = "not verified: the destination did not answer"
            continue
        if problem is None:
            matched.add(record.logical_key)
        else:
            differs[record.logical_key] = problem
    return Evidence(frozenset(matched), differs, unverified)


def _key_problem(record: ExportRecord, currents, places, read) -> str | None:
    """What is wrong with one completed key of :func:`destination_problems` (None: it matches)."""
    current = currents[record.logical_key]
    target = ExportTarget.of_record(record, current.revision, place_of_location(current.location))
    seen = places[record.logical_key].verify_current(target, logical_key=record.logical_key, sha256=current.sha256)
    if seen.verdict is not Verdict.PUBLISHED:
        return f"at the destination: {seen.detail}"
    published = seen.manifest.row_count
    if record.logical_key in read:
        if published != read[record.logical_key]:
            return f"{published} rows published, {read[record.logical_key]} read from the source"
    elif record.row_count is not None and published != record.row_count:
        return f"{published} rows published, {record.row_count} recorded in the ledger"
    return None


def read_counts(batch: ExportBatch | None) -> dict[str, int]:
    """The rows the run read of each key it exported (a key it found already completed is judged by the ledger's
    count)."""
    if batch is None:
        return {}
    return {r.logical_key: r.row_count for r in batch.results if r.status != "already_completed"}


HEALTH_DESCRIPTION = (
    "each tenant's key of the partition, from the ledger and the destination: healthy (every tenant exported, its "
    "current revision at the destination with the ledger's sha256 and the row count the run read, its source "
    "unchanged), or the worst of its keys: escalated (waits for a person), differs (what is at the destination is "
    "not what the ledger recorded), failed (rerun by the reconciliation sensor), restating (a new revision "
    "requested), stale (source changed since export), unverified (the destination did not answer), in_progress, "
    "missing (never attempted)"
)


def due(spec: ExportSpec):
    """When each tenant's key of a date is due (None: the export has no deadline), for :func:`partition_health`."""
    return None if spec.deadline is None else (lambda tenant, day: due_at(spec, tenant, day))


def health_evaluation(asset_key: dg.AssetKey, verdict: PartitionHealth) -> dg.AssetCheckEvaluation:
    """The ``partition_health`` verdict of one partition: an ERROR while a key is escalated, differs or failed, a
    WARN while one is restating, stale, in progress or missing. Counts, states and the library's notes only, never
    values."""
    table = dg.MetadataValue.table(
        [
            dg.TableRecord(
                {"tenant": k.tenant, "status": k.status, "state": k.state or "", "rows": k.rows or 0, "note": k.note}
            )
            for k in verdict.keys[:LISTED_KEYS]
        ],
        schema=HEALTH_TABLE_SCHEMA,
    )
    return dg.AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=HEALTH_CHECK_NAME,
        partition=verdict.business_date.isoformat(),
        passed=verdict.healthy,
        severity=dg.AssetCheckSeverity.ERROR if verdict.status in SEVERE else dg.AssetCheckSeverity.WARN,
        metadata={
            "status": dg.MetadataValue.text(verdict.status),
            "summary": dg.MetadataValue.text(verdict.summary),
            **{f"{status}_keys": verdict.count(status) for status in STATUSES if verdict.count(status)},
            "verified_at_destination": verdict.verified,
            **({"unverified_keys": verdict.unverified} if verdict.unverified else {}),
            # The ledger's side alone: what partition_health_sensor compares with when it decides to judge again.
            LEDGER_VERDICT: dg.MetadataValue.text(verdict.ledger_summary),
            "keys": table,
            "every_key": dg.MetadataValue.text(status_command(verdict.export, [verdict.business_date.isoformat()])),
        },
        description=verdict.summary,
    )


HEALTH_TABLE_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("tenant", "string"),
        dg.TableColumn("status", "string"),
        dg.TableColumn("state", "string", description="the key's ledger state (empty: never attempted)"),
        dg.TableColumn("rows", "int"),
        dg.TableColumn("note", "string"),
    ]
)


def health_evaluations(
    spec: ExportSpec,
    ledger: ExportLedger,
    partitions: Mapping[str, set[str]],
    *,
    stuck_after: dt.timedelta,
    max_attempts: int = 3,
) -> list[dg.AssetCheckEvaluation]:
    """``partition_health`` of the given partitions (asset name -> partition keys) of one export, for the sensors:
    what a tick changed, reported as it now stands in the ledger."""
    evaluations = []
    for group in spec.groups:
        wanted = sorted(partitions.get(group.asset_name, ()))
        if not wanted:
            continue
        calendar = ExportCalendar(group.timezone, spec.start_date)
        tenants_by_day = {}
        for partition in wanted:
            try:
                day = calendar.window(partition).business_date
            except CalendarError:
                continue  # not a date of this calendar: nothing of it to report
            tenants_by_day[day] = partition_tenants(spec, group, calendar, day)
        verdicts = partition_health(
            ledger, spec.name, tenants_by_day, stuck_after=stuck_after, max_attempts=max_attempts, due=due(spec)
        )
        evaluations.extend(health_evaluation(dg.AssetKey(group.asset_name), v) for v in verdicts.values())
    return evaluations


def partition_tenants(spec: ExportSpec, group: TenantGroup, calendar: ExportCalendar, day: dt.date) -> list[str]:
    """The tenants whose key a partition of ``group`` holds on ``day``: those of its zone that day, except a tenant
    whose own calendar skipped the day (an empty window has no key)."""
    tenants = []
    for tenant in group.tenants_on(day):
        own = spec.calendar_for(tenant)
        window = own.window(day.isoformat()) if own != calendar else calendar.window(day.isoformat())
        if not window.is_empty:
            tenants.append(tenant)
    return tenants


STUCK_DESCRIPTION = (
    "no key of the asset waits for a person: none in conflict, none failed with its automatic reruns spent, none "
    "failed, remote_unknown or abandoned in_progress too long, none late, no tenant refused by its calendar contract "
    "(reported by reconciliation_sensor when that changes)"
)
DRIFT_DESCRIPTION = (
    "no exported key's source changed since it was exported (as last found by drift_sensor, which reports it when "
    "the set of stale keys changes)"
)
#: The checks judged per partition (the others are the whole asset's).
PARTITION_CHECKS = (HEALTH_CHECK_NAME,)


def check_specs(asset_key: dg.AssetKey, partitions: dg.PartitionsDefinition) -> list[dg.AssetCheckSpec]:
    """The checks of an export's asset, declared on the asset so that its own step reports them (one step, one
    process, whatever is selected: :func:`step_verdicts`).

    - ``partition_health`` (per partition): each tenant's key as the ledger holds it (:mod:`export_ledger.health`),
      and for a completed key, what landed is what the ledger recorded and the run read. One verdict per date
      (earlier versions also declared ``export_matches_source_and_ledger`` for the destination's side): each verdict
      is an event Dagster stores, a third of a backfill chunk's time on its SQLite event log with two.
    - ``no_stuck_exports`` and ``source_unchanged``: the whole asset's, reported by the reconciliation and drift
      sensors; a run reports them only when a person selects them (the
      UI's or the CLI's materialize selects every check of the asset), so that no check it planned is left without
      a verdict.
    """
    with warnings.catch_warnings():
        # Partitioned checks are a preview Dagster API; they are what puts a verdict on each partition in the UI.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return [
            dg.AssetCheckSpec(
                HEALTH_CHECK_NAME, asset=asset_key, partitions_def=partitions, description=HEALTH_DESCRIPTION
            ),
            dg.AssetCheckSpec(STUCK_CHECK_NAME, asset=asset_key, description=STUCK_DESCRIPTION),
            dg.AssetCheckSpec(DRIFT_CHECK_NAME, asset=asset_key, description=DRIFT_DESCRIPTION),
        ]


def step_verdicts(
    instance: dg.DagsterInstance,
    spec: ExportSpec,
    group: TenantGroup,
    ledger: ExportLedger,
    destination: Destination,
    selected: Set[str],
    tenants_by_day: Mapping[dt.date, Sequence[str]],
    batch: ExportBatch | None = None,
    *,
    stuck_after: dt.timedelta,
    max_attempts: int = 3,
    health_days: Mapping[dt.date, Sequence[str]] | None = None,
) -> list[dg.AssetCheckEvaluation]:
    """The verdicts an export's step reports: each ``selected`` check (by name), for each partition of
    ``tenants_by_day`` (a partition's date and its tenants with a key) for ``partition_health``.

    ``batch``: the run's export, whose results say what the run read of each key it exported; None: the checks run
    alone (the health sensor's run, a check executed from the UI), with each completed key's count as the ledger
    recorded it. Either way each completed key is verified at the destination where the ledger says it was published,
    and the source is never read. ``health_days``: every tenant of each date of a run that exported only some of
    them, each judged (a date's verdict is every tenant's); default ``tenants_by_day``. Each partition's verdict
    targets the partition's latest materialization (this run's, for a partition it exported): Dagster counts a
    partitioned check's evaluation in the partition's status only when it targets that materialization, else the
    check's partition shows as Missing.
    """
    asset_key = dg.AssetKey(group.asset_name)
    evaluations = []
    if HEALTH_CHECK_NAME in selected:
        days = tenants_by_day if health_days is None else health_days
        partitions = [day.isoformat() for day in sorted(days)]
        targets = latest_materializations(instance, asset_key, partitions)
        read = read_counts(batch)
        verdicts = partition_health(
            ledger,
            spec.name,
            days,
            stuck_after=stuck_after,
            max_attempts=max_attempts,
            due=due(spec),
            verify=lambda records: destination_problems(ledger, destination, records, read),
        )
        for verdict in verdicts.values():
            evaluation = health_evaluation(asset_key, verdict)
            evaluations.append(targeting(evaluation, targets.get(evaluation.partition)))
    if STUCK_CHECK_NAME in selected:
        evaluations.append(
            stuck_evaluation(spec, ledger, group.asset_name, stuck_after=stuck_after, max_attempts=max_attempts)
        )
    if DRIFT_CHECK_NAME in selected:
        evaluations.append(drift_evaluation(spec, ledger, group))
    return evaluations


def late_by_asset(spec: ExportSpec, late: Sequence[Escalation]) -> dict[str, list[Escalation]]:
    """Late keys of one export by the asset of their tenant's zone on their date."""
    by_asset: dict[str, list[Escalation]] = {}
    for escalation in late:
        if escalation.export != spec.name or escalation.tenant not in spec.tenants:
            continue
        asset = spec.group_of(escalation.tenant, escalation.business_date).asset_name
        by_asset.setdefault(asset, []).append(escalation)
    return by_asset


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
                [
                    {"logical_key": e.name, "state": e.state, "since": utc_iso(e.since)}
                    for e in escalations[:LISTED_KEYS]
                ]
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


def stuck_evaluation(
    spec: ExportSpec, ledger: ExportLedger, asset_name: str, *, stuck_after: dt.timedelta, max_attempts: int = 3
) -> dg.AssetCheckEvaluation:
    """``no_stuck_exports`` of one asset of ``spec`` as the ledger now holds it: its escalated keys (counted in the
    ledger, whatever the backlog) and its late ones."""
    summary = ledger.attention.summary(stuck_after, max_attempts=max_attempts, exports=[spec.name])
    count, listed = asset_groups(spec, summary)[asset_name]
    late = late_keys(ledger, [spec], limit=LISTED_KEYS, beside=(stuck_after, max_attempts))
    late = late_by_asset(spec, late).get(asset_name, [])
    listed = with_late(late, listed, LISTED_KEYS)
    return stuck_check_evaluation(dg.AssetKey(asset_name), count + len(late), listed, stuck_after)


def build_stuck_check(
    spec: ExportSpec, stuck_after: dt.timedelta, *, asset_name: str | None = None, max_attempts: int = 3
) -> dg.AssetChecksDefinition:
    """``no_stuck_exports`` of an export without a source, whose asset is the user's own (an export with a source
    declares it on its asset: :func:`check_specs`). The reconciliation sensor reports the same verdict each time the
    set of escalated keys changes; this check is what lists it on the asset, and runs it on demand from the UI."""
    asset_name = asset_name or spec.name

    @dg.asset_check(
        asset=asset_name,
        name=STUCK_CHECK_NAME,
        description="no export key stuck too long",
        required_resource_keys={LEDGER_KEY},
    )
    def _no_stuck_exports(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        ledger = getattr(context.resources, LEDGER_KEY).get_ledger()
        evaluation = stuck_evaluation(spec, ledger, asset_name, stuck_after=stuck_after, max_attempts=max_attempts)
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


def drift_evaluation(spec: ExportSpec, ledger: ExportLedger, group: TenantGroup) -> dg.AssetCheckEvaluation:
    """``source_unchanged`` of one asset of ``spec``: the stale keys the ledger holds for its tenants (what the drift
    sensor last found; the source is not read), counted in the ledger with the first ones listed."""
    tenants = list(group.tenants) if len(spec.groups) > 1 else []
    listed = ledger.drift.open_records(export=spec.name, tenants=tenants, limit=LISTED_KEYS)
    counts = ledger.drift.open_count(export=spec.name, tenants=tenants)
    return drift_check_evaluation(dg.AssetKey(group.asset_name), listed, counts)
