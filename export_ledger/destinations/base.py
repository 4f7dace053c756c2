"""Where exports go: what every destination answers, and the verdict on what it holds. Plain Python, no Dagster.

Two kinds of destination:

* A *publishing* destination (:class:`~export_ledger.destinations.pointer.PointerDestination`) stages a key's
  export where readers do not see it and makes it current by one commit of the key's fenced pointer, outside the
  ledger (docs/protocol.md). A local folder and the object stores are one template of it,
  :class:`~export_ledger.destinations.publishing.PublishingDestination`, over the small hooks of an
  :class:`~export_ledger.destinations.store.ObjectStore` (get, put-if-absent, put-if-match, list, delete...): per key
  one pointer (``date=D/_current.json``) and places (``date=D/r<revision>-t<token>/``). A Delta table
  (:class:`~export_ledger.destinations.delta.DeltaDestination`) implements it over its own log.
* A *transactional* destination lives in the ledger's own database: ``write_in_transaction`` writes the rows with the
  ledger's connection, inside the transaction that records completion, so effect and record commit together.

Both answer :meth:`Destination.verify`: the one function that says what is published for a key and whether it is the
export the caller expects. The protocol, reconciliation, an operator's resolution, the asset check and ``load_input``
all ask it.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from export_ledger.errors import ExportLedgerError
from export_ledger.frames import Manifest


class DestinationError(ExportLedgerError, RuntimeError):
    """The destination refused or failed an operation before anything was published."""


class PublishOutcomeUnknown(DestinationError):
    """A write may or may not have taken effect; only the destination's evidence can tell.

    ``sha256`` and ``location`` say what the write meant to make visible (reconciliation compares them)."""

    def __init__(self, message: str, *, sha256: str | None = None, location: str | None = None) -> None:
        super().__init__(message)
        self.sha256 = sha256
        self.location = location


class DestinationUnreachable(DestinationError):
    """The destination could not be reached at all; nothing was read or written."""


class DestinationConflict(DestinationError):
    """The destination holds something else where this export belongs; it is never overwritten.

    ``location`` says where (the place the key's pointer names, or the key's folder), when known."""

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)
        self.location = location


class PointerMoved(DestinationConflict):
    """The key's pointer is at neither the revision this party supersedes nor the one it publishes."""


class Fenced(DestinationError):
    """The key's pointer carries a fence above this party's token: a newer party holds the key, and this one can no
    longer change what readers see.

    ``fence`` is the pointer's fence."""

    def __init__(self, message: str, *, fence: int) -> None:
        super().__init__(message)
        self.fence = fence


@dataclass(frozen=True)
class ExportTarget:
    """One key of one export at a destination, and (for a revision already committed) the place it is at.

    Attributes:
        export, tenant, business_date: The key's folder, ``<export>/tenant=<tenant>/date=<YYYY-MM-DD>``.
        revision: The revision concerned (1 for a first export).
        place: The folder of that revision inside the key's: ``r<revision>-t<token>`` for exports of release 0.5 and
            later, ``.`` (the key's folder itself) for a revision 1 of 0.4.0 or earlier, ``revision=<N>`` for their
            restatements. None: not known yet (the pointer says).
    """

    export: str
    tenant: str
    business_date: str
    revision: int = 1
    place: str | None = None

    @property
    def parts(self) -> tuple[str, str, str]:
        """The key's folder: where its pointer lives, and its places."""
        return (self.export, f"tenant={self.tenant}", f"date={self.business_date}")

    @classmethod
    def of_record(cls, record, revision: int = 1, place: str | None = None) -> ExportTarget:
        """The target of a key the ledger holds (an :class:`~export_ledger.ledger.ExportRecord`: its export, tenant
        and business date), at ``revision`` and ``place``: the one way from a ledger record to a target."""
        return cls(record.export, record.tenant, record.business_date.isoformat(), revision, place)

    def at_revision(self, revision: int, place: str | None = None) -> ExportTarget:
        return ExportTarget(self.export, self.tenant, self.business_date, revision, place)

    def at_place(self, place: str | None) -> ExportTarget:
        return ExportTarget(self.export, self.tenant, self.business_date, self.revision, place)


