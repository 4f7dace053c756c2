"""Restatements as revisions: a completed key gets revision N + 1 beside revision N, never an overwrite.

The ledger side (requests, the ``restate`` claim, the revisions table, withdrawal, rerun counting, revision numbers
never given twice) on SQLite and PostgreSQL, and the protocol on the local destination (docs/protocol.md): each
revision at the place of the claim that wrote it (``r<revision>-t<token>/``), made current by the commit of the key's
pointer, repair after a crash at every named point, reconciliation, and two concurrent restatements of one key.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest
from builders import ORDERS_DAY as DAY
from builders import ORDERS_SCHEMA as SCHEMA
from builders import commit_unrecorded, key_folder, key_for, open_ledger
from builders import corrected_orders as corrected
from builders import hourly_orders as orders
from builders import orders_item as item

from export_ledger import failpoints
from export_ledger.destinations import LocalDestination
from export_ledger.destinations.base import DestinationUnreachable, Fenced, PointerMoved
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.frames import MANIFEST_NAME, Manifest, validate_frame
from export_ledger.ledger import (
    AlreadyCompleted,
    CompletionEvidence,
    ExportLedger,
    ExportState,
    FencedOut,
    LeaseHeld,
    RestatementRefused,
    SchemaOutdated,
)
from export_ledger.ledger.schema import AttemptOutcome
from export_ledger.protocol import ExportOutcomeUnknown, export_key, target_for
from export_ledger.reconcile import reconcile_batch
from export_ledger.resolve import resolve_key
from export_ledger.restate import withdraw
from export_ledger.stage import Stager

pytestmark = pytest.mark.usefixtures("ledger_url")  # the `ledger` fixture on each backend in turn


def pointer_of(root: Path, key) -> dict:
    return json.loads((key_folder(root, key) / POINTER_NAME).read_text())


def current_of(root: Path, key) -> tuple[int, Path | None]:
    """What an outside reader does: follow the key's pointer ``_current.json`` to the place it names (revision 0:
    nothing published)."""
    values = pointer_of(root, key)
    if values["revision"] == 0:
        return 0, None
    return values["revision"], key_folder(root, key) / values["path"]


def places(root: Path, key) -> list[str]:
    """The key's places (``r<revision>-t<token>``), committed or not."""
    return sorted(p.name for p in key_folder(root, key).iterdir() if p.is_dir() and not p.name.startswith("."))


def read_revision(folder: Path) -> tuple[Manifest, bytes]:
    manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes(), str(folder))
    payload = (folder / manifest.data_file).read_bytes()
    assert hashlib.sha256(payload).hexdigest() == manifest.sha256
    return manifest, payload


@pytest.fixture
def destination(tmp_path) -> LocalDestination:
    return LocalDestination(str(tmp_path / "exports"))


def first_export(ledger, destination, key) -> Path:
    """Exports revision 1; returns its place (``r1-t1`` for a key never claimed before)."""
    result = export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    assert result.status == "exported"
    revision, place = current_of(Path(destination.root), key)
    token = ledger.queries.get(str(key)).fencing_token
    assert (revision, place.name) == (1, f"r1-t{token}"), "revision 1 at the place of the claim that exported it"
    return place


# -- the ledger ---------------------------------------------------------------------------------------------------


def test_a_request_needs_a_reason_and_a_completed_key_and_stays_single(ledger, destination) -> None:
    key = key_for(DAY)
    with pytest.raises(RestatementRefused, match="unknown logical key"):
        ledger.restatements.request(str(key), reason="late invoices", requested_by="ops")
    claim = ledger.claims.claim(key, "run-1/export")
    with pytest.raises(RestatementRefused, match="is in_progress: only a completed key is restated"):
        ledger.restatements.request(str(key), reason="late invoices", requested_by="ops")
    ledger.completions.fail(claim, RuntimeError("source down"))
    first_export(ledger, destination, key)
    with pytest.raises(RestatementRefused, match="needs a reason"):
        ledger.restatements.request(str(key), reason="   ", requested_by="ops")
    request = ledger.restatements.request(str(key), reason="late invoices", requested_by="ops")
    assert (request.revision, request.reason, request.requested_by) == (2, "late invoices", "ops")
    with pytest.raises(RestatementRefused, match="already has an open restatement \\(revision 2"):
        ledger.restatements.request(str(key), reason="again", requested_by="ops")
    # Recorded first: the key is still completed with revision 1, whose row now starts the history.
    assert ledger.queries.get(str(key)).state is ExportState.COMPLETED
    (first,) = ledger.restatements.revisions(str(key))
    assert (first.revision, first.reason, first.published_by) == (1, "first export", "run-1/export")


