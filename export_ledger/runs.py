"""The values one run of the protocol takes and gives: the keys to export (:class:`ExportItem`, gathered in an
:class:`ExportBatch`), and what happened to each (:class:`ExportResult`, :class:`KeyFailure`, settled on the batch
once as its :class:`BatchOutcome`)."""

from __future__ import annotations

import datetime as dt
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ForwardRef, TypeAlias

from export_ledger.frames import ExportSchema, FrameBatches
from export_ledger.keys import LogicalKey
from export_ledger.lazy import lazy_module
from export_ledger.ledger import ExportRecord
from export_ledger.sources import DEFAULT_BATCH_ROWS, ExportSource

pd = lazy_module("pandas", globals(), "pd")

#: A key's rows: a DataFrame (validated whole), batches (validated, written and hashed batch by batch), a reader
#: called after the key is claimed (the source is read only for a key that is exported), or None (found completed
#: when the run was planned: nothing read). pandas is named by a forward reference resolved in this module, so that
#: importing this module does not import pandas, and ``typing.get_type_hints`` of a user's function annotated with
#: ``Rows`` resolves it wherever that function is (a plain string would be evaluated in the user's module).
_DataFrame = ForwardRef("pd.DataFrame", module=__name__)
# typing.Callable: collections.abc.Callable's arguments are flattened when get_type_hints resolves the reference.
Rows: TypeAlias = _DataFrame | FrameBatches | typing.Callable[[], _DataFrame] | None


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


@dataclass(frozen=True)
class BatchOutcome:
    """What happened to every key of one run: the results in the order the keys were exported, and the failures."""

    results: tuple[ExportResult, ...] = ()
    failures: tuple[KeyFailure, ...] = ()


@dataclass
class ExportBatch:
    """Every (partition, tenant) key of one run, in the order they are exported, and once :func:`export_batch` has
    run, what happened to each (:attr:`outcome`, settled once)."""

    schema: ExportSchema
    items: list[ExportItem]
    #: Called by the I/O manager when the batch failed, once every other key is recorded and just before it fails the
    #: step: what the asset reports about the run (its checks' verdicts) must be said then, since a failed step never
    #: returns to the asset's code. Its argument says whether the export ran at all (False: it failed before, e.g. the
    #: destination could not be built, and the ledger alone holds the truth). None: nothing to say.
    on_failure: Callable[[bool], None] | None = field(default=None, repr=False, compare=False)
    #: What :func:`export_batch` did to each key of the batch, results and failures (None until it ran): settled once
    #: (:meth:`settle`), the one way its outcome reaches the asset that yielded the batch, since Dagster hands the
    #: I/O manager's work nothing back.
    outcome: BatchOutcome | None = field(default=None, init=False)

    def settle(self, outcome: BatchOutcome) -> None:
        if self.outcome is not None:
            raise ValueError("this batch was exported already: build a new ExportBatch for another run")
        self.outcome = outcome

    @property
    def results(self) -> tuple[ExportResult, ...]:
        return () if self.outcome is None else self.outcome.results

    @property
    def failures(self) -> tuple[KeyFailure, ...]:
        return () if self.outcome is None else self.outcome.failures
