"""The export ledger: logical runs, their attempts, leases and fencing tokens.

Plain Python on SQLAlchemy Core; nothing here knows about Dagster. One code path serves SQLite and PostgreSQL.

Every state change is one guarded ``UPDATE ... WHERE state IN (...) AND fencing_token = ...`` inside one transaction;
when no row matches, the change is refused with a domain error and nothing is written except, where useful, an
attempt row saying why. Attempt rows are append-only: each attempt on a key gets exactly one row, written when its
outcome is known (or, for a crashed attempt, when a later attempt takes over its expired lease), and never changed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url

from assets.keys import LogicalKey
from assets.windows import ExportWindow, require_aware, tz_database_version
from resources.schema import (
    AttemptOutcome,
    ExportState,
    export_attempts,
    export_contracts,
    export_low_water,
    export_runs,
    metadata,
)

UTC = dt.timezone.utc
DEFAULT_LEASE_TTL = dt.timedelta(minutes=15)
_MESSAGE_LIMIT = 500


def utc_now() -> dt.datetime:
    return dt.datetime.now(UTC)


class LedgerError(Exception):
    """Base class of the ledger's domain errors."""


class LedgerUnavailable(LedgerError):
    """The ledger database cannot be reached or opened."""


class LeaseHeld(LedgerError):
    """Another attempt holds a live lease on the key."""


class NeedsReconciliation(LedgerError):
    """The key's last write has an unknown outcome; retrying blindly could export it twice."""


class FencedOut(LedgerError):
    """The attempt lost its lease (expired and taken over); it must not commit."""


class InvalidTransition(LedgerError):
    """A transition was asked from a state that does not allow it."""


class ConflictRecorded(LedgerError):
    """The destination holds a different export at the key's place; an operator must resolve it."""


class BelowLowWater(LedgerError):
    """The key's business date is below the export's retention low-water mark: its record may have been pruned."""


class ContractChanged(LedgerError):
    """The code's calendar contract differs from the one the ledger recorded for the export."""


class EmptyWindow(LedgerError):
    """The business date does not exist in its zone (a skipped calendar day): there is nothing to export.

    Its empty window starts where the next day's starts, so it cannot have a logical key of its own.
    """


@dataclass(frozen=True)
class ExportRecord:
    """One row of ``export_runs``."""

    logical_key: str
    export: str
    tenant: str
    business_date: dt.date
    timezone: str
    window_start_utc: dt.datetime
    window_end_utc: dt.datetime
    tz_database: str
    state: ExportState
    location: str | None
    sha256: str | None
    row_count: int | None
    committed_attempt: str | None
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    attempt_started_at: dt.datetime | None
    fencing_token: int
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def from_row(cls, row: sa.Row) -> ExportRecord:
        values = dict(row._mapping)
        values["state"] = ExportState(values["state"])
        return cls(**values)

    @property
    def window(self) -> ExportWindow:
        return ExportWindow(self.business_date, self.timezone, self.window_start_utc, self.window_end_utc)


@dataclass(frozen=True)
class AttemptRecord:
    """One row of ``export_attempts``."""

    id: int
    attempt_id: str
    logical_key: str
    fencing_token: int | None
    started_at: dt.datetime
    finished_at: dt.datetime
    outcome: AttemptOutcome
    error_class: str | None
    error_message: str | None

    @classmethod
    def from_row(cls, row: sa.Row) -> AttemptRecord:
        values = dict(row._mapping)
        values["outcome"] = AttemptOutcome(values["outcome"])
        return cls(**values)


@dataclass(frozen=True)
class Claim:
    """A live lease on one logical key, proved by its fencing token.

    ``window`` is the window recorded at the key's first claim: retries export that window, whatever the calendar
    computes today.
    """

    logical_key: str
    attempt_id: str
    fencing_token: int
    window: ExportWindow
    started_at: dt.datetime
    lease_expires_at: dt.datetime
    previous_state: ExportState | None
    tz_database: str


@dataclass(frozen=True)
class AlreadyCompleted:
    """The key was completed before this attempt: nothing to do."""

    record: ExportRecord


@dataclass(frozen=True)
class DaySummary:
    """How the keys of one business day stand over a set of tenants, counted by the database in one grouped read."""

    business_date: dt.date
    keys: int  # tenants with a row that day
    completed: int
    waiting: int  # keys in one of the states asked about
    tokens: int  # sum of the keys' fencing tokens: grows with every claim on any of them


@dataclass(frozen=True)
class Resolution:
    """Reconciliation's verdict on one stuck key, to be applied by :meth:`ExportLedger.resolve_many`."""

    record: ExportRecord
    state: ExportState
    detail: str
    evidence: CompletionEvidence | None = None


@dataclass(frozen=True)
class CompletionEvidence:
    """What a destination says it holds for a key: enough to record completion."""

    location: str
    sha256: str
    row_count: int
    attempt_id: str
    fencing_token: int


