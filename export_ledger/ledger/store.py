"""Where the ledger lives: one engine per URL per process, the ledger's clock, the schema's version and its explicit
upgrade.

Opening a ledger to write creates its tables on an empty database and refuses an older schema: upgrading is an
explicit step (:func:`upgrade`, ``export-ledger upgrade``), one alembic revision per schema version
(:mod:`export_ledger.ledger.migrations`). Opening it to read (``export-ledger status``, ``attempts``) never creates or
alters anything, on any backend, and reads an older schema as it is.

Schema versions:

* 1: ``export_runs``, ``export_attempts``, ``export_low_water``, ``export_contracts`` (release 0.1.0).
* 2: ``export_ledger_schema``, which records the version and when each upgrade ran.
* 3: ``export_operator_log`` (operators' decisions: prunes that close dates, key resolutions).
* 4: ``export_runs.source_fingerprint`` and ``export_drift`` (keys whose source changed since).
* 5: ``export_restatements`` and ``export_revisions``.
* 6: ``export_runs.claim_count``, unique revision numbers per key, ``export_contract_refusals``, partition indexes.
* 7: a restatement request may close ``unchanged`` (its new data was the current revision's: nothing published).
* 8: ``ix_export_runs_day_summary`` (the sensor's per-day summaries from an index alone).
* 9: ``export_runs.contract_id``: the contract (and so the destination) each key was last claimed under.

**One clock.** Every decision that involves time reads :func:`database_now` inside the deciding transaction:
PostgreSQL's ``now()`` (the server's clock, the same for every worker whatever its own clock says), or the host's
clock on SQLite (every process that opens a SQLite file runs on the host that holds it).
"""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from export_ledger.errors import ConfigurationError, safe_message
from export_ledger.ledger.errors import LedgerUnavailable, SchemaOutdated
from export_ledger.ledger.schema import SCHEMA_VERSION, export_ledger_schema, export_runs, metadata
from export_ledger.ledger.urls import create_engine, database_url, redact_url

__all__ = ["redact_url"]  # re-exported: callers have always imported it from here

UTC = dt.timezone.utc
#: The table in which alembic keeps the ledger's revision. Not alembic's default ``alembic_version``: a ledger may
#: share its database with Dagster's own storage, which has that table.
VERSION_TABLE = "export_ledger_alembic"
MIGRATIONS = Path(__file__).with_name("migrations")


def database_now(conn: Connection) -> dt.datetime:
    """The ledger's clock, read inside ``conn``'s transaction: PostgreSQL's ``now()`` (the server's clock, fixed for
    the transaction), the host's clock on SQLite. Always UTC-aware."""
    if conn.dialect.name == "postgresql":
        return database_time(conn.execute(_NOW).scalar_one())
    return dt.datetime.now(UTC)


def database_time(value: dt.datetime) -> dt.datetime:
    """PostgreSQL's ``now()`` as read by any statement of the transaction, checked and in UTC."""
    if value.tzinfo is None:  # a timestamptz always comes back aware; a misconfigured driver must not pass
        raise LedgerUnavailable("the ledger's database returned a naive time for now(); refusing to use it")
    return value.astimezone(UTC)


_NOW = sa.select(sa.func.now())
_VERSION_NUM = sa.select(sa.column("version_num")).select_from(sa.table(VERSION_TABLE))
_engines: dict[str, Engine] = {}
_ready: set[str] = set()  # URLs whose schema this process has found (or created) at SCHEMA_VERSION
_engines_lock = threading.Lock()


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # pragma: no cover - exercised through every SQLite test
        # Take over transaction control from pysqlite so that BEGIN IMMEDIATE below is the only BEGIN.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
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
            return
        if not connection.info.get("wal"):
            # WAL on the first write only (it changes the file's header): a process that only reads a ledger never
            # writes a byte of it, whatever its journal mode.
            connection.exec_driver_sql("PRAGMA journal_mode=WAL")
            connection.info["wal"] = True
        connection.exec_driver_sql("BEGIN IMMEDIATE")


#: A pooled server connection idle longer than this is pinged before it is handed out; one given back more recently
#: is not. Pinging every checkout (SQLAlchemy's ``pool_pre_ping``) cost a round trip on each of a key's two
#: transactions: a third of a claim and completion on PostgreSQL (benchmarks, ledger throughput).
IDLE_PING_SECONDS = 1.0


