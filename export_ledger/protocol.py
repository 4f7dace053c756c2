"""The write protocol for logical keys: the one function the I/O manager, the benchmarks and the harnesses call.

For each key (docs/protocol.md): **claim** it in the ledger (a lease and a fencing token, on the ledger's clock,
refused unless its window has ended and its calendar contract is the one in force); **fence** the destination with
the token when anyone held the key before; **verify** what the key's pointer names (an earlier attempt's commit is
recorded as a repair, never written twice); otherwise **read** the source (after the claim: a source failure is this
key's, recorded as ``failed`` with its details withheld), validate it against the window recorded at the first claim,
**sweep** places no pointer can ever name, **stage** the revision at this attempt's own place, **commit** it with the
pointer's compare-and-swap (the one step that changes what readers see, refused to a fenced attempt), and only then
**record** completion. On a transactional destination the rows and the completion record commit in one transaction
instead. Plain Python, no Dagster.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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
from export_ledger.destinations.publishing import Pointer, StagedExport
from export_ledger.errors import ExportLedgerError, safe_message
from export_ledger.fingerprint import Fingerprint
from export_ledger.frames import ExportSchema, FrameBatches, data_file_name
from export_ledger.keys import LogicalKey
from export_ledger.ledger import (
    AlreadyCompleted,
    Claim,
    CompletionEvidence,
    ExportLedger,
    ExportRecord,
    ExportState,
    FencedOut,
    LedgerError,
    LedgerUnavailable,
)
from export_ledger.runs import BatchOutcome, ExportBatch, ExportItem, ExportResult, KeyFailure, Rows
from export_ledger.stage import Stager

__all__ = [
    "DEFAULT_GROUP_SIZE", "RENEW_AFTER", "BatchOutcome", "ExportBatch", "ExportBatchFailed", "ExportConflict",
    "ExportItem", "ExportOutcomeUnknown", "ExportResult", "FailureFinish", "KeyFailure", "Rows", "export_batch",
    "export_key", "failure_finish", "target_for",
]  # fmt: skip

_log = logging.getLogger("export_ledger")


class ExportConflict(DestinationConflict):
    """The destination holds a different export at this key's place; an operator must look."""


class ExportBatchFailed(DestinationError):
    """Keys of one run failed; each is named with its error (in the library's own words), and every other key was
    still exported."""


class ExportOutcomeUnknown(DestinationError):
    """The destination may or may not hold the export; the key is ``remote_unknown`` until reconciled."""


def target_for(key: LogicalKey, revision: int = 1, place: str | None = None) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision, place)


def _same_window(claim: Claim, key: LogicalKey) -> bool:
    return (claim.window.start_utc.timestamp(), claim.window.end_utc.timestamp()) == (
        key.window.start_utc.timestamp(),
        key.window.end_utc.timestamp(),
    )


def export_key(
    ledger: ExportLedger,
    destination: Destination,
    schema: ExportSchema,
    item: ExportItem,
    attempt: str,
    *,
    file_format: str = "csv",
    log: Callable[[str, str], None] | None = None,
) -> ExportResult:
    """Exports one logical key exactly once, whatever the number of attempts: a group of one (:func:`export_batch`).

    Args:
        ledger: The ledger that decides who may export the key.
        destination: Where the export is published (or written, for a transactional destination).
        schema: The export's columns and rules; the rows are validated against it and the key's window.
        item: The key and its rows.
        attempt: This attempt's id (a Dagster run id and step key).
        file_format: ``csv`` or ``parquet``.
        log: ``log(level, message)``; default the ``export_ledger`` logger.

    Returns:
        What happened: ``exported``, ``repaired`` (an earlier attempt's commit was recorded),
        ``already_completed``, or ``unchanged`` (a restatement whose data was the current revision's, byte for byte:
        nothing published, the request closed ``unchanged``).

    Raises:
        ExportOutcomeUnknown: the destination may hold the export; the key is ``remote_unknown`` until reconciled.
        ExportConflict: the destination holds something else at the key's place; the key is ``conflict``.
        LedgerError: the ledger refused the claim (held lease, unknown outcome, conflict, below the low-water mark,
            a window not over, a changed contract) or this attempt lost the key before recording (``FencedOut``).
        Any other error: the key is ``failed`` (safe to retry) and the error is raised again.
    """
    data_file_name(file_format)
    exporter = _Exporter(ledger, destination, Stager(schema, file_format, log or _default_log))
    failures: list[Exception] = []
    results = _Group(exporter, [item], attempt, lambda _, exc: failures.append(exc), deferred=False).run()
    if failures:
        raise failures[0]
    return results[0]


