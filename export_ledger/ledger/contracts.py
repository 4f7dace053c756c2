"""Export contracts: what each tenant's history depends on, recorded once and changed only by an operator.

A contract (:mod:`export_ledger.contract`) is the tenant's calendar (zone, start date, earlier zones) and, under
``"terms"``, the export's destination, file format, schema, source and version. It is kept per tenant (its row's JSON
names the tenant). Rows without a tenant are export-wide: written by releases before per-tenant zones and by an
operator accepting for a whole export; they apply to every tenant, and the latest row that applies to a tenant is the
one in force. A contract recorded before release 0.6 has no terms: the first claim that brings terms with the same
calendar records them (nothing to compare them with), and from then on they are checked like the calendar.

Each key names the contract it was last claimed under (``export_runs.contract_id``, schema version 9), so that an
operator command acts on the destination that contract records (:meth:`Contracts.of_keys`), and a claim that would
carry a key whose earlier attempts may have written to one destination over to another is refused
(:func:`moved_destination`).

The contract is checked **at claim, in the claim's transaction** (:meth:`Contracts.decide_in`, called by
:mod:`export_ledger.ledger.claims`): an attempt that computed its windows with one contract cannot claim a key after an
operator accepted another, so a zone move accepted while a run is in flight cannot cut a day twice. A tenant refused
this way gets an open row in ``export_contract_refusals``, escalated to a person until an operator accepts a contract
(:meth:`Contracts.accept`) or the code goes back to the recorded one (the next claim closes it).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.contract import calendar_of, changes, destination_of, terms_of, with_terms
from export_ledger.ledger.errors import MESSAGE_LIMIT, ContractChanged, DestinationMoved, LedgerError
from export_ledger.ledger.operators import append_in
from export_ledger.ledger.schema import ExportState, export_contract_refusals, export_contracts, export_runs

#: The first schema version that keeps contract refusals.
REFUSALS_SCHEMA_VERSION = 6
#: The first schema version whose keys name the contract they were claimed under.
KEY_CONTRACTS_SCHEMA_VERSION = 9
#: What an operator says becomes of the keys already exported when the terms change.
KEEP, RESTATE = "keep", "restate"


@dataclass
class Decided:
    """What a claim's transaction decided about its tenants' contracts.

    Attributes:
        refusals: The refused tenants, by ``(export, tenant)``.
        in_force: The id of the contract row each other tenant's keys are claimed under (what ``contract_id``
            records), by ``(export, tenant)``.
    """

    refusals: dict[tuple[str, str], ContractChanged] = field(default_factory=dict)
    in_force: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(frozen=True)
class Accepted:
    """One tenant's (or the whole export's) accepted contract: what was in force before, and what changed."""

    export: str
    tenant: str | None
    previous: dict | None
    accepted: dict
    changes: list[str]


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
    ) -> Decided:
        """Inside a claim's transaction: records each tenant's contract at its first claim (and the terms of a
        contract recorded without them), compares the others with the one in force, keeps the refusals open (and
        closes those that match again). Returns the refusals and the contract each other tenant is claimed under.
        ``dates`` gives the first and last business date each tenant's claim asked for: a refusal keeps them, so that
        they are launched again once it closes.

        A contract without terms (a low-level caller's calendar alone) is compared on its calendar only.

        On PostgreSQL two first claims of one export must not both record theirs, and a refusal must not be kept
        after an operator's acceptance it did not see: when a contract is to be recorded or a tenant refused, the
        transaction takes an advisory lock on the export's name (the one :meth:`accept` takes; before any row lock, so
        that claims never wait for each other in two orders), then decides again. SQLite's ``BEGIN IMMEDIATE``
        already serializes.
        """
        by_export: dict[str, dict[str, Mapping]] = {}
        for (export, tenant), contract in contracts.items():
            by_export.setdefault(export, {})[tenant] = contract
        decided = Decided()
        for export, wanted in sorted(by_export.items()):
            inserts, refused, matched = self._decisions(conn, export, wanted)
            if (inserts or refused) and _lock_export(conn, export):
                inserts, refused, matched = self._decisions(conn, export, wanted)
            if inserts:
                conn.execute(
                    export_contracts.insert(),
                    [{"export": export, "contract": t, "recorded_at": now, "reason": why} for t, why in inserts],
                )
                _, own = _in_force(conn, export)  # the rows just recorded are the tenants' own, and the latest
                recorded = {json.loads(text)["tenant"] for text, _ in inserts}
                matched.update({tenant: own[tenant][0] for tenant in recorded})
            spans = {tenant: (dates or {}).get((export, tenant)) for tenant in refused}
            self._keep_refusals(conn, export, wanted, refused, now, spans)
            decided.refusals.update({(export, tenant): error for tenant, (error, _) in refused.items()})
            decided.in_force.update({(export, tenant): row_id for tenant, row_id in matched.items()})
        return decided

    def _decisions(
        self, conn: Connection, export: str, wanted: Mapping[str, Mapping]
    ) -> tuple[list[tuple[str, str]], dict[str, tuple[ContractChanged, str]], dict[str, int]]:
        """The contracts to record (tenant row JSON, reason), the refusals (tenant -> (error, recorded JSON)) and
        the contract row each matching tenant is claimed under (tenant -> row id)."""
        wide, own = _in_force(conn, export)
        inserts, refused, unsure, matched = [], {}, [], {}
        for tenant, contract in wanted.items():
            mine = own.get(tenant)
            recorded = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
            if recorded is None:
                inserts.append((_tenant_row(contract, tenant), "first claim"))
                continue
            held = json.loads(recorded[1])
            if _same(held, contract):
                matched[tenant] = recorded[0]
            elif terms_of(held) is None and calendar_of(held) == calendar_of(contract):
                # Recorded by a release that kept the calendar alone: nothing to compare the terms with.
                inserts.append((_tenant_row(contract, tenant), "terms recorded at the first claim that gave them"))
            else:
                unsure.append((tenant, contract, recorded[1], mine is None))
        # A tenant the ledger holds no key of has no history to protect: an export-wide contract that disagrees with
        # it (a new tenant in another zone) does not refuse it; its own contract is recorded instead.
        with_keys = _tenants_with_keys(conn, export, [t for t, _, _, wide_only in unsure if wide_only])
        for tenant, contract, recorded, wide_only in unsure:
            if wide_only and tenant not in with_keys:
                inserts.append((_tenant_row(contract, tenant), "first claim"))
            else:
                refused[tenant] = (changed(export, tenant, recorded, contract), recorded)
        return inserts, refused, matched

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
            return self.decide_in(conn, contracts, self.ledger.now(conn)).refusals

    def moved_in(
        self, conn: Connection, records: Sequence, decided: Decided, contracts: Mapping[tuple[str, str], Mapping]
    ) -> dict[str, DestinationMoved]:
        """Inside a claim's transaction: the keys of ``records`` last claimed under a contract whose destination is
        not the one their claim now publishes to (by logical key); see :func:`moved_destination`."""
        if not self.ledger.supports(KEY_CONTRACTS_SCHEMA_VERSION):
            return {}
        stale = {
            r.logical_key: r.contract_id
            for r in records
            if r.contract_id is not None and decided.in_force.get((r.export, r.tenant), r.contract_id) != r.contract_id
        }
        if not stale:
            return {}
        held = _contracts_by_id(conn, set(stale.values()))
        moved = {}
        for record in records:
            if record.logical_key not in stale:
                continue
            was = destination_of(held.get(stale[record.logical_key]))
            now = destination_of(contracts.get((record.export, record.tenant)))
            if was is not None and now is not None and was != now:
                moved[record.logical_key] = moved_destination(record.logical_key, was, now)
        return moved

    def moved_key_in(self, conn: Connection, record) -> tuple[dict, dict] | None:
        """Inside a transaction: ``(recorded, in force)`` destinations when the contract ``record`` was last claimed
        under publishes elsewhere than its tenant's contract in force (a key kept at the old destination by an
        accepted move), else None."""
        if not self.ledger.supports(KEY_CONTRACTS_SCHEMA_VERSION):
            return None
        contract_id = conn.execute(
            sa.select(export_runs.c.contract_id).where(export_runs.c.logical_key == record.logical_key)
        ).scalar()
        if contract_id is None:
            return None
        wide, own = _in_force(conn, record.export)
        mine = own.get(record.tenant)
        chosen = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
        if chosen is None or chosen[0] == contract_id:
            return None
        was = destination_of(_contracts_by_id(conn, {contract_id}).get(contract_id))
        now = destination_of(json.loads(chosen[1]))
        return (was, now) if was is not None and now is not None and was != now else None

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

    def of_keys(self, records: Sequence) -> dict[str, dict | None]:
        """The contract each key was last claimed under (its ``contract_id``), or for a key claimed before schema
        version 9 its tenant's contract in force; None when the ledger holds none. By logical key; one read of the
        keys' contracts and one per export of the others."""
        found: dict[str, dict | None] = {}
        with self.ledger.atomic(read_only=True) as conn:
            ids: dict[str, int] = {}
            if self.ledger.supports(KEY_CONTRACTS_SCHEMA_VERSION) and records:
                rows = conn.execute(
                    sa.select(export_runs.c.logical_key, export_runs.c.contract_id).where(
                        export_runs.c.logical_key.in_([r.logical_key for r in records]),
                        export_runs.c.contract_id.is_not(None),
                    )
                )
                ids = dict(rows.all())
            held = _contracts_by_id(conn, set(ids.values()))
            in_force: dict[str, tuple] = {}
            for record in records:
                if record.logical_key in ids:
                    found[record.logical_key] = held.get(ids[record.logical_key])
                    continue
                if record.export not in in_force:
                    in_force[record.export] = _in_force(conn, record.export)
                wide, own = in_force[record.export]
                mine = own.get(record.tenant)
                chosen = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
                found[record.logical_key] = None if chosen is None else json.loads(chosen[1])
        return found

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

    def accept(
        self,
        export: str,
        contract: Mapping,
        reason: str,
        *,
        tenant: str | None = None,
        operator: str = "unknown",
        exported: str | None = None,
    ) -> Accepted:
        """Records ``contract`` as the one in force for ``tenant`` of ``export`` (every tenant when None), with the
        operator's reason, in the operator log too; closes the tenant's (or every tenant's) open refusal.

        A contract given without terms (a calendar alone, as ``accept-contract --timezone`` gives it) keeps the terms
        in force. When the terms change, ``exported`` says what becomes of the keys already exported: ``keep`` (they
        stay as they are, each under the contract it was exported with) or ``restate`` (the caller then requests a
        restatement of each: :func:`export_ledger.restate.request_each`); a new destination can only ``keep`` them.

        Raises:
            ValueError: no reason; terms changed without ``exported``; ``restate`` with a new destination.
            ContractChanged: the contract puts a day the ledger already holds in another zone than the one it was
                exported in (a zone changed without a move, or a move on or before a day already exported); or the
                destination changes while a key in scope may still be written at the old one (in progress, unknown
                outcome, conflict, or an open restatement request).
        """
        if not reason or not reason.strip():
            raise ValueError("accepting a contract change needs a reason")
        if exported not in (None, KEEP, RESTATE):
            raise ValueError(f"exported must be {KEEP!r} or {RESTATE!r}, got {exported!r}")
        ledger = self.ledger
        with ledger.atomic() as conn:
            _lock_export(conn, export)  # a claim deciding on the old contract commits its refusal before, or sees this
            return self._accept_in(conn, ledger.now(conn), export, contract, reason, tenant, operator, exported)

    def accept_refused(
        self,
        export: str,
        reason: str,
        *,
        tenant: str | None = None,
        operator: str = "unknown",
        exported: str | None = None,
    ) -> list[Accepted]:
        """Accepts the contract the code asked for in each open refusal of ``export`` (``tenant``'s only, when
        given): the way out of a refusal, without retyping the contract. One transaction for all of them.

        Raises:
            LedgerError: no open refusal to accept.
            ValueError, ContractChanged: as :meth:`accept` says, for any of them (then none is accepted).
        """
        if not reason or not reason.strip():
            raise ValueError("accepting a contract change needs a reason")
        ledger = self.ledger
        with ledger.atomic() as conn:
            _lock_export(conn, export)
            now = ledger.now(conn)
            table = export_contract_refusals
            query = sa.select(table.c.tenant, table.c.wanted).where(
                table.c.export == export, table.c.closed_at.is_(None)
            )
            if tenant is not None:
                query = query.where(table.c.tenant == tenant)
            refused = conn.execute(query.order_by(table.c.tenant)).all()
            if not refused:
                whose = "" if tenant is None else f" for tenant {tenant}"
                raise LedgerError(
                    f"{export} has no refused contract to accept{whose}: its claims match the contract in force. To "
                    "declare a calendar change ahead of the code, give --timezone and --start-date"
                )
            return [
                self._accept_in(conn, now, export, json.loads(wanted), reason, name, operator, exported)
                for name, wanted in refused
            ]

    def _accept_in(
        self,
        conn: Connection,
        now: dt.datetime,
        export: str,
        contract: Mapping,
        reason: str,
        tenant: str | None,
        operator: str,
        exported: str | None,
    ) -> Accepted:
        wide, own = _in_force(conn, export)
        mine = own.get(tenant) if tenant is not None else None
        before = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
        if tenant is None and before is None and own:
            before = max(own.values())  # the newest tenant's: what an export-wide acceptance replaces for most
        previous = None if before is None else json.loads(before[1])
        contract = {k: v for k, v in contract.items() if k != "tenant"}
        if terms_of(contract) is None and terms_of(previous) is not None:
            contract = with_terms(contract, terms_of(previous))  # a calendar alone keeps the terms in force
        said = changes(previous, contract) if previous is not None else ["first contract"]
        if previous is not None and terms_of(previous) is not None and terms_of(previous) != terms_of(contract):
            self._check_terms_change(conn, export, tenant, previous, contract, exported)
        self._check_zones(conn, export, tenant, contract)
        text = canonical(contract) if tenant is None else _tenant_row(contract, tenant)
        conn.execute(
            export_contracts.insert().values(
                export=export, contract=text, recorded_at=now, reason=reason.strip()[:MESSAGE_LIMIT]
            )
        )
        if self.ledger.supports(REFUSALS_SCHEMA_VERSION):
            table = export_contract_refusals
            closing = table.update().where(table.c.export == export, table.c.closed_at.is_(None))
            if tenant is not None:
                closing = closing.where(table.c.tenant == tenant)
            conn.execute(closing.values(closed_at=now, relaunch_pending=table.c.first_date.is_not(None)))
        scope = "every tenant" if tenant is None else f"tenant {tenant}"
        kept = f"; keys already exported: {exported}" if exported else ""
        append_in(conn, now, operator, "accept-contract", f"{scope}: {'; '.join(said)}{kept}", reason, export)
        return Accepted(export, tenant, previous, contract, said)

    def _check_terms_change(
        self, conn: Connection, export: str, tenant: str | None, previous: Mapping, contract: Mapping, exported
    ) -> None:
        """New terms need the operator's word on the keys already exported; a new destination also needs every key
        in scope settled where its attempts wrote (no attempt of it can still be under way, unknown or disputed)."""
        if exported is None:
            raise ValueError(
                f"the terms of {export} change ({'; '.join(changes(previous, contract))}): say what becomes of the "
                "keys already exported: keep them as they are (--keep-exported) or restate them as new revisions "
                "(--restate-exported)"
            )
        moved = destination_of(previous) != destination_of(contract)
        if moved and exported == RESTATE:
            raise ValueError(
                f"the destination of {export} changes ({_where(previous)} -> {_where(contract)}): keys already "
                f"exported stay at {_where(previous)} with their revisions (--keep-exported); a restatement "
                "publishes a key's next revision beside its current one, which is at the old destination"
            )
        if not moved:
            return
        from export_ledger.ledger.schema import export_restatements

        runs = export_runs.c
        unsettled = sa.select(runs.logical_key, runs.state).where(
            runs.export == export,
            runs.state.in_(
                [ExportState.IN_PROGRESS.value, ExportState.REMOTE_UNKNOWN.value, ExportState.CONFLICT.value]
            ),
        )
        requests = sa.select(export_restatements.c.logical_key).where(
            export_restatements.c.export == export, export_restatements.c.closed_at.is_(None)
        )
        if tenant is not None:
            unsettled = unsettled.where(runs.tenant == tenant)
            requests = requests.where(export_restatements.c.tenant == tenant)
        held = conn.execute(unsettled.order_by(runs.logical_key).limit(1)).first()
        asked = conn.execute(requests.order_by(export_restatements.c.logical_key).limit(1)).first()
        if held is not None or asked is not None:
            which = (
                f"{held.logical_key} is {held.state} (settle it there first: export-ledger reconcile, or resolve)"
                if held is not None
                else f"{asked.logical_key} has an open restatement (publish or withdraw it there first)"
            )
            raise ContractChanged(
                f"the destination of {export} changes ({_where(previous)} -> {_where(contract)}), but {which}: an "
                f"attempt of it may still write at {_where(previous)}, and a key exported at two destinations is two "
                "exports. Accept again once every key is settled"
            )

    def _check_zones(self, conn: Connection, export: str, tenant: str | None, contract: Mapping) -> None:
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


