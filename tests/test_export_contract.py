"""Each key carries its export contract (issue #26): what a key's export *is* (its destination, file format, schema,
source and version, with its tenant's calendar) is recorded at the tenant's first claim and checked at every claim,
and every edge (a run worker, an operator command) acts from what the ledger recorded, never from its own environment.

Each test here failed on 8fa414b, where only the calendar was recorded: a worker that lost its source settings
exported the sample and recorded it completed, and operator commands acted on whatever folder their environment
named.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import sqlalchemy as sa
from builders import open_ledger
from pipeline_helpers import failure_message, ledger_at, make_defs, run_partition

from export_ledger import cli
from export_ledger.calendar import ExportCalendar, ZoneMove, window_for
from export_ledger.contract import calendar_of
from export_ledger.destinations import LocalDestination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ContractChanged, DestinationMoved, ExportLedger, ExportState, RestatementRefused
from export_ledger.reconcile import reconcile_batch
from export_ledger.spec import ExportSpec
from export_ledger.tenants import Tenant
from resources.invoices import SampleInvoiceSource, SqlInvoiceSource, invoices_table

KEY_7 = "invoice_export/acme/2026-03-07T05:00:00Z"
KEY_8 = "invoice_export/acme/2026-03-08T05:00:00Z"


def _sql_source(tmp_path: Path) -> SqlInvoiceSource:
    """An invoices table holding the sample's rows of March 2026 for acme: a real SQL source."""
    url = f"sqlite:///{tmp_path / 'source.sqlite3'}"
    engine = sa.create_engine(url)
    table = invoices_table()
    table.metadata.create_all(engine)
    start = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)
    rows = SampleInvoiceSource().rows("acme", start, start + dt.timedelta(days=14))
    with engine.begin() as conn:
        conn.execute(table.insert(), rows.to_dict("records"))
    engine.dispose()
    return SqlInvoiceSource(url=url, table="invoices")


def _refusals(tmp_path: Path) -> list[dict]:
    return ledger_at(tmp_path).contracts.refusals()


def test_a_worker_that_lost_its_source_settings_is_refused_not_exported_from_the_sample(tmp_path, instance, capsys):
    source = _sql_source(tmp_path)
    assert run_partition(make_defs(tmp_path, source=source), instance, "2026-03-07").success
    # What a run worker without EXPORTS_SOURCE_URL built on 8fa414b: the same code location on the sample source.
    lost = run_partition(make_defs(tmp_path, source=SampleInvoiceSource()), instance, "2026-03-08")

    assert not lost.success, "a worker whose source is not the recorded one must not export"
    message = failure_message(lost)
    assert "source sql (" in message and "-> sample" in message, f"the refusal says what changed:\n{message}"
    assert "table invoices" in message and "password" not in message
    ledger = ledger_at(tmp_path)
    assert ledger.queries.get(KEY_8) is None, "refused before any row: nothing exported, nothing recorded"
    assert not (tmp_path / "exports" / "invoice_export" / "tenant=acme" / "date=2026-03-08").exists()
    (refusal,) = _refusals(tmp_path)
    assert refusal["tenant"] == "acme" and json.loads(refusal["wanted"])["terms"]["source"]["kind"] == "sample", (
        "the refusal is kept, with both contracts, and escalated until accepted or the worker is fixed"
    )
    assert cli.main(["--ledger-url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}", "status", "--needs-attention"]) == 0
    listed = capsys.readouterr().out
    assert "-> sample" in listed and "accept-contract --export invoice_export --keep-exported" in listed, listed
    assert run_partition(make_defs(tmp_path, source=source), instance, "2026-03-08").success, (
        "the worker with its settings back runs, and closes the refusal"
    )
    assert _refusals(tmp_path) == []


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (dict(file_format="parquet"), "file format csv -> parquet"),
        (dict(version=2), "version None -> 2"),
        (
            dict(columns={"invoice_id": "string", "tenant": "string", "occurred_at": "timestamp"}),
            "columns dropped: amount",
        ),
        (
            dict(columns={"invoice_id": "string", "tenant": "string", "amount": "float", "occurred_at": "timestamp"}),
            "column order invoice_id, tenant, occurred_at, amount -> invoice_id, tenant, amount, occurred_at",
        ),
        (
            dict(columns={"invoice_id": "string", "tenant": "string", "occurred_at": "timestamp", "amount": "string"}),
            "column kinds changed: amount float -> string",
        ),
        (dict(id_columns=["invoice_id", "tenant"]), "id columns ['invoice_id'] -> ['invoice_id', 'tenant']"),
        (dict(destination_root="elsewhere"), "destination local"),
    ],
)
def test_a_claim_under_another_contract_is_refused_naming_what_changed(tmp_path, clocked_ledger, change, said):
    columns = {"invoice_id": "string", "tenant": "string", "occurred_at": "timestamp", "amount": "float"}
    base = dict(
        name="invoice_export", source=lambda tenant, start, end: None, columns=columns, id_columns=["invoice_id"],
        time_column="occurred_at", tenant_column="tenant", tenants=["acme"], timezone="America/New_York",
        start_date="2026-01-01",
    )  # fmt: skip
    here = LocalDestination(root=str(tmp_path / "exports"))
    ledger = clocked_ledger.get_ledger()
    first = ExportSpec(**base).contract("acme", here)
    ledger.claims.claim(_key(7), "run-1/x", contract=first)
    root = change.pop("destination_root", None)
    there = LocalDestination(root=str(tmp_path / root)) if root else here
    changed = ExportSpec(**{**base, **change}).contract("acme", there)

    with pytest.raises(ContractChanged) as refused:
        ledger.claims.claim(_key(8), "run-2/x", contract=changed)
    assert said in str(refused.value), str(refused.value)
    assert "export-ledger accept-contract --export invoice_export --keep-exported" in str(refused.value)
    assert ledger.queries.get(str(_key(8))) is None
    assert ledger.contracts.in_force("invoice_export", "acme") == first, "the contract in force is unchanged"


