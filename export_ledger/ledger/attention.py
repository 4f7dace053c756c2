"""What needs doing, a bounded page at a time: stuck keys to reconcile, partitions to rerun or to restate, and
escalations for a person.

Every read here takes a ``limit`` and continues ``after`` a cursor, filters by the caller's exports (two code
locations sharing a ledger see only their own), and counts in the database: a sensor tick costs what it acts on, not
what the ledger holds, and binds a fixed number of parameters whatever the backlog.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa

from export_ledger.contract import changes, terms_of
from export_ledger.ledger import transitions as T
from export_ledger.ledger.contracts import accept_command, count_open_per_zone
from export_ledger.ledger.records import ExportRecord
from export_ledger.ledger.schema import ExportState, export_missed_partitions, export_restatements, export_runs

S = ExportState
#: Keys listed per group (an asset) in a summary; the counts are exact.
LISTED = 20


_CLOSE_MISSED_ONE = (
    export_missed_partitions.update()
    .where(
        export_missed_partitions.c.closed_at.is_(None),
        export_missed_partitions.c.export == sa.bindparam("m_export"),
        export_missed_partitions.c.timezone == sa.bindparam("m_timezone"),
        export_missed_partitions.c.business_date == sa.bindparam("m_date"),
    )
    .values(closed_at=sa.bindparam("m_now"))
)


@dataclass(frozen=True)
class PartitionWork:
    """One (export, business date, zone) with keys to rerun or to restate: one run of one zone's asset.

    ``digest`` changes whenever the situation does (a new failure raises a key's token; a new request has a new id)
    and stays the same while it does not, so a run key built from it launches each situation once.
    """

    export: str
    business_date: dt.date
    timezone: str
    keys: int
    digest: str

    @property
    def cursor(self) -> str:
        return f"{self.export}|{self.business_date.isoformat()}|{self.timezone}"


@dataclass(frozen=True)
class Escalation:
    """Something that waits for a person, with why and the way out.

    ``record`` is the key's row (None for a tenant refused by its calendar contract, and for a partition whose runs
    failed before they claimed any key: neither has a key to show). ``tenant`` is None for such a partition, which
    concerns every tenant the ledger has no key of; ``business_date`` names it.
    """

    export: str
    tenant: str | None
    timezone: str | None
    logical_key: str | None
    state: str
    since: dt.datetime
    why: str
    record: ExportRecord | None = None
    business_date: dt.date | None = None

    @property
    def name(self) -> str:
        if self.logical_key:
            return self.logical_key
        if self.tenant is None:
            return f"{self.export}/{self.timezone}/{self.business_date.isoformat() if self.business_date else '?'}"
        return f"{self.export}/{self.tenant}"


@dataclass(frozen=True)
class AttentionSummary:
    """Escalations counted per group (export and zone: one Dagster asset), with the first :data:`LISTED` of each, and
    a digest that changes when the escalated set does."""

    total: int
    digest: str
    groups: dict[tuple[str, str | None], tuple[int, list[Escalation]]] = field(default_factory=dict)
    #: The counts are lower bounds: a source held more than the summary's ``cap`` (see :meth:`Attention.summary`).
    at_least: bool = False


class Attention:
    """The pages of work and escalations of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    # -- reconciliation ----------------------------------------------------------------------------------------

    def stuck(self, *, limit: int, after: str | None = None, exports: Sequence[str] = ()) -> list[ExportRecord]:
        """Keys that need reconciling, in key order after ``after``: ``remote_unknown``, and ``in_progress`` whose
        lease has ended (a crashed or stalled party). Each of the two reads walks an index on state."""
        _check_limit(limit)
        runs = export_runs.c
        rows = []
        with self.ledger.atomic(read_only=True) as conn:
            now = self.ledger.now(conn)
            for condition in (
                runs.state == S.REMOTE_UNKNOWN.value,
                sa.and_(runs.state == S.IN_PROGRESS.value, T.lease_expired_sql(now)),
            ):
                query = self._keys(condition, exports)
                if after is not None:
                    query = query.where(runs.logical_key > after)
                rows.extend(conn.execute(query.order_by(runs.logical_key).limit(limit)))
        records = sorted((ExportRecord.from_row(r) for r in rows), key=lambda r: r.logical_key)
        return records[:limit]

    # -- reruns and restatements, a partition at a time ----------------------------------------------------------

    def failed_partitions(
        self, *, max_attempts: int, limit: int, after: str | None = None, exports: Sequence[str] = ()
    ) -> list[PartitionWork]:
        """Partitions holding ``failed`` keys with automatic reruns left (fewer than ``max_attempts`` export claims
        since their last resolution or request), after the cursor ``after``. Every failed key of a partition counts,
        whichever page it falls on, so one partition is one run however many of its keys failed."""
        _check_limit(limit)
        runs = export_runs.c
        condition = sa.and_(runs.state == S.FAILED.value, runs.claim_count < max_attempts)
        query = sa.select(
            runs.export, runs.business_date, runs.timezone, sa.func.count().label("keys"),
            sa.func.sum(runs.fencing_token).label("tokens"), sa.func.max(runs.fencing_token).label("newest"),
        ).where(condition)  # fmt: skip
        return self._partitions(query, exports, after, limit, lambda r: f"{r.keys}:{r.tokens}:{r.newest}")

    def restating_partitions(
        self, *, limit: int, after: str | None = None, exports: Sequence[str] = ()
    ) -> list[PartitionWork]:
        """Partitions holding ``completed`` keys with an open restatement request: the run that publishes them. The
        digest names the partition's open requests (their count and lowest and highest ids)."""
        _check_limit(limit)
        runs = export_runs.c
        requests = export_restatements.c
        query = (
            sa.select(
                runs.export, runs.business_date, runs.timezone, sa.func.count().label("keys"),
                sa.func.min(requests.id).label("low"), sa.func.max(requests.id).label("high"),
            )
            .select_from(export_runs.join(export_restatements, requests.logical_key == runs.logical_key))
            .where(_open_requests_first(), requests.closed_at.is_(None))
        )  # fmt: skip
        return self._partitions(
            query, exports, after, limit, lambda r: f"{r.keys}:{r.low}:{r.high}", export_column=requests.export
        )

    def _partitions(
        self, query: sa.Select, exports, after, limit, situation, export_column: sa.Column = export_runs.c.export
    ) -> list[PartitionWork]:
        """The page of partitions ``query`` groups, without those a run is working on (a live lease on one of their
        keys): a rerun or a restatement launched beside it would compete with it for its keys; once it has ended,
        the partition's situation is judged again."""
        runs = export_runs.c
        busy = export_runs.alias("busy")
        working = (
            sa.select(sa.literal(1))
            .where(
                busy.c.export == runs.export, busy.c.business_date == runs.business_date,
                busy.c.timezone == runs.timezone, busy.c.state == S.IN_PROGRESS.value,
                busy.c.lease_expires_at > sa.bindparam("now"),
            )
            .exists()
        )  # fmt: skip
        query = query.where(~working)
        if exports:
            query = query.where(export_column.in_(list(exports)))
        if after is not None:
            export, day, zone = after.split("|", 2)
            position = sa.tuple_(runs.export, runs.business_date, runs.timezone)
            start = sa.tuple_(sa.literal(export), sa.literal(dt.date.fromisoformat(day), sa.Date), sa.literal(zone))
            query = query.where(position > start)
        query = (
            query.group_by(runs.export, runs.business_date, runs.timezone)
            .order_by(runs.export, runs.business_date, runs.timezone)
            .limit(limit)
        )
        with self.ledger.atomic(read_only=True) as conn:
            rows = list(conn.execute(query, {"now": self.ledger.now(conn)}))
        return [
            PartitionWork(
                r.export, r.business_date, r.timezone, int(r.keys),
                hashlib.sha256(situation(r).encode()).hexdigest()[:16],
            )
            for r in rows
        ]  # fmt: skip

    # -- escalations -------------------------------------------------------------------------------------------

    def _escalated(
        self,
        now: dt.datetime,
        stuck_after: dt.timedelta,
        max_attempts: int | None,
        exports: Sequence[str],
        tenants: Sequence[str] = (),
        business_dates: Sequence[dt.date] = (),
        cap: int | None = None,
    ) -> sa.Subquery:
        """The escalated keys' rows, one read per state, each on the index that starts with the state. (One OR of
        the four made SQLite walk every row of the export: 1.3 s a tick at a million rows.) ``cap``: the first
        ``cap`` of each state in key order only (walked on the index of state and key), so that a page or a bounded
        count reads at most ``4 * cap`` rows whatever the backlog."""
        runs = export_runs.c
        horizon = now - stuck_after
        failed = runs.updated_at <= horizon
        if max_attempts is not None and self.ledger.supports(6):
            failed = sa.or_(failed, runs.claim_count >= max_attempts)
        branches = [
            runs.state == S.CONFLICT.value,
            sa.and_(runs.state == S.FAILED.value, failed),
            sa.and_(runs.state == S.REMOTE_UNKNOWN.value, runs.updated_at <= horizon),
            sa.and_(runs.state == S.IN_PROGRESS.value, T.lease_expired_sql(now), runs.updated_at <= horizon),
        ]
        selects = []
        for branch in branches:
            query = self._keys(branch, exports)
            if tenants:
                query = query.where(runs.tenant.in_(list(tenants)))
            if business_dates:
                query = query.where(runs.business_date.in_(list(business_dates)))
            if cap is not None:
                first = query.order_by(runs.logical_key).limit(cap).subquery()
                query = sa.select(*first.c)
            selects.append(query)
        return sa.union_all(*selects).subquery("escalated")

    def _pending_requests(self, now: dt.datetime, stuck_after: dt.timedelta, exports: Sequence[str]) -> sa.Select:
        """Completed keys whose restatement was requested longer than ``stuck_after`` ago and never claimed: the run
        that should publish it was never launched, or failed before it reached the key. Read from the open requests
        (see :func:`_open_requests_first`)."""
        runs = export_runs.c
        requests = export_restatements.c
        query = (
            sa.select(
                *self.ledger.run_columns,
                requests.revision.label("pending_revision"),
                requests.requested_at.label("pending_since"),
            )  # fmt: skip
            .select_from(export_runs.join(export_restatements, requests.logical_key == runs.logical_key))
            .where(requests.closed_at.is_(None), requests.requested_at <= now - stuck_after, _open_requests_first())
        )
        if exports:
            query = query.where(requests.export.in_(list(exports)))
        return query

    def escalated_keys(
        self,
        stuck_after: dt.timedelta,
        *,
        export: str,
        business_dates: Sequence[dt.date],
        max_attempts: int | None = 3,
        limit: int = 100,
    ) -> list[Escalation]:
        """The escalated keys of these business dates of one export (the key rules of :meth:`needs_attention`, no
        refusals, missed partitions or pending requests), at most ``limit``, in key order: what a partition's health
        reports (:mod:`export_ledger.health`)."""
        _check_limit(limit)
        if not business_dates:
            return []
        ledger = self.ledger
        with ledger.atomic(read_only=True) as conn:
            now = ledger.now(conn)
            keys = self._escalated(now, stuck_after, max_attempts, [export], business_dates=business_dates, cap=limit)
            rows = list(conn.execute(sa.select(keys).order_by(keys.c.logical_key).limit(limit)))
        return [self._escalation(ExportRecord.from_row(row), now, max_attempts) for row in rows]

    def needs_attention(
        self,
        stuck_after: dt.timedelta,
        *,
        max_attempts: int | None = 3,
        exports: Sequence[str] = (),
        tenants: Sequence[str] = (),
        limit: int = 100,
        offset: int = 0,
    ) -> list[Escalation]:
        """What waits for a person, a page of at most ``limit`` from position ``offset``: tenants refused by their
        calendar contract, then partitions whose runs failed before they claimed a key, then keys in key order:
        ``conflict``; ``failed`` with their automatic reruns spent; ``failed``, ``remote_unknown`` or abandoned
        ``in_progress`` longer than ``stuck_after``; and restatements requested longer ago and never published.
        Every key asked for that is not completed ends here or completed. ``tenants`` keeps those tenants' (a missed
        partition is kept too: it may concern them). Each source reads at most ``offset + limit`` rows."""
        _check_limit(limit)
        if offset < 0:
            raise ValueError(f"offset must not be negative, got {offset}")
        ledger = self.ledger
        runs = export_runs.c
        window = offset + limit
        with ledger.atomic(read_only=True) as conn:
            now = ledger.now(conn)
            keys = self._escalated(now, stuck_after, max_attempts, exports, tenants, cap=window)
            pending = self._pending_requests(now, stuck_after, exports)
            if tenants:
                pending = pending.where(runs.tenant.in_(list(tenants)))
            key_rows = list(conn.execute(sa.select(keys).order_by(keys.c.logical_key).limit(window)))
            pending_rows = list(conn.execute(pending.order_by(runs.logical_key).limit(window)))
            missed = self._missed(conn, exports, window)
        found = [self._escalation(ExportRecord.from_row(row), now, max_attempts) for row in key_rows]
        found += [_pending_escalation(row, now) for row in pending_rows]
        found.sort(key=lambda e: e.logical_key)
        first = self._refusals(exports, window, tenants=tenants) + [_missed_escalation(row, now) for row in missed]
        return (first + found[:window])[offset:window]

    def summary(
        self,
        stuck_after: dt.timedelta,
        *,
        max_attempts: int | None = 3,
        exports: Sequence[str] = (),
        listed: bool = True,
        cap: int | None = None,
    ) -> AttentionSummary:
        """Escalations per (export, zone), counted by the database, with the first :data:`LISTED` of each group
        (``listed=False``: counts and digest only, the groups' lists empty); a refused tenant counts in the group of
        the zone its code names. One snapshot (PostgreSQL reads it in one REPEATABLE READ transaction), so the
        listing agrees with the counts.

        ``cap`` bounds what is read (a sensor tick): of each kind of escalated key (a state, a pending request) the
        first ``cap`` in key order are counted and listed, and a summary that reached it says so (``at_least``).
        Below the cap the counts are exact. Beyond it the total is a lower bound, and the digest changes when those
        first keys do (a group whose keys all lie beyond them is not seen: a backlog of that size fails the checks
        of the groups it shows). Without ``cap`` every escalated key is counted (a count that walks the backlog)."""
        ledger = self.ledger
        runs = export_runs.c
        groups: dict[tuple[str, str | None], tuple[int, list[Escalation]]] = {}
        parts: list[str] = []
        reached = False

        def count(group: tuple[str, str | None], keys: int, part: str) -> None:
            total, listed = groups.get(group, (0, []))
            groups[group] = (total + keys, listed)
            parts.append(part)

        def listing(group: tuple[str, str | None]) -> list[Escalation]:
            return groups.setdefault(group, (0, []))[1]

        with ledger.atomic(read_only=True) as conn:
            now = ledger.now(conn)
            escalated = self._escalated(now, stuck_after, max_attempts, exports, cap=cap)
            pending_source = self._pending_requests(now, stuck_after, exports)
            if cap is not None:
                pending_source = pending_source.order_by(runs.logical_key).limit(cap)
            for source in (escalated, pending_source.subquery("pending")):
                # A hold that gives a key back unchanged keeps its updated_at and its claim count (holds are not
                # claims), so the digest changes when the escalated situation does, not on every reconciliation tick.
                rows = source.c
                counted = sa.select(
                    rows.export, rows.timezone, sa.func.count().label("keys"),
                    sa.func.max(rows.updated_at).label("latest"),
                    sa.func.sum(rows.claim_count if self.ledger.supports(6) else rows.fencing_token).label("tokens"),
                    sa.func.max(rows.state).label("state"),
                ).group_by(rows.export, rows.timezone)  # fmt: skip
                for row in conn.execute(counted):
                    count((row.export, row.timezone), int(row.keys),
                          f"{row.export}|{row.timezone}|{row.keys}|{row.latest}|{row.tokens}|{row.state}")  # fmt: skip
            if cap is not None:
                # Reached when a kind of key filled its cap: each of the four states of ``escalated`` (one read
                # each, at most ``cap`` rows), and the pending requests.
                kinds = sa.select(escalated.c.state, sa.func.count().label("keys")).group_by(escalated.c.state)
                pending_count = sa.select(sa.func.count()).select_from(pending_source.subquery())
                reached = any(int(row.keys) >= cap for row in conn.execute(kinds))
                reached = reached or conn.execute(pending_count).scalar_one() >= cap
            for row in ledger.contracts.refusal_counts(conn, exports):
                count((row.export, row.timezone), int(row.refused),
                      f"{row.export}|{row.timezone}|refused|{row.refused}|{row.latest}|{row.times}")  # fmt: skip
            for row in self._missed_counts(conn, exports):
                count((row.export, row.timezone), int(row.partitions),
                      f"{row.export}|{row.timezone}|missed|{row.partitions}|{row.latest}|{row.runs}")  # fmt: skip
            digest = hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()[:16]
            if not groups or not listed:
                return AttentionSummary(sum(count for count, _ in groups.values()), digest, groups, reached)
            ranked = sa.select(escalated).add_columns(
                sa.func.row_number().over(partition_by=(escalated.c.export, escalated.c.timezone),
                                          order_by=escalated.c.logical_key).label("rank")
            ).subquery()  # fmt: skip
            first = sa.select(ranked).where(ranked.c.rank <= LISTED).order_by(ranked.c.logical_key)
            for row in conn.execute(first):
                escalation = self._escalation(ExportRecord.from_row(row), now, max_attempts)
                listing((row.export, row.timezone)).append(escalation)
            pending = self._pending_requests(now, stuck_after, exports)
            for row in conn.execute(pending.order_by(runs.logical_key).limit(LISTED)):
                listed = listing((row.export, row.timezone))
                if len(listed) < LISTED:
                    listed.append(_pending_escalation(row, now))
            for row in self._missed(conn, exports, LISTED):
                listed = listing((row.export, row.timezone))
                if len(listed) < LISTED:
                    listed.append(_missed_escalation(row, now))
        for refusal in self._refusals(exports, LISTED):
            listed = listing((refusal.export, refusal.timezone))
            if len(listed) < LISTED:
                listed.append(refusal)
        return AttentionSummary(sum(count for count, _ in groups.values()), digest, groups, reached)

    # -- partitions whose runs never claimed ------------------------------------------------------------------

    def note_missed(
        self, export: str, timezone: str, business_date: dt.date, *, missing_keys: int, run_id: str, runs: int = 1
    ) -> None:
        """Records that ``run_id``, the last of ``runs`` runs of the partition (``export``, ``timezone``,
        ``business_date``), failed before it claimed ``missing_keys`` of its keys and that its automatic reruns are
        spent: the partition is escalated until a claim of it (:meth:`close_missed_in`). Noting the same run twice
        changes nothing."""
        if missing_keys <= 0:
            raise ValueError(f"a missed partition has keys missing, got {missing_keys}")
        table = export_missed_partitions
        with self.ledger.atomic() as conn:
            now = self.ledger.now(conn)
            where = (table.c.export == export, table.c.timezone == timezone, table.c.business_date == business_date)
            row = conn.execute(sa.select(table).where(*where, table.c.closed_at.is_(None))).first()
            if row is None:
                conn.execute(
                    table.insert().values(
                        export=export, timezone=timezone, business_date=business_date, missing_keys=missing_keys,
                        failed_runs=runs, last_run_id=run_id[:64], first_noted_at=now, last_noted_at=now,
                    )
                )  # fmt: skip
            elif row.last_run_id != run_id[:64]:
                conn.execute(
                    table.update()
                    .where(table.c.id == row.id)
                    .values(
                        missing_keys=missing_keys,
                        failed_runs=table.c.failed_runs + 1,
                        last_run_id=run_id[:64],
                        last_noted_at=now,
                    )  # fmt: skip
                )

    def close_missed_in(self, conn, partitions: set[tuple[str, str, dt.date]], now: dt.datetime) -> None:
        """Inside a claim's transaction: the partitions a run claimed keys of are no longer missed."""
        if not partitions or not self.ledger.supports(6):
            return
        table = export_missed_partitions
        if len(partitions) == 1:  # a claim of one key, or a group of one partition: the statement built once
            ((export, timezone, business_date),) = partitions
            conn.execute(_CLOSE_MISSED_ONE, dict(m_export=export, m_timezone=timezone, m_date=business_date, m_now=now))
            return
        partition = sa.tuple_(table.c.export, table.c.timezone, table.c.business_date)
        # One statement per claim transaction (a group's keys span up to 50 partitions), on the claim's hot path.
        conn.execute(
            table.update().where(table.c.closed_at.is_(None), partition.in_(sorted(partitions))).values(closed_at=now)
        )

    def _missed(self, conn, exports: Sequence[str], limit: int) -> list[sa.Row]:
        if not self.ledger.supports(6):
            return []
        table = export_missed_partitions
        query = sa.select(table).where(table.c.closed_at.is_(None))
        if exports:
            query = query.where(table.c.export.in_(list(exports)))
        return list(conn.execute(query.order_by(table.c.export, table.c.business_date, table.c.timezone).limit(limit)))

    def _missed_counts(self, conn, exports: Sequence[str]) -> list[sa.Row]:
        if not self.ledger.supports(6):
            return []
        table = export_missed_partitions
        return count_open_per_zone(conn, table, ("partitions", "latest", "runs"), table.c.last_noted_at,
                                   table.c.failed_runs, exports)  # fmt: skip

    def _refusals(self, exports: Sequence[str], limit: int, *, tenants: Sequence[str] = ()) -> list[Escalation]:
        found = []
        for row in self.ledger.contracts.refusals(exports=exports, tenants=tenants, limit=limit):
            wanted, recorded = json.loads(row["wanted"]), json.loads(row["recorded"])
            said = "; ".join(changes(recorded, wanted)) or "its recorded text differs"
            renewed = terms_of(recorded) is not None and terms_of(wanted) not in (None, terms_of(recorded))
            command = accept_command(row["export"], wanted, None if renewed else row["tenant"], terms_changed=renewed)
            found.append(
                Escalation(
                    row["export"], row["tenant"], wanted.get("timezone"), None, "refused", row["first_refused_at"],
                    f"contract changed in code ({said}), refused {row['refusals']} time(s); accept it (recorded) "
                    f"with: {command}, or restore the recorded contract in code",
                )
            )  # fmt: skip
        return found

    def _escalation(self, record: ExportRecord, now: dt.datetime, max_attempts: int | None) -> Escalation:
        return Escalation(
            record.export, record.tenant, record.timezone, record.logical_key, record.state.value, record.updated_at,
            attention_reason(record, now, max_attempts), record,
        )  # fmt: skip

    def _keys(self, condition: sa.ColumnElement, exports: Sequence[str]) -> sa.Select:
        query = sa.select(*self.ledger.run_columns).where(condition)
        if exports:
            query = query.where(export_runs.c.export.in_(list(exports)))
        return query


