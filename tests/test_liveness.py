"""Liveness: every key asked for ends completed or escalated, every stuck state has an audited way out, and nothing
leaks. One test per defect found by the review (issue 10); each failed on the code before the fix."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sqlite3
import threading
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import evidence_for, key_for, open_ledger
from pipeline_helpers import JOB, failure_message, make_defs, places, run_partition, run_range, tick
from restatement_support import (
    DAY,
    PREFIX,
    UTC,
    restatement_dead_after_publishing,
    s3_destination,
)

from definitions import build_definitions
from export_ledger import Tenant, cli
from export_ledger.calendar import ExportCalendar, ZoneMove, utc_iso, windows_between
from export_ledger.dagster import LedgerResource
from export_ledger.dagster.sensors import RELAUNCH_TAG, SITUATION_TAG
from export_ledger.destinations import ExportTarget, LocalDestination
from export_ledger.destinations.base import Fenced, Verdict
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.errors import redact_text
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import MANIFEST_NAME, ExportSchema, Manifest
from export_ledger.ledger import (
    AttemptOutcome,
    ContractChanged,
    ExportLedger,
    ExportState,
    redact_url,
)
from export_ledger.ledger.contracts import Contracts
from export_ledger.ledger.errors import LiveLease
from export_ledger.protocol import ExportItem, ExportOutcomeUnknown, export_key
from export_ledger.restate import request_for_date
from resources.invoices import SampleInvoiceSource

PARTITION = "2026-03-08"
ACME = "invoice_export/acme/2026-03-08T05:00:00Z"
GLOBEX = "invoice_export/globex/2026-03-08T05:00:00Z"


def _crash(ledger: ExportLedger, key, attempt: str):
    """A claim whose attempt died: its lease runs out with no result."""
    return ledger.claims.claim(key, attempt)


# -- 1. a failed key is rerun beside a stuck sibling, and once a sibling's live run ends ------------------------------


@pytest.mark.parametrize("sibling", ["in_progress", "remote_unknown", "conflict"])
def test_a_failed_key_is_rerun_although_a_sibling_key_of_its_partition_is_busy(
    tmp_path, instance, clocked_ledger, clock, sibling
):
    defs = make_defs(tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger)
    ledger = clocked_ledger.get_ledger()
    _crash(ledger, key_for(tenant="acme"), "dead-run/invoice_export")
    clock.advance(minutes=16)  # acme's lease has expired: reconciliation will find nothing and call it failed
    busy = ledger.claims.claim(key_for(tenant="globex"), "backfill-run/invoice_export")  # a concurrent backfill, live
    if sibling == "remote_unknown":
        ledger.completions.mark_remote_unknown(busy, TimeoutError("lost"))
    elif sibling == "conflict":
        ledger.completions.mark_conflict(busy, RuntimeError("something else there"))

    first = tick(defs, instance)
    assert ledger.queries.get(ACME).state is ExportState.FAILED
    if sibling == "in_progress":  # a run still holds globex: a rerun now would compete with it, so it waits
        assert first.result.run_requests == [], "no rerun beside a live lease"
        ledger.completions.complete(busy, evidence_for(busy))
        first = tick(defs, instance, first.cursor)
    assert [r.partition_key for r in first.result.run_requests] == [PARTITION], "rerun although globex is busy"

    later = tick(defs, instance, first.cursor)  # the defect: later ticks never looked at failed keys again
    assert [r.run_key for r in later.result.run_requests] == [first.result.run_requests[0].run_key]


def test_a_key_whose_automatic_reruns_are_spent_is_escalated_not_silently_dropped(tmp_path, instance, clocked_ledger):
    defs = make_defs(tmp_path, ledger=clocked_ledger)
    ledger = clocked_ledger.get_ledger()
    for n in range(3):  # three claims, three failures (a deterministic bad input, say)
        ledger.completions.fail(ledger.claims.claim(key_for(), f"run-{n}/invoice_export"), RuntimeError("bad input"))

    result = tick(defs, instance)
    assert result.result.run_requests == [], "no fourth automatic rerun"
    (evaluation,) = result.check_evaluations
    assert evaluation.check_name == "no_stuck_exports" and evaluation.passed is False
    assert any(ACME in e and "automatic reruns are spent" in e for e in result.errors()), result.errors()
    [escalation] = ledger.attention.needs_attention(dt.timedelta(hours=6))
    assert escalation.logical_key == ACME and "export-ledger resolve" in escalation.why
    assert (escalation.state, escalation.record.claim_count) == ("failed", 3), "escalated after three export claims"


def test_status_needs_attention_lists_escalated_keys_with_the_way_out(sqlite_url, capsys):
    ledger = open_ledger(sqlite_url)  # the wall clock, as the CLI reads it
    claim = ledger.claims.claim(key_for(), "run-1/invoice_export")
    ledger.completions.mark_conflict(claim, RuntimeError("other bytes"))
    ledger.claims.claim(key_for(tenant="globex"), "run-2/invoice_export")  # live: not escalated
    assert cli.main(["--ledger-url", sqlite_url, "status", "--needs-attention"]) == 0
    out = capsys.readouterr().out
    assert ACME in out and "conflict" in out and "export-ledger resolve" in out
    assert GLOBEX not in out


# -- 2. conflict has an exit, audited --------------------------------------------------------------------------------


def _plant_another_keys_export(root: Path) -> Path:
    """Another key's manifest where acme's 2026-03-08 export belongs (how a conflict looks)."""
    folder = root / "invoice_export" / "tenant=acme" / "date=2026-03-08"
    folder.mkdir(parents=True)
    other = Manifest.build(
        logical_key="invoice_export/acme/2026-03-07T05:00:00Z", export="invoice_export", tenant="acme",
        window=key_for(dt.date(2026, 3, 7)).window, row_count=0, sha256="0" * 64, attempt_id="x", fencing_token=1,
        data_file="data.csv", tz_database="",
    )  # fmt: skip
    (folder / MANIFEST_NAME).write_bytes(other.to_json())
    (folder / "data.csv").write_bytes(b"")
    return folder


def test_a_key_in_conflict_is_resolved_by_discarding_the_destination_and_then_exported(tmp_path, instance, capsys):
    defs = make_defs(tmp_path)
    exports = tmp_path / "exports"
    _plant_another_keys_export(exports)
    assert not run_partition(defs, instance, PARTITION).success
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    ledger = open_ledger(url)
    assert ledger.queries.get(ACME).state is ExportState.CONFLICT

    resolve = ["--ledger-url", url, "resolve", ACME, "--destination", str(exports), "--operator", "ops@host"]
    assert cli.main([*resolve, "--discard-destination", "--reason", "orphan of a dead writer"]) == 0
    assert "failed" in capsys.readouterr().out
    assert ledger.queries.get(ACME).state is ExportState.FAILED
    folder = exports / "invoice_export" / "tenant=acme" / "date=2026-03-08"
    assert not (folder / MANIFEST_NAME).exists() and not (folder / "data.csv").exists(), (
        "the other key's unrecorded export is deleted (v2 discards delete: no pointer can ever name it again)"
    )
    assert json.loads((folder / POINTER_NAME).read_bytes())["revision"] == 0, "readers see nothing for the key"
    last = ledger.queries.attempts(ACME)[-1]
    assert (last.attempt_id, last.outcome, last.error_class) == (
        "ops@host",
        AttemptOutcome.FAILED,
        "OperatorResolution",
    )
    assert "orphan of a dead writer" in last.error_message
    assert ledger.operators.entries()[-1]["action"] == "discard-destination"

    assert run_partition(defs, instance, PARTITION).success, "the rerun exports the key"
    assert ledger.queries.get(ACME).state is ExportState.COMPLETED


def test_accepting_the_destinations_export_completes_the_key_and_a_live_lease_is_refused(sqlite_url, clock, tmp_path):
    ledger = open_ledger(sqlite_url, clock=clock)
    destination = LocalDestination(root=str(tmp_path / "exports"))
    key = key_for()
    claim = ledger.claims.claim(key, "run-1/invoice_export")
    frame = SampleInvoiceSource().rows("acme", key.window.start_utc, key.window.end_utc)
    from assets.invoices import INVOICE_SCHEMA
    from export_ledger.frames import validate_frame

    table = validate_frame(frame, INVOICE_SCHEMA, key.window, what=str(key))
    template = Manifest.build(
        logical_key=str(key), export="invoice_export", tenant="acme", window=key.window, row_count=0, sha256="",
        attempt_id=claim.attempt_id, fencing_token=claim.fencing_token, data_file="data.csv", tz_database="",
    )  # fmt: skip
    target = ExportTarget("invoice_export", "acme", PARTITION)
    staged = destination.stage(target, claim.fencing_token, table, "csv", template)
    destination.commit(staged, claim.fencing_token, superseded=0)  # committed, then the attempt died unrecorded
    with pytest.raises(LiveLease, match="held by run-1/invoice_export until"):  # names the holder, and when it ends
        from export_ledger.resolve import resolve_key

        resolve_key(ledger, destination, str(key), action="accept-destination", operator="ops", reason="it is fine")
    ledger.completions.mark_conflict(claim, RuntimeError("looked different at the time"))

    done = resolve_key(ledger, destination, str(key), action="accept-destination", operator="ops", reason="checked")
    assert done.record.state is ExportState.COMPLETED and done.record.committed_attempt == "run-1/invoice_export"
    last = ledger.queries.attempts(str(key))[-1]
    assert (last.outcome, last.error_class) == (AttemptOutcome.REPAIRED, "OperatorResolution")


# -- 3. sweeping a dead attempt's place never deletes what readers see ----------------------------------------------
# v2 replaced the staging folders (and the race between cleaning one and its owner renaming it into place) with
# places per token: a place becomes visible only through the pointer, and once the next party has fenced the pointer
# no earlier token can commit. What the sweep deletes can never be named; what the pointer names is never swept.


def _stage(destination: LocalDestination, key, token: int):
    """Stages the sample source's rows of ``key`` at its revision 1 place for ``token``: written and invisible."""
    from assets.invoices import INVOICE_SCHEMA
    from export_ledger.frames import validate_frame

    frame = SampleInvoiceSource().rows(key.tenant, key.window.start_utc, key.window.end_utc)
    table = validate_frame(frame, INVOICE_SCHEMA, key.window, what=str(key))
    template = Manifest.build(
        logical_key=str(key), export=key.export, tenant=key.tenant, window=key.window, row_count=0, sha256="",
        attempt_id=f"run-t{token}/invoice_export", fencing_token=token, data_file="data.csv", tz_database="",
    )  # fmt: skip
    return destination.stage(ExportTarget(key.export, key.tenant, PARTITION), token, table, "csv", template)


