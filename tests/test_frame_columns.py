"""A frame's columns against the export's kinds and names (issue 26): what each kind accepts and refuses, the same
for a whole frame (on the Arrow path and the pandas path) and for streamed batches; duplicated column names refused
by name, from a source, in a batch, in a declaration and in an asset's own frame.

The table in docs/library.md, *What a frame must hold*, says what each kind accepts; :data:`KINDS` below checks it."""

from __future__ import annotations

import datetime as dt
import decimal

import dagster as dg
import numpy as np
import pandas as pd
import pytest
from builders import open_ledger
from pipeline_helpers import failure_message, published_dirs

from export_ledger import ConfigurationError, ExportSpec, FrameError
from export_ledger.calendar import window_for
from export_ledger.dagster import ledgered_definitions
from export_ledger.frames import ExportSchema, FrameBatches, validate_batches, validate_frame, write_rows
from export_ledger.ledger.schema import ExportState

WINDOW = window_for(dt.date(2026, 3, 8), "America/New_York")
ROWS = 4


def frame_with(value: pd.Series, *, ordered: bool = True) -> pd.DataFrame:
    """Rows of the window with ``value`` as column ``v``: in file order (the Arrow path is tried first), or reversed
    (left to the pandas checks, which sort)."""
    start = pd.Timestamp(WINDOW.start_utc)
    frame = pd.DataFrame(
        {
            "id": [f"r{i}" for i in range(ROWS)],
            "at": [start + pd.Timedelta(minutes=i) for i in range(ROWS)],
            "v": value.reset_index(drop=True),
        }
    )
    return frame if ordered else frame.iloc[::-1].reset_index(drop=True)


def schema_of(kind: str) -> ExportSchema:
    return ExportSchema({"id": "string", "at": "timestamp", "v": kind}, "at", ("id",), nullable={"v"})


def verdicts(frame: pd.DataFrame, schema: ExportSchema) -> dict[str, object]:
    """What each way in makes of one frame: the values exported (a list) or the refusal (a FrameError's text)."""
    found: dict[str, object] = {}
    try:
        found["whole"] = validate_frame(frame, schema, WINDOW, "key").column("v").to_pylist()
    except FrameError as exc:
        found["whole"] = str(exc)
    try:
        stream = validate_batches(FrameBatches([frame.iloc[:2], frame.iloc[2:]]), schema, WINDOW, "key")
        write_rows(stream, "csv", _Discarded())
        found["streamed"] = "written"
    except FrameError as exc:
        found["streamed"] = str(exc)
    return found


class _Discarded:
    """A sink that keeps nothing: what is checked is whether the stream is written at all."""

    def write(self, data) -> int:
        return memoryview(data).nbytes


def _series(values, dtype=None) -> pd.Series:
    return pd.Series(values, dtype=dtype)


