"""Unit tests of the window arithmetic (``assets/windows.py``) and the export calendar (``assets/calendar.py``).

The DST table pins exact UTC bounds for days that are not 24 hours long. The expected values were read off the tz
database with zoneinfo (system 2025b and tzdata 2026f here) before being written down; the one row on which the two
databases disagree (Cuba, 2026-11-01) carries an expectation per database.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from zoneinfo import ZoneInfo

import dagster as dg
import pytest

from export_ledger.calendar import (
    CalendarError,
    ExportCalendar,
    ExportWindow,
    load_zone,
    parse_business_date,
    require_aware,
    tz_database_version,
    utc_iso,
    window_for,
    windows_between,
)
from export_ledger.dagster import dagster_disagreement, partitions_def

UTC = dt.timezone.utc
HOUR = dt.timedelta(hours=1)


def _utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True)
class DstCase:
    """One row of the DST table: a business date, its exact UTC window and the local wall clock it starts at."""

    zone: str
    day: str
    start_utc: str
    end_utc: str
    hours: float
    start_local: str
    why: str

    @property
    def id(self) -> str:
        return f"{self.zone}-{self.day}"


def _havana_autumn_case() -> DstCase:
    """Cuba's 2026 fall-back differs between tz releases: 2025b ends DST on 2026-11-01, 2026f keeps it to 2027-11-07."""
    version = tz_database_version("America/Havana").split(" ", 1)[-1]
    if re.fullmatch(r"\d{4}[a-z]", version) and version < "2026a":
        return DstCase(
            "America/Havana", "2026-11-01", "2026-11-01T04:00:00Z", "2026-11-02T05:00:00Z", 25,
            "2026-11-01T00:00:00-04:00", f"midnight repeats (tz {version}): the day starts at its first occurrence",
        )
    if re.fullmatch(r"\d{4}[a-z]", version) and version >= "2026f":
        return DstCase(
            "America/Havana", "2026-11-01", "2026-11-01T04:00:00Z", "2026-11-02T04:00:00Z", 24,
            "2026-11-01T00:00:00-04:00", f"no fall-back in 2026 (tz {version}): Cuba stays on DST until 2027-11-07",
        )
    unknown = f"no verified expectation for tz database {version!r}"
    return DstCase("America/Havana", "2026-11-01", "", "", 0, "", unknown)


DST_TABLE = [
    DstCase("America/New_York", "2026-03-08", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z", 23,
            "2026-03-08T00:00:00-05:00", "02:00 -> 03:00: a 23-hour day"),
    DstCase("America/New_York", "2026-11-01", "2026-11-01T04:00:00Z", "2026-11-02T05:00:00Z", 25,
            "2026-11-01T00:00:00-04:00", "02:00 -> 01:00: a 25-hour day"),
    DstCase("Europe/Dublin", "2026-03-29", "2026-03-29T00:00:00Z", "2026-03-29T23:00:00Z", 23,
            "2026-03-29T00:00:00+00:00", "01:00 GMT -> 02:00 IST (Dublin's 'negative DST' in the tz database)"),
    DstCase("Europe/Dublin", "2026-10-25", "2026-10-24T23:00:00Z", "2026-10-26T00:00:00Z", 25,
            "2026-10-25T00:00:00+01:00", "02:00 IST -> 01:00 GMT"),
    DstCase("Australia/Lord_Howe", "2026-10-04", "2026-10-03T13:30:00Z", "2026-10-04T13:00:00Z", 23.5,
            "2026-10-04T00:00:00+10:30", "a 30-minute shift forward: 23.5 hours"),
    DstCase("Australia/Lord_Howe", "2026-04-05", "2026-04-04T13:00:00Z", "2026-04-05T13:30:00Z", 24.5,
            "2026-04-05T00:00:00+11:00", "a 30-minute shift back: 24.5 hours"),
    DstCase("America/Havana", "2026-03-08", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z", 23,
            "2026-03-08T01:00:00-04:00", "midnight does not exist: the day starts at the first instant after the gap"),
    _havana_autumn_case(),
    DstCase("America/Santiago", "2026-04-04", "2026-04-04T03:00:00Z", "2026-04-05T04:00:00Z", 25,
            "2026-04-04T00:00:00-03:00", "24:00 -> 23:00: the day's last hour repeats, midnight itself occurs once"),
    DstCase("America/Santiago", "2026-04-05", "2026-04-05T04:00:00Z", "2026-04-06T04:00:00Z", 24,
            "2026-04-05T00:00:00-04:00", "the day after the repeated hour is a plain 24 hours"),
    DstCase("America/Santiago", "2026-09-06", "2026-09-06T04:00:00Z", "2026-09-07T03:00:00Z", 23,
            "2026-09-06T01:00:00-03:00", "midnight does not exist: the day starts at 01:00"),
    DstCase("Asia/Beirut", "2026-03-29", "2026-03-28T22:00:00Z", "2026-03-29T21:00:00Z", 23,
            "2026-03-29T01:00:00+03:00", "midnight does not exist: the day starts at 01:00"),
    DstCase("Asia/Beirut", "2026-10-24", "2026-10-23T21:00:00Z", "2026-10-24T22:00:00Z", 25,
            "2026-10-24T00:00:00+03:00", "24:00 -> 23:00: the day's last hour repeats"),
    DstCase("Pacific/Apia", "2011-12-29", "2011-12-29T10:00:00Z", "2011-12-30T10:00:00Z", 24,
            "2011-12-29T00:00:00-10:00", "the last day before Samoa crossed the date line"),
    DstCase("Pacific/Apia", "2011-12-30", "2011-12-30T10:00:00Z", "2011-12-30T10:00:00Z", 0,
            "2011-12-31T00:00:00+14:00", "a skipped calendar day: an empty window"),
    DstCase("Pacific/Apia", "2011-12-31", "2011-12-30T10:00:00Z", "2011-12-31T10:00:00Z", 24,
            "2011-12-31T00:00:00+14:00", "the first day after the date line"),
]
DST_ZONES = sorted({case.zone for case in DST_TABLE})


