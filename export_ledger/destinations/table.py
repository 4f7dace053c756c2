"""A transactional destination: exported rows go into a table of the ledger's own database.

This is the one destination where effect and record truly share a transaction: the rows, a manifest row and the
ledger's ``completed`` record commit together or not at all (SQLite and PostgreSQL). There is no publish step and
no unknown outcome. The manifest row plays the role of ``_manifest.json``; the data's sha256 is that of the CSV
serialization of the rows, so a reader can verify what it reads.

Restatements: the ``<table>_manifests`` row (one per key) is the key's current pointer, holding the current
revision's manifest. Revision N >= 2 writes its rows under a row key of its own (``<logical key>#revision=<N>``),
beside the rows of the revisions before it, and every revision's manifest is kept in ``<table>_revisions`` (made at
a table's first restatement; the revision being superseded is copied there first). The pointer row then moves with an
UPDATE guarded by the manifest it held, so a lost update matches no row and is refused. All of it happens in the
ledger's completion transaction. Tables of keys never restated stay exactly as 0.3.0 wrote them.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
from dataclasses import dataclass

import sqlalchemy as sa

from export_ledger.destinations.base import (
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    PointerMoved,
    TransactionalDestination,
    Verdict,
    Verification,
    judge,
    reading_only,
)
from export_ledger.destinations.registry import Scheme
from export_ledger.errors import ManifestError
from export_ledger.frames import Manifest, TableStream, write_rows, write_table
from export_ledger.lazy import lazy_module
from export_ledger.ledger.schema import UtcDateTime
from export_ledger.ledger.schema import metadata as ledger_metadata
from export_ledger.ledger.store import ledger_engine, redact_url

pa = lazy_module("pyarrow", globals(), "pa")


@functools.cache
def _kinds() -> dict:
    """Each Arrow type a rows table takes: its column kind and SQL type (pyarrow is imported on first use)."""
    return {
        pa.string(): ("string", sa.Text),
        pa.float64(): ("float", sa.Float(precision=53)),
        pa.int64(): ("int", sa.BigInteger),
        pa.timestamp("us", tz="UTC"): ("timestamp", UtcDateTime),
        pa.bool_(): ("bool", sa.Boolean),
    }


#: PostgreSQL's longest name, in bytes (NAMEDATALEN - 1); a longer one fails SQLAlchemy's DDL (``IdentifierError``).
NAME_BYTES = 63
#: A rows table's longest name: its ``<table>_manifests`` and ``<table>_revisions`` (10 more) must fit
#: :data:`NAME_BYTES`. SQLite has no limit of its own; the same one applies there, so a ledger's tables are the same
#: on both databases (a ledger moves from one to the other).
TABLE_NAME_BYTES = NAME_BYTES - len("_manifests")
_TABLE_RE = re.compile(rf"[a-z_][a-z0-9_]{{0,{TABLE_NAME_BYTES - 1}}}")
# The ledger's own tables, and the manifest tables a ledger-table destination would add beside them.
_LEDGER_TABLES = {*ledger_metadata.tables, *(f"{name}_manifests" for name in ledger_metadata.tables)}
#: Rows per INSERT (one ``executemany``): the rows go in as they arrive, so the Python values of at most this many
#: rows are in memory, whatever the size of the partition (issue #21).
INSERT_ROWS = 10_000


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


def _revision_table(name: str, metadata: sa.MetaData | None = None) -> sa.Table:
    if metadata is None:
        return _revisions_of(name)
    return sa.Table(
        f"{name}_revisions",
        metadata,
        sa.Column("export", sa.String(63), primary_key=True),
        sa.Column("tenant", sa.String(63), primary_key=True),
        sa.Column("business_date", sa.String(10), primary_key=True),
        sa.Column("revision", sa.Integer, primary_key=True),
        sa.Column("row_key", sa.String(_ROW_KEY_LENGTH), nullable=False, unique=True),
        sa.Column("manifest", sa.Text, nullable=False),
        sa.Column("columns", sa.Text, nullable=False),
    )


@functools.lru_cache(maxsize=256)
def _revisions_of(name: str) -> sa.Table:
    return _revision_table(name, sa.MetaData())


#: The rows table's key column (``logical_key``): a revision's row key must fit it.
_ROW_KEY_LENGTH = 300


def _row_key(logical_key: str, revision: int) -> str:
    """The rows' key of one revision: the logical key for revision 1 (as 0.3.0 wrote it), ``<key>#revision=<N>``
    for a restatement's revision N."""
    return logical_key if revision == 1 else f"{logical_key}#revision={revision}"


