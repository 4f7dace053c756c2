"""The ledger's tables, written once with SQLAlchemy Core for SQLite and PostgreSQL.

Invariants live in the schema where a database can hold them: one row per logical key, one row per
(export, tenant, zone, business date), states from a closed list, and the fields a state needs are present.
"""

from __future__ import annotations

import datetime as dt
import enum

import sqlalchemy as sa

UTC = dt.timezone.utc


class ExportState(str, enum.Enum):
    """Where one logical export stands. No row at all means it was never attempted."""

    IN_PROGRESS = "in_progress"  # an attempt holds the lease; it may be writing right now
    FAILED = "failed"  # the last attempt failed before anything was published: safe to retry
    COMPLETED = "completed"  # published and recorded; never exported again
    REMOTE_UNKNOWN = "remote_unknown"  # the destination may or may not hold the export: reconcile before retrying
    CONFLICT = "conflict"  # the destination holds something else at this key's place: an operator must decide


class AttemptOutcome(str, enum.Enum):
    """How one attempt on one logical key ended. Attempt rows are written once and never changed."""

    COMPLETED = "completed"  # this attempt published and committed the export
    REPAIRED = "repaired"  # this attempt found an earlier attempt's published export and recorded it
    FAILED = "failed"  # failed before publishing; the key went to `failed`
    REMOTE_UNKNOWN = "remote_unknown"  # the write's outcome at the destination is unknown
    REFUSED = "refused"  # another attempt held a live lease, or the key needs reconciliation first
    ALREADY_COMPLETED = "already_completed"  # the key was already completed; nothing was done
    ABANDONED = "abandoned"  # the attempt's lease expired without a result (crashed or stalled worker)
    FENCED = "fenced"  # the attempt lost its lease to a newer one and was not allowed to commit
    CONFLICT = "conflict"  # reconciliation found a different export at the destination; nothing was overwritten


