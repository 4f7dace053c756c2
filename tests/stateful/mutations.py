"""The guards of docs/protocol.md, each removed by a monkeypatch (never by editing the library): a mutation test runs
the state machine with one of these in place and expects a :class:`~stateful.machine.ProtocolViolation`.

Each function takes pytest's ``monkeypatch`` and removes exactly one guard (one, ``takeover_failure_before_fence``,
removes a rule of ``export_key`` from the machine's own attempts, which take ``export_key`` apart).
"""

from __future__ import annotations

from dataclasses import replace

import sqlalchemy as sa

from export_ledger import reconcile
from export_ledger.destinations.publishing import PublishingDestination
from export_ledger.ledger import selection
from export_ledger.ledger import transitions as T
from export_ledger.ledger.schema import export_runs


def commit_fence_check(monkeypatch) -> None:
    """``commit(t, place)`` is refused when the pointer's fence is above ``t`` (Fenced): removed by letting the pointer
    reads inside ``commit`` see a fence of at most ``t``."""
    commit, pointer = PublishingDestination.commit, PublishingDestination.pointer
    inside: list[int] = []

    def pointer_seen_by_commit(self, target):
        found = pointer(self, target)
        return replace(found, fence=min(found.fence, inside[-1])) if inside else found

    def unfenced_commit(self, staged, token, *, superseded):
        inside.append(token)
        try:
            return commit(self, staged, token, superseded=superseded)
        finally:
            inside.pop()

    monkeypatch.setattr(PublishingDestination, "pointer", pointer_seen_by_commit)
    monkeypatch.setattr(PublishingDestination, "commit", unfenced_commit)


def fence_write(monkeypatch) -> None:
    """``fence(t)`` raises the pointer's fence to ``t`` (steps 2 of an attempt, of reconciliation, of an operator):
    made a no-op that only reads the pointer."""
    def read_only(self, target, token, *, logical_key, read=None):
        return self.pointer(target)

    monkeypatch.setattr(PublishingDestination, "fence", read_only)


def reconciler_fence(monkeypatch) -> None:
    """Reconciliation fences with its hold's token before it judges (its step 2): the fence skipped inside
    ``reconcile.examine`` only."""
    examine, fence = reconcile.examine, PublishingDestination.fence
    inside: list[bool] = []

    def fence_unless_reconciling(self, target, token, *, logical_key, read=None):
        if inside:
            return self.pointer(target)
        return fence(self, target, token, logical_key=logical_key, read=read)

    def unfenced_examine(destination, record, claim, read=None):
        inside.append(True)
        try:
            return examine(destination, record, claim, read)
        finally:
            inside.pop()

    monkeypatch.setattr(PublishingDestination, "fence", fence_unless_reconciling)
    monkeypatch.setattr(reconcile, "examine", unfenced_examine)


def sweep_token_bound(monkeypatch) -> None:
    """The sweep deletes only places with a token below the sweeper's (fenced by now): the bound lifted."""
    sweep = PublishingDestination.sweep
    monkeypatch.setattr(PublishingDestination, "sweep", lambda self, target, token, pointer: sweep(
        self, target, 1 << 40, pointer))  # fmt: skip


def sweep_revision_bound(monkeypatch) -> None:
    """The sweep deletes only places of a revision above the pointer's (no pointer ever named them): the bound
    lifted (the sweep reads the pointer as naming revision 0)."""
    sweep = PublishingDestination.sweep
    monkeypatch.setattr(PublishingDestination, "sweep", lambda self, target, token, pointer: sweep(
        self, target, token, replace(pointer, revision=0)))  # fmt: skip


def _expiry_guard(monkeypatch, live: bool) -> None:
    monkeypatch.setattr(T, "lease_live", lambda expires_at, now: live)
    monkeypatch.setattr(T, "lease_expired_sql", lambda now: sa.false() if live else sa.true())
    for transition in T.TRANSITIONS:  # their guarded UPDATEs were built with the real predicate: build them again
        monkeypatch.delitem(transition.__dict__, "statement", raising=False)
    T._returning.cache_clear()


