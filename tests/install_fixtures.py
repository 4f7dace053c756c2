"""A fresh virtualenv with a non-editable install of this checkout, shared by the tests of an installed
export-ledger (star-imported by conftest.py): the install is most of their time."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent.parent


def _run(args: list[str], cwd: Path, timeout: int) -> None:
    done = subprocess.run(args, cwd=cwd, env=dict(os.environ), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{(done.stdout + done.stderr)[-4000:]}"


@pytest.fixture(scope="session")
def fresh_install(tmp_path_factory) -> Path:
    """The bin folder of a fresh virtualenv holding a non-editable install of this checkout, and create-dagster.

    The install is most of the marked test's time (about two minutes on 2 cores): a session fixture, so that other
    tests of an installed export-ledger can share it. Under ``pytest -n`` each worker has a session of its own: the
    install is made once, under a file lock, in the folder the workers' temporary folders share, and the others wait
    for it and use it.
    """
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-of-<user>/pytest-N/, beside each worker's popen-gwK/
    root = shared / "fresh-install"
    root.mkdir(exist_ok=True)
    venv, done = root / "venv", root / "installed"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            # create-dagster is how Dagster starts a project (`uvx create-dagster project`); it is no dependency of
            # ours. --no-compile halves the install (measured 57 s against 118 s); the modules a command imports
            # compile then.
            packages = [str(PROJECT), "create-dagster==1.13.27"]
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
            _run([*pip, *packages], root, timeout=900)
            done.touch()
    return venv / "bin"
