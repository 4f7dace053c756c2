"""One export attempt from a JSON-able spec, and what a reader can see at a destination afterwards.

Pytest-free: the fork server's children run :func:`child_main`, and the harness tests run :func:`run_attempt` in
process (with a ledger clock shifted past dead attempts' leases) and check destinations with :func:`survey` and
:func:`violations`.

An attempt goes through the project's own write path: ``export_ledger.export_batch`` (the one write protocol) called
directly (mode ``io_manager``, about 0.1 s), or the whole ``invoice_export_job`` with ``execute_in_process`` on an
ephemeral instance (mode ``job``, about 0.3 s).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import dagster as dg
import sqlalchemy as sa

from assets.invoices import EXPORT_NAME, INVOICE_SCHEMA
from definitions import build_definitions
from export_ledger.calendar import window_for
from export_ledger.dagster import LedgerResource
from export_ledger.destinations import Destination, ExportTarget, LocalDestination
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import MANIFEST_NAME, Manifest, ManifestError, validate_frame, write_table
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ExportLedger, ledger_engine, utc_now
from export_ledger.ledger.schema import AttemptOutcome, ExportState
from export_ledger.protocol import ExportBatch, ExportItem, export_batch
from resources.invoices import SampleInvoiceSource

JOB = "invoice_export_job"
ZONE = "America/New_York"
EFFECTS = (AttemptOutcome.COMPLETED, AttemptOutcome.REPAIRED)  # attempt rows that record an export's effect


class OffsetClockLedgerResource(LedgerResource):
    """The project's ledger resource with its clock shifted: the harness's way to stand after a dead lease.

    Attributes:
        clock_offset_seconds: Added to the wall clock (negative: a claim made in the past, its lease long expired).
    """

    clock_offset_seconds: float = 0.0

    def clock(self) -> dt.datetime:
        return utc_now() + dt.timedelta(seconds=self.clock_offset_seconds)


@dataclass
class AttemptSpec:
    """Everything one attempt needs, as JSON: a child process receives it over a pipe.

    ``destination`` is ``{"kind": "local", "root": ...}``, ``{"kind": "s3", "bucket", "prefix", "endpoint_url",
    "access_key_id", "secret_access_key"}`` or ``{"kind": "sql", "table": ...}`` (in the ledger's database).
    """

    ledger_url: str
    destination: dict
    business_date: str
    run_id: str
    tenant: str = "acme"
    timezone: str = ZONE
    mode: str = "io_manager"  # or "job"
    lease_ttl_seconds: int = 60
    clock_offset_seconds: float = 0.0
    cadence_minutes: int = 15  # of the sample source: another cadence is a source that changed between attempts
    failpoints: str = ""
    result_path: str | None = None
    log_path: str | None = None
    tmpdir: str | None = None  # where the S3 destination stages its local temporary file

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AttemptSpec:
        return cls(**json.loads(text))

    @property
    def attempt_id(self) -> str:
        """The ledger's attempt id in ``io_manager`` mode (in ``job`` mode Dagster picks the run id)."""
        return f"{self.run_id}/{EXPORT_NAME}"

    @property
    def logical_key(self) -> str:
        return str(logical_key(self.tenant, self.business_date, self.timezone))

    @property
    def target(self) -> ExportTarget:
        return ExportTarget(EXPORT_NAME, self.tenant, self.business_date)


def logical_key(tenant: str, business_date: str, timezone: str = ZONE) -> LogicalKey:
    return LogicalKey(EXPORT_NAME, tenant, window_for(dt.date.fromisoformat(business_date), timezone))


def build_destination(spec: dict, ledger_url: str) -> Destination:
    kind = spec["kind"]
    if kind == "local":
        return LocalDestination(root=spec["root"])
    if kind == "sql":
        return SqlTableDestination(url=ledger_url, table=spec["table"])
    if kind == "s3":
        from export_ledger.destinations.s3 import S3Destination

        return S3Destination(
            bucket=spec["bucket"],
            prefix=spec.get("prefix", ""),
            endpoint_url=spec["endpoint_url"],
            access_key_id=spec.get("access_key_id", "testing"),
            secret_access_key=spec.get("secret_access_key", "testing"),
            connect_timeout_seconds=5,
            read_timeout_seconds=10,
        )
    raise ValueError(f"unknown destination kind {kind!r}")


def ledger_resource(spec: AttemptSpec) -> OffsetClockLedgerResource:
    return OffsetClockLedgerResource(
        url=spec.ledger_url, lease_ttl_seconds=spec.lease_ttl_seconds, clock_offset_seconds=spec.clock_offset_seconds
    )


def run_attempt(spec: AttemptSpec) -> dict:
    """Runs one attempt and returns what it reported: ``status`` (``exported``, ``repaired``,
    ``already_completed``, ``succeeded`` in job mode, or ``failed``), ``error_class`` and ``error``.

    Failpoints come from the environment (:func:`child_main` sets them in a child); this function never sets them.
    """
    ledger = ledger_resource(spec)
    destination = build_destination(spec.destination, spec.ledger_url)
    source = SampleInvoiceSource(cadence_minutes=spec.cadence_minutes)
    if spec.mode == "job":
        defs = build_definitions(
            spec.timezone, tenants=[spec.tenant], ledger=ledger, destination=destination, source=source, environ={}
        )
        result = defs.resolve_job_def(JOB).execute_in_process(
            partition_key=spec.business_date, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False
        )
        report = {"run_id": result.run_id, "attempt_id": f"{result.run_id}/{EXPORT_NAME}"}
        if result.success:
            return {**report, "status": "succeeded", "error_class": None, "error": None}
        error_class, error = _step_failure(result)
        return {**report, "status": "failed", "error_class": error_class, "error": error}

    key = logical_key(spec.tenant, spec.business_date, spec.timezone)
    frame = source.rows(spec.tenant, key.window.start_utc, key.window.end_utc)
    batch = ExportBatch(INVOICE_SCHEMA, [ExportItem(key, spec.business_date, frame)])
    report = {"run_id": spec.run_id, "attempt_id": spec.attempt_id}
    try:
        export_batch(ledger.get_ledger(), destination, batch, spec.attempt_id)
    except Exception as exc:  # the attempt's own failure is its report, not the harness's
        return {**report, "status": "failed", "error_class": type(exc).__name__, "error": str(exc)[:4000]}
    (result,) = batch.results
    return {**report, "status": result.status, "error_class": None, "error": None}


def _step_failure(result: dg.ExecuteInProcessResult) -> tuple[str | None, str]:
    for event in result.all_events:
        if event.is_step_failure:
            error = event.step_failure_data.error
            classes, messages = [], []
            while error is not None:
                classes.append(error.cls_name)
                messages.append(error.message)
                error = error.cause
            # The innermost cause is the project's own exception; Dagster wraps it in its step error.
            return classes[-1], "\n".join(messages)[:4000]
    return None, "the run failed without a step failure"


def child_main(spec: AttemptSpec) -> int:
    """The body of a forked child: set its failpoints and temp folder, run the attempt, write the result file.

    The result file is written whole and renamed into place, so the harness never reads half of one; a child killed
    before it leaves none.
    """
    if spec.failpoints:
        os.environ[FAILPOINTS] = spec.failpoints
    else:
        os.environ.pop(FAILPOINTS, None)
    if spec.tmpdir:
        tempfile.tempdir = spec.tmpdir
    result = run_attempt(spec)
    if spec.result_path:
        partial = f"{spec.result_path}.partial"
        with open(partial, "w") as handle:
            json.dump(result, handle)
        os.rename(partial, spec.result_path)
    return 0 if result["status"] != "failed" else 1


def warm_up() -> None:
    """Loads what an attempt loads lazily (Arrow's CSV writer, pandas paths) without
    opening any database, socket, file or thread, so that forked children start warm and share nothing."""
    import io

    window = window_for(dt.date(2026, 3, 8), ZONE)
    frame = SampleInvoiceSource().rows("acme", window.start_utc, window.end_utc)
    table = validate_frame(frame, INVOICE_SCHEMA, window, what="warm-up")
    write_table(table, "csv", io.BytesIO())
    try:  # the [s3] extra: importing it here saves each S3 child the import
        import boto3  # noqa: F401
        import botocore.config  # noqa: F401
        import resources.s3_destination  # noqa: F401
    except ImportError:
        pass


# -- what a reader can see --------------------------------------------------------------------------------------


@dataclass
class Published:
    """One export a reader can see: its manifest and whether the data it names is there, intact."""

    where: str
    manifest: Manifest | None
    intact: bool
    problem: str = ""


@dataclass
class Survey:
    """Everything visible at a destination, plus what the protocol hides from readers.

    ``exports`` maps logical keys to every visible export of that key (more than one is a duplicate); ``partial`` lists
    visible things that are not a whole export; ``hidden`` lists leftovers readers never see by protocol (local
    staging folders, S3 data objects without a manifest); ``rows`` counts SQL rows per logical key.
    """

    exports: dict[str, list[Published]] = field(default_factory=dict)
    partial: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    rows: Counter = field(default_factory=Counter)

    def add(self, published: Published) -> None:
        if published.manifest is None or not published.intact:
            self.partial.append(f"{published.where}: {published.problem}")
            return
        self.exports.setdefault(published.manifest.logical_key, []).append(published)

    def hidden_for(self, business_date: str) -> list[str]:
        return [item for item in self.hidden if f"date={business_date}" in item]


def survey(destination_spec: dict, ledger_url: str, *, s3_client=None, only: ExportTarget | None = None) -> Survey:
    """Looks at the destination directly (the folder tree, the bucket listing on the server, the tables) rather than
    through the destination's ``probe``; only the ledger table's rows are read back with the destination's own
    serialization, to compare their sha256. ``only`` limits the look to one target's place (a trial's key), so that
    a check per trial does not grow with the number of trials."""
    kind = destination_spec["kind"]
    if kind == "local":
        return _survey_local(Path(destination_spec["root"]), only)
    if kind == "s3":
        return _survey_s3(s3_client, destination_spec["bucket"], destination_spec.get("prefix", ""), only)
    if kind == "sql":
        return _survey_sql(ledger_url, destination_spec["table"], only)
    raise ValueError(kind)


def _survey_local(root: Path, only: ExportTarget | None) -> Survey:
    found = Survey()
    if not root.exists():
        return found
    if only is None:
        paths = sorted(root.rglob("*"))
    else:
        tenant_dir = root.joinpath(*only.parts[:2])
        mine = (f"date={only.business_date}", f".staging-date={only.business_date}-")
        paths = [tenant_dir] if tenant_dir.exists() else []
        for entry in sorted(tenant_dir.iterdir()) if tenant_dir.is_dir() else ():
            if entry.name == mine[0] or entry.name.startswith(mine[1]):
                paths.append(entry)
                paths.extend(sorted(entry.rglob("*")))
    for path in paths:
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            if path.parent.name.startswith("tenant=") and path.name.startswith(".staging-"):
                found.hidden.append(str(relative))
            continue  # readers ignore dot-folders and everything in them
        depth = len(relative.parts)
        if depth < 3:
            if not path.is_dir():
                found.partial.append(f"{relative}: a file where an export folder belongs")
            continue
        if depth == 3:
            found.add(_local_export(path, str(relative)))
        elif depth > 4 or not path.parent.is_dir():
            found.partial.append(f"{relative}: stray entry")
    return found


def _local_export(folder: Path, where: str) -> Published:
    if not folder.is_dir():
        return Published(where, None, False, "not a folder")
    names = {p.name for p in folder.iterdir()}
    if MANIFEST_NAME not in names:
        return Published(where, None, False, f"folder without a manifest ({sorted(names)})")
    try:
        manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes(), where)
    except ManifestError as exc:
        return Published(where, None, False, str(exc))
    if names != {MANIFEST_NAME, manifest.data_file}:
        return Published(where, manifest, False, f"unexpected files {sorted(names)}")
    payload = (folder / manifest.data_file).read_bytes()
    if hashlib.sha256(payload).hexdigest() != manifest.sha256:
        return Published(where, manifest, False, "data file does not match its manifest's sha256")
    return Published(where, manifest, True)


