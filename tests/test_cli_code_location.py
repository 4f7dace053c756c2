"""``export-ledger`` with a code location named as Dagster's CLI names one (issue #19, items 6 and 7): -f/-m/-a,
the printed ``dagster asset materialize`` commands, drift of the reference code location, the lookback's gap, tables
that fit the terminal, the form of a key, and the exit codes."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from builders import evidence_for, key_for, open_ledger

from export_ledger import cli
from export_ledger.cli import render
from export_ledger.operations import KEY_FORM

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DAY = dt.date(2026, 3, 8)

LOCATION = """
import pandas as pd
from export_ledger import ExportSpec
from export_ledger.dagster import ledgered_definitions

orders = ExportSpec(
    name="orders",
    source=lambda tenant, start, end: pd.DataFrame(),
    columns={{"order_id": "string", "tenant": "string", "placed_at": "timestamp"}},
    id_columns=["order_id"], time_column="placed_at", tenant_column="tenant",
    tenants={{"acme": "America/New_York", "bombay": "Asia/Kolkata"}},
    timezone="America/New_York", start_date="2026-01-01",
)
shop_defs = ledgered_definitions(
    [orders], environ={{"EXPORTS_LEDGER_URL": {url!r}, "EXPORTS_DESTINATION": {destination!r}}}
)
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def shop(tmp_path, monkeypatch, sqlite_url):
    """A code location of one export in two zones (``orders`` and ``orders__asia_kolkata``), as a file and as a
    module, and its ledger: Bombay's key of DAY completed, Bombay's key of the day after stuck in remote_unknown."""
    destination = tmp_path / "exports"
    destination.mkdir()
    (tmp_path / "shop_location.py").write_text(LOCATION.format(url=sqlite_url, destination=str(destination)))
    ledger = open_ledger(sqlite_url)
    claim = ledger.claims.claim(key_for(DAY, export="orders", tenant="bombay", timezone="Asia/Kolkata"), "run-1")
    ledger.completions.complete(claim, evidence_for(claim))
    stuck = key_for(DAY + dt.timedelta(days=1), export="orders", tenant="bombay", timezone="Asia/Kolkata")
    ledger.completions.mark_remote_unknown(ledger.claims.claim(stuck, "run-2"), TimeoutError("upload timed out"))
    monkeypatch.chdir(tmp_path)
    # -m imports the module once a process: an earlier test's shop_location would name that test's ledger.
    monkeypatch.delitem(sys.modules, "shop_location", raising=False)
    monkeypatch.setenv("EXPORTS_LEDGER_URL", sqlite_url)
    monkeypatch.setenv("EXPORTS_DESTINATION", str(destination))
    monkeypatch.setenv("COLUMNS", "400")  # the printed commands on one line each
    return ledger, str(claim.logical_key), str(stuck)


def commands(out: str, prefix: str) -> list[list[str]]:
    return [shlex.split(line.removeprefix(prefix)) for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize(
    "location",
    [("-f", "shop_location.py"), ("-f", "shop_location.py", "-a", "shop_defs"), ("-m", "shop_location")],
    ids=["file", "file-attribute", "module"],
)
def test_restate_prints_the_materialize_command_of_the_users_code_location_and_the_zones_asset(
    capsys, shop, location
):
    _, completed, _ = shop

    code, out, err = run(capsys, "restate", completed, "--reason", "late rows", *location)

    assert code == 0, err
    assert commands(out, "materialize: ") == [
        ["dagster", "asset", "materialize", *location, "--select", "orders__asia_kolkata", "--partition", "2026-03-08"]
    ], "the command repeats the operator's -f/-m (and -a) and names the asset of the tenant's zone"
    assert "assume" not in out, "a command built from the code location is not a guess"


def test_reconcile_with_a_code_location_prints_reruns_in_it(capsys, shop):
    _, _, stuck = shop

    code, out, err = run(capsys, "reconcile", "-f", "shop_location.py")

    assert code == 0, err
    assert stuck in out and "failed" in out, "nothing at the destination: the key is failed, safe to rerun"
    assert commands(out, "rerun: ") == [
        ["dagster", "asset", "materialize", "-f", "shop_location.py", "--select", "orders__asia_kolkata",
         "--partition", "2026-03-09"]
    ]  # fmt: skip


def _unusable_location(shop, tmp_path: Path) -> str:
    """The shop's code location with its source unusable in this process (a setting missing here)."""
    unusable = LOCATION.replace(
        "source=lambda tenant, start, end: pd.DataFrame()",
        "source=UnusableSource('the orders source cannot be used here: set SHOP_DB_URL')",
    ).replace("from export_ledger import ExportSpec", "from export_ledger import ExportSpec, UnusableSource")
    (tmp_path / "unusable_location.py").write_text(unusable.format(
        url=str(shop[0].url), destination=str(tmp_path / "exports")))  # fmt: skip
    return "unusable_location.py"


def test_drift_with_a_source_that_cannot_be_used_here_says_so_and_exits_1(capsys, shop, tmp_path):
    """Its keys were not checked, so a script must not read the pass as clean. Guard: ``Drifted.unusable``."""
    code, out, err = run(capsys, "drift", "-f", _unusable_location(shop, tmp_path))

    assert code == 1, (out, err)
    assert "not checked, no source to read again here: orders (the orders source cannot be used here: set " in out


def test_printed_commands_say_what_this_shell_lacks_to_run_them_as_the_code_locations_runs_do(
    capsys, shop, monkeypatch, tmp_path
):
    """A run started by a pasted ``dagster asset materialize`` reads this shell's settings: without DAGSTER_HOME it
    is recorded in a temporary instance the UI never shows, and a source this environment cannot read fails the run.
    Both are said under the commands (the settings named, never a value); a shell that has them gets no note."""
    _, completed, _ = shop
    location = _unusable_location(shop, tmp_path)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)

    code, out, err = run(capsys, "reconcile", "-f", location)

    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("(before running the dagster commands here: ")]
    assert len(notes) == 2 and "DAGSTER_HOME is not set in this shell" in notes[0], out
    assert notes[1].endswith("the orders source cannot be used here: set SHOP_DB_URL)"), out

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    code, out, err = run(capsys, "restate", completed, "--reason", "late rows", "-f", "shop_location.py")
    assert code == 0 and commands(out, "materialize: ") and "before running" not in out, out


