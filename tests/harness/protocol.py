"""One export attempt from a JSON-able spec, and what a reader can see at a destination afterwards (protocol v2).

Pytest-free: the fork server's children run :func:`child_main`, and the harness tests run :func:`run_attempt` in
process (with a ledger clock shifted past dead attempts' leases) and check destinations with :func:`survey` (the
layout of docs/protocol.md, read directly) and :func:`violations` (its invariants).

An attempt goes through the project's own write path: ``export_ledger.export_batch`` (the one write protocol) called
directly (mode ``io_manager``, about 0.1 s), or the whole ``invoice_export_job`` with ``execute_in_process`` on an
ephemeral instance (mode ``job``, about 0.3 s).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import io
import itertools
import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from zoneinfo import ZoneInfo

import dagster as dg
import sqlalchemy as sa

from assets.invoices import EXPORT_NAME, INVOICE_SCHEMA
from definitions import build_definitions
from export_ledger.calendar import window_for
from export_ledger.dagster import LedgerResource
from export_ledger.destinations import Destination, ExportTarget, LocalDestination
from export_ledger.destinations.base import parse_place, place_name, place_of_location
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.frames import MANIFEST_NAME, Manifest, ManifestError, validate_frame, write_table
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ExportLedger, ExportRecord, Restatement, Revision, ledger_engine, utc_now
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
    "access_key_id", "secret_access_key"}``, ``{"kind": "gcs", "bucket", "prefix", "endpoint_url"}`` (anonymous, an
    emulator), ``{"kind": "azure", "container", "prefix", "endpoint_url", "account_name", "account_key"}``,
    ``{"kind": "delta", "table": ...}`` (a local path, ``{export}`` replaced) or ``{"kind": "sql", "table": ...}`` (in
    the ledger's database).
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
    #: Keys exported together by one ``io_manager`` attempt: the dates from ``business_date`` on, one group (group
    #: commit: staged, synced, published, synced, then recorded in one ledger commit).
    group: int = 1

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
    if kind == "gcs":
        from export_ledger.destinations.gcs import GCSDestination

        return GCSDestination(
            bucket=spec["bucket"], prefix=spec.get("prefix", ""), gcs_endpoint_url=spec["endpoint_url"],
            connect_timeout_seconds=5, read_timeout_seconds=10,
        )  # fmt: skip
    if kind == "azure":
        from export_ledger.destinations.azure import AzureDestination

        return AzureDestination(
            container=spec["container"], prefix=spec.get("prefix", ""), azure_endpoint_url=spec["endpoint_url"],
            azure_account_name=spec["account_name"], azure_account_key=spec["account_key"],
            connect_timeout_seconds=5, read_timeout_seconds=10,
        )  # fmt: skip
    if kind == "sftp":
        from export_ledger.destinations.sftp import SftpDestination

        return SftpDestination(
            host=spec["host"], port=spec["port"], path=spec["path"], sftp_user=spec["user"],
            sftp_key_file=spec["key_file"], sftp_known_hosts=spec["known_hosts"], connect_timeout_seconds=5,
            read_timeout_seconds=10,
        )  # fmt: skip
    if kind == "delta":
        from export_ledger.destinations.delta import DeltaDestination

        return DeltaDestination(table=spec["table"])
    if kind == "warehouse":
        from export_ledger.destinations.warehouse import WarehouseDestination

        return WarehouseDestination(table=spec["table"], warehouse_url=spec["url"])
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

    first = dt.date.fromisoformat(spec.business_date)
    dates = [(first + dt.timedelta(days=n)).isoformat() for n in range(spec.group)]
    keys = [logical_key(spec.tenant, day, spec.timezone) for day in dates]

    def frame(key: LogicalKey):  # read after the claim, as the assets read it (a source read never precedes the lease)
        return lambda: source.rows(spec.tenant, key.window.start_utc, key.window.end_utc)

    items = [ExportItem(key, day, frame(key)) for key, day in zip(keys, dates, strict=True)]
    batch = ExportBatch(INVOICE_SCHEMA, items)
    report = {"run_id": spec.run_id, "attempt_id": spec.attempt_id}
    try:
        export_batch(ledger.get_ledger(), destination, batch, spec.attempt_id)
    except Exception as exc:  # the attempt's own failure is its report, not the harness's
        return {**report, "status": "failed", "error_class": type(exc).__name__, "error": str(exc)[:4000]}
    statuses = sorted({result.status for result in batch.results})
    return {**report, "status": statuses[0] if len(statuses) == 1 else "+".join(statuses), "error_class": None,
            "error": None, "statuses": [result.status for result in batch.results]}  # fmt: skip


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


def destination_environment(spec: dict) -> dict[str, str]:
    """The secrets a run worker of this destination has in its environment, as a deployment gives them: a destination
    object's secret reaches Dagster by name (``EnvVar``) only where the process environment holds it."""
    if spec["kind"] == "s3":
        return {"AWS_SECRET_ACCESS_KEY": spec.get("secret_access_key", "testing")}
    if spec["kind"] == "azure":
        return {"AZURE_STORAGE_ACCOUNT_KEY": spec["account_key"]}
    if spec["kind"] == "warehouse":
        return {"EXPORTS_WAREHOUSE_URL": spec["url"]}
    return {}


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
    os.environ.update(destination_environment(spec.destination))
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
    # The [gcs], [azure] and [delta] extras, likewise (google-cloud-storage alone takes ~0.5 s to import).
    for module in ("google.cloud.storage", "google.auth.credentials", "azure.storage.blob", "deltalake"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


# -- what a reader can see --------------------------------------------------------------------------------------
#
# The layout of protocol v2 (docs/protocol.md, "What readers see"): per key folder ``<export>/tenant=T/date=D/`` one
# pointer ``_current.json`` and places ``r<revision>-t<token>/``, each a ``_manifest.json`` and its data file. Readers
# see only what the pointer names. Legacy layouts read the same way: no pointer and a ``_manifest.json`` in the key
# folder is revision 1 at place ``.``; a pointer without ``format`` (0.4.0's) names ``revision=N/`` with fence 0. The
# ledger table is read the same way too: its ``<table>_manifests`` row is the pointer, each kept revision a place
# (``.`` for revision 1, ``revision=N`` after).


@dataclass
class Place:
    """One place of a key folder, as found: whole when its manifest reads, names the revision and token of the
    place's name, and its data matches the manifest's sha256 (the key is checked with the folder).

    Attributes:
        name: ``r<revision>-t<token>``, ``.`` (a legacy revision 1 in the key folder itself) or ``revision=<N>``.
        revision, token: As the name says (``.``: revision 1; a legacy place has no token).
    """

    where: str
    name: str
    revision: int | None
    token: int | None
    manifest: Manifest | None = None
    whole: bool = False
    problem: str = ""


@dataclass
class Pointer:
    """A key's pointer as a reader reads it. ``fenced``: a format-2 pointer, whose fence the protocol checks (the
    legacy readings and the ledger table's pointer row carry none)."""

    where: str
    logical_key: str | None
    fence: int
    revision: int
    place: str | None
    sha256: str | None
    fenced: bool = True


@dataclass
class KeyFolder:
    """One key's folder: its pointer (None: nothing a reader could follow, revision 0) and its places."""

    where: str
    pointer: Pointer | None = None
    places: dict[str, Place] = field(default_factory=dict)
    problem: str = ""  # a pointer that does not read
    #: A kind that replaces a key's rows when a restatement supersedes them (the warehouse): a superseded revision's
    #: place is gone by design, and what is kept of it is its marker, in ``kept_markers``.
    replaces: bool = False
    #: A replacing kind's kept markers: revision -> (place, sha256, row count), as its history table holds them.
    kept_markers: dict[int, tuple[str, str, int]] = field(default_factory=dict)

    @property
    def current(self) -> int:
        return 0 if self.pointer is None else self.pointer.revision

    @property
    def named(self) -> Place | None:
        """The place the pointer names (None: nothing published, or a place that is not there)."""
        if self.pointer is None or self.pointer.revision == 0:
            return None
        return self.places.get(self.pointer.place)

    @property
    def visible(self) -> Place | None:
        """What readers get: the named place when it is a whole export matching the pointer, else None."""
        named = self.named
        return named if named is not None and not _named_problem(self) else None


@dataclass
class Survey:
    """Everything at a destination, as readers see it and beside it.

    ``folders`` maps logical keys to their key folder (a folder whose key cannot be told, holding only leftovers, is
    listed under its path); ``partial`` lists what a reader following the layout finds broken (a pointer that does not
    read, or names a place that is not a whole export of its key and revision matching it; a second folder of one
    key; an entry outside the layout); ``hidden`` lists what readers never see by protocol (places the pointer does
    not name, earlier revisions among them, and temporary files of killed writers); ``rows`` counts SQL rows per row
    key (a revision's, for a ledger table).
    """

    folders: dict[str, KeyFolder] = field(default_factory=dict)
    partial: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    rows: Counter = field(default_factory=Counter)
    temporary: list[str] = field(default_factory=list)  # the temporary files among ``hidden``

    def add_temporary(self, where: str) -> None:
        self.temporary.append(where)
        self.hidden.append(where)

    def folder(self, key: str) -> KeyFolder | None:
        return self.folders.get(key)

    def folder_at(self, target: ExportTarget) -> KeyFolder | None:
        """The key folder of ``target``, whether or not its key can be told from what it holds."""
        suffix = "/".join(target.parts)
        return next((f for f in self.folders.values() if f.where == suffix or f.where.endswith("/" + suffix)), None)

    def current(self, key: str) -> int:
        """The key's current revision as a reader resolves it (0: nothing published)."""
        folder = self.folders.get(key)
        return 0 if folder is None else folder.current

    def visible(self, key: str) -> Place | None:
        folder = self.folders.get(key)
        return None if folder is None else folder.visible

    @property
    def exports(self) -> dict[str, Place]:
        """Every key readers get an export of, and that export (one per key, by construction of the layout)."""
        return {key: folder.visible for key, folder in self.folders.items() if folder.visible is not None}

    def places(self, key: str) -> dict[str, Place]:
        folder = self.folders.get(key)
        return {} if folder is None else folder.places

    def finish(self, folders: list[KeyFolder]) -> None:
        """Files each folder under its key (the pointer's, else its manifests'), and lists what readers would find
        broken and what they never see."""
        for folder in folders:
            keys = {p.manifest.logical_key for p in folder.places.values() if p.manifest is not None}
            key = folder.pointer.logical_key if folder.pointer is not None and folder.pointer.logical_key else None
            if key is None and len(keys) == 1:
                (key,) = keys
            if folder.problem:
                self.partial.append(f"{folder.where}: {folder.problem}")
            for place in folder.places.values():
                if place.manifest is not None and key is not None and place.manifest.logical_key != key:
                    self.partial.append(
                        f"{place.where}: a place holding {place.manifest.logical_key} in {key}'s folder"
                    )
            problem = _named_problem(folder)
            if problem:
                self.partial.append(f"{folder.where}: {problem}")
            named = folder.named
            self.hidden.extend(
                f"{place.where}" + (f" ({place.problem})" if place.problem else "")
                for place in folder.places.values()
                if place is not named
            )
            if key is None:
                key = f"?{folder.where}"
            if key in self.folders:
                self.partial.append(f"{folder.where}: a second key folder of {key}")
                continue
            self.folders[key] = folder


def _named_problem(folder: KeyFolder) -> str:
    """Why what the pointer names is not a whole export of its key and revision ('' when it is, or names nothing)."""
    pointer = folder.pointer
    if pointer is None or pointer.revision == 0:
        return ""
    place = folder.places.get(pointer.place)
    if place is None:
        return f"the pointer names revision {pointer.revision} at {pointer.place!r}, which is not there"
    if not place.whole:
        return f"the pointer names {place.where}, which is not a whole export ({place.problem})"
    manifest = place.manifest
    if manifest.revision != pointer.revision:
        return (
            f"the pointer names revision {pointer.revision} at {place.where}, which holds revision {manifest.revision}"
        )
    if pointer.sha256 is not None and pointer.sha256 != manifest.sha256:
        return f"the pointer names sha256 {pointer.sha256[:12]}, {place.where} holds {manifest.sha256[:12]}"
    if pointer.logical_key is not None and pointer.logical_key != manifest.logical_key:
        return f"the pointer of {pointer.logical_key} names {place.where}, which holds {manifest.logical_key}"
    return ""


def place_of(name: str) -> tuple[int | None, int | None] | None:
    """``(revision, token)`` a place's name says: ``r<N>-t<T>`` (release 0.5), ``revision=<N>`` (0.4.0, no token);
    None for a name that is no place."""
    parsed = parse_place(name)
    if parsed is not None and name == place_name(*parsed) and parsed[0] >= 1 and parsed[1] >= 1:
        return parsed
    prefix, _, number = name.partition("=")
    if prefix == "revision" and number.isdigit() and str(int(number)) == number and int(number) >= 2:
        return int(number), None
    return None


def read_pointer(where: str, payload: bytes) -> Pointer:
    """A pointer object as readers read it: format 2 (fenced), or 0.4.0's (no format: fence 0).

    Raises:
        ValueError: it does not read as a pointer.
    """
    try:
        values = json.loads(payload)
        revision = values["revision"]
        fence = values.get("fence", 0)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ValueError("a pointer that is not a JSON object with a revision") from None
    counts = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (revision, fence))
    fenced = values.get("format") == 2
    if not counts or (not fenced and (revision < 1 or "fence" in values)):
        raise ValueError(f"a pointer naming revision {revision!r} with fence {fence!r}")
    place = values.get("path") if revision else None
    if revision and not isinstance(place, str):
        raise ValueError(f"a pointer naming revision {revision} without its place")
    key = values.get("logical_key")
    return Pointer(where, key if isinstance(key, str) else None, fence, revision, place, values.get("sha256"), fenced)


