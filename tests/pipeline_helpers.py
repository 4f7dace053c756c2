"""Helpers for pipeline tests: build the project's definitions in a scratch folder and run partitions in process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from builders import open_ledger

from definitions import build_definitions
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import ExportLedger

JOB = "invoice_export_job"


def make_defs(
    tmp_path: Path, *, tenants: Sequence[str] = ("acme",), ledger=None, env: Mapping[str, str] | None = None, **kwargs
) -> dg.Definitions:
    """The reference location on the sample source; ``env``: further settings the location loads with."""
    kwargs.setdefault("timezone", "America/New_York")
    kwargs.setdefault("start_date", "2026-01-01")
    kwargs.setdefault("destination", str(tmp_path / "exports"))
    if ledger is None:
        kwargs.setdefault("ledger_url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    environ = {"EXPORTS_SOURCE": "sample", **(env or {})}
    return build_definitions(tenants=list(tenants), ledger=ledger, environ=environ, **kwargs)


def run_partition(defs: dg.Definitions, instance: dg.DagsterInstance, partition_key: str) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def(JOB).execute_in_process(
        partition_key=partition_key, instance=instance, raise_on_error=False
    )


def run_range(defs: dg.Definitions, instance: dg.DagsterInstance, first: str, last: str) -> dg.ExecuteInProcessResult:
    """One run over a partition range, as a single-run backfill launches it."""
    return defs.resolve_job_def(JOB).execute_in_process(
        instance=instance,
        raise_on_error=False,
        tags={"dagster/asset_partition_range_start": first, "dagster/asset_partition_range_end": last},
    )


def failure_message(result: dg.ExecuteInProcessResult) -> str:
    """Every step failure's message and cause, joined: what an operator reads in the UI."""
    parts = []
    for event in result.all_events:
        if event.is_step_failure:
            error = event.step_failure_data.error
            while error is not None:
                parts.append(error.message)
                error = error.cause
    return "\n".join(parts)


def _pointer(folder: Path) -> dict | None:
    """The key folder's pointer (``_current.json``) as JSON, or None when it has none."""
    path = folder / POINTER_NAME
    return json.loads(path.read_bytes()) if path.is_file() else None


def _current_place(folder: Path) -> Path | None:
    """The place readers of a key folder see (docs/protocol.md): the one its pointer names, or the folder itself for
    a legacy revision 1 (no pointer, a manifest of its own); None when nothing is published."""
    pointer = _pointer(folder)
    if pointer is None:
        return folder if (folder / MANIFEST_NAME).is_file() else None
    if not pointer.get("revision"):
        return None
    return folder if pointer["path"] == "." else folder / pointer["path"]


def key_folders(root: Path) -> list[Path]:
    """Every key folder (``<export>/tenant=<t>/date=<d>``) under ``root`` holding anything: a pointer or a place."""
    return sorted({p.parent for p in root.rglob("date=*/*")} if root.exists() else set())


def published_dirs(root: Path) -> list[Path]:
    """The key folders whose pointer names a published revision: what readers see. A place no pointer names (staged
    by an attempt that never committed) is invisible, so its folder is not listed."""
    return [folder for folder in key_folders(root) if _current_place(folder) is not None]


def places(root: Path) -> list[Path]:
    """Every place (``r<revision>-t<token>`` folder) under ``root``, named by a pointer or not."""
    return sorted(p for p in root.rglob("date=*/r*-t*") if p.is_dir()) if root.exists() else []


def current_data_file(folder: Path) -> Path:
    """The data file readers of a key folder get (the one its pointer names)."""
    place = _current_place(folder)
    assert place is not None, f"{folder}: nothing is published"
    return place / Manifest.from_json((place / MANIFEST_NAME).read_bytes(), str(place)).data_file


def stored_objects(root: Path) -> list[str]:
    """Every object (file) a local destination holds under ``root``, temporary files included, relative to ``root``;
    the store's own locks (``.export-ledger/``) are not objects."""
    if not root.exists():
        return []
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".export-ledger" not in p.parts
    )


