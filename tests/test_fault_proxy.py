"""The fault proxy and the moto server behave as the S3 destination relies on, seen through plain boto3.

Every object check after a fault goes straight to the server, never through the proxy. Clients make one attempt
with 2 s timeouts unless a test says otherwise, so each fault surfaces as exactly one botocore exception.
"""

from __future__ import annotations

import http.client
import threading
import time

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from s3_support import Fault, FaultProxy

ONE_ATTEMPT = Config(retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=4)  # roomy under load


@pytest.fixture
def client(fault_proxy, s3_credentials):
    """boto3 S3 client through the proxy: one attempt, 2 s connect and read timeouts."""
    s3 = boto3.client("s3", endpoint_url=fault_proxy.endpoint_url, config=ONE_ATTEMPT, **s3_credentials)
    yield s3
    s3.close()


@pytest.fixture
def direct(s3_server, s3_credentials):
    """boto3 S3 client straight to the server: the truth about what landed."""
    s3 = boto3.client("s3", endpoint_url=s3_server, config=ONE_ATTEMPT, **s3_credentials)
    yield s3
    s3.close()


def stored_body(direct, bucket: str, key: str) -> bytes | None:
    try:
        return direct.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "NoSuchKey":
            return None
        raise


def faults_applied(proxy: FaultProxy) -> list[Fault]:
    return [request.fault for request in proxy.history]


def test_put_and_get_pass_through_unchanged(client, direct, fault_proxy, s3_bucket):
    client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows", Metadata={"export-id": "42"})

    assert client.get_object(Bucket=s3_bucket, Key="part-0.parquet")["Body"].read() == b"rows"
    assert client.head_object(Bucket=s3_bucket, Key="part-0.parquet")["Metadata"] == {"export-id": "42"}
    assert stored_body(direct, s3_bucket, "part-0.parquet") == b"rows"
    assert fault_proxy.forwarded == {"PUT": 1, "GET": 1, "HEAD": 1}, "with no fault every request is forwarded"
    assert faults_applied(fault_proxy) == [Fault.NONE] * 3


def test_second_conditional_put_answers_412_and_keeps_the_first_object(client, direct, s3_bucket):
    client.put_object(Bucket=s3_bucket, Key="_manifest.json", Body=b"first", IfNoneMatch="*")

    with pytest.raises(ClientError) as excinfo:
        client.put_object(Bucket=s3_bucket, Key="_manifest.json", Body=b"second", IfNoneMatch="*")

    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert excinfo.value.response["Error"]["Code"] == "PreconditionFailed"
    assert stored_body(direct, s3_bucket, "_manifest.json") == b"first", "a refused conditional put changes nothing"


def test_drop_before_forward_raises_connection_closed_and_nothing_lands(client, direct, fault_proxy, s3_bucket):
    fault_proxy.inject("drop_before_forward", method="PUT")

    with pytest.raises(ConnectionClosedError) as excinfo:
        client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")

    assert type(excinfo.value) is ConnectionClosedError
    assert stored_body(direct, s3_bucket, "part-0.parquet") is None, "a dropped request never reached the server"
    assert fault_proxy.seen["PUT"] == 1 and fault_proxy.forwarded["PUT"] == 0


def test_cut_before_response_raises_connection_closed_but_the_object_landed(client, direct, fault_proxy, s3_bucket):
    fault_proxy.inject("cut_before_response", method="PUT")

    with pytest.raises(ConnectionClosedError) as excinfo:
        client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")

    assert type(excinfo.value) is ConnectionClosedError, "a lost response looks exactly like a dropped request"
    assert stored_body(direct, s3_bucket, "part-0.parquet") == b"rows", "the write landed though the client never heard"
    assert fault_proxy.forwarded["PUT"] == 1


@pytest.mark.slow  # waits out a real client timeout: the harness tier
def test_delay_raises_read_timeout_and_the_object_landed(client, direct, fault_proxy, s3_bucket):
    fault_proxy.inject("delay", method="PUT", delay_seconds=5.0)  # past the client's 4 s read timeout

    with pytest.raises(ReadTimeoutError) as excinfo:
        client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")

    assert type(excinfo.value) is ReadTimeoutError
    assert not fault_proxy.wait_idle(timeout=0), "the client gave up while the proxy still held the response"
    assert fault_proxy.wait_idle(timeout=15), "the proxy drops the held response once the delay passes"
    assert stored_body(direct, s3_bucket, "part-0.parquet") == b"rows"


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [("error_500", 500, "InternalError"), ("error_503", 503, "ServiceUnavailable")],
)
def test_server_error_raises_client_error_with_that_status_and_nothing_lands(
    client, direct, fault_proxy, s3_bucket, fault, status, code
):
    fault_proxy.inject(fault, method="PUT")

    with pytest.raises(ClientError) as excinfo:
        client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")

    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert excinfo.value.response["Error"]["Code"] == code
    assert stored_body(direct, s3_bucket, "part-0.parquet") is None
    assert fault_proxy.forwarded["PUT"] == 0


