"""Real OS processes racing to claim and complete the same keys, on SQLite (a file) and PostgreSQL.

Each racer is a process started with ``spawn`` (a fresh interpreter, nothing inherited but its arguments). All racers
wait on one barrier per round, then claim the round's key and complete it when they win. Rounds start from each state
a claim can win from: a key never attempted, a key whose last attempt failed, and a key whose holder crashed (its
lease expired). Whatever the interleaving, every key must end with exactly one completion, and every other racer must
have been told why it lost.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import queue
import time
from collections import Counter

import pytest
from builders import evidence_for, key_for, open_ledger, overlapping_writers

from export_ledger.calendar import window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import AlreadyCompleted, Claim, CompletionEvidence, LeaseHeld
from export_ledger.ledger.schema import AttemptOutcome, ExportState

FRESH = "fresh"  # nobody ever claimed the key
FAILED = "failed"  # an earlier attempt failed: safe to retry
CRASHED = "crashed"  # an earlier attempt holds a lease that has expired
ROUND_STARTS = (FRESH, FRESH, FRESH, FAILED, FAILED, CRASHED, CRASHED)
ROUNDS = len(ROUND_STARTS)
ZONE = "America/New_York"
FIRST_DATE = dt.date(2026, 3, 6)  # the rounds cross the spring-forward day (2026-03-08)
UTC = dt.timezone.utc
LEASE_TTL = dt.timedelta(minutes=10)  # far longer than a race: no racer's lease expires during it
BARRIER_TIMEOUT_S = 60.0  # a safety net for a racer that never arrives, not a measurement
COLLECT_TIMEOUT_S = 90.0  # likewise: a hung racer fails the test instead of hanging it

WON = "won"
LEASE_HELD = "lease_held"
ALREADY_COMPLETED = "already_completed"
ERROR = "error"


def round_key(round_index: int) -> LogicalKey:
    return LogicalKey("invoice_export", "acme", window_for(FIRST_DATE + dt.timedelta(days=round_index), ZONE))


def racer_attempt_id(racer: int, round_index: int) -> str:
    return f"racer-{racer}/round-{round_index}"


def seed_attempt_id(round_index: int) -> str:
    return f"seed/round-{round_index}"


def seed_round_starts(url: str) -> None:
    """Puts every round's key in its starting state, from the test process, before any racer starts."""
    open_ledger(url, lease_ttl=LEASE_TTL)  # creates the schema
    long_ago = dt.datetime.now(UTC) - dt.timedelta(days=1)
    crashed_holder = open_ledger(url, lease_ttl=LEASE_TTL, clock=lambda: long_ago)
    for round_index, start in enumerate(ROUND_STARTS):
        if start == FRESH:
            continue
        claim = crashed_holder.claims.claim(round_key(round_index), seed_attempt_id(round_index))
        if start == FAILED:
            crashed_holder.completions.fail(claim, RuntimeError("seeded failure"))


def race(url: str, racer: int, barrier, results) -> None:
    """One racer: for every round, wait for the others, claim the round's key and complete it if it won."""
    try:
        ledger = open_ledger(url, lease_ttl=LEASE_TTL)
    except BaseException as exc:  # report it for every round, and release the others instead of leaving them waiting
        barrier.abort()
        for round_index in range(ROUNDS):
            results.put((racer, round_index, ERROR, f"opening the ledger: {type(exc).__name__}: {exc}"))
        return
    for round_index in range(ROUNDS):
        key = round_key(round_index)
        attempt = racer_attempt_id(racer, round_index)
        try:
            barrier.wait(BARRIER_TIMEOUT_S)
            outcome = ledger.claims.claim(key, attempt)
            if isinstance(outcome, Claim):
                ledger.completions.complete(
                    outcome,
                    CompletionEvidence(
                        location=f"file:///exports/{attempt}.parquet",
                        sha256=f"{racer:064x}",
                        row_count=racer,
                        attempt_id=attempt,
                        fencing_token=outcome.fencing_token,
                    ),
                )
                result = (WON, "")
            elif isinstance(outcome, AlreadyCompleted):
                result = (ALREADY_COMPLETED, "")
            else:
                result = (ERROR, f"claim returned {outcome!r}")
        except LeaseHeld:
            result = (LEASE_HELD, "")
        except BaseException as exc:  # anything else is a failure of the contract: report it, keep racing
            result = (ERROR, f"{type(exc).__name__}: {exc}")
        results.put((racer, round_index, *result))


