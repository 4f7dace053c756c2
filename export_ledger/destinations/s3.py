"""An S3-compatible object store as the publishing template's store hooks (optional extra ``[s3]``: boto3).

Conditions are the store's own: ``If-None-Match: *`` creates only if absent, ``If-Match: <etag>`` replaces only the
version read. Before its first write (once per process and store) the store is checked to honour both, and a store
that ignores either is refused: there a retry could replace an export, or two parties both move a pointer. So is a
store that lets more than one of several racing creates win (:func:`~export_ledger.destinations.store.racing_creates`
says what that check can and cannot show).

What a failed write means is classified, because a database transaction cannot commit a remote upload. The client
makes exactly one send per call (botocore's own retries are off: a blind resend is the thing to avoid):

* nothing was sent (connection refused, a connect timeout, no credentials) or the store refused it (a 4xx other than
  412/409): the write did not happen (``DestinationUnreachable`` when the store could not be reached);
* the bucket does not exist (404 ``NoSuchBucket``): a read cannot tell (``DestinationUnreachable``, never "absent"),
  a write did not happen (``DestinationError``); both name the bucket;
* sent but unanswered (read timeout, connection cut before the response, a 5xx): it may or may not have happened;
* 412 (409: a concurrent conditional write won): the condition did not hold; nothing was written by this call.

Data files above ``multipart_threshold`` go up as a multipart upload (a single PUT takes at most 5 GB); their names
are their party's own (``r<revision>-t<token>/``), so no condition is needed on them.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import os
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from export_ledger.destinations.base import DestinationError, DestinationUnreachable, PublishOutcomeUnknown
from export_ledger.destinations.publishing import PublishingDestination
from export_ledger.destinations.registry import Scheme, Setting
from export_ledger.destinations.staging import staging_folder
from export_ledger.destinations.store import (
    AlreadyExists,
    Blob,
    PreconditionFailed,
    ProbedStore,
    Upload,
)
from export_ledger.errors import redact_text

_CHUNK = 1 << 20
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: An ETag no object has (S3 ETags are quoted hex digests): an ``If-Match`` on it must be refused with 412.
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'
_CONDITIONS_CHECKED: set[tuple[str | None, str]] = set()


def _boto():
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise DestinationError("the S3 destination needs boto3: pip install 'export-ledger[s3]'") from exc
    return boto3, botocore.config, botocore.exceptions


@functools.lru_cache(maxsize=16)
def _client(endpoint_url, region, key_id, secret, token, connect_timeout, read_timeout):
    boto3, config, _ = _boto()
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or None,
        region_name=region,
        aws_access_key_id=key_id or None,
        aws_secret_access_key=secret or None,
        aws_session_token=token or None,
        config=config.Config(
            # One send per call: a blind resend of an ambiguous write is exactly what this destination avoids.
            retries={"total_max_attempts": 1},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            s3={"addressing_style": "path"},
        ),
    )


@dataclass(frozen=True)
class S3Store(ProbedStore):
    """A bucket (and key prefix) as an object store. Built by :class:`S3Destination`."""

    _checked: ClassVar[set] = _CONDITIONS_CHECKED

    bucket: str
    prefix: str
    endpoint_url: str | None
    client_settings: tuple = field(repr=False)  # the secret key and session token: never printed
    multipart_threshold: int
    part_size: int

    def _s3(self):
        return _client(*self.client_settings)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self._key(name)}"

    def describe(self) -> str:
        where = f" at {redact_text(self.endpoint_url)}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    # -- classification ----------------------------------------------------------------------------------------

    @staticmethod
    def _status(exc) -> int | None:
        response = getattr(exc, "response", None) or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status is None:
            code = response.get("Error", {}).get("Code", "")
            status = int(code) if str(code).isdigit() else None
        return status

    @staticmethod
    def _describe_error(exc) -> str:
        status = S3Store._status(exc)
        name = type(exc).__name__
        return f"{name} (HTTP {status})" if status else name

    @staticmethod
    def _no_bucket(exc) -> bool:
        response = getattr(exc, "response", None) or {}
        return response.get("Error", {}).get("Code") == "NoSuchBucket"

    def _absent(self, exc) -> bool:
        if self._no_bucket(exc):
            return False
        return self._status(exc) == 404 or exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404")

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
        """The error for a failed write: certainly not written, or an unknown outcome."""
        _, _, errors = _boto()
        if self._no_bucket(exc):
            return DestinationError(self._missing(what))
        if isinstance(exc, errors.ClientError):
            status = self._status(exc)
            if status is not None and status >= 500:
                return PublishOutcomeUnknown(f"{what} answered {self._describe_error(exc)}: it may or may not exist")
            return DestinationError(f"the store refused {what}: {self._describe_error(exc)}")
        not_sent = (
            errors.EndpointConnectionError, errors.ConnectTimeoutError, errors.NoCredentialsError,
            errors.PartialCredentialsError,
        )  # fmt: skip
        if isinstance(exc, not_sent):
            # Connection refused, a connect timeout, no credentials: nothing was sent. (A TLS error can come after the
            # request went out whole, and other connection errors too: those are unknown outcomes.)
            return DestinationUnreachable(f"cannot reach the store for {what}: {self._describe_error(exc)}")
        return PublishOutcomeUnknown(f"{what} got no answer ({self._describe_error(exc)}): it may or may not exist")

    # -- reads ---------------------------------------------------------------------------------------------------

    def _get_object(self, name: str):
        _, _, errors = _boto()
        try:
            return self._s3().get_object(Bucket=self.bucket, Key=self._key(name))
        except errors.ClientError as exc:
            if self._absent(exc):
                return None
            raise self._unreadable(exc, f"read {self.url(name)}") from None
        except errors.BotoCoreError as exc:
            raise self._unreadable(exc, f"read {self.url(name)}") from None

    def _body(self, name: str, response, consume) -> object:
        _, _, errors = _boto()
        try:
            return consume(response["Body"])
        except (errors.BotoCoreError, OSError) as exc:
            raise DestinationUnreachable(f"cannot read {self.url(name)}: {type(exc).__name__}") from None

    def get(self, name: str) -> Blob | None:
        response = self._get_object(name)
        if response is None:
            return None
        return Blob(self._body(name, response, lambda body: body.read()), response["ETag"])

    def read(self, name: str) -> bytes | None:
        found = self.get(name)
        return None if found is None else found.data

    def digest(self, name: str) -> str | None:
        response = self._get_object(name)
        if response is None:
            return None

        def hashed(body) -> str:
            digest = hashlib.sha256()
            for chunk in body.iter_chunks(_CHUNK):
                digest.update(chunk)
            return digest.hexdigest()

        return self._body(name, response, hashed)

    def list(self, prefix: str) -> list[str]:
        _, _, errors = _boto()
        start = self._key(prefix)
        cut = len(self.prefix) + 1 if self.prefix else 0
        try:
            pages = self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start)
            return [item["Key"][cut:] for page in pages for item in page.get("Contents", [])]
        except (errors.ClientError, errors.BotoCoreError) as exc:
            raise self._unreadable(exc, f"list {self.url(prefix)}") from None

    # -- writes --------------------------------------------------------------------------------------------------

    def put_if_absent(self, name: str, data: bytes) -> None:
        _, _, errors = _boto()
        try:
            self._s3().put_object(Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*")
            return
        except errors.ClientError as exc:
            if self._status(exc) not in (409, 412):
                raise self._write_failed(exc, f"writing {self.url(name)}") from None
        except errors.BotoCoreError as exc:
            raise self._write_failed(exc, f"writing {self.url(name)}") from None
        # 412: something is there. The same bytes: this party's own earlier send landed (one party writes a place).
        found = self.get(name)
        if found is None:
            raise PublishOutcomeUnknown(f"{self.url(name)} answered 412 but cannot be read back")
        if found.data != data:
            raise AlreadyExists(f"{self.url(name)} holds other bytes")

    def upload(self, name: str) -> Upload:
        return _S3Upload(self, name, staging_folder("s3"))

    def put_if_match(self, name: str, data: bytes, tag: str | None) -> str:
        _, _, errors = _boto()
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            response = self._s3().put_object(
                Bucket=self.bucket, Key=self._key(name), Body=data, ContentType="application/json", **condition
            )
        except errors.ClientError as exc:
            # 412: not at the version read; 404: deleted since; 409: a concurrent conditional write won.
            if self._status(exc) in (404, 409, 412) and not self._no_bucket(exc):
                raise PreconditionFailed(f"{self.url(name)} changed since it was read") from None
            raise self._write_failed(exc, f"writing {self.url(name)}") from None
        except errors.BotoCoreError as exc:
            raise self._write_failed(exc, f"writing {self.url(name)}") from None
        return response["ETag"]

    def delete(self, name: str) -> None:
        _, _, errors = _boto()
        try:
            self._s3().delete_object(Bucket=self.bucket, Key=self._key(name))
        except (errors.ClientError, errors.BotoCoreError) as exc:
            if self._no_bucket(exc):
                raise DestinationError(self._missing(f"delete {self.url(name)}")) from None
            if isinstance(exc, (errors.EndpointConnectionError, errors.ConnectTimeoutError)):
                raise DestinationUnreachable(f"cannot delete {self.url(name)}: {self._describe_error(exc)}") from None
            raise DestinationError(f"cannot delete {self.url(name)}: {self._describe_error(exc)}") from None

    # -- the startup check (ProbedStore.check_conditions, over these hooks) ---------------------------------------

    def _where(self) -> str:
        return f"s3://{self.bucket}"

    def _conditions_key(self) -> tuple:
        return (self.endpoint_url, self.bucket)

    def _conditional_put(self, name: str, data: bytes, tag: str | None) -> str:
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        return self._s3().put_object(Bucket=self.bucket, Key=self._key(name), Body=data, **condition)["ETag"]

    def _stale_tag(self, tag: str) -> str:
        return _NO_SUCH_ETAG

    def _refused_condition(self, exc) -> bool:
        """412, or 409: a concurrent conditional write won (S3's answer to a create racing another)."""
        _, _, errors = _boto()
        return isinstance(exc, errors.ClientError) and self._status(exc) in (409, 412)

    def _probe_failures(self) -> tuple:
        _, _, errors = _boto()
        return errors.ClientError, errors.BotoCoreError

    def _probe_refused(self, exc, what: str) -> str | None:
        _, _, errors = _boto()
        if not isinstance(exc, errors.ClientError):
            return None
        if self._no_bucket(exc):
            return self._missing(what)
        status = self._status(exc)
        if status is not None and 400 <= status < 500:
            return f"the store refused the {what}: {self._describe_error(exc)}"
        return None

    def _probe_name(self) -> str:
        folder = ".export-ledger-probe/"
        client = self._s3()
        listing = client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(folder))
        store_now = _response_time(listing)
        if store_now is not None:
            for item in listing.get("Contents", []):
                if item["LastModified"] < store_now - dt.timedelta(hours=1):
                    client.delete_object(Bucket=self.bucket, Key=item["Key"])
        return f"{folder}{uuid.uuid4().hex}"


