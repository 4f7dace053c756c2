"""Reading back what is current: every key's current revision of a range of business dates, from the destination's
own evidence alone (issue 30, item 3). Plain Python, no Dagster.

A consumer of a published export follows each key's pointer (docs/layout.md): a glob over the key folders sees every
revision of a restated key, and the places of attempts that never committed. :func:`read_current` does the following
for every key of the range, one key at a time: it reads the revision the key's pointer names
(:meth:`~export_ledger.destinations.Destination.current_revision`), has the destination judge that revision behind
the pointer (:meth:`~export_ledger.destinations.Destination.verify`: its manifest names the key and the revision, and
its data's sha256 is the manifest's and the pointer's), then reads that place's data
(:meth:`~export_ledger.destinations.Destination.read_data`) and checks its sha256 once more. It never opens the
ledger: a partner who receives the export has none. A place, once named by a pointer, is never changed or deleted
(docs/protocol.md), so a key read while a restatement moves its pointer is read whole at revision N, or whole at
revision N + 1, never both and never neither.

Example:
    >>> frame = read_current(orders, dt.date(2026, 3, 1), dt.date(2026, 3, 7))  # doctest: +SKIP
    >>> frame.attrs["missing"]  # the keys of the range with nothing published  # doctest: +SKIP
    ['orders/globex/2026-03-07T05:00:00Z']
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from collections.abc import Sequence

from export_ledger.calendar import load_zone, parse_business_date, window_for
from export_ledger.destinations.base import Destination, DestinationError, ExportTarget, Verdict, place_of_location
from export_ledger.destinations.registry import destination_from
from export_ledger.errors import CalendarError, ConfigurationError
from export_ledger.frames import ExportSchema, read_arrow
from export_ledger.keys import LogicalKey, validate_slug
from export_ledger.lazy import lazy_module
from export_ledger.settings import DESTINATION_ENV, LEDGER_URL_ENV, ledger_url_from
from export_ledger.spec import ExportSpec

pd = lazy_module("pandas", globals(), "pd")
pa = lazy_module("pyarrow", globals(), "pa")

#: The longest range :func:`read_current` reads unless asked for more (``max_days=``): a year and a day, so that any
#: calendar year (and a leap year) fits; longer reads are a bulk job, asked for on purpose.
MAX_DAYS = 366
#: How often one key's read starts again because its pointer moved while it was read (each move is another party's
#: commit of a new revision, so this is reached only when the key is restated this many times during one read).
_ROUNDS = 8
#: ``superseded`` for :meth:`Destination.verify`: no revision, so the verdict is PUBLISHED or CONFLICT, never ABSENT.
_NO_REVISION = -1


class CurrentRevisionUnreadable(DestinationError):
    """A key's current revision is not what its pointer says it is (a manifest of another key or revision, a data
    file whose sha256 is not the one recorded, a data file missing): never skipped, never read past.

    ``logical_key`` names the key."""

    def __init__(self, message: str, *, logical_key: str) -> None:
        super().__init__(message)
        self.logical_key = logical_key


def read_current(
    spec_or_destination: ExportSpec | Destination,
    start: dt.date | str,
    end: dt.date | str,
    *,
    tenants: Sequence[str] | None = None,
    export: ExportSpec | str | None = None,
    timezone: str | None = None,
    max_days: int | None = MAX_DAYS,
) -> pd.DataFrame:
    """The current revision of every key of ``start`` to ``end`` (business dates, **both included**), read from the
    destination's evidence alone, one key at a time. It only reads (:meth:`Destination.reading`): nothing is
    created, fsynced or written, so read access to the destination is enough.

    Args:
        spec_or_destination: An :class:`~export_ledger.ExportSpec` that declares its ``destination`` (the scheme's
            settings, such as credentials, from the environment, as the CLI reads them; a ``ledger-table:`` one in
            the database ``EXPORTS_LEDGER_URL`` names, which must be set), for its tenants in their own zones. Or a
            :class:`~export_ledger.destinations.Destination`, with ``export=``: the way to read a spec without a
            destination of its own (nothing is guessed from ``EXPORTS_DESTINATION`` or ``./var/exports``).
        start, end: The first and the last business date (``datetime.date`` or ``YYYY-MM-DD``), each tenant's in its
            own zone. A datetime is refused (naive, it names no zone; aware, an instant rather than a day), and so is
            an ``end`` before ``start``.
        tenants: The tenants to read (default: the spec's; required with a destination and an export name: no
            destination lists its tenants without walking every object under the export).
        export: With a destination: the export's :class:`~export_ledger.ExportSpec` (its tenants, zones and column
            kinds), or its name, with ``timezone``.
        timezone: With an export's name: the IANA zone of its business dates (every tenant's).
        max_days: The longest range read (default :data:`MAX_DAYS`); None reads any range.

    Returns:
        One frame of every key's rows in the export's columns, as published (typed by the spec's column kinds when
        there is a spec; a CSV export read by name alone takes the types pyarrow infers), business date by business
        date and within a date tenant by tenant, each key's rows in file order. No column is added: the tenant and
        the date are the export's own columns where it has them, and the revisions are in ``attrs``:
        ``frame.attrs["current"]`` maps each key read (``export/tenant/window start UTC``) to its current revision,
        and ``frame.attrs["missing"]`` lists the keys of the range with nothing published, in the same order: they
        are absent from the frame, never an error.

    Raises:
        CurrentRevisionUnreadable: a key's pointer names a revision that is not intact (another key's or revision's
            manifest, a data file whose sha256 is not the one its manifest and pointer record, or a missing one),
            naming the key.
        CalendarError: a range that is reversed, not made of dates, or starts before the export does.
        ConfigurationError: a range longer than ``max_days``, a tenant the export does not have, a destination
            without the export it holds, or a spec without a destination of its own.
        DestinationUnreachable: the destination cannot be read.
        LedgerUnavailable: a ledger table's database does not exist or holds no ledger (a reader never creates
            one).

    Example:
        >>> from export_ledger import LocalDestination, read_current
        >>> frame = read_current(
        ...     LocalDestination("var/exports"), "2026-03-01", "2026-03-07",
        ...     export="orders", timezone="America/New_York", tenants=["acme", "globex"],
        ... )  # doctest: +SKIP
    """
    spec, destination = _export_and_destination(spec_or_destination, export, timezone)
    first, last = _day(start, "start"), _day(end, "end")
    if last < first:
        raise CalendarError(f"end {last} is before start {first}: the range is reversed")
    days = (last - first).days + 1
    if max_days is not None:
        if isinstance(max_days, bool) or not isinstance(max_days, int) or max_days < 1:
            raise ConfigurationError(f"max_days must be a positive number of days or None, got {max_days!r}")
        if days > max_days:
            raise ConfigurationError(
                f"{first} to {last} is {days} days, more than max_days={max_days}: read it in parts, or pass a larger "
                "max_days (None: no limit)"
            )
    name = spec.name if spec is not None else export
    if spec is not None and first < spec.calendar.first_date:
        raise CalendarError(f"start {first} is before export {name!r} starts ({spec.start_date})")
    wanted = _tenants(tenants, spec)
    schema = spec.schema if spec is not None else None
    tables: list[pa.Table] = []
    current: dict[str, int] = {}
    missing: list[str] = []
    with destination.reading():  # a reader creates, settles and writes nothing: read access is enough
        for offset in range(days):
            day = first + dt.timedelta(days=offset)
            for tenant in wanted:
                window = spec.calendar_for(tenant).window_of(day) if spec is not None else window_for(day, timezone)
                key = LogicalKey(name, tenant, window)
                found = _read_key(destination, key, schema)
                if found is None:
                    missing.append(str(key))
                    continue
                revision, table = found
                current[str(key)] = revision
                tables.append(table)
    frame = _frame(tables, schema)
    frame.attrs["current"] = current
    frame.attrs["missing"] = missing
    return frame


def _read_key(destination: Destination, key: LogicalKey, schema: ExportSchema | None) -> tuple[int, pa.Table] | None:
    """One key's current revision and its rows, or None when nothing is published for it."""
    logical_key = str(key)
    target = ExportTarget(key.export, key.tenant, key.window.business_date.isoformat())
    revision = destination.current_revision(target)
    for _ in range(_ROUNDS):
        if revision == 0:
            return None
        seen = destination.verify(target.at_revision(revision), logical_key=logical_key, superseded=_NO_REVISION)
        if seen.verdict is Verdict.PUBLISHED:
            break
        moved = destination.current_revision(target)
        if moved == revision:
            # The pointer stayed where it was: what it names is not this key's intact revision.
            raise CurrentRevisionUnreadable(f"{logical_key}: {seen.detail}", logical_key=logical_key)
        revision = moved  # a restatement (or an operator) moved the pointer between the two reads: follow it
    else:
        raise CurrentRevisionUnreadable(
            f"{logical_key}: its pointer moved {_ROUNDS} times while it was read; read it again",
            logical_key=logical_key,
        )
    at = target.at_revision(revision, place_of_location(seen.location))
    payload = destination.read_data(at, seen.manifest)
    # Read a second time after the verdict: what is returned is what was checked.
    if hashlib.sha256(payload).hexdigest() != seen.manifest.sha256:
        raise CurrentRevisionUnreadable(
            f"{logical_key}: the data of revision {revision} at {seen.location} does not match the sha256 its "
            f"manifest records ({seen.manifest.sha256})",
            logical_key=logical_key,
        )
    file_format = "parquet" if seen.manifest.data_file.endswith(".parquet") else "csv"
    return revision, read_arrow(payload, destination.data_format(file_format), schema)


