"""Profile the ledger against the benchmark's raw SQL of the same transactions: one key at a time, and in groups of 50.

Run from the project root:  python -m benchmarks.profiles.ledger_profile [--postgres]
Writes benchmarks/profiles/ledger-single-key.txt and benchmarks/profiles/ledger-groups.txt (the summary lines at the
top of each are added by hand).
"""

from __future__ import annotations

import collections
import cProfile
import datetime as dt
import io
import pstats
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event

from benchmarks.ledger_throughput import (
    PAST_YEAR,
    TIMEZONE,
    RawSqlLedger,
    _keys,
    _sqlite_connection,
)
from export_ledger.calendar import tz_database_version, window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import CompletionEvidence, ExportLedger, dispose_engines, ledger_engine
from export_ledger.protocol import DEFAULT_GROUP_SIZE

KEYS = 500
OUT = Path("benchmarks/profiles/ledger-single-key.txt")
GROUPS_OUT = Path("benchmarks/profiles/ledger-groups.txt")
PG = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd="/work/main", capture_output=True, text=True, check=True).stdout.strip()


class TimedCursor:
    """Counts and times the raw side's statements by their first word (COMMIT included)."""

    def __init__(self, cursor, tally):
        self._cursor, self._tally = cursor, tally

    def execute(self, sql, params=()):
        start = time.perf_counter()
        try:
            return self._cursor.execute(sql, params)
        finally:
            entry = self._tally[sql.split()[0].upper()]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._cursor, name)


class TimedConnection:
    def __init__(self, conn, tally):
        self._conn, self._tally = conn, tally

    def cursor(self):
        return TimedCursor(self._conn.cursor(), self._tally)

    def commit(self):
        start = time.perf_counter()
        try:
            return self._conn.commit()
        finally:
            entry = self._tally["COMMIT"]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._conn, name)


def ledger_counter(engine):
    """Counts the ledger's statements (before_cursor_execute) and DBAPI commits, and times commits."""
    tally = collections.defaultdict(lambda: [0, 0.0])

    @event.listens_for(engine, "before_cursor_execute")
    def _count(conn, cursor, statement, parameters, context, executemany):
        tally[statement.split()[0].upper()][0] += 1

    @event.listens_for(engine, "commit")
    def _commit(conn):
        tally["(commit event)"][0] += 1

    return tally


def run_ledger(ledger, keys):
    for key in keys:
        claim = ledger.claims.claim(key, "bench/attempt")
        ledger.completions.complete(
            claim, CompletionEvidence(f"/exports/{key}", "0" * 64, 96, claim.attempt_id, claim.fencing_token)
        )


def run_raw(raw, keys, tz_database):
    for key in keys:
        raw.claim_and_complete(key, "bench/attempt", tz_database)


def run_ledger_groups(ledger, keys):
    for first in range(0, len(keys), DEFAULT_GROUP_SIZE):
        claims = ledger.claims.claim_many(keys[first : first + DEFAULT_GROUP_SIZE], "bench/attempt")
        ledger.completions.complete_many(
            [
                (c, CompletionEvidence(f"/exports/{c.logical_key}", "0" * 64, 96, c.attempt_id, c.fencing_token))
                for c in claims
            ]
        )


def run_raw_groups(raw, keys, tz_database):
    for first in range(0, len(keys), DEFAULT_GROUP_SIZE):
        raw.claim_and_complete_group(keys[first : first + DEFAULT_GROUP_SIZE], "bench/attempt", tz_database)


def run_keys(prefix: str, windows, days: int = 31, tenants: int = 10) -> list[LogicalKey]:
    """A 31-partition x 10-tenant run's keys in the order the asset lists them, as the benchmark's batched variant."""
    return [
        LogicalKey("invoice_export", f"{prefix}{t:03d}", window) for window in windows[:days] for t in range(tenants)
    ]


