"""Counts for monitoring (the Prometheus collector of :mod:`export_ledger.metrics`), each one aggregate statement.

Each read is bounded by what it groups by (exports x states, exports x tenants), never by the keys the ledger holds,
and is counted by the database. Which keys need a person is :meth:`Attention.summary
<export_ledger.ledger.attention.Attention.summary>`'s to say, not this module's.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

from export_ledger.ledger.schema import ExportState, export_runs


class Tallies:
    """Aggregate reads of :class:`~export_ledger.ledger.ExportLedger` for dashboards and alerts."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def keys_by_state(self) -> dict[tuple[str, ExportState], int]:
        """How many keys each export has in each state (a state with no key is absent)."""
        runs = export_runs.c
        query = sa.select(runs.export, runs.state, sa.func.count().label("keys")).group_by(runs.export, runs.state)
        with self.ledger.atomic(read_only=True) as conn:
            return {(row.export, ExportState(row.state)): int(row.keys) for row in conn.execute(query)}

    def last_completed_windows(self) -> dict[tuple[str, str], dt.datetime]:
        """Per export and tenant, the end (UTC) of the latest window whose key is completed: how far the tenant's
        exports have got."""
        runs = export_runs.c
        query = (
            sa.select(runs.export, runs.tenant, sa.func.max(runs.window_end_utc).label("window_end"))
            .where(runs.state == sa.bindparam("completed", ExportState.COMPLETED.value))
            .group_by(runs.export, runs.tenant)
        )
        with self.ledger.atomic(read_only=True) as conn:
            return {(row.export, row.tenant): row.window_end for row in conn.execute(query)}
