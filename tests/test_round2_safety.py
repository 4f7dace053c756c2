"""Issue 18, round 2 — Safety (items 1 to 5): each reported defect, reproduced on protocol v2 (docs/protocol.md).

Each test is the reproduction that failed on 0.4.0 (07f55b3), ported to the reworked API: the same scenario, adapted
where v2 changed the mechanism (every key has a pointer naming the committed place, places per token, fencing checked
at the pointer, holds by reconcilers and operators with a new token, sources read after the claim), and the same
"must hold" assertion. Helpers are in ``round2_support.py``; the other areas are in ``test_round2_liveness.py``
(items 6 to 18) and ``test_round2_suspected.py`` (the six suspicions).

Tests marked ``process`` are deselected by the default ``addopts`` (a restatement run paused past a 2-second lease,
then ``export-ledger reconcile``; a libfaketime worker 20 minutes ahead, and a libfaketime reconciler, on
PostgreSQL). Tests marked ``postgres`` need the server at 127.0.0.1:5432.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pipeline_helpers import failure_message
from s3_support import FaultProxy

from export_ledger import cli
from export_ledger.calendar import ZoneMove
from export_ledger.destinations import LocalDestination
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import MANIFEST_NAME
from export_ledger.ledger import ExportLedger, ExportState, FencedOut, LedgerError
from export_ledger.protocol import export_key
from export_ledger.resolve import resolve_key
from export_ledger.restate import withdraw
from export_ledger.tenants import Tenant
from tests.builders import key_for
from tests.round2_support import (  # noqa: F401  (fixtures: ledger, local)
    DAY,
    EXPORT_LEDGER,
    LEASE,
    PROJECT,
    SCHEMA,
    UTC,
    corrected,
    fenced_restatement,
    finish,
    item,
    ledger,
    local,
    local_places,
    local_reader_view,
    materialize,
    process_env,
    restatement_dead_after_publishing,
    s3_destination,
    s3_folder,
    s3_reader_view,
    third_version,
    wait_for,
)

# -- 1. a fenced restatement still changes what readers see ---------------------------------------------------------


def test_fenced_restatement_never_changes_what_readers_see(ledger, local, clock):
    """Item 1: a restatement fenced by reconciliation (its lease ran out while it read its source) must not move the
    key's current pointer: an attempt with a stale fencing token never changes what readers see, and `failed` means
    nothing of that attempt is visible.
    Fails on 0.4.0 (07f55b3): readers see revision 2, ledger current revision 1, state failed."""
    key = key_for(DAY)
    raised = fenced_restatement(ledger, local, clock, key)
    record = ledger.queries.get(str(key))
    readers = local_reader_view(Path(local.root), key)
    observed = {
        "attempt raised": type(raised).__name__,
        "ledger state": record.state.value,
        "ledger's current revision": ledger.restatements.current_revision(str(key)).revision,
        "readers see revision": readers["revision"],
        "readers see place": readers["place"],
    }
    assert observed["readers see revision"] == observed["ledger's current revision"], observed
    assert (observed["ledger state"], observed["readers see place"]) == ("failed", "r1-t1"), (
        f"reconciliation's verdict stands and readers still see revision 1's place: {observed}"
    )
    assert isinstance(raised, FencedOut), f"the stale attempt records nothing: {observed}"


def test_withdrawing_a_fenced_restatement_leaves_readers_on_the_revision_the_ledger_completes(ledger, local, clock):
    """Item 1: after the fenced restatement, `export-ledger restate --withdraw` completes the key at revision N. The
    pointer must equal the ledger's current revision (a withdrawn or fenced revision is never current); v2's
    withdrawal holds the key, fences the destination and looks at its pointer first (--destination).
    Fails on 0.4.0 (07f55b3): exit 0, ledger completed at 1, readers see 2."""
    key = key_for(DAY)
    fenced_restatement(ledger, local, clock, key)
    assert ledger.queries.get(str(key)).state is ExportState.FAILED  # reconciliation's verdict, before the attempt woke
    code = cli.main([
        "--ledger-url", ledger.url, "restate", "--withdraw", str(key), "--destination", local.root,
        "--reason", "source cannot be fixed now",
    ])  # fmt: skip
    record = ledger.queries.get(str(key))
    observed = {
        "withdraw exit code": code,
        "ledger state": record.state.value,
        "ledger's current revision": ledger.restatements.current_revision(str(key)).revision,
        "readers see revision": local_reader_view(Path(local.root), key)["revision"],
        "pointer's fence": local_reader_view(Path(local.root), key)["fence"],
        "withdrawal's token": record.fencing_token,
    }
    assert observed["readers see revision"] == observed["ledger's current revision"], observed
    assert (code, record.state) == (0, ExportState.COMPLETED), f"the withdrawal went through: {observed}"
    assert observed["pointer's fence"] == observed["withdrawal's token"], f"it fenced before it judged: {observed}"


def test_a_restatement_after_a_withdrawn_fenced_one_reads_the_new_source_under_a_new_revision_number(
    ledger, local, clock
):
    """Item 1: the next request after the withdrawal must not reuse revision number N + 1 (the fenced attempt
    wrote a place of it) and must not "repair" from the withdrawn revision: the new source is read and published.
    Fails on 0.4.0 (07f55b3): request numbered 2 while the destination holds 2, status repaired, readers get the
    fenced attempt's rows."""
    key = key_for(DAY)
    fenced_restatement(ledger, local, clock, key)
    withdraw(ledger, local, str(key), operator="ops", reason="source cannot be fixed now")
    request = ledger.restatements.request(str(key), reason="second correction", requested_by="ops")
    at_destination = local_places(Path(local.root), key)
    result = export_key(ledger, local, SCHEMA, item(key, third_version(key)), "run-3/export")
    readers = local_reader_view(Path(local.root), key)
    observed = {
        "new request's revision": request.revision,
        "revisions already at the destination": sorted(at_destination),
        "status": result.status,
        "rows readers see": readers.get("rows"),
        "rows of the new source": len(third_version(key)),
    }
    assert 2 in at_destination, f"the fenced attempt's place of revision 2 is still there: {observed}"
    assert request.revision not in at_destination, observed
    assert (result.status, readers.get("rows")) == ("exported", len(third_version(key))), observed
    assert readers["revision"] == request.revision and readers["intact"], observed


