"""export-ledger's Dagster integration: resources, the ledgered I/O manager, and factories for assets, checks,
schedules, the reconciliation sensor and the drift sensor, assembled by :func:`ledgered_definitions`.

Example:
    >>> from export_ledger.dagster import ledgered_definitions
    >>> defs = ledgered_definitions([orders, payments])  # doctest: +SKIP
"""

from export_ledger.dagster.assets import TENANTS_TAG, ExportRunConfig, build_export_asset
from export_ledger.dagster.checks import (
    DRIFT_CHECK_NAME,
    HEALTH_CHECK_NAME,
    STUCK_CHECK_NAME,
    build_stuck_check,
    destination_problems,
    drift_check_evaluation,
    stuck_check_evaluation,
)
from export_ledger.dagster.component import LedgeredExports
from export_ledger.dagster.definitions import declared_exports, ledgered_definitions
from export_ledger.dagster.drift_sensor import build_drift_sensor, drift_check_evaluations
from export_ledger.dagster.io_manager import LedgeredExportIOManager, partition_metadata
from export_ledger.dagster.partitions import calendar_of, dagster_disagreement, partitions_def
from export_ledger.dagster.resources import (
    LEDGER_KEY,
    DestinationResource,
    LedgerResource,
    SourceResource,
    resolved_spec,
    resource_keys,
    source_key,
    url_field,
)
from export_ledger.dagster.schedules import build_nightly_schedule
from export_ledger.dagster.sensors import (
    build_reconciliation_sensor,
    job_selection,
    restatement_requests,
    sensor_result,
)

__all__ = [
    "DRIFT_CHECK_NAME",
    "HEALTH_CHECK_NAME",
    "LEDGER_KEY",
    "LedgeredExports",
    "STUCK_CHECK_NAME",
    "TENANTS_TAG",
    "DestinationResource",
    "ExportRunConfig",
    "LedgerResource",
    "LedgeredExportIOManager",
    "SourceResource",
    "build_drift_sensor",
    "build_export_asset",
    "build_nightly_schedule",
    "build_reconciliation_sensor",
    "build_stuck_check",
    "calendar_of",
    "dagster_disagreement",
    "declared_exports",
    "destination_problems",
    "drift_check_evaluation",
    "drift_check_evaluations",
    "job_selection",
    "ledgered_definitions",
    "partition_metadata",
    "partitions_def",
    "resolved_spec",
    "resource_keys",
    "source_key",
    "restatement_requests",
    "sensor_result",
    "stuck_check_evaluation",
    "url_field",
]
