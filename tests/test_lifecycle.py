"""Lifecycle rules: retention with a durable low-water mark, and the calendar contract guard."""

from __future__ import annotations

import datetime as dt

import pytest
from pipeline_helpers import failure_message, make_defs, published_dirs, run_partition

from export_ledger import cli
from export_ledger.calendar import ExportCalendar, window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import BelowLowWater, CompletionEvidence, ContractChanged, ExportLedger
from export_ledger.ledger.schema import ExportState

UTC = dt.timezone.utc


def _complete(ledger: ExportLedger, day: dt.date, tenant: str = "acme") -> None:
    key = LogicalKey("invoice_export", tenant, window_for(day, "America/New_York"))
    claim = ledger.claim(key, f"run-{day}/invoice_export")
    ledger.complete(claim, CompletionEvidence(f"/exports/{day}", "ab" * 32, 96, claim.attempt_id, claim.fencing_token))


def _fail(ledger: ExportLedger, day: dt.date) -> None:
    key = LogicalKey("invoice_export", "acme", window_for(day, "America/New_York"))
    ledger.fail(ledger.claim(key, f"run-{day}/invoice_export"), RuntimeError("source down"))


@pytest.fixture
def aged_ledger(ledger_url, clock):
    """Completed keys on 2026-01-01..2026-01-10 and one failed key on 2026-01-02, seen from 2026-03-09."""
    ledger = ExportLedger(ledger_url, clock=clock)
    for offset in range(10):
        _complete(ledger, dt.date(2026, 1, 1) + dt.timedelta(days=offset), tenant="globex")
    _fail(ledger, dt.date(2026, 1, 2))
    return ledger


def test_prune_deletes_only_old_completed_records_and_stops_the_mark_at_a_key_not_completed(aged_ledger, clock):
    (plan,) = aged_ledger.prune(63)  # horizon 2026-01-05; acme's 2026-01-02 is failed

    assert (plan.horizon, plan.blocked_by, plan.mark) == (dt.date(2026, 1, 5), dt.date(2026, 1, 2), dt.date(2026, 1, 2))
    assert plan.pruned == 1, "only 2026-01-01 lies below a mark that may not pass the failed key"
    assert aged_ledger.low_water("invoice_export") == dt.date(2026, 1, 2)
    remaining = aged_ledger.records()
    failed = [r for r in remaining if r.state is ExportState.FAILED]
    assert [r.business_date for r in failed] == [dt.date(2026, 1, 2)], "other states are never pruned"
    assert all(aged_ledger.attempts(r.logical_key) for r in remaining), "kept keys keep their history"

    _complete(aged_ledger, dt.date(2026, 1, 2))  # the failed key is exported after all
    (plan,) = aged_ledger.prune(63)
    assert (plan.mark, plan.pruned) == (dt.date(2026, 1, 5), 4), "now the mark reaches the horizon"


def test_a_first_claim_below_the_low_water_mark_is_refused_unless_overridden(aged_ledger, ledger_url, clock):
    aged_ledger.prune(63)
    pruned_key = LogicalKey("invoice_export", "globex", window_for(dt.date(2026, 1, 1), "America/New_York"))
    with pytest.raises(BelowLowWater, match=r"below the retention low-water mark of invoice_export \(2026-01-02\)"):
        aged_ledger.claim(pruned_key, "late-retry/invoice_export")
    assert aged_ledger.get(str(pruned_key)) is None, "a refused claim leaves no row behind"

    failed_key = LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 1, 2), "America/New_York"))
    assert aged_ledger.claim(failed_key, "retry/invoice_export").fencing_token == 2, "a key not completed stays open"

    override = ExportLedger(ledger_url, clock=clock, allow_below_low_water=True)
    assert override.claim(pruned_key, "operator/invoice_export").fencing_token == 1


def test_the_low_water_mark_never_moves_back(aged_ledger, clock):
    aged_ledger.prune(63)
    aged_ledger.prune(90)
    assert aged_ledger.low_water("invoice_export") == dt.date(2026, 1, 2)


def test_prune_older_than_0_never_closes_tonights_key_that_was_never_exported(ledger_url, clock):
    # Defect: the mark went to today, and tonight's key for yesterday (no record yet) was refused as BelowLowWater.
    ledger = ExportLedger(ledger_url, clock=clock)  # now: 2026-03-09 09:30 UTC
    ledger.check_contract("invoice_export", ExportCalendar("America/New_York", "2026-03-01").contract())
    for day in range(1, 8):  # 2026-03-01..07 exported; 2026-03-08 (last night's) not yet
        _complete(ledger, dt.date(2026, 3, day))

    (plan,) = ledger.prune_plan(0)
    assert plan.unexported == [dt.date(2026, 3, 8)] and plan.mark == dt.date(2026, 3, 8)
    assert ledger.low_water("invoice_export") is None, "a plan changes nothing"
    ledger.prune(0)
    assert ledger.low_water("invoice_export") == dt.date(2026, 3, 8)
    tonight = LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 3, 8), "America/New_York"))
    assert ledger.claim(tonight, "nightly/invoice_export").fencing_token == 1, "tonight's key is still exported"

    with pytest.raises(ValueError, match="needs an operator and a reason"):
        ledger.prune(0, close_unexported=True)


