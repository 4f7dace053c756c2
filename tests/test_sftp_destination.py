"""The SFTP destination against Debian's OpenSSH server (tests/sftp_fixtures.py): a store that can only create, each
key's pointer a sequence of created pointer objects (export_ledger/destinations/sequence.py).

The contract suite, the restatements, read_current and the end-to-end run hold it to what every publishing kind does.
These hold it to what is its own: racing writers and a fence never change what a partner reading the pointer objects
sees unless they hold the key; a connection cut mid-upload publishes nothing; a cut during the pointer's create is an
unknown outcome that the sequence settles; a restarted server is reached again; the host key is always checked; a spec
carrying a credential is refused without echoing it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from builders import key_for
from object_buckets import sftp_client, sftp_objects
from sftp_fixtures import CuttingProxy, SshServer

from export_ledger.destinations import ExportTarget, Fenced, PointerMoved, Verdict
from export_ledger.destinations.base import DestinationError, DestinationUnreachable, PublishOutcomeUnknown
from export_ledger.destinations.registry import destination_from
from export_ledger.destinations.sftp import SftpStore
from export_ledger.errors import ConfigurationError
from export_ledger.frames import Manifest

KEY = key_for()

TABLE = pa.table({"invoice_id": ["a", "b"], "amount": [1.0, 2.0]})
BIG = pa.table({"invoice_id": [f"invoice-{n:06d}" for n in range(20000)], "amount": [float(n) for n in range(20000)]})


def target(revision: int = 1) -> ExportTarget:
    return ExportTarget(KEY.export, KEY.tenant, KEY.window.business_date.isoformat(), revision)


def manifest(token: int, revision: int = 1) -> Manifest:
    """Revision ``revision``'s manifest as party ``token`` writes it (the stage fills in its sha256 and count)."""
    return Manifest.build(
        logical_key=str(KEY), export=KEY.export, tenant=KEY.tenant, window=KEY.window, row_count=0, sha256="",
        attempt_id=f"run-{token}/invoice_export", fencing_token=token, data_file="data.csv", tz_database="test",
        revision=revision, supersedes=(revision - 1, "ab" * 32) if revision > 1 else None,
    )  # fmt: skip


def key_folder(destination) -> str:
    return destination.key_folder(target())


def partner_sees(server, folder: str, destination) -> dict:
    """What a partner reading with its own session sees of the key: the highest pointer object, or {}."""
    sftp = sftp_client(server)
    try:
        found = sftp_objects(sftp, f"{folder}/{key_folder(destination)}")
    finally:
        sftp.close()
    return json.loads(found["_current.json"]) if "_current.json" in found else {}


def pointer_objects(folder: str, destination) -> list[dict]:
    """Every pointer object the key holds, in order (the server is on this machine)."""
    found = sorted((Path(folder) / key_folder(destination) / "_pointers").glob("*.json"))
    return [json.loads(path.read_bytes()) for path in found]


def test_racing_writers_and_a_fence_never_change_what_a_reader_sees_below_the_fence(sftp_server, sftp_folder):
    """A fence at token 5, then four parties commit revision 1 at once: the two below the fence are Fenced and
    create no pointer object at all; of the two above, exactly one moves the pointer, and the reader sees its place."""
    destination = sftp_server.destination(sftp_folder)
    destination.fence(target(), 5, logical_key=manifest(5).logical_key)
    staged = {token: destination.stage(target(), token, TABLE, "csv", manifest(token)) for token in (3, 4, 6, 7)}
    barrier, outcomes = threading.Barrier(len(staged)), {}

    def commit(token: int) -> None:
        barrier.wait(timeout=10)
        try:
            destination.commit(staged[token], token, superseded=0)
            outcomes[token] = "committed"
        except (Fenced, PointerMoved) as exc:
            outcomes[token] = type(exc).__name__

    threads = [threading.Thread(target=commit, args=(token,)) for token in staged]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert outcomes[3] == outcomes[4] == "Fenced", outcomes
    winners = [token for token in (6, 7) if outcomes[token] == "committed"]
    assert len(winners) == 1, outcomes
    seen = partner_sees(sftp_server, sftp_folder, destination)
    assert (seen["revision"], seen["path"], seen["fence"]) == (1, f"r1-t{winners[0]}", winners[0])
    written = pointer_objects(sftp_folder, destination)
    assert [p["fence"] for p in written] == [5, winners[0]], "the fence, then one commit: nothing of tokens 3 and 4"
    assert destination.pointer(target()).tag == "2", "the current pointer is the highest number"


