"""Business dates that were asked for and whose keys the ledger never heard of.

The ledger knows a key from its first claim. A run that fails before it claims anything (its code location did not
load, the ledger or a resource was unreachable when it started, it was refused by a calendar contract) leaves no row:
the reconciliation passes that read the ledger never see it. Two things are left to find them by:

- the run itself, failed in the orchestrator's records, with the dates it was for: :func:`missing_keys` counts, per
  date, the tenants of the zone's asset that have no key;
- a contract refusal, which keeps the dates whose claims it refused: once it closes (an operator accepted the
  contract, or the code went back to the recorded one) :func:`refused_dates` names those dates that still have no key
  of the tenant, to be launched again.

Dates at or below the export's low-water mark (pruned: no claim is taken there) are never counted. Nothing here
decides how often to launch: the reconciliation sensor caps it (its ``max_attempts``) and notes a partition it gives
up on (:meth:`~export_ledger.ledger.attention.Attention.note_missed`), so that it is escalated.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from export_ledger.ledger import ExportLedger
from export_ledger.spec import ExportSpec
from export_ledger.tenants import TenantGroup

#: Days read per ledger statement (bound parameters stay few whatever the range).
DAYS_PER_READ = 100
#: Open refusals read per export when counting what is missing (they are escalated on their own).
REFUSALS_READ = 1000


@dataclass(frozen=True)
class Excluded:
    """What :func:`missing_keys` never counts for an export: dates at or below its low-water mark, and tenants with
    an open contract refusal (escalated on their own; their dates are launched again when the refusal closes).
    Read once per export and sensor tick, however many failed runs it looks at."""

    low_water: dt.date | None
    refused: frozenset[str]

    @classmethod
    def read(cls, ledger: ExportLedger, export: str) -> Excluded:
        refusals = ledger.contracts.refusals(exports=[export], limit=REFUSALS_READ)
        return cls(ledger.retention.low_water(export), frozenset(row["tenant"] for row in refusals))


def missing_keys(
    ledger: ExportLedger,
    spec: ExportSpec,
    group: TenantGroup,
    days: Sequence[dt.date],
    excluded: Excluded,
    tenants: Sequence[str] | None = None,
) -> dict[dt.date, int]:
    """Per day of ``days`` (business dates of ``group``'s zone), how many of its tenants on that day (of ``tenants``
    only, for a run scoped to them) have no key at all, less what ``excluded`` says; days with none missing are left
    out."""
    if tenants is not None and not tenants:
        return {}  # a run scoped to none of this zone's tenants asked for no key here
    wanted = sorted({day for day in days if excluded.low_water is None or day > excluded.low_water})
    found: dict[dt.date, int] = {}
    for start in range(0, len(wanted), DAYS_PER_READ):
        chunk = wanted[start : start + DAYS_PER_READ]
        summaries = ledger.queries.day_summaries(
            export=spec.name, timezone=group.timezone, days=chunk, tenants=group.tenants if tenants is None else tenants
        )
        for day in chunk:
            expected = [
                tenant
                for tenant in group.tenants_on(day)
                if tenant not in excluded.refused and (tenants is None or tenant in tenants)
            ]
            have = summaries[day].keys if day in summaries else 0
            if len(expected) > have:
                found[day] = len(expected) - have
    return found


def refused_dates(ledger: ExportLedger, spec: ExportSpec, refusal: Mapping) -> dict[TenantGroup, list[dt.date]]:
    """The dates a closed refusal refused that still have no key of its tenant, per asset (zone group) that exports
    the tenant on them under the contract in code; empty once every one has a key (or the export no longer has the
    tenant, or the dates were pruned)."""
    tenant, first, last = refusal["tenant"], refusal.get("first_date"), refusal.get("last_date")
    if first is None or last is None or tenant not in {t for group in spec.groups for t in group.tenants}:
        return {}
    low_water = ledger.retention.low_water(spec.name)
    days = [first + dt.timedelta(days=n) for n in range((last - first).days + 1)]
    days = [day for day in days if low_water is None or day > low_water]
    have = {
        record.business_date
        for record in ledger.queries.records(
            export=spec.name, tenant=tenant, date_from=first, date_to=last, limit=len(days) + 1
        )
    }
    missing: dict[TenantGroup, list[dt.date]] = {}
    for day in days:
        if day in have or day < spec.calendar.first_date:
            continue
        try:
            group = spec.group_of(tenant, day)
        except KeyError:
            continue
        missing.setdefault(group, []).append(day)
    return missing


__all__ = ["Excluded", "missing_keys", "refused_dates"]
