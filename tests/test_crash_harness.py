"""Crash anywhere: SIGKILL an export attempt at a random moment or at each named point of the write protocol, then
reconcile and retry, on every destination (local folder, ``ledger-table:`` in the ledger's SQLite database, S3 on the
moto test server, GCS on fake-gcs-server, Azure Blob on Azurite, a Delta table on a local path).

Each trial is one logical key (tenant ``acme``, its own business date) in one ledger per destination:

1. a fresh child process (forked by :mod:`harness.forkserver`, so it starts in ~20 ms instead of ~2.5 s) runs one
   attempt and is SIGKILLed, after a random delay drawn over the attempt's measured duration, or by the failpoint
   ``<point>=kill``;
2. what the kill left is classified (no claim / claimed / staged: its place written, invisible / published: the
   pointer names it, the ledger does not record it yet / completed) and checked;
3. ``reconcile_batch`` runs with the same destination, on a ledger whose clock stands past the dead attempt's lease
   (it holds the key with a new token, fences the pointer, then judges);
4. a fresh attempt runs to completion in this process;
5. the invariants of docs/protocol.md ("Invariants") are checked against the ledger and the destination itself (the
   v2 layout read directly: folder tree, bucket or container listing on the server, the Delta log's txn versions and
   rows, tables; see :func:`harness.protocol.violations`)
   after each step, with what earlier steps saw of the key: one recorded export per revision, nothing half-visible,
   exactly one current revision (the pointer, naming a whole place), the pointer agreeing with the ledger, the
   recorded revisions a chain and the pointer never moving back, no effect of a stale token visible (no commit below
   a fence raised), nothing a pointer or a recorded revision named deleted or replaced (for the warehouse, which
   replaces a restated key's rows by design: each superseded revision's marker kept in its history table, the current
   rows matching the recorded sha256 and row count), and finally every key
   ``completed`` with one recorded effect (one ``completed`` or ``repaired`` attempt row) per revision.

A restatement trial first completes its key at revision N (1, 2 or 3, in this process) and records a request; the
killed child then restates it (revision N + 1, from a source whose cadence changed), and the checks add that revision
N stays current until N + 1 is committed (the pointer's move is the publish: ``after_publish``), and that the key ends
at revision N + 1.

The slow tier runs ``EXPORTS_CRASH_TRIALS`` random-moment trials per destination plus 4 named-point kills at each
of the 5 points of a first export (one of them through the whole Dagster job, ``execute_in_process`` in the child),
the ledger-table destination once more in PostgreSQL (``EXPORTS_CRASH_TRIALS_POSTGRES``), and restatements on the
destinations that keep revisions (``RESTATING``): 2 kills at each of the 5 points and
``EXPORTS_CRASH_RESTATE_TRIALS`` random ones (on S3 ``EXPORTS_CRASH_RESTATE_TRIALS_S3``), a quarter of them early and
a quarter late in the restatement's life. GCS, Azure and Delta (issue #20) run 2 kills at each point and
``EXPORTS_CRASH_TRIALS_<KIND>`` random first exports, ``EXPORTS_CRASH_RESTATE_TRIALS_<KIND>`` random restatements.
The random counts are CI's (50 per destination, 12 on PostgreSQL, 20 restatements, 20 on S3, 6 and 4 for the newer
kinds) unless ``EXPORTS_TEST_DEPTH=full`` (200, 60, 80, 60, 30 and 20; tests/depth.py) or a variable sets them. Each
prints its trial count and tallies. The default run keeps a smoke version: each named point once per destination,
for a first export and for a restatement (the warehouse's on PostgreSQL).
"""

from __future__ import annotations

import datetime as dt
import json
import random
import shutil
import signal
import sqlite3
import statistics
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import boto3
import pyarrow as pa
import pytest
from builders import open_ledger
from cloud_fixtures import AZURITE_ACCOUNT, AZURITE_KEY
from depth import sized
from harness.forkserver import CHILD_ERROR, ForkServer
from harness.protocol import (
    INVARIANTS,
    AttemptSpec,
    History,
    build_destination,
    leftovers,
    logical_key,
    run_attempt,
    store_client,
    survey,
    violations,
)
from s3_support import Fault
from warehouse_fixtures import warehouse_destination

from assets.invoices import EXPORT_NAME
from export_ledger.destinations import ExportTarget
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.failpoints import POINTS
from export_ledger.frames import MANIFEST_NAME
from export_ledger.ledger import dispose_engines, utc_now
from export_ledger.ledger.schema import ExportState
from export_ledger.reconcile import reconcile_batch

pytest_plugins = ["harness.fixtures"]  # the shared fork server (fixture fork_server)

CHILD_LEASE_SECONDS = 30
PAST_THE_LEASE = CHILD_LEASE_SECONDS + 5  # where the reconciler's and the retry's clock stand
# The random searches' sizes at CI's depth and at the full depth (tests/depth.py: EXPORTS_TEST_DEPTH=full; each
# variable below sets its own). CI's 50 random trials per destination are the fewest at which every state a first
# export passes through is asserted to have been reached by some kill (EVERY_STATE_TRIALS, with the top-ups below);
# the named points are covered apart, NAMED_REPEATS times each, at every depth.
RANDOM_TRIALS = sized("EXPORTS_CRASH_TRIALS", ci=50, full=200)
POSTGRES_RANDOM_TRIALS = sized("EXPORTS_CRASH_TRIALS_POSTGRES", ci=12, full=60)
NAMED_REPEATS = 4
RESTATE_RANDOM_TRIALS = sized("EXPORTS_CRASH_RESTATE_TRIALS", ci=20, full=80)
# An S3 restatement trial takes about 0.5 s here (a pointer read and a conditional write more, through moto), 4 times
# a local one. 20 is the fewest CI runs: the test asserts that random kills landed before, inside and after the
# restatement, and 10 on S3 once left none after it under load (their quarter drawn late all fell inside).
S3_RESTATE_RANDOM_TRIALS = sized("EXPORTS_CRASH_RESTATE_TRIALS_S3", ci=20, full=60)
RESTATE_NAMED_REPEATS = 2
# The destinations added for issue #20 (GCS on fake-gcs-server, Azure on Azurite, Delta on a local path) take a few
# seconds each in the default tier and a small count in the slow tier: EXPORTS_CRASH_TRIALS_<KIND> random
# first-export trials and EXPORTS_CRASH_RESTATE_TRIALS_<KIND> random restatements each, and NEW_KIND_NAMED_REPEATS
# kills at each named point (the default tier kills at each one once already).
NEW_KINDS = ("gcs", "azure", "sftp", "delta")
NEW_KIND_TRIALS = {kind: sized(f"EXPORTS_CRASH_TRIALS_{kind.upper()}", ci=6, full=30) for kind in NEW_KINDS}
NEW_KIND_RESTATE_TRIALS = {
    kind: sized(f"EXPORTS_CRASH_RESTATE_TRIALS_{kind.upper()}", ci=4, full=20) for kind in NEW_KINDS
}
NEW_KIND_NAMED_REPEATS = 2
#: Below this many random trials, the few percent of kills that land inside a protocol's narrow states (staged,
#: published) are too rare to assert each one: the named points assert them.
EVERY_STATE_TRIALS = 50
#: The states a kill can leave a first export in, in the order an attempt passes through them.
PROTOCOL_ORDER = ("no_claim", "claimed", "staged", "published", "completed")
#: At most this many random kills more, drawn where a state no kill reached must lie (between the latest moment that
#: left an earlier state and the earliest that left a later one): on S3 the published state lasts a few percent of an
#: attempt, and CI once drew 100 kills with none of them in it.
TOP_UP_TRIALS = 30
#: After this many plain top-ups missed a state, the next ones widen it: the child pauses where the state begins (the
#: failpoint that enters it, ``pause``) and the kill is drawn over that pause. Under CI's load the jitter of a child's
#: timing exceeds the few milliseconds a local key spends staged, and 30 plain draws once all missed it; a widened state
#: is still left by a kill at a moment the harness drew, not by the failpoint itself.
PLAIN_TOP_UPS = 5
#: The failpoint at which each narrow state begins, for a widened top-up.
ENTERED_AT = {"claimed": "after_claim", "staged": "after_stage", "published": "after_publish"}
#: The sample source's cadence for each revision (revision r uses CADENCES[(r - 1) % 3]): a restatement reads a
#: source that changed, so each revision's bytes differ from the one it supersedes.
CADENCES = (15, 30, 20)
FIRST_DATE = dt.date(2026, 1, 1)
CALIBRATION_DATE = dt.date(2025, 6, 1)
SEED = 20261129

