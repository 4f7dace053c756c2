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
from export_ledger.destinations.base import CURRENT_NAME
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
    """One export a reader can see: its manifest and whether the data it names is there, intact.

    ``revision`` is the revision its place says (``date=D`` is revision 1, ``date=D/revision=N`` revision N); a
    manifest that names another revision is not intact.
    """

    where: str
    manifest: Manifest | None
    intact: bool
    problem: str = ""
    revision: int = 1


@dataclass
class Pointer:
    """A key's current pointer (``date=D/_current.json``) as a reader reads it."""

    where: str
    logical_key: str
    revision: int
    sha256: str | None
    path: str


@dataclass
class Survey:
    """Everything visible at a destination, plus what the protocol hides from readers.

    ``exports`` maps logical keys to every visible export of that key, one per published revision (two of one
    revision are a duplicate); ``pointers`` maps logical keys to their current pointer (none: revision 1 is current);
    ``partial`` lists visible things that are not a whole export (or an unreadable pointer); ``hidden`` lists
    leftovers readers never see by protocol (local staging folders and pointer temp files, S3 data objects without a
    manifest); ``rows`` counts SQL rows per row key (a revision's, for a ledger table).
    """

    exports: dict[str, list[Published]] = field(default_factory=dict)
    pointers: dict[str, Pointer] = field(default_factory=dict)
    partial: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    rows: Counter = field(default_factory=Counter)

    def add(self, published: Published) -> None:
        if published.manifest is None or not published.intact:
            self.partial.append(f"{published.where}: {published.problem}")
            return
        self.exports.setdefault(published.manifest.logical_key, []).append(published)

    def add_pointer(self, where: str, payload: bytes) -> None:
        """Reads a pointer the way an outside reader does; one that does not parse is a visible defect."""
        try:
            values = json.loads(payload)
            pointer = Pointer(
                where, str(values["logical_key"]), values["revision"], values.get("sha256"), values.get("path", "")
            )
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            self.partial.append(f"{where}: a current pointer that is not a JSON object with a key and a revision")
            return
        if not isinstance(pointer.revision, int) or pointer.revision < 1:
            self.partial.append(f"{where}: a current pointer naming revision {pointer.revision!r}")
            return
        if pointer.logical_key in self.pointers:
            self.partial.append(f"{where}: a second current pointer for {pointer.logical_key}")
            return
        self.pointers[pointer.logical_key] = pointer

    def current(self, key: str) -> int:
        """The key's current revision as a reader resolves it: the pointer's, or 1 without one."""
        pointer = self.pointers.get(key)
        return 1 if pointer is None else pointer.revision

    def at(self, key: str, revision: int) -> list[Published]:
        """The key's visible exports of one revision (one, or none; more is a duplicate)."""
        return [p for p in self.exports.get(key, []) if p.revision == revision]

    def hidden_for(self, business_date: str) -> list[str]:
        return [item for item in self.hidden if f"date={business_date}" in item]


def revision_of(name: str) -> int | None:
    """N for a folder named ``revision=N`` (N >= 2), else None."""
    prefix, _, number = name.partition("=")
    if prefix != "revision" or not number.isdigit() or int(number) < 2 or str(int(number)) != number:
        return None
    return int(number)


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


#: Leftovers of dead attempts in a tenant's or key's folder that readers never see: staging folders (of revision 1
#: beside the key's folder, of a revision N inside it) and a current pointer's temporary file.
LOCAL_LEFTOVERS = (".staging-", ".current-")


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
        parts = relative.parts
        if any(part.startswith(".") for part in parts):
            if path.name.startswith(LOCAL_LEFTOVERS) and path.parent.name.startswith(("tenant=", "date=")):
                found.hidden.append(str(relative))
            continue  # readers ignore dot-names and everything in them (the pointer's lock file among them)
        depth = len(parts)
        if depth < 3:
            if not path.is_dir():
                found.partial.append(f"{relative}: a file where an export folder belongs")
            continue
        if depth == 3:
            found.add(_local_export(path, str(relative), 1))
        elif depth == 4 and path.name == CURRENT_NAME:
            if path.is_file():
                found.add_pointer(str(relative), path.read_bytes())
            else:
                found.partial.append(f"{relative}: a current pointer that is not a file")
        elif depth == 4 and revision_of(path.name) is not None and path.is_dir():
            found.add(_local_export(path, str(relative), revision_of(path.name)))
        elif depth == 5 and revision_of(parts[3]) is not None and path.parent.is_dir():
            continue  # a revision's own files, checked with it
        elif depth > 4 or not path.parent.is_dir():
            found.partial.append(f"{relative}: stray entry")
    return found


