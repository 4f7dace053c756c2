"""Shared builders for tests: logical keys and completion evidence (plain functions, importable anywhere)."""

from __future__ import annotations

import datetime as dt

from export_ledger.calendar import window_for
from export_ledger.keys import LogicalKey
from export_ledger.ledger import Claim, CompletionEvidence

ZONE = "America/New_York"
BUSINESS_DATE = dt.date(2026, 3, 8)  # the spring-forward day in New York: a 23-hour window


def key_for(
    business_date: dt.date = BUSINESS_DATE,
    *,
    export: str = "invoice_export",
    tenant: str = "acme",
    timezone: str = ZONE,
) -> LogicalKey:
    """The logical key of one export, tenant and business date."""
    return LogicalKey(export, tenant, window_for(business_date, timezone))


def evidence_for(claim: Claim, *, attempt_id: str | None = None, row_count: int = 42) -> CompletionEvidence:
    """What a destination would report for the claim's export (or for another attempt's, with ``attempt_id``)."""
    producer = attempt_id or claim.attempt_id
    return CompletionEvidence(
        location=f"file:///exports/{claim.logical_key}/{producer.replace('/', '_')}.parquet",
        sha256="ab" * 32,
        row_count=row_count,
        attempt_id=producer,
        fencing_token=claim.fencing_token,
    )
