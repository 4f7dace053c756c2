"""The ledger's side of restatements: requests to publish a new revision of a completed key, and the revisions table.

A restatement never overwrites. An operator (``export-ledger restate``, the Dagster launchpad) or the drift sensor
records a request first; the key stays ``completed`` with its current revision until its next claim, which takes it
back to ``in_progress`` through the ``restate`` transition. The request's revision is one more than any revision the
key ever had *or was ever asked for*: a withdrawn request's number is never given again (a unique index holds it), so
a place left at the destination by a withdrawn or fenced attempt can never be taken for a later request's. The
completion appends the revision's row, closes the request and clears the key's drift record, all in the completion's
transaction (:meth:`Restatements.record_revision_in`). A restatement whose data is the current revision's publishes
nothing: the key is completed again at that revision and the request closed ``unchanged``
(:meth:`Restatements.close_unchanged_in`).

Everything here needs schema version 5: on an older ledger opened for reading, every key reads as revision 1 with no
request.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger import transitions as T
from export_ledger.ledger.errors import MESSAGE_LIMIT, InvalidTransition, RestatementRefused
from export_ledger.ledger.operators import append_in
from export_ledger.ledger.records import Claim, CompletionEvidence, ExportRecord, Restatement, Revision
from export_ledger.ledger.retention import lock_export_in
from export_ledger.ledger.rows import RUN_BY_KEY_LOCKED
from export_ledger.ledger.schema import ExportState, export_drift, export_restatements, export_revisions

#: The first schema version with restatements and revisions.
REVISIONS_SCHEMA_VERSION = 5

_OPEN = export_restatements.c.closed_at.is_(None)
#: The open requests of some keys: read by every claim that finds a row (built once: benchmarks, ledger throughput).
_OPEN_REQUESTS = sa.select(export_restatements).where(
    export_restatements.c.logical_key.in_(sa.bindparam("r_keys", expanding=True)), _OPEN
)
_INSERT_REVISION = export_revisions.insert()


class Restatements:
    """Requests, withdrawals and reads of restatements and revisions of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    # -- requests ----------------------------------------------------------------------------------------------

    def request(self, logical_key: str, *, reason: str, requested_by: str) -> Restatement:
        """Records a request to publish the next revision of a completed key; the key's next claim publishes it.

        Args:
            logical_key: A key of the ledger, ``completed``.
            reason: Why, in words: required, kept with the revision for good (at most 500 characters).
            requested_by: Who asks: an operator's name, a run's id, or ``drift-sensor``.

        Raises:
            RestatementRefused: no reason; the key is unknown, not completed, or already has an open request.
        """
        reason = (reason or "").strip()
        if not reason:
            raise RestatementRefused(f'a restatement of {logical_key} needs a reason (--reason "...")')
        if len(reason) > MESSAGE_LIMIT:
            raise RestatementRefused(f"the reason is {len(reason)} characters; at most {MESSAGE_LIMIT} are kept")
        requested_by = (requested_by or "").strip()
        if not requested_by:
            raise RestatementRefused("a restatement names who asked for it")
        ledger = self.ledger
        with ledger.atomic() as conn:
            # Shared with other requests, exclusive to a prune: the key and the mark below are read as a prune left
            # them, and no prune deletes this key before the request commits (issue #26).
            lock_export_in(conn, logical_key.partition("/")[0], shared=True)
            return self.request_in(conn, ledger.now(conn), logical_key, reason=reason, requested_by=requested_by)

    def request_in(
        self, conn: Connection, now: dt.datetime, logical_key: str, *, reason: str, requested_by: str
    ) -> Restatement:
        """:meth:`request` inside ``conn``'s transaction, which holds the export's retention lock (shared, at least:
        :func:`~export_ledger.ledger.retention.lock_export_in`), with a reason and requester already checked."""
        ledger = self.ledger
        row = conn.execute(RUN_BY_KEY_LOCKED, {"k_key": logical_key}).first()
        closed = ledger.retention.closed_refusal(
            conn, logical_key, None if row is None else row.business_date, "a restatement"
        )
        if closed is not None:
            raise RestatementRefused(closed)
        if row is None:
            raise RestatementRefused(f"unknown logical key {logical_key!r}: the ledger has no export with it")
        record = ExportRecord.from_row(row)
        pending = self.open_in(conn, [logical_key]).get(logical_key)
        if pending is not None:
            raise RestatementRefused(
                f"{logical_key} already has an open restatement (revision {pending.revision}, requested by "
                f"{pending.requested_by} at {pending.requested_at.isoformat()}: {pending.reason!r}); it is "
                "published by the partition's next materialization, or withdrawn with "
                f"`export-ledger restate --withdraw {logical_key} --reason ...`"
            )
        if record.state is not ExportState.COMPLETED:
            raise RestatementRefused(
                f"{logical_key} is {record.state.value}: only a completed key is restated (a key that is not "
                "completed gets its first export by a rerun)"
            )
        moved = ledger.contracts.moved_key_in(conn, record)
        if moved is not None:
            was, now_at = moved
            raise RestatementRefused(
                f"{logical_key} was exported to {was['kind']} {was['root']}, where its revisions stay (the export "
                f"moved to {now_at['kind']} {now_at['root']} and kept its exported keys): a restatement would "
                "publish its next revision at the new destination, beside nothing. Refused"
            )
        rows = self._revision_rows(conn, logical_key)
        if not rows:
            conn.execute(_INSERT_REVISION, _revision_values(Revision.first(record)))  # the history starts whole
        current = rows[-1].revision if rows else 1
        asked = conn.execute(
            sa.select(sa.func.max(export_restatements.c.revision)).where(
                export_restatements.c.logical_key == logical_key
            )
        ).scalar()
        values = dict(
            logical_key=logical_key, export=record.export, tenant=record.tenant,
            business_date=record.business_date, revision=max(current, asked or 0) + 1, reason=reason,
            requested_by=requested_by[:300], requested_at=now, base_token=record.fencing_token,
        )  # fmt: skip
        new_id = conn.execute(export_restatements.insert().values(**values)).inserted_primary_key[0]
        return Restatement(id=new_id, closed_at=None, outcome=None, **values)

    def withdraw_unclaimed(self, logical_key: str, *, operator: str, reason: str) -> ExportRecord:
        """Withdraws the open request of a key that is still ``completed`` (never claimed for it: nothing of it can be
        at the destination). A key whose restatement failed is withdrawn through
        :func:`export_ledger.restate.withdraw`, which looks at the destination first.

        Raises:
            RestatementRefused: no reason, no open request, or the key is not ``completed`` (the message says what to
                run instead).
        """
        reason = (reason or "").strip()
        if not reason:
            raise RestatementRefused(f"withdrawing the restatement of {logical_key} needs a reason")
        ledger = self.ledger
        with ledger.atomic() as conn:
            now = ledger.now(conn)
            row = conn.execute(RUN_BY_KEY_LOCKED, {"k_key": logical_key}).first()
            request = self.open_in(conn, [logical_key]).get(logical_key)
            if row is None or request is None:
                raise RestatementRefused(f"{logical_key} has no open restatement to withdraw")
            record = ExportRecord.from_row(row)
            if record.state is not ExportState.COMPLETED:
                raise RestatementRefused(
                    f"{logical_key} is {record.state.value}: its restatement was claimed, so the destination is looked "
                    "at before it is withdrawn"
                )
            T.close(conn, T.WITHDRAW_REQUEST, request.id, now)
            append_in(
                conn, now, operator, "withdraw-restatement", withdrawn_detail(request), reason,
                export=record.export, logical_key=logical_key,
            )  # fmt: skip
        return record

    # -- reads -------------------------------------------------------------------------------------------------

    def requests(
        self,
        *,
        export: str | None = None,
        exports: Sequence[str] = (),
        tenants: Sequence[str] = (),
        logical_keys: Sequence[str] = (),
        open_only: bool = True,
        limit: int | None = None,
        after: str | None = None,
        date_from: dt.date | None = None,
        date_to: dt.date | None = None,
        outcomes: Sequence[str] = (),
    ) -> list[Restatement]:
        """Restatement requests (open ones by default), in key order; ``limit`` and ``after`` (a logical key) page,
        ``date_from`` and ``date_to`` bound the business dates, ``outcomes`` keeps closed requests of those outcomes
        (``published``, ``withdrawn``, ``unchanged``; implies ``open_only=False``)."""
        query = sa.select(export_restatements)
        if outcomes:
            open_only = False
            query = query.where(export_restatements.c.outcome.in_(list(outcomes)))
        if date_from is not None:
            query = query.where(export_restatements.c.business_date >= date_from)
        if date_to is not None:
            query = query.where(export_restatements.c.business_date <= date_to)
        if export is not None:
            query = query.where(export_restatements.c.export == export)
        if exports:
            query = query.where(export_restatements.c.export.in_(list(exports)))
        if tenants:
            query = query.where(export_restatements.c.tenant.in_(list(tenants)))
        if logical_keys:
            query = query.where(export_restatements.c.logical_key.in_(list(logical_keys)))
        if open_only:
            query = query.where(_OPEN)
        if after is not None:
            query = query.where(export_restatements.c.logical_key > after)
        query = query.order_by(export_restatements.c.logical_key, export_restatements.c.id)
        if limit is not None:
            query = query.limit(limit)
        with self.ledger.atomic(read_only=True) as conn:
            if not self.ledger.supports(REVISIONS_SCHEMA_VERSION):
                return []
            return [Restatement.from_row(row) for row in conn.execute(query)]

    def open_requests(self, logical_keys: Sequence[str]) -> dict[str, Restatement]:
        """The open request of each of ``logical_keys`` that has one."""
        if not logical_keys or not self.ledger.supports(REVISIONS_SCHEMA_VERSION):
            return {}
        with self.ledger.atomic(read_only=True) as conn:
            return self.open_in(conn, logical_keys)

    def revisions(self, logical_key: str) -> list[Revision]:
        """Every published revision of a key, oldest first (revision 1 alone for a completed key never restated;
        nothing for a key never completed)."""
        ledger = self.ledger
        with ledger.atomic(read_only=True) as conn:
            rows = self._revision_rows(conn, logical_key) if ledger.supports(REVISIONS_SCHEMA_VERSION) else []
        if rows:
            return rows
        record = ledger.queries.get(logical_key)
        return [Revision.first(record)] if record is not None and record.state is ExportState.COMPLETED else []

    def current_revisions_of(self, records: Sequence[ExportRecord]) -> dict[str, Revision]:
        """:meth:`current_revision` of each completed record's key, in one read per 500 keys."""
        completed = [r for r in records if r.state is ExportState.COMPLETED]
        newest: dict[str, Revision] = {}
        if completed and self.ledger.supports(REVISIONS_SCHEMA_VERSION):
            keys = [r.logical_key for r in completed]
            with self.ledger.atomic(read_only=True) as conn:
                for first in range(0, len(keys), 500):
                    query = (
                        sa.select(export_revisions)
                        .where(export_revisions.c.logical_key.in_(keys[first : first + 500]))
                        .order_by(export_revisions.c.logical_key, export_revisions.c.revision)
                    )
                    newest.update((row.logical_key, Revision.from_row(row)) for row in conn.execute(query))
        for record in completed:
            newest.setdefault(record.logical_key, Revision.first(record))
        return newest

    def current_revision(self, logical_key: str) -> Revision | None:
        """The key's current recorded revision: what readers get (None: the key has never completed)."""
        revisions = self.revisions(logical_key)
        return revisions[-1] if revisions else None

    # -- inside the ledger's transactions ----------------------------------------------------------------------

    def open_in(self, conn: Connection, logical_keys: Sequence[str]) -> dict[str, Restatement]:
        if not logical_keys:
            return {}
        rows = conn.execute(_OPEN_REQUESTS, {"r_keys": list(logical_keys)})
        return {row.logical_key: Restatement.from_row(row) for row in rows}

    def current_in(self, conn: Connection, logical_keys: Sequence[str]) -> dict[str, tuple[int, str]]:
        """Each key's newest recorded revision and its sha256, from ``export_revisions`` (a key with an open request
        always has its rows: the first request writes revision 1's)."""
        if not logical_keys:
            return {}
        newest = (
            sa.select(export_revisions.c.logical_key, sa.func.max(export_revisions.c.revision).label("revision"))
            .where(export_revisions.c.logical_key.in_(list(logical_keys)))
            .group_by(export_revisions.c.logical_key)
            .subquery()
        )
        query = sa.select(export_revisions.c.logical_key, export_revisions.c.revision, export_revisions.c.sha256).join(
            newest,
            sa.and_(
                newest.c.logical_key == export_revisions.c.logical_key, newest.c.revision == export_revisions.c.revision
            ),
        )
        return {key: (revision, sha256) for key, revision, sha256 in conn.execute(query)}

    def _revision_rows(self, conn: Connection, logical_key: str) -> list[Revision]:
        query = (
            sa.select(export_revisions)
            .where(export_revisions.c.logical_key == logical_key)
            .order_by(export_revisions.c.revision)
        )
        return [Revision.from_row(row) for row in conn.execute(query)]

    def record_revision_in(
        self, conn: Connection, claim: Claim, evidence: CompletionEvidence, now: dt.datetime
    ) -> None:
        """After a restatement's completion matched (same transaction): its revision row, the request closed, the
        key's drift record cleared (the new revision was read from the source as it is now)."""
        key = claim.logical_key
        request = self.open_in(conn, [key]).get(key)
        if request is None:
            raise InvalidTransition(f"{key} completed a restatement that has no open request")
        if evidence.revision != request.revision:
            raise InvalidTransition(
                f"{key}: the evidence is revision {evidence.revision}, but the open restatement publishes revision "
                f"{request.revision}; nothing recorded"
            )
        supersedes_revision, supersedes_sha256 = claim.supersedes
        conn.execute(
            _INSERT_REVISION,
            dict(
                logical_key=key, revision=request.revision, location=evidence.location, sha256=evidence.sha256,
                row_count=evidence.row_count, supersedes_revision=supersedes_revision,
                supersedes_sha256=supersedes_sha256, reason=request.reason, requested_by=request.requested_by,
                requested_at=request.requested_at, published_by=evidence.attempt_id, recorded_at=now,
            ),
        )  # fmt: skip
        T.close(conn, T.PUBLISH_REQUEST, request.id, now)
        self._clear_drift_in(conn, key, now)

    def close_unchanged_in(self, conn: Connection, claim: Claim, now: dt.datetime) -> None:
        """After a restatement found its data identical to the current revision (same transaction as the key's
        completion at that revision): the request closed ``unchanged``, no revision row (nothing was published; the
        request's number is never given again), the key's drift record cleared (the source was read now and matches
        what readers see)."""
        key = claim.logical_key
        request = self.open_in(conn, [key]).get(key)
        if request is None or request.revision != claim.revision:
            raise InvalidTransition(f"{key}: no open restatement of revision {claim.revision} to close unchanged")
        T.close(conn, T.UNCHANGED_REQUEST, request.id, now)
        self._clear_drift_in(conn, key, now)

    def _clear_drift_in(self, conn: Connection, logical_key: str, now: dt.datetime) -> None:
        drift = conn.execute(
            sa.select(export_drift.c.id).where(
                export_drift.c.logical_key == logical_key, export_drift.c.cleared_at.is_(None)
            )
        ).scalars()
        T.close_many(conn, T.CLEAR_DRIFT, list(drift), now)

    def withdraw_in(self, conn: Connection, logical_key: str, now: dt.datetime, operator: str, reason: str) -> None:
        """Closes the key's open request as withdrawn and logs the operator's decision (inside the transaction that
        completes the key again at its recorded revision)."""
        request = self.open_in(conn, [logical_key]).get(logical_key)
        if request is None:
            raise InvalidTransition(f"{logical_key} has no open restatement to withdraw")
        T.close(conn, T.WITHDRAW_REQUEST, request.id, now)
        append_in(
            conn, now, operator, "withdraw-restatement", withdrawn_detail(request), reason,
            export=logical_key.split("/", 1)[0], logical_key=logical_key,
        )  # fmt: skip


def withdrawn_detail(request: Restatement) -> str:
    return f"revision {request.revision} withdrawn ({request.reason})"[:1000]


def _revision_values(revision: Revision) -> dict:
    return {name: getattr(revision, name) for name in Revision.__dataclass_fields__}
