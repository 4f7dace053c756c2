"""A restatement fenced while it runs never changes what readers see (docs/protocol.md, protocol v2): one whose lease
ran out while it read its source, withdrawn or followed by another, repaired through a transient S3 error, paused
past its lease as a real run; and discarding the current revision behaves the same on a local folder and on S3.

Each test is a reproduction that failed on 0.4.0 (07f55b3) (issue 18, items 1 and 2), ported to protocol v2 with the
same "must hold" assertion. Helpers are in ``restatement_support.py``. The test marked ``process`` is deselected by
the default ``addopts`` (a restatement run paused past a 2-second lease, then ``export-ledger reconcile``).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from builders import key_for, open_ledger
from restatement_support import (
    DAY,
    EXPORT_LEDGER,
    LEASE,
    SCHEMA,
    corrected,
    fenced_restatement,
    finish,
    item,
    local_places,
    local_reader_view,
    materialize,
    process_env,
    restatement_dead_after_publishing,
    s3_destination,
    s3_reader_view,
    third_version,
    wait_for,
)

from export_ledger import cli
from export_ledger.destinations import LocalDestination
from export_ledger.destinations.publishing import POINTER_NAME
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.ledger import ExportState, FencedOut, LedgerError
from export_ledger.protocol import export_key
from export_ledger.resolve import resolve_key
from export_ledger.restate import withdraw

# -- a fenced restatement never changes what readers see --------------------------------------------------------------


def test_fenced_restatement_never_changes_what_readers_see(ledger, local, clock):
    """Item 1: a restatement fenced by reconciliation (its lease ran out while it read its source) must not move the
    key's current pointer: an attempt with a stale fencing token never changes what readers see, and `failed` means
    nothing of that attempt is visible.
    Fails on 0.4.0 (07f55b3): readers see revision 2, ledger current revision 1, state failed."""
    key = key_for(DAY)
    raised = fenced_restatement(ledger, local, clock, key)
    record = ledger.queries.get(str(key))
    readers = local_reader_view(Path(local.root), key)
    observed = {
        "attempt raised": type(raised).__name__,
        "ledger state": record.state.value,
        "ledger's current revision": ledger.restatements.current_revision(str(key)).revision,
        "readers see revision": readers["revision"],
        "readers see place": readers["place"],
    }
    assert observed["readers see revision"] == observed["ledger's current revision"], observed
    assert (observed["ledger state"], observed["readers see place"]) == ("failed", "r1-t1"), (
        f"reconciliation's verdict stands and readers still see revision 1's place: {observed}"
    )
    assert isinstance(raised, FencedOut), f"the stale attempt records nothing: {observed}"


def test_withdrawing_a_fenced_restatement_leaves_readers_on_the_revision_the_ledger_completes(ledger, local, clock):
    """Item 1: after the fenced restatement, `export-ledger restate --withdraw` completes the key at revision N. The
    pointer must equal the ledger's current revision (a withdrawn or fenced revision is never current); v2's
    withdrawal holds the key, fences the destination and looks at its pointer first (--destination).
    Fails on 0.4.0 (07f55b3): exit 0, ledger completed at 1, readers see 2."""
    key = key_for(DAY)
    fenced_restatement(ledger, local, clock, key)
    assert ledger.queries.get(str(key)).state is ExportState.FAILED  # reconciliation's verdict, before the attempt woke
    code = cli.main([
        "--ledger-url", ledger.url, "restate", "--withdraw", str(key), "--destination", local.root,
        "--reason", "source cannot be fixed now",
    ])  # fmt: skip
    record = ledger.queries.get(str(key))
    observed = {
        "withdraw exit code": code,
        "ledger state": record.state.value,
        "ledger's current revision": ledger.restatements.current_revision(str(key)).revision,
        "readers see revision": local_reader_view(Path(local.root), key)["revision"],
        "pointer's fence": local_reader_view(Path(local.root), key)["fence"],
        "withdrawal's token": record.fencing_token,
    }
    assert observed["readers see revision"] == observed["ledger's current revision"], observed
    assert (code, record.state) == (0, ExportState.COMPLETED), f"the withdrawal went through: {observed}"
    assert observed["pointer's fence"] == observed["withdrawal's token"], f"it fenced before it judged: {observed}"


def test_a_restatement_after_a_withdrawn_fenced_one_reads_the_new_source_under_a_new_revision_number(
    ledger, local, clock
):
    """Item 1: the next request after the withdrawal must not reuse revision number N + 1 (the fenced attempt
    wrote a place of it) and must not "repair" from the withdrawn revision: the new source is read and published.
    Fails on 0.4.0 (07f55b3): request numbered 2 while the destination holds 2, status repaired, readers get the
    fenced attempt's rows."""
    key = key_for(DAY)
    fenced_restatement(ledger, local, clock, key)
    withdraw(ledger, local, str(key), operator="ops", reason="source cannot be fixed now")
    request = ledger.restatements.request(str(key), reason="second correction", requested_by="ops")
    at_destination = local_places(Path(local.root), key)
    result = export_key(ledger, local, SCHEMA, item(key, third_version(key)), "run-3/export")
    readers = local_reader_view(Path(local.root), key)
    observed = {
        "new request's revision": request.revision,
        "revisions already at the destination": sorted(at_destination),
        "status": result.status,
        "rows readers see": readers.get("rows"),
        "rows of the new source": len(third_version(key)),
    }
    assert 2 in at_destination, f"the fenced attempt's place of revision 2 is still there: {observed}"
    assert request.revision not in at_destination, observed
    assert (result.status, readers.get("rows")) == ("exported", len(third_version(key))), observed
    assert readers["revision"] == request.revision and readers["intact"], observed


