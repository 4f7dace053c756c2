"""Reading back what is current (issue 30, item 3): :func:`export_ledger.read_current` returns exactly the current
revision of every key of a range, from the destination's evidence alone, and the DuckDB query of docs/reading.md
returns the same rows over the local layout.

Keys are exported and restated through the real protocol (``export_key``, then ``request_each`` and ``export_key``
again): revision ``r`` of a key holds the key's hourly orders with ``total == r``, so a frame that mixed two revisions
of a key, or lost one, shows it in its rows.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
from pathlib import Path

import pandas as pd
import pytest
from builders import ORDERS_DAY as DAY
from builders import ORDERS_SCHEMA as SCHEMA
from builders import hourly_orders, key_folder, key_for
from restatement_support import s3_destination

from export_ledger import (
    CalendarError,
    ConfigurationError,
    CurrentRevisionUnreadable,
    ExportItem,
    ExportSpec,
    LocalDestination,
    export_key,
    read_current,
)
from export_ledger.destinations import DestinationUnreachable
from export_ledger.destinations.delta import DeltaDestination
from export_ledger.destinations.local import LocalStore
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.ledger.errors import LedgerUnavailable
from export_ledger.restate import request_each

EXPORT = "orders"
ZONE = "America/New_York"
TENANTS = ("acme", "globex", "initech")
READING = Path(__file__).resolve().parents[1] / "docs" / "reading.md"


def key(tenant: str, day: dt.date = DAY):
    return key_for(day, export=EXPORT, tenant=tenant)


def revision_rows(k, revision: int) -> pd.DataFrame:
    """What revision ``revision`` of key ``k`` holds: its hourly orders, every total ``revision``."""
    return hourly_orders(k, total=float(revision))


def publish(ledger, destination, k, revision: int, run: str) -> None:
    """Revision 1 of ``k`` (its first export), or revision ``revision`` through a restatement requested first."""
    if revision > 1:
        report = request_each(ledger, [(str(k), f"revision {revision}")], requested_by="test")
        assert not report.refused, report.refused
    item = ExportItem(k, k.window.business_date.isoformat(), revision_rows(k, revision))
    result = export_key(ledger, destination, SCHEMA, item, f"{run}/export")
    assert result.status == "exported", result


def read(destination, first: dt.date = DAY, last: dt.date = DAY, **options) -> pd.DataFrame:
    options.setdefault("tenants", list(TENANTS))
    return read_current(destination, first, last, export=EXPORT, timezone=ZONE, **options)


def rows_of(frame: pd.DataFrame, k) -> pd.DataFrame:
    placed = frame["placed_at"]
    mine = frame[(frame["tenant"] == k.tenant) & (placed >= k.window.start_utc) & (placed < k.window.end_utc)]
    return mine.reset_index(drop=True)


def assert_one_revision_each(frame: pd.DataFrame, keys) -> dict[str, int]:
    """Each key's rows are exactly one whole revision's, the one ``attrs["current"]`` names; returns the revisions."""
    seen = {}
    for k in keys:
        mine = rows_of(frame, k)
        totals = set(mine["total"])
        assert len(totals) == 1, f"{k}: rows of revisions {sorted(totals)} in one read (or of none)"
        revision = int(totals.pop())
        assert frame.attrs["current"][str(k)] == revision, f"{k}: attrs name another revision than the rows"
        expected = revision_rows(k, revision)
        assert len(mine) == len(expected), f"{k}: revision {revision} read with {len(mine)} of {len(expected)} rows"
        assert list(mine["order_id"]) == list(expected["order_id"]), f"{k}: not revision {revision}'s rows"
        seen[str(k)] = revision
    assert len(frame) == sum(len(revision_rows(k, 1)) for k in keys), "no row outside the keys read"
    return seen


@pytest.fixture(params=["local", "s3", "sftp", "delta", "ledger-table"])
def destination(request, tmp_path, sqlite_url):
    """Every kind the tests reach without a server of their own (GCS and Azure are the object-store template local
    and S3 are, over other stores), and SFTP (its pointer is a sequence of pointer objects, read another way)."""
    if request.param == "sftp":
        return request.getfixturevalue("sftp_server").destination(request.getfixturevalue("sftp_folder"))
    if request.param == "local":
        return LocalDestination(exports_folder(tmp_path))
    if request.param == "s3":
        return s3_destination(request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_server"))
    if request.param == "delta":
        return DeltaDestination(str(tmp_path / "delta" / "{export}"))
    return SqlTableDestination(url=sqlite_url, table="exported_{export}")


# -- what is read ------------------------------------------------------------------------------------------------------


def test_a_restated_key_is_read_at_its_current_revision_only_and_a_key_never_published_is_absent(ledger, destination):
    for tenant in ("acme", "globex"):
        publish(ledger, destination, key(tenant), 1, f"run-1-{tenant}")
    publish(ledger, destination, key("acme"), 2, "run-2")
    publish(ledger, destination, key("acme"), 3, "run-3")

    frame = read(destination)

    assert assert_one_revision_each(frame, [key("acme"), key("globex")]) == {
        str(key("acme")): 3,
        str(key("globex")): 1,
    }, "the pointer's revision of each key, never an earlier one beside it"
    assert frame.attrs["missing"] == [str(key("initech"))], "a key never published is absent, and listed as such"
    assert rows_of(frame, key("initech")).empty


def test_a_spec_reads_where_its_keys_are_exported_in_its_columns_kinds(ledger, tmp_path):
    destination = LocalDestination(exports_folder(tmp_path))
    spec = ExportSpec(
        name=EXPORT, columns=SCHEMA.columns, id_columns=SCHEMA.id_columns, time_column=SCHEMA.time_column,
        tenant_column="tenant", tenants=list(TENANTS), timezone=ZONE, start_date="2026-03-01",
        destination=str(tmp_path / "exports"),
    )  # fmt: skip
    publish(ledger, destination, key("globex"), 1, "run-1")

    by_spec = read_current(spec, DAY, DAY)
    by_destination = read_current(destination, DAY, DAY, export=spec)

    pd.testing.assert_frame_equal(by_spec, by_destination)
    assert list(by_spec.columns) == list(SCHEMA.columns), "the export's columns, none added"
    assert str(by_spec["placed_at"].dtype).startswith("datetime64") and by_spec["total"].dtype == float
    assert by_spec.attrs["missing"] == [str(key("acme")), str(key("initech"))]


def exports_folder(tmp_path: Path) -> str:
    """An export folder that exists, with nothing published in it yet."""
    folder = tmp_path / "exports"
    folder.mkdir(exist_ok=True)
    return str(folder)


def test_a_local_folder_that_does_not_exist_is_an_error_not_every_key_missing(tmp_path):
    """A mistyped or unmounted folder would read as every key missing, the same as nothing published: refused, naming
    the folder. Guard: ``LocalDestination.reading``'s check of its root."""
    with pytest.raises(DestinationUnreachable, match=r"export folder .*exprots does not exist"):
        read(LocalDestination(str(tmp_path / "exprots")), DAY, DAY, tenants=["acme"])