def _response_time(response) -> dt.datetime | None:
    """The store's clock, from a response's ``Date`` header (None when it sent none)."""
    from email.utils import parsedate_to_datetime

    header = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not header:
        return None
    try:
        return parsedate_to_datetime(header).astimezone(dt.timezone.utc)
    except (TypeError, ValueError):
        return None


class _S3Upload(Upload):
    """A data file staged in a private local file (its sha256 is known before anything is sent), then uploaded."""

    def __init__(self, store: S3Store, name: str, folder: Path) -> None:
        self.store, self.name = store, name
        handle, path = tempfile.mkstemp(prefix=f"{os.getpid()}-", dir=folder)
        self.path = Path(path)
        self.handle = os.fdopen(handle, "wb")

    def commit(self) -> None:
        self.handle.close()
        try:
            if self.path.stat().st_size > self.store.multipart_threshold:
                self._multipart()
            else:
                self.store.put_if_absent(self.name, self.path.read_bytes())
        finally:
            self.path.unlink(missing_ok=True)

    def _multipart(self) -> None:
        """Parts of ``part_size``: the object appears whole when the upload completes, or not at all (an unfinished
        upload is aborted; a store's lifecycle rule should also expire those a dead process left)."""
        _, _, errors = _boto()
        store, client = self.store, self.store._s3()
        key = store._key(self.name)
        what = f"uploading {store.url(self.name)}"
        try:
            upload_id = client.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]
        except (errors.ClientError, errors.BotoCoreError) as exc:
            if store._no_bucket(exc):
                raise DestinationError(store._missing(what)) from None
            raise DestinationError(f"the store refused {what}: {store._describe_error(exc)}") from None
        parts = []
        try:
            with open(self.path, "rb") as source:
                number = 1
                while chunk := source.read(store.part_size):
                    answer = client.upload_part(
                        Bucket=store.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
                    )
                    parts.append({"PartNumber": number, "ETag": answer["ETag"]})
                    number += 1
        except (errors.ClientError, errors.BotoCoreError) as exc:
            # Nothing is visible until the upload completes: a failed part is a failed write.
            _abort(client, store.bucket, key, upload_id)
            raise DestinationError(f"{what} failed: {store._describe_error(exc)}") from None
        try:
            client.complete_multipart_upload(
                Bucket=store.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except (errors.ClientError, errors.BotoCoreError) as exc:
            raise store._write_failed(exc, what) from None

    def abort(self) -> None:
        try:
            self.handle.close()
        finally:
            self.path.unlink(missing_ok=True)


def _abort(client, bucket: str, key: str, upload_id: str) -> None:
    try:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception:  # best effort: an unfinished upload is invisible, and the store's lifecycle rule expires it
        pass


@dataclass(frozen=True)
class S3Destination(PublishingDestination):
    """Exports as objects in an S3-compatible bucket: the publishing template (docs/protocol.md) over
    :class:`S3Store`.

    Attributes:
        bucket: Bucket name.
        prefix: Key prefix without leading or trailing slash ("" for the bucket root).
        endpoint_url: Endpoint of a non-AWS store (``AWS_ENDPOINT_URL``); None for AWS itself.
        region_name: Region (``AWS_REGION``, else ``AWS_DEFAULT_REGION``).
        access_key_id / secret_access_key / session_token: Credentials, normally given as Dagster ``EnvVar`` so
            they never appear in run config or the UI; None lets boto3 find them itself.
        connect_timeout_seconds / read_timeout_seconds: Client timeouts; a read timeout on a write makes its
            outcome unknown.
        multipart_threshold_bytes / part_size_bytes: Data files above the threshold go up in parts.
    """

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region_name: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 30.0
    multipart_threshold_bytes: int = 1 << 30
    part_size_bytes: int = 64 << 20

    pool = "exports-s3"
    locators = ("endpoint_url",)

    @functools.cached_property
    def store(self) -> S3Store:
        settings = (
            self.endpoint_url, self.region_name, self.access_key_id, self.secret_access_key, self.session_token,
            self.connect_timeout_seconds, self.read_timeout_seconds,
        )  # fmt: skip
        return S3Store(
            self.bucket, self.prefix.strip("/"), self.endpoint_url, settings, self.multipart_threshold_bytes,
            self.part_size_bytes,
        )  # fmt: skip

    @staticmethod
    def check_spec(spec: str) -> str | None:
        bucket = spec.removeprefix("s3://").partition("/")[0]
        return None if _BUCKET_RE.fullmatch(bucket) else f"{bucket!r} is not a valid S3 bucket name"

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> S3Destination:
        bucket, _, prefix = spec.removeprefix("s3://").partition("/")
        return cls(bucket=bucket, prefix=prefix.strip("/"), **settings)

    def spec(self) -> tuple[str, dict]:
        """The spec and settings that build this destination again."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/"), SCHEME.settings_of(self)


SCHEME = Scheme(
    "s3://",
    "S3Destination",
    "s3://bucket/prefix",
    settings=(
        Setting("endpoint_url", "AWS_ENDPOINT_URL", doc="Endpoint of a non-AWS store; None: AWS itself"),
        Setting("region_name", ("AWS_REGION", "AWS_DEFAULT_REGION"), default="us-east-1", doc="The bucket's region"),
        Setting("access_key_id", "AWS_ACCESS_KEY_ID", credential=True, doc="Access key id; None: boto3's lookup"),
        Setting("secret_access_key", "AWS_SECRET_ACCESS_KEY", secret=True, doc="Secret access key"),
        Setting("session_token", "AWS_SESSION_TOKEN", secret=True, doc="Session token of temporary credentials"),
        Setting("connect_timeout_seconds", parse=float, default=5.0, doc="Client connect timeout"),
        Setting("read_timeout_seconds", parse=float, default=30.0, doc="Client read timeout (a write's: unknown)"),
    ),
)
