"""An Azure Blob Storage container as the publishing template's store hooks (optional extra ``[azure]``:
azure-storage-blob).

Conditions are the store's own: ``If-None-Match: *`` creates only if absent, ``If-Match: <etag>`` replaces only the
version read. Every call makes exactly one send (azure-core's retries are off: a blind resend of an ambiguous write is
what this destination avoids), and every call's failure is classified as for S3:

* nothing was sent (``ServiceRequestError``: connection refused, a connect timeout): ``DestinationUnreachable``;
* the container does not exist (404 ``ContainerNotFound``): a read cannot tell (``DestinationUnreachable``, never
  "absent"), a write did not happen (``DestinationError``); both name the container;
* the store refused a write (a 4xx other than 409/412): the write did not happen;
* sent but unanswered (``ServiceResponseError``: read timeout, connection cut; a 5xx): it may or may not have happened;
* 409 ``BlobAlreadyExists`` or 412 ``ConditionNotMet``: the condition did not hold.

Messages carry the SDK's error class and HTTP status only, never its text (which quotes the request's URL, a SAS
token included).

Blobs up to ``max_single_put_bytes`` go up in one Put Blob; larger data files as blocks committed by one Put Block
List, which carries the condition. Before the first write (once per process and store) both paths are probed with a
small object (the block path through a client whose single-put limit is below it), and a store that ignores the
condition on either is refused, as is one that lets more than one of several racing creates win
(:func:`~export_ledger.destinations.store.racing_creates`).
"""

from __future__ import annotations

import functools
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

_CONTAINER_RE = re.compile(r"[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]")
_PROBE_FOLDER = ".export-ledger-probe/"
#: The probe of the block path: a blob of this size through a client whose single-put limit and block size are
#: below it, so it goes up as four blocks and a conditional Put Block List, as a large data file does.
_PROBE_BLOCKS = (2048, 1024, 512)
#: An ETag no blob has: an ``If-Match`` on it must be refused with 412.
_NO_SUCH_ETAG = '"0x8D000000000000F"'
_CONDITIONS_CHECKED: set[tuple[str, str]] = set()


def _sdk():
    try:
        import azure.core.exceptions as errors
        from azure.core import MatchConditions
        from azure.storage.blob import BlobServiceClient
    except ImportError as exc:
        raise DestinationError(
            "the Azure destination needs azure-storage-blob: pip install 'export-ledger[azure]'"
        ) from exc
    return BlobServiceClient, MatchConditions, errors


@functools.lru_cache(maxsize=16)
def _container(account_url, account_name, account_key, sas_token, container, connect, read, single_put, block):
    service_client, _, _ = _sdk()
    if account_key:
        credential = {"account_name": account_name, "account_key": account_key}
    else:
        credential = sas_token or None  # None: anonymous (a public container, or a URL that carries a SAS)
    service = service_client(
        account_url, credential=credential, retry_total=0, connection_timeout=connect, read_timeout=read,
        max_single_put_size=single_put, max_block_size=block,
    )  # fmt: skip
    return service.get_container_client(container)


