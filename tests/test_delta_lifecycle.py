"""The Delta Lake destination over a table's life: deploys that change the export's columns, routine maintenance
(OPTIMIZE, then VACUUM) and many writers at once, against real deltalake on a local table (issue 26)."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import shutil
import threading
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from builders import key_for  # noqa: E402

from export_ledger.destinations import ExportTarget, Fenced, PointerMoved, Verdict  # noqa: E402
from export_ledger.destinations import delta as delta_module  # noqa: E402
from export_ledger.destinations.base import (  # noqa: E402
    DestinationError,
    DestinationUnreachable,
    PublishOutcomeUnknown,
    place_of_location,
)
from export_ledger.destinations.delta import KEY_COLUMN, DeltaDestination, fence_id, revision_id  # noqa: E402
from export_ledger.errors import ConfigurationError  # noqa: E402
from export_ledger.failpoints import ENV_VAR as FAILPOINTS  # noqa: E402
from export_ledger.failpoints import SimulatedCrash  # noqa: E402
from export_ledger.frames import ExportSchema, Manifest  # noqa: E402
from export_ledger.ledger import ExportLedger, ExportState  # noqa: E402
from export_ledger.ledger.schema import AttemptOutcome  # noqa: E402
from export_ledger.protocol import ExportItem, ExportOutcomeUnknown, export_key  # noqa: E402
from export_ledger.reconcile import reconcile_batch  # noqa: E402

DAY = dt.date(2026, 3, 2)
COLUMNS = {"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"}


def schema_of(columns: dict[str, str], nullable: frozenset[str] = frozenset()) -> ExportSchema:
    return ExportSchema(columns, "placed_at", ("order_id",), tenant_column="tenant", nullable=nullable)


SCHEMA = schema_of(COLUMNS)
#: The same export after a deploy that only reorders its columns.
REORDERED = schema_of({name: COLUMNS[name] for name in reversed(COLUMNS)})


def orders(key, columns=tuple(COLUMNS), total: float = 12.5) -> pd.DataFrame:
    """Hourly orders of the key's tenant inside its window, in the given column order."""
    start, end = pd.Timestamp(key.window.start_utc), pd.Timestamp(key.window.end_utc)
    times = pd.date_range(start.ceil("h"), end, freq="h", inclusive="left").as_unit("us")
    frame = pd.DataFrame(
        {
            "order_id": [f"{key.tenant}-{int(t.timestamp())}" for t in times],
            "tenant": [key.tenant] * len(times),
            "placed_at": times,
            "total": [total] * len(times),
        }
    )
    return frame[list(columns)]


def item(key, frame: pd.DataFrame) -> ExportItem:
    return ExportItem(key, key.window.business_date.isoformat(), frame)


def target_of(key, revision: int = 1, place: str | None = None) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision, place)


def delta_table(destination: DeltaDestination, export: str = "invoice_export") -> deltalake.DeltaTable:
    return deltalake.DeltaTable(destination.table_for(export))


def log_actions(destination: DeltaDestination, kind: str) -> list[dict]:
    """Every action of one kind (``metaData``, ``commitInfo``, ``txn``) in the table's log, oldest first."""
    log = Path(destination.table_for("invoice_export")) / "_delta_log"
    found = []
    for entry in sorted(log.glob("*.json")):
        found += [action[kind] for action in map(json.loads, entry.read_text().splitlines()) if kind in action]
    return found


@pytest.fixture
def destination(tmp_path) -> DeltaDestination:
    return DeltaDestination(str(tmp_path / "delta" / "{export}"))



def recorded_intact(ledger: ExportLedger, destination: DeltaDestination, key) -> bytes:
    """What the asset check, ``load_input`` and drift do with a completed key: its current recorded revision verified
    against the ledger's sha256, then read back; returns the bytes read."""
    current = ledger.restatements.current_revision(str(key))
    target = target_of(key, current.revision, place_of_location(current.location))
    seen = destination.verify_recorded(target, logical_key=str(key), sha256=current.sha256)
    assert seen.verdict is Verdict.PUBLISHED, f"{key} revision {current.revision} is intact: {seen.detail}"
    payload = destination.read_data(target, seen.manifest)
    assert hashlib.sha256(payload).hexdigest() == current.sha256, f"{key} reads back as the bytes the ledger hashed"
    return payload


