"""``export-ledger prune``: delete completed records older than a horizon, keeping a low-water mark; a plan first."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.ledger import ExportLedger
from export_ledger.settings import Settings

from . import render
from ._base import UsageError, days_arg, operator_option, slug_arg


def add_parser(commands, common, location) -> None:
    prune = commands.add_parser(
        "prune", parents=[common], help="delete completed records older than a horizon, keeping a low-water mark"
    )
    prune.add_argument(
        "--older-than", dest="older_than", metavar="DAYS", type=days_arg, required=True,
        help="prune completed keys whose business date is more than DAYS days ago (UTC)",
    )  # fmt: skip
    prune.add_argument("--export", type=slug_arg("export name"), help="only this export")
    prune.add_argument("--yes", action="store_true", help="apply the plan (without it, prune only shows it)")
    prune.add_argument(
        "--close-unexported", action="store_true",
        help="let the mark close business dates that have no key at all (never exported); needs --reason",
    )  # fmt: skip
    prune.add_argument("--reason", help="why dates never exported may be closed (recorded)")
    operator_option(prune)
    prune.set_defaults(handler=prune_command, check=_reason_to_close)


def _reason_to_close(args: argparse.Namespace) -> None:
    if args.close_unexported and not (args.reason and args.reason.strip()):
        raise UsageError("--close-unexported needs --reason: closing dates never exported is recorded")


def prune_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    operations.require_export(ledger, args.export)
    if args.yes:
        plans = ledger.retention.prune(
            args.older_than, export=args.export, close_unexported=args.close_unexported, operator=args.operator,
            reason=args.reason,
        )  # fmt: skip
    else:
        plans = ledger.retention.plan(args.older_than, export=args.export, close_unexported=args.close_unexported)
    if args.json:
        return render.dump([
            {"export": p.export, "applied": args.yes, "pruned": p.pruned, "low_water_date": render.date(p.mark),
             "previous_low_water_date": render.date(p.previous_mark), "blocked_by": render.date(p.blocked_by),
             "unexported_dates": [d.isoformat() for d in p.unexported], "unexported_count": p.unexported_count,
             "missing_tenants": p.missing_tenants}
            for p in plans
        ])  # fmt: skip
    if not plans:
        return "nothing to prune"
    rows = [
        (p.export, p.pruned, render.date(p.previous_mark), render.date(p.mark), render.date(p.blocked_by),
         p.unexported_count)
        for p in plans
    ]  # fmt: skip
    headers = ("EXPORT", "COMPLETED RECORDS PRUNED", "MARK BEFORE", "MARK AFTER", "STOPPED BY", "DATES NEVER EXPORTED")
    lines = [render.table(headers, rows)]
    for p in plans:
        if p.blocked_by is not None and p.mark is not None and p.mark <= p.blocked_by:
            lines.append(f"{p.export}: the mark stops at {p.blocked_by}, which still has a key not completed")
        if p.unexported and not p.closes_unexported:
            who = ", ".join(p.missing_tenants[:5]) + (", ..." if len(p.missing_tenants) > 5 else "")
            lines.append(
                f"{p.export}: {p.unexported_count} date(s) from {p.unexported[0]} have a tenant with no key at all "
                f"(on {p.unexported[0]}: {who}) and stay open; export them, or (a tenant that left the export) "
                '--close-unexported --reason "..." closes them (recorded)'
            )
    if not args.yes:
        lines.append("dry run: nothing changed; add --yes to apply")
    return "\n".join(lines)
