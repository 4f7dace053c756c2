"""The export pipeline through Dagster's public testing APIs: materialize partitions and ranges, inject failures."""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pandas as pd
import pytest
from object_buckets import KINDS, delta_destination, object_destination
from pipeline_helpers import (
    check_evaluations,
    completed_without_export,
    failure_message,
    key_rows,
    ledger_at,
    make_defs,
    places,
    published_dirs,
    read_export,
    run_partition,
    run_range,
    tick,
)
from warehouse_fixtures import WAREHOUSE_KINDS, warehouse_destination

from export_ledger.calendar import ExportWindow, window_for
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.keys import LogicalKey
from export_ledger.ledger.schema import AttemptOutcome, ExportState
from resources.invoices import SampleInvoiceSource

UTC = dt.timezone.utc


def test_materializing_a_partition_twice_publishes_one_export_and_records_two_attempts(tmp_path, instance):
    defs = make_defs(tmp_path)

    first = run_partition(defs, instance, "2026-03-08")
    second = run_partition(defs, instance, "2026-03-08")

    assert first.success and second.success
    folders = published_dirs(tmp_path / "exports")
    assert [f.name for f in folders] == ["date=2026-03-08"], "one published export for one logical key"
    ledger = ledger_at(tmp_path)
    key = "invoice_export/acme/2026-03-08T05:00:00Z"
    assert ledger.queries.get(key).state is ExportState.COMPLETED
    outcomes = [a.outcome for a in ledger.queries.attempts(key)]
    assert outcomes == [AttemptOutcome.COMPLETED, AttemptOutcome.ALREADY_COMPLETED]
    second_meta = second.get_asset_materialization_events()[0].materialization.metadata
    assert [(r["tenant"], r["status"]) for r in key_rows(second_meta)] == [("acme", "already_completed")]
    assert second_meta["skipped_keys"].value == 1 and second_meta["exported_keys"].value == 0


def test_a_second_window_is_a_distinct_export(tmp_path, instance):
    defs = make_defs(tmp_path)
    assert run_partition(defs, instance, "2026-03-08").success
    assert run_partition(defs, instance, "2026-03-09").success

    folders = published_dirs(tmp_path / "exports")
    assert [f.name for f in folders] == ["date=2026-03-08", "date=2026-03-09"]
    (m1, f1), (m2, f2) = (read_export(f) for f in folders)
    assert m1.logical_key != m2.logical_key
    assert m1.window_end_utc == m2.window_start_utc, "neighbouring windows touch"
    assert set(f1["invoice_id"]).isdisjoint(f2["invoice_id"])


def test_export_holds_exactly_the_window_events_with_manifest_and_metadata(tmp_path, instance):
    defs = make_defs(tmp_path, tenants=["acme", "globex"])
    result = run_partition(defs, instance, "2026-03-08")
    assert result.success

    window = window_for(dt.date(2026, 3, 8), "America/New_York")
    source = SampleInvoiceSource()
    for folder in published_dirs(tmp_path / "exports"):
        manifest, frame = read_export(folder)
        tenant = manifest.tenant
        expected = source.rows(tenant, window.start_utc, window.end_utc)
        assert list(frame["invoice_id"]) == list(expected["invoice_id"])
        assert manifest.row_count == len(expected) == 92, "a 23-hour day at one event per 15 minutes"
        assert (manifest.window_start_utc, manifest.window_end_utc) == ("2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z")
        assert manifest.timezone == "America/New_York" and manifest.business_date == "2026-03-08"
        assert manifest.fencing_token == 1 and manifest.attempt_id.startswith(result.run_id)
        assert manifest.tz_database

    (materialization,) = [e.materialization for e in result.get_asset_materialization_events()]
    meta = materialization.metadata
    assert materialization.partition == "2026-03-08"
    assert meta["window_start_utc"].value == "2026-03-08T05:00:00Z"
    assert meta["timezone"].value == "America/New_York"
    # The sources are read after each key's claim, so the rows are counted where they were exported.
    assert meta["rows_exported"].value == 2 * 92, "every row of both tenants' windows exported"
    ledger = ledger_at(tmp_path)
    assert {r.tenant: r.row_count for r in ledger.queries.records()} == {"acme": 92, "globex": 92}
    rows = key_rows(meta)
    assert {r["tenant"]: r["rows"] for r in rows} == {"acme": 92, "globex": 92}
    assert all(len(r["sha256"]) == 16 and r["location"] for r in rows)
    assert meta["dagster/row_count"].value == 2 * 92
    assert meta["attempt_id"].value.startswith(result.run_id)
    assert list(meta)[:3] == ["business_date", "timezone", "window_start_utc"], "the window and zone come first"
    checks = check_evaluations(result, "partition_health")
    assert set(checks) == {"2026-03-08"}, checks
    health = checks["2026-03-08"]
    assert health.passed and health.metadata["status"].value == "healthy"
    assert health.metadata["verified_at_destination"].value == 2, "both keys verified where they landed"


