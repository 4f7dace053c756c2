"""Schema version 3: export_operator_log, operators' decisions (append-only)."""

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v3"
down_revision = "v2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "export_operator_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("operator", sa.String(200), nullable=False),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("export", sa.String(63)),
        sa.Column("logical_key", sa.String(300)),
        sa.Column("detail", sa.String(1000), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
    )
    stamp(3)