# -- a deploy that reorders the export's columns ---------------------------------------------------------------------


def test_a_deploy_that_reorders_columns_leaves_every_commit_verified_by_name(destination, ledger, clock, monkeypatch):
    before, after, crashed = (key_for(DAY, tenant=tenant) for tenant in ("acme", "beta", "gamma"))
    assert export_key(ledger, destination, SCHEMA, item(before, orders(before)), "run-1/x").status == "exported"
    reordered = tuple(REORDERED.columns)
    assert export_key(ledger, destination, REORDERED, item(after, orders(after, reordered)), "run-2/x").status == (
        "exported"
    )
    for key, columns in ((before, tuple(COLUMNS)), (after, reordered)):
        seen = destination.verify(target_of(key), logical_key=str(key), superseded=0)
        assert seen.verdict is Verdict.PUBLISHED, f"{key}'s intact commit is published, whatever the table's order"
        header = recorded_intact(ledger, destination, key).split(b"\n", 1)[0].decode()
        assert header.replace('"', "").split(",") == list(columns), "read back in the order its export hashed"
    # The reordered deploy's commit lands, the run dies before recording it: reconciliation finds it intact.
    monkeypatch.setenv(FAILPOINTS, "after_publish=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, REORDERED, item(crashed, orders(crashed, reordered)), "run-3/x")
    monkeypatch.delenv(FAILPOINTS)
    clock.advance(minutes=16)
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    assert ledger.queries.get(str(crashed)).state is ExportState.COMPLETED, "an intact commit is never a conflict"
    recorded_intact(ledger, destination, crashed)


# -- a deploy that drops, adds or retypes a column -------------------------------------------------------------------

CHANGED = {
    "dropped": ({k: v for k, v in COLUMNS.items() if k != "total"}, frozenset(), "'total'"),
    "added": ({**COLUMNS, "coupon": "string"}, frozenset(), "'coupon'"),
    "retyped": ({**COLUMNS, "total": "string"}, frozenset(), "'total' is string in the export, double in the table"),
    "made nullable": (COLUMNS, frozenset({"total"}), "'total' may be empty"),
}


def changed_rows(key, columns: dict[str, str]) -> pd.DataFrame:
    frame = orders(key, [name for name in columns if name in COLUMNS])
    if "coupon" in columns:
        frame["coupon"] = "spring"
    if columns.get("total") == "string":
        frame["total"] = frame["total"].astype(str)
    return frame


@pytest.mark.parametrize("change", list(CHANGED))
def test_a_column_the_table_does_not_have_is_refused_before_writing_and_the_key_fails(destination, ledger, change):
    first, later = key_for(DAY, tenant="acme"), key_for(DAY, tenant="beta")
    export_key(ledger, destination, SCHEMA, item(first, orders(first)), "run-1/x")
    version = delta_table(destination).version()
    columns, nullable, named = CHANGED[change]
    with pytest.raises(DestinationError) as refused:
        export_key(ledger, destination, schema_of(columns, nullable), item(later, changed_rows(later, columns)), "r/x")
    assert not isinstance(refused.value, (PublishOutcomeUnknown, ExportOutcomeUnknown)), "the store refused: known"
    record = ledger.queries.get(str(later))
    assert record.state is ExportState.FAILED, f"nothing was written, so the key is failed, not {record.state}"
    [attempt] = ledger.queries.attempts(str(later))
    assert attempt.outcome is AttemptOutcome.FAILED, "failed, never remote_unknown: the store said no before writing"
    assert named in attempt.error_message, f"the ledger's message names the column: {attempt.error_message}"
    assert "beta-1772" not in attempt.error_message, "no row of the export is quoted"
    table = delta_table(destination)
    assert table.version() == version, "nothing was committed, not even a fence"
    assert table.transaction_version(str(later)) is None
    assert table.to_pyarrow_table(filters=[(KEY_COLUMN, "=", str(later))]).num_rows == 0


def test_a_column_its_owner_added_to_the_table_first_is_exported_and_earlier_keys_still_verify(destination, ledger):
    first, later = key_for(DAY, tenant="acme"), key_for(DAY, tenant="beta")
    export_key(ledger, destination, SCHEMA, item(first, orders(first)), "run-1/x")
    coupon = deltalake.Field("coupon", deltalake.schema.PrimitiveType("string"), nullable=True)
    delta_table(destination).alter.add_columns(coupon)
    columns = {**COLUMNS, "coupon": "string"}
    assert export_key(
        ledger, destination, schema_of(columns), item(later, changed_rows(later, columns)), "r/x"
    ).status == ("exported")
    recorded_intact(ledger, destination, later)
    recorded_intact(ledger, destination, first)  # its rows now carry an empty coupon: its recorded columns are read


def test_a_commit_made_before_commits_recorded_their_columns_verifies_in_the_tables_order_at_its_commit(destination):
    key = key_for(DAY)
    frame = pa.Table.from_pandas(orders(key), preserve_index=False)
    staged = destination.stage(target_of(key), 1, frame, "csv", manifest_for(key, 1))
    # What a release before the column order was recorded committed: the same layout, no export_ledger.columns.
    deltalake.write_deltalake(
        destination.table_for(key.export), staged.rows, partition_by=[KEY_COLUMN],
        configuration={"delta.logRetentionDuration": "interval 3650 days"},
        commit_properties=deltalake.CommitProperties(
            app_transactions=[deltalake.Transaction(str(key), 1), deltalake.Transaction(fence_id(str(key)), 1),
                              deltalake.Transaction(revision_id(str(key), 1), 0)],
            custom_metadata={"export_ledger.manifest": staged.manifest.to_json().decode()},
        ),
    )  # fmt: skip
    delta_table(destination).alter.add_columns(deltalake.Field("coupon", deltalake.schema.PrimitiveType("string")))
    seen = destination.verify(
        target_of(key), logical_key=str(key), superseded=0, expected_sha256=staged.manifest.sha256
    )
    assert seen.verdict is Verdict.PUBLISHED, f"read in the columns the table had at its commit: {seen.detail}"


# -- routine maintenance: OPTIMIZE, then VACUUM ------------------------------------------------------------------------


def maintain(destination: DeltaDestination) -> list[str]:
    """OPTIMIZE (compaction, and a Z-order that rewrites every file: compaction leaves a partition of one file alone),
    then VACUUM of everything the latest version no longer references; returns the files VACUUM removed."""
    table = delta_table(destination)
    table.optimize.compact()
    table.optimize.z_order(["order_id"])
    return table.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)