# What a kill at each named point leaves, per destination. A publishing destination over an object store (local,
# S3, GCS, Azure) writes its place at after_stage (invisible) and commits the pointer before after_publish (visible,
# not recorded). Delta stages nothing anywhere (its stage only holds the rows in memory), so a kill at after_stage
# leaves a claim and nothing at the table; its one commit (rows and the key's txn versions together) is the publish.
# The ledger-table destination writes inside the ledger's completion transaction: it never reaches after_stage or
# after_publish (the attempt completes), and its before_commit fires inside that transaction, so the kill rolls the
# rows back with it.
# A single key is a group of one: it passes the group's sync points (before_group_sync, after_group_sync) after its
# publish, with nothing to sync between them.
PUBLISHING_LANDING = {
    "after_claim": "claimed",
    "after_stage": "staged",
    "after_publish": "published",
    "before_group_sync": "published",
    "after_group_sync": "published",
    "before_commit": "published",
    "after_commit": "completed",
}
EXPECTED_LANDING = {
    "local": PUBLISHING_LANDING,
    "s3": PUBLISHING_LANDING,
    "gcs": PUBLISHING_LANDING,
    "azure": PUBLISHING_LANDING,
    "sftp": PUBLISHING_LANDING,
    "delta": {**PUBLISHING_LANDING, "after_stage": "claimed"},
    # The warehouse stages the rows in its staging table (invisible), and its one transaction is the publish.
    "warehouse": PUBLISHING_LANDING,
    "sql": {
        "after_claim": "claimed",
        "after_stage": "completed",
        "after_publish": "completed",
        "before_group_sync": "completed",
        "after_group_sync": "completed",
        "before_commit": "claimed",
        "after_commit": "completed",
    },
}
#: Keys of one group trial: one child exports them together (group commit, docs/protocol.md).
GROUP_KEYS = 3
#: The group trials' dates: after every other trial's.
GROUP_FIRST_DATE = dt.date(2026, 9, 1)
# What a kill at each named point leaves for each key of a group (in date order). The group stages every key (the
# first kill at after_stage is the first key's), syncs, then moves each pointer (the first kill at after_publish is the
# first key's, the others staged), syncs once more (before_group_sync, after_group_sync: every key published), then
# records them all in one commit (the first before_commit is reached with every key published and none recorded).
_GROUP_PUBLISHING = {
    "after_claim": ["claimed"] * GROUP_KEYS,
    "after_stage": ["staged"] + ["claimed"] * (GROUP_KEYS - 1),
    "after_publish": ["published"] + ["staged"] * (GROUP_KEYS - 1),
    "before_group_sync": ["published"] * GROUP_KEYS,
    "after_group_sync": ["published"] * GROUP_KEYS,
    "before_commit": ["published"] * GROUP_KEYS,
    "after_commit": ["completed"] * GROUP_KEYS,
}
GROUP_LANDING = {
    "local": _GROUP_PUBLISHING,
    "s3": _GROUP_PUBLISHING,
    "gcs": _GROUP_PUBLISHING,
    "azure": _GROUP_PUBLISHING,
    "sftp": _GROUP_PUBLISHING,
    "warehouse": _GROUP_PUBLISHING,
    # Delta stages nothing: a kill at after_stage or after_publish leaves the unpublished keys only claimed.
    "delta": {
        **_GROUP_PUBLISHING,
        "after_stage": ["claimed"] * GROUP_KEYS,
        "after_publish": ["published"] + ["claimed"] * (GROUP_KEYS - 1),
    },
    # The ledger table writes each key in its own completion transaction: the first before_commit kill rolls the
    # first key back, the others not reached; no sync point is reached.
    "sql": {
        **{point: ["completed"] * GROUP_KEYS for point in POINTS},
        "after_claim": ["claimed"] * GROUP_KEYS,
        "before_commit": ["claimed"] * GROUP_KEYS,
    },
}
# A restatement (revision N + 1 of a completed key) passes the same points and lands the same way: "published" is the
# pointer naming revision N + 1, which the ledger does not record yet (protocol v2 has no separate pointer move).
EXPECTED_RESTATE_LANDING = EXPECTED_LANDING
# The destinations whose restatements the harness runs: every destination that keeps revisions.
RESTATING = ("local", "s3", "sql", "gcs", "azure", "sftp", "delta")


@dataclass
class Tally:
    """What the trials did and found; printed at the end of each run."""

    destination: str
    trials: Counter = field(default_factory=Counter)  # random / named:<point> / calibration
    landed: Counter = field(default_factory=Counter)  # what the kill left, random trials
    landed_named: Counter = field(default_factory=Counter)
    landed_widened: Counter = field(default_factory=Counter)  # random top-ups with their state widened (a pause)
    verdicts: Counter = field(default_factory=Counter)  # reconciliation verdicts
    retries: Counter = field(default_factory=Counter)  # the fresh attempt's status
    violations: Counter = field(default_factory=Counter)  # invariant -> count, at every check
    checks: int = 0
    anomalies: list[str] = field(default_factory=list)
    child_seconds: list[float] = field(default_factory=list)
    s3_temp_files_left: int = 0
    leftovers: int = 0  # places no pointer or record names, and temporary files: invisible, counted
    seconds: Counter = field(default_factory=Counter)  # wall time per phase

    def lap(self, phase: str, since: float) -> float:
        now = time.monotonic()
        self.seconds[phase] += now - since
        return now

    def report(self, wall: float) -> str:
        lines = [
            f"crash harness [{self.destination}]: {sum(self.trials.values())} trials in {wall:.1f}s "
            f"({dict(sorted(self.trials.items()))})",
            f"  kills landed (random): {dict(sorted(self.landed.items()))}",
            f"  kills landed (named):  {dict(sorted(self.landed_named.items()))}",
            f"  kills landed (random, state widened): {dict(sorted(self.landed_widened.items()))}",
            f"  reconcile verdicts:    {dict(sorted(self.verdicts.items()))}",
            f"  retry statuses:        {dict(sorted(self.retries.items()))}",
            f"  invariant checks: {self.checks}; violations: "
            + ", ".join(f"{name}={self.violations[name]}" for name in INVARIANTS),
            f"  leftovers at the end (named by no pointer or record, invisible): {self.leftovers}; S3 staging temp "
            "files left by killed children: "
            f"{self.s3_temp_files_left}; anomalies: {len(self.anomalies)}",
        ]
        if self.child_seconds:
            lines.append(
                f"  child attempt seconds: median {statistics.median(self.child_seconds):.3f}; wall seconds per phase: "
                + ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in sorted(self.seconds.items()))
            )
        return "\n".join(lines)


