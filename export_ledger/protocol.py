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

import concurrent.futures
import contextlib
import contextvars
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa

from export_ledger import failpoints
from export_ledger.calendar import utc_iso
from export_ledger.destinations.base import (
    Destination,
    DestinationConflict,
    DestinationError,
    ExportTarget,
    Fenced,
    PublishOutcomeUnknown,
    TransactionalDestination,
    Verdict,
    place_name,
    place_of_location,
)
from export_ledger.destinations.publishing import Pointer, PublishingDestination, StagedExport, pointer_otherwise
from export_ledger.errors import ExportLedgerError, safe_message
from export_ledger.fingerprint import Fingerprint
from export_ledger.frames import (
    ExportSchema,
    FrameBatches,
    Manifest,
    TableStream,
    data_file_name,
    validate_batches,
    validate_frame,
    validate_frame_in_two_steps,
)
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
from export_ledger.sources import DEFAULT_BATCH_ROWS, ExportSource

_log = logging.getLogger("export_ledger")


class ExportConflict(DestinationConflict):
    """The destination holds a different export at this key's place; an operator must look."""


class ExportBatchFailed(DestinationError):
    """Keys of one run failed; each is named with its error (in the library's own words), and every other key was
    still exported."""


class ExportOutcomeUnknown(DestinationError):
    """The destination may or may not hold the export; the key is ``remote_unknown`` until reconciled."""


#: A key's rows: a DataFrame (validated whole), batches (validated, written and hashed batch by batch), a reader
#: called after the key is claimed (the source is read only for a key that is exported), or None (found completed
#: when the run was planned: nothing read).
Rows = pd.DataFrame | FrameBatches | Callable[[], pd.DataFrame] | None


@dataclass(frozen=True)
class ExportItem:
    """One logical key to export.

    Attributes:
        key: The key.
        partition_key: The Dagster partition it belongs to.
        frame: Its rows (see :data:`Rows`).
        contract: The tenant's calendar contract the key's window was computed with; the claim is refused unless it
            is the one the ledger holds in force (None: not checked).
    """

    key: LogicalKey
    partition_key: str
    frame: Rows
    contract: Mapping | None = None

    @classmethod
    def streamed(
        cls,
        key: LogicalKey,
        partition_key: str,
        source: ExportSource,
        schema: ExportSchema,
        *,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        contract: Mapping | None = None,
    ) -> ExportItem:
        """An item whose rows are read from ``source`` in batches of ``batch_rows`` while they are exported.

        Nothing is read until the export runs (and never for a key found completed).
        """
        start, end = key.window.start_utc, key.window.end_utc
        batches = FrameBatches(_LazyBatches(source, key.tenant, start, end, schema, batch_rows))
        return cls(key, partition_key, batches, contract)


@dataclass(frozen=True)
class _LazyBatches:
    """The source's batches, requested only when iterated."""

    source: ExportSource
    tenant: str
    start_utc: dt.datetime
    end_utc: dt.datetime
    schema: ExportSchema
    batch_rows: int

    def __iter__(self):
        return iter(
            self.source.batches(
                self.tenant, self.start_utc, self.end_utc, schema=self.schema, batch_rows=self.batch_rows
            )
        )


@dataclass(frozen=True)
class ExportResult:
    """What happened to one key in this attempt."""

    logical_key: str
    partition_key: str
    tenant: str
    status: str  # exported | repaired | already_completed | unchanged
    location: str
    sha256: str
    row_count: int
    committed_attempt: str
    #: The revision this attempt published or repaired (the restatement's for a restatement); 1 for
    #: ``already_completed``, whose current revision is not looked up (the ledger's ``current_revision`` has it).
    revision: int = 1
    #: For a restatement, the revision it superseded (the key's recorded revision before it: not always
    #: ``revision - 1``, since a withdrawn request's number is never given again); None otherwise.
    supersedes: int | None = None
    #: For ``unchanged`` (a restatement whose data was the current revision's, so nothing was published and its
    #: request was closed ``unchanged``): the revision that was asked for. ``revision`` is then the one that stays
    #: current, and location, sha256 and row count are that revision's. None otherwise.
    requested_revision: int | None = None

    @classmethod
    def of(
        cls,
        record: ExportRecord,
        partition_key: str,
        status: str,
        revision: int = 1,
        supersedes: int | None = None,
        requested_revision: int | None = None,
    ) -> ExportResult:
        return cls(
            record.logical_key, partition_key, record.tenant, status, record.location, record.sha256,
            record.row_count, record.committed_attempt, revision, supersedes, requested_revision,
        )  # fmt: skip