@pytest.mark.parametrize("case", DST_TABLE, ids=lambda case: case.id)
def test_dst_table_window_has_exact_utc_bounds_and_duration(case: DstCase) -> None:
    if not case.start_utc:
        pytest.fail(f"{case.id}: {case.why}; verify the zone's rules with zoneinfo and add a row for it")
    window = window_for(dt.date.fromisoformat(case.day), case.zone)

    assert (utc_iso(window.start_utc), utc_iso(window.end_utc)) == (case.start_utc, case.end_utc), (
        f"{case.id} ({case.why}) must map to [{case.start_utc}, {case.end_utc})"
    )
    assert window.duration == dt.timedelta(hours=case.hours), f"{case.id} lasts {case.hours} hours ({case.why})"
    assert window.start_utc.astimezone(ZoneInfo(case.zone)).isoformat() == case.start_local, (
        f"{case.id} starts at local {case.start_local} ({case.why})"
    )
    assert window.is_empty == (case.hours == 0), f"only a skipped calendar day has an empty window ({case.id})"


@pytest.mark.parametrize("case", DST_TABLE, ids=lambda case: case.id)
def test_dst_table_calendar_window_matches_window_for(case: DstCase) -> None:
    calendar = ExportCalendar(timezone=case.zone, start_date="2011-01-01")

    assert calendar.window(case.day) == window_for(dt.date.fromisoformat(case.day), case.zone), (
        "the calendar is a thin key-parsing layer over window_for"
    )


def test_skipped_day_in_apia_is_empty_and_touched_by_both_neighbours() -> None:
    before, skipped, after = windows_between(dt.date(2011, 12, 29), dt.date(2011, 12, 31), "Pacific/Apia")

    assert skipped.is_empty and skipped.start_utc == skipped.end_utc == _utc("2011-12-30T10:00:00Z"), (
        "2011-12-30 never happened in Samoa: its window holds no instant"
    )
    assert before.end_utc == skipped.start_utc, "the day before ends where the skipped day (does not) start"
    assert skipped.end_utc == after.start_utc, "the day after starts where the skipped day ends"
    assert not skipped.contains(skipped.start_utc), "an empty window contains no instant, not even its bound"


@pytest.mark.parametrize("zone", DST_ZONES)
def test_windows_between_equals_independent_window_for_calls(zone: str) -> None:
    first, last = dt.date(2026, 1, 1), dt.date(2026, 12, 31)
    shared = windows_between(first, last, zone)

    independent = [window_for(w.business_date, zone) for w in shared]

    assert shared == independent, f"windows_between and window_for must agree on every 2026 day in {zone}"
    assert [w.business_date for w in shared] == [
        first + dt.timedelta(days=i) for i in range((last - first).days + 1)
    ], "one window per date, in order"


def test_window_contains_its_start_but_not_its_end() -> None:
    window = window_for(dt.date(2026, 3, 8), "America/New_York")

    assert window.contains(window.start_utc), "the start is inclusive"
    assert not window.contains(window.end_utc), "the end is exclusive: it belongs to the next day"
    assert window.contains(dt.datetime(2026, 3, 8, 3, 0, tzinfo=ZoneInfo("America/New_York"))), (
        "an aware local instant inside the day is contained"
    )