def test_after_optimize_and_vacuum_current_revisions_read_and_restate_from_the_latest_version(
    destination, ledger, clock, monkeypatch
):
    kept, restated, later, crashed = (key_for(DAY, tenant=tenant) for tenant in ("acme", "beta", "gamma", "delta"))
    for key in (kept, restated, later, crashed):
        export_key(ledger, destination, SCHEMA, item(key, orders(key)), "run-1/x")
    ledger.restatements.request(str(restated), reason="late rows", requested_by="ops")
    assert export_key(ledger, destination, SCHEMA, item(restated, orders(restated, total=13.0)), "run-2/x").status == (
        "exported"
    )
    assert maintain(destination), "maintenance removed files older versions referenced"

    assert export_key(ledger, destination, SCHEMA, item(kept, orders(kept)), "run-3/x").status == "already_completed"
    for key in (kept, restated):
        recorded_intact(ledger, destination, key)  # the asset check's, load_input's and drift's read
    current = destination.verify(target_of(restated, 2), logical_key=str(restated), superseded=1)
    assert current.verdict is Verdict.PUBLISHED, current.detail
    with pytest.raises(DestinationError, match="superseded and its files are gone"):
        destination.verify_recorded(
            target_of(restated, 1, "r1-t1"), logical_key=str(restated), sha256=current.manifest.sha256
        )  # revision 1 is no longer in the table: VACUUM may remove it, and says so instead of FileNotFoundError

    ledger.restatements.request(str(later), reason="late rows", requested_by="ops")
    assert export_key(ledger, destination, SCHEMA, item(later, orders(later, total=14.0)), "run-4/x").status == (
        "exported"
    )
    recorded_intact(ledger, destination, later)
    # A restatement after maintenance whose run dies after its commit: reconciliation records it.
    ledger.restatements.request(str(crashed), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, "after_publish=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(crashed, orders(crashed, total=15.0)), "run-5/x")
    monkeypatch.delenv(FAILPOINTS)
    clock.advance(minutes=16)
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    assert ledger.queries.get(str(crashed)).state is ExportState.COMPLETED
    assert ledger.restatements.current_revision(str(crashed)).revision == 2
    recorded_intact(ledger, destination, crashed)


def test_a_table_that_vacuums_sooner_than_the_ledger_reads_superseded_revisions_is_refused(tmp_path):
    path, key = str(tmp_path / "short"), key_for(DAY)
    deltalake.DeltaTable.create(
        path, pa.schema([(KEY_COLUMN, pa.string())]), partition_by=[KEY_COLUMN],
        configuration={"delta.deletedFileRetentionDuration": "interval 1 hours"},
    )  # fmt: skip
    short = DeltaDestination(path, retention_days=30)
    for check in (lambda: short.check_table("x"), lambda: short.fence(target_of(key), 2, logical_key=str(key))):
        with pytest.raises(ConfigurationError, match=r"delta.deletedFileRetentionDuration is 'interval 1 hours'"):
            check()
    assert deltalake.DeltaTable(path).version() == 0, "nothing was written to a table that keeps too little"

    made = DeltaDestination(str(tmp_path / "made" / "{export}"))
    made.fence(target_of(key), 2, logical_key=str(key))
    configuration = delta_table(made).metadata().configuration
    assert configuration["delta.deletedFileRetentionDuration"] == "interval 7 days", "set when the table is made"
    DeltaDestination(path, retention_days=30, file_retention_days=0).check_table("x")  # what its owner chose


class MaintainedWhileReading(DeltaDestination):
    """A destination whose next read of the table's latest version is overtaken by OPTIMIZE and a VACUUM that ignores
    the table's retention, between loading the version and reading its files (the race, made certain)."""

    def _open(self, export: str, version: int | None = None):
        table = super()._open(export, version)
        if version is None and table is not None and _MAINTAIN_NEXT_READ:
            _MAINTAIN_NEXT_READ.clear()
            assert maintain(self), "the files the read is about to open are removed"
        return table


_MAINTAIN_NEXT_READ: list[bool] = []


def test_files_vacuumed_under_a_read_of_the_current_revision_make_it_unreachable_never_a_conflict(tmp_path, ledger):
    destination = MaintainedWhileReading(str(tmp_path / "delta" / "{export}"))
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, item(key, orders(key)), "run-1/x")
    _MAINTAIN_NEXT_READ.append(True)
    with pytest.raises(DestinationUnreachable, match="went missing while"):
        destination.rows(target_of(key), str(key), 1)
    recorded_intact(ledger, destination, key)  # read again: the latest version's files are there


