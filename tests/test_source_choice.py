"""The reference code location's invoice source is chosen, never implied (issue 26): ``EXPORTS_SOURCE=sample`` chooses
the sample, ``EXPORTS_SOURCE_URL`` with ``EXPORTS_SOURCE_TABLE`` a SQL table; anything else fails each run, naming
the settings (the location still loads: issue 27). Before, a process whose environment lost ``EXPORTS_SOURCE_URL``
(a run worker whose launcher config did not pass it) exported the sample invoices and recorded them ``completed``.

The settings are the fields of a Dagster resource (``InvoiceSourceResource``, issue 27 item 4): the URL by name
(``EnvVar``), resolved where the source is used: a run's step, the drift sensor's tick, the CLI."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import dagster as dg
import pytest
from builders import open_ledger, sql_invoices
from pipeline_helpers import JOB, PROJECT, failure_message, published_dirs, read_export, run_partition, tick

from assets.invoices import invoice_export
from definitions import build_definitions, invoice_source_resource
from export_ledger import ConfigurationError, SqlSource, cli
from export_ledger.dagster import SourceResource, ledgered_definitions, url_field
from export_ledger.dagster.code_location import load_code_location
from export_ledger.dagster.resources import built_spec
from export_ledger.ledger import ExportState
from export_ledger.sources import UnusableSource
from resources.invoices import InvoiceSourceResource, SampleInvoiceSource, SqlInvoiceSource

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
    ],
    ids=["sample-and-url", "sample-and-table", "url-without-table", "table-without-url"],
)
def test_two_sources_or_half_of_one_fail_each_run_naming_the_settings_never_their_values(
    tmp_path, instance, monkeypatch, settings, expected
):
    if "EXPORTS_SOURCE_URL" in settings:  # a URL is given by name, as the process environment's (never as a value)
        monkeypatch.setenv("EXPORTS_SOURCE_URL", settings["EXPORTS_SOURCE_URL"])
    assert expected in invoice_source_resource(settings).problem()

    words = _refused_run(tmp_path, instance, _environ(tmp_path, **settings))

    assert words.count(expected) >= 2, f"the asset's page and the run name it: {words[-2000:]}"
    assert PASSWORD not in words, "a source URL's password is never quoted"


def test_a_choice_other_than_sample_is_refused_at_load_without_its_value(tmp_path):
    """A value malformed in itself is wrong in every process: refused at load, never carried into the resource config
    the UI shows (here a URL pasted into EXPORTS_SOURCE)."""
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path, EXPORTS_SOURCE=f"postgresql://u:{PASSWORD}@db/billing"))

    assert "EXPORTS_SOURCE takes one value, 'sample'" in str(refused.value)
    assert PASSWORD not in str(refused.value)


def ui_resource_config(defs: dg.Definitions, key: str) -> dict:
    """A resource's configured values as the Dagster UI gets them (GraphQL ``configuredValues``: the default value of
    the resource's config schema)."""
    resource = defs.get_repository_def().get_top_level_resources()[key]
    return json.loads(resource.config_schema.default_value_as_json_str)


def test_the_ui_resource_config_names_exports_source_url_never_the_url(tmp_path, monkeypatch):
    for name, value in _environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("EXPORTS_SOURCE")
    monkeypatch.setenv("EXPORTS_SOURCE_URL", f"postgresql+psycopg2://reader:{PASSWORD}@billing-db/billing")
    monkeypatch.setenv("EXPORTS_SOURCE_TABLE", "billing_invoices")

    config = ui_resource_config(build_definitions(), "invoice_export__source")

    assert config["url"] == {"env": "EXPORTS_SOURCE_URL"}, f"the URL is passed by name: {config}"
    assert config["table"] == "billing_invoices" and config["sample"] is False
    assert PASSWORD not in json.dumps(config) and "billing-db" not in json.dumps(config)


def test_a_source_url_with_a_password_given_as_a_value_is_refused_at_load_without_quoting_it(tmp_path):
    """Read from an environ mapping that the process environment does not hold, the URL could only reach Dagster as a
    value, shown in the UI's resource config: refused, saying how to give it by name."""
    url = f"postgresql+psycopg2://reader:{PASSWORD}@billing-db/billing"
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path, EXPORTS_SOURCE_URL=url, EXPORTS_SOURCE_TABLE="invoices"))

    assert "EXPORTS_SOURCE_URL" in str(refused.value) and "holds a secret" in str(refused.value)
    assert PASSWORD not in str(refused.value)


