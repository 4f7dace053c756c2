"""Tenants with business days of their own: a zone (and a nightly time) per tenant, grouped for Dagster.

Plain Python, no Dagster. An export declares its tenants as plain ids (every tenant in the export's zone) or as
:class:`Tenant` values (or a mapping ``id -> zone``); :func:`tenant_groups` then puts together the tenants whose
business day is one zone's **on each date**, because one Dagster partitions definition has one zone and one run
exports one business date of one zone. A tenant that moved zones belongs to its earlier zone's group for the dates
before the move, and to its new zone's from the move on: every date of a tenant is exported by the asset whose
partitions are that date's windows, so no run asks for a day that has not ended in the tenant's own zone.

Example:
    >>> groups = tenant_groups("orders", "America/New_York", "04:30",
    ...                        [Tenant("acme"), Tenant("bombay-traders", "Asia/Kolkata")])
    >>> [(g.asset_name, g.timezone, g.tenants) for g in groups]
    [('orders', 'America/New_York', ('acme',)), ('orders__asia_kolkata', 'Asia/Kolkata', ('bombay-traders',))]
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from export_ledger.calendar import ExportCalendar, ZoneMove, load_zone
from export_ledger.errors import CalendarError, ConfigurationError
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
            try:
                load_zone(self.timezone)
            except CalendarError as exc:  # a typo in one tenant's zone among many: say whose
                raise ConfigurationError(f"tenant {self.id!r}: {exc}") from None
        object.__setattr__(self, "moves", tuple(self.moves))
        if self.moves and self.timezone is None:
            raise ConfigurationError(f"tenant {self.id!r} has zone moves: name the zone it moved to (timezone=...)")


@dataclass(frozen=True)
class TenantGroup:
    """The tenants of one export whose business day is one zone's (on some dates): in Dagster one asset, one
    partitions definition, one job and one nightly schedule.

    Attributes:
        export: The export's name.
        asset_name: ``export`` for the export's own zone, else ``<export>__<zone slug>`` (``orders__asia_kolkata``).
        timezone: The zone of the group's partitions.
        schedule_time: Local ``HH:MM`` of the group's nightly run, or None for no schedule.
        tenants: Every tenant that is in the zone on some date, in declaration order.
        spans: Per tenant, the business dates it is in the zone: ``(first, last)``, ``None`` for "from the calendar's
            start" and "still".
    """

    export: str
    asset_name: str
    timezone: str
    schedule_time: str | None
    tenants: tuple[str, ...]
    spans: tuple[tuple[str, dt.date | None, dt.date | None], ...] = ()

    def tenants_on(self, day: dt.date) -> tuple[str, ...]:
        """The tenants whose business day ``day`` is this zone's."""
        if not self.spans:
            return self.tenants
        return tuple(
            tenant
            for tenant, first, last in self.spans
            if (first is None or first <= day) and (last is None or day <= last)
        )

    @property
    def last_date(self) -> dt.date | None:
        """The group's last business date when every tenant has moved away from its zone; None while one is in it."""
        if not self.spans or any(last is None for _, _, last in self.spans):
            return None
        return max(last for _, _, last in self.spans)


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
    """Groups ``tenants`` by the zone of each of their business dates: the export's own zone first (named like the
    export, so an export that gains a tenant elsewhere keeps its asset), then the others by zone name. A tenant that
    moved is in its earlier zone's group until the day before its move.

    Raises:
        ConfigurationError: two tenants of one zone ask for different nightly times (tenants in it today; a tenant
            that left the zone does not vote), or two zones' names would make the same asset name.
    """
    by_zone: dict[str, list[tuple[Tenant, dt.date | None, dt.date | None]]] = {}
    for tenant in tenants:
        first: dt.date | None = None
        for move in tenant.moves:
            by_zone.setdefault(move.from_zone, []).append((tenant, first, move.on_date - dt.timedelta(days=1)))
            first = move.on_date
        by_zone.setdefault(tenant.timezone or timezone, []).append((tenant, first, None))
    groups, names = [], {}
    for zone in sorted(by_zone, key=lambda z: (z != timezone, z)):
        members = by_zone[zone]
        voting = [t for t, _, last in members if last is None] or [t for t, _, _ in members]
        times = {t.schedule_time or schedule_time for t in voting}
        if len(times) > 1:
            shown = ", ".join(f"{t.id} at {t.schedule_time or schedule_time}" for t in voting)
            raise ConfigurationError(
                f"tenants of {zone} share one nightly run (one partition of one asset), but ask for different times: "
                f"{shown}; give them one schedule_time"
            )
        name = export if zone == timezone else f"{export}__{zone_slug(zone)}"
        if name in names:
            raise ConfigurationError(f"zones {names[name]} and {zone} would both be the asset {name!r}")
        names[name] = zone
        ids = tuple(dict.fromkeys(t.id for t, _, _ in members))
        spans = tuple((t.id, first, last) for t, first, last in members)
        groups.append(TenantGroup(export, name, zone, times.pop(), ids, spans))
    return tuple(groups)