def test_a_printed_command_runs_the_dagster_of_the_clis_own_virtualenv(monkeypatch, tmp_path):
    """A shell that never activated the virtualenv (``.venv/bin/export-ledger status ...``) would find no dagster, or
    another one: the command then names this virtualenv's, relative to the working directory below which it lies."""
    from export_ledger.operations import dagster_program

    beside = Path(sys.executable).parent / "dagster"
    assert beside.is_file(), "dagster is installed beside this interpreter"
    assert dagster_program() == "dagster", "the shell's PATH finds this interpreter's dagster first (conftest)"

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert dagster_program(cwd=tmp_path) == str(beside.absolute())
    root = beside.absolute().parent.parent.parent  # the folder that holds the virtualenv
    relative = dagster_program(cwd=root)
    assert relative == str(beside.absolute().relative_to(root)) and "/" in relative, relative
    assert (root / relative).is_file()


def test_without_a_code_location_the_printed_command_says_what_it_assumes(capsys, shop):
    _, completed, _ = shop

    code, out, _ = run(capsys, "restate", completed, "--reason", "late rows")

    assert code == 0
    assert "-f YOUR_DEFINITIONS.py" in out and "no ./definitions.py here" in out, (
        "a printed command never names a file that is not where it is printed"
    )
    assert "pass -f FILE or -m MODULE" in out, out


@pytest.mark.parametrize(
    ("argv", "mention"),
    [
        (("-f", "missing.py"), "no such file"),
        (("-m", "shop_location", "-a", "orders"), "a ExportSpec, not a dagster Definitions"),
        (("-m", "shop_location", "-a", "nothing"), "has no attribute 'nothing'"),
        (("-a", "shop_defs"), "give one of them too"),
    ],
)
def test_a_wrong_code_location_is_one_clear_error(capsys, shop, argv, mention):
    _, completed, _ = shop
    code, _, err = run(capsys, "restate", completed, "--reason", "x", *argv)
    assert code in (1, 2) and mention in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_drift_runs_for_the_reference_code_location_and_says_what_its_lookback_left_out(
    capsys, tmp_path, monkeypatch, sqlite_url
):
    ledger = open_ledger(sqlite_url)
    claim = ledger.claims.claim(key_for(DAY), "run-1")  # invoice_export/acme, long before the 7-day lookback
    ledger.completions.complete(claim, evidence_for(claim))
    monkeypatch.setenv("EXPORTS_LEDGER_URL", sqlite_url)
    monkeypatch.setenv("EXPORTS_DESTINATION", str(tmp_path / "exports"))
    monkeypatch.chdir(PROJECT_ROOT)

    code, out, err = run(capsys, "drift", "-f", "definitions.py")

    assert code == 0, err
    needed = (dt.datetime.now(ZoneInfo("America/New_York")).date() - DAY).days + 1
    assert "0 key(s) checked" in out
    assert (
        f"1 completed key(s) older than the lookback of 7 day(s) were not checked (the oldest of {DAY}); "
        f"--lookback-days {needed} checks them too"
    ) in " ".join(out.split()), out

    code, _, err = run(capsys, "drift", "--specs", "definitions:defs")
    assert code == 2 and "is a Definitions: name a code location with -f FILE or -m MODULE" in err, err
    code, _, err = run(capsys, "drift")
    assert code == 2 and "-f FILE or -m MODULE" in err, "drift without its exports is a usage error"


