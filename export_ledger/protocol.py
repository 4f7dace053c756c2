"""The write protocol for logical keys: the one function the I/O manager, the benchmarks and the harnesses call.

For each key (docs/protocol.md): **claim** it in the ledger (a lease and a fencing token, on the ledger's clock,
refused unless its window has ended and its calendar contract is the one in force); **fence** the destination with
the token when anyone held the key before; **verify** what the key's pointer names (an earlier attempt's commit is
recorded as a repair, never written twice); otherwise **read** the source (after the claim: a source failure is this
key's, recorded as ``failed`` with its details withheld), validate it against the window recorded at the first claim,
**sweep** places no pointer can ever name, **stage** the revision at this attempt's own place, **commit** it with the
pointer's compare-and-swap (the one step that changes what readers see, refused to a fenced attempt), and only then
**record** completion. On a transactional destination the rows and the completion record commit in one transaction
instead. Here the keys go in groups (one claim transaction, their effects, one completion transaction; one key is a
group of one); one key's steps are :mod:`export_ledger.steps`. Plain Python, no Dagster.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from export_ledger import failpoints
from export_ledger.destinations.base import Destination, DestinationError
from export_ledger.errors import ExportLedgerError, safe_message
from export_ledger.frames import ExportSchema, FrameBatches, data_file_name
from export_ledger.ledger import AlreadyCompleted, ExportLedger, ExportState, FencedOut, LedgerError, LedgerUnavailable
from export_ledger.runs import BatchOutcome, ExportBatch, ExportItem, ExportResult, KeyFailure, Rows
from export_ledger.stage import Stager
from export_ledger.steps import (
    ExportConflict,
    ExportOutcomeUnknown,
    FailureFinish,
    HeldKey,
    KeySteps,
    failure_finish,
    target_for,
)

__all__ = [
    "DEFAULT_GROUP_SIZE", "RENEW_AFTER", "BatchOutcome", "ExportBatch", "ExportBatchFailed", "ExportConflict",
    "ExportItem", "ExportOutcomeUnknown", "ExportResult", "FailureFinish", "KeyFailure", "Rows", "export_batch",
    "export_key", "failure_finish", "target_for",
]  # fmt: skip

_log = logging.getLogger("export_ledger")


class ExportBatchFailed(DestinationError):
    """Keys of one run failed; each is named with its error (in the library's own words), and every other key was
    still exported."""


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
    exporter = KeySteps(ledger, destination, Stager(schema, file_format, log or _default_log))
    failures: list[Exception] = []
    results = _Group(exporter, [item], attempt, lambda _, exc: failures.append(exc), deferred=False).run()
    if failures:
        raise failures[0]
    return results[0]


def _default_log(level: str, message: str) -> None:
    getattr(_log, level)(message)


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
    exporter = KeySteps(ledger, destination, Stager(batch.schema, file_format, log))
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
    commit. Its lists live for one :meth:`run`; each key in them is a frozen :class:`HeldKey`.
    """

    exporter: KeySteps
    items: list[ExportItem]
    attempt: str
    #: Told of each key that fails, with its error, as it fails.
    failed: Callable[[ExportItem, Exception], None]
    deferred: bool = True
    results: dict[int, ExportResult] = field(default_factory=dict)
    recorded: list[HeldKey] = field(default_factory=list)

    def run(self) -> list[ExportResult]:
        """The group's results in item order (each failed key was told to :attr:`failed`)."""
        exporter, ledger = self.exporter, self.exporter.ledger
        held = self._claimed()
        staged: list[HeldKey] = []  # staged, invisible, to publish
        unrecorded: list[HeldKey] = []  # published, repaired or unchanged: to make durable and record
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

    def _claimed(self) -> dict[int, HeldKey]:
        exporter, items = self.exporter, self.items
        contracts = {(i.key.export, i.key.tenant): i.contract for i in items if i.contract is not None}
        outcomes = exporter.ledger.claims.claim_many([i.key for i in items], self.attempt, contracts=contracts or None)
        held: dict[int, HeldKey] = {}
        for i, (item, outcome) in enumerate(zip(items, outcomes, strict=True)):
            if isinstance(outcome, AlreadyCompleted):
                self.results[i] = exporter.skipped(outcome, item)
            elif isinstance(outcome, LedgerError):
                self._fail(i, outcome)
            else:
                # A takeover's predecessor is not fenced until this attempt's fence lands (docs/protocol.md, step 2).
                held[i] = HeldKey(i, item, outcome, outcome.previous_state is not ExportState.IN_PROGRESS)
        return held

    def _settle(self, staged: list[HeldKey], unrecorded: list[HeldKey]) -> None:
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

    def _record(self, unrecorded: list[HeldKey]) -> None:
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

    def _renewed(self, held: dict[int, HeldKey], start: int) -> dict[int, HeldKey]:
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

    def _lose(self, held: HeldKey, exc: Exception) -> None:
        try:
            self.exporter.lose(held, exc)
        except LedgerUnavailable:
            raise
        except Exception as recorded:
            self._fail(held.index, recorded)

    def _fail(self, i: int, exc: Exception) -> None:
        self.failed(self.items[i], exc)
