"""The I/O manager that turns an export's output into published, ledgered exports.

An export asset built by :func:`export_ledger.dagster.build_export_asset` hands it an
:class:`~export_ledger.protocol.ExportBatch`; a partitioned asset of your own may hand it one DataFrame holding every
tenant's rows (split here by tenant column and window). Either way each key goes through
:func:`export_ledger.protocol.export_key`.
"""

import hashlib
import json
from collections.abc import Mapping

import dagster as dg

from export_ledger.calendar import ExportCalendar
from export_ledger.contract import asset_source, export_terms, with_terms
from export_ledger.dagster.resources import DestinationResource, LedgerResource
from export_ledger.destinations import DestinationError, ExportTarget, Verdict, place_of_location
from export_ledger.errors import FrameError, safe_message
from export_ledger.frames import ExportSchema, check_column_names, read_table
from export_ledger.keys import LogicalKey, attempt_id
from export_ledger.lazy import lazy_module
from export_ledger.ledger import ExportRecord, Restatement, Revision
from export_ledger.placement import recorded_destinations
from export_ledger.protocol import ExportBatch, ExportItem, ExportResult, export_batch
from export_ledger.restate import published_revisions
from export_ledger.settings import DEFAULT_OPENLINEAGE_NAMESPACE, OPENLINEAGE_URL_ENV, http_url

pd = lazy_module("pandas", globals(), "pd")


