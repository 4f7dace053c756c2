"""One example's world: a fresh ledger (SQLite or a PostgreSQL schema of its own), two destinations behind stores that
inject faults (A: a local folder, or a bucket on moto's S3 server; B: another local folder), the ledger's controllable
clock, the code a worker runs (:class:`Code`: the export's contract as the worker's environment declares it), and a
reader that looks at each destination the way an outside reader does, without the library.

The reader is deliberately written from docs/protocol.md alone: it lists the key's folder, parses ``_current.json``,
follows it to the manifest and the data file, and hashes the data itself. It shares nothing with
``PublishingDestination.verify``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import quote

import pandas as pd
import sqlalchemy as sa
from builders import open_ledger

from export_ledger.calendar import calendar_contract, window_for
from export_ledger.contract import export_terms, with_terms
from export_ledger.destinations import LocalDestination
from export_ledger.destinations.base import DestinationError, PublishOutcomeUnknown
from export_ledger.destinations.publishing import PublishingDestination
from export_ledger.destinations.store import ObjectStore
from export_ledger.frames import ExportSchema
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ExportRecord, dispose_engines
from export_ledger.ledger.schema import (
    export_attempts,
    export_contracts,
    export_restatements,
    export_revisions,
    export_runs,
)
from export_ledger.placement import recorded_destinations

UTC = dt.timezone.utc
EXPORT = "orders"
SCHEMA = ExportSchema(
    {"order_id": "string", "placed_at": "timestamp", "amount": "float"}, "placed_at", ("order_id",)
)
LEASE = dt.timedelta(minutes=10)
#: The ledger's clock at the start of every example: the late key's window ends 20 minutes later (so claims before
#: it ends are tried and must be refused). Far from the host's clock on purpose: a decision that read the host's
#: clock instead of the ledger's would show.
START = dt.datetime(2026, 3, 20, 3, 40, tzinfo=UTC)
#: Two keys: one whose window ended long ago (UTC), one whose window (New York) ends at 2026-03-20T04:00Z.
KEYS = (
    LogicalKey(EXPORT, "acme", window_for(dt.date(2026, 3, 18), "UTC")),
    LogicalKey(EXPORT, "globex", window_for(dt.date(2026, 3, 19), "America/New_York")),
)
POSTGRES_ADMIN_URL = os.environ.get("EXPORTS_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


#: The destinations' names, by index: A (local or S3) and B (a local folder).
PLACES = "AB"
START_DATE = "2026-01-01"


@dataclass(frozen=True)
class Code:
    """What a worker's code and environment say the export is (its contract's terms): the destination (0: A, 1: B),
    the file format, the columns in file order, the source's name and the export's version."""

    at: int = 0
    file_format: str = "csv"
    columns: tuple[str, ...] = tuple(SCHEMA.columns)
    source: str = "orders.read"
    version: int | None = None

    def schema(self) -> ExportSchema:
        return ExportSchema({name: SCHEMA.columns[name] for name in self.columns}, SCHEMA.time_column,
                            SCHEMA.id_columns)  # fmt: skip

    def changed(self, what: str) -> Code:
        """This code after a deploy that changes ``what``."""
        if what == "destination":
            return replace(self, at=1 - self.at)
        if what == "file_format":
            return replace(self, file_format="parquet" if self.file_format == "csv" else "csv")
        if what == "columns":
            return replace(self, columns=self.columns[1:] + self.columns[:1])
        if what == "source":
            return replace(self, source=self.source + "_v2")
        return replace(self, version=(self.version or 0) + 1)

    def describe(self) -> str:
        columns = ",".join(c[0] for c in self.columns)
        return f"{PLACES[self.at]}/{self.file_format}/{columns}/{self.source}/v{self.version}"


#: What a deploy may change.
CHANGES = ("destination", "file_format", "columns", "source", "version")


def frame_for(key: LogicalKey, variant: int) -> pd.DataFrame:
    """An attempt's source rows: two rows inside the key's window, the amounts telling attempts apart (so that one
    attempt's data published over another's would show in the sha256)."""
    start = key.window.start_utc
    return pd.DataFrame(
        {
            "order_id": [f"{key.tenant}-{i}" for i in range(2)],
            "placed_at": pd.to_datetime([start + dt.timedelta(hours=i + 1) for i in range(2)], utc=True),
            "amount": [float(variant * 10 + i) for i in range(2)],
        }
    )


class Clock:
    """The ledger's clock (passed as ``ExportLedger(clock=...)``): moves only when the machine says."""

    def __init__(self, start: dt.datetime) -> None:
        self.now = start

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


