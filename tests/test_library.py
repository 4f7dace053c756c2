"""export_ledger as a library: a Dagster-free core, declared exports, several exports in one code location, the
README's library example, an installed package with one top-level name, and ledgers made by the old schema."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import open_ledger
from builders import v1_ledger as _v1_ledger
from pipeline_helpers import current_data_file

from export_ledger import ConfigurationError, ExportLedgerError, ExportSpec, FrameError, SqlSource, window_for
from export_ledger.dagster import ledgered_definitions
from export_ledger.ledger import (
    SCHEMA_VERSION,
    ExportLedger,
    LedgerUnavailable,
    SchemaOutdated,
    dispose_engines,
    schema_version,
    upgrade_url,
)

PROJECT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CORE_MODULES = [
    "export_ledger",
    "export_ledger.calendar",
    "export_ledger.keys",
    "export_ledger.frames",
    "export_ledger.spec",
    "export_ledger.sources",
    "export_ledger.settings",
    "export_ledger.protocol",
    "export_ledger.steps",
    "export_ledger.stage",
    "export_ledger.runs",
    "export_ledger.reconcile",
    "export_ledger.ledger",
    "export_ledger.destinations",
    "export_ledger.destinations.table",
    "export_ledger.cli",
]


def test_importing_the_core_modules_does_not_import_dagster() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {CORE_MODULES!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'dagster' or m.startswith('dagster.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert json.loads(out.stdout) == [], "the core must stay importable without Dagster"


def _python_with_the_sample_location(code: str, tmp_path) -> subprocess.CompletedProcess:
    """``python -c code`` in the project, its environment the reference location's on the sample (ledger and exports
    in ``tmp_path``) and no other ``EXPORTS_*`` setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_")}
    env.update(
        EXPORTS_SOURCE="sample",
        EXPORTS_LEDGER_URL=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        EXPORTS_DESTINATION=str(tmp_path / "exports"),
        PYTHONPATH=str(PROJECT),
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT, env=env)


def test_the_reference_code_location_uses_the_library_s_public_names_only() -> None:
    """The reference location is written as a user of the library would write it: every name it imports from
    export_ledger is in the ``__all__`` of the module it comes from, or is a public module (one with an ``__all__``);
    a module it imports whole is a public one (a private helper may change under a user)."""
    import ast
    import importlib.util

    def public(module: str, name: str | None = None) -> bool:
        imported = importlib.import_module(module)
        if name is None:
            return hasattr(imported, "__all__")
        if name in getattr(imported, "__all__", ()):
            return True
        return importlib.util.find_spec(f"{module}.{name}") is not None and public(f"{module}.{name}")

    files = [PROJECT / "definitions.py"] + [p for folder in ("assets", "resources", "sensors")
                                            for p in sorted((PROJECT / folder).rglob("*.py"))]  # fmt: skip
    private = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "export_ledger":
                private += [
                    f"{path.name}: {node.module}.{a.name}" for a in node.names if not public(node.module, a.name)
                ]
            elif isinstance(node, ast.Import):
                private += [
                    f"{path.name}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "export_ledger" and not public(a.name)
                ]
    assert len(files) > 3 and not private, f"names outside the library's __all__: {private}"


