"""A deterministic simulation of the export protocol: seeded schedules over the real ledger and destinations.

Each schedule is drawn from one seed. Attempts run the real write protocol (:func:`export_ledger.export_key`) in
threads, but only one runs at a time: at every named point of the protocol (``after_claim`` ... ``after_commit``) an
attempt hands control back to the scheduler, which decides from the seed what happens next:

* resume an attempt, crash it there (it stops like a killed process: no handler records anything), make it fail there
  (an ordinary error), or leave it paused (a stalled worker);
* start another attempt on a key (a retry, a concurrent backfill);
* advance the ledger's clock past the lease (a stalled holder loses its key);
* tick the sensor: reconcile stuck keys from the destination's evidence, then rerun failed keys with reruns left;
* inject a destination fault on the next write (S3: through the fault proxy; local and ledger table: a failure at
  the write itself);
* change the source (late data), so a retry may carry other bytes than a dead attempt left behind.

Then faults stop: paused attempts wake up (and must be fenced), the clock passes every lease, and the sensor ticks and
reruns until nothing changes. The checks:

* safety, after every step: at most one export per key at the destination, a published export never replaced, no
  ``completed`` record without its export (same sha256);
* liveness, at the end: every key ``completed``, or escalated to a person (:meth:`ExportLedger.needs_attention`).

A failing schedule is reported with its seed; ``replay(seed, ...)`` runs exactly that schedule again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import random
import threading
from dataclasses import dataclass, field

import pandas as pd

from export_ledger import failpoints
from export_ledger.calendar import window_for
from export_ledger.destinations import ExportTarget, TransactionalDestination
from export_ledger.frames import ExportSchema
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ExportLedger, ExportState
from export_ledger.ledger.core import DEFAULT_MAX_ATTEMPTS
from export_ledger.protocol import ExportItem, export_key
from export_ledger.reconcile import reconcile_batch

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

    def __init__(self, sim: Simulation, name: str, key: LogicalKey, version: int) -> None:
        super().__init__(name=name, daemon=True)
        self.sim, self.key, self.version = sim, key, version
        self.attempt_id = f"{name}/sim"
        self.turn = threading.Event()
        self.point: str | None = "start"
        self.fate: str | None = None  # crash | raise, set by the scheduler before resuming
        self.outcome: str | None = None
        self.done = False

    def run(self) -> None:
        self.turn.wait()
        self.turn.clear()
        frame = self.sim.frame(self.key, self.version)
        try:
            result = export_key(
                self.sim.ledger, self.sim.destination, SCHEMA, ExportItem(self.key, "p", frame), self.attempt_id,
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


class Simulation:
    """One seeded schedule over ``destination`` and ``ledger_url``; :meth:`run` returns a :class:`Report`.

    ``fault(kind)`` arms one destination fault for the next write (the caller's own per destination; None disarms),
    and ``survey(keys)`` returns the exports the destination holds for those keys as ``{logical key: [sha256, ...]}``.
    """

    def __init__(self, seed: int, *, ledger_url: str, destination, fault, survey, fault_kinds) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = Clock(dt.datetime(2026, 3, 9, 9, 30, tzinfo=UTC) + dt.timedelta(days=seed))
        self.ledger = ExportLedger(ledger_url, lease_ttl=TTL, clock=self.clock)
        self.destination = destination
        self.fault, self.survey, self.fault_kinds = fault, survey, fault_kinds
        self.back = threading.Event()
        self.attempts: list[Attempt] = []
        self.versions: dict[str, int] = {}
        self.first_export: dict[str, str] = {}
        self.report = Report(seed)
        day = dt.date(2026, 1, 1) + dt.timedelta(days=seed % 3000)
        tenants = [f"s{seed}a", f"s{seed}b"][: self.rng.choice((1, 1, 2))]
        self.keys = [LogicalKey("sim", tenant, window_for(day, ZONE)) for tenant in tenants]

    # -- the world ---------------------------------------------------------------------------------------------

    def frame(self, key: LogicalKey, version: int) -> pd.DataFrame:
        """Three events of the key's window; a later version (late data) adds one, so its bytes differ."""
        start = pd.Timestamp(key.window.start_utc)
        times = [start + pd.Timedelta(hours=h) for h in range(3 + min(version, 1))]
        return pd.DataFrame(
            {
                "event_id": [f"{key.tenant}-{i}" for i in range(len(times))],
                "tenant": [key.tenant] * len(times),
                "at": pd.DatetimeIndex(times).as_unit("us"),
                "value": [1.5] * len(times),
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
        attempt = Attempt(self, f"a{len(self.attempts)}", key, self.versions.get(str(key), 0))
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
        records = [self.ledger.get(str(k)) for k in self.keys]
        failed = [r for r in records if r is not None and r.state is ExportState.FAILED]
        bases = self.ledger.rerun_bases([r.logical_key for r in failed])
        for record in failed:
            if record.fencing_token - bases[record.logical_key] < DEFAULT_MAX_ATTEMPTS:
                key = next(k for k in self.keys if str(k) == record.logical_key)
                key = LogicalKey(key.export, key.tenant, record.window)
                self._finish(self._start(key), faults=False)

    def _finish(self, attempt: Attempt, *, faults: bool) -> None:
        while not attempt.done:
            fate = None
            if faults and self.rng.random() < 0.1:
                fate = self.rng.choice(("crash", "raise"))
            publishing = attempt.point in ("after_stage", "after_claim")
            self._step(attempt, fate)
            self._check(published=publishing)

    # -- the checks --------------------------------------------------------------------------------------------

    def _check(self, *, published: bool = True) -> None:
        """Safety now. The destination is read when a step may have published (``published``) or a key says it is
        completed; otherwise nothing there can have changed since the last look."""
        records = {str(key): self.ledger.get(str(key)) for key in self.keys}
        completed = any(r is not None and r.state is ExportState.COMPLETED for r in records.values())
        exports = self.survey(self.keys) if published or completed else {}
        for key in self.keys:
            name = str(key)
            found = exports.get(name, [])
            if len(found) > 1:
                self._violation(f"{name}: {len(found)} exports at the destination")
            if found:
                first = self.first_export.setdefault(name, found[0])
                if found[0] != first:
                    self._violation(f"{name}: the published export was replaced ({first[:12]} -> {found[0][:12]})")
            record = records[name]
            if record is not None and record.state is ExportState.COMPLETED and record.sha256 not in found:
                self._violation(f"{name}: completed in the ledger without its export at the destination")

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
                if fate is None and attempt.point == "after_stage" and self.fault_kinds and rng.random() < 0.3:
                    kind = rng.choice(self.fault_kinds)
                    self.fault(kind)
                    self.report.steps.append(f"fault {kind} on {attempt.name}'s publish")
                self.report.steps.append(f"{attempt.name}@{attempt.point} -> {fate or 'go'}")
                publishing = attempt.point in ("after_stage", "after_claim")  # the next step may publish or write
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
            else:
                key = rng.choice(self.keys)
                self.versions[str(key)] = self.versions.get(str(key), 0) + 1
                self.report.steps.append(f"late data for {key.tenant}")

    def _quiesce(self) -> None:
        self.fault(None)
        for attempt in self.attempts:  # stalled workers wake up: they must be fenced, or finish cleanly
            self._finish(attempt, faults=False)
        for _ in range(DEFAULT_MAX_ATTEMPTS + 3):  # until nothing changes: each round can only move keys forward
            before = [self.ledger.get(str(k)) for k in self.keys]
            self.clock.now += TTL + dt.timedelta(seconds=1)
            self._tick(rerun=True)
            self._check()
            if [self.ledger.get(str(k)) for k in self.keys] == before:
                break
        bases = self.ledger.rerun_bases([str(k) for k in self.keys])
        for key in self.keys:
            record = self.ledger.get(str(key))
            if record is None:
                self._violation(f"{key}: never recorded although attempts were asked for it")
                continue
            spent = record.fencing_token - bases[str(key)]
            # What needs_attention escalates at once: a conflict, or a failed key whose automatic reruns are spent.
            escalated = record.state is ExportState.CONFLICT or (
                record.state is ExportState.FAILED and spent >= DEFAULT_MAX_ATTEMPTS
            )
            if record.state is not ExportState.COMPLETED and not escalated:
                self._violation(
                    f"{key}: {record.state.value} (token {record.fencing_token}), neither done nor escalated"
                )
            if record.state is ExportState.COMPLETED:
                effects = [a for a in self.ledger.attempts(str(key)) if a.outcome.value in ("completed", "repaired")]
                if len(effects) != 1:
                    self._violation(f"{key}: {len(effects)} attempt rows record an effect, not one")


def survey_through(destination, keys) -> dict[str, list[str]]:
    """What the destination holds for ``keys``, through its own probe and read (the path readers take):
    ``{logical key: [sha256]}``; a data file that does not match its manifest shows as ``torn:<sha256>``."""
    found: dict[str, list[str]] = {}
    for key in keys:
        target = target_of(key)
        manifest = destination.probe(target)
        if manifest is None:
            continue
        data = destination.read_data(target, manifest)
        sha = manifest.sha256 if hashlib.sha256(data).hexdigest() == manifest.sha256 else "torn:" + manifest.sha256
        found.setdefault(manifest.logical_key, []).append(sha)
    return found


def target_of(key: LogicalKey) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat())
