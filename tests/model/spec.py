"""The export protocol of docs/protocol.md as a transition system over small, immutable states.

Everything here is re-stated from the docs, not from ``export_ledger`` (nothing of it is imported). A state holds:

* per key, the ledger's row (state, fencing token, lease owner, lease left in ticks of the *ledger's* clock, the
  recorded current revision and its place, the open restatement request, the highest revision ever given or asked);
* per key, the destination: the pointer ``_current.json`` (its version tag, fence, revision and place) and the
  objects of the places ``r<rev>-t<token>/`` (a data file and a manifest each);
* per key, ghost facts that no party reads and the invariants need (revisions ever issued, places ever recorded,
  the highest fence ever written);
* the parties: workers (export attempts, each with its own clock offset and a budget of attempts: the automatic
  reruns), one reconciler and one operator, each with a program counter through its steps and what it remembers;
* the budget of faults (crashes, errors, unknown outcomes) and of operator commands left;
* when contracts are modelled (``Bounds.contracts``): two destinations (each its own pointers and places), the tenant's
  contract in force (a version; 0 until the first claim records its own), each key's contract (the one in force when
  an attempt last claimed it) and the destination of its recorded place; each worker's code names a contract (a deploy
  that moved the destination, or a worker left with a stale environment) and publishes at that contract's destination.

Time is relative: the ledger's clock moves by ``tick``, which shortens every lease and the wait for the window's end.
A party's own clock is the ledger's plus its offset; the protocol never uses it, and a mutation does.

Each guard of the protocol is a flag of :class:`Guards` (all on: the protocol as documented). Turning one off is a
mutation; the tests expect the explorer to find what breaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple

# -- ledger states -------------------------------------------------------------------------------------------------

NONE = "none"  # no row yet: never claimed
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
FAILED = "failed"
REMOTE_UNKNOWN = "remote_unknown"
CONFLICT = "conflict"

# -- program counters ----------------------------------------------------------------------------------------------

IDLE = "idle"
FENCE_READ, FENCE_WRITE = "fence_read", "fence_write"
PROBE = "probe"  # an attempt's step 3 (the source read of step 4 is folded in: its failure is an error here)
SWEEP = "sweep"
STAGE_DATA, STAGE_MANIFEST = "stage_data", "stage_manifest"
COMMIT_READ, COMMIT_WRITE = "commit_read", "commit_write"
JUDGE = "judge"
SETBACK_READ, SETBACK_WRITE = "setback_read", "setback_write"
DELETE = "delete"
RECORD = "record"
ACCEPT_RECORD = "accept_record"  # accept-contract: its keys were checked; the new contract is still to be recorded

# -- kinds of transition -------------------------------------------------------------------------------------------

STEP = "step"  # a party doing its job, or the clock ticking: what liveness may use
FAULT = "fault"  # a crash, an error, an unknown outcome, an unreachable destination
COMMAND = "command"  # an operator starting a command (restate, withdraw, discard, accept, accept_contract)

DATA, MANIFEST = "data", "manifest"


class Pointer(NamedTuple):
    """``_current.json`` as stored: ``ver`` is the store's version tag (0: absent; every write makes a new one)."""

    ver: int = 0
    fence: int = 0
    rev: int = 0
    place: tuple[int, int] | None = None  # (revision, token) of the place it names; None: nothing published


NOTHING = Pointer()


class Row(NamedTuple):
    """The ledger's row for one key."""

    state: str = NONE
    token: int = 0
    owner: str | None = None
    lease: int = 0  # ticks of the ledger's clock until the lease ends; 0: ended (expired is lease_expires_at <= now)
    current_rev: int = 0
    current_place: tuple[int, int] | None = None
    request: int = 0  # the open restatement request's revision; 0: none open
    rev_high: int = 0  # the highest revision the key ever had or was ever asked for
    contract: int = 0  # the contract in force when an attempt last claimed the key (contract_id); 0: none
    at: int = 0  # the destination of the recorded current place (part of the recorded location)


class Dest(NamedTuple):
    """One key's folder at the destination."""

    ptr: Pointer = NOTHING
    objects: frozenset = frozenset()  # {(revision, token, DATA | MANIFEST)}


class Ghost(NamedTuple):
    """Facts kept for the invariants only; no party reads them."""

    issued: frozenset = frozenset()  # revision numbers ever given (first export, requests)
    recorded: frozenset = frozenset()  # places ever recorded as a completed revision: (revision, token, destination)
    max_fence: int = 0  # the highest fence ever written to the pointer


class Party(NamedTuple):
    """A worker, the reconciler or the operator: where it is in its steps and what it remembers (lost on a crash,
    except ``left``, the worker's attempts still to run)."""

    pc: str = IDLE
    key: int = 0
    token: int = 0
    rev: int = 0  # r: the revision it publishes (or judges)
    sup: int = 0  # s: the revision r supersedes
    seen: Pointer | None = None  # the pointer as last read
    fenced_pred: bool = True  # whoever held the key before is fenced (false for a takeover until its fence lands)
    found: tuple[int, int] | None = None  # the place to record (or, for a discard, to restore)
    verdict: str = ""  # reconciler: what it judged; operator: the command
    prev: str = ""  # the key's state before a hold (to give it back)
    left: tuple[int, ...] = ()  # worker: attempts left to run, per key (each key's automatic reruns)
    at: int = 0  # the destination it acts at: a worker's code's; the reconciler's and operator's, the key's contract's
    contract: int = 0  # operator: the contract accept-contract records


class State(NamedTuple):
    window: int  # ticks of the ledger's clock until the keys' window ends
    rows: tuple[Row, ...]
    dests: tuple[Dest, ...]  # per (destination, key): index destination * keys + key
    ghosts: tuple[Ghost, ...]
    workers: tuple[Party, ...]
    recon: Party
    oper: Party
    faults: int  # faults left
    ops: int  # operator commands left
    in_force: int = 0  # the tenant's contract in force (0: none recorded yet; the first claim records its own)


class Move(NamedTuple):
    label: str
    kind: str
    state: State
    violation: str | None = None  # a transition invariant this move breaks