def measure_groups(dialect, ledger_url, raw_conn, prefix, lines, rounds=3):
    """Groups of 50: statements per group, ms per key on both sides, and a cProfile of the ledger's side."""
    windows = [window_for(PAST_YEAR + dt.timedelta(days=d), TIMEZONE) for d in range(365)]
    tz_database = tz_database_version(TIMEZONE)
    ledger = ExportLedger(ledger_url)
    engine = ledger_engine(ledger_url)
    raw_tally = collections.defaultdict(lambda: [0, 0.0])
    raw = RawSqlLedger(dialect, TimedConnection(raw_conn, raw_tally))
    run_ledger_groups(ledger, run_keys(f"{prefix}w", windows))
    run_raw_groups(raw, run_keys(f"{prefix}x", windows), tz_database)
    raw_tally.clear()
    tally = ledger_counter(engine)
    ledger_s = raw_s = 0.0
    keys = 0
    for r in range(rounds):
        batch = run_keys(f"{prefix}l{r}", windows)
        start = time.perf_counter()
        run_ledger_groups(ledger, batch)
        ledger_s += time.perf_counter() - start
        batch = run_keys(f"{prefix}r{r}", windows)
        start = time.perf_counter()
        run_raw_groups(raw, batch, tz_database)
        raw_s += time.perf_counter() - start
        keys += len(batch)
    groups = keys / DEFAULT_GROUP_SIZE
    counted = {k: list(v) for k, v in tally.items()}
    profiler = cProfile.Profile()
    profiler.enable()
    run_ledger_groups(ledger, run_keys(f"{prefix}p", windows))
    profiler.disable()
    stats = pstats.Stats(profiler)
    prof_total = sum(v[2] for v in stats.stats.values())
    lines += [
        f"{dialect}: {rounds} runs of 31 x 10 keys in groups of {DEFAULT_GROUP_SIZE}, unprofiled, after a warm-up run",
        f"  ledger  {1000 * ledger_s / keys:7.3f} ms/key   raw SQL in groups {1000 * raw_s / keys:7.3f} ms/key   "
        f"ratio (ledger/raw throughput) {raw_s / ledger_s:.3f}",
        f"  ledger statements per group (before_cursor_execute, first word): {fmt(counted, groups)}",
        f"  raw    statements per group (driver cursor.execute / commit):    {fmt(raw_tally, groups)}",
        f"  ledger (profiled run, {1000 * prof_total / len(run_keys('', windows)):.3f} ms/key under cProfile): DBAPI "
        f"commit {1000 * commit_time(stats, dialect) / len(run_keys('', windows)):.3f} ms/key",
    ]
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats("cumulative").print_stats(45)
    return buffer.getvalue().rstrip()


def fmt(tally, keys):
    return ", ".join(f"{k} {v[0] / keys:.2f}" for k, v in sorted(tally.items()))


def commit_time(stats: pstats.Stats, dialect: str) -> float:
    needle = "of 'sqlite3.Connection'" if dialect == "sqlite" else "of 'psycopg2.extensions.connection'"
    total = 0.0
    for (_filename, _line, name), (_cc, _nc, tt, _ct, _c) in stats.stats.items():
        if "commit" in name and needle in name:
            total += tt
    return total


def measure(dialect, ledger_url, raw_conn, prefix, lines, profile_to_file):
    windows = [window_for(PAST_YEAR + dt.timedelta(days=d), TIMEZONE) for d in range(365)]
    tz_database = tz_database_version(TIMEZONE)
    ledger = ExportLedger(ledger_url)
    engine = ledger_engine(ledger_url)
    raw_tally = collections.defaultdict(lambda: [0, 0.0])
    raw = RawSqlLedger(dialect, TimedConnection(raw_conn, raw_tally))
    # warm-up, then counted runs
    run_ledger(ledger, _keys(f"{prefix}w", 50, windows))
    run_raw(raw, _keys(f"{prefix}x", 50, windows), tz_database)
    raw_tally.clear()
    tally = ledger_counter(engine)
    start = time.perf_counter()
    run_ledger(ledger, _keys(f"{prefix}l", KEYS, windows))
    ledger_s = time.perf_counter() - start
    start = time.perf_counter()
    run_raw(raw, _keys(f"{prefix}r", KEYS, windows), tz_database)
    raw_s = time.perf_counter() - start
    raw_commit_s = raw_tally["COMMIT"][1]
    counted = {k: list(v) for k, v in tally.items()}
    profiler = cProfile.Profile()
    profiler.enable()
    run_ledger(ledger, _keys(f"{prefix}p", KEYS, windows))
    profiler.disable()
    stats = pstats.Stats(profiler)
    prof_total = sum(v[2] for v in stats.stats.values())
    ledger_commit = commit_time(stats, dialect)
    lines += [
        f"{dialect}: {KEYS} keys, unprofiled, one pass each after 50 warm-up keys",
        f"  ledger  {1000 * ledger_s / KEYS:7.3f} ms/key   raw SQL {1000 * raw_s / KEYS:7.3f} ms/key   "
        f"ratio (ledger/raw throughput) {raw_s / ledger_s:.3f}",
        f"  ledger statements per key (before_cursor_execute, first word): {fmt(counted, KEYS)}",
        f"  raw    statements per key (driver cursor.execute / commit):    {fmt(raw_tally, KEYS)}",
        f"  raw: commit {1000 * raw_commit_s / KEYS:.3f} ms/key = {100 * raw_commit_s / raw_s:.0f}% of raw time",
        f"  ledger (profiled run, {1000 * prof_total / KEYS:.3f} ms/key under cProfile): DBAPI commit "
        f"{1000 * ledger_commit / KEYS:.3f} ms/key = {100 * ledger_commit / prof_total:.0f}%",
    ]
    if profile_to_file:
        for label, needles in (
            ("claims.claim", ("claims.py", "(claim)")),
            ("completions.complete", ("completions.py", "(complete)")),
            ("Connection.execute (SQLAlchemy)", ("engine/base.py", "(execute)")),
            ("_execute_context (SQLAlchemy)", ("engine/base.py", "(_execute_context)")),
            ("compile (SQLAlchemy)", ("elements.py", "(_compile_w_cache)")),
            ("cursor.execute (driver)", ("'execute' of 'sqlite3.Cursor'",)),
            ("DBAPI commit", ("'commit' of 'sqlite3.Connection'",)),
        ):
            best = 0.0
            for (filename, line, name), (_cc, _nc, _tt, ct, _c) in stats.stats.items():
                text = f"{filename}:{line}({name})"
                if all(n in text for n in needles):
                    best = max(best, ct)
            lines.append(f"    {label:36s} {1000 * best / KEYS:7.3f} ms/key cumulative (profiled)")
        stats.dump_stats(str(Path(tempfile.gettempdir()) / "ledger.prof"))
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats("cumulative").print_stats(40)
        return buffer.getvalue().rstrip()
    return None