def test_a_fence_then_a_stale_commit_leaves_the_reader_on_what_it_saw(sftp_server, sftp_folder):
    destination = sftp_server.destination(sftp_folder)
    staged = destination.stage(target(), 1, TABLE, "csv", manifest(1))
    destination.commit(staged, 1, superseded=0)
    before = partner_sees(sftp_server, sftp_folder, destination)
    later = destination.stage(target(2), 2, TABLE, "csv", manifest(2, 2))
    destination.fence(target(), 3, logical_key=manifest(3).logical_key)
    with pytest.raises(Fenced, match="fenced at token 3"):
        destination.commit(later, 2, superseded=1)
    after = partner_sees(sftp_server, sftp_folder, destination)
    assert {k: v for k, v in after.items() if k != "fence"} == {k: v for k, v in before.items() if k != "fence"}
    assert after["fence"] == 3 and len(pointer_objects(sftp_folder, destination)) == 2


@pytest.fixture
def proxy(sftp_server):
    cutting = CuttingProxy(sftp_server.port)
    yield cutting
    cutting.close()


def test_a_connection_cut_mid_upload_publishes_nothing_and_the_next_attempt_publishes(sftp_server, sftp_folder, proxy):
    destination = sftp_server.destination(sftp_folder, port=proxy.port)
    destination.fence(target(), 1, logical_key=manifest(1).logical_key)  # connected, checked: the data file is next
    proxy.arm(cut_after=64 << 10)  # inside the data file's ~400 kB
    with pytest.raises(DestinationError, match="cannot write .*data.csv") as cut:
        destination.stage(target(), 1, BIG, "csv", manifest(1))
    assert not isinstance(cut.value, PublishOutcomeUnknown) and proxy.cuts == 1
    assert partner_sees(sftp_server, sftp_folder, destination)["revision"] == 0, "only the fence: nothing published"

    staged = destination.stage(target(), 1, BIG, "csv", manifest(1))  # a new connection
    destination.commit(staged, 1, superseded=0)
    seen = partner_sees(sftp_server, sftp_folder, destination)
    assert (seen["revision"], seen["row_count"]) == (1, BIG.num_rows)


@pytest.mark.parametrize("delivered", [True, False], ids=["rename-done-answer-lost", "rename-never-sent"])
def test_a_cut_during_the_pointers_create_is_unknown_and_the_sequence_settles_it(
    sftp_server, sftp_folder, proxy, monkeypatch, delivered
):
    """The connection is cut at the rename that creates pointer object 1: after the server did it (its answer lost),
    or before the request reached it. Either way the commit cannot know; the verdict, read from the sequence on a
    new connection, says which (what reconciliation records)."""
    destination = sftp_server.destination(sftp_folder, port=proxy.port)
    staged = destination.stage(target(), 1, TABLE, "csv", manifest(1))
    create = SftpStore._create

    def cut_at_the_pointer(store, temporary, name, data):
        if "/_pointers/" in name:
            proxy.arm_after_request() if delivered else proxy.arm(cut_after=0)
        return create(store, temporary, name, data)

    monkeypatch.setattr(SftpStore, "_create", cut_at_the_pointer)
    with pytest.raises(PublishOutcomeUnknown, match="may or may not exist"):
        destination.commit(staged, 1, superseded=0)
    monkeypatch.setattr(SftpStore, "_create", create)

    verdict = destination.verify(target(), logical_key=manifest(1).logical_key, superseded=0).verdict
    assert verdict is (Verdict.PUBLISHED if delivered else Verdict.ABSENT)
    assert partner_sees(sftp_server, sftp_folder, destination).get("revision", 0) == (1 if delivered else 0)


