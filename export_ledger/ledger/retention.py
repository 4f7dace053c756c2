"""Retention: prune old completion records and keep a durable low-water mark per export.

The mark closes business dates to new claims (a pruned record would otherwise look like "never attempted"), so it
must never close a date whose export is not done: it stops at the first business date that still has a key not
``completed``, and at the first date with no key at all (never exported, such as tonight's) unless an operator closes
those explicitly, with a reason that is recorded. :meth:`prune_plan` says what :meth:`prune` would do.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger.schema import (
    ExportState,
    export_attempts,
    export_contracts,
    export_drift,
    export_low_water,
    export_operator_log,
    export_restatements,
    export_revisions,
    export_runs,
)


@dataclass(frozen=True)
class PrunePlan:
    """What pruning one export does (or did).

    Attributes:
        export: The export.
        horizon: Business dates before it were asked to be pruned (today minus the days given).
        mark: The low-water mark afterwards: dates before it are closed to new claims.
        previous_mark: The mark before (None: never pruned).
        pruned: Completed records deleted (with their attempts): those dated before ``mark``.
        blocked_by: The first date before the horizon with a key not completed: the mark stops there.
        unexported: Dates before the mark, or before the horizon when they stopped it, with no key at all.
        closes_unexported: The operator closed ``unexported`` dates explicitly.
    """

    export: str
    horizon: dt.date
    mark: dt.date | None
    previous_mark: dt.date | None
    pruned: int
    blocked_by: dt.date | None = None
    unexported: list[dt.date] = field(default_factory=list)
    closes_unexported: bool = False


class RetentionMixin:
    """The ledger's retention methods (mixed into :class:`~export_ledger.ledger.ExportLedger`)."""

    def low_water(self, export: str) -> dt.date | None:
        with self.atomic(read_only=True) as conn:
            return self._low_water(conn, export)

    def _low_water(self, conn: Connection, export: str) -> dt.date | None:
        return conn.execute(
            sa.select(export_low_water.c.low_water_date).where(export_low_water.c.export == export)
        ).scalar()

    def prune_plan(
        self, older_than_days: int, *, export: str | None = None, close_unexported: bool = False
    ) -> list[PrunePlan]:
        """What :meth:`prune` would do, changing nothing."""
        with self.atomic(read_only=True) as conn:
            return [self._plan(conn, name, older_than_days, close_unexported) for name in self._names(conn, export)]

    def prune(
        self,
        older_than_days: int,
        *,
        export: str | None = None,
        close_unexported: bool = False,
        operator: str | None = None,
        reason: str | None = None,
    ) -> list[PrunePlan]:
        """Deletes ``completed`` records (and their attempts) dated before each export's new low-water mark, and
        raises the mark, as :meth:`prune_plan` describes.

        Other states are never pruned: a failed or stuck key keeps its history until it is resolved. After pruning,
        first claims below the mark are refused (see ``allow_below_low_water``).

        Args:
            older_than_days: Prune business dates more than this many days before today (UTC); 0 or more.
            export: Only this export.
            close_unexported: Let the mark close dates that have no key at all (they can then never be exported
                without an override). Needs ``operator`` and ``reason``; recorded in the operator log.
        """
        if close_unexported and not (operator and reason and reason.strip()):
            raise ValueError("closing dates that were never exported needs an operator and a reason")
        now = self.now()
        plans = []
        with self.atomic() as conn:
            for name in self._names(conn, export):
                plan = self._plan(conn, name, older_than_days, close_unexported)
                plans.append(plan)
                if plan.mark is None or plan.mark == plan.previous_mark:
                    continue
                doomed = sa.select(export_runs.c.logical_key).where(
                    export_runs.c.export == name,
                    export_runs.c.state == ExportState.COMPLETED.value,
                    export_runs.c.business_date < plan.mark,
                )
                conn.execute(export_attempts.delete().where(export_attempts.c.logical_key.in_(doomed)))
                # Their revisions go with them, as their attempts do (closed restatement requests are kept, like
                # drift records: who asked for what, and why).
                conn.execute(export_revisions.delete().where(export_revisions.c.logical_key.in_(doomed)))
                # A pruned key can no longer be stale: its open drift record is closed (drift records are kept).
                conn.execute(
                    export_drift.update()
                    .where(export_drift.c.logical_key.in_(doomed), export_drift.c.cleared_at.is_(None))
                    .values(cleared_at=now)
                )
                conn.execute(
                    export_runs.delete().where(
                        export_runs.c.export == name,
                        export_runs.c.state == ExportState.COMPLETED.value,
                        export_runs.c.business_date < plan.mark,
                    )
                )
                if plan.previous_mark is None:
                    conn.execute(
                        export_low_water.insert().values(
                            export=name, low_water_date=plan.mark, pruned_total=plan.pruned, updated_at=now
                        )
                    )
                else:
                    conn.execute(
                        export_low_water.update()
                        .where(export_low_water.c.export == name)
                        .values(
                            low_water_date=plan.mark,
                            pruned_total=export_low_water.c.pruned_total + plan.pruned,
                            updated_at=now,
                        )
                    )
                closed = [d for d in plan.unexported if d < plan.mark]
                if closed:
                    conn.execute(
                        export_operator_log.insert().values(
                            recorded_at=now, operator=operator[:200], action="prune-close-unexported", export=name,
                            logical_key=None,
                            detail=f"low-water mark {plan.mark} closes {len(closed)} date(s) never exported: "
                            + ", ".join(d.isoformat() for d in closed[:20]),
                            reason=reason.strip()[:500],
                        )
                    )  # fmt: skip
        return plans

    def _names(self, conn: Connection, export: str | None) -> list[str]:
        query = sa.select(export_runs.c.export).distinct()
        if export is not None:
            query = query.where(export_runs.c.export == export)
        return sorted(set(conn.execute(query).scalars()) | ({export} if export else set()))

    def _plan(self, conn: Connection, name: str, older_than_days: int, close_unexported: bool) -> PrunePlan:
        if older_than_days < 0:
            raise ValueError(f"older_than_days must be zero or more, got {older_than_days}")
        horizon = self.now().date() - dt.timedelta(days=older_than_days)
        previous = self._low_water(conn, name)
        runs = export_runs.c
        blocked_by = conn.execute(
            sa.select(sa.func.min(runs.business_date)).where(
                runs.export == name, runs.state != ExportState.COMPLETED.value, runs.business_date < horizon
            )
        ).scalar()
        # A completed key with an open restatement request is not done either: it stops the mark too.
        restating = None
        if self._has_revisions(conn):
            restating = conn.execute(
                sa.select(sa.func.min(export_restatements.c.business_date)).where(
                    export_restatements.c.export == name,
                    export_restatements.c.closed_at.is_(None),
                    export_restatements.c.business_date < horizon,
                )
            ).scalar()
        if restating is not None:
            blocked_by = restating if blocked_by is None else min(blocked_by, restating)
        candidate = min(horizon, blocked_by) if blocked_by is not None else horizon
        keyed = set(
            conn.execute(
                sa.select(runs.business_date).distinct().where(runs.export == name, runs.business_date < candidate)
            ).scalars()
        )
        first = self._first_date(conn, name, keyed, previous)
        unexported = []
        if first is not None:
            day = first
            while day < candidate:
                if day not in keyed:
                    unexported.append(day)
                day += dt.timedelta(days=1)
        mark = candidate if close_unexported or not unexported else unexported[0]
        if previous is not None:
            mark = max(previous, mark)  # the mark never goes down: what was closed stays closed
        pruned = conn.execute(
            sa.select(sa.func.count()).where(
                runs.export == name, runs.state == ExportState.COMPLETED.value, runs.business_date < mark
            )
        ).scalar()
        return PrunePlan(name, horizon, mark, previous, int(pruned), blocked_by, unexported, close_unexported)

    def _first_date(self, conn: Connection, name: str, keyed: set[dt.date], previous: dt.date | None) -> dt.date | None:
        """Where "never exported" starts counting: the previous mark, else the calendar's start date as recorded in
        the export's contract, else its first key."""
        if previous is not None:
            return previous
        contract = conn.execute(
            sa.select(export_contracts.c.contract)
            .where(export_contracts.c.export == name)
            .order_by(export_contracts.c.id.desc())
            .limit(1)
        ).scalar()
        if contract is not None:
            start = json.loads(contract).get("start_date")
            if start:
                return dt.date.fromisoformat(start)
        return min(keyed) if keyed else None
