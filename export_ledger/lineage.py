"""OpenLineage run events for export runs: what a run read, what it published, and under which revision.

Plain Python (no Dagster): the I/O manager calls :meth:`LineageEmitter.start` before it exports a batch and
:meth:`LineageEmitter.finish` after, with the run's id (a UUID: Dagster's run id) and the job's name (the asset's).

What an event holds, and why:

* one **input** dataset, the source, named without secrets: a :class:`~export_ledger.sources.SqlSource` by its
  database (``postgresql://host:5432`` / ``dbname``; never the user, password or query parameters), a callable
  source by its qualified name, any other :class:`~export_ledger.sources.ExportSource` by its class's;
* one **output** dataset per destination and export (the export's folder, prefix or table), not one per key: a
  consumer reads the export as one dataset partitioned by tenant and date (``<root>/<export>/*/*/data.csv``), and a
  dataset per key would give a lineage catalog a new dataset per tenant and day (365,000 a year for 1,000 tenants).
  Its facets: the export's columns and kinds (``schema``); in COMPLETE and FAIL, as output facets, the rows this run
  published (``outputStatistics``) and the keys it published with their revisions (``exportLedger``: the first
  :data:`LISTED_KEYS`, and how many in all).

Never in an event: rows, source error text, URLs' credentials. A receiver that is down or answers an error changes
nothing about the export (it is durable and recorded before the COMPLETE event is sent): it is logged as a warning
naming the receiver's host.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from export_ledger.destinations import Destination
from export_ledger.errors import ConfigurationError
from export_ledger.frames import ExportSchema, FrameBatches
from export_ledger.protocol import ExportBatch, ExportResult
from export_ledger.settings import OPENLINEAGE_API_KEY_ENV, OPENLINEAGE_URL_ENV, Settings
from export_ledger.sources import CallableSource, ExportSource, SqlSource
from export_ledger.spec import ExportSpec

UTC = dt.timezone.utc
#: This library as the events' producer, and the names of its custom facets' schemas: URNs, since export-ledger
#: publishes no URL of its own (the facets are described in this module's docstring and docs/lineage-metrics.md).
PRODUCER = "urn:export-ledger"
#: Keys listed per output dataset; the count is exact (every key is in the ledger: ``export-ledger status``).
LISTED_KEYS = 20
#: A receiver gets this long to answer, and one retry: an export waits seconds at most for an absent receiver.
TIMEOUT_SECONDS = 5.0
RETRY = {"total": 1, "connect": 1, "read": 1, "backoff_factor": 0.2, "status_forcelist": [502, 503, 504],
         "allowed_methods": ["POST"]}  # fmt: skip

Log = Callable[[str, str], None]


@dataclass(frozen=True)
class DatasetName:
    """An OpenLineage dataset identity (https://openlineage.io/docs/spec/naming)."""

    namespace: str
    name: str


def source_dataset(source: ExportSource) -> DatasetName:
    """The source's identity without secrets."""
    if isinstance(source, SqlSource):
        return database_dataset(source.url)
    if isinstance(source, CallableSource):
        return DatasetName("python", _qualified_name(source.fn))
    return DatasetName("python", _qualified_name(type(source)))


def database_dataset(url: str) -> DatasetName:
    """A database as ``<backend>://host:port`` and its database name: user, password and query parameters (which can
    carry tokens) are left out. SQLite: the file path, in namespace ``sqlite``."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return DatasetName("sqlite", parsed.database or ":memory:")
    port = f":{parsed.port}" if parsed.port else ""
    return DatasetName(f"{backend}://{parsed.host or 'localhost'}{port}", parsed.database or "")


def destination_dataset(destination: Destination, export: str) -> DatasetName:
    """The export's dataset at ``destination`` (:meth:`~export_ledger.destinations.Destination.dataset`): its table,
    or the folder or object prefix that holds its key folders."""
    return DatasetName(*destination.dataset(export))


def batch_source(batch: ExportBatch) -> ExportSource | None:
    """The source an export asset's batch reads from, found from its items' readers (a reader of
    :meth:`ExportSpec.read <export_ledger.spec.ExportSpec.read>`, or a stream of a source); None when the rows came
    as frames (an asset of the user's own: the rows' source is that asset's business) or no key read any."""
    for item in batch.items:
        reader = item.frame
        if isinstance(reader, functools.partial) and isinstance(getattr(reader.func, "__self__", None), ExportSpec):
            return reader.func.__self__.source
        if isinstance(reader, FrameBatches):
            source = getattr(reader._batches, "source", None)  # ExportItem.streamed's lazy batches
            if isinstance(source, ExportSource):
                return source
    return None


def _qualified_name(thing) -> str:
    return f"{getattr(thing, '__module__', '?')}.{getattr(thing, '__qualname__', type(thing).__qualname__)}"


class LineageEmitter:
    """Sends an export run's START and COMPLETE (or FAIL) events to one OpenLineage HTTP receiver.

    Args:
        url: The receiver's base URL (events are POSTed to ``<url>/api/v1/lineage``).
        namespace: The jobs' OpenLineage namespace.
        api_key: A bearer token for the receiver, or None.
        log: ``log(level, message)``: where a receiver's failure is reported (a warning).

    Example:
        >>> emitter = LineageEmitter.from_settings(Settings.from_environment(), log=log)  # doctest: +SKIP
        >>> emitter.start(run_id, "invoice_export", batch, destination)  # doctest: +SKIP
    """

    def __init__(self, url: str, *, namespace: str, api_key: str | None = None, log: Log) -> None:
        try:
            from openlineage.client import OpenLineageClient
            from openlineage.client.transport.http import ApiKeyTokenProvider, HttpConfig, HttpTransport
        except ImportError:
            raise ConfigurationError(
                f"{OPENLINEAGE_URL_ENV} is set but openlineage-python is not installed: install the lineage extra "
                "(pip install 'export-ledger[lineage]'), or unset it"
            ) from None
        auth = ApiKeyTokenProvider({"api_key": api_key}) if api_key else None
        config = HttpConfig(url=url, timeout=TIMEOUT_SECONDS, retry=RETRY, **({"auth": auth} if auth else {}))
        self.client = OpenLineageClient(transport=HttpTransport(config))
        parts = urlsplit(url)
        self.receiver = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
        self.namespace = namespace
        self.log = log

    @classmethod
    def from_settings(cls, settings: Settings, *, log: Log) -> LineageEmitter | None:
        """The emitter the settings ask for; None when ``EXPORTS_OPENLINEAGE_URL`` is unset."""
        if settings.openlineage_url is None:
            return None
        return cls(settings.openlineage_url, namespace=settings.openlineage_namespace,
                   api_key=settings.environ.get(OPENLINEAGE_API_KEY_ENV) or None, log=log)  # fmt: skip

    def start(self, run_id: str, job: str, batch: ExportBatch, destination: Destination) -> None:
        """The START event: what the run reads and where it publishes (no statistics yet)."""
        self._emit("START", run_id, job, batch, destination, results=None)

    def finish(self, run_id: str, job: str, batch: ExportBatch, destination: Destination, *, failed: bool) -> None:
        """COMPLETE, or FAIL when some key failed: either way with the keys the run did publish (they are durable
        and recorded, whatever happened to the others)."""
        self._emit("FAIL" if failed else "COMPLETE", run_id, job, batch, destination, results=batch.results)
        self.client.close()  # the run's last event: its HTTP session is not kept

    def _emit(self, state: str, run_id: str, job: str, batch: ExportBatch, destination: Destination,
              *, results: Sequence[ExportResult] | None) -> None:  # fmt: skip
        try:
            event = self._event(state, run_id, job, batch, destination, results)
            self.client.emit(event)
        except Exception as exc:  # the export stands whatever the receiver does: report, never raise
            status = getattr(getattr(exc, "response", None), "status_code", None)
            answered = f", HTTP {status}" if status else ""
            self.log(
                "warning",
                f"OpenLineage {state} event for run {run_id} not delivered to {self.receiver}: "
                f"{type(exc).__name__}{answered}; the export is unaffected",
            )

    def _event(self, state, run_id, job, batch, destination, results):
        from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState

        export = _export_name(batch, job)
        source = batch_source(batch)
        inputs = [] if source is None else [InputDataset(**vars(source_dataset(source)))]
        output = destination_dataset(destination, export)
        published = None if results is None else [r for r in results if r.status != "already_completed"]
        return RunEvent(
            eventType=getattr(RunState, state),
            eventTime=dt.datetime.now(UTC).isoformat(),
            run=Run(runId=run_id, facets={"exportLedger": _run_facet(export, batch, results)}),
            job=Job(namespace=self.namespace, name=job),
            inputs=inputs,
            outputs=[
                OutputDataset(
                    output.namespace, output.name, facets={"schema": _schema_facet(batch.schema)},
                    outputFacets={} if published is None else _published_facets(published),
                )
            ],  # fmt: skip
            producer=PRODUCER,
        )


def _export_name(batch: ExportBatch, job: str) -> str:
    return batch.items[0].key.export if batch.items else job


def _schema_facet(schema: ExportSchema):
    from openlineage.client.generated.schema_dataset import SchemaDatasetFacet, SchemaDatasetFacetFields

    return SchemaDatasetFacet(
        fields=[SchemaDatasetFacetFields(name=name, type=kind, ordinal_position=position)
                for position, (name, kind) in enumerate(schema.columns.items(), start=1)]  # fmt: skip
    )


def _published_facets(published: Sequence[ExportResult]) -> dict:
    from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet

    return {
        "outputStatistics": OutputStatisticsOutputDatasetFacet(rowCount=sum(r.row_count for r in published)),
        "exportLedger": _facet_class("dataset")(
            keys=len(published),
            listed=[
                {"logical_key": r.logical_key, "partition_key": r.partition_key, "status": r.status,
                 "revision": r.revision, "supersedes": r.supersedes, "row_count": r.row_count}  # fmt: skip
                for r in published[:LISTED_KEYS]
            ],
        ),
    }


def _run_facet(export: str, batch: ExportBatch, results):
    partitions = sorted({item.partition_key for item in batch.items})
    return _facet_class("run")(
        export=export,
        keys=len(batch.items),
        first_partition=partitions[0] if partitions else None,
        last_partition=partitions[-1] if partitions else None,
        failed_keys=None if results is None else len(batch.failures),
    )


@functools.cache
def _facet_class(kind: str):
    """The custom facets (built on first use: the OpenLineage client is an optional dependency)."""
    import attr
    from openlineage.client.generated.base import OutputDatasetFacet, RunFacet

    schema = f"{PRODUCER}:facet:{kind}"
    if kind == "run":

        @attr.define
        class ExportLedgerRunFacet(RunFacet):
            """The export and the keys this run was asked for (counts and partitions, no rows)."""

            export: str
            keys: int
            first_partition: str | None
            last_partition: str | None
            failed_keys: int | None

            @staticmethod
            def _get_schema() -> str:
                return schema

        return ExportLedgerRunFacet

    @attr.define
    class ExportLedgerDatasetFacet(OutputDatasetFacet):
        """The keys this run published to the dataset: how many, and the first ones with revision and rows."""

        keys: int
        listed: list

        @staticmethod
        def _get_schema() -> str:
            return schema

    return ExportLedgerDatasetFacet
