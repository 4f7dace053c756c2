"""What every benchmark shares: interleaved timing, medians, targets, the machine description, scratch folders.

The machine is shared and noisy, so every number that is judged is a ratio against a baseline measured in the
same run, with the variants interleaved repetition by repetition and the median taken of each.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

PROJECT_ROOT = Path(__file__).resolve().parent.parent
POSTGRES_ADMIN_URL = os.environ.get("EXPORTS_BENCH_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class Settings:
    """How big and how often: ``smoke`` proves the code runs; ``quick`` compares two commits on one machine (the
    protocol's benchmarks at middle sizes, three repetitions); the full settings give the published numbers."""

    smoke: bool
    scratch: Path
    repeats: int | None = None  # overrides each benchmark's own repetition count
    quick: bool = False

    def reps(self, full: int, smoke: int = 1) -> int:
        if self.repeats is not None:
            return self.repeats
        if self.quick:
            return min(full, 3)
        return smoke if self.smoke else full

    def size(self, full, smoke, quick):
        """The size of a measurement in this mode."""
        return smoke if self.smoke else quick if self.quick else full


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def interleaved(
    variants: Mapping[str, Callable[[int], object]],
    repeats: int,
    *,
    setup: Callable[[str, int], object] | None = None,
    warmup: bool = True,
) -> dict[str, list[float]]:
    """Runs each variant ``repeats`` times, rotating their order every repetition; returns seconds per variant.

    ``setup(name, rep)`` runs before each timed call, outside the timing. A first untimed round warms imports,
    caches and connection pools so that no variant pays them inside the measurement.
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds = ([-1] if warmup else []) + list(range(repeats))
    for rep in rounds:
        shift = max(rep, 0) % len(names)
        for name in names[shift:] + names[:shift]:
            if setup is not None:
                setup(name, rep)
            start = time.perf_counter()
            variants[name](rep)
            elapsed = time.perf_counter() - start
            if rep >= 0:
                times[name].append(elapsed)
    return times


def target(name: str, value: float, limit: float, *, at_most: bool, unit: str = "x") -> dict:
    """One judged number: ``value`` against ``limit`` (``at_most`` or at least)."""
    met = value <= limit if at_most else value >= limit
    return {
        "name": name,
        "value": round(value, 4),
        "limit": limit,
        "comparison": "<=" if at_most else ">=",
        "unit": unit,
        "met": bool(met),
    }


def fsync_file(handle) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def versions() -> dict[str, str]:
    names = ["dagster", "pandas", "pyarrow", "numpy", "SQLAlchemy", "psycopg2-binary", "dlt"]
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["python"] = platform.python_version()
    found["sqlite"] = __import__("sqlite3").sqlite_version
    return found


def code_version() -> dict[str, object]:
    """The commit measured, and whether tracked files differed from it (numbers belong to code, not to a date)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "--short=12", "HEAD") or "unknown", "modified": bool(git("status", "-suno"))}


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        memory_gib = round(int(first.split()[1]) / 1024 / 1024, 1)
    return {
        "hostname_hash": uuid.uuid5(uuid.NAMESPACE_DNS, platform.node()).hex[:8],
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


@contextlib.contextmanager
def scratch_dir(parent: Path, name: str) -> Iterator[Path]:
    """A fresh folder under ``parent`` (same filesystem as every variant of one benchmark), removed afterwards."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def postgres_unavailable_reason() -> str | None:
    import sqlalchemy as sa

    engine = sa.create_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return None
    except Exception as exc:  # any failure to connect means the PostgreSQL half is skipped, with this reason
        return f"PostgreSQL not reachable at {engine.url.render_as_string(hide_password=True)}: {type(exc).__name__}"
    finally:
        engine.dispose()


@contextlib.contextmanager
def postgres_schema(prefix: str) -> Iterator[tuple[str, str]]:
    """A fresh schema; yields (SQLAlchemy URL whose connections use it, schema name). Dropped afterwards."""
    import sqlalchemy as sa

    from export_ledger.ledger import dispose_engines

    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(POSTGRES_ADMIN_URL)
    with admin.begin() as conn:
        conn.execute(sa.schema.CreateSchema(schema))
    separator = "&" if "?" in POSTGRES_ADMIN_URL else "?"
    url = f"{POSTGRES_ADMIN_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    try:
        yield url, schema
    finally:
        dispose_engines()
        with admin.begin() as conn:
            conn.execute(sa.schema.DropSchema(schema, cascade=True))
        admin.dispose()


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)