_RESOLUTION_OUTCOMES = {
    ExportState.COMPLETED: AttemptOutcome.REPAIRED,
    ExportState.FAILED: AttemptOutcome.FAILED,
    ExportState.CONFLICT: AttemptOutcome.CONFLICT,
}


def short_error(exc: BaseException) -> tuple[str, str]:
    """Error class and a bounded message for the attempts table."""
    message = str(exc) or exc.__class__.__name__
    if len(message) > _MESSAGE_LIMIT:
        message = message[: _MESSAGE_LIMIT - 3] + "..."
    return exc.__class__.__name__, message


def redact_url(url: str) -> str:
    """The URL with any password replaced, for error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL is reported by its scheme only
        return url.split(":", 1)[0] + ":..."


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


# Statements built once, executed with parameters: building a Core statement and its cache key on every call cost
# more than executing it (benchmarks/RESULTS.md, ledger throughput).
_RUN_BY_KEY = sa.select(export_runs).where(export_runs.c.logical_key == sa.bindparam("k_key"))
_RUN_BY_DAY = sa.select(export_runs).where(
    export_runs.c.export == sa.bindparam("k_export"),
    export_runs.c.tenant == sa.bindparam("k_tenant"),
    export_runs.c.timezone == sa.bindparam("k_timezone"),
    export_runs.c.business_date == sa.bindparam("k_business_date"),
)
_RUN_BY_DAY_LOCKED = _RUN_BY_DAY.with_for_update()
_INSERT_RUN = export_runs.insert()
_INSERT_ATTEMPT = export_attempts.insert()


def _guarded_update_statement(with_owner: bool) -> sa.Update:
    """``UPDATE export_runs SET <the parameters named like columns> WHERE key, state, token (and owner) match``."""
    conditions = [
        export_runs.c.logical_key == sa.bindparam("g_key"),
        export_runs.c.state.in_(sa.bindparam("g_states", expanding=True)),
        export_runs.c.fencing_token == sa.bindparam("g_token"),
    ]
    if with_owner:
        conditions.append(export_runs.c.lease_owner == sa.bindparam("g_owner"))
    return export_runs.update().where(*conditions)


_GUARDED_UPDATE = {False: _guarded_update_statement(False), True: _guarded_update_statement(True)}


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


def ledger_engine(url: str) -> Engine:
    """One engine per URL per process, with the schema created on first use."""
    with _engines_lock:
        engine = _engines.get(url)
        if engine is not None:
            return engine
        try:
            parsed = make_url(url)
        except Exception as exc:
            raise LedgerUnavailable(f"invalid ledger URL {redact_url(url)!r}: {exc}") from None
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
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
            raise LedgerUnavailable(f"cannot open ledger {redact_url(url)!r}: {exc}") from None
        if engine.dialect.name == "sqlite":
            _configure_sqlite(engine)
        _create_schema(engine, url)
        _engines[url] = engine
        return engine


def _create_schema(engine: Engine, url: str) -> None:
    for attempt in range(3):
        try:
            metadata.create_all(engine)
            return
        except sa.exc.OperationalError as exc:
            raise LedgerUnavailable(
                f"cannot reach the ledger at {redact_url(url)!r}: {exc.orig.__class__.__name__}: "
                f"{str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else ''}"
            ) from None
        except (sa.exc.IntegrityError, sa.exc.ProgrammingError):
            # Another process created the same tables between our check and our CREATE; look again.
            if attempt == 2:
                raise


def dispose_engines() -> None:
    """Closes every pooled connection (tests, CLI exit)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


