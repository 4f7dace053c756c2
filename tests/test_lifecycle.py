"""Lifecycle rules: retention with a durable low-water mark, and the calendar contract guard."""

from __future__ import annotations

import datetime as dt

import pytest
from builders import evidence_for, key_for, open_ledger
from pipeline_helpers import failure_message, make_defs, published_dirs, run_partition

from export_ledger import cli
from export_ledger.calendar import ExportCalendar, ZoneMove, utc_iso, window_for
from export_ledger.contract import calendar_of
from export_ledger.keys import LogicalKey
from export_ledger.ledger import BelowLowWater, CompletionEvidence, ContractChanged, ExportLedger, RestatementRefused
from export_ledger.ledger.schema import ExportState
from export_ledger.tenants import Tenant

UTC = dt.timezone.utc
NY = "America/New_York"


def _complete(ledger: ExportLedger, day: dt.date, tenant: str = "acme") -> None:
    key = LogicalKey("invoice_export", tenant, window_for(day, "America/New_York"))
    claim = ledger.claims.claim(key, f"run-{day}/invoice_export")
    evidence = CompletionEvidence(f"/exports/{day}", "ab" * 32, 96, claim.attempt_id, claim.fencing_token)
    ledger.completions.complete(claim, evidence)


def _fail(ledger: ExportLedger, day: dt.date, tenant: str = "acme") -> None:
    key = LogicalKey("invoice_export", tenant, window_for(day, "America/New_York"))
    ledger.completions.fail(ledger.claims.claim(key, f"run-{day}/invoice_export"), RuntimeError("source down"))


#: From the clock's 2026-03-20 (09:30 UTC: the 20th in New York too), this many days back is 2026-01-05.
TO_JAN_5 = 74


@pytest.fixture
def aged_ledger(ledger_url, clock):
    """Globex's keys completed on 2026-01-01..2026-01-10; acme's from 2026-01-02 on, its first one failed. Seen
    from 2026-03-20, so that ``prune(TO_JAN_5)`` has its horizon on 2026-01-05."""
    ledger = open_ledger(ledger_url, clock=clock)
    for offset in range(10):
        _complete(ledger, dt.date(2026, 1, 1) + dt.timedelta(days=offset), tenant="globex")
    _fail(ledger, dt.date(2026, 1, 2))
    for offset in range(2, 10):  # acme is expected from its first key on: its other days are exported
        _complete(ledger, dt.date(2026, 1, 1) + dt.timedelta(days=offset))
    return ledger


def test_prune_deletes_only_old_completed_records_and_stops_the_mark_at_a_key_not_completed(aged_ledger, clock):
    (plan,) = aged_ledger.retention.prune(TO_JAN_5)  # horizon 2026-01-05; acme's 2026-01-02 is failed

    assert (plan.horizon, plan.blocked_by, plan.mark) == (dt.date(2026, 1, 5), dt.date(2026, 1, 2), dt.date(2026, 1, 2))
    assert plan.pruned == 1, "only 2026-01-01 lies below a mark that may not pass the failed key"
    assert aged_ledger.retention.low_water("invoice_export") == dt.date(2026, 1, 2)
    remaining = aged_ledger.queries.records()
    failed = [r for r in remaining if r.state is ExportState.FAILED]
    assert [r.business_date for r in failed] == [dt.date(2026, 1, 2)], "other states are never pruned"
    assert all(aged_ledger.queries.attempts(r.logical_key) for r in remaining), "kept keys keep their history"

    _complete(aged_ledger, dt.date(2026, 1, 2))  # the failed key is exported after all
    (plan,) = aged_ledger.retention.prune(TO_JAN_5)
    assert (plan.mark, plan.pruned) == (dt.date(2026, 1, 5), 6), (
        "now the mark reaches the horizon: both tenants' 2026-01-02..04 are pruned"
    )


