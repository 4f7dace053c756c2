"""The export ledger's contract, run once per backend (SQLite and PostgreSQL) through the ``ledger_url`` fixture.

Every test gets a fresh database (SQLite file or PostgreSQL schema) and a controllable clock; nothing here sleeps.
"""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from builders import ZONE, evidence_for, key_for, open_ledger

from export_ledger.calendar import ExportCalendar, ExportWindow, window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import (
    AlreadyCompleted,
    AttemptRecord,
    Claim,
    ContractChanged,
    EmptyWindow,
    ExportLedger,
    FencedOut,
    LeaseHeld,
    LedgerError,
    NeedsReconciliation,
    WindowNotOver,
    ledger_engine,
)
from export_ledger.ledger.schema import AttemptOutcome, ExportState, export_runs

UTC = dt.timezone.utc
TTL = dt.timedelta(minutes=15)
pytestmark = pytest.mark.usefixtures("ledger_url")  # the `ledger` fixture on each backend in turn


def claim_live(ledger: ExportLedger, key: LogicalKey, attempt_id: str) -> Claim:
    outcome = ledger.claims.claim(key, attempt_id)
    assert isinstance(outcome, Claim), f"{attempt_id} should have won the lease on {key}, got {outcome!r}"
    return outcome


def outcomes(attempts: list[AttemptRecord]) -> list[tuple[str, AttemptOutcome]]:
    return [(a.attempt_id, a.outcome) for a in attempts]


# -- claiming --------------------------------------------------------------------------------------------------------


def test_first_claim_creates_one_in_progress_row_with_token_one_and_the_keys_window(ledger, clock):
    key = key_for()

    claim = claim_live(ledger, key, "run-1/export")

    assert claim.fencing_token == 1, "the first claim on a key starts the fencing sequence at 1"
    assert claim.previous_state is None, "a first claim has no previous state"
    assert claim.window == key.window, "a first claim exports the window it was asked for"
    assert claim.lease_expires_at == clock.now + TTL, "the lease lasts the configured TTL from the claim"
    records = ledger.queries.records()
    assert len(records) == 1, "one claim creates exactly one logical run"
    record = records[0]
    assert record.logical_key == str(key)
    assert record.state is ExportState.IN_PROGRESS, "a claimed key is in progress"
    assert record.fencing_token == 1
    assert record.lease_owner == "run-1/export", "the lease belongs to the claiming attempt"
    assert record.window == key.window, "the key's window is recorded at the first claim"
    assert record.tz_database, "the tz database the window came from is recorded"
    assert record.tz_database == claim.tz_database
    assert record.location is None and record.committed_attempt is None, "nothing is published yet"
    assert ledger.queries.attempts(str(key)) == [], "an attempt row is written when its outcome is known, not at claim"


def test_competing_claim_during_a_live_lease_raises_lease_held_naming_the_holder(ledger, clock):
    key = key_for()
    claim_live(ledger, key, "run-1/export")
    clock.advance(minutes=14, seconds=59)  # still inside the 15-minute lease

    with pytest.raises(LeaseHeld) as refused:
        ledger.claims.claim(key, "run-2/export")

    assert "run-1/export" in str(refused.value), "the refusal names the attempt that holds the lease"
    record = ledger.queries.get(str(key))
    assert record.lease_owner == "run-1/export" and record.fencing_token == 1, "a refused claim changes nothing"
    [attempt] = ledger.queries.attempts(str(key))
    assert (attempt.attempt_id, attempt.outcome) == ("run-2/export", AttemptOutcome.REFUSED), (
        "the refused attempt is recorded"
    )
    assert attempt.error_class == "LeaseHeld"
    assert attempt.fencing_token is None, "a refused attempt never held a token"


def test_complete_records_the_destinations_evidence(ledger, clock):
    key = key_for()
    claim = claim_live(ledger, key, "run-1/export")
    clock.advance(minutes=3)

    record = ledger.completions.complete(claim, evidence_for(claim, row_count=1234))

    assert record.state is ExportState.COMPLETED
    assert record.location == evidence_for(claim).location
    assert record.sha256 == "ab" * 32
    assert record.row_count == 1234
    assert record.committed_attempt == "run-1/export", "the row names the attempt whose export it points at"
    assert record.lease_owner is None and record.lease_expires_at is None, "a completed key holds no lease"
    assert record.updated_at == clock.now
    assert ledger.queries.get(str(key)) == record, "complete returns the row as stored"
    [attempt] = ledger.queries.attempts(str(key))
    assert attempt.outcome is AttemptOutcome.COMPLETED
    assert attempt.fencing_token == 1
    assert (attempt.started_at, attempt.finished_at) == (claim.started_at, clock.now)