class CrashHarness:
    """One destination, one ledger, one logical key per trial."""

    def __init__(
        self,
        server: ForkServer,
        kind: str,
        workdir: Path,
        store: dict | None = None,
        *,
        ledger_url: str | None = None,
    ) -> None:
        """``store``: an object store's settings (``s3``: bucket and endpoint_url; ``gcs``: bucket and endpoint_url;
        ``azure``: container, endpoint_url, account_name, account_key)."""
        self.server = server
        self.kind = kind
        self.workdir = workdir
        self.ledger_url = ledger_url or f"sqlite:///{workdir / 'ledger.sqlite3'}"
        self.s3_client = self.store_client = None
        if kind == "local":
            self.destination_spec = {"kind": "local", "root": str(workdir / "exports")}
        elif kind == "sql":
            self.destination_spec = {"kind": "sql", "table": "exported_invoices"}
        elif kind == "delta":
            self.destination_spec = {"kind": "delta", "table": str(workdir / "delta" / "{export}")}
        elif kind == "warehouse":
            self.destination_spec = {"kind": "warehouse", "table": "exported_{export}", **store}
        elif kind in ("gcs", "azure"):
            self.destination_spec = {"kind": kind, "prefix": "exports", **store}
            self.store_client = store_client(self.destination_spec)
        elif kind == "sftp":
            self.destination_spec = store
            self.store_client = store_client(self.destination_spec)
        else:
            self.destination_spec = {"kind": "s3", "prefix": "exports", **store}
            self.s3_client = boto3.client(
                "s3",
                endpoint_url=store["endpoint_url"],
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
                region_name="us-east-1",
            )
        (workdir / "logs").mkdir()
        (workdir / "results").mkdir()
        (workdir / "tmp").mkdir()
        # The reconciler and every retry stand past the dead attempt's lease: a clock shifted forward.
        self.ledger = open_ledger(self.ledger_url, clock=lambda: utc_now() + dt.timedelta(seconds=PAST_THE_LEASE))
        self.destination = build_destination(self.destination_spec, self.ledger_url)
        server.prepare(self.destination_spec, self.ledger_url)
        self.tally = Tally(f"{kind}, ledger on {self.ledger.dialect}")
        self.keys: list[str] = []
        self.durations: deque[float] = deque(maxlen=15)
        self.history = History()  # what every check saw of each key: the invariants over time
        self.bodies: dict = {}  # S3 objects read before, by key and ETag: each check reads only what changed

    def spec(self, name: str, business_date: str, **changes) -> AttemptSpec:
        return AttemptSpec(
            ledger_url=self.ledger_url,
            destination=self.destination_spec,
            business_date=business_date,
            run_id=f"crash-{self.kind}-{name}",
            lease_ttl_seconds=CHILD_LEASE_SECONDS,
            result_path=str(self.workdir / "results" / f"{name}.json"),
            log_path=str(self.workdir / "logs" / f"{name}.log"),
            tmpdir=str(self.workdir / "tmp"),
            **changes,
        )

    def survey(self, business_date: str | None = None):
        only = ExportTarget(EXPORT_NAME, "acme", business_date) if business_date else None
        return survey(
            self.destination_spec, self.ledger_url, s3_client=self.s3_client, only=only, s3_bodies=self.bodies,
            client=self.store_client,
        )  # fmt: skip

    def check(self, stage: str, key: str, business_date: str, *, final: bool) -> None:
        problems = violations(self.ledger, self.survey(business_date), [key], final=final, history=self.history)
        self.tally.checks += 1
        for name, found in problems.items():
            self.tally.violations[name] += len(found)
            if found:
                self.tally.anomalies.append(f"{key} {stage}: {name} {found}")

    def calibrate(self, runs: int = 1, *, restate: bool = False) -> None:
        """Times whole, uncrashed attempts (fork to exit): random kills are drawn over their recent median, which
        follows the load of the shared machine (the same attempt takes 0.1 s or 0.5 s). With ``restate``, the attempts
        timed are restatements (revision 2 of a key completed here), which take longer than a first export on S3 (a
        pointer read and a conditional write more)."""
        for _ in range(runs):
            number = self.tally.trials["calibration"]
            # Dates of their own, long over by the ledger's clock (a window not over is refused at claim).
            day = (CALIBRATION_DATE + dt.timedelta(days=number)).isoformat()
            name = f"calibration-{number}"
            revision = self.restated_key(name, day, 1) if restate else 1
            outcome = self.server.run(self.spec(name, day, cadence_minutes=cadence(revision)))
            assert outcome.exit_code == 0, f"calibration attempt failed: {outcome}"
            self.durations.append(outcome.elapsed)
            self.keys.append(str(logical_key("acme", day)))
            self.tally.trials["calibration"] += 1

    def random_delay(self, rng: random.Random) -> float:
        """A random moment of the child's life. A quarter of the kills fall anywhere in it (and a little beyond, so
        some come too late to matter); the rest fall in its second half, where the protocol runs: the first ~55% of
        an attempt (fork, opening the ledger, reading the source) holds nothing of the protocol."""
        typical = statistics.median(self.durations)
        if rng.random() < 0.25:
            return rng.uniform(0.0, 1.3 * typical)
        return rng.uniform(0.45 * typical, 1.05 * typical)

    def stratified_delay(self, rng: random.Random, number: int) -> float:
        """A random moment of a restatement's life: one trial in four early (before and around the claim), one in
        four late (around and after the commit), the others drawn as :meth:`random_delay` draws them. A restatement on
        S3 claims its key in its first ~15% and commits in its last few percent (a local one spends its first half
        before the claim): drawn over the whole life alone, a few dozen kills reach both ends too rarely to assert."""
        typical = statistics.median(self.durations)
        if number == 0:
            # One kill right after the fork, before any claim: under a loaded machine the early quarter's kills all
            # once landed after an S3 restatement's claim (the fork and imports took less of its life than calibrated).
            return rng.uniform(0.0, 0.05 * typical)
        if number % 4 == 0:
            return rng.uniform(0.0, 0.35 * typical)
        if number % 4 == 1:
            # Up to twice the typical life: under CI's two workers at once an attempt can run well past its calibration
            # (S3's 20 random restatements once all ended before their commit).
            return rng.uniform(0.85 * typical, 2.0 * typical)
        return self.random_delay(rng)

    def boundary_delay(self, rng: random.Random, missing: str, drawn: list[tuple[float, str]]) -> float:
        """A moment of the child's life where the state ``missing`` must lie, from the kills drawn so far (each a
        share of the typical attempt and where it landed): between the latest kill that left an earlier state and the
        earliest that left a later one. Attempts vary, so those two can cross: the moment is then drawn between them
        the other way round, which still holds the boundary."""
        rank = PROTOCOL_ORDER.index(missing)
        earlier = [share for share, landed in drawn if PROTOCOL_ORDER.index(landed) < rank]
        later = [share for share, landed in drawn if PROTOCOL_ORDER.index(landed) > rank]
        low = max(earlier, default=0.0)
        high = min(later, default=1.3)
        low, high = min(low, high), max(low, high)
        return rng.uniform(low, high) * statistics.median(self.durations)

    def widened_delay(self, rng: random.Random, missing: str, drawn: list[tuple[float, str]]) -> tuple[float, str]:
        """A kill drawn inside the state ``missing`` once the child pauses where it begins. The state begins somewhere
        in :meth:`boundary_delay`'s span (``early`` to ``late``); the pause outlasts that span twice over (and is at
        least a second), and the kill falls between the latest beginning and the earliest end of the paused state."""
        typical = statistics.median(self.durations)
        rank = PROTOCOL_ORDER.index(missing)
        earlier = max((share for share, landed in drawn if PROTOCOL_ORDER.index(landed) < rank), default=0.0)
        later = min((share for share, landed in drawn if PROTOCOL_ORDER.index(landed) > rank), default=1.0)
        early, late = min(earlier, later) * typical, max(earlier, later) * typical
        pause = max(1.0, 2 * typical, 2 * (late - early))
        return rng.uniform(late, early + 0.9 * pause), f"{ENTERED_AT[missing]}=pause:{pause:.3f}"

    def landing(self, key: str, business_date: str) -> str:
        """What a kill left for one key, read from the ledger and the destination: ``no_claim``; for a restatement
        ``requested`` (not claimed yet: N current); ``claimed``; ``staged`` (the dead attempt's place, of its token,
        is there, unnamed: nothing of it visible); ``published`` (the pointer names its revision, the ledger does not
        record it yet); ``completed``."""
        record = self.ledger.queries.get(key)
        found = self.survey(business_date)
        if record is None:
            return "no_claim"
        request = self.ledger.restatements.open_requests([key]).get(key)
        if record.state is ExportState.COMPLETED:
            return "requested" if request is not None else "completed"
        if record.state is not ExportState.IN_PROGRESS:
            return f"unexpected_{record.state.value}"
        pending = request.revision if request is not None else 1
        if found.current(key) == pending:
            return "published"
        folder = found.folder_at(ExportTarget(EXPORT_NAME, "acme", business_date))
        places = folder.places.values() if folder is not None else ()
        mine = [p for p in places if (p.revision, p.token) == (pending, record.fencing_token)]
        return "staged" if mine else "claimed"

    def restated_key(self, name: str, business_date: str, revisions: int) -> int:
        """Completes a key at revision ``revisions`` in this process (its first export, then each restatement), and
        records the request for the next revision; returns that revision."""
        for revision in range(1, revisions + 1):
            if revision >= 2:
                self.ledger.restatements.request(
                    str(logical_key("acme", business_date)), reason=f"setup {revision}", requested_by="crash-harness"
                )
            spec = self.spec(f"{name}-setup{revision}", business_date, cadence_minutes=cadence(revision))
            done = run_attempt(replace(spec, result_path=None))
            assert done["status"] == "exported", f"setting up revision {revision} of {business_date}: {done}"
        key = str(logical_key("acme", business_date))
        self.ledger.restatements.request(key, reason="late invoices", requested_by="crash-harness")
        return revisions + 1

    def trial(
        self,
        index: int,
        *,
        kill_after: float | None = None,
        point: str | None = None,
        mode: str = "io_manager",
        restate_from: int | None = None,
        widen: str | None = None,
    ) -> str:
        """One key, one kill, reconciliation, a fresh attempt, the checks. With ``restate_from`` N, the key is first
        completed at revision N (in this process) with a request recorded, and the killed attempt restates it. With
        ``widen`` (``point=pause:SECONDS``), the child pauses there and the kill (``kill_after``) stays the harness's.
        Returns where the kill landed (:meth:`landing`)."""
        business_date = (FIRST_DATE + dt.timedelta(days=index)).isoformat()
        key = str(logical_key("acme", business_date))
        self.keys.append(key)
        name = f"{index:04d}"
        revision = 1
        if restate_from is not None:
            clock = time.monotonic()
            revision = self.restated_key(name, business_date, restate_from)
            self.tally.lap("setup", clock)
        kind = "restate " if revision >= 2 else ""
        failpoints = f"{point}=kill" if point else (widen or "")
        spec = self.spec(name, business_date, mode=mode, failpoints=failpoints, cadence_minutes=cadence(revision))

        clock = time.monotonic()
        outcome = self.server.run(spec, kill_after=kill_after, timeout=60)
        self.tally.child_seconds.append(outcome.elapsed)
        if kill_after is not None and outcome.exit_code == 0 and widen is None:
            self.durations.append(outcome.elapsed)  # it finished before its kill: a whole attempt, timed
        clock = self.tally.lap("child", clock)
        if outcome.exit_code == CHILD_ERROR or outcome.timed_out:
            self.tally.anomalies.append(f"{key}: the child itself broke ({outcome}); see {spec.log_path}")
        elif outcome.exit_code not in (None, 0):
            self.tally.anomalies.append(f"{key}: the attempt failed instead of dying: {outcome.result}")
        landed = self.landing(key, business_date)
        if point is None and widen is not None:
            self.tally.trials[f"{kind}widened"] += 1
            self.tally.landed_widened[f"{kind}{landed}"] += 1
        elif point is None:
            self.tally.trials[f"{kind}random"] += 1
            self.tally.landed[f"{kind}{landed}"] += 1
        else:
            self.tally.trials[f"{kind}named:{point}"] += 1
            self.tally.landed_named[f"{kind}{point}->{landed}"] += 1
            expected = (EXPECTED_RESTATE_LANDING if revision >= 2 else EXPECTED_LANDING)[self.kind][point]
            if landed != expected:
                self.tally.anomalies.append(f"{key}: a kill at {point} left {landed}, expected {expected}")
            if expected != "completed" and not (outcome.killed and not outcome.killed_by_harness):
                self.tally.anomalies.append(f"{key}: the failpoint {point}=kill did not kill the child: {outcome}")
        self.check("after the kill", key, business_date, final=False)
        if revision >= 2:
            # The revision it supersedes stays current until the new one is published and made current.
            self.check_current(key, business_date, revision if landed in ("published", "completed") else revision - 1)
        clock = self.tally.lap("checks", clock)

        report = reconcile_batch(
            self.ledger, self.destination, limit=10, after=None, reconciler=f"crash-harness/{name}"
        )
        for finding in report.findings:
            self.tally.verdicts[f"{kind}{finding.verdict.value}"] += 1
            if finding.record.logical_key != key:
                self.tally.anomalies.append(f"reconciling {key} found another stuck key {finding.record.logical_key}")
        if not report.findings:
            self.tally.verdicts[f"{kind}nothing stuck"] += 1
        record = self.ledger.queries.get(key)
        if record is not None and record.state is ExportState.IN_PROGRESS:
            self.tally.anomalies.append(f"{key}: still in_progress after reconciling past its lease")
        clock = self.tally.lap("reconcile", clock)
        self.check("after reconciliation", key, business_date, final=False)
        clock = self.tally.lap("checks", clock)

        # The retry shares the dead attempt's temp folder, as every process on one machine does.
        saved_tempdir, tempfile.tempdir = tempfile.tempdir, spec.tmpdir or tempfile.tempdir
        try:
            retry = run_attempt(
                replace(
                    spec,
                    run_id=f"{spec.run_id}-retry",
                    mode="io_manager",
                    failpoints="",
                    clock_offset_seconds=PAST_THE_LEASE,
                    result_path=None,
                )
            )
        finally:
            tempfile.tempdir = saved_tempdir
        self.tally.retries[f"{kind}{retry['status']}"] += 1
        clock = self.tally.lap("retry", clock)
        if retry["status"] == "failed":
            self.tally.anomalies.append(f"{key}: the fresh attempt failed: {retry['error_class']}: {retry['error']}")
        self.check("after the fresh attempt", key, business_date, final=True)
        self.check_current(key, business_date, revision)
        recorded = [row.revision for row in self.ledger.restatements.revisions(key)]
        if recorded != list(range(1, revision + 1)):
            self.tally.anomalies.append(f"{key}: revisions {recorded} recorded, expected 1..{revision}")
        self.tally.lap("checks", clock)
        return landed

    def group_trial(self, index: int, point: str) -> None:
        """:data:`GROUP_KEYS` keys exported by one child as one group (group commit), killed at ``point``; then
        reconciliation, a fresh attempt of the whole group, and the checks: every key completed once, no second
        copy, each current and whole."""
        first = GROUP_FIRST_DATE + dt.timedelta(days=index * GROUP_KEYS)
        dates = [(first + dt.timedelta(days=n)).isoformat() for n in range(GROUP_KEYS)]
        keys = [str(logical_key("acme", day)) for day in dates]
        self.keys.extend(keys)
        name = f"group-{index:04d}"
        spec = self.spec(name, dates[0], failpoints=f"{point}=kill", group=GROUP_KEYS)
        clock = time.monotonic()
        outcome = self.server.run(spec, timeout=60)
        self.tally.child_seconds.append(outcome.elapsed)
        clock = self.tally.lap("child", clock)
        landed = [self.landing(key, day) for key, day in zip(keys, dates, strict=True)]
        self.tally.trials[f"group:{point}"] += 1
        self.tally.landed_named[f"group {point}->{'/'.join(landed)}"] += 1
        expected = GROUP_LANDING[self.kind][point]
        if landed != expected:
            self.tally.anomalies.append(f"group {dates[0]}: a kill at {point} left {landed}, expected {expected}")
        if set(expected) != {"completed"} and not (outcome.killed and not outcome.killed_by_harness):
            self.tally.anomalies.append(
                f"group {dates[0]}: the failpoint {point}=kill did not kill the child: {outcome}"
            )
        for key, day in zip(keys, dates, strict=True):
            self.check("after the kill", key, day, final=False)
        clock = self.tally.lap("checks", clock)

        report = reconcile_batch(
            self.ledger, self.destination, limit=10, after=None, reconciler=f"crash-harness/{name}"
        )
        for finding in report.findings:
            self.tally.verdicts[f"group {finding.verdict.value}"] += 1
            if finding.record.logical_key not in keys:
                self.tally.anomalies.append(
                    f"reconciling group {dates[0]} found another key {finding.record.logical_key}"
                )
        for key in keys:
            record = self.ledger.queries.get(key)
            if record is not None and record.state is ExportState.IN_PROGRESS:
                self.tally.anomalies.append(f"{key}: still in_progress after reconciling past its lease")
        clock = self.tally.lap("reconcile", clock)

        saved_tempdir, tempfile.tempdir = tempfile.tempdir, spec.tmpdir or tempfile.tempdir
        try:
            retry = run_attempt(
                replace(spec, run_id=f"{spec.run_id}-retry", failpoints="", clock_offset_seconds=PAST_THE_LEASE,
                        result_path=None)
            )  # fmt: skip
        finally:
            tempfile.tempdir = saved_tempdir
        self.tally.retries[f"group {retry['status']}"] += 1
        clock = self.tally.lap("retry", clock)
        if retry["status"] == "failed":
            self.tally.anomalies.append(f"group {dates[0]}: the fresh attempt failed: {retry['error']}")
        for key, day in zip(keys, dates, strict=True):
            self.check("after the fresh attempt", key, day, final=True)
            self.check_current(key, day, 1)
            recorded = [row.revision for row in self.ledger.restatements.revisions(key)]
            if recorded != [1]:
                self.tally.anomalies.append(f"{key}: revisions {recorded} recorded, expected [1]")
        self.tally.lap("checks", clock)

    def check_current(self, key: str, business_date: str, revision: int) -> None:
        """A reader following the key's pointer finds ``revision``, whole (the invariants check the rest)."""
        found = self.survey(business_date)
        if found.current(key) != revision or found.visible(key) is None:
            whole = "whole" if found.visible(key) is not None else "not whole"
            self.tally.anomalies.append(
                f"{key}: the current revision is {found.current(key)} ({whole}), expected revision {revision}"
            )

    def finish(self) -> None:
        """The whole destination at the end: every trial's key completed once, nothing else visible."""
        found = self.survey()
        problems = violations(self.ledger, found, final=True, history=self.history)
        self.tally.checks += 1
        for name, items in problems.items():
            self.tally.violations[name] += len(items)
            if items:
                self.tally.anomalies.append(f"at the end: {name} {items[:5]}")
        if sorted(found.exports) != sorted(self.keys):
            self.tally.anomalies.append(f"at the end: {len(found.exports)} visible exports for {len(self.keys)} keys")
        self.tally.leftovers = len(leftovers(self.ledger, found))
        self.tally.s3_temp_files_left = len(s3_staging_files(self.workdir / "tmp"))

    def close(self) -> None:
        for client in (self.s3_client, self.store_client):
            if client is not None:
                client.close()
        dispose_engines()