def test_accept_contract_keeps_or_restates_the_keys_already_exported(tmp_path, instance, capsys):
    assert run_partition(make_defs(tmp_path), instance, "2026-03-07").success
    parquet = make_defs(tmp_path, file_format="parquet")
    assert not run_partition(parquet, instance, "2026-03-08").success
    url = ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}"]
    accept = [*url, "accept-contract", "--export", "invoice_export", "--reason", "partners read Parquet now"]

    assert cli.main(accept) == 2, "the terms changed: the operator must say what becomes of the exported keys"
    assert "--keep-exported" in capsys.readouterr().err
    assert cli.main([*accept, "--restate-exported"]) == 0
    out = capsys.readouterr().out
    assert "file format csv -> parquet" in out and "restatements requested for 1 key(s)" in out
    ledger = ledger_at(tmp_path)
    assert [r.logical_key for r in ledger.restatements.requests(export="invoice_export")] == [KEY_7]
    entry = ledger.operators.entries()[-1]
    assert entry["action"] == "accept-contract" and "file format csv -> parquet" in entry["detail"], (
        "the acceptance is audited in the operator log"
    )
    assert run_partition(parquet, instance, "2026-03-08").success, "the new contract is in force"
    assert run_partition(parquet, instance, "2026-03-07").success, "the restatement publishes revision 2"
    assert ledger.restatements.current_revision(KEY_7).revision == 2
    assert ledger.restatements.current_revision(KEY_7).location.endswith("r2-t2")
    assert cli.main([*accept, "--keep-exported"]) == 1, "nothing is refused any more: nothing to accept"
    assert "no refused contract to accept" in capsys.readouterr().err


