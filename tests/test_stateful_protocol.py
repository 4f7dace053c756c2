"""The real ledger and the real destinations driven step by step by a Hypothesis state machine (docs/protocol.md).

What the machine models (tests/stateful/): one or two logical keys (one whose window ended long ago, one whose
window ends 20 minutes after the ledger's clock starts; the early one may have been exported before the example
starts), on SQLite or PostgreSQL, publishing to destination A (a local folder, or S3 on moto's server) or B (another
local folder):

* export attempts, each advanced one protocol step per rule (claim, fence, probe, read, sweep, stage, commit,
  record) with the library's own step functions, paused for any number of rules (``run_until`` stops one before
  any step), or crashed for good; a takeover at the very instant a lease ends (``take_over``);
* reconcilers advanced the same way (find stuck, hold, fence and judge, finish), and whole reconciliation passes;
* operators' commands, whole: restatement requests (and the run they launch), ``restate --withdraw``,
  ``resolve --accept-destination`` and ``--discard-destination``, each at the destination the library places the
  key (its contract's);
* the export contract: deploys that change the destination (A <-> B), the file format, the column order, the
  source or the version; attempts that run the code deployed last or (a stale environment) an earlier one, each
  claiming with the contract its code declares and publishing at its code's destination; the operator's
  ``accept-contract --keep-exported`` (``accept_refused``, or ``accept`` of the new code's contract ahead of its
  claims);
* the ledger's clock (``ExportLedger(clock=...)``) moved by any amount or exactly to a lease's expiry; a clock
  offset per party that the library never sees (the parties only count what they believe with it);
* faults at the pointer's compare-and-swap (fence, commit, discard): the write lands and its answer is lost, it is
  lost, or the store refuses it.

After every rule the invariants are checked by reading what a reader sees, with a reader of the test's own (it
follows ``_current.json`` to the manifest and the data, and hashes the data itself) and the ledger's rows read
apart from the library's queries:

* 1 one export per revision; 2 exactly one current revision, intact; 3 and 6 the ledger and the pointer agree
  (``failed``: the pointer names the recorded revision, or nothing); 4 revision numbers unique, the pointer's revision
  never decreasing but for an operator's discard back to the recorded one; 5 no effect of a stale token (the fence
  never goes down, no commit below it succeeds); 7 nothing a pointer or a recorded revision names is deleted; 8 no
  key claimed before its window ends, by the ledger's clock;
* L the claim and hold guards against an independent model of docs/protocol.md step 1 on the ledger's clock (a
  live lease is never taken over, an ended one always can be, whatever the claimant's own clock says); K the
  contract at claim against an independent model of it (refused unless it is the tenant's contract in force; a key
  last claimed under a contract no longer in force that publishes elsewhere is never taken over, restated or retried
  at the new destination), a claim leaves the key naming its own contract, and a claim the contract refuses changes
  no row; D one export per key (never visible at A and at B) and each key where its contract says (a completed
  key's location is at its contract's destination, verified there by 3; nothing visible at the other); 1 to 7 are
  checked at the destination the key's contract records; T tokens
  never reused, and a party's finishing transition recorded exactly when it still holds the key (fencing in the
  ledger, whatever its lease's expiry or its own clock say); C (stricter than the spec) no key ends in conflict,
  since every writer here follows the protocol;
* 9 liveness, at teardown: faults stop, time passes beyond every lease, the parties still alive wake up and run to
  their end, reconciliation and fresh attempts run until nothing changes; every key ends completed or escalated.

Then each guard of docs/protocol.md the machine exercises, and the export contract's two claim refusals
(``ContractChanged``, ``DestinationMoved``), is removed by a monkeypatch (tests/stateful/mutations.py) in a test of its
own, which expects the machine to find a violation, named by the invariant that catches it. (accept-contract's check
that every key is settled before the destination moves is not caught: ``DestinationMoved`` covers every key that names
its contract; docs/model-check.md.)
"""

from __future__ import annotations

import os
import time

import pytest
from depth import sized
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from stateful import world
from stateful.machine import STATS, ProtocolViolation, machine_for
from stateful.mutations import MUTATIONS

STEPS = 50
PROTOCOL_STEPS = {"claim", "fence", "probe", "read", "sweep", "stage", "commit", "record", "find", "hold", "examine",
                  "finish"}  # fmt: skip


