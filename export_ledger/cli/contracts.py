"""``export-ledger accept-contract``: an operator's acceptance of a changed contract, recorded with who and why."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.ledger import ExportLedger
from export_ledger.settings import Settings

from . import render
from ._base import UsageError, date_arg, move_arg, operator_option, slug_arg


def add_parser(commands, common, location) -> None:
    accept = commands.add_parser(
        "accept-contract", parents=[common],
        help="accept the contract the code now declares (the one its refused claims named) after a deliberate change",
    )  # fmt: skip
    accept.add_argument(
        "--export", type=slug_arg("export name"), required=True, help="the export whose contract changed"
    )
    accept.add_argument(
        "--tenant", type=slug_arg("tenant id"),
        help="the tenant whose contract changed (default: every tenant whose claims were refused)",
    )  # fmt: skip
    exported = accept.add_mutually_exclusive_group()
    exported.add_argument(
        "--keep-exported", dest="exported", action="store_const", const="keep",
        help="keys already exported stay as they are, each under the contract it was exported with",
    )  # fmt: skip
    exported.add_argument(
        "--restate-exported", dest="exported", action="store_const", const="restate",
        help="request a restatement of every key already exported (not with a new destination)",
    )  # fmt: skip
    accept.add_argument(
        "--timezone",
        help="instead of the refused contract: declare a calendar (the zone the code now declares, e.g. "
        "America/Chicago), with --start-date; the terms in force stay",
    )
    accept.add_argument(
        "--move", action="append", default=[], type=move_arg, metavar="YYYY-MM-DD:ZONE",
        help="with --timezone: an earlier zone (repeatable, oldest first): business dates before the date were ZONE's",
    )  # fmt: skip
    accept.add_argument(
        "--start-date", dest="start_date", type=date_arg, metavar="YYYY-MM-DD",
        help="with --timezone: the start date the code now declares",
    )  # fmt: skip
    accept.add_argument("--reason", required=True, help="why the contract changed; recorded in the ledger")
    operator_option(accept)
    accept.set_defaults(handler=accept_command, check=_reason_and_calendar)


def _reason_and_calendar(args: argparse.Namespace) -> None:
    if not args.reason.strip():
        raise UsageError("--reason must say why the contract changed")
    operations.declared_calendar(args.timezone, args.start_date, args.move)


def accept_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    operations.require_export(ledger, args.export)
    operations.require_tenant(ledger, args.tenant, args.export)
    try:
        done = operations.accept_contract(
            ledger, args.export, reason=args.reason, operator=args.operator, tenant=args.tenant,
            exported=args.exported, timezone=args.timezone, start_date=args.start_date, moves=args.move,
        )  # fmt: skip
    except ValueError as exc:  # the ledger's refusal of the options as given (a --restate-exported it cannot do)
        raise UsageError(str(exc)) from None
    if args.json:
        items = [
            {"export": a.export, "tenant": a.tenant, "previous": a.previous, "accepted": a.accepted,
             "changes": a.changes, "reason": args.reason.strip(), "exported": args.exported}
            for a in done.accepted
        ]  # fmt: skip
        return render.dump(items + [{"restatements_requested": done.restated, "restatements_refused": done.refused}])
    lines = []
    for a in done.accepted:
        scope = a.export if a.tenant is None else f"{a.export}, tenant {a.tenant}"
        lines.append(f"accepted for {scope}: {'; '.join(a.changes) or 'no change'}")
    if args.exported == "restate":
        lines.append(
            f"restatements requested for {done.restated} key(s) already exported ({done.refused} refused); the "
            "reconciliation sensor launches their partitions, or materialize them"
        )
    elif args.exported == "keep":
        lines.append("keys already exported stay as they are, each under the contract it was exported with")
    return "\n".join(lines)
