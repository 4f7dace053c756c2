"""The ``export-ledger`` operator CLI: tables, JSON, filters, errors and exit codes, on a ledger built in tmp."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import evidence_for, key_for, open_ledger

from export_ledger import SourceError, cli
from export_ledger.keys import LogicalKey
from export_ledger.ledger import CompletionEvidence, LeaseHeld, dispose_engines

PROJECT_ROOT = Path(__file__).resolve().parent.parent
ZONE = "America/New_York"
PREFIX = "export-ledger: error:"
UNREACHABLE_WITH_PASSWORD = "postgresql+psycopg2://u:topsecret@127.0.0.1:1/x"


def key(tenant: str, day: int, export: str = "invoice_export") -> LogicalKey:
    return key_for(dt.date(2026, 3, day), export=export, tenant=tenant)


def evidence(claim, rows: int) -> CompletionEvidence:
    return evidence_for(claim, row_count=rows)


# The ledger every test reads: one logical key per state, two exports, three tenants, three business dates.
ACME_7 = str(key("acme", 7))  # completed after a failed attempt and a refused one
ACME_8 = str(key("acme", 8))  # completed at the first attempt
GLOBEX_7 = str(key("globex", 7))  # failed
GLOBEX_8 = str(key("globex", 8))  # in_progress, lease held by run-globex-8
INITECH_9 = str(key("initech", 9))  # remote_unknown
PAYMENTS_ACME_8 = str(key("acme", 8, export="payment_export"))  # completed, another export
ALL_KEYS = {ACME_7, ACME_8, GLOBEX_7, GLOBEX_8, INITECH_9, PAYMENTS_ACME_8}


@pytest.fixture
def ledger_url(sqlite_url: str, clock) -> str:
    ledger = open_ledger(sqlite_url, clock=clock)

    first = ledger.claims.claim(key("acme", 7), "run-acme-7a")
    clock.advance(minutes=1)
    ledger.completions.fail(first, SourceError("source timed out\x1b[31m\nafter 30 s"))
    clock.advance(minutes=1)
    retry = ledger.claims.claim(key("acme", 7), "run-acme-7b")
    with pytest.raises(LeaseHeld):
        ledger.claims.claim(key("acme", 7), "run-acme-7c")
    clock.advance(minutes=1)
    ledger.completions.complete(retry, evidence(retry, 42))

    claim = ledger.claims.claim(key("acme", 8), "run-acme-8")
    ledger.completions.complete(claim, evidence(claim, 7))
    claim = ledger.claims.claim(key("acme", 8, export="payment_export"), "run-payments-8")
    ledger.completions.complete(claim, evidence(claim, 3))
    claim = ledger.claims.claim(key("globex", 7), "run-globex-7")
    ledger.completions.fail(claim, ValueError("negative amount in frame"))
    claim = ledger.claims.claim(key("initech", 9), "run-initech-9")
    ledger.completions.mark_remote_unknown(claim, TimeoutError("upload timed out"))
    ledger.claims.claim(key("globex", 8), "run-globex-8")
    return sqlite_url


@pytest.fixture
def wide_terminal(monkeypatch) -> None:
    """A terminal wide enough for every column on one line: the tests that read a table's cells by position."""
    monkeypatch.setenv("COLUMNS", "400")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def status_json(capsys, ledger_url: str, *filters: str) -> list[dict]:
    code, out, err = run(capsys, "--ledger-url", ledger_url, "status", "--json", *filters)
    assert code == 0, f"status --json {filters} should succeed, stderr: {err}"
    return json.loads(out)


