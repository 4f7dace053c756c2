"""Whole exports racing: 2 and 8 processes claim and export the same key at once, through the I/O manager and the
local destination, on SQLite and PostgreSQL, round after round.

``test_ledger_races.py`` races ``claim``/``complete`` on the ledger alone; here every racer runs the full write path
(claim, fence, verify, sweep, stage, commit, record: docs/protocol.md), so the effect is counted where a reader sees
it, and beside it: the key's pointer and places on disk (the v2 layout, read directly).

Each round is one logical key. The harness first puts the key in a starting state, with a seeding attempt in a
child process whose clock stands an hour back (so its lease has long expired when the racers come):

* ``fresh``: never attempted;
* ``failed``: the seed failed (``after_stage=raise``), staging removed;
* ``crashed``: the seed died holding its lease (``after_claim=kill``);
* ``staged``: the seed died with its place written, unnamed (``after_stage=kill``);
* ``published``: the seed died after committing the pointer, before recording (``after_publish=kill``): the racers
  must record that export (``repaired``), never write a second one.

Then N racers are forked, held at a gate, and released together; on alternate rounds each holds its claim 50 ms
(``after_claim=pause:0.05``) so that the others arrive while the lease is live. Per round: exactly one place of the
key, named by the pointer (the seed's staged or failed place swept by the winner, whose token fenced it), the key
``completed`` with exactly one recorded effect, every racer's attempt recorded once with the outcome it was told,
losers refused (``LeaseHeld``) or skipped as already completed, nothing else, nothing left that readers never see.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from pathlib import Path

import pytest
from builders import open_ledger
from harness.forkserver import ForkServer
from harness.protocol import AttemptSpec, survey, violations

from assets.invoices import EXPORT_NAME
from export_ledger.destinations import ExportTarget
from export_ledger.ledger import dispose_engines
from export_ledger.ledger.schema import AttemptOutcome, ExportState

pytest_plugins = ["harness.fixtures"]  # the shared fork server (fixture fork_server)

START_STATES = ("fresh", "failed", "crashed", "staged", "published")
SEED_FAILPOINTS = {
    "failed": "after_stage=raise",
    "crashed": "after_claim=kill",
    "staged": "after_stage=kill",
    "published": "after_publish=kill",
}
SEED_ROW = {  # the seed's attempt row after the round: recorded once, by the one takeover
    "fresh": [],
    "failed": [AttemptOutcome.FAILED],
    "crashed": [AttemptOutcome.ABANDONED],
    "staged": [AttemptOutcome.ABANDONED],
    "published": [AttemptOutcome.ABANDONED],
}
TOLD = {  # what a racer was told -> the attempt row it must have
    "exported": AttemptOutcome.COMPLETED,
    "repaired": AttemptOutcome.REPAIRED,
    "already_completed": AttemptOutcome.ALREADY_COMPLETED,
    "LeaseHeld": AttemptOutcome.REFUSED,
}
HOUR_AGO = -3600.0
FIRST_DATE = dt.date(2026, 2, 1)


class RaceHarness:
    def __init__(self, server: ForkServer, ledger_url: str, workdir: Path) -> None:
        self.server = server
        self.ledger_url = ledger_url
        self.workdir = workdir
        self.destination = {"kind": "local", "root": str(workdir / "exports")}
        for folder in ("results", "logs"):
            (workdir / folder).mkdir()
        self.ledger = open_ledger(ledger_url)
        self.rounds = 0
        self.tally: Counter = Counter()
        self.problems: list[str] = []

    def spec(self, name: str, business_date: str, **changes) -> AttemptSpec:
        return AttemptSpec(
            ledger_url=self.ledger_url,
            destination=self.destination,
            business_date=business_date,
            run_id=name,
            result_path=str(self.workdir / "results" / f"{name}.json"),
            log_path=str(self.workdir / "logs" / f"{name}.log"),
            **changes,
        )

    def round(self, racers: int, start: str, *, hold_claim: bool) -> None:
        number = self.rounds
        self.rounds += 1
        business_date = (FIRST_DATE + dt.timedelta(days=number)).isoformat()
        key = self.spec("probe", business_date).logical_key
        seed = self.spec(
            f"seed-{number}", business_date, clock_offset_seconds=HOUR_AGO, failpoints=SEED_FAILPOINTS.get(start, "")
        )
        if start != "fresh":
            self.server.run(seed)
            expected = ExportState.FAILED if start == "failed" else ExportState.IN_PROGRESS
            assert self.ledger.queries.get(key).state is expected, f"seeding {start} for {key}"

        specs = [
            self.spec(f"racer-{number}-{i}", business_date, failpoints="after_claim=pause:0.05" if hold_claim else "")
            for i in range(racers)
        ]
        pids, gate = self.server.spawn(specs, gated=True)
        self.server.release(gate)
        outcomes = self.server.wait(pids, timeout=120)
        told: dict[str, str] = {}
        for spec, pid in zip(specs, pids, strict=True):
            result = outcomes[pid].result
            if result is None:
                self.problems.append(f"{key}: racer {spec.run_id} reported nothing: {outcomes[pid]}")
                continue
            told[spec.attempt_id] = result["status"] if result["status"] != "failed" else result["error_class"]
        self.tally.update(told.values())
        self.tally[f"start:{start}"] += 1
        self.check(key, business_date, start, seed.attempt_id, told, racers)

    def check(self, key: str, business_date: str, start: str, seed: str, told: dict[str, str], racers: int) -> None:
        def problem(message: str) -> None:
            self.problems.append(f"{key} ({start}, {racers} racers): {message}")

        others = {attempt: what for attempt, what in told.items() if what not in TOLD}
        if others:
            problem(f"losing is LeaseHeld or already completed, never {others}")
        winners = [a for a, what in told.items() if what in ("exported", "repaired")]
        if len(winners) != 1:
            problem(f"exactly one racer exports or repairs, got {winners}")
        if start == "published" and any(told[a] == "exported" for a in winners):
            problem("the seed's published export must be recorded (repaired), not written again")

        found = survey(self.destination, self.ledger_url, only=ExportTarget(EXPORT_NAME, "acme", business_date))
        places = found.places(key)
        if len(places) != 1 or found.visible(key) is None:
            problem(f"{len(places)} places on disk ({sorted(places)}), exactly one, current, expected")
        if found.hidden:
            problem(f"left behind, never visible: {found.hidden}")
        for name, items in violations(self.ledger, found, [key], final=True).items():
            if items:
                problem(f"{name}: {items}")

        record = self.ledger.queries.get(key)
        rows = self.ledger.queries.attempts(key)
        seed_rows = [a.outcome for a in rows if a.attempt_id == seed]
        if seed_rows != SEED_ROW[start]:
            problem(f"the seed's rows are {seed_rows}, expected {SEED_ROW[start]}")
        racer_rows = Counter(a.attempt_id for a in rows if a.attempt_id != seed)
        if sorted(racer_rows) != sorted(told) or set(racer_rows.values()) != {1}:
            problem(f"every racer's attempt is recorded exactly once: {dict(racer_rows)}")
        for attempt in rows:
            what = told.get(attempt.attempt_id)
            if what in TOLD and attempt.outcome is not TOLD[what]:
                problem(f"{attempt.attempt_id} was told {what} but its row says {attempt.outcome.value}")
        if record is not None and start == "published" and record.committed_attempt != seed:
            problem(f"the committed export is {record.committed_attempt}'s, not the seed's that was published")

    def close(self) -> None:
        dispose_engines()


@pytest.fixture
def race(fork_server, ledger_url, tmp_path):
    harness = RaceHarness(fork_server, ledger_url, tmp_path)
    yield harness
    harness.close()


def run_rounds(race: RaceHarness, racers: int, repeats: int) -> None:
    started = time.monotonic()
    for repeat in range(repeats):
        for start in START_STATES:
            race.round(racers, start, hold_claim=(repeat + START_STATES.index(start)) % 2 == 0)
    found = survey(race.destination, race.ledger_url)
    everything = violations(race.ledger, found, final=True)
    print(
        f"export races [{race.ledger.dialect}, {racers} racers]: {race.rounds} rounds, "
        f"{sum(v for k, v in race.tally.items() if not k.startswith('start:'))} racing attempts in "
        f"{time.monotonic() - started:.1f}s; told {dict(sorted(race.tally.items()))}; "
        f"{len(found.exports)} keys visible; problems {len(race.problems)}"
    )
    assert race.problems == [], "\n".join(race.problems[:20])
    assert {name: items for name, items in everything.items() if items} == {}
    assert len(found.exports) == race.rounds, "one visible export per key, whoever won"
    assert found.hidden == [], "nothing beside the exports readers see"


def test_eight_racing_exports_publish_each_key_once_from_every_starting_state(race):
    run_rounds(race, 8, repeats=1)


@pytest.mark.slow
@pytest.mark.parametrize("racers", [2, 8])
def test_many_rounds_of_racing_exports_publish_each_key_once(race, racers):
    run_rounds(race, racers, repeats=4)