def test_a_user_s_function_annotated_with_rows_has_type_hints_and_importing_rows_imports_no_pandas(tmp_path) -> None:
    """``Rows`` (a key's rows, from export_ledger.protocol) names pandas without importing it, and resolves where a
    user's function annotated with it is inspected (Dagster and pydantic read annotations with get_type_hints), even
    in a module that never imports pandas."""
    (tmp_path / "users_module.py").write_text(
        "from export_ledger.protocol import Rows\n\ndef rows_for(tenant: str) -> Rows: ...\n", encoding="utf-8"
    )
    code = (
        "import sys, typing, users_module\n"
        "print('pandas' in sys.modules)\n"
        "print(typing.get_type_hints(users_module.rows_for)['return'])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PROJECT)])}  # this checkout's library
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    imported, hint = done.stdout.splitlines()
    assert imported == "False", "importing Rows imported pandas"
    assert "pandas.DataFrame" in hint and "FrameBatches" in hint and "Callable[[], pandas.DataFrame]" in hint, hint


def test_loading_the_code_location_imports_no_frame_library(tmp_path) -> None:
    # `dagster asset materialize` and `dagster dev` load the definitions in a process that reads no data: pandas,
    # numpy and pyarrow (half a second of imports) are imported by the step that exports, where they are first used.
    code = (
        "import json, sys\n"
        "import definitions, export_ledger, export_ledger.dagster\n"
        "print(json.dumps(sorted(m for m in ('pandas', 'numpy', 'pyarrow') if m in sys.modules)))"
    )
    out = _python_with_the_sample_location(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [], "loading the definitions imported a frame library"


def test_a_lazily_imported_library_is_the_module_itself_after_its_first_use() -> None:
    from export_ledger.lazy import LazyModule, lazy_module

    namespace: dict = {}
    namespace["js"] = lazy_module("json", namespace, "js")
    assert isinstance(namespace["js"], LazyModule)
    assert namespace["js"].dumps([1]) == "[1]"
    assert namespace["js"] is json, "after its first use the name is bound to the module"


def test_a_placeholder_is_patched_copied_and_refused_like_a_module() -> None:
    import copy

    from export_ledger.lazy import lazy_module

    namespace: dict = {}
    namespace["js"] = lazy_module("json", namespace, "js")
    namespace["js"].ledger_test_marker = 1  # what a test's patch does before the library's first use
    try:
        assert json.ledger_test_marker == 1, "setting an attribute sets it on the module itself"
    finally:
        del json.ledger_test_marker
    copied = copy.copy(lazy_module("json", {}, "js"))  # a copy asks for slots that are not set yet: no recursion
    assert copied is not None
    missing: dict = {}
    missing["gone"] = lazy_module("no_such_library_here", missing, "gone")
    with pytest.raises(ConfigurationError, match="export-ledger needs no_such_library_here"):
        _ = missing["gone"].anything


def test_a_process_without_a_frame_library_is_refused_at_load_naming_it(tmp_path) -> None:
    # The frame libraries are imported on first use; a process that lacks one (a broken install) is refused when it
    # loads the code location, naming it, rather than failing every key of every run with the name withheld.
    code = (
        "import sys\n"
        "sys.modules['pyarrow'] = None\n"  # as if it were not installed: its import fails, find_spec finds nothing
        "import definitions\n"
    )
    out = _python_with_the_sample_location(code, tmp_path)
    assert out.returncode != 0, "a code location without pyarrow must not load"
    assert "export-ledger needs pyarrow (a declared dependency)" in out.stderr, out.stderr[-2000:]


def _orders(tenant: str, start: dt.datetime, end: dt.datetime) -> pd.DataFrame:
    times = pd.date_range(pd.Timestamp(start).ceil("h"), pd.Timestamp(end), freq="h", inclusive="left").as_unit("us")
    return pd.DataFrame(
        {
            "order_id": [f"{tenant}-{int(t.timestamp())}" for t in times],
            "tenant": [tenant] * len(times),
            "placed_at": times,
            "total": [12.5] * len(times),
            "note": [None] * len(times),
        }
    )


def spec(name: str = "orders", **overrides) -> ExportSpec:
    values = dict(
        name=name,
        source=_orders,
        columns={
            "order_id": "string",
            "tenant": "string",
            "placed_at": "timestamp",
            "total": "float",
            "note": "string",
        },
        id_columns=["order_id"],
        time_column="placed_at",
        tenant_column="tenant",
        nullable=["note"],
        tenants=["acme", "globex"],
        timezone="America/New_York",
        start_date="2026-03-01",
    )
    return ExportSpec(**{**values, **overrides})


def test_two_declared_exports_share_one_ledger_and_sensor_and_get_their_own_asset_schedule_and_pool(tmp_path) -> None:
    environ = {"EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}", "EXPORTS_DESTINATION": str(tmp_path)}
    payments = spec("payments", timezone="Europe/Dublin", file_format="parquet", schedule_time="05:15")
    defs = ledgered_definitions([spec(), payments], environ=environ)

    assert {a.key.to_user_string() for a in defs.assets} == {"orders", "payments"}
    assert {s.name for s in defs.schedules} == {"nightly_orders", "nightly_payments"}
    assert [s.name for s in defs.sensors] == ["reconciliation_sensor", "partition_health_sensor", "drift_sensor"], (
        "one of each for all exports"
    )
    assert defs.get_assets_def("orders").op.pool == "exports-local-orders"
    assert defs.get_assets_def("payments").op.pool == "exports-local-payments"
    assert "ledger" in defs.resources

    with dg.instance_for_test() as instance:
        for name in ("orders", "payments"):
            result = defs.resolve_job_def(f"{name}_job").execute_in_process(
                partition_key="2026-03-08", instance=instance
            )
            assert result.success
    ledger = open_ledger(environ["EXPORTS_LEDGER_URL"])
    assert ledger.queries.exports() == ["orders", "payments"]
    orders = ledger.queries.records(export="orders")
    assert [(r.tenant, r.state.value, r.row_count) for r in orders] == [
        ("acme", "completed", 23),
        ("globex", "completed", 23),
    ]
    # Readers follow each key's pointer to its place: each export in its own format, under its own folder.
    assert current_data_file(tmp_path / "payments" / "tenant=acme" / "date=2026-03-08").name == "data.parquet"
    assert current_data_file(tmp_path / "orders" / "tenant=acme" / "date=2026-03-08").name == "data.csv"


def test_composite_ids_and_nullable_columns_are_validated(tmp_path) -> None:
    window = window_for(dt.date(2026, 3, 8), "America/New_York")
    twice = spec(id_columns=["order_id", "tenant"])
    frame = _orders("acme", window.start_utc, window.end_utc)
    frame = pd.concat([frame, frame.head(1)], ignore_index=True)
    from export_ledger import validate_frame

    with pytest.raises(FrameError, match="share their order_id/tenant with another"):
        validate_frame(frame, twice.schema, window, what="k", tenant="acme")
    required = spec(nullable=[])
    with pytest.raises(FrameError, match="column 'note' has 23 null value"):
        validate_frame(_orders("acme", window.start_utc, window.end_utc), required.schema, window, what="k")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": "Orders!"}, "invalid export name"),
        ({"tenants": []}, "needs at least one tenant"),
        ({"columns": {"order_id": "money"}}, "kind 'money'"),
        ({"id_columns": ["missing"]}, "'missing' is not among"),
        ({"file_format": "xlsx"}, "unknown file format"),
        ({"schedule_time": "02:30"}, "does not occur exactly once"),
        ({"source": None, "tenant_column": None}, "need tenant_column"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_export_and_the_problem(overrides, message) -> None:
    with pytest.raises(ExportLedgerError, match=f"export '.*': .*{message}"):
        spec(**overrides)


def test_two_exports_sharing_one_ledger_table_are_refused(tmp_path) -> None:
    environ = {"EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'l.sqlite3'}", "EXPORTS_DESTINATION": "ledger-table:rows"}
    with pytest.raises(ConfigurationError, match=r"ledger-table:exported_\{export\}"):
        ledgered_definitions([spec(), spec("payments")], environ=environ)
    environ["EXPORTS_DESTINATION"] = "ledger-table:exported_{export}"
    assert ledgered_definitions([spec(), spec("payments")], environ=environ)


def test_an_asset_of_ones_own_is_exported_through_the_ledgered_io_manager(tmp_path) -> None:
    usage = spec("usage", source=None)

    @dg.asset(name="usage", partitions_def=dg.DailyPartitionsDefinition("2026-03-01", timezone="America/New_York"),
              io_manager_key="usage__io_manager")  # fmt: skip
    def usage_asset(context) -> pd.DataFrame:
        window = context.partition_time_window
        return pd.concat([_orders(t, window.start, window.end) for t in ("acme", "globex")], ignore_index=True)

    environ = {"EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'l.sqlite3'}", "EXPORTS_DESTINATION": str(tmp_path)}
    defs = ledgered_definitions([usage], assets=[usage_asset], environ=environ)
    with dg.instance_for_test() as instance:
        assert (
            defs.resolve_job_def("usage_job").execute_in_process(partition_key="2026-03-08", instance=instance).success
        )
    records = open_ledger(environ["EXPORTS_LEDGER_URL"]).queries.records(export="usage")
    assert [(r.tenant, r.state.value, r.row_count) for r in records] == [
        ("acme", "completed", 23),
        ("globex", "completed", 23),
    ]


def test_a_sql_source_reads_with_bound_tenant_start_and_end(tmp_path) -> None:
    db = tmp_path / "shop.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE orders (order_id TEXT, tenant TEXT, placed_at TEXT, total REAL, note TEXT)")
        conn.executemany(
            "INSERT INTO orders VALUES (?, ?, ?, ?, NULL)",
            [("a1", "acme", "2026-03-08 05:00:00", 1.0), ("a2", "acme", "2026-03-09 03:59:59", 2.0),
             ("a3", "acme", "2026-03-09 04:00:00", 3.0), ("g1", "globex", "2026-03-08 12:00:00", 4.0)],
        )  # fmt: skip
    source = SqlSource(
        f"sqlite:///{db}", "SELECT * FROM orders WHERE tenant = :tenant AND placed_at >= :start AND placed_at < :end"
    )
    declared = spec(source=source)
    window = window_for(dt.date(2026, 3, 8), "America/New_York")
    frame = declared.read("acme", window.start_utc, window.end_utc)
    assert list(frame["order_id"]) == ["a1", "a2"], "the window is [05:00Z, 04:00Z next day) on the 23-hour day"
    assert isinstance(frame["placed_at"].dtype, pd.DatetimeTZDtype)
    assert declared.count("acme", window.start_utc, window.end_utc) == 2
    with pytest.raises(ValueError, match="bound parameters"):
        SqlSource("sqlite://", "SELECT * FROM orders")


def _readme_library_example() -> str:
    text = (PROJECT / "README.md").read_text()
    section = text.split("## Use it as a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_library_example_is_the_example_file() -> None:
    assert _readme_library_example() == (PROJECT / "examples" / "shop_definitions.py").read_text()


# -- the old schema ------------------------------------------------------------------------------------------------

# What release 0.1.0 created (export_ledger.ledger.schema at version 1), written out as its DDL: no version table.


def test_a_ledger_made_by_the_old_schema_reads_unchanged_refuses_writes_until_upgraded_then_keeps_every_record(
    ledger_url,
) -> None:
    _v1_ledger(ledger_url)
    reader = ExportLedger(ledger_url, read_only=True)
    assert schema_version(sa.create_engine(ledger_url)) == 1, "a read leaves the old schema as it is"
    before = [(r.logical_key, r.state.value, r.row_count, r.fencing_token) for r in reader.queries.records()]
    assert len(before) == 2
    dispose_engines()

    with pytest.raises(SchemaOutdated, match="export-ledger upgrade"):
        ExportLedger(ledger_url)  # opening to write names the explicit upgrade instead of running it
    assert schema_version(sa.create_engine(ledger_url)) == 1, "a refused write-open leaves the old schema as it is"
    dispose_engines()

    assert upgrade_url(ledger_url), "the explicit upgrade has steps to run on a version 1 ledger"
    writer = open_ledger(ledger_url)
    assert schema_version(sa.create_engine(ledger_url)) == SCHEMA_VERSION
    assert [(r.logical_key, r.state.value, r.row_count, r.fencing_token) for r in writer.queries.records()] == before
    attempts = writer.queries.attempts("invoice_export/acme/2026-03-08T05:00:00Z")
    assert [a.outcome.value for a in attempts] == ["completed"]
    assert writer.retention.low_water("invoice_export") == dt.date(2026, 1, 1)
    assert writer.contracts.recorded("invoice_export") == {"timezone": "America/New_York"}
    failed = writer.queries.records(states=[writer.queries.records()[1].state])[0]
    assert failed.tenant == "globex", "the failed key is still claimable after the upgrade"


def test_a_read_never_creates_tables_on_an_empty_database(ledger_url) -> None:
    with pytest.raises(LedgerUnavailable, match="holds no export ledger"):
        ExportLedger(ledger_url, read_only=True)
    assert sa.inspect(sa.create_engine(ledger_url)).get_table_names() == []


# -- installed, outside the checkout -------------------------------------------------------------------------------


@pytest.mark.xdist_group("fresh_install")  # one worker makes the shared install and runs both of its tests
@pytest.mark.process
def test_a_non_editable_install_puts_only_export_ledger_in_site_packages_and_the_example_runs(
    tmp_path, fresh_install
) -> None:
    venv = fresh_install.parent  # one non-editable install, shared with the Component's test
    python = str(venv / "bin" / "python")
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (record,) = site.glob("export_ledger-*.dist-info/RECORD")
    ours = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    assert ours == {"export_ledger", record.parent.name, ".."}, f"top-level names installed: {sorted(ours)}"
    clashes = {"assets", "resources", "sensors", "cli.py", "definitions.py"} & set(os.listdir(site))
    assert not clashes, f"site-packages holds {sorted(clashes)}"

    work = tmp_path / "work"
    work.mkdir()
    (work / "shop.py").write_text(_readme_library_example())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "PYTHON"))}
    env["DAGSTER_HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    dagster = str(venv / "bin" / "dagster")

    def run(*args: str) -> str:
        done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr[-3000:]}"
        return done.stdout

    run(dagster, "definitions", "validate", "-f", "shop.py")
    for name in ("orders", "payments"):
        run(dagster, "asset", "materialize", "-f", "shop.py", "--select", name, "--partition", "2026-03-08")
    out = run(str(venv / "bin" / "export-ledger"), "status", "--export", "orders")
    assert "orders/acme/2026-03-08T05:00:00Z" in out and "completed" in out
    exports = work / "var" / "exports"
    assert current_data_file(exports / "orders" / "tenant=globex" / "date=2026-03-08").name == "data.csv"
    assert current_data_file(exports / "payments" / "tenant=acme" / "date=2026-03-08").name == "data.parquet"
    assert (work / "var" / "ledger.sqlite3").is_file(), "the ledger lives in the working directory"


