"""``export-ledger status``: the logical exports, or only the stale ones, the ones being restated, or the ones that
need a person (``--needs-attention``, in :mod:`.attention`)."""

from __future__ import annotations

import argparse

from export_ledger import operations
from export_ledger.ledger import ExportLedger, ExportState
from export_ledger.ledger.core import DEFAULT_MAX_ATTEMPTS
from export_ledger.restate import published_revisions, records_of
from export_ledger.settings import Settings

from . import attention, render
from ._base import STALE, STATUS_LIMIT, UsageError, date_arg, location_named, more, positive_int_arg, slug_arg

#: ``--state restating``: keys with an open restatement request (completed until claimed, then under way).
RESTATING = "restating"

HEADERS = ("LOGICAL KEY", "STATE", "BUSINESS DATE", "ZONE", "ROWS", "COMMITTED ATTEMPT", "LEASE OWNER",
           "LEASE EXPIRES", "UPDATED", "REVISION")  # fmt: skip
#: Left out first when the table cannot fit: the longest and least read (an attempt id is 40+ characters).
DROPPABLE = ("COMMITTED ATTEMPT", "LEASE OWNER", "LEASE EXPIRES", "UPDATED", "REVISION")


def add_parser(commands, common, location) -> None:
    status = commands.add_parser("status", parents=[common, location], help="one line per logical export")
    status.add_argument("--export", type=slug_arg("export name"), help="only this export, e.g. invoice_export")
    status.add_argument("--tenant", type=slug_arg("tenant id"), help="only this tenant")
    status.add_argument("--from", dest="date_from", metavar="YYYY-MM-DD", type=date_arg,
                        help="business dates from this day (inclusive)")  # fmt: skip
    status.add_argument("--to", dest="date_to", metavar="YYYY-MM-DD", type=date_arg,
                        help="business dates up to this day (inclusive)")  # fmt: skip
    status.add_argument(
        "--state", dest="states", action="append", default=[],
        choices=[state.value for state in ExportState] + [STALE, RESTATING],
        help="only exports in this state; repeat for several. 'stale': completed keys whose source changed since "
        "(found by the drift sensor or `export-ledger drift`), with counts of rows added, removed and changed; "
        "'restating': keys with an open restatement request, with the revision it publishes and why",
    )  # fmt: skip
    status.add_argument(
        "--limit", type=positive_int_arg, metavar="N", default=STATUS_LIMIT,
        help=f"at most N rows (default {STATUS_LIMIT}; every read is bounded, a longer list says how to page)",
    )  # fmt: skip
    status.add_argument("--offset", type=int, default=0, metavar="N", help="skip the first N rows (paging)")
    status.add_argument(
        "--needs-attention", action="store_true",
        help="only keys escalated to a person (conflict; failed with automatic reruns spent; stuck too long), "
        "each with why and the way out",
    )  # fmt: skip
    status.add_argument(
        "--stuck-after-hours", type=positive_int_arg, default=6, metavar="H",
        help="with --needs-attention: a key failed, remote_unknown or abandoned longer than this is escalated (6)",
    )  # fmt: skip
    status.add_argument(
        "--max-attempts", type=positive_int_arg, default=DEFAULT_MAX_ATTEMPTS, metavar="N",
        help=f"with --needs-attention: claims before reruns stop being automatic ({DEFAULT_MAX_ATTEMPTS})",
    )  # fmt: skip
    status.set_defaults(handler=status_command, read_only=True, check=_options_agree)


def _options_agree(args: argparse.Namespace) -> None:
    if args.date_from and args.date_to and args.date_from > args.date_to:
        raise UsageError(f"--from {args.date_from} is after --to {args.date_to}")
    location_named(args)  # -a without -f/-m
    if len(set(args.states)) > 1 and STALE in args.states:
        raise UsageError("--state stale lists stale keys only; it cannot be combined with other states")
    if len(set(args.states)) > 1 and RESTATING in args.states:
        raise UsageError("--state restating lists keys with an open restatement only; it cannot be combined")


