"""Secrets written where they do not belong: a password with un-encoded characters in a database URL, credentials in
a destination spec, a ledger URL with its password given to ``build_definitions`` as an argument.

Each is either masked (a URL's password, in every message) or refused before it is stored anywhere (a destination
spec that carries a credential; a ledger URL whose password would be shown in the Dagster UI's resource config),
and the refusal never repeats the secret.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from azure.storage.blob import BlobServiceClient
from builders import key_for, open_ledger
from cloud_fixtures import AZURITE_ACCOUNT, AZURITE_KEY
from pipeline_helpers import failure_message, run_partition

from definitions import build_definitions
from export_ledger import ExportSpec, cli
from export_ledger.dagster import LedgerResource, ledgered_definitions
from export_ledger.destinations import destination_from
from export_ledger.destinations.azure import AzureDestination
from export_ledger.destinations.delta import DeltaDestination
from export_ledger.destinations.gcs import GCSDestination
from export_ledger.destinations.local import LocalDestination
from export_ledger.destinations.s3 import S3Destination
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.destinations.warehouse import WarehouseDestination
from export_ledger.errors import ConfigurationError, redact_text
from export_ledger.ledger import ExportLedger, LedgerUnavailable, redact_url

PROJECT = Path(__file__).resolve().parent.parent

# -- 1. a URL's password, whatever characters it holds ---------------------------------------------------------------

#: (URL, how messages show it, pieces of the password that must never show).
PASSWORD_SHAPES = [
    pytest.param(
        "postgresql+psycopg2://exporter:hunter@2-tail@db.internal:5432/ledger",
        "postgresql+psycopg2://exporter:***@db.internal:5432/ledger",
        ["hunter", "2-tail"],
        id="at-sign-in-password",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter:hun:ter2@db.internal:5432/ledger",
        "postgresql+psycopg2://exporter:***@db.internal:5432/ledger",
        ["hun:ter2", "ter2"],
        id="colon-in-password",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter:pa/ss-word@db.internal/ledger",
        "postgresql+psycopg2://exporter:***@db.internal/ledger",
        ["pa/ss", "ss-word"],
        id="slash-in-password",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter:pw@v6-tail@[::1]:5432/ledger",
        "postgresql+psycopg2://exporter:***@[::1]:5432/ledger",
        ["v6-tail"],
        id="ipv6-host",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter@db.internal:5432/ledger",
        "postgresql+psycopg2://exporter@db.internal:5432/ledger",
        [],
        id="no-password",
    ),
]


@pytest.mark.parametrize(("url", "shown", "hidden"), PASSWORD_SHAPES)
def test_a_url_password_is_masked_up_to_the_last_at_sign_before_the_host(url, shown, hidden):
    assert redact_url(url) == shown, "the whole password is masked and the real host is shown"
    assert redact_text(f"cannot reach {url}: refused") == f"cannot reach {shown}: refused", "the same in free text"
    assert redact_text(f"cannot reach {url!r}") == f"cannot reach {shown!r}", "and in a quoted URL"
    for piece in hidden:
        assert piece not in redact_url(url) and piece not in redact_text(url), f"{piece!r} is part of the password"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg2://exporter:hunter@2-tail@127.0.0.1:9/ledger",
        "postgresql+psycopg2://exporter:pw@v6-tail@[::1]:9/ledger",
    ],
)
def test_a_ledger_url_whose_password_holds_an_unencoded_at_sign_is_refused_naming_the_fix(url, capfd):
    with pytest.raises((ConfigurationError, LedgerUnavailable)) as refused:
        ExportLedger(url)
    message = str(refused.value)
    assert "un-encoded '@'" in message and "%40" in message, message
    assert "2-tail" not in message and "v6-tail" not in message, "the password's tail is not shown as the host"

    assert cli.main(["--ledger-url", url, "status"]) == 1
    err = capfd.readouterr().err
    assert "%40" in err and "2-tail" not in err and "v6-tail" not in err and "hunter" not in err, err


# -- 2. a destination spec that carries a credential ------------------------------------------------------------------

SECRET = "SECRETcanary-5e0a7c"
#: (spec, how the refusal shows it, a setting the refusal names as the place for the credentials).
CREDENTIAL_SPECS = [
    pytest.param(f"s3://AKIAEXAMPLE:{SECRET}@exports-bucket/p", "s3://***@exports-bucket/p", "AWS_SECRET_ACCESS_KEY",
                 id="s3-user-and-password"),
    pytest.param(f"s3://AKIAEXAMPLE:pa/{SECRET}@exports-bucket/p", "s3://***@exports-bucket/p",
                 "AWS_SECRET_ACCESS_KEY", id="s3-password-with-slash"),
    pytest.param(f"az://account:{SECRET}@exports/p", "az://***@exports/p", "AZURE_STORAGE_ACCOUNT_KEY",
                 id="az-user-and-password"),
    pytest.param(f"gs://user:{SECRET}@exports-bucket/p", "gs://***@exports-bucket/p", "GOOGLE_APPLICATION_CREDENTIALS",
                 id="gs-user-and-password"),
    pytest.param(f"sftp://exporter:{SECRET}@files.example:2222/srv/exports", "sftp://***@files.example:2222/srv/exports",
                 "EXPORTS_SFTP_KEY_PASSPHRASE", id="sftp-user-and-password"),
    pytest.param(f"sftp://files.example/srv/exports?password={SECRET}", "sftp://files.example/srv/exports?***",
                 "EXPORTS_SFTP_USER", id="sftp-query"),
    pytest.param(f"delta:s3://AKIAEXAMPLE:{SECRET}@exports-bucket/t", "delta:s3://***@exports-bucket/t",
                 "AWS_SECRET_ACCESS_KEY", id="delta-s3-user-and-password"),
    pytest.param(f"s3://exports-bucket/p?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRET}",
                 "s3://exports-bucket/p?***", "AWS_SECRET_ACCESS_KEY", id="s3-presigned"),
    pytest.param(f"gs://exports-bucket/p?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature={SECRET}",
                 "gs://exports-bucket/p?***", "GOOGLE_APPLICATION_CREDENTIALS", id="gs-signed"),
    pytest.param(f"az://exports/p?sv=2022-11-02&ss=b&srt=co&sp=rwdlac&se=2026-12-31T00:00:00Z&sig={SECRET}",
                 "az://exports/p?***", "AZURE_STORAGE_SAS_TOKEN", id="az-sas"),
    pytest.param(f"az://exports/p?{SECRET}", "az://exports/p?***", "AZURE_STORAGE_SAS_TOKEN", id="any-query"),
    pytest.param(f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={SECRET}==;EndpointSuffix=core.windows.net",
                 "DefaultEndpointsProtocol=***;AccountName=***;AccountKey=***;EndpointSuffix=***",
                 "AZURE_STORAGE_ACCOUNT_KEY", id="azure-connection-string"),
    pytest.param(f"https://acct.blob.core.windows.net/exports?sv=2022-11-02&sig={SECRET}",
                 "https://acct.blob.core.windows.net/exports?***", "AZURE_STORAGE_SAS_TOKEN", id="sas-url"),
    pytest.param(f"exporter:{SECRET}@files.example:/srv/exports", "***@files.example:/srv/exports", "no credentials",
                 id="scp-style-folder"),
    pytest.param(f"exporter:{SECRET}/tail@files.example:/srv/exports", "***@files.example:/srv/exports",
                 "no credentials", id="scp-style-password-with-slash"),
    pytest.param(f"sv=2022-11-02&ss=b&srt=co&sp=rwdlac&se=2026-12-31T00:00:00Z&sig={SECRET}%3D", "***",
                 "AZURE_STORAGE_SAS_TOKEN", id="bare-sas-token"),
    pytest.param(f"sig={SECRET}%3D&sv=2022-11-02", "***", "AZURE_STORAGE_SAS_TOKEN", id="bare-sas-signature-first"),
    pytest.param(f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRET}", "***",
                 "no credentials", id="bare-presigned-query"),
    pytest.param(f"./exports?sig={SECRET}", "./exports?***", "no credentials", id="folder-with-a-signature"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "shown", "setting"), CREDENTIAL_SPECS)
def test_a_destination_spec_with_a_credential_is_refused_without_repeating_it(
    spec, shown, setting, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a spec taken for a folder would be created here
    with pytest.raises(ConfigurationError) as refused:
        destination_from(
            spec, ledger_url="", environ={"AZURE_STORAGE_ACCOUNT_NAME": "acct"}, what="EXPORTS_DESTINATION"
        )
    message = str(refused.value)
    assert SECRET not in message, f"the refusal repeats the secret: {message}"
    assert message.startswith("EXPORTS_DESTINATION carries "), "the refusal names the setting and the problem"
    assert repr(shown) in message, "the spec is shown with the secret part replaced"
    assert setting in message, "the refusal says where the credentials go instead"
    assert list(tmp_path.iterdir()) == [], "nothing is created"


@pytest.mark.parametrize(
    "spec",
    [
        "s3://exports-bucket/team@corp/p",
        "./exports/key=2026",
        "ledger-table:exported_{export}",
        "az://exports/p",
        "key=2026",
        "./R&D/exports",
        "/srv/exports/user@host",
    ],
)
def test_destination_specs_without_credentials_are_still_accepted(spec):
    destination_from(spec, ledger_url="sqlite://", environ={"AZURE_STORAGE_ACCOUNT_NAME": "acct"})


SOME_SPECS = [CREDENTIAL_SPECS[0], CREDENTIAL_SPECS[5], CREDENTIAL_SPECS[9]]


def orders(destination: str | None = None) -> ExportSpec:
    return ExportSpec(
        name="orders", source=lambda tenant, start, end: pd.DataFrame(), tenants=["acme"],
        columns={"order_id": "string", "tenant": "string", "placed_at": "timestamp"}, id_columns=["order_id"],
        time_column="placed_at", tenant_column="tenant", timezone="America/New_York", start_date="2026-01-01",
        destination=destination,
    )  # fmt: skip


@pytest.mark.parametrize(("spec", "shown", "setting"), SOME_SPECS)
def test_an_exports_own_destination_with_a_credential_fails_the_code_location_load_without_repeating_it(
    spec, shown, setting, sqlite_url
):
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([orders(spec)], environ={"EXPORTS_LEDGER_URL": sqlite_url})
    message = str(refused.value)
    assert message.startswith("export 'orders': destination carries ") and repr(shown) in message, message
    assert SECRET not in message


@pytest.mark.parametrize(("spec", "shown", "setting"), SOME_SPECS)
def test_exports_destination_or_a_destination_argument_with_a_credential_fails_build_definitions(
    spec, shown, setting, sqlite_url
):
    environ = {"EXPORTS_SOURCE": "sample", "EXPORTS_LEDGER_URL": sqlite_url, "EXPORTS_DESTINATION": spec}
    with pytest.raises(ConfigurationError) as from_environment:
        build_definitions(environ=environ)
    with pytest.raises(ConfigurationError) as from_argument:
        build_definitions(destination=spec, environ={"EXPORTS_SOURCE": "sample", "EXPORTS_LEDGER_URL": sqlite_url})
    for refused, setting_name in ((from_environment, "EXPORTS_DESTINATION"), (from_argument, "destination argument")):
        message = str(refused.value)
        assert setting_name in message and repr(shown) in message and setting in message, message
        assert SECRET not in message


@pytest.mark.parametrize(("spec", "shown", "setting"), SOME_SPECS)
def test_the_cli_refuses_a_destination_with_a_credential_exit_1_without_printing_it(
    spec, shown, setting, sqlite_url, tmp_path, monkeypatch, capfd
):
    for name in ("EXPORTS_SOURCE_URL", "EXPORTS_TENANTS", "EXPORTS_FILE_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    ledger = open_ledger(sqlite_url)
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    open_ledger(sqlite_url, clock=lambda: long_ago).claims.claim(key_for(), "dead-run/invoice_export")  # stuck
    assert ledger.queries.get(str(key_for())) is not None
    monkeypatch.setenv("EXPORTS_LEDGER_URL", sqlite_url)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXPORTS_DESTINATION", spec)

    printed = {}
    for argv in (["reconcile", "-f", str(PROJECT / "definitions.py")], ["reconcile"]):
        printed[argv[-1]] = (cli.main(argv), *capfd.readouterr())
    monkeypatch.delenv("EXPORTS_DESTINATION")
    printed["--destination"] = (cli.main(["reconcile", "--destination", spec]), *capfd.readouterr())

    for how, (code, out, err) in printed.items():
        setting_name = "--destination" if how == "--destination" else "EXPORTS_DESTINATION"
        assert code == 1, f"{how}: exit 1 (runtime error), got {code}: {err}"
        assert f"{setting_name} carries" in err and repr(shown) in err, f"{how}: {err}"
        assert SECRET not in out + err, f"{how}: the secret is printed"
    assert not (tmp_path / "DefaultEndpointsProtocol=https;AccountName=acct").exists()


@pytest.mark.process
def test_the_code_location_load_error_never_shows_a_destination_credential(tmp_path, sqlite_url):
    open_ledger(sqlite_url)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "AWS_", "AZURE_"))},
        "DAGSTER_HOME": str(tmp_path),
        "EXPORTS_SOURCE": "sample",
        "EXPORTS_LEDGER_URL": sqlite_url,
        "EXPORTS_DESTINATION": f"az://exports/p?sv=2022-11-02&sig={SECRET}",
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-f", "definitions.py"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "EXPORTS_DESTINATION carries a query string" in output, output[-3000:]
    assert SECRET not in output, "the load error (shown by the webserver and the daemon) repeats the secret"


# -- 3. the ledger URL's password never reaches the UI's resource config ---------------------------------------------

PASSWORD = "PWcanary-41d2"
LEDGER_WITH_PASSWORD = f"postgresql+psycopg2://exporter:{PASSWORD}@db.internal:5432/ledger"


def ui_resource_config(defs: dg.Definitions) -> dict[str, dict]:
    """Every top-level resource's configured values as the Dagster UI gets them (GraphQL ``configuredValues``, which
    Dagster takes from the default value of the resource's config schema)."""
    resources = defs.get_repository_def().get_top_level_resources()
    return {
        name: json.loads(resource.config_schema.default_value_as_json_str)
        for name, resource in resources.items()
        if resource.config_schema.default_provided
    }


