"""Helpers for pipeline tests: build the project's definitions in a scratch folder and run partitions in process."""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import pandas as pd

from definitions import build_definitions
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import ExportLedger

JOB = "invoice_export_job"


def make_defs(tmp_path: Path, *, tenants: Sequence[str] = ("acme",), ledger=None, **kwargs) -> dg.Definitions:
    kwargs.setdefault("timezone", "America/New_York")
    kwargs.setdefault("start_date", "2026-01-01")
    kwargs.setdefault("destination", str(tmp_path / "exports"))
    if ledger is None:
        kwargs.setdefault("ledger_url", f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    return build_definitions(tenants=list(tenants), ledger=ledger, environ={}, **kwargs)


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


def published_dirs(root: Path) -> list[Path]:
    """Committed export folders (``date=...`` holding a manifest); staging folders are not published."""
    return sorted(p.parent for p in root.rglob(MANIFEST_NAME) if not p.parent.name.startswith("."))


def read_export(folder: Path) -> tuple[Manifest, pd.DataFrame]:
    manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes(), str(folder))
    payload = (folder / manifest.data_file).read_bytes()
    assert hashlib.sha256(payload).hexdigest() == manifest.sha256, f"{folder}: data file does not match its manifest"
    if manifest.data_file.endswith(".parquet"):
        frame = pd.read_parquet(folder / manifest.data_file)
    else:
        frame = pd.read_csv(folder / manifest.data_file)
        frame["occurred_at"] = pd.to_datetime(frame["occurred_at"], utc=True)
    return manifest, frame


def ledger_at(tmp_path: Path) -> ExportLedger:
    return ExportLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")


def completed_without_export(ledger: ExportLedger) -> list[str]:
    """Keys the ledger calls completed whose published export is missing or different: must always be empty."""
    bad = []
    for record in ledger.records():
        if record.state.value != "completed":
            continue
        manifest_path = Path(record.location) / MANIFEST_NAME
        if not manifest_path.is_file():
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
    with dg.build_sensor_context(
        instance=instance, resources=defs.resources, definitions=defs, cursor=cursor
    ) as context:
        context.log.addHandler(recorder)
        result = sensor(context)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return Tick(result, recorder.records)
