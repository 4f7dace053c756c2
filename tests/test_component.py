"""LedgeredExports: ledgered exports declared in a defs.yaml, loaded in process with Dagster's component sandbox and,
marked ``process``, through ``dg`` in a project that holds no Python of the user's own after a non-editable install.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import yaml
from builders import open_ledger
from dagster.components.testing import create_defs_folder_sandbox
from pipeline_helpers import current_data_file

from export_ledger import ExportSpec
from export_ledger.dagster import LedgeredExports
from export_ledger.dagster.component import ExportModel
from export_ledger.ledger import ExportState

PROJECT = Path(__file__).resolve().parent.parent
TYPE_NAME = "export_ledger.dagster.LedgeredExports"
DAY = "2026-03-08"
#: globex's business day 2026-03-08 in Asia/Kolkata (UTC+05:30) starts at 18:30 UTC the day before.
GLOBEX_KEY = "orders/globex/2026-03-07T18:30:00Z"
ZONED_ASSET = "orders__asia_kolkata"

#: The defs.yaml of docs/component.md: what the marked test writes into the project ``dg`` made, and the fast tests
#: load. Paths and secrets come from the environment or the project root, so the same text works in any checkout.
COMPONENT_YAML = """\
type: export_ledger.dagster.LedgeredExports

attributes:
  ledger_url_env: SHOP_LEDGER_URL
  destination: "{{ context.project_root }}/var/exports"
  exports:
    - name: orders
      source:
        url_env: SHOP_DATABASE_URL
        query: >-
          SELECT order_id, tenant, placed_at, total FROM orders
          WHERE tenant = :tenant AND placed_at >= :start AND placed_at < :end
          ORDER BY placed_at, order_id
      columns: {order_id: string, tenant: string, placed_at: timestamp, total: float}
      id_columns: [order_id]
      time_column: placed_at
      tenant_column: tenant
      tenants:
        acme: null              # the export's zone
        globex: Asia/Kolkata    # a business day of its own
      timezone: America/New_York
      start_date: "2026-01-01"
"""

#: Source rows (UTC text, as SqlSource binds its bounds on SQLite): three of globex's Kolkata day, one just after it,
#: and one of acme's.
ORDERS = [
    ("g1", "globex", "2026-03-07 18:30:00", 10.0),
    ("g2", "globex", "2026-03-08 02:00:00", 20.5),
    ("g3", "globex", "2026-03-08 18:29:59", 30.0),
    ("g4", "globex", "2026-03-08 18:30:00", 40.0),
    ("a1", "acme", "2026-03-08 12:00:00", 50.0),
]


def make_source_database(path: Path) -> str:
    """A SQLite shop database holding :data:`ORDERS`; returns its URL."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE orders (order_id TEXT, tenant TEXT, placed_at TEXT, total REAL)")
        conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", ORDERS)
    return f"sqlite:///{path}"


