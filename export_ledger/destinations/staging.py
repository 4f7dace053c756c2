"""A data file staged in a private local file before it goes to a remote store: its size and sha256 are known before
anything is sent, and a stream that fails validation leaves nothing remote. Shared by the GCS and Azure stores."""

from __future__ import annotations

import hashlib
import os
import tempfile
from abc import abstractmethod
from pathlib import Path

from export_ledger.destinations.store import Upload

_CHUNK = 1 << 20


def staging_folder(kind: str) -> Path:
    """``<tmp>/export-ledger-<kind>-staging`` (mode 0700), after removing files of writers that died mid-export:
    they hold customer data and nobody else would delete them."""
    folder = Path(tempfile.gettempdir()) / f"export-ledger-{kind}-staging"
    folder.mkdir(mode=0o700, exist_ok=True)
    for entry in folder.iterdir():
        pid_text = entry.name.split("-", 1)[0]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and not process_alive(int(pid_text)):
            entry.unlink(missing_ok=True)
    return folder


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class StagedFileUpload(Upload):
    """Writes go to a private file; :meth:`commit` hands it to :meth:`send`, and the file is removed either way."""

    def __init__(self, folder: Path) -> None:
        handle, path = tempfile.mkstemp(prefix=f"{os.getpid()}-", dir=folder)
        self.path = Path(path)
        self.handle = os.fdopen(handle, "wb")

    @abstractmethod
    def send(self, path: Path, size: int) -> None:
        """Creates the object from the staged file, only if absent (raises ``AlreadyExists`` for other bytes)."""

    def commit(self) -> None:
        self.handle.close()
        try:
            self.send(self.path, self.path.stat().st_size)
        finally:
            self.path.unlink(missing_ok=True)

    def abort(self) -> None:
        try:
            self.handle.close()
        finally:
            self.path.unlink(missing_ok=True)