def test_materializing_a_completed_key_twice_is_one_export_and_two_attempt_rows(ledger, clock):
    key = key_for()
    claim = claim_live(ledger, key, "run-1/export")
    completed = ledger.completions.complete(claim, evidence_for(claim))
    clock.advance(hours=2)

    outcome = ledger.claims.claim(key, "run-2/export")

    assert isinstance(outcome, AlreadyCompleted), "a completed key is never claimed again"
    assert outcome.record == completed, "the caller learns what was already exported"
    assert ledger.queries.get(str(key)) == completed, "claiming a completed key changes nothing"
    assert outcomes(ledger.queries.attempts(str(key))) == [
        ("run-1/export", AttemptOutcome.COMPLETED),
        ("run-2/export", AttemptOutcome.ALREADY_COMPLETED),
    ], "one export, and one attempt row per materialization"


def test_completing_the_same_claim_twice_keeps_the_first_completion(ledger):
    key = key_for()
    claim = claim_live(ledger, key, "run-1/export")
    completed = ledger.completions.complete(claim, evidence_for(claim, row_count=1))

    with pytest.raises(LedgerError):
        ledger.completions.complete(claim, evidence_for(claim, row_count=2))

    assert ledger.queries.get(str(key)) == completed, "a second completion must not overwrite the recorded evidence"


def test_failed_key_is_safe_to_retry_and_the_retry_gets_the_next_token(ledger, clock):
    key = key_for()
    first = claim_live(ledger, key, "run-1/export")
    failed = ledger.completions.fail(first, RuntimeError("source database timed out"))
    assert failed.state is ExportState.FAILED
    assert failed.lease_owner is None, "a failed attempt releases its lease"
    clock.advance(minutes=1)  # well inside the old TTL: failing releases the lease at once

    retry = claim_live(ledger, key, "run-2/export")

    assert retry.fencing_token == 2, "every claim advances the fencing token"
    assert retry.previous_state is ExportState.FAILED
    assert retry.window == key.window
    record = ledger.queries.get(str(key))
    assert (record.state, record.lease_owner, record.fencing_token) == (ExportState.IN_PROGRESS, "run-2/export", 2)
    [attempt] = ledger.queries.attempts(str(key))
    assert (attempt.attempt_id, attempt.outcome, attempt.fencing_token) == ("run-1/export", AttemptOutcome.FAILED, 1)
    assert attempt.error_class == "RuntimeError"
    assert attempt.error_message.startswith("RuntimeError (details withheld"), "a driver's words are never stored"


def test_remote_unknown_refuses_claims_until_reconciled(ledger, clock):
    key = key_for()
    claim = claim_live(ledger, key, "run-1/export")
    marked = ledger.completions.mark_remote_unknown(claim, TimeoutError("upload timed out after sending"))
    assert marked.state is ExportState.REMOTE_UNKNOWN
    clock.advance(days=2)  # no amount of waiting makes a blind retry safe

    with pytest.raises(NeedsReconciliation) as refused:
        ledger.claims.claim(key, "run-2/export")

    assert "run-1/export" in str(refused.value), "the refusal names the attempt whose write is in doubt"

    assert ledger.queries.get(str(key)) == marked, "a refused claim changes nothing"
    attempts = ledger.queries.attempts(str(key))
    assert outcomes(attempts) == [
        ("run-1/export", AttemptOutcome.REMOTE_UNKNOWN),
        ("run-2/export", AttemptOutcome.REFUSED),
    ]
    assert attempts[-1].error_class == "NeedsReconciliation"


# -- leases and fencing ----------------------------------------------------------------------------------------------


