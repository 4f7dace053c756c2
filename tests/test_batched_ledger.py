"""The batched ledger (issue #13): a run of many keys claims a group of them in one transaction and records the
completions of their publishes in one more, with every guarantee of the one-key path kept per key.

Covered here: one transaction per group, one lease and fencing token per key (a retried key's token moves on, new
keys start at 1, as with ``claim``); completed keys skipped and held keys refused in their place without stopping the
others; a concurrent claimer fencing one key of a group; and a crash between a group's publishes and its completion
commit, repaired by the next run from the manifests (one published export per key, never a second copy).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from builders import ORDERS_SCHEMA as SCHEMA
from builders import evidence_for, hourly_orders, key_for, open_ledger, overlapping_writers
from pipeline_helpers import places, published_dirs

from export_ledger.destinations import LocalDestination
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import AlreadyCompleted, Claim, ExportLedger, FencedOut, LeaseHeld
from export_ledger.ledger import transitions as T
from export_ledger.ledger.completions import Completions, Finish
from export_ledger.ledger.schema import AttemptOutcome, ExportState
from export_ledger.protocol import ExportBatch, ExportItem, export_batch

TENANTS = [f"t{i:02d}" for i in range(6)]
DAY = dt.date(2026, 3, 2)


def batch_of(keys) -> ExportBatch:
    items = [ExportItem(key, key.window.business_date.isoformat(), hourly_orders(key)) for key in keys]
    return ExportBatch(SCHEMA, items)


def current_manifest(folder: Path) -> Manifest:
    """The manifest of the place a key folder's pointer names: what its readers see."""
    pointer = json.loads((folder / POINTER_NAME).read_bytes())
    return Manifest.from_json((folder / pointer["path"] / MANIFEST_NAME).read_bytes(), str(folder))


def commits(ledger: ExportLedger) -> list[int]:
    """A counter of the ledger's committed transactions (read-only ones included), through SQLAlchemy's events."""
    counted = [0]

    def on_commit(_connection) -> None:
        counted[0] += 1

    sa.event.listen(ledger._engine, "commit", on_commit)
    return counted


def test_claim_many_takes_one_lease_per_key_in_one_transaction(ledger_url, clock) -> None:
    ledger = open_ledger(ledger_url, clock=clock)
    keys = [key_for(DAY, tenant=tenant) for tenant in TENANTS]
    retried = ledger.claims.claim(keys[2], "run-0/export")
    ledger.completions.fail(retried, RuntimeError("source down"))

    counted = commits(ledger)
    outcomes = ledger.claims.claim_many(keys, "run-1/export")
    assert counted[0] == 1, "the whole group is claimed in one transaction"

    assert all(isinstance(o, Claim) for o in outcomes)
    assert [o.logical_key for o in outcomes] == [str(k) for k in keys], "outcomes come back in the keys' order"
    assert [o.fencing_token for o in outcomes] == [1, 1, 2, 1, 1, 1], "each key's own token, as claim gives it"
    for outcome in outcomes:
        record = ledger.queries.get(outcome.logical_key)
        assert record.state is ExportState.IN_PROGRESS
        assert record.lease_owner == "run-1/export" and record.fencing_token == outcome.fencing_token
        assert record.lease_expires_at == clock() + ledger.lease_ttl
    # The key retried keeps its history: one failed attempt, and nothing yet for the new one.
    assert [a.outcome for a in ledger.queries.attempts(str(keys[2]))] == [AttemptOutcome.FAILED]

    counted[0] = 0
    records = ledger.completions.complete_many([(claim, evidence_for(claim)) for claim in outcomes])
    assert counted[0] == 1, "the group's completions are recorded in one transaction"
    assert all(r.state is ExportState.COMPLETED and r.committed_attempt == "run-1/export" for r in records)
    assert [a.outcome for a in ledger.queries.attempts(str(keys[2]))] == [
        AttemptOutcome.FAILED,
        AttemptOutcome.COMPLETED,
    ]