def _survey_s3(client, bucket: str, prefix: str, only: ExportTarget | None) -> Survey:
    found = Survey()
    folders: dict[str, set[str]] = {}
    start = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    if only is not None:
        start += "/".join(only.parts) + "/"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start):
        for item in page.get("Contents", []):
            folder, _, name = item["Key"].rpartition("/")
            if folder.endswith(".export-ledger-probe"):
                continue  # the destination's check of conditional creates, not an export
            folders.setdefault(folder, set()).add(name)
    for folder, names in sorted(folders.items()):
        where = f"s3://{bucket}/{folder}/"
        objects = {name: client.get_object(Bucket=bucket, Key=f"{folder}/{name}") for name in names}
        bodies = {name: obj["Body"].read() for name, obj in objects.items()}
        torn = [
            name
            for name, obj in objects.items()
            if name != MANIFEST_NAME and hashlib.sha256(bodies[name]).hexdigest() != obj["Metadata"].get("sha256")
        ]
        if MANIFEST_NAME not in names:
            # A data object without its manifest is invisible by protocol; a torn one would still be a defect.
            found.hidden.extend(f"{where}{name}" for name in sorted(names))
            found.partial.extend(f"{where}{name}: object bytes do not match its sha256 metadata" for name in torn)
            continue
        try:
            manifest = Manifest.from_json(bodies[MANIFEST_NAME], where)
        except ManifestError as exc:
            found.add(Published(where, None, False, str(exc)))
            continue
        # Data objects the manifest does not name are orphans of failed or fenced attempts: readers never see them
        # (they read what the manifest names), so they are hidden leftovers, not partial exports.
        orphans = sorted(name for name in names - {MANIFEST_NAME, manifest.data_file} if name.startswith("data-t"))
        found.hidden.extend(f"{where}{name}" for name in orphans)
        torn = [name for name in torn if name not in orphans]
        if names - set(orphans) != {MANIFEST_NAME, manifest.data_file}:
            found.add(Published(where, manifest, False, f"objects {sorted(names)}"))
        elif torn or hashlib.sha256(bodies[manifest.data_file]).hexdigest() != manifest.sha256:
            found.add(Published(where, manifest, False, "data object does not match its manifest's sha256"))
        else:
            found.add(Published(where, manifest, True))
    return found