@pytest.fixture
def no_exports_settings(monkeypatch):
    for name in [name for name in os.environ if name.startswith(("EXPORTS_", "AWS_", "AZURE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("EXPORTS_SOURCE", "sample")  # the reference location's source is always chosen


def test_a_ledger_url_from_the_environment_stays_an_envvar_when_lease_ttl_seconds_is_given(
    monkeypatch, no_exports_settings, tmp_path
):
    monkeypatch.setenv("EXPORTS_LEDGER_URL", LEDGER_WITH_PASSWORD)
    monkeypatch.setenv("EXPORTS_DESTINATION", str(tmp_path / "exports"))

    config = ui_resource_config(build_definitions(lease_ttl_seconds=60))

    assert PASSWORD not in json.dumps(config), "the password is in the UI's resource config"
    assert config["ledger"]["url"] == {"env": "EXPORTS_LEDGER_URL"}, "the ledger URL is passed by name"
    assert config["ledger"]["lease_ttl_seconds"] == 60, "the argument is still applied"
    destinations = [values for name, values in config.items() if name.endswith("__destination")]
    assert destinations and all(d["ledger_url"] == {"env": "EXPORTS_LEDGER_URL"} for d in destinations)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: build_definitions(ledger_url=LEDGER_WITH_PASSWORD), id="ledger_url-argument"),
        pytest.param(lambda: build_definitions(ledger_url=LEDGER_WITH_PASSWORD, lease_ttl_seconds=60), id="with-ttl"),
        pytest.param(
            lambda: build_definitions(ledger_url=f"postgresql+psycopg2://exporter@db/ledger?password={PASSWORD}"),
            id="password-as-query-parameter",
        ),
        pytest.param(
            lambda: ledgered_definitions([orders()], environ={"EXPORTS_LEDGER_URL": LEDGER_WITH_PASSWORD}),
            id="environ-mapping",
        ),  # fmt: skip
        pytest.param(
            lambda: ledgered_definitions([orders()], ledger=LedgerResource(url=LEDGER_WITH_PASSWORD)),
            id="ledger-resource",
        ),  # fmt: skip
    ],
)
def test_a_ledger_url_with_a_password_given_as_a_value_is_refused_saying_how_to_give_it_by_name(
    build, no_exports_settings
):
    with pytest.raises(ConfigurationError) as refused:
        build()
    message = str(refused.value)
    assert PASSWORD not in message, message
    assert "Dagster UI's resource config" in message, "the refusal says why"
    assert "EXPORTS_LEDGER_URL" in message and "EnvVar" in message and "PGPASSWORD" in message, "and what to do"


