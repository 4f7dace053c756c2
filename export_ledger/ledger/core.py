"""The export ledger: logical runs, their attempts, leases and fencing tokens.

Plain Python on SQLAlchemy Core; nothing here knows about Dagster. One code path serves SQLite and PostgreSQL.

Every state change is one of the transitions declared in :mod:`export_ledger.ledger.transitions`, applied as one
guarded ``UPDATE ... WHERE state IN (...) AND fencing_token = ...`` inside one transaction; when no row matches, the
change is refused with a domain error and nothing is written except, where useful, an attempt row saying why.
Attempt rows are append-only: each attempt on a key gets exactly one row, written when its outcome is known (or, for
a crashed attempt, when a later attempt takes over its expired lease), and never changed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from export_ledger.calendar import require_aware, tz_database_version
from export_ledger.keys import LogicalKey
from export_ledger.ledger import transitions as T
from export_ledger.ledger.contracts import ContractsMixin
from export_ledger.ledger.drift import DriftMixin
from export_ledger.ledger.errors import (
    MESSAGE_LIMIT,
    BelowLowWater,
    ConflictRecorded,
    EmptyWindow,
    FencedOut,
    InvalidTransition,
    LeaseHeld,
    LedgerError,
    LedgerUnavailable,
    LiveLease,
    NeedsReconciliation,
    OperatorResolution,
    short_error,
)
from export_ledger.ledger.records import (
    AlreadyCompleted,
    AttemptRecord,
    Claim,
    CompletionEvidence,
    DaySummary,
    ExportRecord,
    Resolution,
    Restatement,
)
from export_ledger.ledger.retention import RetentionMixin
from export_ledger.ledger.revisions import RestatementsMixin
from export_ledger.ledger.schema import (
    RUN_COLUMNS,
    AttemptOutcome,
    ExportState,
    export_attempts,
    export_operator_log,
    export_restatements,
    export_runs,
)
from export_ledger.ledger.store import ledger_engine, redact_url

UTC = dt.timezone.utc
DEFAULT_LEASE_TTL = dt.timedelta(minutes=15)
#: Claims a key may take before its reruns stop being automatic and it is escalated to a person.
DEFAULT_MAX_ATTEMPTS = 3


def utc_now() -> dt.datetime:
    return dt.datetime.now(UTC)


# Statements built once, executed with parameters: building a Core statement and its cache key on every call cost
# more than executing it (benchmarks/RESULTS.md, ledger throughput).
_RUN_BY_KEY = sa.select(*RUN_COLUMNS).where(export_runs.c.logical_key == sa.bindparam("k_key"))
_RUN_BY_DAY = sa.select(*RUN_COLUMNS).where(
    export_runs.c.export == sa.bindparam("k_export"),
    export_runs.c.tenant == sa.bindparam("k_tenant"),
    export_runs.c.timezone == sa.bindparam("k_timezone"),
    export_runs.c.business_date == sa.bindparam("k_business_date"),
)
_RUN_BY_DAY_LOCKED = _RUN_BY_DAY.with_for_update()
_INSERT_RUN = export_runs.insert()
_INSERT_ATTEMPT = export_attempts.insert()


class ExportLedger(RetentionMixin, ContractsMixin, DriftMixin, RestatementsMixin):
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
        read_only: bool = False,
    ) -> None:
        if lease_ttl <= dt.timedelta(0):
            raise ValueError(f"lease_ttl must be positive, got {lease_ttl}")
        self.url = url
        self.lease_ttl = lease_ttl
        self.allow_below_low_water = allow_below_low_water
        self.read_only = read_only
        self._clock = clock
        self._engine = ledger_engine(url, read_only=read_only)

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
        if self.read_only and not read_only:
            raise LedgerError(f"the ledger at {redact_url(self.url)!r} was opened for reading; it cannot be changed")
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
        query = sa.select(*RUN_COLUMNS)
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

    def exports(self) -> list[str]:
        """Every export name the ledger has a key or a calendar contract of, sorted."""
        from export_ledger.ledger.schema import export_contracts

        with self.atomic(read_only=True) as conn:
            names = set(conn.execute(sa.select(export_runs.c.export).distinct()).scalars())
            names |= set(conn.execute(sa.select(export_contracts.c.export).distinct()).scalars())
        return sorted(names)

    def day_summaries(
        self,
        *,
        export: str,
        timezone: str | None,
        days: Sequence[dt.date],
        tenants: Sequence[str],
    ) -> dict[dt.date, DaySummary]:
        """Per business day, how ``tenants``' keys stand (in ``timezone``; None: whatever their zone): counted in the
        database, so a tick that looks at a hundred days of a thousand tenants reads a hundred rows, not a hundred
        thousand. Days with no key are absent."""
        if not days or not tenants:
            return {}
        state = export_runs.c.state
        query = (
            sa.select(
                export_runs.c.business_date,
                sa.func.count().label("keys"),
                sa.func.sum(sa.case((state == ExportState.COMPLETED.value, 1), else_=0)).label("completed"),
                sa.func.sum(sa.case((state == ExportState.COMPLETED.value, export_runs.c.row_count), else_=0)).label(
                    "rows"
                ),
            )
            .where(
                export_runs.c.export == export,
                export_runs.c.business_date.in_(list(days)),
                export_runs.c.tenant.in_(list(tenants)),
            )
            .group_by(export_runs.c.business_date)
        )
        if timezone is not None:
            query = query.where(export_runs.c.timezone == timezone)
        with self.atomic(read_only=True) as conn:
            return {
                row.business_date: DaySummary(row.business_date, int(row.keys), int(row.completed), int(row.rows or 0))
                for row in conn.execute(query)
            }

    def first_records(
        self,
        *,
        export: str,
        timezone: str | None,
        days: Sequence[dt.date],
        tenants: Sequence[str],
        per_day: int,
    ) -> dict[dt.date, list[ExportRecord]]:
        """The first ``per_day`` records of each day (by tenant id) among ``tenants``: what an event lists, read
        without loading a day of a thousand tenants (one windowed query, ``ROW_NUMBER`` per day)."""
        if not days or not tenants:
            return {}
        rank = (
            sa.func.row_number()
            .over(partition_by=export_runs.c.business_date, order_by=export_runs.c.tenant)
            .label("day_rank")
        )
        ranked = sa.select(export_runs, rank).where(
            export_runs.c.export == export,
            export_runs.c.business_date.in_(list(days)),
            export_runs.c.tenant.in_(list(tenants)),
        )
        if timezone is not None:
            ranked = ranked.where(export_runs.c.timezone == timezone)
        ranked = ranked.subquery()
        query = (
            sa.select(*(ranked.c[c.name] for c in export_runs.c))
            .where(ranked.c.day_rank <= per_day)
            .order_by(ranked.c.business_date, ranked.c.tenant)
        )
        found: dict[dt.date, list[ExportRecord]] = {}
        with self.atomic(read_only=True) as conn:
            for row in conn.execute(query):
                record = ExportRecord.from_row(row)
                found.setdefault(record.business_date, []).append(record)
        return found

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
        self._check_not_empty(key)
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
                raise LedgerError(f"could not record a claim on {key}: {type(exc.orig).__name__}") from None
        raise LedgerError(f"could not claim {key}: the row kept changing under concurrent claims")

    @staticmethod
    def _check_not_empty(key: LogicalKey) -> None:
        if key.window.is_empty:
            raise EmptyWindow(
                f"{key.window.business_date} does not exist in {key.window.timezone} (the zone skipped that calendar "
                f"day): its window is empty and {key.export} for {key.tenant} has nothing to export"
            )

    def _claim_once(self, key: LogicalKey, attempt_id: str) -> Claim | AlreadyCompleted:
        now = self.now()
        inserts: list[dict] = []
        attempts: list[dict] = []
        with self.atomic() as conn:
            row = self._find(conn, key, lock=True)
            requests = self._open_requests(conn, [row.logical_key]) if row is not None else {}
            outcome = self._claim_in(conn, key, row, attempt_id, now, inserts, attempts, {}, requests)
            if inserts:
                conn.execute(_INSERT_RUN, inserts[0])
            if attempts:
                conn.execute(_INSERT_ATTEMPT, attempts)
        if isinstance(outcome, LedgerError):
            raise outcome  # after the commit: the refused attempt's row must survive
        return outcome

    def claim_many(self, keys: Sequence[LogicalKey], attempt_id: str) -> list[Claim | AlreadyCompleted | LedgerError]:
        """:meth:`claim` for several keys in one transaction: one durable commit for a group of a run's keys.

        Each key gets exactly what :meth:`claim` would give it: its own lease and fencing token (a first claim, a
        retry of a ``failed`` key, or a takeover of an expired lease, recorded ``abandoned`` for the dead holder), the
        same attempt rows, and the same refusals. A refusal is returned in the key's place instead of being raised,
        so one refused key never stops the others; its ``refused`` attempt row commits with the rest.

        Rows are locked in logical key order and new keys inserted in that order, so two attempts claiming
        overlapping groups at once wait for each other instead of deadlocking. If a concurrent first claim
        inserted one of the keys between this transaction's read and its insert, the whole transaction rolls
        back (nothing of it was acted upon) and the keys are claimed one by one with :meth:`claim`, whose retry
        and messages handle exactly that race.

        Args:
            keys: Distinct logical keys.
            attempt_id: This attempt's id.

        Returns:
            Per key, in the order given: a :class:`Claim`, :class:`AlreadyCompleted`, or the :class:`LedgerError`
            :meth:`claim` would have raised (``LeaseHeld``, ``NeedsReconciliation``, ``ConflictRecorded``,
            ``BelowLowWater``, ``EmptyWindow``).

        Raises:
            ValueError: a key appears twice.
            LedgerUnavailable: the ledger failed; nothing was claimed.
        """
        names = [str(key) for key in keys]
        if len(set(names)) != len(names):
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"claim_many needs distinct keys; repeated: {repeated[:5]}")
        outcomes: list[Claim | AlreadyCompleted | LedgerError | None] = [None] * len(keys)
        pending = []
        for i, key in enumerate(keys):
            try:
                self._check_not_empty(key)
                pending.append(i)
            except EmptyWindow as exc:
                outcomes[i] = exc
        if not pending:
            return outcomes
        try:
            claimed = self._claim_many_once([keys[i] for i in pending], attempt_id)
        except sa.exc.IntegrityError:
            claimed = [self._claim_or_refusal(keys[i], attempt_id) for i in pending]
        for i, outcome in zip(pending, claimed, strict=True):
            outcomes[i] = outcome
        return outcomes

    def _claim_or_refusal(self, key: LogicalKey, attempt_id: str) -> Claim | AlreadyCompleted | LedgerError:
        try:
            return self.claim(key, attempt_id)
        except LedgerUnavailable:
            raise
        except LedgerError as exc:
            return exc

    def _claim_many_once(
        self, keys: Sequence[LogicalKey], attempt_id: str
    ) -> list[Claim | AlreadyCompleted | LedgerError]:
        now = self.now()
        order = sorted(range(len(keys)), key=lambda i: str(keys[i]))
        outcomes: list[Claim | AlreadyCompleted | LedgerError | None] = [None] * len(keys)
        inserts: list[dict] = []
        attempts: list[dict] = []
        marks: dict[str, dt.date | None] = {}  # each export's low-water mark, read once for the group
        with self.atomic() as conn:
            found = self._find_many(conn, keys)
            requests = self._open_requests(conn, [row.logical_key for row in found.values()]) if found else {}
            for i in order:
                key = keys[i]
                row = found.get((key.export, key.tenant, key.window.timezone, key.window.business_date))
                outcomes[i] = self._claim_in(conn, key, row, attempt_id, now, inserts, attempts, marks, requests)
            if inserts:
                conn.execute(_INSERT_RUN, inserts)  # one executemany, in logical key order
            if attempts:
                conn.execute(_INSERT_ATTEMPT, attempts)
        return outcomes

    def _find_many(self, conn: Connection, keys: Sequence[LogicalKey]) -> dict[tuple, sa.Row]:
        """The rows of ``keys``' business days, locked in logical key order (one statement for the group).

        The filter is the product of the keys' exports, tenants, zones and dates, so it may lock a few rows of other
        keys of the same days as well: they are released at the commit, moments later.
        """
        query = (
            sa.select(*RUN_COLUMNS)
            .where(
                export_runs.c.export.in_(sorted({k.export for k in keys})),
                export_runs.c.tenant.in_(sorted({k.tenant for k in keys})),
                export_runs.c.timezone.in_(sorted({k.window.timezone for k in keys})),
                export_runs.c.business_date.in_(sorted({k.window.business_date for k in keys})),
            )
            .order_by(export_runs.c.logical_key)
            .with_for_update()
        )
        return {(row.export, row.tenant, row.timezone, row.business_date): row for row in conn.execute(query)}

    def _claim_in(
        self,
        conn: Connection,
        key: LogicalKey,
        row: sa.Row | None,
        attempt_id: str,
        now: dt.datetime,
        inserts: list[dict],
        attempts: list[dict],
        marks: dict[str, dt.date | None],
        requests: dict[str, Restatement],
    ) -> Claim | AlreadyCompleted | LedgerError:
        """Decides one key's claim inside the caller's transaction, from its locked row (None: no row yet).

        Updates of existing rows run here; the first claim's row and the attempt rows are appended to ``inserts`` and
        ``attempts`` for the caller to write. A refusal is returned (its attempt row appended), never raised, so the
        caller commits that row; a key below the low-water mark is returned with no row, as :meth:`claim` writes none.
        ``marks`` caches the low-water mark of each export for the transaction; ``requests`` holds the open
        restatement requests of the transaction's keys: a ``completed`` key with one is claimed to publish its next
        revision (and a retry or takeover of such a key goes on with that revision).
        """
        expires = now + self.lease_ttl
        if row is None:
            if key.export not in marks:
                marks[key.export] = self._low_water(conn, key.export)
            mark = marks[key.export]
            if mark is not None and key.window.business_date < mark and not self.allow_below_low_water:
                return BelowLowWater(
                    f"{key} is below the retention low-water mark of {key.export} ({mark.isoformat()}): its "
                    "completion record may have been pruned, so exporting it again could duplicate an export. "
                    "Refused; an operator who knows it was never exported can allow it explicitly "
                    "(EXPORTS_ALLOW_BELOW_LOW_WATER=1 for that run)"
                )
            tz_database = tz_database_version(key.window.timezone)
            inserts.append(
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
                )
            )
            return Claim(str(key), attempt_id, 1, key.window, now, expires, None, tz_database)

        record = ExportRecord.from_row(row)
        request = requests.get(record.logical_key)
        if record.state is ExportState.COMPLETED and request is None:
            attempts.append(
                self._attempt_values(record.logical_key, attempt_id, None, now, AttemptOutcome.ALREADY_COMPLETED)
            )
            return AlreadyCompleted(record)
        refusal = self._refusal(record, now)
        if refusal is not None:
            error_class, message = short_error(refusal)
            attempts.append(
                self._attempt_values(
                    record.logical_key, attempt_id, None, now, AttemptOutcome.REFUSED, error_class, message
                )
            )
            return refusal
        if record.state is ExportState.COMPLETED:
            transition = T.RESTATE  # the current revision stays published and current until the new one is
        else:
            transition = T.TAKE_OVER if record.state is ExportState.IN_PROGRESS else T.CLAIM_RETRY
        if transition is T.TAKE_OVER:
            # The holder's lease ran out without a result: record its attempt before taking over.
            attempts.append(self._abandoned_values(record, now))
        token = record.fencing_token + 1
        moved = T.apply(
            conn,
            transition,
            record.logical_key,
            token=record.fencing_token,
            now=now,
            values=dict(
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
        if not moved:
            raise InvalidTransition(f"{record.logical_key} changed while it was being claimed")
        return Claim(
            record.logical_key, attempt_id, token, record.window, now, expires, record.state, record.tz_database,
            **self._restating(conn, request),
        )  # fmt: skip

    @staticmethod
    def _refusal(record: ExportRecord, now: dt.datetime) -> LedgerError | None:
        """Why a key that is not completed cannot be claimed now, or None when it can."""
        if record.state is ExportState.CONFLICT:
            return ConflictRecorded(
                f"{record.logical_key} is in conflict: the destination holds a different export at "
                f"{record.location or 'its place'}; refusing to overwrite it until an operator resolves it"
            )
        if record.state is ExportState.REMOTE_UNKNOWN:
            return NeedsReconciliation(
                f"{record.logical_key} has an unknown outcome at the destination (attempt {record.lease_owner}); "
                "retrying could export it twice, so it is refused until reconciliation resolves it"
            )
        if record.state is ExportState.IN_PROGRESS and record.lease_expires_at > now:
            return LeaseHeld(
                f"{record.logical_key} is being exported by attempt {record.lease_owner} "
                f"(lease held until {record.lease_expires_at.isoformat()})"
            )
        return None

    def complete(
        self, claim: Claim, evidence: CompletionEvidence, *, note: OperatorResolution | None = None
    ) -> ExportRecord:
        """Records the key as completed from the destination's evidence.

        ``evidence.attempt_id`` other than the claim's means an earlier attempt published and crashed before
        recording: the row points at that attempt's export and this attempt is recorded as ``repaired``. ``note``
        (an operator's resolution) is stored as the attempt row's message.
        """
        transition = T.COMPLETE if evidence.attempt_id == claim.attempt_id else T.REPAIR
        _check_revision(claim, evidence)
        return self._finish(
            claim,
            transition,
            error=note,
            values=_evidence_values(evidence),
            then=self._revision_recorder(claim, evidence),
        )

    def complete_many(self, completions: Sequence[tuple[Claim, CompletionEvidence]]) -> list[ExportRecord | FencedOut]:
        """:meth:`complete` for a group of keys in one transaction: one durable commit after their publishes.

        Each key keeps its own guard (its claim's token and lease owner) and transition (``complete``, or
        ``repair`` when the evidence is an earlier attempt's export). A key whose lease this attempt lost gets its
        ``fenced`` attempt row and a :class:`FencedOut` in its place; the others still commit. Until this commit the
        group's exports are published but not recorded: a crash here leaves each key ``in_progress`` with an export
        at the destination, which the key's next claim (or reconciliation) records from its manifest.

        Returns:
            Per completion, in the order given: the key's record as committed, or the :class:`FencedOut` to raise.
        """
        if not completions:
            return []
        names = [claim.logical_key for claim, _ in completions]
        if len(set(names)) != len(names):
            raise ValueError(f"complete_many needs distinct keys; got {len(names) - len(set(names))} repeated")
        for claim, evidence in completions:
            _check_revision(claim, evidence)
        now = self.now()
        fenced: dict[int, FencedOut] = {}
        attempts: list[dict] = []
        with self.atomic() as conn:
            for i, (claim, evidence) in enumerate(completions):
                transition = T.COMPLETE if evidence.attempt_id == claim.attempt_id else T.REPAIR
                matched = T.apply(
                    conn,
                    transition,
                    claim.logical_key,
                    token=claim.fencing_token,
                    owner=claim.attempt_id,
                    values=dict(
                        lease_owner=None,
                        lease_expires_at=None,
                        updated_at=now,
                        **_evidence_values(evidence),
                    ),
                )
                if matched:
                    if claim.revision > 1:
                        self._record_revision(conn, claim.logical_key, evidence, now)
                    attempts.append(
                        self._attempt_values(
                            claim.logical_key,
                            claim.attempt_id,
                            claim.fencing_token,
                            now,
                            transition.outcome,
                            started_at=claim.started_at,
                        )
                    )
                else:
                    fenced[i] = self._record_fenced(conn, claim, now)
            if attempts:
                conn.execute(_INSERT_ATTEMPT, attempts)
            rows = {
                row.logical_key: row
                for row in conn.execute(sa.select(*RUN_COLUMNS).where(export_runs.c.logical_key.in_(names)))
            }
        return [fenced[i] if i in fenced else ExportRecord.from_row(rows[name]) for i, name in enumerate(names)]

    def hold(self, logical_key: str, operator: str) -> Claim:
        """Takes a key's lease for an operator who is about to resolve it (``export-ledger resolve``).

        Allowed from ``conflict``, ``failed``, ``remote_unknown`` and ``in_progress`` whose lease has expired (the dead
        holder is recorded ``abandoned``); refused while a live lease holds the key. The token is incremented, so an
        attempt that held the key before can no longer commit.

        Raises:
            LiveLease: an attempt holds a live lease; the message names it and when it ends.
            InvalidTransition: the key is ``completed`` or unknown.
        """
        now = self.now()
        with self.atomic() as conn:
            row = conn.execute(_RUN_BY_KEY, {"k_key": logical_key}).first()
            if row is None:
                raise InvalidTransition(f"unknown logical key {logical_key!r}: the ledger has no export with it")
            record = ExportRecord.from_row(row)
            if record.state is ExportState.IN_PROGRESS and record.lease_expires_at > now:
                raise LiveLease(
                    f"{logical_key} is held by attempt {record.lease_owner} until "
                    f"{record.lease_expires_at.isoformat()}; resolve it after that lease ends"
                )
            if record.state not in T.OPERATOR_HOLD.from_states:
                raise InvalidTransition(f"{logical_key} is {record.state.value}: there is nothing to resolve")
            if record.state is ExportState.IN_PROGRESS:
                conn.execute(_INSERT_ATTEMPT, self._abandoned_values(record, now))
            token = record.fencing_token + 1
            expires = now + self.lease_ttl
            moved = T.apply(
                conn,
                T.OPERATOR_HOLD,
                logical_key,
                token=record.fencing_token,
                states=(record.state,),
                now=now,
                values=dict(
                    lease_owner=operator, lease_expires_at=expires, attempt_started_at=now, fencing_token=token,
                    updated_at=now,
                ),
            )  # fmt: skip
            if not moved:
                raise InvalidTransition(f"{logical_key} changed while an operator was taking it; look again")
            restating = self._restating(conn, self._open_requests(conn, [logical_key]).get(logical_key))
        return Claim(
            logical_key, operator, token, record.window, now, expires, record.state, record.tz_database, **restating
        )

    def log_operator(
        self,
        operator: str,
        action: str,
        detail: str,
        reason: str,
        *,
        export: str | None = None,
        logical_key: str | None = None,
    ) -> None:
        """Appends an operator's decision to ``export_operator_log``."""  # fmt: skip
        with self.atomic() as conn:
            conn.execute(
                export_operator_log.insert().values(
                    recorded_at=self.now(), operator=operator[:200], action=action, export=export,
                    logical_key=logical_key, detail=detail[:1000], reason=reason.strip()[:MESSAGE_LIMIT],
                )
            )  # fmt: skip

    def operator_log(self) -> list[dict]:
        with self.atomic(read_only=True) as conn:
            rows = conn.execute(sa.select(export_operator_log).order_by(export_operator_log.c.id))
            return [dict(row._mapping) for row in rows]

    def rerun_bases(self, logical_keys: Sequence[str]) -> dict[str, int]:
        """Per key, the fencing token of its latest operator resolution or open restatement request (0 if none):
        automatic reruns count the claims after it, so a key an operator sent back to ``failed``, or a restatement,
        gets its reruns again."""
        if not logical_keys:
            return {}
        query = (
            sa.select(export_attempts.c.logical_key, sa.func.max(export_attempts.c.fencing_token))
            .where(
                export_attempts.c.logical_key.in_(list(logical_keys)),
                export_attempts.c.error_class == OperatorResolution.__name__,
            )
            .group_by(export_attempts.c.logical_key)
        )
        with self.atomic(read_only=True) as conn:
            found = {key: int(token or 0) for key, token in conn.execute(query)}
            if self._has_revisions(conn):
                for request in self._open_requests(conn, logical_keys).values():
                    found[request.logical_key] = max(found.get(request.logical_key, 0), request.base_token)
        return {key: found.get(key, 0) for key in logical_keys}

    def mark_conflict(self, claim: Claim, error: BaseException, *, location: str | None = None) -> ExportRecord:
        """Records that the destination holds something else at this key's place: refused until an operator acts."""
        return self._finish(claim, T.MARK_CONFLICT, error=error, values=dict(location=location))

    def fail(self, claim: Claim, error: BaseException) -> ExportRecord:
        """Records that the attempt failed before publishing anything: the key is safe to retry."""
        return self._finish(claim, T.FAIL, error=error)

    def mark_remote_unknown(
        self, claim: Claim, error: BaseException, *, sha256: str | None = None, location: str | None = None
    ) -> ExportRecord:
        """Records that the destination may or may not hold the export: no retry until reconciled.

        ``sha256`` and ``location`` describe what the attempt tried to write; reconciliation compares the
        destination's evidence with them.
        """
        return self._finish(
            claim,
            T.MARK_REMOTE_UNKNOWN,
            error=error,
            values=dict(sha256=sha256, location=location),
        )

    # -- reconciliation ----------------------------------------------------------------------------------------

    def committed_by(self, attempt: str) -> list[ExportRecord]:
        """Keys an attempt completed (its other keys, when one of them is being reconciled)."""
        query = sa.select(*RUN_COLUMNS).where(export_runs.c.committed_attempt == attempt)
        with self.atomic(read_only=True) as conn:
            return [ExportRecord.from_row(r) for r in conn.execute(query.order_by(export_runs.c.logical_key))]

    def stuck(self, *, limit: int, after: str | None = None) -> list[ExportRecord]:
        """Keys that need reconciling, in key order after ``after``: ``remote_unknown``, and ``in_progress`` whose
        lease has expired (a crashed or stalled attempt). Each of the two reads walks an index on state."""
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        now = self.now()
        unknown = sa.select(*RUN_COLUMNS).where(export_runs.c.state == ExportState.REMOTE_UNKNOWN.value)
        expired = sa.select(*RUN_COLUMNS).where(
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

    def failed(self, *, limit: int, after: str | None = None, max_attempts: int | None = None) -> list[ExportRecord]:
        """``failed`` keys in key order after ``after`` (the reconciliation sensor reruns them, a batch a tick).

        With ``max_attempts``, keys whose automatic reruns are spent are left out (they are escalated, not rerun), so
        escalated keys piling up never delay the rerun of a new failure; keys an operator resolved are kept (their
        reruns count from the resolution).
        """
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        query = sa.select(*RUN_COLUMNS).where(export_runs.c.state == ExportState.FAILED.value)
        if max_attempts is not None:
            resolved = sa.select(export_attempts.c.logical_key).where(
                export_attempts.c.error_class == OperatorResolution.__name__
            )
            restating = sa.select(export_restatements.c.logical_key).where(export_restatements.c.closed_at.is_(None))
            query = query.where(
                sa.or_(
                    export_runs.c.fencing_token < max_attempts,
                    export_runs.c.logical_key.in_(resolved),
                    export_runs.c.logical_key.in_(restating),
                )
            )
        if after is not None:
            query = query.where(export_runs.c.logical_key > after)
        with self.atomic(read_only=True) as conn:
            rows = conn.execute(query.order_by(export_runs.c.logical_key).limit(limit))
            return [ExportRecord.from_row(r) for r in rows]

    def needs_attention(
        self, stuck_after: dt.timedelta, *, max_attempts: int | None = DEFAULT_MAX_ATTEMPTS
    ) -> list[tuple[ExportRecord, str]]:
        """Keys escalated to a person, each with why: in ``conflict``; ``failed`` after ``max_attempts`` claims (the
        automatic reruns are spent); or ``failed``, ``remote_unknown`` or expired ``in_progress`` for longer than
        ``stuck_after``. Every key that is not completed ends here or completed: no state is a dead end."""
        now = self.now()
        horizon = now - stuck_after
        waiting = sa.or_(
            export_runs.c.state.in_([ExportState.FAILED.value, ExportState.REMOTE_UNKNOWN.value]),
            sa.and_(export_runs.c.state == ExportState.IN_PROGRESS.value, export_runs.c.lease_expires_at < now),
        )
        conditions = [
            export_runs.c.state == ExportState.CONFLICT.value,
            sa.and_(export_runs.c.updated_at < horizon, waiting),
        ]
        if max_attempts is not None:
            conditions.append(
                sa.and_(export_runs.c.state == ExportState.FAILED.value, export_runs.c.fencing_token >= max_attempts)
            )
        query = sa.select(*RUN_COLUMNS).where(sa.or_(*conditions)).order_by(export_runs.c.logical_key)
        with self.atomic(read_only=True) as conn:
            records = [ExportRecord.from_row(r) for r in conn.execute(query)]
        bases = self.rerun_bases([r.logical_key for r in records if r.state is ExportState.FAILED])
        found = []
        for record in records:
            spent = record.fencing_token - bases.get(record.logical_key, 0)
            if record.state is ExportState.FAILED and record.updated_at >= horizon and spent < (max_attempts or 0):
                continue  # an operator sent it back with its reruns restored: not escalated yet
            found.append((record, self._attention_reason(record, now, horizon, max_attempts, spent)))
        return sorted(found + self._unpublished_restatements(horizon, now), key=lambda item: item[0].logical_key)

    def _unpublished_restatements(self, horizon: dt.datetime, now: dt.datetime) -> list[tuple[ExportRecord, str]]:
        """Completed keys whose restatement was requested before ``horizon`` and never claimed: the run that should
        publish it was never launched, or failed before it reached the key (a source that cannot be read)."""
        query = (
            sa.select(*RUN_COLUMNS, export_restatements.c.revision.label("pending_revision"),
                      export_restatements.c.requested_at.label("pending_since"))
            .join(export_restatements, export_restatements.c.logical_key == export_runs.c.logical_key)
            .where(
                export_restatements.c.closed_at.is_(None),
                export_restatements.c.requested_at < horizon,
                export_runs.c.state == ExportState.COMPLETED.value,
            )
        )  # fmt: skip
        with self.atomic(read_only=True) as conn:
            if not self._has_revisions(conn):
                return []
            rows = list(conn.execute(query))
        found = []
        for row in rows:
            values = {column.name: row._mapping[column.name] for column in RUN_COLUMNS}
            record = ExportRecord(**{**values, "state": ExportState(values["state"])})
            since = str(now - row.pending_since).split(".")[0]
            found.append((
                record,
                f"restatement to revision {row.pending_revision} requested {since} ago and not published: materialize "
                f"the partition, or withdraw it (export-ledger restate --withdraw {record.logical_key} --reason ...)",
            ))  # fmt: skip
        return found

    @staticmethod
    def _attention_reason(
        record: ExportRecord, now: dt.datetime, horizon: dt.datetime, max_attempts: int | None, spent: int
    ) -> str:
        if record.state is ExportState.CONFLICT:
            return "conflict: the destination holds something else; resolve it (export-ledger resolve)"
        if record.state is ExportState.FAILED and max_attempts is not None and spent >= max_attempts:
            return (
                f"failed {spent} time(s): automatic reruns are spent; fix the cause and rerun the "
                "partition, or resolve it (export-ledger resolve; a restatement: export-ledger restate --withdraw)"
            )
        since = now - record.updated_at
        return f"{record.state.value} for {str(since).split('.')[0]}: longer than allowed"

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
        if state not in T.RECONCILE_TO:
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
        transition = T.RECONCILE_TO[state]
        values: dict = dict(lease_owner=None, lease_expires_at=None, updated_at=now)
        if evidence is not None:
            values.update(_evidence_values(evidence))
        # Guarded by the state examined (never a live lease) and its token: the row as updated, or None.
        row = T.apply(
            conn,
            transition,
            record.logical_key,
            token=record.fencing_token,
            states=(record.state,),
            now=now,
            values=values,
            returning=True,
        )
        if row is None:
            return None
        if evidence is not None and self._open_requests(conn, [record.logical_key]):
            self._record_revision(conn, record.logical_key, evidence, now)  # a restatement, found published
        if record.state is ExportState.IN_PROGRESS:
            attempts.append(self._abandoned_values(record, now))
        attempts.append(
            self._attempt_values(
                record.logical_key,
                reconciler,
                record.fencing_token,
                now,
                transition.outcome,
                "Reconciliation",
                item.detail,
            )
        )
        return ExportRecord.from_row(row)

    def _finish(
        self,
        claim: Claim,
        transition: T.Transition,
        *,
        values: dict | None = None,
        error: BaseException | None = None,
        then: Callable[[Connection, dt.datetime], None] | None = None,
    ) -> ExportRecord:
        """Applies an owner-guarded transition; ``then`` runs in the same transaction when it matched."""
        now = self.now()
        error_class, message = short_error(error) if error is not None else (None, None)
        outcome = transition.outcome
        with self.atomic() as conn:
            matched = T.apply(
                conn,
                transition,
                claim.logical_key,
                token=claim.fencing_token,
                owner=claim.attempt_id,
                values=dict(
                    # remote_unknown keeps the attempt whose write is in doubt: reconciliation looks for its evidence.
                    lease_owner=claim.attempt_id if transition is T.MARK_REMOTE_UNKNOWN else None,
                    lease_expires_at=None,
                    updated_at=now,
                    **(values or {}),
                ),
            )
            if matched:
                if then is not None:
                    then(conn, now)
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
                sa.select(*RUN_COLUMNS).where(export_runs.c.logical_key == claim.logical_key).with_for_update()
            ).first()
            live = (
                current is not None
                and current.state == ExportState.IN_PROGRESS.value
                and current.fencing_token == claim.fencing_token
                and current.lease_owner == claim.attempt_id
            )
            if live:
                evidence = effect(conn)
                moved = T.apply(
                    conn,
                    T.COMPLETE,
                    claim.logical_key,
                    token=claim.fencing_token,
                    owner=claim.attempt_id,
                    values=dict(
                        lease_owner=None,
                        lease_expires_at=None,
                        updated_at=now,
                        **_evidence_values(evidence),
                    ),
                )
                if not moved:  # the row is locked above: only a bug could get here
                    raise InvalidTransition(f"{claim.logical_key} changed under its own row lock")
                _check_revision(claim, evidence)
                if claim.revision > 1:
                    self._record_revision(conn, claim.logical_key, evidence, now)
                self._append_attempt(
                    conn,
                    claim.logical_key,
                    claim.attempt_id,
                    claim.fencing_token,
                    now,
                    T.COMPLETE.outcome,
                    started_at=claim.started_at,
                )
                row = conn.execute(_RUN_BY_KEY, {"k_key": claim.logical_key}).one()
                return ExportRecord.from_row(row)
            fenced = self._record_fenced(conn, claim, now)
        raise fenced

    def _revision_recorder(
        self, claim: Claim, evidence: CompletionEvidence
    ) -> Callable[[Connection, dt.datetime], None] | None:
        if claim.revision == 1:
            return None
        return lambda conn, now: self._record_revision(conn, claim.logical_key, evidence, now)

    def _record_fenced(self, conn: Connection, claim: Claim, now: dt.datetime) -> FencedOut:
        """Appends the ``fenced`` attempt row (unless the attempt already has its row: a takeover recorded it
        ``abandoned``) and returns the error to raise (after the transaction commits)."""
        current = conn.execute(_RUN_BY_KEY, {"k_key": claim.logical_key}).first()
        holder = "nobody"
        if current is not None:
            holder = f"{current.lease_owner or 'nobody'} (state {current.state}, token {current.fencing_token})"
        fenced = FencedOut(
            f"attempt {claim.attempt_id} lost its lease on {claim.logical_key} (token {claim.fencing_token}); "
            f"now held by {holder}: its result is not recorded"
        )
        recorded = conn.execute(
            sa.select(export_attempts.c.id).where(
                export_attempts.c.logical_key == claim.logical_key,
                export_attempts.c.attempt_id == claim.attempt_id,
                export_attempts.c.fencing_token == claim.fencing_token,
            )
        ).first()
        if recorded is not None:
            return fenced  # one row per attempt: the takeover already recorded this one as abandoned
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
            error_message=error_message[:MESSAGE_LIMIT] if error_message else error_message,
        )


def _check_revision(claim: Claim, evidence: CompletionEvidence) -> None:
    """A completion records the revision its claim publishes, never another one's export."""
    if evidence.revision != claim.revision:
        raise InvalidTransition(
            f"{claim.logical_key}: the claim publishes revision {claim.revision} but the evidence is revision "
            f"{evidence.revision} ({evidence.location}); nothing recorded"
        )


def _evidence_values(evidence: CompletionEvidence) -> dict:
    """The ``export_runs`` columns a completion records from the destination's evidence."""
    return dict(
        location=evidence.location,
        sha256=evidence.sha256,
        row_count=evidence.row_count,
        committed_attempt=evidence.attempt_id,
        source_fingerprint=evidence.source_fingerprint,
    )
