"""The reference code location's exports (declarations only; export_ledger builds their assets)."""
