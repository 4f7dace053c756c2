"""The deterministic simulation (slow tier): seeded schedules per destination over the real ledger and destinations
(a local folder; S3 through the fault proxy; a ledger table), checking the invariants of docs/protocol.md after every
step and liveness once faults stop. See tests/harness/simulation.py.

On every destination the schedules also restate keys (half of them start by restating keys exported once or twice
before; any may request a restatement of a completed key). Faults hit an attempt's next write after its claim (the
pointer's fence, or its place's staging) and after its staging (the pointer's commit, which is the publish in protocol
v2, for a first export and a restatement alike): on the local folder a failure armed at the store's writes, on S3 the
proxy faulting the next PUT; the ledger table writes everything inside the completion transaction, where the armed
insert failure falls.

``EXPORTS_SIM_SCHEDULES`` sets the count per destination (``EXPORTS_SIM_SCHEDULES_TABLE`` and
``EXPORTS_SIM_SCHEDULES_S3`` the ledger table's and S3's alone). Unset, CI's depth runs 120 (local), 80 (ledger table)
and 12 (S3) schedules, and ``EXPORTS_TEST_DEPTH=full`` runs 1,000, 400 and 60 (tests/depth.py). At 400, 250 and 40
they took 91, 29 and 56 s on this 2-core machine while other work loaded it (December 2026).
``EXPORTS_SIM_SCHEDULES=10000`` is the longest run.
``EXPORTS_SIM_SEED=N`` replays schedule N alone. A failure names its seed and how to replay it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from depth import sized
from harness.protocol import survey
from harness.simulation import Simulation
from s3_support import Fault

from export_ledger.destinations import DestinationError, LocalDestination, PublishOutcomeUnknown
from export_ledger.destinations.local import LocalStore
from export_ledger.destinations.store import Upload
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.ledger import dispose_engines

pytestmark = pytest.mark.slow

SCHEDULES = sized("EXPORTS_SIM_SCHEDULES", ci=120, full=1000)
# Restating schedules run more attempts, and each step reads the key's pointer row and every kept revision.
TABLE_SCHEDULES = sized("EXPORTS_SIM_SCHEDULES_TABLE", ci=80, full=400, fallback="EXPORTS_SIM_SCHEDULES")
# S3 goes through HTTP (the fault proxy, then moto), and the survey after each step lists each key's folder and reads
# what changed since the last look (a new place, the pointer): about 1 s a schedule here.
S3_SCHEDULES = sized("EXPORTS_SIM_SCHEDULES_S3", ci=12, full=60, fallback="EXPORTS_SIM_SCHEDULES")
REPLAY = os.environ.get("EXPORTS_SIM_SEED")


class _Armed:
    """One fault armed for the next write of a destination that has no network to fault (local, ledger table)."""

    def __init__(self) -> None:
        self.kind: str | None = None

    def __call__(self, kind: str | None) -> None:
        self.kind = kind

    def take(self) -> str | None:
        """The armed fault (``refused`` or ``unknown``), disarmed; None when none is armed."""
        kind, self.kind = self.kind, None
        return kind


@dataclass(frozen=True)
class _FaultyStore(LocalStore):
    """The local store with one armed fault on its next write, as the store's contract classifies failures:
    ``refused`` fails before anything is written; ``unknown`` writes, then cannot say so (a failed folder fsync)."""

    armed: _Armed = None

    def _faulted(self, write):
        kind = self.armed.take()
        if kind == "refused":
            raise DestinationError("simulated: the folder refused the write")
        result = write()
        if kind == "unknown":
            raise PublishOutcomeUnknown("simulated: written, but the folder fsync failed")
        return result

    def put_if_absent(self, name: str, data: bytes) -> None:
        return self._faulted(lambda: super(_FaultyStore, self).put_if_absent(name, data))

    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        return self._faulted(lambda: super(_FaultyStore, self).put_if_match(name, data, tag))

    def upload(self, name: str) -> Upload:
        return _FaultyUpload(super().upload(name), self)


class _FaultyUpload(Upload):
    """A data file's upload whose creation (``commit``) takes the armed fault."""

    def __init__(self, upload: Upload, store: _FaultyStore) -> None:
        self.upload, self.store, self.handle = upload, store, upload.handle

    def commit(self) -> None:
        refused = self.store.armed.kind == "refused"
        if refused:
            self.upload.abort()  # nothing is created: the refusal raised next is the store's answer
        self.store._faulted(lambda: None if refused else self.upload.commit())

    def abort(self) -> None:
        self.upload.abort()