def place_name(revision: int, token: int) -> str:
    """The place one party (``token``) publishes ``revision`` at: written by that party only."""
    return f"r{revision}-t{token}"


def parse_place(place: str) -> tuple[int, int] | None:
    """``(revision, token)`` of a place named by :func:`place_name`; None for any other name."""
    if not place.startswith("r") or "-t" not in place:
        return None
    revision, _, token = place[1:].partition("-t")
    if not (revision.isdigit() and token.isdigit()):
        return None
    return int(revision), int(token)


def place_of_location(location: str) -> str:
    """The place a recorded location names: its last path segment; a key folder (``date=...``) is the place ``.``
    (a revision 1 written by 0.4.0 or earlier)."""
    last = location.rstrip("/").rsplit("/", 1)[-1]
    return "." if last.startswith("date=") else last


class Verdict(str, enum.Enum):
    """What a destination holds for a key, against what a party expects."""

    PUBLISHED = "published"  # the revision expected is current, intact, and this key's
    ABSENT = "absent"  # nothing of the revision expected is visible: the pointer names the superseded one
    CONFLICT = "conflict"  # anything else: never overwritten, a person looks


@dataclass(frozen=True)
class Verification:
    """:meth:`Destination.verify`'s answer.

    Attributes:
        verdict: See :class:`Verdict`.
        detail: Why, in words (names paths and revisions, never data).
        manifest: The published revision's manifest (``PUBLISHED``).
        location: Where the published revision is (``PUBLISHED``), as the ledger records it; for ``CONFLICT``, where
            the conflicting content is.
        fence: The pointer's fence (publishing destinations; 0 otherwise).
    """

    verdict: Verdict
    detail: str
    manifest: Manifest | None = None
    location: str | None = None
    fence: int = 0


def judge(
    *,
    logical_key: str,
    revision: int,
    superseded: int,
    pointer_revision: int,
    manifest: Manifest | None,
    data_sha256: str | None,
    pointer_sha256: str | None,
    where: str,
    expected_sha256: str | None = None,
) -> Verification:
    """The verdict on one key from what its pointer and the place it names hold. Pure: no I/O.

    Args:
        logical_key: The key expected.
        revision: The revision the caller publishes (or published).
        superseded: The revision it supersedes (0: a first export).
        pointer_revision: The revision the key's pointer names (0: nothing).
        manifest: The manifest of the place the pointer names (None: missing or not read).
        data_sha256: The sha256 of that place's data file (None: missing).
        pointer_sha256: The sha256 the pointer names.
        where: The place, for messages.
        expected_sha256: What the caller meant to commit, when it knows (an unknown outcome's).
    """
    if pointer_revision == superseded:
        return Verification(Verdict.ABSENT, f"nothing of revision {revision} is published at {where}")
    if pointer_revision != revision:
        return Verification(
            Verdict.CONFLICT,
            f"{where}: the key's pointer names revision {pointer_revision}, neither revision {revision} nor the "
            f"revision {superseded} it supersedes",
        )
    if manifest is None:
        return Verification(Verdict.CONFLICT, f"{where}: the pointer names a place without a readable manifest")
    if manifest.logical_key != logical_key:
        return Verification(Verdict.CONFLICT, f"{where} holds the export of {manifest.logical_key}, not {logical_key}")
    if manifest.revision != revision:
        return Verification(Verdict.CONFLICT, f"{where} holds revision {manifest.revision}, not revision {revision}")
    if data_sha256 is None:
        return Verification(Verdict.CONFLICT, f"{where}: its manifest names data file {manifest.data_file}, which is "
                                              "missing")  # fmt: skip
    if data_sha256 != manifest.sha256 or (pointer_sha256 is not None and pointer_sha256 != manifest.sha256):
        return Verification(
            Verdict.CONFLICT, f"{where}: data sha256 {data_sha256} does not match its manifest ({manifest.sha256})"
        )
    if expected_sha256 is not None and manifest.sha256 != expected_sha256:
        return Verification(
            Verdict.CONFLICT,
            f"{where} holds data with sha256 {manifest.sha256}, but the attempt meant to commit {expected_sha256}",
        )
    return Verification(Verdict.PUBLISHED, f"published by attempt {manifest.attempt_id} at {where}", manifest, where)