def test_restating_publishes_revision_2_beside_revision_1_and_moves_the_pointer(ledger, destination) -> None:
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    root = Path(destination.root)
    original_manifest, original = read_revision(first_place)
    first_manifest = json.loads((first_place / MANIFEST_NAME).read_text())
    assert "revision" not in first_manifest, "revision 1's manifest: 0.3.0's bytes"

    # Without a request, a rerun changes nothing.
    again = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    assert again.status == "already_completed" and current_of(root, key)[0] == 1

    ledger.restatements.request(str(key), reason="invoice amounts corrected", requested_by="ops")
    result = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    assert result.status == "exported" and result.row_count == len(corrected(key))

    revision, folder = current_of(root, key)
    assert revision == 2 and folder == key_folder(root, key) / "r2-t2", "revision 2 at its own claim's place (token 2)"
    manifest, payload = read_revision(folder)
    assert (manifest.revision, manifest.supersedes_revision, manifest.supersedes_sha256) == (
        2,
        1,
        original_manifest.sha256,
    )
    # Revision 1 is still there, byte for byte.
    assert read_revision(first_place) == (original_manifest, original)
    assert places(root, key) == ["r1-t1", "r2-t2"]

    record = ledger.queries.get(str(key))
    assert record.state is ExportState.COMPLETED and record.sha256 == manifest.sha256
    assert record.location == str(folder)
    history = ledger.restatements.revisions(str(key))
    assert [(r.revision, r.sha256, r.supersedes_revision, r.reason) for r in history] == [
        (1, original_manifest.sha256, None, "first export"),
        (2, manifest.sha256, 1, "invoice amounts corrected"),
    ]
    assert history[1].requested_by == "ops" and history[1].published_by == "run-3/export"
    assert ledger.restatements.open_requests([str(key)]) == {}
    # Done: the next run skips it, and a second restatement is revision 3.
    assert export_key(ledger, destination, SCHEMA, item(key), "run-4/export").status == "already_completed"
    assert ledger.restatements.request(str(key), reason="again", requested_by="ops").revision == 3


def test_a_restatement_that_fails_before_publishing_keeps_revision_1_current_and_is_rerun(
    ledger, destination, monkeypatch
) -> None:
    key = key_for(DAY)
    ledger.completions.fail(ledger.claims.claim(key, "run-0/export"), RuntimeError("source down"))
    first_export(ledger, destination, key)
    assert ledger.queries.get(str(key)).claim_count == 2, "revision 1 took two claims"
    ledger.restatements.request(str(key), reason="fix", requested_by="ops")
    bad = corrected(key).drop(columns=["total"])
    with pytest.raises(Exception, match="total"):
        export_key(ledger, destination, SCHEMA, item(key, bad), "run-2/export")
    record = ledger.queries.get(str(key))
    assert record.state is ExportState.FAILED
    assert current_of(Path(destination.root), key)[0] == 1
    # Its reruns count from the request, not from the key's first claim: one claim, not three, so it is rerun.
    assert record.claim_count == 1
    (work,) = ledger.attention.failed_partitions(max_attempts=3, limit=10)
    assert (work.export, work.business_date, work.keys) == (key.export, DAY, 1)
    assert ledger.restatements.current_revision(str(key)).revision == 1
    result = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    assert result.status == "exported" and current_of(Path(destination.root), key)[0] == 2