def test_parquet_exports_round_trip(tmp_path, instance):
    defs = make_defs(tmp_path, file_format="parquet")
    assert run_partition(defs, instance, "2026-03-08").success
    (folder,) = published_dirs(tmp_path / "exports")
    manifest, frame = read_export(folder)
    assert manifest.data_file == "data.parquet" and len(frame) == manifest.row_count == 92


@pytest.mark.parametrize("point", ["after_claim", "after_stage"])
def test_failure_before_publish_leaves_nothing_and_the_retry_exports_once(tmp_path, instance, monkeypatch, point):
    defs = make_defs(tmp_path)
    monkeypatch.setenv(FAILPOINTS, f"{point}=raise")
    failed = run_partition(defs, instance, "2026-03-08")
    assert not failed.success and f"injected failure at {point}" in failure_message(failed)
    assert published_dirs(tmp_path / "exports") == [], "nothing of a failed attempt is visible"
    staged = [p.name for p in places(tmp_path / "exports")]
    assert staged == ([] if point == "after_claim" else ["r1-t1"]), "at most the attempt's own place, uncommitted"
    ledger = ledger_at(tmp_path)
    (record,) = ledger.queries.records()
    assert record.state is ExportState.FAILED

    monkeypatch.delenv(FAILPOINTS)
    assert run_partition(defs, instance, "2026-03-08").success
    assert len(published_dirs(tmp_path / "exports")) == 1
    assert [p.name for p in places(tmp_path / "exports")] == ["r1-t2"], "the retry swept the failed attempt's place"
    assert ledger.queries.get(record.logical_key).state is ExportState.COMPLETED
    assert completed_without_export(ledger) == []


def test_failure_after_publish_is_repaired_from_the_manifest_without_a_second_copy(tmp_path, instance, monkeypatch):
    defs = make_defs(tmp_path)
    monkeypatch.setenv(FAILPOINTS, "after_publish=raise")
    failed = run_partition(defs, instance, "2026-03-08")
    assert not failed.success
    (folder,) = published_dirs(tmp_path / "exports")
    first_manifest, _ = read_export(folder)
    ledger = ledger_at(tmp_path)
    (record,) = ledger.queries.records()
    # Published, so not `failed` (which means nothing was published): reconciliation records it from the manifest.
    assert record.state is ExportState.REMOTE_UNKNOWN, "not completed: the ledger never recorded the publish"
    assert completed_without_export(ledger) == []

    monkeypatch.delenv(FAILPOINTS)
    tick(defs, instance)
    (folder_after,) = published_dirs(tmp_path / "exports")
    manifest_after, _ = read_export(folder_after)
    assert manifest_after == first_manifest, "reconciliation recorded the first publish instead of writing another"
    record = ledger.queries.get(record.logical_key)
    assert record.state is ExportState.COMPLETED
    assert record.committed_attempt == first_manifest.attempt_id
    outcomes = [a.outcome for a in ledger.queries.attempts(record.logical_key)]
    assert outcomes == [AttemptOutcome.REMOTE_UNKNOWN, AttemptOutcome.REPAIRED]
    assert run_partition(defs, instance, "2026-03-08").success, "a rerun then skips the completed key"