def test_a_first_claim_below_the_low_water_mark_is_refused_unless_overridden(aged_ledger, ledger_url, clock):
    aged_ledger.retention.prune(TO_JAN_5)
    pruned_key = LogicalKey("invoice_export", "globex", window_for(dt.date(2026, 1, 1), "America/New_York"))
    with pytest.raises(BelowLowWater, match=r"below the retention low-water mark of invoice_export \(2026-01-02\)"):
        aged_ledger.claims.claim(pruned_key, "late-retry/invoice_export")
    assert aged_ledger.queries.get(str(pruned_key)) is None, "a refused claim leaves no row behind"

    failed_key = LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 1, 2), "America/New_York"))
    retry = aged_ledger.claims.claim(failed_key, "retry/invoice_export")
    assert retry.fencing_token == 2, "a key not completed stays open"

    override = open_ledger(ledger_url, clock=clock, allow_below_low_water=True)
    assert override.claims.claim(pruned_key, "operator/invoice_export").fencing_token == 1


def test_a_restatement_of_an_unknown_key_says_it_was_pruned_only_when_its_date_is_surely_before_the_mark(
    sqlite_url, clock
):
    """The refusal reads the key's date from its window start (the key does not name its zone): a Tokyo key on the
    mark date itself starts the day before in UTC. It must not be told its date was pruned (the review, issue 26)."""
    ledger = open_ledger(sqlite_url, clock=clock)
    for day in range(1, 7):
        key = LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 1, day), "Asia/Tokyo"))
        claim = ledger.claims.claim(key, f"run-{day}/invoice_export")
        ledger.completions.complete(claim, CompletionEvidence(f"/exports/{day}", "ab" * 32, 9, claim.attempt_id, 1))
    (plan,) = ledger.retention.prune(TO_JAN_5)
    assert (plan.mark, plan.pruned) == (dt.date(2026, 1, 5), 4)

    on_the_mark = LogicalKey("invoice_export", "globex", window_for(dt.date(2026, 1, 5), "Asia/Tokyo"))
    with pytest.raises(RestatementRefused) as refused:
        ledger.restatements.request(str(on_the_mark), reason="late invoices", requested_by="ops")
    message = str(refused.value)
    assert f"unknown logical key '{on_the_mark}'" in message and "2026-01-04T15:00:00Z" in message, message
    assert "of those dates" not in message and "never exported, or pruned" in message, (
        f"a key that may be on the mark date is not said to be of a pruned date: {message}"
    )

    pruned = LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 1, 3), "Asia/Tokyo"))
    surely = r"business dates before the retention low-water mark of invoice_export \(2026-01-05\) were pruned: a "
    with pytest.raises(RestatementRefused, match=surely + "restatement of a key of those dates"):
        ledger.restatements.request(str(pruned), reason="late invoices", requested_by="ops")


def test_the_low_water_mark_never_moves_back(aged_ledger, clock):
    aged_ledger.retention.prune(TO_JAN_5)
    aged_ledger.retention.prune(TO_JAN_5 + 27)  # a horizon before the mark
    assert aged_ledger.retention.low_water("invoice_export") == dt.date(2026, 1, 2)


def test_prune_older_than_0_never_closes_tonights_key_that_was_never_exported(ledger_url, clock):
    # Defect: the mark went to today, and tonight's key for yesterday (no record yet) was refused as BelowLowWater.
    ledger = open_ledger(ledger_url, clock=clock)  # now: 2026-03-20 09:30 UTC, 05:30 in New York
    ledger.contracts.check({("invoice_export", "acme"): ExportCalendar("America/New_York", "2026-03-01").contract()})
    for day in range(1, 19):  # 2026-03-01..18 exported; 2026-03-19 (last night's) not yet
        _complete(ledger, dt.date(2026, 3, day))

    (plan,) = ledger.retention.plan(0)
    assert plan.unexported == [dt.date(2026, 3, 19)] and plan.mark == dt.date(2026, 3, 19)
    assert ledger.retention.low_water("invoice_export") is None, "a plan changes nothing"
    ledger.retention.prune(0)
    assert ledger.retention.low_water("invoice_export") == dt.date(2026, 3, 19)
    tonight = LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 3, 19), "America/New_York"))
    assert ledger.claims.claim(tonight, "nightly/invoice_export").fencing_token == 1, "tonight's key is still exported"

    with pytest.raises(ValueError, match="needs an operator and a reason"):
        ledger.retention.prune(0, close_unexported=True)


