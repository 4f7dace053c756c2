"""Benchmark 7: the invoice export against the peer a user would pick instead, a plain Dagster asset on UPathIOManager.

The peer (``PLAIN_PEER`` below, written into the scratch folder as a user's own file) is a daily-partitioned
``@dg.asset`` (America/New_York, from 2026-01-01, the reference code location's first date) returning each tenant's
invoices of the partition's window, and a ``dg.UPathIOManager`` subclass that writes one CSV per tenant with pyarrow's
writer (the export's writer and default format) and one fsync per file. It imports neither export_ledger nor this
project: its frame generator is a copy of ``SampleInvoiceSource.rows``, checked equal to it (untimed) before anything is
timed, so the peer does not pay the library's imports. Dagster 1.13's ``UPathIOManager.handle_output`` refuses an output
of several partitions (one run of a ``multi_run`` backfill chunk), so the peer overrides it to dump each partition's
value, as a user must.

1. **One partition as a whole process**, what ``dagster asset materialize --select <export> --partition D`` costs
   a user: each variant a fresh ``dagster asset materialize -f FILE --select ASSET --partition D`` process, the
   export's FILE this project's own ``definitions.py`` configured by its environment as the README's command runs it
   (the sample source, one tenant), with a fresh ``DAGSTER_HOME`` (telemetry off), ledger (its tables created) and
   destination per repetition, made untimed, interleaved;
   ``python -c "import dagster"`` beside them as the floor. One tenant, so each writes exactly one data file. From
   each run's event log (read untimed afterwards) the wall time is split into phases; the first run of each variant
   (the untimed warm-up; in ``--smoke``, which has none, the one timed run) runs under ``python -X importtime``: what
   the export's processes import beyond the peer's.
2. **A chunked backfill, per key**: D days x T tenants in process (``execute_in_process`` on a fresh
   ``instance_for_test``, ledger and destination per repetition), runs of at most 31 partitions launched with the
   partition-range tags as the backfill daemon launches them: the export's ``invoice_export_job`` against the peer's
   asset (``BackfillPolicy.multi_run(31)``) in a ``define_asset_job``. Beside them, reported and not judged,
   ``plain_checked``: the peer with one partitioned asset check, one verdict per partition of each run targeting the
   partition's materialization (what the UI counts): the least a plain asset does to show a verdict on each date,
   so what Dagster's event log costs a verdict, apart from anything the export does.

After every timed call the files written are counted (untimed); a variant that did not write every expected file
fails the benchmark (a benchmark that measures a no-op is a defect).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import PROJECT_ROOT, Settings, interleaved, median, scratch_dir, target

NAME = "dagster_peer"
TIMEZONE = "America/New_York"
START = dt.date(2026, 1, 1)  # the reference code location's first date (definitions.DEFAULT_START_DATE)
#: The partition of target 1: an ordinary (no DST change) day whose window has long ended.
PARTITION = "2026-01-02"
TENANT = "acme"
CHUNK = 31
#: The sample source's default cadence (``EXPORTS_SAMPLE_CADENCE_MINUTES``): one invoice per tenant every 15 minutes,
#: 96 rows in a 24-hour window. The frame is small on purpose: what is compared is the cost of a run around it.
CADENCE_MINUTES = 15
LEDGERED_ASSET = "invoice_export"
LEDGERED_JOB = "invoice_export_job"
PLAIN_ASSET = "plain_invoices"
PLAIN_JOB = "plain_invoices_job"
PROCESS_LIMIT = 1.2
BACKFILL_LIMIT = 1.3

PLAIN_PEER = '''"""A plain Dagster asset on UPathIOManager: each tenant's invoices of a business day, one CSV each."""

import datetime as dt
import hashlib
import math
import os
import warnings

import dagster as dg
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pa_csv
from dagster._core.definitions.asset_checks.asset_check_evaluation import (  # a check's target: no public alias
    AssetCheckEvaluationTargetMaterializationData,
)
from upath import UPath

