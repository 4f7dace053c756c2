"""Every call of each object store classified when the store cannot be used: S3 on moto, GCS on fake-gcs-server and
Azure Blob on Azurite, each once at a closed port (unreachable) and once with a bucket or container that does not
exist.

What each answer means is part of the store contract (``export_ledger/destinations/store.py``): a read that cannot
tell raises ``DestinationUnreachable`` (never "absent": a missing container read as an absent pointer would let
reconciliation judge a published key lost), a write that certainly did not happen raises ``DestinationError`` (never
an unknown outcome, a failed condition or a conflict), and the startup probe refuses the store with one of the two.
No message carries the SDK's own text, which can quote a URL and its SAS token.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import pytest
from builders import key_for, open_ledger
from cloud_fixtures import AZURITE_ACCOUNT, AZURITE_KEY
from restatement_support import DAY, SCHEMA, item
from restatement_support import s3_destination as support_s3_destination  # (bucket, endpoint_url)

from export_ledger.destinations import DestinationError, DestinationUnreachable, PublishOutcomeUnknown
from export_ledger.destinations.azure import AzureDestination
from export_ledger.destinations.gcs import GCSDestination
from export_ledger.destinations.s3 import S3Destination
from export_ledger.destinations.store import AlreadyExists, PreconditionFailed
from export_ledger.errors import ExportLedgerError
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.ledger import ResolutionRefused
from export_ledger.ledger.schema import ExportState
from export_ledger.protocol import export_key
from export_ledger.reconcile import Verdict, reconcile_batch
from export_ledger.resolve import resolve_key

SECRET = "SECRETcanary-0b9f"
TIMEOUTS = {"connect_timeout_seconds": 2.0, "read_timeout_seconds": 3.0}


def closed_port() -> int:
    """A loopback port nobody listens on: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def azure_sas() -> str:
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    return generate_account_sas(
        AZURITE_ACCOUNT, AZURITE_KEY, ResourceTypes(service=True, container=True, object=True),
        AccountSasPermissions(read=True, write=True, delete=True, list=True, create=True),
        expiry=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
    )  # fmt: skip


def s3_destination(endpoint: str, bucket: str) -> S3Destination:
    return S3Destination(bucket=bucket, prefix="exports", endpoint_url=endpoint, access_key_id="testing",
                         secret_access_key=SECRET, **TIMEOUTS)  # fmt: skip


def gcs_destination(endpoint: str, bucket: str) -> GCSDestination:
    return GCSDestination(bucket=bucket, prefix="exports", gcs_endpoint_url=endpoint, **TIMEOUTS)


def azure_destination(endpoint: str, container: str, **credentials) -> AzureDestination:
    credentials = credentials or {"azure_account_name": AZURITE_ACCOUNT, "azure_account_key": AZURITE_KEY}
    return AzureDestination(container=container, prefix="exports", azure_endpoint_url=endpoint, **credentials,
                            **TIMEOUTS)  # fmt: skip


