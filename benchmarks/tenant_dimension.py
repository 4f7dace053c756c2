"""How many runs does Dagster's backfill daemon launch if tenants become a partition dimension?

A standalone measurement (not part of ``benchmarks.run``)::

    .venv/bin/python -m benchmarks.tenant_dimension [--out FILE.json] [--smoke]

Today each export asset has one daily dimension and every run covers all tenants of its dates. With
``BackfillPolicy.multi_run(31)`` a backfill of 62 dates is 2 runs and a year is 12. The question answered here: if
tenants became a second partition dimension, do backfills stay chunked, and how many runs would a year of 100
tenants be?

What runs: a throwaway definitions file in a temporary folder holds five trivial assets, all with
``BackfillPolicy.multi_run(31)`` (each body only counts ``context.partition_keys``, logs it and returns a
``MaterializeResult``; no I/O manager is involved, and runs use the in-process executor):

* ``one_dim_daily``: ``DailyPartitionsDefinition`` (variant **(a)**, the project today);
* ``date_x_tenant_static_small`` / ``_large``: ``MultiPartitionsDefinition`` of ``date`` x ``tenant`` with a
  ``StaticPartitionsDefinition`` of 3 / 100 tenants (variant **(b)**);
* ``date_x_tenant_dynamic_small`` / ``_large``: the same with a ``DynamicPartitionsDefinition`` (variant **(c)**);
  its 3 / 100 tenants are added with the public ``DagsterInstance.add_dynamic_partitions`` before any backfill.

The dates are 2023-01-01 .. 2023-12-31 (``end_date`` fixed, so the year is exactly 365 partitions whatever today
is). ``dagster-webserver`` and ``dagster-daemon run`` are started as subprocesses (each in its own session, so its
process group is killed at the end, even on error) on 127.0.0.1 and a free port, with a fresh ``DAGSTER_HOME``:
telemetry off, default SQLite storage, the default run launcher, and a ``QueuedRunCoordinator`` (6 concurrent runs,
1 s dequeue interval) with one tag concurrency limit of **0** for the tag ``tenant_dimension_bench/hold=true``.

Each backfill is launched through the webserver's GraphQL mutation ``launchPartitionBackfill`` exactly as the UI's
asset Materialize dialog does for a partitioned asset that is not in a user job (``LaunchAssetChoosePartitionsDialog``:
``assetSelection`` + ``partitionNames`` + ``fromFailure: false`` + the tag ``dagster/from_ui=true``). Multi-partition
names are ``str(dagster.MultiPartitionKey({"date": ..., "tenant": ...}))``, i.e. ``2023-01-01|tenant000``
(dimensions in alphabetical order of their names, joined by ``|``).

Two kinds of case:

* **executed**: the runs really execute; the backfill is polled until it reaches a terminal status, and every
  targeted partition must be materialized;
* **held** (the big ones: 365 dates x 100 tenants and 31 x 100): the backfill carries the hold tag, which the
  backfill daemon copies onto every run it creates, so the runs stay ``QUEUED`` and nothing executes. The daemon
  still creates (submits) every run of the backfill; the case is done when all targeted partitions are requested
  (``numPartitionsInProgress == numPartitionsTargeted``), the runs are counted, and the backfill is canceled. These
  run counts are **measured** (the daemon's own run creation), not extrapolated; only their execution is skipped.
  Creating runs is slow (on 2 shared cores about one run per second per backfill, so a 1,200-run backfill needs
  ~20 minutes just to create its runs), so for a held backfill still creating runs when the time budget ends the count
  is the daemon's **plan**: before creating any run the daemon stores every run request of the iteration, with a
  reserved run id each, in the backfill's record (``PartitionBackfill.submitting_run_requests`` /
  ``reserved_run_ids``: read with ``DagsterInstance.get_backfill``, **not public API**) and shrinks that list every 25
  runs it creates; the union (by run id) of what was observed there and of the runs created is the whole plan
  (``figures: "measured (planned)"``, with ``runs_created`` beside it). Nothing is extrapolated. A case with neither
  is marked ``partial``.

Per case the JSON records: partitions requested (``numPartitions``), runs created by the backfill, each run's partition
range (the tags ``dagster/asset_partition_range_start``/``_end``) and its size in partitions (min / max / histogram,
computed with the public ``PartitionsDefinition.get_partition_keys_in_range``), the backfill's final status and the
seconds from launch to done. Beside each figure, ``model_runs``: the count predicted by the rule Dagster 1.13 applies
(``DefaultPartitionsSubset.get_partition_key_ranges`` and ``_build_run_requests_with_backfill_policy``, read from the
installed source, re-implemented here in a few lines, no private import): for a multi-partitioned asset the requested
keys are grouped by the dimension with **fewer distinct selected keys**, every group's contiguous run of keys along the
other dimension is one range, and each range is cut into chunks of at most 31 partitions. For a one-dimension daily
asset, the contiguous dates are cut into chunks of 31.

GraphQL fields used (all public schema of dagster-graphql 1.13):

* ``workspaceOrError { ... on Workspace { locationEntries { name loadStatus locationOrLoadError { __typename
  ... on PythonError { message } } } } }`` (wait until the code location is loaded);
* ``instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } }`` (wait for the daemons);
* ``launchPartitionBackfill(backfillParams: {assetSelection, partitionNames, fromFailure, tags})`` ->
  ``LaunchBackfillSuccess { backfillId }`` (errors: ``PartitionKeysNotFoundError``, ``PythonError``, ...);
* ``partitionBackfillOrError(backfillId) { ... on PartitionBackfill { id status numPartitions assetBackfillData {
  assetBackfillStatuses { ... on AssetPartitionsStatusCounts { numPartitionsTargeted numPartitionsInProgress
  numPartitionsMaterialized numPartitionsFailed } } } } }``;
* ``runsOrError(filter: {tags: [{key: "dagster/backfill", value: <id>}]}) { ... on Runs { count results { runId
  status tags { key value } } } }``;
* ``cancelPartitionBackfill(backfillId)`` (held cases, after counting).

Outside GraphQL: ``DagsterInstance.get()`` (with ``DAGSTER_HOME`` pointing at the fresh home, which it also
initialises before the webserver and daemon start: two processes creating a fresh SQLite home race on its alembic
stamp), ``add_dynamic_partitions``, ``get_backfill`` (held cases' plan, see above), and the generated definitions
module, imported to size run ranges.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MAX_PER_RUN = 31
HOLD_TAG = "tenant_dimension_bench/hold"
BACKFILL_TAG = "dagster/backfill"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
FROM_UI_TAG = "dagster/from_ui"
START_DATE = dt.date(2023, 1, 1)
END_DATE = dt.date(2024, 1, 1)  # exclusive: 365 daily partitions
TERMINAL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}

DEFS_TEMPLATE = '''"""Throwaway definitions written by benchmarks.tenant_dimension (deleted afterwards)."""

import dagster as dg

DAILY = dg.DailyPartitionsDefinition(start_date="{start}", end_date="{end}")
SMALL_TENANTS = {small!r}
LARGE_TENANTS = {large!r}
POLICY = dg.BackfillPolicy.multi_run({max_per_run})

PARTITIONS = {{
    "one_dim_daily": DAILY,
    "date_x_tenant_static_small": dg.MultiPartitionsDefinition(
        {{"date": DAILY, "tenant": dg.StaticPartitionsDefinition(SMALL_TENANTS)}}
    ),
    "date_x_tenant_static_large": dg.MultiPartitionsDefinition(
        {{"date": DAILY, "tenant": dg.StaticPartitionsDefinition(LARGE_TENANTS)}}
    ),
    "date_x_tenant_dynamic_small": dg.MultiPartitionsDefinition(
        {{"date": DAILY, "tenant": dg.DynamicPartitionsDefinition(name="tenants_small")}}
    ),
    "date_x_tenant_dynamic_large": dg.MultiPartitionsDefinition(
        {{"date": DAILY, "tenant": dg.DynamicPartitionsDefinition(name="tenants_large")}}
    ),
}}


def _make(name, partitions_def):
    @dg.asset(name=name, partitions_def=partitions_def, backfill_policy=POLICY)
    def _asset(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        count = len(context.partition_keys)
        context.log.info(f"{{count}} partition keys in this run")
        return dg.MaterializeResult(metadata={{"partition_keys_in_run": count}})

    return _asset


defs = dg.Definitions(
    assets=[_make(name, pdef) for name, pdef in PARTITIONS.items()],
    executor=dg.in_process_executor,
)
'''

DAGSTER_YAML = f"""telemetry:
  enabled: false
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    max_concurrent_runs: 6
    dequeue_interval_seconds: 2
    tag_concurrency_limits:
      - key: "{HOLD_TAG}"
        value: "true"
        limit: 0
