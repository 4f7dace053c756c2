"""A prune and a restatement request of the same export at once (issue #26): they end in one of two consistent states,
whichever order they meet in. Either the request lands and its key is not pruned, or the prune lands and the request
is refused, naming the low-water mark. Never a request whose key was deleted under it (``restate`` then exited 1
"unexpected KeyError" although its request was committed, and the request waited for a publish that could never come).

On PostgreSQL each order is forced by a second connection that holds a lock on a table one side writes next: that
side waits there, in the middle of its transaction, until the test lets it go. SQLite's writers are serialized, so
there the two orders run one after the other.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from builders import evidence_for, key_for, open_ledger

from export_ledger.ledger import ExportLedger, RestatementRefused
from export_ledger.ledger.schema import ExportState

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DAYS = [dt.date(2026, 1, 1) + dt.timedelta(days=offset) for offset in range(6)]  # 2026-01-01 .. 2026-01-06
#: From the clock's 2026-03-20, this many days back is 2026-01-05: a prune deletes 2026-01-01..04, mark 2026-01-05.
TO_JAN_5 = 74
MARK = dt.date(2026, 1, 5)
RESTATED = key_for(dt.date(2026, 1, 3))
#: What a refusal must say: the export's mark, by date.
NAMES_THE_MARK = r"low-water mark of invoice_export \(2026-01-05\)"

#: A second connection's lock on the table a side writes next, by table (one constant statement each).
HOLD = {
    table: sa.text(f"LOCK TABLE {table} IN SHARE MODE")
    for table in ("export_restatements", "export_low_water", "export_attempts")
}


def completed_days(url: str, clock) -> ExportLedger:
    """acme's keys of 2026-01-01..06, each completed, seen from 2026-03-20."""
    ledger = open_ledger(url, clock=clock)
    for day in DAYS:
        claim = ledger.claims.claim(key_for(day), f"run-{day}/invoice_export")
        ledger.completions.complete(claim, evidence_for(claim))
    return ledger


def request(ledger: ExportLedger):
    return ledger.restatements.request(str(RESTATED), reason="late invoices", requested_by="ops")


class Side(threading.Thread):
    """One side of the race on a thread of its own: its result, or what it raised."""

    def __init__(self, work) -> None:
        super().__init__(daemon=True)
        self.work, self.value, self.error = work, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.work()
        except BaseException as exc:  # noqa: BLE001 - handed to the test by outcome()
            self.error = exc

    def outcome(self):
        self.join(timeout=60)
        assert not self.is_alive(), "the side finished once the test let it go"
        if self.error is not None:
            raise self.error
        return self.value


