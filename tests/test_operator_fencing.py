"""Fencing of the parties that change a key's place besides its attempt (docs/protocol.md), each a scenario that broke
an invariant before its fix (the adversarial review of protocol v2): an operator's discard racing a newer commit, a
withdrawal releasing the key to a state read before its hold, a zone changed without a move, two ledger keys sharing
one folder, a group's committed keys losing their leases, and a killed writer's rows left in a swept place."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path

import pytest
from builders import hourly_orders as orders
from builders import open_ledger

from export_ledger.calendar import ExportCalendar, window_for
from export_ledger.destinations import LocalDestination, place_name
from export_ledger.destinations.local import LocalStore
from export_ledger.frames import ExportSchema
from export_ledger.keys import LogicalKey
from export_ledger.ledger import ContractChanged, ExportState, ResolutionRefused, RestatementRefused
from export_ledger.protocol import ExportBatch, ExportItem, export_batch, export_key
from export_ledger.reconcile import reconcile_batch
from export_ledger.resolve import resolve_key
from export_ledger.restate import withdraw
from export_ledger.steps import ExportConflict

UTC = dt.timezone.utc
SCHEMA = ExportSchema(
    {"order_id": "string", "tenant": "string", "placed_at": "timestamp", "total": "float"},
    "placed_at",
    ("order_id",),
    tenant_column="tenant",
)
LEASE = dt.timedelta(minutes=15)


def key_for(day: dt.date = dt.date(2026, 3, 2), tenant: str = "acme", zone: str = "America/New_York") -> LogicalKey:
    return LogicalKey("invoice_export", tenant, window_for(day, zone))


def item(key: LogicalKey, frame=None) -> ExportItem:
    return ExportItem(key, key.window.business_date.isoformat(), orders(key) if frame is None else frame)


def folder(root: str, key: LogicalKey) -> Path:
    return Path(root) / key.export / f"tenant={key.tenant}" / f"date={key.window.business_date.isoformat()}"


def reader_sees(root: str, key: LogicalKey) -> tuple[int, str | None, bool]:
    """What a reader sees, read without the library: (revision, place, whether the data it names is intact)."""
    pointer_file = folder(root, key) / "_current.json"
    if not pointer_file.exists():
        return 0, None, True
    pointer = json.loads(pointer_file.read_text())
    if pointer["revision"] == 0:
        return 0, None, True
    data = folder(root, key) / pointer["data_file"]
    intact = data.exists() and hashlib.sha256(data.read_bytes()).hexdigest() == pointer["sha256"]
    return pointer["revision"], pointer["path"], intact


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "exports")


def failing_at(point: str, run) -> None:
    os.environ["EXPORTS_FAILPOINTS"] = f"{point}=raise"
    try:
        run()
    except Exception:
        pass
    finally:
        del os.environ["EXPORTS_FAILPOINTS"]


def test_an_operators_discard_paused_past_its_lease_never_deletes_a_newer_partys_commit(ledger, root, clock):
    """The operator holds (token 2), fences and sets the pointer back; paused before it lists the places, it loses the
    key to a worker (token 3) that commits and records. The discard resumes: it must delete nothing of token 3's."""
    key = key_for()
    failing_at("after_publish", lambda: export_key(ledger, LocalDestination(root), SCHEMA, item(key), "w1/export"))
    assert ledger.queries.get(str(key)).state is ExportState.REMOTE_UNKNOWN

    class PausingStore(LocalStore):
        paused = False

        def list(self, prefix):
            if not PausingStore.paused:
                PausingStore.paused = True
                clock.advance(minutes=16)  # the operator's lease ends while it is paused here
                export_key(ledger, LocalDestination(root), SCHEMA, item(key), "w3/export")
            return super().list(prefix)

    class OperatorDestination(LocalDestination):
        @property
        def store(self):
            return PausingStore(Path(self.root).resolve())

    with pytest.raises(ResolutionRefused):
        resolve_key(ledger, OperatorDestination(root), str(key), action="discard-destination", operator="ops",
                    reason="clear it")  # fmt: skip
    record = ledger.queries.get(str(key))
    assert record.state is ExportState.COMPLETED and record.location.endswith(place_name(1, 3))
    assert reader_sees(root, key) == (1, place_name(1, 3), True), "the newer party's recorded export is whole"


def test_an_operators_discard_fences_the_key_before_it_looks_at_what_the_destination_holds(ledger, root):
    """Guard: ``Destination.hold`` first. Unfenced, an attempt of an older token could still commit while the operator
    reads whose export the key's place holds."""
    key = key_for()
    failing_at("after_publish", lambda: export_key(ledger, LocalDestination(root), SCHEMA, item(key), "w1/export"))
    fences = []

    class Watching(LocalDestination):
        def key_at(self, target):
            fences.append(self.pointer(target).fence)
            return super().key_at(target)

    resolve_key(ledger, Watching(root), str(key), action="discard-destination", operator="ops", reason="clear it")

    assert fences == [2], "fenced with the operator's token (2), above the writer's (1), before anything is read"
    assert ledger.queries.get(str(key)).state is ExportState.FAILED


