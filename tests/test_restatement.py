"""Restatements as revisions: a completed key gets revision N + 1 beside revision N, never an overwrite.

The ledger side (requests, the ``restate`` claim, the revisions table, withdrawal, rerun counting) on SQLite and
PostgreSQL, and the protocol on the local destination: the current pointer, repair after a crash at every named
point, reconciliation, and two concurrent restatements of one key.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from export_ledger.destinations import LocalDestination
from export_ledger.destinations.base import CURRENT_NAME, ExportTarget
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import (
    AlreadyCompleted,
    ExportLedger,
    ExportState,
    LeaseHeld,
    RestatementRefused,
)
from export_ledger.ledger.schema import AttemptOutcome
from export_ledger.protocol import ExportItem, export_key
from export_ledger.reconcile import reconcile_batch
from tests.builders import key_for
from tests.test_batched_ledger import SCHEMA, orders

DAY = dt.date(2026, 3, 2)


def item(key, frame: pd.DataFrame | None = None) -> ExportItem:
    return ExportItem(key, key.window.business_date.isoformat(), orders(key) if frame is None else frame)


def corrected(key) -> pd.DataFrame:
    """The key's rows after a correction: one amount changed, one late row added."""
    frame = orders(key)
    frame.loc[0, "total"] = 99.0
    late = frame.iloc[[-1]].copy()
    late["order_id"] = f"{key.tenant}-late"
    late["placed_at"] = late["placed_at"] - pd.Timedelta(minutes=30)
    return pd.concat([frame, late]).sort_values("placed_at", kind="stable").reset_index(drop=True)


def key_folder(root: Path, key) -> Path:
    return root / key.export / f"tenant={key.tenant}" / f"date={key.window.business_date.isoformat()}"


def current_of(root: Path, key) -> tuple[int, Path]:
    """What an outside reader does: follow ``_current.json`` (absent: revision 1 is the key's folder)."""
    folder = key_folder(root, key)
    pointer = folder / CURRENT_NAME
    if not pointer.exists():
        return 1, folder
    values = json.loads(pointer.read_text())
    return values["revision"], folder / values["path"]


def read_revision(folder: Path) -> tuple[Manifest, bytes]:
    manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes(), str(folder))
    payload = (folder / manifest.data_file).read_bytes()
    assert hashlib.sha256(payload).hexdigest() == manifest.sha256
    return manifest, payload


@pytest.fixture
def ledger(ledger_url, clock) -> ExportLedger:
    return ExportLedger(ledger_url, clock=clock, lease_ttl=dt.timedelta(minutes=15))


@pytest.fixture
def destination(tmp_path) -> LocalDestination:
    return LocalDestination(str(tmp_path / "exports"))


def first_export(ledger, destination, key) -> None:
    result = export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    assert result.status == "exported"


# -- the ledger ---------------------------------------------------------------------------------------------------


def test_a_request_needs_a_reason_and_a_completed_key_and_stays_single(ledger, destination) -> None:
    key = key_for(DAY)
    with pytest.raises(RestatementRefused, match="unknown logical key"):
        ledger.request_restatement(str(key), reason="late invoices", requested_by="ops")
    claim = ledger.claim(key, "run-1/export")
    with pytest.raises(RestatementRefused, match="is in_progress: only a completed key is restated"):
        ledger.request_restatement(str(key), reason="late invoices", requested_by="ops")
    ledger.fail(claim, RuntimeError("source down"))
    first_export(ledger, destination, key)
    with pytest.raises(RestatementRefused, match="needs a reason"):
        ledger.request_restatement(str(key), reason="   ", requested_by="ops")
    request = ledger.request_restatement(str(key), reason="late invoices", requested_by="ops")
    assert (request.revision, request.reason, request.requested_by) == (2, "late invoices", "ops")
    with pytest.raises(RestatementRefused, match="already has an open restatement \\(revision 2"):
        ledger.request_restatement(str(key), reason="again", requested_by="ops")
    # Recorded first: the key is still completed with revision 1, whose row now starts the history.
    assert ledger.get(str(key)).state is ExportState.COMPLETED
    (first,) = ledger.revisions(str(key))
    assert (first.revision, first.reason, first.published_by) == (1, "first export", "run-1/export")


