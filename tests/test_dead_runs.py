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
import threading
import time

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import evidence_for, hourly_orders, key_for, open_ledger
from pipeline_helpers import JOB, make_defs, tick

from export_ledger.dagster.sensors import end_dead_runs
from export_ledger.dead_runs import GAP_WAIT, Finding, Lease, RunLedger, Watch, judge_run, run_of
from export_ledger.destinations import LocalDestination
from export_ledger.frames import ExportSchema
from export_ledger.ledger import AttemptOutcome, AttemptRecord, ExportState
from export_ledger.ledger.queries import AttemptPage
from export_ledger.protocol import ExportBatch, ExportBatchFailed, ExportItem, export_batch

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 3, 20, 9, 30, tzinfo=UTC)
LEASE = dt.timedelta(minutes=15)  # how long a run must be quiet after its latest loss
LOST = NOW - LEASE  # a loss a whole lease ago
RUN = "4f1c2a9e-0d7b-4c55-9a51-2b8f3e6d7c10"
ATTEMPT = f"{RUN}/invoice_export"


def _row(row_id: int, outcome: AttemptOutcome, attempt: str = ATTEMPT, at: dt.datetime = LOST) -> AttemptRecord:
    return AttemptRecord(row_id, attempt, f"key-{row_id}", 1, at - dt.timedelta(minutes=20), at, outcome, None, None)


def _page(*rows: AttemptRecord, after: int = 0, ids: tuple[int, ...] | None = None) -> AttemptPage:
    """A page of attempt rows as the ledger reads it (``ids``: every id read, default the rows' own)."""
    return AttemptPage(after, ids if ids is not None else tuple(row.id for row in rows), rows, False)


# -- the decision ----------------------------------------------------------------------------------------------


def test_a_run_that_lost_every_key_it_held_and_holds_none_has_ended():
    verdict = judge_run(RunLedger(RUN, keys_lost=2, last_lost_at=LOST), NOW, LEASE)
    assert verdict.finding is Finding.ENDED and verdict.ended
    assert "2 key(s) recorded abandoned" in verdict.why, "the reason says what the ledger recorded"


def test_a_run_that_lost_its_keys_less_than_a_lease_ago_is_not_ended_yet():
    """Its group's leases ended while it read one slow key (a group renews only between keys): it may be alive."""
    run = RunLedger(RUN, keys_lost=3, last_lost_at=LOST + dt.timedelta(seconds=1))
    verdict = judge_run(run, NOW, LEASE)
    assert verdict.finding is Finding.RECENT and not verdict.ended, "a loss less than a lease ago proves nothing yet"
    assert judge_run(run, NOW + dt.timedelta(seconds=1), LEASE).ended, "quiet for a whole lease after its loss: ended"


def test_a_run_holding_a_live_lease_is_not_ended():
    run = RunLedger(RUN, keys_lost=1, last_lost_at=LOST, leases=(Lease(ATTEMPT, NOW + dt.timedelta(seconds=1)),))
    verdict = judge_run(run, NOW, LEASE)
    assert verdict.finding is Finding.LIVE and not verdict.ended, "a live lease is a working attempt"


def test_a_run_with_one_of_two_attempts_still_live_is_not_ended():
    """Two steps of one run: one's key was taken over, the other's lease is live."""
    leases = (Lease(f"{RUN}/other_step", NOW + dt.timedelta(minutes=5)),)
    verdict = judge_run(RunLedger(RUN, keys_lost=1, last_lost_at=LOST, leases=leases), NOW, LEASE)
    assert not verdict.ended and verdict.finding is Finding.LIVE
    assert f"{RUN}/other_step" in verdict.why


def test_a_run_with_no_ledger_attempts_is_not_touched():
    """A run that never claimed a key (slow to start, or dead before its claim): the ledger cannot tell."""
    verdict = judge_run(RunLedger(RUN), NOW, LEASE)
    assert verdict.finding is Finding.NOTHING_LOST and not verdict.ended