def test_a_sweep_after_fencing_leaves_the_place_the_pointer_names_whole(tmp_path):
    destination = LocalDestination(root=str(tmp_path))
    key = key_for()
    target = ExportTarget("invoice_export", "acme", PARTITION)
    old = _stage(destination, key, token=1)
    destination.commit(old, 1, superseded=0)  # the old attempt committed just before the next party fenced

    pointer = destination.fence(target, 2, logical_key=str(key))
    assert destination.sweep(target, 2, pointer) == 0, "the place the pointer names is never swept"

    place = tmp_path / "invoice_export" / "tenant=acme" / "date=2026-03-08" / old.target.place
    assert sorted(p.name for p in place.iterdir()) == sorted([MANIFEST_NAME, "data.csv"])
    verification = destination.verify(target, logical_key=str(key), superseded=0)
    assert verification.verdict is Verdict.PUBLISHED, "the published export is whole and verifies"


def test_a_dead_attempts_place_is_swept_and_its_late_commit_is_fenced(tmp_path):
    destination = LocalDestination(root=str(tmp_path))
    key = key_for()
    target = ExportTarget("invoice_export", "acme", PARTITION)
    dead = _stage(destination, key, token=1)  # staged, then its attempt stalled before committing

    pointer = destination.fence(target, 2, logical_key=str(key))
    assert destination.sweep(target, 2, pointer) == 1, "a place with a fenced token no pointer names is removed"
    assert places(tmp_path) == [], "nothing of the dead attempt is left"

    with pytest.raises(Fenced):
        destination.commit(dead, 1, superseded=0)  # the stalled attempt wakes: the fence refuses it
    assert destination.pointer(target).revision == 0, "readers still see nothing: the swept place is never named"


# -- 4. customer data never in error messages -----------------------------------------------------------------------


class _EmailAmounts(SampleInvoiceSource):
    def rows(self, tenant, start_utc, end_utc) -> pd.DataFrame:
        frame = super().rows(tenant, start_utc, end_utc)
        frame["amount"] = frame["amount"].astype(object)
        frame.loc[3, "amount"] = "leak-canary@example.org"
        return frame


def test_an_arrow_conversion_error_never_quotes_the_value_in_the_ledger_or_the_run(tmp_path, instance):
    defs = make_defs(tmp_path, source=_EmailAmounts())
    result = run_partition(defs, instance, PARTITION)
    assert not result.success
    message = failure_message(result)
    assert "column 'amount'" in message and "leak-canary" not in message
    (attempt,) = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.attempts(ACME)
    assert "leak-canary" not in (attempt.error_message or "") and "column 'amount'" in attempt.error_message
    assert all("leak-canary" not in str(e) for e in result.all_events)


@pytest.mark.postgres
def test_a_postgres_failing_row_detail_never_reaches_the_ledger_or_the_run(tmp_path, instance, postgres_url):
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:  # a rows table whose CHECK the export violates: PostgreSQL quotes the whole row
        conn.execute(sa.text(
            "CREATE TABLE exported_invoices (logical_key VARCHAR(300), row_number BIGINT, invoice_id TEXT, "
            "tenant TEXT, occurred_at TIMESTAMPTZ, amount DOUBLE PRECISION CHECK (amount < 0), currency TEXT, "
            "customer_email TEXT, PRIMARY KEY (logical_key, row_number))"
        ))  # fmt: skip
    engine.dispose()
    defs = make_defs(tmp_path, ledger_url=postgres_url, destination="ledger-table:exported_invoices")
    result = run_partition(defs, instance, PARTITION)
    assert not result.success
    message = failure_message(result)
    assert "exported_invoices" in message and "@example.com" not in message and "Failing row" not in message
    attempts = open_ledger(postgres_url).queries.attempts(ACME)
    assert attempts and all("@example.com" not in (a.error_message or "") for a in attempts)


# -- 5. a password as a URL query parameter is never printed --------------------------------------------------------


def test_a_password_given_as_a_query_parameter_is_redacted_everywhere(capsys):
    url = "postgresql+psycopg2://reader@127.0.0.1:1/x?password=qp-secret-42&sslmode=disable&api_token=tok-9"
    assert "qp-secret-42" not in redact_url(url) and "tok-9" not in redact_url(url)
    assert "sslmode=disable" in redact_url(url), "other parameters stay readable"
    assert "qp-secret-42" not in redact_text(f"failed: could not reach {url}")
    assert cli.main(["--ledger-url", url, "status"]) == 1
    err = capsys.readouterr().err
    assert "qp-secret-42" not in err and "tok-9" not in err and "export-ledger: error:" in err


