"""Restatements from the user's side (issue #12, parts 3 and 5): the CLI, the launchpad's run config, the sensors.

End to end in process, as tests/test_drift.py: a SQL source changes after its key completed, the drift sensor marks
the key stale with the right counts, a restatement (``export-ledger restate``, the run config, or ``restate_stale``
through the drift and reconciliation sensors) publishes revision 2 beside revision 1 with its reason recorded;
``load_input`` returns the current revision (never one half-written), the materialization names the revision and the
reason, and ``export-ledger revisions`` lists both.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
import sqlite3
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from builders import drift_day as _day
from builders import drift_environ as _environ
from builders import drift_source as _source
from builders import drift_spec as _spec
from builders import late_deleted_and_updated as _late_deleted_and_updated
from builders import open_ledger
from pipeline_helpers import failure_message, key_rows, make_defs, published_dirs, read_export, run_partition, tick

from export_ledger import cli
from export_ledger.dagster import ledgered_definitions
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ExportState
from export_ledger.restate import asset_name_for

REASON = "late invoices from the billing fix"
KEY = "invoice_export/acme/2026-03-08T05:00:00Z"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from export_ledger import cli

    capsys.readouterr()  # what Dagster logged before is not the command's
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class Shop:
    """One export of a SQL source with its code location, ledger and Dagster instance."""

    def __init__(self, tmp_path: Path, instance: dg.DagsterInstance, **overrides) -> None:
        self.db = tmp_path / "shop.sqlite3"
        self.spec = _spec(self.db, **overrides)
        _source(self.db, self.spec)  # acme's rows o0..o4
        with sqlite3.connect(self.db) as conn:  # two rows of each other tenant, inside every zone's window of the day
            conn.executemany(
                "INSERT INTO orders SELECT ? || substr(order_id, 2), ?, placed_at, total, version FROM orders "
                "WHERE order_id IN ('o1', 'o2')",
                [(f"{tenant}-", tenant) for tenant in self.spec.tenants if tenant != "acme"],
            )
        self.environ = _environ(tmp_path)
        self.url = self.environ["EXPORTS_LEDGER_URL"]
        self.root = Path(self.environ["EXPORTS_DESTINATION"])
        self.defs = ledgered_definitions([self.spec], environ=self.environ)
        self.instance = instance
        self.day = _day().isoformat()
        self.ledger = open_ledger(self.url)

    def run(self, run_config: dict | None = None, *, job: str = "orders_job", partition: str | None = None, **kw):
        return self.defs.resolve_job_def(job).execute_in_process(
            partition_key=partition or self.day,
            instance=self.instance,
            run_config=run_config or {},
            raise_on_error=False,
            **kw,
        )

    def key(self, tenant: str = "acme") -> str:
        (record,) = self.ledger.queries.records(tenant=tenant)
        return record.logical_key

    def key_folder(self, tenant: str = "acme") -> Path:
        return self.root / "orders" / f"tenant={tenant}" / f"date={self.day}"

    def folder(self, revision: int = 1, tenant: str = "acme") -> Path:
        """The place of ``revision`` the key's ledger record names (``r<revision>-t<token>``: the claim that
        published it)."""
        (recorded,) = [r for r in self.ledger.restatements.revisions(self.key(tenant)) if r.revision == revision]
        place = Path(recorded.location)
        assert place.parent == self.key_folder(tenant) and place.name.startswith(f"r{revision}-t"), recorded.location
        return place

    def pointer(self, tenant: str = "acme") -> int:
        """The revision the key's pointer names: what readers see (0: nothing)."""
        return json.loads((self.key_folder(tenant) / POINTER_NAME).read_text())["revision"]

    def current_place(self, tenant: str = "acme") -> Path:
        """The place the key's pointer names."""
        return self.key_folder(tenant) / json.loads((self.key_folder(tenant) / POINTER_NAME).read_text())["path"]

    def load(self) -> pd.DataFrame:
        """What a downstream asset of ``orders`` gets for the day (the I/O manager's ``load_input``)."""
        seen = []
        (export_asset,) = [a for a in self.defs.assets if a.key == dg.AssetKey("orders")]

        @dg.asset(partitions_def=export_asset.partitions_def, ins={"orders": dg.AssetIn()})
        def order_rows(orders: pd.DataFrame) -> None:
            seen.append(orders)

        result = dg.materialize(
            [export_asset, order_rows],
            partition_key=self.day,
            instance=self.instance,
            resources=self.defs.resources,
            selection=[dg.AssetKey("order_rows")],
            raise_on_error=False,
        )
        assert result.success, failure_message(result)
        return seen[0]


