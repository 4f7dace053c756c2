"""A local folder as an object store: the store hooks over files, with the durability a crash needs.

Every object is created by writing a temporary file beside it, fsyncing it, and ``link``-ing it to its name (which
fails if the name exists, so nothing is ever replaced), then fsyncing the folder. The pointer's compare-and-swap is
done under an advisory lock of the key (``flock`` on a file in ``<root>/.export-ledger/locks/``, never inside a
published folder, and removed after use): read, compare the content's digest with the version given, write a
temporary file, fsync, ``rename`` over the pointer (readers see the old one or the new one), fsync the folder.
Readers take no lock.

Inside :meth:`LocalStore.deferred` (a group of keys, docs/protocol.md "Group commit") those fsyncs are not made one by
one: the paths are remembered, and :meth:`LocalStore.sync` makes them durable at once, with Linux's ``syncfs`` once on
each filesystem they are on (a folder under the root can be another disk's mount, or a symlink to one), or, where
``syncfs`` is not available, by fsyncing each remembered path in parallel threads (logged once). A pointer's bytes are
written and synced with its revision's data (``prepare``), so the rename that publishes it never exposes bytes a power
cut could lose.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import fcntl
import hashlib
import logging
import os
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from export_ledger.destinations.base import DestinationError, DestinationUnreachable, PublishOutcomeUnknown
from export_ledger.destinations.publishing import PublishingDestination
from export_ledger.destinations.registry import Scheme
from export_ledger.destinations.staging import process_alive
from export_ledger.destinations.store import AlreadyExists, Blob, ObjectStore, PreconditionFailed, Upload

_PUBLISHED_MODE = stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH  # 0644: mkstemp's 0600 is too tight
_CHUNK = 1 << 20
#: Where the store keeps what is not an export: its locks. Readers ignore dot folders.
_INTERNAL = ".export-ledger"
#: The lock file that earlier releases left in each key folder; removed when the key's pointer is next written.
_LEGACY_POINTER_LOCK = ".current.lock"


_log = logging.getLogger("export_ledger")
#: A prepared pointer's bytes (``.tmp-next-<name>-<pid>-<ns>``): not the ``.tmp-<name>-*`` a pointer writer removes
#: under the key's lock, since a prepared one is renamed into place under that lock later.
_PREPARED = ".tmp-next-"
#: Threads fsyncing a group's paths where ``syncfs`` is unavailable.
_SYNC_THREADS = 16


def _fsync_path(path: Path) -> None:
    deferral = _DEFERRAL.get()
    if deferral is not None and deferral.covers(path):
        deferral.paths.append(path)
        return
    _fsync_now(path)


def _fsync_now(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_handle(handle: BinaryIO, final: Path) -> None:
    """Makes an open file durable, or (deferred) remembers the name it will be linked or renamed to."""
    deferral = _DEFERRAL.get()
    if deferral is not None and deferral.covers(final):
        deferral.paths.append(final)
        return
    os.fsync(handle.fileno())


@dataclass
class _Deferral:
    """The fsyncs one :meth:`LocalStore.deferred` owes, and the pointers it prepared (by final path and bytes)."""

    root: Path
    paths: list[Path] = field(default_factory=list)
    prepared: dict[tuple[Path, bytes], Path] = field(default_factory=dict)

    def covers(self, path: Path) -> bool:
        return path == self.root or self.root in path.parents


#: The deferral of the current thread's group (None: every write is made durable before it returns).
_DEFERRAL: contextvars.ContextVar[_Deferral | None] = contextvars.ContextVar("export_ledger_deferral", default=None)
_syncfs_missing_logged = False


def _syncfs(folder: Path) -> bool:
    """``syncfs(2)`` on ``folder``'s filesystem; False where the call does not exist (not Linux)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return False
    fd = os.open(folder, os.O_RDONLY)
    try:
        if call(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        os.close(fd)
    return True


def _only_temporaries(folder: Path) -> bool:
    """Whether ``folder`` holds nothing but temporary files (or nothing)."""
    try:
        return all(entry.name.startswith(".tmp-") and entry.is_file() for entry in folder.iterdir())
    except FileNotFoundError:
        return False


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the one at ``path`` now (not removed, not replaced)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino)


def _temporary(final: Path) -> Path:
    return final.parent / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"