def _frame(tables: list[pa.Table], schema: ExportSchema | None) -> pd.DataFrame:
    if tables:
        return pa.concat_tables(tables, promote_options="permissive").to_pandas()
    if schema is not None:
        return schema.arrow_schema().empty_table().to_pandas()
    return pd.DataFrame()


def _export_and_destination(
    spec_or_destination: ExportSpec | Destination, export: ExportSpec | str | None, timezone: str | None
) -> tuple[ExportSpec | None, Destination]:
    """The export's spec (None: known by name alone) and the destination to read."""
    if isinstance(spec_or_destination, ExportSpec):
        if export is not None or timezone is not None:
            raise ConfigurationError("export= and timezone= go with a destination; a spec names its own")
        return spec_or_destination, _destination_of(spec_or_destination)
    if not isinstance(spec_or_destination, Destination):
        raise ConfigurationError(
            f"read_current reads an ExportSpec or a Destination, got {type(spec_or_destination).__name__}"
        )
    if isinstance(export, ExportSpec):
        if timezone is not None:
            raise ConfigurationError(
                f"timezone= goes with an export's name; export {export.name!r}'s spec names its own"
            )
        return export, spec_or_destination
    if export is None:
        raise ConfigurationError(
            "a destination holds many exports: name the one to read (export=spec, or export=NAME with timezone=ZONE)"
        )
    validate_slug(export, "export name")
    if timezone is None:
        raise ConfigurationError(f"export {export!r} by name needs timezone=: the zone of its business dates")
    load_zone(timezone)
    return None, spec_or_destination


