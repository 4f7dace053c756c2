"""Database URLs as users write them (issue #19, item 6): ``EXPORTS_LEDGER_URL`` as a plain path (the README's default),
URLs redacted and refused without their password, and PostgreSQL URLs with or without a driver, for the ledger and
for a SQL source."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from builders import open_ledger
from pipeline_helpers import failure_message, published_dirs, run_partition

from definitions import build_definitions
from export_ledger import SqlSource
from export_ledger.dagster import LedgerResource
from export_ledger.errors import ConfigurationError
from export_ledger.ledger import ExportLedger, ExportState, LedgerUnavailable, redact_url

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
    record = open_ledger(f"sqlite:///{tmp_path / 'var' / 'ledger.sqlite3'}").queries.get(KEY)
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


@pytest.mark.parametrize(
    "url",
    [
        " postgresql://exporter:hunter2@db/exports",
        "postgresql://exporter@db/exports#password=hunter2",
        "postgresql://exporter:hun#ter2@db/exports",
        "postgresql://db/exports?sslmode=require#sslkey=hunter2&x=1",
    ],
    ids=["a leading space", "a secret in the fragment", "a '#' in the password", "a query and a secret fragment"],
)
def test_a_url_the_library_refuses_as_secret_is_never_printed_with_its_secret(url):
    """What holds_secret refuses, redact_url and redact_text must hide (the refusal quotes the URL redacted): a URL
    pasted with a leading space, a fragment named like a secret, a password holding '#'."""
    from export_ledger.dagster.definitions import ledgered_definitions
    from export_ledger.errors import redact_text
    from export_ledger.ledger.urls import holds_secret

    assert holds_secret(url), "judged to hold a secret"
    assert "hunter2" not in redact_url(url) and "ter2" not in redact_url(url), redact_url(url)
    assert "hunter2" not in redact_text(f"could not open {url} here"), redact_text(f"could not open {url} here")
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([], ledger=LedgerResource(url=url))
    assert "hunter2" not in str(refused.value) and "ter2" not in str(refused.value), str(refused.value)


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