class Race:
    """PostgreSQL sessions named for this test (``application_name``), and the locks that order them."""

    def __init__(self, url: str) -> None:
        self.url, self.tag = url, f"race-{uuid.uuid4().hex[:10]}"
        self.watch = sa.create_engine(url, poolclass=sa.pool.NullPool)

    def url_for(self, side: str) -> str:
        return f"{self.url}&application_name={self.tag}-{side}"

    def waiting(self, side: str) -> bool:
        with self.watch.connect() as conn:
            events = conn.execute(
                sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE application_name = :name"),
                {"name": f"{self.tag}-{side}"},
            ).scalars()
            return "Lock" in list(events)

    def wait_for(self, what: str, condition, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, f"{what} within {seconds} s"
            time.sleep(0.05)

    def until_waiting(self, side: str) -> None:
        self.wait_for(f"the {side} side waits on a lock", lambda: self.waiting(side))

    @contextlib.contextmanager
    def holding(self, table: str):
        """Holds a lock on ``table`` that its writers wait for; yields the function that lets them go."""
        with self.watch.connect() as conn:
            transaction = conn.begin()
            conn.execute(HOLD[table])
            yield transaction.rollback
            if transaction.is_active:
                transaction.rollback()


def restate_console(url: str) -> subprocess.Popen:
    """``export-ledger restate`` as an operator runs it: a process of its own."""
    environ = {k: v for k, v in os.environ.items() if k != "EXPORTS_LEDGER_URL"}
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "export-ledger"), "--ledger-url", url, "restate", str(RESTATED),
         "--reason", "late invoices", "--operator", "ops"],
        cwd=PROJECT_ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finished(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


@pytest.fixture
def race(postgres_url) -> Race:
    race = Race(postgres_url)
    yield race
    race.watch.dispose()


# -- PostgreSQL: each order forced ----------------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_request_in_flight_when_a_prune_starts_lands_and_its_key_is_not_pruned(race, postgres_url, clock):
    ledger = completed_days(postgres_url, clock)
    pruner = open_ledger(race.url_for("prune"), clock=clock)
    with race.holding("export_restatements") as let_the_request_write:
        console = restate_console(race.url_for("restate"))
        race.until_waiting("restate")  # it has read the key (and the mark), and waits to write its request
        prune = Side(lambda: pruner.retention.prune(TO_JAN_5))
        race.until_waiting("prune")
        let_the_request_write()
    code, out, err = finished(console)
    (plan,) = prune.outcome()

    assert "KeyError" not in err and code == 0, f"the request was recorded and said so: {err}"
    assert "revision 2" in out and "requested" in out
    record = ledger.queries.get(str(RESTATED))
    assert record is not None and record.state is ExportState.COMPLETED, "the requested key is not pruned"
    assert ledger.restatements.open_requests([str(RESTATED)])[str(RESTATED)].revision == 2
    assert plan.mark == RESTATED.window.business_date, "the prune planned after the request: the mark stops at it"
    assert ledger.retention.low_water("invoice_export") == RESTATED.window.business_date
    assert [r.business_date for r in ledger.queries.records()] == DAYS[2:], "the dates before it are pruned"


@pytest.mark.postgres
def test_a_request_arriving_while_a_prune_commits_is_refused_naming_the_mark(race, postgres_url, clock):
    ledger = completed_days(postgres_url, clock)
    pruner = open_ledger(race.url_for("prune"), clock=clock)
    with race.holding("export_low_water") as let_the_prune_commit:
        prune = Side(lambda: pruner.retention.prune(TO_JAN_5))
        race.until_waiting("prune")  # it has deleted what it prunes, and waits to raise the mark
        console = restate_console(race.url_for("restate"))
        race.until_waiting("restate")
        let_the_prune_commit()
    (plan,) = prune.outcome()
    code, out, err = finished(console)

    assert plan.mark == MARK and plan.pruned == 4
    assert code == 1 and "KeyError" not in err
    assert "refused" not in out and err.count("\n") == 1, f"one error line: {err}"
    assert "invoice_export/acme/2026-01-03T05:00:00Z" in err and "low-water mark of invoice_export (2026-01-05)" in err
    assert ledger.queries.get(str(RESTATED)) is None
    assert ledger.restatements.requests(logical_keys=[str(RESTATED)], open_only=False) == [], (
        "no request is left behind for a pruned key"
    )


@pytest.mark.postgres
def test_a_request_that_reads_the_key_after_a_prune_planned_is_refused_and_nothing_is_orphaned(
    race, postgres_url, clock
):
    """The widest window: the prune has planned (no request then) and not deleted yet; the request reads the key in
    between and would write its request after the prune deleted it."""
    ledger = completed_days(postgres_url, clock)
    pruner = open_ledger(race.url_for("prune"), clock=clock)
    requester = open_ledger(race.url_for("request"), clock=clock)
    with (
        race.holding("export_attempts") as let_the_prune_delete,
        race.holding("export_restatements") as let_the_request_write,
    ):
        prune = Side(lambda: pruner.retention.prune(TO_JAN_5))
        race.until_waiting("prune")  # planned; waits to delete the attempts of what it prunes
        asked = Side(lambda: request(requester))
        race.until_waiting("request")
        let_the_prune_delete()
        race.wait_for("the prune commits or waits for the key", lambda: not prune.is_alive() or race.waiting("prune"))
        let_the_request_write()
    (plan,) = prune.outcome()

    with pytest.raises(RestatementRefused, match=NAMES_THE_MARK):
        asked.outcome()
    assert plan.mark == MARK and ledger.queries.get(str(RESTATED)) is None
    assert ledger.restatements.requests(logical_keys=[str(RESTATED)], open_only=False) == []


# -- both backends: the orders one after the other ------------------------------------------------------------------


def test_a_request_before_a_prune_keeps_its_key_and_stops_the_mark_at_it(ledger_url, clock):
    ledger = completed_days(ledger_url, clock)
    request(ledger)
    (plan,) = ledger.retention.prune(TO_JAN_5)
    assert (plan.mark, plan.pruned) == (RESTATED.window.business_date, 2)
    assert ledger.queries.get(str(RESTATED)).state is ExportState.COMPLETED
    assert ledger.restatements.open_requests([str(RESTATED)])[str(RESTATED)].revision == 2


def test_a_request_after_a_prune_is_refused_naming_the_mark(ledger_url, clock):
    ledger = completed_days(ledger_url, clock)
    ledger.retention.prune(TO_JAN_5)
    with pytest.raises(RestatementRefused, match=NAMES_THE_MARK):
        request(ledger)
    assert ledger.restatements.requests(logical_keys=[str(RESTATED)], open_only=False) == []


def test_a_key_exported_below_the_mark_by_an_override_is_not_restated(ledger_url, clock):
    """An operator may export a date below the mark (``allow_below_low_water``); its key is closed all the same: a
    request on it would be deleted with it by the next prune that moves the mark."""
    ledger = completed_days(ledger_url, clock)
    ledger.retention.prune(TO_JAN_5)
    override = open_ledger(ledger_url, clock=clock, allow_below_low_water=True)
    claim = override.claims.claim(RESTATED, "operator/invoice_export")
    override.completions.complete(claim, evidence_for(claim))
    with pytest.raises(RestatementRefused, match=NAMES_THE_MARK):
        request(ledger)
    assert ledger.restatements.requests(logical_keys=[str(RESTATED)], open_only=False) == []


@pytest.mark.postgres
def test_a_claim_that_waits_on_a_key_being_pruned_is_refused_below_the_mark_not_claimed_again(
    race, postgres_url, clock
):
    """A rerun claims a completed key while a prune deletes it: the claim waits on the key's row lock, and when the
    prune commits the row is gone. The claim must decide on the mark the prune committed (read after its row locks),
    not on one read at the start of its transaction: that claim would be a first claim below the mark, exporting
    again a key whose completion record was just pruned. Guard: claims read the low-water mark after locking rows."""
    from export_ledger.ledger import BelowLowWater

    ledger = completed_days(postgres_url, clock)
    pruner = open_ledger(race.url_for("prune"), clock=clock)
    claimer = open_ledger(race.url_for("claim"), clock=clock)
    with race.holding("export_low_water") as let_the_prune_commit:
        prune = Side(lambda: pruner.retention.prune(TO_JAN_5))
        race.until_waiting("prune")  # it has deleted what it prunes (the rows stay locked), and waits to raise the mark
        claim = Side(lambda: claimer.claims.claim(RESTATED, "rerun/invoice_export"))
        race.until_waiting("claim")  # it waits on the row lock of the key being pruned
        let_the_prune_commit()
    (plan,) = prune.outcome()

    assert plan.mark == MARK and plan.pruned == 4
    with pytest.raises(BelowLowWater, match=NAMES_THE_MARK):
        claim.outcome()
    assert ledger.queries.get(str(RESTATED)) is None, "a pruned key is not claimed again below the mark"
