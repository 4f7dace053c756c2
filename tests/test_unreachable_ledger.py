"""An unreachable ledger says which of refused, timed out, not resolved, not PostgreSQL, authentication failed or
database missing (issue 27, item 5), found by the library's own probes (a TCP connect, PostgreSQL's SSLRequest, a
connection to the server's ``postgres`` database), never from the driver's words, and never with the password."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy.engine import make_url

from export_ledger import cli
from export_ledger.ledger import ExportLedger, LedgerUnavailable, dispose_engines
from export_ledger.ledger.store import why_unreachable


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def _listener(serve) -> Iterator[int]:
    """A TCP server on 127.0.0.1 whose every connection is handed to ``serve``; its port."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                serve(conn)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_a_closed_port_is_refused():
    port = _free_port()
    assert why_unreachable(f"postgresql://u@127.0.0.1:{port}/x") == (
        f"the connection to 127.0.0.1:{port} was refused (is the database server running there?)"
    )


def test_a_name_that_does_not_resolve_is_said_so():
    assert why_unreachable("postgresql://u@ledger.invalid/x") == "the host name 'ledger.invalid' does not resolve"


def test_a_port_whose_queue_is_full_times_out():
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        port = server.getsockname()[1]
        queued = []
        for _ in range(4):  # fill the accept queue: later connects get no answer
            pending = socket.socket()
            pending.setblocking(False)
            pending.connect_ex(("127.0.0.1", port))
            queued.append(pending)
        try:
            why = why_unreachable(f"postgresql://u@127.0.0.1:{port}/x", timeout=1)
        finally:
            for conn in queued:
                conn.close()
    assert why == f"connecting to 127.0.0.1:{port} timed out after 1 s"


def test_a_server_that_is_not_postgresql_is_said_so():
    with _listener(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")) as port:
        why = why_unreachable(f"postgresql://u@127.0.0.1:{port}/x", timeout=2)
    assert why == f"127.0.0.1:{port} accepted the connection but is not a PostgreSQL server (it did not answer as one)"


def test_a_server_that_accepts_and_says_nothing_is_not_called_something_else():
    """A stopped (SIGSTOPed) server, or a balancer that accepts and waits: no answer is said as such, no guess."""
    hold = threading.Event()
    with _listener(lambda conn: hold.wait(3)) as port:
        why = why_unreachable(f"postgresql://u@127.0.0.1:{port}/x", timeout=1)
        hold.set()
    assert why == f"127.0.0.1:{port} accepted the connection but did not answer as PostgreSQL within 1 s"


def test_a_missing_database_and_a_refused_user_are_told_apart_without_claiming_more(postgres_admin_url):
    admin = make_url(postgres_admin_url)
    where = f"{admin.host}:{admin.port or 5432}"
    missing = admin.set(database="no_such_ledger_db").render_as_string(hide_password=False)
    stranger = admin.set(username="no_such_role", password=None).render_as_string(hide_password=False)

    assert why_unreachable(missing).startswith(
        f"{where} is a PostgreSQL server that accepts user {admin.username!r} (in its postgres database), but not "
        "in 'no_such_ledger_db': the database does not exist,"
    )
    assert why_unreachable(stranger).startswith(
        f"{where} is a PostgreSQL server that refuses user 'no_such_role' with these settings"
    )


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////nonexistent/ledger.sqlite3",
        "mssql+pyodbc://u@dsn",
        "postgresql://u@127.0.0.9/x?host=127.0.0.1",  # libpq connects to the query's host: no probe of another
        "postgresql://u@db..example.com/x",
    ],
)
def test_what_the_probe_cannot_tell_gets_no_guess_and_no_error(url):
    assert why_unreachable(url) in ("", "the host name 'db..example.com' does not resolve")


def test_the_library_keeps_the_class_only_message_and_never_probes(postgres_admin_url, monkeypatch):
    """Runs and sensors open ledgers while a database is down: no probe there (it would add seconds to each open)."""
    from export_ledger.ledger import ExportLedger, LedgerUnavailable, store

    monkeypatch.setattr(store, "_probe", lambda *a: pytest.fail("the library probed"))
    port = _free_port()
    with pytest.raises(LedgerUnavailable, match="OperationalError") as raised:
        ExportLedger(f"postgresql+psycopg2://u@127.0.0.1:{port}/x")
    assert getattr(raised.value, "unreachable", False)


def test_the_cli_says_why_and_never_the_password(capsys):
    port = _free_port()
    code = cli.main(["--ledger-url", f"postgresql+psycopg2://u:topsecret@127.0.0.1:{port}/x", "status"])
    out, err = capsys.readouterr()
    dispose_engines()

    assert code == 1 and out == ""
    assert f"the connection to 127.0.0.1:{port} was refused" in err
    assert "u:***@" in err and "topsecret" not in err


# -- refused at opening: an unreachable server, an uncreatable folder ------------------------------------------------


def test_unreachable_ledger_raises_ledger_unavailable_without_the_password():
    url = "postgresql+psycopg2://user:s3cr3t-pw@127.0.0.1:1/x"

    with pytest.raises(LedgerUnavailable) as unavailable:
        ExportLedger(url)

    message = str(unavailable.value)
    assert "s3cr3t-pw" not in message, "the ledger's password must never reach logs or error messages"
    assert "s3cr3t-pw" not in repr(unavailable.value)
    assert "127.0.0.1" in message, "the message says which ledger could not be reached"


def test_unreachable_ledger_without_password_raises_ledger_unavailable():
    with pytest.raises(LedgerUnavailable, match="127.0.0.1"):
        ExportLedger("postgresql+psycopg2://nobody@127.0.0.1:1/x")


def test_sqlite_ledger_in_an_uncreatable_folder_raises_ledger_unavailable(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the ledger folder should be")

    with pytest.raises(LedgerUnavailable):
        ExportLedger(f"sqlite:///{blocker / 'ledger.sqlite3'}")
