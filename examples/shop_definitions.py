"""A code location of two ledgered exports, orders (CSV) and payments (Parquet), from a small shop database."""

import datetime as dt
import sqlite3
from pathlib import Path

import pandas as pd

from export_ledger import ExportSpec, SqlSource
from export_ledger.dagster import ledgered_definitions

SHOP = Path("var/shop.sqlite3")  # a sample database this file creates in the working directory
TENANTS = ["acme", "globex"]


def create_shop(path: Path) -> None:
    """Orders every 20 minutes and a payment every hour, per tenant, from 2026-03-01 to 2026-03-14 (UTC)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, tenant TEXT, placed_at TEXT, total REAL)"
        )
        db.execute(
            "CREATE TABLE IF NOT EXISTS payments (payment_id TEXT, tenant TEXT, paid_at TEXT, amount REAL, "
            "method TEXT, PRIMARY KEY (payment_id, tenant))"
        )
        start = dt.datetime(2026, 3, 1)
        for tenant in TENANTS:
            for i in range(14 * 72):
                placed = start + dt.timedelta(minutes=20 * i)
                db.execute(
                    "INSERT OR IGNORE INTO orders VALUES (?, ?, ?, ?)",
                    (f"{tenant}-o{i}", tenant, placed.isoformat(sep=" "), 10 + i % 90),
                )
            for i in range(14 * 24):
                paid = start + dt.timedelta(hours=i)
                db.execute(
                    "INSERT OR IGNORE INTO payments VALUES (?, ?, ?, ?, ?)",
                    (f"p{i}", tenant, paid.isoformat(sep=" "), 25.0 + i % 7, ["card", "transfer"][i % 2]),
                )


create_shop(SHOP)

orders = ExportSpec(
    name="orders",
    source=SqlSource(
        f"sqlite:///{SHOP}",
        "SELECT order_id, tenant, placed_at, total FROM orders "
        "WHERE tenant = :tenant AND placed_at >= :start AND placed_at < :end",
    ),
    columns={"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"},
    id_columns=["order_id"],
    time_column="placed_at",
    tenant_column="tenant",
    tenants=TENANTS,
    timezone="America/New_York",
    start_date="2026-03-01",
    file_format="csv",
)


def read_payments(tenant: str, start: dt.datetime, end: dt.datetime) -> pd.DataFrame:
    """Any Python can be a source: one tenant's payments in [start, end), times as UTC-aware timestamps."""
    with sqlite3.connect(SHOP) as db:
        frame = pd.read_sql_query(
            "SELECT payment_id, tenant, paid_at, amount, method FROM payments WHERE tenant = ?", db, params=(tenant,)
        )
    frame["paid_at"] = pd.to_datetime(frame["paid_at"], utc=True)
    return frame[(frame["paid_at"] >= start) & (frame["paid_at"] < end)]


payments = ExportSpec(
    name="payments",
    source=read_payments,
    columns={"payment_id": "string", "tenant": "string", "paid_at": "timestamp", "amount": "float", "method": "string"},
    id_columns=["payment_id", "tenant"],
    time_column="paid_at",
    tenant_column="tenant",
    order_by=["paid_at", "payment_id"],
    tenants=TENANTS,
    timezone="Europe/Dublin",
    start_date="2026-03-01",
    schedule_time="05:15",
    file_format="parquet",
)

defs = ledgered_definitions([orders, payments])
