"""The health of one export's partition (one business date of one zone's tenants), read from the ledger and, where
the caller asks it, from the destination's evidence.

One verdict per partition, computed in one place, that the Dagster integration reports as the partitioned check
``partition_health`` wherever a partition's state changes (the export's run, the reconciliation sensor, the drift
sensor, a check run from the UI): so that a person looking at an export's partitions can tell its states apart
without opening a run. Plain Python, no Dagster.

Statuses, worst first (a partition takes the worst of its keys):

- ``escalated``: a key waits for a person (conflict; failed with its automatic reruns spent; failed,
  remote_unknown or abandoned in_progress longer than the stuck threshold).
- ``differs``: a completed key's data at its destination is not what the ledger recorded (its current revision's
  manifest or sha256, or its row count against what the run read): judged where the caller passes the destination's
  evidence (``verify``), never from the ledger alone.
- ``failed``: a key failed; the reconciliation sensor reruns it.
- ``restating``: a completed key has an open restatement request; its next revision is not published yet.
- ``stale``: a completed key's source changed since it was exported (drift detection); it needs a restatement.
- ``unverified``: every key is exported as the ledger says, but the destination did not answer when asked about one
  (judged again when the ledger's side changes, or the check is run from the UI).
- ``in_progress``: a key is being exported (or its remote outcome is being settled) and nothing is wrong yet.
- ``missing``: a tenant of the partition has no key yet (never attempted).
- ``healthy``: every tenant's key is completed, current and unchanged at its source as last checked.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from export_ledger.ledger import ExportLedger, ExportRecord, ExportState

#: Worst first: a partition's status is the worst of its keys'.
STATUSES = ("escalated", "differs", "failed", "restating", "stale", "unverified", "in_progress", "missing", "healthy")
#: Statuses that need someone (or the sensor) to act before the partition is right: reported as an ERROR.
SEVERE = frozenset({"escalated", "differs", "failed"})


@dataclass(frozen=True)
class Evidence:
    """What a destination said of completed keys it was asked about (logical keys): ``matched`` as the ledger
    recorded them; ``differs``: key -> what differs; ``unverified``: key -> why it could not be asked (the destination
    unreachable). A key in none of them was not verified."""

    matched: frozenset[str] = frozenset()
    differs: Mapping[str, str] = field(default_factory=dict)
    unverified: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class KeyHealth:
    """One tenant's key of the partition: its status, its ledger state (None: never attempted), the row count of its
    current export, and a short note in the library's words (never source data)."""

    tenant: str
    status: str
    state: str | None
    rows: int | None = None
    note: str = ""


@dataclass(frozen=True)
class PartitionHealth:
    """The verdict of one partition: its status (the worst of its keys') and its keys, tenant order.

    With the destination's evidence: ``verified`` and ``unverified`` count its completed keys found as the ledger
    recorded them and those the destination could not be asked about; ``ledger_status`` and ``ledger_summary`` are
    the verdict the ledger alone gives (what :func:`partition_health` says without ``verify``, which the health
    sensor compares with). Without it they are the verdict's own."""

    export: str
    business_date: dt.date
    status: str
    keys: tuple[KeyHealth, ...]
    verified: int = 0
    unverified: int = 0
    ledger_keys: tuple[KeyHealth, ...] | None = None

    @property
    def healthy(self) -> bool:
        return self.status == "healthy"

    def count(self, status: str) -> int:
        return sum(key.status == status for key in self.keys)

    @property
    def summary(self) -> str:
        """``failed: 1 of 3 tenants (globex)``, or ``healthy: 3 of 3 tenants exported``."""
        return _summary(self.status, self.keys)

    @property
    def ledger_status(self) -> str:
        return _worst(self.ledger_keys) if self.ledger_keys is not None else self.status

    @property
    def ledger_summary(self) -> str:
        return _summary(self.ledger_status, self.ledger_keys) if self.ledger_keys is not None else self.summary


def _worst(keys: Sequence[KeyHealth]) -> str:
    return min((key.status for key in keys), key=STATUSES.index, default="healthy")


def _summary(status: str, keys: Sequence[KeyHealth]) -> str:
    if status == "healthy":
        return f"healthy: {len(keys)} of {len(keys)} tenants exported"
    worst = [key.tenant for key in keys if key.status == status]
    shown = ", ".join(worst[:5]) + (", ..." if len(worst) > 5 else "")
    return f"{status}: {len(worst)} of {len(keys)} tenants ({shown})"


