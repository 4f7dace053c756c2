"""The drift sensor: re-reads the sources of recently completed keys and marks stale those that changed.

The decisions live in :mod:`export_ledger.drift` (plain Python); this module wires one pass per tick to the sensor's
cursor, resources and log, and reports ``source_unchanged`` on each export asset when the set of stale keys changes.

Exports that declare ``restate_stale`` get a restatement request for each key a tick newly finds stale; the
reconciliation sensor launches the runs that publish them (this sensor launches nothing: it has no jobs).

It is a sensor of its own rather than a mode of the reconciliation sensor: reconciliation reads the ledger and the
destinations only and must stay cheap and always on, while drift detection reads the sources again (the production
database the export protects), on a slower interval. It is therefore **stopped by default**: an operator starts it
(in the UI, or with ``ledgered_definitions(..., drift_sensor_running=True)``) once its load on the sources is
acceptable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import dagster as dg

from export_ledger.dagster.checks import drift_evaluation
from export_ledger.dagster.resources import LEDGER_KEY, SourceResource, built_spec, resource_keys
from export_ledger.drift import DEFAULT_DRIFT_BATCH, DEFAULT_LOOKBACK_DAYS, describe, drift_pass, stale_digest
from export_ledger.ledger import DriftRecord, ExportLedger
from export_ledger.sources import UnusableSource
from export_ledger.spec import ExportSpec

_NOTHING_STALE = stale_digest({})


def drift_check_evaluations(exports: Sequence[ExportSpec], book: ExportLedger) -> list[dg.AssetCheckEvaluation]:
    """One ``source_unchanged`` verdict per export asset, counted in the ledger (one count per asset) with the first
    stale keys listed; an asset of several zones counts its tenants' keys."""
    return [drift_evaluation(spec, book, group) for spec in exports for group in spec.groups]


def _asset_of(spec: ExportSpec, record: DriftRecord) -> str:
    """The asset of a stale key's partition: its tenant's zone on that date (a tenant no longer declared: the export's
    first asset, so it is never dropped)."""
    if record.tenant not in spec.tenants:
        return spec.groups[0].asset_name
    return spec.group_of(record.tenant, record.business_date).asset_name


def build_drift_sensor(
    exports: Sequence[ExportSpec],
    *,
    lookback_days: int = DEFAULT_LOOKBACK_DAYS,
    batch_size: int = DEFAULT_DRIFT_BATCH,
    minimum_interval_seconds: int = 600,
    running: bool = False,
) -> dg.SensorDefinition:
    """One sensor for every export with a source. Each tick checks at most ``batch_size`` completed keys of the last
    ``lookback_days`` business dates, continuing where the previous tick stopped (a JSON cursor), records stale and
    cleared keys in the ledger, and reports ``source_unchanged`` when the set of stale keys changes."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if lookback_days <= 0:
        raise ValueError(f"lookback_days must be positive, got {lookback_days}")
    checked = [spec for spec in exports if spec.source is not None]
    destination_keys = {spec.name: resource_keys(spec)[0] for spec in checked}

    @dg.sensor(
        name="drift_sensor",
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        required_resource_keys={LEDGER_KEY, *destination_keys.values()},
        description=(
            f"Re-reads the sources of keys completed in the last {lookback_days} business dates and marks stale "
            "those whose source changed (counts only); fails source_unchanged while any is stale; requests a "
            "restatement of each new one for exports with restate_stale."
        ),
    )
    def drift_sensor(context: dg.SensorEvaluationContext, **_resources) -> dg.SensorResult:
        # Resources come from context.resources; a direct call (tests) also passes them by key, unused here.
        state = json.loads(context.cursor) if context.cursor else {}
        book: ExportLedger = getattr(context.resources, LEDGER_KEY).get_ledger()
        destinations = {
            name: getattr(context.resources, key).get_destination() for name, key in destination_keys.items()
        }
        # A source declared as a resource is resolved here, at each tick, from the code server's environment (ticks
        # run there), export by export: one export's missing setting leaves it unchecked and the others checked.
        # Requiring its key on the sensor would make Dagster refuse the whole tick instead.
        here = [built_spec(spec) if isinstance(spec.source, SourceResource) else spec for spec in checked]
        for spec in here:
            if isinstance(spec.source, UnusableSource):
                context.log.warning(f"{spec.name}: not checked for drift: {spec.source.reason}")
        report = drift_pass(
            book, here, destinations, lookback_days=lookback_days, limit=batch_size, after=state.get("after")
        )
        for key, why in report.unchecked:
            context.log.warning(f"{key}: not checked for drift: {why}")
        for request in report.restatements.requested:
            context.log.info(
                f"{request.logical_key}: restatement requested (revision {request.revision}, {request.reason}); the "
                "reconciliation sensor launches its partition"
            )
        for key, why in report.restatements.refused:
            context.log.info(f"{key}: stale, no restatement requested: {why}")
        names = sorted(spec.name for spec in checked)
        opened = book.drift.open_records(logical_keys=report.changes.opened) if report.changes.opened else []
        for record in opened:
            context.log.warning(f"{record.logical_key} is stale: its source changed since export ({describe(record)})")
        summary = book.drift.open_summary(exports=names)
        digest = stale_digest(summary)
        cursor = json.dumps({"after": report.next_after, "stale_digest": digest})
        if digest == state.get("stale_digest", _NOTHING_STALE):
            return dg.SensorResult(
                skip_reason=(
                    f"{report.checked} key(s) checked, {len(report.stale)} stale, {len(report.unchecked)} not "
                    f"checked; {sum(c for c, _ in summary.values())} stale key(s) in all, unchanged since the last "
                    "report"
                ),
                cursor=cursor,
            )
        events = [*drift_check_evaluations(checked, book), *_partition_observations(checked, opened, report, book)]
        return dg.SensorResult(asset_events=events, cursor=cursor)

    return drift_sensor


def _partition_observations(
    exports: Sequence[ExportSpec], stale: Sequence[DriftRecord], report, book: ExportLedger
) -> list[dg.AssetObservation]:
    """One observation on the partition of each key this tick found stale, or cleared: so the partition's own page
    in the UI says it (``stale`` with the counts, or ``stale: false``). Counts and the key only, never values."""
    specs = {spec.name: spec for spec in exports}
    opened = set(report.changes.opened)
    observations = []
    for record in stale:
        if record.logical_key in opened and record.export in specs:
            observations.append(
                dg.AssetObservation(
                    asset_key=dg.AssetKey(_asset_of(specs[record.export], record)),
                    partition=record.business_date.isoformat(),
                    metadata={
                        "stale": True,
                        "logical_key": record.logical_key,
                        "rows_added": record.rows_added,
                        "rows_removed": record.rows_removed,
                        "rows_changed": dg.MetadataValue.text(
                            "unknown" if record.rows_changed is None else str(record.rows_changed)
                        ),
                        "remedy": dg.MetadataValue.text(f"export-ledger restate {record.logical_key} --reason ..."),
                    },
                )
            )
    for key in report.changes.cleared:
        found = book.queries.get(key)
        if found is not None and found.export in specs:
            observations.append(
                dg.AssetObservation(
                    asset_key=dg.AssetKey(_asset_of(specs[found.export], found)),
                    partition=found.business_date.isoformat(),
                    metadata={"stale": False, "logical_key": key},
                )
            )
    return observations
