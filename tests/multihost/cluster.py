"""The whole multi-host setup of one test run, and its teardown.

:class:`Cluster` makes the three test hosts, starts moto on each host-side address (and on 127.0.0.1 for the host),
the PostgreSQL forwarder, a fresh ledger schema and bucket, and the workers (``ip netns exec <ns> faketime -f
<offset> <python> -m tests.multihost.worker <config>``, each in a process group of its own). :meth:`Cluster.close`
undoes all of it, whatever state the run is in: every worker's group gets SIGCONT (a stopped process cannot die of
SIGTERM), then SIGTERM, then SIGKILL; then the links, servers, schema, bucket and namespaces go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from . import survey
from . import worker as adapter
from .netns import Network, TestHost, pid_alive, remove_leftovers
from .services import TcpForwarder, start_s3_servers, stop_s3_servers

PROJECT = Path(__file__).resolve().parents[2]
EXPORT = "mh_export"
TENANTS = ("acme", "globex")
TIMEZONE = "America/New_York"


def faketime_offset(seconds: float) -> str:
    """libfaketime's relative offset for ``-f``: ``+1200`` style seconds, signed."""
    return f"{'+' if seconds >= 0 else '-'}{abs(int(seconds))}"


@dataclass
class Worker:
    host: TestHost
    offset_seconds: float
    config_path: Path
    journal_path: Path
    log_path: Path
    process: subprocess.Popen | None = None
    stopped: bool = False  # SIGSTOPped by the test and not yet continued
    read_to: int = 0  # how far the test has followed the journal
    current: dict | None = None  # the claim of the attempt under way, per the journal (None between attempts)

    def follow(self) -> dict | None:
        """Reads the journal's new lines; returns the claim of the attempt under way (key, attempt, token)."""
        try:
            with open(self.journal_path, "rb") as handle:
                handle.seek(self.read_to)
                chunk = handle.read()
        except FileNotFoundError:
            return None
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.read_to += len(complete)
        for line in complete.splitlines():
            event = json.loads(line)
            if event["event"] == "claim":
                self.current = event
            elif event["event"] in ("result", "error") and self.current and event["attempt"] == self.current["attempt"]:
                self.current = None
        return self.current

    @property
    def name(self) -> str:
        return self.host.name


