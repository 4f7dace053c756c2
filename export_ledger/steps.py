"""One claimed key's way through the write protocol (docs/protocol.md), as values: a frozen :class:`HeldKey` (its
claim, whether a predecessor may still publish, the pointer, the staged revision, the evidence, the record) that each
step of :class:`KeySteps` takes and returns anew, and :func:`failure_finish`, the pure rule for which failure leaves
which finish in the ledger. :mod:`export_ledger.protocol` runs these steps for a group of keys (one key is a group of
one) and commits the group; nothing here knows about groups. Plain Python, no Dagster.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

from export_ledger import failpoints
from export_ledger.calendar import utc_iso
from export_ledger.destinations.base import (
    Destination,
    DestinationConflict,
    DestinationError,
    ExportTarget,
    Fenced,
    PublishOutcomeUnknown,
    Verdict,
    place_name,
)
from export_ledger.destinations.pointer import Pointer, StagedExport
from export_ledger.errors import safe_message
from export_ledger.fingerprint import Fingerprint
from export_ledger.keys import LogicalKey
from export_ledger.ledger import (
    AlreadyCompleted,
    Claim,
    CompletionEvidence,
    ExportLedger,
    ExportRecord,
    FencedOut,
    LedgerError,
)
from export_ledger.runs import ExportItem, ExportResult
from export_ledger.stage import Stager

__all__ = [
    "PUBLISHING_STEPS", "ExportConflict", "ExportOutcomeUnknown", "FailureFinish", "HeldKey", "KeySteps",
    "failure_finish", "target_for",
]  # fmt: skip


class ExportConflict(DestinationConflict):
    """The destination holds a different export at this key's place; an operator must look."""


class ExportOutcomeUnknown(DestinationError):
    """The destination may or may not hold the export; the key is ``remote_unknown`` until reconciled."""


def target_for(key: LogicalKey, revision: int = 1, place: str | None = None) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision, place)


def _same_window(claim: Claim, key: LogicalKey) -> bool:
    return (claim.window.start_utc.timestamp(), claim.window.end_utc.timestamp()) == (
        key.window.start_utc.timestamp(),
        key.window.end_utc.timestamp(),
    )


class FailureFinish(enum.Enum):
    """What a failure of a key's effect leaves in the ledger (:func:`failure_finish`)."""

    #: The destination may hold the export: ``remote_unknown``, with the evidence the error carries.
    UNKNOWN = "remote_unknown"
    #: A predecessor not yet fenced may still publish: ``remote_unknown`` at this attempt's place, for
    #: reconciliation to hold, fence and judge the key there.
    UNKNOWN_AT_PLACE = "remote_unknown at this attempt's place"
    #: The destination holds something else, or was fenced by another party: ``conflict``, for an operator.
    CONFLICT = "conflict"
    #: Nothing of the key is visible: ``failed``, safe to retry.
    FAILED = "failed"
    #: This attempt no longer holds the key: it records nothing more.
    NOTHING = "nothing"


def failure_finish(error: Exception, fenced_predecessor: bool) -> FailureFinish:
    """Which finish a failure of a key's effect becomes (docs/protocol.md, step 2 and "What each failure leaves").

    ``fenced_predecessor``: whether nothing an earlier holder of the key did can still become visible, i.e. the key
    was not taken over from a lapsed lease, or this attempt's fence has landed. Before that, a failure cannot say
    "nothing is visible", so it is not ``failed``.
    """
    if isinstance(error, PublishOutcomeUnknown):
        return FailureFinish.UNKNOWN
    if isinstance(error, FencedOut):
        return FailureFinish.NOTHING
    if isinstance(error, (Fenced, DestinationConflict)):
        return FailureFinish.CONFLICT
    return FailureFinish.FAILED if fenced_predecessor else FailureFinish.UNKNOWN_AT_PLACE


