"""Pytest fixtures for object-storage tests: a moto S3 server, a fresh bucket per test, a fault proxy.

Meant for ``from s3_fixtures import *  # noqa`` in conftest.py; until then a test module imports the fixtures it uses
by name. boto3 and moto are imported when a fixture first runs, not when this module is imported.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from s3_support import FaultProxy, start_s3_server, stop_s3_server

__all__ = ["fault_proxy", "s3", "s3_bucket", "s3_credentials", "s3_environment", "s3_server"]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1, one for the session."""
    server, endpoint_url = start_s3_server()
    try:
        yield endpoint_url
    finally:
        stop_s3_server(server)


@pytest.fixture
def s3_credentials() -> dict[str, str]:
    """Dummy credentials and region, as keyword arguments for ``boto3.client("s3", ...)``."""
    return {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


@pytest.fixture
def s3_environment(s3_credentials: dict[str, str], monkeypatch) -> dict[str, str]:
    """The dummy credentials in the process environment, as a deployment holds its own: a destination built in Python
    with them reaches Dagster by name (``EnvVar("AWS_SECRET_ACCESS_KEY")``), and one holding a secret the environment
    does not is refused. A test that sets other values sets them after this fixture."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    return s3_credentials


@pytest.fixture
def s3_bucket(s3_server: str, s3_credentials: dict[str, str], s3_environment) -> Iterator[str]:
    """A new, empty bucket on ``s3_server`` (``exports-<hex>``), emptied and deleted afterwards; the credentials are
    in the environment (:func:`s3_environment`)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    name = f"exports-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for item in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=item["Key"])
        client.delete_bucket(Bucket=name)
        client.close()


@pytest.fixture
def s3(s3_server: str, s3_credentials: dict[str, str]):
    """A client on the moto server itself, never through a proxy: what the bucket really holds, whatever the proxy
    does."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    yield client
    client.close()


@pytest.fixture
def fault_proxy(s3_server: str) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of ``s3_server``, passing everything through until a test injects a fault."""
    with FaultProxy(s3_server) as proxy:
        yield proxy
