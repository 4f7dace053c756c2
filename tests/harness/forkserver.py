"""A fork server: one interpreter imports the export code once, then forks a fresh child process per attempt.

Why: a new interpreter that imports Dagster and the project takes about 2.5 s on the 2-core test machine
(``python -c "import resources.io_manager"``), a fork about 20 ms. Each child is still an OS process of its own that
the harness SIGKILLs, SIGSTOPs or races against others: it dies with everything in its memory, and the kernel closes
its files, database connections and sockets, as for a crashed worker. The server holds no database connection,
socket or thread when it forks (it checks for threads), so children share nothing but imported code.

Run it with ``python -m harness.forkserver`` (``tests`` and the project on ``PYTHONPATH``) and talk to it with
:class:`ForkServer`. Requests and replies are JSON lines on its stdin and stdout:

* ``run``: fork a child for ``spec``; SIGKILL it after ``kill_after`` seconds if it is still running (the server is
  its parent, so the pid cannot have been reused); reply with how it ended.
* ``spawn``: fork children for ``specs``, optionally held at a gate until ``release`` (all start at once); reply pids.
* ``signal`` / ``wait``: send a signal to a child / wait for children to end.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
PROJECT = TESTS.parent
CHILD_ERROR = 70  # a child's own crash (a harness bug), not an attempt's failure


@dataclass
class ChildOutcome:
    """How one child process ended, and the result file it wrote (None when it died first)."""

    pid: int
    exit_code: int | None
    signal: int | None
    killed_by_harness: bool
    timed_out: bool
    elapsed: float
    result: dict | None = None

    @property
    def killed(self) -> bool:
        return self.signal == signal.SIGKILL


# -- the server ---------------------------------------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        self.children: dict[int, dict] = {}  # pid -> {"pidfd", "started", "killed", "result_path"}
        self.gates: dict[int, tuple[int, int]] = {}  # gate id -> (pipe write end, children waiting)

    def fork(self, spec_json: str, gate_read: int | None = None, gate_write: int | None = None) -> int:
        from harness import protocol

        spec = protocol.AttemptSpec.from_json(spec_json)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the server loop
            code = CHILD_ERROR
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                log = os.open(spec.log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                if gate_read is not None:
                    os.close(gate_write)
                    os.read(gate_read, 1)
                code = protocol.child_main(spec)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.children[pid] = {
            "pidfd": os.pidfd_open(pid),
            "started": time.monotonic(),
            "killed": False,
            "result_path": spec.result_path,
        }
        return pid

    def reap(self, pid: int, timeout: float | None) -> dict | None:
        """Waits up to ``timeout`` seconds for ``pid`` to end; reaps it and returns its outcome, or None."""
        child = self.children[pid]
        readable, _, _ = select.select([child["pidfd"]], [], [], timeout)
        if not readable:
            return None
        _, status = os.waitpid(pid, 0)
        elapsed = time.monotonic() - child["started"]
        os.close(child["pidfd"])
        del self.children[pid]
        result = None
        if child["result_path"] and os.path.exists(child["result_path"]):
            with open(child["result_path"]) as handle:
                result = json.load(handle)
        return {
            "pid": pid,
            "exit_code": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "killed_by_harness": child["killed"],
            "timed_out": child.get("timed_out", False),
            "elapsed": elapsed,
            "result": result,
        }

    def kill(self, pid: int, *, timed_out: bool = False) -> None:
        child = self.children[pid]
        child["killed"] = True
        child["timed_out"] = timed_out
        signal.pidfd_send_signal(child["pidfd"], signal.SIGKILL)

    # -- operations ---------------------------------------------------------------------------------------------

    def op_run(self, request: dict) -> dict:
        pid = self.fork(request["spec"])
        kill_after = request.get("kill_after")
        if kill_after is not None:
            outcome = self.reap(pid, kill_after)
            if outcome is not None:
                return outcome
            self.kill(pid)
            return self.reap(pid, None)
        outcome = self.reap(pid, request.get("run_timeout", 120))
        if outcome is None:
            self.kill(pid, timed_out=True)
            outcome = self.reap(pid, None)
        return outcome

    def op_spawn(self, request: dict) -> dict:
        gate = None
        read_end = write_end = None
        if request.get("gated"):
            read_end, write_end = os.pipe()
        pids = [self.fork(spec, read_end, write_end) for spec in request["specs"]]
        if request.get("gated"):
            os.close(read_end)
            gate = write_end
            self.gates[gate] = (write_end, len(pids))
        return {"pids": pids, "gate": gate}

    def op_release(self, request: dict) -> dict:
        write_end, waiting = self.gates.pop(request["gate"])
        os.write(write_end, b"x" * waiting)
        os.close(write_end)
        return {"released": waiting}

    def op_prepare(self, request: dict) -> dict:
        """Does once before forking what a long-lived worker does once at start. S3: builds the client (each child
        would otherwise spend ~0.2 s loading botocore's service model; no request is sent). GCS and Azure: runs the
        store's check that the server honours conditional writes (once per process: ~0.5 s a child on Azurite), then
        closes the clients it used. No socket is open and no thread runs when children fork (checked)."""
        from harness import protocol

        spec = request["destination"]
        if spec["kind"] == "s3":
            protocol.build_destination(spec, request["ledger_url"]).store._s3()
        elif spec["kind"] in ("gcs", "azure"):
            store = protocol.build_destination(spec, request["ledger_url"]).store
            store.check_conditions()
            _close_cached_clients(store)
        elif spec["kind"] == "sftp":  # the server's check once here, its sessions closed: each child opens its own
            store = protocol.build_destination(spec, request["ledger_url"]).raw_store
            store.check_conditions()
            store.server.drop()
        sockets = _open_sockets()
        if sockets:
            raise RuntimeError(
                f"the fork server holds {sockets} open socket(s); children would share them: {_socket_peers()}"
            )
        if threading.active_count() != 1:
            raise RuntimeError(f"the fork server runs {threading.active_count()} threads; children would copy locks")
        return {"prepared": spec["kind"]}

    def op_signal(self, request: dict) -> dict:
        pid = request["pid"]
        if pid not in self.children:
            return {"sent": False}
        signal.pidfd_send_signal(self.children[pid]["pidfd"], request["signal"])
        if request["signal"] == signal.SIGKILL:
            self.children[pid]["killed"] = True
        return {"sent": True}

    def op_wait(self, request: dict) -> dict:
        deadline = time.monotonic() + request.get("wait_timeout", 120)
        outcomes = {}
        for pid in request["pids"]:
            if pid not in self.children:
                continue
            outcome = self.reap(pid, max(0.0, deadline - time.monotonic()))
            if outcome is None and request.get("kill_on_timeout", True):
                self.kill(pid, timed_out=True)
                outcome = self.reap(pid, None)
            if outcome is not None:
                outcomes[str(pid)] = outcome
        return {"outcomes": outcomes}

    def shutdown(self) -> None:
        for pid in list(self.children):
            self.kill(pid)
            self.reap(pid, None)


def _close_cached_clients(store) -> None:
    """Closes the SDK clients a GCS or Azure store keeps per process (their connection pools) and forgets them:
    each child opens its own. The clients are the cached ones the store's own calls return."""
    from export_ledger.destinations import azure, gcs

    if isinstance(store, gcs.GCSStore):
        gcs._client(*store.client_settings).close()
        gcs._client.cache_clear()
    else:
        # A container client shares its service client's transport and does not close it: the last reference
        # dropped closes the connections.
        azure._container.cache_clear()
    # The conditions' check races creates on threads. A refused create's exception may keep its response, and with it
    # a connection, in a cycle (exception, traceback, frame) until the collector runs: the likely reason a CI run once
    # found 9 sockets still open here after the client was closed (not reproduced since).
    gc.collect()


def _socket_fds() -> list[int]:
    """The descriptors of this process's open sockets."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                fds.append(int(fd))
        except OSError:
            pass
    return fds


def _open_sockets() -> int:
    return len(_socket_fds())


def _socket_peers() -> str:
    """Where the process's open sockets lead (``family local -> remote``), for a refusal that names them."""
    import socket

    peers = []
    for fd in _socket_fds():
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # the number was closed and reused meanwhile: the copy is not inherited by a child
            os.close(dup)
            continue
        with sock:
            try:
                remote = sock.getpeername()
            except OSError:
                remote = "-"
            try:
                local = sock.getsockname()
            except OSError:
                local = "-"
            peers.append(f"{getattr(sock.family, 'name', sock.family)} {local} -> {remote}")
    return "; ".join(peers) or "none found"


def serve() -> None:
    started = time.monotonic()
    from harness import protocol

    protocol.warm_up()
    if threading.active_count() != 1:  # forking a process with threads could copy a lock held by one of them
        print(json.dumps({"ready": False, "error": f"{threading.active_count()} threads after imports"}), flush=True)
        return
    server = _Server()
    print(json.dumps({"ready": True, "pid": os.getpid(), "import_seconds": time.monotonic() - started}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = getattr(server, f"op_{request['op']}")(request)
        except Exception as exc:  # a bad request is reported to the harness, the server keeps serving
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
    server.shutdown()


# -- the client -----------------------------------------------------------------------------------------------------


class ForkServerError(RuntimeError):
    """The fork server died, hung or refused a request."""


class ForkServer:
    """Starts ``python -m harness.forkserver`` and talks to it.

    Args:
        log_path: Where the server's own stderr goes (children log to their spec's ``log_path``).
        env: Extra environment for the server (and so for every child).

    Example:
        server = ForkServer(tmp / "forkserver.log")
        outcome = server.run(spec, kill_after=0.05)  # a SIGKILLed attempt
        server.close()
    """

    def __init__(self, log_path: Path, env: dict[str, str] | None = None, start_timeout: float = 120) -> None:
        environment = {**os.environ, **(env or {})}
        environment["PYTHONPATH"] = os.pathsep.join([str(PROJECT), str(TESTS), environment.get("PYTHONPATH", "")])
        environment.pop("EXPORTS_FAILPOINTS", None)
        self._log = open(log_path, "ab")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "harness.forkserver"],
            cwd=PROJECT,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self._buffer = b""
        ready = self._read_reply(start_timeout)
        if not ready.get("ready"):
            self.close()
            raise ForkServerError(f"fork server did not start: {ready}")
        self.import_seconds = ready["import_seconds"]

    def _read_reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ForkServerError(f"no reply from the fork server in {timeout}s")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise ForkServerError(f"the fork server exited (code {self._process.poll()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def request(self, timeout: float = 300, **payload) -> dict:
        self._process.stdin.write((json.dumps(payload) + "\n").encode())
        self._process.stdin.flush()
        reply = self._read_reply(timeout)
        if "error" in reply:
            raise ForkServerError(f"{payload['op']}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def run(self, spec, *, kill_after: float | None = None, timeout: float = 120) -> ChildOutcome:
        """Runs one attempt in a fresh child; with ``kill_after``, SIGKILLs it then if it is still running."""
        reply = self.request(
            op="run", spec=spec.to_json(), kill_after=kill_after, run_timeout=timeout, timeout=timeout + 30
        )
        return ChildOutcome(**reply)

    def spawn(self, specs, *, gated: bool = False) -> tuple[list[int], int | None]:
        reply = self.request(op="spawn", specs=[s.to_json() for s in specs], gated=gated)
        return reply["pids"], reply["gate"]

    def prepare(self, destination: dict, ledger_url: str) -> None:
        self.request(op="prepare", destination=destination, ledger_url=ledger_url)

    def release(self, gate: int) -> None:
        self.request(op="release", gate=gate)

    def signal(self, pid: int, signum: int) -> bool:
        return self.request(op="signal", pid=pid, signal=int(signum))["sent"]

    def wait(self, pids: list[int], *, timeout: float = 120, kill_on_timeout: bool = True) -> dict[int, ChildOutcome]:
        reply = self.request(
            op="wait", pids=pids, wait_timeout=timeout, kill_on_timeout=kill_on_timeout, timeout=timeout + 30
        )
        return {int(pid): ChildOutcome(**outcome) for pid, outcome in reply["outcomes"].items()}

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()


if __name__ == "__main__":
    serve()
