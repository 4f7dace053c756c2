"""The local filesystem destination: one folder per export, published with one atomic ``rename``."""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from export_ledger.destinations.base import (
    CURRENT_NAME,
    DestinationError,
    ExportTarget,
    PointerMoved,
    PublishedElsewhere,
    PublishingDestination,
    PublishOutcomeUnknown,
    StagedExport,
    pointer_payload,
    pointer_revision,
)
from export_ledger.frames import MANIFEST_NAME, Manifest, TableStream, write_rows


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_PUBLISHED_MODE = stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH  # 0644: mkstemp's 0600 is too tight


@dataclass(frozen=True)
class LocalDestination(PublishingDestination):
    """Exports as directories under ``root``, published with one atomic ``rename`` of a fsynced staging directory.

    Staging directories are named ``.staging-...`` beside their target (same filesystem, so the rename is atomic)
    and are ignored by readers.

    A restatement's revision N is published the same way at ``date=<D>/revision=<N>``, beside the revisions before
    it, and the key's current pointer ``date=<D>/_current.json`` then moves to it with one atomic ``rename`` of a
    fsynced file (under an advisory lock, with a check of where it points first, so a lost update is refused).
    """

    root: str
    pool = "exports-local"

    def _root(self) -> Path:
        return Path(self.root).expanduser().resolve()

    def _key_dir(self, target: ExportTarget) -> Path:
        return self._root().joinpath(*target.parts)

    def _target_dir(self, target: ExportTarget) -> Path:
        folder = self._key_dir(target)
        return folder if target.revision_part is None else folder / target.revision_part

    def location(self, target: ExportTarget) -> str:
        return str(self._target_dir(target))

    def describe(self) -> str:
        return f"local:{self._root()}"

    def probe(self, target: ExportTarget) -> Manifest | None:
        manifest_path = self._target_dir(target) / MANIFEST_NAME
        try:
            payload = manifest_path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None  # nothing was ever published there
        except OSError as exc:
            raise DestinationError(f"cannot read {manifest_path}: {exc.strerror}") from None
        return Manifest.from_json(payload, str(manifest_path))

    def stage(
        self, target: ExportTarget, table: pa.Table | TableStream, file_format: str, manifest: Manifest
    ) -> StagedExport:
        final = self._target_dir(target)
        parent = final.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".staging-{final.name}-t{manifest.fencing_token}-", dir=parent))
        except OSError as exc:
            raise DestinationError(
                f"cannot write to export destination {self._root()}: {exc.strerror or exc} ({exc.filename or parent})"
            ) from None
        try:
            data_path = staging / manifest.data_file
            with open(data_path, "xb") as handle:
                sha256, row_count = write_rows(table, file_format, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(data_path, _PUBLISHED_MODE)
            complete = Manifest(**{**manifest.__dict__, "sha256": sha256, "row_count": row_count})
            manifest_path = staging / MANIFEST_NAME
            with open(manifest_path, "xb") as handle:
                handle.write(complete.to_json())
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(manifest_path, _PUBLISHED_MODE)
            os.chmod(staging, 0o755)
            _fsync_path(staging)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise DestinationError(f"cannot stage export in {parent}: {exc.strerror or exc}") from None
            raise
        return StagedExport(target, complete, str(staging))

    def publish(self, staged: StagedExport) -> Manifest:
        final = self._target_dir(staged.target)
        staging = Path(staged.handle)
        try:
            # rename(2) of a directory onto a non-empty directory fails, so an existing export is never replaced.
            # An empty directory at the target (never made by this protocol) would be replaced; refuse it first.
            if final.exists():
                existing = self.probe(staged.target)
                if existing is not None:
                    raise PublishedElsewhere(f"an export is already published at {final}", existing)
                raise DestinationError(f"{final} exists without a manifest; refusing to publish over it")
            os.rename(staging, final)
        except OSError as exc:
            existing = self.probe(staged.target)
            if existing is not None:
                raise PublishedElsewhere(f"an export is already published at {final}", existing) from None
            raise DestinationError(f"cannot publish to {final}: {exc.strerror or exc}") from None
        try:
            _fsync_path(final.parent)
        except OSError as exc:
            # The rename happened; whether it survives a power cut is what we cannot say.
            raise PublishOutcomeUnknown(f"published {final} but could not fsync its folder: {exc.strerror}") from None
        return staged.manifest

    def discard(self, staged: StagedExport) -> None:
        shutil.rmtree(staged.handle, ignore_errors=True)

    def discard_target(self, target: ExportTarget) -> list[str]:
        """Moves whatever is at the key's place aside, into ``.discarded-date=...-<time>`` beside it (readers ignore
        dot folders; the evidence is kept for the operator to delete); returns what was there."""
        final = self._target_dir(target)
        if not final.exists():
            return []
        names = sorted(p.name for p in final.iterdir()) if final.is_dir() else [final.name]
        aside = final.parent / f".discarded-{final.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        try:
            os.rename(final, aside)
            _fsync_path(final.parent)
        except OSError as exc:
            raise DestinationError(f"cannot move {final} aside: {exc.strerror or exc}") from None
        return names

    def discard_abandoned(
        self, target: ExportTarget, below_token: int, *, min_age: dt.timedelta = dt.timedelta(0)
    ) -> int:
        """Removes staging folders that earlier attempts (lower fencing tokens) left behind when they died."""
        parent = self._target_dir(target).parent
        removed = 0
        if not parent.is_dir():
            return 0
        prefix = f".staging-{self._target_dir(target).name}-t"
        for entry in parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            token_text = entry.name[len(prefix) :].split("-", 1)[0]
            if token_text.isdigit() and int(token_text) < below_token:
                # Move it out of the way first, atomically, then delete what was moved. The old attempt may be alive
                # (its lease merely expired) and rename this very folder into place at any moment: either our rename
                # wins (its publish then fails, nothing published) or its rename wins (ours fails: the folder is
                # now a published export, and it is left alone). Never delete inside a folder we did not move.
                trash = parent / f".trash-{entry.name}-{os.getpid()}-{time.monotonic_ns()}"
                try:
                    os.rename(entry, trash)
                except OSError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
                removed += 1
        return removed

    def current(self, target: ExportTarget) -> int:
        pointer = self._key_dir(target) / CURRENT_NAME
        try:
            payload = pointer.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return 1
        except OSError as exc:
            raise DestinationError(f"cannot read {pointer}: {exc.strerror}") from None
        return pointer_revision(payload, str(pointer))

    def move_current(self, target: ExportTarget, manifest: Manifest, *, supersedes: int) -> None:
        folder = self._key_dir(target)
        pointer = folder / CURRENT_NAME
        try:
            lock = os.open(folder / ".current.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DestinationError(f"cannot lock {folder}'s current pointer: {exc.strerror or exc}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # movers of one key wait for each other; readers never take it
            now = self.current(target)
            if now == target.revision:
                return  # an earlier attempt moved it and died before recording: nothing to do
            if now != supersedes:
                raise PointerMoved(
                    f"{pointer} points at revision {now}, not at revision {supersedes} which revision "
                    f"{target.revision} supersedes; it is not moved"
                )
            payload = pointer_payload(target, manifest)
            temporary = folder / f".current-{os.getpid()}-{time.monotonic_ns()}"
            try:
                with open(temporary, "xb") as handle:
                    handle.write(payload)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(temporary, _PUBLISHED_MODE)
                os.rename(temporary, pointer)  # atomic: readers see the old pointer or the new one
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                raise DestinationError(f"cannot move {pointer}: {exc.strerror or exc}") from None
            try:
                _fsync_path(folder)
            except OSError as exc:
                raise PublishOutcomeUnknown(
                    f"moved {pointer} to revision {target.revision} but could not fsync its folder: {exc.strerror}"
                ) from None
        finally:
            os.close(lock)

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        path = self._target_dir(target) / manifest.data_file
        try:
            return path.read_bytes()
        except OSError as exc:
            raise DestinationError(f"cannot read committed export {path}: {exc.strerror}") from None
