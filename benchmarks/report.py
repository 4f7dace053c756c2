"""Renders a results file of ``python -m benchmarks.run`` as Markdown: the run's facts, every target, every table.

    python -m benchmarks.report benchmarks/results/2026-12-01.json > /tmp/figures.md

RESULTS.md and the README's table are written from this output, so their figures are the run's, not a transcription.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render(document: dict) -> str:
    out = [f"# Figures of `{document.get('command', 'python -m benchmarks.run')}`\n"]
    code = document.get("code", {})
    machine = document.get("machine", {})
    facts = [
        {"": "Mode", " ": document.get("mode")},
        {"": "Ran", " ": f"{document.get('started_utc')} to {document.get('finished_utc')} (UTC)"},
        {"": "Code", " ": f"{code.get('commit')}{' with local changes' if code.get('modified') else ''}"},
        {
            "": "Machine",
            " ": f"{machine.get('cpu')}, {machine.get('cores')} cores, {machine.get('memory_gib')} GiB, "
            f"{machine.get('platform')}",
        },  # fmt: skip
        {
            "": "Load average",
            " ": f"{machine.get('load_average_at_start')} at start, {document.get('load_average_at_end')} at end",
        },  # fmt: skip
        {"": "Versions", " ": ", ".join(f"{k} {v}" for k, v in document.get("versions", {}).items())},
    ]
    out += [markdown_table(facts), "## Targets\n"]
    targets = []
    for name, result in document.get("benchmarks", {}).items():
        for t in result.get("targets", []):
            targets.append({"benchmark": name, **{k: t.get(k) for k in ("name", "value", "limit", "unit", "met")}})
        if "error" in result:
            targets.append({"benchmark": name, "name": "did not run", "value": result["error"]})
    out.append(markdown_table(targets))
    for name, result in document.get("benchmarks", {}).items():
        out.append(f"## {name}\n")
        if result.get("description"):
            out.append(f"{result['description']}\n")
        for key in ("table", "phases_table"):
            if isinstance(result.get(key), list):
                out.append(markdown_table(result[key]))
        for note in result.get("notes", []):
            out.append(f"- {note}\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.report RESULTS.json", file=sys.stderr)
        return 2
    print(render(json.loads(Path(args[0]).read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
