"""The key's pointer on a store that can only create (no compare-and-swap): a numbered sequence of pointer objects.

A store whose :attr:`~export_ledger.destinations.store.ObjectStore.compare_and_swap` is False (an SFTP server:
OpenSSH's rename refuses to replace, so "create if absent" is atomic, but nothing replaces an object only if it is
still at the version read) gets its pointer from :class:`SequencedPointers`, which wraps the store so that the
publishing template (:class:`~export_ledger.destinations.publishing.PublishingDestination`) runs unchanged over it.

Per key, the pointer ``<key>/_current.json`` of the other stores is instead the folder ``<key>/_pointers/`` of
pointer objects ``000000000001.json``, ``000000000002.json``, ... each holding what ``_current.json`` holds
(:class:`~export_ledger.destinations.pointer.Pointer`'s payload), each created only if absent and never changed:

* **the current pointer is the highest number** (its version tag is that number);
* **a compare-and-swap from version N is the create of N + 1**: it succeeds only if nobody created N + 1 first,
  and N + 1 can only be created by a party that read N as the highest. So of the parties that read N, exactly one
  moves the pointer, and a party that read an older number finds its N + 1 taken: the same outcome, read for read,
  as a compare-and-swap on the version read (docs/protocol.md; the model in tests/model/ holds for it unchanged).
  "Create if absent" (version None) is the create of number 1.

A reader lists ``<key>/_pointers/``, takes the highest number, and reads the manifest and data it names. A listing
taken before N + 1 was created sees N: the reader sees the pointer as it was at its listing, never a mix.

Pointer objects are never deleted by the library: a deleted number below the highest could be created again by a
party that read it long ago and stalled, and that create would succeed while changing nothing readers see (the
higher number stays current), so the party would believe it had moved the pointer. Each fence, commit and discard
adds one object of ~300 bytes, two per run of a key: a key's listing stays short (a key restated ten times holds
about twenty).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from export_ledger.destinations.base import DestinationError
from export_ledger.destinations.store import AlreadyExists, Blob, ObjectStore, PreconditionFailed, Upload

#: The pointer's name in the template (``publishing.POINTER_NAME``; not imported: publishing imports the stores).
POINTER_NAME = "_current.json"
#: The folder of a key's pointer objects, in the key's folder.
POINTERS_FOLDER = "_pointers"
#: A pointer object's name: its number, zero-padded so that names sort as numbers do.
_NUMBERED = re.compile(r"(\d{1,18})\.json")
_WIDTH = 12


def pointer_object(folder: str, number: int) -> str:
    """The name of pointer object ``number`` of the key folder ``folder``."""
    return f"{folder}/{POINTERS_FOLDER}/{number:0{_WIDTH}d}.json"


def numbers(names: list[str], folder: str) -> list[int]:
    """The numbers of the pointer objects among ``names`` (a listing of ``<folder>/_pointers/``), ascending; other
    names (a writer's temporary file) are not pointers."""
    prefix = f"{folder}/{POINTERS_FOLDER}/"
    found = []
    for name in names:
        match = _NUMBERED.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


@dataclass(frozen=True)
class SequencedPointers(ObjectStore):
    """A store that can only create, with each key's pointer as a sequence of created objects (see the module).

    Every name but a pointer's (``<key>/_current.json``) passes through to ``inner``; a pointer's ``get`` reads the
    highest pointer object, its ``put_if_match`` creates the next one, and a listing shows a key's pointer objects as
    the one name ``<key>/_current.json``, so the template's sweep and discard never see them as a place.
    """

    inner: ObjectStore
    compare_and_swap: ClassVar[bool] = True  # this wrapper gives the pointer the compare-and-swap's semantics

    @staticmethod
    def _folder_of(name: str) -> str | None:
        """The key folder of a pointer's name, or None when ``name`` is no pointer."""
        folder, _, last = name.rpartition("/")
        return folder if last == POINTER_NAME and folder else None

    def _highest(self, folder: str) -> int | None:
        found = numbers(self.inner.list(f"{folder}/{POINTERS_FOLDER}/"), folder)
        return found[-1] if found else None

    # -- the pointer -----------------------------------------------------------------------------------------------

    def get(self, name: str) -> Blob | None:
        folder = self._folder_of(name)
        if folder is None:
            return self.inner.get(name)
        highest = self._highest(folder)
        if highest is None:
            return None
        found = self.inner.get(pointer_object(folder, highest))
        if found is None:  # never deleted (see the module): only an operator's hand removes one
            raise DestinationError(f"{self.url(pointer_object(folder, highest))} was listed but cannot be read")
        return Blob(found.data, str(highest))

    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        folder = self._folder_of(name)
        if folder is None:
            raise DestinationError(f"{self.inner.url(name)}: this store replaces no object (it can only create)")
        if tag is not None and not tag.isdigit():
            raise PreconditionFailed(f"{self.url(name)} is not at version {tag!r}")
        number = 1 if tag is None else int(tag) + 1
        try:
            # The same bytes there already are this party's own earlier create that landed (a pointer's bytes hold
            # its writer's token): the compare-and-swap it asked for happened.
            self.inner.put_if_absent(pointer_object(folder, number), data)
        except AlreadyExists:
            raise PreconditionFailed(f"{self.url(name)} is no longer at version {tag}") from None
        return str(number)

    def list(self, prefix: str) -> list[str]:
        names, pointers = [], set()
        for name in self.inner.list(prefix):
            folder, _, rest = name.rpartition(f"/{POINTERS_FOLDER}/")
            if rest and "/" not in rest:
                if _NUMBERED.fullmatch(rest):
                    pointers.add(f"{folder}/{POINTER_NAME}")
                continue  # a pointer object, or a pointer writer's temporary file: never a place's object
            names.append(name)
        return sorted(names + sorted(pointers))

    def delete(self, name: str) -> None:
        folder = self._folder_of(name)
        if folder is None:
            self.inner.delete(name)
            return
        # The lowest first: until the last is gone, readers see the pointer as it was.
        for number in numbers(self.inner.list(f"{folder}/{POINTERS_FOLDER}/"), folder):
            self.inner.delete(pointer_object(folder, number))

    def settle(self, names: list[str]) -> None:
        settled = []
        for name in names:
            folder = self._folder_of(name)
            highest = self._highest(folder) if folder is not None else None
            settled.append(name if folder is None else pointer_object(folder, highest or 1))
        self.inner.settle(settled)

    def prepare(self, name: str, data: bytes) -> None:
        if self._folder_of(name) is None:
            self.inner.prepare(name, data)

    # -- everything else passes through -----------------------------------------------------------------------------

    def url(self, name: str) -> str:
        folder = self._folder_of(name)
        # A message about the pointer names where it is: the folder of pointer objects (there is no _current.json).
        return self.inner.url(name if folder is None else f"{folder}/{POINTERS_FOLDER}/")

    def describe(self) -> str:
        return self.inner.describe()

    def digest(self, name: str) -> str | None:
        return self.inner.digest(name)

    def read(self, name: str) -> bytes | None:
        folder = self._folder_of(name)
        if folder is None:
            return self.inner.read(name)
        found = self.get(name)
        return None if found is None else found.data

    def put_if_absent(self, name: str, data: bytes) -> None:
        self.inner.put_if_absent(name, data)

    def upload(self, name: str) -> Upload:
        return self.inner.upload(name)

    def check_conditions(self) -> None:
        self.inner.check_conditions()

    def deferred(self):
        return self.inner.deferred()

    def sync(self) -> None:
        self.inner.sync()


def with_pointer(store: ObjectStore) -> ObjectStore:
    """``store`` itself when it has a compare-and-swap, else the store with a sequence of pointer objects."""
    return store if store.compare_and_swap else SequencedPointers(store)