def cadence(revision: int) -> int:
    """The sample source's cadence (minutes) as it is when ``revision`` is exported."""
    return CADENCES[(revision - 1) % len(CADENCES)]


def s3_staging_files(folder: Path) -> list[Path]:
    """The S3 destination's local staging files left under the temp folder ``folder``."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and "export-ledger" in str(p.relative_to(folder)))


@pytest.fixture
def harness(request, fork_server, tmp_path):
    """``local``, ``sql`` (the ledger-table destination), ``s3`` (moto), ``gcs`` (fake-gcs-server), ``azure``
    (Azurite) and ``delta`` (a local Delta table) on a SQLite ledger; ``sql-postgres`` is the ledger-table destination
    in PostgreSQL, where a killed client's transaction is aborted by the server."""
    name = request.param
    if name == "s3":
        s3 = {"bucket": request.getfixturevalue("s3_bucket"), "endpoint_url": request.getfixturevalue("s3_server")}
        crash = CrashHarness(fork_server, "s3", tmp_path, s3)
    elif name == "gcs":
        gcs = {"bucket": request.getfixturevalue("gcs_bucket"), "endpoint_url": request.getfixturevalue("gcs_server")}
        crash = CrashHarness(fork_server, "gcs", tmp_path, gcs)
    elif name == "azure":
        azure = {
            "container": request.getfixturevalue("azure_container"),
            "endpoint_url": request.getfixturevalue("azurite_server"),
            "account_name": AZURITE_ACCOUNT,
            "account_key": AZURITE_KEY,
        }
        crash = CrashHarness(fork_server, "azure", tmp_path, azure)
    elif name == "sftp":
        spec = request.getfixturevalue("sftp_server").spec(request.getfixturevalue("sftp_folder"))
        crash = CrashHarness(fork_server, "sftp", tmp_path, spec)
    elif name.startswith("warehouse-"):
        built = warehouse_destination(name.removeprefix("warehouse-"), request, tmp_path)
        crash = CrashHarness(fork_server, "warehouse", tmp_path, {"url": built.warehouse_url})
    elif name == "sql-postgres":
        crash = CrashHarness(fork_server, "sql", tmp_path, ledger_url=request.getfixturevalue("postgres_url"))
    else:
        crash = CrashHarness(fork_server, name, tmp_path)
    yield crash
    crash.close()


