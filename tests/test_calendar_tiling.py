"""Property test: the export windows of every zone tile the UTC timeline, 1970-01-01 to 2037-12-31.

For each zone and each day ``d`` the window is checked three ways:

* against its neighbours, each computed by an independent ``window_for`` call: ``end(d) == start(d + 1)``;
* against ``windows_between`` over the whole range (which shares boundaries by construction);
* against an oracle for the written policy, using only UTC -> local conversion (which is never ambiguous): a
  non-empty window starts at an instant whose local date is ``d`` and whose previous microsecond is before ``d``, and
  its last microsecond is still on ``d`` or earlier; an empty window starts on a later local date.

A deterministic sample of 40 zones runs by default, every day of each. The sweep over every zone the calendar accepts
(``zoneinfo.available_timezones()`` less ``localtime``, ``posixrules`` and ``Factory``, one zone of each distinct rule
set) is marked slow: there, each zone is checked on every day within two days of a change of its UTC offset (found
apart from the library, by sampling ``zoneinfo`` at each UTC noon: a window is cut from two local midnights, each
within 14 hours of the day's UTC midnight, so only those days can be cut differently from a plain day) and on one
day in 61 besides. ``EXPORTS_TILING_EVERY_DAY=1`` checks every day of every zone (about two minutes on 2 cores).
"""

from __future__ import annotations

import datetime as dt
import importlib.resources
import os
import sys
import zoneinfo
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from export_ledger.calendar import known_zones, tz_database_version, window_for, windows_between

FIRST_DAY = dt.date(1970, 1, 1)
LAST_DAY = dt.date(2037, 12, 31)
DAYS = (LAST_DAY - FIRST_DAY).days + 1
TICK = dt.timedelta(microseconds=1)
MAX_REPORTED_PER_ZONE = 5

DST_TABLE_ZONES = [
    "America/New_York",
    "Europe/Dublin",
    "Australia/Lord_Howe",
    "America/Havana",
    "America/Santiago",
    "Asia/Beirut",
    "Pacific/Apia",
]
# Zones picked for unusual history: skipped days (Fakaofo, Kwajalein, Kiritimati, Kanton), odd offsets (Chatham,
# Marquesas, Kathmandu, Monrovia before 1972), transitions at or across midnight (Sao Paulo, Asuncion, Cairo, Gaza,
# Colombo, Dhaka, Karachi), negative or two-hour DST (Casablanca, Troll), and a few plain ones.
SAMPLE_ZONES = DST_TABLE_ZONES + [
    "Pacific/Fakaofo",
    "Pacific/Kwajalein",
    "Pacific/Kiritimati",
    "Pacific/Kanton",
    "Pacific/Chatham",
    "Pacific/Marquesas",
    "Asia/Kathmandu",
    "Asia/Kolkata",
    "Asia/Tehran",
    "Asia/Dhaka",
    "Asia/Gaza",
    "Asia/Colombo",
    "Asia/Pyongyang",
    "Asia/Karachi",
    "Africa/Casablanca",
    "Africa/Cairo",
    "Africa/Monrovia",
    "Antarctica/Troll",
    "Antarctica/Macquarie",
    "America/St_Johns",
    "America/Sao_Paulo",
    "America/Asuncion",
    "America/Nuuk",
    "America/Scoresbysund",
    "America/Caracas",
    "America/Adak",
    "America/Metlakatla",
    "America/Argentina/San_Luis",
    "Europe/Lisbon",
    "Europe/Moscow",
    "Europe/Kyiv",
    "Australia/Adelaide",
    "UTC",
]


#: Besides the days around its offset changes, the slow sweep checks one day in this many of each zone.
STRIDE = 61
#: Days checked on either side of a change of a zone's UTC offset.
MARGIN = 2


