"""Benchmark 3: one reconciliation tick against ledgers of 10k, 100k and 1M rows, each with 100 stuck keys.

Keys are laid out as 1,000 business days x (rows / 1,000) tenants: the 1M-row ledger is 1,000 tenants over about
three years, and the sensor is built for those tenants. Rows are bulk-inserted with SQLAlchemy Core ``executemany``
into the ledger's own tables (not through ``claim``):
completed keys, plus 100 stuck ones on 100 distinct business dates (so each touches a partition of its own, the
costliest case for the sensor's per-partition decisions) and spread over the tenants, half ``remote_unknown`` and half
``in_progress`` with an expired lease, each last claimed with token 2. Half of the stuck keys have an intact export
at the destination, committed by that token (its place and the key's pointer naming it: they resolve to
``completed``), the other half have nothing (``failed``, and a run request).

A third ledger holds a backlog for a person: every key but the stuck ones ``failed`` with its automatic reruns spent
(its claim count at the sensor's ``max_attempts``), at least 100,000 of them (1,000 in ``--smoke``), and the same
100 stuck keys; its whole sensor tick is timed too (``sensor tick with 100,000 escalated keys``): counting and
listing what is escalated must not read the backlog.

Two variants are timed, interleaved across the ledger sizes, with the stuck keys and their pointers put back
(untimed) before each, so that every tick holds, fences (a pointer write), judges and records each key afresh:

* ``reconcile_batch``: :func:`export_ledger.reconcile.reconcile_batch` with the sensor's batch size (100);
* ``sensor``: the project's ``reconciliation_sensor`` evaluated with ``build_sensor_context``: the batch above,
  the pages of failed and restating partitions, ``attention.summary`` for the ``no_stuck_exports`` check, and the
  Dagster result.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import warnings
from pathlib import Path

import dagster as dg
import pyarrow as pa
import sqlalchemy as sa

from benchmarks.common import (
    Settings,
    interleaved,
    median,
    postgres_schema,
    postgres_unavailable_reason,
    scratch_dir,
    target,
)
from export_ledger.calendar import ExportWindow, tz_database_version, utc_iso, window_for
from export_ledger.dagster import DestinationResource, LedgerResource
from export_ledger.destinations import ExportTarget, LocalDestination
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.frames import Manifest
from export_ledger.ledger import ExportLedger, dispose_engines, ledger_engine
from export_ledger.ledger.schema import ExportState, export_runs
from export_ledger.reconcile import reconcile_batch

NAME = "sensor_tick"
TIMEZONE = "America/New_York"
#: 1,000 business days from here have all ended: completed keys of windows not yet over cannot exist.
START = dt.date(2023, 1, 1)
STUCK = 100
DAYS = 1000  # tenants = rows / DAYS
UTC = dt.timezone.utc
INSERT_CHUNK = 20_000
#: Keys escalated (failed, automatic reruns spent) in the escalation variant's ledger, at least.
ESCALATED = 100_000


def _layout(rows: int) -> tuple[int, int]:
    days = min(DAYS, rows)
    return days, max(1, rows // days)


def _row(index: int, days: int, windows: list[ExportWindow], tz_db: str, now: dt.datetime) -> dict:
    tenant, day = divmod(index, days)
    window = windows[day]
    key = f"invoice_export/t{tenant:05d}/{utc_iso(window.start_utc)}"
    return {
        "logical_key": key,
        "export": "invoice_export",
        "tenant": f"t{tenant:05d}",
        "business_date": window.business_date,
        "timezone": TIMEZONE,
        "window_start_utc": window.start_utc,
        "window_end_utc": window.end_utc,
        "tz_database": tz_db,
        "state": ExportState.COMPLETED.value,
        "location": f"/exports/invoice_export/tenant=t{tenant:05d}/date={window.business_date}",
        "sha256": hashlib.sha256(key.encode()).hexdigest(),
        "row_count": 96,
        "committed_attempt": "bulk/invoice_export",
        "lease_owner": None,
        "lease_expires_at": None,
        "attempt_started_at": now - dt.timedelta(days=2),
        "fencing_token": 1,
        "created_at": now - dt.timedelta(days=2),
        "updated_at": now - dt.timedelta(days=2),
    }


class StuckLedger:
    """A ledger database of ``rows`` keys, 100 of them stuck, and a destination holding half of their exports."""

    def __init__(self, url: str, rows: int, folder: Path, stuck: int = STUCK) -> None:
        self.url = url
        self.rows = rows
        self.root = folder / f"exports-{rows}"
        self.destination = LocalDestination(root=str(self.root))
        self.ledger = ExportLedger(url)
        self.now = dt.datetime.now(UTC)
        days, tenants = _layout(rows)
        self.days = days
        self.tenants = [f"t{t:05d}" for t in range(tenants)]
        self.windows = [window_for(START + dt.timedelta(days=d), TIMEZONE) for d in range(days)]
        tz_db = tz_database_version(TIMEZONE)
        # Stuck keys on distinct business dates (7919 is prime, so i -> day is one-to-one over 1,000 days) and spread
        # over the tenants: every stuck key touches a partition of its own, the sensor's costliest case.
        count = min(stuck, days)
        self.stuck_index = [((i * tenants) // count) * days + (i * 7919 + 13) % days for i in range(count)]
        engine = ledger_engine(url)
        with engine.begin() as conn:
            for first in range(0, days * tenants, INSERT_CHUNK):
                chunk = [
                    _row(i, days, self.windows, tz_db, self.now)
                    for i in range(first, min(first + INSERT_CHUNK, days * tenants))
                ]
                conn.execute(export_runs.insert(), chunk)  # executemany
        self.stuck_rows = [self._stuck_values(n, i, tz_db) for n, i in enumerate(self.stuck_index)]
        for values in self.stuck_rows[::2]:
            self._publish(values)
        # What each stuck key's pointer holds before a tick (None: no pointer), put back with the rows.
        paths = [self._pointer(values) for values in self.stuck_rows]
        self.pointers = {path: path.read_bytes() if path.exists() else None for path in paths}
        self.reset()
        self.analyze()

    def analyze(self) -> None:
        """PostgreSQL's statistics of the tables, as autovacuum gathers them after a bulk load or a mass update: this
        machine's server runs with autovacuum off, and on tables never analyzed the planner guessed (first_keys and
        day_summaries took 48 and 40 ms a tick at 100,000 rows instead of 6 and 3). SQLite gathers none by itself,
        and gets none here."""
        if self.ledger.dialect != "postgresql":
            return
        with ledger_engine(self.url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE export_runs, export_attempts"))

    def _stuck_values(self, n: int, index: int, tz_db: str) -> dict:
        row = _row(index, self.days, self.windows, tz_db, self.now)
        attempt = f"crashed-{n}/invoice_export"
        # What the attempt meant to commit (a published key's is replaced by its manifest's, see _publish).
        payload = f"invoice_id\n{row['logical_key']}\n".encode()
        row.update(
            state=ExportState.REMOTE_UNKNOWN.value if n % 4 < 2 else ExportState.IN_PROGRESS.value,
            location=None,
            sha256=hashlib.sha256(payload).hexdigest(),
            row_count=None,
            committed_attempt=None,
            lease_owner=attempt,
            lease_expires_at=self.now - dt.timedelta(hours=8),
            fencing_token=2,
            updated_at=self.now - dt.timedelta(hours=9),
        )
        if row["state"] == ExportState.IN_PROGRESS.value:
            row["sha256"] = None  # an in_progress attempt has not said what it wrote
        return row

    def _target(self, values: dict) -> ExportTarget:
        return ExportTarget("invoice_export", values["tenant"], values["business_date"].isoformat())

    def _pointer(self, values: dict) -> Path:
        return self.root / self.destination.key_folder(self._target(values)) / POINTER_NAME

    def _publish(self, values: dict) -> None:
        """What the crashed attempt (token 2) committed before it died, through the destination's own protocol
        half: its place (data file and manifest) and the key's pointer naming it."""
        window = self.windows[(values["business_date"] - START).days]
        template = Manifest.build(
            logical_key=values["logical_key"],
            export="invoice_export",
            tenant=values["tenant"],
            window=window,
            row_count=0,
            sha256="",
            attempt_id=values["lease_owner"],
            fencing_token=2,
            data_file="data.csv",
            tz_database=values["tz_database"],
        )
        table = pa.table({"invoice_id": [values["logical_key"]]})
        staged = self.destination.stage(self._target(values), 2, table, "csv", template)
        self.destination.commit(staged, 2, superseded=0)
        if values["sha256"] is not None:
            values["sha256"] = staged.manifest.sha256  # a remote_unknown attempt said what it committed

    def reset(self) -> None:
        """Puts the stuck keys and their pointers back as they were (untimed)."""
        for path, payload in self.pointers.items():
            if payload is None:
                path.unlink(missing_ok=True)  # the tick's fence created it
            else:
                path.write_bytes(payload)  # the tick's fence raised it above the crashed attempt's token
        columns = (
            "state",
            "location",
            "sha256",
            "row_count",
            "committed_attempt",
            "lease_owner",
            "lease_expires_at",
            "fencing_token",
            "updated_at",
        )
        statement = (
            export_runs.update()
            .where(export_runs.c.logical_key == sa.bindparam("key"))
            .values({c: sa.bindparam(f"v_{c}") for c in columns})
        )
        params = [{"key": r["logical_key"], **{f"v_{c}": r[c] for c in columns}} for r in self.stuck_rows]
        with self.ledger.atomic() as conn:
            conn.execute(statement, params)

    def escalate(self, max_attempts: int = 3) -> int:
        """Turns every completed key but the stuck ones into a ``failed`` key whose automatic reruns are spent: a
        backlog escalated to a person. Returns how many (untimed, once)."""
        stuck = [r["logical_key"] for r in self.stuck_rows]
        statement = (
            export_runs.update()
            .where(export_runs.c.state == ExportState.COMPLETED.value, export_runs.c.logical_key.not_in(stuck))
            .values(
                state=ExportState.FAILED.value, location=None, row_count=None, committed_attempt=None,
                claim_count=max_attempts, fencing_token=max_attempts,
            )
        )  # fmt: skip
        with self.ledger.atomic() as conn:
            count = conn.execute(statement).rowcount
        self.analyze()
        return count

    def check(self, report) -> None:
        resolved = len(report.resolved)
        if resolved != len(self.stuck_rows):
            raise RuntimeError(f"{self.rows} rows: a tick resolved {resolved} of {len(self.stuck_rows)} stuck keys")


