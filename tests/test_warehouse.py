"""The warehouse destination on its three real servers (PostgreSQL, MariaDB, DuckDB): what only it promises beyond
the contract suite (tests/test_destination_contract.py runs that on all three).

* Fencing at the destination: a fenced attempt's rows never become visible to a plain ``SELECT`` of the rows table.
* Restatements: a reader thread querying the rows table throughout sees exactly one revision's rows, never a mix
  and never none; the superseded marker is kept in the history table.
* ``read_current`` reads each key's current rows back.
* The URL is a secret: never in the spec, ``describe()`` or an error; a missing one is refused by name.
"""

from __future__ import annotations

import datetime as dt
import threading
import tracemalloc
from dataclasses import replace

import pyarrow as pa
import pytest
import sqlalchemy as sa
from builders import ORDERS_DAY, ORDERS_SCHEMA, ZONE, hourly_orders, key_for, open_ledger, orders_item
from warehouse_fixtures import WAREHOUSE_KINDS, warehouse_destination

from export_ledger.destinations import DestinationError, ExportTarget, Fenced, Verdict
from export_ledger.destinations.registry import destination_from
from export_ledger.destinations.warehouse import WarehouseDestination
from export_ledger.errors import ConfigurationError, FrameError
from export_ledger.frames import Manifest, TableStream
from export_ledger.protocol import export_key
from export_ledger.read import read_current

KEY = key_for(ORDERS_DAY, export="orders")
TARGET = ExportTarget(KEY.export, KEY.tenant, KEY.window.business_date.isoformat(), 1)


@pytest.fixture
def warehouse(warehouse_url) -> WarehouseDestination:
    return WarehouseDestination(table="exported_{export}", warehouse_url=warehouse_url)


@pytest.fixture(params=[kind for kind in WAREHOUSE_KINDS if kind != "duckdb"])
def waiting_warehouse(request, tmp_path) -> WarehouseDestination:
    """A warehouse whose writer waits on another's row lock (not DuckDB, which refuses a conflicting writer at once,
    retried: there is no interleaving to test there)."""
    return warehouse_destination(request.param, request, tmp_path)


def manifest_for(token: int, revision: int = 1) -> Manifest:
    return Manifest(
        logical_key=str(KEY), export=KEY.export, tenant=KEY.tenant, business_date=TARGET.business_date,
        timezone="UTC", window_start_utc="2026-03-02T05:00:00Z", window_end_utc="2026-03-03T05:00:00Z",
        row_count=0, sha256="", attempt_id=f"attempt-{token}", fencing_token=token, data_file="", revision=revision,
    )  # fmt: skip


def rows(total: float) -> pa.Table:
    frame = hourly_orders(KEY, total=total)
    return pa.Table.from_pandas(frame, preserve_index=False).cast(
        pa.schema([("order_id", pa.string()), ("tenant", pa.string()), ("placed_at", pa.timestamp("us", tz="UTC")),
                   ("total", pa.float64())])
    )  # fmt: skip