def _ping_idle_connections(engine: Engine) -> None:
    """Pings a connection that sat in the pool longer than :data:`IDLE_PING_SECONDS` when it is checked out, and has
    the pool replace it when the ping fails (a restarted server, a dropped link), as ``pool_pre_ping`` does for every
    checkout. A connection that dies in the second after it was last used fails its transaction, which rolls back;
    SQLAlchemy then discards the pool's other connections too (they are as old), so the next transaction gets a new
    one."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection, record):
        record.info["ledger_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection, record, _proxy):
        since = record.info.pop("ledger_idle_since", None)
        if since is None or time.monotonic() - since <= IDLE_PING_SECONDS:
            return  # a new connection, or one just given back
        try:
            engine.dialect.do_ping(dbapi_connection)  # what pool_pre_ping sends
        except Exception:
            # The pool discards this connection and checks out another (a new one if need be).
            raise sa.exc.DisconnectionError("the pooled ledger connection did not answer its ping") from None


def _engine(url: str, *, make_folder: bool) -> Engine:
    engine = _engines.get(url)
    if engine is not None:
        return engine
    try:
        parsed = database_url(url, what="ledger URL")
    except ConfigurationError as exc:
        raise LedgerUnavailable(str(exc)) from None
    if make_folder and parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database).expanduser().resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LedgerUnavailable(f"cannot create the ledger folder {folder}: {exc.strerror}") from None
    try:
        # hide_parameters: a failed statement's error must not carry its values (exported rows hold customer
        # data) into logs or Dagster's event log.
        engine = create_engine(url, what="ledger URL", hide_parameters=True)
    except ConfigurationError as exc:  # an unknown scheme, a driver that is not installed: named in the message
        raise LedgerUnavailable(str(exc)) from None
    except Exception as exc:
        raise LedgerUnavailable(f"cannot open ledger {redact_url(url)!r}: {safe_message(exc)}") from None
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)  # a file has no connection to lose: nothing to ping
    else:
        _ping_idle_connections(engine)
    _engines[url] = engine
    return engine


def ledger_engine(url: str, *, read_only: bool = False, create: bool = True) -> Engine:
    """One engine per URL per process.

    To write (the default), the schema is created on an empty database; an older schema is refused, naming the
    command that upgrades it, and so is a newer one. To read, nothing is created or changed: a database without a
    ledger, or with a newer schema than this release knows, is refused with a message; an older one reads as it is.
    ``create=False`` (an operator's command) refuses to write into a database that holds no ledger too, and a SQLite
    URL that names no existing file before anything is opened: a mistyped path is never left behind as a new ledger.
    """
    if not create:
        _require_existing_file(url)
    with _engines_lock:
        engine = _engine(url, make_folder=create and not read_only)
        if url in _ready:
            return engine
        with unavailable_as_error(url):
            version = schema_version(engine)
        if version > SCHEMA_VERSION:
            raise LedgerUnavailable(
                f"the ledger at {redact_url(url)!r} has schema version {version}, newer than this release of "
                f"export-ledger supports ({SCHEMA_VERSION}); upgrade export-ledger"
            )
        if version == 0 and (read_only or not create):
            raise LedgerUnavailable(
                f"{redact_url(url)!r} is not an export ledger: it holds no export ledger tables (no export_runs "
                f"table), and {'a read' if read_only else 'this command'} never creates them"
            )
        if read_only:
            return engine  # an older schema reads as it is: upgrades only add
        if version == 0:
            with unavailable_as_error(url):
                upgrade(engine)
        elif version < SCHEMA_VERSION:
            raise SchemaOutdated(
                f"the ledger at {redact_url(url)!r} has schema version {version}; this release writes version "
                f"{SCHEMA_VERSION}. Upgrade it once, explicitly: export-ledger upgrade --ledger-url <that URL> "
                "(reads still work on the older version)"
            )
        _ready.add(url)
        return engine


def _require_existing_file(url: str) -> None:
    """Refuses a SQLite URL that names no existing file, before any connection would create it (a server's database
    is checked by its schema instead)."""
    try:
        parsed = database_url(url, what="ledger URL")  # a plain path is a SQLite file, as in EXPORTS_LEDGER_URL
    except ConfigurationError as exc:  # its message names the URL redacted, never its password
        raise LedgerUnavailable(f"{exc} (for example sqlite:///var/ledger.sqlite3 or ./var/ledger.sqlite3)") from None
    if parsed.get_backend_name() != "sqlite":
        return
    if parsed.database in (None, "", ":memory:"):
        raise LedgerUnavailable("an in-memory SQLite URL holds no ledger; name the ledger's file instead")
    path = Path(parsed.database).expanduser()
    if not path.is_file():
        raise LedgerUnavailable(f"no ledger at {path}: the SQLite file does not exist, and it is not created here")


class unavailable_as_error:
    """Turns a connection failure into :class:`LedgerUnavailable` naming the ledger (password hidden) and the
    driver's error class; the driver's own words are withheld (they can quote statement values)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, _tb) -> bool:
        if isinstance(exc, sa.exc.OperationalError):
            unavailable = LedgerUnavailable(
                f"cannot reach the ledger at {redact_url(self.url)!r}: {exc.orig.__class__.__name__} "
                "(the driver's message is withheld: it can quote statement values)"
            )
            unavailable.unreachable = True  # the first connection failed: an operator's tool may probe why
            raise unavailable from None
        if isinstance(exc, ModuleNotFoundError):
            raise LedgerUnavailable(
                f"cannot open the ledger at {redact_url(self.url)!r}: its database driver is not installed "
                f"({exc.name}); for PostgreSQL write postgresql+psycopg2:// (psycopg2 is installed with export-ledger)"
            ) from None
        return False


