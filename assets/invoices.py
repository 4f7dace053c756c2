"""The invoice export asset and its per-materialization check."""

import datetime as dt
import hashlib
import warnings
from collections.abc import Iterator, Sequence

import dagster as dg

from assets.calendar import ExportCalendar
from assets.keys import LogicalKey, validate_slug
from assets.windows import parse_business_date, utc_iso
from resources.destinations import Destination
from resources.io_manager import ExportBatch, ExportItem, ExportResult, target_for
from resources.ledger import ExportLedger, ExportRecord
from resources.ledger_resource import LedgerResource
from resources.schema import ExportState
from resources.sources import INVOICE_SCHEMA, InvoiceSource

EXPORT_NAME = "invoice_export"
CHECK_NAME = "export_matches_source_and_ledger"
STUCK_CHECK_NAME = "no_stuck_exports"


def build_invoice_export(
    calendar: ExportCalendar,
    tenants: Sequence[str],
    *,
    pool: str,
    backfill_policy: dg.BackfillPolicy | None = None,
) -> dg.AssetsDefinition:
    """The ``invoice_export`` asset: for each partition in the run and each tenant, exactly the window's events.

    The asset plans (which keys, which windows, which are already done) and reads the source; the
    ``export_io_manager`` claims, publishes and records each key.
    """
    tenants = tuple(validate_slug(t, "tenant id") for t in tenants)
    if not tenants:
        raise ValueError("at least one tenant is required")
    partitions_def = calendar.partitions_def()

    # Backfill policies are a beta Dagster API; the chunking they give is the documented way to bound backfills.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        asset_decorator = dg.asset(
            name=EXPORT_NAME,
            partitions_def=partitions_def,
            io_manager_key="export_io_manager",
            backfill_policy=backfill_policy,
            pool=pool,
            check_specs=[dg.AssetCheckSpec(CHECK_NAME, asset=EXPORT_NAME)],
            description="Invoice events of each tenant inside the partition's business-day window, exported once.",
        )

    @asset_decorator
    def invoice_export(
        context: dg.AssetExecutionContext,
        ledger: LedgerResource,
        source: InvoiceSource,
        destination: Destination,
    ) -> Iterator:
        book = ledger.get_ledger()
        book.check_contract(EXPORT_NAME, calendar.contract())  # a changed zone or start date is refused unaccepted
        items: list[ExportItem] = []
        partition_keys = sorted(context.partition_keys)
        # One read for the whole run instead of one per key: a 31-day chunk of 10 tenants is 1 query, not 310.
        known = {
            (r.tenant, r.timezone, r.business_date): r
            for r in book.records(
                export=EXPORT_NAME,
                date_from=parse_business_date(partition_keys[0]),
                date_to=parse_business_date(partition_keys[-1]),
            )
        }
        for partition_key in partition_keys:
            window = calendar.window(partition_key)
            disagreement = calendar.dagster_disagreement(
                window, partitions_def.time_window_for_partition_key(partition_key)
            )
            if disagreement:
                context.log.warning(disagreement)
            planned_skips = []
            if window.is_empty:
                # The zone skipped this calendar day; its empty window has no logical key of its own (it would share
                # the next day's window start), and no event belongs to it.
                context.log.warning(
                    f"{partition_key} does not exist in {calendar.timezone}: empty window, nothing to export"
                )
            for tenant in tenants if not window.is_empty else ():
                key = LogicalKey(EXPORT_NAME, tenant, window)
                record = known.get((tenant, window.timezone, window.business_date))
                if record is not None:
                    key = LogicalKey(EXPORT_NAME, tenant, record.window)  # the first claim's window is authoritative
                if record is not None and record.state is ExportState.COMPLETED:
                    items.append(ExportItem(key, partition_key, None))
                    planned_skips.append(tenant)
                    continue
                frame = source.events(tenant, key.window.start_utc, key.window.end_utc)
                items.append(ExportItem(key, partition_key, frame))
            context.add_asset_metadata(
                {
                    "business_date": partition_key,
                    "timezone": calendar.timezone,
                    "window_start_utc": utc_iso(window.start_utc),
                    "window_end_utc": utc_iso(window.end_utc),
                    "window_hours": window.duration.total_seconds() / 3600,
                    "partition_logical_keys": dg.MetadataValue.json(
                        [str(i.key) for i in items if i.partition_key == partition_key]
                    ),
                    "source_rows": dg.MetadataValue.json(
                        {
                            i.key.tenant: len(i.frame)
                            for i in items
                            if i.partition_key == partition_key and i.frame is not None
                        }
                    ),
                    "tenants_skipped_already_completed": dg.MetadataValue.json(planned_skips),
                },
                partition_key=partition_key,
            )
        batch = ExportBatch(INVOICE_SCHEMA, items)
        yield dg.Output(batch)
        # The I/O manager has published and recorded every key by now: check what actually landed.
        yield _check(book, source, destination, batch.results)

    return invoice_export


