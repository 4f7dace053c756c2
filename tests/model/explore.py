"""Breadth-first, exhaustive exploration of :mod:`model.spec`: every reachable state within the bounds, once each.

States are immutable tuples, so a dict from state to its number is the visited set. Breadth-first order makes the
first counterexample a shortest one. Safety is checked on every state and every move; liveness afterwards, by
reverse reachability over the fault-free moves (``STEP``: parties doing their jobs and the clock ticking; no crash,
error or operator command): every reachable state must reach a settled one.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass, field

from model.spec import COMMAND, FAULT, STEP, Bounds, Guards, Protocol, State, check_state, initial_state, settled

__all__ = ["Bounds", "Exploration", "Guards", "explore", "COMMAND", "FAULT", "STEP"]


@dataclass
class Exploration:
    """What one exploration found."""

    states: int
    transitions: int
    depth: int
    seconds: float
    bound_hits: int = 0
    invariant: str | None = None  # the invariant broken, by name (see model.spec.INVARIANTS)
    trace: list[str] = field(default_factory=list)  # the steps from the initial state to the counterexample

    @property
    def ok(self) -> bool:
        return self.invariant is None

    def summary(self) -> str:
        line = f"model: {self.states} states, {self.transitions} transitions, depth {self.depth}, {self.seconds:.2f}s"
        if self.bound_hits:
            line += f", {self.bound_hits} moves past the token bound"
        if not self.ok:
            line += f"; {self.invariant} broken after {len(self.trace)} steps"
        return line


def explore(
    bounds: Bounds,
    guards: Guards | None = None,
    *,
    liveness: bool = True,
    max_states: int = 2_000_000,
    ignore: frozenset[str] = frozenset(),
) -> Exploration:
    """Explores every state reachable within ``bounds`` under ``guards``; stops at the first broken invariant.
    ``ignore``: invariants (by name) not checked, to see what a mutation breaks beyond the invariant that states its
    guard."""
    protocol = Protocol(bounds, guards or Guards())
    contracts = bounds.contracts

    def check(state: State) -> str | None:
        return check_state(state, contracts, ignore)

    canonical = protocol.canonical
    started = time.perf_counter()
    first = initial_state(bounds)
    index: dict[State, int] = {first: 0}
    states: list[State] = [first]
    parent = array("i", [-1])
    depth = array("i", [0])
    sources, targets = array("i"), array("i")  # fault-free moves, for liveness
    transitions = 0
    queue = deque([0])

    def found(invariant: str, at: int, last=None) -> Exploration:
        trace, here = _trace(protocol, states, parent, at)
        if last is not None:  # the breaking move, named as the replayed (not renamed) state names its workers
            target = canonical(last.state)
            trace.append(
                next(
                    m.label
                    for m in protocol.successors(here)
                    if m.violation == last.violation and canonical(m.state) == target
                )
            )
        return Exploration(
            len(states), transitions, max(depth), time.perf_counter() - started, protocol.bound_hits, invariant, trace
        )

    broken = check(first)
    if broken:
        return found(broken, 0)
    while queue:
        here = queue.popleft()
        for move in protocol.successors(states[here]):
            transitions += 1
            if move.violation and move.violation not in ignore:
                return found(move.violation, here, move)
            state = canonical(move.state)
            there = index.get(state)
            if there is None:
                there = len(states)
                if there >= max_states:
                    raise RuntimeError(f"more than {max_states} states: the bounds are too large")
                index[state] = there
                states.append(state)
                parent.append(here)
                depth.append(depth[here] + 1)
                broken = check(state)
                if broken:
                    return found(broken, there)
                queue.append(there)
            if move.kind == STEP:
                sources.append(here)
                targets.append(there)
    if liveness:
        stuck = _unsettled(states, sources, targets)
        if stuck is not None:
            result = found("liveness", stuck)
            result.trace.append("... and from here no fault-free path settles every key")
            return result
    return Exploration(len(states), transitions, max(depth), time.perf_counter() - started, protocol.bound_hits)


def _unsettled(states: list[State], sources: array, targets: array) -> int | None:
    """The shallowest state from which no fault-free path reaches a settled state, or None."""
    n = len(states)
    # Reverse adjacency in compressed rows: for each state, the states with a fault-free move into it.
    counts = array("i", bytes(4 * (n + 1)))
    for t in targets:
        counts[t + 1] += 1
    for i in range(n):
        counts[i + 1] += counts[i]
    start = array("i", counts)
    into = array("i", bytes(4 * len(sources)))
    for s, t in zip(sources, targets, strict=True):
        into[start[t]] = s
        start[t] += 1
    good = bytearray(n)
    queue = deque(i for i in range(n) if settled(states[i]))
    for i in queue:
        good[i] = 1
    while queue:
        t = queue.popleft()
        for j in range(counts[t], counts[t + 1]):
            s = into[j]
            if not good[s]:
                good[s] = 1
                queue.append(s)
    for i in range(n):  # states are numbered in breadth-first order: the first is a shallowest
        if not good[i]:
            return i
    return None


def _trace(protocol: Protocol, states: list[State], parent: array, at: int) -> tuple[list[str], State]:
    """The labels of the moves from the initial state to state number ``at``, found again by replaying from the
    initial state without renaming workers (so that a worker keeps its name along the trace)."""
    path = []
    while at > 0:
        path.append(at)
        at = parent[at]
    labels, here = [], states[0]
    for number in reversed(path):
        target = states[number]
        move = next(m for m in protocol.successors(here) if protocol.canonical(m.state) == target)
        labels.append(move.label)
        here = move.state
    return labels, here
