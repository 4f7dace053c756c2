"""One alembic revision per schema version; ``stamp`` records each in ``export_ledger_schema``, as releases before
alembic did, so the version history reads the same whichever release upgraded it."""

import datetime as dt

from alembic import op


def stamp(version: int) -> None:
    """Appends the version row of the revision being applied (same transaction)."""
    from export_ledger.ledger.schema import export_ledger_schema

    op.get_bind().execute(
        export_ledger_schema.insert().values(
            version=version, applied_at=dt.datetime.now(dt.timezone.utc), note=f"upgraded from {version - 1}"
        )
    )