def assert_one_error_line(err: str, *mentions: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"an error should be one line on stderr, got: {err!r}"
    assert lines[0].startswith(PREFIX), f"the error line should start with {PREFIX!r}: {lines[0]!r}"
    for mention in mentions:
        assert mention in lines[0], f"the error should name {mention!r}: {lines[0]!r}"
    assert "Traceback" not in err


# -- status ------------------------------------------------------------------------------------------------------


def test_status_table_lists_every_export_with_its_state_date_zone_rows_and_committed_attempt(
    capsys, ledger_url, wide_terminal
):
    code, out, err = run(capsys, "--ledger-url", ledger_url, "status")

    assert code == 0 and err == ""
    header, *rows = out.strip().splitlines()
    for column in (
        "LOGICAL KEY",
        "STATE",
        "BUSINESS DATE",
        "ZONE",
        "ROWS",
        "COMMITTED ATTEMPT",
        "LEASE OWNER",
        "LEASE EXPIRES",
        "UPDATED",
    ):
        assert column in header, f"the status table should have a {column} column"
    assert {row.split()[0] for row in rows} == ALL_KEYS, "every logical export should have one row"
    acme_7 = next(row.split() for row in rows if row.startswith(ACME_7 + " "))
    assert acme_7[1:6] == ["completed", "2026-03-07", ZONE, "42", "run-acme-7b"], (
        "a completed export should show its business date, zone, row count and the attempt that committed it"
    )


def test_status_table_shows_lease_owner_and_expiry_only_for_in_progress_exports(capsys, ledger_url, wide_terminal):
    code, out, _ = run(capsys, "--ledger-url", ledger_url, "status")

    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.strip().splitlines()[1:]}
    # Claimed at the fixture clock's 09:33 with the default 15-minute lease.
    assert rows[GLOBEX_8][6:8] == ["run-globex-8", "2026-03-20T09:48:00Z"], "in_progress shows who holds the lease"
    for logical_key in ALL_KEYS - {GLOBEX_8}:
        assert rows[logical_key][6:8] == ["-", "-"], f"{logical_key} is not in progress and holds no lease"


def test_status_json_round_trips_with_utc_z_timestamps_and_plain_dates(capsys, ledger_url):
    records = {record["logical_key"]: record for record in status_json(capsys, ledger_url)}

    assert set(records) == ALL_KEYS
    in_progress = records[GLOBEX_8]
    assert in_progress["state"] == "in_progress"
    assert in_progress["lease_owner"] == "run-globex-8"
    assert in_progress["lease_expires_at"] == "2026-03-20T09:48:00Z", "timestamps are ISO 8601 UTC with a Z"
    assert in_progress["business_date"] == "2026-03-08", "business dates are plain YYYY-MM-DD"
    assert in_progress["window_start_utc"] == "2026-03-08T05:00:00Z"
    completed = records[ACME_7]
    assert (completed["row_count"], completed["committed_attempt"]) == (42, "run-acme-7b")
    assert completed["lease_owner"] is None and completed["lease_expires_at"] is None
    for record in records.values():
        for field in ("created_at", "updated_at", "window_start_utc", "window_end_utc"):
            assert record[field].endswith("Z"), f"{field} should be UTC with a Z suffix: {record[field]}"


def test_status_json_exposes_only_the_chosen_ledger_fields(capsys, ledger_url):
    # The CLI picks fields one by one, so a column added to the ledger is not printed until someone decides so.
    expected = {
        "logical_key",
        "export",
        "tenant",
        "business_date",
        "timezone",
        "window_start_utc",
        "window_end_utc",
        "state",
        "row_count",
        "committed_attempt",
        "location",
        "sha256",
        "fencing_token",
        "lease_owner",
        "lease_expires_at",
        "created_at",
        "updated_at",
        "revision",
    }
    for record in status_json(capsys, ledger_url):
        assert set(record) == expected


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        pytest.param(["--export", "payment_export"], {PAYMENTS_ACME_8}, id="export"),
        pytest.param(["--tenant", "acme"], {ACME_7, ACME_8, PAYMENTS_ACME_8}, id="tenant"),
        pytest.param(["--from", "2026-03-08"], {ACME_8, GLOBEX_8, INITECH_9, PAYMENTS_ACME_8}, id="from-inclusive"),
        pytest.param(["--to", "2026-03-07"], {ACME_7, GLOBEX_7}, id="to-inclusive"),
        pytest.param(["--from", "2026-03-08", "--to", "2026-03-08"], {ACME_8, GLOBEX_8, PAYMENTS_ACME_8}, id="one-day"),
        pytest.param(["--state", "failed"], {GLOBEX_7}, id="state"),
        pytest.param(["--state", "in_progress", "--state", "remote_unknown"], {GLOBEX_8, INITECH_9}, id="states"),
        pytest.param(
            ["--tenant", "acme", "--export", "invoice_export", "--state", "completed"], {ACME_7, ACME_8}, id="combined"
        ),
    ],
)
def test_status_filters_select_exactly_the_matching_exports(capsys, ledger_url, filters, expected):
    assert {record["logical_key"] for record in status_json(capsys, ledger_url, *filters)} == expected


