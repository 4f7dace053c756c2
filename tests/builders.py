"""Shared builders for tests: the ledger a test opens, logical keys, completion evidence, a key's orders, the sources
and old ledgers several test modules build (plain functions and values, importable anywhere). A test module imports
these, never another test module."""

from __future__ import annotations

import datetime as dt
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import sqlalchemy as sa

from export_ledger import ExportSpec, SqlSource
from export_ledger.calendar import load_zone, window_for
from export_ledger.frames import ExportSchema, validate_frame
from export_ledger.keys import LogicalKey
from export_ledger.ledger import Claim, CompletionEvidence, ExportLedger, schema_version
from export_ledger.protocol import ExportItem, target_for
from export_ledger.stage import Stager

ZONE = "America/New_York"
BUSINESS_DATE = dt.date(2026, 3, 8)  # the spring-forward day in New York: a 23-hour window
LEDGER_LEASE = dt.timedelta(minutes=15)  # the ``ledger`` fixture's lease


def open_ledger(url: str, *, clock=None, **options) -> ExportLedger:
    """The one place the tests open a ledger (the ``ledger`` fixture is built on it): ``url`` with the test's
    ``clock`` (None: the ledger's own) and any of :class:`ExportLedger`'s options. Tests of opening itself (URLs,
    ``create=False``, ``read_only``, upgrades, unreachable ledgers, pools) call :class:`ExportLedger` directly."""
    return ExportLedger(url, clock=clock, **options)


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


