"""A Google Cloud Storage bucket as the publishing template's store hooks (optional extra ``[gcs]``:
google-cloud-storage).

Conditions are the store's own: ``ifGenerationMatch=0`` creates only if absent, ``ifGenerationMatch=<generation>``
replaces only the version read (the generation is the version tag). Every call makes exactly one send (the client's
own retries are off, as for S3: a blind resend of an ambiguous write is what this destination avoids), and a failed
write is classified the same way:

* nothing was sent (connection refused, a connect timeout, no credentials) or the store refused it (a 4xx other than
  412/409): the write did not happen (``DestinationUnreachable`` when the store could not be reached);
* the bucket does not exist: a read cannot tell (``DestinationUnreachable``, never "absent"), a write did not happen
  (``DestinationError``); both name the bucket. GCS answers a missing bucket and a missing object with the same 404,
  so a 404 is followed by one look at the bucket (once per process, while it exists);
* sent but unanswered (read timeout, connection cut, a 5xx): it may or may not have happened;
* 412 (409: a concurrent write won): the condition did not hold.

Two upload paths, each checked before its first use (once per process and store), because a store can honour the
conditions on one and not the other (fake-gcs-server before 1.55 ignores them on resumable uploads):

* objects up to :data:`SINGLE_REQUEST_LIMIT` (pointers, manifests, most data files) go up in one multipart request;
  :meth:`GCSStore.check_conditions` probes that path at startup (a second create, a stale generation, racing creates);
* data files above it go up as a resumable upload in chunks; before the first one, a probe object just above the limit
  is created twice the same way, and a store that accepts the second create is refused.
"""

from __future__ import annotations

import functools
import hashlib
import io
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from export_ledger.destinations.base import DestinationError, DestinationUnreachable, PublishOutcomeUnknown
from export_ledger.destinations.publishing import PublishingDestination
from export_ledger.destinations.registry import Scheme, Setting
from export_ledger.destinations.staging import StagedFileUpload, file_sha256, staging_folder
from export_ledger.destinations.store import (
    AlreadyExists,
    Blob,
    PreconditionFailed,
    ProbedStore,
    Upload,
)
from export_ledger.errors import redact_text

#: google-cloud-storage sends an object of at most this size in one multipart request, and anything larger as a
#: resumable upload (its ``_MAX_MULTIPART_SIZE``); the two paths are probed separately.
SINGLE_REQUEST_LIMIT = 8 << 20
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_PROBE_FOLDER = ".export-ledger-probe/"
_CONDITIONS_CHECKED: set[tuple[str | None, str]] = set()
_RESUMABLE_CHECKED: set[tuple[str | None, str]] = set()
#: Buckets seen to exist (endpoint, bucket): a 404 from them is an absent object.
_BUCKETS_SEEN: set[tuple[str | None, str]] = set()


def _sdk():
    try:
        import google.api_core.exceptions as api_errors
        import google.auth.exceptions as auth_errors
        import google.cloud.storage as storage
        import requests.exceptions as http_errors
    except ImportError as exc:
        raise DestinationError(
            "the GCS destination needs google-cloud-storage: pip install 'export-ledger[gcs]'"
        ) from exc
    return storage, api_errors, auth_errors, http_errors


@functools.lru_cache(maxsize=16)
def _client(endpoint_url, project, credentials_file):
    storage, _, _, _ = _sdk()
    if endpoint_url:  # an emulator or a private endpoint: anonymous unless a key file is given
        from google.auth.credentials import AnonymousCredentials

        credentials = None if credentials_file else AnonymousCredentials()
        options = {"api_endpoint": endpoint_url}
    else:
        credentials, options = None, None
    if credentials_file:
        return storage.Client.from_service_account_json(credentials_file, project=project, client_options=options)
    return storage.Client(project=project or "export-ledger", credentials=credentials, client_options=options)