def test_a_new_destination_keeps_exported_keys_where_they_are_and_operator_commands_follow_them(
    tmp_path, instance, capsys, monkeypatch
):
    assert run_partition(make_defs(tmp_path), instance, "2026-03-07").success
    moved = make_defs(tmp_path, destination=str(tmp_path / "new-exports"))
    assert not run_partition(moved, instance, "2026-03-08").success
    url = ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}"]
    accept = [*url, "accept-contract", "--export", "invoice_export", "--reason", "moved to the new disk"]
    assert cli.main([*accept, "--restate-exported"]) == 2
    assert "keys already exported stay at local" in capsys.readouterr().err
    assert cli.main([*accept, "--keep-exported"]) == 0
    assert run_partition(moved, instance, "2026-03-08").success
    assert (tmp_path / "new-exports" / "invoice_export" / "tenant=acme" / "date=2026-03-08").is_dir()

    ledger = ledger_at(tmp_path)
    with pytest.raises(RestatementRefused, match="where its revisions stay"):
        ledger.restatements.request(KEY_7, reason="late invoices", requested_by="ops")
    assert cli.main([*url, "restate", KEY_7, "--reason", "late invoices"]) == 1
    assert "a restatement would publish its next revision at the new destination" in capsys.readouterr().err
    assert ledger.queries.get(KEY_7).state is ExportState.COMPLETED, "revision 1 stays current where it is"
    assert run_partition(moved, instance, "2026-03-07").success, "nothing to do for 2026-03-07: it is exported"


def _key(day: int) -> LogicalKey:
    return LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 3, day), "America/New_York"))


def _published_unrecorded(tmp_path: Path, instance, monkeypatch) -> ExportLedger:
    """acme's 2026-03-08 published at tmp_path/exports by an attempt that died before its ledger commit, its lease
    over: what reconciliation and operators meet after a lost worker."""
    defs = make_defs(tmp_path, lease_ttl_seconds=1)
    monkeypatch.setenv(FAILPOINTS, "before_commit=raise")
    assert not run_partition(defs, instance, "2026-03-08").success
    monkeypatch.delenv(FAILPOINTS)
    time.sleep(1.2)
    ledger = ledger_at(tmp_path)
    assert ledger.queries.get(KEY_8).state is ExportState.IN_PROGRESS
    return ledger


def test_reconcile_judges_a_key_where_its_contract_says_not_where_the_environment_points(
    tmp_path, instance, capsys, monkeypatch
):
    ledger = _published_unrecorded(tmp_path, instance, monkeypatch)
    other = tmp_path / "other-folder"
    url = ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}"]
    token = ledger.queries.get(KEY_8).fencing_token

    assert cli.main([*url, "reconcile", "--destination", str(other)]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and str((tmp_path / "exports").resolve()) in err, f"both are named: {err}"
    assert ledger.queries.get(KEY_8).fencing_token == token, "refused before the key was held"
    assert not other.exists(), "no fence written into the wrong folder"

    monkeypatch.setenv("EXPORTS_DESTINATION", str(other))  # an operator's shell pointing elsewhere
    assert cli.main([*url, "reconcile"]) == 0
    assert ledger.queries.get(KEY_8).state is ExportState.COMPLETED, "published at its real destination: recorded"
    assert not other.exists()


def test_resolve_discards_at_the_keys_destination_and_refuses_another(tmp_path, instance, capsys, monkeypatch):
    ledger = _published_unrecorded(tmp_path, instance, monkeypatch)
    other = tmp_path / "other-folder"
    url = ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}"]
    discard = [*url, "resolve", KEY_8, "--discard-destination", "--reason", "bad rows"]

    assert cli.main([*discard, "--destination", str(other)]) == 2
    assert "Leave --destination out" in capsys.readouterr().err
    assert ledger.queries.get(KEY_8).state is ExportState.IN_PROGRESS

    monkeypatch.setenv("EXPORTS_DESTINATION", str(other))
    assert cli.main(discard) == 0, capsys.readouterr().err
    assert ledger.queries.get(KEY_8).state is ExportState.FAILED
    key_folder = tmp_path / "exports" / "invoice_export" / "tenant=acme" / "date=2026-03-08"
    pointer = key_folder / "_current.json"
    assert not pointer.exists() or json.loads(pointer.read_text()).get("revision", 0) == 0, (
        "the export that was current at its real destination is discarded, not left current"
    )
    assert not other.exists()


