"""Profile the whole reconciliation sensor tick (issue 28's tick miss) with the benchmark's own ledger and sensor.

Run from the project root:  python -m benchmarks.profiles.tick_profile [ROWS]
Writes benchmarks/profiles/sensor-tick.txt (the summary lines at its top are added by hand): a SQLite ledger of ROWS
rows (default 100,000; the tick grows 1.2-1.3x from 10,000 to 1,000,000 rows) with the benchmark's 100 stuck keys,
the stuck keys put back before each tick (untimed), five ticks timed, then five under cProfile.
"""

from __future__ import annotations

import cProfile
import datetime as dt
import io
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

from benchmarks.sensor_tick import STUCK, StuckLedger, _sensor
from export_ledger.dagster import DestinationResource, LedgerResource
from export_ledger.ledger import dispose_engines

OUT = Path("benchmarks/profiles/sensor-tick.txt")
PROBES = [
    ("reconcile_batch", "reconcile.py", "reconcile_batch"),
    ("fences (destination)", "publishing.py", "(fence)"),
    ("holds (claims.hold_many)", "claims.py", "hold_many"),
    ("finishes (completions.finish_many)", "completions.py", "finish_many"),
    ("the batch's sync (syncfs)", "local.py", "_syncfs"),
    ("attention summary (escalations)", "attention.py", "summary"),
    ("dead runs", "dead_runs.py", ""),
    ("SQLite execute (driver)", "'execute' of 'sqlite3.Cursor'"),
    ("SQLite commit (driver)", "'commit' of 'sqlite3.Connection'"),
    (
        "Dagster sensor machinery (build context, evaluate)",
        "dagster/_core/definitions/sensor_definition.py",
        "__call__",
    ),
]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"# cProfile of the whole reconciliation sensor tick on a SQLite ledger of {rows:,} rows, {STUCK} stuck keys "
        "(benchmarks.sensor_tick's StuckLedger and sensor).",
        "# Rerun: python -m benchmarks.profiles.tick_profile [ROWS]",
        f"# Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}.",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="prof-tick-") as tmp, dg.instance_for_test() as instance:
        folder = Path(tmp)
        sl = StuckLedger(f"sqlite:///{folder / 'ledger.sqlite3'}", rows, folder, STUCK)
        sensor = _sensor(sl.url, str(sl.root), sl.tenants)

        def tick():
            sl.reset()
            context = dg.build_sensor_context(
                instance=instance,
                resources={
                    "ledger": LedgerResource(url=sl.url),
                    "invoice_export__destination": DestinationResource.of(sl.destination),
                },
            )
            start = time.perf_counter()
            sensor(context)
            return time.perf_counter() - start

        tick()  # warm-up
        times = sorted(tick() for _ in range(5))
        profiler = cProfile.Profile()
        for _ in range(5):
            sl.reset()
            context = dg.build_sensor_context(
                instance=instance,
                resources={
                    "ledger": LedgerResource(url=sl.url),
                    "invoice_export__destination": DestinationResource.of(sl.destination),
                },
            )
            profiler.enable()
            sensor(context)
            profiler.disable()
        dispose_engines()
    stats = pstats.Stats(profiler)
    total = sum(v[2] for v in stats.stats.values()) / 5
    lines += [
        f"unprofiled tick, median of 5: {1000 * times[2]:.1f} ms (all: {', '.join(f'{1000 * t:.0f}' for t in times)})",
        f"profiled tick: {1000 * total:.1f} ms; cumulative of selected functions per tick:",
    ]
    for label, *needles in PROBES:
        best = max(
            (
                ct
                for (f, n, name), (_cc, _nc, _tt, ct, _c) in stats.stats.items()
                if all(x in f"{f}:{n}({name})" for x in needles)
            ),
            default=0.0,
        )
        lines.append(f"  {label:52s} {1000 * best / 5:7.1f} ms")
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats("cumulative").print_stats(40)
    lines += ["", "pstats of five ticks, sorted by cumulative (top 40):", buffer.getvalue().rstrip()]
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats("tottime").print_stats(25)
    lines += ["", "pstats of five ticks, sorted by tottime (top 25):", buffer.getvalue().rstrip()]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