@dataclass
class Cluster:
    tmp: Path
    admin_url: str
    offsets: tuple[float, ...]
    lease_seconds: float
    dates: list[str]
    seed: int
    read_seconds: tuple[float, float] = (0.6, 2.4)
    s3_latency: tuple[float, float] = (0.03, 0.12)  # per request, before it is sent (see worker.add_latency)
    network: Network = field(init=False)
    workers: list[Worker] = field(default_factory=list)
    teardown_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.network = Network(len(self.offsets))
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.schema = f"mh_{self.tag.replace('-', '_')}"
        self.bucket = f"el-mh-{self.tag}"
        self.prefix = "mh"
        self.servers: dict[str, tuple[object, str]] = {}
        self.forwarder: TcpForwarder | None = None
        self._schema_made = False
        self._bucket_made = False
        self.stop_file = self.tmp / "stop"
        self.keys = adapter.key_names(self.config)

    # -- setup ---------------------------------------------------------------------------------------------------

    @property
    def host_s3(self) -> dict:
        return {"endpoint_url": self.servers["127.0.0.1"][1], "bucket": self.bucket, "prefix": self.prefix}

    @property
    def host_ledger_url(self) -> str:
        return self._ledger_url(None, None)

    def _ledger_url(self, host: str | None, port: int | None) -> str:
        url = make_url(self.admin_url)
        query = dict(url.query)
        query["options"] = f"-csearch_path={self.schema}"
        query["connect_timeout"] = "3"
        if host is not None:
            url = url.set(host=host, port=port)
        return url.set(query=query).render_as_string(hide_password=False)

    def start(self) -> None:
        leftovers = remove_leftovers()
        if leftovers:
            print(f"removed leftovers of earlier runs: {leftovers}")
        hosts = self.network.create()
        self.servers = start_s3_servers([h.host_addr for h in hosts] + ["127.0.0.1"])
        admin = make_url(self.admin_url)
        self.forwarder = TcpForwarder([h.host_addr for h in hosts], (admin.host or "127.0.0.1", admin.port or 5432))
        self.forwarder.start()
        engine = sa.create_engine(self.admin_url)
        try:
            with engine.begin() as conn:
                for (name,) in conn.execute(sa.text("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'mh\\_%'")):
                    parts = name.split("_")
                    if len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
                        conn.execute(sa.schema.DropSchema(name, cascade=True))  # a killed run's ledger
                        print(f"dropped schema {name} of an earlier run")
                conn.execute(sa.schema.CreateSchema(self.schema))
            self._schema_made = True
        finally:
            engine.dispose()
        self.s3_client = self._s3_client()
        self.s3_client.create_bucket(Bucket=self.bucket)
        self._bucket_made = True
        adapter.prepare_ledger(self.host_ledger_url)
        for host, offset in zip(hosts, self.offsets, strict=True):
            worker = Worker(
                host,
                offset,
                self.tmp / f"{host.name}.json",
                self.tmp / f"{host.name}.journal.jsonl",
                self.tmp / f"{host.name}.log",
            )
            config = {
                "name": host.name,
                "ledger_url": self._ledger_url(host.host_addr, self.forwarder.ports[host.host_addr]),
                "s3": {
                    "endpoint_url": self.servers[host.host_addr][1],
                    "bucket": self.bucket,
                    "prefix": self.prefix,
                    "connect_timeout_seconds": 2.0,
                    "read_timeout_seconds": 4.0,
                    "latency_seconds": list(self.s3_latency),
                },
                "export": EXPORT,
                "tenants": list(TENANTS),
                "dates": self.dates,
                "timezone": TIMEZONE,
                "lease_seconds": self.lease_seconds,
                "read_seconds": list(self.read_seconds),
                "seed": self.seed * 10 + host.index,
                "journal": str(worker.journal_path),
                "stop_file": str(self.stop_file),
                "clock_offset_seconds": offset,
                "test_pid": os.getpid(),
                "max_seconds": 600,
            }
            worker.config_path.write_text(json.dumps(config, indent=2))
            self.workers.append(worker)

    def _s3_client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.servers["127.0.0.1"][1],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    @property
    def config(self) -> dict:
        """The workers' shared key set, as :func:`worker.key_names` reads it."""
        return {"export": EXPORT, "tenants": list(TENANTS), "dates": self.dates, "timezone": TIMEZONE}

    # -- the workers ---------------------------------------------------------------------------------------------

    def start_workers(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(PROJECT), "PYTHONUNBUFFERED": "1"}
        for worker in self.workers:
            command = [
                "ip", "netns", "exec", worker.host.namespace,
                "faketime", "-f", faketime_offset(worker.offset_seconds),
                sys.executable, "-m", "tests.multihost.worker", str(worker.config_path),
            ]  # fmt: skip
            with open(worker.log_path, "wb") as log:
                worker.process = subprocess.Popen(
                    command, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

    def wait_ready(self, timeout: float) -> None:
        """Until every worker has journaled its start (its imports done, its clock read)."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            while not any(e["event"] == "start" for e in self._read_journal(worker)):
                if worker.process.poll() is not None:
                    raise RuntimeError(
                        f"{worker.name} exited with {worker.process.returncode}: {self.log_tail(worker)}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{worker.name} did not start in {timeout:.0f}s: {self.log_tail(worker)}")
                time.sleep(0.1)

    def log_tail(self, worker: Worker, size: int = 3000) -> str:
        try:
            return worker.log_path.read_text(errors="replace")[-size:]
        except FileNotFoundError:
            return "(no log)"

    def pause(self, index: int) -> None:
        worker = self.workers[index - 1]
        os.killpg(worker.process.pid, signal.SIGSTOP)
        worker.stopped = True

    def resume(self, index: int) -> None:
        worker = self.workers[index - 1]
        os.killpg(worker.process.pid, signal.SIGCONT)
        worker.stopped = False

    def cut(self, index: int) -> None:
        self.network.cut(self.network.hosts[index - 1])

    def restore(self, index: int) -> None:
        self.network.restore(self.network.hosts[index - 1])

    def holding(self, index: int) -> str | None:
        """The key of the worker's attempt under way (claimed, not yet returned), per its journal; or None."""
        current = self.workers[index - 1].follow()
        return None if current is None else current["key"]

    def staged(self, index: int) -> str | None:
        """The key of the worker's attempt under way if the bucket holds that attempt's data (its token) and no
        manifest beside it: the attempt is between its upload and its manifest."""
        current = self.workers[index - 1].follow()
        if current is None:
            return None
        day = self.keys[current["key"]]
        folder = f"{self.prefix}/{EXPORT}/tenant={day['tenant']}/date={day['business_date']}"
        staged = survey.staged_tokens(self.s3_client, self.bucket, folder)
        return current["key"] if current["token"] in staged.get(folder, ()) else None

    def moment(self, fault) -> str | None:
        """Whether it is the moment for ``fault`` (a key it lands on), per its kind; see :mod:`.faults`."""
        return self.staged(fault.worker) if fault.kind == "stall" else self.holding(fault.worker)

    def stop_workers(self, grace: float) -> dict[str, int | None]:
        """Asks every worker to stop between two keys (the stop file), waits ``grace`` seconds, then ends the rest
        by their process groups. Returns each worker's exit code (None: it had to be killed)."""
        for index in range(1, len(self.workers) + 1):
            self.restore(index)
            if self.workers[index - 1].stopped:
                self.resume(index)
        self.stop_file.touch()
        deadline = time.monotonic() + grace
        codes: dict[str, int | None] = {}
        for worker in self.workers:
            try:
                codes[worker.name] = worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[worker.name] = None
                _end_groups([worker.process])
        return codes

    def journal(self) -> list[dict]:
        events = [event for worker in self.workers for event in self._read_journal(worker)]
        return sorted(events, key=lambda e: e["t"])

    @staticmethod
    def _read_journal(worker: Worker) -> list[dict]:
        try:
            text = worker.journal_path.read_text()
        except FileNotFoundError:
            return []
        # A line cut short by a kill is not an event.
        events = []
        for line in text.splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return events

    # -- teardown ------------------------------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Ends everything this run started, each step on its own so that one failure leaves no other leftover.
        Returns what failed (also kept in ``teardown_errors``)."""
        errors = self.teardown_errors
        try:
            _end_groups([w.process for w in self.workers if w.process is not None])
        except Exception as exc:
            errors.append(f"ending the workers: {type(exc).__name__}: {exc}")
        if self._bucket_made and "127.0.0.1" in self.servers:
            try:
                client = self._s3_client()
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
                    for item in page.get("Contents", []):
                        client.delete_object(Bucket=self.bucket, Key=item["Key"])
                client.delete_bucket(Bucket=self.bucket)
            except Exception as exc:
                errors.append(f"deleting bucket {self.bucket}: {type(exc).__name__}: {exc}")
        if self.forwarder is not None:
            try:
                self.forwarder.stop()
            except Exception as exc:
                errors.append(f"stopping the forwarder: {type(exc).__name__}: {exc}")
        errors.extend(stop_s3_servers(self.servers))
        try:
            adapter.dispose()
        except Exception as exc:
            errors.append(f"closing the ledger's connections: {type(exc).__name__}: {exc}")
        if self._schema_made:
            engine = sa.create_engine(self.admin_url)
            try:
                with engine.begin() as conn:
                    conn.execute(sa.schema.DropSchema(self.schema, cascade=True))
            except Exception as exc:
                errors.append(f"dropping schema {self.schema}: {type(exc).__name__}: {exc}")
            finally:
                engine.dispose()
        errors.extend(self.network.teardown())
        return errors


def _end_groups(processes: list[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGCONT (a stopped process would not act on SIGTERM) and SIGTERM to each process's whole group, then SIGKILL
    to the groups still there after ``grace`` seconds. A group whose leader has exited may still hold its children
    (faketime's), so groups are signalled whatever the leader's state."""
    groups = [process.pid for process in processes]  # start_new_session=True: each process leads its own group
    for group in groups:
        for signum in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                break
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_group_alive(group) for group in groups):
        for process in processes:
            process.poll()  # reap the leaders, so that their groups can empty
        time.sleep(0.05)
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


