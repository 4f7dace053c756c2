"""An SFTP server as the publishing template's store (optional extra ``[sftp]``: paramiko): a store that can only
create.

Every object is created by writing a temporary file beside it (``.tmp-<name>-<random>``) and renaming it to its
name with the SFTP protocol's plain rename (``SSH_FXP_RENAME``), which OpenSSH's server refuses when the name exists
(it links, then unlinks): "create if absent" is one atomic step. Nothing replaces an object (``posix-rename`` would,
and is never used), so there is no compare-and-swap: each key's pointer is a numbered sequence of pointer objects
(:mod:`export_ledger.destinations.sequence`). Before its first write (once per process and server) the store checks
that the server refuses a second create of one name, and that of :data:`~export_ledger.destinations.store.RACERS`
racing creates exactly one wins; a server whose rename replaces is refused.

The server's host key is always checked, against the ``known_hosts`` file of a setting (an unknown or changed key is
refused, never added). What a failed operation means is classified:

* the server could not be reached (refused, a connect timeout, authentication failed): nothing happened
  (``DestinationUnreachable``);
* the connection broke or timed out while a temporary file was written: nothing was published (``DestinationError``;
  the temporary file is swept with its place);
* the connection broke or timed out during the rename that creates an object: it may or may not exist
  (``PublishOutcomeUnknown``); for a pointer object, reconciliation reads the sequence and settles it;
* the server answered a rename with a failure and the name exists: the object was there already
  (``AlreadyExists``, or success when it holds the very bytes: a resend of one's own create).

A broken connection is dropped; the next operation connects again (a restarted server is reached again).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import re
import socket
import threading
import uuid
from dataclasses import dataclass, field
from typing import BinaryIO, ClassVar

from export_ledger.destinations.base import DestinationError, DestinationUnreachable, PublishOutcomeUnknown
from export_ledger.destinations.publishing import PublishingDestination
from export_ledger.destinations.registry import Scheme, Setting
from export_ledger.destinations.sequence import with_pointer
from export_ledger.destinations.store import (
    RACERS,
    AlreadyExists,
    Blob,
    ObjectStore,
    Upload,
    race_problem,
    racing_creates,
)

_CHUNK = 1 << 20
#: A host name or an IPv4 address (an IPv6 address is refused: give the host a name).
_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
#: Where the startup check writes its probe objects, under the root (readers ignore dot folders).
_PROBES = ".export-ledger-probe"
_CHECKED: set[tuple] = set()
#: The open sessions, by server and thread: paramiko's SFTP client answers one thread's requests at a time (two
#: threads waiting on one session read each other's answers), so threads never share one. A session whose thread has
#: ended is closed when the next one is opened (a worker's thread pool comes and goes; its sessions must not stay).
_OPEN: dict[tuple, _Connection] = {}
_OPEN_LOCK = threading.Lock()


def _paramiko():
    try:
        import paramiko
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise DestinationError("the SFTP destination needs paramiko: pip install 'export-ledger[sftp]'") from exc
    return paramiko


class _Lost(Exception):
    """The connection broke or timed out (the server may or may not have done what was asked)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(type(cause).__name__)
        self.cause = cause


@dataclass
class _Connection:
    client: object
    sftp: object