def _survey_sql(ledger_url: str, table: str, only: ExportTarget | None) -> Survey:
    found = Survey()
    engine = ledger_engine(ledger_url)
    with engine.connect().execution_options(ledger_read_only=True) as conn:
        inspector = sa.inspect(conn)
        present = [inspector.has_table(table), inspector.has_table(f"{table}_manifests")]
        if not all(present):
            if any(present):
                found.partial.append(f"sql:{table}: rows table and manifests table do not exist together")
            return found
        # Only the columns read here, named as the README describes the layout (no reflection: a check per trial).
        rows_table = sa.table(table, sa.column("logical_key"))
        manifests = sa.table(
            f"{table}_manifests",
            *(sa.column(c) for c in ("export", "tenant", "business_date", "logical_key", "manifest")),
        )
        counts = sa.select(rows_table.c.logical_key, sa.func.count()).group_by(rows_table.c.logical_key)
        listing = sa.select(manifests)
        if only is not None:
            key = str(logical_key(only.tenant, only.business_date))
            counts = counts.where(rows_table.c.logical_key == key)
            listing = listing.where(
                manifests.c.export == only.export,
                manifests.c.tenant == only.tenant,
                manifests.c.business_date == only.business_date,
            )
        rows = Counter({key: count for key, count in conn.execute(counts)})
        manifest_rows = list(conn.execute(listing))
    found.rows = rows
    destination = SqlTableDestination(url=ledger_url, table=table)
    keys_with_manifest = set()
    for row in manifest_rows:
        where = f"sql:{table}/{row.export}/tenant={row.tenant}/date={row.business_date}"
        manifest = Manifest.from_json(row.manifest.encode(), where)
        keys_with_manifest.add(manifest.logical_key)
        target = ExportTarget(row.export, row.tenant, row.business_date)
        payload = destination.read_data(target, manifest)
        if rows[manifest.logical_key] != manifest.row_count:
            found.add(
                Published(
                    where, manifest, False, f"{rows[manifest.logical_key]} rows, manifest says {manifest.row_count}"
                )
            )
        elif hashlib.sha256(payload).hexdigest() != manifest.sha256:
            found.add(Published(where, manifest, False, "rows do not match the manifest's sha256"))
        else:
            found.add(Published(where, manifest, True))
    for key, count in rows.items():
        if key not in keys_with_manifest:
            found.partial.append(f"sql:{table}: {count} rows of {key} without a manifest row")  # visible to readers
    return found