def test_claim_many_skips_a_completed_key_and_refuses_a_held_one_without_stopping_the_others(ledger_url) -> None:
    ledger = open_ledger(ledger_url)
    done, held, fresh = (key_for(DAY, tenant=tenant) for tenant in ("done", "held", "fresh"))
    first = ledger.claims.claim(done, "run-0/export")
    ledger.completions.complete(first, evidence_for(first))
    ledger.claims.claim(held, "run-other/export")

    skipped, refused, claimed = ledger.claims.claim_many([done, held, fresh], "run-1/export")

    assert isinstance(skipped, AlreadyCompleted) and skipped.record.committed_attempt == "run-0/export"
    assert isinstance(refused, LeaseHeld) and "run-other/export" in str(refused)
    assert isinstance(claimed, Claim) and claimed.fencing_token == 1
    assert [a.outcome for a in ledger.queries.attempts(str(done))][-1] is AttemptOutcome.ALREADY_COMPLETED
    assert [(a.attempt_id, a.outcome) for a in ledger.queries.attempts(str(held))] == [
        ("run-1/export", AttemptOutcome.REFUSED)
    ], "the refused claim is recorded, as claim records it"
    assert ledger.queries.get(str(held)).lease_owner == "run-other/export", "the holder keeps its lease"


def test_a_concurrent_claimer_fences_one_key_of_the_group_and_the_others_commit(ledger, clock) -> None:
    keys = [key_for(DAY, tenant=tenant) for tenant in TENANTS[:3]]
    claims = ledger.claims.claim_many(keys, "run-1/export")
    clock.advance(minutes=16)  # run-1 stalls past its leases; another attempt takes the first key over
    taken = ledger.claims.claim(keys[0], "run-2/export")
    assert taken.fencing_token == 2

    results = ledger.completions.complete_many([(claim, evidence_for(claim)) for claim in claims])

    assert isinstance(results[0], FencedOut) and "run-2/export" in str(results[0])
    assert [r.state for r in results[1:5]] == [ExportState.COMPLETED, ExportState.COMPLETED]
    record = ledger.queries.get(str(keys[0]))
    assert (record.state, record.lease_owner, record.fencing_token) == (ExportState.IN_PROGRESS, "run-2/export", 2)
    # One row per attempt: the takeover recorded run-1 as abandoned, so its fenced commit adds none.
    assert [(a.attempt_id, a.outcome) for a in ledger.queries.attempts(str(keys[0]))] == [
        ("run-1/export", AttemptOutcome.ABANDONED)
    ]


def test_export_batch_with_a_key_taken_over_mid_run_fences_that_key_only_and_the_next_run_repairs_it(
    tmp_path: Path, ledger, clock, monkeypatch
) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = [key_for(DAY, tenant=tenant) for tenant in TENANTS[:3]]
    commit = LocalDestination.commit
    committed: list[str] = []

    def commit_then_lose_the_first_lease(self, staged, token, *, superseded):
        pointer = commit(self, staged, token, superseded=superseded)
        committed.append(staged.manifest.logical_key)
        if len(committed) == len(keys):  # all three committed; before the group records them, a takeover happens
            clock.advance(minutes=16)
            ledger.claims.claim(keys[0], "run-2/export")
        return pointer

    monkeypatch.setattr(LocalDestination, "commit", commit_then_lose_the_first_lease)
    with pytest.raises(FencedOut, match="run-2/export"):
        export_batch(ledger, destination, batch_of(keys), "run-1/export")
    monkeypatch.setattr(LocalDestination, "commit", commit)

    assert [ledger.queries.get(str(k)).state for k in keys] == [ExportState.IN_PROGRESS, *[ExportState.COMPLETED] * 2]
    clock.advance(minutes=16)  # run-2 died too; the next run takes the key over and finds run-1's export
    results = export_batch(ledger, destination, batch_of(keys), "run-3/export")
    assert [r.status for r in results] == ["repaired", "already_completed", "already_completed"]
    assert ledger.queries.get(str(keys[0])).committed_attempt == "run-1/export"
    assert len(published_dirs(tmp_path / "exports")) == 3, "one published export per key"
    assert len(places(tmp_path / "exports")) == 3, "the repair wrote no second copy of the key"