class ReconcileLoop:
    """Reconciliation passes from the host in a thread of their own (a pass may wait on a row a paused worker has
    locked, and the fault schedule must still be able to continue that worker)."""

    def __init__(self, cluster: Cluster, interval: float = 1.0) -> None:
        self.reconciler = adapter.Reconciler(
            cluster.host_ledger_url, cluster.host_s3, lease_seconds=cluster.lease_seconds
        )
        self.interval = interval
        self.passes = 0
        self.errors: list[str] = []
        self.resolved: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)

    def start(self) -> ReconcileLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.run_pass()
            self._stop.wait(self.interval)

    def run_pass(self) -> dict | None:
        try:
            report = self.reconciler.pass_once()
        except Exception as exc:  # the ledger or the store was unreachable: try again next time
            self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            return None
        self.passes += 1
        for _, state in report["resolved"]:
            self.resolved[state] = self.resolved.get(state, 0) + 1
        return report

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def until_quiet(self, max_rounds: int = 10) -> int:
        """Whole rounds over every stuck key until one changes nothing; returns the rounds run."""
        for round_number in range(1, max_rounds + 1):
            changed = False
            self.reconciler.after = None
            while True:
                report = self.run_pass()
                if report is None:
                    changed = True  # could not look: not quiet
                    break
                changed = changed or bool(report["resolved"]) or bool(report["changed_meanwhile"])
                if report["wrapped"]:
                    break
            if not changed:
                return round_number
            time.sleep(0.5)
        return max_rounds