def run_racers(url: str, racers: int) -> list[tuple[int, int, str, str]]:
    """Starts ``racers`` spawned processes on ``url`` and returns one result per racer per round."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(racers)
    results = context.Queue()
    processes = [
        context.Process(target=race, args=(url, racer, barrier, results), name=f"racer-{racer}", daemon=True)
        for racer in range(racers)
    ]
    collected: list[tuple[int, int, str, str]] = []
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while len(collected) < racers * ROUNDS:
            try:
                collected.append(results.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            crashed = {p.name: p.exitcode for p in processes if p.exitcode not in (None, 0)}
            if crashed or time.monotonic() > deadline:
                exits = {p.name: p.exitcode for p in processes}
                pytest.fail(f"racers stopped reporting after {len(collected)} results; exit codes {exits}")
        for process in processes:
            process.join(timeout=30)
        assert [p.exitcode for p in processes] == [0] * racers, "every racer exits cleanly"
    finally:
        barrier.abort()  # frees any racer still waiting for a round that will not start
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=10)
        results.close()
        results.join_thread()
    return collected


@pytest.mark.process
@pytest.mark.parametrize("racers", [2, 8])
def test_racing_processes_complete_each_key_exactly_once(ledger_url, racers):
    seed_round_starts(ledger_url)
    ledger = open_ledger(ledger_url, lease_ttl=LEASE_TTL)

    results = run_racers(ledger_url, racers)

    errors = [r for r in results if r[2] == ERROR]
    assert errors == [], "losing a race is LeaseHeld or AlreadyCompleted, never another error"
    for round_index, start in enumerate(ROUND_STARTS):
        key = str(round_key(round_index))
        reported = {racer: kind for racer, r, kind, _ in results if r == round_index}
        assert sorted(reported) == list(range(racers)), f"every racer reports once for {key}"
        winners = [racer for racer, kind in reported.items() if kind == WON]
        assert len(winners) == 1, f"exactly one racer exports the {start} key {key}, got {winners}"
        winner = racer_attempt_id(winners[0], round_index)

        record = ledger.queries.get(key)
        assert record.state is ExportState.COMPLETED, f"{key} ends completed"
        assert record.committed_attempt == winner, f"{key} records the winner's export"
        expected_token = 1 if start == FRESH else 2
        assert record.fencing_token == expected_token, f"exactly one racer's claim on the {start} key {key} won"

        attempts = ledger.queries.attempts(key)
        racer_rows = [a for a in attempts if a.attempt_id != seed_attempt_id(round_index)]
        assert len(racer_rows) == racers, f"every racer on {key} leaves exactly one attempt row"
        by_attempt = {a.attempt_id: a.outcome for a in racer_rows}
        assert len(by_attempt) == racers, f"one attempt row per racer on {key}"
        assert Counter(a.outcome for a in attempts)[AttemptOutcome.COMPLETED] == 1, f"one completed attempt on {key}"
        assert by_attempt[winner] is AttemptOutcome.COMPLETED
        expected_row = {LEASE_HELD: AttemptOutcome.REFUSED, ALREADY_COMPLETED: AttemptOutcome.ALREADY_COMPLETED}
        for racer, kind in reported.items():
            if kind != WON:
                attempt = racer_attempt_id(racer, round_index)
                assert by_attempt[attempt] is expected_row[kind], (
                    f"{attempt} was told {kind}: its attempt row must say the same"
                )

        seed_rows = [a.outcome for a in attempts if a.attempt_id == seed_attempt_id(round_index)]
        expected_seed_rows = {
            FRESH: [],
            FAILED: [AttemptOutcome.FAILED],
            CRASHED: [AttemptOutcome.ABANDONED],  # recorded once, by the one takeover
        }[start]
        assert seed_rows == expected_seed_rows, f"the earlier attempt on the {start} key {key} is recorded once"


# -- complete_many and claim_many never deadlock on PostgreSQL ---------------------------------------------------------


@pytest.mark.postgres
def test_overlapping_backfills_never_deadlock_between_complete_many_and_claim_many(postgres_url, postgres_admin_url):
    """Suspected S1: run 1 completes its group (its first row update done, the second about to run) while an
    overlapping backfill claims the same keys, locking them in logical key order (tenant first). Neither may fail
    with a deadlock. (v2: the pause is before run 1's second update of export_runs whichever key it is, so that run 1
    always holds one row lock when run 2 arrives; 0.4.0 updated in item order: x first, then y. v3: a group's finish
    on PostgreSQL locks its rows in key order and then updates them in one statement: the pause is before the second
    of those statements that lock rows, so run 1 holds its locks when run 2 arrives, whichever form it takes.)
    Fails on 0.4.0 (07f55b3): DeadlockDetected between complete_many and claim_many."""
    book = open_ledger(postgres_url)
    x = key_for(dt.date(2026, 3, 1), tenant="tb")  # first in item order (the earlier date)
    y = key_for(dt.date(2026, 3, 2), tenant="ta")  # first in key order (tenant ta sorts before tb)
    assert str(y) < str(x)
    cx, cy = book.claims.claim_many([x, y], "run-1/export")
    completions = [(cx, evidence_for(cx)), (cy, evidence_for(cy))]

    def complete_many():  # run 1
        return book.completions.complete_many(completions)

    def claim_many():  # run 2
        return book.claims.claim_many([x, y], "run-2/export")

    outcomes, waited = overlapping_writers(postgres_admin_url, complete_many, claim_many)
    assert waited, f"run 2 waited for a row lock of run 1 (the overlap happened): {outcomes}"
    assert all(v.startswith("ok") for v in outcomes.values()) and len(outcomes) == 2, outcomes
    assert {book.queries.get(str(k)).state for k in (x, y)} == {ExportState.COMPLETED}, outcomes
