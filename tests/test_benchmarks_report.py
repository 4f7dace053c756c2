"""The Markdown report of a benchmark results file: every target and every table of the run, nothing invented."""

from __future__ import annotations

import json

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
