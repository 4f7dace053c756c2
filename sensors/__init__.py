"""The reference code location's sensor settings; export_ledger builds the one reconciliation sensor."""

import datetime as dt

#: Stuck keys the reconciliation sensor examines per tick.
RECONCILE_BATCH_SIZE = 100
#: Keys unresolved for longer fail ``no_stuck_exports`` and are logged as errors.
STUCK_AFTER = dt.timedelta(hours=6)
