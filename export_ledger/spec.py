"""Declared exports: everything one ledgered export is, in a few lines. Plain Python, no Dagster.

Example:
    >>> orders = ExportSpec(
    ...     name="orders",
    ...     source=lambda tenant, start, end: load_orders(tenant, start, end),
    ...     columns={"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"},
    ...     id_columns=["order_id"],
    ...     time_column="placed_at",
    ...     tenant_column="tenant",
    ...     tenants=["acme", "globex"],
    ...     timezone="America/New_York",
    ...     start_date="2026-01-01",
    ... )  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from export_ledger.calendar import ExportCalendar, check_schedule_time
from export_ledger.contract import asset_source, export_terms, with_terms
from export_ledger.destinations.base import Destination
from export_ledger.destinations.registry import refuse_credentials
from export_ledger.errors import ConfigurationError, ExportLedgerError
from export_ledger.frames import FILE_FORMATS, ExportSchema
from export_ledger.keys import validate_slug
from export_ledger.lazy import lazy_module
from export_ledger.sources import ExportSource, SqlSource, as_source, readable
from export_ledger.tenants import Tenant, TenantGroup, as_tenants, tenant_calendar, tenant_groups

pd = lazy_module("pandas", globals(), "pd")


@dataclass(frozen=True)
class ExportSpec:
    """One ledgered export: its name, source, columns, tenants, calendar, destination and format.

    Attributes:
        name: The export's name (a slug): its asset, the first part of its logical keys and its folder.
        source: An :class:`~export_ledger.sources.ExportSource`, a callable ``(tenant, start_utc, end_utc) ->
            DataFrame``, a :class:`~export_ledger.sources.SqlSource`, a source's settings resolved where it is used
            (:class:`~export_ledger.sources.ResolvableSource`, such as a Dagster
            :class:`~export_ledger.dagster.SourceResource`: :meth:`with_source` gives the spec with it resolved), or
            None when a partitioned Dagster asset of your own produces the rows (one frame with a tenant column,
            through the ledgered I/O manager).
        columns: Column name -> kind (``string``, ``float``, ``int``, ``timestamp``, ``bool``), in file order.
        id_columns: The columns whose values together identify a row (unique within one export).
        time_column: The timestamp column that places a row in a window.
        tenants: The tenants exported for every business date: ids (slugs) in the export's zone, or
            :class:`~export_ledger.tenants.Tenant` values, or a mapping ``id -> zone``, for tenants whose business
            day is their own. After construction: the ids, in order (:meth:`tenant` gives the full declaration).
        timezone: IANA zone of the business day (of every tenant that names none). Set in code: a timezone is a
            business decision.
        start_date: First business date, ``YYYY-MM-DD``.
        schedule_time: Local ``HH:MM`` of the nightly run (must occur exactly once every day); None: no schedule.
        tenant_column: The column holding the tenant; every row must hold the key's tenant. Required when the rows
            come from an asset of your own.
        order_by: The file's row order; default ``(time_column, *id_columns)``.
        nullable: Columns that may be null; every other column is required on every row.
        file_format: ``csv`` or ``parquet``.
        destination: A destination spec of this export's own (folder, ``s3://bucket/prefix``,
            ``ledger-table:<table>``); None uses the code location's (``EXPORTS_DESTINATION``). A spec that carries a
            credential (``user:password@``, a signature or SAS token) is refused here, without repeating it.
        description: Shown in the Dagster UI.
        stream_rows: Stream each key's rows from the source in batches of this many rows, validated, written and
            hashed batch by batch, instead of one DataFrame: memory bounded by a batch (plus 8-10 bytes a row for the
            duplicate check) for a tenant's day larger than memory. The source must give the rows in file order
            (``order_by``); :class:`~export_ledger.sources.SqlSource` streams from a server-side cursor. None: one
            DataFrame per key.
        version_column: A version or updated-at column among ``columns``: a row whose value there changed after its
            key was exported counts as changed in drift detection (:mod:`export_ledger.drift`). None: late and
            deleted rows are still detected, changes in place are not (reported as unknown).
        restate_stale: Restate stale keys automatically: when drift detection finds a key of the lookback horizon
            stale, a restatement is requested (reason ``source changed: +A -R ~C rows``, asked by ``drift-sensor``)
            and the reconciliation sensor launches the partition that publishes its next revision. False: stale keys
            wait for an operator (``export-ledger restate``).
        owners: Who owns the export, shown on its assets in the Dagster UI: e-mail addresses or ``team:NAME``.
        deadline: Local ``HH:MM`` by which each tenant's key of a business date is due, on the morning after that
            date in the tenant's zone (after the nightly run); a key not completed by then is late and escalated
            (:mod:`export_ledger.deadlines`), and Dagster's freshness policy of the asset shows it. None: no deadline.
        version: The version of the export's logic (a number or a short text), recorded in its contract with the
            destination, format, schema and source: bump it when what the export computes changes, and the ledger
            refuses the new code's claims until an operator accepts the change (``export-ledger accept-contract``)
            and says what becomes of the keys already exported. None: no version.
    """

    name: str
    columns: Mapping[str, str]
    id_columns: Sequence[str]
    time_column: str
    tenants: Sequence[str | Tenant] | Mapping[str, str | Tenant | None]
    timezone: str
    start_date: str
    source: ExportSource | Callable | None = None
    schedule_time: str | None = "04:30"
    tenant_column: str | None = None
    order_by: Sequence[str] = ()
    nullable: Sequence[str] = ()
    file_format: str = "csv"
    destination: str | None = None
    description: str | None = None
    stream_rows: int | None = None
    version_column: str | None = None
    restate_stale: bool = False
    owners: Sequence[str] = ()
    deadline: str | None = None
    version: str | int | None = None
    _schema: ExportSchema = field(init=False, repr=False, compare=False)
    _tenants: dict[str, Tenant] = field(init=False, repr=False, compare=False)
    _groups: tuple[TenantGroup, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            validate_slug(self.name, "export name")
            if self.destination is not None:  # first: any later refusal may print the declaration, secret and all
                if not isinstance(self.destination, str) or not self.destination.strip():
                    text = isinstance(self.destination, str)
                    got = repr(self.destination) if text else type(self.destination).__name__  # an object: no repr
                    raise ConfigurationError(f"destination must be a destination spec (a text) or None, got {got}")
                refuse_credentials(self.destination, "destination")
            declared = as_tenants(self.tenants)
            tenants = tuple(t.id for t in declared)
            if not tenants:
                raise ConfigurationError(f"export {self.name!r} needs at least one tenant")
            if len(set(tenants)) != len(tenants):
                raise ConfigurationError(f"duplicate tenant ids in {list(tenants)}")
            object.__setattr__(self, "tenants", tenants)
            object.__setattr__(self, "_tenants", {t.id: t for t in declared})
            if self.file_format not in FILE_FORMATS:
                raise ConfigurationError(
                    f"unknown file format {self.file_format!r}: expected one of {sorted(FILE_FORMATS)}"
                )
            object.__setattr__(self, "source", as_source(self.source))
            if readable(self.source):
                self.source.identity()  # recorded in every claim's contract: one that cannot be made fails here
            if self.stream_rows is not None and (
                isinstance(self.stream_rows, bool) or not isinstance(self.stream_rows, int) or self.stream_rows <= 0
            ):
                raise ConfigurationError(f"stream_rows must be a positive number of rows, got {self.stream_rows!r}")
            if self.stream_rows is not None and self.source is None:
                raise ConfigurationError("stream_rows needs a source: rows from an asset of your own come as one frame")
            owners = [self.owners] if isinstance(self.owners, str) else list(self.owners)
            for owner in owners:
                if not isinstance(owner, str) or not (owner.startswith("team:") and len(owner) > 5 or "@" in owner):
                    raise ConfigurationError(f"owners must be e-mail addresses or team:NAME, got {owner!r}")
            object.__setattr__(self, "owners", tuple(owners))
            if self.version is not None and (
                isinstance(self.version, bool)
                or not isinstance(self.version, (str, int))
                or (isinstance(self.version, str) and not (0 < len(self.version.strip()) <= 100))
            ):
                raise ConfigurationError(f"version must be a number or a short text, got {self.version!r}")
            if not isinstance(self.restate_stale, bool):
                raise ConfigurationError(f"restate_stale must be True or False, got {self.restate_stale!r}")
            if self.restate_stale and self.source is None:
                raise ConfigurationError("restate_stale needs a source: drift detection re-reads it to find stale keys")
            if self.source is None and self.tenant_column is None:
                raise ConfigurationError("rows from an asset of your own need tenant_column to split them by tenant")
            schema = ExportSchema(
                columns=dict(self.columns),
                time_column=self.time_column,
                id_columns=tuple(self.id_columns),
                tenant_column=self.tenant_column,
                order_by=tuple(self.order_by),
                nullable=frozenset(self.nullable),
                version_column=self.version_column,
            )
            object.__setattr__(self, "_schema", schema)
            ExportCalendar(timezone=self.timezone, start_date=self.start_date)
            for tenant in declared:
                tenant_calendar(tenant, self.timezone, self.start_date)  # a bad zone or move fails here
            groups = tenant_groups(self.name, self.timezone, self.schedule_time, declared)
            if self.source is None and len(groups) > 1:
                moved = [t.id for t in declared if t.moves]
                why = (
                    f" (tenants {', '.join(moved)} moved: their days before a move are another zone's)" if moved else ""
                )
                raise ConfigurationError(
                    "rows from an asset of your own come in one partitions definition, so in one zone; tenants in "
                    f"{[g.timezone for g in groups]}{why} need a source (or one export per zone)"
                )
            for group in groups:
                if group.schedule_time is not None:
                    check_schedule_time(
                        ExportCalendar(group.timezone, self.start_date), _time_of(group.schedule_time, group.tenants)
                    )
                if self.deadline is not None:
                    _check_deadline(self.deadline, group, self.start_date)
            object.__setattr__(self, "_groups", groups)
        except ExportLedgerError as exc:
            raise type(exc)(f"export {self.name!r}: {exc}") from None  # the same error, naming the export
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"export {self.name!r}: {exc}") from None

    @property
    def schema(self) -> ExportSchema:
        return self._schema

    @property
    def calendar(self) -> ExportCalendar:
        """The export's own calendar (its zone, no moves): the one of every tenant that declares no zone."""
        return ExportCalendar(timezone=self.timezone, start_date=self.start_date)

    @property
    def nightly_at(self) -> dt.time:
        return _time_of(self.schedule_time, ())

    @property
    def groups(self) -> tuple[TenantGroup, ...]:
        """The tenants grouped by zone, the export's own zone first (:func:`export_ledger.tenants.tenant_groups`)."""
        return self._groups

    def tenant(self, tenant_id: str) -> Tenant:
        """The tenant's declaration; raises KeyError for a tenant the export does not have."""
        return self._tenants[tenant_id]

    def group_of(self, tenant_id: str, day: dt.date | None = None) -> TenantGroup:
        """The group (Dagster asset) that exports ``tenant_id`` on business date ``day`` (None: from its last move
        on). Raises KeyError for a tenant the export does not have."""
        calendar = self.calendar_for(tenant_id)
        group = self.group_of_zone(calendar.zone_on(day) if day is not None else calendar.timezone)
        if group is None or tenant_id not in group.tenants:
            raise KeyError(tenant_id)
        return group

    def group_of_zone(self, zone: str) -> TenantGroup | None:
        """The group (Dagster asset) whose partitions are ``zone``'s days, or None."""
        for group in self._groups:
            if group.timezone == zone:
                return group
        return None

    def exports_key(self, tenant_id: str, day: dt.date, zone: str) -> bool:
        """Whether this export still exports ``tenant_id`` on ``day`` in ``zone`` (the zone its key was claimed in)."""
        return tenant_id in self._tenants and self.calendar_for(tenant_id).zone_on(day) == zone

    def calendar_for(self, tenant_id: str) -> ExportCalendar:
        """The tenant's calendar: its zone (or the export's), the export's start date, its earlier zones."""
        return tenant_calendar(self._tenants[tenant_id], self.timezone, self.start_date)

    def with_source(self, source: ExportSource) -> "ExportSpec":
        """This export read from ``source`` instead: its declared settings resolved in the process that uses them
        (:class:`~export_ledger.sources.ResolvableSource`). Nothing else is checked again: only the source changes.

        Raises:
            ConfigurationError: the source's identity cannot be made (it is recorded in every claim's contract).
        """
        resolved = copy.copy(self)
        object.__setattr__(resolved, "source", as_source(source))
        if readable(resolved.source):
            resolved.source.identity()
        return resolved

    def terms(self, destination: Destination) -> dict:
        """The export's terms at ``destination``: what its contract records besides each tenant's calendar
        (:mod:`export_ledger.contract`)."""
        return export_terms(
            destination=destination.identity(self.name),
            file_format=self.file_format,
            schema=self.schema,
            source=self.source.identity() if self.source is not None else asset_source(self.name),
            version=self.version,
        )

    def contract(self, tenant_id: str, destination: Destination) -> dict:
        """The contract a claim of ``tenant_id``'s keys is checked against: its calendar and the export's terms."""
        return with_terms(self.calendar_for(tenant_id).contract(), self.terms(destination))

    def read(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        """One tenant's rows for one window, as the source gives them (SQL values conformed to the kinds)."""
        if self.source is None:
            raise ConfigurationError(f"export {self.name!r} has no source: its rows come from an asset")
        frame = self.source.rows(tenant, start_utc, end_utc)
        if isinstance(self.source, SqlSource) and isinstance(frame, pd.DataFrame):
            frame = self.source.conform(frame, self.schema)
        return frame

    def count(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> int | None:
        """How many rows the source has for one window (None without a source)."""
        return None if self.source is None else self.source.count(tenant, start_utc, end_utc)


def _check_deadline(deadline: str, group: TenantGroup, start_date: str) -> None:
    """A deadline is a wall time that occurs once every day of the group's zone, after its nightly run."""
    try:
        at = dt.time.fromisoformat(deadline)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"deadline must be HH:MM (local, the morning after the date), got {deadline!r}"
        ) from None
    if at == dt.time(0, 0):
        raise ConfigurationError("deadline 00:00 is the window's own end: no key could be exported by then")
    try:
        check_schedule_time(ExportCalendar(group.timezone, start_date), at)
    except ExportLedgerError as exc:
        raise ConfigurationError(f"deadline {deadline} in {group.timezone}: {exc}") from None
    if group.schedule_time is not None and at <= _time_of(group.schedule_time, group.tenants):
        raise ConfigurationError(
            f"deadline {deadline} is not after the nightly run at {group.schedule_time} in {group.timezone}: every "
            "key would be late before it is exported"
        )


def _time_of(text: str | None, tenants) -> dt.time:
    try:
        return dt.time.fromisoformat(text)
    except (TypeError, ValueError):
        whose = f" (tenants {', '.join(tenants)})" if tenants else ""
        raise ConfigurationError(f"schedule_time must be HH:MM, got {text!r}{whose}") from None