def test_s3_transient_get_error_while_repairing_a_current_revision_never_records_failed(
    s3, s3_bucket, s3_server, ledger, clock, fault_proxy, monkeypatch
):
    """Item 1 (no pause needed, on S3): a restatement dies after committing revision 2 (the pointer names it); the
    retry takes the key over, fences, and reads the committed place back to repair it, meeting one transient GET
    error. `failed` must mean nothing of the attempt is visible, so the key must not be `failed` while readers see
    revision 2. (v2: `after_current` is gone, the commit is the publish: the crash is at `after_publish`.)
    Fails on 0.4.0 (07f55b3): DestinationUnreachable, ledger failed, readers see revision 2."""
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    restatement_dead_after_publishing(ledger, destination, key, monkeypatch)
    clock.advance(minutes=16)

    fault_proxy.inject("error_503", method="GET", when=lambda _m, path: "/r2-t2/data.csv" in path)
    try:
        export_key(ledger, destination, SCHEMA, item(key, corrected(key)), "run-3/export")
        raised = None
    except Exception as exc:
        raised = type(exc).__name__
    assert fault_proxy.remaining == 0, "the repair's read-back met the fault"
    record = ledger.queries.get(str(key))
    readers = s3_reader_view(s3, s3_bucket, key)
    observed = {
        "retry raised": raised,
        "ledger state": record.state.value,
        "ledger's current revision": ledger.restatements.current_revision(str(key)).revision,
        "readers see revision": readers["revision"],
    }
    assert readers["revision"] == 2, f"the dead attempt's commit is visible: {observed}"
    assert not (record.state is ExportState.FAILED and readers["revision"] == 2), observed


