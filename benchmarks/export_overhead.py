"""Benchmark 1: one partition exported through the ledgered path against plain writes of the same frame.

Variants, interleaved on the same frame and the same disk:

* ``ledgered``: the I/O manager's ``handle_output`` for one logical key (docs/protocol.md): claim, read the key's
  pointer, validate, write the data file at the attempt's own place with streaming SHA-256 and fsync, create the
  manifest beside it, commit the pointer (compare-and-swap, fsync), ledger commit.
* ``pandas`` (baseline a): what a plain cron script does, ``DataFrame.to_csv`` / ``to_parquet`` and one fsync.
* ``arrow`` (baseline b): the fastest plain write of the format found here: ``pa.Table.from_pandas`` and
  pyarrow's CSV or Parquet writer, to a Python file or to pyarrow's native file, and one fsync. Baseline (b) is
  the fastest median of every plain variant (for Parquet, pandas' ``to_parquet`` is pyarrow too and can win).

* ``dlt`` (a peer, when ``dlt`` is installed: ``pip install -e ".[bench]"``): what a user would pick instead, dlt's
  ``filesystem`` destination on a local folder with compression off and telemetry off, loading the same frame into one
  table in the same format: one pipeline, a new load per repetition (its first, untimed, is the warm-up). What
  differs in durability: dlt writes its files and load packages without fsync (and writes each file twice: in its
  working folder, then copied to the destination), and records no ledger; the export fsyncs its data file, manifest,
  pointer and folders and commits its ledger row (SQLite, synchronous=FULL). Parquet keeps Snappy in every variant.

Beside them, the raw disk floor: bytes written divided by the sequential write bandwidth measured in the same run.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import shutil
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from assets.invoices import INVOICE_SCHEMA
from benchmarks.common import Settings, fsync_file, interleaved, median, scratch_dir, target
from export_ledger.calendar import ExportWindow, window_for
from export_ledger.dagster import DestinationResource, LedgeredExportIOManager, LedgerResource
from export_ledger.fingerprint import Fingerprint
from export_ledger.frames import validate_frame
from export_ledger.keys import LogicalKey
from export_ledger.ledger import CompletionEvidence, ExportLedger, dispose_engines
from export_ledger.protocol import ExportBatch, ExportItem, target_for
from export_ledger.stage import Stager

NAME = "export_overhead"
FORMATS = ("csv", "parquet")
BUSINESS_DATE = dt.date(2026, 3, 10)
TIMEZONE = "America/New_York"
_CURRENCIES = np.array(["USD", "EUR", "GBP", "CAD"], dtype=object)


# Issue #28's limits at 1M rows: the ledgered export against the fastest plain write of the same format (pyarrow's
# writer and one fsync), and against dlt's filesystem destination (at most its time).
OVERHEAD_LIMITS = {"csv": 1.10, "parquet": 1.30}
DLT_LIMIT = 1.0


def invoice_frame(rows: int, window: ExportWindow, tenant: str = "acme") -> pd.DataFrame:
    """``rows`` invoices spread evenly over ``window``, built like the sample source's frames (same dtypes)."""
    k = np.arange(rows, dtype=np.int64)
    start_us = int(window.start_utc.timestamp() * 1_000_000)
    span_us = int(window.duration.total_seconds() * 1_000_000)
    mixed = (k * 2654435761 + 12345) % 1_000_003
    return pd.DataFrame(
        {
            "invoice_id": (tenant + "-" + pd.Series(k, dtype="int64").astype(str).str.zfill(12)).astype(object),
            "tenant": np.full(rows, tenant, dtype=object),
            "occurred_at": pd.to_datetime(start_us + (k * span_us) // max(rows, 1), unit="us", utc=True),
            "amount": np.round(5 + (mixed % 250_000) / 100.0, 2),
            "currency": _CURRENCIES[mixed % len(_CURRENCIES)],
            "customer_email": ("customer" + pd.Series(mixed % 5000).astype(str) + "@example.com").astype(object),
        }
    )


def disk_bandwidth(folder: Path, size_bytes: int, block: int = 8 << 20) -> float:
    """Sequential write bandwidth in bytes/s: ``size_bytes`` of incompressible data in large blocks, one fsync."""
    payload = os.urandom(min(block, size_bytes))
    path = folder / "bandwidth.bin"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        written = 0
        while written < size_bytes:
            handle.write(payload)
            written += len(payload)
        fsync_file(handle)
    elapsed = time.perf_counter() - start
    path.unlink()
    return written / elapsed


class _Plain:
    """The baselines: plain writes of one frame into ``folder``, one fsync each."""

    def __init__(self, frame: pd.DataFrame, file_format: str, folder: Path) -> None:
        self.frame = frame
        self.file_format = file_format
        self.folder = folder
        self.bytes: dict[str, int] = {}
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.{self.file_format}"

    def pandas(self, _rep: int) -> None:
        path = self.path("pandas")
        if self.file_format == "csv":
            with open(path, "w", encoding="utf-8", newline="") as handle:
                self.frame.to_csv(handle, index=False)
                fsync_file(handle)
        else:
            with open(path, "wb") as handle:
                self.frame.to_parquet(handle, index=False)
                fsync_file(handle)

    def arrow_pyfile(self, _rep: int) -> None:
        table = pa.Table.from_pandas(self.frame, preserve_index=False)
        with open(self.path("arrow_pyfile"), "wb") as handle:
            if self.file_format == "csv":
                pa_csv.write_csv(table, handle)
            else:
                pq.write_table(table, handle)
            fsync_file(handle)

    def arrow_native(self, _rep: int) -> None:
        table = pa.Table.from_pandas(self.frame, preserve_index=False)
        path = self.path("arrow_native")
        with pa.OSFile(str(path), "wb") as sink:
            if self.file_format == "csv":
                pa_csv.write_csv(table, sink)
            else:
                pq.write_table(table, sink)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def clean(self, name: str | None = None) -> None:
        """Removes one variant's file (or all), remembering its size: the disk stays small between repetitions."""
        for entry in self.folder.iterdir():
            if name is None or entry.stem == name:
                self.bytes[entry.stem] = entry.stat().st_size
                entry.unlink()


def dlt_installed() -> bool:
    return importlib.util.find_spec("dlt") is not None


class _Dlt:
    """dlt's ``filesystem`` destination on a local folder, used as a nightly job uses it: one pipeline (made and run
    once untimed, so its state and schema exist), and a new load of the frame as one table per repetition
    (``loader_file_format`` the format, compression off, telemetry off). Between repetitions, untimed, the loaded
    data files and dlt's kept copies of completed packages are removed."""

    def __init__(self, frame: pd.DataFrame, file_format: str, folder: Path) -> None:
        import dlt

        self.frame = frame
        self.file_format = file_format
        self.folder = folder
        self.bytes = 0
        self.pipeline = dlt.pipeline(
            pipeline_name=f"bench_{file_format}",
            pipelines_dir=str(folder / "pipelines"),
            destination=dlt.destinations.filesystem(bucket_url=(folder / "out").as_uri()),
            dataset_name=f"invoices_{file_format}",
        )

    def prepare(self, _rep: int) -> None:
        """Nothing to make: the pipeline is the same one; its last load was removed by :meth:`clean`."""

    def export(self, _rep: int) -> None:
        info = self.pipeline.run(self.frame, table_name="invoices", loader_file_format=self.file_format)
        if info.has_failed_jobs:
            raise RuntimeError(f"dlt failed to load the frame: {info}")

    def clean(self) -> None:
        """Removes the last load's data files (their size remembered; none found after a load means dlt wrote
        something else, a compressed file for one: an error, never a silent comparison) and the completed packages
        dlt keeps under its pipelines folder."""
        data = [p for p in (self.folder / "out").rglob("*") if p.is_file() and p.parent.name == "invoices"]
        if data:
            wrong = [p.name for p in data if p.suffix != f".{self.file_format}"]
            if wrong:
                raise RuntimeError(f"dlt wrote {wrong}, not uncompressed {self.file_format}: settings not ours")
            self.bytes = sum(p.stat().st_size for p in data)
            for path in data:
                path.unlink()
        for loaded in (self.folder / "pipelines").glob("*/load/loaded"):
            shutil.rmtree(loaded, ignore_errors=True)


def dlt_settings() -> None:
    """dlt's settings for the peer, set for the whole process (dlt reads them from the environment): compression off
    in both places dlt looks, telemetry off (it would send four events a run from a background thread), quiet logs."""
    os.environ["DATA_WRITER__DISABLE_COMPRESSION"] = "true"
    os.environ["NORMALIZE__DATA_WRITER__DISABLE_COMPRESSION"] = "true"
    os.environ["RUNTIME__DLTHUB_TELEMETRY"] = "false"
    os.environ["RUNTIME__LOG_LEVEL"] = "WARNING"


class _Ledgered:
    """One logical key per repetition through the project's I/O manager (a new tenant each time)."""

    def __init__(
        self, frame: pd.DataFrame, file_format: str, folder: Path, window: ExportWindow, instance: dg.DagsterInstance
    ) -> None:
        self.frame = frame
        self.window = window
        self.file_format = file_format
        self.root = folder / "exports"
        self.ledger_url = f"sqlite:///{folder / 'ledger.sqlite3'}"
        self.io_manager = LedgeredExportIOManager(
            ledger=LedgerResource(url=self.ledger_url),
            destination=DestinationResource(spec=str(self.root)),
            file_format=file_format,
            tenants=["acme"],
        )
        self.last_bytes = 0
        self.instance = instance

    def key(self, rep: int) -> LogicalKey:
        # A new export name per repetition: a fresh logical key for the same frame, tenant and window (every row
        # must belong to the key's tenant, so the tenant cannot change without changing the bytes written).
        label = "warmup" if rep < 0 else f"rep{rep:03d}"
        return LogicalKey(f"invoice_export_{label}_{self.file_format}", "acme", self.window)

    def prepare(self, rep: int) -> None:
        """Outside the timing: the output context and the batch the asset hands over, as a real run has them (the
        previous context closed by :meth:`clean`)."""
        key = self.key(rep)
        self.batch = ExportBatch(INVOICE_SCHEMA, [ExportItem(key, BUSINESS_DATE.isoformat(), self.frame)])
        self.context = dg.build_output_context(
            run_id=f"bench-{key.tenant}",
            step_key="invoice_export",
            instance=self.instance,
            asset_key=dg.AssetKey("invoice_export"),
        )

    def export(self, rep: int) -> None:
        batch = self.batch
        self.io_manager.handle_output(self.context, batch)
        (result,) = batch.results
        if result.status != "exported":
            raise RuntimeError(f"{result.logical_key} was {result.status}, expected a fresh export")
        self.last_path = Path(result.location)

    def clean(self) -> None:
        """Removes the last key's folder: its place (data file and manifest, whose size is remembered) and pointer;
        closes the last output context (left to the garbage collector, its resources' scope ended in a traceback)."""
        context, self.context = getattr(self, "context", None), None
        if context is not None:
            context.__exit__(None, None, None)
        path = getattr(self, "last_path", None)
        if path is not None and path.exists():
            self.last_bytes = sum(p.stat().st_size for p in path.iterdir())
            shutil.rmtree(path.parent)  # the key folder: the place and the pointer naming it

    def phases(self) -> dict[str, float]:
        """The I/O manager's steps for one more key, called one by one with a timer on each: where the time goes."""
        ledger = ExportLedger(self.ledger_url)
        destination = self.io_manager.destination.get_destination()
        key = LogicalKey(f"invoice_export_phases_{self.file_format}", "acme", self.window)
        spent: dict[str, float] = {}

        def timed(name, call):
            start = time.perf_counter()
            value = call()
            spent[name] = time.perf_counter() - start
            return value

        claim = timed("claim", lambda: ledger.claims.claim(key, "bench-phases/invoice_export"))
        target = target_for(key, claim.revision)
        superseded = claim.superseded_revision
        timed(
            "verify_pointer",
            lambda: destination.verify(target, logical_key=claim.logical_key, superseded=superseded),
        )
        fingerprint = Fingerprint(INVOICE_SCHEMA.id_columns, INVOICE_SCHEMA.version_column)
        table = timed(
            "validate_frame",
            lambda: validate_frame(
                self.frame, INVOICE_SCHEMA, claim.window, str(key), key.tenant, fingerprint=fingerprint
            ),
        )
        template = Stager(INVOICE_SCHEMA, self.file_format, lambda level, message: None).manifest_template(claim, key)
        token = claim.fencing_token
        staged = timed(
            "stage_write_hash_fsync",
            lambda: destination.stage(target, token, table, self.file_format, template),
        )
        timed("commit_pointer_cas_fsync", lambda: destination.commit(staged, token, superseded=superseded))
        location = destination.location(staged.target)
        evidence = CompletionEvidence(
            location, staged.manifest.sha256, staged.manifest.row_count, claim.attempt_id, token,
            source_fingerprint=fingerprint.encode(), revision=claim.revision,
        )  # fmt: skip
        timed("complete", lambda: ledger.completions.complete(claim, evidence))
        self.last_path = Path(location)
        self.clean()
        return spent


def run(settings: Settings) -> dict:
    sizes = settings.size(full=(10_000, 100_000, 1_000_000), smoke=(1_000, 5_000), quick=(10_000, 100_000))
    repeats = {size: settings.reps(full=9 if size < 1_000_000 else 5) for size in sizes}
    window = window_for(BUSINESS_DATE, TIMEZONE)
    rows_out = []
    with scratch_dir(settings.scratch, NAME) as folder, dg.instance_for_test() as instance:
        bandwidth_samples = [disk_bandwidth(folder, (8 if settings.smoke else 256) << 20) for _ in range(2)]
        for size in sizes:
            frame = invoice_frame(size, window)
            for file_format in FORMATS:
                plain = _Plain(frame, file_format, folder / f"plain-{size}-{file_format}")
                ledgered = _Ledgered(frame, file_format, folder / f"ledgered-{size}-{file_format}", window, instance)
                variants = {
                    "ledgered": ledgered.export,
                    "pandas": plain.pandas,
                    "arrow_pyfile": plain.arrow_pyfile,
                    "arrow_native": plain.arrow_native,
                }
                peer = None
                if dlt_installed():
                    dlt_settings()
                    peer = _Dlt(frame, file_format, folder / f"dlt-{size}-{file_format}")
                    variants["dlt"] = peer.export

                def setup(name, rep, plain=plain, ledgered=ledgered, peer=peer):
                    if name == "ledgered":
                        ledgered.clean()
                        ledgered.prepare(rep)
                    elif name == "dlt":
                        peer.clean()
                        peer.prepare(rep)
                    else:
                        plain.clean(name)

                times = interleaved(variants, repeats[size], setup=setup, warmup=not settings.smoke)
                ledgered.clean()
                plain.clean()
                if peer is not None:
                    peer.clean()
                sizes_on_disk = {name: plain.bytes[name] for name in ("pandas", "arrow_pyfile")}
                if peer is not None:
                    sizes_on_disk["dlt"] = peer.bytes
                    if peer.bytes == 0:
                        raise RuntimeError(f"dlt loaded no {file_format} data file for {size:,} rows")
                phases = ledgered.phases() if size == sizes[-1] else None
                medians = {name: median(values) for name, values in times.items()}
                arrow_best = min(("arrow_pyfile", "arrow_native", "pandas"), key=lambda n: medians[n])
                rows_out.append(
                    {
                        "rows": size,
                        "format": file_format,
                        "repeats": repeats[size],
                        "median_s": {name: round(v, 5) for name, v in medians.items()},
                        "all_s": {name: [round(v, 5) for v in values] for name, values in times.items()},
                        "baseline_b": arrow_best,
                        "bytes": {"ledgered_data_and_manifest": ledgered.last_bytes, **sizes_on_disk},
                        "ratio_vs_arrow": round(medians["ledgered"] / medians[arrow_best], 4),
                        "ratio_vs_pandas": round(medians["ledgered"] / medians["pandas"], 4),
                        "ratio_vs_dlt": round(medians["ledgered"] / medians["dlt"], 4) if "dlt" in medians else None,
                        "dlt_vs_arrow": round(medians["dlt"] / medians[arrow_best], 4) if "dlt" in medians else None,
                        "dlt_same_size_as_arrow": sizes_on_disk["dlt"] == sizes_on_disk["arrow_pyfile"]
                        if peer is not None
                        else None,
                        "phases_s": {k: round(v, 5) for k, v in phases.items()} if phases else None,
                    }
                )
            del frame
        bandwidth_samples += [disk_bandwidth(folder, (8 if settings.smoke else 256) << 20) for _ in range(2)]
    dispose_engines()
    bandwidth = median(bandwidth_samples)
    for row in rows_out:
        row["disk_floor_s"] = round(row["bytes"]["arrow_pyfile"] / bandwidth, 5)
    largest = [r for r in rows_out if r["rows"] == sizes[-1]]
    targets = []
    for row in largest:
        targets.append(
            target(
                f"{row['format']} {row['rows']:,} rows: ledgered / plain arrow (b)",
                row["ratio_vs_arrow"],
                OVERHEAD_LIMITS[row["format"]],
                at_most=True,
            )
        )
        if row["ratio_vs_dlt"] is not None:
            targets.append(
                target(
                    f"{row['format']} {row['rows']:,} rows: ledgered / dlt filesystem (peer)",
                    row["ratio_vs_dlt"],
                    DLT_LIMIT,
                    at_most=True,
                )  # fmt: skip
            )
    table = [
        {
            "rows": f"{r['rows']:,}",
            "format": r["format"],
            "ledgered s": r["median_s"]["ledgered"],
            "pandas (a) s": r["median_s"]["pandas"],
            "arrow (b) s": r["median_s"][r["baseline_b"]],
            "disk floor s": r["disk_floor_s"],
            "dlt s": r["median_s"].get("dlt", ""),
            "ledgered/(b)": r["ratio_vs_arrow"],
            "ledgered/(a)": r["ratio_vs_pandas"],
            "ledgered/dlt": r["ratio_vs_dlt"] if r["ratio_vs_dlt"] is not None else "",
        }
        for r in rows_out
    ]
    return {
        "description": "one partition, ledgered export vs plain writes of the same frame on the same disk"
        + ("" if dlt_installed() else " (dlt not installed: its peer was skipped; pip install -e '.[bench]')"),
        "disk_bandwidth_mb_s": round(bandwidth / 1e6, 1),
        "disk_bandwidth_samples_mb_s": [round(b / 1e6, 1) for b in bandwidth_samples],
        "results": rows_out,
        "table": table,
        "targets": targets,
    }
