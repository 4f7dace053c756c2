"""Tenants in their own timezones: each tenant's windows tile UTC in its zone (and across a move), one asset, job and
schedule per zone, every sample event exported exactly once, and the calendar contract guarded per tenant."""

from __future__ import annotations

import datetime as dt
import doctest
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from builders import open_ledger
from pipeline_helpers import failure_message, published_dirs, read_export
from pipeline_helpers import run_range as run_dates  # (defs, instance, first, last); run_range below is per asset

import export_ledger.calendar
import export_ledger.tenants
from assets.invoices import INVOICE_COLUMNS
from definitions import build_definitions
from export_ledger import cli
from export_ledger.calendar import ExportCalendar, ZoneMove, utc_iso, window_for
from export_ledger.contract import calendar_of
from export_ledger.dagster import LedgerResource, ledgered_definitions
from export_ledger.errors import ConfigurationError
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ExportState
from export_ledger.spec import ExportSpec
from export_ledger.tenants import Tenant, zone_slug
from resources.invoices import SampleInvoiceSource

THREE_ZONES = {"acme": "America/New_York", "bombay-traders": "Asia/Kolkata", "apia-foods": "Pacific/Apia"}
NY = "America/New_York"
ASSETS = {
    "America/New_York": "invoice_export",
    "Asia/Kolkata": "invoice_export__asia_kolkata",
    "Pacific/Apia": "invoice_export__pacific_apia",
}
HOUR = dt.timedelta(hours=1)
PROJECT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.filterwarnings("ignore:Starting in dagster 1.11, get_schedule_def:UserWarning")


def zone_defs(tmp_path: Path, tenants, start_date: str = "2011-12-01") -> dg.Definitions:
    return build_definitions(
        tenants=tenants,
        start_date=start_date,
        ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        destination=str(tmp_path / "exports"),
        source=SampleInvoiceSource(cadence_minutes=60),
        environ={},
    )


def run_range(defs: dg.Definitions, asset: str, instance, first: str, last: str) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def(f"{asset}_job").execute_in_process(
        instance=instance,
        raise_on_error=False,
        tags={"dagster/asset_partition_range_start": first, "dagster/asset_partition_range_end": last},
    )


def run_partition(defs: dg.Definitions, asset: str, instance, partition: str) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def(f"{asset}_job").execute_in_process(
        partition_key=partition, instance=instance, raise_on_error=False
    )


def test_the_calendar_and_tenant_examples_hold():
    for module in (export_ledger.calendar, export_ledger.tenants):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, f"{module.__name__}: {result}"


@pytest.mark.parametrize(
    ("tenant", "first", "last"),
    [
        (Tenant("acme", "America/New_York"), "2011-12-01", "2013-01-31"),
        (Tenant("bombay", "Asia/Kolkata"), "2011-12-01", "2013-01-31"),
        (Tenant("apia", "Pacific/Apia"), "2011-12-01", "2013-01-31"),  # with the skipped 2011-12-30
        (Tenant("west", "America/Chicago", moves=(ZoneMove("2026-03-10", "America/New_York"),)), "2026-01-01",
         "2026-12-31"),  # fmt: skip
        (Tenant("east", "Asia/Kolkata", moves=(ZoneMove("2026-06-01", "Pacific/Honolulu"),)), "2026-01-01",
         "2026-12-31"),  # fmt: skip
        (
            Tenant(
                "twice",
                "Europe/London",
                moves=(ZoneMove("2026-03-01", "Pacific/Apia"), ZoneMove("2026-10-25", "America/Los_Angeles")),
            ),
            "2026-01-01",
            "2026-12-31",
        ),
    ],
    ids=lambda v: v.id if isinstance(v, Tenant) else v,
)
def test_each_tenants_windows_tile_utc_in_its_own_zone(tenant, first, last):
    spec = ExportSpec(
        name="x", columns={"id": "string", "at": "timestamp"}, id_columns=["id"], time_column="at",
        tenants=[tenant], timezone="America/New_York", start_date=first, source=lambda *_: None, schedule_time=None,
    )  # fmt: skip
    calendar = spec.calendar_for(tenant.id)
    windows = calendar.windows(dt.date.fromisoformat(first), dt.date.fromisoformat(last))
    for before, after in zip(windows, windows[1:], strict=False):
        assert before.end_utc == after.start_utc, f"{tenant.id}: a gap or overlap between {before} and {after}"
        assert after.business_date == before.business_date + dt.timedelta(days=1)
    for window in windows:
        assert window.timezone == calendar.zone_on(window.business_date)
        assert window.end_utc >= window.start_utc
        if window.timezone == tenant.timezone and not tenant.moves:
            assert window == window_for(window.business_date, tenant.timezone), "without moves: the zone's own day"


