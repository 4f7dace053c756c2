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


@dataclass
class Acceptance:
    """What one acceptance recorded: each contract accepted, and the restatements it requested."""

    accepted: list[Accepted]
    restated: int = 0
    refused: int = 0


@dataclass(frozen=True)
class Accepted:
    """One tenant's (or the whole export's) accepted contract: what was in force before, and what changed."""

    export: str
    tenant: str | None
    previous: dict | None
    accepted: dict
    changes: list[str]


class Contracts:
    """The export contracts (each tenant's calendar, the export's terms) of
    :class:`~export_ledger.ledger.ExportLedger`."""

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

        The calendar is each tenant's own; the terms are the export's: a tenant's first claim is refused when its
        terms differ from the export's in force (a new tenant onboarded by a worker pointed elsewhere). A contract
        without terms (a low-level caller's calendar alone) is compared on its calendar only.

        On PostgreSQL a claim holds the export's acceptance lock shared until it commits, so an operator's acceptance
        (which takes it exclusively) is never interleaved with a claim decided on the contract it replaces. Two first
        claims of one export must not both record theirs, and a refusal must not be kept after an acceptance it did
        not see: to record a contract or refuse a tenant, the transaction also takes the export's contract lock (the
        one an acceptance takes next), then decides again. SQLite's ``BEGIN IMMEDIATE`` already serializes.
        """
        by_export: dict[str, dict[str, Mapping]] = {}
        for (export, tenant), contract in contracts.items():
            by_export.setdefault(export, {})[tenant] = contract
        decided = Decided()
        for export, wanted in sorted(by_export.items()):
            _lock_acceptance(conn, export, shared=True)
            inserts, refused, matched = self._decisions(conn, export, wanted)
            if (inserts or refused) and _lock_export(conn, export):
                inserts, refused, matched = self._decisions(conn, export, wanted)
            if inserts:
                conn.execute(
                    export_contracts.insert(),
                    [
                        {"export": export, "contract": _tenant_row(c, t), "recorded_at": now, "reason": why,
                         **self._tenant_column(t)}
                        for t, c, why in inserts
                    ],
                )  # fmt: skip
                _, own = _in_force_for(conn, export, [t for t, _, _ in inserts])  # the rows just recorded
                matched.update({tenant: own[tenant][0] for tenant, _, _ in inserts})
            spans = {tenant: (dates or {}).get((export, tenant)) for tenant in refused}
            self._keep_refusals(conn, export, wanted, refused, now, spans)
            decided.refusals.update({(export, tenant): error for tenant, (error, _) in refused.items()})
            decided.in_force.update({(export, tenant): row_id for tenant, row_id in matched.items()})
        return decided

    def _tenant_column(self, tenant: str | None) -> dict:
        """``export_contracts.tenant`` for a new row (schema version 9; an older ledger keeps it in the JSON only)."""
        return {"tenant": tenant} if self.ledger.supports(KEY_CONTRACTS_SCHEMA_VERSION) else {}

    def _decisions(
        self, conn: Connection, export: str, wanted: Mapping[str, Mapping]
    ) -> tuple[list[tuple[str, Mapping, str]], dict[str, tuple[ContractChanged, str]], dict[str, int]]:
        """The contracts to record (tenant, contract, reason), the refusals (tenant -> (error, recorded JSON)) and
        the contract row each matching tenant is claimed under (tenant -> row id). Reads the claimed tenants' rows
        only, and parses one only when its text is not the wanted contract's."""
        wide, own = _in_force_for(conn, export, list(wanted))
        inserts, refused, unsure, matched, first = [], {}, [], {}, []
        for tenant, contract in wanted.items():
            mine = own.get(tenant)
            recorded = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
            if recorded is None:
                first.append((tenant, contract))
                continue
            if recorded[1] == (_tenant_row(contract, tenant) if recorded is mine else canonical(contract)):
                matched[tenant] = recorded[0]
                continue
            held = _parsed(recorded[1])
            if _same(held, contract):
                matched[tenant] = recorded[0]
            elif terms_of(held) is None and calendar_of(held) == calendar_of(contract):
                # Recorded by a release that kept the calendar alone: nothing to compare the terms with.
                inserts.append((tenant, contract, "terms recorded at the first claim that gave them"))
            else:
                unsure.append((tenant, contract, canonical(held), mine is None))
        # A tenant the ledger holds no key of has no history to protect: an export-wide contract that disagrees with
        # its calendar (a new tenant in another zone) does not refuse it; its own contract is recorded instead.
        with_keys = _tenants_with_keys(conn, export, [t for t, _, _, wide_only in unsure if wide_only])
        for tenant, contract, recorded, wide_only in unsure:
            if wide_only and tenant not in with_keys and terms_of(contract) == terms_of(json.loads(recorded)):
                first.append((tenant, contract))
            else:
                refused[tenant] = (changed(export, tenant, recorded, contract), recorded)
        # A new tenant's calendar is its own, but the terms are the export's: one onboarded by a worker whose
        # environment names another destination, source, format or schema is refused like the others would be.
        terms = _export_terms(conn, export) if any(terms_of(c) is not None for _, c in first) else None
        for tenant, contract in first:
            if terms is not None and terms_of(contract) is not None and terms_of(contract) != terms:
                recorded = canonical(with_terms(calendar_of(contract), terms))
                refused[tenant] = (changed(export, tenant, recorded, contract), recorded)
            else:
                inserts.append((tenant, contract, "first claim"))
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
        wide, own = _in_force_for(conn, record.export, [record.tenant])
        mine = own.get(record.tenant)
        chosen = mine if mine is not None and (wide is None or mine[0] > wide[0]) else wide
        if chosen is None or chosen[0] == contract_id:
            return None
        was = destination_of(_contracts_by_id(conn, {contract_id}).get(contract_id))
        now = destination_of(_parsed(chosen[1]))
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
        """The contract each key was last claimed under (its ``contract_id``), by logical key; None for a key claimed
        before schema version 9 (or by a caller that checked no contract): its ledger never recorded where it went,
        whatever its tenant's contract says now. One read of the keys and one of their contracts."""
        found: dict[str, dict | None] = {r.logical_key: None for r in records}
        if not records or not self.ledger.supports(KEY_CONTRACTS_SCHEMA_VERSION):
            return found
        with self.ledger.atomic(read_only=True) as conn:
            rows = conn.execute(
                sa.select(export_runs.c.logical_key, export_runs.c.contract_id).where(
                    export_runs.c.logical_key.in_([r.logical_key for r in records]),
                    export_runs.c.contract_id.is_not(None),
                )
            )
            ids = dict(rows.all())
            held = _contracts_by_id(conn, set(ids.values()))
        found.update({key: held.get(contract_id) for key, contract_id in ids.items()})
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
    ) -> Acceptance:
        """Records ``contract`` as the one in force for ``tenant`` of ``export`` (every tenant when None), with the
        operator's reason, in the operator log too; closes the open refusals it answers.

        A contract given without terms (a calendar alone, as ``accept-contract --timezone`` gives it) keeps the terms
        in force, and is refused while a refusal in scope asks for other terms (it would close that refusal without
        accepting it). New terms are the export's, for every tenant (see :meth:`accept_refused`).

        Raises:
            ValueError: no reason; new terms without ``exported``, or for one ``tenant``; ``restate`` with a new
                destination or with no new terms.
            ContractChanged: the contract puts a day the ledger already holds in another zone than the one it was
                exported in (a zone changed without a move, or a move on or before a day already exported); a new
                destination while a key of the export has an open restatement; a calendar while refused terms wait.
        """
        _check_reason(reason, exported)
        ledger = self.ledger
        with ledger.atomic() as conn:
            _lock_acceptance(conn, export)  # waits for the claims in flight, decided on the contract it replaces
            _lock_export(conn, export)
            if terms_of(contract) is None:
                asked = self._open_refusals(conn, export, tenant)
                kept = _export_terms(conn, export)
                other = sorted({canonical(terms_of(w)) for _, w in asked if terms_of(w) not in (None, kept)})
                if other:
                    raise ContractChanged(
                        f"the refused claims of {export} also change its terms "
                        f"({'; '.join(changes(with_terms({}, kept), with_terms({}, json.loads(other[0]))))}): a "
                        f"calendar accepted alone would close their refusals without accepting them. Accept what they "
                        f'ask with: export-ledger accept-contract --export {export} --keep-exported --reason "..."'
                    )
            return self._accept_all(conn, ledger.now(conn), export, {tenant: contract}, reason, operator, exported)

    def accept_refused(
        self,
        export: str,
        reason: str,
        *,
        tenant: str | None = None,
        operator: str = "unknown",
        exported: str | None = None,
    ) -> Acceptance:
        """Accepts the contract the code asked for in each open refusal of ``export`` (``tenant``'s only, when
        given): the way out of a refusal, without retyping the contract. One transaction for all of it.

        Each refused tenant's calendar is accepted for that tenant. New terms are the export's: they are recorded for
        every tenant of the export (refused so far or not, each with its own calendar), every refusal of the export
        is closed, and ``exported`` says what becomes of the keys already exported: ``keep`` (each stays as it is,
        under the contract it was exported with) or ``restate`` (a restatement request for each completed key, in
        this transaction). A new destination can only ``keep`` them, and waits for the export's open restatements.

        Raises:
            LedgerError: no open refusal to accept.
            ValueError, ContractChanged: as :meth:`accept` says (then nothing is accepted).
        """
        _check_reason(reason, exported)
        ledger = self.ledger
        with ledger.atomic() as conn:
            _lock_acceptance(conn, export)
            _lock_export(conn, export)
            refused = self._open_refusals(conn, export, tenant)
            if not refused:
                whose = "" if tenant is None else f" for tenant {tenant}"
                raise LedgerError(
                    f"{export} has no refused contract to accept{whose}: its claims match the contract in force. To "
                    "declare a calendar change ahead of the code, give --timezone and --start-date"
                )
            return self._accept_all(conn, ledger.now(conn), export, dict(refused), reason, operator, exported)

    def _open_refusals(self, conn: Connection, export: str, tenant: str | None) -> list[tuple[str, dict]]:
        """The open refusals of ``export`` (``tenant``'s), as (tenant, the contract its claims asked for)."""
        if not self.ledger.supports(REFUSALS_SCHEMA_VERSION):
            return []
        table = export_contract_refusals
        query = sa.select(table.c.tenant, table.c.wanted).where(table.c.export == export, table.c.closed_at.is_(None))
        if tenant is not None:
            query = query.where(table.c.tenant == tenant)
        return [(name, json.loads(wanted)) for name, wanted in conn.execute(query.order_by(table.c.tenant))]

    def _accept_all(
        self,
        conn: Connection,
        now: dt.datetime,
        export: str,
        wanted: Mapping[str | None, Mapping],
        reason: str,
        operator: str,
        exported: str | None,
    ) -> Acceptance:
        """Records the contracts ``wanted`` (by tenant; None: export-wide), the export's new terms for every tenant
        when they change, closes the refusals they answer, logs it, and restates the exported keys if asked."""
        wide, own = _in_force(conn, export)
        current = _export_terms(conn, export)
        asked = {canonical(terms_of(c)) for c in wanted.values() if terms_of(c) is not None}
        if len(asked) > 1:
            raise ContractChanged(
                f"the refused claims of {export} ask for {len(asked)} different sets of terms (two deploys at once?): "
                "put one version of the code back, let its claims be refused again, then accept"
            )
        terms = json.loads(asked.pop()) if asked else current
        renewed = current is not None and terms is not None and terms != current
        if renewed:
            if exported is None:
                said = "; ".join(changes(with_terms({}, current), with_terms({}, terms)))
                raise ValueError(
                    f"the terms of {export} change ({said}): say what becomes of the keys already exported: keep them "
                    "as they are (--keep-exported) or restate them as new revisions (--restate-exported)"
                )
            self._check_terms_change(conn, export, current, terms, exported)
            scope: dict[str | None, Mapping] = {name: _parsed(text) for name, (_, text) in own.items()}
            if wide is not None:
                scope[None] = _parsed(wide[1])
            scope.update(wanted)  # the refused tenants' calendars are what they asked for
        else:
            if exported == RESTATE:
                raise ValueError(
                    f"the terms of {export} do not change: there is nothing to restate (a day already exported keeps "
                    "its calendar); use --keep-exported or neither"
                )
            scope = dict(wanted)
        accepted = []
        for name, contract in sorted(scope.items(), key=lambda item: (item[0] is not None, item[0] or "")):
            held = own.get(name) if name is not None else None
            before = held if held is not None and (wide is None or held[0] > wide[0]) else wide
            previous = None if before is None else _parsed(before[1])
            if name is None and before is None and own:
                previous = _parsed(max(own.values())[1])  # an export-wide calendar replaces the tenants' own
            contract = with_terms(calendar_of(contract), terms if terms is not None else terms_of(contract))
            if previous is None or calendar_of(previous) != calendar_of(contract):
                self._check_zones(conn, export, name, contract)
            text = canonical(contract) if name is None else _tenant_row(contract, name)
            conn.execute(
                export_contracts.insert().values(
                    export=export, contract=text, recorded_at=now, reason=reason.strip()[:MESSAGE_LIMIT],
                    **self._tenant_column(name),
                )
            )  # fmt: skip
            accepted.append(Accepted(export, name, previous, contract, changes(previous, contract) if previous else
                                     ["first contract"]))  # fmt: skip
        if self.ledger.supports(REFUSALS_SCHEMA_VERSION):
            table = export_contract_refusals
            closing = table.update().where(table.c.export == export, table.c.closed_at.is_(None))
            if not renewed and None not in wanted:
                closing = closing.where(table.c.tenant.in_([name for name in wanted if name is not None]))
            conn.execute(closing.values(closed_at=now, relaunch_pending=table.c.first_date.is_not(None)))
        said = sorted({change for a in accepted for change in a.changes})
        who = "every tenant" if renewed or None in wanted else "tenant " + ", ".join(sorted(n for n in wanted if n))
        kept = f"; keys already exported: {exported}" if renewed else ""
        append_in(conn, now, operator, "accept-contract", f"{who}: {'; '.join(said) or 'no change'}{kept}", reason,
                  export)  # fmt: skip
        done = Acceptance(accepted)
        if renewed and exported == RESTATE:
            self._restate_exported(conn, now, export, reason, operator, done)
        return done

    def _restate_exported(
        self, conn: Connection, now: dt.datetime, export: str, reason: str, operator: str, done: Acceptance
    ) -> None:
        """A restatement request for each completed key of ``export``, in the acceptance's transaction (all of them
        or, if anything fails, none and no acceptance), read a page at a time in key order."""
        from export_ledger.ledger.errors import RestatementRefused
        from export_ledger.ledger.retention import lock_export_in

        lock_export_in(conn, export, shared=True)  # a prune waits, as for any request
        runs = export_runs.c
        after = ""
        while True:
            page = (
                conn.execute(
                    sa.select(runs.logical_key)
                    .where(runs.export == export, runs.state == ExportState.COMPLETED.value, runs.logical_key > after)
                    .order_by(runs.logical_key)
                    .limit(500)
                )
                .scalars()
                .all()
            )
            if not page:
                return
            for key in page:
                try:
                    self.ledger.restatements.request_in(
                        conn, now, key, reason=reason.strip(), requested_by=f"accept-contract ({operator})"[:300]
                    )
                    done.restated += 1
                except RestatementRefused:
                    done.refused += 1  # an open request already: it stands, with its own reason
            after = page[-1]

    def _check_terms_change(
        self, conn: Connection, export: str, current: Mapping, terms: Mapping, exported: str
    ) -> None:
        """A new destination keeps the keys already exported where they are, and waits for the export's open
        restatements (each would publish its next revision beside nothing). Keys in progress, of unknown outcome or
        in conflict at the old destination are settled there: a claim that would carry one of them over is refused
        (:class:`DestinationMoved`) until reconciliation or an operator settles it where it was written."""
        moved = current.get("destination") != terms.get("destination")
        if not moved:
            return
        was, now = _place(current.get("destination")), _place(terms.get("destination"))
        if exported == RESTATE:
            raise ValueError(
                f"the destination of {export} changes ({was} -> {now}): keys already exported stay at {was} with "
                "their revisions (--keep-exported); a restatement publishes a key's next revision beside its current "
                "one, which is at the old destination"
            )
        from export_ledger.ledger.schema import export_restatements

        asked = conn.execute(
            sa.select(export_restatements.c.logical_key)
            .where(export_restatements.c.export == export, export_restatements.c.closed_at.is_(None))
            .order_by(export_restatements.c.logical_key)
            .limit(1)
        ).first()
        if asked is not None:
            raise ContractChanged(
                f"the destination of {export} changes ({was} -> {now}), but {asked.logical_key} has an open "
                f"restatement, which would publish its next revision at the new destination beside nothing: publish "
                "or withdraw it at the old one first (export-ledger restate --withdraw), then accept again"
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


#: The class of the advisory lock an acceptance takes exclusively and every claim shared (two-key form: apart from
#: the contract lock below and the retention lock of export_ledger.ledger.retention).
ACCEPTANCE_LOCK_CLASS = 8926


def _lock_acceptance(conn: Connection, export: str, *, shared: bool = False) -> None:
    """PostgreSQL: ``export``'s acceptance lock until the transaction ends (shared for a claim, exclusive for an
    acceptance). SQLite's write transactions are serialized already."""
    if conn.dialect.name != "postgresql":
        return
    take = sa.func.pg_advisory_xact_lock_shared if shared else sa.func.pg_advisory_xact_lock
    conn.execute(sa.select(take(ACCEPTANCE_LOCK_CLASS, sa.func.hashtext(export))))


def _check_reason(reason: str, exported: str | None) -> None:
    if not reason or not reason.strip():
        raise ValueError("accepting a contract change needs a reason")
    if exported not in (None, KEEP, RESTATE):
        raise ValueError(f"exported must be {KEEP!r} or {RESTATE!r}, got {exported!r}")


def _place(destination: Mapping | None) -> str:
    place = destination or {}
    return f"{place.get('kind')} {place.get('root')}"


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


def _in_force_for(
    conn: Connection, export: str, tenants: Sequence[str]
) -> tuple[tuple[int, str] | None, dict[str, tuple[int, str]]]:
    """Like :func:`_in_force`, for ``tenants`` only and with each row's stored text (tenant rows name their tenant):
    the latest export-wide row and each tenant's latest own row, read by ``export_contracts.tenant`` (schema version
    9), so a claim reads what it compares, not the export's whole history."""
    table = export_contracts.c
    latest = (
        sa.select(sa.func.max(table.id))
        .where(table.export == export, sa.or_(table.tenant.is_(None), table.tenant.in_(sorted(set(tenants)))))
        .group_by(table.tenant)
    )
    rows = conn.execute(sa.select(table.id, table.tenant, table.contract).where(table.id.in_(latest)))
    wide, own = None, {}
    for row_id, tenant, text in rows:
        if tenant is None:
            wide = (row_id, text)
        else:
            own[tenant] = (row_id, text)
    return wide, own


def _export_terms(conn: Connection, export: str) -> dict | None:
    """The export's terms in force: those of its newest contract row (every row written since release 0.6 carries
    them, and an acceptance of new terms writes one for every tenant), or None (no contract, or one without terms)."""
    text = conn.execute(
        sa.select(export_contracts.c.contract)
        .where(export_contracts.c.export == export)
        .order_by(export_contracts.c.id.desc())
        .limit(1)
    ).scalar()
    return None if text is None else terms_of(json.loads(text))


def _parsed(text: str) -> dict:
    """A stored contract without its tenant."""
    contract = json.loads(text)
    contract.pop("tenant", None)
    return contract


def _tenants_with_keys(conn: Connection, export: str, tenants: list[str]) -> set[str]:
    if not tenants:
        return set()
    query = (
        sa.select(export_runs.c.tenant)
        .where(export_runs.c.export == export, export_runs.c.tenant.in_(tenants))
        .distinct()
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
    terms_changed = (
        terms_of(held) is not None and terms_of(contract) is not None and terms_of(held) != terms_of(contract)
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