def test_nothing_published_reads_as_an_empty_frame_of_the_exports_columns(tmp_path):
    spec = ExportSpec(
        name=EXPORT, columns=SCHEMA.columns, id_columns=SCHEMA.id_columns, time_column=SCHEMA.time_column,
        tenant_column="tenant", tenants=["acme"], timezone=ZONE, start_date="2026-03-01",
    )  # fmt: skip
    frame = read_current(LocalDestination(exports_folder(tmp_path)), DAY, DAY, export=spec)
    assert frame.empty and list(frame.columns) == list(SCHEMA.columns)
    assert frame.attrs == {"current": {}, "missing": [str(key("acme"))]}


# -- what is refused -----------------------------------------------------------------------------------------------


def test_a_data_file_whose_sha256_is_not_the_recorded_one_is_an_error_naming_the_key(ledger, tmp_path):
    destination = LocalDestination(exports_folder(tmp_path))
    for tenant in TENANTS:
        publish(ledger, destination, key(tenant), 1, f"run-{tenant}")
    folder = key_folder(tmp_path / "exports", key("globex"))
    data = next(folder.glob("r1-t*/data.csv"))
    data.write_text(data.read_text().replace("globex-", "gl0bex-", 1))

    with pytest.raises(CurrentRevisionUnreadable, match=re.escape(str(key("globex")))) as caught:
        read(destination)
    assert caught.value.logical_key == str(key("globex"))
    assert "sha256" in str(caught.value)