def _default_log(level: str, message: str) -> None:
    getattr(_log, level)(message)


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
class _Held:
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


#: What the protocol calls on a destination whose exports are published (``takes_effect = "published"``).
PUBLISHING_STEPS = ("pointer", "fence", "verify", "sweep", "stage", "commit", "unstage", "location")


@dataclass(frozen=True)
class _Exporter:
    """The protocol's steps for one key, each from a :class:`_Held` to the next one; a failure is recorded on the key
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

    def open(self, held: _Held) -> _Held:
        """Everything up to the publish: the rows written with the completion record (a transactional destination),
        an earlier attempt's commit found (``repaired``), the same data as the revision it restates (``unchanged``),
        or the revision staged, invisible, for :meth:`publish`."""
        held = self.step(held, self._fenced)
        if self.destination.takes_effect == "with_record":
            return self.step(held, self._written)
        return self.step(held, self._staged)

    def publish(self, held: _Held) -> _Held:
        """The pointer's compare-and-swap for a staged revision: visible now, its evidence still to record."""
        return self.step(held, self._committed)

    def lose(self, held: _Held, error: Exception) -> _Held:
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

    def step(self, held: _Held, step: Callable[[_Held], _Held]) -> _Held:
        try:
            return step(held)
        except Exception as exc:
            finish = failure_finish(exc, held.fenced_predecessor)
            raised = self._record(held, finish, exc)
            if raised is exc:
                raise
            raise raised from exc

    def _record(self, held: _Held, finish: FailureFinish, exc: Exception) -> Exception:
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

    def _place_location(self, held: _Held) -> str | None:
        """Where this attempt's place is (recorded with an unknown outcome, so that reconciliation judges the key at
        the destination the attempt wrote to, not at another one it is pointed at)."""
        claim = held.claim
        try:
            return self.destination.attempt_location(
                held.target.at_place(place_name(claim.revision, claim.fencing_token))
            )
        except Exception:  # noqa: BLE001 - a location is a courtesy to reconciliation; the outcome is recorded anyway
            return None

    def _fenced(self, held: _Held) -> _Held:
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

    def _staged(self, held: _Held) -> _Held:
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

    def _committed(self, held: _Held) -> _Held:
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

    def _written(self, held: _Held) -> _Held:
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

    def result(self, held: _Held, attempt: str) -> ExportResult:
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


#: Keys claimed together in one ledger transaction, and completed together in one more, by :func:`export_batch`.
#: Bounded because every lease of a group starts at the group's claim (it is renewed as the group goes, see
#: :data:`RENEW_AFTER`), and a crash before a group's completion commit leaves at most this many keys to be repaired.
DEFAULT_GROUP_SIZE = 50
#: The share of the lease after which the rest of a group's leases are renewed before the next key's source is read.
RENEW_AFTER = 0.5


