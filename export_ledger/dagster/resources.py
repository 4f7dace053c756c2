"""Dagster resources: configuration in, plain export_ledger objects out (a ledger, a destination).

Settings that may hold secrets are given as Dagster ``EnvVar``s by :func:`export_ledger.dagster.ledgered_definitions`,
so the UI and run config show variable names, never values: Dagster shows every resource's configured values in its
UI (GraphQL ``configuredValues``). A secret that cannot be given by name is refused (:func:`secret_by_name`).
"""

import datetime as dt
import os
import re
from abc import abstractmethod
from collections.abc import Mapping, Sequence

import dagster as dg
import pydantic

from export_ledger.destinations import Destination, destination_from
from export_ledger.destinations.registry import Setting, refuse_credentials, scheme_of, scheme_taking
from export_ledger.errors import ConfigurationError
from export_ledger.ledger import ExportLedger
from export_ledger.ledger.urls import holds_secret, may_hold_secret
from export_ledger.settings import LEDGER_URL_ENV
from export_ledger.sources import ExportSource, ResolvableSource, UnusableSource
from export_ledger.spec import ExportSpec

#: The resource key of the ledger, shared by every export of a code location.
LEDGER_KEY = "ledger"


def resource_keys(spec: ExportSpec) -> tuple[str, str]:
    """The resource keys of an export's destination and I/O manager."""
    return f"{spec.name}__destination", f"{spec.name}__io_manager"


def source_key(spec: ExportSpec) -> str:
    """The resource key of an export's source, when it is declared as a :class:`SourceResource`."""
    return f"{spec.name}__source"


def is_secret(setting: Setting, value: object) -> bool:
    """Whether a destination setting's value is a secret: one its scheme declares secret (a key, a token), or a
    ``*_url`` setting (an endpoint) whose URL carries a password, a user part (a token: ``https://t0ken@minio:9000``)
    or a query, as the OpenLineage URL is judged."""
    if not value or not isinstance(value, str):
        return False
    return setting.secret or (setting.name.endswith("_url") and may_hold_secret(value))


def secret_by_name(value: str, variables: str | Sequence[str], refusal: str) -> dg.EnvVar:
    """A secret as Dagster gets it: ``EnvVar(variable)`` of the first of ``variables`` under which the code
    location's process environment holds this very value (a run worker then reads it there too), so the UI shows the
    name, never the value.

    Raises:
        ConfigurationError: the process environment holds it under none of them; the message (``refusal`` and what
            to do) names the setting and the variables, never the value.
    """
    names = (variables,) if isinstance(variables, str) else tuple(variables)
    for variable in names:
        if os.environ.get(variable) == value:
            return dg.EnvVar(variable)
    first, others = names[0], names[1:]
    passed = "EnvVar of that variable" if others else f"EnvVar({first!r})"
    raise ConfigurationError(
        f"{refusal}, and given as a value it would be shown in the Dagster UI's resource config. Give it by name: set "
        f"{' or '.join(names)} to it in the code location's environment, and it is passed to Dagster as {passed}"
    )


_SECRET_HELD = "holds a secret (a password, or a parameter named like one)"
_ENDPOINT_SECRET_HELD = "may hold a secret (a password, a user part, or a query)"


def url_field(url: str, variable: str, *, by_name: bool = False, endpoint: bool = False) -> str | dg.EnvVar:
    """A URL setting read from ``variable``, as a resource's field takes it: ``EnvVar(variable)`` when ``by_name``
    (it was read from the process environment) or when the process environment holds this very value there, so the
    UI shows the name; the URL itself when it carries no secret; refused when it carries one that the process
    environment does not hold, since the UI would show it.

    A database (SQLAlchemy) URL carries a secret in a password (``user:password@``) or a parameter named like one
    (``?password=``, ``?sslkey=``); its user name is none. With ``endpoint`` (an HTTP API, an object store's
    endpoint) a user part alone (a token written as the user: ``https://t0ken@host``) or any query counts as one too.

    For a code location that reads its settings from a mapping (a test, a wrapper passing ``environ``):

    >>> fields["url"] = url_field(environ.get("EXPORTS_SOURCE_URL", ""), "EXPORTS_SOURCE_URL")  # doctest: +SKIP

    Raises:
        ConfigurationError: the URL carries a secret and cannot go by name; the message names ``variable``, never the
            value.
    """
    if url and (by_name or os.environ.get(variable) == url):
        return dg.EnvVar(variable)
    if url and (may_hold_secret(url) if endpoint else holds_secret(url)):
        held = _ENDPOINT_SECRET_HELD if endpoint else _SECRET_HELD
        return secret_by_name(url, variable, f"{variable} (read from the environ mapping) {held}")
    return url


