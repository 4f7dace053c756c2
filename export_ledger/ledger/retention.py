"""Retention: prune old completion records and keep a durable low-water mark per export.

The mark closes business dates to new claims (a pruned record would otherwise look like "never attempted"), so it
must never close a date whose export is not done: it stops at the first business date that still has a key not
``completed`` (or an open restatement), and at the first date on which **any tenant expected then** has no key at
all (never exported, such as tonight's) unless an operator closes those explicitly, with a reason that is recorded.
A tenant is expected on a date from its calendar contract's start date on (every tenant the ledger holds a contract
or a key of). The horizon is a business date in the tenants' own zones: the earliest "today" among them, less the
days asked. :meth:`Retention.plan` says what :meth:`Retention.prune` would do.

A prune and a restatement request of the same export never interleave (issue #26): the prune holds the export's
retention lock from before it plans until it commits, and a request holds it shared from before it reads its key until
it commits, then refuses a key below the mark (:meth:`Retention.closed_refusal`). So either the request lands first
and the prune's plan sees it (the mark stops at its key), or the prune lands first and the request is refused naming
the mark: never a request whose key was deleted under it. A completed key leaves ``completed`` only through a
restatement, which needs a request, so under the lock the rows the prune deletes are the rows it planned on. On
PostgreSQL the lock is a transaction-scoped advisory lock: a guard in the DELETE alone would not do (the plan, made in
READ COMMITTED, cannot see a request still in flight, and a DELETE that waited on the key's row lock deletes the row
without evaluating its conditions on the request table again). SQLite's write transactions are serialized already.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.calendar import load_zone, utc_iso
from export_ledger.ledger.operators import append_in
from export_ledger.ledger.schema import (
    ExportState,
    export_attempts,
    export_contracts,
    export_drift,
    export_low_water,
    export_restatements,
    export_revisions,
    export_runs,
)

#: Dates listed as never exported in a plan (the count is exact; the list is for the operator to read).
LISTED_DATES = 50
#: The class of the retention locks (PostgreSQL advisory locks of two keys: this class and the export's hash; the
#: contracts' locks are of the one-key form, a space of their own).
RETENTION_LOCK_CLASS = 0x52455400


def lock_export_in(conn: Connection, export: str, *, shared: bool = False) -> None:
    """Takes ``export``'s retention lock until ``conn``'s transaction ends: exclusive for a prune, shared for a
    restatement request (requests of one export do not wait for each other). SQLite: nothing to take, its write
    transactions are serialized already."""
    if conn.dialect.name != "postgresql":
        return
    take = sa.func.pg_advisory_xact_lock_shared if shared else sa.func.pg_advisory_xact_lock
    conn.execute(sa.select(take(RETENTION_LOCK_CLASS, sa.func.hashtext(export))))


#: Read by every first claim (built once: benchmarks, ledger throughput).
_LOW_WATER = sa.select(export_low_water.c.low_water_date).where(export_low_water.c.export == sa.bindparam("w_export"))


@dataclass(frozen=True)
class PrunePlan:
    """What pruning one export does (or did).

    Attributes:
        export: The export.
        horizon: Business dates before it were asked to be pruned (the earliest "today" of the tenants' zones, less
            the days given).
        mark: The low-water mark afterwards: dates before it are closed to new claims.
        previous_mark: The mark before (None: never pruned).
        pruned: Completed records deleted (with their attempts): those dated before ``mark``.
        blocked_by: The first date before the horizon with a key not completed: the mark stops there.
        unexported: Dates before the mark, or before the horizon when they stopped it, on which an expected tenant
            has no key (the first :data:`LISTED_DATES` of them).
        unexported_count: How many such dates there are.
        closes_unexported: The operator closed ``unexported`` dates explicitly.
        missing_tenants: The tenants with no key on the first unexported date (the first :data:`LISTED_DATES`): a
            tenant that left the export stays expected, and holds the mark, until an operator closes its dates.
    """

    export: str
    horizon: dt.date
    mark: dt.date | None
    previous_mark: dt.date | None
    pruned: int
    blocked_by: dt.date | None = None
    unexported: list[dt.date] = field(default_factory=list)
    unexported_count: int = 0
    closes_unexported: bool = False
    missing_tenants: list[str] = field(default_factory=list)


class Retention:
    """The retention methods of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def low_water(self, export: str) -> dt.date | None:
        with self.ledger.atomic(read_only=True) as conn:
            return self.low_water_in(conn, export)

    def low_water_in(self, conn: Connection, export: str) -> dt.date | None:
        return conn.execute(_LOW_WATER, {"w_export": export}).scalar()

    def closed_refusal(
        self, conn: Connection, logical_key: str, business_date: dt.date | None, what: str
    ) -> str | None:
        """Why ``what`` (``a restatement``) is refused for a key below its export's low-water mark, read in
        ``conn``'s transaction (which holds the export's retention lock); None when the key is not below it. A key
        with no record (``business_date`` None) whose window starts before the mark may have been pruned: the
        refusal says so."""
        export, _, rest = logical_key.partition("/")
        mark = self.low_water_in(conn, export)
        if mark is None:
            return None
        closed = f"the retention low-water mark of {export} ({mark.isoformat()})"
        if business_date is None:
            try:
                start = dt.datetime.fromisoformat(rest.rpartition("/")[2].replace("Z", "+00:00"))
            except ValueError:
                return None
            # The key names its window's start, not its zone: its business date is the date of that instant in a
            # zone between UTC-12 and UTC+14.
            earliest, latest = ((start + dt.timedelta(hours=h)).date() for h in (-12, 14))
            if earliest >= mark:
                return None
            if latest < mark:
                return (
                    f"unknown logical key {logical_key!r}: the ledger has no record of it, and the records of "
                    f"business dates before {closed} were pruned: {what} of a key of those dates is refused"
                )
            return (
                f"unknown logical key {logical_key!r}: the ledger has no record of it (never exported, or pruned: its "
                f"window starts at {utc_iso(start)}, so by its zone its business date may be on or before "
                f"{closed}, and the records of business dates before the mark were pruned); {what} of it is refused"
            )
        if business_date >= mark:
            return None
        return (
            f"{logical_key} (business date {business_date}) is below {closed}: dates before the mark are closed and "
            f"their records are pruned, so {what} of it is refused"
        )

    def plan(
        self, older_than_days: int, *, export: str | None = None, close_unexported: bool = False
    ) -> list[PrunePlan]:
        """What :meth:`prune` would do, changing nothing."""
        with self.ledger.atomic(read_only=True) as conn:
            now = self.ledger.now(conn)
            return [self._plan(conn, name, older_than_days, close_unexported, now) for name in _names(conn, export)]

    def prune(
        self,
        older_than_days: int,
        *,
        export: str | None = None,
        close_unexported: bool = False,
        operator: str | None = None,
        reason: str | None = None,
    ) -> list[PrunePlan]:
        """Deletes ``completed`` records (and their attempts and revisions) dated before each export's new low-water
        mark, and raises the mark, as :meth:`plan` describes.

        Other states are never pruned: a failed or stuck key keeps its history until it is resolved. After pruning,
        first claims below the mark are refused (see ``allow_below_low_water``).

        Args:
            older_than_days: Prune business dates more than this many days before today; 0 or more.
            export: Only this export.
            close_unexported: Let the mark close dates on which an expected tenant has no key (they can then never
                be exported without an override). Needs ``operator`` and ``reason``; recorded in the operator log.
        """
        if close_unexported and not (operator and reason and reason.strip()):
            raise ValueError("closing dates that were never exported needs an operator and a reason")
        plans = []
        with self.ledger.atomic() as conn:
            now = self.ledger.now(conn)
            for name in _names(conn, export):
                # Held until the commit: no restatement request of the export is in flight while it plans and
                # deletes, and none starts before the new mark is committed (see the module's docstring).
                lock_export_in(conn, name)
                plan = self._plan(conn, name, older_than_days, close_unexported, now)
                plans.append(plan)
                if plan.mark is None or plan.mark == plan.previous_mark:
                    continue
                self._apply(conn, plan, now, operator, reason)
        return plans

    def _apply(self, conn: Connection, plan: PrunePlan, now: dt.datetime, operator, reason) -> None:
        name = plan.export
        old = sa.and_(
            export_runs.c.export == name,
            export_runs.c.state == ExportState.COMPLETED.value,
            export_runs.c.business_date < plan.mark,
        )
        doomed = sa.select(export_runs.c.logical_key).where(old)
        conn.execute(export_attempts.delete().where(export_attempts.c.logical_key.in_(doomed)))
        # Their revisions go with them, as their attempts do (closed restatement requests are kept, like drift
        # records: who asked for what, and why).
        conn.execute(export_revisions.delete().where(export_revisions.c.logical_key.in_(doomed)))
        # A pruned key can no longer be stale: its open drift record is closed (drift records are kept).
        conn.execute(
            export_drift.update()
            .where(export_drift.c.logical_key.in_(doomed), export_drift.c.cleared_at.is_(None))
            .values(cleared_at=now)
        )
        conn.execute(export_runs.delete().where(old))
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
                    low_water_date=plan.mark, pruned_total=export_low_water.c.pruned_total + plan.pruned, updated_at=now
                )
            )
        closed = [d for d in plan.unexported if d < plan.mark]
        if plan.closes_unexported and plan.unexported_count:
            append_in(
                conn, now, operator, "prune-close-unexported",
                f"low-water mark {plan.mark} closes {plan.unexported_count} date(s) on which a tenant was never "
                "exported: " + ", ".join(d.isoformat() for d in closed[:20]),
                reason, export=name,
            )  # fmt: skip

    def _plan(
        self, conn: Connection, name: str, older_than_days: int, close_unexported: bool, now: dt.datetime
    ) -> PrunePlan:
        if older_than_days < 0:
            raise ValueError(f"older_than_days must be zero or more, got {older_than_days}")
        starts = _expected_tenants(conn, name)
        horizon = _today_in(starts.zones, now) - dt.timedelta(days=older_than_days)
        previous = self.low_water_in(conn, name)
        runs = export_runs.c
        blocked_by = conn.execute(
            sa.select(sa.func.min(runs.business_date)).where(
                runs.export == name, runs.state != ExportState.COMPLETED.value, runs.business_date < horizon
            )
        ).scalar()
        # A completed key with an open restatement request is not done either: it stops the mark too.
        if self.ledger.supports(5):
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
        first = previous or starts.first
        unexported: list[dt.date] = []
        count = 0
        missing: list[str] = []
        if first is not None and first < candidate:
            # Counted per start date: a tenant is looked for from its own start on, so keys of a tenant on dates
            # before its start never stand in for another tenant's missing key.
            groups = starts.by_start()
            keyed = {start: _keyed_per_day(conn, name, tenants, max(first, start), candidate)
                     for start, tenants in groups.items() if start < candidate}  # fmt: skip
            day = first
            while day < candidate:
                short = [start for start, tenants in groups.items()
                         if start <= day and keyed[start].get(day, 0) < len(tenants)]  # fmt: skip
                if short:
                    count += 1
                    if len(unexported) < LISTED_DATES:
                        unexported.append(day)
                    if not missing:
                        missing = _missing_on(conn, name, day, [t for start in short for t in groups[start]])
                day += dt.timedelta(days=1)
        mark = candidate if close_unexported or not count else unexported[0]
        if previous is not None:
            mark = max(previous, mark)  # the mark never goes down: what was closed stays closed
        pruned = conn.execute(
            sa.select(sa.func.count()).where(
                runs.export == name, runs.state == ExportState.COMPLETED.value, runs.business_date < mark
            )
        ).scalar()
        return PrunePlan(
            name,
            horizon,
            mark,
            previous,
            int(pruned),
            blocked_by,
            unexported,
            count,
            close_unexported and count > 0,
            missing,
        )


