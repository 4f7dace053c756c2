"""export-ledger: ledgered nightly data exports, one logical export per (export, tenant, window).

This top level is the Dagster-free core: declare exports (:class:`ExportSpec`), read and change the ledger
(:class:`ExportLedger`), export one key (:func:`export_key`), reconcile stuck keys (:func:`reconcile_batch`), read
back every key's current revision from a destination (:func:`read_current`).
The Dagster integration is :mod:`export_ledger.dagster`; importing this package never imports Dagster.
"""

from export_ledger.calendar import (
    WINDOW_POLICY,
    ExportCalendar,
    ExportWindow,
    ZoneMove,
    check_schedule_time,
    load_zone,
    parse_business_date,
    require_aware,
    utc_iso,
    window_for,
    windows_between,
)
from export_ledger.destinations import (
    Destination,
    DestinationError,
    ExportTarget,
    LocalDestination,
    PointerDestination,
    PublishingDestination,
    TransactionalDestination,
    destination_from,
)
from export_ledger.drift import drift_pass
from export_ledger.errors import (
    CalendarError,
    ConfigurationError,
    ExportLedgerError,
    FrameError,
    InvalidIdentifier,
    ManifestError,
    SourceError,
)
from export_ledger.frames import MANIFEST_NAME, ExportSchema, FrameBatches, Manifest, validate_frame
from export_ledger.keys import LogicalKey, attempt_id, parse_tenants, validate_slug
from export_ledger.ledger import (
    SCHEMA_VERSION,
    AttemptOutcome,
    ExportLedger,
    ExportRecord,
    ExportState,
    LedgerError,
    Restatement,
    RestatementRefused,
    Revision,
    UtcDateTime,
    redact_url,
)
from export_ledger.ledger.urls import create_engine as database_engine
from export_ledger.protocol import ExportBatch, ExportItem, ExportResult, export_batch, export_key
from export_ledger.read import CurrentRevisionUnreadable, read_current
from export_ledger.reconcile import reconcile_batch
from export_ledger.settings import Settings
from export_ledger.sources import (
    CallableSource,
    ExportSource,
    ResolvableSource,
    SqlSource,
    UnusableSource,
    url_identity,
)
from export_ledger.spec import ExportSpec
from export_ledger.tenants import Tenant, TenantGroup

__version__ = "0.6.0"

__all__ = [
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "WINDOW_POLICY",
    "AttemptOutcome",
    "CalendarError",
    "CallableSource",
    "ConfigurationError",
    "CurrentRevisionUnreadable",
    "Destination",
    "DestinationError",
    "ExportBatch",
    "ExportCalendar",
    "ExportItem",
    "ExportLedger",
    "ExportLedgerError",
    "ExportRecord",
    "ExportResult",
    "ExportSchema",
    "ExportSource",
    "ExportSpec",
    "ExportState",
    "ExportTarget",
    "ExportWindow",
    "ResolvableSource",
    "Restatement",
    "RestatementRefused",
    "Revision",
    "FrameBatches",
    "FrameError",
    "InvalidIdentifier",
    "LedgerError",
    "LocalDestination",
    "LogicalKey",
    "Manifest",
    "ManifestError",
    "PointerDestination",
    "PublishingDestination",
    "Settings",
    "SourceError",
    "SqlSource",
    "UnusableSource",
    "Tenant",
    "TenantGroup",
    "TransactionalDestination",
    "UtcDateTime",
    "ZoneMove",
    "attempt_id",
    "check_schedule_time",
    "database_engine",
    "destination_from",
    "drift_pass",
    "export_batch",
    "export_key",
    "load_zone",
    "parse_business_date",
    "parse_tenants",
    "read_current",
    "reconcile_batch",
    "redact_url",
    "require_aware",
    "utc_iso",
    "validate_frame",
    "validate_slug",
    "window_for",
    "url_identity",
    "windows_between",
]
