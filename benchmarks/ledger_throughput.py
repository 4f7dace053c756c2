"""Benchmark 2: claim + complete per second through ``ExportLedger`` against the same two durable transactions
written by hand in raw SQL on the database driver (sqlite3, psycopg2), on the same schema.

Each key costs two transactions on both sides:

1. claim: lock, look the key up by (export, tenant, zone, business date), insert the ``in_progress`` row; commit.
2. complete: the guarded ``UPDATE ... WHERE logical_key AND state AND fencing_token AND lease_owner``, append the
   attempt row, read the row back; commit.

Beside it, the **batched ledger** of a run of many keys: the keys of a 31-partition x 10-tenant run (310 keys; 4 x 3
in ``--smoke``) claimed and completed the way :func:`export_batch` records them, in groups of
:data:`~export_ledger.protocol.DEFAULT_GROUP_SIZE` (one ``claim_many`` and one ``complete_many`` transaction per group),
against the raw per-key transactions above for the same number of keys. Judged: the ledger's cost per key in that run
over the raw SQL's cost per key (the single-key ratio stays reported).

SQLite runs in WAL mode with ``synchronous=FULL`` and ``BEGIN IMMEDIATE`` on both sides; PostgreSQL uses
``SELECT ... FOR UPDATE`` and the server's default durable commit. Ledger and baseline use separate databases
(files, or schemas) of the same schema, created by the ledger.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Callable

import sqlalchemy as sa

from benchmarks.common import (
    Settings,
    interleaved,
    median,
    postgres_schema,
    postgres_unavailable_reason,
    scratch_dir,
    target,
)
from export_ledger.calendar import tz_database_version, window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import Claim, CompletionEvidence, ExportLedger, ExportRecord, dispose_engines, ledger_engine
from export_ledger.protocol import DEFAULT_GROUP_SIZE

NAME = "ledger_throughput"
TIMEZONE = "America/New_York"
UTC = dt.timezone.utc
LEASE = dt.timedelta(minutes=15)
#: First days of the single-key and the batched keys (different years: their keys never meet). Every window has ended
#: by now, as a claim needs (the ledger refuses a window that has not ended, by its own clock).
PAST_YEAR = dt.date(2025, 1, 1)
BATCH_YEAR = dt.date(2024, 1, 1)

_COLUMNS = (
    "logical_key, export, tenant, business_date, timezone, window_start_utc, window_end_utc, tz_database, state, "
    "lease_owner, lease_expires_at, attempt_started_at, fencing_token, created_at, updated_at"
)
SQL = {
    "sqlite": {
        "begin": "BEGIN IMMEDIATE",
        "find": "SELECT * FROM export_runs WHERE export = ? AND tenant = ? AND timezone = ? AND business_date = ?",
        "insert_run": (
            f"INSERT INTO export_runs ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, 1, ?, ?)"
        ),
        "complete": (
            "UPDATE export_runs SET state = 'completed', lease_owner = NULL, lease_expires_at = NULL, updated_at = ?, "
            "location = ?, sha256 = ?, row_count = ?, committed_attempt = ? "
            "WHERE logical_key = ? AND state IN ('in_progress') AND fencing_token = ? AND lease_owner = ?"
        ),
        "insert_attempt": (
            "INSERT INTO export_attempts (attempt_id, logical_key, fencing_token, started_at, finished_at, outcome) "
            "VALUES (?, ?, ?, ?, ?, 'completed')"
        ),
        "get": "SELECT * FROM export_runs WHERE logical_key = ?",
    },
    "postgresql": {
        "begin": None,  # psycopg2 opens the transaction with the first statement
        "find": (
            "SELECT * FROM export_runs WHERE export = %s AND tenant = %s AND timezone = %s AND business_date = %s "
            "FOR UPDATE"
        ),
        "insert_run": (
            f"INSERT INTO export_runs ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'in_progress', %s, %s, %s, "
            "1, %s, %s)"
        ),
        "complete": (
            "UPDATE export_runs SET state = 'completed', lease_owner = NULL, lease_expires_at = NULL, updated_at = %s, "
            "location = %s, sha256 = %s, row_count = %s, committed_attempt = %s "
            "WHERE logical_key = %s AND state IN ('in_progress') AND fencing_token = %s AND lease_owner = %s"
        ),
        "insert_attempt": (
            "INSERT INTO export_attempts (attempt_id, logical_key, fencing_token, started_at, finished_at, outcome) "
            "VALUES (%s, %s, %s, %s, %s, 'completed')"
        ),
        "get": "SELECT * FROM export_runs WHERE logical_key = %s",
    },
}


class RawSqlLedger:
    """The hand-written baseline: the same two transactions per key, straight on the driver."""

    def __init__(self, dialect: str, connection) -> None:
        self.dialect = dialect
        self.conn = connection
        self.sql = SQL[dialect]

    def _stamp(self, value: dt.datetime):
        # SQLite holds naive UTC text (as the ledger's UtcDateTime type writes it); PostgreSQL takes timestamptz.
        return value.replace(tzinfo=None).isoformat(" ") if self.dialect == "sqlite" else value

    def _transaction(self, body: Callable[[object], object]):
        cursor = self.conn.cursor()
        try:
            if self.sql["begin"]:
                cursor.execute(self.sql["begin"])
            value = body(cursor)
            self.conn.commit() if self.dialect == "postgresql" else cursor.execute("COMMIT")
            return value
        except BaseException:
            self.conn.rollback()
            raise
        finally:
            cursor.close()

    def claim_and_complete(self, key: LogicalKey, attempt_id: str, tz_database: str) -> None:
        now = dt.datetime.now(UTC)
        window = key.window
        logical_key = str(key)

        def claim(cursor):
            cursor.execute(
                self.sql["find"], (key.export, key.tenant, window.timezone, window.business_date.isoformat())
            )
            if cursor.fetchone() is not None:
                raise RuntimeError(f"{logical_key} exists already")
            cursor.execute(
                self.sql["insert_run"],
                (
                    logical_key,
                    key.export,
                    key.tenant,
                    window.business_date.isoformat(),
                    window.timezone,
                    self._stamp(window.start_utc),
                    self._stamp(window.end_utc),
                    tz_database,
                    attempt_id,
                    self._stamp(now + LEASE),
                    self._stamp(now),
                    self._stamp(now),
                    self._stamp(now),
                ),
            )

        self._transaction(claim)
        done = dt.datetime.now(UTC)

        def complete(cursor):
            cursor.execute(
                self.sql["complete"],
                (self._stamp(done), f"/exports/{logical_key}", "0" * 64, 96, attempt_id, logical_key, 1, attempt_id),
            )
            if cursor.rowcount != 1:
                raise RuntimeError(f"{logical_key}: guarded update matched {cursor.rowcount} rows")
            cursor.execute(
                self.sql["insert_attempt"], (attempt_id, logical_key, 1, self._stamp(now), self._stamp(done))
            )
            cursor.execute(self.sql["get"], (logical_key,))
            return cursor.fetchone()

        self._transaction(complete)

    def claim_and_complete_group(self, keys: list[LogicalKey], attempt_id: str, tz_database: str) -> None:
        """The floor of a group: two transactions for the whole group, each one statement per table. The claim is one
        multi-row ``INSERT ... ON CONFLICT DO NOTHING RETURNING``; the completion one ``UPDATE ... FROM (VALUES ...)
        ... RETURNING`` with the same guard per row, and one multi-row insert of the attempt rows."""
        p = "?" if self.dialect == "sqlite" else "%s"
        now = dt.datetime.now(UTC)
        names = [str(key) for key in keys]

        def claim(cursor):
            row = f"({', '.join([p] * 8)}, 'in_progress', {p}, {p}, {p}, 1, {p}, {p}, 1)"  # claim_count 1, as a claim
            params: list = []
            for key, name in zip(keys, names, strict=True):
                window = key.window
                params += [
                    name, key.export, key.tenant, window.business_date.isoformat(), window.timezone,
                    self._stamp(window.start_utc), self._stamp(window.end_utc), tz_database, attempt_id,
                    self._stamp(now + LEASE), self._stamp(now), self._stamp(now), self._stamp(now),
                ]  # fmt: skip
            cursor.execute(
                f"INSERT INTO export_runs ({_COLUMNS}, claim_count) VALUES {', '.join([row] * len(keys))} "
                "ON CONFLICT DO NOTHING RETURNING logical_key",
                params,
            )
            claimed = cursor.fetchall()
            if len(claimed) != len(keys):
                raise RuntimeError(f"{len(keys) - len(claimed)} of a group's keys exist already")

        self._transaction(claim)
        done = dt.datetime.now(UTC)

        def complete(cursor):
            values, params = [], []
            for name in names:
                values.append(f"({p}, {p}, {p}, {p}, {p})")
                params += [name, 1, attempt_id, f"/exports/{name}", "0" * 64]
            cursor.execute(
                f"WITH v (logical_key, fencing_token, lease_owner, location, sha256) AS (VALUES {', '.join(values)}) "
                f"UPDATE export_runs SET state = 'completed', lease_owner = NULL, lease_expires_at = NULL, "
                f"updated_at = {p}, location = v.location, sha256 = v.sha256, row_count = 96, "
                "committed_attempt = v.lease_owner FROM v WHERE export_runs.logical_key = v.logical_key "
                "AND export_runs.state IN ('in_progress') AND export_runs.fencing_token = v.fencing_token "
                f"AND export_runs.lease_owner = v.lease_owner RETURNING {'*' if p == '?' else 'export_runs.*'}",
                [*params, self._stamp(done)],  # the VALUES come first in the statement, then updated_at
            )
            rows = cursor.fetchall()
            if len(rows) != len(names):
                raise RuntimeError(f"guarded group update matched {len(rows)} of {len(names)} rows")
            attempt = f"({p}, {p}, 1, {p}, {p}, 'completed')"
            cursor.execute(
                "INSERT INTO export_attempts (attempt_id, logical_key, fencing_token, started_at, finished_at, "
                f"outcome) VALUES {', '.join([attempt] * len(names))}",
                [v for name in names for v in (attempt_id, name, self._stamp(now), self._stamp(done))],
            )
            return rows

        self._transaction(complete)


def _sqlite_connection(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in (
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=FULL",
        "PRAGMA busy_timeout=30000",
        "PRAGMA foreign_keys=ON",
    ):
        conn.execute(pragma)
    return conn


def _keys(prefix: str, count: int, windows: list) -> list[LogicalKey]:
    return [
        LogicalKey("invoice_export", f"{prefix}{i // len(windows):05d}", windows[i % len(windows)])
        for i in range(count)
    ]


def _measure(backend: str, ledger_url: str, baseline: RawSqlLedger, per_trial: int, repeats: int, warmup: bool) -> dict:
    ledger = ExportLedger(ledger_url)
    windows = [window_for(PAST_YEAR + dt.timedelta(days=d), TIMEZONE) for d in range(365)]
    tz_database = tz_database_version(TIMEZONE)
    batches: dict[str, list[LogicalKey]] = {}

    def setup(name: str, rep: int) -> None:
        batches[name] = _keys(f"{name[0]}{rep + 1:03d}t", per_trial, windows)

    def run_ledger(_rep: int) -> None:
        for key in batches["ledger"]:
            claim = ledger.claims.claim(key, "bench/attempt")
            ledger.completions.complete(
                claim, CompletionEvidence(f"/exports/{key}", "0" * 64, 96, claim.attempt_id, claim.fencing_token)
            )

    def run_baseline(_rep: int) -> None:
        for key in batches["baseline"]:
            baseline.claim_and_complete(key, "bench/attempt", tz_database)

    times = interleaved({"ledger": run_ledger, "baseline": run_baseline}, repeats, setup=setup, warmup=warmup)
    rates = {name: [per_trial / t for t in values] for name, values in times.items()}
    ledger_rate, baseline_rate = median(rates["ledger"]), median(rates["baseline"])
    return {
        "backend": backend,
        "keys_per_trial": per_trial,
        "repeats": repeats,
        "ledger_keys_per_s": round(ledger_rate, 1),
        "baseline_keys_per_s": round(baseline_rate, 1),
        "ratio": round(ledger_rate / baseline_rate, 4),
        "all_keys_per_s": {name: [round(r, 1) for r in values] for name, values in rates.items()},
        "ledger_ms_per_key": round(1000 / ledger_rate, 3),
        "baseline_ms_per_key": round(1000 / baseline_rate, 3),
    }


def _measure_batch(
    backend: str, ledger_url: str, baseline: RawSqlLedger, shape: tuple[int, int], repeats: int, warmup: bool
) -> dict:
    """Ledger cost per key inside one run of ``days`` partitions x ``tenants`` tenants, batched as export_batch
    records it, against the raw per-key transactions for as many keys."""
    days, tenants = shape
    ledger = ExportLedger(ledger_url)
    windows = [window_for(BATCH_YEAR + dt.timedelta(days=d), TIMEZONE) for d in range(days)]
    tz_database = tz_database_version(TIMEZONE)
    per_trial = days * tenants
    batches: dict[str, list[LogicalKey]] = {}

    def setup(name: str, rep: int) -> None:
        # A run's keys in the order the asset lists them: partition by partition, every tenant of each.
        prefix = f"{name[0]}{rep + 1:03d}r"
        batches[name] = [
            LogicalKey("invoice_export", f"{prefix}{t:03d}", window) for window in windows for t in range(tenants)
        ]

    def run_ledger(_rep: int) -> None:
        keys = batches["ledger_batch"]
        for first in range(0, len(keys), DEFAULT_GROUP_SIZE):
            claims = ledger.claims.claim_many(keys[first : first + DEFAULT_GROUP_SIZE], "bench/attempt")
            if not all(isinstance(c, Claim) for c in claims):
                raise RuntimeError(f"a fresh key was not claimed: {[c for c in claims if not isinstance(c, Claim)]}")
            done = ledger.completions.complete_many(
                [
                    (c, CompletionEvidence(f"/exports/{c.logical_key}", "0" * 64, 96, c.attempt_id, c.fencing_token))
                    for c in claims
                ]
            )
            if not all(isinstance(record, ExportRecord) for record in done):
                raise RuntimeError(f"a fresh claim was fenced: {[r for r in done if not isinstance(r, ExportRecord)]}")

    def run_baseline(_rep: int) -> None:
        for key in batches["baseline"]:
            baseline.claim_and_complete(key, "bench/attempt", tz_database)

    def run_raw_groups(_rep: int) -> None:
        keys = batches["raw_groups"]
        for first in range(0, len(keys), DEFAULT_GROUP_SIZE):
            baseline.claim_and_complete_group(keys[first : first + DEFAULT_GROUP_SIZE], "bench/attempt", tz_database)

    variants = {"ledger_batch": run_ledger, "baseline": run_baseline, "raw_groups": run_raw_groups}
    times = interleaved(variants, repeats, setup=setup, warmup=warmup)
    ms_per_key = {name: 1000 * median(values) / per_trial for name, values in times.items()}
    return {
        "backend": backend,
        "run": f"{days} partitions x {tenants} tenants",
        "keys_per_run": per_trial,
        "group_size": DEFAULT_GROUP_SIZE,
        "repeats": repeats,
        "ledger_batch_ms_per_key": round(ms_per_key["ledger_batch"], 4),
        "baseline_ms_per_key": round(ms_per_key["baseline"], 4),
        "raw_groups_ms_per_key": round(ms_per_key["raw_groups"], 4),
        "cost_ratio": round(ms_per_key["ledger_batch"] / ms_per_key["baseline"], 4),
        # Throughput against the raw floor of the same groups (raw cost over the ledger's: higher is better).
        "group_ratio": round(ms_per_key["raw_groups"] / ms_per_key["ledger_batch"], 4),
        "all_s": {name: [round(v, 4) for v in values] for name, values in times.items()},
    }


def _batch_row(label: str, r: dict, raw: str) -> dict:
    """A table row of the batched ledger against the raw variant ``raw`` (``baseline``: one key at a time)."""
    ledger_ms, raw_ms = r["ledger_batch_ms_per_key"], r[f"{raw}_ms_per_key"]
    return {
        "backend": label,
        "ledger keys/s": round(1000 / ledger_ms, 1),
        "raw SQL keys/s": round(1000 / raw_ms, 1),
        "ledger ms/key": ledger_ms,
        "raw ms/key": raw_ms,
        "ratio": round(raw_ms / ledger_ms, 4),
    }


def run(settings: Settings) -> dict:
    per_trial = 20 if settings.smoke else 200
    shape = (4, 3) if settings.smoke else (31, 10)
    batched = []
    repeats = settings.reps(full=7)
    results, notes = [], []
    with scratch_dir(settings.scratch, NAME) as folder:
        ledger_url = f"sqlite:///{folder / 'ledger.sqlite3'}"
        baseline_path = folder / "baseline.sqlite3"
        ledger_engine(f"sqlite:///{baseline_path}")  # the ledger's schema, for the hand-written side too
        conn = _sqlite_connection(str(baseline_path))
        try:
            raw = RawSqlLedger("sqlite", conn)
            results.append(_measure("sqlite", ledger_url, raw, per_trial, repeats, not settings.smoke))
            batched.append(_measure_batch("sqlite", ledger_url, raw, shape, repeats, not settings.smoke))
        finally:
            conn.close()
            dispose_engines()

    reason = postgres_unavailable_reason()
    if reason is not None:
        notes.append(f"postgresql skipped: {reason}")
    else:
        import psycopg2

        with postgres_schema("bench_ledger") as (ledger_url, _), postgres_schema("bench_raw") as (raw_url, raw_schema):
            ledger_engine(raw_url)
            parsed = sa.engine.make_url(raw_url)
            conn = psycopg2.connect(
                host=parsed.host,
                port=parsed.port,
                user=parsed.username,
                password=parsed.password,
                dbname=parsed.database,
                options=f"-csearch_path={raw_schema}",
            )
            try:
                raw = RawSqlLedger("postgresql", conn)
                results.append(_measure("postgresql", ledger_url, raw, per_trial, repeats, not settings.smoke))
                batched.append(_measure_batch("postgresql", ledger_url, raw, shape, repeats, not settings.smoke))
            finally:
                conn.close()
                dispose_engines()

    return {
        "description": (
            "claim + complete per second: ExportLedger vs the same two transactions in raw SQL, one key at a time "
            "and batched as a run of many keys records them"
        ),
        "results": results,
        "batched": batched,
        "table": [
            {
                "backend": r["backend"],
                "ledger keys/s": r["ledger_keys_per_s"],
                "raw SQL keys/s": r["baseline_keys_per_s"],
                "ledger ms/key": r["ledger_ms_per_key"],
                "raw ms/key": r["baseline_ms_per_key"],
                "ratio": r["ratio"],
            }
            for r in results
        ]
        + [_batch_row(f"{r['backend']}, raw SQL in groups of {r['group_size']}", r, "raw_groups") for r in batched]
        + [_batch_row(f"{r['backend']}, batched {r['run']}", r, "baseline") for r in batched],
        "targets": [
            target(f"{r['backend']}: ledger / raw SQL throughput", r["ratio"], 0.5, at_most=False) for r in results
        ]
        + [
            target(
                f"{r['backend']}: ledger / raw SQL throughput, both in groups of {r['group_size']}",
                r["group_ratio"],
                0.5,
                at_most=False,
            )
            for r in batched
        ]
        + [
            target(
                f"{r['backend']}: batch ledger cost per key in a {r['run']} run / raw per-key SQL",
                r["cost_ratio"],
                1.0,
                at_most=True,
            )
            for r in batched
        ],
        "notes": notes,
    }