backfills:
  use_threads: true
  num_workers: 4
"""

VARIANT_ASSETS = {
    "a_one_dim": "one_dim_daily",
    "b_static": "date_x_tenant_static_{size}",
    "c_dynamic": "date_x_tenant_dynamic_{size}",
}
VARIANT_LABELS = {
    "a_one_dim": "(a) one daily dim",
    "b_static": "(b) date x static tenant",
    "c_dynamic": "(c) date x dynamic tenant",
}


@dataclass
class Case:
    variant: str  # a_one_dim | b_static | c_dynamic
    dates: int
    tenants: int | None  # selected tenants (None for the one-dimension asset)
    dimension: str  # "small" | "large" | "" (one dimension)
    held: bool = False
    note: str = ""
    backfill_id: str | None = None
    launched_at: float = 0.0
    done_at: float | None = None
    last_status: dict = field(default_factory=dict)
    error: str | None = None
    # held cases: run id -> (range start, range end) of every run request the daemon wrote into the backfill's record
    plan: dict = field(default_factory=dict)
    plan_seen_at: float | None = None
    plan_error: str | None = None
    next_poll: float = 0.0

    @property
    def asset(self) -> str:
        return VARIANT_ASSETS[self.variant].format(size=self.dimension)

    @property
    def name(self) -> str:
        if self.tenants is None:
            return f"{self.dates}d"
        return f"{self.dates}d x {self.tenants}t"


# --------------------------------------------------------------------------------------------------------------
# Cases


def tenant_names(count: int) -> list[str]:
    return [f"tenant{i:03d}" for i in range(count)]


def build_cases(smoke: bool) -> tuple[list[Case], int, int]:
    """Returns the cases and the tenant counts of the small and large tenant dimensions."""
    if smoke:
        cases = [Case("a_one_dim", 4, None, "")]
        for variant in ("b_static", "c_dynamic"):
            cases += [
                Case(variant, 4, 2, "small", note="all tenants"),
                Case(variant, 4, 1, "small", note="one tenant of 2"),
                Case(variant, 1, 2, "small", note="one date, all tenants"),
            ]
        cases.append(Case("b_static", 4, 2, "small", held=True, note="held: runs created, not executed"))
        return cases, 2, 2
    cases = [
        Case("a_one_dim", 62, None, "", note="two months, tenants inside each partition (today)"),
        Case("a_one_dim", 365, None, "", note="a year, tenants inside each partition (today)"),
    ]
    for variant in ("b_static", "c_dynamic"):
        cases += [
            Case(variant, 62, 3, "small", note="all 3 tenants"),
            Case(variant, 62, 1, "small", note="one tenant of 3 (its own backfill)"),
            Case(variant, 1, 3, "small", note="earlier exploration"),
            Case(variant, 2, 3, "small", note="earlier exploration"),
            Case(variant, 4, 3, "small", note="earlier exploration"),
            Case(variant, 365, 1, "large", note="one tenant of 100, a year"),
            Case(variant, 1, 100, "large", note="one date, all 100 tenants"),
            Case(variant, 31, 100, "large", held=True, note="a month of 100 tenants (the 'slice')"),
            Case(variant, 365, 100, "large", held=True, note="the year: 36,500 partitions"),
        ]
    return cases, 3, 100


def case_partition_names(case: Case, small: list[str], large: list[str]) -> list[str]:
    import dagster as dg

    dates = [(START_DATE + dt.timedelta(days=i)).isoformat() for i in range(case.dates)]
    if case.tenants is None:
        return dates
    dimension = small if case.dimension == "small" else large
    if case.tenants == len(dimension):
        tenants = dimension
    elif case.tenants == 1:
        tenants = [dimension[len(dimension) // 2]]  # a tenant in the middle: tenant001 of 3, tenant050 of 100
    else:
        tenants = dimension[: case.tenants]
    return [str(dg.MultiPartitionKey({"date": d, "tenant": t})) for d in dates for t in tenants]


def model_runs(case: Case, dimension_size: int) -> int:
    """Dagster 1.13's rule (see the module docstring), for a rectangle of contiguous dates x contiguous tenants."""
    if case.tenants is None:
        return math.ceil(case.dates / MAX_PER_RUN)
    # grouped by the dimension with fewer distinct selected keys (ties: the primary, time, dimension)
    if case.dates <= case.tenants:
        groups, length = case.dates, case.tenants
    else:
        groups, length = case.tenants, case.dates
    return groups * math.ceil(length / MAX_PER_RUN)


