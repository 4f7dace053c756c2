"""Per-partition truth: each partition's ``partition_health`` verdict, computed from the ledger in one place, reported
by the export's run for its own partitions (a failed run's too) and, for what changes a partition without a run of it,
by ``partition_health_sensor`` through a run of the export's step for the partition's check alone. The statuses a
person must tell apart in the UI (healthy, failed, stale, restating, escalated, missing) each come out as themselves.
"""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pytest
from builders import evidence_for, key_for
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.event_log.base import PartitionKeyFilter
from pipeline_helpers import check_evaluations, failure_message, make_defs, run_partition, run_range, tick

from export_ledger.destinations import DestinationUnreachable
from export_ledger.errors import SourceError
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.health import Evidence, partition_health
from export_ledger.ledger.drift import DriftFinding
from resources.invoices import SampleInvoiceSource

TENANTS = ("acme", "globex")
HEALTHY, FAILED, STALE, RESTATING, ESCALATED, MISSING = (f"2026-03-{d:02d}" for d in range(2, 8))
STUCK_AFTER = dt.timedelta(hours=6)


class GlobexFailsOn(SampleInvoiceSource):
    """The sample invoices, except that globex's source fails on one date (a source error, as a real one would)."""

    def __init__(self, day: str) -> None:
        super().__init__()
        self.day = day

    def rows(self, tenant, start_utc, end_utc):
        if tenant == "globex" and start_utc.date().isoformat() == self.day:
            raise SourceError("the source refused the query")
        return super().rows(tenant, start_utc, end_utc)


SOURCE = GlobexFailsOn(FAILED)


@pytest.fixture
def shop(tmp_path, instance, clocked_ledger):
    """Six partitions of two tenants, one in each state."""
    SOURCE.day = FAILED
    defs = make_defs(tmp_path, tenants=TENANTS, ledger=clocked_ledger, source=SOURCE)
    book = clocked_ledger.get_ledger()
    first = tick(defs, instance, sensor_name="partition_health_sensor")  # its cursor starts here
    for day in (HEALTHY, STALE, RESTATING):
        assert run_partition(defs, instance, day).success
    assert not run_partition(defs, instance, FAILED).success, "globex's source fails: the step fails"
    stale = book.queries.get(str(key_for(dt.date.fromisoformat(STALE), tenant="acme")))
    finding = DriftFinding(stale, rows_added=2, rows_removed=0, rows_changed=None, source_fingerprint="f")
    book.drift.record([finding], [])
    book.restatements.request(
        str(key_for(dt.date.fromisoformat(RESTATING), tenant="globex")), reason="late invoices", requested_by="ops"
    )
    claim = book.claims.claim(key_for(dt.date.fromisoformat(ESCALATED), tenant="acme"), "run-1/invoice_export")
    book.completions.mark_conflict(claim, RuntimeError("something else is there"))
    return defs, book, first.result.cursor


def _days(*days: str) -> dict[dt.date, tuple[str, ...]]:
    return {dt.date.fromisoformat(day): TENANTS for day in days}


def test_each_partition_gets_the_status_of_its_worst_key_with_the_tenant_named(shop) -> None:
    _, book, _ = shop
    verdicts = partition_health(
        book, "invoice_export", _days(HEALTHY, FAILED, STALE, RESTATING, ESCALATED, MISSING), stuck_after=STUCK_AFTER
    )
    statuses = {day.isoformat(): v.status for day, v in verdicts.items()}
    assert statuses == {
        HEALTHY: "healthy",
        FAILED: "failed",
        STALE: "stale",
        RESTATING: "restating",
        ESCALATED: "escalated",
        MISSING: "missing",
    }
    failed = verdicts[dt.date.fromisoformat(FAILED)]
    assert failed.summary == "failed: 1 of 2 tenants (globex)", "the failed tenant is named"
    assert [(k.tenant, k.status) for k in failed.keys] == [("acme", "healthy"), ("globex", "failed")]
    escalated = verdicts[dt.date.fromisoformat(ESCALATED)]
    assert "export-ledger resolve" in escalated.keys[0].note, "the way out is named"
    assert verdicts[dt.date.fromisoformat(STALE)].keys[0].note == "source changed: +2 -0 ~?"


