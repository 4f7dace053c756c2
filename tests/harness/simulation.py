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
* change the source (late data), so a retry may carry other bytes than a dead attempt left behind;
* request a restatement of a completed key (where the destination keeps revisions): the source changes and the key's
  next attempts race to publish revision N + 1 beside N and move its current pointer (a fault can hit that move).

Then faults stop: paused attempts wake up (and must be fenced), the clock passes every lease, and the sensor ticks and
reruns until nothing changes. The checks:

* safety, after every step: a published revision never replaced; exactly one current revision per key, published
  and whole, and the pointer never moves back; revision N + 1 supersedes N with N's sha256, and N stays published;
  one ledger revision row per published revision (a published one not yet recorded only while its restatement is
  under way); no ``completed`` record without its revision current (same sha256);
* liveness, at the end: every key ``completed`` with its restatement done (the requested partition is materialized
  once more, as an operator would), or escalated to a person (:meth:`ExportLedger.needs_attention`); one effect
  row per revision.

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
        # A restatement's attempt: after publishing, its next write moves the key's current pointer.
        self.restating = sim.restatements and str(key) in sim.ledger.open_restatements([str(key)])

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
    revisions: dict[str, int] = field(default_factory=dict)  # each key's current revision at the end


class Simulation:
    """One seeded schedule over ``destination`` and ``ledger_url``; :meth:`run` returns a :class:`Report`.

    ``fault(kind)`` arms one destination fault for the next write (the caller's own per destination; None disarms),
    and ``survey(keys)`` returns what the destination holds for those keys as ``{logical key: Seen}``. With
    ``restatements`` (a destination that keeps revisions), schedules restate keys; ``pointer_fault_kinds`` are the
    faults armed for a restatement's move of the current pointer.
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
        pointer_fault_kinds=(),
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = Clock(dt.datetime(2026, 3, 9, 9, 30, tzinfo=UTC) + dt.timedelta(days=seed))
        self.ledger = ExportLedger(ledger_url, lease_ttl=TTL, clock=self.clock)
        self.destination = destination
        self.fault, self.survey, self.fault_kinds = fault, survey, fault_kinds
        self.restatements, self.pointer_fault_kinds = restatements, tuple(pointer_fault_kinds)
        self.current_seen: dict[str, int] = {}  # the highest current revision seen per key: it never moves back
        self.back = threading.Event()
        self.attempts: list[Attempt] = []
        self.versions: dict[str, int] = {}
        self.first_export: dict[tuple[str, int], str] = {}  # (key, revision) -> the sha256 first seen there
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

    @property
    def _writing(self) -> tuple[str, ...]:
        """The points after which an attempt's next step may change the destination."""
        return ("after_stage", "after_claim", "after_publish") if self.restatements else ("after_stage", "after_claim")

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
            publishing = attempt.point in self._writing
            self._step(attempt, fate)
            self._check(published=publishing)

    # -- the checks --------------------------------------------------------------------------------------------

    def _check(self, *, published: bool = True) -> None:
        """Safety now. The destination is read when a step may have published or moved a pointer (``published``) or
        a key says it is completed; otherwise nothing there can have changed since the last look."""
        records = {str(key): self.ledger.get(str(key)) for key in self.keys}
        completed = any(r is not None and r.state is ExportState.COMPLETED for r in records.values())
        if not (published or completed):
            return
        seen = self.survey(self.keys)
        requests = self.ledger.open_restatements(list(records)) if self.restatements else {}
        for key in self.keys:
            name = str(key)
            found = seen.get(name)
            record = records[name]
            if found is None:
                if record is not None and record.state is ExportState.COMPLETED:
                    self._violation(f"{name}: completed in the ledger without its export at the destination")
                continue
            for revision, sha in found.revisions.items():
                first = self.first_export.setdefault((name, revision), sha)
                if sha != first:
                    self._violation(f"{name}: revision {revision} was replaced ({first[:12]} -> {sha[:12]})")
                if sha.startswith("torn:"):
                    self._violation(f"{name}: revision {revision} does not match its manifest")
                elif sha.startswith("misplaced:"):
                    self._violation(f"{name}: revision {revision}'s place holds another revision's or key's manifest")
            for (key_name, revision), _ in self.first_export.items():
                if key_name == name and revision not in found.revisions:
                    self._violation(f"{name}: revision {revision} was published and is gone")
            current = found.current
            if current not in found.revisions:
                self._violation(f"{name}: the current pointer names revision {current}, which is not published")
            if current < self.current_seen.get(name, 1):
                self._violation(f"{name}: the current pointer moved back to {current}")
            self.current_seen[name] = max(current, self.current_seen.get(name, 1))
            for revision, supersedes in found.supersedes.items():
                if revision >= 2 and supersedes != (revision - 1, found.revisions.get(revision - 1)):
                    self._violation(f"{name}: revision {revision} supersedes {supersedes}, not revision {revision - 1}")
            is_completed = record is not None and record.state is ExportState.COMPLETED
            # Only revision 1 published, no pointer, no request: its record's sha256 is checked below; the rows are
            # read (one more query per key and step) only for a key that has been restated or is being restated.
            restated = set(found.revisions) != {1} or current != 1 or name in requests
            rows = self.ledger.revisions(name) if self.restatements and restated else []
            if rows:
                for row in rows:
                    if found.revisions.get(row.revision) != row.sha256:
                        self._violation(f"{name}: revision {row.revision} is recorded, not published with its sha256")
                    if row.revision >= 2 and (row.supersedes_revision, row.supersedes_sha256) != (
                        row.revision - 1,
                        rows[row.revision - 2].sha256,
                    ):
                        self._violation(f"{name}: recorded revision {row.revision} does not supersede its predecessor")
                pending = requests.get(name)
                waiting = {pending.revision} if pending is not None and not is_completed else set()
                stray = set(found.revisions) - {row.revision for row in rows} - waiting
                if stray:
                    self._violation(f"{name}: revisions {sorted(stray)} published but neither recorded nor under way")
            if is_completed:
                if record.sha256 != found.revisions.get(current):
                    self._violation(f"{name}: completed in the ledger without its export current at the destination")
                if rows and rows[-1].revision != current:
                    self._violation(f"{name}: completed at revision {rows[-1].revision}, current is {current}")

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
                if fate is None and attempt.point == "after_stage" and self.fault_kinds and rng.random() < 0.3:
                    kind = rng.choice(self.fault_kinds)
                    self.fault(kind)
                    self.report.steps.append(f"fault {kind} on {attempt.name}'s publish")
                elif fate is None and attempt.point == "after_publish" and attempt.restating and rng.random() < 0.3:
                    if self.pointer_fault_kinds:
                        kind = rng.choice(self.pointer_fault_kinds)
                        self.fault(kind)
                        self.report.steps.append(f"fault {kind} on {attempt.name}'s pointer move")
                self.report.steps.append(f"{attempt.name}@{attempt.point} -> {fate or 'go'}")
                publishing = attempt.point in self._writing  # the next step may publish, write or move a pointer
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
                done = [
                    k for k in self.keys if getattr(self.ledger.get(str(k)), "state", None) is ExportState.COMPLETED
                ]
                if done and self._request(rng.choice(done)):
                    self._check(published=False)
            else:
                key = rng.choice(self.keys)
                self.versions[str(key)] = self.versions.get(str(key), 0) + 1
                self.report.steps.append(f"late data for {key.tenant}")

    def _request(self, key: LogicalKey) -> bool:
        """An operator restates ``key`` (the source was corrected) if it is completed with no request open."""
        record = self.ledger.get(str(key))
        if record is None or record.state is not ExportState.COMPLETED or self.ledger.open_restatements([str(key)]):
            return False
        request = self.ledger.request_restatement(str(key), reason="corrected", requested_by="sim")
        self.versions[str(key)] = self.versions.get(str(key), 0) + 1
        self.report.steps.append(f"restate {key.tenant} to revision {request.revision}")
        return True

    def _quiesce(self) -> None:
        self.fault(None)
        for attempt in self.attempts:  # stalled workers wake up: they must be fenced, or finish cleanly
            self._finish(attempt, faults=False)
        for _ in range(DEFAULT_MAX_ATTEMPTS + 3):  # until nothing changes: each round can only move keys forward
            before = [self.ledger.get(str(k)) for k in self.keys]
            self.clock.now += TTL + dt.timedelta(seconds=1)
            self._tick(rerun=True)
            self._check()
            if self.restatements:  # a restated partition is materialized once more, as an operator would
                requests = self.ledger.open_restatements([str(k) for k in self.keys])
                for key in self.keys:
                    record = self.ledger.get(str(key))
                    if str(key) in requests and record.state is ExportState.COMPLETED:
                        self._finish(self._start(key), faults=False)
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
                self.report.revisions[str(key)] = self.ledger.current_revision(str(key)).revision
                if self.restatements and self.ledger.open_restatements([str(key)]):
                    self._violation(f"{key}: completed with its restatement still open after quiescence")
                revisions = len(self.ledger.revisions(str(key)))
                effects = [a for a in self.ledger.attempts(str(key)) if a.outcome.value in ("completed", "repaired")]
                if len(effects) != revisions:
                    self._violation(f"{key}: {len(effects)} attempt rows record an effect for {revisions} revision(s)")


