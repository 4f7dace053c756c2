"""A reconciliation tick reads what it acts on, not what the ledger holds (issue #21, part 3): the reads it makes of a
day stop at what they show, its count of escalated keys stops at a cap, and its reads of Dagster's run storage do not
grow with the page of partitions it reruns.

Work is measured as SQLite virtual-machine steps (a progress handler), which grow with the rows a statement visits
whatever the machine's load; the ledgers are bulk-inserted like the benchmark's (``benchmarks/sensor_tick.py``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import warnings

import dagster as dg
import sqlalchemy as sa
from builders import open_ledger

from benchmarks.sensor_tick import START, TIMEZONE, StuckLedger, _row
from export_ledger.calendar import tz_database_version, window_for
from export_ledger.dagster import DestinationResource, LedgerResource
from export_ledger.ledger import ExportLedger, ExportState, ledger_engine
from export_ledger.ledger.schema import export_runs

UTC = dt.timezone.utc
STUCK_AFTER = dt.timedelta(hours=6)


@contextlib.contextmanager
def counted_steps(url: str):
    """Counts the SQLite VM steps (in thousands) of every statement on the ledger at ``url`` inside the block."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    def before(conn, cursor, statement, parameters, context, executemany):
        cursor.connection.set_progress_handler(tick, 1000)

    engine = ledger_engine(url)
    sa.event.listen(engine, "before_cursor_execute", before)
    try:
        yield steps
    finally:
        sa.event.remove(engine, "before_cursor_execute", before)


def _days_ledger(url: str, tenants: int, state: ExportState) -> ExportLedger:
    """Two business days of ``tenants`` keys each, all in ``state`` (completed keys carry their evidence)."""
    ledger = open_ledger(url)
    now = dt.datetime.now(UTC)
    windows = [window_for(START + dt.timedelta(days=d), TIMEZONE) for d in range(2)]
    rows = [_row(i, 2, windows, tz_database_version(TIMEZONE), now) for i in range(2 * tenants)]
    if state is not ExportState.COMPLETED:
        for row in rows:
            row.update(state=state.value, location=None, row_count=None, committed_attempt=None)
    with ledger.atomic() as conn:
        conn.execute(export_runs.insert(), rows)
    return ledger


def _listing_and_probe_steps(tmp_path, tenants: int) -> tuple[int, int]:
    url_done = f"sqlite:///{tmp_path / f'done-{tenants}.sqlite3'}"
    url_failed = f"sqlite:///{tmp_path / f'failed-{tenants}.sqlite3'}"
    done = _days_ledger(url_done, tenants, ExportState.COMPLETED)
    failed = _days_ledger(url_failed, tenants, ExportState.FAILED)
    names = [f"t{t:05d}" for t in range(tenants)]
    days = [START, START + dt.timedelta(days=1)]
    with counted_steps(url_done) as listing:
        listed = done.queries.first_keys(
            export="invoice_export", timezone=TIMEZONE, days=days, tenants=names, per_day=20
        )
    assert {day: [r.tenant for r in rs] for day, rs in listed.items()} == {day: names[:20] for day in days}
    with counted_steps(url_failed) as probing:
        unfinished = failed.queries.unfinished_days(
            export="invoice_export", timezone=TIMEZONE, days=days, tenants=names
        )
    assert unfinished == set(days)
    assert done.queries.unfinished_days(export="invoice_export", timezone=TIMEZONE, days=days, tenants=names) == set()
    return listing[0], probing[0]


def test_a_touched_days_listing_and_its_unfinished_probe_do_not_read_the_whole_day(tmp_path):
    small = _listing_and_probe_steps(tmp_path, 25)
    large = _listing_and_probe_steps(tmp_path, 1000)
    assert large[0] <= 2 * small[0] + 5, f"the first 20 keys of a day cost what they list: {small[0]} -> {large[0]}"
    assert large[1] <= 2 * small[1] + 5, f"a day with failed keys is found by one probe: {small[1]} -> {large[1]}"