def test_expired_lease_is_taken_over_with_the_next_token_and_the_old_attempt_abandoned(ledger, clock):
    key = key_for()
    stale = claim_live(ledger, key, "run-1/export")
    clock.advance(minutes=16)

    takeover = claim_live(ledger, key, "run-2/export")

    assert takeover.fencing_token == stale.fencing_token + 1, "a takeover fences out the previous holder"
    assert takeover.previous_state is ExportState.IN_PROGRESS
    assert takeover.window == stale.window
    record = ledger.queries.get(str(key))
    assert (record.lease_owner, record.fencing_token) == ("run-2/export", 2)
    assert record.lease_expires_at == clock.now + TTL
    [abandoned] = ledger.queries.attempts(str(key))
    assert (abandoned.attempt_id, abandoned.outcome) == ("run-1/export", AttemptOutcome.ABANDONED), (
        "the crashed holder's attempt is recorded when its lease is taken over"
    )
    assert abandoned.fencing_token == 1
    assert (abandoned.started_at, abandoned.finished_at) == (stale.started_at, clock.now)


@pytest.mark.parametrize(
    "finish",
    [
        pytest.param(lambda ledger, claim: ledger.completions.complete(claim, evidence_for(claim)), id="complete"),
        pytest.param(lambda ledger, claim: ledger.completions.fail(claim, RuntimeError("late failure")), id="fail"),
        pytest.param(
            lambda ledger, claim: ledger.completions.mark_remote_unknown(claim, TimeoutError("late timeout")),
            id="remote_unknown",
        ),
    ],
)
def test_fenced_out_attempt_cannot_record_a_result(ledger, clock, finish):
    key = key_for()
    stale = claim_live(ledger, key, "run-1/export")
    clock.advance(minutes=16)
    claim_live(ledger, key, "run-2/export")
    before = ledger.queries.get(str(key))
    clock.advance(minutes=1)

    with pytest.raises(FencedOut) as fenced:
        finish(ledger, stale)

    assert "run-1/export" in str(fenced.value)
    assert ledger.queries.get(str(key)) == before, "a fenced-out attempt must not change the row"
    attempts = ledger.queries.attempts(str(key))
    assert outcomes(attempts) == [
        ("run-1/export", AttemptOutcome.ABANDONED),
    ], "one row per attempt: the takeover recorded it abandoned; its late result is not the key's outcome"
    assert attempts[-1].fencing_token == stale.fencing_token


def test_complete_with_another_attempts_evidence_records_a_repair(ledger, clock):
    key = key_for()
    crashed = claim_live(ledger, key, "run-1/export")  # published, then died before recording
    clock.advance(minutes=16)
    repair = claim_live(ledger, key, "run-2/export")

    record = ledger.completions.complete(repair, evidence_for(crashed, attempt_id="run-1/export"))

    assert record.state is ExportState.COMPLETED
    assert record.committed_attempt == "run-1/export", "the row points at the attempt that produced the export"
    assert record.location == evidence_for(crashed).location
    assert outcomes(ledger.queries.attempts(str(key))) == [
        ("run-1/export", AttemptOutcome.ABANDONED),
        ("run-2/export", AttemptOutcome.REPAIRED),
    ], "the attempt that recorded someone else's export is a repair, not a second export"


# -- the guards every claim checks in its own transaction (issue 18) -------------------------------------------------


def test_a_key_whose_window_has_not_ended_by_the_ledgers_clock_is_refused_and_leaves_no_row(ledger, clock):
    key = key_for()  # 2026-03-08 in New York: the window ends at 2026-03-09T04:00Z
    clock.now = key.window.end_utc - dt.timedelta(seconds=1)

    with pytest.raises(WindowNotOver, match="has not ended by the ledger's clock"):
        ledger.claims.claim(key, "run-1/export")

    assert ledger.queries.find(key) is None, "a refused first claim leaves no row"
    assert ledger.queries.all_attempts() == [], "and no attempt row: the key has none to hang it on"
    clock.now = key.window.end_utc
    assert claim_live(ledger, key, "run-2/export").fencing_token == 1, "at its end instant the window is over"