def survey(
    destination_spec: dict,
    ledger_url: str,
    *,
    s3_client=None,
    only: ExportTarget | list[ExportTarget] | None = None,
    s3_bodies: dict | None = None,
    client=None,
) -> Survey:
    """Looks at the destination directly (the folder tree, the bucket or container listing on the server, the Delta
    log and table, the tables) rather than through the destination's own reads; only the ledger table's rows are read
    back with the destination's own serialization, to compare their sha256. ``only`` limits the look to some targets'
    key folders (a trial's keys), so that a check per trial does not grow with the number of trials.

    ``s3_client`` is a boto3 client of the S3 server; ``client`` the SDK's client of a GCS or Azure destination (from
    :func:`store_client`; one is opened when it is None). ``s3_bodies`` (a dict the caller keeps between looks, for
    any object store) holds the bytes of the objects read before, by name and version tag (ETag, generation): an
    object the listing shows with the tag it had is not read again. A look after every step then reads only what
    changed."""
    kind = destination_spec["kind"]
    targets = None if only is None else (only if isinstance(only, list) else [only])
    found = Survey()
    bodies = {} if s3_bodies is None else s3_bodies
    if kind == "local":
        found.finish(_survey_local(Path(destination_spec["root"]), targets, found))
    elif kind in ("s3", "gcs", "azure", "sftp"):
        lister = _S3Objects(s3_client, destination_spec["bucket"]) if kind == "s3" else (
            client or store_client(destination_spec))  # fmt: skip
        prefix = destination_spec.get("prefix", "")
        found.finish(_survey_objects(lister, prefix, targets, found, bodies))
    elif kind == "delta":
        found.finish(_survey_delta(destination_spec["table"], targets, found))
    elif kind == "sql":
        found.finish(_survey_sql(ledger_url, destination_spec["table"], targets, found))
    elif kind == "warehouse":
        found.finish(_survey_warehouse(destination_spec, targets, found))
    else:
        raise ValueError(kind)
    return found


