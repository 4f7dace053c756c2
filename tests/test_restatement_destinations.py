"""Restatements on the S3 and ledger-table destinations: revision N beside N - 1, one current pointer per key.

S3 runs on the moto server (behind the fault proxy where a test breaks or races a request); each revision is at the
place of the claim that wrote it (``r<revision>-t<token>/``) and the ``_current.json`` pointer, written only by a
conditional write on the version read, makes it current (docs/protocol.md). The ledger table runs on SQLite and
PostgreSQL; its pointer is the key's ``<table>_manifests`` row, moved in the completion transaction. Either way a
reader sees exactly one intact current revision, revision 1 stays readable, and the ledger records revisions 1 and 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import sqlalchemy as sa
from builders import ORDERS_DAY as DAY
from builders import ORDERS_SCHEMA as SCHEMA
from builders import commit_unrecorded, key_for
from builders import corrected_orders as corrected
from builders import hourly_orders as orders
from builders import orders_item as item
from object_buckets import KINDS, Bucket, bucket_for, delta_destination, object_destination
from restatement_support import s3_destination  # a read timeout of 3 s

from export_ledger.destinations.base import ExportTarget, Fenced, PointerMoved, Verdict
from export_ledger.destinations.publishing import POINTER_NAME, Pointer, StagedExport
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.frames import MANIFEST_NAME, Manifest, validate_frame
from export_ledger.ledger import ExportState, LedgerError
from export_ledger.protocol import ExportOutcomeUnknown, export_key
from export_ledger.reconcile import reconcile_batch
from export_ledger.resolve import resolve_key

PREFIX = "exports"
TABLE = "restated_orders"


def target_of(key, revision: int = 1, place: str | None = None) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision, place)


def restate(ledger, destination, key, run_id: str = "run-2/export"):
    ledger.restatements.request(str(key), reason="invoice amounts corrected", requested_by="ops")
    return export_key(ledger, destination, SCHEMA, item(key, corrected(key)), run_id)


# -- object stores (S3, GCS, Azure Blob) ---------------------------------------------------------------------------



@pytest.fixture(params=(*KINDS, "sftp"))
def store(request) -> tuple:
    """``(destination, bucket)``: a destination of each object-store kind, and its bucket read with the store's own
    client (an outside reader)."""
    return object_destination(request.param, request, PREFIX), bucket_for(request.param, request)


def bucket_of(s3, s3_bucket: str) -> Bucket:
    """The S3 bucket read with the ``s3`` fixture's client (for the tests that race or break S3's requests)."""
    return Bucket("s3", s3_bucket, s3)


def key_prefix(key) -> str:
    return f"{PREFIX}/{key.export}/tenant={key.tenant}/date={key.window.business_date.isoformat()}/"


def objects(bucket: Bucket, key) -> dict[str, bytes]:
    """Object name (relative to the key's folder) -> bytes, for everything under the key's folder."""
    return bucket.objects(key_prefix(key))


def s3_current(bucket: Bucket, key) -> tuple[int, Manifest, bytes]:
    """What an outside reader does: follow ``_current.json`` to the manifest and the data it names, and check the
    data against the manifest's sha256."""
    stored = objects(bucket, key)
    pointer = json.loads(stored[POINTER_NAME])
    manifest = Manifest.from_json(stored[pointer["manifest"]], bucket.kind)
    data = stored[pointer["data_file"]]
    assert hashlib.sha256(data).hexdigest() == manifest.sha256 == pointer["sha256"], "the current data is intact"
    assert manifest.revision == pointer["revision"], "the pointer names the revision its place holds"
    return pointer["revision"], manifest, data


def place_names(stored: dict[str, bytes]) -> list[str]:
    """The key's places (``r<revision>-t<token>``), committed or not."""
    return sorted({name.split("/", 1)[0] for name in stored if "/" in name})


def stage_revision(destination, key, revision: int, token: int, supersedes: Manifest) -> StagedExport:
    """Writes ``revision`` at the place of ``token`` (invisible until committed), as that party would."""
    manifest = dataclasses.replace(
        supersedes, revision=revision, supersedes_revision=supersedes.revision, supersedes_sha256=supersedes.sha256,
        fencing_token=token,
    )  # fmt: skip
    table = validate_frame(corrected(key), SCHEMA, key.window, what=str(key))
    return destination.stage(target_of(key, revision), token, table, "csv", manifest)


def test_restating_publishes_revision_2_beside_revision_1_and_moves_the_pointer(store, ledger):
    destination, bucket = store
    key = key_for(DAY)
    assert export_key(ledger, destination, SCHEMA, item(key), "run-1/export").status == "exported"
    _, original_manifest, original = s3_current(bucket, key)
    first = json.loads(objects(bucket, key)[POINTER_NAME])
    assert (first["revision"], first["path"], first["fence"]) == (1, "r1-t1", 1), "revision 1 is committed too"

    result = restate(ledger, destination, key)
    assert result.status == "exported" and result.row_count == len(corrected(key))

    revision, manifest, data = s3_current(bucket, key)
    assert revision == 2 and destination.current_revision(target_of(key)) == 2
    assert (manifest.revision, manifest.supersedes_revision, manifest.supersedes_sha256) == (
        2,
        1,
        original_manifest.sha256,
    )
    stored = objects(bucket, key)
    assert place_names(stored) == ["r1-t1", "r2-t2"]
    pointer = json.loads(stored[POINTER_NAME])
    assert pointer == {
        "format": 2,
        "fence": 2,
        "logical_key": str(key),
        "revision": 2,
        "path": "r2-t2",
        "manifest": f"r2-t2/{MANIFEST_NAME}",
        "data_file": f"r2-t2/{manifest.data_file}",
        "sha256": manifest.sha256,
        "row_count": manifest.row_count,
    }
    # Revision 1 is still where it was, byte for byte, and readable through the destination.
    assert Manifest.from_json(stored[f"r1-t1/{MANIFEST_NAME}"], bucket.kind) == original_manifest
    assert stored[f"r1-t1/{original_manifest.data_file}"] == original
    seen = destination.verify_recorded(
        target_of(key, 1, "r1-t1"), logical_key=str(key), sha256=original_manifest.sha256
    )
    assert seen.verdict is Verdict.PUBLISHED and seen.manifest == original_manifest
    assert destination.read_data(target_of(key, 1, "r1-t1"), original_manifest) == original
    assert destination.read_data(target_of(key, 2, "r2-t2"), manifest) == data

    record = ledger.queries.get(str(key))
    assert record.state is ExportState.COMPLETED and record.sha256 == manifest.sha256
    assert record.location == f"{bucket.scheme}://{bucket.name}/{key_prefix(key)}r2-t2/"
    assert [(r.revision, r.sha256) for r in ledger.restatements.revisions(str(key))] == [
        (1, original_manifest.sha256),
        (2, manifest.sha256),
    ]


def test_pointer_refuses_a_stale_commit_and_leaves_one_already_there_alone(store, ledger):
    destination, bucket = store
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    _, first, _ = s3_current(bucket, key)
    restate(ledger, destination, key)
    _, manifest, _ = s3_current(bucket, key)
    pointer_key = f"{key_prefix(key)}{POINTER_NAME}"
    before = bucket.version(pointer_key)

    # A party that still believes revision 1 is current: its revision 3 is staged (invisible) and never committed.
    stale = stage_revision(destination, key, 3, 5, first)
    with pytest.raises(PointerMoved, match="names revision 2, not revision 1 which revision 3 supersedes"):
        destination.commit(stale, 5, superseded=1)
    # Revision 2's commit sent again (as after an unknown outcome): already there, so nothing is written.
    again = destination.commit(StagedExport(target_of(key, 2, "r2-t2"), manifest), 2, superseded=1)
    assert (again.revision, again.place) == (2, "r2-t2")

    assert bucket.version(pointer_key) == before, "never rewritten"
    assert destination.current_revision(target_of(key)) == 2


@pytest.mark.parametrize(
    "interloper",
    ["another-revision-won", "a-newer-token-fenced-it", "the-same-commit-landed"],
)
def test_s3_pointer_written_between_read_and_write_is_never_overwritten(
    s3, s3_bucket, ledger, fault_proxy, interloper
):
    """A real lost-update race: the interloper writes the pointer when the proxy holds the committer's conditional
    PUT (after the committer read the pointer, before its write reaches the store); the store answers 412, and the
    committer judges the pointer it reads again."""
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    _, first, _ = s3_current(bucket_of(s3, s3_bucket), key)
    staged = stage_revision(destination, key, 2, 2, first)  # the committer: token 2, revision 2 superseding 1
    committed = Pointer(2, 2, "r2-t2", staged.manifest.sha256, staged.manifest.row_count, "data.csv", str(key))
    written = {
        "another-revision-won": dataclasses.replace(committed, fence=1, revision=3, place="r3-t1"),
        "a-newer-token-fenced-it": Pointer(3, 1, "r1-t1", first.sha256, first.row_count, "data.csv", str(key)),
        "the-same-commit-landed": committed,
    }[interloper].payload()
    pointer_key = f"{key_prefix(key)}{POINTER_NAME}"
    raced = []

    def interlope(method: str, path: str) -> bool:
        if method == "PUT" and path.endswith(f"/{pointer_key}") and not raced:
            s3.put_object(Bucket=s3_bucket, Key=pointer_key, Body=written)
            raced.append(path)
        return False  # no fault: the committer's PUT is forwarded as sent

    fault_proxy.inject("error_500", count=None, when=interlope)
    if interloper == "another-revision-won":
        with pytest.raises(PointerMoved, match="names revision 3, not revision 1"):
            destination.commit(staged, 2, superseded=1)
    elif interloper == "a-newer-token-fenced-it":
        with pytest.raises(Fenced, match="fenced at token 3, above this party's 2"):
            destination.commit(staged, 2, superseded=1)
    else:
        assert destination.commit(staged, 2, superseded=1).place == "r2-t2", "an earlier send landed: success"
    assert raced, "the committer's PUT met the race"
    assert s3.get_object(Bucket=s3_bucket, Key=pointer_key)["Body"].read() == written, "the interloper's stays"


@pytest.mark.parametrize("point", ["after_stage", "after_publish", "before_commit"])
def test_restatement_killed_after_writing_ends_with_one_current_revision(store, ledger, clock, monkeypatch, point):
    destination, bucket = store
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    _, original_manifest, original = s3_current(bucket, key)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)

    committed = point != "after_stage"  # staged is invisible; after_publish is after the pointer's commit
    revision, _, _ = s3_current(bucket, key)  # readers see one intact revision, whatever was reached
    assert revision == (2 if committed else 1)
    clock.advance(minutes=16)
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    if not committed:
        assert ledger.queries.get(str(key)).state is ExportState.FAILED, "nothing visible: failed, and rerun"
        assert export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export").status == (
            "exported"
        )

    record = ledger.queries.get(str(key))
    revision, manifest, _ = s3_current(bucket, key)
    assert record.state is ExportState.COMPLETED and record.sha256 == manifest.sha256
    assert revision == 2 and manifest.supersedes_sha256 == original_manifest.sha256
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]
    stored = objects(bucket, key)
    # Tokens: revision 1's 1, the dead attempt 2, reconciliation's hold 3, the rerun 4 (which swept the dead place).
    assert place_names(stored) == ["r1-t1", "r2-t2" if committed else "r2-t4"]
    assert stored[f"r1-t1/{original_manifest.data_file}"] == original, "revision 1 is untouched"