@pytest.mark.parametrize(
    "url, by_name, environment, expected",
    [
        ("", False, None, ""),
        ("sqlite:////srv/billing.db", False, None, "sqlite:////srv/billing.db"),
        ("postgresql://reader@billing-db/billing", True, None, dg.EnvVar("TEST_SOURCE_URL")),
        (f"postgresql://reader:{PASSWORD}@billing-db/billing", False, "same", dg.EnvVar("TEST_SOURCE_URL")),
        (f"postgresql://reader:{PASSWORD}@billing-db/billing", False, "other", ConfigurationError),
        (f"postgresql://billing-db/billing?password={PASSWORD}", False, None, ConfigurationError),
        (f" postgresql://reader:{PASSWORD}@billing-db/billing", False, None, ConfigurationError),
        (f"postgresql://billing-db/billing#password={PASSWORD}", False, None, ConfigurationError),
        (f"https://{PASSWORD}@billing-db/api", False, None, f"https://{PASSWORD}@billing-db/api"),
        (f"https://{PASSWORD}@billing-db/api", "endpoint", None, ConfigurationError),
        (f"https://billing-db/api?auth={PASSWORD}", "endpoint", None, ConfigurationError),
        (f" https://{PASSWORD}@billing-db/api", "endpoint", None, ConfigurationError),
        ("https://billing-db/api", "endpoint", None, "https://billing-db/api"),
    ],
    ids=[
        "empty",
        "no secret",
        "read by name",
        "held by the process",
        "a password held nowhere",
        "secret parameter",
        "a leading space",
        "in the fragment",
        "a database user name",
        "an endpoint's token as the user",
        "an endpoint's query",
        "an endpoint after a leading space",
        "an endpoint without one",
    ],
)
def test_url_field_passes_a_url_by_name_where_it_can_and_refuses_a_secret_it_cannot(
    monkeypatch, url, by_name, environment, expected
):
    """The library's one call for a URL read from a mapping (the reference location's EXPORTS_SOURCE_URL uses it):
    by name when it can be, the value when it holds no secret, refused without quoting it otherwise. A database URL's
    user name is no secret; an endpoint's user part or query may be one (``endpoint=True``)."""
    monkeypatch.delenv("TEST_SOURCE_URL", raising=False)
    if environment is not None:
        monkeypatch.setenv("TEST_SOURCE_URL", url if environment == "same" else "postgresql://other-db/billing")
    how = {"by_name": by_name is True, "endpoint": by_name == "endpoint"}
    if expected is ConfigurationError:
        with pytest.raises(ConfigurationError) as refused:
            url_field(url, "TEST_SOURCE_URL", **how)
        held = "may hold a secret (a password, a user part, or a query)" if how["endpoint"] else "holds a secret"
        assert f"TEST_SOURCE_URL (read from the environ mapping) {held}" in str(refused.value), str(refused.value)
        assert PASSWORD not in str(refused.value) and "billing-db" not in str(refused.value), str(refused.value)
        return
    given = url_field(url, "TEST_SOURCE_URL", **how)
    assert given == expected and type(given) is type(expected), given


class UsersSource(SourceResource):
    """A user's own source resource (its url meant to be a dg.EnvVar)."""

    url: str

    def get_source(self, spec):
        return SqlInvoiceSource(url=self.url, table="invoices")


@pytest.mark.parametrize("how", ["reference", "users_own"])
def test_a_source_resource_given_a_password_as_a_value_is_refused_at_load_naming_the_field(tmp_path, how):
    """A SourceResource's field is shown in the UI's resource config as given: a URL with a password given as a
    value (not an EnvVar) is refused at load, as the ledger URL is, naming the field and dg.EnvVar, never the value."""
    literal = f"postgresql://reader:{PASSWORD}@billing-db/billing"
    with pytest.raises(ConfigurationError) as refused:
        if how == "reference":
            build_definitions(environ=_environ(tmp_path), source=InvoiceSourceResource(url=literal, table="invoices"))
        else:
            spec = invoice_export(
                source=UsersSource(url=literal), tenants=["acme"], timezone="UTC", start_date="2026-01-01"
            )
            ledgered_definitions([spec], environ=_environ(tmp_path))

    said = str(refused.value)
    assert "'s url holds a password" in said and "dg.EnvVar" in said, said
    assert PASSWORD not in said and "billing-db" not in said, said