def lease_expiry(monkeypatch) -> None:
    """A key ``in_progress`` is taken over (or held by reconciliation, or an operator) only once its lease has ended
    by the ledger's clock (the one lease predicate, in Python and in SQL): every lease taken as ended."""
    _expiry_guard(monkeypatch, live=False)


def lease_end(monkeypatch) -> None:
    """The other side of the lease predicate: a lease ends (``lease_expires_at <= now``). Every lease taken as live
    forever: only liveness can notice."""
    _expiry_guard(monkeypatch, live=True)


def ledger_token_guard(monkeypatch) -> None:
    """Every finishing transition is guarded by the party's token and lease owner (fencing in the ledger): the guard
    made to match whatever the key's row holds."""
    apply = T.apply

    def unguarded(conn, transition, logical_key, *, token, values, states=None, owner=None, now=None,
                  returning=False):  # fmt: skip
        if transition in T.FINISHING:
            row = conn.execute(
                sa.select(export_runs.c.fencing_token, export_runs.c.lease_owner).where(
                    export_runs.c.logical_key == logical_key
                )
            ).first()
            if row is not None:
                token = row.fencing_token
                owner = row.lease_owner if row.lease_owner is not None else owner
        return apply(conn, transition, logical_key, token=token, values=values, states=states, owner=owner, now=now,
                     returning=returning)  # fmt: skip

    def unguarded_many(conn, moves, *, now=None, locked=False):  # a group's moves (finish_many, hold_many) alike
        rows = {
            row.logical_key: row
            for row in conn.execute(
                sa.select(export_runs.c.logical_key, export_runs.c.fencing_token, export_runs.c.lease_owner).where(
                    export_runs.c.logical_key.in_([move.logical_key for move in moves])
                )
            )
        }
        moves = [
            replace(move, token=rows[move.logical_key].fencing_token,
                    owner=rows[move.logical_key].lease_owner or move.owner)
            if move.transition in T.FINISHING and move.logical_key in rows else move
            for move in moves
        ]  # fmt: skip
        return apply_many(conn, moves, now=now, locked=locked)

    apply_many = T.apply_many
    monkeypatch.setattr(T, "apply", unguarded)
    monkeypatch.setattr(T, "apply_many", unguarded_many)


def window_end(monkeypatch) -> None:
    """A key is claimed only once its window has ended by the ledger's clock: the check made to look at the window's
    end instead of now."""
    refusal = selection.window_refusal
    monkeypatch.setattr(selection, "window_refusal", lambda key, now: refusal(key, max(now, key.window.end_utc)))


def commit_supersedes_check(monkeypatch) -> None:
    """``commit`` moves the pointer only from the revision the commit supersedes (any other is a conflict, never
    moved over): the check removed by telling ``commit`` that whatever the pointer names is the one superseded.

    Not caught, and not in the tests: with every writer following the protocol, a pointer at another revision always
    carries a fence above the committer's token (the committer fenced it itself, so only a higher token moved it), and
    the fence check refuses first. The check guards against writers outside the protocol (0.4.0 layouts, whose
    pointers have fence 0, a hand-edited pointer), which the machine does not model."""
    commit, pointer = PublishingDestination.commit, PublishingDestination.pointer

    def commit_over_anything(self, staged, token, *, superseded):
        return commit(self, staged, token, superseded=pointer(self, staged.target).revision)

    monkeypatch.setattr(PublishingDestination, "commit", commit_over_anything)


def takeover_failure_before_fence(monkeypatch) -> None:
    """docs/protocol.md step 2: a takeover's error before its fence lands records ``remote_unknown`` (its predecessor
    is not fenced and may still commit). That rule lives in ``export_key`` (protocol.py), which the machine takes
    apart: removed in the machine's attempts, which then record ``failed`` as the code did before the rule."""
    from stateful.parties import ExportAttempt

    monkeypatch.setattr(ExportAttempt, "failed_before_fence", True)


def discard_restore(monkeypatch) -> None:
    """``resolve --discard-destination`` sets the pointer back to the ledger's current revision: made to set it back
    to nothing."""
    from export_ledger import resolve

    monkeypatch.setattr(resolve, "recorded_target", lambda ledger, record: None)


