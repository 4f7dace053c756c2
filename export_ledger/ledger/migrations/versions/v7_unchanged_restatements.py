"""Schema version 7: a restatement request may close as ``unchanged``.

A restatement whose new data is the current revision's, byte for byte, publishes nothing: its request is closed with
the outcome ``unchanged`` (docs/protocol.md, step 7), which ``ck_restatement_closed`` did not allow. SQLite cannot
alter a CHECK constraint, so there the table is copied under the new one (alembic's batch mode, from the table as
version 6 left it, with its indexes); PostgreSQL replaces the constraint in place.
"""

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v7"
down_revision = "v6"
branch_labels = None
depends_on = None

_CLOSED_V7 = (
    "(closed_at IS NULL AND outcome IS NULL) OR "
    "(closed_at IS NOT NULL AND outcome IN ('published', 'withdrawn', 'unchanged'))"
)


def _restatements_v6() -> sa.Table:
    """``export_restatements`` as versions 5 and 6 made it (the batch copies from this, never from reflection)."""
    table = sa.Table(
        "export_restatements",
        sa.MetaData(),
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
    sa.Index(
        "uq_export_restatements_open", table.c.logical_key, unique=True,
        sqlite_where=sa.text("closed_at IS NULL"), postgresql_where=sa.text("closed_at IS NULL"),
    )  # fmt: skip
    sa.Index("ix_export_restatements_export", table.c.export, table.c.closed_at)
    sa.Index(
        "uq_export_restatements_key_revision", table.c.logical_key, table.c.revision, unique=True,
        sqlite_where=sa.text("outcome IS NULL OR outcome = 'published'"),
        postgresql_where=sa.text("outcome IS NULL OR outcome = 'published'"),
    )  # fmt: skip
    return table


def upgrade() -> None:
    with op.batch_alter_table("export_restatements", copy_from=_restatements_v6()) as batch:
        batch.drop_constraint("ck_restatement_closed", type_="check")
        batch.create_check_constraint("ck_restatement_closed", sa.text(_CLOSED_V7))
    stamp(7)
