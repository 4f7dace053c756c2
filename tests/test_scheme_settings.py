"""Each destination scheme declares its own settings (issue 29, item 2): the variable each is read from, whether it is
a secret, how its text is parsed, its default. A new store with credentials is then one file: the Dagster resource
holds its settings by name (secrets as ``EnvVar``), the CLI reads them from their variables, and the secret rules
(a credential in a spec, a secret given as a value) hold for it, with no other file touched.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import textwrap

import dagster as dg
import pandas as pd
import pydantic
import pytest

import export_ledger.destinations as destinations_package
from export_ledger import ExportSpec
from export_ledger.dagster import DestinationResource, LedgerResource, ledgered_definitions
from export_ledger.destinations import destination_from
from export_ledger.destinations.registry import Setting, refuse_credentials, schemes
from export_ledger.destinations.s3 import S3Destination
from export_ledger.errors import ConfigurationError

TOKEN = "TOKENcanary-9f3a61"

#: A whole store in one file: a folder behind an API token, with a timeout read from the environment as text.
TOKEN_FOLDER = '''
"""A folder behind an API token: a store declared in this one file, settings and all."""

from dataclasses import dataclass, field

from export_ledger.destinations.local import LocalDestination
from export_ledger.destinations.registry import Scheme, Setting


@dataclass(frozen=True)
class TokenFolderDestination(LocalDestination):
    api_token: str | None = field(default=None, repr=False)
    timeout_seconds: float = 10.0
    mirror_url: str | None = None

    @classmethod
    def from_spec(cls, spec, *, ledger_url, settings):
        return cls(root=spec.removeprefix("tokenfolder:"), **settings)

    def spec(self):
        return f"tokenfolder:{self.root}", SCHEME.settings_of(self)


SCHEME = Scheme(
    "tokenfolder:",
    "TokenFolderDestination",
    "tokenfolder:PATH",
    settings=(
        Setting("api_token", ("TOKENFOLDER_API_TOKEN", "TOKENFOLDER_TOKEN"), secret=True, doc="The API token"),
        Setting("timeout_seconds", "TOKENFOLDER_TIMEOUT_SECONDS", parse=float, default=10.0, doc="Its timeout"),
        Setting("mirror_url", doc="A mirror, given in code or resource config only"),
    ),
)
'''

#: Every variable each scheme read before the schemes declared them (``S3_ENV``, ``CLOUD_ENV``, the region's two):
#: users of environment variables see no change.
VARIABLES_BEFORE = {
    "s3://": {"endpoint_url": ("AWS_ENDPOINT_URL",), "region_name": ("AWS_REGION", "AWS_DEFAULT_REGION"),
              "access_key_id": ("AWS_ACCESS_KEY_ID",), "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
              "session_token": ("AWS_SESSION_TOKEN",), "connect_timeout_seconds": (), "read_timeout_seconds": ()},
    "gs://": {"gcs_endpoint_url": ("EXPORTS_GCS_ENDPOINT_URL",), "gcs_project": ("GOOGLE_CLOUD_PROJECT",),
              "gcs_credentials_file": ("GOOGLE_APPLICATION_CREDENTIALS",), "connect_timeout_seconds": (),
              "read_timeout_seconds": ()},
    "az://": {"azure_endpoint_url": ("EXPORTS_AZURE_ENDPOINT_URL",),
              "azure_account_name": ("AZURE_STORAGE_ACCOUNT_NAME",),
              "azure_account_key": ("AZURE_STORAGE_ACCOUNT_KEY",), "azure_sas_token": ("AZURE_STORAGE_SAS_TOKEN",),
              "connect_timeout_seconds": (), "read_timeout_seconds": ()},
    "delta:": {"endpoint_url": ("AWS_ENDPOINT_URL",), "region_name": ("AWS_REGION", "AWS_DEFAULT_REGION"),
               "access_key_id": ("AWS_ACCESS_KEY_ID",), "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
               "session_token": ("AWS_SESSION_TOKEN",)},
    "ledger-table:": {},
    "": {},
}  # fmt: skip
#: The settings that were secrets whatever their value (the resource's ``SECRET_SETTINGS``).
SECRETS_BEFORE = {"secret_access_key", "session_token", "azure_account_key", "azure_sas_token"}


@pytest.fixture
def token_folder(tmp_path, monkeypatch):
    """The store's one file, dropped beside the destination modules (a folder of the package's path): the registry
    finds it as it finds theirs."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "token_folder.py").write_text(textwrap.dedent(TOKEN_FOLDER))
    monkeypatch.setattr(destinations_package, "__path__", [*destinations_package.__path__, str(folder)])
    schemes.cache_clear()
    yield importlib.import_module("export_ledger.destinations.token_folder")
    sys.modules.pop("export_ledger.destinations.token_folder", None)
    schemes.cache_clear()