def test_crash_before_the_ledger_commit_keeps_the_lease_until_it_expires_then_repairs(
    tmp_path, instance, monkeypatch, clocked_ledger, clock
):
    defs = make_defs(tmp_path, ledger=clocked_ledger)
    monkeypatch.setenv(FAILPOINTS, "before_commit=raise")
    assert not run_partition(defs, instance, "2026-03-08").success
    monkeypatch.delenv(FAILPOINTS)
    ledger = clocked_ledger.get_ledger()
    (record,) = ledger.queries.records()
    assert record.state is ExportState.IN_PROGRESS, "a dead attempt is not known to be dead until its lease expires"
    assert len(published_dirs(tmp_path / "exports")) == 1

    refused = run_partition(defs, instance, "2026-03-08")
    assert not refused.success
    assert f"is being exported by attempt {record.lease_owner}" in failure_message(refused)

    clock.advance(seconds=clocked_ledger.lease_ttl_seconds + 1)
    assert run_partition(defs, instance, "2026-03-08").success
    assert len(published_dirs(tmp_path / "exports")) == 1, "never a second published copy"
    outcomes = [a.outcome for a in ledger.queries.attempts(record.logical_key)]
    assert outcomes == [AttemptOutcome.REFUSED, AttemptOutcome.ABANDONED, AttemptOutcome.REPAIRED]
    assert completed_without_export(ledger) == []


def test_retry_the_next_morning_exports_the_originally_scheduled_window(
    tmp_path, instance, monkeypatch, clocked_ledger, clock
):
    defs = make_defs(tmp_path, ledger=clocked_ledger)
    monkeypatch.setenv(FAILPOINTS, "after_stage=raise")
    assert not run_partition(defs, instance, "2026-03-08").success
    monkeypatch.delenv(FAILPOINTS)

    clock.advance(days=1)
    assert run_partition(defs, instance, "2026-03-08").success

    (folder,) = published_dirs(tmp_path / "exports")
    manifest, frame = read_export(folder)
    assert manifest.business_date == "2026-03-08"
    assert (manifest.window_start_utc, manifest.window_end_utc) == ("2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z")
    assert frame["occurred_at"].min() >= pd.Timestamp("2026-03-08T05:00:00Z")
    assert frame["occurred_at"].max() < pd.Timestamp("2026-03-09T04:00:00Z")


def test_the_window_recorded_at_the_first_claim_wins_over_todays_calculation(tmp_path, instance):
    # Stands for a tz database update between two attempts: the first claim recorded a window an hour later.
    defs = make_defs(tmp_path)
    computed = window_for(dt.date(2026, 3, 8), "America/New_York")
    recorded = ExportWindow(
        computed.business_date,
        computed.timezone,
        computed.start_utc + dt.timedelta(hours=1),
        computed.end_utc + dt.timedelta(hours=1),
    )
    ledger = ledger_at(tmp_path)
    claim = ledger.claims.claim(LogicalKey("invoice_export", "acme", recorded), "earlier-run/invoice_export")
    ledger.completions.fail(claim, RuntimeError("worker lost"))

    assert run_partition(defs, instance, "2026-03-08").success
    (folder,) = published_dirs(tmp_path / "exports")
    manifest, frame = read_export(folder)
    assert manifest.window_start_utc == "2026-03-08T06:00:00Z"
    assert frame["occurred_at"].min() == pd.Timestamp("2026-03-08T06:00:00Z")


def test_single_run_backfill_of_31_partitions_and_3_tenants_commits_93_keys(tmp_path, instance):
    defs = make_defs(tmp_path, tenants=["acme", "globex", "initech"], max_partitions_per_run=None)
    result = run_range(defs, instance, "2026-01-01", "2026-01-31")
    assert result.success, failure_message(result)
    ledger = ledger_at(tmp_path)
    records = ledger.queries.records(states=[ExportState.COMPLETED])
    assert len(records) == 93
    assert len({r.logical_key for r in records}) == 93
    assert len(published_dirs(tmp_path / "exports")) == 93
    events = result.get_asset_materialization_events()
    assert len({e.materialization.partition for e in events}) == 31
    for event in events:  # each partition's own counts, never the run's
        assert event.materialization.metadata["keys"].value == 3
        assert {r["tenant"] for r in key_rows(event.materialization.metadata)} == {"acme", "globex", "initech"}
    checks = check_evaluations(result, "partition_health")
    assert len(checks) == 31
    assert all(c.passed and c.metadata["verified_at_destination"].value == 3 for c in checks.values())


