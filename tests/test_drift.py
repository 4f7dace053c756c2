"""Source fingerprints and drift detection (issue #12, parts 1 and 2).

A key completes with a fingerprint of its source rows (counts and digests, no values); later the SQL source changes
(a late row, a deleted row, a row whose version moved) and the drift sensor, evaluated with ``build_sensor_context``,
or ``export-ledger drift`` in one pass, marks the key stale with the right counts; ``source_unchanged`` fails and
``export-ledger status --state stale`` lists it; reverting the source clears it.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import DRIFT_COLUMNS as COLUMNS
from builders import DRIFT_QUERY as QUERY
from builders import drift_day as _day
from builders import drift_environ as _environ
from builders import drift_source as _source
from builders import drift_spec as _spec
from builders import late_deleted_and_updated as _late_deleted_and_updated
from builders import ledger_at as _ledger_at
from builders import open_ledger
from pipeline_helpers import tick

from export_ledger.dagster import ledgered_definitions
from export_ledger.drift import compare
from export_ledger.fingerprint import Fingerprint, of_frame, parse
from export_ledger.frames import ExportSchema, FrameBatches, validate_batches, validate_frame
from export_ledger.ledger import (
    SCHEMA_VERSION,
    ExportLedger,
    SchemaOutdated,
    dispose_engines,
    schema_version,
    upgrade_url,
)


def _export(defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
    result = defs.resolve_job_def("orders_job").execute_in_process(partition_key=_day().isoformat(), instance=instance)
    assert result.success


def _run_check(defs: dg.Definitions, instance: dg.DagsterInstance) -> dg.AssetCheckEvaluation:
    """Runs ``source_unchanged`` alone, as the UI's "Execute" on the check does."""
    key = dg.AssetCheckKey(dg.AssetKey("orders"), "source_unchanged")
    job = defs.resolve_implicit_global_asset_job_def().get_subset(asset_check_selection={key}, asset_selection=set())
    (evaluation,) = job.execute_in_process(instance=instance).get_asset_check_evaluations()
    return evaluation


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from export_ledger import cli

    code = cli.main(list(argv))
    return code, capsys.readouterr().out


# -- fingerprints ----------------------------------------------------------------------------------------------------


def test_a_fingerprint_counts_and_digests_ids_and_versions_whatever_the_row_order() -> None:
    frame = pd.DataFrame({"order_id": [f"o{i}" for i in range(50)], "version": list(range(50))})
    shuffled = frame.sample(frac=1, random_state=7).reset_index(drop=True)
    assert of_frame(frame, ["order_id"], "version") == of_frame(shuffled, ["order_id"], "version")
    parsed = parse(of_frame(frame, ["order_id"], "version"))
    assert parsed.rows == 50 and parsed.versions is not None
    assert parse(of_frame(frame, ["order_id"], None)).versions is None, "no version column: no version digest"

    bumped = frame.assign(version=frame["version"].where(frame["order_id"] != "o3", 99))
    one, other = parse(of_frame(frame, ["order_id"], "version")), parse(of_frame(bumped, ["order_id"], "version"))
    assert one.ids == other.ids and one.versions != other.versions, "a version change moves only the version digest"

    batched = Fingerprint(("order_id",), "version")
    for part in (shuffled[:20], shuffled[20:]):
        batched.add(part)
    assert batched.encode() == of_frame(frame, ["order_id"], "version"), "batches add up to the whole"
    assert "o3" not in batched.encode(), "no values, only counts and digests"


def test_validation_fingerprints_a_frame_and_a_stream_alike() -> None:
    spec = _spec(Path("unused.sqlite3"))
    window = spec.calendar.window(_day().isoformat())
    start = pd.Timestamp(window.start_utc)
    frame = pd.DataFrame(
        {
            "order_id": [f"o{i}" for i in range(30)],
            "tenant": "acme",
            "placed_at": [start + pd.Timedelta(minutes=i) for i in range(30)],
            "total": 1.0,
            "version": 1,
        }
    )
    whole, streamed = Fingerprint(("order_id",), "version"), Fingerprint(("order_id",), "version")
    validate_frame(frame.iloc[::-1], spec.schema, window, "k", fingerprint=whole)
    list(validate_batches(FrameBatches([frame[:10], frame[10:]]), spec.schema, window, "k", fingerprint=streamed))
    assert whole.encode() == streamed.encode() == of_frame(frame, ["order_id"], "version")
    with pytest.raises(ValueError, match="version column 'order_id' cannot be an id column"):
        ExportSchema(COLUMNS, "placed_at", ("order_id",), version_column="order_id")


