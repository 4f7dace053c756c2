"""Retention: prune old completion records and keep a durable low-water mark per export."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger.schema import ExportState, export_attempts, export_low_water, export_runs


class RetentionMixin:
    """The ledger's retention methods (mixed into :class:`~export_ledger.ledger.ExportLedger`)."""

    def low_water(self, export: str) -> dt.date | None:
        with self.atomic(read_only=True) as conn:
            return self._low_water(conn, export)

    def _low_water(self, conn: Connection, export: str) -> dt.date | None:
        return conn.execute(
            sa.select(export_low_water.c.low_water_date).where(export_low_water.c.export == export)
        ).scalar()

    def prune(self, older_than_days: int, *, export: str | None = None) -> dict[str, int]:
        """Deletes ``completed`` records (and their attempts) whose business date is more than ``older_than_days``
        days before today (UTC), and raises each export's durable low-water mark to that horizon.

        Other states are never pruned: a failed or stuck key keeps its history until it is resolved. After pruning,
        first claims below the mark are refused (see ``allow_below_low_water``). Returns rows deleted per export.
        """
        if older_than_days < 0:
            raise ValueError(f"older_than_days must be zero or more, got {older_than_days}")
        now = self.now()
        horizon = now.date() - dt.timedelta(days=older_than_days)
        deleted: dict[str, int] = {}
        with self.atomic() as conn:
            exports_query = sa.select(export_runs.c.export).distinct()
            if export is not None:
                exports_query = exports_query.where(export_runs.c.export == export)
            names = sorted(set(conn.execute(exports_query).scalars()) | ({export} if export else set()))
            for name in names:
                doomed = sa.select(export_runs.c.logical_key).where(
                    export_runs.c.export == name,
                    export_runs.c.state == ExportState.COMPLETED.value,
                    export_runs.c.business_date < horizon,
                )
                conn.execute(export_attempts.delete().where(export_attempts.c.logical_key.in_(doomed)))
                count = conn.execute(
                    export_runs.delete().where(
                        export_runs.c.export == name,
                        export_runs.c.state == ExportState.COMPLETED.value,
                        export_runs.c.business_date < horizon,
                    )
                ).rowcount
                deleted[name] = count
                mark = self._low_water(conn, name)
                if mark is None:
                    conn.execute(
                        export_low_water.insert().values(
                            export=name, low_water_date=horizon, pruned_total=count, updated_at=now
                        )
                    )
                else:
                    conn.execute(
                        export_low_water.update()
                        .where(export_low_water.c.export == name)
                        .values(
                            low_water_date=max(mark, horizon),
                            pruned_total=export_low_water.c.pruned_total + count,
                            updated_at=now,
                        )
                    )
        return deleted
