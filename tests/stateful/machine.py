"""The state machine: parties interleaved step by step over one or two keys, the ledger's clock moved by any amount
at any step, faults at the pointer's compare-and-swap, reconciliation, restatements, withdrawals and resolutions,
deploys that change the export's contract (destination A or B, file format, column order, source, version) and the
operator's accept-contract; docs/protocol.md's invariants and the export contract's checked after every rule by
reading what a reader of each destination sees; liveness at teardown.

:func:`machine_for` builds the machine class for a ledger backend and a destination kind, with or without the export
contract's rules (deploys, accept-contract, a key exported before the example, restatements that launch their run;
without them every attempt runs the one code, and the protocol's own interleavings get every step). A violation raises
:class:`ProtocolViolation`, whose message starts with the invariant's number and name.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from export_ledger import resolve as resolving
from export_ledger import restate
from export_ledger.keys import LogicalKey
from export_ledger.ledger import AlreadyCompleted, Claim, ContractChanged, DestinationMoved, ExportState, LedgerError
from export_ledger.reconcile import reconcile_batch
from stateful.parties import (
    COMMIT,
    EXAMINE,
    FENCE,
    FINISH,
    HOLD,
    PROBE,
    READ,
    RECORD,
    STAGE,
    SWEEP,
    ExportAttempt,
    Party,
    Reconciler,
)
from stateful.world import CHANGES, EXPORT, FAULTS, KEYS, LEASE, PLACES, Code, KeyRows, World, canonical, parse_place

S = ExportState
MAX_ATTEMPTS = 3  # the sensor's automatic reruns (DEFAULT_MAX_ATTEMPTS)
STUCK_AFTER = dt.timedelta(hours=1)
MAX_LIVE = 4  # parties alive at once
MAX_CODES = 4  # codes deployed in one example (the first included)
#: The claim refusals of the export contract (``ContractChanged``, ``DestinationMoved``).
CONTRACT_REFUSALS = (ContractChanged.__name__, DestinationMoved.__name__)
#: Where ``run_until`` may pause a party (an attempt's steps, a reconciler's; "end": it runs to its end).
STEPS = (FENCE, PROBE, READ, SWEEP, STAGE, COMMIT, RECORD, HOLD, EXAMINE, FINISH, "end")

#: How many deploys back an attempt's code is: mostly the latest, sometimes a stale environment's.
STALE = st.sampled_from([0, 0, 0, 1, 2])
#: What the machines explored, over every example of the process (reset by the tests that print it).
STATS: Counter = Counter()


class ProtocolViolation(AssertionError):
    """An invariant of docs/protocol.md does not hold; the message starts with ``invariant <n> (<name>)``."""


def violation(number: str, name: str, detail: str) -> ProtocolViolation:
    return ProtocolViolation(f"invariant {number} ({name}): {detail}")


def place_of(location: str) -> str:
    """The place a recorded location names (its last path segment), parsed here, not by the library."""
    return location.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class Track:
    """What the machine has seen of one key at one destination so far."""

    max_fence: int = 0
    revision: int = 0
    place: str | None = None
    named: set[str] = field(default_factory=set)  # places a pointer named (and no discard removed since)
    tokens: list[int] = field(default_factory=list)  # tokens issued by claims and holds, in order
    requested: set[int] = field(default_factory=set)  # revision numbers ever requested


def expected_claim(key: LogicalKey, before: KeyRows, now: dt.datetime) -> str:
    """The claim docs/protocol.md step 1 allows, from the key's rows as read just before and the ledger's clock: an
    independent model of the claim's guards (window, state, the one lease predicate)."""
    run = before.run
    if run is None:
        return "WindowNotOver" if key.window.end_utc > now else "claim"
    if run.window_end_utc > now:
        return "WindowNotOver"
    state = S(run.state)
    if state is S.COMPLETED:
        return "claim" if before.open_request is not None else "completed"
    if state is S.FAILED:
        return "claim"
    if state is S.CONFLICT:
        return "ConflictRecorded"
    if state is S.REMOTE_UNKNOWN:
        return "NeedsReconciliation"
    live = run.lease_expires_at is not None and run.lease_expires_at > now
    return "LeaseHeld" if live else "claim"


def expected_contract(before: KeyRows, contract: dict, wanted: str) -> str | None:
    """The refusal the export contract adds to the claim ``wanted`` (:func:`expected_claim`), or None: an independent
    model of the claim's contract checks, from the key's rows and the contracts recorded, as read just before.

    Refused with ``ContractChanged`` unless its contract is the tenant's contract in force (or none is recorded yet:
    then it is recorded, unless its terms are not the export's); a key already completed is skipped first. A claim
    that would take a key over, restate it or retry its failed restatement is refused with ``DestinationMoved`` when
    the key was last claimed under a contract no longer in force that publishes at another destination than this
    claim."""
    in_force, run = before.in_force, before.run
    if wanted == "completed":
        return None
    if contract_mismatch(before, contract):
        return ContractChanged.__name__
    if wanted != "claim" or run is None or before.contract is None:
        return None
    has_request = before.open_request is not None
    carries = run.state == S.IN_PROGRESS.value or (has_request and run.state in (S.COMPLETED.value, S.FAILED.value))
    stale = canonical(before.contract) != canonical(in_force or contract)
    moved = before.contract["terms"]["destination"] != contract["terms"]["destination"]
    return DestinationMoved.__name__ if carries and stale and moved else None


def contract_mismatch(before: KeyRows, contract: dict) -> bool:
    """Whether a claim's contract is not the one in force: the tenant's, or, for a tenant with none yet, the export's
    terms (the calendar is the tenant's own, the terms are the export's)."""
    if before.in_force is not None:
        return canonical(before.in_force) != canonical(contract)
    return before.export_terms is not None and before.export_terms != contract.get("terms")


def _outcome_name(outcome) -> str:
    if isinstance(outcome, Claim):
        return "claim"
    if isinstance(outcome, AlreadyCompleted):
        return "completed"
    return type(outcome).__name__