def accept_command(export: str, contract: Mapping, tenant: str | None, *, terms_changed: bool = False) -> str:
    """The command an operator runs to accept the contract a refusal names (for one tenant, or export-wide)."""
    parts = [f"export-ledger accept-contract --export {export}"]
    if tenant is not None:
        parts.append(f"--tenant {tenant}")
    if terms_changed:
        parts.append("--keep-exported")
    parts.append('--reason "..."')
    return " ".join(parts)


def changed(export: str, tenant: str, recorded: str, contract: Mapping) -> ContractChanged:
    """The refusal of ``tenant``'s claims while its code names ``contract`` and the ledger holds ``recorded``."""
    held = json.loads(recorded)
    said = changes(held, contract)
    terms_changed = terms_of(held) is not None and terms_of(contract) is not None and terms_of(held) != terms_of(
        contract
    )
    hint = ""
    if held.get("timezone") != contract.get("timezone") and not contract.get("moves"):
        hint = (
            " The code names a new zone without saying when the tenant moved: declare the move in code "
            "(Tenant(..., moves=(ZoneMove(on=<first new date>, from_zone=<old zone>),))) so the days around it tile."
        )
    if terms_changed:
        command = accept_command(export, contract, None, terms_changed=True)
        way = (
            f"until an operator accepts the new terms for every tenant ({command}, or --restate-exported to publish "
            "the keys already exported again as new revisions) or the code goes back"
        )
    else:
        way = f"until an operator runs: {accept_command(export, contract, tenant)} (or the code goes back)"
    # Both contracts in full are kept with the refusal (export_contract_refusals); the message says what differs.
    said_text = "; ".join(said) if said else f"the ledger recorded {_short(held)}, the code says {_short(contract)}"
    which = "contract" if terms_changed else "calendar contract"
    return ContractChanged(
        f"the {which} of {export} for tenant {tenant} changed ({said_text}). A change of what a key's export is "
        f"(where it goes, its format, columns, source, zone or start date) is a business change: this tenant's claims "
        f"are refused (the other tenants run) {way}.{hint}"
    )