@pytest.fixture
def clean_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("EXPORTS_", "AWS_", "AZURE_", "TOKENFOLDER_"))]:
        monkeypatch.delenv(name)


def orders() -> ExportSpec:
    def rows(tenant, start, end):
        times = pd.date_range(pd.Timestamp(start).ceil("h"), pd.Timestamp(end), freq="h", inclusive="left")
        ids = [f"{tenant}-{i}" for i in range(len(times))]
        return pd.DataFrame({"order_id": ids, "placed_at": times.as_unit("us")})

    return ExportSpec(
        name="orders", source=rows, columns={"order_id": "string", "placed_at": "timestamp"}, id_columns=["order_id"],
        time_column="placed_at", tenants=["acme"], timezone="America/New_York", start_date="2026-03-01",
    )  # fmt: skip


def ui_config(defs: dg.Definitions, key: str) -> dict:
    """A resource's configured values as the Dagster UI gets them (GraphQL ``configuredValues``)."""
    resource = defs.get_repository_def().get_top_level_resources()[key]
    return json.loads(resource.config_schema.default_value_as_json_str)


# -- a new store is one file ------------------------------------------------------------------------------------------


def test_a_new_store_with_a_credential_is_one_file_its_settings_reach_dagster_by_name_and_a_run_resolves_them(
    token_folder, clean_environment, monkeypatch, tmp_path, sqlite_url
):
    monkeypatch.setenv("TOKENFOLDER_API_TOKEN", TOKEN)
    monkeypatch.setenv("TOKENFOLDER_TIMEOUT_SECONDS", "2.5")
    spec = f"tokenfolder:{tmp_path / 'exports'}"
    defs = ledgered_definitions([orders()], ledger=LedgerResource(url=sqlite_url), destination=spec)

    config = ui_config(defs, "orders__destination")
    assert config["settings"] == {"api_token": {"env": "TOKENFOLDER_API_TOKEN"},
                                  "timeout_seconds": {"env": "TOKENFOLDER_TIMEOUT_SECONDS"}}  # fmt: skip
    assert TOKEN not in json.dumps(config), "the token is in the UI's resource config"
    with dg.build_resources({"destination": defs.resources["orders__destination"]}) as resources:
        built = resources.destination.get_destination()
    assert isinstance(built, token_folder.TokenFolderDestination)
    assert (built.api_token, built.timeout_seconds) == (TOKEN, 2.5), "the run resolves the variables, parsed"

    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("orders_job").execute_in_process(partition_key="2026-03-08", instance=instance)
    assert result.success
    assert list((tmp_path / "exports" / "orders").rglob("*.csv")), "the store exported through its resource"

    from_cli = destination_from(spec, ledger_url="", environ={"TOKENFOLDER_API_TOKEN": "t", "AWS_REGION": "x"})
    assert (from_cli.api_token, from_cli.timeout_seconds) == ("t", 10.0), "the CLI reads its variables, and no other"


def test_a_new_stores_secret_and_a_credential_in_its_spec_are_refused_naming_its_own_variable(
    token_folder, clean_environment, sqlite_url, tmp_path
):
    literal = token_folder.TokenFolderDestination(root=str(tmp_path), api_token=TOKEN)
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([orders()], ledger=LedgerResource(url=sqlite_url), destination=literal)
    message = str(refused.value)
    assert TOKEN not in message and "api_token" in message and "TOKENFOLDER_API_TOKEN" in message, message

    with_password = token_folder.TokenFolderDestination(root=str(tmp_path), mirror_url=f"https://u:{TOKEN}@mirror")
    with pytest.raises(ConfigurationError) as no_variable:
        ledgered_definitions([orders()], ledger=LedgerResource(url=sqlite_url), destination=with_password)
    message = str(no_variable.value)
    assert TOKEN not in message and "mirror_url is a secret" in message and "no environment variable" in message

    with pytest.raises(ConfigurationError) as in_spec:
        refuse_credentials(f"tokenfolder:user:{TOKEN}@files.example:/srv", "EXPORTS_DESTINATION")
    message = str(in_spec.value)
    assert TOKEN not in message and "TOKENFOLDER_API_TOKEN" in message and "tokenfolder:PATH" in message, message


