"""The warehouse destination's tables and connections: the columns it adds to an export's rows, each column kind's
SQL and Arrow type, an export's tables (``T``, ``T_markers``, ``T_history``, ``T_staged``), one engine per warehouse
URL per process, and which database a warehouse URL names (:func:`warehouse_locator`).

Apart from :class:`~export_ledger.destinations.warehouse.WarehouseDestination`, whose protocol (fence, stage, commit,
the verdicts) is written over them: this module holds what the warehouse database keeps and how it is reached, not how
a key's revision moves there (see :mod:`export_ledger.destinations.warehouse`'s docstring).
"""

from __future__ import annotations

import datetime as dt
import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from export_ledger.errors import ConfigurationError
from export_ledger.lazy import lazy_module
from export_ledger.ledger.urls import database_url, is_plain_path

pa = lazy_module("pyarrow", globals(), "pa")

KEY_COLUMN = "_export_key"
ROW_COLUMN = "_export_row"
PLACE_COLUMN = "_export_place"
TOKEN_COLUMN = "_export_token"
_KEY_LENGTH = 300
_PLACE_LENGTH = 40


class _Timestamp(sa.types.TypeDecorator):
    """A UTC timestamp: ``timestamptz`` on PostgreSQL, naive UTC with microseconds elsewhere (MariaDB's DATETIME(6),
    DuckDB's TIMESTAMP), always read back UTC-aware."""

    impl = sa.DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect):
        if dialect.name == "postgresql":
            return dialect.type_descriptor(sa.DateTime(timezone=True))
        if dialect.name in ("mysql", "mariadb"):
            from sqlalchemy.dialects import mysql

            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(sa.DateTime())

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        value = value.astimezone(dt.UTC)
        return value if dialect.name == "postgresql" else value.replace(tzinfo=None)

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


_SQL = {"string": sa.Text, "float": sa.Double, "int": sa.BigInteger, "timestamp": _Timestamp, "bool": sa.Boolean}


@functools.cache
def _kinds() -> dict:
    """Each Arrow type a warehouse table takes: its column kind and SQL type (pyarrow is imported on first use)."""
    arrow = {"string": pa.string(), "float": pa.float64(), "int": pa.int64(), "timestamp": pa.timestamp("us", tz="UTC"),
             "bool": pa.bool_()}  # fmt: skip
    return {arrow[kind]: (kind, sql) for kind, sql in _SQL.items()}


@functools.cache
def _arrow() -> dict:
    """Each column kind's Arrow type."""
    return {kind: arrow for arrow, (kind, _) in _kinds().items()}


def _warehouse_driver_missing(exc: ImportError) -> ConfigurationError:
    return ConfigurationError(
        "a warehouse: destination needs its database's driver (psycopg2, pymysql, or duckdb with duckdb-engine): "
        f"install export-ledger with the warehouse extra (pip install 'export-ledger[warehouse]'); missing: "
        f"{exc.name or 'a module'}"
    )


#: One engine per URL per process (its pool is shared by every destination of the URL).
_ENGINES: dict[str, sa.Engine] = {}
_ENGINES_LOCK = threading.Lock()
#: Export tables this process made (or found), by URL: create_all's probes run once.
_MADE: dict[str, set[str]] = {}


def _engine_for(url: str) -> sa.Engine:
    with _ENGINES_LOCK:
        engine = _ENGINES.get(url)
        if engine is None:
            parsed = _parsed(url)
            try:
                options = {}
                if parsed.get_backend_name() in ("mysql", "mariadb"):
                    # Each statement reads what is committed now, as on PostgreSQL: under InnoDB's default REPEATABLE
                    # READ, the marker read after a guarded UPDATE that matched nothing (a higher fence committed
                    # meanwhile) would come from the transaction's first snapshot and show the old fence.
                    options["isolation_level"] = "READ COMMITTED"
                engine = _ENGINES[url] = sa.create_engine(parsed, pool_pre_ping=True, **options)
            except ImportError as exc:
                raise _warehouse_driver_missing(exc) from None
            except sa.exc.ArgumentError:
                raise ConfigurationError("EXPORTS_WAREHOUSE_URL is not a SQLAlchemy database URL") from None
        return engine