@dataclass(frozen=True)
class AzureStore(ProbedStore):
    """A container (and name prefix) as an object store. Built by :class:`AzureDestination`."""

    _checked: ClassVar[set] = _CONDITIONS_CHECKED
    PROBE_STALE = "an ETag the blob does not have (If-Match)"
    PROBE_NOUN = "blob"

    container: str
    prefix: str
    account_url: str
    #: account_url, name, key, sas, container, connect and read timeouts (the key and SAS token: never printed)
    client_settings: tuple = field(repr=False)
    sizes: tuple[int, int]  # single-put limit and block size of data uploads

    def _client(self, sizes: tuple[int, int] | None = None):
        return _container(*self.client_settings, *(sizes or self.sizes))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _blob(self, name: str, sizes: tuple[int, int] | None = None):
        return self._client(sizes).get_blob_client(self._key(name))

    def url(self, name: str) -> str:
        return f"az://{self.container}/{self._key(name)}"

    def describe(self) -> str:
        return f"az://{self.container}/{self.prefix} at {redact_text(self.account_url)}"

    # -- classification ----------------------------------------------------------------------------------------

    @staticmethod
    def _describe_error(exc) -> str:
        status = getattr(exc, "status_code", None)
        return f"{type(exc).__name__} (HTTP {status})" if status else type(exc).__name__

    @staticmethod
    def _no_container(exc) -> bool:
        return getattr(exc, "error_code", None) == "ContainerNotFound"

    def _missing(self, what: str) -> str:
        return (
            f"cannot {what}: the container {self.container!r} does not exist at {redact_text(self.account_url)} "
            "(create it, or correct the destination)"
        )

    def _unreadable(self, exc, what: str) -> DestinationUnreachable:
        """The error for a failed read: the read cannot tell what is there."""
        if self._no_container(exc):
            return DestinationUnreachable(self._missing(what))
        return DestinationUnreachable(f"cannot {what}: {self._describe_error(exc)}")

    def _write_failed(self, exc, what: str) -> DestinationError:
        _, _, errors = _sdk()
        if self._no_container(exc):
            return DestinationError(self._missing(what))
        if isinstance(exc, errors.HttpResponseError) and not isinstance(exc, errors.ServiceResponseError):
            if (exc.status_code or 0) >= 500:
                return PublishOutcomeUnknown(f"{what} answered {self._describe_error(exc)}: it may or may not exist")
            return DestinationError(f"the store refused {what}: {self._describe_error(exc)}")
        if isinstance(exc, errors.ServiceRequestError):
            return DestinationUnreachable(f"cannot reach the store for {what}: {self._describe_error(exc)}")
        return PublishOutcomeUnknown(f"{what} got no answer ({self._describe_error(exc)}): it may or may not exist")

    @classmethod
    def _refused_condition(cls, exc) -> bool:
        _, _, errors = _sdk()
        refused = (errors.ResourceExistsError, errors.ResourceModifiedError, errors.ResourceNotFoundError)
        return isinstance(exc, refused) and not cls._no_container(exc)

    # -- reads ---------------------------------------------------------------------------------------------------

    def _download(self, name: str):
        _, _, errors = _sdk()
        try:
            return self._blob(name).download_blob()
        except errors.AzureError as exc:
            if isinstance(exc, errors.ResourceNotFoundError) and not self._no_container(exc):
                return None
            raise self._unreadable(exc, f"read {self.url(name)}") from None

    def _consume(self, name: str, consume):
        _, _, errors = _sdk()
        try:
            return consume()
        except (errors.AzureError, OSError) as exc:
            raise self._unreadable(exc, f"read {self.url(name)}") from None

    def get(self, name: str) -> Blob | None:
        downloader = self._download(name)
        if downloader is None:
            return None
        return Blob(self._consume(name, downloader.readall), downloader.properties.etag)

    def read(self, name: str) -> bytes | None:
        found = self.get(name)
        return None if found is None else found.data

    def digest(self, name: str) -> str | None:
        import hashlib

        downloader = self._download(name)
        if downloader is None:
            return None

        def hashed() -> str:
            digest = hashlib.sha256()
            for chunk in downloader.chunks():
                digest.update(chunk)
            return digest.hexdigest()

        return self._consume(name, hashed)

    def list(self, prefix: str) -> list[str]:
        _, _, errors = _sdk()
        cut = len(self.prefix) + 1 if self.prefix else 0
        try:
            return [blob.name[cut:] for blob in self._client().list_blobs(name_starts_with=self._key(prefix))]
        except errors.AzureError as exc:
            raise self._unreadable(exc, f"list {self.url(prefix)}") from None

    # -- writes --------------------------------------------------------------------------------------------------

    def _send(self, name: str, data, tag: str | None, sizes: tuple[int, int] | None = None) -> str:
        """One conditional upload (``tag`` None: only if absent); returns the new ETag."""
        _, match, _ = _sdk()
        condition = {"overwrite": False} if tag is None else {
            "overwrite": True, "etag": tag, "match_condition": match.IfNotModified}  # fmt: skip
        return self._blob(name, sizes).upload_blob(data, **condition)["etag"]

    def _create_or_compare(self, name: str, data, sha256: str) -> None:
        """Creates ``name`` only if absent; an object already there with the same bytes (sha256) is success."""
        _, _, errors = _sdk()
        try:
            self._send(name, data, None)
            return
        except errors.AzureError as exc:
            if not self._refused_condition(exc):
                raise self._write_failed(exc, f"writing {self.url(name)}") from None
        # 409: something is there. The same bytes: this party's own earlier send landed (one party writes a place).
        found = self.digest(name)
        if found is None:
            raise PublishOutcomeUnknown(f"{self.url(name)} answered 409 but cannot be read back")
        if found != sha256:
            raise AlreadyExists(f"{self.url(name)} holds other bytes")

    def put_if_absent(self, name: str, data: bytes) -> None:
        import hashlib

        self._create_or_compare(name, data, hashlib.sha256(data).hexdigest())

    def upload(self, name: str) -> Upload:
        return _AzureUpload(self, name, staging_folder("azure"))

    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        _, _, errors = _sdk()
        try:
            return self._send(name, data, tag)
        except errors.AzureError as exc:
            if self._refused_condition(exc):
                raise PreconditionFailed(f"{self.url(name)} changed since it was read") from None
            raise self._write_failed(exc, f"writing {self.url(name)}") from None

    def delete(self, name: str) -> None:
        _, _, errors = _sdk()
        try:
            self._blob(name).delete_blob()
        except errors.AzureError as exc:
            if isinstance(exc, errors.ResourceNotFoundError) and not self._no_container(exc):
                return
            if self._no_container(exc):
                raise DestinationError(self._missing(f"delete {self.url(name)}")) from None
            if isinstance(exc, errors.ServiceRequestError):
                raise DestinationUnreachable(f"cannot delete {self.url(name)}: {self._describe_error(exc)}") from None
            raise DestinationError(f"cannot delete {self.url(name)}: {self._describe_error(exc)}") from None

    # -- the startup check ---------------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"az://{self.container}"

    def _conditions_key(self) -> tuple:
        return (self.account_url, self.container)

    def _conditional_put(self, name: str, data: bytes, tag: str | None) -> str:
        return self._send(name, data, tag)

    def _stale_tag(self, tag: str) -> str:
        return _NO_SUCH_ETAG

    def _probe_failures(self) -> tuple:
        _, _, errors = _sdk()
        return (errors.AzureError,)

    def _probe_refused(self, exc, what: str) -> str | None:
        status = getattr(exc, "status_code", None)
        if self._no_container(exc):
            return self._missing(what)
        if status is not None and 400 <= status < 500:
            return f"the store refused the {what}: {self._describe_error(exc)}"
        return None

    def _probe_more(self, name: str) -> None:
        """The block path: a blob committed as a block list (as a large data file is) must be refused a second
        create too."""
        size, single_put, block = _PROBE_BLOCKS
        blocks = f"{name}-blocks"
        try:
            self._send(blocks, b"5" * size, None, (single_put, block))
            self._must_refuse(lambda: self._send(blocks, b"6" * size, None, (single_put, block)), "a second "
                              "conditional create committed as a block list (Put Block List, If-None-Match: *)",
                              "a retry could replace a published data file uploaded in blocks")  # fmt: skip
        finally:
            self._remove_probes(blocks)

    def _probe_name(self) -> str:
        """A fresh probe blob's name, after removing probes an hour older than the newest (left by processes killed
        mid-check; the store's own timestamps, not this machine's clock)."""
        probes = list(self._client().list_blobs(name_starts_with=self._key(_PROBE_FOLDER)))
        newest = max((blob.last_modified for blob in probes), default=None)
        cut = len(self.prefix) + 1 if self.prefix else 0
        for blob in probes:
            if (newest - blob.last_modified).total_seconds() > 3600:
                self.delete(blob.name[cut:])
        return f"{_PROBE_FOLDER}{uuid.uuid4().hex}"


