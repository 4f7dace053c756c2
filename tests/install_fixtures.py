"""A fresh virtualenv with a non-editable install of this checkout, shared by the tests of an installed
export-ledger (star-imported by conftest.py): the install is most of their time."""

from __future__ import annotations

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
    tests of an installed export-ledger can share it.
    """
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # create-dagster is how Dagster starts a project (`uvx create-dagster project`); it is no dependency of ours.
    # --no-compile halves the install (measured 57 s against 118 s); the modules a command imports compile then.
    packages = [str(PROJECT), "create-dagster==1.13.27"]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, *packages], venv.parent, timeout=900)
    return venv / "bin"


