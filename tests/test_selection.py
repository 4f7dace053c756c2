"""The pure transition selector: which transition a claim or a hold takes, from the key's row, its open request and
the ledger's time. No database: each case builds the row a claiming transaction would have read."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from builders import key_for

from export_ledger.calendar import window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import transitions as T
from export_ledger.ledger.errors import (
    BelowLowWater,
    ConflictRecorded,
    EmptyWindow,
    InvalidTransition,
    LeaseHeld,
    LiveLease,
    NeedsReconciliation,
    WindowNotOver,
)
from export_ledger.ledger.records import ExportRecord, Restatement
from export_ledger.ledger.schema import ExportState
from export_ledger.ledger.selection import Refuse, Skip, select_claim, select_hold

UTC = dt.timezone.utc
KEY = key_for()  # 2026-03-08 in New York: [05:00Z, next day 04:00Z)
AFTER = KEY.window.end_utc + dt.timedelta(hours=5)


def record(state: ExportState, *, lease_expires_at: dt.datetime | None = None, token: int = 1) -> ExportRecord:
    window = KEY.window
    return ExportRecord(
        logical_key=str(KEY), export=KEY.export, tenant=KEY.tenant, business_date=window.business_date,
        timezone=window.timezone, window_start_utc=window.start_utc, window_end_utc=window.end_utc,
        tz_database="test", state=state, location=None, sha256=None, row_count=None, committed_attempt=None,
        lease_owner="run-1/export" if lease_expires_at else None, lease_expires_at=lease_expires_at,
        attempt_started_at=None, fencing_token=token, created_at=AFTER, updated_at=AFTER, claim_count=1,
    )  # fmt: skip


REQUEST = Restatement(
    id=7, logical_key=str(KEY), export=KEY.export, tenant=KEY.tenant, business_date=KEY.window.business_date,
    revision=2, reason="corrected", requested_by="ops", requested_at=AFTER, base_token=1, closed_at=None, outcome=None,
)  # fmt: skip


def test_a_key_without_a_row_takes_the_first_claim_once_its_window_has_ended():
    assert select_claim(None, None, AFTER, key=KEY) is T.CLAIM_FIRST


def test_a_window_that_has_not_ended_by_the_ledgers_clock_is_refused_naming_when_it_ends():
    decision = select_claim(None, None, KEY.window.end_utc - dt.timedelta(seconds=1), key=KEY)
    assert isinstance(decision, Refuse) and isinstance(decision.error, WindowNotOver)
    assert "2026-03-09T04:00:00Z" in str(decision.error), "the refusal says when the window ends"
    assert not decision.recorded, "no row exists for an attempt row to hang on"


def test_a_window_ends_at_its_end_instant_exactly():
    assert select_claim(None, None, KEY.window.end_utc, key=KEY) is T.CLAIM_FIRST


def test_an_existing_row_whose_window_has_not_ended_is_refused_too():
    early = KEY.window.end_utc - dt.timedelta(minutes=1)
    decision = select_claim(record(ExportState.FAILED), None, early, key=KEY)
    assert isinstance(decision, Refuse) and isinstance(decision.error, WindowNotOver)


def test_a_first_claim_below_the_low_water_mark_is_refused_unless_overridden():
    mark = KEY.window.business_date + dt.timedelta(days=1)
    refused = select_claim(None, None, AFTER, key=KEY, low_water=mark)
    assert isinstance(refused, Refuse) and isinstance(refused.error, BelowLowWater)
    assert select_claim(None, None, AFTER, key=KEY, low_water=mark, allow_below_low_water=True) is T.CLAIM_FIRST


def test_a_skipped_calendar_day_has_no_window_to_claim():
    skipped = LogicalKey("invoice_export", "apia", window_for(dt.date(2011, 12, 30), "Pacific/Apia"))
    decision = select_claim(None, None, AFTER, key=skipped)
    assert isinstance(decision, Refuse) and isinstance(decision.error, EmptyWindow)


@pytest.mark.parametrize(
    ("state", "request_", "expected"),
    [
        (ExportState.FAILED, None, T.CLAIM_RETRY),
        (ExportState.COMPLETED, REQUEST, T.RESTATE),
    ],
)
def test_a_claimable_row_takes_its_transition(state, request_, expected):
    assert select_claim(record(state), request_, AFTER, key=KEY) is expected


def test_a_completed_key_without_a_request_is_skipped():
    decision = select_claim(record(ExportState.COMPLETED), None, AFTER, key=KEY)
    assert isinstance(decision, Skip) and decision.record.state is ExportState.COMPLETED


@pytest.mark.parametrize(
    ("state", "error"),
    [(ExportState.CONFLICT, ConflictRecorded), (ExportState.REMOTE_UNKNOWN, NeedsReconciliation)],
)
def test_a_key_waiting_for_a_person_or_for_reconciliation_is_refused_with_a_recorded_row(state, error):
    decision = select_claim(record(state), None, AFTER, key=KEY)
    assert isinstance(decision, Refuse) and isinstance(decision.error, error) and decision.recorded


def test_a_live_lease_is_refused_and_one_that_ended_is_taken_over():
    live = record(ExportState.IN_PROGRESS, lease_expires_at=AFTER + dt.timedelta(seconds=1))
    decision = select_claim(live, None, AFTER, key=KEY)
    assert isinstance(decision, Refuse) and isinstance(decision.error, LeaseHeld)
    ended = record(ExportState.IN_PROGRESS, lease_expires_at=AFTER - dt.timedelta(seconds=1))
    assert select_claim(ended, None, AFTER, key=KEY) is T.TAKE_OVER


def test_a_lease_ending_exactly_now_has_ended_for_claims_and_holds_alike():
    """One lease predicate: at the expiry instant the lease has ended, for the selector and for the SQL guard."""
    at_now = record(ExportState.IN_PROGRESS, lease_expires_at=AFTER)
    assert not T.lease_live(AFTER, AFTER)
    assert select_claim(at_now, None, AFTER, key=KEY) is T.TAKE_OVER
    assert select_hold(at_now, AFTER, operator=False) is T.RECONCILE_HOLD
    assert select_hold(at_now, AFTER, operator=True) is T.OPERATOR_HOLD


def test_holds_never_take_a_live_lease_and_never_a_completed_key():
    live = record(ExportState.IN_PROGRESS, lease_expires_at=AFTER + dt.timedelta(minutes=1))
    assert isinstance(select_hold(live, AFTER, operator=True), LiveLease)
    assert isinstance(select_hold(record(ExportState.COMPLETED), AFTER, operator=True), InvalidTransition)
    assert isinstance(select_hold(record(ExportState.FAILED), AFTER, operator=False), InvalidTransition), (
        "reconciliation holds only stuck keys: remote_unknown, or a lease that ended"
    )
    assert select_hold(record(ExportState.REMOTE_UNKNOWN), AFTER, operator=False) is T.RECONCILE_HOLD
    assert select_hold(record(ExportState.CONFLICT), AFTER, operator=True) is T.OPERATOR_HOLD


def test_every_transition_is_declared_once_with_its_guards():
    names = [(t.name, t.from_states, t.to_state) for t in T.TRANSITIONS]
    assert len(names) == len(set(names)), "no transition is declared twice"
    finishing = {t for t in T.TRANSITIONS if t.owner_guard}
    assert set(T.FINISHING) | {T.RENEW} == finishing, "every owner-guarded move finishes a held key (or renews it)"
    for transition in (T.TAKE_OVER, T.RECONCILE_HOLD, T.OPERATOR_HOLD):
        assert transition.expired_guard, f"{transition.name} must never take a live lease"
    assert T.CLAIM_RETRY.claims == "add" and T.RECONCILE_HOLD.claims == "keep", "only export claims count as reruns"


def test_a_claim_transition_refuses_to_start_from_a_state_it_does_not_declare():
    with pytest.raises(InvalidTransition, match="does not start from"):
        T.apply(None, T.CLAIM_RETRY, "k", token=1, values={}, states=(ExportState.COMPLETED,))


def test_a_refusal_is_a_value_not_an_exception():
    """The selector never raises: a claim transaction records a refusal's attempt row and commits it."""
    decision = select_claim(record(ExportState.CONFLICT), None, AFTER, key=KEY)
    assert dataclasses.is_dataclass(decision) and isinstance(decision, Refuse)