def _every_total_corrected(db: Path) -> None:
    """Every row of every tenant changes (its total), so each key's next restatement has data of its own."""
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE orders SET total = total + 1")


def _rows(out: str) -> dict[str, list[str]]:
    """A CLI table's rows by their first cell (cells are separated by two spaces or more)."""
    lines = [line for line in out.splitlines() if line.startswith("orders/")]
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in lines)}


def _key_of(shop: Shop, logical_key: str) -> LogicalKey:
    record = shop.ledger.queries.get(logical_key)
    return LogicalKey(record.export, record.tenant, record.window)


def read_revision(folder: Path) -> tuple[Manifest, bytes]:
    manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes(), str(folder))
    payload = (folder / manifest.data_file).read_bytes()
    assert hashlib.sha256(payload).hexdigest() == manifest.sha256, f"{folder} is intact"
    return manifest, payload


def materialization(result: dg.ExecuteInProcessResult) -> dg.AssetMaterialization:
    (event,) = [e.materialization for e in result.get_asset_materialization_events()]
    return event


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


# -- the "done when", through the CLI ------------------------------------------------------------------------


def test_a_stale_key_restated_from_the_cli_publishes_revision_2_beside_revision_1(tmp_path, instance, capsys) -> None:
    shop = Shop(tmp_path, instance)
    assert shop.run().success
    key = shop.key()
    original_manifest, original = read_revision(shop.folder(1))

    _late_deleted_and_updated(shop.db, shop.spec)
    found = tick(shop.defs, instance, sensor_name="drift_sensor")
    (drift,) = shop.ledger.drift.open_records()
    assert (drift.rows_added, drift.rows_removed, drift.rows_changed) == (1, 1, 1), "stale with the right counts"
    assert shop.ledger.restatements.open_requests([key]) == {}, "restate_stale is off: drift alone requests nothing"

    code, out, _ = _cli(capsys, "--ledger-url", shop.url, "restate", key, "--reason", REASON, "--operator", "ops")
    assert code == 0, out
    assert _rows(out)[key] == ["revision 2", "requested"]
    assert f"materialize: dagster asset materialize -f definitions.py --select orders --partition {shop.day}" in out
    assert "reconciliation sensor" in out
    assert shop.ledger.queries.get(key).state is ExportState.COMPLETED, "recorded first"
    assert shop.pointer() == 1, "nothing moved"

    code, out, _ = _cli(capsys, "--ledger-url", shop.url, "status", "--state", "restating", "--json")
    (pending,) = json.loads(out)
    assert (pending["logical_key"], pending["revision"], pending["reason"], pending["requested_by"]) == (
        key,
        2,
        REASON,
        "ops",
    )
    assert pending["state"] == "completed"

    # The command the CLI printed, as Dagster runs it: the partition's next materialization restates the key.
    result = shop.run()
    assert result.success, failure_message(result)
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert checks["partition_health"].metadata["status"].value == "healthy", "restated: nothing left open"
    assert checks["partition_health"].metadata["verified_at_destination"].value == 1, "the current revision verified"

    assert shop.pointer() == 2 and shop.current_place() == shop.folder(2), "readers see the revision recorded"
    manifest, _ = read_revision(shop.folder(2))
    assert (manifest.revision, manifest.supersedes_revision, manifest.supersedes_sha256) == (
        2,
        1,
        original_manifest.sha256,
    )
    assert read_revision(shop.folder(1)) == (original_manifest, original), "revision 1 is still readable, unchanged"
    assert manifest.row_count == 5, "the source as it is now: o0 removed, 'late' added"

    event = materialization(result)
    assert event.metadata["restated_keys"].value == 1
    assert event.metadata["revisions"].value == {
        key: {"revision": 2, "supersedes": 1, "reason": REASON, "requested_by": "ops"}
    }
    assert shop.ledger.drift.open_records() == [], "the new revision was read from the source as it is: not stale"
    (verdict,) = tick(shop.defs, instance, found.cursor, sensor_name="drift_sensor").check_evaluations
    assert verdict.passed and verdict.metadata["stale_keys"].value == 0, "source_unchanged passes again"

    loaded = shop.load()
    assert set(loaded["order_id"]) == {"o1", "o2", "o3", "o4", "late"}, "load_input returns revision 2"
    assert loaded.loc[loaded["order_id"] == "o3", "version"].item() == 2

    code, out, _ = _cli(capsys, "--ledger-url", shop.url, "revisions", key)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["REVISION", "SHA256", "ROWS"]
    assert lines[1].split()[:3] == ["1", original_manifest.sha256, "5"] and "first export" in lines[1]
    assert lines[2].split()[:3] == ["2", manifest.sha256, "5"] and REASON in lines[2] and "ops" in lines[2]
    assert lines[-1] == "current: revision 2"
    code, out, _ = _cli(capsys, "--ledger-url", shop.url, "revisions", key, "--json")
    history = json.loads(out)
    assert [(h["revision"], h["supersedes_revision"], h["reason"]) for h in history] == [
        (1, None, "first export"),
        (2, 1, REASON),
    ]
    assert history[1]["location"] == str(shop.folder(2)) and history[1]["published_by"].startswith(result.run_id)

    code, out, _ = _cli(capsys, "--ledger-url", shop.url, "status")
    assert out.splitlines()[1].split()[-1] == "2", "status shows the current revision once it is > 1"
    assert json.loads(_cli(capsys, "--ledger-url", shop.url, "status", "--json")[1])[0]["revision"] == 2