class LedgeredExportIOManager(dg.ConfigurableIOManager):
    """Publishes one export's outputs through its destination and records each key in the ledger.

    Attributes:
        ledger: The ledger resource.
        destination: Where exports are published.
        file_format: ``csv`` (default) or ``parquet``.
        export: The export's name (default: the asset's name).
        tenants: The tenants whose committed exports ``load_input`` returns (and a frame output is split into).
        tenants_by_asset: JSON object of asset name -> its tenants (ids, or ``[id, first date, last date]`` for a
            tenant in the asset's zone on those dates only); wins over ``tenants`` where set. This is what
            :func:`~export_ledger.dagster.ledgered_definitions` passes: one config value however many tenants, since
            Dagster processes every resource's config once per job (40 zones of 1,000 tenants would pay for a
            1,000-item list 40 times when the code location loads).
        columns, time_column, id_columns, tenant_column, order_by, nullable: The export's schema, for a frame output.
        timezone, start_date: The export's calendar, for a frame output.
        version: The export's version (``ExportSpec.version``), recorded in its contract with the rest of its terms.
        openlineage_url: The OpenLineage HTTP receiver each run sends its START and COMPLETE (or FAIL) events to;
            None: no events. :func:`~export_ledger.dagster.ledgered_definitions` sets it from
            ``EXPORTS_OPENLINEAGE_URL`` when the code location loads (in the code server, and again in each run
            worker), by name (``EnvVar``): the UI shows the variable, never a token in the URL.
        openlineage_namespace: The jobs' OpenLineage namespace.
        openlineage_api_key: A bearer token for the receiver (an ``EnvVar``: ``EXPORTS_OPENLINEAGE_API_KEY``).
    """

    ledger: dg.ResourceDependency[LedgerResource]
    destination: dg.ResourceDependency[DestinationResource]
    file_format: str = "csv"
    export: str = ""
    tenants: list[str] = []
    tenants_by_asset: str = ""
    columns: dict[str, str] = {}
    time_column: str = ""
    id_columns: list[str] = []
    tenant_column: str | None = None
    order_by: list[str] = []
    nullable: list[str] = []
    timezone: str = ""
    start_date: str = ""
    version: str | None = None
    openlineage_url: str | None = None
    openlineage_namespace: str = DEFAULT_OPENLINEAGE_NAMESPACE
    openlineage_api_key: str | None = None

    def handle_output(self, context: dg.OutputContext, obj: "ExportBatch | pd.DataFrame") -> None:
        if isinstance(obj, pd.DataFrame):
            obj = self._batch_from_frame(context, obj)
        if not isinstance(obj, ExportBatch):
            raise TypeError(f"{type(self).__name__} exports ExportBatch or DataFrame values, got {type(obj).__name__}")
        attempt = attempt_id(context.run_id, context.step_key)

        def log(level: str, message: str) -> None:
            getattr(context.log, level)(message)

        try:
            destination = self.destination.get_destination()
            lineage = self._lineage(log)
            job = context.asset_key.to_user_string() if context.has_asset_key else context.step_key
            if lineage is not None:
                lineage.start(context.run_id, job, obj, destination)
        except Exception:
            _before_failing(context, obj, exported=False)  # nothing exported: the verdicts are the ledger's
            raise
        try:
            export_batch(
                self.ledger.get_ledger(),
                destination,
                obj,
                attempt,
                file_format=self.file_format,
                log=log,
            )
        except Exception:
            _record_finished_partitions(context, obj, attempt)
            _before_failing(context, obj)
            if lineage is not None:
                lineage.finish(context.run_id, job, obj, destination, failed=True)
            raise
        if lineage is not None:
            # After export_batch: every key of the event is durable and recorded before the receiver hears of it.
            lineage.finish(context.run_id, job, obj, destination, failed=False)
        exported = [r for r in obj.results if r.status == "exported"]
        if exported:
            # One line for the routine outcome, not one per key: each log line is an event-log write in the run, and
            # the materialization metadata already lists every key's path and checksum.
            context.log.info(
                f"{len(exported)} key(s) exported, {sum(r.row_count for r in exported)} rows (attempt {attempt}): "
                f"{', '.join(r.logical_key for r in exported[:5])}{', ...' if len(exported) > 5 else ''}"
            )
        restated = [
            r.logical_key for r in obj.results if r.revision > 1 and r.status not in ("already_completed", "unchanged")
        ]
        reasons = published_revisions(self.ledger.get_ledger(), restated) if restated else {}
        if restated:
            context.log.info(
                f"{len(restated)} key(s) restated: "
                + ", ".join(f"{key} (revision {reasons[key].revision})" for key in restated[:5] if key in reasons)
                + (", ..." if len(restated) > 5 else "")
            )
        add_partition_metadata(context, obj.results, attempt, reasons)

    def _lineage(self, log):
        """The run's OpenLineage emitter, from this resource's own fields (None: no events asked for). A URL given
        (by name: as the run resolved it) that is empty or not http(s) fails the run naming the variable."""
        if self.openlineage_url is None:
            return None
        # Imported here so that this method alone carries lineage.
        from export_ledger.lineage import LineageEmitter

        url = http_url(OPENLINEAGE_URL_ENV, self.openlineage_url)  # as the run worker resolved it: checked again
        return LineageEmitter(url, namespace=self.openlineage_namespace, api_key=self.openlineage_api_key, log=log)

    def _batch_from_frame(self, context: dg.OutputContext, frame: "pd.DataFrame") -> ExportBatch:
        """Splits one frame of every tenant's rows into one item per (partition, tenant); a row that belongs to no
        configured tenant or to no partition of the run is refused, so nothing is dropped silently."""
        if not self.columns or not self.tenant_column or not self.timezone:
            raise FrameError(f"{context.asset_key.to_user_string()}: a frame output needs the export's schema")
        schema = ExportSchema(
            self.columns, self.time_column, tuple(self.id_columns), self.tenant_column, tuple(self.order_by),
            frozenset(self.nullable),
        )  # fmt: skip
        calendar = ExportCalendar(self.timezone, self.start_date)
        export = self.export or context.asset_key.path[-1]
        what = f"{export} (rows of the asset's frame)"
        check_column_names(frame, schema, what)
        for name in (schema.time_column, schema.tenant_column):
            if name not in frame.columns:
                raise FrameError(f"{what}: the frame has no {name!r} column")
        times = frame[schema.time_column]
        if not isinstance(times.dtype, pd.DatetimeTZDtype):
            raise FrameError(f"{what}: column {schema.time_column!r} must hold timezone-aware timestamps")
        items, placed = [], 0
        # Checked at claim, in the claim's transaction: the calendar these windows were cut with, and where and how
        # they are exported, must be the contract the ledger holds for each tenant (recorded at its first claim), so
        # a changed zone, destination, format or schema is refused, not exported.
        terms = export_terms(
            destination=self.destination.get_destination().identity(export), file_format=self.file_format,
            schema=schema, source=asset_source(export), version=self.version,
        )  # fmt: skip
        contract = with_terms(calendar.contract(), terms)
        for partition_key in sorted(context.asset_partition_keys):
            window = calendar.window(partition_key)
            in_window = (times >= window.start_utc) & (times < window.end_utc)
            for tenant in self._tenants_of(context.asset_key.path[-1], window.business_date):
                rows = frame[in_window & (frame[schema.tenant_column] == tenant)]
                placed += len(rows)
                if not window.is_empty:
                    items.append(ExportItem(LogicalKey(export, tenant, window), partition_key, rows, contract))
        if placed != len(frame):
            raise FrameError(
                f"{what}: {len(frame) - placed} row(s) belong to no configured tenant or fall outside the run's "
                "partitions; nothing was exported"
            )
        return ExportBatch(schema, items)

    def _tenants_of(self, asset_name: str, day=None) -> list[str]:
        """The asset's tenants (on business date ``day``, when given)."""
        if not self.tenants_by_asset:
            return list(self.tenants)
        found = []
        for member in json.loads(self.tenants_by_asset).get(asset_name, []):
            tenant, first, last = member if isinstance(member, list) else (member, None, None)
            on = day.isoformat() if day is not None else None
            if on is None or ((first is None or first <= on) and (last is None or on <= last)):
                found.append(tenant)
        return found

    def load_input(self, context: dg.InputContext) -> "pd.DataFrame":
        """Each (partition, tenant)'s current revision, and only a committed one: the newest revision the ledger
        recorded, read where that revision was published and checked against the ledger's sha256.

        A key whose restatement is under way, failed or unknown still has its current revision (the one before the
        restatement): that is returned. A revision published but not yet recorded (its pointer moved, then the
        attempt died) is not: reconciliation records it first. A key never completed is refused.
        """
        export = self.export or context.asset_key.path[-1]
        tenants = self._tenants_of(context.asset_key.path[-1])  # narrowed per date below
        ledger = self.ledger.get_ledger()
        destination = self.destination.get_destination()
        frames = []
        partition_keys = sorted(context.asset_partition_keys) if context.has_asset_partitions else []
        if not partition_keys:
            raise DestinationError(f"{export} is partitioned by day; load it for one or more partitions")
        if not tenants:
            raise DestinationError(f"no tenants configured for loading {export}")
        for partition_key in partition_keys:
            day = pd.Timestamp(partition_key).date()
            for tenant in self._tenants_of(context.asset_key.path[-1], day):
                records = ledger.queries.records(export=export, tenant=tenant, date_from=day, date_to=day)
                current = ledger.restatements.current_revision(records[0].logical_key) if len(records) == 1 else None
                if current is None:
                    state = (
                        records[0].state.value
                        if len(records) == 1
                        else ("never attempted" if not records else "ambiguous")
                    )
                    raise DestinationError(
                        f"{export} for tenant {tenant} on {partition_key} is not committed ({state}); "
                        "load_input returns committed exports only"
                    )
                # Read where the key's contract says it was exported (kept there when the destination changed).
                place = recorded_destinations(ledger, records, known=destination, fallback=lambda _: destination)
                frames.append(self._read_revision(place[records[0].logical_key], records[0], current, context))
        return pd.concat(frames, ignore_index=True)

    def _read_revision(
        self, destination, record: ExportRecord, current: Revision, context: dg.InputContext
    ) -> "pd.DataFrame":
        """One key's ``current`` revision (the newest the ledger recorded), read where it was recorded and checked
        against its sha256 (:meth:`~export_ledger.destinations.Destination.verify_recorded`)."""
        target = ExportTarget.of_record(record, current.revision, place_of_location(current.location))
        pointer = destination.current_revision(target)
        if pointer != current.revision:
            # Ahead: a restatement committed and not yet recorded (reconciliation records it). The ledger's recorded
            # revision is the one whose checksum is known.
            context.log.warning(
                f"{record.logical_key}: the destination's current pointer says revision {pointer}, the ledger's "
                f"newest recorded revision is {current.revision}; reading revision {current.revision}"
            )
        seen = destination.verify_recorded(target, logical_key=record.logical_key, sha256=current.sha256)
        if seen.verdict is not Verdict.PUBLISHED:
            raise DestinationError(
                f"{record.logical_key} revision {current.revision} is recorded in the ledger but {seen.detail}"
            )
        payload = destination.read_data(target, seen.manifest)
        if hashlib.sha256(payload).hexdigest() != current.sha256:
            raise DestinationError(
                f"{destination.location(target)}: data file does not match the ledger's sha256 for revision "
                f"{current.revision}"
            )
        file_format = "parquet" if seen.manifest.data_file.endswith(".parquet") else "csv"
        return read_table(payload, file_format)


