"""Shared fixtures: ledger backends (SQLite always, PostgreSQL when reachable), a controllable clock, project defs.

PostgreSQL: tests marked ``postgres`` run against 127.0.0.1:5432 (override with ``EXPORTS_TEST_POSTGRES_URL``), each
in a schema of its own that is dropped afterwards. Without a server they skip with the reason; with ``CI=true`` a
missing server is an error, never a silent skip.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import dagster as dg
import pytest
import sqlalchemy as sa
from builders import LEDGER_LEASE, open_ledger
from cloud_fixtures import *  # noqa: F403  (gcs_server, gcs_bucket, azurite_server, azure_container, ...)
from install_fixtures import fresh_install  # noqa: F401  (a shared non-editable install)
from s3_fixtures import *  # noqa: F403  (s3_server, s3_credentials, s3_bucket, s3, fault_proxy)
from sftp_fixtures import *  # noqa: F403  (sftp_server, sftp_folder)
from warehouse_fixtures import *  # noqa: F403  (mariadb_server, warehouse_url)

from export_ledger.dagster import LedgerResource
from export_ledger.destinations import LocalDestination
from export_ledger.ledger import dispose_engines

UTC = dt.timezone.utc

# The reference code location has no default source (issue 26): the test session chooses the sample explicitly, as the
# Quickstart's first line does, before a test module imports definitions.py (it builds its `defs` at import) and for
# every `dagster ... -f definitions.py` a test starts with this environment. A SQL source in the shell that runs the
# tests is no choice of theirs. Tests of the choice itself give their own environment.
os.environ["EXPORTS_SOURCE"] = "sample"
for _name in ("EXPORTS_SOURCE_URL", "EXPORTS_SOURCE_TABLE"):
    os.environ.pop(_name, None)
POSTGRES_ADMIN_URL = os.environ.get(
    "EXPORTS_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


def postgres_unavailable_reason() -> str | None:
    engine = sa.create_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return None
    except Exception as exc:  # any failure to connect is a reason to skip (or, in CI, to fail)
        return f"PostgreSQL not reachable at {engine.url.render_as_string(hide_password=True)}: {type(exc).__name__}"
    finally:
        engine.dispose()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` every test marked ``xdist_group`` must carry its group in its node id (what the
    scheduler reads): without it, the tests of a group run on any worker and each worker makes the group's expensive
    fixtures again (a fresh install, the deploy image, the benchmark smoke run). pytest 9.2 with pytest-xdist 3.8 drops
    it silently (pytest-xdist#1386)."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        message = (
            f"--dist loadgroup: {len(lost)} test(s) marked xdist_group lost their group (first: {lost[0]}); "
            "this pytest and pytest-xdist do not work together (pytest-xdist#1386): install pytest<9.2"
        )
        sys.stderr.write(message + "\n")  # a worker's error reaches the controller as an internal error only
        raise pytest.UsageError(message)


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    reason = postgres_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}; start it with: pg_ctlcluster <version> main start")
        pytest.skip(reason)
    return POSTGRES_ADMIN_URL


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A URL whose connections live in a fresh schema (``search_path``), dropped after the test."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_admin_url)
    with admin.begin() as conn:
        conn.execute(sa.schema.CreateSchema(schema))
    separator = "&" if "?" in postgres_admin_url else "?"
    url = f"{postgres_admin_url}{separator}options={quote(f'-csearch_path={schema}')}"
    try:
        yield url
    finally:
        dispose_engines()
        with admin.begin() as conn:
            conn.execute(sa.schema.DropSchema(schema, cascade=True))
        admin.dispose()


@pytest.fixture
def instance():
    """A Dagster instance in memory: runs and asset events are recorded and read back like any instance's, and it
    starts in milliseconds."""
    return dg.DagsterInstance.ephemeral()


@pytest.fixture
def sqlite_url(tmp_path) -> Iterator[str]:
    yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    dispose_engines()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request) -> str:
    """The ledger URL of each backend in turn: the contract suites run once per backend."""
    return request.getfixturevalue(f"{request.param}_url")


class Clock:
    """A controllable clock for ledgers and resources: starts at ``start`` and moves only when told."""

    def __init__(self, start: dt.datetime) -> None:
        self.now = start

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, **delta) -> dt.datetime:
        self.now += dt.timedelta(**delta)
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock(dt.datetime(2026, 3, 20, 9, 30, tzinfo=UTC))  # after every window the tests export


@pytest.fixture
def ledger(request, clock: Clock):
    """A ledger on the ``clock`` fixture with a 15-minute lease: on SQLite, or on each backend in turn for a test that
    runs on each (it asks for ``ledger_url`` too, or its module is marked ``pytest.mark.usefixtures("ledger_url")``)."""
    url = request.getfixturevalue("ledger_url" if "ledger_url" in request.fixturenames else "sqlite_url")
    return open_ledger(url, clock=clock, lease_ttl=LEDGER_LEASE)


@pytest.fixture
def local(tmp_path) -> LocalDestination:
    """A local destination in the test's folder (``exports``)."""
    return LocalDestination(str(tmp_path / "exports"))


class ClockedLedgerResource(LedgerResource):
    """The project's ledger resource with its clock read from a shared :class:`Clock` (set by the test)."""

    clock_id: str

    def clock(self) -> dt.datetime:
        return _CLOCKS[self.clock_id]()


_CLOCKS: dict[str, Clock] = {}


@pytest.fixture
def clocked_ledger(clock: Clock, sqlite_url: str):
    """A ledger resource on SQLite driven by the ``clock`` fixture."""
    clock_id = uuid.uuid4().hex
    _CLOCKS[clock_id] = clock
    yield ClockedLedgerResource(url=sqlite_url, clock_id=clock_id)
    _CLOCKS.pop(clock_id, None)


@pytest.fixture(autouse=True)
def _wide_cli_tables(monkeypatch) -> None:
    """CLI tables fit the terminal (100 columns when it is not one); tests that read their cells by position read
    them unwrapped. A test of the width sets COLUMNS itself."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture(autouse=True)
def _virtualenv_on_path(monkeypatch) -> None:
    """The shell a printed command is pasted in finds this interpreter's ``dagster`` first, as in an activated
    virtualenv: commands read ``dagster ...`` (:func:`export_ledger.operations.dagster_program`). A test of the other
    case sets PATH itself."""
    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join([bin_dir, os.environ.get("PATH", "")]))
