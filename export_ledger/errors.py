"""The library's errors: one root, so a caller can catch everything export-ledger refuses with one ``except``.

Each error is also an instance of the built-in class it always was (``ValueError`` for bad input, ``RuntimeError``
for a failed destination or source), so code written against those keeps working.
"""

from __future__ import annotations


class ExportLedgerError(Exception):
    """Root of every error export-ledger raises on purpose. Messages name the problem, never customer values."""


class ConfigurationError(ExportLedgerError, ValueError):
    """A setting (argument, declaration or environment variable) that cannot be used; the message names it."""


class CalendarError(ExportLedgerError, ValueError):
    """A business date, zone or schedule time that the export calendar cannot accept."""


class InvalidIdentifier(ExportLedgerError, ValueError):
    """A tenant or export name that is not a safe slug."""


class FrameError(ExportLedgerError, ValueError):
    """Source data that cannot be exported as it is. Messages name columns and ids, never customer values."""


class ManifestError(ExportLedgerError, ValueError):
    """A manifest that is missing fields or does not describe the expected export."""


class SourceError(ExportLedgerError, RuntimeError):
    """The source could not be read."""