def test_a_restarted_server_is_reached_again_and_a_stopped_one_is_unreachable(tmp_path):
    server = SshServer(tmp_path / "sshd").start()
    try:
        destination = server.destination(str(tmp_path / "exports"))
        destination.fence(target(), 1, logical_key=manifest(1).logical_key)
        server.stop()
        # The open session's next request meets the closed connection (nothing was created, and it is dropped), or
        # the session saw it close first and connects again, refused.
        with pytest.raises(DestinationError, match="connection lost.*nothing was created|cannot connect") as lost:
            destination.stage(target(), 1, TABLE, "csv", manifest(1))
        assert not isinstance(lost.value, PublishOutcomeUnknown)
        with pytest.raises(DestinationUnreachable, match="cannot connect"):  # a new one is refused
            destination.stage(target(), 1, TABLE, "csv", manifest(1))
        server.start()
        staged = destination.stage(target(), 1, TABLE, "csv", manifest(1))
        destination.commit(staged, 1, superseded=0)
        assert destination.pointer(target()).revision == 1
    finally:
        server.stop()


def test_a_write_the_server_fails_mid_upload_publishes_nothing(tmp_path):
    """The server stores only the first 100 kB of a file (a full disk: its writes past that answer an error, the
    connection stays up). The data file's pipelined writes are not each awaited, so their errors come back unasked
    for: the stage must still fail, and nothing of the cut data file may ever become current."""
    server = SshServer(tmp_path / "sshd", file_size_limit=100_000).start()
    try:
        destination = server.destination(str(tmp_path / "exports"))
        with pytest.raises(DestinationError, match="cannot write .*data.csv") as failed:
            staged = destination.stage(target(), 1, BIG, "csv", manifest(1))
            destination.commit(staged, 1, superseded=0)  # reached only when the stage missed the failure
        assert not isinstance(failed.value, PublishOutcomeUnknown)
        assert destination.pointer(target()).revision == 0, "nothing published"
        assert not list((tmp_path / "exports").rglob("_manifest.json")), "no manifest names the cut data file"
    finally:
        server.stop()


def test_a_failed_login_is_unreachable_and_its_message_names_the_settings_never_the_login(sftp_server, sftp_folder):
    """A login the server refuses: nothing happened (unreachable); the message, which reaches the ledger and the logs,
    names the settings to look at, not the login name (half of a credential) nor the key file."""
    destination = dataclasses.replace(sftp_server.destination(sftp_folder), sftp_user="partner-login-7f3a")
    with pytest.raises(DestinationUnreachable, match="authentication failed") as refused:
        destination.pointer(target())
    assert "sftp_user" in str(refused.value)
    assert "partner-login-7f3a" not in str(refused.value) and sftp_server.key_file not in str(refused.value)


def test_the_startup_check_leaves_another_process_probe_alone(sftp_server, sftp_folder, monkeypatch):
    """Every process checks the server before its first write, in one probe folder: a worker's steps start together.
    One process's cleanup must not remove another's probe file while it is being written (nor the folder it is about
    to write in), or that process's check fails and its run with it."""
    from export_ledger.destinations import sftp

    monkeypatch.setattr(sftp, "_CHECKED", set())
    probes = Path(sftp_folder) / ".export-ledger-probe"
    probes.mkdir()
    theirs = probes / ".tmp-0123abcd-5f5f5f5f5f5f5f5f"  # another process's probe, written, not yet renamed
    theirs.write_bytes(b"1")
    sftp_server.destination(sftp_folder).raw_store.check_conditions()
    assert theirs.exists(), "another process's probe file, removed under it"
    assert sorted(p.name for p in probes.iterdir()) == [theirs.name], "this process's own probes are removed"