# --------------------------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    handle = log.open("wb")
    try:
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    finally:
        handle.close()


def stop(proc: subprocess.Popen, *, grace: float = 20.0) -> None:
    """SIGTERM to the process group the child leads (its own session), then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers in the group (run workers, code servers)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def kill_stragglers(marker: str) -> list[dict]:
    """Processes that carry our unique DAGSTER_HOME in their environment (descendants that left the process group).

    Only processes started for this measurement can have it: the home is a fresh temporary folder.
    """
    killed = []
    needle = f"DAGSTER_HOME={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            cmdline = ""
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append({"pid": int(entry.name), "cmdline": cmdline})
    return killed


def log_tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# --------------------------------------------------------------------------------------------------------------
# GraphQL


class GraphQL:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/graphql"

    def __call__(self, query: str, variables: dict | None = None, timeout: float = 300.0) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
        if payload.get("errors"):
            raise RuntimeError(f"GraphQL errors: {json.dumps(payload['errors'])[:2000]}")
        return payload["data"]


WORKSPACE_QUERY = """
query {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError { __typename ... on PythonError { message } }
      }
    }
  }
}
"""

DAEMON_QUERY = """
query { instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }
"""

LAUNCH_MUTATION = """
mutation LaunchPartitionBackfill($backfillParams: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $backfillParams) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PartitionSetNotFoundError { message }
    ... on PartitionKeysNotFoundError { message }
    ... on UnauthorizedError { message }
    ... on PythonError { message stack }
  }
}
"""

BACKFILL_QUERY = """
query Backfill($backfillId: String!) {
  partitionBackfillOrError(backfillId: $backfillId) {
    __typename
    ... on PartitionBackfill {
      id
      status
      numPartitions
      assetBackfillData {
        assetBackfillStatuses {
          ... on AssetPartitionsStatusCounts {
            numPartitionsTargeted
            numPartitionsInProgress
            numPartitionsMaterialized
            numPartitionsFailed
          }
        }
      }
    }
    ... on PythonError { message }
  }
}
"""

RUNS_QUERY = """
query BackfillRuns($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs { count results { runId status tags { key value } } }
    ... on PythonError { message }
  }
}
"""

CANCEL_MUTATION = """
mutation Cancel($backfillId: String!) {
  cancelPartitionBackfill(backfillId: $backfillId) {
    __typename
    ... on PythonError { message }
  }
}
"""


def wait_until_ready(
    gql: GraphQL, procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout: float, daemons: bool
) -> dict:
    """Waits for the code location to load and (``daemons``) the backfill and run queue daemons to heartbeat."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    location_loaded_s = None
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_tail(logs[name])}")
        try:
            if location_loaded_s is None:
                entries = gql(WORKSPACE_QUERY, timeout=30)["workspaceOrError"].get("locationEntries") or []
                for entry in entries:
                    located = entry.get("locationOrLoadError") or {}
                    if located.get("__typename") == "PythonError":
                        raise RuntimeError(f"code location failed to load: {located.get('message')}")
                if entries and all(
                    e["loadStatus"] == "LOADED" and (e.get("locationOrLoadError") or {}).get("__typename")
                    for e in entries
                ):
                    location_loaded_s = time.monotonic() - started
            if location_loaded_s is not None and not daemons:
                return {"code_location_loaded_s": round(location_loaded_s, 1)}
            if location_loaded_s is not None:
                statuses = gql(DAEMON_QUERY, timeout=30)["instance"]["daemonHealth"]["allDaemonStatuses"]
                healthy = {s["daemonType"] for s in statuses if s["healthy"]}
                if {"BACKFILL", "QUEUED_RUN_COORDINATOR"} <= healthy:
                    return {"daemons_healthy_s": round(time.monotonic() - started, 1)}
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass  # webserver not listening yet
        time.sleep(1.0)
    raise RuntimeError(
        f"not ready after {timeout:.0f} s:\n--- webserver\n{log_tail(logs['webserver'])}\n"
        f"--- daemon\n{log_tail(logs['daemon']) if 'daemon' in procs else '(not started)'}"
    )


