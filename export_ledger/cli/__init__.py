"""``export-ledger``: the operator's view of the export ledger, and what the sensors do, once, without a daemon.

Each command is a module of this package: its options beside its handler, and the handler one call of
:mod:`export_ledger.operations` (or of the ledger) whose result it renders as a table or ``--json``
(:mod:`.render`)::

    export-ledger status [--export E] [--tenant T] [--from D] [--to D] [--state S ...] [--needs-attention]
    export-ledger attempts LOGICAL_KEY            export-ledger revisions LOGICAL_KEY
    export-ledger reconcile [--export E] [-f FILE | -m MODULE | -w WORKSPACE]
    export-ledger resolve LOGICAL_KEY --accept-destination | --discard-destination --reason "..."
    export-ledger restate LOGICAL_KEY | --export E --date D [--tenant T] | --withdraw LOGICAL_KEY --reason "..."
    export-ledger drift -f FILE | -m MODULE [-a ATTR] | --specs MODULE:ATTR [--lookback-days N]
    export-ledger prune --older-than DAYS [--yes]
    export-ledger accept-contract --export E [--tenant T] [--keep-exported | --restate-exported] --reason "..."
    export-ledger upgrade

The ledger is found from ``--ledger-url``, else the code location's (``-f``/``-m``/``-w``), else
``EXPORTS_LEDGER_URL``, else ``./var/ledger.sqlite3``; the CLI never creates one. A key's destination is the one its
contract records: ``reconcile``, ``resolve`` and ``restate --withdraw`` act there and refuse a ``--destination`` that
names another. Credentials come from the environment, never the ledger.

Exit codes: 0 success (an empty result included), 1 the command could not be carried out or left keys unresolved, 2
bad usage. Every error is one line on stderr starting ``export-ledger: error:``; no traceback, no password.
"""

from __future__ import annotations

import argparse
import os
import sys

import sqlalchemy as sa

from export_ledger import operations
from export_ledger.errors import ExportLedgerError, redact_text
from export_ledger.ledger import ExportLedger, dispose_engines, redact_url
from export_ledger.ledger.store import why_unreachable
from export_ledger.settings import LEDGER_URL_ENV, Settings

from . import _base, attempts, contracts, drift, prune, reconcile, render, resolve, restate, revisions, status, upgrade
from ._base import ATTEMPTS_LIMIT, LEDGER_URL_HELP, PROG, STATUS_LIMIT, CliError, Parser, UsageError, code_location

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

#: The commands, in the order ``--help`` lists them; each module adds its own parser (``add_parser``).
COMMANDS = (status, attempts, reconcile, drift, prune, resolve, contracts, restate, revisions, upgrade)


def build_parser() -> argparse.ArgumentParser:
    """The ``export-ledger`` argument parser; ``--ledger-url`` is accepted before or after the command."""
    parser = Parser(
        prog=PROG, description="Read the export ledger: logical exports and their attempts.", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--ledger-url", metavar="URL", help=LEDGER_URL_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common, location = _base.shared_options()
    for command in COMMANDS:
        command.add_parser(subparsers, common, location)
    return parser


def _ledger_url(args: argparse.Namespace, settings: Settings) -> str:
    """``--ledger-url``, else the ledger of the code location given with ``-f``/``-m``/``-w`` (its resource, as its runs
    open it), else ``EXPORTS_LEDGER_URL`` or the default file."""
    if args.ledger_url is not None:
        return args.ledger_url
    location = code_location(args)
    if location is not None and location.ledger_url:
        return location.ledger_url
    return settings.ledger_url


def _redact_message(message: str, url: str | None) -> str:
    if url:
        message = message.replace(url, redact_url(url))
    return redact_text(render.printable(message))


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
        if getattr(args, "check", None):
            args.check(args)  # what the options alone can say is wrong, before any ledger is opened
    except (UsageError, operations.UsageRefused) as exc:
        return _error(_redact_message(str(exc), None), USAGE_ERROR)
    except SystemExit as exc:  # --help, after argparse printed it
        return exc.code if isinstance(exc.code, int) else 0

    url: str | None = None
    try:
        settings = Settings.from_environment()  # read once: every part of the command sees the same settings
        url = _ledger_url(args, settings)
        # Reads never create or alter a table, on any backend; commands that change keys open it to write. Neither
        # creates a ledger: a mistyped path or URL is refused, never left behind as an empty ledger.
        ledger = ExportLedger(url, read_only=getattr(args, "read_only", False), create=False)
        output = args.handler(ledger, args, settings)
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


__all__ = ["ATTEMPTS_LIMIT", "LEDGER_URL_ENV", "STATUS_LIMIT", "build_parser", "main"]