def _destination_of(spec: ExportSpec) -> Destination:
    """The destination ``spec`` declares (its scheme's settings, such as credentials, from the environment, as the
    CLI reads them). A spec without one is refused: a reader never guesses where a partner's export is from
    ``EXPORTS_DESTINATION`` or the working directory (a wrong guess reads as every key missing)."""
    if not spec.destination:
        raise ConfigurationError(
            f"export {spec.name!r} declares no destination of its own, and read_current does not guess one (not "
            f"{DESTINATION_ENV}, not ./var/exports): pass the destination its keys are published to, with the spec: "
            "read_current(LocalDestination(FOLDER), start, end, export=spec), or read_current(destination_from(SPEC, "
            "ledger_url=..., environ=os.environ), start, end, export=spec)"
        )
    environ = os.environ
    destination = destination_from(
        spec.destination,
        ledger_url=ledger_url_from(environ.get(LEDGER_URL_ENV) or ""),
        environ=environ,
        what=f"destination of export {spec.name}",
    )
    if destination.kind == "ledger-table" and not environ.get(LEDGER_URL_ENV):
        # Its rows are in the ledger's database: named, never the working directory's ./var/ledger.sqlite3.
        raise ConfigurationError(
            f"export {spec.name!r} is published to a ledger table, in the database {LEDGER_URL_ENV} names, and "
            f"{LEDGER_URL_ENV} is not set: set it, or pass read_current(SqlTableDestination(url=..., table=...), "
            "start, end, export=spec)"
        )
    return destination


def _day(value: object, name: str) -> dt.date:
    """A business date: a ``datetime.date`` or ``YYYY-MM-DD``; a datetime is refused."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise CalendarError(
                f"{name} must be a business date, got the naive datetime {value.isoformat()}: a date of the export's "
                "zone is a day, not a time"
            )
        raise CalendarError(
            f"{name} must be a business date, got the datetime {value.isoformat()}: pass its date in the export's "
            "zone (an instant is a different day in different zones)"
        )
    if isinstance(value, dt.date):
        return value
    if isinstance(value, str):
        return parse_business_date(value)
    raise CalendarError(f"{name} must be a business date (datetime.date or YYYY-MM-DD), got {type(value).__name__}")


def _tenants(tenants: Sequence[str] | None, spec: ExportSpec | None) -> tuple[str, ...]:
    if tenants is None:
        if spec is None:
            raise ConfigurationError(
                "tenants= is needed with an export's name: a destination cannot list its tenants without walking "
                "every object of the export"
            )
        return tuple(spec.tenants)
    if isinstance(tenants, str):
        raise ConfigurationError(f"tenants must be a list of tenant ids, got the text {tenants!r}")
    wanted = tuple(validate_slug(tenant, "tenant id") for tenant in tenants)
    if len(set(wanted)) != len(wanted):
        raise ConfigurationError(f"duplicate tenant ids in {list(wanted)}")
    if spec is not None:
        unknown = [tenant for tenant in wanted if tenant not in spec.tenants]
        if unknown:
            raise ConfigurationError(f"export {spec.name!r} has no tenant {', '.join(unknown)}")
    return wanted


__all__ = ["MAX_DAYS", "CurrentRevisionUnreadable", "read_current"]