def moved_destination(logical_key: str, was: Mapping, now: Mapping) -> DestinationMoved:
    return DestinationMoved(
        f"{logical_key} was last claimed under a contract that publishes to {was.get('kind')} {was.get('root')}; this "
        f"attempt publishes to {now.get('kind')} {now.get('root')}. An attempt of it may have written there, so it is "
        "refused: settle it where it was written (export-ledger reconcile for a key in progress; export-ledger restate "
        "--withdraw for a restatement), then run it again"
    )


def _where(contract: Mapping | None) -> str:
    place = destination_of(contract) or {}
    return f"{place.get('kind')} {place.get('root')}"


def _short(contract: Mapping) -> str:
    """A contract for a message: bounded (a schema of many columns is summarized)."""
    text = canonical(contract)
    return text if len(text) <= 600 else text[:600] + "...(cut)"


def _same(held: Mapping, wanted: Mapping) -> bool:
    """Whether ``wanted`` is the contract ``held`` (on the calendar only, when ``wanted`` brings no terms)."""
    if terms_of(wanted) is None:
        return calendar_of(held) == calendar_of(wanted)
    return canonical(held) == canonical(wanted)


def _contracts_by_id(conn: Connection, ids: set[int]) -> dict[int, dict]:
    if not ids:
        return {}
    rows = conn.execute(
        sa.select(export_contracts.c.id, export_contracts.c.contract).where(export_contracts.c.id.in_(sorted(ids)))
    )
    return {row_id: json.loads(text) for row_id, text in rows}


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