@dataclass(frozen=True)
class Guards:
    """The protocol's guards (docs/protocol.md), all on by default. Each flag off is one mutation."""

    #: Claims and holds judge "lease ended" and "window ended" by the ledger's clock, never the party's own.
    judge_time_by_ledger_clock: bool = True
    #: A claim is refused unless the window has ended (``window_end_utc <= now``).
    refuse_claim_before_window_end: bool = True
    #: A takeover (token above 1) raises the destination's fence before it probes, sweeps and stages (step 2).
    fence_before_publishing: bool = True
    #: Every pointer write is a compare-and-swap on the version read (``put_if_match``), never a blind put.
    pointer_compare_and_swap: bool = True
    #: ``commit(t, place)`` is refused when the pointer's fence is above ``t``.
    commit_checks_fence: bool = True
    #: ``commit`` moves only a pointer at the revision it supersedes; any other revision is a conflict.
    commit_checks_superseded: bool = True
    #: The sweep deletes only places no pointer can name: above the pointer's revision, or its revision elsewhere.
    sweep_only_unreferenced_places: bool = True
    #: The sweep deletes only places of tokens below its own (fenced ones).
    sweep_only_below_own_token: bool = True
    #: A request's revision is one above any the key ever had or was asked for (withdrawn numbers never reused).
    never_reuse_revision_numbers: bool = True
    #: Reconciliation holds the key (a new token) before it judges.
    reconcile_holds_before_judging: bool = True
    #: Reconciliation fences the destination with its hold's token before it judges.
    reconcile_fences_before_judging: bool = True
    #: A takeover's error before its fence lands records ``remote_unknown``, never ``failed``.
    error_before_fence_is_remote_unknown: bool = True
    #: An error while verifying a pointer that names something other than s records ``remote_unknown``, not
    #: ``failed`` (export_ledger/steps.py, KeySteps._staged, does this; docs/protocol.md's rule for errors before
    #: step 7 does not).
    probe_error_past_s_is_remote_unknown: bool = True
    #: Finishing moves (complete, fail, conflict, remote_unknown, release) are guarded by the token and lease owner.
    finish_guarded_by_token_and_owner: bool = True
    #: A discard deletes only places of tokens below its own.
    discard_deletes_only_below_its_token: bool = True
    #: Withdrawing a failed restatement completes the key again only if the pointer names the recorded revision.
    withdraw_checks_pointer: bool = True
    #: A ``remote_unknown`` key is never claimed (only reconciliation or an operator may take it).
    claim_refuses_remote_unknown: bool = True
    #: A claim whose contract is not the one in force is refused (``ContractChanged``), in the claim's transaction.
    claim_checks_contract: bool = True
    #: A claim that would carry a key whose earlier attempts may have written at the destination its contract
    #: records (a takeover, a restatement, a retry of a failed restatement) over to another destination is refused
    #: (``DestinationMoved``).
    claim_refuses_moved_key: bool = True
    #: accept-contract moves the destination only when no key is in_progress, remote_unknown or conflict, and none
    #: has an open restatement request.
    accept_checks_settled_keys: bool = True

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def without(self, name: str) -> Guards:
        if name not in self.names():
            raise ValueError(f"no guard {name!r}")
        return Guards(**{**self.__dict__, name: False})


@dataclass(frozen=True)
class Bounds:
    """How big the explored world is."""

    keys: int = 1
    #: One clock offset per worker, in ticks ahead of the ledger's clock (the number of workers is its length).
    worker_offsets: tuple[int, ...] = (0, 1)
    reconciler_offset: int = 1
    operator_offset: int = 0
    attempts_per_worker: int = 1  # the automatic reruns: once spent, a failed key is escalated
    ttl: int = 2  # lease length in ticks
    window: int = 1  # ticks until the window ends
    faults: int = 1
    commands: tuple[str, ...] = ()  # operator commands: restate, withdraw, discard, accept, accept_contract
    operator_commands: int = 0  # how many the operator runs
    #: Start with every key completed at revision 1 (place r1-t1), so that restatements fit in small bounds.
    start_completed: bool = False
    reconciler: bool = True
    max_token: int = 0  # 0: computed from the other bounds (see token_bound)
    #: The destination (0: A, 1: B) of each contract version 1, 2, ...; empty: contracts are not modelled (one
    #: destination, no contract checked).
    contracts: tuple[int, ...] = ()
    #: The contract each worker's code names (as many as workers); empty: all 1 when contracts are modelled.
    worker_codes: tuple[int, ...] = ()
    #: The contract in force at the start (recorded by the tenant's earlier claims); 0: none, the first claim records
    #: its own. With ``start_completed``, 1.
    in_force: int = 0

    def __post_init__(self) -> None:
        if self.worker_codes and len(self.worker_codes) != len(self.worker_offsets):
            raise ValueError("one contract per worker")
        named = (*self.worker_codes, self.in_force) if self.in_force else self.worker_codes
        if any(not 1 <= c <= len(self.contracts) for c in named):
            raise ValueError("a contract that is not among the contracts")

    @property
    def workers(self) -> int:
        return len(self.worker_offsets)

    @property
    def destinations(self) -> int:
        return max(self.contracts) + 1 if self.contracts else 1

    def code(self, worker: int) -> int:
        """The contract worker ``worker``'s code names (0: contracts are not modelled)."""
        if not self.contracts:
            return 0
        return self.worker_codes[worker] if self.worker_codes else 1

    def home(self, contract: int) -> int:
        """The destination contract ``contract`` records (A, 0, for none)."""
        return self.contracts[contract - 1] if contract else 0

    def token_bound(self) -> int:
        """Tokens are finite without this bound (each claim spends an attempt, each hold needs a stuck key); the
        bound only guards against a modelling mistake. Moves past it are counted as ``bound_hits``."""
        if self.max_token:
            return self.max_token
        claims = self.workers * self.attempts_per_worker + self.operator_commands + int(self.start_completed)
        return 2 * (claims + self.faults) + 3


def under_way(row: Row) -> tuple[int, int]:
    """(r, s): the revision a claim of this row publishes and the one it supersedes."""
    return (row.request, row.current_rev) if row.request else (1, 0)


def place_objects(place: tuple[int, int]) -> tuple[tuple, tuple]:
    rev, tok = place
    return (rev, tok, DATA), (rev, tok, MANIFEST)


def intact(dest: Dest, place: tuple[int, int] | None) -> bool:
    """The place holds its manifest and data (the model's places are written by one party: their content is right)."""
    if place is None:
        return False
    data, manifest = place_objects(place)
    return data in dest.objects and manifest in dest.objects


def places_of(dest: Dest) -> list[tuple[int, int]]:
    return sorted({(rev, tok) for rev, tok, _ in dest.objects})


def initial_state(bounds: Bounds) -> State:
    """Every key never claimed (no contract recorded), or with ``start_completed`` completed at revision 1 under
    contract 1 (when contracts are modelled), at that contract's destination."""
    rows, ghosts = [], []
    dests = [Dest()] * (bounds.destinations * bounds.keys)
    in_force = 1 if bounds.contracts and bounds.start_completed else bounds.in_force
    home = bounds.home(in_force)
    for k in range(bounds.keys):
        if bounds.start_completed:
            place = (1, 1)
            rows.append(Row(COMPLETED, 1, None, 0, 1, place, 0, 1, in_force, home))
            dests[home * bounds.keys + k] = Dest(Pointer(1, 1, 1, place), frozenset(place_objects(place)))
            ghosts.append(Ghost(frozenset({1}), frozenset({place + (home,)}), 1))
        else:
            rows.append(Row())
            ghosts.append(Ghost())
    workers = tuple(Party(left=(bounds.attempts_per_worker,) * bounds.keys) for _ in bounds.worker_offsets)
    window = 0 if bounds.start_completed else bounds.window
    return State(
        window,
        tuple(rows),
        tuple(dests),
        tuple(ghosts),
        workers,
        Party(),
        Party(),
        bounds.faults,
        bounds.operator_commands,
        in_force,
    )