#: (kind, what the column holds, the column, accepted). Values are made distinctive (4711...) so that a refusal that
#: quoted one would be caught.
KINDS = [
    ("float", "float64", _series([4711.5, 2.0, 3.25, 4.0]), True),
    ("float", "int64", _series([4711, 2, 3, 4]), True),
    ("float", "nullable Int64", _series([4711, None, 3, 4], "Int64"), True),
    ("float", "uint8", _series([47, 2, 3, 4], "uint8"), True),
    ("float", "float32", _series([4711.5, 2, 3, 4], "float32"), True),
    ("float", "bool", _series([True, False, True, True]), False),
    ("float", "nullable boolean", _series([True, None, False, True], "boolean"), False),
    ("float", "int64 beyond 2**53", _series([2**53 + 4711, 2, 3, 4]), False),
    ("float", "strings of digits", _series(["4711", "2", "3", "4"]), False),
    ("float", "object of floats", _series([4711.5, 2.0, 3.0, 4.0], object), False),
    ("float", "object of Decimals", _series([decimal.Decimal("4711.5")] * ROWS), False),
    ("float", "complex", _series([4711 + 1j, 2, 3, 4]), False),
    ("int", "int64", _series([4711, 2, 3, 4]), True),
    ("int", "nullable Int64", _series([4711, None, 3, 4], "Int64"), True),
    ("int", "uint64 within int64", _series([4711, 2, 3, 4], "uint64"), True),
    ("int", "uint64 beyond int64", _series([2**63 + 4711, 2, 3, 4], "uint64"), False),
    ("int", "bool", _series([True, False, True, True]), False),
    ("int", "whole floats", _series([4711.0, 2.0, 3.0, 4.0]), False),
    ("int", "floats with fractions", _series([4711.5, 2.0, 3.0, 4.0]), False),
    ("int", "strings of digits", _series(["4711", "2", "3", "4"]), False),
    ("int", "object of ints", _series([4711, 2, 3, 4], object), False),
    ("bool", "bool", _series([True, False, True, True]), True),
    ("bool", "nullable boolean", _series([True, None, False, True], "boolean"), True),
    ("bool", "object of True/False/None", _series([True, None, False, True], object), True),
    ("bool", "int64 of 0/1", _series([1, 0, 1, 1]), False),
    ("bool", "object of 0/1", _series([1, 0, 1, 1], object), False),
    ("bool", "strings 'true'/'false'", _series(["true", "false", "true", "true"]), False),
    ("bool", "object of 'true'/'false'", _series(["true", "false", "true", "true"], object), False),
    ("bool", "float64", _series([1.0, 0.0, 1.0, 1.0]), False),
    ("string", "str", _series(["4711", "b", "c", "d"]), True),
    ("string", "object of str and None", _series(["4711", None, "c", "d"], object), True),
    ("string", "string[python]", _series(["4711", "b", "c", "d"], "string"), True),
    ("string", "int64", _series([4711, 2, 3, 4]), False),
    ("string", "bool", _series([True, False, True, True]), False),
    ("string", "object of bytes in UTF-8", _series([b"4711", b"b", b"c", b"d"], object), True),
    ("string", "object of ints", _series([4711, 2, 3, 4], object), False),
    ("string", "object of str and ints", _series(["a", 4711, "c", "d"], object), False),
    ("string", "object of bytes not in UTF-8", _series([b"\xff4711", b"b", b"c", b"d"], object), False),
    ("string", "object of bools", _series([True, False, True, True], object), False),
    ("string", "category", _series(["4711", "b", "c", "d"], "category"), False),
    ("timestamp", "aware, another zone", _series(pd.date_range(WINDOW.start_utc, periods=ROWS, freq="h")).dt.tz_convert("Asia/Tokyo"), True),  # noqa: E501
    ("timestamp", "naive", _series(pd.date_range(WINDOW.start_utc, periods=ROWS, freq="h")).dt.tz_localize(None), False),  # noqa: E501
    ("timestamp", "ISO strings", _series([WINDOW.start_utc.isoformat()] * ROWS), False),
    ("timestamp", "object of datetimes", _series([WINDOW.start_utc] * ROWS, object), False),
    ("timestamp", "int64", _series([4711, 2, 3, 4]), False),
    # Sparse columns: Arrow cannot convert them (a raw TypeError before, reported as "details withheld").
    ("int", "sparse int64", _series(pd.arrays.SparseArray([4711, 0, 0, 4])), False),
    ("float", "sparse float64", _series(pd.arrays.SparseArray([4711.5, 0.0, 0.0, 4.0])), False),
    ("bool", "sparse bool", _series(pd.arrays.SparseArray([True, False, False, True])), False),
    ("string", "sparse str", _series(pd.arrays.SparseArray(["4711", "b", "c", "d"])), False),
]


