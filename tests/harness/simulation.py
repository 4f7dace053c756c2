"""A deterministic simulation of the export protocol: seeded schedules over the real ledger and destinations.

Each schedule is drawn from one seed. Attempts run the real write protocol (:func:`export_ledger.export_key`) in
threads, but only one runs at a time: at every named point of the protocol (``after_claim`` ... ``after_commit``) an
attempt hands control back to the scheduler, which decides from the seed what happens next:

* resume an attempt, crash it there (it stops like a killed process: no handler records anything), make it fail there
  (an ordinary error), or leave it paused (a stalled worker);
* start another attempt on a key (a retry, a concurrent backfill);
* advance the ledger's clock past the lease (a stalled holder loses its key);
* tick the sensor: reconcile stuck keys (hold with a new token, fence the pointer, judge), then rerun failed keys with
  automatic reruns left (``claim_count``);
* inject a destination fault on the attempt's next write: after its claim (the pointer's fence, or the staging of its
  place) or after staging (the pointer's commit, the one write readers see); S3 through the fault proxy, local and
  ledger table as a failure at the store or the insert itself;
* change the source (late data): attempts read their source after the claim, so a retry may carry other bytes than a
  dead attempt left behind;
* request a restatement of a completed key: the source changes and the key's next attempts race to commit revision
  N + 1 over N (the pointer's compare-and-swap, fenced by the token).

Then faults stop: paused attempts wake up (and must be fenced), the clock passes every lease, and the sensor ticks and
reruns until nothing changes. The checks are the invariants of docs/protocol.md ("Invariants") through
:func:`harness.protocol.violations` on the v2 layout read directly (:func:`harness.protocol.survey`), with what every
earlier step saw of the schedule's keys:

* safety, after every step: one recorded export per revision; nothing half-visible; exactly one current revision (the
  pointer, naming a whole place); the pointer agreeing with the ledger (``completed``: its recorded revision;
  ``failed``: the recorded one it superseded, or nothing; under way: either); recorded revisions a chain, the pointer
  never moving back; no effect of a stale token visible (a fence never goes down, no commit below it succeeds);
  nothing a pointer or a recorded revision named deleted or replaced;
* liveness, at the end: every key ``completed`` with its restatement done (the requested partition is materialized
  once more, as an operator would), or escalated to a person (a conflict, or failed with its automatic reruns
  spent); one effect row per revision.

A failing schedule is reported with its seed; ``replay(seed, ...)`` runs exactly that schedule again.
"""

from __future__ import annotations

import datetime as dt
import random
import threading
from dataclasses import dataclass, field

import pandas as pd
from builders import open_ledger

from export_ledger import failpoints
from export_ledger.calendar import window_for
from export_ledger.destinations import ExportTarget, TransactionalDestination
from export_ledger.frames import ExportSchema
from export_ledger.keys import LogicalKey
from export_ledger.ledger import DEFAULT_MAX_ATTEMPTS, ExportState
from export_ledger.protocol import ExportItem, export_key
from export_ledger.reconcile import reconcile_batch
from harness.protocol import EFFECTS, History, violations

UTC = dt.timezone.utc
ZONE = "America/New_York"
TTL = dt.timedelta(minutes=15)
SCHEMA = ExportSchema(
    {"event_id": "string", "tenant": "string", "at": "timestamp", "value": "float"}, "at", ("event_id",), "tenant"
)
POINTS = failpoints.POINTS
MAX_STEPS = 24


class Crash(BaseException):
    """The attempt dies here: nothing after it runs and no handler records anything."""


class Injected(RuntimeError):
    """An ordinary failure at a named point (a full disk, a dropped connection before anything was sent)."""


@dataclass
class Clock:
    now: dt.datetime

    def __call__(self) -> dt.datetime:
        return self.now