def _local(tmp_path: Path, armed: _Armed):
    root = tmp_path / "exports"

    @dataclass(frozen=True)
    class FaultyLocal(LocalDestination):
        @property
        def store(self) -> LocalStore:
            return _FaultyStore(root.resolve(), armed)

    return FaultyLocal(root=str(root))


def _table(ledger_url: str, armed: _Armed):
    class FaultyTable(SqlTableDestination):
        def write_in_transaction(self, connection, target, table, manifest):
            written = super().write_in_transaction(connection, target, table, manifest)
            if armed.take() is not None:  # "refused" is the one fault kind armed here
                raise DestinationError("simulated: the insert failed (rolled back with the completion)")
            return written

    return FaultyTable(url=ledger_url, table="sim_rows")


def _run(make, label: str, count: int = SCHEDULES) -> None:
    seeds = [int(REPLAY)] if REPLAY else range(count)
    started = time.monotonic()
    failures = []
    restated = requests = 0
    for seed in seeds:
        report = make(seed).run()
        requests += sum(step.startswith("restate ") for step in report.steps)
        restated += sum(revision >= 2 for revision in report.revisions.values())
        if report.violations:
            failures.append(report)
            if REPLAY or len(failures) >= 3:
                break
    elapsed = time.monotonic() - started
    print(
        f"\n{label}: {len(seeds) if not failures else 'stopped after'} seeded schedules in {elapsed:.0f} s; "
        f"{requests} restatement requests, {restated} keys completed at revision 2 or later"
    )
    if failures:
        lines = []
        for report in failures:
            lines.append(f"seed {report.seed}: {report.violations}")
            lines.append(f"  replay: EXPORTS_SIM_SEED={report.seed} pytest -m slow tests/test_simulation.py -k {label}")
            lines.append(f"  steps: {report.steps}")
        pytest.fail("\n".join(lines))


def test_simulation_local(tmp_path):
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    armed = _Armed()
    destination = _local(tmp_path, armed)
    reader = {"kind": "local", "root": str(tmp_path / "exports")}
    try:
        _run(
            lambda seed: Simulation(
                seed, ledger_url=ledger_url, destination=destination, fault=armed,
                survey=lambda targets: survey(reader, ledger_url, only=targets),
                fault_kinds=["refused", "unknown"], restatements=True,
            ),
            "local",
        )  # fmt: skip
    finally:
        dispose_engines()


def test_simulation_ledger_table(tmp_path):
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    armed = _Armed()
    destination = _table(ledger_url, armed)
    reader = {"kind": "sql", "table": "sim_rows"}
    try:
        _run(
            lambda seed: Simulation(
                seed, ledger_url=ledger_url, destination=destination, fault=armed,
                survey=lambda targets: survey(reader, ledger_url, only=targets), fault_kinds=["refused"],
                restatements=True,
            ),
            "ledger_table",
            TABLE_SCHEDULES,
        )  # fmt: skip
    finally:
        dispose_engines()


def test_simulation_s3(tmp_path, s3_server, s3_bucket, fault_proxy):
    from export_ledger.destinations.s3 import S3Destination

    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    destination = S3Destination(
        bucket=s3_bucket, prefix="sim", endpoint_url=fault_proxy.endpoint_url, access_key_id="testing",
        secret_access_key="testing", connect_timeout_seconds=5, read_timeout_seconds=5,
    )  # fmt: skip
    # Readers go to the store itself: the proxy only faults the attempts' writes, and the survey after every step
    # costs a fifth less without the proxy's hop.
    client = boto3.client(
        "s3", endpoint_url=s3_server, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    )  # fmt: skip
    reader = {"kind": "s3", "bucket": s3_bucket, "prefix": "sim"}
    bodies: dict = {}  # objects read before, by key and ETag: a look after every step reads only what changed

    def fault(kind):
        if kind is None:
            fault_proxy.clear()
        else:
            fault_proxy.inject(Fault(kind), method="PUT", count=1)

    kinds = [Fault.DROP_BEFORE_FORWARD.value, Fault.CUT_BEFORE_RESPONSE.value, Fault.ERROR_500.value,
             Fault.ERROR_403.value]  # fmt: skip
    try:
        _run(
            lambda seed: Simulation(
                seed, ledger_url=ledger_url, destination=destination, fault=fault,
                survey=lambda targets: survey(reader, ledger_url, s3_client=client, only=targets, s3_bodies=bodies),
                fault_kinds=kinds,
                restatements=True,  # the proxy faults the next PUT: the fence, a staged object or the commit
            ),
            "s3",
            S3_SCHEDULES,
        )  # fmt: skip
    finally:
        client.close()
        dispose_engines()