@dataclass(frozen=True)
class KeyFailure:
    """One key of a run that was not exported, and why (``message``: in the library's own words; ``error``: the
    exception itself, for callers that branch on its class)."""

    logical_key: str
    partition_key: str
    tenant: str
    error_class: str
    message: str
    error: Exception = field(repr=False, compare=False, default=None)


@dataclass
class ExportBatch:
    """Every (partition, tenant) key of one run, in the order they are exported, and what happened to each."""

    schema: ExportSchema
    items: list[ExportItem]
    results: list[ExportResult] = field(default_factory=list)
    failures: list[KeyFailure] = field(default_factory=list)
    #: Called by the I/O manager when the batch failed, once every other key is recorded and just before it fails the
    #: step: what the asset reports about the run (its checks' verdicts) must be said then, since a failed step never
    #: returns to the asset's code. Its argument says whether the export ran at all (False: it failed before, e.g. the
    #: destination could not be built, and the ledger alone holds the truth). None: nothing to say.
    on_failure: Callable[[bool], None] | None = field(default=None, repr=False, compare=False)


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
    """Exports one logical key exactly once, whatever the number of attempts.

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
    return _KeyExport(ledger, destination, schema, file_format, log or _default_log).run(item, attempt)


def _default_log(level: str, message: str) -> None:
    getattr(_log, level)(message)


@dataclass(frozen=True)
class _Staged:
    """A key's revision staged at its place and not yet published (its pointer's bytes prepared beside it)."""

    staged: StagedExport
    fingerprint: Fingerprint
    #: Whether the key's predecessor was fenced when it was staged (see ``_KeyExport._fenced_predecessor``).
    fenced_predecessor: bool


@dataclass
class _KeyExport:
    ledger: ExportLedger
    destination: Destination
    schema: ExportSchema
    file_format: str
    log: Callable[[str, str], None]
    _fenced_predecessor: bool = field(default=True, init=False, repr=False)

    def run(self, item: ExportItem, attempt: str) -> ExportResult:
        contracts = None if item.contract is None else {(item.key.export, item.key.tenant): item.contract}
        (outcome,) = self.ledger.claims.claim_many([item.key], attempt, contracts=contracts)
        if isinstance(outcome, LedgerError):
            raise outcome
        if isinstance(outcome, AlreadyCompleted):
            return self.skipped(outcome, item)
        claim = outcome
        status, effect = self.effect(claim, item)
        if isinstance(effect, ExportRecord):
            record = effect  # a transactional destination recorded it with its rows
        else:
            # A group of one: its writes were made durable one by one, so there is nothing to sync between these.
            failpoints.reach("before_group_sync")
            failpoints.reach("after_group_sync")
            failpoints.reach("before_commit")
            record = self.ledger.completions.complete(claim, effect)
        failpoints.reach("after_commit")
        return self.result(record, item, status, attempt, claim)

    def skipped(self, outcome: AlreadyCompleted, item: ExportItem) -> ExportResult:
        record = outcome.record
        self.log(
            "info",
            f"{record.logical_key} already completed by attempt {record.committed_attempt}; skipped, no new effect",
        )
        return ExportResult.of(record, item.partition_key, "already_completed")

    def result(self, record: ExportRecord, item: ExportItem, status: str, attempt: str, claim: Claim) -> ExportResult:
        if status == "unchanged":
            kept = claim.superseded_revision
            self.log(
                "warning",
                f"{record.logical_key}: the restatement to revision {claim.revision} read the same data as revision "
                f"{kept} ({record.row_count} rows, same sha256): nothing published; revision {kept} stays current and "
                f"the request is closed unchanged (attempt {attempt})",
            )
            return ExportResult.of(record, item.partition_key, status, kept, requested_revision=claim.revision)
        if status != "exported":
            self.log(
                "info",
                f"{record.logical_key} {status}: {record.row_count} rows at {record.location} (attempt {attempt})",
            )
        supersedes = claim.superseded_revision if claim.revision > 1 else None
        return ExportResult.of(record, item.partition_key, status, claim.revision, supersedes)

    def effect(self, claim: Claim, item: ExportItem) -> tuple[str, ExportRecord | CompletionEvidence]:
        """Everything between a key's claim and its completion record: the repair, publish or transactional write.

        Returns the status and either the committed record (a transactional destination commits rows and record
        together) or the evidence of the committed export, still to be recorded. A failure is recorded on the key
        (``failed``, ``conflict``, ``remote_unknown``, or the ``fenced`` row of an attempt that lost the key) and
        raised again.
        """
        status, outcome = self.stage(claim, item)
        if isinstance(outcome, _Staged):
            return self.publish(claim, outcome)
        return status, outcome

    def stage(self, claim: Claim, item: ExportItem) -> tuple[str, ExportRecord | CompletionEvidence | _Staged]:
        """:meth:`effect` up to the publish: a staged revision is returned for :meth:`publish` (a group stages all
        its keys, syncs once, then publishes each: docs/protocol.md, "Group commit")."""
        target = target_for(item.key, claim.revision)
        # A takeover's predecessor is not fenced until this attempt's fence lands: before that, nobody knows what it
        # did or will still do, so this attempt's failure cannot say "nothing is visible" (docs/protocol.md, step 2).
        self._fenced_predecessor = claim.previous_state is not ExportState.IN_PROGRESS
        with self._recording_failures(claim, target):
            failpoints.reach("after_claim")
            if not _same_window(claim, item.key):
                raise LedgerError(
                    f"{claim.logical_key} was first claimed for [{utc_iso(claim.window.start_utc)}, "
                    f"{utc_iso(claim.window.end_utc)}) but this attempt computed "
                    f"[{utc_iso(item.key.window.start_utc)}, {utc_iso(item.key.window.end_utc)}); nothing exported"
                )
            if isinstance(self.destination, TransactionalDestination):
                self._fenced_predecessor = True  # its effect and record commit in one ledger transaction: fenced there
                return "exported", self._write_in_transaction(claim, item, target)
            return self._prepare(claim, item, target)

    def publish(self, claim: Claim, pending: _Staged) -> tuple[str, CompletionEvidence]:
        """The pointer's compare-and-swap for a revision :meth:`stage` returned, a failure recorded as there."""
        self._fenced_predecessor = pending.fenced_predecessor
        with self._recording_failures(claim, pending.staged.target):
            return self._commit(claim, pending)

    def lost(
        self, claim: Claim, item: ExportItem, pending: _Staged | None, error: Exception,
        evidence: CompletionEvidence | None,
    ) -> None:  # fmt: skip
        """Records a group-wide failure (its sync) on one key of the group, as that key's own failure would be, and
        raises it: staged only (``pending``: nothing visible) or published (``evidence``: visible, durability
        unknown, so the outcome is unknown)."""
        if pending is not None:
            self._fenced_predecessor = pending.fenced_predecessor
        else:
            self._fenced_predecessor = True  # it published, so its fence (if any) had landed
        with self._recording_failures(claim, target_for(item.key, claim.revision)):
            if evidence is None:
                raise error
            raise PublishOutcomeUnknown(
                f"committed {evidence.location}, then could not make it durable ({safe_message(error)})",
                sha256=evidence.sha256, location=evidence.location,
            ) from error  # fmt: skip

    @contextlib.contextmanager
    def _recording_failures(self, claim: Claim, target: ExportTarget):
        """Records a failure of the key's effect on the key (``failed``, ``conflict``, ``remote_unknown``) and raises
        it again."""
        completions = self.ledger.completions
        try:
            yield
        except PublishOutcomeUnknown as exc:
            completions.mark_remote_unknown(
                claim, exc, sha256=exc.sha256, location=exc.location or self._place_location(claim, target)
            )
            raise ExportOutcomeUnknown(
                f"{claim.logical_key}: the outcome at the destination is unknown ({exc}). The key is now "
                "remote_unknown; reconciliation (the reconciliation sensor, or `export-ledger reconcile`) will resolve "
                "it from the destination's evidence. Retrying before then is refused, because a blind retry could "
                "export it twice."
            ) from exc
        except FencedOut:
            raise  # this attempt no longer owns the key: it records nothing more
        except Fenced as exc:
            # Another party fenced the destination: the ledger took the key from this attempt (its finish is then
            # refused, recording `fenced`), or the fence came from a token the ledger never issued: a conflict.
            completions.mark_conflict(claim, exc)
            raise
        except DestinationConflict as exc:
            # Never retried blindly: an operator must look at the destination.
            completions.mark_conflict(claim, exc, location=getattr(exc, "location", None))
            raise
        except Exception as exc:
            if self._fenced_predecessor:
                completions.fail(claim, exc)
            else:
                # Reconciliation holds, fences and judges it: at the destination this location names.
                completions.mark_remote_unknown(claim, exc, location=self._place_location(claim, target))
            raise

    def _place_location(self, claim: Claim, target: ExportTarget) -> str | None:
        """Where this attempt's place is (recorded with an unknown outcome, so that reconciliation judges the key at
        the destination the attempt wrote to, not at another one it is pointed at)."""
        try:
            return self.destination.attempt_location(target.at_place(place_name(claim.revision, claim.fencing_token)))
        except Exception:  # noqa: BLE001 - a location is a courtesy to reconciliation; the outcome is recorded anyway
            return None

    def _publish(self, claim: Claim, item: ExportItem, target: ExportTarget) -> tuple[str, CompletionEvidence]:
        """Fence, verify, stage and commit one key at once: :meth:`_prepare`, then :meth:`_commit`."""
        status, outcome = self._prepare(claim, item, target)
        if isinstance(outcome, _Staged):
            return self._commit(claim, outcome)
        return status, outcome

    def _prepare(
        self, claim: Claim, item: ExportItem, target: ExportTarget
    ) -> tuple[str, CompletionEvidence | _Staged]:
        destination = self.destination
        if not isinstance(destination, PublishingDestination):
            raise DestinationError(f"{destination.describe()} cannot publish exports")
        token, superseded = claim.fencing_token, claim.superseded_revision
        if token > 1:
            pointer = destination.fence(target, token, logical_key=claim.logical_key)
            self._fenced_predecessor = True
        else:
            pointer = destination.pointer(target)
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
            return "repaired", CompletionEvidence.published(verification.location, manifest)
        if verification.verdict is Verdict.CONFLICT:
            raise ExportConflict(f"{claim.logical_key}: {verification.detail}", location=verification.location)
        fingerprint = Fingerprint(self.schema.id_columns, self.schema.version_column)
        table, finish = self._validated_in_two_steps(claim, item, fingerprint)
        destination.sweep(target, token, pointer)
        staged = self._stage(destination, target, token, table, finish, self._manifest_template(claim, item))
        failpoints.reach("after_stage")
        unchanged = self._unchanged(destination, claim, staged, fingerprint, pointer)
        if unchanged is not None:
            self._unstage(destination, staged)
            return "unchanged", unchanged
        return "staged", _Staged(staged, fingerprint, self._fenced_predecessor)

    def _commit(self, claim: Claim, pending: _Staged) -> tuple[str, CompletionEvidence]:
        """The publish of a staged revision: the pointer's compare-and-swap, then its evidence, still to record."""
        destination, staged, token = self.destination, pending.staged, claim.fencing_token
        destination.commit(staged, token, superseded=claim.superseded_revision)
        location = destination.location(staged.target)
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
            source_fingerprint=pending.fingerprint.encode(),
            revision=claim.revision,
        )
        return "exported", evidence

    def _unchanged(
        self,
        destination: PublishingDestination,
        claim: Claim,
        staged: StagedExport,
        fingerprint: Fingerprint,
        pointer: Pointer,
    ) -> CompletionEvidence | None:
        """For a restatement whose staged data is the revision it supersedes, byte for byte (the same sha256 and row
        count), and that revision what readers see, intact: the evidence of that revision, to record again instead
        of publishing a copy of it. None otherwise: a revision whose data was lost or changed at the destination, or
        that the pointer (``pointer``, read after this attempt's fence) no longer names as recorded, is restated by
        publishing the next one (the way out of ``partition_health``'s ``differs``). A destination that cannot say
        leaves the revision as it is (as before the check), with a warning.

        Decided where the commit would be: under the key's lease, after this attempt's fence was raised and the
        pointer read back naming that revision, so no earlier party can still move it, and nothing was committed.
        """
        if claim.supersedes is None:
            return None
        revision, sha256 = claim.supersedes
        if staged.manifest.sha256 != sha256:
            return None
        current = self.ledger.restatements.current_revision(claim.logical_key)
        if current is None or current.revision != revision or current.row_count != staged.manifest.row_count:
            return None
        recorded = staged.target.at_revision(revision, place_of_location(current.location))
        if (otherwise := pointer_otherwise(pointer, recorded, current.sha256)) is not None:
            self.log("warning", f"{claim.logical_key}: {otherwise}; revision {claim.revision} is published")
            return None
        try:
            intact = destination.verify_recorded(recorded, logical_key=claim.logical_key, sha256=current.sha256)
        except DestinationError as exc:
            self.log("warning", f"{claim.logical_key}: revision {revision} could not be read back to check it is "
                                f"intact ({safe_message(exc)}); it stays current unchanged")  # fmt: skip
            intact = None
        if intact is not None and intact.verdict is not Verdict.PUBLISHED:
            self.log("warning", f"{claim.logical_key}: revision {revision} is not intact at the destination "
                                f"({intact.detail}); revision {claim.revision} is published")  # fmt: skip
            return None
        return CompletionEvidence(
            current.location, current.sha256, current.row_count, current.published_by, claim.fencing_token,
            source_fingerprint=fingerprint.encode(), revision=revision, unchanged=True,
        )  # fmt: skip

    def _unstage(self, destination: PublishingDestination, staged: StagedExport) -> None:
        """Removes the place of a revision that will not be committed. A failure changes nothing readers see (no
        pointer names the place, and none can: only this attempt could commit it), so it is logged, and the key's
        next claim sweeps the place."""
        try:
            destination.unstage(staged)
        except DestinationError as exc:
            self.log(
                "warning",
                f"{staged.manifest.logical_key}: could not remove the unpublished place "
                f"{destination.location(staged.target)} ({safe_message(exc)}); readers never see it, and the key's "
                "next claim sweeps it",
            )

    def _write_in_transaction(self, claim: Claim, item: ExportItem, target: ExportTarget) -> ExportRecord:
        """Rows and completion record in one ledger transaction: both commit or neither."""
        existing = self.destination.verify(target, logical_key=claim.logical_key, superseded=claim.superseded_revision)
        if existing.verdict is not Verdict.ABSENT:
            raise ExportConflict(
                f"{claim.logical_key}: {existing.detail} although the ledger has no completion of revision "
                f"{claim.revision}",
                location=existing.location,
            )
        fingerprint = Fingerprint(self.schema.id_columns, self.schema.version_column)
        # A stream is read, validated and inserted batch by batch inside the completion transaction (issue #21), so
        # memory stays bounded by one batch; a bad batch rolls back the rows before it. The key's row lock (and on
        # SQLite the database's write lock) is held while the source is read.
        rows = self._validated(claim, item, fingerprint)
        template = self._manifest_template(claim, item)

        def effect(connection) -> CompletionEvidence:
            written = self.destination.write_in_transaction(connection, target, rows, template)
            failpoints.reach("before_commit")  # inside the transaction: a failure here rolls the rows back too
            return CompletionEvidence(
                self.destination.location(target), written.sha256, written.row_count, claim.attempt_id,
                claim.fencing_token, source_fingerprint=fingerprint.encode(), revision=written.revision,
            )  # fmt: skip

        return self.ledger.completions.complete_within(claim, effect)

    def _validated_in_two_steps(
        self, claim: Claim, item: ExportItem, fingerprint: Fingerprint
    ) -> tuple[pa.Table | TableStream, Callable[[], pa.Table] | None]:
        """:meth:`_validated`, for a whole frame of at least :data:`OVERLAP_ROWS` rows in two steps
        (:func:`~export_ledger.frames.validate_frame_in_two_steps`): its table checked for everything but the ids,
        and the step that checks the ids, for :meth:`_stage` to run while the file is written. Otherwise the rows
        validated whole, and None."""
        rows = self._rows(claim, item)
        checks = dict(what=claim.logical_key, tenant=item.key.tenant, fingerprint=fingerprint)
        if isinstance(rows, pd.DataFrame) and len(rows) >= OVERLAP_ROWS:
            return validate_frame_in_two_steps(rows, self.schema, claim.window, **checks)
        return self._checked(rows, claim, checks), None

    def _stage(
        self, destination: PublishingDestination, target: ExportTarget, token: int, table: pa.Table | TableStream,
        finish: Callable[[], pa.Table] | None, template: Manifest,
    ) -> StagedExport:  # fmt: skip
        """Stages ``table``; with ``finish`` (the ids' check), writes it on a second thread while ``finish`` runs on
        this one (pyarrow's writers and hashing release the GIL). A refusal by ``finish`` removes what was staged
        and is raised: the place is this attempt's own and no pointer names it, so nothing of it was ever visible."""
        if finish is None:
            return destination.stage(target, token, table, self.file_format, template)
        context = contextvars.copy_context()  # the group's deferred durability (a context variable) goes along
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-ledger-stage") as pool:
            writing = pool.submit(context.run, destination.stage, target, token, table, self.file_format, template)
            try:
                final = finish()
            except BaseException:
                try:
                    self._unstage(destination, writing.result())
                except Exception:  # noqa: BLE001 - its write failed too: the refusal is the key's outcome
                    pass
                raise
            staged = writing.result()
        if final is not table and not final.equals(table):
            # Decided on the values after a hash collision, as pandas orders them: the file is written again.
            self._unstage(destination, staged)
            staged = destination.stage(target, token, final, self.file_format, template)
        return staged

    def _validated(self, claim: Claim, item: ExportItem, fingerprint: Fingerprint) -> pa.Table | TableStream:
        """The item's rows, read now if they are read lazily, checked against the schema and the claim's window: a
        whole table for a DataFrame, a stream of validated tables (checked while they are written) for batches.
        ``fingerprint`` accumulates the rows' source fingerprint (complete once a stream has been written)."""
        checks = dict(what=claim.logical_key, tenant=item.key.tenant, fingerprint=fingerprint)
        return self._checked(self._rows(claim, item), claim, checks)

    @staticmethod
    def _rows(claim: Claim, item: ExportItem):
        """The item's rows, read now if they are read lazily (after the claim: a source's failure is this key's)."""
        rows = item.frame
        if rows is None:
            raise LedgerError(
                f"{claim.logical_key} was completed when the asset planned this run but is claimable now; "
                "rerun to read its source"
            )
        if callable(rows) and not isinstance(rows, (pd.DataFrame, FrameBatches)):
            rows = rows()
        return rows

    def _checked(self, rows, claim: Claim, checks: dict) -> pa.Table | TableStream:
        if isinstance(rows, FrameBatches):
            return validate_batches(rows, self.schema, claim.window, **checks)
        return validate_frame(rows, self.schema, claim.window, **checks)

    def _manifest_template(self, claim: Claim, item: ExportItem) -> Manifest:
        return Manifest.build(
            logical_key=claim.logical_key,
            export=item.key.export,
            tenant=item.key.tenant,
            window=claim.window,
            row_count=0,
            sha256="",
            attempt_id=claim.attempt_id,
            fencing_token=claim.fencing_token,
            data_file=data_file_name(self.file_format),
            tz_database=claim.tz_database,
            revision=claim.revision,
            supersedes=claim.supersedes,
        )


