"""The S3 destination end to end: a moto server behind the fault proxy, the pipeline through Dagster's public APIs.

Every fault the proxy knows is applied to each PUT of an attempt: its data object, its manifest (both in its own
place ``r<revision>-t<token>/``) and the key's pointer ``_current.json`` (the commit, the one write readers see).
Right after the failed run the ledger must say what is known (``failed`` when nothing was sent: a refused connection,
a connect timeout; ``remote_unknown`` when the write may have landed); reconciliation (the sensor: hold with a new
token, fence the pointer, judge what it names) and at most one rerun must then end with exactly the key's pointer and
the one place it names in the bucket, and the key ``completed``. Objects are always read straight from the moto
server, never through the proxy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import uuid
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import dagster as dg
import pytest
from condition_proxy import CheckThenWrite
from pipeline_helpers import failure_message, ledger_at, make_defs, places, published_dirs, run_partition
from s3_support import Fault

from definitions import build_definitions
from export_ledger.destinations import POINTER_NAME, ExportTarget, Fenced, StagedExport, Verdict, place_of_location
from export_ledger.destinations import delta as delta_module
from export_ledger.destinations import s3 as s3_module
from export_ledger.destinations.delta import DeltaDestination
from export_ledger.destinations.s3 import S3Destination
from export_ledger.destinations.store import AlreadyExists
from export_ledger.errors import ConfigurationError
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger.schema import AttemptOutcome, ExportState

ASSET = dg.AssetKey("invoice_export")
PARTITION = "2026-03-08"
KEY = "invoice_export/acme/2026-03-08T05:00:00Z"
FOLDER = "invoice_export/tenant=acme/date=2026-03-08"
TARGET = ExportTarget("invoice_export", "acme", "2026-03-08")
PREFIX = "exports"
# A held response must outlast the client's read timeout; everything else on loopback answers far sooner.
READ_TIMEOUT_SECONDS = 3.0  # generous: a loaded CI machine must not time out an ordinary request
DELAY_SECONDS = 6.0
# The kernel answers a loopback connect at once, however loaded the machine; a connect_timeout fault waits this out.
CONNECT_TIMEOUT_SECONDS = 2.0
UNKNOWN_OUTCOME = "the outcome at the destination is unknown"
# The objects of the first attempt's place (token 1, revision 1).
FIRST_PLACE = "r1-t1"



def s3_destination(bucket: str, endpoint_url: str, prefix: str = PREFIX) -> S3Destination:
    return S3Destination(
        bucket=bucket,
        prefix=prefix,
        endpoint_url=endpoint_url,
        access_key_id="testing",
        secret_access_key="testing",
        connect_timeout_seconds=CONNECT_TIMEOUT_SECONDS,
        read_timeout_seconds=READ_TIMEOUT_SECONDS,
    )


def stored(s3, bucket: str, folder: str = FOLDER, prefix: str = PREFIX) -> dict[str, bytes]:
    """Object name (relative to the folder) -> bytes of everything under one folder on the moto server."""
    base = f"{prefix}/{folder}/" if folder else f"{prefix}/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base)
    names = [item["Key"] for page in pages for item in page.get("Contents", [])]
    return {name[len(base) :]: s3.get_object(Bucket=bucket, Key=name)["Body"].read() for name in names}


def place_objects(place: str) -> list[str]:
    """The objects of one place holding a CSV export, sorted."""
    return [f"{place}/{MANIFEST_NAME}", f"{place}/data.csv"]


def pointer_of(objects: dict[str, bytes]) -> dict:
    return json.loads(objects[POINTER_NAME])


def exported_data(objects: dict[str, bytes]) -> bytes:
    """The data object the pointer names (the export readers see), checked against its manifest and the pointer."""
    pointer = pointer_of(objects)
    manifest = Manifest.from_json(objects[pointer["manifest"]], "moto")
    payload = objects[pointer["data_file"]]
    assert hashlib.sha256(payload).hexdigest() == manifest.sha256 == pointer["sha256"], "readers can verify it"
    return payload


def materializations(instance: dg.DagsterInstance, partition: str) -> list:
    records_filter = dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[partition])
    return instance.fetch_materializations(records_filter, limit=100).records


def reconcile_tick(defs: dg.Definitions, instance: dg.DagsterInstance) -> dg.SensorResult:
    """One reconciliation tick, its asset events recorded in the instance as the daemon records them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # get_sensor_def's notice about unresolved resources
        sensor = defs.get_sensor_def("reconciliation_sensor")
    with dg.build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context:
        result = sensor(context)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return result