def test_a_crash_between_the_publishes_and_the_group_commit_is_repaired_by_the_next_run(
    tmp_path: Path, ledger, clock, monkeypatch
) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = [key_for(DAY, tenant=tenant) for tenant in TENANTS]

    def die(self, completions):
        raise SimulatedCrash("the process died before the group's completions committed")

    with monkeypatch.context() as patch:
        patch.setattr(Completions, "complete_many", die)
        with pytest.raises(SimulatedCrash):
            export_batch(ledger, destination, batch_of(keys), "run-1/export", group_size=4)
    # The first group of four was committed at the destination, none recorded; the second group was never claimed.
    first_manifests = {
        manifest.logical_key: manifest
        for manifest in (current_manifest(folder) for folder in published_dirs(tmp_path / "exports"))
    }
    assert sorted(first_manifests) == sorted(str(k) for k in keys[:4])
    assert [ledger.queries.get(str(k)).state for k in keys[:4]] == [ExportState.IN_PROGRESS] * 4
    assert [ledger.queries.get(str(k)) for k in keys[4:]] == [None, None]

    clock.advance(minutes=16)  # past the dead run's leases
    results = export_batch(ledger, destination, batch_of(keys), "run-2/export", group_size=4)

    assert [r.status for r in results] == ["repaired"] * 4 + ["exported"] * 2
    folders = published_dirs(tmp_path / "exports")
    assert len(folders) == len(keys), "exactly one published export per key: never a second copy"
    assert len(places(tmp_path / "exports")) == len(keys), "the repairs wrote no second place: one place per key"
    for key in keys[:4]:
        record = ledger.queries.get(str(key))
        assert record.state is ExportState.COMPLETED
        assert record.committed_attempt == "run-1/export" and record.sha256 == first_manifests[str(key)].sha256
        assert [(a.attempt_id, a.outcome) for a in ledger.queries.attempts(str(key))] == [
            ("run-1/export", AttemptOutcome.ABANDONED),
            ("run-2/export", AttemptOutcome.REPAIRED),
        ]


def test_a_crash_at_the_before_commit_failpoint_leaves_claimed_keys_that_the_next_run_finishes(
    tmp_path: Path, ledger, clock, monkeypatch
) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = [key_for(DAY, tenant=tenant) for tenant in TENANTS[:3]]
    monkeypatch.setenv(FAILPOINTS, "before_commit=crash")
    with pytest.raises(SimulatedCrash):
        export_batch(ledger, destination, batch_of(keys), "run-1/export")
    monkeypatch.delenv(FAILPOINTS)
    assert len(published_dirs(tmp_path / "exports")) == 3, (
        "group commit: the whole group was published and synced before its first completion record"
    )
    assert [ledger.queries.get(str(k)).state for k in keys] == [ExportState.IN_PROGRESS] * 3, (
        "the whole group was claimed"
    )

    clock.advance(minutes=16)
    results = export_batch(ledger, destination, batch_of(keys), "run-2/export")
    assert [r.status for r in results] == ["repaired", "repaired", "repaired"]
    assert len(published_dirs(tmp_path / "exports")) == 3
    assert len(places(tmp_path / "exports")) == 3, "every key is repaired from its place, not written again"


def test_one_bad_key_of_a_group_fails_alone(tmp_path: Path, ledger) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = [key_for(DAY, tenant=tenant) for tenant in TENANTS[:3]]
    batch = batch_of(keys)
    bad = batch.items[1].frame.copy()
    bad.loc[0, "tenant"] = "someone-else"
    batch.items[1] = ExportItem(keys[1], batch.items[1].partition_key, bad)

    with pytest.raises(Exception, match="belong to another tenant"):
        export_batch(ledger, destination, batch, "run-1/export")

    assert [ledger.queries.get(str(k)).state for k in keys] == [
        ExportState.COMPLETED,
        ExportState.FAILED,
        ExportState.COMPLETED,
    ]
    assert [r.logical_key for r in batch.results] == [str(keys[0]), str(keys[2])]
    assert len(published_dirs(tmp_path / "exports")) == 2


