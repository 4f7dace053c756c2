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

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd

from export_ledger.calendar import ExportCalendar, check_schedule_time
from export_ledger.errors import ConfigurationError, ExportLedgerError
from export_ledger.frames import FILE_FORMATS, ExportSchema
from export_ledger.keys import validate_slug
from export_ledger.sources import ExportSource, SqlSource, as_source


@dataclass(frozen=True)
class ExportSpec:
    """One ledgered export: its name, source, columns, tenants, calendar, destination and format.

    Attributes:
        name: The export's name (a slug): its asset, the first part of its logical keys and its folder.
        source: An :class:`~export_ledger.sources.ExportSource`, a callable ``(tenant, start_utc, end_utc) ->
            DataFrame``, a :class:`~export_ledger.sources.SqlSource`, or None when a partitioned Dagster asset of
            your own produces the rows (one frame with a tenant column, through the ledgered I/O manager).
        columns: Column name -> kind (``string``, ``float``, ``int``, ``timestamp``, ``bool``), in file order.
        id_columns: The columns whose values together identify a row (unique within one export).
        time_column: The timestamp column that places a row in a window.
        tenants: The tenants (slugs) exported for every business date.
        timezone: IANA zone of the business day. Set in code: a timezone is a business decision.
        start_date: First business date, ``YYYY-MM-DD``.
        schedule_time: Local ``HH:MM`` of the nightly run (must occur exactly once every day); None: no schedule.
        tenant_column: The column holding the tenant; every row must hold the key's tenant. Required when the rows
            come from an asset of your own.
        order_by: The file's row order; default ``(time_column, *id_columns)``.
        nullable: Columns that may be null; every other column is required on every row.
        file_format: ``csv`` or ``parquet``.
        destination: A destination spec of this export's own (folder, ``s3://bucket/prefix``,
            ``ledger-table:<table>``); None uses the code location's (``EXPORTS_DESTINATION``).
        description: Shown in the Dagster UI.
    """

    name: str
    columns: Mapping[str, str]
    id_columns: Sequence[str]
    time_column: str
    tenants: Sequence[str]
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
    _schema: ExportSchema = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            validate_slug(self.name, "export name")
            tenants = tuple(validate_slug(t, "tenant id") for t in self.tenants)
            if not tenants:
                raise ConfigurationError(f"export {self.name!r} needs at least one tenant")
            if len(set(tenants)) != len(tenants):
                raise ConfigurationError(f"duplicate tenant ids in {list(tenants)}")
            object.__setattr__(self, "tenants", tenants)
            if self.file_format not in FILE_FORMATS:
                raise ConfigurationError(
                    f"unknown file format {self.file_format!r}: expected one of {sorted(FILE_FORMATS)}"
                )
            object.__setattr__(self, "source", as_source(self.source))
            if self.source is None and self.tenant_column is None:
                raise ConfigurationError("rows from an asset of your own need tenant_column to split them by tenant")
            schema = ExportSchema(
                columns=dict(self.columns),
                time_column=self.time_column,
                id_columns=tuple(self.id_columns),
                tenant_column=self.tenant_column,
                order_by=tuple(self.order_by),
                nullable=frozenset(self.nullable),
            )
            object.__setattr__(self, "_schema", schema)
            calendar = ExportCalendar(timezone=self.timezone, start_date=self.start_date)
            if self.schedule_time is not None:
                check_schedule_time(calendar, self.nightly_at)
        except ExportLedgerError as exc:
            raise type(exc)(f"export {self.name!r}: {exc}") from None  # the same error, naming the export
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"export {self.name!r}: {exc}") from None

    @property
    def schema(self) -> ExportSchema:
        return self._schema

    @property
    def calendar(self) -> ExportCalendar:
        return ExportCalendar(timezone=self.timezone, start_date=self.start_date)

    @property
    def nightly_at(self) -> dt.time:
        try:
            return dt.time.fromisoformat(self.schedule_time)
        except (TypeError, ValueError):
            raise ConfigurationError(f"schedule_time must be HH:MM, got {self.schedule_time!r}") from None

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