class ExportLedger:
    """Records logical exports and their attempts.

    Args:
        url: Any SQLAlchemy URL; ``sqlite:///path`` or ``postgresql+psycopg2://user@host/db``.
        lease_ttl: How long a claim stays exclusive without a result.
        clock: Returns the current time, timezone-aware; tests pass a controllable one.
        allow_below_low_water: Let first claims below the retention low-water mark through (an operator's explicit
            override after pruning; see :meth:`prune`).

    Example:
        >>> ledger = ExportLedger("sqlite:///var/ledger.sqlite3")  # doctest: +SKIP
        >>> outcome = ledger.claim(key, attempt_id="run-1/invoice_export")  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        lease_ttl: dt.timedelta = DEFAULT_LEASE_TTL,
        clock: Callable[[], dt.datetime] = utc_now,
        allow_below_low_water: bool = False,
    ) -> None:
        if lease_ttl <= dt.timedelta(0):
            raise ValueError(f"lease_ttl must be positive, got {lease_ttl}")
        self.url = url
        self.lease_ttl = lease_ttl
        self.allow_below_low_water = allow_below_low_water
        self._clock = clock
        self._engine = ledger_engine(url)

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    def now(self) -> dt.datetime:
        return require_aware(self._clock(), "ledger clock")

    @contextlib.contextmanager
    def atomic(self, *, read_only: bool = False) -> Iterator[Connection]:
        """The one transaction entry point. Everything inside commits together or not at all.

        Rolling back is always safe here: the ledger records decisions, and a decision that did not commit was
        never acted upon (destinations act only after ``claim`` has committed, and record after they acted).
        """
        try:
            with self._engine.connect().execution_options(ledger_read_only=read_only) as connection:
                with connection.begin():
                    yield connection
        except sa.exc.OperationalError as exc:
            raise LedgerUnavailable(
                f"ledger at {redact_url(self.url)!r} failed: {exc.orig.__class__.__name__}: {str(exc.orig).strip()}"
            ) from exc

    # -- reads -------------------------------------------------------------------------------------------------

    def get(self, logical_key: str) -> ExportRecord | None:
        with self.atomic(read_only=True) as conn:
            row = conn.execute(_RUN_BY_KEY, {"k_key": logical_key}).first()
        return ExportRecord.from_row(row) if row else None

    def find(self, key: LogicalKey) -> ExportRecord | None:
        """The record for the key's business day, whatever window start it was first claimed with."""
        with self.atomic(read_only=True) as conn:
            row = self._find(conn, key, lock=False)
        return ExportRecord.from_row(row) if row else None

    def records(
        self,
        *,
        export: str | None = None,
        tenant: str | None = None,
        date_from: dt.date | None = None,
        date_to: dt.date | None = None,
        states: Sequence[ExportState] = (),
        limit: int | None = None,
        tenants: Sequence[str] = (),
        business_dates: Sequence[dt.date] = (),
        timezone: str | None = None,
    ) -> list[ExportRecord]:
        query = sa.select(export_runs)
        if export is not None:
            query = query.where(export_runs.c.export == export)
        if tenant is not None:
            query = query.where(export_runs.c.tenant == tenant)
        if tenants:
            query = query.where(export_runs.c.tenant.in_(list(tenants)))
        if business_dates:
            query = query.where(export_runs.c.business_date.in_(list(business_dates)))
        if timezone is not None:
            query = query.where(export_runs.c.timezone == timezone)
        if date_from is not None:
            query = query.where(export_runs.c.business_date >= date_from)
        if date_to is not None:
            query = query.where(export_runs.c.business_date <= date_to)
        if states:
            query = query.where(export_runs.c.state.in_([s.value for s in states]))
        query = query.order_by(export_runs.c.export, export_runs.c.business_date, export_runs.c.tenant)
        if limit is not None:
            query = query.limit(limit)
        with self.atomic(read_only=True) as conn:
            return [ExportRecord.from_row(row) for row in conn.execute(query)]

    def day_summaries(
        self,
        *,
        export: str,
        timezone: str,
        days: Sequence[dt.date],
        tenants: Sequence[str],
        waiting: Sequence[ExportState],
    ) -> dict[dt.date, DaySummary]:
        """Per business day, how ``tenants``' keys stand: counted in the database, so a tick that looks at a hundred
        days of a thousand tenants reads a hundred rows, not a hundred thousand. Days with no key are absent."""
        if not days or not tenants:
            return {}
        state = export_runs.c.state
        query = (
            sa.select(
                export_runs.c.business_date,
                sa.func.count().label("keys"),
                sa.func.sum(sa.case((state == ExportState.COMPLETED.value, 1), else_=0)).label("completed"),
                sa.func.sum(sa.case((state.in_([s.value for s in waiting]), 1), else_=0)).label("waiting"),
                sa.func.sum(export_runs.c.fencing_token).label("tokens"),
            )
            .where(
                export_runs.c.export == export,
                export_runs.c.timezone == timezone,
                export_runs.c.business_date.in_(list(days)),
                export_runs.c.tenant.in_(list(tenants)),
            )
            .group_by(export_runs.c.business_date)
        )
        with self.atomic(read_only=True) as conn:
            return {
                row.business_date: DaySummary(
                    row.business_date, int(row.keys), int(row.completed), int(row.waiting), int(row.tokens)
                )
                for row in conn.execute(query)
            }

    def attempts(self, logical_key: str) -> list[AttemptRecord]:
        query = (
            sa.select(export_attempts)
            .where(export_attempts.c.logical_key == logical_key)
            .order_by(export_attempts.c.id)
        )
        with self.atomic(read_only=True) as conn:
            return [AttemptRecord.from_row(row) for row in conn.execute(query)]

    def all_attempts(self) -> list[AttemptRecord]:
        with self.atomic(read_only=True) as conn:
            rows = conn.execute(sa.select(export_attempts).order_by(export_attempts.c.id))
            return [AttemptRecord.from_row(row) for row in rows]

    # -- transitions -------------------------------------------------------------------------------------------

    def claim(self, key: LogicalKey, attempt_id: str) -> Claim | AlreadyCompleted:
        """Takes the lease on ``key`` for ``attempt_id`` and increments its fencing token.

        Returns :class:`AlreadyCompleted` (and records that attempt) when the key is done.

        Raises:
            LeaseHeld: another attempt holds a live lease; the message names it.
            NeedsReconciliation: the key is ``remote_unknown``.
        """
        if key.window.is_empty:
            raise EmptyWindow(
                f"{key.window.business_date} does not exist in {key.window.timezone} (the zone skipped that calendar "
                f"day): its window is empty and {key.export} for {key.tenant} has nothing to export"
            )
        for _ in range(5):
            try:
                return self._claim_once(key, attempt_id)
            except sa.exc.IntegrityError as exc:
                if self.find(key) is not None:
                    continue  # two first claims inserted the same key at once; the loser now finds the winner's row
                holder = self.get(str(key))
                if holder is not None:
                    raise LedgerError(
                        f"logical key {key} already belongs to {holder.export}/{holder.tenant} on "
                        f"{holder.business_date} ({holder.timezone}); "
                        f"refusing to claim it for {key.window.business_date}"
                    ) from None
                raise LedgerError(f"could not record a claim on {key}: {exc.orig}") from None
        raise LedgerError(f"could not claim {key}: the row kept changing under concurrent claims")

    def _claim_once(self, key: LogicalKey, attempt_id: str) -> Claim | AlreadyCompleted:
        now = self.now()
        expires = now + self.lease_ttl
        refusal: LedgerError | None = None
        with self.atomic() as conn:
            row = self._find(conn, key, lock=True)
            if row is None:
                mark = self._low_water(conn, key.export)
                if mark is not None and key.window.business_date < mark and not self.allow_below_low_water:
                    raise BelowLowWater(
                        f"{key} is below the retention low-water mark of {key.export} ({mark.isoformat()}): its "
                        "completion record may have been pruned, so exporting it again could duplicate an export. "
                        "Refused; an operator who knows it was never exported can allow it explicitly "
                        "(EXPORTS_ALLOW_BELOW_LOW_WATER=1 for that run)"
                    )
                tz_database = tz_database_version(key.window.timezone)
                conn.execute(
                    _INSERT_RUN,
                    dict(
                        logical_key=str(key),
                        export=key.export,
                        tenant=key.tenant,
                        business_date=key.window.business_date,
                        timezone=key.window.timezone,
                        window_start_utc=key.window.start_utc,
                        window_end_utc=key.window.end_utc,
                        tz_database=tz_database,
                        state=ExportState.IN_PROGRESS.value,
                        lease_owner=attempt_id,
                        lease_expires_at=expires,
                        attempt_started_at=now,
                        fencing_token=1,
                        created_at=now,
                        updated_at=now,
                    ),
                )
                return Claim(str(key), attempt_id, 1, key.window, now, expires, None, tz_database)

            record = ExportRecord.from_row(row)
            if record.state is ExportState.COMPLETED:
                self._append_attempt(conn, record.logical_key, attempt_id, None, now, AttemptOutcome.ALREADY_COMPLETED)
                return AlreadyCompleted(record)
            if record.state is ExportState.CONFLICT:
                refusal = ConflictRecorded(
                    f"{record.logical_key} is in conflict: the destination holds a different export at "
                    f"{record.location or 'its place'}; refusing to overwrite it until an operator resolves it"
                )
            elif record.state is ExportState.REMOTE_UNKNOWN:
                refusal = NeedsReconciliation(
                    f"{record.logical_key} has an unknown outcome at the destination (attempt {record.lease_owner}); "
                    "retrying could export it twice, so it is refused until reconciliation resolves it"
                )
            elif record.state is ExportState.IN_PROGRESS and record.lease_expires_at > now:
                refusal = LeaseHeld(
                    f"{record.logical_key} is being exported by attempt {record.lease_owner} "
                    f"(lease held until {record.lease_expires_at.isoformat()})"
                )
            if refusal is not None:
                error_class, message = short_error(refusal)
                self._append_attempt(
                    conn, record.logical_key, attempt_id, None, now, AttemptOutcome.REFUSED, error_class, message
                )
            else:
                if record.state is ExportState.IN_PROGRESS:
                    # The holder's lease ran out without a result: record its attempt before taking over.
                    self._append_abandoned(conn, record, now)
                token = record.fencing_token + 1
                self._guarded_update(
                    conn,
                    record.logical_key,
                    from_states=(ExportState.FAILED, ExportState.IN_PROGRESS),
                    token=record.fencing_token,
                    values=dict(
                        state=ExportState.IN_PROGRESS.value,
                        lease_owner=attempt_id,
                        lease_expires_at=expires,
                        attempt_started_at=now,
                        fencing_token=token,
                        updated_at=now,
                        # What an earlier attempt meant to write is not this attempt's: judge it by its own export.
                        sha256=None,
                        location=None,
                    ),
                )
                return Claim(
                    record.logical_key, attempt_id, token, record.window, now, expires, record.state, record.tz_database
                )
        raise refusal

    def complete(self, claim: Claim, evidence: CompletionEvidence) -> ExportRecord:
        """Records the key as completed from the destination's evidence.

        ``evidence.attempt_id`` other than the claim's means an earlier attempt published and crashed before
        recording: the row points at that attempt's export and this attempt is recorded as ``repaired``.
        """
        outcome = AttemptOutcome.COMPLETED if evidence.attempt_id == claim.attempt_id else AttemptOutcome.REPAIRED
        return self._finish(
            claim,
            ExportState.COMPLETED,
            outcome,
            values=dict(
                location=evidence.location,
                sha256=evidence.sha256,
                row_count=evidence.row_count,
                committed_attempt=evidence.attempt_id,
            ),
        )

    def mark_conflict(self, claim: Claim, error: BaseException, *, location: str | None = None) -> ExportRecord:
        """Records that the destination holds something else at this key's place: refused until an operator acts."""
        return self._finish(
            claim, ExportState.CONFLICT, AttemptOutcome.CONFLICT, error=error, values=dict(location=location)
        )

    def fail(self, claim: Claim, error: BaseException) -> ExportRecord:
        """Records that the attempt failed before publishing anything: the key is safe to retry."""
        return self._finish(claim, ExportState.FAILED, AttemptOutcome.FAILED, error=error)

    def mark_remote_unknown(
        self, claim: Claim, error: BaseException, *, sha256: str | None = None, location: str | None = None
    ) -> ExportRecord:
        """Records that the destination may or may not hold the export: no retry until reconciled.

        ``sha256`` and ``location`` describe what the attempt tried to write; reconciliation compares the
        destination's evidence with them.
        """
        return self._finish(
            claim,
            ExportState.REMOTE_UNKNOWN,
            AttemptOutcome.REMOTE_UNKNOWN,
            error=error,
            values=dict(sha256=sha256, location=location),
        )

    # -- retention ---------------------------------------------------------------------------------------------

    def low_water(self, export: str) -> dt.date | None:
        with self.atomic(read_only=True) as conn:
            return self._low_water(conn, export)

    def _low_water(self, conn: Connection, export: str) -> dt.date | None:
        return conn.execute(
            sa.select(export_low_water.c.low_water_date).where(export_low_water.c.export == export)
        ).scalar()

    def prune(self, older_than_days: int, *, export: str | None = None) -> dict[str, int]:
        """Deletes ``completed`` records (and their attempts) whose business date is more than ``older_than_days``
        days before today (UTC), and raises each export's durable low-water mark to that horizon.

        Other states are never pruned: a failed or stuck key keeps its history until it is resolved. After pruning,
        first claims below the mark are refused (see ``allow_below_low_water``). Returns rows deleted per export.
        """
        if older_than_days < 0:
            raise ValueError(f"older_than_days must be zero or more, got {older_than_days}")
        now = self.now()
        horizon = now.date() - dt.timedelta(days=older_than_days)
        deleted: dict[str, int] = {}
        with self.atomic() as conn:
            exports_query = sa.select(export_runs.c.export).distinct()
            if export is not None:
                exports_query = exports_query.where(export_runs.c.export == export)
            names = sorted(set(conn.execute(exports_query).scalars()) | ({export} if export else set()))
            for name in names:
                doomed = sa.select(export_runs.c.logical_key).where(
                    export_runs.c.export == name,
                    export_runs.c.state == ExportState.COMPLETED.value,
                    export_runs.c.business_date < horizon,
                )
                conn.execute(export_attempts.delete().where(export_attempts.c.logical_key.in_(doomed)))
                count = conn.execute(
                    export_runs.delete().where(
                        export_runs.c.export == name,
                        export_runs.c.state == ExportState.COMPLETED.value,
                        export_runs.c.business_date < horizon,
                    )
                ).rowcount
                deleted[name] = count
                mark = self._low_water(conn, name)
                if mark is None:
                    conn.execute(
                        export_low_water.insert().values(
                            export=name, low_water_date=horizon, pruned_total=count, updated_at=now
                        )
                    )
                else:
                    conn.execute(
                        export_low_water.update()
                        .where(export_low_water.c.export == name)
                        .values(
                            low_water_date=max(mark, horizon),
                            pruned_total=export_low_water.c.pruned_total + count,
                            updated_at=now,
                        )
                    )
        return deleted

    # -- calendar contract -------------------------------------------------------------------------------------

    def recorded_contract(self, export: str) -> dict | None:
        with self.atomic(read_only=True) as conn:
            text = self._latest_contract(conn, export)
        return None if text is None else json.loads(text)

    def _latest_contract(self, conn: Connection, export: str) -> str | None:
        return conn.execute(
            sa.select(export_contracts.c.contract)
            .where(export_contracts.c.export == export)
            .order_by(export_contracts.c.id.desc())
            .limit(1)
        ).scalar()

    def check_contract(self, export: str, contract: dict) -> None:
        """Records the contract at an export's first materialization; afterwards refuses any other one.

        Raises:
            ContractChanged: naming the recorded and the new contract, until an operator accepts the new one.
        """
        wanted = json.dumps(contract, sort_keys=True)
        with self.atomic() as conn:
            recorded = self._latest_contract(conn, export)
            if recorded is None:
                conn.execute(
                    export_contracts.insert().values(
                        export=export, contract=wanted, recorded_at=self.now(), reason="first materialization"
                    )
                )
                return
        if recorded != wanted:
            raise ContractChanged(
                f"the calendar contract of {export} changed: the ledger recorded {recorded}, the code now says "
                f"{wanted}. Changing the zone or start date is a business change: every materialization is refused "
                f'until an operator runs: export-ledger accept-contract --export {export} --reason "..."'
            )

    def accept_contract(self, export: str, contract: dict, reason: str) -> None:
        """Records ``contract`` as the one in force for ``export``, with the operator's reason."""
        if not reason or not reason.strip():
            raise ValueError("accepting a contract change needs a reason")
        with self.atomic() as conn:
            conn.execute(
                export_contracts.insert().values(
                    export=export,
                    contract=json.dumps(contract, sort_keys=True),
                    recorded_at=self.now(),
                    reason=reason.strip()[:_MESSAGE_LIMIT],
                )
            )

    def contract_history(self, export: str) -> list[dict]:
        query = sa.select(export_contracts).where(export_contracts.c.export == export).order_by(export_contracts.c.id)
        with self.atomic(read_only=True) as conn:
            return [
                {"contract": json.loads(r.contract), "recorded_at": r.recorded_at, "reason": r.reason}
                for r in conn.execute(query)
            ]

    # -- reconciliation ----------------------------------------------------------------------------------------

    def committed_by(self, attempt: str) -> list[ExportRecord]:
        """Keys an attempt completed (its other keys, when one of them is being reconciled)."""
        query = sa.select(export_runs).where(export_runs.c.committed_attempt == attempt)
        with self.atomic(read_only=True) as conn:
            return [ExportRecord.from_row(r) for r in conn.execute(query.order_by(export_runs.c.logical_key))]

    def stuck(self, *, limit: int, after: str | None = None) -> list[ExportRecord]:
        """Keys that need reconciling, in key order after ``after``: ``remote_unknown``, and ``in_progress`` whose
        lease has expired (a crashed or stalled attempt). Each of the two reads walks an index on state."""
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        now = self.now()
        unknown = sa.select(export_runs).where(export_runs.c.state == ExportState.REMOTE_UNKNOWN.value)
        expired = sa.select(export_runs).where(
            export_runs.c.state == ExportState.IN_PROGRESS.value, export_runs.c.lease_expires_at < now
        )
        rows = []
        with self.atomic(read_only=True) as conn:
            for query in (unknown, expired):
                if after is not None:
                    query = query.where(export_runs.c.logical_key > after)
                rows.extend(conn.execute(query.order_by(export_runs.c.logical_key).limit(limit)))
        records = sorted((ExportRecord.from_row(r) for r in rows), key=lambda r: r.logical_key)
        return records[:limit]

    def stuck_longer_than(self, age: dt.timedelta) -> list[ExportRecord]:
        """Keys unresolved for longer than ``age``: ``remote_unknown``, ``conflict`` and expired ``in_progress``."""
        now = self.now()
        horizon = now - age
        query = sa.select(export_runs).where(
            export_runs.c.updated_at < horizon,
            sa.or_(
                export_runs.c.state.in_([ExportState.REMOTE_UNKNOWN.value, ExportState.CONFLICT.value]),
                sa.and_(export_runs.c.state == ExportState.IN_PROGRESS.value, export_runs.c.lease_expires_at < now),
            ),
        )
        with self.atomic(read_only=True) as conn:
            return [ExportRecord.from_row(r) for r in conn.execute(query.order_by(export_runs.c.logical_key))]

    def resolve(
        self,
        record: ExportRecord,
        state: ExportState,
        *,
        reconciler: str,
        detail: str,
        evidence: CompletionEvidence | None = None,
    ) -> ExportRecord | None:
        """Moves a stuck key to ``completed`` (with evidence), ``failed`` or ``conflict`` from reconciliation.

        Guarded by the state and fencing token that were read: if an attempt changed the key meanwhile, nothing is
        written and None is returned. Appends the reconciler's attempt row (and, for an expired lease, the dead
        holder's ``abandoned`` row).
        """
        (updated,) = self.resolve_many([Resolution(record, state, detail, evidence)], reconciler=reconciler)
        return updated

    def resolve_many(self, resolutions: Sequence[Resolution], *, reconciler: str) -> list[ExportRecord | None]:
        """:meth:`resolve` for a batch of keys in one transaction: one durable commit per reconciliation tick.

        Each key keeps its own guard; a key an attempt changed meanwhile gets None and the others still commit.
        Rolling the whole batch back on an error is safe: each verdict comes from the destination's evidence and is
        found again by the next tick.
        """
        for item in resolutions:
            self._check_resolution(item)
        if not resolutions:
            return []
        now = self.now()
        attempts: list[dict] = []
        with self.atomic() as conn:
            updated = [self._resolve_in(conn, item, reconciler, now, attempts) for item in resolutions]
            if attempts:
                conn.execute(_INSERT_ATTEMPT, attempts)  # one executemany for the batch's attempt rows, in order
        return updated

    @staticmethod
    def _check_resolution(item: Resolution) -> None:
        record, state = item.record, item.state
        if state not in _RESOLUTION_OUTCOMES:
            raise InvalidTransition(f"reconciliation cannot move {record.logical_key} to {state.value}")
        if state is ExportState.COMPLETED and item.evidence is None:
            raise InvalidTransition(f"completing {record.logical_key} needs the destination's evidence")
        if record.state not in (ExportState.REMOTE_UNKNOWN, ExportState.IN_PROGRESS):
            raise InvalidTransition(f"{record.logical_key} is {record.state.value}, not stuck")

    def _resolve_in(
        self, conn: Connection, item: Resolution, reconciler: str, now: dt.datetime, attempts: list[dict]
    ) -> ExportRecord | None:
        """Applies one guarded transition; appends its attempt rows to ``attempts`` for the caller to insert."""
        record, state, evidence = item.record, item.state, item.evidence
        values: dict = dict(state=state.value, lease_owner=None, lease_expires_at=None, updated_at=now)
        if evidence is not None:
            values.update(
                location=evidence.location,
                sha256=evidence.sha256,
                row_count=evidence.row_count,
                committed_attempt=evidence.attempt_id,
            )
        conditions = [
            export_runs.c.logical_key == record.logical_key,
            export_runs.c.state == record.state.value,
            export_runs.c.fencing_token == record.fencing_token,
        ]
        if record.state is ExportState.IN_PROGRESS:
            conditions.append(export_runs.c.lease_expires_at < now)  # never take a key from a live lease
        statement = export_runs.update().where(*conditions).values(**values).returning(*export_runs.c)
        row = conn.execute(statement).first()  # the row as updated, or None when the guard did not match
        if row is None:
            return None
        if record.state is ExportState.IN_PROGRESS:
            attempts.append(self._abandoned_values(record, now))
        attempts.append(
            self._attempt_values(
                record.logical_key,
                reconciler,
                record.fencing_token,
                now,
                _RESOLUTION_OUTCOMES[state],
                "Reconciliation",
                item.detail,
            )
        )
        return ExportRecord.from_row(row)

    def _finish(
        self,
        claim: Claim,
        state: ExportState,
        outcome: AttemptOutcome,
        *,
        values: dict | None = None,
        error: BaseException | None = None,
    ) -> ExportRecord:
        now = self.now()
        error_class, message = short_error(error) if error is not None else (None, None)
        with self.atomic() as conn:
            matched = self._guarded_update(
                conn,
                claim.logical_key,
                from_states=(ExportState.IN_PROGRESS,),
                token=claim.fencing_token,
                owner=claim.attempt_id,
                values=dict(
                    state=state.value,
                    # remote_unknown keeps the attempt whose write is in doubt: reconciliation looks for its evidence.
                    lease_owner=claim.attempt_id if state is ExportState.REMOTE_UNKNOWN else None,
                    lease_expires_at=None,
                    updated_at=now,
                    **(values or {}),
                ),
                required=False,
            )
            if matched:
                self._append_attempt(
                    conn,
                    claim.logical_key,
                    claim.attempt_id,
                    claim.fencing_token,
                    now,
                    outcome,
                    error_class,
                    message,
                    started_at=claim.started_at,
                )
                row = conn.execute(_RUN_BY_KEY, {"k_key": claim.logical_key}).one()
                return ExportRecord.from_row(row)
            fenced = self._record_fenced(conn, claim, now)
        raise fenced  # after the commit: the fenced attempt's row must survive

    def complete_within(self, claim: Claim, effect: Callable[[Connection], CompletionEvidence]) -> ExportRecord:
        """Runs ``effect`` (a transactional destination's write, on the ledger's connection) and records completion
        in the same transaction: the rows and the completion record commit together or not at all.

        The key is locked and the claim's fencing token checked before ``effect`` runs, so a fenced attempt writes
        nothing. Any exception from ``effect`` rolls both back.
        """
        now = self.now()
        with self.atomic() as conn:
            current = conn.execute(
                sa.select(export_runs).where(export_runs.c.logical_key == claim.logical_key).with_for_update()
            ).first()
            live = (
                current is not None
                and current.state == ExportState.IN_PROGRESS.value
                and current.fencing_token == claim.fencing_token
                and current.lease_owner == claim.attempt_id
            )
            if live:
                evidence = effect(conn)
                self._guarded_update(
                    conn,
                    claim.logical_key,
                    from_states=(ExportState.IN_PROGRESS,),
                    token=claim.fencing_token,
                    owner=claim.attempt_id,
                    values=dict(
                        state=ExportState.COMPLETED.value,
                        lease_owner=None,
                        lease_expires_at=None,
                        updated_at=now,
                        location=evidence.location,
                        sha256=evidence.sha256,
                        row_count=evidence.row_count,
                        committed_attempt=evidence.attempt_id,
                    ),
                )
                self._append_attempt(
                    conn,
                    claim.logical_key,
                    claim.attempt_id,
                    claim.fencing_token,
                    now,
                    AttemptOutcome.COMPLETED,
                    started_at=claim.started_at,
                )
                row = conn.execute(_RUN_BY_KEY, {"k_key": claim.logical_key}).one()
                return ExportRecord.from_row(row)
            fenced = self._record_fenced(conn, claim, now)
        raise fenced

    def _record_fenced(self, conn: Connection, claim: Claim, now: dt.datetime) -> FencedOut:
        """Appends the ``fenced`` attempt row and returns the error to raise (after the transaction commits)."""
        current = conn.execute(_RUN_BY_KEY, {"k_key": claim.logical_key}).first()
        holder = "nobody"
        if current is not None:
            holder = f"{current.lease_owner or 'nobody'} (state {current.state}, token {current.fencing_token})"
        fenced = FencedOut(
            f"attempt {claim.attempt_id} lost its lease on {claim.logical_key} (token {claim.fencing_token}); "
            f"now held by {holder}: its result is not recorded"
        )
        fenced_class, fenced_message = short_error(fenced)
        self._append_attempt(
            conn,
            claim.logical_key,
            claim.attempt_id,
            claim.fencing_token,
            now,
            AttemptOutcome.FENCED,
            fenced_class,
            fenced_message,
            started_at=claim.started_at,
        )
        return fenced

    # -- helpers -----------------------------------------------------------------------------------------------

    def _find(self, conn: Connection, key: LogicalKey, *, lock: bool) -> sa.Row | None:
        parameters = {
            "k_export": key.export,
            "k_tenant": key.tenant,
            "k_timezone": key.window.timezone,
            "k_business_date": key.window.business_date,
        }
        return conn.execute(_RUN_BY_DAY_LOCKED if lock else _RUN_BY_DAY, parameters).first()

    def _guarded_update(
        self,
        conn: Connection,
        logical_key: str,
        *,
        from_states: Sequence[ExportState],
        token: int,
        values: dict,
        owner: str | None = None,
        required: bool = True,
    ) -> bool:
        parameters = {"g_key": logical_key, "g_states": [s.value for s in from_states], "g_token": token, **values}
        if owner is not None:
            parameters["g_owner"] = owner
        result = conn.execute(_GUARDED_UPDATE[owner is not None], parameters)
        if result.rowcount == 1:
            return True
        if required:
            raise InvalidTransition(
                f"{logical_key} is no longer in {[s.value for s in from_states]} with token {token}; "
                "another attempt changed it"
            )
        return False

    def _append_abandoned(self, conn: Connection, record: ExportRecord, now: dt.datetime) -> None:
        """Records the attempt whose lease ran out without a result (it crashed or stalled)."""
        conn.execute(_INSERT_ATTEMPT, self._abandoned_values(record, now))

    def _abandoned_values(self, record: ExportRecord, now: dt.datetime) -> dict:
        return self._attempt_values(
            record.logical_key,
            record.lease_owner,
            record.fencing_token,
            now,
            AttemptOutcome.ABANDONED,
            "LeaseExpired",
            f"lease expired at {record.lease_expires_at.isoformat()} without a result",
            started_at=record.attempt_started_at,
        )

    def _append_attempt(self, conn: Connection, *args, **kwargs) -> None:
        conn.execute(_INSERT_ATTEMPT, self._attempt_values(*args, **kwargs))

    def _attempt_values(
        self,
        logical_key: str,
        attempt_id: str,
        fencing_token: int | None,
        now: dt.datetime,
        outcome: AttemptOutcome,
        error_class: str | None = None,
        error_message: str | None = None,
        *,
        started_at: dt.datetime | None = None,
    ) -> dict:
        started_at = started_at or now
        return dict(
            attempt_id=attempt_id,
            logical_key=logical_key,
            fencing_token=fencing_token,
            started_at=started_at,
            # A wall clock stepped back (NTP) since the claim must not lose the outcome: never finish before start.
            finished_at=max(now, started_at),
            outcome=outcome.value,
            error_class=error_class,
            error_message=error_message[:_MESSAGE_LIMIT] if error_message else error_message,
        )
