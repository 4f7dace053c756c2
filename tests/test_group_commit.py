"""Group commit of durability (issue #21, docs/protocol.md "Group commit"): a group of keys on a local destination
is staged with its fsyncs deferred, synced once, published, synced once more, and only then recorded in one ledger
commit. These tests count the syncs, check their order against the pointer moves and the ledger commit, and crash or
fail the group between them."""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from builders import ORDERS_SCHEMA as SCHEMA
from builders import hourly_orders as orders  # hourly in each key's window
from builders import key_for, open_ledger
from pipeline_helpers import places, published_dirs

from export_ledger.destinations import LocalDestination, local
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.ledger import FencedOut
from export_ledger.ledger.completions import Completions
from export_ledger.ledger.schema import ExportState
from export_ledger.protocol import ExportBatch, ExportBatchFailed, ExportItem, export_batch, export_key
from export_ledger.reconcile import reconcile_batch

DAY = dt.date(2026, 3, 2)


def keys_of(count: int) -> list:
    return [key_for(DAY, tenant=f"t{i:02d}") for i in range(count)]


def batch_of(keys) -> ExportBatch:
    return ExportBatch(SCHEMA, [ExportItem(key, key.window.business_date.isoformat(), orders(key)) for key in keys])


@pytest.fixture
def events(monkeypatch) -> list[str]:
    """What the group does, in order: ``fsync``, ``syncfs``, ``rename-pointer``, ``commit`` (the completions)."""
    seen: list[str] = []
    real_fsync, real_syncfs, real_rename = os.fsync, local._syncfs, os.rename
    real_complete_many = Completions.complete_many

    def fsync(fd):
        seen.append("fsync")
        return real_fsync(fd)

    def syncfs(folder):
        seen.append("syncfs")
        return real_syncfs(folder)

    def rename(source, target):
        if Path(target).name == POINTER_NAME:
            seen.append("rename-pointer")
        return real_rename(source, target)

    def complete_many(self, entries):
        if entries:
            seen.append("commit")
        return real_complete_many(self, entries)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(local, "_syncfs", syncfs)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(Completions, "complete_many", complete_many)
    return seen


@pytest.mark.parametrize("size", [5, 20])
def test_a_group_pays_two_syncs_whatever_its_size_where_one_key_pays_several_fsyncs(
    tmp_path: Path, ledger, events, size
) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    alone = key_for(DAY, tenant="alone")
    export_key(ledger, destination, SCHEMA, ExportItem(alone, "p", orders(alone)), "run-0/export")
    per_key = events.count("fsync")
    assert per_key >= 4 and "syncfs" not in events, f"a single key keeps its own fsyncs ({events})"

    events.clear()
    results = export_batch(ledger, destination, batch_of(keys_of(size)), "run-1/export", group_size=size)
    assert [r.status for r in results] == ["exported"] * size
    assert events.count("syncfs") == 2, f"one sync before the pointers move, one before the ledger commit: {events}"
    assert events.count("fsync") == 0, f"no fsync of its own for any key of the group: {events}"
    assert events.count("commit") == 1


def test_no_pointer_moves_before_the_data_is_synced_and_nothing_is_recorded_before_the_moves_are(
    tmp_path: Path, ledger, events
) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    export_batch(ledger, destination, batch_of(keys_of(4)), "run-1/export")
    moves = [i for i, event in enumerate(events) if event == "rename-pointer"]
    syncs = [i for i, event in enumerate(events) if event == "syncfs"]
    commit = events.index("commit")
    assert len(moves) == 4
    assert syncs and syncs[0] < moves[0], f"the staged data is durable before any pointer names it: {events}"
    assert any(moves[-1] < sync < commit for sync in syncs), (
        f"the pointer moves are durable before the ledger records them: {events}"
    )


