"""Pytest fixtures of the harnesses, loaded by the test modules that need them with
``pytest_plugins = ["harness.fixtures"]``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.forkserver import ForkServer


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory) -> Iterator[ForkServer]:
    """One fork server for the whole session (it starts in about 2 s: the imports every child then shares)."""
    server = ForkServer(tmp_path_factory.mktemp("forkserver") / "server.log")
    yield server
    server.close()
