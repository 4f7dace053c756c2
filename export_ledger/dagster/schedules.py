"""The nightly schedule of one export: one run per day, for the previous business day, at a local time that always
exists once (checked by :func:`export_ledger.calendar.check_schedule_time` when the export is declared)."""

from __future__ import annotations

import dagster as dg

from export_ledger.spec import ExportSpec


def build_nightly_schedule(job: dg.UnresolvedAssetJobDefinition, spec: ExportSpec) -> dg.ScheduleDefinition:
    """Each day at the export's ``schedule_time`` (local to its zone), the partition of the previous business day."""
    at = spec.nightly_at
    return dg.build_schedule_from_partitioned_job(
        job,
        name=f"nightly_{spec.name}",
        hour_of_day=at.hour,
        minute_of_hour=at.minute,
        default_status=dg.DefaultScheduleStatus.RUNNING,
    )