@pytest.mark.process
def test_black_box_fenced_restatement_paused_past_its_lease_never_moves_the_pointer(tmp_path):
    """Item 1, black box as reported: a restatement run paused by a failpoint after its claim, a 2-second lease, then
    `export-ledger reconcile`; the run wakes and finishes. Readers must still see the revision the ledger records
    (the issue found the pointer at revision 2 while the ledger said `failed`).
    Fails on 0.4.0 (07f55b3): _current.json says 2, ledger current 1, failed."""
    key_text = "invoice_export/acme/2026-03-08T05:00:00Z"
    partition = "2026-03-08"
    env = process_env(tmp_path, "home-1", EXPORTS_LEASE_TTL_SECONDS="2")
    code, output = finish(materialize(env, partition))
    assert code == 0, output[-3000:]
    ledger_url = env["EXPORTS_LEDGER_URL"]
    assert cli.main(["--ledger-url", ledger_url, "restate", key_text, "--reason", "late invoices"]) == 0

    restating = materialize({**env, FAILPOINTS: "after_claim=pause:12"}, partition)
    book = open_ledger(ledger_url)
    wait_for(
        lambda: (r := book.queries.get(key_text)) is not None and r.state is ExportState.IN_PROGRESS,
        90,
        "the restatement claim",
    )
    time.sleep(3)  # its 2-second lease runs out while it is paused
    reconcile = subprocess.run(
        [EXPORT_LEDGER, "--ledger-url", ledger_url, "reconcile", "--destination", env["EXPORTS_DESTINATION"]],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    after_reconcile = book.queries.get(key_text).state.value
    code, output = finish(restating)
    record = book.queries.get(key_text)
    folder = tmp_path / "exports" / "invoice_export" / "tenant=acme" / "date=2026-03-08"
    pointer = json.loads((folder / POINTER_NAME).read_text())
    observed = {
        "readers see revision (_current.json)": pointer["revision"],
        "ledger's current revision": book.restatements.current_revision(key_text).revision,
        "ledger state": record.state.value,
        "restatement run exit code": code,
        "state after reconcile": after_reconcile,
        "reconcile said": [line for line in reconcile.stdout.splitlines() if key_text in line] or reconcile.stderr,
    }
    assert after_reconcile == "failed", f"reconciliation judged the paused restatement's key: {observed}"
    assert pointer["revision"] == observed["ledger's current revision"], observed


# -- discarding the current revision: the same on local and S3 -----------------------------------------------------


def test_discarding_the_current_revision_behaves_the_same_on_local_and_s3_and_never_leaves_a_dangling_pointer(
    tmp_path, clock, s3, s3_bucket, s3_server, monkeypatch
):
    """Item 2: `resolve --discard-destination` of a restatement that died after committing revision 2 (the pointer
    names it, the ledger does not). The destination's half of the protocol must be one implementation: local and S3
    must do the same, and the pointer must never name (or keep the sha256 of) a revision that is gone. (v2: discard
    deletes revision 2's places and sets the pointer back to the recorded revision 1, on both.)
    Fails on 0.4.0 (07f55b3): local discards the current revision leaving a dangling pointer, S3 refuses."""
    key = key_for(DAY)
    outcomes = {}
    for name, destination in (
        ("local", LocalDestination(str(tmp_path / "exports"))),
        ("s3", s3_destination(s3_bucket, s3_server)),
    ):
        book = open_ledger(f"sqlite:///{tmp_path / f'{name}.sqlite3'}", clock=clock, lease_ttl=LEASE)
        restatement_dead_after_publishing(book, destination, key, monkeypatch)
        clock.advance(minutes=16)
        try:
            resolve_key(book, destination, str(key), action="discard-destination", operator="ops", reason="bad rows")
            what = "discarded"
        except LedgerError as exc:
            what = f"refused ({type(exc).__name__})"
        if name == "local":
            readers = local_reader_view(Path(destination.root), key)
        else:
            readers = s3_reader_view(s3, s3_bucket, key)
        outcomes[name] = {
            "resolve": what,
            "pointer names revision": readers["revision"],
            "it exists": readers["manifest"],
            "intact": readers["intact"],
            "ledger": book.queries.get(str(key)).state.value,
        }
    assert outcomes["local"] == outcomes["s3"], outcomes
    assert all(o["it exists"] and o["intact"] for o in outcomes.values()), outcomes
    assert outcomes["local"]["pointer names revision"] == 1, outcomes