def test_a_run_resolves_the_source_url_where_it_runs_and_the_contract_refuses_another_database(
    tmp_path, instance, monkeypatch
):
    """The location's Definitions name the URL's variable; each run reads it from the environment it runs in (its run
    worker's). A run whose environment names another database than the one the key's contract recorded is refused
    before a row is read, naming what changed without the URL's credentials."""
    first = f"sqlite:///{tmp_path / 'billing.sqlite3'}"
    other = f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}"
    sql_invoices(first, DAY - dt.timedelta(days=1), ("acme",))
    sql_invoices(other, DAY, ("acme",))
    monkeypatch.setenv("EXPORTS_SOURCE_URL", first)
    defs = build_definitions(environ=_environ(tmp_path, EXPORTS_SOURCE_URL=first, EXPORTS_SOURCE_TABLE="invoices"))
    assert run_partition(defs, instance, (DAY - dt.timedelta(days=1)).isoformat()).success

    monkeypatch.setenv("EXPORTS_SOURCE_URL", other)  # the same Definitions; a run worker given another database
    result = run_partition(defs, instance, DAY.isoformat())

    assert not result.success, "a run reading another database than the contract's is refused"
    message = failure_message(result)
    assert "source sql (" in message and "elsewhere.sqlite3" in message, message
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    assert [r.business_date for r in ledger.queries.records()] == [DAY - dt.timedelta(days=1)], "nothing claimed"


def test_the_cli_reads_the_source_a_run_of_the_location_reads(tmp_path, instance, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'billing.sqlite3'}"
    sql_invoices(url, DAY, ("acme",), table="billing_invoices")
    for name, value in _environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("EXPORTS_SOURCE")
    monkeypatch.setenv("EXPORTS_SOURCE_URL", url)
    monkeypatch.setenv("EXPORTS_SOURCE_TABLE", "billing_invoices")
    monkeypatch.chdir(PROJECT)
    assert run_partition(build_definitions(), instance, DAY.isoformat()).success

    (spec,) = load_code_location(python_file="definitions.py").specs

    assert isinstance(spec.source, SqlInvoiceSource), "the CLI has the source resolved, as a run resolves it"
    assert (spec.source.url, spec.source.table) == (url, "billing_invoices")
    code = cli.main(["drift", "-f", "definitions.py", "--lookback-days", "3650"])
    out = capsys.readouterr().out
    assert code == 0 and "1 key(s) checked: 0 stale, 1 match their source" in out, out


def test_the_declared_resource_is_never_read_as_its_settings(monkeypatch):
    """The declared resource holds the variable's name where Dagster resolves a value: read as the source, the name
    would be taken for the URL. Only the resource Dagster resolved (a run's, a tick's, build_resources') gives one."""
    monkeypatch.setenv("EXPORTS_SOURCE_URL", "sqlite://")
    declared = InvoiceSourceResource(url=dg.EnvVar("EXPORTS_SOURCE_URL"), table="invoices")
    spec = invoice_export(source=SampleInvoiceSource(), tenants=["acme"], timezone="UTC", start_date="2026-01-01")
    with pytest.raises(ConfigurationError, match="url not resolved"):
        declared.resolve(spec)
    with dg.build_resources({"source": declared}) as built:
        assert built.source.resolve(spec).identity()["table"] == "invoices"


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
    assert any("invoice_export: not checked for drift: the source cannot be used" in s for s in said), said
    assert found.skip_message.startswith("0 key(s) checked, 0 stale, 0 not checked"), found.skip_message

    for name, value in _environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("EXPORTS_SOURCE")
    monkeypatch.chdir(PROJECT)
    code = cli.main(["drift", "-f", "definitions.py", "--lookback-days", "3650"])
    out = capsys.readouterr().out
    assert code == 1 and "0 key(s) checked" in out, "keys left unchecked: exit 1, as the CLI's exit codes say"
    assert "not checked, no source to read again here: invoice_export (the source cannot be used" in out
    assert "EXPORTS_SOURCE_URL" in out