def dispose_engines() -> None:
    """Closes every warehouse connection this process holds (tests drop their databases after)."""
    with _ENGINES_LOCK:
        for engine in _ENGINES.values():
            engine.dispose()
        _ENGINES.clear()
        _MADE.clear()


@dataclass(frozen=True)
class _Tables:
    """An export's four tables (the rows table made with the export's columns once they are known)."""

    metadata: sa.MetaData
    markers: sa.Table
    history: sa.Table
    name: str


def _marker_columns() -> list[sa.Column]:
    return [
        sa.Column("logical_key", sa.String(_KEY_LENGTH), nullable=False),
        sa.Column("revision", sa.Integer, nullable=False),
        sa.Column("place", sa.String(_PLACE_LENGTH)),
        sa.Column("fencing_token", sa.BigInteger),
        sa.Column("attempt_id", sa.String(200)),
        sa.Column("row_count", sa.BigInteger),
        sa.Column("sha256", sa.String(64)),
        sa.Column("manifest", sa.Text),
        sa.Column("columns", sa.Text),
        sa.Column("committed_at", _Timestamp),
    ]


@functools.lru_cache(maxsize=256)
def _tables(name: str) -> _Tables:
    metadata = sa.MetaData()
    key_parts = [
        sa.Column("export", sa.String(63), primary_key=True),
        sa.Column("tenant", sa.String(63), primary_key=True),
        sa.Column("business_date", sa.String(10), primary_key=True),
    ]
    markers = sa.Table(
        f"{name}_markers", metadata, *key_parts, sa.Column("fence", sa.BigInteger, nullable=False), *_marker_columns()
    )
    history = sa.Table(
        f"{name}_history",
        metadata,
        *(sa.Column(c.name, c.type, primary_key=True) for c in key_parts),
        *(sa.Column(c.name, c.type, primary_key=c.name == "revision", nullable=c.nullable) for c in _marker_columns()),
    )
    return _Tables(metadata, markers, history, name)


def _rows_table(name: str, metadata: sa.MetaData, columns: tuple[tuple[str, str], ...], staged: bool) -> sa.Table:
    extra = (
        [sa.Column(PLACE_COLUMN, sa.String(_PLACE_LENGTH), primary_key=True), sa.Column(TOKEN_COLUMN, sa.BigInteger)]
        if staged
        else []
    )
    return sa.Table(
        f"{name}_staged" if staged else name,
        metadata,
        sa.Column(KEY_COLUMN, sa.String(_KEY_LENGTH), primary_key=True),
        *extra,
        sa.Column(ROW_COLUMN, sa.BigInteger, primary_key=True),
        *(sa.Column(column, _SQL[kind]) for column, kind in columns),
    )


@functools.lru_cache(maxsize=256)
def _rows_of(name: str, columns: tuple[tuple[str, str], ...], staged: bool) -> sa.Table:
    return _rows_table(name, sa.MetaData(), columns, staged)


#: The port a URL that names none connects to, by database system (so both spellings name the same database).
_DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}


def _parsed(url: str) -> sa.engine.URL:
    """The warehouse URL parsed, or refused without echo: text that is no URL (a path, or a password pasted alone)
    and a URL SQLAlchemy would misread (an un-encoded '@' in the password makes its tail the host)."""
    if is_plain_path(url):
        raise ConfigurationError(
            "EXPORTS_WAREHOUSE_URL is not a SQLAlchemy database URL (a DuckDB file is duckdb:///path/to/file.duckdb)"
        )
    return database_url(url, what="EXPORTS_WAREHOUSE_URL")


def warehouse_locator(url: str) -> str:
    """Which warehouse database a URL names, without its user, password, driver or query: the database system, host,
    port and database (a DuckDB or SQLite file's absolute path). Never a secret.

    Example:
        >>> warehouse_locator("postgresql+psycopg2://exporter:pw@db.example/analytics?sslmode=require")
        'postgresql://db.example:5432/analytics'
    """
    parsed = _parsed(url)
    backend, database = parsed.get_backend_name(), parsed.database
    if backend in ("duckdb", "sqlite") and database and database != ":memory:" and ":" not in database:
        database = str(Path(database).expanduser().resolve())  # a relative file is another file in another folder
    port = parsed.port or (_DEFAULT_PORTS.get(backend) if parsed.host else None)
    return sa.engine.URL.create(backend, host=parsed.host, port=port, database=database).render_as_string()