# -- many writers at once ------------------------------------------------------------------------------------------


def manifest_for(key, token: int, revision: int = 1) -> Manifest:
    return Manifest.build(
        logical_key=str(key), export=key.export, tenant=key.tenant, window=key.window, row_count=0, sha256="",
        attempt_id=f"run-{token}/x", fencing_token=token, data_file="delta", tz_database="test", revision=revision,
    )  # fmt: skip


def staged_for(destination: DeltaDestination, key, token: int):
    rows = pa.table({"order_id": [f"{key.tenant}-t{token}"], "total": [float(token)]})
    return destination.stage(target_of(key), token, rows, "csv", manifest_for(key, token))


def fences_before_commit(destination: DeltaDestination, logical_key: str) -> int:
    """The highest fence of the key in the log before the entry that committed its revision 1."""
    log = Path(destination.table_for("invoice_export")) / "_delta_log"
    highest = 0
    for entry in sorted(log.glob("*.json")):
        txns = {a["txn"]["appId"]: a["txn"]["version"] for a in map(json.loads, entry.read_text().splitlines())
                if "txn" in a}  # fmt: skip
        if txns.get(logical_key) == 1:
            return highest
        highest = max(highest, txns.get(fence_id(logical_key), 0))
    raise AssertionError(f"no commit of {logical_key} in the log")