def test_event_metadata_is_bounded_and_names_the_command_that_lists_every_key(tmp_path) -> None:
    tenants = [f"t{n:02d}" for n in range(25)]
    environ = {"EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'l.sqlite3'}", "EXPORTS_DESTINATION": str(tmp_path)}
    defs = ledgered_definitions([spec(tenants=tenants)], environ=environ)
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("orders_job").execute_in_process(partition_key="2026-03-08", instance=instance)
        assert result.success
        (event,) = result.asset_materializations_for_node("orders")
    metadata = event.metadata
    assert metadata["keys"].value == 25 and metadata["exported_keys"].value == 25
    assert len(metadata["key_table"].value.records) == 20, "the first 20 keys listed"
    command = "export-ledger status --export orders --from 2026-03-08 --to 2026-03-08"
    assert command in metadata["all_keys"].value and metadata["every_key"].value == command


def test_export_ledger_upgrade_brings_an_old_ledger_to_the_current_schema(sqlite_url, capsys) -> None:
    from export_ledger import cli

    _v1_ledger(sqlite_url)
    assert cli.main(["--ledger-url", sqlite_url, "status", "--json"]) == 0, "an old ledger reads as it is"
    assert schema_version(sa.create_engine(sqlite_url)) == 1
    capsys.readouterr()
    assert cli.main(["--ledger-url", sqlite_url, "upgrade"]) == 0
    assert f"version {SCHEMA_VERSION}" in capsys.readouterr().out
    assert schema_version(sa.create_engine(sqlite_url)) == SCHEMA_VERSION
    assert cli.main(["--ledger-url", sqlite_url, "upgrade"]) == 0
    assert "current" in capsys.readouterr().out


