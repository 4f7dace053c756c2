"""Calendar contracts: what each export's history depends on, recorded once and changed only by an operator.

A contract is kept per tenant (its row's JSON names the tenant): moving one tenant to another zone is refused for
that tenant alone until accepted, and the others keep running. Rows without a tenant are export-wide: written by
releases before per-tenant zones and by an operator accepting for a whole export; they apply to every tenant, and
the latest row that applies to a tenant is the one in force.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger.errors import MESSAGE_LIMIT, ContractChanged
from export_ledger.ledger.schema import export_contracts, export_runs


class ContractsMixin:
    """The ledger's calendar-contract methods (mixed into :class:`~export_ledger.ledger.ExportLedger`)."""

    def recorded_contract(self, export: str) -> dict | None:
        """The export-wide contract in force (recorded by releases before per-tenant zones, or accepted for a whole
        export), or None."""
        with self.atomic(read_only=True) as conn:
            wide, _ = self._contracts_in_force(conn, export)
        return None if wide is None else json.loads(wide[1])

    def check_contract(self, export: str, contract: dict, *, tenant: str | None = None) -> None:
        """Records the contract at the first materialization; afterwards refuses any other one. Without ``tenant``,
        the export-wide contract (every tenant in one zone); with it, that tenant's (see :meth:`check_contracts`).

        Raises:
            ContractChanged: naming the recorded and the new contract, until an operator accepts the new one.
        """
        if tenant is not None:
            refused = self.check_contracts(export, {tenant: contract})
            if refused:
                raise refused[tenant]
            return
        wanted = json.dumps(contract, sort_keys=True)
        with self.atomic() as conn:
            wide, _ = self._contracts_in_force(conn, export)
            if wide is None and conn.dialect.name == "postgresql":
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(export))))
                wide, _ = self._contracts_in_force(conn, export)
            if wide is None:
                conn.execute(
                    export_contracts.insert().values(
                        export=export, contract=wanted, recorded_at=self.now(), reason="first materialization"
                    )
                )
                return
        if wide[1] != wanted:
            raise ContractChanged(
                f"the calendar contract of {export} changed: the ledger recorded {wide[1]}, the code now says "
                f"{wanted}. Changing the zone or start date is a business change: every materialization is refused "
                f"until an operator runs: {accept_command(export, contract, None)}"
            )

    def check_contracts(self, export: str, contracts: Mapping[str, dict]) -> dict[str, ContractChanged]:
        """Per tenant: records the contract at the tenant's first materialization, afterwards compares with the one in
        force. Returns the refusals (tenant -> error naming the command that accepts the change); the rest may run.

        A tenant the ledger holds no key of has no history to protect: an export-wide contract that disagrees with it
        (a new tenant in another zone) does not refuse it; its own contract is recorded instead.
        """
        if not contracts:
            return {}
        with self.atomic() as conn:
            inserts, refusals = self._contract_decisions(conn, export, contracts)
            if inserts and conn.dialect.name == "postgresql":
                # Two first materializations at once must not both record theirs: serialize them on the export's
                # name (SQLite's BEGIN IMMEDIATE already does), then decide again.
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(export))))
                inserts, refusals = self._contract_decisions(conn, export, contracts)
            if inserts:
                now = self.now()
                conn.execute(
                    export_contracts.insert(),
                    [
                        {"export": export, "contract": text, "recorded_at": now, "reason": "first materialization"}
                        for text in inserts
                    ],
                )
        return refusals

    def _contract_decisions(
        self, conn: Connection, export: str, contracts: Mapping[str, dict]
    ) -> tuple[list[str], dict[str, ContractChanged]]:
        wide, own = self._contracts_in_force(conn, export)
        inserts, refusals, unsure = [], {}, []
        for tenant, contract in contracts.items():
            wanted = json.dumps(contract, sort_keys=True)
            mine = own.get(tenant)
            recorded = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
            if recorded is None:
                inserts.append(_tenant_row(contract, tenant))
            elif recorded[1] != wanted:
                unsure.append((tenant, contract, recorded[1], mine is None))
        with_keys = self._tenants_with_keys(conn, export, [t for t, _, _, wide_only in unsure if wide_only])
        for tenant, contract, recorded, wide_only in unsure:
            if wide_only and tenant not in with_keys:
                inserts.append(_tenant_row(contract, tenant))
            else:
                refusals[tenant] = _changed(export, tenant, recorded, contract)
        return inserts, refusals

    def _contracts_in_force(
        self, conn: Connection, export: str
    ) -> tuple[tuple[int, str] | None, dict[str, tuple[int, str]]]:
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
            entry = (row_id, json.dumps(contract, sort_keys=True))
            if tenant is None:
                wide = entry
            else:
                own[tenant] = entry
        return wide, own

    def _tenants_with_keys(self, conn: Connection, export: str, tenants: list[str]) -> set[str]:
        if not tenants:
            return set()
        query = (
            sa.select(export_runs.c.tenant)
            .where(export_runs.c.export == export, export_runs.c.tenant.in_(tenants))
            .distinct()
        )
        return set(conn.execute(query).scalars())

    def contract_in_force(self, export: str, tenant: str) -> dict | None:
        """The contract that applies to ``tenant`` (its own or the export-wide one, whichever is later), or None."""
        with self.atomic(read_only=True) as conn:
            wide, own = self._contracts_in_force(conn, export)
        mine = own.get(tenant)
        recorded = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
        return None if recorded is None else json.loads(recorded[1])

    def tenant_contracts(self, export: str) -> dict[str, dict]:
        """Each tenant's own contract in force, where no later export-wide one supersedes it."""
        with self.atomic(read_only=True) as conn:
            wide, own = self._contracts_in_force(conn, export)
        return {t: json.loads(text) for t, (row_id, text) in own.items() if wide is None or row_id > wide[0]}

    def accept_contract(self, export: str, contract: dict, reason: str, *, tenant: str | None = None) -> None:
        """Records ``contract`` as the one in force for ``tenant`` of ``export`` (every tenant when None), with the
        operator's reason."""
        if not reason or not reason.strip():
            raise ValueError("accepting a contract change needs a reason")
        text = json.dumps(contract, sort_keys=True) if tenant is None else _tenant_row(contract, tenant)
        with self.atomic() as conn:
            for move in contract.get("moves", ()):
                # The day of a move starts at the old zone's midnight and ends at the new one's; if the ledger already
                # holds it (or a later day) in the old zone, the windows around the move would no longer tile.
                query = sa.select(sa.func.max(export_runs.c.business_date)).where(
                    export_runs.c.export == export,
                    export_runs.c.timezone == move["from"],
                    export_runs.c.business_date >= dt.date.fromisoformat(move["on"]),
                )
                if tenant is not None:
                    query = query.where(export_runs.c.tenant == tenant)
                latest = conn.execute(query).scalar()
                if latest is not None:
                    raise ContractChanged(
                        f"{export}{'' if tenant is None else f' (tenant {tenant})'} already has {latest} in "
                        f"{move['from']}: a move on {move['on']} would re-cut days already exported; move on "
                        f"{latest + dt.timedelta(days=1)} or later"
                    )
            conn.execute(
                export_contracts.insert().values(
                    export=export, contract=text, recorded_at=self.now(), reason=reason.strip()[:MESSAGE_LIMIT]
                )
            )

    def contract_history(self, export: str) -> list[dict]:
        query = sa.select(export_contracts).where(export_contracts.c.export == export).order_by(export_contracts.c.id)
        with self.atomic(read_only=True) as conn:
            return [
                {"contract": json.loads(r.contract), "recorded_at": r.recorded_at, "reason": r.reason}
                for r in conn.execute(query)
            ]