def test_a_ledger_url_without_a_password_is_still_taken_as_an_argument(no_exports_settings, tmp_path):
    url = "postgresql+psycopg2://exporter@db.internal:5432/ledger"
    config = ui_resource_config(build_definitions(ledger_url=url, destination=str(tmp_path), lease_ttl_seconds=60))
    assert config["ledger"]["url"] == url and config["ledger"]["lease_ttl_seconds"] == 60


def test_an_endpoint_setting_with_a_credential_is_masked_where_a_destination_describes_itself():
    azure = AzureDestination(
        container="exports", azure_endpoint_url=f"https://acct.blob.core.windows.net/?sig={SECRET}"
    )
    s3 = S3Destination(bucket="exports-bucket", endpoint_url=f"https://minio:{SECRET}@minio.internal:9000")
    gcs = GCSDestination(bucket="exports-bucket", gcs_endpoint_url=f"https://gcs.internal/?token={SECRET}")
    for destination in (azure, s3, gcs):
        shown = destination.store.describe()
        assert SECRET not in shown and "***" in shown, f"the endpoint's credential is shown: {shown}"


def test_a_store_repr_never_shows_its_client_credentials():
    """A store is printed in tracebacks and debug logs: its client settings (the secret key, the SAS token) stay out."""
    stores = [
        S3Destination(bucket="exports-bucket", secret_access_key=SECRET, session_token=SECRET).store,
        AzureDestination(container="exports", azure_account_name="acct", azure_account_key=SECRET).store,
        AzureDestination(container="exports", azure_account_name="acct", azure_sas_token=f"sv=1&sig={SECRET}").store,
        GCSDestination(bucket="exports-bucket", gcs_credentials_file=f"/keys/{SECRET}.json").store,
    ]
    for store in stores:
        assert SECRET not in repr(store) and SECRET not in str(store), f"a credential in {type(store).__name__}'s repr"
        assert "exports" in repr(store), "the repr still says which store it is"