@pytest.mark.parametrize("fault", ["error_503", "cut_before_response"])
def test_s3_pointer_commit_with_an_unknown_outcome_is_remote_unknown_and_reconciled(
    s3, s3_bucket, ledger, fault_proxy, fault
):
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    pointer_puts = []

    def the_commit(_method: str, path: str) -> bool:
        pointer_puts.append(path)
        return len(pointer_puts) == 2  # the restatement's first pointer write is its fence (token 2), then its commit

    fault_proxy.inject(fault, method="PUT", path_suffix=f"/{POINTER_NAME}", when=the_commit)
    with pytest.raises(ExportOutcomeUnknown, match="may or may not exist"):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    assert fault_proxy.remaining == 0, "the commit's PUT met the fault"
    assert ledger.queries.get(str(key)).state is ExportState.REMOTE_UNKNOWN
    # 503: never forwarded, so revision 1 is still current; a cut response: the commit landed.
    landed = fault == "cut_before_response"
    assert s3_current(bucket_of(s3, s3_bucket), key)[0] == (2 if landed else 1)

    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    if landed:
        assert [r.state for r in report.resolved_to(ExportState.COMPLETED)] == [ExportState.COMPLETED]
    else:
        # The commit never landed and is fenced now (token 3): nothing of it can become visible, so it is rerun.
        assert [r.state for r in report.resolved_to(ExportState.FAILED)] == [ExportState.FAILED]
        assert export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export").status == (
            "exported"
        )
    revision, manifest, _ = s3_current(bucket_of(s3, s3_bucket), key)
    assert revision == 2 and ledger.queries.get(str(key)).sha256 == manifest.sha256
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]


