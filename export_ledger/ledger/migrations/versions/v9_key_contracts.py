"""Schema version 9: each key names the contract it was last claimed under.

``export_runs.contract_id`` is the ``export_contracts`` row in force for the key's tenant when an attempt last claimed
it to export (a hold by reconciliation or an operator leaves it). Operator commands act on the destination that
contract records, never on whatever their own environment names, and a claim is refused when it would carry a key
whose earlier attempts may have written to one destination over to another. NULL for keys claimed before version 9
(and by callers that check no contract): their tenant's contract in force answers for them.
"""

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v9"
down_revision = "v8"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: SQLite adds it in place (no copy of the table), PostgreSQL too.
    op.add_column("export_runs", sa.Column("contract_id", sa.BigInteger))
    stamp(9)
