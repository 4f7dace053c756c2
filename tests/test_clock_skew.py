"""Leases are judged by one clock, the ledger's (docs/protocol.md): on PostgreSQL the server's, whatever the clock of
the host a worker or a reconciler runs on. Real processes under libfaketime, 20 minutes ahead (marked ``process``)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import key_for, open_ledger
from restatement_support import DAY, PROJECT

from export_ledger.ledger import ExportState

# -- a worker or a reconciler on a host whose clock runs ahead ---------------------------------------------------------


def _twenty_minutes_ahead(script: Path, source: str, postgres_url: str) -> subprocess.CompletedProcess:
    """``source`` run as a script under libfaketime, its clock 20 minutes ahead, on the ledger at ``postgres_url``
    and a local destination beside the script."""
    script.write_text(source)
    return subprocess.run(
        ["faketime", "-f", "+20m", sys.executable, str(script), postgres_url, str(script.parent / "exports")],
        cwd=PROJECT,
        env={**os.environ, "PYTHONPATH": f"{PROJECT}:{PROJECT / 'tests'}"},
        capture_output=True,
        text=True,
        timeout=120,
    )


_FAKETIME_RECONCILER = """
import sys, datetime as dt
from export_ledger.ledger import ExportLedger
from export_ledger.destinations import LocalDestination
from export_ledger.reconcile import reconcile_batch
print("reconciler clock", dt.datetime.now(dt.timezone.utc).isoformat(), flush=True)
ledger = ExportLedger(sys.argv[1])  # no clock given: the ledger's own, PostgreSQL's now()
report = reconcile_batch(ledger, LocalDestination(sys.argv[2]), limit=10, after=None, reconciler="fast-host")
print("VERDICTS", [f.verdict.value for f in report.findings], flush=True)
"""


@pytest.mark.process
@pytest.mark.postgres
def test_a_reconciler_whose_clock_runs_ahead_never_fails_a_live_key_on_postgres(postgres_url, tmp_path):
    """Item 3: on PostgreSQL, claim, expiry and reconciliation must use one clock (the server's). A reconciler whose
    own clock runs 20 minutes ahead must not judge a live 10-minute lease expired and mark the key `failed`. (v2: a
    ledger's `clock` argument is a test's override of the ledger's clock, so a fast host is a real process under
    libfaketime with the ledger's own clock, not a `clock=` argument.)
    Fails on 0.4.0 (07f55b3): verdict absent, live key failed."""
    worker = open_ledger(postgres_url, lease_ttl=dt.timedelta(minutes=10))  # the server's clock
    key = key_for(DAY)
    claim = worker.claims.claim(key, "run-1/export")
    done = _twenty_minutes_ahead(tmp_path / "fast_reconciler.py", _FAKETIME_RECONCILER, postgres_url)
    record = worker.queries.get(str(key))
    observed = {
        "fast reconciler said": done.stdout.strip().splitlines()[-2:] or done.stderr[-500:],
        "lease held until (server's clock)": claim.lease_expires_at.isoformat(),
        "state": record.state.value,
    }
    assert done.returncode == 0 and "VERDICTS []" in done.stdout, observed
    assert record.state is ExportState.IN_PROGRESS and record.fencing_token == claim.fencing_token, observed
    assert record.lease_owner == "run-1/export", observed


_FAKETIME_WORKER = """
import sys, datetime as dt
from export_ledger.ledger import ExportLedger, LedgerError
from export_ledger.destinations import LocalDestination
from export_ledger.protocol import export_key
from builders import key_for
from builders import ORDERS_SCHEMA as SCHEMA
from builders import ORDERS_DAY as DAY
from builders import orders_item as item
ledger = ExportLedger(sys.argv[1], lease_ttl=dt.timedelta(minutes=10))
print("worker clock", dt.datetime.now(dt.timezone.utc).isoformat(), flush=True)
try:
    result = export_key(ledger, LocalDestination(sys.argv[2]), SCHEMA, item(key_for(DAY)), "fast-host-run/export")
    print("RESULT", result.status, flush=True)
except LedgerError as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
"""


@pytest.mark.process
@pytest.mark.postgres
def test_black_box_a_worker_20_minutes_ahead_never_takes_over_a_live_10_minute_lease(postgres_url, tmp_path):
    """Item 3, black box as reported: libfaketime makes a second worker's clock run 20 minutes ahead; on PostgreSQL it
    must be refused while the first worker's 10-minute lease is live (the server's clock decides), not take over and
    export the key.
    Fails on 0.4.0 (07f55b3): RESULT exported by the fast host over a live lease."""
    worker = open_ledger(postgres_url, lease_ttl=dt.timedelta(minutes=10))
    key = key_for(DAY)
    claim = worker.claims.claim(key, "live-run/export")  # live: held for 10 minutes by the server's clock
    done = _twenty_minutes_ahead(tmp_path / "fast_worker.py", _FAKETIME_WORKER, postgres_url)
    record = worker.queries.get(str(key))
    observed = {
        "fast worker said": done.stdout.strip().splitlines()[-2:] or done.stderr[-500:],
        "live lease until": claim.lease_expires_at.isoformat(),
        "state": record.state.value,
        "committed by": record.committed_attempt,
    }
    assert "REFUSED LeaseHeld" in done.stdout and record.state is ExportState.IN_PROGRESS, observed
    assert record.lease_owner == "live-run/export" and record.fencing_token == claim.fencing_token, observed