@dataclass(frozen=True)
class Opened:
    """A key as the party that holds it finds it at its destination (:meth:`Destination.open`): the key's pointer as
    that party fenced it (None where the destination keeps no pointer outside the ledger), and what is published for
    the key, judged."""

    pointer: Any
    verification: Verification


class Destination(ABC):
    """What every destination answers: where a key's export is, what is published for it, and its bytes; and what a
    party holding a key does there (:meth:`open`, :meth:`hold`, :meth:`discard_key`), whatever the destination's kind,
    so that callers never ask which kind it is."""

    #: The Dagster concurrency pool kind exports to this destination run in (each destination kind has its own).
    pool: str = "exports"
    #: How a key's export takes effect here, which the protocol asks instead of the destination's class: "published"
    #: (staged outside the ledger, made visible by the pointer's commit, recorded after:
    #: :class:`~export_ledger.destinations.PointerDestination`) or "with_record" (the rows commit in the ledger's own
    #: transaction, together with the completion record: :class:`TransactionalDestination`). Neither here: a
    #: destination says which by its base, and the protocol refuses one that says neither before any key is claimed.
    takes_effect: str | None = None

    # -- what a party holding a key does here -----------------------------------------------------------------------

    def hold(self, target: ExportTarget, token: int, *, logical_key: str) -> Any:
        """Fences the key with the holder's ``token`` where this destination needs it, so that no party with a lower
        token can change what readers see; returns the key's pointer as fenced. A destination inside the ledger's
        database needs nothing here (the ledger's own transaction fences it): None."""
        return None

    def open(
        self,
        target: ExportTarget,
        token: int,
        *,
        logical_key: str,
        superseded: int,
        expected_sha256: str | None = None,
        read: Any = None,
    ) -> Opened:
        """:meth:`hold`, then what is published for the key judged behind that fence (:meth:`verify`): what
        reconciliation, an operator's resolution and a withdrawal do first. ``read``: the pointer as
        :meth:`prepare_fence` read it, for a batch.

        Raises:
            Fenced: a newer party holds the key.
            DestinationUnreachable: the destination cannot say.
        """
        pointer = self.hold(target, token, logical_key=logical_key)
        verification = self.verify(
            target, logical_key=logical_key, superseded=superseded, expected_sha256=expected_sha256
        )
        return Opened(pointer, verification)

    def discard_key(self, target: ExportTarget, token: int, *, logical_key: str, recorded: ExportTarget | None
                    ) -> list[str]:  # fmt: skip
        """Clears what the ledger does not record at the key's place (an operator decided): what readers see goes
        back to ``recorded`` (the revision the ledger records, at its place; None: nothing). Returns what was
        removed.

        Raises:
            DestinationError: this destination cannot discard, or failed to.
        """
        raise DestinationError(f"{self.describe()} cannot discard what it holds for {logical_key}")

    def recorded_here(self, target: ExportTarget, location: str) -> bool:
        """Whether ``location``, where an attempt recorded its export of ``target``'s key, is one of this
        destination's (a key must never be judged, or fenced, at a destination it was not exported to). Only a
        destination whose attempts write to places of their own can tell; any other says yes."""
        return True

    def attempt_location(self, target: ExportTarget) -> str | None:
        """Where an attempt's own place (``target.place``) is, recorded with an unknown outcome so that
        reconciliation judges the key where the attempt wrote; None where attempts have no place of their own."""
        return None

    # -- durability of a group ----------------------------------------------------------------------------------

    def deferred(self) -> contextlib.AbstractContextManager:
        """A group's writes, their durability deferred to :meth:`sync` (docs/protocol.md, "Group commit"). No-op
        by default: an object store's acknowledged write is durable, and a database commits durably each time."""
        return contextlib.nullcontext()

    def sync(self) -> None:
        """Makes every write of the current :meth:`deferred` durable (no-op by default, see there)."""
        return None

    def prepare_fence(self, target: ExportTarget, token: int, *, logical_key: str) -> Any:
        """Prepares :meth:`hold`'s write for a batch made durable by one :meth:`sync`; returns what it read, for
        :meth:`open`'s ``read``. None: nothing to prepare (the default)."""
        return None

    # -- a reader's reads ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Reads of a consumer (:func:`export_ledger.read_current`), not of a party that holds a key: within it, no
        destination creates, settles (a local folder's fsyncs), fences or writes anything, so a reader needs read
        access only. :func:`reading_only` says whether a read runs inside one."""
        reset = _READING.set(True)
        try:
            yield
        finally:
            _READING.reset(reset)

    # -- how the export's data and dataset are read ---------------------------------------------------------------

    def data_format(self, file_format: str) -> str:
        """The format of :meth:`read_data`'s bytes for an export declared in ``file_format``."""
        return file_format

    def dataset(self, export: str) -> tuple[str, str]:
        """The export's dataset here, as OpenLineage names one (namespace, name): the folder or object prefix that
        holds its key folders (the location of a key, less its ``tenant=``/``date=`` folders)."""
        probe = self.location(ExportTarget(export, _PROBE_TENANT, "2000-01-01", 1, "."))
        root = probe.split(f"/tenant={_PROBE_TENANT}/", 1)[0]
        scheme, separator, rest = root.partition("://")
        if separator:
            bucket, _, path = rest.partition("/")
            return f"{scheme}://{bucket}", path
        return "file", root

    @abstractmethod
    def location(self, target: ExportTarget) -> str:
        """Where the export of ``target`` (at its place) is, as recorded in the ledger."""

    @abstractmethod
    def verify(
        self,
        target: ExportTarget,
        *,
        logical_key: str,
        superseded: int,
        expected_sha256: str | None = None,
    ) -> Verification:
        """What is published for ``target``'s key, judged against revision ``target.revision`` superseding
        ``superseded`` (see :func:`judge`); the data is hashed as it is read, never held whole.

        Raises:
            DestinationUnreachable: the destination cannot say.
        """

    @abstractmethod
    def verify_recorded(self, target: ExportTarget, *, logical_key: str, sha256: str) -> Verification:
        """Whether the revision the ledger recorded (``target`` at its place) is intact: its manifest names the key
        and revision, and its data's sha256 is ``sha256``. ``PUBLISHED`` when it is, else ``CONFLICT``.

        Raises:
            DestinationUnreachable: the destination cannot say.
        """

    def verify_current(self, target: ExportTarget, *, logical_key: str, sha256: str) -> Verification:
        """:meth:`verify_recorded`, and what readers see of the key is that revision (its current revision is
        ``target.revision``). ``CONFLICT`` when it is not.

        Raises:
            DestinationUnreachable: the destination cannot say.
        """
        verification = self.verify_recorded(target, logical_key=logical_key, sha256=sha256)
        if verification.verdict is not Verdict.PUBLISHED:
            return verification
        otherwise = self.readers_see_otherwise(target, sha256=sha256)
        if otherwise is None:
            return verification
        return Verification(Verdict.CONFLICT, f"{logical_key}: {otherwise}", location=verification.location)

    def readers_see_otherwise(self, target: ExportTarget, *, sha256: str) -> str | None:
        """What readers see of the key instead of ``target`` with ``sha256``, in words (None: they see it): here,
        another current revision.

        Raises:
            DestinationUnreachable: the destination cannot say.
        """
        current = self.current_revision(target)
        if current == target.revision:
            return None
        return f"readers see revision {current}, the ledger recorded revision {target.revision}"

    @abstractmethod
    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        """The data file of ``target`` (at its place), whole: for callers that need the rows (``load_input``,
        drift). Verification never uses it."""

    @abstractmethod
    def current_revision(self, target: ExportTarget) -> int:
        """The revision the key's pointer names (0: nothing published)."""

    @abstractmethod
    def key_at(self, target: ExportTarget) -> str | None:
        """The logical key whose export the target's place holds now (what its pointer or manifest row names), or
        None: an operator's discard refuses to delete another key's recorded export."""

    def describe(self) -> str:
        """A description safe for logs: no credentials."""
        return type(self).__name__

    @property
    def kind(self) -> str:
        """The destination's kind: ``local``, ``s3``, ``gcs``, ``azure``, ``delta``, ``ledger-table``."""
        return self.pool.removeprefix("exports-")

    def root_of(self, export: str) -> str:
        """Where ``export``'s keys are, as a spec that builds this destination again without its settings (a
        credential is never part of it): recorded in the export's contract (:mod:`export_ledger.contract`)."""
        spec = getattr(self, "spec", None)
        if spec is None:
            return self.describe()
        return spec()[0].replace("{export}", export)

    #: The settings that say *which* store a root is in (an endpoint, an account): recorded with the root in the
    #: export's contract (never a credential), so that an edge whose environment names another store is refused.
    locators: tuple[str, ...] = ()

    def identity(self, export: str) -> dict:
        """The destination of ``export`` as its contract records it: ``{"kind": ..., "root": ...}``, and the
        :attr:`locators` that are set (an endpoint's URL without userinfo or query)."""
        found = {"kind": self.kind, "root": self.root_of(export)}
        settings = self.spec()[1] if hasattr(self, "spec") else {}
        for name in self.locators:
            value = settings.get(name)
            if value:
                found[name] = _locator(str(value))
        return found


#: Whether the reads in progress are a consumer's (:meth:`Destination.reading`).
_READING: contextvars.ContextVar[bool] = contextvars.ContextVar("export_ledger_reading", default=False)


def reading_only() -> bool:
    """Whether the reads in progress are a consumer's (inside :meth:`Destination.reading`): nothing may be created,
    settled or written."""
    return _READING.get()


#: The tenant of the key whose location :meth:`Destination.dataset` reads (any slug: no key of it is touched).
_PROBE_TENANT = "lineage-probe"


def _locator(value: str) -> str:
    """An endpoint URL without its userinfo, query or fragment (an account name is returned as it is)."""
    parts = urlsplit(value)
    if not parts.scheme or not parts.netloc:
        return value
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))


class TransactionalDestination(Destination):
    """A destination inside the ledger's own database: rows and completion record commit in one transaction, so
    there is no unknown outcome and nothing to fence outside the ledger."""

    takes_effect = "with_record"

    @abstractmethod
    def write_in_transaction(self, connection, target: ExportTarget, table, manifest: Manifest) -> Manifest:
        """Writes the export with the ledger's connection, inside the completion transaction."""

    @abstractmethod
    def discard_target(self, target: ExportTarget) -> list[str]:
        """Removes what is at the key's place (an operator decided); returns what."""

    def discard_key(self, target: ExportTarget, token: int, *, logical_key: str, recorded: ExportTarget | None
                    ) -> list[str]:  # fmt: skip
        return self.discard_target(target)

    def data_format(self, file_format: str) -> str:
        return "csv"  # the rows are handed back as CSV, whatever the export's file format