def launch(gql: GraphQL, case: Case, names: list[str]) -> None:
    """The UI's Materialize dialog for an asset outside a user job: assetSelection + partitionNames."""
    tags = [{"key": FROM_UI_TAG, "value": "true"}]
    if case.held:
        tags.append({"key": HOLD_TAG, "value": "true"})
    params = {
        "tags": tags,
        "assetSelection": [{"path": [case.asset]}],
        "partitionNames": names,
        "fromFailure": False,
    }
    case.launched_at = time.monotonic()
    result = gql(LAUNCH_MUTATION, {"backfillParams": params})["launchPartitionBackfill"]
    if result["__typename"] != "LaunchBackfillSuccess":
        raise RuntimeError(f"launchPartitionBackfill for {case.asset} {case.name}: {result}")
    case.backfill_id = result["backfillId"]


def backfill_status(gql: GraphQL, backfill_id: str) -> dict:
    found = gql(BACKFILL_QUERY, {"backfillId": backfill_id})["partitionBackfillOrError"]
    if found["__typename"] != "PartitionBackfill":
        raise RuntimeError(f"backfill {backfill_id}: {found}")
    counts = [s for s in (found.get("assetBackfillData") or {}).get("assetBackfillStatuses") or [] if s]
    status = {"status": found["status"], "numPartitions": found["numPartitions"]}
    for key in ("numPartitionsTargeted", "numPartitionsInProgress", "numPartitionsMaterialized", "numPartitionsFailed"):
        status[key] = sum(c.get(key, 0) for c in counts)
    return status


