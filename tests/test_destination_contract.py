"""The destination's half of the protocol, one contract suite for every destination (docs/protocol.md).

The publishing template's tests run on the local folder and on S3, GCS and Azure (their emulators on 127.0.0.1): the
pointer is fenced and moved only by compare-and-swap, places are invisible until the pointer names them, the verdict
is the same function everywhere, the sweep deletes only what no pointer can name, and an operator's discard behaves
the same on each. The tests at the end hold all seven kinds, Delta and the ledger table too, to what the protocol and
the operators ask of any destination.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json

import pyarrow as pa
import pytest
from builders import ORDERS_DAY, ORDERS_SCHEMA, corrected_orders, key_for, open_ledger, orders_item
from object_buckets import delta_destination, object_destination
from warehouse_fixtures import WAREHOUSE_KINDS, warehouse_destination

from export_ledger.destinations import (
    POINTER_NAME,
    ExportTarget,
    Fenced,
    LocalDestination,
    Pointer,
    PointerMoved,
    Verdict,
    place_name,
)
from export_ledger.destinations.base import place_of_location
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.frames import MANIFEST_NAME, Manifest
from export_ledger.ledger import ExportRecord
from export_ledger.protocol import export_key

KEY = key_for()
LOGICAL_KEY = str(KEY)
TABLE = pa.table({"invoice_id": ["a", "b"], "amount": [1.0, 2.0]})


@pytest.fixture(params=["local", "s3", "gcs", "azure", "sftp"])
def destination(request, tmp_path):
    if request.param == "local":
        return LocalDestination(str(tmp_path / "exports"))
    if request.param in ("gcs", "azure", "sftp"):
        return object_destination(request.param, request, prefix="contract")
    from export_ledger.destinations.s3 import S3Destination

    endpoint = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return S3Destination(
        bucket=bucket, prefix="contract", endpoint_url=endpoint, access_key_id="testing", secret_access_key="testing"
    )


def target(revision: int = 1) -> ExportTarget:
    return ExportTarget(KEY.export, KEY.tenant, KEY.window.business_date.isoformat(), revision)


def manifest(token: int, revision: int = 1, logical_key: str = LOGICAL_KEY) -> Manifest:
    return Manifest.build(
        logical_key=logical_key, export=KEY.export, tenant=KEY.tenant, window=KEY.window, row_count=0, sha256="",
        attempt_id=f"run-{token}/invoice_export", fencing_token=token, data_file="data.csv", tz_database="test",
        revision=revision, supersedes=(revision - 1, "ab" * 32) if revision > 1 else None,
    )  # fmt: skip


def publish(destination, token: int, revision: int = 1, superseded: int = 0, logical_key: str = LOGICAL_KEY):
    staged = destination.stage(target(revision), token, TABLE, "csv", manifest(token, revision, logical_key))
    destination.commit(staged, token, superseded=superseded)
    return staged


def reader_sees(destination) -> tuple[int, str | None]:
    """What a reader outside the library sees: the pointer's revision and the manifest's attempt it names."""
    folder = destination.key_folder(target())
    found = destination.store.get(f"{folder}/{POINTER_NAME}")
    if found is None:
        return 0, None
    pointer = json.loads(found.data)
    if pointer["revision"] == 0:
        return 0, None
    named = destination.store.get(f"{folder}/{pointer['manifest']}")
    return pointer["revision"], json.loads(named.data)["attempt_id"]


def test_a_staged_revision_is_invisible_until_its_commit(destination):
    staged = destination.stage(target(), 1, TABLE, "csv", manifest(1))
    assert reader_sees(destination) == (0, None), "a place is invisible until the pointer names it"
    assert destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0).verdict is Verdict.ABSENT
    destination.commit(staged, 1, superseded=0)
    assert reader_sees(destination) == (1, "run-1/invoice_export")
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0)
    assert seen.verdict is Verdict.PUBLISHED and seen.manifest.fencing_token == 1
    assert seen.location == destination.location(target().at_place(place_name(1, 1)))


def test_a_commit_is_idempotent_and_a_second_party_cannot_commit_the_same_revision(destination):
    first = publish(destination, 1)
    destination.commit(first, 1, superseded=0)  # a resend of one's own commit: success, nothing changes
    other = destination.stage(target(), 2, TABLE, "csv", manifest(2))
    with pytest.raises(PointerMoved):
        destination.commit(other, 2, superseded=0)
    assert reader_sees(destination) == (1, "run-1/invoice_export"), "a published revision is never replaced"


def test_once_fenced_no_lower_token_changes_what_readers_see(destination):
    stale = destination.stage(target(), 1, TABLE, "csv", manifest(1))  # a paused attempt staged its revision
    fenced = destination.fence(target(), 2, logical_key=LOGICAL_KEY)  # a newer party holds the key now
    assert (fenced.fence, fenced.revision) == (2, 0)
    with pytest.raises(Fenced):
        destination.commit(stale, 1, superseded=0)
    with pytest.raises(Fenced):
        destination.fence(target(), 1, logical_key=LOGICAL_KEY)
    assert reader_sees(destination) == (0, None), "the stale attempt's revision never became visible"
    assert destination.fence(target(), 2, logical_key=LOGICAL_KEY).fence == 2, "fencing again is idempotent"


def test_a_fence_keeps_what_the_pointer_names(destination):
    publish(destination, 1)
    fenced = destination.fence(target(), 5, logical_key=LOGICAL_KEY)
    assert (fenced.fence, fenced.revision, fenced.place) == (5, 1, place_name(1, 1))
    assert reader_sees(destination) == (1, "run-1/invoice_export")


def test_a_restatement_commits_only_from_the_revision_it_supersedes(destination):
    publish(destination, 1)
    publish(destination, 3, revision=2, superseded=1)
    assert reader_sees(destination) == (2, "run-3/invoice_export")
    late = destination.stage(target(3), 4, TABLE, "csv", manifest(4, revision=3))
    with pytest.raises(PointerMoved):
        destination.commit(late, 4, superseded=1), "a pointer found elsewhere is a conflict, never moved back"
    seen = destination.verify(target(3), logical_key=LOGICAL_KEY, superseded=1)
    assert seen.verdict is Verdict.CONFLICT


def test_the_verdict_is_conflict_for_another_keys_export_or_data_that_does_not_match(destination):
    publish(destination, 1, logical_key="invoice_export/other/2026-03-08T05:00:00Z")
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0)
    assert seen.verdict is Verdict.CONFLICT and "other" in seen.detail


def test_a_manifest_without_its_data_is_a_conflict_not_an_unreachable_store(destination):
    publish(destination, 1)
    destination.store.delete(f"{destination.key_folder(target())}/{place_name(1, 1)}/data.csv")
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0)
    assert seen.verdict is Verdict.CONFLICT and "missing" in seen.detail


def test_an_expected_sha256_other_than_the_committed_one_is_a_conflict(destination):
    publish(destination, 1)
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0, expected_sha256="00" * 32)
    assert seen.verdict is Verdict.CONFLICT


def test_the_sweep_deletes_only_places_no_pointer_can_ever_name(destination):
    publish(destination, 1)
    never_current = destination.stage(target(1), 2, TABLE, "csv", manifest(2))  # revision 1, another place
    publish(destination, 3, revision=2, superseded=1)
    earlier_orphan = never_current.target.place
    fenced = destination.stage(target(3), 4, TABLE, "csv", manifest(4, revision=3))  # a fenced restatement
    same_revision = destination.stage(target(2), 5, TABLE, "csv", manifest(5, revision=2))  # lost to r2-t3
    higher = destination.stage(target(3), 9, TABLE, "csv", manifest(9, revision=3))  # a higher token's
    pointer = destination.fence(target(3), 6, logical_key=LOGICAL_KEY)
    removed = destination.sweep(target(3), 6, pointer)
    places = set(destination._places(target()))
    assert removed == 2 and not {fenced.target.place, same_revision.target.place} & places, (
        "a revision above the pointer's, and the pointer's revision at another place, can never be current"
    )
    assert {place_name(1, 1), place_name(2, 3), earlier_orphan, higher.target.place} <= places, (
        "the current place, every place of an earlier revision (one of them is that revision, readable for good) "
        "and a higher token's place are kept"
    )
    assert reader_sees(destination) == (2, "run-3/invoice_export")


def test_a_first_claim_sweeps_nothing(destination):
    destination.stage(target(), 1, TABLE, "csv", manifest(1))
    assert destination.sweep(target(), 1, destination.pointer(target())) == 0


def test_discarding_an_unrecorded_revision_sets_the_pointer_back_to_the_recorded_one_on_every_destination(destination):
    """One implementation: local and S3 both put the pointer back to what the ledger records and delete the rest."""
    publish(destination, 1)
    publish(destination, 2, revision=2, superseded=1)  # committed, never recorded by the ledger
    recorded = destination.pointer_to(target(1).at_place(place_name(1, 1)))
    destination.fence(target(2), 3, logical_key=LOGICAL_KEY)
    removed = destination.discard(target(2), 3, logical_key=LOGICAL_KEY, restore=recorded)
    assert removed == [place_name(2, 2)]
    assert reader_sees(destination) == (1, "run-1/invoice_export"), "readers are back on the recorded revision"
    assert destination.verify(target(2), logical_key=LOGICAL_KEY, superseded=1).verdict is Verdict.ABSENT


def test_discarding_a_first_export_in_conflict_leaves_nothing_published(destination):
    publish(destination, 1, logical_key="invoice_export/other/2026-03-08T05:00:00Z")
    destination.fence(target(), 2, logical_key=LOGICAL_KEY)
    removed = destination.discard(target(), 2, logical_key=LOGICAL_KEY, restore=Pointer.nothing())
    assert removed == [place_name(1, 1)] and reader_sees(destination) == (0, None)


def test_a_legacy_revision_1_without_a_pointer_reads_as_revision_1_and_its_first_fence_keeps_it(destination):
    folder = destination.key_folder(target())
    legacy = manifest(1)
    data = b"invoice_id,amount\na,1\n"
    import hashlib

    legacy = Manifest(**{**legacy.__dict__, "sha256": hashlib.sha256(data).hexdigest(), "row_count": 1})
    destination.store.put_if_absent(f"{folder}/data.csv", data)
    destination.store.put_if_absent(f"{folder}/{MANIFEST_NAME}", legacy.to_json())
    pointer = destination.pointer(target())
    assert (pointer.revision, pointer.place, pointer.tag) == (1, ".", None)
    seen = destination.verify(target(), logical_key=LOGICAL_KEY, superseded=0)
    assert seen.verdict is Verdict.PUBLISHED and seen.location == destination.location(target().at_place("."))
    fenced = destination.fence(target(), 2, logical_key=LOGICAL_KEY)
    assert (fenced.revision, fenced.place, fenced.fence) == (1, ".", 2)
    assert json.loads(destination.store.get(f"{folder}/{POINTER_NAME}").data)["format"] == 2


# -- what a party holding a key does, whatever the destination's kind (Destination.open, hold, discard_key) ----------


def test_open_fences_the_key_then_judges_what_is_published_behind_the_fence(destination):
    """Guard: :meth:`open` fences first. A party with an older token is refused at the pointer from then on."""
    publish(destination, 1)

    opened = destination.open(target(2), 3, logical_key=LOGICAL_KEY, superseded=1)

    assert opened.pointer.fence == 3 and opened.verification.verdict is Verdict.ABSENT
    staged = destination.stage(target(2), 2, TABLE, "csv", manifest(2, revision=2))
    with pytest.raises(Fenced):
        destination.commit(staged, 2, superseded=1)
    with pytest.raises(Fenced):
        destination.open(target(2), 2, logical_key=LOGICAL_KEY, superseded=1)
    assert reader_sees(destination) == (1, "run-1/invoice_export")


def test_open_judges_what_is_published_only_once_its_fence_holds(tmp_path):
    """Guard: the order inside :meth:`open`. An older party that commits right after the judgement must be refused:
    judged first and fenced after, the judgement says "absent" while readers see the older party's revision."""
    late = []

    class Racing(LocalDestination):
        def verify(self, *args, **kwargs):
            found = super().verify(*args, **kwargs)
            for staged in late:  # an older party (token 1) commits right after the judgement
                with contextlib.suppress(Fenced):
                    LocalDestination.commit(self, staged, 1, superseded=0)
            return found

    destination = Racing(str(tmp_path / "exports"))
    late.append(destination.stage(target(1), 1, TABLE, "csv", manifest(1)))

    opened = destination.open(target(1), 2, logical_key=LOGICAL_KEY, superseded=0)

    assert opened.verification.verdict is Verdict.ABSENT and reader_sees(destination) == (0, None)