def test_window_contains_refuses_a_naive_instant() -> None:
    window = window_for(dt.date(2026, 3, 8), "America/New_York")

    with pytest.raises(ValueError, match="instant must be timezone-aware"):
        window.contains(dt.datetime(2026, 3, 8, 12, 0))


def test_export_window_refuses_an_end_before_its_start() -> None:
    with pytest.raises(CalendarError, match="2026-03-08 ends before it starts"):
        ExportWindow(dt.date(2026, 3, 8), "UTC", _utc("2026-03-09T00:00:00Z"), _utc("2026-03-08T00:00:00Z"))


def test_export_window_refuses_a_naive_or_offset_bound() -> None:
    with pytest.raises(CalendarError, match="start_utc must be a UTC-aware datetime"):
        ExportWindow(dt.date(2026, 3, 8), "UTC", dt.datetime(2026, 3, 8), _utc("2026-03-09T00:00:00Z"))
    new_york = ZoneInfo("America/New_York")
    with pytest.raises(CalendarError, match="end_utc must be a UTC-aware datetime"):
        ExportWindow(
            dt.date(2026, 3, 8), "UTC", _utc("2026-03-08T00:00:00Z"), dt.datetime(2026, 3, 9, tzinfo=new_york)
        )


def test_export_window_stores_bounds_in_utc_even_when_given_a_zero_offset_zone() -> None:
    london = ZoneInfo("Europe/London")
    window = ExportWindow(
        dt.date(2026, 1, 10), "Europe/London", dt.datetime(2026, 1, 10, tzinfo=london),
        dt.datetime(2026, 1, 11, tzinfo=london),
    )

    assert window.start_utc.tzinfo is UTC, "bounds are stored in UTC, whatever zone the caller used"
    assert utc_iso(window.start_utc + dt.timedelta(days=180)) == "2026-07-09T00:00:00Z", (
        "180 days after a UTC midnight is a UTC midnight"
    )


@pytest.mark.parametrize("key", ["2026-13-01", "20260301", "", "2026-02-30"])
def test_bad_partition_key_raises_calendar_error_naming_the_key(key: str) -> None:
    with pytest.raises(CalendarError) as parsed:
        parse_business_date(key)
    assert repr(key) in str(parsed.value), f"the error names the rejected key {key!r}"

    with pytest.raises(CalendarError) as windowed:
        ExportCalendar().window(key)
    assert repr(key) in str(windowed.value), f"the calendar's error names the rejected key {key!r}"


def test_partition_key_before_calendar_start_is_refused_naming_both() -> None:
    calendar = ExportCalendar(timezone="America/New_York", start_date="2026-01-01")

    with pytest.raises(CalendarError, match=r"'2025-12-31' is before the calendar start 2026-01-01"):
        calendar.window("2025-12-31")


@pytest.mark.parametrize("zone", ["Mars/Olympus", "", "UTC "])
def test_unknown_zone_raises_calendar_error_naming_the_zone(zone: str) -> None:
    for build in (load_zone, lambda z: window_for(dt.date(2026, 3, 8), z), lambda z: ExportCalendar(timezone=z)):
        with pytest.raises(CalendarError) as raised:
            build(zone)
        assert repr(zone) in str(raised.value), f"the error names the rejected zone {zone!r}"


def test_calendar_refuses_a_malformed_start_date() -> None:
    with pytest.raises(CalendarError, match="'2026-02-30'"):
        ExportCalendar(timezone="UTC", start_date="2026-02-30")


def test_require_aware_refuses_a_naive_datetime_naming_it() -> None:
    with pytest.raises(ValueError, match=r"claimed_at must be timezone-aware, got naive 2026-03-08T02:30:00"):
        require_aware(dt.datetime(2026, 3, 8, 2, 30), "claimed_at")


def test_require_aware_refuses_a_date_that_is_not_a_datetime() -> None:
    with pytest.raises(TypeError, match="claimed_at must be a datetime, got date"):
        require_aware(dt.date(2026, 3, 8), "claimed_at")


def test_require_aware_converts_an_aware_datetime_to_utc() -> None:
    local = dt.datetime(2026, 3, 8, 3, 30, tzinfo=ZoneInfo("America/New_York"))

    converted = require_aware(local, "instant")

    assert converted.tzinfo is UTC and converted == local, "same instant, expressed in UTC"
    assert converted == _utc("2026-03-08T07:30:00Z")


def test_utc_iso_renders_z_suffix_in_utc() -> None:
    local = dt.datetime(2026, 3, 8, 0, 0, tzinfo=ZoneInfo("America/New_York"))

    assert utc_iso(local) == "2026-03-08T05:00:00Z", "any aware instant is rendered in UTC with a Z"
    assert utc_iso(_utc("2026-03-08T05:00:00.250000Z")) == "2026-03-08T05:00:00.250000Z", "microseconds survive"


