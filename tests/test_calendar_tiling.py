"""Property test: the export windows of every zone tile the UTC timeline, 1970-01-01 to 2037-12-31.

For each zone and each day ``d`` the window is checked three ways:

* against its neighbours, each computed by an independent ``window_for`` call: ``end(d) == start(d + 1)``;
* against ``windows_between`` over the whole range (which shares boundaries by construction);
* against an oracle for the written policy, using only UTC -> local conversion (which is never ambiguous): a
  non-empty window starts at an instant whose local date is ``d`` and whose previous microsecond is before ``d``, and
  its last microsecond is still on ``d`` or earlier; an empty window starts on a later local date.

A deterministic sample of zones runs by default; the sweep over every zone the calendar accepts
(``zoneinfo.available_timezones()`` less ``localtime``, ``posixrules`` and ``Factory``, one zone of each distinct rule
set) is marked slow.
"""

from __future__ import annotations

import datetime as dt
import importlib.resources
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


def check_zone(zone: str) -> tuple[str, int, list[str]]:
    """Checks every day of ``zone``; returns the zone, the number of days checked and (a few) failures."""
    tz = zoneinfo.ZoneInfo(zone)
    shared = windows_between(FIRST_DAY, LAST_DAY, zone)
    failures: list[str] = []

    def fail(day: dt.date, what: str) -> None:
        failures.append(f"{zone} {day}: {what}")

    previous = None
    checked = 0
    for index in range(DAYS):
        day = FIRST_DAY + dt.timedelta(days=index)
        window = window_for(day, zone)
        start, end = window.start_utc, window.end_utc
        checked += 1

        if window.business_date != day or shared[index].business_date != day:
            fail(day, "window carries the wrong business date")
        if (shared[index].start_utc, shared[index].end_utc) != (start, end):
            fail(day, f"windows_between gives [{shared[index].start_utc}, {shared[index].end_utc}), "
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
    return zone, checked, failures


def sweep(zones: list[str]) -> tuple[int, int, list[str]]:
    """Checks ``zones`` on two worker processes; returns zones checked, windows checked and failures."""
    failures: list[str] = []
    windows = 0
    with ProcessPoolExecutor(max_workers=2) as pool:
        for _zone, checked, zone_failures in pool.map(check_zone, zones):
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

    zones, windows, failures = sweep(sorted(distinct.values()))

    print(f"tiling: {len(all_zones)} zones, {zones} distinct rule sets x {DAYS} days = {windows} windows "
          f"({tz_database_version('UTC')})")  # fmt: skip
    assert zones > 100 and windows == zones * DAYS, "every day of every distinct zone was checked"
    assert failures == [], "consecutive windows must tile the UTC timeline under the written policy:\n" + "\n".join(
        failures
    )