def test_a_move_changes_only_the_day_of_the_move():
    moved = ExportCalendar("America/Chicago", "2026-01-01", (ZoneMove("2026-03-10", "America/New_York"),))
    assert moved.window("2026-03-09") == window_for(dt.date(2026, 3, 9), "America/New_York"), "the last old day stays"
    move_day = moved.window("2026-03-10")
    assert move_day.start_utc == window_for(dt.date(2026, 3, 10), "America/New_York").start_utc
    assert move_day.end_utc == window_for(dt.date(2026, 3, 11), "America/Chicago").start_utc
    assert move_day.duration == 25 * HOUR and move_day.timezone == "America/Chicago"
    assert moved.window("2026-03-11") == window_for(dt.date(2026, 3, 11), "America/Chicago")

    east = ExportCalendar("Asia/Kolkata", "2026-01-01", (ZoneMove("2026-06-01", "Pacific/Honolulu"),))
    assert east.window("2026-06-01").duration == dt.timedelta(hours=8, minutes=30), "moving east shortens the day"
    with pytest.raises(Exception, match="more than a day apart"):
        ExportCalendar("Pacific/Kiritimati", "2026-01-01", (ZoneMove("2026-06-01", "Etc/GMT+12"),)).window(
            "2026-06-01"
        )


def test_tenant_declarations_are_checked_with_messages_that_name_the_problem():
    def spec(tenants, **kwargs):
        return ExportSpec(
            name="x", columns={"id": "string", "at": "timestamp"}, id_columns=["id"], time_column="at",
            tenants=tenants, timezone="America/New_York", start_date="2026-01-01", source=lambda *_: None, **kwargs,
        )  # fmt: skip

    with pytest.raises(Exception, match="unknown timezone 'Mars/Olympus'"):
        spec({"acme": "Mars/Olympus"})
    with pytest.raises(ConfigurationError, match="share one nightly run.*acme at 04:30, globex at 06:00"):
        spec([Tenant("acme", "Asia/Kolkata"), Tenant("globex", "Asia/Kolkata", schedule_time="06:00")])
    with pytest.raises(Exception, match="schedule time 02:30 does not occur exactly once"):
        spec([Tenant("acme", "Europe/Berlin", schedule_time="02:30")])
    with pytest.raises(ConfigurationError, match="the ids must match"):
        spec({"acme": Tenant("globex")})
    with pytest.raises(Exception, match="must come after the start date"):
        spec([Tenant("acme", "America/Chicago", moves=(ZoneMove("2025-06-01", "America/New_York"),))])
    with pytest.raises(ConfigurationError, match="one zone"):
        ExportSpec(
            name="x", columns={"id": "string", "at": "timestamp", "t": "string"}, id_columns=["id"],
            time_column="at", tenant_column="t", tenants={"a": "Asia/Kolkata", "b": "America/New_York"},
            timezone="America/New_York", start_date="2026-01-01",
        )  # fmt: skip
    mixed = spec([Tenant("acme"), Tenant("bombay", "Asia/Kolkata", schedule_time="06:00")])
    assert [(g.asset_name, g.schedule_time, g.tenants) for g in mixed.groups] == [
        ("x", "04:30", ("acme",)),
        ("x__asia_kolkata", "06:00", ("bombay",)),
    ]
    assert zone_slug("Etc/GMT+5") == "etc_gmt_plus_5"
    assert zone_slug("America/Port-au-Prince") == "america_port_au_prince"


def _exported_rows(root: Path, tenant: str) -> pd.DataFrame:
    """Every row readers of the tenant's key folders see (each pointer's place), with its manifest's date and zone."""
    frames = []
    for folder in published_dirs(root / "invoice_export" / f"tenant={tenant}"):
        manifest, frame = read_export(folder)
        frame["business_date"] = manifest.business_date
        frame["manifest_timezone"] = manifest.timezone
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