def test_every_transition_is_declared_once_and_refuses_a_state_it_does_not_start_from(sqlite_url, clock) -> None:
    from export_ledger.ledger import transitions as T
    from export_ledger.ledger.errors import InvalidTransition

    names = [(t.name, t.from_states, t.to_state) for t in T.TRANSITIONS]
    assert len(set(names)) == len(names), "one declaration per transition"
    ledger = open_ledger(sqlite_url, clock=clock)
    claim = ledger.claims.claim(key_for_library(), "run-1/orders")
    with ledger.atomic() as conn, pytest.raises(InvalidTransition, match="does not start from"):
        T.apply(conn, T.FAIL, claim.logical_key, token=1, owner="run-1/orders", values={}, states=(T.S.COMPLETED,))
    with ledger.atomic() as conn, pytest.raises(InvalidTransition, match="needs the party that holds the lease"):
        T.apply(conn, T.COMPLETE, claim.logical_key, token=1, values={})


def key_for_library():
    from export_ledger.keys import LogicalKey

    return LogicalKey("orders", "acme", window_for(dt.date(2026, 3, 8), "America/New_York"))


def test_a_shared_ledger_table_is_refused_also_when_the_ledger_url_comes_from_the_environment(tmp_path, monkeypatch):
    # With environ=None the ledger URL reaches the resources as an EnvVar; the check must not depend on its value.
    monkeypatch.setenv("EXPORTS_LEDGER_URL", f"sqlite:///{tmp_path / 'l.sqlite3'}")
    monkeypatch.setenv("EXPORTS_DESTINATION", "ledger-table:rows")
    with pytest.raises(ConfigurationError, match="would share the ledger table 'rows'"):
        ledgered_definitions([spec(), spec("payments")])


