"""What one export is made of: a validated frame, a data file hashed while it is written, and a manifest.

Plain Python (pandas and pyarrow); nothing here knows about Dagster.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from export_ledger.calendar import ExportWindow, utc_iso
from export_ledger.errors import FrameError, ManifestError
from export_ledger.fingerprint import Fingerprint, id_hashes
from export_ledger.lazy import lazy_module

np = lazy_module("numpy", globals(), "np")
pd = lazy_module("pandas", globals(), "pd")
pa = lazy_module("pyarrow", globals(), "pa")
pc = lazy_module("pyarrow.compute", globals(), "pc")
pa_csv = lazy_module("pyarrow.csv", globals(), "pa_csv")
pq = lazy_module("pyarrow.parquet", globals(), "pq")

FILE_FORMATS = {"csv": "data.csv", "parquet": "data.parquet"}
MANIFEST_NAME = "_manifest.json"
MANIFEST_VERSION = 1
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
#: A stream's id digests held in memory before they are spilled to disk (:class:`_Digests`): 8 MiB.
_DIGESTS_IN_MEMORY = 1 << 20
#: The files spilled digests are spread over, by their top bits (a power of two).
_DIGEST_FILES = 64


def _digest_file_bounds():
    """Where each digest file's digests begin, after the first's."""
    return np.arange(1, _DIGEST_FILES, dtype=np.uint64) * np.uint64(2**64 // _DIGEST_FILES)


def data_file_name(file_format: str) -> str:
    try:
        return FILE_FORMATS[file_format]
    except KeyError:
        raise ValueError(f"unknown file format {file_format!r}: expected one of {sorted(FILE_FORMATS)}") from None


COLUMN_KINDS = ("string", "float", "int", "timestamp", "bool")


@dataclass(frozen=True)
class ExportSchema:
    """The columns an export must carry, in file order, and the rules its rows obey.

    Attributes:
        columns: column name -> kind, one of ``string``, ``float``, ``int``, ``timestamp``, ``bool``.
        time_column: timestamp column that must fall inside the window.
        id_columns: columns whose values together must be unique within one export (one column or several).
        tenant_column: column that must hold the export's own tenant on every row (None: no such column).
        order_by: the order of rows in the file; default ``(time_column, *id_columns)``.
        nullable: columns that may hold nulls; every other column is required on every row.
        version_column: a version or updated-at column whose change means a row changed (source fingerprints and
            drift counts use it); None: changes in place cannot be told apart from unchanged rows.

    Example:
        >>> ExportSchema({"order_id": "string", "placed_at": "timestamp"}, "placed_at", ("order_id",)).order_by
        ('placed_at', 'order_id')
    """

    columns: Mapping[str, str]
    time_column: str
    id_columns: tuple[str, ...] | str
    tenant_column: str | None = None
    order_by: tuple[str, ...] = ()
    nullable: frozenset[str] = frozenset()
    version_column: str | None = None

    def __post_init__(self) -> None:
        ids = (self.id_columns,) if isinstance(self.id_columns, str) else tuple(self.id_columns)
        pairs = list(self.columns.items()) if isinstance(self.columns, Mapping) else list(self.columns)
        for what, names in (("columns", [name for name, _ in pairs]), ("id_columns", ids), ("order_by", self.order_by)):
            repeated = sorted({name for name in names if list(names).count(name) > 1})
            if repeated:
                raise ValueError(f"{what} names {', '.join(map(repr, repeated))} more than once; name each column once")
        object.__setattr__(self, "id_columns", ids)
        object.__setattr__(self, "order_by", tuple(self.order_by) or (self.time_column, *ids))
        object.__setattr__(self, "nullable", frozenset(self.nullable))
        object.__setattr__(self, "columns", dict(self.columns))
        if not self.columns:
            raise ValueError("an export schema needs at least one column")
        for name, kind in self.columns.items():
            if kind not in COLUMN_KINDS:
                raise ValueError(f"column {name!r} has kind {kind!r}; expected one of {list(COLUMN_KINDS)}")
        if not ids:
            raise ValueError("an export schema needs at least one id column")
        named = [self.time_column, *ids, *self.order_by, *self.nullable]
        if self.version_column is not None:
            named.append(self.version_column)
        if self.tenant_column is not None:
            named.append(self.tenant_column)
        for name in named:
            if name not in self.columns:
                raise ValueError(f"schema column {name!r} is not among {list(self.columns)}")
        if self.version_column in ids:
            raise ValueError(f"version column {self.version_column!r} cannot be an id column: ids never change")
        if self.columns[self.time_column] != "timestamp":
            raise ValueError(f"time column {self.time_column!r} must be of kind 'timestamp'")
        required = {self.time_column, *ids} | ({self.tenant_column} if self.tenant_column else set())
        if required & self.nullable:
            raise ValueError(f"time, id and tenant columns cannot be nullable: {sorted(required & self.nullable)}")

    @property
    def id_column(self) -> str:
        """The first id column (what messages name)."""
        return self.id_columns[0]

    def arrow_schema(self) -> pa.Schema:
        kinds = {
            "string": pa.string(),
            "float": pa.float64(),
            "int": pa.int64(),
            "timestamp": pa.timestamp("us", tz="UTC"),
            "bool": pa.bool_(),
        }
        return pa.schema(
            [pa.field(name, kinds[kind], nullable=name in self.nullable) for name, kind in self.columns.items()]
        )


def _duplicates(what: str, ids: list[str], rows: np.ndarray) -> str:
    """The refusal of duplicate ids: which columns, how many rows and the first rows' positions (counted from 1 in the
    key's rows, as the batch labels count them), never the values (ids are customer data: an order id can hold an
    email)."""
    shown = ", ".join(str(int(row)) for row in rows[:5]) + (", ..." if len(rows) > 5 else "")
    return (
        f"{what}: {len(rows)} row(s) share their {'/'.join(ids)} with another (rows {shown}); each event must appear "
        "once"
    )


def validate_frame(
    frame: object,
    schema: ExportSchema,
    window: ExportWindow,
    what: str,
    tenant: str | None = None,
    *,
    fingerprint: Fingerprint | None = None,
) -> pa.Table:
    """Checks a source frame against the schema and window; returns it as an Arrow table in file order.

    ``fingerprint``, when given, accumulates the frame's source fingerprint (from the id hashes the duplicate check
    computes anyway).

    The checks run on the Arrow table the file is written from (nulls, the window's bounds and the tenant on Arrow
    data; the order on numpy views of the columns; the ids' hashes with pandas, which define the stored fingerprint):
    a frame that passes them is converted once, with none of the pandas scans (``isna``, comparisons) of before. A
    frame that any of them would refuse is checked again on pandas, as before (:func:`_validated_on_pandas`), whose
    checks in their order give the refusal its words: the Arrow checks only ever accept frames that the pandas checks
    accept, with the same table.

    Raises:
        FrameError: missing columns, nulls in required fields, wrong types, events outside the window, duplicate ids.
    """
    _, finish = validate_frame_in_two_steps(frame, schema, window, what, tenant, fingerprint=fingerprint)
    return finish()


def _validated_on_arrow(
    frame: object, schema: ExportSchema, window: ExportWindow, tenant: str | None, fingerprint: Fingerprint | None
) -> pa.Table | None:
    """The frame as its Arrow table when every check passes on it, else None (nothing is added to ``fingerprint``):
    whether :func:`validate_frame` accepts it without the pandas checks (what the equivalence tests pin)."""
    table = _checked_on_arrow(frame, schema, window, tenant)
    if table is None or not _distinct_ids(frame, schema, fingerprint):
        return None
    return table


def validate_frame_in_two_steps(
    frame: object,
    schema: ExportSchema,
    window: ExportWindow,
    what: str,
    tenant: str | None = None,
    *,
    fingerprint: Fingerprint | None = None,
) -> tuple[pa.Table, Callable[[], pa.Table]]:
    """:func:`validate_frame` in two steps, so that the file can be written while the second one runs.

    Returns the frame's Arrow table, checked for everything but its ids (columns, kinds, nulls, the window, the
    tenant, the order), and ``finish``: a callable that hashes and checks the ids (adding them to ``fingerprint``) and
    returns the table to publish, or raises the refusal :func:`validate_frame` would raise. The table it returns is
    the same table, except after a collision of two different ids' hashes (decided on the values), when it is an
    equal one. A frame the first step cannot accept on Arrow is validated whole at once: ``finish`` then returns it.

    Raises:
        FrameError: from the first step (anything but the ids), or from ``finish`` (duplicate ids).
    """
    table = _checked_on_arrow(frame, schema, window, tenant)
    if table is None:
        whole = _validated_on_pandas(frame, schema, window, what, tenant, fingerprint)
        return whole, lambda: whole

    def finish() -> pa.Table:
        if _distinct_ids(frame, schema, fingerprint):
            return table
        return _validated_on_pandas(frame, schema, window, what, tenant, fingerprint)

    return table, finish


def _distinct_ids(frame: pd.DataFrame, schema: ExportSchema, fingerprint: Fingerprint | None) -> bool:
    """Whether the ids' 64-bit hashes are all distinct (then so are the ids), adding them to ``fingerprint`` if so;
    equal hashes (a duplicate, or a collision of different ids) are decided on the values by pandas."""
    hashes = id_hashes(frame, list(schema.id_columns))
    ordered_hashes = np.sort(hashes)
    if (ordered_hashes[1:] == ordered_hashes[:-1]).any():
        return False
    if fingerprint is not None:
        fingerprint.add(frame, hashes)
    return True


def _checked_on_arrow(frame: object, schema: ExportSchema, window: ExportWindow, tenant: str | None) -> pa.Table | None:
    """The frame as its Arrow table when every check but the ids' passes on it, else None.

    Sound by construction: each step returns None wherever the pandas checks might refuse, or might order the rows
    differently (a frame not in file order is left to pandas' stable sort)."""
    if not isinstance(frame, pd.DataFrame) or frame.empty or not frame.columns.is_unique:
        return None
    dtypes = frame.dtypes  # one Series of every column's dtype: cheaper than a column Series each on small frames
    if any(name not in dtypes.index or _dtype_refusal(dtypes[name], kind) for name, kind in schema.columns.items()):
        return None
    if not _already_ordered(frame, schema):
        return None
    try:
        # Arrow refuses nulls in the schema's non-nullable fields itself (ValueError), counting as null what pandas'
        # isna does (None, NaN, NaT, pd.NA); a value pandas would call null and Arrow cannot convert fails too.
        # Arrow converts the schema's columns alone, by name (the others are never read): no pandas copy of them.
        table = pa.Table.from_pandas(frame, schema=schema.arrow_schema(), preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, ValueError):
        return None
    if any(table.column(name).null_count for name in schema.columns if name not in schema.nullable):
        return None
    if not _inside(table.column(schema.time_column), window):
        return None
    if schema.tenant_column is not None and tenant is not None:
        try:
            if not pc.all(pc.equal(table.column(schema.tenant_column), tenant)).as_py():
                return None
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            return None  # a tenant column of another kind than text: compared by pandas
    return table


def _already_ordered(frame: pd.DataFrame, schema: ExportSchema) -> bool:
    """Whether the rows are in file order already, so that the pandas checks' stable sort would move none."""
    if schema.order_by == (schema.time_column, schema.id_column):
        return _in_file_order(frame[schema.time_column], frame[schema.id_column])
    try:
        later, equal = _lexicographic_steps([_sortable(frame[name]) for name in schema.order_by], "")
    except (FrameError, TypeError, ValueError):
        return False  # values that do not compare, or nulls: sorted (or refused) by pandas
    return bool((later | equal).all())


def _inside(times: pa.ChunkedArray, window: ExportWindow) -> bool:
    """Whether every timestamp (microseconds since the epoch in UTC, as integers: exact, whatever the year) falls
    in ``[start, end)``."""
    bounds = pc.min_max(times.cast(pa.int64())).as_py()
    return bounds["min"] >= _microseconds(window.start_utc) and bounds["max"] < _microseconds(window.end_utc)


def _microseconds(moment: dt.datetime) -> int:
    return (moment - _EPOCH) // dt.timedelta(microseconds=1)


def _validated_on_pandas(
    frame: object,
    schema: ExportSchema,
    window: ExportWindow,
    what: str,
    tenant: str | None,
    fingerprint: Fingerprint | None,
) -> pa.Table:
    """:func:`validate_frame`'s checks on pandas, in the order whose first failure names the refusal."""
    _check_rows(frame, schema, window, what, tenant)
    if frame.empty:
        return schema.arrow_schema().empty_table()  # a day without events: typed by the schema, whatever the dtypes
    times = frame[schema.time_column]
    ids = list(schema.id_columns)
    hashes = id_hashes(frame, ids)
    if fingerprint is not None:
        fingerprint.add(frame, hashes)
    # The ids' 64-bit hashes are computed for the fingerprint anyway: distinct hashes prove distinct ids, and
    # checking integers is cheaper than checking the values. Equal hashes (a duplicate, or rarely a collision) are
    # decided on the values themselves.
    ordered_hashes = np.sort(hashes)
    if (ordered_hashes[1:] == ordered_hashes[:-1]).any():
        if len(ids) == 1:
            duplicated = frame[schema.id_column].duplicated(keep=False)
        else:
            duplicated = frame.duplicated(subset=ids, keep=False)
    else:
        duplicated = np.zeros(0, dtype=bool)
    if duplicated.any():
        raise FrameError(_duplicates(what, ids, 1 + np.flatnonzero(np.asarray(duplicated))))

    columns = frame[list(schema.columns)]
    if schema.order_by == (schema.time_column, schema.id_column) and _in_file_order(times, frame[schema.id_column]):
        ordered = columns  # sources usually hand rows over in file order already: checking is O(n), sorting is not
    else:
        ordered = columns.sort_values(list(schema.order_by), kind="stable")
    return _to_arrow(ordered, schema, what)


def _check_rows(frame: object, schema: ExportSchema, window: ExportWindow, what: str, tenant: str | None) -> None:
    """The checks of one frame's rows on their own: columns, kinds, nulls, window and tenant."""
    if not isinstance(frame, pd.DataFrame):
        raise FrameError(f"{what}: expected a pandas DataFrame, got {type(frame).__name__}")
    check_column_names(frame, schema, what)
    missing = [name for name in schema.columns if name not in frame.columns]
    if missing:
        raise FrameError(f"{what}: source frame is missing required columns {missing}")
    for name, kind in schema.columns.items():
        series = frame[name]
        if series.empty:
            continue  # no rows, no wrong values: a source's empty result often comes untyped (dtype object)
        if name not in schema.nullable:
            nulls = int(series.isna().sum())
            if nulls:
                raise FrameError(f"{what}: column {name!r} has {nulls} null value(s); the column is required")
        refusal = _kind_refusal(series, kind)
        if refusal:
            raise FrameError(f"{what}: column {name!r} {refusal}")

    times = frame[schema.time_column]
    outside_mask = (times < window.start_utc) | (times >= window.end_utc)
    if outside_mask.any():
        raise FrameError(
            f"{what}: {int(outside_mask.sum())} event(s) fall outside the window [{utc_iso(window.start_utc)}, "
            f"{utc_iso(window.end_utc)}) ({_rows(outside_mask)}); nothing was exported"
        )
    if schema.tenant_column is not None and tenant is not None:
        foreign_mask = frame[schema.tenant_column] != tenant
        if foreign_mask.any():
            raise FrameError(
                f"{what}: {int(foreign_mask.sum())} row(s) belong to another tenant than {tenant!r} "
                f"({_rows(foreign_mask)}); nothing was exported"
            )


def check_column_names(frame: pd.DataFrame, schema: ExportSchema, what: str) -> None:
    """Refuses a frame in which a column of the schema appears more than once (which of them would be exported is
    anybody's guess); repeated columns the export does not read are left alone, like any column it does not read.

    Raises:
        FrameError: naming the repeated columns.
    """
    if frame.columns.is_unique:
        return
    repeated = sorted({str(name) for name in frame.columns[frame.columns.duplicated()] if name in schema.columns})
    if repeated:
        raise FrameError(
            f"{what}: the frame has more than one column named {', '.join(map(repr, repeated))}; each column of the "
            "export must appear once, nothing was exported"
        )


#: What each kind takes, as refusals say it (the dtype decides, never a value: a refusal quotes no data).
KIND_TAKES = {
    "string": "a string dtype, or an object dtype holding str",
    "float": "an integer or float dtype, never bool",
    "int": "an integer dtype, never bool or float",
    "timestamp": "a timezone-aware datetime64 dtype",
    "bool": "a bool dtype, or an object dtype holding True and False",
}


def _kind_refusal(series: pd.Series, kind: str) -> str | None:
    """Why a column cannot hold values of ``kind`` (the end of the refusal), or None when it can.

    Decided on the dtype, the same on the Arrow path and the pandas path, so that both refuse what Arrow would
    convert silently (booleans as 1.0 and 0.0 in a float column: issue 26). What is accepted is then converted
    exactly, or refused by Arrow value by value (:func:`_to_arrow`): an integer beyond 2**53 in a float column, a
    timestamp with nanoseconds, a value of another type in an object column of the string or bool kind (bytes in a
    string column are decoded as UTF-8 text: telling them apart would cost a scan of every text column).
    """
    return _dtype_refusal(series.dtype, kind)


def _dtype_refusal(dtype, kind: str) -> str | None:
    """:func:`_kind_refusal` of a column of ``dtype``."""
    if isinstance(dtype, pd.SparseDtype):
        # pandas counts a sparse column as its values' kind; Arrow cannot convert it (a raw TypeError).
        return (
            f"is sparse, found dtype {dtype} (kind {kind!r} takes {KIND_TAKES[kind]}): make it dense first "
            "(series.sparse.to_dense())"
        )
    if kind == "timestamp":
        accepted = isinstance(dtype, pd.DatetimeTZDtype)
        refusal = "must hold timezone-aware timestamps"
    elif kind == "float":
        # pandas counts bool as numeric; Arrow would write True as 1.0.
        accepted = pd.api.types.is_float_dtype(dtype) or pd.api.types.is_integer_dtype(dtype)
        refusal = "must be numeric"
    elif kind == "int":
        accepted = pd.api.types.is_integer_dtype(dtype)
        refusal = "must hold integers"
    elif kind == "bool":
        # Object columns pass this check and are refused value by value by Arrow (anything but True, False, null).
        accepted = pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_object_dtype(dtype)
        refusal = "must hold booleans"
    else:
        # Object columns pass this check and are refused value by value by Arrow (anything but str, null, bytes).
        accepted = pd.api.types.is_string_dtype(dtype)
        refusal = "must hold strings"
    return None if accepted else f"{refusal}, found dtype {dtype} (kind {kind!r} takes {KIND_TAKES[kind]})"


def _rows(mask) -> str:
    """The first rows a check refused, by position (counted from 1 in the rows given), never by value: ids and times
    are customer data."""
    positions = 1 + np.flatnonzero(np.asarray(mask))
    return "rows " + ", ".join(str(int(row)) for row in positions[:5]) + (", ..." if len(positions) > 5 else "")


def _to_arrow(ordered: pd.DataFrame, schema: ExportSchema, what: str) -> pa.Table:
    arrow_schema = schema.arrow_schema()
    try:
        return pa.Table.from_pandas(ordered, schema=arrow_schema, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        # Arrow's message quotes the value it could not convert (customer data): name the column, never the value.
        column, lossy = _unconvertible_column(ordered, arrow_schema)
        reason = "converting them would lose data" if lossy else "the values are not shown"
        raise FrameError(
            f"{what}: source frame does not fit the export schema: column {column!r} holds values that are not of "
            f"kind {schema.columns.get(column, 'its kind')!r} ({reason}); nothing was exported"
        ) from None


def _unconvertible_column(frame: pd.DataFrame, arrow_schema: pa.Schema) -> tuple[str, bool]:
    """The first column Arrow cannot convert to its type (found column by column, after the whole frame failed), and
    whether converting would lose precision. Arrow's message is read for that, never repeated: it quotes values."""
    for column in arrow_schema:
        try:
            pa.array(frame[column.name], type=column.type, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as exc:
            return column.name, "would lose data" in str(exc) or "not in range" in str(exc)
    return "(unknown)", False


def _in_file_order(times: pd.Series, ids: pd.Series) -> bool:
    """True when rows are already sorted by (time, id), so that sorting would not move any (ids are unique here)."""
    stamps = times.array.asi8
    steps = np.diff(stamps)
    if (steps < 0).any():
        return False
    ties = np.flatnonzero(steps == 0)
    if not len(ties):
        return True
    values = ids.to_numpy()
    try:
        return bool((values[ties] < values[ties + 1]).all())
    except TypeError:  # ids that do not compare: let the sort (and then Arrow) refuse them as before
        return False


class HashingWriter(io.RawIOBase):
    """A write-only file object that feeds every byte to SHA-256 on its way to ``sink``."""

    def __init__(self, sink: BinaryIO) -> None:
        super().__init__()
        self._sink = sink
        self._hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        self._hash.update(view)
        self._sink.write(view)
        self.size += view.nbytes
        return view.nbytes

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def write_table(table: pa.Table, file_format: str, sink: BinaryIO) -> str:
    """Writes ``table`` in ``file_format`` to ``sink`` and returns the SHA-256 of the bytes written."""
    data_file_name(file_format)
    writer = HashingWriter(sink)
    if file_format == "csv":
        pa_csv.write_csv(table, writer)
    else:
        pq.write_table(table, writer)
    return writer.hexdigest()


def write_rows(rows: pa.Table | TableStream, file_format: str, sink: BinaryIO) -> tuple[str, int]:
    """Writes a whole table, or a stream of validated tables batch by batch, to ``sink``.

    A stream is written as it arrives, so memory stays bounded by one batch: CSV through one ``CSVWriter`` (the
    header once, then each batch; the bytes are those ``write_csv`` writes for the same rows), Parquet through one
    ``ParquetWriter`` (a row group per batch). Every byte is hashed on its way out.

    Returns:
        The SHA-256 of the bytes written and the number of rows.

    Raises:
        FrameError: a batch of the stream failed validation (the partly written file must be discarded).
    """
    if isinstance(rows, pa.Table):
        return write_table(rows, file_format, sink), rows.num_rows
    data_file_name(file_format)
    writer = HashingWriter(sink)
    count = 0
    if file_format == "csv":
        with pa_csv.CSVWriter(writer, rows.schema) as out:
            for table in rows:
                out.write_table(table)
                count += table.num_rows
    else:
        with pq.ParquetWriter(writer, rows.schema) as out:
            for table in rows:
                out.write_table(table)
                count += table.num_rows
    return writer.hexdigest(), count


class FrameBatches:
    """One key's rows as a sequence of DataFrames, read once, in file order: what a streaming source hands over.

    Put it in an :class:`~export_ledger.protocol.ExportItem` in place of a DataFrame and the export is validated,
    written and hashed batch by batch (:func:`validate_batches`), so a partition larger than memory exports with
    one batch in memory at a time.

    Example:
        >>> FrameBatches(source.batches("acme", start, end, schema=schema))  # doctest: +SKIP
    """

    def __init__(self, batches: Iterable[pd.DataFrame]) -> None:
        self._batches = batches
        self._read = False

    def __iter__(self) -> Iterator[pd.DataFrame]:
        if self._read:
            raise FrameError("these batches were already read: a stream of rows can be exported once")
        self._read = True
        return iter(self._batches)


@dataclass
class TableStream:
    """Validated Arrow tables of one key, in file order, made while the writer consumes them (single use)."""

    schema: pa.Schema
    tables: Iterator[pa.Table]

    def __iter__(self) -> Iterator[pa.Table]:
        return self.tables


def validate_batches(
    batches: FrameBatches,
    schema: ExportSchema,
    window: ExportWindow,
    what: str,
    tenant: str | None = None,
    *,
    fingerprint: Fingerprint | None = None,
) -> TableStream:
    """:func:`validate_frame` for a key whose rows arrive in batches, with memory bounded by one batch, whatever the
    number of rows; returns the stream of validated tables for :func:`write_rows`.

    Each batch gets the checks of one frame (columns, kinds, nulls, window, tenant, conversion to the schema).
    Across batches, nothing is held but the last row's sort key and one digest per row:

    * **Order.** A stream cannot be sorted without holding it, so its rows must arrive in file order
      (``schema.order_by``; from SQL, ``ORDER BY`` those columns, with a byte-order collation such as ``COLLATE "C"``
      for text on PostgreSQL, since Python compares strings by code point). Within a batch every row is compared
      with the next (vectorised, lexicographic over the order columns); the first row of a batch is compared with
      the last row of the batch before. A row that sorts before its predecessor fails the stream.
    * **Uniqueness.** The id values of each row are hashed to 64 bits (``fingerprint.id_hashes``); the
      digests are kept (in memory up to 8 MiB, then spilled to temporary files, 8 bytes a row: :class:`_Digests`),
      and after the last batch, before anything is published, sorted and checked for equal neighbours. Rows
      whose order keys are equal and include the ids are neighbours and are refused in their batch already, naming
      the ids. Two different ids with the same digest (probability about n² / 2⁶⁵, 3e-6 at 10M rows) are refused
      as a duplicate: the check can only err towards refusing, never towards accepting one.

    ``fingerprint``, when given, accumulates the source fingerprint batch by batch, from the same id hashes.

    A failure raises :class:`FrameError` from the stream while it is written: the caller discards the partly
    written file and publishes nothing.

    Raises:
        FrameError: ``schema.order_by`` holds a nullable column (the order of nulls cannot be checked in a stream).
    """
    nullable = [name for name in schema.order_by if name in schema.nullable]
    if nullable:
        raise FrameError(
            f"{what}: rows cannot be streamed in an order of nullable columns {nullable}; hand over one DataFrame"
        )
    return TableStream(schema.arrow_schema(), _validated_tables(batches, schema, window, what, tenant, fingerprint))


def _validated_tables(
    batches: FrameBatches,
    schema: ExportSchema,
    window: ExportWindow,
    what: str,
    tenant: str | None,
    fingerprint: Fingerprint | None,
) -> Iterator[pa.Table]:
    """The stream's checked tables; the digests' spilled files are removed however the stream ends."""
    digests = _Digests()
    try:
        yield from _checked_tables(batches, schema, window, what, tenant, fingerprint, digests)
    finally:
        digests.close()  # also when the stream fails, or is abandoned by its reader


def _checked_tables(
    batches: FrameBatches,
    schema: ExportSchema,
    window: ExportWindow,
    what: str,
    tenant: str | None,
    fingerprint: Fingerprint | None,
    digests: _Digests,
) -> Iterator[pa.Table]:
    order = list(schema.order_by)
    ids = list(schema.id_columns)
    # Equal order keys are duplicate ids when the ids are part of the order (the default: time, then ids).
    ids_in_order = set(ids) <= set(order)
    previous: tuple | None = None
    offset = 0
    frame = keys = None
    for number, frame in enumerate(batches):
        where = f"{what} (batch {number + 1}, rows {offset + 1}-{offset + len(frame)})"
        _check_rows(frame, schema, window, where, tenant)
        if not len(frame):
            continue
        keys = [_sortable(frame[name]) for name in order]
        later, equal = _lexicographic_steps(keys, where)
        if (~later & ~equal).any():
            raise FrameError(
                f"{where}: rows are not in file order ({', '.join(order)}); a streamed export must arrive sorted, "
                "nothing was exported"
            )
        if ids_in_order and equal.any():
            raise FrameError(_duplicates(where, ids, offset + 2 + np.flatnonzero(equal)))  # the later row of each pair
        first = tuple(_item(column[0]) for column in keys)
        if previous is not None:
            if first < previous:
                raise FrameError(
                    f"{where}: the batch's first row sorts before the previous batch's last row "
                    f"({', '.join(order)}); a streamed export must arrive sorted, nothing was exported"
                )
            if first == previous and ids_in_order:
                raise FrameError(
                    f"{where}: the batch's first row repeats the previous batch's last {'/'.join(ids)} (row "
                    f"{offset + 1}) across two batches; each event must appear once"
                )
        previous = tuple(_item(column[-1]) for column in keys)
        hashes = id_hashes(frame, ids)
        digests.extend(hashes)
        if fingerprint is not None:
            fingerprint.add(frame, hashes)  # complete once the stream is: the caller reads it after the write
        offset += len(frame)
        yield _to_arrow(frame[list(schema.columns)], schema, where)
    del frame, keys  # the last batch is written: free it before the digests are sorted
    repeated = digests.repeats()
    if repeated:
        raise FrameError(
            f"{what}: {repeated} row(s) repeat the {'/'.join(ids)} values of an earlier row (found by their "
            "digests; the streamed rows are not held, so the values are not shown); each event must appear once"
        )


class _Digests:
    """The rows' 64-bit id digests, kept until the last batch for the duplicate check, in memory that stays flat.

    Up to :data:`_DIGESTS_IN_MEMORY` digests (8 MiB) are held in one ``uint64`` array grown in place. Beyond that
    (issue #21: peak memory must not grow with a partition's rows) they are spilled to :data:`_DIGEST_FILES` files
    of a private temporary directory (``tempfile``, so ``TMPDIR``), each digest to the file its top bits name:
    equal digests share a file, so the check sorts and compares one file at a time. The cost is 8 bytes a row of
    temporary disk, written once and read once, and at the check one file's digests in memory (1/64 of 8 bytes a
    row: 1.25 MiB at 10M rows). The files hold digests, never values, and are removed when the check ends or the
    stream is abandoned (:meth:`close`).
    """

    def __init__(self) -> None:
        self._values = np.empty(1024, dtype=np.uint64)
        self._used = 0
        self._folder: tempfile.TemporaryDirectory | None = None
        self._files: list[BinaryIO] = []

    def extend(self, values: np.ndarray) -> None:
        needed = self._used + len(values)
        if self._folder is None and needed <= _DIGESTS_IN_MEMORY:
            if needed > len(self._values):
                self._values.resize(min(max(needed, len(self._values) * 2), _DIGESTS_IN_MEMORY), refcheck=False)
            self._values[self._used : needed] = values
            self._used = needed
            return
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="export-ledger-digests-")
            self._files = [open(Path(self._folder.name) / f"{n:03d}", "wb") for n in range(_DIGEST_FILES)]
            self._spill(self._values[: self._used])
            self._values, self._used = np.empty(0, dtype=np.uint64), 0
        self._spill(values)

    def _spill(self, values: np.ndarray) -> None:
        """Appends ``values`` to their files: sorted, each file's digests are one slice."""
        ordered = np.sort(values)
        edges = [0, *np.searchsorted(ordered, _digest_file_bounds()).tolist(), len(ordered)]
        for handle, start, end in zip(self._files, edges[:-1], edges[1:], strict=True):
            if end > start:
                handle.write(ordered[start:end].data)

    def repeats(self) -> int:
        """How many digests equal an earlier one."""
        if self._folder is None:
            return _repeats(self._values[: self._used])
        repeated = 0
        for handle in self._files:
            handle.close()
            repeated += _repeats(np.fromfile(handle.name, dtype=np.uint64))
        return repeated

    def close(self) -> None:
        """Removes the spilled files (if any)."""
        for handle in self._files:
            handle.close()
        if self._folder is not None:
            self._folder.cleanup()
        self._folder, self._files = None, []


def _repeats(values: np.ndarray) -> int:
    values.sort()
    return int(np.count_nonzero(values[1:] == values[:-1]))


def _sortable(series: pd.Series) -> np.ndarray:
    """A column as values whose ``<`` is the file's order: timestamps as int64 microseconds, others as they are."""
    if isinstance(series.dtype, pd.DatetimeTZDtype):
        return series.dt.as_unit("us").array.asi8
    return series.to_numpy()


def _item(value):
    return value.item() if isinstance(value, np.generic) else value


def _lexicographic_steps(keys: list[np.ndarray], where: str) -> tuple[np.ndarray, np.ndarray]:
    """For each pair of neighbouring rows, whether the second sorts after the first, and whether they are equal."""
    later = np.zeros(len(keys[0]) - 1, dtype=bool)
    equal = np.ones(len(keys[0]) - 1, dtype=bool)
    for column in reversed(keys):
        try:
            after, same = column[1:] > column[:-1], column[1:] == column[:-1]
        except TypeError:
            raise FrameError(f"{where}: an order column holds values that do not compare") from None
        later = after | (same & later)
        equal &= same
    return later, equal


def read_table(payload: bytes, file_format: str, schema: ExportSchema | None = None) -> pd.DataFrame:
    """Parses an export's data file back into a frame."""
    return read_arrow(payload, file_format, schema).to_pandas()


def read_arrow(payload: bytes, file_format: str, schema: ExportSchema | None = None) -> pa.Table:
    """Parses an export's data file back into an Arrow table (a CSV file's columns typed by ``schema`` when given,
    else as pyarrow infers them)."""
    data_file_name(file_format)
    if file_format == "parquet":
        return pq.read_table(io.BytesIO(payload))
    convert = pa_csv.ConvertOptions(column_types=schema.arrow_schema() if schema else None)
    return pa_csv.read_csv(io.BytesIO(payload), convert_options=convert)


_REVISION_FIELDS = ("revision", "supersedes_revision", "supersedes_sha256")


@dataclass(frozen=True)
class Manifest:
    """The completion marker published beside the data file.

    A reader trusts a data file only through its manifest: same directory, same sha256.
    """

    logical_key: str
    export: str
    tenant: str
    business_date: str
    timezone: str
    window_start_utc: str
    window_end_utc: str
    row_count: int
    sha256: str
    attempt_id: str
    fencing_token: int
    data_file: str
    tz_database: str = ""
    manifest_version: int = field(default=MANIFEST_VERSION)
    #: Which revision of the key this is (1: its first export) and, for a restatement, the revision it supersedes
    #: with that revision's sha256. Revision 1's manifest omits all three, byte for byte what 0.3.0 wrote.
    revision: int = 1
    supersedes_revision: int | None = None
    supersedes_sha256: str | None = None

    @classmethod
    def build(
        cls,
        *,
        logical_key: str,
        export: str,
        tenant: str,
        window: ExportWindow,
        row_count: int,
        sha256: str,
        attempt_id: str,
        fencing_token: int,
        data_file: str,
        tz_database: str,
        revision: int = 1,
        supersedes: tuple[int, str] | None = None,
    ) -> Manifest:
        return cls(
            logical_key=logical_key,
            export=export,
            tenant=tenant,
            business_date=window.business_date.isoformat(),
            timezone=window.timezone,
            window_start_utc=utc_iso(window.start_utc),
            window_end_utc=utc_iso(window.end_utc),
            row_count=row_count,
            sha256=sha256,
            attempt_id=attempt_id,
            fencing_token=fencing_token,
            data_file=data_file,
            tz_database=tz_database,
            revision=revision,
            supersedes_revision=supersedes[0] if supersedes else None,
            supersedes_sha256=supersedes[1] if supersedes else None,
        )

    def to_json(self) -> bytes:
        values = asdict(self)
        if self.revision == 1:
            for name in _REVISION_FIELDS:
                values.pop(name)
        return (json.dumps(values, indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, payload: bytes, where: str) -> Manifest:
        try:
            values = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest at {where} is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ManifestError(f"manifest at {where} is not a JSON object")
        optional = ("tz_database", "manifest_version", *_REVISION_FIELDS)
        required = [name for name in cls.__dataclass_fields__ if name not in optional]
        missing = [name for name in required if name not in values]
        if missing:
            raise ManifestError(f"manifest at {where} is missing fields {missing}")
        known = {name: values[name] for name in cls.__dataclass_fields__ if name in values}
        revision = known.get("revision", 1)
        if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
            raise ManifestError(f"manifest at {where} has revision {revision!r}; revisions count from 1")
        return cls(**known)

    @property
    def business_day(self) -> dt.date:
        return dt.date.fromisoformat(self.business_date)
