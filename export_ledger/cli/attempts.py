"""``export-ledger attempts``: one key's attempts, in order (read only)."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.ledger import ExportLedger
from export_ledger.settings import Settings

from . import render
from ._base import ATTEMPTS_LIMIT


def add_parser(commands, common, location) -> None:
    attempts = commands.add_parser("attempts", parents=[common], help="the attempts of one logical export, in order")
    attempts.add_argument(
        "logical_key", metavar="LOGICAL_KEY", help="as shown by status, e.g. invoice_export/acme/2026-03-08T05:00:00Z"
    )
    attempts.set_defaults(handler=attempts_command, read_only=True)


def attempts_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    record = operations.require_key(ledger, args.logical_key)
    attempts = ledger.queries.attempts(record.logical_key, limit=ATTEMPTS_LIMIT)
    if args.json:
        return render.dump([render.attempt_json(attempt) for attempt in attempts])
    if not attempts:
        # Attempt rows are written when an outcome is known: a first attempt still running has none yet.
        return f"no finished attempts for {record.logical_key} yet (state {record.state.value})"
    rows = [
        (a.attempt_id, a.fencing_token, render.short_time(a.started_at), render.short_time(a.finished_at),
         a.outcome.value, a.error_class, a.error_message)
        for a in attempts
    ]  # fmt: skip
    headers = ("ATTEMPT", "TOKEN", "STARTED", "FINISHED", "OUTCOME", "ERROR", "MESSAGE")
    total = ledger.queries.attempt_count(record.logical_key) if len(attempts) == ATTEMPTS_LIMIT else len(attempts)
    note = f"\n(the last {ATTEMPTS_LIMIT} of {total} attempts)" if total > len(attempts) else ""
    return render.table(headers, rows, keep_first=False) + note