def test_without_syncfs_each_deferred_path_is_fsynced_and_the_fallback_is_logged(
    tmp_path: Path, ledger, events, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(local, "_syncfs", lambda folder: events.append("syncfs-missing") or False)
    monkeypatch.setattr(local, "_syncfs_missing_logged", False)
    destination = LocalDestination(str(tmp_path / "exports"))
    with caplog.at_level(logging.WARNING, logger="export_ledger"):
        results = export_batch(ledger, destination, batch_of(keys_of(3)), "run-1/export")
    assert [r.status for r in results] == ["exported"] * 3
    assert "syncfs is not available" in caplog.text, "the fallback is said, never silent"
    first, second = (i for i, event in enumerate(events) if event == "syncfs-missing")
    assert events[first + 1 : second].count("fsync") >= 3 * 3, "each key's data file, manifest and pointer bytes"
    assert "fsync" in events[second + 1 : events.index("commit")], "the pointer moves' folders, before the commit"


@pytest.mark.parametrize("point", ["before_group_sync", "after_group_sync"])
def test_a_crash_between_publish_and_commit_leaves_the_keys_unrecorded_and_the_next_run_repairs_them(
    tmp_path: Path, ledger, clock, monkeypatch, point
) -> None:
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = keys_of(3)
    monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
    with pytest.raises(SimulatedCrash):
        export_batch(ledger, destination, batch_of(keys), "run-1/export")
    monkeypatch.delenv(FAILPOINTS)
    assert len(published_dirs(tmp_path / "exports")) == 3, "every key of the group is published"
    assert [ledger.queries.get(str(k)).state for k in keys] == [ExportState.IN_PROGRESS] * 3, "and none recorded"

    clock.advance(minutes=16)
    results = export_batch(ledger, destination, batch_of(keys), "run-2/export")
    assert [r.status for r in results] == ["repaired"] * 3
    assert len(places(tmp_path / "exports")) == 3, "recorded from their manifests: no second copy"
    assert {ledger.queries.get(str(k)).committed_attempt for k in keys} == {"run-1/export"}


def test_a_repair_makes_what_it_records_durable_first(tmp_path: Path, ledger, clock, monkeypatch) -> None:
    """A group killed before its second sync leaves pointers that may not be durable yet: the attempt that records
    them (here a single key's, outside any group) fsyncs the pointer and the place it names before recording."""
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = keys_of(2)
    monkeypatch.setenv(FAILPOINTS, "before_group_sync=crash")
    with pytest.raises(SimulatedCrash):
        export_batch(ledger, destination, batch_of(keys), "run-1/export")
    monkeypatch.delenv(FAILPOINTS)
    synced: list[str] = []
    real = local._fsync_now
    monkeypatch.setattr(local, "_fsync_now", lambda path: synced.append(Path(path).name) or real(path))

    clock.advance(minutes=16)
    result = export_key(ledger, destination, SCHEMA, ExportItem(keys[0], "p", orders(keys[0])), "run-2/export")
    assert result.status == "repaired"
    assert POINTER_NAME in synced and "_manifest.json" in synced, f"settled before it was recorded: {synced}"


@pytest.mark.parametrize(("failing", "state"), [(1, ExportState.FAILED), (2, ExportState.REMOTE_UNKNOWN)])
def test_a_failed_sync_fails_a_staged_group_and_leaves_a_published_one_to_reconciliation(
    tmp_path: Path, ledger, monkeypatch, failing, state
) -> None:
    """The first sync failing: nothing is visible yet, so the keys are ``failed`` (safe to retry) and no pointer
    exists. The second failing: the pointers moved but may not survive a power cut, so the keys are
    ``remote_unknown`` and reconciliation decides from what the destination holds."""
    calls = [0]

    def syncfs(folder):
        calls[0] += 1
        if calls[0] == failing:
            raise OSError(5, "Input/output error")
        return True

    monkeypatch.setattr(local, "_syncfs", syncfs)
    destination = LocalDestination(str(tmp_path / "exports"))
    keys = keys_of(3)
    with pytest.raises(ExportBatchFailed, match="3 of 3"):
        export_batch(ledger, destination, batch_of(keys), "run-1/export")
    assert [ledger.queries.get(str(k)).state for k in keys] == [state] * 3
    assert len(published_dirs(tmp_path / "exports")) == (0 if failing == 1 else 3)


def test_a_key_taken_over_before_its_group_renews_is_reported_lost_and_every_other_key_is_exported(
    tmp_path: Path, ledger_url, clock
) -> None:
    """Issue #26: a renewal that drops a later key of the group (another attempt took it over while an earlier key's
    source was read) made the loop raise a bare KeyError on reaching it: the key staged before it was never
    published, and the keys after it (and the next group) were never attempted."""
    lease = dt.timedelta(seconds=3)  # the group renews after half of it, on this process's monotonic clock
    ledger = open_ledger(ledger_url, clock=clock, lease_ttl=lease)
    rival = open_ledger(ledger_url, clock=clock, lease_ttl=lease)
    keys = keys_of(6)  # two groups: t00..t03, then t04..t05
    taken = keys[2]

    def slow_source_while_a_rival_takes_a_later_key():
        clock.advance(seconds=4)  # every lease of the group has ended by the ledger's clock
        rival.claims.claim(taken, "run-2/export")  # taken over: run-1's token on it is fenced
        time.sleep(lease.total_seconds() * 0.6)  # past the renewal point before the next key's source is read
        return orders(keys[0])

    batch = batch_of(keys)
    batch.items[0] = ExportItem(keys[0], batch.items[0].partition_key, slow_source_while_a_rival_takes_a_later_key)
    destination = LocalDestination(str(tmp_path / "exports"))
    with pytest.raises(FencedOut, match=f"lost its lease on {taken}"):
        export_batch(ledger, destination, batch, "run-1/export", group_size=4)

    assert [f.logical_key for f in batch.failures] == [str(taken)], "the taken key is the run's only failure"
    assert batch.failures[0].error_class == "FencedOut"
    others = [k for k in keys if k != taken]
    assert [r.logical_key for r in batch.results] == [str(k) for k in others], "every other key has its result"
    assert all(r.status == "exported" for r in batch.results)
    for key in others:
        record = ledger.queries.get(str(key))
        assert (record.state, record.committed_attempt) == (ExportState.COMPLETED, "run-1/export"), (
            f"{key} is published and recorded, before and after the lost key and in the next group"
        )
    record = ledger.queries.get(str(taken))
    assert (record.state, record.lease_owner, record.fencing_token) == (ExportState.IN_PROGRESS, "run-2/export", 2), (
        "nothing is recorded on the lost key: the attempt that took it owns it"
    )
    published = published_dirs(tmp_path / "exports")
    assert len(published) == len(others) and not [f for f in published if f"={taken.tenant}" in str(f)], (
        f"one published export per exported key, none for the key run-1 lost: {published}"
    )


# -- reconciliation: a batch of fences, one sync --------------------------------------------------------------------


def _stuck_pair(ledger, clock, destination, monkeypatch) -> tuple[list, list]:
    """Two keys published and never recorded (their party died after the pointer moved), two never published (died
    after the claim); every lease has ended."""
    published, absent = keys_of(4)[:2], keys_of(4)[2:]
    for keys, point in ((published, "after_publish"), (absent, "after_claim")):
        monkeypatch.setenv(FAILPOINTS, f"{point}=crash")
        for key in keys:
            with pytest.raises(SimulatedCrash):
                export_key(ledger, destination, SCHEMA, ExportItem(key, "p", orders(key)), f"run-{key.tenant}/x")
    monkeypatch.delenv(FAILPOINTS)
    clock.advance(minutes=16)
    return published, absent


def _record_finishes(events: list[str], monkeypatch) -> None:
    """From here on, ``events`` holds only what follows, and ``record`` for each ledger transaction of verdicts."""
    real_finish_many = Completions.finish_many

    def finish_many(self, finishes, **kwargs):
        events.append("record")
        return real_finish_many(self, finishes, **kwargs)

    monkeypatch.setattr(Completions, "finish_many", finish_many)
    events.clear()


def test_reconciliation_fences_a_batch_with_one_sync_before_it_records_any_verdict(
    tmp_path: Path, ledger, clock, monkeypatch, events
) -> None:
    """Each fence (a pointer rewritten with the reconciler's token) used to be made durable on its own: the pointer's
    bytes, the folder and the repaired key's settled place fsynced key by key. A batch now pays two ``syncfs``: one
    for every fence's prepared bytes, before any pointer is renamed (a renamed pointer is never torn), and one for
    every rename and settle, after the last key is judged and before the ledger records a verdict. Guards: without
    the deferral there is no syncfs at all; with the sync after the record, "record" comes first; without the
    prepared fences each pointer's bytes are fsynced on their own (4 fsyncs)."""
    destination = LocalDestination(str(tmp_path / "exports"))
    published, absent = _stuck_pair(ledger, clock, destination, monkeypatch)
    _record_finishes(events, monkeypatch)
    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")

    assert [ledger.queries.get(str(k)).state for k in published] == [ExportState.COMPLETED] * 2
    assert [ledger.queries.get(str(k)).state for k in absent] == [ExportState.FAILED] * 2
    assert len(report.resolved) == 4
    assert events.count("syncfs") == 2, f"two syncs for the batch: {events}"
    assert events.count("rename-pointer") == 4, f"every key fenced: {events}"
    first_fence = events.index("rename-pointer")
    last_fence = max(i for i, e in enumerate(events) if e == "rename-pointer")
    bytes_synced, renames_synced = (i for i, e in enumerate(events) if e == "syncfs")
    assert bytes_synced < first_fence and last_fence < renames_synced < events.index("record"), events
    assert events.count("fsync") == 0, f"no pointer's bytes fsynced on their own: {events}"


def test_a_failed_sync_leaves_every_key_of_the_batch_unknown_and_records_no_verdict_behind_its_fences(
    tmp_path: Path, ledger, clock, monkeypatch
) -> None:
    """The fences were written but may not survive a power cut: a verdict recorded behind one (``failed``, then a
    rerun) could let the crashed party's late commit become visible. Every key stays ``remote_unknown``, keeping
    when it got stuck, and says why. Guard: without the downgrade, two keys are recorded completed, two failed."""
    destination = LocalDestination(str(tmp_path / "exports"))
    published, absent = _stuck_pair(ledger, clock, destination, monkeypatch)

    def syncfs(folder):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local, "_syncfs", syncfs)
    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")

    assert [ledger.queries.get(str(k)).state for k in [*published, *absent]] == [ExportState.REMOTE_UNKNOWN] * 4
    assert len(report.unreachable) == 4 and not report.resolved
    details = [f.detail for f in report.unreachable]
    assert all("could not be made durable" in d and "Input/output error" in d for d in details), details


