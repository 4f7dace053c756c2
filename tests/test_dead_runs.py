"""Runs whose worker died where nothing reported it (issue 26, §3): the ledger knows their leases ended and their keys
were taken over; the reconciliation sensor marks them failed in Dagster, and never a healthy run.

The decision is a pure function (:func:`export_ledger.dead_runs.judge_run`), tested first on its own; then the
sensor on a real Dagster instance (in memory) and a SQLite ledger driven by the test's clock. The end-to-end test (a
code server's process group killed mid-backfill on PostgreSQL) is ``tests/test_e2e_dead_runs.py``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging

import dagster as dg
import pytest
from builders import evidence_for, key_for
from pipeline_helpers import JOB, make_defs, tick

from export_ledger.dagster.sensors import end_dead_runs
from export_ledger.dead_runs import Finding, Lease, RunLedger, Watch, judge_run, run_of
from export_ledger.ledger import AttemptOutcome, AttemptRecord, ExportState

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 3, 20, 9, 30, tzinfo=UTC)
RUN = "4f1c2a9e-0d7b-4c55-9a51-2b8f3e6d7c10"
ATTEMPT = f"{RUN}/invoice_export"


def _row(row_id: int, outcome: AttemptOutcome, attempt: str = ATTEMPT, at: dt.datetime = NOW) -> AttemptRecord:
    return AttemptRecord(row_id, attempt, f"key-{row_id}", 1, at - dt.timedelta(minutes=20), at, outcome, None, None)


# -- the decision ----------------------------------------------------------------------------------------------


def test_a_run_that_lost_every_key_it_held_and_holds_none_has_ended():
    verdict = judge_run(RunLedger(RUN, keys_lost=2, last_lost_at=NOW - dt.timedelta(minutes=1)), NOW)
    assert verdict.finding is Finding.ENDED and verdict.ended
    assert "2 key(s) recorded abandoned" in verdict.why, "the reason says what the ledger recorded"


def test_a_run_holding_a_live_lease_is_not_ended():
    run = RunLedger(RUN, keys_lost=1, last_lost_at=NOW, leases=(Lease(ATTEMPT, NOW + dt.timedelta(seconds=1)),))
    verdict = judge_run(run, NOW)
    assert verdict.finding is Finding.LIVE and not verdict.ended, "a live lease is a working attempt"


def test_a_run_with_one_of_two_attempts_still_live_is_not_ended():
    """Two steps of one run: one's key was taken over, the other's lease is live."""
    leases = (Lease(f"{RUN}/other_step", NOW + dt.timedelta(minutes=5)),)
    verdict = judge_run(RunLedger(RUN, keys_lost=1, last_lost_at=NOW, leases=leases), NOW)
    assert not verdict.ended and verdict.finding is Finding.LIVE
    assert f"{RUN}/other_step" in verdict.why


def test_a_run_with_no_ledger_attempts_is_not_touched():
    """A run that never claimed a key (slow to start, or dead before its claim): the ledger cannot tell."""
    verdict = judge_run(RunLedger(RUN), NOW)
    assert verdict.finding is Finding.NOTHING_LOST and not verdict.ended


def test_a_run_whose_lease_ended_is_not_ended_until_its_key_is_taken_over():
    run = RunLedger(RUN, keys_lost=1, last_lost_at=NOW, leases=(Lease(ATTEMPT, NOW - dt.timedelta(seconds=1)),))
    verdict = judge_run(run, NOW)
    assert verdict.finding is Finding.NOT_TAKEN_OVER and not verdict.ended, "reconciliation takes the key first"


def test_a_run_heard_from_after_it_lost_a_key_is_not_ended():
    """It stalled past its lease, then woke and tried to commit (refused: fenced): alive, not dead."""
    watch = Watch().seen([_row(1, AttemptOutcome.ABANDONED), _row(2, AttemptOutcome.FENCED)], after=2)
    verdict = judge_run(watch.losing[RUN], NOW)
    assert verdict.finding is Finding.HEARD_FROM and not verdict.ended


def test_a_later_loss_brings_a_run_heard_from_back_to_judgement():
    watch = Watch().seen(
        [_row(1, AttemptOutcome.ABANDONED), _row(2, AttemptOutcome.COMPLETED), _row(3, AttemptOutcome.ABANDONED)],
        after=3,
    )
    assert watch.losing[RUN].keys_lost == 2 and not watch.losing[RUN].heard_after
    assert judge_run(watch.losing[RUN], NOW).ended


def test_rows_of_runs_that_lost_nothing_are_not_watched():
    watch = Watch().seen([_row(1, AttemptOutcome.COMPLETED), _row(2, AttemptOutcome.REFUSED)], after=2)
    assert watch.losing == {} and watch.after == 2


def test_the_watch_survives_the_sensor_cursor():
    watch = Watch().seen([_row(7, AttemptOutcome.ABANDONED)], after=9)
    assert Watch.from_json(json.loads(json.dumps(watch.to_json()))) == watch


def test_an_attempt_id_names_its_run():
    assert run_of(ATTEMPT) == RUN and run_of(RUN) == RUN


# -- the sensor on a Dagster instance ----------------------------------------------------------------------------

PARTITION = "2026-03-08"


def _started_run(defs: dg.Definitions, instance: dg.DagsterInstance) -> dg.DagsterRun:
    """A run of the export's job that Dagster has STARTED, as the daemon leaves it when its worker's host is lost."""
    job = defs.resolve_job_def(JOB)
    return instance.create_run_for_job(job, status=dg.DagsterRunStatus.STARTED, tags={"dagster/partition": PARTITION})


def _status(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dg.DagsterRunStatus:
    return instance.get_run_by_id(run.run_id).status


def _failure_messages(instance: dg.DagsterInstance, run: dg.DagsterRun) -> list[str]:
    records = instance.fetch_run_status_changes(dg.DagsterEventType.RUN_FAILURE, limit=100).records
    return [r.event_log_entry.dagster_event.message for r in records if r.run_id == run.run_id]


@pytest.fixture
def defs(tmp_path, clocked_ledger):
    return make_defs(tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger)


def test_a_started_run_whose_keys_were_taken_over_is_marked_failed_with_why_in_its_log(
    defs, instance, clocked_ledger, clock
):
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    for tenant in ("acme", "globex"):
        ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant=tenant), f"{run.run_id}/invoice_export")
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED
    first = tick(defs, instance)
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED, "its leases are live: the run is working"

    clock.advance(seconds=ledger.lease_ttl.total_seconds() + 1)  # the worker died: its leases end
    second = tick(defs, instance, first.cursor)
    assert _status(instance, run) is dg.DagsterRunStatus.FAILURE, "the ledger knows the run is dead: Dagster too"
    (message,) = _failure_messages(instance, run)
    assert "reconciliation_sensor" in message and "2 key(s) recorded abandoned" in message, message
    assert any(run.run_id in r.getMessage() and "marked failed" in r.getMessage().lower() for r in second.logs), (
        "the sensor's log names the run and why"
    )
    abandoned = [a for a in ledger.queries.all_attempts() if a.outcome is AttemptOutcome.ABANDONED]
    assert {a.attempt_id for a in abandoned} == {f"{run.run_id}/invoice_export"}
    assert {r.state for r in ledger.queries.records()} == {ExportState.FAILED}
    assert [r.partition_key for r in second.result.run_requests] == [PARTITION], "its partition is rerun"

    tick(defs, instance, second.cursor)
    assert len(_failure_messages(instance, run)) == 1, "a run is marked failed once"


def test_a_run_with_a_second_attempt_still_live_is_left_started_until_that_lease_ends_too(
    defs, instance, clocked_ledger, clock
):
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    ttl = ledger.lease_ttl.total_seconds()
    ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant="acme"), f"{run.run_id}/invoice_export")
    clock.advance(seconds=ttl - 60)
    ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant="globex"), f"{run.run_id}/other_step")
    clock.advance(seconds=61)  # the first lease has ended, the second lives

    first = tick(defs, instance)
    assert [a.attempt_id for a in ledger.queries.all_attempts() if a.outcome is AttemptOutcome.ABANDONED] == [
        f"{run.run_id}/invoice_export"
    ], "the ended lease's key was taken over"
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED, "an attempt of the run still holds a live lease"
    assert any("holds a live lease" in r.getMessage() for r in first.logs)

    clock.advance(seconds=ttl)
    tick(defs, instance, first.cursor)
    assert _status(instance, run) is dg.DagsterRunStatus.FAILURE


def test_a_slow_run_that_lost_nothing_is_never_touched(defs, instance, clocked_ledger, clock):
    """STARTED for hours, and its keys completed (or never claimed): the ledger has no loss of it."""
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    other = _started_run(defs, instance)  # a run that lost its key: the sensor reads rows and judges this tick
    attempt = f"{run.run_id}/invoice_export"
    claim = ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant="acme"), attempt)
    ledger.completions.complete(claim, evidence_for(claim))
    ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant="globex"), f"{other.run_id}/invoice_export")
    clock.advance(hours=5)
    tick(defs, instance)
    assert _status(instance, other) is dg.DagsterRunStatus.FAILURE
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED, "a run that lost no key is at most slow"


def test_a_run_that_finished_is_left_as_it_finished(defs, instance, clocked_ledger, clock):
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant="acme"), f"{run.run_id}/invoice_export")
    instance.report_run_canceled(run)
    clock.advance(hours=1)
    tick(defs, instance)
    assert _status(instance, run) is dg.DagsterRunStatus.CANCELED
    assert _failure_messages(instance, run) == []


def test_a_tick_marks_at_most_its_batch_of_dead_runs_and_the_next_tick_the_rest(tmp_path, instance, clocked_ledger,
                                                                                 clock):  # fmt: skip
    """Both runs' keys were taken over by a retry's claims (not by reconciliation) before the tick."""
    defs = make_defs(tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger, reconcile_batch_size=1)
    ledger = clocked_ledger.get_ledger()
    runs = [_started_run(defs, instance) for _ in range(2)]
    keys = [key_for(dt.date(2026, 3, 8), tenant=tenant) for tenant in ("acme", "globex")]
    for run, key in zip(runs, keys, strict=True):
        ledger.claims.claim(key, f"{run.run_id}/invoice_export")
    clock.advance(hours=1)
    ledger.claims.claim_many(keys, "a-retry/invoice_export")
    cursor = None
    ended = []
    for _ in range(2):
        cursor = tick(defs, instance, cursor).cursor
        ended.append(sum(_status(instance, run) is dg.DagsterRunStatus.FAILURE for run in runs))
    assert ended == [1, 2], "one dead run a tick at batch size 1, the other on the next tick"


def test_a_run_heard_from_in_a_row_not_read_yet_is_not_ended(defs, instance, clocked_ledger, clock):
    """The run stalled past one key's lease (taken over) and then completed another key: two rows, read one a tick.
    Judged after the first row alone it would look dead; the sensor judges only once it has read every row."""
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    attempt = f"{run.run_id}/invoice_export"
    lost, kept = (key_for(dt.date(2026, 3, 8), tenant=tenant) for tenant in ("acme", "globex"))
    claims = ledger.claims.claim_many([lost, kept], attempt)
    clock.advance(seconds=ledger.lease_ttl.total_seconds() - 60)
    (renewed,) = ledger.claims.renew_many([claims[1]])
    clock.advance(seconds=61)
    ledger.claims.claim(lost, "a-retry/invoice_export")  # takes the ended lease over: the run's attempt abandoned
    ledger.completions.complete(renewed, evidence_for(renewed))  # the run was alive all along
    watch, log = Watch(after=0), logging.getLogger("test_dead_runs")
    for _ in range(3):
        watch, ended = end_dead_runs(instance, ledger, ["invoice_export"], watch, limit=10, log=log, attempts_read=1)
        assert ended == []
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED, "a run heard from after its loss is alive"


def test_a_run_of_another_code_locations_export_is_left_to_that_location(defs, instance, clocked_ledger, clock):
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    theirs = key_for(dt.date(2026, 3, 8), export="payments_export")
    ledger.claims.claim(theirs, f"{run.run_id}/payments_export")
    clock.advance(hours=1)
    ledger.claims.claim(theirs, "their-retry/payments_export")
    log = logging.getLogger("test_dead_runs")
    _, ended = end_dead_runs(instance, ledger, ["invoice_export"], Watch(after=0), limit=10, log=log)
    assert ended == [] and _status(instance, run) is dg.DagsterRunStatus.STARTED
