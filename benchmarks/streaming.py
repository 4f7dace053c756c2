"""Benchmark 6: one large partition from the SQL source, streamed in bounded batches against the whole-frame path.

One key of ``invoice_export`` whose source is a :class:`~export_ledger.sources.SqlSource` on PostgreSQL holding
10M rows of one tenant's day (20,000 in ``--smoke``), generated on the server, with an index on the file order
(``occurred_at, invoice_id COLLATE "C"``). Two variants, interleaved, each in a fresh child process (a fresh ledger
and destination per run, made before the clock starts):

* ``streamed``: ``ExportItem.streamed``: ``SqlSource.batches`` on a server-side cursor (``DEFAULT_BATCH_ROWS``:
  50,000 rows a batch) -> validation batch by batch -> CSV writer fed per batch -> streaming SHA-256 -> fsync,
  publish, ledger commit.
* ``whole_frame``: ``SqlSource.rows`` + ``conform`` into one DataFrame -> ``export_key`` as every DataFrame export.

Timed inside the child: from the source query to the ledger commit (imports and setup excluded). Memory: the
child's peak resident set (``VmHWM`` of ``/proc/self/status``, read by the child when its export ended; Python and
the libraries alone are reported beside it as ``after_imports``), so it is measured, not estimated.

Flat memory (issue #21): a partition a tenth the size (1M rows; 2,000 in ``--smoke``), in a table of its own, is
streamed the same way, in child processes of the same kind, and the large partition's peak RSS is judged against
its peak: memory that stays flat makes the ratio about 1, whatever the rows.

Without a PostgreSQL server the same runs use a SQLite source, and the JSON says so.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa

from benchmarks.common import (
    PROJECT_ROOT,
    Settings,
    median,
    postgres_schema,
    postgres_unavailable_reason,
    scratch_dir,
    target,
)
from export_ledger.sources import DEFAULT_BATCH_ROWS

NAME = "streaming"
TIMEZONE = "America/New_York"
BUSINESS_DATE = dt.date(2026, 3, 10)
TENANT = "acme"
#: The small partition is the large one's rows divided by this.
SMALL_SHARE = 10
QUERY = (
    "SELECT invoice_id, tenant, occurred_at, amount, currency, customer_email FROM stream_invoices "
    "WHERE tenant = :tenant AND occurred_at >= :start AND occurred_at < :end "
    "ORDER BY occurred_at, invoice_id{collate}"
)
# The day's rows, spread evenly over the window (one every 8.64 ms at 10M rows), built by the database itself.
_POSTGRES_FILL = sa.text(
    "INSERT INTO stream_invoices "
    "SELECT 'acme-' || lpad(g::text, 12, '0'), 'acme', "
    "CAST(:start AS timestamptz) + make_interval(secs => (g * :span_us / :rows) / 1000000.0), "
    "round(5 + ((g * 2654435761 + 12345) % 1000003 % 250000) / 100.0, 2), "
    "(ARRAY['USD', 'EUR', 'GBP', 'CAD'])[1 + (g * 2654435761 + 12345) % 1000003 % 4], "
    "'customer' || ((g * 2654435761 + 12345) % 1000003 % 5000) || '@example.com' "
    "FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS g"
)


def _window():
    from export_ledger.calendar import window_for

    return window_for(BUSINESS_DATE, TIMEZONE)


def _fill(url: str, rows: int) -> None:
    """Untimed: the source table, its rows and the index on the file order."""
    window = _window()
    engine = sa.create_engine(url)
    postgres = engine.dialect.name == "postgresql"
    span_us = int(window.duration.total_seconds() * 1_000_000)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE stream_invoices (invoice_id TEXT NOT NULL, tenant TEXT NOT NULL, occurred_at "
            + ("TIMESTAMPTZ" if postgres else "TEXT")
            + " NOT NULL, amount DOUBLE PRECISION NOT NULL, currency TEXT NOT NULL, customer_email TEXT NOT NULL)"
        )
    step = 1_000_000
    for first in range(0, rows, step):
        last = min(first + step, rows) - 1
        with engine.begin() as conn:
            if postgres:
                conn.execute(
                    _POSTGRES_FILL,
                    {"start": window.start_utc, "span_us": span_us, "rows": rows, "first": first, "last": last},
                )
            else:
                conn.execute(
                    sa.text("INSERT INTO stream_invoices VALUES (:i, :t, :o, :a, :c, :e)"),
                    [_sqlite_row(g, window.start_utc, span_us, rows) for g in range(first, last + 1)],
                )
    with engine.begin() as conn:
        collate = ' COLLATE "C"' if postgres else ""
        conn.exec_driver_sql(
            f"CREATE INDEX stream_invoices_order ON stream_invoices (occurred_at, invoice_id{collate})"
        )
        if postgres:
            conn.exec_driver_sql("ANALYZE stream_invoices")
    engine.dispose()


def _sqlite_row(g: int, start: dt.datetime, span_us: int, rows: int) -> dict:
    mixed = (g * 2654435761 + 12345) % 1000003
    at = start + dt.timedelta(microseconds=g * span_us // rows)
    return {
        "i": f"acme-{g:012d}",
        "t": TENANT,
        "o": at.replace(tzinfo=None).isoformat(sep=" "),
        "a": round(5 + (mixed % 250000) / 100.0, 2),
        "c": ("USD", "EUR", "GBP", "CAD")[mixed % 4],
        "e": f"customer{mixed % 5000}@example.com",
    }


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS cannot be measured on this system")


def child(spec: dict) -> dict:
    """One export in this process: the variant named by ``spec``; returns its time and peak RSS."""
    from assets.invoices import INVOICE_SCHEMA
    from export_ledger.destinations import LocalDestination
    from export_ledger.keys import LogicalKey
    from export_ledger.ledger import ExportLedger
    from export_ledger.protocol import ExportItem, export_key
    from export_ledger.sources import SqlSource

    after_imports = _peak_rss_mib()
    work = Path(spec["work"])
    ledger = ExportLedger(f"sqlite:///{work / 'ledger.sqlite3'}")
    destination = LocalDestination(str(work / "exports"))
    source = SqlSource(spec["url"], spec["query"])
    window = _window()
    key = LogicalKey("invoice_export", TENANT, window)
    ledger.queries.records(limit=1)  # the ledger's schema exists before the clock starts
    began = time.perf_counter()
    if spec["variant"] == "streamed":
        item = ExportItem.streamed(key, BUSINESS_DATE.isoformat(), source, INVOICE_SCHEMA, batch_rows=spec["batch"])
    else:
        frame = source.conform(source.rows(TENANT, window.start_utc, window.end_utc), INVOICE_SCHEMA)
        item = ExportItem(key, BUSINESS_DATE.isoformat(), frame)
    result = export_key(ledger, destination, INVOICE_SCHEMA, item, f"bench-{spec['variant']}/invoice_export")
    elapsed = time.perf_counter() - began
    return {
        "variant": spec["variant"],
        "seconds": elapsed,
        "rows": result.row_count,
        "sha256": result.sha256,
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "after_imports_rss_mib": round(after_imports, 1),
    }


def _run_child(spec: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.streaming", json.dumps(spec)],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {spec['variant']} child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(
    url: str, folder: Path, repeats: int, batch: int, collate: str, variants=("streamed", "whole_frame")
) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(runs)
    folder.mkdir(exist_ok=True)
    for rep in range(repeats):
        # The order rotates every repetition, as in common.interleaved; each run is its own process.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            work = folder / f"{name}-{rep}"
            work.mkdir()
            spec = {"variant": name, "url": url, "query": QUERY.format(collate=collate), "batch": batch}
            runs[name].append(_run_child({**spec, "work": str(work)}))
    return runs


def run(settings: Settings) -> dict:
    rows = 20_000 if settings.smoke else 10_000_000
    small = rows // SMALL_SHARE
    batch = 5_000 if settings.smoke else DEFAULT_BATCH_ROWS
    repeats = settings.reps(full=3)
    # One run of the small partition: its peak is steady from run to run, and the large one's is the largest of its
    # runs, so the ratio errs towards growth.
    small_repeats = settings.reps(full=1)
    notes = []
    reason = postgres_unavailable_reason()
    with scratch_dir(settings.scratch, NAME) as folder:
        if reason is None:
            backend = "postgresql"
            with postgres_schema("bench_stream") as (url, _):
                _fill(url, rows)
                runs = _measure(url, folder / "large", repeats, batch, ' COLLATE "C"')
            with postgres_schema("bench_stream_small") as (url, _):
                _fill(url, small)
                small_runs = _measure(url, folder / "small", small_repeats, batch, ' COLLATE "C"', ("streamed",))
        else:
            backend = "sqlite"
            notes.append(f"the source is SQLite, not PostgreSQL: {reason}")
            url = f"sqlite:///{folder / 'source.sqlite3'}"
            _fill(url, rows)
            runs = _measure(url, folder / "large", repeats, batch, "")
            url = f"sqlite:///{folder / 'source-small.sqlite3'}"
            _fill(url, small)
            small_runs = _measure(url, folder / "small", small_repeats, batch, "", ("streamed",))
    shas = {r["sha256"] for rs in runs.values() for r in rs}
    if len(shas) != 1 or any(r["rows"] != rows for rs in runs.values() for r in rs):
        raise RuntimeError("the streamed and whole-frame exports differ: the benchmark compares different work")
    if any(r["rows"] != small for r in small_runs["streamed"]):
        raise RuntimeError(f"the small partition's export did not hold its {small:,} rows")
    seconds = {name: median([r["seconds"] for r in rs]) for name, rs in runs.items()}
    peak = {name: max(r["peak_rss_mib"] for r in rs) for name, rs in runs.items()}
    small_peak = max(r["peak_rss_mib"] for r in small_runs["streamed"])
    ratio = seconds["streamed"] / seconds["whole_frame"]
    table = [
        {
            "variant": name,
            "rows": rows,
            "median s": round(seconds[name], 3),
            "peak RSS MiB": peak[name],
            "RSS after imports MiB": max(r["after_imports_rss_mib"] for r in runs[name]),
            "x whole_frame time": round(seconds[name] / seconds["whole_frame"], 3),
        }
        for name in runs
    ]
    table.append(
        {
            "variant": "streamed",
            "rows": small,
            "median s": round(median([r["seconds"] for r in small_runs["streamed"]]), 3),
            "peak RSS MiB": small_peak,
            "RSS after imports MiB": max(r["after_imports_rss_mib"] for r in small_runs["streamed"]),
        }
    )
    notes.append("the files are identical (one sha256 across every run); peak RSS is the largest of the runs")
    notes.append(f"the {small:,}-row partition is streamed alone ({small_repeats} run), for the peak RSS ratio")
    return {
        "description": f"one {rows:,}-row partition from a {backend} SqlSource: streamed vs whole frame, CSV",
        "backend": backend,
        "rows": rows,
        "batch_rows": batch,
        "repeats": repeats,
        "median_s": {k: round(v, 4) for k, v in seconds.items()},
        "peak_rss_mib": peak,
        "small_rows": small,
        "small_peak_rss_mib": small_peak,
        "runs": runs,
        "small_runs": small_runs,
        "table": table,
        "notes": notes,
        "targets": [
            target(
                f"streamed {rows:,}-row partition: peak RSS of the child",
                peak["streamed"],
                512,
                at_most=True,
                unit=" MiB",
            ),
            target("streamed / whole-frame time", ratio, 1.1, at_most=True),
            target(f"peak RSS {rows:,} / {small:,} rows", peak["streamed"] / small_peak, 1.3, at_most=True),
        ],  # fmt: skip
    }


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
