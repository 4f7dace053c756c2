"""The reference export's invoice sources: a deterministic sample that needs no setup, and a SQL table read by UTC
bounds. Written against export_ledger's public API (``ExportSource``), as a user's own source would be.

Events carry a customer email and an amount: personal and business data that is exported but never logged.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from abc import ABC, abstractmethod

import sqlalchemy as sa

from export_ledger import (
    ExportSource,
    SourceError,
    UtcDateTime,
    database_engine,
    redact_url,
    require_aware,
    url_identity,
)
from export_ledger.lazy import lazy_module

np = lazy_module("numpy", globals(), "np")
pd = lazy_module("pandas", globals(), "pd")

_CURRENCIES = ("USD", "EUR", "GBP", "CAD")


class InvoiceSource(ExportSource, ABC):
    """Where invoice events come from, read by tenant and half-open UTC bounds ``[start, end)``.

    Subclasses take their settings as keyword arguments (``SampleInvoiceSource(cadence_minutes=30)``).
    """

    def __init__(self, **settings) -> None:
        known = {name for cls in type(self).__mro__ for name in getattr(cls, "__annotations__", {})}
        for name, value in settings.items():
            if name not in known and not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__} has no setting {name!r}")
            setattr(self, name, value)

    @abstractmethod
    def count(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> int:
        """How many events ``rows`` returns for the same arguments (for the export's asset check)."""


def _bounds(start_utc: dt.datetime, end_utc: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    start = require_aware(start_utc, "start_utc")
    end = require_aware(end_utc, "end_utc")
    if end < start:
        raise ValueError(f"end_utc {end.isoformat()} is before start_utc {start.isoformat()}")
    return start, end


class SampleInvoiceSource(InvoiceSource):
    """One invoice per tenant every ``cadence_minutes``, on a UTC grid anchored at the Unix epoch.

    Deterministic: the same window always yields the same events, so reruns and retries are comparable.
    """

    cadence_minutes: int = 15
    #: ``(tenant, window start in UTC)`` of the windows whose reads fail as a real source's outage would
    #: (``SourceError``): each tenant's business date, resolved in its own calendar (see definitions.py).
    outages: frozenset[tuple[str, dt.datetime]] = frozenset()
    #: ``(tenant, window start in UTC)`` of the windows whose last invoice was voided after the fact: read again, the
    #: window has one row fewer, as a source corrected after its export (drift detection finds it).
    voided: frozenset[tuple[str, dt.datetime]] = frozenset()

    def identity(self) -> dict:
        # The cadence, outages and voided invoices are what the sample holds (like the rows of a table), not which
        # source it is.
        return {**super().identity(), "kind": "sample"}

    def _voided(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> bool:
        return bool(self.voided) and (tenant, _bounds(start_utc, end_utc)[0]) in self.voided

    def _indices(self, start_utc: dt.datetime, end_utc: dt.datetime) -> range:
        if self.cadence_minutes <= 0:
            raise ValueError(f"cadence_minutes must be positive, got {self.cadence_minutes}")
        start, end = _bounds(start_utc, end_utc)
        step = self.cadence_minutes * 60
        first = math.ceil(start.timestamp() / step)
        stop = math.ceil(end.timestamp() / step)
        return range(first, stop)

    def count(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> int:
        self._refuse_if_down(tenant, start_utc, end_utc)
        total = len(self._indices(start_utc, end_utc))
        return max(total - 1, 0) if self._voided(tenant, start_utc, end_utc) else total

    def _refuse_if_down(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> None:
        if self.outages and (tenant, _bounds(start_utc, end_utc)[0]) in self.outages:
            raise SourceError(f"the sample source is down for tenant {tenant!r} (EXPORTS_SAMPLE_OUTAGE)")

    def rows(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        self._refuse_if_down(tenant, start_utc, end_utc)
        indices = self._indices(start_utc, end_utc)
        if self._voided(tenant, start_utc, end_utc) and len(indices):
            indices = indices[:-1]
        k = np.arange(indices.start, indices.stop, dtype=np.int64)
        seed = int.from_bytes(hashlib.sha256(tenant.encode()).digest()[:4], "big")
        mixed = (k * 2654435761 + seed) % 1_000_003
        seconds = k * (self.cadence_minutes * 60)
        ids = pd.Series(k, dtype="int64").astype(str).str.zfill(12)
        return pd.DataFrame(
            {
                "invoice_id": (tenant + "-" + ids).astype(object),
                "tenant": np.full(len(k), tenant, dtype=object),
                "occurred_at": pd.to_datetime(seconds, unit="s", utc=True).as_unit("us"),
                "amount": np.round(5 + (mixed % 250_000) / 100.0, 2),
                "currency": np.array(_CURRENCIES, dtype=object)[mixed % len(_CURRENCIES)],
                "customer_email": ("customer" + pd.Series(mixed % 5000).astype(str) + "@example.com").astype(object),
            }
        )


def invoices_table(name: str = "invoices") -> sa.Table:
    """The ``invoices`` table the SQL source reads (and tests create)."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("invoice_id", sa.String(100), primary_key=True),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("occurred_at", UtcDateTime, nullable=False),
        sa.Column("amount", sa.Float, nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("customer_email", sa.String(320), nullable=False),
        sa.Index(f"ix_{name}_tenant_time", "tenant", "occurred_at"),
    )


class SqlInvoiceSource(InvoiceSource):
    """Reads a real ``invoices`` table (SQLite or PostgreSQL) by tenant and UTC bounds, with bound parameters."""

    url: str = ""
    table: str = "invoices"

    def identity(self) -> dict:
        return {"kind": "sql", "url": url_identity(self.url), "table": self.table}

    def _engine(self) -> sa.Engine:
        # postgresql:// takes the installed driver, a plain path is a SQLite file; errors never carry customer values
        return database_engine(self.url, what="EXPORTS_SOURCE_URL", hide_parameters=True)

    def _run(self, query):
        engine = self._engine()
        try:
            with engine.connect() as conn:
                return conn.execute(query).all()
        except sa.exc.SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            raise SourceError(
                f"cannot read {self.table} from {redact_url(self.url)!r}: {orig.__class__.__name__}: "
                f"{str(orig).strip().splitlines()[0]}"
            ) from None
        finally:
            engine.dispose()

    def rows(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        start, end = _bounds(start_utc, end_utc)
        table = invoices_table(self.table)
        query = (
            sa.select(*table.c)
            .where(table.c.tenant == tenant, table.c.occurred_at >= start, table.c.occurred_at < end)
            .order_by(table.c.occurred_at, table.c.invoice_id)
        )
        rows = self._run(query)
        frame = pd.DataFrame(rows, columns=[c.name for c in table.c])
        frame["occurred_at"] = pd.to_datetime(frame["occurred_at"], utc=True).dt.as_unit("us")
        frame["amount"] = frame["amount"].astype("float64")
        for name in ("invoice_id", "tenant", "currency", "customer_email"):
            frame[name] = frame[name].astype(object)
        return frame

    def count(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> int:
        start, end = _bounds(start_utc, end_utc)
        table = invoices_table(self.table)
        query = sa.select(sa.func.count()).where(
            table.c.tenant == tenant, table.c.occurred_at >= start, table.c.occurred_at < end
        )
        return int(self._run(query)[0][0])