def test_discard_key_puts_back_the_revision_the_ledger_records_or_nothing(destination):
    publish(destination, 1)
    publish(destination, 2, revision=2, superseded=1)  # committed, never recorded
    destination.hold(target(2), 3, logical_key=LOGICAL_KEY)

    removed = destination.discard_key(target(2), 3, logical_key=LOGICAL_KEY, recorded=target(1).at_place("r1-t1"))

    assert removed == [place_name(2, 2)] and reader_sees(destination) == (1, "run-1/invoice_export")
    destination.hold(target(1), 4, logical_key=LOGICAL_KEY)
    destination.discard_key(target(1), 4, logical_key=LOGICAL_KEY, recorded=None)
    assert reader_sees(destination) == (0, None)


def test_a_location_is_recorded_here_only_when_it_is_this_destinations_place_of_the_key(destination, tmp_path):
    place = target().at_place(place_name(1, 1))
    assert destination.recorded_here(target(), destination.location(place))
    elsewhere = LocalDestination(str(tmp_path / "elsewhere")).location(place)
    assert not destination.recorded_here(target(), elsewhere), "a key is never judged where it was not exported"


def test_a_ledger_table_holds_no_pointer_of_its_own_and_hands_its_rows_back_as_csv(tmp_path):
    """The transactional kind answers the same questions: nothing to fence outside the ledger (its transaction fences
    it), rows read back as CSV whatever the export's format, and its dataset is its table in the ledger's database."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    open_ledger(url)  # the ledger's database, where the table lives
    table = SqlTableDestination(url, "exported_{export}")

    opened = table.open(target(), 1, logical_key=LOGICAL_KEY, superseded=0)

    assert opened.pointer is None and opened.verification.verdict is Verdict.ABSENT
    assert table.hold(target(), 2, logical_key=LOGICAL_KEY) is None
    assert table.data_format("parquet") == "csv" and LocalDestination(str(tmp_path)).data_format("parquet") == "parquet"
    assert table.dataset("invoice_export") == ("sqlite", "exported_invoice_export")


# -- what every kind answers, through the protocol and the interface every destination shares --------------------
#
# The tests above hold the publishing template to its pointer and places. These hold all seven kinds, the two that are
# not object stores too (a Delta table, and a table in the ledger's own database), to what the protocol, the
# reconciliation and the operators' commands ask of any destination: a key never held is absent, an exported key is
# judged from the destination's own evidence, and a restatement leaves one current revision.

ALL_KINDS = ["local", "s3", "gcs", "azure", "sftp", "delta", "table", *(f"warehouse-{k}" for k in WAREHOUSE_KINDS)]
ORDERS_DAY_KEY = key_for(ORDERS_DAY, export="orders")


@pytest.fixture(params=ALL_KINDS)
def exported_to(request, tmp_path, clock):
    """A ledger and a destination of each kind, built as a user builds them."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    book = open_ledger(url, clock=clock, lease_ttl=dt.timedelta(minutes=15))
    kind = request.param
    if kind == "local":
        built = LocalDestination(str(tmp_path / "exports"))
    elif kind == "delta":
        built = delta_destination(request, tmp_path)
    elif kind == "table":
        built = SqlTableDestination(url, "exported_{export}")
    elif kind.startswith("warehouse-"):
        built = warehouse_destination(kind.removeprefix("warehouse-"), request, tmp_path)
    else:
        built = object_destination(kind, request, prefix="contract-all")
    return book, built