def test_closing_dates_never_exported_is_explicit_and_recorded(ledger_url, clock):
    ledger = ExportLedger(ledger_url, clock=clock)
    ledger.check_contract("invoice_export", ExportCalendar("America/New_York", "2026-03-01").contract())
    _complete(ledger, dt.date(2026, 3, 1))
    (plan,) = ledger.prune(2, close_unexported=True, operator="ops@host", reason="those days had no sales at all")
    assert plan.mark == dt.date(2026, 3, 7) and plan.unexported[0] == dt.date(2026, 3, 2)
    (entry,) = ledger.operator_log()
    assert (entry["operator"], entry["action"]) == ("ops@host", "prune-close-unexported")
    assert "2026-03-02" in entry["detail"] and entry["reason"] == "those days had no sales at all"


def test_prune_from_the_cli_shows_the_plan_and_changes_nothing_without_yes(tmp_path, sqlite_url, clock, capsys):
    ledger = ExportLedger(sqlite_url)
    _complete(ledger, dt.date(2020, 1, 1))
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "30"]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing changed" in out and "invoice_export" in out
    assert len(ledger.records()) == 1, "without --yes nothing is deleted"
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "30", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "invoice_export" in out and "dry run" not in out
    assert ledger.records() == []
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "-3"]) == 2
    assert "invalid number of days '-3'" in capsys.readouterr().err
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "3", "--close-unexported"]) == 2
    assert "--close-unexported needs --reason" in capsys.readouterr().err


def test_a_materialization_under_a_changed_timezone_is_refused_until_accepted(tmp_path, instance, monkeypatch, capsys):
    new_york = make_defs(tmp_path)
    assert run_partition(new_york, instance, "2026-03-08").success
    assert ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").contract_in_force("invoice_export", "acme") == (
        ExportCalendar("America/New_York", "2026-01-01").contract()
    ), "each tenant's contract is recorded at its first materialization"

    chicago = make_defs(tmp_path, timezone="America/Chicago")
    refused = run_partition(chicago, instance, "2026-03-09")
    assert not refused.success
    message = failure_message(refused)
    assert "the calendar contract of invoice_export for tenant acme changed" in message
    assert '"timezone": "America/New_York"' in message and '"timezone": "America/Chicago"' in message
    assert "export-ledger accept-contract" in message
    assert [f.name for f in published_dirs(tmp_path / "exports")] == ["date=2026-03-08"], "nothing new published"

    # The operator accepts the code's contract: the CLI reads it from the code location.
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    contract = ExportCalendar("America/Chicago", "2026-01-01").contract()
    ExportLedger(ledger_url).accept_contract("invoice_export", contract, "moved the business to Chicago")
    assert run_partition(chicago, instance, "2026-03-09").success
    history = ExportLedger(ledger_url).contract_history("invoice_export")
    assert [h["reason"] for h in history] == ["first materialization", "moved the business to Chicago"]


def test_accept_contract_from_the_cli_records_the_code_contract_and_reason(sqlite_url, monkeypatch, capsys):
    ledger = ExportLedger(sqlite_url)
    code_contract = ExportCalendar("America/New_York", "2026-01-01").contract()
    ledger.check_contract("invoice_export", {**code_contract, "timezone": "Europe/Dublin"})  # recorded first
    with pytest.raises(ContractChanged, match="Europe/Dublin"):
        ledger.check_contract("invoice_export", code_contract)

    accept = ["--ledger-url", sqlite_url, "accept-contract", "--export", "invoice_export"]
    accept += ["--timezone", "America/New_York", "--start-date", "2026-01-01"]
    assert cli.main([*accept, "--reason", "zone fixed in code"]) == 0
    assert "accepted for invoice_export" in capsys.readouterr().out
    assert ledger.recorded_contract("invoice_export") == code_contract
    ledger.check_contract("invoice_export", code_contract)  # no longer refused
    assert ledger.contract_history("invoice_export")[-1]["reason"] == "zone fixed in code"
    assert cli.main([*accept, "--reason", "  "]) == 2
