"""The rows the ledger's concerns write, built in one place: attempt rows, an abandoned holder's row, a completion's
evidence columns, and the statements every concern shares."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

from export_ledger.ledger.errors import MESSAGE_LIMIT, short_error
from export_ledger.ledger.records import CompletionEvidence, ExportRecord
from export_ledger.ledger.schema import RUN_COLUMNS, AttemptOutcome, export_attempts, export_runs

# Built once, executed with parameters (benchmarks/RESULTS.md, ledger throughput).
INSERT_RUN = export_runs.insert()
INSERT_ATTEMPT = export_attempts.insert()
RUN_BY_KEY = sa.select(*RUN_COLUMNS, export_runs.c.claim_count).where(
    export_runs.c.logical_key == sa.bindparam("k_key")
)
RUN_BY_KEY_LOCKED = RUN_BY_KEY.with_for_update()


def attempt_values(
    logical_key: str,
    attempt_id: str,
    fencing_token: int | None,
    now: dt.datetime,
    outcome: AttemptOutcome,
    error: BaseException | None = None,
    *,
    error_class: str | None = None,
    message: str | None = None,
    started_at: dt.datetime | None = None,
) -> dict:
    """One ``export_attempts`` row. ``error`` is stored as its class and a message safe to keep (never a driver's
    words); ``error_class`` and ``message`` give them directly (the library's own notes)."""
    if error is not None:
        error_class, message = short_error(error)
    started_at = started_at or now
    return dict(
        attempt_id=attempt_id,
        logical_key=logical_key,
        fencing_token=fencing_token,
        started_at=started_at,
        # The ledger's clock is one clock, but a row written by an older release may carry a worker's time: never
        # finish before start.
        finished_at=max(now, started_at),
        outcome=outcome.value,
        error_class=error_class,
        error_message=message[:MESSAGE_LIMIT] if message else message,
    )


def abandoned_values(record: ExportRecord, now: dt.datetime) -> dict:
    """The row of a holder whose lease ended without a result (recorded by whoever takes the key next)."""
    return attempt_values(
        record.logical_key,
        record.lease_owner,
        record.fencing_token,
        now,
        AttemptOutcome.ABANDONED,
        error_class="LeaseExpired",
        message=f"lease ended at {record.lease_expires_at.isoformat()} without a result",
        started_at=record.attempt_started_at,
    )


def evidence_values(evidence: CompletionEvidence) -> dict:
    """The ``export_runs`` columns a completion records from the destination's evidence."""
    return dict(
        location=evidence.location,
        sha256=evidence.sha256,
        row_count=evidence.row_count,
        committed_attempt=evidence.attempt_id,
        source_fingerprint=evidence.source_fingerprint,
    )