def test_status_filters_apply_to_the_table_too(capsys, ledger_url, wide_terminal):
    code, out, _ = run(capsys, "--ledger-url", ledger_url, "status", "--state", "failed")

    assert code == 0
    assert [line.split()[0] for line in out.strip().splitlines()[1:]] == [GLOBEX_7]


def test_status_limit_keeps_the_first_exports_in_export_date_tenant_order(capsys, ledger_url):
    records = status_json(capsys, ledger_url, "--limit", "2")

    assert [record["logical_key"] for record in records] == [ACME_7, GLOBEX_7]


def test_status_offset_pages_on_and_a_full_page_says_how_to_see_the_next_one(capsys, ledger_url, wide_terminal):
    records = status_json(capsys, ledger_url, "--limit", "2", "--offset", "2")
    assert [record["logical_key"] for record in records] == [ACME_8, GLOBEX_8], "the next page, in the same order"

    code, out, _ = run(capsys, "--ledger-url", ledger_url, "status", "--limit", "2", "--offset", "2")
    assert code == 0
    assert out.strip().splitlines()[-1] == "(the first 2 rows from 2; --offset 4 shows the next ones)", (
        "a page that stopped at its limit says how to page on"
    )
    code, out, _ = run(capsys, "--ledger-url", ledger_url, "status", "--limit", "3", "--offset", "4")
    assert code == 0 and len(out.strip().splitlines()) == 3, "the header and the last two keys"
    assert "--offset" not in out, "a page shorter than its limit is the last: it says nothing more"


def test_status_reads_at_most_500_keys_by_default(capsys, tmp_path, clock):
    url = f"sqlite:///{tmp_path / 'large.sqlite3'}"
    ledger = open_ledger(url, clock=clock)
    ledger.claims.claim_many([key(f"t{i:03d}", 8) for i in range(501)], "run-large/invoice_export")

    assert len(status_json(capsys, url)) == cli.STATUS_LIMIT == 500, "every CLI read is bounded"
    code, out, _ = run(capsys, "--ledger-url", url, "status")
    assert code == 0 and out.strip().endswith("--offset 500 shows the next ones)")
    assert len(status_json(capsys, url, "--offset", "500")) == 1


def test_status_without_matches_says_so_in_table_and_prints_an_empty_array_in_json(capsys, ledger_url):
    code, out, err = run(capsys, "--ledger-url", ledger_url, "status", "--tenant", "acme", "--state", "failed")
    assert (code, out.strip(), err) == (0, "no exports match", "")

    code, out, err = run(
        capsys, "--ledger-url", ledger_url, "status", "--tenant", "acme", "--state", "failed", "--json"
    )
    assert (code, json.loads(out), err) == (0, [], "")


# -- attempts ----------------------------------------------------------------------------------------------------


def test_attempts_table_lists_one_keys_attempts_in_order_with_error_class_and_message(
    capsys, ledger_url, wide_terminal
):
    code, out, err = run(capsys, "--ledger-url", ledger_url, "attempts", ACME_7)

    assert code == 0 and err == ""
    header, *rows = out.strip().splitlines()
    for column in ("ATTEMPT", "TOKEN", "STARTED", "FINISHED", "OUTCOME", "ERROR", "MESSAGE"):
        assert column in header
    assert [row.split()[0] for row in rows] == ["run-acme-7a", "run-acme-7c", "run-acme-7b"], "attempts in order"
    assert [row.split()[4] for row in rows] == ["failed", "refused", "completed"]
    assert rows[0].split()[1:4] == ["1", "2026-03-20T09:30:00Z", "2026-03-20T09:31:00Z"], "token, started, finished"
    assert "SourceError" in rows[0] and "source timed out" in rows[0]
    assert "LeaseHeld" in rows[1], "a refused attempt says why"


def test_attempts_table_escapes_control_characters_in_stored_messages(capsys, ledger_url, wide_terminal):
    _, out, _ = run(capsys, "--ledger-url", ledger_url, "attempts", ACME_7)

    assert "\x1b" not in out, "a stored message must not send terminal escape sequences"
    assert "source timed out\\x1b[31m\\nafter 30 s" in out, "a message stays on its row, escaped"