def _local_export(folder: Path, where: str, revision: int) -> Published:
    if not folder.is_dir():
        return Published(where, None, False, "not a folder", revision)
    names = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
    if revision == 1:  # the key's folder also holds its later revisions and its current pointer
        names = {name for name in names if name != CURRENT_NAME and revision_of(name) is None}
    if MANIFEST_NAME not in names:
        return Published(where, None, False, f"folder without a manifest ({sorted(names)})", revision)
    try:
        manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes(), where)
    except ManifestError as exc:
        return Published(where, None, False, str(exc), revision)
    if names != {MANIFEST_NAME, manifest.data_file}:
        return Published(where, manifest, False, f"unexpected files {sorted(names)}", revision)
    if manifest.revision != revision:
        return Published(where, manifest, False, f"manifest of revision {manifest.revision} in this place", revision)
    payload = (folder / manifest.data_file).read_bytes()
    if hashlib.sha256(payload).hexdigest() != manifest.sha256:
        return Published(where, manifest, False, "data file does not match its manifest's sha256", revision)
    return Published(where, manifest, True, revision=revision)


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
        if CURRENT_NAME in names:  # the key's current pointer, in the key's folder beside revision 1's objects
            names.discard(CURRENT_NAME)
            found.add_pointer(f"{where}{CURRENT_NAME}", _s3_body(client, bucket, f"{folder}/{CURRENT_NAME}"))
            if not names:
                found.partial.append(f"{where}: a current pointer without revision 1 beside it")
                continue
        revision = revision_of(folder.rpartition("/")[2]) or 1
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
            found.add(Published(where, None, False, str(exc), revision))
            continue
        # Data objects the manifest does not name are orphans of failed or fenced attempts: readers never see them
        # (they read what the manifest names), so they are hidden leftovers, not partial exports.
        orphans = sorted(name for name in names - {MANIFEST_NAME, manifest.data_file} if name.startswith("data-t"))
        found.hidden.extend(f"{where}{name}" for name in orphans)
        torn = [name for name in torn if name not in orphans]
        if names - set(orphans) != {MANIFEST_NAME, manifest.data_file}:
            found.add(Published(where, manifest, False, f"objects {sorted(names)}", revision))
        elif torn or hashlib.sha256(bodies[manifest.data_file]).hexdigest() != manifest.sha256:
            found.add(Published(where, manifest, False, "data object does not match its manifest's sha256", revision))
        elif manifest.revision != revision:
            found.add(Published(where, manifest, False, f"manifest of revision {manifest.revision} here", revision))
        else:
            found.add(Published(where, manifest, True, revision=revision))
    return found