def test_a_withdrawn_restatement_returns_the_key_to_completed_with_its_current_revision_and_burns_its_number(
    ledger, destination
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    before = ledger.queries.get(str(key))
    ledger.restatements.request(str(key), reason="fix", requested_by="ops")
    with pytest.raises(Exception, match="total"):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key).drop(columns=["total"])), "run-2/export")
    with pytest.raises(RestatementRefused, match="needs a reason"):
        withdraw(ledger, destination, str(key), operator="ops", reason="")
    after = withdraw(ledger, destination, str(key), operator="ops", reason="source cannot be fixed this week")
    assert after.state is ExportState.COMPLETED
    assert (after.sha256, after.location, after.row_count) == (before.sha256, before.location, before.row_count)
    # The operator held the key (token 3) and fenced the pointer with it before judging; revision 1 stays current.
    assert after.fencing_token == 3 and pointer_of(root, key)["fence"] == 3
    assert current_of(root, key)[1].name == "r1-t1"
    assert ledger.restatements.open_requests([str(key)]) == {}
    (closed,) = ledger.restatements.requests(logical_keys=[str(key)], open_only=False)
    assert closed.outcome == "withdrawn"
    assert ledger.operators.entries()[-1]["action"] == "withdraw-restatement"
    assert export_key(ledger, destination, SCHEMA, item(key), "run-3/export").status == "already_completed"
    with pytest.raises(RestatementRefused, match="no open restatement"):
        withdraw(ledger, destination, str(key), operator="ops", reason="twice")
    # Revision 2 was asked for and withdrawn: its number is never given again (its place could still be somewhere).
    assert ledger.restatements.request(str(key), reason="again", requested_by="ops").revision == 3


def test_withdrawing_a_restatement_whose_revision_readers_see_is_refused_and_the_key_stays_failed(
    ledger, destination
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    # A party outside the protocol committed revision 2 and recorded a failure: the pointer names the revision the
    # operator is about to withdraw.
    claim = ledger.claims.claim(key, "run-2/export")
    commit_unrecorded(destination, SCHEMA, claim, key, corrected(key))
    ledger.completions.fail(claim, RuntimeError("lost track of its commit"))
    assert current_of(root, key)[0] == 2

    with pytest.raises(RestatementRefused, match="the withdrawn revision 2 may be what readers see") as refused:
        withdraw(ledger, destination, str(key), operator="ops", reason="not needed")
    assert "--accept-destination" in str(refused.value) and "--discard-destination" in str(refused.value), (
        "the refusal names the resolutions to run"
    )
    record = ledger.queries.get(str(key))
    assert record.state is ExportState.FAILED and record.lease_owner is None, "back to failed, not left held"
    assert ledger.restatements.open_requests([str(key)])[str(key)].revision == 2, "the request stays open"
    assert current_of(root, key)[0] == 2 and pointer_of(root, key)["fence"] == 3, "fenced, never moved"
    assert ledger.operators.entries()[-1]["action"] == "withdraw-refused"

    # Discarding revision 2 first sets the pointer back to revision 1; then the withdrawal goes through.
    resolve_key(ledger, destination, str(key), action="discard-destination", operator="ops", reason="not needed")
    assert current_of(root, key)[1].name == "r1-t1"
    after = withdraw(ledger, destination, str(key), operator="ops", reason="not needed")
    assert after.state is ExportState.COMPLETED and ledger.restatements.open_requests([str(key)]) == {}


@pytest.mark.parametrize("point", ["after_claim", "after_stage", "after_publish", "before_commit"])
def test_a_restatement_killed_at_any_point_leaves_one_current_revision_and_is_finished(
    ledger, destination, clock, monkeypatch, point
) -> None:
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    root = Path(destination.root)
    _, original = read_revision(first_place)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)

    # Whatever was reached, readers see exactly one intact revision, and revision 1 is untouched. Staged is not
    # visible; committed (after_publish) is.
    committed = point in ("after_publish", "before_commit")
    revision, folder = current_of(root, key)
    read_revision(folder)
    assert read_revision(first_place)[1] == original
    assert revision == (2 if committed else 1)

    # A retry during the dead attempt's lease is refused; after it, reconciliation finishes or fails the key.
    with pytest.raises(LeaseHeld):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    clock.advance(minutes=16)
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    record = ledger.queries.get(str(key))
    if not committed:
        assert record.state is ExportState.FAILED
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-4/export")
    assert ledger.queries.get(str(key)).state is ExportState.COMPLETED
    revision, folder = current_of(root, key)
    manifest, _ = read_revision(folder)
    assert revision == 2 and manifest.revision == 2 and ledger.queries.get(str(key)).sha256 == manifest.sha256
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]
    # Tokens: revision 1's claim 1, the dead attempt 2, reconciliation's hold 3, the rerun 4. One place of revision 2
    # is left: the dead attempt's committed one, or the rerun's (which swept the dead attempt's uncommitted place).
    assert places(root, key) == ["r1-t1", "r2-t2" if committed else "r2-t4"]
    assert folder.name == places(root, key)[1]


