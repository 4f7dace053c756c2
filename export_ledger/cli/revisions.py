"""``export-ledger revisions``: every published revision of one key, with who asked and why (read only)."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.ledger import ExportLedger
from export_ledger.settings import Settings

from . import render

#: Unchanged restatements of one key listed at most (each a request closed without a new revision).
UNCHANGED_LIMIT = 200


def add_parser(commands, common, location) -> None:
    revisions = commands.add_parser(
        "revisions", parents=[common], help="every published revision of one key, oldest first, with who and why"
    )
    revisions.add_argument("logical_key", metavar="LOGICAL_KEY", help="as shown by status")
    revisions.set_defaults(handler=revisions_command, read_only=True)


def revisions_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    revisions = ledger.restatements.revisions(args.logical_key)
    if not revisions:
        record = operations.require_key(ledger, args.logical_key)
        return f"{record.logical_key} has no published revision yet (state {record.state.value})"
    unchanged = ledger.restatements.requests(
        logical_keys=[args.logical_key], outcomes=["unchanged"], limit=UNCHANGED_LIMIT
    )
    if args.json:
        return render.dump(
            [render.revision_json(r) for r in revisions]
            + [{**render.request_json(r), "outcome": "unchanged", "closed_at": render.iso(r.closed_at)}
               for r in unchanged]
        )  # fmt: skip
    headers = (
        "REVISION", "SHA256", "ROWS", "SUPERSEDES", "REASON", "REQUESTED BY", "REQUESTED", "PUBLISHED BY", "LOCATION",
    )  # fmt: skip
    rows = [
        (r.revision, r.sha256, r.row_count, r.supersedes_revision, r.reason, r.requested_by,
         render.short_time(r.requested_at), r.published_by, r.location)
        for r in revisions
    ]  # fmt: skip
    notes = "".join(
        f"\nrevision {r.revision} not published: its data was identical to the current revision's "
        f"(reason {render.printable(r.reason)!r}, requested by {r.requested_by}, "
        f"closed {render.short_time(r.closed_at)})"
        for r in unchanged
    )
    return render.table(headers, rows) + f"\ncurrent: revision {revisions[-1].revision}" + notes
