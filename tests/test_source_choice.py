"""The reference code location's invoice source is chosen, never implied (issue 26): ``EXPORTS_SOURCE=sample`` chooses
the sample, ``EXPORTS_SOURCE_URL`` with ``EXPORTS_SOURCE_TABLE`` a SQL table; anything else fails each run, naming
the settings (the location still loads: issue 27). Before, a process whose environment lost ``EXPORTS_SOURCE_URL``
(a run worker whose launcher config did not pass it) exported the sample invoices and recorded them ``completed``."""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pytest
from builders import open_ledger, sql_invoices
from pipeline_helpers import PROJECT, failure_message, published_dirs, read_export, run_partition, tick

from definitions import build_definitions, invoice_source_from
from export_ledger import ConfigurationError, cli
from export_ledger.ledger import ExportState
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


def _refused_run(tmp_path, instance, environ) -> str:
    """Loads the location with ``environ`` (it loads: the UI shows the export), runs one partition, and returns
    what a person reads: the asset's description, then the run's failure. Nothing may have been claimed."""
    defs = build_definitions(environ=environ)
    description = defs.resolve_assets_def("invoice_export").descriptions_by_key[dg.AssetKey("invoice_export")]

    result = run_partition(defs, instance, DAY.isoformat())

    assert not result.success, "a run without a usable source fails"
    assert open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.records() == [], "nothing claimed"
    assert not (tmp_path / "exports").exists() or not any((tmp_path / "exports").rglob("*")), "nothing published"
    logs = "\n".join(str(e.message) for e in instance.all_logs(result.run_id))
    return f"{description}\n{failure_message(result)}\n{logs}"


def test_a_location_given_no_source_setting_loads_and_each_run_fails_naming_the_settings(tmp_path, instance):
    """Issue 27, item 4: a setting a run needs and lacks fails that run, not the code location at load."""
    words = _refused_run(tmp_path, instance, _environ(tmp_path))

    description, failure = words.split("\n", 1)
    for name in ("EXPORTS_SOURCE=sample", "EXPORTS_SOURCE_URL", "EXPORTS_SOURCE_TABLE"):
        assert name in description, f"the asset's page names {name} before any run: {description}"
        assert name in failure, f"the run's failure names {name}: {failure[-2000:]}"
    assert "nothing was exported" in failure


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
def test_two_sources_or_half_of_one_fail_each_run_naming_the_settings_never_their_values(
    tmp_path, instance, settings, expected
):
    with pytest.raises(ConfigurationError) as refused:
        invoice_source_from(settings)
    assert expected in str(refused.value) and PASSWORD not in str(refused.value)

    words = _refused_run(tmp_path, instance, _environ(tmp_path, **settings))

    assert words.count(expected) >= 2, f"the asset's page and the run name it: {words[-2000:]}"
    assert PASSWORD not in words, "a source URL's password is never quoted"


def test_exports_source_sample_exports_the_sample_invoices(tmp_path, instance):
    defs = build_definitions(environ=_environ(tmp_path, EXPORTS_SOURCE="sample", EXPORTS_SAMPLE_CADENCE_MINUTES="30"))

    result = run_partition(defs, instance, DAY.isoformat())

    assert result.success, failure_message(result)
    (folder,) = published_dirs(tmp_path / "exports")
    _, frame = read_export(folder)
    (record,) = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.records()
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
    (record,) = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.records()
    assert record.state is ExportState.COMPLETED and record.row_count == len(ids["acme"])


def test_drift_passes_over_an_export_whose_source_is_unusable_here_and_says_why(
    tmp_path, instance, capsys, monkeypatch
):
    """Drift detection re-reads the source: where it cannot be used, the export is named with the reason (the sensor
    logs it, the CLI prints it), and no key is marked stale or counted as checked."""
    assert run_partition(build_definitions(environ=_environ(tmp_path, EXPORTS_SOURCE="sample")), instance,
                         DAY.isoformat()).success  # fmt: skip
    defs = build_definitions(environ=_environ(tmp_path))

    found = tick(defs, instance, sensor_name="drift_sensor")

    said = [record.getMessage() for record in found.logs]
    assert any("invoice_export: not checked for drift: the invoice source cannot be used" in s for s in said), said
    assert found.skip_message.startswith("0 key(s) checked, 0 stale, 0 not checked"), found.skip_message

    for name, value in _environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("EXPORTS_SOURCE")
    monkeypatch.chdir(PROJECT)
    code = cli.main(["drift", "-f", "definitions.py", "--lookback-days", "3650"])
    out = capsys.readouterr().out
    assert code == 1 and "0 key(s) checked" in out, "keys left unchecked: exit 1, as the CLI's exit codes say"
    assert "not checked, no source to read again here: invoice_export (the invoice source cannot be used" in out
    assert "EXPORTS_SOURCE_URL" in out


def test_a_bad_sample_cadence_is_refused_at_load_without_its_value(tmp_path):
    """A malformed value (not a missing setting) is refused at load, and a URL pasted into it is not quoted."""
    settings = {"EXPORTS_SOURCE": "sample", "EXPORTS_SAMPLE_CADENCE_MINUTES": f"postgresql://u:{PASSWORD}@db/x"}
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path, **settings))

    assert "EXPORTS_SAMPLE_CADENCE_MINUTES must be a positive integer" in str(refused.value)
    assert PASSWORD not in str(refused.value)
