"""The Azurite install the Azure tests make on first use (tests/cloud_fixtures.py), with a stand-in npm and node on
PATH: a first run that was interrupted, or a machine whose Node.js is too old, must not turn every Azure test into an
error on the next run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import cloud_fixtures
import pytest

FAKE_NPM = """#!/bin/sh
# npm install --no-audit --no-fund --prefix FOLDER azurite@VERSION: leaves an azurite-blob that answers --version.
echo "$@" >> "$NPM_CALLS"
prefix="$5"
mkdir -p "$prefix/node_modules/.bin"
printf '#!/bin/sh\\necho %s\\n' "${6#azurite@}" > "$prefix/node_modules/.bin/azurite-blob"
chmod +x "$prefix/node_modules/.bin/azurite-blob"
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """A bin folder with a stand-in npm and node first on PATH, and the Azurite folder the fixture installs into."""
    bin_dir = tmp_path / "bin"
    _executable(bin_dir / "npm", FAKE_NPM)
    _executable(bin_dir / "node", "#!/bin/sh\necho v20.11.1\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NPM_CALLS", str(tmp_path / "npm-calls"))
    monkeypatch.setenv("EXPORTS_TEST_AZURITE_DIR", str(tmp_path / "azurite"))
    monkeypatch.delenv("CI", raising=False)
    return tmp_path


def _npm_calls(tools: Path) -> int:
    calls = tools / "npm-calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_an_install_an_interrupted_run_left_half_made_is_made_again_then_reused(tools):
    """Guard: the ``--version`` check. Without it the broken script would be started, and every Azure test error."""
    _executable(tools / "azurite" / "node_modules" / ".bin" / "azurite-blob", "#!/bin/sh\nexit 1\n")

    binary = cloud_fixtures._azurite_binary()

    assert _npm_calls(tools) == 1, "the half-made install is made again"
    assert os.popen(f"{binary} --version").read().strip() == cloud_fixtures.AZURITE_VERSION
    cloud_fixtures._azurite_binary()
    assert _npm_calls(tools) == 1, "a verified install is reused, not made again"


def test_a_node_older_than_20_skips_with_the_reason_instead_of_failing_every_start(tools):
    _executable(tools / "bin" / "node", "#!/bin/sh\necho v18.19.0\n")

    with pytest.raises(pytest.skip.Exception, match="needs Node.js 20 or newer; this machine's node is 'v18.19.0'"):
        cloud_fixtures._azurite_binary()
    assert _npm_calls(tools) == 0