def test_a_restatement_that_fails_right_after_its_commit_is_remote_unknown_and_reconciled(
    ledger, destination, clock, monkeypatch
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, "after_publish=raise")
    with pytest.raises(ExportOutcomeUnknown, match="unknown"):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)
    assert ledger.queries.get(str(key)).state is ExportState.REMOTE_UNKNOWN
    assert current_of(root, key)[0] == 2, "committed: readers see revision 2 before the ledger records it"
    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    assert [r.state for r in report.resolved_to(ExportState.COMPLETED)] == [ExportState.COMPLETED]
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]
    assert current_of(root, key)[1].name == "r2-t2"
    # The reconciler held the key with a token of its own and fenced the pointer with it before judging.
    assert ledger.queries.get(str(key)).fencing_token == 3 and pointer_of(root, key)["fence"] == 3


def test_two_concurrent_restatements_of_one_key_make_one_revision(ledger, destination, clock) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    root = Path(destination.root)
    # The first claim stalls (its lease runs out) before writing; the second takes over and publishes revision 2.
    slow = ledger.claims.claim(key, "run-2/export")
    assert slow.revision == 2 and slow.supersedes[0] == 1
    clock.advance(minutes=16)
    fast = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
    assert fast.status == "exported"
    pointer = (key_folder(root, key) / POINTER_NAME).read_bytes()
    revision, fast_place = current_of(root, key)
    assert (revision, fast_place.name) == (2, "r2-t3")
    published = {p.name: p.read_bytes() for p in fast_place.iterdir()}
    # The stalled attempt wakes and writes revision 2 too, at its own place (no other party writes there); its
    # commit is refused by the pointer's fence, so readers never see it and nothing is replaced or recorded.
    table = validate_frame(corrected(key), SCHEMA, slow.window, what=str(key))
    manifest = Manifest.build(
        logical_key=str(key), export=key.export, tenant=key.tenant, window=slow.window, row_count=0, sha256="",
        attempt_id=slow.attempt_id, fencing_token=slow.fencing_token, data_file="data.csv",
        tz_database=slow.tz_database, revision=2, supersedes=slow.supersedes,
    )  # fmt: skip
    staged = destination.stage(target_for(key, 2), slow.fencing_token, table, "csv", manifest)
    assert staged.target.place == "r2-t2"
    with pytest.raises(Fenced, match="fenced at token 3, above this party's 2"):
        destination.commit(staged, slow.fencing_token, superseded=1)
    assert (key_folder(root, key) / POINTER_NAME).read_bytes() == pointer, "the pointer is never rewritten"
    assert {p.name: p.read_bytes() for p in fast_place.iterdir()} == published
    with pytest.raises(FencedOut):
        ledger.completions.complete(slow, CompletionEvidence.published(destination.location(staged.target), manifest))
    outcomes = [a.outcome for a in ledger.queries.attempts(str(key))]
    assert outcomes.count(AttemptOutcome.COMPLETED) == 2  # revision 1, then revision 2: one each
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]


