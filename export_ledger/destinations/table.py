"""A transactional destination: exported rows go into a table of the ledger's own database.

This is the one destination where effect and record truly share a transaction: the rows, a manifest row and the
ledger's ``completed`` record commit together or not at all (SQLite and PostgreSQL). There is no publish step and
no unknown outcome. The manifest row plays the role of ``_manifest.json``; the data's sha256 is that of the CSV
serialization of the rows, so a reader can verify what it reads.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from dataclasses import dataclass

import pyarrow as pa
import sqlalchemy as sa

from export_ledger.destinations.base import (
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    TransactionalDestination,
)
from export_ledger.frames import Manifest, write_table
from export_ledger.ledger.schema import UtcDateTime
from export_ledger.ledger.store import ledger_engine, redact_url

_KINDS = {
    pa.string(): ("string", sa.Text),
    pa.float64(): ("float", sa.Float(precision=53)),
    pa.int64(): ("int", sa.BigInteger),
    pa.timestamp("us", tz="UTC"): ("timestamp", UtcDateTime),
    pa.bool_(): ("bool", sa.Boolean),
}
_ARROW = {sql_kind: arrow for arrow, (sql_kind, _) in _KINDS.items()}


def _manifest_table(name: str, metadata: sa.MetaData | None = None) -> sa.Table:
    if metadata is None:
        return _manifests_of(name)
    return sa.Table(
        f"{name}_manifests",
        metadata,
        sa.Column("export", sa.String(63), primary_key=True),
        sa.Column("tenant", sa.String(63), primary_key=True),
        sa.Column("business_date", sa.String(10), primary_key=True),
        sa.Column("logical_key", sa.String(300), nullable=False, unique=True),
        sa.Column("manifest", sa.Text, nullable=False),
        sa.Column("columns", sa.Text, nullable=False),
    )


@functools.lru_cache(maxsize=256)
def _manifests_of(name: str) -> sa.Table:
    """One Table object per name, so SQLAlchemy compiles each statement once (not on every probe)."""
    return _manifest_table(name, sa.MetaData())


@functools.lru_cache(maxsize=256)
def _rows_of(name: str, columns: tuple[tuple[str, str], ...]) -> sa.Table:
    return _rows_table(name, sa.MetaData(), dict(columns))


def _rows_table(
    name: str, metadata: sa.MetaData, columns: dict[str, str], nullable: set[str] = frozenset()
) -> sa.Table:
    kinds = {kind: sql for kind, sql in _KINDS.values()}
    return sa.Table(
        name,
        metadata,
        sa.Column("logical_key", sa.String(300), primary_key=True),
        sa.Column("row_number", sa.BigInteger, primary_key=True),
        *(sa.Column(column, kinds[kind], nullable=column in nullable) for column, kind in columns.items()),
    )


def _serialize(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    write_table(table, "csv", buffer)
    return buffer.getvalue()


@dataclass(frozen=True)
class SqlTableDestination(TransactionalDestination):
    """Exports as rows of ``table`` (plus ``<table>_manifests``) in the ledger's database.

    Attributes:
        url: The ledger's SQLAlchemy URL: this destination only makes sense inside the ledger's database.
        table: Name of the rows table.
    """

    url: str
    table: str = "exported_invoices"

    pool = "exports-ledger-table"

    def location(self, target: ExportTarget) -> str:
        return f"sql:{self.table_for(target.export)}/{'/'.join(target.parts)}"

    def describe(self) -> str:
        return f"sql:{self.table} in {redact_url(self.url)}"

    def table_for(self, export: str) -> str:
        """The rows table of ``export``: ``table`` itself, or with ``{export}`` replaced by the export's name."""
        return self.table.replace("{export}", export)

    def _engine(self) -> sa.Engine:
        return ledger_engine(self.url)

    def write_in_transaction(self, connection, target: ExportTarget, table: pa.Table, manifest: Manifest) -> Manifest:
        try:
            return self._write(connection, target, table, manifest)
        except sa.exc.SQLAlchemyError as exc:
            # The server's text (PostgreSQL's DETAIL: Failing row contains ...) can quote the row: name the class only.
            orig = getattr(exc, "orig", None) or exc
            raise DestinationError(
                f"cannot write {manifest.logical_key} into {self.table_for(target.export)}: {type(orig).__name__}"
            ) from None

    def _write(self, connection, target: ExportTarget, table: pa.Table, manifest: Manifest) -> Manifest:
        columns = {}
        for field in table.schema:
            if field.type not in _KINDS:
                where = self.table_for(target.export)
                raise DestinationError(f"column {field.name!r} of type {field.type} cannot be stored in {where}")
            columns[field.name] = _KINDS[field.type][0]
        metadata = sa.MetaData()
        name = self.table_for(target.export)
        inspector = sa.inspect(connection)
        if inspector.has_table(name):
            existing = {column["name"] for column in inspector.get_columns(name)}
            missing = [column for column in columns if column not in existing]
            if missing:
                raise DestinationError(
                    f"table {name} has no column named {', '.join(missing)} (it was made for other columns: "
                    f"{', '.join(sorted(existing - {'logical_key', 'row_number'}))}); nothing was written"
                )
        nullable = {field.name for field in table.schema if field.nullable}
        rows_table = _rows_table(name, metadata, columns, nullable)
        manifests = _manifest_table(name, metadata)
        metadata.create_all(connection, checkfirst=True)
        existing = connection.execute(
            sa.select(manifests.c.logical_key).where(
                manifests.c.export == target.export,
                manifests.c.tenant == target.tenant,
                manifests.c.business_date == target.business_date,
            )
        ).first()
        if existing is not None:
            raise DestinationError(f"{self.location(target)} already holds {existing.logical_key}")
        sha256 = hashlib.sha256(_serialize(table)).hexdigest()
        complete = Manifest(**{**manifest.__dict__, "sha256": sha256, "row_count": table.num_rows})
        records = table.to_pylist()
        if records:
            connection.execute(
                rows_table.insert(),
                [{"logical_key": manifest.logical_key, "row_number": i, **row} for i, row in enumerate(records)],
            )
        connection.execute(
            manifests.insert().values(
                export=target.export,
                tenant=target.tenant,
                business_date=target.business_date,
                logical_key=manifest.logical_key,
                manifest=complete.to_json().decode("utf-8"),
                columns=json.dumps(columns),
            )
        )
        return complete

    def discard_target(self, target: ExportTarget) -> list[str]:
        """Deletes the key's rows and manifest row, in one transaction; returns what was deleted."""
        name = self.table_for(target.export)
        manifests = _manifest_table(name)
        row = self._manifest_row(target)
        if row is None:
            return []
        with self._engine().begin() as conn:
            rows_table = sa.Table(name, sa.MetaData(), sa.Column("logical_key", sa.String(300)))
            deleted = conn.execute(rows_table.delete().where(rows_table.c.logical_key == row.logical_key)).rowcount
            conn.execute(manifests.delete().where(manifests.c.logical_key == row.logical_key))
        return [f"{deleted} row(s) of {row.logical_key}", f"{name}_manifests row"]

    def _manifest_row(self, target: ExportTarget):
        manifests = _manifest_table(self.table_for(target.export))
        query = sa.select(manifests).where(
            manifests.c.export == target.export,
            manifests.c.tenant == target.tenant,
            manifests.c.business_date == target.business_date,
        )
        try:
            with self._engine().connect().execution_options(ledger_read_only=True) as conn:
                return conn.execute(query).first()
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            text = str(exc.orig).lower()
            if "no such table" in text or "does not exist" in text:
                return None  # nothing was ever exported to this table
            raise DestinationUnreachable(f"cannot read {self.describe()}: {type(exc.orig).__name__}") from None

    def probe(self, target: ExportTarget) -> Manifest | None:
        row = self._manifest_row(target)
        return None if row is None else Manifest.from_json(row.manifest.encode("utf-8"), self.location(target))

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        row = self._manifest_row(target)
        if row is None:
            raise DestinationError(f"{self.location(target)} holds no export")
        columns = json.loads(row.columns)
        rows_table = _rows_of(self.table_for(target.export), tuple(columns.items()))
        query = (
            sa.select(*(rows_table.c[name] for name in columns))
            .where(rows_table.c.logical_key == manifest.logical_key)
            .order_by(rows_table.c.row_number)
        )
        with self._engine().connect().execution_options(ledger_read_only=True) as conn:
            records = [dict(r._mapping) for r in conn.execute(query)]
        schema = pa.schema([(name, _ARROW[kind]) for name, kind in columns.items()])
        return _serialize(pa.Table.from_pylist(records, schema=schema))
