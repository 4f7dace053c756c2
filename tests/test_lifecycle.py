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


def test_prune_deletes_only_old_completed_records_and_keeps_a_low_water_mark(aged_ledger, clock):
    horizon = clock.now.date() - dt.timedelta(days=63)  # 2026-01-05
    deleted = aged_ledger.prune(63)

    assert deleted == {"invoice_export": 4}, "2026-01-01..04 are completed and older than the horizon"
    assert aged_ledger.low_water("invoice_export") == horizon
    remaining = aged_ledger.records()
    assert min(r.business_date for r in remaining if r.state is ExportState.COMPLETED) == horizon
    failed = [r for r in remaining if r.state is ExportState.FAILED]
    assert [r.business_date for r in failed] == [dt.date(2026, 1, 2)], "other states are never pruned"
    assert all(aged_ledger.attempts(r.logical_key) for r in remaining), "kept keys keep their history"


def test_a_first_claim_below_the_low_water_mark_is_refused_unless_overridden(aged_ledger, ledger_url, clock):
    aged_ledger.prune(63)
    pruned_key = LogicalKey("invoice_export", "globex", window_for(dt.date(2026, 1, 3), "America/New_York"))
    with pytest.raises(BelowLowWater, match=r"below the retention low-water mark of invoice_export \(2026-01-05\)"):
        aged_ledger.claim(pruned_key, "late-retry/invoice_export")
    assert aged_ledger.get(str(pruned_key)) is None, "a refused claim leaves no row behind"

    failed_key = LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 1, 2), "America/New_York"))
    assert aged_ledger.claim(failed_key, "retry/invoice_export").fencing_token == 2, (
        "a key that still has its record (never completed) may be retried below the mark"
    )

    override = ExportLedger(ledger_url, clock=clock, allow_below_low_water=True)
    assert override.claim(pruned_key, "operator/invoice_export").fencing_token == 1


def test_the_low_water_mark_never_moves_back(aged_ledger, clock):
    aged_ledger.prune(63)
    aged_ledger.prune(90)
    assert aged_ledger.low_water("invoice_export") == dt.date(2026, 1, 5)


def test_prune_from_the_cli_reports_counts_and_the_mark(tmp_path, sqlite_url, clock, capsys):
    ledger = ExportLedger(sqlite_url)
    _complete(ledger, dt.date(2020, 1, 1))
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "30"]) == 0
    out = capsys.readouterr().out
    assert "invoice_export" in out and "1" in out
    assert ledger.records() == []
    assert cli.main(["--ledger-url", sqlite_url, "prune", "--older-than", "-3"]) == 2
    assert "invalid number of days '-3'" in capsys.readouterr().err


def test_a_materialization_under_a_changed_timezone_is_refused_until_accepted(tmp_path, instance, monkeypatch, capsys):
    new_york = make_defs(tmp_path)
    assert run_partition(new_york, instance, "2026-03-08").success
    assert ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").recorded_contract("invoice_export") == (
        ExportCalendar("America/New_York", "2026-01-01").contract()
    )

    chicago = make_defs(tmp_path, timezone="America/Chicago")
    refused = run_partition(chicago, instance, "2026-03-09")
    assert not refused.success
    message = failure_message(refused)
    assert "the calendar contract of invoice_export changed" in message
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