@contextlib.contextmanager
def cut_off_from(destination: S3Destination, proxy, suffix: str, fault: Fault):
    """A connection fault (``refuse``, ``connect_timeout``) from the moment the destination is about to send the PUT
    of ``suffix``.

    Those faults apply to every connection at once, which would fail the pointer's GET first. To hit one chosen PUT
    (for the manifest: after the data PUT succeeded), the fault starts from botocore's ``before-send`` event on the
    destination's own client.
    """

    def cut_off(request, **_):
        if request.method == "PUT" and urlsplit(request.url).path.endswith(suffix):
            proxy.inject(fault)

    client = destination.store._s3()
    client.meta.events.register("before-send.s3.PutObject", cut_off)
    try:
        yield
    finally:
        client.meta.events.unregister("before-send.s3.PutObject", cut_off)
        proxy.clear()


@contextlib.contextmanager
def ignoring(destination: S3Destination, condition: str):
    """The destination's client drops ``condition`` (``IfNoneMatch``, ``IfMatch``) from every PutObject: what a store
    that ignores the header does with it. The startup check is forgotten before and after."""

    def drop_condition(params, **_):
        params.pop(condition, None)

    client = destination.store._s3()
    checked = (destination.endpoint_url, destination.bucket)
    client.meta.events.register("provide-client-params.s3.PutObject", drop_condition)
    s3_module._CONDITIONS_CHECKED.discard(checked)
    try:
        yield
    finally:
        client.meta.events.unregister("provide-client-params.s3.PutObject", drop_condition)
        s3_module._CONDITIONS_CHECKED.discard(checked)


# -- faults on each PUT ------------------------------------------------------------------------------------------