def test_a_failed_sync_of_the_prepared_fences_renames_no_pointer_from_them(
    tmp_path: Path, ledger, clock, monkeypatch, events
) -> None:
    """The first sync (the fences' prepared bytes) fails and the second would succeed: no pointer is renamed from
    bytes that may not survive a power cut (Linux reports a writeback error once, so a later sync may say nothing),
    and every key stays ``remote_unknown``, saying why. Guard: renaming the prepared bytes anyway records two keys
    completed and two failed behind fences that were never durable."""
    destination = LocalDestination(str(tmp_path / "exports"))
    published, absent = _stuck_pair(ledger, clock, destination, monkeypatch)
    real, calls = local._syncfs, []

    def first_fails(folder):
        calls.append(folder)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real(folder)

    monkeypatch.setattr(local, "_syncfs", first_fails)
    _record_finishes(events, monkeypatch)
    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")

    assert "rename-pointer" not in events, events
    assert [ledger.queries.get(str(k)).state for k in [*published, *absent]] == [ExportState.REMOTE_UNKNOWN] * 4
    assert len(report.unreachable) == 4 and not report.resolved
    assert all("Input/output error" in f.detail for f in report.unreachable), report.unreachable
    leftovers = [p for p in (tmp_path / "exports").rglob("*") if p.name.startswith(".")]
    assert not [p for p in leftovers if p.is_file() and "lock" not in str(p)], f"prepared bytes left: {leftovers}"