def main() -> None:
    commit = git("rev-parse", "--short", "HEAD")
    if git("status", "--short"):
        commit += " with uncommitted changes"
    lines = [
        f"# cProfile of the single-key ledger: {KEYS} keys of ledger.claims.claim(key) + ledger.completions.complete"
        "(claim, evidence),",
        "# against benchmarks.ledger_throughput.RawSqlLedger (same two transactions on the driver); SQLite on temp",
        "# files (WAL, synchronous=FULL, BEGIN IMMEDIATE on both sides); statements counted with a SQLAlchemy",
        "# before_cursor_execute listener on export_ledger.ledger.ledger_engine(url); a counting cursor raw side.",
        "# Rerun: python -m benchmarks.profiles.ledger_profile --postgres",
        f"# Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}.",
        "# 2 shared cores, loaded by other engineers' work: absolute times are noisy, compare shares.",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="prof-ledger-") as tmp:
        ledger_url = f"sqlite:///{tmp}/ledger.sqlite3"
        baseline = f"{tmp}/baseline.sqlite3"
        ledger_engine(f"sqlite:///{baseline}")
        conn = _sqlite_connection(baseline)
        try:
            table = measure("sqlite", ledger_url, conn, "s", lines, True)
        finally:
            conn.close()
            dispose_engines()
    if "--postgres" in sys.argv:
        import psycopg2

        schemas = [f"prof_{uuid.uuid4().hex[:8]}_l", f"prof_{uuid.uuid4().hex[:8]}_r"]
        admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            for s in schemas:
                c.execute(sa.schema.CreateSchema(s))
        try:
            urls = [f"{PG}?options=-csearch_path%3D{s}" for s in schemas]
            ledger_engine(urls[1])
            conn = psycopg2.connect(
                host="127.0.0.1", port=5432, user="postgres", dbname="test", options=f"-csearch_path={schemas[1]}"
            )
            try:
                lines.append("")
                measure("postgresql", urls[0], conn, "p", lines, False)
            finally:
                conn.close()
                dispose_engines()
        finally:
            with admin.connect() as c:
                for s in schemas:
                    c.execute(sa.schema.DropSchema(s, cascade=True))
            admin.dispose()
    lines += ["", f"pstats of the ledger, {KEYS} keys on SQLite, sorted by cumulative (top 40):", table]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    groups(commit)


def groups(commit: str) -> None:
    lines = [
        f"# cProfile of the ledger in groups of {DEFAULT_GROUP_SIZE}: a 31-partition x 10-tenant run's keys through "
        "claims.claim_many + completions.complete_many,",
        "# against benchmarks.ledger_throughput.RawSqlLedger.claim_and_complete_group (one multi-row INSERT ... ON "
        "CONFLICT, one UPDATE ... FROM (VALUES) ... RETURNING and one attempt insert per group).",
        "# Rerun: python -m benchmarks.profiles.ledger_profile --postgres",
        f"# Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}.",
        "",
    ]
    tables = []
    with tempfile.TemporaryDirectory(prefix="prof-ledger-groups-") as tmp:
        baseline = f"{tmp}/baseline.sqlite3"
        ledger_engine(f"sqlite:///{baseline}")
        conn = _sqlite_connection(baseline)
        try:
            tables.append(("sqlite", measure_groups("sqlite", f"sqlite:///{tmp}/ledger.sqlite3", conn, "g", lines)))
        finally:
            conn.close()
            dispose_engines()
    if "--postgres" in sys.argv:
        import psycopg2

        schemas = [f"prof_{uuid.uuid4().hex[:8]}_l", f"prof_{uuid.uuid4().hex[:8]}_r"]
        admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            for s in schemas:
                c.execute(sa.schema.CreateSchema(s))
        try:
            urls = [f"{PG}?options=-csearch_path%3D{s}" for s in schemas]
            ledger_engine(urls[1])
            conn = psycopg2.connect(
                host="127.0.0.1", port=5432, user="postgres", dbname="test", options=f"-csearch_path={schemas[1]}"
            )
            try:
                lines.append("")
                tables.append(("postgresql", measure_groups("postgresql", urls[0], conn, "h", lines)))
            finally:
                conn.close()
                dispose_engines()
        finally:
            with admin.connect() as c:
                for s in schemas:
                    c.execute(sa.schema.DropSchema(s, cascade=True))
            admin.dispose()
    for dialect, table in tables:
        lines += [
            "",
            f"pstats of the ledger's groups on {dialect}, one 31 x 10 run, sorted by cumulative (top 45):",
            table,
        ]
    GROUPS_OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
