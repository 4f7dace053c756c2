"""Renders a results file of ``python -m benchmarks.run`` as Markdown: the run's facts, every target, every table.

    python -m benchmarks.report benchmarks/RESULTS.json > /tmp/figures.md
    python -m benchmarks.report benchmarks/RESULTS.json --write benchmarks/RESULTS.md --write docs/benchmarks.md

    python -m benchmarks.report benchmarks/RESULTS.json --merge /tmp/dagster_peer.json

``--merge LATER.json`` puts the benchmarks of a later run (``python -m benchmarks.run --only NAME``) in place of the
same benchmarks of the results file, and rewrites the file: each merged benchmark keeps the facts of the run that
measured it (``rerun``: its commit, command, start and end, load), and every report names it with them, so that no
figure is shown as measured on a commit it was not.

``--write FILE`` replaces what stands between the lines ``<!-- benchmarks.report: full -->`` (or ``: targets``, or
``: summary``) and ``<!-- benchmarks.report: end -->`` in FILE with the whole report (or its facts and targets only,
or one line of facts and a row per target), so that RESULTS.md, the table of docs/benchmarks.md and the README's are
the run's figures, not a transcription. A file without those lines is refused.
"""

from __future__ import annotations

import json
import re
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


def _minute(stamp) -> str:
    return str(stamp if stamp is not None else "?")[:16].replace("T", " ")


def _rerun_clauses(document: dict) -> list[str]:
    """One clause per benchmark measured by a later run than the file's own (``--merge``): which run, where, when."""
    clauses = []
    for name, result in document.get("benchmarks", {}).items():
        run = result.get("rerun")
        if run:
            clauses.append(
                f"`{name}` measured again by `{run.get('command')}` on `{str(run.get('commit'))[:7]}`"
                f"{' with local changes' if run.get('modified') else ''}, {_minute(run.get('started_utc'))} to "
                f"{_minute(run.get('finished_utc'))} UTC, load average {run.get('load_average_at_start')} at start "
                f"and {run.get('load_average_at_end')} at end"
            )
    return clauses


def merge(document: dict, later: dict) -> dict:
    """``document`` with each benchmark of ``later`` in place of its own, carrying the later run's facts.

    Raises:
        SystemExit: ``later`` is not a run of the same mode (a smoke run's sizes are not a full run's), or holds no
            benchmark.
    """
    if later.get("mode") != document.get("mode"):
        raise SystemExit(f"cannot merge a {later.get('mode')} run into a {document.get('mode')} run's results")
    if not later.get("benchmarks"):
        raise SystemExit("the later run holds no benchmark")
    merged = dict(document, benchmarks=dict(document.get("benchmarks", {})))
    code = later.get("code", {})
    for name, result in later["benchmarks"].items():
        merged["benchmarks"][name] = dict(
            result,
            rerun={
                "command": later.get("command"),
                "commit": code.get("commit"),
                "modified": code.get("modified"),
                "started_utc": later.get("started_utc"),
                "finished_utc": later.get("finished_utc"),
                "load_average_at_start": later.get("machine", {}).get("load_average_at_start"),
                "load_average_at_end": later.get("load_average_at_end"),
            },
        )
    return merged


MARK = "<!-- benchmarks.report: {} -->"
#: The generated blocks: the whole report, its facts and targets, or one line of facts and the targets' rows.
KINDS = ("full", "targets", "summary")
END = MARK.format("end")


def render(document: dict, *, targets_only: bool = False) -> str:
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
    out.append(markdown_table(facts))
    out += [f"{clause}: its figures are that run's.\n" for clause in _rerun_clauses(document)]
    out.append("## Targets\n")
    targets = []
    for name, result in document.get("benchmarks", {}).items():
        for t in result.get("targets", []):
            targets.append({"benchmark": name, **{k: t.get(k) for k in ("name", "value", "limit", "unit", "met")}})
        if "error" in result:
            targets.append({"benchmark": name, "name": "did not run", "value": result["error"]})
    out.append(markdown_table(targets))
    if targets_only:
        return "\n".join(out)
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