class _AzureUpload(StagedFileUpload):
    def __init__(self, store: AzureStore, name: str, folder: Path) -> None:
        super().__init__(folder)
        self.store, self.name = store, name

    def send(self, path: Path, size: int) -> None:
        with open(path, "rb") as source:
            self.store._create_or_compare(self.name, source, file_sha256(path))


@dataclass(frozen=True)
class AzureDestination(PublishingDestination):
    """Exports as blobs in an Azure Blob Storage container: the publishing template (docs/protocol.md) over
    :class:`AzureStore`.

    Attributes:
        container: Container name.
        prefix: Name prefix without leading or trailing slash ("" for the container root).
        azure_endpoint_url: The account's blob endpoint (``EXPORTS_AZURE_ENDPOINT_URL``; Azurite:
            ``http://127.0.0.1:10000/devstoreaccount1``). None: ``https://<account>.blob.core.windows.net``.
        azure_account_name: Storage account (``AZURE_STORAGE_ACCOUNT_NAME``).
        azure_account_key / azure_sas_token: A shared key (``AZURE_STORAGE_ACCOUNT_KEY``) or a SAS token
            (``AZURE_STORAGE_SAS_TOKEN``), normally given as Dagster ``EnvVar``; neither: anonymous.
        connect_timeout_seconds / read_timeout_seconds: Client timeouts; a read timeout on a write makes its
            outcome unknown.
        max_single_put_bytes / block_size_bytes: Data files above the limit go up as blocks of that size.
    """

    container: str
    prefix: str = ""
    azure_endpoint_url: str | None = None
    azure_account_name: str | None = None
    azure_account_key: str | None = field(default=None, repr=False)
    azure_sas_token: str | None = field(default=None, repr=False)
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 30.0
    max_single_put_bytes: int = 64 << 20
    block_size_bytes: int = 8 << 20

    pool = "exports-azure"
    locators = ("azure_endpoint_url", "azure_account_name")

    def __post_init__(self) -> None:
        _sdk()  # a configured destination without its package fails here, naming the extra
        if not (self.azure_endpoint_url or self.azure_account_name):
            raise DestinationError("an az:// destination needs azure_account_name or azure_endpoint_url")
        if self.azure_account_key and not self.azure_account_name:
            raise DestinationError("an az:// destination with an account key needs azure_account_name")

    @property
    def account_url(self) -> str:
        return (self.azure_endpoint_url or f"https://{self.azure_account_name}.blob.core.windows.net").rstrip("/")

    @functools.cached_property
    def store(self) -> AzureStore:
        settings = (
            self.account_url, self.azure_account_name, self.azure_account_key, self.azure_sas_token, self.container,
            self.connect_timeout_seconds, self.read_timeout_seconds,
        )  # fmt: skip
        sizes = (self.max_single_put_bytes, self.block_size_bytes)
        return AzureStore(self.container, self.prefix.strip("/"), self.account_url, settings, sizes)

    @staticmethod
    def check_spec(spec: str) -> str | None:
        container = spec.removeprefix("az://").partition("/")[0]
        return None if _CONTAINER_RE.fullmatch(container) else f"{container!r} is not a valid Azure container name"

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> AzureDestination:
        container, _, prefix = spec.removeprefix("az://").partition("/")
        return cls(container=container, prefix=prefix.strip("/"), **settings)

    def spec(self) -> tuple[str, dict]:
        """The spec and settings that build this destination again."""
        return f"az://{self.container}/{self.prefix}".rstrip("/"), SCHEME.settings_of(self)


SCHEME = Scheme(
    "az://",
    "AzureDestination",
    "az://container/prefix",
    settings=(
        Setting("azure_endpoint_url", "EXPORTS_AZURE_ENDPOINT_URL",
                doc="The account's blob endpoint; None: https://<account>.blob.core.windows.net"),
        Setting("azure_account_name", "AZURE_STORAGE_ACCOUNT_NAME", credential=True, doc="The storage account"),
        Setting("azure_account_key", "AZURE_STORAGE_ACCOUNT_KEY", secret=True, doc="The account's shared key"),
        Setting("azure_sas_token", "AZURE_STORAGE_SAS_TOKEN", secret=True, doc="A SAS token (instead of the key)"),
        Setting("connect_timeout_seconds", parse=float, default=5.0, doc="Client connect timeout"),
        Setting("read_timeout_seconds", parse=float, default=30.0, doc="Client read timeout (a write's: unknown)"),
    ),
)  # fmt: skip
