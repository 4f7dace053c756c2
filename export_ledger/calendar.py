"""The export calendar. Canonical export windows: one business date in one IANA zone mapped to a half-open UTC interval.

Plain Python on top of :mod:`zoneinfo`; nothing here knows about Dagster.

Window policy
-------------
The window of business date ``d`` in zone ``Z`` is ``[S(d), S(d + 1))`` where ``S(d)`` is the earliest UTC instant
whose wall-clock date in ``Z`` is ``d`` or later. Read as rules:

* a local midnight that does not exist (the clock jumps over it) starts the day at the first instant after the gap;
* a local midnight that occurs twice starts the day at its first occurrence;
* a calendar day the zone skipped entirely (Pacific/Apia, 2011-12-30) has an empty window: it exports nothing, and
  no event can belong to two windows.

Because ``S`` never decreases, consecutive windows tile the UTC timeline: contiguous, non-overlapping, one per date.
"""

from __future__ import annotations

import datetime as dt
import difflib
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from zoneinfo import TZPATH, ZoneInfo, ZoneInfoNotFoundError, available_timezones

from export_ledger.errors import CalendarError

UTC = dt.timezone.utc
# Names the policy above; recorded in each export's calendar contract so a change of policy is a visible change.
WINDOW_POLICY = "earliest-instant-of-local-date/v1"
_ONE_DAY = dt.timedelta(days=1)
_TICK = dt.timedelta(microseconds=1)
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True)
class ExportWindow:
    """The canonical UTC window of one business date in one zone.

    Attributes:
        business_date: The local calendar date the window stands for.
        timezone: IANA zone name, e.g. ``America/New_York``.
        start_utc: Inclusive start, timezone-aware UTC.
        end_utc: Exclusive end, timezone-aware UTC. Equal to ``start_utc`` on a day the zone skipped.
    """

    business_date: dt.date
    timezone: str
    start_utc: dt.datetime
    end_utc: dt.datetime

    def __post_init__(self) -> None:
        for name in ("start_utc", "end_utc"):
            value = getattr(self, name)
            if value.tzinfo is None or value.utcoffset() != dt.timedelta(0):
                raise CalendarError(f"{name} must be a UTC-aware datetime, got {value!r}")
            # A zero offset is not UTC (Europe/London in winter): store real UTC so arithmetic stays in UTC.
            object.__setattr__(self, name, value.astimezone(UTC))
        if self.end_utc < self.start_utc:
            raise CalendarError(f"window for {self.business_date} ends before it starts")

    @property
    def duration(self) -> dt.timedelta:
        return self.end_utc - self.start_utc

    @property
    def is_empty(self) -> bool:
        """True on a calendar day that the zone skipped: the window holds no instant."""
        return self.start_utc == self.end_utc

    def contains(self, instant: dt.datetime) -> bool:
        return self.start_utc <= require_aware(instant, "instant") < self.end_utc