def run_together(jobs) -> list[str]:
    """Runs each job in its own thread, all released at once; returns each one's outcome in words."""
    barrier = threading.Barrier(len(jobs))
    outcomes = [""] * len(jobs)

    def run(index: int) -> None:
        barrier.wait()
        try:
            outcomes[index] = jobs[index]()
        except (Fenced, PointerMoved) as exc:
            outcomes[index] = type(exc).__name__
        except Exception as exc:  # anything else is a defect, named in the assertions
            outcomes[index] = f"error {type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_sixteen_writers_of_different_keys_all_land_on_one_new_table(destination):
    keys = [[key_for(DAY, tenant=f"w{writer:02d}k{n}") for n in range(2)] for writer in range(16)]

    def writer(own) -> str:
        for key in own:
            destination.commit(staged_for(destination, key, 1), 1, superseded=0)
        return "committed"

    outcomes = run_together([lambda own=own: writer(own) for own in keys])
    assert outcomes == ["committed"] * 16, outcomes
    table = delta_table(destination)
    for key in (key for own in keys for key in own):
        assert table.transaction_version(str(key)) == 1
        rows = table.to_pyarrow_table(filters=[(KEY_COLUMN, "=", str(key))]).column("order_id").to_pylist()
        assert rows == [f"{key.tenant}-t1"], "each key's own rows, once"
        seen = destination.verify(target_of(key), logical_key=str(key), superseded=0)
        assert seen.verdict is Verdict.PUBLISHED, f"a commit Delta rebased is found from its txn: {seen.detail}"
    assert table.version() == 32 and len(log_actions(destination, "metaData")) == 1, "one create, 32 commits"


def test_sixteen_writers_racing_on_one_key_land_one_revision_while_other_keys_land_and_fences_hold(destination):
    contested = key_for(DAY, tenant="contested")
    destination.commit(staged_for(destination, key_for(DAY, tenant="seed"), 1), 1, superseded=0)

    def takeover(token: int) -> str:  # a party that fences the key first, as a retry or the reconciler does
        destination.fence(target_of(contested), token, logical_key=str(contested))
        destination.commit(staged_for(destination, contested, token), token, superseded=0)
        return f"committed {token}"

    def attempt(token: int) -> str:
        destination.commit(staged_for(destination, contested, token), token, superseded=0)
        return f"committed {token}"

    def other(tenant: str) -> str:
        destination.commit(staged_for(destination, key_for(DAY, tenant=tenant), 1), 1, superseded=0)
        return "other committed"

    jobs = [lambda t=t: takeover(t) for t in (2, 4, 6, 8)] + [lambda t=t: attempt(t) for t in (1, 3, 5, 7)]
    jobs += [lambda n=n: other(f"other{n}") for n in range(8)]
    outcomes = run_together(jobs)
    assert outcomes[8:] == ["other committed"] * 8, f"writers of other keys all land: {outcomes}"
    won = [outcome for outcome in outcomes[:8] if outcome.startswith("committed")]
    assert len(won) == 1 and all(o in ("Fenced", "PointerMoved") for o in outcomes[:8] if o not in won), outcomes
    winner = int(won[0].split()[1])
    table = delta_table(destination)
    rows = table.to_pyarrow_table(filters=[(KEY_COLUMN, "=", str(contested))]).column("order_id").to_pylist()
    assert rows == [f"contested-t{winner}"], "exactly one revision of the contested key, the winner's"
    assert table.transaction_version(str(contested)) == 1
    assert fences_before_commit(destination, str(contested)) <= winner, "no higher fence had landed before it"


def test_a_commit_made_from_an_old_read_lands_over_other_keys_commits_but_never_over_its_own_keys_fence(destination):
    key, other = key_for(DAY, tenant="acme"), key_for(DAY, tenant="beta")
    destination.commit(staged_for(destination, key_for(DAY, tenant="seed"), 1), 1, superseded=0)
    read = delta_table(destination)
    destination.commit(staged_for(destination, other, 1), 1, superseded=0)  # lands after the read
    version = destination._write(read, staged_for(destination, key, 1), 1)
    assert version == read.version() == 3, "Delta rebased the commit over another key's"
    assert delta_table(destination).transaction_version(revision_id(str(key), 1)) == 2, "the version it was made from"
    seen = destination.verify(target_of(key), logical_key=str(key), superseded=0)
    assert seen.verdict is Verdict.PUBLISHED and seen.manifest.fencing_token == 1, seen.detail

    late = key_for(DAY, tenant="gamma")
    destination.fence(target_of(late), 3, logical_key=str(late))  # the key's folder is in the table from here on
    read = delta_table(destination)
    destination.commit(staged_for(destination, key_for(DAY, tenant="delta"), 1), 1, superseded=0)
    destination.fence(target_of(late), 5, logical_key=str(late))  # a takeover after the read
    with pytest.raises(deltalake.exceptions.CommitFailedError):
        destination._write(read, staged_for(destination, late, 4), 4)
    assert delta_table(destination).transaction_version(str(late)) is None, "the fenced party's rows never landed"


