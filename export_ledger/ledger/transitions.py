"""Every transition the ledger makes, declared once, with the one lease predicate.

A key's transitions (:data:`TRANSITIONS`) say from which states, to which state, which attempt outcome they record,
how they count claims, and what guards them; :func:`apply` runs one as a single guarded ``UPDATE ... WHERE
logical_key = :key AND state IN (...) AND fencing_token = :token [AND lease_owner = :owner] [AND the lease expired]``.
Restatement requests and drift records change the same way (:data:`REQUEST_TRANSITIONS`, :data:`DRIFT_TRANSITIONS`,
:func:`close`): a guarded ``UPDATE`` that must match exactly one open row, else a domain error. Which transition a
claim takes is decided by the pure :func:`export_ledger.ledger.selection.select_claim`.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Connection

from export_ledger.ledger.errors import InvalidTransition
from export_ledger.ledger.schema import AttemptOutcome, ExportState, export_drift, export_restatements, export_runs
from export_ledger.ledger.store import database_time

S = ExportState


# -- the one lease predicate -------------------------------------------------------------------------------------


def lease_live(expires_at: dt.datetime | None, now: dt.datetime) -> bool:
    """A lease is live while its expiry is strictly after now; at its expiry instant it has ended."""
    return expires_at is not None and expires_at > now


def lease_expired_sql(now) -> sa.ColumnElement:
    """:func:`lease_live`'s negation in SQL, for ``export_runs`` rows (``now``: a time, or a bind parameter, typed by
    the column)."""
    return export_runs.c.lease_expires_at <= now


# -- a key's transitions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transition:
    """One allowed move of a key.

    Attributes:
        name: What the move is called in messages.
        from_states: States the key may be in; empty for the first claim (no row yet).
        to_state: The state the key is in afterwards.
        outcome: The attempt outcome recorded with the move (None: the attempt's row comes later).
        owner_guard: The party moving the key must hold its lease (``lease_owner`` matches).
        expired_guard: A key found ``in_progress`` moves only once its lease has ended (never from a live lease).
        claims: How ``claim_count`` (export claims since the last resolution or request) moves: ``keep``, ``add``
            (one more export claim), ``one`` (the first claim of a restatement) or ``reset`` (an operator restored
            the automatic reruns).
        guard: The rule in words, for the docs and for errors.
    """

    name: str
    from_states: tuple[ExportState, ...]
    to_state: ExportState
    outcome: AttemptOutcome | None
    owner_guard: bool = False
    expired_guard: bool = False
    claims: str = "keep"
    guard: str = "the fencing token read is still the key's"

    @functools.cached_property
    def statement(self) -> sa.Update:
        """Built once, executed with parameters: building a Core statement on every call cost more than running it."""
        conditions = [
            export_runs.c.logical_key == sa.bindparam("g_key"),
            export_runs.c.state.in_(sa.bindparam("g_states", expanding=True)),
            export_runs.c.fencing_token == sa.bindparam("g_token"),
        ]
        if self.owner_guard:
            conditions.append(export_runs.c.lease_owner == sa.bindparam("g_owner"))
        if self.expired_guard:
            # Only an in_progress row carries a lease to wait for; any other state passes this guard.
            conditions.append(
                sa.or_(export_runs.c.state != S.IN_PROGRESS.value, lease_expired_sql(sa.bindparam("g_now")))
            )
        statement = export_runs.update().where(*conditions)
        counts = self.claim_count
        return statement if counts is None else statement.values(claim_count=counts)

    @property
    def claim_count(self) -> sa.ColumnElement | None:
        """What ``claim_count`` is set to (:attr:`claims`); None: left as it is."""
        return {
            "keep": None,
            "add": export_runs.c.claim_count + 1,
            "one": sa.literal(1),
            "reset": sa.literal(0),
        }[self.claims]


CLAIM_FIRST = Transition(
    "claim", (), S.IN_PROGRESS, None, claims="one",
    guard="no row for the key's business day; its window has ended; not below the low-water mark; the tenant's "
    "calendar contract is the one in force",
)  # fmt: skip
CLAIM_RETRY = Transition(
    "claim", (S.FAILED,), S.IN_PROGRESS, None, claims="add", guard="token matches; the token is incremented"
)
TAKE_OVER = Transition(
    "take over",
    (S.IN_PROGRESS,),
    S.IN_PROGRESS,
    AttemptOutcome.ABANDONED,  # recorded for the holder whose lease ran out
    expired_guard=True,
    claims="add",
    guard="the holder's lease has ended; token matches and is incremented",
)
RESTATE = Transition(
    "restate",
    (S.COMPLETED,),
    S.IN_PROGRESS,
    None,  # the attempt's row is written when its outcome is known, as for any claim
    claims="one",
    guard="an open restatement request for the key; token matches and is incremented; the current revision stays "
    "published and current until the new one is committed",
)
RECONCILE_HOLD = Transition(
    "reconcile hold",
    (S.REMOTE_UNKNOWN, S.IN_PROGRESS),
    S.IN_PROGRESS,
    None,  # the reconciler's row is written with its verdict; an expired holder's `abandoned` row at once
    expired_guard=True,
    guard="reconciliation takes a stuck key (remote_unknown, or a lease that has ended) with a new token, so that "
    "it can fence the destination before judging it",
)
OPERATOR_HOLD = Transition(
    "operator hold",
    (S.CONFLICT, S.FAILED, S.REMOTE_UNKNOWN, S.IN_PROGRESS),
    S.IN_PROGRESS,
    None,  # the operator's row is written when the resolution ends
    expired_guard=True,
    guard="an operator takes the key to resolve it; never from a live lease; token matches and is incremented",
)
RENEW = Transition(
    "renew", (S.IN_PROGRESS,), S.IN_PROGRESS, None, owner_guard=True,
    guard="the party still holds the lease with this token; its lease is extended from the ledger's now",
)  # fmt: skip
COMPLETE = Transition(
    "complete", (S.IN_PROGRESS,), S.COMPLETED, AttemptOutcome.COMPLETED, owner_guard=True,
    guard="the party holds the lease with this token; its own committed export is recorded",
)  # fmt: skip
REPAIR = Transition(
    "repair", (S.IN_PROGRESS,), S.COMPLETED, AttemptOutcome.REPAIRED, owner_guard=True,
    guard="the party holds the lease; an export an earlier attempt committed (the pointer names it) is recorded",
)  # fmt: skip
WITHDRAW = Transition(
    "withdraw restatement", (S.IN_PROGRESS,), S.COMPLETED, AttemptOutcome.REPAIRED, owner_guard=True,
    guard="an operator holds the key, and the pointer still names the recorded revision: it is recorded again",
)  # fmt: skip
UNCHANGED = Transition(
    "restatement unchanged", (S.IN_PROGRESS,), S.COMPLETED, AttemptOutcome.COMPLETED, owner_guard=True,
    guard="the party holds the lease; its restatement's data is the current revision's, so nothing was committed: "
    "the key is completed again at the revision the pointer still names",
)  # fmt: skip
FAIL = Transition("fail", (S.IN_PROGRESS,), S.FAILED, AttemptOutcome.FAILED, owner_guard=True)
FAIL_RESTORED = Transition(
    "fail, reruns restored", (S.IN_PROGRESS,), S.FAILED, AttemptOutcome.FAILED, owner_guard=True, claims="reset",
    guard="an operator discarded the destination's content: the key is exported again with its reruns restored",
)  # fmt: skip
MARK_REMOTE_UNKNOWN = Transition(
    "mark remote_unknown", (S.IN_PROGRESS,), S.REMOTE_UNKNOWN, AttemptOutcome.REMOTE_UNKNOWN, owner_guard=True
)
MARK_CONFLICT = Transition("mark conflict", (S.IN_PROGRESS,), S.CONFLICT, AttemptOutcome.CONFLICT, owner_guard=True)

#: Every transition of a key, in the order a key usually meets them (docs/ledger.md's states are written from this).
TRANSITIONS = (
    CLAIM_FIRST,
    CLAIM_RETRY,
    TAKE_OVER,
    RESTATE,
    RECONCILE_HOLD,
    OPERATOR_HOLD,
    RENEW,
    COMPLETE,
    REPAIR,
    WITHDRAW,
    UNCHANGED,
    FAIL,
    FAIL_RESTORED,
    MARK_REMOTE_UNKNOWN,
    MARK_CONFLICT,
)

#: The transitions that finish a held key (the owner-guarded ones), by the state they lead to.
FINISHING = (COMPLETE, REPAIR, WITHDRAW, UNCHANGED, FAIL, FAIL_RESTORED, MARK_REMOTE_UNKNOWN, MARK_CONFLICT)
#: What puts a held key back in the state it was in, when its holder gives up (a refused resolution, a reconciler
#: that could not reach the destination): each is a truthful finishing transition from that state's point of view.
BACK_TO = {S.FAILED: FAIL, S.CONFLICT: MARK_CONFLICT, S.REMOTE_UNKNOWN: MARK_REMOTE_UNKNOWN}


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
    states = _guarded_states(transition, states, owner, now)
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
    if returning:
        return conn.execute(_returning(transition), parameters).first()
    return conn.execute(transition.statement, parameters).rowcount == 1


def _guarded_states(
    transition: Transition, states: tuple[ExportState, ...] | None, owner: str | None, now: dt.datetime | None
) -> tuple[ExportState, ...]:
    """The states a move of ``transition`` starts from (``states`` narrows them), once its guards have what they
    need: the party that holds the lease, the ledger's time."""
    states = transition.from_states if states is None else states
    if not states or not set(states) <= set(transition.from_states):
        raise InvalidTransition(f"{transition.name} does not start from {[s.value for s in states]}")
    if transition.owner_guard and owner is None:
        raise InvalidTransition(f"{transition.name} needs the party that holds the lease")
    if transition.expired_guard and now is None:
        raise InvalidTransition(f"{transition.name} needs the ledger's time to check the lease")
    return tuple(states)


@functools.lru_cache(maxsize=None)
def _returning(transition: Transition) -> sa.Update:
    return transition.statement.returning(*export_runs.c)


@dataclass(frozen=True)
class Move:
    """One key's part of :func:`apply_many`: what :func:`apply` takes for one key, and its transition."""

    transition: Transition
    logical_key: str
    token: int
    values: dict
    states: tuple[ExportState, ...] | None = None
    owner: str | None = None


#: Moves per statement on SQLite, as one of these counts of rows (the last padded with rows that match no key): a
#: few statements per transition and set of columns, each at most a few hundred bound values.
SQLITE_BATCH_SIZES = (1, 5, 10, 25, 50)
SQLITE_BATCH_ROWS = SQLITE_BATCH_SIZES[-1]


def apply_many(
    conn: Connection, moves: Sequence[Move], *, now: dt.datetime | None = None, locked: bool = False
) -> dict[str, sa.Row]:
    """:func:`apply` for each of ``moves`` (distinct keys, any transitions), each with its own guards; returns the
    updated row of each key that moved, by key (a key whose guards did not match is absent).

    The moves that share a transition, states and columns are one guarded ``UPDATE ... FROM (the moves as rows)
    RETURNING``, each row matched on its own key, token and owner as :func:`apply` matches it: on PostgreSQL the
    moves as arrays (``unnest``), where a group of a hundred keys was a hundred round trips, half of a reconciliation
    tick; on SQLite (``UPDATE ... FROM`` and ``RETURNING``: 3.35 and later, which the ledger needs already) as a
    ``UNION ALL`` of bound rows, :data:`SQLITE_BATCH_ROWS` a statement, where SQLAlchemy's work on a statement per
    key was three quarters of a group's completion. On PostgreSQL every key of
    ``moves`` is first locked in key order, in one statement (as a claim's group locks its keys, so two transactions
    over overlapping keys wait for each other instead of deadlocking, whatever mix of transitions each holds); a row
    whose guards fail stays locked until the commit, as under :func:`apply` one key at a time in order. SQLite has one
    writer at a time (a write transaction begins ``IMMEDIATE``). Any other database takes each move with
    :func:`apply`, in key order. ``locked``: the caller locked the keys already, with :func:`lock_in_key_order`.
    """
    keys = [move.logical_key for move in moves]
    if len(set(keys)) != len(keys):
        raise ValueError("apply_many needs distinct keys")
    moved: dict[str, sa.Row] = {}
    ordered = sorted(moves, key=lambda move: move.logical_key)
    dialect = conn.dialect.name
    if dialect not in ("postgresql", "sqlite"):
        for move in ordered:
            row = apply(
                conn, move.transition, move.logical_key, token=move.token, values=move.values, states=move.states,
                owner=move.owner, now=now, returning=True,
            )  # fmt: skip
            if row is not None:
                moved[move.logical_key] = row
        return moved
    groups: dict[tuple, list[Move]] = {}
    for move in ordered:
        states = _guarded_states(move.transition, move.states, move.owner, now)
        groups.setdefault((move.transition, states, tuple(sorted(move.values))), []).append(move)
    if not groups:
        return moved
    if dialect == "sqlite":
        for (transition, states, columns), group in groups.items():
            for first in range(0, len(group), SQLITE_BATCH_ROWS):
                chunk = group[first : first + SQLITE_BATCH_ROWS]
                size = next(size for size in SQLITE_BATCH_SIZES if size >= len(chunk))
                parameters: dict = {"g_states": [state.value for state in states]}
                if transition.expired_guard:
                    parameters["g_now"] = now
                for i in range(size):  # the rows past the chunk's are NULL: their key matches none
                    move = chunk[i] if i < len(chunk) else None
                    parameters[f"b{i}_key"] = move.logical_key if move else None
                    parameters[f"b{i}_token"] = move.token if move else None
                    parameters.update({f"b{i}_{column}": move.values[column] if move else None for column in columns})
                    if transition.owner_guard:
                        parameters[f"b{i}_owner"] = move.owner if move else None
                statement = _sqlite_batch_statement(transition, columns, size)
                for row in conn.execute(statement, parameters):
                    moved[row.logical_key] = row
        return moved
    if not locked:
        lock_in_key_order(conn, keys)
    for (transition, states, columns), group in groups.items():
        parameters = {
            "g_states": [state.value for state in states],
            "b_key": [move.logical_key for move in group],
            "b_token": [move.token for move in group],
            **{f"b_{column}": [move.values[column] for move in group] for column in columns},
        }
        if transition.owner_guard:
            parameters["b_owner"] = [move.owner for move in group]
        if transition.expired_guard:
            parameters["g_now"] = now
        for row in conn.execute(_batch_statement(transition, columns), parameters):
            moved[row.logical_key] = row
    return moved


def lock_in_key_order(conn: Connection, keys: Sequence[str], *, clock: bool = False) -> dt.datetime | None:
    """On PostgreSQL, locks the rows of ``keys`` in key order, in one statement, as :func:`apply_many` does first.

    With ``clock``, the same statement reads the transaction's ``now()`` and returns it (None when no key has a row):
    a group's completion needs the ledger's clock before its moves, and a round trip of its own cost as much as the
    lock. Does nothing on other databases (SQLite has one writer at a time) and returns None.
    """
    if conn.dialect.name != "postgresql":
        return None
    statement = _LOCK_IN_KEY_ORDER_WITH_CLOCK if clock else _LOCK_IN_KEY_ORDER
    rows = conn.execute(statement, {"l_keys": sorted(keys)}).all()
    return database_time(rows[0].now) if clock and rows else None


def _lock_statement(*columns) -> sa.Select:
    return (
        sa.select(export_runs.c.logical_key, *columns)
        .where(export_runs.c.logical_key == sa.any_(sa.cast(sa.bindparam("l_keys"), pg.ARRAY(sa.String))))
        .order_by(export_runs.c.logical_key)
        .with_for_update()
    )


_LOCK_IN_KEY_ORDER = _lock_statement()
_LOCK_IN_KEY_ORDER_WITH_CLOCK = _lock_statement(sa.func.now().label("now"))


def _guarded_update(transition: Transition, rows, columns: tuple[str, ...]) -> sa.Update:
    """:attr:`Transition.statement` with each key's guards and values read from ``rows`` (one row per move)."""
    conditions = [
        export_runs.c.logical_key == rows.c.g_key,
        export_runs.c.state.in_(sa.bindparam("g_states", expanding=True)),
        export_runs.c.fencing_token == rows.c.g_token,
    ]
    if transition.owner_guard:
        conditions.append(export_runs.c.lease_owner == rows.c.g_owner)
    if transition.expired_guard:
        conditions.append(sa.or_(export_runs.c.state != S.IN_PROGRESS.value, lease_expired_sql(sa.bindparam("g_now"))))
    values: dict = {"state": sa.literal(transition.to_state.value), **{c: rows.c[f"v_{c}"] for c in columns}}
    if transition.claim_count is not None:
        values["claim_count"] = transition.claim_count
    return export_runs.update().where(*conditions).values(values).returning(*export_runs.c)


@functools.lru_cache(maxsize=None)
def _sqlite_batch_statement(transition: Transition, columns: tuple[str, ...], count: int) -> sa.Update:
    """:attr:`Transition.statement` for ``count`` keys on SQLite: the moves as a ``UNION ALL`` of rows of bound
    values, each bound as its column binds it, built once per transition, set of columns and count."""

    def row(i: int) -> sa.Select:
        parts = [
            sa.bindparam(f"b{i}_key", type_=export_runs.c.logical_key.type).label("g_key"),
            sa.bindparam(f"b{i}_token", type_=export_runs.c.fencing_token.type).label("g_token"),
            *([sa.bindparam(f"b{i}_owner", type_=export_runs.c.lease_owner.type).label("g_owner")]
              if transition.owner_guard else []),
            *(sa.bindparam(f"b{i}_{c}", type_=export_runs.c[c].type).label(f"v_{c}") for c in columns),
        ]  # fmt: skip
        return sa.select(*parts)

    rows = (sa.union_all(*(row(i) for i in range(count))) if count > 1 else row(0)).subquery("moves")
    return _guarded_update(transition, rows, columns)


@functools.lru_cache(maxsize=None)
def _batch_statement(transition: Transition, columns: tuple[str, ...]) -> sa.Update:
    """:attr:`Transition.statement` for many keys on PostgreSQL: the keys, their guards and their values as arrays,
    one row each (``unnest``), built once per transition and set of columns."""

    def array(name: str, kind) -> sa.ColumnElement:
        # Typed here (each value bound as its column binds it: a naive time is refused as apply refuses it) and on
        # the server (an array of NULLs, no lease to set, is otherwise text[], which no column takes).
        return sa.cast(sa.bindparam(name, type_=pg.ARRAY(kind)), pg.ARRAY(kind))

    names = ["g_key", "g_token", *(["g_owner"] if transition.owner_guard else []), *(f"v_{c}" for c in columns)]
    arrays = [
        array("b_key", export_runs.c.logical_key.type),
        array("b_token", export_runs.c.fencing_token.type),
        *([array("b_owner", export_runs.c.lease_owner.type)] if transition.owner_guard else []),
        *(array(f"b_{column}", export_runs.c[column].type) for column in columns),
    ]
    rows = sa.func.unnest(*arrays).table_valued(*names).render_derived(name="moves")
    return _guarded_update(transition, rows, columns)


# -- requests and drift records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowTransition:
    """One allowed move of a restatement request or a drift record: an open row closed, guarded so that it matches
    that row only while it is open.

    Attributes:
        name: What the move is called in messages.
        table: ``export_restatements`` or ``export_drift``.
        closed_column: The column that is NULL while the row is open (``closed_at``, ``cleared_at``).
        outcome: The request's outcome afterwards (``published``, ``withdrawn``); None for drift records.
    """

    name: str
    table: sa.Table
    closed_column: str
    outcome: str | None = None

    @functools.cached_property
    def statement(self) -> sa.Update:
        closed = self.table.c[self.closed_column]
        statement = self.table.update().where(self.table.c.id == sa.bindparam("g_id"), closed.is_(None))
        values = {self.closed_column: sa.bindparam("g_now")}
        if self.outcome is not None:
            values["outcome"] = sa.literal(self.outcome)
        return statement.values(**values)

    @functools.cached_property
    def many(self) -> sa.Update:
        """The same move for a list of rows (``g_ids``), each still guarded by being open."""
        closed = self.table.c[self.closed_column]
        statement = self.table.update().where(
            self.table.c.id.in_(sa.bindparam("g_ids", expanding=True)), closed.is_(None)
        )
        values = {self.closed_column: sa.bindparam("g_now")}
        if self.outcome is not None:
            values["outcome"] = sa.literal(self.outcome)
        return statement.values(**values)


PUBLISH_REQUEST = RowTransition("publish restatement", export_restatements, "closed_at", "published")
WITHDRAW_REQUEST = RowTransition("withdraw restatement", export_restatements, "closed_at", "withdrawn")
#: The restatement's data was the current revision's: nothing was published (schema version 7).
UNCHANGED_REQUEST = RowTransition("close restatement unchanged", export_restatements, "closed_at", "unchanged")
CLEAR_DRIFT = RowTransition("clear drift", export_drift, "cleared_at")

#: Opening a request or a drift record is an INSERT guarded by a partial unique index (one open row per key).
REQUEST_TRANSITIONS = (PUBLISH_REQUEST, WITHDRAW_REQUEST, UNCHANGED_REQUEST)
DRIFT_TRANSITIONS = (CLEAR_DRIFT,)


def close(conn: Connection, transition: RowTransition, row_id: int, now: dt.datetime) -> None:
    """Closes one open row; raises :class:`InvalidTransition` when it is not open (someone closed it meanwhile)."""
    if conn.execute(transition.statement, {"g_id": row_id, "g_now": now}).rowcount != 1:
        raise InvalidTransition(f"{transition.name}: row {row_id} of {transition.table.name} is not open")


def close_many(conn: Connection, transition: RowTransition, row_ids: list[int], now: dt.datetime) -> int:
    """Closes whichever of ``row_ids`` are still open; returns how many were. For sweeps that may meet rows another
    pass closed first (a drift pass clearing records a restatement cleared)."""
    if not row_ids:
        return 0
    return conn.execute(transition.many, {"g_ids": list(row_ids), "g_now": now}).rowcount