def test_an_unknown_host_key_is_refused_never_added(sftp_server, sftp_folder, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    destination = sftp_server.destination(sftp_folder, sftp_known_hosts=str(empty))
    with pytest.raises(DestinationError, match="host key is not in .*never added"):
        destination.pointer(target())
    assert empty.read_text() == "", "nothing was added"


def test_a_spec_with_a_credential_is_refused_without_echo_and_settings_come_from_the_environment(sftp_server):
    with pytest.raises(ConfigurationError) as refused:
        destination_from("sftp://bob:hunter2@127.0.0.1/srv/exports", ledger_url="")
    assert "hunter2" not in str(refused.value) and "EXPORTS_SFTP_KEY_PASSPHRASE" in str(refused.value)
    built = destination_from(
        f"sftp://127.0.0.1:{sftp_server.port}/srv/exports", ledger_url="", environ=sftp_server.environment()
    )
    assert (built.sftp_user, built.sftp_key_file, built.path) == (
        sftp_server.user,
        sftp_server.key_file,
        "/srv/exports",
    )
    with pytest.raises(ConfigurationError, match="names no folder"):
        destination_from("sftp://127.0.0.1/", ledger_url="")


def test_the_partners_reader_in_the_docs_reads_what_the_destination_made_current(sftp_server, sftp_folder):
    """docs/destinations.md's paramiko reader, run as written, on a key restated once and fenced since."""
    section = Path(__file__).parents[1].joinpath("docs", "destinations.md").read_text().split("## SFTP", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/destinations.md", "exec"), namespace)  # noqa: S102 - the docs' own example
    destination = sftp_server.destination(sftp_folder)
    sftp = sftp_client(sftp_server)
    try:
        folder = f"{sftp_folder}/{key_folder(destination)}"
        assert namespace["current"](sftp, folder) is None, "a key never held"
        destination.fence(target(), 1, logical_key=manifest(1).logical_key)
        assert namespace["current"](sftp, folder) is None, "fenced, nothing published"
        first = destination.stage(target(), 1, TABLE, "csv", manifest(1))
        destination.commit(first, 1, superseded=0)
        second = destination.stage(target(2), 2, BIG, "csv", manifest(2, 2))
        destination.commit(second, 2, superseded=1)
        destination.fence(target(), 3, logical_key=manifest(3).logical_key)
        pointer, data = namespace["current"](sftp, folder)
    finally:
        sftp.close()
    assert (pointer["revision"], pointer["path"], pointer["fence"]) == (2, "r2-t2", 3)
    assert len(data) > 100_000 and pointer["row_count"] == BIG.num_rows


def test_moving_the_pointer_from_the_version_read_is_refused_once_another_party_moved_it(sftp_server, sftp_folder):
    """The sequence's compare-and-swap, step by step: a party reads version N, another moves the pointer to N + 1
    meanwhile; the first party's move from N is refused (it never becomes N + 2), as is a create-if-absent of a pointer
    that exists; the pointer objects are the two accepted writes, in order."""
    from export_ledger.destinations.store import PreconditionFailed

    store = sftp_server.destination(sftp_folder).store
    name = "invoice_export/tenant=acme/date=2026-03-08/_current.json"
    assert store.get(name) is None
    assert store.put_if_match(name, b'{"first": 1}', None) == "1"
    read = store.get(name)
    assert (read.data, read.tag) == (b'{"first": 1}', "1")
    assert store.put_if_match(name, b'{"other": 2}', read.tag) == "2"  # another party, from the same version
    with pytest.raises(PreconditionFailed):
        store.put_if_match(name, b'{"stale": 3}', read.tag)
    with pytest.raises(PreconditionFailed):
        store.put_if_match(name, b'{"absent?": 4}', None)
    assert store.get(name) == type(read)(b'{"other": 2}', "2")
    folder = Path(sftp_folder) / "invoice_export/tenant=acme/date=2026-03-08/_pointers"
    assert sorted(p.name for p in folder.iterdir()) == ["000000000001.json", "000000000002.json"]
    assert store.list("invoice_export/") == [name], "a listing shows the pointer, never its objects as a place"


def test_a_session_of_a_thread_that_ended_is_closed_when_the_next_one_opens(sftp_server, sftp_folder):
    """Each thread holds its own session (paramiko's SFTP client serves one thread at a time); a worker's threads
    come and go, so the sessions of ended threads are closed, not left open until the process ends."""
    from export_ledger.destinations import sftp

    destination = sftp_server.destination(sftp_folder)
    ours = destination.raw_store.server
    release = threading.Event()

    def read_then_wait() -> None:
        destination.pointer(target())
        release.wait(10)

    threads = [threading.Thread(target=read_then_wait) for _ in range(3)]
    for thread in threads:
        thread.start()
    ended = [thread.ident for thread in threads]  # distinct while they all run (an ended thread's may be reused)
    deadline = time.monotonic() + 10
    while sum(key[-1] in ended for key in sftp._OPEN) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
    for thread in threads:
        thread.join(10)
    assert sum(key[-1] in ended for key in sftp._OPEN) == 3, "each thread opened its own"
    another = sftp.SftpServer(**{**vars(ours), "connect_timeout": ours.connect_timeout + 1})
    another.connection()  # a new session: the ended threads' are closed first
    assert [key for key in sftp._OPEN if key[-1] in ended] == []
    another.drop()