#: A whole frame of at least this many rows is written while its ids are hashed and checked (on a second thread:
#: pyarrow's writers release the GIL); a smaller one is checked first, as a thread would cost more than it saves.
OVERLAP_ROWS = 50_000

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
    still exported; the failures are kept in ``batch.failures`` and then raised together (a library error as
    itself when it is the only one, else :class:`ExportBatchFailed` naming each key, in the library's own words:
    a source's or driver's message is withheld, it may quote customer data). A lost ledger stops at once.

    A run of several keys works in groups of ``group_size``: the group's keys are claimed in one ledger transaction
    (a lease and fencing token per key, as one by one), then each key is repaired, published or written (its source
    read after the claim), and the completions of the group's committed keys are recorded in one more transaction.
    Every guarantee of :func:`export_key` holds per key. A single key, and each streamed key
    (:class:`~export_ledger.frames.FrameBatches`, claimed right before it is read so that its lease covers its own
    export only), go through :func:`export_key`'s path one by one.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    data_file_name(file_format)
    log = log or _default_log
    exporter = _KeyExport(ledger, destination, batch.schema, file_format, log)
    group: list[ExportItem] = []
    for position, item in enumerate(batch.items):
        if len(batch.items) > 1 and not isinstance(item.frame, FrameBatches):
            group.append(item)
            if len(group) == group_size or position == len(batch.items) - 1:
                batch.results.extend(_export_group(exporter, group, attempt, batch.failures))
                group = []
            continue
        # A single key, or a streamed one: claimed alone, right before it is read.
        if group:
            batch.results.extend(_export_group(exporter, group, attempt, batch.failures))
            group = []
        try:
            batch.results.append(exporter.run(item, attempt))
        except LedgerUnavailable:
            raise
        except Exception as exc:
            _failed(log, batch.failures, item, exc)
    _raise_failures(batch)
    return batch.results