def test_attempts_json_round_trips_with_outcomes_tokens_and_errors(capsys, ledger_url):
    code, out, _ = run(capsys, "--ledger-url", ledger_url, "attempts", ACME_7, "--json")

    assert code == 0
    attempts = json.loads(out)
    assert [(a["attempt_id"], a["fencing_token"], a["outcome"]) for a in attempts] == [
        ("run-acme-7a", 1, "failed"),
        ("run-acme-7c", None, "refused"),
        ("run-acme-7b", 2, "completed"),
    ]
    assert attempts[0]["error_class"] == "SourceError"
    assert attempts[0]["error_message"] == "source timed out\x1b[31m\nafter 30 s", "JSON keeps the stored message"
    assert attempts[0]["started_at"] == "2026-03-20T09:30:00Z" and attempts[0]["finished_at"] == "2026-03-20T09:31:00Z"
    assert attempts[2]["error_class"] is None and attempts[2]["error_message"] is None


def test_attempts_shows_the_last_200_attempts_and_says_how_many_there_are(capsys, ledger_url, clock, wide_terminal):
    ledger = open_ledger(ledger_url, clock=clock)
    for n in range(201):  # globex's 2026-03-08 lease is live: each claim is refused, and recorded
        with pytest.raises(LeaseHeld):
            ledger.claims.claim(key("globex", 8), f"run-refused-{n:03d}")

    code, out, _ = run(capsys, "--ledger-url", ledger_url, "attempts", GLOBEX_8)
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert rows[-1] == f"(the last {cli.ATTEMPTS_LIMIT} of 201 attempts)", "a bounded read says what it left out"
    shown = [row.split()[0] for row in rows[:-1]]
    assert shown == [f"run-refused-{n:03d}" for n in range(1, 201)], "the newest 200, oldest first"
    code, out, _ = run(capsys, "--ledger-url", ledger_url, "attempts", GLOBEX_8, "--json")
    assert code == 0 and [a["attempt_id"] for a in json.loads(out)] == shown, "JSON is bounded the same way"


def test_attempts_of_a_first_attempt_still_running_says_none_finished_yet(capsys, ledger_url):
    code, out, _ = run(capsys, "--ledger-url", ledger_url, "attempts", GLOBEX_8)
    assert code == 0
    assert out.strip() == f"no finished attempts for {GLOBEX_8} yet (state in_progress)"

    code, out, _ = run(capsys, "--ledger-url", ledger_url, "attempts", GLOBEX_8, "--json")
    assert (code, json.loads(out)) == (0, [])


def test_attempts_of_an_unknown_key_is_an_error_naming_the_key(capsys, ledger_url):
    unknown = "invoice_export/acme/2030-01-01T05:00:00Z"
    code, out, err = run(capsys, "--ledger-url", ledger_url, "attempts", unknown)

    assert code == 1 and out == ""
    assert_one_error_line(err, "unknown logical key", unknown)


# -- choosing the ledger -----------------------------------------------------------------------------------------


def test_ledger_url_comes_from_the_environment_when_not_given(capsys, ledger_url, monkeypatch):
    monkeypatch.setenv(cli.LEDGER_URL_ENV, ledger_url)

    code, out, _ = run(capsys, "status", "--state", "failed")

    assert code == 0 and GLOBEX_7 in out


def test_ledger_url_option_overrides_the_environment_before_or_after_the_subcommand(
    capsys, ledger_url, tmp_path, monkeypatch
):
    monkeypatch.setenv(cli.LEDGER_URL_ENV, f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}")

    assert run(capsys, "--ledger-url", ledger_url, "status")[0] == 0
    assert run(capsys, "status", "--ledger-url", ledger_url)[0] == 0
    assert run(capsys, "attempts", ACME_7, "--ledger-url", ledger_url)[0] == 0


def test_ledger_url_defaults_to_var_ledger_in_the_working_directory(capsys, ledger_url, monkeypatch, tmp_path):
    monkeypatch.delenv(cli.LEDGER_URL_ENV, raising=False)
    dispose_engines()  # the last connection's close checkpoints the WAL into the file copied below
    (tmp_path / "cwd" / "var").mkdir(parents=True)
    shutil.copy(ledger_url.removeprefix("sqlite:///"), tmp_path / "cwd" / "var" / "ledger.sqlite3")
    monkeypatch.chdir(tmp_path / "cwd")

    code, out, _ = run(capsys, "status", "--state", "remote_unknown")

    assert code == 0 and INITECH_9 in out


# -- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["2026-02-30", "20260308", "yesterday", "2026-3-8"])
@pytest.mark.parametrize("option", ["--from", "--to"])
def test_an_invalid_date_is_a_usage_error_naming_the_option_and_value(capsys, ledger_url, option, text):
    code, out, err = run(capsys, "--ledger-url", ledger_url, "status", option, text)

    assert code == 2 and out == ""
    assert_one_error_line(err, option, repr(text), "YYYY-MM-DD")


