"""The Delta Lake destination on S3 under a store's faults (moto's server behind tests/s3_support.py's fault proxy):
the startup probe makes one send per request and lives under the table's folder, and what the store answers is named
as the S3 destination names it."""

from __future__ import annotations

import datetime as dt
import email.utils
import socket

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from builders import key_for  # noqa: E402
from s3_support import FaultProxy  # noqa: E402

from export_ledger.destinations import ExportTarget  # noqa: E402
from export_ledger.destinations import delta as delta_module  # noqa: E402
from export_ledger.destinations.base import (  # noqa: E402
    DestinationError,
    DestinationUnreachable,
)
from export_ledger.destinations.delta import DeltaDestination  # noqa: E402
from export_ledger.destinations.store import RACERS  # noqa: E402
from export_ledger.frames import Manifest  # noqa: E402

KEY = key_for()
EXPORT = KEY.export
PROBES = f"lake/{EXPORT}/.export-ledger-probe/"


def on(endpoint_url: str, bucket: str) -> DeltaDestination:
    return DeltaDestination(f"s3://{bucket}/lake/{{export}}", endpoint_url=endpoint_url, access_key_id="testing",
                            secret_access_key="testing")  # fmt: skip


def target(tenant: str = KEY.tenant) -> ExportTarget:
    return ExportTarget(EXPORT, tenant, KEY.window.business_date.isoformat(), 1)


def publish(destination: DeltaDestination, tenant: str = KEY.tenant) -> None:
    logical_key = f"{EXPORT}/{tenant}/{str(KEY).rsplit('/', 1)[-1]}"
    manifest = Manifest.build(
        logical_key=logical_key, export=EXPORT, tenant=tenant, window=KEY.window, row_count=0, sha256="",
        attempt_id="run-1/x", fencing_token=1, data_file="delta", tz_database="test", revision=1, supersedes=None,
    )  # fmt: skip
    rows = pa.table({"invoice_id": ["a", "b"], "amount": [1.0, 2.0]})
    destination.commit(destination.stage(target(tenant), 1, rows, "csv", manifest), 1, superseded=0)


def stored(s3, bucket: str, prefix: str = "") -> list[str]:
    return [item["Key"] for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the startup probe -------------------------------------------------------------------------------------------------


def test_racing_probe_creates_whose_answers_are_lost_make_the_store_unreachable_never_a_refused_store(
    fault_proxy, s3_bucket, s3
):
    """Each lost answer was a create that landed: resent, it would be refused by its own object, and the probe would
    see a store that refused every create yet holds one (the S3 destination reports such a store unreachable too)."""
    destination = on(fault_proxy.endpoint_url, s3_bucket)
    fault_proxy.inject("cut_before_response", count=RACERS, method="PUT", path_suffix="-race")
    with pytest.raises(DestinationUnreachable, match="honours conditional puts") as lost:
        destination.check_table(EXPORT)
    assert "ConnectionClosedError" in str(lost.value), f"the store's failure is named: {lost.value}"
    races = [r for r in fault_proxy.history if r.method == "PUT" and r.path.endswith("-race")]
    assert len(races) == RACERS, f"one send per create, never a blind resend: {len(races)} sends"
    assert (fault_proxy.endpoint_url, s3_bucket) not in delta_module._CONDITIONS_CHECKED, "nothing was shown"
    destination.check_table(EXPORT)  # the answers arrive now: the store is honest, and the check passes
    assert stored(s3, s3_bucket) == [], "the probes are deleted"


def test_a_credential_scoped_to_the_tables_folder_probes_and_commits_there(fault_proxy, s3_bucket, s3):
    """Objects outside ``lake/`` are refused (403), as for a credential whose policy names only that prefix; listing
    the bucket is allowed (a prefix-scoped policy allows it with a prefix condition)."""

    def outside(method: str, path: str) -> bool:
        return path != f"/{s3_bucket}" and not path.startswith(f"/{s3_bucket}/lake/")

    fault_proxy.inject("error_403", count=None, when=outside)
    destination = on(fault_proxy.endpoint_url, s3_bucket)
    destination.check_table(EXPORT)
    publish(destination)
    assert deltalake.DeltaTable(destination.table_for(EXPORT), storage_options=destination.storage_options()
                                ).transaction_version(str(KEY)) == 1  # fmt: skip
    refused = [f"{r.method} {r.path}" for r in fault_proxy.history if r.fault != "none"]
    assert refused == [], f"nothing outside the table's folder was asked for: {refused}"
    probes = [r.path for r in fault_proxy.history if ".export-ledger-probe/" in r.path]
    assert probes and all(path.startswith(f"/{s3_bucket}/{PROBES}") for path in probes), probes
    assert stored(s3, s3_bucket, f"lake/{EXPORT}/.export-ledger-probe") == [], "the probes are deleted"


class ClockAhead(FaultProxy):
    """A store whose clock (the ``Date`` of its answers) is two hours ahead of the objects' times it lists."""

    def _forward(self, request, method):
        response = super()._forward(request, method)
        ahead = email.utils.format_datetime(dt.datetime.now(dt.UTC) + dt.timedelta(hours=2), usegmt=True)
        response.headers = [(name, ahead if name.lower() == "date" else value) for name, value in response.headers]
        return response


def test_a_probe_left_under_the_table_by_a_killed_process_is_swept_once_an_hour_old_by_the_stores_clock(
    s3_server, s3_bucket, s3
):
    left = f"{PROBES}left-by-a-killed-process"
    s3.put_object(Bucket=s3_bucket, Key=left, Body=b"1")
    on(s3_server, s3_bucket).check_table(EXPORT)
    assert stored(s3, s3_bucket) == [left], "a probe seconds old may be another process's check in progress: kept"
    with ClockAhead(s3_server) as ahead:
        on(ahead.endpoint_url, s3_bucket).check_table(EXPORT)
    assert stored(s3, s3_bucket) == [], "an hour old by the store's clock: removed with the check's own probes"


# -- what the store answers, named -------------------------------------------------------------------------------------


def test_a_missing_bucket_is_named_by_the_probe_and_by_a_read(s3_server):
    destination = on(s3_server, "exports-no-such-bucket")
    missing = r"the bucket 'exports-no-such-bucket' does not exist"
    with pytest.raises(DestinationError, match=missing):
        destination.check_table(EXPORT)
    with pytest.raises(DestinationUnreachable, match=missing):
        destination.pointer(target())


def test_a_store_that_refuses_the_credential_is_named_with_its_http_status(fault_proxy, s3_bucket):
    fault_proxy.inject("error_403", count=None)
    destination = on(fault_proxy.endpoint_url, s3_bucket)
    with pytest.raises(DestinationError, match=r"refused .*HTTP 403") as refused:
        destination.check_table(EXPORT)
    assert not isinstance(refused.value, DestinationUnreachable), "the store answered: it refused, it is reachable"
    with pytest.raises(DestinationUnreachable, match=r"HTTP 403"):
        destination.pointer(target())


def test_an_endpoint_nobody_listens_on_is_unreachable_for_the_probe_and_for_a_read():
    destination = on(f"http://127.0.0.1:{closed_port()}", "exports-closed")
    with pytest.raises(DestinationUnreachable, match="EndpointConnectionError"):
        destination.check_table(EXPORT)
    with pytest.raises(DestinationUnreachable, match="EndpointConnectionError"):
        destination.pointer(target())
