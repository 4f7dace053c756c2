"""Shared builders for tests: logical keys, completion evidence, a key's orders (plain functions, importable
anywhere)."""

from __future__ import annotations

import datetime as dt

import pandas as pd

from export_ledger.calendar import window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import Claim, CompletionEvidence

ZONE = "America/New_York"
BUSINESS_DATE = dt.date(2026, 3, 8)  # the spring-forward day in New York: a 23-hour window


def key_for(
    business_date: dt.date = BUSINESS_DATE,
    *,
    export: str = "invoice_export",
    tenant: str = "acme",
    timezone: str = ZONE,
) -> LogicalKey:
    """The logical key of one export, tenant and business date."""
    return LogicalKey(export, tenant, window_for(business_date, timezone))


def evidence_for(claim: Claim, *, attempt_id: str | None = None, row_count: int = 42) -> CompletionEvidence:
    """What a destination would report for the claim's export (or for another attempt's, with ``attempt_id``)."""
    producer = attempt_id or claim.attempt_id
    return CompletionEvidence(
        location=f"file:///exports/{claim.logical_key}/{producer.replace('/', '_')}.parquet",
        sha256="ab" * 32,
        row_count=row_count,
        attempt_id=producer,
        fencing_token=claim.fencing_token,
    )


def sql_invoices(url: str, day: dt.date, tenants: tuple[str, ...], *, table: str = "invoices", per_tenant: int = 5):
    """Creates an invoices table (the one ``SqlInvoiceSource`` reads) at ``url`` with ``per_tenant`` invoices for each
    tenant on ``day`` in New York, unlike the sample's (ids ``<tenant>-sql-<n>``), and returns each tenant's ids."""
    import sqlalchemy as sa

    from resources.invoices import invoices_table

    start = window_for(day, ZONE).start_utc
    ids = {tenant: [f"{tenant}-sql-{n}" for n in range(per_tenant)] for tenant in tenants}
    rows = [
        {
            "invoice_id": invoice_id,
            "tenant": tenant,
            "occurred_at": start + dt.timedelta(hours=1 + n),
            "amount": 10.5 + n,
            "currency": "EUR",
            "customer_email": f"buyer{n}@example.com",
        }
        for tenant, tenant_ids in ids.items()
        for n, invoice_id in enumerate(tenant_ids)
    ]
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            invoices_table(table).create(conn)
            conn.execute(invoices_table(table).insert(), rows)
    finally:
        engine.dispose()
    return ids


def hourly_orders(key: LogicalKey) -> pd.DataFrame:
    """Hourly orders of the key's tenant inside its window (order_id, tenant, placed_at, total)."""
    start, end = pd.Timestamp(key.window.start_utc), pd.Timestamp(key.window.end_utc)
    times = pd.date_range(start.ceil("h"), end, freq="h", inclusive="left").as_unit("us")
    return pd.DataFrame(
        {
            "order_id": [f"{key.tenant}-{int(t.timestamp())}" for t in times],
            "tenant": [key.tenant] * len(times),
            "placed_at": times,
            "total": [12.5] * len(times),
        }
    )
