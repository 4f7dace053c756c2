"""The S3 destination end to end: a moto server behind the fault proxy, the pipeline through Dagster's public APIs.

Every fault the proxy knows is applied to the data PUT and to the manifest PUT. Right after the failed run the
ledger must say what is known (``failed`` when nothing can have been written, ``remote_unknown`` when the write may
have landed); reconciliation (the sensor) and at most one rerun must then end with exactly the key's two objects in
the bucket and the key ``completed``. Objects are always read straight from the moto server, never through the proxy.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import uuid
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import dagster as dg
import pytest
from pipeline_helpers import failure_message, ledger_at, make_defs, published_dirs, run_partition
from s3_support import Fault

from definitions import build_definitions
from export_ledger.destinations import ExportTarget
from export_ledger.destinations import s3 as s3_module
from export_ledger.destinations.s3 import S3Destination
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
UNKNOWN_OUTCOME = "the outcome at the destination is unknown"


@pytest.fixture
def s3(s3_server, s3_credentials):
    """A client on the moto server itself: what the bucket really holds, whatever the proxy does."""
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    yield client
    client.close()


def s3_destination(bucket: str, endpoint_url: str, prefix: str = PREFIX) -> S3Destination:
    return S3Destination(
        bucket=bucket,
        prefix=prefix,
        endpoint_url=endpoint_url,
        access_key_id="testing",
        secret_access_key="testing",
        connect_timeout_seconds=5.0,
        read_timeout_seconds=READ_TIMEOUT_SECONDS,
    )


def stored(s3, bucket: str, folder: str = FOLDER, prefix: str = PREFIX) -> dict[str, bytes]:
    """Object name -> bytes of everything under one key's folder on the moto server."""
    base = f"{prefix}/{folder}/"
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=base).get("Contents", [])
    return {item["Key"][len(base) :]: s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read() for item in listing}


def kinds(objects) -> list[str]:
    """Object names with each attempt's own data object name (``data-t<token>-<hash>.csv``) shown as ``data``."""
    return sorted("data" if name.startswith("data-t") and name.endswith(".csv") else name for name in objects)


def exported_data(objects: dict[str, bytes]) -> bytes:
    """The data object the manifest names (the export), checked against the manifest's sha256."""
    manifest = Manifest.from_json(objects[MANIFEST_NAME], "moto")
    payload = objects[manifest.data_file]
    assert hashlib.sha256(payload).hexdigest() == manifest.sha256
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
def refused_from(destination: S3Destination, proxy, suffix: str):
    """Connections are refused from the moment the destination is about to send the PUT of ``suffix``.

    The proxy's ``refuse`` closes its port for every request at once, which would refuse the probe's GET first. To
    refuse one chosen PUT (for the manifest: after the data PUT succeeded), the port is closed from botocore's
    ``before-send`` event on the destination's own client.
    """

    def close_port(request, **_):
        if request.method == "PUT" and urlsplit(request.url).path.endswith(suffix):
            proxy.inject(Fault.REFUSE)

    client = destination._s3()
    client.meta.events.register("before-send.s3.PutObject", close_port)
    try:
        yield
    finally:
        client.meta.events.unregister("before-send.s3.PutObject", close_port)
        proxy.clear()


# -- faults on each PUT ------------------------------------------------------------------------------------------

