"""What one export is made of: a validated frame, a data file hashed while it is written, and a manifest.

Plain Python (pandas and pyarrow); nothing here knows about Dagster.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import BinaryIO

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from export_ledger.calendar import ExportWindow, utc_iso
from export_ledger.errors import FrameError, ManifestError

FILE_FORMATS = {"csv": "data.csv", "parquet": "data.parquet"}
MANIFEST_NAME = "_manifest.json"
MANIFEST_VERSION = 1


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

    def __post_init__(self) -> None:
        ids = (self.id_columns,) if isinstance(self.id_columns, str) else tuple(self.id_columns)
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
        if self.tenant_column is not None:
            named.append(self.tenant_column)
        for name in named:
            if name not in self.columns:
                raise ValueError(f"schema column {name!r} is not among {list(self.columns)}")
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


def validate_frame(
    frame: object, schema: ExportSchema, window: ExportWindow, what: str, tenant: str | None = None
) -> pa.Table:
    """Checks a source frame against the schema and window; returns it as an Arrow table in file order.

    Raises:
        FrameError: missing columns, nulls in required fields, wrong types, events outside the window, duplicate ids.
    """
    if not isinstance(frame, pd.DataFrame):
        raise FrameError(f"{what}: expected a pandas DataFrame, got {type(frame).__name__}")
    missing = [name for name in schema.columns if name not in frame.columns]
    if missing:
        raise FrameError(f"{what}: source frame is missing required columns {missing}")
    for name, kind in schema.columns.items():
        series = frame[name]
        if name not in schema.nullable:
            nulls = int(series.isna().sum())
            if nulls:
                raise FrameError(f"{what}: column {name!r} has {nulls} null value(s); the column is required")
        if kind == "timestamp":
            if not isinstance(series.dtype, pd.DatetimeTZDtype):
                raise FrameError(
                    f"{what}: column {name!r} must hold timezone-aware timestamps, found dtype {series.dtype}"
                )
        elif kind == "float" and not pd.api.types.is_numeric_dtype(series.dtype):
            raise FrameError(f"{what}: column {name!r} must be numeric, found dtype {series.dtype}")
        elif kind == "int" and not pd.api.types.is_integer_dtype(series.dtype):
            raise FrameError(f"{what}: column {name!r} must hold integers, found dtype {series.dtype}")
        elif kind == "bool" and not pd.api.types.is_bool_dtype(series.dtype) and series.dtype != object:
            raise FrameError(f"{what}: column {name!r} must hold booleans, found dtype {series.dtype}")
        elif kind == "string" and not pd.api.types.is_string_dtype(series.dtype):
            # Mixed object columns pass this check and are refused value by value by Arrow below.
            raise FrameError(f"{what}: column {name!r} must hold strings, found dtype {series.dtype}")

    times = frame[schema.time_column]
    outside_mask = (times < window.start_utc) | (times >= window.end_utc)
    if outside_mask.any():
        outside = frame[outside_mask]
        sample = ", ".join(map(str, outside[schema.id_column].head(3)))
        raise FrameError(
            f"{what}: {len(outside)} event(s) fall outside the window [{utc_iso(window.start_utc)}, "
            f"{utc_iso(window.end_utc)}) (ids {sample}); nothing was exported"
        )
    if schema.tenant_column is not None and tenant is not None:
        foreign_mask = frame[schema.tenant_column] != tenant
        if foreign_mask.any():
            foreign = frame[foreign_mask]
            sample = ", ".join(map(str, foreign[schema.id_column].head(3)))
            raise FrameError(
                f"{what}: {len(foreign)} row(s) belong to another tenant than {tenant!r} (ids {sample}); "
                "nothing was exported"
            )
    ids = list(schema.id_columns)
    if len(ids) == 1:
        duplicated = frame[schema.id_column].duplicated(keep=False)
    else:
        duplicated = frame.duplicated(subset=ids, keep=False)
    if duplicated.any():
        sample = ", ".join(map(str, frame.loc[duplicated, schema.id_column].unique()[:3]))
        raise FrameError(f"{what}: duplicate {'/'.join(ids)} values ({sample}); each event must appear once")

    columns = frame[list(schema.columns)]
    if schema.order_by == (schema.time_column, schema.id_column) and _in_file_order(times, frame[schema.id_column]):
        ordered = columns  # sources usually hand rows over in file order already: checking is O(n), sorting is not
    else:
        ordered = columns.sort_values(list(schema.order_by), kind="stable")
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
            return column.name, "would lose data" in str(exc)
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


def read_table(payload: bytes, file_format: str, schema: ExportSchema | None = None) -> pd.DataFrame:
    """Parses an export's data file back into a frame."""
    data_file_name(file_format)
    if file_format == "parquet":
        table = pq.read_table(io.BytesIO(payload))
    else:
        convert = pa_csv.ConvertOptions(column_types=schema.arrow_schema() if schema else None)
        table = pa_csv.read_csv(io.BytesIO(payload), convert_options=convert)
    return table.to_pandas()


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
        )

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, payload: bytes, where: str) -> Manifest:
        try:
            values = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest at {where} is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ManifestError(f"manifest at {where} is not a JSON object")
        required = [name for name in cls.__dataclass_fields__ if name not in ("tz_database", "manifest_version")]
        missing = [name for name in required if name not in values]
        if missing:
            raise ManifestError(f"manifest at {where} is missing fields {missing}")
        known = {name: values[name] for name in cls.__dataclass_fields__ if name in values}
        return cls(**known)

    @property
    def business_day(self) -> dt.date:
        return dt.date.fromisoformat(self.business_date)