#: A local store's temporary file (``.tmp-<name>-<pid>-<ns>``): what a writer killed before its link or rename left.
LOCAL_TEMPORARY = ".tmp-"


def _survey_local(root: Path, targets: list[ExportTarget] | None, found: Survey) -> list[KeyFolder]:
    if not root.exists():
        return []
    if targets is None:
        key_folders = []
        for path in sorted(root.rglob("*")):
            parts = path.relative_to(root).parts
            if any(part.startswith(".") for part in parts[:3]):
                continue  # readers ignore dot-names (the store's locks in .export-ledger among them)
            if len(parts) < 3 and not path.is_dir():
                found.partial.append(f"{path.relative_to(root)}: a file where an export folder belongs")
            elif len(parts) == 3:
                if path.is_dir():
                    key_folders.append(path)
                else:
                    found.partial.append(f"{path.relative_to(root)}: a file where a key folder belongs")
    else:
        key_folders = [root.joinpath(*target.parts) for target in targets]
    return [_local_folder(root, folder, found) for folder in key_folders if folder.is_dir()]


def _local_folder(root: Path, folder: Path, found: Survey) -> KeyFolder:
    where = str(folder.relative_to(root))
    key = KeyFolder(where)
    legacy: dict[str, bytes] = {}
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if name.startswith(LOCAL_TEMPORARY):
            found.add_temporary(f"{where}/{name}")
        elif name.startswith("."):
            continue
        elif name == POINTER_NAME and entry.is_file():
            try:
                key.pointer = read_pointer(f"{where}/{name}", entry.read_bytes())
            except ValueError as exc:
                key.problem = str(exc)
        elif entry.is_file():
            body = _read(entry)
            if body is not None:
                legacy[name] = body  # a 0.4.0 revision 1 in the key folder itself
        elif entry.is_dir() and place_of(name) is not None:
            objects = {}
            try:
                items = sorted(entry.iterdir())
            except FileNotFoundError:
                items = []  # swept since the key folder was listed
            for item in items:
                if item.name.startswith(LOCAL_TEMPORARY):
                    found.add_temporary(f"{where}/{name}/{item.name}")
                elif item.is_file():
                    body = _read(item)
                    if body is not None:
                        objects[item.name] = body
                else:
                    objects[item.name] = None
            if objects:
                key.places[name] = _place(f"{where}/{name}", name, objects)
        elif entry.exists():
            found.partial.append(f"{where}/{name}: an entry outside the layout")
    _legacy_revision_1(key, legacy, where)
    return key