def summary(document: dict) -> str:
    """One line of the run's facts and one row per target: the README's table (generated, as the pages' are)."""
    code = document.get("code", {})
    machine = document.get("machine", {})
    started, finished = (_minute(document.get(k)) for k in ("started_utc", "finished_utc"))
    reruns = "".join(f"; {clause}" for clause in _rerun_clauses(document))  # in the sentence: the README's lines
    facts = (
        f"`{document.get('command', 'python -m benchmarks.run')}` on `{str(code.get('commit'))[:7]}`"
        f"{' with local changes' if code.get('modified') else ''}, {started} to {finished} UTC, "
        f"{machine.get('cores')} cores, load average {machine.get('load_average_at_start')} at start and "
        f"{document.get('load_average_at_end')} at end{reruns}:\n"
    )
    rows = []
    for name, result in document.get("benchmarks", {}).items():
        for t in result.get("targets", []):
            unit = "" if t.get("unit") in (None, "x") else t["unit"]
            rows.append(
                {
                    "target": f"{name}: {t.get('name')}",
                    "value": f"{_cell(t.get('value'))}{unit}",
                    "limit": f"{t.get('comparison', '')} {_cell(t.get('limit'))}{unit}".strip(),
                    "met": t.get("met"),
                }
            )
        if "error" in result:
            rows.append({"target": f"{name}: did not run", "value": "-", "limit": "-", "met": False})
    return facts + "\n" + markdown_table(rows)


def write_into(path: Path, document: dict) -> None:
    """Replaces each generated block of ``path`` (see the module's docstring) with this run's report."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    out, block = [], None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if block is None:
            out.append(line)
            for kind in KINDS:
                if stripped == MARK.format(kind):
                    block = kind
                    if kind == "summary":
                        out.append(summary(document))
                        continue
                    text = render(document, targets_only=kind == "targets")
                    # The report's own title would be a second top-level heading inside the page: it is dropped, and
                    # its headings go one level down, below the section the block stands in.
                    block_text = text.split("\n", 1)[1].lstrip("\n")
                    out.append(re.sub(r"(?m)^(#+) ", r"#\1 ", block_text) + "\n")
        elif stripped == END:
            out.append(line)
            block = None
        elif stripped.startswith("<!-- benchmarks.report:"):
            raise SystemExit(f"{path}:{number}: a generated block opens inside another one")
    if block is not None:
        raise SystemExit(f"{path}: the generated block ({block}) has no {END} line")
    if not any(line.strip() in {MARK.format(kind) for kind in KINDS} for line in lines):
        raise SystemExit(
            f"{path} has none of the lines {', '.join(MARK.format(kind) for kind in KINDS)} to write after"
        )
    path.write_text("".join(out), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m benchmarks.report RESULTS.json [--merge LATER.json] [--write FILE ...]"
    paths: list[Path] = []
    later: Path | None = None
    for option in ("--write", "--merge"):
        while option in args:
            at = args.index(option)
            if at + 1 >= len(args):
                print(usage, file=sys.stderr)
                return 2
            if option == "--write":
                paths.append(Path(args[at + 1]))
            elif later is not None:
                print(f"{usage}: one --merge at a time", file=sys.stderr)
                return 2
            else:
                later = Path(args[at + 1])
            args = args[:at] + args[at + 2 :]
    if len(args) != 1:
        print(usage, file=sys.stderr)
        return 2
    document = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    if later is not None:
        run = json.loads(later.read_text(encoding="utf-8"))
        document = merge(document, run)
        Path(args[0]).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"merged {', '.join(run['benchmarks'])} of {later} into {args[0]}")
    if not paths and later is None:
        print(render(document))
    for path in paths:
        write_into(path, document)
        print(f"wrote the report of {args[0]} into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