def test_discarding_an_unrecorded_revision_keeps_every_recorded_one_and_sets_the_pointer_back(
    store, ledger, clock
):
    """Replaces 0.4's discard of revision 1 beside a current revision 2 and its orphan sweep by age: in protocol v2
    nothing a recorded revision names is ever deleted, and only what no pointer can ever name is swept."""
    destination, bucket = store
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    restate(ledger, destination, key)
    recorded = objects(bucket, key)
    assert place_names(recorded) == ["r1-t1", "r2-t2"]
    with pytest.raises(LedgerError, match="completed"):
        resolve_key(ledger, destination, str(key), action="discard-destination", operator="ops", reason="x")
    pointer = destination.pointer(target_of(key))
    assert destination.sweep(target_of(key), 99, pointer) == 0, "recorded revisions are never swept"

    # Revision 3 committed by an attempt that died before recording it; an operator discards it.
    ledger.restatements.request(str(key), reason="more late rows", requested_by="ops")
    claim = ledger.claims.claim(key, "run-3/export")
    commit_unrecorded(destination, SCHEMA, claim, key, orders(key))
    assert s3_current(bucket, key)[0] == 3
    clock.advance(minutes=16)
    resolved = resolve_key(
        ledger, destination, str(key), action="discard-destination", operator="ops", reason="wrong source"
    )
    assert resolved.record.state is ExportState.FAILED

    stored = objects(bucket, key)
    assert place_names(stored) == ["r1-t1", "r2-t2"], "only revision 3's place was deleted"
    assert {n: b for n, b in stored.items() if n != POINTER_NAME} == {
        n: b for n, b in recorded.items() if n != POINTER_NAME
    }, "revisions 1 and 2, byte for byte"
    after = json.loads(stored[POINTER_NAME])
    assert (after["revision"], after["path"], after["fence"]) == (2, "r2-t2", 4), "set back, fenced by the operator"
    assert s3_current(bucket, key)[0] == 2