def test_closing_dates_never_exported_is_explicit_and_recorded(ledger_url, clock):
    ledger = open_ledger(ledger_url, clock=clock)  # 2026-03-20: 13 days back is 2026-03-07
    ledger.contracts.check({("invoice_export", "acme"): ExportCalendar("America/New_York", "2026-03-01").contract()})
    _complete(ledger, dt.date(2026, 3, 1))
    (plan,) = ledger.retention.prune(
        13, close_unexported=True, operator="ops@host", reason="those days had no sales at all"
    )
    assert plan.mark == dt.date(2026, 3, 7) and plan.unexported[0] == dt.date(2026, 3, 2)
    (entry,) = ledger.operators.entries()
    assert (entry["operator"], entry["action"]) == ("ops@host", "prune-close-unexported")
    assert "2026-03-02" in entry["detail"] and entry["reason"] == "those days had no sales at all"


def test_a_date_one_tenant_never_exported_stops_the_mark_although_another_tenant_exported_it(ledger_url, clock):
    # Issue 18 (8): a date counted as keyed when any tenant had a key on it, so globex's 2026-03-03 was closed.
    ledger = open_ledger(ledger_url, clock=clock)  # 2026-03-20: 13 days back is 2026-03-07
    contract = ExportCalendar("America/New_York", "2026-03-01").contract()
    ledger.contracts.check({("invoice_export", tenant): contract for tenant in ("acme", "globex")})
    for day in (1, 2, 3, 4, 5):
        _complete(ledger, dt.date(2026, 3, day))
        if day != 3:
            _complete(ledger, dt.date(2026, 3, day), tenant="globex")

    (plan,) = ledger.retention.prune(13)

    assert plan.unexported[0] == dt.date(2026, 3, 3), "a date is exported only once every expected tenant has a key"
    assert (plan.mark, plan.pruned) == (dt.date(2026, 3, 3), 4), "the mark stops at globex's missing date"
    missed = LogicalKey("invoice_export", "globex", window_for(dt.date(2026, 3, 3), "America/New_York"))
    assert ledger.claims.claim(missed, "nightly/invoice_export").fencing_token == 1, "globex's date is still exported"


def test_the_prune_horizon_is_the_earliest_local_date_among_the_tenants_zones(ledger_url, clock):
    # Issue 18 (8): the horizon was a UTC date; 2026-03-20 09:30 UTC is still 2026-03-19 in Honolulu.
    ledger = open_ledger(ledger_url, clock=clock)
    ledger.contracts.check(
        {
            ("invoice_export", "acme"): ExportCalendar("Asia/Tokyo", "2026-03-01").contract(),  # 18:30 on the 20th
            ("invoice_export", "globex"): ExportCalendar("Pacific/Honolulu", "2026-03-01").contract(),  # 23:30, 19th
        }
    )

    (plan,) = ledger.retention.plan(0, export="invoice_export")

    assert plan.horizon == dt.date(2026, 3, 19), "a date is past only once it is past for every tenant"


def test_prune_from_the_cli_shows_the_plan_and_changes_nothing_without_yes(tmp_path, sqlite_url, clock, capsys):
    ledger = open_ledger(sqlite_url)
    _complete(ledger, dt.date(2020, 1, 1))
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "30"]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing changed" in out and "invoice_export" in out
    assert len(ledger.queries.records()) == 1, "without --yes nothing is deleted"
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "30", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "invoice_export" in out and "dry run" not in out
    assert ledger.queries.records() == []
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "-3"]) == 2
    assert "invalid number of days '-3'" in capsys.readouterr().err
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "3", "--close-unexported"]) == 2
    assert "--close-unexported needs --reason" in capsys.readouterr().err