# An attempt's PUTs in the order it sends them (token 1 sends no fence): data and manifest in its place, then the
# pointer. Each name is matched as a path suffix.
WRITES = {"data": "/data.csv", "manifest": f"/{MANIFEST_NAME}", "pointer": f"/{POINTER_NAME}"}
WRITTEN = {"data": f"{FIRST_PLACE}/data.csv", "manifest": f"{FIRST_PLACE}/{MANIFEST_NAME}", "pointer": POINTER_NAME}
# The proxy forwards these and loses the answer: the object is written although the client never hears so.
LANDS_ANYWAY = {Fault.CUT_BEFORE_RESPONSE, Fault.DELAY}
# Connection faults: the request is never sent, so nothing can have been written.
NOTHING_SENT = {Fault.REFUSE, Fault.CONNECT_TIMEOUT}


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize(
    "fault",
    [
        Fault.DROP_BEFORE_FORWARD,
        Fault.CUT_BEFORE_RESPONSE,
        Fault.DELAY,
        Fault.ERROR_500,
        Fault.ERROR_503,
        Fault.REFUSE,
        Fault.CONNECT_TIMEOUT,
    ],
)
def test_a_fault_on_a_put_is_classified_then_reconciled_to_one_completed_export(
    tmp_path, instance, s3, s3_bucket, fault_proxy, fault, write
):
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    defs = make_defs(tmp_path, destination=destination)
    name = WRITES[write]

    if fault in NOTHING_SENT:
        with cut_off_from(destination, fault_proxy, name, fault):
            failed = run_partition(defs, instance, PARTITION)
    else:
        fault_proxy.inject(fault, method="PUT", path_suffix=name, count=1, delay_seconds=DELAY_SECONDS)
        failed = run_partition(defs, instance, PARTITION)
        assert fault_proxy.remaining == 0, f"the {fault} fault should have hit the {write} PUT"
        fault_proxy.clear()

    assert not failed.success
    ledger = ledger_at(tmp_path)
    message = failure_message(failed)
    if fault in NOTHING_SENT:
        assert ledger.queries.get(KEY).state is ExportState.FAILED, (
            f"{fault}: the request was never sent, so nothing can have been written (a connect timeout included)"
        )
        assert "cannot reach the store" in message, message
    else:
        assert ledger.queries.get(KEY).state is ExportState.REMOTE_UNKNOWN, (
            f"after {fault} the write may have landed or not"
        )
        assert UNKNOWN_OUTCOME in message and "remote_unknown" in message, message
        assert "reconciliation" in message and "will resolve it" in message, "the operator learns what happens next"
    sent_before = list(WRITES)[: list(WRITES).index(write)]
    expected = [WRITTEN[w] for w in sent_before] + ([WRITTEN[write]] if fault in LANDS_ANYWAY else [])
    assert sorted(stored(s3, s3_bucket)) == sorted(expected), "what the moto server holds right after the fault"
    assert materializations(instance, PARTITION) == [], "a failed run materializes nothing"

    committed = write == "pointer" and fault in LANDS_ANYWAY  # the pointer names the attempt's place
    tick = reconcile_tick(defs, instance)
    if fault in NOTHING_SENT:
        assert [r.partition_key for r in tick.run_requests] == [PARTITION], "a failed key is rerun, not reconciled"
        rerun_partitions = [PARTITION]
    elif committed:
        assert ledger.queries.get(KEY).state is ExportState.COMPLETED, "the commit landed: reconciliation records it"
        assert [e.partition for e in tick.asset_events] == [PARTITION] and not tick.run_requests
        rerun_partitions = []
    else:
        assert ledger.queries.get(KEY).state is ExportState.FAILED, (
            "the pointer never named the attempt's place: nothing of it is visible, and fenced now, nothing of it can "
            "become visible; safe to retry"
        )
        assert [r.partition_key for r in tick.run_requests] == [PARTITION], "reconciliation requests the rerun"
        rerun_partitions = [r.partition_key for r in tick.run_requests]
    if fault not in NOTHING_SENT:
        assert pointer_of(stored(s3, s3_bucket))["fence"] == 2, "reconciliation fenced the pointer with its own token"
    for partition in rerun_partitions:
        rerun = run_partition(defs, instance, partition)
        assert rerun.success, failure_message(rerun)

    record = ledger.queries.get(KEY)
    assert record.state is ExportState.COMPLETED
    objects = stored(s3, s3_bucket)
    place = place_of_location(record.location)
    assert place == (FIRST_PLACE if committed else f"r1-t{record.fencing_token}"), "the place of the recorded attempt"
    assert sorted(objects) == [POINTER_NAME, *place_objects(place)], (
        "the pointer and the one place it names: the failed attempt's place was swept by the next token"
    )
    pointer = pointer_of(objects)
    assert (pointer["revision"], pointer["path"], pointer["fence"]) == (1, place, record.fencing_token)
    manifest = Manifest.from_json(objects[f"{place}/{MANIFEST_NAME}"], "moto")
    assert manifest.logical_key == KEY
    assert hashlib.sha256(exported_data(objects)).hexdigest() == manifest.sha256 == record.sha256
    assert len(materializations(instance, PARTITION)) == 1, "the partition is materialized exactly once"


# -- places of fenced attempts -----------------------------------------------------------------------------------