def test_a_contract_recorded_before_terms_existed_gets_them_at_the_next_claim(tmp_path, clocked_ledger):
    ledger = clocked_ledger.get_ledger()
    spec = ExportSpec(
        name="invoice_export", source=lambda tenant, start, end: pd.DataFrame(), columns={"id": "string",
        "at": "timestamp"}, id_columns=["id"], time_column="at", tenants=["acme"], timezone="America/New_York",
        start_date="2026-01-01",
    )  # fmt: skip
    contract = spec.contract("acme", LocalDestination(root=str(tmp_path)))
    ledger.contracts.accept("invoice_export", calendar_of(contract), "what release 0.5 recorded")

    claim = ledger.claims.claim(_key(8), "run-1/x", contract=contract)

    assert claim.fencing_token == 1, "the same calendar: not refused"
    assert ledger.contracts.in_force("invoice_export", "acme") == contract
    assert ledger.contracts.history("invoice_export")[-1]["reason"] == (
        "terms recorded at the first claim that gave them"
    )
    other = spec.contract("acme", LocalDestination(root=str(tmp_path / "b")))
    with pytest.raises(ContractChanged, match="destination local"):
        ledger.claims.claim(_key(9), "run-2/x", contract=other)


def test_a_takeover_across_destinations_is_refused_until_the_key_is_settled_where_it_was_written(
    tmp_path, clocked_ledger, clock
):
    """A new destination is accepted while a key is in progress at the old one. Its takeover under the new contract
    would fence and publish at the new destination while the old one may hold its export: refused, naming both,
    until reconciliation settles it at the old one; then it is exported at the new one."""
    ledger = clocked_ledger.get_ledger()
    spec = ExportSpec(
        name="invoice_export", source=lambda tenant, start, end: pd.DataFrame(), columns={"id": "string",
        "at": "timestamp"}, id_columns=["id"], time_column="at", tenants=["acme"], timezone="America/New_York",
        start_date="2026-01-01",
    )  # fmt: skip
    old, new = LocalDestination(root=str(tmp_path / "a")), LocalDestination(root=str(tmp_path / "b"))
    ledger.claims.claim(_key(8), "run-1/x", contract=spec.contract("acme", old))  # then its worker is lost
    ledger.contracts.accept("invoice_export", spec.contract("acme", new), "moved", operator="ops", exported="keep")
    clock.advance(seconds=ledger.lease_ttl.total_seconds() + 1)

    with pytest.raises(DestinationMoved, match=r"publishes to local .*/a; this attempt publishes to local .*/b"):
        ledger.claims.claim(_key(8), "run-2/x", contract=spec.contract("acme", new))
    assert ledger.queries.get(str(_key(8))).lease_owner == "run-1/x", "left to reconciliation, at a"

    report = reconcile_batch(ledger, new, limit=10, after=None, reconciler="reconciler")
    (finding,) = report.findings
    assert finding.detail.startswith("nothing of revision 1 is published"), "judged at a, where it was claimed"
    assert not (tmp_path / "b").exists(), "nothing fenced at the new destination"
    assert ledger.claims.claim(_key(8), "run-3/x", contract=spec.contract("acme", new)).fencing_token == 3, (
        "settled as failed at a: nothing of it anywhere, so it is exported at b"
    )