@pytest.fixture(params=["s3", "gcs", "azure"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def unreachable_store(kind):
    """``(store, secrets that must never show)`` at a closed port."""
    port = closed_port()
    if kind == "s3":
        return s3_destination(f"http://127.0.0.1:{port}", "exports-bucket").store, [SECRET]
    if kind == "gcs":
        return gcs_destination(f"http://127.0.0.1:{port}", "exports-bucket").store, []
    sas = azure_sas()
    signature = sas.split("sig=", 1)[1].split("&", 1)[0]
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    return azure_destination(endpoint, "exports", azure_sas_token=sas).store, [signature]


@pytest.fixture
def missing_destination(request, kind):
    """A destination on a running server whose bucket or container does not exist, and that name."""
    name = f"missing-{uuid.uuid4().hex[:12]}"
    server = {"s3": "s3_server", "gcs": "gcs_server", "azure": "azurite_server"}[kind]
    endpoint = request.getfixturevalue(server)
    return {"s3": s3_destination, "gcs": gcs_destination, "azure": azure_destination}[kind](endpoint, name), name


def uploaded(store, name: str) -> None:
    upload = store.upload(name)
    upload.handle.write(b"a,b\n1,2\n")
    upload.commit()


CALLS = {
    "check_conditions": lambda store: store.check_conditions(),
    "list": lambda store: store.list("invoice_export/"),
    "get": lambda store: store.get("invoice_export/_current.json"),
    "digest": lambda store: store.digest("invoice_export/r1-t1/data.csv"),
    "read": lambda store: store.read("invoice_export/r1-t1/manifest.json"),
    "put_if_absent": lambda store: store.put_if_absent("invoice_export/r1-t1/manifest.json", b"{}"),
    "put_if_match (create)": lambda store: store.put_if_match("invoice_export/_current.json", b"{}", None),
    "put_if_match (replace)": lambda store: store.put_if_match("invoice_export/_current.json", b"{}", "1"),
    "upload": lambda store: uploaded(store, "invoice_export/r1-t1/data.csv"),
    "delete": lambda store: store.delete("invoice_export/r1-t1/data.csv"),
}
READS = {"list", "get", "digest", "read"}
#: What the SDKs' messages for a refused connection say (urllib3's, botocore's, azure-core's).
SDK_TEXT = ("Connection refused", "HTTPConnectionPool", "Max retries", "Could not connect", "Errno")


@pytest.mark.parametrize("call", list(CALLS))
def test_every_store_call_at_a_closed_port_is_unreachable_and_quotes_no_sdk_text(unreachable_store, call):
    store, secrets = unreachable_store
    with pytest.raises(DestinationUnreachable) as refused:
        CALLS[call](store)
    message = str(refused.value)
    assert not any(secret in message for secret in secrets), f"a credential in the message: {message}"
    assert not any(sdk in message for sdk in SDK_TEXT), f"the SDK's own text (it quotes the request): {message}"


@pytest.mark.parametrize("call", list(CALLS))
def test_every_store_call_on_a_missing_bucket_or_container_names_it_and_never_reads_absent(missing_destination, call):
    destination, name = missing_destination
    store = destination.store
    expected = DestinationUnreachable if call in READS else DestinationError
    with pytest.raises(expected) as refused:
        result = CALLS[call](store)
        pytest.fail(f"{call} on a missing bucket or container answered {result!r}")
    error = refused.value
    assert not isinstance(error, (PublishOutcomeUnknown, PreconditionFailed, AlreadyExists)), (
        f"{call}: nothing was written and no condition failed, got {type(error).__name__}: {error}"
    )
    assert f"{name!r} does not exist" in str(error), f"{call}: the message names the bucket or container: {error}"


def test_a_key_reconciled_against_a_missing_bucket_or_container_stays_unknown_naming_it(
    missing_destination, sqlite_url
):
    """Read as "absent", a missing container would let reconciliation record a published key ``failed`` (and rerun
    it): the destination cannot say, so the key stays as it was."""
    destination, name = missing_destination
    ledger = open_ledger(sqlite_url)
    key = key_for()
    ledger.completions.mark_remote_unknown(ledger.claims.claim(key, "run-1"), TimeoutError("answer lost"))

    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="reconciliation-test")

    (finding,) = report.findings
    assert finding.verdict is Verdict.UNREACHABLE, f"{finding.verdict}: {finding.detail}"
    assert f"{name!r} does not exist" in finding.detail, finding.detail
    assert ledger.queries.get(str(key)).state is ExportState.REMOTE_UNKNOWN, "the key is left for a later look"


# -- a GCS client that cannot be built --------------------------------------------------------------------------------


def write_key_file(path, text: str | None) -> str:
    if text is not None:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "key_file",
    [
        pytest.param(None, id="missing"),
        pytest.param("{}", id="not-a-service-account"),
        pytest.param("{", id="not-json"),
    ],
)
@pytest.mark.parametrize("call", list(CALLS))
def test_every_gcs_call_with_an_unusable_credentials_file_is_refused_naming_the_setting(call, key_file, tmp_path):
    """The key file is read when the client is built, before anything is sent: each call says which setting is wrong
    (a raw FileNotFoundError or JSON error out of a read would be taken for an unknown outcome)."""
    credentials_file = write_key_file(tmp_path / "key.json", key_file)
    destination = GCSDestination(bucket="exports-bucket", prefix="exports", gcs_credentials_file=credentials_file,
                                 gcs_endpoint_url=f"http://127.0.0.1:{closed_port()}", **TIMEOUTS)  # fmt: skip
    with pytest.raises(DestinationUnreachable) as refused:
        CALLS[call](destination.store)
    message = str(refused.value)
    assert "gcs_credentials_file" in message and "GOOGLE_APPLICATION_CREDENTIALS" in message, message
    assert "nothing was sent" in message, message


