"""The asset checks of an export's asset: their names, how each verdict is computed, and the ``no_stuck_exports``
and ``source_unchanged`` checks."""

import datetime as dt
import warnings
from collections.abc import Mapping, Sequence

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (  # the target of a check's evaluation
    AssetCheckEvaluationTargetMaterializationData,
)

from export_ledger.calendar import ExportCalendar, utc_iso
from export_ledger.dagster.io_manager import LISTED_KEYS, status_command
from export_ledger.dagster.partitions import partitions_def
from export_ledger.dagster.resources import LEDGER_KEY, resource_keys
from export_ledger.deadlines import due_at, late_keys
from export_ledger.destinations import Destination, Verdict, place_of_location
from export_ledger.drift import describe
from export_ledger.errors import CalendarError
from export_ledger.health import SEVERE, STATUSES, PartitionHealth, partition_health
from export_ledger.keys import LogicalKey
from export_ledger.ledger import AttentionSummary, DriftRecord, Escalation, ExportLedger, ExportRecord, ExportState
from export_ledger.placement import recorded_destinations
from export_ledger.protocol import ExportResult, target_for
from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup

CHECK_NAME = "export_matches_source_and_ledger"
HEALTH_CHECK_NAME = "partition_health"
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


def export_check(
    spec: ExportSpec,
    ledger: ExportLedger,
    destination: Destination,
    results: Sequence[ExportResult | ExportRecord],
    *,
    asset_key: dg.AssetKey,
    partition: str,
) -> dg.AssetCheckEvaluation:
    """``export_matches_source_and_ledger`` of one partition: each of its keys completed in the ledger, its current
    recorded revision intact where it was recorded
    (:meth:`~export_ledger.destinations.Destination.verify_recorded`: its manifest names the key, its data's sha256
    is the ledger's), and its row count what the run read from the source (a ledger record's: the source's count)."""
    problems: list[str] = []
    records = {result.logical_key: ledger.queries.get(result.logical_key) for result in results}
    # A key exported under an earlier contract (kept when the destination changed) is checked where it was exported.
    places = recorded_destinations(
        ledger, [r for r in records.values() if r is not None], known=destination, fallback=lambda _: destination
    )
    for result in results:
        record = records[result.logical_key]
        if record is None or record.state is not ExportState.COMPLETED:
            problems.append(f"{result.logical_key}: not completed in the ledger")
            continue
        current = ledger.restatements.current_revision(record.logical_key)
        key = LogicalKey(record.export, record.tenant, record.window)
        target = target_for(key, current.revision, place_of_location(current.location))
        seen = places[record.logical_key].verify_recorded(
            target, logical_key=record.logical_key, sha256=current.sha256
        )
        if seen.verdict is not Verdict.PUBLISHED:
            problems.append(f"{record.logical_key}: {seen.detail}")
            continue
        # A run's result: the rows it read and wrote, never a second read of the source (a streamed callable
        # source is a generator, read once: issue 26). A ledger record (the check run on its own): the source's count.
        expected_rows = (
            result.row_count
            if isinstance(result, ExportResult)
            else spec.count(record.tenant, record.window_start_utc, record.window_end_utc)
        )
        published_rows = seen.manifest.row_count
        if expected_rows is not None and published_rows != expected_rows:
            problems.append(f"{record.logical_key}: {published_rows} rows published, {expected_rows} read from source")
    return dg.AssetCheckEvaluation(
        check_name=CHECK_NAME,
        asset_key=asset_key,
        partition=partition,
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"keys_checked": len(results), "problems": dg.MetadataValue.json(problems[:LISTED_KEYS])},
        description=f"{len(problems)} of {len(results)} keys differ" if problems else f"{len(results)} keys match",
    )


CHECK_DESCRIPTION = (
    "each key of the partition is completed in the ledger, its current revision's data at the destination has the "
    "ledger's sha256, and its row count equals the source's for its window"
)
HEALTH_DESCRIPTION = (
    "the ledger's verdict on the partition: healthy (every tenant exported, current, source unchanged), or the worst "
    "of its keys: escalated (waits for a person), failed (rerun by the reconciliation sensor), restating (a new "
    "revision requested), stale (source changed since export), in_progress, missing (never attempted)"
)


def due(spec: ExportSpec):
    """When each tenant's key of a date is due (None: the export has no deadline), for :func:`partition_health`."""
    return None if spec.deadline is None else (lambda tenant, day: due_at(spec, tenant, day))


def health_evaluation(asset_key: dg.AssetKey, verdict: PartitionHealth) -> dg.AssetCheckEvaluation:
    """The ``partition_health`` verdict of one partition: an ERROR while a key is escalated or failed, a WARN while
    one is restating, stale, in progress or missing. Counts, states and the library's notes only, never values."""
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
            tenants_by_day[day] = _partition_tenants(spec, group, calendar, day)
        verdicts = partition_health(
            ledger, spec.name, tenants_by_day, stuck_after=stuck_after, max_attempts=max_attempts, due=due(spec)
        )
        evaluations.extend(health_evaluation(dg.AssetKey(group.asset_name), v) for v in verdicts.values())
    return evaluations