def test_refuse_raises_endpoint_connection_error_until_cleared(client, direct, fault_proxy, s3_bucket):
    client.head_bucket(Bucket=s3_bucket)  # leaves a kept-alive connection in the client's pool
    port = fault_proxy.port
    fault_proxy.inject("refuse")

    with pytest.raises(EndpointConnectionError) as excinfo:
        client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")

    assert type(excinfo.value) is EndpointConnectionError
    assert stored_body(direct, s3_bucket, "part-0.parquet") is None
    fault_proxy.clear()
    assert fault_proxy.port == port, "the proxy listens again on the same port"
    client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")
    assert stored_body(direct, s3_bucket, "part-0.parquet") == b"rows"


def test_connect_timeout_raises_connect_timeout_error_and_nothing_is_sent_until_cleared(
    direct, fault_proxy, s3_bucket, s3_credentials
):
    impatient = Config(retries={"total_max_attempts": 1}, connect_timeout=1, read_timeout=4)
    client = boto3.client("s3", endpoint_url=fault_proxy.endpoint_url, config=impatient, **s3_credentials)
    client.head_bucket(Bucket=s3_bucket)  # leaves a kept-alive connection in the client's pool
    port = fault_proxy.port
    fault_proxy.inject("connect_timeout")

    with pytest.raises(ConnectTimeoutError) as excinfo:
        client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")

    assert type(excinfo.value) is ConnectTimeoutError, "neither a refused connection nor a lost answer"
    assert not isinstance(excinfo.value, EndpointConnectionError), "botocore tells it apart from a refused connect"
    assert fault_proxy.seen["PUT"] == 0, "the request never reached the proxy: nothing was sent"
    assert stored_body(direct, s3_bucket, "part-0.parquet") is None
    fault_proxy.clear()
    assert fault_proxy.port == port, "the proxy listens again on the same port"
    client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")
    assert stored_body(direct, s3_bucket, "part-0.parquet") == b"rows"
    client.close()


def test_connection_faults_take_no_request_condition(fault_proxy):
    for fault in ("refuse", "connect_timeout"):
        with pytest.raises(ValueError, match="applies to connections"):
            fault_proxy.inject(fault, method="PUT")


def test_error_hits_only_the_next_request_on_a_kept_alive_connection(client, direct, fault_proxy, s3_bucket):
    client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"zero")
    fault_proxy.inject("error_503")
    with pytest.raises(ClientError):
        client.put_object(Bucket=s3_bucket, Key="part-1.parquet", Body=b"one")
    client.put_object(Bucket=s3_bucket, Key="part-2.parquet", Body=b"two")

    assert fault_proxy.connections_accepted == 1, "all three requests shared one connection"
    assert faults_applied(fault_proxy) == [Fault.NONE, Fault.ERROR_503, Fault.NONE]
    assert [stored_body(direct, s3_bucket, f"part-{i}.parquet") for i in range(3)] == [b"zero", None, b"two"]


def test_cut_hits_only_the_next_request_and_the_client_reconnects(client, direct, fault_proxy, s3_bucket):
    client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"zero")
    fault_proxy.inject("cut_before_response")
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=s3_bucket, Key="part-1.parquet", Body=b"one")
    client.put_object(Bucket=s3_bucket, Key="part-2.parquet", Body=b"two")

    assert fault_proxy.connections_accepted == 2, "the cut closed the first connection after its second request"
    assert faults_applied(fault_proxy) == [Fault.NONE, Fault.CUT_BEFORE_RESPONSE, Fault.NONE]
    assert [stored_body(direct, s3_bucket, f"part-{i}.parquet") for i in range(3)] == [b"zero", b"one", b"two"]


