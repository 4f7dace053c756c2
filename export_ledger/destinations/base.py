"""Where exports go: two kinds of destination, each with a few small hooks. Plain Python, no Dagster.

A *publishing* destination (a local folder, an object store) follows this protocol, driven by
:func:`export_ledger.protocol.export_key`:

1. ``probe``: is an export for this key already published? (repair after a crash, never a second copy)
2. ``stage``: write the data file (hashed while written) and the manifest somewhere invisible to readers;
3. ``publish``: make both visible in one atomic step, refusing to replace anything already there;
4. the protocol then records completion in the ledger.

A *transactional* destination lives in the ledger's own database: ``write_in_transaction`` writes the rows with the
ledger's connection, inside the transaction that records completion, so effect and record commit together.
"""

from __future__ import annotations

import datetime as dt
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

import pyarrow as pa

from export_ledger.errors import ExportLedgerError
from export_ledger.frames import Manifest, TableStream


class DestinationError(ExportLedgerError, RuntimeError):
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
    """Where one revision of one logical export lives: ``<export>/tenant=<tenant>/date=<YYYY-MM-DD>`` for revision 1
    (what every first export writes), ``.../date=<YYYY-MM-DD>/revision=<N>`` for a restatement's revision N."""

    export: str
    tenant: str
    business_date: str
    revision: int = 1

    @property
    def parts(self) -> tuple[str, str, str]:
        """The key's folder (revision 1's place, and where the key's current pointer lives)."""
        return (self.export, f"tenant={self.tenant}", f"date={self.business_date}")

    @property
    def revision_part(self) -> str | None:
        """The revision's folder inside the key's, or None for revision 1."""
        return None if self.revision == 1 else f"revision={self.revision}"

    def at_revision(self, revision: int) -> ExportTarget:
        return ExportTarget(self.export, self.tenant, self.business_date, revision)


#: The name of a key's current pointer, in the key's folder: ``{"revision": N, "sha256": ..., "logical_key": ...}``.
#: Absent, the current revision is 1 (the key's folder itself): exports never restated need no pointer.
CURRENT_NAME = "_current.json"


class PointerMoved(DestinationConflict):
    """The key's current pointer is not at the revision this restatement supersedes: never moved over it."""


def pointer_payload(target: ExportTarget, manifest: Manifest) -> bytes:
    """The current pointer's content: the revision, its folder (relative to the key's) and sha256, the data file's
    name and the key (for a reader's check). Every publishing destination writes these bytes.

    Example:
        ``{"data_file": "data.csv", "logical_key": "...", "path": "revision=2", "revision": 2, "sha256": "..."}``
    """
    values = {
        "logical_key": manifest.logical_key,
        "revision": target.revision,
        "path": target.revision_part or ".",
        "sha256": manifest.sha256,
        "data_file": manifest.data_file,
    }
    return (json.dumps(values, indent=2, sort_keys=True) + "\n").encode("utf-8")


def pointer_revision(payload: bytes, where: str) -> int:
    """The revision a current pointer's bytes name; ``where`` names the pointer in the error.

    Raises:
        DestinationError: the bytes are not a pointer, or name no valid revision.
    """
    try:
        revision = json.loads(payload)["revision"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise DestinationError(f"current pointer {where} is not a JSON object with a revision") from None
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
        raise DestinationError(f"current pointer {where} names revision {revision!r}")
    return revision


@dataclass(frozen=True)
class StagedExport:
    """An export written but not yet visible."""

    target: ExportTarget
    manifest: Manifest
    handle: str


class Destination(ABC):
    """What every destination answers: where a key's export is, whether it is there, and its bytes."""

    #: The Dagster concurrency pool kind exports to this destination run in (each destination kind has its own).
    pool: str = "exports"

    @abstractmethod
    def location(self, target: ExportTarget) -> str:
        """Where the committed export for ``target`` is, as recorded in the ledger."""

    @abstractmethod
    def probe(self, target: ExportTarget) -> Manifest | None:
        """The manifest published at ``target``, or None when nothing is published there."""

    @abstractmethod
    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        """The committed data file's bytes."""

    def describe(self) -> str:
        """A description safe for logs: no credentials."""
        return type(self).__name__

    @abstractmethod
    def discard_target(self, target: ExportTarget) -> list[str]:
        """Removes whatever is at the key's place (an operator decided it is not to be kept); returns what."""

    def current(self, target: ExportTarget) -> int:
        """The key's current revision as the destination's pointer says (1 when there is no pointer)."""
        return 1

    def move_current(self, target: ExportTarget, manifest: Manifest, *, supersedes: int) -> None:
        """Moves the key's current pointer from revision ``supersedes`` to ``target.revision`` (whose published
        manifest is ``manifest``), atomically: readers see the old revision or the new one, never neither.

        Idempotent: a pointer already at ``target.revision`` is left as it is (an earlier attempt moved it and died).

        Raises:
            PointerMoved: the pointer is at neither revision (someone else moved it); nothing is changed.
            PublishOutcomeUnknown: the move may or may not have taken effect.
            DestinationError: the pointer was not moved.
        """
        raise DestinationError(f"{self.describe()} does not support restatements (no current pointer)")


class PublishingDestination(Destination):
    """A destination outside the ledger's database: stage invisibly, publish atomically, never replace."""

    @abstractmethod
    def stage(
        self, target: ExportTarget, table: pa.Table | TableStream, file_format: str, manifest: Manifest
    ) -> StagedExport:
        """Writes data and manifest where readers cannot see them; ``manifest`` gets the sha256 and row count.

        ``table`` is a whole table, or a stream of validated tables to write batch by batch with
        :func:`~export_ledger.frames.write_rows`; a stream that fails validation raises from the write, and the
        partly staged export must then be removed before the error goes on.
        """

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

    def discard_abandoned(
        self, target: ExportTarget, below_token: int, *, min_age: dt.timedelta = dt.timedelta(0)
    ) -> int:
        """Removes what attempts with a lower fencing token staged and never published; returns how many."""
        return 0


class TransactionalDestination(Destination):
    """A destination inside the ledger's own database: rows and completion record commit in one transaction."""

    @abstractmethod
    def write_in_transaction(self, connection, target: ExportTarget, table: pa.Table, manifest: Manifest) -> Manifest:
        """Writes the export with the ledger's connection, inside the completion transaction."""