def case_done(case: Case, status: dict) -> bool:
    if status["status"] in TERMINAL:
        return True
    if case.held:
        targeted = status["numPartitionsTargeted"]
        return targeted > 0 and status["numPartitionsInProgress"] >= targeted
    return False


def backfill_runs(gql: GraphQL, backfill_id: str) -> tuple[int, list[dict]]:
    found = gql(RUNS_QUERY, {"filter": {"tags": [{"key": BACKFILL_TAG, "value": backfill_id}]}})["runsOrError"]
    if found["__typename"] != "Runs":
        raise RuntimeError(f"runs of backfill {backfill_id}: {found}")
    return found["count"], found["results"]


def observe_plan(case: Case, instance) -> None:
    """Reads the run requests the daemon planned for a held backfill from the backfill's stored record.

    Before submitting anything, the asset backfill daemon writes every run request of the iteration and a reserved run
    id for each into the backfill (``PartitionBackfill.submitting_run_requests`` / ``reserved_run_ids``, not public
    API), then shrinks that list after every 25 runs it creates. Each observation is therefore the not-yet-created
    suffix of the plan; the union of the observations and of the runs created (keyed by run id) is the whole plan.
    """
    try:
        backfill = instance.get_backfill(case.backfill_id)
        requests = list(backfill.submitting_run_requests or [])
        run_ids = list(backfill.reserved_run_ids or [])
    except Exception as exc:  # private attributes: a later Dagster may rename them; the count then stays "created"
        case.plan_error = f"{type(exc).__name__}: {exc}"[:500]
        return
    if requests and len(run_ids) == len(requests):
        for run_id, request in zip(run_ids, requests, strict=True):
            case.plan[run_id] = (request.tags.get(RANGE_START_TAG), request.tags.get(RANGE_END_TAG))
        if case.plan_seen_at is None:
            case.plan_seen_at = time.monotonic()


def wait_for(gql: GraphQL, cases: list[Case], deadline: float, instance) -> None:
    """Polls every pending backfill (held ones every 10 s: their status is costly to compute) until done or deadline."""
    pending = [c for c in cases if c.error is None and c.done_at is None]
    while pending and time.monotonic() < deadline:
        for case in pending:
            if time.monotonic() < case.next_poll:
                continue
            case.next_poll = time.monotonic() + (10.0 if case.held else 3.0)
            if case.held:
                observe_plan(case, instance)
            try:
                case.last_status = backfill_status(gql, case.backfill_id)
            except (urllib.error.URLError, TimeoutError, RuntimeError) as exc:
                case.last_status = {**case.last_status, "poll_error": str(exc)[:500]}
                continue
            if case_done(case, case.last_status):
                case.done_at = time.monotonic()
        pending = [c for c in pending if c.done_at is None]
        if pending:
            time.sleep(1.0)


# --------------------------------------------------------------------------------------------------------------
# Measurement


def load_defs_module(path: Path):
    spec = importlib.util.spec_from_file_location("tenant_dimension_throwaway_defs", path)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BetaWarning: backfill_policy
        spec.loader.exec_module(module)
    return module


def range_size(partitions_def, start_key: str | None, end_key: str | None, instance) -> int:
    from dagster import MultiPartitionsDefinition, PartitionKeyRange

    if start_key is None or end_key is None:
        return 0
    key_range = PartitionKeyRange(start_key, end_key)
    if isinstance(partitions_def, MultiPartitionsDefinition):  # the dynamic dimension needs the instance
        return len(partitions_def.get_partition_keys_in_range(key_range, dynamic_partitions_store=instance))
    return len(partitions_def.get_partition_keys_in_range(key_range))