def test_a_capped_summary_counts_at_most_the_cap_of_each_kind_and_says_it_is_a_lower_bound(tmp_path):
    backlog = StuckLedger(f"sqlite:///{tmp_path / 'backlog.sqlite3'}", 2000, tmp_path, stuck=10)
    escalated = backlog.escalate()
    ledger = backlog.ledger
    exact = ledger.attention.summary(STUCK_AFTER, listed=False)
    assert exact.total == escalated + 10 and not exact.at_least, "uncapped, every escalated key is counted"
    assert ledger.attention.summary(STUCK_AFTER, listed=False, cap=5000) == exact, "below the cap, exact"
    with counted_steps(backlog.url) as uncapped_steps:
        ledger.attention.summary(STUCK_AFTER)
    with counted_steps(backlog.url) as capped_steps:
        capped = ledger.attention.summary(STUCK_AFTER, cap=100)
    assert capped.at_least, "a summary that reached its cap says that its counts are lower bounds"
    assert capped.total == 100 + 10, "100 failed keys past their reruns (the cap), 5 remote_unknown, 5 abandoned"
    assert capped.digest != exact.digest
    listed = capped.groups[("invoice_export", TIMEZONE)][1]
    assert len(listed) == 20 and listed == sorted(listed, key=lambda e: e.logical_key)
    assert capped_steps[0] * 4 < uncapped_steps[0], f"capped {capped_steps[0]}, uncapped {uncapped_steps[0]}"


def _sensor_for(sl: StuckLedger, instance: dg.DagsterInstance):
    from definitions import build_definitions

    defs = build_definitions(
        TIMEZONE, START.isoformat(), sl.tenants, ledger_url=sl.url, destination=str(sl.root),
        environ={"EXPORTS_SOURCE": "sample"},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sensor = defs.get_sensor_def("reconciliation_sensor")
    context = dg.build_sensor_context(
        instance=instance,
        resources={
            "ledger": LedgerResource(url=sl.url),
            "invoice_export__destination": DestinationResource.of(sl.destination),
        },
    )
    return sensor, context


def test_a_tick_reads_the_run_storage_once_for_its_page_of_reruns(tmp_path):
    statements: list[str] = []

    def before(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    with dg.instance_for_test() as instance:
        sl = StuckLedger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}", 1000, tmp_path, stuck=20)
        sensor, context = _sensor_for(sl, instance)
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", before)
        try:
            result = sensor(context)
        finally:
            sa.event.remove(sa.engine.Engine, "before_cursor_execute", before)
    reruns = [r for r in result.run_requests if r.run_key.startswith("rerun/")]
    assert len(reruns) == 10, "the ten keys with nothing at the destination failed: ten partitions to rerun"
    tag_reads = [s for s in statements if "FROM runs JOIN run_tags" in s]
    assert len(tag_reads) == 1, (
        f"one read of the run storage for the page's ended reruns, not one per partition: {tag_reads}"
    )


def test_a_days_summary_is_read_from_the_covering_index_alone_on_a_fresh_and_an_upgraded_ledger(tmp_path):
    """Schema 8's index holds every column the per-day summary reads: SQLite answers it from the index, never from
    the table's rows (without it, each of a day's thousand keys was a lookup in the table)."""
    import shutil
    from pathlib import Path

    from export_ledger.ledger import upgrade_url

    upgraded = tmp_path / "upgraded.sqlite3"
    shutil.copy(Path(__file__).parent / "data" / "ledger-0.4.0.sqlite3", upgraded)
    upgrade_url(f"sqlite:///{upgraded}")
    for url in (f"sqlite:///{tmp_path / 'fresh.sqlite3'}", f"sqlite:///{upgraded}"):
        ledger = open_ledger(url)
        statements = []

        def seen(conn, cursor, statement, parameters, context, executemany, statements=statements):
            statements.append((statement, parameters))

        engine = ledger_engine(url)
        sa.event.listen(engine, "before_cursor_execute", seen)
        try:
            # A zone's thousand tenants over two days, as a tick asks (for one tenant, the key's own index is a lookup).
            ledger.queries.day_summaries(
                export="invoice_export", timezone=TIMEZONE, days=[START, START + dt.timedelta(days=1)],
                tenants=[f"t{t:05d}" for t in range(1000)],
            )  # fmt: skip
        finally:
            sa.event.remove(engine, "before_cursor_execute", seen)
        (summary,) = [(s, p) for s, p in statements if s.lstrip().startswith("SELECT")]
        with engine.connect() as conn:
            plan = " ".join(row[3] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + summary[0], summary[1]))
        assert "USING COVERING INDEX ix_export_runs_day_summary" in plan, plan