def test_a_run_whose_lease_ended_is_not_ended_until_its_key_is_taken_over():
    run = RunLedger(RUN, keys_lost=1, last_lost_at=LOST, leases=(Lease(ATTEMPT, NOW - dt.timedelta(seconds=1)),))
    verdict = judge_run(run, NOW, LEASE)
    assert verdict.finding is Finding.NOT_TAKEN_OVER and not verdict.ended, "reconciliation takes the key first"


def test_a_run_heard_from_after_it_lost_a_key_is_not_ended():
    """It stalled past its lease, then woke and tried to commit (refused: fenced): alive, not dead."""
    watch = Watch(after=0).seen(_page(_row(1, AttemptOutcome.ABANDONED), _row(2, AttemptOutcome.FENCED)), NOW)
    verdict = judge_run(watch.losing[RUN], NOW, LEASE)
    assert verdict.finding is Finding.HEARD_FROM and not verdict.ended


def test_a_later_loss_brings_a_run_heard_from_back_to_judgement():
    rows = (_row(1, AttemptOutcome.ABANDONED), _row(2, AttemptOutcome.COMPLETED), _row(3, AttemptOutcome.ABANDONED))
    watch = Watch(after=0).seen(_page(*rows), NOW)
    assert watch.losing[RUN].keys_lost == 2 and not watch.losing[RUN].heard_after
    assert judge_run(watch.losing[RUN], NOW, LEASE).ended


def test_rows_of_runs_that_lost_nothing_are_not_watched():
    watch = Watch(after=0).seen(_page(_row(1, AttemptOutcome.COMPLETED), _row(2, AttemptOutcome.REFUSED)), NOW)
    assert watch.losing == {} and watch.after == 2


def test_the_watch_survives_the_sensor_cursor():
    watch = Watch(after=6).seen(_page(_row(7, AttemptOutcome.ABANDONED), ids=(7, 9)), NOW)
    assert watch.waiting is not None, "id 8 is missing: the watch waits for it"
    assert Watch.from_json(json.loads(json.dumps(watch.to_json()))) == watch


# -- attempt rows read in id order, none skipped -----------------------------------------------------------------


def test_a_missing_id_holds_the_watch_back_until_its_row_is_read():
    """Id 1 is not committed yet when id 2 is read: the watch stays before it and reads id 2 again next time."""
    loss, other = _row(1, AttemptOutcome.ABANDONED), _row(2, AttemptOutcome.FAILED, attempt="other/invoice_export")
    watch = Watch(after=0).seen(_page(other), NOW)
    assert (watch.after, watch.losing) == (0, {}), "nothing is taken past a missing id"
    watch = watch.seen(_page(loss, other), NOW + dt.timedelta(seconds=30))
    assert watch.after == 2 and watch.losing[RUN].keys_lost == 1, "the row committed late is read"
    assert watch.waiting is None


def test_a_row_heard_after_a_missing_loss_is_taken_after_it():
    """The loss (id 1) commits after the run's own later row (id 2): taken in id order, the run was heard from."""
    watch = Watch(after=0).seen(_page(_row(2, AttemptOutcome.COMPLETED)), NOW)
    watch = watch.seen(_page(_row(1, AttemptOutcome.ABANDONED), _row(2, AttemptOutcome.COMPLETED)), NOW)
    assert judge_run(watch.losing[RUN], NOW, LEASE).finding is Finding.HEARD_FROM


def test_an_id_missing_for_longer_than_gap_wait_is_passed_over():
    """A transaction rolled back after it took id 1: the watch waits GAP_WAIT for it, then goes on."""
    loss = _row(2, AttemptOutcome.ABANDONED)
    watch = Watch(after=0).seen(_page(loss), NOW)
    watch = watch.seen(_page(loss), NOW + GAP_WAIT - dt.timedelta(seconds=1))
    assert watch.after == 0, "still within GAP_WAIT: id 1 may yet commit"
    watch = watch.seen(_page(loss), NOW + GAP_WAIT)
    assert watch.after == 2 and watch.losing[RUN].keys_lost == 1 and watch.waiting is None