def test_an_unreachable_ledger_with_a_query_password_never_reaches_the_event_log(tmp_path, instance, monkeypatch):
    # By name: a URL with a password given as a value is refused when the definitions are built.
    monkeypatch.setenv("EXPORTS_LEDGER_URL", "postgresql+psycopg2://reader@127.0.0.1:1/x?password=qp-secret-43")
    defs = make_defs(tmp_path, ledger=LedgerResource(url=dg.EnvVar("EXPORTS_LEDGER_URL")))
    result = run_partition(defs, instance, PARTITION)
    assert not result.success
    assert "qp-secret-43" not in failure_message(result)
    assert all("qp-secret-43" not in str(e) for e in instance.all_logs(result.run_id))


# -- 6. status never creates the ledger's tables, on PostgreSQL either ---------------------------------------------


@pytest.mark.postgres
def test_status_on_an_empty_postgres_database_creates_nothing(postgres_url, capsys):
    assert cli.main(["--ledger-url", postgres_url, "status"]) == 1
    assert "holds no export ledger" in capsys.readouterr().err
    assert sa.inspect(sa.create_engine(postgres_url)).get_table_names() == []


# -- 7. an exception after publishing is not `failed`: reconciliation records the export ---------------------------


def test_a_failure_after_publishing_leaves_the_key_for_reconciliation_which_completes_it(
    tmp_path, instance, monkeypatch
):
    defs = make_defs(tmp_path)
    monkeypatch.setenv(FAILPOINTS, "after_publish=raise")
    assert not run_partition(defs, instance, PARTITION).success
    monkeypatch.delenv(FAILPOINTS)
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    assert ledger.queries.get(ACME).state is ExportState.REMOTE_UNKNOWN, (
        "published, so never `failed` (nothing published)"
    )

    result = tick(defs, instance)
    assert ledger.queries.get(ACME).state is ExportState.COMPLETED, "reconciliation records it from the manifest"
    assert [e.partition for e in result.materializations] == [PARTITION]


# -- also: contracts, rerun keys, fenced rows ------------------------------------------------------------------------


