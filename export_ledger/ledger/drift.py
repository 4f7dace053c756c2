"""The ledger's side of drift detection: stored source fingerprints and the ``export_drift`` records.

Which keys are stale is decided in :mod:`export_ledger.drift`; this mixin only reads fingerprints and records, and
writes findings, each batch in one transaction. Everything here needs schema version 4: on an older ledger opened
for reading, reads return nothing (no key can be stale before fingerprints existed) and writes are refused.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from export_ledger.ledger.errors import LedgerError
from export_ledger.ledger.records import ExportRecord
from export_ledger.ledger.schema import RUN_COLUMNS, ExportState, export_drift, export_runs
from export_ledger.ledger.store import schema_version

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


class DriftMixin:
    """Fingerprints and drift records of :class:`~export_ledger.ledger.ExportLedger`."""

    def has_drift_schema(self) -> bool:
        """Whether the ledger's schema has fingerprints and drift records (version 4 or later)."""
        with self.atomic(read_only=True) as conn:
            return schema_version(conn) >= DRIFT_SCHEMA_VERSION

    def fingerprints(self, logical_keys: Sequence[str]) -> dict[str, str | None]:
        """The stored source fingerprint of each key (None: none recorded: a repaired or older key)."""
        if not logical_keys or not self.has_drift_schema():
            return {key: None for key in logical_keys}
        query = sa.select(export_runs.c.logical_key, export_runs.c.source_fingerprint).where(
            export_runs.c.logical_key.in_(list(logical_keys))
        )
        with self.atomic(read_only=True) as conn:
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
        query = sa.select(*RUN_COLUMNS).where(runs.state == ExportState.COMPLETED.value, horizon)
        if after is not None:
            query = query.where(runs.logical_key > after)
        with self.atomic(read_only=True) as conn:
            rows = conn.execute(query.order_by(runs.logical_key).limit(limit))
            return [ExportRecord.from_row(row) for row in rows]

    def open_drift(self, *, export: str | None = None, logical_keys: Sequence[str] = ()) -> list[DriftRecord]:
        """Open drift records (stale keys), in logical key order; none on a ledger older than version 4."""
        if not self.has_drift_schema():
            return []
        query = sa.select(export_drift).where(export_drift.c.cleared_at.is_(None))
        if export is not None:
            query = query.where(export_drift.c.export == export)
        if logical_keys:
            query = query.where(export_drift.c.logical_key.in_(list(logical_keys)))
        with self.atomic(read_only=True) as conn:
            return [DriftRecord.from_row(row) for row in conn.execute(query.order_by(export_drift.c.logical_key))]

    def record_drift(self, stale: Sequence[DriftFinding], matching: Sequence[str]) -> DriftChanges:
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
            except sa.exc.IntegrityError:
                continue
        raise LedgerError("could not record drift: another pass kept recording the same keys")

    def _record_drift_once(self, stale: Sequence[DriftFinding], matching: Sequence[str]) -> DriftChanges:
        now = self.now()
        keys = [f.record.logical_key for f in stale] + list(matching)
        opened: list[str] = []
        cleared: list[str] = []
        with self.atomic() as conn:
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
            if close:
                conn.execute(
                    export_drift.update()
                    .where(export_drift.c.id.in_(close), export_drift.c.cleared_at.is_(None))
                    .values(cleared_at=now)
                )
            if inserts:
                conn.execute(export_drift.insert(), inserts)
        return DriftChanges(opened=opened, cleared=cleared)