class Overtaken(DeltaDestination):
    """A destination whose next write is overtaken: the change in ``_BEFORE_NEXT_WRITE`` lands between its read of
    the table and its own commit."""

    def _write(self, table, staged, token: int) -> int:
        if _BEFORE_NEXT_WRITE:
            _BEFORE_NEXT_WRITE.pop()(self)
        return super()._write(table, staged, token)


_BEFORE_NEXT_WRITE: list = []
#: A change that lands first, and how many times Delta may rebase the commit over commits it does not conflict with.
OVERTAKERS = {
    "another key's commit, past the commit's rebases": (
        lambda d: d.commit(staged_for(d, key_for(DAY, tenant="beta"), 1), 1, superseded=0), 0
    ),
    "a change of the table's properties": (
        lambda d: delta_table(d).alter.set_table_properties({"delta.checkpointInterval": "50"}), 100
    ),
    "a CHECK constraint the rows keep (a protocol upgrade)": (
        lambda d: delta_table(d).alter.add_constraint({"positive_total": "total > 0"}), 100
    ),
    "an OPTIMIZE rewriting the key's files": (lambda d: delta_table(d).optimize.z_order(["order_id"]), 100),
}


@pytest.mark.parametrize("overtaker", list(OVERTAKERS))
def test_a_restatement_that_loses_a_race_reads_the_table_again_and_lands(tmp_path, monkeypatch, overtaker):
    change, rebases = OVERTAKERS[overtaker]
    monkeypatch.setattr(delta_module, "_REBASES", rebases)
    destination = Overtaken(str(tmp_path / "delta" / "{export}"))
    key = key_for(DAY, tenant="acme")
    destination.commit(staged_for(destination, key, 1), 1, superseded=0)
    rows = pa.table({"order_id": ["acme-r2"], "total": [2.0]})
    restated = destination.stage(target_of(key, 2), 2, rows, "csv", manifest_for(key, 2, revision=2))
    _BEFORE_NEXT_WRITE.append(change)
    destination.commit(restated, 2, superseded=1)
    assert not _BEFORE_NEXT_WRITE, "the change landed between the read and the commit"
    table = delta_table(destination)
    assert table.transaction_version(str(key)) == 2, "read again, the restatement landed"
    assert table.to_pyarrow_table(filters=[(KEY_COLUMN, "=", str(key))]).column("order_id").to_pylist() == ["acme-r2"]
    seen = destination.verify(target_of(key, 2), logical_key=str(key), superseded=1)
    assert seen.verdict is Verdict.PUBLISHED, seen.detail


def test_sixteen_parties_making_the_table_at_once_make_it_once(tmp_path):
    for attempt in range(5):
        destination = DeltaDestination(str(tmp_path / f"t{attempt}" / "{export}"))
        key = key_for(DAY, tenant=f"t{attempt}")
        fence = functools.partial(destination.fence, target_of(key), 2, logical_key=str(key))
        outcomes = run_together([lambda fence=fence: fence() and "fenced"] * 16)
        assert outcomes == ["fenced"] * 16, f"a lost race to make the table uses the winner's: {outcomes}"
        assert len(log_actions(destination, "metaData")) == 1, "made once: a lost create never replaces the table's"


# -- rules of the table that refuse rows before anything is committed -------------------------------------------------


def check_constraint(destination: DeltaDestination) -> None:
    delta_table(destination).alter.add_constraint({"positive_total": "total > 0"})


