"""The Markdown report of a benchmark results file: every target and every table of the run, nothing invented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import report


def test_the_report_shows_each_target_and_table_of_the_results_file(tmp_path, capsys):
    document = {
        "command": "python -m benchmarks.run",
        "code": {"commit": "abc123", "modified": False},
        "benchmarks": {
            "backfill": {
                "description": "90 partitions",
                "table": [{"variant": "chunked", "median s": 12.5}, {"variant": "per_partition", "median s": 140.0}],
                "targets": [{"name": "year: total / data work", "value": 1.42, "limit": 1.5, "unit": "x", "met": True}],
            },
            "streaming": {"error": "RuntimeError: no PostgreSQL"},
        },
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(document))
    assert report.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "| backfill | year: total / data work | 1.42 | 1.5 | x | yes |" in text
    assert "| streaming | did not run | RuntimeError: no PostgreSQL |" in text
    assert "| chunked | 12.5 |" in text and "| per_partition | 140 |" in text
    assert "abc123" in text and "with local changes" not in text
    assert report.main([]) == 2


def test_write_replaces_only_the_generated_blocks_and_refuses_a_file_without_them(tmp_path, capsys):
    document = {
        "code": {"commit": "def456", "modified": False},
        "benchmarks": {"sensor_tick": {"description": "ticks", "table": [{"rows": 10}], "targets": [
            {"name": "sqlite sensor tick with 100,000 escalated keys", "value": 150.0, "limit": 200, "unit": " ms",
             "met": True}]}},
    }  # fmt: skip
    results = tmp_path / "RESULTS.json"
    results.write_text(json.dumps(document))
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\nkept before\n<!-- benchmarks.report: targets -->\nold figures\n<!-- benchmarks.report: end -->\n"
        "kept after\n"
    )
    assert report.main([str(results), "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Title\nkept before\n<!-- benchmarks.report: targets -->\n")
    assert text.endswith("<!-- benchmarks.report: end -->\nkept after\n")
    assert "old figures" not in text and "# Figures of" not in text
    assert "| sensor_tick | sqlite sensor tick with 100,000 escalated keys | 150 | 200 |  ms | yes |" in text
    assert "| rows |" not in text, "the targets block holds no benchmark tables"
    full = tmp_path / "RESULTS.md"
    full.write_text("<!-- benchmarks.report: full -->\n<!-- benchmarks.report: end -->\n")
    assert report.main([str(results), "--write", str(full)]) == 0
    assert "| rows |" in full.read_text() and "def456" in full.read_text()
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(SystemExit, match="none of the lines <!-- benchmarks.report: full -->"):
        report.main([str(results), "--write", str(bare)])
    assert bare.read_text() == "no markers\n"
    unclosed = tmp_path / "unclosed.md"
    unclosed.write_text("<!-- benchmarks.report: full -->\nold\n")
    with pytest.raises(SystemExit, match="has no <!-- benchmarks.report: end -->"):
        report.main([str(results), "--write", str(unclosed)])
    assert unclosed.read_text() == "<!-- benchmarks.report: full -->\nold\n"


def test_quick_runs_the_protocols_benchmarks_at_middle_sizes_and_refuses_smoke_beside_it(tmp_path, capsys):
    from benchmarks.common import Settings
    from benchmarks.run import QUICK, _parse

    with pytest.raises(SystemExit) as refused:
        _parse(["--smoke", "--quick"])
    assert refused.value.code == 2 and "--smoke and --quick" in capsys.readouterr().err
    assert _parse(["--quick"]).quick and set(QUICK) == {"export_overhead", "ledger_throughput", "backfill"}
    quick = Settings(smoke=False, scratch=tmp_path, quick=True)
    assert quick.reps(full=9) == 3 and quick.reps(full=1) == 1, "at most three repetitions"
    assert quick.size(full=(365, 100), smoke=(4, 2), quick=(31, 20)) == (31, 20)
    full = Settings(smoke=False, scratch=tmp_path)
    assert full.reps(full=9) == 9 and full.size(full=(365, 100), smoke=(4, 2), quick=(31, 20)) == (365, 100)


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md", "benchmarks/RESULTS.md"])
def test_the_published_figures_are_the_committed_runs_not_a_transcription(tmp_path, page):
    """The README's table, docs/benchmarks.md's and RESULTS.md's are generated from benchmarks/RESULTS.json: writing
    the report of that file into a copy of each page changes nothing. A figure edited by hand, or a new run committed
    without its pages written again, fails here."""
    root = Path(__file__).resolve().parent.parent
    document = json.loads((root / "benchmarks" / "RESULTS.json").read_text(encoding="utf-8"))
    copy = tmp_path / Path(page).name
    copy.write_text((root / page).read_text(encoding="utf-8"), encoding="utf-8")
    report.write_into(copy, document)
    assert copy.read_text(encoding="utf-8") == (root / page).read_text(encoding="utf-8"), (
        f"{page}'s generated block is not the report of benchmarks/RESULTS.json: run "
        f"python -m benchmarks.report benchmarks/RESULTS.json --write {page}"
    )


def _run_of(commit: str, benchmarks: dict, mode: str = "full") -> dict:
    return {
        "mode": mode,
        "command": f"python -m benchmarks.run --only {' --only '.join(benchmarks)}",
        "started_utc": "2026-12-04T17:00:00+00:00",
        "finished_utc": "2026-12-04T17:08:00+00:00",
        "code": {"commit": commit, "modified": False},
        "machine": {"cores": 2, "load_average_at_start": [0.5, 0.6, 0.7]},
        "load_average_at_end": [1.0, 0.9, 0.8],
        "benchmarks": benchmarks,
    }


def test_a_later_run_of_one_benchmark_replaces_its_figures_and_every_report_names_that_run(tmp_path, capsys):
    peer = {"targets": [{"name": "one partition", "value": 1.25, "limit": 1.2, "unit": "x", "met": False}]}
    tick = {"targets": [{"name": "tick", "value": 150.0, "limit": 200, "unit": " ms", "met": True}]}
    results = tmp_path / "RESULTS.json"
    results.write_text(json.dumps(_run_of("aaaaaaa1", {"dagster_peer": peer, "sensor_tick": tick})))
    later = tmp_path / "later.json"
    newer_peer = {"targets": [{"name": "one partition", "value": 1.1, "limit": 1.2, "unit": "x", "met": True}]}
    later.write_text(json.dumps(_run_of("bbbbbbb2", {"dagster_peer": newer_peer})))

    assert report.main([str(results), "--merge", str(later)]) == 0
    merged = json.loads(results.read_text())
    assert merged["code"]["commit"] == "aaaaaaa1", "the file's own run is still the one it names"
    assert merged["benchmarks"]["sensor_tick"] == tick, "a benchmark the later run did not measure is kept as it was"
    assert merged["benchmarks"]["dagster_peer"]["targets"][0]["value"] == 1.1, "the later figures replace the old"
    assert merged["benchmarks"]["dagster_peer"]["rerun"]["commit"] == "bbbbbbb2"

    text = report.summary(merged)
    assert "`dagster_peer` measured again by `python -m benchmarks.run --only dagster_peer` on `bbbbbbb`" in text
    assert "sensor_tick` measured again" not in text
    assert "| dagster_peer: one partition | 1.1 | 1.2 | yes |" in text, "the README's row shows the later value"
    assert "measured again" in report.render(merged), "the full report names the later run too"


def test_merging_a_run_of_another_mode_or_of_nothing_is_refused_and_the_file_is_left_as_it_was(tmp_path):
    results = tmp_path / "RESULTS.json"
    original = json.dumps(_run_of("aaaaaaa1", {"dagster_peer": {"targets": []}}))
    results.write_text(original)
    smoke = tmp_path / "smoke.json"
    smoke.write_text(json.dumps(_run_of("bbbbbbb2", {"dagster_peer": {"targets": []}}, mode="smoke")))
    with pytest.raises(SystemExit, match="cannot merge a smoke run into a full run"):
        report.main([str(results), "--merge", str(smoke)])
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_run_of("bbbbbbb2", {})))
    with pytest.raises(SystemExit, match="holds no benchmark"):
        report.main([str(results), "--merge", str(empty)])
    assert results.read_text() == original