def _partition_tenants(spec: ExportSpec, group: TenantGroup, calendar: ExportCalendar, day: dt.date) -> list[str]:
    """The tenants whose key a partition of ``group`` holds on ``day``: those of its zone that day, except a tenant
    whose own calendar skipped the day (an empty window has no key)."""
    tenants = []
    for tenant in group.tenants_on(day):
        own = spec.calendar_for(tenant)
        window = own.window(day.isoformat()) if own != calendar else calendar.window(day.isoformat())
        if not window.is_empty:
            tenants.append(tenant)
    return tenants


def build_partition_checks(
    spec: ExportSpec,
    group: TenantGroup,
    *,
    stuck_after: dt.timedelta,
    max_attempts: int = 3,
) -> list[dg.AssetChecksDefinition]:
    """The two partitioned checks of one zone's asset, runnable on any partition from the UI: the export's run
    reports them for its partitions, the sensors for the partitions a tick changed.

    - ``export_matches_source_and_ledger``: what landed is what the ledger recorded and the source holds.
    - ``partition_health``: the ledger's verdict (:mod:`export_ledger.health`).
    """
    with warnings.catch_warnings():
        # Partitioned checks are a preview Dagster API; they are what puts a verdict on each partition in the UI.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return _partition_checks(spec, group, stuck_after=stuck_after, max_attempts=max_attempts)


def _partition_checks(
    spec: ExportSpec, group: TenantGroup, *, stuck_after: dt.timedelta, max_attempts: int
) -> list[dg.AssetChecksDefinition]:
    calendar = ExportCalendar(group.timezone, spec.start_date)
    partitions = partitions_def(calendar, group.last_date)
    asset_key = dg.AssetKey(group.asset_name)
    destination_key = resource_keys(spec)[0]

    def days_of(context: dg.AssetCheckExecutionContext) -> dict[dt.date, list[str]]:
        op = context.op_execution_context
        keys = op.partition_keys if op.has_partition_key or op.has_partition_key_range else []
        return {
            (day := calendar.window(key).business_date): _partition_tenants(spec, group, calendar, day) for key in keys
        }

    def worst(evaluations: list[dg.AssetCheckEvaluation], context: dg.AssetCheckExecutionContext):
        """One result for the check's step: the partition's verdict; for a range, each partition's is logged and
        the step's result is the first failing one's (or the last passing one's)."""
        if not evaluations:
            return dg.AssetCheckResult(passed=False, metadata={"problem": "no partition selected"})
        if len(evaluations) > 1:
            for evaluation in evaluations:
                context.op_execution_context.log_event(evaluation)
        chosen = next((e for e in evaluations if not e.passed), evaluations[-1])
        return dg.AssetCheckResult(
            passed=chosen.passed, severity=chosen.severity, metadata=chosen.metadata, description=chosen.description
        )

    @dg.asset_check(
        asset=asset_key,
        name=CHECK_NAME,
        partitions_def=partitions,
        description=CHECK_DESCRIPTION,
        required_resource_keys={LEDGER_KEY, destination_key},
    )
    def _matches(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        book = getattr(context.resources, LEDGER_KEY).get_ledger()
        destination = getattr(context.resources, destination_key).get_destination()
        evaluations = []
        for day, tenants in days_of(context).items():
            records = book.queries.records(export=spec.name, business_dates=[day], tenants=tenants)
            evaluations.append(
                export_check(spec, book, destination, records, asset_key=asset_key, partition=day.isoformat())
            )
        return worst(evaluations, context)

    @dg.asset_check(
        asset=asset_key,
        name=HEALTH_CHECK_NAME,
        partitions_def=partitions,
        description=HEALTH_DESCRIPTION,
        required_resource_keys={LEDGER_KEY},
    )
    def _health(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        book = getattr(context.resources, LEDGER_KEY).get_ledger()
        verdicts = partition_health(
            book, spec.name, days_of(context), stuck_after=stuck_after, max_attempts=max_attempts, due=due(spec)
        )
        return worst([health_evaluation(asset_key, v) for v in verdicts.values()], context)

    return [_matches, _health]


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
        late = late_by_asset(spec, late_keys(ledger, [spec], limit=LISTED_KEYS)).get(asset_name, [])
        count, listed = count + len(late), (late + listed)[:LISTED_KEYS]
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
        counts = drift.open_count(export=export, tenants=tenants)
        evaluation = drift_check_evaluation(dg.AssetKey(asset_name), listed, counts)
        return dg.AssetCheckResult(
            passed=evaluation.passed,
            severity=evaluation.severity,
            metadata=evaluation.metadata,
            description=evaluation.description,
        )

    return _source_unchanged
