"""What an outside reader of an object store sees, with the store's own client (boto3, google-cloud-storage,
azure-storage-blob), never through a destination: every object under a prefix, and an object's version.

Tests that check a destination's layout on S3, GCS and Azure Blob build one :class:`Bucket` per kind with
:func:`bucket_for`, next to the destination under test (:func:`object_destination`), so the same assertions run on
each store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("s3", "gcs", "azure")


@dataclass
class Bucket:
    """One bucket (container) read with its store's client: ``scheme`` is how the destination's locations begin."""

    kind: str
    name: str
    client: Any
    root: str = ""  # sftp: the folder the names are relative to (``name`` is ``host:port<root>``)

    @property
    def scheme(self) -> str:
        return {"s3": "s3", "gcs": "gs", "azure": "az", "sftp": "sftp"}[self.kind]

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Object name (relative to ``prefix``) -> bytes, for everything under ``prefix``."""
        if self.kind == "s3":
            listing = self.client.list_objects_v2(Bucket=self.name, Prefix=prefix).get("Contents", [])
            names = [item["Key"] for item in listing]
            return {n[len(prefix) :]: self.client.get_object(Bucket=self.name, Key=n)["Body"].read() for n in names}
        if self.kind == "sftp":
            return sftp_objects(self.client, f"{self.root}/{prefix}")
        if self.kind == "gcs":
            blobs = list(self.client.list_blobs(self.name, prefix=prefix))
            return {blob.name[len(prefix) :]: blob.download_as_bytes() for blob in blobs}
        container = self.client.get_container_client(self.name)
        return {
            blob.name[len(prefix) :]: container.download_blob(blob.name).readall()
            for blob in container.list_blobs(name_starts_with=prefix)
        }

    def version(self, name: str) -> tuple:
        """What changes whenever the object is written, even with the same bytes (ETag and time; generation)."""
        if self.kind == "s3":
            head = self.client.head_object(Bucket=self.name, Key=name)
            return head["ETag"], head["LastModified"]
        if self.kind == "sftp":
            folder, _, last = f"{self.root}/{name}".rpartition("/")
            if last == "_current.json":  # the pointer: its highest pointer object (what a reader follows)
                number = max(int(n[:-5]) for n in self.client.listdir(f"{folder}/_pointers") if n[:-5].isdigit())
                name = f"{name[: -len(last)]}_pointers/{number:012d}.json"
            found = self.client.stat(f"{self.root}/{name}")
            return name, found.st_mtime, found.st_size
        if self.kind == "gcs":
            blob = self.client.bucket(self.name).get_blob(name)
            return blob.generation, blob.metageneration, blob.updated
        properties = self.client.get_blob_client(self.name, name).get_blob_properties()
        return properties.etag, properties.last_modified

    def put(self, name: str, data: bytes) -> None:
        """Writes ``name`` unconditionally, as another party's client would."""
        if self.kind == "s3":
            self.client.put_object(Bucket=self.name, Key=name, Body=data)
        elif self.kind == "gcs":
            self.client.bucket(self.name).blob(name).upload_from_string(data)
        else:
            self.client.get_blob_client(self.name, name).upload_blob(data, overwrite=True)


def bucket_for(kind: str, request) -> Bucket:
    """The test's bucket of ``kind`` (the ``s3_bucket``, ``gcs_bucket`` or ``azure_container`` fixture), read
    straight on its server."""
    if kind == "s3":
        return Bucket(kind, request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3"))
    if kind == "gcs":
        from cloud_fixtures import _gcs_client

        return Bucket(kind, request.getfixturevalue("gcs_bucket"), _gcs_client(request.getfixturevalue("gcs_server")))
    if kind == "azure":
        from azure.storage.blob import BlobServiceClient
        from cloud_fixtures import AZURITE_ACCOUNT, AZURITE_KEY

        service = BlobServiceClient(
            request.getfixturevalue("azurite_server"),
            credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY},
        )
        request.addfinalizer(service.close)
        return Bucket(kind, request.getfixturevalue("azure_container"), service)
    if kind == "sftp":
        server = request.getfixturevalue("sftp_server")
        root = request.getfixturevalue("sftp_folder")
        client = sftp_client(server)
        request.addfinalizer(client.close)
        return Bucket(kind, f"127.0.0.1:{server.port}{root}", client, root)
    raise AssertionError(f"no bucket of kind {kind!r}")


