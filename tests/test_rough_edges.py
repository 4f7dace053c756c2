"""Rough edges outside the CLI (issue #19, item 6): settings as the README writes them, database drivers, a tenant's
zone typo, an unchanged restatement, the pointer's lock file, each with the behaviour users were promised."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from pipeline_helpers import failure_message, make_defs, published_dirs, read_export, run_partition, tick

from definitions import build_definitions
from export_ledger import SqlSource, cli
from export_ledger.dagster import LedgerResource
from export_ledger.destinations.local import LocalStore
from export_ledger.destinations.store import PreconditionFailed
from export_ledger.errors import ConfigurationError
from export_ledger.ledger import ExportLedger, ExportState, LedgerUnavailable, redact_url, upgrade_url
from resources.invoices import SampleInvoiceSource

KEY = "invoice_export/acme/2026-03-08T05:00:00Z"


# -- EXPORTS_LEDGER_URL as a plain path (the README's default, as its configuration table writes it) -----------------


@pytest.mark.parametrize("by_name", [True, False], ids=["process-environment", "given-environ"])
def test_a_plain_ledger_path_in_the_environment_materializes_into_that_sqlite_file(
    tmp_path, instance, monkeypatch, by_name
):
    monkeypatch.chdir(tmp_path)
    env = {
        "EXPORTS_SOURCE": "sample",
        "EXPORTS_LEDGER_URL": "./var/ledger.sqlite3",
        "EXPORTS_DESTINATION": str(tmp_path / "exports"),
    }
    if by_name:  # the process environment: the URL reaches the run as an EnvVar, unresolved until then
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        defs = build_definitions(tenants=["acme"], environ=None)
    else:
        defs = build_definitions(tenants=["acme"], environ=env)

    result = run_partition(defs, instance, "2026-03-08")

    assert result.success, failure_message(result)
    assert (tmp_path / "var" / "ledger.sqlite3").is_file(), "the plain path is a SQLite file in the working directory"
    record = ExportLedger(f"sqlite:///{tmp_path / 'var' / 'ledger.sqlite3'}").queries.get(KEY)
    assert record is not None and record.state is ExportState.COMPLETED
    assert [f.name for f in published_dirs(tmp_path / "exports")] == ["date=2026-03-08"]


def test_the_ledger_resource_opens_a_plain_path_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ledger = LedgerResource(url="data/ledger.sqlite3").get_ledger()
    assert ledger.dialect == "sqlite"
    assert (tmp_path / "data" / "ledger.sqlite3").is_file()


def test_redact_url_keeps_paths_readable_and_never_invents_a_url():
    assert redact_url("./var/ledger.sqlite3") == "./var/ledger.sqlite3"
    assert redact_url("/srv/ledger.sqlite3") == "/srv/ledger.sqlite3"
    broken = redact_url("postgresql://exporter:hunter2@db:notaport/exports")
    assert "hunter2" not in broken and broken.startswith("postgresql:"), broken
    assert "not a valid URL" in broken, "an unparsable URL says so instead of looking like a URL or a path"
    assert not broken.endswith(":..."), "no made-up ':...' suffix that reads like part of the address"


def test_an_unparsable_ledger_url_is_refused_naming_it_without_its_password(tmp_path):
    with pytest.raises(LedgerUnavailable) as refused:
        ExportLedger("postgresql://exporter:hunter2@db:notaport/exports")
    message = str(refused.value)
    assert "invalid ledger URL" in message and "hunter2" not in message, message


# -- PostgreSQL drivers ----------------------------------------------------------------------------------------------


def _without_driver(url: str) -> str:
    assert url.startswith("postgresql+psycopg2://"), url
    return "postgresql://" + url.removeprefix("postgresql+psycopg2://")


@pytest.mark.postgres
def test_a_plain_postgresql_ledger_url_opens_with_the_installed_driver(postgres_url):
    ledger = ExportLedger(_without_driver(postgres_url))
    assert ledger.dialect == "postgresql"
    assert ledger.queries.get(KEY) is None, "the ledger's tables were created and read through psycopg2"


@pytest.mark.postgres
def test_a_plain_postgresql_source_url_reads_with_the_installed_driver(postgres_url):
    import datetime as dt

    utc = dt.timezone.utc
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (tenant text, placed_at timestamptz, total float)"))
        conn.execute(sa.text("INSERT INTO orders VALUES ('acme', '2026-03-08 12:00:00+00', 1.5)"))
    engine.dispose()
    source = SqlSource(
        _without_driver(postgres_url),
        "SELECT * FROM orders WHERE tenant = :tenant AND placed_at >= :start AND placed_at < :end",
    )
    start, end = dt.datetime(2026, 3, 8, tzinfo=utc), dt.datetime(2026, 3, 9, tzinfo=utc)
    assert source.rows("acme", start, end)["total"].tolist() == [1.5]
    assert [len(batch) for batch in source.batches("acme", start, end, batch_rows=10)] == [1]


def test_a_named_driver_that_is_not_installed_is_refused_with_the_package_and_the_scheme_to_write():
    url = "postgresql+asyncpg://exporter:hunter2@127.0.0.1:1/exports"
    with pytest.raises(LedgerUnavailable) as refused:
        ExportLedger(url)
    message = str(refused.value)
    assert "asyncpg" in message and "pip install asyncpg" in message, message
    assert "postgresql+psycopg2://" in message and "hunter2" not in message, message
    assert "ModuleNotFoundError" not in message, message

    source = SqlSource(url, "SELECT 1 WHERE :tenant = :tenant AND :start < :end")
    import datetime as dt

    utc = dt.timezone.utc
    with pytest.raises(ConfigurationError, match=r"SqlSource URL .*pip install asyncpg"):
        source.rows("acme", dt.datetime(2026, 3, 8, tzinfo=utc), dt.datetime(2026, 3, 9, tzinfo=utc))


def test_a_sql_source_with_an_invalid_url_is_refused_where_it_is_declared():
    with pytest.raises(ConfigurationError, match="invalid SqlSource URL"):
        SqlSource("postgresql://u:p@h:notaport/db", "SELECT 1 WHERE :tenant = :tenant AND :start < :end")


# -- a tenant's zone typo --------------------------------------------------------------------------------------------


def test_a_tenant_zone_typo_is_refused_naming_the_tenant_the_zone_and_the_nearest_zone(tmp_path):
    with pytest.raises(ConfigurationError) as refused:
        build_definitions(
            tenants={"globex": "Europe/Dublin", "acme": "America/New_Yrok"},
            ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
            destination=str(tmp_path / "exports"),
            environ={"EXPORTS_SOURCE": "sample"},
        )
    message = str(refused.value)
    assert "tenant 'acme'" in message and "'America/New_Yrok'" in message, message
    assert "did you mean 'America/New_York'" in message, message
    assert "globex" not in message, "only the tenant whose zone is wrong is named"


# -- the pointer's lock files ------------------------------------------------------------------------------------------


def _lock_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.lock")) if root.exists() else []


def test_a_published_and_restated_key_leaves_no_lock_file_anywhere_under_the_destination(tmp_path, instance):
    assert run_partition(make_defs(tmp_path), instance, "2026-03-08").success
    ledger = ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    ledger.restatements.request(KEY, reason="late invoices", requested_by="ops")
    changed = make_defs(tmp_path, source=SampleInvoiceSource(cadence_minutes=30))  # other data: a real revision 2
    restated = run_partition(changed, instance, "2026-03-08")

    assert restated.success, failure_message(restated)
    assert read_export(published_dirs(tmp_path / "exports")[0])[0].revision == 2, "the pointer moved (twice written)"
    assert _lock_files(tmp_path / "exports") == [], "no lock outlives its use, in a key folder or beside them"


def test_a_lock_file_left_in_a_key_folder_by_an_earlier_release_goes_when_its_pointer_is_next_written(tmp_path):
    store = LocalStore(tmp_path)
    (tmp_path / "orders" / "tenant=acme" / "date=2026-03-08").mkdir(parents=True)
    legacy = tmp_path / "orders" / "tenant=acme" / "date=2026-03-08" / ".current.lock"
    legacy.write_bytes(b"")

    store.put_if_match("orders/tenant=acme/date=2026-03-08/_current.json", b"{}", None)

    assert not legacy.exists() and _lock_files(tmp_path) == []


def test_the_pointer_compare_and_swap_loses_no_update_while_lock_files_come_and_go(tmp_path):
    """Writers race read-modify-write on one object, each retrying a refused swap: every increment lands exactly once.
    A lock file removed under a waiting writer would let two writers swap from the same version (a lost update)."""
    store, name, writers, increments = LocalStore(tmp_path), "orders/tenant=acme/date=2026-03-08/_current.json", 4, 40
    store.put_if_match(name, b"0", None)

    def increment() -> int:
        refused = 0
        for _ in range(increments):
            while True:
                found = store.get(name)
                try:
                    store.put_if_match(name, str(int(found.data) + 1).encode(), found.tag)
                    break
                except PreconditionFailed:
                    refused += 1
        return refused

    with ThreadPoolExecutor(writers) as pool:
        refusals = sum(pool.map(lambda _: increment(), range(writers)))

    assert int(store.get(name).data) == writers * increments, f"lost updates ({refusals} swaps were refused)"
    assert _lock_files(tmp_path) == []


# -- a restatement whose data is the current revision's ---------------------------------------------------------------


def test_an_identical_restatement_is_closed_unchanged_visibly_and_never_launched_again(tmp_path, instance, capsys):
    defs = make_defs(tmp_path)
    assert run_partition(defs, instance, "2026-03-08").success
    ledger = ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    ledger.restatements.request(KEY, reason="check the billing fix", requested_by="ops")

    restated = run_partition(defs, instance, "2026-03-08")

    assert restated.success, failure_message(restated)
    (event,) = restated.get_asset_materialization_events()
    (row,) = event.materialization.metadata["key_table"].value.records
    assert (row.data["status"], row.data["revision"]) == ("unchanged", 1), "the run says what happened to the key"
    metadata = event.materialization.metadata
    assert (metadata["unchanged_keys"].value, metadata["exported_keys"].value, metadata["rows_exported"].value) == (
        1, 0, 0,
    ), "counted as unchanged, not as exported"  # fmt: skip
    (folder,) = published_dirs(tmp_path / "exports")
    assert read_export(folder)[0].revision == 1, "readers still get revision 1"
    assert sorted(p.name for p in folder.iterdir()) == ["_current.json", "r1-t1"], "no copy of it beside it"
    (request,) = ledger.restatements.requests(logical_keys=[KEY], open_only=False)
    assert request.outcome == "unchanged" and ledger.restatements.requests() == [], "closed, not left open"
    assert tick(defs, instance).result.run_requests in (None, []), "the reconciliation sensor launches nothing"
    assert cli.main(["--ledger-url", ledger.url, "revisions", KEY]) == 0
    out = capsys.readouterr().out
    assert "revision 2 not published: its data was identical to the current revision's" in out, out


def test_a_ledger_of_release_0_4_0_upgrades_to_record_unchanged_requests_and_keeps_its_indexes(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    shutil.copy(Path(__file__).parent / "data" / "ledger-0.4.0.sqlite3", path)
    url = f"sqlite:///{path}"
    assert upgrade_url(url) == [6, 7, 8, 9]
    insert = sa.text(
        "INSERT INTO export_restatements (logical_key, export, tenant, business_date, revision, reason, requested_by, "
        "requested_at, base_token, closed_at, outcome) VALUES (:k, 'invoice_export', 'acme', '2026-03-01', :r, 'x', "
        "'ops', '2026-03-21 00:00:00', 1, :closed, :outcome)"
    )
    key = "invoice_export/acme/2026-03-01T05:00:00Z"
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(insert, {"k": key, "r": 7, "closed": "2026-03-21 01:00:00", "outcome": "unchanged"})
            conn.execute(insert, {"k": key, "r": 8, "closed": None, "outcome": None})
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(insert, {"k": key, "r": 9, "closed": None, "outcome": None})  # a second open request
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(insert, {"k": key, "r": 10, "closed": "2026-03-21 01:00:00", "outcome": "forgotten"})
    finally:
        engine.dispose()