def test_a_withdrawal_never_releases_the_key_to_a_state_read_before_its_hold(ledger, root):
    """A restatement failed; between the operator's read and its hold, a rerun commits revision 2 and ends
    remote_unknown. The withdrawal is refused (readers see revision 2): the key must go back to remote_unknown, the
    state the hold found, never to the `failed` read before it."""
    key = key_for()
    destination = LocalDestination(root)
    export_key(ledger, destination, SCHEMA, item(key), "w1/export")
    ledger.restatements.request(str(key), reason="fix", requested_by="ops")
    failing_at("after_claim", lambda: export_key(ledger, destination, SCHEMA, item(key), "w2/export"))
    assert ledger.queries.get(str(key)).state is ExportState.FAILED
    hold = ledger.claims.hold

    def rerun_then_hold(logical_key, operator):
        failing_at("after_publish", lambda: export_key(ledger, destination, SCHEMA, item(key, orders(key, 99.0)),
                                                       "w3/export"))  # fmt: skip
        return hold(logical_key, operator)

    ledger.claims.hold = rerun_then_hold
    with pytest.raises(RestatementRefused):
        withdraw(ledger, destination, str(key), operator="ops", reason="not needed")
    record = ledger.queries.get(str(key))
    assert reader_sees(root, key)[0] == 2
    assert record.state is ExportState.REMOTE_UNKNOWN, "readers see revision 2: the key is not `failed`"
    reconcile_batch(ledger, destination, limit=10, after=None, reconciler="reconciler")
    assert ledger.restatements.current_revision(str(key)).revision == 2, "reconciliation records what readers see"


def test_a_zone_changed_without_a_move_cannot_be_accepted_over_days_already_exported(ledger, root):
    """Two ledger keys of one tenant and date in two zones would share one folder, one pointer and one fence."""
    key = key_for()
    new_york = ExportCalendar("America/New_York", "2026-01-01").contract()
    export_key(ledger, LocalDestination(root), SCHEMA, ExportItem(key, "2026-03-02", orders(key), new_york), "w1")
    tokyo = ExportCalendar("Asia/Tokyo", "2026-01-01").contract()
    with pytest.raises(ContractChanged, match="2026-03-02 in America/New_York.*--move 2026-03-03:America/New_York"):
        ledger.contracts.accept("invoice_export", tokyo, "moved", tenant="acme")


def test_a_discard_refuses_to_delete_another_recorded_keys_export(ledger, root):
    """A ledger written before the acceptance check (or by hand) holds two keys of one day in two zones: discarding
    the one in conflict must not delete the other's recorded export."""
    destination = LocalDestination(root)
    new_york, tokyo = key_for(), key_for(zone="Asia/Tokyo")
    export_key(ledger, destination, SCHEMA, item(new_york), "w1/export")
    with pytest.raises(ExportConflict):
        export_key(ledger, destination, SCHEMA, item(tokyo), "w2/export")  # finds New York's export: a conflict
    assert ledger.queries.get(str(tokyo)).state is ExportState.CONFLICT
    with pytest.raises(ResolutionRefused, match="a key the ledger records"):
        resolve_key(ledger, destination, str(tokyo), action="discard-destination", operator="ops", reason="clear")
    assert reader_sees(root, new_york) == (1, place_name(1, 1), True)
    assert ledger.queries.get(str(tokyo)).state is ExportState.CONFLICT, "refused: the key is back in conflict"


def test_a_groups_committed_keys_are_recorded_before_their_leases_end(sqlite_url, root, clock):
    """Three keys of one group whose sources each take most of half a lease: the first key's commit must be recorded
    while its lease holds, not at the end of the group when a reconciler may have taken it."""
    ledger = open_ledger(sqlite_url, clock=clock, lease_ttl=dt.timedelta(seconds=120))
    keys = [key_for(tenant=f"t{i}") for i in range(3)]

    def slow(key):
        def read():
            clock.advance(seconds=50)  # three reads: 150 s, beyond the 120 s lease of the group's claim
            return orders(key)

        return read

    batch = ExportBatch(SCHEMA, [ExportItem(k, "2026-03-02", slow(k)) for k in keys])
    export_batch(ledger, LocalDestination(root), batch, "run-1/export")
    assert [r.status for r in batch.results] == ["exported"] * 3 and not batch.failures
    attempts = {a.logical_key: a.outcome.value for a in ledger.queries.all_attempts()}
    assert set(attempts.values()) == {"completed"}, "no key lost its lease: the group's commits were recorded in time"


def test_a_killed_writers_temporary_file_is_swept_with_its_place(ledger, root, clock):
    """A worker killed while writing its data file leaves only a temporary file (customer rows) in its place; the next
    token's sweep must remove it, though the place holds no object yet."""
    key = key_for()
    place = folder(root, key) / place_name(1, 1)
    place.mkdir(parents=True)
    (place / ".tmp-data.csv-4242-1").write_text("order_id,tenant\nacme-1,jane@example.org\n")
    ledger.claims.claim(key, "killed/export")  # token 1, then the process died
    clock.advance(minutes=16)  # the ledger's clock
    export_key(ledger, LocalDestination(root), SCHEMA, item(key), "retry/export")
    assert not place.exists(), "nothing of the killed writer's rows is left"
    assert reader_sees(root, key) == (1, place_name(1, 2), True)