@dataclass(frozen=True)
class LocalStore(ObjectStore):
    """A folder whose files are the objects (names are paths under ``root``)."""

    root: Path

    def _path(self, name: str) -> Path:
        return self.root / name

    def url(self, name: str) -> str:
        return str(self._path(name)) if name else str(self.root)

    def describe(self) -> str:
        return f"local:{self.root}"

    def get(self, name: str) -> Blob | None:
        data = self.read(name)
        return None if data is None else Blob(data, hashlib.sha256(data).hexdigest())

    def read(self, name: str) -> bytes | None:
        path = self._path(name)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise DestinationUnreachable(f"cannot read {path}: {exc.strerror}") from None
        except ValueError:  # a name no file can have (a NUL byte): nothing there
            return None

    def digest(self, name: str) -> str | None:
        path = self._path(name)
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise DestinationUnreachable(f"cannot read {path}: {exc.strerror}") from None
        return digest.hexdigest()

    def _folder(self, path: Path) -> None:
        """Creates ``path``'s missing folders, each made durable in its parent."""
        missing = []
        folder = path.parent
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            try:
                folder.mkdir(mode=0o755)
            except FileExistsError:
                continue
            except OSError as exc:
                raise DestinationError(
                    f"cannot write to export destination {self.root}: {exc.strerror} ({folder})"
                ) from None
            _fsync_path(folder.parent)

    def _create(self, temporary: Path, final: Path) -> None:
        """Links the fsynced ``temporary`` to ``final`` (never over an existing file), then makes it durable."""
        try:
            os.chmod(temporary, _PUBLISHED_MODE)
            os.link(temporary, final)
        except FileExistsError:
            raise AlreadyExists(f"{final} exists") from None
        except OSError as exc:
            raise DestinationError(f"cannot create {final}: {exc.strerror}") from None
        finally:
            temporary.unlink(missing_ok=True)
        try:
            _fsync_path(final.parent)
        except OSError as exc:
            raise PublishOutcomeUnknown(f"created {final} but could not fsync its folder: {exc.strerror}") from None

    def put_if_absent(self, name: str, data: bytes) -> None:
        final = self._path(name)
        self._folder(final)
        temporary = _temporary(final)
        try:
            with open(temporary, "xb") as handle:
                handle.write(data)
                handle.flush()
                _fsync_handle(handle, final)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise DestinationError(f"cannot write {final}: {exc.strerror}") from None
        try:
            self._create(temporary, final)
        except AlreadyExists:
            if self.read(name) != data:
                raise
            # The same bytes: an earlier write of this very object (it is created by one party only).

    def upload(self, name: str) -> Upload:
        final = self._path(name)
        self._folder(final)
        return _LocalUpload(self, final)

    @contextlib.contextmanager
    def _locked(self, name: str):
        """Holds the key's lock file (``<root>/.export-ledger/locks/<digest>.lock``), and removes it when done, so no
        lock outlives its use.

        Removing a lock file is safe only with a check: a writer that waited on a file its holder removed has locked
        a file nobody else will ever lock. So the lock counts only if the file locked is still the one at the lock's
        name (same inode), and the holder removes it before releasing: whoever waited on it then finds another file
        there (or none) and locks again. Of two writers, at most one holds the file that is at the name.
        """
        path = self.root / _INTERNAL / "locks" / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.lock"
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                lock = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise DestinationError(f"cannot lock {self._path(name)}: {exc.strerror}") from None
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # writers of one object wait for each other; readers never take it
                if _same_file(lock, path):
                    break
            except BaseException:
                os.close(lock)
                raise
            os.close(lock)  # its holder removed it meanwhile: lock the file at the name now
        try:
            yield
        finally:
            try:
                path.unlink(missing_ok=True)  # before the release: see above
            finally:
                os.close(lock)

    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        final = self._path(name)
        self._folder(final)
        with self._locked(name):
            found = self.get(name)
            if (found.tag if found is not None else None) != tag:
                raise PreconditionFailed(f"{final} is not at the version read")
            for leftover in final.parent.glob(f".tmp-{final.name}-*"):
                leftover.unlink(missing_ok=True)  # written under this lock by a writer that died: nobody writes it now
            _remove_dead_prepared(final)
            # Earlier releases locked the pointer with a file beside it, in the consumer's folder; none locks it now.
            (final.parent / _LEGACY_POINTER_LOCK).unlink(missing_ok=True)
            deferral = _DEFERRAL.get()
            prepared = deferral.prepared.pop((final, data), None) if deferral is not None else None
            temporary = prepared if prepared is not None and prepared.exists() else _temporary(final)
            try:
                if temporary is not prepared:
                    with open(temporary, "xb") as handle:
                        handle.write(data)
                        handle.flush()
                        os.fsync(handle.fileno())  # never deferred: a renamed pointer is never torn
                os.chmod(temporary, _PUBLISHED_MODE)
                os.rename(temporary, final)  # atomic: readers see the old object or the new one
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                raise DestinationError(f"cannot write {final}: {exc.strerror}") from None
            try:
                _fsync_path(final.parent)
            except OSError as exc:
                # The rename happened; whether it survives a power cut is what nobody can say.
                raise PublishOutcomeUnknown(f"wrote {final} but could not fsync its folder: {exc.strerror}") from None
        return hashlib.sha256(data).hexdigest()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        if _DEFERRAL.get() is not None:
            raise DestinationError(f"{self.root}: a deferral is already open in this thread")
        deferral = _Deferral(self.root)
        reset = _DEFERRAL.set(deferral)
        try:
            yield
        finally:
            _DEFERRAL.reset(reset)
            for temporary in deferral.prepared.values():  # pointers never committed (a key failed, or was unchanged)
                temporary.unlink(missing_ok=True)

    def sync(self) -> None:
        deferral = _DEFERRAL.get()
        if deferral is None or deferral.root != self.root:
            return
        paths, deferral.paths = deferral.paths, []
        try:
            # One syncfs per filesystem the deferred paths are on: a folder under the root may be a mount or a
            # symlink to another disk, and syncfs of the root's filesystem would never reach it.
            if all(_syncfs(anchor) for anchor in _one_path_per_device(dict.fromkeys(paths))):
                return
            _log_syncfs_missing()
            with ThreadPoolExecutor(max_workers=_SYNC_THREADS) as pool:
                list(pool.map(_fsync_existing, dict.fromkeys(paths)))
        except OSError as exc:
            raise DestinationError(f"cannot sync {self.root}: {exc.strerror}") from None

    def prepare(self, name: str, data: bytes) -> None:
        deferral = _DEFERRAL.get()
        final = self._path(name)
        if deferral is None or not deferral.covers(final):
            return
        temporary = final.parent / f"{_PREPARED}{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self._folder(final)  # a key never published has none yet (its fence creates it): made durable by the sync
            with open(temporary, "xb") as handle:
                handle.write(data)
        except (OSError, DestinationError):
            temporary.unlink(missing_ok=True)
            return  # an optimisation only: put_if_match then writes and fsyncs the pointer's bytes itself
        deferral.paths.append(temporary)
        deferral.prepared[(final, data)] = temporary

    def settle(self, names: list[str]) -> None:
        for name in names:
            path = self._path(name)
            for each in (path, path.parent):
                with contextlib.suppress(FileNotFoundError):
                    _fsync_path(each)

    def list(self, prefix: str) -> list[str]:
        folder = self._path(prefix)
        names = []
        try:
            for dirpath, dirnames, filenames in os.walk(folder):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                base = Path(dirpath).relative_to(self.root).as_posix()
                # Below the folder listed, a killed writer's temporary files are listed too, so that a place holding
                # nothing else is still found and swept; at its top (a key's pointer) they are the pointer writer's,
                # removed under the key's lock.
                top = Path(dirpath) == folder
                names.extend(f"{base}/{f}" for f in filenames if not (top and f.startswith(".tmp-")))
        except OSError as exc:
            raise DestinationUnreachable(f"cannot list {folder}: {exc.strerror}") from None
        return sorted(names)

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            path.unlink(missing_ok=True)
            folder = path.parent
            if folder != self.root and _only_temporaries(folder):
                # A place's folder goes with its last object, and with what a writer killed mid-write left in it
                # (a swept place's writer is fenced: its temporary files can never become objects).
                for leftover in folder.iterdir():
                    leftover.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    folder.rmdir()
            _fsync_path(folder if folder.exists() else folder.parent)
        except OSError as exc:
            raise DestinationError(f"cannot delete {path}: {exc.strerror}") from None


