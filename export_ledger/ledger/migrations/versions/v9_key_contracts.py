"""Schema version 9: each key names the contract it was last claimed under; each contract row names its tenant.

``export_runs.contract_id`` is the ``export_contracts`` row in force for the key's tenant when an attempt last claimed
it to export (a hold by reconciliation or an operator leaves it). Operator commands act on the destination that
contract records, never on whatever their own environment names, and a claim is refused when it would carry a key
whose earlier attempts may have written to one destination over to another. NULL for keys claimed before version 9
(and by callers that check no contract): the ledger never recorded where they went.

``export_contracts.tenant`` repeats the tenant each row's JSON names (NULL: an export-wide row), filled here for the
rows already there, so that a claim reads its tenants' latest rows by index rather than the export's whole history.
"""

import json

import sqlalchemy as sa
from alembic import op

from export_ledger.ledger.migrations.versions import stamp

revision = "v9"
down_revision = "v8"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable columns without a default: SQLite adds them in place (no copy of the table), PostgreSQL too.
    op.add_column("export_runs", sa.Column("contract_id", sa.BigInteger))
    op.add_column("export_contracts", sa.Column("tenant", sa.String(63)))
    contracts = sa.table(
        "export_contracts", sa.column("id", sa.BigInteger), sa.column("contract", sa.Text), sa.column("tenant")
    )
    bind = op.get_bind()
    named = [
        {"row_id": row_id, "tenant": json.loads(text).get("tenant")}
        for row_id, text in bind.execute(sa.select(contracts.c.id, contracts.c.contract))
    ]
    named = [row for row in named if row["tenant"] is not None]
    if named:
        bind.execute(
            contracts.update().where(contracts.c.id == sa.bindparam("row_id")).values(tenant=sa.bindparam("tenant")),
            named,
        )
    op.create_index("ix_export_contracts_tenant", "export_contracts", ["export", "tenant", "id"])
    stamp(9)
