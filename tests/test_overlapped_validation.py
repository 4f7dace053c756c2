"""A whole frame of at least ``OVERLAP_ROWS`` rows is written on a second thread while its ids are hashed and checked
(issue #21: validation at the writer's speed). What readers and the ledger see must not change: a refused frame
leaves nothing staged or published and no ``completed`` record, and an accepted one is the same bytes, sha256 and
fingerprint as when it is checked first."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from builders import INVOICES_SCHEMA as INVOICES
from builders import invoices_frame as invoices
from builders import open_ledger
from pipeline_helpers import places, published_dirs

from export_ledger import stage
from export_ledger.destinations import LocalDestination
from export_ledger.errors import FrameError
from export_ledger.keys import LogicalKey
from export_ledger.ledger.schema import ExportState, export_runs
from export_ledger.protocol import ExportItem, export_key

ROWS = stage.OVERLAP_ROWS  # the smallest frame that is written while its ids are checked
KEY = LogicalKey("invoice_export", "acme", __import__("test_validation_speed_equivalence").WINDOW)


def _export(tmp_path, name: str, frame, file_format: str = "csv"):
    ledger = open_ledger(f"sqlite:///{tmp_path / f'{name}.sqlite3'}")
    destination = LocalDestination(tmp_path / name)
    item = ExportItem(KEY, KEY.window.business_date.isoformat(), frame)
    return ledger, destination, export_key(ledger, destination, INVOICES, item, "run-1/step", file_format=file_format)


@pytest.mark.parametrize("file_format", ["csv", "parquet"])
def test_a_frame_written_while_its_ids_are_checked_is_the_same_export_as_one_checked_first(
    tmp_path, monkeypatch, file_format
):
    first, _, overlapped = _export(tmp_path, "overlapped", invoices(ROWS), file_format)
    monkeypatch.setattr(stage, "OVERLAP_ROWS", 10**9)  # the same frame, checked whole before it is written
    second, _, sequential = _export(tmp_path, "sequential", invoices(ROWS), file_format)
    assert overlapped.status == sequential.status == "exported"
    assert (overlapped.sha256, overlapped.row_count) == (sequential.sha256, ROWS)
    fingerprints = []
    for ledger in (first, second):
        with ledger.atomic(read_only=True) as conn:
            fingerprints.append(conn.execute(sa.select(export_runs.c.source_fingerprint)).scalar_one())
    assert fingerprints[0] == fingerprints[1] and fingerprints[0], "the same stored fingerprint"


def test_a_duplicate_id_found_while_the_file_is_written_leaves_nothing_staged_or_published(tmp_path, monkeypatch):
    written = []
    stage = LocalDestination.stage

    def spy(self, *args, **kwargs):
        staged = stage(self, *args, **kwargs)
        written.append(staged)  # the second thread did write the place before the refusal removed it
        return staged

    monkeypatch.setattr(LocalDestination, "stage", spy)
    frame = invoices(ROWS)
    frame.loc[ROWS - 1, "invoice_id"] = frame.loc[0, "invoice_id"]
    with pytest.raises(FrameError, match="share their invoice_id with another"):
        _export(tmp_path, "dup", frame)
    assert len(written) == 1, "the place was written on the second thread"
    assert published_dirs(tmp_path / "dup") == [] and places(tmp_path / "dup") == [], "nothing staged or published"
    ledger = open_ledger(f"sqlite:///{tmp_path / 'dup.sqlite3'}")
    (record,) = ledger.queries.records()
    assert record.state is ExportState.FAILED, "refused rows: failed, safe to retry"


def test_a_frame_refused_before_its_ids_are_checked_is_never_written(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(LocalDestination, "stage", lambda *a, **k: written.append(1))
    frame = invoices(ROWS)
    frame.loc[7, "occurred_at"] = frame.loc[7, "occurred_at"] - dt.timedelta(days=2)
    with pytest.raises(FrameError, match="fall outside the window"):
        _export(tmp_path, "outside", frame)
    assert written == [], "the first step refused it: no write was started"