@pytest.mark.postgres
def test_an_acceptance_waits_for_the_claims_in_flight_and_never_recuts_a_day_they_claimed(postgres_url, clock):
    """A claim decided on the old contract must not commit after an acceptance of the new one: a zone move accepted
    meanwhile would cut that day a second time. The claim holds the export's acceptance lock shared until it
    commits; the acceptance waits, then sees the day and refuses. The window is held open on PostgreSQL by a
    connection that keeps export_runs from being written."""
    ledger = open_ledger(postgres_url, clock=clock)
    new_york = ExportCalendar("America/New_York", "2026-01-01").contract()
    ledger.claims.claim(_key(8), "run-0/x", contract=new_york)  # the contract in force: New York
    moved = ExportCalendar("Europe/Dublin", "2026-01-01", (ZoneMove("2026-03-09", "America/New_York"),)).contract()
    engine = sa.create_engine(postgres_url)
    claimed, accepted = [], []

    def claim() -> None:
        claimed.append(ledger.claims.claim(_key(10), "run-1/x", contract=new_york))

    def accept() -> None:
        try:
            ledger.contracts.accept("invoice_export", moved, "moved", tenant="acme")
            accepted.append("accepted")
        except Exception as exc:  # noqa: BLE001 - the assertion below reads what it was
            accepted.append(f"{type(exc).__name__}: {exc}")

    with engine.connect() as blocker:
        blocker.execute(sa.text("LOCK TABLE export_runs IN SHARE MODE"))  # reads pass, the claim's insert waits
        claiming = threading.Thread(target=claim)
        claiming.start()
        _wait_for_lock_waits(engine, 1)
        accepting = threading.Thread(target=accept)
        accepting.start()
        _wait_for_lock_waits(engine, 1, "advisory", accepted)
        assert not accepted, f"the acceptance waits for the claim decided on the contract it replaces: {accepted}"
        blocker.rollback()
    claiming.join(timeout=30)
    accepting.join(timeout=30)
    assert claimed and claimed[0].fencing_token == 1
    assert accepted and "already has 2026-03-10 in America/New_York" in accepted[0], (
        "then it sees the day claimed in New York and refuses to re-cut it"
    )
    engine.dispose()


def _wait_for_lock_waits(engine: sa.Engine, count: int, event: str | None = None, seen: object = None) -> None:
    """Until ``count`` sessions wait on a lock (of kind ``event``, e.g. ``advisory``, when given)."""
    deadline = time.monotonic() + 30
    query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    if event is not None:
        query += f" AND wait_event = '{event}'"  # a constant of this test
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(sa.text(query)).scalar()
            conn.rollback()  # pg_stat_activity is read once per transaction: a new one sees the sessions as they are
            if waiting >= count:
                return
            time.sleep(0.05)
    raise AssertionError(f"{count} transaction(s) never waited on the held locks ({seen})")


def test_a_new_tenant_onboarded_by_a_worker_pointed_elsewhere_is_refused_like_the_others(tmp_path, instance):
    """The calendar is each tenant's own, the terms are the export's: a tenant's first claim under other terms is
    refused too, never recorded as the export's new terms (review of issue #26)."""
    assert run_partition(make_defs(tmp_path), instance, "2026-03-07").success
    elsewhere = run_partition(
        make_defs(tmp_path, tenants=("acme", "beta"), destination=str(tmp_path / "var-exports")), instance, "2026-03-08"
    )
    assert not elsewhere.success
    ledger = ledger_at(tmp_path)
    assert ledger.queries.records(tenant="beta") == [], "beta's first claim is refused: nothing exported"
    assert {r["tenant"] for r in ledger.contracts.refusals()} == {"acme", "beta"}
    assert not (tmp_path / "var-exports").exists()


def test_accepting_new_terms_records_them_for_every_tenant_of_every_zone(tmp_path, instance, capsys):
    zones = [Tenant("acme"), Tenant("dub", "Europe/Dublin")]
    assert run_partition(make_defs(tmp_path, tenants=zones), instance, "2026-03-07").success
    dublin = make_defs(tmp_path, tenants=zones).resolve_job_def("invoice_export__europe_dublin_job")
    assert dublin.execute_in_process(partition_key="2026-03-07", instance=instance).success
    parquet = make_defs(tmp_path, tenants=zones, file_format="parquet")
    assert not run_partition(parquet, instance, "2026-03-08").success  # the New York asset: acme refused
    url = ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}"]

    assert cli.main([*url, "accept-contract", "--export", "invoice_export", "--keep-exported", "--reason", "x"]) == 0
    ledger = ledger_at(tmp_path)
    terms = {t: ledger.contracts.in_force("invoice_export", t)["terms"]["file_format"] for t in ("acme", "dub")}
    assert terms == {"acme": "parquet", "dub": "parquet"}, "dub was never refused, and has the export's terms too"
    job = parquet.resolve_job_def("invoice_export__europe_dublin_job")
    assert job.execute_in_process(partition_key="2026-03-08", instance=instance).success