def guarded(method):
    """Marks the machine broken when a rule or invariant raises, so that teardown does not pile a liveness failure
    on top of the first one."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper


class ProtocolMachine(RuleBasedStateMachine):
    """See the module docstring; subclasses set ``backend`` and ``destination_kind``."""

    backend = "sqlite"
    destination_kind = "local"
    liveness = True

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None
        self.broken = False
        self.parties: list[Party] = []
        self.keys: tuple[LogicalKey, ...] = ()
        self.tracks: dict[tuple[str, int], Track] = {}  # by key and destination
        self.recorded: dict[str, dict[int, tuple[int | None, str]]] = {}  # key -> revision -> (destination, place)
        self.codes: list[Code] = []  # every code deployed, the latest last
        # What the machine knows of the contracts, to pick an acceptance that can change something: each tenant's
        # code whose contract is in force, and the code its last claim refused by the contract brought.
        self.in_force_code: dict[str, Code] = {}
        self.refused_tenants: dict[str, Code] = {}
        self.numbers = Counter()
        self.discarded: set[str] = set()
        self._fence_before = 0
        self._place_before: str | None = None
        self.seen: dict[str, tuple[ExportState | None, bool]] = {}  # state and open request, as last checked

    # -- setup -----------------------------------------------------------------------------------------------

    @initialize(keys=st.integers(0, 1))
    @guarded
    def setup(self, keys: int) -> None:
        """One key (the late one, whose window ends after the start) or two."""
        self._setup(keys)

    def _setup(self, keys: int, history: bool = False) -> None:
        """With ``history``, the early key (when there are two) was exported before the example starts, by the first
        code."""
        self.world = World(self.backend, self.destination_kind)
        self.keys = KEYS[-(keys + 1) :]
        self.tracks = {(str(key), at): Track() for key in self.keys for at in range(len(PLACES))}
        self.recorded = {str(key): {} for key in self.keys}
        self.codes = [Code()]
        STATS["examples"] += 1
        if history and len(self.keys) > 1:
            earlier = ExportAttempt(self._name("history"), self.keys[0], 0, source_fails=False, variant=0)
            self.parties.append(earlier)
            while not earlier.done:
                self.step(earlier)
                self.check()
            STATS[f"history: {earlier.outcome}"] += 1

    def teardown(self) -> None:
        try:
            if self.world is not None and not self.broken and self.liveness:
                self.settle()
        finally:
            if self.world is not None:
                self.world.close()

    def _count(self, rule_name: str) -> None:
        STATS["steps"] += 1
        STATS[f"rule {rule_name}"] += 1

    def _name(self, kind: str) -> str:
        self.numbers[kind] += 1
        return f"{kind}-{self.numbers[kind]}/orders"

    def live(self) -> list[Party]:
        return [p for p in self.parties if not p.done]

    def _pick(self, index: int) -> Party:
        live = self.live()
        return live[index % len(live)]

    # -- rules: parties ----------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.live()) < MAX_LIVE)
    @rule(
        which=st.integers(0, 1),
        offset=st.sampled_from([0, 0, -1800, -600, -30, 30, 600, 1800, 7200]),
        source_fails=st.integers(0, 5).map(lambda n: n == 0),
    )
    @guarded
    def start_attempt(self, which: int, offset: int, source_fails: bool) -> None:
        """A worker starts an attempt on a key: its first step, the claim."""
        self._start_attempt(which, offset, source_fails, self.codes[-1])

    def _start_attempt(self, which: int, offset: int, source_fails: bool, code: Code) -> None:
        self._count("start_attempt")
        key = self.keys[which % len(self.keys)]
        variant = self.numbers["attempt"] + 1
        attempt = ExportAttempt(self._name("attempt"), key, offset, source_fails=source_fails, variant=variant,
                                code=code)  # fmt: skip
        self.parties.append(attempt)
        self.step(attempt)

    @precondition(lambda self: len(self.live()) < MAX_LIVE and self._where(S.IN_PROGRESS, S.REMOTE_UNKNOWN))
    @rule(which=st.integers(0, 1), offset=st.sampled_from([0, -900, 900]))
    @guarded
    def start_reconciler(self, which: int, offset: int) -> None:
        """A reconciler starts a pass over a key that is (or may soon be) stuck: its first step finds it stuck (then
        hold, fence and judge, finish)."""
        self._count("start_reconciler")
        keys = self._where(S.IN_PROGRESS, S.REMOTE_UNKNOWN)
        reconciler = Reconciler(self._name("reconciler"), keys[which % len(keys)], offset)
        self.parties.append(reconciler)
        self.step(reconciler)

    @precondition(lambda self: bool(self.live()))
    @rule(index=st.integers(0, MAX_LIVE - 1), fault=st.sampled_from([None] * 6 + list(FAULTS)))
    @guarded
    def advance(self, index: int, fault: str | None) -> None:
        """One party takes one protocol step; a fault may meet its pointer write."""
        self._count("advance")
        self.step(self._pick(index), fault)

    @precondition(lambda self: bool(self.live()))
    @rule(index=st.integers(0, MAX_LIVE - 1), fault=st.sampled_from([None] * 6 + list(FAULTS)))
    @guarded
    def advance_again(self, index: int, fault: str | None) -> None:
        """The same as :meth:`advance` (rules are drawn evenly: advancing is what most steps should do)."""
        self._count("advance")
        self.step(self._pick(index), fault)

    @precondition(lambda self: bool(self.live()))
    @rule(index=st.integers(0, MAX_LIVE - 1), until=st.sampled_from(STEPS))
    @guarded
    def run_until(self, index: int, until: str) -> None:
        """One party runs, a step at a time, until its next step is ``until`` (it pauses there) or it ends."""
        self._run_until(index, until)

    def _run_until(self, index: int, until: str) -> None:
        self._count("run_until")
        party = self._pick(index)
        for _ in range(12):
            if party.done or party.next == until:
                break
            self.step(party)
            self.check()

    @precondition(lambda self: bool(self.live()))
    @rule(index=st.integers(0, MAX_LIVE - 1), until=st.sampled_from(STEPS))
    @guarded
    def run_until_again(self, index: int, until: str) -> None:
        """The same as :meth:`run_until`."""
        self._run_until(index, until)

    @precondition(lambda self: bool(self.live()))
    @rule(index=st.integers(0, MAX_LIVE - 1))
    @guarded
    def crash(self, index: int) -> None:
        """A party dies where it stands, for good."""
        self._count("crash")
        party = self._pick(index)
        party.finish(f"crashed before {party.next}")
        STATS["crashes"] += 1

    def step(self, party: Party, fault: str | None = None) -> str:
        world = self.world
        if party.claim is not None and not party.done:
            expired = party.claim.lease_expires_at <= world.clock.now
            if expired and party.believes_live(world):
                STATS["steps taken past the lease, its own clock saying live"] += 1
        world.faults.arm(fault)
        try:
            what = party.step(world, self)
        finally:
            world.faults.disarm()
        STATS[f"{party.kind} {party.history[-1]}"] += 1
        if party.done:
            STATS[f"{party.kind} ended: {party.outcome.split(':')[0]}"] += 1
        return what

    # -- rules: time -------------------------------------------------------------------------------------------

    @rule(seconds=st.one_of(st.sampled_from([1, 60, 299, 599, 600, 601, 1200, 3600]), st.integers(0, 1800)))
    @guarded
    def tick(self, seconds: int) -> None:
        """The ledger's clock moves on (leases end, the late key's window ends)."""
        self._count("tick")
        self.world.clock.advance(seconds)

    @precondition(lambda self: any(p.claim is not None for p in self.live()))
    @rule(index=st.integers(0, MAX_LIVE - 1))
    @guarded
    def tick_to_lease_end(self, index: int) -> None:
        """The ledger's clock stops exactly at a party's lease expiry (at equality the lease has ended)."""
        self._count("tick_to_lease_end")
        held = [p for p in self.live() if p.claim is not None]
        party = held[index % len(held)]
        if party.claim.lease_expires_at > self.world.clock.now:
            self.world.clock.now = party.claim.lease_expires_at
            STATS["clock set to a lease's expiry"] += 1

    @precondition(lambda self: any(p.claim is not None for p in self.live()) and len(self.live()) < MAX_LIVE)
    @rule(
        index=st.integers(0, MAX_LIVE - 1),
        late=st.sampled_from([0, 0, 1, 300]),
        who=st.sampled_from(["attempt", "attempt", "reconciler"]),
        offset=st.sampled_from([0, -1800, 1800]),
    )
    @guarded
    def take_over(self, index: int, late: int, who: str, offset: int) -> None:
        """A party's lease runs out (the clock set to its expiry, or ``late`` seconds after) while it still believes
        in it, and a new attempt (or a reconciler) comes for its key at once: its first step."""
        self._take_over(index, late, who, offset, self.codes[-1])

    def _take_over(self, index: int, late: int, who: str, offset: int, code: Code) -> None:
        self._count("take_over")
        held = [p for p in self.live() if p.claim is not None]
        party = held[index % len(held)]
        expiry = party.claim.lease_expires_at + dt.timedelta(seconds=late)
        if expiry > self.world.clock.now:
            self.world.clock.now = expiry
        if who == "reconciler":
            newcomer: Party = Reconciler(self._name("reconciler"), party.key, offset)
        else:
            variant = self.numbers["attempt"] + 1
            newcomer = ExportAttempt(self._name("attempt"), party.key, offset, source_fails=False, variant=variant,
                                     code=code)  # fmt: skip
        self.parties.append(newcomer)
        self.step(newcomer)

    # -- rules: reconciliation and operators ---------------------------------------------------------------------

    @precondition(lambda self: self._where(S.IN_PROGRESS, S.REMOTE_UNKNOWN))
    @rule(fault=st.sampled_from([None, None, None] + list(FAULTS)))
    @guarded
    def reconcile_pass(self, fault: str | None) -> None:
        """``reconcile_batch`` whole, over every stuck key."""
        self._count("reconcile_pass")
        world = self.world
        with self._faulty(fault):
            report = reconcile_batch(world.ledger, world.placed, limit=10, after=None, exports=[EXPORT],
                                     reconciler=self._name("reconcile-pass"))  # fmt: skip
        for finding in report.findings:
            STATS[f"reconcile pass judged {finding.verdict.value}"] += 1

    def _where(self, *states: ExportState, request: bool | None = None) -> list[LogicalKey]:
        """The keys whose state (as the last check read it) is one of ``states`` (and with or without an open
        restatement request): what an operator would pick a command for."""
        found = []
        for key in self.keys:
            state, has_request = self.seen.get(str(key), (None, False))
            if state in states and (request is None or has_request == request):
                found.append(key)
        return found

    @precondition(lambda self: self._where(S.COMPLETED, request=False))
    @rule(which=st.integers(0, 1))
    @guarded
    def request_restatement(self, which: int) -> None:
        """An operator (or the drift sensor) asks for the next revision of a completed key."""
        self._restate(which, launch=False)

    def _restate(self, which: int, *, launch: bool) -> None:
        """The request; with ``launch``, the run that publishes it starts at once (as ``export-ledger restate``
        launches it), on the code deployed last: its first step, the claim."""
        self._count("request_restatement")
        keys = self._where(S.COMPLETED, request=False)
        key = keys[which % len(keys)]
        if self._request(key) and launch and len(self.live()) < MAX_LIVE:
            variant = self.numbers["attempt"] + 1
            attempt = ExportAttempt(self._name("attempt"), key, 0, source_fails=False, variant=variant,
                                    code=self.codes[-1])  # fmt: skip
            self.parties.append(attempt)
            self.step(attempt)

    @precondition(lambda self: self._where(S.COMPLETED, S.FAILED, request=True))
    @rule(which=st.integers(0, 1), fault=st.sampled_from([None] * 4 + list(FAULTS)))
    @guarded
    def withdraw(self, which: int, fault: str | None) -> None:
        """``restate --withdraw`` whole, on a key with an open request; a fault may meet its fence."""
        self._count("withdraw")
        keys = self._where(S.COMPLETED, S.FAILED, request=True)
        with self._faulty(fault):
            self._withdraw(keys[which % len(keys)])

    @precondition(lambda self: self._where(S.CONFLICT, S.FAILED, S.REMOTE_UNKNOWN, S.IN_PROGRESS))
    @rule(
        which=st.integers(0, 1),
        action=st.sampled_from([resolving.ACCEPT, resolving.DISCARD]),
        fault=st.sampled_from([None] * 4 + list(FAULTS)),
        skip=st.integers(0, 1),
    )
    @guarded
    def resolve(self, which: int, action: str, fault: str | None, skip: int) -> None:
        """``export-ledger resolve`` whole, accepting or discarding what the destination holds, on a key that is not
        completed (a live lease included: it must be refused); a fault may meet its fence (``skip`` 0) or a
        discard's pointer write (``skip`` 1)."""
        self._count(f"resolve {action}")
        keys = self._where(S.CONFLICT, S.FAILED, S.REMOTE_UNKNOWN, S.IN_PROGRESS)
        with self._faulty(fault, skip):
            self._resolve(keys[which % len(keys)], action)

    @contextlib.contextmanager
    def _faulty(self, fault: str | None, skip: int = 0):
        self.world.faults.arm(fault, skip)
        try:
            yield
        finally:
            self.world.faults.disarm()

    def _request(self, key: LogicalKey) -> bool:
        """Asks for the key's next revision; whether it was recorded."""
        seen = self._revisions_seen(key)
        try:
            request = self.world.ledger.restatements.request(str(key), reason="amounts corrected", requested_by="ops")
        except LedgerError as exc:
            STATS[f"restatement refused: {type(exc).__name__}"] += 1
            return False
        STATS["restatement requested"] += 1
        run = self.world.rows.key(key)
        if run.contract is not None and canonical(run.contract) != canonical(run.in_force):
            moved = run.contract["terms"]["destination"] != run.in_force["terms"]["destination"]
            STATS[f"restatement requested of a key whose contract is no longer in force{' (moved)' * moved}"] += 1
        if request.revision <= seen:
            raise violation("4", "revision numbers unique", f"{key}: a request got revision {request.revision} "
                            f"although revision {seen} was already had or asked for")  # fmt: skip
        return True

    def _withdraw(self, key: LogicalKey) -> None:
        try:
            restate.withdraw(self.world.ledger, self._placed(key), str(key), operator="ops",
                             reason="asked by mistake")  # fmt: skip
        except LedgerError as exc:
            STATS[f"withdraw refused: {type(exc).__name__}"] += 1
            return
        STATS["withdrawn"] += 1

    def _placed(self, key: LogicalKey):
        """Where an operator's command acts on ``key``: where the library places it (its contract's destination), as
        the CLI asks (``operations.key_destination``)."""
        record = self.world.ledger.queries.get(str(key))
        return self.world.destination if record is None else self.world.placed([record])[str(key)]

    def _resolve(self, key: LogicalKey, action: str) -> None:
        if action == resolving.DISCARD:
            # A discard may set the pointer back even when it then fails (a write that landed, its answer lost):
            # the pointer may go back to the recorded revision whatever the command answered.
            self.discarded.add(str(key))
        try:
            resolving.resolve_key(self.world.ledger, self._placed(key), str(key), action=action, operator="ops",
                                  reason="looked at it")  # fmt: skip
        except LedgerError as exc:
            STATS[f"resolve {action} refused: {type(exc).__name__}"] += 1
            return
        STATS[f"resolved {action}"] += 1

    # -- checks at the moment a party acts ---------------------------------------------------------------------

    def on_claim(self, party: ExportAttempt, before: KeyRows, now: dt.datetime, outcome) -> None:
        """Invariant 8, the claim's guards (docs/protocol.md step 1), by the ledger's clock only, and its contract's."""
        key, run, request = party.key, before.run, before.open_request
        wanted, got = expected_claim(key, before, now), _outcome_name(outcome)
        STATS[f"claim {got}"] += 1
        wanted = self.check_claim_contract(party, before, wanted, got) or wanted
        if isinstance(outcome, Claim):
            if key.window.end_utc > now:
                raise violation("8", "no claim before the window ends", f"{key} claimed at {now.isoformat()} by the "
                                f"ledger's clock; its window ends {key.window.end_utc.isoformat()}")  # fmt: skip
            if outcome.started_at != now:
                raise violation("8", "one clock", f"{key}: the claim started at {outcome.started_at}, the ledger's "
                                f"clock said {now}")  # fmt: skip
            self._issued(key, outcome.fencing_token, "claim")
            expected_token = 1 if run is None else run.fencing_token + 1
            expected_revision = request.revision if request is not None else 1
            if (outcome.fencing_token, outcome.revision) != (expected_token, expected_revision):
                raise violation("T", "tokens", f"{key}: claim got token {outcome.fencing_token} revision "
                                f"{outcome.revision}, expected {expected_token} and {expected_revision}")  # fmt: skip
        if run is not None and run.state == S.IN_PROGRESS.value and wanted == "LeaseHeld":
            believed = "expired" if party.own_now(self.world) >= run.lease_expires_at else "live"
            STATS[f"claim of a live lease, claimant's own clock saying {believed}"] += 1
        if wanted != got:
            own = expected_claim(key, before, party.own_now(self.world))
            by_own = " (what the claimant's own clock would decide)" if own == got else ""
            raise violation("L", "claim guards", f"{key}: the claim ended {got}{by_own}; docs/protocol.md step 1 "
                            f"allows {wanted} (state {run.state if run else None}, lease until "
                            f"{run.lease_expires_at if run else None}, ledger now {now})")  # fmt: skip

    def check_claim_contract(self, party: ExportAttempt, before: KeyRows, wanted: str, got: str) -> str | None:
        """Invariant K: the claim's contract checks decide as :func:`expected_contract` says; a claim that succeeds
        leaves the key naming its own contract, the one in force; a claim refused by the contract changes nothing.
        Returns the refusal expected (None: the claim's other guards decide)."""
        key, contract = party.key, party.contract
        refusal = expected_contract(before, contract, wanted)
        if contract_mismatch(before, contract):
            self.refused_tenants[key.tenant] = party.code  # kept open by the ledger, even for a key completed
        else:
            self.refused_tenants.pop(key.tenant, None)  # a claim under the contract in force closes the refusal
            self.in_force_code[key.tenant] = party.code  # recorded by the first claim, or matched
        if refusal is not None or got in CONTRACT_REFUSALS:
            STATS[f"contract: {got} (expected {refusal or wanted})"] += 1
        if refusal is not None and got != refusal:
            raise violation("K", "the contract at claim", f"{key}: the claim of {party.name} (code "
                            f"{party.code.describe()}) ended {got}, where the contract allows only {refusal} (the "
                            f"key was claimed under {_terms(before.contract)}, in force {_terms(before.in_force)}, "
                            f"the claim brings {_terms(contract)})")  # fmt: skip
        if refusal is None and got in CONTRACT_REFUSALS:
            raise violation("K", "the contract at claim", f"{key}: the claim of {party.name} was refused ({got}) "
                            f"under the contract in force {_terms(before.in_force)}")  # fmt: skip
        after = self.world.rows.key(key)
        if got in CONTRACT_REFUSALS:
            changed = (before.run is None) != (after.run is None) or (
                before.run is not None and dict(before.run._mapping) != dict(after.run._mapping)
            )
            if changed:
                raise violation("K", "a refused claim changes nothing", f"{key}: refused ({got}), yet its row went "
                                f"from {before.run} to {after.run}")  # fmt: skip
            left = [(row.outcome, row.error_class) for row in self.world.rows.attempts(party.name)]
            if any(found != ("refused", got) for found in left) or len(left) > 1:
                raise violation("K", "a refused claim changes nothing", f"{key}: refused ({got}), yet {party.name} "
                                f"left the attempt rows {left} (at most one, refused)")  # fmt: skip
        elif got == "claim":
            if after.contract is None or canonical(after.contract) != canonical(contract):
                raise violation("K", "the contract at claim", f"{key}: claimed by {party.name} under "
                                f"{_terms(contract)}, yet the key names {_terms(after.contract)}")  # fmt: skip
            if after.in_force is None or canonical(after.in_force) != canonical(contract):
                raise violation("K", "the contract at claim", f"{key}: claimed under {_terms(contract)}, the "
                                f"contract in force is {_terms(after.in_force)}")  # fmt: skip
        return refusal

    def on_hold(self, party: Reconciler, found, current, now: dt.datetime, claim) -> None:
        """A reconciliation hold: only a stuck key (``remote_unknown``, or a lease ended by the ledger's clock) that
        nobody moved since it was found, with the next token."""
        if current.state != found.state.value or current.fencing_token != found.fencing_token:
            wanted = False
        elif current.state == S.IN_PROGRESS.value:
            wanted = current.lease_expires_at is not None and current.lease_expires_at <= now
        else:
            wanted = current.state == S.REMOTE_UNKNOWN.value
        STATS[f"hold {'taken' if claim is not None else 'refused'}"] += 1
        if wanted != (claim is not None):
            raise violation("L", "hold guards", f"{party.key}: hold {'taken' if claim else 'refused'} on "
                            f"{current.state} (lease until {current.lease_expires_at}, ledger now {now}, found "
                            f"{found.state.value} token {found.fencing_token})")  # fmt: skip
        if claim is not None:
            self._issued(party.key, claim.fencing_token, "hold")
            if claim.fencing_token != current.fencing_token + 1:
                raise violation("T", "tokens", f"{party.key}: hold got token {claim.fencing_token} after "
                                f"{current.fencing_token}")  # fmt: skip

    def _issued(self, key: LogicalKey, token: int, what: str) -> None:
        tokens = self.tracks[(str(key), 0)].tokens  # tokens are the key's, whatever the destination
        if tokens and token <= tokens[-1]:
            raise violation("T", "tokens never reused", f"{key}: {what} got token {token} after {tokens}")
        tokens.append(token)

    def before_commit(self, party: ExportAttempt) -> None:
        view = self.world.view(party.key, party.code.at)
        self._fence_before = max(view.fence, self.tracks[(str(party.key), party.code.at)].max_fence)
        self._place_before = view.place

    def after_commit(self, party: ExportAttempt, pointer) -> None:
        """Invariant 5 at the commit itself: once the pointer's fence reached f, no commit below f succeeds."""
        token = party.claim.fencing_token
        if self._place_before != party.staged.target.place and token < self._fence_before:
            raise violation("5", "no effect of a stale token", f"{party.key}: {party.name}'s commit with token "
                            f"{token} succeeded after the pointer's fence reached {self._fence_before}")  # fmt: skip
        STATS["commit succeeded"] += 1

    def before_finish(self, party: Party):
        return self.world.rows.key(party.key).run

    def after_finish(self, party: Party, before, *, accepted: bool) -> None:
        """Fencing in the ledger: a party's finishing transition is recorded exactly when it still holds the key (the
        key ``in_progress`` under its token and lease owner), whatever its lease's expiry or its own clock say."""
        claim = party.claim
        holds = (
            before is not None
            and before.state == S.IN_PROGRESS.value
            and before.fencing_token == claim.fencing_token
            and before.lease_owner == claim.attempt_id
        )
        STATS[f"finish {'recorded' if accepted else 'refused'}"] += 1
        if accepted != holds:
            raise violation("T", "fencing in the ledger", f"{party.key}: {party.name}'s finish (token "
                            f"{claim.fencing_token}) was {'recorded' if accepted else 'refused'} while the key was "
                            f"{before.state if before else None} under token {before.fencing_token if before else None}"
                            f" held by {before.lease_owner if before else None}")  # fmt: skip

    def on_fenced(self, party: Party) -> None:
        STATS[f"{party.kind} fenced"] += 1
        if party.believes_live(self.world):
            STATS["fenced while its own clock said its lease was live"] += 1

    # -- the invariants, read from what a reader sees ------------------------------------------------------------

    def _revisions_seen(self, key: LogicalKey) -> int:
        """The highest revision the key ever had or was asked for, from the machine's own records, the ledger's rows
        and what the destination holds."""
        rows, recorded = self.world.rows.key(key), self.recorded[str(key)]
        seen = [0, *recorded, *[r.revision for r in rows.requests]]
        for at in range(len(PLACES)):
            view = self.world.view(key, at)
            seen += [view.revision, *self.tracks[(str(key), at)].requested]
            seen += [p.revision for p in view.places.values() if p.revision is not None]
        return max(seen)

    @invariant()
    @guarded
    def protocol_holds(self) -> None:
        self.check()

    def check(self) -> None:
        snapshot = self.world.rows.read()
        for key in self.keys:
            rows = snapshot.get(str(key), KeyRows(None))
            self.check_key(key, rows)
            self.seen[str(key)] = (S(rows.state) if rows.state else None, rows.open_request is not None)
        self.discarded.clear()

    def check_key(self, key: LogicalKey, rows: KeyRows) -> None:
        """Every invariant of one key: at the destination its contract records (its home: where reconciliation and the
        operator's commands act), docs/protocol.md's; at the other, nothing visible; and D, one export per key."""
        name = str(key)
        views = [self.world.view(key, at) for at in range(len(PLACES))]
        home = 0 if rows.run is None or rows.contract is None else self.world.home_of(rows.contract)
        if home is None:
            raise violation("D", "each key at its contract's destination", f"{name}: its contract records "
                            f"{_terms(rows.contract)}, neither A nor B")  # fmt: skip
        visible = [PLACES[at] for at, view in enumerate(views) if view.place is not None]
        if len(visible) > 1:
            where = ", ".join(f"{PLACES[at]}: r{v.revision} at {v.place}" for at, v in enumerate(views))
            raise violation("D", "one destination per key", f"{name}: its export is visible at both ({where})")
        for at, view in enumerate(views):
            if at != home:
                self.check_elsewhere(key, rows, view, self.tracks[(name, at)], at)
        self.check_home(key, rows, views, self.tracks[(name, home)], home)

    def check_elsewhere(self, key: LogicalKey, rows: KeyRows, view, track: Track, at: int) -> None:
        """A destination the key's contract does not record: its pointer names nothing (only a conflict may hold
        something anywhere), what a pointer named there stays, its fence never goes down."""
        name = str(key)
        if view.problems:
            raise violation("2", "one current revision", f"{name} at {PLACES[at]}: {'; '.join(view.problems)}")
        if view.fence < track.max_fence:
            raise violation("5", "no effect of a stale token", f"{name} at {PLACES[at]}: the pointer's fence went "
                            f"from {track.max_fence} down to {view.fence}")  # fmt: skip
        if view.place is not None and rows.state != S.CONFLICT.value:
            raise violation("D", "each key at its contract's destination", f"{name} is {rows.state} under a contract "
                            f"that records {PLACES[1 - at]}, yet {PLACES[at]}'s pointer names r{view.revision} at "
                            f"{view.place}")  # fmt: skip
        for place in sorted(track.named):
            found = view.places.get(place)
            if found is None or not found.intact:
                raise violation("7", "nothing named is deleted", f"{name} at {PLACES[at]}: {place} (named by the "
                                "pointer) is gone")  # fmt: skip
        track.max_fence = max(track.max_fence, view.fence)
        track.revision, track.place = view.revision, view.place
        if view.place is not None:
            track.named.add(view.place)

    def check_home(self, key: LogicalKey, rows: KeyRows, views: list, track: Track, home: int) -> None:
        """docs/protocol.md's invariants at the destination the key's contract records (``views``: what a reader sees
        at each destination)."""
        name = str(key)
        view = views[home]
        record, current, request = rows.run, rows.current, rows.open_request
        discarded = name in self.discarded
        recorded = self.recorded[name]

        # 2. Exactly one current revision: the pointer names one intact place, or nothing.
        if view.problems:
            raise violation("2", "one current revision", f"{name}: {'; '.join(view.problems)}")

        # 5. No effect of a stale token: the fence never goes down, and a place made current after the fence
        # reached f has a token of at least f.
        if view.fence < track.max_fence:
            raise violation("5", "no effect of a stale token", f"{name}: the pointer's fence went from "
                            f"{track.max_fence} down to {view.fence}")  # fmt: skip
        if view.place is not None:
            token = parse_place(view.place)[1]
            if token > view.fence:
                raise violation("5", "no effect of a stale token", f"{name}: the pointer names {view.place} under "
                                f"fence {view.fence}")  # fmt: skip
            if view.place != track.place and not discarded and token < track.max_fence:
                raise violation("5", "no effect of a stale token", f"{name}: {view.place} became current after the "
                                f"fence reached {track.max_fence}")  # fmt: skip

        # 4. Revision numbers unique per key; the pointer's revision never decreases, but for a discard back to the
        # recorded revision.
        recorded_revision = current.revision if current is not None else 0
        if view.revision < track.revision and not (discarded and view.revision == recorded_revision):
            raise violation("4", "the pointer's revision never decreases", f"{name}: from {track.revision} to "
                            f"{view.revision} (recorded {recorded_revision}, discard: {discarded})")  # fmt: skip
        numbers = [r.revision for r in rows.revisions]
        if len(set(numbers)) != len(numbers) or numbers != sorted(numbers):
            raise violation("4", "revision numbers unique", f"{name}: recorded revisions {numbers}")
        asked = [r.revision for r in rows.requests]
        if len(set(asked)) != len(asked):
            raise violation("4", "revision numbers unique", f"{name}: requested revisions {asked}")
        track.requested.update(asked)

        # 1. One logical export per key: one place per recorded revision, at one destination, for good.
        for revision in rows.revisions or ([current] if current is not None else []):
            place = (self.world.at_of(revision.location), place_of(revision.location))
            known = recorded.setdefault(revision.revision, place)
            if known != place:
                raise violation("1", "one export per revision", f"{name}: revision {revision.revision} recorded at "
                                f"{_at(place)}, earlier at {_at(known)}")  # fmt: skip

        # D. A completed key is verified at the destination its contract records: its recorded location is there
        # (and 3 below: the pointer there names it, with its sha256).
        state = S(record.state) if record is not None else None
        if state is S.COMPLETED and self.world.at_of(record.location) != home:
            raise violation("D", "each key at its contract's destination", f"{name} is completed at "
                            f"{record.location}; its contract records {PLACES[home]}")  # fmt: skip

        # 3 and 6. The ledger and the pointer agree.
        s_place = place_of(current.location) if current is not None else None
        names_s = view.revision == recorded_revision and (recorded_revision == 0 or view.place == s_place)
        under_way = request.revision if request is not None else (1 if current is None else None)
        where = f"{name} is {state.value if state else 'unknown'}, the pointer at {PLACES[home]} names " \
                f"r{view.revision} at {view.place} (fence {view.fence}); recorded r{recorded_revision} at " \
                f"{s_place}, under way r{under_way}"  # fmt: skip
        if state is None and (view.revision != 0 or view.has_pointer):
            raise violation("3", "the ledger and the pointer agree", where)
        if state is S.COMPLETED:
            if not names_s or current is None or view.sha256 != current.sha256:
                raise violation("3", "the ledger and the pointer agree", where)
            if record.location != current.location or record.sha256 != current.sha256:
                raise violation("3", "the ledger and the pointer agree", f"{where}; the key's row says "
                                f"{record.location}")  # fmt: skip
        if state is S.FAILED and not names_s:
            raise violation("6", "failed means nothing of it is visible", where)
        if state in (S.IN_PROGRESS, S.REMOTE_UNKNOWN) and not (names_s or view.revision == under_way):
            raise violation("3", "the ledger and the pointer agree", where)
        # C. Stricter than docs/protocol.md: here every writer of the destination is a party of the protocol, so
        # nothing "else" is ever there and no key should need a person for a conflict.
        if state is S.CONFLICT:
            raise violation("C", "no conflict without a foreign writer", where)

        # 7. Nothing a pointer named (and no discard removed since) and nothing a recorded revision names is
        # deleted.
        if discarded:
            track.named = {p for p in track.named if (home, p) in recorded.values() or p == view.place}
        for place in sorted(track.named):
            found = view.places.get(place)
            if found is None or not found.intact:
                raise violation("7", "nothing named is deleted", f"{name}: {place} (named by the pointer at "
                                f"{PLACES[home]}) is {'gone' if found is None else 'no longer intact'}")  # fmt: skip
        for at, place in sorted(set(recorded.values()), key=str):
            found = views[at].places.get(place) if at is not None else None
            if found is None or not found.intact:
                raise violation("7", "nothing named is deleted", f"{name}: {_at((at, place))} (recorded) is "
                                f"{'gone' if found is None else 'no longer intact'}")  # fmt: skip

        track.max_fence = max(track.max_fence, view.fence)
        track.revision, track.place = view.revision, view.place
        if view.place is not None:
            track.named.add(view.place)

    # -- liveness ------------------------------------------------------------------------------------------------

    def settle(self) -> None:
        """Invariant 9: faults stop, time passes beyond every lease, the parties still alive wake up and run to their
        end, then reconciliation and fresh attempts (automatic reruns while they last, restatements asked for, run by
        the code deployed last) run until nothing changes. Every key must end completed or escalated (a key whose
        reruns the contract refuses, by its tenant's open refusal or as a key that waits too long)."""
        world = self.world
        world.faults.enabled = False
        world.clock.advance((LEASE * 2).total_seconds())
        for party in list(self.live()):
            while not party.done:
                self.step(party)
                self.check()
        refused: dict[str, str] = {}  # key -> the contract's refusal of its last rerun
        for round_ in range(10):
            world.clock.advance((LEASE * 2).total_seconds())
            progressed = False
            report = reconcile_batch(world.ledger, world.placed, limit=10, after=None, reconciler="settle",
                                     exports=[EXPORT])  # fmt: skip
            progressed |= bool(report.findings)
            self.check()
            for key in self.keys:
                record = world.ledger.queries.get(str(key))
                request = world.ledger.restatements.open_requests([str(key)]).get(str(key))
                wanted = (
                    record is None
                    or (record.state is S.FAILED and record.claim_count < MAX_ATTEMPTS)
                    or (record.state is S.COMPLETED and request is not None)
                )
                if not wanted:
                    continue
                attempt = ExportAttempt(self._name("settle"), key, 0, source_fails=False, variant=1000 + round_,
                                        code=self.codes[-1])  # fmt: skip
                self.parties.append(attempt)
                while not attempt.done:
                    self.step(attempt)
                    self.check()
                refusal = next((r for r in CONTRACT_REFUSALS if r in attempt.outcome), None)
                if refusal is None:
                    refused.pop(str(key), None)
                    progressed = True
                else:
                    refused[str(key)] = refusal
            if not progressed:
                break
        if refused:
            world.clock.advance(STUCK_AFTER.total_seconds())  # a restatement refused long enough is escalated
        escalations = world.ledger.attention.needs_attention(STUCK_AFTER, max_attempts=MAX_ATTEMPTS)
        escalated = {e.logical_key for e in escalations}
        refused_tenants = {e.tenant for e in escalations if e.logical_key is None and e.state == "refused"}
        for key in self.keys:
            record = world.ledger.queries.get(str(key))
            request = world.ledger.restatements.open_requests([str(key)]).get(str(key))
            done = record is not None and record.state is S.COMPLETED and request is None
            spent = record is not None and record.state is S.FAILED and record.claim_count >= MAX_ATTEMPTS
            given_up = record is not None and record.state is S.CONFLICT
            by_contract = refused.get(str(key))
            if by_contract is not None and not (str(key) in escalated or key.tenant in refused_tenants):
                raise violation("9", "liveness", f"{key}: its reruns are refused ({by_contract}) but needs_attention "
                                "lists neither the key nor its tenant's refusal")  # fmt: skip
            state = "completed" if done else record.state.value if record else "never claimed"
            STATS[f"settled {state}{f' ({by_contract})' if by_contract and not done else ''}"] += 1
            if not (done or spent or given_up or by_contract):
                raise violation("9", "liveness", f"{key} ends {record.state.value if record else 'never claimed'} "
                                f"(claims {record.claim_count if record else None}, open request {request}) once "
                                "faults stopped and reconciliation and reruns ran")  # fmt: skip
            if not done and not by_contract and str(key) not in escalated:
                raise violation("9", "liveness", f"{key} ends {record.state.value} but needs_attention does not list "
                                "it")  # fmt: skip