def test_a_secret_read_from_either_of_its_variables_reaches_dagster_by_the_one_holding_it(
    token_folder, clean_environment, monkeypatch, tmp_path
):
    made = token_folder.TokenFolderDestination(root=str(tmp_path), api_token=TOKEN)
    monkeypatch.setenv("TOKENFOLDER_API_TOKEN", "another-token")
    monkeypatch.setenv("TOKENFOLDER_TOKEN", TOKEN)
    resource = DestinationResource.of(made)
    assert resource.settings["api_token"] == dg.EnvVar("TOKENFOLDER_TOKEN"), "the variable that holds this value"
    assert get_destination(resource) == made

    monkeypatch.delenv("TOKENFOLDER_TOKEN")
    with pytest.raises(ConfigurationError) as refused:
        DestinationResource.of(made)
    message = str(refused.value)
    assert TOKEN not in message and "set TOKENFOLDER_API_TOKEN or TOKENFOLDER_TOKEN to it" in message, message


def test_a_new_stores_bad_value_from_its_variable_fails_the_load_naming_the_setting_and_the_variable(
    token_folder, clean_environment, monkeypatch, sqlite_url, tmp_path
):
    monkeypatch.setenv("TOKENFOLDER_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([orders()], ledger=LedgerResource(url=sqlite_url), destination=f"tokenfolder:{tmp_path}")
    message = str(refused.value)
    assert "timeout_seconds (TOKENFOLDER_TIMEOUT_SECONDS) must be a number, got 'soon'" in message, message


# -- what the resource takes -----------------------------------------------------------------------------------------


def get_destination(resource: DestinationResource):
    with dg.build_resources({"destination": resource}) as resources:
        return resources.destination.get_destination()


def test_a_setting_the_scheme_does_not_declare_is_refused_when_the_resource_is_built_naming_it_and_the_schemes():
    for given in ({"read_timout_seconds": "60"}, {"endpoint_url": "http://minio:9000", "gcs_project": "p"}):
        with pytest.raises(pydantic.ValidationError) as refused:  # the code location's load, not each run
            DestinationResource(spec="s3://exports-bucket/p", settings=given)
        message = str(refused.value)
        undeclared = next(name for name in given if name != "endpoint_url")
        assert f"takes no setting {undeclared!r}" in message, message
        assert "endpoint_url, region_name, access_key_id, secret_access_key" in message, "and names those it takes"
    with pytest.raises(ConfigurationError, match="takes no setting 'region_name'; it takes no settings"):
        destination_from("./exports", ledger_url="", settings={"region_name": "eu-west-1"})


def test_a_resource_is_refused_when_built_for_a_spec_no_destination_takes_and_never_shows_a_refused_value():
    with pytest.raises(pydantic.ValidationError, match="scheme 'ftp' is not supported"):
        DestinationResource(spec="ftp://files.example/exports", settings={})
    with pytest.raises(pydantic.ValidationError) as refused:
        DestinationResource(spec="s3://exports-bucket/p", settings={"secret_acess_key": TOKEN})
    assert "'secret_acess_key'" in str(refused.value) and TOKEN not in str(refused.value), str(refused.value)


def test_a_resources_settings_given_as_envvars_are_checked_by_name_and_resolved_when_a_run_builds_it(monkeypatch):
    monkeypatch.setenv("READ_TIMEOUT", "60")
    monkeypatch.setenv("EXPORTS_DESTINATION", "s3://exports-bucket/p")
    resource = DestinationResource(
        spec="s3://exports-bucket/p", settings={"read_timeout_seconds": dg.EnvVar("READ_TIMEOUT")}
    )
    assert get_destination(resource).read_timeout_seconds == 60.0, "the key survives Dagster's resolution"
    by_name = DestinationResource(spec=dg.EnvVar("EXPORTS_DESTINATION"), settings={"region_name": "eu-west-1"})
    assert get_destination(by_name).region_name == "eu-west-1", "a spec given by name is checked when a run reads it"


def test_a_destination_object_whose_spec_returns_a_setting_its_scheme_does_not_declare_is_refused_naming_it():
    @dataclasses.dataclass(frozen=True)
    class TunedS3(S3Destination):
        def spec(self):
            spec, settings = super().spec()
            return spec, {**settings, "part_size_bytes": self.part_size_bytes}

    with pytest.raises(ConfigurationError, match="TunedS3's setting part_size_bytes is none its scheme"):
        DestinationResource.of(TunedS3(bucket="exports-bucket"))


def test_a_bad_number_in_the_resources_settings_is_refused_naming_the_setting():
    resource = DestinationResource(spec="s3://exports-bucket/p", settings={"read_timeout_seconds": "30s"})
    with pytest.raises(ConfigurationError) as refused:
        get_destination(resource)
    assert str(refused.value) == "the destination resource: setting read_timeout_seconds must be a number, got '30s'"


def test_a_resource_of_settings_as_text_builds_the_destination_a_python_object_describes():
    made = S3Destination(bucket="exports-bucket", prefix="p", region_name="eu-west-1", read_timeout_seconds=60.0)
    resource = DestinationResource.of(made)
    assert resource.settings == {"region_name": "eu-west-1", "read_timeout_seconds": "60.0"}, "defaults left out"
    assert get_destination(resource) == made
    assert get_destination(DestinationResource(spec="s3://exports-bucket/p", settings={"endpoint_url": ""})) == (
        S3Destination(bucket="exports-bucket", prefix="p")
    ), "an empty setting gives nothing, as an empty variable does"


# -- the declarations ------------------------------------------------------------------------------------------------


def test_every_scheme_reads_the_variables_it_read_before_and_the_same_settings_are_secrets(token_folder):
    before = [s for s in schemes() if s.prefix in VARIABLES_BEFORE]  # a new store (token_folder) is none of these
    declared = {s.prefix: {setting.name: setting.env for setting in s.settings} for s in before}
    assert declared == VARIABLES_BEFORE
    secrets = {setting.name for s in before for setting in s.settings if setting.secret}
    assert secrets == SECRETS_BEFORE


def test_each_declared_default_is_the_destination_classes_own_and_a_secrets_field_is_left_out_of_its_repr():
    for scheme in [s for s in schemes() if s.settings]:
        fields = {f.name: f for f in dataclasses.fields(scheme.load())}
        for setting in scheme.settings:
            assert setting.name in fields, f"{scheme.example}: {setting.name} is no field of its destination"
            assert fields[setting.name].default == setting.default, f"{scheme.example}: {setting.name}'s default"
            if setting.secret:  # a destination's repr is in logs and tracebacks
                assert fields[setting.name].repr is False, f"{scheme.example}: {setting.name} needs field(repr=False)"


def test_delta_on_s3_declares_the_s3_destinations_settings_bar_the_client_timeouts():
    by_prefix = {s.prefix: s for s in schemes()}
    s3 = [s for s in by_prefix["s3://"].settings if not s.name.endswith("_timeout_seconds")]
    strip = [dataclasses.replace(s, doc="") for s in s3]
    assert [dataclasses.replace(s, doc="") for s in by_prefix["delta:"].settings] == strip


def test_a_secret_setting_without_a_variable_is_a_declaration_error():
    with pytest.raises(ValueError, match="'api_token' needs an environment variable"):
        Setting("api_token", secret=True)
    assert Setting("token", "T", secret=True).credential, "a secret is a credential"
    assert Setting("region", ("A", "B")).read({"B": "x", "A": ""}) == ("B", "x"), "the first variable set wins"


def host_only(text: str) -> str:
    """A parser that refuses every URL: the setting's value fails to parse."""
    if "://" in text:
        raise ValueError("a host, not a URL")
    return text


@pytest.mark.parametrize(
    ("name", "given"),
    [
        pytest.param("mirror", "http://u:SEKRIT@mirror", id="password-in-a-url"),
        pytest.param("mirror", "http://SEKRIT@mirror", id="user-part-of-a-url"),
        pytest.param("mirror", "http://mirror/?auth=SEKRIT", id="query-of-a-url"),
        pytest.param("mirror_url", "http://mirror/SEKRIT", id="a-url-setting"),
    ],
)
def test_a_value_that_fails_to_parse_is_never_shown_where_it_may_hold_a_secret(name, given):
    with pytest.raises(ConfigurationError) as refused:
        Setting(name, parse=host_only).value(given, what="the destination resource", source="MIRROR")
    message = str(refused.value)
    assert "SEKRIT" not in message and f"setting {name} (MIRROR) must be a valid host_only" in message, message


def test_a_value_that_fails_to_parse_and_cannot_hold_a_secret_is_shown():
    with pytest.raises(ConfigurationError, match="must be a number, got '30s'"):
        Setting("read_timeout_seconds", parse=float).value("30s", what="the destination resource")


def test_the_region_is_read_from_aws_region_then_aws_default_region_as_before():
    environ = {"AWS_DEFAULT_REGION": "eu-central-1"}
    assert destination_from("s3://b-1/p", ledger_url="", environ=environ).region_name == "eu-central-1"
    environ["AWS_REGION"] = "eu-west-1"
    assert destination_from("s3://b-1/p", ledger_url="", environ=environ).region_name == "eu-west-1"
    assert destination_from("s3://b-1/p", ledger_url="", environ={}).region_name == "us-east-1"