def test_from_after_to_is_a_usage_error(capsys, ledger_url):
    code, _, err = run(capsys, "--ledger-url", ledger_url, "status", "--from", "2026-03-09", "--to", "2026-03-08")

    assert code == 2
    assert_one_error_line(err, "--from 2026-03-09 is after --to 2026-03-08")


def test_an_unknown_state_is_a_usage_error_listing_the_known_ones(capsys, ledger_url):
    code, _, err = run(capsys, "--ledger-url", ledger_url, "status", "--state", "done")

    assert code == 2
    assert_one_error_line(err, "--state", "'done'", "in_progress", "remote_unknown")


@pytest.mark.parametrize(
    ("argv", "mention"),
    [
        pytest.param(["status", "--limit", "0"], "--limit", id="limit-zero"),
        pytest.param(["status", "--limit", "ten"], "--limit", id="limit-text"),
        pytest.param(["status", "--tenant", "../acme"], "tenant id", id="tenant-not-a-slug"),
        pytest.param(["status", "--export", "Invoice Export"], "export name", id="export-not-a-slug"),
        pytest.param([], "COMMAND", id="no-subcommand"),
        pytest.param(["attempts"], "LOGICAL_KEY", id="attempts-without-key"),
        pytest.param(["purge"], "invalid choice", id="unknown-subcommand"),
    ],
)
def test_other_usage_errors_are_one_line_with_exit_code_2(capsys, ledger_url, argv, mention):
    code, _, err = run(capsys, "--ledger-url", ledger_url, *argv)

    assert code == 2
    assert_one_error_line(err, mention)


@pytest.mark.parametrize(
    ("argv", "mention"),
    [
        (["drift"], "drift needs the declared exports"),
        (["restate", ACME_8], "restate needs a reason"),
        (["restate", "--export", "invoice_export", "--reason", "x"], "restate takes a LOGICAL_KEY"),
        (["accept-contract", "--export", "invoice_export", "--timezone", "UTC", "--reason", "x"], "go together"),
        (["prune", "--older-than", "3", "--close-unexported"], "--close-unexported needs --reason"),
        (["resolve", ACME_8, "--accept-destination", "--reason", " "], "--reason must say why"),
        (["status", "--from", "2026-03-09", "--to", "2026-03-08"], "is after --to"),
        (["status", "--needs-attention", "-a", "defs"], "-a ATTRIBUTE names the Definitions"),
        (["status", "--state", "restating", "--state", "failed"], "cannot be combined"),
    ],
)
def test_a_usage_error_is_exit_2_before_any_ledger_is_opened(capsys, tmp_path, argv, mention):
    """What the options alone say is wrong is said first: a script gets exit 2 whether or not the ledger is there.
    Guard: each command's ``check``; checked after the open, a missing ledger made these exit 1."""
    missing = tmp_path / "absent.sqlite3"

    code, _, err = run(capsys, "--ledger-url", f"sqlite:///{missing}", *argv)

    assert code == 2
    assert_one_error_line(err, mention)


def test_a_missing_sqlite_ledger_is_an_error_and_is_not_created(capsys, tmp_path):
    missing = tmp_path / "absent" / "ledger.sqlite3"

    code, out, err = run(capsys, "--ledger-url", f"sqlite:///{missing}", "status")

    assert code == 1 and out == ""
    assert_one_error_line(err, str(missing), "does not exist")
    assert not missing.parent.exists(), "a read must not create the ledger's folder or file"


def test_a_sqlite_file_that_is_not_a_ledger_is_refused_and_left_untouched(capsys, tmp_path):
    stray = tmp_path / "notes.sqlite3"
    stray.write_bytes(b"")

    code, _, err = run(capsys, "--ledger-url", f"sqlite:///{stray}", "status")

    assert code == 1
    assert_one_error_line(err, str(stray), "not an export ledger")
    assert stray.read_bytes() == b"", "the CLI must not add ledger tables to another database"