def test_a_destination_that_fences_its_own_way_is_reconciled_as_before(tmp_path: Path, ledger, clock, monkeypatch):
    """A subclass written before fences were prepared overrides ``fence(target, token, *, logical_key)``: nothing is
    prepared for it and its fence is called as it was declared. Guard: passing it ``read`` is a TypeError, which
    leaves all four keys unreachable at every tick."""

    class OwnFence(LocalDestination):
        def fence(self, target, token, *, logical_key):
            return super().fence(target, token, logical_key=logical_key)

    destination = OwnFence(str(tmp_path / "exports"))
    published, absent = _stuck_pair(ledger, clock, destination, monkeypatch)

    report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")

    assert len(report.resolved) == 4 and not report.unreachable, report.unreachable
    assert [ledger.queries.get(str(k)).state for k in published] == [ExportState.COMPLETED] * 2


def test_a_batch_whose_export_folder_is_on_another_filesystem_syncs_that_filesystem_too(
    tmp_path: Path, ledger, clock, monkeypatch
) -> None:
    """The export's folder under the root is a symlink to another disk (here /dev/shm): the one ``syncfs`` of the
    root's filesystem never reaches the fences written there. Guard: one ``syncfs`` per filesystem of the deferred
    paths; with the root's alone, the other device is never synced."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem other than the test's folder")
    elsewhere = Path(tempfile.mkdtemp(dir=shm, prefix="export-ledger-test-"))
    try:
        (tmp_path / "exports").mkdir()
        (tmp_path / "exports" / "invoice_export").symlink_to(elsewhere, target_is_directory=True)
        destination = LocalDestination(str(tmp_path / "exports"))
        _stuck_pair(ledger, clock, destination, monkeypatch)
        synced: list[int] = []
        real = local._syncfs
        monkeypatch.setattr(local, "_syncfs", lambda folder: synced.append(os.stat(folder).st_dev) or real(folder))

        report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")

        assert len(report.resolved) == 4
        assert elsewhere.stat().st_dev in synced, f"the other disk's fences were synced: {synced}"
        # Two syncs (the fences' bytes, then their renames), each of every filesystem once.
        assert set(Counter(synced).values()) == {2}, f"each filesystem once a sync: {synced}"
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_reconciliation_inside_a_callers_deferral_syncs_it_before_recording(
    tmp_path: Path, ledger, clock, monkeypatch, events
) -> None:
    """A caller that already holds the destination's deferral in this thread (a group that reconciles): the batch
    cannot open its own, so it works in the caller's and syncs it before the ledger records a verdict."""
    destination = LocalDestination(str(tmp_path / "exports"))
    published, absent = _stuck_pair(ledger, clock, destination, monkeypatch)
    _record_finishes(events, monkeypatch)
    with destination.deferred():
        report = reconcile_batch(ledger, destination, limit=10, after=None, reconciler="test")
    assert len(report.resolved) == 4
    assert [ledger.queries.get(str(k)).state for k in published] == [ExportState.COMPLETED] * 2
    assert events.count("syncfs") == 2, events
    assert max(i for i, e in enumerate(events) if e == "syncfs") < events.index("record"), events


