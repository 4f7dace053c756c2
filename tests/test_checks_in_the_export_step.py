"""Each check of an export is judged once, by the step that knows the answer (issue 27): the export's own step reports
its one partitioned check (``partition_health``: the ledger's side and the destination's, one verdict per date) for
every partition it ran, a failed run's included, each verdict naming the partition's
materialization; a check never reads the source again; the health sensor's refresh is that same step asked for the
check alone. ``tests/test_processes.py`` runs the same through ``dagster asset materialize``."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter

import dagster as dg
import pandas as pd
import pytest
from builders import open_ledger
from pipeline_helpers import JOB, failure_message, make_defs, run_range

from export_ledger import ExportSpec
from export_ledger.dagster import ledgered_definitions
from export_ledger.errors import SourceError
from resources.invoices import SampleInvoiceSource

ASSET = dg.AssetKey("invoice_export")
CHECKS = ("partition_health",)
GOOD, BAD, ALSO_GOOD = "2026-03-02", "2026-03-03", "2026-03-04"


class CountedSource(SampleInvoiceSource):
    """The sample invoices, counting each read of a tenant's window; globex's read fails on ``fails_on``."""

    def __init__(self, fails_on: str | None = None) -> None:
        super().__init__()
        self.fails_on = fails_on
        self.reads: Counter[tuple[str, str]] = Counter()

    def rows(self, tenant, start_utc, end_utc):
        self.reads[(tenant, start_utc.isoformat())] += 1
        if tenant == "globex" and start_utc.date().isoformat() == self.fails_on:
            raise SourceError("the source refused the query")
        return super().rows(tenant, start_utc, end_utc)


def _executions(instance: dg.DagsterInstance, check: str, asset: dg.AssetKey = ASSET) -> dict[str | None, object]:
    """The latest execution record of each partition of a check (None: its unpartitioned ones)."""
    latest: dict[str | None, object] = {}
    for record in instance.event_log_storage.get_asset_check_execution_history(dg.AssetCheckKey(asset, check), 100):
        latest.setdefault(record.partition, record)
    return latest


def _verdict(record) -> dg.AssetCheckEvaluation:
    return record.event.dagster_event.event_specific_data


def test_a_run_that_fails_for_one_tenant_on_one_date_reports_every_date_and_names_each_good_dates_materialization(
    tmp_path, instance
):
    source = CountedSource(fails_on=BAD)
    defs = make_defs(tmp_path, tenants=("acme", "globex"), source=source)

    result = run_range(defs, instance, GOOD, ALSO_GOOD)

    assert not result.success and "the source refused the query" in failure_message(result), "globex's key fails it"
    status = instance.get_status_by_partition(ASSET, [GOOD, BAD, ALSO_GOOD], defs.get_assets_def(ASSET).partitions_def)
    assert status == {
        GOOD: dg.AssetPartitionStatus.MATERIALIZED,
        BAD: dg.AssetPartitionStatus.FAILED,
        ALSO_GOOD: dg.AssetPartitionStatus.MATERIALIZED,
    }
    materializations = {
        r.partition_key: r.storage_id
        for r in instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=ASSET), limit=10).records
        if r.run_id == result.run_id
    }
    assert sorted(materializations) == [GOOD, ALSO_GOOD]
    for check in CHECKS:
        latest = _executions(instance, check)
        assert sorted(p for p in latest if p) == [GOOD, BAD, ALSO_GOOD], f"{check}: a verdict for every date of the run"
        assert {p: r.run_id for p, r in latest.items()} == dict.fromkeys([GOOD, BAD, ALSO_GOOD], result.run_id), (
            f"{check}: judged by the run itself, not by a later step of its own"
        )
        assert {p: r.status.value for p, r in latest.items()} == {
            GOOD: "SUCCEEDED",
            BAD: "FAILED",
            ALSO_GOOD: "SUCCEEDED",
        }, f"{check}: every date of the run judged, none left planned"
        verdicts = {p: _verdict(r) for p, r in latest.items()}
        for good in (GOOD, ALSO_GOOD):
            target = verdicts[good].target_materialization_data
            assert target is not None and target.storage_id == materializations[good], (
                f"{check} on {good} names the materialization this run recorded (else Dagster shows it Missing)"
            )
        assert verdicts[BAD].target_materialization_data is None, "the bad date has no materialization to name"
    bad_health = _verdict(_executions(instance, "partition_health")[BAD])
    assert bad_health.description == "failed: 1 of 2 tenants (globex)"
    assert bad_health.severity is dg.AssetCheckSeverity.ERROR
    keys = [(r.data["tenant"], r.data["status"], r.data["note"]) for r in bad_health.metadata["keys"].records]
    assert keys == [("acme", "healthy", ""), ("globex", "failed", "failed; the reconciliation sensor reruns it")], (
        "the failed key is named in the library's words, never the source's error text"
    )
    assert bad_health.metadata["verified_at_destination"].value == 1, "acme's completed key verified where it landed"
    every = instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records
    assert len(every) == 3, "one verdict per date, no second check judging the same keys"
    for whole in ("no_stuck_exports", "source_unchanged"):
        assert not _executions(instance, whole), f"{whole} is the sensors' to report, not each export run's"


def test_each_key_is_read_once_by_a_run_with_every_check_and_never_by_a_check_run_alone(tmp_path):
    reads: Counter[tuple[str, dt.datetime]] = Counter()

    def orders(tenant: str, start: dt.datetime, end: dt.datetime) -> pd.DataFrame:
        reads[(tenant, start)] += 1
        times = pd.date_range(pd.Timestamp(start).ceil("h"), pd.Timestamp(end), freq="h", inclusive="left")
        return pd.DataFrame(
            {"order_id": [f"{tenant}-{i:03d}" for i in range(len(times))], "placed_at": times.as_unit("us")}
        )

    spec = ExportSpec(
        name="orders",
        source=orders,  # a callable: counting its rows would call it again (CallableSource.count is len(rows()))
        columns={"order_id": "string", "placed_at": "timestamp"},
        id_columns=["order_id"],
        time_column="placed_at",
        tenants=["acme", "globex"],
        timezone="America/New_York",
        start_date="2026-03-01",
    )
    defs = ledgered_definitions(
        [spec],
        environ={
            "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
            "EXPORTS_DESTINATION": str(tmp_path / "exports"),
        },
    )
    asset = dg.AssetKey("orders")
    implicit = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        # What `dagster asset materialize --select orders --partition 2026-03-08` runs: the asset and all its checks.
        run = implicit.execute_in_process(partition_key="2026-03-08", instance=instance, asset_selection=[asset])
        assert run.success
        assert sorted(e.check_name for e in run.get_asset_check_evaluations()) == sorted(
            ["partition_health", "no_stuck_exports", "source_unchanged"]
        ), "every check selected, each judged once, in the one step"
        # The check executed from the UI on the partition, alone: judged from the ledger and the destination.
        alone = implicit.get_subset(
            asset_check_selection={dg.AssetCheckKey(asset, "partition_health")}, asset_selection=set()
        ).execute_in_process(partition_key="2026-03-08", instance=instance)
        (verdict,) = alone.get_asset_check_evaluations()
        assert verdict.passed and verdict.metadata["verified_at_destination"].value == 2, verdict
        # The same on a date never exported: its two keys were never claimed, which fails it (a check of the
        # destination's side alone used to pass it with "0 keys match", found by the review of issue 27).
        never = implicit.get_subset(
            asset_check_selection={dg.AssetCheckKey(asset, "partition_health")}, asset_selection=set()
        ).execute_in_process(partition_key="2026-03-09", instance=instance)
        (verdict,) = never.get_asset_check_evaluations()
        assert not verdict.passed, verdict
        assert verdict.description == "missing: 2 of 2 tenants (acme, globex)", verdict
    assert sorted(reads) == [(t, dt.datetime(2026, 3, 8, 5, tzinfo=dt.timezone.utc)) for t in ("acme", "globex")]
    assert set(reads.values()) == {1}, f"one read per key, none by a check: {reads}"


def test_the_health_sensors_refresh_is_the_export_step_alone_exporting_and_reading_nothing(tmp_path, instance):
    source = CountedSource()
    defs = make_defs(tmp_path, tenants=("acme", "globex"), source=source)
    assert run_range(defs, instance, GOOD, GOOD).success
    read = sum(source.reads.values())

    refresh = defs.resolve_job_def("invoice_export_health_job").execute_in_process(
        instance=instance, tags={"dagster/partition": GOOD}
    )

    assert refresh.success
    assert [e.step_key for e in refresh.all_events if e.is_step_start] == ["invoice_export"], "one step"
    assert refresh.get_asset_materialization_events() == [], "nothing exported"
    assert sum(source.reads.values()) == read, "nothing read from the source"
    (verdict,) = refresh.get_asset_check_evaluations()
    assert (verdict.check_name, verdict.partition, verdict.passed) == ("partition_health", GOOD, True)
    (materialization,) = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[GOOD]), limit=1
    ).records
    assert verdict.target_materialization_data.storage_id == materialization.storage_id


@pytest.mark.parametrize("damage", ["data removed", "pointer's sha256 changed", "rows differ from what the run read"])
def test_a_completed_key_whose_destination_disagrees_makes_its_date_differ_an_error_naming_it(
    tmp_path, instance, monkeypatch, damage
):
    """The destination's side is judged in the same verdict as the ledger's (the two partitioned checks were merged,
    issue 27): a completed key whose data is gone, or whose published rows are not the rows the run read, turns the
    date ``differs``, an ERROR whose keys table names the key; the other tenant stays healthy."""
    source = CountedSource()
    defs = make_defs(tmp_path, tenants=("acme", "globex"), source=source)
    if damage != "rows differ from what the run read":
        assert run_range(defs, instance, GOOD, GOOD).success
        if damage == "data removed":
            (data,) = [p for p in (tmp_path / "exports").rglob("data.*") if "globex" in str(p)]
            data.unlink()
        else:  # what readers follow no longer names the recorded revision as the ledger recorded it
            (pointer,) = [p for p in (tmp_path / "exports").rglob("_current.json") if "globex" in str(p)]
            pointer.write_text(json.dumps({**json.loads(pointer.read_text()), "sha256": "0" * 64}))
        result = defs.resolve_job_def("invoice_export_health_job").execute_in_process(
            instance=instance, tags={"dagster/partition": GOOD}
        )
        expected_note = "at the destination:"
    else:
        from export_ledger.dagster import checks

        # The run's own count of what it read is one more than what it published (a source read twice would say so).
        def misread(batch):
            return {r.logical_key: r.row_count + (r.tenant == "globex") for r in batch.results} if batch else {}

        monkeypatch.setattr(checks, "read_counts", misread)
        result = run_range(defs, instance, GOOD, GOOD)
        expected_note = "rows published,"
    (verdict,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "partition_health"]
    assert (verdict.passed, verdict.severity) == (False, dg.AssetCheckSeverity.ERROR), verdict
    assert verdict.description == "differs: 1 of 2 tenants (globex)"
    keys = {r.data["tenant"]: (r.data["status"], r.data["note"]) for r in verdict.metadata["keys"].records}
    assert keys["acme"] == ("healthy", "")
    assert keys["globex"][0] == "differs" and expected_note in keys["globex"][1], keys
    if damage != "rows differ from what the run read":
        # The way out the README gives: a restatement, whose run publishes revision 2 from the source.

        book = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
        (record,) = book.queries.records(export="invoice_export", tenants=["globex"])
        book.restatements.request(record.logical_key, reason="data lost", requested_by="ops")
        restated = run_range(defs, instance, GOOD, GOOD)
        (after,) = [e for e in restated.get_asset_check_evaluations() if e.check_name == "partition_health"]
        assert after.passed and after.metadata["verified_at_destination"].value == 2, after.metadata["keys"]


def test_dagster_keeps_one_runless_evaluation_of_a_partitioned_check_per_partition():
    """Why ``partition_health_sensor`` refreshes a verdict with a run rather than a runless evaluation, as the other
    sensors do for the unpartitioned checks: Dagster 1.13.27 refuses the second runless evaluation of a partitioned
    check's partition (its unique index on asset, check, run id and partition; every runless event has run id "").
    When this test fails, Dagster lifted the limit and the sensor can report events instead of launching runs."""
    check = {"asset_key": ASSET, "check_name": "partition_health"}
    with dg.instance_for_test() as instance:
        for _ in range(3):
            instance.report_runless_asset_event(dg.AssetCheckEvaluation(**{**check, "check_name": "no_stuck_exports"},
                                                                        passed=True))  # fmt: skip
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(**check, passed=True, partition=GOOD))
        with pytest.raises(Exception, match="UNIQUE constraint failed"):
            instance.report_runless_asset_event(dg.AssetCheckEvaluation(**check, passed=False, partition=GOOD))


@pytest.mark.parametrize("where", ["asset", "io_manager"])
def test_a_run_refused_before_it_exports_leaves_each_dates_verdict_as_the_ledger_says(
    tmp_path, instance, monkeypatch, where
):
    """A run that fails before exporting anything (a launchpad config naming an unknown tenant, refused by the asset;
    the I/O manager failing before its export, here its lineage emitter) reports the ledger's verdicts for its dates:
    left planned, Dagster would show dates that passed as 'execution failed' although nothing changed (found by the
    review of issue 27)."""
    # A location loaded with lineage (its receiver down: the first runs' events are not delivered, a warning each).
    monkeypatch.setenv("EXPORTS_OPENLINEAGE_URL", "http://127.0.0.1:9/")
    defs = make_defs(tmp_path, tenants=("acme", "globex"), env={"EXPORTS_OPENLINEAGE_URL": "http://127.0.0.1:9/"})
    assert run_range(defs, instance, GOOD, ALSO_GOOD).success
    config = None
    if where == "asset":
        config = {"ops": {"invoice_export": {"config": {"restate_reason": "x", "restate_tenants": ["typo"]}}}}
    else:
        from export_ledger import lineage

        def refuse(*_args, **_kwargs):
            raise RuntimeError("the lineage settings are unusable")

        monkeypatch.setattr(lineage.LineageEmitter, "__init__", refuse)
    result = defs.resolve_job_def(JOB).execute_in_process(
        instance=instance,
        raise_on_error=False,
        run_config=config,
        tags={"dagster/asset_partition_range_start": GOOD, "dagster/asset_partition_range_end": ALSO_GOOD},
    )

    assert not result.success, "the run is refused"
    for check in CHECKS:
        latest = _executions(instance, check)
        assert {p: (r.run_id, r.status.value) for p, r in latest.items() if p} == {
            day: (result.run_id, "SUCCEEDED") for day in (GOOD, BAD, ALSO_GOOD)
        }, f"{check}: each date judged by the refused run from the ledger (every key completed): passed"