# Each zone's clock changes inside these ranges: Apia skipped 2011-12-30 and left DST on 2012-04-01, New York began
# DST on 2012-03-11 and ended it on 2012-11-04; Kolkata (+05:30) has no change, only its half-hour offset.
RANGES = [("2011-12-26", "2012-01-02"), ("2012-03-08", "2012-03-14"), ("2012-03-29", "2012-04-04")]


def test_three_zone_code_location_exports_every_sample_event_exactly_once(tmp_path, instance, capsys):
    defs = zone_defs(tmp_path, THREE_ZONES)
    assert sorted(a.key.to_user_string() for a in defs.assets) == sorted(ASSETS.values()), "one asset per zone"
    source = SampleInvoiceSource(cadence_minutes=60)
    for asset in ASSETS.values():
        for first, last in RANGES:
            assert run_range(defs, asset, instance, first, last).success, f"{asset} {first}..{last}"
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    for tenant, zone in THREE_ZONES.items():
        rows = _exported_rows(tmp_path / "exports", tenant)
        assert rows["invoice_id"].is_unique, f"{tenant}: an event exported twice"
        assert set(rows["manifest_timezone"]) == {zone}, "the manifest names the tenant's zone"
        occurred = pd.to_datetime(rows["occurred_at"], utc=True)
        for first, last in RANGES:
            start = window_for(dt.date.fromisoformat(first), zone).start_utc
            end = window_for(dt.date.fromisoformat(last), zone).end_utc
            inside = (occurred >= start) & (occurred < end)
            assert inside.sum() == source.count(tenant, start, end), f"{tenant} {first}..{last}: an event missing"
        for business_date, group in rows.groupby("business_date"):
            window = window_for(dt.date.fromisoformat(business_date), zone)
            times = pd.to_datetime(group["occurred_at"], utc=True)
            assert ((times >= window.start_utc) & (times < window.end_utc)).all(), f"{tenant} {business_date}"
        records = ledger.queries.records(export="invoice_export", tenant=tenant)
        assert {r.timezone for r in records} == {zone} and all(r.state is ExportState.COMPLETED for r in records)
        assert all(r.tz_database for r in records), "each window is persisted with the tz database it came from"
    apia = {r.business_date for r in ledger.queries.records(export="invoice_export", tenant="apia-foods")}
    assert dt.date(2011, 12, 30) not in apia, "the day Apia skipped has no key"
    kolkata = ledger.queries.records(export="invoice_export", tenant="bombay-traders", date_from=dt.date(2012, 3, 8))[0]
    assert utc_iso(kolkata.window_start_utc) == "2012-03-07T18:30:00Z"
    new_york = ledger.queries.records(export="invoice_export", tenant="acme", date_from=dt.date(2012, 3, 11))[0]
    assert new_york.window_end_utc - new_york.window_start_utc == 23 * HOUR

    # The status command shows each tenant's zone.
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    assert cli.main(["--ledger-url", url, "status", "--export", "invoice_export", "--from", "2012-03-08",
                     "--to", "2012-03-08", "--json"]) == 0  # fmt: skip
    shown = {row["tenant"]: row["timezone"] for row in json.loads(capsys.readouterr().out)}
    assert shown == THREE_ZONES


def _requests_at(schedule: dg.ScheduleDefinition, instance, tick: dt.datetime) -> list[str]:
    result = schedule(dg.build_schedule_context(instance=instance, scheduled_execution_time=tick))
    requests = [result] if isinstance(result, dg.RunRequest) else list(result or [])
    return [r.partition_key for r in requests if isinstance(r, dg.RunRequest)]


@pytest.mark.parametrize(
    ("zone", "first"),
    [("America/New_York", "2026-03-05"), ("America/New_York", "2026-10-29"), ("Asia/Kolkata", "2026-03-05"),
     ("Pacific/Apia", "2012-03-28")],  # fmt: skip
)
def test_each_zone_schedule_fires_at_its_local_time_for_its_previous_day(tmp_path, instance, zone, first):
    defs = zone_defs(tmp_path, THREE_ZONES)
    schedule = defs.get_schedule_def(f"nightly_{ASSETS[zone]}")
    assert schedule.execution_timezone == zone
    minute, hour, *_ = schedule.cron_schedule.split()
    assert (int(hour), int(minute)) == (4, 30)
    for offset in range(8):  # a week around a clock change of the zone (or none: Kolkata)
        day = dt.date.fromisoformat(first) + dt.timedelta(days=offset)
        tick = dt.datetime.combine(day, dt.time(4, 30), tzinfo=export_ledger.calendar.load_zone(zone))
        assert _requests_at(schedule, instance, tick.astimezone(dt.timezone.utc)) == [
            (day - dt.timedelta(days=1)).isoformat()
        ], f"{zone} tick at {tick.isoformat()}"