@dataclass(frozen=True)
class SftpServer:
    """How to reach and log in to one server (never shown: ``passphrase`` is a secret)."""

    host: str
    port: int
    user: str | None
    key_file: str | None
    passphrase: str | None = field(repr=False)
    known_hosts: str
    connect_timeout: float
    read_timeout: float

    def where(self) -> str:
        return f"sftp://{self.host}:{self.port}"

    def _key(self) -> tuple:
        passphrase = hashlib.sha256((self.passphrase or "").encode()).hexdigest()
        return (self.host, self.port, self.user, self.key_file, self.known_hosts, self.connect_timeout,
                self.read_timeout, passphrase, os.getpid())  # fmt: skip

    def connection(self):
        """The process's open SFTP session to this server (a forked child opens its own)."""
        key = (*self._key(), threading.get_ident())
        with _OPEN_LOCK:
            found = _OPEN.get(key)
        transport = found.client.get_transport() if found is not None else None
        if transport is not None and transport.is_active():
            return found.sftp
        self.drop()
        _close_orphans()
        opened = self._connect()
        with _OPEN_LOCK:
            _OPEN[key] = opened
        return opened.sftp

    def drop(self) -> None:
        """Closes the session after a broken operation: the next one connects again."""
        with _OPEN_LOCK:
            found = _OPEN.pop((*self._key(), threading.get_ident()), None)
        if found is not None:
            _close(found)

    def _connect(self) -> _Connection:
        paramiko = _paramiko()
        known_hosts = os.path.expanduser(self.known_hosts)
        client = paramiko.SSHClient()
        try:
            client.load_host_keys(known_hosts)
        except OSError:
            raise DestinationError(
                f"cannot read the known_hosts file of {self.where()} (setting sftp_known_hosts, EXPORTS_SFTP_KNOWN_"
                "HOSTS): the server's host key is always checked"
            ) from None
        client.set_missing_host_key_policy(paramiko.RejectPolicy())  # never trust a key nobody wrote down
        try:
            client.connect(
                self.host, port=self.port, username=self.user, key_filename=self.key_file, passphrase=self.passphrase,
                timeout=self.connect_timeout, banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout,
                allow_agent=False, look_for_keys=False,
            )  # fmt: skip
            sftp = client.open_sftp()
            sftp.get_channel().settimeout(self.read_timeout)
        except paramiko.BadHostKeyException:
            client.close()
            raise DestinationError(
                f"{self.where()} presented a host key other than its known_hosts entry: refusing to connect"
            ) from None
        except paramiko.AuthenticationException:
            client.close()
            raise DestinationUnreachable(
                f"cannot log in to {self.where()}: authentication failed (settings sftp_user, "
                "sftp_key_file, sftp_key_passphrase)"
            ) from None
        except paramiko.SSHException as exc:
            client.close()
            if "known_hosts" in str(exc) or "not found in" in str(exc):
                raise DestinationError(
                    f"{self.where()}'s host key is not in {self.known_hosts} (setting sftp_known_hosts): the host key "
                    "is always checked, never added"
                ) from None
            raise DestinationUnreachable(f"cannot connect to {self.where()}: {type(exc).__name__}") from None
        except (OSError, EOFError) as exc:
            client.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise DestinationUnreachable(f"cannot connect to {self.where()}: {reason}") from None
        return _Connection(client, sftp)

    @contextlib.contextmanager
    def session(self):
        """The open session; a broken connection raises :class:`_Lost` (and is dropped), an answer of the server
        (no such file, permission denied) its ``OSError``."""
        paramiko = _paramiko()
        sftp = self.connection()
        try:
            yield sftp
        except (EOFError, paramiko.SSHException, socket.timeout, ConnectionError) as exc:
            self.drop()
            raise _Lost(exc) from None
        except OSError as exc:
            transport = sftp.get_channel().get_transport()
            if sftp.get_channel().closed or transport is None or not transport.is_active():
                self.drop()
                raise _Lost(exc) from None
            raise


def _close(found: _Connection) -> None:
    transport = found.client.get_transport()
    with contextlib.suppress(Exception):
        found.client.close()
    if transport is not None and transport is not threading.current_thread():
        transport.join(5)  # its reader thread ends with it (a fork server forks with no thread running)


def _close_orphans() -> None:
    """Closes the sessions of this process's threads that have ended. Those a forked child inherited from its parent
    are forgotten, never closed: their socket is the parent's too, and a close would say goodbye on it."""
    alive, pid = {thread.ident for thread in threading.enumerate()}, os.getpid()
    with _OPEN_LOCK:
        inherited = [key for key in _OPEN if key[-2] != pid]
        for key in inherited:
            del _OPEN[key]
        closing = [_OPEN.pop(key) for key in list(_OPEN) if key[-1] not in alive]
    for found in closing:
        _close(found)


def _absent(exc: OSError) -> bool:
    return exc.errno == errno.ENOENT


def _reason(exc: BaseException) -> str:
    """An error's kind, never its text (a server's message may quote a path with a customer's name in it)."""
    if isinstance(exc, _Lost):
        return f"connection lost ({exc})"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    return "the server refused it"