class LedgerResource(dg.ConfigurableResource):
    """Where the ledger lives and how long a claim's lease lasts.

    Attributes:
        url: SQLAlchemy URL, or a plain path for a SQLite file (the default, ``./var/ledger.sqlite3``); PostgreSQL as
            ``postgresql+psycopg2://...`` (a plain ``postgresql://`` is opened with the installed driver).
        lease_ttl_seconds: How long one attempt keeps a key to itself without a result. Longer than the slowest
            single export, shorter than the time an operator will wait before retrying a crashed run.
        allow_below_low_water: Allow first claims below the retention low-water mark (an explicit override).
    """

    url: str
    lease_ttl_seconds: int = 900
    allow_below_low_water: bool = False

    def clock(self) -> dt.datetime | None:
        """A test's clock; None in production: the ledger's own (the PostgreSQL server's, the host's on SQLite).
        Tests subclass this resource to return a controlled time."""
        return None

    def get_ledger(self) -> ExportLedger:
        if self.lease_ttl_seconds <= 0:
            raise ValueError(f"lease_ttl_seconds must be positive, got {self.lease_ttl_seconds}")
        return ExportLedger(
            self.url,
            lease_ttl=dt.timedelta(seconds=self.lease_ttl_seconds),
            clock=self.clock if self.clock() is not None else None,
            allow_below_low_water=self.allow_below_low_water,
        )


class DestinationResource(dg.ConfigurableResource):
    """Where exports go, by spec: a folder, ``s3://bucket/prefix``, ``gs://``, ``az://``, ``delta:`` or
    ``ledger-table:<table>``, and the settings the spec's scheme declares.

    Attributes:
        spec: The destination spec (``EXPORTS_DESTINATION``).
        ledger_url: The ledger's URL (a ``ledger-table:`` destination lives in the ledger's database).
        settings: The destination's settings by name, as text (``{"endpoint_url": ..., "secret_access_key":
            dg.EnvVar("AWS_SECRET_ACCESS_KEY"), "read_timeout_seconds": "60"}``): each one the spec's scheme declares
            (:class:`export_ledger.destinations.registry.Setting`), parsed by its declaration; a secret as ``EnvVar``,
            so the UI shows its variable's name. A setting left out takes its default (None: the store's own lookup,
            such as boto3's).

    Example:
        >>> DestinationResource(spec="s3://bucket/exports", settings={"region_name": "eu-west-1"})  # doctest: +SKIP
    """

    # A refused value may be a secret: pydantic's message then leaves out what it was given.
    model_config = pydantic.ConfigDict(hide_input_in_errors=True)

    spec: str
    ledger_url: str = ""
    settings: dict[str, str] = {}

    @pydantic.model_validator(mode="before")
    @classmethod
    def _settings_declared_by_the_specs_scheme(cls, given: object) -> object:
        """A mistyped setting, or a spec no destination takes, fails the code location's load, not each run and
        sensor tick. Only the keys are checked: they survive Dagster's resolution of the resource, while a value may
        still be an ``EnvVar``'s name. A spec given as ``EnvVar`` is checked when a run resolves it (it is seen here
        before pydantic makes it a plain str, which would pass its variable's name for the spec)."""
        spec = given.get("spec") if isinstance(given, Mapping) else None
        settings = given.get("settings") if isinstance(given, Mapping) else None
        if isinstance(spec, str) and not isinstance(spec, dg.EnvVar) and spec.strip() and isinstance(settings, Mapping):
            what = "the destination resource"
            scheme_taking(spec, what).refuse_undeclared(settings, what)
        return given

    def get_destination(self) -> Destination:
        return destination_from(
            self.spec, ledger_url=self.ledger_url, settings=self.settings, what="the destination resource"
        )

    @classmethod
    def of(
        cls, destination: Destination, *, what: str = "destination", ledger_variable: str = LEDGER_URL_ENV
    ) -> "DestinationResource":
        """The resource for a destination built in Python: its spec and the settings its scheme declares, as text
        (those at their default left out). Its secrets reach Dagster by name: each secret setting
        (``secret_access_key``, ``azure_account_key``, an endpoint or table URL with a password, ...) becomes
        ``EnvVar`` of the variable its declaration reads (``AWS_SECRET_ACCESS_KEY``, ...; a table destination's URL:
        the ledger's, ``ledger_variable``) when the process environment holds that very value there.

        Raises:
            ConfigurationError: naming ``what`` and the setting: the spec carries a credential, or a secret setting
                holds a value the process environment does not.
        """
        spec, values = destination.spec()
        refuse_credentials(spec, what)
        scheme, kind = scheme_of(spec), type(destination).__name__
        settings = {}
        for name, value in values.items():
            setting = scheme.setting(name)
            if setting is None:
                raise ConfigurationError(f"{what}: the {kind}'s setting {name} is none its scheme ({scheme.example}) "
                                         "declares")  # fmt: skip
            if value is None or value == setting.default:
                continue
            if is_secret(setting, value):
                if not setting.env:
                    raise ConfigurationError(
                        f"{what}: the {kind}'s {name} is a secret, and given as a value it would be shown in the "
                        f"Dagster UI's resource config; {scheme.example} reads it from no environment variable"
                    )
                value = secret_by_name(value, setting.env, f"{what}: the {kind}'s {name} is a secret")
            settings[name] = value if isinstance(value, str) else str(value)  # an EnvVar is a str
        ledger_url = getattr(destination, "url", "")
        if isinstance(ledger_url, str) and ledger_url and holds_secret(ledger_url):
            ledger_url = secret_by_name(
                ledger_url, ledger_variable, f"{what}: the {kind}'s url (the ledger_url setting) holds a password"
            )
        return cls(spec=spec, ledger_url=ledger_url, settings=settings)


