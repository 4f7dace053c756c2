"""The fault schedule: drawn from a seed before anything runs (so it can be printed and replayed), then executed.

Three kinds of fault, each aimed at one worker:

* ``cut``: the worker's link goes down (host side), then up again after ``duration`` seconds. Its ledger and S3
  connections stall; new connects time out.
* ``pause``: SIGSTOP to the worker's process group, SIGCONT after ``duration`` seconds, which is longer than a lease.
* ``stall``: a short SIGSTOP (under a lease) the moment the worker's data object is in the bucket and its manifest
  is not: the attempt "uploads its data and pauses", the opening of issue #18's item 4.

Each fault waits (up to ``HOLD_WAIT_SECONDS``) for its moment: a ``cut`` or ``pause`` until its worker holds a key
(an ``in_progress`` key whose lease owner is that worker), a ``stall`` until the bucket shows that worker's staged
data; the log says whether it found it. A worker never has two faults at once. The schedule is a plan: the times
actually applied are in the executor's log.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HOLD_WAIT_SECONDS = 4.0
#: How often the moment is looked for: a stall's window (one request's latency) is about a tenth of a second.
POLL_SECONDS = 0.02


@dataclass(frozen=True)
class Fault:
    kind: str  # "cut" | "pause"
    worker: int  # 1-based
    at: float  # seconds after the fault phase starts
    duration: float

    def describe(self) -> str:
        verb = {"cut": "cut the link of", "pause": "pause (SIGSTOP)", "stall": "stall (SIGSTOP) after its upload"}[
            self.kind
        ]
        return f"t+{self.at:5.1f}s {verb} w{self.worker} for {self.duration:.1f}s"


def draw_schedule(
    seed: int,
    *,
    workers: int,
    phase_seconds: float,
    lease_seconds: float,
    cuts: int = 5,
    pauses: int = 3,
    stalls: int = 4,
) -> list[Fault]:
    """``cuts`` link cuts of 2 to 7 s, ``pauses`` of a lease plus 1 to 4 s and ``stalls`` of 0.5 to 2.5 s, at random
    times and workers, no two on one worker at once (drawn again until they fit), all over before the phase ends."""
    rng = random.Random(seed)
    kinds = ["cut"] * cuts + ["pause"] * pauses + ["stall"] * stalls
    rng.shuffle(kinds)
    durations = {
        "cut": lambda: rng.uniform(2.0, 7.0),
        "pause": lambda: lease_seconds + rng.uniform(1.0, 4.0),
        "stall": lambda: rng.uniform(0.5, 2.5),
    }
    chosen: list[Fault] = []
    for kind in kinds:
        for _ in range(500):
            duration = durations[kind]()
            at = rng.uniform(2.0, phase_seconds - duration - HOLD_WAIT_SECONDS - 1.0)
            worker = rng.randint(1, workers)
            candidate = Fault(kind, worker, round(at, 2), round(duration, 2))
            # Margins for the wait until the worker holds a key, and a second between two faults on one worker.
            clash = any(
                f.worker == worker
                and candidate.at < f.at + f.duration + HOLD_WAIT_SECONDS + 1.0
                and f.at < candidate.at + candidate.duration + HOLD_WAIT_SECONDS + 1.0
                for f in chosen
            )
            if not clash:
                chosen.append(candidate)
                break
    return sorted(chosen, key=lambda f: f.at)


@dataclass
class FaultRunner:
    """Applies a schedule: ``apply(fault)`` at its time (after waiting until ``moment(fault)`` names a key, or
    ``HOLD_WAIT_SECONDS``), ``undo(fault)`` ``duration`` seconds later. ``log`` gets one line per action."""

    schedule: list[Fault]
    apply: Callable[[Fault], None]
    undo: Callable[[Fault], None]
    moment: Callable[[Fault], str | None]
    log: Callable[[str], None]
    applied: list[dict] = field(default_factory=list)
    _ends: list[tuple[float, int, Fault]] = field(default_factory=list)
    _active: list[Fault] = field(default_factory=list)
    _start: float = 0.0

    def run(self, start: float) -> None:
        """Runs the whole schedule (from ``start``, a ``time.monotonic()``), then undoes whatever is still active."""
        self._start = start
        try:
            for fault in self.schedule:
                self._finish_due(until=start + fault.at)
                held = None
                give_up = time.monotonic() + HOLD_WAIT_SECONDS
                while True:
                    self._finish_due(until=time.monotonic())
                    try:
                        held = self.moment(fault)
                    except Exception as exc:  # a ledger read that failed is no reason to skip the fault
                        self.log(f"  (could not read who holds keys: {type(exc).__name__})")
                        held = None
                    if held is not None or time.monotonic() >= give_up:
                        break
                    time.sleep(POLL_SECONDS)
                at = time.monotonic() - start
                self.apply(fault)
                self._active.append(fault)
                heapq.heappush(self._ends, (time.monotonic() + fault.duration, id(fault), fault))
                self.applied.append({"fault": fault, "applied_at": round(at, 2), "holding": held})
                if fault.kind == "stall":
                    where = f"after its upload of {held}" if held else "(no upload seen: not aimed)"
                else:
                    where = f"while it held {held}" if held else "(it held no key)"
                self.log(f"t+{at:5.1f}s {fault.kind} w{fault.worker} for {fault.duration:.1f}s {where}")
            while self._ends:
                self._finish_due(until=self._ends[0][0])
        finally:
            self.undo_all()

    def _finish_due(self, until: float) -> None:
        """Sleeps until ``until``, undoing each fault whose end comes first, at its end."""
        while True:
            now = time.monotonic()
            if self._ends and self._ends[0][0] <= min(until, now):
                _, _, fault = heapq.heappop(self._ends)
                self._undo(fault)
                continue
            if now >= until:
                return
            wake = until if not self._ends else min(until, self._ends[0][0])
            time.sleep(max(0.0, min(wake - now, 0.2)))

    def _undo(self, fault: Fault) -> None:
        if fault in self._active:
            self._active.remove(fault)
            self.undo(fault)
            self.log(f"t+{time.monotonic() - self._start:5.1f}s end of {fault.kind} w{fault.worker}")

    def undo_all(self) -> None:
        """Undoes every fault still active (links up, workers continued), whatever happened."""
        self._ends.clear()
        for fault in list(self._active):
            self._undo(fault)
