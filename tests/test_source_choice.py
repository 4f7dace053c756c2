"""The reference code location's invoice source is chosen, never implied (issue 26): ``EXPORTS_SOURCE=sample`` chooses
the sample, ``EXPORTS_SOURCE_URL`` with ``EXPORTS_SOURCE_TABLE`` a SQL table; anything else refuses to load, naming the
settings. Before, a process whose environment lost ``EXPORTS_SOURCE_URL`` (a run worker whose launcher config did not
pass it) exported the sample invoices and recorded them ``completed``."""

from __future__ import annotations

import datetime as dt

import pytest
from builders import sql_invoices
from pipeline_helpers import failure_message, published_dirs, read_export, run_partition

from definitions import build_definitions
from export_ledger import ConfigurationError
from export_ledger.ledger import ExportLedger, ExportState
from resources.invoices import SampleInvoiceSource

DAY = dt.date(2026, 3, 8)
PASSWORD = "hunter2-canary"


def _environ(tmp_path, **settings: str) -> dict[str, str]:
    return {
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": str(tmp_path / "exports"),
        "EXPORTS_TENANTS": "acme",
        **settings,
    }


def test_a_location_given_no_source_setting_refuses_to_load_naming_the_settings(tmp_path):
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path))

    message = str(refused.value)
    for name in ("EXPORTS_SOURCE=sample", "EXPORTS_SOURCE_URL", "EXPORTS_SOURCE_TABLE"):
        assert name in message, f"the refusal names {name}: {message}"
    assert not (tmp_path / "ledger.sqlite3").exists() and not (tmp_path / "exports").exists(), "nothing was written"


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"EXPORTS_SOURCE": "sample", "EXPORTS_SOURCE_URL": f"postgresql://u:{PASSWORD}@db/billing"},
            "EXPORTS_SOURCE=sample and EXPORTS_SOURCE_URL choose two sources",
        ),
        (
            {"EXPORTS_SOURCE": "sample", "EXPORTS_SOURCE_TABLE": "invoices"},
            "EXPORTS_SOURCE=sample and EXPORTS_SOURCE_TABLE choose two sources",
        ),
        (
            {"EXPORTS_SOURCE_URL": f"postgresql://u:{PASSWORD}@db/billing"},
            "EXPORTS_SOURCE_URL is set without EXPORTS_SOURCE_TABLE",
        ),
        ({"EXPORTS_SOURCE_TABLE": "invoices"}, "EXPORTS_SOURCE_TABLE is set without EXPORTS_SOURCE_URL"),
        (
            {"EXPORTS_SOURCE": f"postgresql://u:{PASSWORD}@db/billing"},
            "EXPORTS_SOURCE takes one value, 'sample'",
        ),
    ],
    ids=["sample-and-url", "sample-and-table", "url-without-table", "table-without-url", "unknown-choice"],
)
def test_two_sources_or_half_of_one_are_refused_naming_the_settings_never_their_values(tmp_path, settings, expected):
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path, **settings))

    assert expected in str(refused.value), str(refused.value)
    assert PASSWORD not in str(refused.value), "a source URL's password is never quoted"


def test_exports_source_sample_exports_the_sample_invoices(tmp_path, instance):
    defs = build_definitions(environ=_environ(tmp_path, EXPORTS_SOURCE="sample", EXPORTS_SAMPLE_CADENCE_MINUTES="30"))

    result = run_partition(defs, instance, DAY.isoformat())

    assert result.success, failure_message(result)
    (folder,) = published_dirs(tmp_path / "exports")
    _, frame = read_export(folder)
    (record,) = ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.records()
    expected = SampleInvoiceSource(cadence_minutes=30).rows("acme", record.window_start_utc, record.window_end_utc)
    assert list(frame["invoice_id"]) == list(expected["invoice_id"]), "the sample at the chosen cadence"


def test_a_sql_source_exports_the_rows_of_the_table_it_names(tmp_path, instance):
    url = f"sqlite:///{tmp_path / 'billing.sqlite3'}"
    ids = sql_invoices(url, DAY, ("acme",), table="billing_invoices")
    defs = build_definitions(
        environ=_environ(tmp_path, EXPORTS_SOURCE_URL=url, EXPORTS_SOURCE_TABLE="billing_invoices")
    )

    result = run_partition(defs, instance, DAY.isoformat())

    assert result.success, failure_message(result)
    (folder,) = published_dirs(tmp_path / "exports")
    _, frame = read_export(folder)
    assert list(frame["invoice_id"]) == ids["acme"], "the named table's invoices, not the sample's"
    (record,) = ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.records()
    assert record.state is ExportState.COMPLETED and record.row_count == len(ids["acme"])
