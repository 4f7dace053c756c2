"""The ledger's side of drift detection: stored source fingerprints and the ``export_drift`` records.

Which keys are stale is decided in :mod:`export_ledger.drift`; this class only reads fingerprints and records, and
writes findings, each batch in one transaction. A record is opened by an INSERT that the partial unique index keeps to
one open record per key, and closed only by the declared :data:`~export_ledger.ledger.transitions.CLEAR_DRIFT`.
Everything here needs schema version 4: on an older ledger opened for reading, reads return nothing (no key can be
stale before fingerprints existed) and writes are refused.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from export_ledger.ledger import transitions as T
from export_ledger.ledger.errors import LedgerError
from export_ledger.ledger.records import ExportRecord
from export_ledger.ledger.schema import ExportState, export_drift, export_runs

#: The first schema version with fingerprints and drift records.
DRIFT_SCHEMA_VERSION = 4


@dataclass(frozen=True)
class DriftRecord:
    """One row of ``export_drift``: a key found stale, with counts (never values); open while ``cleared_at`` is None."""

    id: int
    logical_key: str
    export: str
    tenant: str
    business_date: dt.date
    detected_at: dt.datetime
    rows_added: int
    rows_removed: int
    rows_changed: int | None
    source_fingerprint: str
    cleared_at: dt.datetime | None

    @classmethod
    def from_row(cls, row: sa.Row) -> DriftRecord:
        return cls(**dict(row._mapping))

    @property
    def changes(self) -> str:
        """``+added -removed ~changed`` (``~?`` when changes are unknown)."""
        changed = "?" if self.rows_changed is None else self.rows_changed
        return f"+{self.rows_added} -{self.rows_removed} ~{changed}"


@dataclass(frozen=True)
class DriftFinding:
    """A completed key whose source no longer matches its published export, to be recorded stale."""

    record: ExportRecord
    rows_added: int
    rows_removed: int
    rows_changed: int | None  # None: unknown (no version column)
    source_fingerprint: str


@dataclass(frozen=True)
class DriftChanges:
    """What :meth:`DriftMixin.record_drift` changed: keys newly stale (or stale differently), keys cleared."""

    opened: list[str]
    cleared: list[str]


class _Raced(Exception):
    """A drift record this pass meant to close was closed by another pass first."""


class Drift:
    """Fingerprints and drift records of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def has_drift_schema(self) -> bool:
        """Whether the ledger's schema has fingerprints and drift records (version 4 or later)."""
        return self.ledger.supports(DRIFT_SCHEMA_VERSION)

    def fingerprints(self, logical_keys: Sequence[str]) -> dict[str, str | None]:
        """The stored source fingerprint of each key (None: none recorded: a repaired or older key)."""
        if not logical_keys or not self.has_drift_schema():
            return {key: None for key in logical_keys}
        query = sa.select(export_runs.c.logical_key, export_runs.c.source_fingerprint).where(
            export_runs.c.logical_key.in_(list(logical_keys))
        )
        with self.ledger.atomic(read_only=True) as conn:
            found = {key: fingerprint for key, fingerprint in conn.execute(query)}
        return {key: found.get(key) for key in logical_keys}

    def completed_since(
        self, date_from: Mapping[str, dt.date], *, limit: int, after: str | None = None
    ) -> list[ExportRecord]:
        """Completed keys of the exports named in ``date_from`` whose business date is on or after the export's date
        there, in logical key order after ``after``: one page of a drift sweep."""
        if not date_from:
            return []
        runs = export_runs.c
        horizon = sa.or_(*(sa.and_(runs.export == name, runs.business_date >= day) for name, day in date_from.items()))
        query = sa.select(*self.ledger.run_columns).where(runs.state == ExportState.COMPLETED.value, horizon)
        if after is not None:
            query = query.where(runs.logical_key > after)
        with self.ledger.atomic(read_only=True) as conn:
            rows = conn.execute(query.order_by(runs.logical_key).limit(limit))
            return [ExportRecord.from_row(row) for row in rows]

    def completed_before(self, date_to: Mapping[str, dt.date]) -> tuple[int, dt.date | None]:
        """How many completed keys of the exports named in ``date_to`` have a business date before the export's
        date there, and the oldest of those dates: the keys a drift sweep's lookback leaves out (one aggregate read)."""
        if not date_to:
            return 0, None
        runs = export_runs.c
        before = sa.or_(*(sa.and_(runs.export == name, runs.business_date < day) for name, day in date_to.items()))
        query = sa.select(sa.func.count(), sa.func.min(runs.business_date)).where(
            runs.state == ExportState.COMPLETED.value, before
        )
        with self.ledger.atomic(read_only=True) as conn:
            count, oldest = conn.execute(query).one()
        if isinstance(oldest, str):  # SQLite hands an aggregate of a date column back as its text
            oldest = dt.date.fromisoformat(oldest)
        return int(count), oldest

    def open_records(
        self,
        *,
        export: str | None = None,
        exports: Sequence[str] = (),
        tenants: Sequence[str] = (),
        logical_keys: Sequence[str] = (),
        limit: int | None = None,
        after: str | None = None,
        date_from: dt.date | None = None,
        date_to: dt.date | None = None,
    ) -> list[DriftRecord]:
        """Open drift records (stale keys), in logical key order; ``limit`` and ``after`` (a logical key) page. None
        on a ledger older than version 4."""
        if not self.has_drift_schema():
            return []
        query = self._open_query(export, exports, tenants, logical_keys)
        if date_from is not None:
            query = query.where(export_drift.c.business_date >= date_from)
        if date_to is not None:
            query = query.where(export_drift.c.business_date <= date_to)
        if after is not None:
            query = query.where(export_drift.c.logical_key > after)
        query = query.order_by(export_drift.c.logical_key)
        if limit is not None:
            query = query.limit(limit)
        with self.ledger.atomic(read_only=True) as conn:
            return [DriftRecord.from_row(row) for row in conn.execute(query)]

    def open_count(self, *, export: str | None = None, tenants: Sequence[str] = ()) -> tuple[int, int, int]:
        """How many keys are stale, and their rows added and removed: counted by the database."""
        if not self.has_drift_schema():
            return 0, 0, 0
        query = sa.select(
            sa.func.count(), sa.func.coalesce(sa.func.sum(export_drift.c.rows_added), 0),
            sa.func.coalesce(sa.func.sum(export_drift.c.rows_removed), 0),
        ).where(export_drift.c.cleared_at.is_(None))  # fmt: skip
        if export is not None:
            query = query.where(export_drift.c.export == export)
        if tenants:
            query = query.where(export_drift.c.tenant.in_(list(tenants)))
        with self.ledger.atomic(read_only=True) as conn:
            count, added, removed = conn.execute(query).one()
        return int(count), int(added), int(removed)

    def open_summary(self, *, exports: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
        """Per export, how many keys are stale and the newest open record's id (one grouped read)."""
        if not self.has_drift_schema():
            return {}
        query = sa.select(export_drift.c.export, sa.func.count(), sa.func.max(export_drift.c.id)).where(
            export_drift.c.cleared_at.is_(None)
        )
        if exports:
            query = query.where(export_drift.c.export.in_(list(exports)))
        with self.ledger.atomic(read_only=True) as conn:
            rows = conn.execute(query.group_by(export_drift.c.export)).all()
        return {export: (int(count), int(newest)) for export, count, newest in rows}

    @staticmethod
    def _open_query(export, exports, tenants, logical_keys) -> sa.Select:
        query = sa.select(export_drift).where(export_drift.c.cleared_at.is_(None))
        if export is not None:
            query = query.where(export_drift.c.export == export)
        if exports:
            query = query.where(export_drift.c.export.in_(list(exports)))
        if tenants:
            query = query.where(export_drift.c.tenant.in_(list(tenants)))
        if logical_keys:
            query = query.where(export_drift.c.logical_key.in_(list(logical_keys)))
        return query

    def record(self, stale: Sequence[DriftFinding], matching: Sequence[str]) -> DriftChanges:
        """Records one drift pass in one transaction: opens a record for each newly stale key, replaces an open
        record whose counts or source changed (closed, and a new one opened: records are never rewritten), and clears
        the open record of each key in ``matching`` (its source matches its export again).

        A concurrent pass opening the same key collides on the one-open-record index: the transaction rolls back
        (nothing of it was acted upon) and is tried once more against what the other pass recorded.
        """
        if not self.has_drift_schema():
            raise LedgerError("the ledger's schema predates drift records (version 4); run `export-ledger upgrade`")
        for _ in range(2):
            try:
                return self._record_drift_once(stale, matching)
            except (sa.exc.IntegrityError, _Raced):
                continue
        raise LedgerError("could not record drift: another pass kept recording the same keys")

    def _record_drift_once(self, stale: Sequence[DriftFinding], matching: Sequence[str]) -> DriftChanges:
        keys = [f.record.logical_key for f in stale] + list(matching)
        opened: list[str] = []
        cleared: list[str] = []
        with self.ledger.atomic() as conn:
            now = self.ledger.now(conn)
            current = {
                row.logical_key: row
                for row in conn.execute(
                    sa.select(export_drift).where(
                        export_drift.c.cleared_at.is_(None), export_drift.c.logical_key.in_(keys)
                    )
                )
            }
            close = []
            inserts = []
            for finding in stale:
                key = finding.record.logical_key
                existing = current.get(key)
                counts = (finding.rows_added, finding.rows_removed, finding.rows_changed, finding.source_fingerprint)
                if existing is not None:
                    if counts == (
                        existing.rows_added,
                        existing.rows_removed,
                        existing.rows_changed,
                        existing.source_fingerprint,
                    ):
                        continue  # the same drift seen again: nothing new to record
                    close.append(existing.id)
                inserts.append(
                    dict(
                        logical_key=key,
                        export=finding.record.export,
                        tenant=finding.record.tenant,
                        business_date=finding.record.business_date,
                        detected_at=now,
                        rows_added=finding.rows_added,
                        rows_removed=finding.rows_removed,
                        rows_changed=finding.rows_changed,
                        source_fingerprint=finding.source_fingerprint,
                        cleared_at=None,
                    )
                )
                opened.append(key)
            for key in matching:
                if key in current:
                    close.append(current[key].id)
                    cleared.append(key)
            closing = sorted(set(close))
            if len(closing) != T.close_many(conn, T.CLEAR_DRIFT, closing, now):
                raise _Raced()  # another pass closed one first: rolled back and decided again by record()
            if inserts:
                conn.execute(export_drift.insert(), inserts)
        return DriftChanges(opened=opened, cleared=cleared)