class SwappedAfterTheVerdict(LocalDestination):
    """A local folder whose data file changes between the verdict on it and the read of it."""

    def read_data(self, target, manifest):
        return super().read_data(target, manifest).replace(b"Z,1", b"Z,7", 1)


def test_data_that_changed_between_its_check_and_its_read_is_refused_not_returned(ledger, tmp_path):
    publish(ledger, LocalDestination(exports_folder(tmp_path)), key("acme"), 1, "run-1")
    swapped = SwappedAfterTheVerdict(str(tmp_path / "exports"))
    with pytest.raises(CurrentRevisionUnreadable, match=re.escape(str(key("acme")))):
        read(swapped, tenants=["acme"])


@pytest.mark.parametrize(
    ("start", "end", "options", "error", "words"),
    [
        (DAY, DAY - dt.timedelta(days=1), {}, CalendarError, "reversed"),
        (dt.datetime(2026, 3, 2, 0, 0), DAY, {}, CalendarError, "naive datetime"),
        (DAY, dt.datetime(2026, 3, 2, tzinfo=dt.UTC), {}, CalendarError, "an instant is a different day"),
        ("2026-03-32", DAY, {}, CalendarError, "invalid partition key"),
        (DAY, DAY + dt.timedelta(days=366), {}, ConfigurationError, "367 days, more than max_days=366"),
        (DAY, DAY + dt.timedelta(days=3), {"max_days": 3}, ConfigurationError, "4 days, more than max_days=3"),
        (DAY, DAY, {"max_days": 0}, ConfigurationError, "max_days must be a positive number"),
        (DAY, DAY, {"tenants": "acme"}, ConfigurationError, "a list of tenant ids"),
        (DAY, DAY, {"tenants": ["acme", "acme"]}, ConfigurationError, "duplicate tenant"),
        (DAY, DAY, {"tenants": None}, ConfigurationError, "cannot list its tenants"),
    ],
)
def test_a_bad_range_or_tenant_list_is_refused_naming_the_problem(tmp_path, start, end, options, error, words):
    with pytest.raises(error, match=re.escape(words)):
        read(LocalDestination(exports_folder(tmp_path)), start, end, **options)


def test_a_long_range_is_read_when_asked_for(tmp_path):
    frame = read(LocalDestination(exports_folder(tmp_path)), DAY, DAY + dt.timedelta(days=400), max_days=None,
                 tenants=["acme"])  # fmt: skip
    assert len(frame.attrs["missing"]) == 401


def test_a_destination_needs_its_export_and_a_spec_its_own_tenants_and_dates(tmp_path):
    destination = LocalDestination(exports_folder(tmp_path))
    with pytest.raises(ConfigurationError, match="name the one to read"):
        read_current(destination, DAY, DAY, tenants=["acme"])
    with pytest.raises(ConfigurationError, match="needs timezone="):
        read_current(destination, DAY, DAY, export=EXPORT, tenants=["acme"])
    spec = ExportSpec(
        name=EXPORT, columns=SCHEMA.columns, id_columns=SCHEMA.id_columns, time_column=SCHEMA.time_column,
        tenant_column="tenant", tenants=["acme"], timezone=ZONE, start_date="2026-03-01",
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="has no tenant globex"):
        read_current(destination, DAY, DAY, export=spec, tenants=["globex"])
    with pytest.raises(CalendarError, match="before export 'orders' starts"):
        read_current(destination, dt.date(2026, 2, 28), DAY, export=spec)


def orders_spec(**fields) -> ExportSpec:
    return ExportSpec(
        name=EXPORT, columns=SCHEMA.columns, id_columns=SCHEMA.id_columns, time_column=SCHEMA.time_column,
        tenant_column="tenant", tenants=list(TENANTS), timezone=ZONE, start_date="2026-03-01", **fields,
    )  # fmt: skip


