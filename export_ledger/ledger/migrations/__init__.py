"""The ledger's schema migrations: one alembic revision per schema version (``versions/v1`` ... ``v7``).

They run only through :func:`export_ledger.ledger.store.upgrade` (``export-ledger upgrade``), never on their own and
never on a read. Each revision freezes the tables it creates as they were at that version, so replaying a later
revision never meets a table already shaped by an earlier one.
"""