_CURRENCIES = np.array(["USD", "EUR", "GBP", "CAD"], dtype=object)
PARTITIONS = dg.DailyPartitionsDefinition(start_date="2026-01-01", timezone="America/New_York")


def sample_rows(tenant, start_utc, end_utc, cadence_minutes=15):
    """One invoice every ``cadence_minutes`` on a UTC grid: the same frame as the sample source of the export."""
    step = cadence_minutes * 60
    k = np.arange(math.ceil(start_utc.timestamp() / step), math.ceil(end_utc.timestamp() / step), dtype=np.int64)
    seed = int.from_bytes(hashlib.sha256(tenant.encode()).digest()[:4], "big")
    mixed = (k * 2654435761 + seed) % 1_000_003
    ids = pd.Series(k, dtype="int64").astype(str).str.zfill(12)
    return pd.DataFrame(
        {
            "invoice_id": (tenant + "-" + ids).astype(object),
            "tenant": np.full(len(k), tenant, dtype=object),
            "occurred_at": pd.to_datetime(k * step, unit="s", utc=True).as_unit("us"),
            "amount": np.round(5 + (mixed % 250_000) / 100.0, 2),
            "currency": _CURRENCIES[mixed % len(_CURRENCIES)],
            "customer_email": ("customer" + pd.Series(mixed % 5000).astype(str) + "@example.com").astype(object),
        }
    )


class TenantCsvIOManager(dg.UPathIOManager):
    """One CSV per tenant under the partition's path, written by pyarrow and fsynced."""

    def __init__(self, base_path):
        super().__init__(base_path=base_path)
        self.root = base_path

    def dump_to_path(self, context, obj, path):
        path.mkdir(parents=True, exist_ok=True)
        for tenant, frame in obj.items():
            with (path / f"{tenant}.csv").open("wb") as handle:
                pa_csv.write_csv(pa.Table.from_pandas(frame, preserve_index=False), handle)
                handle.flush()
                os.fsync(handle.fileno())

    def load_from_path(self, context, path):
        return {file.stem: pa_csv.read_csv(str(file)).to_pandas() for file in sorted(path.glob("*.csv"))}

    def handle_output(self, context, obj):
        # UPathIOManager.handle_output refuses an output of several partitions (a multi_run backfill chunk's run):
        # dump each partition's value at its own path.
        if not context.has_asset_partitions or len(context.asset_partition_keys) == 1:
            return super().handle_output(context, obj)
        base = self.root.joinpath(*context.asset_key.path)
        for key in context.asset_partition_keys:
            self.dump_to_path(context, obj[key], self.get_path_for_partition(context, base, key))


def build(root, tenants, chunk=None, cadence_minutes=15, checked=False):
    """The peer's definitions; ``checked``: with one partitioned check, one verdict per partition of each run
    (counting its rows), targeting the partition's materialization as the UI needs: the least a plain asset does to
    show a verdict on each date."""
    check = "rows_written"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # partitioned checks are a preview API in Dagster 1.13
        specs = [dg.AssetCheckSpec(check, asset="plain_invoices", partitions_def=PARTITIONS)] if checked else None

    @dg.asset(
        partitions_def=PARTITIONS,
        backfill_policy=dg.BackfillPolicy.multi_run(chunk) if chunk else None,
        io_manager_key="tenant_csv",
        check_specs=specs,
    )
    def plain_invoices(context: dg.AssetExecutionContext):
        frames = {}
        for key in context.partition_keys:
            window = PARTITIONS.time_window_for_partition_key(key)
            start, end = window.start.astimezone(dt.timezone.utc), window.end.astimezone(dt.timezone.utc)
            frames[key] = {tenant: sample_rows(tenant, start, end, cadence_minutes) for tenant in tenants}
        yield dg.Output(next(iter(frames.values())) if len(frames) == 1 else frames)
        if not checked:
            return
        records = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=context.asset_key, asset_partitions=list(frames)), limit=len(frames)
        ).records
        targets = {
            r.partition_key: AssetCheckEvaluationTargetMaterializationData(
                storage_id=r.storage_id, run_id=r.run_id, timestamp=r.timestamp
            )
            for r in records
        }
        for key, by_tenant in frames.items():
            rows = sum(len(frame) for frame in by_tenant.values())
            context.log_event(
                dg.AssetCheckEvaluation(
                    asset_key=context.asset_key, check_name=check, passed=rows > 0, partition=key,
                    metadata={"rows": rows}, target_materialization_data=targets.get(key),
                )
            )
        key = dg.AssetCheckKey(context.asset_key, check)
        yield dg.Output(None, output_name=context.assets_def.get_output_name_for_asset_check_key(key))

    return dg.Definitions(
        assets=[plain_invoices],
        jobs=[dg.define_asset_job("plain_invoices_job", selection=[plain_invoices])],
        resources={"tenant_csv": TenantCsvIOManager(UPath(root))},
    )
