"""Schema version 4: export_runs.source_fingerprint and export_drift (keys whose source changed since)."""

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v4"
down_revision = "v3"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default rewrites no row, on either backend.
    op.add_column("export_runs", sa.Column("source_fingerprint", sa.String(120)))
    op.create_table(
        "export_drift",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("logical_key", sa.String(300), nullable=False),
        sa.Column("export", sa.String(63), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("business_date", sa.Date, nullable=False),
        sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("rows_added", sa.BigInteger, nullable=False),
        sa.Column("rows_removed", sa.BigInteger, nullable=False),
        sa.Column("rows_changed", sa.BigInteger),
        sa.Column("source_fingerprint", sa.String(120), nullable=False),
        sa.Column("cleared_at", sa.DateTime(timezone=True)),
    )
    op.create_index(
        "uq_export_drift_open",
        "export_drift",
        ["logical_key"],
        unique=True,
        sqlite_where=sa.text("cleared_at IS NULL"),
        postgresql_where=sa.text("cleared_at IS NULL"),
    )
    op.create_index("ix_export_drift_export", "export_drift", ["export", "cleared_at"])
    stamp(4)
