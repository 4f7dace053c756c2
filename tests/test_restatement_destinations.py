"""Restatements on the S3 and ledger-table destinations: revision N beside N - 1, one current pointer per key.

S3 runs on the moto server (behind the fault proxy where a test breaks or races a request); its pointer is the
``_current.json`` object, moved by a conditional write. The ledger table runs on SQLite and PostgreSQL; its pointer is
the key's ``<table>_manifests`` row, moved in the completion transaction. Either way a reader sees exactly one intact
current revision, revision 1 stays readable, and the ledger records revisions 1 and 2.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json

import boto3
import pytest
import sqlalchemy as sa

from export_ledger.destinations.base import CURRENT_NAME, ExportTarget, PointerMoved
from export_ledger.destinations.s3 import S3Destination
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.frames import MANIFEST_NAME, Manifest, validate_frame
from export_ledger.ledger import ExportLedger, ExportState
from export_ledger.protocol import ExportOutcomeUnknown, export_key
from export_ledger.reconcile import reconcile_batch
from tests.builders import key_for
from tests.test_batched_ledger import SCHEMA
from tests.test_restatement import DAY, corrected, item

PREFIX = "exports"
TABLE = "restated_orders"


def target_of(key, revision: int = 1) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision)


def restate(ledger, destination, key, run_id: str = "run-2/export"):
    ledger.request_restatement(str(key), reason="invoice amounts corrected", requested_by="ops")
    return export_key(ledger, destination, SCHEMA, item(key, corrected(key)), run_id)


# -- S3 -----------------------------------------------------------------------------------------------------------


@pytest.fixture
def s3(s3_server, s3_credentials):
    """A client on the moto server itself: what the bucket really holds, whatever the proxy does."""
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    yield client
    client.close()


@pytest.fixture
def s3_ledger(sqlite_url, clock) -> ExportLedger:
    return ExportLedger(sqlite_url, clock=clock, lease_ttl=dt.timedelta(minutes=15))


def s3_destination(bucket: str, endpoint_url: str) -> S3Destination:
    return S3Destination(
        bucket=bucket,
        prefix=PREFIX,
        endpoint_url=endpoint_url,
        access_key_id="testing",
        secret_access_key="testing",
        read_timeout_seconds=3.0,
    )


def key_prefix(key) -> str:
    return f"{PREFIX}/{key.export}/tenant={key.tenant}/date={key.window.business_date.isoformat()}/"


def objects(s3, bucket: str, key) -> dict[str, bytes]:
    """Object name (relative to the key's folder) -> bytes, for everything under the key's folder."""
    base = key_prefix(key)
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=base).get("Contents", [])
    return {item["Key"][len(base) :]: s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read() for item in listing}


def s3_current(s3, bucket: str, key) -> tuple[int, Manifest, bytes]:
    """What an outside reader does: follow ``_current.json`` (absent: revision 1 in the key's folder), read the
    revision's manifest and the data it names, and check the data against the manifest's sha256."""
    stored = objects(s3, bucket, key)
    pointer = json.loads(stored[CURRENT_NAME]) if CURRENT_NAME in stored else {"revision": 1, "path": "."}
    folder = "" if pointer["path"] == "." else f"{pointer['path']}/"
    manifest = Manifest.from_json(stored[f"{folder}{MANIFEST_NAME}"], "moto")
    data = stored[f"{folder}{manifest.data_file}"]
    assert hashlib.sha256(data).hexdigest() == manifest.sha256, "the current revision's data matches its manifest"
    assert manifest.revision == pointer["revision"], "the pointer names the revision its folder holds"
    return pointer["revision"], manifest, data


def revision_names(stored: dict[str, bytes]) -> list[str]:
    return sorted({name.split("/", 1)[0] for name in stored if name.startswith("revision=")})


def test_s3_restating_publishes_revision_2_beside_revision_1_and_moves_the_pointer(s3, s3_bucket, s3_server, s3_ledger):
    destination = s3_destination(s3_bucket, s3_server)
    key = key_for(DAY)
    assert export_key(s3_ledger, destination, SCHEMA, item(key), "run-1/export").status == "exported"
    _, original_manifest, original = s3_current(s3, s3_bucket, key)
    assert CURRENT_NAME not in objects(s3, s3_bucket, key), "a key never restated needs no pointer"

    result = restate(s3_ledger, destination, key)
    assert result.status == "exported" and result.row_count == len(corrected(key))

    revision, manifest, data = s3_current(s3, s3_bucket, key)
    assert revision == 2 and destination.current(target_of(key)) == 2
    assert (manifest.revision, manifest.supersedes_revision, manifest.supersedes_sha256) == (
        2,
        1,
        original_manifest.sha256,
    )
    stored = objects(s3, s3_bucket, key)
    assert revision_names(stored) == ["revision=2"]
    pointer = json.loads(stored[CURRENT_NAME])
    assert pointer == {
        "logical_key": str(key),
        "revision": 2,
        "path": "revision=2",
        "sha256": manifest.sha256,
        "data_file": manifest.data_file,
    }
    # Revision 1 is still where it was, byte for byte, and readable through the destination.
    assert Manifest.from_json(stored[MANIFEST_NAME], "moto") == original_manifest
    assert stored[original_manifest.data_file] == original
    assert destination.probe(target_of(key)) == original_manifest
    assert destination.read_data(target_of(key), original_manifest) == original
    assert destination.read_data(target_of(key, 2), manifest) == data

    record = s3_ledger.get(str(key))
    assert record.state is ExportState.COMPLETED and record.sha256 == manifest.sha256
    assert record.location == f"s3://{s3_bucket}/{key_prefix(key)}revision=2/"
    assert [(r.revision, r.sha256) for r in s3_ledger.revisions(str(key))] == [
        (1, original_manifest.sha256),
        (2, manifest.sha256),
    ]


def test_s3_pointer_refuses_a_stale_move_and_leaves_one_already_there_alone(s3, s3_bucket, s3_server, s3_ledger):
    destination = s3_destination(s3_bucket, s3_server)
    key = key_for(DAY)
    export_key(s3_ledger, destination, SCHEMA, item(key), "run-1/export")
    restate(s3_ledger, destination, key)
    _, manifest, _ = s3_current(s3, s3_bucket, key)
    pointer_key = f"{key_prefix(key)}{CURRENT_NAME}"
    before = s3.head_object(Bucket=s3_bucket, Key=pointer_key)

    with pytest.raises(PointerMoved, match="points at revision 2, not at revision 1 which revision 3 supersedes"):
        destination.move_current(target_of(key, 3), manifest, supersedes=1)
    destination.move_current(target_of(key, 2), manifest, supersedes=1)  # already there: nothing to do

    after = s3.head_object(Bucket=s3_bucket, Key=pointer_key)
    assert (after["ETag"], after["LastModified"]) == (before["ETag"], before["LastModified"]), "never rewritten"
    assert destination.current(target_of(key)) == 2


@pytest.mark.parametrize(
    ("interloper_revision", "outcome"),
    [(3, "refused"), (2, "idempotent")],
    ids=["another-revision-won", "same-revision-won"],
)
def test_s3_pointer_written_between_read_and_write_is_never_overwritten(
    s3, s3_bucket, s3_ledger, fault_proxy, interloper_revision, outcome
):
    """A real lost-update race: the interloper writes the pointer when the proxy holds the mover's conditional PUT
    (after the mover read the pointer, before its write reaches the store); the store answers 412."""
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    export_key(s3_ledger, destination, SCHEMA, item(key), "run-1/export")
    manifest = destination.probe(target_of(key))
    pointer_key = f"{key_prefix(key)}{CURRENT_NAME}"
    interloper = json.dumps({"revision": interloper_revision, "path": f"revision={interloper_revision}"}).encode()
    raced = []

    def interlope(method: str, path: str) -> bool:
        if method == "PUT" and path.endswith(f"/{pointer_key}") and not raced:
            s3.put_object(Bucket=s3_bucket, Key=pointer_key, Body=interloper)
            raced.append(path)
        return False  # no fault: the mover's PUT is forwarded as sent

    destination.check_conditional_updates()  # its probe PUTs are not the race
    fault_proxy.inject("error_500", count=None, when=interlope)
    if outcome == "refused":
        with pytest.raises(PointerMoved, match="points at revision 3, not at revision 1"):
            destination.move_current(target_of(key, 2), manifest, supersedes=1)
    else:
        destination.move_current(target_of(key, 2), manifest, supersedes=1)
    assert raced, "the mover's PUT met the race"
    assert s3.get_object(Bucket=s3_bucket, Key=pointer_key)["Body"].read() == interloper, "the interloper's stays"


@pytest.mark.parametrize("point", ["after_publish", "after_current", "before_commit"])
def test_s3_restatement_killed_after_publishing_ends_with_one_current_revision(
    s3, s3_bucket, s3_server, s3_ledger, clock, monkeypatch, point
):
    destination = s3_destination(s3_bucket, s3_server)
    key = key_for(DAY)
    export_key(s3_ledger, destination, SCHEMA, item(key), "run-1/export")
    _, original_manifest, original = s3_current(s3, s3_bucket, key)
    s3_ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
    with pytest.raises(SimulatedCrash):
        export_key(s3_ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)

    revision, _, _ = s3_current(s3, s3_bucket, key)  # readers see one intact revision, whatever was reached
    assert revision == (1 if point == "after_publish" else 2)
    clock.advance(minutes=16)
    reconcile_batch(s3_ledger, destination, limit=10, after=None, reconciler="test")

    record = s3_ledger.get(str(key))
    revision, manifest, _ = s3_current(s3, s3_bucket, key)
    assert record.state is ExportState.COMPLETED and record.sha256 == manifest.sha256
    assert revision == 2 and manifest.supersedes_sha256 == original_manifest.sha256
    assert [r.revision for r in s3_ledger.revisions(str(key))] == [1, 2]
    stored = objects(s3, s3_bucket, key)
    assert revision_names(stored) == ["revision=2"]
    assert stored[original_manifest.data_file] == original, "revision 1 is untouched"


@pytest.mark.parametrize("fault", ["error_503", "cut_before_response"])
def test_s3_pointer_write_with_an_unknown_outcome_is_remote_unknown_and_reconciled(
    s3, s3_bucket, s3_ledger, fault_proxy, fault
):
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    export_key(s3_ledger, destination, SCHEMA, item(key), "run-1/export")
    s3_ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    fault_proxy.inject(fault, method="PUT", path_suffix=f"/{CURRENT_NAME}")
    with pytest.raises(ExportOutcomeUnknown, match="may or may not have moved"):
        export_key(s3_ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    assert fault_proxy.remaining == 0, "the pointer's PUT met the fault"
    assert s3_ledger.get(str(key)).state is ExportState.REMOTE_UNKNOWN
    # 503: never forwarded, so revision 1 is still current; a cut response: the move landed.
    assert s3_current(s3, s3_bucket, key)[0] == (1 if fault == "error_503" else 2)

    report = reconcile_batch(s3_ledger, destination, limit=10, after=None, reconciler="test")
    assert [r.state for r in report.resolved_to(ExportState.COMPLETED)] == [ExportState.COMPLETED]
    revision, manifest, _ = s3_current(s3, s3_bucket, key)
    assert revision == 2 and s3_ledger.get(str(key)).sha256 == manifest.sha256
    assert [r.revision for r in s3_ledger.revisions(str(key))] == [1, 2]


def test_s3_discarding_revision_1_keeps_later_revisions_and_the_pointer(s3, s3_bucket, s3_server, s3_ledger):
    destination = s3_destination(s3_bucket, s3_server)
    key = key_for(DAY)
    export_key(s3_ledger, destination, SCHEMA, item(key), "run-1/export")
    first = destination.probe(target_of(key))
    restate(s3_ledger, destination, key)
    later = {name: body for name, body in objects(s3, s3_bucket, key).items() if "/" in name or name == CURRENT_NAME}
    assert len(later) == 3, "revision 2's manifest and data, and the pointer"

    assert destination.discard_abandoned(target_of(key), below_token=99) == 0, "revision 1's data is its manifest's"
    with pytest.raises(Exception, match="is revision 2, the key's current one"):
        destination.discard_target(target_of(key, 2))
    removed = destination.discard_target(target_of(key))

    assert sorted(removed) == sorted([MANIFEST_NAME, first.data_file])
    assert objects(s3, s3_bucket, key) == later, "only revision 1's own objects were deleted"
    assert s3_current(s3, s3_bucket, key)[0] == 2


# -- the ledger table (SQLite and PostgreSQL) ---------------------------------------------------------------------


@pytest.fixture
def ledger(ledger_url, clock) -> ExportLedger:
    return ExportLedger(ledger_url, clock=clock, lease_ttl=dt.timedelta(minutes=15))


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


def verified(destination, target) -> tuple[Manifest, bytes]:
    manifest = destination.probe(target)
    assert manifest is not None, f"revision {target.revision} is published"
    data = destination.read_data(target, manifest)
    assert hashlib.sha256(data).hexdigest() == manifest.sha256, f"revision {target.revision} reads as written"
    return manifest, data


def test_table_restatement_keeps_every_revision_and_moves_the_manifest_row(ledger, table_destination, ledger_url):
    key = key_for(DAY)
    assert export_key(ledger, table_destination, SCHEMA, item(key), "run-1/export").status == "exported"
    first, first_data = verified(table_destination, target_of(key))
    assert not sa.inspect(sa.create_engine(ledger_url)).has_table(f"{TABLE}_revisions"), "made only when restated"
    assert table_destination.probe(target_of(key, 2)) is None

    assert restate(ledger, table_destination, key).status == "exported"
    second, _ = verified(table_destination, target_of(key, 2))
    assert (second.revision, second.supersedes_revision, second.supersedes_sha256) == (2, 1, first.sha256)
    assert table_destination.current(target_of(key)) == 2
    assert verified(table_destination, target_of(key)) == (first, first_data), "revision 1 is still readable"
    record = ledger.get(str(key))
    assert record.state is ExportState.COMPLETED and record.sha256 == second.sha256
    assert record.location == table_destination.location(target_of(key, 2)) and record.location.endswith("revision=2")

    # A second restatement: revision 3 beside both, revision 1's copy is not made twice.
    assert restate(ledger, table_destination, key, "run-3/export").status == "exported"
    third, _ = verified(table_destination, target_of(key, 3))
    assert (third.supersedes_revision, third.supersedes_sha256) == (2, second.sha256)
    assert verified(table_destination, target_of(key, 2))[0] == second
    assert row_keys(ledger_url) == {
        str(key): first.row_count,
        f"{key}#revision=2": second.row_count,
        f"{key}#revision=3": third.row_count,
    }
    assert [r.revision for r in ledger.revisions(str(key))] == [1, 2, 3]
    with pytest.raises(Exception, match="restated key"):
        table_destination.discard_target(target_of(key))


def test_table_pointer_refuses_a_stale_revision_and_writes_nothing(ledger, table_destination, ledger_url):
    key = key_for(DAY)
    export_key(ledger, table_destination, SCHEMA, item(key), "run-1/export")
    restate(ledger, table_destination, key)
    first = table_destination.probe(target_of(key))
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
    assert row_keys(ledger_url) == before and table_destination.probe(target_of(key, 3)) is None
    assert table_destination.current(target_of(key)) == 2

    second = table_destination.probe(target_of(key, 2))
    table_destination.move_current(target_of(key, 2), second, supersedes=1)  # already there: confirmed
    with pytest.raises(PointerMoved, match="current revision is 2"):
        table_destination.move_current(target_of(key, 3), second, supersedes=2)


def test_table_restatement_killed_before_commit_leaves_revision_1_current_and_is_rerun(
    ledger, table_destination, ledger_url, clock, monkeypatch
):
    key = key_for(DAY)
    export_key(ledger, table_destination, SCHEMA, item(key), "run-1/export")
    before = row_keys(ledger_url)
    ledger.request_restatement(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, "before_commit=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, table_destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)
    assert row_keys(ledger_url) == before and table_destination.current(target_of(key)) == 1, "all rolled back"
    assert table_destination.probe(target_of(key, 2)) is None

    clock.advance(minutes=16)
    reconcile_batch(ledger, table_destination, limit=10, after=None, reconciler="test")
    assert ledger.get(str(key)).state is ExportState.FAILED
    assert export_key(ledger, table_destination, SCHEMA, item(key, corrected(key)), "run-3/export").status == (
        "exported"
    )
    assert table_destination.current(target_of(key)) == 2
    assert [r.revision for r in ledger.revisions(str(key))] == [1, 2]


def test_s3_pointer_is_never_moved_on_a_store_that_fails_the_conditional_update_check(
    s3, s3_bucket, s3_ledger, fault_proxy
):
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    export_key(s3_ledger, destination, SCHEMA, item(key), "run-1/export")
    manifest = destination.probe(target_of(key))
    fault_proxy.inject("error_403", method="PUT", when=lambda _method, path: ".export-ledger-probe/" in path)
    with pytest.raises(Exception, match="the store refused the check .* honours conditional updates \\(If-Match\\)"):
        destination.move_current(target_of(key, 2), manifest, supersedes=1)
    assert destination.current(target_of(key)) == 1
    sent = [r.method for r in fault_proxy.history if r.path.endswith(CURRENT_NAME)]
    assert "PUT" not in sent, "no pointer write was sent"
    # Not remembered as checked: once the store answers, the check passes and the pointer moves.
    destination.move_current(target_of(key, 2), manifest, supersedes=1)
    assert destination.current(target_of(key)) == 2