# -- faults at the destination -------------------------------------------------------------------------------------

LANDED = "landed"  # the pointer write is applied, then the answer is lost: PublishOutcomeUnknown
LOST = "lost"  # the pointer write is not applied, and the answer is lost: PublishOutcomeUnknown
REFUSED = "refused"  # the store certainly did not write it (a 403, a connection refused): DestinationError
FAULTS = (LANDED, LOST, REFUSED)


class Faults:
    """One fault armed for one ``put_if_match`` of one step (the pointer's compare-and-swap: fence, commit, discard):
    the first one after ``skip`` others, then disarmed. ``enabled`` False: none fires (the liveness phase)."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.skip = 0
        self.enabled = True
        self.fired: list[str] = []

    def arm(self, mode: str | None, skip: int = 0) -> None:
        self.armed, self.skip = (mode if self.enabled else None), skip

    def disarm(self) -> None:
        self.armed = None

    def take(self) -> str | None:
        if self.armed is not None and self.skip > 0:
            self.skip -= 1
            return None
        mode, self.armed = self.armed, None
        return mode


class FaultyStore(ObjectStore):
    """A store's hooks, passed through, except a ``put_if_match`` that meets an armed fault."""

    def __init__(self, inner: ObjectStore, faults: Faults) -> None:
        self.inner, self.faults = inner, faults

    def url(self, name):
        return self.inner.url(name)

    def describe(self):
        return self.inner.describe()

    def get(self, name):
        return self.inner.get(name)

    def digest(self, name):
        return self.inner.digest(name)

    def read(self, name):
        return self.inner.read(name)

    def put_if_absent(self, name, data):
        return self.inner.put_if_absent(name, data)

    def upload(self, name):
        return self.inner.upload(name)

    def list(self, prefix):
        return self.inner.list(prefix)

    def delete(self, name):
        return self.inner.delete(name)

    def check_conditions(self):
        return self.inner.check_conditions()

    def put_if_match(self, name, data, tag):
        mode = self.faults.take()
        if mode is None:
            return self.inner.put_if_match(name, data, tag)
        self.faults.fired.append(mode)
        if mode == LANDED:
            self.inner.put_if_match(name, data, tag)
            raise PublishOutcomeUnknown(f"injected: {name} written, the answer lost")
        if mode == LOST:
            raise PublishOutcomeUnknown(f"injected: {name} not written, the answer lost")
        raise DestinationError(f"injected: the store refused writing {name}")


class FaultyDestination(PublishingDestination):
    """The real publishing template over the real store (local or S3), with :class:`FaultyStore` in between."""

    def __init__(self, inner: PublishingDestination, faults: Faults) -> None:
        self.inner = inner
        self._store = FaultyStore(inner.store, faults)
        self.pool = inner.pool  # its kind, as a contract records it

    @property
    def store(self) -> ObjectStore:
        return self._store

    def spec(self):
        return self.inner.spec()

    def identity(self, export: str) -> dict:
        return self.inner.identity(export)


# -- the independent reader ----------------------------------------------------------------------------------------