def _read(path: Path) -> bytes | None:
    """A file's bytes; None when it went away since the folder was listed (a sweep running beside the look)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _legacy_revision_1(key: KeyFolder, objects: dict[str, bytes | None], where: str) -> None:
    """Objects of the key folder itself: a 0.4.0 revision 1 (place ``.``), read as revision 1 without a pointer."""
    if not objects:
        return
    place = _place(f"{where}/.", ".", objects)
    key.places["."] = place
    if key.pointer is None and key.problem == "" and MANIFEST_NAME in objects:
        manifest = place.manifest
        key.pointer = Pointer(
            f"{where} (no pointer: revision 1 in the key folder)",
            manifest.logical_key if manifest else None,
            0,
            1,
            ".",
            manifest.sha256 if manifest else None,
            fenced=False,
        )


def _place(where: str, name: str, objects: dict[str, bytes | None]) -> Place:
    revision, token = place_of(name) or (1, None)
    place = Place(where, name, revision, token)
    if MANIFEST_NAME not in objects or objects[MANIFEST_NAME] is None:
        place.problem = f"no manifest ({sorted(objects)})"
        return place
    try:
        manifest = Manifest.from_json(objects[MANIFEST_NAME], where)
    except ManifestError as exc:
        place.problem = str(exc)
        return place
    place.manifest = manifest
    if set(objects) != {MANIFEST_NAME, manifest.data_file}:
        place.problem = f"objects {sorted(objects)}, its manifest names {manifest.data_file}"
    elif (data := objects[manifest.data_file]) is None or hashlib.sha256(data).hexdigest() != manifest.sha256:
        place.problem = "data does not match its manifest's sha256"
    elif manifest.revision != revision:
        place.problem = f"a manifest of revision {manifest.revision} in a place of revision {revision}"
    elif token is not None and manifest.fencing_token != token:
        place.problem = f"a manifest of token {manifest.fencing_token} in a place of token {token}"
    else:
        place.whole = True
    return place


class _S3Objects:
    """A bucket on the S3 server as :func:`_survey_objects` reads it: names with their ETags, and bodies."""

    def __init__(self, client, bucket: str) -> None:
        self.client, self.bucket = client, bucket
        self.url = f"s3://{bucket}"

    def listing(self, start: str):
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for item in page.get("Contents", []):
                yield item["Key"], item["ETag"]

    def body(self, name: str) -> tuple[bytes, str] | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=name)
        except self.client.exceptions.NoSuchKey:
            return None
        return answer["Body"].read(), answer["ETag"]


class _GCSObjects:
    """A bucket on fake-gcs-server, read with google-cloud-storage (anonymous): names with their generations."""

    def __init__(self, endpoint_url: str, bucket: str) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.client = storage.Client(
            project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint_url}
        )
        self.bucket = self.client.bucket(bucket)
        self.url = f"gs://{bucket}"

    def listing(self, start: str):
        for blob in self.client.list_blobs(self.bucket, prefix=start):
            yield blob.name, str(blob.generation)

    def body(self, name: str) -> tuple[bytes, str] | None:
        from google.api_core.exceptions import NotFound

        blob = self.bucket.blob(name)
        try:
            return blob.download_as_bytes(), str(blob.generation)
        except NotFound:
            return None

    def close(self) -> None:
        self.client.close()


class _SftpObjects:
    """A folder on an SFTP server, read as a partner reads it with its own paramiko session: each key's
    ``_pointers/`` folder is its pointer, ``_current.json``, the highest pointer object (docs/destinations.md,
    "SFTP"), tagged with its number; every other file is tagged with its size and modification time."""

    def __init__(self, spec: dict) -> None:
        import paramiko

        self.ssh = paramiko.SSHClient()
        self.ssh.load_host_keys(spec["known_hosts"])
        self.ssh.set_missing_host_key_policy(paramiko.RejectPolicy())
        self.ssh.connect(spec["host"], spec["port"], spec["user"], key_filename=spec["key_file"], allow_agent=False,
                         look_for_keys=False)  # fmt: skip
        self.sftp = self.ssh.open_sftp()
        self.root = spec["path"].rstrip("/")
        self.url = f"sftp://{spec['host']}:{spec['port']}{self.root}"

    def listing(self, start: str):
        import stat

        def walk(relative: str):
            try:
                entries = self.sftp.listdir_attr(f"{self.root}/{relative}".rstrip("/"))
            except FileNotFoundError:
                return
            for entry in entries:
                name = f"{relative}{entry.filename}"
                if entry.filename == "_pointers" and stat.S_ISDIR(entry.st_mode):
                    numbers = self._numbers(name)
                    if numbers:
                        yield f"{relative}{POINTER_NAME}", str(numbers[-1])
                elif stat.S_ISDIR(entry.st_mode):
                    if not entry.filename.startswith("."):
                        yield from walk(f"{name}/")
                elif not entry.filename.startswith(".tmp-"):
                    yield name, f"{entry.st_size}-{entry.st_mtime}"

        yield from walk(start)

    def _numbers(self, folder: str) -> list[int]:
        names = self.sftp.listdir(f"{self.root}/{folder}")
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def body(self, name: str) -> tuple[bytes, str] | None:
        folder, _, last = name.rpartition("/")
        try:
            if last == POINTER_NAME:
                numbers = self._numbers(f"{folder}/_pointers")
                if not numbers:
                    return None
                with self.sftp.open(f"{self.root}/{folder}/_pointers/{numbers[-1]:012d}.json") as handle:
                    return handle.read(), str(numbers[-1])
            found = self.sftp.stat(f"{self.root}/{name}")
            with self.sftp.open(f"{self.root}/{name}") as handle:
                return handle.read(), f"{found.st_size}-{found.st_mtime}"
        except FileNotFoundError:
            return None

    def close(self) -> None:
        self.ssh.close()


class _AzureObjects:
    """A container on Azurite, read with azure-storage-blob: names with their ETags."""

    def __init__(self, endpoint_url: str, container: str, account_name: str, account_key: str) -> None:
        from azure.storage.blob import ContainerClient

        credential = {"account_name": account_name, "account_key": account_key}
        self.client = ContainerClient(endpoint_url, container, credential=credential)
        self.url = f"az://{container}"

    def listing(self, start: str):
        for blob in self.client.list_blobs(name_starts_with=start):
            yield blob.name, blob.etag

    def body(self, name: str) -> tuple[bytes, str] | None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            downloader = self.client.download_blob(name)
            return downloader.readall(), downloader.properties.etag
        except ResourceNotFoundError:
            return None

    def close(self) -> None:
        self.client.close()


def store_client(destination_spec: dict):
    """The SDK client :func:`survey` reads a GCS or Azure destination with, straight from the server (not through
    the destination's store): open one per harness and pass it as ``client``; ``close()`` it at the end."""
    kind = destination_spec["kind"]
    if kind == "gcs":
        return _GCSObjects(destination_spec["endpoint_url"], destination_spec["bucket"])
    if kind == "azure":
        return _AzureObjects(
            destination_spec["endpoint_url"], destination_spec["container"], destination_spec["account_name"],
            destination_spec["account_key"],
        )  # fmt: skip
    if kind == "sftp":
        return _SftpObjects(destination_spec)
    raise ValueError(f"no store client for destination kind {kind!r}")


def _survey_objects(store, prefix: str, targets: list[ExportTarget] | None, found: Survey, bodies: dict):
    """An object store's layout (S3, GCS, Azure): object names under the prefix, grouped by key folder."""
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    starts = [base] if targets is None else [base + "/".join(target.parts) + "/" for target in targets]
    names: dict[str, list[str]] = {}  # key folder -> object names relative to it
    tags: dict[str, str] = {}
    for start in starts:
        for name, tag in store.listing(start):
            relative = name[len(base) :]
            if relative.startswith(".export-ledger-probe/"):
                continue  # the destination's check of conditional writes, not an export
            parts = relative.split("/")
            if len(parts) < 4:
                found.partial.append(f"{store.url}/{name}: an object where a key folder belongs")
                continue
            names.setdefault("/".join(parts[:3]), []).append("/".join(parts[3:]))
            tags[name] = tag
    folders = []
    for folder, objects in sorted(names.items()):
        where = f"{store.url}/{base}{folder}"
        key = KeyFolder(where)
        legacy: dict[str, bytes] = {}
        by_place: dict[str, dict[str, bytes]] = {}
        for name in sorted(objects):
            full_name = f"{base}{folder}/{name}"
            body = bodies.get((full_name, tags[full_name]))
            if body is None:
                read = store.body(full_name)
                if read is None:
                    continue  # deleted since the listing (a sweep running beside the look)
                body, tag = read
                if tag == tags[full_name]:
                    bodies[(full_name, tag)] = body  # the version listed, read whole
            place, sep, rest = name.partition("/")
            if not sep:
                if name == POINTER_NAME:
                    try:
                        key.pointer = read_pointer(f"{where}/{name}", body)
                    except ValueError as exc:
                        key.problem = str(exc)
                else:
                    legacy[name] = body
            elif place_of(place) is not None and "/" not in rest:
                by_place.setdefault(place, {})[rest] = body
            else:
                found.partial.append(f"{where}/{name}: an object outside the layout")
        for place, items in by_place.items():
            key.places[place] = _place(f"{where}/{place}", place, items)
        _legacy_revision_1(key, legacy, where)
        folders.append(key)
    return folders


def _survey_delta(template: str, targets: list[ExportTarget] | None, found: Survey) -> list[KeyFolder]:
    """A Delta table as a reader reads it (export_ledger/destinations/delta.py's module docstring): the key's txn
    version ``K`` is its current revision and ``K#fence`` its fence, together the pointer; each revision ``r`` is a
    place at the table version ``K#r<r>`` names, whose commit metadata holds its manifest; the current revision's
    rows are the key's rows in the latest version (what a reader of the table gets), an earlier one's are read at
    its own version (time travel). Rows of a key no commit of the key names are visible and broken. A whole-table
    look (``targets`` None) reads the key names from the log's txn actions and the table's partitions, of the one
    export the harness writes."""
    import deltalake

    from export_ledger.destinations.delta import KEY_COLUMN

    exports = sorted({t.export for t in targets}) if targets is not None else [EXPORT_NAME]
    folders = []
    for export in exports:
        uri = template.replace("{export}", export)
        try:
            table = deltalake.DeltaTable(uri)
        except deltalake.exceptions.TableNotFoundError:
            continue
        with_rows = {values[KEY_COLUMN] for values in table.partitions()}
        if targets is None:
            keys = sorted(_delta_log_keys(Path(uri)) | with_rows)
        else:
            keys = [str(logical_key(t.tenant, t.business_date)) for t in targets if t.export == export]
        for key in keys:
            folder = _delta_folder(uri, table, key, found)
            if folder is None and key in with_rows:
                found.partial.append(f"delta:{uri}: rows of {key}, which no commit of the key names")
            elif folder is not None:
                folders.append(folder)
    return folders


def _delta_log_keys(table: Path) -> set[str]:
    """Every logical key a txn action of the log names (``K``, ``K#fence``, ``K#r<N>``; not the folder ids)."""
    keys = set()
    for entry in sorted((table / "_delta_log").glob("*.json")):
        for line in entry.read_bytes().splitlines():
            app_id = json.loads(line).get("txn", {}).get("appId")
            if app_id and "/tenant=" not in app_id:
                keys.add(app_id.split("#", 1)[0])
    return keys


def _delta_folder(uri: str, table, key: str, found: Survey) -> KeyFolder | None:
    """One key of a Delta table: None when no commit names it (nothing fenced, nothing published)."""
    fence = table.transaction_version(f"{key}#fence") or 0
    revision = table.transaction_version(key) or 0
    if fence == 0 and revision == 0:
        return None
    export, tenant, start_utc = key.split("/")  # <export>/<tenant>/<window start in UTC>, as the ledger keys
    window_start = dt.datetime.fromisoformat(start_utc.replace("Z", "+00:00"))
    target = ExportTarget(export, tenant, window_start.astimezone(ZoneInfo(ZONE)).date().isoformat())
    folder_name = "/".join(target.parts)
    where = f"delta:{uri}#/{folder_name}"
    start = table.transaction_version(folder_name)
    if start is not None and start != int(window_start.timestamp()):
        found.partial.append(f"{where}: the folder's txn names window start {start}, not {key}'s")
    folder = KeyFolder(where)
    # Every revision up to the current one, and any committed above it (the key's version moved back).
    for number in itertools.count(1):
        version = table.transaction_version(f"{key}#r{number}")
        if version is None and number > revision:
            break
        if version is not None:
            place = _delta_place(uri, table if number == revision else None, key, number, version, where)
            folder.places[place.name] = place
    current = next((p for p in folder.places.values() if p.revision == revision), None)
    name = None if revision == 0 else (current.name if current is not None else f"r{revision}-unknown")
    sha256 = current.manifest.sha256 if current is not None and current.manifest is not None else None
    folder.pointer = Pointer(f"{where} (txn {key})", key, fence, revision, name, sha256)
    return folder


def _delta_place(uri: str, latest, key: str, revision: int, version: int, where: str) -> Place:
    """Revision ``revision`` of ``key``, committed at table ``version``: its manifest from that commit's metadata,
    its rows from the ``latest`` table (the current revision) or from that version."""
    import deltalake

    from export_ledger.destinations.delta import KEY_COLUMN, MANIFEST_METADATA, ROW_COLUMN

    # The commit is the first log entry from K#r<N>'s version that carries K#r<N> (Delta may have rebased it over other
    # keys' commits), its manifest in that entry's commit metadata.
    text = None
    for entry in sorted((Path(uri) / "_delta_log").glob("*.json")):
        if int(entry.stem) < version:
            continue
        actions = [json.loads(line) for line in entry.read_bytes().splitlines()]
        if any(action.get("txn", {}).get("appId") == f"{key}#r{revision}" for action in actions):
            version = int(entry.stem)
            text = next((a["commitInfo"].get(MANIFEST_METADATA) for a in actions if "commitInfo" in a), None)
            break
    if text is None:
        return Place(f"{where}/r{revision}@v{version}", f"r{revision}-unknown", revision, None,
                     problem=f"no manifest in the commit of version {version}")  # fmt: skip
    try:
        manifest = Manifest.from_json(text.encode("utf-8"), f"{where}@v{version}")
    except ManifestError as exc:
        return Place(f"{where}/r{revision}@v{version}", f"r{revision}-unknown", revision, None, problem=str(exc))
    name = place_name(revision, manifest.fencing_token)
    place = Place(f"{where}/{name}@v{version}", name, revision, manifest.fencing_token, manifest)
    table = latest if latest is not None else deltalake.DeltaTable(uri, version=version)
    rows = table.to_pyarrow_table(filters=[(KEY_COLUMN, "=", key)]).sort_by(ROW_COLUMN)
    foreign = f"the commit of {key}'s revision {revision} holds {manifest.logical_key}'s {manifest.revision}"
    _judge_rows(place, rows.drop_columns([KEY_COLUMN, ROW_COLUMN]), key, revision, foreign)
    return place


def _judge_rows(place: Place, rows, key: str, revision: int, foreign: str) -> None:
    """A place whose rows are read from a table (Delta, the warehouse) judged against its manifest, as a folder's data
    file is: the manifest names this key at this revision (else ``foreign``), then the row count, then the sha256 of
    the rows' CSV serialization."""
    manifest = place.manifest
    buffer = io.BytesIO()
    write_table(rows, "csv", buffer)
    if manifest.revision != revision or manifest.logical_key != key:
        place.problem = foreign
    elif rows.num_rows != manifest.row_count:
        place.problem = f"{rows.num_rows} rows, its manifest says {manifest.row_count}"
    elif hashlib.sha256(buffer.getvalue()).hexdigest() != manifest.sha256:
        place.problem = "rows do not match the manifest's sha256"
    else:
        place.whole = True


def _survey_warehouse(spec: dict, targets: list[ExportTarget] | None, found: Survey) -> list[KeyFolder]:
    """A warehouse database as its readers read it (export_ledger/destinations/warehouse.py's module docstring), with
    plain SQL, never through the destination: the key's marker row is its pointer (fence, revision, place, sha256);
    the current revision's place is the key's rows in the rows table, re-hashed against the marker's manifest (a
    superseded revision's rows are replaced by design: only its marker is kept, in the history table); what an attempt
    staged (``T_staged``, by place) is a place of its token that readers never see. Rows of a key no marker names are
    visible and broken."""
    engine = sa.create_engine(spec["url"], poolclass=sa.pool.NullPool)
    folders = []
    try:
        with engine.connect() as conn:
            exports = sorted({t.export for t in targets}) if targets is not None else [EXPORT_NAME]
            for export in exports:
                name = spec["table"].replace("{export}", export)
                if not sa.inspect(conn).has_table(f"{name}_markers"):
                    continue
                where_key = "" if targets is None else " WHERE export = :export"
                markers = {
                    (row.tenant, row.business_date): row
                    for row in conn.execute(sa.text(f"SELECT * FROM {name}_markers{where_key}"), {"export": export})
                }
                wanted = [t for t in targets if t.export == export] if targets is not None else [
                    ExportTarget(export, tenant, day) for tenant, day in markers]  # fmt: skip
                for target in wanted:
                    folder = _warehouse_folder(conn, name, target, markers.get((target.tenant, target.business_date)))
                    if folder is not None:
                        folders.append(folder)
                if targets is None and sa.inspect(conn).has_table(name):
                    named = {row.logical_key for row in markers.values() if row.revision}
                    for (key,) in conn.execute(sa.text(f"SELECT DISTINCT _export_key FROM {name}")):
                        if key not in named:
                            found.partial.append(f"warehouse:{name}: rows of {key}, which no marker names")
    finally:
        engine.dispose()
    return folders


def _warehouse_folder(conn, name: str, target: ExportTarget, marker) -> KeyFolder | None:
    where = f"warehouse:{name}#/{'/'.join(target.parts)}"
    folder = KeyFolder(where)
    key = marker.logical_key if marker is not None else str(logical_key(target.tenant, target.business_date))
    if sa.inspect(conn).has_table(f"{name}_staged"):
        staged = conn.execute(
            sa.text(f"SELECT _export_place, _export_token, COUNT(*) AS n FROM {name}_staged WHERE _export_key = :key "
                    "GROUP BY _export_place, _export_token"), {"key": key},
        )  # fmt: skip
        for place_text, token, count in staged:
            revision, _ = parse_place(place_text) or (None, None)
            folder.places[place_text] = Place(
                f"{where}/{place_text} (staged)", place_text, revision, token, problem=f"staged, {count} rows"
            )  # fmt: skip
    if marker is None:
        return folder if folder.places else None
    folder.pointer = Pointer(f"{where} (marker)", key, marker.fence, marker.revision, marker.place, marker.sha256)
    folder.replaces = True
    if sa.inspect(conn).has_table(f"{name}_history"):
        kept = conn.execute(
            sa.text(f"SELECT revision, place, sha256, row_count FROM {name}_history WHERE logical_key = :key"),
            {"key": key},
        )
        folder.kept_markers = {row.revision: (row.place, row.sha256, row.row_count) for row in kept}
    if marker.revision == 0:
        return folder
    manifest = Manifest.from_json(marker.manifest.encode("utf-8"), where)
    place = Place(f"{where}/{marker.place}", marker.place, marker.revision, marker.fencing_token, manifest)
    columns = json.loads(marker.columns)
    from export_ledger.destinations.warehouse import _arrow, _rows_of

    table = _rows_of(name, tuple(columns.items()), False)
    query = sa.select(*(table.c[c] for c in columns)).where(table.c._export_key == key).order_by(table.c._export_row)
    records = [dict(r._mapping) for r in conn.execute(query)]
    import pyarrow as pa

    rows = pa.Table.from_pylist(records, schema=pa.schema([(c, _arrow()[k]) for c, k in columns.items()]))
    foreign = f"the marker of {key}'s revision {marker.revision} holds {manifest.logical_key}'s"
    _judge_rows(place, rows, key, marker.revision, foreign)
    folder.places[place.name] = place
    return folder


def _survey_sql(ledger_url: str, table: str, targets: list[ExportTarget] | None, found: Survey) -> list[KeyFolder]:
    """The ledger table as a reader reads it: the ``<table>_manifests`` row is the key's pointer (it holds the
    current revision's manifest); every revision's manifest is kept in ``<table>_revisions`` once the key was
    restated (else the manifests row is revision 1's); each revision's rows are under their row key."""
    engine = ledger_engine(ledger_url)
    with engine.connect().execution_options(ledger_read_only=True) as conn:
        inspector = sa.inspect(conn)
        present = [inspector.has_table(table), inspector.has_table(f"{table}_manifests")]
        if not all(present):
            if any(present):
                found.partial.append(f"sql:{table}: rows table and manifests table do not exist together")
            return []
        restated = inspector.has_table(f"{table}_revisions")  # made at the table's first restatement
        # Only the columns read here, named as the README describes the layout (no reflection: a check per trial).
        rows_table = sa.table(table, sa.column("logical_key"))
        place = ("export", "tenant", "business_date")
        manifests = sa.table(f"{table}_manifests", *(sa.column(c) for c in (*place, "logical_key", "manifest")))
        revisions = sa.table(f"{table}_revisions", *(sa.column(c) for c in (*place, "revision", "row_key", "manifest")))
        counts = sa.select(rows_table.c.logical_key, sa.func.count()).group_by(rows_table.c.logical_key)
        listing = sa.select(manifests)
        kept = sa.select(revisions)
        if targets is not None:
            keys = [str(LogicalKey(t.export, t.tenant, window_for(dt.date.fromisoformat(t.business_date), ZONE)))
                    for t in targets]  # fmt: skip
            counts = counts.where(
                sa.or_(
                    *(rows_table.c.logical_key == key for key in keys),
                    *(rows_table.c.logical_key.startswith(f"{key}#revision=", autoescape=True) for key in keys),
                )
            )
            listing = listing.where(
                sa.or_(*(sa.and_(*(manifests.c[c] == getattr(t, c) for c in place)) for t in targets))
            )
            kept = kept.where(sa.or_(*(sa.and_(*(revisions.c[c] == getattr(t, c) for c in place)) for t in targets)))
        rows = Counter({row_key: count for row_key, count in conn.execute(counts)})  # per row key
        pointer_rows = list(conn.execute(listing))
        revision_rows = list(conn.execute(kept)) if restated else []
    found.rows = rows
    destination = SqlTableDestination(url=ledger_url, table=table)
    by_place: dict[tuple, list] = {}
    for row in revision_rows:
        by_place.setdefault((row.export, row.tenant, row.business_date), []).append(row)
    row_keys_read = set()
    folders = []
    for pointer_row in pointer_rows:
        place_of_key = (pointer_row.export, pointer_row.tenant, pointer_row.business_date)
        where = f"sql:{table}/{pointer_row.export}/tenant={pointer_row.tenant}/date={pointer_row.business_date}"
        folder = KeyFolder(where)
        current = Manifest.from_json(pointer_row.manifest.encode(), where)
        kept_rows = sorted(by_place.pop(place_of_key, []), key=lambda r: r.revision)
        # A key never restated: its manifests row is revision 1's manifest. A restated key: every revision's
        # manifest is in <table>_revisions, and the pointer must hold one of them, byte for byte.
        listed = [(r.revision, r.row_key, r.manifest) for r in kept_rows] or [(1, pointer_row.logical_key, None)]
        if kept_rows and pointer_row.manifest not in {r.manifest for r in kept_rows if r.revision == current.revision}:
            folder.problem = "the pointer row holds a manifest no kept revision holds"
        elif not kept_rows and current.revision != 1:
            folder.problem = f"the pointer row names revision {current.revision}, none is kept"
        else:
            folder.pointer = Pointer(
                where, current.logical_key, 0, current.revision, sql_place(current.revision), current.sha256,
                fenced=False,
            )  # fmt: skip
        for revision, row_key, text in listed:
            name = sql_place(revision)
            at = f"{where}/{name}"
            place = Place(at, name, revision, None)
            folder.places[name] = place
            manifest = current if text is None else Manifest.from_json(text.encode(), at)
            place.manifest = manifest
            row_keys_read.add(row_key)
            if manifest.revision != revision or row_key != sql_row_key(manifest.logical_key, revision):
                place.problem = f"revision {manifest.revision} kept as {revision}"
                continue
            target = ExportTarget(pointer_row.export, pointer_row.tenant, pointer_row.business_date, revision)
            payload = destination.read_data(target, manifest)
            if rows[row_key] != manifest.row_count:
                place.problem = f"{rows[row_key]} rows, manifest says {manifest.row_count}"
            elif hashlib.sha256(payload).hexdigest() != manifest.sha256:
                place.problem = "rows do not match the manifest's sha256"
            else:
                place.whole = True
        folders.append(folder)
    for place_of_key, orphans in by_place.items():
        found.partial.append(f"sql:{table}_revisions: revisions {[r.revision for r in orphans]} of {place_of_key} "
                             "without a pointer row")  # fmt: skip
    for row_key, count in rows.items():
        if row_key not in row_keys_read:
            found.partial.append(f"sql:{table}: {count} rows of {row_key} without a manifest")  # visible to readers
    return folders


def sql_place(revision: int) -> str:
    """The place of a ledger table's revision, as its recorded location ends (``.``: the key's own, revision 1)."""
    return "." if revision == 1 else f"revision={revision}"


def sql_row_key(key: str, revision: int) -> str:
    """The ledger table's rows of one revision are keyed by the logical key (revision 1, as 0.3.0 wrote them) or
    ``<logical key>#revision=<N>`` (export_ledger/destinations/table.py's module docstring)."""
    return key if revision == 1 else f"{key}#revision={revision}"


def leftovers(ledger: ExportLedger, found: Survey) -> list[str]:
    """What is at the destination that neither a pointer nor a recorded revision names (places of failed, fenced or
    killed attempts that no later attempt swept, temporary files of killed writers): invisible by protocol, so never
    a violation, but counted. The earlier revisions a key keeps are not leftovers."""
    items = list(found.temporary)
    for key, folder in found.folders.items():
        recorded = ledger.restatements.revisions(key) if not key.startswith("?") else []
        kept = {place_of_location(row.location) for row in recorded}
        named = folder.named
        items.extend(p.where for p in folder.places.values() if p is not named and p.name not in kept)
    return items


# -- invariants ---------------------------------------------------------------------------------------------------


#: Every list :func:`violations` returns, in the order the harnesses report them: the invariants of docs/protocol.md
#: ("Invariants") that a survey and the ledger can show, and the end state of a run of trials.
INVARIANTS = (
    "duplicate_exports",
    "visible_partial",
    "current_not_one",
    "pointer_disagrees",
    "revision_chain_broken",
    "stale_token_visible",
    "named_deleted",
    "revision_replaced",
    "not_completed",
    "effects_not_one",
)


@dataclass
class History:
    """What earlier checks saw of each key: invariants 4, 5 and 7 are about time (the pointer never moves back, a
    fence once raised holds, nothing once named goes away or changes)."""

    fence: dict[str, int] = field(default_factory=dict)
    revision: dict[str, int] = field(default_factory=dict)
    place: dict[str, str | None] = field(default_factory=dict)
    #: Every place a pointer or a recorded revision named: key -> {place: (revision, sha256)}.
    named: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)
    #: The key's recorded revisions and effect rows as last read, with the record they were read beside. Both change
    #: only in a transition that also changes the record (a completion or repair comes with a new token and state),
    #: so while the record is equal they are read from here.
    reads: dict[str, tuple[ExportRecord | None, list, list]] = field(default_factory=dict)

    def ledger_reads(self, ledger: ExportLedger, key: str, record: ExportRecord | None) -> tuple[list, list]:
        """The key's recorded revisions and effect rows (``completed`` or ``repaired`` attempt rows)."""
        cached = self.reads.get(key)
        if cached is not None and cached[0] == record:
            return cached[1], cached[2]
        recorded, effects = _ledger_reads(ledger, key)
        self.reads[key] = (record, recorded, effects)
        return recorded, effects