@pytest.mark.postgres
def test_two_first_materializations_with_different_contracts_record_only_one(postgres_url):
    ledgers = [open_ledger(postgres_url) for _ in range(2)]
    contracts = [ExportCalendar(zone, "2026-01-01").contract() for zone in ("America/New_York", "America/Chicago")]
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    keys = [key_for(dt.date(2026, 3, day)) for day in (7, 8)]  # acme's first two claims, one per attempt

    def first(i: int) -> None:
        barrier.wait()
        try:
            ledgers[i].claims.claim(keys[i], f"run-{i}/invoice_export", contract=contracts[i])
            outcomes.append("recorded")
        except ContractChanged:
            outcomes.append("refused")

    threads = [threading.Thread(target=first, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["recorded", "refused"]
    assert len(ledgers[0].contracts.history("invoice_export")) == 1, "one contract recorded, at the claim that won"


def test_rerun_run_keys_never_repeat_for_a_new_failure(sqlite_url, clock):
    from assets.invoices import invoice_export
    from export_ledger.dagster.sensors import rerun_requests

    ledger = open_ledger(sqlite_url, clock=clock)
    exports = {"invoice_export": invoice_export(source=SampleInvoiceSource(), tenants=["acme", "globex"],
                                                 timezone="America/New_York", start_date="2026-01-01")}  # fmt: skip
    seen = set()
    for n in range(2):  # the same key failing again (a new token) gets a new run key; the same failure, the same
        ledger.completions.fail(ledger.claims.claim(key_for(), f"run-{n}/invoice_export"), RuntimeError("x"))
        failed = ledger.attention.failed_partitions(max_attempts=3, limit=10)
        keys = [r.run_key for r in rerun_requests(failed, exports, log=_NullLog())]
        next_tick = ledger.attention.failed_partitions(max_attempts=3, limit=10)
        again = [r.run_key for r in rerun_requests(next_tick, exports, log=_NullLog())]
        assert keys == again and len(keys) == 1, "the same failure seen on the next tick repeats its run key"
        assert keys[0] not in seen, "a new failure of the key brings a new run key"
        seen.add(keys[0])


class _NullLog:
    def __getattr__(self, _name):
        return lambda *_args, **_kwargs: None


def test_an_operator_discard_restores_the_automatic_reruns(sqlite_url, clock, tmp_path):
    from export_ledger.resolve import resolve_key

    ledger = open_ledger(sqlite_url, clock=clock)
    for n in range(3):
        ledger.completions.fail(ledger.claims.claim(key_for(), f"run-{n}/invoice_export"), RuntimeError("bad input"))
    assert [e.logical_key for e in ledger.attention.needs_attention(dt.timedelta(hours=6))] == [ACME]
    assert ledger.attention.failed_partitions(max_attempts=3, limit=10) == [], "its automatic reruns are spent"
    resolve_key(ledger, LocalDestination(root=str(tmp_path)), ACME, action="discard-destination", operator="ops",
                reason="source fixed")  # fmt: skip
    assert ledger.attention.needs_attention(dt.timedelta(hours=6)) == [], "sent back with its reruns: not escalated"
    record = ledger.queries.get(ACME)
    assert (record.state, record.claim_count) == (ExportState.FAILED, 0), "its export claims count from zero again"
    assert [(w.business_date, w.keys) for w in ledger.attention.failed_partitions(max_attempts=3, limit=10)] == [
        (dt.date(2026, 3, 8), 1)
    ], "its partition is rerun automatically again"


def test_escalated_keys_piling_up_never_delay_the_rerun_of_a_new_failure(sqlite_url, clock):
    ledger = open_ledger(sqlite_url, clock=clock)
    for day, tenant in ((5, "a1"), (6, "a2"), (7, "a3"), (8, "a4")):  # escalated, on dates scanned first
        for n in range(3):  # their automatic reruns are spent
            key = key_for(dt.date(2026, 3, day), tenant=tenant)
            ledger.completions.fail(ledger.claims.claim(key, f"run-{tenant}-{n}/invoice_export"), RuntimeError("x"))
    ledger.completions.fail(ledger.claims.claim(key_for(tenant="zz"), "run-zz/invoice_export"), RuntimeError("x"))

    first_page = ledger.attention.failed_partitions(limit=1, max_attempts=3)
    assert [(w.business_date, w.keys) for w in first_page] == [(dt.date(2026, 3, 8), 1)], (
        "the scan reaches the new failure's partition first, whatever piles up; the escalated key beside it is not "
        "counted"
    )
    assert len(ledger.attention.failed_partitions(limit=10, max_attempts=4)) == 4, (
        "with reruns left for every key, each failed partition is listed"
    )
    assert {e.tenant for e in ledger.attention.needs_attention(dt.timedelta(hours=6))} == {"a1", "a2", "a3", "a4"}, (
        "the spent keys are escalated instead"
    )


# -- sensors and ticks: never-claimed and refused dates, one run per partition, a tick survives any one key ------------
# Liveness, bounds and privacy gaps found by the review of protocol v2 (0.5.0), each a test that failed before its fix:
# every key asked for ends exported or escalated with a way out, a tick survives any one key, a page of the CLI shows
# what it says, and no refusal names a customer's values. The guard each test pins is named in its docstring; removing
# it makes the test fail.


STUCK_AFTER = dt.timedelta(hours=6)
LEDGER_DOWN = "postgresql+psycopg2://postgres@127.0.0.1:1/test"  # nothing listens on port 1


def _execute(defs: dg.Definitions, instance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """Runs a sensor's request in process, as the daemon would launch it (same job, partition and tags)."""
    return defs.resolve_job_def(request.job_name).execute_in_process(
        partition_key=request.partition_key, instance=instance, tags=request.tags, raise_on_error=False
    )


def _ledger(tmp_path) -> ExportLedger:
    return open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")


# -- runs that fail before they claim anything ---------------------------------------------------------------


def test_a_date_whose_run_failed_before_claiming_is_launched_again_and_exported(tmp_path, instance):
    """The run of 2026-03-08 failed before it claimed a key (the ledger was unreachable as it started): the ledger
    has no row of it, so only the orchestrator's failed run says it was asked for. Guard: the sensor's pass over
    failed runs (``missed_requests``); without it nothing ever reruns or escalates the date."""
    down = make_defs(tmp_path, tenants=["acme", "globex"], ledger_url=LEDGER_DOWN)
    assert not run_partition(down, instance, "2026-03-08").success
    good = make_defs(tmp_path, tenants=["acme", "globex"])
    assert run_partition(good, instance, "2026-03-09").success  # the next night works: the ledger is back
    first = tick(good, instance)
    (request,) = first.result.run_requests
    assert (request.partition_key, request.tags[RELAUNCH_TAG]) == ("2026-03-08", "1")
    assert _execute(good, instance, request).success
    states = {(r.tenant, r.business_date.isoformat()): r.state for r in _ledger(tmp_path).queries.records()}
    assert states[("acme", "2026-03-08")] is ExportState.COMPLETED
    assert states[("globex", "2026-03-08")] is ExportState.COMPLETED
    assert not tick(good, instance, first.cursor).result.run_requests, "a date launched again once, not every tick"


def test_a_date_whose_runs_keep_failing_before_claiming_is_escalated_until_a_claim(tmp_path, instance):
    """Its relaunches fail the same way: after ``max_attempts`` runs in all the sensor stops launching it and notes
    the partition missed; it is escalated (CLI and the summary behind ``no_stuck_exports``) with the way out, and
    the first claim of the partition closes it. Guard: the cap on relaunches and ``Attention.note_missed``."""
    down = make_defs(tmp_path, tenants=["acme", "globex"], ledger_url=LEDGER_DOWN)
    assert not run_partition(down, instance, "2026-03-08").success
    good = make_defs(tmp_path, tenants=["acme", "globex"])
    cursor, generations = None, []
    for _ in range(3):
        result = tick(good, instance, cursor)
        cursor = result.cursor
        for request in result.result.run_requests:
            generations.append(request.tags[RELAUNCH_TAG])
            assert not _execute(down, instance, request).success  # the cause is not fixed yet
    assert generations == ["1", "2"], "the nightly run and two relaunches: three runs, then it is given up on"
    ledger = _ledger(tmp_path)
    summary = ledger.attention.summary(STUCK_AFTER)
    assert summary.total == 1
    (escalation,) = ledger.attention.needs_attention(STUCK_AFTER)
    assert (escalation.state, escalation.business_date) == ("never claimed", dt.date(2026, 3, 8))
    assert "3 run(s)" in escalation.why and "2 of its keys" in escalation.why and "materialize" in escalation.why
    assert not tick(good, instance, cursor).result.run_requests
    assert run_partition(good, instance, "2026-03-08").success  # the operator fixed the cause and materialized it
    assert ledger.attention.summary(STUCK_AFTER).total == 0


def test_a_canceled_run_is_not_launched_again(tmp_path, instance):
    """A person canceled it: that is a decision, not a failure to recover from."""
    good = make_defs(tmp_path, tenants=["acme"])
    job = good.resolve_job_def("invoice_export_job")
    run = instance.create_run_for_job(job, tags={"dagster/partition": "2026-03-08"})
    instance.report_run_canceled(run)
    assert not tick(good, instance).result.run_requests


# -- contract refusals ---------------------------------------------------------------------------------------


def test_dates_refused_by_a_contract_are_launched_again_once_it_is_accepted(tmp_path, instance):
    """acme's code moved it to Chicago: its claim of 2026-03-09 was refused (no row: the date was never attempted).
    Once the operator accepts the contract, the refusal closes and the sensor launches the refused date again.
    Guard: the refusal keeps its dates, and ``refused_requests``; without them the day is lost after the accept."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    old = make_defs(tmp_path, tenants=["acme", "globex"])
    assert run_partition(old, instance, "2026-03-08").success
    moved = {"acme": Tenant("acme", "America/Chicago", moves=(ZoneMove("2026-03-09", "America/New_York"),)),
             "globex": None}  # fmt: skip
    new = build_definitions("America/New_York", "2026-01-01", moved, ledger_url=url,
                            destination=str(tmp_path / "exports"),
                            environ={"EXPORTS_SOURCE": "sample"})  # fmt: skip
    chicago = new.resolve_job_def("invoice_export__america_chicago_job")
    assert not chicago.execute_in_process(partition_key="2026-03-09", instance=instance, raise_on_error=False).success
    ledger = _ledger(tmp_path)
    (refusal,) = ledger.contracts.refusals()
    assert (refusal["first_date"], refusal["last_date"]) == (dt.date(2026, 3, 9), dt.date(2026, 3, 9))
    first = tick(new, instance)
    assert not [r for r in first.result.run_requests if "chicago" in r.job_name], "refused: escalated, not rerun"
    assert cli.main(["--ledger-url", url, "accept-contract", "--export", "invoice_export", "--tenant", "acme",
                     "--timezone", "America/Chicago", "--start-date", "2026-01-01", "--move",
                     "2026-03-09:America/New_York", "--reason", "acme moved to Chicago"]) == 0  # fmt: skip
    second = tick(new, instance, first.cursor)
    (request,) = [r for r in second.result.run_requests if r.job_name == "invoice_export__america_chicago_job"]
    assert request.partition_key == "2026-03-09"
    assert _execute(new, instance, request).success
    acme = ledger.queries.records(export="invoice_export", tenant="acme", date_from=dt.date(2026, 3, 9))
    assert [(r.timezone, r.state) for r in acme] == [("America/Chicago", ExportState.COMPLETED)]
    tick(new, instance, second.cursor)
    assert not ledger.contracts.to_relaunch(), "every refused date has a key: nothing left to launch"


@pytest.mark.postgres
def test_a_claim_refused_while_the_contract_is_accepted_keeps_no_refusal(postgres_url, monkeypatch):
    """PostgreSQL, READ COMMITTED: an operator accepts the new contract while a claim is deciding against the old one.
    Guard: the claim holds the export's acceptance lock (shared) from before it reads the contract, so the acceptance
    (exclusive) waits for the claim to commit its refusal, then closes it; no refusal stays open for ever, and the
    next claim runs under the accepted contract."""
    ledger = open_ledger(postgres_url)
    ny = ExportCalendar("America/New_York", "2026-01-01").contract()
    chicago = ExportCalendar("America/Chicago", "2026-01-01", (ZoneMove("2026-03-02", "America/New_York"),)).contract()
    ledger.claims.claim(key_for(dt.date(2026, 3, 1), tenant="globex"), "r0/x", contract=ny)
    operator = open_ledger(postgres_url)
    original = Contracts._decisions
    accepted = []

    def racing(self, conn, export, wanted):
        decided = original(self, conn, export, wanted)
        if decided[1] and not accepted:  # the claim would refuse: the operator accepts meanwhile
            accepted.append(threading.Thread(target=lambda: accepted.append(
                operator.contracts.accept("invoice_export", chicago, "moved", tenant="globex"))))  # fmt: skip
            accepted[0].start()
            accepted[0].join(timeout=2)
            assert len(accepted) == 1, "the acceptance waits for the claim that decides on the contract it replaces"
        return decided

    monkeypatch.setattr(Contracts, "_decisions", racing)
    with pytest.raises(ContractChanged):
        ledger.claims.claim(
            key_for(dt.date(2026, 3, 2), tenant="globex", timezone="America/Chicago"), "r1/x", contract=chicago
        )
    monkeypatch.undo()
    accepted[0].join(timeout=30)
    assert len(accepted) == 2, "the acceptance went through once the claim committed"
    assert not ledger.contracts.refusals(), "and closed the refusal the claim kept"
    claim = ledger.claims.claim(key_for(dt.date(2026, 3, 2), tenant="globex", timezone="America/Chicago"), "r2/x",
                                contract=chicago)  # fmt: skip
    assert claim.fencing_token == 1, "the accepted contract is in force"


def test_every_refused_tenant_is_counted(sqlite_url, clock):
    """250 tenants refused: the summary counts them in the database (a count of the rows read stopped at 200)."""
    ledger = open_ledger(sqlite_url, clock=clock)
    tenants = [f"t{i:03d}" for i in range(250)]
    ny = ExportCalendar("America/New_York", "2026-01-01").contract()
    moved = ExportCalendar("America/Chicago", "2026-01-01", (ZoneMove("2026-03-10", "America/New_York"),)).contract()
    ledger.contracts.check({("invoice_export", t): ny for t in tenants})
    assert len(ledger.contracts.check({("invoice_export", t): moved for t in tenants})) == 250
    summary = ledger.attention.summary(STUCK_AFTER)
    assert summary.total == 250
    ((count, listed),) = summary.groups.values()
    assert count == 250 and len(listed) == 20


# -- one run per partition -----------------------------------------------------------------------------------

TENANTS = [f"t{i:03d}" for i in range(120)]


def test_no_rerun_is_launched_beside_a_run_that_still_holds_the_date(tmp_path, instance, clocked_ledger, clock):
    """The nightly run's first group failed and its second is being exported: a rerun launched now would compete
    with it for the date's keys (and fail on those it holds). Guard: partitions with a live lease are left out of
    the pages of work until it ends."""
    defs = make_defs(tmp_path, tenants=TENANTS, ledger=clocked_ledger)
    ledger = clocked_ledger.get_ledger()
    keys = [key_for(tenant=t) for t in TENANTS]
    for claim in ledger.claims.claim_many(keys[:50], "nightly/invoice_export"):
        ledger.completions.fail(claim, TimeoutError("source timed out"))
    held = ledger.claims.claim_many(keys[50:100], "nightly/invoice_export")
    first = tick(defs, instance)
    assert not first.result.run_requests
    for claim in held:
        ledger.completions.complete(claim, evidence_for(claim))
    second = tick(defs, instance, first.cursor)
    (request,) = second.result.run_requests  # the run ended: its failed keys are rerun, in one run
    assert request.partition_key == "2026-03-08"


def test_one_tick_launches_one_run_per_partition(tmp_path, instance, clocked_ledger):
    """A failed key and an open restatement on one date: one run claims both (it reruns the one and restates the
    other). Guard: ``merged``; without it two runs of the date compete."""
    defs = make_defs(tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger)
    ledger = clocked_ledger.get_ledger()
    acme = ledger.claims.claim(key_for(tenant="acme"), "nightly/invoice_export")
    ledger.completions.complete(acme, evidence_for(acme))
    ledger.restatements.request(str(key_for(tenant="acme")), reason="late invoices", requested_by="ops")
    ledger.completions.fail(ledger.claims.claim(key_for(tenant="globex"), "nightly/invoice_export"), OSError("x"))
    requests = tick(defs, instance).result.run_requests
    assert [r.partition_key for r in requests] == ["2026-03-08"]


class _FailsOnce(SampleInvoiceSource):
    broken: bool = True

    def rows(self, tenant, start_utc, end_utc):
        if self.broken and tenant == "acme" and start_utc.date().isoformat() == "2026-03-03":
            raise TimeoutError("source timed out")
        return super().rows(tenant, start_utc, end_utc)


def test_the_finished_dates_of_a_failed_range_run_are_materialized(tmp_path, instance):
    """A single-run backfill over five dates fails on one key: the four other dates are exported, and Dagster
    records no materialization for a failed step. Guard: the I/O manager records each fully exported partition
    before it raises; the failed date's rerun records its own."""
    source = _FailsOnce()
    defs = make_defs(tmp_path, tenants=["acme", "globex"], source=source)
    assert not run_range(defs, instance, "2026-03-01", "2026-03-05").success
    days = [f"2026-03-0{d}" for d in range(1, 6)]
    assert _materialized(instance, days) == set(days) - {"2026-03-03"}
    source.broken = False
    for request in tick(defs, instance).result.run_requests:
        assert _execute(defs, instance, request).success
    assert _materialized(instance, days) == set(days)


def _materialized(instance, partitions) -> set[str]:
    page = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("invoice_export"), asset_partitions=list(partitions)), limit=100
    )
    return {record.partition_key for record in page.records}


# -- a tick survives any one key -----------------------------------------------------------------------------


def test_one_unreadable_pointer_never_stops_a_tick_nor_its_escalation(tmp_path, instance, clocked_ledger, clock):
    """A pointer naming a path with a NUL byte (a corrupt or hostile writer): the tick goes on with the other keys,
    and the key escalates after ``stuck_after`` although every tick holds it. Guards: a malformed pointer is a
    conflict of that key (``Pointer.parse``, path checks), ``examine`` keeps any one key's failure to itself, and a
    hold leaves the key's "stuck since" alone."""
    defs = make_defs(tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger)
    ledger = clocked_ledger.get_ledger()
    ledger.claims.claim(key_for(tenant="acme"), "dead-run/invoice_export")  # its lease runs out: a crash
    ledger.completions.fail(ledger.claims.claim(key_for(tenant="globex"), "run-g/invoice_export"), RuntimeError("x"))
    folder = tmp_path / "exports" / "invoice_export" / "tenant=acme" / "date=2026-03-08"
    folder.mkdir(parents=True)
    (folder / "_current.json").write_text(json.dumps(
        {"format": 2, "fence": 1, "revision": 1, "path": "r1-t1\u0000", "data_file": "r1-t1\u0000/data.csv",
         "manifest": "r1-t1\u0000/_manifest.json", "sha256": "0" * 64, "row_count": 0}))  # fmt: skip
    clock.advance(minutes=16)
    cursor, launched = None, []
    for _ in range(30):  # 7.5 hours of ticks
        result = tick(defs, instance, cursor)
        cursor = result.cursor
        launched += [r.partition_key for r in result.result.run_requests]
        clock.advance(minutes=15)
    assert "2026-03-08" in launched, "globex's failed key is rerun although acme's pointer is unreadable"
    names = [e.name for e in ledger.attention.needs_attention(STUCK_AFTER)]
    assert str(key_for(tenant="acme")) in names


# -- the CLI's pages -----------------------------------------------------------------------------------------


def _conflicts(ledger, n):
    for i in range(n):
        claim = ledger.claims.claim(key_for(tenant=f"t{i:04d}"), f"run-{i}/invoice_export")
        ledger.completions.mark_conflict(claim, RuntimeError("x"))


def test_needs_attention_pages_with_offset_and_filters_tenants_before_the_limit(sqlite_url, capsys):
    """The page the CLI points to ("--offset 5 shows the next ones") holds the next escalations, and --tenant
    filters in the database, not among the first --limit rows."""
    _conflicts(open_ledger(sqlite_url), 12)
    base = ["--ledger-url", sqlite_url, "status", "--needs-attention", "--limit", "5"]
    assert cli.main(base) == 0
    assert "--offset 5 shows the next ones" in capsys.readouterr().out
    assert cli.main([*base, "--offset", "5"]) == 0
    second = capsys.readouterr().out
    assert "t0005" in second and "t0004" not in second
    assert cli.main([*base, "--tenant", "t0011"]) == 0
    assert "t0011" in capsys.readouterr().out


SCHEMA = ExportSchema({"id": "string", "tenant": "string", "at": "timestamp"}, "at", ("id",), tenant_column="tenant")


def _unknown_orders_key(tmp_path, monkeypatch, ledger):
    from export_ledger import failpoints

    destination = LocalDestination(str(tmp_path / "orders-bucket"))
    key = key_for(export="orders")
    frame = pd.DataFrame({"id": ["o1"], "tenant": ["acme"], "at": [pd.Timestamp(key.window.start_utc)]})
    monkeypatch.setenv(failpoints.ENV_VAR, "after_publish=raise")
    with pytest.raises(ExportOutcomeUnknown):
        export_key(ledger, destination, SCHEMA, ExportItem(key, "2026-03-08", frame), "run-1/orders")
    monkeypatch.delenv(failpoints.ENV_VAR)
    return key


def test_reconcile_never_judges_a_key_at_a_destination_it_was_not_published_to(tmp_path, monkeypatch, capsys):
    """orders published to its own bucket; the CLI is pointed at the invoices' destination. Guard: the location the
    attempt recorded with its unknown outcome is compared with the destination's first; without it the key is
    judged absent there (``failed``) while its export is visible to readers of its real destination."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    ledger = open_ledger(url)
    key = _unknown_orders_key(tmp_path, monkeypatch, ledger)
    wrong = tmp_path / "invoices-exports"
    monkeypatch.setenv("EXPORTS_DESTINATION", str(wrong))
    cli.main(["--ledger-url", url, "reconcile"])
    out = capsys.readouterr().out
    assert ledger.queries.get(str(key)).state is ExportState.REMOTE_UNKNOWN
    assert "not" in out and "orders-bucket" in out
    assert not wrong.exists() or not any(wrong.rglob("*")), "nothing was written at the wrong destination"
    monkeypatch.setenv("EXPORTS_DESTINATION", str(tmp_path / "orders-bucket"))
    cli.main(["--ledger-url", url, "reconcile", "--export", "orders"])
    assert ledger.queries.get(str(key)).state is ExportState.COMPLETED


def test_reconcile_without_export_refuses_stuck_keys_of_several_exports_that_record_no_destination(
    tmp_path, sqlite_url, capsys
):
    """Keys claimed with no contract (as before release 0.6) record no destination: one --destination for several
    exports would judge a key published elsewhere absent. (Keys that record theirs are each judged there.)"""
    ledger = open_ledger(sqlite_url, lease_ttl=dt.timedelta(seconds=1))
    for export in ("invoice_export", "orders"):
        ledger.claims.claim(key_for(export=export), f"run/{export}")
    time.sleep(1.1)  # the leases end: both keys are stuck
    assert cli.main(["--ledger-url", sqlite_url, "reconcile", "--destination", str(tmp_path / "x")]) == 2
    assert "--export" in capsys.readouterr().err
    assert not (tmp_path / "x").exists(), "no fence written anywhere"


# -- retention -----------------------------------------------------------------------------------------------


def test_a_later_start_date_never_hides_another_tenants_missing_day(sqlite_url, clock):
    """acme's history now starts on 2026-03-08; its keys before then must not count for globex, which never
    exported 2026-03-05. Guard: keys are counted per start date, only of the tenants expected from it."""
    ledger = open_ledger(sqlite_url, clock=clock)
    contract = ExportCalendar("America/New_York", "2026-03-01").contract()
    for i in range(10):
        day = dt.date(2026, 3, 1) + dt.timedelta(days=i)
        for tenant in ("acme", "globex"):
            if (tenant, i) != ("globex", 4):
                claim = ledger.claims.claim(key_for(day, tenant=tenant), f"run-{tenant}-{i}/x", contract=contract)
                ledger.completions.complete(claim, evidence_for(claim))
    later = ExportCalendar("America/New_York", "2026-03-08").contract()
    ledger.contracts.accept("invoice_export", later, "acme's history starts later", tenant="acme")
    (plan,) = ledger.retention.plan(7, export="invoice_export")
    assert plan.mark == dt.date(2026, 3, 5) and plan.unexported[0] == dt.date(2026, 3, 5)
    assert plan.missing_tenants == ["globex"]


# -- privacy -------------------------------------------------------------------------------------------------

CANARY = "4111111111111111"


class _Defective(SampleInvoiceSource):
    defect: str = "outside"

    def rows(self, tenant, start_utc, end_utc):
        frame = super().rows(tenant, start_utc, end_utc)
        frame.loc[0, "invoice_id"] = f"card-{CANARY}"
        if self.defect == "outside":
            frame.loc[0, "occurred_at"] = end_utc + pd.Timedelta(hours=1)
        else:
            frame.loc[0, "tenant"] = "globex"
        return frame


@pytest.mark.parametrize("defect", ["outside", "foreign"])
def test_a_refused_row_is_named_by_position_never_by_id(tmp_path, instance, defect):
    """An event outside the window, a row of another tenant: the refusal counts them and gives their row positions;
    their ids (customer data) reach neither the ledger nor the event log."""
    defs = make_defs(tmp_path, source=_Defective(defect=defect))
    result = run_partition(defs, instance, "2026-03-08")
    assert not result.success
    stored = [a.error_message or "" for a in _ledger(tmp_path).queries.all_attempts()]
    assert any("rows 1" in m for m in stored), stored
    logged = [str(e.message) + str(getattr(e, "dagster_event", "")) for e in instance.all_logs(result.run_id)]
    assert not [m for m in stored + logged if CANARY in m]


@pytest.mark.postgres
def test_the_summary_lists_what_it_counted_while_keys_escalate(postgres_url):
    """PostgreSQL: a key escalates in a new (export, zone) group between the summary's counts and its listing.
    Guard: one REPEATABLE READ snapshot for the read (and a listing that never assumes its group was counted);
    without it the tick raised KeyError."""
    ledger = open_ledger(postgres_url)
    ledger.completions.mark_conflict(ledger.claims.claim(key_for(tenant="acme"), "r1/x"), RuntimeError("x"))
    other = open_ledger(postgres_url)
    fired = []

    def escalate_meanwhile(conn, cursor, statement, parameters, context, executemany):
        if "row_number()" in statement and not fired:
            fired.append(1)
            claim = other.claims.claim(key_for(tenant="kolkata-co", timezone="Asia/Kolkata"), "r2/x")
            other.completions.mark_conflict(claim, RuntimeError("x"))

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", escalate_meanwhile)
    try:
        summary = ledger.attention.summary(STUCK_AFTER)
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", escalate_meanwhile)
    assert fired and summary.total == 1
    assert ledger.attention.summary(STUCK_AFTER).total == 2


# -- a rerun that fails before its claim keeps its remaining reruns ----------------------------------------------------


def test_a_rerun_that_fails_before_its_claim_still_gets_the_remaining_automatic_reruns(
    tmp_path, instance, clocked_ledger, clock
):
    """Suspected S6: the rerun's run key names each failed key with its fencing token. A rerun run that fails before
    it claims leaves the token as it was, so the next tick repeats the run key and Dagster launches nothing: the key
    gets one automatic rerun, not three, and is not escalated either (until stuck_after). (v2 reads a source after
    the claim, so "fails before its claim" is a run whose ledger cannot be opened; it runs in the instance with the
    sensor's tags, `export-ledger/rerun-of=<situation>`, as the daemon launches it.)
    Fails on 0.4.0 (07f55b3): the second tick repeats the rerun run key after a run that failed before its claim."""
    defs = make_defs(tmp_path, tenants=["acme"], ledger=clocked_ledger)
    (tmp_path / "a-file").write_text("not a folder")  # the ledger cannot be opened beneath it
    unreachable = LedgerResource(url=f"sqlite:///{tmp_path / 'a-file' / 'ledger.sqlite3'}")
    down = make_defs(tmp_path, tenants=["acme"], ledger=unreachable, destination=str(tmp_path / "elsewhere"))
    book = clocked_ledger.get_ledger()
    book.completions.fail(book.claims.claim(key_for(), "run-1/invoice_export"), RuntimeError("source down"))
    run_keys, cursor = [], None
    for _ in range(4):
        result = tick(defs, instance, cursor)
        cursor = result.cursor
        requests = [r for r in result.result.run_requests if r.partition_key == PARTITION]
        run_keys.append([r.run_key for r in requests])
        for request in requests:  # the run the sensor asked for: it fails before it claims anything
            rerun = down.resolve_job_def(JOB).execute_in_process(
                partition_key=PARTITION, instance=instance, tags=request.tags, raise_on_error=False
            )
            assert not rerun.success and request.tags.get(SITUATION_TAG)
        clock.advance(minutes=5)
    record = book.queries.get(ACME)
    observed = {
        "run keys per tick": run_keys,
        "claims so far": record.claim_count,
        "state": record.state.value,
    }
    launched = [keys[0] for keys in run_keys if keys]
    assert len(launched) == 3 and len(set(launched)) == 3, f"three automatic reruns, each a new run key: {observed}"
    assert run_keys[3] == [], f"then no more: {observed}"
    assert (record.claim_count, record.state) == (1, ExportState.FAILED), observed
    clock.advance(hours=7)  # longer than stuck_after: the key whose reruns never claimed it waits for a person
    escalated = [e.logical_key for e in book.attention.needs_attention(dt.timedelta(hours=6))]
    assert escalated == [ACME], observed


# -- the reconciliation sensor and the operators' ways out -------------------------------------------------------------
# Liveness of the reconciliation sensor and the operators' ways out (issue 18, items 6 and 11 to 16): a tenant's source
# failure recorded on its key, escalated backlogs past SQLite's parameter limit, one run per restated date, code
# locations sharing a ledger, calendar refusals escalated, a refused resolve that leaves the key as it was. Each failed
# on 0.4.0 (07f55b3). Helpers are in ``restatement_support.py``; item 11 at full size is in the ``slow`` tier.


NY = "America/New_York"
EMAIL = "jane.doe@example.org"
CARD = "4111 1111 1111 1111"


# -- one tenant's source failure is recorded on its key ----------------------------------------------------------------


class _GlobexSourceDown(SampleInvoiceSource):
    def rows(self, tenant, start_utc, end_utc) -> pd.DataFrame:
        if tenant == "globex":
            raise RuntimeError(f"payment lookup failed for card {CARD} of {EMAIL}")
        return super().rows(tenant, start_utc, end_utc)


def test_one_tenants_source_failure_is_recorded_on_its_key_and_the_other_tenants_export(tmp_path, instance):
    """Item 6: a source raising for one tenant must be recorded on that tenant's key as `failed` (details withheld),
    and the other tenants must export; its message (an email, a card number) must not reach Dagster's event log.
    Fails on 0.4.0 (07f55b3): no ledger row for either tenant; card number and email in the event log."""
    defs = make_defs(tmp_path, tenants=["acme", "globex"], source=_GlobexSourceDown())
    result = run_partition(defs, instance, PARTITION)
    book = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    acme, globex = book.queries.get(ACME), book.queries.get(GLOBEX)
    logged = " ".join(str(e) for e in instance.all_logs(result.run_id)) + failure_message(result)
    stored = " ".join(a.error_message or "" for a in book.queries.attempts(GLOBEX)) if globex else ""
    observed = {
        "acme": acme.state.value if acme else "no ledger row",
        "globex": globex.state.value if globex else "no ledger row",
        "customer data in the event log": EMAIL in logged or CARD in logged,
        "customer data in the ledger": EMAIL in stored or CARD in stored,
    }
    assert observed == {
        "acme": "completed",
        "globex": "failed",
        "customer data in the event log": False,
        "customer data in the ledger": False,
    }
    assert "details withheld" in stored, stored


# -- an escalated backlog never breaks the reconciliation tick ---------------------------------------------------------


def _sqlite_time(value: dt.datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


@pytest.mark.slow
def test_an_escalated_backlog_past_sqlites_parameter_limit_never_breaks_the_tick_and_a_fresh_failure_is_rerun(
    tmp_path, instance, clocked_ledger, clock, sqlite_url, capsys
):
    """Item 11: more escalated keys (failed, reruns spent) than SQLite binds parameters in one statement (the issue's
    33,000 against the default limit of 32,766; this machine's SQLite is built with a higher limit, read below).
    Every sensor tick and CLI read must be bounded: the tick must not raise "too many SQL variables", and a fresh
    failure must still be rerun. (v2: reruns are counted by `claim_count`, set to 3 on the backlog's rows.)
    Fails on 0.4.0 (07f55b3): tick raises LedgerUnavailable "too many SQL variables" with 251,000 escalated keys;
    no reruns."""
    book = clocked_ledger.get_ledger()
    limit = sqlite3.connect(":memory:").getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    days = 100
    windows = windows_between(dt.date(2025, 1, 1), dt.date(2025, 1, 1) + dt.timedelta(days=days - 1), NY)
    tenants = limit // days + 10  # limit + 1,000 keys or so
    then = _sqlite_time(clock.now - dt.timedelta(days=1))
    rows = [
        (
            f"invoice_export/old{t:05d}/{utc_iso(w.start_utc)}",
            "invoice_export",
            f"old{t:05d}",
            w.business_date.isoformat(),
            NY,
            _sqlite_time(w.start_utc),
            _sqlite_time(w.end_utc),
            "test",
            "failed",
            3,
            3,
            then,
            then,
        )  # fmt: skip
        for t in range(tenants)
        for w in windows
    ]
    assert len(rows) > limit
    with contextlib.closing(sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))) as conn, conn:
        conn.executemany(  # one executemany, in SQLAlchemy's SQLite formats (what the ledger itself writes)
            "INSERT INTO export_runs (logical_key, export, tenant, business_date, timezone, window_start_utc, "
            "window_end_utc, tz_database, state, fencing_token, claim_count, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    book.completions.fail(book.claims.claim(key_for(), "run-1/invoice_export"), RuntimeError("source down"))

    defs = make_defs(tmp_path, tenants=["acme"], ledger=clocked_ledger)
    try:
        result = tick(defs, instance)
        ticked = "ok"
        reruns = [r.partition_key for r in result.result.run_requests]
    except Exception as exc:
        ticked, reruns = f"{type(exc).__name__}: {exc}"[:200], []
    code = cli.main(["--ledger-url", sqlite_url, "status", "--needs-attention", "--json"])
    err = capsys.readouterr().err.strip()
    observed = {
        "escalated keys": len(rows),
        "SQLite's parameter limit": limit,
        "tick": ticked,
        "reruns requested": reruns,
        "status --needs-attention": (code, err[:160]),
    }
    assert (ticked, reruns, code) == ("ok", [PARTITION], 0), observed


# -- a restated date with more keys than a batch gets one run ----------------------------------------------------------


def test_a_restated_date_with_more_keys_than_the_batch_size_gets_one_run(tmp_path, instance, clocked_ledger):
    """Item 12: a date of 250 tenants restated, with the sensor's batch size 100. The README says one run per
    partition: every tick's restatement run request for the date must carry one run key, not one per page.
    Fails on 0.4.0 (07f55b3): 3 distinct run keys for one date with 250 tenants and batch size 100."""
    tenants = [f"t{i:03d}" for i in range(250)]
    defs = make_defs(tmp_path, tenants=tenants, ledger=clocked_ledger, reconcile_batch_size=100)
    book = clocked_ledger.get_ledger()
    claims = book.claims.claim_many([key_for(tenant=t) for t in tenants], "run-1/invoice_export")
    book.completions.complete_many([(claim, evidence_for(claim)) for claim in claims])
    report = request_for_date(book, "invoice_export", dt.date(2026, 3, 8), reason="late invoices", requested_by="ops")
    assert len(report.requested) == 250
    run_keys, cursor = [], None
    for _ in range(3):
        result = tick(defs, instance, cursor)
        cursor = result.cursor
        run_keys += [r.run_key for r in result.result.run_requests if r.partition_key == PARTITION]
    assert run_keys, "the restated date is launched"
    assert len(set(run_keys)) == 1, f"{len(set(run_keys))} distinct run keys for {PARTITION}: {sorted(set(run_keys))}"


# -- code locations sharing a ledger see only their own keys -----------------------------------------------------------


def test_a_code_location_sharing_a_ledger_neither_logs_nor_pages_another_locations_keys(
    tmp_path, instance, clocked_ledger
):
    """Item 13: location A (invoice_export) shares its ledger with location B (aaa_orders). A must not log B's
    conflicts as errors, and B's failed keys must not fill A's page of failed keys (A's fresh failure is rerun on
    its first tick).
    Fails on 0.4.0 (07f55b3): location A logs B's conflict; A's reruns empty."""
    book = clocked_ledger.get_ledger()
    other = key_for(export="aaa_orders", tenant="zed")
    book.completions.mark_conflict(book.claims.claim(other, "b-run/aaa_orders"), RuntimeError("other bytes there"))
    for tenant in ("b1", "b2", "b3"):
        claim = book.claims.claim(key_for(export="aaa_orders", tenant=tenant), f"b-{tenant}/aaa_orders")
        book.completions.fail(claim, RuntimeError("x"))
    book.completions.fail(book.claims.claim(key_for(), "a-run/invoice_export"), RuntimeError("source down"))

    defs = make_defs(tmp_path, tenants=["acme"], ledger=clocked_ledger, reconcile_batch_size=2)
    result = tick(defs, instance)
    observed = {
        "A's errors naming B's keys": [e[:120] for e in result.errors() if "aaa_orders" in e],
        "A's reruns on its first tick": [r.partition_key for r in result.result.run_requests],
    }
    assert observed == {"A's errors naming B's keys": [], "A's reruns on its first tick": [PARTITION]}


# -- a tenant refused by its calendar contract is escalated ------------------------------------------------------------


def test_a_tenant_refused_by_its_calendar_contract_is_escalated(tmp_path, instance, clocked_ledger, clock, capsys):
    """Item 14: acme's zone changed in code without acceptance, so its materializations are refused. Its partition
    was asked for and neither completes nor fails a key: it must be escalated (the reconciliation sensor's error,
    `status --needs-attention`).
    Fails on 0.4.0 (07f55b3): a tenant refused by its contract is not escalated."""
    first = make_defs(tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger)
    assert run_partition(first, instance, "2026-03-08").success  # both contracts recorded in New York
    moved = build_definitions(
        tenants={"acme": "America/Chicago", "globex": NY}, ledger=clocked_ledger,
        destination=str(tmp_path / "exports"), environ={"EXPORTS_SOURCE": "sample"},
    )  # fmt: skip
    refused = moved.resolve_job_def("invoice_export__america_chicago_job").execute_in_process(
        partition_key="2026-03-09", instance=instance, raise_on_error=False
    )
    assert not refused.success and "calendar contract" in failure_message(refused)
    clock.advance(hours=7)  # longer than stuck_after
    errors = tick(moved, instance).errors()
    cli.main(["--ledger-url", clocked_ledger.url, "status", "--needs-attention"])
    listed = capsys.readouterr().out
    observed = {
        "sensor errors naming acme": [e[:120] for e in errors if "acme" in e],
        "status --needs-attention": listed.strip()[:200],
    }
    assert observed["sensor errors naming acme"] and "acme" in listed, observed


# -- a refused resolve leaves the key as it was ------------------------------------------------------------------------


def test_a_refused_resolve_leaves_the_key_as_it_was_or_says_so_in_the_ledger(
    ledger, clock, s3_bucket, fault_proxy, monkeypatch, capsys
):
    """Item 16: `export-ledger resolve --discard-destination` on S3 of a restatement that died after committing
    revision 2 is refused by the destination after the operator took the key. A refused resolve must leave the key
    as it was, or record the refusal (an attempt row and an operator log line). (v2 discards the current revision on
    S3 as on local disks, item 2: the destination's refusal is now a DELETE answered 500.)
    Fails on 0.4.0 (07f55b3): refused resolve leaves the key in_progress under the operator's lease, no attempt row,
    no log line."""
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    restatement_dead_after_publishing(ledger, destination, key, monkeypatch)
    before = ledger.queries.get(str(key))  # in_progress, its lease long expired by the CLI's (the host's) clock
    for name, value in {"AWS_ENDPOINT_URL": fault_proxy.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    fault_proxy.inject("error_500", method="DELETE", when=lambda _m, path: "/r2-t2/" in path)
    code = cli.main([
        "--ledger-url", ledger.url, "resolve", str(key), "--discard-destination", "--reason", "bad rows",
        "--operator", "ops@host", "--destination", f"s3://{s3_bucket}/{PREFIX}",
    ])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert fault_proxy.remaining == 0, "the destination refused the discard's delete"
    after = ledger.queries.get(str(key))
    traces = [a.outcome.value for a in ledger.queries.attempts(str(key)) if a.attempt_id == "ops@host"]
    observed = {
        "exit code": code,
        "error": err[:160],
        "before": (before.state.value, before.lease_owner, before.fencing_token),
        "after": (after.state.value, after.lease_owner, after.fencing_token),
        "operator's attempt rows": traces,
        "operator log lines": [line["action"] for line in ledger.operators.entries()],
    }
    unchanged = observed["before"] == observed["after"]
    recorded = bool(traces) and bool(observed["operator log lines"])
    assert code != 0, f"the refusal is reported: {observed}"
    assert unchanged or recorded, observed
    assert after.state is not ExportState.IN_PROGRESS, f"never left held by the operator who gave up: {observed}"