def test_a_fresh_watch_waits_for_no_missing_id():
    """The sensor's first tick starts anywhere in the ledger's history (pruned rows leave ids missing)."""
    watch = Watch().seen(_page(_row(5, AttemptOutcome.ABANDONED), after=2), NOW)
    assert watch.after == 5 and RUN in watch.losing


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
    abandoned = [a for a in ledger.queries.all_attempts() if a.outcome is AttemptOutcome.ABANDONED]
    assert {a.attempt_id for a in abandoned} == {f"{run.run_id}/invoice_export"}
    assert {r.state for r in ledger.queries.records()} == {ExportState.FAILED}
    assert [r.partition_key for r in second.result.run_requests] == [PARTITION], "its partition is rerun"
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED, "lost a moment ago: it may be reading a key"

    clock.advance(seconds=ledger.lease_ttl.total_seconds())  # quiet for a lease since: its worker is gone
    third = tick(defs, instance, second.cursor)
    assert _status(instance, run) is dg.DagsterRunStatus.FAILURE, "the ledger knows the run is dead: Dagster too"
    (message,) = _failure_messages(instance, run)
    assert "reconciliation_sensor" in message and "2 key(s) recorded abandoned" in message, message
    assert any(run.run_id in r.getMessage() and "marked failed" in r.getMessage().lower() for r in third.logs), (
        "the sensor's log names the run and why"
    )

    tick(defs, instance, third.cursor)
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

    clock.advance(seconds=ttl)  # the second lease has ended too: its key is taken over now
    second = tick(defs, instance, first.cursor)
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED, "its last loss is recent"
    clock.advance(seconds=ttl)
    tick(defs, instance, second.cursor)
    assert _status(instance, run) is dg.DagsterRunStatus.FAILURE


def test_a_slow_run_that_lost_nothing_is_never_touched(defs, instance, clocked_ledger, clock):
    """STARTED for hours, and its keys completed (or never claimed): the ledger has no loss of it."""
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    other = _started_run(defs, instance)  # a run that lost its key: the sensor reads rows and judges it
    attempt = f"{run.run_id}/invoice_export"
    claim = ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant="acme"), attempt)
    ledger.completions.complete(claim, evidence_for(claim))
    ledger.claims.claim(key_for(dt.date(2026, 3, 8), tenant="globex"), f"{other.run_id}/invoice_export")
    clock.advance(hours=5)
    first = tick(defs, instance)
    clock.advance(seconds=ledger.lease_ttl.total_seconds())
    tick(defs, instance, first.cursor)
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
    clock.advance(seconds=ledger.lease_ttl.total_seconds())  # quiet for a lease since
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


# -- a slow run that is alive --------------------------------------------------------------------------------------

ORDERS = ExportSchema(
    {"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"},
    "placed_at",
    ("order_id",),
    tenant_column="tenant",
)


def test_a_run_whose_group_leases_ended_while_it_read_one_slow_key_is_not_marked_failed(
    tmp_path, instance, clocked_ledger, clock
):
    """The reviewer's case (issue 26): a group of three keys is claimed; key 1's source takes longer than the rest of
    the lease, so the group's leases are not renewed in time (a group renews only between keys), every one of them
    ends and the sensor takes them over while the run is still reading. The run is alive: it goes on to its next
    group. Marked failed there, its pool slots would be freed and run_retries would start a second copy of it."""
    tenants = [f"t{i:02d}" for i in range(6)]
    defs = make_defs(tmp_path, tenants=tenants, ledger=clocked_ledger)
    ledger = clocked_ledger.get_ledger()
    run = _started_run(defs, instance)
    ttl = ledger.lease_ttl.total_seconds()
    during: list[dg.DagsterRunStatus] = []
    cursor: list[str] = []

    def source(key):
        def read() -> pd.DataFrame:
            if key.tenant == "t01":  # the slow key: past every lease of its group, and the sensor ticks meanwhile
                clock.advance(seconds=ttl + 1)
                cursor.append(tick(defs, instance).cursor)
                during.append(_status(instance, run))
            return hourly_orders(key)

        return read

    day = dt.date(2026, 3, 2)
    items = [ExportItem(key_for(day, tenant=t), day.isoformat(), source(key_for(day, tenant=t))) for t in tenants]
    batch = ExportBatch(ORDERS, items)
    with pytest.raises(ExportBatchFailed):  # the first group's keys were taken over: its commits are refused
        export_batch(ledger, LocalDestination(str(tmp_path / "exports")), batch, f"{run.run_id}/invoice_export",
                     group_size=3)  # fmt: skip
    lost = {a.logical_key for a in ledger.queries.all_attempts() if a.outcome is AttemptOutcome.ABANDONED}
    assert lost == {str(item.key) for item in items[:3]}, "the tick took the first group over, as it should"
    assert during == [dg.DagsterRunStatus.STARTED], "a run that lost its keys a moment ago may be reading: left alone"
    assert sorted(r.logical_key for r in batch.results) == sorted(str(i.key) for i in items[3:]), "it went on"

    clock.advance(seconds=ttl + 1)  # a whole lease after the loss: the run was heard from (its second group)
    tick(defs, instance, cursor[0])
    assert _status(instance, run) is dg.DagsterRunStatus.STARTED, "a run heard from after its loss is alive"