def _not_sent(exc: BaseException) -> bool:
    """Whether a connection error happened before the request went out (refused, a connect timeout)."""
    import urllib3.exceptions

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, urllib3.exceptions.ConnectTimeoutError):  # NewConnectionError is one (urllib3 2)
            return True
        reason = getattr(exc, "reason", None)
        exc = reason if isinstance(reason, BaseException) else (exc.args[0] if exc.args and isinstance(
            exc.args[0], BaseException) else exc.__context__)  # fmt: skip
        seen += 1
    return False


@dataclass(frozen=True)
class GCSStore(ProbedStore):
    """A bucket (and name prefix) as an object store. Built by :class:`GCSDestination`."""

    _checked: ClassVar[set] = _CONDITIONS_CHECKED
    PROBE_CREATE = "ifGenerationMatch=0"
    PROBE_STALE = "a generation the object does not have"
    PROBE_IGNORES = "the preconditions"

    bucket: str
    prefix: str
    endpoint_url: str | None
    client_settings: tuple = field(repr=False)  # endpoint, project, key file: the client's, not for printing
    timeout: tuple[float, float]
    chunk_size: int

    def _connect(self):
        """The client. Building it reads the key file (``gcs_credentials_file``) or finds application default
        credentials, before anything is sent: a setting that cannot give one is refused here, named, for every call
        alike (a raw ``FileNotFoundError`` out of a read would be taken for an unknown outcome)."""
        _, _, auth_errors, _ = _sdk()
        try:
            return _client(*self.client_settings)
        except (OSError, ValueError, auth_errors.GoogleAuthError) as exc:
            variable = SCHEME.setting("gcs_credentials_file").variable
            if self.client_settings[2]:  # the key file
                problem = (
                    f"gcs_credentials_file ({variable}) names no readable service-account key file "
                    f"({type(exc).__name__})"
                )
            else:
                problem = (
                    f"no Google credentials were found ({type(exc).__name__}): set {variable} (the "
                    "gcs_credentials_file setting) to a service-account key file, or run where application default "
                    "credentials exist"
                )
            raise DestinationUnreachable(f"cannot use gs://{self.bucket}: {problem}; nothing was sent") from None

    def _bucket(self):
        return self._connect().bucket(self.bucket)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _blob(self, name: str, **kwargs):
        return self._bucket().blob(self._key(name), **kwargs)

    def url(self, name: str) -> str:
        return f"gs://{self.bucket}/{self._key(name)}"

    def describe(self) -> str:
        where = f" at {redact_text(self.endpoint_url)}" if self.endpoint_url else ""
        return f"gs://{self.bucket}/{self.prefix}{where}"

    # -- classification ----------------------------------------------------------------------------------------

    @staticmethod
    def _describe_error(exc) -> str:
        code = getattr(exc, "code", None)
        return f"{type(exc).__name__} (HTTP {code})" if isinstance(code, int) else type(exc).__name__

    def _no_bucket(self, exc) -> bool:
        """Whether a 404 means the bucket does not exist (a look at the bucket tells: the same 404 answers a missing
        object). A look that fails proves nothing: False."""
        _, api_errors, _, _ = _sdk()
        where = (self.endpoint_url, self.bucket)
        if not isinstance(exc, api_errors.NotFound) or where in _BUCKETS_SEEN:
            return False
        try:
            exists = self._bucket().exists(timeout=self.timeout, retry=None)
        except self._failures():
            return False
        if exists:
            _BUCKETS_SEEN.add(where)
        return not exists

    def _missing(self, what: str) -> str:
        where = f" at {redact_text(self.endpoint_url)}" if self.endpoint_url else ""
        return (
            f"cannot {what}: the bucket {self.bucket!r} does not exist{where} (create it, or correct the destination)"
        )

    def _unreadable(self, exc, what: str) -> DestinationUnreachable:
        """The error for a failed read: the read cannot tell what is there."""
        if self._no_bucket(exc):
            return DestinationUnreachable(self._missing(what))
        return DestinationUnreachable(f"cannot {what}: {self._describe_error(exc)}")

    def _write_failed(self, exc, what: str) -> DestinationError:
        _, api_errors, auth_errors, http_errors = _sdk()
        if self._no_bucket(exc):
            return DestinationError(self._missing(what))
        if isinstance(exc, api_errors.GoogleAPICallError):
            if isinstance(exc.code, int) and exc.code >= 500:
                return PublishOutcomeUnknown(f"{what} answered {self._describe_error(exc)}: it may or may not exist")
            return DestinationError(f"the store refused {what}: {self._describe_error(exc)}")
        if isinstance(exc, auth_errors.GoogleAuthError):
            return DestinationError(f"cannot authenticate to the store for {what}: {self._describe_error(exc)}")
        if isinstance(exc, http_errors.ConnectionError) and _not_sent(exc):
            return DestinationUnreachable(f"cannot reach the store for {what}: {self._describe_error(exc)}")
        return PublishOutcomeUnknown(f"{what} got no answer ({self._describe_error(exc)}): it may or may not exist")

    def _failures(self):
        _, api_errors, auth_errors, http_errors = _sdk()
        return api_errors.GoogleAPICallError, auth_errors.GoogleAuthError, http_errors.RequestException

    def _refused_condition(self, exc) -> bool:
        _, api_errors, _, _ = _sdk()
        return isinstance(exc, (api_errors.PreconditionFailed, api_errors.Conflict))

    # -- reads ---------------------------------------------------------------------------------------------------

    def _download(self, name: str, sink) -> str | None:
        """Downloads ``name`` into ``sink``; returns its generation, None when it does not exist."""
        _, api_errors, _, _ = _sdk()
        blob = self._blob(name)
        try:
            blob.download_to_file(sink, timeout=self.timeout, retry=None)
        except self._failures() as exc:
            if isinstance(exc, api_errors.NotFound) and not self._no_bucket(exc):
                return None
            raise self._unreadable(exc, f"read {self.url(name)}") from None
        return str(blob.generation)

    def get(self, name: str) -> Blob | None:
        sink = io.BytesIO()
        generation = self._download(name, sink)
        return None if generation is None else Blob(sink.getvalue(), generation)

    def read(self, name: str) -> bytes | None:
        found = self.get(name)
        return None if found is None else found.data

    def digest(self, name: str) -> str | None:
        sink = _HashingSink()
        return None if self._download(name, sink) is None else sink.digest.hexdigest()

    def list(self, prefix: str) -> list[str]:
        cut = len(self.prefix) + 1 if self.prefix else 0
        try:
            blobs = self._connect().list_blobs(self.bucket, prefix=self._key(prefix), timeout=self.timeout, retry=None)
            return [blob.name[cut:] for blob in blobs]
        except self._failures() as exc:
            raise self._unreadable(exc, f"list {self.url(prefix)}") from None

    # -- writes --------------------------------------------------------------------------------------------------

    def _send(self, name: str, data: bytes, generation: int) -> str:
        """One conditional single-request upload; returns the new generation."""
        if len(data) > SINGLE_REQUEST_LIMIT:
            raise DestinationError(f"{self.url(name)}: a small object above {SINGLE_REQUEST_LIMIT} bytes")
        blob = self._blob(name)
        blob.upload_from_string(data, if_generation_match=generation, timeout=self.timeout, retry=None)
        return str(blob.generation)

    def put_if_absent(self, name: str, data: bytes) -> None:
        try:
            self._send(name, data, 0)
            return
        except self._failures() as exc:
            if not self._refused_condition(exc):
                raise self._write_failed(exc, f"writing {self.url(name)}") from None
        # 412: something is there. The same bytes: this party's own earlier send landed (one party writes a place).
        found = self.get(name)
        if found is None:
            raise PublishOutcomeUnknown(f"{self.url(name)} answered 412 but cannot be read back")
        if found.data != data:
            raise AlreadyExists(f"{self.url(name)} holds other bytes")

    def upload(self, name: str) -> Upload:
        return _GCSUpload(self, name, staging_folder("gcs"))

    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        try:
            return self._send(name, data, 0 if tag is None else int(tag))
        except self._failures() as exc:
            if self._refused_condition(exc):
                raise PreconditionFailed(f"{self.url(name)} changed since it was read") from None
            raise self._write_failed(exc, f"writing {self.url(name)}") from None

    def delete(self, name: str) -> None:
        _, api_errors, _, _ = _sdk()
        try:
            self._blob(name).delete(timeout=self.timeout, retry=None)
        except self._failures() as exc:
            if self._no_bucket(exc):
                raise DestinationError(self._missing(f"delete {self.url(name)}")) from None
            if isinstance(exc, api_errors.NotFound):
                return
            _, _, _, http_errors = _sdk()
            if isinstance(exc, http_errors.ConnectionError) and _not_sent(exc):
                raise DestinationUnreachable(f"cannot delete {self.url(name)}: {self._describe_error(exc)}") from None
            raise DestinationError(f"cannot delete {self.url(name)}: {self._describe_error(exc)}") from None

    # -- the startup checks --------------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"gs://{self.bucket}"

    def _conditions_key(self) -> tuple:
        return (self.endpoint_url, self.bucket)

    def _conditional_put(self, name: str, data: bytes, tag: str | None) -> str:
        return self._send(name, data, 0 if tag is None else int(tag))

    def _stale_tag(self, tag: str) -> str:
        return str(int(tag) + 1)

    def _probe_failures(self) -> tuple:
        return self._failures()

    def _probe_refused(self, exc, what: str) -> str | None:
        code = getattr(exc, "code", None)
        if self._no_bucket(exc):
            return self._missing(what)
        if isinstance(code, int) and 400 <= code < 500:
            return f"the store refused the {what}: {self._describe_error(exc)}"
        return None

    def check_resumable_conditions(self) -> None:
        """Refuses a bucket whose resumable uploads ignore ``ifGenerationMatch=0``, before the first data file above
        :data:`SINGLE_REQUEST_LIMIT`: a probe object one byte above the limit is created twice with the data files'
        own upload (the second must be refused). Once per process and store."""
        where = (self.endpoint_url, self.bucket)
        if where in _RESUMABLE_CHECKED:
            return
        probe = b"\0" * (SINGLE_REQUEST_LIMIT + 1)
        with self._probing("honours conditions on resumable uploads"):
            key = self._probe_name()
            self._resumable(key, io.BytesIO(probe), len(probe))
            try:
                self._must_refuse(
                    lambda: self._resumable(key, io.BytesIO(probe), len(probe)),
                    f"a second conditional create of a {len(probe)}-byte object as a resumable upload",
                    f"a retry could replace a published data file above {SINGLE_REQUEST_LIMIT} bytes",
                )
            finally:
                self.delete(key)
        _RESUMABLE_CHECKED.add(where)

    def _resumable(self, name: str, source, size: int) -> None:
        blob = self._blob(name, chunk_size=self.chunk_size)
        blob.upload_from_file(source, size=size, if_generation_match=0, timeout=self.timeout, retry=None)

    def _probe_name(self) -> str:
        """A fresh probe object's name, after removing probes an hour older than the newest (left by processes
        killed mid-check; the store's own timestamps, not this machine's clock)."""
        probes = list(self._connect().list_blobs(
            self.bucket, prefix=self._key(_PROBE_FOLDER), timeout=self.timeout, retry=None))  # fmt: skip
        newest = max((blob.time_created for blob in probes if blob.time_created), default=None)
        for blob in probes:
            if newest is not None and blob.time_created and (newest - blob.time_created).total_seconds() > 3600:
                self.delete(blob.name[len(self.prefix) + 1 :] if self.prefix else blob.name)
        return f"{_PROBE_FOLDER}{uuid.uuid4().hex}"