# -- Delta Lake: the key's txn versions are its pointer ------------------------------------------------------------
# No objects of its own to list: a reader asks the table (the key's txn version, its rows in one table version),
# and a revision is read back at the table version that committed it.


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])  # on moto: ~3 s a test (log listing)
def delta(request, tmp_path):
    return delta_destination(request, tmp_path, on_s3=request.param == "s3")


def delta_reader_sees(destination, key) -> tuple[int | None, list[str]]:
    """What a reader outside the library sees: the key's txn version and its order ids, from the latest table."""
    import deltalake

    from export_ledger.destinations.delta import KEY_COLUMN

    table = deltalake.DeltaTable(destination.table_for(key.export), storage_options=destination.storage_options())
    rows = table.to_pyarrow_table(filters=[(KEY_COLUMN, "=", str(key))])
    return table.transaction_version(str(key)), sorted(rows.column("order_id").to_pylist())


def delta_table_version(destination, key) -> int:
    import deltalake

    options = destination.storage_options()
    return deltalake.DeltaTable(destination.table_for(key.export), storage_options=options).version()


def ids(frame) -> list[str]:
    return sorted(frame["order_id"])


def test_delta_restating_commits_revision_2_and_keeps_revision_1_readable(delta, ledger):
    key = key_for(DAY)
    assert export_key(ledger, delta, SCHEMA, item(key), "run-1/export").status == "exported"
    assert delta_reader_sees(delta, key) == (1, ids(orders(key)))
    (first,) = ledger.restatements.revisions(str(key))
    original = delta.verify_recorded(target_of(key, 1, "r1-t1"), logical_key=str(key), sha256=first.sha256)
    assert original.verdict is Verdict.PUBLISHED, original.detail

    result = restate(ledger, delta, key)
    assert result.status == "exported" and result.row_count == len(corrected(key))
    assert delta_reader_sees(delta, key) == (2, ids(corrected(key))), "readers see revision 2's rows, only them"
    assert delta.current_revision(target_of(key)) == 2
    seen = delta.verify(target_of(key, 2), logical_key=str(key), superseded=1)
    assert seen.verdict is Verdict.PUBLISHED, seen.detail
    manifest = seen.manifest
    assert (manifest.revision, manifest.supersedes_revision, manifest.supersedes_sha256) == (2, 1, first.sha256)
    # Revision 1 is still readable, at the table version that committed it, byte for byte as recorded.
    again = delta.verify_recorded(target_of(key, 1, "r1-t1"), logical_key=str(key), sha256=first.sha256)
    assert again.verdict is Verdict.PUBLISHED and again.manifest == original.manifest
    assert hashlib.sha256(delta.read_data(target_of(key, 1, "r1-t1"), again.manifest)).hexdigest() == first.sha256
    assert hashlib.sha256(delta.read_data(target_of(key, 2, "r2-t2"), manifest)).hexdigest() == manifest.sha256

    record = ledger.queries.get(str(key))
    assert record.state is ExportState.COMPLETED and record.sha256 == manifest.sha256
    assert record.location == delta.location(target_of(key, 2, "r2-t2"))
    assert [(r.revision, r.sha256) for r in ledger.restatements.revisions(str(key))] == [
        (1, first.sha256),
        (2, manifest.sha256),
    ]