class SourceResource(dg.ConfigurableResource, ResolvableSource):
    """An export's source as a Dagster resource: its settings are the resource's fields, a secret among them given as
    ``dg.EnvVar`` (the UI's resource config then shows the variable's name, never its value).

    Declared as an :class:`~export_ledger.spec.ExportSpec`'s ``source``, it is a resource of the code location
    (key :func:`source_key`), and each use gets the source from it as Dagster resolved it there: the export's step in
    its run worker, the drift sensor at each tick, the CLI through ``dg.build_resources`` (``-f``/``-m``/``-w``).
    A setting that use lacks makes the source an :class:`~export_ledger.sources.UnusableSource` there alone: a run
    fails naming it before anything is claimed, and the code location still loads. Subclasses implement
    :meth:`get_source`; :meth:`problem` may say at load what is wrong with the fields as given.

    An ``EnvVar`` field whose variable a process lacks is refused by Dagster itself, when it resolves the resource:
    every run of the export's asset (its check-only runs too: they are the same step) fails on its config, naming the
    variable. The drift sensor's tick and the CLI resolve it themselves (:func:`built_spec`): that export alone is
    not checked there, saying which variable is missing. To fail only the runs
    that read the source, and in their step, leave the field empty where the variable is unset when the location
    loads and say so in :meth:`problem` (the reference location's ``InvoiceSourceResource`` and the Component's SQL
    source do this).

    Example:
        >>> class OrdersSource(SourceResource):  # doctest: +SKIP
        ...     url: str
        ...     def get_source(self, spec):
        ...         return SqlSource(url=self.url, query="SELECT ... WHERE tenant = :tenant AND ...")
        >>> ExportSpec(name="orders", source=OrdersSource(url=dg.EnvVar("ORDERS_DB_URL")), ...)  # doctest: +SKIP
    """

    @abstractmethod
    def get_source(self, spec: ExportSpec) -> ExportSource:
        """The source the fields give for the export ``spec``, in this process.

        Raises:
            ConfigurationError: a field is missing or contradicts another, naming it, never its value.
        """

    def resolve(self, spec: ExportSpec) -> ExportSource:
        # Dagster resolves an EnvVar field into a new instance; on the declared one the field is the variable's name
        # (an EnvVar is a str), which would be read as the setting itself: a path, a table.
        unresolved = sorted(name for name, value in self.__dict__.items() if isinstance(value, dg.EnvVar))
        if unresolved:
            raise ConfigurationError(
                f"{type(self).__name__}'s {', '.join(unresolved)} not resolved: use the resource Dagster gives a run "
                "or a sensor (context.resources), or dg.build_resources, not the declared one"
            )
        return self.get_source(spec)