@dataclass(frozen=True)
class SftpStore(ObjectStore):
    """A folder ``root`` on an SFTP server whose files are the objects; it can only create."""

    server: SftpServer
    root: str
    compare_and_swap: ClassVar[bool] = False

    def _path(self, name: str) -> str:
        return posixpath.join(self.root, name) if name else self.root

    def url(self, name: str) -> str:
        return f"{self.server.where()}{self._path(name)}"

    def describe(self) -> str:
        return self.url("")

    # -- reads ---------------------------------------------------------------------------------------------------

    def read(self, name: str) -> bytes | None:
        path = self._path(name)
        try:
            with self.server.session() as sftp, sftp.open(path, "rb") as handle:
                handle.prefetch()
                return handle.read()
        except (OSError, _Lost) as exc:
            if isinstance(exc, OSError) and _absent(exc):
                return None
            raise DestinationUnreachable(f"cannot read {self.url(name)}: {_reason(exc)}") from None

    def get(self, name: str) -> Blob | None:
        data = self.read(name)
        return None if data is None else Blob(data, hashlib.sha256(data).hexdigest())

    def digest(self, name: str) -> str | None:
        path, digest = self._path(name), hashlib.sha256()
        try:
            with self.server.session() as sftp, sftp.open(path, "rb") as handle:
                handle.prefetch()
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
        except (OSError, _Lost) as exc:
            if isinstance(exc, OSError) and _absent(exc):
                return None
            raise DestinationUnreachable(f"cannot read {self.url(name)}: {_reason(exc)}") from None
        return digest.hexdigest()

    def list(self, prefix: str) -> list[str]:
        top = self._path(prefix.rstrip("/"))
        names: list[str] = []
        try:
            with self.server.session() as sftp:
                self._walk(sftp, top, prefix.rstrip("/"), names, top=True)
        except (OSError, _Lost) as exc:
            raise DestinationUnreachable(f"cannot list {self.url(prefix)}: {_reason(exc)}") from None
        return sorted(names)

    def _walk(self, sftp, path: str, relative: str, names: list[str], *, top: bool) -> None:
        import stat

        try:
            entries = sftp.listdir_attr(path)
        except OSError as exc:
            if _absent(exc):
                return
            raise
        for entry in entries:
            child = f"{relative}/{entry.filename}" if relative else entry.filename
            if stat.S_ISDIR(entry.st_mode or 0):
                if not entry.filename.startswith("."):
                    self._walk(sftp, f"{path}/{entry.filename}", child, names, top=False)
            elif not (top and entry.filename.startswith(".tmp-")):
                # Below the folder listed, a killed writer's temporary files are listed, so that a place holding
                # nothing else is still found and swept.
                names.append(child)

    # -- writes --------------------------------------------------------------------------------------------------

    def _folders(self, sftp, path: str) -> None:
        """Creates ``path``'s missing folders (another party creating one at the same time is fine)."""
        missing, folder = [], posixpath.dirname(path)
        while folder not in ("", "/"):
            try:
                sftp.stat(folder)
                break
            except OSError as exc:
                if not _absent(exc):
                    raise
            missing.append(folder)
            folder = posixpath.dirname(folder)
        for each in reversed(missing):
            try:
                sftp.mkdir(each, 0o755)
            except OSError:
                sftp.stat(each)  # created by another party meanwhile; anything else raises here

    def _temporary(self, path: str) -> str:
        return posixpath.join(posixpath.dirname(path), f".tmp-{posixpath.basename(path)}-{uuid.uuid4().hex[:16]}")

    def _create(self, temporary: str, name: str, data: bytes | None) -> None:
        """Renames the written ``temporary`` to ``name``, never over an existing object.

        Raises:
            AlreadyExists: ``name`` exists (with other bytes than ``data``, when given).
            PublishOutcomeUnknown: the connection broke during the rename.
        """
        path = self._path(name)
        try:
            with self.server.session() as live:
                live.rename(temporary, path)  # SSH_FXP_RENAME: OpenSSH refuses an existing target
            return
        except _Lost:
            raise PublishOutcomeUnknown(
                f"the connection to {self.server.where()} broke while {self.url(name)} was created: it may or may not "
                "exist"
            ) from None
        except OSError as refused:
            failure = refused
        # Best effort: a temporary file left behind is swept with its place; the verdict comes from the read below.
        with contextlib.suppress(OSError, _Lost, DestinationError), self.server.session() as live:
            live.remove(temporary)
        try:
            exists = self.read(name)
        except DestinationUnreachable:
            raise PublishOutcomeUnknown(f"cannot tell whether {self.url(name)} was created") from None
        if exists is None:
            raise DestinationError(f"cannot create {self.url(name)}: {_reason(failure)}")
        if data is None or exists != data:
            raise AlreadyExists(f"{self.url(name)} exists")
        # The same bytes: an earlier create of this very object (it is created by one party only).

    def put_if_absent(self, name: str, data: bytes) -> None:
        path = self._path(name)
        temporary = self._temporary(path)
        try:
            with self.server.session() as sftp:
                self._folders(sftp, path)
                with sftp.open(temporary, "wb") as handle:
                    handle.write(data)
        except (OSError, _Lost) as exc:
            raise DestinationError(f"cannot write {self.url(name)}: {_reason(exc)}; nothing was created") from None
        self._create(temporary, name, data)

    def upload(self, name: str) -> Upload:
        path = self._path(name)
        temporary = self._temporary(path)
        try:
            with self.server.session() as sftp:
                self._folders(sftp, path)
                handle = sftp.open(temporary, "wb")
                handle.set_pipelined(True)
        except (OSError, _Lost) as exc:
            raise DestinationError(f"cannot write {self.url(name)}: {_reason(exc)}; nothing was created") from None
        return _SftpUpload(self, name, temporary, handle)

    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        raise DestinationError(f"{self.url(name)}: an SFTP store replaces nothing (its pointer is a sequence)")

    def delete(self, name: str, *, tidy: bool = True) -> None:
        """Deletes ``name``, and with ``tidy`` its folder once it holds nothing but temporary files (a place's: only
        its own writer, fenced by now, writes there)."""
        path = self._path(name)
        try:
            with self.server.session() as sftp:
                with contextlib.suppress(FileNotFoundError):
                    sftp.remove(path)
                folder = posixpath.dirname(path)
                if tidy and folder != self.root.rstrip("/"):
                    self._remove_if_spent(sftp, folder)
        except (OSError, _Lost) as exc:
            raise DestinationError(f"cannot delete {self.url(name)}: {_reason(exc)}") from None

    @staticmethod
    def _remove_if_spent(sftp, folder: str) -> None:
        """Removes a place's folder holding nothing but temporary files (its writer is fenced: they can never
        become objects)."""
        try:
            left = sftp.listdir(folder)
        except FileNotFoundError:
            return
        if all(name.startswith(".tmp-") for name in left):
            for name in left:
                with contextlib.suppress(OSError):
                    sftp.remove(f"{folder}/{name}")
            with contextlib.suppress(OSError):
                sftp.rmdir(folder)

    # -- the startup check ---------------------------------------------------------------------------------------

    def check_conditions(self) -> None:
        """Refuses a server whose rename replaces an existing file: a second create of one name must be refused,
        and of :data:`RACERS` racing creates exactly one may win. Once per process (and its forks) and server and
        root."""
        key = (self.server.host, self.server.port, self.root)
        if key in _CHECKED:
            return
        name = f"{_PROBES}/{uuid.uuid4().hex}"
        try:
            self.put_if_absent(name, b"1")
            try:
                self.put_if_absent(name, b"2")
            except AlreadyExists:
                pass
            else:
                raise DestinationError(
                    f"{self.describe()} replaced an existing file on rename: this server cannot create only if "
                    "absent, so a retry could replace a published export. Refusing to publish to it"
                )

            def create(body: bytes) -> None:
                try:
                    self.put_if_absent(f"{name}-race", body)
                finally:
                    self.server.drop()  # each racer's own session: its thread ends here

            accepted = racing_creates(create, lambda exc: isinstance(exc, AlreadyExists), RACERS)
            problem = race_problem(accepted, self.read(f"{name}-race"))
            if problem:
                raise DestinationError(
                    f"{self.describe()} {problem}: its rename is not one atomic create. Refusing to publish to it"
                )
        finally:
            for each in (name, f"{name}-race"):
                with contextlib.suppress(DestinationError):
                    # Its own files only: other processes check in the same folder at the same time, and a temporary
                    # file there is another's probe being written (the folder stays, an empty dot folder).
                    self.delete(each, tidy=False)
        _CHECKED.add(key)


