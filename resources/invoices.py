"""The reference export's invoice sources: a deterministic sample that needs no setup, and a SQL table read by UTC
bounds; and :class:`InvoiceSourceResource`, the choice between them as a Dagster resource's fields. Written against
export_ledger's public API (``ExportSource``, ``SourceResource``), as a user's own source would be.

Events carry a customer email and an amount: personal and business data that is exported but never logged.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import pydantic
import sqlalchemy as sa

from export_ledger import (
    ConfigurationError,
    ExportSource,
    ExportSpec,
    SourceError,
    UtcDateTime,
    database_engine,
    redact_url,
    require_aware,
    url_identity,
)
from export_ledger.dagster import SourceResource

if TYPE_CHECKING:
    import pandas as pd

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
        import numpy as np  # here, not at import: loading the code location reads no data and needs no frame library
        import pandas as pd

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
        import pandas as pd  # here, not at import, as the sample's rows

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


#: Each field of :class:`InvoiceSourceResource` and the environment variable definitions.py reads it from.
SOURCE_VARIABLES = {
    "sample": "EXPORTS_SOURCE",
    "url": "EXPORTS_SOURCE_URL",
    "table": "EXPORTS_SOURCE_TABLE",
    "sample_cadence_minutes": "EXPORTS_SAMPLE_CADENCE_MINUTES",
    "sample_outage": "EXPORTS_SAMPLE_OUTAGE",
    "sample_voided": "EXPORTS_SAMPLE_VOIDED",
}


class InvoiceSourceResource(SourceResource):
    """The invoice source chosen by its settings, as Dagster resource fields: the sample, or a SQL table. Nothing is
    implied: a process given neither (a run worker whose launcher config dropped them) never exports the sample
    invoices as if they were the real ones.

    Each use resolves it where it runs (a run's step in its worker, the drift sensor's tick, the CLI): a choice
    missing there, two sources chosen, or half of the SQL source's settings fail that use, naming the settings
    (:meth:`problem`), and the code location still loads. They are refused at use, not at load, because which of them
    a process has depends on what its environment was given: a code server may lack the URL its run workers have,
    and a launcher config may drop one; the run reads what its own worker's settings say, or nothing.

    Attributes:
        sample: The sample invoices (``EXPORTS_SOURCE=sample``).
        url: SQLAlchemy URL of the SQL source's database (``EXPORTS_SOURCE_URL``); a secret, given as
            ``dg.EnvVar("EXPORTS_SOURCE_URL")`` so that the UI's resource config shows the variable, never the URL.
        table: The SQL source's invoices table (``EXPORTS_SOURCE_TABLE``).
        sample_cadence_minutes: One sample invoice per tenant every this many minutes
            (``EXPORTS_SAMPLE_CADENCE_MINUTES``).
        sample_outage: ``tenant@YYYY-MM-DD,...``: the sample's reads of those tenants' business dates fail as an
            outage would (``EXPORTS_SAMPLE_OUTAGE``).
        sample_voided: ``YYYY-MM-DD,...``: each tenant's last sample invoice of those dates is voided after the fact
            (``EXPORTS_SAMPLE_VOIDED``), which drift detection finds.
    """

    # A refused value may be a URL pasted into the wrong setting: pydantic's message then leaves out what it was given.
    model_config = pydantic.ConfigDict(hide_input_in_errors=True)

    sample: bool = False
    url: str = ""
    table: str = ""
    sample_cadence_minutes: int = 15
    sample_outage: str = ""
    sample_voided: str = ""

    def problem(self) -> str | None:
        """What the settings lack or contradict, naming them and never their values; None when they choose one
        source. Nothing is read: an ``EnvVar`` not yet resolved counts as given."""
        given = [SOURCE_VARIABLES[name] for name in ("url", "table") if getattr(self, name)]
        switches = [SOURCE_VARIABLES[name] for name in ("sample_outage", "sample_voided") if getattr(self, name)]
        if self.sample and given:
            return f"EXPORTS_SOURCE=sample and {' and '.join(given)} choose two sources: set one"
        if switches and not self.sample:
            verb = "apply" if len(switches) > 1 else "applies"
            return f"{' and '.join(switches)} {verb} to the sample source only (EXPORTS_SOURCE=sample)"
        if self.sample:
            if self.sample_cadence_minutes <= 0:
                return "EXPORTS_SAMPLE_CADENCE_MINUTES must be a positive integer of minutes"
            return None
        if not given:
            return (
                "no invoice source: set EXPORTS_SOURCE=sample for the sample invoices, or EXPORTS_SOURCE_URL and "
                "EXPORTS_SOURCE_TABLE for a SQL table (a run worker gets them from its launcher config)"
            )
        if len(given) == 1:
            (missing,) = {"EXPORTS_SOURCE_URL", "EXPORTS_SOURCE_TABLE"} - set(given)
            return f"{given[0]} is set without {missing}: a SQL source needs both"
        return None

    def get_source(self, spec: ExportSpec) -> InvoiceSource:
        problem = self.problem()
        if problem is not None:
            raise ConfigurationError(problem)
        if self.sample:
            outages, voided = sample_switches(self.sample_outage, self.sample_voided, spec)
            return SampleInvoiceSource(cadence_minutes=self.sample_cadence_minutes, outages=outages, voided=voided)
        return SqlInvoiceSource(url=self.url, table=self.table)


def _date(setting: str, position: int, text: str) -> dt.date:
    """One date written YYYY-MM-DD; anything else names the setting and the entry's position, never its text (a URL
    pasted into the wrong setting may carry a password)."""
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            return dt.date.fromisoformat(text)
    except ValueError:
        pass
    raise ConfigurationError(f"{setting}: entry {position} is not a date (YYYY-MM-DD)")


def _entries(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def sample_switches(outage: str, voided: str, spec: ExportSpec) -> tuple[frozenset, frozenset]:
    """``EXPORTS_SAMPLE_OUTAGE`` (``tenant@YYYY-MM-DD,...``) and ``EXPORTS_SAMPLE_VOIDED`` (``YYYY-MM-DD,...``) as the
    sample source takes them: ``(tenant, window start in UTC)`` of each business date in the tenant's own calendar
    (a tenant east of UTC+12 has its own day's window, not the next one's).

    Raises:
        ConfigurationError: an entry is malformed, names an unknown tenant, or a date outside the calendar; the entry
            is named by its position (1 for the first), never quoted.
    """
    outages = set()
    for position, entry in enumerate(_entries(outage), start=1):
        tenant, at, day = entry.partition("@")
        if not at or not tenant or not day.strip():
            raise ConfigurationError(f"EXPORTS_SAMPLE_OUTAGE: entry {position} is not tenant@YYYY-MM-DD")
        if tenant not in spec.tenants:  # the tenants are slugs: an entry that is not one is not among them
            raise ConfigurationError(
                f"EXPORTS_SAMPLE_OUTAGE: entry {position} names a tenant not among the tenants "
                f"({', '.join(sorted(spec.tenants))})"
            )
        date = _date("EXPORTS_SAMPLE_OUTAGE", position, day.strip())
        outages.add((tenant, _window_start(spec, tenant, date, "EXPORTS_SAMPLE_OUTAGE")))
    voided_windows = {
        (tenant, _window_start(spec, tenant, _date("EXPORTS_SAMPLE_VOIDED", position, day), "EXPORTS_SAMPLE_VOIDED"))
        for position, day in enumerate(_entries(voided), start=1)
        for tenant in spec.tenants
    }
    return frozenset(outages), frozenset(voided_windows)


def _window_start(spec: ExportSpec, tenant: str, day: dt.date, setting: str) -> dt.datetime:
    calendar = spec.calendar_for(tenant)
    if day < calendar.first_date:
        raise ConfigurationError(f"{setting}: {day} is before the export's first business date ({calendar.start_date})")
    try:
        return calendar.window_of(day).start_utc
    except OverflowError:
        raise ConfigurationError(f"{setting}: {day} is out of the calendar's range") from None