@dataclass
class Place:
    """One place ``r<revision>-t<token>/`` as the reader finds it."""

    name: str
    revision: int | None
    token: int | None
    manifest: dict | None
    data_sha256: str | None  # of the data file the manifest names (None: missing)

    @property
    def intact(self) -> bool:
        return self.manifest is not None and self.data_sha256 is not None and self.data_sha256 == self.manifest.get(
            "sha256"
        )


@dataclass
class KeyView:
    """What a reader of one key sees: the pointer (fence, revision, place, sha256) and every place there is."""

    fence: int
    revision: int
    place: str | None
    sha256: str | None
    places: dict[str, Place] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    has_pointer: bool = False


def parse_place(name: str) -> tuple[int, int] | None:
    if not name.startswith("r") or "-t" not in name:
        return None
    revision, _, token = name[1:].partition("-t")
    return (int(revision), int(token)) if revision.isdigit() and token.isdigit() else None


def key_folder(key: LogicalKey) -> str:
    return f"{key.export}/tenant={key.tenant}/date={key.window.business_date.isoformat()}"


def read_view(objects: dict[str, bytes], key: LogicalKey) -> KeyView:
    """The key as a reader sees it, from the objects of its folder (names relative to it)."""
    places: dict[str, Place] = {}
    for name in objects:
        if "/" not in name:
            continue
        folder = name.split("/", 1)[0]
        if folder in places:
            continue
        parsed = parse_place(folder)
        manifest = None
        data_sha = None
        raw = objects.get(f"{folder}/_manifest.json")
        if raw is not None:
            try:
                manifest = json.loads(raw)
            except ValueError:
                manifest = None
        if isinstance(manifest, dict) and isinstance(manifest.get("data_file"), str):
            data = objects.get(f"{folder}/{manifest['data_file']}")
            data_sha = None if data is None else hashlib.sha256(data).hexdigest()
        places[folder] = Place(folder, *(parsed or (None, None)), manifest if isinstance(manifest, dict) else None,
                               data_sha)  # fmt: skip
    raw = objects.get("_current.json")
    if raw is None:
        stray = [n for n in objects if "/" not in n]
        view = KeyView(0, 0, None, None, places)
        if stray:
            view.problems.append(f"objects in the key's folder without a pointer: {stray}")
        return view
    problems: list[str] = []
    try:
        pointer = json.loads(raw)
    except ValueError:
        return KeyView(0, 0, None, None, places, [f"_current.json is not JSON: {raw[:80]!r}"], True)
    fence, revision = pointer.get("fence", 0), pointer.get("revision")
    if pointer.get("format") != 2:
        problems.append(f"pointer format {pointer.get('format')!r}, not 2")
    if pointer.get("logical_key") != str(key):
        problems.append(f"pointer names key {pointer.get('logical_key')!r}")
    if not isinstance(revision, int) or revision < 0 or not isinstance(fence, int) or fence < 0:
        return KeyView(0, 0, None, None, places, problems + [f"pointer revision {revision!r} fence {fence!r}"], True)
    if revision == 0:
        if pointer.get("path") is not None:
            problems.append(f"revision 0 with a path {pointer.get('path')!r}")
        return KeyView(fence, 0, None, None, places, problems, True)
    path = pointer.get("path")
    view = KeyView(fence, revision, path, pointer.get("sha256"), places, problems, True)
    place = places.get(path)
    if place is None:
        problems.append(f"the pointer names {path!r}, which holds nothing")
        return view
    if pointer.get("manifest") != f"{path}/_manifest.json":
        problems.append(f"the pointer's manifest is {pointer.get('manifest')!r}")
    if place.manifest is None:
        problems.append(f"{path} has no readable manifest")
        return view
    manifest = place.manifest
    if pointer.get("data_file") != f"{path}/{manifest.get('data_file')}":
        problems.append(
            f"the pointer names data {pointer.get('data_file')!r}, the manifest {manifest.get('data_file')!r}"
        )
    if place.data_sha256 is None:
        problems.append(f"{path}: the data file its manifest names is missing")
    elif not (place.data_sha256 == manifest.get("sha256") == pointer.get("sha256")):
        problems.append(f"{path}: data sha256 {place.data_sha256}, manifest {manifest.get('sha256')}, pointer "
                        f"{pointer.get('sha256')}")  # fmt: skip
    if manifest.get("logical_key") != str(key):
        problems.append(f"{path} holds key {manifest.get('logical_key')!r}")
    if manifest.get("revision", 1) != revision or place.revision != revision:
        problems.append(f"{path} holds revision {manifest.get('revision', 1)} for the pointer's {revision}")
    if place.token is None or manifest.get("fencing_token") != place.token:
        problems.append(f"{path}: manifest token {manifest.get('fencing_token')} for its place")
    return view


