"""The transactional destination: exported rows in the ledger's own database, on SQLite and PostgreSQL.

Rows, manifest row and the ledger's ``completed`` record commit in one transaction, so a failure between them (the
``before_commit`` failpoint fires inside that transaction) must leave none of them behind.
"""

from __future__ import annotations

import hashlib
import warnings

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import open_ledger
from pipeline_helpers import check_evaluations, failure_message, make_defs, run_partition

from definitions import build_definitions
from export_ledger.calendar import window_for
from export_ledger.destinations import ExportTarget, Verdict
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import Manifest
from export_ledger.ledger.schema import AttemptOutcome, ExportState
from resources.invoices import SampleInvoiceSource

PARTITION = "2026-03-08"
KEY = "invoice_export/acme/2026-03-08T05:00:00Z"
TARGET = ExportTarget("invoice_export", "acme", PARTITION)
TABLE = "exported_invoices"


@pytest.fixture(params=["environment", "resource"])
def sql_defs(request, tmp_path, ledger_url, monkeypatch):
    """The destination configured both ways: from the environment as the code location loads it
    (``EXPORTS_DESTINATION=ledger-table:<table>``), or as a resource passed in."""
    if request.param == "resource":
        return make_defs(tmp_path, ledger_url=ledger_url, destination=SqlTableDestination(url=ledger_url, table=TABLE))
    for name in ("EXPORTS_SOURCE_URL", "EXPORTS_FILE_FORMAT", "EXPORTS_LEASE_TTL_SECONDS", FAILPOINTS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXPORTS_DESTINATION", f"ledger-table:{TABLE}")
    monkeypatch.setenv("EXPORTS_LEDGER_URL", ledger_url)
    monkeypatch.setenv("EXPORTS_TENANTS", "acme")
    return build_definitions(environ=None)


def stored_rows(ledger_url: str) -> dict[str, int]:
    """Rows per logical key in the rows table and in its manifests table (empty when the tables do not exist)."""
    engine = sa.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            counts = {}
            for name in (TABLE, f"{TABLE}_manifests"):
                if not inspector.has_table(name):
                    continue
                table = sa.Table(name, sa.MetaData(), autoload_with=conn)
                query = sa.select(table.c.logical_key, sa.func.count()).group_by(table.c.logical_key)
                counts.update({f"{name}:{key}": n for key, n in conn.execute(query)})
            return counts
    finally:
        engine.dispose()


def _expected_frame() -> pd.DataFrame:
    window = window_for(pd.Timestamp(PARTITION).date(), "America/New_York")
    return SampleInvoiceSource().rows("acme", window.start_utc, window.end_utc)


def test_rows_land_in_the_ledger_database_together_with_their_completion_record(sql_defs, instance, ledger_url):
    result = run_partition(sql_defs, instance, PARTITION)

    assert result.success, failure_message(result)
    ledger = open_ledger(ledger_url)
    record = ledger.queries.get(KEY)
    assert record.state is ExportState.COMPLETED and record.row_count == len(_expected_frame()) == 92
    assert record.location == f"sql:{TABLE}/invoice_export/tenant=acme/date={PARTITION}"
    assert stored_rows(ledger_url) == {f"{TABLE}:{KEY}": 92, f"{TABLE}_manifests:{KEY}": 1}
    assert [a.outcome for a in ledger.queries.attempts(KEY)] == [AttemptOutcome.COMPLETED]
    check = check_evaluations(result, "partition_health")[PARTITION]
    assert check.passed and check.metadata["verified_at_destination"].value == 1, check.metadata

    destination = SqlTableDestination(url=ledger_url, table=TABLE)
    verification = destination.verify(TARGET, logical_key=KEY, superseded=0, expected_sha256=record.sha256)
    assert verification.verdict is Verdict.PUBLISHED, verification.detail
    manifest = verification.manifest
    assert isinstance(manifest, Manifest) and manifest.logical_key == KEY and manifest.sha256 == record.sha256
    assert destination.current_revision(TARGET) == 1, "the manifest row is the key's pointer: revision 1"
    recorded = destination.verify_recorded(TARGET, logical_key=KEY, sha256=record.sha256)
    assert recorded.verdict is Verdict.PUBLISHED, "the recorded revision is intact where the ledger says it is"
    payload = destination.read_data(TARGET, manifest)
    assert hashlib.sha256(payload).hexdigest() == record.sha256, "what is read back is what was recorded"


def test_load_input_reads_back_the_committed_rows(tmp_path, instance, ledger_url):
    defs = make_defs(tmp_path, ledger_url=ledger_url, destination=f"ledger-table:{TABLE}")
    seen = []
    (export_asset,) = defs.assets

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)  # backfill_policy: the export's, so one job can run both

        @dg.asset(
            partitions_def=export_asset.partitions_def,
            backfill_policy=export_asset.backfill_policy,
            ins={"invoice_export": dg.AssetIn()},
        )
        def invoice_rows(invoice_export: pd.DataFrame) -> None:
            seen.append(invoice_export)

    result = dg.materialize(
        [export_asset, invoice_rows],
        partition_key=PARTITION,
        instance=instance,
        resources=defs.resources,
        raise_on_error=False,
    )

    assert result.success, failure_message(result)
    (frame,) = seen
    expected = _expected_frame()
    assert list(frame["invoice_id"]) == list(expected["invoice_id"])
    assert list(frame["amount"]) == list(expected["amount"])
    assert (frame["occurred_at"] == expected["occurred_at"].reset_index(drop=True)).all()


def test_a_failure_between_rows_and_completion_record_leaves_neither_and_a_rerun_exports_once(
    sql_defs, instance, ledger_url, monkeypatch
):
    monkeypatch.setenv(FAILPOINTS, "before_commit=raise")
    failed = run_partition(sql_defs, instance, PARTITION)

    assert not failed.success and "injected failure at before_commit" in failure_message(failed)
    ledger = open_ledger(ledger_url)
    assert ledger.queries.get(KEY).state is ExportState.FAILED, "not completed: the transaction rolled back"
    assert stored_rows(ledger_url) == {}, "no row survives the rolled-back transaction"

    monkeypatch.delenv(FAILPOINTS)
    assert run_partition(sql_defs, instance, PARTITION).success
    assert run_partition(sql_defs, instance, PARTITION).success
    record = ledger.queries.get(KEY)
    assert record.state is ExportState.COMPLETED
    assert stored_rows(ledger_url) == {f"{TABLE}:{KEY}": record.row_count, f"{TABLE}_manifests:{KEY}": 1}
    outcomes = [a.outcome for a in ledger.queries.attempts(KEY)]
    assert outcomes == [AttemptOutcome.FAILED, AttemptOutcome.COMPLETED, AttemptOutcome.ALREADY_COMPLETED]
