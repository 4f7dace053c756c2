"""Named points of the write protocol where a test can make an attempt fail or die.

Activated by the environment variable ``EXPORTS_FAILPOINTS`` (read at each point, never at import), a
comma-separated list of ``point=action`` with action ``raise`` (an ordinary exception), ``crash`` (a
:class:`SimulatedCrash`, which ordinary handlers do not catch, so the attempt stops like a dead process), ``kill``
(SIGKILL to this process) or ``pause:SECONDS`` (sleep there, to widen a race). Unset in production; the points cost
one environment lookup.
"""

from __future__ import annotations

import os
import signal
import time

from export_ledger.errors import ExportLedgerError

ENV_VAR = "EXPORTS_FAILPOINTS"
#: In the order an attempt meets them: claimed; staged at its place (invisible); committed (the pointer names it:
#: visible); before and after the group's sync that makes its publishes durable (once per group of keys, between the
#: last publish and the completion commit; a single key is a group of one, whose writes were durable as they were
#: made); before and after the ledger records it.
POINTS = (
    "after_claim", "after_stage", "after_publish", "before_group_sync", "after_group_sync", "before_commit",
    "after_commit",
)  # fmt: skip
ACTIONS = ("raise", "crash", "kill", "pause:SECONDS")


class InjectedFailure(ExportLedgerError, RuntimeError):
    """An ordinary failure injected at a named point."""


class SimulatedCrash(BaseException):
    """Stands for a process dying at a named point: nothing after it runs, no handler records anything."""


def active() -> dict[str, str]:
    spec = os.environ.get(ENV_VAR, "").strip()
    if not spec:
        return {}
    actions: dict[str, str] = {}
    for item in spec.split(","):
        point, _, action = item.strip().partition("=")
        if point not in POINTS or not _valid_action(action):
            raise ValueError(
                f"{ENV_VAR} entry {item.strip()!r} is not point=action with point in {POINTS} and action in {ACTIONS}"
            )
        actions[point] = action
    return actions


def _valid_action(action: str) -> bool:
    if action in ("raise", "crash", "kill"):
        return True
    kind, _, seconds = action.partition(":")
    try:
        return kind == "pause" and float(seconds) >= 0
    except ValueError:
        return False


_hook = None  # a test's in-process stepper (the deterministic simulation); None in production


def set_hook(hook) -> None:
    """Installs ``hook(point)``, called at every named point before the environment's actions (tests only: the
    deterministic simulation pauses, crashes or fails attempts there). ``None`` removes it."""
    global _hook
    _hook = hook


def reach(point: str) -> None:
    """Marks that the protocol reached ``point``; fails there if a test asked for it."""
    if point not in POINTS:
        raise ValueError(f"unknown failpoint {point!r}")
    if _hook is not None:
        _hook(point)
    action = active().get(point)
    if action is None:
        return
    if action.startswith("pause:"):
        time.sleep(float(action.removeprefix("pause:")))
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "crash":
        raise SimulatedCrash(f"simulated crash at {point}")
    raise InjectedFailure(f"injected failure at {point}")
