"""The ledger's pooled connections to a database server (PostgreSQL): a connection the server dropped is replaced
before a transaction uses it, once it sat idle; a connection used moments ago is trusted without a ping (issue #28:
a ping on every checkout cost a round trip on each of a key's two transactions).

The server drops connections for real here: ``pg_terminate_backend`` on this test's own connections (found by their
``application_name``, so tests running beside it keep theirs).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest
import sqlalchemy as sa
from builders import evidence_for, key_for

from export_ledger.ledger import ExportLedger, LedgerUnavailable, store
from export_ledger.ledger.schema import ExportState

pytestmark = pytest.mark.postgres


@pytest.fixture
def named_url(postgres_url):
    """The test's PostgreSQL ledger URL, its connections named so that the server can drop exactly them."""
    name = f"ledger-conn-{uuid.uuid4().hex[:10]}"
    return f"{postgres_url}&application_name={name}", name


def drop_connections(admin_url: str, name: str) -> int:
    """Has the server end every connection named ``name``; returns how many it ended."""
    admin = sa.create_engine(admin_url, poolclass=sa.pool.NullPool)
    try:
        with admin.begin() as conn:
            return len(
                conn.execute(
                    sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :name"),
                    {"name": name},
                ).all()
            )
    finally:
        admin.dispose()


def export_one(ledger: ExportLedger, day: dt.date):
    claim = ledger.claims.claim(key_for(day), "run/step")
    return ledger.completions.complete(claim, evidence_for(claim))


def pings(ledger: ExportLedger, monkeypatch) -> list[int]:
    counted = [0]
    dialect = ledger._engine.dialect
    original = dialect.do_ping

    def counting(dbapi_connection):
        counted[0] += 1
        return original(dbapi_connection)

    monkeypatch.setattr(dialect, "do_ping", counting)
    return counted


def test_a_connection_the_server_dropped_is_replaced_before_the_next_transaction(
    named_url, postgres_admin_url, monkeypatch
):
    url, name = named_url
    monkeypatch.setattr(store, "IDLE_PING_SECONDS", 0.05)
    ledger = ExportLedger(url)
    export_one(ledger, dt.date(2026, 3, 1))
    assert drop_connections(postgres_admin_url, name) >= 1
    time.sleep(0.1)  # idle past the threshold: checked out, pinged, found dead, replaced
    record = export_one(ledger, dt.date(2026, 3, 2))
    assert record.state is ExportState.COMPLETED
    assert ledger.queries.count(states=[ExportState.COMPLETED]) == 2


def test_a_connection_used_moments_ago_is_not_pinged_and_an_idle_one_is(named_url, monkeypatch):
    url, _ = named_url
    monkeypatch.setattr(store, "IDLE_PING_SECONDS", 0.2)
    ledger = ExportLedger(url)
    counted = pings(ledger, monkeypatch)
    export_one(ledger, dt.date(2026, 3, 1))
    for day in range(2, 6):  # eight transactions back to back: none pinged
        export_one(ledger, dt.date(2026, 3, day))
    assert counted[0] == 0
    time.sleep(0.3)
    export_one(ledger, dt.date(2026, 3, 6))
    assert counted[0] == 1  # the claim's checkout after the pause; its completion's came moments later


def test_a_connection_dropped_moments_after_its_use_fails_one_transaction_whole_and_the_next_one_works(
    named_url, postgres_admin_url, monkeypatch
):
    """The cost of trusting a connection used in the last second: the server dropping it in that second fails the
    next transaction before anything of it commits (a claim not taken is retried by its run); the pool then
    replaces its connections."""
    url, name = named_url
    monkeypatch.setattr(store, "IDLE_PING_SECONDS", 3600.0)
    ledger = ExportLedger(url)
    export_one(ledger, dt.date(2026, 3, 1))
    assert drop_connections(postgres_admin_url, name) >= 1
    with pytest.raises(LedgerUnavailable):
        ledger.claims.claim(key_for(dt.date(2026, 3, 2)), "run/step")
    assert ledger.queries.find(key_for(dt.date(2026, 3, 2))) is None  # nothing of it committed
    assert export_one(ledger, dt.date(2026, 3, 2)).state is ExportState.COMPLETED