'''

#: The last line of the peer's file for target 1 (the peer's source is put before it).
PLAIN_DEFS = "\n\ndefs = build({root!r}, [{tenant!r}], {chunk}, {cadence})\n"

#: The phases of one materialize process, between its start, the events of its run and its exit: (label, first
#: event, last event, what happens there). None is the process's own start or exit.
PHASES = (
    ("start", None, "RUN_START", "the CLI process: interpreter, imports, load the file, instance, run"),
    ("step_process", "RUN_START", "STEP_WORKER_STARTED", "the step process is spawned: imports dagster, instance"),
    ("step_load", "STEP_WORKER_STARTED", "STEP_START", "the step process loads the file again, plans, resources"),
    ("step", "STEP_START", "STEP_SUCCESS", "asset body, I/O manager, asset checks"),
    ("step_exit", "STEP_SUCCESS", "RUN_SUCCESS", "the step process ends"),
    ("exit", "RUN_SUCCESS", None, "the CLI process ends"),
)


def _dagster_command() -> list[str]:
    script = Path(sys.executable).with_name("dagster")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "dagster"]


def _environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_") and k != "DAGSTER_HOME"}
    env["DAGSTER_HOME"] = str(home)
    env["EXPORTS_SOURCE"] = "sample"  # definitions.py builds its own `defs` on import, and it has no default source
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-3000:]}")
    return done


def _make_ledger(url: str) -> None:
    """Untimed: the ledger's tables, as a deployment's ledger has them before its first run."""
    from export_ledger import ExportLedger
    from export_ledger.ledger import dispose_engines

    ExportLedger(url).now()
    dispose_engines()


def _data_files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file()) if root.exists() else []


def _load_plain(folder: Path):
    """The peer's file, imported as a module of its own (variant 2 builds its Definitions in this process)."""
    path = folder / "plain_peer.py"
    path.write_text(PLAIN_PEER, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("bench_plain_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_same_frames(plain, dates: list[str], tenants: list[str]) -> None:
    """Untimed: the peer's copy of the sample generator gives the sample source's frames, on the export's windows."""
    import pandas as pd

    from export_ledger.calendar import window_for
    from resources.invoices import SampleInvoiceSource

    source = SampleInvoiceSource(cadence_minutes=CADENCE_MINUTES)
    # (Nothing here resolves Definitions: outside an open instance, after another benchmark's instance_for_test has
    # closed, Dagster 1.13 fails to ("Attempted to resolve undefined DagsterInstance weakref").)
    for day in dates:
        window = window_for(dt.date.fromisoformat(day), TIMEZONE)
        peer = plain.PARTITIONS.time_window_for_partition_key(day)
        if (peer.start, peer.end) != (window.start_utc, window.end_utc):
            raise RuntimeError(f"the peer's window of {day} is not the export's: {peer} != {window}")
        for tenant in tenants:
            pd.testing.assert_frame_equal(
                plain.sample_rows(tenant, window.start_utc, window.end_utc, CADENCE_MINUTES),
                source.rows(tenant, window.start_utc, window.end_utc),
            )


# --- 1. one partition as a whole process ---------------------------------------------------------------------------


class _Process:
    """Fresh folders (untimed) and one ``dagster asset materialize`` process per timed call."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.counter = 0
        self.calls: dict[str, list[dict]] = defaultdict(list)
        self.current: dict | None = None

    def setup(self, name: str, rep: int) -> None:
        self.counter += 1
        work = self.folder / f"{name}-{self.counter}"
        home = work / "dagster_home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n", encoding="utf-8")
        exports = work / "exports"
        env = _environment(home)
        if name == "ledgered":
            # The README's own command on this project's code location, configured by its environment; the ledger's
            # tables are made here, untimed, as a deployment's ledger already exists when a run starts.
            ledger_url = f"sqlite:///{work / 'ledger.sqlite3'}"
            _make_ledger(ledger_url)
            env.update(
                EXPORTS_LEDGER_URL=ledger_url,
                EXPORTS_DESTINATION=str(exports),
                EXPORTS_TENANTS=TENANT,
                EXPORTS_SAMPLE_CADENCE_MINUTES=str(CADENCE_MINUTES),
            )
            file, asset, pattern = str(PROJECT_ROOT / "definitions.py"), LEDGERED_ASSET, "data.csv"
        else:
            text = PLAIN_PEER + PLAIN_DEFS.format(
                root=str(exports), tenant=TENANT, chunk=CHUNK, cadence=CADENCE_MINUTES
            )
            (work / "plain_definitions.py").write_text(text, encoding="utf-8")
            file, asset, pattern = "plain_definitions.py", PLAIN_ASSET, "*.csv"
        arguments = ["asset", "materialize", "-f", file, "--select", asset, "--partition", PARTITION]
        # The first run of each variant (the warm-up, untimed, but for --smoke) runs under -X importtime, which the step
        # process inherits: the import breakdown.
        first = not self.calls[name]
        launcher = [sys.executable, "-X", "importtime", "-m", "dagster"] if first else _dagster_command()
        self.current = {
            "name": name, "rep": rep, "first": first, "work": work, "home": home, "exports": exports,
            "pattern": pattern, "arguments": arguments, "command": [*launcher, *arguments], "env": env,
        }  # fmt: skip

    def call(self, _rep: int) -> None:
        call = self.current
        call["began"] = time.time()
        done = _run(call["command"], call["work"], call["env"])
        call["ended"] = time.time()
        call["stderr"] = done.stderr if call["first"] else ""
        self.calls[call["name"]].append(call)

    def check(self, call: dict) -> Path:
        """Untimed: the process wrote exactly one data file (of the one tenant's partition)."""
        files = _data_files(call["exports"], call["pattern"])
        if len(files) != 1:
            raise RuntimeError(f"{call['name']} wrote {len(files)} data files, not 1: {files}")
        return files[0]


def _phases(call: dict) -> dict[str, float]:
    """The run's phases (seconds), from its event log (event timestamps, written by the CLI and the step process) and
    the process's start and exit; ``events`` is the number of records in the run's event log."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(call["home"])) as instance:
        (run,) = instance.get_runs()
        if run.status != dg.DagsterRunStatus.SUCCESS:
            raise RuntimeError(f"{call['name']}: run {run.run_id} is {run.status}")
        records = instance.all_logs(run.run_id)
    at: dict[str, float] = {}
    for record in records:
        if record.dagster_event is not None:
            at.setdefault(record.dagster_event.event_type.name, record.timestamp)
    phases = {"events": len(records)}
    for label, first, last, _ in PHASES:
        begin = call["began"] if first is None else at[first]
        end = call["ended"] if last is None else at[last]
        phases[label] = end - begin
    return phases


_IMPORT_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|( *)(\S+)\s*$")


def _import_self_times(call: dict) -> dict[str, float]:
    """Import self time (seconds) by top-level package, over the CLI and step processes of a ``-X importtime`` run."""
    totals: dict[str, float] = defaultdict(float)
    for line in call["stderr"].splitlines():
        found = _IMPORT_LINE.match(line)
        if found:
            totals[found.group(4).split(".")[0]] += int(found.group(1)) / 1e6
    if not totals:
        raise RuntimeError(f"{call['name']}: the warm-up run printed no -X importtime lines")
    return dict(totals)


def _one_partition(settings: Settings, folder: Path) -> dict:
    bench = _Process(folder)
    floor_env = _environment(folder)
    variants = {
        "ledgered": bench.call,
        "plain": bench.call,
        "import_dagster": lambda _rep: _run([sys.executable, "-c", "import dagster"], folder, floor_env),
    }

    def setup(name: str, rep: int) -> None:
        if name != "import_dagster":
            bench.setup(name, rep)

    times = interleaved(variants, settings.reps(full=5), setup=setup, warmup=not settings.smoke)
    medians = {name: median(values) for name, values in times.items()}

    files = {name: [bench.check(call) for call in calls] for name, calls in bench.calls.items()}
    written = {name: paths[-1] for name, paths in files.items()}
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in written.items()}
    phases = {}
    for name, calls in bench.calls.items():
        timed = [c for c in calls if c["rep"] >= 0]
        each = [_phases(c) for c in timed]
        phases[name] = {label: round(median([p[label] for p in each]), 4) for label in each[0]}
    imports = {name: _import_self_times(calls[0]) for name, calls in bench.calls.items()}
    return {
        "medians": medians,
        "times": times,
        "rows": sum(1 for _ in written["plain"].open(encoding="utf-8")) - 1,
        "bytes": {name: path.stat().st_size for name, path in written.items()},
        "same_bytes": digests["ledgered"] == digests["plain"],
        "files_per_run": {name: 1 for name in files},
        "phases": phases,
        "imports": imports,
        "command": " ".join(["dagster", *bench.calls["ledgered"][-1]["arguments"]]),
    }


# --- 2. a chunked backfill, per key --------------------------------------------------------------------------------


class _Backfill:
    def __init__(self, folder: Path, partitions: list[str], tenants: list[str], plain) -> None:
        self.folder = folder
        self.partitions = partitions
        self.tenants = tenants
        self.plain = plain
        self.stack: contextlib.ExitStack | None = None
        self.counter = 0
        self.files: dict[str, list[int]] = defaultdict(list)

    def fresh(self, name: str, _rep: int) -> None:
        """Untimed: a new Dagster instance, ledger and destination, and the variant's job."""
        import dagster as dg

        from definitions import build_definitions

        self.close()
        self.counter += 1
        self.name = name
        self.work = self.folder / f"{name}-{self.counter}"
        (self.work / "dagster").mkdir(parents=True)
        self.exports = self.work / "exports"
        self.stack = contextlib.ExitStack()
        self.instance = self.stack.enter_context(dg.instance_for_test(temp_dir=str(self.work / "dagster")))
        if name == "ledgered":
            ledger_url = f"sqlite:///{self.work / 'ledger.sqlite3'}"
            _make_ledger(ledger_url)
            defs = build_definitions(
                TIMEZONE,
                START.isoformat(),
                self.tenants,
                ledger_url=ledger_url,
                destination=str(self.exports),
                environ={"EXPORTS_SOURCE": "sample", "EXPORTS_SAMPLE_CADENCE_MINUTES": str(CADENCE_MINUTES)},
                max_partitions_per_run=CHUNK,
            )
            self.job, self.pattern = defs.resolve_job_def(LEDGERED_JOB), "data.csv"
        else:
            checked = name == "plain_checked"
            defs = self.plain.build(str(self.exports), self.tenants, CHUNK, CADENCE_MINUTES, checked=checked)
            self.job, self.pattern = defs.resolve_job_def(PLAIN_JOB), "*.csv"

    def close(self) -> None:
        """Untimed: the last call wrote one data file per key, or the benchmark fails."""
        if self.stack is None:
            return
        self.stack.close()
        self.stack = None
        from export_ledger.ledger import dispose_engines

        dispose_engines()
        count = len(_data_files(self.exports, self.pattern))
        expected = len(self.partitions) * len(self.tenants)
        if count != expected:
            raise RuntimeError(f"{self.name} wrote {count} data files, not {expected}")
        self.files[self.name].append(count)
        shutil.rmtree(self.work, ignore_errors=True)

    def call(self, _rep: int) -> None:
        for first in range(0, len(self.partitions), CHUNK):
            chunk = self.partitions[first : first + CHUNK]
            tags = {"dagster/asset_partition_range_start": chunk[0], "dagster/asset_partition_range_end": chunk[-1]}
            result = self.job.execute_in_process(instance=self.instance, raise_on_error=False, tags=tags)
            if not result.success:
                raise RuntimeError(f"{self.name}: the run of {chunk[0]}..{chunk[-1]} failed")


def _backfill(settings: Settings, folder: Path, plain) -> dict:
    days, tenant_count = (3, 2) if settings.smoke else (62, 10)
    partitions = [(START + dt.timedelta(days=d)).isoformat() for d in range(days)]
    tenants = [f"tenant{t:02d}" for t in range(tenant_count)]
    _check_same_frames(plain, partitions[:1], tenants)
    bench = _Backfill(folder, partitions, tenants, plain)
    try:
        times = interleaved(
            {"ledgered": bench.call, "plain": bench.call, "plain_checked": bench.call},
            settings.reps(full=5),
            setup=bench.fresh,
            warmup=not settings.smoke,
        )
    finally:
        bench.close()
    keys = days * tenant_count
    return {
        "partitions": days,
        "tenants": tenant_count,
        "logical_keys": keys,
        "runs": -(-days // CHUNK),
        "medians": {name: median(values) for name, values in times.items()},
        "times": times,
        "files_per_call": {name: counts[-1] for name, counts in bench.files.items()},
    }


def _notes(one: dict, backfill: dict) -> list[str]:
    extra = one["medians"]["ledgered"] - one["medians"]["plain"]
    phases = one["phases"]
    diffs = {label: phases["ledgered"][label] - phases["plain"][label] for label, *_ in PHASES}
    imports = one["imports"]
    by_package = {
        package: imports["ledgered"].get(package, 0.0) - imports["plain"].get(package, 0.0)
        for package in set(imports["ledgered"]) | set(imports["plain"])
    }
    top = sorted(by_package.items(), key=lambda item: -item[1])[:6]
    import_extra = sum(imports["ledgered"].values()) - sum(imports["plain"].values())
    keys = backfill["logical_keys"]
    per_key = {name: 1000 * value / keys for name, value in backfill["medians"].items()}
    return [
        f"one partition: the export's process takes {extra:+.2f} s over the peer's "
        f"({one['medians']['ledgered']:.2f} s vs {one['medians']['plain']:.2f} s; import dagster alone "
        f"{one['medians']['import_dagster']:.2f} s)",
        "by phase (medians, export - peer; phases_s in the JSON): "
        + ", ".join(f"{label} {diff:+.3f} s" for label, diff in diffs.items()),
        f"the run's event log holds {phases['ledgered']['events']:.0f} records against {phases['plain']['events']:.0f} "
        "(the export's asset checks add outputs and evaluations; the step process stores each in DAGSTER_HOME)",
        f"imports (self time, python -X importtime on the first run, the CLI process and the multiprocess executor's "
        f"step process together, both load the code file): {import_extra:+.2f} s for the export; by package: "
        + ", ".join(f"{package} {value:+.3f} s" for package, value in top),
        f"both write the same frame ({one['rows']} rows) with pyarrow's CSV writer and fsync the data file "
        f"({one['bytes']['ledgered']} vs {one['bytes']['plain']} bytes, same bytes: {one['same_bytes']}); the export "
        "also writes a manifest and a pointer with fsyncs (files and folders) and commits its ledger (SQLite)",
        f"backfill: {per_key['ledgered']:.2f} ms per key against {per_key['plain']:.2f} for the peer "
        f"({keys} keys in {backfill['runs']} runs of at most {CHUNK} partitions)",
        f"backfill: the peer with one partitioned check reported per partition (the least a plain asset does to show "
        f"a verdict on each date in the UI, targeting its materialization) takes {per_key['plain_checked']:.2f} ms per "
        f"key, {per_key['plain_checked'] / per_key['plain']:.2f}x the plain peer: Dagster stores each evaluation in "
        f"its event log (SQLite here); the export reports one per partition too and is "
        f"{per_key['ledgered'] / per_key['plain_checked']:.2f}x that peer",
    ]


def run(settings: Settings) -> dict:
    with scratch_dir(settings.scratch, NAME) as folder:
        plain = _load_plain(folder)
        _check_same_frames(plain, [PARTITION], [TENANT])
        one = _one_partition(settings, folder / "one_partition")
        backfill = _backfill(settings, folder / "backfill", plain)
    process_ratio = one["medians"]["ledgered"] / one["medians"]["plain"]
    keys = backfill["logical_keys"]
    per_key = {name: 1000 * value / keys for name, value in backfill["medians"].items()}
    backfill_ratio = per_key["ledgered"] / per_key["plain"]
    repeats = len(one["times"]["plain"])
    table = [
        {
            "measurement": "one partition, whole process",
            "variant": name,
            "median s": round(one["medians"][name], 3),
            "ms per key": round(1000 * one["medians"][name], 1) if name != "import_dagster" else "",
            "x plain": round(one["medians"][name] / one["medians"]["plain"], 3),
            "files": one["files_per_run"].get(name, 0),
        }
        for name in ("ledgered", "plain", "import_dagster")
    ]
    table += [
        {
            "measurement": f"backfill {backfill['partitions']} x {backfill['tenants']}, chunks of {CHUNK}",
            "variant": name,
            "median s": round(backfill["medians"][name], 3),
            "ms per key": round(per_key[name], 2),
            "x plain": round(per_key[name] / per_key["plain"], 3),
            "files": backfill["files_per_call"][name],
        }
        for name in ("ledgered", "plain", "plain_checked")
    ]
    return {
        "description": (
            "the invoice export against a plain Dagster asset on UPathIOManager doing the same write: one partition as "
            "a whole `dagster asset materialize` process, and a chunked backfill in process, per key"
        ),
        "repeats": repeats,
        "one_partition": {
            "command": one["command"],
            "partition": PARTITION,
            "tenant": TENANT,
            "rows": one["rows"],
            "cadence_minutes": CADENCE_MINUTES,
            "file_format": "csv",
            "bytes": one["bytes"],
            "same_bytes": one["same_bytes"],
            "median_s": {k: round(v, 4) for k, v in one["medians"].items()},
            "all_s": {k: [round(v, 4) for v in vs] for k, vs in one["times"].items()},
            "ratio": round(process_ratio, 4),
            "phases_s": one["phases"],
            "phases": {
                label: f"{first or 'process start'} to {last or 'process exit'}: {what}"
                for label, first, last, what in PHASES
            },
            "import_self_s_by_package": {
                name: {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:15]}
                for name, per in one["imports"].items()
            },
        },
        "backfill": {
            "partitions": backfill["partitions"],
            "tenants": backfill["tenants"],
            "logical_keys": keys,
            "runs": backfill["runs"],
            "median_s": {k: round(v, 4) for k, v in backfill["medians"].items()},
            "all_s": {k: [round(v, 4) for v in vs] for k, vs in backfill["times"].items()},
            "ms_per_key": {k: round(v, 3) for k, v in per_key.items()},
            "ratio": round(backfill_ratio, 4),
        },
        "table": table,
        "notes": _notes(one, backfill),
        "targets": [
            target(
                "one partition as a whole process (dagster asset materialize), export / plain UPathIOManager asset",
                process_ratio,
                PROCESS_LIMIT,
                at_most=True,
            ),
            target(
                f"chunked backfill ({backfill['partitions']} x {backfill['tenants']}), ms per key, export / plain "
                "UPathIOManager asset",
                backfill_ratio,
                BACKFILL_LIMIT,
                at_most=True,
            ),
        ],
    }