def test_restate_refuses_without_a_reason_a_key_not_completed_and_a_second_open_request(
    tmp_path, instance, capsys, monkeypatch
) -> None:
    shop = Shop(tmp_path, instance)
    assert shop.run().success
    key, url = shop.key(), shop.url

    code, _, err = _cli(capsys, "--ledger-url", url, "restate", key)
    assert code == 2 and "needs a reason" in err, "a missing option is a usage error (exit 2), as argparse's are"
    code, _, err = _cli(capsys, "--ledger-url", url, "restate", key, "--reason", "   ")
    assert code == 1 and "needs a reason" in err
    code, _, err = _cli(capsys, "--ledger-url", url, "restate", "orders/nobody/2026-01-01T05:00:00Z", "--reason", "x")
    assert code == 1 and "unknown logical key" in err
    code, _, err = _cli(capsys, "--ledger-url", url, "restate", key, "--export", "orders", "--date", shop.day)
    assert code == 2 and "not both" in err
    code, _, err = _cli(capsys, "--ledger-url", url, "restate", "--date", shop.day, "--reason", "x")
    assert code == 2 and "--date needs --export" in err
    # A withdrawal looks at the key's destination (it holds the key and fences the pointer before judging it).
    withdrawal = ("--ledger-url", url, "restate", "--withdraw", key, "--destination", str(shop.root))
    code, _, err = _cli(capsys, *withdrawal, "--reason", "no longer needed")
    assert code == 1 and "no open restatement to withdraw" in err

    assert _cli(capsys, "--ledger-url", url, "restate", key, "--reason", REASON)[0] == 0
    code, _, err = _cli(capsys, "--ledger-url", url, "restate", key, "--reason", "again")
    assert code == 1 and "already has an open restatement (revision 2" in err

    # A restatement that fails after its claim leaves the key failed with revision 1 current.
    monkeypatch.setenv(FAILPOINTS, "after_stage=raise")
    assert not shop.run().success
    assert shop.ledger.queries.get(key).state is ExportState.FAILED and shop.pointer() == 1
    code, _, err = _cli(capsys, "--ledger-url", url, "restate", key, "--reason", "again")
    assert code == 1 and "already has an open restatement" in err
    code, out, _ = _cli(capsys, *withdrawal, "--reason", "source is gone")
    assert code == 0 and "withdrawn" in out
    assert shop.ledger.queries.get(key).state is ExportState.COMPLETED
    assert _cli(capsys, "--ledger-url", url, "status", "--state", "restating")[1].strip() == "no open restatements"

    # A key that is not completed (its first export failed) is refused, named.
    earlier = (_day() - dt.timedelta(days=1)).isoformat()
    assert not shop.run(partition=earlier).success
    monkeypatch.delenv(FAILPOINTS)
    (failed,) = shop.ledger.queries.records(states=[ExportState.FAILED])
    code, _, err = _cli(capsys, "--ledger-url", url, "restate", failed.logical_key, "--reason", "x")
    assert code == 1 and "is failed: only a completed key is restated" in err
    by_date = ("restate", "--export", "orders", "--date", earlier, "--reason", "x")
    code, _, err = _cli(capsys, "--ledger-url", url, *by_date)
    assert code == 1 and "is failed: only a completed key is restated" in err