class ContractMachine(ProtocolMachine):
    """The machine with the export contract's rules: deploys that change what the export is, attempts on the code
    deployed last or (a stale environment) an earlier one, accept-contract, a key exported before the example starts,
    restatements that launch their run. (Rules of the same name replace the protocol machine's, with one more
    choice each.)"""

    @initialize(keys=st.integers(0, 1), history=st.booleans())
    @guarded
    def setup(self, keys: int, history: bool) -> None:
        """As the protocol machine's; with ``history``, the early key (when there are two) was exported before the
        example starts, by the first code (so that deploys and restatements meet a key completed under a contract)."""
        self._setup(keys, history)

    @precondition(lambda self: len(self.live()) < MAX_LIVE)
    @rule(
        which=st.integers(0, 1),
        offset=st.sampled_from([0, 0, -1800, -600, -30, 30, 600, 1800, 7200]),
        source_fails=st.integers(0, 5).map(lambda n: n == 0),
        stale=STALE,
    )
    @guarded
    def start_attempt(self, which: int, offset: int, source_fails: bool, stale: int) -> None:
        """A worker starts an attempt on a key: its first step, the claim. It runs the code deployed last, or (a worker
        with a stale environment) an earlier one."""
        self._start_attempt(which, offset, source_fails, self._code(stale))

    @precondition(lambda self: any(p.claim is not None for p in self.live()) and len(self.live()) < MAX_LIVE)
    @rule(
        index=st.integers(0, MAX_LIVE - 1),
        late=st.sampled_from([0, 0, 1, 300]),
        who=st.sampled_from(["attempt", "attempt", "reconciler"]),
        offset=st.sampled_from([0, -1800, 1800]),
        stale=STALE,
    )
    @guarded
    def take_over(self, index: int, late: int, who: str, offset: int, stale: int) -> None:
        """As the protocol machine's, the newcomer on the code deployed last or an earlier one."""
        self._take_over(index, late, who, offset, self._code(stale))

    @precondition(lambda self: self._where(S.COMPLETED, request=False))
    @rule(which=st.integers(0, 1), launch=st.booleans())
    @guarded
    def request_restatement(self, which: int, launch: bool) -> None:
        """An operator (or the drift sensor) asks for the next revision of a completed key; with ``launch``, its run
        starts at once on the code deployed last."""
        self._restate(which, launch=launch)

    def _code(self, stale: int) -> Code:
        """The code deployed last, or ``stale`` deploys before it (a worker that has not picked up the new code)."""
        return self.codes[max(0, len(self.codes) - 1 - stale)]

    @precondition(lambda self: len(self.codes) < MAX_CODES)
    @rule(what=st.sampled_from(("destination",) * 3 + CHANGES))  # a new destination is the change that matters most
    @guarded
    def deploy(self, what: str) -> None:
        """A deploy changes what the export is: its destination (A <-> B), file format, column order, source or
        version. Attempts started from now on run it (but for a worker with a stale environment)."""
        self._count(f"deploy {what}")
        self.codes.append(self.codes[-1].changed(what))

    def _acceptable(self, ahead: bool) -> list[str]:
        """The tenants an acceptance would change: ``ahead``, whose contract in force is not the latest code's;
        else, those with a refusal open."""
        if ahead:
            return sorted(t for t, code in self.in_force_code.items() if code != self.codes[-1])
        return sorted(self.refused_tenants)

    @precondition(lambda self: self._acceptable(True) or self._acceptable(False))
    @rule(which=st.integers(0, 1), ahead=st.booleans())
    @guarded
    def accept_contract(self, which: int, ahead: bool) -> None:
        """``export-ledger accept-contract --keep-exported`` for a tenant: the contract its refused code asked for
        (``accept_refused``), or (``ahead``) the contract of the code deployed last, declared before its claims
        (``accept``), becomes the one in force. Refused itself while a key of the tenant may still be written at the
        old destination (or, for ``accept_refused``, when no claim was refused)."""
        self._count("accept_contract")
        contracts = self.world.ledger.contracts
        ahead = ahead if self._acceptable(ahead) else not ahead
        tenants = self._acceptable(ahead)
        tenant = tenants[which % len(tenants)]
        key = next(key for key in self.keys if key.tenant == tenant)
        code = self.codes[-1] if ahead else self.refused_tenants[tenant]
        try:
            if ahead:
                accepted = contracts.accept(EXPORT, self.world.contract(key, code), "deployed", tenant=tenant,
                                            operator="ops", exported="keep").accepted  # fmt: skip
            else:
                accepted = contracts.accept_refused(EXPORT, "deployed", tenant=tenant, operator="ops",
                                                    exported="keep").accepted  # fmt: skip
        except (LedgerError, ValueError) as exc:
            STATS[f"accept-contract refused: {type(exc).__name__}"] += 1
            return
        # The terms are the export's: new terms are recorded for every tenant (each keeps its own calendar), and
        # every refusal of the export is closed; a calendar alone is the tenant's.
        for done in accepted:
            if done.tenant is not None:
                self.refused_tenants.pop(done.tenant, None)
                self.in_force_code[done.tenant] = code
        moved = any(a.previous and a.previous["terms"]["destination"] != a.accepted["terms"]["destination"]
                    for a in accepted)  # fmt: skip
        STATS[f"accept-contract {'of a new destination' if moved else 'of new terms'}"] += 1


def _at(place: tuple[int | None, str]) -> str:
    at, name = place
    return f"{name} at {'?' if at is None else PLACES[at]}"


def _terms(contract: dict | None) -> str:
    """A contract's terms, short, for a violation's message."""
    if contract is None:
        return "no contract"
    terms = contract.get("terms") or {}
    columns = ",".join(name for name, _ in (terms.get("schema") or {}).get("columns", []))
    root = (terms.get("destination") or {}).get("root", "?")
    return (f"[{root.rsplit('/', 1)[-1]} {terms.get('file_format')} {columns} {(terms.get('source') or {}).get('name')}"
            f" v{terms.get('version')}]")  # fmt: skip


@functools.cache
def machine_for(backend: str, destination: str, *, contracts: bool = True) -> type[ProtocolMachine]:
    """The machine on a ledger backend (``sqlite``, ``postgres``) and a destination A (``local``, ``s3``), with the
    export contract's rules or (``contracts`` False) without them."""
    base = ContractMachine if contracts else ProtocolMachine
    return type(f"{base.__name__}_{backend}_{destination}", (base,),
                dict(backend=backend, destination_kind=destination))  # fmt: skip
