"""An executable model of the export protocol (docs/protocol.md), written from the docs alone, explored exhaustively
in small bounds (docs/model-check.md). It never imports ``export_ledger``: it is a second statement of the protocol,
so that the implementation's assumptions are not silently shared."""
