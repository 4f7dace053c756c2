"""The export calendar: daily partitions in an explicit zone, each key mapped to its canonical window.

The window arithmetic lives in :mod:`assets.windows`; this module is the thin Dagster side of it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import dagster as dg

from assets.windows import WINDOW_POLICY, CalendarError, ExportWindow, load_zone, parse_business_date, window_for

DEFAULT_TIMEZONE = "America/New_York"
DEFAULT_START_DATE = "2026-01-01"


@dataclass(frozen=True)
class ExportCalendar:
    """Daily business dates in ``timezone`` starting at ``start_date`` (``YYYY-MM-DD``)."""

    timezone: str = DEFAULT_TIMEZONE
    start_date: str = DEFAULT_START_DATE

    def __post_init__(self) -> None:
        load_zone(self.timezone)
        parse_business_date(self.start_date)

    @property
    def first_date(self) -> dt.date:
        return parse_business_date(self.start_date)

    def contract(self) -> dict[str, str]:
        """What an export's history depends on: the ledger refuses to run under a different one unaccepted."""
        return {
            "timezone": self.timezone,
            "start_date": self.start_date,
            "cadence": "daily",
            "window_policy": WINDOW_POLICY,
        }

    @classmethod
    def of(cls, partitions_def: dg.TimeWindowPartitionsDefinition) -> ExportCalendar:
        """The calendar behind a daily partitions definition built by :meth:`partitions_def`."""
        return cls(timezone=partitions_def.timezone, start_date=partitions_def.start.strftime("%Y-%m-%d"))

    def partitions_def(self) -> dg.DailyPartitionsDefinition:
        return dg.DailyPartitionsDefinition(start_date=self.start_date, timezone=self.timezone)

    def window(self, partition_key: str) -> ExportWindow:
        """The canonical window for a partition key; refuses keys before the calendar starts."""
        day = parse_business_date(partition_key)
        if day < self.first_date:
            raise CalendarError(
                f"partition key {partition_key!r} is before the calendar start {self.start_date} ({self.timezone})"
            )
        return window_for(day, self.timezone)

    def dagster_disagreement(self, window: ExportWindow, dagster_window: dg.TimeWindow) -> str | None:
        """Describes how Dagster's window for the same key differs from ours, or None when they agree.

        Compared as instants (timestamps), never as wall clocks: Dagster can hand back a non-existent local midnight.
        """
        ours = (window.start_utc.timestamp(), window.end_utc.timestamp())
        theirs = (dagster_window.start.timestamp(), dagster_window.end.timestamp())
        if ours == theirs:
            return None
        return (
            f"Dagster's window for {window.business_date} in {self.timezone} is "
            f"[{dagster_window.start.isoformat()}, {dagster_window.end.isoformat()}); the export calendar's is "
            f"[{window.start_utc.isoformat()}, {window.end_utc.isoformat()}), which is used"
        )