class _LocalUpload(Upload):
    def __init__(self, store: LocalStore, final: Path) -> None:
        self.store, self.final = store, final
        self.temporary = _temporary(final)
        try:
            self.handle: BinaryIO = open(self.temporary, "xb")
        except OSError as exc:
            raise DestinationError(
                f"cannot write to export destination {store.root}: {exc.strerror} ({final.parent})"
            ) from None

    def commit(self) -> None:
        try:
            self.handle.flush()
            _fsync_handle(self.handle, self.final)
            self.handle.close()
        except OSError as exc:
            self.abort()
            raise DestinationError(f"cannot write {self.final}: {exc.strerror}") from None
        self.store._create(self.temporary, self.final)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.handle.close()
        self.temporary.unlink(missing_ok=True)


def _one_path_per_device(paths) -> list[Path]:
    """One of ``paths`` on each filesystem they are on (a path deleted since is skipped: nothing to make durable)."""
    anchors: dict[int, Path] = {}
    for path in paths:
        try:
            anchors.setdefault(os.stat(path).st_dev, path)
        except FileNotFoundError:
            continue
    return list(anchors.values())


def _fsync_existing(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # deleted since (a swept place): nothing to make durable
        _fsync_now(path)


def _log_syncfs_missing() -> None:
    global _syncfs_missing_logged
    if not _syncfs_missing_logged:
        _syncfs_missing_logged = True
        _log.warning(
            "syncfs is not available here: a group's writes are made durable by fsyncing each of them, "
            f"{_SYNC_THREADS} at a time"
        )


def _remove_dead_prepared(final: Path) -> None:
    """Removes prepared pointer bytes left by writers that died (their pid is gone): nobody will rename them."""
    for leftover in final.parent.glob(f"{_PREPARED}{final.name}-*"):
        pid = leftover.name.removeprefix(f"{_PREPARED}{final.name}-").split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            leftover.unlink(missing_ok=True)


#: The store a :meth:`LocalDestination.deferred` group works in, by the destination's root as given: its root is
#: resolved once for the group, not at each of a key's ~15 store operations (8% of a 310-key backfill chunk).
_PINNED: contextvars.ContextVar[tuple[str, LocalStore] | None] = contextvars.ContextVar(
    "export_ledger_pinned_store", default=None
)


@dataclass(frozen=True)
class LocalDestination(PublishingDestination):
    """Exports under a folder ``root``: the publishing template (docs/protocol.md) over :class:`LocalStore`.

    Runs on several hosts only on a shared filesystem with working ``flock`` (an NFS mount without locks is not
    enough: the pointer's compare-and-swap depends on the lock)."""

    root: str
    pool = "exports-local"

    @property
    def store(self) -> LocalStore:
        pinned = _PINNED.get()
        if pinned is not None and pinned[0] == self.root:
            return pinned[1]  # inside this destination's group: the folder it resolved when the group began
        return LocalStore(Path(self.root).expanduser().resolve())

    @staticmethod
    def check_spec(spec: str) -> str | None:
        return None  # any path; a URL-like spec no destination takes is refused by the registry

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> LocalDestination:
        return cls(root=spec)

    def spec(self) -> tuple[str, dict]:
        """The spec and settings that build this destination again."""
        return self.root, {}

    def root_of(self, export: str) -> str:  # noqa: ARG002 - one folder holds every export's own
        """The folder, absolute: a relative one names another folder from another working directory."""
        return str(Path(self.root).expanduser().resolve())

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        store = self.store
        with store.deferred():
            pinned = _PINNED.set((self.root, store))
            try:
                yield
            finally:
                _PINNED.reset(pinned)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A consumer's reads (:meth:`Destination.reading`) of a folder that exists: a mistyped or unmounted path would
        otherwise read as every key missing, the same as nothing published."""
        if not Path(self.root).expanduser().is_dir():
            raise DestinationUnreachable(
                f"the export folder {self.root_of('')} does not exist or is not a folder: nothing was read (a wrong "
                "path would look like every key missing)"
            )
        with super().reading():
            yield

    def sync(self) -> None:
        self.store.sync()


SCHEME = Scheme("", "LocalDestination", "a folder path")