def column_invariant(destination: DeltaDestination) -> None:
    """A table its owner made with an invariant on ``total`` (Delta writer version 2), before the first export."""
    fields = [
        deltalake.Field("order_id", "string"), deltalake.Field("tenant", "string"),
        deltalake.Field("placed_at", "timestamp"),
        deltalake.Field("total", "double", metadata={"delta.invariants": json.dumps(
            {"expression": {"expression": "total > 0"}})}),
        deltalake.Field(KEY_COLUMN, "string"), deltalake.Field("_export_row", "long"),
    ]  # fmt: skip
    deltalake.DeltaTable.create(
        destination.table_for("invoice_export"), deltalake.Schema(fields), partition_by=[KEY_COLUMN],
        configuration={"delta.logRetentionDuration": "interval 3650 days"},
    )  # fmt: skip


RULES = {"check constraint": (check_constraint, "positive_total"), "column invariant": (column_invariant, "'total'")}


def data_files(destination: DeltaDestination) -> set[str]:
    root = Path(destination.table_for("invoice_export"))
    return {str(path.relative_to(root)) for path in root.rglob("*.parquet")}


@pytest.mark.parametrize("rule", list(RULES))
def test_rows_a_table_rule_refuses_fail_the_key_naming_the_rule_and_nothing_is_committed(destination, ledger, rule):
    first, later = key_for(DAY, tenant="acme"), key_for(DAY, tenant="beta")
    add_rule, named = RULES[rule]
    if rule == "column invariant":
        add_rule(destination)
    export_key(ledger, destination, SCHEMA, item(first, orders(first)), "run-1/x")
    if rule == "check constraint":
        add_rule(destination)
    version = delta_table(destination).version()
    with pytest.raises(DestinationError) as refused:
        export_key(ledger, destination, SCHEMA, item(later, orders(later, total=-7.25)), "run-2/x")
    assert not isinstance(refused.value, (PublishOutcomeUnknown, ExportOutcomeUnknown)), "Delta refused: known"
    assert ledger.queries.get(str(later)).state is ExportState.FAILED, "nothing was committed: failed, not unknown"
    [attempt] = ledger.queries.attempts(str(later))
    assert attempt.outcome is AttemptOutcome.FAILED, attempt.error_message
    assert named in attempt.error_message and "total > 0" in attempt.error_message, (
        f"the message names the table's rule: {attempt.error_message}"
    )
    assert "-7.25" not in attempt.error_message and "beta-1772" not in attempt.error_message, "no row is quoted"
    table = delta_table(destination)
    assert table.version() == version and table.transaction_version(str(later)) is None, "nothing was committed"
    assert export_key(ledger, destination, SCHEMA, item(later, orders(later)), "run-3/x").status == "exported", (
        "rows that keep the rule export on the next run: the refusal is no loop"
    )


def test_a_restatement_on_an_append_only_table_fails_naming_the_property_and_writes_no_rows(destination, ledger):
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, item(key, orders(key)), "run-1/x")
    delta_table(destination).alter.set_table_properties({"delta.appendOnly": "true"})
    files = data_files(destination)
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    with pytest.raises(DestinationError) as refused:
        export_key(ledger, destination, SCHEMA, item(key, orders(key, total=13.0)), "run-2/x")
    assert not isinstance(refused.value, (PublishOutcomeUnknown, ExportOutcomeUnknown)), "refused before writing"
    message = str(refused.value)
    assert "delta.appendOnly" in message and "kept changing" not in message, f"the property is named: {message}"
    [_, attempt] = ledger.queries.attempts(str(key))
    assert attempt.outcome is AttemptOutcome.FAILED and "delta.appendOnly" in attempt.error_message, attempt
    table = delta_table(destination)
    assert table.transaction_version(str(key)) == 1, "revision 1 is still the key's rows"
    assert data_files(destination) == files, "no rows were written, not even files no commit references"
    assert ledger.restatements.current_revision(str(key)).revision == 1