def test_condition_selects_the_manifest_put_among_other_requests(client, direct, fault_proxy, s3_bucket):
    fault_proxy.inject("drop_before_forward", method="PUT", path_suffix="_manifest.json")

    client.put_object(Bucket=s3_bucket, Key="2026-11-29/part-0.parquet", Body=b"rows")
    client.get_object(Bucket=s3_bucket, Key="2026-11-29/part-0.parquet")
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=s3_bucket, Key="2026-11-29/_manifest.json", Body=b"{}")
    client.put_object(Bucket=s3_bucket, Key="2026-11-29/_manifest.json", Body=b"{}")

    assert faults_applied(fault_proxy) == [Fault.NONE, Fault.NONE, Fault.DROP_BEFORE_FORWARD, Fault.NONE]
    assert fault_proxy.remaining == 0, "count=1 is spent by the one matching request"
    assert stored_body(direct, s3_bucket, "2026-11-29/_manifest.json") == b"{}"


def test_unlimited_fault_hits_every_matching_request_until_cleared(client, fault_proxy, s3_bucket):
    fault_proxy.inject("error_500", count=None, method="PUT")
    for key in ("a", "b"):
        with pytest.raises(ClientError):
            client.put_object(Bucket=s3_bucket, Key=key, Body=b"x")
    client.head_bucket(Bucket=s3_bucket)
    fault_proxy.clear()
    client.put_object(Bucket=s3_bucket, Key="c", Body=b"x")

    assert faults_applied(fault_proxy) == [Fault.ERROR_500, Fault.ERROR_500, Fault.NONE, Fault.NONE]


def test_chunked_requests_are_framed_per_request(direct, fault_proxy, s3_bucket):
    # boto3's put_object always sends Content-Length (it refuses unseekable bodies), but other clients chunk.
    # Unsigned requests: moto accepts an anonymous PUT (though not an anonymous GET).
    fault_proxy.inject("error_503", path_suffix="/second.bin")
    connection = http.client.HTTPConnection("127.0.0.1", fault_proxy.port, timeout=2)
    statuses = []
    try:
        for key in ("first.bin", "second.bin", "third.bin"):
            body = iter([key.encode(), b"|", b"chunked"])
            connection.request("PUT", f"/{s3_bucket}/{key}", body=body, encode_chunked=True)
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
    finally:
        connection.close()

    assert statuses == [200, 503, 200]
    assert fault_proxy.connections_accepted == 1, "each chunked body ended where its request did"
    assert stored_body(direct, s3_bucket, "first.bin") == b"first.bin|chunked"
    assert stored_body(direct, s3_bucket, "second.bin") is None
    assert stored_body(direct, s3_bucket, "third.bin") == b"third.bin|chunked"


@pytest.mark.slow  # waits out a real client timeout: the harness tier
def test_stop_closes_held_responses_and_joins_every_thread(s3_server, s3_credentials, s3_bucket):
    proxy = FaultProxy(s3_server, delay_seconds=30).start()
    impatient = Config(retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=3)
    s3 = boto3.client("s3", endpoint_url=proxy.endpoint_url, config=impatient, **s3_credentials)
    s3.head_bucket(Bucket=s3_bucket)  # an idle kept-alive connection
    proxy.inject("delay")
    with pytest.raises(ReadTimeoutError):
        s3.put_object(Bucket=s3_bucket, Key="held", Body=b"x")  # a response held for 30 s

    started = time.monotonic()
    proxy.stop()

    assert time.monotonic() - started < 15, "stop() does not wait out the 30 s delay"
    assert not [t.name for t in threading.enumerate() if t.name.startswith(f"fault-proxy-{proxy.port}-")]
    s3.close()


# What botocore does on its own with default retry settings (standard mode, 3 attempts, in botocore 1.44).


@pytest.fixture
def default_retry_client(fault_proxy, s3_credentials, monkeypatch, tmp_path):
    """Client with botocore's default retries: no retry config, and no environment or config file that sets one."""
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    s3 = boto3.client(
        "s3",
        endpoint_url=fault_proxy.endpoint_url,
        config=Config(connect_timeout=2, read_timeout=2),
        **s3_credentials,
    )
    yield s3
    s3.close()


def test_default_retries_send_a_cut_put_three_times(default_retry_client, direct, fault_proxy, s3_bucket):
    fault_proxy.inject("cut_before_response", count=None, method="PUT")

    with pytest.raises(ConnectionClosedError):
        default_retry_client.put_object(Bucket=s3_bucket, Key="part-0.parquet", Body=b"rows")

    assert fault_proxy.forwarded["PUT"] == 3, "standard mode: 3 attempts, each one landed"
    assert stored_body(direct, s3_bucket, "part-0.parquet") == b"rows"


