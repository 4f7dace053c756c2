"""Runs whose worker is gone where nothing reported it (a lost host): the ledger knows, Dagster does not.

When a run worker's host is lost, the code server that started the worker is lost with it, so nothing tells Dagster:
the run stays ``STARTED``, holding its pool slots, until run monitoring's ``max_runtime_seconds``. The ledger has
recovered long before: the attempt's leases ended, whoever took its keys next recorded it ``abandoned``, and the
keys were judged and rerun. This module decides, from the ledger alone and without Dagster, which runs have ended;
the reconciliation sensor (:mod:`export_ledger.dagster.sensors`) then ends them in Dagster.

A run has ended when it lost a key (an attempt of it recorded ``abandoned``: its lease ended without a result and
the key was taken over), holds none (no key ``in_progress`` under its attempts' leases, live or ended), and recorded
nothing after its last loss. A run holding a live lease is working; a run that lost nothing is at most slow (the
ledger cannot tell it from a run between two keys): neither is ever judged ended. A run that lost a key while alive
(stalled longer than its lease) is fenced out of committing it anyway (docs/protocol.md): by the lease's contract it
is as good as dead, and if it still runs it records its refusal, which counts as being heard from.

Attempt ids are ``<run id>/<step key>`` (:func:`export_ledger.keys.attempt_id`).
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from export_ledger.calendar import utc_iso
from export_ledger.ledger import AttemptOutcome, AttemptRecord, ExportRecord


def run_of(attempt_id: str) -> str:
    """The Dagster run id of an attempt id (``<run id>/<step key>``, or a run id alone)."""
    return attempt_id.split("/", 1)[0]


@dataclass(frozen=True)
class Lease:
    """A key ``in_progress`` under an attempt's lease."""

    attempt_id: str
    expires_at: dt.datetime

    @classmethod
    def of(cls, record: ExportRecord) -> Lease:
        return cls(record.lease_owner, record.lease_expires_at)


@dataclass(frozen=True)
class RunLedger:
    """What the ledger holds of one Dagster run."""

    run_id: str
    #: Keys taken over from its attempts after their leases ended (each recorded ``abandoned``).
    keys_lost: int = 0
    #: When the latest of them was taken over (the ledger's clock).
    last_lost_at: dt.datetime | None = None
    #: An attempt of the run recorded an outcome after its latest loss: it was alive then.
    heard_after: bool = False
    #: Keys ``in_progress`` its attempts hold, live or ended.
    leases: tuple[Lease, ...] = ()


class Finding(str, enum.Enum):
    """What the ledger says of one run."""

    ENDED = "ended"  # it lost every key it held and recorded nothing since: its worker is gone
    LIVE = "live"  # an attempt of it holds a live lease
    NOT_TAKEN_OVER = "not_taken_over"  # a lease of it has ended but its key is not taken over yet
    NOTHING_LOST = "nothing_lost"  # it lost no key: working, slow, or between two keys; the ledger cannot tell
    HEARD_FROM = "heard_from"  # it recorded an outcome after its latest loss: it was alive then


@dataclass(frozen=True)
class RunVerdict:
    run_id: str
    finding: Finding
    why: str

    @property
    def ended(self) -> bool:
        return self.finding is Finding.ENDED


def judge_run(run: RunLedger, now: dt.datetime) -> RunVerdict:
    """Whether ``run`` has ended, by the ledger at ``now`` (the ledger's clock), and why, in words for a log."""
    live = [lease for lease in run.leases if lease.expires_at > now]
    if live:
        last = max(live, key=lambda lease: lease.expires_at)
        return RunVerdict(
            run.run_id, Finding.LIVE, f"attempt {last.attempt_id} holds a live lease on {len(live)} key(s) until "
            f"{utc_iso(last.expires_at)}"
        )  # fmt: skip
    if run.leases:
        first = min(run.leases, key=lambda lease: lease.expires_at)
        return RunVerdict(
            run.run_id, Finding.NOT_TAKEN_OVER, f"the lease of attempt {first.attempt_id} on {len(run.leases)} key(s) "
            f"ended at {utc_iso(first.expires_at)}; no one has taken them over yet"
        )  # fmt: skip
    if not run.keys_lost:
        return RunVerdict(run.run_id, Finding.NOTHING_LOST, "it holds no key and lost none")
    if run.heard_after:
        return RunVerdict(
            run.run_id, Finding.HEARD_FROM, f"it recorded an outcome after it lost {run.keys_lost} key(s)"
        )
    return RunVerdict(
        run.run_id, Finding.ENDED, f"every key its attempts held was taken over after their leases ended "
        f"({run.keys_lost} key(s) recorded abandoned, the last at {utc_iso(run.last_lost_at)}), it holds none and "
        "recorded nothing since: its worker is gone"
    )  # fmt: skip


@dataclass(frozen=True)
class Watch:
    """The runs that lost keys, seen in the ledger's attempt rows up to ``after`` (an ``export_attempts`` id) and not
    judged yet. A JSON-ready value; :meth:`seen` moves it on."""

    after: int | None = None
    losing: Mapping[str, RunLedger] = field(default_factory=dict)

    def seen(self, rows: Iterable[AttemptRecord], after: int) -> Watch:
        """This watch after ``rows`` (attempt rows above ``self.after``, oldest first) read up to ``after``: an
        ``abandoned`` row is a loss of its run; any other row of a run already losing means it was heard from."""
        losing = dict(self.losing)
        for row in rows:
            run_id = run_of(row.attempt_id)
            if row.outcome is AttemptOutcome.ABANDONED:
                known = losing.get(run_id, RunLedger(run_id))
                losing[run_id] = replace(
                    known, keys_lost=known.keys_lost + 1, last_lost_at=row.finished_at, heard_after=False
                )
            elif run_id in losing:
                losing[run_id] = replace(losing[run_id], heard_after=True)
        return Watch(after, losing)

    def to_json(self) -> dict:
        return {
            "after": self.after,
            "losing": {
                run.run_id: [run.keys_lost, utc_iso(run.last_lost_at), run.heard_after] for run in self.losing.values()
            },
        }

    @classmethod
    def from_json(cls, value: Mapping | None) -> Watch:
        if not value:
            return cls()
        losing = {
            run_id: RunLedger(run_id, lost, dt.datetime.fromisoformat(at), heard)
            for run_id, (lost, at, heard) in value.get("losing", {}).items()
        }
        return cls(value.get("after"), losing)


def judge_runs(
    watch: Watch, in_flight: Sequence[str], held: Sequence[ExportRecord], now: dt.datetime
) -> list[RunVerdict]:
    """A verdict for each run of ``watch`` still in flight in Dagster (``in_flight``: ``STARTING`` or ``STARTED``),
    given the keys ``held`` under their attempts' leases (:meth:`~export_ledger.ledger.queries.Queries.held_by_runs`).
    """
    leases: dict[str, list[Lease]] = {}
    for record in held:
        leases.setdefault(run_of(record.lease_owner), []).append(Lease.of(record))
    return [
        judge_run(replace(watch.losing[run_id], leases=tuple(leases.get(run_id, ()))), now)
        for run_id in in_flight
        if run_id in watch.losing
    ]
