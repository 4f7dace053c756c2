"""Streaming exports (issue #13): a key's rows as batches (:class:`FrameBatches`), validated, written and hashed
batch by batch, from a source that yields them (``SqlSource.batches`` on a server-side cursor).

The streamed file is the whole-frame path's file for the same rows (CSV byte for byte; Parquet the same rows in row
groups per batch); order and uniqueness are checked across batches; bad input anywhere in the stream publishes
nothing and records no completion.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from builders import STREAM_DAY as DAY
from builders import STREAM_KEY as KEY
from builders import STREAM_SCHEMA as SCHEMA
from builders import key_for, open_ledger
from builders import split_frame as split
from builders import stream_orders as orders
from pipeline_helpers import current_data_file, published_dirs, read_export, stored_objects

from export_ledger import FrameError, SqlSource, frames
from export_ledger.destinations import LocalDestination
from export_ledger.frames import (
    ExportSchema,
    FrameBatches,
    validate_batches,
    validate_frame,
    write_rows,
    write_table,
)
from export_ledger.ledger.schema import AttemptOutcome, ExportState
from export_ledger.protocol import ExportBatch, ExportItem, export_batch, export_key
from export_ledger.sources import CallableSource


def export(tmp_path: Path, frame, *, file_format: str = "csv", attempt: str = "run-1/export"):
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    destination = LocalDestination(str(tmp_path / "exports"))
    item = ExportItem(KEY, DAY.isoformat(), frame)
    return ledger, export_key(ledger, destination, SCHEMA, item, attempt, file_format=file_format)


@pytest.mark.parametrize("size", [1, 7, 64, 500])
def test_a_streamed_csv_is_byte_for_byte_the_whole_frame_file(size: int) -> None:
    frame = orders()
    whole = io.BytesIO()
    whole_sha = write_table(validate_frame(frame, SCHEMA, KEY.window, "whole", "acme"), "csv", whole)
    streamed = io.BytesIO()
    stream = validate_batches(FrameBatches(split(frame, size)), SCHEMA, KEY.window, "streamed", "acme")
    sha, rows = write_rows(stream, "csv", streamed)
    assert streamed.getvalue() == whole.getvalue()
    assert (sha, rows) == (whole_sha, len(frame)) and sha == hashlib.sha256(streamed.getvalue()).hexdigest()


def test_a_streamed_parquet_file_holds_the_same_rows_in_a_row_group_per_batch() -> None:
    frame = orders()
    sink = io.BytesIO()
    sha, rows = write_rows(
        validate_batches(FrameBatches(split(frame, 64)), SCHEMA, KEY.window, "streamed", "acme"), "parquet", sink
    )
    parquet = pq.ParquetFile(io.BytesIO(sink.getvalue()))
    assert parquet.metadata.num_row_groups == 4 and rows == 200
    assert parquet.read().to_pandas().equals(frame)
    assert sha == hashlib.sha256(sink.getvalue()).hexdigest()


def test_export_key_publishes_a_stream_like_a_frame(tmp_path: Path) -> None:
    ledger, result = export(tmp_path / "streamed", FrameBatches(split(orders(), 30)))
    _, whole = export(tmp_path / "whole", orders())
    assert result.status == "exported" and result.row_count == 200
    assert result.sha256 == whole.sha256, "the same rows make the same file, streamed or whole"
    (folder,) = published_dirs(tmp_path / "streamed" / "exports")
    manifest, _ = read_export(folder)  # what the key's pointer names
    assert (manifest.row_count, manifest.sha256) == (200, result.sha256)
    assert ledger.queries.get(str(KEY)).state is ExportState.COMPLETED


def _duplicate_at_another_time() -> list[pd.DataFrame]:
    frame = orders()
    frame.loc[150, "order_id"] = "o000003"  # a repeat of batch 1's id, far from it in time: not a neighbour
    return split(frame, 50)


def _outside_the_window() -> list[pd.DataFrame]:
    batches = split(orders(), 50)
    batches[2].loc[10, "placed_at"] = pd.Timestamp(KEY.window.end_utc) + pd.Timedelta(hours=1)
    return batches


def _out_of_order_across_batches() -> list[pd.DataFrame]:
    batches = split(orders(), 50)
    return [batches[0], batches[2], batches[1], batches[3]]


def _out_of_order_inside_a_batch() -> list[pd.DataFrame]:
    batches = split(orders(), 50)
    batches[1] = batches[1].iloc[::-1].reset_index(drop=True)
    return batches


def _neighbours_with_one_id() -> list[pd.DataFrame]:
    frame = orders()
    frame.loc[101, "order_id"] = frame.loc[100, "order_id"]  # same timestamp, same id: neighbours
    return split(frame, 50)


def _null_in_the_last_batch() -> list[pd.DataFrame]:
    batches = split(orders(), 50)
    batches[3].loc[49, "total"] = None
    return batches


def _not_a_frame() -> list:
    return [*split(orders(), 50)[:2], [{"order_id": "x"}]]


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        (_duplicate_at_another_time, r"1 row\(s\) repeat the order_id values of an earlier row"),
        (_outside_the_window, r"batch 3, rows 101-150\): 1 event\(s\) fall outside the window"),
        (_out_of_order_across_batches, "first row sorts before the previous batch's last row"),
        (_out_of_order_inside_a_batch, r"batch 2, rows 51-100\): rows are not in file order"),
        (_neighbours_with_one_id, r"row\(s\) share their order_id with another \(rows 102\)"),
        (_null_in_the_last_batch, r"batch 4, rows 151-200\): column 'total' has 1 null value"),
        (_not_a_frame, "expected a pandas DataFrame, got list"),
    ],
)
def test_bad_input_anywhere_in_a_stream_publishes_nothing_and_records_no_completion(
    tmp_path: Path, batches, message: str
) -> None:
    with pytest.raises(FrameError, match=message):
        export(tmp_path, FrameBatches(batches()))
    root = tmp_path / "exports"
    assert published_dirs(root) == []
    assert stored_objects(root) == [], "the partly written data file was discarded: nothing of the attempt is left"
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    assert ledger.queries.get(str(KEY)).state is ExportState.FAILED
    assert [a.outcome for a in ledger.queries.attempts(str(KEY))] == [AttemptOutcome.FAILED]


def test_a_stream_can_be_exported_once_and_its_order_columns_must_not_be_nullable(tmp_path: Path) -> None:
    batches = FrameBatches(split(orders(), 50))
    list(batches)
    with pytest.raises(FrameError, match="already read"):
        list(batches)
    nullable_order = ExportSchema(SCHEMA.columns, "placed_at", ("order_id",), order_by=("total",), nullable={"total"})
    with pytest.raises(FrameError, match=r"nullable columns \['total'\]"):
        validate_batches(FrameBatches([]), nullable_order, KEY.window, "orders")


def _source_table(url: str) -> None:
    engine = sa.create_engine(url)
    frame = orders(1_000, every="1min")
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS stream_orders")
        conn.exec_driver_sql(
            "CREATE TABLE stream_orders (order_id TEXT, tenant TEXT, placed_at "
            + ("TIMESTAMPTZ" if engine.dialect.name == "postgresql" else "TEXT")
            + ", total DOUBLE PRECISION)"
        )
        rows = frame.assign(placed_at=frame["placed_at"].dt.tz_localize(None).astype(str))
        conn.execute(
            sa.text("INSERT INTO stream_orders VALUES (:order_id, :tenant, :placed_at, :total)"),
            rows.to_dict("records") if engine.dialect.name == "sqlite" else frame.to_dict("records"),
        )
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def source_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'source.sqlite3'}"
    return request.getfixturevalue("postgres_url")


def test_sql_source_streams_bounded_batches_and_exports_the_file_the_whole_frame_path_writes(
    tmp_path: Path, source_url: str
) -> None:
    _source_table(source_url)
    collate = ' COLLATE "C"' if source_url.startswith("postgresql") else ""
    source = SqlSource(
        source_url,
        "SELECT order_id, tenant, placed_at, total FROM stream_orders WHERE tenant = :tenant "
        f"AND placed_at >= :start AND placed_at < :end ORDER BY placed_at, order_id{collate}",
    )
    start, end = KEY.window.start_utc, KEY.window.end_utc
    batches = list(source.batches("acme", start, end, schema=SCHEMA, batch_rows=128))
    assert [len(b) for b in batches] == [128] * 7 + [104]
    assert all(isinstance(b["placed_at"].dtype, pd.DatetimeTZDtype) for b in batches)

    streamed = ExportItem.streamed(KEY, DAY.isoformat(), source, SCHEMA, batch_rows=128)
    _, result = export(tmp_path / "streamed", streamed.frame)
    whole = source.conform(source.rows("acme", start, end), SCHEMA)
    _, expected = export(tmp_path / "whole", whole)
    assert (result.row_count, result.sha256) == (1_000, expected.sha256)


def test_sql_source_errors_while_streaming_name_the_database_not_the_values(source_url: str) -> None:
    source = SqlSource(source_url, "SELECT * FROM missing WHERE tenant = :tenant AND t >= :start AND t < :end")
    with pytest.raises(Exception, match="cannot stream the source query on") as raised:
        list(source.batches("acme", KEY.window.start_utc, KEY.window.end_utc))
    assert "acme" not in str(raised.value)


def test_an_empty_stream_exports_an_empty_file_with_its_header(tmp_path: Path) -> None:
    _, result = export(tmp_path, FrameBatches([]))
    (folder,) = published_dirs(tmp_path / "exports")
    assert result.row_count == 0
    assert current_data_file(folder).read_bytes() == b'"order_id","tenant","placed_at","total"\n'


def test_a_streamed_key_in_a_run_is_claimed_alone_when_its_turn_comes(tmp_path: Path) -> None:
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    before, streamed, after = (key_for(DAY, tenant=t) for t in ("before", "acme", "after"))
    seen: dict[str, object] = {}

    def batches():
        # What the ledger holds when the stream is first read: the keys before it are done, the next is untouched.
        seen["before"] = ledger.queries.get(str(before)).state
        seen["after"] = ledger.queries.get(str(after))
        yield from split(orders(), 64)

    def frame_of(key) -> pd.DataFrame:
        return orders(10).assign(tenant=key.tenant, order_id=lambda f: key.tenant + f["order_id"])

    batch = ExportBatch(
        SCHEMA,
        [
            ExportItem(before, DAY.isoformat(), frame_of(before)),
            ExportItem(streamed, DAY.isoformat(), FrameBatches(batches())),
            ExportItem(after, DAY.isoformat(), frame_of(after)),
        ],
    )
    results = export_batch(ledger, LocalDestination(str(tmp_path / "exports")), batch, "run-1/export")
    assert [r.status for r in results] == ["exported"] * 3
    assert seen == {"before": ExportState.COMPLETED, "after": None}
    assert results[1].row_count == 200


def test_a_declared_callable_source_that_yields_batches_is_streamed(tmp_path: Path) -> None:
    calls = []

    def read(tenant: str, start: dt.datetime, end: dt.datetime):
        calls.append(tenant)
        yield from split(orders(), 25)

    item = ExportItem.streamed(KEY, DAY.isoformat(), CallableSource(read), SCHEMA)
    assert calls == [], "nothing is read before the export runs"
    _, result = export(tmp_path, item.frame)
    assert calls == ["acme"] and result.row_count == 200
    _, whole = export(tmp_path / "whole", orders())
    assert result.sha256 == whole.sha256


def test_a_stream_to_s3_publishes_the_whole_frame_objects_and_a_bad_one_leaves_nothing(
    tmp_path: Path, s3_server: str, s3_bucket: str, s3_credentials: dict, monkeypatch
) -> None:
    import boto3

    from export_ledger.destinations.s3 import S3Destination

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the S3 destination stages in a local folder of its own
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)
    destination = S3Destination(
        bucket=s3_bucket,
        prefix="streams",
        endpoint_url=s3_server,
        access_key_id="testing",
        secret_access_key="testing",
    )
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    result = export_key(
        ledger, destination, SCHEMA, ExportItem(KEY, DAY.isoformat(), FrameBatches(split(orders(), 30))), "run-1/export"
    )
    _, whole = export(tmp_path / "whole", orders())
    assert (result.row_count, result.sha256) == (200, whole.sha256)

    other = key_for(DAY, tenant="globex")
    bad = [batch.assign(tenant="globex", order_id=lambda f: "g" + f["order_id"]) for batch in split(orders(), 50)]
    bad[3].loc[4, "order_id"] = bad[0].loc[4, "order_id"]  # the first of a timestamp pair: still in order
    with pytest.raises(FrameError, match="repeat the order_id values"):
        export_key(ledger, destination, SCHEMA, ExportItem(other, DAY.isoformat(), FrameBatches(bad)), "run-1/export")
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    names = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    client.close()
    assert names and not [n for n in names if "tenant=globex" in n], "nothing of the bad stream was uploaded"
    assert ledger.queries.get(str(other)).state is ExportState.FAILED
    staging = tmp_path / "tmp" / "export-ledger-s3-staging"
    assert not list(staging.iterdir()), "the partly written local staging file was removed"


def test_a_repeated_id_is_found_across_a_long_stream() -> None:
    """Thousands of rows in many batches (the digests' array grows several times): the first id comes back last."""
    frame = orders(6_000, every="10s")
    stream = validate_batches(FrameBatches(split(frame, 500)), SCHEMA, KEY.window, "long", "acme")
    assert write_rows(stream, "csv", io.BytesIO())[1] == 6_000
    frame.loc[5_998, "order_id"] = "o000000"
    stream = validate_batches(FrameBatches(split(frame, 500)), SCHEMA, KEY.window, "long", "acme")
    with pytest.raises(FrameError, match=r"long: 1 row\(s\) repeat the order_id values"):
        write_rows(stream, "csv", io.BytesIO())


def test_a_long_stream_spills_its_digests_to_files_removed_after_the_check(tmp_path: Path, monkeypatch) -> None:
    """Past the digests held in memory (issue #21: memory flat in the row count), they are spilled to temporary
    files: a repeat is still found, and the files are gone afterwards, whether the stream passed or failed."""
    monkeypatch.setattr(frames, "_DIGESTS_IN_MEMORY", 1_000)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    frame = orders(6_000, every="10s")
    spilled = []
    monkeypatch.setattr(frames._Digests, "_spill", _recorded(frames._Digests._spill, spilled))
    stream = validate_batches(FrameBatches(split(frame, 500)), SCHEMA, KEY.window, "long", "acme")
    assert write_rows(stream, "csv", io.BytesIO())[1] == 6_000
    assert sum(spilled) == 6_000, "every digest went to the files once the first 1,000 were exceeded"
    assert list(tmp_path.iterdir()) == [], "the spilled digests' files are removed after the check"

    frame.loc[5_998, "order_id"] = "o000000"
    stream = validate_batches(FrameBatches(split(frame, 500)), SCHEMA, KEY.window, "long", "acme")
    with pytest.raises(FrameError, match=r"long: 1 row\(s\) repeat the order_id values"):
        write_rows(stream, "csv", io.BytesIO())
    frame.loc[5_998, "order_id"] = "o005998"
    frame.loc[3_000, "total"] = None
    stream = validate_batches(FrameBatches(split(frame, 500)), SCHEMA, KEY.window, "long", "acme")
    with pytest.raises(FrameError, match=r"batch 7, rows 3001-3500\): column 'total' has 1 null") as refused:
        write_rows(stream, "csv", io.BytesIO())
    # Checked while the refusal (whose traceback holds the stream's frame) is alive, as it is for its caller.
    assert refused.traceback and list(tmp_path.iterdir()) == [], "and after a refusal, found at the end or mid-stream"


def _recorded(spill, sizes: list[int]):
    def recording(self, values):
        sizes.append(len(values))
        return spill(self, values)

    return recording