def any_target(revision: int = 1, place: str | None = None) -> ExportTarget:
    key = ORDERS_DAY_KEY
    return ExportTarget(key.export, key.tenant, key.window.business_date.isoformat(), revision, place)


def exported(book, built, rows=None) -> ExportRecord:
    key = ORDERS_DAY_KEY
    result = export_key(
        book, built, ORDERS_SCHEMA, orders_item(key, rows), f"run-{len(book.queries.attempts(str(key)))}/x"
    )
    assert result.status == "exported"
    return book.queries.get(str(key))


def recorded_target(record: ExportRecord, revision: int) -> ExportTarget:
    return any_target(revision, place_of_location(record.location))


def test_every_kind_judges_a_key_it_never_held_absent(exported_to) -> None:
    book, built = exported_to
    opened = built.open(any_target(), 1, logical_key=str(ORDERS_DAY_KEY), superseded=0)
    assert opened.verification.verdict is Verdict.ABSENT
    assert built.current_revision(any_target()) == 0


def test_every_kind_judges_an_exported_key_from_its_own_evidence(exported_to) -> None:
    book, built = exported_to
    record = exported(book, built)
    logical_key, recorded = str(ORDERS_DAY_KEY), recorded_target(record, 1)

    assert built.recorded_here(any_target(), record.location)
    assert built.current_revision(any_target()) == 1
    intact = built.verify_recorded(recorded, logical_key=logical_key, sha256=record.sha256)
    assert intact.verdict is Verdict.PUBLISHED
    assert hashlib.sha256(built.read_data(recorded, intact.manifest)).hexdigest() == record.sha256, (
        "the bytes handed back are the ones the ledger recorded"
    )
    assert built.verify_recorded(recorded, logical_key=logical_key, sha256="0" * 64).verdict is Verdict.CONFLICT
    # What reconciliation and an operator do first: a party with a newer token opens the key and finds it published.
    opened = built.open(any_target(), record.fencing_token + 1, logical_key=logical_key, superseded=0)
    assert opened.verification.verdict is Verdict.PUBLISHED
    assert opened.verification.manifest.sha256 == record.sha256


def test_every_kind_keeps_one_current_revision_across_a_restatement(exported_to) -> None:
    book, built = exported_to
    first = exported(book, built)
    book.restatements.request(str(ORDERS_DAY_KEY), reason="late rows", requested_by="ops")
    second = exported(book, built, corrected_orders(ORDERS_DAY_KEY))
    logical_key = str(ORDERS_DAY_KEY)

    assert second.sha256 != first.sha256 and built.current_revision(any_target()) == 2
    now = built.verify_current(recorded_target(second, 2), logical_key=logical_key, sha256=second.sha256)
    assert now.verdict is Verdict.PUBLISHED
    before = built.verify_current(recorded_target(first, 1), logical_key=logical_key, sha256=first.sha256)
    assert before.verdict is Verdict.CONFLICT, "readers see revision 2, never both"