def _tenant_row(contract: dict, tenant: str) -> str:
    return json.dumps({**contract, "tenant": tenant}, sort_keys=True)


def accept_command(export: str, contract: dict, tenant: str | None) -> str:
    """The command an operator runs to accept ``contract`` (for one tenant, or export-wide)."""
    parts = [f"export-ledger accept-contract --export {export}"]
    if tenant is not None:
        parts.append(f"--tenant {tenant}")
    parts.append(f"--timezone {contract.get('timezone')} --start-date {contract.get('start_date')}")
    parts.extend(f"--move {move['on']}:{move['from']}" for move in contract.get("moves", ()))
    parts.append('--reason "..."')
    return " ".join(parts)


def _changed(export: str, tenant: str, recorded: str, contract: dict) -> ContractChanged:
    wanted = json.dumps(contract, sort_keys=True)
    hint = ""
    if json.loads(recorded).get("timezone") != contract.get("timezone") and not contract.get("moves"):
        hint = (
            " The code names a new zone without saying when the tenant moved: declare the move in code "
            "(Tenant(..., moves=(ZoneMove(on=<first new date>, from_zone=<old zone>),))) so the days around it tile."
        )
    return ContractChanged(
        f"the calendar contract of {export} for tenant {tenant} changed: the ledger recorded {recorded}, the code now "
        f"says {wanted}. Changing a zone or the start date is a business change: this tenant's materializations are "
        f"refused (the other tenants run) until an operator runs: {accept_command(export, contract, tenant)}.{hint}"
    )
