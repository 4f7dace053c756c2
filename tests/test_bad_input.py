"""Bad input fails with a message naming the problem, publishes nothing and writes no `completed` record."""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pandas as pd
import pytest
from builders import hourly_orders as orders
from builders import key_for, open_ledger
from pipeline_helpers import failure_message, make_defs, places, published_dirs, run_partition
from restatement_support import DAY, SCHEMA, item

from definitions import build_definitions
from export_ledger import ConfigurationError
from export_ledger.calendar import CalendarError, ExportCalendar
from export_ledger.dagster import LedgerResource
from export_ledger.keys import InvalidIdentifier, parse_tenants
from export_ledger.ledger.schema import ExportState
from export_ledger.protocol import export_key
from resources.invoices import InvoiceSource, SampleInvoiceSource

EMAIL = "jane.doe@example.org"


class DoctoredSource(InvoiceSource):
    """The sample source with one defect applied to its frame."""

    defect: str

    def count(self, tenant, start_utc, end_utc) -> int:
        return SampleInvoiceSource().count(tenant, start_utc, end_utc)

    def rows(self, tenant, start_utc, end_utc) -> pd.DataFrame:
        frame = SampleInvoiceSource().rows(tenant, start_utc, end_utc)
        if self.defect == "missing_column":
            return frame.drop(columns=["customer_email"])
        if self.defect == "null_amount":
            frame.loc[3, "amount"] = None
            return frame
        if self.defect == "outside_window":
            frame.loc[0, "occurred_at"] = pd.Timestamp(start_utc) - pd.Timedelta(minutes=1)
            return frame
        if self.defect == "duplicate_id":
            frame.loc[1, "invoice_id"] = frame.loc[0, "invoice_id"]
            return frame
        if self.defect == "naive_timestamps":
            frame["occurred_at"] = frame["occurred_at"].dt.tz_localize(None)
            return frame
        if self.defect == "text_amounts":
            frame["amount"] = frame["amount"].astype(str)
            return frame
        if self.defect == "not_a_frame":
            return frame.to_dict()
        raise AssertionError(self.defect)


def _assert_nothing_committed(tmp_path):
    assert published_dirs(tmp_path / "exports") == [], "nothing may be published"
    assert places(tmp_path / "exports") == [], "nothing staged either: rows are validated before a place is written"
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    records = ledger.queries.records()
    assert all(r.state is not ExportState.COMPLETED for r in records), "no completed record"
    return records


@pytest.mark.parametrize(
    ("defect", "message"),
    [
        ("missing_column", "missing required columns ['customer_email']"),
        ("null_amount", "column 'amount' has 1 null value(s)"),
        ("outside_window", "1 event(s) fall outside the window [2026-03-08T05:00:00Z, 2026-03-09T04:00:00Z)"),
        ("duplicate_id", "share their invoice_id with another"),
        ("naive_timestamps", "column 'occurred_at' must hold timezone-aware timestamps"),
        ("text_amounts", "column 'amount' must be numeric"),
        ("not_a_frame", "expected a pandas DataFrame, got dict"),
    ],
)
def test_bad_source_frames_are_refused_with_the_problem_named(tmp_path, instance, defect, message):
    defs = make_defs(tmp_path, source=DoctoredSource(defect=defect))
    result = run_partition(defs, instance, "2026-03-08")
    assert not result.success
    text = failure_message(result)
    assert message in text and "invoice_export/acme/2026-03-08T05:00:00Z" in text
    assert "@example.com" not in text, "customer emails never appear in errors"
    (record,) = _assert_nothing_committed(tmp_path)
    assert record.state is ExportState.FAILED, "the attempt is recorded as failed before commit: safe to retry"


class RaisingForGlobex(InvoiceSource):
    """The sample source, except that reading globex's rows raises with customer data in the message."""

    def count(self, tenant, start_utc, end_utc) -> int:
        return SampleInvoiceSource().count(tenant, start_utc, end_utc)

    def rows(self, tenant, start_utc, end_utc) -> pd.DataFrame:
        if tenant == "globex":
            raise RuntimeError("card 4111-1111-1111-1111 of leak-canary@example.org was rejected")
        return SampleInvoiceSource().rows(tenant, start_utc, end_utc)