def _claim_group(url: str, keys: list, attempt: str, start, results) -> None:
    ledger = open_ledger(url)
    start.wait(timeout=30)
    try:
        results[attempt] = ledger.claims.claim_many(keys, attempt)
    except BaseException as exc:  # the test asserts there was none
        results[attempt] = exc


def test_two_runs_claiming_overlapping_groups_at_once_each_key_goes_to_exactly_one(ledger_url) -> None:
    """Threads with their own connections, keys given in opposite orders: rows are locked in key order, and a
    first claim inserted under a concurrent group falls back to one-by-one claims, so nobody deadlocks or fails."""
    keys = [key_for(DAY, tenant=f"r{i:02d}") for i in range(20)]
    half = open_ledger(ledger_url)
    for key in keys[::2]:
        # half of the keys are retried, half are first claims
        half.completions.fail(half.claims.claim(key, "run-0/export"), RuntimeError("source down"))
    for round_index in range(3):
        for key in keys:
            assert half.queries.get(str(key)) is None or half.queries.get(str(key)).state is not ExportState.IN_PROGRESS
        results: dict = {}
        start = threading.Barrier(2)
        threads = [
            threading.Thread(target=_claim_group, args=(ledger_url, order, attempt, start, results))
            for order, attempt in ((keys, f"run-a{round_index}/export"), (keys[::-1], f"run-b{round_index}/export"))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        a, b = results[f"run-a{round_index}/export"], results[f"run-b{round_index}/export"]
        assert isinstance(a, list) and isinstance(b, list), f"a claimer failed: {a!r} {b!r}"
        for key, mine, theirs in zip(keys, a, b[::-1], strict=True):
            outcomes = sorted(type(o).__name__ for o in (mine, theirs))
            assert outcomes == ["Claim", "LeaseHeld"], f"{key}: {outcomes}"
            winner = mine if isinstance(mine, Claim) else theirs
            assert half.queries.get(str(key)).lease_owner == winner.attempt_id
            half.completions.fail(winner, RuntimeError("next round"))


def _updates_of_runs(ledger: ExportLedger) -> list[str]:
    """The ``UPDATE export_runs`` statements the ledger sends from now on."""
    sent: list[str] = []

    def before(_conn, _cursor, statement, _parameters, _context, _executemany) -> None:
        if statement.lstrip().upper().startswith("UPDATE EXPORT_RUNS"):
            sent.append(statement)

    sa.event.listen(ledger._engine, "before_cursor_execute", before)
    return sent


def test_a_group_finish_matches_each_key_on_its_own_token_and_owner_in_one_statement_per_transition(
    ledger_url, clock
) -> None:
    """finish_many of several transitions at once: one guarded UPDATE per transition for the whole group (on
    PostgreSQL a hundred keys were a hundred round trips), each row still matched on its own key, token and owner: a key
    taken over meanwhile is fenced alone and keeps its new holder."""
    ledger = open_ledger(ledger_url, clock=clock, lease_ttl=dt.timedelta(minutes=15))
    keys = [key_for(DAY, tenant=tenant) for tenant in [*TENANTS, "t06"]]
    claims = ledger.claims.claim_many(keys, "run-1/export")
    clock.advance(minutes=16)
    taken = ledger.claims.claim(keys[0], "run-2/export")  # run-1's claim of keys[0] is fenced
    # The same attempt id takes keys[5] over (a retried step reusing its id): only the token tells the claims apart.
    again = ledger.claims.claim(keys[5], "run-1/export")
    finishes = [
        Finish(claims[0], T.COMPLETE, evidence=evidence_for(claims[0])),
        Finish(claims[1], T.COMPLETE, evidence=evidence_for(claims[1])),
        Finish(claims[2], T.COMPLETE, evidence=evidence_for(claims[2])),
        Finish(claims[3], T.FAIL, error=RuntimeError("source down")),
        Finish(claims[4], T.MARK_REMOTE_UNKNOWN, error=TimeoutError("upload"), location="x", sha256="0" * 64),
        Finish(claims[5], T.COMPLETE, evidence=evidence_for(claims[5])),
        # A claim of the right token in another party's name: only the owner guard refuses it.
        Finish(dataclasses.replace(claims[6], attempt_id="run-9/export"), T.COMPLETE, evidence=evidence_for(claims[6])),
    ]
    sent = _updates_of_runs(ledger)

    results = ledger.completions.finish_many(finishes)

    assert len(sent) == 3, f"{len(sent)} UPDATE statements for 7 keys of 3 transitions"
    assert isinstance(results[6], FencedOut), "a party that does not hold the lease is fenced"
    assert ledger.queries.get(str(keys[6])).state is ExportState.IN_PROGRESS
    assert isinstance(results[0], FencedOut) and "run-2/export" in str(results[0])
    assert isinstance(results[5], FencedOut), "an earlier claim of the same attempt id is fenced by its token"
    record = ledger.queries.get(str(keys[5]))
    assert (record.state, record.fencing_token) == (ExportState.IN_PROGRESS, again.fencing_token)
    assert [r.state for r in results[1:5]] == [
        ExportState.COMPLETED, ExportState.COMPLETED, ExportState.FAILED, ExportState.REMOTE_UNKNOWN,
    ]  # fmt: skip
    assert [r.committed_attempt for r in results[1:3]] == ["run-1/export"] * 2
    assert results[3].lease_owner is None and results[4].lease_owner == "run-1/export"
    assert results[1].claim_count == results[3].claim_count == 1
    record = ledger.queries.get(str(keys[0]))
    assert (record.state, record.lease_owner, record.fencing_token) == (ExportState.IN_PROGRESS, "run-2/export", 2)
    assert record.fencing_token == taken.fencing_token
    assert [a.outcome for a in ledger.queries.attempts(str(keys[3]))] == [AttemptOutcome.FAILED]


def test_a_group_hold_takes_each_stuck_key_on_the_state_and_token_it_read(ledger_url, clock) -> None:
    """hold_many (reconciliation's hold) is one guarded UPDATE per state read, and each key is held only
    from the state and token reconciliation read: a key whose lease is live, or that moved since it was read, is not
    held; an abandoned attempt gets its ``abandoned`` row."""
    ledger = open_ledger(ledger_url, clock=clock, lease_ttl=dt.timedelta(minutes=15))
    unknown, abandoned, live, moved, late, renewed = (key_for(DAY, tenant=tenant) for tenant in TENANTS)
    ledger.completions.mark_remote_unknown(ledger.claims.claim(unknown, "run-1/export"), TimeoutError("upload"))
    ledger.claims.claim(abandoned, "run-1/export")
    ledger.completions.mark_remote_unknown(ledger.claims.claim(moved, "run-1/export"), TimeoutError("upload"))
    late_claim = ledger.claims.claim(late, "run-1/export")
    clock.advance(minutes=16)  # those leases have ended
    ledger.claims.claim(live, "run-3/export")  # a live lease
    ledger.claims.claim(renewed, "run-3/export")
    records = [ledger.queries.get(str(key)) for key in (unknown, abandoned, live, moved, late, renewed)]
    ledger.claims.hold(str(moved), "operator")  # moved on since reconciliation read it (its token is 2 now)
    # The late attempt finishes after its read (the same token, another state): the hold was judged on in_progress.
    ledger.completions.mark_remote_unknown(late_claim, TimeoutError("upload"))
    # A record read as if its lease had ended (it is live): the UPDATE's own lease guard refuses it.
    records[5] = dataclasses.replace(records[5], lease_expires_at=clock() - dt.timedelta(seconds=1))
    sent = _updates_of_runs(ledger)

    held = ledger.claims.hold_many(records, "reconciler")

    assert len(sent) == 2, sent
    assert [h.fencing_token if h else None for h in held] == [2, 2, None, None, None, None]
    assert [h.attempt_id if h else None for h in held] == ["reconciler", "reconciler", None, None, None, None]
    assert ledger.queries.get(str(late)).state is ExportState.REMOTE_UNKNOWN, "not held from a state it left"
    assert ledger.queries.get(str(renewed)).lease_owner == "run-3/export", "a live lease is never taken"
    for key, state in ((unknown, ExportState.REMOTE_UNKNOWN), (abandoned, ExportState.IN_PROGRESS)):
        record = ledger.queries.get(str(key))
        assert (record.state, record.lease_owner, record.fencing_token) == (ExportState.IN_PROGRESS, "reconciler", 2)
        assert held[[unknown, abandoned].index(key)].previous_state is state
    assert ledger.queries.get(str(live)).lease_owner == "run-3/export", "a live lease is never taken"
    assert ledger.queries.get(str(moved)).lease_owner == "operator", "the key's new holder keeps it"
    assert [a.outcome for a in ledger.queries.attempts(str(abandoned))] == [AttemptOutcome.ABANDONED]


@pytest.mark.postgres
def test_a_group_finish_of_mixed_transitions_never_deadlocks_with_an_overlapping_claim(
    postgres_url, postgres_admin_url
):
    """A reconciliation's verdicts mix transitions (``repaired``, ``failed``, ...). Their group takes its row locks in
    key order across every transition, as a claim's group does: a claim of overlapping keys waits, then finds them
    finished. The finish pauses before its second statement that takes row locks; locked one transition at a time (a
    and c, then b), the claimer takes b and waits for c while the finish waits for b. Guard: locking per transition
    fails with DeadlockDetected."""
    book = open_ledger(postgres_url)
    keys = [key_for(DAY, tenant=tenant) for tenant in ("ta", "tb", "tc")]
    claims = book.claims.claim_many(keys, "run-1/export")
    finishes = [
        Finish(claims[0], T.COMPLETE, evidence=evidence_for(claims[0])),
        Finish(claims[1], T.FAIL, error=RuntimeError("source down")),
        Finish(claims[2], T.COMPLETE, evidence=evidence_for(claims[2])),
    ]

    def finish_many():
        return book.completions.finish_many(finishes)

    def claim_many():
        return book.claims.claim_many(keys[1:], "run-2/x")

    outcomes, waited = overlapping_writers(postgres_admin_url, finish_many, claim_many)

    assert waited, f"the claim waited for a row lock of the finish (the overlap happened): {outcomes}"
    assert "Deadlock" not in str(outcomes) and len(outcomes) == 2, outcomes
    assert outcomes["finish_many"] == "ok: ExportRecord, ExportRecord, ExportRecord", outcomes
    assert [book.queries.get(str(k)).state for k in keys] == [
        ExportState.COMPLETED, ExportState.IN_PROGRESS, ExportState.COMPLETED,
    ], "the failed key is claimed again by the second run, the completed ones are skipped"  # fmt: skip


def test_a_group_refuses_a_naive_time_as_one_key_does(ledger_url, clock) -> None:
    """Every value of a group's statement is bound as its column binds it: a naive time is refused on PostgreSQL's
    arrays as the one-key statement refuses it (the ledger stores timezone-aware times only)."""
    ledger = open_ledger(ledger_url, clock=clock)
    (claim,) = ledger.claims.claim_many([key_for(DAY)], "run-1/export")
    naive = T.Move(T.FAIL, claim.logical_key, claim.fencing_token,
                   dict(lease_owner=None, lease_expires_at=None, updated_at=dt.datetime(2026, 3, 3)),
                   owner=claim.attempt_id)  # fmt: skip
    with pytest.raises(Exception, match="timezone-aware"):
        with ledger.atomic() as conn:
            T.apply_many(conn, [naive])
    assert ledger.queries.get(claim.logical_key).state is ExportState.IN_PROGRESS


def test_a_group_larger_than_one_statement_finishes_every_key_on_its_own_guards(ledger_url, clock) -> None:
    """A group of 120 keys is several statements on SQLite (at most SQLITE_BATCH_ROWS moves each: bound values are
    limited): every key is finished, and the one taken over meanwhile (in the second statement's rows) alone is
    fenced."""
    ledger = open_ledger(ledger_url, clock=clock, lease_ttl=dt.timedelta(minutes=15))
    keys = [key_for(DAY, tenant=f"g{i:03d}") for i in range(120)]
    claims = ledger.claims.claim_many(keys, "run-1/export")
    clock.advance(minutes=16)
    ledger.claims.claim(keys[75], "run-2/export")

    results = ledger.completions.complete_many([(claim, evidence_for(claim)) for claim in claims])

    fenced = [i for i, result in enumerate(results) if isinstance(result, FencedOut)]
    assert fenced == [75], fenced
    assert all(r.state is ExportState.COMPLETED for i, r in enumerate(results) if i != 75)
    assert ledger.queries.get(str(keys[75])).lease_owner == "run-2/export"


def test_a_claim_closes_the_missed_rows_of_its_own_partitions_only(ledger_url) -> None:
    """A claim reads in one statement whether any partition of its export is open as missed, and closes the open rows
    of the partitions it claimed keys of: not another export's, not another date's. Guard: the missed-partitions part
    of the claim's facts (reading it as always closed leaves the claimed partition open)."""
    ledger = open_ledger(ledger_url)
    claimed, other_day = dt.date(2026, 3, 2), dt.date(2026, 3, 3)
    for export, day in (("invoice_export", claimed), ("invoice_export", other_day), ("refund_export", claimed)):
        ledger.attention.note_missed(export, key_for(day).window.timezone, day, missing_keys=2, run_id=f"run-{export}")
    outcomes = ledger.claims.claim_many([key_for(claimed, tenant=t) for t in ("acme", "globex")], "run-2/export")
    assert all(isinstance(outcome, Claim) for outcome in outcomes), outcomes
    engine = sa.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT export, business_date, closed_at FROM export_missed_partitions "
                    "ORDER BY export, business_date"
                )
            ).all()
    finally:
        engine.dispose()
    is_open = {(row.export, str(row.business_date)[:10]): row.closed_at is None for row in rows}
    assert is_open == {
        ("invoice_export", "2026-03-02"): False,
        ("invoice_export", "2026-03-03"): True,
        ("refund_export", "2026-03-02"): True,
    }, is_open