def _ledger_reads(ledger: ExportLedger, key: str) -> tuple[list, list]:
    recorded = ledger.restatements.revisions(key)
    return recorded, [a for a in ledger.queries.attempts(key) if a.outcome in EFFECTS]


def violations(
    ledger: ExportLedger,
    found: Survey,
    keys: list[str] | None = None,
    *,
    final: bool,
    history: History | None = None,
    records: dict | None = None,
) -> dict[str, list]:
    """The invariants of docs/protocol.md ("Invariants"), as lists of offending keys or things (each must be empty).

    * ``duplicate_exports`` (1): a revision recorded twice, or more recorded effects (``completed`` or ``repaired``
      attempt rows) than recorded revisions.
    * ``visible_partial``: what a reader following the layout finds broken (see :class:`Survey`).
    * ``current_not_one`` (2): a pointer that does not read, or names revision N >= 1 but no whole place of it.
    * ``pointer_disagrees`` (3): the pointer and the ledger disagree: a ``completed`` key's pointer must name the place
      (and sha256) of its recorded current revision ``s``; a ``failed`` key's, ``s`` (nothing: revision 0, for a key
      never completed); an ``in_progress`` or ``remote_unknown`` key's, ``s`` or a place of the revision ``r`` under
      way; a key with no record, nothing. Only ``conflict`` may hold anything else.
    * ``revision_chain_broken`` (4): recorded revisions not increasing, one not superseding the recorded one before it
      (with its sha256), a recorded place whose manifest says otherwise; with ``history``, a pointer moved back.
    * ``stale_token_visible`` (5): a pointer naming a place of a token above its fence, a fence above the ledger's
      token; with ``history``, a fence that went down, or the pointer moved to a place whose token is below a fence
      it carried before (a stale commit that succeeded).
    * ``named_deleted`` (7): a recorded revision's place gone, or not whole with its recorded sha256; with
      ``history``, a place once named by the pointer or a record gone or changed. For a kind that replaces a key's
      rows (:attr:`KeyFolder.replaces`, the warehouse), a superseded revision's place is gone by design: its kept
      marker must name its recorded place, sha256 and row count instead, and the current place must hold the
      recorded row count too.
    * ``revision_replaced``: with ``history``, a revision once named at one place (or sha256) named at another.
    * ``not_completed`` (final): a key not ``completed``, or completed with its restatement still open.
    * ``effects_not_one`` (final): not exactly one recorded effect per recorded revision.

    Args:
        found: What the destination shows: all of it when ``keys`` is None, else at least those keys' folders.
        keys: The logical keys to check; None checks every key in the ledger against a survey of everything.
        final: After the last attempt: every key must be completed, its restatement done, one effect per revision.
        history: What earlier checks of the same keys saw; updated with what this one sees.
        records: The keys' records, when the caller has just read them.
    """
    if keys is None:
        records = {r.logical_key: r for r in ledger.queries.records()}
        keys = sorted(records)
    elif records is None:
        records = {key: ledger.queries.get(key) for key in keys}
    requests = ledger.restatements.open_requests(keys)
    problems: dict[str, list] = {name: [] for name in INVARIANTS}
    problems["visible_partial"] = list(found.partial)
    for key in keys:
        record = records.get(key)
        folder = found.folder(key) or KeyFolder(f"(no key folder of {key})")
        reads = history.ledger_reads(ledger, key, record) if history is not None else _ledger_reads(ledger, key)
        recorded, effects = reads
        check = _KeyCheck(key, record, folder, recorded, requests.get(key), problems)
        check.one_export(effects)
        check.one_current()
        check.agrees()
        check.chain()
        check.fencing()
        check.kept()
        if history is not None:
            check.against(history)
        if final:
            if record is None or record.state is not ExportState.COMPLETED:
                problems["not_completed"].append(f"{key}: {record.state.value if record else 'no record'}")
            elif requests.get(key) is not None:
                problems["not_completed"].append(
                    f"{key}: completed with revision {requests[key].revision} still requested"
                )
            if len(effects) != max(len(recorded), 1):
                problems["effects_not_one"].append(
                    f"{key}: {[a.outcome.value for a in effects]} for {len(recorded)} revision(s)"
                )
    return problems