def visible(destination: WarehouseDestination) -> list[tuple[str, float]]:
    """What a plain SELECT of the rows table shows of the key, as any reader of the warehouse runs it."""
    engine = sa.create_engine(destination.warehouse_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("exported_orders"):
                return []
            query = sa.text("SELECT order_id, total FROM exported_orders WHERE _export_key = :key ORDER BY _export_row")
            return [tuple(row) for row in conn.execute(query, {"key": str(KEY)})]
    finally:
        engine.dispose()


def test_a_fenced_attempts_rows_never_become_visible(warehouse) -> None:
    """Attempt 1 stages its rows; attempt 2 takes the key over and fences it; attempt 1's commit is refused as
    fenced, and a plain SELECT of the rows table never shows its rows. Attempt 2's sweep removes what 1 staged (a
    refused commit of 1 also removes its own place: tested below), and its own commit is what readers see."""
    first = warehouse.stage(TARGET, 1, rows(1.0), "csv", manifest_for(1))
    assert visible(warehouse) == [], "staged rows are where readers do not look"
    pointer = warehouse.fence(TARGET, 2, logical_key=str(KEY))
    assert warehouse.sweep(TARGET, 2, pointer) == 1, "the fenced attempt's staged rows are removed"

    with pytest.raises(Fenced):
        warehouse.commit(first, 1, superseded=0)
    assert visible(warehouse) == [], "a fenced attempt's rows never become visible"
    assert warehouse.pointer(TARGET).revision == 0 and warehouse.pointer(TARGET).fence == 2

    second = warehouse.stage(TARGET, 2, rows(2.0), "csv", manifest_for(2))
    landed = warehouse.commit(second, 2, superseded=0)
    assert (landed.revision, landed.fence) == (1, 2)
    assert {total for _, total in visible(warehouse)} == {2.0}
    assert warehouse.commit(second, 2, superseded=0) == landed, "a commit sent again is the one that landed"
    with pytest.raises(Fenced):  # a stale party cannot fence below the marker's fence either
        warehouse.fence(TARGET, 1, logical_key=str(KEY))


def test_readers_see_revision_n_or_n_plus_1_never_both_or_neither(warehouse, tmp_path) -> None:
    """Five restatements while a reader thread runs a plain SELECT of the key's rows again and again: every answer is
    exactly one revision's rows. The markers of the superseded revisions are kept in the history table."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    revisions = 6

    def frame(revision: int):
        return hourly_orders(KEY, total=float(revision))

    expected = {revision: [(row.order_id, row.total) for row in frame(revision).itertuples()]
                for revision in range(1, revisions + 1)}  # fmt: skip
    assert export_key(ledger, warehouse, ORDERS_SCHEMA, orders_item(KEY, frame(1)), "run-1/x").status == "exported"
    seen: list[list] = []
    stop = threading.Event()
    # A reader of its own (DuckDB: the same process's database, one writer at a time, so its engine).
    duck = warehouse.warehouse_url.startswith("duckdb")
    engine = warehouse._engine() if duck else sa.create_engine(warehouse.warehouse_url)
    query = sa.text("SELECT order_id, total FROM exported_orders WHERE _export_key = :key ORDER BY _export_row")

    def read() -> None:
        with engine.connect() as conn:
            while not stop.is_set():
                seen.append([tuple(row) for row in conn.execute(query, {"key": str(KEY)})])
                conn.rollback()  # a fresh snapshot for the next SELECT (MariaDB's REPEATABLE READ keeps one open)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for revision in range(2, revisions + 1):
            ledger.restatements.request(str(KEY), reason="late rows", requested_by="ops")
            result = export_key(
                ledger, warehouse, ORDERS_SCHEMA, orders_item(KEY, frame(revision)), f"run-{revision}/x"
            )
            assert result.status == "exported"
    finally:
        stop.set()
        reader.join()
        if engine is not warehouse._engine():
            engine.dispose()
    by_answer = {tuple(rows): revision for revision, rows in expected.items()}
    answers = [by_answer.get(tuple(answer)) for answer in seen]
    assert seen and None not in answers, "every answer is exactly one revision's rows: never both, never neither"
    assert answers == sorted(answers), "a reader never goes back to an earlier revision"
    assert len(set(answers)) > 1, "the reader saw the restatements happen (a fresh snapshot per SELECT)"
    assert visible(warehouse) == expected[revisions]
    with warehouse._engine().connect() as conn:
        kept = conn.execute(sa.text("SELECT revision FROM exported_orders_history ORDER BY revision")).scalars().all()
        marker = conn.execute(sa.text("SELECT revision, fence, row_count FROM exported_orders_markers")).one()
    assert kept == list(range(1, revisions + 1)), "every revision's marker is kept"
    assert marker == (revisions, revisions, len(expected[revisions]))


def test_read_current_reads_each_keys_current_rows(warehouse, tmp_path) -> None:
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    other = key_for(ORDERS_DAY + dt.timedelta(days=1), export="orders")
    for key in (KEY, other):
        assert export_key(ledger, warehouse, ORDERS_SCHEMA, orders_item(key), f"run-{key}/x").status == "exported"
    ledger.restatements.request(str(KEY), reason="late rows", requested_by="ops")
    restated = hourly_orders(KEY, total=99.0)
    assert export_key(ledger, warehouse, ORDERS_SCHEMA, orders_item(KEY, restated), "run-2/x").status == "exported"

    frame = read_current(
        warehouse, ORDERS_DAY, ORDERS_DAY + dt.timedelta(days=2), tenants=["acme"], export="orders",
        timezone=ZONE,
    )  # fmt: skip

    assert frame.attrs["current"] == {str(KEY): 2, str(other): 1}
    assert len(frame) == len(restated) + len(hourly_orders(other))
    assert sorted(frame["total"].astype(float).unique()) == [12.5, 99.0]
    assert len(frame.attrs["missing"]) == 1, "the third day has nothing published"


def test_the_url_is_a_secret_never_shown_and_a_missing_one_is_named(tmp_path) -> None:
    url = "postgresql+psycopg2://exporter:s3cr3t-pw@127.0.0.1:1/analytics"
    built = destination_from("warehouse:exported_{export}", ledger_url="", environ={"EXPORTS_WAREHOUSE_URL": url})
    assert built.warehouse_url == url
    assert "s3cr3t-pw" not in built.describe() and "s3cr3t-pw" not in repr(built)
    assert "s3cr3t-pw" not in str(built.identity("orders")) and built.root_of("orders") == "warehouse:exported_orders"
    with pytest.raises(Exception) as unreachable:
        built.pointer(TARGET)
    assert "s3cr3t-pw" not in str(unreachable.value), "the driver's error text (which may quote the URL) is not shown"
    with pytest.raises(ConfigurationError, match="EXPORTS_WAREHOUSE_URL"):
        destination_from("warehouse:exported_{export}", ledger_url="", environ={})
    with pytest.raises(ConfigurationError, match="not a table name"):
        destination_from("warehouse:Bad-Name", ledger_url="", environ={"EXPORTS_WAREHOUSE_URL": url})


def test_a_streamed_key_is_staged_in_bulk_with_flat_memory(warehouse) -> None:
    """A key streamed as batches is staged batch by batch: the Python memory at its peak is the same for 4 batches
    and for 16 (one batch's values at a time, whatever the key's size), and every row is there once committed."""
    size = 1_000
    schema = pa.schema([("order_id", pa.string()), ("total", pa.float64())])

    def batch(number: int) -> pa.Table:
        first = number * size
        return pa.table({"order_id": [f"order-{first + i:09d}-{'x' * 40}" for i in range(size)],
                         "total": [float(first + i) for i in range(size)]}, schema=schema)  # fmt: skip

    arrow_held: list[int] = []  # Arrow's allocations (not Python's, which tracemalloc sees) as each batch is made

    def batches(count: int):
        for number in range(count):
            made = batch(number)
            arrow_held.append(pa.total_allocated_bytes())
            yield made

    def staged_with_peak(count: int, token: int):
        tracemalloc.start()
        try:
            staged = warehouse.stage(TARGET, token, TableStream(schema, batches(count)), "csv", manifest_for(token))
            return staged, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, small_peak = staged_with_peak(4, 1)
    large, large_peak = staged_with_peak(16, 2)
    assert large_peak < 1.5 * small_peak, f"Python's peak: {large_peak} bytes for 16 batches, {small_peak} for 4"
    one = batch(0).nbytes
    assert max(arrow_held) - min(arrow_held) < 4 * one, "the batches already staged are let go, not gathered"
    warehouse.unstage(small)
    warehouse.commit(large, 2, superseded=0)
    assert large.manifest.row_count == 16 * size
    with warehouse._engine().connect() as conn:
        count = conn.execute(sa.text("SELECT COUNT(*) FROM exported_orders WHERE _export_key = :k"), {"k": str(KEY)})
        assert count.scalar() == 16 * size


def test_a_stream_that_fails_midway_leaves_no_staged_row(warehouse) -> None:
    """A batch that fails validation after others were staged (on DuckDB, already committed batch by batch) raises
    from stage, and no row of the attempt's place is left in the staging table."""
    schema = rows(1.0).schema

    def failing():
        yield rows(1.0)
        raise FrameError("batch 2: a row outside the window")

    with pytest.raises(FrameError):
        warehouse.stage(TARGET, 1, TableStream(schema, failing()), "csv", manifest_for(1))
    with warehouse._engine().connect() as conn:
        # PostgreSQL rolls the staging table's creation back with the rows (its DDL is transactional).
        made = sa.inspect(conn).has_table("exported_orders_staged")
        left = conn.execute(sa.text("SELECT COUNT(*) FROM exported_orders_staged")).scalar() if made else 0
    assert left == 0, "nothing of the failed stream is left"
    assert visible(warehouse) == []


def test_a_run_pointed_at_another_warehouse_database_is_refused_and_exports_nothing(
    request, tmp_path, instance, monkeypatch
) -> None:
    """The export's contract records which database its warehouse is (host, port, database; never the user or the
    password): a run whose ``EXPORTS_WAREHOUSE_URL`` names another database, with the same table name, is refused
    at its claim, naming both, and nothing reaches that database."""
    from pipeline_helpers import failure_message, make_defs, run_partition

    from export_ledger.destinations.warehouse import warehouse_locator

    first = warehouse_destination("postgres", request, tmp_path)
    other = warehouse_destination("postgres", request, tmp_path)
    monkeypatch.setenv("EXPORTS_WAREHOUSE_URL", first.warehouse_url)
    assert run_partition(make_defs(tmp_path, destination=first), instance, "2026-03-07").success

    monkeypatch.setenv("EXPORTS_WAREHOUSE_URL", other.warehouse_url)
    refused = run_partition(make_defs(tmp_path, destination=other), instance, "2026-03-08")

    assert not refused.success
    said = failure_message(refused)
    assert warehouse_locator(other.warehouse_url) in said and warehouse_locator(first.warehouse_url) in said, said
    for url in (first.warehouse_url, other.warehouse_url):
        assert sa.make_url(url).password not in said, "the password is never shown"
    engine = sa.create_engine(other.warehouse_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            assert sa.inspect(conn).get_table_names() == [], "nothing fenced, staged or written in the other database"
    finally:
        engine.dispose()
    assert sa.make_url(first.warehouse_url).password not in str(first.identity("orders"))


def test_the_recorded_locator_names_the_database_not_the_user_password_driver_or_query() -> None:
    from export_ledger.destinations.warehouse import warehouse_locator

    same = warehouse_locator("postgresql+psycopg2://a:pw1@db.example/analytics?sslmode=require")
    assert (
        same
        == warehouse_locator("postgresql://b:pw2@db.example:5432/analytics")
        == "postgresql://db.example:5432/analytics"
    )
    assert warehouse_locator("postgresql://a:pw1@db.example/other") != same
    assert "SECRET" not in warehouse_locator("duckdb:///md:db?motherduck_token=SECRET")


def test_a_column_name_is_an_identifier_never_sql(warehouse) -> None:
    """DuckDB's Arrow path builds its INSERT from column names: a name holding ``"`` is quoted as an identifier (the
    quote doubled), stored under that very name as on PostgreSQL and MariaDB, and never read as SQL (a name that
    closes the quote and names a reserved column does not reach it)."""
    odd = {'to"tal': [1.0, 2.0], 'x", "_export_token': [3.0, 4.0]}
    staged = warehouse.stage(TARGET, 1, pa.table({"order_id": ["a", "b"], **odd}), "csv", manifest_for(1))
    warehouse.commit(staged, 1, superseded=0)
    with warehouse._engine().connect() as conn:
        found = conn.execute(sa.select(sa.text("*")).select_from(sa.table("exported_orders")).limit(0)).keys()
        values = conn.execute(sa.text("SELECT * FROM exported_orders ORDER BY _export_row")).mappings().all()
    assert set(found) == {"_export_key", "_export_row", "order_id", *odd}
    assert [[row[name] for name in odd] for row in values] == [[1.0, 3.0], [2.0, 4.0]]


def _while_another_fences(warehouse: WarehouseDestination, step, fence: int = 6, statement: str | None = None):
    """Runs ``step`` while another party's transaction holds the marker's row, raising its fence to ``fence`` (or
    running ``statement``), and commits that transaction once ``step`` has read the marker and waits on the row: what
    it returned or raised."""
    engine = sa.create_engine(warehouse.warehouse_url, poolclass=sa.pool.NullPool)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["returned"] = step()
        except Exception as exc:  # noqa: BLE001  (the outcome is what the test judges)
            outcome["raised"] = exc

    try:
        with engine.connect() as other:
            other.execute(sa.text(statement or "UPDATE exported_orders_markers SET fence = :fence"), {"fence": fence})
            worker = threading.Thread(target=run)
            worker.start()
            worker.join(1.0)  # it reads the marker (a plain read does not wait) and waits at its guarded UPDATE
            assert worker.is_alive(), f"the step did not wait for the other party's row lock: {outcome}"
            other.commit()
            worker.join(30)
    finally:
        engine.dispose()
    return outcome


def test_a_fence_or_commit_that_loses_to_a_higher_fence_meanwhile_is_told_fenced(waiting_warehouse) -> None:
    """A party whose guarded UPDATE matched nothing because a higher fence committed after it first read the marker is
    refused as Fenced: the marker is read again as committed now, not from the snapshot of its first read (MariaDB's
    default REPEATABLE READ would show the old fence: the fence would be granted, the commit called a moved pointer,
    which the ledger records as a conflict)."""
    warehouse = waiting_warehouse
    warehouse.fence(TARGET, 4, logical_key=str(KEY))
    fenced = _while_another_fences(warehouse, lambda: warehouse.fence(TARGET, 5, logical_key=str(KEY)))
    assert isinstance(fenced.get("raised"), Fenced), f"a fence above the party's token is not granted: {fenced}"

    staged = warehouse.stage(TARGET, 7, rows(1.0), "csv", manifest_for(7))
    warehouse.fence(TARGET, 7, logical_key=str(KEY))
    refused = _while_another_fences(warehouse, lambda: warehouse.commit(staged, 7, superseded=0), fence=8)
    assert isinstance(refused.get("raised"), Fenced), f"a fenced commit is Fenced, not a conflict: {refused}"
    assert visible(warehouse) == [], "nothing of the fenced party is visible"


@pytest.mark.parametrize(
    "url", ["postgresql://exporter:s3cr@t-pw@127.0.0.1:5432/analytics", "s3cr3t-pw", "./s3cr3t-pw.duckdb"]
)
def test_a_url_sqlalchemy_would_misread_is_refused_where_it_is_set_without_echo(url) -> None:
    """An un-encoded '@' in the password makes its tail the host (the locator the contract records would carry it);
    text that is no URL at all (a password pasted alone) would be opened as a SQLite file of that name."""
    with pytest.raises(ConfigurationError, match="EXPORTS_WAREHOUSE_URL") as refused:
        destination_from("warehouse:exported_{export}", ledger_url="", environ={"EXPORTS_WAREHOUSE_URL": url})
    assert "t-pw" not in str(refused.value)


def test_a_commit_whose_staged_rows_are_gone_is_refused_and_shows_nothing(warehouse) -> None:
    """The commit counts the rows it moves: when the place's staged rows are not all there (swept, or removed by hand)
    it is refused, rolled back whole: the marker is not moved and readers see nothing of it (never an empty key)."""
    staged = warehouse.stage(TARGET, 1, rows(1.0), "csv", manifest_for(1))
    with warehouse._engine().begin() as conn:
        conn.execute(sa.text("DELETE FROM exported_orders_staged WHERE _export_row >= 3"))
    with pytest.raises(DestinationError, match="staged rows .* were found, not 24"):
        warehouse.commit(staged, 1, superseded=0)
    assert visible(warehouse) == []
    assert warehouse.pointer(TARGET).revision == 0


def test_a_user_who_may_not_create_the_tables_is_refused_naming_them_not_left_unknown(
    request, tmp_path, postgres_admin_url
) -> None:
    """A warehouse user without the right to create tables, in a database without them: the fence is refused naming
    the tables (nothing was written), not an unknown outcome that sends the key to reconciliation again and again."""
    destination = warehouse_destination("postgres", request, tmp_path)
    url = sa.make_url(destination.warehouse_url)
    admin = sa.create_engine(
        sa.make_url(postgres_admin_url).set(database=url.database), isolation_level="AUTOCOMMIT",
        poolclass=sa.pool.NullPool,
    )  # fmt: skip
    with admin.connect() as conn:
        conn.execute(sa.text(f"REVOKE CREATE ON SCHEMA public FROM {url.username}"))
    admin.dispose()

    with pytest.raises(DestinationError, match="cannot create the tables exported_orders_history, exported_orders_mar"):
        destination.fence(TARGET, 1, logical_key=str(KEY))
    assert url.password not in str(destination.describe())


def test_verifying_a_large_key_holds_one_batch_not_the_key(warehouse) -> None:
    """A retry or reconciliation that finds its revision committed re-hashes the key's rows: it reads them batch by
    batch, so Python's peak while verifying a key of 20,000 rows is that of one of 5,000, and the verdict holds."""
    schema = pa.schema([("order_id", pa.string()), ("total", pa.float64())])

    def committed(size: int, token: int):
        table = pa.table({"order_id": [f"order-{i:09d}-{'x' * 40}" for i in range(size)],
                          "total": [float(i) for i in range(size)]}, schema=schema)  # fmt: skip
        target = ExportTarget(KEY.export, KEY.tenant, f"2026-03-0{token}", 1)
        key = f"{KEY}-{token}"
        staged = warehouse.stage(target, token, table, "csv", replace(manifest_for(token), logical_key=key))
        warehouse.commit(staged, token, superseded=0)
        return target, key, staged.manifest.sha256

    def verified_with_peak(target: ExportTarget, key: str, sha256: str):
        tracemalloc.start()
        try:
            verdict = warehouse.verify(target, logical_key=key, superseded=0, expected_sha256=sha256)
            return verdict, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = committed(5_000, 1), committed(20_000, 2)
    verified_with_peak(*small)  # the first read of a table warms SQLAlchemy's caches
    (small_verdict, small_peak), (large_verdict, large_peak) = verified_with_peak(*small), verified_with_peak(*large)
    assert small_verdict.verdict is large_verdict.verdict is Verdict.PUBLISHED, large_verdict.detail
    assert large_peak < 1.5 * small_peak, f"Python's peak: {large_peak} bytes for 20,000 rows, {small_peak} for 5,000"


def test_a_first_commit_racing_a_fence_that_makes_the_marker_is_told_fenced(waiting_warehouse) -> None:
    """A first export (no marker yet) commits while a newer party's fence inserts the key's marker at revision 0:
    Fenced, and nothing of it visible. On PostgreSQL the commit's own INSERT of the marker waits on the key, fails on
    it once the fence commits, and is judged again; on MariaDB its guarded UPDATE already waits on the fence's
    uncommitted insert and then matches nothing, judged the same way (the INSERT's retry is then never reached)."""
    warehouse = waiting_warehouse
    staged = warehouse.stage(TARGET, 1, rows(1.0), "csv", manifest_for(1))
    insert = (
        "INSERT INTO exported_orders_markers (export, tenant, business_date, fence, logical_key, revision) "
        f"VALUES ('{TARGET.export}', '{TARGET.tenant}', '{TARGET.business_date}', :fence, '{KEY}', 0)"
    )
    refused = _while_another_fences(warehouse, lambda: warehouse.commit(staged, 1, superseded=0), 2, insert)
    assert isinstance(refused.get("raised"), Fenced), refused
    assert visible(warehouse) == []
    assert (warehouse.pointer(TARGET).revision, warehouse.pointer(TARGET).fence) == (0, 2)


def test_an_operator_command_finds_the_recorded_table_with_the_environments_password(
    request, tmp_path, instance, monkeypatch
) -> None:
    """A key is acted on where its contract says (its table, its database), whatever the code names now; credentials
    come from the environment: the URL the environment holds (with its password) is kept when it names the recorded
    database, never replaced by the recorded locator, which has no password."""
    from pipeline_helpers import make_defs, run_partition

    from export_ledger.placement import recorded_destinations

    first = warehouse_destination("postgres", request, tmp_path)
    monkeypatch.setenv("EXPORTS_WAREHOUSE_URL", first.warehouse_url)
    assert run_partition(make_defs(tmp_path, destination=first), instance, "2026-03-07").success
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    records = ledger.queries.records(tenant="acme")
    renamed = WarehouseDestination(table="renamed_{export}", warehouse_url=first.warehouse_url)

    chosen = recorded_destinations(ledger, records, known=renamed, environ={})
    (found,) = set(chosen.values())
    export = records[0].export
    assert found.root_of(export) == first.root_of(export) != renamed.root_of(export), "the recorded table"
    assert found.warehouse_url == first.warehouse_url, "the environment's URL, password and all"
    assert found.pointer(TARGET) is not None


def test_a_fenced_party_that_staged_after_the_sweep_leaves_no_staged_row(warehouse) -> None:
    """The newer party fences and sweeps before the older one has finished staging: the older one's rows land after
    the sweep. Its commit is refused as Fenced and removes its own place, so nothing of it stays in the staging
    table until some later party happens to sweep the key."""
    pointer = warehouse.fence(TARGET, 2, logical_key=str(KEY))
    assert warehouse.sweep(TARGET, 2, pointer) == 0
    late = warehouse.stage(TARGET, 1, rows(1.0), "csv", manifest_for(1))
    with pytest.raises(Fenced):
        warehouse.commit(late, 1, superseded=0)
    with warehouse._engine().connect() as conn:
        left = conn.execute(sa.text("SELECT COUNT(*) FROM exported_orders_staged")).scalar()
    assert left == 0, "the fenced party's staged rows are removed by its refused commit"
    assert visible(warehouse) == []