def test_compare_counts_added_removed_and_changed_rows_by_id() -> None:
    ids = np.array([1, 2, 3], dtype=np.uint64)
    counts = compare(
        np.array([2, 3, 4], dtype=np.uint64),
        np.array([20, 31, 40], dtype=np.uint64),
        ids,
        np.array([10, 20, 30], dtype=np.uint64),
    )
    assert (counts.added, counts.removed, counts.changed) == (1, 1, 1)
    assert compare(ids, None, ids, None).changed is None, "without a version column, changes are unknown"


# -- the drift sensor, the check and status --state stale ------------------------------------------------------------


def test_a_changed_source_makes_its_key_stale_with_counts_until_the_source_is_reverted(tmp_path, capsys) -> None:
    db = tmp_path / "shop.sqlite3"
    spec = _spec(db)
    _source(db, spec)
    environ = _environ(tmp_path)
    defs = ledgered_definitions([spec], environ=environ)
    assert defs.get_sensor_def("drift_sensor").default_status == dg.DefaultSensorStatus.STOPPED
    with dg.instance_for_test() as instance:
        _export(defs, instance)
        ledger = open_ledger(environ["EXPORTS_LEDGER_URL"])
        (record,) = ledger.queries.records()
        stored = ledger.drift.fingerprints([record.logical_key])[record.logical_key]
        assert parse(stored).rows == 5 and parse(stored).versions is not None, "fingerprint stored at completion"

        quiet = tick(defs, instance, sensor_name="drift_sensor")
        assert quiet.check_evaluations == [] and "1 key(s) checked, 0 stale" in quiet.skip_message

        _late_deleted_and_updated(db, spec)
        found = tick(defs, instance, quiet.cursor, sensor_name="drift_sensor")
        (evaluation,) = found.check_evaluations
        assert evaluation.check_name == "source_unchanged" and evaluation.passed is False
        assert evaluation.asset_key == dg.AssetKey("orders") and evaluation.metadata["stale_keys"].value == 1
        (drift,) = ledger.drift.open_records()
        assert (drift.logical_key, drift.rows_added, drift.rows_removed, drift.rows_changed) == (
            record.logical_key,
            1,
            1,
            1,
        )
        assert ledger.queries.get(record.logical_key).state.value == "completed", "a stale key stays completed"
        (observed,) = [e for e in found.result.asset_events if isinstance(e, dg.AssetObservation)]
        assert (observed.asset_key, observed.partition) == (dg.AssetKey("orders"), record.business_date.isoformat())
        assert observed.metadata["stale"].value is True and observed.metadata["rows_added"].value == 1
        seen = instance.fetch_observations(dg.AssetKey("orders"), limit=5).records
        assert [r.partition_key for r in seen] == [record.business_date.isoformat()], "the partition's page shows it"

        again = tick(defs, instance, found.cursor, sensor_name="drift_sensor")
        assert again.check_evaluations == [], "the verdict is reported when the set of stale keys changes"
        assert len(ledger.drift.open_records()) == 1

        code, out = _cli(capsys, "--ledger-url", environ["EXPORTS_LEDGER_URL"], "status", "--state", "stale")
        assert code == 0 and record.logical_key in out and "restatement" in out
        code, out = _cli(capsys, "--ledger-url", environ["EXPORTS_LEDGER_URL"], "status", "--state", "stale", "--json")
        (listed,) = json.loads(out)
        assert (listed["state"], listed["rows_added"], listed["rows_removed"], listed["rows_changed"]) == (
            "stale",
            1,
            1,
            1,
        )
        assert set(listed) == {
            "logical_key", "export", "tenant", "business_date", "state", "rows_added", "rows_removed", "rows_changed",
            "detected_at",
        }, "counts only, never values"  # fmt: skip
        from_ui = _run_check(defs, instance)
        assert (from_ui.passed, from_ui.metadata["stale_keys"].value) == (False, 1), "the check runs from the UI too"

        _source(db, spec)  # the source as it was exported
        cleared = tick(defs, instance, again.cursor, sensor_name="drift_sensor")
        (evaluation,) = cleared.check_evaluations
        assert evaluation.passed is True and evaluation.metadata["stale_keys"].value == 0
        (observed,) = [e for e in cleared.result.asset_events if isinstance(e, dg.AssetObservation)]
        assert observed.partition == record.business_date.isoformat() and observed.metadata["stale"].value is False
        assert ledger.drift.open_records() == []
        code, out = _cli(capsys, "--ledger-url", environ["EXPORTS_LEDGER_URL"], "status", "--state", "stale")
        assert code == 0 and "no stale exports" in out
        assert _run_check(defs, instance).passed is True