def test_delta_refuses_a_stale_or_fenced_commit_and_leaves_one_already_there_alone(delta, ledger):
    key = key_for(DAY)
    export_key(ledger, delta, SCHEMA, item(key), "run-1/export")
    first = delta.verify(target_of(key), logical_key=str(key), superseded=0).manifest
    restate(ledger, delta, key)
    manifest = delta.verify(target_of(key, 2), logical_key=str(key), superseded=1).manifest
    version, seen = delta_table_version(delta, key), delta_reader_sees(delta, key)

    # A party that still believes revision 1 is current: its revision 3 is never committed.
    stale = stage_revision(delta, key, 3, 5, first)
    with pytest.raises(PointerMoved, match="is at revision 2, not revision 1 which revision 3 supersedes"):
        delta.commit(stale, 5, superseded=1)
    # Revision 2's commit sent again (as after an unknown outcome): already there, so nothing is committed.
    again = delta.commit(StagedExport(target_of(key, 2, "r2-t2"), manifest), 2, superseded=1)
    assert (again.revision, again.place) == (2, "r2-t2")
    assert delta_table_version(delta, key) == version and delta_reader_sees(delta, key) == seen, "never rewritten"

    # A newer party fences the key: an attempt with a lower token commits nothing, even a well-formed revision 3.
    delta.fence(target_of(key), 6, logical_key=str(key))
    paused = stage_revision(delta, key, 3, 5, manifest)
    with pytest.raises(Fenced, match="fenced at token 6, above this party's 5"):
        delta.commit(paused, 5, superseded=2)
    assert delta_reader_sees(delta, key) == seen and delta.current_revision(target_of(key)) == 2