# -- from the launchpad: the run config --------------------------------------------------------------------------------


def _restate(reason: str = "", tenants: list[str] | None = None) -> dict:
    config: dict = {"restate_reason": reason}
    if tenants is not None:
        config["restate_tenants"] = tenants
    return {"ops": {"orders": {"config": config}}}


def test_a_restatement_from_the_launchpad_needs_its_reason_and_is_asked_by_the_run(tmp_path, instance) -> None:
    shop = Shop(tmp_path, instance, tenants=["acme", "globex"])
    assert shop.run().success
    acme, globex = shop.key("acme"), shop.key("globex")
    plain = shop.run()  # a schedule's, backfill's or sensor's run passes no config
    assert plain.success and materialization(plain).metadata["skipped_keys"].value == 2
    assert "restated_keys" not in materialization(plain).metadata

    no_reason = shop.run(_restate("", ["acme"]))
    assert not no_reason.success and "given without restate_reason" in failure_message(no_reason)
    stranger = shop.run(_restate(REASON, ["acme", "nobody"]))
    assert not stranger.success and "['nobody'] are not tenants of the asset orders" in failure_message(stranger)
    assert shop.ledger.restatements.requests(open_only=False) == [], "a refused config records nothing"

    _late_deleted_and_updated(shop.db, shop.spec)
    result = shop.run(_restate(REASON, ["acme"]))
    assert result.success, failure_message(result)
    event = materialization(result)
    assert event.metadata["revisions"].value == {
        acme: {"revision": 2, "supersedes": 1, "reason": REASON, "requested_by": result.run_id}
    }
    assert {r["tenant"]: r["status"] for r in key_rows(event.metadata)} == {
        "acme": "restated",
        "globex": "already_completed",
    }
    (first, second) = shop.ledger.restatements.revisions(acme)
    assert (second.revision, second.reason, second.requested_by) == (2, REASON, result.run_id)
    assert second.published_by.startswith(result.run_id)
    assert [r.revision for r in shop.ledger.restatements.revisions(globex)] == [1], "only the listed tenant is restated"
    assert shop.pointer("acme") == 2 and shop.pointer("globex") == 1

    # Every tenant of the partition when none is listed; an open request elsewhere stands with its own reason.
    # Both tenants' rows change first: a restatement of the current revision's data publishes nothing.
    _every_total_corrected(shop.db)
    shop.ledger.restatements.request(globex, reason="operator's reason", requested_by="ops")
    everyone = shop.run(_restate("second correction"))
    assert everyone.success, failure_message(everyone)
    revisions = materialization(everyone).metadata["revisions"].value
    assert revisions[acme]["revision"] == 3 and revisions[acme]["reason"] == "second correction"
    assert revisions[globex] == {"revision": 2, "supersedes": 1, "reason": "operator's reason", "requested_by": "ops"}


# -- automatic restatement, and the reconciliation sensor's launches ---------------------------------------------------


