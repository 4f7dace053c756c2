"""The deploy files run what they say (issue 26): each launcher config in deploy/ gives a run worker every setting it
needs, and a run worker started with exactly what a config gives it, in an install made as deploy/Dockerfile makes
the image, exports.

No container runtime is needed. :func:`build_image` does what each instruction of the Dockerfile does, in a folder
standing for the image's filesystem: its ``COPY`` s, its ``ENV``, its one ``pip install`` (into a fresh virtualenv
standing for the base image's Python). A run worker is then a fresh ``dagster asset materialize`` process in the
image's working directory, whose environment is built from scratch: the image's ``ENV``, what the launcher config
passes (its own values, and the values of the names it takes from the deployment), ``PATH`` and ``HOME``; nothing from
this process. The one addition is ``AWS_ENDPOINT_URL``, where moto stands in for S3.
"""

from __future__ import annotations

import hashlib
import io
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
import sqlalchemy as sa
import yaml
from builders import BUSINESS_DATE, open_ledger, sql_invoices
from pipeline_helpers import finish
from sqlalchemy.engine import make_url

from definitions import RUN_WORKER_SETTINGS, SOURCE_SETTINGS
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import ExportState, dispose_engines

PROJECT = Path(__file__).resolve().parent.parent
DEPLOY = PROJECT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKER, K8S = "run-launcher-docker.yaml", "run-launcher-k8s.yaml"
LAUNCHERS = (DOCKER, K8S)
PARTITION = BUSINESS_DATE.isoformat()
EXPORT = "invoice_export"


# -- reading the deploy files -----------------------------------------------------------------------------------------