@pytest.mark.parametrize("point", ["after_stage", "after_publish", "before_commit"])
def test_delta_restatement_killed_after_writing_ends_with_one_current_revision(
    delta, ledger, clock, monkeypatch, point
):
    key = key_for(DAY)
    export_key(ledger, delta, SCHEMA, item(key), "run-1/export")
    (first,) = ledger.restatements.revisions(str(key))
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, delta, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)

    committed = point != "after_stage"  # staged rows are not in the table; after_publish is after the commit
    assert delta_reader_sees(delta, key) == ((2, ids(corrected(key))) if committed else (1, ids(orders(key))))
    clock.advance(minutes=16)
    reconcile_batch(ledger, delta, limit=10, after=None, reconciler="test")
    if not committed:
        assert ledger.queries.get(str(key)).state is ExportState.FAILED, "nothing visible: failed, and rerun"
        assert export_key(ledger, delta, SCHEMA, item(key, corrected(key)), "run-3/export").status == "exported"

    record = ledger.queries.get(str(key))
    seen = delta.verify(target_of(key, 2), logical_key=str(key), superseded=1)
    assert seen.verdict is Verdict.PUBLISHED and record.state is ExportState.COMPLETED
    assert record.sha256 == seen.manifest.sha256 and seen.manifest.supersedes_sha256 == first.sha256
    assert delta_reader_sees(delta, key) == (2, ids(corrected(key)))
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]
    kept = delta.verify_recorded(target_of(key, 1, "r1-t1"), logical_key=str(key), sha256=first.sha256)
    assert kept.verdict is Verdict.PUBLISHED, "revision 1 is untouched"


def test_delta_an_unrecorded_revision_is_not_discarded_and_every_recorded_one_stays(delta, ledger, clock):
    """Delta's discard refuses (the operator restores the table instead): neither a recorded revision nor the
    unrecorded one is touched, and the key is not marked failed."""
    key = key_for(DAY)
    export_key(ledger, delta, SCHEMA, item(key), "run-1/export")
    restate(ledger, delta, key)
    recorded = ledger.restatements.revisions(str(key))
    with pytest.raises(LedgerError, match="completed"):
        resolve_key(ledger, delta, str(key), action="discard-destination", operator="ops", reason="x")
    assert delta.sweep(target_of(key), 99, delta.pointer(target_of(key))) == 0, "recorded revisions are never swept"

    ledger.restatements.request(str(key), reason="more late rows", requested_by="ops")
    claim = ledger.claims.claim(key, "run-3/export")
    commit_unrecorded(delta, SCHEMA, claim, key, orders(key))
    assert delta_reader_sees(delta, key)[0] == 3
    clock.advance(minutes=16)
    # Refused, naming the way out (restore the table, then resolve again). Not before anything is written: the
    # operator's hold fences the key first, an empty commit of its fence to the table; no row is written or removed.
    refusal = r"discard-destination of .* failed: delta:.*not discarded by export-ledger; restore the table .*restore"
    with pytest.raises(Exception, match=refusal):
        resolve_key(ledger, delta, str(key), action="discard-destination", operator="ops", reason="wrong source")
    assert ledger.queries.get(str(key)).state is not ExportState.FAILED
    assert delta_reader_sees(delta, key) == (3, ids(orders(key))), "the unrecorded revision is left as it is"
    for revision in recorded:
        place = target_of(key, revision.revision, f"r{revision.revision}-t{revision.revision}")
        seen = delta.verify_recorded(place, logical_key=str(key), sha256=revision.sha256)
        assert seen.verdict is Verdict.PUBLISHED, f"revision {revision.revision} is intact: {seen.detail}"