class Attempt(threading.Thread):
    """One attempt on one key, stepped by the scheduler at each named point."""

    def __init__(self, sim: Simulation, name: str, key: LogicalKey) -> None:
        super().__init__(name=name, daemon=True)
        self.sim, self.key = sim, key
        self.attempt_id = f"{name}/sim"
        self.turn = threading.Event()
        self.point: str | None = "start"
        self.fate: str | None = None  # crash | raise, set by the scheduler before resuming
        self.outcome: str | None = None
        self.done = False

    def run(self) -> None:
        self.turn.wait()
        self.turn.clear()
        sim, key = self.sim, self.key

        def frame() -> pd.DataFrame:  # read after the claim, as the source is when it is read (late data included)
            return sim.frame(key, sim.versions.get(str(key), 0))

        try:
            result = export_key(
                sim.ledger, sim.destination, SCHEMA, ExportItem(key, "p", frame), self.attempt_id,
                log=lambda _level, _message: None,
            )  # fmt: skip
            self.outcome = result.status
        except Crash:
            self.outcome = "crashed"
        except Exception as exc:  # the attempt's own failure is its outcome
            self.outcome = type(exc).__name__
        finally:
            self.done = True
            self.point = None
            self.sim.back.set()

    def at(self, point: str) -> None:
        """Called in this thread at a named point: hand control back, then do what the scheduler decided."""
        if point == "before_commit" and isinstance(self.sim.destination, TransactionalDestination):
            # Inside the ledger's transaction, holding its write lock: another attempt could not run (a frozen
            # process there blocks the others: a known limit). Decide here, without handing control back.
            fate = self.sim.rng.choice((None, None, None, "crash", "raise"))
            if fate == "crash":
                raise Crash(point)
            if fate == "raise":
                raise Injected(f"injected failure at {point}")
            return
        self.point = point
        self.sim.back.set()
        self.turn.wait()
        self.turn.clear()
        fate, self.fate = self.fate, None
        if fate == "crash":
            raise Crash(point)
        if fate == "raise":
            raise Injected(f"injected failure at {point}")


@dataclass
class Report:
    seed: int
    steps: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    revisions: dict[str, int] = field(default_factory=dict)  # each key's current revision at the end


#: The points after which an attempt's next step writes to the destination, and what it writes there: the fence and
#: its place's staging (after its claim), the commit of the pointer (after staging: the one write readers see).
WRITES = {"after_claim": "fence or stage", "after_stage": "commit"}


