"""Reconciliation: decide what happened to stuck keys from the destination's own evidence (docs/protocol.md).

Plain Python; the Dagster sensor (:mod:`export_ledger.dagster.sensors`) and ``export-ledger reconcile`` are thin
wrappers. A key is stuck when it is ``remote_unknown``, or ``in_progress`` with a lease that has ended (a crashed or
stalled party, on any destination). Reconciliation is a party that never publishes:

1. it **holds** the key in the ledger with a new fencing token (an ended holder is recorded ``abandoned``);
2. it **fences** the destination with that token, so that no earlier party, however late it wakes, can change what
   readers see from here on;
3. it **judges** what the key's pointer names (:meth:`~export_ledger.destinations.Destination.verify`): the revision
   the key was publishing, intact (and what the attempt meant to commit, when the ledger knows it) → ``completed``;
   the revision it supersedes → ``failed``, safe to rerun, since nothing of it is visible or can become visible;
   anything else → ``conflict``; a destination that cannot be reached → ``remote_unknown``, looked at again next time;
4. it **records** the verdict, guarded by its token.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from export_ledger.destinations.base import (
    Destination,
    DestinationConflict,
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    Fenced,
)
from export_ledger.destinations.base import Verdict as DestinationVerdict
from export_ledger.destinations.pointer import Pointer
from export_ledger.errors import ManifestError, safe_message
from export_ledger.ledger import Claim, CompletionEvidence, ExportLedger, ExportRecord, ExportState, Finish
from export_ledger.ledger import transitions as T
from export_ledger.placement import recorded_destinations


class Verdict(str, enum.Enum):
    """What the destination's evidence says about one stuck key."""

    COMPLETED = "completed"  # this key's export is there, intact
    ABSENT = "absent"  # nothing of it is visible: the write never landed (and is fenced now)
    CONFLICT = "conflict"  # something else is there
    UNREACHABLE = "unreachable"  # the destination could not be asked


@dataclass(frozen=True)
class Finding:
    """Reconciliation's verdict on one key; ``record`` is the key as found stuck (before the hold)."""

    record: ExportRecord
    verdict: Verdict
    detail: str
    evidence: CompletionEvidence | None = None


def examine(destination: Destination, record: ExportRecord, claim: Claim, read: Pointer | None = None) -> Finding:
    """Fences the destination with the hold's token and judges what the key's pointer names, against the revision
    the key was publishing (``claim.revision``) and the one it supersedes. ``read``: the key's pointer as
    :meth:`~export_ledger.destinations.Destination.prepare_fence` read it."""
    target = ExportTarget.of_record(record, claim.revision)
    elsewhere = _recorded_elsewhere(destination, record)
    if elsewhere is not None:
        return Finding(record, Verdict.UNREACHABLE, elsewhere)
    try:
        verification = destination.open(
            target, claim.fencing_token, logical_key=record.logical_key, superseded=claim.superseded_revision,
            expected_sha256=record.sha256, read=read,
        ).verification  # fmt: skip
    except DestinationUnreachable as exc:
        return Finding(record, Verdict.UNREACHABLE, str(exc))
    except (ManifestError, DestinationConflict) as exc:
        return Finding(record, Verdict.CONFLICT, str(exc))
    except DestinationError as exc:
        # Fenced above a fresh token (one the ledger never issued), a pointer that kept changing, a refused write.
        return Finding(record, Verdict.UNREACHABLE if _passing(exc) else Verdict.CONFLICT, str(exc))
    except Exception as exc:  # noqa: BLE001 - one key's unexpected failure never stops a tick's other keys
        return Finding(record, Verdict.UNREACHABLE, f"the destination could not be judged: {safe_message(exc)}")
    if verification.verdict is DestinationVerdict.PUBLISHED:
        evidence = CompletionEvidence.published(verification.location, verification.manifest)
        return Finding(record, Verdict.COMPLETED, verification.detail, evidence)
    if verification.verdict is DestinationVerdict.ABSENT:
        return Finding(record, Verdict.ABSENT, verification.detail)
    return Finding(record, Verdict.CONFLICT, verification.detail)