def hourly_orders(key: LogicalKey, total: float = 12.5) -> pd.DataFrame:
    """Hourly orders of the key's tenant inside its window (order_id, tenant, placed_at, total)."""
    start, end = pd.Timestamp(key.window.start_utc), pd.Timestamp(key.window.end_utc)
    times = pd.date_range(start.ceil("h"), end, freq="h", inclusive="left").as_unit("us")
    return pd.DataFrame(
        {
            "order_id": [f"{key.tenant}-{int(t.timestamp())}" for t in times],
            "tenant": [key.tenant] * len(times),
            "placed_at": times,
            "total": [total] * len(times),
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


# -- moved from test_batched_ledger.py: shared by several test modules ------------------------------------------------


ORDERS_SCHEMA = ExportSchema(
    {"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"},
    "placed_at",
    ("order_id",),
    tenant_column="tenant",
)


# -- moved from test_restatement.py: shared by several test modules ---------------------------------------------------


ORDERS_DAY = dt.date(2026, 3, 2)


def orders_item(key, frame: pd.DataFrame | None = None) -> ExportItem:
    return ExportItem(key, key.window.business_date.isoformat(), hourly_orders(key) if frame is None else frame)


def corrected_orders(key) -> pd.DataFrame:
    """The key's rows after a correction: one amount changed, one late row added."""
    frame = hourly_orders(key)
    frame.loc[0, "total"] = 99.0
    late = frame.iloc[[-1]].copy()
    late["order_id"] = f"{key.tenant}-late"
    late["placed_at"] = late["placed_at"] - pd.Timedelta(minutes=30)
    return pd.concat([frame, late]).sort_values("placed_at", kind="stable").reset_index(drop=True)


def key_folder(root: Path, key) -> Path:
    return root / key.export / f"tenant={key.tenant}" / f"date={key.window.business_date.isoformat()}"


# -- moved from test_drift.py: shared by several test modules ---------------------------------------------------------


DRIFT_QUERY = (
    "SELECT order_id, tenant, placed_at, total, version FROM orders WHERE tenant = :tenant AND placed_at >= :start "
    "AND placed_at < :end ORDER BY placed_at, order_id"
)


DRIFT_COLUMNS = {"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float", "version": "int"}


def drift_day() -> dt.date:
    """Two days ago in New York: inside the default lookback of 7 business dates, and a partition Dagster has."""
    return dt.datetime.now(load_zone("America/New_York")).date() - dt.timedelta(days=2)


def drift_spec(db: Path, **overrides) -> ExportSpec:
    values = dict(
        name="orders",
        source=SqlSource(f"sqlite:///{db}", DRIFT_QUERY),
        columns=DRIFT_COLUMNS,
        id_columns=["order_id"],
        time_column="placed_at",
        tenant_column="tenant",
        version_column="version",
        tenants=["acme"],
        timezone="America/New_York",
        start_date="2026-01-01",
    )
    return ExportSpec(**{**values, **overrides})


def drift_stamp(spec: ExportSpec, minutes: int) -> str:
    start = spec.calendar.window(drift_day().isoformat()).start_utc
    return (start + dt.timedelta(minutes=minutes)).strftime("%Y-%m-%d %H:%M:%S")


def drift_source(db: Path, spec: ExportSpec, rows: int = 5) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE IF EXISTS orders")
        conn.execute("CREATE TABLE orders (order_id TEXT, tenant TEXT, placed_at TEXT, total REAL, version INTEGER)")
        conn.executemany(
            "INSERT INTO orders VALUES (?, 'acme', ?, ?, 1)",
            [(f"o{i}", drift_stamp(spec, 10 + i), float(i)) for i in range(rows)],
        )


def late_deleted_and_updated(db: Path, spec: ExportSpec) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO orders VALUES ('late', 'acme', ?, 9.5, 1)", (drift_stamp(spec, 60),))
        conn.execute("DELETE FROM orders WHERE order_id = 'o0'")
        conn.execute("UPDATE orders SET version = 2, total = 99 WHERE order_id = 'o3'")


def drift_environ(tmp_path: Path) -> dict[str, str]:
    return {
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": str(tmp_path / "x"),
    }


def ledger_at(url: str, version: int) -> None:
    """A ledger as a release before 0.5.0 left it at schema ``version``: release 0.1.0's (:func:`v1_ledger`),
    upgraded by the alembic revisions up to ``version`` (each freezes its tables as that version had them), without
    the alembic revision table those releases did not have: only ``export_ledger_schema`` says its version."""
    from alembic.config import Config
    from alembic.runtime.environment import EnvironmentContext
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from export_ledger.ledger.store import MIGRATIONS, VERSION_TABLE

    v1_ledger(url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    script = ScriptDirectory.from_config(config)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).stamp(script, "v1")
        with EnvironmentContext(
            config, script, fn=lambda revision, _: script._upgrade_revs(f"v{version}", revision),
            destination_rev=f"v{version}",
        ) as environment:  # fmt: skip
            environment.configure(connection=conn, version_table=VERSION_TABLE)
            environment.run_migrations()
        conn.execute(sa.text(f"DROP TABLE {VERSION_TABLE}"))
    engine.dispose()
    assert schema_version(sa.create_engine(url)) == version, f"the ledger is at schema {version}"


# -- moved from test_library.py: shared by several test modules -------------------------------------------------------


V1_DDL = [
    """CREATE TABLE export_runs (logical_key VARCHAR(300) PRIMARY KEY, export VARCHAR(63) NOT NULL,
    tenant VARCHAR(63) NOT NULL, business_date DATE NOT NULL, timezone VARCHAR(64) NOT NULL,
    window_start_utc TIMESTAMP WITH TIME ZONE NOT NULL, window_end_utc TIMESTAMP WITH TIME ZONE NOT NULL,
    tz_database VARCHAR(64) NOT NULL, state VARCHAR(20) NOT NULL, location VARCHAR(1024), sha256 VARCHAR(64),
    row_count BIGINT, committed_attempt VARCHAR(300), lease_owner VARCHAR(300),
    lease_expires_at TIMESTAMP WITH TIME ZONE, attempt_started_at TIMESTAMP WITH TIME ZONE,
    fencing_token BIGINT NOT NULL, created_at TIMESTAMP WITH TIME ZONE NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT uq_export_runs_business_day UNIQUE (export, tenant, timezone, business_date))""",
    """CREATE TABLE export_attempts (id INTEGER PRIMARY KEY, attempt_id VARCHAR(300) NOT NULL,
    logical_key VARCHAR(300) NOT NULL REFERENCES export_runs (logical_key), fencing_token BIGINT,
    started_at TIMESTAMP WITH TIME ZONE NOT NULL, finished_at TIMESTAMP WITH TIME ZONE NOT NULL,
    outcome VARCHAR(20) NOT NULL, error_class VARCHAR(200), error_message VARCHAR(500))""",
    """CREATE TABLE export_low_water (export VARCHAR(63) PRIMARY KEY, low_water_date DATE NOT NULL,
    pruned_total BIGINT NOT NULL, updated_at TIMESTAMP WITH TIME ZONE NOT NULL)""",
    """CREATE TABLE export_contracts (id INTEGER PRIMARY KEY, export VARCHAR(63) NOT NULL, contract TEXT NOT NULL,
    recorded_at TIMESTAMP WITH TIME ZONE NOT NULL, reason VARCHAR(500) NOT NULL)""",
]


def v1_ledger(url: str) -> None:
    """A ledger as release 0.1.0 left it: one completed key, one failed, an attempt each, a mark and a contract."""
    engine = sa.create_engine(url)
    stamp = "2026-03-09 10:00:00" if engine.dialect.name == "sqlite" else "2026-03-09 10:00:00+00"
    with engine.begin() as conn:
        for ddl in V1_DDL:
            sql = ddl if engine.dialect.name == "sqlite" else ddl.replace("INTEGER PRIMARY KEY", "SERIAL PRIMARY KEY")
            conn.execute(sa.text(sql))
        conn.execute(
            sa.text(
                "INSERT INTO export_runs VALUES (:k, 'invoice_export', :t, '2026-03-08', 'America/New_York', "
                ":s, :e, 'system 2025b', :state, :loc, :sha, :rows, :att, NULL, NULL, NULL, :token, :s, :s)"
            ),
            [
                dict(k="invoice_export/acme/2026-03-08T05:00:00Z", t="acme", state="completed", loc="/x", sha="a" * 64,
                     rows=92, att="run-1/invoice_export", token=1, s=stamp, e=stamp),
                dict(k="invoice_export/globex/2026-03-08T05:00:00Z", t="globex", state="failed", loc=None, sha=None,
                     rows=None, att=None, token=2, s=stamp, e=stamp),
            ],
        )  # fmt: skip
        conn.execute(
            sa.text("INSERT INTO export_attempts (attempt_id, logical_key, fencing_token, started_at, finished_at, "
                    "outcome) VALUES ('run-1/invoice_export', 'invoice_export/acme/2026-03-08T05:00:00Z', 1, :s, :s, "
                    "'completed')"),
            dict(s=stamp),
        )  # fmt: skip
        conn.execute(
            sa.text("INSERT INTO export_low_water VALUES ('invoice_export', '2026-01-01', 7, :s)"), dict(s=stamp)
        )
        conn.execute(
            sa.text("INSERT INTO export_contracts (export, contract, recorded_at, reason) VALUES ('invoice_export', "
                    ":c, :s, 'first materialization')"),
            dict(c='{"timezone": "America/New_York"}', s=stamp),
        )  # fmt: skip
    engine.dispose()


# -- moved from test_streaming.py: shared by several test modules -----------------------------------------------------


STREAM_SCHEMA = ORDERS_SCHEMA


STREAM_DAY = ORDERS_DAY


STREAM_KEY = key_for(STREAM_DAY, tenant="acme")


def stream_orders(rows: int = 200, *, every: str = "5min") -> pd.DataFrame:
    """Orders of acme inside STREAM_KEY's window, in file order, two per timestamp (ties broken by id)."""
    start = pd.Timestamp(STREAM_KEY.window.start_utc)
    times = pd.date_range(start, periods=(rows + 1) // 2, freq=every).as_unit("us").repeat(2)[:rows]
    return pd.DataFrame(
        {
            "order_id": [f"o{i:06d}" for i in range(rows)],
            "tenant": ["acme"] * rows,
            "placed_at": times,
            "total": [float(i) for i in range(rows)],
        }
    )


def split_frame(frame: pd.DataFrame, size: int) -> list[pd.DataFrame]:
    return [frame.iloc[i : i + size].reset_index(drop=True) for i in range(0, len(frame), size)]


# -- moved from test_validation_speed_equivalence.py: shared by several test modules ----------------------------------


INVOICE_WINDOW = window_for(dt.date(2026, 3, 10), "America/New_York")


INVOICES_SCHEMA = ExportSchema(
    {
        "invoice_id": "string",
        "tenant": "string",
        "occurred_at": "timestamp",
        "amount": "float",
        "currency": "string",
        "customer_email": "string",
    },
    "occurred_at",
    ("invoice_id",),
    tenant_column="tenant",
)


def invoices_frame(rows: int, *, ties: bool = False, shuffled: bool = False, dtype: object = object) -> pd.DataFrame:
    """Invoices spread over the window; ``ties``: seven rows share each time (ids decide their order)."""
    k = np.arange(rows, dtype=np.int64)
    step = (INVOICE_WINDOW.end_utc - INVOICE_WINDOW.start_utc) / max(rows, 1)
    times = pd.Timestamp(INVOICE_WINDOW.start_utc) + pd.to_timedelta(
        (k // 7 if ties else k) * step.total_seconds(), unit="s"
    ).round("us")
    mixed = (k * 2654435761 + 12345) % 1_000_003
    frame = pd.DataFrame(
        {
            "invoice_id": pd.Series([f"acme-{i:012d}" for i in (rows - k if ties else k)], dtype=dtype),
            "tenant": pd.Series(["acme"] * rows, dtype=dtype),
            "occurred_at": times,
            "amount": np.round(5 + (mixed % 250_000) / 100.0, 2),
            "currency": pd.Series(np.array(["USD", "EUR", "GBP", "CAD"], dtype=object)[mixed % 4], dtype=dtype),
            "customer_email": pd.Series([f"customer{m % 5000}@example.com" for m in mixed], dtype=dtype),
        }
    )
    if ties:
        frame = frame.sort_values(["occurred_at", "invoice_id"], kind="stable").reset_index(drop=True)
    if shuffled:
        frame = frame.iloc[(k * 7919) % rows].reset_index(drop=True)
    return frame


def commit_unrecorded(destination, schema: ExportSchema, claim: Claim, key: LogicalKey, rows: pd.DataFrame) -> None:
    """What an attempt that published ``rows`` for ``claim`` and died before recording leaves behind, made with the
    destination's own steps: the key fenced with the claim's token (when anyone held it before), the revision
    staged at the attempt's place and committed; nothing recorded in the ledger."""
    target, token = target_for(key, claim.revision), claim.fencing_token
    if token > 1:
        destination.fence(target, token, logical_key=claim.logical_key)
    table = validate_frame(rows, schema, claim.window, what=claim.logical_key)
    template = Stager(schema, "csv", lambda level, message: None).manifest_template(claim, key)
    staged = destination.stage(target, token, table, "csv", template)
    destination.commit(staged, token, superseded=claim.superseded_revision)
