"""Deadlines: "yesterday's export of each tenant is due at 06:00 in the tenant's zone". A key not completed by then
(never attempted included) is late, escalated like a stuck one, named per tenant in its own zone, and the asset
carries Dagster's freshness policy."""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pytest
from builders import key_for
from pipeline_helpers import check_evaluations, make_defs, run_partition, tick

from export_ledger import ConfigurationError, ExportSpec, cli
from export_ledger.dagster import declared_exports
from export_ledger.deadlines import due_at, late_keys, with_late
from resources.invoices import SampleInvoiceSource

UTC = dt.UTC
TENANTS = {"acme": "America/New_York", "bombay": "Asia/Kolkata"}
DAY = dt.date(2026, 3, 9)
COLUMNS = {"invoice_id": "string", "tenant": "string", "occurred_at": "timestamp", "amount": "float",
           "currency": "string", "customer_email": "string"}  # fmt: skip


def orders(deadline: str | None = "06:00", **overrides) -> ExportSpec:
    fields = dict(
        name="orders",
        source=SampleInvoiceSource(),
        columns=COLUMNS,
        id_columns=["invoice_id"],
        time_column="occurred_at",
        tenant_column="tenant",
        tenants=TENANTS,
        timezone="America/New_York",
        start_date="2026-03-01",
        deadline=deadline,
    )  # fmt: skip
    fields.update(overrides)
    return ExportSpec(**fields)


@pytest.mark.parametrize(
    ("deadline", "schedule_time", "message"),
    [
        ("6am", "04:30", "deadline must be HH:MM"),
        ("00:00", None, "deadline 00:00 is the window's own end"),
        ("04:00", "04:30", "deadline 04:00 is not after the nightly run at 04:30"),
        ("02:30", None, "deadline 02:30 in America/New_York"),  # skipped on the day clocks go forward
    ],
)
def test_a_deadline_that_cannot_be_met_or_does_not_exist_is_refused_by_name(deadline, schedule_time, message):
    with pytest.raises(ConfigurationError, match=message):
        orders(deadline, schedule_time=schedule_time)


def test_each_tenant_is_due_in_its_own_zone_the_morning_after_its_date():
    spec = orders()
    assert due_at(spec, "acme", DAY) == dt.datetime(2026, 3, 10, 10, 0, tzinfo=UTC), "06:00 EDT"
    assert due_at(spec, "bombay", DAY) == dt.datetime(2026, 3, 10, 0, 30, tzinfo=UTC), "06:00 IST"
    assert due_at(orders(None), "acme", DAY) is None


def test_a_key_not_completed_by_its_deadline_is_late_even_never_attempted(clocked_ledger, clock):
    spec, ledger = orders(), clocked_ledger.get_ledger()
    clock.now = dt.datetime(2026, 3, 10, 9, 0, tzinfo=UTC)  # after Bombay's 06:00, before New York's
    late = {e.tenant: e for e in late_keys(ledger, [spec], lookback_days=1)}
    # Each tenant's latest date already due, in its own zone: Bombay's 03-09, New York's 03-08 (03-09 not yet due).
    assert {t: (e.business_date, e.state) for t, e in late.items()} == {
        "acme": (DAY - dt.timedelta(days=1), "late"),
        "bombay": (DAY, "late"),
    }
    assert "due at 06:00 Asia/Kolkata on 2026-03-10, and never attempted" in late["bombay"].why

    clock.now = dt.datetime(2026, 3, 10, 10, 0, tzinfo=UTC)  # New York's deadline: exactly due is due
    claim = ledger.claims.claim(key_for(DAY, export="orders", tenant="acme"), "run-1/orders")
    ledger.completions.fail(claim, RuntimeError("source down"))
    late = {e.tenant: e for e in late_keys(ledger, [spec], lookback_days=1)}
    assert late["acme"].business_date == DAY and "and failed" in late["acme"].why, "now due, and failed"


def test_a_key_both_late_and_escalated_counts_once_beside_the_ledgers_escalations(clocked_ledger, clock):
    """Guard: ``late_keys(beside=...)``. A key whose reruns are spent and whose deadline passed is the ledger's
    escalation (its reason, its way out); counted as late too, ``no_stuck_exports`` said 2 keys for 1."""
    spec, ledger = orders(), clocked_ledger.get_ledger()
    clock.now = dt.datetime(2026, 3, 10, 10, 0, tzinfo=UTC)  # both tenants' 03-09 are due
    key = key_for(DAY, export="orders", tenant="acme")
    for attempt in range(3):
        claim = ledger.claims.claim(key, f"run-{attempt}/orders")
        ledger.completions.fail(claim, RuntimeError("source down"))
    rules = (dt.timedelta(hours=6), 3)
    escalated = {e.logical_key for e in ledger.attention.needs_attention(rules[0], max_attempts=rules[1])}
    assert str(key) in escalated, "its reruns are spent: the ledger escalates it"

    late = late_keys(ledger, [spec], lookback_days=1, beside=rules)

    assert str(key) not in {e.logical_key for e in late} and {e.tenant for e in late} == {"bombay"}
    assert str(key) in {e.logical_key for e in late_keys(ledger, [spec], lookback_days=1)}, "alone, it is late"