def test_a_ledger_url_read_from_an_environ_mapping_goes_by_name_when_the_process_environment_holds_it(
    no_exports_settings, monkeypatch, tmp_path
):
    monkeypatch.setenv("EXPORTS_LEDGER_URL", LEDGER_WITH_PASSWORD)  # the same value the mapping gives
    environ = {"EXPORTS_LEDGER_URL": LEDGER_WITH_PASSWORD, "EXPORTS_DESTINATION": str(tmp_path / "exports")}
    config = ui_resource_config(ledgered_definitions([orders()], environ=environ))
    assert config["ledger"]["url"] == {"env": "EXPORTS_LEDGER_URL"}, "passed by name, as a secret from the environment"
    assert PASSWORD not in json.dumps(config)


def test_an_export_spec_refuses_a_destination_with_a_credential_without_repeating_it():
    with pytest.raises(ConfigurationError) as refused:
        orders(f"s3://AKIAEXAMPLE:{SECRET}@exports-bucket/p")
    message = str(refused.value)
    assert message.startswith("export 'orders': destination carries a user name and password"), message
    assert SECRET not in message

    with pytest.raises(ConfigurationError) as not_a_spec:  # an object where a spec goes: named by its type alone
        orders(S3Destination(bucket="exports-bucket", endpoint_url=f"https://minio:{SECRET}@minio:9000"))
    message = str(not_a_spec.value)
    assert "destination must be a destination spec" in message and "got S3Destination" in message, message
    assert SECRET not in message


