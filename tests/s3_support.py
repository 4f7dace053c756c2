"""Object storage for tests: a moto S3 server on loopback and a fault-injecting HTTP proxy in front of it.

Pytest-free on purpose: harnesses and scripts use it as well as the fixtures in ``s3_fixtures``. Importing this
module needs neither moto nor boto3 and starts nothing.

Example:
    server, endpoint_url = start_s3_server()
    with FaultProxy(endpoint_url) as proxy:
        proxy.inject("cut_before_response", method="PUT", path_suffix="_manifest.json")
        ...  # a boto3 client on proxy.endpoint_url: the manifest PUT lands, its response never arrives
    stop_s3_server(server)
"""

from __future__ import annotations

import enum
import io
import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

LOOPBACK = "127.0.0.1"
_MAX_HEAD_BYTES = 64 * 1024
_JOIN_TIMEOUT_SECONDS = 5.0
# connect_timeout: the kernel answers a loopback connect in microseconds, so one unanswered this long was dropped
# (roomy for a loaded machine: it is paid once per injection).
_BLACK_HOLE_PROBE_SECONDS = 0.5
_BLACK_HOLE_MAX_QUEUE = 16


class MotoServer:
    """moto's S3 server on a thread, with each conditional write made one atomic step as real S3 makes it.

    moto checks ``If-None-Match``/``If-Match`` and then stores (or deletes) the object in two steps on the request's
    thread, so on a loaded machine two conditional creates of one object sent at once can both succeed (seen in CI:
    2 of 8). The S3 destination's startup probe rightly refuses such a store, which turns a test of something else
    into a refusal. Every ``PUT``/``POST``/``DELETE`` therefore runs, its body read first, under one lock for the
    whole process (moto's backend is one per process, whichever server a request reaches), and so does every ``GET``
    and ``HEAD`` (moto replaces an object in place, see below): the store answers one request at a time. The probe's
    refusal of a store that is not atomic is tested through the fault proxy, which strips the condition.
    """

    def __init__(self, ip_address: str = LOOPBACK, port: int = 0) -> None:
        self._address = (ip_address, port)
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        # Werkzeug logs every request to stderr at INFO on a handler of its own; keep warnings and errors only.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        app = _atomic_conditional_writes(DomainDispatcherApplication(create_backend_app))
        # Port 0: the OS picks a free port at bind time (no window between choosing a port and binding it).
        self._server = make_server(*self._address, app, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()

    def get_host_and_port(self) -> tuple[str, int]:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return str(host), port

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT_SECONDS)
        self._server.server_close()  # shutdown() ends the loop but leaves the listening socket open
        self._server = None


_CONDITIONAL_WRITES = threading.Lock()


def _atomic_conditional_writes(app):
    def serialized(environ, start_response):
        method = environ.get("REQUEST_METHOD")
        if method in ("GET", "HEAD"):
            # moto replaces an object in place and closes the old one's buffer: a read racing a conditional write of
            # the same key (a reader of a pointer while a restatement commits it) could meet the closed buffer and
            # answer 500, where S3 serves either version whole. Reads have no body to wait for: they take the lock.
            with _CONDITIONAL_WRITES:
                return list(app(environ, start_response))
        if method not in ("PUT", "POST", "DELETE"):
            return app(environ, start_response)
        # Unconditional writes take the lock too: a check-then-write gateway (tests/condition_proxy.py) forwards racing
        # creates without their condition, and moto replacing one object from two threads at once (or under a read
        # holding the lock) meets the closed buffer as above and answers 500.
        # The body is read whole before the lock, as S3 evaluates a condition once the request is complete: a client
        # frozen mid-upload (SIGSTOP, a cut link) must neither hold every other conditional write nor win the race
        # against the party that fenced it.
        length = environ.get("CONTENT_LENGTH")
        body = environ["wsgi.input"].read(int(length)) if length else environ["wsgi.input"].read()
        environ["wsgi.input"] = io.BytesIO(body)
        with _CONDITIONAL_WRITES:
            # The response body is built before the lock is released: moto's answers are lists, never lazy.
            return list(app(environ, start_response))

    return serialized


