"""``export-ledger``: the operator's view of the export ledger, and reconciliation without a daemon.

Subcommands, each with a readable table or ``--json``::

    export-ledger status [--export E] [--tenant T] [--from YYYY-MM-DD] [--to YYYY-MM-DD] [--state S ...] [--limit N]
    export-ledger attempts <logical key>
    export-ledger reconcile [--export E] [--limit N]
    export-ledger drift -f FILE | -m MODULE [-a ATTR] | --specs MODULE:ATTR [--export E] [--destination SPEC]
                        [--lookback-days N] [--limit N]
    export-ledger prune --older-than DAYS [--export E]
    export-ledger accept-contract --export E [--tenant T] [--keep-exported | --restate-exported] --reason "..."
    export-ledger accept-contract --export E [--tenant T] --timezone Z --start-date YYYY-MM-DD [--move D:ZONE]
                                  --reason "..."
    export-ledger restate LOGICAL_KEY --reason "..." [--operator WHO]
    export-ledger restate --export E --date YYYY-MM-DD [--tenant T] --reason "..." [--operator WHO]
    export-ledger restate --withdraw LOGICAL_KEY --reason "..." [--operator WHO]
    export-ledger revisions LOGICAL_KEY
    export-ledger upgrade

``status`` and ``attempts`` only read. ``reconcile`` does once what the reconciliation sensor does each tick:
it probes each stuck key at the destination its contract records and records what it finds. ``prune`` deletes old
completion records and keeps a low-water mark; ``drift`` does once what the drift sensor does each tick (re-reads the
sources of recently completed keys and records which are stale); ``status --state stale`` lists them with their counts;
``accept-contract`` records an operator's acceptance of a changed contract (the one the refused claims named, or a
calendar given by its options) and what becomes of the keys already exported. ``restate`` records a request to publish
the next revision of completed keys (published by the partition's next materialization: the command it prints, a
launch from the UI, or the reconciliation sensor), or withdraws one; ``revisions`` lists every revision of a key, and
``status --state restating`` the keys with an open request.

The ledger is found from ``--ledger-url``, else ``EXPORTS_LEDGER_URL``, else ``./var/ledger.sqlite3``. A key's
destination is the one its contract records: ``reconcile``, ``resolve`` and ``restate --withdraw`` act there, and refuse
a ``--destination`` that names another (only a key claimed before release 0.6, which records none, takes
``--destination``, else ``EXPORTS_DESTINATION``). Credentials come from the environment, never the ledger. Export
names come from the ledger: ``--export`` names one it knows. ``restate``, ``reconcile`` and ``drift`` take a code
location as ``dagster`` does (``-f FILE`` or ``-m MODULE``, ``-a ATTRIBUTE``): only then is it imported (:mod:`export_ledger.dagster.code_location`), its declared
exports and destinations are used, and the printed ``dagster`` commands repeat those options. ``drift`` needs the
sources: a code location, or ``--specs module:attribute`` (an ``ExportSpec`` or a list of them). Each command is one
call of :mod:`export_ledger.operations` (or of the ledger) and renders what it returns.

Exit codes: 0 success (an empty result included), 1 the ledger could not be read, the key is unknown, or
``reconcile`` left keys unresolved because the destination was unreachable; 2 bad usage. Every error is one line
on stderr starting ``export-ledger: error:``; no traceback, no password.

The ledger holds no customer data, and the CLI prints only ledger fields chosen one by one below, so a column
added to the ledger later is not shown until someone decides it should be.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import getpass
import json
import os
import re
import shutil
import socket
import sqlite3
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL

from export_ledger import operations
from export_ledger.calendar import ExportCalendar, ZoneMove, utc_iso
from export_ledger.deadlines import late_keys
from export_ledger.drift import DEFAULT_LOOKBACK_DAYS
from export_ledger.errors import ConfigurationError, ExportLedgerError, InvalidIdentifier, redact_text
from export_ledger.keys import validate_slug
from export_ledger.ledger import (
    AttemptRecord,
    ExportLedger,
    ExportRecord,
    ExportState,
    Restatement,
    Revision,
    dispose_engines,
    redact_url,
    upgrade_url,
)
from export_ledger.ledger.core import DEFAULT_MAX_ATTEMPTS
from export_ledger.ledger.store import why_unreachable
from export_ledger.ledger.urls import database_url
from export_ledger.restate import (
    published_revisions,
    records_of,
    withdraw,
)
from export_ledger.settings import LEDGER_URL_ENV, Settings
from export_ledger.sources import UnusableSource

#: Rows a CLI read returns unless ``--limit`` says otherwise: every read is bounded, whatever the ledger holds.
STATUS_LIMIT = 500
ATTEMPTS_LIMIT = 200

PROG = "export-ledger"
#: ``status --state stale``: not a state of export_runs (a stale key stays completed) but an open drift record.
STALE = "stale"
#: ``status --state restating``: keys with an open restatement request (completed until claimed, then under way).
RESTATING = "restating"
USAGE_ERROR = 2
RUNTIME_ERROR = 1
EXIT_CODES = """exit codes:
  0  success (an empty result included)
  1  the command could not be carried out: the ledger could not be read, a key or export is unknown, the ledger
     refused (a restatement, a resolution), or keys were left unresolved or unchecked (reconcile, drift, restate)
  2  bad usage: an unknown option or value, a missing required option (restate without --reason, drift without
     -f/-m/--specs), or a command that needs narrowing (reconcile of several exports without --export or -f/-m)

A logical key is written export/tenant/window start in UTC, e.g. invoice_export/acme/2026-03-08T05:00:00Z
(export-ledger status lists them). -f FILE / -m MODULE [-a ATTRIBUTE] name the code location as dagster does."""

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class UsageError(Exception):
    """The command line itself is wrong (exit 2, as argparse does)."""


class CliError(Exception):
    """The command is well formed but cannot be carried out (exit 1)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse would print the usage block and "export-ledger status: error: ..."; operators and scripts get
        # one line with a fixed prefix instead, and main() returns the exit code rather than exiting.
        raise UsageError(message)


# -- argument types ------------------------------------------------------------------------------------------------


def _date_arg(text: str) -> dt.date:
    # date.fromisoformat alone would also accept 20260308 on Python 3.11; partitions are written YYYY-MM-DD.
    if _DATE_RE.fullmatch(text):
        with contextlib.suppress(ValueError):
            return dt.date.fromisoformat(text)
    raise argparse.ArgumentTypeError(f"invalid date {text!r}: expected a calendar date as YYYY-MM-DD")