@dataclass(frozen=True)
class HeldKey:
    """One claimed key of a group as it goes through the protocol's steps; each step returns a new value."""

    index: int  # its position in the group
    item: ExportItem
    claim: Claim
    #: Whether nothing an earlier holder did can still become visible (see :func:`failure_finish`): true unless the key
    #: was taken over from a lapsed lease and this attempt's fence has not landed yet.
    fenced_predecessor: bool
    status: str = "claimed"  # then staged, or exported / repaired / unchanged once it has its evidence or record
    pointer: Pointer | None = None
    staged: StagedExport | None = None
    fingerprint: Fingerprint | None = None
    evidence: CompletionEvidence | None = None
    record: ExportRecord | None = None

    @property
    def target(self) -> ExportTarget:
        return target_for(self.item.key, self.claim.revision)


#: What the protocol calls on a destination whose exports are published (``takes_effect = "published"``): the steps
#: :class:`~export_ledger.destinations.PointerDestination` declares.
PUBLISHING_STEPS = ("pointer", "fence", "verify", "sweep", "stage", "commit", "unstage", "location")


@dataclass(frozen=True)
class KeySteps:
    """The protocol's steps for one key, each from a :class:`HeldKey` to the next one; a failure is recorded on the key
    as :func:`failure_finish` says and raised again."""

    ledger: ExportLedger
    destination: Destination
    stager: Stager

    def __post_init__(self) -> None:
        destination, how = self.destination, getattr(self.destination, "takes_effect", None)
        publishes = all(callable(getattr(destination, step, None)) for step in PUBLISHING_STEPS)
        writes = callable(getattr(destination, "write_in_transaction", None))
        if not ((how == "published" and publishes) or (how == "with_record" and writes)):
            raise DestinationError(
                f"{destination.describe()} cannot export: takes_effect is {how!r}, and a destination exports either "
                f"'published' (with {', '.join(PUBLISHING_STEPS)}) or 'with_record' (with write_in_transaction)"
            )

    @property
    def log(self) -> Callable[[str, str], None]:
        return self.stager.log

    def open(self, held: HeldKey) -> HeldKey:
        """Everything up to the publish: the rows written with the completion record (a transactional destination),
        an earlier attempt's commit found (``repaired``), the same data as the revision it restates (``unchanged``),
        or the revision staged, invisible, for :meth:`publish`."""
        held = self.step(held, self._fenced)
        if self.destination.takes_effect == "with_record":
            return self.step(held, self._written)
        return self.step(held, self._staged)

    def publish(self, held: HeldKey) -> HeldKey:
        """The pointer's compare-and-swap for a staged revision: visible now, its evidence still to record."""
        return self.step(held, self._committed)

    def lose(self, held: HeldKey, error: Exception) -> HeldKey:
        """Records a group-wide failure (its sync) on one key of the group, as that key's own failure would be, and
        raises it: staged only (nothing visible) or published or repaired (visible, durability unknown: the outcome
        is unknown)."""
        if held.evidence is None:
            return self.step(held, lambda _: _raise(error))
        location, sha256 = held.evidence.location, held.evidence.sha256
        unknown = PublishOutcomeUnknown(
            f"committed {location}, then could not make it durable ({safe_message(error)})",
            sha256=sha256, location=location,
        )  # fmt: skip
        unknown.__cause__ = error
        return self.step(replace(held, fenced_predecessor=True), lambda _: _raise(unknown))

    def step(self, held: HeldKey, step: Callable[[HeldKey], HeldKey]) -> HeldKey:
        try:
            return step(held)
        except Exception as exc:
            finish = failure_finish(exc, held.fenced_predecessor)
            raised = self._record(held, finish, exc)
            if raised is exc:
                raise
            raise raised from exc

    def _record(self, held: HeldKey, finish: FailureFinish, exc: Exception) -> Exception:
        """Records ``finish`` for ``held``'s failure ``exc``; returns what to raise."""
        completions, claim = self.ledger.completions, held.claim
        if finish is FailureFinish.UNKNOWN:
            completions.mark_remote_unknown(
                claim, exc, sha256=exc.sha256, location=exc.location or self._place_location(held)
            )
            return ExportOutcomeUnknown(
                f"{claim.logical_key}: the outcome at the destination is unknown ({exc}). The key is now "
                "remote_unknown; reconciliation (the reconciliation sensor, or `export-ledger reconcile`) will resolve "
                "it from the destination's evidence. Retrying before then is refused, because a blind retry could "
                "export it twice."
            )
        if finish is FailureFinish.CONFLICT:
            # Fenced: the ledger took the key from this attempt (its finish is then refused, recording `fenced`), or
            # the fence came from a token the ledger never issued. Otherwise never retried blindly: a person looks.
            completions.mark_conflict(
                claim, exc, location=None if isinstance(exc, Fenced) else getattr(exc, "location", None)
            )
        elif finish is FailureFinish.FAILED:
            completions.fail(claim, exc)
        elif finish is FailureFinish.UNKNOWN_AT_PLACE:
            completions.mark_remote_unknown(claim, exc, location=self._place_location(held))
        return exc

    def _place_location(self, held: HeldKey) -> str | None:
        """Where this attempt's place is (recorded with an unknown outcome, so that reconciliation judges the key at
        the destination the attempt wrote to, not at another one it is pointed at)."""
        claim = held.claim
        try:
            return self.destination.attempt_location(
                held.target.at_place(place_name(claim.revision, claim.fencing_token))
            )
        except Exception:  # noqa: BLE001 - a location is a courtesy to reconciliation; the outcome is recorded anyway
            return None

    def _fenced(self, held: HeldKey) -> HeldKey:
        """The claim checked against the key, then, on a publishing destination, the key's pointer: fenced with this
        attempt's token when anyone held the key before (from then on no predecessor can publish), else read."""
        failpoints.reach("after_claim")
        claim, key = held.claim, held.item.key
        if not _same_window(claim, key):
            raise LedgerError(
                f"{claim.logical_key} was first claimed for [{utc_iso(claim.window.start_utc)}, "
                f"{utc_iso(claim.window.end_utc)}) but this attempt computed "
                f"[{utc_iso(key.window.start_utc)}, {utc_iso(key.window.end_utc)}); nothing exported"
            )
        destination = self.destination
        if destination.takes_effect == "with_record":
            # Its effect and record commit in one ledger transaction: fenced there.
            return replace(held, fenced_predecessor=True)
        if claim.fencing_token > 1:
            pointer = destination.fence(held.target, claim.fencing_token, logical_key=claim.logical_key)
            return replace(held, pointer=pointer, fenced_predecessor=True)
        return replace(held, pointer=destination.pointer(held.target))

    def _staged(self, held: HeldKey) -> HeldKey:
        """What the pointer names, judged: an earlier attempt's commit is ``repaired`` from its manifest, something
        else is a conflict; otherwise the rows are read, validated, staged at this attempt's place (after a sweep
        of the places no pointer can name) and, for a restatement, compared with the revision they would supersede."""
        destination, claim, stager, pointer = self.destination, held.claim, self.stager, held.pointer
        target, token, superseded = held.target, claim.fencing_token, claim.superseded_revision
        try:
            verification = destination.verify(
                target, logical_key=claim.logical_key, superseded=superseded, pointer=pointer
            )
        except DestinationError as exc:
            if pointer.revision == superseded or isinstance(exc, DestinationConflict):
                raise
            # The pointer names something this attempt could not read back: what readers see is not known to be
            # nothing, so this is not `failed`. Reconciliation holds, fences and judges it.
            raise PublishOutcomeUnknown(
                f"{claim.logical_key}: the pointer names revision {pointer.revision}, which could not be verified "
                f"({safe_message(exc)})"
            ) from None
        if verification.verdict is Verdict.PUBLISHED:
            manifest = verification.manifest
            self.log(
                "warning",
                f"{claim.logical_key} was committed by attempt {manifest.attempt_id} but never recorded; recording it "
                "from its manifest instead of writing a second copy",
            )
            return replace(
                held, status="repaired", evidence=CompletionEvidence.published(verification.location, manifest)
            )
        if verification.verdict is Verdict.CONFLICT:
            raise ExportConflict(f"{claim.logical_key}: {verification.detail}", location=verification.location)
        fingerprint = stager.fingerprint()
        table, finish = stager.validated_in_two_steps(claim, held.item.frame, held.item.key, fingerprint)
        destination.sweep(target, token, pointer)
        template = stager.manifest_template(claim, held.item.key)
        staged = stager.stage(destination, target, token, table, finish, template)
        failpoints.reach("after_stage")
        unchanged = stager.unchanged(self.ledger, destination, claim, staged, fingerprint, pointer)
        if unchanged is not None:
            stager.unstage(destination, staged)
            return replace(held, status="unchanged", evidence=unchanged)
        return replace(held, status="staged", staged=staged, fingerprint=fingerprint)

    def _committed(self, held: HeldKey) -> HeldKey:
        """The publish of a staged revision: the pointer's compare-and-swap, then its evidence, still to record."""
        claim, staged, token = held.claim, held.staged, held.claim.fencing_token
        self.destination.commit(staged, token, superseded=claim.superseded_revision)
        location = self.destination.location(staged.target)
        try:
            failpoints.reach("after_publish")
        except Exception as exc:
            # The export is visible now: this key is not `failed` (nothing visible) but unrecorded. remote_unknown
            # hands it to reconciliation, which records it from the destination's evidence.
            raise PublishOutcomeUnknown(
                f"committed {location}, then failed before recording it ({safe_message(exc)})",
                sha256=staged.manifest.sha256, location=location,
            ) from exc  # fmt: skip
        evidence = CompletionEvidence(
            location=location,
            sha256=staged.manifest.sha256,
            row_count=staged.manifest.row_count,
            attempt_id=claim.attempt_id,
            fencing_token=token,
            # The stream (if any) was written whole by now: the fingerprint covers every row published.
            source_fingerprint=held.fingerprint.encode(),
            revision=claim.revision,
        )
        return replace(held, status="exported", evidence=evidence, fenced_predecessor=True)

    def _written(self, held: HeldKey) -> HeldKey:
        """Rows and completion record in one ledger transaction: both commit or neither."""
        destination, claim, stager, target = self.destination, held.claim, self.stager, held.target
        existing = destination.verify(target, logical_key=claim.logical_key, superseded=claim.superseded_revision)
        if existing.verdict is not Verdict.ABSENT:
            raise ExportConflict(
                f"{claim.logical_key}: {existing.detail} although the ledger has no completion of revision "
                f"{claim.revision}",
                location=existing.location,
            )
        fingerprint = stager.fingerprint()
        # A stream is read, validated and inserted batch by batch inside the completion transaction (issue #21), so
        # memory stays bounded by one batch; a bad batch rolls back the rows before it. The key's row lock (and on
        # SQLite the database's write lock) is held while the source is read.
        rows = stager.validated(claim, held.item.frame, held.item.key, fingerprint)
        template = stager.manifest_template(claim, held.item.key)

        def effect(connection) -> CompletionEvidence:
            written = destination.write_in_transaction(connection, target, rows, template)
            failpoints.reach("before_commit")  # inside the transaction: a failure here rolls the rows back too
            return CompletionEvidence(
                destination.location(target), written.sha256, written.row_count, claim.attempt_id,
                claim.fencing_token, source_fingerprint=fingerprint.encode(), revision=written.revision,
            )  # fmt: skip

        record = self.ledger.completions.complete_within(claim, effect)
        return replace(held, status="exported", record=record)

    def skipped(self, outcome: AlreadyCompleted, item: ExportItem) -> ExportResult:
        record = outcome.record
        self.log(
            "info",
            f"{record.logical_key} already completed by attempt {record.committed_attempt}; skipped, no new effect",
        )
        return ExportResult.of(record, item.partition_key, "already_completed")

    def result(self, held: HeldKey, attempt: str) -> ExportResult:
        record, claim, status, partition_key = held.record, held.claim, held.status, held.item.partition_key
        if status == "unchanged":
            kept = claim.superseded_revision
            self.log(
                "warning",
                f"{record.logical_key}: the restatement to revision {claim.revision} read the same data as revision "
                f"{kept} ({record.row_count} rows, same sha256): nothing published; revision {kept} stays current and "
                f"the request is closed unchanged (attempt {attempt})",
            )
            return ExportResult.of(record, partition_key, status, kept, requested_revision=claim.revision)
        if status != "exported":
            self.log(
                "info",
                f"{record.logical_key} {status}: {record.row_count} rows at {record.location} (attempt {attempt})",
            )
        supersedes = claim.superseded_revision if claim.revision > 1 else None
        return ExportResult.of(record, partition_key, status, claim.revision, supersedes)


def _raise(error: Exception):
    raise error