@dataclass(frozen=True)
class _Expected:
    """Which tenants an export is expected to have keys for, from when (their contracts' start dates, else their
    first key), and in which zones their business days run."""

    starts: dict[str, dt.date]
    zones: set[str]

    @property
    def first(self) -> dt.date | None:
        return min(self.starts.values()) if self.starts else None

    def by_start(self) -> dict[dt.date, list[str]]:
        """The tenants, grouped by the date they are expected from."""
        groups: dict[dt.date, list[str]] = {}
        for tenant, start in sorted(self.starts.items()):
            groups.setdefault(start, []).append(tenant)
        return groups


#: Tenants bound per statement when counting keys.
TENANTS_PER_READ = 500


def _keyed_per_day(conn: Connection, export: str, tenants: list[str], first: dt.date, end: dt.date) -> dict:
    """Per business date in [first, end), how many of ``tenants`` have a key."""
    runs = export_runs.c
    counts: dict[dt.date, int] = {}
    for start in range(0, len(tenants), TENANTS_PER_READ):
        query = (
            sa.select(runs.business_date, sa.func.count(sa.distinct(runs.tenant)))
            .where(
                runs.export == export,
                runs.business_date >= first,
                runs.business_date < end,
                runs.tenant.in_(tenants[start : start + TENANTS_PER_READ]),
            )  # fmt: skip
            .group_by(runs.business_date)
        )
        for day, keys in conn.execute(query):
            counts[day] = counts.get(day, 0) + int(keys)
    return counts