def summarize(
    case: Case, runs: list[dict], listed_at: float, partitions_def, instance, dimension_size: int | None
) -> dict:
    created: dict[str, tuple[str | None, str | None]] = {}
    statuses = collections.Counter()
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["tags"]}
        statuses[run["status"]] += 1
        created[run["runId"]] = (tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG))
    # held: every run the daemon planned (created or still to create); executed: the runs created
    planned = {**case.plan, **created} if case.held else created
    sizes = [range_size(partitions_def, start, end, instance) for start, end in planned.values()]
    status = case.last_status
    expected = model_runs(case, dimension_size or 0)
    all_created = case.done_at is not None
    if not case.held:
        figures = "measured" if all_created and status.get("status") in TERMINAL else "partial"
        runs_source = "runs created and executed (runsOrError, tag dagster/backfill)"
    elif all_created:
        figures = "measured"
        runs_source = "runs created by the daemon, held in the queue (runsOrError, tag dagster/backfill)"
    elif case.plan_seen_at is not None:
        figures = "measured (planned)"
        runs_source = (
            "runs planned by the daemon: the backfill record's submitting_run_requests/reserved_run_ids (not public "
            "API) united with the runs created; the time budget stopped creation before all runs existed"
        )
    else:
        figures = "partial"
        runs_source = "runs created before the time budget ran out (the plan was not observed)"
    return {
        "variant": case.variant,
        "variant_label": VARIANT_LABELS[case.variant],
        "case": case.name,
        "asset": case.asset,
        "dates": case.dates,
        "tenants_selected": case.tenants,
        "tenants_in_dimension": dimension_size,
        "note": case.note,
        "executed": not case.held,
        "held_in_queue": case.held,
        "figures": figures,
        "runs_source": runs_source,
        "backfill_id": case.backfill_id,
        "backfill_status": status.get("status"),
        "partitions_requested": status.get("numPartitions"),
        "partitions_targeted": status.get("numPartitionsTargeted"),
        "partitions_in_progress": status.get("numPartitionsInProgress"),
        "partitions_materialized": status.get("numPartitionsMaterialized"),
        "partitions_failed": status.get("numPartitionsFailed"),
        "runs": len(planned),
        "runs_created": len(created),
        "all_runs_created": all_created or len(created) == len(planned) and case.plan_seen_at is not None,
        "run_statuses": dict(statuses),
        "partitions_per_run_min": min(sizes) if sizes else None,
        "partitions_per_run_max": max(sizes) if sizes else None,
        "partitions_per_run_histogram": {str(k): v for k, v in sorted(collections.Counter(sizes).items())},
        "partitions_covered_by_runs": sum(sizes),
        "runs_cover_all_partitions": sum(sizes) == status.get("numPartitions"),
        "model_runs": expected,
        "model_agrees": len(planned) == expected,
        "seconds_launch_to_done": round(case.done_at - case.launched_at, 1) if case.done_at else None,
        "runs_created_per_s_since_launch": (
            round(len(created) / ((case.done_at or listed_at) - case.launched_at), 2) if case.launched_at else None
        ),
        "plan_observed_s_after_launch": (
            round(case.plan_seen_at - case.launched_at, 1) if case.plan_seen_at is not None else None
        ),
        "plan_error": case.plan_error,
        "run_ranges_first": sorted([list(r) for r in planned.values()], key=lambda r: [str(x) for x in r])[:5],
        "error": case.error,
    }


def machine_description() -> dict:
    loadavg = None
    with contextlib.suppress(OSError):
        loadavg = Path("/proc/loadavg").read_text().strip()
    cpu = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for name in ("dagster", "dagster-webserver", "dagster-graphql"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "proc_loadavg": loadavg,
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def git_commit() -> dict:
    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30)
            return done.stdout.strip() if done.returncode == 0 else ""
        return ""

    return {"commit": git("rev-parse", "--short=12", "HEAD") or "unknown", "modified": bool(git("status", "-suno"))}


