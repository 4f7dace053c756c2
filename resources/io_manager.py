"""The I/O manager that turns an export batch into published, ledgered exports.

For each logical key in the batch, in order: claim the key (lease + fencing token), look for an export an earlier
attempt published and never recorded (repair it from its manifest), otherwise validate the frame against the
window recorded at the first claim, stage, publish atomically, and only then record completion. Data and
completion metadata become visible together; a key already completed is skipped with no new effect.
"""

import hashlib
from dataclasses import dataclass, field

import dagster as dg
import pandas as pd

from assets.keys import LogicalKey, attempt_id
from assets.windows import utc_iso
from resources import failpoints
from resources.destinations import (
    Destination,
    DestinationConflict,
    DestinationError,
    ExportTarget,
    PublishedElsewhere,
    PublishOutcomeUnknown,
)
from resources.exportfile import ExportSchema, Manifest, data_file_name, read_table, validate_frame
from resources.ledger import (
    AlreadyCompleted,
    Claim,
    CompletionEvidence,
    ExportLedger,
    ExportRecord,
    FencedOut,
    LedgerError,
    LedgerUnavailable,
)
from resources.ledger_resource import LedgerResource
from resources.schema import ExportState


class ExportConflict(DestinationConflict):
    """The destination holds a different export at this key's location; an operator must look."""


class ExportBatchFailed(RuntimeError):
    """Several keys of one run failed; each is named with its error, and every other key was still exported."""


class ExportOutcomeUnknown(DestinationError):
    """The destination may or may not hold the export; the key is ``remote_unknown`` until reconciled."""


@dataclass(frozen=True)
class ExportItem:
    """One logical key to export. ``frame`` is None when the asset found the key completed and read nothing."""

    key: LogicalKey
    partition_key: str
    frame: pd.DataFrame | None


@dataclass(frozen=True)
class ExportResult:
    """What happened to one key in this attempt."""

    logical_key: str
    partition_key: str
    tenant: str
    status: str  # exported | repaired | already_completed
    location: str
    sha256: str
    row_count: int
    committed_attempt: str

    @classmethod
    def of(cls, record: ExportRecord, partition_key: str, status: str) -> "ExportResult":
        return cls(
            record.logical_key,
            partition_key,
            record.tenant,
            status,
            record.location,
            record.sha256,
            record.row_count,
            record.committed_attempt,
        )


@dataclass
class ExportBatch:
    """What an export asset hands to the I/O manager: every (partition, tenant) key of the run."""

    schema: ExportSchema
    items: list[ExportItem]
    results: list[ExportResult] = field(default_factory=list)


def target_for(key: LogicalKey) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat())


def _same_window(claim: Claim, key: LogicalKey) -> bool:
    return (claim.window.start_utc.timestamp(), claim.window.end_utc.timestamp()) == (
        key.window.start_utc.timestamp(),
        key.window.end_utc.timestamp(),
    )


