"""Where exports are published: an abstract destination with small hooks, and the local filesystem one.

The protocol every destination follows (driven by :mod:`resources.io_manager`):

1. ``probe``: is an export for this key already published? (repair after a crash, never a second copy)
2. ``stage``: write the data file (hashed while written) and the manifest somewhere invisible to readers;
3. ``publish``: make both visible in one atomic step, refusing to replace anything already there;
4. the I/O manager then records completion in the ledger.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow as pa

from resources.exportfile import MANIFEST_NAME, Manifest, write_table


class DestinationError(RuntimeError):
    """The destination refused or failed an operation before anything was published."""


class PublishOutcomeUnknown(DestinationError):
    """The publish step may or may not have taken effect; only the destination's evidence can tell."""


class DestinationUnreachable(DestinationError):
    """The destination could not be reached at all; nothing was read or written."""


class DestinationConflict(DestinationError):
    """The destination holds something else where this export belongs; it is never overwritten."""


class PublishedElsewhere(DestinationError):
    """Another attempt's export already sits at the target; it is never replaced."""

    def __init__(self, message: str, manifest: Manifest) -> None:
        super().__init__(message)
        self.manifest = manifest


@dataclass(frozen=True)
class ExportTarget:
    """Where one logical export lives: ``<export>/tenant=<tenant>/date=<YYYY-MM-DD>``."""

    export: str
    tenant: str
    business_date: str

    @property
    def parts(self) -> tuple[str, str, str]:
        return (self.export, f"tenant={self.tenant}", f"date={self.business_date}")


@dataclass(frozen=True)
class StagedExport:
    """An export written but not yet visible."""

    target: ExportTarget
    manifest: Manifest
    handle: str


class Destination(dg.ConfigurableResource, ABC):
    """A place exports are published to. Implementations fill in a few small hooks.

    A *transactional* destination (``write_in_transaction``) lives in the ledger's own database: its rows and the
    completion record commit in one transaction, so there is no publish step and no unknown outcome.
    """

    @property
    def transactional(self) -> bool:
        return False

    @property
    def pool(self) -> str:
        """The Dagster concurrency pool exports to this destination run in (each destination kind has its own)."""
        raise NotImplementedError

    def write_in_transaction(self, connection, target: ExportTarget, table: pa.Table, manifest: Manifest) -> Manifest:
        """Writes the export with the ledger's connection, inside the completion transaction (transactional only)."""
        raise NotImplementedError(f"{type(self).__name__} is not transactional")

    @abstractmethod
    def location(self, target: ExportTarget) -> str:
        """Where the committed export for ``target`` is, as recorded in the ledger."""

    @abstractmethod
    def probe(self, target: ExportTarget) -> Manifest | None:
        """The manifest published at ``target``, or None when nothing is published there."""

    @abstractmethod
    def stage(self, target: ExportTarget, table: pa.Table, file_format: str, manifest: Manifest) -> StagedExport:
        """Writes data and manifest where readers cannot see them; ``manifest`` gets the sha256 and row count."""

    @abstractmethod
    def publish(self, staged: StagedExport) -> Manifest:
        """Makes a staged export visible atomically.

        Raises:
            PublishedElsewhere: the target already holds an export (never replaced).
            PublishOutcomeUnknown: the export may or may not be visible.
            DestinationError: nothing was published.
        """

    @abstractmethod
    def discard(self, staged: StagedExport) -> None:
        """Removes a staged export that will not be published."""

    @abstractmethod
    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        """The committed data file's bytes."""

    def describe(self) -> str:
        """A description safe for logs: no credentials."""
        return type(self).__name__

    def discard_abandoned(self, target: ExportTarget, below_token: int) -> int:
        """Removes what attempts with a lower fencing token staged and never published; returns how many."""
        return 0


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_PUBLISHED_MODE = stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH  # 0644: mkstemp's 0600 is too tight


class LocalDestination(Destination):
    """Exports as directories under ``root``, published with one atomic ``rename`` of a fsynced staging directory.

    Staging directories are named ``.staging-...`` beside their target (same filesystem, so the rename is atomic)
    and are ignored by readers.
    """

    root: str

    @property
    def pool(self) -> str:
        return "exports-local"

    def _root(self) -> Path:
        return Path(self.root).expanduser().resolve()

    def _target_dir(self, target: ExportTarget) -> Path:
        return self._root().joinpath(*target.parts)

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

    def stage(self, target: ExportTarget, table: pa.Table, file_format: str, manifest: Manifest) -> StagedExport:
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
                sha256 = write_table(table, file_format, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(data_path, _PUBLISHED_MODE)
            complete = Manifest(**{**manifest.__dict__, "sha256": sha256, "row_count": table.num_rows})
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

    def discard_abandoned(self, target: ExportTarget, below_token: int) -> int:
        """Removes staging folders that earlier attempts (lower fencing tokens) left behind when they died."""
        parent = self._target_dir(target).parent
        removed = 0
        if not parent.is_dir():
            return 0
        prefix = f".staging-date={target.business_date}-t"
        for entry in parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            token_text = entry.name[len(prefix) :].split("-", 1)[0]
            if token_text.isdigit() and int(token_text) < below_token:
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        return removed

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        path = self._target_dir(target) / manifest.data_file
        try:
            return path.read_bytes()
        except OSError as exc:
            raise DestinationError(f"cannot read committed export {path}: {exc.strerror}") from None