def _record_finished_partitions(context: dg.OutputContext, batch: ExportBatch, attempt: str) -> None:
    """A run over several partitions failed on some key: the partitions each of whose keys this run finished are
    exported all the same, and Dagster records no materialization for a failed step; one event per such partition
    says so (the failed partitions are rerun from the ledger and recorded by their rerun)."""
    items: dict[str, list[str]] = {}
    for item in batch.items:
        items.setdefault(item.partition_key, []).append(str(item.key))
    if len(items) < 2:
        return
    results = by_partition(batch.results)
    failed = {failure.partition_key for failure in batch.failures}
    for partition_key in sorted(items):
        done = results.get(partition_key, [])
        if partition_key in failed or {r.logical_key for r in done} != set(items[partition_key]):
            continue
        context.log_event(
            dg.AssetMaterialization(
                asset_key=context.asset_key,
                partition=partition_key,
                metadata={"attempt_id": attempt, **partition_metadata(done)},
                description="every key of this partition was exported by this run; other partitions of the run failed",
            )
        )


def _before_failing(context: dg.OutputContext, batch: ExportBatch, exported: bool = True) -> None:
    """The batch's own last word before the step fails (its checks' verdicts): a failure there is logged, by its class
    and the library's words only, and never hides the export's own error, raised next."""
    if batch.on_failure is None:
        return
    try:
        batch.on_failure(exported)
    except Exception as exc:
        context.log.warning(f"the run's verdicts on its partitions could not be reported: {safe_message(exc)}")