@dataclass
class Seen:
    """One key at a destination as a reader finds it: ``revisions`` maps each published revision to its sha256
    (``torn:<sha256>`` when the data does not match its manifest), ``supersedes`` to what its manifest supersedes,
    and ``current`` is the revision the key's pointer names (1 without one)."""

    current: int
    revisions: dict[int, str] = field(default_factory=dict)
    supersedes: dict[int, tuple[int | None, str | None]] = field(default_factory=dict)


def survey_through(destination, keys, *, revisions: bool = False) -> dict[str, Seen]:
    """What the destination holds for ``keys``, through its own probe, read and current pointer (the path readers
    take). With ``revisions``, revision 2, 3, ... are probed until one is absent (and the one after, so a gap shows).
    """
    found: dict[str, Seen] = {}
    for key in keys:
        seen = Seen(destination.current(target_of(key)) if revisions else 1)
        revision, misses = 1, 0
        while misses < 2 and (revision == 1 or revisions):
            target = target_of(key, revision)
            manifest = destination.probe(target)
            if manifest is None:
                misses += 1
            else:
                data = destination.read_data(target, manifest)
                good = hashlib.sha256(data).hexdigest() == manifest.sha256
                seen.revisions[revision] = manifest.sha256 if good else "torn:" + manifest.sha256
                seen.supersedes[revision] = (manifest.supersedes_revision, manifest.supersedes_sha256)
                if manifest.revision != revision or manifest.logical_key != str(key):
                    seen.revisions[revision] = f"misplaced:{manifest.sha256}"
            revision += 1
            if revision == 2 and not seen.revisions:
                break  # nothing published: no revision can be
        if seen.revisions or seen.current != 1:
            found[str(key)] = seen
    return found


def target_of(key: LogicalKey, revision: int = 1) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision)
