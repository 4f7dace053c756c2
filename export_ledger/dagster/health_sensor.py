"""``partition_health_sensor``: each partition's ``partition_health`` verdict in the UI follows the ledger.

An export's run reports the verdict of its own partitions from its step, a failed run's included. What changes a
partition without a run of it — a reconciliation, a drift found, a restatement asked, a key escalated by the passing
of time — is found here from the ledger, and the partition's check is judged again when the ledger's verdict differs
from the ledger's side of the one the UI shows (its ``ledger_verdict`` metadata): by a run of the asset's
``..._health_job`` for that partition, which is the export's one step asked for ``partition_health`` alone (nothing
exported, nothing read from the source; judged from the ledger and verified at the destination).

Why runs, not runless check evaluations (the way the reconciliation and drift sensors report ``no_stuck_exports`` and
``source_unchanged``): Dagster 1.13 stores a runless evaluation of a partitioned check under the run id ``""``, and its
unique index on (asset, check, run id, partition) refuses the second one for the same partition (measured with
dagster 1.13.27 on SQLite and PostgreSQL: ``IntegrityError``, which would fail the sensor's tick). An unpartitioned
check has a NULL partition, which the index does not compare, so those two can be reported runless on every change.
A run of the check is what Dagster itself records without limit.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping, Sequence

import dagster as dg
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.event_log.base import PartitionKeyFilter

from export_ledger.calendar import utc_iso
from export_ledger.dagster.checks import HEALTH_CHECK_NAME, LEDGER_VERDICT, health_evaluations
from export_ledger.dagster.io_manager import LISTED_KEYS
from export_ledger.dagster.resources import LEDGER_KEY
from export_ledger.ledger import DEFAULT_MAX_ATTEMPTS, ExportLedger
from export_ledger.spec import ExportSpec

HEALTH_TAG = "export-ledger/health"
PARTITION_TAG = "dagster/partition"


def health_job_name(asset_name: str) -> str:
    return f"{asset_name}_health_job"


def build_health_sensor(
    exports: Sequence[ExportSpec],
    jobs: Sequence[dg.JobDefinition | dg.UnresolvedAssetJobDefinition],
    *,
    stuck_after: dt.timedelta,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    batch_size: int = 100,
    minimum_interval_seconds: int = 30,
) -> dg.SensorDefinition:
    """One sensor for every export with a source. Each tick reads at most ``batch_size`` new attempts, drift records
    and restatement requests (a cursor of their ids) and the first escalated keys, and asks for a run of the check of
    each of their partitions whose verdict changed (at most ``batch_size`` partitions a tick)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    by_name = {spec.name: spec for spec in exports if spec.source is not None}

    @dg.sensor(
        name="partition_health_sensor",
        jobs=list(jobs),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        required_resource_keys={LEDGER_KEY},
        description=(
            "Judges partition_health again (a one-step run of the check alone) on each partition the ledger changed "
            "without a run of it (a reconciliation, drift, a restatement request, an escalation), so each partition's "
            "verdict in the UI is the ledger's."
        ),
    )
    def partition_health_sensor(context: dg.SensorEvaluationContext, **_resources) -> dg.SensorResult:
        state = json.loads(context.cursor) if context.cursor else {}
        book: ExportLedger = getattr(context.resources, LEDGER_KEY).get_ledger()
        touched, after = book.queries.touched_partitions(after=state.get("after"), limit=batch_size)
        escalated = book.attention.needs_attention(
            stuck_after, max_attempts=max_attempts, exports=sorted(by_name), limit=LISTED_KEYS
        )
        for escalation in escalated:
            day = escalation.record.business_date if escalation.record is not None else escalation.business_date
            if day is not None and escalation.timezone is not None:
                touched.append((escalation.export, escalation.timezone, day))
        requests = health_requests(context.instance, book, by_name, touched[: batch_size + LISTED_KEYS],
                                   stuck_after=stuck_after, max_attempts=max_attempts)  # fmt: skip
        cursor = json.dumps({"after": after})
        if not requests:
            return dg.SensorResult(
                skip_reason=f"{len(touched)} partition(s) looked at, every verdict as shown ({utc_iso(book.now())})",
                cursor=cursor,
            )
        return dg.SensorResult(run_requests=requests, cursor=cursor)

    return partition_health_sensor


def health_requests(
    instance: dg.DagsterInstance,
    ledger: ExportLedger,
    exports: Mapping[str, ExportSpec],
    touched: Sequence[tuple[str, str, dt.date]],
    *,
    stuck_after: dt.timedelta,
    max_attempts: int,
) -> list[dg.RunRequest]:
    """A run of ``partition_health`` alone for each touched partition whose verdict differs from its latest recorded
    one.

    The run key names the verdict and the evaluation it replaces: the same change asked again on the next tick
    (its run not finished yet) launches nothing twice, and a verdict that comes back after another is asked anew."""
    wanted: dict[str, dict[str, set[str]]] = {}
    for export, zone, day in touched:
        spec = exports.get(export)
        group = spec.group_of_zone(zone) if spec is not None else None
        if group is not None:
            wanted.setdefault(export, {}).setdefault(group.asset_name, set()).add(day.isoformat())
    requests = []
    for export, by_asset in wanted.items():
        for evaluation in health_evaluations(
            exports[export], ledger, by_asset, stuck_after=stuck_after, max_attempts=max_attempts
        ):
            shown, shown_id = _latest(instance, evaluation.asset_key, evaluation.partition)
            # Like with like: the ledger's side of the verdict shown (a date the destination says differs keeps
            # its verdict until the ledger's changes: the sensor judges from the ledger alone, the run verifies).
            if shown in ("running", evaluation.description):
                continue
            asset = evaluation.asset_key.to_user_string()
            verdict = hashlib.sha256(f"{evaluation.passed}|{evaluation.description}".encode()).hexdigest()[:12]
            requests.append(
                dg.RunRequest(
                    job_name=health_job_name(asset),
                    run_key=f"health/{asset}/{evaluation.partition}/{verdict}/{shown_id}",
                    # The partition as a tag: a job of checks alone has no partitions definition of its own in
                    # Dagster 1.13 (it drops the one it is given), and the check reads its partition from the run.
                    tags={HEALTH_TAG: "true", PARTITION_TAG: evaluation.partition},
                )
            )
    return requests


def _latest(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str | None):
    """The ledger's side of the latest recorded verdict of a partition's ``partition_health`` (its summary, from the
    ``ledger_verdict`` metadata; a verdict recorded before it existed: its description), and its record's id; a
    check still running is ``"running"`` (nothing is asked beside it)."""
    records = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(asset_key, HEALTH_CHECK_NAME), limit=1, partition_filter=PartitionKeyFilter(key=partition)
    )
    if not records:
        return None, 0
    record = records[0]
    if record.status is AssetCheckExecutionRecordStatus.PLANNED:
        # Planned by a run: still to come while the run runs; a run that ended without evaluating it (its step died
        # before it could judge, or it was asked for the check and refused its run config) shows no verdict, and the
        # check is asked for again.
        run = instance.get_run_by_id(record.run_id)
        if run is not None and not run.is_finished:
            return "running", record.id
        return None, record.id
    data = record.event.dagster_event.event_specific_data if record.event and record.event.dagster_event else None
    if data is None:
        return None, record.id
    ledger_side = data.metadata.get(LEDGER_VERDICT)
    return (ledger_side.value if ledger_side is not None else data.description), record.id
