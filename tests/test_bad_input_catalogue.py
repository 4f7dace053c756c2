"""The bad-input catalogue: one table of bad inputs, each refused with a clear error, nothing published, no
``completed`` record, and the ledger consistent afterwards.

``test_bad_input.py`` covers a first set (missing column, a null amount, naive timestamps, text amounts, a duplicate id,
an event before the window, a file where the destination root belongs, an unreachable ledger, ...); this catalogue adds
other inputs of every kind: CLI arguments, configuration, partition keys, tenant ids, source data and destinations
(a read-only root and a full disk, both real tmpfs mounts; an S3 bucket that does not exist, an S3 endpoint nobody
answers, a ledger table whose existing schema does not fit).

Every case starts from the same ledger and export folder, holding one completed export (2026-03-07), and is checked
the same way:

* the error names the problem (expected fragments, no Python traceback for the CLI);
* nothing new is published at the case's destination (readers see only what a key's pointer names: no new pointer
  names anything) and the existing export is unchanged, byte for byte (its pointer and the place it names);
* no new ``completed`` record; the ledger is consistent: no lease left behind, every record has attempt rows that
  agree with its state, every ``completed`` record has its export; inputs refused before a run leave the ledger
  exactly as it was;
* for inputs that reached a run (source data, destinations): once the input is corrected, the same partition exports
  exactly once, proving the failed attempt left the key retryable.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import open_ledger
from harness.protocol import Survey, survey, violations
from pipeline_helpers import failure_message

from definitions import build_definitions
from export_ledger import cli
from export_ledger.destinations import LocalDestination
from export_ledger.destinations.s3 import S3Destination
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.ledger import ExportLedger, dispose_engines
from export_ledger.ledger.schema import AttemptOutcome, ExportState
from resources.invoices import InvoiceSource, SampleInvoiceSource

JOB = "invoice_export_job"
BASELINE_DATE = "2026-03-07"
PARTITION = "2026-03-08"
KEY = "invoice_export/acme/2026-03-08T05:00:00Z"


# -- the source defects ---------------------------------------------------------------------------------------------


def _set(column: str, value, *, as_object: bool = False):
    def defect(frame: pd.DataFrame, start: pd.Timestamp, end: pd.Timestamp) -> pd.DataFrame:
        if as_object:
            frame[column] = frame[column].astype(object)
        frame.loc[2, column] = value
        return frame

    return defect


def _int_ids(frame, start, end):
    frame["invoice_id"] = np.arange(len(frame), dtype="int64")
    return frame


def _text_times(frame, start, end):
    frame["occurred_at"] = [t.isoformat() for t in frame["occurred_at"]]
    return frame


def _at_window_end(frame, start, end):
    frame.loc[len(frame) - 1, "occurred_at"] = end  # windows are half-open: the end belongs to the next day
    return frame


def _next_day(frame, start, end):
    frame.loc[0, "occurred_at"] = end + pd.Timedelta(hours=20)
    return frame


def _repeated_row(frame, start, end):
    return pd.concat([frame, frame.tail(1)], ignore_index=True)


def _nanoseconds(frame, start, end):
    frame["occurred_at"] = frame["occurred_at"].dt.as_unit("ns")
    frame.loc[2, "occurred_at"] = frame.loc[2, "occurred_at"] + pd.Timedelta(1, "ns")
    return frame


def _no_rows_missing_column(frame, start, end):
    return frame.head(0).drop(columns=["amount"])


def _bool_amounts(frame, start, end):
    frame["amount"] = frame["amount"] > 50  # exported as 1.0/0.0 and recorded completed before issue 26
    return frame


def _repeated_amount_column(frame, start, end):
    return pd.concat([frame, frame[["amount"]]], axis=1)


DEFECTS: dict[str, Callable] = {
    "null_invoice_id": _set("invoice_id", None),
    "nat_occurred_at": _set("occurred_at", pd.NaT),
    "null_customer_email": _set("customer_email", None),
    "int_invoice_ids": _int_ids,
    "text_timestamps": _text_times,
    "event_at_window_end": _at_window_end,
    "event_next_day": _next_day,
    "repeated_row": _repeated_row,
    "amount_text_among_numbers": _set("amount", "12.50", as_object=True),
    "email_number_among_text": _set("customer_email", 12345, as_object=True),
    "nanosecond_timestamps": _nanoseconds,
    "no_rows_missing_column": _no_rows_missing_column,
    "foreign_tenant_row": _set("tenant", "globex"),
    "bool_amounts": _bool_amounts,
    "repeated_amount_column": _repeated_amount_column,
}


class DefectiveSource(InvoiceSource):
    """The sample source with one named defect applied to every frame it returns."""

    defect: str

    def count(self, tenant, start_utc, end_utc) -> int:
        return SampleInvoiceSource().count(tenant, start_utc, end_utc)

    def identity(self) -> dict:
        return SampleInvoiceSource().identity()  # the same source, returning bad rows: no change of contract

    def rows(self, tenant, start_utc, end_utc) -> pd.DataFrame:
        frame = SampleInvoiceSource().rows(tenant, start_utc, end_utc)
        return DEFECTS[self.defect](frame, pd.Timestamp(start_utc), pd.Timestamp(end_utc))


# -- one workspace per case -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """A ledger and an export folder holding one completed export, copied into every case's workspace."""
    folder = tmp_path_factory.mktemp("baseline")
    defs = build_definitions(
        tenants=["acme"],
        ledger_url=f"sqlite:///{folder / 'ledger.sqlite3'}",
        destination=str(folder / "exports"),
        environ={"EXPORTS_SOURCE": "sample"},
    )
    result = defs.resolve_job_def(JOB).execute_in_process(
        partition_key=BASELINE_DATE, instance=dg.DagsterInstance.ephemeral()
    )
    assert result.success
    dispose_engines()  # checkpoints the WAL: the copies below are whole databases
    return folder