def test_a_fenced_attempts_place_is_swept_by_the_next_token_and_never_becomes_visible(
    tmp_path, instance, s3, s3_bucket, fault_proxy
):
    # The data object landed, then the store answered 403 to the manifest: nothing is visible (no pointer names the
    # place), and the key is failed. The retry (token 2) fences the pointer and sweeps the place of token 1 at once,
    # with no age rule: however late its writer wakes, a token below the pointer's fence can never commit it.
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    defs = make_defs(tmp_path, destination=destination)
    fault_proxy.inject(Fault.ERROR_403, method="PUT", path_suffix=MANIFEST_NAME, count=1)
    assert not run_partition(defs, instance, PARTITION).success
    fault_proxy.clear()
    ledger = ledger_at(tmp_path)
    assert ledger.queries.get(KEY).state is ExportState.FAILED, "a refused manifest made nothing visible: safe to retry"
    assert sorted(stored(s3, s3_bucket)) == [f"{FIRST_PLACE}/data.csv"], "token 1's place, named by no pointer"

    retry = run_partition(defs, instance, PARTITION)
    assert retry.success, failure_message(retry)
    record = ledger.queries.get(KEY)
    assert record.state is ExportState.COMPLETED and record.fencing_token == 2
    objects = stored(s3, s3_bucket)
    assert sorted(objects) == [POINTER_NAME, *place_objects("r1-t2")], (
        "token 1's place is swept at once, not after a lease"
    )
    assert place_of_location(record.location) == "r1-t2"

    # Token 1's writer wakes now: it writes its place again, manifest and all, and commits it. The pointer's fence
    # refuses the commit, and readers still see the retry's export.
    winner = Manifest.from_json(objects[f"r1-t2/{MANIFEST_NAME}"], "moto")
    late = dataclasses.replace(winner, attempt_id="late-writer/invoice_export", fencing_token=1)
    destination.store.put_if_absent(f"{FOLDER}/{FIRST_PLACE}/data.csv", b"late rows\n")
    destination.store.put_if_absent(f"{FOLDER}/{FIRST_PLACE}/{MANIFEST_NAME}", late.to_json())
    with pytest.raises(Fenced) as refused:
        destination.commit(StagedExport(TARGET.at_place(FIRST_PLACE), late), 1, superseded=0)
    assert refused.value.fence == 2, "refused by the fence the retry raised"
    assert stored(s3, s3_bucket)[POINTER_NAME] == objects[POINTER_NAME], "the pointer still names the retry's place"
    seen = destination.verify(TARGET, logical_key=KEY, superseded=0, expected_sha256=record.sha256)
    assert seen.verdict is Verdict.PUBLISHED and seen.manifest.attempt_id == winner.attempt_id, seen.detail
    assert seen.location == record.location, "readers see the recorded export, whatever the late writer wrote"


# -- conditional writes -------------------------------------------------------------------------------------------


def test_a_store_that_ignores_conditional_creates_is_refused_before_anything_is_published(
    tmp_path, instance, s3, s3_bucket, fault_proxy
):
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url, "ignoring")
    with ignoring(destination, "IfNoneMatch"):
        defs = make_defs(tmp_path, destination=destination)
        result = run_partition(defs, instance, PARTITION)
    assert not result.success
    assert "ignores conditional writes" in failure_message(result)
    assert stored(s3, s3_bucket, folder="", prefix="ignoring") == {}, "nothing is written to such a store"


def test_a_store_that_ignores_if_match_is_refused_before_anything_is_published(
    tmp_path, instance, s3, s3_bucket, fault_proxy
):
    # On such a store the pointer's compare-and-swap is a blind overwrite: two parties could both move it, and a
    # fenced party could still change what readers see.
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url, "ignoring")
    defs = make_defs(tmp_path, destination=destination)
    with ignoring(destination, "IfMatch"):
        result = run_partition(defs, instance, PARTITION)
    assert not result.success
    message = failure_message(result)
    assert "ignores conditional writes" in message and "If-Match" in message, message
    assert ledger_at(tmp_path).queries.get(KEY).state is ExportState.FAILED, "refused before anything was sent"
    assert stored(s3, s3_bucket, folder="", prefix="ignoring") == {}, "nothing is written to such a store"

    rerun = run_partition(defs, instance, PARTITION)
    assert rerun.success, "the refusal is not remembered: once the store honours If-Match, the key exports"
    assert ledger_at(tmp_path).queries.get(KEY).state is ExportState.COMPLETED


