"""The parties of docs/protocol.md, each advanced one protocol step at a time with the library's own step functions.

An :class:`ExportAttempt` is ``export_key`` taken apart, run by a worker whose code (:class:`~stateful.world.Code`)
says what the export is: claim (``ledger.claims.claim_many``, with the contract its code declares), fence
(``destination.fence``, or a read of the pointer for token 1), probe (``destination.verify``), read and validate
the source, sweep, stage, commit (``destination.commit``) and record (``ledger.completions.complete``). A failure is
recorded the way ``export_key`` records it (``fail``; ``mark_remote_unknown`` for an unknown outcome, and for a
takeover's error before its fence landed; ``mark_conflict``), and a party that lost the key stops.

An attempt publishes at its code's destination. A :class:`Reconciler` is ``reconcile_batch`` for one key taken apart:
find it stuck (``ledger.attention.stuck``), hold (``ledger.claims.hold_many``), fence and judge (``reconcile.examine``)
at the destination the library places the key (its contract's), finish (``ledger.completions.finish_many``).

Each party has a clock offset of its own. It is never given to the library (the ledger's clock is the only clock
the library sees); the parties only use it to say what they *believe* (``believes_live``), so that the machine can
count the steps taken by a party sure of a lease the ledger has already ended, and check those are fenced.
"""

from __future__ import annotations

import datetime as dt

from export_ledger import reconcile
from export_ledger.destinations.base import DestinationConflict, Fenced, PublishOutcomeUnknown, Verdict
from export_ledger.errors import ExportLedgerError, SourceError
from export_ledger.fingerprint import Fingerprint
from export_ledger.frames import Manifest, data_file_name, validate_frame
from export_ledger.keys import LogicalKey
from export_ledger.ledger import Claim, CompletionEvidence, ExportState, FencedOut, LedgerError
from export_ledger.protocol import ExportConflict, target_for
from stateful.world import Code, World, frame_for

CLAIM, FENCE, PROBE, READ, SWEEP, STAGE, COMMIT, RECORD = (
    "claim", "fence", "probe", "read", "sweep", "stage", "commit", "record",
)  # fmt: skip
FIND, HOLD, EXAMINE, FINISH = "find", "hold", "examine", "finish"


class Party:
    """A worker, reconciler: ``step`` advances it by one protocol step; ``done`` once it has stopped."""

    kind = "party"

    def __init__(self, name: str, key: LogicalKey, offset: float) -> None:
        self.name, self.key, self.offset = name, key, offset
        self.claim: Claim | None = None
        self.done = False
        self.outcome: str | None = None
        self.next: str = ""
        self.history: list[str] = []

    def own_now(self, world: World) -> dt.datetime:
        """What this party's own clock says (the ledger's plus its offset). Never passed to the library."""
        return world.clock.now + dt.timedelta(seconds=self.offset)

    def believes_live(self, world: World) -> bool:
        return self.claim is not None and self.own_now(world) < self.claim.lease_expires_at

    def finish(self, outcome: str) -> str:
        self.done, self.outcome = True, outcome
        return outcome

    def __repr__(self) -> str:
        token = self.claim.fencing_token if self.claim else None
        return f"<{self.kind} {self.name} key={self.key.tenant} token={token} next={self.next} done={self.done}>"