def test_at_its_expiry_instant_a_lease_has_ended_and_a_group_claim_takes_it_over(ledger, clock):
    held, fresh = key_for(), key_for(tenant="globex")
    stale = claim_live(ledger, held, "run-1/export")
    clock.now = stale.lease_expires_at  # one lease predicate: live while expiry > now, so ended at equality

    taken, first = ledger.claims.claim_many([held, fresh], "run-2/export")

    assert isinstance(taken, Claim) and taken.fencing_token == 2, "the lease ended at its expiry: taken over"
    assert isinstance(first, Claim) and first.fencing_token == 1, "the group's other key is claimed with it"
    assert outcomes(ledger.queries.attempts(str(held))) == [("run-1/export", AttemptOutcome.ABANDONED)]


def test_a_claim_under_another_contract_than_the_one_in_force_is_refused_in_its_place_and_escalated(ledger, clock):
    new_york = ExportCalendar("America/New_York", "2026-01-01").contract()
    chicago = ExportCalendar("America/Chicago", "2026-01-01").contract()
    acme_7, acme_8, globex_8 = key_for(dt.date(2026, 3, 7)), key_for(), key_for(tenant="globex")
    ledger.claims.claim(acme_7, "run-1/export", contract=new_york)  # recorded at acme's first claim

    refused, claimed = ledger.claims.claim_many(
        [acme_8, globex_8],
        "run-2/export",
        contracts={("invoice_export", "acme"): chicago, ("invoice_export", "globex"): new_york},
    )

    assert isinstance(refused, ContractChanged) and "export-ledger accept-contract" in str(refused), (
        "the refusal says how an operator accepts the change"
    )
    assert isinstance(claimed, Claim), "another tenant's claim in the same group goes on"
    assert ledger.queries.find(acme_8) is None, "the refused key is not claimed"
    assert ledger.contracts.in_force("invoice_export", "acme") == new_york, "the contract in force is unchanged"
    [escalation] = ledger.attention.needs_attention(dt.timedelta(hours=6))
    assert (escalation.export, escalation.tenant, escalation.state) == ("invoice_export", "acme", "refused"), (
        "a tenant refused by its contract is escalated to a person"
    )
    assert "America/Chicago" in escalation.why

    assert isinstance(ledger.claims.claim(acme_8, "run-3/export", contract=new_york), Claim)
    assert ledger.attention.needs_attention(dt.timedelta(hours=6)) == [], "the code back on the recorded contract"


def test_holds_raise_the_token_but_only_export_claims_count_toward_the_automatic_reruns(ledger, clock):
    key = key_for()
    for n in range(2):
        ledger.completions.fail(claim_live(ledger, key, f"run-{n}/export"), RuntimeError("source down"))
    record = ledger.queries.get(str(key))
    assert (record.fencing_token, record.claim_count) == (2, 2)

    held = ledger.claims.hold(str(key), "ops@host")
    assert held.fencing_token == 3, "an operator's hold takes a new token, so that it can fence the destination"
    ledger.completions.release(held, ("OperatorResolution", "ops@host looked and gave it back"))

    record = ledger.queries.get(str(key))
    assert (record.state, record.fencing_token, record.claim_count) == (ExportState.FAILED, 3, 2), (
        "the hold raised the token and did not count as a rerun"
    )
    retry = claim_live(ledger, key, "run-2/export")
    assert (retry.fencing_token, ledger.queries.get(str(key)).claim_count) == (4, 3)


# -- windows ---------------------------------------------------------------------------------------------------------


def shifted(key: LogicalKey, hours: int) -> LogicalKey:
    """The same business day with a different window, as a changed tz database could compute it."""
    w = key.window
    moved = ExportWindow(w.business_date, w.timezone, w.start_utc + dt.timedelta(hours=hours), w.end_utc)
    return LogicalKey(key.export, key.tenant, moved)


def test_window_recorded_at_the_first_claim_is_authoritative_for_retries(ledger, clock):
    original = key_for()
    first = claim_live(ledger, original, "run-1/export")
    ledger.completions.fail(first, RuntimeError("transient"))
    recomputed = shifted(original, hours=1)
    assert str(recomputed) != str(original) and recomputed.window != original.window

    retry = claim_live(ledger, recomputed, "run-2/export")

    assert retry.window == original.window, "a retry exports the window recorded at the first claim"
    assert retry.logical_key == str(original), "a retry continues the same logical run"
    assert retry.fencing_token == 2
    assert ledger.queries.find(recomputed) == ledger.queries.get(str(original)), (
        "the business day finds the recorded run"
    )
    assert len(ledger.queries.records()) == 1, "a recomputed window must not start a second logical run"