def test_a_zone_change_is_refused_for_that_tenant_alone_until_accepted(tmp_path, instance, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    before = zone_defs(tmp_path, {"acme": "America/New_York", "globex": "America/New_York"}, "2026-01-01")
    assert run_partition(before, "invoice_export", instance, "2026-03-08").success

    # acme moves to Chicago from 2026-03-10; initech is new, in Chicago from the start. acme's days before the move
    # stay New York's: its 2026-03-09 is in the New York asset, beside globex.
    moved = Tenant("acme", "America/Chicago", moves=(ZoneMove("2026-03-10", "America/New_York"),))
    after = zone_defs(tmp_path, [moved, Tenant("globex"), Tenant("initech", "America/Chicago")], "2026-01-01")
    refused = run_partition(after, "invoice_export", instance, "2026-03-09")
    assert not refused.success, "acme's claim is refused by its unaccepted contract, which fails the run"
    message = failure_message(refused)
    assert "the calendar contract of invoice_export for tenant acme changed" in message
    command = 'export-ledger accept-contract --export invoice_export --tenant acme --reason "..."'
    assert command in message, "the failure names the command that accepts the change"
    assert "zone America/New_York -> America/Chicago" in message, "and says what changed"
    ledger = open_ledger(url)
    assert ledger.queries.records(export="invoice_export", tenant="acme", date_from=dt.date(2026, 3, 9)) == []
    globex = ledger.queries.records(export="invoice_export", tenant="globex", date_from=dt.date(2026, 3, 9))
    assert [r.state for r in globex] == [ExportState.COMPLETED], "the other tenant of the run was still exported"
    refused_again = run_partition(after, "invoice_export__america_chicago", instance, "2026-03-10")
    assert not refused_again.success and command in failure_message(refused_again), "acme's new zone too"
    initech = ledger.queries.records(export="invoice_export", tenant="initech")
    assert [r.state for r in initech] == [ExportState.COMPLETED], "the other tenant of the new zone was exported"

    accept = ["--ledger-url", url, "accept-contract", "--export", "invoice_export", "--tenant", "acme"]
    accept += ["--timezone", "America/Chicago", "--start-date", "2026-01-01", "--reason", "acme moved to Chicago"]
    assert cli.main([*accept, "--move", "2026-03-08:America/New_York"]) == 1
    assert "already has 2026-03-08 in America/New_York" in capsys.readouterr().err, "exported days are not re-cut"
    assert cli.main([*accept, "--move", "2026-03-10:America/New_York"]) == 0
    assert "accepted for invoice_export, tenant acme" in capsys.readouterr().out

    assert run_partition(after, "invoice_export", instance, "2026-03-09").success, "acme's last New York day"
    for day in ("2026-03-10", "2026-03-11"):
        assert run_partition(after, "invoice_export__america_chicago", instance, day).success, day
    acme = ledger.queries.records(export="invoice_export", tenant="acme")
    assert [(r.business_date.isoformat(), r.timezone) for r in acme] == [
        ("2026-03-08", "America/New_York"),
        ("2026-03-09", "America/New_York"),
        ("2026-03-10", "America/Chicago"),
        ("2026-03-11", "America/Chicago"),
    ]
    for before_key, after_key in zip(acme, acme[1:], strict=False):
        assert before_key.window_end_utc == after_key.window_start_utc, "no event in two windows or in none"
    assert acme[2].window_end_utc - acme[2].window_start_utc == 25 * HOUR
    assert ledger.contracts.in_force("invoice_export", "globex")["timezone"] == "America/New_York"


def test_the_reconciliation_sensor_reruns_a_failed_key_through_its_zones_job(tmp_path):
    from export_ledger.dagster import sensors

    defs_spec = ExportSpec(
        name="invoice_export", columns={"invoice_id": "string", "occurred_at": "timestamp"},
        id_columns=["invoice_id"], time_column="occurred_at", tenants=THREE_ZONES, timezone="America/New_York",
        start_date="2026-01-01", source=lambda *_: None,
    )  # fmt: skip
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    window = defs_spec.calendar_for("bombay-traders").window("2026-03-08")
    claim = ledger.claims.claim(LogicalKey("invoice_export", "bombay-traders", window), "run-1/step")
    ledger.completions.fail(claim, RuntimeError("source timed out"))
    failed = ledger.attention.failed_partitions(max_attempts=3, limit=10, exports=["invoice_export"])
    requests = sensors.rerun_requests(
        failed, {"invoice_export": defs_spec}, max_attempts=3, log=logging.getLogger("test")
    )
    assert [(r.job_name, r.partition_key) for r in requests] == [("invoice_export__asia_kolkata_job", "2026-03-08")]
    (work,) = failed
    assert requests[0].run_key == f"rerun/invoice_export__asia_kolkata/2026-03-08/{work.digest}", (
        "one run per partition of the zone's asset, keyed by the partition's failed keys"
    )


def test_a_thousand_tenants_in_forty_zones_make_forty_assets(tmp_path):
    zones = sorted(z for z in export_ledger.calendar.known_zones() if z.startswith(("America/", "Europe/", "Asia/")))
    chosen = [z for z in zones if not z.startswith("America/Argentina")][:40]
    tenants = {f"t{i:04d}": chosen[i % 40] for i in range(1000)}
    defs = zone_defs(tmp_path, tenants, "2026-01-01")
    assert len(defs.assets) == 40
    health = sorted(j.name.endswith("_health_job") for j in defs.jobs)
    assert health == [False] * 40 + [True] * 40, "a job and a health job per zone"
    assert len({s.name for s in defs.schedules}) == 40


def _docs_zones_example() -> str:
    page = (PROJECT / "docs" / "tenants.md").read_text()
    return re.search(r"```python\n(.*?)```", page, re.S).group(1)


def test_the_docs_three_zone_example_is_the_example_file():
    assert _docs_zones_example() == (PROJECT / "examples" / "three_zones.py").read_text()


@pytest.mark.process
def test_the_three_zone_example_loads_in_dagster_as_the_readme_says(tmp_path):
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path),
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": str(tmp_path / "exports"),
    }
    dagster = str(Path(sys.executable).with_name("dagster"))
    done = subprocess.run(
        [dagster, "definitions", "validate", "-f", "examples/three_zones.py"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Validation successful for code location three_zones.py" in done.stderr + done.stdout


def test_a_downstream_asset_loads_the_committed_exports_of_its_zones_tenants(tmp_path, instance):
    from assets.invoices import invoice_export
    from export_ledger.dagster import ledgered_definitions

    seen = {}

    @dg.asset(
        partitions_def=dg.DailyPartitionsDefinition(start_date="2026-01-01", timezone="Asia/Kolkata"),
        ins={"rows": dg.AssetIn(key="invoice_export__asia_kolkata")},
    )
    def kolkata_totals(rows: pd.DataFrame) -> None:
        seen["tenants"] = sorted(set(rows["tenant"]))
        seen["rows"] = len(rows)

    spec = invoice_export(
        source=SampleInvoiceSource(cadence_minutes=60),
        tenants={"acme": "America/New_York", "bombay-traders": "Asia/Kolkata", "delhi-mills": "Asia/Kolkata"},
        timezone="America/New_York",
        start_date="2026-01-01",
    )
    defs = ledgered_definitions(
        [spec],
        assets=[kolkata_totals],
        ledger=None,
        destination=str(tmp_path / "exports"),
        environ={"EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}"},
    )
    assert run_partition(defs, "invoice_export__asia_kolkata", instance, "2026-03-08").success
    downstream = dg.Definitions.merge(
        defs, dg.Definitions(jobs=[dg.define_asset_job("totals", selection=["kolkata_totals"])])
    )
    result = downstream.resolve_job_def("totals").execute_in_process(partition_key="2026-03-08", instance=instance)
    assert result.success
    assert seen == {"tenants": ["bombay-traders", "delhi-mills"], "rows": 48}, "the zone's tenants only, 24 h each"


def test_contracts_per_tenant_upgrade_from_an_export_wide_contract(sqlite_url, capsys):
    ledger = open_ledger(sqlite_url)
    new_york = ExportCalendar("America/New_York", "2026-01-01").contract()
    kolkata = ExportCalendar("Asia/Kolkata", "2026-01-01").contract()
    # What release 0.2.0 recorded: one contract for the whole export (today an export-wide acceptance).
    ledger.contracts.accept("invoice_export", new_york, "first materialization")
    window = window_for(dt.date(2026, 3, 8), "America/New_York")
    claim = ledger.claims.claim(LogicalKey("invoice_export", "acme", window), "run-1/step")
    ledger.completions.fail(claim, RuntimeError("stopped"))  # acme has history under the export-wide contract

    acme, bombay = ("invoice_export", "acme"), ("invoice_export", "bombay")
    refused = ledger.contracts.check({acme: new_york, bombay: kolkata})
    assert refused == {}, "acme matches the export-wide contract; bombay is new, so nothing to protect"
    assert ledger.contracts.in_force("invoice_export", "bombay") == kolkata
    assert ledger.contracts.in_force("invoice_export", "acme") == new_york
    refused = ledger.contracts.check({acme: kolkata, bombay: kolkata})
    assert list(refused) == [acme], "a tenant with keys is refused a new zone; the other tenant runs"
    assert "accept-contract --export invoice_export --tenant acme" in str(refused[acme])
    assert "declare the move in code" in str(refused[acme])

    url_args = ["--ledger-url", sqlite_url, "accept-contract", "--export", "invoice_export"]
    args = [*url_args, "--timezone", "America/New_York", "--start-date", "2026-02-01", "--reason", "later start"]
    assert cli.main(args) == 2
    assert "tenants in other zones than America/New_York (bombay): accept per tenant with --tenant" in (
        capsys.readouterr().err
    )
    assert cli.main([*url_args, "--tenant", "acme", *args[len(url_args):]]) == 0  # fmt: skip
    assert ledger.contracts.in_force("invoice_export", "acme")["start_date"] == "2026-02-01"
    assert ledger.contracts.in_force("invoice_export", "bombay") == kolkata, "the other tenant is untouched"


# -- a tenant's zone typo ----------------------------------------------------------------------------------------------


def test_a_tenant_zone_typo_is_refused_naming_the_tenant_the_zone_and_the_nearest_zone(tmp_path):
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(
            tenants={"globex": "Europe/Dublin", "acme": "America/New_Yrok"},
            ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
            destination=str(tmp_path / "exports"),
            environ={"EXPORTS_SOURCE": "sample"},
        )
    message = str(refused.value)
    assert "tenant 'acme'" in message and "'America/New_Yrok'" in message, message
    assert "did you mean 'America/New_York'" in message, message
    assert "globex" not in message, "only the tenant whose zone is wrong is named"


# -- a window is never exported before it ends -------------------------------------------------------------------------


def test_a_key_is_never_claimed_before_its_window_ends_for_a_tenant_that_will_move_east(
    tmp_path, instance, clock, clocked_ledger
):
    """Item 5: a tenant moving from Honolulu to Kiritimati on 2026-04-01. The nightly tick for 2026-03-08 of the
    Kiritimati asset comes at 04:30 Kiritimati (2026-03-08T14:30Z) while the tenant's Honolulu window ends at
    2026-03-09T10:00Z. No key may be claimed before its window has ended by the ledger's clock, whatever Dagster's
    partition set says. (v2 groups tenants by zone per date, so the tenant's 2026-03-08 is the Honolulu asset's:
    both assets' 2026-03-08 runs are made at 14:30Z, the Honolulu one as a manual launch Dagster allows.)
    Fails on 0.4.0 (07f55b3): key claimed at 2026-03-08T14:30Z before its window ended 2026-03-09T10:00Z."""
    import dagster as dg

    from definitions import build_definitions

    resource = clocked_ledger  # the clock fixture's, on tmp_path's ledger.sqlite3
    tenant = Tenant("hono", "Pacific/Kiritimati", moves=(ZoneMove("2026-04-01", "Pacific/Honolulu"),))
    defs = build_definitions(
        tenants=[tenant], ledger=resource, destination=str(tmp_path / "exports"),
        environ={"EXPORTS_SOURCE": "sample"},
    )
    tick_at = dt.datetime(2026, 3, 8, 14, 30, tzinfo=dt.timezone.utc)  # 2026-03-09 04:30 in Kiritimati
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

    # the Honolulu window has ended: now it is claimed
    clock.now = dt.datetime(2026, 3, 9, 10, 0, tzinfo=dt.timezone.utc)
    done = defs.resolve_job_def("invoice_export__pacific_honolulu_job").execute_in_process(
        partition_key="2026-03-08", instance=instance, raise_on_error=False
    )
    (record,) = book.queries.records(tenant="hono")
    assert done.success and record.state is ExportState.COMPLETED, (record, ran)
    assert record.window_end_utc == clock.now and record.timezone == "Pacific/Honolulu", record


# -- a zone move accepted while an old-zone run is in flight loses no hour ---------------------------------------------


class _MoveAcceptedWhileRead(SampleInvoiceSource):
    """The source of the old-zone run: while it reads acme's 2026-03-09, an operator accepts acme's move to Chicago
    on 2026-03-10 (no key of 2026-03-10 exists yet, so the acceptance is allowed)."""

    ledger_url: str = ""
    accepted: list = []

    def rows(self, tenant, start_utc, end_utc) -> pd.DataFrame:
        if tenant == "acme" and start_utc.date() == dt.date(2026, 3, 9) and not self.accepted:
            code = cli.main([
                "--ledger-url", self.ledger_url, "accept-contract", "--export", "invoice_export", "--tenant", "acme",
                "--timezone", "America/Chicago", "--start-date", "2026-01-01", "--move", "2026-03-10:America/New_York",
                "--reason", "acme moved to Chicago",
            ])  # fmt: skip
            self.accepted.append(code)
        return super().rows(tenant, start_utc, end_utc)


def test_a_zone_move_accepted_while_an_old_zone_run_is_in_flight_loses_no_hour(tmp_path, instance):
    """Item 9: the contract is checked at run start, never at claim. A move accepted while an old-zone run reads its
    source must be seen by the claim (in the claim's transaction): every instant of the tenant's timeline must fall
    in exactly one window, exported or still to export under the contract in force. (v2 reads a source after its
    key's claim, so the run in flight is a range run 2026-03-09..10 whose rows are streamed: each key is claimed
    right before it is read, and the move is accepted while 03-09 is read, before 03-10 is claimed.)
    Fails on 0.4.0 (07f55b3): gap [2026-03-11T04:00Z, 05:00Z) between two days."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    source = _MoveAcceptedWhileRead(ledger_url=url, accepted=[])
    spec = ExportSpec(
        name="invoice_export", source=source, columns=INVOICE_COLUMNS, id_columns=["invoice_id"],
        time_column="occurred_at", tenant_column="tenant", tenants=["acme"], timezone=NY, start_date="2026-01-01",
        stream_rows=1000,
    )  # fmt: skip
    defs = ledgered_definitions(
        [spec], ledger=LedgerResource(url=url), destination=str(tmp_path / "exports"), environ={}
    )
    in_flight = run_dates(defs, instance, "2026-03-09", "2026-03-10")
    assert source.accepted == [0], "the operator's accept-contract succeeded while the run was in flight"
    assert not in_flight.success and "calendar contract" in failure_message(in_flight), "the old-zone claim is refused"

    book = open_ledger(url)
    moved = ExportCalendar("America/Chicago", "2026-01-01", (ZoneMove("2026-03-10", NY),))  # the contract in force
    recorded = {r.business_date: r for r in book.queries.records(tenant="acme")}
    timeline = []
    for day in (dt.date(2026, 3, 9), dt.date(2026, 3, 10), dt.date(2026, 3, 11)):
        record = recorded.get(day)
        if record is not None:
            timeline.append((day, f"recorded in {record.timezone}", record.window_start_utc, record.window_end_utc))
        else:
            window = moved.window_of(day)
            timeline.append((day, f"to export in {window.timezone}", window.start_utc, window.end_utc))
    gaps = [
        f"[{utc_iso(a[3])}, {utc_iso(b[2])}) between {a[0]} ({a[1]}) and {b[0]} ({b[1]})"
        for a, b in zip(timeline, timeline[1:], strict=False)
        if a[3] != b[2]
    ]
    assert dt.date(2026, 3, 9) in recorded, f"the run exported 03-09 before the move was accepted: {timeline}"
    assert gaps == [], gaps


# -- assets of the user's own follow zone moves and contracts ----------------------------------------------------------


OWN_COLUMNS = {"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"}


def _own_orders(tenants, zone: str) -> tuple[ExportSpec, dg.AssetsDefinition]:
    """An export whose rows come from the user's own partitioned asset (source=None), in ``zone``."""
    spec = ExportSpec(
        name="own_orders", source=None, columns=OWN_COLUMNS, id_columns=["order_id"], time_column="placed_at",
        tenant_column="tenant", tenants=tenants, timezone=zone, start_date="2026-03-01", schedule_time=None,
    )  # fmt: skip

    @dg.asset(
        name="own_orders",
        partitions_def=dg.DailyPartitionsDefinition(start_date="2026-03-01", timezone=zone),
        io_manager_key="own_orders__io_manager",
    )
    def own_orders(context) -> pd.DataFrame:
        window = context.partition_time_window  # the user's rows for the partition Dagster gives
        start, end = pd.Timestamp(window.start).tz_convert("UTC"), pd.Timestamp(window.end).tz_convert("UTC")
        times = pd.date_range(start, end, freq="h", inclusive="left").as_unit("us")
        return pd.DataFrame(
            {"order_id": [f"o{int(t.timestamp())}" for t in times], "tenant": "acme", "placed_at": times, "total": 1.0}
        )

    return spec, own_orders


def test_an_own_asset_export_follows_the_tenants_zone_moves_and_records_its_contract(tmp_path, instance):
    """Item 10: for an export whose rows come from the user's own asset (source=None), the I/O manager must split the
    frame with the tenant's calendar (its zone move included) and the tenant's calendar contract must be recorded and
    checked, as for a declared source. (v2: an own asset has one partitions definition, so one zone; a tenant that
    moved has days in two zones, and such an export is refused where it is declared instead of being split with a
    calendar without the move: that refusal replaces the split. The contract part is kept as it was: recorded at the
    first claim, and a zone changed in code without acceptance is refused at claim.)
    Fails on 0.4.0 (07f55b3): own-asset export ignores the move and records no contract."""
    moved = Tenant("acme", "America/Chicago", moves=(ZoneMove("2026-03-10", NY),))
    with pytest.raises(ConfigurationError, match="moved"):
        _own_orders([moved], "America/Chicago")

    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    spec, asset = _own_orders([Tenant("acme", "America/Chicago")], "America/Chicago")
    defs = ledgered_definitions(
        [spec], ledger=LedgerResource(url=url), destination=str(tmp_path / "exports"), assets=[asset], environ={}
    )
    for partition in ("2026-03-09", "2026-03-10"):
        run = defs.resolve_job_def("own_orders_job").execute_in_process(
            partition_key=partition, instance=instance, raise_on_error=False
        )
        assert run.success, failure_message(run)
    book = open_ledger(url)
    calendar = spec.calendar_for("acme")
    windows = {}
    for record in book.queries.records(export="own_orders"):
        expected = calendar.window_of(record.business_date)
        windows[record.business_date.isoformat()] = {
            "recorded": f"{record.timezone} {utc_iso(record.window_start_utc)}..{utc_iso(record.window_end_utc)}",
            "tenant's calendar": f"{expected.timezone} {utc_iso(expected.start_utc)}..{utc_iso(expected.end_utc)}",
        }
    observed = {"windows": windows, "contract recorded": book.contracts.in_force("own_orders", "acme")}
    assert sorted(windows) == ["2026-03-09", "2026-03-10"], observed
    assert all(w["recorded"] == w["tenant's calendar"] for w in windows.values()), observed
    assert calendar_of(observed["contract recorded"]) == calendar.contract(), observed

    # The zone changed in code (New York), never accepted: the own asset's next claim is refused and escalated.
    spec, asset = _own_orders(["acme"], NY)
    changed = ledgered_definitions(
        [spec], ledger=LedgerResource(url=url), destination=str(tmp_path / "exports"), assets=[asset], environ={}
    )
    refused = changed.resolve_job_def("own_orders_job").execute_in_process(
        partition_key="2026-03-11", instance=instance, raise_on_error=False
    )
    assert not refused.success and "calendar contract" in failure_message(refused), failure_message(refused)
    assert [r.business_date.isoformat() for r in book.queries.records(export="own_orders")] == list(windows), (
        "nothing was claimed under the contract nobody accepted"
    )
    assert [r["tenant"] for r in book.contracts.refusals(exports=["own_orders"])] == ["acme"], "and it is escalated"
