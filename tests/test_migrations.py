"""Schema upgrades through alembic: one revision per version, an explicit upgrade, and a read-open that never writes.

``tests/data/ledger-0.4.0.sqlite3`` was written by release 0.4.0 (commit 07f55b3, schema 5): completed, failed (with an
operator's resolution after three claims), remote_unknown and restated keys, an open request and a tenant contract.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa
from builders import key_for

from export_ledger.cli import main
from export_ledger.ledger import (
    SCHEMA_VERSION,
    ExportLedger,
    ExportState,
    LedgerUnavailable,
    SchemaOutdated,
    dispose_engines,
    schema_version,
    upgrade,
    upgrade_url,
)
from export_ledger.ledger.migrations.versions import stamp  # noqa: F401  (the revisions import it)
from export_ledger.ledger.store import MIGRATIONS, VERSION_TABLE

FIXTURE = Path(__file__).parent / "data" / "ledger-0.4.0.sqlite3"
UTC = dt.timezone.utc


@pytest.fixture
def ledger_040(tmp_path) -> str:
    path = tmp_path / "ledger.sqlite3"
    shutil.copy(FIXTURE, path)
    yield f"sqlite:///{path}"
    dispose_engines()


def _digest(url: str) -> str:
    return hashlib.sha256(Path(url.removeprefix("sqlite:///")).read_bytes()).hexdigest()


def test_an_empty_database_is_created_at_the_newest_version_and_stamped(tmp_path):
    url = f"sqlite:///{tmp_path / 'new.sqlite3'}"
    ledger = ExportLedger(url)
    assert ledger.schema_version == SCHEMA_VERSION
    with ledger.atomic(read_only=True) as conn:
        assert schema_version(conn) == SCHEMA_VERSION
        stamped = conn.execute(sa.select(sa.column("version_num")).select_from(sa.table(VERSION_TABLE))).scalar()
    assert stamped == f"v{SCHEMA_VERSION}", "an alembic revision is recorded, in a table of the ledger's own name"


def test_one_alembic_revision_per_schema_version():
    names = sorted(p.stem.split("_", 1)[0] for p in (MIGRATIONS / "versions").glob("v*.py"))
    assert names == [f"v{n}" for n in range(1, SCHEMA_VERSION + 1)]


def test_a_ledger_of_release_0_4_0_reads_as_it_is_and_the_read_changes_no_byte(ledger_040):
    before = _digest(ledger_040)
    reader = ExportLedger(ledger_040, read_only=True)
    assert reader.schema_version == 5
    states = {r.logical_key.split("/", 1)[1]: r.state for r in reader.queries.records()}
    assert states["acme/2026-03-02T05:00:00Z"] is ExportState.FAILED
    assert [r.revision for r in reader.restatements.revisions("invoice_export/globex/2026-03-01T05:00:00Z")] == [1, 2]
    assert reader.attention.needs_attention(dt.timedelta(hours=6), limit=10) is not None
    dispose_engines()
    assert _digest(ledger_040) == before, "a read-open never writes"


def test_a_write_open_of_an_older_schema_is_refused_naming_the_explicit_upgrade(ledger_040):
    with pytest.raises(SchemaOutdated, match="export-ledger upgrade"):
        ExportLedger(ledger_040)


def test_the_explicit_upgrade_brings_0_4_0_to_the_newest_version_and_counts_claims_since_each_resolution(ledger_040):
    assert upgrade_url(ledger_040) == [6, 7, 8, 9]
    ledger = ExportLedger(ledger_040)
    counts = {r.logical_key.split("/", 1)[1]: (r.fencing_token, r.claim_count) for r in ledger.queries.records()}
    assert counts["acme/2026-03-02T05:00:00Z"] == (4, 0), "three claims, then an operator restored the reruns"
    assert counts["acme/2026-03-01T05:00:00Z"] == (1, 1)
    assert counts["globex/2026-03-02T05:00:00Z"] == (1, 0), "an open restatement request restarts the count"
    with ledger.atomic(read_only=True) as conn:
        history = conn.execute(sa.text("SELECT version, note FROM export_ledger_schema ORDER BY version")).all()
    assert [v for v, _ in history] == [5, 6, 7, 8, 9] and history[1][1] == "upgraded from 5"
    assert upgrade_url(ledger_040) == [], "upgrading again does nothing"


def test_after_the_upgrade_revision_numbers_are_never_reused(ledger_040):
    upgrade_url(ledger_040)
    ledger = ExportLedger(ledger_040, clock=lambda: dt.datetime(2026, 3, 21, tzinfo=UTC))
    request = ledger.restatements.request(
        "invoice_export/globex/2026-03-01T05:00:00Z", reason="again", requested_by="ops"
    )
    assert request.revision == 3
    with ledger.atomic() as conn, pytest.raises(sa.exc.IntegrityError):
        conn.execute(
            sa.text(
                "INSERT INTO export_restatements (logical_key, export, tenant, business_date, revision, reason, "
                "requested_by, requested_at, base_token, closed_at, outcome) VALUES (:k, 'invoice_export', 'globex', "
                "'2026-03-01', 2, 'r', 'ops', '2026-03-21 00:00:00', 1, '2026-03-21 00:00:00', 'published')"
            ),
            {"k": "invoice_export/globex/2026-03-01T05:00:00Z"},
        )  # the database holds it too: one published (or open) request per revision number


def test_a_0_4_0_ledger_that_withdrew_a_request_and_asked_again_upgrades(tmp_path):
    """0.4.0 gave a request after a withdrawn one the same revision number; the upgrade keeps both rows as recorded
    (the unique index covers open and published requests), and the next request gets a number never given."""
    url = f"sqlite:///{tmp_path / 'reused.sqlite3'}"
    shutil.copy(FIXTURE, tmp_path / "reused.sqlite3")
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # the rows 0.4.0's withdraw-then-request left: two requests for revision 2
        conn.execute(
            sa.text(
                "INSERT INTO export_restatements (logical_key, export, tenant, business_date, revision, reason, "
                "requested_by, requested_at, base_token, closed_at, outcome) VALUES (:k, 'invoice_export', 'globex', "
                "'2026-03-02', 2, 'first try', 'ops', '2026-03-19 00:00:00', 1, '2026-03-19 01:00:00', 'withdrawn')"
            ),
            {"k": "invoice_export/globex/2026-03-02T05:00:00Z"},
        )
    engine.dispose()
    assert upgrade_url(url) == [6, 7, 8, 9]
    ledger = ExportLedger(url, clock=lambda: dt.datetime(2026, 3, 21, tzinfo=UTC))
    revisions = [r.revision for r in ledger.restatements.requests(open_only=False)
                 if r.logical_key == "invoice_export/globex/2026-03-02T05:00:00Z"]  # fmt: skip
    assert sorted(revisions) == [2, 2], "both rows kept as 0.4.0 recorded them"
    dispose_engines()


def test_export_ledger_upgrade_is_the_one_command_that_changes_the_schema(ledger_040, capsys):
    assert main(["status", "--ledger-url", ledger_040]) == 0, "status reads an older ledger"
    assert main(["upgrade", "--ledger-url", ledger_040]) == 0
    assert "upgraded the ledger's schema to version 9" in capsys.readouterr().out
    assert main(["upgrade", "--ledger-url", ledger_040]) == 0
    assert "current" in capsys.readouterr().out


def test_a_read_open_of_a_database_without_a_ledger_creates_nothing(ledger_url):
    with pytest.raises(LedgerUnavailable, match="holds no export ledger"):
        ExportLedger(ledger_url, read_only=True)
    engine = sa.create_engine(ledger_url)
    try:
        assert sa.inspect(engine).get_table_names() == [], "a read never creates a table, on any backend"
    finally:
        engine.dispose()


def _v1_schema(conn) -> None:
    """The tables of release 0.1.0, as they were (schema version 1: no version table)."""
    metadata = sa.MetaData()
    sa.Table(
        "export_runs", metadata,
        sa.Column("logical_key", sa.String(300), primary_key=True), sa.Column("export", sa.String(63)),
        sa.Column("tenant", sa.String(63)), sa.Column("business_date", sa.Date), sa.Column("timezone", sa.String(64)),
        sa.Column("window_start_utc", sa.DateTime(timezone=True)),
        sa.Column("window_end_utc", sa.DateTime(timezone=True)),
        sa.Column("tz_database", sa.String(64)), sa.Column("state", sa.String(20)),
        sa.Column("location", sa.String(1024)), sa.Column("sha256", sa.String(64)),
        sa.Column("row_count", sa.BigInteger),
        sa.Column("committed_attempt", sa.String(300)), sa.Column("lease_owner", sa.String(300)),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True)),
        sa.Column("attempt_started_at", sa.DateTime(timezone=True)),
        sa.Column("fencing_token", sa.BigInteger), sa.Column("created_at", sa.DateTime(timezone=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True)),
    )  # fmt: skip
    sa.Table(
        "export_attempts", metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True), sa.Column("attempt_id", sa.String(300)),
        sa.Column("logical_key", sa.String(300)), sa.Column("fencing_token", sa.BigInteger),
        sa.Column("started_at", sa.DateTime(timezone=True)), sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column("outcome", sa.String(20)), sa.Column("error_class", sa.String(200)),
        sa.Column("error_message", sa.String(500)),
    )  # fmt: skip
    sa.Table(
        "export_low_water", metadata, sa.Column("export", sa.String(63), primary_key=True),
        sa.Column("low_water_date", sa.Date), sa.Column("pruned_total", sa.BigInteger),
        sa.Column("updated_at", sa.DateTime(timezone=True)),
    )  # fmt: skip
    sa.Table(
        "export_contracts", metadata, sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("export", sa.String(63)), sa.Column("contract", sa.Text),
        sa.Column("recorded_at", sa.DateTime(timezone=True)), sa.Column("reason", sa.String(500)),
    )  # fmt: skip
    metadata.create_all(conn)
    conn.execute(
        sa.text(
            "INSERT INTO export_runs VALUES ('invoice_export/acme/2026-03-08T05:00:00Z', 'invoice_export', 'acme', "
            "'2026-03-08', 'America/New_York', :s, :e, 'system 2025b', 'failed', NULL, NULL, NULL, NULL, NULL, NULL, "
            "NULL, 2, :s, :e)"
        ),
        {"s": dt.datetime(2026, 3, 8, 5, tzinfo=UTC).replace(tzinfo=None), "e": dt.datetime(2026, 3, 9, 4)},
    )


def test_a_version_1_ledger_upgrades_through_every_revision_on_each_backend(ledger_url):
    engine = sa.create_engine(ledger_url)
    try:
        with engine.begin() as conn:
            _v1_schema(conn)
        assert schema_version(engine) == 1
    finally:
        engine.dispose()
    assert upgrade_url(ledger_url) == [2, 3, 4, 5, 6, 7, 8, 9]
    ledger = ExportLedger(ledger_url, clock=lambda: dt.datetime(2026, 3, 20, tzinfo=UTC))
    (record,) = ledger.queries.records()
    assert (record.state, record.fencing_token, record.claim_count) == (ExportState.FAILED, 2, 2)
    claim = ledger.claims.claim(key_for(), "retry/invoice_export")
    assert claim.fencing_token == 3, "the upgraded ledger claims as any other"


def test_upgrade_is_refused_for_a_ledger_newer_than_this_release(tmp_path):
    url = f"sqlite:///{tmp_path / 'newer.sqlite3'}"
    ExportLedger(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = 'v99'"))  # a constant table name
    engine.dispose()
    dispose_engines()
    with pytest.raises(LedgerUnavailable, match="newer than this release"):
        ExportLedger(url)
    assert upgrade(sa.create_engine(url)) == [], "an upgrade never goes back"


def test_a_ledger_of_release_0_4_0_is_read_by_tenant_and_a_typo_is_named(ledger_040, capsys):
    """The tenant check reads only the tables this schema has (no refusals before version 6, no contract tenants
    before 9): status --tenant on an older ledger lists the tenant's keys, and a typo lists the known tenants."""
    from export_ledger import cli

    before = _digest(ledger_040)
    assert cli.main(["--ledger-url", ledger_040, "status", "--tenant", "acme", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed and {item["tenant"] for item in listed} == {"acme"}
    assert cli.main(["--ledger-url", ledger_040, "status", "--tenant", "acmee"]) == 1
    assert "the ledger knows no tenant 'acmee' (known: acme, globex" in capsys.readouterr().err
    dispose_engines()
    assert _digest(ledger_040) == before, "a read-open never writes"


# -- a ledger of release 0.4.0 records unchanged requests --------------------------------------------------------------


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
