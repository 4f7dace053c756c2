"""The protocol model (tests/model, docs/model-check.md) explored exhaustively: every invariant in every reachable state
of small worlds (default tier), larger worlds and each guard removed (slow tier; the export contract's guards, whose
counterexamples are a few hundred states away, in the default tier).

Each test prints what it explored into the test log (without ``-s`` too) and records it in the report
(``record_property``).
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

# The export contract: contract 1 publishes at destination A, contract 2 at B. Worker w0's code names contract 1, w1's
# contract 2 (a deploy that moved the destination, seen by one worker before the other, or a worker left with a stale
# environment). The operator's accept-contract records the other one in force.
CONTRACT_MOVES = (0, 1)
#: A fresh key, contract 1 in force, one accept-contract, one fault.
DEPLOY = Bounds(ttl=1, faults=1, contracts=CONTRACT_MOVES, worker_codes=(1, 2), in_force=1,
                commands=("accept_contract",), operator_commands=1)  # fmt: skip
#: A key completed at A under contract 1; two operator commands of restate, withdraw and accept-contract; one fault.
DEPLOY_RESTATED = Bounds(ttl=1, faults=1, start_completed=True, contracts=CONTRACT_MOVES, worker_codes=(1, 2),
                         commands=("restate", "withdraw", "accept_contract"), operator_commands=2)  # fmt: skip
#: A fresh key and no contract recorded yet: whichever worker claims first records its own.
FIRST_CONTRACT = Bounds(ttl=1, faults=1, contracts=CONTRACT_MOVES, worker_codes=(1, 2))

# Slow tier: larger contract worlds.
DEPLOY_TWICE = Bounds(ttl=1, faults=1, contracts=CONTRACT_MOVES, worker_codes=(1, 2), in_force=1,
                      commands=("accept_contract",), operator_commands=2)  # fmt: skip
DEPLOY_AND_BACK = Bounds(ttl=1, faults=0, contracts=(0, 1, 0), worker_codes=(1, 2), in_force=1,
                         commands=("accept_contract",), operator_commands=2)  # fmt: skip
DEPLOY_OPERATED = Bounds(ttl=1, faults=1, start_completed=True, contracts=CONTRACT_MOVES, worker_codes=(1, 2),
                         commands=ALL_COMMANDS + ("accept_contract",), operator_commands=2)  # fmt: skip
DEPLOY_TWO_KEYS = Bounds(ttl=1, keys=2, faults=0, contracts=CONTRACT_MOVES, worker_codes=(1, 2), in_force=1,
                         commands=("accept_contract",), operator_commands=1)  # fmt: skip
FORMAT_CHANGE = Bounds(ttl=1, faults=1, contracts=(0, 0), worker_codes=(1, 2), in_force=1,
                       commands=("accept_contract",), operator_commands=1)  # fmt: skip


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


@pytest.mark.parametrize(
    "name, bounds",
    [("deploy", DEPLOY), ("deploy_restated", DEPLOY_RESTATED), ("first_contract", FIRST_CONTRACT)],
)
def test_export_contract_worlds(name, bounds, note):
    """Two destinations, workers whose code names different contracts, the operator's accept-contract: every
    invariant holds, the contract's three among them."""
    result = _holds(bounds, note, name)
    assert result.states > 1000  # the worlds really branch


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
        ("deploy_twice", DEPLOY_TWICE),
        ("deploy_and_back", DEPLOY_AND_BACK),
        ("deploy_operated", DEPLOY_OPERATED),
        ("deploy_two_keys", DEPLOY_TWO_KEYS),
        ("format_change", FORMAT_CHANGE),
    ],
)
def test_larger_worlds(name, bounds, note):
    _holds(bounds, note, name)


# -- each guard removed (slow tier, but for the contract's, found within a few hundred states) ----------------------

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
    "claim_checks_contract": (DEPLOY, ("claim_under_the_contract_in_force",)),
    "claim_refuses_moved_key": (DEPLOY, ("ledger_and_pointer_agree", "one_destination_per_key")),
    "accept_checks_settled_keys": ((DEPLOY, DEPLOY_RESTATED, DEPLOY_OPERATED), None),
}
#: Guards whose removal is explored in the default tier (each world explored in well under a second).
FAST_MUTATIONS = {"claim_checks_contract", "claim_refuses_moved_key"}


@pytest.mark.parametrize(
    "guard", [pytest.param(g, marks=[] if g in FAST_MUTATIONS else [pytest.mark.slow]) for g in sorted(MUTATIONS)]
)
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


#: The invariants that state a contract guard's own rule, set aside to see what its removal does to the exports.
_CONTRACT_RULES = frozenset(
    {"claim_under_the_contract_in_force", "ledger_and_pointer_agree", "completed_at_its_contracts_destination",
     "no_stale_token_visible"}
)  # fmt: skip


@pytest.mark.parametrize("guard", ["claim_checks_contract", "claim_refuses_moved_key"])
def test_contract_guard_removed_exports_a_key_at_two_destinations(guard, note):
    """Past the invariants that state the guard's rule (a claim under the contract in force; the ledger and the pointer
    agree at the key's contract's destination; a stale token), its removal ends with one key's export visible at A
    and at B: two exports of one key."""
    result = explore(DEPLOY, Guards().without(guard), ignore=_CONTRACT_RULES)
    note(result, f"without_{guard}_consequence")
    assert result.invariant == "one_destination_per_key", f"without {guard}: {result.invariant or 'nothing'} broken"


@pytest.mark.slow
def test_a_worker_clock_ahead_claims_before_the_window_ends(note):
    """The same mutation as judge_time_by_ledger_clock, seen at the window: the worker a tick ahead claims early."""
    result = explore(FRESH, Guards().without("judge_time_by_ledger_clock"))
    note(result, "worker_clock_window")
    assert result.invariant == "no_claim_before_window_end"
