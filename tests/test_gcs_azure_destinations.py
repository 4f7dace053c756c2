"""GCS (fake-gcs-server) and Azure Blob (Azurite) destinations: the upload paths they really use are probed and a store
that ignores the conditions on one is refused; a lost answer after the pointer's compare-and-swap landed ends as one
verdict (one completed export, one current revision); a missing client package names its extra."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import sys

import dagster as dg
import pytest
from cloud_fixtures import AZURITE_ACCOUNT, AZURITE_KEY
from condition_proxy import CheckThenWrite, ConditionStripper
from pipeline_helpers import failure_message, ledger_at, make_defs, run_partition
from s3_support import Fault

from export_ledger.destinations import POINTER_NAME, DestinationError, destination_from
from export_ledger.destinations import azure as azure_module
from export_ledger.destinations import gcs as gcs_module
from export_ledger.destinations.azure import AzureDestination
from export_ledger.destinations.gcs import SINGLE_REQUEST_LIMIT, GCSDestination
from export_ledger.destinations.store import AlreadyExists
from export_ledger.ledger.schema import ExportState

PARTITION = "2026-03-08"
KEY = "invoice_export/acme/2026-03-08T05:00:00Z"
FOLDER = "invoice_export/tenant=acme/date=2026-03-08"


def azure_destination(endpoint: str, container: str, **credentials) -> AzureDestination:
    credentials = credentials or {"azure_account_name": AZURITE_ACCOUNT, "azure_account_key": AZURITE_KEY}
    return AzureDestination(container=container, prefix="exports", azure_endpoint_url=endpoint,
                            read_timeout_seconds=3.0, **credentials)  # fmt: skip


def gcs_destination(endpoint: str, bucket: str) -> GCSDestination:
    return GCSDestination(bucket=bucket, prefix="exports", gcs_endpoint_url=endpoint, read_timeout_seconds=3.0)


def uploaded(store, name: str, size: int, byte: bytes) -> None:
    upload = store.upload(name)
    upload.handle.write(byte * size)
    upload.commit()


# -- GCS: the two upload paths -------------------------------------------------------------------------------------


def test_gcs_data_up_to_the_single_request_limit_is_created_only_once(gcs_server, gcs_bucket):
    store = gcs_destination(gcs_server, gcs_bucket).store
    store.check_conditions()
    uploaded(store, "r1-t1/data.csv", SINGLE_REQUEST_LIMIT, b"a")
    uploaded(store, "r1-t1/data.csv", SINGLE_REQUEST_LIMIT, b"a")  # a resend of one's own bytes: success
    with pytest.raises(AlreadyExists):
        uploaded(store, "r1-t1/data.csv", SINGLE_REQUEST_LIMIT, b"b")
    assert store.digest("r1-t1/data.csv") == hashlib.sha256(b"a" * SINGLE_REQUEST_LIMIT).hexdigest()


def test_gcs_data_above_the_limit_is_refused_where_resumable_uploads_ignore_preconditions(gcs_server, gcs_bucket):
    """fake-gcs-server (the wrapper's build) accepts a second ``ifGenerationMatch=0`` resumable upload: the probe of
    that path must refuse the store before any data file goes up that way."""
    store = gcs_destination(gcs_server, gcs_bucket).store
    gcs_module._RESUMABLE_CHECKED.discard((store.endpoint_url, store.bucket))
    refusal = "as a resumable upload: this store ignores the preconditions"
    with pytest.raises(DestinationError, match=refusal) as refused:
        uploaded(store, "r1-t1/data.csv", SINGLE_REQUEST_LIMIT + 1, b"a")
    assert "Refusing to publish to it" in str(refused.value)
    assert store.list("") == [], "neither the data file nor the probe is left"


# -- Azure: a store that ignores If-None-Match ---------------------------------------------------------------------


def sas() -> str:
    """An account SAS for Azurite. A SAS signs no request headers (a shared key signs If-None-Match, so a request a
    proxy changed would fail to verify)."""
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    return generate_account_sas(
        AZURITE_ACCOUNT, AZURITE_KEY, ResourceTypes(service=True, container=True, object=True),
        AccountSasPermissions(read=True, write=True, delete=True, list=True, create=True),
        expiry=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
    )  # fmt: skip


def test_an_azure_store_that_ignores_if_none_match_is_refused_before_anything_is_published(
    azurite_server, azure_container
):
    token = sas()
    host, account = azurite_server.rsplit("/", 1)
    with ConditionStripper(host) as proxy:
        destination = azure_destination(f"{proxy.endpoint_url}/{account}", azure_container, azure_sas_token=token)
        with pytest.raises(DestinationError, match=r"accepted a second conditional create \(If-None-Match: \*\)"):
            destination.store.check_conditions()
    honest = azure_destination(azurite_server, azure_container, azure_sas_token=token)
    honest.store.check_conditions()  # the same container, straight: accepted
    assert honest.store.list("") == [], "the probes are deleted"
    assert (destination.store.account_url, azure_container) not in azure_module._CONDITIONS_CHECKED


def test_an_azure_store_whose_conditional_create_is_a_check_then_a_write_is_refused_by_racing_creates(
    azurite_server, azure_container
):
    host, account = azurite_server.rsplit("/", 1)
    with CheckThenWrite(host, window_seconds=0.2) as proxy:
        destination = azure_destination(f"{proxy.endpoint_url}/{account}", azure_container, azure_sas_token=sas())
        store = destination.store
        store.put_if_absent("sequential", b"first")
        with pytest.raises(AlreadyExists):
            store.put_if_absent("sequential", b"second")  # a create after the first one is refused
        store.delete("sequential")
        with pytest.raises(DestinationError, match="conditional creates of one new object sent at once") as refused:
            store.check_conditions()
    assert "not one atomic step" in str(refused.value) and "Refusing to publish to it" in str(refused.value)
    assert azure_destination(azurite_server, azure_container).store.list("") == [], "the probes are deleted"
    assert (store.account_url, azure_container) not in azure_module._CONDITIONS_CHECKED


# -- a lost answer after the pointer's compare-and-swap landed -----------------------------------------------------


def reconcile_tick(defs: dg.Definitions, instance: dg.DagsterInstance) -> dg.SensorResult:
    sensor = defs.get_sensor_def("reconciliation_sensor")
    with dg.build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context:
        result = sensor(context)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return result


def lost_pointer_answer_ends_as_one_verdict(tmp_path, instance, destination, proxy, fault_on_pointer) -> None:
    destination.store.check_conditions()  # its probes go through the proxy before the fault is armed
    defs = make_defs(tmp_path, destination=destination)
    fault_on_pointer()
    failed = run_partition(defs, instance, PARTITION)
    assert proxy.remaining == 0, "the fault hit the pointer's write"
    proxy.clear()
    assert not failed.success
    ledger = ledger_at(tmp_path)
    assert ledger.queries.get(KEY).state is ExportState.REMOTE_UNKNOWN, failure_message(failed)
    tick = reconcile_tick(defs, instance)
    record = ledger.queries.get(KEY)
    assert record.state is ExportState.COMPLETED and not tick.run_requests, "the commit landed: recorded, not rerun"
    names = destination.store.list(FOLDER + "/")
    assert sorted(n.rsplit("/", 2)[-2] for n in names if not n.endswith(POINTER_NAME)) == ["r1-t1", "r1-t1"]
    pointer = json.loads(destination.store.get(f"{FOLDER}/{POINTER_NAME}").data)
    assert (pointer["revision"], pointer["path"], pointer["fence"]) == (1, "r1-t1", 2), "one current revision"
    assert pointer["sha256"] == record.sha256


def test_gcs_a_lost_answer_after_the_pointer_landed_ends_as_one_completed_export(
    tmp_path, instance, gcs_bucket, gcs_proxy
):
    destination = gcs_destination(gcs_proxy.endpoint_url, gcs_bucket)
    uploads = []

    def third_upload(method: str, path: str) -> bool:  # data, manifest, then the pointer (names are in the body)
        uploads.append(path)
        return len(uploads) == 3

    lost_pointer_answer_ends_as_one_verdict(
        tmp_path, instance, destination, gcs_proxy,
        lambda: gcs_proxy.inject(Fault.CUT_BEFORE_RESPONSE, method="POST", when=lambda m, p: p.startswith(
            "/upload/") and third_upload(m, p)),
    )  # fmt: skip


def test_azure_a_lost_answer_after_the_pointer_landed_ends_as_one_completed_export(
    tmp_path, instance, azurite_server, azure_container, azure_proxy
):
    destination = azure_destination(f"{azure_proxy.endpoint_url}/{AZURITE_ACCOUNT}", azure_container)
    lost_pointer_answer_ends_as_one_verdict(
        tmp_path, instance, destination, azure_proxy,
        lambda: azure_proxy.inject(Fault.CUT_BEFORE_RESPONSE, method="PUT", path_suffix=POINTER_NAME),
    )  # fmt: skip


# -- specs, settings, extras ---------------------------------------------------------------------------------------


def test_gs_and_az_specs_build_their_destinations_and_refuse_bad_names():
    gcs = destination_from("gs://exports-bucket/team/a", ledger_url="", settings={"gcs_project": "p"})
    assert isinstance(gcs, GCSDestination) and (gcs.bucket, gcs.prefix, gcs.gcs_project) == ("exports-bucket",
                                                                                             "team/a", "p")
    az = destination_from("az://exports/team", ledger_url="", settings={"azure_account_name": "acct"})
    assert isinstance(az, AzureDestination) and az.account_url == "https://acct.blob.core.windows.net"
    declared = [setting.name for setting in azure_module.SCHEME.settings]
    assert az.spec() == ("az://exports/team", {name: getattr(az, name) for name in declared})
    with pytest.raises(Exception, match="not a valid GCS bucket name"):
        destination_from("gs://B/x", ledger_url="")
    with pytest.raises(Exception, match="not a valid Azure container name"):
        destination_from("az://a--b/x", ledger_url="", settings={"azure_account_name": "acct"})


@pytest.mark.parametrize(("spec", "module", "extra"), [
    ("gs://exports-bucket/x", "google.cloud.storage", "export-ledger[gcs]"),
    ("az://exports/x", "azure.storage.blob", "export-ledger[azure]"),
])  # fmt: skip
def test_a_configured_destination_without_its_client_package_names_the_extra(monkeypatch, spec, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without the package imports
    with pytest.raises(DestinationError, match=extra.replace("[", r"\[").replace("]", r"\]")):
        destination_from(spec, ledger_url="", environ={"AZURE_STORAGE_ACCOUNT_NAME": "acct"})
