"""The operations behind ``export-ledger``: each command is one call here, and the CLI only renders what it returns
(as sqlite-utils' ``tables`` is ``db.table_names()``). Plain Python, no Dagster.

The decisions a command makes live here, not in :mod:`export_ledger.cli`: which destination an export is judged at,
which exports one reconciliation may judge, which asset and code location publish a partition, and what an unknown
key looks like. A code location (:class:`CodeLocation`) is loaded by :mod:`export_ledger.dagster.code_location`; an
operation given one uses its declared exports and destinations instead of guessing.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from export_ledger.calendar import ExportCalendar, ZoneMove
from export_ledger.destinations import Destination, destination_from
from export_ledger.drift import DriftReport, LookbackGap, beyond_lookback, drift_pass
from export_ledger.errors import ConfigurationError, ExportLedgerError
from export_ledger.ledger import ExportLedger, ExportRecord, ExportState, Restatement, RestatementRefused
from export_ledger.ledger.attention import Escalation
from export_ledger.ledger.contracts import Acceptance
from export_ledger.ledger.urls import holds_secret
from export_ledger.placement import DestinationMismatch, recorded_destinations
from export_ledger.reconcile import ReconcileReport, reconcile_batch
from export_ledger.restate import (
    DEFAULT_LOCATION,
    asset_name_for,
    asset_name_of_zone,
    materialize_command,
    records_of,
    request_for_date,
)
from export_ledger.settings import Settings
from export_ledger.sources import ResolvableSource, UnusableSource, readable
from export_ledger.spec import ExportSpec
from export_ledger.tenants import zone_slug

#: How a logical key is written (:class:`export_ledger.keys.LogicalKey`): the window's start in UTC, not the date.
KEY_FORM = "export/tenant/window start in UTC, e.g. invoice_export/acme/2026-03-08T05:00:00Z"
_DATE_KEY = re.compile(r"^([^/]+)/([^/]+)/(\d{4}-\d{2}-\d{2})$")


class UsageRefused(ExportLedgerError):
    """The command as asked cannot be carried out without more from the operator (the CLI exits 2)."""


@dataclass(frozen=True)
class CodeLocation:
    """A Dagster code location as the operator named it: its Dagster options, declared exports and destinations."""

    dagster_args: tuple[str, ...]  # e.g. ("-f", "shop.py") or ("-m", "shop.defs", "-a", "defs")
    specs: tuple[ExportSpec, ...]
    destinations: Mapping[str, Destination] = field(default_factory=dict)
    ledger_url: str | None = None  # its ledger resource's URL, resolved; None without one

    def spec(self, export: str) -> ExportSpec | None:
        return next((spec for spec in self.specs if spec.name == export), None)


@dataclass(frozen=True)
class Command:
    """A command to run, with a note where part of it is a guess."""

    text: str
    note: str = ""


# -- keys and exports ------------------------------------------------------------------------------------------------


def unknown_key_message(logical_key: str) -> str:
    """Why ``logical_key`` names nothing, with the form of a key (and the status command, for a key of a date)."""
    message = f"unknown logical key {logical_key!r}: the ledger has no export with it (a key is {KEY_FORM}"
    by_date = _DATE_KEY.fullmatch(logical_key)
    if by_date:
        export, tenant, day = by_date.groups()
        message += f"; export-ledger status --export {export} --tenant {tenant} --from {day} --to {day} shows it"
    return message + ")"


def require_key(ledger: ExportLedger, logical_key: str) -> ExportRecord:
    """The key's record; raises :class:`ExportLedgerError` naming the form of a key when the ledger has none."""
    record = ledger.queries.get(logical_key)
    if record is None:
        raise ExportLedgerError(unknown_key_message(logical_key))
    return record


def require_export(ledger: ExportLedger, export: str | None) -> None:
    """Refuses an export name the ledger has never seen, listing those it knows (a typo is not an empty result)."""
    if export is None:
        return
    known = ledger.queries.exports()
    if export not in known:
        listed = ", ".join(known) if known else "none yet"
        raise ExportLedgerError(f"the ledger knows no export named {export!r} (known: {listed})")


def require_tenant(ledger: ExportLedger, tenant: str | None, export: str | None = None) -> None:
    """Refuses a tenant id the ledger has never seen (of ``export`` when given), listing those it knows."""
    if tenant is None or ledger.queries.has_tenant(tenant, export=export):
        return
    known, more = ledger.queries.tenants(export=export)
    listed = ", ".join(known[:20]) + (", ..." if more or len(known) > 20 else "")
    scope = f" of export {export!r}" if export is not None else ""
    raise ExportLedgerError(f"the ledger knows no tenant {tenant!r}{scope} (known: {listed or 'none yet'})")