class ExportAttempt(Party):
    """``export_key``, one step per call."""

    kind = "attempt"
    #: docs/protocol.md step 2: a takeover's error before its fence lands is ``remote_unknown``. True: ``failed``, as
    #: before that rule (a mutation test's way to show the rule is needed; the library's own is in protocol.py).
    failed_before_fence = False

    def __init__(
        self, name: str, key: LogicalKey, offset: float, *, source_fails: bool, variant: int, code: Code | None = None
    ) -> None:
        super().__init__(name, key, offset)
        self.source_fails, self.variant, self.code = source_fails, variant, code or Code()
        self.contract: dict | None = None
        self.next = CLAIM
        self.pointer = None
        self.table = None
        self.fingerprint: Fingerprint | None = None
        self.staged = None
        self.evidence: CompletionEvidence | None = None
        #: Whether every party that held the key before is fenced (docs/protocol.md step 2): not yet for a takeover
        #: until its own fence lands, so its failure before then is ``remote_unknown``, never ``failed``.
        self.fenced_predecessor = False

    @property
    def target(self):
        return target_for(self.key, self.claim.revision)

    def destination(self, world: World):
        """Where this attempt publishes: its code's destination, whatever the ledger records."""
        return world.destinations[self.code.at]

    def step(self, world: World, observer) -> str:
        """Runs the next step; returns what happened (for the history)."""
        step = self.next
        self.history.append(step)
        if step == CLAIM:
            return self._claim(world, observer)
        if step == RECORD:
            return self._record(world, observer)
        try:
            return getattr(self, f"_{step}")(world, observer)
        except (LedgerError, AssertionError):
            raise  # the ledger is not called in these steps; an assertion is the machine's
        except ExportLedgerError as exc:
            return self._failed(world, observer, exc)

    # -- the steps -------------------------------------------------------------------------------------------

    def _claim(self, world: World, observer) -> str:
        before = world.rows.key(self.key)
        now = world.clock.now
        self.contract = world.contract(self.key, self.code)
        contracts = {(self.key.export, self.key.tenant): self.contract}
        (outcome,) = world.ledger.claims.claim_many([self.key], self.name, contracts=contracts)
        observer.on_claim(self, before, now, outcome)
        if not isinstance(outcome, Claim):
            return self.finish(f"claim refused: {type(outcome).__name__}")
        self.claim = outcome
        self.fenced_predecessor = outcome.previous_state is not ExportState.IN_PROGRESS
        self.next = FENCE
        return f"claimed token {outcome.fencing_token} r{outcome.revision} s{outcome.superseded_revision}"

    def _fence(self, world: World, observer) -> str:
        claim = self.claim
        destination = self.destination(world)
        if claim.fencing_token > 1:
            self.pointer = destination.fence(self.target, claim.fencing_token, logical_key=claim.logical_key)
            self.fenced_predecessor = True
        else:
            self.pointer = destination.pointer(self.target)
        self.next = PROBE
        return f"pointer fence {self.pointer.fence} r{self.pointer.revision}"

    def _probe(self, world: World, observer) -> str:
        claim = self.claim
        verification = self.destination(world).verify(
            self.target, logical_key=claim.logical_key, superseded=claim.superseded_revision, pointer=self.pointer
        )
        if verification.verdict is Verdict.PUBLISHED:
            self.evidence = CompletionEvidence.published(verification.location, verification.manifest)
            self.next = RECORD
            return "found its revision published: repair"
        if verification.verdict is Verdict.CONFLICT:
            raise ExportConflict(f"{claim.logical_key}: {verification.detail}", location=verification.location)
        self.next = READ
        return "absent"

    def _read(self, world: World, observer) -> str:
        if self.source_fails:
            raise SourceError("the source failed (injected)")
        schema = self.code.schema()
        self.fingerprint = Fingerprint(schema.id_columns, schema.version_column)
        self.table = validate_frame(
            frame_for(self.key, self.variant), schema, self.claim.window, self.claim.logical_key, self.key.tenant,
            fingerprint=self.fingerprint,
        )  # fmt: skip
        self.next = SWEEP
        return f"read {self.table.num_rows} rows"

    def _sweep(self, world: World, observer) -> str:
        removed = 0
        if self.claim.fencing_token > 1:
            removed = self.destination(world).sweep(self.target, self.claim.fencing_token, self.pointer)
        self.next = STAGE
        return f"swept {removed}"

    def _stage(self, world: World, observer) -> str:
        claim = self.claim
        template = Manifest.build(
            logical_key=claim.logical_key, export=self.key.export, tenant=self.key.tenant, window=claim.window,
            row_count=0, sha256="", attempt_id=claim.attempt_id, fencing_token=claim.fencing_token,
            data_file=data_file_name(self.code.file_format), tz_database=claim.tz_database, revision=claim.revision,
            supersedes=claim.supersedes,
        )  # fmt: skip
        self.staged = self.destination(world).stage(
            self.target, claim.fencing_token, self.table, self.code.file_format, template
        )
        self.next = COMMIT
        return f"staged {self.staged.target.place}"

    def _commit(self, world: World, observer) -> str:
        claim, staged = self.claim, self.staged
        observer.before_commit(self)
        pointer = self.destination(world).commit(staged, claim.fencing_token, superseded=claim.superseded_revision)
        observer.after_commit(self, pointer)
        self.evidence = CompletionEvidence(
            location=self.destination(world).location(staged.target), sha256=staged.manifest.sha256,
            row_count=staged.manifest.row_count, attempt_id=claim.attempt_id, fencing_token=claim.fencing_token,
            source_fingerprint=self.fingerprint.encode(), revision=claim.revision,
        )  # fmt: skip
        self.next = RECORD
        return f"committed {staged.target.place}"

    def _record(self, world: World, observer) -> str:
        before = observer.before_finish(self)
        try:
            record = world.ledger.completions.complete(self.claim, self.evidence)
        except FencedOut:
            observer.after_finish(self, before, accepted=False)
            observer.on_fenced(self)
            return self.finish("record refused: fenced")
        observer.after_finish(self, before, accepted=True)
        return self.finish(f"recorded {record.state.value}")

    def _failed(self, world: World, observer, exc: ExportLedgerError) -> str:
        """What ``export_key`` records for an error between claim and record."""
        completions, claim = world.ledger.completions, self.claim
        if isinstance(exc, Fenced):
            observer.on_fenced(self)
        before = observer.before_finish(self)
        try:
            if isinstance(exc, PublishOutcomeUnknown):
                completions.mark_remote_unknown(claim, exc, sha256=exc.sha256, location=exc.location)
                what = "remote_unknown"
            elif isinstance(exc, Fenced):
                completions.mark_conflict(claim, exc)
                what = "conflict (fenced by a token the ledger never issued)"
            elif isinstance(exc, DestinationConflict):
                completions.mark_conflict(claim, exc, location=getattr(exc, "location", None))
                what = "conflict"
            elif self.fenced_predecessor or self.failed_before_fence:
                completions.fail(claim, exc)
                what = "failed"
            else:  # a takeover's predecessor may still commit: reconciliation holds, fences and judges the key
                completions.mark_remote_unknown(claim, exc)
                what = "remote_unknown (its predecessor not fenced yet)"
        except FencedOut:
            observer.after_finish(self, before, accepted=False)
            return self.finish(f"{type(exc).__name__} at {self.next}; its record refused: fenced")
        observer.after_finish(self, before, accepted=True)
        return self.finish(f"{type(exc).__name__} at {self.next}: recorded {what}")