def explore(
    backend: str,
    destination: str,
    *,
    examples: int,
    derandomize: bool = True,
    shrink: bool = True,
    contracts: bool = True,
) -> None:
    """Runs the machine (with the export contract's rules unless ``contracts`` is False)."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    run_state_machine_as_test(
        machine_for(backend, destination, contracts=contracts),
        settings=settings(
            max_examples=examples,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,  # nothing written to the checkout
            derandomize=derandomize,
            print_blob=not derandomize,  # a random run's failure prints how to reproduce it
            phases=phases,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        ),
    )


@pytest.fixture
def s3_endpoint(s3_server):
    world.S3_ENDPOINT["url"] = s3_server
    yield s3_server
    world.S3_ENDPOINT.pop("url", None)


# -- the default tier: a few examples per backend ------------------------------------------------------------------


def test_protocol_holds_on_sqlite_and_a_local_folder():
    explore("sqlite", "local", examples=12)


@pytest.mark.postgres
def test_protocol_holds_on_postgresql_and_a_local_folder(postgres_admin_url):
    explore("postgres", "local", examples=4)


def test_protocol_holds_on_sqlite_and_s3(s3_endpoint):
    explore("sqlite", "s3", examples=3)


# -- the slow tier: many more examples, and what they explored -------------------------------------------------------


@pytest.mark.slow
def test_protocol_holds_explored_at_length(capsys, s3_endpoint):
    """Random (not derandomized): every run looks at other interleavings; a failure prints its reproduction. CI's
    depth runs 30, 3 and 8 examples; ``EXPORTS_TEST_DEPTH=full`` 200, 20 and 50 (tests/depth.py)."""
    budget = [
        ("sqlite", "local", sized("EXPORTS_STATEFUL_EXAMPLES", ci=30, full=200)),
        ("sqlite", "s3", sized("EXPORTS_STATEFUL_EXAMPLES_S3", ci=3, full=20)),
    ]
    lines = []
    unavailable = world.postgres_unavailable()
    if unavailable is None:
        budget.append(("postgres", "local", sized("EXPORTS_STATEFUL_EXAMPLES_POSTGRES", ci=8, full=50)))
    elif os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {unavailable}")
    else:
        lines.append(f"  postgres + local: skipped ({unavailable})")
    for backend, destination, examples in budget:
        STATS.clear()
        started, cpu = time.monotonic(), time.process_time()
        explore(backend, destination, examples=examples, derandomize=False)
        lines.append(_summary(f"{backend} + {destination}", time.monotonic() - started, time.process_time() - cpu))
    with capsys.disabled():
        print("\nstateful protocol test explored:\n" + "\n".join(lines))


def _summary(what: str, seconds: float, cpu: float) -> str:
    protocol = sum(v for k, v in STATS.items() if len(k.split()) == 2 and k.split()[1] in PROTOCOL_STEPS)
    rules = ", ".join(f"{k[5:]} {v}" for k, v in sorted(STATS.items()) if k.startswith("rule "))
    details = ", ".join(f"{k} {v}" for k, v in sorted(STATS.items()) if not k.startswith("rule "))
    return (f"  {what}: {STATS['examples']} examples, {STATS['steps']} rules, {protocol} protocol steps by parties, "
            f"{seconds:.0f} s ({cpu:.0f} s CPU)\n    rules: {rules}\n    {details}")  # fmt: skip


# -- the export contract, one path by hand --------------------------------------------------------------------------


def _takeover_after_a_move(machine) -> str:
    """The machine's own rules, in the order that carries a key to a new destination: a worker on the first code
    claims the key at A; a deploy moves the destination to B; the operator accepts it (keep) while the key is still in
    progress at A; the worker's lease runs out and a worker on the new code comes for the key. Returns how that
    newcomer's claim ended. (A restatement of a key kept at A is refused when it is requested.)"""
    machine.setup(keys=1, history=False)
    machine.start_attempt(which=0, offset=0, source_fails=False, stale=0)
    machine.deploy(what="destination")
    machine.accept_contract(which=0, ahead=True)
    machine.check()
    machine.take_over(index=0, late=1, who="attempt", offset=0, stale=0)
    machine.check()
    return machine.parties[-1].outcome


def test_a_takeover_after_a_destination_move_is_refused_until_the_key_is_settled_at_its_destination():
    """The key is in progress at A, where its contract says; the new code publishes at B: its takeover is refused
    (DestinationMoved), nothing of it is visible at B, and at teardown the key is settled (reconciliation at A)."""
    machine = machine_for("sqlite", "local")()
    try:
        ended = _takeover_after_a_move(machine)
        assert ended == "claim refused: DestinationMoved", f"the takeover's claim at B should be refused: {ended}"
        rows = machine.world.rows.key(machine.keys[0])
        assert rows.state == "in_progress", f"{machine.keys[0]} should be left to be settled at A: {rows.state}"
        assert machine.world.view(machine.keys[0], 1).place is None, "nothing of it should be visible at B"
    finally:
        machine.teardown()  # liveness: the key must end completed or escalated (invariant 9 raises otherwise)