# -- destinations ----------------------------------------------------------------------------------------------------


def given_destination(given: str | None, *, settings: Settings, ledger_url: str) -> Destination | None:
    """The destination an operator named with ``--destination`` (built with its settings from the environment), or
    None."""
    if not given:
        return None
    return destination_from(given, ledger_url=ledger_url, environ=settings.environ, what="--destination")


def destination_for(
    export: str,
    *,
    settings: Settings,
    ledger_url: str,
    given: str | None = None,
    spec: ExportSpec | None = None,
    location: CodeLocation | None = None,
) -> Destination:
    """Where ``export`` is published: its own destination (declared on its spec), else ``given`` (``--destination``),
    else its code location's, else ``EXPORTS_DESTINATION`` (the settings). The sensors get the same answer from the
    code location's destination resources, which :func:`ledgered_definitions` built by this precedence."""
    spec = spec or (location.spec(export) if location is not None else None)
    own = spec.destination if spec is not None else None
    located = location.destinations.get(export) if location is not None else None
    if located is not None and (own or not given):
        return located
    if own:
        chosen, what = own, f"destination of export {export}"
    elif given:
        chosen, what = given, "--destination"
    else:
        chosen, what = settings.destination, "EXPORTS_DESTINATION"
    return destination_from(chosen, ledger_url=ledger_url, environ=settings.environ, what=what)


def key_destination(
    ledger: ExportLedger, record: ExportRecord, *, settings: Settings, given: str | None = None
) -> Destination:
    """Where ``record``'s export is: the destination its contract records (:func:`recorded_destinations`; ``given``,
    an operator's ``--destination``, must be that one). A key claimed before release 0.6 has none recorded: ``given``,
    else the settings' (``EXPORTS_DESTINATION``)."""
    named = given_destination(given, settings=settings, ledger_url=ledger.url)
    return recorded_destinations(
        ledger, [record], environ=settings.environ, given=named,
        fallback=lambda export: named or destination_for(export, settings=settings, ledger_url=ledger.url),
    )[record.logical_key]  # fmt: skip


# -- which asset publishes a partition -------------------------------------------------------------------------------


def asset_of(ledger: ExportLedger, record: ExportRecord, location: CodeLocation | None) -> tuple[str, str]:
    """The asset that exports ``record``'s partition, and a note when it is not certain (empty when it is).

    A code location that declares the export answers exactly (the tenant's zone on that date:
    :meth:`ExportSpec.group_of`); otherwise the ledger's best answer (:func:`export_ledger.restate.asset_name_for`).
    """
    spec = location.spec(record.export) if location is not None else None
    if spec is not None:
        try:
            return spec.group_of(record.tenant, record.business_date).asset_name, ""
        except KeyError:
            pass  # a tenant the code no longer declares: the ledger's answer below
    asset, certain = asset_name_for(ledger, record)
    if location is not None and spec is None:
        return asset, f"  (export {record.export} is not declared in {' '.join(location.dagster_args)})"
    if certain:
        return asset, ""
    other = f"{record.export}__{zone_slug(record.timezone)}" if asset == record.export else record.export
    return asset, f"  (a guess from the zones; the asset may be {other})"


def publish_commands(
    ledger: ExportLedger, records: Sequence[ExportRecord], location: CodeLocation | None
) -> list[Command]:
    """One ``dagster asset materialize`` per (asset, partition) of ``records``, in ``location`` (without one:
    :data:`export_ledger.restate.DEFAULT_LOCATION`, said so by the caller)."""
    dagster_args, program = location_args(location), dagster_program()
    commands: dict[str, str] = {}
    for record in records:
        asset, note = asset_of(ledger, record, location)
        commands[materialize_command(asset, record.business_date.isoformat(), dagster_args, program=program)] = note
    return [Command(text, note) for text, note in sorted(commands.items())]


def dagster_program(cwd: Path | None = None) -> str:
    """The ``dagster`` a printed command runs: the one installed beside this interpreter (the virtualenv of
    ``export-ledger`` itself). Written ``dagster`` when that is the one the shell's PATH finds; otherwise as its path,
    relative to the working directory when it lies below it (``.venv/bin/dagster``), so that a command pasted into a
    shell that never activated the virtualenv runs the same Dagster and code instead of failing or finding another.
    Looked up once per interpreter, PATH and working directory (a listing prints one per escalation)."""
    return _dagster_program(sys.executable, os.environ.get("PATH"), (cwd or Path.cwd()).absolute())