def test_s3_transient_get_error_while_repairing_a_current_revision_never_records_failed(
    s3, s3_bucket, s3_server, ledger, clock, fault_proxy, monkeypatch
):
    """Item 1 (no pause needed, on S3): a restatement dies after committing revision 2 (the pointer names it); the
    retry takes the key over, fences, and reads the committed place back to repair it, meeting one transient GET
    error. `failed` must mean nothing of the attempt is visible, so the key must not be `failed` while readers see
    revision 2. (v2: `after_current` is gone, the commit is the publish: the crash is at `after_publish`.)
    Fails on 0.4.0 (07f55b3): DestinationUnreachable, ledger failed, readers see revision 2."""
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    restatement_dead_after_publishing(ledger, destination, key, monkeypatch)
    clock.advance(minutes=16)

    fault_proxy.inject("error_503", method="GET", when=lambda _m, path: "/r2-t2/data.csv" in path)
    try:
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
        raised = None
    except Exception as exc:
        raised = type(exc).__name__
    assert fault_proxy.remaining == 0, "the repair's read-back met the fault"
    record = ledger.queries.get(str(key))
    readers = s3_reader_view(s3, s3_bucket, key)
    observed = {
        "retry raised": raised,
        "ledger state": record.state.value,
        "ledger's current revision": ledger.restatements.current_revision(str(key)).revision,
        "readers see revision": readers["revision"],
    }
    assert readers["revision"] == 2, f"the dead attempt's commit is visible: {observed}"
    assert not (record.state is ExportState.FAILED and readers["revision"] == 2), observed