def test_restate_stale_is_requested_by_the_drift_sensor_and_launched_by_the_reconciliation_sensor(
    tmp_path, instance, capsys
) -> None:
    shop = Shop(tmp_path, instance, restate_stale=True)
    assert shop.run().success
    key = shop.key()
    quiet = tick(shop.defs, instance)
    assert quiet.result.run_requests == [] and "0 with open restatements" in quiet.skip_message

    _late_deleted_and_updated(shop.db, shop.spec)
    drift = tick(shop.defs, instance, sensor_name="drift_sensor")
    request = shop.ledger.restatements.open_requests([key])[key]
    assert (request.revision, request.reason, request.requested_by) == (
        2,
        "source changed: +1 -1 ~1 rows",
        "drift-sensor",
    )
    assert any("restatement requested (revision 2" in r.getMessage() for r in drift.logs)

    launch = tick(shop.defs, instance, quiet.cursor)
    (run_request,) = launch.result.run_requests
    (work,) = shop.ledger.attention.restating_partitions(limit=10)  # the partition's open requests, digested
    assert (run_request.run_key, run_request.job_name, run_request.partition_key) == (
        f"restate/orders/{shop.day}/{work.digest}",
        "orders_job",
        shop.day,
    )
    assert run_request.tags["export-ledger/restatement"] == "true"
    again = tick(shop.defs, instance, launch.cursor)
    assert [r.run_key for r in again.result.run_requests] == [run_request.run_key], "the same request, the same key"

    result = shop.run(tags=run_request.tags)
    assert result.success, failure_message(result)
    assert materialization(result).metadata["revisions"].value[key]["reason"] == "source changed: +1 -1 ~1 rows"
    assert [r.revision for r in shop.ledger.restatements.revisions(key)] == [1, 2] and shop.pointer() == 2
    assert tick(shop.defs, instance, again.cursor).result.run_requests == [], "published: nothing more to launch"
    tick(shop.defs, instance, drift.cursor, sensor_name="drift_sensor")
    assert shop.ledger.drift.open_records() == [] and shop.ledger.restatements.requests() == []

    # A withdrawn automatic request is not asked for again while the drift stays the same.
    with sqlite3.connect(shop.db) as conn:
        conn.execute("UPDATE orders SET version = 3 WHERE order_id = 'o1'")
    third = tick(shop.defs, instance, sensor_name="drift_sensor")
    assert shop.ledger.restatements.open_requests([key])[key].reason == "source changed: +0 -0 ~1 rows"
    withdrawal = ("--ledger-url", shop.url, "restate", "--withdraw", key, "--destination", str(shop.root))
    code, _, _ = _cli(capsys, *withdrawal, "--reason", "known, harmless")
    assert code == 0
    tick(shop.defs, instance, third.cursor, sensor_name="drift_sensor")
    assert shop.ledger.restatements.requests() == [], "not asked for again"
    assert len(shop.ledger.drift.open_records()) == 1, "stale, left to the operator"


def test_restating_a_date_requests_each_completed_key_and_the_sensor_launches_each_zones_partition_once(
    tmp_path, instance, capsys
) -> None:
    tenants = ("acme", "globex", "initech", "kolkata")
    shop = Shop(tmp_path, instance, tenants={"acme": None, "globex": None, "initech": None, "kolkata": "Asia/Kolkata"})
    assert shop.run().success and shop.run(job="orders__asia_kolkata_job").success
    args = ("--ledger-url", shop.url, "restate", "--export", "orders", "--date", shop.day, "--reason", REASON)

    code, out, _ = _cli(capsys, *args, "--tenant", "globex")
    assert code == 0 and _rows(out) == {shop.key("globex"): ["revision 2", "requested"]}
    code, out, _ = _cli(capsys, *args)
    assert code == 1, "globex already has an open request: refused, named, and the others requested"
    rows = _rows(out)
    assert rows[shop.key("globex")][0].startswith("refused: ") and "already has an open restatement" in out
    for tenant in ("acme", "initech", "kolkata"):
        assert rows[shop.key(tenant)] == ["revision 2", "requested"]
    assert f"--select orders --partition {shop.day}" in out
    assert f"--select orders__asia_kolkata --partition {shop.day}" in out, "the other zone's asset"

    # The asset is named by the attempt that completed the key; without one of that form, by the attempt that
    # completed another key of its zone (the guess from the zones comes last: tests/test_cli.py).
    records = {t: shop.ledger.queries.get(shop.key(t)) for t in tenants}
    unnamed = {t: dataclasses.replace(record, committed_attempt="operator") for t, record in records.items()}
    assert asset_name_for(shop.ledger, unnamed["acme"]) == ("orders", True)
    assert asset_name_for(shop.ledger, unnamed["kolkata"]) == ("orders__asia_kolkata", True)
    assert asset_name_for(shop.ledger, shop.ledger.queries.get(shop.key("kolkata"))) == ("orders__asia_kolkata", True)

    launch = tick(shop.defs, instance)
    runs = sorted((r.job_name, r.partition_key) for r in launch.result.run_requests)
    assert runs == [("orders__asia_kolkata_job", shop.day), ("orders_job", shop.day)], "one run per zone's partition"
    _every_total_corrected(shop.db)  # new data for every tenant: an identical restatement would publish nothing
    for run_request in launch.result.run_requests:
        result = shop.run(job=run_request.job_name, partition=run_request.partition_key, tags=run_request.tags)
        assert result.success, failure_message(result)
    assert shop.ledger.restatements.requests() == []
    assert {t: shop.pointer(t) for t in tenants} == dict.fromkeys(tenants, 2)