def test_an_export_declared_to_stream_reads_its_sql_source_in_batches_through_dagster(tmp_path) -> None:
    db = tmp_path / "shop.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE orders (order_id TEXT, tenant TEXT, placed_at TEXT, total REAL, note TEXT)")
        conn.executemany(
            "INSERT INTO orders VALUES (?, ?, ?, ?, NULL)",
            [(f"a{i:04d}", "acme", f"2026-03-08 {5 + i // 60:02d}:{i % 60:02d}:00", float(i)) for i in range(250)],
        )
    query = (
        "SELECT * FROM orders WHERE tenant = :tenant AND placed_at >= :start AND placed_at < :end "
        "ORDER BY placed_at, order_id"
    )
    streamed = spec(source=SqlSource(f"sqlite:///{db}", query), tenants=["acme"], stream_rows=40)
    whole = spec(name="orders_whole", source=SqlSource(f"sqlite:///{db}", query), tenants=["acme"])
    environ = {"EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'l.sqlite3'}", "EXPORTS_DESTINATION": str(tmp_path)}
    defs = ledgered_definitions([streamed, whole], environ=environ)
    with dg.instance_for_test() as instance:
        results = {
            job: defs.resolve_job_def(job).execute_in_process(partition_key="2026-03-08", instance=instance)
            for job in ("orders_job", "orders_whole_job")
        }
    assert all(r.success for r in results.values())
    (event,) = results["orders_job"].get_asset_materialization_events()
    assert event.materialization.metadata["streamed_keys"].value == 1, "the key was read while it was exported"
    ledger = open_ledger(environ["EXPORTS_LEDGER_URL"])
    (a,), (b,) = ledger.queries.records(export="orders"), ledger.queries.records(export="orders_whole")
    assert a.row_count == b.row_count == 250
    assert a.sha256 == b.sha256, "streamed in batches of 40 rows, the file is the whole frame's, byte for byte"
    with pytest.raises(ConfigurationError, match="stream_rows must be a positive number of rows"):
        spec(stream_rows=0)
