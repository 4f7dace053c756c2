"""Deadlines: an export declared with ``deadline="06:00"`` is due, for each tenant and business date, at 06:00 on the
morning after that date in the tenant's own zone. A key that is not completed by then is late, and a late key waits
for a person like a stuck one: it is listed by ``export-ledger status --needs-attention -f ...``, fails
``no_stuck_exports``, and its partition's ``partition_health`` says so. Plain Python, no Dagster.

A key that was never attempted has no row in the ledger; lateness is read against the declared tenants and dates,
so a nightly run that never started (a scheduler down, a code location that did not load) is found too.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from export_ledger.calendar import load_zone
from export_ledger.keys import LogicalKey
from export_ledger.ledger import Escalation, ExportLedger, ExportState
from export_ledger.spec import ExportSpec

#: Business dates looked at behind the latest one due: a key later than this is escalated already (its rows, if any,
#: are in ``needs_attention``'s failed/stuck rules); this keeps every read bounded.
DEFAULT_LATE_LOOKBACK_DAYS = 3


def due_at(spec: ExportSpec, tenant: str, day: dt.date) -> dt.datetime | None:
    """When ``tenant``'s key of business date ``day`` is due (UTC), or None when the export declares no deadline."""
    if spec.deadline is None:
        return None
    zone = load_zone(spec.calendar_for(tenant).zone_on(day))
    following = day + dt.timedelta(days=1)
    at = dt.time.fromisoformat(spec.deadline)
    return dt.datetime.combine(following, at, tzinfo=zone).astimezone(dt.UTC)


def with_late(late: Sequence[Escalation], escalations: Sequence[Escalation], limit: int) -> list[Escalation]:
    """The first ``limit`` keys waiting for a person: the late ones first, then the ledger's other escalations (a key
    that is both is listed once, where the ledger puts it, with the ledger's reason)."""
    listed = {e.logical_key for e in escalations}
    return [*(e for e in late if e.logical_key not in listed), *escalations][:limit]


def late_keys(
    ledger: ExportLedger,
    exports: Sequence[ExportSpec],
    *,
    now: dt.datetime | None = None,
    lookback_days: int = DEFAULT_LATE_LOOKBACK_DAYS,
    limit: int = 100,
    beside: tuple[dt.timedelta, int | None] | None = None,
) -> list[Escalation]:
    """Keys past their deadline and not completed, of the last ``lookback_days`` business dates already due, at most
    ``limit`` (tenant, then date order). ``now`` defaults to the ledger's clock. One read per export.

    ``beside``: the ledger's escalation rules (stuck after, max attempts) the late keys are counted beside. A late key
    the ledger escalates anyway (failed with its reruns spent, say) is then left out, so that a count of both, and
    their listing (:func:`with_late`), counts it once. One more read per export."""
    now = now or ledger.now()
    found: list[Escalation] = []
    for spec in exports:
        if spec.deadline is None:
            continue
        expected: dict[tuple[str, dt.date], dt.datetime] = {}
        for tenant in spec.tenants:
            calendar = spec.calendar_for(tenant)
            # The latest business dates already due in the tenant's zone: today's date there is never due yet.
            today = now.astimezone(load_zone(calendar.zone_on(now.date()))).date()
            taken = 0
            for back in range(1, lookback_days + 2):
                day = today - dt.timedelta(days=back)
                if day < calendar.first_date or taken == lookback_days:
                    break
                due = due_at(spec, tenant, day)
                if due is None or due > now:
                    continue  # yesterday, before this morning's deadline
                taken += 1
                if not calendar.window(day.isoformat()).is_empty:
                    expected[(tenant, day)] = due
        if not expected:
            continue
        days = sorted({day for _, day in expected})
        escalated = (
            set()
            if beside is None
            else {
                e.logical_key
                for e in ledger.attention.escalated_keys(
                    beside[0], export=spec.name, business_dates=days, max_attempts=beside[1], limit=len(expected)
                )
            }
        )
        records = {
            (r.tenant, r.business_date): r
            for r in ledger.queries.records(export=spec.name, business_dates=days, tenants=list(spec.tenants))
        }
        for (tenant, day), due in sorted(expected.items()):
            record = records.get((tenant, day))
            if record is not None and (record.state is ExportState.COMPLETED or record.logical_key in escalated):
                continue
            state = record.state.value if record is not None else "never attempted"
            zone = spec.calendar_for(tenant).zone_on(day)
            key = record.logical_key if record is not None else str(
                LogicalKey(spec.name, tenant, spec.calendar_for(tenant).window(day.isoformat()))
            )
            found.append(
                Escalation(
                    spec.name, tenant, zone, key, "late", due,
                    f"late: due at {spec.deadline} {zone} on {(day + dt.timedelta(days=1)).isoformat()}, and "
                    f"{state}; launch its partition (dagster asset materialize ... --partition {day.isoformat()}) "
                    "or find why the nightly run did not export it",
                    record, day,
                )  # fmt: skip
            )
            if len(found) >= limit:
                return found
    return found
