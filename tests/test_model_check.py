"""The protocol model (tests/model, docs/model-check.md) explored exhaustively: every invariant in every reachable state
of small worlds (default tier), larger worlds and each guard removed (slow tier).

Each test prints what it explored into the test log (without ``-s`` too) and records it in the report (``record_property``).
"""

from __future__ import annotations

import pytest
from model.explore import Bounds, Exploration, Guards, explore
from model.spec import INVARIANTS

ALL_COMMANDS = ("restate", "withdraw", "discard", "accept")

#: A fresh key, two workers (one clock a tick ahead), one fault anywhere, reconciliation at any point.
FRESH = Bounds(ttl=1, faults=1)
#: A key completed at revision 1, one operator command (restate, withdraw, discard or accept) and one fault.
OPERATED = Bounds(ttl=1, start_completed=True, commands=ALL_COMMANDS, operator_commands=1, faults=1)
#: Two keys, one worker, one fault.
TWO_KEYS_SMALL = Bounds(ttl=1, keys=2, worker_offsets=(0,), faults=1)

# Slow tier: larger worlds.
THREE_WORKERS = Bounds(ttl=1, worker_offsets=(0, 1, 2), faults=0)
TWO_COMMANDS = Bounds(ttl=1, start_completed=True, commands=ALL_COMMANDS, operator_commands=2, faults=0)
TWO_KEYS = Bounds(ttl=1, keys=2, worker_offsets=(0, 1), faults=0)
LONGER_LEASES = Bounds(ttl=2, faults=1)
RERUNS = Bounds(ttl=1, attempts_per_worker=2, faults=0)
OPERATED_TWICE_WITH_FAULT = Bounds(ttl=1, start_completed=True, commands=ALL_COMMANDS, operator_commands=2, faults=1)
RESTATE_WITHDRAW_RESTATE = Bounds(
    ttl=1, start_completed=True, commands=("restate", "withdraw"), operator_commands=3, faults=0, worker_offsets=(0,)
)
NO_WINDOW_WAIT = Bounds(ttl=1, window=0, faults=0)


@pytest.fixture
def note(record_property, capsys):
    """Prints what an exploration covered into the test log, even without ``-s`` (CI's log shows the state counts),
    and records it in the report."""

    def noted(result: Exploration, name: str) -> None:
        with capsys.disabled():
            print(f"\n[model {name}] {result.summary()}")
            if result.trace:
                print("  " + "\n  ".join(result.trace))
        record_property(f"{name}_states", result.states)
        record_property(f"{name}_transitions", result.transitions)
        record_property(f"{name}_depth", result.depth)
        record_property(f"{name}_seconds", round(result.seconds, 2))
        if result.invariant:
            record_property(f"{name}_invariant", result.invariant)

    return noted


def _holds(bounds: Bounds, note, name: str) -> Exploration:
    result = explore(bounds)
    note(result, name)
    assert result.ok, f"{result.invariant} broken: " + " -> ".join(result.trace)
    assert result.bound_hits == 0, "the token bound cut the exploration short"
    return result


# -- default tier --------------------------------------------------------------------------------------------------


def test_fresh_key_two_workers_one_fault(note):
    result = _holds(FRESH, note, "fresh")
    assert result.states > 1000  # the world really branches (a broken model could explore a handful of states)


def test_operator_commands_on_a_completed_key(note):
    _holds(OPERATED, note, "operated")


def test_two_keys_one_worker(note):
    _holds(TWO_KEYS_SMALL, note, "two_keys_small")


def test_every_guard_and_invariant_is_named():
    assert len(Guards.names()) == len(set(Guards.names())) >= 10
    assert set(MUTATIONS) == set(Guards.names())
    for _, expected in MUTATIONS.values():
        assert expected is None or set(expected) <= set(INVARIANTS)


# -- slow tier: larger worlds --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, bounds",
    [
        ("three_workers", THREE_WORKERS),
        ("two_commands", TWO_COMMANDS),
        ("two_keys", TWO_KEYS),
        ("longer_leases", LONGER_LEASES),
        ("reruns", RERUNS),
    ],
)
def test_larger_worlds(name, bounds, note):
    _holds(bounds, note, name)


# -- slow tier: each guard removed -------------------------------------------------------------------------------

#: guard -> (the world(s) its removal is explored in, the invariants it may break; None: never caught, see
#: docs/model-check.md for why, and then it is explored in two worlds).
MUTATIONS: dict[str, tuple[Bounds | tuple[Bounds, ...], tuple[str, ...] | None]] = {
    "judge_time_by_ledger_clock": (NO_WINDOW_WAIT, ("no_takeover_of_a_live_lease",)),
    "refuse_claim_before_window_end": (FRESH, ("no_claim_before_window_end",)),
    "fence_before_publishing": (FRESH, ("nothing_named_is_deleted",)),
    "pointer_compare_and_swap": (FRESH, ("pointer_revision_never_decreases", "ledger_and_pointer_agree")),
    "commit_checks_fence": (FRESH, ("no_stale_token_visible",)),
    "commit_checks_superseded": ((OPERATED, TWO_COMMANDS), None),
    "sweep_only_unreferenced_places": (OPERATED, ("nothing_named_is_deleted",)),
    "sweep_only_below_own_token": (RERUNS, ("nothing_named_is_deleted",)),
    "never_reuse_revision_numbers": (RESTATE_WITHDRAW_RESTATE, ("revision_numbers_unique",)),
    "reconcile_holds_before_judging": (FRESH, ("ledger_and_pointer_agree",)),
    "reconcile_fences_before_judging": (FRESH, ("ledger_and_pointer_agree",)),
    "error_before_fence_is_remote_unknown": (FRESH, ("ledger_and_pointer_agree",)),
    "probe_error_past_s_is_remote_unknown": (FRESH, ("ledger_and_pointer_agree",)),
    "finish_guarded_by_token_and_owner": (FRESH, ("no_completion_from_a_fenced_token",)),
    "discard_deletes_only_below_its_token": (OPERATED_TWICE_WITH_FAULT, ("nothing_named_is_deleted",)),
    "withdraw_checks_pointer": ((OPERATED, TWO_COMMANDS), None),
    "claim_refuses_remote_unknown": ((FRESH, LONGER_LEASES), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("guard", sorted(MUTATIONS))
def test_guard_removed(guard, note):
    worlds, expected = MUTATIONS[guard]
    if expected is None:
        # Redundant in the model: the other guards already prevent what this one does (docs/model-check.md). The
        # test keeps that claim honest: if the model ever finds a counterexample, the table must change.
        for number, bounds in enumerate(worlds):
            result = explore(bounds, Guards().without(guard))
            note(result, f"without_{guard}_{number}")
            assert result.ok, f"{guard} is caught after all ({result.invariant}): update docs/model-check.md"
    else:
        result = explore(worlds, Guards().without(guard))
        note(result, f"without_{guard}")
        assert result.invariant in expected, f"without {guard}: {result.invariant or 'nothing'} broken"


@pytest.mark.slow
def test_a_worker_clock_ahead_claims_before_the_window_ends(note):
    """The same mutation as judge_time_by_ledger_clock, seen at the window: the worker a tick ahead claims early."""
    result = explore(FRESH, Guards().without("judge_time_by_ledger_clock"))
    note(result, "worker_clock_window")
    assert result.invariant == "no_claim_before_window_end"
