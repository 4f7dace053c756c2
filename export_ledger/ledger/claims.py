"""Claims and holds: the only transitions that take a key, each in one ledger transaction on the ledger's clock.

An *export claim* (:meth:`Claims.claim_many`) takes a key for an attempt that will publish it: first claim, retry,
takeover of an ended lease, or a restatement. A *hold* takes a stuck key for a party that will only judge it: the
reconciler (:meth:`Claims.hold_many`) or an operator (:meth:`Claims.hold`). Both raise the fencing token, so that the
party can fence the destination before it looks (docs/protocol.md).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import replace

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.calendar import tz_database_version
from export_ledger.keys import LogicalKey
from export_ledger.ledger import transitions as T
from export_ledger.ledger.contracts import Decided
from export_ledger.ledger.errors import FencedOut, InvalidTransition, LedgerError
from export_ledger.ledger.records import AlreadyCompleted, Claim, ExportRecord, Restatement
from export_ledger.ledger.rows import INSERT_ATTEMPT, INSERT_RUN, RUN_BY_KEY_LOCKED, abandoned_values, attempt_values
from export_ledger.ledger.schema import (
    RUN_COLUMNS,
    AttemptOutcome,
    ExportState,
    export_missed_partitions,
    export_runs,
)
from export_ledger.ledger.selection import Refuse, Skip, select_claim, select_hold
from export_ledger.ledger.store import database_time

#: A claim's outcome per key: the claim, "already completed", or the refusal (returned, never raised, by
#: :meth:`Claims.claim_many`).
ClaimOutcome = Claim | AlreadyCompleted | LedgerError


class Claims:
    """Claims and holds of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    # -- export claims -----------------------------------------------------------------------------------------

    def claim(self, key: LogicalKey, attempt_id: str, *, contract: Mapping | None = None) -> Claim | AlreadyCompleted:
        """Takes the lease on ``key`` for ``attempt_id`` and increments its fencing token.

        Args:
            key: The key; its window must have ended by the ledger's clock.
            attempt_id: The attempt's id (a Dagster run id and step key).
            contract: The tenant's calendar contract the attempt computed the window with; refused unless it is the
                one in force (recorded at the tenant's first claim). None: not checked (low-level use).

        Returns :class:`AlreadyCompleted` (and records that attempt) when the key is done.

        Raises:
            LeaseHeld: another attempt holds a live lease; the message names it.
            NeedsReconciliation: the key is ``remote_unknown``.
            ConflictRecorded, BelowLowWater, EmptyWindow, WindowNotOver, ContractChanged: as the message says.
        """
        contracts = None if contract is None else {(key.export, key.tenant): contract}
        (outcome,) = self.claim_many([key], attempt_id, contracts=contracts)
        if isinstance(outcome, LedgerError):
            raise outcome
        return outcome

    def claim_many(
        self,
        keys: Sequence[LogicalKey],
        attempt_id: str,
        *,
        contracts: Mapping[tuple[str, str], Mapping] | None = None,
    ) -> list[ClaimOutcome]:
        """Claims several keys in one transaction: one durable commit for a group of a run's keys.

        Each key gets its own decision (:func:`~export_ledger.ledger.selection.select_claim`), lease and fencing
        token. A refusal is returned in the key's place, never raised, so one refused key never stops the others;
        its ``refused`` attempt row commits with the rest. Rows are locked in logical key order and new rows inserted
        in that order, so overlapping groups wait for each other instead of deadlocking. A concurrent first claim of
        one of the keys makes the insert collide: the transaction rolls back (nothing of it was acted upon) and is
        tried again, finding the other claim's row.

        Args:
            keys: Distinct logical keys.
            attempt_id: This attempt's id.
            contracts: ``(export, tenant) -> contract`` for the keys' tenants (see :meth:`claim`).

        Raises:
            ValueError: a key appears twice.
            LedgerUnavailable: the ledger failed; nothing was claimed.
        """
        names = [str(key) for key in keys]
        if len(set(names)) != len(names):
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"claim_many needs distinct keys; repeated: {repeated[:5]}")
        if not keys:
            return []
        for _ in range(5):
            try:
                return self._claim_group(keys, attempt_id, contracts or {})
            except sa.exc.IntegrityError:
                continue  # a concurrent first claim inserted one of the keys: look again
        raise self._collision(keys)

    def _claim_group(
        self, keys: Sequence[LogicalKey], attempt_id: str, contracts: Mapping[tuple[str, str], Mapping]
    ) -> list[ClaimOutcome]:
        ledger = self.ledger
        outcomes: list[ClaimOutcome | None] = [None] * len(keys)
        inserts: list[dict] = []
        attempts: list[dict] = []
        with ledger.atomic() as conn:
            now, missed_open = _claim_facts(ledger, conn, sorted({key.export for key in keys}))
            decided = ledger.contracts.decide_in(conn, contracts, now, _spans(keys)) if contracts else Decided()
            refused = decided.refusals
            found = _find_many(conn, keys)
            records = {k: ExportRecord.from_row(row) for k, row in found.items()}
            moved = ledger.contracts.moved_in(conn, list(records.values()), decided, contracts) if contracts else {}
            requests = ledger.restatements.open_in(conn, [row.logical_key for row in found.values()])
            supersedes = ledger.restatements.current_in(conn, list(requests))
            marks: dict[str, dt.date | None] = {}
            names = [str(key) for key in keys]
            for i in sorted(range(len(keys)), key=names.__getitem__):
                key = keys[i]
                record = records.get((key.export, key.tenant, key.window.timezone, key.window.business_date))
                if record is None and key.export not in marks:
                    # Read after the rows are locked, never before: a prune that deleted a key's row while this
                    # claim waited on it has committed its mark by now (READ COMMITTED), and the key is refused.
                    marks[key.export] = ledger.retention.low_water_in(conn, key.export)
                request = requests.get(record.logical_key) if record is not None else None
                decision = select_claim(
                    record,
                    request,
                    now,
                    key=key,
                    low_water=marks.get(key.export),
                    allow_below_low_water=ledger.allow_below_low_water,
                )
                contract_refusal = refused.get((key.export, key.tenant))
                if contract_refusal is not None and not isinstance(decision, Skip):
                    decision = Refuse(contract_refusal)
                elif record is not None and record.logical_key in moved and _may_carry_writes(decision, request):
                    decision = Refuse(moved[record.logical_key])
                contract_id = decided.in_force.get((key.export, key.tenant))
                outcomes[i] = self._apply_claim(
                    conn, key, record, request, decision, attempt_id, now, inserts, attempts, supersedes, contract_id
                )
            if inserts:
                conn.execute(INSERT_RUN, inserts)  # one executemany, in logical key order
            if attempts:
                conn.execute(INSERT_ATTEMPT, attempts)
            if missed_open:  # a run got this far: its partitions are not missed
                reached = {
                    (key.export, key.window.timezone, key.window.business_date)
                    for key, outcome in zip(keys, outcomes, strict=True)
                    if isinstance(outcome, (Claim, AlreadyCompleted))
                }
                ledger.attention.close_missed_in(conn, reached, now)
        return outcomes

    def _apply_claim(
        self,
        conn: Connection,
        key: LogicalKey,
        record: ExportRecord | None,
        request: Restatement | None,
        decision,
        attempt_id: str,
        now: dt.datetime,
        inserts: list[dict],
        attempts: list[dict],
        supersedes: Mapping[str, tuple[int, str]],
        contract_id: int | None = None,
    ) -> ClaimOutcome:
        """One key's decision, applied inside the group's transaction (rows to insert go to ``inserts`` and
        ``attempts`` for the caller to write, in key order). ``contract_id`` is the contract the key is claimed
        under (None: no contract checked, the key's own is kept)."""
        expires = now + self.ledger.lease_ttl
        if isinstance(decision, Skip):
            attempts.append(attempt_values(record.logical_key, attempt_id, None, now, AttemptOutcome.ALREADY_COMPLETED))
            return AlreadyCompleted(record)
        if isinstance(decision, Refuse):
            if record is not None and decision.recorded:
                attempts.append(
                    attempt_values(record.logical_key, attempt_id, None, now, AttemptOutcome.REFUSED, decision.error)
                )
            return decision.error
        if decision is T.CLAIM_FIRST:
            tz_database = tz_database_version(key.window.timezone)
            inserts.append(
                dict(
                    logical_key=str(key), export=key.export, tenant=key.tenant,
                    business_date=key.window.business_date, timezone=key.window.timezone,
                    window_start_utc=key.window.start_utc, window_end_utc=key.window.end_utc,
                    tz_database=tz_database, state=ExportState.IN_PROGRESS.value, lease_owner=attempt_id,
                    lease_expires_at=expires, attempt_started_at=now, fencing_token=1, claim_count=1,
                    created_at=now, updated_at=now, contract_id=contract_id,
                )
            )  # fmt: skip
            return Claim(str(key), attempt_id, 1, key.window, now, expires, None, tz_database)
        if decision is T.TAKE_OVER:
            attempts.append(abandoned_values(record, now))  # the holder's lease ended without a result
        token = record.fencing_token + 1
        moved = T.apply(
            conn,
            decision,
            record.logical_key,
            token=record.fencing_token,
            now=now,
            values=dict(
                lease_owner=attempt_id, lease_expires_at=expires, attempt_started_at=now, fencing_token=token,
                updated_at=now,
                # What an earlier attempt meant to write is not this attempt's: it is judged by its own export.
                sha256=None, location=None,
                **({} if contract_id is None else {"contract_id": contract_id}),
            ),
        )  # fmt: skip
        if not moved:  # the row is locked: only a bug gets here
            raise InvalidTransition(f"{record.logical_key} changed under its own row lock while it was claimed")
        return Claim(
            record.logical_key, attempt_id, token, record.window, now, expires, record.state, record.tz_database,
            **_revision_fields(request, supersedes),
        )  # fmt: skip

    def _collision(self, keys: Sequence[LogicalKey]) -> LedgerError:
        """Why first claims kept colliding: a key's string belongs to a row of another business day."""
        queries = self.ledger.queries
        for key in keys:
            holder = queries.get(str(key))
            if holder is not None and queries.find(key) is None:
                return LedgerError(
                    f"logical key {key} already belongs to {holder.export}/{holder.tenant} on {holder.business_date} "
                    f"({holder.timezone}); refusing to claim it for {key.window.business_date}"
                )
        return LedgerError(f"could not claim {len(keys)} key(s): the rows kept changing under concurrent claims")

    def renew_many(self, claims: Sequence[Claim]) -> list[Claim | FencedOut]:
        """Extends the leases of claims still held (a group whose sources take long to read), from the ledger's now,
        in one transaction; a claim lost meanwhile gets its :class:`FencedOut` (nothing is recorded for it: the party
        that took the key owns it)."""
        ledger = self.ledger
        renewed: list[Claim | FencedOut] = []
        with ledger.atomic() as conn:
            now = ledger.now(conn)
            expires = now + ledger.lease_ttl
            for claim in claims:
                moved = T.apply(
                    conn, T.RENEW, claim.logical_key, token=claim.fencing_token, owner=claim.attempt_id,
                    values=dict(lease_expires_at=expires, updated_at=now),
                )  # fmt: skip
                renewed.append(
                    replace(claim, lease_expires_at=expires)
                    if moved
                    else FencedOut(
                        f"attempt {claim.attempt_id} lost its lease on {claim.logical_key} before renewing it"
                    )
                )
        return renewed

    # -- holds -------------------------------------------------------------------------------------------------

    def hold_many(self, records: Sequence[ExportRecord], holder: str) -> list[Claim | None]:
        """Reconciliation's hold on stuck keys (``remote_unknown``, or ``in_progress`` whose lease has ended), each
        guarded by the state and token read: a key an attempt changed meanwhile gets None. One transaction."""
        ledger = self.ledger
        held: list[Claim | None] = []
        attempts: list[dict] = []
        with ledger.atomic() as conn:
            now = ledger.now(conn)
            requests = ledger.restatements.open_in(conn, [r.logical_key for r in records])
            supersedes = ledger.restatements.current_in(conn, list(requests))
            decisions = [select_hold(record, now, operator=False) for record in records]
            moves = [
                self._hold_move(record, decision, holder, now) if isinstance(decision, T.Transition) else None
                for record, decision in zip(records, decisions, strict=True)
            ]
            # One statement per state held from on PostgreSQL, after one that locks the keys in key order.
            moved = T.apply_many(conn, [move for move in moves if move is not None], now=now)
            for record, move in zip(records, moves, strict=True):
                if move is None or move.logical_key not in moved:
                    held.append(None)
                    continue
                if record.state is ExportState.IN_PROGRESS:
                    attempts.append(abandoned_values(record, now))
                held.append(self._claim_of_hold(record, move, now, requests, supersedes))
            if attempts:
                conn.execute(INSERT_ATTEMPT, attempts)
        return held

    def hold(self, logical_key: str, operator: str) -> Claim:
        """Takes a key for an operator who is about to resolve it (``export-ledger resolve``, ``restate --withdraw``).

        Allowed from ``conflict``, ``failed``, ``remote_unknown`` and ``in_progress`` whose lease has ended (the
        holder is recorded ``abandoned``); refused while a live lease holds the key. The token is incremented, so no
        party that held the key before can commit or change the destination once it is fenced.

        Raises:
            LiveLease: a live lease holds the key; the message names it and when it ends.
            InvalidTransition: the key is ``completed`` or unknown.
        """
        ledger = self.ledger
        with ledger.atomic() as conn:
            now = ledger.now(conn)
            row = conn.execute(RUN_BY_KEY_LOCKED, {"k_key": logical_key}).first()
            if row is None:
                raise InvalidTransition(f"unknown logical key {logical_key!r}: the ledger has no export with it")
            record = ExportRecord.from_row(row)
            decision = select_hold(record, now, operator=True)
            if isinstance(decision, LedgerError):
                raise decision
            requests = ledger.restatements.open_in(conn, [logical_key])
            claim = self._hold_in(
                conn, record, decision, operator, now, requests, ledger.restatements.current_in(conn, list(requests))
            )
            if claim is None:
                raise InvalidTransition(f"{logical_key} changed while an operator was taking it; look again")
            if record.state is ExportState.IN_PROGRESS:
                conn.execute(INSERT_ATTEMPT, abandoned_values(record, now))
        return claim

    def _hold_in(
        self,
        conn: Connection,
        record: ExportRecord,
        transition: T.Transition,
        holder: str,
        now: dt.datetime,
        requests: Mapping[str, Restatement],
        supersedes: Mapping[str, tuple[int, str]],
    ) -> Claim | None:
        move = self._hold_move(record, transition, holder, now)
        if not T.apply(conn, transition, move.logical_key, token=move.token, values=move.values, states=move.states,
                       now=now):  # fmt: skip
            return None
        return self._claim_of_hold(record, move, now, requests, supersedes)

    def _hold_move(self, record: ExportRecord, transition: T.Transition, holder: str, now: dt.datetime) -> T.Move:
        """A hold on ``record``, guarded by the state and token read. A hold leaves updated_at alone: it is the key's
        "stuck since", and a holder that crashes or gives the key back unchanged must not restart the clock that
        escalates it."""
        values = dict(
            lease_owner=holder, lease_expires_at=now + self.ledger.lease_ttl, attempt_started_at=now,
            fencing_token=record.fencing_token + 1,
        )  # fmt: skip
        return T.Move(transition, record.logical_key, record.fencing_token, values, states=(record.state,))

    @staticmethod
    def _claim_of_hold(
        record: ExportRecord,
        move: T.Move,
        now: dt.datetime,
        requests: Mapping[str, Restatement],
        supersedes: Mapping[str, tuple[int, str]],
    ) -> Claim:
        values = move.values
        return Claim(
            record.logical_key, values["lease_owner"], values["fencing_token"], record.window, now,
            values["lease_expires_at"], record.state, record.tz_database,
            **_revision_fields(requests.get(record.logical_key), supersedes), previous_updated_at=record.updated_at,
        )  # fmt: skip