def test_the_pointer_refuses_a_commit_that_supersedes_a_revision_it_does_not_name(destination, ledger) -> None:
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    first = Manifest.from_json((first_place / MANIFEST_NAME).read_bytes(), "m")
    manifest = dataclasses.replace(first, revision=3, supersedes_revision=2, supersedes_sha256="ab" * 32)
    table = validate_frame(orders(key), SCHEMA, key.window, what=str(key))
    staged = destination.stage(target_for(key, 3), 2, table, "csv", manifest)
    pointer = (key_folder(Path(destination.root), key) / POINTER_NAME).read_bytes()

    with pytest.raises(PointerMoved, match="names revision 1, not revision 2 which revision 3 supersedes"):
        destination.commit(staged, 2, superseded=2)
    assert destination.current_revision(target_for(key)) == 1
    assert (key_folder(Path(destination.root), key) / POINTER_NAME).read_bytes() == pointer, "a conflict never moves it"


def test_claims_of_a_completed_key_without_a_request_stay_already_completed(ledger, destination) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    (outcome,) = ledger.claims.claim_many([key], "run-2/export")
    assert isinstance(outcome, AlreadyCompleted)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    (outcome,) = ledger.claims.claim_many([key], "run-3/export")
    assert outcome.revision == 2 and outcome.previous_state is ExportState.COMPLETED


def test_an_operator_resolves_a_restatement_at_the_revision_it_publishes(ledger, destination, clock) -> None:
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    root = Path(destination.root)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    # An attempt committed revision 2 and died before recording it; a person accepts it.
    claim = ledger.claims.claim(key, "run-2/export")
    commit_unrecorded(destination, SCHEMA, claim, key, corrected(key))
    assert current_of(root, key)[0] == 2 and ledger.restatements.current_revision(str(key)).revision == 1, (
        "committed, not recorded"
    )
    clock.advance(minutes=16)
    resolved = resolve_key(
        ledger, destination, str(key), action="accept-destination", operator="ops", reason="checked revision 2"
    )
    assert resolved.record.state is ExportState.COMPLETED
    assert current_of(root, key)[0] == 2 and [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]

    # Discarding a restatement's revision removes that revision only; the key is rerun, revision 2 current again.
    ledger.restatements.request(str(key), reason="more late rows", requested_by="ops")
    claim = ledger.claims.claim(key, "run-3/export")
    further = corrected(key)
    further.loc[1, "total"] = 77.0  # other data than revision 2's: an identical restatement publishes nothing
    commit_unrecorded(destination, SCHEMA, claim, key, further)
    assert current_of(root, key)[1].name == "r3-t4"
    clock.advance(minutes=16)
    resolved = resolve_key(
        ledger, destination, str(key), action="discard-destination", operator="ops", reason="wrong source"
    )
    assert resolved.record.state is ExportState.FAILED
    assert current_of(root, key)[1].name == "r2-t2", "the pointer is set back to the recorded revision 2"
    assert places(root, key) == ["r1-t1", "r2-t2"], "revision 3's place is deleted, revisions 1 and 2 kept"
    assert read_revision(first_place)[0].revision == 1
    result = export_key(ledger, destination, SCHEMA, item(key, further), "run-4/export")
    assert result.status == "exported" and current_of(root, key)[0] == 3


def test_prune_stops_at_a_key_with_an_open_restatement_and_removes_the_revisions_of_what_it_prunes(
    ledger, destination, clock
) -> None:
    early, late = key_for(dt.date(2026, 1, 5)), key_for(dt.date(2026, 1, 6))
    for key in (early, late):
        first_export(ledger, destination, key)
    ledger.restatements.request(str(early), reason="late rows", requested_by="ops")
    export_key(ledger, destination, SCHEMA, item(early, corrected(early)), "run-2/export")
    ledger.restatements.request(str(late), reason="more", requested_by="ops")
    (plan,) = ledger.retention.prune(older_than_days=30)
    assert plan.mark == late.window.business_date, "the open request keeps its date open"
    assert ledger.queries.get(str(early)) is None and ledger.restatements.revisions(str(early)) == []
    assert ledger.queries.get(str(late)).state is ExportState.COMPLETED
    assert ledger.restatements.open_requests([str(late)])[str(late)].revision == 2