def _missing_table(exc: sa.exc.DBAPIError) -> bool:
    text = str(exc.orig).lower()
    return "no such table" in text or "does not exist" in text


@functools.lru_cache(maxsize=256)
def _rows_of(name: str, columns: tuple[tuple[str, str], ...]) -> sa.Table:
    return _rows_table(name, sa.MetaData(), dict(columns))


def _rows_table(
    name: str, metadata: sa.MetaData, columns: dict[str, str], nullable: set[str] = frozenset()
) -> sa.Table:
    kinds = {kind: sql for kind, sql in _kinds().values()}
    return sa.Table(
        name,
        metadata,
        sa.Column("logical_key", sa.String(_ROW_KEY_LENGTH), primary_key=True),
        sa.Column("row_number", sa.BigInteger, primary_key=True),
        *(sa.Column(column, kinds[kind], nullable=column in nullable) for column, kind in columns.items()),
    )


def _serialize(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    write_table(table, "csv", buffer)
    return buffer.getvalue()


def _inserted(connection, insert: sa.Insert, row_key: str, stream: TableStream):
    """The stream's tables, each inserted (in slices of :data:`INSERT_ROWS` rows) before it is passed on."""
    row_number = 0
    for table in stream:
        for start in range(0, table.num_rows, INSERT_ROWS):
            records = table.slice(start, INSERT_ROWS).to_pylist()
            connection.execute(
                insert, [{"logical_key": row_key, "row_number": row_number + i, **row} for i, row in enumerate(records)]
            )
            row_number += len(records)
        yield table


class _Discarded:
    """A sink that keeps nothing: only the hash of what is written is wanted."""

    def write(self, data) -> int:
        return memoryview(data).nbytes


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

    def dataset(self, export: str) -> tuple[str, str]:
        from export_ledger.lineage import database_dataset  # the database as OpenLineage names one, no credentials

        return database_dataset(self.url).namespace, self.table_for(export)

    def location(self, target: ExportTarget) -> str:
        parts = (*target.parts, f"revision={target.revision}") if target.revision > 1 else target.parts
        return f"sql:{self.table_for(target.export)}/{'/'.join(parts)}"

    @staticmethod
    def check_spec(spec: str) -> str | None:
        table = spec.removeprefix("ledger-table:")
        if not _TABLE_RE.fullmatch(table.replace("{export}", "x")) or table in _LEDGER_TABLES:
            return (
                f"{table!r} is not a valid table name, or is one of the ledger's own tables "
                f"({', '.join(sorted(ledger_metadata.tables))})"
            )
        return None

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> SqlTableDestination:
        return cls(url=ledger_url, table=spec.removeprefix("ledger-table:"))

    def spec(self) -> tuple[str, dict]:
        """The spec and settings that build this destination again."""
        return f"ledger-table:{self.table}", {}

    def describe(self) -> str:
        return f"sql:{self.table} in {redact_url(self.url)}"

    def table_for(self, export: str) -> str:
        """The rows table of ``export``: ``table`` itself, or with ``{export}`` replaced by the export's name."""
        return self.table.replace("{export}", export)

    def tables_for(self, export: str) -> dict[str, str]:
        """The tables of ``export``, by role: its rows table, ``<table>_manifests`` and ``<table>_revisions``."""
        name = self.table_for(export)
        return {"rows": name, "manifests": f"{name}_manifests", "revisions": f"{name}_revisions"}

    @staticmethod
    def check_export(spec: str, export: str) -> str | None:
        """Why ``spec`` cannot hold ``export``'s rows (None: it can): the table name it makes for that export, with
        ``{export}`` replaced by the export's real name, must leave its companion tables' names within PostgreSQL's
        limit (:data:`TABLE_NAME_BYTES`). :meth:`check_spec` can only check a stand-in name."""
        table = spec.removeprefix("ledger-table:")
        name = table.replace("{export}", export)
        if name in _LEDGER_TABLES:
            return f"export {export!r} would be stored in the ledger's own table {name!r}"
        size = len(name.encode("utf-8"))
        if size <= TABLE_NAME_BYTES:
            return None
        return (
            f"export {export!r} would be stored in the table {name!r} ({size} bytes) and {name + '_manifests'!r} "
            f"({size + len('_manifests')} bytes), over the limit of {NAME_BYTES} bytes of a PostgreSQL name; a "
            f"ledger table's name may have at most {TABLE_NAME_BYTES} (on SQLite too, so that a ledger's tables are "
            "the same on both): shorten the table's or the export's name"
        )

    def _engine(self) -> sa.Engine:
        if reading_only():
            # A consumer's read (read_current): a database that holds no ledger, or a SQLite file that does not
            # exist, is refused, never created; an older schema reads as it is.
            return ledger_engine(self.url, read_only=True, create=False)
        return ledger_engine(self.url)

    def write_in_transaction(
        self, connection, target: ExportTarget, rows: pa.Table | TableStream, manifest: Manifest
    ) -> Manifest:
        """Writes the rows (a whole table, or a stream of validated tables consumed here) with the ledger's
        connection, in INSERTs of at most :data:`INSERT_ROWS` rows, and the manifest row; returns the manifest with
        the rows' count and sha256.

        A stream is validated while it is read: a bad batch raises :class:`~export_ledger.errors.FrameError` from
        here, and the completion transaction rolls back every row inserted before it.
        """
        try:
            return self._write(connection, target, rows, manifest)
        except sa.exc.SQLAlchemyError as exc:
            # The server's text (PostgreSQL's DETAIL: Failing row contains ...) can quote the row: name the class only.
            orig = getattr(exc, "orig", None) or exc
            raise DestinationError(
                f"cannot write {manifest.logical_key} into {self.table_for(target.export)}: {type(orig).__name__}"
            ) from None

    def _write(self, connection, target: ExportTarget, rows: pa.Table | TableStream, manifest: Manifest) -> Manifest:
        problem = self.check_export(self.table, target.export)
        if problem:
            raise DestinationError(f"{problem}; nothing was written")
        columns = {}
        for field in rows.schema:
            if field.type not in _kinds():
                where = self.table_for(target.export)
                raise DestinationError(f"column {field.name!r} of type {field.type} cannot be stored in {where}")
            columns[field.name] = _kinds()[field.type][0]
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
        if manifest.revision != target.revision:
            raise DestinationError(
                f"the manifest of {manifest.logical_key} is revision {manifest.revision}, not the target's revision "
                f"{target.revision}; nothing was written"
            )
        row_key = _row_key(manifest.logical_key, target.revision)
        if len(row_key) > _ROW_KEY_LENGTH:
            raise DestinationError(
                f"revision {target.revision} of {manifest.logical_key} would be stored under a row key of "
                f"{len(row_key)} characters; {name}.logical_key holds at most {_ROW_KEY_LENGTH}; nothing was written"
            )
        nullable = {field.name for field in rows.schema if field.nullable}
        rows_table = _rows_table(name, metadata, columns, nullable)
        manifests = _manifest_table(name, metadata)
        if target.revision >= 2:
            _revision_table(name, metadata)  # made at the table's first restatement, never before
        metadata.create_all(connection, checkfirst=True)
        pointer = connection.execute(
            sa.select(manifests.c.logical_key, manifests.c.manifest, manifests.c.columns).where(
                manifests.c.export == target.export,
                manifests.c.tenant == target.tenant,
                manifests.c.business_date == target.business_date,
            )
        ).first()
        if target.revision == 1 and pointer is not None:
            raise DestinationError(f"{self.location(target)} already holds {pointer.logical_key}")
        stream = rows if isinstance(rows, TableStream) else TableStream(rows.schema, iter([rows]))
        inserted = TableStream(stream.schema, _inserted(connection, rows_table.insert(), row_key, stream))
        # The sha256 is that of the CSV serialization (what read_data serializes), hashed as the rows go in: the
        # streamed CSV writer writes the bytes write_table writes for the same rows.
        sha256, row_count = write_rows(inserted, "csv", _Discarded())
        complete = Manifest(**{**manifest.__dict__, "sha256": sha256, "row_count": row_count})
        if target.revision >= 2:
            self._record_revision(connection, name, target, pointer, complete, columns)
        if target.revision == 1:
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

    def _record_revision(self, connection, name: str, target: ExportTarget, pointer, manifest: Manifest, columns):
        """A restatement's revision: keeps the superseded revision's manifest in ``<table>_revisions`` (copied there
        at the key's first restatement), adds this one's, and moves the pointer row from the superseded revision to
        this one with an UPDATE guarded by the manifest it holds: a pointer moved meanwhile matches no row."""
        where = self.location(target)
        if pointer is None:
            raise PointerMoved(f"{where}: the key has no current revision to supersede; nothing was written")
        held = Manifest.from_json(pointer.manifest.encode("utf-8"), self.location(target.at_revision(1)))
        if held.revision != manifest.supersedes_revision:
            raise PointerMoved(
                f"{where}: the key's current revision is {held.revision}, not revision {manifest.supersedes_revision} "
                f"which revision {target.revision} supersedes; nothing was written"
            )
        revisions = _revision_table(name)
        kept = set(
            connection.execute(
                sa.select(revisions.c.revision).where(
                    revisions.c.export == target.export,
                    revisions.c.tenant == target.tenant,
                    revisions.c.business_date == target.business_date,
                    revisions.c.revision.in_([held.revision, target.revision]),
                )
            ).scalars()
        )
        if target.revision in kept:
            raise DestinationError(f"{where} already holds revision {target.revision} of {manifest.logical_key}")
        values = {"export": target.export, "tenant": target.tenant, "business_date": target.business_date}
        if held.revision not in kept:
            connection.execute(
                revisions.insert().values(
                    **values,
                    revision=held.revision,
                    row_key=_row_key(held.logical_key, held.revision),
                    manifest=pointer.manifest,
                    columns=pointer.columns,
                )
            )
        text = manifest.to_json().decode("utf-8")
        connection.execute(
            revisions.insert().values(
                **values,
                revision=target.revision,
                row_key=_row_key(manifest.logical_key, target.revision),
                manifest=text,
                columns=json.dumps(columns),
            )
        )
        manifests = _manifest_table(name)
        moved = connection.execute(
            manifests.update()
            .where(
                manifests.c.export == target.export,
                manifests.c.tenant == target.tenant,
                manifests.c.business_date == target.business_date,
                manifests.c.manifest == pointer.manifest,
            )
            .values(manifest=text, columns=json.dumps(columns))
        ).rowcount
        if moved != 1:
            raise PointerMoved(
                f"{where}: the key's current pointer changed while revision {target.revision} was written"
            )

    def discard_target(self, target: ExportTarget) -> list[str]:
        """Deletes the key's rows and manifest row, in one transaction; returns what was deleted.

        Only for a key never restated (its revision 1, the one its manifest row holds): a restated key's revisions
        are committed with the ledger's record of them, so there is nothing unrecorded to discard, and deleting one
        would break the key's history.

        Raises:
            DestinationError: the key has been restated; nothing is deleted.
        """
        name = self.table_for(target.export)
        manifests = _manifest_table(name)
        row = self._manifest_row(target)
        if row is None:
            return []
        if target.revision != 1 or self._revision_row(target.at_revision(1)) is not None:
            raise DestinationError(
                f"{self.location(target)} belongs to a restated key (see {name}_revisions): its revisions are kept, "
                "not discarded"
            )
        with self._engine().begin() as conn:
            rows_table = sa.Table(name, sa.MetaData(), sa.Column("logical_key", sa.String(_ROW_KEY_LENGTH)))
            deleted = conn.execute(rows_table.delete().where(rows_table.c.logical_key == row.logical_key)).rowcount
            conn.execute(manifests.delete().where(manifests.c.logical_key == row.logical_key))
        return [f"{deleted} row(s) of {row.logical_key}", f"{name}_manifests row"]

    def _read_row(self, table: sa.Table, *conditions):
        """The one row of ``table`` matching ``conditions``, None when there is none or no such table."""
        try:
            with self._engine().connect().execution_options(ledger_read_only=True) as conn:
                return conn.execute(sa.select(table).where(*conditions)).first()
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:
            if _missing_table(exc):
                return None  # nothing was ever exported (or restated) to this table
            raise DestinationUnreachable(f"cannot read {self.describe()}: {type(exc.orig).__name__}") from None

    def _manifest_row(self, target: ExportTarget):
        """The key's pointer row: the current revision's manifest and columns."""
        manifests = _manifest_table(self.table_for(target.export))
        return self._read_row(
            manifests,
            manifests.c.export == target.export,
            manifests.c.tenant == target.tenant,
            manifests.c.business_date == target.business_date,
        )

    def _revision_row(self, target: ExportTarget):
        """The target revision's row of ``<table>_revisions`` (a restated key's), None when there is none."""
        revisions = _revision_table(self.table_for(target.export))
        return self._read_row(
            revisions,
            revisions.c.export == target.export,
            revisions.c.tenant == target.tenant,
            revisions.c.business_date == target.business_date,
            revisions.c.revision == target.revision,
        )

    def _published(self, target: ExportTarget):
        """The target revision's manifest text and columns: from the pointer row while it is current (every
        revision of a key never restated), else from ``<table>_revisions``; None when it was never written."""
        row = self._manifest_row(target)
        if row is None:
            return None
        manifest = self._manifest_of(row, target)
        if manifest is not None and manifest.revision == target.revision:
            return row
        return self._revision_row(target)

    def _manifest_of(self, row, target: ExportTarget) -> Manifest | None:
        try:
            return Manifest.from_json(row.manifest.encode("utf-8"), self.location(target))
        except ManifestError:
            return None

    def key_at(self, target: ExportTarget) -> str | None:
        row = self._manifest_row(target)
        return None if row is None else row.logical_key

    def current_revision(self, target: ExportTarget) -> int:
        row = self._manifest_row(target)
        if row is None:
            return 0
        manifest = self._manifest_of(row, target)
        return manifest.revision if manifest is not None else -1

    def verify(
        self, target: ExportTarget, *, logical_key: str, superseded: int, expected_sha256: str | None = None
    ) -> Verification:
        """The pointer row's revision judged like a publishing destination's pointer. Rows and their record commit
        together, so a revision published and not recorded cannot exist: only a conflict or nothing."""
        row = self._manifest_row(target)
        manifest = self._manifest_of(row, target) if row is not None else None
        revision = 0 if row is None else (manifest.revision if manifest is not None else -1)
        data_sha256 = None
        if manifest is not None and revision == target.revision:
            data_sha256 = hashlib.sha256(self.read_data(target, manifest)).hexdigest()
        return judge(
            logical_key=logical_key, revision=target.revision, superseded=superseded, pointer_revision=revision,
            manifest=manifest, data_sha256=data_sha256, pointer_sha256=None, where=self.location(target),
            expected_sha256=expected_sha256,
        )  # fmt: skip

    def verify_recorded(self, target: ExportTarget, *, logical_key: str, sha256: str) -> Verification:
        row = self._published(target)
        where = self.location(target)
        if row is None:
            return Verification(Verdict.CONFLICT, f"{where} holds no export")
        manifest = self._manifest_of(row, target)
        data_sha256 = hashlib.sha256(self.read_data(target, manifest)).hexdigest() if manifest else None
        return judge(
            logical_key=logical_key, revision=target.revision, superseded=-1, pointer_revision=target.revision,
            manifest=manifest, data_sha256=data_sha256, pointer_sha256=None, where=where, expected_sha256=sha256,
        )  # fmt: skip

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        row = self._published(target)
        if row is None:
            raise DestinationError(f"{self.location(target)} holds no export")
        columns = json.loads(row.columns)
        rows_table = _rows_of(self.table_for(target.export), tuple(columns.items()))
        query = (
            sa.select(*(rows_table.c[name] for name in columns))
            .where(rows_table.c.logical_key == _row_key(manifest.logical_key, target.revision))
            .order_by(rows_table.c.row_number)
        )
        with self._engine().connect().execution_options(ledger_read_only=True) as conn:
            records = [dict(r._mapping) for r in conn.execute(query)]
        arrow = {sql_kind: arrow for arrow, (sql_kind, _) in _kinds().items()}
        schema = pa.schema([(name, arrow[kind]) for name, kind in columns.items()])
        return _serialize(pa.Table.from_pylist(records, schema=schema))


SCHEME = Scheme("ledger-table:", "SqlTableDestination", "ledger-table:<table>")