def test_a_sync_with_nothing_deferred_does_nothing(tmp_path: Path, monkeypatch) -> None:
    """Nothing written since the deferral began (every key judged unreachable before a write, at a root that does
    not exist): no ``syncfs`` (it syncs the filesystems of what was written), and no error for the missing root."""
    calls: list[object] = []
    monkeypatch.setattr(local, "_syncfs", lambda folder: calls.append(folder) or True)
    destination = LocalDestination(str(tmp_path / "missing"))
    with destination.deferred():
        destination.sync()
    assert calls == []


# -- a lease that ends exactly now never stops its group ---------------------------------------------------------------


def test_a_key_whose_lease_ends_exactly_now_never_stops_its_group_of_50(ledger, local, clock):
    """Item 15: `_refusal` says a lease is held while `expires > now`, the takeover guard needs `expires < now`. At
    equality claim_many raises and rolls back the whole group. One key must never stop the other 49.
    Fails on 0.4.0 (07f55b3): InvalidTransition, 0 of 49 other keys completed."""
    tenants = [f"t{i:02d}" for i in range(50)]
    keys = [key_for(DAY, tenant=t) for t in tenants]
    ledger.claims.claim(keys[0], "dead-run/export")  # its lease ends at now + 15 minutes, to the microsecond
    clock.advance(minutes=15)  # exactly the lease's end
    batch = ExportBatch(SCHEMA, [ExportItem(k, DAY.isoformat(), orders(k)) for k in keys])
    try:
        export_batch(ledger, local, batch, "run-2/export")
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"[:160]
    completed = [
        k for k in keys[1:] if (r := ledger.queries.get(str(k))) is not None and r.state is ExportState.COMPLETED
    ]
    observed = {"export_batch raised": raised, "other keys completed": len(completed)}
    assert observed["other keys completed"] == 49, observed
    first = ledger.queries.get(str(keys[0]))
    assert (first.state, first.committed_attempt) == (ExportState.COMPLETED, "run-2/export"), (
        f"at equality the lease has ended: the key is taken over ({observed})"
    )
