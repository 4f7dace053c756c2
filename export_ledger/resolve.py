"""An operator's way out for an escalated key: accept what the destination holds, or discard it and export again.

Plain Python, behind ``export-ledger resolve``. Both go through the ledger's transitions: the operator first takes
the key's lease (:meth:`ExportLedger.hold`; refused while a live attempt holds it, and raising the fencing token so no
earlier attempt can commit), then acts, then records the outcome with who and why in the attempts table and the
operator log.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from export_ledger.destinations.base import Destination, ExportTarget
from export_ledger.errors import ExportLedgerError, ManifestError
from export_ledger.ledger import CompletionEvidence, ExportLedger, ExportRecord, LedgerError
from export_ledger.ledger.errors import OperatorResolution

ACCEPT = "accept-destination"
DISCARD = "discard-destination"


@dataclass(frozen=True)
class Resolved:
    """What a resolution did: the key's record afterwards and what the operator's action found or removed."""

    record: ExportRecord
    detail: str


def _target(record: ExportRecord, revision: int = 1) -> ExportTarget:
    return ExportTarget(record.export, record.tenant, record.business_date.isoformat(), revision)


def _acceptable(destination: Destination, record: ExportRecord, revision: int = 1) -> CompletionEvidence:
    """The destination's export of this key (at the revision a restatement under way publishes), checked: its
    manifest names the key and the revision, and its data matches."""
    target = _target(record, revision)
    location = destination.location(target)
    try:
        manifest = destination.probe(target)
    except (ManifestError, ExportLedgerError) as exc:
        raise LedgerError(f"cannot accept {record.logical_key}: {exc}") from None
    if manifest is None:
        raise LedgerError(f"cannot accept {record.logical_key}: nothing is published at {location}")
    if manifest.logical_key != record.logical_key:
        raise LedgerError(
            f"cannot accept {record.logical_key}: {location} holds the export of {manifest.logical_key}; "
            "discard it instead (--discard-destination) once sure"
        )
    if manifest.revision != revision:
        raise LedgerError(
            f"cannot accept {record.logical_key}: {location} holds revision {manifest.revision}, "
            f"not revision {revision}"
        )
    actual = hashlib.sha256(destination.read_data(target, manifest)).hexdigest()
    if actual != manifest.sha256:
        raise LedgerError(f"cannot accept {record.logical_key}: the data at {location} does not match its manifest")
    if revision > 1:
        try:
            destination.move_current(target, manifest, supersedes=revision - 1)
        except ExportLedgerError as exc:
            raise LedgerError(f"cannot accept {record.logical_key}: {exc}") from None
    return CompletionEvidence.published(location, manifest)


def resolve_key(
    ledger: ExportLedger, destination: Destination, logical_key: str, *, action: str, operator: str, reason: str
) -> Resolved:
    """Resolves one key that needs a person.

    Args:
        action: ``accept-destination`` (record the export the destination holds for the key as completed) or
            ``discard-destination`` (move aside or delete what is at the key's place; the key becomes ``failed`` and
            is exported again by the next run, with its automatic reruns restored).
        operator: Who decided (recorded).
        reason: Why (recorded; required).

    A key whose restatement is under way is resolved at the revision it publishes: accepting records that revision
    (and makes it current), discarding removes only that revision's place; the revisions before stay as they are.

    Raises:
        LiveLease: an attempt holds a live lease on the key.
        LedgerError: the key is unknown or completed, or (accept) the destination holds nothing acceptable.
    """
    if action not in (ACCEPT, DISCARD):
        raise ValueError(f"unknown resolution {action!r}: expected {ACCEPT} or {DISCARD}")
    if not reason or not reason.strip():
        raise ValueError("a resolution needs a reason")
    record = ledger.get(logical_key)
    if record is None:
        raise LedgerError(f"unknown logical key {logical_key!r}: the ledger has no export with it")
    request = ledger.open_restatements([logical_key]).get(logical_key)
    revision = request.revision if request is not None else 1
    if action == ACCEPT and revision == 1:
        _acceptable(destination, record)  # look before taking the key: nothing changes if there is nothing to accept
    claim = ledger.hold(logical_key, operator)
    if action == ACCEPT:
        try:
            evidence = _acceptable(destination, record, claim.revision)  # again, now that no attempt can change it
        except LedgerError as exc:
            ledger.mark_conflict(claim, OperatorResolution(f"{operator}: {exc}"))
            raise
        note = OperatorResolution(f"{operator} accepted the destination's export: {reason.strip()}")
        updated = ledger.complete(claim, evidence, note=note)
        detail = f"recorded the export at {evidence.location} (attempt {evidence.attempt_id})"
    else:
        removed = destination.discard_target(_target(record, claim.revision))
        what = ", ".join(removed) if removed else "nothing"
        note = OperatorResolution(f"{operator} discarded the destination's content ({what}): {reason.strip()}")
        updated = ledger.fail(claim, note)
        detail = f"discarded {what}; the key is failed and is exported again by its next run"
    ledger.log_operator(operator, action, detail, reason, export=record.export, logical_key=logical_key)
    return Resolved(updated, detail)