def test_the_destinations_evidence_makes_a_completed_key_differ_and_ranks_below_escalated_only(shop) -> None:
    """``verify`` is asked once about every completed key of the dates, and a key it names ``differs``: worse than
    failed, restating or stale (what readers see is not what the ledger says), never hiding an escalation."""
    _, book, _ = shop
    # globex's key of the escalated date completed: the date holds one escalated key and one the destination says
    # differs, and the escalation shows (a person is asked already).
    claim = book.claims.claim(key_for(dt.date.fromisoformat(ESCALATED), tenant="globex"), "run-2/invoice_export")
    book.completions.complete(claim, evidence_for(claim))
    asked: list[list[str]] = []

    def verify(records):
        asked.append(sorted(r.logical_key for r in records))
        differs = [r for r in records if r.tenant == "acme" or r.business_date.isoformat() == ESCALATED]
        return Evidence(
            matched=frozenset(r.logical_key for r in records if r not in differs),
            differs={r.logical_key: "at the destination: data missing" for r in differs},
        )

    days = _days(HEALTHY, FAILED, RESTATING, ESCALATED, MISSING)
    verdicts = partition_health(book, "invoice_export", days, stuck_after=STUCK_AFTER, verify=verify)
    statuses = {day.isoformat(): v.status for day, v in verdicts.items()}
    assert statuses == {
        HEALTHY: "differs",
        FAILED: "differs",  # acme's completed key differs, globex's failed: the worse one shows
        RESTATING: "differs",
        ESCALATED: "escalated",  # acme's key is in conflict, not completed: never verified
        MISSING: "missing",
    }
    assert len(asked) == 1 and len(asked[0]) == 6, "one question for every completed key of every date"
    escalated = verdicts[dt.date.fromisoformat(ESCALATED)]
    assert [(k.tenant, k.status) for k in escalated.keys] == [("acme", "escalated"), ("globex", "differs")]
    healthy = verdicts[dt.date.fromisoformat(HEALTHY)]
    assert healthy.summary == "differs: 1 of 2 tenants (acme)" and healthy.verified == 1, "globex's key matched"
    assert healthy.keys[0].note == "at the destination: data missing"
    assert (healthy.ledger_status, healthy.ledger_summary) == ("healthy", "healthy: 2 of 2 tenants exported")
    unverified = partition_health(book, "invoice_export", _days(HEALTHY), stuck_after=STUCK_AFTER)
    assert unverified[dt.date.fromisoformat(HEALTHY)].verified == 0, "without evidence nothing is said verified"


def test_the_run_reports_its_own_partitions_and_the_sensor_reruns_the_check_of_the_others(shop, instance) -> None:
    defs, _, cursor = shop
    # The run of each healthy partition already reported its verdict: the sensor asks nothing for it.
    reported = _latest(instance, HEALTHY)
    assert reported is not None and reported.passed and reported.description == "healthy: 2 of 2 tenants exported"
    (materialization,) = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("invoice_export"), asset_partitions=[HEALTHY]), limit=1
    ).records
    target = reported.target_materialization_data
    assert target is not None and target.storage_id == materialization.storage_id, (
        "it judges the partition's materialization (without a target, Dagster shows the check's partition Missing)"
    )

    # The run that failed for globex reported its partition's verdict before it failed: nothing to ask for it either.
    failed = _latest(instance, FAILED)
    assert failed is not None and not failed.passed and failed.metadata["status"].value == "failed", (
        "a failed run's partition gets its failing verdict from the run itself"
    )

    second = tick(defs, instance, cursor, sensor_name="partition_health_sensor")
    requests = {r.tags["dagster/partition"]: r for r in second.result.run_requests}
    assert set(requests) == {STALE, RESTATING, ESCALATED}, "each partition the ledger changed without a run"
    assert {r.job_name for r in requests.values()} == {"invoice_export_health_job"}

    job = defs.resolve_job_def("invoice_export_health_job")
    for partition in sorted(requests):
        assert job.execute_in_process(tags=requests[partition].tags, instance=instance).success
    shown = {p: _latest(instance, p) for p in (FAILED, *requests)}
    assert {p: (e.passed, e.metadata["status"].value) for p, e in shown.items()} == {
        FAILED: (False, "failed"),
        STALE: (False, "stale"),
        RESTATING: (False, "restating"),
        ESCALATED: (False, "escalated"),
    }
    assert shown[ESCALATED].severity is dg.AssetCheckSeverity.ERROR
    assert shown[STALE].severity is dg.AssetCheckSeverity.WARN, "stale data is served, not broken: a warning"

    third = tick(defs, instance, second.result.cursor, sensor_name="partition_health_sensor")
    assert not third.result.run_requests, "every verdict is shown: nothing asked twice"