def test_a_spec_without_a_destination_of_its_own_is_refused_never_guessed_from_the_environment(
    ledger, tmp_path, monkeypatch
):
    """Neither EXPORTS_DESTINATION nor ./var/exports is read: a guess at a partner's folder reads as every key
    missing. The error says how to name the destination."""
    monkeypatch.chdir(tmp_path)
    exported = LocalDestination(str(tmp_path / "var" / "exports"))
    publish(ledger, exported, key("acme"), 1, "run-1")
    monkeypatch.setenv("EXPORTS_DESTINATION", str(tmp_path / "var" / "exports"))
    with pytest.raises(ConfigurationError, match=r"declares no destination of its own.*export=spec"):
        read_current(orders_spec(), DAY, DAY)
    monkeypatch.delenv("EXPORTS_DESTINATION")
    with pytest.raises(ConfigurationError, match="does not guess one"):
        read_current(orders_spec(), DAY, DAY)
    frame = read_current(exported, DAY, DAY, export=orders_spec())  # the way the error names
    assert frame.attrs["current"] == {str(key("acme")): 1}


def test_a_ledger_table_spec_reads_the_database_exports_ledger_url_names_never_a_default_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EXPORTS_LEDGER_URL", raising=False)
    with pytest.raises(ConfigurationError, match="EXPORTS_LEDGER_URL is not set"):
        read_current(orders_spec(destination="ledger-table:exported_{export}"), DAY, DAY)
    assert not (tmp_path / "var").exists(), "no ./var/ledger.sqlite3 made by a reader"


def test_a_reader_never_creates_the_database_of_a_ledger_table(tmp_path):
    nowhere = tmp_path / "elsewhere" / "ledger.sqlite3"
    destination = SqlTableDestination(url=f"sqlite:///{nowhere}", table="exported_{export}")
    with pytest.raises(LedgerUnavailable, match="does not exist"):
        read(destination)
    assert not nowhere.parent.exists(), "a reader creates no folder, no file and no ledger schema"


class ReadOnlyFolder(LocalStore):
    """A local folder that refuses every write, fsync and lock: what a reader on a read-only copy may do is read."""

    def _refuse(self, *_args, **_kwargs):
        raise AssertionError("a reader wrote to, fsynced or locked the destination")

    put_if_absent = put_if_match = upload = delete = settle = prepare = sync = _locked = _refuse


class ReadOnlyDestination(LocalDestination):
    @property
    def store(self) -> LocalStore:
        return ReadOnlyFolder(Path(self.root).resolve())


def test_a_reader_only_reads_a_local_folder_never_writes_fsyncs_or_locks(ledger, tmp_path):
    exported = LocalDestination(exports_folder(tmp_path))
    publish(ledger, exported, key("acme"), 1, "run-1")
    publish(ledger, exported, key("acme"), 2, "run-2")
    publish(ledger, exported, key("globex"), 1, "run-3")
    frame = read(ReadOnlyDestination(str(tmp_path / "exports")))
    assert assert_one_revision_each(frame, [key("acme"), key("globex")]) == {str(key("acme")): 2,
                                                                            str(key("globex")): 1}  # fmt: skip


# -- while a restatement is published ---------------------------------------------------------------------------------


class RestatedWhileRead(LocalDestination):
    """A local folder whose key is restated once, right after a reader read its pointer and before the verdict."""

    def __init__(self, root: str, restate) -> None:
        super().__init__(root)
        object.__setattr__(self, "_restate", restate)

    def current_revision(self, target):
        revision = super().current_revision(target)
        restate = self._restate
        object.__setattr__(self, "_restate", None)  # once
        if restate is not None:
            restate()
        return revision


def test_a_key_restated_between_its_pointer_and_its_verdict_is_read_at_the_new_revision(ledger, tmp_path):
    plain = LocalDestination(exports_folder(tmp_path))
    publish(ledger, plain, key("acme"), 1, "run-1")
    racing = RestatedWhileRead(str(tmp_path / "exports"), lambda: publish(ledger, plain, key("acme"), 2, "run-2"))

    frame = read(racing, tenants=["acme"])

    assert assert_one_revision_each(frame, [key("acme")]) == {str(key("acme")): 2}