@pytest.mark.parametrize("ordered", [True, False], ids=["arrow-path", "pandas-path"])
@pytest.mark.parametrize(("kind", "holds", "column", "accepted"), KINDS, ids=[f"{k}-{h}" for k, h, _, _ in KINDS])
def test_each_kind_accepts_and_refuses_the_same_columns_whole_or_streamed(kind, holds, column, accepted, ordered):
    frame = frame_with(column, ordered=ordered)
    found = verdicts(frame, schema_of(kind))

    if accepted:
        expected = [v.decode() if isinstance(v, bytes) else v for v in frame.sort_values("at")["v"]]
        assert found["streamed"] == "written" or not ordered, f"a {holds} column is accepted streamed: {found}"
        exported = found["whole"]
        assert isinstance(exported, list), f"a {holds} column is accepted as kind {kind}: {exported}"
        if kind == "timestamp":
            assert [pd.Timestamp(v) for v in exported] == [pd.Timestamp(v) for v in expected], "the same instants"
        else:
            assert [None if pd.isna(v) else v for v in exported] == [None if pd.isna(v) else v for v in expected], (
                "accepted values are exported exactly"
            )
        return
    ways = ["whole", "streamed"] if ordered else ["whole"]  # a stream must arrive ordered: reversed is its own error
    for way in ways:
        message = found[way]
        assert isinstance(message, str), f"a {holds} column is refused for kind {kind} ({way}): exported {message}"
        assert "column 'v'" in message and f"kind {kind!r}" in message, f"the refusal names column and kind: {message}"
        assert "4711" not in message, f"a refusal never quotes a value: {message}"


@pytest.mark.parametrize("dtype", ["bool", "boolean"])
@pytest.mark.parametrize("ordered", [True, False], ids=["arrow-path", "pandas-path"])
def test_booleans_in_a_float_column_are_refused_not_exported_as_one_and_zero(dtype, ordered):
    frame = frame_with(pd.Series([True, False, True, True], dtype=dtype), ordered=ordered)
    with pytest.raises(FrameError) as refused:
        validate_frame(frame, schema_of("float"), WINDOW, "orders/acme")
    assert f"column 'v' must be numeric, found dtype {dtype} (kind 'float'" in str(refused.value)
    stream = validate_batches(FrameBatches([frame]), schema_of("float"), WINDOW, "orders/acme")
    with pytest.raises(FrameError, match=f"batch 1.*column 'v' must be numeric, found dtype {dtype}"):
        write_rows(stream, "csv", _Discarded())


@pytest.mark.parametrize("ordered", [True, False], ids=["arrow-path", "pandas-path"])
def test_a_sparse_column_is_refused_by_name_saying_how_to_make_it_dense(ordered):
    frame = frame_with(pd.Series(pd.arrays.SparseArray([4711, 0, 0, 4])), ordered=ordered)
    with pytest.raises(FrameError) as refused:
        validate_frame(frame, schema_of("int"), WINDOW, "orders/acme")
    message = str(refused.value)
    assert "column 'v' is sparse, found dtype Sparse[int64, 0]" in message, message
    assert ".sparse.to_dense()" in message, f"the refusal says how to export it: {message}"


@pytest.mark.parametrize(
    ("kind", "column"),
    [
        ("float", pd.Series([2**53 + 1, 2, 3, 4])),
        ("int", pd.Series([2**63 + 1, 2, 3, 4], dtype="uint64")),
        ("timestamp", pd.Series(pd.date_range(WINDOW.start_utc, periods=ROWS, freq="h")) + pd.Timedelta(1, "ns")),
    ],
    ids=["float-int-beyond-2**53", "int-uint64-beyond-int64", "timestamp-nanoseconds"],
)
def test_values_that_would_change_in_their_kind_are_refused_as_losing_data(kind, column):
    with pytest.raises(FrameError, match=f"column 'v' holds values that are not of kind '{kind}' \\(converting them "
                       "would lose data\\)"):  # fmt: skip
        validate_frame(frame_with(column), schema_of(kind), WINDOW, "k")


# -- duplicated column names ----------------------------------------------------------------------------------------


