"""``export-ledger drift``: what the drift sensor does each tick, once: the sources of recently completed keys read
again, and the keys whose source changed since recorded as stale."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.drift import DEFAULT_LOOKBACK_DAYS
from export_ledger.ledger import ExportLedger
from export_ledger.settings import Settings

from . import render
from ._base import (
    PROG,
    STALE,
    UsageError,
    code_location,
    location_named,
    operator_option,
    positive_int_arg,
    slug_arg,
)


def add_parser(commands, common, location) -> None:
    drift = commands.add_parser(
        "drift", parents=[common, location],
        help="re-read the sources of recently completed keys once and record which are stale (what the drift "
        "sensor does)",
    )  # fmt: skip
    drift.add_argument(
        "--specs", metavar="MODULE:ATTR", action="append",
        help="instead of -f/-m: a module's declared exports (an ExportSpec or a list of them), e.g. "
        "examples.shop_definitions:orders; repeat for several",
    )  # fmt: skip
    drift.add_argument("--export", type=slug_arg("export name"), help="only this export's keys")
    drift.add_argument(
        "--destination", metavar="SPEC",
        help="where exports without a destination of their own are published "
        "(default: $EXPORTS_DESTINATION, else ./var/exports)",
    )  # fmt: skip
    drift.add_argument(
        "--lookback-days", type=positive_int_arg, metavar="N", default=DEFAULT_LOOKBACK_DAYS,
        help=f"check keys of the last N business dates of each export (default {DEFAULT_LOOKBACK_DAYS}); the "
        "summary counts the completed keys older than that and names the N that reaches them",
    )  # fmt: skip
    drift.add_argument(
        "--limit", type=positive_int_arg, metavar="N", default=1000, help="check at most N keys (default 1000)"
    )
    operator_option(drift, "who runs it: named as who asked for the restatements of exports with restate_stale")
    drift.set_defaults(handler=drift_command, check=_sources_named)


def _sources_named(args: argparse.Namespace) -> None:
    if location_named(args) == bool(args.specs):
        raise UsageError(
            "--specs and -f/-m both name the declared exports: give one of them" if args.specs else
            "drift needs the declared exports: name the code location with -f FILE or -m MODULE"
        )  # fmt: skip


def drift_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> tuple[str, bool]:
    """Exit 1 (unresolved) when a key could not be checked, or an export's source cannot be used here."""
    location = code_location(args)
    specs = list(location.specs) if location is not None else operations.load_specs(args.specs)
    done = operations.drift_once(
        ledger, specs, settings=settings, lookback_days=args.lookback_days, limit=args.limit,
        requested_by=f"{PROG} drift ({args.operator})", export=args.export, destination=args.destination,
        location=location,
    )  # fmt: skip
    report = done.report
    opened, cleared = set(report.changes.opened), sorted(report.changes.cleared)
    if args.json:
        items = [
            {"logical_key": f.record.logical_key, "result": STALE, "new": f.record.logical_key in opened,
             "rows_added": f.rows_added, "rows_removed": f.rows_removed, "rows_changed": f.rows_changed}
            for f in report.stale
        ]  # fmt: skip
        items += [{"logical_key": key, "result": "cleared"} for key in cleared]
        items += [{"logical_key": key, "result": "not checked", "detail": why} for key, why in report.unchecked]
        return render.dump(items), done.unresolved
    rows = [
        (f.record.logical_key, "stale (new)" if f.record.logical_key in opened else STALE, f.rows_added,
         f.rows_removed, "unknown" if f.rows_changed is None else f.rows_changed, "")
        for f in report.stale
    ]  # fmt: skip
    rows += [(key, "cleared: matches its source again", "", "", "", "") for key in cleared]
    rows += [(key, "not checked", "", "", "", why) for key, why in report.unchecked]
    table = [render.table(("LOGICAL KEY", "RESULT", "ADDED", "REMOVED", "CHANGED", "DETAIL"), rows)] if rows else []
    return "\n".join(table + _summary(done, args)), done.unresolved


def _summary(done: operations.Drifted, args: argparse.Namespace) -> list[str]:
    report = done.report
    lines = [
        f"{report.checked} key(s) checked: {len(report.stale)} stale, {len(report.matching)} match their source"
        f"{f', {len(report.unchecked)} not checked' if report.unchecked else ''}"
    ]
    if done.without_source:
        lines.append(f"not checked, no source to read again here: {', '.join(done.without_source)}")
    if report.stale:
        lines.append(
            "stale keys: export-ledger status --state stale; restate one with "
            'export-ledger restate LOGICAL_KEY --reason "..."'
        )
    if report.restatements.requested:
        lines.append(
            f"{len(report.restatements.requested)} restatement(s) requested (exports with restate_stale): "
            "export-ledger status --state restating"
        )
    if done.beyond.keys:
        lines.append(
            f"{done.beyond.keys} completed key(s) older than the lookback of {args.lookback_days} day(s) were not "
            f"checked (the oldest of {done.beyond.oldest}); --lookback-days {done.beyond.lookback_days_needed} "
            "checks them too"
        )
    if report.next_after is not None:
        lines.append(f"more keys remain beyond --limit {args.limit}; run again")
    return lines