def test_restating_publishes_revision_2_beside_revision_1_and_moves_the_pointer(ledger, destination) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    original_manifest, original = read_revision(key_folder(root, key))
    assert "revision" not in json.loads((key_folder(root, key) / MANIFEST_NAME).read_text()), "0.3.0's bytes"

    # Without a request, a rerun changes nothing.
    again = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    assert again.status == "already_completed" and current_of(root, key)[0] == 1

    ledger.request_restatement(str(key), reason="invoice amounts corrected", requested_by="ops")
    result = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    assert result.status == "exported" and result.row_count == len(corrected(key))

    revision, folder = current_of(root, key)
    assert revision == 2 and folder == key_folder(root, key) / "revision=2"
    manifest, payload = read_revision(folder)
    assert (manifest.revision, manifest.supersedes_revision, manifest.supersedes_sha256) == (
        2,
        1,
        original_manifest.sha256,
    )
    # Revision 1 is still there, byte for byte.
    assert read_revision(key_folder(root, key)) == (original_manifest, original)

    record = ledger.get(str(key))
    assert record.state is ExportState.COMPLETED and record.sha256 == manifest.sha256
    assert record.location == str(folder)
    history = ledger.revisions(str(key))
    assert [(r.revision, r.sha256, r.supersedes_revision, r.reason) for r in history] == [
        (1, original_manifest.sha256, None, "first export"),
        (2, manifest.sha256, 1, "invoice amounts corrected"),
    ]
    assert history[1].requested_by == "ops" and history[1].published_by == "run-3/export"
    assert ledger.open_restatements([str(key)]) == {}
    # Done: the next run skips it, and a second restatement is revision 3.
    assert export_key(ledger, destination, SCHEMA, item(key), "run-4/export").status == "already_completed"
    assert ledger.request_restatement(str(key), reason="again", requested_by="ops").revision == 3


def test_a_restatement_that_fails_before_publishing_keeps_revision_1_current_and_is_rerun(
    ledger, destination, monkeypatch
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    request = ledger.request_restatement(str(key), reason="fix", requested_by="ops")
    bad = corrected(key).drop(columns=["total"])
    with pytest.raises(Exception, match="total"):
        export_key(ledger, destination, SCHEMA, item(key, bad), "run-2/export")
    record = ledger.get(str(key))
    assert record.state is ExportState.FAILED
    assert current_of(Path(destination.root), key)[0] == 1
    # Its reruns count from the request, not from the key's first claim.
    assert ledger.rerun_bases([str(key)]) == {str(key): request.base_token}
    assert [r.logical_key for r in ledger.failed(limit=10, max_attempts=3)] == [str(key)]
    assert ledger.current_revision(str(key)).revision == 1
    result = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    assert result.status == "exported" and current_of(Path(destination.root), key)[0] == 2


def test_a_withdrawn_restatement_returns_the_key_to_completed_with_its_current_revision(ledger, destination) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    before = ledger.get(str(key))
    ledger.request_restatement(str(key), reason="fix", requested_by="ops")
    with pytest.raises(Exception, match="total"):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key).drop(columns=["total"])), "run-2/export")
    with pytest.raises(RestatementRefused, match="needs a reason"):
        ledger.withdraw_restatement(str(key), operator="ops", reason="")
    after = ledger.withdraw_restatement(str(key), operator="ops", reason="source cannot be fixed this week")
    assert after.state is ExportState.COMPLETED
    assert (after.sha256, after.location, after.row_count) == (before.sha256, before.location, before.row_count)
    assert ledger.open_restatements([str(key)]) == {}
    (closed,) = ledger.restatements(logical_keys=[str(key)], open_only=False)
    assert closed.outcome == "withdrawn"
    assert ledger.operator_log()[-1]["action"] == "withdraw-restatement"
    assert export_key(ledger, destination, SCHEMA, item(key), "run-3/export").status == "already_completed"
    with pytest.raises(RestatementRefused, match="no open restatement"):
        ledger.withdraw_restatement(str(key), operator="ops", reason="twice")