@pytest.mark.parametrize("argv", [["reconcile"], ["prune", "--older-than", "30", "--yes"]])
def test_a_command_that_writes_refuses_a_sqlite_file_that_is_not_a_ledger_and_leaves_it_untouched(
    capsys, tmp_path, argv
):
    """Guard: an operator's command opens the ledger with ``create=False``; opened as runs open it, the CLI would make
    the stray file a new, empty ledger."""
    stray = tmp_path / "notes.sqlite3"
    stray.write_bytes(b"")

    code, _, err = run(capsys, "--ledger-url", f"sqlite:///{stray}", *argv)

    assert code == 1
    assert_one_error_line(err, str(stray), "not an export ledger", "never creates")
    assert stray.read_bytes() == b"", "the CLI must not add ledger tables to another database"


@pytest.mark.postgres
def test_a_command_that_writes_creates_nothing_in_an_empty_postgres_database(postgres_url, capsys):
    import sqlalchemy as sa

    code, _, err = run(capsys, "--ledger-url", postgres_url, "reconcile")

    assert code == 1
    assert_one_error_line(err, "not an export ledger")
    assert sa.inspect(sa.create_engine(postgres_url)).get_table_names() == [], "no table created by an operator"


def test_an_in_memory_sqlite_url_is_refused(capsys):
    code, _, err = run(capsys, "--ledger-url", "sqlite://", "status")

    assert code == 1
    assert_one_error_line(err, "in-memory")


def test_an_unreachable_ledger_is_an_error_that_never_prints_the_password(capsys):
    code, out, err = run(capsys, "--ledger-url", UNREACHABLE_WITH_PASSWORD, "status")

    assert code == 1 and out == ""
    assert_one_error_line(err, "cannot reach the ledger", "127.0.0.1")
    assert "topsecret" not in out + err, "the password in the URL must never be printed"


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("postgresql+psycopg2://u:topsecret@127.0.0.1:port/x", id="unparsable"),
        pytest.param("nosuchdb://u:topsecret@127.0.0.1/x", id="unknown-dialect"),
    ],
)
def test_an_unusable_ledger_url_is_an_error_that_never_prints_the_password(capsys, url):
    code, out, err = run(capsys, "--ledger-url", url, "attempts", ACME_7)

    assert code == 1
    assert_one_error_line(err)
    assert "topsecret" not in out + err, "the password in the URL must never be printed"


# -- the real console entry --------------------------------------------------------------------------------------