def reconciler_judge(monkeypatch) -> None:
    """Reconciliation records ``failed`` only when the pointer names the superseded revision (ABSENT): made to take a
    published revision for an absent one."""
    examine = reconcile.examine

    def misjudged(destination, record, claim, read=None):
        finding = examine(destination, record, claim, read)
        if finding.verdict is reconcile.Verdict.COMPLETED:
            return reconcile.Finding(finding.record, reconcile.Verdict.ABSENT, "misjudged")
        return finding

    monkeypatch.setattr(reconcile, "examine", misjudged)


class _ForgetfulFunc:
    """``sqlalchemy.func``, but the highest revision ever requested reads as NULL."""

    def __getattr__(self, name):
        return getattr(sa.func, name)

    @staticmethod
    def max(column, *rest):
        from export_ledger.ledger.schema import export_restatements

        return sa.null() if column is export_restatements.c.revision else sa.func.max(column, *rest)


class _ForgetfulSa:
    """``sqlalchemy`` as the restatements module sees it, with :class:`_ForgetfulFunc` for ``func``."""

    func = _ForgetfulFunc()

    def __getattr__(self, name):
        return getattr(sa, name)


def request_revision_numbering(monkeypatch) -> None:
    """A request's revision is one more than any revision the key had *or was asked for* (a withdrawn request's
    number is never given again): the requests' part forgotten (one more than the recorded revisions only)."""
    from export_ledger.ledger import restatements

    monkeypatch.setattr(restatements, "sa", _ForgetfulSa())


def contract_refusal(monkeypatch) -> None:
    """A claim whose contract is not the one in force is refused (``ContractChanged``): the comparison made to find
    every contract the same as the one recorded (so the claim goes on, under the contract in force)."""
    from export_ledger.ledger import contracts

    monkeypatch.setattr(contracts, "_same", lambda held, wanted: True)


def moved_refusal(monkeypatch) -> None:
    """A claim that would carry a key whose earlier attempts may have written at its contract's destination over to
    another (a takeover, a restatement, the retry of a failed restatement) is refused (``DestinationMoved``): no key
    ever found moved."""
    from export_ledger.ledger.contracts import Contracts

    monkeypatch.setattr(Contracts, "moved_in", lambda self, conn, records, decided, contracts: {})


def accept_settled_check(monkeypatch) -> None:
    """accept-contract moves the destination only when no key of the export has an open restatement request (keys in
    progress, of unknown outcome or in conflict at the old destination are settled there: their takeover is refused
    with ``DestinationMoved``): the check told that the destination does not move.

    Not caught, and not in the tests: a request is refused for a key kept at an earlier destination, and a restatement
    claim under the new contract is refused with ``DestinationMoved``, so an open request can only wait, escalated as
    restating (the model check shows the acceptance's own checks redundant in the same way: docs/model-check.md)."""
    from export_ledger.ledger.contracts import Contracts

    check = Contracts._check_terms_change

    def destination_unmoved(self, conn, export, current, terms, exported):
        return check(self, conn, export, current, {**terms, "destination": current.get("destination")}, exported)

    monkeypatch.setattr(Contracts, "_check_terms_change", destination_unmoved)


MUTATIONS = {
    "commit_fence_check": commit_fence_check,
    "fence_write": fence_write,
    "reconciler_fence": reconciler_fence,
    "sweep_token_bound": sweep_token_bound,
    "sweep_revision_bound": sweep_revision_bound,
    "lease_expiry": lease_expiry,
    "lease_end": lease_end,
    "ledger_token_guard": ledger_token_guard,
    "window_end": window_end,
    "commit_supersedes_check": commit_supersedes_check,
    "takeover_failure_before_fence": takeover_failure_before_fence,
    "discard_restore": discard_restore,
    "reconciler_judge": reconciler_judge,
    "request_revision_numbering": request_revision_numbering,
    "contract_refusal": contract_refusal,
    "moved_refusal": moved_refusal,
    "accept_settled_check": accept_settled_check,
}
