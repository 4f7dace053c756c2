"""An S3-compatible object store as an export destination (optional extra ``[s3]``: boto3).

Same layout and manifest as the local destination: ``<prefix>/<export>/tenant=<tenant>/date=<YYYY-MM-DD>/`` holding
``_manifest.json`` and the data object it names. Each attempt writes its data under a name of its own
(``data-t<token>-<attempt hash>.csv``), then the manifest: the manifest's conditional create (``If-None-Match: *``) is
the one step that decides which data object is the export, so the store itself refuses a second export. A data object
no manifest names is an orphan of a failed or fenced attempt: harmless to readers (they read what the manifest names),
never in the way of a retry (which writes its own name), and swept by a later attempt once older than a lease.
Object metadata carries the logical key, attempt id, fencing token and sha256. Before its first publish the
destination checks that the store honours conditional creates, and refuses a store that does not.

What a failed write means is classified, because a database transaction cannot commit a remote upload:

* refused before anything was sent (connection refused, connect timeout, a 4xx other than 412): nothing was
  written, the attempt failed, a retry is safe;
* sent but unanswered (read timeout, connection cut before the response, a 5xx): the object may or may not exist,
  so the outcome is unknown and only reconciliation, reading the store, may decide;
* 412 Precondition Failed: something is already there; it is read and compared, never overwritten.

A restatement's revision N is published the same way at ``.../date=<YYYY-MM-DD>/revision=<N>/``, beside the revisions
before it (revision 1 stays at the key's folder, where every first export is). The key's current pointer is the object
``.../date=<YYYY-MM-DD>/_current.json`` (absent: revision 1 is current), moved by a compare-and-swap the store itself
decides: the pointer is read with its ETag and rewritten with ``If-Match: <etag>`` (or ``If-None-Match: *`` when
absent), so a lost update answers 412 and is refused. Before its first pointer move the destination checks that the
store honours ``If-Match`` on writes, and refuses a store that does not.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from export_ledger.destinations.base import (
    CURRENT_NAME,
    DestinationConflict,
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    PointerMoved,
    PublishedElsewhere,
    PublishingDestination,
    PublishOutcomeUnknown,
    StagedExport,
    pointer_payload,
    pointer_revision,
)
from export_ledger.frames import MANIFEST_NAME, Manifest, ManifestError, write_rows


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


_CONDITIONAL_CREATES_CHECKED: set[tuple[str | None, str]] = set()
_CONDITIONAL_UPDATES_CHECKED: set[tuple[str | None, str]] = set()
#: An ETag no object has (S3 ETags are quoted hex digests): an ``If-Match`` on it must be refused with 412.
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'


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

    def _key_folder(self, target: ExportTarget) -> str:
        """The key's folder: revision 1's place, and where the key's current pointer lives."""
        parts = [p for p in (self.prefix.strip("/"), *target.parts) if p]
        return "/".join(parts)

    def _folder(self, target: ExportTarget) -> str:
        """The revision's folder: the key's for revision 1, ``<key's>/revision=<N>`` for a restatement's."""
        folder = self._key_folder(target)
        return folder if target.revision_part is None else f"{folder}/{target.revision_part}"

    def _pointer_key(self, target: ExportTarget) -> str:
        return f"{self._key_folder(target)}/{CURRENT_NAME}"

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
        found = self._get_tagged(key)
        return None if found is None else (found[0], found[1])

    def _get_tagged(self, key: str) -> tuple[bytes, dict, str] | None:
        """An object's bytes, metadata and ETag (as the store quotes it), None when absent; raises
        DestinationUnreachable when it cannot tell."""
        _, _, errors = _boto()
        try:
            response = self._s3().get_object(Bucket=self.bucket, Key=key)
            return response["Body"].read(), response.get("Metadata", {}), response["ETag"]
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

    def data_name(self, manifest: Manifest, file_format: str) -> str:
        """The data object's name for this attempt: never the name another attempt writes."""
        attempt = hashlib.sha256(manifest.attempt_id.encode()).hexdigest()[:12]
        return f"data-t{manifest.fencing_token}-{attempt}.{file_format}"

    def stage(self, target: ExportTarget, table, file_format: str, manifest: Manifest) -> StagedExport:
        # Staging is a local file, so the checksum is known before anything is sent. It holds customer data: it lives
        # in a private folder, and files of processes that died before cleaning up are removed here.
        folder = _staging_folder()
        _sweep_dead_staging(folder)
        handle, path = tempfile.mkstemp(prefix=f"{os.getpid()}-", suffix=f".{file_format}", dir=folder)
        try:
            with os.fdopen(handle, "wb") as sink:
                sha256, row_count = write_rows(table, file_format, sink)
        except BaseException:
            os.unlink(path)
            raise
        complete = Manifest(
            **{
                **manifest.__dict__,
                "sha256": sha256,
                "row_count": row_count,
                "data_file": self.data_name(manifest, file_format),
            }
        )
        return StagedExport(target, complete, path)

    def check_conditional_creates(self) -> None:
        """Refuses a store that ignores ``If-None-Match: *``: there, a second write would replace an export silently.

        Checked once per process and store, with a probe object written twice and then deleted.
        """
        where = (self.endpoint_url, self.bucket)
        if where in _CONDITIONAL_CREATES_CHECKED:
            return
        _, _, errors = _boto()
        client = self._s3()
        try:
            key = self._probe_key()
            client.put_object(Bucket=self.bucket, Key=key, Body=b"1", IfNoneMatch="*")
            try:
                client.put_object(Bucket=self.bucket, Key=key, Body=b"2", IfNoneMatch="*")
            except errors.ClientError as exc:
                if self._status(exc) != 412:
                    raise
            else:
                raise DestinationError(
                    f"s3://{self.bucket} accepted a second conditional create (If-None-Match: *) of one object: this "
                    "store ignores conditional writes, so a retry could overwrite a published export silently. "
                    "Refusing to publish to it"
                )
            finally:
                client.delete_object(Bucket=self.bucket, Key=key)
        except errors.ClientError as exc:
            status = self._status(exc)
            refused = "the store refused" if status is not None and 400 <= status < 500 else "cannot check"
            raise DestinationError(
                f"{refused} the check that s3://{self.bucket} honours conditional creates: {self._describe_error(exc)}"
            ) from None
        except errors.BotoCoreError as exc:
            raise DestinationError(
                f"cannot check that s3://{self.bucket} honours conditional creates: {self._describe_error(exc)}"
            ) from None
        _CONDITIONAL_CREATES_CHECKED.add(where)

    def _probe_key(self) -> str:
        """A fresh probe object's key, after removing probes older than an hour (of processes killed mid-check)."""
        folder = f"{self.prefix.strip('/') + '/' if self.prefix.strip('/') else ''}.export-ledger-probe/"
        client = self._s3()
        stale = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
        for item in client.list_objects_v2(Bucket=self.bucket, Prefix=folder).get("Contents", []):
            if item["LastModified"] < stale:
                client.delete_object(Bucket=self.bucket, Key=item["Key"])
        return f"{folder}{uuid.uuid4().hex}"

    def check_conditional_updates(self) -> None:
        """Refuses a store that ignores ``If-Match`` on writes: there, two restatements could both move a key's current
        pointer and one would be lost silently. Checked once per process and store, before the first pointer move, with
        a probe object rewritten on a wrong ETag (must answer 412) and on its own (must succeed), then deleted.
        """
        where = (self.endpoint_url, self.bucket)
        if where in _CONDITIONAL_UPDATES_CHECKED:
            return
        _, _, errors = _boto()
        client = self._s3()
        try:
            key = self._probe_key()
            etag = client.put_object(Bucket=self.bucket, Key=key, Body=b"1", IfNoneMatch="*")["ETag"]
            try:
                try:
                    client.put_object(Bucket=self.bucket, Key=key, Body=b"2", IfMatch=_NO_SUCH_ETAG)
                except errors.ClientError as exc:
                    if self._status(exc) != 412:
                        raise
                else:
                    raise DestinationError(
                        f"s3://{self.bucket} accepted a write conditional on an ETag the object does not have "
                        "(If-Match): this store ignores conditional updates, so two restatements could both move a "
                        "key's current pointer and one would be lost silently. Refusing to move pointers on it"
                    )
                client.put_object(Bucket=self.bucket, Key=key, Body=b"3", IfMatch=etag)
            finally:
                client.delete_object(Bucket=self.bucket, Key=key)
        except errors.ClientError as exc:
            status = self._status(exc)
            refused = "the store refused" if status is not None and 400 <= status < 500 else "cannot check"
            raise DestinationError(
                f"{refused} the check that s3://{self.bucket} honours conditional updates (If-Match): "
                f"{self._describe_error(exc)}"
            ) from None
        except errors.BotoCoreError as exc:
            raise DestinationError(
                f"cannot check that s3://{self.bucket} honours conditional updates (If-Match): "
                f"{self._describe_error(exc)}"
            ) from None
        _CONDITIONAL_UPDATES_CHECKED.add(where)

    def publish(self, staged: StagedExport) -> Manifest:
        self.check_conditional_creates()
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
            # The name is this attempt's own: only this attempt (same token, same id) writes it.
            raise DestinationConflict(
                f"{where} holds a data object with sha256 {existing.get('sha256', 'unknown')}; this attempt's data "
                f"has sha256 {manifest.sha256}: refusing to overwrite it"
            )

    def discard(self, staged: StagedExport) -> None:
        try:
            os.unlink(staged.handle)
        except FileNotFoundError:
            pass

    def _list(self, target: ExportTarget) -> list[dict]:
        """The revision's own objects: directly in its folder (``Delimiter="/"``), so never a later revision's
        ``revision=<N>/`` objects, and never the key's current pointer (which belongs to the key, not to revision 1)."""
        _, _, errors = _boto()
        folder = self._folder(target) + "/"
        pointer = self._pointer_key(target)
        try:
            pages = (
                self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder, Delimiter="/")
            )
            return [item for page in pages for item in page.get("Contents", []) if item["Key"] != pointer]
        except errors.ClientError as exc:
            status = self._status(exc)
            if status is not None and 400 <= status < 500:
                raise DestinationError(
                    f"the store refused listing {self.location(target)}: {self._describe_error(exc)}"
                ) from None
            raise DestinationUnreachable(f"cannot list {self.location(target)}: {self._describe_error(exc)}") from None
        except errors.BotoCoreError as exc:
            raise DestinationUnreachable(f"cannot list {self.location(target)}: {self._describe_error(exc)}") from None

    def discard_abandoned(
        self, target: ExportTarget, below_token: int, *, min_age: dt.timedelta = dt.timedelta(0)
    ) -> int:
        """Deletes data objects that no manifest names, written by attempts with a lower token, older than
        ``min_age`` (a lease: their writers cannot hold the key any more). Returns how many."""
        if below_token <= 1:
            return 0  # a first claim: no earlier attempt can have left anything (and no request is spent asking)
        manifest = self.probe(target)
        referenced = manifest.data_file if manifest is not None else None
        now = dt.datetime.now(dt.timezone.utc)
        removed = 0
        for item in self._list(target):
            name = item["Key"].rsplit("/", 1)[1]
            token_text = name.removeprefix("data-t").split("-", 1)[0]
            if not name.startswith("data-t") or not token_text.isdigit() or name == referenced:
                continue
            if int(token_text) >= below_token or now - item["LastModified"] < min_age:
                continue
            self._s3().delete_object(Bucket=self.bucket, Key=item["Key"])
            removed += 1
        return removed

    def discard_target(self, target: ExportTarget) -> list[str]:
        """Deletes the objects of the target's revision (the manifest first, so readers never see a manifest without
        its data); returns the names deleted. For an operator's ``export-ledger resolve --discard-destination``.

        Only that revision's own objects: discarding revision 1 leaves every ``revision=<N>/`` and the key's current
        pointer alone. A revision the pointer names is refused (readers would follow the pointer to nothing): the
        pointer never moves back, so a current revision stays until a later one supersedes it.

        Raises:
            DestinationError: the target's revision is the current one of a restated key; nothing is deleted.
        """
        if target.revision >= 2 and self.current(target) == target.revision:
            raise DestinationError(
                f"{self.location(target)} is revision {target.revision}, the key's current one "
                f"(s3://{self.bucket}/{self._pointer_key(target)}): not discarded"
            )
        items = sorted(self._list(target), key=lambda item: not item["Key"].endswith(MANIFEST_NAME))
        for item in items:
            self._s3().delete_object(Bucket=self.bucket, Key=item["Key"])
        return [item["Key"].rsplit("/", 1)[1] for item in items]

    def current(self, target: ExportTarget) -> int:
        key = self._pointer_key(target)
        found = self._get(key)
        return 1 if found is None else pointer_revision(found[0], f"s3://{self.bucket}/{key}")

    def move_current(self, target: ExportTarget, manifest: Manifest, *, supersedes: int) -> None:
        """Moves the key's pointer with a compare-and-swap the store decides (see the module's docstring)."""
        self.check_conditional_updates()
        _, _, errors = _boto()
        key = self._pointer_key(target)
        where = f"s3://{self.bucket}/{key}"
        found = self._get_tagged(key)
        now = 1 if found is None else pointer_revision(found[0], where)
        if now == target.revision:
            return  # an earlier attempt moved it and died before recording: nothing to do
        if now != supersedes:
            raise self._moved(where, now, target, supersedes)
        # Absent: only a create may succeed. Present: only a write over the very object read.
        condition = {"IfNoneMatch": "*"} if found is None else {"IfMatch": found[2]}
        try:
            self._s3().put_object(
                Bucket=self.bucket,
                Key=key,
                Body=pointer_payload(target, manifest),
                ContentType="application/json",
                **condition,
            )
            return
        except errors.ClientError as exc:
            status = self._status(exc)
            # 412: the pointer changed since it was read (404: deleted; 409: a concurrent conditional write won).
            if status in (404, 409, 412):
                after = self.current(target)
                if after == target.revision:
                    return  # moved by another attempt at the same revision (or by this one's lost resend)
                if after == supersedes and status == 409:
                    raise DestinationError(
                        f"moving {where} met a concurrent write ({self._describe_error(exc)}); it still points at "
                        f"revision {supersedes}"
                    ) from None
                raise self._moved(where, after, target, supersedes) from None
            if status is not None and status >= 500:
                raise PublishOutcomeUnknown(
                    f"moving {where} to revision {target.revision} answered {self._describe_error(exc)}: it may or "
                    "may not have moved"
                ) from None
            raise DestinationError(f"the store refused moving {where}: {self._describe_error(exc)}") from None
        except errors.BotoCoreError as exc:
            if self._unreached(exc):
                raise DestinationError(f"cannot reach the store to move {where}: {self._describe_error(exc)}") from None
            raise PublishOutcomeUnknown(
                f"moving {where} to revision {target.revision} got no answer ({self._describe_error(exc)}): it may or "
                "may not have moved"
            ) from None

    @staticmethod
    def _moved(where: str, now: int, target: ExportTarget, supersedes: int) -> PointerMoved:
        return PointerMoved(
            f"{where} points at revision {now}, not at revision {supersedes} which revision {target.revision} "
            "supersedes; it is not moved"
        )

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        key = self._key(target, manifest.data_file)
        found = self._get(key)
        if found is None:
            raise DestinationError(f"s3://{self.bucket}/{key} is missing although its manifest exists")
        return found[0]
