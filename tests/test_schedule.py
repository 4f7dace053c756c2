"""The nightly schedule, evaluated with Dagster's own machinery around DST weeks, and its guard on the wall time.

Ticks are the schedule's own cron times (minute and hour read from ``cron_schedule``) placed on each local day with
zoneinfo, timezone-aware. Each tick is evaluated by invoking the schedule on
``build_schedule_context(instance=..., scheduled_execution_time=...)`` with a throwaway ``instance_for_test()``.
"""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import dagster as dg
import pytest

from definitions import build_definitions
from export_ledger.calendar import CalendarError, ExportCalendar, check_schedule_time

UTC = dt.timezone.utc
SCHEDULE_NAME = "nightly_invoice_export"

# get_schedule_def is the public accessor; its warning announces that 1.11+ will stop resolving resources, which
# these tests do not rely on (they evaluate ticks, not resources).
pytestmark = pytest.mark.filterwarnings("ignore:Starting in dagster 1.11, get_schedule_def:UserWarning")


@pytest.fixture
def export_root(tmp_path) -> str:
    return str(tmp_path / "exports")


def nightly_schedule(sqlite_url: str, export_root: str, timezone: str = "America/New_York") -> dg.ScheduleDefinition:
    defs = build_definitions(
        timezone, "2026-01-01", ["acme"], ledger_url=sqlite_url, destination=export_root,
        environ={"EXPORTS_SOURCE": "sample"},
    )
    return defs.get_schedule_def(SCHEDULE_NAME)


def cron_ticks(schedule: dg.ScheduleDefinition, first: dt.date, last: dt.date) -> list[dt.datetime]:
    """The schedule's daily ticks from ``first`` to ``last``: its cron minute and hour on each local day."""
    minute, hour, day_of_month, month, day_of_week = schedule.cron_schedule.split()
    assert (day_of_month, month, day_of_week) == ("*", "*", "*"), "the nightly schedule fires every day"
    zone = ZoneInfo(schedule.execution_timezone)
    at = dt.time(int(hour), int(minute))
    ticks = []
    for offset in range((last - first).days + 1):
        tick = dt.datetime.combine(first + dt.timedelta(days=offset), at, tzinfo=zone)
        assert tick.astimezone(UTC).astimezone(zone).replace(tzinfo=None) == tick.replace(tzinfo=None), (
            f"the tick {tick} is a real wall time: Dagster has nothing to shift"
        )
        ticks.append(tick)
    return ticks


def run_requests_at(schedule: dg.ScheduleDefinition, instance: dg.DagsterInstance, tick: dt.datetime) -> list:
    context = dg.build_schedule_context(instance=instance, scheduled_execution_time=tick)
    result = schedule(context)
    if isinstance(result, dg.SkipReason):
        return []
    if isinstance(result, dg.RunRequest):
        return [result]
    return list(result or [])


def test_default_schedule_runs_at_0430_new_york_time(sqlite_url: str, export_root: str) -> None:
    schedule = nightly_schedule(sqlite_url, export_root)

    assert schedule.cron_schedule == "30 4 * * *", "04:30 exists exactly once on every New York day"
    assert schedule.execution_timezone == "America/New_York", "the schedule runs in the calendar's zone, never UTC"
    assert schedule.job_name == "invoice_export_job"


@pytest.mark.parametrize(
    ("timezone", "first", "last"),
    [
        pytest.param("America/New_York", dt.date(2026, 3, 5), dt.date(2026, 3, 12), id="new-york-spring-forward-week"),
        pytest.param("America/New_York", dt.date(2026, 10, 29), dt.date(2026, 11, 5), id="new-york-fall-back-week"),
        pytest.param("America/Havana", dt.date(2026, 3, 5), dt.date(2026, 3, 12), id="havana-skipped-midnight-week"),
    ],
)
def test_each_tick_requests_exactly_the_previous_days_partition(
    sqlite_url: str, export_root: str, timezone: str, first: dt.date, last: dt.date
) -> None:
    schedule = nightly_schedule(sqlite_url, export_root, timezone)
    ticks = cron_ticks(schedule, first, last)
    requested: list[str] = []

    with dg.instance_for_test() as instance:
        for tick in ticks:
            requests = run_requests_at(schedule, instance, tick)
            expected = (tick.date() - dt.timedelta(days=1)).isoformat()
            assert [r.partition_key for r in requests] == [expected], (
                f"the tick at {tick.isoformat()} requests one run, for the previous business day {expected}"
            )
            requested.extend(r.partition_key for r in requests)

    days = [(first + dt.timedelta(days=i - 1)).isoformat() for i in range(len(ticks))]
    assert requested == days, "over the week every business day is requested once: none skipped, none doubled"


def test_tick_given_in_utc_requests_the_same_partition(sqlite_url: str, export_root: str) -> None:
    schedule = nightly_schedule(sqlite_url, export_root)
    tick = cron_ticks(schedule, dt.date(2026, 3, 9), dt.date(2026, 3, 9))[0]

    with dg.instance_for_test() as instance:
        local = run_requests_at(schedule, instance, tick)
        in_utc = run_requests_at(schedule, instance, tick.astimezone(UTC))

    assert [r.partition_key for r in local] == [r.partition_key for r in in_utc] == ["2026-03-08"], (
        "the partition depends on the instant of the tick, not on the zone it is expressed in"
    )


@pytest.mark.parametrize(
    ("at", "day", "what"),
    [
        pytest.param(dt.time(2, 30), "2026-03-08", "skipped", id="0230-skipped-at-spring-forward"),
        pytest.param(dt.time(1, 30), "2026-11-01", "repeated", id="0130-repeated-at-fall-back"),
    ],
)
def test_check_schedule_time_refuses_a_new_york_time_that_is_skipped_or_repeated(
    at: dt.time, day: str, what: str
) -> None:
    calendar = ExportCalendar(timezone="America/New_York", start_date="2026-01-01")

    with pytest.raises(CalendarError) as raised:
        check_schedule_time(calendar, at)

    message = str(raised.value)
    assert day in message, f"{at:%H:%M} is {what} on {day}: the error names that day ({message})"
    assert at.strftime("%H:%M") in message and "America/New_York" in message, "the error names the time and zone"


def test_build_definitions_refuses_a_schedule_time_skipped_by_dst(sqlite_url: str, export_root: str) -> None:
    with pytest.raises(CalendarError, match=r"02:30 does not occur exactly once on 2026-03-08 in America/New_York"):
        build_definitions(
            "America/New_York", "2026-01-01", ["acme"], ledger_url=sqlite_url, destination=export_root,
            schedule_time="02:30", environ={"EXPORTS_SOURCE": "sample"},
        )


def test_check_schedule_time_accepts_0430_in_a_zone_that_changes_at_midnight() -> None:
    calendar = ExportCalendar(timezone="America/Havana", start_date="2026-01-01")

    check_schedule_time(calendar, dt.time(4, 30))  # raises if 04:30 is skipped or repeated on any day to 2037


def test_check_schedule_time_refuses_0030_in_a_zone_that_changes_at_midnight() -> None:
    calendar = ExportCalendar(timezone="America/Havana", start_date="2026-01-01")

    with pytest.raises(CalendarError, match=r"00:30 does not occur exactly once on 2026-03-08 in America/Havana"):
        check_schedule_time(calendar, dt.time(0, 30))


def test_havana_definitions_build_with_the_default_schedule_time(sqlite_url: str, export_root: str) -> None:
    schedule = nightly_schedule(sqlite_url, export_root, "America/Havana")

    assert (schedule.cron_schedule, schedule.execution_timezone) == ("30 4 * * *", "America/Havana")