def test_export_ledger_drift_runs_one_pass_from_the_declared_specs(tmp_path, capsys, monkeypatch) -> None:
    db = tmp_path / "shop.sqlite3"
    module = tmp_path / "drift_specs.py"
    module.write_text(
        "from export_ledger import ExportSpec, SqlSource\n"
        f"orders = ExportSpec(name='orders', source=SqlSource({f'sqlite:///{db}'!r}, {QUERY!r}), columns={COLUMNS!r},"
        " id_columns=['order_id'], time_column='placed_at', tenant_column='tenant', tenants=['acme'],"
        " timezone='America/New_York', start_date='2026-01-01', stream_rows=2)\n"
    )
    spec = _spec(db, version_column=None, stream_rows=2)
    _source(db, spec)
    environ = _environ(tmp_path)
    with dg.instance_for_test() as instance:
        _export(ledgered_definitions([spec], environ=environ), instance)
    url = environ["EXPORTS_LEDGER_URL"]
    drift = [
        "--ledger-url",
        url,
        "drift",
        "--specs",
        "drift_specs:orders",
        "--destination",
        environ["EXPORTS_DESTINATION"],
    ]
    monkeypatch.chdir(tmp_path)

    code, out = _cli(capsys, *drift)
    assert code == 0 and "1 key(s) checked: 0 stale, 1 match their source" in out

    _late_deleted_and_updated(db, spec)
    code, out = _cli(capsys, *drift, "--json")
    (item,) = json.loads(out)
    assert code == 0 and (item["result"], item["new"]) == ("stale", True)
    assert (item["rows_added"], item["rows_removed"], item["rows_changed"]) == (1, 1, None), (
        "without a version column an update in place is unknown, never guessed"
    )

    # A key repaired from its manifest has no fingerprint: drift compares the source with the published file.
    with sa.create_engine(url).begin() as conn:
        conn.execute(sa.text("UPDATE export_runs SET source_fingerprint = NULL"))
    _source(db, spec)
    code, out = _cli(capsys, *drift)
    assert code == 0 and "cleared" in out and "1 match their source" in out
    code, out = _cli(capsys, "--ledger-url", url, "status", "--state", "stale")
    assert "no stale exports" in out

    from export_ledger import cli

    assert cli.main(["--ledger-url", url, "drift", "--specs", "drift_specs:nothing"]) == 2
    assert "drift_specs has no attribute 'nothing'" in capsys.readouterr().err


# -- schema version 4 ------------------------------------------------------------------------------------------------


def test_a_v3_ledger_reads_unchanged_refuses_writes_and_upgrades_explicitly_keeping_every_row(
    ledger_url, capsys
) -> None:
    _ledger_at(ledger_url, 3)
    reader = ExportLedger(ledger_url, read_only=True)
    assert schema_version(sa.create_engine(ledger_url)) == 3
    before = [(r.logical_key, r.state.value, r.row_count, r.sha256, r.fencing_token) for r in reader.queries.records()]
    assert len(before) == 2 and reader.drift.open_records() == [], "a v3 ledger reads as it is, with nothing stale"
    code, out = _cli(capsys, "--ledger-url", ledger_url, "status", "--state", "stale")
    assert code == 0 and "no stale exports" in out
    assert schema_version(sa.create_engine(ledger_url)) == 3, "reading never upgrades"
    dispose_engines()

    with pytest.raises(SchemaOutdated, match="export-ledger upgrade"):
        ExportLedger(ledger_url)
    assert schema_version(sa.create_engine(ledger_url)) == 3, "opening to write never upgrades on its own"
    assert upgrade_url(ledger_url) == [4, 5, 6, 7, 8, 9], "the explicit upgrade runs each revision from 3 on"
    writer = open_ledger(ledger_url)
    assert schema_version(sa.create_engine(ledger_url)) == SCHEMA_VERSION == 9
    after = [(r.logical_key, r.state.value, r.row_count, r.sha256, r.fencing_token) for r in writer.queries.records()]
    assert after == before
    fingerprints = writer.drift.fingerprints([key for key, *_ in before])
    assert set(fingerprints.values()) == {None}, "old keys have no fingerprint"
    assert writer.drift.open_records() == []
    attempts = writer.queries.attempts("invoice_export/acme/2026-03-08T05:00:00Z")
    assert [a.outcome.value for a in attempts] == ["completed"]