@pytest.mark.parametrize(
    ("zone", "first", "last"),
    [
        ("America/New_York", "2026-03-06", "2026-03-10"),
        ("America/New_York", "2026-10-30", "2026-11-03"),
        ("Europe/Dublin", "2026-03-27", "2026-03-31"),
        ("Europe/Dublin", "2026-10-23", "2026-10-27"),
        ("Australia/Lord_Howe", "2026-04-03", "2026-04-07"),
        ("Australia/Lord_Howe", "2026-10-02", "2026-10-06"),
        ("America/Havana", "2026-03-06", "2026-03-10"),
        ("America/Havana", "2026-10-30", "2026-11-03"),
        ("America/Santiago", "2026-04-03", "2026-04-07"),
        ("America/Santiago", "2026-09-04", "2026-09-08"),
    ],
)
def test_dst_partitions_export_each_event_exactly_once(tmp_path, instance, zone, first, last):
    defs = make_defs(tmp_path, timezone=zone, max_partitions_per_run=None)
    result = run_range(defs, instance, first, last)
    assert result.success, failure_message(result)

    windows = {}
    exported = []
    for folder in published_dirs(tmp_path / "exports"):
        manifest, frame = read_export(folder)
        window = window_for(dt.date.fromisoformat(manifest.business_date), zone)
        windows[manifest.business_date] = window
        assert frame["occurred_at"].between(window.start_utc, window.end_utc, inclusive="left").all()
        exported.extend(frame["invoice_id"])
    assert len(windows) == 5
    span = sorted(windows.values(), key=lambda w: w.start_utc)
    expected = SampleInvoiceSource().rows("acme", span[0].start_utc, span[-1].end_utc)
    assert len(exported) == len(set(exported)), "no event exported twice"
    assert set(exported) == set(expected["invoice_id"]), "every event in the span exported"
    assert any(w.duration != dt.timedelta(hours=24) for w in windows.values()), "the span crosses a transition"


def _with_downstream(defs: dg.Definitions) -> tuple[dg.Definitions, list]:
    seen = []
    (export_asset,) = defs.assets

    @dg.asset(partitions_def=export_asset.partitions_def, ins={"invoice_export": dg.AssetIn()})
    def invoice_rows(invoice_export: pd.DataFrame) -> None:
        seen.append(invoice_export)

    return dg.Definitions(assets=[export_asset, invoice_rows], resources=defs.resources), seen


def _load(defs: dg.Definitions, instance, partition_key: str, **kwargs) -> tuple[dg.ExecuteInProcessResult, list]:
    """Materializes the export and ``invoice_rows`` downstream of it (``selection``: only some of them); returns
    the run and the frames ``load_input`` gave ``invoice_rows``."""
    defs, seen = _with_downstream(defs)
    result = dg.materialize(
        defs.assets, partition_key=partition_key, instance=instance, resources=defs.resources, raise_on_error=False,
        **kwargs,
    )  # fmt: skip
    return result, seen


# Delta on moto's S3: several seconds a test (its log listing is slow there), so in the slow tier.
LOAD_KINDS = [
    "local", *KINDS[1:], "sftp", "delta", pytest.param("delta-s3", marks=pytest.mark.slow),
    *(f"warehouse-{kind}" for kind in WAREHOUSE_KINDS),
]  # fmt: skip


@pytest.fixture(params=LOAD_KINDS)
def load_destination(request, tmp_path):
    """The destination ``load_input`` reads back from: each kind, on a server of its own where it has one."""
    if request.param == "local":
        return str(tmp_path / "exports")
    if request.param.startswith("delta"):
        return delta_destination(request, tmp_path, on_s3=request.param == "delta-s3")
    if request.param.startswith("warehouse-"):
        destination = warehouse_destination(request.param.removeprefix("warehouse-"), request, tmp_path)
        # A secret: Dagster gets it by name (EnvVar), from the code location's environment.
        request.getfixturevalue("monkeypatch").setenv("EXPORTS_WAREHOUSE_URL", destination.warehouse_url)
        return destination
    return object_destination(request.param, request, "exports")


def test_load_input_returns_committed_exports(tmp_path, instance, load_destination):
    defs = make_defs(tmp_path, tenants=["acme", "globex"], destination=load_destination)
    result, seen = _load(defs, instance, "2026-03-08")
    assert result.success, failure_message(result)
    (frame,) = seen
    assert len(frame) == 2 * 92 and set(frame["tenant"]) == {"acme", "globex"}
    assert frame["invoice_id"].is_unique