def _revision_fields(request: Restatement | None, supersedes: Mapping[str, tuple[int, str]]) -> dict:
    """A claim's revision fields: none for a first export (revision 1), else the revision the open request publishes
    and the key's current recorded revision, which it supersedes."""
    if request is None:
        return {}
    current = supersedes.get(request.logical_key)
    if current is None:
        raise InvalidTransition(
            f"{request.logical_key}: its restatement to revision {request.revision} has no recorded revision to "
            "supersede in export_revisions"
        )
    return dict(revision=request.revision, supersedes=current)


_FOUND = sa.select(*RUN_COLUMNS, export_runs.c.claim_count, export_runs.c.contract_id)
#: One key's row by its business day, locked (a claim of one key: equality, nothing to expand).
_FIND_ONE = _FOUND.where(
    export_runs.c.export == sa.bindparam("f_export"),
    export_runs.c.tenant == sa.bindparam("f_tenant"),
    export_runs.c.timezone == sa.bindparam("f_timezone"),
    export_runs.c.business_date == sa.bindparam("f_date"),
).with_for_update()
#: A group's rows, locked in logical key order. Built once: a claim is on every run's hot path, and SQLAlchemy
#: building and keying a fresh statement cost more than the database's own work (benchmarks, ledger throughput).
_FIND_MANY = (
    _FOUND.where(
        export_runs.c.export.in_(sa.bindparam("f_exports", expanding=True)),
        export_runs.c.tenant.in_(sa.bindparam("f_tenants", expanding=True)),
        export_runs.c.timezone.in_(sa.bindparam("f_timezones", expanding=True)),
        export_runs.c.business_date.in_(sa.bindparam("f_dates", expanding=True)),
    )
    .order_by(export_runs.c.logical_key)
    .with_for_update()
)


