"""The export ledger, split by concern: ``schema`` (tables), ``store`` (engines, schema version and upgrades),
``transitions`` (every state change, declared once), ``records`` (what reads return), ``core`` (claims,
completions, reconciliation), ``retention``, ``contracts`` and ``drift``. Plain Python; nothing here imports Dagster.
"""

from export_ledger.ledger.core import DEFAULT_LEASE_TTL, ExportLedger, utc_now
from export_ledger.ledger.drift import DriftChanges, DriftFinding, DriftRecord
from export_ledger.ledger.errors import (
    BelowLowWater,
    ConflictRecorded,
    ContractChanged,
    EmptyWindow,
    FencedOut,
    InvalidTransition,
    LeaseHeld,
    LedgerError,
    LedgerUnavailable,
    NeedsReconciliation,
    RestatementRefused,
    short_error,
)
from export_ledger.ledger.records import (
    AlreadyCompleted,
    AttemptRecord,
    Claim,
    CompletionEvidence,
    DaySummary,
    ExportRecord,
    Resolution,
    Restatement,
    Revision,
)
from export_ledger.ledger.schema import SCHEMA_VERSION, AttemptOutcome, ExportState, UtcDateTime
from export_ledger.ledger.store import dispose_engines, ledger_engine, redact_url, schema_version, upgrade

__all__ = [
    "DEFAULT_LEASE_TTL",
    "SCHEMA_VERSION",
    "AlreadyCompleted",
    "AttemptOutcome",
    "AttemptRecord",
    "BelowLowWater",
    "Claim",
    "CompletionEvidence",
    "ConflictRecorded",
    "ContractChanged",
    "DaySummary",
    "DriftChanges",
    "DriftFinding",
    "DriftRecord",
    "EmptyWindow",
    "ExportLedger",
    "ExportRecord",
    "ExportState",
    "FencedOut",
    "InvalidTransition",
    "LeaseHeld",
    "LedgerError",
    "LedgerUnavailable",
    "NeedsReconciliation",
    "Resolution",
    "Restatement",
    "RestatementRefused",
    "Revision",
    "UtcDateTime",
    "dispose_engines",
    "ledger_engine",
    "redact_url",
    "schema_version",
    "short_error",
    "upgrade",
    "utc_now",
]