def test_a_source_raising_for_one_tenant_fails_that_tenants_key_only_with_its_details_withheld(tmp_path, instance):
    # Issue 18 (6): the source was read before any claim, so its failure aborted the run with no trace in the
    # ledger, and its message reached the event log word for word.
    defs = make_defs(tmp_path, tenants=["acme", "globex"], source=RaisingForGlobex())
    result = run_partition(defs, instance, "2026-03-08")

    assert not result.success
    text = failure_message(result)
    assert "invoice_export/globex/2026-03-08T05:00:00Z" in text, "the failed key is named"
    assert "4111" not in text and "leak-canary" not in text, "a source's words may quote customer data: withheld"
    assert all("leak-canary" not in str(e) for e in result.all_events)
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    states = {r.tenant: r.state for r in ledger.queries.records()}
    assert states == {"acme": ExportState.COMPLETED, "globex": ExportState.FAILED}, "the other tenant still exports"
    (attempt,) = ledger.queries.attempts("invoice_export/globex/2026-03-08T05:00:00Z")
    assert attempt.error_class == "RuntimeError" and "details withheld" in attempt.error_message
    assert "leak-canary" not in attempt.error_message and "4111" not in attempt.error_message


def test_unwritable_destination_root_fails_clearly_and_records_failure(tmp_path, instance):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the destination root should be")
    defs = make_defs(tmp_path, destination=str(blocker / "exports"))
    result = run_partition(defs, instance, "2026-03-08")
    assert not result.success
    assert f"cannot write to export destination {blocker / 'exports'}" in failure_message(result)
    (record,) = _assert_nothing_committed(tmp_path)
    assert record.state is ExportState.FAILED


def test_unreachable_ledger_fails_the_run_naming_the_ledger_without_its_password(tmp_path, instance, monkeypatch):
    # By name: a URL with a password given as a value is refused when the definitions are built.
    monkeypatch.setenv("EXPORTS_LEDGER_URL", "postgresql+psycopg2://exporter:hunter2-secret@127.0.0.1:1/ledger")
    defs = make_defs(tmp_path, ledger=LedgerResource(url=dg.EnvVar("EXPORTS_LEDGER_URL")))
    result = run_partition(defs, instance, "2026-03-08")
    assert not result.success
    text = failure_message(result)
    assert "cannot reach the ledger at 'postgresql+psycopg2://exporter:***@127.0.0.1:1/ledger'" in text
    assert "hunter2-secret" not in text
    assert published_dirs(tmp_path / "exports") == []


def test_invalid_partition_key_is_refused_by_name(tmp_path, instance):
    defs = make_defs(tmp_path)
    with pytest.raises(Exception, match="2026-13-01"):
        run_partition(defs, instance, "2026-13-01")
    with pytest.raises(CalendarError, match=r"invalid partition key '2026-13-01'"):
        ExportCalendar().window("2026-13-01")
    with pytest.raises(CalendarError, match=r"before the calendar start 2026-01-01"):
        ExportCalendar().window("2025-12-31")
    assert published_dirs(tmp_path / "exports") == []


@pytest.mark.parametrize("zone", ["Mars/Olympus_Mons", "", "america/new_york "])
def test_unknown_timezone_is_refused_when_definitions_are_built(tmp_path, zone):
    with pytest.raises(CalendarError, match="unknown timezone"):
        make_defs(tmp_path, timezone=zone)


@pytest.mark.parametrize("tenant", ["../x", "", "two words", "UPPER", "a/b", "é"])
def test_bad_tenant_ids_are_refused(tmp_path, tenant):
    with pytest.raises(InvalidIdentifier, match="invalid tenant id"):
        make_defs(tmp_path, tenants=[tenant])


