"""Pytest fixtures for the SFTP destination: Debian's OpenSSH server on 127.0.0.1, with a host key and a user key of
its own, one per session (:func:`sftp_server`) or one a test may stop and start (:class:`SshServer`); a fresh folder
per test (:func:`sftp_folder`); a TCP proxy that cuts the connection after a number of bytes (:class:`CuttingProxy`).

The server is ``/usr/sbin/sshd -D -f <config>`` (``apt-get install openssh-server``): its own config in a temporary
folder (``ListenAddress 127.0.0.1:<free port>``, ``AuthorizedKeysFile`` and ``PidFile`` of its own, ``Subsystem sftp
internal-sftp``, ``UsePAM no``, ``StrictModes no``), run as a child in a process group of its own and stopped by it.
The test's user logs in as itself. Without the binary the tests skip with the reason; with ``CI=true`` that fails.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import resource
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloud_fixtures import _free_port, _unavailable, _wait_for_port
from s3_support import LOOPBACK

__all__ = ["sftp_folder", "sftp_server"]

SSHD = "/usr/sbin/sshd"


class SshServer:
    """One OpenSSH server on 127.0.0.1 (keys and config under ``folder``), started and stopped by the test."""

    def __init__(self, folder: Path, *, file_size_limit: int | None = None) -> None:
        if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
            _unavailable(f"no OpenSSH server ({SSHD}; apt-get install openssh-server)")
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.user = getpass.getuser()
        self.host_key = folder / "host_ed25519"
        self.key_file = str(folder / "user_ed25519")
        for key in (self.host_key, Path(self.key_file)):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        (folder / "authorized_keys").write_text(Path(self.key_file + ".pub").read_text())
        public = self.host_key.with_suffix(".pub").read_text().split()[:2]
        self.known_hosts = str(folder / "known_hosts")
        Path(self.known_hosts).write_text(f"[{LOOPBACK}]:{self.port} {' '.join(public)}\n")
        self.config = folder / "sshd_config"
        self.config.write_text(
            f"ListenAddress {LOOPBACK}:{self.port}\nHostKey {self.host_key}\nPidFile {folder / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {folder / 'authorized_keys'}\nSubsystem sftp internal-sftp\nUsePAM no\n"
            "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nMaxStartups 200\nMaxSessions 200\nLogLevel ERROR\n"
        )
        self.process: subprocess.Popen | None = None
        #: A limit on the size of any file the server writes (``RLIMIT_FSIZE``; a write past it fails with EFBIG, as
        #: on a full disk), or None.
        self.file_size_limit = file_size_limit

    def _limit(self) -> None:
        """In the server's process before it starts: files past the limit fail to write (the signal that would kill
        the writer is ignored, so the write answers an error, as a full disk's does)."""
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_size_limit, self.file_size_limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def start(self) -> SshServer:
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege separation folder (no systemd here)
        self.process = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(self.config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=self._limit if self.file_size_limit else None,
        )  # fmt: skip
        _wait_for_port(self.port, self.process, "sshd")
        return self

    def stop(self) -> None:
        """Stops the server and every session it forked (its process group)."""
        if self.process is None:
            return
        # Each session's sshd calls setsid(): it is in no group of the server's, so it is stopped by its pid.
        for child in _descendants(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def destination(self, path: str, *, port: int | None = None, **settings):
        """A destination on ``path`` of this server (through ``port``: a proxy), logged in with the test's key."""
        from export_ledger.destinations.sftp import SftpDestination

        if port is not None and "sftp_known_hosts" not in settings:  # the proxy's port: the same host key there
            known = Path(self.folder / f"known_hosts-{port}")
            entry = Path(self.known_hosts).read_text().split(" ", 1)[1]
            known.write_text(f"[{LOOPBACK}]:{port} {entry}")
            settings["sftp_known_hosts"] = str(known)
        settings.setdefault("sftp_known_hosts", self.known_hosts)
        settings.setdefault("read_timeout_seconds", 3.0)
        settings.setdefault("connect_timeout_seconds", 3.0)
        return SftpDestination(
            host=LOOPBACK, port=port or self.port, path=path, sftp_user=self.user, sftp_key_file=self.key_file,
            **settings,
        )  # fmt: skip

    def spec(self, path: str) -> dict:
        """The destination as the crash harness's children build it (a JSON-able dict)."""
        return {"kind": "sftp", "host": LOOPBACK, "port": self.port, "path": path, "user": self.user,
                "key_file": self.key_file, "known_hosts": self.known_hosts}  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The settings as a deployment gives them (``EXPORTS_SFTP_*``)."""
        return {"EXPORTS_SFTP_USER": self.user, "EXPORTS_SFTP_KEY_FILE": self.key_file,
                "EXPORTS_SFTP_KNOWN_HOSTS": self.known_hosts}  # fmt: skip


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (read from /proc), children first."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        todo += children
    return found


@pytest.fixture(scope="session")
def sftp_server(tmp_path_factory) -> Iterator[SshServer]:
    """One OpenSSH server for the session."""
    server = SshServer(tmp_path_factory.mktemp("sshd")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sftp_folder(sftp_server: SshServer, tmp_path_factory) -> str:
    """A new, empty folder the server serves (the server is on this machine: a test may look at it directly)."""
    folder = tmp_path_factory.mktemp(f"sftp-{uuid.uuid4().hex[:8]}")
    return str(folder)


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of a server that, once armed, cuts the connection: after ``cut_after`` more
    bytes from the client (:meth:`arm`: the client's request is cut before the server has it whole), or after
    forwarding the client's next write whole and letting the server act on it, its answer never delivered
    (:meth:`arm_after_request`: the request happened, the client cannot know)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port = self.listener.getsockname()[1]
        self.cut_after: int | None = None
        self.after_request = False
        self.swallowing = False
        self.answered = threading.Event()  # the server answered while its answers were swallowed
        self.cuts = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._stopping = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def arm(self, cut_after: int) -> None:
        with self._lock:
            self.cut_after = cut_after

    def arm_after_request(self) -> None:
        with self._lock:
            self.after_request = True

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((LOOPBACK, self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
                self.swallowing = False  # a new connection's answers are delivered
            for source, sink, counted in ((client, upstream, True), (upstream, client, False)):
                thread = threading.Thread(
                    target=self._pump, args=(source, sink, counted, client, upstream), daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _cut(self, both) -> None:
        for each in both:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)

    def _pump(self, source, sink, counted, *both) -> None:
        try:
            while data := source.recv(65536):
                if not counted:
                    if not self.swallowing:
                        sink.sendall(data)
                    else:
                        self.answered.set()
                    continue
                with self._lock:
                    deliver_then_cut, self.after_request = self.after_request, False
                    cut = self.cut_after is not None and len(data) >= self.cut_after
                    if cut:
                        data, self.cut_after = data[: self.cut_after], None
                    elif self.cut_after is not None:
                        self.cut_after -= len(data)
                    if cut or deliver_then_cut:
                        self.cuts += 1
                        self.swallowing = deliver_then_cut
                        self.answered.clear()
                sink.sendall(data)
                if deliver_then_cut:
                    # The server acts on the request: cut once its answer came (swallowed), not after a guessed while
                    # (a loaded machine's server may not have read the request yet, and a cut then would stop it).
                    self.answered.wait(10)
                if cut or deliver_then_cut:
                    self._cut(both)
                    return
        except OSError:
            pass
        finally:
            self._cut(both)

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for each in sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)  # wakes the pumps blocked in recv
            with contextlib.suppress(OSError):
                each.close()
        deadline = time.monotonic() + 5
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