# -- 4. a destination's own secrets reach the UI's resource config by name, or are refused ----------------------------

CANARY = "SECRETobj-canary-7c1e"
SAS = f"sv=2022-11-02&ss=b&srt=co&sp=rwdlac&sig={CANARY}"

#: (a destination built in Python with ``secret`` in one of its secret settings, the setting, its variable).
DESTINATIONS_WITH_A_SECRET = [
    pytest.param(lambda secret: S3Destination(bucket="exports-bucket", access_key_id="AKIAEXAMPLE",
                                              secret_access_key=secret),
                 CANARY, "secret_access_key", "AWS_SECRET_ACCESS_KEY", id="s3-secret-access-key"),
    pytest.param(lambda secret: S3Destination(bucket="exports-bucket", session_token=secret),
                 CANARY, "session_token", "AWS_SESSION_TOKEN", id="s3-session-token"),
    pytest.param(lambda secret: AzureDestination(container="exports", azure_account_name="acct",
                                                 azure_account_key=secret),
                 CANARY, "azure_account_key", "AZURE_STORAGE_ACCOUNT_KEY", id="azure-account-key"),
    pytest.param(lambda secret: AzureDestination(container="exports", azure_account_name="acct",
                                                 azure_sas_token=secret),
                 SAS, "azure_sas_token", "AZURE_STORAGE_SAS_TOKEN", id="azure-sas-token"),
    pytest.param(lambda secret: DeltaDestination(table="s3://exports-bucket/t/{export}", secret_access_key=secret),
                 CANARY, "secret_access_key", "AWS_SECRET_ACCESS_KEY", id="delta-secret-access-key"),
    pytest.param(lambda secret: S3Destination(bucket="exports-bucket", endpoint_url=secret),
                 f"https://{CANARY}@minio:9000", "endpoint_url", "AWS_ENDPOINT_URL", id="s3-endpoint-token-as-user"),
    pytest.param(lambda secret: SqlTableDestination(url=secret, table="exported_orders"),
                 LEDGER_WITH_PASSWORD, "ledger_url", "EXPORTS_LEDGER_URL", id="table-url-with-password"),
    pytest.param(lambda secret: WarehouseDestination(table="exported_{export}", warehouse_url=secret),
                 LEDGER_WITH_PASSWORD.replace("/ledger", "/analytics"), "warehouse_url", "EXPORTS_WAREHOUSE_URL",
                 id="warehouse-url-with-password"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "secret", "setting", "variable"), DESTINATIONS_WITH_A_SECRET)