WRITES = {"data": ".csv", "manifest": MANIFEST_NAME}  # each attempt's data object ends .csv; the manifest's name
# The proxy forwards these and loses the answer: the object is written although the client never hears so.
LANDS_ANYWAY = {Fault.CUT_BEFORE_RESPONSE, Fault.DELAY}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize(
    "fault",
    [
        Fault.DROP_BEFORE_FORWARD,
        Fault.CUT_BEFORE_RESPONSE,
        Fault.DELAY,
        Fault.ERROR_500,
        Fault.ERROR_503,
        Fault.REFUSE,
    ],
)
def test_a_fault_on_a_put_is_classified_then_reconciled_to_one_completed_export(
    tmp_path, instance, s3, s3_bucket, fault_proxy, fault, write
):
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    defs = make_defs(tmp_path, destination=destination)
    name = WRITES[write]

    if fault is Fault.REFUSE:
        with refused_from(destination, fault_proxy, name):
            failed = run_partition(defs, instance, PARTITION)
    else:
        fault_proxy.inject(fault, method="PUT", path_suffix=name, count=1, delay_seconds=DELAY_SECONDS)
        failed = run_partition(defs, instance, PARTITION)
        assert fault_proxy.remaining == 0, f"the {fault} fault should have hit the {write} PUT"
        fault_proxy.clear()

    assert not failed.success
    ledger = ledger_at(tmp_path)
    message = failure_message(failed)
    if fault is Fault.REFUSE:
        assert ledger.get(KEY).state is ExportState.FAILED, "a refused connection cannot have written anything"
        assert "cannot reach the store" in message, message
    else:
        assert ledger.get(KEY).state is ExportState.REMOTE_UNKNOWN, f"after {fault} the write may have landed or not"
        assert UNKNOWN_OUTCOME in message and "remote_unknown" in message, message
        assert "reconciliation" in message and "will resolve it" in message, "the operator learns what happens next"
    expected = (["data"] if write == "manifest" or fault in LANDS_ANYWAY else []) + (
        [MANIFEST_NAME] if write == "manifest" and fault in LANDS_ANYWAY else []
    )
    assert kinds(stored(s3, s3_bucket)) == sorted(expected), "what the moto server holds right after the fault"
    assert materializations(instance, PARTITION) == [], "a failed run materializes nothing"

    tick = reconcile_tick(defs, instance)
    if fault is Fault.REFUSE:
        assert [r.partition_key for r in tick.run_requests] == [PARTITION], "a failed key is rerun, not reconciled"
        rerun_partitions = [PARTITION]
    elif write == "manifest" and fault in LANDS_ANYWAY:
        assert ledger.get(KEY).state is ExportState.COMPLETED, "the manifest landed: reconciliation records it"
        assert [e.partition for e in tick.asset_events] == [PARTITION] and not tick.run_requests
        rerun_partitions = []
    else:
        assert ledger.get(KEY).state is ExportState.FAILED, "no manifest landed: the export is absent, safe to retry"
        assert [r.partition_key for r in tick.run_requests] == [PARTITION], "reconciliation requests the rerun"
        rerun_partitions = [r.partition_key for r in tick.run_requests]
    for partition in rerun_partitions:
        rerun = run_partition(defs, instance, partition)
        assert rerun.success, failure_message(rerun)

    record = ledger.get(KEY)
    assert record.state is ExportState.COMPLETED
    objects = stored(s3, s3_bucket)
    assert kinds(objects).count(MANIFEST_NAME) == 1, "exactly one manifest for the key: one export"
    orphans = [n for n in objects if n.startswith("data-t")]
    assert len(orphans) <= 2, "the export's data object, and at most the failed attempt's unreferenced one"
    manifest = Manifest.from_json(objects[MANIFEST_NAME], "moto")
    assert manifest.logical_key == KEY
    assert hashlib.sha256(exported_data(objects)).hexdigest() == manifest.sha256 == record.sha256
    assert len(materializations(instance, PARTITION)) == 1, "the partition is materialized exactly once"


# -- conditional creates ------------------------------------------------------------------------------------------