def test_load_input_refuses_an_export_that_is_not_committed(tmp_path, instance, monkeypatch, load_destination):
    defs = make_defs(tmp_path, destination=load_destination)
    monkeypatch.setenv(FAILPOINTS, "after_stage=raise")
    assert not run_partition(defs, instance, "2026-03-08").success
    monkeypatch.delenv(FAILPOINTS)
    result, seen = _load(defs, instance, "2026-03-08", selection=[dg.AssetKey("invoice_rows")])
    assert not result.success
    assert "invoice_export for tenant acme on 2026-03-08 is not committed (failed)" in failure_message(result)
    assert seen == []


# Two runs of two tenants each: over 2 s a test on Azurite, SFTP, Delta and DuckDB, so those in the slow tier; the
# warehouse (which replaces a restated key's rows rather than keeping them beside) runs by default on PostgreSQL.
@pytest.mark.parametrize(
    "load_destination",
    [
        "local",
        "gcs",
        "warehouse-postgres",
        *(
            pytest.param(kind, marks=pytest.mark.slow)
            for kind in ("azure", "sftp", "delta", "delta-s3", "warehouse-duckdb")
        ),
    ],
    indirect=True,
)
def test_load_input_returns_exactly_the_current_revision_and_after_a_restatement_the_new_rows(
    tmp_path, instance, load_destination
):
    """Each key's rows once, as its current revision holds them; restated (a source that now has every other
    invoice), the revision 2 rows only, none of revision 1's left beside them."""
    window = window_for(dt.date(2026, 3, 8), "America/New_York")
    first_source, restated_source = SampleInvoiceSource(), SampleInvoiceSource(cadence_minutes=30)
    defs = make_defs(tmp_path, tenants=["acme", "globex"], destination=load_destination, source=first_source)
    result, seen = _load(defs, instance, "2026-03-08")
    assert result.success, failure_message(result)
    for tenant in ("acme", "globex"):
        expected = first_source.rows(tenant, window.start_utc, window.end_utc)
        loaded = seen[0][seen[0]["tenant"] == tenant]
        assert sorted(loaded["invoice_id"]) == sorted(expected["invoice_id"]), f"{tenant}: revision 1's rows"

    key = str(LogicalKey("invoice_export", "acme", window))
    ledger_at(tmp_path).restatements.request(key, reason="the source was corrected", requested_by="ops")
    restated = make_defs(tmp_path, tenants=["acme", "globex"], destination=load_destination, source=restated_source)
    result, seen = _load(restated, instance, "2026-03-08")
    assert result.success, failure_message(result)
    (frame,) = seen
    acme, globex = frame[frame["tenant"] == "acme"], frame[frame["tenant"] == "globex"]
    expected = restated_source.rows("acme", window.start_utc, window.end_utc)
    assert list(acme["invoice_id"]) == list(expected["invoice_id"]), "acme: revision 2's rows, in order, only"
    assert len(acme) < len(first_source.rows("acme", window.start_utc, window.end_utc)), "the restatement changed it"
    assert sorted(globex["invoice_id"]) == sorted(
        first_source.rows("globex", window.start_utc, window.end_utc)["invoice_id"]
    ), "globex was not restated: still its revision 1"
    assert [r.revision for r in ledger_at(tmp_path).restatements.revisions(key)] == [1, 2]


def test_a_skipped_calendar_day_exports_nothing_and_its_neighbours_cover_every_event(tmp_path, instance):
    defs = make_defs(tmp_path, timezone="Pacific/Apia", start_date="2011-12-01", max_partitions_per_run=None)
    result = run_range(defs, instance, "2011-12-29", "2011-12-31")
    assert result.success, failure_message(result)

    folders = published_dirs(tmp_path / "exports")
    assert [f.name for f in folders] == ["date=2011-12-29", "date=2011-12-31"], "2011-12-30 never happened in Samoa"
    exported = [i for f in folders for i in read_export(f)[1]["invoice_id"]]
    first, last = window_for(dt.date(2011, 12, 29), "Pacific/Apia"), window_for(dt.date(2011, 12, 31), "Pacific/Apia")
    expected = SampleInvoiceSource().rows("acme", first.start_utc, last.end_utc)
    assert sorted(exported) == sorted(expected["invoice_id"]), "every event exported once, none under two keys"
    skipped = [e for e in result.get_asset_materialization_events() if e.materialization.partition == "2011-12-30"]
    assert skipped[0].materialization.metadata.get("keys") is None, "no key of its own"
    assert "2011-12-30" not in check_evaluations(result, "partition_health"), "a day with no key has no verdict"
