"""``LedgeredExports``: a Dagster Component that declares ledgered exports in a ``defs.yaml``, with no Python.

The YAML attributes are :class:`~export_ledger.spec.ExportSpec`'s fields (the source a :class:`SqlSource` whose URL
comes from a named environment variable, declared as a resource that each run resolves: :class:`SqlSourceResource`),
plus the code location's ledger and default destination. Each export is
checked by ``ExportSpec`` itself while the YAML is resolved, so a bad value fails with the file, the line and the
export it belongs to; :meth:`LedgeredExports.build_defs` is :func:`~export_ledger.dagster.ledgered_definitions`.

Example (``src/shop/defs/exports/defs.yaml``, made by ``dg scaffold defs export_ledger.dagster.LedgeredExports
exports``):

.. code-block:: yaml

    type: export_ledger.dagster.LedgeredExports
    attributes:
      exports:
        - name: orders
          source:
            url_env: SHOP_DATABASE_URL
            query: SELECT * FROM orders WHERE tenant = :tenant AND placed_at >= :start AND placed_at < :end
          columns: {order_id: string, tenant: string, placed_at: timestamp, total: float}
          id_columns: [order_id]
          time_column: placed_at
          tenant_column: tenant
          tenants: [acme]
          timezone: America/New_York
          start_date: "2026-01-01"
"""

# No ``from __future__ import annotations``: Dagster derives the YAML schema from the evaluated annotations.
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import dagster as dg

# Dagster's own error for a failed resolution: raised as it is, it is shown without the YAML snippet that Dagster
# adds to any other error (the snippet would quote a credential). The class has no public alias in dagster 1.13.
from dagster.components.resolved.errors import ResolutionException

from export_ledger.dagster.definitions import ledgered_definitions
from export_ledger.dagster.resources import LedgerResource, SourceResource
from export_ledger.destinations.registry import holds_credential, refuse_credentials
from export_ledger.errors import ConfigurationError, ExportLedgerError
from export_ledger.settings import Settings
from export_ledger.sources import SqlSource, check_query
from export_ledger.spec import ExportSpec

_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ExportSpec) if f.default is not dataclasses.MISSING}


def _spec_default(name: str) -> Any:
    """ExportSpec's own default for a field: the YAML schema shows it, and it is written in one place."""
    return _SPEC_DEFAULTS[name]


@dataclass(frozen=True, repr=False)
class EnvSqlSource(SqlSource):
    """A :class:`SqlSource` whose URL was read from the environment variable ``url_env``.

    Its repr names the variable, never the URL (a URL may hold a password): Dagster and error messages may print a
    component and its exports.
    """

    url_env: str = ""

    def __repr__(self) -> str:
        return f"EnvSqlSource(url_env={self.url_env!r}, query={self.query!r})"


class SqlSourceModel(dg.Model):
    """An export's rows from SQL: ``query`` binds ``:tenant``, ``:start`` and ``:end`` (see :class:`SqlSource`).

    Attributes:
        url_env: The environment variable holding the database's SQLAlchemy URL (a secret: never in the YAML).
        query: The query, filtering ``time >= :start AND time < :end`` itself.
    """

    url_env: str
    query: str


class ExportModel(dg.Model):
    """One export in YAML: :class:`~export_ledger.spec.ExportSpec`'s fields, documented there."""

    name: str
    source: SqlSourceModel
    columns: dict[str, str]
    id_columns: list[str]
    time_column: str
    tenants: list[str] | dict[str, str | None]
    timezone: str
    start_date: str
    schedule_time: str | None = _spec_default("schedule_time")
    tenant_column: str | None = _spec_default("tenant_column")
    order_by: list[str] = list(_spec_default("order_by"))
    nullable: list[str] = list(_spec_default("nullable"))
    file_format: str = _spec_default("file_format")
    destination: str | None = _spec_default("destination")
    description: str | None = _spec_default("description")
    stream_rows: int | None = _spec_default("stream_rows")
    version_column: str | None = _spec_default("version_column")
    restate_stale: bool = _spec_default("restate_stale")
    owners: list[str] = list(_spec_default("owners"))
    deadline: str | None = _spec_default("deadline")
    version: str | int | None = _spec_default("version")