def partition_health(
    ledger: ExportLedger,
    export: str,
    tenants_by_date: Mapping[dt.date, Sequence[str]],
    *,
    stuck_after: dt.timedelta,
    max_attempts: int | None = 3,
    due: Callable[[str, dt.date], dt.datetime | None] | None = None,
    verify: Callable[[Sequence[ExportRecord]], Evidence] | None = None,
) -> dict[dt.date, PartitionHealth]:
    """The health of each business date of ``tenants_by_date`` (the tenants whose key the partition holds on that
    date), in four bounded reads whatever the number of dates: the keys, their escalations, open restatement
    requests and open drift records of those dates. ``due`` gives when a tenant's key of a date is due
    (:func:`export_ledger.deadlines.due_at`): a key not completed by then is escalated as late. ``verify`` is given
    the completed keys of those dates and tenants at once and returns the destination's :class:`Evidence`: a key it
    says differs is ``differs`` (unless escalated); a key it could not ask about keeps the ledger's status, noted and
    counted. Without it nothing is read beyond the ledger."""
    days = sorted(tenants_by_date)
    if not days:
        return {}
    tenants = sorted({tenant for members in tenants_by_date.values() for tenant in members})
    # A key per (tenant, date); a tenant that moved zones has one row per zone-day, the latest first claim wins.
    records: dict[tuple[str, dt.date], ExportRecord] = {}
    for record in ledger.queries.records(export=export, business_dates=days, tenants=tenants):
        records[(record.tenant, record.business_date)] = record
    bound = len(days) * max(len(tenants), 1)
    escalated = {
        e.logical_key: e.why
        for e in ledger.attention.escalated_keys(
            stuck_after, export=export, business_dates=days, max_attempts=max_attempts, limit=bound
        )
    }
    first, last = days[0], days[-1]
    requests = ledger.restatements.requests(export=export, tenants=tenants, date_from=first, date_to=last, limit=bound)
    restating = {r.logical_key: r.revision for r in requests}
    stale = {
        r.logical_key: r
        for r in ledger.drift.open_records(export=export, tenants=tenants, date_from=first, date_to=last, limit=bound)
    }
    now = ledger.now() if due is not None else None
    # Only the partitions' own keys: a tenant's key of a date it spent in another zone is that zone's asset's.
    done = [
        record
        for day in days
        for tenant in tenants_by_date[day]
        if (record := records.get((tenant, day))) is not None and record.state is ExportState.COMPLETED
    ]
    evidence = verify(done) if verify is not None and done else Evidence()
    verdicts = {}
    for day in days:
        ledger_keys = tuple(
            _late(_key_health(tenant, records.get((tenant, day)), escalated, restating, stale), due, day, now)
            for tenant in tenants_by_date[day]
        )
        if verify is None:
            verdicts[day] = PartitionHealth(export, day, _worst(ledger_keys), ledger_keys)
            continue
        keys = tuple(_with_evidence(key, records.get((key.tenant, day)), evidence) for key in ledger_keys)
        names = {r.logical_key for t in tenants_by_date[day] if (r := records.get((t, day))) is not None}
        verdicts[day] = PartitionHealth(
            export,
            day,
            _worst(keys),
            keys,
            verified=len(names & evidence.matched),
            unverified=len(names & evidence.unverified.keys()),
            ledger_keys=ledger_keys,
        )
    return verdicts


def _with_evidence(key: KeyHealth, record: ExportRecord | None, evidence: Evidence) -> KeyHealth:
    """A completed key as the destination's evidence leaves it: ``differs`` with what differs (an escalated key
    stays escalated: a person is already asked), or ``unverified`` when the destination did not answer (a worse
    ledger status stays, noted)."""
    if record is None or record.state is not ExportState.COMPLETED or key.status == "escalated":
        return key
    if record.logical_key in evidence.differs:
        return KeyHealth(key.tenant, "differs", key.state, key.rows, note=evidence.differs[record.logical_key])
    if record.logical_key in evidence.unverified:
        why = evidence.unverified[record.logical_key]
        status = "unverified" if key.status == "healthy" else key.status
        return KeyHealth(key.tenant, status, key.state, key.rows, note=", ".join(filter(None, [key.note, why])))
    return key


def _late(key: KeyHealth, due, day: dt.date, now: dt.datetime | None) -> KeyHealth:
    """A key not completed by its deadline is escalated as late (a completed one is on time, or was)."""
    if due is None or key.state == "completed" or key.status == "escalated":
        return key
    at = due(key.tenant, day)
    if at is None or now < at:
        return key
    return KeyHealth(key.tenant, "escalated", key.state, key.rows, note=f"late: due {at.isoformat()}, {key.note}")


def _key_health(tenant: str, record: ExportRecord | None, escalated, restating, stale) -> KeyHealth:
    if record is None:
        return KeyHealth(tenant, "missing", None, note="never attempted")
    key = record.logical_key
    state = record.state.value
    done = record.state is ExportState.COMPLETED
    rows = record.row_count if done else None
    if key in escalated:
        return KeyHealth(tenant, "escalated", state, note=escalated[key])
    if record.state is ExportState.FAILED:
        return KeyHealth(tenant, "failed", state, note="failed; the reconciliation sensor reruns it")
    if done and key in restating:
        return KeyHealth(tenant, "restating", state, rows=rows, note=f"revision {restating[key]} requested")
    if done and key in stale:
        return KeyHealth(tenant, "stale", state, rows=rows, note=f"source changed: {stale[key].changes}")
    if not done:
        return KeyHealth(tenant, "in_progress", state, note=state.replace("_", " "))
    return KeyHealth(tenant, "healthy", state, rows=rows)