def start_s3_server(ip_address: str = LOOPBACK) -> tuple[MotoServer, str]:
    """Start moto's S3-compatible HTTP server on ``ip_address`` and return it with its endpoint URL."""
    server = MotoServer(ip_address)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def stop_s3_server(server: MotoServer) -> None:
    """Stop a server from :func:`start_s3_server` and release its port."""
    server.stop()


class Fault(enum.StrEnum):
    """What the proxy does to a matching request."""

    NONE = "none"  # forward it and relay the response
    DROP_BEFORE_FORWARD = "drop_before_forward"  # read it whole, never forward, close without a response
    CUT_BEFORE_RESPONSE = "cut_before_response"  # forward, read the whole response, close without relaying it
    DELAY = "delay"  # forward, hold the response for delay_seconds, then close without relaying it
    ERROR_500 = "error_500"  # answer 500 InternalError without forwarding
    ERROR_503 = "error_503"  # answer 503 ServiceUnavailable without forwarding
    ERROR_403 = "error_403"  # answer 403 AccessDenied without forwarding (the store refused the request)
    REFUSE = "refuse"  # stop listening (connects are refused) and close open connections, until clear()
    CONNECT_TIMEOUT = "connect_timeout"  # never accept (connects time out), close open connections, until clear()


_ERRORS = {
    Fault.ERROR_500: (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    Fault.ERROR_503: (503, "Service Unavailable", "ServiceUnavailable", "Please reduce your request rate."),
    Fault.ERROR_403: (403, "Forbidden", "AccessDenied", "Access Denied"),
}


@dataclass(frozen=True)
class ProxiedRequest:
    """One request the proxy read in full, and what it did with it."""

    method: str
    path: str  # percent-decoded, without the query string: "/bucket/key"
    query: str
    fault: Fault


@dataclass
class _Plan:
    fault: Fault
    remaining: int | None  # None: every matching request until clear()
    matches: Callable[[str, str], bool]
    delay_seconds: float


class _PeerClosed(Exception):
    """The other end closed the connection in the middle of a message."""


class _Reader:
    """Buffered reads from a socket, so that bytes past one message stay for the next one (keep-alive)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _fill(self) -> bool:
        data = self._sock.recv(65536)
        self._buf += data
        return bool(data)

    def read_until(self, separator: bytes) -> bytes | None:
        """Bytes up to and including separator; None if the peer closed before sending any byte."""
        while (end := self._buf.find(separator)) < 0:
            if len(self._buf) > _MAX_HEAD_BYTES:
                raise _PeerClosed("header section too large")
            if not self._fill():
                if self._buf:
                    raise _PeerClosed("closed in the middle of a line")
                return None
        line = bytes(self._buf[: end + len(separator)])
        del self._buf[: end + len(separator)]
        return line

    def read_line(self) -> bytes:
        line = self.read_until(b"\r\n")
        if line is None:
            raise _PeerClosed("closed before the end of the message")
        return line

    def read_exact(self, size: int) -> bytes:
        while len(self._buf) < size:
            if not self._fill():
                raise _PeerClosed("closed before the end of the body")
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data

    def read_to_eof(self) -> bytes:
        while self._fill():
            pass
        data = bytes(self._buf)
        self._buf.clear()
        return data


@dataclass
class _Message:
    start_line: str
    headers: list[tuple[str, str]]
    body: bytes = b""  # as on the wire: a chunked body keeps its chunk framing
    ends_at_eof: bool = False  # body delimited by the connection closing

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key.lower() == name.lower()), None)

    def to_bytes(self, *, drop: tuple[str, ...] = (), add: tuple[tuple[str, str], ...] = ()) -> bytes:
        dropped = {name.lower() for name in drop}
        headers = [(k, v) for k, v in self.headers if k.lower() not in dropped] + list(add)
        lines = [self.start_line, *(f"{k}: {v}" for k, v in headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


def _read_head(reader: _Reader) -> _Message | None:
    raw = reader.read_until(b"\r\n\r\n")
    if raw is None:
        return None
    start_line, *header_lines = raw.decode("latin-1").split("\r\n")[:-2]
    headers = []
    for line in header_lines:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return _Message(start_line, headers)


def _read_body(reader: _Reader, message: _Message, *, is_response: bool, bodyless: bool) -> None:
    """Read the body that RFC 9112 section 6.3 delimits, keeping its wire form in ``message.body``."""
    if bodyless:
        return
    if "chunked" in (message.header("Transfer-Encoding") or "").lower():
        raw = bytearray()
        while True:
            size_line = reader.read_line()
            raw += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                break
            raw += reader.read_exact(size + 2)  # the chunk and its CRLF
        while (trailer := reader.read_line()) != b"\r\n":
            raw += trailer
        message.body = bytes(raw + b"\r\n")
    elif (length := message.header("Content-Length")) is not None:
        message.body = reader.read_exact(int(length))
    elif is_response:
        message.body = reader.read_to_eof()
        message.ends_at_eof = True


def _error_response(fault: Fault, *, with_body: bool) -> bytes:
    status, reason, code, text = _ERRORS[fault]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{text}</Message><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode("latin-1") + (body if with_body else b"")


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 that forwards to an S3 endpoint and breaks chosen requests.

    Faults apply per request, not per connection: the proxy frames each request and response (Content-Length,
    chunked, or close-delimited), keeps client connections alive as S3 does, and opens one upstream connection per
    request (moto's Werkzeug server closes after every response). It answers ``Expect: 100-continue`` itself, so
    every request is read whole before its fault is chosen.

    Args:
        upstream_url: the server to forward to, e.g. ``http://127.0.0.1:5000``.
        delay_seconds: default hold for ``Fault.DELAY``; make it longer than the client's read timeout.

    Example:
        with FaultProxy(endpoint_url) as proxy:
            proxy.inject(Fault.DROP_BEFORE_FORWARD, method="PUT")  # the next PUT only
            proxy.inject("error_503", count=None)  # every request until clear()
            proxy.inject("refuse")  # connects refused until clear()
            proxy.inject("connect_timeout")  # connects time out until clear(): nothing is ever sent
            proxy.clear()
    """

    def __init__(self, upstream_url: str, *, delay_seconds: float = 3.0) -> None:
        parts = urlsplit(upstream_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream_url needs a host and a port: {upstream_url!r}")
        self.upstream_url = upstream_url
        self._upstream = (parts.hostname, parts.port)
        self._default_delay = delay_seconds
        self._lock = threading.Condition()
        self._stopping = threading.Event()
        self._plan: _Plan | None = None
        self._port = 0
        self._listener: socket.socket | None = None
        self._black_hole: list[socket.socket] = []  # connect_timeout: a listener that never accepts, and its queue
        self._accept_thread: threading.Thread | None = None
        self._clients: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._in_flight = 0
        self._seen: Counter[str] = Counter()
        self._forwarded: Counter[str] = Counter()
        self._history: list[ProxiedRequest] = []
        self._connections = 0

    # Lifecycle

    def start(self) -> FaultProxy:
        """Listen on a free port of 127.0.0.1; returns self."""
        self._open_listener()
        return self

    def stop(self) -> None:
        """Close every socket and join every thread; raises if a thread is still running."""
        self._stopping.set()
        self._close_listener()
        self._close_black_hole()
        with self._lock:
            clients, threads = list(self._clients), list(self._threads)
        for client in clients:
            _close_quietly(client)
        for thread in threads:
            thread.join(_JOIN_TIMEOUT_SECONDS)
        alive = [thread.name for thread in threads if thread.is_alive()]
        if alive:
            raise RuntimeError(f"FaultProxy threads still running after stop(): {alive}")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self._port}"

    # Faults

    def inject(
        self,
        fault: Fault | str,
        *,
        count: int | None = 1,
        method: str | None = None,
        path_suffix: str | None = None,
        when: Callable[[str, str], bool] | None = None,
        delay_seconds: float | None = None,
    ) -> None:
        """Apply ``fault`` to the next ``count`` matching requests (``None``: all of them, until :meth:`clear`).

        A request matches when its method equals ``method``, its decoded path (no query) ends with ``path_suffix``
        and ``when(method, path)`` is true; omitted conditions always hold. A new call replaces the previous plan.
        ``refuse`` and ``connect_timeout`` take no condition: they apply to connections, at once, until :meth:`clear`.
        """
        fault = Fault(fault)
        if fault is Fault.NONE:
            self.clear()
            return
        if fault in (Fault.REFUSE, Fault.CONNECT_TIMEOUT):
            if method or path_suffix or when:
                raise ValueError(f"{fault} applies to connections: it takes no request condition")
            self._close_listener()
            with self._lock:
                clients = list(self._clients)
            for client in clients:  # idle keep-alive connections would otherwise still be served
                _close_quietly(client)
            if fault is Fault.CONNECT_TIMEOUT and not self._black_hole:
                self._open_black_hole()
            return
        if count is not None and count < 1:
            raise ValueError(f"count must be at least 1 or None, got {count}")

        def matches(request_method: str, path: str) -> bool:
            return (
                (method is None or request_method == method.upper())
                and (path_suffix is None or path.endswith(path_suffix))
                and (when is None or when(request_method, path))
            )

        delay = self._default_delay if delay_seconds is None else delay_seconds
        with self._lock:
            self._plan = _Plan(fault, count, matches, delay)

    def clear(self) -> None:
        """Back to ``none``: forget the plan, and listen again on the same port after ``refuse`` or
        ``connect_timeout``."""
        with self._lock:
            self._plan = None
        self._close_black_hole()
        if self._listener is None and not self._stopping.is_set():
            self._open_listener()

    @property
    def remaining(self) -> int | None:
        """Faults left in the current plan (0 when spent or cleared, None when unlimited)."""
        with self._lock:
            return 0 if self._plan is None else self._plan.remaining

    # Observation

    @property
    def seen(self) -> Counter[str]:
        """Requests read in full, per HTTP method (a snapshot)."""
        with self._lock:
            return Counter(self._seen)

    @property
    def forwarded(self) -> Counter[str]:
        """Requests sent upstream, per HTTP method (a snapshot)."""
        with self._lock:
            return Counter(self._forwarded)

    @property
    def history(self) -> list[ProxiedRequest]:
        """Every request read in full, in order, with the fault applied to it."""
        with self._lock:
            return list(self._history)

    @property
    def connections_accepted(self) -> int:
        with self._lock:
            return self._connections

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (a delayed response has been dropped, for one); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0, timeout)

    # Internals

    def _open_listener(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, self._port))  # 0 the first time; the same port again after refuse
        listener.listen(64)
        self._port = listener.getsockname()[1]
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, args=(listener,), name=f"fault-proxy-{self._port}-accept", daemon=True
        )
        self._accept_thread.start()

    def _close_listener(self) -> None:
        listener, thread = self._listener, self._accept_thread
        self._listener = self._accept_thread = None
        if listener is not None:
            _close_quietly(listener)  # shutdown() wakes the blocked accept() on Linux
        if thread is not None:
            thread.join(_JOIN_TIMEOUT_SECONDS)

    def _open_black_hole(self) -> None:
        """Listens on the port with an accept queue of one and never accepts, then fills the queue: the kernel drops
        every further SYN, so a client's connect gets no answer and times out, and nothing is ever sent (a connect
        timeout, as a black-holed route or an overloaded store gives). Connections are queued until one times out,
        so the queue is known to be full whatever the kernel rounds the backlog up to."""
        hole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hole.bind((LOOPBACK, self._port))
        hole.listen(0)
        self._black_hole = [hole]
        for _ in range(_BLACK_HOLE_MAX_QUEUE):
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.settimeout(_BLACK_HOLE_PROBE_SECONDS)
            try:
                filler.connect((LOOPBACK, self._port))
            except TimeoutError:
                filler.close()
                return  # the queue is full: this connect got no answer, and neither will the client's
            self._black_hole.append(filler)  # queued: the queue had room for it
        self._close_black_hole()
        raise RuntimeError(f"port {self._port} still accepts connects after {_BLACK_HOLE_MAX_QUEUE} queued ones")

    def _close_black_hole(self) -> None:
        sockets, self._black_hole = self._black_hole, []
        for sock in sockets:
            sock.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # listener closed: refuse or stop
            thread = threading.Thread(
                target=self._serve_connection, args=(client,), name=f"fault-proxy-{self._port}-connection", daemon=True
            )
            with self._lock:
                if self._stopping.is_set():
                    client.close()
                    return
                self._connections += 1
                self._clients.add(client)
                self._threads.add(thread)
            thread.start()

    def _take_fault(self, request: _Message) -> tuple[Fault, float]:
        method, target, _version = request.start_line.split(" ", 2)
        target_parts = urlsplit(target)
        path = unquote(target_parts.path)
        with self._lock:
            self._seen[method] += 1
            plan, fault, delay = self._plan, Fault.NONE, 0.0
            if plan is not None and plan.remaining != 0 and plan.matches(method, path):
                fault, delay = plan.fault, plan.delay_seconds
                if plan.remaining is not None:
                    plan.remaining -= 1
            self._history.append(ProxiedRequest(method, path, target_parts.query, fault))
            return fault, delay

    def _serve_connection(self, client: socket.socket) -> None:
        reader = _Reader(client)
        try:
            while not self._stopping.is_set():
                request = _read_head(reader)
                if request is None:
                    return  # the client closed its keep-alive connection
                with self._lock:
                    self._in_flight += 1
                try:
                    if not self._serve_request(client, reader, request):
                        return
                finally:
                    with self._lock:
                        self._in_flight -= 1
                        self._lock.notify_all()
        except (OSError, _PeerClosed, ValueError):
            return  # a closed or garbled connection ends here; the client sees the closed socket
        finally:
            _close_quietly(client)
            with self._lock:
                self._clients.discard(client)
                self._threads.discard(threading.current_thread())

    def _serve_request(self, client: socket.socket, reader: _Reader, request: _Message) -> bool:
        """Serve one request; True if the connection stays open for the next one."""
        if (request.header("Expect") or "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        _read_body(reader, request, is_response=False, bodyless=False)
        method = request.start_line.split(" ", 1)[0]
        keep_alive = (request.header("Connection") or "").lower() != "close"
        fault, delay = self._take_fault(request)

        if fault is Fault.DROP_BEFORE_FORWARD:
            return False
        if fault in _ERRORS:
            client.sendall(_error_response(fault, with_body=method != "HEAD"))
            return keep_alive
        response = self._forward(request, method)
        if fault is Fault.CUT_BEFORE_RESPONSE:
            return False
        if fault is Fault.DELAY:
            self._stopping.wait(delay)
            return False
        # The upstream's Connection header speaks for its own connection; the client's stays open unless it asked
        # for close or the body is delimited by closing.
        keep_alive = keep_alive and not response.ends_at_eof
        closing = () if keep_alive else (("Connection", "close"),)
        client.sendall(response.to_bytes(drop=("Connection", "Keep-Alive"), add=closing))
        return keep_alive

    def _forward(self, request: _Message, method: str) -> _Message:
        # Expect is answered here already; Connection: close because each upstream connection serves one request.
        # Neither header is in the SigV4 SignedHeaders botocore sends.
        payload = request.to_bytes(drop=("Expect", "Connection", "Keep-Alive"), add=(("Connection", "close"),))
        with socket.create_connection(self._upstream, timeout=30) as upstream:
            upstream.sendall(payload)
            with self._lock:
                self._forwarded[method] += 1
            reader = _Reader(upstream)
            while True:
                response = _read_head(reader)
                if response is None:
                    raise _PeerClosed("upstream closed without a response")
                status = int(response.start_line.split(" ", 2)[1])
                if status >= 200:
                    break  # 1xx are interim responses: skip them
            _read_body(reader, response, is_response=True, bodyless=method == "HEAD" or status in (204, 304))
            return response
