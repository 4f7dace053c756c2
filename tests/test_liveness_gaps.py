"""Liveness, bounds and privacy gaps found by the review of protocol v2 (0.5.0), each a test that failed before its
fix: every key asked for ends exported or escalated with a way out, a tick survives any one key, a page of the CLI
shows what it says, and no refusal names a customer's values.

The guard each test pins is named in its docstring; removing it makes the test fail.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import evidence_for, key_for
from pipeline_helpers import make_defs, run_partition, run_range, tick

from definitions import build_definitions
from export_ledger import Tenant, cli
from export_ledger.calendar import ExportCalendar, ZoneMove
from export_ledger.dagster.sensors import RELAUNCH_TAG
from export_ledger.destinations import LocalDestination
from export_ledger.frames import ExportSchema
from export_ledger.ledger import ContractChanged, ExportLedger, ExportState
from export_ledger.ledger.contracts import Contracts
from export_ledger.protocol import ExportItem, ExportOutcomeUnknown, export_key
from resources.invoices import SampleInvoiceSource

STUCK_AFTER = dt.timedelta(hours=6)
LEDGER_DOWN = "postgresql+psycopg2://postgres@127.0.0.1:1/test"  # nothing listens on port 1


def _execute(defs: dg.Definitions, instance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """Runs a sensor's request in process, as the daemon would launch it (same job, partition and tags)."""
    return defs.resolve_job_def(request.job_name).execute_in_process(
        partition_key=request.partition_key, instance=instance, tags=request.tags, raise_on_error=False
    )


def _ledger(tmp_path) -> ExportLedger:
    return ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")


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
    ledger = ExportLedger(postgres_url)
    ny = ExportCalendar("America/New_York", "2026-01-01").contract()
    chicago = ExportCalendar("America/Chicago", "2026-01-01", (ZoneMove("2026-03-02", "America/New_York"),)).contract()
    ledger.claims.claim(key_for(dt.date(2026, 3, 1), tenant="globex"), "r0/x", contract=ny)
    operator = ExportLedger(postgres_url)
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
    ledger = ExportLedger(sqlite_url, clock=clock)
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
    _conflicts(ExportLedger(sqlite_url), 12)
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
    ledger = ExportLedger(url)
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
    ledger = ExportLedger(sqlite_url, lease_ttl=dt.timedelta(seconds=1))
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
    ledger = ExportLedger(sqlite_url, clock=clock)
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
    ledger = ExportLedger(postgres_url)
    ledger.completions.mark_conflict(ledger.claims.claim(key_for(tenant="acme"), "r1/x"), RuntimeError("x"))
    other = ExportLedger(postgres_url)
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
