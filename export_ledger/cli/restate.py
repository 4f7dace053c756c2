"""``export-ledger restate``: request the next revision of completed keys (one key, or every key of a date), or
withdraw a request, at the destination its ledger row records."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.ledger import ExportLedger
from export_ledger.restate import withdraw
from export_ledger.settings import Settings

from . import render
from ._base import UsageError, code_location, date_arg, location_note, operator_option, slug_arg


def add_parser(commands, common, location) -> None:
    restate = commands.add_parser(
        "restate", parents=[common, location],
        help="request the next revision of completed keys (a key, or every key of a date), or withdraw a request",
    )  # fmt: skip
    restate.add_argument(
        "logical_key", metavar="LOGICAL_KEY", nargs="?", help="one completed key, as shown by status (or --date)"
    )
    restate.add_argument("--export", type=slug_arg("export name"), help="with --date: the export to restate")
    restate.add_argument(
        "--date", dest="business_date", metavar="YYYY-MM-DD", type=date_arg,
        help="every completed key of this business date (with --export; --tenant for one tenant's)",
    )  # fmt: skip
    restate.add_argument("--tenant", type=slug_arg("tenant id"), help="with --date: only this tenant's key")
    restate.add_argument(
        "--withdraw", action="store_true",
        help="withdraw LOGICAL_KEY's open request instead (the key keeps its current revision)",
    )  # fmt: skip
    restate.add_argument(
        "--destination", metavar="SPEC",
        help="with --withdraw, not needed: the key's contract records its destination, which is fenced and looked "
        "at first. Given, it must be that one (else refused, naming both)",
    )  # fmt: skip
    restate.add_argument("--reason", help="why (required: without it, exit 2; kept with the revision for good)")
    operator_option(restate, "who asks")
    restate.set_defaults(handler=restate_command, check=_one_way_to_name_keys)


def _one_way_to_name_keys(args: argparse.Namespace) -> None:
    by_date = args.business_date is not None
    if by_date == (args.logical_key is not None):
        raise UsageError("restate takes a LOGICAL_KEY, or --export E --date YYYY-MM-DD [--tenant T], not both")
    if by_date and (args.export is None or args.withdraw):
        raise UsageError("--date needs --export (and --withdraw takes one LOGICAL_KEY)")
    if not by_date and (args.export or args.tenant):
        raise UsageError("--export and --tenant go with --date; a LOGICAL_KEY names its export and tenant")
    if args.reason is None:
        raise UsageError('restate needs a reason: --reason "..." (kept with the revision for good)')


def restate_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str | tuple[str, bool]:
    """Records restatement requests (or withdraws one); the ledger refuses what may not be restated, and says why.
    Exit 1 (unresolved) when some keys of the date were refused: scripts must see it."""
    if args.withdraw:
        return _withdraw(ledger, args, settings)
    if args.business_date is not None:
        operations.require_export(ledger, args.export)
        operations.require_tenant(ledger, args.tenant, args.export)
    done = operations.restate(
        ledger, reason=args.reason, requested_by=args.operator, logical_key=args.logical_key, export=args.export,
        business_date=args.business_date, tenant=args.tenant, location=code_location(args),
    )  # fmt: skip
    if args.json:
        items = [{**render.request_json(r), "requested": True} for r in done.requested]
        items += [{"logical_key": key, "requested": False, "refused": why} for key, why in done.refused]
        return render.dump(items + [{"materialize": command.text} for command in done.commands]), bool(done.refused)
    rows = [(r.logical_key, f"revision {r.revision}", "requested") for r in done.requested]
    rows += [(key, "", f"refused: {why}") for key, why in done.refused]
    lines = [render.table(("LOGICAL KEY", "PUBLISHES", "RESULT"), rows)]
    lines += [f"materialize: {command.text}{command.note}" for command in done.commands]
    lines += location_note(args, done.commands, [r.export for r in done.requested])
    lines.append(
        "otherwise the reconciliation sensor launches the partition's run; until it is published the current "
        "revision stays what readers get"
    )
    return "\n".join(lines), bool(done.refused)


def _withdraw(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    record = operations.require_key(ledger, args.logical_key)
    destination = operations.key_destination(ledger, record, settings=settings, given=args.destination)
    record = withdraw(ledger, destination, args.logical_key, operator=args.operator, reason=args.reason)
    if args.json:
        return render.dump([{"logical_key": record.logical_key, "withdrawn": True, "state": record.state.value}])
    return f"{record.logical_key}: restatement withdrawn; {record.state.value}, its current revision unchanged"