def _set(items: tuple, index: int, value) -> tuple:
    return items[:index] + (value,) + items[index + 1 :]


REC, OP = "rec", "op"


@dataclass
class Protocol:
    """The transition relation for one choice of bounds and guards."""

    bounds: Bounds
    guards: Guards = field(default_factory=Guards)
    bound_hits: int = 0

    def __post_init__(self) -> None:
        self.max_token = self.bounds.token_bound()
        self.keys = range(self.bounds.keys)
        # Workers are interchangeable when no decision reads their clocks (the protocol as documented) or when
        # their clocks agree: a state and its copy with workers renamed are explored once.
        # Workers whose code names different contracts are never interchangeable.
        offsets = set(self.bounds.worker_offsets)
        codes = {self.bounds.code(i) for i in range(self.bounds.workers)}
        self.symmetric = (self.guards.judge_time_by_ledger_clock or len(offsets) == 1) and len(codes) == 1

    def canonical(self, s: State) -> State:
        """``s`` with its workers sorted (and the lease owners in the ledger renamed to match)."""
        if not self.symmetric or len(s.workers) < 2:
            return s
        names = [f"w{i}" for i in range(len(s.workers))]
        order = sorted(
            range(len(s.workers)), key=lambda i: (s.workers[i], tuple(row.owner == names[i] for row in s.rows))
        )
        if order == sorted(order):
            return s
        renamed = {names[old]: names[new] for new, old in enumerate(order)}
        rows = tuple(row._replace(owner=renamed[row.owner]) if row.owner in renamed else row for row in s.rows)
        return s._replace(workers=tuple(s.workers[i] for i in order), rows=rows)

    # -- helpers -------------------------------------------------------------------------------------------------

    def offset(self, who: str) -> int:
        """The party's clock offset, as a claim or hold would use it: 0 (the ledger's clock) under the guard."""
        if self.guards.judge_time_by_ledger_clock:
            return 0
        if who == REC:
            return self.bounds.reconciler_offset
        if who == OP:
            return self.bounds.operator_offset
        return self.bounds.worker_offsets[int(who[1:])]

    @staticmethod
    def party(s: State, who: str) -> Party:
        if who == REC:
            return s.recon
        if who == OP:
            return s.oper
        return s.workers[int(who[1:])]

    @staticmethod
    def with_party(s: State, who: str, p: Party) -> State:
        if who == REC:
            return s._replace(recon=p)
        if who == OP:
            return s._replace(oper=p)
        return s._replace(workers=_set(s.workers, int(who[1:]), p))

    @staticmethod
    def with_row(s: State, k: int, row: Row) -> State:
        return s._replace(rows=_set(s.rows, k, row))

    def slot(self, p: Party) -> int:
        """Where the party's key's folder is in ``State.dests``: at the destination the party acts at."""
        return p.at * self.bounds.keys + p.key

    def dest(self, s: State, p: Party) -> Dest:
        return s.dests[self.slot(p)]

    def with_dest(self, s: State, p: Party, dest: Dest) -> State:
        return s._replace(dests=_set(s.dests, self.slot(p), dest))

    def where(self, p: Party) -> str:
        """The party's key, and its destination when there are several (for the trace)."""
        return f"key{p.key}" + ("@" + "AB"[p.at] if self.bounds.destinations > 1 else "")

    @staticmethod
    def with_ghost(s: State, k: int, ghost: Ghost) -> State:
        return s._replace(ghosts=_set(s.ghosts, k, ghost))

    def idle(self, s: State, who: str) -> State:
        """The party ends what it was doing (a worker keeps its attempts left)."""
        return self.with_party(s, who, Party(left=self.party(s, who).left))

    def write_pointer(self, s: State, p: Party, new: Pointer, *, may_go_back: bool = False) -> tuple[State, str | None]:
        """Stores ``new`` as the pointer of the party's key at its destination (a fresh version tag) and checks the
        pointer's transition invariants. The highest fence is the key's, at any destination (tokens are the key's)."""
        k = p.key
        dest, ghost = self.dest(s, p), s.ghosts[k]
        new = new._replace(ver=1)  # present; with every read-and-swap folded into one move, tags need no history
        violation = None
        if new.rev < dest.ptr.rev and not may_go_back:
            violation = "pointer_revision_never_decreases"
        s = self.with_dest(s, p, dest._replace(ptr=new))
        return self.with_ghost(s, k, ghost._replace(max_fence=max(ghost.max_fence, new.fence))), violation

    def finish(
        self, s: State, who: str, to: str, *, place=None, rev: int = 0, at: int | None = None
    ) -> tuple[State, str | None]:
        """A finishing ledger move of the party's key, guarded by state, token and owner (see the guard); refused
        silently (a ``fenced`` attempt row) when the guard does not hold. Then the party is idle. A completion
        records ``place`` at the party's destination (``at``: at another, the place recorded before)."""
        p = self.party(s, who)
        k = p.key
        row = s.rows[k]
        if p.prev and not self.guards.reconcile_holds_before_judging and who == REC:
            allowed = row.state == p.prev and row.token == p.token  # a look without a hold: guarded by what it read
        elif self.guards.finish_guarded_by_token_and_owner:
            allowed = row.state == IN_PROGRESS and row.token == p.token and row.owner == who
        else:
            allowed = row.state == IN_PROGRESS
        violation = None
        if allowed:
            if to == COMPLETED:
                if row.token != p.token:
                    violation = "no_completion_from_a_fenced_token"
                row = row._replace(
                    state=COMPLETED,
                    owner=None,
                    lease=0,
                    current_rev=rev,
                    current_place=place,
                    request=0,
                    at=p.at if at is None else at,
                )
                ghost = s.ghosts[k]
                s = self.with_ghost(s, k, ghost._replace(recorded=ghost.recorded | {place + (row.at,)}))
            else:
                row = row._replace(state=to, owner=None, lease=0)
            s = self.with_row(s, k, row)
        return self.idle(s, who), violation

    def release(self, s: State, who: str) -> tuple[State, str | None]:
        """An operator gives the key back to the state it was in (a held in_progress key becomes remote_unknown)."""
        p = self.party(s, who)
        back = REMOTE_UNKNOWN if p.prev == IN_PROGRESS else p.prev
        return self.finish(s, who, back)

    def error_state(self, p: Party) -> str:
        """What an attempt's error before its commit request records (docs, step 2 and the end of the steps)."""
        if p.fenced_pred or not self.guards.error_before_fence_is_remote_unknown:
            return FAILED
        return REMOTE_UNKNOWN

    def fault(self, s: State) -> State:
        return s._replace(faults=s.faults - 1)

    # -- the relation --------------------------------------------------------------------------------------------

    def successors(self, s: State) -> list[Move]:
        out: list[Move] = []
        self.tick(s, out)
        for i in range(len(s.workers)):
            self.worker(s, f"w{i}", out)
        if self.bounds.reconciler:
            self.reconciler(s, out)
        self.operator(s, out)
        return out

    def tick(self, s: State, out: list[Move]) -> None:
        if s.window == 0 and not any(row.lease for row in s.rows):
            return
        rows = tuple(row._replace(lease=row.lease - 1) if row.lease else row for row in s.rows)
        out.append(Move("tick", STEP, s._replace(window=max(0, s.window - 1), rows=rows)))

    # -- a worker: one attempt after another ----------------------------------------------------------------------

    def worker(self, s: State, who: str, out: list[Move]) -> None:
        p = self.party(s, who)
        if p.pc == IDLE:
            for k in self.keys:
                if p.left[k]:
                    self.claim(s, who, k, out)
            return
        if s.faults:
            out.append(Move(f"{who} crashes at {p.pc}", FAULT, self.idle(self.fault(s), who)))
        getattr(self, "w_" + p.pc)(s, who, p, out)

    def claim(self, s: State, who: str, k: int, out: list[Move]) -> None:
        """Step 1, one ledger transaction on the ledger's clock."""
        g, row, off = self.guards, s.rows[k], self.offset(who)
        if g.refuse_claim_before_window_end and s.window > off:
            return  # refused: the window has not ended
        violation = "no_claim_before_window_end" if s.window > 0 else None
        fenced_pred = True
        if row.state == COMPLETED and not row.request:
            return  # already completed: skipped
        if row.state == CONFLICT or (row.state == REMOTE_UNKNOWN and g.claim_refuses_remote_unknown):
            return
        if row.state == IN_PROGRESS:
            if row.lease > off:
                return  # a live lease: refused
            if row.lease > 0:
                violation = violation or "no_takeover_of_a_live_lease"
            fenced_pred = False
        token = row.token + 1
        if token > self.max_token:
            self.bound_hits += 1
            return
        left = self.party(s, who).left
        left = _set(left, k, left[k] - 1)
        code = self.bounds.code(int(who[1:]))
        in_force = s.in_force or code  # the first claim records its own contract
        if code:
            refusal = self.contract_refusal(row, code, in_force)
            if refusal:
                # A refused run: it spends one of the automatic reruns and changes nothing else (the refusal is
                # escalated once the reruns are spent).
                idle = self.with_party(s, who, Party(left=left))
                out.append(Move(f"{who}'s claim of key{k} is refused: {refusal}", STEP, idle))
                return
            if code != in_force:
                violation = violation or "claim_under_the_contract_in_force"
        r, sup = under_way(row)
        row = row._replace(
            state=IN_PROGRESS, token=token, owner=who, lease=self.bounds.ttl, rev_high=max(row.rev_high, r),
            contract=in_force,
        )  # fmt: skip
        s2 = self.with_row(s, k, row)._replace(in_force=in_force)
        if r == 1 and token == 1:
            ghost = s.ghosts[k]
            s2 = self.with_ghost(s2, k, ghost._replace(issued=ghost.issued | {1}))
        pc = FENCE_READ if token > 1 and g.fence_before_publishing else PROBE
        p = Party(pc, k, token, r, sup, None, fenced_pred, left=left, at=self.bounds.home(code))
        label = f"{who} claims {self.where(p)} (t{token}, r{r}, s{sup}" + (f", c{code})" if code else ")")
        out.append(Move(label, STEP, self.with_party(s2, who, p), violation))

    def contract_refusal(self, row: Row, code: int, in_force: int) -> str:
        """Why a claim under contract ``code`` is refused ("": it is not), in the claim's transaction: its contract
        is not the one in force (``ContractChanged``); or it would carry the key from the destination its contract
        records, where an earlier attempt may have written (a takeover, a restatement or the retry of a failed one),
        over to another (``DestinationMoved``)."""
        g, home = self.guards, self.bounds.home
        if code != in_force and g.claim_checks_contract:
            return f"its contract c{code} is not the one in force (c{in_force})"
        carries = row.state == IN_PROGRESS or (row.request and row.state in (COMPLETED, FAILED))
        # The code compares destinations only for a key claimed under a contract that is no longer in force.
        stale = row.contract and row.contract != in_force
        if carries and stale and home(row.contract) != home(code) and g.claim_refuses_moved_key:
            was, now = "AB"[home(row.contract)], "AB"[home(code)]
            return f"its contract c{row.contract} publishes at {was}, this one at {now}"
        return ""

    def attempt_error(
        self,
        s: State,
        who: str,
        p: Party,
        out: list[Move],
        what: str,
        effect: State | None = None,
        to: str | None = None,
    ):
        """An error before the commit request (a source failure, a store call refused): recorded by the attempt.
        ``effect``: the state with the call's effect (a call that succeeded but reported an error)."""
        if not s.faults:
            return
        to = to or self.error_state(p)
        if effect is not None:
            s2, v = self.finish(self.fault(effect), who, to)
            out.append(Move(f"{who} {what} lands but reports an error; records {to}", FAULT, s2, v))
        s2, v = self.finish(self.fault(s), who, to)
        out.append(Move(f"{who} {what} fails; records {to}", FAULT, s2, v))

    def read_then(self, s: State, who: str, p: Party, out: list[Move], write_pc: str, label: str, write) -> None:
        """A pointer read, then a write decided from it. Under compare-and-swap the two are one move: the swap
        succeeds only if nothing wrote the pointer since the read, which is the read and write at one instant (a
        lost swap reads again). Without it (the mutation), the read's value is written blindly later: two moves."""
        q = p._replace(pc=write_pc, seen=self.dest(s, p).ptr)
        s2 = self.with_party(s, who, q)
        if self.guards.pointer_compare_and_swap:
            write(s2, who, q, out)
        else:
            out.append(Move(f"{who} reads {self.where(p)}'s pointer {label}", STEP, s2))

    def w_fence_read(self, s, who, p, out):
        self.read_then(s, who, p, out, FENCE_WRITE, "to fence", self.w_fence_write)
        self.attempt_error(s, who, p, out, "pointer read")

    def fence_write(self, s: State, who: str, p: Party, out: list[Move], next_pc: str, on_fenced, on_unknown):
        """``fence(t)``: raise the fence to t, keeping what the pointer names (shared by every party)."""
        seen, t = p.seen, p.token
        dest = self.dest(s, p)
        if seen.fence > t:
            s2, v = on_fenced(s)
            out.append(Move(f"{who} is fenced at {self.where(p)} (fence {seen.fence} > t{t})", STEP, s2, v))
            return
        if seen.fence == t and seen.ver:
            out.append(
                Move(
                    f"{who} finds {self.where(p)} already fenced at t{t}",
                    STEP,
                    self.with_party(s, who, p._replace(pc=next_pc, fenced_pred=True)),
                )
            )
            return
        if self.guards.pointer_compare_and_swap and dest.ptr.ver != seen.ver:
            out.append(
                Move(
                    f"{who}'s fence of {self.where(p)} loses the compare-and-swap; reads again",
                    STEP,
                    self.with_party(s, who, p._replace(pc=FENCE_READ)),
                )
            )
            return
        s2, v = self.write_pointer(s, p, seen._replace(fence=t))
        fenced = self.dest(s2, p).ptr
        out.append(
            Move(
                f"{who} fences {self.where(p)} at t{t}",
                STEP,
                self.with_party(s2, who, p._replace(pc=next_pc, seen=fenced, fenced_pred=True)),
                v,
            )
        )
        if s.faults:
            s3, v3 = on_unknown(self.fault(self.with_party(s2, who, p._replace(seen=fenced))))
            out.append(Move(f"{who}'s fence of {self.where(p)} lands, outcome unknown", FAULT, s3, v or v3))
            s4, v4 = on_unknown(self.fault(s))
            out.append(Move(f"{who}'s fence of {self.where(p)} is lost, outcome unknown", FAULT, s4, v4))

    def w_fence_write(self, s, who, p, out):
        self.fence_write(
            s,
            who,
            p,
            out,
            PROBE,
            on_fenced=lambda st: self.finish(st, who, CONFLICT),  # refused unless the ledger still holds t
            on_unknown=lambda st: self.finish(st, who, REMOTE_UNKNOWN),
        )
        if s.faults:
            to = self.error_state(p)
            s2, v = self.finish(self.fault(s), who, to)
            out.append(Move(f"{who}'s fence of {self.where(p)} is refused by the store; records {to}", FAULT, s2, v))

    def w_probe(self, s, who, p, out):
        dest = self.dest(s, p)
        ptr = p.seen if p.seen is not None else dest.ptr
        if ptr.rev == p.rev:
            if intact(dest, ptr.place):
                nxt = p._replace(pc=RECORD, found=ptr.place, verdict="repaired", seen=ptr)
                out.append(
                    Move(
                        f"{who} probes {self.where(p)}: r{p.rev} already committed at {fmt(ptr.place)}",
                        STEP,
                        self.with_party(s, who, nxt),
                    )
                )
            else:
                s2, v = self.finish(s, who, CONFLICT)
                out.append(Move(f"{who} probes {self.where(p)}: r{p.rev} named but not intact; conflict", STEP, s2, v))
        elif ptr.rev == p.sup:
            pc = SWEEP if p.token > 1 else STAGE_DATA
            out.append(
                Move(
                    f"{who} probes {self.where(p)}: pointer at s{p.sup}",
                    STEP,
                    self.with_party(s, who, p._replace(pc=pc, seen=ptr)),
                )
            )
        else:
            s2, v = self.finish(s, who, CONFLICT)
            out.append(Move(f"{who} probes {self.where(p)}: pointer at r{ptr.rev}; conflict", STEP, s2, v))
        if p.seen is not None and p.seen.rev != p.sup and self.guards.probe_error_past_s_is_remote_unknown:
            # The pointer names something else than s and could not be verified: what readers see is not known to
            # be nothing, so this is not `failed` (the code's rule; the docs' "an error before step 7 records
            # failed" misses it).
            self.attempt_error(s, who, p, out, "verify of the named place", to=REMOTE_UNKNOWN)
        else:
            self.attempt_error(s, who, p, out, "probe (verify or source read)")

    def doomed_by_sweep(self, dest: Dest, t: int, seen: Pointer) -> list[tuple[int, int]]:
        g = self.guards
        doomed = []
        for place in places_of(dest):
            rev, tok = place
            if tok == t:
                continue
            if g.sweep_only_below_own_token and tok > t:
                continue
            if g.sweep_only_unreferenced_places and not (rev > seen.rev or (rev == seen.rev and place != seen.place)):
                continue
            doomed.append(place)
        return doomed

    def delete_place(self, s: State, p: Party, place) -> State:
        dest = self.dest(s, p)
        return self.with_dest(s, p, dest._replace(objects=dest.objects - set(place_objects(place))))

    def w_sweep(self, s, who, p, out):
        doomed = self.doomed_by_sweep(self.dest(s, p), p.token, p.seen)
        if doomed:
            s2 = self.delete_place(s, p, doomed[0])
            out.append(Move(f"{who} sweeps {fmt(doomed[0])} of {self.where(p)}", STEP, s2))
            self.attempt_error(s, who, p, out, f"delete of {fmt(doomed[0])}", effect=s2)
        else:
            out.append(
                Move(
                    f"{who} finishes its sweep of {self.where(p)}",
                    STEP,
                    self.with_party(s, who, p._replace(pc=STAGE_DATA)),
                )
            )
            self.attempt_error(s, who, p, out, "listing")

    def stage(self, s, who, p, out, kind: str, next_pc: str):
        dest = self.dest(s, p)
        obj = (p.rev, p.token, kind)
        if obj in dest.objects:  # put_if_absent refused: a place is written by one party only
            s2, v = self.finish(s, who, self.error_state(p))
            out.append(Move(f"{who}'s put_if_absent of {kind} is refused", STEP, s2, v))
            return
        s2 = self.with_dest(s, p, dest._replace(objects=dest.objects | {obj}))
        out.append(
            Move(
                f"{who} stages {kind} of {fmt((p.rev, p.token))} at {self.where(p)}",
                STEP,
                self.with_party(s2, who, p._replace(pc=next_pc)),
            )
        )
        self.attempt_error(s, who, p, out, f"put of {kind}", effect=s2)

    def w_stage_data(self, s, who, p, out):
        self.stage(s, who, p, out, DATA, STAGE_MANIFEST)

    def w_stage_manifest(self, s, who, p, out):
        self.stage(s, who, p, out, MANIFEST, COMMIT_READ)

    def w_commit_read(self, s, who, p, out):
        self.read_then(s, who, p, out, COMMIT_WRITE, "to commit", self.w_commit_write)
        self.attempt_error(s, who, p, out, "pointer read")

    def w_commit_write(self, s, who, p, out):
        """Step 7: ``commit(t, place)``, the one step that changes what readers see."""
        g, k, seen, t = self.guards, p.key, p.seen, p.token
        dest, mine = self.dest(s, p), (p.rev, p.token)
        if seen.place == mine:
            out.append(
                Move(
                    f"{who} finds its commit of {self.where(p)} landed",
                    STEP,
                    self.with_party(s, who, p._replace(pc=RECORD, found=mine, verdict=COMPLETED)),
                )
            )
            return
        if g.commit_checks_fence and seen.fence > t:
            s2, v = self.finish(s, who, CONFLICT)
            out.append(Move(f"{who}'s commit of {self.where(p)} is fenced (fence {seen.fence} > t{t})", STEP, s2, v))
            return
        if g.commit_checks_superseded and seen.rev != p.sup:
            s2, v = self.finish(s, who, CONFLICT)
            out.append(
                Move(f"{who}'s commit of {self.where(p)} finds r{seen.rev}, not s{p.sup}: conflict", STEP, s2, v)
            )
            return
        if g.pointer_compare_and_swap and dest.ptr.ver != seen.ver:
            out.append(
                Move(
                    f"{who}'s commit of {self.where(p)} loses the compare-and-swap; reads again",
                    STEP,
                    self.with_party(s, who, p._replace(pc=COMMIT_READ)),
                )
            )
            return
        s2, v = self.write_pointer(s, p, Pointer(0, t, p.rev, mine))
        if t < s.ghosts[k].max_fence:
            v = v or "no_stale_token_visible"
        out.append(
            Move(
                f"{who} commits {fmt(mine)} at {self.where(p)}",
                STEP,
                self.with_party(s2, who, p._replace(pc=RECORD, found=mine, verdict=COMPLETED)),
                v,
            )
        )
        if s.faults:
            s3, v3 = self.finish(self.fault(s2), who, REMOTE_UNKNOWN)
            out.append(
                Move(
                    f"{who}'s commit of {self.where(p)} lands, outcome unknown; records remote_unknown",
                    FAULT,
                    s3,
                    v or v3,
                )
            )
            s4, v4 = self.finish(self.fault(s), who, REMOTE_UNKNOWN)
            out.append(
                Move(
                    f"{who}'s commit of {self.where(p)} is lost, outcome unknown; records remote_unknown", FAULT, s4, v4
                )
            )

    def w_record(self, s, who, p, out):
        s2, v = self.finish(s, who, COMPLETED, place=p.found, rev=p.rev)
        out.append(Move(f"{who} records {self.where(p)} completed at {fmt(p.found)} ({p.verdict})", STEP, s2, v))

    # -- the reconciler ------------------------------------------------------------------------------------------

    def reconciler(self, s: State, out: list[Move]) -> None:
        p, g = s.recon, self.guards
        if p.pc == IDLE:
            off = self.offset(REC)
            for k in self.keys:
                row = s.rows[k]
                stuck = row.state == REMOTE_UNKNOWN or (row.state == IN_PROGRESS and row.lease <= off)
                if not stuck:
                    continue
                r, sup = under_way(row)
                if not g.reconcile_holds_before_judging:
                    q = Party(JUDGE, k, row.token, r, sup, prev=row.state, at=self.bounds.home(row.contract))
                    out.append(Move(f"rec looks at stuck key{k} without holding it", STEP, self.with_party(s, REC, q)))
                    continue
                violation = "no_takeover_of_a_live_lease" if row.state == IN_PROGRESS and row.lease > 0 else None
                token = row.token + 1
                if token > self.max_token:
                    self.bound_hits += 1
                    continue
                held = row._replace(state=IN_PROGRESS, token=token, owner=REC, lease=self.bounds.ttl)
                pc = FENCE_READ if g.reconcile_fences_before_judging else JUDGE
                q = Party(pc, k, token, r, sup, prev=row.state, at=self.bounds.home(row.contract))
                out.append(
                    Move(
                        f"rec holds stuck key{k} (t{token})",
                        STEP,
                        self.with_party(self.with_row(s, k, held), REC, q),
                        violation,
                    )
                )
            return
        if s.faults:
            out.append(Move(f"rec crashes at {p.pc}", FAULT, self.idle(self.fault(s), REC)))
        k = p.key
        if p.pc == FENCE_READ:
            self.read_then(s, REC, p, out, FENCE_WRITE, "to fence", self.rec_fence_write)
        elif p.pc == FENCE_WRITE:
            self.rec_fence_write(s, REC, p, out)
        elif p.pc == JUDGE:
            dest = self.dest(s, p)
            ptr = p.seen if p.seen is not None else dest.ptr
            if ptr.rev == p.rev and intact(dest, ptr.place):
                q, what = p._replace(pc=RECORD, verdict=COMPLETED, found=ptr.place), f"r{p.rev} at {fmt(ptr.place)}"
            elif ptr.rev == p.sup:
                q, what = p._replace(pc=RECORD, verdict=FAILED), f"s{p.sup}: nothing of r{p.rev} visible"
            else:
                q, what = p._replace(pc=RECORD, verdict=CONFLICT), f"r{ptr.rev}, neither r{p.rev} nor s{p.sup}"
            out.append(Move(f"rec judges {self.where(p)}: pointer names {what}", STEP, self.with_party(s, REC, q)))
            if s.faults:
                out.append(
                    Move(
                        f"rec cannot reach {self.where(p)}'s destination",
                        FAULT,
                        self.with_party(self.fault(s), REC, p._replace(pc=RECORD, verdict=REMOTE_UNKNOWN)),
                    )
                )
        elif p.pc == RECORD:
            s2, v = self.finish(s, REC, p.verdict, place=p.found, rev=p.rev)
            out.append(Move(f"rec records {self.where(p)} {p.verdict}", STEP, s2, v))

    def rec_fence_write(self, s, who, p, out):
        self.fence_write(
            s,
            REC,
            p,
            out,
            JUDGE,
            on_fenced=lambda st: (self.with_party(st, REC, p._replace(pc=RECORD, verdict=CONFLICT)), None),
            on_unknown=lambda st: (
                self.with_party(st, REC, st.recon._replace(pc=RECORD, verdict=REMOTE_UNKNOWN)),
                None,
            ),
        )

    # -- the operator --------------------------------------------------------------------------------------------

    def operator(self, s: State, out: list[Move]) -> None:
        p, g = s.oper, self.guards
        if p.pc == IDLE:
            if s.ops:
                for k in self.keys:
                    for command in self.bounds.commands:
                        getattr(self, "op_" + command)(s, k, out)
            return
        if s.faults:
            out.append(Move(f"op crashes at {p.pc}", FAULT, self.idle(self.fault(s), OP)))
        k = p.key
        dest = self.dest(s, p)
        if p.pc == ACCEPT_RECORD:
            s2 = self.idle(s._replace(in_force=p.contract), OP)
            out.append(Move(f"op records c{p.contract} as the contract in force", STEP, s2))
        elif p.pc == FENCE_READ:
            self.read_then(s, OP, p, out, FENCE_WRITE, "to fence", self.op_fence_write)
        elif p.pc == FENCE_WRITE:
            self.op_fence_write(s, OP, p, out)
        elif p.pc == JUDGE:
            ptr = p.seen
            if p.verdict == "accept":
                if ptr.rev == p.rev and intact(dest, ptr.place):
                    q = p._replace(pc=RECORD, found=ptr.place)
                    out.append(
                        Move(
                            f"op accepts {self.where(p)}'s r{p.rev} at {fmt(ptr.place)}",
                            STEP,
                            self.with_party(s, OP, q),
                        )
                    )
                else:
                    s2, v = self.release(s, OP)
                    out.append(Move(f"op refuses to accept {self.where(p)} (pointer at r{ptr.rev})", STEP, s2, v))
            else:  # withdraw of a failed restatement
                names_s = ptr.rev == p.sup and ptr.place == p.found  # found: the recorded place, read at the hold
                if names_s or not g.withdraw_checks_pointer:
                    q = p._replace(pc=RECORD)
                    out.append(
                        Move(
                            f"op withdraws {self.where(p)}'s r{p.rev} (pointer at r{ptr.rev})",
                            STEP,
                            self.with_party(s, OP, q),
                        )
                    )
                else:
                    s2, v = self.release(s, OP)
                    out.append(Move(f"op refuses to withdraw {self.where(p)}: pointer names r{ptr.rev}", STEP, s2, v))
        elif p.pc == SETBACK_READ:
            self.read_then(s, OP, p, out, SETBACK_WRITE, "to set it back", self.setback_write)
        elif p.pc == SETBACK_WRITE:
            self.setback_write(s, OP, p, out)
        elif p.pc == DELETE:
            self.discard_delete(s, p, out)
        elif p.pc == RECORD:
            if p.verdict == "discard":
                s2, v = self.finish(s, OP, FAILED)
                out.append(Move(f"op records {self.where(p)} failed (discarded)", STEP, s2, v))
            elif p.verdict == "accept":
                s2, v = self.finish(s, OP, COMPLETED, place=p.found, rev=p.rev)
                out.append(Move(f"op records {self.where(p)} completed at {fmt(p.found)}", STEP, s2, v))
            else:
                s2, v = self.finish(s, OP, COMPLETED, place=p.found, rev=p.sup, at=s.rows[k].at)
                out.append(Move(f"op records {self.where(p)} completed again at s{p.sup}", STEP, s2, v))

    def op_fence_write(self, s, who, p, out):
        after = SETBACK_READ if p.verdict == "discard" else JUDGE
        self.fence_write(
            s, OP, p, out, after, on_fenced=lambda st: self.release(st, OP), on_unknown=lambda st: self.release(st, OP)
        )

    def op_restate(self, s: State, k: int, out: list[Move]) -> None:
        row, ghost = s.rows[k], s.ghosts[k]
        if row.state != COMPLETED or row.request:
            return
        rev = (row.rev_high if self.guards.never_reuse_revision_numbers else row.current_rev) + 1
        violation = "revision_numbers_unique" if rev in ghost.issued else None
        s2 = self.with_row(s, k, row._replace(request=rev, rev_high=max(row.rev_high, rev)))
        s2 = self.with_ghost(s2, k, ghost._replace(issued=ghost.issued | {rev}))
        out.append(Move(f"op requests restatement r{rev} of key{k}", COMMAND, s2._replace(ops=s.ops - 1), violation))

    def hold(self, s: State, k: int, command: str, out: list[Move], states: tuple[str, ...]) -> None:
        """An operator's hold: a new token, never from a live lease (judged by the ledger's clock)."""
        row = s.rows[k]
        if row.state not in states:
            return
        if row.state == IN_PROGRESS and row.lease > self.offset(OP):
            return
        violation = "no_takeover_of_a_live_lease" if row.state == IN_PROGRESS and row.lease > 0 else None
        token = row.token + 1
        if token > self.max_token:
            self.bound_hits += 1
            return
        r, sup = under_way(row)
        if command == "discard":
            sup = row.current_rev
        held = row._replace(state=IN_PROGRESS, token=token, owner=OP, lease=self.bounds.ttl)
        q = Party(
            FENCE_READ, k, token, r, sup, found=row.current_place, verdict=command, prev=row.state,
            at=self.bounds.home(row.contract),
        )  # fmt: skip
        s2 = self.with_party(self.with_row(s, k, held), OP, q)._replace(ops=s.ops - 1)
        out.append(Move(f"op starts {command} of key{k} (holds t{token})", COMMAND, s2, violation))

    def op_withdraw(self, s: State, k: int, out: list[Move]) -> None:
        row = s.rows[k]
        if not row.request:
            return
        if row.state == COMPLETED:
            s2 = self.with_row(s, k, row._replace(request=0))._replace(ops=s.ops - 1)
            out.append(Move(f"op withdraws key{k}'s unclaimed request r{row.request}", COMMAND, s2))
        elif row.state == FAILED:
            self.hold(s, k, "withdraw", out, (FAILED,))

    def op_discard(self, s: State, k: int, out: list[Move]) -> None:
        self.hold(s, k, "discard", out, (CONFLICT, FAILED, REMOTE_UNKNOWN, IN_PROGRESS))

    def op_accept(self, s: State, k: int, out: list[Move]) -> None:
        self.hold(s, k, "accept", out, (CONFLICT, FAILED, REMOTE_UNKNOWN, IN_PROGRESS))

    def op_accept_contract(self, s: State, k: int, out: list[Move]) -> None:
        """``accept-contract --keep-exported`` for the tenant (every key): another contract becomes the one in force.
        A new destination is refused while a key is in_progress, remote_unknown or conflict, or has an open
        restatement request (the guard). Two moves, its check of the keys and then its record, because on PostgreSQL
        they interleave with claims: a claim that matches the contract in force takes no lock the acceptance waits
        for, and the acceptance reads the keys' states without locking them (READ COMMITTED)."""
        if k or not s.in_force:
            return
        home = self.bounds.home
        for contract in range(1, len(self.bounds.contracts) + 1):
            if contract == s.in_force:
                continue
            moved = home(contract) != home(s.in_force)
            unsettled = any(row.state in (IN_PROGRESS, REMOTE_UNKNOWN, CONFLICT) or row.request for row in s.rows)
            if moved and unsettled and self.guards.accept_checks_settled_keys:
                continue  # refused: ContractChanged, nothing recorded
            q = Party(ACCEPT_RECORD, verdict="accept_contract", contract=contract)
            s2 = self.with_party(s, OP, q)._replace(ops=s.ops - 1)
            out.append(Move(f"op starts accept-contract c{contract} (keys checked)", COMMAND, s2))

    def setback_write(self, s: State, who: str, p: Party, out: list[Move]) -> None:
        """The discard's pointer write: back to the recorded revision s (or nothing), fence t, by compare-and-swap."""
        seen, t = p.seen, p.token
        dest = self.dest(s, p)
        restore = (p.sup, p.found) if p.found is not None else (0, None)
        if seen.fence > t:
            s2, v = self.release(s, OP)
            out.append(Move(f"op's set-back of {self.where(p)} is fenced", STEP, s2, v))
            return
        if (seen.rev, seen.place) == restore and seen.ver:
            out.append(
                Move(
                    f"op finds {self.where(p)}'s pointer already at s{p.sup}",
                    STEP,
                    self.with_party(s, OP, p._replace(pc=DELETE)),
                )
            )
            return
        if self.guards.pointer_compare_and_swap and dest.ptr.ver != seen.ver:
            out.append(
                Move(
                    f"op's set-back of {self.where(p)} loses the compare-and-swap; reads again",
                    STEP,
                    self.with_party(s, OP, p._replace(pc=SETBACK_READ)),
                )
            )
            return
        s2, v = self.write_pointer(s, p, Pointer(0, t, restore[0], restore[1]), may_go_back=True)
        out.append(
            Move(
                f"op sets {self.where(p)}'s pointer back to s{p.sup}",
                STEP,
                self.with_party(s2, OP, p._replace(pc=DELETE)),
                v,
            )
        )
        if s.faults:
            s3, v3 = self.release(self.fault(s2), OP)
            out.append(
                Move(f"op's set-back of {self.where(p)} lands but reports an error; released", FAULT, s3, v or v3)
            )

    def discard_delete(self, s: State, p: Party, out: list[Move]) -> None:
        t = p.token
        dest = self.dest(s, p)
        doomed = []
        for place in places_of(dest):
            rev, tok = place
            if place == p.found:
                continue
            if self.guards.discard_deletes_only_below_its_token and tok >= t:
                continue
            if rev == p.rev or place == p.seen.place:
                doomed.append(place)
        if doomed:
            s2 = self.delete_place(s, p, doomed[0])
            out.append(Move(f"op deletes {fmt(doomed[0])} of {self.where(p)}", STEP, s2))
            if s.faults:
                s3, v3 = self.release(self.fault(s2), OP)
                out.append(Move(f"op's delete of {fmt(doomed[0])} lands but reports an error; released", FAULT, s3, v3))
        elif dest.ptr.fence > t:
            s2, v = self.release(s, OP)
            out.append(Move(f"op finds {self.where(p)} fenced above t{t} after its discard; released", STEP, s2, v))
        else:
            out.append(
                Move(f"op has deleted {self.where(p)}'s r{p.rev}", STEP, self.with_party(s, OP, p._replace(pc=RECORD)))
            )


