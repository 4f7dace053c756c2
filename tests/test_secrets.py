"""Secrets and personal data never reach logs: materializations run with a recognizable secret in the destination
credentials and recognizable customer data, and everything an operator or a log pipeline can read is searched.

* The secret: ``AWS_SECRET_ACCESS_KEY`` in the environment, for an ``s3://`` destination built by
  ``build_definitions(environ=None)``, so the resource holds a Dagster ``EnvVar`` (moto accepts any credentials).
* The customer data: a source whose invoices carry ``pii-canary-<n>@example.org`` emails and the amount 98765.43.

Searched: every event of each run (``result.all_events``, and the instance's event log ``instance.all_logs``), the run
record, every file the Dagster instance wrote (event log databases, compute logs), whatever the process printed
(Dagster's console logger), the ledger (attempt rows and the database file), and the output of the ``export-ledger``
CLI (``status``, ``attempts``, ``reconcile``, including their error paths). The runs include failures, since error
paths are where data leaks: bad source data (an event outside the window, amounts as text), an injected failure after
staging, and an unreachable store. The slow test does the same through ``dagster asset materialize`` subprocesses
reading the canary data from a SQL source.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import key_for, open_ledger
from harness.protocol import logical_key
from restatement_support import DAY

from assets.invoices import INVOICE_SCHEMA
from definitions import build_definitions
from export_ledger import cli
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.ledger import dispose_engines
from export_ledger.ledger.schema import ExportState, UtcDateTime
from export_ledger.protocol import ExportItem, export_key
from resources.invoices import InvoiceSource, SampleInvoiceSource

PROJECT = Path(__file__).resolve().parent.parent
DAGSTER = str(Path(sys.executable).parent / "dagster")
SECRET = "SECRET-canary-3b7f9d1e-never-log-me"
EMAIL_MARK = "pii-canary-"
AMOUNT = 98765.43
CANARIES = (SECRET, EMAIL_MARK, "@example.org", "98765.43")
JOB = "invoice_export_job"
GOOD, OUTSIDE, TEXT_AMOUNTS, INJECTED = "2026-03-08", "2026-03-09", "2026-03-10", "2026-03-11"


class CanarySource(InvoiceSource):
    """Invoices every 30 minutes with recognizable customer data; some dates carry a defect."""

    defects: dict[str, str] = {}

    def _frame(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        times = pd.date_range(
            pd.Timestamp(start_utc).ceil("30min"), pd.Timestamp(end_utc), freq="30min", inclusive="left"
        ).as_unit("us")
        n = len(times)
        return pd.DataFrame(
            {
                "invoice_id": [f"inv-{tenant}-{int(t.timestamp())}" for t in times],
                "tenant": [tenant] * n,
                "occurred_at": times,
                "amount": [AMOUNT] * n,
                "currency": ["EUR"] * n,
                "customer_email": [f"{EMAIL_MARK}{i}@example.org" for i in range(n)],
            }
        )

    def count(self, tenant, start_utc, end_utc) -> int:
        return len(self._frame(tenant, start_utc, end_utc))

    def rows(self, tenant, start_utc, end_utc) -> pd.DataFrame:
        frame = self._frame(tenant, start_utc, end_utc)
        defect = self.defects.get(pd.Timestamp(start_utc).tz_convert("America/New_York").date().isoformat())
        if defect == "outside_window":
            frame.loc[1, "occurred_at"] = pd.Timestamp(end_utc) + pd.Timedelta(hours=1)
        elif defect == "text_amounts":
            frame["amount"] = [f"{AMOUNT} EUR"] * len(frame)
        return frame


def leaks(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return [canary for canary in CANARIES if canary in text]


def leaks_in_files(folder: Path) -> dict[str, list[str]]:
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            hit = leaks(path.read_bytes())
            if hit:
                found[str(path.relative_to(folder))] = hit
    return found


@pytest.fixture
def canary_env(monkeypatch, tmp_path, s3_server, s3_bucket):
    """The process environment a deployment would have: an S3 destination whose secret is an EnvVar."""
    for name in (FAILPOINTS, "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "EXPORTS_SOURCE_URL"):
        monkeypatch.delenv(name, raising=False)
    values = {
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": f"s3://{s3_bucket}/exports",
        "EXPORTS_TENANTS": "acme",
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "canary-key-id",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    # The CLI finds the destination by importing definitions.py, which reads the environment at import, as a new
    # process would: make it import afresh.
    monkeypatch.delitem(sys.modules, "definitions", raising=False)
    yield values
    dispose_engines()


def run_and_capture(defs, instance, partition: str) -> tuple[dg.ExecuteInProcessResult, str]:
    result = defs.resolve_job_def(JOB).execute_in_process(
        partition_key=partition, instance=instance, raise_on_error=False
    )
    captured = [dg.serialize_value(event) for event in result.all_events]
    captured += [dg.serialize_value(entry) for entry in instance.all_logs(result.run_id)]
    captured.append(dg.serialize_value(instance.get_run_by_id(result.run_id)))
    return result, "\n".join(captured)


def test_no_secret_or_customer_data_in_event_logs_run_records_instance_files_ledger_or_cli(
    canary_env, tmp_path, monkeypatch, capfd, s3_bucket
):
    source = CanarySource(defects={OUTSIDE: "outside_window", TEXT_AMOUNTS: "text_amounts"})
    defs = build_definitions(source=source, environ=None)
    destination = defs.resources["invoice_export__destination"]
    secret = destination.settings["secret_access_key"]
    assert isinstance(secret, dg.EnvVar), "the secret reaches the resource as an EnvVar"

    home = tmp_path / "dagster_home"
    home.mkdir()
    outcomes, logs = {}, []
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        for partition in (GOOD, OUTSIDE, TEXT_AMOUNTS):
            result, captured = run_and_capture(defs, instance, partition)
            outcomes[partition] = result.success
            logs.append(captured)
        monkeypatch.setenv(FAILPOINTS, "after_stage=raise")
        result, captured = run_and_capture(defs, instance, INJECTED)
        outcomes[INJECTED] = result.success
        logs.append(captured)
        monkeypatch.delenv(FAILPOINTS)
        # The store gone: the destination's error path, with the secret still in the credentials.
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        result, captured = run_and_capture(build_definitions(source=source, environ=None), instance, "2026-03-12")
        outcomes["unreachable"] = result.success
        logs.append(captured)
        monkeypatch.setenv("AWS_ENDPOINT_URL", canary_env["AWS_ENDPOINT_URL"])
    printed = capfd.readouterr()

    assert outcomes == {GOOD: True, OUTSIDE: False, TEXT_AMOUNTS: False, INJECTED: False, "unreachable": False}
    everything = "\n".join(logs)
    assert "outside the window" in everything and "must be numeric" in everything, "the failures are in the logs"
    assert leaks(everything) == [], "no secret or customer data in any event, log entry or run record"
    assert leaks(printed.out + printed.err) == [], "nor in what the runs printed"
    assert leaks_in_files(home) == {}, "nor in any file of the Dagster instance (event logs, compute logs)"

    ledger = open_ledger(canary_env["EXPORTS_LEDGER_URL"])
    assert ledger.queries.get(f"invoice_export/acme/{GOOD}T05:00:00Z").state is ExportState.COMPLETED
    assert leaks(repr(ledger.queries.all_attempts())) == [], "the ledger's error messages hold no customer data"
    dispose_engines()
    for part in tmp_path.glob("ledger.sqlite3*"):
        assert leaks(part.read_bytes()) == [], f"the ledger database file {part.name} holds no customer data"

    # A stuck key for reconcile: an attempt that died holding its lease an hour ago.
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    open_ledger(canary_env["EXPORTS_LEDGER_URL"], clock=lambda: long_ago).claims.claim(
        logical_key("acme", "2026-03-13"), "dead-run/invoice_export"
    )
    dispose_engines()
    cli_runs = [
        (["status"], 0),
        (["status", "--json"], 0),
        (["attempts", f"invoice_export/acme/{GOOD}T05:00:00Z"], 0),
        (["attempts", "--json", f"invoice_export/acme/{OUTSIDE}T04:00:00Z"], 0),
        (["attempts", f"invoice_export/acme/{TEXT_AMOUNTS}T04:00:00Z"], 0),
        (["attempts", "invoice_export/acme/1999-01-01T05:00:00Z"], 1),
        (["reconcile"], 0),
        (["--ledger-url", f"postgresql+psycopg2://exporter:{SECRET}@127.0.0.1:9/ledger", "status"], 1),
    ]
    printed = []
    capfd.readouterr()
    for argv, code in cli_runs:
        assert cli.main(argv) == code, argv
        out, err = capfd.readouterr()
        shown = " ".join(argv).replace(SECRET, "<the secret>")  # the command line itself is ours, not the CLI's output
        printed.append(f"$ export-ledger {shown}\n{out}{err}")
    # reconcile's error path: the store unreachable, the secret still configured.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delitem(sys.modules, "definitions", raising=False)
    open_ledger(canary_env["EXPORTS_LEDGER_URL"], clock=lambda: long_ago).claims.claim(
        logical_key("acme", "2026-03-14"), "dead-run-2/invoice_export"
    )
    dispose_engines()
    assert cli.main(["reconcile"]) == 1
    out, err = capfd.readouterr()
    printed.append(f"$ reconcile (store unreachable)\n{out}{err}")
    transcript = "\n".join(printed)

    assert "outside the window" in transcript and "could not be reached" in transcript, transcript
    assert leaks(transcript) == [], f"no secret or customer data in CLI output:\n{transcript}"


def misfit_ledger_table(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE exported_invoices (logical_key VARCHAR(300), row_number BIGINT)"))
    engine.dispose()


def test_a_failed_ledger_table_write_keeps_customer_rows_out_of_the_event_log(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    open_ledger(url)
    misfit_ledger_table(url)
    defs = build_definitions(
        tenants=["acme"],
        ledger_url=url,
        destination=SqlTableDestination(url=url, table="exported_invoices"),
        source=CanarySource(),
        environ={},
    )
    instance = dg.DagsterInstance.ephemeral()
    result, captured = run_and_capture(defs, instance, GOOD)
    dispose_engines()

    assert not result.success and "exported_invoices" in captured
    assert leaks(captured) == [], "the failure names the table, never the rows"


def canary_sql_source(path: Path) -> str:
    """A SQLite ``invoices`` table with canary data, and bad rows (null emails) on 2026-03-09. The table has the
    columns ``SqlInvoiceSource`` reads but no constraints: it holds what an upstream system wrote."""
    url = f"sqlite:///{path}"
    table = sa.Table(
        "invoices",
        sa.MetaData(),
        sa.Column("invoice_id", sa.String(100)),
        sa.Column("tenant", sa.String(63)),
        sa.Column("occurred_at", UtcDateTime),
        sa.Column("amount", sa.Float),
        sa.Column("currency", sa.String(3)),
        sa.Column("customer_email", sa.String(320), nullable=True),
    )
    start = pd.Timestamp("2026-03-08T04:00Z")
    frame = CanarySource()._frame("acme", start, start + pd.Timedelta(days=2))
    frame.loc[frame["occurred_at"] >= pd.Timestamp("2026-03-09T12:00Z"), "customer_email"] = None
    rows = [{**row, "occurred_at": row["occurred_at"].to_pydatetime()} for row in frame.to_dict("records")]
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        table.create(conn)
        conn.execute(table.insert(), rows)
    engine.dispose()
    return url


@pytest.mark.slow
def test_no_secret_or_customer_data_in_dagster_asset_materialize_output(tmp_path, s3_server, s3_bucket):
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "AWS_"))},
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(PROJECT),
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": f"s3://{s3_bucket}/exports",
        "EXPORTS_TENANTS": "acme",
        "EXPORTS_SOURCE_URL": canary_sql_source(tmp_path / "source.sqlite3"),
        "EXPORTS_SOURCE_TABLE": "invoices",
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "canary-key-id",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
    }
    outputs = {}
    for partition in ("2026-03-08", "2026-03-09"):
        completed = subprocess.run(
            [
                DAGSTER,
                "asset",
                "materialize",
                "-f",
                "definitions.py",
                "--select",
                "invoice_export",
                "--partition",
                partition,
            ],
            cwd=PROJECT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        outputs[partition] = (completed.returncode, completed.stdout + completed.stderr)

    assert outputs["2026-03-08"][0] == 0, outputs["2026-03-08"][1][-3000:]
    assert outputs["2026-03-09"][0] != 0 and "column 'customer_email' has" in outputs["2026-03-09"][1]
    for partition, (_, output) in outputs.items():
        assert leaks(output) == [], f"{partition}: secret or customer data in the CLI's output"
    assert leaks_in_files(home) == {}, "nor in any file of the Dagster instance"


# -- a driver's message quoting a row never reaches the ledger ---------------------------------------------------------


@pytest.mark.postgres
def test_a_driver_message_quoting_a_row_never_reaches_the_ledger_through_atomic(postgres_url):
    """Suspected S2: `ExportLedger.atomic()` turns any OperationalError into LedgerUnavailable with the driver's text,
    and LedgerUnavailable's words are stored and logged as the library's own. A driver message that quotes a row
    (here a deferred constraint trigger on the ledger-table destination, failing at COMMIT with SQLSTATE 55000, an
    OperationalError, and quoting the row's customer_email) must never reach the attempts table.
    Fails on 0.4.0 (07f55b3): a driver's message quoting a row stored in export_attempts."""
    book = open_ledger(postgres_url)
    destination = SqlTableDestination(url=postgres_url, table="exported_invoices")
    source = SampleInvoiceSource()

    def invoices(key) -> ExportItem:
        rows = source.rows("acme", key.window.start_utc, key.window.end_utc)
        return ExportItem(key, key.window.business_date.isoformat(), rows)

    first = key_for(dt.date(2026, 3, 7))
    export_key(book, destination, INVOICE_SCHEMA, invoices(first), "run-1/invoice_export")  # makes the tables
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE FUNCTION refuse_invoice() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'refused invoice of %', NEW.customer_email USING ERRCODE = '55000'; END $$"
        ))  # fmt: skip
        conn.execute(sa.text(
            "CREATE CONSTRAINT TRIGGER refuse_invoices AFTER INSERT ON exported_invoices "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_invoice()"
        ))  # fmt: skip
    engine.dispose()
    key = key_for(DAY)
    with pytest.raises(Exception) as raised:
        export_key(book, destination, INVOICE_SCHEMA, invoices(key), "run-2/invoice_export")
    stored = " ".join(a.error_message or "" for a in book.queries.attempts(str(key)))
    observed = {"stored in export_attempts": stored[-160:], "raised": type(raised.value).__name__}
    assert stored, f"the failure is recorded on the key: {observed}"
    assert "@example.com" not in stored and "@example.com" not in str(raised.value), observed
    assert book.queries.get(str(key)).state is ExportState.FAILED, observed