def _answers_postgresql(conn: socket.socket) -> bool | None:
    """Whether the peer answers PostgreSQL's SSLRequest as a PostgreSQL server does (one byte, ``S`` or ``N``, then
    nothing until the client goes on): True, False (it said something else, or closed), None (no answer in time)."""
    try:
        conn.sendall((8).to_bytes(4, "big") + (80877103).to_bytes(4, "big"))
        first = conn.recv(1)
    except TimeoutError:
        return None
    except OSError:
        return False
    if first not in (b"S", b"N"):
        return False
    conn.settimeout(0.3)
    try:
        conn.recv(1)  # more bytes (an SSH banner starts with S), or the peer closed: not a server waiting for us
    except TimeoutError:
        return True
    except OSError:
        pass
    return False


_DEFAULT_PORTS = {"postgresql": 5432}


def why_unreachable(url: str, timeout: float = 3.0) -> str:
    """For an operator's message (the CLI calls it once a connection failed; nothing in a run or a sensor does): what
    this function's own probes show about the server at ``url``, never the driver's words (which can quote values).

    Certain: a name that does not resolve, a refused or timed-out TCP connect, a peer that does not answer as
    PostgreSQL. When the server answers as PostgreSQL, a connection with the same URL to its ``postgres`` database
    tells whether the server accepts this user with these settings at all: the words say what each outcome leaves
    open. Empty when it cannot tell (no host, a host given in the query, a probe that fails in an unforeseen way)."""
    try:
        return _probe(url, timeout)
    except Exception:  # a message helper: never an error of its own
        return ""


def _probe(url: str, timeout: float) -> str:
    parsed = database_url(url)
    backend = parsed.get_backend_name()
    if not parsed.host or backend not in _DEFAULT_PORTS or "host" in parsed.query or "hostaddr" in parsed.query:
        return ""
    host, port = parsed.host, parsed.port or _DEFAULT_PORTS[backend]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not 0 < port < 65536:
        return f"the port {port} is not a TCP port"
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            answered = _answers_postgresql(conn)
    except (socket.gaierror, UnicodeError):
        return f"the host name {host!r} does not resolve"
    except ConnectionRefusedError:
        return f"the connection to {where} was refused (is the database server running there?)"
    except TimeoutError:
        return f"connecting to {where} timed out after {timeout:g} s"
    except OSError as exc:
        return f"{where} cannot be reached ({exc.strerror or type(exc).__name__})"
    if answered is None:
        return f"{where} accepted the connection but did not answer as PostgreSQL within {timeout:g} s"
    if not answered:
        return f"{where} accepted the connection but is not a PostgreSQL server (it did not answer as one)"
    if parsed.database in (None, "postgres"):
        return f"{where} is a PostgreSQL server, and it refused this connection"
    probe = sa.create_engine(
        parsed.set(database="postgres"), poolclass=sa.pool.NullPool,
        connect_args={"connect_timeout": max(1, round(timeout))},
    )  # fmt: skip
    try:
        probe.connect().close()
    except sa.exc.DBAPIError:
        return (
            f"{where} is a PostgreSQL server that refuses user {parsed.username!r} with these settings (its postgres "
            "database too): a wrong password or unknown role, pg_hba.conf, the SSL settings, or a connection limit"
        )
    finally:
        probe.dispose()
    return (
        f"{where} is a PostgreSQL server that accepts user {parsed.username!r} (in its postgres database), but not "
        f"in {parsed.database!r}: the database does not exist, the user may not connect to it, or it is at its "
        "connection limit"
    )