def test_restate_without_a_reason_is_a_usage_error(capsys, shop):
    _, completed, _ = shop
    code, _, err = run(capsys, "restate", completed)
    assert code == 2 and "needs a reason" in err, err


def test_an_unknown_key_error_names_the_form_of_a_key(capsys, shop):
    for command in ("attempts", "revisions"):
        code, _, err = run(capsys, command, "orders/bombay/2026-03-08")
        assert code == 1 and KEY_FORM in err, err
        assert "export-ledger status --export orders --tenant bombay --from 2026-03-08 --to 2026-03-08" in err
    code, _, err = run(capsys, "restate", "orders/nobody", "--reason", "x")
    assert code == 1 and KEY_FORM in err, err


def test_help_documents_the_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for line in ("0  success", "1  the command could not be carried out", "2  bad usage"):
        assert line in out, f"--help should document exit code {line[0]}"


def test_tables_fit_100_columns_when_stdout_is_not_a_terminal_and_json_stays_whole(capsys, shop, monkeypatch):
    ledger, completed, _ = shop
    monkeypatch.delenv("COLUMNS")
    claim = ledger.claims.claim(key_for(DAY, export="orders", tenant="acme"), "run-" + "x" * 60 + "/orders")
    ledger.completions.fail(claim, ValueError("negative amount"))

    for argv in (("status",), ("attempts", str(claim.logical_key))):
        code, out, _ = run(capsys, *argv)
        assert code == 0
        assert max(len(line) for line in out.splitlines()) <= 100, f"{argv} should fit 100 columns:\n{out}"
        assert completed in out.split() or argv[0] == "attempts", "a logical key is never wrapped: it is copied"

    code, out, _ = run(capsys, "status", "--json")
    assert {"updated_at", "lease_owner", "lease_expires_at"} <= set(json.loads(out)[0]), "--json keeps every field"
    code, out, _ = run(capsys, "attempts", str(claim.logical_key), "--json")
    (attempt,) = json.loads(out)
    assert attempt["attempt_id"] == "run-" + "x" * 60 + "/orders", "--json is never cut"


@pytest.mark.parametrize("columns", [None, "60"], ids=["100 columns", "60 columns"])
def test_needs_attention_in_100_columns_puts_each_why_under_its_key(capsys, shop, monkeypatch, columns):
    """At 100 columns a fifth column of prose got a few characters a line (one key took 13 lines): each why goes
    under its key, wrapped to the terminal, and each key's row stays one line. Only the commands to paste are never
    wrapped. At 60 columns (narrower than a row can be) each why still goes under its row, wrapped to 60. Guard: as
    a column, the why is cut into lines of under 40 characters."""
    ledger = shop[0]
    monkeypatch.delenv("COLUMNS")
    if columns:
        monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.setenv("DAGSTER_HOME", "/nonexistent-instance")  # its note is another test's subject
    claim = ledger.claims.claim(key_for(DAY, export="orders", tenant="acme"), "run-1/orders")
    ledger.completions.fail(claim, ValueError("negative amount"))

    code, out, err = run(capsys, "status", "--needs-attention", "--max-attempts", "1")

    assert code == 0, err
    table, ways = out.split("\nways out, to paste")
    lines = table.strip().splitlines()
    assert lines[0].split() == ["LOGICAL", "KEY", "STATE", "CLAIMS", "SINCE"], lines[0]
    keyed = [i for i, line in enumerate(lines) if line.startswith("orders/")]
    assert keyed and any(str(claim.logical_key) in lines[i] for i in keyed), lines
    for i in keyed:
        why = []
        for line in lines[i + 1 :]:
            if line.startswith("orders/"):
                break
            if line.startswith("    "):
                why.append(line.strip())
        assert why and len(" ".join(why)) > 40, f"the why of {lines[i]} is under it: {lines}"
        assert all(len(part) > 30 for part in why[:-1]), f"the why is wrapped to the terminal, not a column: {why}"
    assert "failed 1 time(s): automatic reruns are spent" in " ".join(table.split())
    assert max(len(line) for line in table.splitlines() if line.startswith("    ")) <= int(columns or 100), table
    commands = [line for line in ways.splitlines() if line.startswith("    ") and not line.startswith("    #")]
    assert commands and all(line.strip().startswith(("dagster ", "export-ledger ")) for line in commands), ways
    assert all(len(line) <= int(columns or 100) for line in ways.splitlines() if line.startswith("#")), "notes wrap"