def test_a_recomputed_window_cannot_bypass_a_live_lease_or_a_completion(ledger):
    original = key_for()
    claim = claim_live(ledger, original, "run-1/export")

    with pytest.raises(LeaseHeld):
        ledger.claims.claim(shifted(original, hours=1), "run-2/export")
    completed = ledger.completions.complete(claim, evidence_for(claim))
    outcome = ledger.claims.claim(shifted(original, hours=-1), "run-3/export")

    assert isinstance(outcome, AlreadyCompleted), "the business day is exported at most once, whatever its window"
    assert outcome.record == completed
    assert len(ledger.queries.records()) == 1


def test_the_day_after_a_skipped_calendar_day_is_its_own_export(ledger):
    skipped = key_for(dt.date(2011, 12, 30), timezone="Pacific/Apia")  # Samoa jumped over this date
    next_day = key_for(dt.date(2011, 12, 31), timezone="Pacific/Apia")
    assert skipped.window.is_empty and skipped.window.start_utc == next_day.window.start_utc
    with pytest.raises(EmptyWindow, match=r"2011-12-30 does not exist in Pacific/Apia"):
        ledger.claims.claim(skipped, "run-1/export")

    claim = ledger.claims.claim(next_day, "run-2/export")

    assert isinstance(claim, Claim), "the day after a skipped day is a business day of its own, never yet exported"
    assert claim.window == next_day.window


# -- attempt history -------------------------------------------------------------------------------------------------


def test_attempt_rows_are_append_only_across_every_transition(ledger, clock):
    key = key_for()
    done_key = key_for(dt.date(2026, 3, 7))
    snapshots = [ledger.queries.all_attempts()]

    def step(expected_new_rows: int, action) -> None:
        try:
            action()
        except LedgerError:
            pass  # refusals are transitions too: they must leave exactly one row
        current = ledger.queries.all_attempts()
        previous = snapshots[-1]
        assert current[: len(previous)] == previous, "earlier attempt rows never change or disappear"
        assert len(current) - len(previous) == expected_new_rows, (
            f"{action.__name__} should add exactly {expected_new_rows} attempt row(s)"
        )
        snapshots.append(current)
        clock.advance(seconds=30)

    claims: dict[str, Claim] = {}

    def claim_a():
        claims["a"] = claim_live(ledger, key, "a")

    def refused_b():
        ledger.claims.claim(key, "b")

    def expire_and_take_over_c():
        clock.advance(minutes=16)
        claims["c"] = claim_live(ledger, key, "c")

    def fenced_a():
        ledger.completions.complete(claims["a"], evidence_for(claims["a"]))

    def fail_c():
        ledger.completions.fail(claims["c"], RuntimeError("boom"))

    def retry_d():
        claims["d"] = claim_live(ledger, key, "d")

    def remote_unknown_d():
        ledger.completions.mark_remote_unknown(claims["d"], TimeoutError("lost ack"))

    def refused_e():
        ledger.claims.claim(key, "e")

    def claim_f():
        claims["f"] = claim_live(ledger, done_key, "f")

    def complete_f():
        ledger.completions.complete(claims["f"], evidence_for(claims["f"]))

    def already_completed_g():
        ledger.claims.claim(done_key, "g")

    step(0, claim_a)
    step(1, refused_b)
    step(1, expire_and_take_over_c)
    step(0, fenced_a)  # a has its row already (abandoned, by the takeover): one row per attempt
    step(1, fail_c)
    step(0, retry_d)
    step(1, remote_unknown_d)
    step(1, refused_e)
    step(0, claim_f)
    step(1, complete_f)
    step(1, already_completed_g)

    assert outcomes(ledger.queries.attempts(str(key))) == [
        ("b", AttemptOutcome.REFUSED),
        ("a", AttemptOutcome.ABANDONED),
        ("c", AttemptOutcome.FAILED),
        ("d", AttemptOutcome.REMOTE_UNKNOWN),
        ("e", AttemptOutcome.REFUSED),
    ]
    assert outcomes(ledger.queries.attempts(str(done_key))) == [
        ("f", AttemptOutcome.COMPLETED),
        ("g", AttemptOutcome.ALREADY_COMPLETED),
    ]
    assert all(a.finished_at >= a.started_at for a in snapshots[-1])