def _open_requests_first() -> sa.ColumnElement:
    """``state = 'completed'`` written so that no index on the state can serve it: a key with an open restatement
    request is then found from the requests (a few), not from the completed keys (all but a few). SQLite's planner,
    without statistics, took the completed keys first: 1.2 s a read at a million rows."""
    return export_runs.c.state.concat("") == S.COMPLETED.value


def attention_reason(record: ExportRecord, now: dt.datetime, max_attempts: int | None) -> str:
    """Why ``record`` waits for a person, and the way out."""
    if record.state is S.CONFLICT:
        return "conflict: the destination holds something else; resolve it (export-ledger resolve)"
    spent = record.claim_count if record.claim_count is not None else record.fencing_token
    if record.state is S.FAILED and max_attempts is not None and spent >= max_attempts:
        return (
            f"failed {spent} time(s): automatic reruns are spent; fix the cause and rerun the partition, or resolve "
            "it (export-ledger resolve; a restatement: export-ledger restate --withdraw)"
        )
    since = now - record.updated_at
    return f"{record.state.value} for {str(since).split('.')[0]}: longer than allowed"


def _pending_escalation(row: sa.Row, now: dt.datetime) -> Escalation:
    record = ExportRecord.from_row(row)
    since = str(now - row.pending_since).split(".")[0]
    return Escalation(
        record.export, record.tenant, record.timezone, record.logical_key, "restating", row.pending_since,
        f"restatement to revision {row.pending_revision} requested {since} ago and not published: materialize the "
        f"partition, or withdraw it (export-ledger restate --withdraw {record.logical_key} --reason ...)",
        record,
    )  # fmt: skip


def _missed_escalation(row: sa.Row, now: dt.datetime) -> Escalation:
    since = str(now - row.first_noted_at).split(".")[0]
    day = row.business_date.isoformat()
    return Escalation(
        row.export, None, row.timezone, None, "never claimed", row.first_noted_at,
        f"{row.failed_runs} run(s) of {day} ({row.timezone}) failed before claiming {row.missing_keys} of its keys, "
        f"the last {row.last_run_id} ({since} since the first): automatic reruns are spent; fix the cause and "
        f"materialize the partition (a claim of it ends this)",
        None, row.business_date,
    )  # fmt: skip


def _check_limit(limit: int) -> None:
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")


__all__ = ["Attention", "AttentionSummary", "Escalation", "PartitionWork", "attention_reason"]