@pytest.mark.process
def test_every_gcs_call_without_default_credentials_is_refused_naming_the_settings(tmp_path):
    """Without a key file, an endpoint or application default credentials (run in a fresh process whose environment
    has none, and that never asks a metadata server), each call says which settings give credentials."""
    script = """
import json
from export_ledger.destinations import DestinationUnreachable
from export_ledger.destinations.gcs import GCSDestination

store = GCSDestination(bucket="exports-bucket", prefix="exports").store
calls = {
    "check_conditions": lambda: store.check_conditions(),
    "list": lambda: store.list("invoice_export/"),
    "get": lambda: store.get("invoice_export/_current.json"),
    "digest": lambda: store.digest("invoice_export/r1-t1/data.csv"),
    "put_if_absent": lambda: store.put_if_absent("invoice_export/m.json", b"{}"),
    "put_if_match": lambda: store.put_if_match("invoice_export/_current.json", b"{}", None),
    "delete": lambda: store.delete("invoice_export/r1-t1/data.csv"),
}
answers = {}
for name, call in calls.items():
    try:
        call()
        answers[name] = "no error"
    except DestinationUnreachable as exc:
        answers[name] = str(exc)
    except Exception as exc:
        answers[name] = "raw " + type(exc).__name__
print(json.dumps(answers))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "GCE_", "CLOUDSDK_"))}
    # No metadata server is ever asked (NO_GCE_CHECK), and its address, were it asked, is a closed loopback port.
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="true",
               GCE_METADATA_HOST=f"127.0.0.1:{closed_port()}",
               GCE_METADATA_IP=f"127.0.0.1:{closed_port()}")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for call, answer in answers.items():
        assert "GOOGLE_APPLICATION_CREDENTIALS" in answer and "no Google credentials" in answer, f"{call}: {answer}"


# -- a TLS error after the request went out ----------------------------------------------------------------------------


def test_a_tls_error_on_a_write_is_an_unknown_outcome_not_nothing_sent():
    """A TLS error can come after the request went out whole (the review drove one through a TLS proxy that answered
    the pointer's PUT with a corrupted record): only a failed connect or missing credentials mean nothing was sent."""
    botocore = pytest.importorskip("botocore.exceptions")
    from export_ledger.destinations.base import PublishOutcomeUnknown
    from export_ledger.destinations.s3 import S3Destination

    store = S3Destination(bucket="exports-bucket", endpoint_url="https://127.0.0.1:9").store
    ssl = botocore.SSLError(endpoint_url="https://127.0.0.1:9", error="decryption failed or bad record mac")
    assert isinstance(store._write_failed(ssl, "writing the pointer"), PublishOutcomeUnknown)
    refused = botocore.EndpointConnectionError(endpoint_url="https://127.0.0.1:9")
    timed_out = botocore.ConnectTimeoutError(endpoint_url="https://127.0.0.1:9")
    for nothing_sent in (refused, timed_out):
        error = store._write_failed(nothing_sent, "writing the pointer")
        assert not isinstance(error, PublishOutcomeUnknown) and "cannot reach the store" in str(error)


# -- a failed S3 delete is the library's destination error -------------------------------------------------------------


def test_a_failed_s3_delete_is_the_librarys_destination_error_not_a_raw_botocore_error(
    ledger, clock, s3_bucket, fault_proxy, monkeypatch
):
    """Suspected S5: `discard_target` and `discard_abandoned` call delete_object bare. A delete answered 500 must be
    a classified DestinationError (as every other S3 call is), not a raw botocore ClientError. (v2: every delete goes
    through the store's `delete` hook; `resolve_key` reports a failed action as ResolutionRefused, in the library's
    own words, with the key put back and the refusal logged, so the classification is read from its message, and
    from the hook itself.)
    Fails on 0.4.0 (07f55b3): raw botocore ClientError escapes resolve_key."""
    destination = support_s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    monkeypatch.setenv(FAILPOINTS, "after_publish=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    monkeypatch.delenv(FAILPOINTS)
    clock.advance(minutes=16)
    fault_proxy.inject("error_500", method="DELETE")
    try:
        resolve_key(ledger, destination, str(key), action="discard-destination", operator="ops", reason="bad rows")
        raised = None
    except Exception as exc:
        raised = exc
    assert fault_proxy.remaining == 0, "the discard's delete was answered 500"
    observed = {
        "raised": f"{type(raised).__module__}.{type(raised).__name__}: {str(raised)[:160]}" if raised else None,
        "state after": ledger.queries.get(str(key)).state.value,
    }
    assert raised is None or isinstance(raised, ExportLedgerError), observed
    assert raised is None or (isinstance(raised, ResolutionRefused) and "cannot delete" in str(raised)), observed

    fault_proxy.inject("error_500", method="DELETE")
    with pytest.raises(DestinationError, match="cannot delete"):
        destination.store.delete(f"{key.export}/tenant={key.tenant}/date={DAY.isoformat()}/r1-t1/data.csv")


# -- a connect timeout to S3 is nothing sent ---------------------------------------------------------------------------


def test_a_connect_timeout_to_s3_is_nothing_sent_not_an_unknown_outcome(ledger, s3_bucket, fault_proxy):
    """Item 17: botocore's ConnectTimeoutError is not an EndpointConnectionError. A connection that was never
    established sent nothing: the key must be `failed` (safe to retry), not `remote_unknown`. (v2: the connect
    timeout starts right before the commit's PUT of the pointer, from botocore's before-send event, so the pointer's
    GET before it still succeeds.)
    Fails on 0.4.0 (07f55b3): ConnectTimeoutError taken as unknown: remote_unknown."""
    destination = support_s3_destination(s3_bucket, fault_proxy.endpoint_url, connect_timeout_seconds=1.0)
    destination.store.check_conditions()  # the store was fine until now
    sent: list[str] = []

    def connects_time_out_from_the_commit(request, **_):
        if request.method == "PUT" and urlsplit(request.url).path.endswith("/_current.json") and not sent:
            sent.append(request.url)
            fault_proxy.inject("connect_timeout")

    client = destination.store._s3()
    client.meta.events.register("before-send.s3.PutObject", connects_time_out_from_the_commit)
    key = key_for(DAY)
    try:
        export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        client.meta.events.unregister("before-send.s3.PutObject", connects_time_out_from_the_commit)
        fault_proxy.clear()
    observed = {"raised": raised, "state": ledger.queries.get(str(key)).state.value}
    assert sent, "the commit's PUT met the connect timeout"
    assert observed["state"] == "failed", observed
    assert "ConnectTimeoutError" in (raised or ""), f"the error names what happened: {observed}"
