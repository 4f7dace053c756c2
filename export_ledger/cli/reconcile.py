"""``export-ledger reconcile``: what the reconciliation sensor does each tick, once, without a daemon."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.calendar import utc_iso
from export_ledger.ledger import ExportLedger
from export_ledger.settings import Settings

from . import render
from ._base import code_location, location_note, positive_int_arg, slug_arg


def add_parser(commands, common, location) -> None:
    reconcile = commands.add_parser(
        "reconcile", parents=[common, location],
        help="resolve stuck keys once from the destination's evidence (what the reconciliation sensor does)",
    )  # fmt: skip
    reconcile.add_argument(
        "--limit", type=positive_int_arg, metavar="N", default=1000, help="examine at most N stuck keys (default 1000)"
    )
    reconcile.add_argument("--export", type=slug_arg("export name"), help="only this export's stuck keys")
    reconcile.add_argument(
        "--destination", metavar="SPEC",
        help="not needed: each key is judged at the destination its contract records. Given, it must be that one "
        "(else refused, naming both); it answers only for keys claimed before release 0.6, which record none",
    )  # fmt: skip
    reconcile.set_defaults(handler=reconcile_command)


def reconcile_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> tuple[str, bool]:
    """Exit 1 (unresolved) while a key's destination could not answer: it is still stuck."""
    done = operations.reconcile_once(
        ledger, settings=settings, limit=args.limit, export=args.export, destination=args.destination,
        location=code_location(args), reconciler=f"export-ledger reconcile@{utc_iso(ledger.now())}",
    )  # fmt: skip
    report = done.report
    if report is None:
        return ("[]" if args.json else "no stuck export keys"), False
    now = {finding.record.logical_key: record.state.value for finding, record in report.resolved}
    unresolved = bool(report.unreachable)
    if args.json:
        return render.dump([
            {"logical_key": f.record.logical_key, "was": f.record.state.value, "verdict": f.verdict.value,
             "now": now.get(f.record.logical_key, f.record.state.value), "detail": f.detail}
            for f in report.findings
        ]), unresolved  # fmt: skip
    if not report.findings:
        return "no stuck export keys", unresolved
    rows = [
        (f.record.logical_key, f.record.state.value, now.get(f.record.logical_key, "unchanged"), f.detail)
        for f in report.findings
    ]
    lines = [render.table(("LOGICAL KEY", "WAS", "NOW", "EVIDENCE"), rows)]
    lines += [f"rerun: {command.text}{command.note}" for command in done.reruns]
    lines += location_note(args, done.reruns, [f.record.export for f in report.findings])
    if report.unreachable:
        lines.append(f"{len(report.unreachable)} key(s) left unchanged: the destination could not be reached")
    if report.next_after is not None:
        lines.append(f"more stuck keys remain beyond --limit {args.limit}; run again")
    return "\n".join(lines), unresolved
