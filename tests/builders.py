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


def overlapping_writers(admin_url: str, first, second, *, pause_at: int = 2) -> tuple[dict[str, str], bool]:
    """Runs ``first()`` in a thread until just before its ``pause_at``-th statement that takes row locks on
    ``export_runs`` (an ``UPDATE`` of it, or a ``SELECT ... FOR UPDATE`` of it), then ``second()`` in another thread
    until PostgreSQL shows it waiting for a lock (looked up through ``admin_url``), then lets both finish.

    Returns each one's outcome (``ok: <types of what it returned>`` or ``<error class>: <message>``, by the callables'
    names) and whether the second waited: the overlap happened."""
    import threading
    import time

    import sqlalchemy as sa

    outcomes: dict[str, str] = {}
    threads: dict[str, threading.Thread] = {}
    locking: list[str] = []
    second_pid: list[int] = []
    paused, resume = threading.Event(), threading.Event()

    def hook(conn, cursor, statement, parameters, context, executemany) -> None:
        thread = threading.current_thread()
        if thread is threads.get("second") and not second_pid:
            second_pid.append(cursor.connection.get_backend_pid())
        text = " ".join(statement.split()).upper()
        takes_locks = text.startswith("UPDATE EXPORT_RUNS") or (
            text.startswith("SELECT EXPORT_RUNS.") and "FROM EXPORT_RUNS" in text and text.endswith("FOR UPDATE")
        )
        if thread is threads.get("first") and takes_locks:
            locking.append(text[:40])
            if len(locking) == pause_at:
                paused.set()
                resume.wait(10)

    def run(name: str, body) -> None:
        try:
            returned = body()
            outcomes[body.__name__] = "ok: " + ", ".join(type(r).__name__ for r in returned or ())
        except Exception as exc:  # noqa: BLE001 - the outcome is the test's to judge
            outcomes[body.__name__] = f"{type(exc).__name__}: {str(exc)[:160]}"

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", hook)
    admin = sa.create_engine(admin_url)
    waited = False
    try:
        threads["first"] = threading.Thread(target=run, args=("first", first))
        threads["first"].start()
        if not paused.wait(10):
            raise AssertionError(f"{first.__name__} never reached its statement {pause_at} that takes row locks")
        threads["second"] = threading.Thread(target=run, args=("second", second))
        threads["second"].start()
        deadline = time.monotonic() + 10
        with admin.connect() as conn:
            while time.monotonic() < deadline and not waited:
                waited = bool(second_pid) and bool(
                    conn.execute(
                        sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid AND wait_event_type = 'Lock'"),
                        {"pid": second_pid[0]},
                    ).scalar()
                )
                time.sleep(0.05)
        resume.set()
        for thread in threads.values():
            thread.join(30)
    finally:
        resume.set()
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", hook)
        admin.dispose()
    return outcomes, waited
