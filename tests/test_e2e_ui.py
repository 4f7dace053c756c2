"""End to end on the production stack: dagster-webserver and dagster-daemon as real processes on a PostgreSQL instance
configured by ``deploy/dagster.yaml``, driven through the webserver's GraphQL API and a headless Chromium.

One stack serves the module (starting it costs about 15 s of two cores). Its Dagster storage and the ledger share one
PostgreSQL database created for the module and dropped afterwards, as ``deploy/dagster.yaml`` allows in production.
The instance file is the production one with only its polling intervals shortened; the limits are the production
limits. Every export pauses one second after its claim (``EXPORTS_FAILPOINTS=after_claim=pause:1``) so steps last long
enough for overlaps to show and for a test to kill a worker that holds a lease. Leases last 10 s instead of 900 s.
The project's schedule and sensors run as they do in production; the sample source is down for one tenant on one date.
The module takes about five minutes on two shared cores, most of it waiting for the daemons' 30-second ticks (the
backfill daemon's, and partition_health_sensor's for the last test).

Without PostgreSQL the module skips with the reason (with ``CI=true`` it fails); without Chromium, chromedriver or
selenium the browser test does the same. ``EXPORTS_SCREENSHOT_TO=<path>`` also saves the browser's screenshot there
(the README's picture is made that way); ``EXPORTS_SCREENSHOT_DIR=docs`` saves the partition health pictures
(``partition-health.png``, ``partition-health-check.png``) there.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa
import yaml
from builders import open_ledger
from sqlalchemy.engine import make_url

from export_ledger.ledger import ExportLedger, ExportRecord, dispose_engines
from export_ledger.ledger.drift import DriftFinding
from export_ledger.ledger.schema import AttemptOutcome, ExportState

PROJECT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PRODUCTION_INSTANCE = PROJECT / "deploy" / "dagster.yaml"
LOCATION = "export-ledger"
ASSET = "invoice_export"
TENANTS = ("acme", "globex")  # the New York tenants: the asset invoice_export
KOLKATA_ASSET, KOLKATA_TENANT = "invoice_export__asia_kolkata", "bombay-traders"  # a tenant in its own zone
# One stack (webserver, daemon, PostgreSQL instance) for the module: its tests stay on one xdist worker together.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e_stack")]
POOL = "exports-local-invoice_export"  # the invoice export's pool on a local-folder destination

PARTITIONS_PER_RUN = 3  # the backfill chunk for this stack (production: 31); see _LOCATION_SOURCE
LEASE_TTL_SECONDS = 10
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

JOB = f"{ASSET}_job"  # the export's own job, as the schedule and the sensors launch it
OUTAGE_TENANT, OUTAGE_DATE = "globex", "2026-05-06"  # the one tenant and business day whose source is down
HEALTHY_DATE, STALE_DATE = "2026-05-04", "2026-05-05"  # the days before it: one left alone, one whose source changes

# The code location of this stack: the project's own composition root with a smaller backfill chunk, so that a
# 12-partition backfill is 4 runs that compete for the pool (production uses definitions.py:defs, chunk 31), and the
# sample source down for one tenant on one day, as an outage of a real source would be.
_LOCATION_SOURCE = f"""\
from pathlib import Path

from definitions import build_definitions
from export_ledger import SourceError
from resources.invoices import SampleInvoiceSource

CORRECTIONS = Path(__file__).parent / "corrections"


class SampleInvoicesWithOutage(SampleInvoiceSource):
    def rows(self, tenant, start_utc, end_utc):
        if tenant == "{OUTAGE_TENANT}" and start_utc.date().isoformat() == "{OUTAGE_DATE}":
            raise SourceError("the invoice source refused the query")
        rows = super().rows(tenant, start_utc, end_utc)
        return rows.iloc[:-1] if _corrected(start_utc) else rows

    def count(self, tenant, start_utc, end_utc):
        return super().count(tenant, start_utc, end_utc) - (1 if _corrected(start_utc) else 0)


def _corrected(start_utc):
    # A date corrected upstream (a file named after it in corrections/): its window's last invoice was voided.
    return (CORRECTIONS / start_utc.date().isoformat()).exists()