def test_a_store_whose_conditional_create_is_a_check_then_a_write_is_refused_by_racing_creates(
    tmp_path, instance, s3, s3_server, s3_bucket
):
    """A second create sent after the first is refused by such a store, as by an honest one: only creates that race
    inside its window between check and write show that two parties could both win."""
    with CheckThenWrite(s3_server, window_seconds=0.2) as proxy:
        sequential = s3_destination(s3_bucket, proxy.endpoint_url, "sequential").store
        sequential.put_if_absent("probe", b"first")
        with pytest.raises(AlreadyExists):
            sequential.put_if_absent("probe", b"second")
        destination = s3_destination(s3_bucket, proxy.endpoint_url, "racing")
        s3_module._CONDITIONS_CHECKED.discard((destination.endpoint_url, destination.bucket))
        result = run_partition(make_defs(tmp_path, destination=destination), instance, PARTITION)
    assert not result.success
    message = failure_message(result)
    assert "conditional creates of one new object sent at once" in message, message
    assert "not one atomic step" in message and "Refusing to publish to it" in message, message
    assert ledger_at(tmp_path).queries.get(KEY).state is ExportState.FAILED, "refused before anything was sent"
    assert stored(s3, s3_bucket, folder="", prefix="racing") == {}, "nothing is left: the probes are deleted"
    assert (destination.endpoint_url, destination.bucket) not in s3_module._CONDITIONS_CHECKED


def test_a_delta_table_on_a_store_whose_conditional_create_is_a_check_then_a_write_is_refused(s3_server, s3_bucket, s3):
    """Delta's commit is a create-only-if-absent of the next log entry: on such a store two racing writers could both
    commit one table version. The sequential second create of the probe is refused there; racing creates are not."""
    with CheckThenWrite(s3_server, window_seconds=0.2) as proxy:
        table = DeltaDestination(f"s3://{s3_bucket}/lake/{{export}}", endpoint_url=proxy.endpoint_url,
                                 access_key_id="testing", secret_access_key="testing")  # fmt: skip
        delta_module._CONDITIONS_CHECKED.discard((proxy.endpoint_url, s3_bucket))
        with pytest.raises(ConfigurationError, match="conditional creates of one new object sent at once") as refused:
            table.check_table("invoice_export")
    assert "not one atomic step" in str(refused.value) and "same Delta table version" in str(refused.value)
    assert (proxy.endpoint_url, s3_bucket) not in delta_module._CONDITIONS_CHECKED, "a refusal is not remembered"
    assert s3.list_objects_v2(Bucket=s3_bucket).get("Contents", []) == [], "no table was made, the probes are deleted"


def _another_keys_export(s3, bucket: str, tmp_path: Path, instance, endpoint_url: str) -> dict[str, bytes]:
    """The objects of another key's export (the same tenant's 2026-03-07), by name relative to its key folder."""
    other = make_defs(tmp_path / "other", destination=s3_destination(bucket, endpoint_url, "other"))
    assert run_partition(other, instance, "2026-03-07").success
    return stored(s3, bucket, FOLDER.replace("03-08", "03-07"), prefix="other")


CONFLICTS = [
    "manifest of another key",  # in the key's folder: what 0.4.0 and earlier read as a revision 1
    "pointer to another key's export",  # the pointer and the place it names, copied from another key
]


def _plant_conflict(kind: str, s3, bucket: str, tmp_path: Path, instance, endpoint_url: str) -> dict[str, bytes]:
    """Puts something that is not this key's export where its export belongs; returns what, by name relative to the
    key's folder."""
    objects = _another_keys_export(s3, bucket, tmp_path, instance, endpoint_url)
    if kind == "manifest of another key":
        planted = {MANIFEST_NAME: objects[f"{FIRST_PLACE}/{MANIFEST_NAME}"]}
    else:
        planted = objects
    for name, body in planted.items():
        s3.put_object(Bucket=bucket, Key=f"{PREFIX}/{FOLDER}/{name}", Body=body)
    return planted


@pytest.mark.parametrize("kind", CONFLICTS)
def test_a_different_object_at_the_key_is_never_overwritten_and_the_error_tells_the_operator(
    tmp_path, instance, s3, s3_bucket, fault_proxy, kind
):
    planted = _plant_conflict(kind, s3, s3_bucket, tmp_path, instance, fault_proxy.endpoint_url)
    defs = make_defs(tmp_path, destination=s3_destination(s3_bucket, fault_proxy.endpoint_url))

    for _ in range(2):  # a rerun changes nothing either
        result = run_partition(defs, instance, PARTITION)
        assert not result.success
        assert stored(s3, s3_bucket) == planted, "never overwritten, and nothing written beside it"
    message = failure_message(result)
    assert f"{PREFIX}/{FOLDER}" in message, "the error names where the conflict is"
    assert "refusing to overwrite" in message, message
    assert ledger_at(tmp_path).queries.get(KEY).state is not ExportState.COMPLETED


