"""Every finishing transition of a held key, through one path: :meth:`Completions.finish_many`.

A single completion, a group's completions, a transactional destination's write-and-record, a failure, an unknown
outcome, a conflict, reconciliation's verdicts and an operator's resolution are all :class:`Finish` items applied in
one transaction, each guarded by its claim's token and lease owner. A finish whose guard does not match (the party lost
its lease to a newer one) records a ``fenced`` attempt row instead, and the others still commit. Items are applied in
logical key order, the order claims lock rows in, so two transactions over overlapping keys never deadlock.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger import transitions as T
from export_ledger.ledger.errors import FencedOut, InvalidTransition, LedgerError
from export_ledger.ledger.records import Claim, CompletionEvidence, ExportRecord
from export_ledger.ledger.rows import INSERT_ATTEMPT, RUN_BY_KEY, RUN_BY_KEY_LOCKED, attempt_values, evidence_values
from export_ledger.ledger.schema import RUN_COLUMNS, AttemptOutcome, ExportState, export_attempts, export_runs

_RUNS_BY_KEYS = sa.select(*RUN_COLUMNS, export_runs.c.claim_count).where(
    export_runs.c.logical_key.in_(sa.bindparam("n_keys", expanding=True))
)
_COMPLETING = (T.COMPLETE, T.REPAIR, T.WITHDRAW, T.UNCHANGED)
#: Completions that record the revision the claim superseded again, not the claim's own.
_RECORDING_SUPERSEDED = (T.WITHDRAW, T.UNCHANGED)


@dataclass(frozen=True)
class Finish:
    """One held key's finishing transition.

    Attributes:
        claim: The claim (or hold) that holds the key.
        transition: One of :data:`~export_ledger.ledger.transitions.FINISHING`.
        evidence: What the destination holds: required to complete (``complete``, ``repair``, ``withdraw``).
        error: The error the attempt row records (its class and a message safe to keep).
        note: ``(class, message)`` of the library's own words for the attempt row, instead of ``error``
            (``Reconciliation``, ``OperatorResolution``).
        location: For ``remote_unknown`` and ``conflict``: where the attempt wrote, or found something else.
        sha256: For ``remote_unknown``: what the attempt meant to commit (reconciliation compares with it).
        since: Keep the key's ``updated_at`` (when it last changed meaningfully: "stuck since") at this time instead
            of now: a holder that gives a key back unchanged (a reconciler that could not reach the destination, a
            refused resolution) must not restart the clock that escalates it.
    """

    claim: Claim
    transition: T.Transition
    evidence: CompletionEvidence | None = None
    error: BaseException | None = None
    note: tuple[str, str] | None = None
    location: str | None = None
    sha256: str | None = None
    since: dt.datetime | None = None

    def check(self) -> None:
        transition, claim, evidence = self.transition, self.claim, self.evidence
        if transition not in T.FINISHING:
            raise InvalidTransition(f"{transition.name} does not finish a held key")
        if transition in _COMPLETING:
            if evidence is None:
                raise InvalidTransition(f"{transition.name} of {claim.logical_key} needs the destination's evidence")
            expected = (claim.superseded_revision or 1) if transition in _RECORDING_SUPERSEDED else claim.revision
            if evidence.revision != expected:
                raise InvalidTransition(
                    f"{claim.logical_key}: {transition.name} records revision {expected} but the evidence is revision "
                    f"{evidence.revision} ({evidence.location}); nothing recorded"
                )

    def values(self, now: dt.datetime) -> dict:
        values: dict = dict(lease_owner=None, lease_expires_at=None, updated_at=self.since or now)
        if self.transition is T.MARK_REMOTE_UNKNOWN:
            # The key keeps the party whose write is in doubt: reconciliation looks for its evidence.
            values.update(lease_owner=self.claim.attempt_id, sha256=self.sha256, location=self.location)
        elif self.transition is T.MARK_CONFLICT:
            values.update(location=self.location)
        if self.evidence is not None:
            values.update(evidence_values(self.evidence))
            if self.transition is T.WITHDRAW:
                del values["source_fingerprint"]  # the recorded revision's fingerprint stays the key's
        return values

    def attempt_row(self, now: dt.datetime) -> dict:
        claim = self.claim
        note = self.note
        if note is None and self.transition is T.UNCHANGED:
            note = unchanged_note(claim, self.evidence)
        error_class, message = note if note is not None else (None, None)
        return attempt_values(
            claim.logical_key, claim.attempt_id, claim.fencing_token, now, self.transition.outcome, self.error,
            error_class=error_class, message=message, started_at=claim.started_at,
        )  # fmt: skip


#: Work that runs in the finishing transaction after an item matched (an operator log row, a closed request).
After = Callable[[Connection, dt.datetime, Finish], None]


class Completions:
    """The finishing transitions of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def finish_many(self, finishes: Sequence[Finish], *, then: After | None = None) -> list[ExportRecord | FencedOut]:
        """Applies each item's transition in one transaction; returns, per item in the order given, the key's record
        as committed or the :class:`FencedOut` of a party that lost the key (its ``fenced`` row is written).

        Rolling the whole transaction back on an error is safe: each item is a decision found again by its party (an
        attempt's evidence is published and is repaired by the key's next claim; a verdict is reached again).
        """
        if not finishes:
            return []
        names = [item.claim.logical_key for item in finishes]
        if len(set(names)) != len(names):
            raise ValueError(f"finish_many needs distinct keys; got {len(names) - len(set(names))} repeated")
        for item in finishes:
            item.check()
        ledger = self.ledger
        outcomes: dict[int, ExportRecord | FencedOut] = {}
        rows: dict[str, sa.Row] = {}
        with ledger.atomic() as conn:
            # On PostgreSQL one statement locks every key of the group in key order and reads the ledger's clock.
            now = T.lock_in_key_order(conn, names, clock=ledger.clock_in_database(conn)) or ledger.now(conn)
            attempts: list[dict] = []
            order = sorted(range(len(finishes)), key=names.__getitem__)
            # Then one statement per transition.
            moved = T.apply_many(conn, [self._move(item, now) for item in finishes], locked=True)
            for i in order:
                outcome = self._after_move(conn, finishes[i], moved.get(names[i]), now, attempts, then, rows)
                if outcome is not None:
                    outcomes[i] = outcome
            if attempts:
                conn.execute(INSERT_ATTEMPT, attempts)  # one executemany for the group's attempt rows
            if then is not None:
                # What ``then`` did may have changed the rows after their transitions returned them: read them back.
                matched = [name for i, name in enumerate(names) if i not in outcomes]
                rows = {row.logical_key: row for row in conn.execute(_RUNS_BY_KEYS, {"n_keys": matched})}
        return [outcomes.get(i) or ExportRecord.from_row(rows[name]) for i, name in enumerate(names)]

    def _finish_in(
        self,
        conn: Connection,
        item: Finish,
        now: dt.datetime,
        attempts: list[dict],
        then: After | None,
        rows: dict[str, sa.Row] | None = None,
    ) -> FencedOut | None:
        """One item's transition; the row it left goes to ``rows`` when given (the guarded UPDATE returns it: no read
        back)."""
        move = self._move(item, now)
        row = T.apply(
            conn, item.transition, move.logical_key, token=move.token, owner=move.owner, values=move.values,
            returning=True,
        )  # fmt: skip
        return self._after_move(conn, item, row, now, attempts, then, rows)

    @staticmethod
    def _move(item: Finish, now: dt.datetime) -> T.Move:
        claim = item.claim
        return T.Move(item.transition, claim.logical_key, claim.fencing_token, item.values(now), owner=claim.attempt_id)

    def _after_move(
        self,
        conn: Connection,
        item: Finish,
        row: sa.Row | None,
        now: dt.datetime,
        attempts: list[dict],
        then: After | None,
        rows: dict[str, sa.Row] | None,
    ) -> FencedOut | None:
        """What follows one item's guarded UPDATE: its ``fenced`` row when it did not match (``row`` None), else its
        revision or closed request, ``then`` and its attempt row."""
        claim = item.claim
        if row is None:
            return self._fenced(conn, claim, now, attempts)
        if rows is not None:
            rows[claim.logical_key] = row
        if item.transition in (T.COMPLETE, T.REPAIR) and claim.revision > 1:
            self.ledger.restatements.record_revision_in(conn, claim, item.evidence, now)
        elif item.transition is T.UNCHANGED:
            self.ledger.restatements.close_unchanged_in(conn, claim, now)
        if then is not None:
            then(conn, now, item)
        attempts.append(item.attempt_row(now))
        return None

    def _fenced(self, conn: Connection, claim: Claim, now: dt.datetime, attempts: list[dict]) -> FencedOut:
        """Appends the ``fenced`` attempt row (unless the attempt has its row already: a takeover recorded it
        ``abandoned``) and returns the error to raise after the commit."""
        current = conn.execute(RUN_BY_KEY, {"k_key": claim.logical_key}).first()
        holder = "nobody"
        if current is not None:
            holder = f"{current.lease_owner or 'nobody'} (state {current.state}, token {current.fencing_token})"
        fenced = FencedOut(
            f"attempt {claim.attempt_id} lost its lease on {claim.logical_key} (token {claim.fencing_token}); "
            f"now held by {holder}: its result is not recorded"
        )
        recorded = conn.execute(
            sa.select(export_attempts.c.id).where(
                export_attempts.c.logical_key == claim.logical_key,
                export_attempts.c.attempt_id == claim.attempt_id,
                export_attempts.c.fencing_token == claim.fencing_token,
            )
        ).first()
        if recorded is None and not any(
            row["logical_key"] == claim.logical_key and row["fencing_token"] == claim.fencing_token for row in attempts
        ):
            attempts.append(
                attempt_values(
                    claim.logical_key, claim.attempt_id, claim.fencing_token, now, AttemptOutcome.FENCED, fenced,
                    started_at=claim.started_at,
                )
            )  # fmt: skip
        return fenced

    # -- the shapes callers use ----------------------------------------------------------------------------------

    def finish(self, item: Finish, *, then: After | None = None) -> ExportRecord:
        """:meth:`finish_many` of one item; raises its :class:`FencedOut`."""
        (outcome,) = self.finish_many([item], then=then)
        if isinstance(outcome, FencedOut):
            raise outcome
        return outcome

    def complete(
        self, claim: Claim, evidence: CompletionEvidence, *, note: tuple[str, str] | None = None
    ) -> ExportRecord:
        """Records the key as completed from the destination's evidence: ``complete`` when the evidence is this
        attempt's own export, ``repair`` when an earlier attempt's (it committed and died before recording)."""
        return self.finish(Finish(claim, completion_transition(claim, evidence), evidence, note=note))

    def complete_many(self, completions: Sequence[tuple[Claim, CompletionEvidence]]) -> list[ExportRecord | FencedOut]:
        """:meth:`complete` for a group of keys in one transaction (one durable commit after their publishes)."""
        return self.finish_many([Finish(c, completion_transition(c, e), e) for c, e in completions])

    def complete_within(self, claim: Claim, effect: Callable[[Connection], CompletionEvidence]) -> ExportRecord:
        """Runs ``effect`` (a transactional destination's write, on the ledger's connection) and records completion
        in the same transaction: the rows and the completion record commit together or not at all.

        The key is locked and the claim's guard checked before ``effect`` runs, so a fenced attempt writes nothing.
        Any exception from ``effect`` rolls both back.
        """
        ledger = self.ledger
        with ledger.atomic() as conn:
            now = ledger.now(conn)
            current = conn.execute(RUN_BY_KEY_LOCKED, {"k_key": claim.logical_key}).first()
            live = (
                current is not None
                and current.state == ExportState.IN_PROGRESS.value
                and current.fencing_token == claim.fencing_token
                and current.lease_owner == claim.attempt_id
            )
            attempts: list[dict] = []
            if live:
                item = Finish(claim, T.COMPLETE, effect(conn))
                item.check()
                if self._finish_in(conn, item, now, attempts, None) is not None:  # locked above: only a bug
                    raise InvalidTransition(f"{claim.logical_key} changed under its own row lock")
                if attempts:
                    conn.execute(INSERT_ATTEMPT, attempts)
                return ExportRecord.from_row(conn.execute(RUN_BY_KEY, {"k_key": claim.logical_key}).one())
            fenced = self._fenced(conn, claim, now, attempts)
            if attempts:
                conn.execute(INSERT_ATTEMPT, attempts)
        raise fenced  # after the commit: the fenced attempt's row must survive

    def fail(self, claim: Claim, error: BaseException | None = None, *, note: tuple[str, str] | None = None,
             restore_reruns: bool = False) -> ExportRecord:  # fmt: skip
        """Records that the party failed before its commit was sent: nothing of it is visible; safe to retry.
        ``restore_reruns``: an operator's discard, after which the key's automatic reruns count from zero."""
        transition = T.FAIL_RESTORED if restore_reruns else T.FAIL
        return self.finish(Finish(claim, transition, error=error, note=note))

    def mark_remote_unknown(
        self,
        claim: Claim,
        error: BaseException | None = None,
        *,
        sha256: str | None = None,
        location: str | None = None,
        note: tuple[str, str] | None = None,
    ) -> ExportRecord:
        """Records that the destination may or may not hold the party's commit: no retry until reconciled.
        ``sha256`` and ``location`` say what it meant to commit; reconciliation compares them with what it finds."""
        return self.finish(
            Finish(claim, T.MARK_REMOTE_UNKNOWN, error=error, note=note, sha256=sha256, location=location)
        )

    def mark_conflict(
        self,
        claim: Claim,
        error: BaseException | None = None,
        *,
        location: str | None = None,
        note: tuple[str, str] | None = None,
    ) -> ExportRecord:
        """Records that the destination holds something else at this key's place: refused until an operator acts."""
        return self.finish(Finish(claim, T.MARK_CONFLICT, error=error, note=note, location=location))

    def release(self, claim: Claim, note: tuple[str, str], *, then: After | None = None) -> ExportRecord:
        """Puts a held key back in the state it was in before the hold, with ``note`` on the holder's attempt row: an
        operator's resolution that was refused or failed. The state and "stuck since" are the ones the hold read under
        its row lock (never a record read before it: the key may have changed in between), what the key's attempt
        meant to commit is the row's (a hold keeps it). A key held from ``in_progress`` (a lease that had ended) goes to
        ``remote_unknown``: nobody knows what its holder did."""
        ledger = self.ledger
        with ledger.atomic() as conn:
            now = ledger.now(conn)
            row = conn.execute(RUN_BY_KEY_LOCKED, {"k_key": claim.logical_key}).first()
            transition = T.BACK_TO.get(claim.previous_state, T.MARK_REMOTE_UNKNOWN)
            item = Finish(
                claim, transition, note=note, sha256=row.sha256 if row is not None else None,
                location=row.location if row is not None else None, since=claim.previous_updated_at,
            )  # fmt: skip
            attempts: list[dict] = []
            fenced = self._finish_in(conn, item, now, attempts, then)
            if attempts:  # a holder taken over meanwhile already has its row (abandoned)
                conn.execute(INSERT_ATTEMPT, attempts)
            record = conn.execute(RUN_BY_KEY, {"k_key": claim.logical_key}).first()
        if fenced is not None:
            raise fenced
        return ExportRecord.from_row(record)


def completion_transition(claim: Claim, evidence: CompletionEvidence) -> T.Transition:
    """``complete`` for the claim's own export, ``repair`` for an earlier attempt's, ``restatement unchanged`` for a
    restatement that found its data identical to the revision it supersedes (``evidence.unchanged``: nothing was
    committed, the evidence is that revision's)."""
    if evidence.unchanged:
        return T.UNCHANGED
    return T.COMPLETE if evidence.attempt_id == claim.attempt_id else T.REPAIR


def unchanged_note(claim: Claim, evidence: CompletionEvidence | None) -> tuple[str, str]:
    """The attempt row's note of an unchanged restatement: which revision was asked for and which one stays."""
    kept = evidence.revision if evidence is not None else claim.superseded_revision
    return (
        "RestatementUnchanged",
        f"revision {claim.revision} would be identical to revision {kept} (same sha256 and row count): nothing "
        f"published, revision {kept} stays current and the request is closed unchanged",
    )


__all__ = ["Completions", "Finish", "LedgerError", "completion_transition", "unchanged_note"]