def schema_version(engine_or_connection: Engine | Connection) -> int:
    """0 for a database without a ledger, 1 for a ledger made before versions were recorded, else the version its
    alembic revision (or, before 0.5.0, its ``export_ledger_schema`` table) records. Only reads."""
    if isinstance(engine_or_connection, Engine):
        # A read transaction of its own: on SQLite a plain connection would begin a writer's transaction.
        with engine_or_connection.connect().execution_options(ledger_read_only=True) as conn:
            return _version_in(conn, sa.inspect(conn))
    return _version_in(engine_or_connection, sa.inspect(engine_or_connection))


def _version_in(conn: Connection, inspector) -> int:
    if inspector.has_table(VERSION_TABLE):
        revision = conn.execute(_VERSION_NUM).scalar()
        if revision:
            return int(revision.removeprefix("v"))
    if inspector.has_table(export_ledger_schema.name):
        value = conn.execute(sa.select(sa.func.max(export_ledger_schema.c.version))).scalar()
        return int(value or 1)
    return 1 if inspector.has_table(export_runs.name) else 0


def upgrade(engine: Engine) -> list[int]:
    """Brings the ledger's schema to :data:`SCHEMA_VERSION`; returns the versions it upgraded to (empty: nothing to
    do). The explicit step behind ``export-ledger upgrade``.

    An empty database gets every table at once, stamped at the newest revision. An older one runs each alembic
    revision from its version on, in one transaction (both backends run DDL transactionally), so a failed upgrade
    leaves the previous version intact. A ledger upgraded by a release before 0.5.0 has no alembic revision yet: it is
    stamped at the version its ``export_ledger_schema`` records first. Two processes creating one empty ledger at
    once: the loser's tables collide with the winner's, and it finds the work done when it looks again.
    """
    from alembic.migration import MigrationContext
    from alembic.runtime.environment import EnvironmentContext

    script, config = _scripts()
    for _ in range(3):
        done: list[int] = []
        version = -1
        try:
            with engine.begin() as conn:
                version = schema_version(conn)
                if version == 0:
                    metadata.create_all(conn)
                    conn.execute(
                        export_ledger_schema.insert().values(
                            version=SCHEMA_VERSION, applied_at=dt.datetime.now(UTC), note="created"
                        )
                    )
                    MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).stamp(script, "head")
                    return [SCHEMA_VERSION]
                if version >= SCHEMA_VERSION:
                    return []
                context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
                if context.get_current_revision() is None:
                    context.stamp(script, f"v{version}")  # upgraded by an earlier release, without alembic

                def steps(revision, _context):
                    return script._upgrade_revs("head", revision)

                with EnvironmentContext(config, script, fn=steps, destination_rev="head") as environment:
                    environment.configure(connection=conn, version_table=VERSION_TABLE)
                    environment.run_migrations()
                done = list(range(version + 1, SCHEMA_VERSION + 1))
            return done
        except (sa.exc.IntegrityError, sa.exc.ProgrammingError, sa.exc.OperationalError) as exc:
            # Another process created or upgraded the same tables first: the version moved meanwhile, look again.
            # Anything else is this database's own problem, named by its class (the driver's words are withheld).
            if schema_version(engine) == version and not (
                isinstance(exc, sa.exc.OperationalError) and "already exists" in str(exc.orig)
            ):
                raise LedgerUnavailable(
                    f"upgrading the ledger from schema version {version} failed: {type(exc.orig).__name__}; nothing "
                    "was changed (the upgrade runs in one transaction)"
                ) from None
            continue
    raise LedgerUnavailable("could not upgrade the ledger's schema: it kept changing under concurrent upgrades")


def _scripts():
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(config), config


def upgrade_url(url: str) -> list[int]:
    """:func:`upgrade` of the ledger at ``url`` (what ``export-ledger upgrade`` runs); the process's engine for it is
    then ready to write."""
    with _engines_lock:
        engine = _engine(url, make_folder=True)
    with unavailable_as_error(url):
        done = upgrade(engine)
    with _engines_lock:
        _ready.add(url)
    return done


def dispose_engines() -> None:
    """Closes every pooled connection (tests, CLI exit)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _ready.clear()
