"""The protocol core as values (docs/protocol.md): which failure of a key becomes which finish is one pure function,
a key is a group of one, and a run's outcome is handed back once, as a value."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
from pathlib import Path

import pytest
from builders import ORDERS_SCHEMA as SCHEMA
from builders import corrected_orders as corrected
from builders import hourly_orders as orders
from builders import key_for, open_ledger

from export_ledger import failpoints
from export_ledger.destinations import Destination, LocalDestination
from export_ledger.destinations.base import (
    DestinationConflict,
    DestinationError,
    DestinationUnreachable,
    Fenced,
    PointerMoved,
    PublishOutcomeUnknown,
)
from export_ledger.ledger import ExportState, FencedOut, LeaseHeld, LedgerError, LedgerUnavailable
from export_ledger.protocol import (
    BatchOutcome,
    ExportBatch,
    ExportConflict,
    ExportItem,
    ExportOutcomeUnknown,
    FailureFinish,
    export_batch,
    export_key,
    failure_finish,
    target_for,
)

DAY = dt.date(2026, 3, 2)

# Every kind of failure a key's effect can raise, and the finish it leaves: whatever the predecessor's state for the
# first four, and for the rest ``failed`` only once nothing a predecessor did can still become visible.
EXPECTED = {
    PublishOutcomeUnknown("no answer"): FailureFinish.UNKNOWN,
    FencedOut("lease lost"): FailureFinish.NOTHING,
    Fenced("a newer token", fence=9): FailureFinish.CONFLICT,
    PointerMoved("moved"): FailureFinish.CONFLICT,
    ExportConflict("something else"): FailureFinish.CONFLICT,
    DestinationConflict("something else"): FailureFinish.CONFLICT,
}
UNCERTAIN = [
    LedgerError("another window"),
    DestinationUnreachable("down"),
    DestinationError("refused"),
    ValueError("bad row"),
    OSError("disk"),
]


@pytest.mark.parametrize(("error", "fenced"), list(itertools.product([*EXPECTED, *UNCERTAIN], [True, False])), ids=repr)
def test_which_failure_becomes_which_finish_is_one_pure_function(error: Exception, fenced: bool) -> None:
    if error in EXPECTED:
        assert failure_finish(error, fenced) is EXPECTED[error]
    elif fenced:
        assert failure_finish(error, fenced) is FailureFinish.FAILED, "nothing of anyone is visible: safe to retry"
    else:
        assert failure_finish(error, fenced) is FailureFinish.UNKNOWN_AT_PLACE, (
            "a predecessor not fenced yet may still publish: never `failed`"
        )


def test_a_fenced_destination_leaves_the_key_in_conflict_not_failed(ledger, tmp_path: Path) -> None:
    """The destination refuses this attempt's token (a token the ledger never issued fenced it): the key is
    ``conflict``, for a person, and never ``failed`` (a retry would be refused again)."""
    destination = LocalDestination(str(tmp_path / "exports"))
    key = key_for(DAY)
    export_key(ledger, destination, SCHEMA, ExportItem(key, "p", orders(key)), "run-1/x")
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    # The key's pointer fenced far above any token the ledger issued.
    destination.fence(target_for(key, 2), 99, logical_key=str(key))
    with pytest.raises(Fenced):
        export_key(ledger, destination, SCHEMA, ExportItem(key, "p", corrected(key)), "run-2/x")
    assert ledger.queries.get(str(key)).state is ExportState.CONFLICT


def test_one_key_and_a_batch_of_one_leave_the_same_ledger(clock, tmp_path: Path) -> None:
    """A key is a group of one: exported alone or as a batch's only key, its row and attempts are the same."""
    seen = []
    for how in ("key", "batch"):
        book = open_ledger(f"sqlite:///{tmp_path}/{how}.db", clock=clock, lease_ttl=dt.timedelta(minutes=15))
        destination = LocalDestination(str(tmp_path / how))
        key = key_for(DAY)
        item = ExportItem(key, "p", orders(key))
        if how == "key":
            result = export_key(book, destination, SCHEMA, item, "run-1/x")
        else:
            (result,) = export_batch(book, destination, ExportBatch(SCHEMA, [item]), "run-1/x")
        record = book.queries.get(str(key))
        attempts = [(a.attempt_id, a.outcome) for a in book.queries.attempts(str(key))]
        seen.append((result.status, result.sha256, result.row_count, record.state, record.sha256, attempts))
    assert seen[0] == seen[1]
    assert seen[0][0] == "exported"


def test_a_batch_settles_its_outcome_once_as_a_value(ledger, tmp_path: Path) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = [key_for(DAY, tenant=f"t{i}") for i in range(3)]
    bad = orders(keys[1])
    bad = bad.astype({"total": object})
    bad.loc[0, "total"] = "not a number"
    batch = ExportBatch(SCHEMA, [ExportItem(k, "p", bad if k is keys[1] else orders(k)) for k in keys])
    assert batch.outcome is None and batch.results == () and batch.failures == ()

    with pytest.raises(Exception, match="total"):
        export_batch(ledger, destination, batch, "run-1/x")
    assert isinstance(batch.outcome, BatchOutcome)
    assert [r.logical_key for r in batch.results] == [str(keys[0]), str(keys[2])], "every other key has its result"
    assert [f.logical_key for f in batch.failures] == [str(keys[1])]
    with pytest.raises(dataclasses.FrozenInstanceError):  # what the asset reads is what the run settled
        batch.outcome.results = ()

    with pytest.raises(ValueError, match="exported already"):
        export_batch(ledger, destination, batch, "run-2/x")
    assert [f.logical_key for f in batch.failures] == [str(keys[1])], "the first outcome stands"
    assert all(a.attempt_id == "run-1/x" for a in ledger.queries.attempts(str(keys[1]))), (
        "refused before anything is claimed: the second run did nothing"
    )


