"""Liveness: every key asked for ends completed or escalated, every stuck state has an audited way out, and nothing
leaks. One test per defect found by the review (issue 10); each failed on the code before the fix."""

from __future__ import annotations

import datetime as dt
import json
import threading
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import evidence_for, key_for
from pipeline_helpers import failure_message, make_defs, places, run_partition, tick

from export_ledger import cli
from export_ledger.calendar import ExportCalendar
from export_ledger.dagster import LedgerResource
from export_ledger.destinations import ExportTarget, LocalDestination
from export_ledger.destinations.base import Fenced, Verdict
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.errors import redact_text
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import (
    AttemptOutcome,
    ContractChanged,
    ExportLedger,
    ExportState,
    redact_url,
)
from export_ledger.ledger.errors import LiveLease
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
    ledger = ExportLedger(sqlite_url)  # the wall clock, as the CLI reads it
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
    ledger = ExportLedger(url)
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
    ledger = ExportLedger(sqlite_url, clock=clock)
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
    (attempt,) = ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.attempts(ACME)
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
    attempts = ExportLedger(postgres_url).queries.attempts(ACME)
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
    ledger = ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    assert ledger.queries.get(ACME).state is ExportState.REMOTE_UNKNOWN, (
        "published, so never `failed` (nothing published)"
    )

    result = tick(defs, instance)
    assert ledger.queries.get(ACME).state is ExportState.COMPLETED, "reconciliation records it from the manifest"
    assert [e.partition for e in result.materializations] == [PARTITION]


# -- also: contracts, rerun keys, fenced rows ------------------------------------------------------------------------


@pytest.mark.postgres
def test_two_first_materializations_with_different_contracts_record_only_one(postgres_url):
    ledgers = [ExportLedger(postgres_url) for _ in range(2)]
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

    ledger = ExportLedger(sqlite_url, clock=clock)
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

    ledger = ExportLedger(sqlite_url, clock=clock)
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
    ledger = ExportLedger(sqlite_url, clock=clock)
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