@pytest.mark.parametrize("point", ["after_claim", "after_stage", "after_publish", "after_current", "before_commit"])
def test_a_restatement_killed_at_any_point_leaves_one_current_revision_and_is_finished(
    ledger, destination, clock, monkeypatch, point
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    _, original = read_revision(key_folder(root, key))
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)

    # Whatever was reached, readers see exactly one intact revision, and revision 1 is untouched.
    revision, folder = current_of(root, key)
    read_revision(folder)
    assert read_revision(key_folder(root, key))[1] == original
    assert revision == (2 if point in ("after_current", "before_commit") else 1)

    # A retry during the dead attempt's lease is refused; after it, reconciliation finishes or fails the key.
    with pytest.raises(LeaseHeld):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    clock.advance(minutes=16)
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    record = ledger.get(str(key))
    if point in ("after_claim", "after_stage"):
        assert record.state is ExportState.FAILED
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-4/export")
    assert ledger.get(str(key)).state is ExportState.COMPLETED
    revision, folder = current_of(root, key)
    manifest, _ = read_revision(folder)
    assert revision == 2 and manifest.revision == 2 and ledger.get(str(key)).sha256 == manifest.sha256
    assert [r.revision for r in ledger.revisions(str(key))] == [1, 2]
    assert sorted(p.name for p in key_folder(root, key).iterdir() if p.name.startswith("revision=")) == ["revision=2"]


def test_a_restatement_whose_pointer_move_fails_is_remote_unknown_and_reconciled(
    ledger, destination, clock, monkeypatch
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, "after_current=raise")
    with pytest.raises(Exception, match="unknown"):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)
    assert ledger.get(str(key)).state is ExportState.REMOTE_UNKNOWN
    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    assert [r.state for r in report.resolved_to(ExportState.COMPLETED)] == [ExportState.COMPLETED]
    assert [r.revision for r in ledger.revisions(str(key))] == [1, 2]
    assert current_of(Path(destination.root), key)[0] == 2


def test_two_concurrent_restatements_of_one_key_make_one_revision(ledger, destination, clock) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    # The first claim stalls (its lease runs out) after publishing; the second takes over, repairs, moves the pointer.
    slow = ledger.claim(key, "run-2/export")
    assert slow.revision == 2 and slow.supersedes[0] == 1
    clock.advance(minutes=16)
    fast = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    assert fast.status == "exported"
    # The stalled attempt wakes and publishes revision 2 too: the place is taken, nothing is replaced or recorded.
    target = ExportTarget(key.export, key.tenant, DAY.isoformat(), 2)
    before = sorted(p.name for p in key_folder(Path(destination.root), key).iterdir())
    from export_ledger.frames import validate_frame

    table = validate_frame(corrected(key), SCHEMA, slow.window, what=str(key))
    manifest = Manifest.build(
        logical_key=str(key), export=key.export, tenant=key.tenant, window=slow.window, row_count=0, sha256="",
        attempt_id=slow.attempt_id, fencing_token=slow.fencing_token, data_file="data.csv",
        tz_database=slow.tz_database, revision=2, supersedes=slow.supersedes,
    )  # fmt: skip
    staged = destination.stage(target, table, "csv", manifest)
    with pytest.raises(Exception, match="already published"):
        destination.publish(staged)
    destination.discard(staged)
    assert sorted(p.name for p in key_folder(Path(destination.root), key).iterdir()) == before
    outcomes = [a.outcome for a in ledger.attempts(str(key))]
    assert outcomes.count(AttemptOutcome.COMPLETED) == 2  # revision 1, then revision 2: one each
    assert [r.revision for r in ledger.revisions(str(key))] == [1, 2]


