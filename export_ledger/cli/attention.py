"""``export-ledger status --needs-attention``: the keys that wait for a person, each with why and its way out, as
lines to paste."""

from __future__ import annotations

import argparse
import datetime as dt

from export_ledger import operations
from export_ledger.deadlines import late_keys, with_late
from export_ledger.ledger import ExportLedger

from . import render
from ._base import code_location, command_notes, more


def needs_attention(ledger: ExportLedger, args: argparse.Namespace) -> str:
    found = ledger.attention.needs_attention(
        dt.timedelta(hours=args.stuck_after_hours), max_attempts=args.max_attempts,
        exports=[args.export] if args.export else (), tenants=[args.tenant] if args.tenant else (), limit=args.limit,
        offset=args.offset,
    )  # fmt: skip
    location = code_location(args)
    if location is not None and args.offset == 0:
        # Late keys are read against the declared exports' deadlines (a key never attempted has no row to list).
        specs = [s for s in location.specs if not args.export or s.name == args.export]
        late = [e for e in late_keys(ledger, specs, limit=args.limit) if not args.tenant or e.tenant == args.tenant]
        found = with_late(late, found, args.limit)
    assets: dict = {}  # each (export, zone)'s asset, looked up once a listing
    ways = [operations.ways_out(ledger, e, location, ledger_url=args.ledger_url, assets=assets) for e in found]
    if args.json:
        return render.dump([
            {**(render.record_json(e.record) if e.record else _escalation_json(e)), "state": e.state,
             "needs_attention": e.why, "ways_out": out}
            for e, out in zip(found, ways, strict=True)
        ])  # fmt: skip
    if not found:
        return "no export key needs attention"
    rows = [(e.name, e.state, e.record.claim_count if e.record else None, render.short_time(e.since)) for e in found]
    table = render.with_notes(
        ("LOGICAL KEY", "STATE", "CLAIMS", "SINCE"), rows, "WHY, AND THE WAY OUT", [e.why for e in found]
    )
    # Commands are printed whole, never wrapped: they are to be pasted.
    listed = [
        f"  {e.name}\n" + "\n".join(f"    {command}" for command in out)
        for e, out in zip(found, ways, strict=True)
        if out
    ]
    if listed:
        materialize = [line for out in ways for line in out if " asset materialize " in line]
        notes = render.wrapped_notes(command_notes(args, materialize, [e.export for e in found]))
        table += "\n\nways out, to paste (write each --reason; lines with # are notes):\n" + "\n".join(notes + listed)
    return table + more(len(found), args)


def _escalation_json(escalation) -> dict:
    """An escalation without a key: a refused tenant, or a partition whose runs never claimed."""
    return {
        "export": escalation.export,
        "tenant": escalation.tenant,
        "timezone": escalation.timezone,
        "business_date": escalation.business_date.isoformat() if escalation.business_date else None,
    }