defs = build_definitions(
    tenants={{"acme": "America/New_York", "globex": "America/New_York", "bombay-traders": "Asia/Kolkata"}},
    max_partitions_per_run={PARTITIONS_PER_RUN},
    source=SampleInvoicesWithOutage(),
)
"""

_FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}


def _production_instance() -> dict:
    return yaml.safe_load(PRODUCTION_INSTANCE.read_text())


def _pool_limit() -> int:
    return _production_instance()["concurrency"]["pools"]["default_limit"]


def _backfill_run_limit() -> int:
    (limit,) = [
        rule["limit"]
        for rule in _production_instance()["concurrency"]["runs"]["tag_concurrency_limits"]
        if rule["key"] == "dagster/backfill"
    ]
    return limit


def _test_instance() -> dict:
    """The production instance with test-sized polling intervals; limits, storage and retries unchanged."""
    config = _production_instance()
    config["run_coordinator"]["config"]["dequeue_interval_seconds"] = 1
    config["run_monitoring"]["poll_interval_seconds"] = 5
    config["run_monitoring"]["free_slots_after_run_end_seconds"] = 5
    return config


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(command: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    # A session (process group) of its own: the code server and run workers it spawns stay in that group, so one
    # signal to the group stops all of them.
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM to the process group, SIGKILL to it after ``timeout``; always reaps the leader."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig is signal.SIGTERM:
            try:  # the leader is gone; its children (code server, run workers) may not be
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _eventually(what: str, probe: Callable[[], object], timeout: float, interval: float = 1.0, diagnostics=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:.0f}s\n{diagnostics()}")
        time.sleep(interval)


def _max_overlap(intervals: list[tuple[dt.datetime, dt.datetime]]) -> int:
    """The largest number of intervals open at one instant (an interval ending when another starts does not count)."""
    edges = sorted(
        [(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals], key=lambda e: (e[0], e[1])
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


@dataclass
class Stack:
    url: str
    home: Path
    env: dict[str, str]
    ledger_url: str
    exports: Path
    logs: list[Path] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def diagnostics(self) -> str:
        return "\n".join(f"--- {log.name} (last lines)\n{_tail(log)}" for log in self.logs)

    def gql(self, query: str, **variables) -> dict:
        response = requests.post(f"{self.url}/graphql", json={"query": query, "variables": variables}, timeout=30)
        response.raise_for_status()
        body = response.json()
        assert not body.get("errors"), f"GraphQL errors: {body['errors']}"
        return body["data"]

    def ledger(self) -> ExportLedger:
        return open_ledger(self.ledger_url)

    def launch_partition(
        self,
        partition: str | tuple[str, str],
        asset: str = ASSET,
        run_config: dict | None = None,
        job: str = "__ASSET_JOB",
        **tags: str,
    ) -> str:
        """Launches a run of one partition, or of a ``(first, last)`` range in one run (as a backfill chunk)."""
        if isinstance(partition, tuple):
            first, last = partition
            where = {"dagster/asset_partition_range_start": first, "dagster/asset_partition_range_end": last}
        else:
            where = {"dagster/partition": partition}
        data = self.gql(
            """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
                 __typename ... on LaunchRunSuccess { run { runId } } ... on Error { message } } }""",
            params={
                "selector": {
                    "repositoryLocationName": LOCATION,
                    "repositoryName": "__repository__",
                    "jobName": job,
                    # A named job runs as its definition says; an asset selection would also plan the asset's checks.
                    **({"assetSelection": [{"path": [asset]}]} if job == "__ASSET_JOB" else {}),
                },
                "executionMetadata": {
                    "tags": [{"key": key, "value": value} for key, value in {**where, **tags}.items()]
                },
                **({"runConfigData": run_config} if run_config is not None else {}),
            },
        )["launchRun"]
        assert data["__typename"] == "LaunchRunSuccess", data
        return data["run"]["runId"]

    def launch_backfill(self, partitions: list[str], asset: str = ASSET, **tags: str) -> str:
        """Launches a backfill of ``partitions`` from the UI's GraphQL, as the Materialize dialog does; its id."""
        launched = self.gql(
            """mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) {
                 __typename ... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }""",
            params={
                "partitionNames": partitions,
                "assetSelection": [{"path": [asset]}],
                "tags": [{"key": key, "value": value} for key, value in tags.items()],
            },
        )["launchPartitionBackfill"]
        assert launched["__typename"] == "LaunchBackfillSuccess", launched
        return launched["backfillId"]

    def wait_for_backfill(self, backfill_id: str, timeout: float) -> dict:
        """The backfill once it has finished (succeeded or not), with its runs."""

        def finished():
            backfill = self.gql(
                """query($id: String!) { partitionBackfillOrError(backfillId: $id) { ... on PartitionBackfill {
                     status runs { runId status startTime endTime tags { key value } } } } }""",
                id=backfill_id,
            )["partitionBackfillOrError"]
            return backfill["status"] not in ("REQUESTED", "CANCELING", "FAILING") and backfill

        return _eventually(f"backfill {backfill_id} finishing", finished, timeout, 2, diagnostics=self.diagnostics)

    def run(self, run_id: str) -> dict:
        return self.gql(
            """query($id: ID!) { runOrError(runId: $id) { __typename ... on Run {
                 runId status startTime endTime parentRunId rootRunId tags { key value } } } }""",
            id=run_id,
        )["runOrError"]

    def wait_for_run(self, run_id: str, timeout: float = 120) -> dict:
        return _eventually(
            f"run {run_id} finishing",
            lambda: (run := self.run(run_id))["status"] in _FINISHED and run,
            timeout,
            diagnostics=self.diagnostics,
        )

    def run_group(self, run_id: str) -> list[dict]:
        """The run and its re-executions (automatic retries among them)."""
        return self.gql(
            """query($id: ID!) { runGroupOrError(runId: $id) { ... on RunGroup {
                 runs { runId status parentRunId rootRunId tags { key value } } } } }""",
            id=run_id,
        )["runGroupOrError"]["runs"]

    def messages(self, run_id: str) -> list[str]:
        events = self.gql(
            """query($id: ID!) { logsForRun(runId: $id) { ... on EventConnection {
                 events { __typename ... on MessageEvent { message } } } } }""",
            id=run_id,
        )["logsForRun"]["events"]
        return [event.get("message") or "" for event in events]

    def materialized_partitions(self, partitions: list[str] | None, asset: str = ASSET) -> dict[str, str]:
        """Partition key -> run id of its latest materialization, of ``partitions`` (None: of all) that have one."""
        events = self.gql(
            """query($partitions: [String!], $asset: [String!]!) { assetOrError(assetKey: {path: $asset}) {
                 ... on Asset { assetMaterializations(partitions: $partitions) { partition runId timestamp } } } }""",
            partitions=partitions,
            asset=[asset],
        )["assetOrError"]["assetMaterializations"]
        latest: dict[str, tuple[float, str]] = {}
        for event in events:
            stamp = float(event["timestamp"])
            if event["partition"] not in latest or stamp > latest[event["partition"]][0]:
                latest[event["partition"]] = (stamp, event["runId"])
        return {partition: run_id for partition, (_, run_id) in latest.items()}

    def check_executions(self, partition: str, check: str = "partition_health", asset: str = ASSET) -> list[dict]:
        """A partitioned check's latest executions on one partition, newest first, each with its verdict."""
        return self.gql(
            """query($asset: [String!]!, $check: String!, $partition: String!) { assetCheckExecutions(
                 assetKey: {path: $asset}, checkName: $check, partition: $partition, limit: 5) { runId status
                 evaluation { severity description metadataEntries { label ... on TextMetadataEntry { text } } } } }""",
            asset=[asset],
            check=check,
            partition=partition,
        )["assetCheckExecutions"]

    def sensor_ticks(self, sensor: str) -> list[dict]:
        return self._sensor(sensor)["sensorState"]["ticks"]

    def _sensor(self, sensor: str) -> dict:
        return self.gql(
            """query($selector: SensorSelector!) { sensorOrError(sensorSelector: $selector) {
                 ... on Sensor { sensorState { id status ticks(limit: 5) { status timestamp runIds } } } } }""",
            selector=self._sensor_selector(sensor),
        )["sensorOrError"]

    @staticmethod
    def _sensor_selector(sensor: str) -> dict:
        return {"repositoryLocationName": LOCATION, "repositoryName": "__repository__", "sensorName": sensor}

    @contextmanager
    def sensor_stopped(self, sensor: str) -> Iterator[None]:
        """``sensor`` stopped in the daemon (as from the UI's toggle), then back to its default status."""
        stopped = self.gql(
            """mutation($id: String!) { stopSensor(id: $id) { __typename
                 ... on StopSensorMutationResult { instigationState { status } } ... on Error { message } } }""",
            id=self._sensor(sensor)["sensorState"]["id"],
        )["stopSensor"]
        assert stopped.get("instigationState", {}).get("status") == "STOPPED", stopped
        try:
            yield
        finally:
            reset = self.gql(
                """mutation($selector: SensorSelector!) { resetSensor(sensorSelector: $selector) { __typename
                     ... on Sensor { sensorState { status } } ... on Error { message } } }""",
                selector=self._sensor_selector(sensor),
            )["resetSensor"]
            assert reset.get("sensorState", {}).get("status") == "RUNNING", reset

    def pool_claims(self) -> list[str]:
        """The runs holding a slot of the export's pool (the pool's own name: a pool named ``exports`` has none)."""
        limit = self.gql(
            """query($key: String!) { instance { concurrencyLimit(concurrencyKey: $key) {
                 claimedSlots { runId } } } }""",
            key=POOL,
        )["instance"]["concurrencyLimit"]
        return [slot["runId"] for slot in limit["claimedSlots"]]


