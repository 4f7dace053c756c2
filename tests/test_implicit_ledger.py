"""A run worker that lost ``EXPORTS_LEDGER_URL`` must not export to a store every host writes (issue 26, review).

Unset, the ledger is ``./var/ledger.sqlite3`` in the working directory: a file of one host (one container). A worker
whose launcher config dropped the variable used to export to the real bucket and record the key ``completed`` in a
private ledger that no contract check, sensor or operator command sees. The code location now refuses to load when
the implicit ledger meets an object store or a Delta table on a URL, naming ``EXPORTS_LEDGER_URL``; the Quickstart
(a local folder, the implicit ledger) still loads. A local folder with a lost ledger URL on a second host is not
caught: both are local to that host, and nothing at load can tell.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from pipeline_helpers import DAGSTER, PROJECT

from definitions import build_definitions
from export_ledger import ConfigurationError, ExportSpec
from export_ledger.dagster import LedgerResource, ledgered_definitions

SHARED_STORES = ["s3://exports-bucket/p", "delta:s3://exports-bucket/lake/{export}"]


def _orders_spec(destination: str | None = None) -> ExportSpec:
    return ExportSpec(
        name="orders", source=lambda tenant, start, end: None, tenants=["acme"],
        columns={"order_id": "string", "placed_at": "timestamp"}, id_columns=["order_id"], time_column="placed_at",
        timezone="America/New_York", start_date="2026-01-01", destination=destination,
    )  # fmt: skip


@pytest.mark.parametrize("destination", SHARED_STORES)
def test_an_object_store_with_the_implicit_ledger_is_refused_at_load_naming_the_setting(destination, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ={"EXPORTS_SOURCE": "sample", "EXPORTS_DESTINATION": destination})
    message = str(refused.value)
    assert "EXPORTS_LEDGER_URL is not set" in message and "./var/ledger.sqlite3" in message, message
    assert "export invoice_export" in message and "(EXPORTS_DESTINATION)" in message, message
    assert not (tmp_path / "var").exists(), "no private ledger is created"


@pytest.mark.parametrize(
    "declare",
    [
        pytest.param(lambda: ledgered_definitions([_orders_spec("gs://exports-bucket/p")], environ={}), id="own"),
        pytest.param(
            lambda: ledgered_definitions([_orders_spec()], destination="s3://exports-bucket/q", environ={}),
            id="argument",
        ),
    ],
)
def test_an_exports_own_or_argument_destination_on_a_store_with_the_implicit_ledger_is_refused(declare, monkeypatch,
                                                                                              tmp_path):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=r"export orders goes to (gs|s3):// \(.*EXPORTS_LEDGER_URL is not set"):
        declare()


@pytest.mark.parametrize("destination", ["{tmp}/exports", "delta:{tmp}/lake/{{export}}", "ledger-table:rows"])
def test_the_implicit_ledger_still_serves_a_destination_on_this_host(destination, tmp_path, monkeypatch):
    """The Quickstart: a local folder (or a local Delta table, or the ledger's own database) and no ledger URL."""
    monkeypatch.chdir(tmp_path)
    environ = {"EXPORTS_SOURCE": "sample", "EXPORTS_DESTINATION": destination.format(tmp=tmp_path)}
    assert build_definitions(environ=environ).resolve_job_def("invoice_export_job")


@pytest.mark.parametrize("destination", SHARED_STORES)
def test_an_object_store_with_a_ledger_chosen_explicitly_loads(destination, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    environ = {"EXPORTS_SOURCE": "sample", "EXPORTS_DESTINATION": destination}
    assert build_definitions(environ={**environ, "EXPORTS_LEDGER_URL": url})
    assert build_definitions(environ=environ, ledger_url=url), "a URL given in code is a choice too"
    assert build_definitions(environ=environ, ledger=LedgerResource(url=url))


@pytest.mark.process
def test_a_run_worker_that_lost_the_ledger_url_exports_nothing_to_the_bucket(tmp_path, s3_server, s3_bucket, s3):
    """The review's repro: ``dagster asset materialize`` from another directory, with an environment that has the
    bucket, the source and the credentials, and no ``EXPORTS_LEDGER_URL``. Before, the run succeeded: the partition
    was published to the bucket and recorded in ``<that directory>/var/ledger.sqlite3``."""
    worker = tmp_path / "worker"
    worker.mkdir()
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "DAGSTER_HOME": str(home), "PYTHONPATH": str(PROJECT),
        "EXPORTS_SOURCE": "sample", "EXPORTS_TENANTS": "acme", "EXPORTS_DESTINATION": f"s3://{s3_bucket}/exports",
        "AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }  # fmt: skip
    done = subprocess.run(
        [DAGSTER, "asset", "materialize", "-f", str(PROJECT / "definitions.py"), "--select", "invoice_export",
         "--partition", "2026-03-08"],
        cwd=worker, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, f"the worker must not run: {output[-2000:]}"
    assert "EXPORTS_LEDGER_URL is not set" in output, output[-2000:]
    assert s3.list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0, "nothing is published to the bucket"
    assert not (worker / "var").exists(), "no private ledger is written in the worker's directory"