def test_a_calendar_accepted_alone_never_closes_a_refusal_of_new_terms(tmp_path, instance, capsys):
    assert run_partition(make_defs(tmp_path), instance, "2026-03-07").success
    assert not run_partition(make_defs(tmp_path, file_format="parquet"), instance, "2026-03-08").success
    url = ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}"]
    calendar = ["--timezone", "America/New_York", "--start-date", "2026-01-01", "--reason", "x"]

    assert cli.main([*url, "accept-contract", "--export", "invoice_export", *calendar]) == 1
    assert "also change its terms (file format csv -> parquet)" in capsys.readouterr().err
    assert [r["tenant"] for r in ledger_at(tmp_path).contracts.refusals()] == ["acme"], "still escalated"


def test_a_key_claimed_before_release_0_6_records_no_destination_whatever_came_after(tmp_path, clocked_ledger):
    """A key claimed with no contract (as release 0.5 did) is placed by --destination or EXPORTS_DESTINATION, never
    by the terms a later claim recorded for its tenant (review of issue #26)."""
    ledger = clocked_ledger.get_ledger()
    legacy = ledger.claims.claim(_key(7), "run-0/x")  # no contract: what an older release recorded
    spec = ExportSpec(
        name="invoice_export", source=lambda tenant, start, end: pd.DataFrame(), columns={"id": "string",
        "at": "timestamp"}, id_columns=["id"], time_column="at", tenants=["acme"], timezone="America/New_York",
        start_date="2026-01-01",
    )  # fmt: skip
    ledger.claims.claim(_key(8), "run-1/x", contract=spec.contract("acme", LocalDestination(root=str(tmp_path / "n"))))

    places = ledger.contracts.of_keys([ledger.queries.get(legacy.logical_key), ledger.queries.get(str(_key(8)))])
    assert places[legacy.logical_key] is None, "no recorded destination: the operator's --destination answers"
    assert places[str(_key(8))]["terms"]["destination"]["root"].endswith("/n")


@pytest.mark.parametrize(
    ("first", "second", "same"),
    [
        ("postgresql+psycopg2://app:secret@db.example/prod", "postgresql+psycopg2://app@db.example/prod", True),
        ("postgresql://app_v1@db.example/prod", "postgresql://app_v2@db.example/prod?sslmode=require", True),
        ("postgresql://db.example/prod", "postgresql+psycopg2://db.example/prod", True),
        ("postgresql://db.example/prod", "postgresql://db.example/staging", False),
        ("postgresql://db-a.example/prod", "postgresql://db-b.example/prod", False),
    ],
)
def test_a_sql_sources_identity_is_its_database_not_its_user_password_or_driver(first, second, same):
    from export_ledger.sources import url_identity

    assert (url_identity(first) == url_identity(second)) is same
    assert "app" not in url_identity(first) and "secret" not in url_identity(first)


def test_a_keyword_connection_string_is_refused_without_echo_where_the_source_is_declared():
    from export_ledger.errors import ConfigurationError
    from export_ledger.sources import SqlSource

    with pytest.raises(ConfigurationError) as refused:
        SqlSource("host=db.example password=s3cret dbname=prod", "SELECT 1 WHERE :tenant :start :end")
    assert "key=value connection string" in str(refused.value) and "s3cret" not in str(refused.value)


def test_sources_and_tables_named_relatively_are_recorded_absolutely(tmp_path, monkeypatch):
    import functools

    from export_ledger.destinations.delta import DeltaDestination
    from export_ledger.sources import CallableSource, url_identity

    monkeypatch.chdir(tmp_path)
    assert url_identity("sqlite:///./src.db") == f"sqlite:///{tmp_path.resolve() / 'src.db'}"
    assert DeltaDestination(table="./tables/{export}").identity("orders")["root"] == (
        f"delta:{tmp_path.resolve() / 'tables' / 'orders'}"
    )

    def read(tenant, start, end, table):
        return pd.DataFrame()

    a, b = (CallableSource(functools.partial(read, table=name)).identity() for name in ("a", "b"))
    assert a != b, "a partial reading another table is another source"