class LocalReader:
    """The objects of a key's folder, read from the file system."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def objects(self, key: LogicalKey) -> dict[str, bytes]:
        base = self.root / key_folder(key)
        found: dict[str, bytes] = {}
        if not base.exists():
            return found
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):
                    continue
                path = Path(dirpath) / name
                found[path.relative_to(base).as_posix()] = path.read_bytes()
        return found


class S3Reader:
    """The objects of a key's folder, read from the bucket with a client of its own."""

    def __init__(self, client, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix

    def objects(self, key: LogicalKey) -> dict[str, bytes]:
        base = f"{self.prefix}/{key_folder(key)}/"
        found: dict[str, bytes] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for item in page.get("Contents", []):
                body = self.client.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
                found[item["Key"][len(base) :]] = body
        return found


# -- the ledger's rows, read apart from the library's queries -------------------------------------------------------

_RUNS = sa.select(export_runs)
_REVISIONS = sa.select(export_revisions).order_by(export_revisions.c.logical_key, export_revisions.c.revision)
_REQUESTS = sa.select(export_restatements).order_by(export_restatements.c.id)
_CONTRACTS = sa.select(export_contracts.c.id, export_contracts.c.contract).order_by(export_contracts.c.id)


def canonical(contract) -> str:
    """A contract compared as JSON with sorted keys, without the tenant it is recorded for."""
    return json.dumps({k: v for k, v in dict(contract).items() if k != "tenant"}, sort_keys=True)


@dataclass
class Current:
    """A key's recorded current revision: what a completed key's readers must get."""

    revision: int
    location: str
    sha256: str


@dataclass
class KeyRows:
    """One key's rows: its ``export_runs`` row (None: never claimed), revisions and restatement requests."""

    run: sa.Row | None
    revisions: list = field(default_factory=list)
    requests: list = field(default_factory=list)
    contract: dict | None = None  # the contract its row names (contract_id), read from export_contracts
    in_force: dict | None = None  # its tenant's contract in force (the latest recorded for it, or for every tenant)
    export_terms: dict | None = None  # the export's terms in force: those of the newest contract recorded

    @property
    def state(self) -> str | None:
        return None if self.run is None else self.run.state

    @property
    def open_request(self):
        found = [r for r in self.requests if r.closed_at is None]
        return found[-1] if found else None

    @property
    def current(self) -> Current | None:
        """The newest recorded revision; a completed key never restated has revision 1 on its own row (the revisions
        table starts at its first request), and a key without either never completed."""
        if self.revisions:
            newest = self.revisions[-1]
            return Current(newest.revision, newest.location, newest.sha256)
        if self.run is not None and self.run.state == "completed":
            return Current(1, self.run.location, self.run.sha256)
        return None


class LedgerRows:
    """Reads the ledger's three tables in one go, with an engine of its own (prebuilt statements: cheap enough to
    run after every rule)."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)

    def read(self) -> dict[str, KeyRows]:
        with self.engine.connect() as conn:
            rows = {run.logical_key: KeyRows(run) for run in conn.execute(_RUNS)}
            for revision in conn.execute(_REVISIONS):
                rows.setdefault(revision.logical_key, KeyRows(None)).revisions.append(revision)
            for request in conn.execute(_REQUESTS):
                rows.setdefault(request.logical_key, KeyRows(None)).requests.append(request)
            contracts = {row_id: json.loads(text) for row_id, text in conn.execute(_CONTRACTS)}
        for found in rows.values():
            found.export_terms = terms_in_force(contracts)
            if found.run is not None:
                found.contract = contracts.get(found.run.contract_id)
                found.in_force = in_force(contracts, found.run.tenant)
        return rows

    def key(self, key: LogicalKey) -> KeyRows:
        found = self.read().get(str(key), KeyRows(None))
        if found.run is None:
            with self.engine.connect() as conn:
                contracts = {row_id: json.loads(text) for row_id, text in conn.execute(_CONTRACTS)}
            found.in_force, found.export_terms = in_force(contracts, key.tenant), terms_in_force(contracts)
        return found

    def attempts(self, attempt_id: str) -> list[sa.Row]:
        """The attempt rows an attempt left (outcome and error class)."""
        query = sa.select(export_attempts.c.outcome, export_attempts.c.error_class).where(
            export_attempts.c.attempt_id == attempt_id
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query.order_by(export_attempts.c.id)))

    def in_force(self, tenant: str) -> dict | None:
        with self.engine.connect() as conn:
            contracts = {row_id: json.loads(text) for row_id, text in conn.execute(_CONTRACTS)}
        return in_force(contracts, tenant)

    def close(self) -> None:
        self.engine.dispose()


def terms_in_force(contracts: dict[int, dict]) -> dict | None:
    """The export's terms in force, as docs say: those of the newest contract recorded (an acceptance of new terms
    records them for every tenant)."""
    return contracts[max(contracts)].get("terms") if contracts else None


def in_force(contracts: dict[int, dict], tenant: str) -> dict | None:
    """The tenant's contract in force, as docs say: the latest recorded for it or for every tenant (no tenant)."""
    mine = [row_id for row_id, c in contracts.items() if c.get("tenant") in (None, tenant)]
    return contracts[max(mine)] if mine else None


