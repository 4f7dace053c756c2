"""What every command shares: its errors, argument types, the shared options, and the code location of -f/-m/-w."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import getpass
import re
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from export_ledger import operations
from export_ledger.calendar import ZoneMove
from export_ledger.errors import ExportLedgerError, InvalidIdentifier
from export_ledger.keys import validate_slug
from export_ledger.settings import LEDGER_URL_ENV

PROG = "export-ledger"
#: Rows a CLI read returns unless ``--limit`` says otherwise: every read is bounded, whatever the ledger holds.
STATUS_LIMIT = 500
ATTEMPTS_LIMIT = 200
#: ``status --state stale`` and ``drift``'s result: not a state of export_runs (a stale key stays completed) but an open
#: drift record.
STALE = "stale"
LEDGER_URL_HELP = f"SQLAlchemy URL of the ledger (default: ${LEDGER_URL_ENV}, else ./var/ledger.sqlite3)"

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class UsageError(Exception):
    """The command line itself is wrong (exit 2, as argparse does)."""


class CliError(Exception):
    """The command is well formed but cannot be carried out (exit 1)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse would print the usage block and "export-ledger status: error: ..."; operators and scripts get
        # one line with a fixed prefix instead, and main() returns the exit code rather than exiting.
        raise UsageError(message)


# -- argument types --------------------------------------------------------------------------------------------------


def date_arg(text: str) -> dt.date:
    # date.fromisoformat alone would also accept 20260308 on Python 3.11; partitions are written YYYY-MM-DD.
    if _DATE_RE.fullmatch(text):
        with contextlib.suppress(ValueError):
            return dt.date.fromisoformat(text)
    raise argparse.ArgumentTypeError(f"invalid date {text!r}: expected a calendar date as YYYY-MM-DD")


def slug_arg(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return validate_slug(text, what)
        except InvalidIdentifier as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid limit {text!r}: expected a positive integer")
    return value


def days_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid number of days {text!r}: expected a whole number, 0 or more")
    return value


def move_arg(text: str) -> ZoneMove:
    on, sep, zone = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected YYYY-MM-DD:ZONE (e.g. 2026-04-01:America/New_York), got {text!r}")
    try:
        return ZoneMove(on=on, from_zone=zone)
    except ExportLedgerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_operator() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name to be found (a container without one): say so rather than guess
        user = "unknown-user"
    return f"{user}@{socket.gethostname()}"


def operator_option(parser: argparse.ArgumentParser, who: str = "who decides") -> None:
    parser.add_argument("--operator", default=default_operator(), help=f"{who} (default: this user@host)")


# -- the options several commands take ------------------------------------------------------------------------------


def shared_options() -> tuple[Parser, Parser]:
    """The parents of the commands' parsers: ``--ledger-url`` and ``--json`` (every command), and a code location named
    as Dagster's CLI names one (the printed dagster commands repeat these options exactly)."""
    common = Parser(add_help=False)
    # Defaulting to "not given" so that it never overwrites the same option given before the command.
    common.add_argument("--ledger-url", metavar="URL", default=argparse.SUPPRESS, help=LEDGER_URL_HELP)
    common.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    location = Parser(add_help=False)
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
    return common, location


def more(shown: int, args: argparse.Namespace) -> str:
    """The line that says a read stopped at its limit, and how to see the rest."""
    if shown < args.limit:
        return ""
    return f"\n(the first {shown} rows from {args.offset}; --offset {args.offset + shown} shows the next ones)"


# -- the code location of -f/-m/-w ----------------------------------------------------------------------------------


def location_named(args: argparse.Namespace) -> bool:
    """Whether -f/-m/-w name a code location (nothing is loaded). Raises :class:`UsageError` for -a without -f/-m."""
    if getattr(args, "attribute", None) and not (args.python_file or args.module_name):
        raise UsageError("-a ATTRIBUTE names the Definitions in the -f FILE or -m MODULE: give one of them too")
    return any(getattr(args, name, None) for name in ("python_file", "module_name", "workspace"))


def code_location(args: argparse.Namespace) -> operations.CodeLocation | None:
    """The code location named by -f/-m/-w (-a), loaded once a command (this imports Dagster and the user's code);
    None without one."""
    if not location_named(args):
        return None
    if getattr(args, "loaded_location", None) is None:
        from export_ledger.dagster.code_location import load_code_location, load_workspace_location

        if args.workspace:
            args.loaded_location = load_workspace_location(args.workspace)
        else:
            args.loaded_location = load_code_location(
                python_file=args.python_file, module_name=args.module_name, attribute=args.attribute
            )
    return args.loaded_location


def command_notes(
    args: argparse.Namespace, commands: Sequence[operations.Command | str], exports: Sequence[str] = ()
) -> list[str]:
    """What this shell lacks to run printed dagster commands as the code location's runs do
    (:func:`operations.shell_problems`); without -f/-m, that they assume this repository's layout and how to have the
    exact ones."""
    if not commands:
        return []
    notes = [f"before running the dagster commands here: {problem}" for problem in
             operations.shell_problems(code_location(args), exports)]  # fmt: skip
    if location_named(args):
        return notes
    if Path("definitions.py").is_file():  # what operations.location_args names, or its placeholder
        assumed = "assume the code location is ./definitions.py"
    else:
        assumed = "name YOUR_DEFINITIONS.py where yours goes (there is no ./definitions.py here)"
    return [*notes, f"the commands {assumed}; pass -f FILE or -m MODULE [-a ATTRIBUTE] and they name yours"]


def location_note(
    args: argparse.Namespace, commands: Sequence[operations.Command | str], exports: Sequence[str] = ()
) -> list[str]:
    """:func:`command_notes`, each in parentheses, to print under the commands."""
    return [f"({note})" for note in command_notes(args, commands, exports)]