def test_a_v4_ledger_reads_as_revision_1_then_upgrades_explicitly_and_restates(ledger_url, tmp_path) -> None:
    import sqlalchemy as sa
    from builders import ledger_at as _ledger_at

    from export_ledger.ledger import SCHEMA_VERSION, dispose_engines, schema_version, upgrade_url

    _ledger_at(ledger_url, 4)
    key = "invoice_export/acme/2026-03-08T05:00:00Z"
    reader = ExportLedger(ledger_url, read_only=True)
    assert [r.revision for r in reader.restatements.revisions(key)] == [1]
    assert reader.restatements.open_requests([key]) == {} and reader.restatements.requests() == []
    assert schema_version(sa.create_engine(ledger_url)) == 4, "reading never upgrades"
    dispose_engines()

    with pytest.raises(SchemaOutdated, match="has schema version 4"):
        ExportLedger(ledger_url)
    assert schema_version(sa.create_engine(ledger_url)) == 4, "a refused write-open changes nothing"
    assert upgrade_url(ledger_url) == [5, 6, 7, 8, 9]
    writer = open_ledger(ledger_url)
    assert schema_version(sa.create_engine(ledger_url)) == SCHEMA_VERSION == 9
    # Before 0.5 reruns were counted from the key's tokens: the upgrade counts its one claim.
    assert writer.queries.get(key).claim_count == 1
    request = writer.restatements.request(key, reason="corrected", requested_by="ops")
    assert request.revision == 2 and [r.revision for r in writer.restatements.revisions(key)] == [1]


def test_a_restatement_nobody_publishes_is_escalated_with_its_way_out(ledger, destination, clock) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    assert ledger.attention.needs_attention(dt.timedelta(hours=6)) == []
    clock.advance(hours=7)
    (escalation,) = ledger.attention.needs_attention(dt.timedelta(hours=6))
    assert escalation.logical_key == str(key) and escalation.record.state is ExportState.COMPLETED
    assert "restatement to revision 2 requested 7:00:00 ago and not published" in escalation.why
    assert f"export-ledger restate --withdraw {key}" in escalation.why
    withdraw(ledger, destination, str(key), operator="ops", reason="not needed")
    assert ledger.attention.needs_attention(dt.timedelta(hours=6)) == []


def test_a_stalled_restatement_that_wakes_after_a_newer_revision_never_moves_the_pointer_back(
    ledger, destination, clock
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    root = Path(destination.root)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    # Attempt A (token 2) stages revision 2 at its place, then stalls before committing; its lease runs out.
    stalled = ledger.claims.claim(key, "run-A/export")
    table = validate_frame(corrected(key), SCHEMA, stalled.window, what=str(key))
    manifest = Stager(SCHEMA, "csv", lambda level, message: None).manifest_template(stalled, key)
    staged = destination.stage(target_for(key, 2), stalled.fencing_token, table, "csv", manifest)
    clock.advance(minutes=16)
    # B (token 3) takes over: nothing of A is visible, so it publishes revision 2 itself, sweeping A's place;
    # then revision 3 is requested and published by C (token 4).
    assert export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-B/export").status == "exported"
    assert "r2-t2" not in places(root, key), "A's uncommitted place is swept: no pointer can ever name it"
    ledger.restatements.request(str(key), reason="more late rows", requested_by="ops")
    more = corrected(key)
    more.loc[1, "total"] = 77.0  # other data than revision 2's (an identical restatement publishes nothing)
    assert export_key(ledger, destination, SCHEMA, item(key, more), "run-C/export").status == "exported"
    assert current_of(root, key)[0] == 3
    # A wakes: its commit from revision 1 to 2 is refused by the pointer's fence, and it can record nothing.
    with pytest.raises(Fenced, match="fenced at token 4, above this party's 2") as fenced:
        destination.commit(staged, stalled.fencing_token, superseded=1)
    assert fenced.value.fence == 4
    with pytest.raises(FencedOut):
        ledger.completions.mark_conflict(stalled, RuntimeError("fenced"))
    assert current_of(root, key)[0] == 3 and ledger.queries.get(str(key)).state is ExportState.COMPLETED
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2, 3]


