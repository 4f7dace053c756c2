"""End to end on the production stack: dagster-webserver and dagster-daemon as real processes on a PostgreSQL instance
configured by ``deploy/dagster.yaml``, driven through the webserver's GraphQL API and a headless Chromium.

One stack serves the module (starting it costs about 15 s of two cores). Its Dagster storage and the ledger share one
PostgreSQL database created for the module and dropped afterwards, as ``deploy/dagster.yaml`` allows in production.
The instance file is the production one with only its polling intervals shortened; the limits are the production
limits. Every export pauses one second after its claim (``EXPORTS_FAILPOINTS=after_claim=pause:1``) so steps last long
enough for overlaps to show and for a test to kill a worker that holds a lease. Leases last 10 s instead of 900 s.
The project's schedule and reconciliation sensor run as they do in production. The module takes about three minutes,
most of it waiting for the backfill daemon's 30-second ticks.

Without PostgreSQL the module skips with the reason (with ``CI=true`` it fails); without Chromium, chromedriver or
selenium the browser test does the same. ``EXPORTS_SCREENSHOT_TO=<path>`` also saves the browser's screenshot there
(the README's picture is made that way).
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import make_url

from export_ledger.ledger import ExportLedger, ExportRecord, dispose_engines
from export_ledger.ledger.schema import AttemptOutcome, ExportState

PROJECT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PRODUCTION_INSTANCE = PROJECT / "deploy" / "dagster.yaml"
LOCATION = "export-ledger"
ASSET = "invoice_export"
TENANTS = ("acme", "globex")  # the New York tenants: the asset invoice_export
KOLKATA_ASSET, KOLKATA_TENANT = "invoice_export__asia_kolkata", "bombay-traders"  # a tenant in its own zone
pytestmark = pytest.mark.e2e
POOL = "exports-local-invoice_export"  # the invoice export's pool on a local-folder destination

PARTITIONS_PER_RUN = 3  # the backfill chunk for this stack (production: 31); see _LOCATION_SOURCE
LEASE_TTL_SECONDS = 10
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

# The code location of this stack: the project's own composition root with a smaller backfill chunk, so that a
# 12-partition backfill is 4 runs that compete for the pool. (Production uses definitions.py:defs, chunk 31.)
_LOCATION_SOURCE = f"""\
from definitions import build_definitions

defs = build_definitions(
    tenants={{"acme": "America/New_York", "globex": "America/New_York", "bombay-traders": "Asia/Kolkata"}},
    max_partitions_per_run={PARTITIONS_PER_RUN},
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
        return ExportLedger(self.ledger_url)

    def launch_partition(self, partition: str, asset: str = ASSET, run_config: dict | None = None, **tags: str) -> str:
        data = self.gql(
            """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
                 __typename ... on LaunchRunSuccess { run { runId } } ... on Error { message } } }""",
            params={
                "selector": {
                    "repositoryLocationName": LOCATION,
                    "repositoryName": "__repository__",
                    "jobName": "__ASSET_JOB",
                    "assetSelection": [{"path": [asset]}],
                },
                "executionMetadata": {
                    "tags": [
                        {"key": key, "value": value} for key, value in {"dagster/partition": partition, **tags}.items()
                    ]
                },
                **({"runConfigData": run_config} if run_config is not None else {}),
            },
        )["launchRun"]
        assert data["__typename"] == "LaunchRunSuccess", data
        return data["run"]["runId"]

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

    def pool_claims(self) -> list[str]:
        limit = self.gql(
            """{ instance { concurrencyLimit(concurrencyKey: "exports") { slotCount claimedSlots { runId } } } }"""
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
def test_a_partition_restated_from_the_launchpad_config_publishes_revision_2_with_its_reason(stack: Stack):
    partition = "2026-03-17"  # a partition no other test of the stack uses
    first = stack.wait_for_run(stack.launch_partition(partition))
    assert first["status"] == "SUCCESS"
    reason = "invoices of 10 March corrected upstream"
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
    launched = stack.gql(
        """mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) {
             __typename ... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }""",
        params={"partitionNames": partitions, "assetSelection": [{"path": [ASSET]}]},
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill_id = launched["backfillId"]

    def backfill_finished():
        backfill = stack.gql(
            """query($id: String!) { partitionBackfillOrError(backfillId: $id) { ... on PartitionBackfill {
                 status runs { runId status startTime endTime tags { key value } } } } }""",
            id=backfill_id,
        )["partitionBackfillOrError"]
        return backfill["status"] not in ("REQUESTED", "CANCELING", "FAILING") and backfill

    backfill = _eventually("the backfill finishing", backfill_finished, 240, interval=2, diagnostics=stack.diagnostics)
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


@pytest.mark.postgres
def test_partitions_page_in_headless_chromium_shows_what_storage_holds(
    selenium_webdriver, stack: Stack, tmp_path: Path
):
    from selenium.webdriver.chrome.service import Service
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

    options = selenium_webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1440,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = selenium_webdriver.Chrome(service=service, options=options)
    screenshot = tmp_path / "invoice-export-partitions.png"
    try:
        driver.get(f"{stack.url}/assets/{ASSET}?view=partitions&partition={shown}")

        def page_text() -> str:
            return driver.find_element(By.TAG_NAME, "body").text

        _eventually(
            f"the partitions page showing {count} materialized partitions and the details of {shown}",
            lambda: all(
                text in page_text() for text in (f"Materialized ({count})", shown, "attempt_id", "logical_keys")
            ),
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

    group = _eventually("a retry succeeding", succeeded, 150, interval=2, diagnostics=diagnostics)
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
    """Runs last: the Kolkata tenant's asset, launched like any other, holds that zone's partitions."""
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
