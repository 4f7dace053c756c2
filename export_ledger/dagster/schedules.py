"""The nightly schedule of one export: one run per day, for the previous business day, at a local time that always
exists once (checked by :func:`export_ledger.calendar.check_schedule_time` when the export is declared)."""

from __future__ import annotations

import datetime as dt

import dagster as dg

from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup


def build_nightly_schedule(
    job: dg.UnresolvedAssetJobDefinition, spec: ExportSpec, group: TenantGroup | None = None
) -> dg.ScheduleDefinition:
    """Each day at the group's ``schedule_time`` (local to its zone; default the export's only group), the partition of
    the previous business day: ``nightly_<asset name>``."""
    group = group or spec.groups[0]
    at = dt.time.fromisoformat(group.schedule_time or spec.schedule_time)
    return dg.build_schedule_from_partitioned_job(
        job,
        name=f"nightly_{group.asset_name}",
        hour_of_day=at.hour,
        minute_of_hour=at.minute,
        default_status=dg.DefaultScheduleStatus.RUNNING,
    )
