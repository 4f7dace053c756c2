"""The metrics server as a real process over a real ledger (SQLite and PostgreSQL), scraped over HTTP; the collector
in process for a ledger that stops answering."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from builders import evidence_for, key_for, open_ledger
from prometheus_client.parser import text_string_to_metric_families

from export_ledger.ledger import ExportLedger

PROJECT = Path(__file__).resolve().parent.parent
DAY = dt.date(2026, 3, 8)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build_ledger(url: str) -> ExportLedger:
    """invoice_export: acme completed on two days, globex failed once, initech remote_unknown (recent: not escalated),
    hooli in conflict and umbrella failed three times (both escalated); orders_export: acme completed."""
    ledger = open_ledger(url)

    def claim(tenant: str, day: dt.date = DAY, export: str = "invoice_export", run: str = "run-1"):
        return ledger.claims.claim(key_for(day, tenant=tenant, export=export), attempt_id=f"{run}/{tenant}")

    for day in (DAY - dt.timedelta(days=1), DAY):
        ledger.completions.complete(first := claim("acme", day), evidence_for(first))
    ledger.completions.fail(claim("globex"), RuntimeError("source down"))
    ledger.completions.mark_remote_unknown(claim("initech"), TimeoutError("lost ack"))
    ledger.completions.mark_conflict(claim("hooli"), location="file:///elsewhere")
    for run in range(3):
        ledger.completions.fail(claim("umbrella", run=f"run-{run}"), RuntimeError("bad rows"))
    ledger.completions.complete(other := claim("acme", export="orders_export"), evidence_for(other))
    return ledger


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def start_server(url: str, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "export_ledger.metrics", "--ledger-url", url, "--port", str(port)],
        cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"metrics server exited {process.returncode}: {process.stdout.read()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process
        except OSError:
            time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail("metrics server did not listen within 30 s")


def keys(metrics, export: str, state: str) -> float:
    return metrics[("export_ledger_keys", (("export", export), ("state", state)))]


@pytest.mark.process
def test_scrape_reports_the_ledgers_states_escalations_and_progress_and_follows_other_writers(ledger_url):
    build_ledger(ledger_url)
    port = free_port()
    server = start_server(ledger_url, port)
    try:
        metrics = scrape(port)
        assert metrics[("export_ledger_up", ())] == 1
        counts = {s: keys(metrics, "invoice_export", s) for s in
                  ("completed", "failed", "remote_unknown", "conflict", "in_progress")}  # fmt: skip
        assert counts == {"completed": 2, "failed": 2, "remote_unknown": 1, "conflict": 1, "in_progress": 0}
        assert keys(metrics, "orders_export", "completed") == 1
        attention = {e: metrics[("export_ledger_needs_attention", (("export", e),))]
                     for e in ("invoice_export", "orders_export")}  # fmt: skip
        assert attention == {"invoice_export": 2, "orders_export": 0}, "the conflict and the spent failure"
        last = "export_ledger_last_exported_window_end_timestamp_seconds"
        acme = metrics[(last, (("export", "invoice_export"), ("tenant", "acme")))]
        assert acme == key_for(DAY).window.end_utc.timestamp(), "the latest completed day's window end"
        assert (last, (("export", "invoice_export"), ("tenant", "globex"))) not in metrics, "globex completed nothing"

        # Another process records a completion: the next scrape shows it (nothing is cached in the server).
        writer = textwrap.dedent(
            f"""
            from builders import evidence_for, key_for
            from export_ledger.ledger import ExportLedger
            ledger = ExportLedger({ledger_url!r})
            claim = ledger.claims.claim(key_for(tenant="globex"), attempt_id="run-2/globex")
            ledger.completions.complete(claim, evidence_for(claim))
            """
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT / "tests"), str(PROJECT)])}
        subprocess.run([sys.executable, "-c", writer], cwd=PROJECT, env=env, check=True, timeout=60)
        metrics = scrape(port)
        assert (keys(metrics, "invoice_export", "completed"), keys(metrics, "invoice_export", "failed")) == (3, 1)
        globex = metrics[(last, (("export", "invoice_export"), ("tenant", "globex")))]
        assert globex == key_for(DAY).window.end_utc.timestamp()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode == 0, "SIGTERM stops the server cleanly"


@pytest.mark.process
def test_a_ledger_unreachable_at_start_is_refused_naming_it_without_its_password():
    url = "postgresql+psycopg2://postgres:hunter2@127.0.0.1:1/nowhere"
    done = subprocess.run(
        [sys.executable, "-m", "export_ledger.metrics", "--ledger-url", url, "--port", str(free_port())],
        cwd=PROJECT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "127.0.0.1:1/nowhere" in done.stderr and "hunter2" not in done.stderr + done.stdout, done.stderr


def test_a_ledger_that_stops_answering_is_reported_down_and_nothing_else(tmp_path):
    import sqlite3

    from export_ledger.metrics import registry_for

    path = tmp_path / "ledger.sqlite3"
    build_ledger(f"sqlite:///{path}")
    registry = registry_for(ExportLedger(f"sqlite:///{path}", read_only=True))
    assert registry.get_sample_value("export_ledger_up") == 1
    with sqlite3.connect(path) as broken:  # every read of the ledger fails from now on
        broken.execute("ALTER TABLE export_runs RENAME TO export_runs_gone")
    assert registry.get_sample_value("export_ledger_up") == 0
    assert registry.get_sample_value("export_ledger_keys", {"export": "invoice_export", "state": "completed"}) is None


def test_metrics_without_prometheus_client_installed_fail_naming_the_extra(tmp_path, monkeypatch):
    from export_ledger.errors import ConfigurationError
    from export_ledger.metrics import registry_for

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigurationError, match=r"export-ledger\[metrics\]"):
        registry_for(ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}"))