def test_a_ledger_lost_mid_group_keeps_the_failures_already_met(ledger, tmp_path: Path) -> None:
    """A lost ledger stops the run at once; the keys that failed before it are still the batch's failures, and
    were logged as they failed."""
    destination = LocalDestination(str(tmp_path / "exports"))
    bad_key, lost_key = key_for(DAY, tenant="t0"), key_for(DAY, tenant="t1")
    bad = orders(bad_key).astype({"total": object})
    bad.loc[0, "total"] = "not a number"

    def ledger_gone():
        raise LedgerUnavailable("the ledger's database went away")

    batch = ExportBatch(SCHEMA, [ExportItem(bad_key, "p", bad), ExportItem(lost_key, "p", ledger_gone)])
    logged = []
    with pytest.raises(LedgerUnavailable):
        export_batch(ledger, destination, batch, "run-1/x", log=lambda level, message: logged.append((level, message)))
    assert [f.logical_key for f in batch.failures] == [str(bad_key)]
    assert [level for level, message in logged if str(bad_key) in message] == ["error"]


class _Neither(LocalDestination):
    takes_effect = "sideways"


def test_a_destination_that_can_neither_publish_nor_write_with_the_record_is_refused_before_any_claim(
    ledger, tmp_path: Path
) -> None:
    key = key_for(DAY)
    with pytest.raises(DestinationError, match="cannot export: takes_effect is 'sideways'"):
        export_key(ledger, _Neither(str(tmp_path / "exports")), SCHEMA, ExportItem(key, "p", orders(key)), "run-1/x")
    assert ledger.queries.get(str(key)) is None, "nothing claimed"


def _never(*args, **kwargs):
    raise AssertionError("a destination of no kind is never asked to take a step")


class _PlainDestination(Destination):
    """A destination of no kind: what every destination answers, and methods named as every step a published kind
    takes, but no base that says how its exports take effect."""

    pointer = fence = sweep = stage = commit = unstage = verify = verify_recorded = read_data = _never

    def location(self, target):
        return f"plain://{'/'.join(target.parts)}"

    def current_revision(self, target):
        return 0

    def key_at(self, target):
        return None


def test_a_plain_destination_subclass_takes_effect_neither_way_and_is_refused_before_any_claim(ledger) -> None:
    """``Destination`` itself claims no kind: a subclass of it alone is refused, naming what it lacks, as one that
    answers a kind the protocol does not know, even when it has methods named as the published kind's steps."""
    key = key_for(DAY)
    assert _PlainDestination().takes_effect is None
    lacks = r"_PlainDestination cannot export: takes_effect is None, .* 'published' \(with pointer, fence"
    with pytest.raises(DestinationError, match=lacks):
        export_key(ledger, _PlainDestination(), SCHEMA, ExportItem(key, "p", orders(key)), "run-1/x")
    assert ledger.queries.get(str(key)) is None, "nothing claimed"


def test_a_failed_sync_after_a_single_keys_publish_leaves_it_remote_unknown(ledger, tmp_path: Path) -> None:
    """A single key passes the group's sync points too: an error there, after its pointer moved, is an unknown
    outcome (its export is visible), never an unrecorded key nor `failed`."""
    destination = LocalDestination(str(tmp_path / "exports"))
    key = key_for(DAY)

    def fail_at(point: str) -> None:
        if point == "before_group_sync":
            raise OSError("the disk went away")

    failpoints.set_hook(fail_at)
    try:
        with pytest.raises(ExportOutcomeUnknown):
            export_key(ledger, destination, SCHEMA, ExportItem(key, "p", orders(key)), "run-1/x")
    finally:
        failpoints.set_hook(None)
    assert ledger.queries.get(str(key)).state is ExportState.REMOTE_UNKNOWN


def test_a_refused_claim_records_nothing_and_is_raised_as_itself(ledger, tmp_path: Path) -> None:
    """A claim the ledger refuses (a live lease held by another attempt) is that key's failure alone: raised as
    itself, in the library's words, with the other keys of its group exported."""
    destination = LocalDestination(str(tmp_path / "exports"))
    held, other = key_for(DAY), key_for(DAY, tenant="other")
    ledger.claims.claim(held, "run-0/x")
    with pytest.raises(LeaseHeld):
        export_key(ledger, destination, SCHEMA, ExportItem(held, "p", orders(held)), "run-1/x")
    batch = ExportBatch(SCHEMA, [ExportItem(k, "p", orders(k)) for k in (held, other)])
    with pytest.raises(LeaseHeld):
        export_batch(ledger, destination, batch, "run-2/x")
    assert [r.logical_key for r in batch.results] == [str(other)]
    assert ledger.queries.get(str(held)).lease_owner == "run-0/x", "the holder keeps the key"