@pytest.mark.parametrize("kind", CONFLICTS)
def test_a_different_object_at_the_key_puts_the_key_in_conflict(tmp_path, instance, s3, s3_bucket, fault_proxy, kind):
    _plant_conflict(kind, s3, s3_bucket, tmp_path, instance, fault_proxy.endpoint_url)
    defs = make_defs(tmp_path, destination=s3_destination(s3_bucket, fault_proxy.endpoint_url))

    assert not run_partition(defs, instance, PARTITION).success
    assert ledger_at(tmp_path).queries.get(KEY).state is ExportState.CONFLICT, (
        "an operator must decide; a retry cannot help"
    )
    rerun = run_partition(defs, instance, PARTITION)
    assert f"{KEY} is in conflict" in failure_message(rerun), "retries are refused until an operator resolves it"


# -- what the objects carry ---------------------------------------------------------------------------------------


def test_objects_carry_key_attempt_token_and_sha256_in_the_local_layout_with_the_same_manifest(
    tmp_path, instance, s3, s3_bucket, fault_proxy
):
    local = make_defs(tmp_path / "local", tenants=["acme", "globex"])
    remote = make_defs(
        tmp_path / "s3", tenants=["acme", "globex"], destination=s3_destination(s3_bucket, fault_proxy.endpoint_url)
    )
    assert run_partition(local, instance, PARTITION).success
    assert run_partition(remote, instance, PARTITION).success

    local_root = tmp_path / "local" / "exports"
    local_names = sorted(
        p.relative_to(local_root).as_posix()
        for p in local_root.rglob("*")
        if p.is_file() and not p.relative_to(local_root).parts[0].startswith(".")  # the store's locks
    )
    remote_objects = stored(s3, s3_bucket, folder="")
    assert sorted(remote_objects) == local_names, "the same layout as the local destination: pointers and places"

    ledger = ledger_at(tmp_path / "s3")
    local_places = places(local_root)
    assert [place.parent for place in local_places] == published_dirs(local_root), "one place per key, each current"
    for place in local_places:
        relative = place.relative_to(local_root).as_posix()
        key_folder, place_name = relative.rsplit("/", 1)
        local_manifest = Manifest.from_json((place / MANIFEST_NAME).read_bytes(), str(place))
        objects = stored(s3, s3_bucket, key_folder)
        assert objects[POINTER_NAME] == (place.parent / POINTER_NAME).read_bytes(), (
            "the same pointer, byte for byte: it names the place, the key, its sha256 and its fence"
        )
        remote_manifest = Manifest.from_json(objects[f"{place_name}/{MANIFEST_NAME}"], relative)
        differing = {k for k, v in vars(remote_manifest).items() if vars(local_manifest)[k] != v}
        assert differing == {"attempt_id"}, "the same manifest, written by another attempt"
        assert place_name == f"r{remote_manifest.revision}-t{remote_manifest.fencing_token}" == "r1-t1", (
            "the place's name carries the revision and the token of the one party that wrote it"
        )
        assert exported_data(objects) == (place / "data.csv").read_bytes(), "the same data, byte for byte"
        pointer = pointer_of(objects)
        assert (pointer["logical_key"], pointer["sha256"], pointer["fence"]) == (
            remote_manifest.logical_key, remote_manifest.sha256, remote_manifest.fencing_token,
        ), "the pointer carries the logical key, the sha256 and the fencing token of what it names"  # fmt: skip
        record = ledger.queries.get(remote_manifest.logical_key)
        assert record.location == f"s3://{s3_bucket}/{PREFIX}/{relative}/"
        assert record.committed_attempt == remote_manifest.attempt_id
        assert record.sha256 == remote_manifest.sha256 and record.fencing_token == remote_manifest.fencing_token


