"""Pytest fixtures for the warehouse destination: a database that is not the ledger's, on each of its real servers.

* MariaDB: Debian's ``mariadbd``, one per session, initialized in a temporary folder and started on a free
  127.0.0.1 port with a socket of its own (never the machine's own server); each test gets a fresh database and a user
  with rights on that database only.
* PostgreSQL: the test server's (127.0.0.1:5432); each test gets a fresh database and a login role that may connect
  to it and create in its ``public`` schema, nothing else; both dropped after the test.
* DuckDB: a file in the test's folder.

Without ``mariadbd`` or PostgreSQL the tests skip with the reason; with ``CI=true`` that is an error.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from cloud_fixtures import _free_port, _unavailable
from s3_support import LOOPBACK

__all__ = ["WAREHOUSE_KINDS", "mariadb_server", "warehouse_destination", "warehouse_url"]

WAREHOUSE_KINDS = ("postgres", "mariadb", "duckdb")
MARIADBD = os.environ.get("EXPORTS_TEST_MARIADBD", "/usr/sbin/mariadbd")
_READY_SECONDS = 30.0


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[dict]:
    """A MariaDB server of the session's own: ``{"port", "socket"}``; root connects through the socket only."""
    install = shutil.which("mariadb-install-db")
    if not Path(MARIADBD).exists() or install is None:
        _unavailable(f"MariaDB is not installed ({MARIADBD}, mariadb-install-db); apt-get install mariadb-server")
    folder = Path(tempfile.mkdtemp(prefix="export-ledger-mariadb-"))
    data, socket_path = folder / "data", folder / "mariadb.sock"
    as_root = ["--user=root"] if os.geteuid() == 0 else []
    installed = subprocess.run(
        [install, "--no-defaults", f"--datadir={data}", *as_root, "--auth-root-authentication-method=normal",
         "--skip-test-db"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if installed.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        said = (installed.stderr or installed.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"mariadb-install-db exited with {installed.returncode}:\n" + "\n".join(said))
    port = _free_port()
    process = subprocess.Popen(
        [MARIADBD, "--no-defaults", f"--datadir={data}", f"--socket={socket_path}", f"--port={port}",
         f"--bind-address={LOOPBACK}", *as_root, f"--pid-file={folder / 'mariadb.pid'}",
         f"--log-error={folder / 'error.log'}", "--innodb-buffer-pool-size=32M", "--skip-name-resolve"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + _READY_SECONDS
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"mariadbd exited with {process.returncode}; see {folder / 'error.log'}")
            try:
                with _mariadb_admin(socket_path).connect():
                    break
            except sa.exc.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mariadbd did not answer in time") from None
                time.sleep(0.1)
        yield {"port": port, "socket": str(socket_path)}
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _mariadb_admin(socket_path) -> sa.Engine:
    return sa.create_engine(
        "mysql+pymysql://root@localhost/", connect_args={"unix_socket": str(socket_path)}, poolclass=sa.pool.NullPool
    )


def _mariadb_url(request) -> Iterator[str]:
    server = request.getfixturevalue("mariadb_server")
    name = f"wh_{uuid.uuid4().hex[:12]}"
    password = uuid.uuid4().hex
    admin = _mariadb_admin(server["socket"])
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
        conn.execute(sa.text(f"CREATE USER '{name}'@'{LOOPBACK}' IDENTIFIED BY :password"), {"password": password})
        # Its own database only: tables, rows, and nothing of the server's.
        conn.execute(sa.text(f"GRANT SELECT, INSERT, UPDATE, DELETE, CREATE ON {name}.* TO '{name}'@'{LOOPBACK}'"))
    try:
        yield f"mysql+pymysql://{name}:{password}@{LOOPBACK}:{server['port']}/{name}"
    finally:
        from export_ledger.destinations.warehouse import dispose_engines

        dispose_engines()  # else its pooled connections outlive the user: more per test, up to max_connections
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name}"))
            conn.execute(sa.text(f"DROP USER '{name}'@'{LOOPBACK}'"))
        admin.dispose()


def _postgres_url(request) -> Iterator[str]:
    admin_url = sa.make_url(request.getfixturevalue("postgres_admin_url"))
    name = f"wh_{uuid.uuid4().hex[:12]}"
    password = uuid.uuid4().hex
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'"))
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
        conn.execute(sa.text(f"REVOKE ALL ON DATABASE {name} FROM PUBLIC"))
        conn.execute(sa.text(f"GRANT CONNECT ON DATABASE {name} TO {name}"))
    in_database = sa.create_engine(
        admin_url.set(database=name), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )
    with in_database.connect() as conn:
        conn.execute(sa.text("REVOKE ALL ON SCHEMA public FROM PUBLIC"))
        conn.execute(sa.text(f"GRANT USAGE, CREATE ON SCHEMA public TO {name}"))
    in_database.dispose()
    try:
        yield str(admin_url.set(username=name, password=password, database=name).render_as_string(hide_password=False))
    finally:
        from export_ledger.destinations.warehouse import dispose_engines

        dispose_engines()  # its pooled connections would keep the database from being dropped
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
            conn.execute(sa.text(f"DROP ROLE {name}"))
        admin.dispose()


@pytest.fixture(params=WAREHOUSE_KINDS)
def warehouse_url(request, tmp_path) -> Iterator[str]:
    """The URL of a fresh warehouse database of each kind, as a limited user of it."""
    yield from _warehouse_url(request.param, request, tmp_path)


def _warehouse_url(kind: str, request, tmp_path) -> Iterator[str]:
    if kind == "postgres":
        yield from _postgres_url(request)
    elif kind == "mariadb":
        yield from _mariadb_url(request)
    elif kind == "duckdb":
        yield f"duckdb:///{tmp_path / 'warehouse.duckdb'}"
        from export_ledger.destinations.warehouse import dispose_engines

        dispose_engines()
    else:
        raise AssertionError(f"no warehouse of kind {kind!r}")


def warehouse_destination(kind: str, request, tmp_path, table: str = "exported_{export}"):
    """A warehouse destination on a fresh database of ``kind`` (dropped after the test)."""
    from export_ledger.destinations.warehouse import WarehouseDestination

    urls = _warehouse_url(kind, request, tmp_path)
    url = next(urls)
    request.addfinalizer(lambda: next(urls, None))
    return WarehouseDestination(table=table, warehouse_url=url)