def resolved_spec(spec: ExportSpec, resource: ResolvableSource) -> ExportSpec:
    """``spec`` with its source resolved from ``resource`` (the export's :class:`SourceResource` as Dagster resolved it
    for this run, tick or command): an :class:`~export_ledger.sources.UnusableSource` naming the setting when the
    settings are missing or contradict each other here, or the source they give is refused (a ``ValueError`` or
    ``TypeError``, as :class:`~export_ledger.spec.ExportSpec` refuses a source given in code: a ``SqlSource`` query
    without its bound parameters)."""
    try:
        return spec.with_source(resource.resolve(spec))
    except (ConfigurationError, ValueError, TypeError) as exc:
        return spec.with_source(UnusableSource(f"the source cannot be used in this process: {exc}"))


_DAGSTER_PREFIX = re.compile(r"^[\w.]*Error:\s*")


def built_spec(spec: ExportSpec, resource: SourceResource | None = None) -> ExportSpec:
    """``spec`` with its source resolved here as a run would resolve it: ``resource`` (default the declared
    ``spec.source``) built by ``dg.build_resources``, its ``EnvVar`` fields read from this process's environment. Used
    where Dagster does not hand the resource over: the CLI, and the drift sensor's tick (per export, so one export's
    missing setting leaves the others checked). A setting this process lacks makes the source an
    :class:`~export_ledger.sources.UnusableSource` naming it (never a value)."""
    key = source_key(spec)
    try:
        with dg.build_resources({key: resource if resource is not None else spec.source}) as built:
            return resolved_spec(spec, getattr(built, key))
    except dg.DagsterInvalidConfigError as exc:  # an EnvVar this process lacks: Dagster's message names it
        said = next(
            # Dagster's line reads "dagster._config.errors.PostProcessingError: You have attempted to fetch the
            # environment variable ...": its exception class is not the operator's business.
            (_DAGSTER_PREFIX.sub("", line.strip()) for line in str(exc).splitlines() if "environment variable" in line),
            None,
        )
        # Other config errors may quote a value: only where (the field's path) and Dagster's kind of error are said.
        declared = resource if resource is not None else spec.source
        said = said or _config_refusal(key, exc, declared)
        return spec.with_source(UnusableSource(f"the source cannot be used in this process: {said}"))


def _config_refusal(key: str, exc: dg.DagsterInvalidConfigError, declared: object) -> str:
    """Which fields of resource ``key`` (``declared``) Dagster refused, and how (its reason's name), never a value: a
    field's path (a list's positions as ``[i]``; a map's keys, which may be data, left out), the variable a field
    declared as an ``EnvVar`` reads, or that the field is a resource the source depends on."""
    problems = []
    for error in getattr(exc, "errors", None) or ():
        path = []  # field names, and list positions as ints
        for entry in getattr(getattr(error, "stack", None), "entries", None) or ():
            if getattr(entry, "field_name", None) is not None:
                path.append(str(entry.field_name))
            elif isinstance(getattr(entry, "list_index", None), int):
                path.append(entry.list_index)
        nested = path[:1] == ["config"]  # Dagster's stack of a nested resource starts at that resource's own config
        own = path[:2] == [key, "config"]
        path = path[1:] if nested else path[2:] if own else path
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "its config"
        field = path[0] if own and path and isinstance(path[0], str) else None
        variable = getattr(getattr(declared, field, None), "env_var_name", None) if field else None
        if variable:
            where += f", read from {variable}"
        if nested:
            where = f"a resource it depends on: {where}"
        reason = getattr(getattr(error, "reason", None), "name", "INVALID")
        problems.append(f"{where} ({reason.lower().replace('_', ' ')})")
    if not problems:
        return f"its resource {key} is not valid config here"
    return f"its resource {key} is not valid config here: {', '.join(dict.fromkeys(problems))}"