def test_a_materialization_under_a_changed_timezone_is_refused_until_accepted(tmp_path, instance, monkeypatch, capsys):
    new_york = make_defs(tmp_path)
    assert run_partition(new_york, instance, "2026-03-08").success
    recorded = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").contracts.in_force("invoice_export", "acme")
    assert calendar_of(recorded) == ExportCalendar("America/New_York", "2026-01-01").contract(), (
        "each tenant's contract is recorded at its first materialization"
    )
    assert recorded["terms"]["destination"] == {"kind": "local", "root": str((tmp_path / "exports").resolve())}, (
        "with the destination, format, schema and source it was exported with"
    )

    chicago = make_defs(tmp_path, timezone="America/Chicago")
    refused = run_partition(chicago, instance, "2026-03-09")
    assert not refused.success
    message = failure_message(refused)
    assert "the calendar contract of invoice_export for tenant acme changed" in message
    assert "zone America/New_York -> America/Chicago" in message, "the refusal says what changed"
    assert "export-ledger accept-contract" in message
    assert [f.name for f in published_dirs(tmp_path / "exports")] == ["date=2026-03-08"], "nothing new published"

    # A zone changed without saying when cannot be accepted: it would put 2026-03-08, exported in New York, in Chicago
    # (a second key of that day, sharing its folder). The refusal names the move to declare.
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    ledger = open_ledger(ledger_url)
    undeclared = ExportCalendar("America/Chicago", "2026-01-01").contract()
    with pytest.raises(ContractChanged, match="2026-03-08 in America/New_York.*--move 2026-03-09:America/New_York"):
        ledger.contracts.accept("invoice_export", undeclared, "moved the business to Chicago", tenant="acme")

    # The code declares the move, the operator accepts that contract, and the day after the move runs in Chicago.
    move = ZoneMove(on="2026-03-09", from_zone="America/New_York")
    moved = make_defs(tmp_path, tenants=[Tenant("acme", "America/Chicago", moves=(move,))])
    contract = ExportCalendar("America/Chicago", "2026-01-01", (move,)).contract()
    ledger.contracts.accept("invoice_export", contract, "moved the business to Chicago", tenant="acme")
    job = moved.resolve_job_def("invoice_export__america_chicago_job")
    assert job.execute_in_process(partition_key="2026-03-09", instance=instance, raise_on_error=False).success
    history = ledger.contracts.history("invoice_export")
    assert [h["reason"] for h in history] == ["first claim", "moved the business to Chicago"], (
        "the contract is recorded at the tenant's first claim, then changed only by the operator's acceptance"
    )


def test_accept_contract_from_the_cli_records_the_code_contract_and_reason(sqlite_url, clock, monkeypatch, capsys):
    ledger = open_ledger(sqlite_url, clock=clock)
    code_contract = ExportCalendar("America/New_York", "2026-01-01").contract()
    first, second = (
        LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 3, day), "America/New_York")) for day in (7, 8)
    )
    dublin = {**code_contract, "timezone": "Europe/Dublin"}
    ledger.claims.claim(first, "run-1/invoice_export", contract=dublin)  # recorded at the tenant's first claim
    with pytest.raises(ContractChanged, match="Europe/Dublin"):
        ledger.claims.claim(second, "run-2/invoice_export", contract=code_contract)
    assert ledger.queries.get(str(second)) is None, "a claim under another contract is refused before any row"

    export_wide = ["--ledger-url", sqlite_url, "accept-contract", "--export", "invoice_export"]
    export_wide += ["--timezone", "America/New_York", "--start-date", "2026-01-01", "--reason", "zone fixed in code"]
    assert cli.main(export_wide) == 2, "an export-wide acceptance over a tenant in another zone is refused"
    assert "accept per tenant with --tenant" in capsys.readouterr().err

    accept = ["--ledger-url", sqlite_url, "accept-contract", "--export", "invoice_export", "--tenant", "acme"]
    accept += ["--timezone", "America/New_York", "--start-date", "2026-01-01"]
    assert cli.main([*accept, "--reason", "zone fixed in code"]) == 0
    assert "accepted for invoice_export, tenant acme" in capsys.readouterr().out
    assert ledger.contracts.in_force("invoice_export", "acme") == code_contract
    assert ledger.contracts.check({("invoice_export", "acme"): code_contract}) == {}, "no longer refused"
    assert ledger.claims.claim(second, "run-3/invoice_export", contract=code_contract).fencing_token == 1
    assert ledger.contracts.history("invoice_export")[-1]["reason"] == "zone fixed in code"
    assert cli.main([*accept, "--reason", "  "]) == 2