# -- load_input: the current revision, never a half-written one --------------------------------------------------------


def test_load_input_returns_the_current_revision_while_a_restatement_is_under_way_failed_or_unrecorded(
    tmp_path, instance, monkeypatch
) -> None:
    shop = Shop(tmp_path, instance)
    assert shop.run().success
    key = shop.key()
    revision_1 = {"o0", "o1", "o2", "o3", "o4"}
    assert set(shop.load()["order_id"]) == revision_1

    _late_deleted_and_updated(shop.db, shop.spec)
    shop.ledger.restatements.request(key, reason=REASON, requested_by="ops")
    assert shop.run().success
    revision_2 = {"o1", "o2", "o3", "o4", "late"}
    assert set(shop.load()["order_id"]) == revision_2

    _source(shop.db, shop.spec)  # back to revision 1's rows: revision 3 would hold them again
    shop.ledger.restatements.request(key, reason="revert the billing fix", requested_by="ops")
    claim = shop.ledger.claims.claim(_key_of(shop, key), "someone/else")
    assert claim.revision == 3
    assert set(shop.load()["order_id"]) == revision_2, "under way: the current revision is still 2"
    shop.ledger.completions.fail(claim, RuntimeError("source timed out"))
    assert set(shop.load()["order_id"]) == revision_2, "failed: revision 2 is still current"

    # Revision 3 committed (the pointer names it), but never recorded: the ledger's revision 2 is read until then.
    monkeypatch.setenv(FAILPOINTS, "after_publish=raise")
    assert not shop.run().success
    monkeypatch.delenv(FAILPOINTS)
    assert shop.ledger.queries.get(key).state is ExportState.REMOTE_UNKNOWN and shop.pointer() == 3
    assert set(shop.load()["order_id"]) == revision_2

    reconciled = tick(shop.defs, instance)  # reconciliation finds revision 3 published and records it
    (event,) = reconciled.materializations
    assert event.partition == shop.day, "the partition's earlier materialization was revision 2's: this is 3's"
    assert event.metadata["revisions"].value == {
        key: {"revision": 3, "supersedes": 2, "reason": "revert the billing fix", "requested_by": "ops"}
    }
    assert shop.ledger.queries.get(key).state is ExportState.COMPLETED
    assert [r.revision for r in shop.ledger.restatements.revisions(key)] == [1, 2, 3]
    assert set(shop.load()["order_id"]) == revision_1


def test_export_ledger_drift_requests_the_restatements_of_restate_stale_exports(
    tmp_path, instance, capsys, monkeypatch
) -> None:
    shop = Shop(tmp_path, instance, restate_stale=True)
    module = tmp_path / "restate_specs.py"
    module.write_text(
        "from test_drift import _spec\n"
        f"orders = _spec(__import__('pathlib').Path({str(shop.db)!r}), restate_stale=True)\n"
    )
    assert shop.run().success
    key = shop.key()
    monkeypatch.chdir(tmp_path)
    drift = ("--ledger-url", shop.url, "drift", "--specs", "restate_specs:orders", "--destination", str(shop.root))

    _late_deleted_and_updated(shop.db, shop.spec)
    code, out, _ = _cli(capsys, *drift, "--operator", "ops@desk")
    assert code == 0 and "1 restatement(s) requested" in out
    request = shop.ledger.restatements.open_requests([key])[key]
    assert (request.reason, request.requested_by) == ("source changed: +1 -1 ~1 rows", "export-ledger drift (ops@desk)")
    code, out, _ = _cli(capsys, *drift)
    assert code == 0 and "restatement(s) requested" not in out, "the same drift asks once"


# -- a restatement whose data is the current revision's ----------------------------------------------------------------


def test_an_identical_restatement_is_closed_unchanged_visibly_and_never_launched_again(tmp_path, instance, capsys):
    defs = make_defs(tmp_path)
    assert run_partition(defs, instance, "2026-03-08").success
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
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