def test_bad_tenant_list_in_the_environment_is_refused(tmp_path):
    with pytest.raises(InvalidIdentifier, match=r"invalid tenant id '\.\./etc'"):
        build_definitions(environ={"EXPORTS_TENANTS": "acme,../etc"}, destination=str(tmp_path))
    with pytest.raises(InvalidIdentifier, match="duplicate tenant id"):
        parse_tenants("acme,acme")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"EXPORTS_FILE_FORMAT": "xlsx"}, "unknown file format 'xlsx'"),
        ({"EXPORTS_LEASE_TTL_SECONDS": "soon"}, "EXPORTS_LEASE_TTL_SECONDS must be a positive integer"),
        ({"EXPORTS_SAMPLE_CADENCE_MINUTES": "0"}, "EXPORTS_SAMPLE_CADENCE_MINUTES must be a positive integer"),
        ({"EXPORTS_DESTINATION": "ftp://host/x"}, "EXPORTS_DESTINATION scheme 'ftp' is not supported"),
        ({"EXPORTS_MAX_PARTITIONS_PER_RUN": "0"}, "EXPORTS_MAX_PARTITIONS_PER_RUN must be a positive integer"),
        ({"EXPORTS_DESTINATION": "s3://Bad_Bucket/x"}, "'Bad_Bucket' is not a valid S3 bucket name"),
        ({"EXPORTS_DESTINATION": "ledger-table:drop table"}, "'drop table' is not a valid table name"),
        ({"EXPORTS_ALLOW_BELOW_LOW_WATER": "yes"}, "EXPORTS_ALLOW_BELOW_LOW_WATER must be 0 or 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(tmp_path, environ, message):
    environ = {"EXPORTS_SOURCE": "sample", "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'l.sqlite3'}", **environ}
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_definitions(environ=environ)


def test_bad_schedule_time_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="schedule_time must be HH:MM"):
        make_defs(tmp_path, schedule_time="half past four")
    with pytest.raises(CalendarError, match="does not occur exactly once on 2026-03-08"):
        make_defs(tmp_path, schedule_time="02:30")


def test_naive_bounds_are_refused_by_sources():
    with pytest.raises(ValueError, match="must be timezone-aware"):
        SampleInvoiceSource().rows("acme", dt.datetime(2026, 3, 8), dt.datetime(2026, 3, 9))


@pytest.mark.parametrize(
    ("destination", "pool"),
    [
        ("{tmp}/exports", "exports-local-invoice_export"),
        ("s3://exports-bucket/p", "exports-s3-invoice_export"),
        ("ledger-table:rows", "exports-ledger-table-invoice_export"),
    ],
)
def test_each_export_and_destination_kind_exports_in_its_own_concurrency_pool(tmp_path, destination, pool):
    environ = {
        "EXPORTS_SOURCE": "sample",
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'l.sqlite3'}",
        "EXPORTS_DESTINATION": destination.format(tmp=tmp_path),
        "EXPORTS_MAX_PARTITIONS_PER_RUN": "7",
    }
    asset = build_definitions(environ=environ).get_assets_def("invoice_export")
    assert asset.op.pool == pool
    assert asset.backfill_policy == dg.BackfillPolicy.multi_run(max_partitions_per_run=7)


# -- a duplicate id is never stored in the ledger ----------------------------------------------------------------------


def test_a_duplicate_id_error_stores_no_id_value_in_the_ledger(ledger, local):
    """Item 18: the ids of a row are customer data (here an id holding an email). A duplicate-id error must not store
    an id value in the ledger's attempts table.
    Fails on 0.4.0 (07f55b3): the ledger stores "duplicate order_id values (acme-jane.doe@example.org)"."""
    key = key_for(DAY)
    frame = orders(key)
    frame.loc[[0, 1], "order_id"] = f"acme-{EMAIL}"
    with pytest.raises(Exception, match="share their order_id with another"):  # 0.4.0 said "duplicate order_id values"
        export_key(ledger, local, SCHEMA, item(key, frame), "run-1/export")
    (attempt,) = ledger.queries.attempts(str(key))
    assert EMAIL not in (attempt.error_message or ""), attempt.error_message
    assert "2 row(s) share their order_id" in (attempt.error_message or ""), (
        f"the refusal still says what is wrong, by count and row position: {attempt.error_message}"
    )