def test_without_the_moved_refusal_the_same_path_is_caught(monkeypatch):
    """The same rules with ``DestinationMoved`` removed: the takeover's claim goes through and the machine says which
    invariant that breaks."""
    MUTATIONS["moved_refusal"](monkeypatch)
    machine = machine_for("sqlite", "local")()
    machine.liveness = False
    try:
        with pytest.raises(ProtocolViolation, match=r"^invariant K .*allows only DestinationMoved"):
            _takeover_after_a_move(machine)
    finally:
        machine.teardown()


# -- each guard, removed, is caught --------------------------------------------------------------------------------

#: Mutation (tests/stateful/mutations.py) -> (the invariants expected to catch it, examples allowed, slow tier).
#: Derandomized: each is found at the same example on every run, well inside its budget (the slow ones after a few
#: dozen to a few hundred examples, 5 to 80 s on a loaded machine; the others within the first few). The protocol's
#: guards are explored by the machine without the export contract's rules (one code: every step goes to the
#: protocol's own interleavings); the contract's guards, with them.
CAUGHT_BY = {
    "commit_fence_check": (r"invariant 5 ", 400, True),
    "fence_write": (r"invariant (2|6|7) ", 400, True),
    "reconciler_fence": (r"invariant 6 ", 400, True),
    "reconciler_judge": (r"invariant 6 ", 400, True),
    "sweep_token_bound": (r"invariant (2|7) ", 800, True),
    "sweep_revision_bound": (r"invariant (2|7) ", 300, False),
    "lease_expiry": (r"invariant L ", 200, False),
    "lease_end": (r"invariant (L|9) ", 200, False),
    "ledger_token_guard": (r"invariant (3|6|C|T) ", 400, True),
    "takeover_failure_before_fence": (r"invariant (3|6) ", 1000, True),
    "discard_restore": (r"invariant (3|4|6) ", 600, True),
    "request_revision_numbering": (r"invariant 4 ", 300, False),
    "window_end": (r"invariant 8 ", 200, False),
    "contract_refusal": (r"invariant (K|D|3|6) ", 100, False),
    "moved_refusal": (r"invariant (K|D|3|C) ", 400, True),
}
#: The export contract's guards: explored by the machine with the contract's rules. ``moved_refusal`` needs a key in
#: progress at A, a new destination accepted, then a takeover on the new code (found after many examples): the default
#: tier shows it on that path by hand (test_without_the_moved_refusal_the_same_path_is_caught).
CONTRACT_MUTATIONS = {"contract_refusal", "moved_refusal"}


#: Found by the random search only after about 100 s here, so CI leaves each to a deterministic test that finds the
#: same removal; ``EXPORTS_STATEFUL_ALL_MUTATIONS=1`` runs them too.
LONG_MUTATIONS = {
    "takeover_failure_before_fence": "about 100 s; the model check finds the same removal "
    "(error_before_fence_is_remote_unknown) in 9 steps",
    # Derandomized, it was found after ~140 examples on one machine and not within 400 (95 s) on CI's: the example
    # sequence follows the machine's code, so any change to it moves the find.
    "moved_refusal": "not found within its budget on every machine; the default tier removes it on the path that "
    "reaches it (test_without_the_moved_refusal_the_same_path_is_caught)",
}
ALL_MUTATIONS = os.environ.get("EXPORTS_STATEFUL_ALL_MUTATIONS") == "1"


@pytest.mark.parametrize(
    "mutation",
    [pytest.param(name, marks=[pytest.mark.slow] if slow else []) for name, (_, _, slow) in sorted(CAUGHT_BY.items())],
)
def test_removing_a_guard_is_caught(mutation, monkeypatch):
    """The guard ``mutation`` names removed: the machine finds a violation of one of the invariants expected."""
    if mutation in LONG_MUTATIONS and not ALL_MUTATIONS:
        pytest.skip(f"{LONG_MUTATIONS[mutation]}; EXPORTS_STATEFUL_ALL_MUTATIONS=1 runs it")
    expected, budget, _ = CAUGHT_BY[mutation]
    MUTATIONS[mutation](monkeypatch)
    with pytest.raises(ProtocolViolation, match=f"^{expected}"):
        explore("sqlite", "local", examples=budget, shrink=False, contracts=mutation in CONTRACT_MUTATIONS)
