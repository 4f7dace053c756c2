"""Reconciliation: decide what happened to stuck keys from the destination's own evidence.

Plain Python; the Dagster sensor (:mod:`export_ledger.dagster.sensors`) and ``export-ledger reconcile`` are thin
wrappers.

A key is stuck when its outcome is ``remote_unknown``, or when it is ``in_progress`` with an expired lease (a
crashed or stalled attempt, on any destination). For each, the destination is probed:

* a manifest for this key whose data matches it (and matches what the attempt meant to write, when the ledger
  knows that) → ``completed`` from that evidence, and one materialization event for the partition;
* nothing there → ``failed``: safe to retry, and the sensor requests a run for the partition;
* something else there → ``conflict``: never overwritten, an operator decides;
* the destination cannot be reached → unchanged, tried again later.

A key under restatement is judged the same way at its new revision's place: found published, the key's current
pointer is moved to it (idempotently: the attempt may have moved it before dying) before the revision is recorded;
found absent, the key is ``failed`` with its current revision untouched, and rerun.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from export_ledger.destinations.base import (
    Destination,
    DestinationConflict,
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
)
from export_ledger.errors import ManifestError
from export_ledger.frames import Manifest
from export_ledger.ledger import CompletionEvidence, ExportLedger, ExportRecord, ExportState, Resolution, Restatement


class Verdict(str, enum.Enum):
    """What the destination's evidence says about one stuck key."""

    COMPLETED = "completed"  # this key's export is there, intact
    ABSENT = "absent"  # nothing is there: the write never landed
    CONFLICT = "conflict"  # something else is there
    UNREACHABLE = "unreachable"  # the destination could not be asked


_NEXT_STATE = {
    Verdict.COMPLETED: ExportState.COMPLETED,
    Verdict.ABSENT: ExportState.FAILED,
    Verdict.CONFLICT: ExportState.CONFLICT,
}


@dataclass(frozen=True)
class Finding:
    record: ExportRecord
    verdict: Verdict
    detail: str
    evidence: CompletionEvidence | None = None


def judge(record: ExportRecord, manifest: Manifest | None, data_sha256: str | None, location: str) -> Finding:
    """The verdict on one stuck key from what the destination holds. Pure: no I/O."""
    if manifest is None:
        return Finding(record, Verdict.ABSENT, f"nothing is published at {location}")
    if manifest.logical_key != record.logical_key:
        return Finding(record, Verdict.CONFLICT, f"{location} holds the export of {manifest.logical_key}")
    if data_sha256 != manifest.sha256:
        return Finding(record, Verdict.CONFLICT, f"{location}: data sha256 {data_sha256} does not match its manifest")
    if record.sha256 is not None and manifest.sha256 != record.sha256:
        return Finding(
            record,
            Verdict.CONFLICT,
            f"{location} holds data with sha256 {manifest.sha256}, but attempt {record.lease_owner} wrote "
            f"{record.sha256}",
        )
    evidence = CompletionEvidence.published(location, manifest)
    return Finding(record, Verdict.COMPLETED, f"published by attempt {manifest.attempt_id} at {location}", evidence)


def target_of(record: ExportRecord, revision: int = 1) -> ExportTarget:
    return ExportTarget(record.export, record.tenant, record.business_date.isoformat(), revision)


def examine(destination: Destination, record: ExportRecord, request: Restatement | None = None) -> Finding:
    """Probes the destination for one stuck key (at the revision its open restatement ``request`` publishes, if
    any) and judges what it finds; a restatement found published is made current before it is judged completed."""
    target = target_of(record, request.revision if request is not None else 1)
    location = destination.location(target)
    try:
        manifest = destination.probe(target)
        data_sha256 = None
        if manifest is not None and manifest.logical_key == record.logical_key:
            data_sha256 = hashlib.sha256(destination.read_data(target, manifest)).hexdigest()
        finding = judge(record, manifest, data_sha256, location)
        if finding.verdict is Verdict.COMPLETED and manifest.revision != target.revision:
            return Finding(record, Verdict.CONFLICT, f"{location} holds revision {manifest.revision}")
        if finding.verdict is Verdict.COMPLETED and request is not None:
            destination.move_current(target, manifest, supersedes=request.revision - 1)
    except DestinationUnreachable as exc:
        return Finding(record, Verdict.UNREACHABLE, str(exc))
    except (ManifestError, DestinationConflict) as exc:
        return Finding(record, Verdict.CONFLICT, str(exc))
    except DestinationError as exc:
        return Finding(record, Verdict.UNREACHABLE, str(exc))
    return finding


@dataclass
class ReconcileReport:
    """One pass over a batch of stuck keys."""

    findings: list[Finding] = field(default_factory=list)
    resolved: list[tuple[Finding, ExportRecord]] = field(default_factory=list)  # transitions that happened
    changed_meanwhile: list[Finding] = field(default_factory=list)  # an attempt moved the key first: untouched
    next_after: str | None = None  # cursor for the next batch; None starts again from the first stuck key
    unknown_exports: set[str] = field(default_factory=set)  # stuck keys of exports with no destination given: untouched

    @property
    def unreachable(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict is Verdict.UNREACHABLE]

    def resolved_to(self, state: ExportState) -> list[ExportRecord]:
        return [record for _, record in self.resolved if record.state is state]


def reconcile_batch(
    ledger: ExportLedger,
    destination: Destination | Mapping[str, Destination],
    *,
    limit: int,
    after: str | None,
    reconciler: str,
) -> ReconcileReport:
    """Reconciles at most ``limit`` stuck keys after ``after`` (key order), applying each verdict to the ledger.

    Successive calls with ``after=report.next_after`` walk every stuck key once before starting over, so thousands
    of stuck keys are worked through fairly, a bounded batch at a time. ``destination`` is one destination for
    every export, or one per export name; a stuck key of an export missing from that mapping is left unchanged and
    named in ``report.unknown_exports``.
    """
    records = ledger.stuck(limit=limit, after=after)
    report = ReconcileReport(next_after=records[-1].logical_key if len(records) == limit else None)
    requests = ledger.open_restatements([record.logical_key for record in records])
    decided = []
    for record in records:
        if isinstance(destination, Mapping):
            if record.export not in destination:
                report.unknown_exports.add(record.export)
                continue
            finding = examine(destination[record.export], record, requests.get(record.logical_key))
        else:
            # Destination I/O first, outside the ledger's write transaction.
            finding = examine(destination, record, requests.get(record.logical_key))
        report.findings.append(finding)
        if finding.verdict is not Verdict.UNREACHABLE:
            decided.append(finding)
    resolutions = [Resolution(f.record, _NEXT_STATE[f.verdict], f.detail, f.evidence) for f in decided]
    for finding, updated in zip(decided, ledger.resolve_many(resolutions, reconciler=reconciler), strict=True):
        if updated is None:
            report.changed_meanwhile.append(finding)
        else:
            report.resolved.append((finding, updated))
    return report