@pytest.mark.parametrize("kind", ["local", "s3", "sftp"])
def test_a_reader_never_sees_two_revisions_of_a_key_or_none_while_restatements_are_published(
    request, ledger, tmp_path, kind
):
    """A reader thread reads the range in a loop while another thread restates every key of it, key by key, three
    times: every read shows each key exactly once, whole, at one revision, and no key's revision goes backwards."""
    if kind == "local":
        destination = LocalDestination(exports_folder(tmp_path))
    elif kind == "sftp":
        destination = request.getfixturevalue("sftp_server").destination(request.getfixturevalue("sftp_folder"))
    else:
        destination = s3_destination(request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_server"))
    days = (DAY, DAY + dt.timedelta(days=1))
    keys = [key(tenant, day) for day in days for tenant in TENANTS]
    for k in keys:
        publish(ledger, destination, k, 1, f"run-1-{k.tenant}-{k.window.business_date}")
    done = threading.Event()
    failures: list[BaseException] = []

    def restate_all() -> None:
        try:
            for revision in (2, 3, 4):
                for k in keys:
                    publish(ledger, destination, k, revision, f"run-{revision}-{k.tenant}-{k.window.business_date}")
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=restate_all, name="restatements")
    writer.start()
    reads, last = 0, dict.fromkeys(map(str, keys), 1)
    try:
        while not done.is_set() or reads == 0:
            frame = read(destination, days[0], days[-1])
            assert frame.attrs["missing"] == [], "no key is ever unpublished by a restatement"
            seen = assert_one_revision_each(frame, keys)
            assert all(seen[k] >= last[k] for k in seen), f"a revision went backwards: {last} then {seen}"
            last, reads = seen, reads + 1
    finally:
        writer.join()
    assert not failures, failures
    assert reads >= 2, "the reader read while the restatements were published"
    assert assert_one_revision_each(read(destination, days[0], days[-1]), keys) == dict.fromkeys(map(str, keys), 4)


# -- the documented DuckDB query -----------------------------------------------------------------------------------


def documented_query() -> str:
    """The query of docs/reading.md: the ```sql block after the marker ``<!-- read-current-query -->``."""
    text = READING.read_text()
    found = re.search(r"<!-- read-current-query -->\s*```sql\n(.*?)```", text, flags=re.S)
    assert found, "docs/reading.md holds the query after its marker"
    return found.group(1)


def test_the_documented_duckdb_query_returns_exactly_what_read_current_returns(ledger, tmp_path, monkeypatch):
    duckdb = pytest.importorskip("duckdb", reason="the [read] extra (or [dev]) installs duckdb")
    monkeypatch.chdir(tmp_path)  # the query reads var/exports/orders/..., as the docs say
    destination = LocalDestination(str(tmp_path / "var" / "exports"))
    first, last = dt.date(2026, 3, 1), dt.date(2026, 3, 7)  # the docs' range
    for tenant in ("acme", "globex"):
        publish(ledger, destination, key(tenant), 1, f"run-1-{tenant}")
    publish(ledger, destination, key("acme"), 2, "run-2")  # a restated key: revision 1 stays beside it
    publish(ledger, destination, key("initech", dt.date(2026, 3, 8)), 1, "run-out")  # outside the range
    assert len(list(key_folder(tmp_path / "var" / "exports", key("acme")).glob("r*-t*/data.csv"))) == 2

    expected = read(destination, first, last)
    with duckdb.connect() as connection:
        got = connection.sql(documented_query()).df()

    def normal(frame: pd.DataFrame) -> pd.DataFrame:
        frame = frame.assign(placed_at=pd.to_datetime(frame["placed_at"], utc=True).astype("datetime64[us, UTC]"))
        frame = frame.astype({"order_id": str, "tenant": str, "total": float})
        return frame.sort_values(["tenant", "placed_at", "order_id"]).reset_index(drop=True)

    assert len(got) == len(expected) == 48, "each key's current revision once, revision 1 of acme not beside it"
    pd.testing.assert_frame_equal(normal(got), normal(expected), check_dtype=False)


def test_the_documented_query_refuses_a_data_file_whose_sha256_is_not_the_pointers(ledger, tmp_path, monkeypatch):
    duckdb = pytest.importorskip("duckdb", reason="the [read] extra (or [dev]) installs duckdb")
    monkeypatch.chdir(tmp_path)
    destination = LocalDestination(str(tmp_path / "var" / "exports"))
    publish(ledger, destination, key("acme"), 1, "run-1")
    folder = key_folder(tmp_path / "var" / "exports", key("acme"))
    assert (folder / POINTER_NAME).is_file()
    data = next(folder.glob("r1-t*/data.csv"))
    data.write_text(data.read_text().replace("Z,1", "Z,7", 1))
    with duckdb.connect() as connection, pytest.raises(duckdb.Error, match="sha256"):
        connection.sql(documented_query()).df()