# -- backends ------------------------------------------------------------------------------------------------------

_ADMIN: dict[str, sa.Engine] = {}


def postgres_admin() -> sa.Engine:
    engine = _ADMIN.get("admin")
    if engine is None:
        engine = _ADMIN["admin"] = sa.create_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
    return engine


def postgres_unavailable() -> str | None:
    try:
        with postgres_admin().connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return None
    except Exception as exc:  # any failure to connect is a reason to skip (or, with CI=true, to fail)
        return f"PostgreSQL not reachable at {POSTGRES_ADMIN_URL}: {type(exc).__name__}"


#: The S3 endpoint of the session's moto server (set by the test module's fixture before S3 machines run).
S3_ENDPOINT: dict[str, str] = {}
S3_CREDENTIALS = dict(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")


def scratch_root() -> str | None:
    """Where examples keep their files: tmpfs when there is one (every example fsyncs a lot), else the default."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class World:
    """Everything one example runs against; :meth:`close` removes it all."""

    def __init__(self, backend: str, destination: str) -> None:
        self.backend, self.kind = backend, destination
        self.clock = Clock(START)
        self.faults = Faults()
        self.tmp = Path(tempfile.mkdtemp(prefix="stateful-", dir=scratch_root()))
        self._closers = [lambda: shutil.rmtree(self.tmp, ignore_errors=True)]
        if backend == "sqlite":
            self.url = f"sqlite:///{self.tmp / 'ledger.sqlite3'}"
        else:
            schema = f"s_{uuid.uuid4().hex[:12]}"
            with postgres_admin().begin() as conn:
                conn.execute(sa.schema.CreateSchema(schema))

            def drop() -> None:
                with postgres_admin().begin() as conn:
                    conn.execute(sa.schema.DropSchema(schema, cascade=True))

            self._closers.append(drop)
            self.url = f"{POSTGRES_ADMIN_URL}?options={quote(f'-csearch_path={schema}')}"
        self._closers.append(dispose_engines)
        self.ledger = open_ledger(self.url, lease_ttl=LEASE, clock=self.clock)
        self.rows = LedgerRows(self.url)
        self._closers.append(self.rows.close)
        if destination == "local":
            root = self.tmp / "exports"
            inner: PublishingDestination = LocalDestination(str(root))
            reader: LocalReader | S3Reader = LocalReader(root)
        else:
            import boto3

            from export_ledger.destinations.s3 import S3Destination

            endpoint = S3_ENDPOINT["url"]
            client = boto3.client("s3", endpoint_url=endpoint, **S3_CREDENTIALS)
            bucket = f"stateful-{uuid.uuid4().hex[:16]}"
            client.create_bucket(Bucket=bucket)

            def empty() -> None:
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                    for item in page.get("Contents", []):
                        client.delete_object(Bucket=bucket, Key=item["Key"])
                client.delete_bucket(Bucket=bucket)
                client.close()

            self._closers.append(empty)
            inner = S3Destination(
                bucket=bucket, prefix="exports", endpoint_url=endpoint, access_key_id="testing",
                secret_access_key="testing", read_timeout_seconds=30.0, connect_timeout_seconds=5.0,
            )  # fmt: skip
            reader = S3Reader(client, bucket, "exports")
        elsewhere = self.tmp / "moved"
        #: A and B; the same faults are armed for both (a step writes at one of them).
        self.destinations = [FaultyDestination(inner, self.faults),
                             FaultyDestination(LocalDestination(str(elsewhere)), self.faults)]  # fmt: skip
        self.readers = [reader, LocalReader(elsewhere)]
        self.destination = self.destinations[0]
        self.homes = [d.identity(EXPORT) for d in self.destinations]
        self.prefixes = [d.store.url("") for d in self.destinations]

    def view(self, key: LogicalKey, at: int = 0) -> KeyView:
        """The key as a reader of destination ``at`` sees it."""
        return read_view(self.readers[at].objects(key), key)

    def contract(self, key: LogicalKey, code: Code) -> dict:
        """The contract a claim of ``key`` by ``code`` is checked against: the tenant's calendar (its key's zone) and
        the code's terms, built with the library's own functions as an export's spec builds them."""
        terms = export_terms(
            destination=self.destinations[code.at].identity(EXPORT), file_format=code.file_format,
            schema=code.schema(), source={"kind": "callable", "name": code.source}, version=code.version,
        )  # fmt: skip
        return with_terms(calendar_contract(key.window.timezone, START_DATE), terms)

    def home_of(self, contract: dict | None) -> int | None:
        """Which destination a contract records (None: no contract, or none of A and B)."""
        place = (contract or {}).get("terms", {}).get("destination")
        return self.homes.index(place) if place in self.homes else None

    def at_of(self, location: str) -> int | None:
        """Which destination a recorded location is at (None: neither)."""
        found = [at for at, prefix in enumerate(self.prefixes) if location.startswith(prefix)]
        return max(found, key=lambda at: len(self.prefixes[at])) if found else None

    def placed(self, records: list[ExportRecord]) -> dict[str, FaultyDestination]:
        """Where the library says each key's export is (:func:`recorded_destinations`, as ``export-ledger
        reconcile``, ``resolve`` and ``restate --withdraw`` ask it), as this world's destination there (its faults
        armed)."""
        here = self.destination
        chosen = recorded_destinations(self.ledger, records, known=here, fallback=lambda _: here)
        found = {}
        for name, destination in chosen.items():
            identity = destination.identity(EXPORT)
            if identity not in self.homes:
                raise AssertionError(f"{name}: the library placed it at {identity}, neither A nor B")
            found[name] = self.destinations[self.homes.index(identity)]
        return found

    def close(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception:  # cleanup is best effort: a failed drop must not hide the example's outcome
                pass
