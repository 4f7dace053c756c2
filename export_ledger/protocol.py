"""The write protocol for one logical key: the one function the I/O manager, the benchmarks and the harnesses call.

For each key: claim it (lease + fencing token), look for an export an earlier attempt published and never recorded
(repair it from its manifest), otherwise validate the frame against the window recorded at the first claim, stage,
publish atomically, and only then record completion. On a transactional destination the rows and the completion
record commit in one transaction instead. Data and completion metadata become visible together; a key already
completed is skipped with no new effect. Plain Python, no Dagster.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Callable
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
    PublishedElsewhere,
    PublishingDestination,
    PublishOutcomeUnknown,
    TransactionalDestination,
)
from export_ledger.errors import safe_message
from export_ledger.fingerprint import Fingerprint
from export_ledger.frames import (
    ExportSchema,
    FrameBatches,
    Manifest,
    TableStream,
    data_file_name,
    validate_batches,
    validate_frame,
)
from export_ledger.keys import LogicalKey
from export_ledger.ledger import (
    AlreadyCompleted,
    Claim,
    CompletionEvidence,
    ExportLedger,
    ExportRecord,
    FencedOut,
    LedgerError,
    LedgerUnavailable,
)
from export_ledger.sources import DEFAULT_BATCH_ROWS, ExportSource

_log = logging.getLogger("export_ledger")


class ExportConflict(DestinationConflict):
    """The destination holds a different export at this key's location; an operator must look."""


class ExportBatchFailed(DestinationError):
    """Several keys of one run failed; each is named with its error, and every other key was still exported."""


class ExportOutcomeUnknown(DestinationError):
    """The destination may or may not hold the export; the key is ``remote_unknown`` until reconciled."""


@dataclass(frozen=True)
class ExportItem:
    """One logical key to export.

    ``frame`` is the key's rows: one DataFrame (validated whole, sorted if needed), or
    :class:`~export_ledger.frames.FrameBatches` (validated, written and hashed batch by batch with bounded memory;
    the rows must arrive in file order, see :func:`~export_ledger.frames.validate_batches`), or None when the key was
    found completed and nothing was read.
    """

    key: LogicalKey
    partition_key: str
    frame: pd.DataFrame | FrameBatches | None

    @classmethod
    def streamed(
        cls,
        key: LogicalKey,
        partition_key: str,
        source: ExportSource,
        schema: ExportSchema,
        *,
        batch_rows: int = DEFAULT_BATCH_ROWS,
    ) -> ExportItem:
        """An item whose rows are read from ``source`` in batches of ``batch_rows`` while they are exported.

        Nothing is read until the export runs (and never for a key found completed).
        """
        start, end = key.window.start_utc, key.window.end_utc
        return cls(key, partition_key, FrameBatches(_LazyBatches(source, key.tenant, start, end, schema, batch_rows)))


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
    status: str  # exported | repaired | already_completed
    location: str
    sha256: str
    row_count: int
    committed_attempt: str
    #: The revision this attempt published or repaired (N + 1 for a restatement); 1 for ``already_completed``,
    #: whose current revision is not looked up (the ledger's ``current_revision`` has it).
    revision: int = 1

    @classmethod
    def of(cls, record: ExportRecord, partition_key: str, status: str, revision: int = 1) -> ExportResult:
        return cls(
            record.logical_key,
            partition_key,
            record.tenant,
            status,
            record.location,
            record.sha256,
            record.row_count,
            record.committed_attempt,
            revision,
        )


@dataclass
class ExportBatch:
    """Every (partition, tenant) key of one run, in the order they are exported, and what happened to each."""

    schema: ExportSchema
    items: list[ExportItem]
    results: list[ExportResult] = field(default_factory=list)


