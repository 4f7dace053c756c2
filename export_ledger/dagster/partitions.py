"""The Dagster side of the export calendar: daily partitions in the calendar's zone, and a cross-check of windows."""

from __future__ import annotations

import datetime as dt

import dagster as dg

from export_ledger.calendar import ExportCalendar, ExportWindow


def partitions_def(calendar: ExportCalendar, last_date: dt.date | None = None) -> dg.DailyPartitionsDefinition:
    """Daily partitions whose keys are the calendar's business dates (up to ``last_date`` when given: a zone every
    tenant has moved away from)."""
    end = None if last_date is None else (last_date + dt.timedelta(days=1)).isoformat()
    return dg.DailyPartitionsDefinition(start_date=calendar.start_date, timezone=calendar.timezone, end_date=end)


def calendar_of(definition: dg.TimeWindowPartitionsDefinition) -> ExportCalendar:
    """The calendar behind a daily partitions definition built by :func:`partitions_def`."""
    return ExportCalendar(timezone=definition.timezone, start_date=definition.start.strftime("%Y-%m-%d"))


def dagster_disagreement(window: ExportWindow, dagster_window: dg.TimeWindow) -> str | None:
    """Describes how Dagster's window for the same key differs from ours, or None when they agree.

    Compared as instants (timestamps), never as wall clocks: Dagster can hand back a non-existent local midnight.
    """
    ours = (window.start_utc.timestamp(), window.end_utc.timestamp())
    theirs = (dagster_window.start.timestamp(), dagster_window.end.timestamp())
    if ours == theirs:
        return None
    return (
        f"Dagster's window for {window.business_date} in {window.timezone} is "
        f"[{dagster_window.start.isoformat()}, {dagster_window.end.isoformat()}); the export calendar's is "
        f"[{window.start_utc.isoformat()}, {window.end_utc.isoformat()}), which is used"
    )
