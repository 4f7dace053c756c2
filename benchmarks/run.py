"""Runs the benchmarks, prints a table per benchmark and the targets, and writes the results as JSON.

Usage (from the project root, in the project's virtualenv)::

    python -m benchmarks.run                        # everything, full size (about 15-20 minutes here)
    python -m benchmarks.run --smoke                # tiny sizes: proves every benchmark runs (CI)
    python -m benchmarks.run --quick                # the protocol's benchmarks, middle sizes: before/after a change
    python -m benchmarks.run --only ledger_throughput --only sensor_tick
    python -m benchmarks.run --out benchmarks/results/mine.json

Every judged number is a ratio against a baseline measured in the same run (see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.common import PROJECT_ROOT, Settings, code_version, machine, versions

BENCHMARKS = (
    "export_overhead",
    "ledger_throughput",
    "sensor_tick",
    "backfill",
    "code_location",
    "streaming",
    "dagster_peer",
)
#: What ``--quick`` runs: the benchmarks of the export protocol's own path, the ones a change to it can slow down.
QUICK = ("export_overhead", "ledger_throughput", "backfill")
DEFAULT_PLOT = PROJECT_ROOT / "docs" / "benchmark-overhead.png"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: proves the code runs")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{', '.join(QUICK)} at middle sizes, 3 repetitions: compares two commits on one machine (a few minutes)",
    )
    parser.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
    parser.add_argument("--out", type=Path, help="JSON results file (default benchmarks/results/<UTC date>.json)")
    parser.add_argument(
        "--plot",
        type=Path,
        help=f"overhead plot PNG (default {DEFAULT_PLOT.relative_to(PROJECT_ROOT)}; in --smoke mode beside --out)",
    )
    parser.add_argument("--scratch", type=Path, help="where files and ledgers are written (default var/bench-scratch)")
    parser.add_argument("--repeats", type=int, help="override every benchmark's repetition count")
    args = parser.parse_args(argv)
    if args.smoke and args.quick:
        parser.error("--smoke and --quick are two sizes: give one")
    return args


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "  (no rows)"
    headers = list(rows[0])
    cells = [[_cell(row.get(h, "")) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def format_targets(results: dict) -> str:
    rows = []
    for name, result in results.items():
        for t in result.get("targets", []):
            rows.append(
                {
                    "benchmark": name,
                    "target": t["name"],
                    "value": t["value"],
                    "limit": f"{t['comparison']} {t['limit']}{t['unit'] if t['unit'] != 'x' else ''}",
                    "met": "yes" if t["met"] else "NO",
                }
            )
    return format_table(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started = dt.datetime.now(dt.timezone.utc)
    suffix = "-smoke" if args.smoke else "-quick" if args.quick else ""
    out = args.out or PROJECT_ROOT / "benchmarks" / "results" / f"{started:%Y-%m-%d}{suffix}.json"

    plot = args.plot or (out.with_suffix(".png") if args.smoke or args.quick else DEFAULT_PLOT)
    scratch_parent = args.scratch or PROJECT_ROOT / "var" / "bench-scratch"
    scratch_parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=scratch_parent))
    settings = Settings(smoke=args.smoke, scratch=scratch, repeats=args.repeats, quick=args.quick)
    selected = args.only or list(QUICK if args.quick else BENCHMARKS)
    # The benchmarks measure the reference location on its sample source, chosen as the Quickstart chooses it (there
    # is no default source): importing build_definitions builds definitions.py's own `defs` from this environment.
    os.environ["EXPORTS_SOURCE"] = "sample"
    for setting in ("EXPORTS_SOURCE_URL", "EXPORTS_SOURCE_TABLE"):
        os.environ.pop(setting, None)

    document = {
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "started_utc": started.isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])]),
        "code": code_version(),
        "machine": machine(),
        "versions": versions(),
        "benchmarks": {},
    }
    failed = []
    try:
        for name in selected:
            print(f"== {name}", flush=True)
            began = time.perf_counter()
            try:
                module = importlib.import_module(f"benchmarks.{name}")
                result = module.run(settings)
            except Exception:  # one broken benchmark is reported and fails the run, the others still run
                failed.append(name)
                result = {"error": traceback.format_exc()}
                print(result["error"], file=sys.stderr, flush=True)
            result["wall_s"] = round(time.perf_counter() - began, 2)
            document["benchmarks"][name] = result
            if "table" in result:
                print(format_table(result["table"]), flush=True)
            for note in result.get("notes", []):
                print(f"  note: {note}", flush=True)
            print(f"  ({result['wall_s']} s)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    if "export_overhead" in document["benchmarks"] and "results" in document["benchmarks"]["export_overhead"]:
        from benchmarks.plot import plot_overhead

        document["plot"] = plot_overhead(document, plot)
        print(f"== plot: {document['plot']}", flush=True)
    document["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    document["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]

    caveat = {
        "smoke": " (smoke mode: sizes too small for the targets to mean anything)",
        "quick": " (quick mode: middle sizes, for comparing two commits; the targets are judged on full sizes)",
    }
    print("== targets" + caveat.get(document["mode"], ""))
    print(format_targets(document["benchmarks"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    print(f"== results: {out}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