# -- attempt rows committed out of id order (PostgreSQL) -----------------------------------------------------------

#: The test's advisory lock: a takeover's ``abandoned`` row waits on it, inside its transaction, once inserted.
HELD = 2026


@pytest.mark.postgres
def test_a_loss_committed_after_a_later_row_is_still_read_and_its_dead_run_failed(
    postgres_url, instance, tmp_path, clock
):
    """On PostgreSQL an id is taken at the INSERT and becomes visible at the commit: a takeover's ``abandoned`` row
    (id n) can commit after another worker's row (id n + 1). A cursor moved to the highest id read would never read
    id n: the dead run would be left to max_runtime_seconds. The takeover here is the ledger's own claim, held in its
    transaction by a trigger that waits on the test's advisory lock once the row is inserted."""
    ledger = open_ledger(postgres_url, clock=clock)
    defs = make_defs(tmp_path, tenants=["acme", "globex"])
    dead, live = _started_run(defs, instance), _started_run(defs, instance)
    dead_key, live_key = (key_for(dt.date(2026, 3, 8), tenant=tenant) for tenant in ("acme", "globex"))
    ledger.claims.claim(dead_key, f"{dead.run_id}/invoice_export")
    clock.advance(seconds=ledger.lease_ttl.total_seconds() + 1)  # the dead run's lease ends
    live_claim = ledger.claims.claim(live_key, f"{live.run_id}/invoice_export")
    log = logging.getLogger("test_dead_runs")
    watch, _ = end_dead_runs(instance, ledger, ["invoice_export"], Watch(), limit=10, log=log)

    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE FUNCTION wait_for_test() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF NEW.outcome = 'abandoned' THEN PERFORM pg_advisory_xact_lock({HELD}); END IF; RETURN NEW; END $$"
        ))  # fmt: skip
        conn.execute(sa.text(
            "CREATE TRIGGER wait_for_test AFTER INSERT ON export_attempts FOR EACH ROW EXECUTE FUNCTION wait_for_test()"
        ))  # fmt: skip
        newest = conn.execute(sa.text("SELECT coalesce(max(id), 0) FROM export_attempts")).scalar_one()
    holder = engine.connect()
    holder.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": HELD})
    retry = threading.Thread(target=ledger.claims.claim, args=(dead_key, "a-retry/invoice_export"))
    try:
        retry.start()  # the retry takes the dead run's key over: its abandoned row gets id newest + 1, uncommitted
        deadline = time.monotonic() + 30
        while _sequence_at(engine) <= newest:
            assert time.monotonic() < deadline, "the takeover never inserted its row"
            time.sleep(0.05)
        ledger.completions.complete(live_claim, evidence_for(live_claim))  # id newest + 2, committed first
        watch, ended = end_dead_runs(instance, ledger, ["invoice_export"], watch, limit=10, log=log)
        assert ended == [], "the loss is not committed yet: nothing to judge"
    finally:
        holder.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": HELD})
        retry.join(timeout=30)
        holder.close()
        engine.dispose()
    ids = {a.outcome: a.id for a in ledger.queries.all_attempts()}
    assert ids[AttemptOutcome.ABANDONED] < ids[AttemptOutcome.COMPLETED], "the loss has the lower id, committed last"

    clock.advance(seconds=ledger.lease_ttl.total_seconds() + 1)  # quiet for a lease after its loss
    _, ended = end_dead_runs(instance, ledger, ["invoice_export"], watch, limit=10, log=log)
    assert ended == [dead.run_id], "the loss committed out of id order was read, and its dead run failed"
    assert _status(instance, dead) is dg.DagsterRunStatus.FAILURE
    assert _status(instance, live) is dg.DagsterRunStatus.STARTED


