"""The nightly schedule: one run per day, for the previous business day, at a local time that always exists once."""

from __future__ import annotations

import datetime as dt

import dagster as dg

from assets.calendar import ExportCalendar
from assets.windows import CalendarError, local_time_exists_once, windows_between

LAST_CHECKED_YEAR = 2037


def check_schedule_time(calendar: ExportCalendar, at: dt.time, until_year: int = LAST_CHECKED_YEAR) -> None:
    """Refuses a wall time that is skipped or repeated on any day from the calendar start to ``until_year``.

    Dagster shifts a skipped or doubled time only for hours 1-3 and not at all around midnight transitions, so the
    schedule is kept to a time where there is nothing to shift.
    """
    first = calendar.first_date
    last = dt.date(until_year, 12, 31)
    if first > last:
        return
    for window in windows_between(first, last, calendar.timezone):
        # A calendar day the zone skipped entirely has no wall times at all; there is nothing to run on it.
        if not window.is_empty and not local_time_exists_once(window.business_date, at, calendar.timezone):
            raise CalendarError(
                f"schedule time {at.isoformat('minutes')} does not occur exactly once on {window.business_date} in "
                f"{calendar.timezone} (a clock change skips or repeats it); choose a time that occurs once every day"
            )


def build_nightly_schedule(
    job: dg.UnresolvedAssetJobDefinition, calendar: ExportCalendar, at: dt.time
) -> dg.ScheduleDefinition:
    """Each day at ``at`` (local to the calendar zone) requests the partition of the previous business day."""
    check_schedule_time(calendar, at)
    return dg.build_schedule_from_partitioned_job(
        job,
        name="nightly_invoice_export",
        hour_of_day=at.hour,
        minute_of_hour=at.minute,
        default_status=dg.DefaultScheduleStatus.RUNNING,
    )
