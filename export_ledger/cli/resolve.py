"""``export-ledger resolve``: an operator's way out for one key, at the destination its ledger row records."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.ledger import ExportLedger
from export_ledger.resolve import resolve_key
from export_ledger.settings import Settings

from . import render
from ._base import UsageError, operator_option


def add_parser(commands, common, location) -> None:
    resolve = commands.add_parser(
        "resolve", parents=[common],
        help="an operator's way out for a key in conflict or escalated: accept or discard what the destination holds",
    )  # fmt: skip
    resolve.add_argument("logical_key", metavar="LOGICAL_KEY", help="as shown by status --needs-attention")
    choice = resolve.add_mutually_exclusive_group(required=True)
    choice.add_argument(
        "--accept-destination", dest="action", action="store_const", const="accept-destination",
        help="record the export the destination holds for this key as completed (after checking it)",
    )  # fmt: skip
    choice.add_argument(
        "--discard-destination", dest="action", action="store_const", const="discard-destination",
        help="move aside or delete what the destination holds at the key's place; the key is exported again",
    )  # fmt: skip
    resolve.add_argument("--reason", required=True, help="why (recorded with who in the attempts table)")
    operator_option(resolve)
    resolve.add_argument(
        "--destination", metavar="SPEC",
        help="not needed: the key's contract records its destination. Given, it must be that one (else refused, "
        "naming both); it answers only for a key claimed before release 0.6",
    )  # fmt: skip
    resolve.set_defaults(handler=resolve_command, check=_a_reason)


def _a_reason(args: argparse.Namespace) -> None:
    if not args.reason.strip():
        raise UsageError("--reason must say why")


def resolve_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    record = operations.require_key(ledger, args.logical_key)
    destination = operations.key_destination(ledger, record, settings=settings, given=args.destination)
    done = resolve_key(
        ledger, destination, args.logical_key, action=args.action, operator=args.operator, reason=args.reason
    )
    if args.json:
        return render.dump(
            [{"logical_key": done.record.logical_key, "state": done.record.state.value, "detail": done.detail}]
        )
    return f"{done.record.logical_key}: {done.record.state.value}; {done.detail}"
