"""Calendar contracts: what each export's history depends on, recorded once and changed only by an operator."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.ledger.errors import MESSAGE_LIMIT, ContractChanged
from export_ledger.ledger.schema import export_contracts


class ContractsMixin:
    """The ledger's calendar-contract methods (mixed into :class:`~export_ledger.ledger.ExportLedger`)."""

    def recorded_contract(self, export: str) -> dict | None:
        with self.atomic(read_only=True) as conn:
            text = self._latest_contract(conn, export)
        return None if text is None else json.loads(text)

    def _latest_contract(self, conn: Connection, export: str) -> str | None:
        return conn.execute(
            sa.select(export_contracts.c.contract)
            .where(export_contracts.c.export == export)
            .order_by(export_contracts.c.id.desc())
            .limit(1)
        ).scalar()

    def check_contract(self, export: str, contract: dict) -> None:
        """Records the contract at an export's first materialization; afterwards refuses any other one.

        Raises:
            ContractChanged: naming the recorded and the new contract, until an operator accepts the new one.
        """
        wanted = json.dumps(contract, sort_keys=True)
        with self.atomic() as conn:
            recorded = self._latest_contract(conn, export)
            if recorded is None and conn.dialect.name == "postgresql":
                # Two first materializations at once must not both record theirs: serialize them on the export's
                # name (SQLite's BEGIN IMMEDIATE already does), then look again.
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(export))))
                recorded = self._latest_contract(conn, export)
            if recorded is None:
                conn.execute(
                    export_contracts.insert().values(
                        export=export, contract=wanted, recorded_at=self.now(), reason="first materialization"
                    )
                )
                return
        if recorded != wanted:
            raise ContractChanged(
                f"the calendar contract of {export} changed: the ledger recorded {recorded}, the code now says "
                f"{wanted}. Changing the zone or start date is a business change: every materialization is refused "
                f"until an operator runs: export-ledger accept-contract --export {export} --timezone "
                f'{contract.get("timezone")} --start-date {contract.get("start_date")} --reason "..."'
            )

    def accept_contract(self, export: str, contract: dict, reason: str) -> None:
        """Records ``contract`` as the one in force for ``export``, with the operator's reason."""
        if not reason or not reason.strip():
            raise ValueError("accepting a contract change needs a reason")
        with self.atomic() as conn:
            conn.execute(
                export_contracts.insert().values(
                    export=export,
                    contract=json.dumps(contract, sort_keys=True),
                    recorded_at=self.now(),
                    reason=reason.strip()[:MESSAGE_LIMIT],
                )
            )

    def contract_history(self, export: str) -> list[dict]:
        query = sa.select(export_contracts).where(export_contracts.c.export == export).order_by(export_contracts.c.id)
        with self.atomic(read_only=True) as conn:
            return [
                {"contract": json.loads(r.contract), "recorded_at": r.recorded_at, "reason": r.reason}
                for r in conn.execute(query)
            ]