def target_for(key: LogicalKey, revision: int = 1) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision)


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
        schema: The export's columns and rules; the frame is validated against it and the key's window.
        item: The key and its source frame (None when the caller found it completed and read nothing).
        attempt: This attempt's id (a Dagster run id and step key).
        file_format: ``csv`` or ``parquet``.
        log: ``log(level, message)``; default the ``export_ledger`` logger.

    Returns:
        What happened: ``exported``, ``repaired`` (an earlier attempt's export was recorded) or
        ``already_completed``.

    Raises:
        ExportOutcomeUnknown: the destination may hold the export; the key is ``remote_unknown`` until reconciled.
        ExportConflict: the destination holds something else at the key's place; the key is ``conflict``.
        LedgerError: the ledger refused the claim (held lease, unknown outcome, conflict, below the low-water mark)
            or this attempt lost its lease before committing (``FencedOut``).
        Any other error: the key is ``failed`` (safe to retry) and the error is raised again.
    """
    data_file_name(file_format)
    return _KeyExport(ledger, destination, schema, file_format, log or _default_log).run(item, attempt)


def _default_log(level: str, message: str) -> None:
    getattr(_log, level)(message)


@dataclass
class _KeyExport:
    ledger: ExportLedger
    destination: Destination
    schema: ExportSchema
    file_format: str
    log: Callable[[str, str], None]

    def run(self, item: ExportItem, attempt: str) -> ExportResult:
        outcome = self.ledger.claim(item.key, attempt)
        if isinstance(outcome, AlreadyCompleted):
            return self.skipped(outcome, item)
        claim = outcome
        status, effect = self.effect(claim, item)
        if isinstance(effect, ExportRecord):
            record = effect  # a transactional destination recorded it with its rows
        else:
            failpoints.reach("before_commit")
            record = self.ledger.complete(claim, effect)
        failpoints.reach("after_commit")
        return self.result(record, item, status, attempt, claim.revision)

    def skipped(self, outcome: AlreadyCompleted, item: ExportItem) -> ExportResult:
        record = outcome.record
        self.log(
            "info",
            f"{record.logical_key} already completed by attempt {record.committed_attempt}; skipped, no new effect",
        )
        return ExportResult.of(record, item.partition_key, "already_completed")

    def result(
        self, record: ExportRecord, item: ExportItem, status: str, attempt: str, revision: int = 1
    ) -> ExportResult:
        if status != "exported":
            self.log(
                "info",
                f"{record.logical_key} {status}: {record.row_count} rows at {record.location} (attempt {attempt})",
            )
        return ExportResult.of(record, item.partition_key, status, revision)

    def effect(self, claim: Claim, item: ExportItem) -> tuple[str, ExportRecord | CompletionEvidence]:
        """Everything between a key's claim and its completion record: the repair, publish or transactional write.

        Returns the status and either the committed record (a transactional destination commits rows and record
        together) or the evidence of the published export, still to be recorded. A failure is recorded on the key
        (``failed``, ``conflict`` or ``remote_unknown``) and raised again.
        """
        ledger = self.ledger
        target = target_for(item.key, claim.revision)
        try:
            failpoints.reach("after_claim")
            if not _same_window(claim, item.key):
                raise LedgerError(
                    f"{claim.logical_key} was first claimed for [{utc_iso(claim.window.start_utc)}, "
                    f"{utc_iso(claim.window.end_utc)}) but this attempt read its source for "
                    f"[{utc_iso(item.key.window.start_utc)}, {utc_iso(item.key.window.end_utc)}); nothing exported"
                )
            existing = self.destination.probe(target)
            if isinstance(self.destination, TransactionalDestination):
                if existing is not None:
                    raise ExportConflict(
                        f"{self.destination.location(target)} already holds {existing.logical_key} although the "
                        f"ledger has no completion for {claim.logical_key}"
                    )
                return "exported", self._write_in_transaction(claim, item, target)
            if existing is not None:
                evidence = self._evidence_from(existing, claim, target)
                self.log(
                    "warning",
                    f"{claim.logical_key} was published by attempt {existing.attempt_id} but never recorded; "
                    "recording it from its manifest instead of writing a second copy",
                )
                self._move_current(claim, target, existing)
                return "repaired", evidence
            evidence, manifest = self._publish(claim, item, target)
            self._move_current(claim, target, manifest)
            # Publishing can meet another attempt's export (a fenced owner's late upload): that is a repair.
            return ("exported" if evidence.attempt_id == claim.attempt_id else "repaired"), evidence
        except PublishOutcomeUnknown as exc:
            ledger.mark_remote_unknown(
                claim, exc, sha256=getattr(exc, "intended_sha256", None), location=self.destination.location(target)
            )
            raise ExportOutcomeUnknown(
                f"{claim.logical_key}: the outcome at the destination is unknown ({exc}). The key is now "
                "remote_unknown; reconciliation (the reconciliation sensor, or `export-ledger reconcile`) will resolve "
                "it from the destination's evidence. Retrying before then is refused, because a blind retry could "
                "export it twice."
            ) from exc
        except FencedOut:
            raise  # this attempt no longer owns the key: it records nothing more
        except DestinationConflict as exc:
            # Never retried blindly: an operator must look at the destination.
            ledger.mark_conflict(claim, exc, location=self.destination.location(target))
            raise
        except Exception as exc:
            ledger.fail(claim, exc)
            raise

    def _move_current(self, claim: Claim, target: ExportTarget, manifest: Manifest) -> None:
        """A restatement's revision is published: the key's current pointer moves to it before the ledger records
        it, so a completed revision is always the current one. A move whose outcome is unknown hands the key to
        reconciliation (which moves it again, idempotently); a pointer someone else moved is a conflict."""
        if claim.revision == 1:
            return
        assert claim.supersedes is not None
        try:
            self.destination.move_current(target, manifest, supersedes=claim.supersedes[0])
            failpoints.reach("after_current")
        except DestinationConflict:
            raise
        except PublishOutcomeUnknown as exc:
            exc.intended_sha256 = manifest.sha256
            raise
        except Exception as exc:
            # The revision is published: the key is not `failed` (nothing published) but unrecorded.
            unrecorded = PublishOutcomeUnknown(
                f"published {self.destination.location(target)}, then could not make it current ({safe_message(exc)})"
            )
            unrecorded.intended_sha256 = manifest.sha256
            raise unrecorded from exc

    def _publish(self, claim: Claim, item: ExportItem, target: ExportTarget) -> tuple[CompletionEvidence, Manifest]:
        destination = self.destination
        if not isinstance(destination, PublishingDestination):
            raise DestinationError(f"{destination.describe()} cannot publish exports")
        if item.frame is None:
            raise LedgerError(
                f"{claim.logical_key} was completed when the asset planned this run but is claimable now; "
                "rerun to read its source"
            )
        fingerprint = Fingerprint(self.schema.id_columns, self.schema.version_column)
        table = self._validated(claim, item, fingerprint)
        destination.discard_abandoned(target, claim.fencing_token, min_age=self.ledger.lease_ttl)
        template = self._manifest_template(claim, item)
        staged = destination.stage(target, table, self.file_format, template)
        try:
            failpoints.reach("after_stage")
            published = destination.publish(staged)
        except PublishedElsewhere as exc:
            destination.discard(staged)
            return self._evidence_from(exc.manifest, claim, target), exc.manifest
        except PublishOutcomeUnknown as exc:
            exc.intended_sha256 = staged.manifest.sha256
            destination.discard(staged)
            raise
        except Exception:
            destination.discard(staged)
            raise
        try:
            failpoints.reach("after_publish")
        except Exception as exc:
            # The export is at the destination now: this key is not `failed` (nothing published) but unrecorded.
            # remote_unknown hands it to reconciliation, which records it from the destination's evidence.
            unrecorded = PublishOutcomeUnknown(
                f"published {destination.location(target)}, then failed before recording it ({safe_message(exc)})"
            )
            unrecorded.intended_sha256 = published.sha256
            raise unrecorded from exc
        evidence = CompletionEvidence(
            location=destination.location(target),
            sha256=published.sha256,
            row_count=published.row_count,
            attempt_id=published.attempt_id,
            fencing_token=published.fencing_token,
            # The stream (if any) was written whole by now: the fingerprint covers every row published.
            source_fingerprint=fingerprint.encode(),
            revision=published.revision,
        )
        return evidence, published

    def _write_in_transaction(self, claim: Claim, item: ExportItem, target: ExportTarget) -> ExportRecord:
        """Rows and completion record in one ledger transaction: both commit or neither."""
        if item.frame is None:
            raise LedgerError(f"{claim.logical_key} was planned as completed but is claimable now; rerun it")
        fingerprint = Fingerprint(self.schema.id_columns, self.schema.version_column)
        table = self._validated(claim, item, fingerprint)
        if isinstance(table, TableStream):
            # The rows go into the ledger's database in the completion transaction, one statement for the key: a
            # stream is validated batch by batch, then gathered into one table (bounded memory is for files).
            tables = list(table)
            table = pa.concat_tables(tables) if tables else table.schema.empty_table()
        template = self._manifest_template(claim, item)

        def effect(connection) -> CompletionEvidence:
            written = self.destination.write_in_transaction(connection, target, table, template)
            failpoints.reach("before_commit")  # inside the transaction: a failure here rolls the rows back too
            location = self.destination.location(target)
            return CompletionEvidence(
                location,
                written.sha256,
                written.row_count,
                claim.attempt_id,
                claim.fencing_token,
                source_fingerprint=fingerprint.encode(),
                revision=written.revision,
            )

        return self.ledger.complete_within(claim, effect)

    def _validated(self, claim: Claim, item: ExportItem, fingerprint: Fingerprint) -> pa.Table | TableStream:
        """The item's rows checked against the schema and the claim's window: a whole table for a DataFrame, a stream
        of validated tables (checked while they are written) for :class:`~export_ledger.frames.FrameBatches`.
        ``fingerprint`` accumulates the rows' source fingerprint (complete once a stream has been written)."""
        checks = dict(what=claim.logical_key, tenant=item.key.tenant, fingerprint=fingerprint)
        if isinstance(item.frame, FrameBatches):
            return validate_batches(item.frame, self.schema, claim.window, **checks)
        return validate_frame(item.frame, self.schema, claim.window, **checks)

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

    def _evidence_from(self, manifest: Manifest, claim: Claim, target: ExportTarget) -> CompletionEvidence:
        """Turns a manifest found at the target into completion evidence, after checking it is this key's export."""
        location = self.destination.location(target)
        if manifest.logical_key != claim.logical_key:
            raise ExportConflict(
                f"{location} holds the export of {manifest.logical_key}, not {claim.logical_key}; "
                "refusing to overwrite it or to record it as this key"
            )
        if manifest.revision != target.revision:
            raise ExportConflict(
                f"{location} holds revision {manifest.revision} of {claim.logical_key}, not revision "
                f"{target.revision}; refusing to record it as this revision"
            )
        actual = hashlib.sha256(self.destination.read_data(target, manifest)).hexdigest()
        if actual != manifest.sha256:
            raise ExportConflict(
                f"{location}: data file sha256 {actual} does not match its manifest ({manifest.sha256})"
            )
        return CompletionEvidence.published(location, manifest)


#: Keys claimed together in one ledger transaction, and completed together in one more, by :func:`export_batch`.
#: Bounded because every lease of a group starts at the group's claim: a group must be exported within the lease
#: (15 minutes by default) or reconciliation may take its last keys back, and a crash before a group's completion
#: commit leaves at most this many keys to be repaired from their manifests.
DEFAULT_GROUP_SIZE = 50


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
    still exported, and then the failures are raised together (one error as itself, several as
    :class:`ExportBatchFailed` naming each key). A lost ledger stops at once: nothing else could be recorded.

    A run of several keys works in groups of ``group_size``: the group's keys are claimed in one ledger transaction
    (:meth:`~export_ledger.ledger.ExportLedger.claim_many`: a lease and fencing token per key, as one by one), then
    each key is repaired, published or written, and the completions of the group's published keys are recorded in
    one more transaction (:meth:`~export_ledger.ledger.ExportLedger.complete_many`). Every guarantee of
    :func:`export_key` holds per key: a crash between a publish and its group's commit leaves the key ``in_progress``
    with its export published, which the next claim repairs from the manifest (never a second copy); a key whose
    lease was taken over is fenced, alone; refused, already-completed and failed keys are reported as one by one.
    The failpoints fire per key at the same places (``before_commit`` after the key's publish, ``after_commit``
    after its group's commit). A single key, and each streamed key (:class:`~export_ledger.frames.FrameBatches`,
    claimed right before it is read so that its lease covers its own export only), go through :func:`export_key`'s
    path one by one.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    data_file_name(file_format)
    log = log or _default_log
    failures: list[tuple[str, Exception]] = []
    exporter = _KeyExport(ledger, destination, batch.schema, file_format, log)
    group: list[ExportItem] = []
    for position, item in enumerate(batch.items):
        if len(batch.items) > 1 and not isinstance(item.frame, FrameBatches):
            group.append(item)
            if len(group) == group_size or position == len(batch.items) - 1:
                batch.results.extend(_export_group(exporter, group, attempt, failures))
                group = []
            continue
        # A single key, or a streamed one: claimed alone, right before it is read. A streamed key is large by
        # nature (minutes of reading), so a lease taken with a group's could run out before its turn came, while
        # one ledger commit is nothing beside its export.
        if group:
            batch.results.extend(_export_group(exporter, group, attempt, failures))
            group = []
        try:
            batch.results.append(exporter.run(item, attempt))
        except LedgerUnavailable:
            raise
        except Exception as exc:
            log("error", f"{item.key}: {safe_message(exc)}")
            failures.append((str(item.key), exc))
    if len(failures) == 1:
        raise failures[0][1]
    if failures:
        summary = "; ".join(f"{key}: {safe_message(exc)}" for key, exc in failures)
        raise ExportBatchFailed(f"{len(failures)} of {len(batch.items)} export keys failed ({summary})") from failures[
            0
        ][1]
    return batch.results


def _export_group(
    exporter: _KeyExport, group: list[ExportItem], attempt: str, failures: list[tuple[str, Exception]]
) -> list[ExportResult]:
    """One group of :func:`export_batch`: one claim transaction, the keys' effects, one completion transaction.

    Returns the group's results in item order; appends each failed key, with its error, to ``failures``.
    """
    ledger, log = exporter.ledger, exporter.log
    results: dict[int, ExportResult] = {}
    unrecorded: list[tuple[int, Claim, str, CompletionEvidence]] = []
    recorded: list[tuple[int, str, ExportRecord]] = []

    def failed(i: int, exc: Exception) -> None:
        log("error", f"{group[i].key}: {safe_message(exc)}")
        failures.append((str(group[i].key), exc))

    outcomes = ledger.claim_many([item.key for item in group], attempt)
    for i, (item, outcome) in enumerate(zip(group, outcomes, strict=True)):
        if isinstance(outcome, AlreadyCompleted):
            results[i] = exporter.skipped(outcome, item)
            continue
        if isinstance(outcome, LedgerError):
            failed(i, outcome)
            continue
        try:
            status, effect = exporter.effect(outcome, item)
            if isinstance(effect, ExportRecord):
                recorded.append((i, status, effect))
                continue
            failpoints.reach("before_commit")
        except LedgerUnavailable:
            raise
        except Exception as exc:
            failed(i, exc)
            continue
        unrecorded.append((i, outcome, status, effect))

    # Until this commit the group's exports are published and not recorded: the case repair already handles.
    committed = ledger.complete_many([(claim, evidence) for _, claim, _, evidence in unrecorded])
    for (i, _, status, _), record in zip(unrecorded, committed, strict=True):
        if isinstance(record, FencedOut):
            failed(i, record)
        else:
            recorded.append((i, status, record))
    for i, status, record in sorted(recorded, key=lambda entry: entry[0]):
        try:
            failpoints.reach("after_commit")
        except Exception as exc:
            failed(i, exc)
            continue
        results[i] = exporter.result(record, group[i], status, attempt, outcomes[i].revision)
    return [results[i] for i in sorted(results)]