def _missing_on(conn: Connection, export: str, day: dt.date, tenants: list[str]) -> list[str]:
    """Which of ``tenants`` have no key on ``day`` (the first :data:`LISTED_DATES`)."""
    runs = export_runs.c
    have: set[str] = set()
    for start in range(0, len(tenants), TENANTS_PER_READ):
        have.update(
            conn.execute(
                sa.select(runs.tenant).where(
                    runs.export == export,
                    runs.business_date == day,
                    runs.tenant.in_(tenants[start : start + TENANTS_PER_READ]),
                )  # fmt: skip
            ).scalars()
        )
    return [tenant for tenant in tenants if tenant not in have][:LISTED_DATES]


def _expected_tenants(conn: Connection, export: str) -> _Expected:
    starts: dict[str, dt.date] = {}
    zones: set[str] = set()
    wide_start: dt.date | None = None
    for (text,) in conn.execute(
        sa.select(export_contracts.c.contract)
        .where(export_contracts.c.export == export)
        .order_by(export_contracts.c.id)
    ):
        contract = json.loads(text)
        start = dt.date.fromisoformat(contract["start_date"]) if contract.get("start_date") else None
        if contract.get("timezone"):
            zones.add(contract["timezone"])
        tenant = contract.get("tenant")
        if tenant is None:
            wide_start = start
        elif start is not None:
            starts[tenant] = start
    # Tenants with keys and no contract of their own (an export-wide contract, or none): from the wide contract's
    # start date, else from their first key.
    for tenant, first_key, zone in conn.execute(
        sa.select(export_runs.c.tenant, sa.func.min(export_runs.c.business_date), sa.func.min(export_runs.c.timezone))
        .where(export_runs.c.export == export)
        .group_by(export_runs.c.tenant)
    ):
        zones.add(zone)
        if tenant not in starts:
            starts[tenant] = wide_start if wide_start is not None else first_key
    return _Expected(starts, zones)


def _today_in(zones: set[str], now: dt.datetime) -> dt.date:
    """The earliest local date of ``now`` among ``zones`` (UTC's when there are none): a date is only past once it is
    past for every tenant."""
    dates = [now.astimezone(load_zone(zone)).date() for zone in zones]
    return min(dates) if dates else now.date()


def _names(conn: Connection, export: str | None) -> list[str]:
    query = sa.select(export_runs.c.export).distinct()
    if export is not None:
        query = query.where(export_runs.c.export == export)
    return sorted(set(conn.execute(query).scalars()) | ({export} if export else set()))