def _sensor(url: str, root: str, tenants: list[str]):
    from definitions import build_definitions

    defs = build_definitions(
        TIMEZONE, START.isoformat(), tenants, ledger_url=url, destination=root, environ={"EXPORTS_SOURCE": "sample"}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # get_sensor_def's note about resource resolution: we pass them below
        return defs.get_sensor_def("reconciliation_sensor")


def _escalated_rows(smoke: bool) -> int:
    """A ledger size whose keys, less the stuck ones, are at least :data:`ESCALATED` (1,000 in smoke)."""
    wanted = 1_000 if smoke else ESCALATED
    return DAYS * -(-(wanted + STUCK) // DAYS)


def _measure(backend: str, ledgers: dict[int, StuckLedger], repeats: int, warmup: bool) -> list[dict]:
    sensors = {}
    contexts: dict[int, dg.SensorEvaluationContext] = {}
    variants = {}
    for rows, sl in ledgers.items():

        def batch(_rep, sl=sl):
            sl.check(reconcile_batch(sl.ledger, sl.destination, limit=STUCK, after=None, reconciler="bench"))

        def sensor(_rep, rows=rows):
            result = sensors[rows](contexts[rows])
            if not result.run_requests and not result.asset_events:
                raise RuntimeError(f"{rows} rows: the sensor found nothing to do")

        variants[f"reconcile_batch/{rows}"] = batch
        variants[f"sensor/{rows}"] = sensor

    with dg.instance_for_test() as instance:
        # Resolved while an instance is current: Dagster's definitions loading looks for one.
        sensors.update({rows: _sensor(sl.url, str(sl.root), sl.tenants) for rows, sl in ledgers.items()})

        def setup(name: str, _rep: int) -> None:
            rows = int(name.split("/")[1])
            ledgers[rows].reset()
            # The daemon hands the sensor a context; building it is not the sensor's work.
            contexts[rows] = dg.build_sensor_context(
                instance=instance,
                resources={
                    "ledger": LedgerResource(url=ledgers[rows].url),
                    "invoice_export__destination": DestinationResource.of(ledgers[rows].destination),
                },
            )

        times = interleaved(variants, repeats, setup=setup, warmup=warmup)
    out = []
    for rows in ledgers:
        out.append(
            {
                "backend": backend,
                "rows": rows,
                "stuck": len(ledgers[rows].stuck_rows),
                "repeats": repeats,
                "reconcile_batch_ms": round(1000 * median(times[f"reconcile_batch/{rows}"]), 2),
                "sensor_ms": round(1000 * median(times[f"sensor/{rows}"]), 2),
                "all_ms": {k: [round(1000 * v, 2) for v in vs] for k, vs in times.items() if k.endswith(f"/{rows}")},
            }
        )
    return out


def run(settings: Settings) -> dict:
    sizes = (1_000, 5_000) if settings.smoke else (10_000, 100_000, 1_000_000)
    stuck = 10 if settings.smoke else STUCK
    repeats = settings.reps(full=7)
    escalated_rows = _escalated_rows(settings.smoke)
    escalated: dict[str, int] = {}
    results, notes = [], []
    with scratch_dir(settings.scratch, NAME) as folder:
        ledgers = {
            rows: StuckLedger(f"sqlite:///{folder / f'ledger-{rows}.sqlite3'}", rows, folder, stuck) for rows in sizes
        }
        backlog = StuckLedger(f"sqlite:///{folder / 'ledger-escalated.sqlite3'}", escalated_rows, folder / "esc", stuck)
        escalated["sqlite"] = backlog.escalate()
        try:
            results += _measure("sqlite", ledgers, repeats, not settings.smoke)
            results += _escalated(_measure("sqlite", {escalated_rows: backlog}, repeats, not settings.smoke),
                                  escalated["sqlite"])  # fmt: skip
        finally:
            dispose_engines()
        reason = postgres_unavailable_reason()
        if reason is not None:
            notes.append(f"postgresql skipped: {reason}")
        else:
            import contextlib

            with contextlib.ExitStack() as stack:
                pg = {}
                for rows in sizes:
                    url, _ = stack.enter_context(postgres_schema(f"bench_tick_{rows}"))
                    pg[rows] = StuckLedger(url, rows, folder / "pg", stuck)
                url, _ = stack.enter_context(postgres_schema("bench_tick_escalated"))
                backlog = StuckLedger(url, escalated_rows, folder / "pg-esc", stuck)
                escalated["postgresql"] = backlog.escalate()
                for sl in [*pg.values(), backlog]:
                    # What autovacuum would have done by now to a table that grew over years (its insert threshold
                    # vacuums after a fifth of the table is new): statistics, and the visibility map an index-only
                    # scan needs. A fresh schema has had none of it (and a test server may run with autovacuum off):
                    # the benchmark does it once, untimed.
                    engine = sa.create_engine(sl.url)
                    try:
                        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                            conn.exec_driver_sql("VACUUM (ANALYZE) export_runs")
                    finally:
                        engine.dispose()
                results += _measure("postgresql", pg, repeats, not settings.smoke)
                results += _escalated(_measure("postgresql", {escalated_rows: backlog}, repeats, not settings.smoke),
                                      escalated["postgresql"])  # fmt: skip
    targets = []
    for backend in ("sqlite", "postgresql"):
        by_rows = {r["rows"]: r for r in results if r["backend"] == backend and "escalated" not in r}
        if not by_rows:
            continue
        backlog = next(r for r in results if r["backend"] == backend and "escalated" in r)
        targets.append(
            target(
                f"{backend} sensor tick with {_round_down(backlog['escalated']):,} escalated keys",
                backlog["sensor_ms"],
                200,
                at_most=True,
                unit=" ms",
            )
        )
        small, large = by_rows[sizes[0]], by_rows[sizes[-1]]
        for variant in ("sensor", "reconcile_batch"):
            targets.append(
                target(
                    f"{backend} {variant} tick at {sizes[-1]:,} rows",
                    large[f"{variant}_ms"],
                    200,
                    at_most=True,
                    unit=" ms",
                )
            )
            targets.append(
                target(
                    f"{backend} {variant} tick({sizes[-1]:,}) / tick({sizes[0]:,})",
                    large[f"{variant}_ms"] / small[f"{variant}_ms"],
                    2.0,
                    at_most=True,
                )
            )
    return {
        "description": f"reconciliation tick with {stuck} stuck keys against ledgers of growing size",
        "results": results,
        "table": [
            {
                "backend": r["backend"],
                "rows": f"{r['rows']:,}",
                "stuck": r["stuck"],
                "escalated": f"{r.get('escalated', 0):,}",
                "reconcile_batch ms": r["reconcile_batch_ms"],
                "sensor tick ms": r["sensor_ms"],
            }
            for r in results
        ],
        "targets": targets,
        "notes": notes,
    }


def _escalated(results: list[dict], escalated: int) -> list[dict]:
    return [{**r, "escalated": escalated} for r in results]


def _round_down(count: int) -> int:
    """The escalated backlog as a target names it (100,900 keys: "100,000")."""
    step = 1_000 if count < ESCALATED else ESCALATED
    return count // step * step