def measure(smoke: bool, scratch_parent: Path | None, keep: bool, budget_s: float) -> dict:
    started_wall = time.monotonic()
    cases, small_n, large_n = build_cases(smoke)
    small, large = tenant_names(small_n), tenant_names(large_n)
    sizes = {"small": small_n, "large": large_n, "": None}

    root = Path(tempfile.mkdtemp(prefix="tenant_dimension-", dir=scratch_parent))
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    defs_path = root / "tenant_dimension_defs.py"
    defs_path.write_text(
        DEFS_TEMPLATE.format(
            start=START_DATE.isoformat(), end=END_DATE.isoformat(), small=small, large=large, max_per_run=MAX_PER_RUN
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPORTS_"))}
    env["DAGSTER_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    bindir = Path(sys.executable).parent
    port = free_port()
    logs = {"webserver": root / "webserver.log", "daemon": root / "daemon.log"}
    procs: dict[str, subprocess.Popen] = {}
    previous_home = os.environ.get("DAGSTER_HOME")
    instance = None
    result: dict = {
        "benchmark": "tenant_dimension",
        "question": (
            "If tenants became a partition dimension (date x tenant), do backfills with BackfillPolicy.multi_run(31) "
            "stay chunked, and how many runs does the backfill daemon launch for a year of 100 tenants?"
        ),
        "smoke": smoke,
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine_at_start": machine_description(),
        "code": git_commit(),
        "settings": {
            "max_partitions_per_run": MAX_PER_RUN,
            "dates": f"{START_DATE.isoformat()} .. (end_date {END_DATE.isoformat()} exclusive)",
            "small_tenant_dimension": small,
            "large_tenant_dimension": f"{large[0]} .. {large[-1]} ({len(large)} tenants)",
            "one_tenant_choice": "the middle tenant of the dimension (tenant001 of 3, tenant050 of 100)",
            "run_coordinator": "QueuedRunCoordinator, max_concurrent_runs 6, dequeue 2 s, hold tag limit 0",
            "run_launcher": "DefaultRunLauncher; assets use dagster.in_process_executor",
            "storage": "default SQLite under a fresh DAGSTER_HOME",
            "time_budget_s": budget_s,
        },
    }
    try:
        import dagster as dg

        # The storage is created (its SQLite schemas stamped) here, before any Dagster process starts: two processes
        # initialising a fresh home at once race on alembic ("Version table 'alembic_version' has more than one head").
        os.environ["DAGSTER_HOME"] = str(home)
        instance = dg.DagsterInstance.get()
        instance.get_runs_count()
        instance.all_instigator_state()
        instance.add_dynamic_partitions("tenants_small", small)
        instance.add_dynamic_partitions("tenants_large", large)

        procs["webserver"] = start(
            [str(bindir / "dagster-webserver"), "-h", "127.0.0.1", "-p", str(port), "-f", str(defs_path)],
            cwd=root,
            env=env,
            log=logs["webserver"],
        )
        gql = GraphQL(port)
        startup = wait_until_ready(gql, procs, logs, timeout=180, daemons=False)
        procs["daemon"] = start(
            [str(bindir / "dagster-daemon"), "run", "-f", str(defs_path)], cwd=root, env=env, log=logs["daemon"]
        )
        startup.update(wait_until_ready(gql, procs, logs, timeout=180, daemons=True))
        result["startup"] = startup
        defs_module = load_defs_module(defs_path)

        deadline = started_wall + budget_s
        executed = [c for c in cases if not c.held]
        held = [c for c in cases if c.held]
        # Executed cases first, held ones after: thousands of queued runs would slow the dequeue loop and compete
        # for the two cores while the executed runs run. In --smoke everything goes at once (it is tiny).
        phases = [executed + held] if smoke else [executed, held]
        for phase in phases:
            for case in phase:
                try:
                    launch(gql, case, case_partition_names(case, small, large))
                except Exception as exc:  # recorded per case; the others still run
                    case.error = f"{type(exc).__name__}: {exc}"[:2000]
            wait_for(gql, phase, deadline, instance)
            for case in phase:
                if case.held and case.backfill_id:
                    observe_plan(case, instance)  # what is still to be created, before the cancel
                    with contextlib.suppress(Exception):
                        gql(CANCEL_MUTATION, {"backfillId": case.backfill_id})

        rows = []
        for case in cases:
            runs: list[dict] = []
            listed_at = time.monotonic()
            if case.backfill_id:
                try:
                    _, runs = backfill_runs(gql, case.backfill_id)
                except Exception as exc:
                    case.error = (case.error or "") + f" runs query: {type(exc).__name__}: {exc}"[:1000]
            pdef = defs_module.PARTITIONS[case.asset]
            rows.append(summarize(case, runs, listed_at, pdef, instance, sizes[case.dimension]))
        result["cases"] = rows
    except Exception:  # the JSON still gets written, with the error and the processes' log tails
        result["error"] = traceback.format_exc()
    finally:
        for proc in procs.values():
            stop(proc)
        stragglers = kill_stragglers(str(home))
        if stragglers:
            result["stragglers_killed"] = stragglers
        if instance is not None:
            with contextlib.suppress(Exception):
                instance.dispose()
        if previous_home is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = previous_home
        if "cases" not in result:
            result["webserver_log_tail"] = log_tail(logs["webserver"])
            result["daemon_log_tail"] = log_tail(logs["daemon"])
        if keep:
            result["kept_scratch"] = str(root)
        else:
            shutil.rmtree(root, ignore_errors=True)

    result.setdefault("cases", [])
    result["machine_at_end"] = {"proc_loadavg": machine_description()["proc_loadavg"]}
    result["elapsed_s"] = round(time.monotonic() - started_wall, 1)
    result["findings"] = findings(result["cases"])
    return result


def findings(rows: list[dict]) -> dict:
    """The answer in a few numbers, each labelled measured or derived."""
    by = {(r["variant"], r["case"]): r for r in rows}
    executed = [r for r in rows if r["executed"]]
    out: dict = {
        "all_cases_agree_with_model": all(r["model_agrees"] for r in rows),
        "runs_cover_every_requested_partition": all(r["runs_cover_all_partitions"] for r in rows),
        "executed_backfills_materialized_every_partition": all(
            r["partitions_materialized"] == r["partitions_requested"] for r in executed
        ),
    }
    year_a = by.get(("a_one_dim", "365d"))
    for variant in ("b_static", "c_dynamic"):
        year = by.get((variant, "365d x 100t"))
        month = by.get((variant, "31d x 100t"))
        if year is None or month is None:
            continue
        out[variant] = {
            "year_100_tenants_runs": year["runs"],
            "year_100_tenants_runs_is": year["figures"],
            "year_100_tenants_runs_created_before_budget": year["runs_created"],
            "year_100_tenants_runs_created_per_s": year["runs_created_per_s_since_launch"],
            "year_100_tenants_minutes_to_create_all_runs_at_that_rate_derived": (
                round(year["runs"] / year["runs_created_per_s_since_launch"] / 60, 1)
                if year["runs_created_per_s_since_launch"]
                else None
            ),
            "month_100_tenants_runs": month["runs"],
            "naive_extrapolation_from_month_runs": round(month["runs"] * 365 / 31),
            "naive_extrapolation_error": (
                "the month slice is grouped by date (31 dates < 100 tenants), the year by tenant (100 < 365 dates): "
                "scaling the slice by 365/31 does not give the year"
            ),
            "vs_one_dim_year_runs": year_a["runs"] if year_a else None,
        }
    return out


# --------------------------------------------------------------------------------------------------------------
# Output


def table(rows: list[dict]) -> str:
    header = ["variant", "case", "partitions", "runs", "per run min/max", "model", "status", "how", "s"]
    lines = [header]
    for r in rows:
        per_run = (
            f"{r['partitions_per_run_min']}/{r['partitions_per_run_max']}"
            if r["partitions_per_run_min"] is not None
            else "-"
        )
        how = "executed" if r["executed"] else "held: created" if r["all_runs_created"] else "held: planned"
        if r["figures"] == "partial":
            how += " PARTIAL"
        lines.append(
            [
                r["variant_label"],
                r["case"] + (f" (of {r['tenants_in_dimension']})" if r["tenants_in_dimension"] else ""),
                str(r["partitions_requested"]),
                str(r["runs"]) + ("" if r["all_runs_created"] else f" ({r['runs_created']} created)"),
                per_run,
                str(r["model_runs"]) + ("" if r["model_agrees"] else " (!)"),
                str(r["backfill_status"]) + (f" ERROR {r['error'][:60]}" if r["error"] else ""),
                how,
                str(r["seconds_launch_to_done"]),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    rendered = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip() for line in lines]
    rendered.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(rendered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help="JSON results (default benchmarks/results/tenant_dimension-<UTC>.json)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny: 4 dates x 2 tenants, under 2 minutes")
    parser.add_argument("--scratch", type=Path, help="parent folder of the temporary DAGSTER_HOME (default: $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, DAGSTER_HOME)")
    parser.add_argument(
        "--budget", type=float, help="seconds before unfinished backfills are reported as partial (default 780; 100)"
    )
    args = parser.parse_args(argv)
    budget = args.budget if args.budget is not None else (100.0 if args.smoke else 780.0)
    result = measure(args.smoke, args.scratch, args.keep, budget)
    out = args.out
    if out is None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = PROJECT_ROOT / "benchmarks" / "results" / f"tenant_dimension-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result["cases"]))
    print()
    print(json.dumps(result["findings"], indent=2))
    print(f"\n{result['elapsed_s']} s; machine at start: {result['machine_at_start']['proc_loadavg']}; wrote {out}")
    if result.get("error"):
        print(f"\nERROR:\n{result['error']}", file=sys.stderr)
    partial = [r for r in result["cases"] if r["figures"] == "partial" or r["error"]]
    return 1 if partial or result.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
