"""The ledger's side of restatements: requests to publish a new revision of a completed key, and the revisions table.

A restatement never overwrites. An operator (``export-ledger restate``, the Dagster launchpad) or the drift sensor
records a request first; the key stays ``completed`` with its current revision until its next claim, which takes it
back to ``in_progress`` through the ``restate`` transition (lease and fencing token as for any claim). The claim
publishes revision N + 1 beside revision N, moves the destination's current pointer, and its completion appends the
revision's row, closes the request and clears the key's drift record, all in the completion's transaction. Every other
state keeps its meaning: a restatement that fails before publishing leaves the key ``failed`` (its current revision
untouched, its reruns counted from the request), an unknown outcome leaves it ``remote_unknown`` for reconciliation.

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
from export_ledger.ledger.records import CompletionEvidence, ExportRecord, Restatement, Revision
from export_ledger.ledger.schema import (
    RUN_COLUMNS,
    ExportState,
    export_drift,
    export_operator_log,
    export_restatements,
    export_revisions,
    export_runs,
)
from export_ledger.ledger.store import schema_version

#: The first schema version with restatements and revisions.
REVISIONS_SCHEMA_VERSION = 5

_OPEN = export_restatements.c.closed_at.is_(None)
_INSERT_REVISION = export_revisions.insert()


class RestatementsMixin:
    """Requests, withdrawals and reads of restatements and revisions (mixed into ``ExportLedger``)."""

    # -- requests ----------------------------------------------------------------------------------------------

    def request_restatement(self, logical_key: str, *, reason: str, requested_by: str) -> Restatement:
        """Records a request to publish the next revision of a completed key; the key's next claim publishes it.

        Args:
            logical_key: A key of the ledger, ``completed``.
            reason: Why, in words: required, kept with the revision for good (at most 500 characters).
            requested_by: Who asks: an operator's name, or ``drift-sensor``.

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
        now = self.now()
        with self.atomic() as conn:
            row = conn.execute(
                sa.select(*RUN_COLUMNS).where(export_runs.c.logical_key == logical_key).with_for_update()
            ).first()
            if row is None:
                raise RestatementRefused(f"unknown logical key {logical_key!r}: the ledger has no export with it")
            record = ExportRecord.from_row(row)
            pending = self._open_requests(conn, [logical_key]).get(logical_key)
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
            current = self._current_in(conn, record)
            if current.revision == 1 and not self._has_revision_rows(conn, logical_key):
                conn.execute(_INSERT_REVISION, _revision_values(current))  # the history starts whole
            values = dict(
                logical_key=logical_key, export=record.export, tenant=record.tenant,
                business_date=record.business_date, revision=current.revision + 1, reason=reason,
                requested_by=requested_by[:300], requested_at=now, base_token=record.fencing_token,
            )  # fmt: skip
            new_id = conn.execute(export_restatements.insert().values(**values)).inserted_primary_key[0]
        return Restatement(id=new_id, closed_at=None, outcome=None, **values)

    def withdraw_restatement(self, logical_key: str, *, operator: str, reason: str) -> ExportRecord:
        """Withdraws a key's open request: the way out of a restatement that keeps failing (or was asked by mistake).

        Allowed while the key is ``completed`` (the request was never picked up) or ``failed`` (the new revision was
        never published: the key is completed again with its current revision's evidence). Refused while an attempt
        holds the key or its outcome is unknown: reconciliation decides first.
        """
        reason = (reason or "").strip()
        if not reason:
            raise RestatementRefused(f"withdrawing the restatement of {logical_key} needs a reason")
        now = self.now()
        with self.atomic() as conn:
            row = conn.execute(
                sa.select(*RUN_COLUMNS).where(export_runs.c.logical_key == logical_key).with_for_update()
            ).first()
            request = self._open_requests(conn, [logical_key]).get(logical_key)
            if row is None or request is None:
                raise RestatementRefused(f"{logical_key} has no open restatement to withdraw")
            record = ExportRecord.from_row(row)
            if record.state is ExportState.FAILED:
                current = self._revision_rows(conn, logical_key)[-1]
                moved = T.apply(
                    conn, T.WITHDRAW_RESTATEMENT, logical_key, token=record.fencing_token,
                    values=dict(
                        location=current.location, sha256=current.sha256, row_count=current.row_count,
                        committed_attempt=current.published_by, lease_owner=None, lease_expires_at=None,
                        updated_at=now,
                    ),
                )  # fmt: skip
                if not moved:
                    raise InvalidTransition(f"{logical_key} changed while its restatement was being withdrawn")
            elif record.state is not ExportState.COMPLETED:
                raise RestatementRefused(
                    f"{logical_key} is {record.state.value}: its restatement is under way; withdraw it once it has "
                    "failed (reconciliation decides an unknown outcome first)"
                )
            self._close_request(conn, request.id, now, "withdrawn")
            conn.execute(
                export_operator_log.insert().values(
                    recorded_at=now, operator=operator[:200], action="withdraw-restatement", export=record.export,
                    logical_key=logical_key, detail=f"revision {request.revision} withdrawn ({request.reason})"[:1000],
                    reason=reason[:MESSAGE_LIMIT],
                )
            )  # fmt: skip
            return ExportRecord.from_row(conn.execute(sa.select(*RUN_COLUMNS).where(
                export_runs.c.logical_key == logical_key)).one())  # fmt: skip

    # -- reads -------------------------------------------------------------------------------------------------

    def restatements(
        self, *, export: str | None = None, logical_keys: Sequence[str] = (), open_only: bool = True
    ) -> list[Restatement]:
        """Restatement requests (open ones by default), in key order."""
        query = sa.select(export_restatements)
        if export is not None:
            query = query.where(export_restatements.c.export == export)
        if logical_keys:
            query = query.where(export_restatements.c.logical_key.in_(list(logical_keys)))
        if open_only:
            query = query.where(_OPEN)
        query = query.order_by(export_restatements.c.logical_key, export_restatements.c.id)
        with self.atomic(read_only=True) as conn:
            if not self._has_revisions(conn):
                return []
            return [Restatement.from_row(row) for row in conn.execute(query)]

    def open_restatements(self, logical_keys: Sequence[str]) -> dict[str, Restatement]:
        """The open request of each of ``logical_keys`` that has one."""
        if not logical_keys:
            return {}
        with self.atomic(read_only=True) as conn:
            if not self._has_revisions(conn):
                return {}
            return self._open_requests(conn, logical_keys)

    def revisions(self, logical_key: str) -> list[Revision]:
        """Every published revision of a key, oldest first (revision 1 alone for a completed key never restated;
        nothing for a key never completed)."""
        with self.atomic(read_only=True) as conn:
            rows = self._revision_rows(conn, logical_key) if self._has_revisions(conn) else []
            if rows:
                return rows
            row = conn.execute(sa.select(*RUN_COLUMNS).where(export_runs.c.logical_key == logical_key)).first()
        record = ExportRecord.from_row(row) if row is not None else None
        return [Revision.first(record)] if record is not None and record.state is ExportState.COMPLETED else []

    def current_revision(self, logical_key: str) -> Revision | None:
        """The key's current revision: what readers get (None: the key has never completed)."""
        revisions = self.revisions(logical_key)
        return revisions[-1] if revisions else None

    # -- inside the ledger's transactions ----------------------------------------------------------------------

    def _has_revisions(self, conn: Connection) -> bool:
        # Opening a ledger to write upgrades it first, so only a ledger opened for reading can be older.
        if not self.read_only:
            return True
        return schema_version(conn) >= REVISIONS_SCHEMA_VERSION

    def _open_requests(self, conn: Connection, logical_keys: Sequence[str]) -> dict[str, Restatement]:
        query = sa.select(export_restatements).where(export_restatements.c.logical_key.in_(list(logical_keys)), _OPEN)
        return {row.logical_key: Restatement.from_row(row) for row in conn.execute(query)}

    def _restating(self, conn: Connection, request: Restatement | None) -> dict:
        """A claim's revision fields: none for a first export (revision 1), else the revision the open request
        publishes and the one it supersedes."""
        if request is None:
            return {}
        return dict(revision=request.revision, supersedes=self._supersedes(conn, request))

    def _supersedes(self, conn: Connection, request: Restatement) -> tuple[int, str]:
        """The revision a request supersedes and its sha256 (its row was written at the latest at the request)."""
        sha256 = conn.execute(
            sa.select(export_revisions.c.sha256).where(
                export_revisions.c.logical_key == request.logical_key,
                export_revisions.c.revision == request.revision - 1,
            )
        ).scalar()
        if sha256 is None:
            raise InvalidTransition(
                f"{request.logical_key}: revision {request.revision - 1}, which revision {request.revision} "
                "supersedes, has no row in export_revisions"
            )
        return request.revision - 1, sha256

    def _has_revision_rows(self, conn: Connection, logical_key: str) -> bool:
        query = sa.select(export_revisions.c.id).where(export_revisions.c.logical_key == logical_key).limit(1)
        return conn.execute(query).first() is not None

    def _revision_rows(self, conn: Connection, logical_key: str) -> list[Revision]:
        query = (
            sa.select(export_revisions)
            .where(export_revisions.c.logical_key == logical_key)
            .order_by(export_revisions.c.revision)
        )
        return [Revision.from_row(row) for row in conn.execute(query)]

    def _current_in(self, conn: Connection, record: ExportRecord) -> Revision:
        rows = self._revision_rows(conn, record.logical_key)
        return rows[-1] if rows else Revision.first(record)

    def _record_revision(
        self, conn: Connection, logical_key: str, evidence: CompletionEvidence, now: dt.datetime
    ) -> None:
        """After a restatement's completion matched (same transaction): its revision row, the request closed, the
        key's drift record cleared (the new revision was read from the source as it is now)."""
        request = self._open_requests(conn, [logical_key]).get(logical_key)
        if request is None:
            raise InvalidTransition(f"{logical_key} completed a restatement that has no open request")
        if evidence.revision != request.revision:
            raise InvalidTransition(
                f"{logical_key}: the evidence is revision {evidence.revision}, but the open restatement publishes "
                f"revision {request.revision}; nothing recorded"
            )
        supersedes_revision, supersedes_sha256 = self._supersedes(conn, request)
        conn.execute(
            _INSERT_REVISION,
            dict(
                logical_key=logical_key, revision=request.revision, location=evidence.location,
                sha256=evidence.sha256, row_count=evidence.row_count, supersedes_revision=supersedes_revision,
                supersedes_sha256=supersedes_sha256, reason=request.reason, requested_by=request.requested_by,
                requested_at=request.requested_at, published_by=evidence.attempt_id, recorded_at=now,
            ),
        )  # fmt: skip
        self._close_request(conn, request.id, now, "published")
        conn.execute(
            export_drift.update()
            .where(export_drift.c.logical_key == logical_key, export_drift.c.cleared_at.is_(None))
            .values(cleared_at=now)
        )

    @staticmethod
    def _close_request(conn: Connection, request_id: int, now: dt.datetime, outcome: str) -> None:
        conn.execute(
            export_restatements.update()
            .where(export_restatements.c.id == request_id, _OPEN)
            .values(closed_at=now, outcome=outcome)
        )


def _revision_values(revision: Revision) -> dict:
    return {name: getattr(revision, name) for name in Revision.__dataclass_fields__}