@pytest.mark.postgres
def test_a_group_on_postgresql_reads_the_ledgers_clock_inside_statements_it_sends_anyway(postgres_url) -> None:
    """On PostgreSQL the ledger's clock is ``now()`` of the deciding transaction. A claim reads it with the export's
    missed partitions, a completion with the lock on its rows: no round trip of its own (issue 28).
    The times recorded are still the database's, within the transaction. Guard: a separate ``SELECT now()`` in either
    path, or a clock taken from anywhere else."""
    ledger = open_ledger(postgres_url)  # no test clock: the database's
    keys = [key_for(DAY, tenant=t) for t in TENANTS]
    sent: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        sent.append(" ".join(statement.split())[:60].upper())

    engine = sa.create_engine(postgres_url)
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    sa.event.listen(ledger._engine, "before_cursor_execute", record)
    try:
        claims = ledger.claims.claim_many(keys, "run-1/export")
        claim_statements = list(sent)
        sent.clear()
        records = ledger.completions.complete_many([(c, evidence_for(c)) for c in claims])
        complete_statements = list(sent)
    finally:
        sa.event.remove(ledger._engine, "before_cursor_execute", record)
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    engine.dispose()
    assert not [s for s in claim_statements + complete_statements if s.startswith("SELECT NOW()")], (
        claim_statements,
        complete_statements,
    )
    # The facts, the rows (locked), the low-water mark (first claims; read after the lock, see test_retention_races),
    # the inserts.
    assert len(claim_statements) == 4, claim_statements
    assert len(complete_statements) == 3, complete_statements  # the lock with the clock, the update, the attempts
    for claim, record in zip(claims, records, strict=True):
        assert before <= claim.started_at <= after, (before, claim.started_at, after)
        assert claim.lease_expires_at - claim.started_at == ledger.lease_ttl
        assert claim.started_at <= record.updated_at <= after, (claim.started_at, record.updated_at, after)