def offset_change_days(zone: str) -> list[int]:
    """Indices (days from FIRST_DAY) of the days whose window a change of ``zone``'s UTC offset can touch, found with
    ``zoneinfo`` alone: the offset sampled at each UTC noon, a change between two noons marking the days within
    MARGIN of either. (A change undone within the same 24 hours would go unseen: the tz database has none.)"""
    tz = zoneinfo.ZoneInfo(zone)
    start = dt.datetime.combine(FIRST_DAY, dt.time(12), dt.timezone.utc) - dt.timedelta(days=MARGIN + 1)
    marked: set[int] = set()
    previous = start.astimezone(tz).utcoffset()
    for step in range(1, DAYS + 2 * MARGIN + 3):
        instant = start + dt.timedelta(days=step)
        offset = instant.astimezone(tz).utcoffset()
        if offset != previous:
            day = (instant.date() - FIRST_DAY).days
            marked.update(range(day - MARGIN - 1, day + MARGIN + 1))
        previous = offset
    return sorted(index for index in marked if 0 <= index < DAYS)


def runs_of(indices: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive day indices, as (first, last) inclusive."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def check_zone(zone: str, every_day: bool = True) -> tuple[str, int, list[str]]:
    """Checks every day of ``zone`` (else the days around its offset changes and one day in STRIDE); returns the
    zone, the number of days checked and (a few) failures."""
    if every_day:
        runs = [(0, DAYS - 1)]
    else:
        runs = runs_of(sorted({*offset_change_days(zone), *range(len(zone) % STRIDE, DAYS, STRIDE)}))
    failures: list[str] = []
    checked = 0
    for first, last in runs:
        checked += _check_run(zone, first, last, failures)
        if len(failures) >= MAX_REPORTED_PER_ZONE:
            break
    return zone, checked, failures


def _check_run(zone: str, first: int, last: int, failures: list[str]) -> int:
    """Checks the days FIRST_DAY + first .. FIRST_DAY + last of ``zone``, appending (a few) failures."""
    tz = zoneinfo.ZoneInfo(zone)
    shared = windows_between(FIRST_DAY + dt.timedelta(days=first), FIRST_DAY + dt.timedelta(days=last), zone)

    def fail(day: dt.date, what: str) -> None:
        failures.append(f"{zone} {day}: {what}")

    previous = None
    checked = 0
    for index in range(first, last + 1):
        day = FIRST_DAY + dt.timedelta(days=index)
        window = window_for(day, zone)
        start, end = window.start_utc, window.end_utc
        checked += 1

        between = shared[index - first]
        if window.business_date != day or between.business_date != day:
            fail(day, "window carries the wrong business date")
        if (between.start_utc, between.end_utc) != (start, end):
            fail(day, f"windows_between gives [{between.start_utc}, {between.end_utc}), "
                      f"window_for gives [{start}, {end})")
        if not start <= end:
            fail(day, f"ends before it starts: [{start}, {end})")
        if previous is not None and previous.end_utc != start:
            fail(day, f"gap or overlap: the previous day ends at {previous.end_utc}, this one starts at {start}")

        start_date = start.astimezone(tz).date()
        if (start - TICK).astimezone(tz).date() >= day:
            fail(day, f"not the earliest start: the microsecond before {start} is already local {day} or later")
        if start < end:
            if start_date != day:
                fail(day, f"a non-empty window starts on local date {start_date}")
            last_date = (end - TICK).astimezone(tz).date()
            if last_date > day:
                fail(day, f"the window's last microsecond is on local date {last_date}")
        elif start_date <= day:
            fail(day, f"empty window, yet its start {start} is on local date {start_date}: the day did happen")

        if len(failures) >= MAX_REPORTED_PER_ZONE:
            break
        previous = window
    return checked


def sweep(zones: list[str], every_day: bool = True) -> tuple[int, int, list[str]]:
    """Checks ``zones`` on two worker processes; returns zones checked, windows checked and failures."""
    failures: list[str] = []
    windows = 0
    with ProcessPoolExecutor(max_workers=2) as pool:
        for _zone, checked, zone_failures in pool.map(check_zone, zones, [every_day] * len(zones)):
            windows += checked
            failures.extend(zone_failures)
    return len(zones), windows, failures


def test_sample_zones_are_known_to_this_tz_database() -> None:
    missing = sorted(set(SAMPLE_ZONES) - zoneinfo.available_timezones())

    assert missing == [], f"the deterministic sample names zones the tz database does not have: {missing}"
    assert len(set(SAMPLE_ZONES)) == len(SAMPLE_ZONES) == 40, "forty distinct zones, including the DST table's"


def test_windows_tile_utc_timeline_for_sample_zones_1970_to_2037() -> None:
    zones, windows, failures = sweep(SAMPLE_ZONES)

    print(f"tiling: {zones} zones x {DAYS} days = {windows} windows ({tz_database_version('UTC')})")
    assert windows == zones * DAYS, "every day of every sampled zone was checked"
    assert failures == [], "consecutive windows must tile the UTC timeline under the written policy:\n" + "\n".join(
        failures
    )


def tz_rules(zone: str) -> bytes:
    """The TZif bytes ``zoneinfo.ZoneInfo(zone)`` reads: the first file on ``zoneinfo.TZPATH``, else the tzdata
    wheel's. A ZoneInfo's transitions are a function of these bytes alone (the name is only its label)."""
    for root in zoneinfo.TZPATH:
        path = Path(root) / zone
        if path.is_file():
            return path.read_bytes()
    return importlib.resources.files("tzdata.zoneinfo").joinpath(*zone.split("/")).read_bytes()


@pytest.mark.slow
def test_windows_tile_utc_timeline_for_every_available_zone_1970_to_2037() -> None:
    all_zones = sorted(known_zones())  # every zone the calendar accepts (available_timezones less non-places)
    # Zones whose rules are byte for byte the same (links such as Asia/Calcutta -> Asia/Kolkata: 597 zones, 446 rule
    # sets here) cut the same windows: one of each is checked.
    distinct: dict[bytes, str] = {}
    for zone in all_zones:
        distinct.setdefault(tz_rules(zone), zone)

    every_day = os.environ.get("EXPORTS_TILING_EVERY_DAY") == "1"
    zones, windows, failures = sweep(sorted(distinct.values()), every_day)

    print(f"tiling: {len(all_zones)} zones, {zones} distinct rule sets, {windows} windows "
          f"({'every day' if every_day else 'days around offset changes, and one in ' + str(STRIDE)}; "
          f"{tz_database_version('UTC')})")  # fmt: skip
    assert zones > 100, "every distinct zone was checked"
    if every_day:
        assert windows == zones * DAYS, "every day of every distinct zone was checked"
    else:
        assert windows >= zones * (DAYS // STRIDE), "at least one day in STRIDE of every distinct zone was checked"
    assert failures == [], "consecutive windows must tile the UTC timeline under the written policy:\n" + "\n".join(
        failures
    )


def test_the_days_around_offset_changes_are_found_apart_from_the_library() -> None:
    """The slow sweep's choice of days: New York's 2026 DST changes (March 8 and November 1), Apia's skipped
    2011-12-30, and nothing in UTC."""
    new_york = {FIRST_DAY + dt.timedelta(days=i) for i in offset_change_days("America/New_York")}
    apia = {FIRST_DAY + dt.timedelta(days=i) for i in offset_change_days("Pacific/Apia")}

    assert {dt.date(2026, 3, 8), dt.date(2026, 11, 1)} <= new_york
    assert dt.date(2026, 6, 1) not in new_york, "a plain summer day is no change day"
    assert {dt.date(2011, 12, 29), dt.date(2011, 12, 30), dt.date(2011, 12, 31)} <= apia
    assert offset_change_days("UTC") == []


def test_a_window_cut_wrong_on_a_change_day_is_found_by_the_slow_sweeps_choice_of_days(monkeypatch) -> None:
    """The reduced sweep still fails when the library cuts a DST day wrong (here: New York's 2026-03-08 window one
    hour too long at its start)."""
    import export_ledger.calendar as calendar

    real = calendar.window_for

    def wrong(day, timezone):
        window = real(day, timezone)
        if day == dt.date(2026, 3, 8) and timezone == "America/New_York":
            return calendar.ExportWindow(day, timezone, window.start_utc - dt.timedelta(hours=1), window.end_utc)
        return window

    monkeypatch.setattr(sys.modules[__name__], "window_for", wrong)
    _zone, checked, failures = check_zone("America/New_York", every_day=False)

    assert 0 < checked < DAYS // 10, f"the reduced sweep checks a few days of the zone: {checked}"
    assert any("2026-03-08" in failure for failure in failures), failures