def _tags(run: dict) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in run["tags"]}


def _pointer(folder: Path) -> dict:
    """A key folder's pointer (``_current.json``): what its readers see (docs/protocol.md)."""
    return json.loads((folder / "_current.json").read_text())


def _records_by_date(ledger: ExportLedger, partitions: list[str]) -> dict[tuple[str, str], ExportRecord]:
    wanted = set(partitions)
    return {
        (record.business_date.isoformat(), record.tenant): record
        for record in ledger.queries.records(export=ASSET)
        if record.business_date.isoformat() in wanted
    }


@pytest.fixture(scope="module")
def stack(postgres_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("e2e")
    admin_url = make_url(postgres_admin_url)
    database = f"e2e_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{database}"'))  # a generated name; DDL takes no bind parameters
    stack = None
    try:
        home = root / "dagster_home"
        home.mkdir()
        (home / "dagster.yaml").write_text(yaml.safe_dump(_test_instance(), sort_keys=False))
        (root / "location.py").write_text(_LOCATION_SOURCE)
        (root / "workspace.yaml").write_text(
            yaml.safe_dump(
                {
                    "load_from": [
                        {
                            "python_file": {
                                "relative_path": "location.py",
                                "attribute": "defs",
                                "location_name": LOCATION,
                                "working_directory": str(PROJECT),
                            }
                        }
                    ]
                }
            )
        )
        ledger_url = admin_url.set(database=database).render_as_string(hide_password=False)
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "DAGSTER_PG_USERNAME": admin_url.username or "postgres",
            "DAGSTER_PG_PASSWORD": admin_url.password or "",
            "DAGSTER_PG_HOST": admin_url.host or "127.0.0.1",
            "DAGSTER_PG_PORT": str(admin_url.port or 5432),
            "DAGSTER_PG_DB": database,
            "EXPORTS_LEDGER_URL": ledger_url,
            "EXPORTS_DESTINATION": str(root / "exports"),
            "EXPORTS_LEASE_TTL_SECONDS": str(LEASE_TTL_SECONDS),
            "EXPORTS_FAILPOINTS": "after_claim=pause:1",
            "PYTHONPATH": str(PROJECT),
        }
        port = _free_port()
        stack = Stack(f"http://127.0.0.1:{port}", home, env, ledger_url, root / "exports")

        # The documented command sets the pool's limit; it also creates Dagster's tables before two processes race
        # to create them.
        result = subprocess.run(
            [str(BIN / "dagster"), "instance", "concurrency", "set", POOL, str(_pool_limit())],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr

        for name, command in (
            ("webserver", [str(BIN / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]),
            ("daemon", [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"]),
        ):
            log = root / f"{name}.log"
            stack.logs.append(log)
            stack.processes.append(_start(command, env, root, log))

        def location_loaded():
            for process in stack.processes:
                assert process.poll() is None, f"{process.args[0]} exited early\n{stack.diagnostics()}"
            try:
                entries = stack.gql(
                    "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus } } } }"
                )["workspaceOrError"]["locationEntries"]
            except requests.RequestException:
                return False
            return any(entry["name"] == LOCATION and entry["loadStatus"] == "LOADED" for entry in entries)

        _eventually("the webserver serving the code location", location_loaded, 90, diagnostics=stack.diagnostics)
        yield stack
    finally:
        if stack is not None:
            for process in stack.processes:
                _stop(process)
        dispose_engines()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


@pytest.mark.postgres
def test_one_partition_launched_through_graphql_exports_each_tenant_once(stack: Stack):
    partition = "2026-03-08"
    run_id = stack.launch_partition(partition)
    run = stack.wait_for_run(run_id)
    assert run["status"] == "SUCCESS", "\n".join(stack.messages(run_id)[-15:])

    assert stack.materialized_partitions([partition]) == {partition: run_id}
    records = _records_by_date(stack.ledger(), [partition])
    assert sorted(records) == [(partition, tenant) for tenant in sorted(TENANTS)]
    for record in records.values():
        assert record.state is ExportState.COMPLETED, record
        assert record.committed_attempt == f"{run_id}/{ASSET}", "the run's step is the attempt that committed"
        folder = stack.exports / ASSET / f"tenant={record.tenant}" / f"date={partition}"
        pointer = _pointer(folder)
        assert (pointer["revision"], pointer["path"], pointer["fence"]) == (1, "r1-t1", 1), (
            "readers see the first claim's place, named by the key's pointer"
        )
        assert pointer["sha256"] == record.sha256 and (folder / pointer["manifest"]).is_file()
        assert record.location == str(folder / "r1-t1"), "the ledger records the place the pointer names"


@pytest.mark.postgres
def test_a_backfill_tagged_with_one_tenant_as_the_materialize_dialog_tags_it_exports_that_tenant_alone(stack: Stack):
    """The dialog's "Add tags to backfill runs" sends the tags with the backfill; the daemon puts them on every run
    (issue 27, item 3: one tenant's backfill from the UI)."""
    dates = ["2026-03-25", "2026-03-26"]  # dates no other test of the stack uses
    backfill = stack.wait_for_backfill(stack.launch_backfill(dates, **{"export-ledger/tenants": "globex"}), 240)

    assert backfill["status"] in ("COMPLETED", "COMPLETED_SUCCESS") and backfill["runs"], backfill
    for run in backfill["runs"]:
        assert run["status"] == "SUCCESS", "\n".join(stack.messages(run["runId"])[-15:])
        assert {"key": "export-ledger/tenants", "value": "globex"} in run["tags"]
    records = _records_by_date(stack.ledger(), dates)
    assert sorted(records) == [(day, "globex") for day in dates], "acme's keys are neither claimed nor exported"
    assert {record.state for record in records.values()} == {ExportState.COMPLETED}


@pytest.mark.postgres
def test_a_partition_restated_from_the_launchpad_config_publishes_revision_2_with_its_reason(stack: Stack):
    partition = "2026-03-17"  # a partition no other test of the stack uses
    first = stack.wait_for_run(stack.launch_partition(partition))
    assert first["status"] == "SUCCESS"
    reason = "invoices of 10 March corrected upstream"
    corrections = stack.home.parent / "corrections"
    corrections.mkdir(exist_ok=True)
    (corrections / "2026-03-17").touch()  # the source now holds one invoice fewer in that window
    config = {"ops": {ASSET: {"config": {"restate_reason": reason}}}}
    run_id = stack.launch_partition(partition, run_config=config)
    run = stack.wait_for_run(run_id)
    assert run["status"] == "SUCCESS", "\n".join(stack.messages(run_id)[-15:])

    ledger = stack.ledger()
    records = _records_by_date(ledger, [partition])
    assert sorted(records) == [(partition, tenant) for tenant in sorted(TENANTS)]
    for record in records.values():
        revisions = ledger.restatements.revisions(record.logical_key)
        assert [(r.revision, r.reason) for r in revisions] == [(1, "first export"), (2, reason)]
        assert revisions[1].requested_by == run_id and revisions[1].published_by == f"{run_id}/{ASSET}"
        folder = stack.exports / ASSET / f"tenant={record.tenant}" / f"date={partition}"
        pointer = _pointer(folder)
        assert (pointer["revision"], pointer["path"], pointer["fence"]) == (2, "r2-t2", 2), (
            "readers see revision 2 at the second claim's place"
        )
        assert pointer["sha256"] == record.sha256, "the pointer names the revision the ledger records"
        assert (folder / "r1-t1" / "_manifest.json").is_file(), "revision 1 stays where it was published"
        assert (folder / "r2-t2" / "_manifest.json").is_file()
    events = stack.gql(
        """query($partitions: [String!], $asset: [String!]!) { assetOrError(assetKey: {path: $asset}) {
             ... on Asset { assetMaterializations(partitions: $partitions) { runId
               metadataEntries { label ... on JsonMetadataEntry { jsonString } ... on IntMetadataEntry { intValue } }
             } } } }""",
        partitions=[partition],
        asset=[ASSET],
    )["assetOrError"]["assetMaterializations"]
    (restated,) = [e for e in events if e["runId"] == run_id]
    entries = {entry["label"]: entry for entry in restated["metadataEntries"]}
    assert entries["restated_keys"]["intValue"] == len(TENANTS)
    named = json.loads(entries["revisions"]["jsonString"])
    assert {value["revision"] for value in named.values()} == {2}
    assert {value["reason"] for value in named.values()} == {reason}


@pytest.mark.postgres
def test_backfill_runs_in_chunks_and_never_exceeds_the_pool_or_the_backfill_run_limit(stack: Stack):
    partitions = [f"2026-02-{day:02d}" for day in range(1, 13)]
    backfill_id = stack.launch_backfill(partitions)
    # A wait, not a speed limit: about 95 s on 2 idle cores; CI runs the marked tiers on both cores at once.
    backfill = stack.wait_for_backfill(backfill_id, 480)
    runs = backfill["runs"]
    assert backfill["status"] in ("COMPLETED", "COMPLETED_SUCCESS"), backfill
    assert [run["status"] for run in runs] == ["SUCCESS"] * len(runs)

    # Chunks: one run per at most PARTITIONS_PER_RUN partitions, together covering the range exactly once.
    assert len(runs) == math.ceil(len(partitions) / PARTITIONS_PER_RUN), [_tags(run) for run in runs]
    covered = []
    for run in runs:
        tags = _tags(run)
        first, last = tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]
        chunk = [p for p in partitions if first <= p <= last]
        assert 1 <= len(chunk) <= PARTITIONS_PER_RUN, tags
        covered += chunk
    assert sorted(covered) == partitions

    materialized = stack.materialized_partitions(partitions)
    assert sorted(materialized) == partitions, "every partition shows as materialized"
    run_ids = {run["runId"] for run in runs}
    assert set(materialized.values()) <= run_ids

    ledger = stack.ledger()
    records = _records_by_date(ledger, partitions)
    assert len(records) == len(partitions) * len(TENANTS)
    assert {record.state for record in records.values()} == {ExportState.COMPLETED}

    # The pool bounds export steps: each step's span in the ledger, first claim to last result, never overlaps
    # with more than the pool's limit of other steps.
    spans: dict[str, list[dt.datetime]] = defaultdict(list)
    for attempt in ledger.queries.all_attempts():
        if attempt.attempt_id.split("/")[0] in run_ids:
            spans[attempt.attempt_id] += [attempt.started_at, attempt.finished_at]
    assert len(spans) == len(runs)
    step_overlap = _max_overlap([(min(times), max(times)) for times in spans.values()])
    # The queue bounds runs: at most the backfill's tag limit in flight at once (here the pool binds first).
    run_overlap = _max_overlap([(run["startTime"], run["endTime"]) for run in runs])
    print(
        f"backfill {backfill_id}: {len(runs)} runs; at most {step_overlap} export steps at once "
        f"(pool limit {_pool_limit()}), at most {run_overlap} runs at once (backfill run limit {_backfill_run_limit()})"
    )
    assert 1 <= step_overlap <= _pool_limit()
    assert run_overlap <= _backfill_run_limit()


@pytest.fixture
def selenium_webdriver():
    """selenium's webdriver module for Debian's chromium and chromedriver, or a skip (a failure with CI=true).

    Requested before ``stack``, so a machine without a browser skips before starting one."""
    reasons = [
        f"{path} is missing (apt-get install -y chromium chromium-driver)"
        for path in (CHROMIUM, CHROMEDRIVER)
        if not Path(path).exists()
    ]
    try:
        from selenium import webdriver
    except ImportError:
        reasons.append("selenium is not installed (pip install selenium)")
    if reasons:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but the browser test cannot run: " + "; ".join(reasons))
        pytest.skip("; ".join(reasons))
    return webdriver


def _chromium(webdriver, tmp_path: Path, window: tuple[int, int] = (1440, 1000)):
    """Debian's headless Chromium driven by its chromedriver, with a profile and a log in ``tmp_path``."""
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--window-size={window[0]},{window[1]}",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    return webdriver.Chrome(service=service, options=options)


@pytest.mark.postgres
def test_partitions_page_in_headless_chromium_shows_what_storage_holds(
    selenium_webdriver, stack: Stack, tmp_path: Path
):
    from selenium.webdriver.common.by import By

    materialized = stack.materialized_partitions(None)
    if not materialized:  # run alone: give the page something to show
        stack.wait_for_run(stack.launch_partition("2026-03-08"))
        materialized = stack.materialized_partitions(None)
    shown = "2026-03-08" if "2026-03-08" in materialized else min(materialized)
    count = stack.gql(
        """{ assetNodeOrError(assetKey: {path: ["invoice_export"]}) {
             ... on AssetNode { partitionStats { numMaterialized } } } }"""
    )["assetNodeOrError"]["partitionStats"]["numMaterialized"]
    assert count == len(materialized)

    driver = _chromium(selenium_webdriver, tmp_path)
    screenshot = tmp_path / "invoice-export-partitions.png"
    try:
        driver.get(f"{stack.url}/assets/{ASSET}?view=partitions&partition={shown}")

        def page_text() -> str:
            return driver.find_element(By.TAG_NAME, "body").text

        _eventually(
            f"the partitions page showing {count} materialized partitions and the details of {shown}",
            lambda: all(text in page_text() for text in (f"Materialized ({count})", shown, "attempt_id", "key_table")),
            60,
            diagnostics=lambda: page_text()[:3000],
        )
        assert "Join the Dagster community" not in page_text(), "no onboarding dialog over the page (nux disabled)"
        time.sleep(2)  # the partition health bar paints after the text: let it finish before the picture
        assert driver.save_screenshot(str(screenshot))
    finally:
        driver.quit()
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 20_000
    if os.environ.get("EXPORTS_SCREENSHOT_TO"):
        shutil.copyfile(screenshot, os.environ["EXPORTS_SCREENSHOT_TO"])


def _run_processes(stack: Stack, run_id: str) -> list[int]:
    """The run worker of ``run_id`` and its step processes: the worker's pid from Dagster's own engine event."""
    found = [re.search(r"Started process for run \(pid: (\d+)\)", m) for m in stack.messages(run_id)]
    (worker,) = {int(match.group(1)) for match in found if match}
    assert os.getpgid(worker) == os.getpgid(stack.processes[1].pid), "the run worker belongs to this stack's daemon"
    return [worker, *(int(pid) for pid in Path(f"/proc/{worker}/task/{worker}/children").read_text().split())]


def _claimed_key(stack: Stack, ledger: ExportLedger, partition: str, run_id: str) -> ExportRecord:
    """Waits until the run's step holds the lease on a key of ``partition``; returns that ledger record."""
    attempt = f"{run_id}/{ASSET}"

    def held():
        return next(
            (
                r
                for r in _records_by_date(ledger, [partition]).values()
                if r.state is ExportState.IN_PROGRESS and r.lease_owner == attempt
            ),
            None,
        )

    return _eventually("the run claiming a key", held, 120, interval=0.1, diagnostics=stack.diagnostics)


def _retry_chain(stack: Stack, run_id: str, partition: str) -> list[dict]:
    """Waits for an automatic retry of ``run_id`` to succeed; checks every retry is on ``partition``; returns them."""

    def succeeded():
        group = stack.run_group(run_id)
        return any(run["status"] == "SUCCESS" for run in group) and group

    def diagnostics():
        lines = []
        for run in stack.run_group(run_id):
            errors = [m for m in stack.messages(run["runId"]) if "Error" in m or "failed" in m or "refus" in m]
            lines.append(f"{run['runId']} {run['status']} {_tags(run)}: {errors[-3:]}")
        attempts = [
            f"{a.attempt_id} {a.logical_key} {a.outcome.value} {a.started_at:%H:%M:%S.%f} {a.error_message}"
            for a in stack.ledger().queries.all_attempts()
            if partition in a.logical_key or partition in str(a.error_message)
        ]
        return "\n".join(["runs:", *lines, "attempts:", *attempts, stack.diagnostics()])

    # A wait, not a speed limit: the daemon launches the retry on its own tick, which a loaded machine delays (CI
    # failed once at 150 s while other Dagster processes ran beside it, the key already exported by a sensor's rerun).
    group = _eventually("a retry succeeding", succeeded, 300, interval=2, diagnostics=diagnostics)
    retries = sorted((r for r in group if r["runId"] != run_id), key=lambda r: int(_tags(r)["dagster/retry_number"]))
    assert 1 <= len(retries) <= _production_instance()["run_retries"]["max_retries"]
    previous = run_id
    for number, retry in enumerate(retries, start=1):
        tags = _tags(retry)
        assert tags["dagster/partition"] == partition, f"retry {number} exports the failed run's partition"
        assert tags["dagster/retry_number"] == str(number) and retry["parentRunId"] == previous
        assert retry["rootRunId"] == run_id
        previous = retry["runId"]
    assert [r["status"] for r in retries] == ["FAILURE"] * (len(retries) - 1) + ["SUCCESS"]
    return retries


def _check_takeover(
    stack: Stack, ledger: ExportLedger, partition: str, held: ExportRecord, dead_attempt: str
) -> tuple[list[str], dict]:
    """The ledger after a dead attempt: retries are refused (naming it) while its lease lives; after expiry it is
    recorded as abandoned, once, and the key is exported once, by a run on the same partition. Returns the held key's
    outcomes and the run that committed it."""
    history = ledger.queries.attempts(held.logical_key)
    outcomes = [a.outcome.value for a in history]
    abandoned = [a for a in history if a.outcome is AttemptOutcome.ABANDONED]
    assert [a.attempt_id for a in abandoned] == [dead_attempt], outcomes
    refusals = [a for a in history if a.outcome is AttemptOutcome.REFUSED and a.finished_at < abandoned[0].finished_at]
    for refusal in refusals:
        assert dead_attempt in refusal.error_message, "a retry refused during the lease names the attempt holding it"
    (completed,) = [a for a in history if a.outcome is AttemptOutcome.COMPLETED]
    assert completed.started_at >= held.lease_expires_at, "the key is exported again only after the lease expired"
    records = _records_by_date(ledger, [partition]).values()
    assert {r.state for r in records} == {ExportState.COMPLETED} and len(records) == len(TENANTS)
    winner = stack.run(completed.attempt_id.split("/")[0])
    assert _tags(winner)["dagster/partition"] == partition, "the run that exported the key is on the same partition"
    return outcomes, winner


@pytest.mark.postgres
def test_run_whose_worker_dies_is_failed_and_retried_on_the_same_partition_after_the_lease(stack: Stack):
    partition = "2026-03-10"
    ledger = stack.ledger()
    run_id = stack.launch_partition(partition)
    held = _claimed_key(stack, ledger, partition, run_id)
    assert run_id in stack.pool_claims(), "the run's export step holds a slot of the pool while it exports"
    for pid in _run_processes(stack, run_id):  # the worker and its step process die together, as on a lost host
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()

    dead = stack.wait_for_run(run_id, timeout=60)
    assert dead["status"] == "FAILURE", "a run whose worker died is failed, not left STARTED"
    detected_after = time.monotonic() - killed_at
    explanation = [m for m in stack.messages(run_id) if "SIGKILL" in m or "terminated" in m]
    assert explanation, "Dagster says why the run failed"

    # Whichever comes first after the lease expires exports the key: a retry, or a rerun requested by the
    # reconciliation sensor (which marks the dead attempt abandoned); the other then finds the key completed.
    retries = _retry_chain(stack, run_id, partition)
    outcomes, winner = _check_takeover(stack, ledger, partition, held, f"{run_id}/{ASSET}")
    assert winner["runId"] in {r["runId"] for r in retries} or _tags(winner).get("export-ledger/reconciled") == "true"
    assert stack.materialized_partitions([partition]), "the partition shows as materialized"
    path = (
        f"retry {_tags(winner)['dagster/retry_number']}"
        if winner["runId"] in {r["runId"] for r in retries}
        else "the reconciliation sensor's rerun"
    )

    # Run monitoring gives back the pool slot the dead step held (free_slots_after_run_end_seconds).
    _eventually("the dead run's pool slot being freed", lambda: run_id not in stack.pool_claims(), 60, interval=2)
    print(
        f"dead worker: run failed {detected_after:.1f}s after SIGKILL ({explanation[0][:90]}...); "
        f"{len(retries)} retries on {partition}; exported by {path}; ledger outcomes of {held.logical_key}: {outcomes}"
    )


@pytest.mark.postgres
def test_a_tenant_in_its_own_zone_has_its_own_asset_and_partitions(stack: Stack):
    """Runs after the others but the partition health test: the Kolkata tenant's asset, launched like any other,
    holds that zone's partitions."""
    partition = "2026-04-01"
    run_id = stack.launch_partition(partition, asset=KOLKATA_ASSET)
    run = stack.wait_for_run(run_id)
    assert run["status"] == "SUCCESS", "\n".join(stack.messages(run_id)[-15:])
    assert stack.materialized_partitions([partition], asset=KOLKATA_ASSET) == {partition: run_id}
    assert stack.materialized_partitions([partition]) == {}, "the New York asset's partition is its own"
    node = stack.gql(
        """query($asset: [String!]!) { assetNodeOrError(assetKey: {path: $asset}) { ... on AssetNode {
             partitionDefinition { description } partitionStats { numMaterialized } } } }""",
        asset=[KOLKATA_ASSET],
    )["assetNodeOrError"]
    assert "Asia/Kolkata" in node["partitionDefinition"]["description"], "the UI shows the zone's own partitions"
    assert node["partitionStats"]["numMaterialized"] >= 1
    (record,) = stack.ledger().queries.records(export=ASSET, tenant=KOLKATA_TENANT, date_from=dt.date(2026, 4, 1),
                                      date_to=dt.date(2026, 4, 1))  # fmt: skip
    assert (record.timezone, record.state) == ("Asia/Kolkata", ExportState.COMPLETED)
    assert record.window_start_utc == dt.datetime(2026, 3, 31, 18, 30, tzinfo=dt.timezone.utc)
    assert record.committed_attempt == f"{run_id}/{KOLKATA_ASSET}"


def _verdict(execution: dict) -> tuple[str, str | None, str, str]:
    """A check execution as (status, severity when it failed, metadata ``status``, description)."""
    evaluation = execution["evaluation"]
    text = {entry["label"]: entry.get("text") for entry in evaluation["metadataEntries"]}
    severity = evaluation["severity"] if execution["status"] == "FAILED" else None
    return execution["status"], severity, text.get("status"), evaluation["description"]


def _status_of(ranges: list[dict], partitions: tuple[str, ...]) -> dict[str, str]:
    """Each daily partition's status in Dagster's ranges (``startKey``..``endKey``, ISO dates); absent: MISSING."""
    return {p: next((r["status"] for r in ranges if r["startKey"] <= p <= r["endKey"]), "MISSING") for p in partitions}


def _partition_health_snapshot(stack: Stack, dates: tuple[str, ...]) -> dict | None:
    """What the UI reads about ``dates``: the asset's partition statuses, its ``partition_health`` check's, and each
    date's latest verdict; None while a date has no finished verdict yet or the stale one is not reported."""
    latest = {day: stack.check_executions(day) for day in dates}
    if any(not runs or runs[0]["evaluation"] is None for runs in latest.values()):
        return None
    verdicts = {day: _verdict(runs[0]) for day, runs in latest.items()}
    if verdicts[STALE_DATE][2] != "stale":
        return None
    node = stack.gql(
        """query($asset: [String!]!) { assetNodeOrError(assetKey: {path: $asset}) { ... on AssetNode {
             assetPartitionStatuses { ... on TimePartitionStatuses { ranges { startKey endKey status } } }
             health: assetCheckOrError(checkName: "partition_health") { ... on AssetCheck {
               partitionStatuses { ... on AssetCheckTimePartitionStatuses { ranges { startKey endKey status } } } } }
           } } }""",
        asset=[ASSET],
    )["assetNodeOrError"]
    return {
        "asset": _status_of(node["assetPartitionStatuses"]["ranges"], dates),
        "check": _status_of(node["health"]["partitionStatuses"]["ranges"], dates),
        "verdicts": verdicts,
        "judged_by": {day: runs[0]["runId"] for day, runs in latest.items()},
    }


# The colour of each listed partition's status dot (``green``, ``red``, ``gray``...), by partition key.
_LIST_DOTS = """
const colors = {};
for (const entry of document.querySelectorAll('[data-tooltip]')) {
  const color = (entry.nextElementSibling?.getAttribute('style') || '').match(/--color-accent-([a-z]+)/);
  if (color) colors[entry.dataset.tooltip] = color[1];
}
return colors;
"""
# The second "Partitions" tab of an asset's Checks page is the selected check's (the first is the asset's).
_CLICK_CHECK_PARTITIONS_TAB = """
const tabs = [...document.querySelectorAll('[role=tab]')].filter((tab) => tab.textContent === 'Partitions');
if (tabs.length < 2) return false;
tabs[1].click();
return true;
"""
# The icon of the tag beside the heading of the partition shown in detail (``cancel``, ``warning_outline``, ...).
_DETAIL_TAG_ICON = (
    "//span[contains(@class, 'size20')][.//div[@title='{day}']]/following::div[contains(@class, 'BaseTag')][1]"
    "//div[@role='img']"
)
FAILED_RUN = r"Run [0-9a-f]{8} failed, and did not materialize this asset\."  # a failed partition's detail


class _Page:
    """The browser on the stack's UI, read as text and through the attributes the pictures show."""

    def __init__(self, driver) -> None:
        from selenium.webdriver.common.by import By

        self.driver, self.by = driver, By

    def text(self) -> str:
        return self.driver.find_element(self.by.TAG_NAME, "body").text

    def dots(self, days: tuple[str, ...]) -> dict[str, str] | None:
        """The status dots of ``days`` in the partition list, once all are listed."""
        colors = self.driver.execute_script(_LIST_DOTS)
        return {day: colors[day] for day in days} if all(day in colors for day in days) else None

    def select(self, day: str, tags: str) -> str:
        """Selects ``day`` in the partition list; the tag (or banner) beside its heading in the detail."""
        from selenium.common.exceptions import StaleElementReferenceException

        def clicked() -> bool:
            try:
                entry = next(e for e in self.driver.find_elements(self.by.XPATH, f"//span[text()='{day}']")
                             if e.is_displayed())  # fmt: skip
                entry.click()
            except (StopIteration, StaleElementReferenceException):  # not listed yet, or the list re-rendered
                return False
            return True

        def shown() -> str | None:
            found = re.search(rf"\n{day}\n({tags})\n", self.text())
            return found and found.group(1)

        _eventually(f"{day} in the partition list", clicked, 30, interval=0.5, diagnostics=self.text)
        return _eventually(f"{day}'s detail", shown, 30, interval=0.5, diagnostics=self.text)

    def tag_icon(self, day: str) -> str:
        return self.driver.find_element(self.by.XPATH, _DETAIL_TAG_ICON.format(day=day)).get_attribute("aria-label")


@pytest.mark.postgres
def test_a_healthy_a_failed_and_a_stale_partition_look_different_in_chromium(
    selenium_webdriver, stack: Stack, tmp_path: Path
):
    """A backfill of three dates in one chunk: one date left alone, one on which globex's source is down (the step
    fails: Dagster marks the partition failed, and the failed run reports every date's verdicts before it fails), one
    exported and then found changed at its source (drift recorded in the ledger; the daemon's partition_health_sensor
    runs that partition's check again). The asset's Partitions page tells the failed date apart; its partition_health
    check's Partitions tab tells all three apart, each with its verdict (the ledger's and the destination's, one
    check); the failed run's good date keeps its passed verdict.

    Runs last, with the reconciliation sensor stopped while it looks: that sensor reruns the failed date (its
    source still down) until the key escalates, and the pictures would show the rerun in progress instead."""
    with stack.sensor_stopped("reconciliation_sensor"):
        _partitions_in_three_states_shown_apart(selenium_webdriver, stack, tmp_path)


def _partitions_in_three_states_shown_apart(selenium_webdriver, stack: Stack, tmp_path: Path) -> None:
    began = time.monotonic()
    dates = (HEALTHY_DATE, OUTAGE_DATE, STALE_DATE)
    # The sensor's first tick starts its cursor at the ledger's present: the changes below must come after it.
    _eventually("partition_health_sensor ticking", lambda: stack.sensor_ticks("partition_health_sensor"), 60)
    # One backfill of the three dates, from the UI's GraphQL as the Materialize dialog launches it: one chunk, so one
    # run that fails on globex's outage date after exporting the other keys. No automatic retry, so that the outage's
    # key stays failed (not escalated) while the test looks at it.
    backfill = stack.wait_for_backfill(stack.launch_backfill(sorted(dates), **{"dagster/max_retries": "0"}), 240)
    (run,) = backfill["runs"]
    assert run["status"] == "FAILURE", "\n".join(stack.messages(run["runId"])[-15:])
    tags = _tags(run)
    assert (tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]) == (
        min(dates),
        max(dates),
    ), "the three dates are one backfill chunk"
    ledger = stack.ledger()
    changed = _records_by_date(ledger, [STALE_DATE])[(STALE_DATE, "acme")]
    finding = DriftFinding(changed, rows_added=2, rows_removed=0, rows_changed=None, source_fingerprint="e2e")
    assert ledger.drift.record([finding], []).opened == [changed.logical_key]
    snapshot = _eventually(
        "the failed run's verdicts on its dates and partition_health_sensor's on the stale date",
        lambda: _partition_health_snapshot(stack, dates),
        90,
        interval=2,
        diagnostics=lambda: json.dumps(
            {d: stack.check_executions(d)[:2] for d in dates} | {"ticks": stack.sensor_ticks("partition_health_sensor")}
        ),
    )
    reported = time.monotonic() - began

    # What the pages read. Dagster's own status of a partition: a failed tenant fails its date, stale data is still
    # served (materialized); the failed run's good dates are materialized by it. partition_health: passed, failed
    # with an error, failed with a warning, and why: the healthy date's verdict is the failed run's own (the run's
    # failure is not that date's), the stale date's the sensor's refresh after it.
    assert snapshot["asset"] == {HEALTHY_DATE: "MATERIALIZED", OUTAGE_DATE: "FAILED", STALE_DATE: "MATERIALIZED"}
    assert snapshot["check"] == {HEALTHY_DATE: "SUCCEEDED", OUTAGE_DATE: "FAILED", STALE_DATE: "FAILED"}, (
        "each date's check status counts its latest verdict (an evaluation must target the date's materialization)"
    )
    assert set(stack.materialized_partitions(list(dates)).values()) == {run["runId"]}
    assert snapshot["judged_by"][HEALTHY_DATE] == snapshot["judged_by"][OUTAGE_DATE] == run["runId"], (
        "the failed run judged its good date (passed, never 'execution failed') and its bad one"
    )
    verdicts = snapshot["verdicts"]
    assert verdicts == {
        HEALTHY_DATE: ("SUCCEEDED", None, "healthy", "healthy: 2 of 2 tenants exported"),
        OUTAGE_DATE: ("FAILED", "ERROR", "failed", f"failed: 1 of 2 tenants ({OUTAGE_TENANT})"),
        STALE_DATE: ("FAILED", "WARN", "stale", "stale: 1 of 2 tenants (acme)"),
    }

    shots = {"partition-health.png": tmp_path / "asset.png", "partition-health-check.png": tmp_path / "check.png"}
    driver = _chromium(selenium_webdriver, tmp_path)
    try:
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        )
        page = _Page(driver)
        # The asset's Partitions page, its list filtered to failed and materialized dates; the failed one selected.
        driver.get(f"{stack.url}/assets/{ASSET}?view=partitions&status=FAILED,MATERIALIZED")
        asset_dots = _eventually("the asset's partition list", lambda: page.dots(dates), 60, diagnostics=page.text)
        asset_detail = page.select(OUTAGE_DATE, FAILED_RUN)
        time.sleep(0.5)  # the health bar paints after the text
        assert driver.save_screenshot(str(shots["partition-health.png"]))

        # The check's Partitions tab (missing dates filtered out): each date's verdict and its severity's tag; the
        # stale one selected last, for the picture.
        driver.get(f"{stack.url}/assets/{ASSET}?view=checks&checkDetail=partition_health"
                   "&status=EXECUTION_FAILED,FAILED,SUCCEEDED")  # fmt: skip
        _eventually("the check's Partitions tab", lambda: driver.execute_script(_CLICK_CHECK_PARTITIONS_TAB), 60)
        check_dots = _eventually("the check's partition list", lambda: page.dots(dates), 60, diagnostics=page.text)
        check_detail = {}
        for day in (HEALTHY_DATE, OUTAGE_DATE, STALE_DATE):
            tag = page.select(day, "Passed|Failed")
            _eventually(f"{day}'s verdict on the page", lambda d=verdicts[day][3]: f"\n{d}\n" in page.text(), 30, 0.5)
            check_detail[day] = (tag, page.tag_icon(day))
        time.sleep(0.5)
        assert driver.save_screenshot(str(shots["partition-health-check.png"]))
    finally:
        driver.quit()
    assert asset_dots == {HEALTHY_DATE: "green", OUTAGE_DATE: "red", STALE_DATE: "green"}, "stale data is served"
    assert re.fullmatch(FAILED_RUN, asset_detail), asset_detail
    assert check_dots == {HEALTHY_DATE: "green", OUTAGE_DATE: "red", STALE_DATE: "red"}
    assert check_detail == {
        HEALTHY_DATE: ("Passed", "check_circle"),
        OUTAGE_DATE: ("Failed", "cancel"),
        STALE_DATE: ("Failed", "warning_outline"),
    }, "the check's tag shows the severity: an error for the failed date, a warning for the stale one"
    for name, shot in shots.items():
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000, name
        if os.environ.get("EXPORTS_SCREENSHOT_DIR"):
            shutil.copyfile(shot, Path(os.environ["EXPORTS_SCREENSHOT_DIR"]) / name)
    took = time.monotonic() - began
    print(f"partition health: the sensor's verdicts were shown after {reported:.1f}s; the test took {took:.1f}s")
