"""Calendar contracts: what each tenant's history depends on, recorded once and changed only by an operator.

A contract is kept per tenant (its row's JSON names the tenant). Rows without a tenant are export-wide: written by
releases before per-tenant zones and by an operator accepting for a whole export; they apply to every tenant, and the
latest row that applies to a tenant is the one in force.

The contract is checked **at claim, in the claim's transaction** (:meth:`Contracts.decide_in`, called by
:mod:`export_ledger.ledger.claims`): an attempt that computed its windows with one contract cannot claim a key after an
operator accepted another, so a zone move accepted while a run is in flight cannot cut a day twice. A tenant refused
this way gets an open row in ``export_contract_refusals``, escalated to a person until an operator accepts a contract
(:meth:`Contracts.accept`) or the code goes back to the recorded one (the next claim closes it).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger.errors import MESSAGE_LIMIT, ContractChanged
from export_ledger.ledger.schema import export_contract_refusals, export_contracts, export_runs

#: The first schema version that keeps contract refusals.
REFUSALS_SCHEMA_VERSION = 6


class Contracts:
    """The calendar contracts of :class:`~export_ledger.ledger.ExportLedger`."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    # -- at claim ----------------------------------------------------------------------------------------------

    def decide_in(
        self,
        conn: Connection,
        contracts: Mapping[tuple[str, str], Mapping],
        now: dt.datetime,
        dates: Mapping[tuple[str, str], tuple[dt.date, dt.date]] | None = None,
    ) -> dict[tuple[str, str], ContractChanged]:
        """Inside a claim's transaction: records each tenant's contract at its first claim, compares the others with
        the one in force, keeps the refusals open (and closes those that match again). Returns the refusals, by
        ``(export, tenant)``. ``dates`` gives the first and last business date each tenant's claim asked for: a
        refusal keeps them, so that they are launched again once it closes.

        On PostgreSQL two first claims of one export must not both record theirs, and a refusal must not be kept
        after an operator's acceptance it did not see: when a contract is to be recorded or a tenant refused, the
        transaction takes an advisory lock on the export's name (the one :meth:`accept` takes; before any row lock, so
        that claims never wait for each other in two orders), then decides again. SQLite's ``BEGIN IMMEDIATE``
        already serializes.
        """
        by_export: dict[str, dict[str, Mapping]] = {}
        for (export, tenant), contract in contracts.items():
            by_export.setdefault(export, {})[tenant] = contract
        refusals: dict[tuple[str, str], ContractChanged] = {}
        for export, wanted in sorted(by_export.items()):
            inserts, refused = self._decisions(conn, export, wanted)
            if (inserts or refused) and _lock_export(conn, export):
                inserts, refused = self._decisions(conn, export, wanted)
            if inserts:
                conn.execute(
                    export_contracts.insert(),
                    [{"export": export, "contract": t, "recorded_at": now, "reason": "first claim"} for t in inserts],
                )
            spans = {tenant: (dates or {}).get((export, tenant)) for tenant in refused}
            self._keep_refusals(conn, export, wanted, refused, now, spans)
            refusals.update({(export, tenant): error for tenant, (error, _) in refused.items()})
        return refusals

    def _decisions(
        self, conn: Connection, export: str, wanted: Mapping[str, Mapping]
    ) -> tuple[list[str], dict[str, tuple[ContractChanged, str]]]:
        """The contracts to record and the refusals (tenant -> (error, recorded JSON))."""
        wide, own = _in_force(conn, export)
        inserts, refused, unsure = [], {}, []
        for tenant, contract in wanted.items():
            text = canonical(contract)
            mine = own.get(tenant)
            recorded = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
            if recorded is None:
                inserts.append(_tenant_row(contract, tenant))
            elif recorded[1] != text:
                unsure.append((tenant, contract, recorded[1], mine is None))
        # A tenant the ledger holds no key of has no history to protect: an export-wide contract that disagrees with
        # it (a new tenant in another zone) does not refuse it; its own contract is recorded instead.
        with_keys = _tenants_with_keys(conn, export, [t for t, _, _, wide_only in unsure if wide_only])
        for tenant, contract, recorded, wide_only in unsure:
            if wide_only and tenant not in with_keys:
                inserts.append(_tenant_row(contract, tenant))
            else:
                refused[tenant] = (changed(export, tenant, recorded, contract), recorded)
        return inserts, refused

    def _keep_refusals(
        self,
        conn: Connection,
        export: str,
        wanted: Mapping[str, Mapping],
        refused: Mapping[str, tuple[ContractChanged, str]],
        now: dt.datetime,
        spans: Mapping[str, tuple[dt.date, dt.date] | None],
    ) -> None:
        """One open refusal row per refused tenant (its count, last time raised and the span of dates refused); a
        tenant whose code matches the recorded contract again has its open row closed, its dates to launch again."""
        if not self.ledger.supports(REFUSALS_SCHEMA_VERSION):
            return
        table = export_contract_refusals
        open_rows = {
            row.tenant: row
            for row in conn.execute(
                sa.select(table.c.id, table.c.tenant, table.c.first_date, table.c.last_date).where(
                    table.c.export == export, table.c.tenant.in_(list(wanted)), table.c.closed_at.is_(None)
                )
            )
        }
        matching = [row.id for tenant, row in open_rows.items() if tenant not in refused]
        if matching:
            conn.execute(
                table.update()
                .where(table.c.id.in_(matching), table.c.closed_at.is_(None))
                .values(closed_at=now, relaunch_pending=table.c.first_date.is_not(None))
            )
        for tenant, (_, recorded) in sorted(refused.items()):
            text = canonical(wanted[tenant])
            span = spans.get(tenant)
            zone = wanted[tenant].get("timezone")
            if tenant in open_rows:
                row = open_rows[tenant]
                first, last = _widen((row.first_date, row.last_date), span)
                conn.execute(
                    table.update()
                    .where(table.c.id == row.id, table.c.closed_at.is_(None))
                    .values(
                        wanted=text, recorded=recorded, last_refused_at=now, refusals=table.c.refusals + 1,
                        timezone=zone, first_date=first, last_date=last,
                    )
                )  # fmt: skip
            else:
                first, last = span if span is not None else (None, None)
                conn.execute(
                    table.insert().values(
                        export=export, tenant=tenant, recorded=recorded, wanted=text, first_refused_at=now,
                        last_refused_at=now, refusals=1, closed_at=None, timezone=zone, first_date=first,
                        last_date=last, relaunch_pending=False,
                    )
                )  # fmt: skip

    def check(self, contracts: Mapping[tuple[str, str], Mapping]) -> dict[tuple[str, str], ContractChanged]:
        """:meth:`decide_in` in a transaction of its own: records first contracts, returns the refusals (kept open
        for escalation). Claims check the contract themselves; this is for a caller that wants to know before."""
        with self.ledger.atomic() as conn:
            return self.decide_in(conn, contracts, self.ledger.now(conn))

    # -- reads ---------------------------------------------------------------------------------------------------

    def recorded(self, export: str) -> dict | None:
        """The export-wide contract in force (recorded by releases before per-tenant zones, or accepted for a whole
        export), or None."""
        with self.ledger.atomic(read_only=True) as conn:
            wide, _ = _in_force(conn, export)
        return None if wide is None else json.loads(wide[1])

    def in_force(self, export: str, tenant: str) -> dict | None:
        """The contract that applies to ``tenant`` (its own or the export-wide one, whichever is later), or None."""
        with self.ledger.atomic(read_only=True) as conn:
            wide, own = _in_force(conn, export)
        mine = own.get(tenant)
        recorded = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
        return None if recorded is None else json.loads(recorded[1])

    def tenant_contracts(self, export: str) -> dict[str, dict]:
        """Each tenant's own contract in force, where no later export-wide one supersedes it."""
        with self.ledger.atomic(read_only=True) as conn:
            wide, own = _in_force(conn, export)
        return {t: json.loads(text) for t, (row_id, text) in own.items() if wide is None or row_id > wide[0]}

    def history(self, export: str) -> list[dict]:
        query = sa.select(export_contracts).where(export_contracts.c.export == export).order_by(export_contracts.c.id)
        with self.ledger.atomic(read_only=True) as conn:
            return [
                {"contract": json.loads(r.contract), "recorded_at": r.recorded_at, "reason": r.reason}
                for r in conn.execute(query)
            ]

    def refusals(self, *, exports=(), tenants=(), limit: int = 100, offset: int = 0) -> list[dict]:
        """Open refusals (a tenant whose code names another contract than the one in force), oldest first."""
        if not self.ledger.supports(REFUSALS_SCHEMA_VERSION):
            return []
        table = export_contract_refusals
        query = sa.select(table).where(table.c.closed_at.is_(None))
        if exports:
            query = query.where(table.c.export.in_(list(exports)))
        if tenants:
            query = query.where(table.c.tenant.in_(list(tenants)))
        query = query.order_by(table.c.first_refused_at, table.c.id).limit(limit).offset(offset)
        with self.ledger.atomic(read_only=True) as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def refusal_counts(self, conn: Connection, exports=()) -> list[sa.Row]:
        """Open refusals counted per (export, zone the code names), in ``conn``'s transaction: ``export``,
        ``timezone``, ``refused`` (tenants), ``latest`` (last refusal) and ``times`` (refusals in all)."""
        if not self.ledger.supports(REFUSALS_SCHEMA_VERSION):
            return []
        table = export_contract_refusals
        return count_open_per_zone(conn, table, ("refused", "latest", "times"), table.c.last_refused_at,
                                   table.c.refusals, exports)  # fmt: skip

    def to_relaunch(self, *, exports=(), limit: int = 100) -> list[dict]:
        """Closed refusals whose refused dates are still to be launched again (:meth:`relaunched` ends that)."""
        if not self.ledger.supports(REFUSALS_SCHEMA_VERSION):
            return []
        table = export_contract_refusals
        query = sa.select(table).where(table.c.relaunch_pending.is_(True))
        if exports:
            query = query.where(table.c.export.in_(list(exports)))
        with self.ledger.atomic(read_only=True) as conn:
            return [dict(row._mapping) for row in conn.execute(query.order_by(table.c.id).limit(limit))]

    def relaunched(self, refusal_id: int) -> None:
        """Every date a closed refusal refused has a key again (claimed by a relaunch or by any run)."""
        table = export_contract_refusals
        with self.ledger.atomic() as conn:
            conn.execute(table.update().where(table.c.id == refusal_id).values(relaunch_pending=False))

    # -- an operator's acceptance ---------------------------------------------------------------------------------

    def accept(self, export: str, contract: Mapping, reason: str, *, tenant: str | None = None) -> None:
        """Records ``contract`` as the one in force for ``tenant`` of ``export`` (every tenant when None), with the
        operator's reason; closes the tenant's (or every tenant's) open refusal.

        Raises:
            ValueError: no reason.
            ContractChanged: the contract puts a day the ledger already holds in another zone than the one it was
                exported in (a zone changed without a move, or a move on or before a day already exported).
        """
        if not reason or not reason.strip():
            raise ValueError("accepting a contract change needs a reason")
        text = canonical(contract) if tenant is None else _tenant_row(contract, tenant)
        ledger = self.ledger
        with ledger.atomic() as conn:
            _lock_export(conn, export)  # a claim deciding on the old contract commits its refusal before, or sees this
            now = ledger.now(conn)
            for first, last, zone in zone_segments(contract):
                # Each business date the ledger already holds stays in the zone it was exported in: a contract that
                # puts it in another zone would re-cut a delivered day (its window, and the destination folder the
                # two keys would share). The day of a move starts at the old zone's midnight and ends at the new
                # one's, so a move must come after every day already exported in the old zone.
                query = sa.select(export_runs.c.business_date, export_runs.c.timezone).where(
                    export_runs.c.export == export, export_runs.c.timezone != zone
                )
                if first is not None:
                    query = query.where(export_runs.c.business_date >= first)
                if last is not None:
                    query = query.where(export_runs.c.business_date <= last)
                if tenant is not None:
                    query = query.where(export_runs.c.tenant == tenant)
                held = conn.execute(query.order_by(export_runs.c.business_date.desc()).limit(1)).first()
                if held is not None:
                    whose = "" if tenant is None else f" (tenant {tenant})"
                    raise ContractChanged(
                        f"{export}{whose} already has {held.business_date} in {held.timezone}: the new contract puts "
                        f"that day in {zone}, which would re-cut a day already exported. Declare the move on the first "
                        f"day of the new zone, after every day exported in the old one (move on "
                        f"{held.business_date + dt.timedelta(days=1)} or later: --move "
                        f"{held.business_date + dt.timedelta(days=1)}:{held.timezone})"
                    )
            conn.execute(
                export_contracts.insert().values(
                    export=export, contract=text, recorded_at=now, reason=reason.strip()[:MESSAGE_LIMIT]
                )
            )
            if ledger.supports(REFUSALS_SCHEMA_VERSION):
                table = export_contract_refusals
                closing = table.update().where(table.c.export == export, table.c.closed_at.is_(None))
                if tenant is not None:
                    closing = closing.where(table.c.tenant == tenant)
                conn.execute(closing.values(closed_at=now, relaunch_pending=table.c.first_date.is_not(None)))


