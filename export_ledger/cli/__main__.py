"""``python -m export_ledger.cli``: the ``export-ledger`` console script."""

from export_ledger.cli import main

raise SystemExit(main())