class LedgeredExportIOManager(dg.ConfigurableIOManager):
    """Publishes export batches through a destination and records each key in the ledger.

    Attributes:
        ledger: The ledger resource.
        destination: Where exports are published.
        file_format: ``csv`` (default) or ``parquet``.
        tenants: The tenants whose committed exports ``load_input`` returns.
    """

    ledger: dg.ResourceDependency[LedgerResource]
    destination: dg.ResourceDependency[Destination]
    file_format: str = "csv"
    tenants: list[str] = []

    def handle_output(self, context: dg.OutputContext, obj: ExportBatch) -> None:
        if not isinstance(obj, ExportBatch):
            raise TypeError(f"{type(self).__name__} exports ExportBatch values, got {type(obj).__name__}")
        data_file_name(self.file_format)
        ledger = self.ledger.get_ledger()
        attempt = attempt_id(context.run_id, context.step_key)
        failures: list[tuple[str, Exception]] = []
        for item in obj.items:
            try:
                obj.results.append(self._export_one(context, ledger, obj.schema, item, attempt))
            except LedgerUnavailable:
                raise  # nothing else can be recorded either
            except Exception as exc:
                # One key's failure is that key's: the other tenants and partitions of the run still get exported.
                context.log.error(f"{item.key}: {type(exc).__name__}: {exc}")
                failures.append((str(item.key), exc))
        if failures:
            if len(failures) == 1:
                raise failures[0][1]
            summary = "; ".join(f"{key}: {type(exc).__name__}: {exc}" for key, exc in failures)
            raise ExportBatchFailed(
                f"{len(failures)} of {len(obj.items)} export keys failed ({summary})"
            ) from failures[0][1]
        exported = [r for r in obj.results if r.status == "exported"]
        if exported:
            # One line for the routine outcome, not one per key: each log line is an event-log write in the run, and
            # the materialization metadata already lists every key's path and checksum.
            context.log.info(
                f"{len(exported)} key(s) exported, {sum(r.row_count for r in exported)} rows (attempt {attempt}): "
                f"{', '.join(r.logical_key for r in exported[:5])}{', ...' if len(exported) > 5 else ''}"
            )
        context.add_output_metadata(self._metadata(obj.results, attempt))

    def _export_one(
        self, context: dg.OutputContext, ledger: ExportLedger, schema: ExportSchema, item: ExportItem, attempt: str
    ) -> ExportResult:
        outcome = ledger.claim(item.key, attempt)
        if isinstance(outcome, AlreadyCompleted):
            record = outcome.record
            context.log.info(
                f"{record.logical_key} already completed by attempt {record.committed_attempt}; skipped, no new effect"
            )
            return ExportResult.of(record, item.partition_key, "already_completed")
        claim = outcome
        target = target_for(item.key)
        try:
            failpoints.reach("after_claim")
            if not _same_window(claim, item.key):
                raise LedgerError(
                    f"{claim.logical_key} was first claimed for [{utc_iso(claim.window.start_utc)}, "
                    f"{utc_iso(claim.window.end_utc)}) but this attempt read its source for "
                    f"[{utc_iso(item.key.window.start_utc)}, {utc_iso(item.key.window.end_utc)}); nothing exported"
                )
            existing = self.destination.probe(target)
            record = None
            if self.destination.transactional:
                if existing is not None:
                    raise ExportConflict(
                        f"{self.destination.location(target)} already holds {existing.logical_key} although the "
                        f"ledger has no completion for {claim.logical_key}"
                    )
                record = self._write_in_transaction(ledger, claim, schema, item, target)
                status = "exported"
            elif existing is not None:
                evidence = self._evidence_from(existing, claim, target)
                status = "repaired"
                context.log.warning(
                    f"{claim.logical_key} was published by attempt {existing.attempt_id} but never recorded; "
                    "recording it from its manifest instead of writing a second copy"
                )
            else:
                evidence = self._publish(claim, schema, item, target)
                # Publishing can meet another attempt's export (a fenced owner's late upload): that is a repair.
                status = "exported" if evidence.attempt_id == claim.attempt_id else "repaired"
        except PublishOutcomeUnknown as exc:
            ledger.mark_remote_unknown(
                claim, exc, sha256=getattr(exc, "intended_sha256", None), location=self.destination.location(target)
            )
            raise ExportOutcomeUnknown(
                f"{claim.logical_key}: the outcome at the destination is unknown ({exc}). The key is now "
                "remote_unknown; reconciliation (the reconciliation sensor, or `export-ledger reconcile`) will resolve "
                "it from the destination's evidence. Retrying before then is refused, because a blind retry could "
                "export it twice."
            ) from exc
        except FencedOut:
            raise  # this attempt no longer owns the key: it records nothing more
        except DestinationConflict as exc:
            # Never retried blindly: an operator must look at the destination.
            ledger.mark_conflict(claim, exc, location=self.destination.location(target))
            raise
        except Exception as exc:
            ledger.fail(claim, exc)
            raise
        if record is None:
            failpoints.reach("before_commit")
            record = ledger.complete(claim, evidence)
        failpoints.reach("after_commit")
        if status != "exported":
            context.log.info(
                f"{record.logical_key} {status}: {record.row_count} rows at {record.location} (attempt {attempt})"
            )
        return ExportResult.of(record, item.partition_key, status)

    def _publish(
        self, claim: Claim, schema: ExportSchema, item: ExportItem, target: ExportTarget
    ) -> CompletionEvidence:
        if item.frame is None:
            raise LedgerError(
                f"{claim.logical_key} was completed when the asset planned this run but is claimable now; "
                "rerun to read its source"
            )
        table = validate_frame(item.frame, schema, claim.window, what=claim.logical_key, tenant=item.key.tenant)
        self.destination.discard_abandoned(target, claim.fencing_token)
        template = self._manifest_template(claim, item)
        staged = self.destination.stage(target, table, self.file_format, template)
        try:
            failpoints.reach("after_stage")
            published = self.destination.publish(staged)
        except PublishedElsewhere as exc:
            self.destination.discard(staged)
            return self._evidence_from(exc.manifest, claim, target)
        except PublishOutcomeUnknown as exc:
            exc.intended_sha256 = staged.manifest.sha256
            self.destination.discard(staged)
            raise
        except Exception:
            self.destination.discard(staged)
            raise
        failpoints.reach("after_publish")
        return CompletionEvidence(
            location=self.destination.location(target),
            sha256=published.sha256,
            row_count=published.row_count,
            attempt_id=published.attempt_id,
            fencing_token=published.fencing_token,
        )

    def _write_in_transaction(
        self, ledger: ExportLedger, claim: Claim, schema: ExportSchema, item: ExportItem, target: ExportTarget
    ) -> ExportRecord:
        """Rows and completion record in one ledger transaction: both commit or neither."""
        if item.frame is None:
            raise LedgerError(f"{claim.logical_key} was planned as completed but is claimable now; rerun it")
        table = validate_frame(item.frame, schema, claim.window, what=claim.logical_key, tenant=item.key.tenant)
        template = self._manifest_template(claim, item)

        def effect(connection) -> CompletionEvidence:
            written = self.destination.write_in_transaction(connection, target, table, template)
            failpoints.reach("before_commit")  # inside the transaction: a failure here rolls the rows back too
            location = self.destination.location(target)
            return CompletionEvidence(
                location, written.sha256, written.row_count, claim.attempt_id, claim.fencing_token
            )

        return ledger.complete_within(claim, effect)

    def _manifest_template(self, claim: Claim, item: ExportItem) -> Manifest:
        return Manifest.build(
            logical_key=claim.logical_key,
            export=item.key.export,
            tenant=item.key.tenant,
            window=claim.window,
            row_count=0,
            sha256="",
            attempt_id=claim.attempt_id,
            fencing_token=claim.fencing_token,
            data_file=data_file_name(self.file_format),
            tz_database=claim.tz_database,
        )

    def _evidence_from(self, manifest: Manifest, claim: Claim, target: ExportTarget) -> CompletionEvidence:
        """Turns a manifest found at the target into completion evidence, after checking it is this key's export."""
        location = self.destination.location(target)
        if manifest.logical_key != claim.logical_key:
            raise ExportConflict(
                f"{location} holds the export of {manifest.logical_key}, not {claim.logical_key}; "
                "refusing to overwrite it or to record it as this key"
            )
        actual = hashlib.sha256(self.destination.read_data(target, manifest)).hexdigest()
        if actual != manifest.sha256:
            raise ExportConflict(
                f"{location}: data file sha256 {actual} does not match its manifest ({manifest.sha256})"
            )
        return CompletionEvidence(
            location, manifest.sha256, manifest.row_count, manifest.attempt_id, manifest.fencing_token
        )

    @staticmethod
    def _metadata(results: list[ExportResult], attempt: str) -> dict:
        done = [r for r in results if r.status != "already_completed"]
        return {
            "attempt_id": attempt,
            "logical_keys": dg.MetadataValue.json([r.logical_key for r in results]),
            "exported_keys": len(done),
            "rows_exported": sum(r.row_count for r in done),
            "sha256": dg.MetadataValue.json({r.logical_key: r.sha256 for r in results}),
            "paths": dg.MetadataValue.json({r.logical_key: r.location for r in results}),
            "skipped_already_completed": dg.MetadataValue.json(
                [r.logical_key for r in results if r.status == "already_completed"]
            ),
        }

    def load_input(self, context: dg.InputContext) -> pd.DataFrame:
        """Committed exports only: every (partition, tenant) must be ``completed`` and match its checksum."""
        export = context.asset_key.path[-1]
        ledger = self.ledger.get_ledger()
        frames = []
        partition_keys = sorted(context.asset_partition_keys) if context.has_asset_partitions else []
        if not partition_keys:
            raise DestinationError(f"{export} is partitioned by day; load it for one or more partitions")
        if not self.tenants:
            raise DestinationError(f"no tenants configured for loading {export}")
        for partition_key in partition_keys:
            day = pd.Timestamp(partition_key).date()
            for tenant in self.tenants:
                records = ledger.records(export=export, tenant=tenant, date_from=day, date_to=day)
                if len(records) != 1 or records[0].state is not ExportState.COMPLETED:
                    state = (
                        records[0].state.value
                        if len(records) == 1
                        else ("never attempted" if not records else "ambiguous")
                    )
                    raise DestinationError(
                        f"{export} for tenant {tenant} on {partition_key} is not committed ({state}); "
                        "load_input returns committed exports only"
                    )
                record = records[0]
                target = ExportTarget(export, tenant, partition_key)
                manifest = self.destination.probe(target)
                if manifest is None or manifest.sha256 != record.sha256:
                    raise DestinationError(
                        f"{record.logical_key} is completed in the ledger but {record.location} does not hold the "
                        "export it recorded"
                    )
                payload = self.destination.read_data(target, manifest)
                if hashlib.sha256(payload).hexdigest() != record.sha256:
                    raise DestinationError(f"{record.location}: data file does not match the ledger's sha256")
                file_format = "parquet" if manifest.data_file.endswith(".parquet") else "csv"
                frames.append(read_table(payload, file_format))
        return pd.concat(frames, ignore_index=True)