def export_batch(
    ledger: ExportLedger,
    destination: Destination,
    batch: ExportBatch,
    attempt: str,
    *,
    file_format: str = "csv",
    log: Callable[[str, str], None] | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> list[ExportResult]:
    """:func:`export_key` for every key of a run, in order. One key's failure is that key's: every other key is
    still exported; what happened to each key is settled on ``batch`` once (:attr:`ExportBatch.outcome`), then the
    failures are raised together (a library error as itself when it is the only one, else
    :class:`ExportBatchFailed` naming each key, in the library's own words: a source's or driver's message is
    withheld, it may quote customer data). A lost ledger stops at once.

    The keys go in groups of ``group_size``: a group's keys are claimed in one ledger transaction (a lease and
    fencing token per key), then each key is repaired, published or written (its source read after the claim), and
    the completions of the group's committed keys are recorded in one more transaction. Every guarantee of
    :func:`export_key` holds per key. A single key, and each streamed key (:class:`~export_ledger.frames.FrameBatches`,
    claimed right before it is read so that its lease covers its own export only), are a group of one.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if batch.outcome is not None:
        raise ValueError("this batch was exported already (its outcome is settled): build a new ExportBatch to rerun")
    data_file_name(file_format)
    log = log or _default_log
    exporter = _Exporter(ledger, destination, Stager(batch.schema, file_format, log))
    results: list[ExportResult] = []
    failures: list[KeyFailure] = []

    def failed(item: ExportItem, exc: Exception) -> None:  # logged as it happens, and kept if the ledger is lost
        message = safe_message(exc)
        log("error", f"{item.key}: {message}")
        key = item.key
        failures.append(KeyFailure(str(key), item.partition_key, key.tenant, type(exc).__name__, message, exc))

    try:
        for group, deferred in _groups(batch.items, group_size):
            results.extend(_Group(exporter, group, attempt, failed, deferred).run())
    finally:  # the keys finished before a lost ledger stopped the run (its earlier groups', every failure) too
        batch.settle(BatchOutcome(tuple(results), tuple(failures)))
    _raise_failures(batch)
    return results


def _groups(items: list[ExportItem], size: int):
    """The batch's groups in order, each with whether its durability is deferred to its syncs: runs of up to
    ``size`` keys (deferred), and each streamed key or a batch's only key alone, whose writes are made durable one
    by one (fsyncs of its own files cost less than a sync of the whole filesystem)."""
    group: list[ExportItem] = []
    for item in items:
        if len(items) > 1 and not isinstance(item.frame, FrameBatches):
            group.append(item)
            if len(group) == size:
                yield group, True
                group = []
            continue
        if group:
            yield group, True
            group = []
        yield [item], False
    if group:
        yield group, True


def _raise_failures(batch: ExportBatch) -> None:
    failures = batch.failures
    if not failures:
        return
    if len(failures) == 1 and isinstance(failures[0].error, ExportLedgerError):
        # The library's own words are safe to show; what it was raised from (a driver's, a source's) may not be.
        error = failures[0].error
        error.__cause__, error.__suppress_context__ = None, True
        raise error
    summary = "; ".join(f"{f.logical_key}: {f.message}" for f in failures[:20])
    more = f" (and {len(failures) - 20} more)" if len(failures) > 20 else ""
    raise ExportBatchFailed(f"{len(failures)} of {len(batch.items)} export keys failed ({summary}{more})") from None


@dataclass
class _Group:
    """One group of keys: one claim transaction, the keys' effects, one completion transaction.

    On a publishing destination the effects go in two phases with their durability deferred (docs/protocol.md,
    "Group commit"): every key is fenced, verified and staged; one sync makes the staged data (and the pointers'
    bytes) durable; every key's pointer is moved; one more sync makes the moves durable; then the one completion
    commit. Its lists live for one :meth:`run`; each key in them is a frozen :class:`_Held`.
    """

    exporter: _Exporter
    items: list[ExportItem]
    attempt: str
    #: Told of each key that fails, with its error, as it fails.
    failed: Callable[[ExportItem, Exception], None]
    deferred: bool = True
    results: dict[int, ExportResult] = field(default_factory=dict)
    recorded: list[_Held] = field(default_factory=list)

    def run(self) -> list[ExportResult]:
        """The group's results in item order (each failed key was told to :attr:`failed`)."""
        exporter, ledger = self.exporter, self.exporter.ledger
        held = self._claimed()
        staged: list[_Held] = []  # staged, invisible, to publish
        unrecorded: list[_Held] = []  # published, repaired or unchanged: to make durable and record
        started = time.monotonic()  # only decides when to renew; the ledger's clock decides what a lease is
        destination = exporter.destination
        with destination.deferred() if self.deferred else contextlib.nullcontext():
            for i in sorted(held):
                if time.monotonic() - started > ledger.lease_ttl.total_seconds() * RENEW_AFTER:
                    # The keys staged so far are published, synced and recorded now (their leases are as old as the
                    # rest), then the leases of the keys still to export are renewed.
                    self._settle(staged, unrecorded)
                    staged, unrecorded = [], []
                    held = self._renewed(held, i)
                    started = time.monotonic()
                if i not in held:
                    continue  # lost at a renewal (this key or a later one): its failure is recorded, the rest go on
                try:
                    opened = exporter.open(held[i])
                except LedgerUnavailable:
                    raise
                except Exception as exc:
                    self._fail(i, exc)
                    continue
                if opened.record is not None:
                    self.recorded.append(opened)
                elif opened.status == "staged":
                    staged.append(opened)
                else:
                    unrecorded.append(opened)  # a repair, or an unchanged restatement
            # Until this commit the group's exports are committed and not recorded: the case a repair already handles.
            self._settle(staged, unrecorded)
        for done in sorted(self.recorded, key=lambda h: h.index):
            try:
                failpoints.reach("after_commit")
            except Exception as exc:
                self._fail(done.index, exc)
                continue
            self.results[done.index] = exporter.result(done, self.attempt)
        return [self.results[i] for i in sorted(self.results)]

    def _claimed(self) -> dict[int, _Held]:
        exporter, items = self.exporter, self.items
        contracts = {(i.key.export, i.key.tenant): i.contract for i in items if i.contract is not None}
        outcomes = exporter.ledger.claims.claim_many([i.key for i in items], self.attempt, contracts=contracts or None)
        held: dict[int, _Held] = {}
        for i, (item, outcome) in enumerate(zip(items, outcomes, strict=True)):
            if isinstance(outcome, AlreadyCompleted):
                self.results[i] = exporter.skipped(outcome, item)
            elif isinstance(outcome, LedgerError):
                self._fail(i, outcome)
            else:
                # A takeover's predecessor is not fenced until this attempt's fence lands (docs/protocol.md, step 2).
                held[i] = _Held(i, item, outcome, outcome.previous_state is not ExportState.IN_PROGRESS)
        return held

    def _settle(self, staged: list[_Held], unrecorded: list[_Held]) -> None:
        """Sync, publish every staged key, sync, record: a pointer is never durable before the data it names, and a
        key is recorded only once its publish is durable (docs/protocol.md, "Group commit")."""
        exporter, destination = self.exporter, self.exporter.destination
        if staged:
            try:
                destination.sync()  # the staged data, manifests and pointers' bytes, before any pointer names them
            except Exception as exc:
                for held in staged:
                    self._lose(held, exc)
                staged = []
            for held in staged:
                try:
                    unrecorded.append(exporter.publish(held))
                except LedgerUnavailable:
                    raise
                except Exception as exc:
                    self._fail(held.index, exc)
        if unrecorded:
            try:
                failpoints.reach("before_group_sync")
                destination.sync()  # the pointer moves (and the evidence of repairs), before the ledger records them
                failpoints.reach("after_group_sync")
            except Exception as exc:
                for held in unrecorded:
                    self._lose(held, exc)
                unrecorded = []
        self._record(unrecorded)

    def _record(self, unrecorded: list[_Held]) -> None:
        """Records the completions of the group's published keys in one transaction."""
        ready = []
        for held in unrecorded:
            try:
                failpoints.reach("before_commit")
            except Exception as exc:
                self._fail(held.index, exc)
                continue
            ready.append(held)
        if not ready:
            return
        committed = self.exporter.ledger.completions.complete_many([(h.claim, h.evidence) for h in ready])
        for held, record in zip(ready, committed, strict=True):
            if isinstance(record, FencedOut):
                self._fail(held.index, record)
            else:
                self.recorded.append(replace(held, record=record))

    def _renewed(self, held: dict[int, _Held], start: int) -> dict[int, _Held]:
        """The group's keys from ``start`` on, their leases renewed; a claim lost meanwhile is that key's failure."""
        waiting = [i for i in sorted(held) if i >= start]
        kept = {i: held[i] for i in held if i < start}
        for i, renewed in zip(waiting, self.exporter.ledger.claims.renew_many([held[i].claim for i in waiting]),
                              strict=True):  # fmt: skip
            if isinstance(renewed, FencedOut):
                self._fail(i, renewed)
            else:
                kept[i] = replace(held[i], claim=renewed)
        return kept

    def _lose(self, held: _Held, exc: Exception) -> None:
        try:
            self.exporter.lose(held, exc)
        except LedgerUnavailable:
            raise
        except Exception as recorded:
            self._fail(held.index, recorded)

    def _fail(self, i: int, exc: Exception) -> None:
        self.failed(self.items[i], exc)
