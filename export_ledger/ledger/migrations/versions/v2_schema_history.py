"""Schema version 2: export_ledger_schema, one row per version reached."""

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v2"
down_revision = "v1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "export_ledger_schema",
        sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("note", sa.String(200), nullable=False),
    )
    stamp(2)