def test_one_exports_source_setting_missing_at_a_tick_leaves_the_other_exports_checked_for_drift(
    tmp_path, instance, monkeypatch
):
    """The drift sensor resolves each export's source resource itself, export by export: a variable one export's
    resource lacks in the code server makes that export unchecked (logged, naming the variable), not the whole tick
    refused by Dagster for every export."""
    monkeypatch.setenv("TEST_ORDERS_URL", f"sqlite:///{tmp_path / 'shop.sqlite3'}")  # for the run (in process)
    invoices = invoice_export(source=SampleInvoiceSource(), tenants=["acme"], timezone="UTC", start_date="2026-01-01")
    orders = dataclasses.replace(invoices, name="orders", source=UsersSource(url=dg.EnvVar("TEST_ORDERS_URL")))
    defs = ledgered_definitions([invoices, orders], environ=_environ(tmp_path), drift_lookback_days=3650)
    assert run_partition(defs, instance, DAY.isoformat()).success
    monkeypatch.delenv("TEST_ORDERS_URL")  # the code server, where ticks run, lacks it

    found = tick(defs, instance, sensor_name="drift_sensor")

    said = [record.getMessage() for record in found.logs]
    assert any(s.startswith("orders: not checked for drift") and "TEST_ORDERS_URL" in s for s in said), said
    assert found.skip_message.startswith("1 key(s) checked, 0 stale"), (found.skip_message, said)


class BadQuerySource(SourceResource):
    """Gives a SqlSource whose query lacks the bound parameters: SqlSource refuses it (a ValueError)."""

    url: str

    def get_source(self, spec):
        return SqlSource(self.url, "SELECT * FROM invoices")


class FailingSource(SourceResource):
    """Its get_source fails with an error of no kind the library knows."""

    def get_source(self, spec):
        raise RuntimeError("the billing client could not start")


def _checks_reported(instance, result) -> int:
    """The check evaluations the run recorded (a failed step's own are in the instance's log of the run)."""
    return sum(
        1
        for entry in instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        if entry.dagster_event is not None
    )


@pytest.mark.parametrize(
    ("source", "said"),
    [
        (BadQuerySource(url="sqlite:///billing.sqlite3"), "bound parameters"),
        (FailingSource(), "the billing client could not start"),
    ],
)
def test_a_source_resource_that_fails_to_give_its_source_fails_the_run_with_its_checks_reported(
    tmp_path, instance, source, said
):
    """Whatever resolving the source raises, the run fails before anything is claimed, and its checks are judged
    from the ledger rather than left planned (each date shown "execution failed")."""
    sample = invoice_export(source=SampleInvoiceSource(), tenants=["acme"], timezone="UTC", start_date="2026-01-01")
    assert run_partition(ledgered_definitions([sample], environ=_environ(tmp_path)), instance, DAY.isoformat()).success
    defs = ledgered_definitions([dataclasses.replace(sample, source=source)], environ=_environ(tmp_path))

    result = run_partition(defs, instance, DAY.isoformat())

    assert not result.success and said in failure_message(result), failure_message(result)[-2000:]
    assert _checks_reported(instance, result) > 0, "the run's checks are judged from the ledger, not left planned"


def test_a_source_resource_giving_a_refused_source_leaves_its_export_unchecked_for_drift_saying_why(tmp_path, instance):
    """A source refused when it is made (a SqlSource query without its bound parameters raises ValueError) makes the
    export's source unusable where it is resolved (the tick, the CLI: the same resolution), saying why: the drift
    tick logs it instead of failing."""
    spec = invoice_export(
        source=BadQuerySource(url="sqlite:///billing.sqlite3"),
        tenants=["acme"],
        timezone="UTC",
        start_date="2026-01-01",
    )
    defs = ledgered_definitions([spec], environ=_environ(tmp_path), drift_lookback_days=3650)

    found = tick(defs, instance, sensor_name="drift_sensor")

    said = [record.getMessage() for record in found.logs]
    assert any(s.startswith("invoice_export: not checked for drift") and "bound parameters" in s for s in said), said