def _lock_export(conn: Connection, export: str) -> bool:
    """PostgreSQL: the transaction-scoped advisory lock of ``export``'s contracts (True when taken). SQLite's write
    transactions are serialized already."""
    if conn.dialect.name != "postgresql":
        return False
    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(export))))
    return True


def _widen(span: tuple[dt.date | None, dt.date | None], more: tuple[dt.date, dt.date] | None):
    first, last = span
    if more is None:
        return first, last
    return (more[0] if first is None else min(first, more[0])), (more[1] if last is None else max(last, more[1]))


def zone_segments(contract: Mapping) -> list[tuple[dt.date | None, dt.date | None, str]]:
    """The business dates of each zone of a contract, oldest first: ``(first, last, zone)``, None for open ends."""
    segments, first = [], None
    for move in contract.get("moves", ()):
        on = dt.date.fromisoformat(move["on"])
        segments.append((first, on - dt.timedelta(days=1), move["from"]))
        first = on
    segments.append((first, None, contract["timezone"]))
    return segments


def canonical(contract: Mapping) -> str:
    """A contract's canonical JSON: what the ledger stores and compares."""
    return json.dumps(dict(contract), sort_keys=True)


def _in_force(conn: Connection, export: str) -> tuple[tuple[int, str] | None, dict[str, tuple[int, str]]]:
    """The latest export-wide contract and each tenant's latest own one, as (row id, canonical JSON)."""
    wide, own = None, {}
    rows = conn.execute(
        sa.select(export_contracts.c.id, export_contracts.c.contract)
        .where(export_contracts.c.export == export)
        .order_by(export_contracts.c.id)
    )
    for row_id, text in rows:
        contract = json.loads(text)
        tenant = contract.pop("tenant", None)
        entry = (row_id, canonical(contract))
        if tenant is None:
            wide = entry
        else:
            own[tenant] = entry
    return wide, own