def test_a_destination_objects_secret_given_as_a_value_is_refused_naming_the_setting_and_its_variable(
    make, secret, setting, variable, no_exports_settings, sqlite_url
):
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([orders()], destination=make(secret), environ={"EXPORTS_LEDGER_URL": sqlite_url})
    message = str(refused.value)
    assert CANARY not in message and PASSWORD not in message, f"the refusal repeats the secret: {message}"
    assert message.startswith("the destination argument"), f"the refusal names where it came from: {message}"
    assert setting in message and variable in message and "EnvVar" in message, f"and what to do instead: {message}"


@pytest.mark.parametrize(("make", "secret", "setting", "variable"), DESTINATIONS_WITH_A_SECRET)
def test_a_destination_objects_secret_held_by_its_variable_reaches_dagster_by_name(
    make, secret, setting, variable, no_exports_settings, monkeypatch, sqlite_url
):
    monkeypatch.setenv(variable, secret)  # the code location's environment holds the secret under its own name
    ledger = LedgerResource(url=sqlite_url) if variable != "EXPORTS_LEDGER_URL" else None
    defs = ledgered_definitions([orders()], ledger=ledger, destination=make(secret))

    config = ui_resource_config(defs)
    assert CANARY not in json.dumps(config) and PASSWORD not in json.dumps(config), "a secret in the UI's config"
    values = config["orders__destination"]
    shown = values["ledger_url"] if setting == "ledger_url" else values["settings"][setting]
    assert shown == {"env": variable}, "the secret is passed by its variable's name"
    with dg.build_resources({"destination": defs.resources["orders__destination"]}) as resources:
        assert resources.destination.get_destination() == make(secret), "the variable resolves to the same value"