def fmt(place) -> str:
    return "nothing" if place is None else f"r{place[0]}-t{place[1]}"


# -- invariants ----------------------------------------------------------------------------------------------------

#: Every invariant the explorer checks, by name, with what it says (docs/protocol.md, "Invariants").
INVARIANTS = {
    "one_place_per_recorded_revision": "at most one place of a key is recorded per revision (docs 1)",
    "one_current_revision": "a completed key records one current revision, at one place (docs 2)",
    "ledger_and_pointer_agree": "completed: the pointer names the recorded revision; failed: the recorded s; "
    "in_progress/remote_unknown: s or a place of r; only conflict may hold anything else (docs 3, 6); all at the "
    "destination the key's contract records, and nothing visible at another",
    "revision_numbers_unique": "a request's revision was never given before (docs 4)",
    "pointer_revision_never_decreases": "except an operator's discard (docs 4)",
    "no_stale_token_visible": "no commit with a token below a fence already written succeeds (docs 5)",
    "no_completion_from_a_fenced_token": "a completion is recorded only by the key's current token",
    "nothing_named_is_deleted": "the place the pointer names, and every recorded place, are intact (docs 7)",
    "no_claim_before_window_end": "no key is claimed before its window ends by the ledger's clock (docs 8)",
    "no_takeover_of_a_live_lease": "no claim or hold takes a key whose lease is live by the ledger's clock",
    "liveness": "once faults stop, every key ends completed or escalated (docs 9)",
    "one_destination_per_key": "at most one destination's pointer names a place of a key (one export, not two)",
    "completed_at_its_contracts_destination": "a completed key's recorded place is at the destination its contract "
    "records",
    "claim_under_the_contract_in_force": "no claim succeeds under a contract other than the one in force",
}