def instance_settings() -> set[str]:
    """The variables deploy/dagster.yaml reads (``{env: NAME}``): a run worker loads this instance too."""
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if set(node) == {"env"}:
                found.add(node["env"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load((DEPLOY / "dagster.yaml").read_text()))
    return found


def manifests() -> dict[tuple[str, str], dict]:
    """Every Kubernetes object in deploy/, by kind and name."""
    found = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if isinstance(document, dict) and "kind" in document:
                found[(document["kind"], document["metadata"]["name"])] = document
    return found


def launcher_config(launcher: str) -> dict:
    return yaml.safe_load((DEPLOY / launcher).read_text())["run_launcher"]["config"]


@dataclass(frozen=True)
class LauncherEnvironment:
    """What a run worker started by one launcher config is given, besides the image's ``ENV``.

    Attributes:
        fixed: Variables whose value the deploy files fix (``NAME=value`` entries, a ConfigMap's data, the
            Kubernetes launcher's ``dagster_home``).
        supplied: Variables whose value the deployment supplies: from the daemon's environment (a bare ``NAME`` of the
            Docker launcher's ``env_vars``) or a Secret's values.
    """

    fixed: dict[str, str]
    supplied: tuple[str, ...]

    @property
    def names(self) -> set[str]:
        return set(self.fixed) | set(self.supplied)

    def environment(self, deployment: dict[str, str]) -> dict[str, str]:
        missing = [name for name in self.supplied if name not in deployment]
        assert not missing, f"the test's deployment has no value for {missing}"
        return {**{name: deployment[name] for name in self.supplied}, **self.fixed}


def launcher_environment(launcher: str) -> LauncherEnvironment:
    config = launcher_config(launcher)
    objects = manifests()
    fixed: dict[str, str] = {}
    supplied: list[str] = []
    for entry in config.get("env_vars", []):
        name, given, value = entry.partition("=")
        if given:
            fixed[name] = value
        else:
            supplied.append(name)
    for name in config.get("env_config_maps", []):
        assert ("ConfigMap", name) in objects, f"deploy/{launcher} names ConfigMap {name!r}, which deploy/ lacks"
        fixed.update({key: str(value) for key, value in objects[("ConfigMap", name)]["data"].items()})
    for name in config.get("env_secrets", []):
        assert ("Secret", name) in objects, f"deploy/{launcher} names Secret {name!r}, which deploy/ lacks"
        supplied.extend(objects[("Secret", name)]["stringData"])
    if "dagster_home" in config:
        fixed["DAGSTER_HOME"] = config["dagster_home"]
    return LauncherEnvironment(fixed, tuple(supplied))


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments left out."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def dockerfile_env() -> dict[str, str]:
    return dict(
        pair.split("=", 1) for instruction, args in dockerfile_instructions() if instruction == "ENV"
        for pair in shlex.split(args)
    )  # fmt: skip


# -- what the deploy files must say -----------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_launcher_config_gives_a_run_worker_every_setting_it_needs_and_one_source(launcher):
    given = launcher_environment(launcher).names | set(dockerfile_env())
    needed = {*RUN_WORKER_SETTINGS, *instance_settings(), "DAGSTER_HOME"}

    missing = sorted(needed - given)
    assert missing == [], f"deploy/{launcher} gives a run worker no {missing}: it would build another export"
    chosen = [choice for choice, names in SOURCE_SETTINGS.items() if set(names) & given]
    assert len(chosen) == 1 and set(SOURCE_SETTINGS[chosen[0]]) <= given, (
        f"deploy/{launcher} gives a run worker exactly one whole source: {sorted(given)}"
    )


def test_no_user_facing_file_points_at_a_folder_outside_the_project():
    user_facing = [*DEPLOY.iterdir(), PROJECT / "pyproject.toml", PROJECT / "README.md", PROJECT / "CHANGELOG.md",
                   PROJECT / "mkdocs.yml", *(PROJECT / "docs").rglob("*")]
    pointing = [
        str(path.relative_to(PROJECT))
        for path in user_facing
        if path.is_file() and path.suffix != ".png" and "../shared" in path.read_text()
    ]
    assert pointing == [], "a user's clone has no ../shared folder"


# -- the image, without Docker ----------------------------------------------------------------------------------------


@dataclass
class Image:
    """deploy/Dockerfile's result as a folder: ``root`` stands for ``/``, ``python`` for the base image's Python."""

    root: Path
    python: Path
    workdir: Path = None
    env: dict[str, str] = field(default_factory=dict)
    instance_file: str = ""  # the instance file as the image holds it, before a launcher section is added

    def at(self, path: str) -> Path:
        return self.root / path.lstrip("/")


def build_image(root: Path) -> Image:
    """Does what each instruction of deploy/Dockerfile does; an instruction it does not know fails the test."""
    venv = root / "base-python"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    image = Image(root=root / "fs", python=venv / "bin" / "python")
    image.workdir = image.root
    for instruction, args in dockerfile_instructions():
        if instruction in ("FROM", "EXPOSE", "CMD"):
            continue
        if instruction == "WORKDIR":
            image.workdir = image.at(args)
            image.workdir.mkdir(parents=True, exist_ok=True)
        elif instruction == "ENV":
            for pair in shlex.split(args):
                name, value = pair.split("=", 1)
                image.env[name] = str(image.at(value)) if value.startswith("/") else value
        elif instruction == "COPY":
            *sources, target = shlex.split(args)
            into = image.at(target) if target.startswith("/") else image.workdir / target
            for source in (PROJECT / s for s in sources):
                if source.is_dir():  # Docker copies a folder's contents
                    shutil.copytree(source, into, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
                else:
                    folder = target.endswith("/") or len(sources) > 1
                    (into if folder else into.parent).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, into / source.name if folder else into)
        elif instruction == "RUN":
            words = shlex.split(args)
            assert words[:2] == ["pip", "install"], f"deploy/Dockerfile: this test runs only `pip install`: {args}"
            # pip's cache is kept (--no-cache-dir changes where packages come from, not which are installed);
            # --no-compile halves the install.
            requirements = [w for w in words[2:] if w != "--no-cache-dir"]
            pip = [str(image.python), "-m", "pip", "install", "-q", "--no-compile", *requirements]
            done = subprocess.run(pip, cwd=image.workdir, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"{args} failed:\n{(done.stdout + done.stderr)[-4000:]}"
        else:
            pytest.fail(f"deploy/Dockerfile: {instruction} is an instruction this test does not know how to do")
    image.instance_file = (Path(image.env["DAGSTER_HOME"]) / "dagster.yaml").read_text()
    return image


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Image:
    return build_image(tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="module")
def dagster_database(postgres_admin_url: str) -> Iterator[dict[str, str]]:
    """A PostgreSQL database for the instance's storage (deploy/dagster.yaml), as its DAGSTER_PG_* settings."""
    admin_url = make_url(postgres_admin_url)
    database = f"deploy_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{database}"'))  # a generated name; DDL takes no bind parameters
    try:
        yield {
            "DAGSTER_PG_USERNAME": admin_url.username or "postgres",
            "DAGSTER_PG_PASSWORD": admin_url.password or "",
            "DAGSTER_PG_HOST": admin_url.host or "127.0.0.1",
            "DAGSTER_PG_PORT": str(admin_url.port or 5432),
            "DAGSTER_PG_DB": database,
        }
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def k8s_bucket(s3_server: str, s3_credentials: dict[str, str]) -> Iterator[object]:
    """The bucket deploy/k8s-settings.yaml's destination names, on moto, empty, and emptied and deleted afterwards."""
    import boto3

    bucket = launcher_environment(K8S).fixed["EXPORTS_DESTINATION"].removeprefix("s3://").split("/", 1)[0]
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    client.create_bucket(Bucket=bucket)
    try:
        yield client
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=item["Key"])
        client.delete_bucket(Bucket=bucket)
        client.close()


@dataclass
class Deployment:
    """What the operators of this deployment set, on this machine's services: the value of every name a launcher
    config takes from them (the Docker daemon's environment, the Kubernetes Secret's values)."""

    values: dict[str, str]
    ledger_url: str
    invoice_ids: dict[str, list[str]]


@pytest.fixture
def deployment(image, dagster_database, postgres_url, tmp_path) -> Deployment:
    source_url = f"sqlite:///{tmp_path / 'billing.sqlite3'}"
    ids = sql_invoices(source_url, BUSINESS_DATE, ("acme", "globex", "initech"))  # deploy/k8s-settings.yaml's tenants
    volume = launcher_config(DOCKER)["container_kwargs"]["volumes"][0].split(":")[1]  # where the Docker volume mounts
    shutil.rmtree(image.at(volume), ignore_errors=True)  # each test's deployment has a volume of its own
    values = {
        **dagster_database,
        "EXPORTS_LEDGER_URL": postgres_url,
        "EXPORTS_DESTINATION": str(image.at(volume)),
        "EXPORTS_TENANTS": "acme,globex",  # not the default three: a worker that lost it would export all three
        "EXPORTS_FILE_FORMAT": "parquet",  # not the default: a worker that lost it would write csv
        "EXPORTS_LEASE_TTL_SECONDS": "600",
        "EXPORTS_SOURCE_URL": source_url,
        "EXPORTS_SOURCE_TABLE": "invoices",
        "AWS_ACCESS_KEY_ID": "testing",  # moto takes any credentials
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    return Deployment(values, postgres_url, ids)


def run_worker(image: Image, launcher: str, environment: dict[str, str]) -> tuple[int, str]:
    """``dagster asset materialize`` of one partition in the image, with ``environment``, ``PATH`` and ``HOME`` only,
    on the image's instance file with the launcher's section added (as the README says to)."""
    instance = Path(environment["DAGSTER_HOME"]) / "dagster.yaml"
    instance.write_text(image.instance_file + "\n" + (DEPLOY / launcher).read_text())
    home = image.at("/root")
    home.mkdir(exist_ok=True)
    process = subprocess.Popen(
        [str(image.python.parent / "dagster"), "asset", "materialize", "-f", "definitions.py",
         "--select", EXPORT, "--partition", PARTITION],
        cwd=image.workdir,
        env={**environment, "PATH": f"{image.python.parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    return finish(process, timeout=300)


def worker_environment(image: Image, launcher: str, deployment: Deployment, s3_server: str) -> dict[str, str]:
    given = launcher_environment(launcher)
    environment = {**image.env, **given.environment(deployment.values)}
    if "DAGSTER_HOME" in given.fixed:  # the Kubernetes launcher's dagster_home, a path in the image
        environment["DAGSTER_HOME"] = str(image.at(given.fixed["DAGSTER_HOME"]))
    if environment["EXPORTS_DESTINATION"].startswith("s3://"):
        environment["AWS_ENDPOINT_URL"] = s3_server  # moto standing in for S3: the one variable the test adds
    return environment


def published(location: str, s3) -> tuple[str, bytes]:
    """The data file's name and bytes at a recorded location (a place folder or an s3:// place), by its manifest."""
    if location.startswith("s3://"):
        bucket, _, prefix = location.removeprefix("s3://").rstrip("/").partition("/")

        def read(name: str) -> bytes:
            return s3.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()
    else:

        def read(name: str) -> bytes:
            return (Path(location) / name).read_bytes()

    manifest = Manifest.from_json(read(MANIFEST_NAME), location)
    return manifest.data_file, read(manifest.data_file)


# -- a run worker with exactly what a launcher config gives it -------------------------------------------------------


@pytest.mark.process
@pytest.mark.postgres
@pytest.mark.xdist_group("deploy_image")  # one worker makes the image and runs every test of it
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_run_worker_given_exactly_what_a_launcher_config_passes_exports_and_records_completed(
    launcher, image, deployment, s3_server, request
):
    environment = worker_environment(image, launcher, deployment, s3_server)
    s3 = request.getfixturevalue("k8s_bucket") if environment["EXPORTS_DESTINATION"].startswith("s3://") else None

    code, output = run_worker(image, launcher, environment)

    assert code == 0, f"the run worker of deploy/{launcher} failed:\n{output[-4000:]}"
    records = {r.tenant: r for r in open_ledger(deployment.ledger_url).queries.records(export=EXPORT)}
    dispose_engines()
    tenants = environment["EXPORTS_TENANTS"].split(",")
    assert sorted(records) == sorted(tenants), "one key per tenant the config names, in the deployment's ledger"
    for tenant, record in records.items():
        assert record.state is ExportState.COMPLETED, f"{tenant}: {record.state}"
        assert record.location.startswith(environment["EXPORTS_DESTINATION"]), "at the config's destination"
        name, payload = published(record.location, s3)
        assert hashlib.sha256(payload).hexdigest() == record.sha256, f"{tenant}: what is there is what was recorded"
        assert name.endswith(".parquet"), f"{tenant}: the format the config names, got {name}"
        frame = pd.read_parquet(io.BytesIO(payload))
        assert list(frame["invoice_id"]) == deployment.invoice_ids[tenant], "the source's rows, not the sample's"


@pytest.mark.process
@pytest.mark.postgres
@pytest.mark.xdist_group("deploy_image")
@pytest.mark.parametrize(
    ("dropped", "expected"),
    [
        (SOURCE_SETTINGS["sql"], "no invoice source: set EXPORTS_SOURCE=sample"),
        (("EXPORTS_SOURCE_TABLE",), "EXPORTS_SOURCE_URL is set without EXPORTS_SOURCE_TABLE"),
    ],
    ids=["no-source-setting", "no-table"],
)
def test_a_run_worker_whose_launcher_config_lost_a_source_setting_refuses_naming_it(
    dropped, expected, image, deployment, s3_server
):
    environment = worker_environment(image, DOCKER, deployment, s3_server)
    for name in dropped:  # as the launcher configs on 8fa414b passed none of them
        environment.pop(name, None)

    code, output = run_worker(image, DOCKER, environment)

    assert code != 0 and expected in output, f"the worker refuses, naming the setting:\n{output[-3000:]}"
    assert open_ledger(deployment.ledger_url).queries.records() == [], "no key claimed, none recorded completed"
    dispose_engines()
    volume = Path(environment["EXPORTS_DESTINATION"])
    assert not volume.exists() or not any(volume.rglob("*")), "nothing was published"