def run_console(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != cli.LEDGER_URL_ENV}
    environ.update(env or {}, PYTHONPATH=str(PROJECT_ROOT))
    return subprocess.run(
        [str(Path(sys.executable).parent / "export-ledger"), *argv],
        cwd=PROJECT_ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_console_entry_exits_0_on_success_1_on_runtime_errors_and_2_on_usage_errors(ledger_url):
    ok = run_console("--ledger-url", ledger_url, "status", "--json")
    assert ok.returncode == 0, ok.stderr
    assert {record["logical_key"] for record in json.loads(ok.stdout)} == ALL_KEYS
    assert ok.stderr == ""

    unknown = run_console("--ledger-url", ledger_url, "attempts", "nope")
    assert unknown.returncode == 1
    assert_one_error_line(unknown.stderr, "'nope'")

    unreachable = run_console("--ledger-url", UNREACHABLE_WITH_PASSWORD, "status")
    assert unreachable.returncode == 1
    assert_one_error_line(unreachable.stderr, "cannot reach the ledger")
    assert "topsecret" not in unreachable.stdout + unreachable.stderr

    usage = run_console("--ledger-url", ledger_url, "status", "--state", "done")
    assert usage.returncode == 2
    assert_one_error_line(usage.stderr, "--state")


def test_console_entry_reads_the_ledger_url_from_the_environment(ledger_url):
    result = run_console("attempts", ACME_7, env={cli.LEDGER_URL_ENV: ledger_url})

    assert result.returncode == 0, result.stderr
    assert "run-acme-7b" in result.stdout


def test_importing_the_cli_or_naming_a_ledger_does_not_load_dagster_or_the_code_location(ledger_url):
    # The CLI reads the settings module, never a code location (definitions.py builds one on import).
    check = (
        "import sys; from export_ledger import cli; code = cli.main(sys.argv[1:]); "
        "loaded = sorted(m for m in ('dagster', 'definitions') if m in sys.modules); "
        "print(loaded, file=sys.stderr); sys.exit(code)"
    )
    environ = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    result = subprocess.run(
        [sys.executable, "-c", check, "--ledger-url", ledger_url, "status"],
        cwd=PROJECT_ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "[]", "neither Dagster nor definitions.py should be imported"


def test_a_bad_setting_is_one_error_line_naming_it_and_no_code_location_is_loaded():
    result = run_console("status", env={"EXPORTS_LEASE_TTL_SECONDS": "soon"})

    assert result.returncode == 1
    assert_one_error_line(result.stderr, "EXPORTS_LEASE_TTL_SECONDS", "'soon'")


def test_status_of_an_export_the_ledger_does_not_know_names_the_known_ones(capsys, ledger_url):
    code, out, err = run(capsys, "--ledger-url", ledger_url, "status", "--export", "orders")

    assert code == 1 and out == ""
    assert "no export named 'orders'" in err and "invoice_export" in err


@pytest.mark.parametrize(
    "argv",
    [
        ("status", "--tenant", "hooli"),
        ("status", "--export", "invoice_export", "--tenant", "hooli"),
        ("restate", "--export", "invoice_export", "--date", "2026-03-07", "--tenant", "hooli", "--reason", "typo"),
        ("accept-contract", "--export", "invoice_export", "--tenant", "hooli", "--keep-exported", "--reason", "typo"),
    ],
    ids=["status", "status-of-an-export", "restate", "accept-contract"],
)
def test_a_tenant_the_ledger_does_not_know_is_an_error_naming_the_known_ones(capsys, ledger_url, argv):
    """A typo in --tenant is not an empty result (or a request for nothing): like --export, it lists what is known."""
    code, out, err = run(capsys, "--ledger-url", ledger_url, *argv)

    assert code == 1 and out == ""
    assert "no tenant 'hooli'" in err and "acme, globex, initech" in err, err


def test_a_known_tenant_is_listed_as_before(capsys, ledger_url):
    code, out, _ = run(capsys, "--ledger-url", ledger_url, "status", "--tenant", "globex")

    assert code == 0 and "globex" in out and "acme" not in out


def test_needs_attention_prints_each_escalations_way_out_as_commands_to_paste(
    capsys, ledger_url, tmp_path, monkeypatch
):
    """Each escalated key's way out as whole commands (never wrapped into the table's column), in the code location
    of the working directory when its definitions.py is there, else with a placeholder for it: a printed command never
    names a file that is not where it is printed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # this shell has an instance (the note without one: below)
    argv = [
        "--ledger-url",
        ledger_url,
        "status",
        "--needs-attention",
        "--max-attempts",
        "1",
        "--stuck-after-hours",
        "1",
    ]

    code, out, _ = run(capsys, *argv)

    assert code == 0
    _, ways = out.split("ways out, to paste (write each --reason; lines with # are notes):\n")
    url = ["--ledger-url", ledger_url]
    assert ways.splitlines() == [
        "# the commands name YOUR_DEFINITIONS.py where yours goes (there is no ./definitions.py here); pass -f FILE or "
        "-m MODULE [-a ATTRIBUTE] and they name yours",
        "  invoice_export/globex/2026-03-07T05:00:00Z",
        "    # the asset is a guess from the zones (or invoice_export__america_new_york); -f or -m names it",
        "    dagster asset materialize -f YOUR_DEFINITIONS.py --select invoice_export --partition 2026-03-07",
        "  invoice_export/globex/2026-03-08T05:00:00Z",
        "    " + shlex.join(["export-ledger", "reconcile", "--export", "invoice_export", *url]),
        "  invoice_export/initech/2026-03-09T04:00:00Z",
        "    " + shlex.join(["export-ledger", "reconcile", "--export", "invoice_export", *url]),
        "    # if it stays remote_unknown, one of:",
        "    " + shlex.join(["export-ledger", "resolve", "invoice_export/initech/2026-03-09T04:00:00Z",
                             "--accept-destination", *url, "--reason"]),
        "    " + shlex.join(["export-ledger", "resolve", "invoice_export/initech/2026-03-09T04:00:00Z",
                             "--discard-destination", *url, "--reason"]),
    ]  # fmt: skip
    pasted = shlex.split(ways.splitlines()[-1])[1:]
    code, _, err = run(capsys, *pasted)
    assert code == 2 and "--reason" in err, "pasted unread, a command with no reason written is refused"

    (tmp_path / "definitions.py").write_text("")
    code, out, _ = run(capsys, *argv)
    assert "    dagster asset materialize -f definitions.py --select invoice_export --partition 2026-03-07" in out

    code, out, _ = run(capsys, *argv, "--json")
    by_key = {item["logical_key"]: item["ways_out"] for item in json.loads(out)}
    assert by_key["invoice_export/globex/2026-03-07T05:00:00Z"][-1] == (
        "dagster asset materialize -f definitions.py --select invoice_export --partition 2026-03-07"
    )


def test_the_way_out_of_a_never_claimed_partition_a_restatement_and_a_conflict(sqlite_url, tmp_path, monkeypatch):
    from export_ledger import operations
    from export_ledger.ledger.attention import Escalation

    monkeypatch.chdir(tmp_path)
    (tmp_path / "definitions.py").write_text("")
    ledger = open_ledger(sqlite_url)
    since = dt.datetime(2026, 3, 9, tzinfo=dt.timezone.utc)
    day = dt.date(2026, 3, 8)
    key = "invoice_export/acme/2026-03-08T05:00:00Z"

    def way(state, zone="America/New_York", logical_key=key, **kwargs):
        escalation = Escalation("invoice_export", None, zone, logical_key, state, since, "why", None, day)
        return operations.ways_out(ledger, escalation, None, **kwargs)

    rerun = "dagster asset materialize -f definitions.py --select {} --partition 2026-03-08"
    guess = "# the asset is a guess from the zones (or invoice_export__america_new_york); -f or -m names it"
    assert way("never claimed", logical_key=None) == [guess, rerun.format("invoice_export")], (
        "a ledger whose contracts name no zone: the asset is a guess, said so"
    )
    assert way("restating") == [
        guess,
        rerun.format("invoice_export"),
        "# or, to give the restatement up:",
        f"export-ledger restate --withdraw {key} --reason",
    ]
    assert way("conflict") == [
        "# one of:",
        f"export-ledger resolve {key} --accept-destination --reason",
        f"export-ledger resolve {key} --discard-destination --reason",
    ]
    assert way("conflict", ledger_url="postgresql://u:pw@db/x")[0] == (
        "# add --ledger-url as you gave it (not repeated here: it holds a password)"
    )
    assert way("refused", logical_key=None) == [], "a refused contract's command is in its why already"


def test_the_asset_of_a_zone_is_the_one_that_exported_a_key_there_else_a_guess_said_so(sqlite_url, tmp_path):
    """Without a code location, a zone's asset comes from a completed key of that zone (its attempt names the step),
    and a guess from the zones is said to be one."""
    from export_ledger import operations
    from export_ledger.ledger.attention import Escalation

    ledger = open_ledger(sqlite_url)
    claim = ledger.claims.claim(
        key_for(dt.date(2026, 3, 7), tenant="bombay", timezone="Asia/Kolkata"), "run-9/invoice_export__asia_kolkata"
    )
    ledger.completions.complete(claim, evidence_for(claim))
    since = dt.datetime(2026, 3, 9, tzinfo=dt.timezone.utc)

    def rerun(zone):
        escalation = Escalation("invoice_export", None, zone, None, "never claimed", since, "why", None,
                                dt.date(2026, 3, 8))  # fmt: skip
        return operations.ways_out(ledger, escalation, None)

    assert rerun("Asia/Kolkata")[-1].endswith("--select invoice_export__asia_kolkata --partition 2026-03-08")
    assert len(rerun("Asia/Kolkata")) == 1, "known from the key exported there: no note"
    guessed = rerun("Europe/Dublin")
    assert guessed[0].startswith("# the asset is a guess from the zones"), guessed


def test_the_known_tenants_listed_are_the_first_in_order_and_say_when_there_are_more(capsys, tmp_path, clock):
    url = f"sqlite:///{tmp_path / 'many.sqlite3'}"
    open_ledger(url, clock=clock).claims.claim_many([key(f"t{i:03d}", 8) for i in range(150)], "run-many/x")

    code, _, err = run(capsys, "--ledger-url", url, "status", "--tenant", "t999")

    assert code == 1
    assert "(known: t000, t001, t002" in err and "t019, ...)" in err, err


def test_needs_attention_for_a_tenant_with_no_trace_in_the_ledger_is_not_refused(capsys, ledger_url):
    """A tenant the code declares can be late before it has a key, and a partition never claimed concerns every
    tenant: --needs-attention --tenant is not checked against the ledger."""
    code, out, err = run(capsys, "--ledger-url", ledger_url, "status", "--needs-attention", "--tenant", "newcomer")

    assert (code, err) == (0, "") and "no export key needs attention" in out
