"""What tests of restatements and their readers share: what an outside reader of a destination does (follow the
key's pointer ``_current.json`` to the place it names, read that manifest and the data file it names, check the
sha256), a restatement fenced while it reads its source, one killed right after publishing, and the environment of
the processes of the black-box tests. Plain functions and values; the ``local`` destination fixture is conftest's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from builders import ORDERS_DAY as DAY
from builders import ORDERS_SCHEMA as SCHEMA
from builders import corrected_orders as corrected
from builders import key_folder
from builders import orders_item as item
from pipeline_helpers import PROJECT, finish, materialize  # noqa: F401  (re-exported)

from export_ledger.destinations.base import ExportTarget, parse_place
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.destinations.s3 import S3Destination
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import ExportLedger
from export_ledger.protocol import ExportItem, export_key
from export_ledger.reconcile import reconcile_batch
from export_ledger.sources import CallableSource

UTC = dt.timezone.utc
EXPORT_LEDGER = str(Path(sys.executable).parent / "export-ledger")
PREFIX = "exports"
LEASE = dt.timedelta(minutes=15)

__all__ = [
    "DAY",
    "LEASE",
    "PREFIX",
    "SCHEMA",
    "corrected",
    "fenced_restatement",
    "item",
    "key_folder",
    "local_places",
    "local_reader_view",
    "restatement_dead_after_publishing",
    "s3_destination",
    "s3_folder",
    "s3_reader_view",
    "target_of",
    "third_version",
]


# -- destinations and what their readers see -------------------------------------------------------------------------


def s3_destination(bucket: str, endpoint_url: str, **options) -> S3Destination:
    options.setdefault("read_timeout_seconds", 3.0)
    return S3Destination(
        bucket=bucket,
        prefix=PREFIX,
        endpoint_url=endpoint_url,
        access_key_id="testing",
        secret_access_key="testing",
        **options,
    )


def target_of(key, revision: int = 1, place: str | None = None) -> ExportTarget:
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision, place)


def s3_folder(key) -> str:
    return f"{PREFIX}/{key.export}/tenant={key.tenant}/date={key.window.business_date.isoformat()}"


def _view(pointer: dict | None, read) -> dict:
    """What a reader gets from a key folder, given its pointer (None: no pointer object) and ``read(name)`` (bytes
    of an object of the folder, or None): docs/protocol.md, "What readers see" and "Legacy layout"."""
    if pointer is None:
        legacy = read(MANIFEST_NAME)
        if legacy is None:
            return {"revision": 0, "place": None, "manifest": False, "data": False, "intact": False}
        pointer = {"revision": Manifest.from_json(legacy, "legacy").revision, "path": "."}
    if not pointer.get("revision"):
        return {"revision": 0, "place": None, "manifest": False, "data": False, "intact": False}
    place = pointer["path"]
    base = "" if place == "." else f"{place}/"
    view = {"revision": pointer["revision"], "place": place, "fence": pointer.get("fence", 0)}
    raw = read(f"{base}{MANIFEST_NAME}")
    if raw is None:
        return {**view, "manifest": False, "data": False, "intact": False}
    manifest = Manifest.from_json(raw, place)
    data = read(f"{base}{manifest.data_file}")
    if data is None:
        return {**view, "manifest": True, "data": False, "intact": False, "rows": manifest.row_count}
    intact = hashlib.sha256(data).hexdigest() == manifest.sha256 == pointer.get("sha256", manifest.sha256)
    return {**view, "manifest": True, "data": True, "intact": intact, "rows": manifest.row_count}


def local_reader_view(root: Path, key) -> dict:
    """What an outside reader of a local destination sees for ``key``: revision, place, and whether the manifest and
    the data it names are there and match."""
    folder = key_folder(root, key)

    def read(name: str) -> bytes | None:
        path = folder / name
        return path.read_bytes() if path.is_file() else None

    raw = read(POINTER_NAME)
    return _view(json.loads(raw) if raw is not None else None, read)


def s3_reader_view(s3, bucket: str, key) -> dict:
    """The same as :func:`local_reader_view`, read straight from the S3 server (never through a proxy)."""
    folder = s3_folder(key)

    def read(name: str) -> bytes | None:
        try:
            return s3.get_object(Bucket=bucket, Key=f"{folder}/{name}")["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    raw = read(POINTER_NAME)
    return _view(json.loads(raw) if raw is not None else None, read)


def local_places(root: Path, key) -> dict[int, list[str]]:
    """Revision -> the places (``r<revision>-t<token>``) of it at the local destination, committed or not."""
    folder = key_folder(root, key)
    found: dict[int, list[str]] = {}
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        parsed = parse_place(entry.name) if entry.is_dir() else None
        if parsed is not None:
            found.setdefault(parsed[0], []).append(entry.name)
    return found


# -- sources and scenarios --------------------------------------------------------------------------------------------


def third_version(key) -> pd.DataFrame:
    """The source after a second correction: every amount changed again, and two rows fewer than ``corrected``."""
    frame = corrected(key).iloc[2:].reset_index(drop=True)
    frame["total"] = 7.0
    return frame


def restatement_dead_after_publishing(ledger: ExportLedger, destination, key, monkeypatch) -> None:
    """Revision 1 exported, a restatement requested, and its attempt killed right after committing revision 2: the
    pointer names revision 2, the ledger records revision 1 and the key is ``in_progress`` under the dead attempt."""
    export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    ledger.restatements.request(str(key), reason="late rows", requested_by="ops")
    monkeypatch.setenv(FAILPOINTS, "after_publish=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-2/export")
    monkeypatch.delenv(FAILPOINTS)


def fenced_restatement(ledger: ExportLedger, destination, clock, key) -> Exception | None:
    """Item 1's chain, first step: revision 1 is completed and a restatement is requested; the restatement's lease
    runs out while it reads its source (read after its claim and fence: the source is slow, the clock moves past the
    lease and the reconciliation sensor ticks meanwhile: it holds the key with a new token, fences the pointer, finds
    nothing of revision 2 and records ``failed``); the attempt then wakes with its stale token, stages revision 2 at
    its own place and tries to commit it. Returns what the attempt raised."""
    assert export_key(ledger, destination, SCHEMA, item(key), "run-1/export").status == "exported"
    ledger.restatements.request(str(key), reason="invoice amounts corrected", requested_by="ops")

    def slow_source(tenant, start, end):
        clock.advance(minutes=16)  # the lease (15 minutes) runs out while the source is read
        reconcile_batch(ledger, destination, limit=10, after=None, reconciler="reconciliation_sensor@tick")
        return corrected(key)

    restating = ExportItem.streamed(key, DAY.isoformat(), CallableSource(slow_source), SCHEMA)
    try:
        export_key(ledger, destination, SCHEMA, restating, "run-2/export")
    except Exception as exc:  # FencedOut: the pointer refused its commit, and the ledger its record
        return exc
    return None


# -- processes ------------------------------------------------------------------------------------------------------


def process_env(tmp_path: Path, home: str = "dagster_home", **extra: str) -> dict[str, str]:
    """The environment of a ``dagster`` or ``export-ledger`` process on the project's definitions in ``tmp_path``.

    Racing processes take separate ``home``s: two fresh SQLite Dagster instances created at once race on their own
    schema migration, which is Dagster's business, not the ledger's."""
    folder = tmp_path / home
    folder.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(folder),
        "EXPORTS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        "EXPORTS_DESTINATION": str(tmp_path / "exports"),
        "EXPORTS_TENANTS": "acme",
        "PYTHONPATH": str(PROJECT),
    }
    env.pop(FAILPOINTS, None)
    env.update(extra)
    return env


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")