# -- the ledger table (SQLite and PostgreSQL) ---------------------------------------------------------------------



@pytest.fixture
def table_destination(ledger_url) -> SqlTableDestination:
    return SqlTableDestination(url=ledger_url, table=TABLE)


def row_keys(ledger_url: str) -> dict[str, int]:
    """Rows per row key in the rows table."""
    engine = sa.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            rows = sa.Table(TABLE, sa.MetaData(), autoload_with=conn)
            query = sa.select(rows.c.logical_key, sa.func.count()).group_by(rows.c.logical_key)
            return dict(conn.execute(query).all())
    finally:
        engine.dispose()


def verified(ledger, destination, key, revision: int = 1) -> tuple[Manifest, bytes]:
    """The recorded ``revision``, checked against the ledger's record of it, and its data as the destination reads
    it back."""
    (recorded,) = [r for r in ledger.restatements.revisions(str(key)) if r.revision == revision]
    target = target_of(key, revision)
    seen = destination.verify_recorded(target, logical_key=str(key), sha256=recorded.sha256)
    assert seen.verdict is Verdict.PUBLISHED, f"revision {revision} is published: {seen.detail}"
    data = destination.read_data(target, seen.manifest)
    assert hashlib.sha256(data).hexdigest() == seen.manifest.sha256, f"revision {revision} reads as written"
    return seen.manifest, data


def holds_no(destination, key, revision: int) -> bool:
    seen = destination.verify_recorded(target_of(key, revision), logical_key=str(key), sha256="0" * 64)
    return seen.verdict is Verdict.CONFLICT and "holds no export" in seen.detail


def test_table_restatement_keeps_every_revision_and_moves_the_manifest_row(ledger, table_destination, ledger_url):
    key = key_for(DAY)
    assert export_key(ledger, table_destination, SCHEMA, item(key), "run-1/export").status == "exported"
    first, first_data = verified(ledger, table_destination, key)
    assert not sa.inspect(sa.create_engine(ledger_url)).has_table(f"{TABLE}_revisions"), "made only when restated"
    assert holds_no(table_destination, key, 2)

    assert restate(ledger, table_destination, key).status == "exported"
    second, _ = verified(ledger, table_destination, key, 2)
    assert (second.revision, second.supersedes_revision, second.supersedes_sha256) == (2, 1, first.sha256)
    assert table_destination.current_revision(target_of(key)) == 2
    assert verified(ledger, table_destination, key) == (first, first_data), "revision 1 is still readable"
    record = ledger.queries.get(str(key))
    assert record.state is ExportState.COMPLETED and record.sha256 == second.sha256
    assert record.location == table_destination.location(target_of(key, 2)) and record.location.endswith("revision=2")

    # A second restatement: revision 3 beside both, revision 1's copy is not made twice.
    assert restate(ledger, table_destination, key, "run-3/export").status == "exported"
    third, _ = verified(ledger, table_destination, key, 3)
    assert (third.supersedes_revision, third.supersedes_sha256) == (2, second.sha256)
    assert verified(ledger, table_destination, key, 2)[0] == second
    assert row_keys(ledger_url) == {
        str(key): first.row_count,
        f"{key}#revision=2": second.row_count,
        f"{key}#revision=3": third.row_count,
    }
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2, 3]
    with pytest.raises(Exception, match="restated key"):
        table_destination.discard_target(target_of(key))


