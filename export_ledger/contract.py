"""An export's contract: everything that decides what a key's export *is*, as the code declares it. Plain Python.

A contract has two parts, recorded by the ledger at a tenant's first claim and checked at every claim
(:mod:`export_ledger.ledger.contracts`):

* the **calendar** (the tenant's zone, start date, cadence, window policy and earlier zones:
  :func:`export_ledger.calendar.calendar_contract`);
* the **terms**, under ``"terms"``: where the export goes (the destination's kind and root, never a credential), its
  file format, its schema (column names, kinds and order, id, time and tenant columns), the identity of its source (a
  stable description with no secret: the kind, a redacted URL and a digest of the query or table, a callable's
  qualified name) and the version the user bumps when the export's logic changes (``ExportSpec.version``).

A claim whose contract differs from the one in force is refused and escalated until an operator accepts the new one,
so that no edge (a run worker, an operator command, a later deploy) acts on what its own environment happens to say.
:func:`changes` says what differs, in words.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from export_ledger.frames import ExportSchema

#: The key of the terms inside a contract; a contract recorded before release 0.6 has none (calendar only).
TERMS = "terms"
_CALENDAR_WORDS = {
    "timezone": "zone",
    "start_date": "start date",
    "cadence": "cadence",
    "window_policy": "window policy",
}


def export_terms(
    *,
    destination: Mapping[str, str],
    file_format: str,
    schema: ExportSchema,
    source: Mapping[str, Any],
    version: str | int | None = None,
) -> dict:
    """The terms of one export: ``destination`` is :meth:`Destination.identity`, ``source``
    :meth:`ExportSource.identity` (or :func:`asset_source` for rows from an asset of the user's own)."""
    return {
        "destination": dict(destination),
        "file_format": file_format,
        "schema": schema_identity(schema),
        "source": dict(source),
        "version": None if version is None else str(version),
    }


def schema_identity(schema: ExportSchema) -> dict:
    """What of a schema decides the published data: the columns (name and kind) in file order, the id, time and
    tenant columns. (Nullable columns and the row order change what is accepted or how rows are sorted, not what a
    reader finds in a column: a change of them is not a contract change.)"""
    return {
        "columns": [[name, kind] for name, kind in schema.columns.items()],
        "id_columns": list(schema.id_columns),
        "time_column": schema.time_column,
        "tenant_column": schema.tenant_column,
    }


def asset_source(asset: str) -> dict:
    """The source identity of rows produced by a Dagster asset of the user's own (through the ledgered I/O manager)."""
    return {"kind": "asset", "name": asset}


def digest(text: str) -> str:
    """A short, stable digest of a query or table name: what changed can be told without showing it."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_terms(calendar: Mapping, terms: Mapping | None) -> dict:
    """A contract from its calendar part and its terms (None: the calendar alone, as a low-level caller gives it)."""
    contract = {k: v for k, v in calendar.items() if k != TERMS}
    if terms is not None:
        contract[TERMS] = dict(terms)
    return contract


def calendar_of(contract: Mapping) -> dict:
    """A contract's calendar part (without its terms or its tenant)."""
    return {k: v for k, v in contract.items() if k not in (TERMS, "tenant")}


def terms_of(contract: Mapping | None) -> dict | None:
    """A contract's terms, or None (a contract recorded before release 0.6, or a caller that gave a calendar only)."""
    if not contract:
        return None
    return contract.get(TERMS)


def destination_of(contract: Mapping | None) -> dict | None:
    """The destination a contract records (``{"kind", "root"}``), or None."""
    terms = terms_of(contract)
    return None if terms is None else terms.get("destination")


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def changes(recorded: Mapping, wanted: Mapping) -> list[str]:
    """What differs between two contracts, in words an operator reads (never a secret: contracts hold none).

    Example:
        >>> changes({"timezone": "UTC"}, {"timezone": "Europe/Dublin"})
        ['zone UTC -> Europe/Dublin']
    """
    said: list[str] = []
    for field, words in _CALENDAR_WORDS.items():
        if recorded.get(field) != wanted.get(field):
            said.append(f"{words} {recorded.get(field)} -> {wanted.get(field)}")
    if recorded.get("moves", []) != wanted.get("moves", []):
        said.append(f"zone moves {_moves(recorded)} -> {_moves(wanted)}")
    old, new = terms_of(recorded), terms_of(wanted)
    if old is None or new is None:
        return said
    if old.get("destination") != new.get("destination"):
        said.append(f"destination {_place(old.get('destination'))} -> {_place(new.get('destination'))}")
    if old.get("file_format") != new.get("file_format"):
        said.append(f"file format {old.get('file_format')} -> {new.get('file_format')}")
    said.extend(_schema_changes(old.get("schema") or {}, new.get("schema") or {}))
    if old.get("source") != new.get("source"):
        said.append(f"source {_source(old.get('source'))} -> {_source(new.get('source'))}")
    if old.get("version") != new.get("version"):
        said.append(f"version {old.get('version')} -> {new.get('version')}")
    return said


def _moves(contract: Mapping) -> str:
    moves = contract.get("moves") or []
    return ", ".join(f"{m['on']} from {m['from']}" for m in moves) or "none"


def _place(destination: Mapping | None) -> str:
    if not destination:
        return "(none recorded)"
    # The store's locators too (an endpoint, a database): the same root in another store is another place.
    where = ", ".join(f"{k} {v}" for k, v in sorted(destination.items()) if k not in ("kind", "root"))
    return f"{destination.get('kind')} {destination.get('root')}" + (f" ({where})" if where else "")


def _source(source: Mapping | None) -> str:
    if not source:
        return "(none recorded)"
    details = ", ".join(f"{k} {v}" for k, v in sorted(source.items()) if k != "kind")
    return f"{source.get('kind')} ({details})" if details else str(source.get("kind"))


def _schema_changes(old: Mapping, new: Mapping) -> list[str]:
    said: list[str] = []
    before = [tuple(c) for c in old.get("columns") or []]
    after = [tuple(c) for c in new.get("columns") or []]
    kinds_before, kinds_after = dict(before), dict(after)
    added = [f"{name} ({kind})" for name, kind in after if name not in kinds_before]
    dropped = [name for name, _ in before if name not in kinds_after]
    retyped = [
        f"{name} {kinds_before[name]} -> {kind}"
        for name, kind in after
        if name in kinds_before and kinds_before[name] != kind
    ]
    if added:
        said.append(f"columns added: {', '.join(added)}")
    if dropped:
        said.append(f"columns dropped: {', '.join(dropped)}")
    if retyped:
        said.append(f"column kinds changed: {', '.join(retyped)}")
    kept_before = [name for name, _ in before if name in kinds_after]
    kept_after = [name for name, _ in after if name in kinds_before]
    if kept_before != kept_after:
        said.append(f"column order {', '.join(kept_before)} -> {', '.join(kept_after)}")
    for field, words in (("id_columns", "id columns"), ("time_column", "time column"),
                         ("tenant_column", "tenant column")):  # fmt: skip
        if old.get(field) != new.get(field):
            said.append(f"{words} {old.get(field)} -> {new.get(field)}")
    return said