def test_default_retry_of_a_cut_conditional_put_answers_412(default_retry_client, direct, fault_proxy, s3_bucket):
    fault_proxy.inject("cut_before_response", method="PUT")

    with pytest.raises(ClientError) as excinfo:
        default_retry_client.put_object(Bucket=s3_bucket, Key="_manifest.json", Body=b"{}", IfNoneMatch="*")

    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412, (
        "the retry meets the object its own first send wrote: 412 after an ambiguous send is not a conflict"
    )
    assert fault_proxy.forwarded["PUT"] == 2
    assert stored_body(direct, s3_bucket, "_manifest.json") == b"{}"


def _racy_store():
    """A WSGI app that checks ``If-None-Match: *`` and stores in two steps with a pause between, as moto does (its pause
    is the scheduler's, on a loaded machine): unguarded, every racing create passes the check."""
    stored: list[bytes] = []

    def app(environ, start_response):
        absent = not stored
        time.sleep(0.02)
        if environ.get("HTTP_IF_NONE_MATCH") == "*" and not absent:
            start_response("412 Precondition Failed", [])
            return [b""]
        stored.append(environ["wsgi.input"].read())
        start_response("200 OK", [])
        return [b""]

    return app, stored


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_racing_conditional_creates_have_one_winner_only_under_the_test_servers_lock(guarded):
    """The moto server of these tests serializes conditional writes (s3_support.MotoServer), because moto's own check
    and store are two steps: without the lock, creates sent at once all win and the S3 destination's startup probe
    refuses the store (a CI failure of a crash test that was about something else)."""
    import io

    from s3_support import _atomic_conditional_writes

    app, stored = _racy_store()
    served = _atomic_conditional_writes(app) if guarded else app
    statuses: list[str] = []

    def create(number: int) -> None:
        environ = {
            "REQUEST_METHOD": "PUT",
            "HTTP_IF_NONE_MATCH": "*",
            "wsgi.input": io.BytesIO(str(number).encode()),
        }
        list(served(environ, lambda status, headers: statuses.append(status)))

    threads = [threading.Thread(target=create, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    winners = statuses.count("200 OK")
    if guarded:
        assert (winners, len(stored)) == (1, 1), statuses
    else:
        assert winners > 1, "the racy store no longer races: this test shows nothing about the lock"


def test_conditional_creates_sent_at_once_to_the_test_server_have_one_winner(direct, s3_bucket):
    """The same through boto3 on the real test server: eight creates of one key at once, repeated."""
    from concurrent.futures import ThreadPoolExecutor

    for round_number in range(5):
        key = f"race-{round_number}"

        def create(number: int, key=key) -> str:
            try:
                direct.put_object(Bucket=s3_bucket, Key=key, Body=str(number).encode(), IfNoneMatch="*")
                return "created"
            except ClientError as exc:
                return exc.response["Error"]["Code"]

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(create, range(8)))
        assert outcomes.count("created") == 1, outcomes
        assert set(outcomes) - {"created"} <= {"PreconditionFailed", "ConditionalRequestConflict"}, outcomes


def test_a_client_frozen_mid_upload_holds_no_other_conditional_write(s3_server, direct, s3_bucket):
    """The lock of the test server is taken once a request's body is whole: a conditional PUT whose client stops
    after its head and part of its body (a SIGSTOP, a cut link) does not block a conditional PUT of another key."""
    import socket
    from urllib.parse import urlsplit

    host, port = urlsplit(s3_server).hostname, urlsplit(s3_server).port
    stalled = socket.create_connection((host, port))
    try:
        stalled.sendall(
            f"PUT /{s3_bucket}/stalled HTTP/1.1\r\nHost: {host}:{port}\r\nIf-None-Match: *\r\n"
            "Content-Length: 100\r\n\r\n".encode() + b"x" * 10
        )
        time.sleep(0.3)  # the server's handler is now reading the rest of the body
        started = time.monotonic()
        direct.put_object(Bucket=s3_bucket, Key="other", Body=b"hello", IfNoneMatch="*")
        assert time.monotonic() - started < 2, "a conditional write of another key waited for the frozen client"
    finally:
        stalled.close()
    assert stored_body(direct, s3_bucket, "other") == b"hello"
