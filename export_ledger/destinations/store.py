"""The hooks the object-store template's destinations are made of (local, S3, GCS, Azure:
:class:`~export_ledger.destinations.publishing.PublishingDestination`): an object store. Delta publishes over its
table's log instead: it uses this module only to check, on S3, that conditional creates hold
(:func:`racing_creates`).

An :class:`ObjectStore` has nine hooks every store writes (:meth:`~ObjectStore.url`, ``get``, ``digest``, ``read``,
``put_if_absent``, ``upload``, ``put_if_match``, ``list``, ``delete``) and six it may (``check_conditions``,
``describe``, and the group commit's ``deferred``, ``sync``, ``prepare``, ``settle``). A store that must be seen to
honour its conditional writes before its first one derives from :class:`ProbedStore` instead, whose probe is written
once over nine more small hooks and an optional tenth (one conditional put, what a refusal looks like, how its errors
read, a probe's name).

Names are ``/``-separated paths relative to the store's root. Each operation is atomic on one object; nothing spans
two. What a failed operation means is part of the contract, because a database transaction cannot commit a remote
write:

* a read that cannot tell raises :class:`~export_ledger.destinations.base.DestinationUnreachable`;
* a write that certainly did not happen raises :class:`~export_ledger.destinations.base.DestinationError`;
* a write that may have happened raises :class:`~export_ledger.destinations.base.PublishOutcomeUnknown`;
* a condition that did not hold raises :class:`AlreadyExists` or :class:`PreconditionFailed` (nothing written).
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, ClassVar

from export_ledger.destinations.base import DestinationError, DestinationUnreachable


class AlreadyExists(DestinationError):
    """``put_if_absent`` found the object there already, with other bytes than the ones given."""


class PreconditionFailed(DestinationError):
    """``put_if_match`` found the object at another version than the one given (or present when asked absent)."""


@dataclass(frozen=True)
class Blob:
    """An object's bytes and the store's version tag of them (an ETag, a content digest)."""

    data: bytes
    tag: str


class Upload(ABC):
    """A new object written as a stream (a data file), created at its name only by :meth:`commit`, if absent."""

    handle: BinaryIO

    @abstractmethod
    def commit(self) -> None:
        """Makes the written bytes the object, durably, refusing to replace one (raises :class:`AlreadyExists`)."""

    @abstractmethod
    def abort(self) -> None:
        """Drops what was written; nothing is created."""


class ObjectStore(ABC):
    """The hooks: :meth:`get`, :meth:`put_if_absent` (and :meth:`upload` for streams), :meth:`put_if_match`,
    :meth:`list`, :meth:`delete`; :meth:`digest` and :meth:`read` of an object's bytes; :meth:`url`. Optional: the
    startup check that the store really honours the conditions (:class:`ProbedStore` writes it), :meth:`describe`, and
    the group commit's :meth:`deferred`, :meth:`sync`, :meth:`prepare` and :meth:`settle`.

    A store that can only create (:attr:`compare_and_swap` False: its :meth:`put_if_match` replaces nothing) gets
    each key's pointer as a sequence of created objects instead (:mod:`export_ledger.destinations.sequence`).
    """

    #: Whether :meth:`put_if_match` replaces an object only at the version given (False: the store can only create).
    compare_and_swap: ClassVar[bool] = True

    @abstractmethod
    def url(self, name: str) -> str:
        """Where ``name`` is, for the ledger and for messages (never a credential)."""

    @abstractmethod
    def get(self, name: str) -> Blob | None:
        """The object's bytes and version tag; None when it does not exist. For small objects (pointers,
        manifests)."""

    @abstractmethod
    def digest(self, name: str) -> str | None:
        """The sha256 of the object's bytes, read as a stream (never held whole); None when it does not exist."""

    @abstractmethod
    def read(self, name: str) -> bytes | None:
        """The object's bytes, whole; None when it does not exist."""

    @abstractmethod
    def put_if_absent(self, name: str, data: bytes) -> None:
        """Creates the object; an object already there with the same bytes is success (a resend of one's own that
        landed), with other bytes :class:`AlreadyExists`."""

    @abstractmethod
    def upload(self, name: str) -> Upload:
        """A stream to create the object ``name`` (see :class:`Upload`)."""

    @abstractmethod
    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        """Replaces the object if it is still at version ``tag`` (``None``: creates it if absent); returns the new
        version's tag. Raises :class:`PreconditionFailed` when the condition does not hold."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every object name under ``prefix`` (a folder, ending in ``/``), at any depth."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Deletes the object (absent: nothing to do)."""

    def check_conditions(self) -> None:  # noqa: B027 - a hook: most stores need nothing
        """Refuses a store that ignores the conditions (a second create accepted, a stale version accepted, more than
        one of :data:`RACERS` racing creates accepted: see :func:`racing_creates`), before its first write. Stores
        that implement the conditions themselves need no check."""

    def describe(self) -> str:
        return self.url("")

    # -- group commit (docs/protocol.md, "Group commit") ----------------------------------------------------------
    # An object store whose acknowledged write is durable (S3, GCS, Azure) needs none of these: the defaults do
    # nothing. A store that makes each write durable itself (a local folder's fsyncs) defers that work inside
    # :meth:`deferred` and pays it once per :meth:`sync`.

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within: writes may be acknowledged before they are durable; :meth:`sync` makes every one of them durable.
        Whatever is written within and not synced when it ends is as durable as it happens to be: a caller records
        nothing of it (the ledger commit comes after a sync)."""
        yield

    def sync(self) -> None:  # noqa: B027 - a hook: most stores need nothing
        """Makes every write acknowledged since :meth:`deferred` began (or since the last sync) durable.

        Raises:
            DestinationError: durability could not be obtained (the writes may or may not survive a power cut).
        """

    def prepare(self, name: str, data: bytes) -> None:  # noqa: B027 - a hook: most stores need nothing
        """Announces that ``data`` will be written at ``name`` by a later :meth:`put_if_match` of this deferral, so
        that the bytes can be made durable by the same sync as the data they describe (a pointer is never renamed
        into place with bytes a power cut could lose)."""

    def settle(self, names: list[str]) -> None:  # noqa: B027 - a hook: most stores need nothing
        """Makes objects that exist already durable (a repair records what an earlier party wrote, perhaps inside a
        deferral it never synced): at once outside :meth:`deferred`, at the next :meth:`sync` within."""


#: How many conditional creates of one new object the startup check sends at once.
RACERS = 8


def racing_creates(
    create: Callable[[bytes], object], refused: Callable[[BaseException], bool], racers: int = RACERS
) -> list[bytes]:
    """Sends ``racers`` conditional creates of one new object at once, each with bytes of its own, and returns the
    bytes of those the store accepted.

    A store that honours a create-only-if-absent as one atomic step accepts exactly one, and then holds its bytes.
    A second create sent *after* the first (what a sequential probe checks) only shows that the store evaluates the
    condition at all: a gateway that checks, then writes, passes it. Racing creates can catch such a store, when the
    race hits its window between check and write; they cannot prove the opposite (a store that passes one race may
    lose the next), which rests on the store's documented guarantee.

    Each create runs on its own thread, released together by a barrier. A refused create (``refused(exc)``) lost the
    race; any other error is raised once every create has finished.
    """
    bodies = [f"export-ledger race probe {n} of {racers}".encode() for n in range(racers)]
    start = threading.Barrier(racers)

    def one(body: bytes) -> bytes | None:
        start.wait(timeout=30)
        try:
            create(body)
        except Exception as exc:
            if refused(exc):
                return None
            raise
        return body

    with ThreadPoolExecutor(max_workers=racers, thread_name_prefix="race-probe") as pool:
        futures = [pool.submit(one, body) for body in bodies]
    failures = [future.exception() for future in futures if future.exception() is not None]
    if failures:
        raise failures[0]
    return [body for body in (future.result() for future in futures) if body is not None]


def race_problem(accepted: list[bytes], held: bytes | None, racers: int = RACERS) -> str | None:
    """What :func:`racing_creates`' outcome shows wrong with the store (``held``: the object's bytes afterwards),
    or None: more than one create accepted, or the object holding other bytes than the one accepted create's (or
    any bytes, when none was accepted)."""
    if len(accepted) > 1:
        return f"accepted {len(accepted)} of {racers} conditional creates of one new object sent at once"
    if accepted and held != accepted[0]:
        return f"accepted one of {racers} conditional creates of one new object sent at once, but holds other bytes"
    if not accepted and held is not None:
        return f"refused all {racers} conditional creates of one new object sent at once, but holds one of them"
    return None


class ProbedStore(ObjectStore):
    """An object store that cannot be trusted to honour its conditional writes until it has been seen to: its
    :meth:`check_conditions` is the one probe, written here once over the store's own hooks below.

    The probe creates an object, then must see refused a second create of it and a replace on a version it does not
    have, and accepted a replace on its own; :meth:`_probe_more` adds a store's other write paths; then
    :data:`RACERS` racing creates of a new object (exactly one may win: :func:`racing_creates`). Once per process and
    store (:attr:`_checked`, keyed by :meth:`_conditions_key`); a refusal is not remembered.
    """

    #: The process's stores that passed, by :meth:`_conditions_key` (a set of the store's module).
    _checked: ClassVar[set]
    #: How the refusals name the store's create-if-absent and stale-version conditions, what it ignores, its objects.
    PROBE_CREATE: ClassVar[str] = "If-None-Match: *"
    PROBE_STALE: ClassVar[str] = "an ETag the object does not have (If-Match)"
    PROBE_IGNORES: ClassVar[str] = "conditional writes"
    PROBE_NOUN: ClassVar[str] = "object"

    # -- the hooks -----------------------------------------------------------------------------------------------

    @abstractmethod
    def _where(self) -> str:
        """The bucket or container as the refusals name it (``s3://bucket``)."""

    @abstractmethod
    def _conditions_key(self) -> tuple:
        """What identifies this store among the checked ones (its endpoint and bucket)."""

    @abstractmethod
    def _conditional_put(self, name: str, data: bytes, tag: str | None) -> str:
        """One raw conditional write (``tag`` None: only if absent), returning the new version's tag; the store's
        own error when refused."""

    @abstractmethod
    def _stale_tag(self, tag: str) -> str:
        """A version tag the object at ``tag`` does not have."""

    @abstractmethod
    def _refused_condition(self, exc: BaseException) -> bool:
        """Whether the store's error ``exc`` is a refused condition (412, or 409 for a concurrent write)."""

    @abstractmethod
    def _probe_failures(self) -> tuple[type[BaseException], ...]:
        """The store's client's errors, which :meth:`_probing` turns into the destination's."""

    @abstractmethod
    def _probe_refused(self, exc: BaseException, what: str) -> str | None:
        """The message when the store answered ``what`` (the probe: "check that s3://b honours ...") with ``exc``
        refusing it (a missing bucket, a 4xx); None when the store could not be reached or did not answer."""

    @abstractmethod
    def _describe_error(self, exc: BaseException) -> str:
        """The error's class and status, never its text (which may quote a credential or a customer's data)."""

    @abstractmethod
    def _probe_name(self) -> str:
        """A fresh probe object's name (under ``.export-ledger-probe/``), after removing probes an hour older than
        the store's own clock says (left by processes killed mid-check)."""

    def _probe_more(self, name: str) -> None:  # noqa: B027 - a hook: most stores have one write path
        """The store's other write paths, probed with objects of their own beside ``name`` and deleted again."""

    # -- the probe -----------------------------------------------------------------------------------------------

    def check_conditions(self) -> None:
        """The probe (see the class): refuses the store, naming what it ignores, or remembers that it passed. A
        probe object that cannot be deleted afterwards is left for a later check to sweep: the verdict stands."""
        where = self._conditions_key()
        if where in self._checked:
            return
        with self._probing("honours conditional writes"):
            name = self._probe_name()
            tag = self._conditional_put(name, b"1", None)
            try:
                self._must_refuse(lambda: self._conditional_put(name, b"2", None), f"a second conditional create "
                                  f"({self.PROBE_CREATE}) of one {self.PROBE_NOUN}",
                                  "a retry could replace a published export")  # fmt: skip
                self._must_refuse(lambda: self._conditional_put(name, b"3", self._stale_tag(tag)),
                                  f"a write conditional on {self.PROBE_STALE}", "two parties could both move a key's "
                                  "pointer")  # fmt: skip
                self._conditional_put(name, b"4", tag)
                self._probe_more(name)
                self._race(f"{name}-race")
            finally:
                self._remove_probes(name, f"{name}-race")
        self._checked.add(where)

    def _remove_probes(self, *names: str) -> None:
        """Deletes the probe objects; one that cannot be deleted (a 503, a credential that may not delete) is left
        behind, for :meth:`_probe_name` to sweep an hour later: a failed cleanup neither hides nor changes the
        probe's verdict."""
        for name in names:
            with contextlib.suppress(DestinationError, *self._probe_failures()):
                self.delete(name)

    @contextlib.contextmanager
    def _probing(self, what: str) -> Iterator[None]:
        """A probe's failures as the destination's errors: refused, the store is refused; else it is unreachable."""
        try:
            yield
        except self._probe_failures() as exc:
            check = f"check that {self._where()} {what}"
            refused = self._probe_refused(exc, check)
            if refused is not None:
                raise DestinationError(refused) from None
            raise DestinationUnreachable(f"cannot do the {check}: {self._describe_error(exc)}") from None

    def _must_refuse(self, write: Callable[[], object], what: str, risk: str) -> None:
        try:
            write()
        except self._probe_failures() as exc:
            if self._refused_condition(exc):
                return
            raise
        raise DestinationError(
            f"{self._where()} accepted {what}: this store ignores {self.PROBE_IGNORES}, so {risk} silently. "
            "Refusing to publish to it"
        )

    def _race(self, name: str) -> None:
        accepted = racing_creates(lambda body: self._conditional_put(name, body, None), self._refused_condition)
        problem = race_problem(accepted, self.read(name))
        if problem:
            raise DestinationError(
                f"{self._where()} {problem}: its check that {_article(self.PROBE_NOUN)} is absent and its write are "
                "not one atomic step, so two parties racing for a key's place or pointer could both win silently. "
                "Refusing to publish to it"
            )


def _article(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