class Reconciler(Party):
    """``reconcile_batch`` for one key, one step per call."""

    kind = "reconciler"

    def __init__(self, name: str, key: LogicalKey, offset: float) -> None:
        super().__init__(name, key, offset)
        self.next = FIND
        self.record = None
        self.finding = None

    def step(self, world: World, observer) -> str:
        step = self.next
        self.history.append(step)
        ledger = world.ledger
        if step == FIND:
            found = [r for r in ledger.attention.stuck(limit=10) if r.logical_key == str(self.key)]
            if not found:
                return self.finish("nothing stuck")
            self.record = found[0]
            self.next = HOLD
            return f"found {self.record.state.value} token {self.record.fencing_token}"
        if step == HOLD:
            current = world.rows.key(self.key).run
            now = world.clock.now
            (claim,) = ledger.claims.hold_many([self.record], self.name)
            observer.on_hold(self, self.record, current, now, claim)
            if claim is None:
                return self.finish("changed meanwhile")
            self.claim = claim
            self.next = EXAMINE
            return f"held token {claim.fencing_token}"
        if step == EXAMINE:
            place = world.placed([self.record])[self.record.logical_key]  # where its contract says its export is
            self.finding = reconcile.examine(place, self.record, self.claim)
            self.next = FINISH
            return f"judged {self.finding.verdict.value}"
        before = observer.before_finish(self)
        (outcome,) = ledger.completions.finish_many([reconcile._finish(self.finding, self.claim)])
        observer.after_finish(self, before, accepted=not isinstance(outcome, FencedOut))
        if isinstance(outcome, FencedOut):
            observer.on_fenced(self)
            return self.finish("verdict refused: fenced")
        return self.finish(f"recorded {outcome.state.value}")