@dataclass
class _KeyCheck:
    """The invariants of one key: its record, folder, recorded revisions and open request; problems go into
    ``problems`` (shared by every key of one :func:`violations`)."""

    key: str
    record: ExportRecord | None
    folder: KeyFolder
    recorded: list[Revision]
    pending: Restatement | None
    problems: dict[str, list]

    def add(self, invariant: str, text: str) -> None:
        self.problems[invariant].append(f"{self.key}: {text}")

    @property
    def pointer(self) -> Pointer:
        return self.folder.pointer or Pointer(self.folder.where, None, 0, 0, None, None, fenced=False)

    def one_export(self, effects: list) -> None:
        revisions = Counter(row.revision for row in self.recorded)
        for revision, count in revisions.items():
            if count > 1:
                self.add("duplicate_exports", f"revision {revision} recorded {count} times")
        if len(effects) > len(self.recorded):
            self.add(
                "duplicate_exports",
                f"{len(effects)} recorded effects ({[a.outcome.value for a in effects]}) for "
                f"{len(self.recorded)} recorded revision(s)",
            )

    def one_current(self) -> None:
        folder = self.folder
        if folder.problem:
            self.add("current_not_one", f"{folder.where}: {folder.problem}")
        elif folder.current and folder.visible is None:
            self.add("current_not_one", f"revision {folder.current} is current but no whole place of it is named "
                                        f"({_named_problem(folder)})")  # fmt: skip

    def agrees(self) -> None:
        """Invariant 3."""
        record, pointer = self.record, self.pointer
        s = self.recorded[-1] if self.recorded else None
        names_s = pointer.revision == 0 if s is None else (
            (pointer.revision, pointer.place) == (s.revision, place_of_location(s.location))
        )  # fmt: skip
        said = f"the pointer names revision {pointer.revision} at {pointer.place!r}"
        recorded = "nothing" if s is None else f"revision {s.revision} at {place_of_location(s.location)!r}"
        if record is None:
            if pointer.revision != 0 or self.folder.places:
                self.add(
                    "pointer_disagrees", f"{said} with {len(self.folder.places)} place(s), the ledger has no record"
                )
            return
        state = record.state
        if state is ExportState.COMPLETED:
            if s is None or not names_s:
                self.add("pointer_disagrees", f"completed at {recorded}, {said}")
            elif (pointer.sha256 is not None and pointer.sha256 != record.sha256) or s.sha256 != record.sha256:
                self.add("pointer_disagrees", f"completed with sha256 {str(record.sha256)[:12]}, {said} with "
                                              f"{str(pointer.sha256)[:12]}")  # fmt: skip
        elif state is ExportState.FAILED:
            if not names_s:
                self.add("pointer_disagrees", f"failed with {recorded} recorded, {said}")
        elif state in (ExportState.IN_PROGRESS, ExportState.REMOTE_UNKNOWN):
            r = self.pending.revision if self.pending is not None else 1
            named = self.folder.named
            under_way = pointer.revision == r and named is not None and named.revision == r
            if not (names_s or under_way):
                self.add("pointer_disagrees", f"{state.value} publishing revision {r} over {recorded}, {said}")

    def chain(self) -> None:
        """Invariant 4, from the ledger's revision rows and the manifests at their places."""
        numbers = [row.revision for row in self.recorded]
        if numbers != sorted(set(numbers)):
            self.add("revision_chain_broken", f"recorded revisions {numbers}")
        before = None
        for row in self.recorded:
            supersedes = (row.supersedes_revision, row.supersedes_sha256)
            expected = (None, None) if before is None else (before.revision, before.sha256)
            if supersedes != expected:
                self.add("revision_chain_broken", f"recorded revision {row.revision} supersedes {supersedes[0]} "
                                                  f"{str(supersedes[1])[:12]}, not {expected[0]} "
                                                  f"{str(expected[1])[:12]}")  # fmt: skip
            place = self.folder.places.get(place_of_location(row.location))
            if place is not None and place.whole:
                manifest = place.manifest
                said = (manifest.revision, manifest.supersedes_revision, manifest.supersedes_sha256)
                if said != (row.revision, *supersedes):
                    self.add(
                        "revision_chain_broken",
                        f"{place.where} says revision {said[0]} superseding {said[1]}, the ledger records "
                        f"{row.revision} superseding {supersedes[0]}",
                    )
            before = row

    def fencing(self) -> None:
        """Invariant 5, from one look: a commit writes its token as the fence; fences come from the ledger's
        tokens."""
        pointer, named = self.pointer, self.folder.named
        if not pointer.fenced:
            return
        if named is not None and named.token is not None and named.token > pointer.fence:
            self.add("stale_token_visible", f"the pointer names {named.name} under fence {pointer.fence}")
        if self.record is not None and pointer.fence > self.record.fencing_token:
            self.add("stale_token_visible", f"the pointer is fenced at {pointer.fence}, above the ledger's token "
                                            f"{self.record.fencing_token}")  # fmt: skip

    def kept(self) -> None:
        """Invariant 7, from the ledger: every recorded revision's place is there, whole, with its sha256.

        A kind that replaces rows (:attr:`KeyFolder.replaces`) keeps only the revision its pointer names as a place;
        each recorded revision it superseded must be kept as a marker of that place, sha256 and row count instead."""
        for row in self.recorded:
            name = place_of_location(row.location)
            if self.folder.replaces and row.revision < self.pointer.revision:
                self.superseded_kept(row.revision, name, row.sha256, row.row_count, "recorded revision")
                continue
            place = self.folder.places.get(name)
            if place is None:
                self.add("named_deleted", f"recorded revision {row.revision}'s place {name!r} is gone")
            elif not place.whole or place.manifest.sha256 != row.sha256:
                self.add("named_deleted", f"recorded revision {row.revision} at {place.where} is not whole with its "
                                          f"recorded sha256 ({place.problem or 'other bytes'})")  # fmt: skip
            elif self.folder.replaces and place.manifest.row_count != row.row_count:
                self.add("named_deleted", f"recorded revision {row.revision} at {place.where} holds "
                                          f"{place.manifest.row_count} rows, {row.row_count} recorded")  # fmt: skip

    def superseded_kept(self, revision: int, name: str, sha256: str, row_count: int | None, said: str) -> None:
        """A replacing kind's superseded revision: its marker is in the history, naming its place and sha256."""
        kept = self.folder.kept_markers.get(revision)
        if kept is None:
            self.add("named_deleted", f"{said} {revision} was superseded and its marker is not in the history")
        elif kept[:2] != (name, sha256) or (row_count is not None and kept[2] != row_count):
            recorded = "" if row_count is None else f" ({row_count} rows)"
            self.add("named_deleted", f"{said} {revision}'s kept marker names {kept[0]!r} {str(kept[1])[:12]} "
                                      f"({kept[2]} rows), not {name!r} {sha256[:12]}{recorded}")  # fmt: skip

    def against(self, history: History) -> None:
        """Invariants 4, 5 and 7 over time, then what this look saw is remembered."""
        key, pointer, named = self.key, self.pointer, self.folder.named
        fence_before = history.fence.get(key, 0)
        if pointer.fenced and pointer.fence < fence_before:
            self.add("stale_token_visible", f"the pointer's fence went down from {fence_before} to {pointer.fence}")
        moved = history.place.get(key) != pointer.place
        if moved and named is not None and named.token is not None and named.token < fence_before:
            self.add("stale_token_visible", f"the pointer moved to {named.name}, below the fence {fence_before} it "
                                            "carried before")  # fmt: skip
        if pointer.revision < history.revision.get(key, 0):
            self.add("revision_chain_broken", f"the pointer moved back from revision {history.revision[key]} to "
                                              f"{pointer.revision}")  # fmt: skip
        seen = history.named.setdefault(key, {})
        for name, (revision, sha256) in sorted(seen.items()):
            place = self.folder.places.get(name)
            if self.folder.replaces and revision < pointer.revision:
                self.superseded_kept(revision, name, sha256, None, "once named, revision")
            elif place is None:
                self.add("named_deleted", f"{name} (revision {revision}), once named, is gone")
            elif not place.whole or place.manifest.sha256 != sha256:
                self.add("named_deleted", f"{place.where} (revision {revision}), once named, changed ({place.problem})")
        naming = [(row.revision, place_of_location(row.location), row.sha256) for row in self.recorded]
        if named is not None and named.whole:
            naming.append((pointer.revision, named.name, named.manifest.sha256))
        for revision, name, sha256 in naming:
            other = [(n, s) for n, (r, s) in seen.items() if r == revision and (n, s) != (name, sha256)]
            if other:
                self.add("revision_replaced", f"revision {revision} is named at {name} {sha256[:12]}, it was at "
                                              f"{other[0][0]} {other[0][1][:12]}")  # fmt: skip
            seen.setdefault(name, (revision, sha256))
        if pointer.fenced:
            history.fence[key] = max(fence_before, pointer.fence)
        history.revision[key] = max(history.revision.get(key, 0), pointer.revision)
        history.place[key] = pointer.place
