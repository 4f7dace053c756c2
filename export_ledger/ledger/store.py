"""Where the ledger lives: one engine per URL per process, the schema's version, and its explicit upgrade path.

Opening a ledger to write creates its tables on an empty database and upgrades an older schema in one transaction;
opening it to read (``export-ledger status``, ``attempts``) never creates or alters anything, on any backend.

Schema versions:

* 1: ``export_runs``, ``export_attempts``, ``export_low_water``, ``export_contracts`` (release 0.1.0; no version
  table: a database with ``export_runs`` and no ``export_ledger_schema`` is version 1).
* 2: adds ``export_ledger_schema``, which records the version and when each upgrade ran. Every other table is
  unchanged, so version 1 data is read as it is.
* 3: adds ``export_operator_log`` (operators' decisions: prunes that close dates, key resolutions).
* 4: adds the nullable ``export_runs.source_fingerprint`` (what the source held at completion) and ``export_drift``
  (keys whose source changed since). Reads select the version 3 columns, so a version 3 ledger reads as it is.
* 5: adds ``export_restatements`` (requests to publish a new revision of a completed key) and ``export_revisions``
  (every published revision). Keys never restated need no row: a version 4 ledger reads as it is.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url

from export_ledger.errors import SECRET_NAME
from export_ledger.ledger.errors import LedgerUnavailable
from export_ledger.ledger.schema import (
    SCHEMA_VERSION,
    export_drift,
    export_ledger_schema,
    export_operator_log,
    export_restatements,
    export_revisions,
    export_runs,
    metadata,
)

UTC = dt.timezone.utc


def redact_url(url: str) -> str:
    """The URL for messages: the password of its userinfo and every query parameter named like a secret
    (password, secret, token, key, sig) replaced by ``***``."""
    try:
        parsed = make_url(url)
    except Exception:  # an unparsable URL is reported by its scheme only
        return url.split(":", 1)[0] + ":..."
    query = {name: ("***" if SECRET_NAME.search(name) else value) for name, value in parsed.query.items()}
    return parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


_engines: dict[str, Engine] = {}
_ready: set[str] = set()  # URLs whose schema this process has created or upgraded to SCHEMA_VERSION
_engines_lock = threading.Lock()


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # pragma: no cover - exercised through every SQLite test
        # Take over transaction control from pysqlite so that BEGIN IMMEDIATE below is the only BEGIN.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # pragma: no cover - exercised through every SQLite test
        # Writers take the write lock up front: two claimers never both read a state and then race to update it.
        # Readers begin deferred, so `status` never waits behind a running export.
        if connection.get_execution_options().get("ledger_read_only"):
            connection.exec_driver_sql("BEGIN")
        else:
            connection.exec_driver_sql("BEGIN IMMEDIATE")


def _engine(url: str, *, make_folder: bool) -> Engine:
    engine = _engines.get(url)
    if engine is not None:
        return engine
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise LedgerUnavailable(f"invalid ledger URL {redact_url(url)!r}: {type(exc).__name__}") from None
    if make_folder and parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database).expanduser().resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LedgerUnavailable(f"cannot create the ledger folder {folder}: {exc.strerror}") from None
    try:
        # hide_parameters: a failed statement's error must not carry its values (exported rows hold customer
        # data) into logs or Dagster's event log.
        # A file has no connection to lose: pinging it before every transaction only costs time.
        engine = sa.create_engine(parsed, pool_pre_ping=parsed.get_backend_name() != "sqlite", hide_parameters=True)
    except Exception as exc:
        raise LedgerUnavailable(f"cannot open ledger {redact_url(url)!r}: {type(exc).__name__}") from None
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    _engines[url] = engine
    return engine


def ledger_engine(url: str, *, read_only: bool = False) -> Engine:
    """One engine per URL per process.

    To write (the default), the schema is created on an empty database and an older one is upgraded, once per
    process. To read, nothing is created or changed: a database without a ledger, or with a newer schema than this
    release knows, is refused with a message.
    """
    with _engines_lock:
        engine = _engine(url, make_folder=not read_only)
        if url in _ready:
            return engine
        with _unavailable_as_error(url):
            version = schema_version(engine)
        if version > SCHEMA_VERSION:
            raise LedgerUnavailable(
                f"the ledger at {redact_url(url)!r} has schema version {version}, newer than this release of "
                f"export-ledger supports ({SCHEMA_VERSION}); upgrade export-ledger"
            )
        if read_only:
            if version == 0:
                raise LedgerUnavailable(
                    f"{redact_url(url)!r} holds no export ledger (no export_runs table); a read never creates one"
                )
            return engine  # an older schema reads as it is: upgrades only add
        with _unavailable_as_error(url):
            upgrade(engine)
        _ready.add(url)
        return engine


class _unavailable_as_error:
    """Turns a connection failure into :class:`LedgerUnavailable` naming the ledger (password hidden)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, _tb) -> bool:
        if isinstance(exc, sa.exc.OperationalError):
            first = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else ""
            raise LedgerUnavailable(
                f"cannot reach the ledger at {redact_url(self.url)!r}: {exc.orig.__class__.__name__}: {first}"
            ) from None
        return False