def assert_clean(tally: Tally) -> None:
    assert tally.anomalies == [], "\n".join(tally.anomalies[:20])
    for name in INVARIANTS:
        assert tally.violations[name] == 0, f"invariant {name} violated {tally.violations[name]} times"


@pytest.mark.parametrize(
    "harness",
    ["local", "sql", "s3", "gcs", "azure", "sftp", "delta", "warehouse-postgres", "warehouse-mariadb"],
    indirect=True,
)
def test_a_kill_at_each_named_point_is_reconciled_and_retried_to_one_export(harness):
    started = time.monotonic()
    for index, point in enumerate(POINTS):
        harness.trial(index, point=point)
    harness.finish()
    print(harness.tally.report(time.monotonic() - started))
    assert_clean(harness.tally)
    assert sum(harness.tally.landed_named.values()) == len(POINTS)


@pytest.mark.parametrize(
    "harness",
    [
        "local",
        "sql",
        "delta",
        "warehouse-postgres",
        *(pytest.param(kind, marks=pytest.mark.slow) for kind in ("s3", "gcs", "azure", "sftp")),
    ],  # fmt: skip
    indirect=True,
)
def test_a_group_killed_at_each_named_point_is_reconciled_and_retried_to_one_export_per_key(harness):
    """Group commit (docs/protocol.md): one child exports several keys as one group; a kill between its publishes
    and its sync, or between its sync and its ledger commit, leaves every key published and unrecorded, which
    reconciliation records; a kill anywhere else is finished by the retry. Every key ends completed once."""
    started = time.monotonic()
    for index, point in enumerate(POINTS):
        harness.group_trial(index, point)
    harness.finish()
    print(harness.tally.report(time.monotonic() - started))
    assert_clean(harness.tally)
    assert sum(harness.tally.landed_named.values()) == len(POINTS)
    assert {"group:before_group_sync", "group:after_group_sync"} <= set(harness.tally.trials)


# The warehouse replaces a key's rows when it restates them, so its superseded revisions are kept as markers only
# (tests/harness/protocol.py's ``KeyFolder.replaces``); its named-point restatement kills run here.
@pytest.mark.parametrize("harness", [*RESTATING, "warehouse-postgres"], indirect=True)
def test_a_restatement_killed_at_each_named_point_leaves_one_current_revision_and_is_finished(harness):
    started = time.monotonic()
    for index, point in enumerate(POINTS):
        harness.trial(index, point=point, restate_from=1 + index % 2)  # revision 2 of 1, or revision 3 of 2
    harness.finish()
    print(harness.tally.report(time.monotonic() - started))
    assert_clean(harness.tally)
    assert sum(harness.tally.landed_named.values()) == len(POINTS)
    assert harness.tally.retries["restate failed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("harness", "random_trials", "named_repeats"),
    [
        ("local", RANDOM_TRIALS, NAMED_REPEATS),
        ("sql", RANDOM_TRIALS, NAMED_REPEATS),
        ("s3", RANDOM_TRIALS, NAMED_REPEATS),
        pytest.param("sql-postgres", POSTGRES_RANDOM_TRIALS, NAMED_REPEATS, marks=pytest.mark.postgres),
        *((kind, NEW_KIND_TRIALS[kind], NEW_KIND_NAMED_REPEATS) for kind in NEW_KINDS),
    ],
    indirect=["harness"],
)
def test_sigkill_at_random_moments_on_every_destination_never_duplicates_tears_or_loses_an_export(
    harness, random_trials, named_repeats
):
    started = time.monotonic()
    rng = random.Random(f"{SEED}-{harness.tally.destination}")
    # One kill per point through the whole Dagster job (about 1 s a child under load), the rest through the I/O manager.
    named = [(point, "job" if repeat == 0 else "io_manager") for point in POINTS for repeat in range(named_repeats)]
    index = 0
    for point, mode in named:  # the named points first: their dates are early partitions the job accepts
        harness.trial(index, point=point, mode=mode)
        index += 1
    harness.calibrate(runs=3)
    drawn: list[tuple[float, str]] = []  # each random kill: its moment as a share of the typical attempt, its landing
    for number in range(random_trials):
        if number % 20 == 19:
            harness.calibrate()  # follow the machine's load
        # The few trials of the newer destinations are stratified as restatements' are: Delta spends most of an
        # attempt writing its table after the claim, and CI once saw its 10 kills drawn over that life all land there.
        delay = harness.stratified_delay(rng, number) if harness.kind in NEW_KINDS else harness.random_delay(rng)
        share = delay / statistics.median(harness.durations)
        drawn.append((share, harness.trial(index, kill_after=delay)))
        index += 1
    reachable = set(EXPECTED_LANDING[harness.kind].values())
    every_state = harness.kind not in NEW_KINDS and random_trials >= EVERY_STATE_TRIALS
    while harness.tally.trials["random top-up"] < TOP_UP_TRIALS:
        missing = _missing_landings(harness.tally, reachable, every_state)
        if not missing:
            break
        plain = harness.tally.trials[f"random top-up {missing[0]}"] < PLAIN_TOP_UPS
        harness.tally.trials["random top-up"] += 1
        harness.tally.trials[f"random top-up {missing[0]}"] += 1
        if missing[0] == "completed" and not plain:
            # After the attempt, whatever its speed under load: a kill that finds it gone (it is a landing too).
            delay = 3 * statistics.median(harness.durations) + 1.0
            drawn.append((delay / statistics.median(harness.durations), harness.trial(index, kill_after=delay)))
        elif plain or missing[0] not in ENTERED_AT:
            delay = harness.boundary_delay(rng, missing[0], drawn)
            share = delay / statistics.median(harness.durations)
            drawn.append((share, harness.trial(index, kill_after=delay)))
        else:
            delay, widen = harness.widened_delay(rng, missing[0], drawn)
            harness.trial(index, kill_after=delay, widen=widen)  # not drawn: its life is not a typical attempt's
        index += 1
    harness.finish()
    print(harness.tally.report(time.monotonic() - started))

    assert harness.tally.trials["random"] >= random_trials
    assert_clean(harness.tally)
    landed = set(harness.tally.landed)
    widened = set(harness.tally.landed_widened)
    if harness.kind in NEW_KINDS:
        # Their few trials spread the kills over at least two moments of the protocol (which ones depends on the
        # machine's speed: CI saw Delta's 10 kills all land before its commit finished, before they were stratified,
        # and GCS's 10 land before the claim or after the commit; the top-ups then draw inside); the named-point test
        # kills at each state for certain.
        assert len((landed | widened) & reachable) >= 2, (
            f"random kills should land at more than one moment of the protocol: {dict(harness.tally.landed)}"
        )
    elif not every_state:
        assert "completed" in landed | widened and (landed | widened) & (reachable - {"completed"}), (
            f"random kills should land inside the protocol and after it: {dict(harness.tally.landed)}"
        )
    else:
        # A narrow state the plain random kills missed may be reached by a widened one (a kill the harness drew over
        # a pause where the state begins): still not a failpoint's own kill, but tallied apart.
        assert reachable <= landed | widened, (
            f"random kills should land in every state the protocol passes through ({sorted(reachable)}): "
            f"{dict(harness.tally.landed)}, widened {dict(harness.tally.landed_widened)}"
        )


