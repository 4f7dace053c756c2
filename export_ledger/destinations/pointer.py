"""The publishing kind's contract (docs/protocol.md): :class:`PointerDestination`, the steps the protocol asks of a
destination whose exports are published behind a key's fenced pointer, and what is written once over them; and the
values its steps pass: :class:`Pointer` (what readers see of a key, and its fence) and :class:`StagedExport` (a
revision staged, not yet committed).

Two kinds implement it: the object-store template, :class:`~export_ledger.destinations.publishing.PublishingDestination`
(a local folder, S3, GCS, Azure), and :class:`~export_ledger.destinations.delta.DeltaDestination`, over a Delta
table's log.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from dataclasses import dataclass

from export_ledger.destinations.base import (
    Destination,
    DestinationConflict,
    DestinationError,
    ExportTarget,
    Opened,
    Verification,
    place_of_location,
)
from export_ledger.errors import safe_message
from export_ledger.frames import MANIFEST_NAME, Manifest, TableStream
from export_ledger.lazy import lazy_module

pa = lazy_module("pyarrow", globals(), "pa")

#: The version of the pointer's JSON form (:meth:`Pointer.payload`), as the object-store template stores it.
POINTER_FORMAT = 2


@dataclass(frozen=True)
class Pointer:
    """The key's pointer as read: what readers see. The object-store template stores it as JSON (:meth:`payload`,
    :meth:`parse`); Delta reads it from its table's log.

    Attributes:
        fence: The highest token that wrote it (0: written by 0.4.0 or earlier, or absent).
        revision: The current revision (0: nothing published).
        place: Its place (None when nothing is published).
        sha256, row_count, data_file: The current revision's data (``data_file`` relative to its place).
        logical_key: The key.
        tag: The store's version tag of the pointer object; None when there is none (absent, or a legacy revision 1
            without a pointer): a write must then create it.
    """

    fence: int
    revision: int
    place: str | None
    sha256: str | None = None
    row_count: int | None = None
    data_file: str | None = None
    logical_key: str | None = None
    tag: str | None = None

    @classmethod
    def nothing(cls) -> Pointer:
        return cls(0, 0, None)

    def payload(self) -> bytes:
        values: dict = {"format": POINTER_FORMAT, "fence": self.fence, "revision": self.revision}
        if self.logical_key is not None:
            values["logical_key"] = self.logical_key
        if self.revision:
            values.update(
                path=self.place,
                manifest=in_place(self.place, MANIFEST_NAME),
                data_file=in_place(self.place, self.data_file),
                sha256=self.sha256,
                row_count=self.row_count,
            )
        return (json.dumps(values, indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def parse(cls, payload: bytes, tag: str, where: str) -> Pointer:
        try:
            values = json.loads(payload)
            revision = values["revision"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError):
            raise DestinationConflict(f"pointer {where} is not a JSON object with a revision") from None
        fence = values.get("fence", 0)
        if not _count(revision) or not _count(fence):
            raise DestinationConflict(f"pointer {where} names revision {revision!r} with fence {fence!r}")
        if revision == 0:
            return cls(fence, 0, None, logical_key=values.get("logical_key"), tag=tag)
        place = values.get("path")
        data_file = values.get("data_file")
        if not isinstance(place, str) or not isinstance(data_file, str):
            raise DestinationConflict(f"pointer {where} names revision {revision} without its path and data file")
        if not (_relative(place) and _relative(data_file)):
            raise DestinationConflict(f"pointer {where} names a path outside its key's folder")
        prefix = "" if place == "." else f"{place}/"
        return cls(
            fence, revision, place, values.get("sha256"), values.get("row_count"), data_file.removeprefix(prefix),
            values.get("logical_key"), tag,
        )  # fmt: skip


def pointer_otherwise(pointer: Pointer, target: ExportTarget, sha256: str) -> str | None:
    """What ``pointer`` names instead of ``target`` (its revision, at its place) with ``sha256``, in words; None when
    it names exactly that (a pointer without a sha256, a legacy revision 1's, names any)."""
    if (pointer.revision, pointer.place) == (target.revision, target.place) and pointer.sha256 in (None, sha256):
        return None
    return (
        f"its pointer names revision {pointer.revision} at {pointer.place} (sha256 {pointer.sha256}), the ledger "
        f"recorded revision {target.revision} at {target.place}"
    )


@dataclass(frozen=True)
class StagedExport:
    """A revision written at its place and not yet committed: invisible to readers."""

    target: ExportTarget
    manifest: Manifest


class PointerDestination(Destination):
    """The publishing kind (``takes_effect = "published"``): a key's export is staged where readers do not see it,
    then made current by one commit of the key's *pointer*, outside the ledger, and recorded after; the pointer
    carries the fence that keeps an older party from changing what readers see (docs/protocol.md).

    A kind writes the protocol's steps on one key (:data:`export_ledger.steps.PUBLISHING_STEPS`): :meth:`pointer`,
    :meth:`fence`, :meth:`verify`, :meth:`sweep`, :meth:`stage`, :meth:`commit`, :meth:`unstage` and
    :meth:`location`, and what every destination answers (:meth:`verify_recorded`, :meth:`read_data`,
    :meth:`key_at`). Written once here over them: :meth:`hold`, :meth:`open`, :meth:`current_revision`,
    :meth:`readers_see_otherwise`, :meth:`attempt_location` and :meth:`recorded_here`.

    Two kinds: :class:`~export_ledger.destinations.publishing.PublishingDestination`, the template over an object
    store (a local folder, S3, GCS, Azure), and :class:`~export_ledger.destinations.delta.DeltaDestination`, over a
    Delta table's log.
    """

    takes_effect = "published"

    # -- the protocol's steps on one key -------------------------------------------------------------------------

    @abstractmethod
    def pointer(self, target: ExportTarget) -> Pointer:
        """What the key's readers see now: its current revision and place, and the fence (nothing: revision 0).

        Raises:
            DestinationUnreachable: the destination cannot say.
        """

    @abstractmethod
    def fence(self, target: ExportTarget, token: int, *, logical_key: str, read: Pointer | None = None) -> Pointer:
        """Raises the key's fence to ``token``, keeping what its pointer names: from now on no party with a lower
        token can change what the key's readers see. Returns the pointer as fenced. ``read``: the pointer as this
        destination's own :meth:`prepare_fence` read it, passed only when that returned one; a kind that prepares
        nothing is never given it, and need not declare it.

        Raises:
            Fenced: the fence is already above ``token``.
            PublishOutcomeUnknown: the write's outcome is unknown (nothing readers see changed either way).
        """

    @abstractmethod
    def verify(
        self,
        target: ExportTarget,
        *,
        logical_key: str,
        superseded: int,
        expected_sha256: str | None = None,
        pointer: Pointer | None = None,
    ) -> Verification:
        """:meth:`Destination.verify`, judged from ``pointer`` when the caller has just read or fenced it."""

    @abstractmethod
    def sweep(self, target: ExportTarget, token: int, pointer: Pointer) -> int:
        """Before ``token``'s party stages: removes what earlier parties staged and no pointer ever named or can
        (their tokens are fenced); returns how many places were removed."""

    @abstractmethod
    def stage(
        self, target: ExportTarget, token: int, table: pa.Table | TableStream, file_format: str, manifest: Manifest
    ) -> StagedExport:
        """Makes revision ``target.revision`` ready to commit at this party's own place, invisible to readers;
        the staged manifest has the data's sha256 and row count. A stream that fails validation raises from here,
        and nothing of it is left."""

    @abstractmethod
    def commit(self, staged: StagedExport, token: int, *, superseded: int) -> Pointer:
        """Makes the staged revision current: the one step that changes what readers see. Idempotent (a pointer that
        already names this place is success).

        Raises:
            Fenced: the fence is above ``token``: nothing of this party is visible.
            PointerMoved: the pointer names neither ``superseded`` nor this place: a conflict.
            PublishOutcomeUnknown: the write's outcome is unknown.
            DestinationError: the write certainly did not happen.
        """

    @abstractmethod
    def unstage(self, staged: StagedExport) -> None:
        """Removes a staged revision that will not be committed (a restatement whose data was the current
        revision's): no pointer ever named it, and none can."""

    # -- written once over the steps ---------------------------------------------------------------------------

    def hold(self, target: ExportTarget, token: int, *, logical_key: str) -> Pointer:
        return self.fence(target, token, logical_key=logical_key)

    def open(
        self,
        target: ExportTarget,
        token: int,
        *,
        logical_key: str,
        superseded: int,
        expected_sha256: str | None = None,
        read: Pointer | None = None,
    ) -> Opened:
        # A prepared read goes to fence() only when there is one: a kind that prepares nothing takes no read.
        pointer = (
            self.hold(target, token, logical_key=logical_key)
            if read is None
            else self.fence(target, token, logical_key=logical_key, read=read)
        )
        verification = self.verify(
            target, logical_key=logical_key, superseded=superseded, expected_sha256=expected_sha256, pointer=pointer
        )
        return Opened(pointer, verification)

    def current_revision(self, target: ExportTarget) -> int:
        return self.pointer(target).revision

    def readers_see_otherwise(self, target: ExportTarget, *, sha256: str) -> str | None:
        """What the key's pointer (what readers follow) names instead of ``target`` with ``sha256``."""
        try:
            pointer = self.pointer(target)
        except DestinationConflict as exc:
            return safe_message(exc)
        return pointer_otherwise(pointer, target, sha256)

    def attempt_location(self, target: ExportTarget) -> str | None:
        return self.location(target)

    def recorded_here(self, target: ExportTarget, location: str) -> bool:
        try:
            return self.location(target.at_place(place_of_location(location))) == location
        except DestinationError:
            return True  # this destination cannot say where such a place would be: judged here, as before


def in_place(place: str | None, name: str | None) -> str | None:
    """``name`` within ``place`` of a key's folder (``.``, or None: the folder itself)."""
    if name is None:
        return None
    return name if place in (None, ".") else f"{place}/{name}"


def _relative(path: str) -> bool:
    """A path inside the key's folder: relative, no parent steps, no NUL (a pointer is read from the store: it is
    input like any other)."""
    parts = path.split("/")
    return bool(path) and "\x00" not in path and not path.startswith("/") and ".." not in parts and "\\" not in path


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


__all__ = ["POINTER_FORMAT", "Pointer", "PointerDestination", "StagedExport", "in_place", "pointer_otherwise"]
