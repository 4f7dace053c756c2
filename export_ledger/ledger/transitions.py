"""Every transition of a logical key, declared once: from which states, to which state, which attempt outcome it
records, and what guards it. Claim, complete, fail, reconciliation and the operator commands all go through
:func:`apply`, so a guard is written in one place and cannot drift between two copies of it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger.errors import InvalidTransition
from export_ledger.ledger.schema import AttemptOutcome, ExportState, export_runs

S = ExportState


@dataclass(frozen=True)
class Transition:
    """One allowed move of a key.

    Attributes:
        name: What the move is called in messages.
        from_states: States the key may be in; empty for the first claim (no row yet).
        to_state: The state the key is in afterwards.
        outcome: The attempt outcome recorded with the move (None: the attempt's row comes later).
        owner_guard: The attempt moving the key must hold its lease (``lease_owner`` matches).
        expired_guard: A key found ``in_progress`` moves only once its lease has expired (never from a live lease).
        guard: The rule in words, for the README and for errors.
    """

    name: str
    from_states: tuple[ExportState, ...]
    to_state: ExportState
    outcome: AttemptOutcome | None
    owner_guard: bool = False
    expired_guard: bool = False
    guard: str = "the fencing token read is still the key's"


CLAIM_FIRST = Transition(
    "claim", (), S.IN_PROGRESS, None, guard="no row for the key's business day; not below the low-water mark"
)
CLAIM_RETRY = Transition("claim", (S.FAILED,), S.IN_PROGRESS, None, guard="token matches; the token is incremented")
TAKE_OVER = Transition(
    "take over",
    (S.IN_PROGRESS,),
    S.IN_PROGRESS,
    AttemptOutcome.ABANDONED,  # recorded for the holder whose lease ran out
    expired_guard=True,
    guard="the holder's lease expired; token matches and is incremented",
)
COMPLETE = Transition(
    "complete", (S.IN_PROGRESS,), S.COMPLETED, AttemptOutcome.COMPLETED, owner_guard=True,
    guard="the attempt holds the lease with this token; the destination's evidence is recorded",
)  # fmt: skip
REPAIR = Transition(
    "repair", (S.IN_PROGRESS,), S.COMPLETED, AttemptOutcome.REPAIRED, owner_guard=True,
    guard="the attempt holds the lease; an earlier attempt's published export is recorded instead of a new one",
)  # fmt: skip
FAIL = Transition("fail", (S.IN_PROGRESS,), S.FAILED, AttemptOutcome.FAILED, owner_guard=True)
MARK_REMOTE_UNKNOWN = Transition(
    "mark remote_unknown", (S.IN_PROGRESS,), S.REMOTE_UNKNOWN, AttemptOutcome.REMOTE_UNKNOWN, owner_guard=True
)
MARK_CONFLICT = Transition("mark conflict", (S.IN_PROGRESS,), S.CONFLICT, AttemptOutcome.CONFLICT, owner_guard=True)
RECONCILE_COMPLETED = Transition(
    "reconcile to completed", (S.REMOTE_UNKNOWN, S.IN_PROGRESS), S.COMPLETED, AttemptOutcome.REPAIRED,
    expired_guard=True, guard="the destination holds this key's export, intact",
)  # fmt: skip
RECONCILE_ABSENT = Transition(
    "reconcile to failed", (S.REMOTE_UNKNOWN, S.IN_PROGRESS), S.FAILED, AttemptOutcome.FAILED,
    expired_guard=True, guard="the destination holds nothing for the key",
)  # fmt: skip
RECONCILE_CONFLICT = Transition(
    "reconcile to conflict", (S.REMOTE_UNKNOWN, S.IN_PROGRESS), S.CONFLICT, AttemptOutcome.CONFLICT,
    expired_guard=True, guard="the destination holds something else at the key's place",
)  # fmt: skip

RESTATE = Transition(
    "restate",
    (S.COMPLETED,),
    S.IN_PROGRESS,
    None,  # the attempt's row is written when its outcome is known, as for any claim
    guard="an open restatement request for the key; token matches and is incremented; the current revision stays "
    "published and current until the new one is",
)
WITHDRAW_RESTATEMENT = Transition(
    "withdraw restatement",
    (S.FAILED,),
    S.COMPLETED,
    None,  # an operator's decision: recorded in export_operator_log and on the closed request
    guard="an operator withdraws the open request; the key is completed again with its current revision's evidence",
)
OPERATOR_HOLD = Transition(
    "operator hold",
    (S.CONFLICT, S.FAILED, S.REMOTE_UNKNOWN, S.IN_PROGRESS),
    S.IN_PROGRESS,
    None,  # the operator's row is written when the resolution ends (completed, or failed after a discard)
    expired_guard=True,
    guard="an operator takes the lease to resolve the key; never from a live lease; token matches and is incremented",
)

#: Every transition, in the order a key usually meets them (the README's state table is written from this).
TRANSITIONS = (
    CLAIM_FIRST,
    CLAIM_RETRY,
    TAKE_OVER,
    COMPLETE,
    REPAIR,
    FAIL,
    MARK_REMOTE_UNKNOWN,
    MARK_CONFLICT,
    RECONCILE_COMPLETED,
    RECONCILE_ABSENT,
    RECONCILE_CONFLICT,
    RESTATE,
    WITHDRAW_RESTATEMENT,
    OPERATOR_HOLD,
)

#: Reconciliation's transition for each state a verdict leads to.
RECONCILE_TO = {t.to_state: t for t in (RECONCILE_COMPLETED, RECONCILE_ABSENT, RECONCILE_CONFLICT)}


def _statement(owner: bool, expired: bool) -> sa.Update:
    conditions = [
        export_runs.c.logical_key == sa.bindparam("g_key"),
        export_runs.c.state.in_(sa.bindparam("g_states", expanding=True)),
        export_runs.c.fencing_token == sa.bindparam("g_token"),
    ]
    if owner:
        conditions.append(export_runs.c.lease_owner == sa.bindparam("g_owner"))
    if expired:
        # Only an in_progress row carries a lease to wait for; any other state passes this guard.
        conditions.append(
            sa.or_(
                export_runs.c.state != S.IN_PROGRESS.value,
                export_runs.c.lease_expires_at < sa.bindparam("g_now"),
            )
        )
    return export_runs.update().where(*conditions)


# Built once, executed with parameters: building a Core statement on every call cost more than executing it.
_STATEMENTS = {(o, e): _statement(o, e) for o in (False, True) for e in (False, True)}
_RETURNING = {flags: statement.returning(*export_runs.c) for flags, statement in _STATEMENTS.items()}


def apply(
    conn: Connection,
    transition: Transition,
    logical_key: str,
    *,
    token: int,
    values: dict,
    states: tuple[ExportState, ...] | None = None,
    owner: str | None = None,
    now: dt.datetime | None = None,
    returning: bool = False,
):
    """Applies ``transition`` to one key with its guards; returns the updated row (``returning``) or whether it moved.

    ``states`` narrows ``from_states`` to the state a caller read (reconciliation acts on what it examined).
    """
    states = transition.from_states if states is None else states
    if not states or not set(states) <= set(transition.from_states):
        raise InvalidTransition(f"{transition.name} does not start from {[s.value for s in states]}")
    if transition.owner_guard and owner is None:
        raise InvalidTransition(f"{transition.name} needs the attempt that holds the lease")
    if transition.expired_guard and now is None:
        raise InvalidTransition(f"{transition.name} needs the current time to check the lease")
    parameters = {
        "g_key": logical_key,
        "g_states": [s.value for s in states],
        "g_token": token,
        "state": transition.to_state.value,
        **values,
    }
    if transition.owner_guard:
        parameters["g_owner"] = owner
    if transition.expired_guard:
        parameters["g_now"] = now
    flags = (transition.owner_guard, transition.expired_guard)
    if returning:
        return conn.execute(_RETURNING[flags], parameters).first()
    return conn.execute(_STATEMENTS[flags], parameters).rowcount == 1
