"""A stream into the ledger-table destination (issue #21): batch by batch inside the one completion transaction.

The rows of a streamed key go into the ledger's database as they are validated, in INSERTs of at most
``INSERT_ROWS`` rows, never gathered into one table; the manifest row and the completion record commit with them.
Bad input anywhere in the stream rolls back the rows already inserted: nothing is stored and no completion recorded.
"""

from __future__ import annotations

import io

import pandas as pd
import pytest
import sqlalchemy as sa
from builders import STREAM_DAY as DAY
from builders import STREAM_KEY as KEY
from builders import STREAM_SCHEMA as SCHEMA
from builders import open_ledger
from builders import split_frame as split
from builders import stream_orders as orders

from export_ledger import FrameError
from export_ledger.destinations import table as table_destination
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.frames import FrameBatches, validate_frame, write_table
from export_ledger.ledger.schema import AttemptOutcome, ExportState
from export_ledger.protocol import ExportItem, export_key

TABLE = "streamed_orders"


class Journal:
    """What happened, in order: each batch as the stream hands it over, each INSERT into the rows table."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def batches(self, frames: list[pd.DataFrame]):
        for number, frame in enumerate(frames, start=1):
            self.events.append(("batch", number))
            yield frame

    def before_execute(self, conn, clauseelement, multiparams, params, execution_options) -> None:
        if isinstance(clauseelement, sa.Insert) and clauseelement.table.name == TABLE:
            self.events.append(("insert", len(multiparams) if multiparams else 1))

    @property
    def inserts(self) -> list[int]:
        return [rows for kind, rows in self.events if kind == "insert"]


@pytest.fixture
def journal():
    journal = Journal()
    sa.event.listen(sa.engine.Engine, "before_execute", journal.before_execute)
    try:
        yield journal
    finally:
        sa.event.remove(sa.engine.Engine, "before_execute", journal.before_execute)


def export(ledger_url: str, frame, attempt: str = "run-1/export"):
    ledger = open_ledger(ledger_url)
    destination = SqlTableDestination(url=ledger_url, table=TABLE)
    return ledger, export_key(ledger, destination, SCHEMA, ExportItem(KEY, DAY.isoformat(), frame), attempt)


def stored(ledger_url: str) -> dict[str, int]:
    """Rows in the rows table and in its manifests table (0 when a table does not exist)."""
    engine = sa.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            return {
                name: conn.execute(sa.select(sa.func.count()).select_from(sa.table(name))).scalar_one()
                if inspector.has_table(name)
                else 0
                for name in (TABLE, f"{TABLE}_manifests")
            }
    finally:
        engine.dispose()


def test_a_streamed_key_is_inserted_batch_by_batch_as_the_whole_frame_would_be(
    ledger_url: str, journal: Journal, monkeypatch
) -> None:
    monkeypatch.setattr(table_destination, "INSERT_ROWS", 50)
    ledger, result = export(ledger_url, FrameBatches(journal.batches(split(orders(250), 120))))

    assert result.status == "exported" and result.row_count == 250
    assert ledger.queries.get(str(KEY)).state is ExportState.COMPLETED
    assert stored(ledger_url) == {TABLE: 250, f"{TABLE}_manifests": 1}
    assert journal.inserts == [50, 50, 20, 50, 50, 20, 10], "each batch in INSERTs of at most INSERT_ROWS rows"
    assert journal.events.index(("insert", 50)) < journal.events.index(("batch", 2)), (
        "the first batch's rows go in before the next batch is read: the stream is never gathered"
    )
    whole = write_table(validate_frame(orders(250), SCHEMA, KEY.window, "whole", "acme"), "csv", io.BytesIO())
    assert result.sha256 == whole, "the sha256 of the rows' CSV, as for the whole frame"


def test_a_whole_frame_is_inserted_in_slices_of_insert_rows(ledger_url: str, journal: Journal, monkeypatch) -> None:
    monkeypatch.setattr(table_destination, "INSERT_ROWS", 80)
    _, result = export(ledger_url, orders(200))

    assert result.row_count == 200 and journal.inserts == [80, 80, 40]
    assert stored(ledger_url) == {TABLE: 200, f"{TABLE}_manifests": 1}


def _null_id_in_batch_3(frames: list[pd.DataFrame]) -> str:
    frames[2].loc[5, "order_id"] = None
    return r"batch 3, rows 101-150\): column 'order_id' has 1 null value"


def _outside_the_window_in_batch_3(frames: list[pd.DataFrame]) -> str:
    frames[2].loc[10, "placed_at"] = pd.Timestamp(KEY.window.end_utc) + pd.Timedelta(hours=1)
    return r"batch 3, rows 101-150\): 1 event\(s\) fall outside the window"


def _repeated_id_found_after_the_last_batch(frames: list[pd.DataFrame]) -> str:
    frames[3].loc[0, "order_id"] = "o000003"  # batch 1's id again, far from it in time: found by the digests
    return r"1 row\(s\) repeat the order_id values of an earlier row"


@pytest.mark.parametrize(
    "spoil", [_null_id_in_batch_3, _outside_the_window_in_batch_3, _repeated_id_found_after_the_last_batch]
)
def test_bad_input_mid_stream_rolls_back_the_rows_already_inserted(ledger_url: str, journal: Journal, spoil) -> None:
    frames = split(orders(200), 50)
    message = spoil(frames)

    with pytest.raises(FrameError, match=message):
        export(ledger_url, FrameBatches(journal.batches(frames)))

    assert journal.inserts[:2] == [50, 50], "the batches before the bad one were inserted"
    assert stored(ledger_url) == {TABLE: 0, f"{TABLE}_manifests": 0}, "and rolled back with the transaction"
    ledger = open_ledger(ledger_url)
    assert ledger.queries.get(str(KEY)).state is ExportState.FAILED
    assert [a.outcome for a in ledger.queries.attempts(str(KEY))] == [AttemptOutcome.FAILED]

    _, retried = export(ledger_url, orders(200), attempt="run-2/export")
    assert retried.status == "exported" and stored(ledger_url) == {TABLE: 200, f"{TABLE}_manifests": 1}