@pytest.mark.parametrize(
    "destination",
    [
        pytest.param(lambda: DeltaDestination(table=f"s3://AKIAEXAMPLE:{SECRET}@exports-bucket/t/{{export}}"),
                     id="delta-table-url-with-userinfo"),
        pytest.param(lambda: LocalDestination(root=f"exporter:{SECRET}@files.example:/srv/exports"), id="scp-folder"),
        pytest.param(lambda: S3Destination(bucket="exports-bucket", endpoint_url=f"https://minio:{SECRET}@minio:9000"),
                     id="s3-endpoint-with-userinfo"),
    ],
)  # fmt: skip
def test_a_destination_object_whose_spec_or_endpoint_carries_a_credential_is_refused_without_repeating_it(
    destination, no_exports_settings, sqlite_url
):
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([orders()], destination=destination(), environ={"EXPORTS_LEDGER_URL": sqlite_url})
    message = str(refused.value)
    assert message.startswith("the destination argument"), message
    assert SECRET not in message, f"the refusal repeats the secret: {message}"


def test_a_secret_read_from_an_environ_mapping_is_refused_like_the_ledger_url_unless_the_process_holds_it(
    no_exports_settings, monkeypatch, sqlite_url
):
    environ = {
        "EXPORTS_LEDGER_URL": sqlite_url,
        "EXPORTS_DESTINATION": "s3://exports-bucket/p",
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": CANARY,
    }
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([orders()], environ=environ)
    message = str(refused.value)
    assert CANARY not in message, f"the refusal repeats the secret: {message}"
    assert "AWS_SECRET_ACCESS_KEY" in message and "EnvVar" in message, f"it names the variable and the fix: {message}"

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CANARY)  # the same value in the code location's own environment
    config = ui_resource_config(ledgered_definitions([orders()], environ=environ))
    settings = config["orders__destination"]["settings"]
    assert settings["secret_access_key"] == {"env": "AWS_SECRET_ACCESS_KEY"}
    assert settings["access_key_id"] == "AKIAEXAMPLE", "a setting that is no secret stays a value"
    assert CANARY not in json.dumps(config)


# -- 5. EXPORTS_DESTINATION=az://... with its settings in the environment --------------------------------------------


def test_an_azure_destination_from_the_environment_loads_with_its_credentials_and_exports(
    no_exports_settings, monkeypatch, tmp_path, azurite_server, azure_container, instance
):
    """The load-time check of ``EXPORTS_DESTINATION`` builds the destination with the settings it will run with: an
    ``az://`` destination needs its account or endpoint, which are settings, not part of the spec."""
    for name, value in {
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": f"az://{azure_container}/exports",
        "EXPORTS_TENANTS": "acme",
        "EXPORTS_AZURE_ENDPOINT_URL": azurite_server,
        "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
        "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
    }.items():
        monkeypatch.setenv(name, value)

    defs = build_definitions()

    config = ui_resource_config(defs)["invoice_export__destination"]
    assert config["settings"]["azure_account_key"] == {"env": "AZURE_STORAGE_ACCOUNT_KEY"}, "the key is passed by name"
    assert AZURITE_KEY not in json.dumps(ui_resource_config(defs))
    result = run_partition(defs, instance, "2026-03-08")
    assert result.success, failure_message(result)
    key = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    service = BlobServiceClient(azurite_server, credential=key)
    names = [blob.name for blob in service.get_container_client(azure_container).list_blobs()]
    service.close()
    assert any(name.startswith("exports/invoice_export/tenant=acme/date=2026-03-08/") for name in names), names