def _failed(log, failures: list[KeyFailure], item: ExportItem, exc: Exception) -> None:
    message = safe_message(exc)
    log("error", f"{item.key}: {message}")
    failures.append(KeyFailure(str(item.key), item.partition_key, item.key.tenant, type(exc).__name__, message, exc))


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


def _export_group(
    exporter: _KeyExport, group: list[ExportItem], attempt: str, failures: list[KeyFailure]
) -> list[ExportResult]:
    """One group of :func:`export_batch`: one claim transaction, the keys' effects, one completion transaction.

    On a publishing destination the effects go in two phases with their durability deferred (docs/protocol.md,
    "Group commit"): every key is fenced, verified and staged; one sync makes the staged data (and the pointers'
    bytes) durable; every key's pointer is moved; one more sync makes the moves durable; then the one completion
    commit. Returns the group's results in item order; appends each failed key to ``failures``.
    """
    ledger = exporter.ledger
    results: dict[int, ExportResult] = {}
    staged: list[tuple[int, Claim, _Staged]] = []
    unrecorded: list[tuple[int, Claim, str, CompletionEvidence]] = []
    recorded: list[tuple[int, str, ExportRecord]] = []
    pending = _Pending(exporter, group, failures, staged, unrecorded, recorded)
    contracts = {(i.key.export, i.key.tenant): i.contract for i in group if i.contract is not None}
    outcomes = ledger.claims.claim_many([item.key for item in group], attempt, contracts=contracts or None)
    claims: dict[int, Claim] = {}
    for i, (item, outcome) in enumerate(zip(group, outcomes, strict=True)):
        if isinstance(outcome, AlreadyCompleted):
            results[i] = exporter.skipped(outcome, item)
        elif isinstance(outcome, LedgerError):
            _failed(exporter.log, failures, item, outcome)
        else:
            claims[i] = outcome
    started = time.monotonic()  # only decides when to renew; the ledger's clock decides what a lease is
    destination = exporter.destination
    with destination.deferred():
        for i in sorted(claims):
            if time.monotonic() - started > exporter.ledger.lease_ttl.total_seconds() * RENEW_AFTER:
                # The keys staged so far are published, synced and recorded now (their leases are as old as the
                # rest), then the leases of the keys still to export are renewed.
                pending.flush()
                claims = _renewed(ledger, claims, i, group, failures, exporter)
                started = time.monotonic()
            if i not in claims:
                continue  # lost at a renewal (this key or a later one): its failure is recorded, the rest go on
            claim, item = claims[i], group[i]
            try:
                status, effect = exporter.stage(claim, item)
            except LedgerUnavailable:
                raise
            except Exception as exc:
                _failed(exporter.log, failures, item, exc)
                continue
            if isinstance(effect, ExportRecord):
                recorded.append((i, status, effect))
            elif isinstance(effect, _Staged):
                staged.append((i, claim, effect))
            else:
                unrecorded.append((i, claim, status, effect))  # a repair, or an unchanged restatement
        # Until this commit the group's exports are committed and not recorded: the case a repair already handles.
        pending.flush()
    for i, status, record in sorted(recorded, key=lambda entry: entry[0]):
        try:
            failpoints.reach("after_commit")
        except Exception as exc:
            _failed(exporter.log, failures, group[i], exc)
            continue
        results[i] = exporter.result(record, group[i], status, attempt, claims[i])
    return [results[i] for i in sorted(results)]


