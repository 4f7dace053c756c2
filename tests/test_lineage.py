"""OpenLineage events of real materializations, received by a real HTTP server on loopback."""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pipeline_helpers import ledger_at, make_defs, published_dirs, read_export, run_partition

from assets.invoices import INVOICE_COLUMNS
from export_ledger.errors import ConfigurationError
from export_ledger.lineage import LineageEmitter

PARTITION = "2026-03-08"
TENANTS = ("acme", "globex")


class Receiver:
    """An OpenLineage HTTP endpoint: keeps every event POSTed to ``/api/v1/lineage``; answers ``status``."""

    def __init__(self, status: int = 201) -> None:
        self.events: list[dict] = []
        self.bodies: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                if self.path == "/api/v1/lineage":
                    receiver.bodies.append(body)
                    receiver.events.append(json.loads(body))
                self.send_response(status if self.path == "/api/v1/lineage" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def warnings_of(instance, run_id: str) -> list[str]:
    return [entry.user_message for entry in instance.all_logs(run_id) if entry.level == logging.WARNING]


def leaf_values(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from leaf_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from leaf_values(item)
    else:
        yield value


def lineage_env(monkeypatch, url: str, namespace: str | None = None) -> dict[str, str]:
    """The lineage settings a code location loads with, set in this process's environment too (where a run worker
    reads what the location hands over by name)."""
    env = {"EXPORTS_OPENLINEAGE_URL": url, **({"EXPORTS_OPENLINEAGE_NAMESPACE": namespace} if namespace else {})}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def test_materialization_sends_start_and_complete_with_source_destination_schema_and_rows(
    tmp_path, instance, monkeypatch
):
    with Receiver() as receiver:
        defs = make_defs(tmp_path, tenants=TENANTS, env=lineage_env(monkeypatch, receiver.url, "exports-test"))
        result = run_partition(defs, instance, PARTITION)
        assert result.success, "the materialization must succeed"

    assert [e["eventType"] for e in receiver.events] == ["START", "COMPLETE"], "one START, then one COMPLETE"
    start, complete = receiver.events
    for event in receiver.events:
        assert event["run"]["runId"] == result.run_id, "the OpenLineage run id is Dagster's run id"
        assert event["job"] == {"namespace": "exports-test", "name": "invoice_export", "facets": {}}
        assert [(d["namespace"], d["name"]) for d in event["inputs"]] == [
            ("python", "resources.invoices.SampleInvoiceSource")
        ], "the input is the source, by its class's qualified name"
        (output,) = event["outputs"]
        assert (output["namespace"], output["name"]) == ("file", str((tmp_path / "exports" / "invoice_export")))
        fields = output["facets"]["schema"]["fields"]
        assert [(f["name"], f["type"]) for f in fields] == list(INVOICE_COLUMNS.items()), "columns and kinds in order"
    assert start["outputs"][0]["outputFacets"] == {}, "a START has nothing published yet"

    records = {r.logical_key: r for r in ledger_at(tmp_path).queries.records()}
    assert len(records) == 2 and all(r.state.value == "completed" for r in records.values())
    facets = complete["outputs"][0]["outputFacets"]
    assert facets["outputStatistics"]["rowCount"] == sum(r.row_count for r in records.values()) > 0
    published = {k["logical_key"]: k for k in facets["exportLedger"]["listed"]}
    assert facets["exportLedger"]["keys"] == 2
    assert set(published) == set(records), "every key this run published is named"
    for key, listed in published.items():
        assert (listed["revision"], listed["row_count"], listed["status"]) == (1, records[key].row_count, "exported")
        assert listed["partition_key"] == PARTITION
    run_facet = complete["run"]["facets"]["exportLedger"]
    assert (run_facet["export"], run_facet["keys"], run_facet["failed_keys"]) == ("invoice_export", 2, 0)

    # No customer data: no invoice id, email or amount of the exported rows appears anywhere in an event.
    rows = [read_export(folder)[1] for folder in published_dirs(tmp_path / "exports")]
    secrets = {str(v) for frame in rows for v in (*frame["invoice_id"], *frame["customer_email"])}
    amounts = {float(v) for frame in rows for v in frame["amount"]}
    assert secrets and amounts
    leaves = [leaf for event in receiver.events for leaf in leaf_values(event)]
    assert not [s for s in secrets for leaf in leaves if isinstance(leaf, str) and s in leaf], "ids or emails leaked"
    # Amounts have cents; an event's numbers are counts, revisions and positions: integers only.
    assert any(not amount.is_integer() for amount in amounts)
    assert not [leaf for leaf in leaves if isinstance(leaf, float)], "a fractional value in an event: an amount?"


def test_receiver_down_or_failing_leaves_the_export_complete_and_logs_a_warning_naming_the_host(
    tmp_path, instance, monkeypatch
):
    defs = make_defs(tmp_path, tenants=TENANTS, env=lineage_env(monkeypatch, f"http://127.0.0.1:{free_port()}/?token=s3cret"))
    result = run_partition(defs, instance, PARTITION)
    assert result.success, "an absent receiver must not fail the export"
    assert [r.state.value for r in ledger_at(tmp_path).queries.records()] == ["completed", "completed"]
    warned = [w for w in warnings_of(instance, result.run_id) if "OpenLineage" in w]
    assert len(warned) == 2, f"START and COMPLETE are each reported undelivered: {warned}"
    assert all("127.0.0.1:" in w and "s3cret" not in w for w in warned), "the host is named, the token never"

    with Receiver(status=500) as failing:
        # The location hands the URL over by name: each run reads the variable where it runs (a new value too).
        monkeypatch.setenv("EXPORTS_OPENLINEAGE_URL", failing.url)
        result = run_partition(defs, instance, "2026-03-09")
    assert result.success, "a receiver answering 500 must not fail the export"
    warned = [w for w in warnings_of(instance, result.run_id) if "OpenLineage" in w]
    assert len(warned) == 2 and all("HTTP 500" in w for w in warned), warned


def test_a_url_that_is_not_http_is_refused_naming_the_variable(monkeypatch):
    from export_ledger.settings import Settings

    with pytest.raises(ConfigurationError, match="EXPORTS_OPENLINEAGE_URL must be an http"):
        Settings.from_environment({"EXPORTS_OPENLINEAGE_URL": "ftp://lineage.internal"})
    assert LineageEmitter.from_settings(Settings.from_environment({}), log=print) is None, "unset: no events"


def test_a_configured_receiver_without_the_client_installed_fails_the_run_before_any_key_naming_the_extra(
    tmp_path, instance, monkeypatch
):
    from pipeline_helpers import failure_message

    monkeypatch.setitem(sys.modules, "openlineage.client", None)  # what an install without the extra imports
    defs = make_defs(tmp_path, tenants=TENANTS, env=lineage_env(monkeypatch, "http://127.0.0.1:9/"))
    result = run_partition(defs, instance, PARTITION)
    assert not result.success
    assert "export-ledger[lineage]" in failure_message(result)
    assert ledger_at(tmp_path).queries.records() == [], "refused before any key was claimed"


def test_the_lineage_url_and_key_reach_dagster_by_name_and_the_ui_never_shows_a_token(tmp_path, monkeypatch):
    import dagster as dg

    env = {**lineage_env(monkeypatch, "http://127.0.0.1:9/?token=s3cret"), "EXPORTS_OPENLINEAGE_API_KEY": "k3y"}
    monkeypatch.setenv("EXPORTS_OPENLINEAGE_API_KEY", "k3y")
    defs = make_defs(tmp_path, tenants=TENANTS, env=env)
    manager = defs.resources["invoice_export__io_manager"]
    # The UI's resource config names the variables, never the token or the key.
    assert manager.openlineage_url == dg.EnvVar("EXPORTS_OPENLINEAGE_URL")
    assert manager.openlineage_api_key == dg.EnvVar("EXPORTS_OPENLINEAGE_API_KEY")
    assert "s3cret" not in repr(manager) and "k3y" not in repr(manager)


@pytest.mark.parametrize("value", ["", "ftp://lineage.internal/"], ids=["empty", "not http"])
def test_a_lineage_url_a_run_resolves_empty_or_wrong_fails_the_run_naming_the_variable(
    tmp_path, instance, monkeypatch, value
):
    """The I/O manager's own check, as a run resolves its EnvVar: never lineage quietly off."""
    from pipeline_helpers import failure_message

    defs = make_defs(tmp_path, tenants=TENANTS, env=lineage_env(monkeypatch, "http://127.0.0.1:9/"))
    monkeypatch.setenv("EXPORTS_OPENLINEAGE_URL", value)
    result = run_partition(defs, instance, PARTITION)
    assert not result.success
    assert "EXPORTS_OPENLINEAGE_URL must be an http:// or https:// URL" in failure_message(result)
    assert ledger_at(tmp_path).queries.records() == [], "refused before any key was claimed"


@pytest.mark.parametrize(
    "url", ["http://t0ken@lineage.internal/", "http://lineage.internal/?auth=t0ken", "http://u:t0ken@lineage.internal/"]
)
def test_a_lineage_url_with_a_user_part_or_query_given_as_a_value_alone_is_refused_without_echo(
    tmp_path, monkeypatch, url
):
    monkeypatch.delenv("EXPORTS_OPENLINEAGE_URL", raising=False)
    with pytest.raises(ConfigurationError) as refused:
        make_defs(tmp_path, tenants=TENANTS, env={"EXPORTS_OPENLINEAGE_URL": url})
    assert "EXPORTS_OPENLINEAGE_URL" in str(refused.value) and "t0ken" not in str(refused.value)


def test_a_plain_lineage_url_given_as_a_value_is_passed_as_it_is(tmp_path, monkeypatch):
    monkeypatch.delenv("EXPORTS_OPENLINEAGE_URL", raising=False)
    defs = make_defs(tmp_path, tenants=TENANTS, env={"EXPORTS_OPENLINEAGE_URL": "http://lineage.internal:5000"})
    assert defs.resources["invoice_export__io_manager"].openlineage_url == "http://lineage.internal:5000"