def tenant_calendar(tenant: Tenant, timezone: str, start_date: str) -> ExportCalendar:
    """The tenant's calendar: its zone (or the export's), the export's start date, its moves."""
    return ExportCalendar(timezone=tenant.timezone or timezone, start_date=start_date, moves=tenant.moves)


def run_tenants(requested: Sequence[str], group: TenantGroup, groups: Sequence[TenantGroup]) -> tuple[str, ...]:
    """The tenants a run of ``group``'s asset is asked to export alone (a run or backfill scoped to some tenants),
    in the group's order, checked against the export's tenants (``groups``: every group of the export). A tenant of
    the export whose business days are another zone's asset's is not this asset's to export: it is left out (a
    backfill of every zone's asset tagged with one tenant exports it in its own zone, and nothing elsewhere), so the
    result may be empty.

    Raises:
        ConfigurationError: a name is empty, repeated, or not a tenant of the export; nothing is run.
    """
    names = [name.strip()[:64] for name in requested]  # a pasted paragraph is named by its start, not echoed whole
    if not names or any(not name for name in names):
        raise ConfigurationError(
            "the run's tenants are empty or have an empty name: give tenant ids separated by commas, "
            "or leave the tenants out to export every tenant"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigurationError(f"the run's tenants name {', '.join(repeated)} more than once")
    elsewhere = {
        name: other.asset_name
        for other in groups
        if other.asset_name != group.asset_name
        for name in other.tenants
        if name not in group.tenants
    }
    problems = [
        f"{name} (not a tenant of the export {group.export})"
        for name in names
        if name not in group.tenants and name not in elsewhere
    ]
    if problems:
        more = f", ... ({len(group.tenants)} in all)" if len(group.tenants) > 10 else ""
        shown = ", ".join(group.tenants[:10]) + more
        raise ConfigurationError(
            f"the run asks for tenants that {group.asset_name} does not export: {'; '.join(problems)}. "
            f"Its tenants: {shown}. Nothing was exported"
        )
    wanted = set(names)
    return tuple(tenant for tenant in group.tenants if tenant in wanted)


def run_scope(
    tagged: str | None, configured: Sequence[str], group: TenantGroup, groups: Sequence[TenantGroup]
) -> tuple[str, ...] | None:
    """The tenants a run of ``group``'s asset exports alone, from its tag's value (tenant ids separated by commas;
    None: no tag) and its config's list (empty: none); None: every tenant of the asset.

    Raises:
        ConfigurationError: either names a tenant the asset does not export (see :func:`run_tenants`), or both are
            given and differ.
    """
    from_tag = run_tenants(tagged.split(","), group, groups) if tagged is not None else None
    from_config = run_tenants(configured, group, groups) if configured else None
    if from_tag is not None and from_config is not None and set(from_tag) != set(from_config):
        raise ConfigurationError(
            f"the run's tag ({', '.join(from_tag)}) and its config's tenants ({', '.join(from_config)}) differ: give "
            "one of them; nothing was exported"
        )
    return from_config if from_config is not None else from_tag
