"""The export ledger, one class per concern behind a thin facade (:class:`ExportLedger`): ``claims``, ``completions``,
``queries``, ``attention``, ``restatements``, ``contracts``, ``retention``, ``drift`` and ``operators``. Underneath:
``schema`` (tables), ``store`` (engines, the one clock, schema version and the explicit upgrade through alembic),
``transitions`` (every state change, declared once, and the one lease predicate), ``selection`` (which transition a
claim takes: pure functions) and ``records`` (what reads return). Plain Python; nothing here imports Dagster.
"""

from export_ledger.ledger.attention import AttentionSummary, Escalation, PartitionWork
from export_ledger.ledger.completions import Finish
from export_ledger.ledger.core import DEFAULT_LEASE_TTL, DEFAULT_MAX_ATTEMPTS, ExportLedger, utc_now
from export_ledger.ledger.drift import DriftChanges, DriftFinding, DriftRecord
from export_ledger.ledger.errors import (
    BelowLowWater,
    ConflictRecorded,
    ContractChanged,
    DestinationMoved,
    EmptyWindow,
    FencedOut,
    InvalidTransition,
    LeaseHeld,
    LedgerError,
    LedgerUnavailable,
    LiveLease,
    NeedsReconciliation,
    OperatorResolution,
    ResolutionRefused,
    RestatementRefused,
    SchemaOutdated,
    WindowNotOver,
    short_error,
)
from export_ledger.ledger.records import (
    AlreadyCompleted,
    AttemptRecord,
    Claim,
    CompletionEvidence,
    DaySummary,
    ExportRecord,
    Restatement,
    Revision,
)
from export_ledger.ledger.retention import PrunePlan
from export_ledger.ledger.schema import SCHEMA_VERSION, AttemptOutcome, ExportState, UtcDateTime
from export_ledger.ledger.store import (
    database_now,
    dispose_engines,
    ledger_engine,
    redact_url,
    schema_version,
    upgrade,
    upgrade_url,
)

__all__ = [
    "DEFAULT_LEASE_TTL",
    "DEFAULT_MAX_ATTEMPTS",
    "SCHEMA_VERSION",
    "AlreadyCompleted",
    "AttemptOutcome",
    "AttemptRecord",
    "AttentionSummary",
    "BelowLowWater",
    "Claim",
    "CompletionEvidence",
    "ConflictRecorded",
    "ContractChanged",
    "DestinationMoved",
    "DaySummary",
    "DriftChanges",
    "DriftFinding",
    "DriftRecord",
    "EmptyWindow",
    "Escalation",
    "ExportLedger",
    "ExportRecord",
    "ExportState",
    "FencedOut",
    "Finish",
    "InvalidTransition",
    "LeaseHeld",
    "LedgerError",
    "LedgerUnavailable",
    "LiveLease",
    "NeedsReconciliation",
    "OperatorResolution",
    "PartitionWork",
    "PrunePlan",
    "ResolutionRefused",
    "Restatement",
    "RestatementRefused",
    "Revision",
    "SchemaOutdated",
    "UtcDateTime",
    "WindowNotOver",
    "database_now",
    "dispose_engines",
    "ledger_engine",
    "redact_url",
    "schema_version",
    "short_error",
    "upgrade",
    "upgrade_url",
    "utc_now",
]