def test_rows_that_break_a_generated_columns_expression_are_refused_naming_the_column(destination):
    fields = [
        deltalake.Field("order_id", "string"), deltalake.Field("total", "double"),
        deltalake.Field("doubled", "double", metadata={"delta.generationExpression": "total * 2"}),
        deltalake.Field(KEY_COLUMN, "string"), deltalake.Field("_export_row", "long"),
    ]  # fmt: skip
    deltalake.DeltaTable.create(destination.table_for("invoice_export"), deltalake.Schema(fields),
                                partition_by=[KEY_COLUMN],
                                configuration={"delta.logRetentionDuration": "interval 3650 days"})  # fmt: skip
    key = key_for(DAY)
    rows = pa.table({"order_id": ["acme-1"], "total": [1.5], "doubled": [4.0]})
    staged = destination.stage(target_of(key), 1, rows, "csv", manifest_for(key, 1))
    with pytest.raises(DestinationError, match=r"generated column 'doubled' \(total \* 2\)") as refused:
        destination.commit(staged, 1, superseded=0)
    assert not isinstance(refused.value, PublishOutcomeUnknown), "refused before any log entry was written"
    assert "acme-1" not in str(refused.value), "no row is quoted"
    assert delta_table(destination).transaction_version(str(key)) is None


def upgrade_to_a_writer_feature_deltalake_lacks(destination: DeltaDestination) -> None:
    """The next log entry raises the table's protocol to a writer feature deltalake does not know, as a newer Delta
    writer's upgrade of the table would."""
    log = Path(destination.table_for("invoice_export")) / "_delta_log"
    protocol = {"minReaderVersion": 1, "minWriterVersion": 7, "writerFeatures": ["futureWriterFeature"]}
    entry = [{"protocol": protocol}, {"commitInfo": {"operation": "UPGRADE PROTOCOL"}}]
    next_entry = log / f"{delta_table(destination).version() + 1:020d}.json"
    next_entry.write_text("".join(json.dumps(action) + "\n" for action in entry))


def test_a_table_needing_a_writer_feature_deltalake_lacks_fails_the_key_at_once_naming_the_feature(destination, ledger):
    """Delta refuses before writing anything: no race, so nothing is read again and written 16 times."""
    first, later = key_for(DAY, tenant="acme"), key_for(DAY, tenant="beta")
    export_key(ledger, destination, SCHEMA, item(first, orders(first)), "run-1/x")
    upgrade_to_a_writer_feature_deltalake_lacks(destination)
    version, files = delta_table(destination).version(), data_files(destination)
    with pytest.raises(DestinationError) as refused:
        export_key(ledger, destination, SCHEMA, item(later, orders(later)), "run-2/x")
    assert not isinstance(refused.value, (PublishOutcomeUnknown, ExportOutcomeUnknown)), "refused before writing"
    message = str(refused.value)
    assert "futureWriterFeature" in message and "kept changing" not in message, f"the feature is named: {message}"
    [attempt] = ledger.queries.attempts(str(later))
    assert attempt.outcome is AttemptOutcome.FAILED, attempt.error_message
    assert delta_table(destination).version() == version and data_files(destination) == files, "nothing was written"
    ledger.restatements.request(str(first), reason="late rows", requested_by="ops")
    with pytest.raises(DestinationError, match="refused the fence of .*futureWriterFeature") as refused:
        export_key(ledger, destination, SCHEMA, item(first, orders(first, total=13.0)), "run-3/x")
    assert not isinstance(refused.value, (PublishOutcomeUnknown, ExportOutcomeUnknown)), "the fence, refused: known"
    assert delta_table(destination).version() == version, "not even the restatement's fence was written"


def test_a_table_dropped_and_made_again_at_the_same_path_is_judged_by_the_new_tables_log(destination):
    """A long-lived process (a code server, the reconciliation sensor's) keeps what it read of log entries: those of
    a table since dropped must not stand for the entries of the table made again at the same path."""
    key = key_for(DAY)
    destination.commit(staged_for(destination, key, 1), 1, superseded=0)
    seen = destination.verify(target_of(key), logical_key=str(key), superseded=0)
    assert seen.verdict is Verdict.PUBLISHED and seen.manifest.fencing_token == 1, seen.detail
    shutil.rmtree(destination.table_for("invoice_export"))
    again = staged_for(destination, key, 2)
    destination.commit(again, 2, superseded=0)
    seen = destination.verify(target_of(key), logical_key=str(key), superseded=0, expected_sha256=again.manifest.sha256)
    assert seen.verdict is Verdict.PUBLISHED, f"the new table's commit is intact: {seen.detail}"
    assert seen.manifest.fencing_token == 2 and seen.location.endswith("/r1-t2"), "read from the new table's entry"