def test_an_empty_untyped_source_result_exports_an_empty_revision(ledger, destination) -> None:
    # A SQL source's empty result comes back with dtype object columns: no value is of the wrong kind, so it exports.
    key = key_for(DAY)
    empty = pd.DataFrame({name: pd.Series([], dtype=object) for name in SCHEMA.columns})
    assert export_key(ledger, destination, SCHEMA, item(key, empty), "run-1/export").row_count == 0
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    result = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    assert result.row_count == len(corrected(key)) and current_of(Path(destination.root), key)[0] == 2


# -- a restatement whose data is the current revision's ----------------------------------------------------------


def test_a_restatement_with_the_current_revisions_data_publishes_nothing_and_closes_unchanged(
    ledger, destination
) -> None:
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    root = Path(destination.root)
    original = read_revision(first_place)
    ledger.restatements.request(str(key), reason="check the billing fix", requested_by="ops")

    result = export_key(ledger, destination, SCHEMA, item(key), "run-2/export")

    assert (result.status, result.revision, result.requested_revision) == ("unchanged", 1, 2)
    assert (result.location, result.sha256) == (str(first_place), original[0].sha256), "revision 1's, as recorded"
    assert current_of(root, key) == (1, first_place) and read_revision(first_place) == original
    assert pointer_of(root, key)["fence"] == 2, "decided after this attempt's fence was raised"
    assert places(root, key) == ["r1-t1"], "the staged copy of revision 1 is not left beside it"
    (request,) = ledger.restatements.requests(logical_keys=[str(key)], open_only=False)
    assert (request.revision, request.outcome) == (2, "unchanged") and request.closed_at is not None
    assert ledger.restatements.open_requests([str(key)]) == {}, "closed: no sensor launches it again"
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1], "no revision was published"
    record = ledger.queries.get(str(key))
    assert (record.state, record.sha256) == (ExportState.COMPLETED, original[0].sha256)
    assert record.location == str(first_place)
    assert record.committed_attempt == "run-1/export", "what readers see is still revision 1's export"
    last = ledger.queries.attempts(str(key))[-1]
    assert (last.attempt_id, last.outcome, last.error_class) == ("run-2/export", AttemptOutcome.COMPLETED,
                                                                 "RestatementUnchanged")  # fmt: skip

    assert export_key(ledger, destination, SCHEMA, item(key), "run-3/export").status == "already_completed"
    again = ledger.restatements.request(str(key), reason="late rows after all", requested_by="ops")
    assert again.revision == 3, "the unchanged request's number is never given again"
    restated = export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-4/export")
    assert (restated.status, restated.revision, restated.supersedes) == ("exported", 3, 1)
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 3]


@pytest.mark.parametrize("damage", ["data removed", "data changed", "pointer's sha256 changed"])
def test_a_restatement_with_the_same_data_republishes_a_revision_that_is_not_intact_at_the_destination(
    ledger, destination, damage
) -> None:
    """The way out of partition_health's ``differs``: a restatement whose data is revision 1's publishes revision 2
    when revision 1 is not what readers should see (its data gone or changed, or the pointer readers follow not
    naming it as recorded), instead of closing ``unchanged`` over it (found by the review of the merged check).
    Guard: ``_unchanged``'s read-back of the revision it would keep, and its comparison with the pointer."""
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    root = Path(destination.root)
    manifest, _ = read_revision(first_place)
    if damage == "data removed":
        (first_place / manifest.data_file).unlink()
    elif damage == "data changed":
        (first_place / manifest.data_file).write_bytes(b"order_id,placed_at,total\n")
    else:
        pointer = pointer_of(root, key)
        (key_folder(root, key) / POINTER_NAME).write_text(json.dumps({**pointer, "sha256": "0" * 64}))
    ledger.restatements.request(str(key), reason="lost at the destination", requested_by="ops")

    result = export_key(ledger, destination, SCHEMA, item(key), "run-2/export")

    assert (result.status, result.revision, result.supersedes) == ("exported", 2, 1), result
    revision, place = current_of(root, key)
    assert revision == 2 and read_revision(place)[0].sha256 == manifest.sha256, "the same rows, published again"