def _tenants_with_keys(conn: Connection, export: str, tenants: list[str]) -> set[str]:
    if not tenants:
        return set()
    query = (
        sa.select(export_runs.c.tenant).where(export_runs.c.export == export, export_runs.c.tenant.in_(tenants)).distinct()
    )
    return set(conn.execute(query).scalars())


def _tenant_row(contract: Mapping, tenant: str) -> str:
    return json.dumps({**contract, "tenant": tenant}, sort_keys=True)


def accept_command(export: str, contract: Mapping, tenant: str | None) -> str:
    """The command an operator runs to accept ``contract`` (for one tenant, or export-wide)."""
    parts = [f"export-ledger accept-contract --export {export}"]
    if tenant is not None:
        parts.append(f"--tenant {tenant}")
    parts.append(f"--timezone {contract.get('timezone')} --start-date {contract.get('start_date')}")
    parts.extend(f"--move {move['on']}:{move['from']}" for move in contract.get("moves", ()))
    parts.append('--reason "..."')
    return " ".join(parts)


def changed(export: str, tenant: str, recorded: str, contract: Mapping) -> ContractChanged:
    """The refusal of ``tenant``'s claims while its code names ``contract`` and the ledger holds ``recorded``."""
    wanted = canonical(contract)
    hint = ""
    if json.loads(recorded).get("timezone") != contract.get("timezone") and not contract.get("moves"):
        hint = (
            " The code names a new zone without saying when the tenant moved: declare the move in code "
            "(Tenant(..., moves=(ZoneMove(on=<first new date>, from_zone=<old zone>),))) so the days around it tile."
        )
    return ContractChanged(
        f"the calendar contract of {export} for tenant {tenant} changed: the ledger recorded {recorded}, the code now "
        f"says {wanted}. Changing a zone or the start date is a business change: this tenant's claims are refused "
        f"(the other tenants run) until an operator runs: {accept_command(export, contract, tenant)}.{hint}"
    )


def count_open_per_zone(
    conn: Connection, table: sa.Table, labels: tuple[str, str, str], latest: sa.Column, total: sa.Column, exports=()
) -> list[sa.Row]:
    """The open rows (``closed_at`` null) of an escalation table (refusals, missed partitions) per (export, zone):
    ``labels`` name the count, the newest ``latest`` and the sum of ``total``."""
    count, newest, summed = labels
    query = (
        sa.select(
            table.c.export, table.c.timezone, sa.func.count().label(count),
            sa.func.max(latest).label(newest), sa.func.sum(total).label(summed),
        )
        .where(table.c.closed_at.is_(None))
        .group_by(table.c.export, table.c.timezone)
    )  # fmt: skip
    if exports:
        query = query.where(table.c.export.in_(list(exports)))
    return list(conn.execute(query))