def _facts_statement(*, missed: bool, clock: bool) -> sa.Select | None:
    columns = []
    if missed:
        open_missed = sa.exists().where(
            export_missed_partitions.c.closed_at.is_(None),
            export_missed_partitions.c.export == sa.bindparam("w_export"),
        )  # the open rows' partial unique index answers it
        columns.append(open_missed.label("missed_open"))
    if clock:
        columns.append(sa.func.now().label("now"))
    return sa.select(*columns) if columns else None


#: What a claim group reads of each of its exports before it decides, built once per shape: whether any of its
#: partitions is open as missed (schema 6 on), and on PostgreSQL the ledger's clock. Not the retention low-water mark:
#: that is read after the rows are locked (a prune deleting a key's row commits its mark before the lock is granted).
_FACTS = {
    (missed, clock): _facts_statement(missed=missed, clock=clock) for missed in (False, True) for clock in (False, True)
}


def _claim_facts(ledger, conn: Connection, exports: Sequence[str]) -> tuple[dt.datetime, bool]:
    """The ledger's clock, and whether a partition of any of ``exports`` is open as missed.

    One statement per export (a run's group is of one export), read at the start of the claim's transaction. Before,
    these were two round trips on PostgreSQL (``now()`` and an UPDATE closing missed partitions on every claim, which
    almost always matched nothing): the UPDATE now runs only when a partition is open.
    """
    missed, clock = ledger.supports(6), ledger.clock_in_database(conn)
    now = None if clock else ledger.now(conn)
    missed_open = False
    statement = _FACTS[(missed, clock)]
    if statement is None:
        return now, missed_open
    for export in exports:
        row = conn.execute(statement, {"w_export": export}).one()
        missed_open = missed_open or (missed and bool(row.missed_open))
        if now is None:
            now = database_time(row.now)
    return now, missed_open


