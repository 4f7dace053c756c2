"""The local store's pointer: its compare-and-swap loses no update, and no lock file outlives its use (whatever an
earlier release left in a key folder goes when its pointer is next written)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from builders import open_ledger
from pipeline_helpers import failure_message, make_defs, published_dirs, read_export, run_partition

from export_ledger.destinations.local import LocalStore
from export_ledger.destinations.store import PreconditionFailed
from resources.invoices import SampleInvoiceSource

KEY = "invoice_export/acme/2026-03-08T05:00:00Z"


# -- the pointer's lock files ------------------------------------------------------------------------------------------


def _lock_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.lock")) if root.exists() else []


def test_a_published_and_restated_key_leaves_no_lock_file_anywhere_under_the_destination(tmp_path, instance):
    assert run_partition(make_defs(tmp_path), instance, "2026-03-08").success
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    ledger.restatements.request(KEY, reason="late invoices", requested_by="ops")
    changed = make_defs(tmp_path, source=SampleInvoiceSource(cadence_minutes=30))  # other data: a real revision 2
    restated = run_partition(changed, instance, "2026-03-08")

    assert restated.success, failure_message(restated)
    assert read_export(published_dirs(tmp_path / "exports")[0])[0].revision == 2, "the pointer moved (twice written)"
    assert _lock_files(tmp_path / "exports") == [], "no lock outlives its use, in a key folder or beside them"


def test_a_lock_file_left_in_a_key_folder_by_an_earlier_release_goes_when_its_pointer_is_next_written(tmp_path):
    store = LocalStore(tmp_path)
    (tmp_path / "orders" / "tenant=acme" / "date=2026-03-08").mkdir(parents=True)
    legacy = tmp_path / "orders" / "tenant=acme" / "date=2026-03-08" / ".current.lock"
    legacy.write_bytes(b"")

    store.put_if_match("orders/tenant=acme/date=2026-03-08/_current.json", b"{}", None)

    assert not legacy.exists() and _lock_files(tmp_path) == []


def test_the_pointer_compare_and_swap_loses_no_update_while_lock_files_come_and_go(tmp_path):
    """Writers race read-modify-write on one object, each retrying a refused swap: every increment lands exactly once.
    A lock file removed under a waiting writer would let two writers swap from the same version (a lost update)."""
    store, name, writers, increments = LocalStore(tmp_path), "orders/tenant=acme/date=2026-03-08/_current.json", 4, 40
    store.put_if_match(name, b"0", None)

    def increment() -> int:
        refused = 0
        for _ in range(increments):
            while True:
                found = store.get(name)
                try:
                    store.put_if_match(name, str(int(found.data) + 1).encode(), found.tag)
                    break
                except PreconditionFailed:
                    refused += 1
        return refused

    with ThreadPoolExecutor(writers) as pool:
        refusals = sum(pool.map(lambda _: increment(), range(writers)))

    assert int(store.get(name).data) == writers * increments, f"lost updates ({refusals} swaps were refused)"
    assert _lock_files(tmp_path) == []