def test_each_stale_key_fails_source_unchanged_on_its_own_tenants_asset(tmp_path) -> None:
    from export_ledger.dagster import drift_check_evaluations
    from export_ledger.destinations import LocalDestination
    from export_ledger.keys import LogicalKey
    from export_ledger.ledger import DriftFinding
    from export_ledger.protocol import ExportItem, export_key

    spec = _spec(tmp_path / "shop.sqlite3", tenants={"acme": None, "kolkata": "Asia/Kolkata"})
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    kolkata = spec.group_of("kolkata")
    window = spec.calendar_for("kolkata").window(_day().isoformat())
    frame = pd.DataFrame(
        {"order_id": ["o1"], "tenant": ["kolkata"], "placed_at": [pd.Timestamp(window.start_utc)], "total": [1.0]}
    ).assign(version=1)
    key = LogicalKey("orders", "kolkata", window)
    item = ExportItem(key, _day().isoformat(), frame)
    export_key(ledger, LocalDestination(str(tmp_path / "x")), spec.schema, item, "r/1")
    (record,) = ledger.queries.records()
    ledger.drift.record([DriftFinding(record, 2, 0, 1, "fp1 rows=3 ids=0000000000000000 versions=-")], [])

    # Counted in the ledger per asset (a bounded read of its own tenants' records), never from a list in memory.
    verdicts = {e.asset_key.to_user_string(): e for e in drift_check_evaluations([spec], ledger)}
    assert set(verdicts) == {group.asset_name for group in spec.groups} and len(verdicts) == 2
    (failing,) = [e for name, e in verdicts.items() if name == kolkata.asset_name]
    assert failing.passed is False and failing.metadata["stale_keys"].value == 1
    assert verdicts[spec.group_of("acme").asset_name].passed is True


def test_pruning_a_stale_key_closes_its_drift_record(tmp_path) -> None:
    from export_ledger.destinations import LocalDestination
    from export_ledger.keys import LogicalKey
    from export_ledger.ledger import DriftFinding
    from export_ledger.protocol import ExportItem, export_key

    spec = _spec(tmp_path / "shop.sqlite3")
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    window = spec.calendar.window("2026-03-10")
    frame = pd.DataFrame(
        {"order_id": ["o1"], "tenant": ["acme"], "placed_at": [pd.Timestamp(window.start_utc)], "total": [1.0]}
    ).assign(version=1)
    key = LogicalKey("orders", "acme", window)
    export_key(ledger, LocalDestination(str(tmp_path / "x")), spec.schema, ExportItem(key, "2026-03-10", frame), "r/1")
    (record,) = ledger.queries.records()
    opened = ledger.drift.record([DriftFinding(record, 1, 0, 0, "fp1 rows=2 ids=0000000000000000 versions=-")], [])
    assert opened.opened == [record.logical_key] and len(ledger.drift.open_records()) == 1
    again = ledger.drift.record([DriftFinding(record, 1, 0, 0, "fp1 rows=2 ids=0000000000000000 versions=-")], [])
    assert again.opened == [] and len(ledger.drift.open_records()) == 1, "the same drift seen again records nothing"

    ledger.retention.prune(30, export="orders")
    assert ledger.queries.records() == [] and ledger.drift.open_records() == [], "a pruned key is no longer stale"


def test_drift_reads_a_ledger_table_export_back_to_count_the_changes(tmp_path) -> None:
    from export_ledger.destinations import destination_from
    from export_ledger.drift import drift_pass

    db = tmp_path / "shop.sqlite3"
    spec = _spec(db, destination="ledger-table:orders_rows")
    _source(db, spec)
    environ = _environ(tmp_path)
    with dg.instance_for_test() as instance:
        _export(ledgered_definitions([spec], environ=environ), instance)
    ledger = open_ledger(environ["EXPORTS_LEDGER_URL"])
    table = destination_from(spec.destination, ledger_url=ledger.url, what="test")
    with sa.create_engine(ledger.url).begin() as conn:
        conn.execute(sa.text("UPDATE export_runs SET source_fingerprint = NULL"))  # force the comparison
    assert drift_pass(ledger, [spec], {"orders": table}).matching, "the table's rows are the source's"

    _late_deleted_and_updated(db, spec)
    report = drift_pass(ledger, [spec], {"orders": table})
    (finding,) = report.stale
    assert (finding.rows_added, finding.rows_removed, finding.rows_changed) == (1, 1, 1)