def _check(
    ledger: ExportLedger, source: InvoiceSource, destination: Destination, results: list[ExportResult]
) -> dg.AssetCheckResult:
    problems: list[str] = []
    for result in results:
        record = ledger.get(result.logical_key)
        if record is None or record.state is not ExportState.COMPLETED:
            problems.append(f"{result.logical_key}: not completed in the ledger")
            continue
        key = LogicalKey(record.export, record.tenant, record.window)
        target = target_for(key)
        manifest = destination.probe(target)
        if manifest is None:
            problems.append(f"{record.logical_key}: no manifest at {record.location}")
            continue
        actual = hashlib.sha256(destination.read_data(target, manifest)).hexdigest()
        if actual != record.sha256:
            problems.append(f"{record.logical_key}: file sha256 {actual[:12]}... != ledger {record.sha256[:12]}...")
        expected_rows = source.count(record.tenant, record.window_start_utc, record.window_end_utc)
        if record.row_count != expected_rows:
            problems.append(f"{record.logical_key}: exported {record.row_count} rows, source has {expected_rows}")
    return dg.AssetCheckResult(
        check_name=CHECK_NAME,
        asset_key=EXPORT_NAME,
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "keys_checked": len(results),
            "problems": dg.MetadataValue.json(problems),
        },
        description="exported row counts equal the source's for each window; each file's sha256 equals the ledger's",
    )


def stuck_check_evaluation(
    asset_key: dg.AssetKey, stuck: list[ExportRecord], stuck_after: dt.timedelta
) -> dg.AssetCheckEvaluation:
    """The ``no_stuck_exports`` verdict: fails while any key stays unresolved longer than ``stuck_after``."""
    return dg.AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=STUCK_CHECK_NAME,
        passed=not stuck,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "stuck_keys": len(stuck),
            "threshold_hours": stuck_after.total_seconds() / 3600,
            "first_keys": dg.MetadataValue.json(
                [
                    {"logical_key": r.logical_key, "state": r.state.value, "since": utc_iso(r.updated_at)}
                    for r in stuck[:20]
                ]
            ),
        },
        description=f"no key stays remote_unknown, conflict or abandoned in_progress longer than {stuck_after}",
    )


def build_stuck_check(stuck_after: dt.timedelta) -> dg.AssetChecksDefinition:
    """``no_stuck_exports`` on demand from the UI; the reconciliation sensor reports the same verdict each time the
    set of stuck keys changes."""

    @dg.asset_check(asset=EXPORT_NAME, name=STUCK_CHECK_NAME, description="no export key stuck too long")
    def no_stuck_exports(ledger: LedgerResource) -> dg.AssetCheckResult:
        stuck = ledger.get_ledger().stuck_longer_than(stuck_after)
        evaluation = stuck_check_evaluation(dg.AssetKey(EXPORT_NAME), stuck, stuck_after)
        return dg.AssetCheckResult(
            passed=evaluation.passed,
            severity=evaluation.severity,
            metadata=evaluation.metadata,
            description=evaluation.description,
        )

    return no_stuck_exports