class Simulation:
    """One seeded schedule over ``destination`` and ``ledger_url``; :meth:`run` returns a :class:`Report`.

    ``fault(kind)`` arms one destination fault for the next write (the caller's own per destination; None disarms),
    and ``survey(targets)`` returns what the destination holds at those targets' key folders as a
    :class:`harness.protocol.Survey` (read directly, as readers read the layout). With ``restatements`` (a
    destination that keeps revisions), schedules restate keys.
    """

    def __init__(
        self,
        seed: int,
        *,
        ledger_url: str,
        destination,
        fault,
        survey,
        fault_kinds,
        restatements: bool = False,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = Clock(dt.datetime(2026, 3, 9, 9, 30, tzinfo=UTC) + dt.timedelta(days=seed))
        self.ledger = open_ledger(ledger_url, lease_ttl=TTL, clock=self.clock)
        self.destination = destination
        self.fault, self.survey, self.fault_kinds = fault, survey, fault_kinds
        self.restatements = restatements
        self.history = History()  # what every check saw of this schedule's keys: the invariants over time
        self.last_look: list | None = None  # the keys' records when the destination was last read
        self.back = threading.Event()
        self.attempts: list[Attempt] = []
        self.versions: dict[str, int] = {}
        self.report = Report(seed)
        day = dt.date(2026, 1, 1) + dt.timedelta(days=seed % 3000)
        tenants = [f"s{seed}a", f"s{seed}b"][: self.rng.choice((1, 1, 2))]
        self.keys = [LogicalKey("sim", tenant, window_for(day, ZONE)) for tenant in tenants]

    # -- the world ---------------------------------------------------------------------------------------------

    def frame(self, key: LogicalKey, version: int) -> pd.DataFrame:
        """Three events of the key's window; a later version (late data, a restatement) adds one and changes the
        values, so each version's bytes differ."""
        start = pd.Timestamp(key.window.start_utc)
        times = [start + pd.Timedelta(hours=h) for h in range(3 + min(version, 1))]
        return pd.DataFrame(
            {
                "event_id": [f"{key.tenant}-{i}" for i in range(len(times))],
                "tenant": [key.tenant] * len(times),
                "at": pd.DatetimeIndex(times).as_unit("us"),
                "value": [1.5 + version] * len(times),
            }
        )

    def _hook(self, point: str) -> None:
        current = threading.current_thread()
        if isinstance(current, Attempt) and current.sim is self:
            current.at(point)

    def _step(self, attempt: Attempt, fate: str | None = None) -> None:
        attempt.fate = fate
        self.back.clear()
        if not attempt.is_alive() and not attempt.done:
            attempt.start()
        attempt.turn.set()
        if not self.back.wait(60):
            raise RuntimeError(f"seed {self.seed}: attempt {attempt.name} did not hand control back")

    def _start(self, key: LogicalKey) -> Attempt:
        attempt = Attempt(self, f"a{len(self.attempts)}", key)
        self.attempts.append(attempt)
        self._step(attempt)  # runs until its first named point (or its end: a refused claim)
        return attempt

    def _tick(self, *, rerun: bool) -> None:
        destinations = self.destination
        reconcile_batch(self.ledger, destinations, limit=100, after=None, reconciler=f"sensor@{self.clock.now}")
        if not rerun:
            return
        # This schedule's failed keys (the sensor walks every failed key with a cursor; earlier schedules' escalated
        # keys stay failed in this shared ledger and would fill a first page).
        failed = [r for r in self._records() if r is not None and r.state is ExportState.FAILED]
        for record in failed:
            if record.claim_count < DEFAULT_MAX_ATTEMPTS:  # export claims since the last request or resolution
                key = next(k for k in self.keys if str(k) == record.logical_key)
                key = LogicalKey(key.export, key.tenant, record.window)
                self._finish(self._start(key), faults=False)

    def _finish(self, attempt: Attempt, *, faults: bool) -> None:
        while not attempt.done:
            fate = None
            if faults and self.rng.random() < 0.1:
                fate = self.rng.choice(("crash", "raise"))
            publishing = attempt.point in WRITES and fate != "crash"  # a crash there stops before any write
            self._step(attempt, fate)
            self._check(published=publishing)

    # -- the checks --------------------------------------------------------------------------------------------

    def _records(self) -> list:
        """The schedule's keys' records (None: never claimed), in key order."""
        return [self.ledger.queries.get(str(key)) for key in self.keys]

    def _check(self, *, published: bool = True) -> None:
        """Safety now. The destination is read when a step may have written to it (``published``), or when a key is
        completed and the ledger's records changed since the last look; otherwise neither the destination nor the
        ledger changed since then, and the invariants would find what they found."""
        names = [str(key) for key in self.keys]
        records = self._records()
        completed = any(r is not None and r.state is ExportState.COMPLETED for r in records)
        if not (published or completed) or (not published and records == self.last_look):
            return
        self.last_look = records
        found = self.survey([target_of(key) for key in self.keys])
        checked = violations(
            self.ledger, found, names, final=False, history=self.history, records=dict(zip(names, records, strict=True))
        )
        for invariant, items in checked.items():
            for item in items:
                self._violation(f"{invariant}: {item}")

    def _violation(self, text: str) -> None:
        if text not in self.report.violations:
            self.report.violations.append(text)

    # -- the schedule ------------------------------------------------------------------------------------------

    def run(self) -> Report:
        failpoints.set_hook(self._hook)
        try:
            self._schedule()
            self._quiesce()
        finally:
            failpoints.set_hook(None)
            for attempt in self.attempts:  # never leave a thread waiting for a turn that will not come
                while attempt.is_alive() and not attempt.done:
                    self._step(attempt, "crash")
        return self.report

    def _schedule(self) -> None:
        rng = self.rng
        if self.restatements and rng.random() < 0.5:
            # A restatement schedule: the keys were exported (once or twice) before, and are restated now; the
            # schedule's attempts race to publish the next revision.
            for key in self.keys:
                for _ in range(rng.choice((1, 1, 2))):
                    self._finish(self._start(key), faults=False)
                    self._request(key)
        for key in self.keys:
            self._start(key)
        for _ in range(MAX_STEPS):
            live = [a for a in self.attempts if not a.done]
            if not live and rng.random() < 0.5:
                break  # every attempt ended: the schedule may stop here, or go on with a retry
            roll = rng.random()
            if live and roll < 0.55:
                attempt = rng.choice(live)
                fate = rng.choice((None, None, None, None, "crash", "raise"))
                if fate is None and attempt.point in WRITES and self.fault_kinds and rng.random() < 0.3:
                    kind = rng.choice(self.fault_kinds)
                    self.fault(kind)
                    self.report.steps.append(f"fault {kind} on {attempt.name}'s {WRITES[attempt.point]}")
                self.report.steps.append(f"{attempt.name}@{attempt.point} -> {fate or 'go'}")
                # The next step may fence, stage or commit (a crash at the point stops before any of them).
                publishing = attempt.point in WRITES and fate != "crash"
                self._step(attempt, fate)
                self._check(published=publishing)
                continue
            elif roll < 0.70 and len(self.attempts) < 8:
                key = rng.choice(self.keys)
                self.report.steps.append(f"start on {key.tenant}")
                self._start(key)
                self._check(published=False)
                continue
            elif roll < 0.80:
                self.clock.now += TTL + dt.timedelta(seconds=1)
                self.report.steps.append("lease expires")
                continue  # nothing at the destination or in the ledger changed: no check needed
            elif roll < 0.90:
                self.report.steps.append("sensor tick")
                self._tick(rerun=False)
                self._check(published=False)
                continue
            elif self.restatements and roll < 0.95:
                records = zip(self.keys, self._records(), strict=True)
                done = [k for k, record in records if record is not None and record.state is ExportState.COMPLETED]
                if done and self._request(rng.choice(done)):
                    self._check(published=False)
            else:
                key = rng.choice(self.keys)
                self.versions[str(key)] = self.versions.get(str(key), 0) + 1
                self.report.steps.append(f"late data for {key.tenant}")

    def _request(self, key: LogicalKey) -> bool:
        """An operator restates ``key`` (the source was corrected) if it is completed with no request open."""
        record = self.ledger.queries.get(str(key))
        if record is None or record.state is not ExportState.COMPLETED:
            return False
        if self.ledger.restatements.open_requests([str(key)]):
            return False
        request = self.ledger.restatements.request(str(key), reason="corrected", requested_by="sim")
        self.versions[str(key)] = self.versions.get(str(key), 0) + 1
        self.report.steps.append(f"restate {key.tenant} to revision {request.revision}")
        return True

    def _quiesce(self) -> None:
        self.fault(None)
        for attempt in self.attempts:  # stalled workers wake up: they must be fenced, or finish cleanly
            self._finish(attempt, faults=False)
        for _ in range(DEFAULT_MAX_ATTEMPTS + 3):  # until nothing changes: each round can only move keys forward
            before = self._records()
            self.clock.now += TTL + dt.timedelta(seconds=1)
            self._tick(rerun=True)
            self._check()
            if self.restatements:  # a restated partition is materialized once more, as an operator would
                requests = self.ledger.restatements.open_requests([str(k) for k in self.keys])
                for key in self.keys:
                    record = self.ledger.queries.get(str(key))
                    if str(key) in requests and record.state is ExportState.COMPLETED:
                        self._finish(self._start(key), faults=False)
                        self._check()
            if self._records() == before:
                break
        for key in self.keys:
            record = self.ledger.queries.get(str(key))
            if record is None:
                self._violation(f"{key}: never recorded although attempts were asked for it")
                continue
            # What needs_attention escalates at once: a conflict, or a failed key whose automatic reruns are spent
            # (export claims since the last request or resolution; reconciliation's holds do not count).
            escalated = record.state is ExportState.CONFLICT or (
                record.state is ExportState.FAILED and record.claim_count >= DEFAULT_MAX_ATTEMPTS
            )
            if record.state is not ExportState.COMPLETED and not escalated:
                self._violation(
                    f"{key}: {record.state.value} (token {record.fencing_token}), neither done nor escalated"
                )
            if record.state is ExportState.COMPLETED:
                self.report.revisions[str(key)] = self.ledger.restatements.current_revision(str(key)).revision
                if self.restatements and self.ledger.restatements.open_requests([str(key)]):
                    self._violation(f"{key}: completed with its restatement still open after quiescence")
                revisions = len(self.ledger.restatements.revisions(str(key)))
                effects = [a for a in self.ledger.queries.attempts(str(key)) if a.outcome in EFFECTS]
                if len(effects) != revisions:
                    self._violation(f"{key}: {len(effects)} attempt rows record an effect for {revisions} revision(s)")


def target_of(key: LogicalKey, revision: int = 1) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision)