def test_a_failed_tenant_fails_its_partition_in_dagster_and_its_rerun_makes_it_healthy(shop, instance) -> None:
    defs, _, _ = shop
    asset = defs.get_assets_def("invoice_export")
    status = instance.get_status_by_partition(dg.AssetKey("invoice_export"), [HEALTHY, FAILED], asset.partitions_def)
    assert status == {HEALTHY: dg.AssetPartitionStatus.MATERIALIZED, FAILED: dg.AssetPartitionStatus.FAILED}

    SOURCE.day = None  # the source recovers; the rerun exports globex and skips acme
    rerun = run_partition(defs, instance, FAILED)
    assert rerun.success
    status = instance.get_status_by_partition(dg.AssetKey("invoice_export"), [FAILED], asset.partitions_def)
    assert status == {FAILED: dg.AssetPartitionStatus.MATERIALIZED}
    (verdict,) = check_evaluations(rerun, "partition_health").values()
    assert verdict.passed and verdict.description == "healthy: 2 of 2 tenants exported"


def test_a_check_planned_by_a_run_that_died_before_judging_is_asked_for_again(
    tmp_path, instance, clocked_ledger, monkeypatch
):
    """A run plans its checks (Materialize from the UI, the export's job); one whose step died before it could judge
    (a crash once its keys were recorded: nothing after it runs, as in a killed process) leaves them planned: the
    sensor must not take that for a check still running."""
    SOURCE.day = None
    defs = make_defs(tmp_path, tenants=TENANTS, ledger=clocked_ledger, source=SOURCE)
    first = tick(defs, instance, sensor_name="partition_health_sensor")
    asset = dg.AssetKey("invoice_export")
    job = defs.resolve_implicit_global_asset_job_def().get_subset(
        asset_selection={asset}, asset_check_selection={dg.AssetCheckKey(asset, "partition_health")}
    )
    monkeypatch.setenv(FAILPOINTS, "after_commit=crash")
    died = job.execute_in_process(partition_key=FAILED, instance=instance, raise_on_error=False)
    monkeypatch.delenv(FAILPOINTS)
    assert not died.success and "SimulatedCrash" in failure_message(died)
    records = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(asset, "partition_health"), limit=1, partition_filter=PartitionKeyFilter(key=FAILED)
    )
    assert records and records[0].status is AssetCheckExecutionRecordStatus.PLANNED, "planned, never evaluated"

    second = tick(defs, instance, first.result.cursor, sensor_name="partition_health_sensor")
    assert [r.tags["dagster/partition"] for r in second.result.run_requests] == [FAILED]


def _latest(instance: dg.DagsterInstance, partition: str):
    records = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("invoice_export"), "partition_health"),
        limit=1,
        partition_filter=PartitionKeyFilter(key=partition),
    )
    return records[0].event.dagster_event.event_specific_data if records and records[0].event else None


def test_check_evaluations_of_a_range_run_are_one_per_partition(tmp_path, instance) -> None:
    defs = make_defs(tmp_path, tenants=TENANTS)
    result = run_range(defs, instance, "2026-03-02", "2026-03-04")
    assert result.success
    health = check_evaluations(result, "partition_health")
    assert sorted(health) == ["2026-03-02", "2026-03-03", "2026-03-04"]
    assert all(e.passed for e in health.values())


def _health_runs(defs, instance, cursor, rounds: int) -> list[tuple[str, list[tuple[bool, str]]]]:
    """``rounds`` ticks of partition_health_sensor, each run it asks for executed: (run key, its verdicts)."""
    job = defs.resolve_job_def("invoice_export_health_job")
    launched = []
    for _ in range(rounds):
        ticked = tick(defs, instance, cursor, sensor_name="partition_health_sensor")
        cursor = ticked.result.cursor
        for request in ticked.result.run_requests:
            run = job.execute_in_process(tags=request.tags, instance=instance, raise_on_error=False)
            launched.append((request.run_key, [(e.passed, e.description) for e in run.get_asset_check_evaluations()]))
    return launched


def test_a_date_the_destination_says_differs_is_judged_again_only_when_the_ledgers_side_changes(
    tmp_path, instance, clocked_ledger, clock
) -> None:
    """A date whose shown verdict is ``differs`` (globex's data removed at the destination) and whose ledger verdict
    stays ``restating`` (a restatement request waiting past the stuck threshold, which the sensor looks at every
    tick): the sensor compares the ledger's side with the ledger's side, and asks for one run, not one a tick (found
    by the review of the merged check: the run key names the shown evaluation, new after every run).
    Guard: the comparison with the ``ledger_verdict`` metadata."""
    defs = make_defs(tmp_path, tenants=TENANTS, ledger=clocked_ledger, source=SampleInvoiceSource())
    book = clocked_ledger.get_ledger()
    first = tick(defs, instance, sensor_name="partition_health_sensor")
    assert run_partition(defs, instance, HEALTHY).success
    (data,) = [p for p in (tmp_path / "exports").rglob("data.*") if "globex" in str(p)]
    data.unlink()
    book.restatements.request(str(key_for(dt.date.fromisoformat(HEALTHY), tenant="acme")), reason="late",
                              requested_by="ops")  # fmt: skip
    clock.advance(hours=7)

    launched = _health_runs(defs, instance, first.result.cursor, rounds=4)

    assert [verdicts for _, verdicts in launched] == [[(False, "differs: 1 of 2 tenants (globex)")]], launched