@functools.lru_cache(maxsize=8)
def _dagster_program(executable: str, path: str | None, cwd: Path) -> str:
    beside = Path(executable).parent / "dagster"
    if not beside.is_file():
        return "dagster"  # not a virtualenv's layout (or not installed beside it): the shell's own
    found = shutil.which("dagster", path=path)
    if found is not None and Path(found).absolute() == beside.absolute():
        return "dagster"
    try:
        relative = beside.absolute().relative_to(cwd)
    except ValueError:
        return str(beside.absolute())
    return str(relative) if len(relative.parts) > 1 else f"./{relative}"


def shell_problems(
    location: CodeLocation | None, exports: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> list[str]:
    """Why a printed ``dagster asset materialize`` would not do, in this shell, what the code location's own runs do
    (a run started by a pasted command reads its settings from the shell it is pasted in): no ``DAGSTER_HOME``, so
    its run would be recorded in a temporary instance the UI never shows; an export of ``location`` whose source this
    environment cannot read (:class:`~export_ledger.sources.UnusableSource`: its reason names the settings, never
    their values). Without a code location the source cannot be judged here; ``environ`` defaults to ``os.environ``."""
    env = os.environ if environ is None else environ
    problems = []
    if not (env.get("DAGSTER_HOME") or "").strip():
        problems.append(
            "DAGSTER_HOME is not set in this shell: a run started here would be recorded in a temporary Dagster "
            "instance that the UI never shows; set it to the UI's instance (and the settings its runs have) first"
        )
    specs = [location.spec(export) for export in dict.fromkeys(exports)] if location is not None else []
    problems += [spec.source.reason for spec in specs if spec is not None and isinstance(spec.source, UnusableSource)]
    return problems


def location_args(location: CodeLocation | None, cwd: Path | None = None) -> tuple[str, ...]:
    """The code location options a printed ``dagster`` command repeats: the operator's own (``-f``/``-m``), else
    ``-f definitions.py`` where that file exists in the working directory, else a placeholder to fill in (a printed
    command never names a file that is not there)."""
    if location is not None:
        return tuple(location.dagster_args)
    if ((cwd or Path.cwd()) / DEFAULT_LOCATION[1]).is_file():
        return DEFAULT_LOCATION
    return ("-f", "YOUR_DEFINITIONS.py")


def ways_out(
    ledger: ExportLedger,
    escalation: Escalation,
    location: CodeLocation | None,
    *,
    ledger_url: str | None = None,
    assets: dict | None = None,
) -> list[str]:
    """The way out of ``escalation`` as lines to paste into a shell: commands, and ``#`` notes where a choice or a
    guess is the operator's. Each ``--reason`` is left without its text, so a command pasted unread is refused until
    the reason is written. ``ledger_url``: the ``--ledger-url`` the operator gave, repeated (unless it holds a
    password). ``assets``: a memo of each (export, zone)'s asset, shared by the escalations of one listing. The same
    policy for the CLI and anything else that shows escalations; a refused contract's command is in its ``why``."""
    e, where = escalation, location_args(location)
    ledger_args, notes = [], []
    if ledger_url is not None:
        if holds_secret(ledger_url):
            notes.append("# add --ledger-url as you gave it (not repeated here: it holds a password)")
        else:
            ledger_args = ["--ledger-url", ledger_url]
    key, day = e.logical_key, e.business_date or (e.record.business_date if e.record is not None else None)
    rerun = []
    if day is not None:
        asset, guess = _asset_of_zone(ledger, e.export, e.timezone, location, {} if assets is None else assets)
        command = materialize_command(asset, day.isoformat(), where, program=dagster_program())
        rerun = [*([guess] if guess else []), command]

    def cli(*words: str) -> str:  # the reason last, its text left to write
        return shlex.join(["export-ledger", *words, *ledger_args, "--reason"])

    def reconcile() -> str:
        named = list(location.dagster_args) if location is not None else []
        return shlex.join(["export-ledger", "reconcile", "--export", e.export, *named, *ledger_args])

    resolve = [cli("resolve", key, f"--{way}-destination") for way in ("accept", "discard")]
    if e.state == ExportState.CONFLICT.value:
        lines = ["# one of:", *resolve]
    elif e.state == ExportState.IN_PROGRESS.value:  # abandoned: the reconciler judges it from the destination
        lines = [reconcile()]
    elif e.state == ExportState.REMOTE_UNKNOWN.value:  # and where the destination cannot tell, a person decides
        lines = [reconcile(), "# if it stays remote_unknown, one of:", *resolve]
    elif e.state == "restating":
        lines = [*rerun, "# or, to give the restatement up:", cli("restate", "--withdraw", key)]
    elif e.state in (ExportState.FAILED.value, "never claimed", "late"):
        lines = rerun
    else:
        lines = []
    return [*notes, *lines] if lines else []


def _asset_of_zone(
    ledger: ExportLedger, export: str, zone: str | None, location: CodeLocation | None, memo: dict
) -> tuple[str, str]:
    """The asset of ``export``'s partitions in ``zone``, and a ``#`` note when it is a guess: the code location's
    answer when it declares the export, else the asset a completed key of that zone was exported by, else a guess
    from the zones the contracts name. Memoized per (export, zone) in ``memo``."""
    if (export, zone) not in memo:
        spec = location.spec(export) if location is not None else None
        group = spec.group_of_zone(zone) if spec is not None and zone is not None else None
        if group is not None:
            memo[export, zone] = (group.asset_name, "")
        elif zone is None:
            memo[export, zone] = (export, "")
        else:
            asset, certain = asset_name_of_zone(ledger, export, zone)
            other = f"{export}__{zone_slug(zone)}" if asset == export else export
            guess = "" if certain else f"# the asset is a guess from the zones (or {other}); -f or -m names it"
            memo[export, zone] = (asset, guess)
    return memo[export, zone]


# -- reconcile -------------------------------------------------------------------------------------------------------


@dataclass
class Reconciled:
    """What one ``reconcile`` did: the pass's report (None: nothing to reconcile) and the reruns to launch."""

    report: ReconcileReport | None
    reruns: list[Command] = field(default_factory=list)


def reconcile_once(
    ledger: ExportLedger,
    *,
    settings: Settings,
    limit: int,
    export: str | None = None,
    destination: str | None = None,
    location: CodeLocation | None = None,
    reconciler: str = "export-ledger reconcile",
) -> Reconciled:
    """Reconciles the stuck keys of one export, of every export ``location`` declares, or of every export the
    ledger knows, once, as a tick of the reconciliation sensor does.

    Each key is judged at the destination its contract records (:func:`recorded_destinations`): the operator names
    none. ``destination`` (``--destination``), when given, must be that one, or the command is refused
    (:class:`DestinationMismatch`) before any key is held. A key claimed before release 0.6 has no recorded
    destination: ``destination``, the code location's or ``EXPORTS_DESTINATION`` answers for it, and only when the
    pass is about one export (a key published elsewhere would be judged absent: :class:`UsageRefused`).
    """
    require_export(ledger, export)
    if export is not None:
        exports = [export]
    elif location is not None:
        exports = [spec.name for spec in location.specs]
    else:
        exports = ledger.queries.exports()
    if not exports:
        return Reconciled(None)
    named = given_destination(destination, settings=settings, ledger_url=ledger.url)
    known = dict(location.destinations) if location is not None else {}

    def legacy(name: str) -> Destination:  # a key claimed before its ledger recorded destinations
        if len(exports) > 1 and location is None:
            raise UsageRefused(
                f"export {name} has stuck keys claimed before its ledger recorded destinations (release 0.6): "
                "reconcile it on its own with --export E (and its --destination), or name the code location with -f "
                "FILE or -m MODULE"
            )
        if named is not None:
            return named
        return destination_for(name, settings=settings, ledger_url=ledger.url, location=location)

    def placed(records: Sequence[ExportRecord]) -> dict[str, Destination]:
        return recorded_destinations(
            ledger, records, environ=settings.environ, known=known, given=named, fallback=legacy
        )

    report = reconcile_batch(ledger, placed, limit=limit, after=None, reconciler=reconciler, exports=exports)
    failed = [record for _, record in report.resolved if record.state is ExportState.FAILED]
    return Reconciled(report, publish_commands(ledger, failed, location))


# -- restate ---------------------------------------------------------------------------------------------------------


@dataclass
class Restated:
    """The requests one ``restate`` recorded, the keys refused with why, and the commands that publish them."""

    requested: list[Restatement]
    refused: list[tuple[str, str]]
    commands: list[Command]


def restate(
    ledger: ExportLedger,
    *,
    reason: str,
    requested_by: str,
    logical_key: str | None = None,
    export: str | None = None,
    business_date: dt.date | None = None,
    tenant: str | None = None,
    location: CodeLocation | None = None,
) -> Restated:
    """Records a request for one key, or for every completed key of ``export`` on ``business_date`` (one tenant's).

    Raises:
        RestatementRefused: the ledger refused every key (its why for the first), or there is no reason.
        ExportLedgerError: the key or the export is unknown.
    """
    if logical_key is not None:
        require_key(ledger, logical_key)
        requested = [ledger.restatements.request(logical_key, reason=reason, requested_by=requested_by)]
        refused: list[tuple[str, str]] = []
    else:
        require_export(ledger, export)
        report = request_for_date(
            ledger, export, business_date, reason=reason, requested_by=requested_by, tenants=[tenant] if tenant else []
        )
        requested, refused = report.requested, report.refused
        if not requested:
            _, why = refused[0]
            more = f" ({len(refused) - 1} more key(s) refused too)" if len(refused) > 1 else ""
            raise RestatementRefused(f"{why}{more}")
    records = records_of(ledger, requested)
    return Restated(requested, refused, publish_commands(ledger, [records[r.logical_key] for r in requested], location))


# -- accept-contract -------------------------------------------------------------------------------------------------


def declared_calendar(
    timezone: str | None, start_date: dt.date | str | None, moves: Sequence[ZoneMove] = ()
) -> Mapping | None:
    """The calendar contract an operator declares by hand (a zone, a start date and earlier zones), or None when they
    declare none.

    Raises:
        UsageRefused: half a calendar (a zone without a start date, or moves without a zone), or one that is not a
            calendar (an unknown zone, say).
    """
    if (timezone is None) != (start_date is None) or (moves and timezone is None):
        raise UsageRefused("--timezone and --start-date go together (with --move): they declare a calendar")
    if timezone is None:
        return None
    start = start_date if isinstance(start_date, str) else start_date.isoformat()
    try:
        return ExportCalendar(timezone=timezone, start_date=start, moves=tuple(moves)).contract()
    except ExportLedgerError as exc:
        raise UsageRefused(str(exc)) from None


def accept_contract(
    ledger: ExportLedger,
    export: str,
    *,
    reason: str,
    operator: str,
    tenant: str | None = None,
    exported: str | None = None,
    timezone: str | None = None,
    start_date: dt.date | None = None,
    moves: Sequence[ZoneMove] = (),
) -> Acceptance:
    """Accepts the contract each open refusal of ``export`` (``tenant``'s) names, or the calendar declared by
    ``timezone``, ``start_date`` and ``moves`` (the terms in force kept); with ``exported="restate"`` the restatement
    of every key already exported is requested in the same transaction
    (:meth:`~export_ledger.ledger.contracts.Contracts.accept_refused`).

    Raises:
        UsageRefused: half a calendar (a zone without a start date, or moves without a zone), a calendar that is not
            one, or an export-wide calendar for an export whose tenants are in other zones.
        ValueError, ContractChanged, LedgerError: as the ledger's acceptance says.
    """
    require_export(ledger, export)
    calendar = declared_calendar(timezone, start_date, moves)
    if calendar is None:
        return ledger.contracts.accept_refused(export, reason, tenant=tenant, operator=operator, exported=exported)
    if tenant is None:
        zone = calendar.get("timezone")
        elsewhere = sorted(t for t, c in ledger.contracts.tenant_contracts(export).items() if c["timezone"] != zone)
        if elsewhere:
            raise UsageRefused(
                f"{export} has tenants in other zones than {zone} ({', '.join(elsewhere[:5])}"
                f"{', ...' if len(elsewhere) > 5 else ''}): accept per tenant with --tenant"
            )
    return ledger.contracts.accept(export, calendar, reason, tenant=tenant, operator=operator, exported=exported)


# -- drift -----------------------------------------------------------------------------------------------------------


@dataclass
class Drifted:
    """One ``drift`` pass: its report, the exports without a source to read again, and the keys the lookback left."""

    report: DriftReport
    without_source: list[str]
    beyond: LookbackGap
    #: Whether an export's source cannot be used in this process (its keys were left unchecked too).
    unusable: bool = False

    @property
    def unresolved(self) -> bool:
        """Keys left unchecked: by the pass, or because their export's source cannot be used here. A declared
        asset's rows, never a source of their own, do not count: there is nothing to read again, by design."""
        return bool(self.report.unchecked) or self.unusable


def drift_once(
    ledger: ExportLedger,
    specs: Sequence[ExportSpec],
    *,
    settings: Settings,
    lookback_days: int,
    limit: int,
    requested_by: str,
    export: str | None = None,
    destination: str | None = None,
    location: CodeLocation | None = None,
) -> Drifted:
    """One pass of drift detection over ``specs`` (``export``'s only), each at its destination
    (:func:`destination_for`), and the count of completed keys older than the lookback, which it did not check."""
    if export is not None:
        specs = [spec for spec in specs if spec.name == export]
        if not specs:
            raise UsageRefused(f"--export {export}: not among the declared exports")
    destinations = {
        spec.name: destination_for(
            spec.name, settings=settings, ledger_url=ledger.url, given=destination, spec=spec, location=location
        )
        for spec in specs
    }
    now = ledger.now()
    report = drift_pass(
        ledger, specs, destinations, lookback_days=lookback_days, limit=limit, now=now, requested_by=requested_by
    )
    # An export whose source this process cannot use is named with the reason (settings, never values).
    without = [
        f"{spec.name} ({spec.source.reason})" if isinstance(spec.source, UnusableSource) else spec.name
        for spec in specs
        if not readable(spec.source)
    ]
    unusable = any(isinstance(spec.source, UnusableSource) for spec in specs)
    return Drifted(report, without, beyond_lookback(ledger, specs, lookback_days=lookback_days, now=now), unusable)


def load_specs(references: Sequence[str]) -> list[ExportSpec]:
    """The declared exports that ``module:attribute`` references name (each an ExportSpec or a list of them), the
    working directory importable as ``python -m`` makes it.

    Raises:
        UsageRefused: a reference that is not ``module:attribute``, names nothing, names a Definitions (a code location
            is named with -f/-m) or something other than ExportSpecs, or an export declared twice.

    An export whose source is a :class:`~export_ledger.sources.ResolvableSource` (a Dagster ``SourceResource``) is
    returned with an :class:`~export_ledger.sources.UnusableSource` naming -f/-m: its code location resolves it.
        ConfigurationError: a module that cannot be imported.
    """
    import importlib

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    specs: list[ExportSpec] = []
    for reference in references:
        module_name, _, attribute = reference.partition(":")
        if not module_name or not attribute:
            raise UsageRefused(
                f"--specs {reference!r}: expected module:attribute, e.g. examples.shop_definitions:orders"
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise ConfigurationError(
                f"--specs {reference!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
            ) from None
        if not hasattr(module, attribute):
            raise UsageRefused(f"--specs {reference!r}: module {module_name} has no attribute {attribute!r}")
        value = getattr(module, attribute)
        if type(value).__name__ == "Definitions":  # a code location (a @record, a tuple that refuses iteration)
            raise UsageRefused(
                f"--specs {reference!r} is a Definitions: name a code location with -f FILE or -m MODULE "
                f"[-a ATTRIBUTE] instead (e.g. -m {module_name} -a {attribute})"
            )
        found = [value] if isinstance(value, ExportSpec) else list(value) if isinstance(value, list | tuple) else None
        if found is None or not all(isinstance(item, ExportSpec) for item in found):
            raise UsageRefused(
                f"--specs {reference!r} is a {type(value).__name__}; expected an ExportSpec or a list of them"
            )
        specs.extend(found)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise UsageRefused(f"--specs declares an export twice: {sorted({n for n in names if names.count(n) > 1})}")
    # A source declared as settings resolved where it is used (a Dagster SourceResource) is resolved by its code
    # location, which --specs does not name: unusable here, saying how to name it, so the command exits 1.
    return [
        spec.with_source(
            UnusableSource(
                f"its source is {type(spec.source).__name__}, settings a code location resolves: name the location "
                "with -f FILE or -m MODULE instead of --specs"
            )
        )
        if isinstance(spec.source, ResolvableSource)
        else spec
        for spec in specs
    ]


__all__ = [
    "KEY_FORM",
    "CodeLocation",
    "Command",
    "DestinationMismatch",
    "Drifted",
    "Reconciled",
    "Restated",
    "UsageRefused",
    "accept_contract",
    "asset_of",
    "destination_for",
    "key_destination",
    "declared_calendar",
    "drift_once",
    "load_specs",
    "publish_commands",
    "shell_problems",
    "dagster_program",
    "recorded_destinations",
    "reconcile_once",
    "require_export",
    "require_key",
    "restate",
    "unknown_key_message",
]