def test_the_pointer_refuses_a_lost_update(destination, ledger) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    target = ExportTarget(key.export, key.tenant, DAY.isoformat(), 3)
    manifest = Manifest.from_json((key_folder(Path(destination.root), key) / MANIFEST_NAME).read_bytes(), "m")
    from export_ledger.destinations.base import PointerMoved

    with pytest.raises(PointerMoved, match="points at revision 1, not at revision 2"):
        destination.move_current(target, manifest, supersedes=2)
    assert destination.current(target) == 1


def test_claims_of_a_completed_key_without_a_request_stay_already_completed(ledger, destination) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    (outcome,) = ledger.claim_many([key], "run-2/export")
    assert isinstance(outcome, AlreadyCompleted)
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    (outcome,) = ledger.claim_many([key], "run-3/export")
    assert outcome.revision == 2 and outcome.previous_state is ExportState.COMPLETED


def test_an_operator_resolves_a_restatement_at_the_revision_it_publishes(ledger, destination, clock) -> None:
    from export_ledger.resolve import resolve_key

    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    # An attempt published revision 2 and died before moving the pointer; a person accepts it.
    claim = ledger.claim(key, "run-2/export")
    from export_ledger.protocol import _KeyExport

    exporter = _KeyExport(ledger, destination, SCHEMA, "csv", lambda level, message: None)
    target = ExportTarget(key.export, key.tenant, DAY.isoformat(), 2)
    exporter._publish(claim, item(key, corrected(key)), target)
    assert current_of(root, key)[0] == 1
    clock.advance(minutes=16)
    resolved = resolve_key(
        ledger, destination, str(key), action="accept-destination", operator="ops", reason="checked revision 2"
    )
    assert resolved.record.state is ExportState.COMPLETED
    assert current_of(root, key)[0] == 2 and [r.revision for r in ledger.revisions(str(key))] == [1, 2]

    # Discarding a restatement's revision removes that revision only; the key is rerun, revision 2 stays current.
    ledger.request_restatement(str(key), reason="more late rows", requested_by="ops")
    claim = ledger.claim(key, "run-3/export")
    exporter._publish(claim, item(key, corrected(key)), ExportTarget(key.export, key.tenant, DAY.isoformat(), 3))
    clock.advance(minutes=16)
    resolved = resolve_key(
        ledger, destination, str(key), action="discard-destination", operator="ops", reason="wrong source"
    )
    assert resolved.record.state is ExportState.FAILED
    assert current_of(root, key)[0] == 2
    assert not (key_folder(root, key) / "revision=3").exists() and (key_folder(root, key) / "revision=2").is_dir()
    assert read_revision(key_folder(root, key))[0].revision == 1
    result = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-4/export")
    assert result.status == "exported" and current_of(root, key)[0] == 3


def test_prune_stops_at_a_key_with_an_open_restatement_and_removes_the_revisions_of_what_it_prunes(
    ledger, destination, clock
) -> None:
    early, late = key_for(dt.date(2026, 1, 5)), key_for(dt.date(2026, 1, 6))
    for key in (early, late):
        first_export(ledger, destination, key)
    ledger.request_restatement(str(early), reason="late rows", requested_by="ops")
    export_key(ledger, destination, SCHEMA, item(early, corrected(early)), "run-2/export")
    ledger.request_restatement(str(late), reason="more", requested_by="ops")
    (plan,) = ledger.prune(older_than_days=30)
    assert plan.mark == late.window.business_date, "the open request keeps its date open"
    assert ledger.get(str(early)) is None and ledger.revisions(str(early)) == []
    assert ledger.get(str(late)).state is ExportState.COMPLETED
    assert ledger.open_restatements([str(late)])[str(late)].revision == 2


