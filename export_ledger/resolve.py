"""An operator's way out for an escalated key: accept what the destination holds, or discard it and export again.

Plain Python, behind ``export-ledger resolve``. Both go through the ledger's transitions and the destination's fence
(docs/protocol.md): the operator first holds the key (:meth:`~export_ledger.ledger.claims.Claims.hold`; refused while
a live lease holds it, and raising the fencing token), fences the destination with that token, so that no earlier
party can change it any more, then acts, then records the outcome with who and why in the attempts table and the
operator log. A resolution that is refused or fails after the hold puts the key back in the state it was in, with a
row saying why and a line in the operator log: a key is never left held by an operator who gave up.
"""

from __future__ import annotations

from dataclasses import dataclass

from export_ledger.destinations.base import Destination, ExportTarget, Verdict, place_of_location
from export_ledger.errors import safe_message
from export_ledger.ledger import (
    CompletionEvidence,
    ExportLedger,
    ExportRecord,
    ExportState,
    FencedOut,
    Finish,
    LedgerError,
    ResolutionRefused,
)
from export_ledger.ledger import transitions as T
from export_ledger.ledger.errors import OperatorResolution
from export_ledger.ledger.operators import append_in

ACCEPT = "accept-destination"
DISCARD = "discard-destination"


@dataclass(frozen=True)
class Resolved:
    """What a resolution did: the key's record afterwards and what the operator's action found or removed."""

    record: ExportRecord
    detail: str


def recorded_target(ledger: ExportLedger, record: ExportRecord) -> ExportTarget | None:
    """The key's recorded current revision, at its place (None, for a key never completed)."""
    current = ledger.restatements.current_revision(record.logical_key)
    if current is None:
        return None
    return ExportTarget.of_record(record, current.revision, place_of_location(current.location))


def resolve_key(
    ledger: ExportLedger, destination: Destination, logical_key: str, *, action: str, operator: str, reason: str
) -> Resolved:
    """Resolves one key that needs a person.

    Args:
        action: ``accept-destination`` (record the revision the destination's pointer names for the key, once it is
            verified: its manifest names the key and the revision, and its data matches) or ``discard-destination``
            (set the pointer back to the revision the ledger records, or nothing, and delete the unrecorded places;
            the key becomes ``failed`` and is exported again by the next run, with its automatic reruns restored).
        operator: Who decided (recorded).
        reason: Why (recorded; required).

    A key whose restatement is under way is resolved at the revision it publishes: accepting records that revision,
    discarding removes only that revision's places; the revisions before stay as they are.

    Raises:
        LiveLease: a live lease holds the key.
        ResolutionRefused: the destination holds nothing acceptable, or the action failed; the key is back in the
            state it was in.
        LedgerError: the key is unknown or completed.
    """
    if action not in (ACCEPT, DISCARD):
        raise ValueError(f"unknown resolution {action!r}: expected {ACCEPT} or {DISCARD}")
    if not reason or not reason.strip():
        raise ValueError("a resolution needs a reason")
    record = ledger.queries.get(logical_key)
    if record is None:
        raise LedgerError(f"unknown logical key {logical_key!r}: the ledger has no export with it")
    claim = ledger.claims.hold(logical_key, operator)
    target = ExportTarget.of_record(record, claim.revision)

    def log(conn, now, _item) -> None:
        append_in(conn, now, operator, action, detail, reason, export=record.export, logical_key=logical_key)

    try:
        if action == ACCEPT:
            verification = destination.open(
                target, claim.fencing_token, logical_key=logical_key, superseded=claim.superseded_revision
            ).verification
            if verification.verdict is not Verdict.PUBLISHED:
                raise ResolutionRefused(f"cannot accept {logical_key}: {verification.detail}")
            evidence = CompletionEvidence.published(verification.location, verification.manifest)
            detail = f"recorded the export at {evidence.location} (attempt {evidence.attempt_id})"
            note = (OperatorResolution.__name__, f"{operator} accepted the destination's export: {reason.strip()}")
            updated = ledger.completions.finish(Finish(claim, T.REPAIR, evidence, note=note), then=log)
        else:
            destination.hold(target, claim.fencing_token, logical_key=logical_key)
            holder = destination.key_at(target)
            if holder is not None and holder != logical_key and ledger.queries.get(holder) is not None:
                raise ResolutionRefused(
                    f"cannot discard {logical_key}'s place: it holds the export of {holder}, a key the ledger records "
                    "(two keys of one tenant and date in two zones share a folder). Resolve their calendar first: the "
                    "contract that gave this key another zone must declare a move"
                )
            removed = destination.discard_key(
                target, claim.fencing_token, logical_key=logical_key, recorded=recorded_target(ledger, record)
            )
            what = ", ".join(removed) if removed else "nothing"
            detail = f"discarded {what}; the key is failed and is exported again by its next run"
            note = (OperatorResolution.__name__, f"{operator} discarded the destination's content ({what}): "
                                                 f"{reason.strip()}")  # fmt: skip
            updated = ledger.completions.finish(Finish(claim, T.FAIL_RESTORED, note=note), then=log)
    except Exception as exc:
        refused = exc if isinstance(exc, ResolutionRefused) else ResolutionRefused(
            f"{action} of {logical_key} failed: {safe_message(exc)}"
        )  # fmt: skip
        detail = f"refused: {refused}"
        back = claim.previous_state.value if claim.previous_state is not ExportState.IN_PROGRESS else "remote_unknown"
        try:
            ledger.completions.release(
                claim, (OperatorResolution.__name__, f"{operator}: {refused}; the key is back to {back}"),
                then=lambda conn, now, item: append_in(
                    conn, now, operator, f"{action}-refused", detail, reason, export=record.export,
                    logical_key=logical_key,
                ),
            )  # fmt: skip
        except FencedOut as lost:
            raise ResolutionRefused(f"{refused}; meanwhile another party took the key: {lost}") from None
        raise refused from None
    return Resolved(updated, detail)