# -- invariants ---------------------------------------------------------------------------------------------------


def violations(ledger: ExportLedger, found: Survey, keys: list[str] | None = None, *, final: bool) -> dict[str, list]:
    """The crash and race invariants, as lists of offending keys or things (every list must be empty).

    Args:
        found: What the destination shows: all of it when ``keys`` is None, else at least those keys' places.
        keys: The logical keys to check; None checks every key in the ledger against a survey of everything.
        final: After the last attempt: every key must be completed with exactly one recorded effect.
    """
    if keys is None:
        records = {r.logical_key: r for r in ledger.records()}
        keys = sorted(records)
    else:
        records = {key: ledger.get(key) for key in keys}
    problems: dict[str, list] = {
        "duplicate_exports": [k for k, exports in found.exports.items() if len(exports) > 1],
        "visible_partial": list(found.partial),
        "completed_without_export": [],
        "not_completed": [],
        "effects_not_one": [],
    }
    for key in keys:
        record = records.get(key)
        if record is not None and record.state is ExportState.COMPLETED:
            exports = found.exports.get(key, [])
            if not any(p.manifest.sha256 == record.sha256 for p in exports):
                problems["completed_without_export"].append(key)
        if final:
            if record is None or record.state is not ExportState.COMPLETED:
                problems["not_completed"].append(f"{key}: {record.state.value if record else 'no record'}")
            effects = [a for a in ledger.attempts(key) if a.outcome in EFFECTS]
            if len(effects) != 1:
                problems["effects_not_one"].append(f"{key}: {[a.outcome.value for a in effects]}")
    return problems
