"""Reads of keys and attempts. Each read is one statement in a read transaction (SQLite begins it deferred, so a read
never waits behind a running export), and every read a sensor tick or the CLI makes takes a ``limit``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, fields

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from export_ledger.keys import LogicalKey
from export_ledger.ledger.records import AttemptRecord, DaySummary, ExportRecord, ListedKey
from export_ledger.ledger.schema import (
    AttemptOutcome,
    ExportState,
    export_attempts,
    export_contract_refusals,
    export_contracts,
    export_drift,
    export_restatements,
    export_runs,
)


@dataclass(frozen=True)
class AttemptPage:
    """Attempt rows read in id order after an id (:meth:`Queries.attempts_after`).

    Attributes:
        after: The id they were read after.
        ids: Every id read, in order, whatever its export: an id missing between two of them was not visible to the
            read (its transaction not committed yet, rolled back, or its row pruned).
        rows: The rows of the exports asked for, in id order.
        full: The read reached its limit: more rows may follow.
    """

    after: int
    ids: tuple[int, ...]
    rows: tuple[AttemptRecord, ...]
    full: bool


#: Days probed per statement by :meth:`Queries.unfinished_days` (SQLite allows 500 terms in a compound select).
DAYS_PER_PROBE = 100
#: Above this many tenants, :meth:`Queries.day_summaries` joins them as rows on PostgreSQL instead of listing them.
_TENANTS_AS_LIST = 50


def _rows_of(column: str, values: list, item_type: type[sa.types.TypeEngine]) -> sa.TableValuedAlias:
    """PostgreSQL: ``values`` as the rows of a one-column table ``wanted(column)``, sent as one array parameter."""
    array = sa.bindparam(f"{column}_values", values, type_=pg.ARRAY(item_type))
    return sa.func.unnest(array).table_valued(column).render_derived(name="wanted")


class Queries:
    """Reads of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def _select(self) -> sa.Select:
        return sa.select(*self.ledger.run_columns)

    def get(self, logical_key: str) -> ExportRecord | None:
        query = self._select().where(export_runs.c.logical_key == logical_key)
        with self.ledger.atomic(read_only=True) as conn:
            row = conn.execute(query).first()
        return ExportRecord.from_row(row) if row else None

    def get_many(self, logical_keys: Sequence[str]) -> dict[str, ExportRecord]:
        """The records of ``logical_keys`` that exist, by key: one read per 500 keys (a partition's check judges
        every key of it; one read per key was most of its cost)."""
        keys = list(dict.fromkeys(logical_keys))
        found: dict[str, ExportRecord] = {}
        with self.ledger.atomic(read_only=True) as conn:
            for first in range(0, len(keys), 500):
                query = self._select().where(export_runs.c.logical_key.in_(keys[first : first + 500]))
                found.update((row.logical_key, ExportRecord.from_row(row)) for row in conn.execute(query))
        return found

    def find(self, key: LogicalKey) -> ExportRecord | None:
        """The record for the key's business day, whatever window start it was first claimed with."""
        query = self._select().where(
            export_runs.c.export == key.export,
            export_runs.c.tenant == key.tenant,
            export_runs.c.timezone == key.window.timezone,
            export_runs.c.business_date == key.window.business_date,
        )
        with self.ledger.atomic(read_only=True) as conn:
            row = conn.execute(query).first()
        return ExportRecord.from_row(row) if row else None

    def records(
        self,
        *,
        export: str | None = None,
        tenant: str | None = None,
        date_from: dt.date | None = None,
        date_to: dt.date | None = None,
        states: Sequence[ExportState] = (),
        limit: int | None = None,
        offset: int = 0,
        tenants: Sequence[str] = (),
        business_dates: Sequence[dt.date] = (),
        timezone: str | None = None,
        exports: Sequence[str] = (),
    ) -> list[ExportRecord]:
        """Keys matching every filter given, by export, business date and tenant; ``limit`` and ``offset`` page."""
        query = self._select()
        runs = export_runs.c
        if export is not None:
            query = query.where(runs.export == export)
        if exports:
            query = query.where(runs.export.in_(list(exports)))
        if tenant is not None:
            query = query.where(runs.tenant == tenant)
        if tenants:
            query = query.where(runs.tenant.in_(list(tenants)))
        if business_dates:
            query = query.where(runs.business_date.in_(list(business_dates)))
        if timezone is not None:
            query = query.where(runs.timezone == timezone)
        if date_from is not None:
            query = query.where(runs.business_date >= date_from)
        if date_to is not None:
            query = query.where(runs.business_date <= date_to)
        if states:
            query = query.where(runs.state.in_([s.value for s in states]))
        query = query.order_by(runs.export, runs.business_date, runs.tenant)
        if limit is not None:
            query = query.limit(limit)
        if offset:
            query = query.offset(offset)
        with self.ledger.atomic(read_only=True) as conn:
            return [ExportRecord.from_row(row) for row in conn.execute(query)]

    def count(self, *, export: str | None = None, states: Sequence[ExportState] = ()) -> int:
        """How many keys (of ``export``, in ``states``) the ledger holds: counted by the database."""
        query = sa.select(sa.func.count()).select_from(export_runs)
        if export is not None:
            query = query.where(export_runs.c.export == export)
        if states:
            query = query.where(export_runs.c.state.in_([s.value for s in states]))
        with self.ledger.atomic(read_only=True) as conn:
            return int(conn.execute(query).scalar_one())

    def exports(self) -> list[str]:
        """Every export name the ledger has a key or a calendar contract of, sorted (one name a row: bounded by the
        number of exports)."""
        with self.ledger.atomic(read_only=True) as conn:
            names = set(conn.execute(sa.select(export_runs.c.export).distinct()).scalars())
            names |= set(conn.execute(sa.select(export_contracts.c.export).distinct()).scalars())
        return sorted(names)

    def tenants(self, *, export: str | None = None, limit: int = 100) -> tuple[list[str], bool]:
        """Tenant ids the ledger has a key, a contract row or a refused claim of (of one export when given), sorted,
        and whether there may be more: the first ``limit`` of each table in order (a listing for a message)."""
        found: set[str] = set()
        more = False
        with self.ledger.atomic(read_only=True) as conn:
            for table in self._tenant_tables():
                query = sa.select(table.c.tenant).where(table.c.tenant.is_not(None), *_of_export(table, export))
                names = list(conn.execute(query.distinct().order_by(table.c.tenant).limit(limit)).scalars())
                found.update(names)
                more = more or len(names) == limit
        return sorted(found), more

    def has_tenant(self, tenant: str, *, export: str | None = None) -> bool:
        """Whether the ledger has a contract row, a key or a refused claim of ``tenant`` (of ``export`` when given):
        at most one row returned from each table."""
        with self.ledger.atomic(read_only=True) as conn:
            return any(
                conn.execute(
                    sa.select(sa.literal(1)).where(table.c.tenant == tenant, *_of_export(table, export)).limit(1)
                ).first()
                is not None
                for table in self._tenant_tables()
            )

    def committed_step_of_zone(self, export: str, zone: str) -> str | None:
        """The step (Dagster asset) named by the committed attempt of one completed key of ``export`` in ``zone``
        (an attempt id is ``<run id>/<step>``), or None: one row read."""
        query = (
            sa.select(export_runs.c.committed_attempt)
            .where(
                export_runs.c.export == export,
                export_runs.c.timezone == zone,
                export_runs.c.committed_attempt.like("%/%"),
            )
            .limit(1)
        )
        with self.ledger.atomic(read_only=True) as conn:
            attempt = conn.execute(query).scalar()
        step = (attempt or "").rpartition("/")[2]
        return step if step and (step == export or step.startswith(f"{export}__")) else None

    def _tenant_tables(self) -> list[sa.Table]:
        """The tables that name tenants in this ledger's schema: refusals came with version 6, a contract row's
        tenant with version 9 (an older ledger is read as it is)."""
        tables = [export_runs]
        if self.ledger.supports(6):
            tables.append(export_contract_refusals)
        if self.ledger.supports(9):
            tables.append(export_contracts)
        return tables

    def day_summaries(
        self, *, export: str, timezone: str | None, days: Sequence[dt.date], tenants: Sequence[str]
    ) -> dict[dt.date, DaySummary]:
        """Per business day, how ``tenants``' keys stand (in ``timezone``; None: whatever their zone): counted in the
        database, so a tick that looks at a hundred days of a thousand tenants reads a hundred rows. Days with no key
        are absent."""
        if not days or not tenants:
            return {}
        state = export_runs.c.state
        completed = state == ExportState.COMPLETED.value
        query = sa.select(
            export_runs.c.business_date,
            sa.func.count().label("keys"),
            sa.func.sum(sa.case((completed, 1), else_=0)).label("completed"),
            sa.func.sum(sa.case((completed, export_runs.c.row_count), else_=0)).label("rows"),
        ).where(export_runs.c.export == export, export_runs.c.business_date.in_(list(days)))
        with self.ledger.atomic(read_only=True) as conn:
            if conn.dialect.name == "postgresql" and len(tenants) > _TENANTS_AS_LIST:
                # Many tenants: joined as rows, so that PostgreSQL reads the days from the covering index and hashes
                # the tenants (as a long IN list it filtered each day's rows from the table: 2.5x slower at 1,000).
                wanted = _rows_of("tenant", list(tenants), sa.String)
                query = query.select_from(export_runs.join(wanted, export_runs.c.tenant == wanted.c.tenant))
            else:
                query = query.where(export_runs.c.tenant.in_(list(tenants)))
            query = query.group_by(export_runs.c.business_date)
            if timezone is not None:
                query = query.where(export_runs.c.timezone == timezone)
            return {
                row.business_date: DaySummary(row.business_date, int(row.keys), int(row.completed), int(row.rows or 0))
                for row in conn.execute(query)
            }

    def first_keys(
        self, *, export: str, timezone: str | None, days: Sequence[dt.date], tenants: Sequence[str], per_day: int
    ) -> dict[dt.date, list[ListedKey]]:
        """The first ``per_day`` keys of each day (by tenant id) among ``tenants``: what an event lists, as
        :class:`ListedKey` (the columns it shows: a whole record's lease and time columns took 80% of the read).
        Read by key, ``per_day`` tenants at a time in tenant order, for the days still short of ``per_day``: a day of a
        thousand tenants costs ``per_day`` lookups, not a thousand rows. (A ``ROW_NUMBER`` over every row of the
        touched days was 300 ms a tick at a million rows.)"""
        if not days or not tenants or per_day <= 0:
            return {}
        runs = export_runs.c
        columns = [getattr(runs, field.name) for field in fields(ListedKey)]
        ordered = sorted(set(tenants))
        found: dict[dt.date, list[ListedKey]] = {}
        short = sorted(set(days))
        with self.ledger.atomic(read_only=True) as conn:
            for first in range(0, len(ordered), per_day):
                query = sa.select(*columns).where(
                    runs.export == export,
                    runs.business_date.in_(short),
                    runs.tenant.in_(ordered[first : first + per_day]),
                )
                if timezone is not None:
                    query = query.where(runs.timezone == timezone)
                for row in conn.execute(query):
                    listed = ListedKey(*row)
                    found.setdefault(listed.business_date, []).append(listed)
                short = [day for day in short if len(found.get(day, ())) < per_day]
                if not short:
                    break
        return {
            day: sorted(keys, key=lambda k: (k.tenant, k.timezone))[:per_day] for day, keys in sorted(found.items())
        }

    def unfinished_days(
        self, *, export: str, timezone: str | None, days: Sequence[dt.date], tenants: Sequence[str]
    ) -> set[dt.date]:
        """Which of ``days`` hold a key of ``tenants`` (in ``timezone``; None: any) that is not completed: one
        ``EXISTS`` per day and state on the index that starts with the state, so a day costs one probe however many of
        its keys are failed and its completed keys are never read."""
        if not days or not tenants:
            return set()
        runs = export_runs.c
        blocking = [state.value for state in ExportState if state is not ExportState.COMPLETED]
        wanted_days = sorted(set(days))
        found: set[dt.date] = set()
        with self.ledger.atomic(read_only=True) as conn:
            postgres = conn.dialect.name == "postgresql"
            step = len(wanted_days) if postgres else DAYS_PER_PROBE
            for first in range(0, len(wanted_days), step):
                chunk = wanted_days[first : first + step]
                if postgres:
                    # The days and the tenants as two arrays: one statement of a few parameters, whose plan takes
                    # a millisecond (a union of literals and a long IN list in each probe took 28 ms to plan).
                    wanted = _rows_of("day", chunk, sa.Date)
                    tenants_array = sa.bindparam("tenants", list(tenants), type_=pg.ARRAY(sa.String))
                    tenant_in = runs.tenant == sa.any_(tenants_array)
                else:
                    # The days as rows (a UNION of literals: SQLite 3.40 names no VALUES columns), each probed alone.
                    wanted = sa.union_all(*(sa.select(sa.literal(day, sa.Date).label("day")) for day in chunk))
                    wanted = wanted.subquery("wanted")
                    tenant_in = runs.tenant.in_(list(tenants))
                probes = []
                for state in blocking:
                    probe = sa.select(sa.literal(1)).where(
                        runs.state == state,
                        runs.export == export,
                        runs.business_date == wanted.c.day,
                        tenant_in,
                    )
                    if timezone is not None:
                        probe = probe.where(runs.timezone == timezone)
                    probes.append(probe.exists())
                for day in conn.execute(sa.select(wanted.c.day).where(sa.or_(*probes))).scalars():
                    found.add(dt.date.fromisoformat(day) if isinstance(day, str) else day)
        return found

    def partitions_committed_by(
        self, attempts: Sequence[str], *, export: str, limit: int = 1000
    ) -> list[tuple[str, str, dt.date]]:
        """The partitions ``(export, zone, business date)`` of ``export`` holding keys these attempts completed (their
        other keys, when some of theirs are being reconciled), at most ``limit``: one read for a page of attempts, on
        the index of the committed attempt. (The export is compared here, not in SQL: given both, SQLite's planner
        took the export's index and walked every key of it, 8 s a tick at a million rows.)"""
        if not attempts:
            return []
        runs = export_runs.c
        query = (
            sa.select(runs.export, runs.timezone, runs.business_date)
            .where(runs.committed_attempt.in_(sorted(set(attempts))))
            .distinct()
            .order_by(runs.export, runs.timezone, runs.business_date)
            .limit(limit)
        )
        with self.ledger.atomic(read_only=True) as conn:
            return [(r.export, r.timezone, r.business_date) for r in conn.execute(query) if r.export == export]

    def attempts(self, logical_key: str, *, limit: int | None = None) -> list[AttemptRecord]:
        """A key's attempts, oldest first (the last ``limit`` of them when given)."""
        query = sa.select(export_attempts).where(export_attempts.c.logical_key == logical_key)
        if limit is not None:
            newest = query.order_by(export_attempts.c.id.desc()).limit(limit).subquery()
            query = sa.select(newest).order_by(newest.c.id)
        else:
            query = query.order_by(export_attempts.c.id)
        with self.ledger.atomic(read_only=True) as conn:
            return [AttemptRecord.from_row(row) for row in conn.execute(query)]

    def attempt_count(self, logical_key: str) -> int:
        query = sa.select(sa.func.count()).where(export_attempts.c.logical_key == logical_key)
        with self.ledger.atomic(read_only=True) as conn:
            return int(conn.execute(query).scalar_one())

    def all_attempts(self) -> list[AttemptRecord]:
        """Every attempt of every key (tests and harnesses: unbounded by design)."""
        with self.ledger.atomic(read_only=True) as conn:
            rows = conn.execute(sa.select(export_attempts).order_by(export_attempts.c.id))
            return [AttemptRecord.from_row(row) for row in rows]

    def attempts_after(self, after: int | None, *, limit: int, exports: Sequence[str] = ()) -> AttemptPage:
        """Attempt rows with an id above ``after``, oldest first: at most ``limit`` rows read from the primary key,
        those of ``exports`` kept (all when empty). ``after`` None starts ``limit`` rows back from the newest."""
        attempts = export_attempts.c
        with self.ledger.atomic(read_only=True) as conn:
            if after is None:
                newest = conn.execute(sa.select(sa.func.coalesce(sa.func.max(attempts.id), 0))).scalar_one()
                after = max(0, newest - limit)
            rows = conn.execute(
                sa.select(export_attempts, export_runs.c.export)
                .select_from(export_attempts.join(export_runs, export_runs.c.logical_key == attempts.logical_key))
                .where(attempts.id > after)
                .order_by(attempts.id)
                .limit(limit)
            ).all()
        wanted = set(exports)
        kept = tuple(_attempt(row) for row in rows if not wanted or row.export in wanted)
        return AttemptPage(after, tuple(row.id for row in rows), kept, len(rows) == limit)

    def held_by_runs(self, run_ids: Sequence[str], *, limit: int = 1000) -> list[ExportRecord]:
        """Keys ``in_progress`` whose lease (live or ended) an attempt of one of these Dagster runs holds (its id is
        the run id, or ``<run id>/<step key>``), at most ``limit``: read on the index of the state."""
        if not run_ids:
            return []
        owner = export_runs.c.lease_owner
        query = (
            self._select()
            .where(
                export_runs.c.state == ExportState.IN_PROGRESS.value,
                sa.or_(*(sa.or_(owner == run, owner.startswith(f"{run}/", autoescape=True)) for run in run_ids)),
            )
            .order_by(export_runs.c.logical_key)
            .limit(limit)
        )
        with self.ledger.atomic(read_only=True) as conn:
            return [ExportRecord.from_row(r) for r in conn.execute(query)]

    def committed_by(self, attempt: str, *, limit: int = 1000) -> list[ExportRecord]:
        """Keys an attempt completed (its other keys, when one of them is being reconciled), at most ``limit``."""
        query = (
            self._select()
            .where(export_runs.c.committed_attempt == attempt)
            .order_by(export_runs.c.logical_key)
            .limit(limit)
        )
        with self.ledger.atomic(read_only=True) as conn:
            return [ExportRecord.from_row(r) for r in conn.execute(query)]

    def touched_partitions(
        self, *, after: dict[str, int] | None, limit: int
    ) -> tuple[list[tuple[str, str, dt.date]], dict[str, int]]:
        """The partitions ``(export, zone, business date)`` whose keys changed since ``after``: a new attempt (every
        claim and outcome appends one), a new drift record, a new restatement request; at most ``limit`` rows of each,
        read in id order from their primary keys; and the cursor to pass next time. ``after`` None starts from now
        (the latest ids), not from the ledger's history."""
        runs = export_runs.c
        tables = {"attempts": export_attempts, "drift": export_drift, "restatements": export_restatements}
        with self.ledger.atomic(read_only=True) as conn:
            if after is None:
                return [], {
                    name: conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.c.id), 0))).scalar_one()
                    for name, t in tables.items()
                }
            cursor = {name: int(after.get(name, 0)) for name in tables}
            found: list[tuple[str, str, dt.date]] = []
            attempts = export_attempts.c
            rows = conn.execute(
                sa.select(attempts.id, runs.export, runs.timezone, runs.business_date)
                .select_from(export_attempts.join(export_runs, runs.logical_key == attempts.logical_key))
                .where(attempts.id > cursor["attempts"])
                .order_by(attempts.id)
                .limit(limit)
            ).all()
            for row in rows:
                found.append((row.export, row.timezone, row.business_date))
                cursor["attempts"] = row.id
            for name in ("drift", "restatements"):
                table = tables[name].c
                rows = conn.execute(
                    sa.select(table.id, runs.export, runs.timezone, runs.business_date)
                    .select_from(tables[name].join(export_runs, runs.logical_key == table.logical_key))
                    .where(table.id > cursor[name])
                    .order_by(table.id)
                    .limit(limit)
                ).all()
                for row in rows:
                    found.append((row.export, row.timezone, row.business_date))
                    cursor[name] = row.id
        return list(dict.fromkeys(found)), cursor


#: Where ``outcome`` is in an ``export_attempts`` row (read with its columns first, in the table's order).
_OUTCOME_AT = [column.name for column in export_attempts.c].index("outcome")
_ATTEMPT_COLUMNS = len(export_attempts.c)
if [column.name for column in export_attempts.c] != [field.name for field in fields(AttemptRecord)]:
    raise RuntimeError("AttemptRecord's fields must be export_attempts' columns, in order (_attempt reads by position)")


def _attempt(row: sa.Row) -> AttemptRecord:
    """An attempt row read with its key's export, as ``export_attempts`` alone (by position: a tick's cold start
    reads ~1,650 of them, and a dict per row was a fifth of that read)."""
    values = list(row[:_ATTEMPT_COLUMNS])
    values[_OUTCOME_AT] = AttemptOutcome(values[_OUTCOME_AT])
    return AttemptRecord(*values)


def _of_export(table: sa.Table, export: str | None) -> list:
    return [] if export is None else [table.c.export == export]