def examine_many(places: Mapping[str, Destination], work: Sequence[tuple[ExportRecord, Claim]]) -> dict[str, Finding]:
    """:func:`examine` for a batch of held keys, by logical key. Each destination's keys are examined inside one
    deferral of its durability (docs/protocol.md, "Group commit") and synced once after the last of them, before any
    verdict is returned, so a fence is durable before the ledger records what was judged behind it, as when each
    fence is made durable on its own; a folder pays one ``syncfs`` per batch instead of its fsyncs per key. A sync that
    fails leaves every key of that destination unreachable: its fence may not survive a power cut."""
    groups: dict[int, tuple[Destination, list[tuple[ExportRecord, Claim]]]] = {}
    for record, claim in work:
        destination = places[record.logical_key]
        groups.setdefault(id(destination), (destination, []))[1].append((record, claim))
    found: dict[str, Finding] = {}
    for destination, items in groups.values():
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(destination.deferred())
            except DestinationError:
                pass  # this thread's caller has a deferral open: the sync below makes these writes durable with its
            # Every fence's bytes first, made durable by one sync; then each fence renames its own into place. A sync
            # that fails leaves the bytes undurable: nothing is fenced (no pointer renamed from them), every key of
            # the destination is unreachable this tick, and the prepared files go with the deferral.
            reads = [_prepared(destination, record, claim) for record, claim in items]
            failed = _sync_failure(destination)
            if failed is not None:
                judged = [Finding(record, Verdict.UNREACHABLE, failed) for record, _ in items]
            else:
                judged = [
                    examine(destination, record, claim, read)
                    for (record, claim), read in zip(items, reads, strict=True)
                ]
            failed = _sync_failure(destination)
            if failed is not None:
                judged = [
                    f if f.verdict is Verdict.UNREACHABLE else replace(f, verdict=Verdict.UNREACHABLE, detail=failed,
                                                                        evidence=None)
                    for f in judged
                ]  # fmt: skip
        found.update((finding.record.logical_key, finding) for finding in judged)
    return found


def _prepared(destination: Destination, record: ExportRecord, claim: Claim) -> Pointer | None:
    """The key's pointer read for its fence, with the fence's bytes announced (None: left to the fence alone)."""
    if _recorded_elsewhere(destination, record) is not None:
        return None  # never fenced there
    target = ExportTarget.of_record(record, claim.revision)
    try:
        return destination.prepare_fence(target, claim.fencing_token, logical_key=record.logical_key)
    except Exception:  # noqa: BLE001 - an optimisation only: the fence reads and writes on its own
        return None


def _sync_failure(destination: Destination) -> str | None:
    """Makes what the batch wrote so far durable (its prepared fences' bytes, then its renames); why that failed
    (None: it did not)."""
    try:
        destination.sync()
    except Exception as exc:  # noqa: BLE001 - a failed sync is each key's unknown, never the tick's end
        return f"its fence could not be made durable: {safe_message(exc)}"
    return None


def _recorded_elsewhere(destination: Destination, record: ExportRecord) -> str | None:
    """Why ``destination`` is not the one the key's attempt wrote to (the location it recorded is not this
    destination's for the key), or None. Nothing is written there: a fence at the wrong destination, and a verdict
    "absent" from it, would say nothing of the key's export."""
    if record.location is None or destination.recorded_here(ExportTarget.of_record(record), record.location):
        return None
    return (
        f"the attempt recorded its export at {record.location}, which is not {destination.describe()}: reconcile "
        "this export against the destination it was published to (its --destination)"
    )


def _passing(exc: DestinationError) -> bool:
    """A failure that says nothing about what the destination holds (a write that could not be sent)."""
    return not isinstance(exc, Fenced)