@pytest.mark.process
def test_black_box_fenced_restatement_paused_past_its_lease_never_moves_the_pointer(tmp_path):
    """Item 1, black box as reported: a restatement run paused by a failpoint after its claim, a 2-second lease, then
    `export-ledger reconcile`; the run wakes and finishes. Readers must still see the revision the ledger records
    (the issue found the pointer at revision 2 while the ledger said `failed`).
    Fails on 0.4.0 (07f55b3): _current.json says 2, ledger current 1, failed."""
    key_text = "invoice_export/acme/2026-03-08T05:00:00Z"
    partition = "2026-03-08"
    env = process_env(tmp_path, "home-1", EXPORTS_LEASE_TTL_SECONDS="2")
    code, output = finish(materialize(env, partition))
    assert code == 0, output[-3000:]
    ledger_url = env["EXPORTS_LEDGER_URL"]
    assert cli.main(["--ledger-url", ledger_url, "restate", key_text, "--reason", "late invoices"]) == 0

    restating = materialize({**env, FAILPOINTS: "after_claim=pause:12"}, partition)
    book = ExportLedger(ledger_url)
    wait_for(
        lambda: (r := book.queries.get(key_text)) is not None and r.state is ExportState.IN_PROGRESS,
        90,
        "the restatement claim",
    )
    time.sleep(3)  # its 2-second lease runs out while it is paused
    reconcile = subprocess.run(
        [EXPORT_LEDGER, "--ledger-url", ledger_url, "reconcile", "--destination", env["EXPORTS_DESTINATION"]],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    after_reconcile = book.queries.get(key_text).state.value
    code, output = finish(restating)
    record = book.queries.get(key_text)
    folder = tmp_path / "exports" / "invoice_export" / "tenant=acme" / "date=2026-03-08"
    pointer = json.loads((folder / POINTER_NAME).read_text())
    observed = {
        "readers see revision (_current.json)": pointer["revision"],
        "ledger's current revision": book.restatements.current_revision(key_text).revision,
        "ledger state": record.state.value,
        "restatement run exit code": code,
        "state after reconcile": after_reconcile,
        "reconcile said": [line for line in reconcile.stdout.splitlines() if key_text in line] or reconcile.stderr,
    }
    assert after_reconcile == "failed", f"reconciliation judged the paused restatement's key: {observed}"
    assert pointer["revision"] == observed["ledger's current revision"], observed


# -- 2. local and S3 disagree on discarding the current revision ----------------------------------------------------


def test_discarding_the_current_revision_behaves_the_same_on_local_and_s3_and_never_leaves_a_dangling_pointer(
    tmp_path, clock, s3, s3_bucket, s3_server, monkeypatch
):
    """Item 2: `resolve --discard-destination` of a restatement that died after committing revision 2 (the pointer
    names it, the ledger does not). The destination's half of the protocol must be one implementation: local and S3
    must do the same, and the pointer must never name (or keep the sha256 of) a revision that is gone. (v2: discard
    deletes revision 2's places and sets the pointer back to the recorded revision 1, on both.)
    Fails on 0.4.0 (07f55b3): local discards the current revision leaving a dangling pointer, S3 refuses."""
    key = key_for(DAY)
    outcomes = {}
    for name, destination in (
        ("local", LocalDestination(str(tmp_path / "exports"))),
        ("s3", s3_destination(s3_bucket, s3_server)),
    ):
        book = ExportLedger(f"sqlite:///{tmp_path / f'{name}.sqlite3'}", clock=clock, lease_ttl=LEASE)
        restatement_dead_after_publishing(book, destination, key, monkeypatch)
        clock.advance(minutes=16)
        try:
            resolve_key(book, destination, str(key), action="discard-destination", operator="ops", reason="bad rows")
            what = "discarded"
        except LedgerError as exc:
            what = f"refused ({type(exc).__name__})"
        if name == "local":
            readers = local_reader_view(Path(destination.root), key)
        else:
            readers = s3_reader_view(s3, s3_bucket, key)
        outcomes[name] = {
            "resolve": what,
            "pointer names revision": readers["revision"],
            "it exists": readers["manifest"],
            "intact": readers["intact"],
            "ledger": book.queries.get(str(key)).state.value,
        }
    assert outcomes["local"] == outcomes["s3"], outcomes
    assert all(o["it exists"] and o["intact"] for o in outcomes.values()), outcomes
    assert outcomes["local"]["pointer names revision"] == 1, outcomes


# -- 3. leases are judged by each worker's own clock -----------------------------------------------------------------

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
    worker = ExportLedger(postgres_url, lease_ttl=dt.timedelta(minutes=10))  # the server's clock
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
from tests.builders import key_for
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
    worker = ExportLedger(postgres_url, lease_ttl=dt.timedelta(minutes=10))
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


# -- 4. the S3 orphan sweep can delete the data object of the manifest that wins ------------------------------------


def test_s3_orphan_sweep_never_deletes_the_data_of_the_manifest_that_wins(s3, s3_bucket, s3_server, sqlite_url):
    """Item 4: attempt A uploads its data and pauses before its manifest; B takes over, its sweep finds no manifest
    at A's place; A wakes and its manifest create succeeds; B's sweep then deletes A's data object. Nothing a
    published manifest names may ever be deleted. (v2: A's objects are at its own place `r1-t1/`, and a manifest is
    published only once the pointer names its place: B fenced the pointer before sweeping, so A's commit is refused
    and what readers follow is B's place, whole.)
    Fails on 0.4.0 (07f55b3): readers see a manifest whose data is missing, ledger failed."""
    ledger = ExportLedger(sqlite_url, lease_ttl=dt.timedelta(seconds=1))  # the host's clock, a 1-second lease
    key = key_for(DAY)
    a_manifest_arrived, b_swept = threading.Event(), threading.Event()
    manifest_key = f"{s3_folder(key)}/r1-t1/{MANIFEST_NAME}"

    def a_pauses_before_its_manifest(method: str, path: str) -> bool:
        if method == "PUT" and path.endswith(f"/{manifest_key}") and not a_manifest_arrived.is_set():
            a_manifest_arrived.set()
            b_swept.wait(30)  # A is paused here (its lease runs out) until B's sweep has decided what to delete
        return False  # no fault: forwarded as sent

    def b_deletes_after_a_published(method: str, path: str) -> bool:
        if method == "DELETE" and "/r1-t1/data.csv" in path:
            b_swept.set()  # B found no manifest at A's place and is deleting A's data; let A's manifest through first
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if s3.list_objects_v2(Bucket=s3_bucket, Prefix=manifest_key).get("KeyCount"):
                    break
                time.sleep(0.05)
        return False

    with FaultProxy(s3_server) as proxy_a, FaultProxy(s3_server) as proxy_b:
        proxy_a.inject("error_500", count=None, when=a_pauses_before_its_manifest)
        proxy_b.inject("error_500", count=None, when=b_deletes_after_a_published)
        a_destination = s3_destination(s3_bucket, proxy_a.endpoint_url)
        b_destination = s3_destination(s3_bucket, proxy_b.endpoint_url)
        a_outcome: list[str] = []

        def attempt_a() -> None:
            try:
                a_outcome.append(export_key(ledger, a_destination, SCHEMA, item(key), "run-a/export").status)
            except Exception as exc:
                a_outcome.append(type(exc).__name__)

        thread = threading.Thread(target=attempt_a)
        thread.start()
        assert a_manifest_arrived.wait(30), "A reached its manifest create"
        time.sleep(2.5)  # A's 1-second lease has run out
        try:
            b_outcome = export_key(ledger, b_destination, SCHEMA, item(key), "run-b/export").status
        except Exception as exc:
            b_outcome = type(exc).__name__
        thread.join(30)
        assert b_swept.is_set(), "B's sweep deleted A's uncommitted data while A's manifest arrived"
    readers = s3_reader_view(s3, s3_bucket, key)
    record = ledger.queries.get(str(key))
    observed = {"A": a_outcome, "B": b_outcome, "ledger state": record.state.value, "readers": readers}
    assert not readers["manifest"] or (readers["data"] and readers["intact"]), observed
    assert (b_outcome, record.state, readers["place"]) == ("exported", ExportState.COMPLETED, "r1-t2"), observed
    assert a_outcome == ["FencedOut"], f"A's commit is refused by B's fence: {observed}"


# -- 5. a window can be exported before it ends ----------------------------------------------------------------------


def test_a_key_is_never_claimed_before_its_window_ends_for_a_tenant_that_will_move_east(tmp_path, instance, clock):
    """Item 5: a tenant moving from Honolulu to Kiritimati on 2026-04-01. The nightly tick for 2026-03-08 of the
    Kiritimati asset comes at 04:30 Kiritimati (2026-03-08T14:30Z) while the tenant's Honolulu window ends at
    2026-03-09T10:00Z. No key may be claimed before its window has ended by the ledger's clock, whatever Dagster's
    partition set says. (v2 groups tenants by zone per date, so the tenant's 2026-03-08 is the Honolulu asset's:
    both assets' 2026-03-08 runs are made at 14:30Z, the Honolulu one as a manual launch Dagster allows.)
    Fails on 0.4.0 (07f55b3): key claimed at 2026-03-08T14:30Z before its window ended 2026-03-09T10:00Z."""
    import dagster as dg

    from definitions import build_definitions
    from tests.conftest import _CLOCKS, ClockedLedgerResource

    clock_id = "round2-item5"
    _CLOCKS[clock_id] = clock
    try:
        resource = ClockedLedgerResource(url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", clock_id=clock_id)
        tenant = Tenant("hono", "Pacific/Kiritimati", moves=(ZoneMove("2026-04-01", "Pacific/Honolulu"),))
        defs = build_definitions(
            tenants=[tenant], ledger=resource, destination=str(tmp_path / "exports"),
            environ={"EXPORTS_SOURCE": "sample"},
        )
        tick_at = dt.datetime(2026, 3, 8, 14, 30, tzinfo=UTC)  # 2026-03-09 04:30 in Kiritimati
        ran = {}
        clock.now = tick_at
        for asset in ("invoice_export__pacific_kiritimati", "invoice_export__pacific_honolulu"):
            schedule = defs.get_schedule_def(f"nightly_{asset}")
            with dg.build_schedule_context(instance=instance, scheduled_execution_time=tick_at) as context:
                scheduled = [r.partition_key for r in schedule.evaluate_tick(context).run_requests or []]
            result = defs.resolve_job_def(f"{asset}_job").execute_in_process(
                partition_key="2026-03-08", instance=instance, raise_on_error=False
            )
            ran[asset] = {
                "scheduled at 14:30Z": scheduled,
                "run succeeded": result.success,
                "refused": "WindowNotOver" in failure_message(result),
            }
        book = resource.get_ledger()
        early = [
            {
                "key": r.logical_key,
                "claimed at (ledger clock)": r.created_at.isoformat(),
                "window ends": r.window_end_utc.isoformat(),
                "state": r.state.value,
            }
            for r in book.queries.records(tenant="hono")
            if r.created_at < r.window_end_utc
        ]
        assert early == [], f"runs of 2026-03-08 at {tick_at.isoformat()}: {ran}; claimed early: {early}"
        assert book.queries.records(tenant="hono") == [], "a claim refused before its window ended leaves no row"
        assert ran["invoice_export__pacific_honolulu"]["refused"], f"the early run is refused: {ran}"

        clock.now = dt.datetime(2026, 3, 9, 10, 0, tzinfo=UTC)  # the Honolulu window has ended: now it is claimed
        done = defs.resolve_job_def("invoice_export__pacific_honolulu_job").execute_in_process(
            partition_key="2026-03-08", instance=instance, raise_on_error=False
        )
        (record,) = book.queries.records(tenant="hono")
        assert done.success and record.state is ExportState.COMPLETED, (record, ran)
        assert record.window_end_utc == clock.now and record.timezone == "Pacific/Honolulu", record
    finally:
        _CLOCKS.pop(clock_id, None)