def schema_version(engine_or_connection: Engine | Connection) -> int:
    """0 for a database without a ledger, 1 for a ledger made before versions were recorded, else the recorded one."""
    inspector = sa.inspect(engine_or_connection)
    if inspector.has_table(export_ledger_schema.name):
        if isinstance(engine_or_connection, Engine):
            with engine_or_connection.connect() as conn:
                return _recorded_version(conn)
        return _recorded_version(engine_or_connection)
    return 1 if inspector.has_table(export_runs.name) else 0


def _recorded_version(conn: Connection) -> int:
    value = conn.execute(sa.select(sa.func.max(export_ledger_schema.c.version))).scalar()
    return int(value or 1)


def _v1_to_v2(conn: Connection) -> None:
    export_ledger_schema.create(conn, checkfirst=True)


def _v2_to_v3(conn: Connection) -> None:
    export_operator_log.create(conn, checkfirst=True)


# A constant statement (no values): SQLAlchemy Core has no ALTER TABLE construct. Both backends accept it, and
# adding a nullable column without a default rewrites no row.
_ADD_SOURCE_FINGERPRINT = sa.text("ALTER TABLE export_runs ADD COLUMN source_fingerprint VARCHAR(120)")


def _v3_to_v4(conn: Connection) -> None:
    columns = {column["name"] for column in sa.inspect(conn).get_columns(export_runs.name)}
    if "source_fingerprint" not in columns:
        conn.execute(_ADD_SOURCE_FINGERPRINT)
    export_drift.create(conn, checkfirst=True)


def _v4_to_v5(conn: Connection) -> None:
    export_restatements.create(conn, checkfirst=True)
    export_revisions.create(conn, checkfirst=True)


# Each step takes the schema from version N to N + 1 and only adds: older data stays readable as it is.
UPGRADES: dict[int, Callable[[Connection], None]] = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5}


def upgrade(engine: Engine) -> list[int]:
    """Brings the ledger's schema to :data:`SCHEMA_VERSION`; returns the versions it upgraded to (empty: nothing to do).

    An empty database gets every table at once. Each upgrade runs in one transaction with its version row, so a
    failed upgrade leaves the previous version intact. Two processes upgrading at once: the loser's version row
    collides with the winner's, and it finds the work done when it looks again.
    """
    done: list[int] = []
    for _ in range(3):
        try:
            with engine.begin() as conn:
                version = schema_version(conn)
                if version == 0:
                    metadata.create_all(conn)
                    _stamp(conn, SCHEMA_VERSION, "created")
                    return [SCHEMA_VERSION]
                while version < SCHEMA_VERSION:
                    UPGRADES[version](conn)
                    version += 1
                    _stamp(conn, version, f"upgraded from {version - 1}")
                    done.append(version)
            return done
        except (sa.exc.IntegrityError, sa.exc.ProgrammingError):
            done = []  # another process created or upgraded the same tables first; look again
        except sa.exc.OperationalError as exc:
            if "already exists" not in str(exc.orig):
                raise
            done = []
    raise LedgerUnavailable("could not upgrade the ledger's schema: it kept changing under concurrent upgrades")


def _stamp(conn: Connection, version: int, note: str) -> None:
    conn.execute(export_ledger_schema.insert().values(version=version, applied_at=dt.datetime.now(UTC), note=note))


def dispose_engines() -> None:
    """Closes every pooled connection (tests, CLI exit)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _ready.clear()
