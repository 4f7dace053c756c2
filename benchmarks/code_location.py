"""Benchmark 5: ``dagster definitions validate`` on this project against a one-asset project, same run.

Each variant is a fresh process (what a code server or the CLI pays at every start), interleaved; medians.
``import dagster`` alone is timed beside them: the floor that every Dagster code location pays.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import PROJECT_ROOT, Settings, interleaved, median, scratch_dir

NAME = "code_location"
ONE_ASSET = """import dagster as dg


@dg.asset
def one() -> int:
    return 1


defs = dg.Definitions(assets=[one])
"""


def _environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_") and k != "DAGSTER_HOME"}
    env["DAGSTER_HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")


def run(settings: Settings) -> dict:
    repeats = settings.reps(full=7)
    with scratch_dir(settings.scratch, NAME) as folder:
        home = folder / "dagster_home"
        home.mkdir()
        one_asset = folder / "one_asset"
        one_asset.mkdir()
        (one_asset / "definitions.py").write_text(ONE_ASSET, encoding="utf-8")
        env = _environment(home)
        validate = [sys.executable, "-m", "dagster", "definitions", "validate", "-f", "definitions.py"]
        variants = {
            "import_dagster": lambda _rep: _run([sys.executable, "-c", "import dagster"], folder, env),
            "one_asset": lambda _rep: _run(validate, one_asset, env),
            "export_ledger": lambda _rep: _run(validate, PROJECT_ROOT, env),
        }
        times = interleaved(variants, repeats, warmup=not settings.smoke)
    medians = {name: median(values) for name, values in times.items()}
    ratio = medians["export_ledger"] / medians["one_asset"]
    return {
        "description": "dagster definitions validate: this project vs a one-asset project (fresh process each)",
        "repeats": repeats,
        "median_s": {k: round(v, 3) for k, v in medians.items()},
        "all_s": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
        "ratio_project_vs_one_asset": round(ratio, 4),
        "extra_s_vs_one_asset": round(medians["export_ledger"] - medians["one_asset"], 3),
        "table": [
            {
                "variant": "import dagster",
                "median s": round(medians["import_dagster"], 3),
                "x one-asset": round(medians["import_dagster"] / medians["one_asset"], 3),
            },
            {"variant": "one-asset project", "median s": round(medians["one_asset"], 3), "x one-asset": 1.0},
            {
                "variant": "export-ledger",
                "median s": round(medians["export_ledger"], 3),
                "x one-asset": round(ratio, 3),
            },
        ],
        "targets": [],
        "notes": ["no target in the issue: reported for comparison only"],
    }