def test_a_bad_sample_cadence_is_refused_at_load_without_its_value(tmp_path):
    """A malformed value (not a missing setting) is refused at load, and a URL pasted into it is not quoted."""
    settings = {"EXPORTS_SOURCE": "sample", "EXPORTS_SAMPLE_CADENCE_MINUTES": f"postgresql://u:{PASSWORD}@db/x"}
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(environ=_environ(tmp_path, **settings))

    assert "EXPORTS_SAMPLE_CADENCE_MINUTES must be a positive integer" in str(refused.value)
    assert PASSWORD not in str(refused.value)


SHOP_LOCATION = """
import dagster as dg
from export_ledger import ExportSpec, SqlSource
from export_ledger.dagster import SourceResource, ledgered_definitions


class OrdersSource(SourceResource):
    url: str
    def get_source(self, spec):
        return SqlSource(self.url, "SELECT * FROM o WHERE tenant = :tenant AND t >= :start AND t < :end")


orders = ExportSpec(
    name="orders", source=OrdersSource(url=dg.EnvVar("SHOP_ORDERS_URL")),
    columns={"order_id": "string", "tenant": "string", "t": "timestamp"}, id_columns=["order_id"], time_column="t",
    tenant_column="tenant", tenants=["acme"], timezone="UTC", start_date="2026-01-01",
)
shop_defs = ledgered_definitions([orders], environ={"EXPORTS_LEDGER_URL": LEDGER, "EXPORTS_DESTINATION": EXPORTS})
"""


def test_a_source_resource_of_a_users_own_is_resolved_for_the_cli_or_names_the_variable_it_lacks(tmp_path, monkeypatch):
    """A resource whose URL is always an EnvVar: where the CLI's environment lacks the variable, Dagster cannot
    resolve it, and the export's source is unusable there, naming the variable (a run is refused by Dagster the same
    way); where it has it, the CLI reads the URL the variable holds."""
    location = tmp_path / "shop_location.py"
    ledger, exports = f"sqlite:///{tmp_path / 'ledger.sqlite3'}", str(tmp_path / "exports")
    location.write_text(f"LEDGER = {ledger!r}\nEXPORTS = {exports!r}\n{SHOP_LOCATION}")
    monkeypatch.delenv("SHOP_ORDERS_URL", raising=False)

    (lacking,) = load_code_location(python_file=str(location)).specs
    monkeypatch.setenv("SHOP_ORDERS_URL", f"sqlite:///{tmp_path / 'shop.sqlite3'}")
    (given,) = load_code_location(python_file=str(location)).specs

    assert isinstance(lacking.source, UnusableSource), lacking.source
    assert lacking.source.reason.startswith(
        "the source cannot be used in this process: "
        'You have attempted to fetch the environment variable "SHOP_ORDERS_URL" which is not set'
    ), f"Dagster's words without its exception class: {lacking.source.reason}"
    assert given.source.url == f"sqlite:///{tmp_path / 'shop.sqlite3'}", "the CLI reads what the variable holds"


def test_drift_given_specs_whose_source_is_a_resource_says_to_name_the_code_location_and_exits_1(
    tmp_path, monkeypatch, capsys
):
    """--specs names exports, not their code location: a source declared as a resource cannot be resolved there.
    The export is named unchecked, saying to use -f/-m, and the command exits 1 (it exited 0, checking nothing)."""
    (tmp_path / "shop_specs.py").write_text(SHOP_LOCATION.replace("shop_defs = ", "# "))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SHOP_ORDERS_URL", f"sqlite:///{tmp_path / 'shop.sqlite3'}")
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    open_ledger(ledger)

    code = cli.main(["--ledger-url", ledger, "drift", "--specs", "shop_specs:orders", "--destination", str(tmp_path)])

    out = capsys.readouterr().out
    assert code == 1, out
    assert "orders (its source is OrdersSource" in out and "-f FILE or -m MODULE" in out, out


def test_a_run_whose_config_sets_the_source_resource_is_refused_before_anything_is_claimed(tmp_path, instance):
    """The launchpad can give resources.invoice_export__source a config of its own (the sample on a SQL location):
    the source is the location's settings, so such a run is refused, saying so, and nothing is claimed."""
    url = f"sqlite:///{tmp_path / 'billing.sqlite3'}"
    sql_invoices(url, DAY, ("acme",))
    defs = build_definitions(environ=_environ(tmp_path, EXPORTS_SOURCE_URL=url, EXPORTS_SOURCE_TABLE="invoices"))

    result = defs.resolve_job_def(JOB).execute_in_process(
        partition_key=DAY.isoformat(),
        instance=instance,
        raise_on_error=False,
        run_config={"resources": {"invoice_export__source": {"config": {"sample": True, "url": "", "table": ""}}}},
    )

    assert not result.success
    assert "sets resources.invoice_export__source" in failure_message(result), failure_message(result)[-2000:]
    assert open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}").queries.records() == [], "nothing claimed"