def _environment_value(variable: str, what: str) -> str:
    value = os.environ.get(variable)
    if not value:
        raise ConfigurationError(f"{what}: environment variable {variable} is not set")
    return value


class SqlSourceResource(SourceResource):
    """A YAML export's SQL source as a Dagster resource: each run resolves its URL, by name, in its own worker.

    Attributes:
        url_env: The environment variable holding the database's SQLAlchemy URL.
        query: The query (:class:`SqlSource`).
        url: ``dg.EnvVar(url_env)`` where the code location loaded with the variable set (the UI's resource config
            shows its name, never the URL); empty where it was unset, and each run of that process fails naming it.
    """

    url_env: str
    query: str
    url: str = ""

    def problem(self) -> str | None:
        if not self.url:
            return f"source.url_env: environment variable {self.url_env} is not set in this process"
        return None

    def get_source(self, spec: ExportSpec) -> EnvSqlSource:
        if self.problem() is not None:
            raise ConfigurationError(self.problem())
        return EnvSqlSource(url=self.url, query=self.query, url_env=self.url_env)


def _sql_source(model: SqlSourceModel, export: str) -> SqlSourceResource:
    """The export's SQL source, as a resource whose URL is ``EnvVar(url_env)``. A variable unset in this process (a
    code server or run worker started without it) is a setting the export's runs lack, not a bad YAML: the location
    still loads, and the export's asset and each of its runs say which variable is missing
    (:meth:`SqlSourceResource.problem`). A bad query is a bad YAML: refused at load, whether or not the URL is set."""
    try:
        check_query(model.query)
    except ValueError as exc:
        raise ConfigurationError(f"export {export!r}: source.query: {exc}") from None
    url = dg.EnvVar(model.url_env) if os.environ.get(model.url_env) else ""
    return SqlSourceResource(url_env=model.url_env, query=model.query, url=url)


def _export_spec(context: dg.ResolutionContext, model: ExportModel) -> ExportSpec:
    """The export as ExportSpec checks it; a refusal is re-raised at the export's place in the YAML, with the entry
    quoted, unless the entry holds a credential (its ``destination``): then it is named by file, line and path only,
    because the load error is shown by ``dg check defs``, the webserver and the daemon."""
    try:
        fields = model.model_dump(exclude={"source"})
        return ExportSpec(source=_sql_source(model.source, model.name), **fields)
    except ExportLedgerError as exc:
        if model.destination is not None and holds_credential(model.destination):
            raise ResolutionException(
                f"{_place(context)}: {type(exc).__name__}: {exc}\n(the entry is not quoted: it holds a credential)"
            ) from None
        raise context.build_resolve_fn_exc(
            [f"{type(exc).__name__}: {exc}\n"], field_name="exports", model=model
        ) from None


def _place(context: dg.ResolutionContext) -> str:
    """Where the value being resolved is: ``<file>:<line> - attributes.exports.0`` (the file when known)."""
    path = ".".join(str(part) for part in context.path)
    tree = context.source_position_tree
    return f"{tree.lookup_closest_and_path(context.path, trace=None)[0]} - {path}" if tree else path


ResolvedExport = Annotated[ExportSpec, dg.Resolver(_export_spec, model_field_type=ExportModel)]