def check_state(s: State, contracts: tuple[int, ...] = (), ignore: frozenset[str] = frozenset()) -> str | None:
    """The first state invariant ``s`` breaks, by name, or None (``contracts``: ``Bounds.contracts``; ``ignore``:
    invariants not checked, to see what else a mutation breaks)."""
    for name in _broken(s, contracts):
        if name not in ignore:
            return name
    return None


def _broken(s: State, contracts: tuple[int, ...]):
    """The state invariants ``s`` breaks, by name, in the order they are checked."""
    keys = len(s.rows)
    folders = [s.dests[at * keys : (at + 1) * keys] for at in range(len(s.dests) // keys)]
    for k, (row, ghost) in enumerate(zip(s.rows, s.ghosts, strict=True)):
        dests = [folder[k] for folder in folders]
        for dest in dests:
            if dest.ptr.rev and not intact(dest, dest.ptr.place):
                yield "nothing_named_is_deleted"
        for rev, tok, at in ghost.recorded:
            if not intact(dests[at], (rev, tok)):
                yield "nothing_named_is_deleted"
        if len({place[0] for place in ghost.recorded}) != len(ghost.recorded):
            yield "one_place_per_recorded_revision"
        if row.state == COMPLETED and (
            row.current_rev < 1 or row.current_place is None or row.current_place[0] != row.current_rev
        ):
            yield "one_current_revision"
        visible = [at for at, dest in enumerate(dests) if dest.ptr.place is not None]
        if len(visible) > 1:
            yield "one_destination_per_key"
        home = contracts[row.contract - 1] if row.contract else 0
        if row.state == COMPLETED and row.at != home:
            yield "completed_at_its_contracts_destination"
        ptr = dests[home].ptr
        names_s = ptr.rev == row.current_rev and ptr.place == row.current_place
        if row.state in (COMPLETED, FAILED) and not names_s:
            yield "ledger_and_pointer_agree"
        if row.state in (IN_PROGRESS, REMOTE_UNKNOWN) and not (names_s or ptr.rev == under_way(row)[0]):
            yield "ledger_and_pointer_agree"
        if row.state == NONE and ptr.rev:
            yield "ledger_and_pointer_agree"
        if row.state != CONFLICT and any(at != home for at in visible):
            yield "ledger_and_pointer_agree"  # visible at a destination the key's contract does not record


def settled(s: State) -> bool:
    """Every key is completed (with no request a worker could still pick up) or escalated (conflict, or failed with
    the automatic reruns spent, or never claimed with them spent: every run refused by the contract)."""
    for k, row in enumerate(s.rows):
        reruns_left = any(w.left[k] for w in s.workers)
        if row.state == CONFLICT:
            continue
        if row.state == COMPLETED and not (row.request and reruns_left):
            continue
        if row.state in (FAILED, NONE) and not reruns_left:
            continue
        return False
    return True
