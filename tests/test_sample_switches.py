"""The sample source's two switches, so that a newcomer sees each partition status from the UI (issue 27, item 6):
``EXPORTS_SAMPLE_OUTAGE=tenant@date`` makes one tenant's reads of one business date fail as a real source's outage
would, and ``EXPORTS_SAMPLE_VOIDED=date`` voids each tenant's last invoice of a date after the fact, which drift
detection finds. Bad values refuse to load, naming the setting."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import dagster as dg
import pytest
from builders import open_ledger
from pipeline_helpers import run_partition, tick

from definitions import build_definitions
from export_ledger import ConfigurationError, SourceError
from export_ledger.ledger import ExportState
from resources.invoices import SampleInvoiceSource

TENANTS = "acme,globex,initech"


def _environ(tmp_path, **settings: str) -> dict[str, str]:
    return {
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": str(tmp_path / "exports"),
        "EXPORTS_TENANTS": TENANTS,
        "EXPORTS_SOURCE": "sample",
        "EXPORTS_SAMPLE_CADENCE_MINUTES": "120",
        **settings,
    }


def _states(tmp_path, day: str) -> dict[str, ExportState]:
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    date = dt.date.fromisoformat(day)
    return {r.tenant: r.state for r in ledger.queries.records(date_from=date, date_to=date)}


def _window(zone: str, day: dt.date) -> tuple[dt.datetime, dt.datetime]:
    start = dt.datetime.combine(day, dt.time(), ZoneInfo(zone))
    end = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), ZoneInfo(zone))
    return start.astimezone(dt.timezone.utc), end.astimezone(dt.timezone.utc)


def test_an_outage_fails_one_tenant_on_one_date_and_exports_the_others(tmp_path, instance):
    defs = build_definitions(environ=_environ(tmp_path, EXPORTS_SAMPLE_OUTAGE="globex@2026-03-08"))

    failed = run_partition(defs, instance, "2026-03-08")
    passed = run_partition(defs, instance, "2026-03-09")

    assert not failed.success and passed.success
    assert _states(tmp_path, "2026-03-08") == {
        "acme": ExportState.COMPLETED,
        "globex": ExportState.FAILED,
        "initech": ExportState.COMPLETED,
    }
    assert set(_states(tmp_path, "2026-03-09").values()) == {ExportState.COMPLETED}, "the outage is of one date"
    key = dg.AssetCheckKey(dg.AssetKey("invoice_export"), "partition_health")
    shown = {
        record.partition: record.event.dagster_event.event_specific_data.description
        for record in instance.event_log_storage.get_asset_check_execution_history(key, 10)
    }
    assert shown == {"2026-03-08": "failed: 1 of 3 tenants (globex)", "2026-03-09": "healthy: 3 of 3 tenants exported"}


def test_a_voided_date_reads_one_invoice_fewer_per_tenant_and_drift_finds_it(tmp_path, instance):
    day = dt.datetime.now(ZoneInfo("America/New_York")).date() - dt.timedelta(days=2)  # inside drift's lookback
    assert run_partition(build_definitions(environ=_environ(tmp_path)), instance, day.isoformat()).success

    defs = build_definitions(environ=_environ(tmp_path, EXPORTS_SAMPLE_VOIDED=day.isoformat()))
    tick(defs, instance, sensor_name="drift_sensor")  # the sensor finds drift; the check reports what it found
    key = dg.AssetCheckKey(dg.AssetKey("invoice_export"), "source_unchanged")
    job = defs.resolve_implicit_global_asset_job_def().get_subset(asset_check_selection={key}, asset_selection=set())
    (evaluation,) = job.execute_in_process(instance=instance).get_asset_check_evaluations()

    assert not evaluation.passed, evaluation.description
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    opened = ledger.drift.open_records(export="invoice_export")
    assert sorted((d.tenant, d.business_date, d.rows_removed, d.rows_added) for d in opened) == [
        (tenant, day, 1, 0) for tenant in TENANTS.split(",")
    ]


@pytest.mark.parametrize(
    "zone",
    ["America/New_York", "Asia/Kolkata", "Pacific/Pago_Pago", "Pacific/Apia", "Pacific/Kiritimati", "Etc/GMT+12"],
)
def test_a_switch_names_the_business_date_in_each_tenants_own_zone(tmp_path, zone):
    """Resolved in each tenant's calendar: a tenant at UTC+13 or +14 (the reference examples' Apia) or at UTC-12 is
    down, or voided, on the date named, never on the day before or after it."""
    day = dt.date(2026, 3, 8)
    source = SampleInvoiceSource(cadence_minutes=60)
    build_definitions(
        tenants={"acme": zone, "globex": zone},
        source=source,
        environ=_environ(tmp_path, EXPORTS_SAMPLE_OUTAGE="acme@2026-03-08", EXPORTS_SAMPLE_VOIDED="2026-03-08"),
    )
    full = SampleInvoiceSource(cadence_minutes=60)

    with pytest.raises(SourceError, match="EXPORTS_SAMPLE_OUTAGE"):
        source.rows("acme", *_window(zone, day))
    assert len(source.rows("globex", *_window(zone, day))) == full.count("globex", *_window(zone, day)) - 1
    assert source.count("globex", *_window(zone, day)) == full.count("globex", *_window(zone, day)) - 1
    for other in (day - dt.timedelta(days=1), day + dt.timedelta(days=1)):
        assert len(source.rows("acme", *_window(zone, other))) == full.count("acme", *_window(zone, other))
    assert source.identity() == full.identity(), "the switches are the sample's data, never its contract"


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"EXPORTS_SAMPLE_OUTAGE": "globex"}, "EXPORTS_SAMPLE_OUTAGE: entry 1 is not tenant@YYYY-MM-DD"),
        (
            {"EXPORTS_SAMPLE_OUTAGE": "acme@2026-03-08,globex@2026-02-30"},
            "EXPORTS_SAMPLE_OUTAGE: entry 2 is not a date",
        ),
        (
            {"EXPORTS_SAMPLE_OUTAGE": "hooli@2026-03-08"},
            "entry 1 names a tenant not among the tenants (acme, globex, initech)",
        ),
        ({"EXPORTS_SAMPLE_OUTAGE": "globex@"}, "EXPORTS_SAMPLE_OUTAGE: entry 1 is not tenant@YYYY-MM-DD"),
        ({"EXPORTS_SAMPLE_OUTAGE": "@2026-03-08"}, "EXPORTS_SAMPLE_OUTAGE: entry 1 is not tenant@YYYY-MM-DD"),
        ({"EXPORTS_SAMPLE_VOIDED": "yesterday"}, "EXPORTS_SAMPLE_VOIDED: entry 1 is not a date"),
        ({"EXPORTS_SAMPLE_VOIDED": "20260308"}, "EXPORTS_SAMPLE_VOIDED: entry 1 is not a date (YYYY-MM-DD)"),
        ({"EXPORTS_SAMPLE_VOIDED": "2025-12-31"}, "2025-12-31 is before the export's first business date (2026-01-01)"),
        ({"EXPORTS_SAMPLE_OUTAGE": "acme@9999-12-31"}, "9999-12-31 is out of the calendar's range"),
        (
            {"EXPORTS_SOURCE": "", "EXPORTS_SAMPLE_VOIDED": "2026-03-08", "EXPORTS_SOURCE_URL": "sqlite://"},
            "EXPORTS_SAMPLE_VOIDED applies to the sample source only",
        ),
    ],
)
def test_a_bad_switch_refuses_to_load_naming_it(tmp_path, settings, expected):
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path, **settings))
    assert expected in str(refused.value)
    assert not (tmp_path / "ledger.sqlite3").exists(), "nothing was written"


@pytest.mark.parametrize(
    ("setting", "text"),
    [
        ("EXPORTS_SAMPLE_VOIDED", "postgresql://u:hunter2-canary@db/billing"),
        ("EXPORTS_SAMPLE_OUTAGE", "postgresql://u:hunter2-canary@db/billing"),
        ("EXPORTS_SAMPLE_OUTAGE", "hunter2canary@2026-03-08"),
        ("EXPORTS_SAMPLE_OUTAGE", "acme@hunter2-canary"),
    ],
)
def test_a_bad_switch_is_refused_naming_the_setting_and_the_entrys_position_never_its_text(tmp_path, setting, text):
    """A URL pasted into a switch may carry a password, and a run's failure (the switch given as run config) is read
    by whoever sees the run: the entry is named by its position."""
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path, **{setting: text}))
    assert setting in str(refused.value) and "entry" in str(refused.value), str(refused.value)
    assert "hunter2" not in str(refused.value), str(refused.value)