def _slug_arg(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return validate_slug(text, what)
        except InvalidIdentifier as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid limit {text!r}: expected a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``export-ledger`` argument parser; ``--ledger-url`` is accepted before or after the subcommand."""
    ledger_url_help = f"SQLAlchemy URL of the ledger (default: ${LEDGER_URL_ENV}, else ./var/ledger.sqlite3)"
    parser = _Parser(
        prog=PROG,
        description="Read the export ledger: logical exports and their attempts.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ledger-url", metavar="URL", help=ledger_url_help)
    # The same option on each subcommand, defaulting to "not given" so it never overwrites the global one.
    common = _Parser(add_help=False)
    common.add_argument("--ledger-url", metavar="URL", default=argparse.SUPPRESS, help=ledger_url_help)
    common.add_argument("--json", action="store_true", help="print a JSON array instead of a table")

    # A code location named as Dagster's CLI names one; the printed dagster commands repeat these options exactly.
    location = _Parser(add_help=False)
    where = location.add_mutually_exclusive_group()
    where.add_argument("-f", "--python-file", dest="python_file", metavar="FILE", help="the code location's file")
    where.add_argument("-m", "--module-name", dest="module_name", metavar="MODULE", help="the code location's module")
    where.add_argument(
        "-w", "--workspace", dest="workspace", metavar="WORKSPACE",
        help="a workspace.yaml that declares the code location (one python_file or python_module)",
    )  # fmt: skip
    location.add_argument(
        "-a", "--attribute", metavar="ATTRIBUTE",
        help="the Definitions in the file or module (default: the one Definitions there)",
    )  # fmt: skip

    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    status = commands.add_parser("status", parents=[common, location], help="one line per logical export")
    status.add_argument("--export", type=_slug_arg("export name"), help="only this export, e.g. invoice_export")
    status.add_argument("--tenant", type=_slug_arg("tenant id"), help="only this tenant")
    status.add_argument(
        "--from",
        dest="date_from",
        metavar="YYYY-MM-DD",
        type=_date_arg,
        help="business dates from this day (inclusive)",
    )
    status.add_argument(
        "--to", dest="date_to", metavar="YYYY-MM-DD", type=_date_arg, help="business dates up to this day (inclusive)"
    )
    status.add_argument(
        "--state",
        dest="states",
        action="append",
        default=[],
        choices=[state.value for state in ExportState] + [STALE, RESTATING],
        help="only exports in this state; repeat for several. 'stale': completed keys whose source changed since "
        "(found by the drift sensor or `export-ledger drift`), with counts of rows added, removed and changed; "
        "'restating': keys with an open restatement request, with the revision it publishes and why",
    )
    status.add_argument(
        "--limit", type=_positive_int_arg, metavar="N", default=STATUS_LIMIT,
        help=f"at most N rows (default {STATUS_LIMIT}; every read is bounded, a longer list says how to page)",
    )  # fmt: skip
    status.add_argument("--offset", type=int, default=0, metavar="N", help="skip the first N rows (paging)")
    status.add_argument(
        "--needs-attention",
        action="store_true",
        help="only keys escalated to a person (conflict; failed with automatic reruns spent; stuck too long), "
        "each with why and the way out",
    )
    status.add_argument(
        "--stuck-after-hours", type=_positive_int_arg, default=6, metavar="H",
        help="with --needs-attention: a key failed, remote_unknown or abandoned longer than this is escalated (6)",
    )  # fmt: skip
    status.add_argument(
        "--max-attempts", type=_positive_int_arg, default=DEFAULT_MAX_ATTEMPTS, metavar="N",
        help=f"with --needs-attention: claims before reruns stop being automatic ({DEFAULT_MAX_ATTEMPTS})",
    )  # fmt: skip
    status.set_defaults(handler=_status)

    attempts = commands.add_parser("attempts", parents=[common], help="the attempts of one logical export, in order")
    attempts.add_argument(
        "logical_key", metavar="LOGICAL_KEY", help="as shown by status, e.g. invoice_export/acme/2026-03-08T05:00:00Z"
    )
    attempts.set_defaults(handler=_attempts)

    reconcile = commands.add_parser(
        "reconcile",
        parents=[common, location],
        help="resolve stuck keys once from the destination's evidence (what the reconciliation sensor does)",
    )
    reconcile.add_argument(
        "--limit", type=_positive_int_arg, metavar="N", default=1000, help="examine at most N stuck keys (default 1000)"
    )
    reconcile.add_argument("--export", type=_slug_arg("export name"), help="only this export's stuck keys")
    reconcile.add_argument(
        "--destination",
        metavar="SPEC",
        help="not needed: each key is judged at the destination its contract records. Given, it must be that one "
        "(else refused, naming both); it answers only for keys claimed before release 0.6, which record none",
    )
    reconcile.set_defaults(handler=_reconcile)

    drift = commands.add_parser(
        "drift",
        parents=[common, location],
        help="re-read the sources of recently completed keys once and record which are stale (what the drift "
        "sensor does)",
    )
    drift.add_argument(
        "--specs",
        metavar="MODULE:ATTR",
        action="append",
        help="instead of -f/-m: a module's declared exports (an ExportSpec or a list of them), e.g. "
        "examples.shop_definitions:orders; repeat for several",
    )
    drift.add_argument("--export", type=_slug_arg("export name"), help="only this export's keys")
    drift.add_argument(
        "--destination",
        metavar="SPEC",
        help="where exports without a destination of their own are published "
        "(default: $EXPORTS_DESTINATION, else ./var/exports)",
    )
    drift.add_argument(
        "--lookback-days", type=_positive_int_arg, metavar="N", default=DEFAULT_LOOKBACK_DAYS,
        help=f"check keys of the last N business dates of each export (default {DEFAULT_LOOKBACK_DAYS}); the "
        "summary counts the completed keys older than that and names the N that reaches them",
    )  # fmt: skip
    drift.add_argument(
        "--limit", type=_positive_int_arg, metavar="N", default=1000, help="check at most N keys (default 1000)"
    )
    drift.add_argument(
        "--operator", default=_default_operator(),
        help="who runs it: named as who asked for the restatements of exports with restate_stale (default: user@host)",
    )  # fmt: skip
    drift.set_defaults(handler=_drift)

    prune = commands.add_parser(
        "prune", parents=[common], help="delete completed records older than a horizon, keeping a low-water mark"
    )
    prune.add_argument(
        "--older-than",
        dest="older_than",
        metavar="DAYS",
        type=_days_arg,
        required=True,
        help="prune completed keys whose business date is more than DAYS days ago (UTC)",
    )
    prune.add_argument("--export", type=_slug_arg("export name"), help="only this export")
    prune.add_argument("--yes", action="store_true", help="apply the plan (without it, prune only shows it)")
    prune.add_argument(
        "--close-unexported",
        action="store_true",
        help="let the mark close business dates that have no key at all (never exported); needs --reason",
    )
    prune.add_argument("--reason", help="why dates never exported may be closed (recorded)")
    prune.add_argument("--operator", default=_default_operator(), help="who decides (default: this user@host)")
    prune.set_defaults(handler=_prune)

    resolve = commands.add_parser(
        "resolve",
        parents=[common],
        help="an operator's way out for a key in conflict or escalated: accept or discard what the destination holds",
    )
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
    resolve.add_argument("--operator", default=_default_operator(), help="who decides (default: this user@host)")
    resolve.add_argument(
        "--destination",
        metavar="SPEC",
        help="not needed: the key's contract records its destination. Given, it must be that one (else refused, "
        "naming both); it answers only for a key claimed before release 0.6",
    )
    resolve.set_defaults(handler=_resolve)

    accept = commands.add_parser(
        "accept-contract",
        parents=[common],
        help="accept the contract the code now declares (the one its refused claims named) after a deliberate change",
    )
    accept.add_argument(
        "--export", type=_slug_arg("export name"), required=True, help="the export whose contract changed"
    )
    accept.add_argument(
        "--tenant", type=_slug_arg("tenant id"),
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
        "--move", action="append", default=[], type=_move_arg, metavar="YYYY-MM-DD:ZONE",
        help="with --timezone: an earlier zone (repeatable, oldest first): business dates before the date were ZONE's",
    )  # fmt: skip
    accept.add_argument(
        "--start-date", dest="start_date", type=_date_arg, metavar="YYYY-MM-DD",
        help="with --timezone: the start date the code now declares",
    )  # fmt: skip
    accept.add_argument("--reason", required=True, help="why the contract changed; recorded in the ledger")
    accept.add_argument("--operator", default=_default_operator(), help="who decides (default: this user@host)")
    accept.set_defaults(handler=_accept_contract)

    restate = commands.add_parser(
        "restate",
        parents=[common, location],
        help="request the next revision of completed keys (a key, or every key of a date), or withdraw a request",
    )
    restate.add_argument(
        "logical_key", metavar="LOGICAL_KEY", nargs="?", help="one completed key, as shown by status (or --date)"
    )
    restate.add_argument("--export", type=_slug_arg("export name"), help="with --date: the export to restate")
    restate.add_argument(
        "--date", dest="business_date", metavar="YYYY-MM-DD", type=_date_arg,
        help="every completed key of this business date (with --export; --tenant for one tenant's)",
    )  # fmt: skip
    restate.add_argument("--tenant", type=_slug_arg("tenant id"), help="with --date: only this tenant's key")
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
    restate.add_argument("--operator", default=_default_operator(), help="who asks (default: this user@host)")
    restate.set_defaults(handler=_restate)

    revisions = commands.add_parser(
        "revisions", parents=[common], help="every published revision of one key, oldest first, with who and why"
    )
    revisions.add_argument("logical_key", metavar="LOGICAL_KEY", help="as shown by status")
    revisions.set_defaults(handler=_revisions)

    upgrade_command = commands.add_parser(
        "upgrade", parents=[common], help="bring the ledger's schema to this release's version (writes)"
    )
    upgrade_command.set_defaults(handler=_upgrade, writes_schema=True)
    return parser


def _move_arg(text: str) -> ZoneMove:
    on, sep, zone = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected YYYY-MM-DD:ZONE (e.g. 2026-04-01:America/New_York), got {text!r}")
    try:
        return ZoneMove(on=on, from_zone=zone)
    except ExportLedgerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _days_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid number of days {text!r}: expected a whole number, 0 or more")
    return value


# -- finding and opening the ledger ------------------------------------------------------------------------------


def _ledger_url(args: argparse.Namespace, settings: Settings) -> str:
    """``--ledger-url``, else the ledger of the code location given with ``-f``/``-m`` (its resource, as its runs
    open it), else ``EXPORTS_LEDGER_URL`` or the default file."""
    if args.ledger_url is not None:
        return args.ledger_url
    location = _code_location(args)
    if location is not None and location.ledger_url:
        return location.ledger_url
    return settings.ledger_url


def _open_ledger(url: str, *, read_only: bool) -> ExportLedger:
    try:
        parsed = database_url(url, what="ledger URL")  # a plain path is a SQLite file, as in EXPORTS_LEDGER_URL
    except ConfigurationError as exc:  # its message names the URL redacted, never its password
        raise CliError(f"{exc} (for example sqlite:///var/ledger.sqlite3 or ./var/ledger.sqlite3)") from None
    if parsed.get_backend_name() == "sqlite":
        _require_sqlite_ledger(parsed)
    # Reads never create or alter a table, on any backend; commands that change keys open it to write.
    return ExportLedger(url, read_only=read_only)


def _require_sqlite_ledger(parsed: URL) -> None:
    """Refuses a SQLite URL that does not name an existing ledger file.

    Opening the ledger creates its folder and tables; a read must never leave an empty ledger behind on a mistyped
    path, nor add tables to an unrelated database.
    """
    if parsed.database in (None, "", ":memory:"):
        raise CliError("an in-memory SQLite URL holds no ledger; point --ledger-url at the ledger file")
    path = Path(parsed.database).expanduser()
    if not path.is_file():
        raise CliError(
            f"no ledger at {path}: the SQLite file does not exist (the CLI reads ledgers, never creates one)"
        )
    try:
        # mode=ro: this look must not create or change anything either.
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            found = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", ("export_runs",)
            ).fetchone()
    except sqlite3.Error as exc:
        raise CliError(f"cannot read the SQLite ledger {path}: {exc}") from None
    if found is None:
        raise CliError(f"{path} is not an export ledger: it has no export_runs table")


# -- subcommands -------------------------------------------------------------------------------------------------


def _status(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    _known_export(ledger, args.export)
    if args.needs_attention:
        # Not checked against the ledger: a tenant the code declares may be late with no trace in it yet, and a
        # partition never claimed concerns every tenant.
        return _needs_attention(ledger, args)
    operations.require_tenant(ledger, args.tenant, args.export)
    if STALE in args.states:
        return _stale(ledger, args)
    if RESTATING in args.states:
        return _restating(ledger, args)
    records = ledger.queries.records(
        export=args.export,
        tenant=args.tenant,
        date_from=args.date_from,
        date_to=args.date_to,
        states=[ExportState(value) for value in args.states],
        limit=args.limit,
        offset=args.offset,
    )
    # One read of the shown keys' requests (a page of at most --limit keys): most were never restated (revision 1).
    published = published_revisions(ledger, [r.logical_key for r in records]) if records else {}
    revision = {key: request.revision for key, request in published.items()}
    if args.json:
        return _dump([{**_record_json(r), "revision": revision.get(r.logical_key, 1)} for r in records])
    if not records:
        return "no exports match"
    headers = (
        "LOGICAL KEY",
        "STATE",
        "BUSINESS DATE",
        "ZONE",
        "ROWS",
        "COMMITTED ATTEMPT",
        "LEASE OWNER",
        "LEASE EXPIRES",
        "UPDATED",
        "REVISION",
    )
    rows = []
    for record in records:
        owner, expires = _lease(record)
        rows.append(
            (
                record.logical_key,
                record.state.value,
                record.business_date.isoformat(),
                record.timezone,
                record.row_count,
                record.committed_attempt,
                owner,
                _short_time(expires),
                _short_time(record.updated_at),
                revision.get(record.logical_key, ""),  # shown where restated (> 1): the current revision
            )
        )
    # The longest and least read go first: an attempt id is 40+ characters, a revision is one digit.
    droppable = ("COMMITTED ATTEMPT", "LEASE OWNER", "LEASE EXPIRES", "UPDATED", "REVISION")
    return _table(headers, rows, droppable) + _more(len(records), args)


def _more(shown: int, args: argparse.Namespace) -> str:
    """The line that says a read stopped at its limit, and how to see the rest."""
    if shown < args.limit:
        return ""
    return f"\n(the first {shown} rows from {args.offset}; --offset {args.offset + shown} shows the next ones)"


def _restating(ledger: ExportLedger, args: argparse.Namespace) -> str:
    """Keys with an open restatement request: the revision it publishes, who asked, when and why."""
    if len(set(args.states)) > 1:
        raise UsageError("--state restating lists keys with an open restatement only; it cannot be combined")
    requests = ledger.restatements.requests(
        export=args.export, tenants=[args.tenant] if args.tenant else (), date_from=args.date_from,
        date_to=args.date_to, limit=args.limit,
    )  # fmt: skip
    states = {key: r.state.value for key, r in records_of(ledger, requests).items()}
    if args.json:
        return _dump([{**_request_json(r), "state": states.get(r.logical_key)} for r in requests])
    if not requests:
        return "no open restatements"
    rows = [
        (
            r.logical_key, states.get(r.logical_key), r.business_date.isoformat(), r.revision, r.requested_by,
            _short_time(r.requested_at), r.reason,
        )
        for r in requests
    ]  # fmt: skip
    headers = ("LOGICAL KEY", "STATE", "BUSINESS DATE", "REVISION", "REQUESTED BY", "REQUESTED", "REASON")
    return (
        _table(headers, rows) + "\npublished by each partition's next materialization (the reconciliation sensor "
        "launches it); withdraw with: export-ledger restate --withdraw LOGICAL_KEY --reason ..."
    )


def _stale(ledger: ExportLedger, args: argparse.Namespace) -> str:
    """Completed keys with an open drift record: counts of rows added, removed and changed (never values)."""
    if len(set(args.states)) > 1:
        raise UsageError("--state stale lists stale keys only; it cannot be combined with other states")
    stale = ledger.drift.open_records(
        export=args.export, tenants=[args.tenant] if args.tenant else (), date_from=args.date_from,
        date_to=args.date_to, limit=args.limit,
    )  # fmt: skip
    if args.json:
        return _dump([_drift_json(r) for r in stale])
    if not stale:
        return "no stale exports"
    rows = [
        (
            r.logical_key,
            STALE,
            r.business_date.isoformat(),
            r.rows_added,
            r.rows_removed,
            "unknown" if r.rows_changed is None else r.rows_changed,
            _short_time(r.detected_at),
        )
        for r in stale
    ]
    headers = ("LOGICAL KEY", "STATE", "BUSINESS DATE", "ADDED", "REMOVED", "CHANGED", "DETECTED")
    note = (
        "the remedy is a restatement, a new revision beside the current one: "
        'export-ledger restate LOGICAL_KEY --reason "..."'
    )
    return _table(headers, rows) + "\n" + note


def _drift_json(record) -> dict:
    return {
        "logical_key": record.logical_key,
        "export": record.export,
        "tenant": record.tenant,
        "business_date": record.business_date.isoformat(),
        "state": STALE,
        "rows_added": record.rows_added,
        "rows_removed": record.rows_removed,
        "rows_changed": record.rows_changed,
        "detected_at": _iso(record.detected_at),
    }


def _load_specs(references: Sequence[str]) -> list:
    """The declared exports named by ``--specs module:attr`` (an ExportSpec or a sequence of them)."""
    import importlib

    from export_ledger.spec import ExportSpec

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module of the current project is importable
    specs: list[ExportSpec] = []
    for reference in references:
        module_name, _, attribute = reference.partition(":")
        if not module_name or not attribute:
            raise UsageError(f"--specs {reference!r}: expected module:attribute, e.g. examples.shop_definitions:orders")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise CliError(f"--specs {reference!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
        if not hasattr(module, attribute):
            raise UsageError(f"--specs {reference!r}: module {module_name} has no attribute {attribute!r}")
        value = getattr(module, attribute)
        if type(value).__name__ == "Definitions":  # a code location (a @record, a tuple that refuses iteration)
            raise UsageError(
                f"--specs {reference!r} is a Definitions: name a code location with -f FILE or -m MODULE "
                f"[-a ATTRIBUTE] instead (e.g. -m {module_name} -a {attribute})"
            )
        found = [value] if isinstance(value, ExportSpec) else list(value) if isinstance(value, list | tuple) else None
        if found is None or not all(isinstance(item, ExportSpec) for item in found):
            raise UsageError(
                f"--specs {reference!r} is a {type(value).__name__}; expected an ExportSpec or a list of them"
            )
        specs.extend(found)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise UsageError(f"--specs declares an export twice: {sorted({n for n in names if names.count(n) > 1})}")
    return specs


def _drift(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> tuple[str, bool]:
    location = _code_location(args)
    if location is None and not args.specs:
        raise UsageError("drift needs the declared exports: name the code location with -f FILE or -m MODULE")
    if location is not None and args.specs:
        raise UsageError("--specs and -f/-m both name the declared exports: give one of them")
    specs = list(location.specs) if location is not None else _load_specs(args.specs)
    done = operations.drift_once(
        ledger, specs, settings=settings, lookback_days=args.lookback_days, limit=args.limit,
        requested_by=f"{PROG} drift ({args.operator})", export=args.export, destination=args.destination,
        location=location,
    )  # fmt: skip
    report, without = done.report, done.without_source
    # An export whose source cannot be used here left its keys unchecked too (a declared asset's rows, never a source
    # of their own, are not counted: nothing to read again, by design).
    unresolved = bool(report.unchecked) or any(isinstance(spec.source, UnusableSource) for spec in specs)
    opened, cleared = set(report.changes.opened), set(report.changes.cleared)
    if args.json:
        items = [
            {
                "logical_key": f.record.logical_key,
                "result": STALE,
                "new": f.record.logical_key in opened,
                "rows_added": f.rows_added,
                "rows_removed": f.rows_removed,
                "rows_changed": f.rows_changed,
            }
            for f in report.stale
        ]
        items += [{"logical_key": key, "result": "cleared"} for key in sorted(cleared)]
        items += [{"logical_key": key, "result": "not checked", "detail": why} for key, why in report.unchecked]
        return _dump(items), unresolved
    rows = [
        (
            f.record.logical_key,
            "stale (new)" if f.record.logical_key in opened else STALE,
            f.rows_added,
            f.rows_removed,
            "unknown" if f.rows_changed is None else f.rows_changed,
            "",
        )
        for f in report.stale
    ]
    rows += [(key, "cleared: matches its source again", "", "", "", "") for key in sorted(cleared)]
    rows += [(key, "not checked", "", "", "", why) for key, why in report.unchecked]
    lines = [_table(("LOGICAL KEY", "RESULT", "ADDED", "REMOVED", "CHANGED", "DETAIL"), rows)] if rows else []
    lines.append(
        f"{report.checked} key(s) checked: {len(report.stale)} stale, {len(report.matching)} match their source"
        f"{f', {len(report.unchecked)} not checked' if report.unchecked else ''}"
    )
    if without:
        lines.append(f"not checked, no source to read again here: {', '.join(without)}")
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
    return "\n".join(lines), unresolved


def _needs_attention(ledger: ExportLedger, args: argparse.Namespace) -> str:
    found = ledger.attention.needs_attention(
        dt.timedelta(hours=args.stuck_after_hours), max_attempts=args.max_attempts,
        exports=[args.export] if args.export else (), tenants=[args.tenant] if args.tenant else (), limit=args.limit,
        offset=args.offset,
    )  # fmt: skip
    location = _code_location(args)
    if location is not None and args.offset == 0:
        # Late keys are read against the declared exports' deadlines (a key never attempted has no row to list).
        specs = [s for s in location.specs if not args.export or s.name == args.export]
        late = [e for e in late_keys(ledger, specs, limit=args.limit) if not args.tenant or e.tenant == args.tenant]
        listed = {e.logical_key for e in found}
        found = [*(e for e in late if e.logical_key not in listed), *found][: args.limit]
    assets: dict = {}  # each (export, zone)'s asset, looked up once a listing
    ways = [operations.ways_out(ledger, e, location, ledger_url=args.ledger_url, assets=assets) for e in found]
    if args.json:
        return _dump(
            [
                {**(_record_json(e.record) if e.record else _escalation_json(e)), "state": e.state,
                 "needs_attention": e.why, "ways_out": out}
                for e, out in zip(found, ways, strict=True)
            ]
        )  # fmt: skip
    if not found:
        return "no export key needs attention"
    rows = [(e.name, e.state, e.record.claim_count if e.record else None, _short_time(e.since)) for e in found]
    heads = ("LOGICAL KEY", "STATE", "CLAIMS", "SINCE")
    table = _with_notes(heads, rows, "WHY, AND THE WAY OUT", [e.why for e in found])
    # Commands are printed whole, never wrapped: they are to be pasted.
    listed = [
        f"  {e.name}\n" + "\n".join(f"    {command}" for command in out)
        for e, out in zip(found, ways, strict=True)
        if out
    ]
    if listed:
        materialize = [line for out in ways for line in out if " asset materialize " in line]
        width = _terminal_width()
        notes = [
            line
            for note in _command_notes(args, materialize, [e.export for e in found])
            for line in textwrap.wrap(note, width, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
        ]
        table += "\n\nways out, to paste (write each --reason; lines with # are notes):\n" + "\n".join(notes + listed)
    return table + _more(len(found), args)


def _escalation_json(escalation) -> dict:
    """An escalation without a key: a refused tenant, or a partition whose runs never claimed."""
    return {
        "export": escalation.export,
        "tenant": escalation.tenant,
        "timezone": escalation.timezone,
        "business_date": escalation.business_date.isoformat() if escalation.business_date else None,
    }


def _attempts(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    record = operations.require_key(ledger, args.logical_key)
    attempts = ledger.queries.attempts(record.logical_key, limit=ATTEMPTS_LIMIT)
    if args.json:
        return _dump([_attempt_json(attempt) for attempt in attempts])
    if not attempts:
        # Attempt rows are written when an outcome is known: a first attempt still running has none yet.
        return f"no finished attempts for {record.logical_key} yet (state {record.state.value})"
    headers = ("ATTEMPT", "TOKEN", "STARTED", "FINISHED", "OUTCOME", "ERROR", "MESSAGE")
    rows = [
        (
            attempt.attempt_id,
            attempt.fencing_token,
            _short_time(attempt.started_at),
            _short_time(attempt.finished_at),
            attempt.outcome.value,
            attempt.error_class,
            attempt.error_message,
        )
        for attempt in attempts
    ]
    total = ledger.queries.attempt_count(record.logical_key) if len(attempts) == ATTEMPTS_LIMIT else len(attempts)
    note = f"\n(the last {ATTEMPTS_LIMIT} of {total} attempts)" if total > len(attempts) else ""
    return _table(headers, rows, keep_first=False) + note


def _configured_destination(args: argparse.Namespace, ledger: ExportLedger, settings: Settings):
    """The destination the key's contract records (``--destination``, when given, must name it; a key claimed before
    release 0.6, which has none recorded, takes ``--destination``, else the settings')."""
    record = operations.require_key(ledger, args.logical_key)
    return operations.key_destination(ledger, record, settings=settings, given=args.destination)


_known_export = operations.require_export


def _reconcile(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> tuple[str, bool]:
    done = operations.reconcile_once(
        ledger, settings=settings, limit=args.limit, export=args.export, destination=args.destination,
        location=_code_location(args), reconciler=f"export-ledger reconcile@{utc_iso(ledger.now())}",
    )  # fmt: skip
    report = done.report
    if report is None:
        return ("[]" if args.json else "no stuck export keys"), False
    resolved = {finding.record.logical_key: record for finding, record in report.resolved}
    unresolved = bool(report.unreachable)  # keys the destination could not answer for are still stuck
    if args.json:
        return _dump(
            [
                {
                    "logical_key": f.record.logical_key,
                    "was": f.record.state.value,
                    "verdict": f.verdict.value,
                    "now": resolved[f.record.logical_key].state.value
                    if f.record.logical_key in resolved
                    else f.record.state.value,
                    "detail": f.detail,
                }
                for f in report.findings
            ]
        ), unresolved
    if not report.findings:
        return "no stuck export keys", unresolved
    rows = []
    for f in report.findings:
        now = resolved.get(f.record.logical_key)
        rows.append((f.record.logical_key, f.record.state.value, now.state.value if now else "unchanged", f.detail))
    lines = [_table(("LOGICAL KEY", "WAS", "NOW", "EVIDENCE"), rows)]
    lines += [f"rerun: {command.text}{command.note}" for command in done.reruns]
    lines += _location_note(args, done.reruns, [f.record.export for f in report.findings])
    if report.unreachable:
        lines.append(f"{len(report.unreachable)} key(s) left unchanged: the destination could not be reached")
    if report.next_after is not None:
        lines.append(f"more stuck keys remain beyond --limit {args.limit}; run again")
    return "\n".join(lines), unresolved


def _code_location(args: argparse.Namespace) -> operations.CodeLocation | None:
    """The code location named by -f/-m (-a), loaded (this imports Dagster and the user's code); None without one."""
    if getattr(args, "attribute", None) and not (args.python_file or args.module_name):
        raise UsageError("-a ATTRIBUTE names the Definitions in the -f FILE or -m MODULE: give one of them too")
    if not any(getattr(args, name, None) for name in ("python_file", "module_name", "workspace")):
        return None
    if getattr(args, "loaded_location", None) is None:  # loaded once a command: it imports the user's code
        from export_ledger.dagster.code_location import load_code_location, load_workspace_location

        if args.workspace:
            args.loaded_location = load_workspace_location(args.workspace)
        else:
            args.loaded_location = load_code_location(
                python_file=args.python_file, module_name=args.module_name, attribute=args.attribute
            )
    return args.loaded_location


def _location_note(
    args: argparse.Namespace, commands: Sequence[operations.Command | str], exports: Sequence[str] = ()
) -> list[str]:
    """The notes on printed dagster commands (:func:`_command_notes`), each in parentheses under the commands."""
    return [f"({note})" for note in _command_notes(args, commands, exports)]


def _command_notes(
    args: argparse.Namespace, commands: Sequence[operations.Command | str], exports: Sequence[str] = ()
) -> list[str]:
    """What this shell lacks to run printed dagster commands as the code location's runs do
    (:func:`operations.shell_problems`); without -f/-m, that they assume this repository's layout and how to have the
    exact ones."""
    if not commands:
        return []
    notes = [f"before running the dagster commands here: {problem}" for problem in
             operations.shell_problems(_code_location(args), exports)]  # fmt: skip
    if args.python_file or args.module_name or getattr(args, "workspace", None):
        return notes
    if Path("definitions.py").is_file():  # what operations.location_args names, or its placeholder
        assumed = "assume the code location is ./definitions.py"
    else:
        assumed = "name YOUR_DEFINITIONS.py where yours goes (there is no ./definitions.py here)"
    return [*notes, f"the commands {assumed}; pass -f FILE or -m MODULE [-a ATTRIBUTE] and they name yours"]


def _default_operator() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name to be found (a container without one): say so rather than guess
        user = "unknown-user"
    return f"{user}@{socket.gethostname()}"


def _prune(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    _known_export(ledger, args.export)
    if args.close_unexported and not (args.reason and args.reason.strip()):
        raise UsageError("--close-unexported needs --reason: closing dates never exported is recorded")
    if args.yes:
        plans = ledger.retention.prune(
            args.older_than, export=args.export, close_unexported=args.close_unexported, operator=args.operator,
            reason=args.reason,
        )  # fmt: skip
    else:
        plans = ledger.retention.plan(args.older_than, export=args.export, close_unexported=args.close_unexported)
    if args.json:
        return _dump(
            [
                {
                    "export": p.export, "applied": args.yes, "pruned": p.pruned, "low_water_date": _date(p.mark),
                    "previous_low_water_date": _date(p.previous_mark), "blocked_by": _date(p.blocked_by),
                    "unexported_dates": [d.isoformat() for d in p.unexported],
                    "unexported_count": p.unexported_count,
                    "missing_tenants": p.missing_tenants,
                }
                for p in plans
            ]
        )  # fmt: skip
    if not plans:
        return "nothing to prune"
    rows = [
        (p.export, p.pruned, _date(p.previous_mark), _date(p.mark), _date(p.blocked_by), p.unexported_count)
        for p in plans
    ]
    headers = ("EXPORT", "COMPLETED RECORDS PRUNED", "MARK BEFORE", "MARK AFTER", "STOPPED BY", "DATES NEVER EXPORTED")
    lines = [_table(headers, rows)]
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


def _resolve(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    from export_ledger.resolve import resolve_key

    if not args.reason.strip():
        raise UsageError("--reason must say why")
    operations.require_key(ledger, args.logical_key)
    destination = _configured_destination(args, ledger, settings)
    done = resolve_key(
        ledger, destination, args.logical_key, action=args.action, operator=args.operator, reason=args.reason
    )
    if args.json:
        return _dump(
            [{"logical_key": done.record.logical_key, "state": done.record.state.value, "detail": done.detail}]
        )
    return f"{done.record.logical_key}: {done.record.state.value}; {done.detail}"


def _restate(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str | tuple[str, bool]:
    """Records restatement requests (or withdraws one); the ledger refuses what may not be restated, and says why."""
    by_date = args.business_date is not None
    if by_date == (args.logical_key is not None):
        raise UsageError("restate takes a LOGICAL_KEY, or --export E --date YYYY-MM-DD [--tenant T], not both")
    if by_date and (args.export is None or args.withdraw):
        raise UsageError("--date needs --export (and --withdraw takes one LOGICAL_KEY)")
    if not by_date and (args.export or args.tenant):
        raise UsageError("--export and --tenant go with --date; a LOGICAL_KEY names its export and tenant")
    if args.reason is None:
        raise UsageError('restate needs a reason: --reason "..." (kept with the revision for good)')
    if by_date:
        _known_export(ledger, args.export)
        operations.require_tenant(ledger, args.tenant, args.export)
    if args.withdraw:
        operations.require_key(ledger, args.logical_key)
        record = withdraw(
            ledger, _configured_destination(args, ledger, settings), args.logical_key, operator=args.operator,
            reason=args.reason,
        )  # fmt: skip
        if args.json:
            return _dump([{"logical_key": record.logical_key, "withdrawn": True, "state": record.state.value}])
        return f"{record.logical_key}: restatement withdrawn; {record.state.value}, its current revision unchanged"
    done = operations.restate(
        ledger, reason=args.reason, requested_by=args.operator, logical_key=args.logical_key, export=args.export,
        business_date=args.business_date, tenant=args.tenant, location=_code_location(args),
    )  # fmt: skip
    unresolved = bool(done.refused)  # some keys of the date were refused: scripts must see it
    if args.json:
        items = [{**_request_json(r), "requested": True} for r in done.requested]
        items += [{"logical_key": key, "requested": False, "refused": why} for key, why in done.refused]
        return _dump(items + [{"materialize": command.text} for command in done.commands]), unresolved
    rows = [(r.logical_key, f"revision {r.revision}", "requested") for r in done.requested]
    rows += [(key, "", f"refused: {why}") for key, why in done.refused]
    lines = [_table(("LOGICAL KEY", "PUBLISHES", "RESULT"), rows)]
    lines += [f"materialize: {command.text}{command.note}" for command in done.commands]
    lines += _location_note(args, done.commands, [r.export for r in done.requested])
    lines.append(
        "otherwise the reconciliation sensor launches the partition's run; until it is published the current "
        "revision stays what readers get"
    )
    return "\n".join(lines), unresolved


def _revisions(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    revisions = ledger.restatements.revisions(args.logical_key)
    if not revisions:
        record = operations.require_key(ledger, args.logical_key)
        return f"{record.logical_key} has no published revision yet (state {record.state.value})"
    if args.json:
        unchanged = ledger.restatements.requests(logical_keys=[args.logical_key], outcomes=["unchanged"], limit=200)
        return _dump(
            [_revision_json(r) for r in revisions]
            + [{**_request_json(r), "outcome": "unchanged", "closed_at": _iso(r.closed_at)} for r in unchanged]
        )
    headers = (
        "REVISION", "SHA256", "ROWS", "SUPERSEDES", "REASON", "REQUESTED BY", "REQUESTED", "PUBLISHED BY", "LOCATION",
    )  # fmt: skip
    rows = [
        (
            r.revision, r.sha256, r.row_count, r.supersedes_revision, r.reason, r.requested_by,
            _short_time(r.requested_at), r.published_by, r.location,
        )
        for r in revisions
    ]  # fmt: skip
    unchanged = ledger.restatements.requests(logical_keys=[args.logical_key], outcomes=["unchanged"], limit=200)
    notes = "".join(
        f"\nrevision {r.revision} not published: its data was identical to the current revision's "
        f"(reason {_printable(r.reason)!r}, requested by {r.requested_by}, closed {_short_time(r.closed_at)})"
        for r in unchanged
    )
    return _table(headers, rows) + f"\ncurrent: revision {revisions[-1].revision}" + notes


def _date(value: dt.date | None) -> str | None:
    return None if value is None else value.isoformat()


def _accept_contract(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    if not args.reason.strip():
        raise UsageError("--reason must say why the contract changed")
    _known_export(ledger, args.export)
    operations.require_tenant(ledger, args.tenant, args.export)
    if (args.timezone is None) != (args.start_date is None) or (args.move and args.timezone is None):
        raise UsageError("--timezone and --start-date go together (with --move): they declare a calendar")
    calendar = None
    if args.timezone is not None:
        try:
            calendar = ExportCalendar(
                timezone=args.timezone, start_date=args.start_date.isoformat(), moves=tuple(args.move)
            ).contract()
        except ExportLedgerError as exc:
            raise UsageError(str(exc)) from None
    try:
        done = operations.accept_contract(
            ledger, args.export, reason=args.reason, operator=args.operator, tenant=args.tenant,
            exported=args.exported, calendar=calendar,
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        items = [
            {"export": a.export, "tenant": a.tenant, "previous": a.previous, "accepted": a.accepted,
             "changes": a.changes, "reason": args.reason.strip(), "exported": args.exported}
            for a in done.accepted
        ]  # fmt: skip
        return _dump(items + [{"restatements_requested": done.restated, "restatements_refused": done.refused}])
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


def _upgrade(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    done = upgrade_url(ledger.url)
    if args.json:
        return _dump([{"upgraded_to": version} for version in done])
    return "the ledger's schema is current" if not done else f"upgraded the ledger's schema to version {done[-1]}"


# -- rendering ---------------------------------------------------------------------------------------------------


def _lease(record: ExportRecord) -> tuple[str | None, dt.datetime | None]:
    if record.state is ExportState.IN_PROGRESS:
        return record.lease_owner, record.lease_expires_at
    return None, None


def _record_json(record: ExportRecord) -> dict:
    owner, expires = _lease(record)
    return {
        "logical_key": record.logical_key,
        "export": record.export,
        "tenant": record.tenant,
        "business_date": record.business_date.isoformat(),
        "timezone": record.timezone,
        "window_start_utc": _iso(record.window_start_utc),
        "window_end_utc": _iso(record.window_end_utc),
        "state": record.state.value,
        "row_count": record.row_count,
        "committed_attempt": record.committed_attempt,
        "location": record.location,
        "sha256": record.sha256,
        "fencing_token": record.fencing_token,
        "lease_owner": owner,
        "lease_expires_at": _iso(expires),
        "created_at": _iso(record.created_at),
        "updated_at": _iso(record.updated_at),
    }


def _attempt_json(attempt: AttemptRecord) -> dict:
    return {
        "attempt_id": attempt.attempt_id,
        "fencing_token": attempt.fencing_token,
        "started_at": _iso(attempt.started_at),
        "finished_at": _iso(attempt.finished_at),
        "outcome": attempt.outcome.value,
        "error_class": attempt.error_class,
        "error_message": attempt.error_message,
    }


def _request_json(request: Restatement) -> dict:
    return {
        "logical_key": request.logical_key,
        "export": request.export,
        "tenant": request.tenant,
        "business_date": request.business_date.isoformat(),
        "revision": request.revision,
        "reason": request.reason,
        "requested_by": request.requested_by,
        "requested_at": _iso(request.requested_at),
    }


def _revision_json(revision: Revision) -> dict:
    return {
        "logical_key": revision.logical_key,
        "revision": revision.revision,
        "sha256": revision.sha256,
        "row_count": revision.row_count,
        "supersedes_revision": revision.supersedes_revision,
        "supersedes_sha256": revision.supersedes_sha256,
        "reason": revision.reason,
        "requested_by": revision.requested_by,
        "requested_at": _iso(revision.requested_at),
        "published_by": revision.published_by,
        "recorded_at": _iso(revision.recorded_at),
        "location": revision.location,
    }


def _dump(items: list[dict]) -> str:
    return json.dumps(items, indent=2)


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else utc_iso(value)


def _short_time(value: dt.datetime | None) -> str | None:
    # Whole seconds in tables; --json keeps full precision.
    return None if value is None else utc_iso(value.replace(microsecond=0))


def _printable(text: str) -> str:
    # Stored error messages come from exceptions; escape newlines and terminal control sequences before printing.
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


#: Table width when stdout is not a terminal (a pipe, a file) and ``COLUMNS`` says nothing.
DEFAULT_WIDTH = 100
#: A column is never wrapped narrower than this (or its header's longest word, or its widest cell if narrower).
_MIN_COLUMN = 8


def _terminal_width() -> int:
    """``COLUMNS``, else the terminal's width, else :data:`DEFAULT_WIDTH` (stdout is not a terminal)."""
    with contextlib.suppress(ValueError):
        if int(os.environ.get("COLUMNS", "")) > 0:
            return int(os.environ["COLUMNS"])
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


#: Cell words up to this long are never split across lines of a table (``completed``, ``2026-03-10``, a zone).
_WHOLE_WORD = 20


def _floors(headers: Sequence[str], cells: Sequence[Sequence[str]], keep_first: bool = True
            ) -> tuple[list[int], list[int]]:  # fmt: skip
    natural = [max(len(row[i]) for row in [headers, *cells]) for i in range(len(headers))]
    # A column never splits a word of its header, nor a short word of its cells (a state, a date, a zone): those
    # wrap whole or the droppable columns go first; only long values (attempt ids, messages) are cut across lines.
    words = [
        max(_MIN_COLUMN, *(len(word) for word in header.split()),
            *(len(word) for row in cells for word in row[i].split() if len(word) <= _WHOLE_WORD))
        for i, header in enumerate(headers)
    ]  # fmt: skip
    floor = [natural[i] if i == 0 and keep_first else min(natural[i], words[i]) for i in range(len(headers))]
    return natural, floor


def _fitted(headers: Sequence[str], cells: Sequence[Sequence[str]], width: int, keep_first: bool = True) -> list[int]:
    """Column widths that fit ``width``: the widest columns give way first; the first (the logical key, which
    operators copy) never does. A table that cannot fit keeps every column at its minimum."""
    natural, floor = _floors(headers, cells, keep_first)
    widths = list(natural)
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    while excess > 0:
        shrinkable = [i for i in range(len(widths)) if widths[i] > floor[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1
    return widths


def _wrapped(text: str, width: int) -> list[str]:
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=True) or [""]


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    droppable: Sequence[str] = (),
    *,
    keep_first: bool = True,
    under: Sequence[Sequence[str]] = (),
) -> str:
    """A table that fits the terminal: long cells wrap onto lines of their own column, and where even wrapped
    columns cannot fit, the ``droppable`` ones go, in that order, said so below it (``--json`` is never cut). The first
    column (a logical key, which operators copy) is never wrapped unless ``keep_first`` is False. ``under``: lines to
    print under each row, after all of its own (however many its cells wrapped to)."""
    headers = list(headers)
    cells = _cells(rows)
    width, dropped = _terminal_width(), []
    for name in droppable:
        if sum(_floors(headers, cells, keep_first)[1]) + 2 * (len(headers) - 1) <= width:
            break
        index = headers.index(name)
        headers.pop(index)
        cells = [row[:index] + row[index + 1 :] for row in cells]
        dropped.append(name)
    widths = _fitted(headers, cells, width, keep_first)
    lines = []
    for index, row in enumerate([list(headers), *cells]):
        parts = [_wrapped(cell, width) for cell, width in zip(row, widths, strict=True)]
        for depth in range(max(len(part) for part in parts)):
            line = (part[depth] if depth < len(part) else "" for part in parts)
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if index > 0 and under:
            lines.extend(under[index - 1])
    if dropped:
        note = f"({', '.join(dropped)} left out to fit {width} columns; --json or a wider terminal shows them)"
        lines.extend(textwrap.wrap(note, width))
    return "\n".join(lines)


def _cells(rows: Sequence[Sequence[object]]) -> list[list[str]]:
    """A table's cells as printed: ``-`` for nothing, control characters made visible."""
    return [["-" if value is None else _printable(str(value)) for value in row] for row in rows]


#: The narrowest a table's last column of prose may be; narrower, it goes under each row instead.
_NOTE_WIDTH = 40


def _with_notes(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str, notes: Sequence[str]) -> str:
    """:func:`_table` of ``rows`` with ``notes`` (prose, one per row) as a last column ``title`` where that column
    gets at least :data:`_NOTE_WIDTH` characters; in a narrower terminal each note goes under its row (after every line
    the row wrapped to), indented and wrapped to the terminal's width (a column of a few characters buried what an
    operator reads first). A note is never broken inside a word or at a hyphen (a command in it stays whole words)."""
    width = _terminal_width()
    headers = list(headers)
    cells = _cells(rows)
    printable = [_printable(note) for note in notes]
    widths = _fitted([*headers, title], [[*row, note] for row, note in zip(cells, printable, strict=True)], width)
    if widths[-1] >= _NOTE_WIDTH:
        return _table([*headers, title], [[*row, note] for row, note in zip(rows, notes, strict=True)])
    under = [
        textwrap.wrap(note, width, initial_indent="    ", subsequent_indent="    ", break_long_words=False,
                      break_on_hyphens=False)
        for note in printable
    ]  # fmt: skip
    table = _table(headers, rows, under=under).splitlines()
    return "\n".join([table[0], f"    {title.lower()}, under each key", *table[1:]])


# -- entry point -------------------------------------------------------------------------------------------------


def _redact_message(message: str, url: str | None) -> str:
    if url:
        message = message.replace(url, redact_url(url))
    return redact_text(_printable(message))


def _error(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Runs ``export-ledger`` with ``argv`` (default ``sys.argv[1:]``) and returns the exit code.

    Example:
        >>> main(["status", "--state", "failed", "--json"])  # doctest: +SKIP
        0
    """
    try:
        args = build_parser().parse_args(argv)
        if args.command == "status" and args.date_from and args.date_to and args.date_from > args.date_to:
            raise UsageError(f"--from {args.date_from} is after --to {args.date_to}")
    except UsageError as exc:
        return _error(_redact_message(str(exc), None), USAGE_ERROR)
    except SystemExit as exc:  # --help, after argparse printed it
        return exc.code if isinstance(exc.code, int) else 0

    url: str | None = None
    try:
        settings = Settings.from_environment()  # read once: every part of the command sees the same settings
        url = _ledger_url(args, settings)
        # status, attempts and upgrade open the ledger without touching its schema (upgrade then does so itself).
        read_only = args.command in ("status", "attempts", "revisions", "upgrade")
        output = args.handler(_open_ledger(url, read_only=read_only), args, settings)
        # A command that left keys unresolved (reconcile, drift, restate of a date) says so: scripts must see it.
        output, unresolved = output if isinstance(output, tuple) else (output, False)
    except (UsageError, operations.UsageRefused, operations.DestinationMismatch) as exc:
        return _error(_redact_message(str(exc), url), USAGE_ERROR)
    except (CliError, ExportLedgerError) as exc:
        why = why_unreachable(url) if url and getattr(exc, "unreachable", False) else ""
        message = f"cannot reach the ledger at {redact_url(url)!r}: {why}" if why else str(exc)
        return _error(_redact_message(message, url), RUNTIME_ERROR)
    except sa.exc.SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        return _error(
            _redact_message(f"ledger at {redact_url(url or '')!r} failed: {type(cause).__name__}: {cause}", url),
            RUNTIME_ERROR,
        )
    except Exception as exc:  # never a traceback: the operator gets the class and message, redacted
        return _error(_redact_message(f"unexpected {type(exc).__name__}: {exc}", url), RUNTIME_ERROR)
    finally:
        dispose_engines()

    try:
        print(output)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (``| head``): point stdout at devnull so the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return RUNTIME_ERROR
    return RUNTIME_ERROR if unresolved else 0


if __name__ == "__main__":
    sys.exit(main())