def test_a_refused_manifest_put_leaves_an_orphan_that_never_blocks_the_retry_and_is_swept_after_a_lease(
    tmp_path, instance, s3, s3_bucket, fault_proxy, clocked_ledger, clock
):
    # The data object landed, then the store answered 403 to the manifest: nothing is published (no manifest), the
    # key is failed, and the retry writes a data object of its own name. (Before per-attempt names, the retry met
    # the orphan at data.csv and put the key in conflict, with no way out.)
    defs = make_defs(tmp_path, ledger=clocked_ledger, destination=s3_destination(s3_bucket, fault_proxy.endpoint_url))
    fault_proxy.inject(Fault.ERROR_403, method="PUT", path_suffix=MANIFEST_NAME, count=1)
    assert not run_partition(defs, instance, PARTITION).success
    fault_proxy.clear()
    ledger = clocked_ledger.get_ledger()
    assert ledger.get(KEY).state is ExportState.FAILED, "a refused manifest published nothing: safe to retry"
    (orphan,) = stored(s3, s3_bucket)

    retry = run_partition(defs, instance, PARTITION)
    assert retry.success, failure_message(retry)
    objects = stored(s3, s3_bucket)
    assert orphan in objects, "younger than a lease: its writer might still be alive, so it is left alone"
    assert Manifest.from_json(objects[MANIFEST_NAME], "moto").data_file != orphan
    assert ledger.get(KEY).state is ExportState.COMPLETED

    # A later attempt on the key (an operator's discard and rerun) sweeps it once it is older than a lease.
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    assert destination.discard_abandoned(TARGET, below_token=99, min_age=dt.timedelta(0)) == 1
    assert orphan not in stored(s3, s3_bucket), "an unreferenced data object older than a lease is swept"
    assert kinds(stored(s3, s3_bucket)) == [MANIFEST_NAME, "data"], "the export itself is never swept"


def test_a_store_that_ignores_conditional_creates_is_refused_before_anything_is_published(
    tmp_path, instance, s3, s3_bucket, fault_proxy
):
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url, "ignoring")
    client = destination._s3()

    def drop_condition(params, **_):
        params.pop("IfNoneMatch", None)  # what a store that ignores the header does with it

    client.meta.events.register("provide-client-params.s3.PutObject", drop_condition)
    s3_module._CONDITIONAL_CREATES_CHECKED.discard((destination.endpoint_url, destination.bucket))
    try:
        defs = make_defs(tmp_path, destination=destination)
        result = run_partition(defs, instance, PARTITION)
    finally:
        client.meta.events.unregister("provide-client-params.s3.PutObject", drop_condition)
        s3_module._CONDITIONAL_CREATES_CHECKED.discard((destination.endpoint_url, destination.bucket))
    assert not result.success
    assert "ignores conditional writes" in failure_message(result)
    assert stored(s3, s3_bucket, prefix="ignoring") == {}, "nothing is published to such a store"


def _another_keys_manifest(s3, bucket: str, tmp_path: Path, instance, endpoint_url: str) -> bytes:
    other = make_defs(tmp_path / "other", destination=s3_destination(bucket, endpoint_url, "other"))
    assert run_partition(other, instance, "2026-03-07").success
    return s3.get_object(Bucket=bucket, Key=f"other/{FOLDER.replace('03-08', '03-07')}/{MANIFEST_NAME}")["Body"].read()


CONFLICTS = ["manifest of another key"]  # another attempt's data object is an orphan, never a conflict


def _plant_conflict(kind: str, s3, bucket: str, tmp_path: Path, instance, endpoint_url: str) -> tuple[str, bytes]:
    """Puts something that is not this key's export where its export belongs; returns its object key and bytes."""
    key = f"{PREFIX}/{FOLDER}/{MANIFEST_NAME}"
    body = _another_keys_manifest(s3, bucket, tmp_path, instance, endpoint_url)
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    return key, body


@pytest.mark.parametrize("kind", CONFLICTS)
def test_a_different_object_at_the_key_is_never_overwritten_and_the_error_tells_the_operator(
    tmp_path, instance, s3, s3_bucket, fault_proxy, kind
):
    planted_key, planted = _plant_conflict(kind, s3, s3_bucket, tmp_path, instance, fault_proxy.endpoint_url)
    defs = make_defs(tmp_path, destination=s3_destination(s3_bucket, fault_proxy.endpoint_url))

    for _ in range(2):  # a rerun changes nothing either
        result = run_partition(defs, instance, PARTITION)
        assert not result.success
        assert s3.get_object(Bucket=s3_bucket, Key=planted_key)["Body"].read() == planted, "never overwritten"
    message = failure_message(result)
    assert f"{PREFIX}/{FOLDER}" in message, "the error names where the conflict is"
    assert "refusing to overwrite" in message, message
    assert ledger_at(tmp_path).get(KEY).state is not ExportState.COMPLETED


