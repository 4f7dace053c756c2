"""What the ledger reads and returns: records of logical runs and attempts, claims, and evidence. Plain data."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa

from export_ledger.calendar import ExportWindow
from export_ledger.ledger.schema import AttemptOutcome, ExportState


@dataclass(frozen=True)
class ExportRecord:
    """One row of ``export_runs``."""

    logical_key: str
    export: str
    tenant: str
    business_date: dt.date
    timezone: str
    window_start_utc: dt.datetime
    window_end_utc: dt.datetime
    tz_database: str
    state: ExportState
    location: str | None
    sha256: str | None
    row_count: int | None
    committed_attempt: str | None
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    attempt_started_at: dt.datetime | None
    fencing_token: int
    created_at: dt.datetime
    updated_at: dt.datetime
    #: Export claims since the key's last operator resolution or restatement request (schema version 6; None when
    #: the read did not select it).
    claim_count: int | None = None
    #: The contract the key was last claimed under (schema version 9; None before it, or when the read did not
    #: select it).
    contract_id: int | None = None

    @classmethod
    def from_row(cls, row: sa.Row) -> ExportRecord:
        values = {name: value for name, value in row._mapping.items() if name in _RECORD_FIELDS}
        values["state"] = ExportState(values["state"])
        return cls(**values)

    @property
    def window(self) -> ExportWindow:
        return ExportWindow(self.business_date, self.timezone, self.window_start_utc, self.window_end_utc)


_RECORD_FIELDS = frozenset(ExportRecord.__dataclass_fields__)


@dataclass(frozen=True)
class AttemptRecord:
    """One row of ``export_attempts``."""

    id: int
    attempt_id: str
    logical_key: str
    fencing_token: int | None
    started_at: dt.datetime
    finished_at: dt.datetime
    outcome: AttemptOutcome
    error_class: str | None
    error_message: str | None

    @classmethod
    def from_row(cls, row: sa.Row) -> AttemptRecord:
        values = dict(row._mapping)
        values["outcome"] = AttemptOutcome(values["outcome"])
        return cls(**values)


@dataclass(frozen=True)
class Claim:
    """A live lease on one logical key, proved by its fencing token.

    ``window`` is the window recorded at the key's first claim: retries export that window, whatever the calendar
    computes today.
    """

    logical_key: str
    attempt_id: str
    fencing_token: int
    window: ExportWindow
    started_at: dt.datetime
    lease_expires_at: dt.datetime
    previous_state: ExportState | None
    tz_database: str
    #: The revision this claim publishes: 1 for a key's first export, the open request's revision for a
    #: restatement (one more than any revision the key ever had or was asked for).
    revision: int = 1
    #: For a restatement, the key's current recorded revision, which it supersedes, and that revision's sha256.
    supersedes: tuple[int, str] | None = None
    #: For a hold: the key's ``updated_at`` before it (its "stuck since"), read under the hold's row lock, so that a
    #: holder that gives the key back unchanged restores it.
    previous_updated_at: dt.datetime | None = None

    @property
    def superseded_revision(self) -> int:
        """The revision the destination's pointer must name before this claim commits: the recorded current one for
        a restatement, 0 (nothing) for a first export."""
        return self.supersedes[0] if self.supersedes else 0


@dataclass(frozen=True)
class AlreadyCompleted:
    """The key was completed before this attempt: nothing to do."""

    record: ExportRecord


@dataclass(frozen=True)
class DaySummary:
    """How the keys of one business day stand over a set of tenants, counted by the database in one grouped read."""

    business_date: dt.date
    keys: int  # tenants with a row that day
    completed: int
    rows: int = 0  # rows exported by that day's completed keys


@dataclass(frozen=True)
class ListedKey:
    """A key as an event lists it (:meth:`~export_ledger.ledger.queries.Queries.first_keys`, of days whose keys are
    all completed): the columns it shows, without the lease, attempt and time columns a whole :class:`ExportRecord`
    parses."""

    logical_key: str
    tenant: str
    timezone: str
    business_date: dt.date
    row_count: int | None
    sha256: str | None
    location: str | None
    committed_attempt: str | None


@dataclass(frozen=True)
class CompletionEvidence:
    """What a destination says it holds for a key: enough to record completion.

    ``source_fingerprint`` is what the source held (:mod:`export_ledger.fingerprint`), known only to the attempt that
    read the source; evidence read back from a manifest (a repair, reconciliation) has None. ``unchanged``: a
    restatement found its data identical to the revision it supersedes and committed nothing; the evidence is that
    revision's, recorded again (:data:`~export_ledger.ledger.transitions.UNCHANGED`).
    """

    location: str
    sha256: str
    row_count: int
    attempt_id: str
    fencing_token: int
    source_fingerprint: str | None = None
    revision: int = 1
    unchanged: bool = False

    @classmethod
    def published(cls, location: str, manifest) -> CompletionEvidence:
        """The evidence of an export found published at ``location``, from its manifest (a repair, reconciliation,
        an operator's acceptance): no source fingerprint, since the source was not read."""
        return cls(
            location,
            manifest.sha256,
            manifest.row_count,
            manifest.attempt_id,
            manifest.fencing_token,
            revision=manifest.revision,
        )


@dataclass(frozen=True)
class Restatement:
    """One row of ``export_restatements``: a request to publish ``revision`` of a completed key (open until
    ``closed_at``; then ``outcome`` is ``published``, ``withdrawn``, or ``unchanged``: its data was the current
    revision's, and nothing was published)."""

    id: int
    logical_key: str
    export: str
    tenant: str
    business_date: dt.date
    revision: int
    reason: str
    requested_by: str
    requested_at: dt.datetime
    base_token: int
    closed_at: dt.datetime | None
    outcome: str | None

    @classmethod
    def from_row(cls, row: sa.Row) -> Restatement:
        return cls(**dict(row._mapping))


@dataclass(frozen=True)
class Revision:
    """One published revision of a key (a row of ``export_revisions``, or revision 1 read from ``export_runs`` for a
    key never restated)."""

    logical_key: str
    revision: int
    location: str
    sha256: str
    row_count: int
    supersedes_revision: int | None
    supersedes_sha256: str | None
    reason: str
    requested_by: str
    requested_at: dt.datetime
    published_by: str
    recorded_at: dt.datetime

    @classmethod
    def from_row(cls, row: sa.Row) -> Revision:
        values = dict(row._mapping)
        values.pop("id", None)
        return cls(**values)

    @classmethod
    def first(cls, record: ExportRecord) -> Revision:
        """Revision 1 of a completed key, from its ``export_runs`` row."""
        return cls(
            record.logical_key, 1, record.location, record.sha256, record.row_count, None, None, FIRST_EXPORT_REASON,
            record.committed_attempt, record.updated_at, record.committed_attempt, record.updated_at,
        )  # fmt: skip


#: The reason recorded for revision 1 (what the key's first export published).
FIRST_EXPORT_REASON = "first export"
