"""A warehouse destination: a key's rows and its completion marker commit in one transaction of a database that is not
the ledger's (``warehouse:<table>``, the database's SQLAlchemy URL in ``EXPORTS_WAREHOUSE_URL``).

The key belongs where the durable effect lives. For table ``T`` (``{export}`` in the spec is replaced by the export's
name) the destination keeps, in the warehouse database:

* ``T``: the rows readers read. Each row carries its key (``_export_key``) and its row number in the export
  (``_export_row``); a plain ``SELECT`` of ``T`` sees every key's current revision, and nothing else;
* ``T_markers``: one row per key, the completion marker: the key's fence (the highest fencing token that fenced or
  committed it), its current revision, that revision's place (``r<revision>-t<token>``), attempt, row count, sha256
  (of the rows' CSV serialization in the export's column order, as :meth:`WarehouseDestination.read_data` gives them
  back) and manifest;
* ``T_history``: every committed revision's marker, kept when a restatement supersedes it;
* ``T_staged``: rows staged by an attempt, where readers do not look, until its commit moves them.

**Fence**: a party raises the key's fence with ``UPDATE T_markers SET fence = :token WHERE ... AND fence <= :token``
(the marker is inserted at revision 0 first when the key has none). **Commit** is one transaction of the warehouse:
the same guarded UPDATE, also requiring ``revision = :superseded``, moves the marker to the new revision; then the key's
rows are replaced (``DELETE`` of the key's rows, ``INSERT ... SELECT`` of the attempt's staged rows) and the marker is
copied to ``T_history``. An UPDATE that matched nothing (a higher fence, or another revision) changes nothing: the
transaction is rolled back and the marker read to tell a fenced party from a moved pointer and from this very commit
having landed before. So a fenced party's rows never become visible, and readers see revision N or N + 1 of a key,
never both and never neither.

What it needs from the database: transactions, a primary key, and a row-level guarded UPDATE (PostgreSQL, MariaDB or
MySQL with InnoDB, DuckDB; any SQLAlchemy database with those). Loading is bulk: multi-row INSERTs of
:data:`INSERT_ROWS` rows (PostgreSQL's driver and pymysql batch an ``executemany`` into multi-row statements), or
DuckDB's Arrow scan; a stream is staged batch by batch, so memory stays bounded by one batch.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
from dataclasses import dataclass, field, replace

import sqlalchemy as sa

from export_ledger.destinations.base import (
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    Fenced,
    PointerMoved,
    PublishOutcomeUnknown,
    Verdict,
    Verification,
    judge,
    place_name,
    reading_only,
)
from export_ledger.destinations.pointer import Pointer, PointerDestination, StagedExport
from export_ledger.destinations.registry import Scheme, Setting
from export_ledger.destinations.table import _Discarded, _serialize
from export_ledger.destinations.warehouse_tables import (
    _KEY_LENGTH,
    _MADE,
    KEY_COLUMN,
    PLACE_COLUMN,
    ROW_COLUMN,
    TOKEN_COLUMN,
    _arrow,
    _engine_for,
    _kinds,
    _rows_of,
    _rows_table,
    _Tables,
    _tables,
    dispose_engines,
    warehouse_locator,
)
from export_ledger.errors import ConfigurationError, ManifestError
from export_ledger.frames import Manifest, TableStream, write_rows
from export_ledger.lazy import lazy_module
from export_ledger.ledger.urls import redact_url

pa = lazy_module("pyarrow", globals(), "pa")

#: Rows per INSERT: the Python values of at most this many rows are in memory, whatever the size of the key.
INSERT_ROWS = 5_000
#: The longest name of a table (MariaDB's limit is 64, PostgreSQL's 63), with the longest suffix (``_markers``).
NAME_BYTES = 63
_SUFFIXES = ("_markers", "_history", "_staged")
_TABLE_RE = re.compile(r"[a-z_][a-z0-9_]*")
#: Rounds of a commit lost to a concurrent one (DuckDB refuses a conflicting transaction rather than waiting).
_ROUNDS = 8


@dataclass(frozen=True)
class WarehouseStaged(StagedExport):
    """A revision staged in ``T_staged`` at its place: invisible to readers of ``T``."""

    columns: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WarehouseDestination(PointerDestination):
    """Exports as rows of a table in a database of their own, each key's revision committed with its completion
    marker in one transaction of that database (see the module docstring).

    Attributes:
        table: The rows table's name; ``{export}`` is replaced by the export's name.
        warehouse_url: The warehouse database's SQLAlchemy URL (a secret: it may carry a password), from
            ``EXPORTS_WAREHOUSE_URL``; never shown (:meth:`describe` masks its password).
    """

    table: str
    warehouse_url: str | None = field(default=None, repr=False)

    pool = "exports-warehouse"

    # -- spec ----------------------------------------------------------------------------------------------------

    @staticmethod
    def check_spec(spec: str) -> str | None:
        table = spec.removeprefix("warehouse:")
        stand_in = table.replace("{export}", "x")
        if not _TABLE_RE.fullmatch(stand_in) or len(stand_in) + len("_markers") > NAME_BYTES:
            return (
                f"{table!r} is not a table name (lower-case letters, digits and _, at most "
                f"{NAME_BYTES - len('_markers')} characters; {{export}} is replaced by the export's name)"
            )
        return None

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> WarehouseDestination:
        if not settings.get("warehouse_url"):
            raise ConfigurationError(
                f"destination {spec!r} needs its database's URL in EXPORTS_WAREHOUSE_URL (a secret, passed by name)"
            )
        warehouse_locator(settings["warehouse_url"])  # a URL SQLAlchemy would misread is refused here, without echo
        return cls(table=spec.removeprefix("warehouse:"), warehouse_url=settings["warehouse_url"])

    def spec(self) -> tuple[str, dict]:
        return f"warehouse:{self.table}", SCHEME.settings_of(self)

    def describe(self) -> str:
        return f"warehouse:{self.table} in {redact_url(self.warehouse_url or '')}"

    def root_of(self, export: str) -> str:
        return f"warehouse:{self.table_for(export)}"

    def dataset(self, export: str) -> tuple[str, str]:
        from export_ledger.lineage import database_dataset  # the database as OpenLineage names one, no credentials

        return database_dataset(self.warehouse_url).namespace, self.table_for(export)

    def table_for(self, export: str) -> str:
        return self.table.replace("{export}", export)

    def identity(self, export: str) -> dict:
        """The kind, the root and *which* database (:func:`warehouse_locator`: no user, password or query), as the
        export's contract records them: a worker whose ``EXPORTS_WAREHOUSE_URL`` names another database is refused
        at its claim, like an S3 destination at another endpoint."""
        found = {"kind": self.kind, "root": self.root_of(export)}
        if self.warehouse_url:
            found["warehouse_url"] = warehouse_locator(self.warehouse_url)
        return found

    def location(self, target: ExportTarget) -> str:
        if target.place is None:
            raise DestinationError(f"{'/'.join(target.parts)}: revision {target.revision} has no place yet")
        return f"warehouse:{self.table_for(target.export)}#{'/'.join(target.parts)}/{target.place}"

    # -- the database ----------------------------------------------------------------------------------------------

    def _engine(self) -> sa.Engine:
        return _engine_for(self.warehouse_url)

    def _names(self, export: str) -> _Tables:
        name = self.table_for(export)
        if not _TABLE_RE.fullmatch(name) or len(name) + len("_markers") > NAME_BYTES:
            raise DestinationError(f"export {export!r} makes the table name {name!r}, which is not one; nothing done")
        return _tables(name)

    def _unreachable(self, exc: Exception, what: str) -> DestinationUnreachable:
        """The driver's error by class only: its text can quote rows or the URL."""
        orig = getattr(exc, "orig", None) or exc
        return DestinationUnreachable(f"{self.describe()}: cannot {what}: {type(orig).__name__}")

    def _ensure(self, export: str) -> _Tables:
        """The export's marker and history tables, made when absent (never within a reader's read)."""
        tables = self._names(export)
        if not reading_only() and tables.name not in _MADE.get(self.warehouse_url, set()):
            try:
                with self._engine().begin() as conn:
                    tables.metadata.create_all(conn, checkfirst=True)
            except sa.exc.DBAPIError as exc:
                # Two parties creating at once: one of them wins. A table still absent is one this user may not make
                # (no CREATE right): said so, as a refusal (nothing was written), never as an unknown outcome.
                absent = self._absent(tables, exc)
                if absent:
                    raise DestinationError(
                        f"{self.describe()}: cannot create the table{'s' if len(absent) > 1 else ''} "
                        f"{', '.join(absent)} ({type(getattr(exc, 'orig', exc)).__name__}): create them, or let the "
                        "warehouse's user create tables; nothing was written"
                    ) from None
            _MADE.setdefault(self.warehouse_url, set()).add(tables.name)
        return tables

    def _absent(self, tables: _Tables, exc: Exception) -> list[str]:
        try:
            with self._engine().connect() as conn:
                inspector = sa.inspect(conn)
                return [table.name for table in tables.metadata.sorted_tables if not inspector.has_table(table.name)]
        except sa.exc.DBAPIError:
            raise self._unreachable(exc, f"make the tables of {tables.name}") from None

    def _where(self, table: sa.Table, target: ExportTarget):
        return (
            table.c.export == target.export,
            table.c.tenant == target.tenant,
            table.c.business_date == target.business_date,
        )

    def _marker(self, conn, target: ExportTarget):
        markers = self._names(target.export).markers
        return conn.execute(sa.select(markers).where(*self._where(markers, target))).first()

    def _pointer_of(self, row) -> Pointer:
        if row is None:
            return Pointer.nothing()
        if not row.revision:
            return Pointer(row.fence, 0, None, logical_key=row.logical_key)
        return Pointer(row.fence, row.revision, row.place, row.sha256, row.row_count, "warehouse", row.logical_key)

    def _missing(self, exc: sa.exc.DBAPIError) -> bool:
        text = str(getattr(exc, "orig", exc)).lower()
        return "does not exist" in text or "doesn't exist" in text or "no such table" in text

    def pointer(self, target: ExportTarget) -> Pointer:
        self._names(target.export)
        try:
            with self._engine().connect() as conn:
                return self._pointer_of(self._marker(conn, target))
        except sa.exc.DBAPIError as exc:
            if self._missing(exc):
                return Pointer.nothing()
            raise self._unreachable(exc, f"read the marker of {'/'.join(target.parts)}") from None

    def key_at(self, target: ExportTarget) -> str | None:
        pointer = self.pointer(target)
        return pointer.logical_key if pointer.revision else None

    # -- fence -----------------------------------------------------------------------------------------------------

    def _fenced(self, logical_key: str, fence: int, token: int) -> Fenced:
        return Fenced(
            f"{self.describe()}: {logical_key} is fenced at token {fence}, above this party's {token}: a newer party "
            "holds the key, and nothing of this one is made visible",
            fence=fence,
        )

    def fence(self, target: ExportTarget, token: int, *, logical_key: str) -> Pointer:
        """Raises the marker's fence to ``token`` with a guarded UPDATE (the marker made at revision 0 first when
        the key has none)."""
        tables = self._ensure(target.export)
        markers = tables.markers
        for _ in range(_ROUNDS):
            try:
                with self._engine().begin() as conn:
                    row = self._marker(conn, target)
                    if row is None:
                        conn.execute(
                            markers.insert().values(
                                export=target.export, tenant=target.tenant, business_date=target.business_date,
                                logical_key=logical_key, fence=token, revision=0,
                            )
                        )  # fmt: skip
                    else:
                        conn.execute(
                            markers.update()
                            .where(*self._where(markers, target), markers.c.fence <= token)
                            .values(fence=token)
                        )
                    row = self._marker(conn, target)
            except sa.exc.IntegrityError:
                continue  # another party made the marker meanwhile: fence it as it is
            except sa.exc.DBAPIError as exc:
                if _conflict(exc):
                    continue
                raise PublishOutcomeUnknown(f"{self.describe()}: the fence of {logical_key} failed "
                                            f"({type(exc.orig).__name__})") from None  # fmt: skip
            if row.fence > token:
                raise self._fenced(logical_key, row.fence, token)
            return self._pointer_of(row)
        raise DestinationError(f"{self.describe()} kept changing while {logical_key} was being fenced")

    # -- staging -----------------------------------------------------------------------------------------------

    def _columns(self, schema: pa.Schema, where: str) -> tuple[tuple[str, str], ...]:
        columns = []
        for column in schema:
            if column.name in (KEY_COLUMN, ROW_COLUMN, PLACE_COLUMN, TOKEN_COLUMN):
                raise DestinationError(f"column {column.name!r} is reserved by {self.describe()}; nothing was written")
            if column.type not in _kinds():
                raise DestinationError(f"column {column.name!r} of type {column.type} cannot be stored in {where}")
            columns.append((column.name, _kinds()[column.type][0]))
        return tuple(columns)

    def _check_columns(self, conn, name: str, columns: tuple[tuple[str, str], ...]) -> None:
        inspector = sa.inspect(conn)
        if not inspector.has_table(name):
            return
        # The columns as a query sees them (DuckDB's dialect cannot reflect them: its catalog is not PostgreSQL's).
        found = conn.execute(sa.select(sa.text("*")).select_from(sa.table(name)).limit(0)).keys()
        existing = set(found) - {KEY_COLUMN, ROW_COLUMN}
        wanted = {column for column, _ in columns}
        if existing != wanted:
            raise DestinationError(
                f"table {name} has the columns {', '.join(sorted(existing))}, the export has "
                f"{', '.join(sorted(wanted))}; nothing was written (a table's columns change only by its owner)"
            )

    def stage(
        self, target: ExportTarget, token: int, table: pa.Table | TableStream, file_format: str, manifest: Manifest
    ) -> WarehouseStaged:
        """Writes the rows into ``T_staged`` at this party's place in one transaction (on DuckDB, one per batch), batch
        by batch (a stream is consumed as it arrives, hashed on its way in); a batch that fails validation leaves no
        row of the place behind."""
        tables = self._ensure(target.export)
        if len(manifest.logical_key) > _KEY_LENGTH:
            raise DestinationError(f"{manifest.logical_key!r} is longer than {_KEY_LENGTH} characters; nothing written")
        columns = self._columns(table.schema, tables.name)
        place = place_name(target.revision, token)
        metadata = sa.MetaData()
        rows = _rows_table(tables.name, metadata, columns, staged=False)
        staged = _rows_table(tables.name, metadata, columns, staged=True)
        stream = table if isinstance(table, TableStream) else TableStream(table.schema, iter([table]))
        key = manifest.logical_key
        at_place = (staged.c[KEY_COLUMN] == key, staged.c[PLACE_COLUMN] == place)
        try:
            with self._engine().connect() as conn:
                try:
                    self._check_columns(conn, rows.name, columns)
                    self._check_columns(conn, staged.name, (*columns, (PLACE_COLUMN, ""), (TOKEN_COLUMN, "")))
                    metadata.create_all(conn, checkfirst=True)
                    conn.execute(staged.delete().where(*at_place))
                    loaded = TableStream(stream.schema, self._loaded(conn, staged, key, place, token, stream))
                    sha256, row_count = write_rows(loaded, "csv", _Discarded())
                    conn.commit()
                except BaseException:
                    conn.rollback()
                    if conn.dialect.name == "duckdb":  # its batches were committed one by one (see _loaded)
                        conn.execute(staged.delete().where(*at_place))
                        conn.commit()
                    raise
        except sa.exc.SQLAlchemyError as exc:
            raise DestinationError(
                f"{self.describe()}: cannot stage {manifest.logical_key}: {type(getattr(exc, 'orig', exc)).__name__}"
            ) from None
        complete = replace(manifest, sha256=sha256, row_count=row_count, data_file="warehouse")
        return WarehouseStaged(target.at_place(place), complete, columns)

    def _loaded(self, conn, staged: sa.Table, key: str, place: str, token: int, stream: TableStream):
        """The stream's tables, each loaded into ``staged`` in bulk before it is passed on (to the hash)."""
        row_number = 0
        duck = conn.dialect.name == "duckdb"
        for table in stream:
            for start in range(0, table.num_rows, INSERT_ROWS):
                part = table.slice(start, INSERT_ROWS)
                if duck:
                    self._load_arrow(conn, staged, part, key, place, token, row_number)
                    # DuckDB keeps every Arrow batch it scanned until the transaction ends: each batch is committed
                    # on its own (staged rows are invisible to readers; a failed stage deletes its place's rows).
                    conn.commit()
                else:
                    extra = {KEY_COLUMN: key, PLACE_COLUMN: place, TOKEN_COLUMN: token}
                    records = part.to_pylist()
                    conn.execute(
                        staged.insert(),
                        [{**extra, ROW_COLUMN: row_number + i, **row} for i, row in enumerate(records)],
                    )
                row_number += part.num_rows
            yield table

    def _load_arrow(self, conn, staged: sa.Table, part: pa.Table, key, place, token, first: int) -> None:
        """DuckDB's bulk path: the batch is scanned as an Arrow table (timestamps as naive UTC, as stored)."""
        size = part.num_rows
        arrays = [
            pa.array([key] * size, pa.string()),
            pa.array([place] * size, pa.string()),
            pa.array([token] * size, pa.int64()),
            pa.array(range(first, first + size), pa.int64()),
        ]
        names = [KEY_COLUMN, PLACE_COLUMN, TOKEN_COLUMN, ROW_COLUMN]
        for column in part.schema:
            data = part[column.name]
            arrays.append(data.cast(pa.timestamp("us")) if pa.types.is_timestamp(column.type) else data)
            names.append(column.name)
        batch = pa.Table.from_arrays(arrays, names=names)
        raw = conn.connection.driver_connection
        view = f"export_ledger_batch_{threading.get_ident()}"
        # Names only, each quoted as the dialect quotes an identifier (a '"' in an export's column name is doubled,
        # so a name is never read as SQL); no value is in the statement.
        quote = conn.dialect.identifier_preparer.quote_identifier
        quoted = ", ".join(quote(name) for name in names)
        raw.register(view, batch)
        try:
            raw.execute(f"INSERT INTO {quote(staged.name)} ({quoted}) SELECT {quoted} FROM {view}")
        finally:
            raw.unregister(view)

    def sweep(self, target: ExportTarget, token: int, pointer: Pointer) -> int:
        """Removes what parties with lower tokens staged for the key (fenced: never committed)."""
        tables = self._names(target.export)
        staged = sa.Table(
            f"{tables.name}_staged", sa.MetaData(), sa.Column(KEY_COLUMN, sa.String),
            sa.Column(PLACE_COLUMN, sa.String), sa.Column(TOKEN_COLUMN, sa.BigInteger),
        )  # fmt: skip
        key = pointer.logical_key
        if key is None:
            return 0
        condition = (staged.c[KEY_COLUMN] == key, staged.c[TOKEN_COLUMN] < token)
        try:
            with self._engine().begin() as conn:
                places = conn.execute(sa.select(staged.c[PLACE_COLUMN]).where(*condition).distinct()).scalars().all()
                if places:
                    conn.execute(staged.delete().where(*condition))
        except sa.exc.DBAPIError as exc:
            if self._missing(exc):
                return 0
            raise self._unreachable(exc, f"sweep {key}") from None
        return len(places)

    def unstage(self, staged: StagedExport) -> None:
        self._unstage(staged.target, staged.manifest.logical_key)

    def _unstage(self, target: ExportTarget, key: str) -> None:
        table = sa.Table(
            f"{self.table_for(target.export)}_staged", sa.MetaData(), sa.Column(KEY_COLUMN, sa.String),
            sa.Column(PLACE_COLUMN, sa.String),
        )  # fmt: skip
        with self._engine().begin() as conn:
            conn.execute(table.delete().where(table.c[KEY_COLUMN] == key, table.c[PLACE_COLUMN] == target.place))

    # -- commit ------------------------------------------------------------------------------------------------

    def commit(self, staged: StagedExport, token: int, *, superseded: int) -> Pointer:
        """One transaction of the warehouse: the guarded UPDATE of the marker (``fence <= token`` and ``revision =
        superseded``), the key's rows replaced by the staged ones, the marker copied to the history. Nothing matched:
        rolled back, and the marker read to say why (or that this commit already landed)."""
        target, manifest = staged.target, staged.manifest
        key = manifest.logical_key
        tables = self._names(target.export)
        rows = _rows_of(tables.name, staged.columns, False)
        staging = _rows_of(tables.name, staged.columns, True)
        markers, history = tables.markers, tables.history
        names = [KEY_COLUMN, ROW_COLUMN, *(name for name, _ in staged.columns)]
        values = dict(
            logical_key=key, revision=target.revision, place=target.place, fencing_token=token,
            attempt_id=manifest.attempt_id, row_count=manifest.row_count, sha256=manifest.sha256,
            manifest=manifest.to_json().decode("utf-8"), columns=json.dumps(dict(staged.columns)),
        )  # fmt: skip
        for _ in range(_ROUNDS):
            try:
                with self._engine().begin() as conn:
                    when = _now()
                    before = self._marker(conn, target)
                    if before is not None and (before.revision, before.place) == (target.revision, target.place):
                        raise _NotMoved(before)  # an earlier send of this very commit landed: nothing to do again
                    conn.execute(
                        markers.update()
                        .where(*self._where(markers, target), markers.c.fence <= token,
                               markers.c.revision == superseded)
                        .values(fence=token, committed_at=when, **values)
                    )  # fmt: skip
                    row = self._marker(conn, target)
                    if row is None and superseded == 0:
                        # A first attempt (token 1) fences nothing: its commit makes the key's marker. A marker made
                        # meanwhile by another party fails the primary key, and the commit is judged again.
                        conn.execute(
                            markers.insert().values(
                                export=target.export, tenant=target.tenant, business_date=target.business_date,
                                fence=token, committed_at=when, **values,
                            )
                        )  # fmt: skip
                        row = self._marker(conn, target)
                    if row is None or (row.revision, row.place, row.fence) != (target.revision, target.place, token):
                        raise _NotMoved(row)
                    conn.execute(rows.delete().where(rows.c[KEY_COLUMN] == key))
                    moved = conn.execute(
                        rows.insert().from_select(
                            names,
                            sa.select(*(staging.c[name] for name in names)).where(
                                staging.c[KEY_COLUMN] == key, staging.c[PLACE_COLUMN] == target.place
                            ),
                        )
                    ).rowcount
                    if moved not in (-1, None) and moved != manifest.row_count:
                        raise _Incomplete(moved)
                    conn.execute(
                        staging.delete().where(staging.c[KEY_COLUMN] == key, staging.c[PLACE_COLUMN] == target.place)
                    )
                    conn.execute(
                        history.insert().values(
                            export=target.export, tenant=target.tenant, business_date=target.business_date,
                            committed_at=when, **values,
                        )
                    )  # fmt: skip
            except _NotMoved as refused:
                return self._judge_refused(target, manifest, token, superseded, refused.row)
            except _Incomplete as short:
                raise DestinationError(
                    f"{self.describe()}: {short.moved} staged rows of {key} revision {target.revision} were found, "
                    f"not {manifest.row_count}; nothing of it was made visible"
                ) from None
            except sa.exc.IntegrityError:
                continue  # the key's marker was made by another party meanwhile: judged again on it
            except sa.exc.DBAPIError as exc:
                if _conflict(exc):
                    continue
                if exc.connection_invalidated or isinstance(exc, sa.exc.OperationalError):
                    raise PublishOutcomeUnknown(
                        f"{self.describe()}: the commit of {key} revision {target.revision} failed "
                        f"({type(exc.orig).__name__})", sha256=manifest.sha256, location=self.location(target),
                    ) from None  # fmt: skip
                raise DestinationError(
                    f"{self.describe()}: the commit of {key} revision {target.revision} was refused "
                    f"({type(exc.orig).__name__}); nothing of it was made visible"
                ) from None
            return Pointer(token, target.revision, target.place, manifest.sha256, manifest.row_count, "warehouse", key)
        raise DestinationError(f"{self.describe()} kept changing while {key} revision {target.revision} was committed")

    def _judge_refused(self, target, manifest, token, superseded, row) -> Pointer:
        current = self._pointer_of(row)
        if current.revision == target.revision and current.place == target.place:
            return current  # an earlier send of this very commit landed
        if current.fence > token:
            # Never committable now: its staged rows go (a newer party's sweep may have run before they landed).
            try:
                self._unstage(target, manifest.logical_key)
            except sa.exc.DBAPIError:
                pass  # the key's next party sweeps them
            raise self._fenced(manifest.logical_key, current.fence, token)
        raise PointerMoved(
            f"{self.describe()}: {manifest.logical_key} is at revision {current.revision}, not revision {superseded} "
            f"which revision {target.revision} supersedes; it is not moved",
            location=self.location(target.at_place(current.place or ".")),
        )

    def discard_key(self, target: ExportTarget, token: int, *, logical_key: str, recorded: ExportTarget | None
                    ) -> list[str]:  # fmt: skip
        """Refused: a committed warehouse revision replaced the rows before it, which are not kept."""
        raise DestinationError(
            f"{self.describe()}: a committed warehouse revision is not discarded by export-ledger (the rows it "
            f"replaced are gone); restate {logical_key} instead"
        )

    # -- reading back ------------------------------------------------------------------------------------------

    def _record_of(self, target: ExportTarget, revision: int):
        """The marker of ``revision`` of the key (current, else from the history), or None."""
        tables = self._names(target.export)
        try:
            with self._engine().connect() as conn:
                row = self._marker(conn, target)
                if row is not None and row.revision == revision:
                    return row, True
                history = tables.history
                old = conn.execute(
                    sa.select(history).where(*self._where(history, target), history.c.revision == revision)
                ).first()
                return old, False
        except sa.exc.DBAPIError as exc:
            if self._missing(exc):
                return None, False
            raise self._unreachable(exc, f"read the marker of {'/'.join(target.parts)}") from None

    def _manifest(self, row, where: str) -> Manifest | None:
        try:
            return Manifest.from_json(row.manifest.encode("utf-8"), where)
        except (ManifestError, AttributeError):
            return None

    def rows(self, target: ExportTarget, logical_key: str, columns: dict[str, str]) -> pa.Table:
        """The key's current rows in export order, without the key columns."""
        name = self.table_for(target.export)
        table = _rows_of(name, tuple(columns.items()), False)
        query = (
            sa.select(*(table.c[column] for column in columns))
            .where(table.c[KEY_COLUMN] == logical_key)
            .order_by(table.c[ROW_COLUMN])
        )
        try:
            with self._engine().connect() as conn:
                records = [dict(r._mapping) for r in conn.execute(query)]
        except sa.exc.DBAPIError as exc:
            raise self._unreachable(exc, f"read the rows of {logical_key}") from None
        schema = pa.schema([(column, _arrow()[kind]) for column, kind in columns.items()])
        return pa.Table.from_pylist(records, schema=schema)

    def _rows_sha256(self, target: ExportTarget, row) -> str:
        """The sha256 of the key's current rows as :meth:`read_data` gives them, read batch by batch (a server-side
        cursor of :data:`INSERT_ROWS` rows): verifying a large key holds one batch, not the key."""
        columns = json.loads(row.columns)
        table = _rows_of(self.table_for(target.export), tuple(columns.items()), False)
        query = (
            sa.select(*(table.c[column] for column in columns))
            .where(table.c[KEY_COLUMN] == row.logical_key)
            .order_by(table.c[ROW_COLUMN])
        )
        schema = pa.schema([(column, _arrow()[kind]) for column, kind in columns.items()])

        def batches():
            with self._engine().connect() as conn:
                result = conn.execution_options(yield_per=INSERT_ROWS).execute(query)
                for part in result.partitions():
                    yield pa.Table.from_pylist([dict(r._mapping) for r in part], schema=schema)

        try:
            return write_rows(TableStream(schema, batches()), "csv", _Discarded())[0]
        except sa.exc.DBAPIError as exc:
            raise self._unreachable(exc, f"read the rows of {row.logical_key}") from None

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        row, current = self._record_of(target, target.revision)
        if row is None:
            raise DestinationError(f"{self.describe()} holds no revision {target.revision} of {manifest.logical_key}")
        if not current:
            raise DestinationError(
                f"{self.describe()}: revision {target.revision} of {manifest.logical_key} was superseded and its rows "
                "replaced (a warehouse keeps the superseded revision's marker, not its rows)"
            )
        return _serialize(self.rows(target, row.logical_key, json.loads(row.columns)))

    def data_format(self, file_format: str) -> str:
        return "csv"  # read_data serializes the key's rows as CSV, whatever the export's file format

    # -- verdicts ------------------------------------------------------------------------------------------------

    def verify(
        self,
        target: ExportTarget,
        *,
        logical_key: str,
        superseded: int,
        expected_sha256: str | None = None,
        pointer: Pointer | None = None,
    ) -> Verification:
        """The marker judged like a pointer: the commit carried the rows, so a marker at a revision is that revision
        published (its rows are re-hashed to be sure)."""
        pointer = pointer or self.pointer(target)
        where = f"warehouse:{self.table_for(target.export)}#{'/'.join(target.parts)}"
        manifest = data_sha256 = None
        if pointer.revision not in (0, superseded) and pointer.place is not None:
            where = self.location(target.at_place(pointer.place))
            if pointer.revision == target.revision:
                row, _ = self._record_of(target, pointer.revision)
                manifest = self._manifest(row, where) if row is not None else None
                if manifest is not None and row is not None:
                    data_sha256 = self._rows_sha256(target, row)
        verification = judge(
            logical_key=logical_key, revision=target.revision, superseded=superseded,
            pointer_revision=pointer.revision, manifest=manifest, data_sha256=data_sha256, pointer_sha256=None,
            where=where, expected_sha256=expected_sha256,
        )  # fmt: skip
        location = verification.location if verification.verdict is Verdict.PUBLISHED else where
        return replace(verification, fence=pointer.fence, location=location)

    def verify_recorded(self, target: ExportTarget, *, logical_key: str, sha256: str) -> Verification:
        where = self.location(target)
        row, current = self._record_of(target, target.revision)
        if row is None or row.place != target.place:
            return Verification(Verdict.CONFLICT, f"{where} holds no export", location=where)
        if not current:
            return Verification(
                Verdict.CONFLICT, f"{where}: revision {target.revision} was superseded and its rows replaced",
                location=where,
            )  # fmt: skip
        manifest = self._manifest(row, where)
        data_sha256 = self._rows_sha256(target, row) if manifest else None
        return judge(
            logical_key=logical_key, revision=target.revision, superseded=-1, pointer_revision=target.revision,
            manifest=manifest, data_sha256=data_sha256, pointer_sha256=None, where=where, expected_sha256=sha256,
        )  # fmt: skip


class _NotMoved(Exception):
    """The guarded UPDATE matched no row: the transaction rolls back and the marker read says why."""

    def __init__(self, row) -> None:
        self.row = row


class _Incomplete(Exception):
    def __init__(self, moved: int) -> None:
        self.moved = moved


def _conflict(exc: sa.exc.DBAPIError) -> bool:
    """A transaction lost to a concurrent one (DuckDB's write-write conflict, a deadlock or serialization failure):
    nothing of it happened, and it is tried again."""
    text = str(getattr(exc, "orig", exc)).lower()
    return any(
        word in text
        for word in ("conflict", "deadlock", "could not serialize", "lock wait timeout", "try restarting transaction")
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


SCHEME = Scheme(
    "warehouse:",
    "WarehouseDestination",
    "warehouse:<table>",
    settings=(
        Setting("warehouse_url", "EXPORTS_WAREHOUSE_URL", secret=True, doc="The warehouse database's SQLAlchemy URL"),
    ),
)

__all__ = ["WarehouseDestination", "dispose_engines", "warehouse_locator"]
