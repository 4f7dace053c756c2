"""The export ledger: a thin facade over one class per concern.

:class:`ExportLedger` owns what every concern shares: the URL and its engine, the one clock (:meth:`now`), the one
transaction entry point (:meth:`atomic`), the lease length and what the schema supports. Each concern is a class of
its own that takes the facade and does one job:

* :attr:`ExportLedger.claims` — claims and holds (the only transitions that take a key);
* :attr:`ExportLedger.completions` — every finishing transition, through one path;
* :attr:`ExportLedger.queries` — reads of keys and attempts;
* :attr:`ExportLedger.attention` — stuck, failed and escalated keys, a bounded page at a time;
* :attr:`ExportLedger.restatements`, :attr:`ExportLedger.contracts`, :attr:`ExportLedger.retention`,
  :attr:`ExportLedger.drift`, :attr:`ExportLedger.operators` (the operator log);
* :attr:`ExportLedger.tallies` — aggregate counts for monitoring.

Plain Python on SQLAlchemy Core; nothing here knows about Dagster. One code path serves SQLite and PostgreSQL.
Every state change is one of the transitions declared in :mod:`export_ledger.ledger.transitions`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections.abc import Callable, Iterator

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.calendar import require_aware
from export_ledger.ledger.errors import LedgerError, LedgerUnavailable
from export_ledger.ledger.schema import RUN_COLUMNS, export_runs
from export_ledger.ledger.store import database_now, ledger_engine, redact_url, schema_version

UTC = dt.timezone.utc
DEFAULT_LEASE_TTL = dt.timedelta(minutes=15)
#: Claims a key may take before its reruns stop being automatic and it is escalated to a person.
DEFAULT_MAX_ATTEMPTS = 3


def utc_now() -> dt.datetime:
    """The host's clock, UTC. Not the ledger's clock: use :meth:`ExportLedger.now` for anything a lease depends on."""
    return dt.datetime.now(UTC)


class ExportLedger:
    """Records logical exports and their attempts.

    Args:
        url: Any SQLAlchemy URL; ``sqlite:///path`` or ``postgresql+psycopg2://user@host/db``.
        lease_ttl: How long a claim stays exclusive without a result.
        clock: A test's clock (returns a timezone-aware time). None, in production: the ledger's own clock (the
            PostgreSQL server's, or the host's for SQLite), read in each deciding transaction.
        allow_below_low_water: Let first claims below the retention low-water mark through (an operator's explicit
            override after pruning).
        read_only: Open to read only: nothing is created, upgraded or written.
        create: False for a ledger that must already exist (an operator's command): a database without one, or a
            SQLite path that names no file, is refused rather than made a new, empty ledger.

    Example:
        >>> ledger = ExportLedger("sqlite:///var/ledger.sqlite3")  # doctest: +SKIP
        >>> outcome = ledger.claims.claim(key, attempt_id="run-1/invoice_export")  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        lease_ttl: dt.timedelta = DEFAULT_LEASE_TTL,
        clock: Callable[[], dt.datetime] | None = None,
        allow_below_low_water: bool = False,
        read_only: bool = False,
        create: bool = True,
    ) -> None:
        if lease_ttl <= dt.timedelta(0):
            raise ValueError(f"lease_ttl must be positive, got {lease_ttl}")
        self.url = url
        self.lease_ttl = lease_ttl
        self.allow_below_low_water = allow_below_low_water
        self.read_only = read_only
        self._clock = clock
        self._engine = ledger_engine(url, read_only=read_only, create=create)

    # -- what every concern shares ---------------------------------------------------------------------------

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    def now(self, conn: Connection | None = None) -> dt.datetime:
        """The ledger's clock: the test's clock if one was given, else the database's time in ``conn``'s transaction
        (PostgreSQL's ``now()``; the host's clock on SQLite). Without ``conn``, read in a transaction of its own."""
        if self._clock is not None:
            return require_aware(self._clock(), "ledger clock").astimezone(UTC)
        if conn is not None:
            return database_now(conn)
        with self.atomic(read_only=True) as own:
            return database_now(own)

    def clock_in_database(self, conn: Connection) -> bool:
        """Whether :meth:`now` in ``conn``'s transaction is the database's ``now()`` (PostgreSQL, no test's clock): a
        statement that reads something else may then carry the clock along, saving its own round trip."""
        return self._clock is None and conn.dialect.name == "postgresql"

    @contextlib.contextmanager
    def atomic(self, *, read_only: bool = False) -> Iterator[Connection]:
        """The one transaction entry point. Everything inside commits together or not at all.

        Rolling back is always safe here: the ledger records decisions, and a decision that did not commit was
        never acted upon (destinations act only after a claim has committed, and record after they acted).
        """
        if self.read_only and not read_only:
            raise LedgerError(f"the ledger at {redact_url(self.url)!r} was opened for reading; it cannot be changed")
        try:
            options = dict(ledger_read_only=read_only)
            if read_only and self._engine.dialect.name == "postgresql":
                # A read of several statements sees one snapshot: counts and the rows listed under them agree.
                options["isolation_level"] = "REPEATABLE READ"
            with self._engine.connect().execution_options(**options) as connection:
                with connection.begin():
                    yield connection
        except sa.exc.OperationalError as exc:
            # The driver's words can quote a statement's values: its class only.
            raise LedgerUnavailable(
                f"ledger at {redact_url(self.url)!r} failed: {exc.orig.__class__.__name__} (the driver's message is "
                "withheld: it can quote statement values)"
            ) from exc

    @functools.cached_property
    def schema_version(self) -> int:
        """The schema version this ledger has (a writer's is always the newest: older ones are refused to write)."""
        if not self.read_only:
            from export_ledger.ledger.schema import SCHEMA_VERSION

            return SCHEMA_VERSION
        with self.atomic(read_only=True) as conn:
            return schema_version(conn)

    def supports(self, version: int) -> bool:
        """Whether the schema has what ``version`` added (a read of an older ledger does without it)."""
        return self.schema_version >= version

    @functools.cached_property
    def run_columns(self) -> tuple[sa.Column, ...]:
        """``export_runs``' columns every read selects: those of this ledger's schema version."""
        return (*RUN_COLUMNS, export_runs.c.claim_count) if self.supports(6) else RUN_COLUMNS

    # -- the concerns ----------------------------------------------------------------------------------------

    @functools.cached_property
    def claims(self):
        from export_ledger.ledger.claims import Claims

        return Claims(self)

    @functools.cached_property
    def completions(self):
        from export_ledger.ledger.completions import Completions

        return Completions(self)

    @functools.cached_property
    def queries(self):
        from export_ledger.ledger.queries import Queries

        return Queries(self)

    @functools.cached_property
    def attention(self):
        from export_ledger.ledger.attention import Attention

        return Attention(self)

    @functools.cached_property
    def operators(self):
        from export_ledger.ledger.operators import OperatorLog

        return OperatorLog(self)

    @functools.cached_property
    def restatements(self):
        from export_ledger.ledger.restatements import Restatements

        return Restatements(self)

    @functools.cached_property
    def contracts(self):
        from export_ledger.ledger.contracts import Contracts

        return Contracts(self)

    @functools.cached_property
    def retention(self):
        from export_ledger.ledger.retention import Retention

        return Retention(self)

    @functools.cached_property
    def drift(self):
        from export_ledger.ledger.drift import Drift

        return Drift(self)

    @functools.cached_property
    def tallies(self):
        from export_ledger.ledger.tallies import Tallies

        return Tallies(self)
