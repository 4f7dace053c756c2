"""Runs whose worker is gone where nothing reported it (a lost host): the ledger knows, Dagster does not.

When a run worker's host is lost, the code server that started the worker is lost with it, so nothing tells Dagster:
the run stays ``STARTED``, holding its pool slots, until run monitoring's ``max_runtime_seconds``. The ledger has
recovered long before: the attempt's leases ended, whoever took its keys next recorded it ``abandoned``, and the
keys were judged and rerun. This module decides, from the ledger alone and without Dagster, which runs have ended;
the reconciliation sensor (:mod:`export_ledger.dagster.sensors`) then ends them in Dagster.

A run has ended when it lost a key (an attempt of it recorded ``abandoned``: its lease ended without a result and
the key was taken over), holds none (no key ``in_progress`` under its attempts' leases, live or ended), and has been
quiet since its last loss for at least a lease (the ledger's clock): no attempt row of it, and no claim or renewal,
which would hold a key. A run holding a live lease is working; a run that lost nothing is at most slow (the ledger
cannot tell it from a run between two keys): neither is ever judged ended. A run whose loss is recent may still be
reading a key: a group's leases are renewed only between its keys, so one slow key can make every lease of its group
end while the run is alive; it is heard from once the key is read (it claims its next group, or records its next
outcome). A run that lost a key while alive (stalled longer than its lease) is fenced out of committing it anyway
(docs/protocol.md): by the lease's contract it is as good as dead, and if it still runs it records its refusal, which
counts as being heard from.

The attempt rows are read in id order, and an id is taken at the INSERT but seen at the commit (PostgreSQL): a row
can become visible after rows with higher ids. So a missing id below the highest read holds the watch back (its rows
above it are read again next time) until it is seen, or until it has been missing for :data:`GAP_WAIT` (a transaction
rolled back, or a row pruned): rows are always taken in id order, and none is skipped while it may still commit.

Attempt ids are ``<run id>/<step key>`` (:func:`export_ledger.keys.attempt_id`).
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from export_ledger.calendar import utc_iso
from export_ledger.ledger import AttemptOutcome, ExportRecord
from export_ledger.ledger.queries import AttemptPage

#: How long a missing attempt id holds the watch back (the ledger's clock). A ledger transaction commits moments
#: after it inserts its attempt rows; an id missing longer belongs to a transaction rolled back, or a pruned row.
GAP_WAIT = dt.timedelta(minutes=2)


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
    RECENT = "recent"  # it lost its keys less than a lease ago: it may still be reading a key (judged again later)


@dataclass(frozen=True)
class RunVerdict:
    run_id: str
    finding: Finding
    why: str

    @property
    def ended(self) -> bool:
        return self.finding is Finding.ENDED


def judge_run(run: RunLedger, now: dt.datetime, quiet: dt.timedelta) -> RunVerdict:
    """Whether ``run`` has ended, by the ledger at ``now`` (the ledger's clock), and why, in words for a log.
    ``quiet`` is how long a run must have been silent since its latest loss: the lease."""
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
    if now - run.last_lost_at < quiet:
        return RunVerdict(
            run.run_id, Finding.RECENT, f"it lost {run.keys_lost} key(s), the last at {utc_iso(run.last_lost_at)}, "
            f"less than a lease ({quiet}) ago: it may still be reading a key; judged again once a lease has passed"
        )  # fmt: skip
    return RunVerdict(
        run.run_id, Finding.ENDED, f"every key its attempts held was taken over after their leases ended "
        f"({run.keys_lost} key(s) recorded abandoned, the last at {utc_iso(run.last_lost_at)}), it holds none and "
        f"recorded nothing, claimed nothing and renewed nothing in the lease ({quiet}) since: its worker is gone"
    )  # fmt: skip


@dataclass(frozen=True)
class Watch:
    """The runs that lost keys, seen in the ledger's attempt rows up to ``after`` (an ``export_attempts`` id) and not
    judged yet. A JSON-ready value; :meth:`seen` moves it on.

    ``waiting`` is ``(upto, since)`` while a missing id holds the watch back: every id missing at or below ``upto``
    has been missing since ``since`` (the ledger's clock), and is passed over once :data:`GAP_WAIT` has gone by.
    """

    after: int | None = None
    losing: Mapping[str, RunLedger] = field(default_factory=dict)
    waiting: tuple[int, dt.datetime] | None = None

    def seen(self, page: AttemptPage, now: dt.datetime) -> Watch:
        """This watch after ``page`` (the attempt rows above ``self.after``, read at ``now``), taken in id order up to
        the first id missing below the highest read (it may belong to a transaction not committed yet), unless that id
        has been missing for :data:`GAP_WAIT`. An ``abandoned`` row is a loss of its run; any other row of a run
        already losing means it was heard from. A fresh watch (``after`` None) starts anywhere: it waits for no id."""
        if self.after is None:
            passed = page.ids[-1] if page.ids else page.after
        elif self.waiting is not None and now - self.waiting[1] >= GAP_WAIT:
            passed = self.waiting[0]
        else:
            passed = page.after
        through, missing = page.after, None
        for row_id in page.ids:
            if row_id > through + 1 and row_id - 1 > passed:
                missing = max(through + 1, passed + 1)
                break
            through = row_id
        waiting = None
        if missing is not None:
            # Missing since the waiting began (``passed`` is below it: it has not expired), or new: from now on.
            waiting = self.waiting if self.waiting is not None and missing <= self.waiting[0] else (page.ids[-1], now)
        losing = dict(self.losing)
        for row in page.rows:
            if row.id > through:
                break
            run_id = run_of(row.attempt_id)
            if row.outcome is AttemptOutcome.ABANDONED:
                known_run = losing.get(run_id, RunLedger(run_id))
                losing[run_id] = replace(
                    known_run, keys_lost=known_run.keys_lost + 1, last_lost_at=row.finished_at, heard_after=False
                )
            elif run_id in losing:
                losing[run_id] = replace(losing[run_id], heard_after=True)
        return Watch(through, losing, waiting)

    def to_json(self) -> dict:
        return {
            "after": self.after,
            "losing": {
                run.run_id: [run.keys_lost, utc_iso(run.last_lost_at), run.heard_after] for run in self.losing.values()
            },
            "waiting": None if self.waiting is None else [self.waiting[0], utc_iso(self.waiting[1])],
        }

    @classmethod
    def from_json(cls, value: Mapping | None) -> Watch:
        if not value:
            return cls()
        losing = {
            run_id: RunLedger(run_id, lost, dt.datetime.fromisoformat(at), heard)
            for run_id, (lost, at, heard) in value.get("losing", {}).items()
        }
        waiting = value.get("waiting")
        return cls(
            value.get("after"), losing, None if not waiting else (waiting[0], dt.datetime.fromisoformat(waiting[1]))
        )


def judge_runs(
    watch: Watch, in_flight: Sequence[str], held: Sequence[ExportRecord], now: dt.datetime, quiet: dt.timedelta
) -> list[RunVerdict]:
    """A verdict for each run of ``watch`` still in flight in Dagster (``in_flight``: ``STARTING`` or ``STARTED``),
    given the keys ``held`` under their attempts' leases (:meth:`~export_ledger.ledger.queries.Queries.held_by_runs`)
    and the lease (``quiet``).
    """
    leases: dict[str, list[Lease]] = {}
    for record in held:
        leases.setdefault(run_of(record.lease_owner), []).append(Lease.of(record))
    return [
        judge_run(replace(watch.losing[run_id], leases=tuple(leases.get(run_id, ()))), now, quiet)
        for run_id in in_flight
        if run_id in watch.losing
    ]