class _HashingSink:
    """A writable file that only hashes: a data file is verified as a stream, never held whole."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()

    def write(self, chunk: bytes) -> int:
        self.digest.update(chunk)
        return len(chunk)


class _GCSUpload(StagedFileUpload):
    def __init__(self, store: GCSStore, name: str, folder: Path) -> None:
        super().__init__(folder)
        self.store, self.name = store, name

    def send(self, path: Path, size: int) -> None:
        store = self.store
        if size <= SINGLE_REQUEST_LIMIT:
            store.put_if_absent(self.name, path.read_bytes())
            return
        store.check_resumable_conditions()
        try:
            with open(path, "rb") as source:
                store._resumable(self.name, source, size)
            return
        except store._failures() as exc:
            if not store._refused_condition(exc):
                raise store._write_failed(exc, f"uploading {store.url(self.name)}") from None
        found = store.digest(self.name)  # 412: this party's own earlier upload, or another's bytes
        if found is None:
            raise PublishOutcomeUnknown(f"{store.url(self.name)} answered 412 but cannot be read back")
        if found != file_sha256(path):
            raise AlreadyExists(f"{store.url(self.name)} holds other bytes")


@dataclass(frozen=True)
class GCSDestination(PublishingDestination):
    """Exports as objects in a Google Cloud Storage bucket: the publishing template (docs/protocol.md) over
    :class:`GCSStore`.

    Attributes:
        bucket: Bucket name.
        prefix: Name prefix without leading or trailing slash ("" for the bucket root).
        gcs_endpoint_url: An emulator's or private endpoint (``EXPORTS_GCS_ENDPOINT_URL``): anonymous unless a key
            file is given. None: Google's own, with application default credentials.
        gcs_project: Project (``GOOGLE_CLOUD_PROJECT``).
        gcs_credentials_file: A service-account key file (``GOOGLE_APPLICATION_CREDENTIALS``).
        connect_timeout_seconds / read_timeout_seconds: Client timeouts; a read timeout on a write makes its
            outcome unknown.
        chunk_size_bytes: Chunk of a resumable upload (data files above :data:`SINGLE_REQUEST_LIMIT`); a multiple of
            256 KiB.
    """

    bucket: str
    prefix: str = ""
    gcs_endpoint_url: str | None = None
    gcs_project: str | None = None
    gcs_credentials_file: str | None = None
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 30.0
    chunk_size_bytes: int = 32 << 20

    pool = "exports-gcs"
    locators = ("gcs_endpoint_url",)

    def __post_init__(self) -> None:
        _sdk()  # a configured destination without its package fails here, naming the extra
        if self.chunk_size_bytes <= 0 or self.chunk_size_bytes % (256 << 10):
            raise DestinationError(
                f"chunk_size_bytes must be a positive multiple of 256 KiB, got {self.chunk_size_bytes}"
            )

    @functools.cached_property
    def store(self) -> GCSStore:
        settings = (self.gcs_endpoint_url, self.gcs_project, self.gcs_credentials_file)
        return GCSStore(
            self.bucket, self.prefix.strip("/"), self.gcs_endpoint_url, settings,
            (self.connect_timeout_seconds, self.read_timeout_seconds), self.chunk_size_bytes,
        )  # fmt: skip

    @staticmethod
    def check_spec(spec: str) -> str | None:
        bucket = spec.removeprefix("gs://").partition("/")[0]
        return None if _BUCKET_RE.fullmatch(bucket) else f"{bucket!r} is not a valid GCS bucket name"

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> GCSDestination:
        bucket, _, prefix = spec.removeprefix("gs://").partition("/")
        return cls(bucket=bucket, prefix=prefix.strip("/"), **settings)

    def spec(self) -> tuple[str, dict]:
        """The spec and settings that build this destination again."""
        return f"gs://{self.bucket}/{self.prefix}".rstrip("/"), SCHEME.settings_of(self)


SCHEME = Scheme(
    "gs://",
    "GCSDestination",
    "gs://bucket/prefix",
    settings=(
        Setting("gcs_endpoint_url", "EXPORTS_GCS_ENDPOINT_URL", doc="An emulator's or private endpoint"),
        Setting("gcs_project", "GOOGLE_CLOUD_PROJECT", doc="The project"),
        Setting("gcs_credentials_file", "GOOGLE_APPLICATION_CREDENTIALS", credential=True,
                doc="A service-account key file; None: application default credentials"),
        Setting("connect_timeout_seconds", parse=float, default=5.0, doc="Client connect timeout"),
        Setting("read_timeout_seconds", parse=float, default=30.0, doc="Client read timeout (a write's: unknown)"),
    ),
)  # fmt: skip