def _missing_landings(tally: Tally, reachable: set[str], every_state: bool) -> list[str]:
    """The states the random kills must still reach, first in protocol order: every reachable one (``every_state``),
    else ``completed`` (a kill after the attempt) and one inside the protocol. Under CI's load a few dozen draws have
    missed each of those (PostgreSQL's 30 kills all before the commit, GCS's 10 all before the claim or after it)."""
    got = set(tally.landed) | set(tally.landed_widened)
    if every_state:
        return sorted(reachable - got, key=PROTOCOL_ORDER.index)
    inside = reachable - {"completed"}
    missing = [] if "completed" in got else ["completed"]
    if not got & inside:
        missing.append(min(inside, key=PROTOCOL_ORDER.index))
    return sorted(missing, key=PROTOCOL_ORDER.index)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("harness", "random_trials"),
    [
        (kind, NEW_KIND_RESTATE_TRIALS.get(kind, S3_RESTATE_RANDOM_TRIALS if kind == "s3" else RESTATE_RANDOM_TRIALS))
        for kind in RESTATING
    ],
    indirect=["harness"],
)
def test_sigkill_anywhere_in_restatements_leaves_exactly_one_current_revision(harness, random_trials):
    """Restatements of revision 1, 2 or 3, killed at each named point twice and then at random moments (stratified
    over the restatement's life)."""
    started = time.monotonic()
    rng = random.Random(f"{SEED}-restate-{harness.tally.destination}")
    index = 0
    for point in POINTS:
        for _ in range(RESTATE_NAMED_REPEATS):
            harness.trial(index, point=point, restate_from=1 + index % 3)
            index += 1
    harness.calibrate(runs=3, restate=True)
    for number in range(random_trials):
        if number % 20 == 19:
            harness.calibrate(restate=True)
        harness.trial(index, kill_after=harness.stratified_delay(rng, number), restate_from=1 + index % 3)
        index += 1
    harness.finish()
    print(harness.tally.report(time.monotonic() - started))

    assert harness.tally.trials["restate random"] >= random_trials
    assert_clean(harness.tally)
    landed = {name.removeprefix("restate ") for name in harness.tally.landed}
    # Before the claim, inside the protocol and after it: each state inside is reached by a few percent of random
    # kills only (local, December 2026: staged 5 and published 8 of 60), so each one is asserted by the named points
    # instead.
    if harness.kind in NEW_KINDS:  # a few trials: more than one moment (the named points cover each state)
        assert len(landed) >= 2, f"random kills should land at more than one moment of a restatement: {landed}"
        return
    assert {"requested", "completed"} <= landed and landed & {"claimed", "staged", "published"}, (
        f"random kills should land before, inside and after a restatement's protocol: {landed}"
    )


@pytest.mark.parametrize("harness", RESTATING, indirect=True)
def test_racing_restatements_in_separate_processes_publish_one_revision(harness):
    """Three processes restate one key at once (released together from a gate): one revision 2, current, recorded
    once; the others find it completed or held, and nothing is published twice."""
    business_date = FIRST_DATE.isoformat()
    key = str(logical_key("acme", business_date))
    harness.keys.append(key)
    harness.restated_key("race", business_date, 1)
    specs = [harness.spec(f"racer-{n}", business_date, cadence_minutes=cadence(2)) for n in range(3)]
    pids, gate = harness.server.spawn(specs, gated=True)
    harness.server.release(gate)
    outcomes = harness.server.wait(pids)
    statuses = sorted(
        (outcome.result["status"], outcome.result["error_class"]) if outcome.result else ("died", str(outcome))
        for outcome in outcomes.values()
    )
    print(f"racing restatements: {statuses}")
    harness.check("after the race", key, business_date, final=True)
    harness.check_current(key, business_date, 2)
    harness.finish()

    assert_clean(harness.tally)
    # The losers are refused while the winner holds the key, or find it completed (with revision 2, not restated).
    losers = [status for status in statuses if status != ("exported", None)]
    assert len(losers) == 2 and set(losers) <= {("already_completed", None), ("failed", "LeaseHeld")}, statuses
    assert [row.revision for row in harness.ledger.restatements.revisions(key)] == [1, 2]


def test_a_killed_s3_attempt_leaves_no_staged_customer_data_behind(fork_server, tmp_path, s3_bucket, s3_server):
    crash = CrashHarness(fork_server, "s3", tmp_path, {"bucket": s3_bucket, "endpoint_url": s3_server})
    try:
        crash.trial(0, point="after_stage")
        crash.finish()
        assert_clean(crash.tally)  # the export itself is fine: one export, completed

        leftovers = s3_staging_files(tmp_path / "tmp")
        assert [p for p in leftovers if b"@example.com" in p.read_bytes()] == [], (
            f"{len(leftovers)} staged file(s) holding customer emails outlive the attempt that wrote them"
        )
    finally:
        crash.close()