@dataclass
class Workspace:
    root: Path
    request: pytest.FixtureRequest
    capsys: pytest.CaptureFixture
    cleanups: list[Callable] = field(default_factory=list)
    destination: object = None  # the case's destination, when it is not the local export folder
    s3_client: object = None

    @property
    def ledger_url(self) -> str:
        return f"sqlite:///{self.root / 'ledger.sqlite3'}"

    @property
    def exports(self) -> Path:
        return self.root / "exports"

    def ledger(self) -> ExportLedger:
        return open_ledger(self.ledger_url)

    def defs(self, **kwargs) -> dg.Definitions:
        kwargs.setdefault("tenants", ["acme"])
        kwargs.setdefault("ledger_url", self.ledger_url)
        kwargs.setdefault("destination", self.destination or str(self.exports))
        return build_definitions(environ={"EXPORTS_SOURCE": "sample"}, **kwargs)

    def moved(self, defs: dg.Definitions) -> dg.Definitions:
        """The operator moved acme's export to this case's destination on purpose: the run's claim is refused by
        the contract, and the new contract is accepted (``accept-contract --keep-exported``) before the run."""
        refusal = self.run(defs)
        assert "contract of invoice_export for tenant acme changed (destination" in refusal, refusal
        self.ledger().contracts.accept_refused("invoice_export", "moved for this case", exported="keep")
        return defs

    def run(self, defs: dg.Definitions, partition: str = PARTITION) -> str:
        """Runs the partition; returns what the operator reads about its failure ('' when it succeeded)."""
        result = defs.resolve_job_def(JOB).execute_in_process(
            partition_key=partition, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False
        )
        return "" if result.success else failure_message(result) or "the run failed without a step failure"

    def mount_tmpfs(self, folder: Path, options: str) -> Path:
        folder.mkdir(parents=True)
        try:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                check=True,
                capture_output=True,
                timeout=30,
            )
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            pytest.skip(f"cannot mount a tmpfs here ({exc}); the failing-writer cases need one")
        self.cleanups.append(lambda: subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30))
        return folder

    def s3(self, *, bucket: str | None = None, endpoint_url: str | None = None) -> S3Destination:
        import boto3

        server = self.request.getfixturevalue("s3_server")
        self.request.getfixturevalue("s3_environment")  # the destination's credentials, passed to Dagster by name
        self.s3_client = boto3.client(
            "s3",
            endpoint_url=server,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        return S3Destination(
            bucket=bucket or self.request.getfixturevalue("s3_bucket"),
            prefix="exports",
            endpoint_url=endpoint_url or server,
            access_key_id="testing",
            secret_access_key="testing",
            connect_timeout_seconds=2,
            read_timeout_seconds=5,
        )

    def snapshot(self) -> tuple:
        ledger = self.ledger()
        return (
            [(r.logical_key, r.state, r.fencing_token, r.sha256, r.updated_at) for r in ledger.queries.records()],
            [(a.attempt_id, a.logical_key, a.outcome) for a in ledger.queries.all_attempts()],
        )


@pytest.fixture
def workspace(baseline, tmp_path, request, capsys):
    root = tmp_path / "workspace"
    shutil.copytree(baseline, root)
    # The copy's contract names the copy's export folder, as if the baseline had been exported here.
    with contextlib.closing(sqlite3.connect(root / "ledger.sqlite3")) as db, db:
        db.execute(
            "UPDATE export_contracts SET contract = replace(contract, ?, ?)",
            (str((baseline / "exports").resolve()), str((root / "exports").resolve())),
        )
    space = Workspace(root, request, capsys)
    yield space
    for cleanup in reversed(space.cleanups):
        cleanup()
    if space.s3_client is not None:
        space.s3_client.close()
    dispose_engines()


# -- the cases ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadInput:
    """One bad input. ``apply`` returns the error text the operator reads (None: nothing was refused)."""

    name: str
    apply: Callable[[Workspace], str | None]
    expect: tuple[str, ...]
    reaches_a_run: bool = False  # the failure happens inside a run: it leaves an attempt, and a retry must work
    fix: Callable[[Workspace], dg.Definitions] | None = None  # the corrected input, for the retry
    withheld: tuple[str, ...] = ()  # customer values the error must never show


def cli_case(name: str, argv: list[str], code: int, *expect: str) -> BadInput:
    def apply(ws: Workspace) -> str:
        ws.capsys.readouterr()
        returned = cli.main(["--ledger-url", ws.ledger_url, *argv])
        out, err = ws.capsys.readouterr()
        assert returned == code, f"exit code {returned}, expected {code}: {out}{err}"
        assert out == "" and err.count("\n") == 1 and err.startswith("export-ledger: error: "), (out, err)
        return err

    return BadInput(f"cli-{name}", apply, expect)


def raises(build: Callable[[Workspace], object]) -> Callable[[Workspace], str | None]:
    def apply(ws: Workspace) -> str | None:
        try:
            build(ws)
        except Exception as exc:  # the refusal itself is the result under test
            return f"{type(exc).__name__}: {exc}"
        return None

    return apply


def config_case(name: str, environ: dict[str, str], *expect: str) -> BadInput:
    def build(ws: Workspace):
        base = {"EXPORTS_SOURCE": "sample", "EXPORTS_LEDGER_URL": ws.ledger_url, "EXPORTS_DESTINATION": str(ws.exports)}
        return build_definitions(environ={**base, **environ})

    return BadInput(f"config-{name}", raises(build), expect)


def partition_case(name: str, key: str, *expect: str) -> BadInput:
    return BadInput(f"partition-{name}", raises(lambda ws: ws.run(ws.defs(), key)), expect)


def tenant_case(name: str, tenant: str, *expect: str) -> BadInput:
    return BadInput(f"tenant-{name}", raises(lambda ws: ws.defs(tenants=[tenant])), expect)


def source_case(defect: str, *expect: str, withheld: tuple[str, ...] = ()) -> BadInput:
    return BadInput(
        f"source-{defect}",
        lambda ws: ws.run(ws.defs(source=DefectiveSource(defect=defect))) or None,
        (KEY, *expect),
        reaches_a_run=True,
        fix=lambda ws: ws.defs(),
        withheld=withheld,
    )


def _read_only_root(ws: Workspace) -> str | None:
    folder = ws.mount_tmpfs(ws.root / "read-only", "ro,size=64k")
    return ws.run(ws.moved(ws.defs(destination=str(folder / "exports")))) or None


def _full_disk(ws: Workspace) -> str | None:
    folder = ws.mount_tmpfs(ws.root / "tiny", "size=64k")
    (folder / "exports").mkdir()
    ws.destination = LocalDestination(root=str(folder / "exports"))
    with contextlib.suppress(OSError), open(folder / "filler", "wb") as filler:
        while True:
            filler.write(b"\0" * 4096)
            filler.flush()
    assert os.statvfs(folder).f_bavail == 0, "the filesystem is full"
    return ws.run(ws.moved(ws.defs())) or None


def _fix_full_disk(ws: Workspace) -> dg.Definitions:
    (ws.root / "tiny" / "filler").unlink()
    return ws.defs()


def _missing_bucket(ws: Workspace) -> str | None:
    ws.destination = ws.s3(bucket="no-such-bucket-5c1e")
    return ws.run(ws.moved(ws.defs())) or None


def _unreachable_store(ws: Workspace) -> str | None:
    ws.destination = ws.s3(endpoint_url="http://127.0.0.1:9")  # discard port: nothing listens
    return ws.run(ws.moved(ws.defs())) or None


def _fix_endpoint(ws: Workspace) -> dg.Definitions:
    ws.destination = ws.s3()
    return ws.moved(ws.defs())  # the same bucket at another endpoint: another store, accepted


_MISFIT_TABLE = "CREATE TABLE exported_invoices (logical_key VARCHAR(300), row_number BIGINT, invoice_id TEXT)"


def _misfit_ledger_table(ws: Workspace) -> str | None:
    # A table of that name already exists with another schema (an older export format, or somebody else's table).
    with sa.create_engine(ws.ledger_url).begin() as conn:
        conn.execute(sa.text(_MISFIT_TABLE))
    ws.destination = SqlTableDestination(url=ws.ledger_url, table="exported_invoices")
    return ws.run(ws.moved(ws.defs())) or None


def _fix_misfit_ledger_table(ws: Workspace) -> dg.Definitions:
    with sa.create_engine(ws.ledger_url).begin() as conn:
        conn.execute(sa.text("DROP TABLE exported_invoices"))
    return ws.defs()


def _ledger_own_table(ws: Workspace) -> str | None:
    return raises(lambda ws: ws.defs(destination="ledger-table:export_runs"))(ws)



CASES = [
    # CLI arguments
    cli_case("reconcile-limit-negative", ["reconcile", "--limit", "-5"], 2, "--limit", "'-5'"),
    cli_case("prune-negative-days", ["prune", "--older-than", "-3"], 2, "invalid number of days '-3'"),
    cli_case("prune-days-in-words", ["prune", "--older-than", "ten"], 2, "invalid number of days 'ten'"),
    cli_case(
        "accept-contract-blank-reason",
        ["accept-contract", "--export", "invoice_export", "--timezone", "UTC", "--start-date", "2026-01-01"]
        + ["--reason", "   "],
        2,
        "--reason must say why",
    ),
    cli_case(
        "accept-contract-zone-without-start",
        ["accept-contract", "--export", "invoice_export", "--timezone", "UTC", "--reason", "moved"],
        2,
        "--timezone and --start-date go together",
    ),
    cli_case(
        "accept-contract-move-without-zone",
        ["accept-contract", "--export", "invoice_export", "--move", "2026-03-01:UTC", "--reason", "moved"],
        2,
        "--timezone and --start-date go together",
    ),
    cli_case("attempts-path-as-key", ["attempts", "../../etc/passwd"], 1, "unknown logical key '../../etc/passwd'"),
    # configuration
    config_case("lease-zero", {"EXPORTS_LEASE_TTL_SECONDS": "0"}, "EXPORTS_LEASE_TTL_SECONDS", "'0'"),
    config_case("lease-fraction", {"EXPORTS_LEASE_TTL_SECONDS": "1.5"}, "EXPORTS_LEASE_TTL_SECONDS", "'1.5'"),
    config_case(
        "s3-bucket-name", {"EXPORTS_DESTINATION": "s3://Bad_Bucket/x"}, "'Bad_Bucket' is not a valid S3 bucket"
    ),
    config_case("ledger-table-name", {"EXPORTS_DESTINATION": "ledger-table:exports;drop"}, "not a valid table name"),
    config_case("below-low-water-flag", {"EXPORTS_ALLOW_BELOW_LOW_WATER": "yes"}, "must be 0 or 1, got 'yes'"),
    config_case("tenant-list-gap", {"EXPORTS_TENANTS": "acme,,globex"}, "invalid tenant id ''"),
    BadInput("config-ledger-table-is-the-ledger", _ledger_own_table, ("export_runs",)),
    config_case(
        "ledger-table-trailing-newline",
        {"EXPORTS_DESTINATION": "ledger-table:exported_invoices\n"},
        "not a valid table name",
    ),
    # partition keys
    partition_case("not-zero-padded", "2026-3-8", "2026-3-8"),
    partition_case("no-dashes", "20260308", "20260308"),
    partition_case("far-future", "2099-01-01", "2099-01-01"),
    # tenant ids
    tenant_case("leading-dash", "-acme", "invalid tenant id '-acme'"),
    tenant_case("too-long", "a" * 64, "invalid tenant id", "1-63"),
    tenant_case("dotted", "acme.corp", "invalid tenant id 'acme.corp'"),
    tenant_case("trailing-newline", "acme\n", "invalid tenant id"),
    # source data
    source_case("null_invoice_id", "column 'invoice_id' has 1 null value(s)"),
    source_case("nat_occurred_at", "column 'occurred_at' has 1 null value(s)"),
    source_case("null_customer_email", "column 'customer_email' has 1 null value(s)"),
    source_case("int_invoice_ids", "column 'invoice_id' must hold strings, found dtype int64"),
    source_case("text_timestamps", "column 'occurred_at' must hold timezone-aware timestamps"),
    source_case(
        "event_at_window_end", "1 event(s) fall outside the window [2026-03-08T05:00:00Z, 2026-03-09T04:00:00Z)"
    ),
    source_case("event_next_day", "1 event(s) fall outside the window"),
    # Ids are customer data (issue 18, item 18): the refusal says which rows, never the duplicated value.
    source_case(
        "repeated_row", "2 row(s) share their invoice_id with another", "each event must appear once",
        withheld=("acme-000001970031",),
    ),  # fmt: skip
    source_case("amount_text_among_numbers", "column 'amount' must be numeric, found dtype object"),
    source_case("email_number_among_text", "does not fit the export schema", "customer_email"),
    source_case("nanosecond_timestamps", "does not fit the export schema", "would lose data"),
    source_case("no_rows_missing_column", "missing required columns ['amount']"),
    source_case("foreign_tenant_row", "tenant"),
    source_case("bool_amounts", "column 'amount' must be numeric, found dtype bool (kind 'float'"),
    source_case("repeated_amount_column", "the frame has more than one column named 'amount'"),
    # destinations
    BadInput(
        "destination-read-only-root",
        _read_only_root,
        ("cannot write to export destination", "Read-only file system"),
        reaches_a_run=True,
        fix=lambda ws: ws.moved(ws.defs()),
    ),
    BadInput(
        "destination-full-disk",
        _full_disk,
        ("cannot write", "No space left on device"),
        reaches_a_run=True,
        fix=_fix_full_disk,
    ),
    BadInput(
        "destination-s3-missing-bucket",
        _missing_bucket,
        ("the bucket 'no-such-bucket-5c1e' does not exist", "create it, or correct the destination"),
        reaches_a_run=True,
        fix=_fix_endpoint,
    ),
    BadInput(
        "destination-s3-unreachable",
        _unreachable_store,
        ("cannot read s3://", "EndpointConnectionError"),
        reaches_a_run=True,
        fix=_fix_endpoint,
    ),
    BadInput(
        "destination-ledger-table-misfit",
        _misfit_ledger_table,
        ("exported_invoices", "no column named"),
        reaches_a_run=True,
        fix=_fix_misfit_ledger_table,
    ),
]


# -- the checks -----------------------------------------------------------------------------------------------------


def visible(ws: Workspace) -> Survey:
    """What readers see at the case's destination (the local folder, the S3 bucket, or the ledger table)."""
    destination = ws.destination
    if isinstance(destination, S3Destination):
        bucket = destination.bucket
        if bucket != ws.request.getfixturevalue("s3_bucket"):
            return Survey()  # the bucket does not exist
        spec = {"kind": "s3", "bucket": bucket, "prefix": destination.prefix}
        return survey(spec, ws.ledger_url, s3_client=ws.s3_client)
    if isinstance(destination, SqlTableDestination):
        engine = sa.create_engine(ws.ledger_url)
        try:
            with engine.connect() as conn:
                if not sa.inspect(conn).has_table("exported_invoices_manifests"):
                    # Never written by the destination; a table of the rows' name may exist (the misfit case).
                    found = Survey()
                    if sa.inspect(conn).has_table("exported_invoices"):
                        rows = conn.execute(sa.text("SELECT count(*) FROM exported_invoices")).scalar()
                        if rows:
                            found.partial.append(f"exported_invoices: {rows} rows without any manifest")
                    return found
        finally:
            engine.dispose()
        return survey({"kind": "sql", "table": "exported_invoices"}, ws.ledger_url)
    root = Path(destination.root) if isinstance(destination, LocalDestination) else ws.exports
    return survey({"kind": "local", "root": str(root)}, ws.ledger_url)


def ledger_problems(ledger: ExportLedger) -> list[str]:
    """A ledger is consistent when no lease is left behind and every record's attempt rows agree with its state."""
    problems = []
    records = {r.logical_key: r for r in ledger.queries.records()}
    attempts = ledger.queries.all_attempts()
    for attempt in attempts:
        record = records.get(attempt.logical_key)
        if record is None:
            problems.append(f"attempt {attempt.attempt_id} of unknown key {attempt.logical_key}")
        elif attempt.fencing_token is not None and attempt.fencing_token > record.fencing_token:
            problems.append(f"{attempt.attempt_id} has token {attempt.fencing_token} > {record.fencing_token}")
    last_outcome = {a.logical_key: a.outcome for a in attempts}
    expected = {
        ExportState.FAILED: {AttemptOutcome.FAILED},
        ExportState.COMPLETED: {AttemptOutcome.COMPLETED, AttemptOutcome.REPAIRED, AttemptOutcome.ALREADY_COMPLETED},
        ExportState.CONFLICT: {AttemptOutcome.CONFLICT},
        ExportState.REMOTE_UNKNOWN: {AttemptOutcome.REMOTE_UNKNOWN},
    }
    for key, record in records.items():
        if record.state is ExportState.IN_PROGRESS:
            problems.append(f"{key} is still in_progress (lease held by {record.lease_owner})")
        elif last_outcome.get(key) not in expected[record.state]:
            problems.append(f"{key} is {record.state.value} but its last attempt says {last_outcome.get(key)}")
    return problems


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bad_input_is_refused_clearly_and_leaves_nothing_published_and_the_ledger_consistent(workspace, case):
    before = workspace.snapshot()
    baseline_bytes = exported_files(workspace.exports)
    assert [key for key in visible_locally(workspace).exports] == [baseline_key()], "the baseline: one export"

    message = case.apply(workspace)

    assert message, f"{case.name}: the bad input was accepted"
    for fragment in case.expect:
        assert fragment in message, f"{case.name}: the error should say {fragment!r}:\n{message[:3000]}"
    for value in case.withheld:
        assert value not in message, f"{case.name}: the error must not show the customer value {value!r}"
    assert "Traceback (most recent call last)" not in message, "an error for people, not a stack trace"

    found = visible(workspace)
    assert found.partial == [], f"nothing half-published: {found.partial}"
    assert [k for k in found.exports if k != baseline_key()] == [], "nothing new is published"
    assert list(visible_locally(workspace).exports) == [baseline_key()], "nothing new in the export folder either"
    assert exported_files(workspace.exports) == baseline_bytes, "the old export (pointer and place) untouched"
    ledger = workspace.ledger()
    completed = [r.logical_key for r in ledger.queries.records() if r.state is ExportState.COMPLETED]
    assert completed == [baseline_key()], "no new completed record"
    assert ledger_problems(ledger) == []
    if not case.reaches_a_run:
        assert workspace.snapshot() == before, "refused before any run: the ledger is exactly as it was"
        return

    record = ledger.queries.get(KEY)
    assert record is not None and record.state is ExportState.FAILED, "the failed attempt is recorded: safe to retry"
    retry = workspace.run(case.fix(workspace))
    assert retry == "", f"once corrected, the same partition exports: {retry[:2000]}"
    assert ledger.queries.get(KEY).state is ExportState.COMPLETED
    after = visible(workspace)
    assert after.visible(KEY) is not None and len(after.places(KEY)) == 1, (
        f"exactly one export after the retry, and nothing of the failed attempt beside it: {after.hidden}"
    )
    assert {name: items for name, items in violations(ledger, after, [KEY], final=True).items() if items} == {}
    assert ledger_problems(ledger) == []


def visible_locally(ws: Workspace) -> Survey:
    """What readers see in the workspace's own export folder (where the baseline export is)."""
    return survey({"kind": "local", "root": str(ws.exports)}, ws.ledger_url)


def exported_files(root: Path) -> dict[str, bytes]:
    """Every file of the export folder readers could look at (dot names are the store's own: its locks), by path."""
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts)
    }


def baseline_key() -> str:
    return "invoice_export/acme/2026-03-07T05:00:00Z"


def test_the_catalogue_holds_at_least_20_bad_inputs_of_every_kind():
    names = [case.values[0].name if hasattr(case, "values") else case.name for case in CASES]
    kinds = {name.split("-", 1)[0] for name in names}
    assert kinds == {"cli", "config", "partition", "tenant", "source", "destination"}
    assert len(names) >= 20 and len(set(names)) == len(names)
