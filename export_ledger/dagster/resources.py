"""Dagster resources: configuration in, plain export_ledger objects out (a ledger, a destination).

Settings that may hold secrets are given as Dagster ``EnvVar``s by :func:`export_ledger.dagster.ledgered_definitions`,
so the UI and run config show variable names, never values: Dagster shows every resource's configured values in its
UI (GraphQL ``configuredValues``). A secret that cannot be given by name is refused (:func:`secret_by_name`).
"""

import datetime as dt
import os

import dagster as dg

from export_ledger.destinations import Destination, destination_from
from export_ledger.destinations.registry import refuse_credentials
from export_ledger.errors import ConfigurationError
from export_ledger.ledger import ExportLedger
from export_ledger.ledger.urls import holds_secret
from export_ledger.settings import CLOUD_ENV, LEDGER_URL_ENV, S3_ENV
from export_ledger.spec import ExportSpec

#: The resource key of the ledger, shared by every export of a code location.
LEDGER_KEY = "ledger"


def resource_keys(spec: ExportSpec) -> tuple[str, str]:
    """The resource keys of an export's destination and I/O manager."""
    return f"{spec.name}__destination", f"{spec.name}__io_manager"

#: Every destination setting read from the environment, by the variable it is read from.
SETTING_ENV = {**S3_ENV, **CLOUD_ENV}
#: The destination settings that are secrets whatever their value.
SECRET_SETTINGS = frozenset({"secret_access_key", "session_token", "azure_account_key", "azure_sas_token"})


def is_secret(setting: str, value: object) -> bool:
    """Whether a destination setting's value is a secret: a key or token, or a URL (an endpoint, the ledger's) that
    carries a password or a signature."""
    if not value or not isinstance(value, str):
        return False
    return setting in SECRET_SETTINGS or (setting.endswith("_url") and holds_secret(value))


def secret_by_name(value: str, variable: str, refusal: str) -> dg.EnvVar:
    """A secret as Dagster gets it: ``EnvVar(variable)`` when the code location's process environment holds this
    very value under ``variable`` (a run worker then reads it there too), so the UI shows the name, never the value.

    Raises:
        ConfigurationError: the process environment does not hold it; the message (``refusal`` and what to do)
            names the setting and the variable, never the value.
    """
    if os.environ.get(variable) == value:
        return dg.EnvVar(variable)
    raise ConfigurationError(
        f"{refusal}, and given as a value it would be shown in the Dagster UI's resource config. Give it by name: set "
        f"{variable} to it in the code location's environment, and it is passed to Dagster as EnvVar({variable!r})"
    )


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
    """Where exports go, by spec: a folder, ``s3://bucket/prefix`` or ``ledger-table:<table>``.

    Attributes:
        spec: The destination spec (``EXPORTS_DESTINATION``).
        ledger_url: The ledger's URL (a ``ledger-table:`` destination lives in the ledger's database).
        endpoint_url, region_name, access_key_id, secret_access_key, session_token: S3 settings; None lets boto3
            find them itself.
        connect_timeout_seconds, read_timeout_seconds: Client timeouts (S3, GCS, Azure).
        gcs_endpoint_url, gcs_project, gcs_credentials_file: GCS settings (``gs://``); None: Google's endpoint with
            application default credentials.
        azure_endpoint_url, azure_account_name, azure_account_key, azure_sas_token: Azure Blob settings (``az://``).
    """

    spec: str
    ledger_url: str = ""
    endpoint_url: str | None = None
    region_name: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 30.0
    gcs_endpoint_url: str | None = None
    gcs_project: str | None = None
    gcs_credentials_file: str | None = None
    azure_endpoint_url: str | None = None
    azure_account_name: str | None = None
    azure_account_key: str | None = None
    azure_sas_token: str | None = None

    def get_destination(self) -> Destination:
        return destination_from(
            self.spec,
            ledger_url=self.ledger_url,
            credentials=dict(
                endpoint_url=self.endpoint_url,
                region_name=self.region_name,
                access_key_id=self.access_key_id,
                secret_access_key=self.secret_access_key,
                session_token=self.session_token,
                connect_timeout_seconds=self.connect_timeout_seconds,
                read_timeout_seconds=self.read_timeout_seconds,
                gcs_endpoint_url=self.gcs_endpoint_url,
                gcs_project=self.gcs_project,
                gcs_credentials_file=self.gcs_credentials_file,
                azure_endpoint_url=self.azure_endpoint_url,
                azure_account_name=self.azure_account_name,
                azure_account_key=self.azure_account_key,
                azure_sas_token=self.azure_sas_token,
            ),
        )

    @classmethod
    def of(
        cls, destination: Destination, *, what: str = "destination", ledger_variable: str = LEDGER_URL_ENV
    ) -> "DestinationResource":
        """The resource for a destination built in Python. Its secrets reach Dagster by name: each secret setting
        (``secret_access_key``, ``azure_account_key``, an endpoint or table URL with a password, ...) becomes
        ``EnvVar`` of the variable it is read from (``AWS_SECRET_ACCESS_KEY``, ...; a table destination's URL: the
        ledger's, ``ledger_variable``) when the process environment holds that very value there.

        Raises:
            ConfigurationError: naming ``what`` and the setting: the spec carries a credential, or a secret setting
                holds a value the process environment does not.
        """
        spec, settings = destination.spec()
        refuse_credentials(spec, what)
        kind = type(destination).__name__
        for name, value in settings.items():
            if is_secret(name, value):
                settings[name] = secret_by_name(value, SETTING_ENV[name], f"{what}: the {kind}'s {name} is a secret")
        ledger_url = getattr(destination, "url", "")
        if is_secret("ledger_url", ledger_url):
            ledger_url = secret_by_name(
                ledger_url, ledger_variable, f"{what}: the {kind}'s url (the ledger_url setting) holds a password"
            )
        return cls(spec=spec, ledger_url=ledger_url, **settings)
