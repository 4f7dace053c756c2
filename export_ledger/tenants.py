"""Tenants with business days of their own: a zone (and a nightly time) per tenant, grouped for Dagster.

Plain Python, no Dagster. An export declares its tenants as plain ids (every tenant in the export's zone) or as
:class:`Tenant` values (or a mapping ``id -> zone``); :func:`tenant_groups` then puts the tenants that share a zone
together, because one Dagster partitions definition has one zone and one run exports one business date of one zone.

Example:
    >>> groups = tenant_groups("orders", "America/New_York", "04:30",
    ...                        [Tenant("acme"), Tenant("bombay-traders", "Asia/Kolkata")])
    >>> [(g.asset_name, g.timezone, g.tenants) for g in groups]
    [('orders', 'America/New_York', ('acme',)), ('orders__asia_kolkata', 'Asia/Kolkata', ('bombay-traders',))]
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from export_ledger.calendar import ExportCalendar, ZoneMove, load_zone
from export_ledger.errors import ConfigurationError
from export_ledger.keys import validate_slug


@dataclass(frozen=True)
class Tenant:
    """One tenant of an export, with its own business day where it differs from the export's.

    Attributes:
        id: The tenant id (a slug): part of every logical key and of the published layout.
        timezone: The IANA zone of the tenant's business day; None: the export's zone.
        schedule_time: Local ``HH:MM`` of the tenant's nightly run; None: the export's. Tenants of one zone share
            one nightly run, so they must agree on it.
        moves: Earlier zones of the tenant, oldest first (see :class:`~export_ledger.calendar.ZoneMove`);
            ``timezone`` is the zone since the last move.
    """

    id: str
    timezone: str | None = None
    schedule_time: str | None = None
    moves: tuple[ZoneMove, ...] = ()

    def __post_init__(self) -> None:
        validate_slug(self.id, "tenant id")
        if self.timezone is not None:
            load_zone(self.timezone)
        object.__setattr__(self, "moves", tuple(self.moves))
        if self.moves and self.timezone is None:
            raise ConfigurationError(f"tenant {self.id!r} has zone moves: name the zone it moved to (timezone=...)")


@dataclass(frozen=True)
class TenantGroup:
    """The tenants of one export that share a zone: in Dagster one asset, one partitions definition, one job and one
    nightly schedule.

    Attributes:
        export: The export's name.
        asset_name: ``export`` for the export's own zone, else ``<export>__<zone slug>`` (``orders__asia_kolkata``).
        timezone: The zone of the group's partitions (each tenant's current zone).
        schedule_time: Local ``HH:MM`` of the group's nightly run, or None for no schedule.
        tenants: The tenant ids, in declaration order.
    """

    export: str
    asset_name: str
    timezone: str
    schedule_time: str | None
    tenants: tuple[str, ...]


def as_tenants(tenants: Sequence[str | Tenant] | Mapping[str, str | Tenant | None]) -> tuple[Tenant, ...]:
    """Normalizes the forms an export accepts: ids, :class:`Tenant` values, or a mapping ``id -> zone`` (or ``id ->
    Tenant``, or ``id -> None`` for the export's zone)."""
    if isinstance(tenants, str):
        raise ConfigurationError(f"tenants must be a list of tenant ids or a mapping of id to zone, got {tenants!r}")
    if isinstance(tenants, Mapping):
        result = []
        for tenant_id, value in tenants.items():
            if isinstance(value, Tenant):
                if value.id != tenant_id:
                    raise ConfigurationError(f"tenant {tenant_id!r} maps to Tenant({value.id!r}): the ids must match")
                result.append(value)
            elif value is None or isinstance(value, str):
                result.append(Tenant(tenant_id, value))
            else:
                raise ConfigurationError(
                    f"tenant {tenant_id!r}: expected a zone name or a Tenant, got {type(value).__name__}"
                )
        return tuple(result)
    return tuple(t if isinstance(t, Tenant) else Tenant(t) for t in tenants)


_SIGNED_HOUR = re.compile(r"([+-])(\d)")


def zone_slug(zone: str) -> str:
    """A zone name as part of an asset name: ``Asia/Kolkata`` -> ``asia_kolkata``, ``Etc/GMT+5`` -> ``etc_gmt_plus_5``,
    ``America/Port-au-Prince`` -> ``america_port_au_prince``."""
    text = _SIGNED_HOUR.sub(lambda m: ("_plus_" if m.group(1) == "+" else "_minus_") + m.group(2), zone)
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def tenant_groups(
    export: str, timezone: str, schedule_time: str | None, tenants: Sequence[Tenant]
) -> tuple[TenantGroup, ...]:
    """Groups ``tenants`` by zone: the export's own zone first (named like the export, so an export that gains a
    tenant elsewhere keeps its asset), then the others by zone name.

    Raises:
        ConfigurationError: two tenants of one zone ask for different nightly times, or two zones' names would
            make the same asset name.
    """
    by_zone: dict[str, list[Tenant]] = {}
    for tenant in tenants:
        by_zone.setdefault(tenant.timezone or timezone, []).append(tenant)
    groups, names = [], {}
    for zone in sorted(by_zone, key=lambda z: (z != timezone, z)):
        members = by_zone[zone]
        times = {t.schedule_time or schedule_time for t in members}
        if len(times) > 1:
            shown = ", ".join(f"{t.id} at {t.schedule_time or schedule_time}" for t in members)
            raise ConfigurationError(
                f"tenants of {zone} share one nightly run (one partition of one asset), but ask for different times: "
                f"{shown}; give them one schedule_time"
            )
        name = export if zone == timezone else f"{export}__{zone_slug(zone)}"
        if name in names:
            raise ConfigurationError(f"zones {names[name]} and {zone} would both be the asset {name!r}")
        names[name] = zone
        groups.append(TenantGroup(export, name, zone, times.pop(), tuple(t.id for t in members)))
    return tuple(groups)


def tenant_calendar(tenant: Tenant, timezone: str, start_date: str) -> ExportCalendar:
    """The tenant's calendar: its zone (or the export's), the export's start date, its moves."""
    return ExportCalendar(timezone=tenant.timezone or timezone, start_date=start_date, moves=tenant.moves)
