"""Schema version 6 (release 0.5.0): claim counts, unique revision numbers per key, contract refusals, partition
indexes.

- ``export_runs.claim_count``: export claims since the key's last operator resolution or restatement request; filled
  from the attempts and requests already recorded (before, reruns were counted from fencing tokens at read time).
- ``uq_export_restatements_key_revision``: a revision number belongs to one open or published request of a key.
- ``export_contract_refusals``: tenants refused by their calendar contract, escalated until accepted; the dates
  refused are launched again once the refusal closes.
- ``export_missed_partitions``: partitions whose runs kept failing before they claimed a key, escalated.
- two indexes on ``export_runs`` for the pages of failed and stuck keys per export and partition.
"""

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v6"
down_revision = "v5"
branch_labels = None
depends_on = None

# Constant statements: no value is interpolated.
_COUNT_SINCE_RESOLUTION = sa.text(
    "UPDATE export_runs SET claim_count = fencing_token - COALESCE(("
    " SELECT MAX(a.fencing_token) FROM export_attempts a"
    " WHERE a.logical_key = export_runs.logical_key AND a.error_class = 'OperatorResolution'), 0)"
)
_COUNT_SINCE_REQUEST = sa.text(
    "UPDATE export_runs SET claim_count = fencing_token - ("
    " SELECT r.base_token FROM export_restatements r"
    " WHERE r.logical_key = export_runs.logical_key AND r.closed_at IS NULL)"
    " WHERE EXISTS (SELECT 1 FROM export_restatements r"
    "  WHERE r.logical_key = export_runs.logical_key AND r.closed_at IS NULL"
    "  AND export_runs.fencing_token - r.base_token < export_runs.claim_count)"
)
_NOT_NEGATIVE = sa.text("UPDATE export_runs SET claim_count = 0 WHERE claim_count < 0")


def upgrade() -> None:
    op.add_column("export_runs", sa.Column("claim_count", sa.Integer, nullable=False, server_default="0"))
    op.execute(_COUNT_SINCE_RESOLUTION)
    op.execute(_COUNT_SINCE_REQUEST)
    op.execute(_NOT_NEGATIVE)
    op.create_index(
        "ix_export_runs_state_export_date", "export_runs", ["state", "export", "business_date", "timezone"]
    )
    op.create_index("ix_export_runs_state_updated", "export_runs", ["state", "updated_at"])
    # Open or published requests only: releases before 0.5 numbered a request after a withdrawn one with the same
    # revision (the withdrawn row keeps its number, as it was recorded).
    op.create_index(
        "uq_export_restatements_key_revision",
        "export_restatements",
        ["logical_key", "revision"],
        unique=True,
        sqlite_where=sa.text("outcome IS NULL OR outcome = 'published'"),
        postgresql_where=sa.text("outcome IS NULL OR outcome = 'published'"),
    )
    op.create_table(
        "export_contract_refusals",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("export", sa.String(63), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("recorded", sa.Text, nullable=False),
        sa.Column("wanted", sa.Text, nullable=False),
        sa.Column("first_refused_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_refused_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("refusals", sa.Integer, nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True)),
        sa.Column("timezone", sa.String(63)),
        sa.Column("first_date", sa.Date),
        sa.Column("last_date", sa.Date),
        sa.Column("relaunch_pending", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_index(
        "uq_export_contract_refusals_open",
        "export_contract_refusals",
        ["export", "tenant"],
        unique=True,
        sqlite_where=sa.text("closed_at IS NULL"),
        postgresql_where=sa.text("closed_at IS NULL"),
    )
    op.create_table(
        "export_missed_partitions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("export", sa.String(63), nullable=False),
        sa.Column("timezone", sa.String(63), nullable=False),
        sa.Column("business_date", sa.Date, nullable=False),
        sa.Column("missing_keys", sa.Integer, nullable=False),
        sa.Column("failed_runs", sa.Integer, nullable=False),
        sa.Column("last_run_id", sa.String(64), nullable=False),
        sa.Column("first_noted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_noted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True)),
    )
    op.create_index(
        "uq_export_missed_partitions_open",
        "export_missed_partitions",
        ["export", "timezone", "business_date"],
        unique=True,
        sqlite_where=sa.text("closed_at IS NULL"),
        postgresql_where=sa.text("closed_at IS NULL"),
    )
    stamp(6)