# -- time ------------------------------------------------------------------------------------------------------------


def test_sqlite_stores_times_as_sqlalchemys_datetime_text_in_utc_whatever_the_zone_given():
    """The ledger binds times on SQLite in one step (benchmarks: a group binds about ten a key): the text must stay
    what SQLAlchemy's SQLite DATETIME stores, naive UTC ``YYYY-MM-DD HH:MM:SS.ffffff``, which orders as time does and
    which every ledger written before reads. Guard: the one-step bind processor of ``UtcDateTime``."""
    from sqlalchemy.dialects import sqlite

    from export_ledger.ledger.schema import UtcDateTime

    dialect = sqlite.dialect()
    ours = UtcDateTime().bind_processor(dialect)
    theirs = sqlite.DATETIME().bind_processor(dialect)
    new_york = dt.timezone(dt.timedelta(hours=-5))
    for value in (
        dt.datetime(2026, 3, 8, 7, 0, tzinfo=UTC),
        dt.datetime(2026, 3, 8, 2, 0, 0, 123456, tzinfo=new_york),
        dt.datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=dt.timezone(dt.timedelta(hours=14))),
        dt.datetime(1, 1, 1, 0, 0, tzinfo=UTC),
    ):
        assert ours(value) == theirs(value.astimezone(UTC).replace(tzinfo=None)), value
    assert ours(None) is None
    with pytest.raises(ValueError, match="timezone-aware"):
        ours(dt.datetime(2026, 3, 8, 7, 0))


def test_naive_clock_is_refused_before_anything_is_written(ledger_url):
    naive = open_ledger(ledger_url, clock=lambda: dt.datetime(2026, 3, 9, 9, 30), lease_ttl=TTL)
    key = key_for()

    with pytest.raises(ValueError, match="timezone-aware"):
        naive.claims.claim(key, "run-1/export")

    assert naive.queries.find(key) is None, "a claim stamped with a naive time must not be recorded"
    assert naive.queries.all_attempts() == []


def test_naive_clock_cannot_record_a_result(ledger, clock):
    key = key_for()
    claim = claim_live(ledger, key, "run-1/export")
    before = ledger.queries.get(str(key))
    clock.now = clock.now.replace(tzinfo=None)

    with pytest.raises(ValueError, match="timezone-aware"):
        ledger.completions.complete(claim, evidence_for(claim))

    assert ledger.queries.get(str(key)) == before, "a result stamped with a naive time must not be recorded"
    assert ledger.queries.attempts(str(key)) == []


def test_ledger_times_are_utc_aware_whatever_zone_the_clock_reports(ledger_url):
    local = dt.timezone(dt.timedelta(hours=-5))
    clock_time = dt.datetime(2026, 3, 9, 4, 30, tzinfo=local)
    ledger = open_ledger(ledger_url, clock=lambda: clock_time, lease_ttl=TTL)

    claim = claim_live(ledger, key_for(), "run-1/export")

    record = ledger.queries.get(claim.logical_key)
    assert record.created_at == clock_time and record.created_at.utcoffset() == dt.timedelta(0), (
        "times are stored and returned as UTC"
    )
    assert record.window_start_utc.utcoffset() == dt.timedelta(0)


def test_completion_is_recorded_when_the_wall_clock_steps_back_after_the_claim(ledger, clock):
    key = key_for()
    claim = claim_live(ledger, key, "run-1/export")
    clock.advance(seconds=-5)

    record = ledger.completions.complete(claim, evidence_for(claim))

    assert record.state is ExportState.COMPLETED, "a clock correction must not lose a published export"


# -- schema invariants -----------------------------------------------------------------------------------------------


