"""Schema version 1: release 0.1.0 (export_runs, export_attempts, export_low_water, export_contracts).

A baseline, never run: a database of that age is stamped at this revision when it is first upgraded, and an empty
database is created at the newest version directly.
"""

revision = "v1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    raise RuntimeError("schema version 1 is a baseline: an empty ledger is created at the newest version")