def status_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    operations.require_export(ledger, args.export)
    if args.needs_attention:
        # Not checked against the ledger: a tenant the code declares may be late with no trace in it yet, and a
        # partition never claimed concerns every tenant.
        return attention.needs_attention(ledger, args)
    operations.require_tenant(ledger, args.tenant, args.export)
    if STALE in args.states:
        return stale(ledger, args)
    if RESTATING in args.states:
        return restating(ledger, args)
    records = ledger.queries.records(
        export=args.export, tenant=args.tenant, date_from=args.date_from, date_to=args.date_to,
        states=[ExportState(value) for value in args.states], limit=args.limit, offset=args.offset,
    )  # fmt: skip
    # One read of the shown keys' requests (a page of at most --limit keys): most were never restated (revision 1).
    published = published_revisions(ledger, [r.logical_key for r in records]) if records else {}
    revision = {key: request.revision for key, request in published.items()}
    if args.json:
        return render.dump([{**render.record_json(r), "revision": revision.get(r.logical_key, 1)} for r in records])
    if not records:
        return "no exports match"
    rows = []
    for r in records:
        owner, expires = render.lease(r)
        rows.append((
            r.logical_key, r.state.value, r.business_date.isoformat(), r.timezone, r.row_count, r.committed_attempt,
            owner, render.short_time(expires), render.short_time(r.updated_at),
            revision.get(r.logical_key, ""),  # shown where restated (> 1): the current revision
        ))  # fmt: skip
    return render.table(HEADERS, rows, DROPPABLE) + more(len(records), args)


def restating(ledger: ExportLedger, args: argparse.Namespace) -> str:
    """Keys with an open restatement request: the revision it publishes, who asked, when and why."""
    requests = ledger.restatements.requests(
        export=args.export, tenants=[args.tenant] if args.tenant else (), date_from=args.date_from,
        date_to=args.date_to, limit=args.limit,
    )  # fmt: skip
    states = {key: r.state.value for key, r in records_of(ledger, requests).items()}
    if args.json:
        return render.dump([{**render.request_json(r), "state": states.get(r.logical_key)} for r in requests])
    if not requests:
        return "no open restatements"
    rows = [
        (r.logical_key, states.get(r.logical_key), r.business_date.isoformat(), r.revision, r.requested_by,
         render.short_time(r.requested_at), r.reason)
        for r in requests
    ]  # fmt: skip
    headers = ("LOGICAL KEY", "STATE", "BUSINESS DATE", "REVISION", "REQUESTED BY", "REQUESTED", "REASON")
    return (
        render.table(headers, rows) + "\npublished by each partition's next materialization (the reconciliation "
        "sensor launches it); withdraw with: export-ledger restate --withdraw LOGICAL_KEY --reason ..."
    )


def stale(ledger: ExportLedger, args: argparse.Namespace) -> str:
    """Completed keys with an open drift record: counts of rows added, removed and changed (never values)."""
    found = ledger.drift.open_records(
        export=args.export, tenants=[args.tenant] if args.tenant else (), date_from=args.date_from,
        date_to=args.date_to, limit=args.limit,
    )  # fmt: skip
    if args.json:
        return render.dump([drift_json(r) for r in found])
    if not found:
        return "no stale exports"
    rows = [
        (r.logical_key, STALE, r.business_date.isoformat(), r.rows_added, r.rows_removed,
         "unknown" if r.rows_changed is None else r.rows_changed, render.short_time(r.detected_at))
        for r in found
    ]  # fmt: skip
    headers = ("LOGICAL KEY", "STATE", "BUSINESS DATE", "ADDED", "REMOVED", "CHANGED", "DETECTED")
    return render.table(headers, rows) + (
        "\nthe remedy is a restatement, a new revision beside the current one: "
        'export-ledger restate LOGICAL_KEY --reason "..."'
    )


def drift_json(record) -> dict:
    return {
        "logical_key": record.logical_key,
        "export": record.export,
        "tenant": record.tenant,
        "business_date": record.business_date.isoformat(),
        "state": STALE,
        "rows_added": record.rows_added,
        "rows_removed": record.rows_removed,
        "rows_changed": record.rows_changed,
        "detected_at": render.iso(record.detected_at),
    }