def raw_run(business_date: dt.date, **overrides) -> dict:
    window = window_for(business_date, ZONE)
    now = dt.datetime(2026, 3, 9, 9, 30, tzinfo=UTC)
    values = dict(
        logical_key=f"raw_export/acme/{business_date.isoformat()}",
        export="raw_export",
        tenant="acme",
        business_date=business_date,
        timezone=ZONE,
        window_start_utc=window.start_utc,
        window_end_utc=window.end_utc,
        tz_database="test",
        state=ExportState.FAILED.value,
        fencing_token=1,
        created_at=now,
        updated_at=now,
    )
    values.update(overrides)
    return values


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(state="paused"), id="unknown-state"),
        pytest.param(dict(state="completed"), id="completed-without-evidence"),
        pytest.param(
            dict(state="completed", location="file:///x", sha256="ab" * 32, committed_attempt="run-1"),
            id="completed-without-row-count",
        ),
        pytest.param(dict(state="in_progress"), id="in-progress-without-lease"),
    ],
)
def test_schema_refuses_rows_that_break_the_state_invariants(ledger, ledger_url, overrides):
    engine = ledger_engine(ledger_url)
    with engine.begin() as conn:
        conn.execute(export_runs.insert().values(**raw_run(dt.date(2026, 3, 1))))  # the base row itself is valid

    with pytest.raises(sa.exc.IntegrityError):
        with engine.begin() as conn:
            conn.execute(export_runs.insert().values(**raw_run(dt.date(2026, 3, 2), **overrides)))

    assert [r.business_date for r in ledger.queries.records()] == [dt.date(2026, 3, 1)], "the refused row is not stored"


def test_schema_refuses_a_second_run_for_the_same_business_day(ledger, ledger_url):
    engine = ledger_engine(ledger_url)
    with engine.begin() as conn:
        conn.execute(export_runs.insert().values(**raw_run(dt.date(2026, 3, 1))))

    with pytest.raises(sa.exc.IntegrityError):
        with engine.begin() as conn:
            conn.execute(export_runs.insert().values(**raw_run(dt.date(2026, 3, 1), logical_key="raw_export/acme/x")))


# -- queries ---------------------------------------------------------------------------------------------------------


def test_records_filter_by_export_tenant_date_range_and_state(ledger):
    def completed(key: LogicalKey) -> None:
        claim = claim_live(ledger, key, f"run/{key}")
        ledger.completions.complete(claim, evidence_for(claim))

    def failed(key: LogicalKey) -> None:
        ledger.completions.fail(claim_live(ledger, key, f"run/{key}"), RuntimeError("x"))

    acme_6 = key_for(dt.date(2026, 3, 6))
    acme_7 = key_for(dt.date(2026, 3, 7))
    globex_7 = key_for(dt.date(2026, 3, 7), tenant="globex")
    acme_8 = key_for(dt.date(2026, 3, 8))
    payments_7 = key_for(dt.date(2026, 3, 7), export="payments_export")
    completed(acme_6)
    failed(acme_7)
    claim_live(ledger, globex_7, "run/globex")
    completed(acme_8)
    completed(payments_7)

    def keys(**filters) -> set[str]:
        return {r.logical_key for r in ledger.queries.records(**filters)}

    everything = {str(k) for k in (acme_6, acme_7, globex_7, acme_8, payments_7)}
    assert keys() == everything, "no filter returns every run"
    assert keys(export="invoice_export") == everything - {str(payments_7)}
    assert keys(tenant="globex") == {str(globex_7)}
    assert keys(date_from=dt.date(2026, 3, 7), date_to=dt.date(2026, 3, 7)) == {
        str(acme_7),
        str(globex_7),
        str(payments_7),
    }, "the date range includes both ends"
    assert keys(date_from=dt.date(2026, 3, 8)) == {str(acme_8)}
    assert keys(date_to=dt.date(2026, 3, 6)) == {str(acme_6)}
    assert keys(states=[ExportState.COMPLETED]) == {str(acme_6), str(acme_8), str(payments_7)}
    assert keys(states=[ExportState.IN_PROGRESS, ExportState.FAILED]) == {str(acme_7), str(globex_7)}
    assert keys(
        export="invoice_export",
        tenant="acme",
        date_from=dt.date(2026, 3, 7),
        states=[ExportState.COMPLETED, ExportState.FAILED],
    ) == {str(acme_7), str(acme_8)}, "filters combine with AND"
    assert keys(states=[ExportState.REMOTE_UNKNOWN]) == set()
    assert len(ledger.queries.records(limit=2)) == 2