# -- prune never closes a date a tenant never exported -----------------------------------------------------------------


def test_prune_never_closes_a_date_that_one_tenant_never_exported(sqlite_url, clock):
    """Item 8: the low-water mark counts a date as keyed if any tenant has a key on it. `prune` must not close a
    business date that a tenant of the export never exported: that tenant's first claim would be refused for good.
    (v2: tenants' contracts are recorded at their first claim; there is no separate check_contracts.)
    Fails on 0.4.0 (07f55b3): prune mark 2026-03-03 closes globex's unexported 03-02 (BelowLowWater)."""
    book = open_ledger(sqlite_url, clock=clock)
    contract = ExportCalendar(NY, "2026-03-01").contract()
    done = [(dt.date(2026, 3, 1), "acme"), (dt.date(2026, 3, 1), "globex"), (dt.date(2026, 3, 2), "acme")]
    for day, tenant in done:  # globex never exported 2026-03-02 (its run failed before any claim, say)
        claim = book.claims.claim(key_for(day, tenant=tenant), f"run-{day}/invoice_export", contract=contract)
        book.completions.complete(claim, evidence_for(claim))
    code = cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "30", "--yes"])  # the host's clock: December
    mark = book.retention.low_water("invoice_export")
    late = key_for(dt.date(2026, 3, 2), tenant="globex")
    try:
        outcome = type(book.claims.claim(late, "late-run/invoice_export", contract=contract)).__name__
    except BelowLowWater:
        outcome = "BelowLowWater (refused)"
    observed = {"prune exit code": code, "low-water mark": mark.isoformat() if mark else None, "globex 03-02": outcome}
    assert code == 0 and mark == dt.date(2026, 3, 2), f"prune closed 03-01, which every tenant exported: {observed}"
    assert observed["globex 03-02"] == "Claim", observed


def test_prune_with_close_unexported_never_closes_a_date_whose_window_has_not_ended_in_the_tenants_zone(
    sqlite_url, clock
):
    """Item 8 (its horizon is a UTC date): at 2026-03-09T09:30Z Honolulu's 2026-03-08 still runs until 10:00Z.
    `prune --older-than 0 --close-unexported` closes dates before the UTC date 2026-03-09, so tonight's run of
    2026-03-08 is refused. A date whose window has not ended in the tenant's zone must never be closed. (The test
    clock starts at 2026-03-20 in v2's suite: it is set back to the issue's 2026-03-09T09:30Z.)
    Fails on 0.4.0 (07f55b3): a UTC-date horizon closing a Honolulu day not over."""
    clock.now = dt.datetime(2026, 3, 9, 9, 30, tzinfo=UTC)
    book = open_ledger(sqlite_url, clock=clock)
    zone = "Pacific/Honolulu"
    contract = ExportCalendar(zone, "2026-03-07").contract()
    claim = book.claims.claim(key_for(dt.date(2026, 3, 7), tenant="hono", timezone=zone), "run-1/invoice_export",
                              contract=contract)  # fmt: skip
    book.completions.complete(claim, evidence_for(claim))
    book.retention.prune(0, close_unexported=True, operator="ops", reason="close the gaps")
    today = key_for(dt.date(2026, 3, 8), tenant="hono", timezone=zone)
    clock.now = today.window.end_utc + dt.timedelta(minutes=30)  # the nightly run, after the window ended
    try:
        outcome = type(book.claims.claim(today, "nightly/invoice_export", contract=contract)).__name__
    except BelowLowWater:
        outcome = "BelowLowWater (refused)"
    mark = book.retention.low_water("invoice_export")
    observed = {
        "window of 2026-03-08": f"{utc_iso(today.window.start_utc)} .. {utc_iso(today.window.end_utc)}",
        "low-water mark": mark.isoformat() if mark else None,
        "nightly claim": outcome,
    }
    assert observed["nightly claim"] == "Claim", observed
