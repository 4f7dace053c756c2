"""Which transition a claim takes: pure functions of what the claiming transaction read, unit-tested on their own.

:func:`select_claim` decides from the key's row, its open restatement request and the ledger's time; the claim
transaction then applies what it returns (:mod:`export_ledger.ledger.claims`). Nothing here reads or writes.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from export_ledger.calendar import utc_iso
from export_ledger.keys import LogicalKey
from export_ledger.ledger import transitions as T
from export_ledger.ledger.errors import (
    BelowLowWater,
    ConflictRecorded,
    EmptyWindow,
    LeaseHeld,
    LedgerError,
    NeedsReconciliation,
    WindowNotOver,
)
from export_ledger.ledger.records import ExportRecord, Restatement
from export_ledger.ledger.schema import ExportState


@dataclass(frozen=True)
class Skip:
    """The key is completed and has no open request: nothing to do."""

    record: ExportRecord


@dataclass(frozen=True)
class Refuse:
    """The claim is refused; ``error`` says why. ``recorded`` is whether an attempt row says so (only a key with a
    row can have one)."""

    error: LedgerError

    @property
    def recorded(self) -> bool:
        return not isinstance(self.error, (BelowLowWater, EmptyWindow, WindowNotOver))


Decision = T.Transition | Skip | Refuse


def window_refusal(key: LogicalKey, now: dt.datetime) -> LedgerError | None:
    """Why a key's window cannot be claimed at ``now`` (the ledger's time), or None: a skipped calendar day has no
    window to export, and a window that has not ended would be exported without its last rows."""
    window = key.window
    if window.is_empty:
        return EmptyWindow(
            f"{window.business_date} does not exist in {window.timezone} (the zone skipped that calendar day): its "
            f"window is empty and {key.export} for {key.tenant} has nothing to export"
        )
    if window.end_utc > now:
        return WindowNotOver(
            f"{key} is the window [{utc_iso(window.start_utc)}, {utc_iso(window.end_utc)}) of {window.business_date} "
            f"in {window.timezone}, which has not ended by the ledger's clock ({utc_iso(now)}): exporting it now "
            f"would miss its last rows. Refused; run it after {utc_iso(window.end_utc)}"
        )
    return None


def select_claim(
    record: ExportRecord | None,
    request: Restatement | None,
    now: dt.datetime,
    *,
    key: LogicalKey,
    low_water: dt.date | None = None,
    allow_below_low_water: bool = False,
) -> Decision:
    """The transition a claim of ``key`` takes, or why it takes none.

    Args:
        record: The key's row for its business day, as the claiming transaction read (and locked) it; None: no row.
        request: The key's open restatement request, if any.
        now: The ledger's time in the claiming transaction.
        key: The key claimed (its window is checked, for a first claim).
        low_water: The export's retention low-water mark (first claims below it are refused).
        allow_below_low_water: An operator's explicit override of that refusal.
    """
    if record is None:
        refusal = window_refusal(key, now)
        if refusal is not None:
            return Refuse(refusal)
        if low_water is not None and key.window.business_date < low_water and not allow_below_low_water:
            return Refuse(
                BelowLowWater(
                    f"{key} is below the retention low-water mark of {key.export} ({low_water.isoformat()}): its "
                    "completion record may have been pruned, so exporting it again could duplicate an export. "
                    "Refused; an operator who knows it was never exported can allow it explicitly "
                    "(EXPORTS_ALLOW_BELOW_LOW_WATER=1 for that run)"
                )
            )
        return T.CLAIM_FIRST
    if record.window_end_utc > now:
        # Its row was made before the window ended (only an older release could): still not before it ends.
        return Refuse(window_refusal(LogicalKey(record.export, record.tenant, record.window), now))
    state = record.state
    if state is ExportState.COMPLETED:
        return Skip(record) if request is None else T.RESTATE
    if state is ExportState.FAILED:
        return T.CLAIM_RETRY
    if state is ExportState.CONFLICT:
        return Refuse(
            ConflictRecorded(
                f"{record.logical_key} is in conflict: the destination holds a different export at "
                f"{record.location or 'its place'}; refusing to overwrite it until an operator resolves it"
            )
        )
    if state is ExportState.REMOTE_UNKNOWN:
        return Refuse(
            NeedsReconciliation(
                f"{record.logical_key} has an unknown outcome at the destination (attempt {record.lease_owner}); "
                "retrying could export it twice, so it is refused until reconciliation resolves it"
            )
        )
    if T.lease_live(record.lease_expires_at, now):
        return Refuse(
            LeaseHeld(
                f"{record.logical_key} is being exported by attempt {record.lease_owner} "
                f"(lease held until {record.lease_expires_at.isoformat()} by the ledger's clock)"
            )
        )
    return T.TAKE_OVER


def select_hold(record: ExportRecord, now: dt.datetime, *, operator: bool) -> T.Transition | LedgerError:
    """The hold a reconciler (``operator=False``) or an operator takes on ``record``, or why it cannot."""
    from export_ledger.ledger.errors import InvalidTransition, LiveLease

    transition = T.OPERATOR_HOLD if operator else T.RECONCILE_HOLD
    if record.state is ExportState.IN_PROGRESS and T.lease_live(record.lease_expires_at, now):
        return LiveLease(
            f"{record.logical_key} is held by {record.lease_owner} until {record.lease_expires_at.isoformat()} "
            "(the ledger's clock); resolve it after that lease ends"
        )
    if record.state not in transition.from_states:
        return InvalidTransition(f"{record.logical_key} is {record.state.value}: there is nothing to resolve")
    return transition