#: Per-key lists in event metadata stop here: a partition of 1,000 tenants stays readable in the UI, and the full list
#: is in the ledger (``export-ledger status``), named in the metadata by the command to run.
LISTED_KEYS = 20


def status_command(export: str, partition_keys: list[str]) -> str:
    """The command that lists every key of these partitions."""
    first, last = min(partition_keys), max(partition_keys)
    return f"export-ledger status --export {export} --from {first} --to {last}"


def location_value(location: str) -> dg.MetadataValue:
    """A published location as the UI shows it: a URL (``s3://...``) as a link, a folder path as a path."""
    return dg.MetadataValue.url(location) if "://" in location else dg.MetadataValue.path(location)


#: The per-key table of a partition's event: one row per key, the first LISTED_KEYS of them.
KEY_TABLE_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("tenant", "string"),
        dg.TableColumn(
            "status",
            "string",
            description="exported, repaired, already_completed, restated, or unchanged (a restatement whose data was "
            "the current revision's: nothing published)",
        ),
        dg.TableColumn("rows", "int"),
        dg.TableColumn("revision", "int"),
        dg.TableColumn("sha256", "string", description="the first 16 hex digits of the data file's sha256"),
        dg.TableColumn("location", "string"),
    ]
)


def key_table(rows: list[tuple[str, str, int | None, int | None, str | None, str | None]]) -> dg.MetadataValue:
    """``(tenant, status, rows, revision, sha256, location)`` per key, as a table the UI renders."""
    records = [
        dg.TableRecord(
            {
                "tenant": tenant,
                "status": status,
                "rows": rows_ if rows_ is not None else 0,
                "revision": revision if revision is not None else 1,
                "sha256": (sha256 or "")[:16],
                "location": location or "",
            }
        )
        for tenant, status, rows_, revision, sha256, location in rows[:LISTED_KEYS]
    ]
    return dg.MetadataValue.table(records, schema=KEY_TABLE_SCHEMA)


