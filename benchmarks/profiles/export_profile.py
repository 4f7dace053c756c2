"""Profile one partition of 1,000,000 rows of the export, CSV and Parquet, beside the plain arrow write.

Run from the project root:  python -m benchmarks.profiles.export_profile
Writes benchmarks/profiles/export-1m-rows.txt (the summary lines at its top are added by hand). The same frame, window
and I/O manager as ``benchmarks.export_overhead`` (its ``_Ledgered`` and ``_Plain``): the whole export timed against
the plain write, then its steps one after the other (``_Ledgered.phases``: claim, pointer, validation, staged write,
pointer commit, ledger commit), timed and profiled in this thread. In a run the ids' check overlaps the write in
threads cProfile does not see; one after the other, each step's own cost shows.
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

import dagster as dg

from benchmarks.export_overhead import BUSINESS_DATE, TIMEZONE, _Ledgered, _Plain, invoice_frame
from export_ledger.calendar import window_for

ROWS = 1_000_000
OUT = Path("benchmarks/profiles/export-1m-rows.txt")
#: The export's own functions and the library calls they spend in (matched on "filename:lineno(function)" substrings).
PROBES = [
    ("claim", "claims.py", "(claim)"),
    ("validate_frame", "frames.py", "validate_frame"),
    ("  the ids' hashes (pandas, the stored fingerprint)", "hashing.py", "_hash_ndarray"),
    ("  waits on threads (the conversion to Arrow)", "'acquire' of '_thread.lock'"),
    ("destination stage (publishing.py)", "publishing.py", "(stage)"),
    ("  write_table (frames.py: writer + sha256)", "frames.py", "write_table"),
    ("    parquet write_table (pyarrow)", "parquet/core.py", "write_table"),
    ("    sha256 updates", "'update' of '_hashlib.HASH'"),
    ("  os.fsync", "posix.fsync"),
    ("commit (pointer compare-and-swap)", "publishing.py", "(commit)"),
    ("complete (ledger)", "completions.py", "(complete)"),
]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def probe(stats: pstats.Stats, *needles: str) -> float:
    best = 0.0
    for (filename, line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        if all(n in f"{filename}:{line}({name})" for n in needles):
            best = max(best, ct)
    return best


def profile_format(file_format: str, frame, window, folder: Path, instance, lines: list[str]) -> str:
    plain = _Plain(frame, file_format, folder / f"plain-{file_format}")
    ledgered = _Ledgered(frame, file_format, folder / f"ledgered-{file_format}", window, instance)
    walls: dict[str, list[float]] = {"ledgered": [], "arrow_pyfile": []}
    for rep in range(-1, 3):  # a warm-up, then three of each, alternating
        ledgered.clean()
        ledgered.prepare(rep)
        start = time.perf_counter()
        ledgered.export(rep)
        if rep >= 0:
            walls["ledgered"].append(time.perf_counter() - start)
        plain.clean("arrow_pyfile")
        start = time.perf_counter()
        plain.arrow_pyfile(rep)
        if rep >= 0:
            walls["arrow_pyfile"].append(time.perf_counter() - start)
    ledgered.clean()
    phases = ledgered.phases()  # the same steps one after the other, unprofiled
    # Profiled: the steps one after the other in this thread (a run overlaps the ids' check with the write in threads
    # that cProfile does not see; here each step's own cost shows).
    fresh = _Ledgered(frame, file_format, folder / f"profiled-{file_format}", window, instance)  # a ledger of its own
    profiler = cProfile.Profile()
    profiler.enable()
    fresh.phases()
    profiler.disable()
    plain.clean()
    stats = pstats.Stats(profiler)
    total = sum(v[2] for v in stats.stats.values())
    best = {name: sorted(values)[1] for name, values in walls.items()}
    lines += [
        f"{file_format}: {ROWS:,} rows, unprofiled, median of 3 (alternating, after a warm-up)",
        f"  ledgered {best['ledgered']:.3f} s   plain arrow (b) {best['arrow_pyfile']:.3f} s   "
        f"ratio {best['ledgered'] / best['arrow_pyfile']:.3f}",
        "  its steps one after the other, unprofiled (s): "
        + ", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items()),
        f"  the same steps profiled: {total:.3f} s; cumulative of selected functions:",
    ]
    for label, *needles in PROBES:
        lines.append(f"    {label:40s} {probe(stats, *needles):7.3f} s")
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats("tottime").print_stats(25)
    return buffer.getvalue().rstrip()


def main() -> None:
    commit = git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if git("status", "--short") else "")
    lines = [
        f"# cProfile of one partition of {ROWS:,} rows through LedgeredExportIOManager.handle_output (claim, pointer, "
        "validation, staged write with streaming sha256 and fsync, manifest, pointer compare-and-swap, ledger commit),",
        "# beside the plain arrow write (pa.Table.from_pandas + pyarrow's writer + one fsync), as "
        "benchmarks.export_overhead measures them.",
        "# Rerun: python -m benchmarks.profiles.export_profile",
        f"# Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}.",
        "",
    ]
    window = window_for(BUSINESS_DATE, TIMEZONE)
    frame = invoice_frame(ROWS, window)
    tables = []
    with tempfile.TemporaryDirectory(prefix="prof-export-") as tmp, dg.instance_for_test() as instance:
        for file_format in ("csv", "parquet"):
            tables.append((file_format, profile_format(file_format, frame, window, Path(tmp), instance, lines)))
            lines.append("")
    for file_format, table in tables:
        lines += [f"pstats of the profiled {file_format} export, main thread, sorted by tottime (top 25):", table, ""]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:45]))


if __name__ == "__main__":
    main()