def test_a_restatement_that_cannot_read_back_the_revision_it_keeps_closes_unchanged_with_a_warning(
    ledger, destination, monkeypatch
) -> None:
    """A destination that cannot say whether revision 1 is intact (a read that fails once) leaves it current, as an
    unchanged restatement always did, saying so: a transient read error never publishes a copy silently."""
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    ledger.restatements.request(str(key), reason="check", requested_by="ops")
    logged: list[tuple[str, str]] = []

    def unreadable(self, target, *, logical_key, sha256):
        raise DestinationUnreachable("the store did not answer")

    monkeypatch.setattr(LocalDestination, "verify_recorded", unreadable)
    result = export_key(ledger, destination, SCHEMA, item(key), "run-2/export", log=lambda *m: logged.append(m))

    assert (result.status, result.revision) == ("unchanged", 1)
    assert current_of(Path(destination.root), key) == (1, first_place)
    assert any(level == "warning" and "could not be read back" in message for level, message in logged), logged


@pytest.mark.parametrize("point", ["after_stage", "before_commit"])
def test_an_unchanged_restatement_killed_anywhere_keeps_revision_1_current_and_is_finished_unchanged(
    ledger, destination, clock, monkeypatch, point
) -> None:
    key = key_for(DAY)
    first_place = first_export(ledger, destination, key)
    root = Path(destination.root)
    ledger.restatements.request(str(key), reason="check", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)
    assert current_of(root, key) == (1, first_place), "nothing was committed"

    clock.advance(minutes=16)
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    assert ledger.queries.get(str(key)).state is ExportState.FAILED, "the pointer names revision 1: nothing visible"
    assert ledger.restatements.open_requests([str(key)]), "the request stays open until an attempt decides it"
    result = export_key(ledger, destination, SCHEMA, item(key), "run-3/export")

    assert result.status == "unchanged" and current_of(root, key) == (1, first_place)
    assert places(root, key) == ["r1-t1"], "the dead attempt's staged place was swept, the rerun's removed"
    (request,) = ledger.restatements.requests(logical_keys=[str(key)], open_only=False)
    assert request.outcome == "unchanged"
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1]


def test_a_restatement_that_loses_its_lease_before_recording_unchanged_records_nothing(
    ledger, destination, clock
) -> None:
    key = key_for(DAY)
    first_export(ledger, destination, key)
    ledger.restatements.request(str(key), reason="check", requested_by="ops")
    seen: list[str] = []

    def take_over(point: str) -> None:
        seen.append(point)
        if point == "before_commit":  # the unchanged revision's evidence is in hand, not recorded yet
            clock.advance(minutes=16)
            ledger.claims.claim(key, "run-3/export")  # takes the expired lease over

    failpoints.set_hook(take_over)
    try:
        with pytest.raises(FencedOut):
            export_key(ledger, destination, SCHEMA, item(key), "run-2/export")
    finally:
        failpoints.set_hook(None)
    assert "after_stage" in seen and "after_publish" not in seen, "the same data: staged, compared, never published"
    assert places(Path(destination.root), key) == ["r1-t1"], "nothing of the unchanged restatement is left behind"
    assert ledger.restatements.open_requests([str(key)]), "the new holder decides the request, not the fenced one"
    assert ledger.queries.get(str(key)).state is ExportState.IN_PROGRESS