@dataclass
class ReconcileReport:
    """One pass over a batch of stuck keys."""

    findings: list[Finding] = field(default_factory=list)
    resolved: list[tuple[Finding, ExportRecord]] = field(default_factory=list)  # transitions that happened
    changed_meanwhile: list[ExportRecord] = field(default_factory=list)  # a party moved the key first: untouched
    next_after: str | None = None  # cursor for the next batch; None starts again from the first stuck key
    unknown_exports: set[str] = field(default_factory=set)  # stuck keys of exports with no destination given

    @property
    def unreachable(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict is Verdict.UNREACHABLE]

    def resolved_to(self, state: ExportState) -> list[ExportRecord]:
        return [record for _, record in self.resolved if record.state is state]


def reconcile_batch(
    ledger: ExportLedger,
    destination: Destination
    | Mapping[str, Destination]
    | Callable[[Sequence[ExportRecord]], Mapping[str, Destination]],  # noqa: E501
    *,
    limit: int,
    after: str | None,
    reconciler: str,
    exports: Sequence[str] = (),
) -> ReconcileReport:
    """Reconciles at most ``limit`` stuck keys after ``after`` (key order): hold, fence, judge, record.

    Successive calls with ``after=report.next_after`` walk every stuck key once before starting over. Each key is
    judged at the destination its contract records (:func:`~export_ledger.placement.recorded_destinations`), never
    at whatever ``destination`` says: ``destination`` is the one at hand for every export, or one per export name
    (then only those exports' keys are read: another code location's stuck keys, in a shared ledger, are its own),
    lending its settings to a recorded root of its kind and answering for keys whose ledger recorded no destination
    (claimed before release 0.6). Or a function from the stuck keys to each one's destination (by logical key), with
    ``exports`` naming the exports whose keys are read.
    """
    if isinstance(destination, Mapping):
        exports = sorted(destination)
    records = ledger.attention.stuck(limit=limit, after=after, exports=exports)
    report = ReconcileReport(next_after=records[-1].logical_key if len(records) == limit else None)
    if not records:
        return report
    if isinstance(destination, (Destination, Mapping)):
        known = destination
        places = recorded_destinations(
            ledger, records, known=known,
            fallback=(lambda export: known[export]) if isinstance(known, Mapping) else (lambda _: known),
        )  # fmt: skip
    else:
        places = destination(records)  # a caller's choice, made from the same records (export-ledger reconcile)
    held = ledger.claims.hold_many(records, reconciler)
    work = [(record, claim) for record, claim in zip(records, held, strict=True) if claim is not None]
    report.changed_meanwhile += [record for record, claim in zip(records, held, strict=True) if claim is None]
    found = examine_many(places, work)  # destination I/O, outside any ledger transaction
    finishes: list[Finish] = []
    for record, claim in work:
        finding = found[record.logical_key]
        report.findings.append(finding)
        finishes.append(_finish(finding, claim))
    outcomes = ledger.completions.finish_many(finishes)
    decided = {f.record.logical_key: f for f in report.findings}
    for item, outcome in zip(finishes, outcomes, strict=True):
        finding = decided[item.claim.logical_key]
        if isinstance(outcome, ExportRecord):
            if finding.verdict is not Verdict.UNREACHABLE:
                report.resolved.append((finding, outcome))
        else:
            report.changed_meanwhile.append(finding.record)
    return report


def _finish(finding: Finding, claim: Claim) -> Finish:
    note = ("Reconciliation", finding.detail)
    record = finding.record
    if finding.verdict is Verdict.COMPLETED:
        return Finish(claim, T.REPAIR, finding.evidence, note=note)
    if finding.verdict is Verdict.ABSENT:
        return Finish(claim, T.FAIL, note=note)
    if finding.verdict is Verdict.CONFLICT:
        return Finish(claim, T.MARK_CONFLICT, note=note, location=record.location)
    # Unreachable: the outcome stays unknown, with what the attempt meant to commit kept for the next look, and the
    # key's "stuck since" kept too: a destination down for hours must escalate the key, not keep it young.
    return Finish(
        claim, T.MARK_REMOTE_UNKNOWN, note=note, sha256=record.sha256, location=record.location,
        since=record.updated_at,
    )  # fmt: skip