def test_no_stuck_exports_counts_a_key_both_late_and_escalated_once(clocked_ledger, clock):
    """Guard: ``stuck_evaluation`` passes the ledger's rules to ``late_keys(beside=...)`` (the sensor's verdict is
    built the same way). Without them, the key whose reruns are spent was counted twice."""
    from export_ledger.dagster.checks import stuck_evaluation

    spec, ledger = orders(tenants={"acme": "America/New_York"}), clocked_ledger.get_ledger()
    clock.now = dt.datetime(2026, 3, 10, 10, 0, tzinfo=UTC)
    key = key_for(DAY, export="orders", tenant="acme")
    for attempt in range(3):
        claim = ledger.claims.claim(key, f"run-{attempt}/orders")
        ledger.completions.fail(claim, RuntimeError("source down"))
    late_dates = {e.business_date for e in late_keys(ledger, [spec])}
    assert DAY in late_dates, "acme's key of 03-09 is late, and escalated by the ledger too"

    verdict = stuck_evaluation(spec, ledger, "orders", stuck_after=dt.timedelta(hours=6), max_attempts=3)

    assert verdict.metadata["stuck_keys"].value == len(late_dates), "each late date once, the failed one included"


def test_the_sensor_escalates_late_keys_and_the_partition_says_late(tmp_path, instance, clocked_ledger, clock):
    clock.now = dt.datetime(2026, 3, 10, 12, 0, tzinfo=UTC)  # past both deadlines of 2026-03-09
    defs = make_defs(tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger, deadline="06:00")
    asset = defs.get_assets_def("invoice_export")
    policy = asset.specs_by_key[dg.AssetKey("invoice_export")].freshness_policy
    assert (policy.deadline_cron, policy.timezone) == ("0 6 * * *", "America/New_York")

    first = tick(defs, instance)
    (stuck,) = [e for e in first.result.asset_events if e.check_name == "no_stuck_exports"]
    assert not stuck.passed and stuck.metadata["stuck_keys"].value >= 2, "both tenants' keys of 03-09 are late"
    assert any("late: due at 06:00" in r.getMessage() for r in first.logs), "logged as needing a person"

    assert run_partition(defs, instance, "2026-03-09").success  # exported late: no longer late
    specs = declared_exports(defs)
    assert not [e for e in late_keys(clocked_ledger.get_ledger(), specs) if e.business_date == DAY]
    late = late_keys(clocked_ledger.get_ledger(), specs)
    assert sorted({(e.tenant, e.business_date.isoformat()) for e in late}) == [
        ("acme", "2026-03-07"), ("acme", "2026-03-08"), ("globex", "2026-03-07"), ("globex", "2026-03-08"),
    ], "the two dates before it, never attempted, are still late"  # fmt: skip
    health = check_evaluations(run_partition(defs, instance, "2026-03-08"), "partition_health")
    assert health["2026-03-08"].passed, "completed keys are on time, or were"


def test_status_needs_attention_lists_late_keys_from_the_code_location(tmp_path, capsys, clocked_ledger, monkeypatch):
    location = tmp_path / "shop.py"
    location.write_text(
        "from export_ledger import ExportSpec\n"
        "from export_ledger.dagster import ledgered_definitions\n"
        "from resources.invoices import SampleInvoiceSource\n"
        f"spec = ExportSpec(name='orders', source=SampleInvoiceSource(), columns={COLUMNS!r},"
        " id_columns=['invoice_id'], time_column='occurred_at', tenant_column='tenant',"
        f" tenants={TENANTS!r}, timezone='America/New_York',"
        " start_date='2026-03-01', deadline='06:00')\n"
        f"defs = ledgered_definitions([spec], environ={{'EXPORTS_LEDGER_URL': {clocked_ledger.url!r}, "
        f"'EXPORTS_DESTINATION': {str(tmp_path)!r}}})\n"
    )
    clocked_ledger.get_ledger()  # the ledger file exists
    code = cli.main(["--ledger-url", clocked_ledger.url, "status", "--needs-attention", "-f", str(location)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "orders/bombay/" in out and "never attempted" in out and "late" in out


def test_a_tick_with_ten_late_keys_or_more_still_succeeds_and_names_ten(tmp_path, instance, clocked_ledger, clock):
    """Ten late keys fill the log line's ten places: the page of other escalated keys is not read. It was read with
    a limit of 0, which the ledger refuses, so the tick failed, every tick, once ten keys were late."""
    clock.now = dt.datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
    defs = make_defs(tmp_path, tenants=["acme", "globex", "initech", "umbrella"], ledger=clocked_ledger,
                     deadline="06:00")  # fmt: skip
    assert len(late_keys(clocked_ledger.get_ledger(), declared_exports(defs))) >= 10
    first = tick(defs, instance)
    (stuck,) = [e for e in first.result.asset_events if e.check_name == "no_stuck_exports"]
    assert not stuck.passed and stuck.metadata["stuck_keys"].value >= 10
    (line,) = [r.getMessage() for r in first.logs if "need attention" in r.getMessage()]
    assert line.count("late: due at 06:00") == 10, line


def test_late_keys_come_first_and_a_key_both_late_and_escalated_is_listed_once_with_the_ledgers_reason():
    """:func:`with_late`, shared by the CLI, the reconciliation sensor and ``no_stuck_exports``. Guard: a plain
    concatenation lists the failed key twice."""
    from export_ledger.ledger import Escalation

    def escalation(key: str, why: str) -> Escalation:
        return Escalation("orders", key, "UTC", f"orders/{key}/2026-03-08T00:00:00Z", "failed", None, why, None, None)

    late = [escalation("acme", "late"), escalation("globex", "late")]
    escalated = [escalation("globex", "failed 3 times"), escalation("initech", "conflict")]

    listed = with_late(late, escalated, limit=10)

    assert [(e.tenant, e.why) for e in listed] == [
        ("acme", "late"), ("globex", "failed 3 times"), ("initech", "conflict"),
    ]  # fmt: skip
    assert [e.tenant for e in with_late(late, escalated, limit=2)] == ["acme", "globex"]
