"""An S3-compatible object store as an export destination (optional extra ``[s3]``: boto3).

Same layout and manifest as the local destination: ``<prefix>/<export>/tenant=<tenant>/date=<YYYY-MM-DD>/``
holding the data object and ``_manifest.json``. The data object is written first and the manifest last: the
manifest is the completion marker. Every write is a conditional create (``If-None-Match: *``), so the store itself
refuses a second copy. Object metadata carries the logical key, attempt id, fencing token and sha256.

What a failed write means is classified, because a database transaction cannot commit a remote upload:

* refused before anything was sent (connection refused, connect timeout, a 4xx other than 412): nothing was
  written, the attempt failed, a retry is safe;
* sent but unanswered (read timeout, connection cut before the response, a 5xx): the object may or may not exist,
  so the outcome is unknown and only reconciliation, reading the store, may decide;
* 412 Precondition Failed: something is already there; it is read and compared, never overwritten.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from export_ledger.destinations.base import (
    DestinationConflict,
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    PublishedElsewhere,
    PublishingDestination,
    PublishOutcomeUnknown,
    StagedExport,
)
from export_ledger.frames import MANIFEST_NAME, Manifest, ManifestError, write_table


def _boto():
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise DestinationError("the S3 destination needs boto3: pip install 'export-ledger[s3]'") from exc
    return boto3, botocore.config, botocore.exceptions


def _staging_folder() -> Path:
    folder = Path(tempfile.gettempdir()) / "export-ledger-s3-staging"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _sweep_dead_staging(folder: Path) -> None:
    """Removes staging files whose writing process no longer exists (it was killed mid-export)."""
    for entry in folder.iterdir():
        pid_text = entry.name.split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            entry.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, owned by someone else


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
class S3Destination(PublishingDestination):
    """Exports as objects in an S3-compatible bucket.

    Attributes:
        bucket: Bucket name.
        prefix: Key prefix without leading or trailing slash ("" for the bucket root).
        endpoint_url: Endpoint of a non-AWS store (``AWS_ENDPOINT_URL``); None for AWS itself.
        region_name: Region (``AWS_DEFAULT_REGION``).
        access_key_id / secret_access_key / session_token: Credentials, normally given as Dagster ``EnvVar`` so
            they never appear in run config or the UI; None lets boto3 find them itself.
        connect_timeout_seconds / read_timeout_seconds: Client timeouts; a read timeout on a write makes its
            outcome unknown.
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

    pool = "exports-s3"

    # -- plumbing ----------------------------------------------------------------------------------------------

    def _s3(self):
        return _client(
            self.endpoint_url,
            self.region_name,
            self.access_key_id,
            self.secret_access_key,
            self.session_token,
            self.connect_timeout_seconds,
            self.read_timeout_seconds,
        )

    def _folder(self, target: ExportTarget) -> str:
        parts = [p for p in (self.prefix.strip("/"), *target.parts) if p]
        return "/".join(parts)

    def _key(self, target: ExportTarget, name: str) -> str:
        return f"{self._folder(target)}/{name}"

    def location(self, target: ExportTarget) -> str:
        return f"s3://{self.bucket}/{self._folder(target)}/"

    def describe(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix.strip('/')}{where}"

    def _status(self, exc) -> int | None:
        response = getattr(exc, "response", None) or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status is None:
            code = response.get("Error", {}).get("Code", "")
            status = int(code) if str(code).isdigit() else None
        return status

    def _unreached(self, exc) -> bool:
        """True when the request cannot have reached the store (so nothing was written)."""
        _, _, errors = _boto()
        return isinstance(
            exc, (errors.EndpointConnectionError, errors.NoCredentialsError, errors.PartialCredentialsError)
        ) and not isinstance(exc, errors.ReadTimeoutError)

    def _describe_error(self, exc) -> str:
        status = self._status(exc)
        name = type(exc).__name__
        return f"{name} (HTTP {status})" if status else name

    def _get(self, key: str) -> tuple[bytes, dict] | None:
        """An object's bytes and metadata, None when absent; raises DestinationUnreachable when it cannot tell."""
        _, _, errors = _boto()
        try:
            response = self._s3().get_object(Bucket=self.bucket, Key=key)
            return response["Body"].read(), response.get("Metadata", {})
        except errors.ClientError as exc:
            if self._status(exc) == 404 or exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise DestinationUnreachable(f"cannot read s3://{self.bucket}/{key}: {self._describe_error(exc)}") from None
        except errors.BotoCoreError as exc:
            raise DestinationUnreachable(f"cannot read s3://{self.bucket}/{key}: {self._describe_error(exc)}") from None

    # -- the protocol ------------------------------------------------------------------------------------------

    def probe(self, target: ExportTarget) -> Manifest | None:
        key = self._key(target, MANIFEST_NAME)
        found = self._get(key)
        if found is None:
            return None
        return Manifest.from_json(found[0], f"s3://{self.bucket}/{key}")

    def stage(self, target: ExportTarget, table, file_format: str, manifest: Manifest) -> StagedExport:
        # Staging is a local file, so the checksum is known before anything is sent. It holds customer data: it lives
        # in a private folder, and files of processes that died before cleaning up are removed here.
        folder = _staging_folder()
        _sweep_dead_staging(folder)
        handle, path = tempfile.mkstemp(prefix=f"{os.getpid()}-", suffix=f".{file_format}", dir=folder)
        try:
            with os.fdopen(handle, "wb") as sink:
                sha256 = write_table(table, file_format, sink)
        except BaseException:
            os.unlink(path)
            raise
        complete = Manifest(**{**manifest.__dict__, "sha256": sha256, "row_count": table.num_rows})
        return StagedExport(target, complete, path)

    def publish(self, staged: StagedExport) -> Manifest:
        manifest = staged.manifest
        metadata = {
            "logical-key": manifest.logical_key,
            "attempt-id": manifest.attempt_id,
            "fencing-token": str(manifest.fencing_token),
            "sha256": manifest.sha256,
        }
        data_key = self._key(staged.target, manifest.data_file)
        with open(staged.handle, "rb") as body:
            self._create(data_key, body, metadata, manifest, is_manifest=False)
        self._create(self._key(staged.target, MANIFEST_NAME), manifest.to_json(), metadata, manifest, is_manifest=True)
        self.discard(staged)
        return manifest

    def _create(self, key: str, body, metadata: dict, manifest: Manifest, *, is_manifest: bool) -> None:
        _, _, errors = _boto()
        where = f"s3://{self.bucket}/{key}"
        try:
            self._s3().put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=metadata, IfNoneMatch="*")
            return
        except errors.ClientError as exc:
            status = self._status(exc)
            if status == 412:
                self._already_there(key, manifest, is_manifest)
                return
            if status is not None and status >= 500:
                raise PublishOutcomeUnknown(
                    f"writing {where} answered {self._describe_error(exc)}: the object may or may not exist"
                ) from None
            raise DestinationError(f"the store refused {where}: {self._describe_error(exc)}") from None
        except errors.BotoCoreError as exc:
            if self._unreached(exc):
                raise DestinationError(f"cannot reach the store for {where}: {self._describe_error(exc)}") from None
            raise PublishOutcomeUnknown(
                f"writing {where} got no answer ({self._describe_error(exc)}): the object may or may not exist"
            ) from None

    def _already_there(self, key: str, manifest: Manifest, is_manifest: bool) -> None:
        """After a 412: the object exists. The same bytes (a resend that landed) are fine; anything else is not."""
        where = f"s3://{self.bucket}/{key}"
        found = self._get(key)
        if found is None:
            raise PublishOutcomeUnknown(f"{where} answered 412 but cannot be read back")
        payload, existing = found
        if is_manifest:
            try:
                other = Manifest.from_json(payload, where)
            except ManifestError as exc:
                raise DestinationConflict(f"{where} holds an unreadable manifest: {exc}") from None
            if other != manifest:
                raise PublishedElsewhere(f"{where} already holds a manifest (attempt {other.attempt_id})", other)
            return
        if existing.get("sha256") != manifest.sha256:
            manifest_found = self._get(key.rsplit("/", 1)[0] + "/" + MANIFEST_NAME)
            if manifest_found is not None:
                other = Manifest.from_json(manifest_found[0], where)
                raise PublishedElsewhere(f"{where} is already published (attempt {other.attempt_id})", other)
            raise DestinationConflict(
                f"{where} holds a data object with sha256 {existing.get('sha256', 'unknown')} and no manifest; "
                f"this attempt's data has sha256 {manifest.sha256}: refusing to overwrite it"
            )

    def discard(self, staged: StagedExport) -> None:
        try:
            os.unlink(staged.handle)
        except FileNotFoundError:
            pass

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        key = self._key(target, manifest.data_file)
        found = self._get(key)
        if found is None:
            raise DestinationError(f"s3://{self.bucket}/{key} is missing although its manifest exists")
        return found[0]