def test_a_why_goes_under_every_line_of_a_row_that_wraps(monkeypatch):
    """A state of two words ("never claimed") wraps in a narrow terminal, so its row takes two lines: its why goes
    under both, not into a narrow fifth column. Guard: taking one line per row, the whys land under the wrong rows."""
    monkeypatch.setenv("COLUMNS", "70")
    rows = [("k" * 40, "never claimed", None, "2026-12-03T11:22:01Z"), ("j" * 40, "failed", 3, "2026-12-03T11:22:01Z")]
    notes = ["first " * 20, "second " * 20]

    lines = render.with_notes(("LOGICAL KEY", "STATE", "CLAIMS", "SINCE"), rows, "WHY", notes).splitlines()

    first, second = lines.index(next(line for line in lines if line.startswith("k"))), None
    second = lines.index(next(line for line in lines if line.startswith("j")))
    assert lines[first + 1].strip() == "claimed", f"the row wraps: {lines}"
    assert {word for line in lines[first + 2 : second] for word in line.split()} == {"first"}, lines
    assert {word for line in lines[second + 1 :] for word in line.split()} == {"second"}, lines
    assert all(len(line) <= 70 for line in lines if line.startswith("    ")), lines


def test_with_a_code_location_the_ledger_is_the_one_its_runs_use(capsys, shop, tmp_path, monkeypatch):
    """After `dg launch` or `dagster asset materialize -f shop.py`, `export-ledger status -f shop.py` reads the
    ledger of that code location's ledger resource (an EnvVar resolved as a run resolves it): no URL copied by hand.
    EXPORTS_LEDGER_URL names another (empty) ledger here, which the command must not read."""
    ledger, completed, _ = shop
    (tmp_path / "elsewhere.py").write_text(
        LOCATION.replace("environ={{", "ledger=LedgerResource(url=dg.EnvVar('SHOP_LEDGER_URL')), environ={{")
        .replace("from export_ledger.dagster import ledgered_definitions",
                 "import dagster as dg\nfrom export_ledger.dagster import LedgerResource, ledgered_definitions")
        .format(url="unused", destination=str(tmp_path / "exports"))
    )  # fmt: skip
    monkeypatch.setenv("SHOP_LEDGER_URL", ledger.url)
    other = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    open_ledger(other)  # an empty ledger, where EXPORTS_LEDGER_URL points
    monkeypatch.setenv("EXPORTS_LEDGER_URL", other)

    code, out, err = run(capsys, "status", "-f", "elsewhere.py", "--json")

    assert code == 0, err
    assert completed in [item["logical_key"] for item in json.loads(out)], "the location's ledger, not the env's"
    code, out, _ = run(capsys, "status", "--json")
    assert (code, json.loads(out)) == (0, []), "without -f the environment's ledger, as before"


def test_a_workspace_names_the_code_location_and_its_ledger(capsys, shop, tmp_path):
    """-w workspace.yaml, as `dg dev -w` and `dagster` take it: its one location is loaded (from its working
    directory), its ledger read, and the printed commands repeat -w."""
    _, completed, _ = shop
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "workspace.yaml").write_text(
        "load_from:\n  - python_file:\n      relative_path: ../shop_location.py\n      attribute: shop_defs\n"
        "      working_directory: ..\n"
    )

    code, out, err = run(capsys, "restate", completed, "--reason", "late rows", "-w", "ws/workspace.yaml")

    assert code == 0, err
    assert commands(out, "materialize: ") == [
        ["dagster", "asset", "materialize", "-w", "ws/workspace.yaml", "--select", "orders__asia_kolkata",
         "--partition", "2026-03-08"]
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "mention"),
    [
        ("load_from: []\n", "declares 0 python_file or python_module locations"),
        ("load_from:\n  - python_file: a.py\n  - python_file: b.py\n", "declares 2 python_file"),
        ("load_from: [\n", "not valid YAML"),
    ],
)
def test_a_workspace_that_does_not_name_one_location_is_one_clear_error(capsys, shop, tmp_path, text, mention):
    (tmp_path / "bad.yaml").write_text(text)
    code, _, err = run(capsys, "status", "-w", "bad.yaml")
    assert code == 1 and mention in err and len(err.strip().splitlines()) == 1, err
