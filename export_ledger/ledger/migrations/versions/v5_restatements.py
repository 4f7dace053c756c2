"""Schema version 5: export_restatements (requests for a new revision) and export_revisions (published ones)."""

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v5"
down_revision = "v4"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "export_restatements",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("logical_key", sa.String(300), nullable=False),
        sa.Column("export", sa.String(63), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("business_date", sa.Date, nullable=False),
        sa.Column("revision", sa.Integer, nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("requested_by", sa.String(300), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("base_token", sa.BigInteger, nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True)),
        sa.Column("outcome", sa.String(20)),
        sa.CheckConstraint("revision >= 2", name="ck_restatement_revision"),
        sa.CheckConstraint(
            "(closed_at IS NULL AND outcome IS NULL) OR "
            "(closed_at IS NOT NULL AND outcome IN ('published', 'withdrawn'))",
            name="ck_restatement_closed",
        ),
    )
    op.create_index(
        "uq_export_restatements_open",
        "export_restatements",
        ["logical_key"],
        unique=True,
        sqlite_where=sa.text("closed_at IS NULL"),
        postgresql_where=sa.text("closed_at IS NULL"),
    )
    op.create_index("ix_export_restatements_export", "export_restatements", ["export", "closed_at"])
    op.create_table(
        "export_revisions",
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
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("published_by", sa.String(300), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("logical_key", "revision", name="uq_export_revisions_key_revision"),
        sa.CheckConstraint("revision >= 1", name="ck_revision_positive"),
    )
    stamp(5)
