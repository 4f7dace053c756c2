"""The Delta Lake destination, on a local path and on S3 (moto's server, conditional puts): one commit per key and
revision holds the rows and the key's txn actions; readers ask the table, never the ledger."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from builders import ORDERS_DAY as DAY  # noqa: E402
from builders import ORDERS_SCHEMA as SCHEMA  # noqa: E402
from builders import corrected_orders as corrected  # noqa: E402
from builders import key_for  # noqa: E402
from builders import orders_item as item  # noqa: E402

from export_ledger.destinations import ExportTarget, Fenced, PointerMoved, Verdict, destination_from  # noqa: E402
from export_ledger.destinations.delta import KEY_COLUMN, DeltaDestination, fence_id  # noqa: E402
from export_ledger.errors import ConfigurationError  # noqa: E402
from export_ledger.failpoints import ENV_VAR as FAILPOINTS  # noqa: E402
from export_ledger.failpoints import SimulatedCrash  # noqa: E402
from export_ledger.frames import Manifest  # noqa: E402
from export_ledger.ledger import ExportState  # noqa: E402
from export_ledger.protocol import export_key  # noqa: E402
from export_ledger.reconcile import reconcile_batch  # noqa: E402

KEY = key_for()
LOGICAL_KEY = str(KEY)
OTHER_KEY = "invoice_export/other/2026-03-08T05:00:00Z"
TABLE = pa.table({"invoice_id": ["a", "b"], "amount": [1.0, 2.0]})


@pytest.fixture(params=["local", "s3"])
def destination(request, tmp_path) -> DeltaDestination:
    if request.param == "local":
        return DeltaDestination(str(tmp_path / "delta" / "{export}"))
    endpoint = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return DeltaDestination(
        f"s3://{bucket}/lake/{{export}}", endpoint_url=endpoint, access_key_id="testing", secret_access_key="testing"
    )


def target(revision: int = 1, tenant: str = KEY.tenant) -> ExportTarget:
    return ExportTarget(KEY.export, tenant, KEY.window.business_date.isoformat(), revision)


def manifest(token: int, revision: int = 1, logical_key: str = LOGICAL_KEY) -> Manifest:
    built = Manifest.build(
        logical_key=logical_key, export=KEY.export, tenant=KEY.tenant, window=KEY.window, row_count=0, sha256="",
        attempt_id=f"run-{token}/invoice_export", fencing_token=token, data_file="data.csv", tz_database="test",
        revision=revision, supersedes=(revision - 1, "ab" * 32) if revision > 1 else None,
    )  # fmt: skip
    return dataclasses.replace(built, tenant=logical_key.split("/")[1])


def publish(destination, token: int, revision: int = 1, superseded: int = 0, rows=TABLE, logical_key=LOGICAL_KEY):
    where = target(revision, tenant=logical_key.split("/")[1])
    staged = destination.stage(where, token, rows, "csv", manifest(token, revision, logical_key))
    destination.commit(staged, token, superseded=superseded)
    return staged


def table_of(destination) -> deltalake.DeltaTable:
    return deltalake.DeltaTable(destination.table_for(KEY.export), storage_options=destination.storage_options())


def reader_sees(destination, logical_key: str = LOGICAL_KEY) -> tuple[int | None, list[str]]:
    """What a reader outside the library sees: the key's txn version and its rows' invoice ids."""
    try:
        table = table_of(destination)
    except deltalake.exceptions.TableNotFoundError:
        return None, []
    rows = table.to_pyarrow_table(filters=[(KEY_COLUMN, "=", logical_key)])
    return table.transaction_version(logical_key), sorted(rows.column("invoice_id").to_pylist())


def test_rows_and_their_completion_marker_are_one_commit_a_reader_can_ask_for(destination):
    staged = destination.stage(target(), 1, TABLE, "csv", manifest(1))
    assert reader_sees(destination) == (None, []), "nothing is in the table before the commit"
    assert destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0).verdict is Verdict.ABSENT
    destination.commit(staged, 1, superseded=0)
    assert reader_sees(destination) == (1, ["a", "b"])
    commit = destination.commit_info(KEY.export, table_of(destination).version())
    recorded = Manifest.from_json(commit["export_ledger.manifest"].encode(), "commit")
    assert (recorded.attempt_id, recorded.fencing_token, recorded.sha256) == (
        "run-1/invoice_export", 1, staged.manifest.sha256,
    ), "attempt, token and sha256 are in the commit that holds the rows"  # fmt: skip
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0)
    assert seen.verdict is Verdict.PUBLISHED and seen.manifest.sha256 == staged.manifest.sha256
    assert seen.location == destination.location(target().at_place("r1-t1"))


def test_a_keys_rows_are_read_back_in_the_format_the_destination_says_whatever_the_exports(tmp_path):
    """Drift reads a key back with ``data_format``: Delta hands its rows back as CSV, so a Parquet export's rows read
    as Parquet failed ("Parquet magic bytes not found")."""
    from export_ledger.frames import read_table

    destination = DeltaDestination(str(tmp_path / "delta" / "{export}"))
    staged = destination.stage(target(), 1, TABLE, "csv", manifest(1))
    destination.commit(staged, 1, superseded=0)
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0)

    payload = destination.read_data(target().at_place(seen.location.rstrip("/").rsplit("/", 1)[-1]), seen.manifest)

    assert len(read_table(payload, destination.data_format("parquet"))) == TABLE.num_rows


def test_a_resent_commit_lands_once_and_a_second_party_cannot_commit_the_same_revision(destination):
    first = publish(destination, 1)
    destination.commit(first, 1, superseded=0)  # a resend of one's own commit: success, nothing changes
    version = table_of(destination).version()
    other = destination.stage(target(), 2, pa.table({"invoice_id": ["z"], "amount": [9.0]}), "csv", manifest(2))
    with pytest.raises(PointerMoved):
        destination.commit(other, 2, superseded=0)
    assert reader_sees(destination) == (1, ["a", "b"]) and table_of(destination).version() == version


def test_two_writers_racing_on_one_key_land_exactly_one_revision(destination):
    staged = [
        destination.stage(target(), token, pa.table({"invoice_id": [f"t{token}"], "amount": [1.0]}), "csv",
                          manifest(token))
        for token in (1, 2)
    ]  # fmt: skip
    outcomes: dict[int, str] = {}
    barrier = threading.Barrier(2)

    def commit(one) -> None:
        barrier.wait()
        try:
            destination.commit(one, one.manifest.fencing_token, superseded=0)
            outcomes[one.manifest.fencing_token] = "committed"
        except (PointerMoved, Fenced):  # the other landed first: its revision, or its higher token's fence
            outcomes[one.manifest.fencing_token] = "lost"
        except Exception as exc:  # anything else is a defect, named in the assertion below
            outcomes[one.manifest.fencing_token] = f"error: {type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=commit, args=(one,)) for one in staged]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes.values()) == ["committed", "lost"], outcomes
    winner = next(token for token, outcome in outcomes.items() if outcome == "committed")
    assert reader_sees(destination) == (1, [f"t{winner}"]), "the loser re-read the txn version and applied nothing"


def test_a_paused_older_attempt_waking_after_a_takeover_cannot_change_what_readers_see(destination):
    stale = destination.stage(target(), 1, TABLE, "csv", manifest(1))
    read_before_takeover = table_of(destination) if destination.pointer(target()).tag else None
    fenced = destination.fence(target(), 2, logical_key=LOGICAL_KEY)  # the takeover fences the key
    assert (fenced.fence, fenced.revision) == (2, 0)
    with pytest.raises(Fenced):
        destination.commit(stale, 1, superseded=0)
    with pytest.raises(Fenced):
        destination.fence(target(), 1, logical_key=LOGICAL_KEY)
    assert read_before_takeover is None, "no table before the fence: nothing to commit from"
    # The attempt that read the table before the fence and writes only now: Delta refuses the commit outright.
    publish(destination, 2, logical_key=OTHER_KEY)
    before = table_of(destination)
    destination.fence(target(), 3, logical_key=LOGICAL_KEY)
    with pytest.raises(deltalake.exceptions.CommitFailedError):
        destination._write(before, destination.stage(target(), 2, TABLE, "csv", manifest(2)), 2)
    assert reader_sees(destination) == (None, []), "the stale attempt's rows never became visible"
    assert table_of(destination).transaction_version(fence_id(LOGICAL_KEY)) == 3


def test_a_restatement_replaces_exactly_the_keys_rows_in_one_new_table_version(destination):
    publish(destination, 1)
    publish(destination, 1, logical_key=OTHER_KEY, rows=pa.table({"invoice_id": ["o"], "amount": [3.0]}))
    version = table_of(destination).version()
    corrected_rows = pa.table({"invoice_id": ["a", "c"], "amount": [1.5, 4.0]})
    publish(destination, 3, revision=2, superseded=1, rows=corrected_rows)
    table = table_of(destination)
    assert table.version() == version + 1, "one commit removes the key's rows and adds the new ones"
    assert destination.commit_info(KEY.export, table.version())["operationMetrics"]["num_removed_files"] >= 1
    assert reader_sees(destination) == (2, ["a", "c"])
    assert reader_sees(destination, OTHER_KEY) == (1, ["o"]), "another key's rows are untouched"
    assert destination.verify(target(2), logical_key=LOGICAL_KEY, superseded=1).verdict is Verdict.PUBLISHED
    first = destination.verify_recorded(
        target(1).at_place("r1-t1"), logical_key=LOGICAL_KEY, sha256=destination.stage(
            target(), 1, TABLE, "csv", manifest(1)).manifest.sha256,
    )  # fmt: skip
    assert first.verdict is Verdict.PUBLISHED, "revision 1 is still readable at the table version that committed it"
    late = destination.stage(target(3), 4, TABLE, "csv", manifest(4, revision=3))
    with pytest.raises(PointerMoved):
        destination.commit(late, 4, superseded=1)


def test_the_verdict_is_conflict_for_unexpected_data(destination):
    publish(destination, 1)
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0, expected_sha256="00" * 32)
    assert seen.verdict is Verdict.CONFLICT
    assert destination.verify(target(2), logical_key=LOGICAL_KEY, superseded=3).verdict is Verdict.CONFLICT


def test_a_table_whose_txn_retention_is_shorter_than_the_ledgers_is_refused(tmp_path):
    path = str(tmp_path / "short")
    deltalake.DeltaTable.create(
        path, pa.schema([(KEY_COLUMN, pa.string())]), partition_by=[KEY_COLUMN],
        configuration={"delta.setTransactionRetentionDuration": "interval 7 days",
                       "delta.logRetentionDuration": "interval 4000 days"},
    )  # fmt: skip
    destination = DeltaDestination(path, retention_days=30)
    with pytest.raises(ConfigurationError, match="delta.setTransactionRetentionDuration"):
        destination.check_table(KEY.export)
    with pytest.raises(ConfigurationError, match="delta.setTransactionRetentionDuration"):
        destination.fence(target(), 2, logical_key=LOGICAL_KEY)
    assert deltalake.DeltaTable(path).transaction_version(fence_id(LOGICAL_KEY)) is None, "nothing was written"
    DeltaDestination(path, retention_days=7).check_table(KEY.export)  # long enough for a 7-day ledger


def test_a_table_made_by_the_destination_keeps_txns_and_log_as_long_as_the_ledger(tmp_path):
    destination = DeltaDestination(str(tmp_path / "made"), retention_days=400)
    publish(destination, 1)
    configuration = table_of(destination).metadata().configuration
    assert configuration["delta.setTransactionRetentionDuration"] == "interval 400 days"
    assert configuration["delta.logRetentionDuration"] == "interval 400 days"


def test_a_delta_spec_builds_the_destination_and_names_the_extra_when_deltalake_is_missing(tmp_path, monkeypatch):
    built = destination_from(f"delta:{tmp_path}/{{export}}", ledger_url="")
    assert isinstance(built, DeltaDestination) and built.table_for("x") == f"{tmp_path}/x"
    monkeypatch.setitem(sys.modules, "deltalake", None)  # what an install without the extra has: no deltalake
    with pytest.raises(ConfigurationError, match=r"export-ledger\[delta\]"):
        destination_from(f"delta:{tmp_path}/t", ledger_url="")


# -- driven by the protocol -----------------------------------------------------------------------------------------


def test_export_restate_and_a_crash_after_the_commit_that_reconciliation_settles(
    destination, ledger, clock, monkeypatch
):
    key = key_for(DAY)
    assert export_key(ledger, destination, SCHEMA, item(key), "run-1/export").status == "exported"
    assert export_key(ledger, destination, SCHEMA, item(key), "run-1b/export").status == "already_completed"
    table = deltalake.DeltaTable(destination.table_for(key.export), storage_options=destination.storage_options())
    assert table.transaction_version(str(key)) == 1
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, "after_publish=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)
    table.update_incremental()
    assert table.transaction_version(str(key)) == 2, "the commit landed; the ledger never recorded it"
    clock.advance(minutes=16)
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    record = ledger.queries.get(str(key))
    assert record.state is ExportState.COMPLETED
    assert ledger.restatements.current_revision(str(key)).revision == 2
    assert [r.revision for r in ledger.restatements.revisions(str(key))] == [1, 2]
    table.update_incremental()
    assert table.transaction_version(str(key)) == 2 and table.transaction_version(fence_id(str(key))) == 3


# -- a store that ignores conditional puts ---------------------------------------------------------------------------


def test_a_delta_table_on_a_store_that_ignores_if_none_match_is_refused_before_any_commit(s3_server, s3_bucket, s3):
    from condition_proxy import ConditionStripper

    from export_ledger.destinations import delta as delta_module

    def on(endpoint: str) -> DeltaDestination:
        return DeltaDestination(f"s3://{s3_bucket}/lake/{{export}}", endpoint_url=endpoint, access_key_id="testing",
                                secret_access_key="testing")  # fmt: skip

    def stored() -> list[str]:
        return [item["Key"] for item in s3.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]

    with ConditionStripper(s3_server) as proxy:
        stripped = on(proxy.endpoint_url)
        refusal = r"accepted a second create of one object \(If-None-Match: \* ignored\)"
        with pytest.raises(ConfigurationError, match=refusal):
            stripped.check_table(KEY.export)
        with pytest.raises(ConfigurationError, match=refusal):
            publish(stripped, 1)
        assert any(r.method == "PUT" for r in proxy.history), "the probe's writes went through the proxy"
    assert (proxy.endpoint_url, s3_bucket) not in delta_module._CONDITIONS_CHECKED, "a refusal is not remembered"
    assert stored() == [], "no table was made, nothing was committed, the probe is deleted"

    honest = on(s3_server)
    honest.check_table(KEY.export)  # the same bucket, straight: the second create is refused, so it passes
    assert (s3_server, s3_bucket) in delta_module._CONDITIONS_CHECKED and stored() == []
    publish(honest, 1)
    assert reader_sees(honest) == (1, ["a", "b"])