def test_a_crash_before_the_ledger_commit_is_repaired_from_the_published_objects(
    tmp_path, instance, s3, s3_bucket, fault_proxy, monkeypatch, clocked_ledger, clock
):
    defs = make_defs(tmp_path, ledger=clocked_ledger, destination=s3_destination(s3_bucket, fault_proxy.endpoint_url))
    monkeypatch.setenv(FAILPOINTS, "before_commit=raise")
    assert not run_partition(defs, instance, PARTITION).success
    monkeypatch.delenv(FAILPOINTS)
    published = stored(s3, s3_bucket)
    assert sorted(published) == [POINTER_NAME, *place_objects(FIRST_PLACE)], "committed, not recorded"

    clock.advance(seconds=clocked_ledger.lease_ttl_seconds + 1)
    assert run_partition(defs, instance, PARTITION).success
    repaired = stored(s3, s3_bucket)
    assert {n: b for n, b in repaired.items() if n != POINTER_NAME} == {
        n: b for n, b in published.items() if n != POINTER_NAME
    }, "the published objects are recorded, not written again"
    before, after = pointer_of(published), pointer_of(repaired)
    assert after == {**before, "fence": 2}, "the takeover only raised the pointer's fence; it names the same export"
    ledger = clocked_ledger.get_ledger()
    assert [a.outcome for a in ledger.queries.attempts(KEY)] == [AttemptOutcome.ABANDONED, AttemptOutcome.REPAIRED]
    assert place_of_location(ledger.queries.get(KEY).location) == FIRST_PLACE


# -- credentials --------------------------------------------------------------------------------------------------


def _texts_of(result: dg.ExecuteInProcessResult) -> list[str]:
    texts = [failure_message(result)]
    for event in result.all_events:
        texts += [str(event), event.message or ""]
        if event.is_step_materialization:
            texts.append(json.dumps({k: str(v) for k, v in event.materialization.metadata.items()}))
    return texts


def test_credentials_never_appear_in_events_logs_or_output(
    tmp_path, instance, s3, s3_bucket, fault_proxy, monkeypatch, capfd
):
    secret = f"sekrit-{uuid.uuid4().hex}"
    key_id = f"AKID{uuid.uuid4().hex[:12].upper()}"
    unrelated = (
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "EXPORTS_SOURCE_URL",
        FAILPOINTS,
    )
    for name in unrelated:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXPORTS_DESTINATION", f"s3://{s3_bucket}/{PREFIX}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("EXPORTS_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    monkeypatch.setenv("EXPORTS_TENANTS", "acme")
    defs = build_definitions(environ=None)
    destination = defs.resources["invoice_export__destination"]
    assert isinstance(destination.secret_access_key, dg.EnvVar), "the secret stays a variable name in the definitions"

    texts = []
    ok = run_partition(defs, instance, "2026-03-07")
    assert ok.success, failure_message(ok)
    fault_proxy.inject(Fault.ERROR_500, method="PUT", path_suffix=MANIFEST_NAME)
    unknown = run_partition(defs, instance, PARTITION)
    fault_proxy.inject(Fault.REFUSE)
    refused = run_partition(defs, instance, "2026-03-09")
    tick_unreachable = reconcile_tick(defs, instance)
    fault_proxy.clear()
    tick = reconcile_tick(defs, instance)
    assert not unknown.success and not refused.success
    assert ledger_at(tmp_path).queries.get(KEY).state is ExportState.FAILED, (
        "reconciliation read the store with these keys"
    )
    for result in (ok, unknown, refused):
        texts += _texts_of(result)
    texts += [str(tick_unreachable), str(tick), repr(destination), repr(defs.resources)]
    texts += [f"{a.error_class} {a.error_message}" for a in ledger_at(tmp_path).queries.all_attempts()]
    captured = capfd.readouterr()
    texts += [captured.out, captured.err]

    assert "s3://" in "".join(texts), "the texts searched do describe the S3 work"
    assert "STEP_FAILURE" in captured.err, "Dagster's console log was captured too"
    leaks = [text[:200] for text in texts if secret in text]
    assert leaks == [], "the secret access key must appear in no event, log, message or output"