# Once a known limit (pinned as an expected failure): the retry's data object used to share the dead attempt's name
# (data.csv), met it with other bytes and recorded `conflict`. Each attempt now writes a place of its own token
# (r<revision>-t<token>/), nothing of it is visible until the pointer names it, and the next attempt's sweep deletes
# the dead attempt's place (a lower token, a revision above the pointer's: no pointer ever named it, none can).
def test_a_retry_completes_a_key_whose_killed_s3_attempt_left_its_data_object_without_a_manifest(
    fork_server, tmp_path, s3_bucket, s3_server, fault_proxy
):
    crash = CrashHarness(fork_server, "s3", tmp_path, {"bucket": s3_bucket, "endpoint_url": s3_server})
    arrived, release = threading.Event(), threading.Event()

    def hold_the_manifest_put(_method, _path):
        arrived.set()
        release.wait(30)  # the dying attempt waits here for its manifest PUT's answer; the PUT is never forwarded
        return True

    fault_proxy.inject(
        Fault.DROP_BEFORE_FORWARD, method="PUT", path_suffix="_manifest.json", when=hold_the_manifest_put
    )
    through_proxy = {**crash.destination_spec, "endpoint_url": fault_proxy.endpoint_url}
    dying = replace(crash.spec("dying", "2026-03-08"), destination=through_proxy, cadence_minutes=30)
    try:
        (pid,), _ = fork_server.spawn([dying])
        assert arrived.wait(60), "the attempt reached its manifest PUT"
        fork_server.signal(pid, signal.SIGKILL)
        assert fork_server.wait([pid])[pid].killed
        release.set()
        fault_proxy.clear()
        key = dying.logical_key
        found = crash.survey("2026-03-08")
        folder = found.folder_at(dying.target)
        assert found.exports == {} and len(found.hidden) == 1, "its data object landed, its manifest did not"
        assert folder is not None and [(p.name, p.manifest) for p in folder.places.values()] == [("r1-t1", None)]
        report = reconcile_batch(crash.ledger, crash.destination, limit=10, after=None, reconciler="test")
        assert [f.verdict.value for f in report.findings] == ["absent"]
        assert crash.ledger.queries.get(key).state is ExportState.FAILED, "nothing published: failed, safe to retry"

        # The retry reads the source again, which has changed since (a 15-minute cadence instead of 30).
        retry = run_attempt(
            replace(
                dying,
                run_id="retry",
                destination=crash.destination_spec,
                cadence_minutes=15,
                clock_offset_seconds=PAST_THE_LEASE,
                result_path=None,
            )
        )

        assert (retry["status"], retry["error_class"]) == ("exported", None), retry
        assert crash.ledger.queries.get(key).state is ExportState.COMPLETED
        after = crash.survey("2026-03-08")
        assert after.hidden == [], f"the retry's sweep deleted the dead attempt's place: {after.hidden}"
        problems = violations(crash.ledger, after, [key], final=True)
        assert {name: items for name, items in problems.items() if items} == {}, "the invariants hold after the retry"
    finally:
        release.set()
        crash.close()


def test_the_invariants_see_a_wrong_pointer_a_damaged_revision_a_stale_commit_and_a_deleted_one(tmp_path):
    """The checks the harness relies on, each shown failing on a destination damaged by hand (no fork server):
    revision 1 at r1-t1, revision 2 at r2-t2 (current, recorded), and a history of the untouched tree for the checks
    over time."""
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    spec = AttemptSpec(ledger_url, {"kind": "local", "root": str(tmp_path / "good")}, "2026-02-01", "first")
    assert run_attempt(spec)["status"] == "exported"
    ledger = open_ledger(ledger_url)
    key = spec.logical_key
    ledger.restatements.request(key, reason="late invoices", requested_by="test")
    assert run_attempt(replace(spec, run_id="second", cadence_minutes=30))["status"] == "exported"
    try:

        def damaged(name: str, change) -> dict[str, list]:
            root = tmp_path / name
            shutil.copytree(tmp_path / "good", root)
            folder = root / EXPORT_NAME / "tenant=acme" / "date=2026-02-01"
            seen = History()
            assert not any(violations(ledger, survey({"kind": "local", "root": str(root)}, ledger_url), [key],
                                      final=True, history=seen).values())  # fmt: skip
            change(folder)
            found = survey({"kind": "local", "root": str(root)}, ledger_url)
            return {name: items for name, items in violations(ledger, found, [key], final=True, history=seen).items()
                    if items}  # fmt: skip

        def pointer(folder, **changes):
            values = json.loads((folder / POINTER_NAME).read_text())
            (folder / POINTER_NAME).write_text(json.dumps({**values, **changes}))

        def copy_place(folder, source: str, target: str, **manifest_changes) -> dict:
            shutil.copytree(folder / source, folder / target)
            manifest = json.loads((folder / source / MANIFEST_NAME).read_text())
            changed = {**manifest, **manifest_changes}
            (folder / target / MANIFEST_NAME).write_text(json.dumps(changed))
            return changed

        assert damaged("untouched", lambda folder: None) == {}

        found = damaged("pointer-to-nothing", lambda folder: pointer(folder, revision=3, path="r3-t2"))
        assert set(found) == {"visible_partial", "current_not_one", "pointer_disagrees"}, found

        found = damaged("torn-current", lambda folder: (folder / "r2-t2" / "data.csv").write_bytes(b"invoice_id\n"))
        assert set(found) == {"visible_partial", "current_not_one", "named_deleted"}, found

        # Revision 1 is no longer visible, but it is recorded: nothing a recorded revision names may change or go.
        found = damaged("torn-earlier", lambda folder: (folder / "r1-t1" / "data.csv").write_bytes(b"invoice_id\n"))
        assert set(found) == {"named_deleted"}, found
        found = damaged("swept-earlier", lambda folder: shutil.rmtree(folder / "r1-t1"))
        assert set(found) == {"named_deleted"}, found

        found = damaged("no-pointer", lambda folder: (folder / POINTER_NAME).unlink())
        assert set(found) == {"pointer_disagrees", "revision_chain_broken"}, found  # and it moved back to nothing

        def pointer_back_to_1(folder):
            first = json.loads((folder / "r1-t1" / MANIFEST_NAME).read_text())
            pointer(folder, revision=1, path="r1-t1", manifest="r1-t1/_manifest.json", data_file="r1-t1/data.csv",
                    sha256=first["sha256"], row_count=first["row_count"])  # fmt: skip

        found = damaged("pointer-back", pointer_back_to_1)
        assert set(found) == {"pointer_disagrees", "revision_chain_broken", "stale_token_visible"}, found

        def unrecorded_revision_3(folder):
            third = copy_place(folder, "r2-t2", "r3-t3", revision=3, supersedes_revision=2, fencing_token=3)
            pointer(folder, revision=3, path="r3-t3", manifest="r3-t3/_manifest.json", data_file="r3-t3/data.csv",
                    fence=3, sha256=third["sha256"])  # fmt: skip

        # A commit under a token the ledger never issued (the ledger's token is 2).
        found = damaged("unrecorded", unrecorded_revision_3)
        assert set(found) == {"pointer_disagrees", "stale_token_visible"}, found

        def stale_commit(folder):
            copy_place(folder, "r2-t2", "r2-t1", fencing_token=1)
            pointer(folder, path="r2-t1", manifest="r2-t1/_manifest.json", data_file="r2-t1/data.csv")

        # Token 1's revision 2 made current under fence 2: a stale commit that succeeded, over the recorded place.
        found = damaged("stale-commit", stale_commit)
        assert set(found) == {"pointer_disagrees", "stale_token_visible", "revision_replaced"}, found
    finally:
        dispose_engines()


def test_the_invariants_see_a_ledger_tables_wrong_pointer_and_torn_revision(tmp_path):
    """The ledger table's survey, shown failing on tables damaged by hand: its pointer row is the pointer, its kept
    revisions the places."""
    good = tmp_path / "good.sqlite3"
    table = {"kind": "sql", "table": "exported_invoices"}
    spec = AttemptSpec(f"sqlite:///{good}", table, "2026-02-01", "first")
    assert run_attempt(spec)["status"] == "exported"
    key = spec.logical_key
    open_ledger(spec.ledger_url).restatements.request(key, reason="late invoices", requested_by="test")
    assert run_attempt(replace(spec, run_id="second", cadence_minutes=30))["status"] == "exported"
    dispose_engines()
    try:

        def damaged(name: str, statement: str, *params) -> dict[str, list]:
            copy = tmp_path / f"{name}.sqlite3"
            shutil.copy(good, copy)
            with sqlite3.connect(copy) as conn:
                conn.execute(statement, params)
            url = f"sqlite:///{copy}"
            found = survey(table, url)
            return {
                name: items for name, items in violations(open_ledger(url), found, [key], final=True).items() if items
            }

        assert damaged("untouched", "SELECT 1") == {}

        found = damaged(
            "pointer-back",
            "UPDATE exported_invoices_manifests SET manifest = "
            "(SELECT manifest FROM exported_invoices_revisions WHERE revision = 1)",
        )
        assert set(found) == {"pointer_disagrees"}, found

        found = damaged(
            "pointer-unkept", "UPDATE exported_invoices_manifests SET manifest = replace(manifest, '\"revision\"', ?)",
            '"revision_note": "edited", "revision"',
        )  # fmt: skip
        assert set(found) == {"visible_partial", "current_not_one", "pointer_disagrees"}, found

        # Revision 1's rows (keyed by the logical key), recorded and kept: one gone is a recorded revision damaged.
        found = damaged("torn", "DELETE FROM exported_invoices WHERE logical_key = ? AND row_number = 0", key)
        assert set(found) == {"named_deleted"}, found

        found = damaged(
            "stray-rows", "UPDATE exported_invoices SET logical_key = ? WHERE logical_key = ? AND row_number = 0",
            f"{key}#x", key,
        )  # fmt: skip
        assert "visible_partial" in found and any(f"{key}#x" in item for item in found["visible_partial"]), found
    finally:
        dispose_engines()


