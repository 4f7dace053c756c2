"""Profile one chunked backfill run (31 partitions x 10 tenants) with the benchmark's own helpers.

Run from the project root:  python -m benchmarks.profiles.backfill_profile
Writes benchmarks/profiles/backfill-chunked-per-key.txt (the summary lines at its top are added by hand).
"""

from __future__ import annotations

import cProfile
import datetime as dt
import io
import pstats
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.backfill import CHUNK, START, _Backfill

DAYS, TENANTS = 31, 10
OUT = Path("benchmarks/profiles/backfill-chunked-per-key.txt")

# Functions whose cumulative time is reported per key (matched on "filename:lineno(function)" substrings).
PROBES = [
    ("dagster execute_in_process (whole run)", "execute_in_process"),
    ("asset body _export (assets.py)", "assets.py", "_export"),
    ("I/O manager handle_output", "io_manager.py", "handle_output"),
    ("export_batch (protocol)", "protocol.py", "export_batch"),
    ("claims.claim_many", "claims.py", "claim_many"),
    ("completions.complete_many", "completions.py", "complete_many"),
    ("validate_frame", "frames.py", "validate_frame"),
    ("source rows (sample source)", "invoices.py", "rows"),
    ("destination write_table", "write_table"),
    ("os.fsync", "fsync"),
    ("asset check evaluations logged", "asset_check_evaluation"),
    ("dagster _store_output (incl. handle_output)", "execute_step.py", "_store_output"),
    ("event log sqlite _connect", "sqlite_event_log.py", "_connect"),
    ("sqlite commit", "method 'commit' of 'sqlite3.Connection'"),
    ("partition_metadata (io_manager)", "io_manager.py", "partition_metadata"),
    ("add_partition_metadata (io_manager)", "io_manager.py", "add_partition_metadata"),
    ("_record_finished_partitions", "io_manager.py", "_record_finished_partitions"),
    ("dagster store_event", "store_event"),
    ("dagster handle_new_event", "handle_new_event"),
    ("dagster report_dagster_event", "report_dagster_event"),
    ("dagster _store_materialization / _log", "log_dagster_event"),
]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd="/work/main", capture_output=True, text=True, check=True).stdout.strip()


def probe(stats: pstats.Stats, *needles: str) -> tuple[float, int]:
    total, calls = 0.0, 0
    for (filename, line, name), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
        text = f"{filename}:{line}({name})"
        if all(n in text for n in needles):
            # cumulative of recursive/duplicate entries may overlap; keep the largest (outermost) entry
            if ct > total:
                total, calls = ct, nc
    return total, calls


def main() -> None:
    partitions = [(START + dt.timedelta(days=d)).isoformat() for d in range(DAYS)]
    tenants = [f"tenant{t:02d}" for t in range(TENANTS)]
    keys = DAYS * TENANTS
    with tempfile.TemporaryDirectory(prefix="prof-backfill-") as tmp:
        bench = _Backfill(Path(tmp), partitions, tenants)
        try:
            bench.warm()
            timings = {}
            for name, fn in (
                ("data_work", bench.data_work),
                ("chunked", bench.chunked),
                ("ledgered_no_dagster", bench.ledgered_no_dagster),
            ):
                bench.fresh(f"plain-{name}")
                start = time.perf_counter()
                fn(0)
                timings[name] = time.perf_counter() - start
            bench.fresh("profiled")
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.enable()
            bench.chunked(0)
            profiler.disable()
            profiled_wall = time.perf_counter() - start
        finally:
            bench.close()

    profiler.dump_stats(str(Path(tempfile.gettempdir()) / "backfill.prof"))
    stats = pstats.Stats(profiler)
    commit = git("rev-parse", "--short", "HEAD")
    if git("status", "--short"):
        commit += " with uncommitted changes"
    lines = [
        f"# cProfile of one chunked backfill run (BackfillPolicy.multi_run({CHUNK}) range run, execute_in_process,",
        f"# instance_for_test, SQLite ledger) over {DAYS} partitions x {TENANTS} tenants = {keys} logical keys,",
        "# built with benchmarks.backfill._Backfill (warm() first, fresh() instance/ledger/destination per timing).",
        "# Rerun: python -m benchmarks.profiles.backfill_profile",
        f"# Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}.",
        "# 2 shared cores, loaded by other engineers' work: absolute times are noisy, compare shares.",
        "",
        "Unprofiled wall time, one pass each (ms per key):",
    ]
    for name, seconds in timings.items():
        lines.append(f"  {name:22s} {seconds:8.3f} s  {1000 * seconds / keys:7.2f} ms/key")
    lines.append(f"  chunked - data_work    {1000 * (timings['chunked'] - timings['data_work']) / keys:7.2f} ms/key")
    lines.append(
        f"  profiled chunked run   {profiled_wall:8.3f} s  {1000 * profiled_wall / keys:7.2f} ms/key (profiled)"
    )
    lines += ["", "Cumulative time of selected functions in the profiled run (ms per key, calls):"]
    for label, *needles in PROBES:
        total, calls = probe(stats, *needles)
        lines.append(f"  {label:42s} {1000 * total / keys:8.2f} ms/key  {calls:7d} calls")
    for order, limit in (("cumulative", 45), ("tottime", 30)):
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats(order).print_stats(limit)
        lines += ["", f"pstats sorted by {order} (top {limit}):", buffer.getvalue().rstrip()]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))


if __name__ == "__main__":
    main()
