"""The ledger as a Dagster resource: configuration in, a plain :class:`~resources.ledger.ExportLedger` out."""

from __future__ import annotations

import datetime as dt

import dagster as dg

from resources.ledger import ExportLedger, utc_now


class LedgerResource(dg.ConfigurableResource):
    """Where the ledger lives and how long a claim's lease lasts.

    Attributes:
        url: SQLAlchemy URL. SQLite (the default, a project-local file) or ``postgresql+psycopg2://...``.
        lease_ttl_seconds: How long one attempt keeps a key to itself without a result. Longer than the slowest
            single export, shorter than the time an operator will wait before retrying a crashed run.
        allow_below_low_water: Allow first claims below the retention low-water mark (an explicit override).
    """

    url: str
    lease_ttl_seconds: int = 900
    allow_below_low_water: bool = False

    def clock(self) -> dt.datetime:
        """The ledger's notion of now. Tests subclass this resource to control it."""
        return utc_now()

    def get_ledger(self) -> ExportLedger:
        if self.lease_ttl_seconds <= 0:
            raise ValueError(f"lease_ttl_seconds must be positive, got {self.lease_ttl_seconds}")
        return ExportLedger(
            self.url,
            lease_ttl=dt.timedelta(seconds=self.lease_ttl_seconds),
            clock=self.clock,
            allow_below_low_water=self.allow_below_low_water,
        )