def _find_many(conn: Connection, keys: Sequence[LogicalKey]) -> dict[tuple, sa.Row]:
    """The rows of ``keys``' business days, locked in logical key order (one statement for the group).

    The filter is the product of the keys' exports, tenants, zones and dates, so it may lock a few rows of other keys
    of the same days as well: they are released at the commit, moments later.
    """
    if len(keys) == 1:
        (key,) = keys
        parameters = dict(
            f_export=key.export, f_tenant=key.tenant, f_timezone=key.window.timezone, f_date=key.window.business_date
        )
        rows = conn.execute(_FIND_ONE, parameters)
    else:
        rows = conn.execute(
            _FIND_MANY,
            dict(
                f_exports=sorted({k.export for k in keys}),
                f_tenants=sorted({k.tenant for k in keys}),
                f_timezones=sorted({k.window.timezone for k in keys}),
                f_dates=sorted({k.window.business_date for k in keys}),
            ),
        )
    return {(row.export, row.tenant, row.timezone, row.business_date): row for row in rows}


def _may_carry_writes(decision, request: Restatement | None) -> bool:
    """Whether a claim taking ``decision`` carries a key whose earlier attempts may have written at its destination:
    a takeover (the holder's outcome is unknown), a restatement (the current revision is there) or a retry of a failed
    restatement. A retry of a failed first export does not: nothing of it was published anywhere."""
    return decision is T.TAKE_OVER or decision is T.RESTATE or (decision is T.CLAIM_RETRY and request is not None)


def _spans(keys: Sequence[LogicalKey]) -> dict[tuple[str, str], tuple[dt.date, dt.date]]:
    """The first and last business date each (export, tenant) of ``keys`` asks for."""
    spans: dict[tuple[str, str], tuple[dt.date, dt.date]] = {}
    for key in keys:
        day = key.window.business_date
        first, last = spans.get((key.export, key.tenant), (day, day))
        spans[(key.export, key.tenant)] = (min(first, day), max(last, day))
    return spans
