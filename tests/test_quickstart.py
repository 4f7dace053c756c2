"""The Quickstart's first line, as a newcomer runs it: the UI comes up on the embedded default with nothing to dismiss.

The line is read from the README (the first code block under the Quickstart heading, as ``.ci/run`` reads its second
line); its install part is this test run's own virtualenv, linked into a copy of the repository's tracked files. What a
newcomer must not meet: Dagster's warning that no ``dagster.yaml`` was found, its notice that ``dagster dev`` is
superseded by ``dg dev``, and the first-visit dialog asking for an e-mail address (``shouldShowNux``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.process

PROJECT = Path(__file__).resolve().parent.parent
NOT_FOR_A_NEWCOMER = (
    "No dagster instance configuration file",  # the instance folder holds no dagster.yaml
    "superseded",  # `dagster dev` where Dagster asks for `dg dev`
    "Traceback",
)


def quickstart_lines(readme: str) -> list[str]:
    """The command lines of the first code block after the Quickstart heading (comments and blank lines left out)."""
    lines, heading, block = [], False, False
    for line in readme.splitlines():
        if re.match(r"#+ .*[Qq]uickstart", line):
            heading = True
        elif heading and line.startswith("```"):
            if block:
                break
            block = True
        elif block and line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    return lines


def _tracked_copy(destination: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = PROJECT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_first_line_starts_the_ui_with_no_warning_and_no_dialog(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (PROJECT / ".git").exists():
        pytest.skip("needs the repository's git checkout (its tracked files are what a newcomer clones)")
    first, _ = quickstart_lines((PROJECT / "README.md").read_text())
    install, launch = first.rsplit(" && ", 1)
    assert install.startswith("python3 -m venv .venv && .venv/bin/pip install"), install
    port = _free_port()
    assert launch.endswith("-p 3000"), launch
    launch = launch.removesuffix("3000") + str(port)

    checkout = tmp_path / "export-ledger"
    _tracked_copy(checkout)
    assert (checkout / ".dagster_home" / "dagster.yaml").is_file(), "the Quickstart's instance file is tracked"
    (checkout / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the install this test run made
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "DAGSTER_"))}
    env["DAGSTER_DG_UPDATE_CHECK_ENABLED"] = "0"  # no look-up of newer releases from a test
    log = tmp_path / "line1.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", launch], cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        shown = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                shown = requests.post(
                    f"{url}/graphql",
                    json={"query": "{ shouldShowNux workspaceOrError { ... on Workspace { locationEntries { "
                          "name loadStatus } } } }"},
                    timeout=10,
                ).json()["data"]  # fmt: skip
                if all(e["loadStatus"] == "LOADED" for e in shown["workspaceOrError"]["locationEntries"]):
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        output = log.read_text(errors="replace")
        assert shown is not None, f"the UI never answered on {url}:\n{output[-3000:]}"
        assert [e["loadStatus"] for e in shown["workspaceOrError"]["locationEntries"]] == ["LOADED"], output[-3000:]
        assert shown["shouldShowNux"] is False, "the first-visit dialog would cover the page"
        time.sleep(3)  # the daemon's first lines come after the webserver's
        output = log.read_text(errors="replace")
        met = [text for text in NOT_FOR_A_NEWCOMER if text in output]
        assert not met, f"the first line prints {met}:\n{output[-3000:]}"
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                os.killpg(process.pid, signal.SIGKILL)  # the webserver and daemon dg started, if still there
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                pass
            break