@pytest.fixture
def shop_env(tmp_path, monkeypatch) -> dict[str, str]:
    """The variables the YAML names: the source database's URL and the ledger's."""
    env = {
        "SHOP_DATABASE_URL": make_source_database(tmp_path / "shop.db"),
        "SHOP_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def sandbox():
    with create_defs_folder_sandbox(project_name="shop") as made:
        yield made


def load(sandbox, text: str) -> tuple[LedgeredExports, dg.Definitions]:
    """The component and definitions Dagster loads from ``text`` as ``defs/exports/defs.yaml``."""
    folder = sandbox.defs_folder_path / "exports"
    folder.mkdir(exist_ok=True)
    (folder / "defs.yaml").write_text(text)
    with sandbox.load_component_and_build_defs(defs_path=folder) as (component, defs):
        return component, defs


def refusal(sandbox, text: str) -> str:
    """The whole message chain of the error loading ``text``: what ``dg check defs`` prints."""
    with pytest.raises(Exception) as caught:  # Dagster wraps the component's error in its own
        load(sandbox, text)
    messages, error = [], caught.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(messages)


def test_the_scaffolded_template_is_commented_and_loads_as_one_export(sandbox, shop_env) -> None:
    folder = sandbox.scaffold_component(component_cls=LedgeredExports, defs_path="exports")
    text = (folder / "defs.yaml").read_text()
    assert text.count("\n#") + text.count("  # ") >= 10, "the template explains its fields"
    assert yaml.safe_load(text)["type"].endswith("LedgeredExports")

    with sandbox.load_component_and_build_defs(defs_path=folder) as (component, defs):
        (spec,) = component.exports
        assert (spec.name, spec.tenants, spec.timezone) == ("orders", ("acme", "globex"), "America/New_York")
        assert sorted(k.to_user_string() for k in defs.resolve_all_asset_keys()) == ["orders", "orders__asia_kolkata"]
        assert {"orders_job", "orders__asia_kolkata_job"} <= {j.name for j in defs.jobs}
        assert sorted(s.name for s in defs.schedules) == ["nightly_orders", "nightly_orders__asia_kolkata"]
        assert {"drift_sensor", "reconciliation_sensor"} <= {s.name for s in defs.sensors}


def test_every_field_of_export_spec_can_be_declared_in_yaml() -> None:
    declarable = {f.name for f in dataclasses.fields(ExportSpec) if f.init}
    assert set(ExportModel.model_fields) == declarable, "ExportModel follows ExportSpec field for field"


def test_the_readme_example_gives_an_asset_job_and_schedule_per_zone_of_its_tenants(sandbox, shop_env) -> None:
    component, defs = load(sandbox, COMPONENT_YAML)
    (spec,) = component.exports
    assert [(g.asset_name, g.timezone, g.tenants) for g in spec.groups] == [
        ("orders", "America/New_York", ("acme",)),
        ("orders__asia_kolkata", "Asia/Kolkata", ("globex",)),
    ]
    assert sorted(k.to_user_string() for k in defs.resolve_all_asset_keys()) == ["orders", "orders__asia_kolkata"]
    assert {"orders__asia_kolkata_job", "orders_job"} <= {j.name for j in defs.jobs}
    assert len(defs.schedules) == 2
    checks = {key.name for key in defs.resolve_asset_graph().asset_check_keys if key.asset_key.path == [ZONED_ASSET]}
    assert {"no_stuck_exports", "source_unchanged"} <= checks, checks
    assert defs.resources["ledger"].url == dg.EnvVar("SHOP_LEDGER_URL"), "the ledger URL is handed over by name"
    assert defs.resources["orders__destination"].spec == str(sandbox.project_root / "var" / "exports")


def test_a_partition_of_the_yaml_export_is_exported_and_recorded(sandbox, shop_env, instance) -> None:
    _, defs = load(sandbox, COMPONENT_YAML)
    result = defs.resolve_job_def("orders__asia_kolkata_job").execute_in_process(partition_key=DAY, instance=instance)
    assert result.success
    record = open_ledger(shop_env["SHOP_LEDGER_URL"]).queries.get(GLOBEX_KEY)
    assert (record.state, record.row_count) == (ExportState.COMPLETED, 3)
    folder = sandbox.project_root / "var" / "exports" / "orders" / "tenant=globex" / f"date={DAY}"
    assert sorted(pd.read_csv(current_data_file(folder))["order_id"]) == ["g1", "g2", "g3"]


def with_field(line: str) -> str:
    """:data:`COMPONENT_YAML` with one more line in the export's entry."""
    start = 'start_date: "2026-01-01"'
    return COMPONENT_YAML.replace(start, f"{start}\n      {line}")


@pytest.mark.parametrize(
    "text, named",
    [
        (with_field("file_format: xlsx"), "unknown file format 'xlsx'"),
        (COMPONENT_YAML.replace("Asia/Kolkata", "Asia/Calcutta-ish"), "unknown timezone 'Asia/Calcutta-ish'"),
        (with_field('schedule_time: "25:00"'), "schedule_time must be HH:MM"),
        (with_field("stream_rows: 0"), "stream_rows must be a positive number"),
        (COMPONENT_YAML.replace("< :end", "< '2027-01-01'"), "source.query: SqlSource query must use"),
    ],
    ids=["file_format", "tenant zone", "schedule_time", "stream_rows", "query without :end"],
)
def test_a_bad_value_is_refused_naming_the_file_line_export_and_field(sandbox, shop_env, text, named) -> None:
    message = refusal(sandbox, text)
    assert named in message, message
    assert "export 'orders'" in message, "the export is named"
    assert "defs.yaml:7" in message, "the error points at the export's entry in the file"


YAML_SECRET = "SECRETyaml-canary-92d4"


@pytest.mark.parametrize(
    "text",
    [
        with_field(f"destination: s3://AKIAEXAMPLE:{YAML_SECRET}@exports-bucket/orders\n      file_format: xlsx"),
        with_field(f"destination: s3://AKIAEXAMPLE:{YAML_SECRET}@exports-bucket/orders"),
    ],
    ids=["with-another-bad-field", "alone"],
)
def test_an_exports_destination_with_a_credential_is_refused_without_showing_the_entry(sandbox, shop_env, text):
    """The load error (``dg check defs``, the webserver) would otherwise quote the export's entry, secret included."""
    message = refusal(sandbox, text)
    assert YAML_SECRET not in message, f"the load error shows the secret: {message}"
    assert "export 'orders': destination carries a user name and password" in message, message
    assert "'s3://***@exports-bucket/orders'" in message and "AWS_SECRET_ACCESS_KEY" in message, message
    assert "exports.0" in message, f"the error names the export's place in the YAML: {message}"


def test_a_component_destination_with_a_credential_is_refused_naming_the_yaml_attribute(sandbox, shop_env):
    text = COMPONENT_YAML.replace(
        'destination: "{{ context.project_root }}/var/exports"',
        f"destination: s3://AKIAEXAMPLE:{YAML_SECRET}@exports-bucket/orders",
    )
    message = refusal(sandbox, text)
    assert YAML_SECRET not in message, f"the load error shows the secret: {message}"
    assert "LedgeredExports attribute destination carries a user name and password" in message, message
    assert "destination argument" not in message, "a YAML attribute is not a Python argument"


def test_a_value_of_the_wrong_type_is_refused_at_its_field(sandbox, shop_env) -> None:
    message = refusal(sandbox, COMPONENT_YAML.replace("id_columns: [order_id]", "id_columns: {order_id: 1}"))
    assert "0.id_columns" in message and "valid array" in message, message


def test_the_source_url_is_never_shown_by_the_component_or_its_assets(sandbox, shop_env) -> None:
    component, defs = load(sandbox, COMPONENT_YAML)
    url = shop_env["SHOP_DATABASE_URL"]
    assert url not in repr(component), "the component's repr names the variable, never the URL"
    for asset in defs.assets:
        assert url not in repr(asset.metadata_by_key) and url not in repr(asset.descriptions_by_key)
    # The UI's resource config (GraphQL configuredValues): the source is a resource whose URL is the variable's name.
    resource = defs.get_repository_def().get_top_level_resources()["orders__source"]
    configured = json.loads(resource.config_schema.default_value_as_json_str)
    assert configured["url"] == {"env": "SHOP_DATABASE_URL"} and url not in json.dumps(configured), configured


def test_a_missing_source_url_variable_fails_each_run_naming_it_and_the_location_still_loads(
    sandbox, shop_env, instance, monkeypatch
) -> None:
    monkeypatch.delenv("SHOP_DATABASE_URL")
    missing = "source.url_env: environment variable SHOP_DATABASE_URL is not set"
    # The location loads (the UI shows the exports and their history); the asset's page says what its runs lack.
    _, defs = load(sandbox, COMPONENT_YAML)
    for asset in defs.assets:
        (description,) = asset.descriptions_by_key.values()
        assert missing in description and "A run fails naming this" in description, description

    # A run fails naming the variable, before anything is claimed; nothing is read from anywhere else instead.
    result = defs.resolve_job_def("orders__asia_kolkata_job").execute_in_process(
        partition_key=DAY, instance=instance, raise_on_error=False
    )
    assert not result.success
    error, said = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error, []
    while error is not None:  # Dagster's step error, caused by the library's
        said.append(error.message)
        error = error.cause
    assert any(missing in m and "nothing was exported" in m for m in said), said
    ledger = open_ledger(shop_env["SHOP_LEDGER_URL"])
    assert ledger.queries.get(GLOBEX_KEY) is None, "nothing is claimed for a run that lacks its source"
    assert not (sandbox.project_root / "var" / "exports" / "orders").exists(), "nothing is published"

    # Given the variable again (a restarted code server), the same location's next run exports the partition.
    monkeypatch.setenv("SHOP_DATABASE_URL", make_source_database(sandbox.project_root / "shop-again.db"))
    _, defs = load(sandbox, COMPONENT_YAML)
    job = defs.resolve_job_def("orders__asia_kolkata_job")
    assert job.execute_in_process(partition_key=DAY, instance=instance).success
    assert ledger.queries.get(GLOBEX_KEY).state is ExportState.COMPLETED


def test_a_bad_query_is_refused_at_load_even_where_the_source_url_variable_is_unset(sandbox, shop_env, monkeypatch):
    # CI without the secret checks the same YAML as production with it: the query is checked without its URL.
    monkeypatch.delenv("SHOP_DATABASE_URL")
    message = refusal(sandbox, COMPONENT_YAML.replace("< :end", "< '2027-01-01'"))
    assert "source.query: SqlSource query must use the bound parameters [':end']" in message, message


# -- dg in a fresh virtualenv ----------------------------------------------------------------------------------------


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 300, stderr: bool = True) -> str:
    """Runs a command that must succeed; returns its output (stdout alone with ``stderr=False``)."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout + done.stderr if stderr else done.stdout


@pytest.mark.xdist_group("fresh_install")  # one worker makes the shared install and runs both of its tests
@pytest.mark.process
def test_a_project_of_yaml_alone_exports_a_partition_through_dg_after_a_non_editable_install(
    fresh_install, tmp_path
) -> None:
    started = time.monotonic()
    bin_dir = fresh_install
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",  # the virtualenv activated
        VIRTUAL_ENV=str(bin_dir.parent),
        DAGSTER_HOME=str(home),
        DAGSTER_DG_UPDATE_CHECK_ENABLED="0",  # no look-up of newer releases
        SHOP_DATABASE_URL=make_source_database(tmp_path / "shop.db"),
    )

    run(["create-dagster", "project", "shop", "--no-uv-sync"], tmp_path, env)
    shop = tmp_path / "shop"
    # What create-dagster generates: pyproject.toml ([tool.dg] project, root module shop) and four Python files, the
    # empty packages and definitions.py, which loads whatever the defs folder declares. None is the user's.
    generated = sorted(str(p.relative_to(shop)) for p in shop.rglob("*.py"))
    assert generated == [
        "src/shop/__init__.py", "src/shop/definitions.py", "src/shop/defs/__init__.py", "tests/__init__.py",
    ]  # fmt: skip
    run([str(bin_dir / "pip"), "install", "-q", "--no-deps", "-e", "."], shop, env)  # the project's README step

    listed = json.loads(run(["dg", "list", "components", "--json"], shop, env, stderr=False))
    assert TYPE_NAME in [item["key"] for item in listed["items"]], "registered through the entry point"
    run(["dg", "scaffold", "defs", TYPE_NAME, "exports"], shop, env)
    defs_yaml = shop / "src" / "shop" / "defs" / "exports" / "defs.yaml"
    assert yaml.safe_load(defs_yaml.read_text())["type"] == TYPE_NAME  # launched as scaffolded, as the README says

    outputs = [run(["dg", "check", "defs"], shop, env)]
    in_process = '{"execution": {"config": {"in_process": {}}}}'  # one process: the run's steps need no isolation
    outputs.append(
        run(["dg", "launch", "--assets", "orders__asia_kolkata", "--partition", DAY, "--config-json", in_process],
            shop, env)
    )  # fmt: skip

    folder = shop / "var" / "exports" / "orders" / "tenant=globex" / f"date={DAY}"
    assert sorted(pd.read_csv(current_data_file(folder))["order_id"]) == ["g1", "g2", "g3"]
    record = open_ledger(f"sqlite:///{shop / 'var' / 'ledger.sqlite3'}").queries.get(GLOBEX_KEY)
    assert (record.state, record.row_count) == (ExportState.COMPLETED, 3)
    assert not (shop / "var" / "exports" / "orders" / "tenant=acme").exists(), "acme's day is another asset's"
    assert all(env["SHOP_DATABASE_URL"] not in out for out in outputs), "the source URL is never printed"
    print(f"create-dagster, dg scaffold, check and launch: {time.monotonic() - started:.0f} s")
