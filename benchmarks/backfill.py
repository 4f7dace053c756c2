"""Benchmark 4: a backfill of daily partitions x tenants through Dagster in process, under three run policies.

* ``per_partition``: one run per partition (what a backfill without a chunking policy launches);
* ``chunked``: the project's policy, ``BackfillPolicy.multi_run(31)``: one run per chunk of at most 31 partitions;
* ``single_run``: ``BackfillPolicy.single_run()``: one run over the whole range.

Runs are launched the way the backfill daemon launches them (a partition key, or the partition-range tags), with
``execute_in_process`` on a fresh ``instance_for_test`` (SQLite run and event storage) per repetition, a fresh
ledger and a fresh destination.

Two references are timed in the same interleaving, over the same keys and source:

* ``data_work``: what a plain script does per key: read the sample source's frame, write it with pyarrow, fsync;
* ``ledgered_no_dagster``: the same keys through the I/O manager directly (claim, validate, stage, publish,
  complete), without Dagster: where the ledger protocol ends and Dagster begins.

Overhead per logical key = (policy wall time - data_work) / keys.

Then **a year of backfill**: 365 daily partitions x 100 tenants = 36,500 keys (4 x 2 in ``--smoke``), ``chunked``
(12 runs of at most 31 partitions, in process) against ``data_work`` for the same keys, once each (one repetition
takes minutes), in a fresh instance, ledger and destination. Judged: chunked / data work.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.csv as pa_csv

from assets.invoices import INVOICE_SCHEMA
from benchmarks.common import Settings, interleaved, median, scratch_dir, target
from definitions import build_definitions
from export_ledger.calendar import window_for
from export_ledger.destinations import LocalDestination
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ExportLedger, dispose_engines
from export_ledger.protocol import ExportBatch, ExportItem, export_batch
from resources.invoices import SampleInvoiceSource

NAME = "backfill"
JOB = "invoice_export_job"
TIMEZONE = "America/New_York"
#: A year whose every window has ended: a claim before its window's end is refused (by the ledger's clock).
START = dt.date(2025, 1, 1)
CHUNK = 31


class _Backfill:
    def __init__(self, folder: Path, partitions: list[str], tenants: list[str]) -> None:
        self.folder = folder
        self.partitions = partitions
        self.tenants = tenants
        self.source = SampleInvoiceSource()
        self.stack: contextlib.ExitStack | None = None
        self.counter = 0

    def fresh(self, name: str) -> None:
        """Untimed: a new ledger, destination and Dagster instance for the next timed call."""
        self.close()
        self.counter += 1
        self.work = self.folder / f"{name}-{self.counter}"
        (self.work / "dagster").mkdir(parents=True)
        self.stack = contextlib.ExitStack()
        self.instance = self.stack.enter_context(dg.instance_for_test(temp_dir=str(self.work / "dagster")))
        self.ledger_url = f"sqlite:///{self.work / 'ledger.sqlite3'}"
        self.defs = build_definitions(
            TIMEZONE,
            START.isoformat(),
            self.tenants,
            ledger_url=self.ledger_url,
            destination=str(self.work / "exports"),
            environ={"EXPORTS_SOURCE": "sample"},
            max_partitions_per_run=CHUNK,
        )
        self.job = self.defs.resolve_job_def(JOB)
        self.windows = {p: window_for(dt.date.fromisoformat(p), TIMEZONE) for p in self.partitions}

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
            self.stack = None
            dispose_engines()
            shutil.rmtree(self.work, ignore_errors=True)

    def _launch(self, **kwargs) -> None:
        result = self.job.execute_in_process(instance=self.instance, raise_on_error=False, **kwargs)
        if not result.success:
            raise RuntimeError(f"backfill run failed: {kwargs}")

    def warm(self) -> None:
        """Untimed: one run of each kind on two partitions, so that no timed variant pays first-use costs."""
        self.fresh("warmup")
        self._launch(partition_key=self.partitions[0])
        self._launch(
            tags={
                "dagster/asset_partition_range_start": self.partitions[1],
                "dagster/asset_partition_range_end": self.partitions[2],
            }
        )
        self.close()

    def per_partition(self, _rep: int) -> None:
        for partition in self.partitions:
            self._launch(partition_key=partition)

    def _ranges(self, size: int) -> None:
        for first in range(0, len(self.partitions), size):
            chunk = self.partitions[first : first + size]
            self._launch(
                tags={"dagster/asset_partition_range_start": chunk[0], "dagster/asset_partition_range_end": chunk[-1]}
            )

    def chunked(self, _rep: int) -> None:
        self._ranges(CHUNK)

    def single_run(self, _rep: int) -> None:
        self._ranges(len(self.partitions))

    def data_work(self, _rep: int) -> None:
        out = self.work / "plain"
        out.mkdir()
        for partition in self.partitions:
            window = self.windows[partition]
            for tenant in self.tenants:
                frame = self.source.rows(tenant, window.start_utc, window.end_utc)
                table = pa.Table.from_pandas(frame, preserve_index=False)
                with open(out / f"{tenant}-{partition}.csv", "wb") as handle:
                    pa_csv.write_csv(table, handle)
                    handle.flush()
                    os.fsync(handle.fileno())

    def ledgered_no_dagster(self, _rep: int) -> None:
        items = []
        for partition in self.partitions:
            window = self.windows[partition]
            for tenant in self.tenants:
                frame = self.source.rows(tenant, window.start_utc, window.end_utc)
                items.append(ExportItem(LogicalKey("invoice_export", tenant, window), partition, frame))
        export_batch(
            ExportLedger(self.ledger_url),
            LocalDestination(root=str(self.work / "exports")),
            ExportBatch(INVOICE_SCHEMA, items),
            "bench-backfill/invoice_export",
        )


def _year_of_backfill(settings: Settings, folder: Path) -> dict:
    """365 partitions x 100 tenants chunked through Dagster in process, against the plain data work of the same keys."""
    days, tenant_count = settings.size(full=(365, 100), smoke=(4, 2), quick=(31, 20))
    partitions = [(START + dt.timedelta(days=d)).isoformat() for d in range(days)]
    tenants = [f"tenant{t:03d}" for t in range(tenant_count)]
    bench = _Backfill(folder, partitions, tenants)
    try:
        times = interleaved(
            {"chunked": bench.chunked, "data_work": bench.data_work},
            settings.reps(full=1),
            setup=lambda name, _rep: bench.fresh(f"year-{name}"),
            warmup=False,
        )
    finally:
        bench.close()
    medians = {name: median(values) for name, values in times.items()}
    keys = days * tenant_count
    return {
        "partitions": days,
        "tenants": tenant_count,
        "logical_keys": keys,
        "runs": -(-days // CHUNK),
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "all_s": {k: [round(v, 4) for v in vs] for k, vs in times.items()},
        "ms_per_key": {k: round(1000 * v / keys, 3) for k, v in medians.items()},
        "ratio": round(medians["chunked"] / medians["data_work"], 4),
    }


def run(settings: Settings) -> dict:
    days, tenant_count = settings.size(full=(90, 10), smoke=(3, 1), quick=(31, 10))
    repeats = settings.reps(full=3)
    partitions = [(START + dt.timedelta(days=d)).isoformat() for d in range(days)]
    tenants = [f"tenant{t:02d}" for t in range(tenant_count)]
    keys = days * tenant_count
    with scratch_dir(settings.scratch, NAME) as folder:
        bench = _Backfill(folder, partitions, tenants)

        def setup(name: str, _rep: int) -> None:
            bench.fresh(name)

        variants = {
            "per_partition": bench.per_partition,
            "chunked": bench.chunked,
            "single_run": bench.single_run,
            "data_work": bench.data_work,
            "ledgered_no_dagster": bench.ledgered_no_dagster,
        }
        try:
            if not settings.smoke:
                bench.warm()  # a full warm-up round would cost minutes; three partitions warm the same code paths
            times = interleaved(variants, repeats, setup=setup, warmup=False)
        finally:
            bench.close()
        year = _year_of_backfill(settings, folder)
    medians = {name: median(values) for name, values in times.items()}
    data = medians["data_work"]
    chunks = -(-days // CHUNK)
    runs = {
        "per_partition": days,
        "chunked": chunks,
        "single_run": 1,
        "data_work": 0,
        "ledgered_no_dagster": 0,
    }
    table = [
        {
            "variant": name,
            "runs": runs[name],
            "wall s": round(medians[name], 3),
            "ms per key": round(1000 * medians[name] / keys, 2),
            "overhead ms/key": round(1000 * (medians[name] - data) / keys, 2),
            "x per_partition": round(medians["per_partition"] / medians[name], 2),
        }
        for name in variants
    ]
    table += [
        {
            "variant": f"year: {name} ({year['partitions']} x {year['tenants']})",
            "runs": year["runs"] if name == "chunked" else 0,
            "wall s": year["median_s"][name],
            "ms per key": year["ms_per_key"][name],
            "overhead ms/key": round(year["ms_per_key"][name] - year["ms_per_key"]["data_work"], 2),
            "x per_partition": "",
        }
        for name in ("chunked", "data_work")
    ]
    speedup = medians["per_partition"] / medians["chunked"]
    # What one run costs beyond its keys, from the two extremes (same keys, days runs against one), and the speedup
    # chunking could reach if every key cost no more than the plain data work (why the old "10x one run per partition"
    # target could not be met as posed: the data work alone caps it near 9; the library's cost per key is judged).
    per_run_s = max(0.0, (medians["per_partition"] - medians["single_run"]) / max(days - 1, 1))
    bound = (days * per_run_s + data) / (chunks * per_run_s + data)
    return {
        "description": f"{days} daily partitions x {tenant_count} tenants = {keys} logical keys, Dagster in process",
        "partitions": days,
        "tenants": tenant_count,
        "logical_keys": keys,
        "repeats": repeats,
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "all_s": {k: [round(v, 4) for v in vs] for k, vs in times.items()},
        "per_run_overhead_s": round(per_run_s, 4),
        "speedup_over_one_run_per_partition": round(speedup, 2),
        "speedup_bound_at_data_work_per_key": round(bound, 2),
        "year": year,
        "table": table,
        "notes": [
            f"one run costs about {per_run_s:.2f} s beyond its keys; with no per-key cost beyond the data work, "
            f"chunking could be at most {bound:.1f}x faster than one run per partition"
        ],
        "targets": [
            target(
                "chunked overhead per logical key beyond the data work",
                1000 * (medians["chunked"] - data) / keys,
                3.0,
                at_most=True,
                unit=" ms",
            ),
            target(
                f"a year of backfill ({year['partitions']} partitions x {year['tenants']} tenants), chunked / plain "
                "data work",
                year["ratio"],
                1.5,
                at_most=True,
            ),
        ],
    }
