"""Dagster resources: configuration in, plain export_ledger objects out (a ledger, a destination).

Settings that may hold secrets are given as Dagster ``EnvVar``s by :func:`export_ledger.dagster.ledgered_definitions`,
so the UI and run config show variable names, never values.
"""

import datetime as dt

import dagster as dg

from export_ledger.destinations import Destination, destination_from
from export_ledger.ledger import ExportLedger


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
    def of(cls, destination: Destination) -> "DestinationResource":
        """The resource for a destination built in Python (tests, scripts)."""
        spec, settings = destination.spec()
        return cls(spec=spec, ledger_url=getattr(destination, "url", ""), **settings)