def require_aware(value: dt.datetime, name: str) -> dt.datetime:
    """Returns ``value`` in UTC, or raises when it is naive: every boundary of this project is timezone-aware."""
    if not isinstance(value, dt.datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got naive {value.isoformat()}")
    return value.astimezone(UTC)


def utc_iso(value: dt.datetime) -> str:
    """ISO 8601 in UTC with a ``Z`` suffix, e.g. ``2026-03-08T05:00:00Z``."""
    value = require_aware(value, "value")
    text = value.replace(tzinfo=None).isoformat()
    return f"{text}Z"


def parse_business_date(text: str) -> dt.date:
    """Parses a ``YYYY-MM-DD`` partition key, naming the key in the error."""
    if not isinstance(text, str) or not _DATE_RE.fullmatch(text):
        raise CalendarError(f"invalid partition key {text!r}: expected a date as YYYY-MM-DD")
    try:
        return dt.date.fromisoformat(text)
    except ValueError as exc:
        raise CalendarError(f"invalid partition key {text!r}: {exc}") from None


@functools.cache
def known_zones() -> frozenset[str]:
    """The IANA zones the export calendar accepts: ``zoneinfo.available_timezones()`` without the entries that are
    not places (Debian ships ``localtime``, this machine's own zone, and ``posixrules``; ``Factory`` has no time)."""
    return frozenset(z for z in available_timezones() if z not in ("localtime", "posixrules", "Factory"))


def load_zone(name: str) -> ZoneInfo:
    """Loads an IANA zone, refusing anything that is not a known zone name.

    Names that zoneinfo can open but that are not zones of the tz database (``localtime``, ``posixrules``,
    ``right/...``) are refused: they mean different things on different machines.
    """
    if not isinstance(name, str) or name not in known_zones():
        raise CalendarError(_unknown_zone(name))
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise CalendarError(_unknown_zone(name)) from exc


def _unknown_zone(name: object) -> str:
    """The refusal of a zone name, with the nearest known zone when the name looks like a typo of one."""
    close = difflib.get_close_matches(name, known_zones(), n=1, cutoff=0.8) if isinstance(name, str) else []
    if close:
        return f"unknown timezone {name!r}: did you mean {close[0]!r}? (expected an IANA zone name)"
    return f"unknown timezone {name!r}: expected an IANA zone name such as 'America/New_York'"


def _local_date(instant: dt.datetime, zone: ZoneInfo) -> dt.date:
    return instant.astimezone(zone).date()


@functools.lru_cache(maxsize=32_768)
def _start_of_day(day: dt.date, zone: ZoneInfo) -> dt.datetime:
    """Earliest UTC instant whose local date in ``zone`` is ``day`` or later.

    Cached: every boundary is the end of one window and the start of the next, and sensors and backfills ask for the
    same days again and again (a pure function of the day and the zone's rules, which a ZoneInfo never changes).
    """
    midnight = dt.datetime(day.year, day.month, day.day)
    # fold=0 maps a repeated midnight to its first occurrence, and a skipped midnight to the instant the clock jumped
    # (the offset before the gap applies), which is the first instant after it.
    candidate = midnight.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if _local_date(candidate, zone) >= day and _local_date(candidate - _TICK, zone) < day:
        return candidate
    return _search_start_of_day(day, zone, midnight)


def _search_start_of_day(day: dt.date, zone: ZoneInfo, midnight: dt.datetime) -> dt.datetime:
    """Exact fallback for transitions that straddle midnight without landing on it.

    Within a stretch of constant UTC offset ``o`` the local date reaches ``day`` at ``midnight - o``, so the answer is
    the earliest such point that lies inside its own stretch. Offset changes are found by bisection to the microsecond.
    """
    lo = (midnight - dt.timedelta(hours=30)).replace(tzinfo=UTC)
    hi = (midnight + dt.timedelta(hours=30)).replace(tzinfo=UTC)
    step = dt.timedelta(minutes=15)
    boundaries = [lo]
    t = lo
    while t < hi:
        nxt = min(t + step, hi)
        if t.astimezone(zone).utcoffset() != nxt.astimezone(zone).utcoffset():
            a, b = t, nxt
            while b - a > _TICK:
                mid = a + (b - a) / 2
                if mid.astimezone(zone).utcoffset() == a.astimezone(zone).utcoffset():
                    a = mid
                else:
                    b = mid
            boundaries.append(b)
        t = nxt
    boundaries.append(hi)
    for seg_start, seg_end in zip(boundaries, boundaries[1:], strict=False):
        offset = seg_start.astimezone(zone).utcoffset()
        reach = (midnight - offset).replace(tzinfo=UTC)
        first = max(seg_start, reach)
        if first < seg_end:
            return first
    raise CalendarError(f"could not place the start of {day} in {zone.key}")  # pragma: no cover - no zone does this


def window_for(business_date: dt.date, timezone: str) -> ExportWindow:
    """Computes the canonical window of ``business_date`` in ``timezone``.

    Example:
        >>> w = window_for(dt.date(2026, 3, 8), "America/New_York")
        >>> (utc_iso(w.start_utc), utc_iso(w.end_utc), w.duration)
        ('2026-03-08T05:00:00Z', '2026-03-09T04:00:00Z', datetime.timedelta(seconds=82800))
    """
    zone = load_zone(timezone)
    start = _start_of_day(business_date, zone)
    end = _start_of_day(business_date + _ONE_DAY, zone)
    return ExportWindow(business_date=business_date, timezone=timezone, start_utc=start, end_utc=end)


def windows_between(first: dt.date, last: dt.date, timezone: str) -> list[ExportWindow]:
    """All windows from ``first`` to ``last`` inclusive, sharing each boundary between neighbours."""
    zone = load_zone(timezone)
    days = (last - first).days + 1
    starts = [_start_of_day(first + dt.timedelta(days=i), zone) for i in range(days + 1)]
    return [ExportWindow(first + dt.timedelta(days=i), timezone, starts[i], starts[i + 1]) for i in range(days)]


@functools.cache
def tz_database_version(timezone: str) -> str:
    """Names the tz database that :mod:`zoneinfo` reads ``timezone`` from, e.g. ``system 2025b`` or ``tzdata 2026f``.

    zoneinfo searches the system database before the ``tzdata`` wheel, so two machines can disagree about a zone's
    rules; the ledger records this string next to every window it computes.
    """
    relative = Path(*timezone.split("/"))
    for root in TZPATH:
        if (Path(root) / relative).is_file():
            version = "unknown"
            zi = Path(root) / "tzdata.zi"
            if zi.is_file():
                with zi.open(encoding="utf-8") as handle:
                    first = handle.readline().strip()
                if first.startswith("# version "):
                    version = first.removeprefix("# version ")
            return f"system {version}"
    try:
        import tzdata

        return f"tzdata {tzdata.IANA_VERSION}"
    except ImportError:  # pragma: no cover - tzdata is a declared dependency
        return "unknown"


def local_time_exists_once(day: dt.date, at: dt.time, timezone: str) -> bool:
    """True when wall time ``at`` occurs exactly once on ``day`` in ``timezone`` (neither skipped nor repeated)."""
    zone = load_zone(timezone)
    naive = dt.datetime.combine(day, at)
    first = naive.replace(tzinfo=zone, fold=0)
    second = naive.replace(tzinfo=zone, fold=1)
    if first.utcoffset() != second.utcoffset():
        return False  # skipped (gap) or repeated (fold)
    roundtrip = first.astimezone(UTC).astimezone(zone).replace(tzinfo=None)
    return roundtrip == naive


DEFAULT_TIMEZONE = "America/New_York"
DEFAULT_START_DATE = "2026-01-01"
LAST_CHECKED_YEAR = 2037


@dataclass(frozen=True)
class ZoneMove:
    """A tenant's business day moved to another zone: from business date ``on`` the day is the new zone's, and
    before it ``from_zone``'s.

    Each day starts where the previous day's zone starts it (see :meth:`ExportCalendar.window_of`), so the day of the
    move begins at ``from_zone``'s midnight and ends at the new zone's: the last day in the old zone keeps the
    window it always had, the windows still tile UTC, and no event falls into two windows or into none. Moving west
    lengthens the day of the move (New York to Chicago: 25 hours); moving east shortens it. The day of the move must
    not have been exported under the old zone (``accept-contract`` refuses such a move).

    Attributes:
        on: The first business date in the new zone, ``YYYY-MM-DD``.
        from_zone: The IANA zone in force before ``on``.
    """

    on: str
    from_zone: str

    def __post_init__(self) -> None:
        parse_business_date(self.on)
        load_zone(self.from_zone)

    @property
    def on_date(self) -> dt.date:
        return parse_business_date(self.on)


@dataclass(frozen=True)
class ExportCalendar:
    """Daily business dates in ``timezone`` starting at ``start_date`` (``YYYY-MM-DD``), optionally after earlier
    zones (``moves``, oldest first): ``timezone`` is the zone in force after the last move.

    Example:
        >>> cal = ExportCalendar("America/New_York", "2026-01-01")
        >>> utc_iso(cal.window("2026-03-08").end_utc)
        '2026-03-09T04:00:00Z'
        >>> moved = ExportCalendar("America/Chicago", "2026-01-01", (ZoneMove("2026-04-01", "America/New_York"),))
        >>> moved.window("2026-04-01").duration  # the day of the move: from New York's midnight to Chicago's
        datetime.timedelta(days=1, seconds=3600)
    """

    timezone: str = DEFAULT_TIMEZONE
    start_date: str = DEFAULT_START_DATE
    moves: tuple[ZoneMove, ...] = ()

    def __post_init__(self) -> None:
        load_zone(self.timezone)
        first = parse_business_date(self.start_date)
        moves = tuple(self.moves)
        object.__setattr__(self, "moves", moves)
        previous = first
        for i, move in enumerate(moves):
            if not isinstance(move, ZoneMove):
                raise CalendarError(f"moves must be ZoneMove values, got {type(move).__name__}")
            if move.on_date <= previous:
                raise CalendarError(
                    f"zone move on {move.on} must come after the start date {self.start_date} and after the move "
                    "before it"
                )
            after = moves[i + 1].from_zone if i + 1 < len(moves) else self.timezone
            if after == move.from_zone:
                raise CalendarError(f"zone move on {move.on} moves from {move.from_zone} to the same zone")
            previous = move.on_date

    @property
    def first_date(self) -> dt.date:
        return parse_business_date(self.start_date)

    @property
    def zones(self) -> tuple[str, ...]:
        """Every zone of the calendar, oldest first."""
        return (*(m.from_zone for m in self.moves), self.timezone)

    def zone_on(self, day: dt.date) -> str:
        """The zone whose business day ``day`` is."""
        for move in self.moves:
            if day < move.on_date:
                return move.from_zone
        return self.timezone

    def contract(self) -> dict:
        """What an export's history depends on: the ledger refuses to run under a different one unaccepted."""
        return calendar_contract(self.timezone, self.start_date, self.moves)

    def window(self, partition_key: str) -> ExportWindow:
        """The canonical window for a partition key; refuses keys before the calendar starts."""
        day = parse_business_date(partition_key)
        if day < self.first_date:
            raise CalendarError(
                f"partition key {partition_key!r} is before the calendar start {self.start_date} ({self.timezone})"
            )
        return self.window_of(day)

    def window_of(self, day: dt.date) -> ExportWindow:
        """The window of business date ``day``: ``[B(day), B(day + 1))`` where ``B(d)`` is the start of ``d`` in the
        zone of ``d - 1``: a day starts where the day before it ends. Without moves it is :func:`window_for`; with
        them only the day of each move differs, starting at the old zone's midnight and ending at the new zone's."""
        if not self.moves:
            return window_for(day, self.timezone)
        zone = self.zone_on(day)
        start = _start_of_day(day, load_zone(self.zone_on(day - _ONE_DAY)))
        end = _start_of_day(day + _ONE_DAY, load_zone(zone))
        if end < start:
            raise CalendarError(
                f"moving from {self.zone_on(day - _ONE_DAY)} to {zone} on {day} would make that day end before it "
                "starts: the zones are more than a day apart"
            )
        return ExportWindow(business_date=day, timezone=zone, start_utc=start, end_utc=end)

    def windows(self, first: dt.date, last: dt.date) -> list[ExportWindow]:
        """Every window from ``first`` to ``last`` inclusive."""
        if not self.moves:
            return windows_between(first, last, self.timezone)
        return [self.window_of(first + dt.timedelta(days=i)) for i in range((last - first).days + 1)]


def calendar_contract(timezone: str, start_date: str, moves: tuple[ZoneMove, ...] = ()) -> dict:
    """The calendar contract of a daily export or tenant: zone, start date, cadence, the window policy, and the
    earlier zones when it moved (absent otherwise, so contracts recorded before moves existed still match)."""
    contract: dict = {
        "timezone": timezone,
        "start_date": start_date,
        "cadence": "daily",
        "window_policy": WINDOW_POLICY,
    }
    if moves:
        contract["moves"] = [{"on": m.on, "from": m.from_zone} for m in moves]
    return contract


def check_schedule_time(calendar: ExportCalendar, at: dt.time, until_year: int = LAST_CHECKED_YEAR) -> None:
    """Refuses a wall time that is skipped or repeated on any day from the calendar start to ``until_year``.

    Dagster shifts a skipped or doubled time only for hours 1-3 and not at all around midnight transitions, so the
    schedule is kept to a time where there is nothing to shift.
    """
    _check_schedule_time(calendar.timezone, calendar.first_date, at, until_year)


@functools.cache
def _check_schedule_time(timezone: str, first: dt.date, at: dt.time, until_year: int) -> None:
    last = dt.date(until_year, 12, 31)
    zone = load_zone(timezone)
    # Only a day with a clock change can skip or repeat a wall time: find those from the offsets at local midnights
    # (cheap), and look closely at them alone. Code locations with dozens of zones load in well under a second.
    day = first
    offset = dt.datetime(day.year, day.month, day.day, tzinfo=zone).utcoffset()
    while day <= last:
        following = day + _ONE_DAY
        midnight = dt.datetime(following.year, following.month, following.day, tzinfo=zone)
        next_offset = midnight.utcoffset()
        # A change within the day, or at either midnight (fold=1 differs from fold=0 only at a skipped or repeated
        # wall time): the latter catches a repeated hour that ends the day.
        changes = offset != next_offset or next_offset != midnight.replace(fold=1).utcoffset() or day == first
        # A calendar day the zone skipped entirely has no wall times at all; there is nothing to run on it.
        if changes and not window_for(day, timezone).is_empty and not local_time_exists_once(day, at, timezone):
            raise CalendarError(
                f"schedule time {at.isoformat('minutes')} does not occur exactly once on {day} in "
                f"{timezone} (a clock change skips or repeats it); choose a time that occurs once every day"
            )
        day, offset = following, next_offset
