"""How far the long random searches go: CI's depth, or the full depth of a run before a release.

Each search (the crash harness's random kills, the deterministic simulation's schedules, the stateful test at length)
has two sizes. CI's (the default) keeps ``bash .ci/run`` under 15 minutes on 2 cores; ``EXPORTS_TEST_DEPTH=full``
runs the full ones, several times longer. The deterministic parts never shrink: every named failpoint, every guard
removal of the model check, every seed a failure printed. A search's own variable (``EXPORTS_CRASH_TRIALS``, ...)
still sets its size, whatever the depth.
"""

from __future__ import annotations

import os

DEPTH_VARIABLE = "EXPORTS_TEST_DEPTH"
DEPTHS = ("ci", "full")


def depth() -> str:
    """``ci`` (unset) or ``full``; anything else is an error naming the variable and the values it takes."""
    value = os.environ.get(DEPTH_VARIABLE, "").strip().lower() or "ci"
    if value not in DEPTHS:
        raise ValueError(f"{DEPTH_VARIABLE}={value!r}: use one of {', '.join(DEPTHS)} (unset: ci)")
    return value


def sized(variable: str, *, ci: int, full: int, fallback: str | None = None) -> int:
    """A search's size: ``variable`` when set (else ``fallback``'s, when given and set), else the size for the depth.

    Raises:
        ValueError: the variable holds something other than a positive whole number, named with its value.
    """
    for name in (variable, fallback):
        text = os.environ.get(name) if name else None
        if text:
            if not text.strip().isdigit() or int(text) < 1:
                raise ValueError(f"{name}={text!r}: a positive whole number")
            return int(text)
    return full if depth() == "full" else ci