@dataclass
class _Pending:
    """A group's keys between their stage and their completion record: staged (invisible), then published and
    unrecorded, then recorded."""

    exporter: _KeyExport
    group: list[ExportItem]
    failures: list[KeyFailure]
    staged: list[tuple[int, Claim, _Staged]]
    unrecorded: list[tuple[int, Claim, str, CompletionEvidence]]
    recorded: list[tuple[int, str, ExportRecord]]

    def flush(self) -> None:
        """Sync, publish every staged key, sync, record: a pointer is never durable before the data it names, and a
        key is recorded only once its publish is durable (docs/protocol.md, "Group commit")."""
        exporter, destination = self.exporter, self.exporter.destination
        if self.staged:
            try:
                destination.sync()  # the staged data, manifests and pointers' bytes, before any pointer names them
            except Exception as exc:
                for i, claim, staged in self.staged:
                    self._lose(i, claim, staged, exc, None)
                self.staged.clear()
            for i, claim, staged in self.staged:
                try:
                    status, evidence = exporter.publish(claim, staged)
                except LedgerUnavailable:
                    raise
                except Exception as exc:
                    _failed(exporter.log, self.failures, self.group[i], exc)
                    continue
                self.unrecorded.append((i, claim, status, evidence))
            self.staged.clear()
        if self.unrecorded:
            try:
                failpoints.reach("before_group_sync")
                destination.sync()  # the pointer moves (and the evidence of repairs), before the ledger records them
                failpoints.reach("after_group_sync")
            except Exception as exc:
                for i, claim, _, evidence in self.unrecorded:
                    self._lose(i, claim, None, exc, evidence)
                self.unrecorded.clear()
        self._record()

    def _lose(self, i: int, claim: Claim, staged: _Staged | None, exc: Exception, evidence) -> None:
        try:
            self.exporter.lost(claim, self.group[i], staged, exc, evidence)
        except LedgerUnavailable:
            raise
        except Exception as recorded:
            _failed(self.exporter.log, self.failures, self.group[i], recorded)

    def _record(self) -> None:
        """Records the completions of the group's published keys in one transaction (and empties ``unrecorded``)."""
        exporter, ready = self.exporter, []
        for entry in self.unrecorded:
            try:
                failpoints.reach("before_commit")
            except Exception as exc:
                _failed(exporter.log, self.failures, self.group[entry[0]], exc)
                continue
            ready.append(entry)
        self.unrecorded.clear()
        committed = exporter.ledger.completions.complete_many([(claim, evidence) for _, claim, _, evidence in ready])
        for (i, _, status, _), record in zip(ready, committed, strict=True):
            if isinstance(record, FencedOut):
                _failed(exporter.log, self.failures, self.group[i], record)
            else:
                self.recorded.append((i, status, record))


def _renewed(ledger, claims: dict[int, Claim], start: int, group, failures, exporter) -> dict[int, Claim]:
    """The group's claims from ``start`` on, their leases renewed; a claim lost meanwhile is that key's failure."""
    waiting = [i for i in sorted(claims) if i >= start]
    kept = {i: claims[i] for i in claims if i < start}
    for i, renewed in zip(waiting, ledger.claims.renew_many([claims[i] for i in waiting]), strict=True):
        if isinstance(renewed, FencedOut):
            _failed(exporter.log, failures, group[i], renewed)
        else:
            kept[i] = renewed
    return kept