def read_export(folder: Path) -> tuple[Manifest, pd.DataFrame]:
    """What a reader of the key folder gets: the pointer's place, its manifest and data file (checked against the
    manifest's and the pointer's sha256)."""
    place = _current_place(folder)
    assert place is not None, f"{folder}: nothing is published"
    manifest = Manifest.from_json((place / MANIFEST_NAME).read_bytes(), str(place))
    payload = (place / manifest.data_file).read_bytes()
    assert hashlib.sha256(payload).hexdigest() == manifest.sha256, f"{place}: data file does not match its manifest"
    pointer = _pointer(folder)
    if pointer is not None:
        assert pointer["sha256"] == manifest.sha256, f"{folder}: the pointer's sha256 is not its manifest's"
    if manifest.data_file.endswith(".parquet"):
        frame = pd.read_parquet(place / manifest.data_file)
    else:
        frame = pd.read_csv(place / manifest.data_file)
        if "occurred_at" in frame.columns:  # the invoice export's time column
            frame["occurred_at"] = pd.to_datetime(frame["occurred_at"], utc=True)
    return manifest, frame


def ledger_at(tmp_path: Path) -> ExportLedger:
    return open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")


def completed_without_export(ledger: ExportLedger) -> list[str]:
    """Keys the ledger calls completed whose export is not what readers see (the key folder's pointer does not name
    the recorded place, or the manifest there is missing or different): must always be empty."""
    bad = []
    for record in ledger.queries.records():
        if record.state.value != "completed":
            continue
        recorded = Path(record.location)
        manifest_path = recorded / MANIFEST_NAME
        folder = recorded if recorded.name.startswith("date=") else recorded.parent  # a legacy revision 1 is at "."
        if not manifest_path.is_file() or _current_place(folder) != recorded:
            bad.append(record.logical_key)
            continue
        manifest = Manifest.from_json(manifest_path.read_bytes(), str(manifest_path))
        if manifest.sha256 != record.sha256 or manifest.logical_key != record.logical_key:
            bad.append(record.logical_key)
    return bad


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Tick:
    """One evaluated tick: the sensor's result and what it logged."""

    result: dg.SensorResult
    logs: list[logging.LogRecord] = field(default_factory=list)

    @property
    def cursor(self) -> str | None:
        return self.result.cursor

    @property
    def skip_message(self) -> str:
        return self.result.skip_reason.skip_message if self.result.skip_reason else ""

    @property
    def materializations(self) -> list[dg.AssetMaterialization]:
        return [e for e in self.result.asset_events if isinstance(e, dg.AssetMaterialization)]

    @property
    def check_evaluations(self) -> list[dg.AssetCheckEvaluation]:
        return [e for e in self.result.asset_events if isinstance(e, dg.AssetCheckEvaluation)]

    def errors(self) -> list[str]:
        return [r.getMessage() for r in self.logs if r.levelno >= logging.ERROR]


def tick(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    cursor: str | None = None,
    *,
    sensor_name: str = "reconciliation_sensor",
) -> Tick:
    """Evaluates a sensor (default the reconciliation sensor) once and records its asset events in the instance, as
    the daemon does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # get_sensor_def's notice about unresolved resources
        sensor = defs.get_sensor_def(sensor_name)
    recorder = _Recorder()
    # Only the resources the sensor requires, as the code server builds them for a tick: another export's resource
    # that cannot be built in this process (an unset EnvVar) does not concern this sensor.
    resources = {key: value for key, value in (defs.resources or {}).items() if key in sensor.required_resource_keys}
    with dg.build_sensor_context(instance=instance, resources=resources, definitions=defs, cursor=cursor) as context:
        context.log.addHandler(recorder)
        result = sensor(context)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return Tick(result, recorder.records)


PROJECT = Path(__file__).resolve().parent.parent
DAGSTER = str(Path(sys.executable).parent / "dagster")


def materialize(env: dict[str, str], partition: str = "2026-03-08", select: str = "invoice_export") -> subprocess.Popen:
    """``dagster asset materialize`` of the reference code location, as a process group of its own."""
    return subprocess.Popen(
        [DAGSTER, "asset", "materialize", "-f", "definitions.py", "--select", select, "--partition", partition],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """The process's exit code and output; its whole group killed, and the test failed, past ``timeout``."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"process did not finish in {timeout}s:\n{output[-3000:]}")
    return process.returncode, output


def key_rows(metadata) -> list[dict]:
    """The per-key table of a partition's materialization (``key_table``), one dict per listed key."""
    return [dict(record.data) for record in metadata["key_table"].value.records]


def check_evaluations(result, check_name: str) -> dict[str | None, object]:
    """A run's evaluations of one check, by partition."""
    return {e.partition: e for e in result.get_asset_check_evaluations() if e.check_name == check_name}