@pytest.mark.postgres
def test_a_run_is_not_judged_while_an_id_below_its_latest_rows_is_missing(postgres_url, instance, tmp_path, clock):
    """A takeover's transaction fails after its INSERT took an id: that id never commits. Until GAP_WAIT has passed
    the sensor cannot tell it from a row about to commit, so it judges no run meanwhile: the run below lost a key
    (the row before the missing id) and was heard from (the row after it)."""
    ledger = open_ledger(postgres_url, clock=clock)
    defs = make_defs(tmp_path, tenants=["acme", "globex", "initech"])
    run = _started_run(defs, instance)
    ttl = ledger.lease_ttl.total_seconds()
    lost, kept, doomed = (key_for(dt.date(2026, 3, 8), tenant=tenant) for tenant in ("acme", "globex", "initech"))
    claims = ledger.claims.claim_many([lost, kept], f"{run.run_id}/invoice_export")
    ledger.claims.claim(doomed, "doomed/invoice_export")
    clock.advance(seconds=ttl - 60)
    (renewed,) = ledger.claims.renew_many([claims[1]])
    clock.advance(seconds=61)
    ledger.claims.claim(lost, "a-retry/invoice_export")  # the run's loss
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE FUNCTION refuse_doomed() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.attempt_id LIKE 'doomed/%' THEN RAISE EXCEPTION 'refused by the test'; END IF; RETURN NEW; END $$"
        ))  # fmt: skip
        conn.execute(sa.text(
            "CREATE TRIGGER refuse_doomed AFTER INSERT ON export_attempts FOR EACH ROW EXECUTE FUNCTION refuse_doomed()"
        ))  # fmt: skip
    engine.dispose()
    with pytest.raises(sa.exc.DBAPIError, match="refused by the test"):  # its row took an id, then it rolled back
        ledger.claims.claim(doomed, "another/invoice_export")
    ledger.completions.complete(renewed, evidence_for(renewed))  # the run is heard from, after the missing id
    ids = [a.id for a in ledger.queries.all_attempts()]
    assert len(ids) == 2 and ids[1] - ids[0] == 2, f"one id is missing between the loss and the completion: {ids}"

    clock.advance(seconds=ttl)  # a lease after the loss
    log = logging.getLogger("test_dead_runs")
    watch, ended = end_dead_runs(instance, ledger, ["invoice_export"], Watch(after=0), limit=10, log=log)
    assert ended == [] and watch.after == ids[0], "nothing past the missing id is taken, and nobody is judged"
    clock.advance(seconds=GAP_WAIT.total_seconds())
    watch, ended = end_dead_runs(instance, ledger, ["invoice_export"], watch, limit=10, log=log)
    assert watch.after == ids[1] and watch.waiting is None, "an id missing for GAP_WAIT is passed over"
    assert ended == [] and _status(instance, run) is dg.DagsterRunStatus.STARTED, "the run was heard from"


def _sequence_at(engine: sa.Engine) -> int:
    """The last id export_attempts' sequence gave (committed or not); 0 before its first (a fresh sequence reads
    ``last_value`` 1 with ``is_called`` false)."""
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM export_attempts_id_seq")
        ).scalar_one()