def partition_metadata(results: list[ExportResult], *, restatements: Mapping[str, Restatement] | None = None) -> dict:
    """The materialization metadata of one partition's keys in one run: its own counts (never the run's), a table of
    its first :data:`LISTED_KEYS` keys, ``dagster/row_count`` (the rows of every key of the partition as the run
    leaves them, skipped ones included) and the published location (typed: a path or a URL) of a one-key partition.

    A restated key (a new revision published by this run) is counted in ``restated_keys`` and named in ``revisions``
    with its revision, the one it supersedes and the request's reason (``restatements``: per key, the request it
    published, as :func:`export_ledger.restate.published_revisions` reads it).
    """
    done = [r for r in results if r.status not in ("already_completed", "unchanged")]
    restated = [r for r in done if r.revision > 1]
    unchanged = sum(r.status == "unchanged" for r in results)
    metadata: dict = {
        "keys": len(results),
        "exported_keys": len(done),
        "skipped_keys": sum(r.status == "already_completed" for r in results),
        "repaired_keys": sum(r.status == "repaired" for r in results),
        "rows_exported": sum(r.row_count for r in done),
        "dagster/row_count": sum(r.row_count for r in results),
        "key_table": key_table(
            [
                (r.tenant, "restated" if r in restated else r.status, r.row_count, r.revision, r.sha256, r.location)
                for r in results
            ]
        ),
    }
    if unchanged:
        # A restatement whose data was the current revision's: nothing published, the request closed unchanged.
        metadata["unchanged_keys"] = unchanged
    if len(results) == 1 and results[0].location:
        metadata["location"] = location_value(results[0].location)
    if restated:
        reasons = restatements or {}
        metadata["restated_keys"] = len(restated)
        metadata["revisions"] = dg.MetadataValue.json(
            {
                r.logical_key: {
                    "revision": r.revision,
                    "supersedes": r.supersedes,
                    "reason": reasons[r.logical_key].reason if r.logical_key in reasons else None,
                    "requested_by": reasons[r.logical_key].requested_by if r.logical_key in reasons else None,
                }
                for r in restated[:LISTED_KEYS]
            }
        )
    if len(results) > LISTED_KEYS:
        export = results[0].logical_key.split("/", 1)[0]
        metadata["all_keys"] = dg.MetadataValue.text(
            f"{len(results)} keys; the first {LISTED_KEYS} are listed. Every key: "
            + status_command(export, [r.partition_key for r in results])
        )
    if len(restated) > LISTED_KEYS:
        metadata["all_revisions"] = dg.MetadataValue.text(
            f"{len(restated)} keys restated; the first {LISTED_KEYS} are listed. Each key's history: "
            "export-ledger revisions KEY"
        )
    return metadata


def by_partition(results: list[ExportResult]) -> dict[str, list[ExportResult]]:
    """A run's results per partition key, in partition order."""
    grouped: dict[str, list[ExportResult]] = {}
    for result in sorted(results, key=lambda r: r.partition_key):
        grouped.setdefault(result.partition_key, []).append(result)
    return grouped


def add_partition_metadata(
    context: dg.OutputContext, results: list[ExportResult], attempt: str, restatements: Mapping[str, Restatement]
) -> None:
    """Each partition's own metadata, and the run's attempt id, onto its own materialization.

    Dagster copies an output's metadata onto every partition's event of a multi-partition run; what is added per
    partition (to the step's asset metadata, read when the events are built after ``handle_output``) is that
    partition's alone."""
    grouped = by_partition(results)
    step = context.step_context if context.has_asset_key and context.has_asset_partitions else None
    if step is None or not grouped:
        context.add_output_metadata({"attempt_id": attempt, **partition_metadata(results, restatements=restatements)})
        return
    for partition_key, mine in grouped.items():
        step.add_asset_metadata(
            {"attempt_id": attempt, **partition_metadata(mine, restatements=restatements)},
            asset_key=context.asset_key, partition_key=partition_key,
        )  # fmt: skip