class LedgeredExportsScaffolder(dg.Scaffolder):
    """``dg scaffold defs export_ledger.dagster.LedgeredExports <path>``: a commented defs.yaml that runs as it is
    (given ``SHOP_DATABASE_URL``), to change into the user's own export."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        if request.scaffold_format != "yaml":
            raise ConfigurationError("LedgeredExports is declared in YAML: scaffold it with --format yaml")
        request.target_path.mkdir(parents=True, exist_ok=True)
        (request.target_path / "defs.yaml").write_text(_TEMPLATE.format(type_name=request.type_name))


@dg.scaffold_with(LedgeredExportsScaffolder)
@dataclass
class LedgeredExports(dg.Component, dg.Resolvable):
    """Ledgered exports declared in YAML: per export and zone of its tenants an asset, checks, a job and a nightly
    schedule; one reconciliation sensor and one drift sensor for all. Built by ``ledgered_definitions``.

    Attributes:
        exports: The exports (names unique), each :class:`~export_ledger.spec.ExportSpec`'s fields with a SQL source.
        ledger_url_env: The environment variable holding the ledger's SQLAlchemy URL; default
            ``EXPORTS_LEDGER_URL``, or ``./var/ledger.sqlite3`` when that is unset.
        destination: The default destination spec (a folder, ``s3://bucket/prefix``, ``ledger-table:<table>``);
            default ``EXPORTS_DESTINATION``, or ``./var/exports``. An export's own ``destination`` wins over it.
    """

    exports: Sequence[ResolvedExport]
    ledger_url_env: str | None = None
    destination: str | None = None

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        settings = Settings.from_environment()
        ledger = None
        if self.ledger_url_env is not None:
            _environment_value(self.ledger_url_env, "ledger_url_env")  # fail at load, not in the first run
            ledger = LedgerResource(
                url=dg.EnvVar(self.ledger_url_env),  # by name: the UI shows the variable, never the URL
                lease_ttl_seconds=settings.lease_ttl_seconds,
                allow_below_low_water=settings.allow_below_low_water,
            )
        if self.destination is not None:  # named as the YAML attribute it is, not as ledgered_definitions' argument
            refuse_credentials(self.destination, "the LedgeredExports attribute destination")
        return ledgered_definitions(self.exports, ledger=ledger, destination=self.destination, settings=settings)


_TEMPLATE = """\
# Ledgered exports (export-ledger): one logical export per (export, tenant, business date).
# Every attribute of an export is a field of export_ledger.ExportSpec; see its docstring for the details.
type: {type_name}

attributes:
  # Optional: the environment variable holding the ledger's SQLAlchemy URL (default EXPORTS_LEDGER_URL, else
  # ./var/ledger.sqlite3). Secrets go in the environment, never in this file.
  # ledger_url_env: EXPORTS_LEDGER_URL
  # Optional: where exports go unless an export names its own (a folder, s3://bucket/prefix, ledger-table:<table>).
  # destination: "{{{{ context.project_root }}}}/var/exports"
  exports:
    - name: orders                     # a slug: the asset, the first part of each logical key, the folder
      source:
        url_env: SHOP_DATABASE_URL     # the variable holding the source database's SQLAlchemy URL
        # Bound parameters: :tenant, and the window [:start, :end) in UTC.
        query: >-
          SELECT order_id, tenant, placed_at, total FROM orders
          WHERE tenant = :tenant AND placed_at >= :start AND placed_at < :end
          ORDER BY placed_at, order_id
      columns:                         # name: string | float | int | timestamp | bool, in file order
        order_id: string
        tenant: string
        placed_at: timestamp
        total: float
      id_columns: [order_id]           # unique within the export
      time_column: placed_at           # places a row in a business day
      tenant_column: tenant            # every row must hold its key's tenant
      # Tenant ids, or id: zone for tenants whose business day is their own (null: the export's zone). Each zone is
      # an asset of its own: orders (New York) and orders__asia_kolkata here.
      tenants:
        acme: null
        globex: Asia/Kolkata
      timezone: America/New_York       # the business day's zone
      start_date: "2026-01-01"         # the first business date (quoted: a date, not a YAML timestamp)
      schedule_time: "04:30"           # local time of the nightly run; null for no schedule
      file_format: csv                 # csv or parquet
      # nullable: [total]              # columns that may be null
      # order_by: [placed_at, order_id]
      # destination: s3://exports-bucket/orders
      # description: Orders placed, per tenant and business day
      # stream_rows: 50000             # stream each key in batches of this many rows
      # version_column: updated_at     # lets drift detection see rows changed in place
      # restate_stale: false           # restate keys whose source changed, without an operator
      # owners: [team:data-platform]   # shown on the assets: e-mail addresses or team:NAME
      # deadline: "06:00"              # each tenant's export is due by then the next morning, in its zone
      # version: 1                     # bump when what the export computes changes (the ledger asks to accept it)
"""
