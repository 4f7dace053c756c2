"""Where an export's rows come from: one tenant's rows for one half-open UTC window ``[start, end)``.

Plain Python. Three kinds: a subclass of :class:`ExportSource`, any callable ``(tenant, start_utc, end_utc) ->
DataFrame`` (wrapped in :class:`CallableSource`), and :class:`SqlSource`, a query with bound ``:tenant``, ``:start``
and ``:end`` against a SQLAlchemy URL. A partitioned Dagster asset of the user's own is the fourth way in, through the
ledgered I/O manager (see :mod:`export_ledger.dagster`).
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL

from export_ledger.calendar import require_aware
from export_ledger.contract import digest
from export_ledger.errors import ConfigurationError, SourceError
from export_ledger.frames import ExportSchema
from export_ledger.lazy import lazy_module
from export_ledger.ledger.urls import create_engine, database_url, is_plain_path, redact_url

pd = lazy_module("pandas", globals(), "pd")

#: Rows per batch when a source streams. Measured on a 6-column export from PostgreSQL (benchmarks/streaming.py):
#: a batch costs about 1.3 KB a row while it is in flight (the driver's row objects, the DataFrame, the Arrow table,
#: the id hashes), so 50,000 rows keep an export's peak near 130 MiB above the interpreter's, whatever the partition.
DEFAULT_BATCH_ROWS = 50_000


class ExportSource(ABC):
    """A source of one export's rows."""

    @abstractmethod
    def rows(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        """Every row of ``tenant`` whose time is in ``[start_utc, end_utc)``."""

    def count(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> int | None:
        """How many rows :meth:`rows` returns for the same arguments (the export's asset check compares it, when it
        is run on its own); None: not known without reading the rows again."""
        return len(self.rows(tenant, start_utc, end_utc))

    def identity(self) -> dict:
        """A stable description of where the rows come from, recorded in the export's contract
        (:mod:`export_ledger.contract`): a claim from a worker whose source differs is refused. Never a secret.

        This default names the class; a source whose settings decide what it reads (a URL, a table) overrides it to
        add them, redacted."""
        return {"kind": "python", "name": qualified_name(type(self))}

    def batches(
        self,
        tenant: str,
        start_utc: dt.datetime,
        end_utc: dt.datetime,
        *,
        schema: ExportSchema | None = None,
        batch_rows: int = DEFAULT_BATCH_ROWS,
    ) -> Iterator[pd.DataFrame]:
        """The rows of :meth:`rows` as DataFrames of at most about ``batch_rows`` rows each, in file order.

        A source that can stream overrides this to yield batches as it reads them, so that an export holds one batch
        at a time (:class:`~export_ledger.frames.FrameBatches`). This default reads :meth:`rows` whole and yields it
        as one batch: the memory of the whole frame, the same rows. ``schema`` lets a source conform its values to
        the export's kinds.
        """
        yield self.rows(tenant, start_utc, end_utc)


def check_query(query: str) -> None:
    """Refuses a :class:`SqlSource` query that does not bind ``:tenant``, ``:start`` and ``:end`` (it would read
    another tenant's or another day's rows): checked where the query is declared, whether or not its URL is at hand.

    Raises:
        ValueError: naming the missing parameters.
    """
    missing = [name for name in (":tenant", ":start", ":end") if name not in query]
    if missing:
        raise ValueError(f"SqlSource query must use the bound parameters {missing}")


class _Unreadable(ExportSource):
    """A source that refuses every read, saying why (:meth:`_why`): the rows, their count, the identity, the batches."""

    def _why(self) -> str:
        raise NotImplementedError

    def rows(self, tenant, start_utc, end_utc):
        raise ConfigurationError(self._why())

    def count(self, tenant, start_utc, end_utc):
        raise ConfigurationError(self._why())

    def identity(self) -> dict:
        raise ConfigurationError(self._why())

    def batches(self, tenant, start_utc, end_utc, *, schema=None, batch_rows=DEFAULT_BATCH_ROWS):
        raise ConfigurationError(self._why())


@dataclass(frozen=True)
class UnusableSource(_Unreadable):
    """The source of an export that this process cannot read, and why: its settings are missing or contradict each
    other here (a code server started without them, a run worker whose launcher config dropped one).

    The code location still loads, so the UI shows the export and its history; every use that needs the rows (a
    run's plan, the contract's identity, a drift check) raises :class:`ConfigurationError` with ``reason``, so that
    run fails naming the settings before anything is claimed. Nothing is read from elsewhere instead.

    Attributes:
        reason: What is wrong, naming the settings and never their values.
    """

    reason: str

    def _why(self) -> str:
        return self.reason


class ResolvableSource(_Unreadable):
    """A source declared by its settings, resolved where it is used: a run, a sensor tick, the CLI (the Dagster
    layer's :class:`~export_ledger.dagster.SourceResource` is one, its settings Dagster resource fields).

    Declared, it is not read: each use resolves it in the process that uses it (:meth:`resolve`), so what a run reads
    is what its own settings say, and a setting the process lacks fails that use alone. Read without resolving,
    it refuses (:class:`ConfigurationError`), as :class:`UnusableSource` does.
    """

    @abstractmethod
    def resolve(self, spec) -> ExportSource:
        """The source these settings give for the export ``spec`` (its tenants and calendars), in this process.

        Raises:
            ConfigurationError: a setting is missing or contradicts another, naming it, never its value.
        """

    def problem(self) -> str | None:
        """What is wrong with the settings as declared, known without reading any environment (None: nothing known):
        shown with the export before any run, as a run would fail for it."""
        return None

    def _why(self) -> str:
        return (
            f"{type(self).__name__} is a source's settings, resolved where it is used (a run, a sensor tick, the CLI): "
            "read the source it resolves to, not the settings"
        )


def readable(source: ExportSource | None) -> bool:
    """Whether a source can be read here: declared, not an :class:`UnusableSource`, and not settings still to
    resolve (:class:`ResolvableSource`)."""
    return source is not None and not isinstance(source, _Unreadable)


def bounds(start_utc: dt.datetime, end_utc: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """Checks a window's bounds: aware, in order; returned in UTC."""
    start = require_aware(start_utc, "start_utc")
    end = require_aware(end_utc, "end_utc")
    if end < start:
        raise ValueError(f"end_utc {end.isoformat()} is before start_utc {start.isoformat()}")
    return start, end


@dataclass(frozen=True)
class CallableSource(ExportSource):
    """Rows from a function ``fn(tenant, start_utc, end_utc) -> DataFrame`` (and an optional ``count`` function)."""

    fn: Callable[[str, dt.datetime, dt.datetime], pd.DataFrame]
    counter: Callable[[str, dt.datetime, dt.datetime], int] | None = None

    def rows(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        start, end = bounds(start_utc, end_utc)
        return self.fn(tenant, start, end)

    def batches(
        self,
        tenant: str,
        start_utc: dt.datetime,
        end_utc: dt.datetime,
        *,
        schema: ExportSchema | None = None,
        batch_rows: int = DEFAULT_BATCH_ROWS,
    ) -> Iterator[pd.DataFrame]:
        """The function's result: a DataFrame is one batch; an iterable of DataFrames (a generator that yields
        batches in file order) is streamed as it comes."""
        start, end = bounds(start_utc, end_utc)
        result = self.fn(tenant, start, end)
        if isinstance(result, pd.DataFrame):
            yield result
        else:
            yield from result

    def identity(self) -> dict:
        return {"kind": "callable", "name": qualified_name(self.fn)}

    def count(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> int | None:
        """The ``count`` function's answer; without one, the rows of the function's DataFrame, or None when it yields
        batches: counting them would read the stream a second time (a generator function is not even called)."""
        start, end = bounds(start_utc, end_utc)
        if self.counter is not None:
            return int(self.counter(tenant, start, end))
        if inspect.isgeneratorfunction(self.fn):
            return None
        result = self.fn(tenant, start, end)
        if isinstance(result, pd.DataFrame):
            return len(result)
        getattr(result, "close", lambda: None)()  # an iterator of batches, left unread
        return None


@dataclass(frozen=True)
class SqlSource(ExportSource):
    """Rows from a SQL query with the bound parameters ``:tenant``, ``:start`` and ``:end`` (UTC datetimes).

    The query must select the export's columns and filter ``time >= :start AND time < :end`` itself. Store event times
    in UTC: ``timestamptz`` on PostgreSQL; on SQLite, text as ``YYYY-MM-DD HH:MM:SS[.ffffff]`` (the bounds are bound
    in that form, so text comparison is time order). Timestamps returned without a zone are read as UTC.

    Example:
        >>> SqlSource("sqlite:///shop.db", "SELECT * FROM orders WHERE tenant = :tenant "
        ...           "AND placed_at >= :start AND placed_at < :end")  # doctest: +SKIP
    """

    url: str
    query: str

    def __post_init__(self) -> None:
        check_query(self.query)
        url_identity(self.url, what="SqlSource URL")  # an unusable URL (or a keyword DSN) fails where it is declared

    def identity(self) -> dict:
        return {"kind": "sql", "url": url_identity(self.url), "query_sha256": digest(self.query)}

    def _engine(self) -> sa.Engine:
        """An engine of its own per read (a source is read rarely; no pool outlives the read). A driver that is not
        installed is refused with the package to install (:func:`~export_ledger.ledger.urls.create_engine`)."""
        return create_engine(self.url, what="SqlSource URL", hide_parameters=True)  # errors never carry values

    def _run(self, statement, parameters: dict) -> list:
        engine = self._engine()
        try:
            with engine.connect() as conn:
                result = conn.execute(statement, parameters)
                # Plain tuples: pandas looks attributes up on SQLAlchemy's Row objects row by row, which made building
                # the frame several times slower than reading the rows (benchmarks/streaming.py's profile).
                return list(result.keys()), [tuple(row) for row in result]
        except sa.exc.SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None) or exc
            raise SourceError(
                f"cannot run the source query on {redact_url(self.url)!r}: {type(orig).__name__}"
            ) from None
        finally:
            engine.dispose()

    def _statement(self) -> sa.TextClause:
        return sa.text(self.query).bindparams(
            sa.bindparam("start", type_=_BoundUtc()), sa.bindparam("end", type_=_BoundUtc())
        )

    def rows(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        start, end = bounds(start_utc, end_utc)
        names, rows = self._run(self._statement(), {"tenant": tenant, "start": start, "end": end})
        return pd.DataFrame(rows, columns=names)

    def batches(
        self,
        tenant: str,
        start_utc: dt.datetime,
        end_utc: dt.datetime,
        *,
        schema: ExportSchema | None = None,
        batch_rows: int = DEFAULT_BATCH_ROWS,
    ) -> Iterator[pd.DataFrame]:
        """The query's rows streamed from the database in DataFrames of ``batch_rows`` rows (the last one shorter).

        The query runs on a server-side cursor, so neither the driver nor this process holds more than one batch: on
        PostgreSQL with psycopg2 a named cursor of the driver's own, read with ``fetchmany`` into plain tuples (going
        through SQLAlchemy's ``stream_results``/``yield_per`` rows cost a third of a streamed export's time in the
        profile of benchmarks/streaming.py); elsewhere SQLAlchemy's ``stream_results`` with ``yield_per``. For an
        export the query must return the rows in file order (``ORDER BY`` the time column, then the ids; on
        PostgreSQL with ``COLLATE "C"`` on text ids, so the database's order is Python's code point order), which the
        export checks batch by batch. With ``schema`` each batch's values are conformed to its kinds
        (:meth:`conform`). The connection stays open until the last batch is read or the iteration is abandoned.

        Raises:
            SourceError: the query failed (the message names the database, never a value).
        """
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
        start, end = bounds(start_utc, end_utc)
        parameters = {"tenant": tenant, "start": start, "end": end}
        engine = self._engine()
        driver_error = engine.dialect.loaded_dbapi.Error
        try:
            with engine.connect() as conn:
                if conn.dialect.driver == "psycopg2":
                    chunks = self._named_cursor_chunks(conn, parameters, batch_rows)
                else:
                    chunks = self._streamed_chunks(conn, parameters, batch_rows)
                for names, rows in chunks:
                    frame = pd.DataFrame(rows, columns=names)
                    del rows  # the driver's rows are the largest copy of a batch: free them before the next
                    if schema is not None:
                        frame = self.conform(frame, schema)
                    yield frame
                    del frame  # held while suspended otherwise, beside the next batch being fetched
        except (sa.exc.SQLAlchemyError, driver_error) as exc:
            orig = getattr(exc, "orig", None) or exc
            raise SourceError(
                f"cannot stream the source query on {redact_url(self.url)!r}: {type(orig).__name__}"
            ) from None
        finally:
            engine.dispose()

    def _streamed_chunks(self, conn, parameters: dict, batch_rows: int) -> Iterator[tuple[list[str], list[tuple]]]:
        result = conn.execution_options(stream_results=True, yield_per=batch_rows).execute(
            self._statement(), parameters
        )
        names = list(result.keys())
        for rows in result.partitions(batch_rows):
            yield names, [tuple(row) for row in rows]  # tuples: see _run

    def _named_cursor_chunks(self, conn, parameters: dict, batch_rows: int) -> Iterator[tuple[list[str], list[tuple]]]:
        """psycopg2's named cursor (``DECLARE ... CURSOR``), in the transaction SQLAlchemy's connection opened.

        The statement is compiled by SQLAlchemy for this dialect (its ``%`` escaped, the parameters named); the bounds
        need no conversion here: they are checked aware by :func:`bounds` and psycopg2 sends them as timestamptz.
        """
        compiled = self._statement().compile(dialect=conn.dialect)
        cursor = conn.connection.driver_connection.cursor(name=f"export_ledger_{uuid.uuid4().hex}")
        try:
            cursor.itersize = batch_rows
            cursor.execute(compiled.string, compiled.construct_params(parameters))
            while rows := cursor.fetchmany(batch_rows):
                yield [column[0] for column in cursor.description], rows
        finally:
            cursor.close()

    def conform(self, frame: pd.DataFrame, schema: ExportSchema) -> pd.DataFrame:
        """Database values as the schema's kinds: timestamps read as UTC, numbers as numbers (values that do not
        convert are left for validation to refuse)."""
        frame = frame.copy()
        for name, kind in schema.columns.items():
            if name not in frame.columns:
                continue
            column = frame[name]
            try:
                if kind == "timestamp" and not isinstance(column.dtype, pd.DatetimeTZDtype):
                    frame[name] = pd.to_datetime(column, utc=True, format="ISO8601").dt.as_unit("us")
                elif kind == "timestamp":
                    frame[name] = column.dt.tz_convert("UTC").dt.as_unit("us")
                elif kind == "float" and column.dtype == object:
                    frame[name] = pd.to_numeric(column)
                elif kind == "string" and len(column) == 0:
                    frame[name] = column.astype(object)
            except (TypeError, ValueError):
                continue
        return frame

    def count(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> int:
        start, end = bounds(start_utc, end_utc)
        counted = sa.select(sa.func.count()).select_from(self._statement().columns().subquery())
        _, rows = self._run(counted, {"tenant": tenant, "start": start, "end": end})
        return int(rows[0][0])


class _BoundUtc(sa.types.TypeDecorator):
    """A window bound for a source query: ``timestamptz`` on PostgreSQL; on SQLite, which has no time type, the text
    ``YYYY-MM-DD HH:MM:SS[.ffffff]`` in UTC (what ``datetime.isoformat(sep=" ")`` writes), so text comparisons hold."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect):
        return dialect.type_descriptor(sa.String() if dialect.name == "sqlite" else sa.DateTime(timezone=True))

    def process_bind_param(self, value, dialect):
        value = require_aware(value, "window bound")
        return value.replace(tzinfo=None).isoformat(sep=" ") if dialect.name == "sqlite" else value


def qualified_name(thing: object) -> str:
    """``module.QualName`` of a function, method, class or ``functools.partial`` (its function's name, and a digest
    of the arguments it binds when they are plain values: ``read(table="a")`` and ``read(table="b")`` read other
    data; an argument that is an object of its own is left out, as its text may change from run to run)."""
    bound = []
    while isinstance(thing, functools.partial):
        plain = [a for a in (*thing.args, *sorted(thing.keywords.items())) if _plain(a)]
        bound.append(repr(plain))
        thing = thing.func
    if not hasattr(thing, "__qualname__") and not isinstance(thing, type):
        thing = type(thing)  # a callable object: its class
    name = f"{getattr(thing, '__module__', '?')}.{getattr(thing, '__qualname__', type(thing).__qualname__)}"
    return f"{name}[{digest(''.join(bound))}]" if bound else name


def _plain(value: object) -> bool:
    if isinstance(value, (str, int, float, bool, type(None), dt.date)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def url_identity(url: str, *, what: str = "source URL") -> str:
    """A database URL as a source's identity: its database system (not the driver: another image with another
    driver reads the same data), host, port and database (a SQLite file's absolute path), without the user, password
    or query (none of which says *which* data is read, and some of which are secrets). A ``key=value`` connection
    string is refused, without echo: its password would be taken for a file name.

    Example:
        >>> url_identity("postgresql+psycopg2://app:secret@db.example:5432/prod?sslmode=require")
        'postgresql://db.example:5432/prod'
    """
    if is_plain_path(url) and re.search(r"(^|\s)\w+\s*=", url):
        raise ConfigurationError(
            f"the {what} looks like a key=value connection string, which is not a URL (it would be opened as a "
            "file of that name): write it as postgresql+psycopg2://user@host/database, with the password in PGPASSWORD"
        )
    parsed = database_url(url, what=what)
    database = parsed.database
    if parsed.get_backend_name() == "sqlite" and database and database != ":memory:":
        database = str(Path(database).expanduser().resolve())
    identity = URL.create(parsed.get_backend_name(), host=parsed.host, port=parsed.port, database=database)
    return identity.render_as_string(hide_password=True)


def as_source(source: ExportSource | Callable | None) -> ExportSource | None:
    """A declared source as an :class:`ExportSource` (a plain callable is wrapped)."""
    if source is None or isinstance(source, ExportSource):
        return source
    if callable(source):
        return CallableSource(source)
    raise TypeError(f"an export's source is an ExportSource, a callable or None, got {type(source).__name__}")