def test_the_survey_reads_a_0_4_0_layout_as_readers_do(tmp_path):
    """Legacy layouts (docs/protocol.md, "Legacy layout"): no pointer and a manifest in the key folder is revision 1 at
    place ``.``; a pointer without ``format`` names ``revision=N/`` with fence 0 (not a fenced pointer)."""
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    spec = AttemptSpec(ledger_url, {"kind": "local", "root": str(tmp_path / "v2")}, "2026-02-01", "first")
    assert run_attempt(spec)["status"] == "exported"
    dispose_engines()
    place = tmp_path / "v2" / EXPORT_NAME / "tenant=acme" / "date=2026-02-01" / "r1-t1"
    folder = tmp_path / "legacy" / EXPORT_NAME / "tenant=acme" / "date=2026-02-01"
    shutil.copytree(place, folder)  # revision 1 as 0.4.0 wrote it: the key folder itself, no pointer
    legacy = {"kind": "local", "root": str(tmp_path / "legacy")}

    found = survey(legacy, ledger_url)
    key = spec.logical_key
    assert (found.current(key), found.visible(key).name, found.partial) == (1, ".", []), "revision 1, no pointer"
    assert not found.folder(key).pointer.fenced, "a legacy reading carries no fence"

    shutil.copytree(place, folder / "revision=2")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    second = {**manifest, "revision": 2, "supersedes_revision": 1, "supersedes_sha256": manifest["sha256"]}
    (folder / "revision=2" / MANIFEST_NAME).write_text(json.dumps(second))
    (folder / POINTER_NAME).write_text(json.dumps(
        {"logical_key": key, "revision": 2, "path": "revision=2", "sha256": manifest["sha256"]}
    ))  # fmt: skip

    found = survey(legacy, ledger_url)
    assert (found.current(key), found.visible(key).name, found.partial) == (2, "revision=2", []), "0.4.0's pointer"
    assert (found.folder(key).pointer.fence, found.folder(key).pointer.fenced) == (0, False)
    assert sorted(found.places(key)) == [".", "revision=2"], "revision 1 stays beside it, unnamed"


@pytest.fixture(params=["gcs", "azure"])
def cloud_spec(request) -> dict:
    """A GCS bucket on fake-gcs-server or an Azure container on Azurite, as a destination spec."""
    if request.param == "gcs":
        bucket, endpoint = request.getfixturevalue("gcs_bucket"), request.getfixturevalue("gcs_server")
        return {"kind": "gcs", "bucket": bucket, "prefix": "exports", "endpoint_url": endpoint}
    return {
        "kind": "azure", "container": request.getfixturevalue("azure_container"), "prefix": "exports",
        "endpoint_url": request.getfixturevalue("azurite_server"), "account_name": AZURITE_ACCOUNT,
        "account_key": AZURITE_KEY,
    }  # fmt: skip


def test_the_invariants_see_a_cloud_stores_wrong_pointer_and_deleted_revision(tmp_path, cloud_spec):
    """The GCS and Azure surveys (the SDK's listing, not the destination's reads), shown failing on a bucket damaged
    by hand: a pointer naming a place that is not there, then revision 1's data object deleted."""
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    spec = AttemptSpec(ledger_url, cloud_spec, "2026-02-01", "first")
    assert run_attempt(spec)["status"] == "exported"
    key, ledger = spec.logical_key, open_ledger(ledger_url)
    store = build_destination(cloud_spec, ledger_url).store
    client = store_client(cloud_spec)
    folder = "/".join(spec.target.parts)
    try:

        def problems() -> dict[str, list]:
            found = survey(cloud_spec, ledger_url, client=client)
            return {name: items for name, items in violations(ledger, found, [key], final=True).items() if items}

        assert problems() == {}
        good = store.get(f"{folder}/{POINTER_NAME}")
        moved = {**json.loads(good.data), "revision": 3, "path": "r3-t1"}
        tag = store.put_if_match(f"{folder}/{POINTER_NAME}", json.dumps(moved).encode(), good.tag)
        assert set(problems()) == {"visible_partial", "current_not_one", "pointer_disagrees"}

        store.put_if_match(f"{folder}/{POINTER_NAME}", good.data, tag)
        assert problems() == {}, "the pointer put back"
        manifest = json.loads(store.read(f"{folder}/r1-t1/{MANIFEST_NAME}"))
        store.delete(f"{folder}/r1-t1/{manifest['data_file']}")
        assert set(problems()) == {"visible_partial", "current_not_one", "named_deleted"}
    finally:
        client.close()
        dispose_engines()


def test_the_invariants_see_a_delta_tables_torn_rows_stray_rows_and_a_txn_moved_back(tmp_path):
    """The Delta survey (the log's txn versions, commit metadata and the rows at each version), shown failing on
    copies of a table damaged by hand: revision 1 then revision 2 of one key, committed by the destination."""
    import deltalake

    from export_ledger.destinations.delta import KEY_COLUMN, ROW_COLUMN

    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    good = {"kind": "delta", "table": str(tmp_path / "good" / "{export}")}
    spec = AttemptSpec(ledger_url, good, "2026-02-01", "first")
    assert run_attempt(spec)["status"] == "exported"
    key, ledger = spec.logical_key, open_ledger(ledger_url)
    ledger.restatements.request(key, reason="late invoices", requested_by="test")
    assert run_attempt(replace(spec, run_id="second", cadence_minutes=30))["status"] == "exported"
    try:

        def damaged(name: str, change) -> dict[str, list]:
            shutil.copytree(tmp_path / "good", tmp_path / name)
            copy = {"kind": "delta", "table": str(tmp_path / name / "{export}")}
            seen = History()
            assert not any(violations(ledger, survey(copy, ledger_url), [key], final=True, history=seen).values())
            change(str(tmp_path / name / EXPORT_NAME))
            found = survey(copy, ledger_url)
            return {name: items for name, items in violations(ledger, found, [key], final=True, history=seen).items()
                    if items}  # fmt: skip

        assert damaged("untouched", lambda table: None) == {}

        def tear(table):  # one row of the current revision deleted by a commit of someone else
            deltalake.DeltaTable(table).delete(f"{KEY_COLUMN} = '{key}' AND {ROW_COLUMN} = 0")

        assert set(damaged("torn", tear)) == {"visible_partial", "current_not_one", "named_deleted"}

        def stray(table):  # rows appended under a key no commit of the key names
            rows = deltalake.DeltaTable(table).to_pyarrow_table(filters=[(KEY_COLUMN, "=", key)]).slice(0, 2)
            rows = rows.set_column(rows.schema.get_field_index(KEY_COLUMN), KEY_COLUMN,
                                   pa.array([f"{key}#x"] * rows.num_rows))  # fmt: skip
            deltalake.write_deltalake(table, rows, mode="append", partition_by=[KEY_COLUMN])

        found = damaged("stray", stray)
        assert set(found) == {"visible_partial"} and f"{key}#x" in found["visible_partial"][0], found

        def back_to_1(table):  # the key's txn version set back to revision 1 by an empty commit
            opened = deltalake.DeltaTable(table)
            properties = deltalake.CommitProperties(app_transactions=[deltalake.Transaction(key, 1)])
            opened.create_write_transaction([], mode="append", schema=opened.schema(), partition_by=[KEY_COLUMN],
                                            commit_properties=properties)  # fmt: skip

        # Readers of the latest version now get revision 2's rows under revision 1's manifest: torn, and moved back
        # below the fence it carried.
        found = damaged("moved-back", back_to_1)
        assert set(found) == {"visible_partial", "current_not_one", "pointer_disagrees", "revision_chain_broken",
                              "stale_token_visible", "named_deleted"}, found  # fmt: skip
    finally:
        dispose_engines()