class UtcDateTime(sa.types.TypeDecorator):
    """Accepts only timezone-aware datetimes, stores them in UTC, and returns them UTC-aware on every backend."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        value = _in_utc(value)
        # SQLite has no time zone type: store naive UTC text, which also sorts correctly.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def bind_processor(self, dialect):
        if dialect.name != "sqlite":
            return super().bind_processor(dialect)

        def process(value):
            # The text SQLAlchemy's SQLite DATETIME stores ("YYYY-MM-DD HH:MM:SS.ffffff", naive UTC), made in one
            # step: a claim and a completion bind about ten times a key, and this type's conversion followed by
            # DATETIME's %-formatting was 15% of a group's time (benchmarks/profiles/ledger-groups.txt).
            return None if value is None else _in_utc(value).replace(tzinfo=None).isoformat(" ", "microseconds")

        return process

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _in_utc(value) -> dt.datetime:
    if not isinstance(value, dt.datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"the ledger stores timezone-aware datetimes only, got {value!r}")
    return value if value.tzinfo is UTC else value.astimezone(UTC)


def _in(column: str, values) -> sa.CheckConstraint:
    allowed = ", ".join(f"'{v.value}'" for v in values)  # constants from the enums above, never user input
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=f"ck_{column}_known")


metadata = sa.MetaData()

export_runs = sa.Table(
    "export_runs",
    metadata,
    sa.Column("logical_key", sa.String(300), primary_key=True),
    sa.Column("export", sa.String(63), nullable=False),
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("business_date", sa.Date, nullable=False),
    sa.Column("timezone", sa.String(64), nullable=False),
    sa.Column("window_start_utc", UtcDateTime, nullable=False),
    sa.Column("window_end_utc", UtcDateTime, nullable=False),
    sa.Column("tz_database", sa.String(64), nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("location", sa.String(1024)),
    sa.Column("sha256", sa.String(64)),
    sa.Column("row_count", sa.BigInteger),
    sa.Column("committed_attempt", sa.String(300)),
    sa.Column("lease_owner", sa.String(300)),
    sa.Column("lease_expires_at", UtcDateTime),
    sa.Column("attempt_started_at", UtcDateTime),
    sa.Column("fencing_token", sa.BigInteger, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("updated_at", UtcDateTime, nullable=False),
    # Schema version 4: what the key's source held when it completed (export_ledger.fingerprint): counts and
    # digests, never values. NULL for keys completed before version 4 and for keys repaired from a manifest.
    sa.Column("source_fingerprint", sa.String(120)),
    # Schema version 6: export claims since the key's last operator resolution or restatement request (a claim that
    # only holds the key, by reconciliation or an operator, does not count). Automatic reruns stop at a limit of it.
    sa.Column("claim_count", sa.Integer, nullable=False, server_default="0"),
    # Schema version 9: the export_contracts row in force when an attempt last claimed the key to export it (NULL
    # before version 9): operator commands act on the destination it records (export_ledger.contract).
    sa.Column("contract_id", sa.BigInteger),
    sa.UniqueConstraint("export", "tenant", "timezone", "business_date", name="uq_export_runs_business_day"),
    _in("state", ExportState),
    sa.CheckConstraint("window_end_utc >= window_start_utc", name="ck_window_ordered"),
    sa.CheckConstraint(
        "state <> 'completed' OR (location IS NOT NULL AND sha256 IS NOT NULL AND row_count IS NOT NULL"
        " AND committed_attempt IS NOT NULL)",
        name="ck_completed_has_evidence",
    ),
    sa.CheckConstraint(
        "state <> 'in_progress' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="ck_in_progress_has_lease",
    ),
    # Reconciliation reads stuck keys by state in key order, so a tick costs what is stuck, not what is stored.
    sa.Index("ix_export_runs_state", "state", "lease_expires_at"),
    sa.Index("ix_export_runs_state_key", "state", "logical_key"),
    sa.Index("ix_export_runs_export_date", "export", "business_date"),
    sa.Index("ix_export_runs_committed_attempt", "committed_attempt"),
    # Schema version 6: pages of failed and stuck keys per export and partition read this index, not every row.
    sa.Index("ix_export_runs_state_export_date", "state", "export", "business_date", "timezone"),
    sa.Index("ix_export_runs_state_updated", "state", "updated_at"),
    # Schema 8: every column of the sensor's per-day summaries, read from the index alone (migration v8).
    sa.Index("ix_export_runs_day_summary", "export", "timezone", "business_date", "state", "row_count", "tenant"),
)

export_attempts = sa.Table(
    "export_attempts",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("attempt_id", sa.String(300), nullable=False),
    sa.Column(
        "logical_key", sa.String(300), sa.ForeignKey("export_runs.logical_key", ondelete="RESTRICT"), nullable=False
    ),
    sa.Column("fencing_token", sa.BigInteger),
    sa.Column("started_at", UtcDateTime, nullable=False),
    sa.Column("finished_at", UtcDateTime, nullable=False),
    sa.Column("outcome", sa.String(20), nullable=False),
    sa.Column("error_class", sa.String(200)),
    sa.Column("error_message", sa.String(500)),
    _in("outcome", AttemptOutcome),
    sa.CheckConstraint("finished_at >= started_at", name="ck_attempt_ordered"),
    sa.Index("ix_export_attempts_key", "logical_key", "id"),
)

# Retention: completed rows older than a horizon may be pruned; the horizon is kept here for good, so an old retry
# cannot mistake a pruned key for one never attempted and export it again.
export_low_water = sa.Table(
    "export_low_water",
    metadata,
    sa.Column("export", sa.String(63), primary_key=True),
    sa.Column("low_water_date", sa.Date, nullable=False),  # business dates before it are closed to new claims
    sa.Column("pruned_total", sa.BigInteger, nullable=False),
    sa.Column("updated_at", UtcDateTime, nullable=False),
)

# The contract each export's tenants are exported under (export_ledger.contract): the calendar (zone, start date,
# cadence, window policy, earlier zones) and, from schema version 9, the terms (destination, file format, schema,
# source, version). Append-only: the latest row is in force; a new row is written only by a first claim or by an
# operator's acceptance.
export_contracts = sa.Table(
    "export_contracts",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("export", sa.String(63), nullable=False),
    sa.Column("contract", sa.Text, nullable=False),  # canonical JSON
    sa.Column("recorded_at", UtcDateTime, nullable=False),
    sa.Column("reason", sa.String(500), nullable=False),
    # Schema version 9: the tenant a row is for (NULL: export-wide), also named in its JSON: a claim reads its tenants'
    # latest rows by it instead of every row of the export.
    sa.Column("tenant", sa.String(63)),
    sa.Index("ix_export_contracts_export", "export", "id"),
    sa.Index("ix_export_contracts_tenant", "export", "tenant", "id"),
)

# Operators' decisions that concern no single key's attempt (a prune that closes dates never exported): who, what,
# why. Append-only. Resolutions of one key are recorded in export_attempts as well.
export_operator_log = sa.Table(
    "export_operator_log",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("recorded_at", UtcDateTime, nullable=False),
    sa.Column("operator", sa.String(200), nullable=False),
    sa.Column("action", sa.String(40), nullable=False),
    sa.Column("export", sa.String(63)),
    sa.Column("logical_key", sa.String(300)),
    sa.Column("detail", sa.String(1000), nullable=False),
    sa.Column("reason", sa.String(500), nullable=False),
)

# Keys whose source no longer matches what was exported (export_ledger.drift): counts only, never values. A stale key
# stays `completed` in export_runs (a state CHECK constraint cannot be altered on SQLite); it is stale while it has a
# record here with cleared_at NULL. A record is never rewritten: a different drift closes it and opens a new one.
export_drift = sa.Table(
    "export_drift",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("logical_key", sa.String(300), nullable=False),
    sa.Column("export", sa.String(63), nullable=False),
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("business_date", sa.Date, nullable=False),
    sa.Column("detected_at", UtcDateTime, nullable=False),
    sa.Column("rows_added", sa.BigInteger, nullable=False),
    sa.Column("rows_removed", sa.BigInteger, nullable=False),
    sa.Column("rows_changed", sa.BigInteger),  # NULL: unknown (the export declares no version column)
    sa.Column("source_fingerprint", sa.String(120), nullable=False),  # the source as found at detection
    sa.Column("cleared_at", UtcDateTime),
    # At most one open record per key.
    sa.Index(
        "uq_export_drift_open",
        "logical_key",
        unique=True,
        sqlite_where=sa.text("cleared_at IS NULL"),
        postgresql_where=sa.text("cleared_at IS NULL"),
    ),
    sa.Index("ix_export_drift_export", "export", "cleared_at"),
)

# Schema version 5: restatements. A restatement publishes revision N + 1 of a completed key beside revision N, which
# stays readable; nothing is overwritten. A request is recorded first (at most one open per key); the key's next claim
# takes it from `completed` back through the usual claim, lease and fencing to `completed` with the new revision.
export_restatements = sa.Table(
    "export_restatements",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("logical_key", sa.String(300), nullable=False),
    sa.Column("export", sa.String(63), nullable=False),
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("business_date", sa.Date, nullable=False),
    sa.Column("revision", sa.Integer, nullable=False),  # the revision this request will publish
    sa.Column("reason", sa.String(500), nullable=False),
    sa.Column("requested_by", sa.String(300), nullable=False),  # an operator, or the drift sensor
    sa.Column("requested_at", UtcDateTime, nullable=False),
    sa.Column("base_token", sa.BigInteger, nullable=False),  # the key's fencing token at the request: reruns count on
    sa.Column("closed_at", UtcDateTime),
    # published | withdrawn | unchanged (schema version 7: the new data was the current revision's), once closed
    sa.Column("outcome", sa.String(20)),
    sa.CheckConstraint("revision >= 2", name="ck_restatement_revision"),
    sa.CheckConstraint(
        "(closed_at IS NULL AND outcome IS NULL) OR "
        "(closed_at IS NOT NULL AND outcome IN ('published', 'withdrawn', 'unchanged'))",
        name="ck_restatement_closed",
    ),
    sa.Index(
        "uq_export_restatements_open",
        "logical_key",
        unique=True,
        sqlite_where=sa.text("closed_at IS NULL"),
        postgresql_where=sa.text("closed_at IS NULL"),
    ),
    sa.Index("ix_export_restatements_export", "export", "closed_at"),
    # Schema version 6: a revision number is given to one request of a key that is open or published (the code gives
    # a number once, whatever became of it; releases before 0.5 gave a withdrawn request's number again, and those
    # withdrawn rows are kept as they are).
    sa.Index(
        "uq_export_restatements_key_revision",
        "logical_key",
        "revision",
        unique=True,
        sqlite_where=sa.text("outcome IS NULL OR outcome = 'published'"),
        postgresql_where=sa.text("outcome IS NULL OR outcome = 'published'"),
    ),
)

# Every published revision of a key, append-only. Keys never restated have no row: their one revision is the
# export_runs row. The first restatement request writes revision 1's row from export_runs, so the history is whole.
export_revisions = sa.Table(
    "export_revisions",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("logical_key", sa.String(300), nullable=False),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("location", sa.String(1024), nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("row_count", sa.BigInteger, nullable=False),
    sa.Column("supersedes_revision", sa.Integer),
    sa.Column("supersedes_sha256", sa.String(64)),
    sa.Column("reason", sa.String(500), nullable=False),
    sa.Column("requested_by", sa.String(300), nullable=False),
    sa.Column("requested_at", UtcDateTime, nullable=False),
    sa.Column("published_by", sa.String(300), nullable=False),  # the attempt whose export it is
    sa.Column("recorded_at", UtcDateTime, nullable=False),
    sa.UniqueConstraint("logical_key", "revision", name="uq_export_revisions_key_revision"),
    sa.CheckConstraint("revision >= 1", name="ck_revision_positive"),
)

# Schema version 6: a tenant whose calendar contract in code differs from the one the ledger holds is refused at
# claim; the refusal is kept here (one open row per tenant) so that it is escalated to a person until an operator
# accepts a contract (which closes it) or the code goes back to the recorded one (the next claim closes it).
export_contract_refusals = sa.Table(
    "export_contract_refusals",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("export", sa.String(63), nullable=False),
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("recorded", sa.Text, nullable=False),  # canonical JSON of the contract in force
    sa.Column("wanted", sa.Text, nullable=False),  # canonical JSON of the contract the code asked for
    sa.Column("first_refused_at", UtcDateTime, nullable=False),
    sa.Column("last_refused_at", UtcDateTime, nullable=False),
    sa.Column("refusals", sa.Integer, nullable=False),
    sa.Column("closed_at", UtcDateTime),
    # The zone the code names (the group a refusal is counted in), and the business dates whose claims were refused:
    # once the refusal closes, those dates are launched again (``relaunch_pending`` until each has a key).
    sa.Column("timezone", sa.String(63)),
    sa.Column("first_date", sa.Date),
    sa.Column("last_date", sa.Date),
    sa.Column("relaunch_pending", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Index(
        "uq_export_contract_refusals_open",
        "export",
        "tenant",
        unique=True,
        sqlite_where=sa.text("closed_at IS NULL"),
        postgresql_where=sa.text("closed_at IS NULL"),
    ),
)

# Schema version 6: a partition (export, zone, business date) whose runs kept failing before they claimed any key of
# it (a code location that did not load, a ledger or source unreachable at the start): the ledger never heard of its
# keys, so the reconciliation sensor notes it here once its automatic reruns are spent, and it is escalated until a
# claim of that partition closes it.
export_missed_partitions = sa.Table(
    "export_missed_partitions",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("export", sa.String(63), nullable=False),
    sa.Column("timezone", sa.String(63), nullable=False),
    sa.Column("business_date", sa.Date, nullable=False),
    sa.Column("missing_keys", sa.Integer, nullable=False),  # tenants of the partition the ledger has no key of
    sa.Column("failed_runs", sa.Integer, nullable=False),
    sa.Column("last_run_id", sa.String(64), nullable=False),
    sa.Column("first_noted_at", UtcDateTime, nullable=False),
    sa.Column("last_noted_at", UtcDateTime, nullable=False),
    sa.Column("closed_at", UtcDateTime),
    sa.Index(
        "uq_export_missed_partitions_open",
        "export",
        "timezone",
        "business_date",
        unique=True,
        sqlite_where=sa.text("closed_at IS NULL"),
        postgresql_where=sa.text("closed_at IS NULL"),
    ),
)

#: export_runs' columns before schema version 4: what every read selects, so a read-only open of a version 3 ledger
#: (which has no source_fingerprint) reads as it is. The fingerprint is read on its own, where it is needed.
RUN_COLUMNS = tuple(
    column for column in export_runs.c if column.name not in ("source_fingerprint", "claim_count", "contract_id")
)

# The schema's version history (see export_ledger.ledger.store): one row per version reached, never changed.
SCHEMA_VERSION = 9
export_ledger_schema = sa.Table(
    "export_ledger_schema",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("applied_at", UtcDateTime, nullable=False),
    sa.Column("note", sa.String(200), nullable=False),
)