class _Writer:
    """The temporary file's handle as ``write_rows`` writes it: a broken connection is an ``OSError``, which the
    template reports as a failed write (nothing published)."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self.written = 0  # what was handed over: the file the server stored must be as long (_SftpUpload.commit)

    def write(self, data) -> int:
        paramiko = _paramiko()
        data = bytes(data)
        try:
            self._handle.write(data)
        except (EOFError, paramiko.SSHException) as exc:
            raise ConnectionError(errno.ECONNRESET, "connection lost") from exc
        self.written += len(data)
        return len(data)


class _SftpUpload(Upload):
    def __init__(self, store: SftpStore, name: str, temporary: str, handle) -> None:
        self.store, self.name, self.temporary, self._file = store, name, temporary, handle
        self._writer = _Writer(handle)
        self.handle: BinaryIO = self._writer  # type: ignore[assignment]

    def commit(self) -> None:
        try:
            with self.store.server.session() as sftp:
                self._file.close()
                # paramiko drops the answers to pipelined writes it was not waiting for (the close waits for its own
                # only), so a write the server failed (a full disk, a quota) goes unnoticed: the file it stored tells.
                stored = sftp.stat(self.temporary).st_size
        except (OSError, _Lost) as exc:
            self.abort()
            raise DestinationError(f"cannot write {self.store.url(self.name)}: {_reason(exc)}") from None
        if stored != self._writer.written:
            self.abort()
            raise DestinationError(
                f"cannot write {self.store.url(self.name)}: the server stored {stored} of its {self._writer.written} "
                "bytes (a write failed there: a full disk or a quota?); nothing was published"
            )
        self.store._create(self.temporary, self.name, None)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._file.close()
        with contextlib.suppress(Exception), self.store.server.session() as sftp:
            sftp.remove(self.temporary)


@dataclass(frozen=True)
class SftpDestination(PublishingDestination):
    """Exports as files under a folder of an SFTP server: the publishing template (docs/protocol.md) over
    :class:`SftpStore`, each key's pointer a sequence of created pointer objects (docs/destinations.md, "SFTP").

    Attributes:
        host / port / path: The server and the absolute folder on it (``sftp://host[:port]/path``).
        sftp_user: The login (``EXPORTS_SFTP_USER``).
        sftp_key_file: The private key file (``EXPORTS_SFTP_KEY_FILE``).
        sftp_key_passphrase: Its passphrase, a secret (``EXPORTS_SFTP_KEY_PASSPHRASE``).
        sftp_known_hosts: The known_hosts file the server's host key is checked against (``EXPORTS_SFTP_KNOWN_HOSTS``).
        connect_timeout_seconds / read_timeout_seconds: A read timeout during a create makes its outcome unknown.
    """

    host: str
    path: str
    port: int = 22
    sftp_user: str | None = None
    sftp_key_file: str | None = None
    sftp_key_passphrase: str | None = field(default=None, repr=False)
    sftp_known_hosts: str = "~/.ssh/known_hosts"
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 30.0

    pool = "exports-sftp"

    @property
    def raw_store(self) -> SftpStore:
        """The server's folder itself, without the sequence pointer (what :attr:`store` wraps)."""
        server = SftpServer(
            self.host, self.port, self.sftp_user, self.sftp_key_file, self.sftp_key_passphrase,
            self.sftp_known_hosts, self.connect_timeout_seconds, self.read_timeout_seconds,
        )  # fmt: skip
        return SftpStore(server, "/" + self.path.strip("/"))

    @property
    def store(self) -> ObjectStore:
        return with_pointer(self.raw_store)

    @staticmethod
    def check_spec(spec: str) -> str | None:
        rest = spec.removeprefix("sftp://")
        authority, _, path = rest.partition("/")
        host, _, port = authority.rpartition(":") if authority.count(":") == 1 else (authority, "", "")
        if not _HOST_RE.fullmatch(host or ""):
            return f"{authority!r} is not a host[:port]"
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            return f"{port!r} is not a port"
        if not path.strip("/"):
            return "it names no folder: write sftp://host[:port]/absolute/path"
        return None

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> SftpDestination:
        authority, _, path = spec.removeprefix("sftp://").partition("/")
        host, _, port = authority.rpartition(":") if authority.count(":") == 1 else (authority, "", "")
        return cls(host=host, port=int(port) if port else 22, path="/" + path.strip("/"), **settings)

    def spec(self) -> tuple[str, dict]:
        """The spec and settings that build this destination again."""
        return f"sftp://{self.host}:{self.port}/{self.path.strip('/')}", SCHEME.settings_of(self)

    def root_of(self, export: str) -> str:  # noqa: ARG002 - one folder holds every export's own
        return self.raw_store.url("")


SCHEME = Scheme(
    "sftp://",
    "SftpDestination",
    "sftp://host[:port]/path",
    settings=(
        Setting("sftp_user", "EXPORTS_SFTP_USER", credential=True, doc="The login on the server"),
        Setting("sftp_key_file", "EXPORTS_SFTP_KEY_FILE", credential=True, doc="The private key file"),
        Setting("sftp_key_passphrase", "EXPORTS_SFTP_KEY_PASSPHRASE", secret=True, doc="The key file's passphrase"),
        Setting(
            "sftp_known_hosts",
            "EXPORTS_SFTP_KNOWN_HOSTS",
            default="~/.ssh/known_hosts",
            doc="The known_hosts file the server's host key is checked against",
        ),  # fmt: skip
        Setting("connect_timeout_seconds", parse=float, default=5.0, doc="Connect timeout"),
        Setting("read_timeout_seconds", parse=float, default=30.0, doc="Read timeout (during a create: unknown)"),
    ),
)