def test_a_source_resource_field_given_a_wrong_value_is_refused_without_quoting_it():
    """A URL pasted into the wrong field (the cadence): pydantic's message would quote it; the resource hides it."""
    with pytest.raises(Exception) as refused:
        InvoiceSourceResource(sample=True, sample_cadence_minutes=f"postgresql://u:{PASSWORD}@db/billing")

    assert "sample_cadence_minutes" in str(refused.value), str(refused.value)
    assert PASSWORD not in str(refused.value), str(refused.value)


class CadenceSource(SourceResource):
    """A user's resource with an integer field, given as dg.EnvVar.int."""

    cadence: int

    def get_source(self, spec):
        return SampleInvoiceSource(cadence_minutes=self.cadence)


def test_a_source_resource_that_dagster_cannot_build_here_is_unusable_naming_its_key_in_one_line(monkeypatch):
    """An EnvVar.int whose variable holds no integer (a URL pasted there): Dagster refuses the resource's config. The
    source is unusable here, named by its resource key and field, in one line: neither the value nor Dagster's stack
    trace."""
    monkeypatch.setenv("TEST_CADENCE", f"postgresql://u:{PASSWORD}@db/billing")
    spec = invoice_export(
        source=CadenceSource(cadence=dg.EnvVar.int("TEST_CADENCE")),
        tenants=["acme"],
        timezone="UTC",
        start_date="2026-01-01",
    )

    reason = built_spec(spec).source.reason

    assert (
        reason
        == "the source cannot be used in this process: its resource invoice_export__source is not valid config here: "
        "cadence, read from TEST_CADENCE (failed post processing)"
    ), "the field is named, the variable it reads, and how Dagster refused it"


class CadenceSetting(dg.ConfigurableResource):
    cadence: int


class NestedCadenceSource(SourceResource):
    """A user's source resource whose setting is a resource of its own."""

    setting: CadenceSetting

    def get_source(self, spec):
        return SampleInvoiceSource(cadence_minutes=self.setting.cadence)


def test_a_refused_setting_of_a_resource_the_source_depends_on_is_named_as_that_resource_s(monkeypatch):
    """Dagster's stack for a nested resource starts at that resource's config: the field is said to be a resource the
    source depends on, not a field of the source's own."""
    monkeypatch.setenv("TEST_CADENCE", f"postgresql://u:{PASSWORD}@db/billing")
    source = NestedCadenceSource(setting=CadenceSetting(cadence=dg.EnvVar.int("TEST_CADENCE")))
    spec = invoice_export(source=source, tenants=["acme"], timezone="UTC", start_date="2026-01-01")

    reason = built_spec(spec).source.reason

    assert reason.endswith("a resource it depends on: cadence (failed post processing)"), reason
    assert PASSWORD not in reason, reason


def test_a_code_server_loaded_without_the_source_url_leaves_drift_unchecked_even_when_a_tick_has_it(
    tmp_path, instance, monkeypatch
):
    """What docs/production.md says: ticks run in the code server, and its environment at load decides whether the URL
    field is EnvVar or empty. Loaded without EXPORTS_SOURCE_URL, the tick cannot use the source, naming the variable."""
    url = f"sqlite:///{tmp_path / 'billing.sqlite3'}"
    sql_invoices(url, DAY, ("acme",))
    for name, value in _environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("EXPORTS_SOURCE", raising=False)
    monkeypatch.delenv("EXPORTS_SOURCE_URL", raising=False)
    monkeypatch.setenv("EXPORTS_SOURCE_TABLE", "invoices")
    defs = build_definitions()  # the code server, without the URL
    monkeypatch.setenv("EXPORTS_SOURCE_URL", url)  # set afterwards: too late for that code server

    said = [record.getMessage() for record in tick(defs, instance, sensor_name="drift_sensor").logs]

    assert any("not checked for drift" in s and "EXPORTS_SOURCE_URL" in s for s in said), said