def test_utc_iso_refuses_a_naive_datetime() -> None:
    with pytest.raises(ValueError, match="must be timezone-aware"):
        utc_iso(dt.datetime(2026, 3, 8))


@pytest.mark.parametrize("zone", ["America/New_York", "UTC", "Pacific/Apia"])
def test_tz_database_version_names_its_source(zone: str) -> None:
    version = tz_database_version(zone)

    assert version, "the ledger records a non-empty tz database name next to each window"
    assert version.startswith(("system ", "tzdata ")), f"{version!r} says whether zoneinfo read the system or wheel"


# --- Cross-check with Dagster's DailyPartitionsDefinition ----------------------------------------------------------


def _days(first: dt.date, last: dt.date) -> list[dt.date]:
    return [first + dt.timedelta(days=i) for i in range((last - first).days + 1)]


@pytest.mark.parametrize("zone", DST_ZONES)
def test_calendar_agrees_with_dagster_on_every_day_2024_to_2027(zone: str) -> None:
    calendar = ExportCalendar(timezone=zone, start_date="2024-01-01")
    partitions = partitions_def(calendar)
    disagreements = []

    for day in _days(dt.date(2024, 1, 1), dt.date(2027, 12, 31)):
        key = day.isoformat()
        ours = calendar.window(key)
        theirs = partitions.time_window_for_partition_key(key)
        ours_instants = (ours.start_utc.timestamp(), ours.end_utc.timestamp())
        theirs_instants = (theirs.start.timestamp(), theirs.end.timestamp())
        if ours_instants != theirs_instants:
            disagreements.append(
                f"{key}: ours [{ours.start_utc}, {ours.end_utc}), Dagster's [{theirs.start}, {theirs.end})"
            )
        if dagster_disagreement(ours, theirs) is not None:
            disagreements.append(f"{key}: dagster_disagreement reports {dagster_disagreement(ours, theirs)}")

    assert disagreements == [], f"Dagster and the export calendar must agree as instants on every day in {zone}"


def test_dagster_gives_apia_skipped_day_the_next_days_window_and_the_disagreement_names_both() -> None:
    calendar = ExportCalendar(timezone="Pacific/Apia", start_date="2011-12-01")
    partitions = partitions_def(calendar)
    theirs = partitions.time_window_for_partition_key("2011-12-30")
    ours = calendar.window("2011-12-30")

    assert ours.is_empty, "the export calendar gives the skipped day an empty window"
    assert theirs.end.timestamp() > theirs.start.timestamp(), "Dagster gives the skipped day a non-empty window"
    assert (theirs.start.timestamp(), theirs.end.timestamp()) == (
        partitions.time_window_for_partition_key("2011-12-31").start.timestamp(),
        partitions.time_window_for_partition_key("2011-12-31").end.timestamp(),
    ), "Dagster's 2011-12-30 window is 2011-12-31's: the same events would belong to two partitions"

    message = dagster_disagreement(ours, theirs)

    assert message is not None, "a real disagreement is reported"
    for part in ("2011-12-30", "Pacific/Apia", theirs.start.isoformat(), theirs.end.isoformat(),
                 ours.start_utc.isoformat(), ours.end_utc.isoformat()):
        assert part in message, f"the disagreement names {part!r} so both windows can be read from the log"


def test_dagster_disagreement_is_none_for_a_non_existent_midnight_compared_as_instants() -> None:
    calendar = ExportCalendar(timezone="America/Havana", start_date="2026-01-01")
    theirs = partitions_def(calendar).time_window_for_partition_key("2026-03-08")
    ours = calendar.window("2026-03-08")

    assert theirs.start != ours.start_utc.astimezone(ZoneInfo("America/Havana")), (
        "Dagster's start is the non-existent wall time 00:00-05:00, which == compares by wall clock"
    )
    assert dagster_disagreement(ours, theirs) is None, "as instants, the two windows are the same"


def test_dagster_disagreement_reports_a_shifted_window() -> None:
    calendar = ExportCalendar(timezone="America/New_York", start_date="2026-01-01")
    ours = calendar.window("2026-03-08")
    shifted = dg.TimeWindow(ours.start_utc + HOUR, ours.end_utc)

    message = dagster_disagreement(ours, shifted)

    assert message is not None and "2026-03-08" in message and "America/New_York" in message, (
        "any difference of an hour is reported, naming the day and zone"
    )


@pytest.mark.parametrize("name", ["localtime", "posixrules", "Factory", "right/UTC", "posix/America/New_York"])
def test_names_that_are_not_iana_zones_are_refused(name):
    with pytest.raises(CalendarError, match=f"unknown timezone '{name}'"):
        load_zone(name)
