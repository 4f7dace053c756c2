"""The benchmarks run: ``python -m benchmarks.run --smoke`` exits 0 and writes well-formed JSON with every benchmark.

A smoke test only. The benchmarks' numbers are never asserted here: timings on a shared machine are not test
results (see benchmarks/README.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import BENCHMARKS

pytestmark = [pytest.mark.process, pytest.mark.xdist_group("benchmark_smoke")]  # one smoke run for the module

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


# Once per session, not per module: under pytest-xdist a module's fixture is made again whenever another test ran on
# the worker between two of its tests (CI paid the smoke run twice, 49 s and 42 s).
@pytest.fixture(scope="session")
def smoke_results(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(out), "--scratch", str(folder / "scratch")],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"the smoke run must exit 0:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert out.is_file(), "the smoke run must write its JSON results where --out says"
    return {"document": json.loads(out.read_text(encoding="utf-8")), "stdout": done.stdout, "folder": folder}


def test_smoke_run_writes_every_benchmark_with_results_and_targets(smoke_results):
    document = smoke_results["document"]
    assert document["mode"] == "smoke"
    assert set(document["benchmarks"]) == set(BENCHMARKS), "every benchmark is present in the JSON"
    for name, result in document["benchmarks"].items():
        assert "error" not in result, f"{name} must run without error"
        assert result["table"], f"{name} reports a table"
        for target in result["targets"]:
            assert {"name", "value", "limit", "comparison", "met"} <= set(target), f"{name}: a target is complete"
    assert all(math.isfinite(n) for n in _numbers(document["benchmarks"])), "no NaN or infinite number in the JSON"
    assert document["versions"]["dagster"] and document["machine"]["cores"], "the machine and versions are recorded"


def test_the_measurements_of_issue_13_are_named_so_a_reader_finds_them(smoke_results):
    benchmarks = smoke_results["document"]["benchmarks"]
    names = {name: [t["name"] for t in result["targets"]] for name, result in benchmarks.items()}
    assert any("RSS" in n for n in names["streaming"]), "the streaming run is its own benchmark with an RSS target"
    assert any("time" in n for n in names["streaming"]), "streamed time is judged against the whole-frame path"
    assert any("batch" in n for n in names["ledger_throughput"]), "the batched ledger is a ledger_throughput target"
    assert any("year" in n for n in names["backfill"]), "a year of backfill is a backfill target"
    streaming = benchmarks["streaming"]
    assert all(r["peak_rss_mib"] > r["after_imports_rss_mib"] > 0 for rs in streaming["runs"].values() for r in rs), (
        "peak RSS is measured in the child, above what its interpreter and imports alone hold"
    )


def test_smoke_run_prints_the_targets_table_and_leaves_no_scratch(smoke_results):
    assert "== targets" in smoke_results["stdout"]
    scratch = smoke_results["folder"] / "scratch"
    assert not any(scratch.iterdir()), "scratch ledgers and exports are removed after the run"