def test_a_frame_with_a_repeated_column_is_refused_naming_it_whole_and_streamed():
    frame = frame_with(pd.Series([1.5, 2.0, 3.0, 4.0]))
    repeated = pd.concat([frame, frame[["v"]]], axis=1)
    with pytest.raises(FrameError, match="more than one column named 'v'"):
        validate_frame(repeated, schema_of("float"), WINDOW, "orders/acme")
    stream = validate_batches(FrameBatches([frame.iloc[:2], repeated.iloc[2:]]), schema_of("float"), WINDOW, "k")
    with pytest.raises(FrameError, match=r"k \(batch 2, rows 3-4\): the frame has more than one column named 'v'"):
        write_rows(stream, "csv", _Discarded())


def test_a_repeated_column_the_export_does_not_read_is_left_alone():
    frame = frame_with(pd.Series([1.5, 2.0, 3.0, 4.0]))
    extra = pd.concat([frame, pd.DataFrame({"note": ["a"] * ROWS}), pd.DataFrame({"note": ["b"] * ROWS})], axis=1)
    assert validate_frame(extra, schema_of("float"), WINDOW, "k").column_names == ["id", "at", "v"]


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ({"id_columns": ["order_id", "order_id"]}, "id_columns names 'order_id' more than once"),
        ({"order_by": ["placed_at", "order_id", "placed_at"]}, "order_by names 'placed_at' more than once"),
    ],
)
def test_a_declaration_naming_a_column_twice_is_refused(declared, message):
    with pytest.raises(ConfigurationError, match=f"export 'orders': {message}"):
        ExportSpec(**{**_declaration(), **declared})
    with pytest.raises(ValueError, match="columns names 'v' more than once"):
        ExportSchema([("id", "string"), ("at", "timestamp"), ("v", "float"), ("v", "int")], "at", ("id",))


def _declaration(**overrides) -> dict:
    return dict(
        name="orders",
        columns={"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"},
        id_columns=["order_id"],
        time_column="placed_at",
        tenant_column="tenant",
        tenants=["acme"],
        timezone="America/New_York",
        start_date="2026-03-01",
        **overrides,
    )


def _orders(start: dt.datetime, end: dt.datetime) -> pd.DataFrame:
    times = pd.date_range(pd.Timestamp(start).ceil("h"), pd.Timestamp(end), freq="h", inclusive="left").as_unit("us")
    return pd.DataFrame(
        {
            "order_id": [f"acme-{i:03d}" for i in range(len(times))],
            "tenant": "acme",
            "placed_at": times,
            "total": np.linspace(1.0, 2.0, len(times)),
        }
    )


@pytest.mark.parametrize("repeated", ["placed_at", "total", "tenant"])
def test_an_assets_own_frame_with_a_repeated_column_is_refused_naming_it(tmp_path, repeated):
    partitions = dg.DailyPartitionsDefinition("2026-03-01", timezone="America/New_York")

    @dg.asset(name="orders", partitions_def=partitions, io_manager_key="orders__io_manager")
    def orders_asset(context) -> pd.DataFrame:
        window = context.partition_time_window
        frame = _orders(window.start, window.end)
        return pd.concat([frame, frame[[repeated]]], axis=1)

    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    spec = ExportSpec(**_declaration(source=None))
    defs = ledgered_definitions(
        [spec], assets=[orders_asset], environ={"EXPORTS_LEDGER_URL": ledger_url, "EXPORTS_DESTINATION": str(tmp_path)}
    )
    result = defs.resolve_job_def("orders_job").execute_in_process(
        partition_key="2026-03-08", instance=dg.DagsterInstance.ephemeral(), raise_on_error=False
    )

    assert not result.success
    text = failure_message(result)
    assert f"orders (rows of the asset's frame): the frame has more than one column named '{repeated}'" in text, text
    assert "TypeError" not in text and "AttributeError" not in text, "the problem is named, not a Python error"
    assert published_dirs(tmp_path / "orders") == [], "nothing is published"
    records = open_ledger(ledger_url).queries.records()
    assert all(r.state is not ExportState.COMPLETED for r in records), "no completed record"