@pytest.mark.parametrize("kind", CONFLICTS)
def test_a_different_object_at_the_key_puts_the_key_in_conflict(tmp_path, instance, s3, s3_bucket, fault_proxy, kind):
    _plant_conflict(kind, s3, s3_bucket, tmp_path, instance, fault_proxy.endpoint_url)
    defs = make_defs(tmp_path, destination=s3_destination(s3_bucket, fault_proxy.endpoint_url))

    assert not run_partition(defs, instance, PARTITION).success
    assert ledger_at(tmp_path).get(KEY).state is ExportState.CONFLICT, "an operator must decide; a retry cannot help"
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
    local_files = sorted(str(p.relative_to(local_root).parent) for p in local_root.rglob(MANIFEST_NAME))
    listing = s3.list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/")["Contents"]
    remote_folders = sorted({item["Key"].removeprefix(f"{PREFIX}/").rsplit("/", 1)[0] for item in listing})
    assert remote_folders == local_files, "same folder layout as the local destination"

    ledger = ledger_at(tmp_path / "s3")
    for folder in published_dirs(local_root):
        relative = folder.relative_to(local_root).as_posix()
        local_manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes(), str(folder))
        objects = stored(s3, s3_bucket, relative)
        remote_manifest = Manifest.from_json(objects[MANIFEST_NAME], relative)
        differing = {k for k, v in vars(remote_manifest).items() if vars(local_manifest)[k] != v}
        assert differing == {"attempt_id", "data_file"}, "the same manifest, by another attempt, naming its object"
        assert remote_manifest.data_file.startswith("data-t1-"), "each attempt's data object has a name of its own"
        assert exported_data(objects) == (folder / "data.csv").read_bytes(), "the same data, byte for byte"
        record = ledger.get(remote_manifest.logical_key)
        assert record.location == f"s3://{s3_bucket}/{PREFIX}/{relative}/"
        assert record.committed_attempt == remote_manifest.attempt_id
        for name in (remote_manifest.data_file, MANIFEST_NAME):
            metadata = s3.head_object(Bucket=s3_bucket, Key=f"{PREFIX}/{relative}/{name}")["Metadata"]
            assert metadata == {
                "logical-key": remote_manifest.logical_key,
                "attempt-id": remote_manifest.attempt_id,
                "fencing-token": str(remote_manifest.fencing_token),
                "sha256": remote_manifest.sha256,
            }, f"{name} carries the logical key, attempt id, fencing token and sha256"


def test_a_crash_before_the_ledger_commit_is_repaired_from_the_published_objects(
    tmp_path, instance, s3, s3_bucket, fault_proxy, monkeypatch, clocked_ledger, clock
):
    defs = make_defs(tmp_path, ledger=clocked_ledger, destination=s3_destination(s3_bucket, fault_proxy.endpoint_url))
    monkeypatch.setenv(FAILPOINTS, "before_commit=raise")
    assert not run_partition(defs, instance, PARTITION).success
    monkeypatch.delenv(FAILPOINTS)
    published = stored(s3, s3_bucket)
    assert kinds(published) == [MANIFEST_NAME, "data"]

    clock.advance(seconds=clocked_ledger.lease_ttl_seconds + 1)
    assert run_partition(defs, instance, PARTITION).success
    assert stored(s3, s3_bucket) == published, "the published objects are recorded, not written again"
    ledger = clocked_ledger.get_ledger()
    assert [a.outcome for a in ledger.attempts(KEY)] == [AttemptOutcome.ABANDONED, AttemptOutcome.REPAIRED]


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
    assert ledger_at(tmp_path).get(KEY).state is ExportState.FAILED, "reconciliation read the store with these keys"
    for result in (ok, unknown, refused):
        texts += _texts_of(result)
    texts += [str(tick_unreachable), str(tick), repr(destination), repr(defs.resources)]
    texts += [f"{a.error_class} {a.error_message}" for a in ledger_at(tmp_path).all_attempts()]
    captured = capfd.readouterr()
    texts += [captured.out, captured.err]

    assert "s3://" in "".join(texts), "the texts searched do describe the S3 work"
    assert "STEP_FAILURE" in captured.err, "Dagster's console log was captured too"
    leaks = [text[:200] for text in texts if secret in text]
    assert leaks == [], "the secret access key must appear in no event, log, message or output"