def sftp_client(server):
    """A partner's own paramiko session to the test's SFTP server (host key checked against its known_hosts)."""
    import paramiko

    ssh = paramiko.SSHClient()
    ssh.load_host_keys(server.known_hosts)
    ssh.set_missing_host_key_policy(paramiko.RejectPolicy())
    ssh.connect("127.0.0.1", server.port, server.user, key_filename=server.key_file, allow_agent=False,
                look_for_keys=False)  # fmt: skip
    sftp = ssh.open_sftp()
    sftp.close = ssh.close  # closing the session closes its connection
    return sftp


def sftp_objects(sftp, folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` (name relative to it -> bytes), read as a partner reads an SFTP destination: a
    key's ``_pointers/`` folder is shown as the one ``_current.json`` its highest pointer object is
    (docs/destinations.md, "SFTP"); temporary files are no objects."""
    import stat

    found: dict[str, bytes] = {}

    def walk(path: str, relative: str) -> None:
        try:
            entries = sftp.listdir_attr(path)
        except FileNotFoundError:
            return
        numbered = sorted(int(e.filename[:-5]) for e in entries if e.filename[:-5].isdigit()) if (
            path.endswith("/_pointers")) else None  # fmt: skip
        if numbered is not None:
            if numbered:
                with sftp.open(f"{path}/{numbered[-1]:012d}.json") as handle:
                    found[relative.removesuffix("_pointers/") + "_current.json"] = handle.read()
            return
        for entry in entries:
            if stat.S_ISDIR(entry.st_mode):
                walk(f"{path}/{entry.filename}", f"{relative}{entry.filename}/")
            elif not entry.filename.startswith(".tmp-"):
                with sftp.open(f"{path}/{entry.filename}") as handle:
                    found[relative + entry.filename] = handle.read()

    walk(folder.rstrip("/"), "")
    return found


def object_destination(kind: str, request, prefix: str, endpoint_url: str | None = None):
    """A destination of ``kind`` on the test's bucket, under ``prefix``; ``endpoint_url`` (a proxy in front of the
    store) instead of the store's own where given."""
    if kind == "s3":
        from export_ledger.destinations.s3 import S3Destination

        return S3Destination(
            bucket=request.getfixturevalue("s3_bucket"), prefix=prefix,
            endpoint_url=endpoint_url or request.getfixturevalue("s3_server"), access_key_id="testing",
            secret_access_key="testing", read_timeout_seconds=3.0,
        )  # fmt: skip
    if kind == "gcs":
        from export_ledger.destinations.gcs import GCSDestination

        return GCSDestination(
            bucket=request.getfixturevalue("gcs_bucket"), prefix=prefix,
            gcs_endpoint_url=endpoint_url or request.getfixturevalue("gcs_server"), read_timeout_seconds=3.0,
        )  # fmt: skip
    if kind == "azure":
        from cloud_fixtures import AZURITE_ACCOUNT, AZURITE_KEY

        from export_ledger.destinations.azure import AzureDestination

        return AzureDestination(
            container=request.getfixturevalue("azure_container"), prefix=prefix,
            azure_endpoint_url=endpoint_url or request.getfixturevalue("azurite_server"),
            azure_account_name=AZURITE_ACCOUNT, azure_account_key=AZURITE_KEY, read_timeout_seconds=3.0,
        )  # fmt: skip
    if kind == "sftp":
        server = request.getfixturevalue("sftp_server")
        folder = f"{request.getfixturevalue('sftp_folder')}/{prefix}".rstrip("/")
        return server.destination(folder, port=int(endpoint_url.rsplit(":", 1)[1]) if endpoint_url else None)
    raise AssertionError(f"no object-store destination of kind {kind!r}")


def delta_destination(request, tmp_path, on_s3: bool = False):
    """A Delta destination, one table per export: under ``tmp_path``, or on the test's moto bucket."""
    from export_ledger.destinations.delta import DeltaDestination

    if not on_s3:
        return DeltaDestination(table=str(tmp_path / "tables" / "{export}"))
    bucket = request.getfixturevalue("s3_bucket")
    return DeltaDestination(
        table=f"s3://{bucket}/tables/{{export}}", endpoint_url=request.getfixturevalue(
            "s3_server"), access_key_id="testing", secret_access_key="testing",
    )  # fmt: skip
