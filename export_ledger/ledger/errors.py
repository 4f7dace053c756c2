"""The ledger's domain errors. Every one is an :class:`~export_ledger.errors.ExportLedgerError`."""

from __future__ import annotations

from export_ledger.errors import ExportLedgerError, safe_message

MESSAGE_LIMIT = 500


class LedgerError(ExportLedgerError):
    """Base class of the ledger's domain errors."""


class LedgerUnavailable(LedgerError):
    """The ledger database cannot be reached or opened."""


class SchemaOutdated(LedgerUnavailable):
    """The ledger's schema is older than this release writes: it must be upgraded explicitly first."""


class LeaseHeld(LedgerError):
    """Another attempt holds a live lease on the key."""


class NeedsReconciliation(LedgerError):
    """The key's last write has an unknown outcome; retrying blindly could export it twice."""


class FencedOut(LedgerError):
    """The attempt lost its lease (expired and taken over); it must not commit."""


class InvalidTransition(LedgerError):
    """A transition was asked from a state that does not allow it."""


class ConflictRecorded(LedgerError):
    """The destination holds a different export at the key's place; an operator must resolve it."""


class BelowLowWater(LedgerError):
    """The key's business date is below the export's retention low-water mark: its record may have been pruned."""


class ContractChanged(LedgerError):
    """The code's contract (calendar or terms: :mod:`export_ledger.contract`) differs from the one the ledger
    recorded for the tenant."""


class DestinationMoved(LedgerError):
    """A key's earlier attempts may have written to the destination its contract recorded, and this claim would
    publish it to another: two exports of one key. Refused until the key is settled where it was written."""


class EmptyWindow(LedgerError):
    """The business date does not exist in its zone (a skipped calendar day): there is nothing to export.

    Its empty window starts where the next day's starts, so it cannot have a logical key of its own.
    """


def short_error(exc: BaseException) -> tuple[str, str]:
    """Error class and a bounded message for the attempts table: never a driver's words (they can quote data)."""
    message = safe_message(exc)
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    return exc.__class__.__name__, message


class OperatorResolution(LedgerError):
    """Not a failure: what an operator decided about a key, recorded as the message of its attempt row."""


class LiveLease(LedgerError):
    """An operator asked to resolve a key that a live attempt holds; wait for its lease to end."""


class RestatementRefused(LedgerError):
    """A restatement cannot be requested (or withdrawn) for this key now; the message says why."""


class WindowNotOver(LedgerError):
    """The key's window has not ended yet by the ledger's clock: exporting it now would miss its last rows."""


class ResolutionRefused(LedgerError):
    """An operator's resolution was refused after the key was held; the key is back in the state it was in."""