def test_a_destination_that_does_not_answer_leaves_the_ledgers_verdict_noted_not_a_failed_run(
    tmp_path, instance, clocked_ledger, clock, monkeypatch
) -> None:
    """The health run verifies at the destination; one that cannot be reached leaves each key's ledger status, noted
    and counted as not verified, instead of failing the run (which left the date 'execution failed' and was asked
    for again on every tick), and is asked once, not once per key (a timeout each). Guards: DestinationUnreachable
    caught per key in destination_problems, and the destinations that did not answer skipped."""
    defs = make_defs(tmp_path, tenants=TENANTS, ledger=clocked_ledger, source=SampleInvoiceSource())
    book = clocked_ledger.get_ledger()
    first = tick(defs, instance, sensor_name="partition_health_sensor")
    assert run_partition(defs, instance, HEALTHY).success
    book.restatements.request(str(key_for(dt.date.fromisoformat(HEALTHY), tenant="acme")), reason="late",
                              requested_by="ops")  # fmt: skip
    clock.advance(hours=7)
    from export_ledger.destinations.publishing import PublishingDestination

    asked: list[str] = []

    def unreachable(self, target, *, logical_key, sha256):
        asked.append(logical_key)
        raise DestinationUnreachable("the store did not answer")

    monkeypatch.setattr(PublishingDestination, "verify_recorded", unreachable)

    launched = _health_runs(defs, instance, first.result.cursor, rounds=3)
    assert len(asked) == 1, f"a destination that did not answer is not asked again in the same verdict: {asked}"

    assert [verdicts for _, verdicts in launched] == [[(False, "restating: 1 of 2 tenants (acme)")]], launched
    shown = _latest(instance, HEALTHY).metadata
    assert shown["unverified_keys"].value == 2, shown
    notes = {r.data["tenant"]: (r.data["status"], r.data["note"]) for r in shown["keys"].records}
    assert notes == {
        "acme": ("restating", "revision 2 requested, not verified: the destination did not answer"),
        "globex": ("unverified", "not verified: the destination did not answer"),
    }, notes


def test_a_key_the_destination_could_not_be_asked_about_is_unverified_a_warning_never_healthy(shop) -> None:
    """A date whose keys are all exported as the ledger says, whose destination did not answer, is not passed:
    ``unverified`` (a warning); a worse ledger status stays, noted."""
    _, book, _ = shop

    def silent(records):
        return Evidence(unverified={r.logical_key: "not verified: the destination did not answer" for r in records})

    verdicts = partition_health(book, "invoice_export", _days(HEALTHY, STALE), stuck_after=STUCK_AFTER, verify=silent)
    healthy, stale = verdicts[dt.date.fromisoformat(HEALTHY)], verdicts[dt.date.fromisoformat(STALE)]
    assert (healthy.status, healthy.summary, healthy.unverified) == ("unverified", "unverified: 2 of 2 tenants "
                                                                     "(acme, globex)", 2)  # fmt: skip
    assert (stale.status, stale.keys[0].status, stale.keys[1].status) == ("stale", "stale", "unverified")
    assert stale.keys[0].note == "source changed: +2 -0 ~?, not verified: the destination did not answer"


def test_the_destination_is_asked_only_about_the_partitions_own_keys(shop) -> None:
    """A tenant's key of a date on which it is not one of the partition's tenants (it moved to another zone, whose
    asset judges it) is not verified here. Guard: ``done`` built from each date's own tenants."""
    _, book, _ = shop
    asked: list[str] = []

    def verify(records):
        asked.extend(sorted(f"{r.tenant}@{r.business_date.isoformat()}" for r in records))
        return Evidence(matched=frozenset(r.logical_key for r in records))

    days = {dt.date.fromisoformat(HEALTHY): TENANTS, dt.date.fromisoformat(STALE): ("acme",)}
    partition_health(book, "invoice_export", days, stuck_after=STUCK_AFTER, verify=verify)
    assert sorted(asked) == sorted([f"acme@{HEALTHY}", f"globex@{HEALTHY}", f"acme@{STALE}"]), asked