def test_a_v4_ledger_reads_as_revision_1_then_upgrades_to_v5_and_restates(ledger_url, tmp_path) -> None:
    import sqlalchemy as sa
    from test_drift import _v3_ledger

    from export_ledger.ledger import SCHEMA_VERSION, dispose_engines, schema_version
    from export_ledger.ledger.store import UPGRADES, _stamp

    _v3_ledger(ledger_url)
    engine = sa.create_engine(ledger_url)
    with engine.begin() as conn:
        UPGRADES[3](conn)
        _stamp(conn, 4, "upgraded from 3")
    engine.dispose()
    key = "invoice_export/acme/2026-03-08T05:00:00Z"
    reader = ExportLedger(ledger_url, read_only=True)
    assert [r.revision for r in reader.revisions(key)] == [1]
    assert reader.open_restatements([key]) == {} and reader.restatements() == []
    assert reader.rerun_bases([key]) == {key: 0}
    assert schema_version(sa.create_engine(ledger_url)) == 4, "reading never upgrades"
    dispose_engines()

    writer = ExportLedger(ledger_url)
    assert schema_version(sa.create_engine(ledger_url)) == SCHEMA_VERSION == 5
    request = writer.request_restatement(key, reason="corrected", requested_by="ops")
    assert request.revision == 2 and [r.revision for r in writer.revisions(key)] == [1]


def test_a_restatement_nobody_publishes_is_escalated_with_its_way_out(ledger, destination, clock) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    assert ledger.needs_attention(dt.timedelta(hours=6)) == []
    clock.advance(hours=7)
    ((record, why),) = ledger.needs_attention(dt.timedelta(hours=6))
    assert record.logical_key == str(key) and record.state is ExportState.COMPLETED
    assert "restatement to revision 2 requested 7:00:00 ago and not published" in why
    assert f"export-ledger restate --withdraw {key}" in why
    ledger.withdraw_restatement(str(key), operator="ops", reason="not needed")
    assert ledger.needs_attention(dt.timedelta(hours=6)) == []


def test_a_stalled_restatement_that_wakes_after_a_newer_revision_never_moves_the_pointer_back(
    ledger, destination, clock
) -> None:
    from export_ledger.destinations.base import PointerMoved
    from export_ledger.ledger import FencedOut
    from export_ledger.protocol import _KeyExport

    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    # Attempt A publishes revision 2, then stalls before moving the pointer; its lease runs out.
    stalled = ledger.claim(key, "run-A/export")
    exporter = _KeyExport(ledger, destination, SCHEMA, "csv", lambda level, message: None)
    target = ExportTarget(key.export, key.tenant, DAY.isoformat(), 2)
    _, published = exporter._publish(stalled, item(key, corrected(key)), target)
    clock.advance(minutes=16)
    # B takes over, records A's revision 2; then revision 3 is requested and published.
    assert export_key(ledger, destination, SCHEMA, item(key), "run-B/export").status == "repaired"
    ledger.request_restatement(str(key), reason="more late rows", requested_by="ops")
    assert export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-C/export").status == "exported"
    assert current_of(root, key)[0] == 3
    # A wakes: its move from revision 1 to 2 is refused, and it can record nothing.
    with pytest.raises(PointerMoved, match="points at revision 3, not at revision 1"):
        exporter._move_current(stalled, target, published)
    with pytest.raises(FencedOut):
        ledger.mark_conflict(stalled, RuntimeError("pointer moved"))
    assert current_of(root, key)[0] == 3 and ledger.get(str(key)).state is ExportState.COMPLETED
    assert [r.revision for r in ledger.revisions(str(key))] == [1, 2, 3]


def test_an_empty_untyped_source_result_exports_an_empty_revision(ledger, destination) -> None:
    # A SQL source's empty result comes back with dtype object columns: no value is of the wrong kind, so it exports.
    key = key_for(DAY)
    empty = pd.DataFrame({name: pd.Series([], dtype=object) for name in SCHEMA.columns})
    assert export_key(ledger, destination, SCHEMA, item(key, empty), "run-1/export").row_count == 0
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    result = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    assert result.row_count == len(corrected(key)) and current_of(Path(destination.root), key)[0] == 2
