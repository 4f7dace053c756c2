"""``export-ledger upgrade``: the one command that changes the ledger's schema."""

from __future__ import annotations

import argparse

from export_ledger.ledger import ExportLedger, upgrade_url
from export_ledger.settings import Settings

from . import render


def add_parser(commands, common, location) -> None:
    upgrade = commands.add_parser(
        "upgrade", parents=[common], help="bring the ledger's schema to this release's version (writes)"
    )
    # Opened to read: a writer would refuse the older schema this command is here to upgrade.
    upgrade.set_defaults(handler=upgrade_command, read_only=True)


def upgrade_command(ledger: ExportLedger, args: argparse.Namespace, settings: Settings) -> str:
    done = upgrade_url(ledger.url)
    if args.json:
        return render.dump([{"upgraded_to": version} for version in done])
    return "the ledger's schema is current" if not done else f"upgraded the ledger's schema to version {done[-1]}"
