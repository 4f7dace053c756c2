"""The operator log: one append-only row per operator decision (``export_operator_log``): who, what, why."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger.errors import MESSAGE_LIMIT
from export_ledger.ledger.schema import export_operator_log


class OperatorLog:
    """Operators' decisions of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def append(
        self,
        operator: str,
        action: str,
        detail: str,
        reason: str,
        *,
        export: str | None = None,
        logical_key: str | None = None,
    ) -> None:
        """Appends one decision, in its own transaction."""
        with self.ledger.atomic() as conn:
            append_in(conn, self.ledger.now(conn), operator, action, detail, reason, export, logical_key)

    def entries(self, *, limit: int | None = None) -> list[dict]:
        """The decisions, oldest first (the last ``limit`` of them when given)."""
        query = sa.select(export_operator_log)
        if limit is not None:
            newest = query.order_by(export_operator_log.c.id.desc()).limit(limit).subquery()
            query = sa.select(newest).order_by(newest.c.id)
        else:
            query = query.order_by(export_operator_log.c.id)
        with self.ledger.atomic(read_only=True) as conn:
            return [dict(row._mapping) for row in conn.execute(query)]


def append_in(
    conn: Connection,
    now: dt.datetime,
    operator: str,
    action: str,
    detail: str,
    reason: str,
    export: str | None = None,
    logical_key: str | None = None,
) -> None:
    """Appends one decision inside ``conn``'s transaction (with the change it explains)."""
    conn.execute(
        export_operator_log.insert().values(
            recorded_at=now, operator=(operator or "")[:200], action=action, export=export, logical_key=logical_key,
            detail=detail[:1000], reason=(reason or "").strip()[:MESSAGE_LIMIT],
        )
    )  # fmt: skip
