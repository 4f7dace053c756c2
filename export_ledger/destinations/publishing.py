"""The object-store template of the publishing kind (docs/protocol.md): :class:`PublishingDestination` implements
the contract, :class:`~export_ledger.destinations.pointer.PointerDestination`, once over the hooks of an object store.

Per key, at ``<export>/tenant=<tenant>/date=<YYYY-MM-DD>/``:

* ``_current.json``, **the pointer**: the only object that ever changes, and only by compare-and-swap on the version
  read (:meth:`~export_ledger.destinations.store.ObjectStore.put_if_match`). It names the current revision's place
  and carries the **fence**: the highest token that wrote it. A party with token ``t`` writes the pointer only from a
  version whose fence is at most ``t``, so once the fence reaches ``f`` no party below ``f`` can change what readers
  see, whatever its lease or its clock says.
* **places** ``r<revision>-t<token>/``, each holding ``_manifest.json`` and its data file, written object by object
  with put-if-absent by the one party holding that token, and invisible until the pointer names them.

Readers read the pointer, then the manifest and the data file it names, and check the data's sha256. Layouts of
release 0.4.0 and earlier read the same way: no pointer and a ``_manifest.json`` in the key's folder is revision 1 at
place ``.``; a pointer without a fence (0.4.0's restatements) names ``revision=<N>/`` with fence 0. The first write of
this release (a fence or a commit) replaces either with a pointer of this format naming the same revision.

A store is its hooks (:class:`~export_ledger.destinations.store.ObjectStore`: nine written, six optional); a
destination class only says which store (:class:`~export_ledger.destinations.local.LocalDestination`,
:class:`~export_ledger.destinations.s3.S3Destination`, ``gcs.py``, ``azure.py``).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

from export_ledger.destinations.base import (
    DestinationError,
    ExportTarget,
    Fenced,
    PointerMoved,
    PublishOutcomeUnknown,
    Verdict,
    Verification,
    judge,
    parse_place,
    place_name,
    reading_only,
)

# The contract and its values, importable from here as they were before the template had a contract of its own.
from export_ledger.destinations.pointer import Pointer, PointerDestination, StagedExport, in_place, pointer_otherwise
from export_ledger.destinations.store import AlreadyExists, ObjectStore, PreconditionFailed
from export_ledger.errors import ManifestError
from export_ledger.frames import MANIFEST_NAME, Manifest, TableStream, data_file_name, write_rows
from export_ledger.lazy import lazy_module

pa = lazy_module("pyarrow", globals(), "pa")

#: The key's pointer, in the key's folder.
POINTER_NAME = "_current.json"
#: Compare-and-swap rounds before a pointer that keeps changing is given up on (each lost round is another party's
#: successful write, so this is only ever reached when several parties raise the fence at once).
_ROUNDS = 8


class PublishingDestination(PointerDestination):
    """The publishing kind over an object store, the same template over any store: layout, pointer, fence, verify,
    stage, sweep, commit, discard (docs/protocol.md). A destination class only says which store."""

    @property
    @abstractmethod
    def store(self) -> ObjectStore:
        """The store this destination publishes to."""

    # -- layout --------------------------------------------------------------------------------------------------

    @staticmethod
    def key_folder(target: ExportTarget) -> str:
        return "/".join(target.parts)

    def _in_place(self, target: ExportTarget, place: str, name: str) -> str:
        return f"{self.key_folder(target)}/{in_place(place, name)}"

    def location(self, target: ExportTarget) -> str:
        if target.place is None:
            raise DestinationError(f"{self.key_folder(target)}: revision {target.revision} has no place yet")
        folder = self.key_folder(target) if target.place == "." else f"{self.key_folder(target)}/{target.place}"
        return self.store.url(folder + "/")

    def describe(self) -> str:
        return self.store.describe()

    # -- what a party holding a key does here ----------------------------------------------------------------------

    def discard_key(self, target: ExportTarget, token: int, *, logical_key: str, recorded: ExportTarget | None
                    ) -> list[str]:  # fmt: skip
        restore = Pointer.nothing() if recorded is None else self.pointer_to(recorded)
        return self.discard(target, token, logical_key=logical_key, restore=restore)

    # -- the pointer ---------------------------------------------------------------------------------------------

    def pointer(self, target: ExportTarget) -> Pointer:
        """What the key's readers see now (a legacy revision 1 without a pointer reads as one at place ``.``)."""
        name = f"{self.key_folder(target)}/{POINTER_NAME}"
        found = self.store.get(name)
        if found is not None:
            return Pointer.parse(found.data, found.tag, self.store.url(name))
        legacy = self._manifest(target, ".")
        if legacy is None:
            return Pointer.nothing()
        return Pointer(0, legacy.revision, ".", legacy.sha256, legacy.row_count, legacy.data_file, legacy.logical_key)

    def key_at(self, target: ExportTarget) -> str | None:
        pointer = self.pointer(target)
        if pointer.revision == 0 or pointer.place is None:
            return None
        try:
            manifest = self._manifest(target, pointer.place)
        except ManifestError:
            return pointer.logical_key
        return manifest.logical_key if manifest is not None else pointer.logical_key

    def pointer_to(self, target: ExportTarget) -> Pointer:
        """The pointer that names ``target`` (a recorded revision, at its place), as its manifest describes it."""
        manifest = self._manifest(target, target.place or ".")
        if manifest is None:
            raise DestinationError(f"{self.location(target)} holds no manifest: it cannot be made current again")
        return Pointer(0, target.revision, target.place, manifest.sha256, manifest.row_count, manifest.data_file,
                       manifest.logical_key)  # fmt: skip

    def fence(self, target: ExportTarget, token: int, *, logical_key: str, read: Pointer | None = None) -> Pointer:
        """The pointer rewritten with the fence raised, by compare-and-swap on the version read (``read``'s tag, when
        :meth:`prepare_fence` read it: the write is then conditional on it still being so, not read again)."""
        self.store.check_conditions()  # no conditional write goes to a store that ignores the conditions
        name = f"{self.key_folder(target)}/{POINTER_NAME}"
        for _ in range(_ROUNDS):
            current, read = (read if read is not None else self.pointer(target)), None
            if current.fence > token:
                raise self._fenced(target, current, token)
            if current.fence == token and current.tag is not None:
                return current
            fenced = replace(current, fence=token, logical_key=current.logical_key or logical_key)
            try:
                tag = self.store.put_if_match(name, fenced.payload(), current.tag)
            except PreconditionFailed:
                continue  # another party wrote the pointer since it was read: read it again
            return replace(fenced, tag=tag)
        raise DestinationError(f"{self.store.url(name)} kept changing while it was being fenced")

    def prepare_fence(self, target: ExportTarget, token: int, *, logical_key: str) -> Pointer | None:
        """Reads the key's pointer and announces the bytes :meth:`fence` will write (:meth:`ObjectStore.prepare`),
        so that within a deferral a batch of fences has its pointers' bytes made durable by one sync, before any is
        renamed into place, instead of an fsync each. Returns the pointer read, for :meth:`fence`; None when there is
        nothing to prepare or it could not be read (the fence then reads and writes as it does alone), and for a
        subclass that writes its fence its own way (it overrides :meth:`fence`: its bytes are not these)."""
        if type(self).fence is not PublishingDestination.fence:
            return None
        try:
            current = self.pointer(target)
        except DestinationError:
            return None
        if current.fence >= token:
            return current
        fenced = replace(current, fence=token, logical_key=current.logical_key or logical_key)
        self.store.prepare(f"{self.key_folder(target)}/{POINTER_NAME}", fenced.payload())
        return current

    def _fenced(self, target: ExportTarget, pointer: Pointer, token: int) -> Fenced:
        return Fenced(
            f"{self.store.url(self.key_folder(target) + '/' + POINTER_NAME)} is fenced at token {pointer.fence}, "
            f"above this party's {token}: a newer party holds the key, and nothing of this one is made visible",
            fence=pointer.fence,
        )

    # -- verdicts ------------------------------------------------------------------------------------------------

    def verify(
        self,
        target: ExportTarget,
        *,
        logical_key: str,
        superseded: int,
        expected_sha256: str | None = None,
        pointer: Pointer | None = None,
    ) -> Verification:
        pointer = pointer or self.pointer(target)
        manifest = data_sha256 = None
        where = self.key_folder(target)
        if pointer.revision not in (0, superseded) and pointer.place is not None:
            where = self.location(target.at_place(pointer.place))
            if pointer.revision == target.revision:
                manifest, data_sha256 = self._read_place(target, pointer.place)
        verification = judge(
            logical_key=logical_key, revision=target.revision, superseded=superseded,
            pointer_revision=pointer.revision, manifest=manifest, data_sha256=data_sha256,
            pointer_sha256=pointer.sha256, where=where, expected_sha256=expected_sha256,
        )  # fmt: skip
        if verification.verdict is Verdict.CONFLICT:
            where = where if where != self.key_folder(target) else self.location(target.at_place("."))
            return replace(verification, fence=pointer.fence, location=where)
        if verification.verdict is Verdict.PUBLISHED and not reading_only():
            # A consumer's read (read_current) records nothing, so it settles nothing: it needs read access only.
            # Whoever records this next (a repair, reconciliation) records it durable: its writer may have died
            # inside a deferral before the sync (docs/protocol.md, "Group commit").
            self.store.settle(
                [f"{self.key_folder(target)}/{POINTER_NAME}", self._in_place(target, pointer.place, MANIFEST_NAME),
                 self._in_place(target, pointer.place, manifest.data_file)]
            )  # fmt: skip
        return replace(verification, fence=pointer.fence)

    def verify_recorded(self, target: ExportTarget, *, logical_key: str, sha256: str) -> Verification:
        if target.place is None:
            raise DestinationError(f"{self.key_folder(target)}: a recorded revision needs its place")
        manifest, data_sha256 = self._read_place(target, target.place)
        where = self.location(target)
        verification = judge(
            logical_key=logical_key, revision=target.revision, superseded=-1, pointer_revision=target.revision,
            manifest=manifest, data_sha256=data_sha256, pointer_sha256=None, where=where, expected_sha256=sha256,
        )  # fmt: skip
        return verification

    def _manifest(self, target: ExportTarget, place: str) -> Manifest | None:
        name = self._in_place(target, place, MANIFEST_NAME)
        found = self.store.get(name)
        if found is None:
            return None
        return Manifest.from_json(found.data, self.store.url(name))

    def _read_place(self, target: ExportTarget, place: str) -> tuple[Manifest | None, str | None]:
        """A place's manifest (None: missing or unreadable) and its data file's sha256, hashed as a stream."""
        try:
            manifest = self._manifest(target, place)
        except ManifestError:
            return None, None
        if manifest is None:
            return None, None
        return manifest, self.store.digest(self._in_place(target, place, manifest.data_file))

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        name = self._in_place(target, target.place or ".", manifest.data_file)
        data = self.store.read(name)
        if data is None:
            raise DestinationError(f"{self.store.url(name)} is missing although its manifest exists")
        return data

    # -- publishing ----------------------------------------------------------------------------------------------

    def stage(
        self, target: ExportTarget, token: int, table: pa.Table | TableStream, file_format: str, manifest: Manifest
    ) -> StagedExport:
        """Writes revision ``target.revision`` at this party's own place (data file, then manifest), durably and
        invisibly; ``manifest`` gets the data's sha256 and row count. A stream that fails validation raises from the
        write, and nothing of it is left."""
        self.store.check_conditions()
        place = place_name(target.revision, token)
        data_file = data_file_name(file_format)
        name = self._in_place(target, place, data_file)
        upload = self.store.upload(name)
        try:
            sha256, row_count = write_rows(table, file_format, upload.handle)
            upload.commit()
        except OSError as exc:  # the staging file's own write (a full disk): the library's words, naming the object
            upload.abort()
            reason = exc.strerror or type(exc).__name__
            raise DestinationError(f"cannot write {self.store.url(name)}: {reason}") from None
        except BaseException:
            upload.abort()
            raise
        complete = replace(manifest, sha256=sha256, row_count=row_count, data_file=data_file)
        try:
            self.store.put_if_absent(self._in_place(target, place, MANIFEST_NAME), complete.to_json())
        except AlreadyExists:
            raise DestinationError(
                f"{self.location(target.at_place(place))} already holds another manifest: a place is written by one "
                "party only; nothing was published"
            ) from None
        staged = StagedExport(target.at_place(place), complete)
        # Within a deferral the pointer's bytes are made durable by the same sync as the data they name.
        self.store.prepare(f"{self.key_folder(target)}/{POINTER_NAME}", _committed(staged, token).payload())
        return staged

    def commit(self, staged: StagedExport, token: int, *, superseded: int) -> Pointer:
        """Makes the staged revision current: the one step that changes what readers see. Idempotent (a pointer that
        already names this place is success).

        Raises:
            Fenced: the pointer's fence is above ``token``: nothing of this party is visible.
            PointerMoved: the pointer names neither ``superseded`` nor this place: a conflict.
            PublishOutcomeUnknown: the write's outcome is unknown.
            DestinationError: the write certainly did not happen.
        """
        self.store.check_conditions()
        target, manifest = staged.target, staged.manifest
        name = f"{self.key_folder(target)}/{POINTER_NAME}"
        for _ in range(_ROUNDS):
            current = self.pointer(target)
            if current.place == target.place:
                return current  # an earlier send of this commit landed
            if current.fence > token:
                raise self._fenced(target, current, token)
            if current.revision != superseded:
                moved = PointerMoved(
                    f"{self.store.url(name)} names revision {current.revision}, not revision {superseded} which "
                    f"revision {target.revision} supersedes; it is not moved"
                )
                moved.location = self.location(target.at_place("."))
                raise moved
            committed = _committed(staged, token)
            try:
                tag = self.store.put_if_match(name, committed.payload(), current.tag)
            except PreconditionFailed:
                continue
            except PublishOutcomeUnknown as exc:
                exc.sha256, exc.location = manifest.sha256, self.location(target)
                raise
            return replace(committed, tag=tag)
        raise DestinationError(f"{self.store.url(name)} kept changing while revision {target.revision} was committed")

    def unstage(self, staged: StagedExport) -> None:
        """Deletes a staged revision that will not be committed (a restatement whose data was the current
        revision's). No pointer ever named its place, and none can: only its own party could commit it, and it
        decided not to. The manifest goes first, as in the sweep."""
        target = staged.target
        self._delete_all(self.store.list(f"{self.key_folder(target)}/{target.place}/"))

    def sweep(self, target: ExportTarget, token: int, pointer: Pointer) -> int:
        """Deletes the places no pointer ever named and none can: a token below ``token`` (fenced by now) and either
        a revision above the pointer's (the pointer never moves back), or the pointer's own revision at another place
        than the one it names (one place per revision is ever made current, and revision numbers are never given
        twice). Places of earlier revisions are kept: one of them is each earlier revision, readable for good. Returns
        how many places were removed."""
        if token <= 1:
            return 0  # a first claim: nobody held the key before
        doomed = []
        for place, names in self._places(target).items():
            parsed = parse_place(place)
            if parsed is None or parsed[1] >= token:
                continue
            revision = parsed[0]
            if revision > pointer.revision or (revision == pointer.revision and place != pointer.place):
                doomed.append(names)
        for names in doomed:
            self._delete_all(names)
        return len(doomed)

    def _places(self, target: ExportTarget) -> dict[str, list[str]]:
        """Every object of the key's folder, by place (``.`` for the objects of the folder itself, the pointer
        excepted)."""
        folder = self.key_folder(target) + "/"
        places: dict[str, list[str]] = {}
        for name in self.store.list(folder):
            relative = name[len(folder) :]
            if relative == POINTER_NAME:
                continue
            place, sep, _ = relative.partition("/")
            places.setdefault(place if sep else ".", []).append(name)
        return places

    def _delete_all(self, names: list[str]) -> None:
        # The manifest first: a place is never left as a manifest without its data.
        for name in sorted(names, key=lambda n: not n.endswith("/" + MANIFEST_NAME) and n != MANIFEST_NAME):
            self.store.delete(name)

    def discard(self, target: ExportTarget, token: int, *, logical_key: str, restore: Pointer) -> list[str]:
        """An operator's discard (after fencing with ``token``): the pointer goes back to ``restore`` (the revision
        the ledger records, or nothing), and the places of ``target.revision`` (the unrecorded one), and whatever
        other unrecorded place the pointer named, are deleted. Returns the places removed."""
        self.store.check_conditions()
        name = f"{self.key_folder(target)}/{POINTER_NAME}"
        for _ in range(_ROUNDS):
            current = self.pointer(target)
            if current.fence > token:
                raise self._fenced(target, current, token)
            if (current.revision, current.place) == (restore.revision, restore.place) and current.tag is not None:
                break
            back = replace(restore, fence=token, logical_key=logical_key, tag=None)
            try:
                self.store.put_if_match(name, back.payload(), current.tag)
            except PreconditionFailed:
                continue
            break
        else:
            raise DestinationError(f"{self.store.url(name)} kept changing while it was being set back")
        removed = []
        for place, names in sorted(self._places(target).items()):
            if place == restore.place:
                continue
            parsed = parse_place(place)
            if parsed is not None and parsed[1] >= token:
                continue  # a newer party's place (it fenced above this discard): never this discard's to delete
            if parsed is None and place != current.place:
                continue  # a legacy place is deleted only when the pointer this discard fenced named it
            revision = parsed[0] if parsed else current.revision
            if revision == target.revision or place == current.place:
                self._delete_all(names)
                removed.append(place)
        after = self.pointer(target)
        if after.fence > token:
            raise self._fenced(target, after, token)
        return removed


def _committed(staged: StagedExport, token: int) -> Pointer:
    """The pointer that makes ``staged`` current, written by ``token``."""
    target, manifest = staged.target, staged.manifest
    return Pointer(
        token, target.revision, target.place, manifest.sha256, manifest.row_count, manifest.data_file,
        manifest.logical_key,
    )  # fmt: skip


__all__ = [
    "POINTER_NAME",
    "Pointer",
    "PointerDestination",
    "PublishingDestination",
    "StagedExport",
    "Verdict",
    "pointer_otherwise",
]