def _s3_body(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def _survey_sql(ledger_url: str, table: str, only: ExportTarget | None) -> Survey:
    """The ledger table as a reader reads it: every revision's manifest (``<table>_revisions`` once a key was
    restated, else the manifests row), the rows of each under its row key, and the key's current pointer (the
    ``<table>_manifests`` row, holding the current revision's manifest)."""
    found = Survey()
    engine = ledger_engine(ledger_url)
    with engine.connect().execution_options(ledger_read_only=True) as conn:
        inspector = sa.inspect(conn)
        present = [inspector.has_table(table), inspector.has_table(f"{table}_manifests")]
        if not all(present):
            if any(present):
                found.partial.append(f"sql:{table}: rows table and manifests table do not exist together")
            return found
        restated = inspector.has_table(f"{table}_revisions")  # made at the table's first restatement
        # Only the columns read here, named as the README describes the layout (no reflection: a check per trial).
        rows_table = sa.table(table, sa.column("logical_key"))
        place = ("export", "tenant", "business_date")
        manifests = sa.table(f"{table}_manifests", *(sa.column(c) for c in (*place, "logical_key", "manifest")))
        revisions = sa.table(f"{table}_revisions", *(sa.column(c) for c in (*place, "revision", "row_key", "manifest")))
        counts = sa.select(rows_table.c.logical_key, sa.func.count()).group_by(rows_table.c.logical_key)
        listing = sa.select(manifests)
        kept = sa.select(revisions)
        if only is not None:
            key = str(logical_key(only.tenant, only.business_date))
            counts = counts.where(
                sa.or_(
                    rows_table.c.logical_key == key,
                    rows_table.c.logical_key.startswith(f"{key}#revision=", autoescape=True),
                )
            )
            listing = listing.where(*(manifests.c[c] == getattr(only, c) for c in place))
            kept = kept.where(*(revisions.c[c] == getattr(only, c) for c in place))
        rows = Counter({row_key: count for row_key, count in conn.execute(counts)})  # per row key
        pointer_rows = list(conn.execute(listing))
        revision_rows = list(conn.execute(kept)) if restated else []
    found.rows = rows
    destination = SqlTableDestination(url=ledger_url, table=table)
    by_place: dict[tuple, list] = {}
    for row in revision_rows:
        by_place.setdefault((row.export, row.tenant, row.business_date), []).append(row)
    row_keys_read = set()
    for pointer_row in pointer_rows:
        place_of = (pointer_row.export, pointer_row.tenant, pointer_row.business_date)
        where = f"sql:{table}/{pointer_row.export}/tenant={pointer_row.tenant}/date={pointer_row.business_date}"
        pointer = Manifest.from_json(pointer_row.manifest.encode(), where)
        kept_rows = sorted(by_place.pop(place_of, []), key=lambda r: r.revision)
        # A key never restated: its manifests row is revision 1's manifest. A restated key: every revision's
        # manifest is in <table>_revisions, and the pointer must hold one of them, byte for byte.
        listed = [(r.revision, r.row_key, r.manifest) for r in kept_rows] or [(1, pointer_row.logical_key, None)]
        if kept_rows and pointer_row.manifest not in {r.manifest for r in kept_rows if r.revision == pointer.revision}:
            found.partial.append(f"{where}: the current pointer holds a manifest no kept revision holds")
        elif not kept_rows and pointer.revision != 1:
            found.partial.append(f"{where}: the current pointer names revision {pointer.revision}, none is kept")
        else:
            path = "." if pointer.revision == 1 else f"revision={pointer.revision}"
            found.pointers[pointer.logical_key] = Pointer(
                where, pointer.logical_key, pointer.revision, pointer.sha256, path
            )
        for revision, row_key, text in listed:
            at = where if revision == 1 else f"{where}/revision={revision}"
            manifest = pointer if text is None else Manifest.from_json(text.encode(), at)
            row_keys_read.add(row_key)
            if manifest.revision != revision or row_key != sql_row_key(manifest.logical_key, revision):
                found.add(Published(at, manifest, False, f"revision {manifest.revision} kept as {revision}", revision))
                continue
            target = ExportTarget(pointer_row.export, pointer_row.tenant, pointer_row.business_date, revision)
            payload = destination.read_data(target, manifest)
            if rows[row_key] != manifest.row_count:
                problem = f"{rows[row_key]} rows, manifest says {manifest.row_count}"
                found.add(Published(at, manifest, False, problem, revision))
            elif hashlib.sha256(payload).hexdigest() != manifest.sha256:
                found.add(Published(at, manifest, False, "rows do not match the manifest's sha256", revision))
            else:
                found.add(Published(at, manifest, True, revision=revision))
    for place_of, orphans in by_place.items():
        found.partial.append(f"sql:{table}_revisions: revisions {[r.revision for r in orphans]} of {place_of} "
                             "without a current pointer")  # fmt: skip
    for row_key, count in rows.items():
        if row_key not in row_keys_read:
            found.partial.append(f"sql:{table}: {count} rows of {row_key} without a manifest")  # visible to readers
    return found


def sql_row_key(key: str, revision: int) -> str:
    """The ledger table's rows of one revision are keyed by the logical key (revision 1, as 0.3.0 wrote them) or
    ``<logical key>#revision=<N>`` (export_ledger/destinations/table.py's module docstring)."""
    return key if revision == 1 else f"{key}#revision={revision}"


# -- invariants ---------------------------------------------------------------------------------------------------


#: Every list :func:`violations` returns, in the order the harnesses report them.
INVARIANTS = (
    "duplicate_exports",
    "visible_partial",
    "current_not_one",
    "revision_chain_broken",
    "revisions_not_recorded",
    "completed_without_export",
    "not_completed",
    "effects_not_one",
)


def violations(ledger: ExportLedger, found: Survey, keys: list[str] | None = None, *, final: bool) -> dict[str, list]:
    """The crash and race invariants, as lists of offending keys or things (every list must be empty).

    * ``duplicate_exports``: two visible exports of one revision of a key.
    * ``visible_partial``: something a reader sees that is not a whole export, or a pointer that does not read.
    * ``current_not_one``: a key with exports whose current revision (the pointer's, or 1 without one) is not exactly
      one intact export of that revision, named as the pointer says (key, sha256, place).
    * ``revision_chain_broken``: a published revision N >= 2 whose manifest does not supersede revision N - 1 with
      N - 1's sha256, or whose revision N - 1 is not there, intact (earlier revisions stay readable).
    * ``revisions_not_recorded``: the ledger's ``revisions()`` and the published revisions disagree: a recorded
      revision not published (or with other bytes), a published one neither recorded nor the key's pending
      restatement (while the key is not completed), a recorded revision N + 1 that does not supersede N's sha256.
    * ``completed_without_export``: a ``completed`` record whose revision is not the current one, or whose sha256 is
      not the current export's.
    * ``not_completed`` (final): a key not ``completed``, or completed with its restatement still open.
    * ``effects_not_one`` (final): not exactly one recorded effect (a ``completed`` or ``repaired`` attempt row) per
      recorded revision.

    Args:
        found: What the destination shows: all of it when ``keys`` is None, else at least those keys' places.
        keys: The logical keys to check; None checks every key in the ledger against a survey of everything.
        final: After the last attempt: every key must be completed, its restatement done, one effect per revision.
    """
    if keys is None:
        records = {r.logical_key: r for r in ledger.records()}
        keys = sorted(records)
    else:
        records = {key: ledger.get(key) for key in keys}
    requests = ledger.open_restatements(keys)
    problems: dict[str, list] = {name: [] for name in INVARIANTS}
    problems["duplicate_exports"] = [
        f"{k}: revision {n}"
        for k, exports in found.exports.items()
        for n, count in Counter(p.revision for p in exports).items()
        if count > 1
    ]
    problems["visible_partial"] = list(found.partial)
    for key in keys:
        record = records.get(key)
        exports = found.exports.get(key, [])
        current = found.current(key)
        problems["current_not_one"].extend(_current_problems(found, key))
        problems["revision_chain_broken"].extend(_chain_problems(found, key))
        recorded = ledger.revisions(key)
        pending = requests.get(key)
        completed = record is not None and record.state is ExportState.COMPLETED
        problems["revisions_not_recorded"].extend(_recording_problems(key, exports, recorded, pending, completed))
        if completed:
            ledger_current = recorded[-1] if recorded else None
            at_current = found.at(key, current)
            if ledger_current is None or ledger_current.revision != current:
                problems["completed_without_export"].append(
                    f"{key}: completed at revision {ledger_current.revision if ledger_current else None}, "
                    f"the destination's current revision is {current}"
                )
            elif not any(p.manifest.sha256 == record.sha256 for p in at_current):
                problems["completed_without_export"].append(f"{key}: revision {current} is not the recorded export")
        if final:
            if not completed:
                problems["not_completed"].append(f"{key}: {record.state.value if record else 'no record'}")
            elif pending is not None:
                problems["not_completed"].append(f"{key}: completed with revision {pending.revision} still requested")
            effects = [a for a in ledger.attempts(key) if a.outcome in EFFECTS]
            if len(effects) != max(len(recorded), 1):
                problems["effects_not_one"].append(
                    f"{key}: {[a.outcome.value for a in effects]} for {len(recorded)} revision(s)"
                )
    return problems


def _current_problems(found: Survey, key: str) -> list[str]:
    exports = found.exports.get(key, [])
    pointer = found.pointers.get(key)
    if not exports:
        return [f"{key}: a current pointer without any export"] if pointer is not None else []
    current = found.current(key)
    at_current = found.at(key, current)
    if len(at_current) != 1:
        return [f"{key}: the current revision {current} has {len(at_current)} intact export(s)"]
    if pointer is None:
        return []
    (published,) = at_current
    expected_path = "." if current == 1 else f"revision={current}"
    if (pointer.sha256, pointer.path) != (published.manifest.sha256, expected_path):
        return [f"{key}: the pointer names {pointer.path} {str(pointer.sha256)[:12]}, the export is {expected_path} "
                f"{published.manifest.sha256[:12]}"]  # fmt: skip
    return []


def _chain_problems(found: Survey, key: str) -> list[str]:
    problems = []
    for published in found.exports.get(key, []):
        manifest, revision = published.manifest, published.revision
        if revision == 1:
            if (manifest.supersedes_revision, manifest.supersedes_sha256) != (None, None):
                problems.append(f"{key}: revision 1 supersedes something")
            continue
        before = found.at(key, revision - 1)
        if len(before) != 1:
            problems.append(f"{key}: revision {revision} is published, revision {revision - 1} is not intact beside it")
        elif (manifest.supersedes_revision, manifest.supersedes_sha256) != (revision - 1, before[0].manifest.sha256):
            problems.append(
                f"{key}: revision {revision}'s manifest supersedes {manifest.supersedes_revision} "
                f"{str(manifest.supersedes_sha256)[:12]}, not revision {revision - 1} {before[0].manifest.sha256[:12]}"
            )
    return problems


def _recording_problems(key: str, exports: list[Published], recorded: list, pending, completed: bool) -> list[str]:
    problems = []
    published = {p.revision: p.manifest.sha256 for p in exports}
    for row in recorded:
        if published.get(row.revision) != row.sha256:
            problems.append(f"{key}: revision {row.revision} is recorded but not published with its sha256")
        if row.revision >= 2:
            before = next((r for r in recorded if r.revision == row.revision - 1), None)
            if before is None or (row.supersedes_revision, row.supersedes_sha256) != (before.revision, before.sha256):
                problems.append(
                    f"{key}: recorded revision {row.revision} does not supersede revision {row.revision - 1}"
                )
    if [row.revision for row in recorded] != list(range(1, len(recorded) + 1)):
        problems.append(f"{key}: recorded revisions {[row.revision for row in recorded]}")
    known = {row.revision for row in recorded}
    # A restatement published but not yet recorded (its attempt died) waits for reconciliation: never once completed.
    waiting = {pending.revision} if pending is not None and not completed else set()
    for revision in sorted(set(published) - known - waiting):
        if revision == 1 and not recorded and not completed:
            continue  # a first export published, its completion not yet recorded
        problems.append(f"{key}: revision {revision} is published but not recorded")
    return problems