def test_table_pointer_refuses_a_stale_revision_and_writes_nothing(ledger, table_destination, ledger_url):
    key = key_for(DAY)
    export_key(ledger, table_destination, SCHEMA, item(key), "run-1/export")
    restate(ledger, table_destination, key)
    first, _ = verified(ledger, table_destination, key)
    before = row_keys(ledger_url)

    # A writer that still believes revision 1 is current: refused inside its transaction, which then rolls back.
    table = validate_frame(corrected(key), SCHEMA, key.window, what=str(key))
    stale = Manifest(**{**first.__dict__, "revision": 3, "supersedes_revision": 1, "supersedes_sha256": first.sha256})
    engine = sa.create_engine(ledger_url)
    try:
        with pytest.raises(PointerMoved, match="current revision is 2, not revision 1"), engine.begin() as conn:
            table_destination.write_in_transaction(conn, target_of(key, 3), table, stale)
    finally:
        engine.dispose()
    assert row_keys(ledger_url) == before and holds_no(table_destination, key, 3)
    assert table_destination.current_revision(target_of(key)) == 2

    # The pointer row judged as a publishing destination's pointer: revision 2 is there; revision 3 superseding 1 is
    # a conflict (neither what it publishes nor what it supersedes).
    confirmed = table_destination.verify(target_of(key, 2), logical_key=str(key), superseded=1)
    assert confirmed.verdict is Verdict.PUBLISHED
    stale_view = table_destination.verify(target_of(key, 3), logical_key=str(key), superseded=1)
    assert stale_view.verdict is Verdict.CONFLICT and "names revision 2" in stale_view.detail


def test_table_restatement_killed_before_commit_leaves_revision_1_current_and_is_rerun(
    ledger, table_destination, ledger_url, clock, monkeypatch
):
    key = key_for(DAY)
    export_key(ledger, table_destination, SCHEMA, item(key), "run-1/export")
    before = row_keys(ledger_url)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, "before_commit=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, table_destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)
    assert row_keys(ledger_url) == before and table_destination.current_revision(target_of(key)) == 1, (
        "all rolled back"
    )
    assert holds_no(table_destination, key, 2)

    clock.advance(minutes=16)
    reconcile_batch(ledger, table_destination, limit=10, after=None, reconciler="test")
    assert ledger.queries.get(str(key)).state is ExportState.FAILED
    assert export_key(ledger, table_destination, SCHEMA, item(key, corrected(key)), "run-3/export").status == (
        "exported"
    )
    assert table_destination.current_revision(target_of(key)) == 2
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]


def test_s3_pointer_is_never_written_on_a_store_that_fails_the_conditional_update_check(
    s3, s3_bucket, s3_server, ledger, fault_proxy
):
    key = key_for(DAY)
    export_key(ledger, s3_destination(s3_bucket, s3_server), SCHEMA, item(key), "run-1/export")
    # Another process (the proxy's endpoint: a store this process has not checked yet) restates the key.
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    pointer = objects(bucket_of(s3, s3_bucket), key)[POINTER_NAME]
    fault_proxy.inject("error_403", method="PUT", when=lambda _method, path: ".export-ledger-probe/" in path)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    with pytest.raises(Exception, match="the store refused the check that s3://.* honours conditional writes"):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    sent = [r.method for r in fault_proxy.history if r.path.endswith(POINTER_NAME)]
    assert "PUT" not in sent, "no pointer write (neither fence nor commit) was sent before the store was checked"
    assert objects(bucket_of(s3, s3_bucket), key)[POINTER_NAME] == pointer
    assert ledger.queries.get(str(key)).state is ExportState.FAILED and destination.current_revision(
        target_of(key)
    ) == 1
    # Not remembered as checked: once the store answers, the check passes and the restatement is committed.
    fault_proxy.clear()
    assert export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export").status == "exported"
    assert destination.current_revision(target_of(key)) == 2
