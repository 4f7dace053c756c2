"""Every call the multi-host test makes into ``export_ledger``: the export worker, and the host's ledger calls.

This is the one module of :mod:`tests.multihost` that imports the library, so that a change of its API is ported
here alone. The rest of the test speaks plain data: JSON configs, journal lines and dicts.

The worker (``python -m tests.multihost.worker CONFIG.json``, started inside a test host's namespace under
``faketime``) loops over a fixed set of logical keys (business dates x tenants of a small in-memory source),
exporting each through the library's write protocol (:func:`export_ledger.protocol.export_key`, with
:class:`~export_ledger.ExportLedger` on the shared PostgreSQL ledger and
:class:`~export_ledger.destinations.s3.S3Destination` on the shared bucket), with a short lease. Refused and failed
keys are tried again on the next pass; a key is done once an attempt reports it exported, repaired or already
completed. It stops between two keys once the stop file exists (or once the test process is gone, or after
``max_seconds``: a worker never outlives a test that was killed before its teardown).

The ledger's clock is the library's default: the PostgreSQL server's (``now()`` in each deciding transaction), so a
worker's faked time decides nothing: that is what the test puts under pressure. The journal (one JSON object a line)
records each claim with its fencing token and each outcome, stamped with the **true** time (the faked clock minus the
offset the worker was started with), so the host can judge leases by one clock afterwards.

Host side: :func:`prepare_ledger`, :class:`Reconciler` (``reconcile_batch`` passes), :func:`holders`,
:func:`snapshot` and :func:`dispose`.

Porting to a reworked API, what the rest of the test relies on:

* the journal's ``claim`` events (token, true times ``before``/``after``, ``previous_state``: ``in_progress`` for a
  takeover) come from :class:`JournaledLedger`, which wraps whatever call takes a key's lease; without
  ``previous_state`` the survey falls back to the holder's own journal;
* ``result`` events carry the result's status (``exported``, ``repaired``, ``already_completed``), location,
  sha256, committed attempt and revision; ``error`` events the exception's class (a fenced attempt's class is in
  ``survey.FENCED_ERRORS``);
* :func:`snapshot` returns each record as plain data (``revision``: the key's current recorded revision, 1 today),
  the attempt rows, and the keys the ledger escalates;
* the ledger's clock: the server's, never passed in: the skew must not matter.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import pandas as pd

from export_ledger import ExportLedger, ExportSchema, ExportSource, LogicalKey, window_for
from export_ledger.destinations.s3 import S3Destination
from export_ledger.ledger import Claim, ExportState, LedgerError, dispose_engines
from export_ledger.protocol import ExportItem, export_key
from export_ledger.reconcile import reconcile_batch

SCHEMA = ExportSchema(
    {"event_id": "string", "tenant": "string", "occurred_at": "timestamp", "amount": "float"},
    "occurred_at",
    ("event_id",),
    tenant_column="tenant",
)
#: Claims after which a failed key's automatic reruns are spent (the library's default for the sensor).
MAX_ATTEMPTS = 3
DONE = ("exported", "repaired", "already_completed")


# -- the keys ------------------------------------------------------------------------------------------------------


def logical_keys(config: dict) -> list[LogicalKey]:
    zone = config["timezone"]
    return [
        LogicalKey(config["export"], tenant, window_for(dt.date.fromisoformat(day), zone))
        for day in config["dates"]
        for tenant in config["tenants"]
    ]


def key_names(config: dict) -> dict[str, dict]:
    """``{logical key: {"export", "tenant", "business_date"}}`` for the config's keys, as the ledger names them."""
    return {
        str(key): {"export": key.export, "tenant": key.tenant, "business_date": key.window.business_date.isoformat()}
        for key in logical_keys(config)
    }


class SlowSource(ExportSource):
    """A small deterministic source (one event every 30 minutes of the window) that takes a while to read.

    The read sleeps a random time drawn per attempt: it runs after the claim, inside the lease, so that pauses and
    link cuts meet workers in the middle of exports.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def rows(self, tenant: str, start_utc: dt.datetime, end_utc: dt.datetime) -> pd.DataFrame:
        time.sleep(self.delay)
        step = 1800
        first = -(-int(start_utc.timestamp()) // step)
        stamps = list(range(first * step, int(end_utc.timestamp()), step))
        return pd.DataFrame(
            {
                "event_id": [f"{tenant}-{stamp}" for stamp in stamps],
                "tenant": [tenant] * len(stamps),
                "occurred_at": pd.to_datetime(stamps, unit="s", utc=True),
                "amount": [float(stamp % 997) / 10 for stamp in stamps],
            }
        )


# -- the worker ----------------------------------------------------------------------------------------------------


class Journal:
    """Appends one JSON object a line, each written whole with one ``write`` on an ``O_APPEND`` file."""

    def __init__(self, path: str, worker: str, offset_seconds: float) -> None:
        self.worker = worker
        self.offset = offset_seconds
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def true_now(self) -> float:
        """The host's time: this process's (faked) clock minus the offset it was started with."""
        return time.time() - self.offset

    def write(self, event: str, **values) -> None:
        line = json.dumps({"worker": self.worker, "event": event, "t": round(self.true_now(), 4), **values})
        os.write(self._fd, (line + "\n").encode())


class JournaledLedger(ExportLedger):
    """The library's ledger, journaling every claim (token, true times around it) and every refused claim: its
    claims concern's ``claim_many`` (the one call that takes a key's lease) is wrapped."""

    def __init__(self, url: str, *, journal: Journal, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self.journal = journal
        claim_many = self.claims.claim_many

        def journaled(keys, attempt_id, **options):
            before = self.journal.true_now()
            outcomes = claim_many(keys, attempt_id, **options)
            after = self.journal.true_now()
            for key, outcome in zip(keys, outcomes, strict=True):
                if isinstance(outcome, LedgerError):
                    self.journal.write(
                        "refused", key=str(key), attempt=attempt_id, error_class=type(outcome).__name__,
                        error=str(outcome)[:300],
                    )  # fmt: skip
                elif isinstance(outcome, Claim):
                    self.journal.write(
                        "claim", key=outcome.logical_key, attempt=attempt_id, token=outcome.fencing_token,
                        before=round(before, 4), after=round(after, 4), revision=outcome.revision,
                        previous_state=outcome.previous_state.value if outcome.previous_state else None,
                    )  # fmt: skip
            return outcomes

        self.claims.claim_many = journaled


def s3_destination(s3: dict) -> S3Destination:
    return S3Destination(
        bucket=s3["bucket"],
        prefix=s3["prefix"],
        endpoint_url=s3["endpoint_url"],
        access_key_id="testing",
        secret_access_key="testing",
        connect_timeout_seconds=s3.get("connect_timeout_seconds", 2.0),
        read_timeout_seconds=s3.get("read_timeout_seconds", 4.0),
    )


def add_latency(destination: S3Destination, low: float, high: float, rng: random.Random) -> None:
    """Every request of this destination's S3 client waits ``low`` to ``high`` seconds before it is sent: network
    latency between the test hosts and the store, which the veth pairs do not have (and this kernel has no netem).
    It widens the windows between two requests of one export (a data object and its manifest) as a real network
    does. Reaches into the destination's private client: the one place its requests can be hooked."""

    def delay(**_) -> None:
        time.sleep(rng.uniform(low, high))

    destination.store._s3().meta.events.register("before-send.s3", delay)


def run_worker(config: dict) -> int:
    name = config["name"]
    journal = Journal(config["journal"], name, config["clock_offset_seconds"])
    ledger = JournaledLedger(
        config["ledger_url"], journal=journal, lease_ttl=dt.timedelta(seconds=config["lease_seconds"])
    )
    destination = s3_destination(config["s3"])
    rng = random.Random(config["seed"])
    if config["s3"].get("latency_seconds"):
        add_latency(destination, *config["s3"]["latency_seconds"], random.Random(config["seed"] + 1))
    stop = Path(config["stop_file"])
    low, high = config["read_seconds"]
    pending = {str(key): key for key in logical_keys(config)}
    journal.write("start", pid=os.getpid(), keys=len(pending), faked_time=time.time())
    attempts = 0
    give_up = time.monotonic() + config.get("max_seconds", 600)

    def told_to_stop() -> bool:
        # The stop file; or the test is gone (killed before its teardown ran), or the run far outlived its budget.
        if stop.exists() or time.monotonic() > give_up:
            return True
        try:
            os.kill(config["test_pid"], 0)
        except ProcessLookupError:
            return True
        except (KeyError, PermissionError):
            pass
        return False

    while not told_to_stop():
        order = sorted(pending.values(), key=str)
        rng.shuffle(order)
        for key in order:
            if told_to_stop():
                break
            attempts += 1
            attempt = f"{name}/a{attempts}"
            item = ExportItem.streamed(
                key, key.window.business_date.isoformat(), SlowSource(rng.uniform(low, high)), SCHEMA
            )
            started = journal.true_now()
            try:
                result = export_key(ledger, destination, SCHEMA, item, attempt, log=lambda level, message: None)
            except Exception as exc:  # every failure is this key's: journaled, and the key is tried again later
                journal.write(
                    "error",
                    key=str(key),
                    attempt=attempt,
                    started=round(started, 4),
                    error_class=type(exc).__name__,
                    error=str(exc)[:300],
                )
                time.sleep(0.05)
                continue
            journal.write(
                "result",
                key=result.logical_key,
                attempt=attempt,
                started=round(started, 4),
                status=result.status,
                location=result.location,
                sha256=result.sha256,
                committed_attempt=result.committed_attempt,
                revision=result.revision,
                row_count=result.row_count,
            )
            if result.status in DONE:
                pending.pop(str(key), None)
        time.sleep(rng.uniform(0.1, 0.4) if pending else 0.3)
    journal.write("stop", attempts=attempts, pending=sorted(pending))
    return 0


# -- the host's calls ----------------------------------------------------------------------------------------------


def prepare_ledger(url: str) -> None:
    """Creates the ledger's tables (before the workers race to), by opening it to write."""
    ExportLedger(url)


class Reconciler:
    """``reconcile_batch`` passes from the host (its own clock, the store at ``s3``), walking the stuck keys with
    the report's cursor."""

    def __init__(self, url: str, s3: dict, *, lease_seconds: float, name: str = "host-reconciler") -> None:
        self.ledger = ExportLedger(url, lease_ttl=dt.timedelta(seconds=lease_seconds))
        self.destination = s3_destination(s3)
        self.name = name
        self.after: str | None = None

    def pass_once(self, limit: int = 50) -> dict:
        """One batch: ``{"resolved": [[key, state], ...], "findings", "unreachable", "changed_meanwhile",
        "wrapped"}`` (``wrapped``: the walk reached the last stuck key and starts again next time)."""
        report = reconcile_batch(self.ledger, self.destination, limit=limit, after=self.after, reconciler=self.name)
        self.after = report.next_after
        return {
            "resolved": [[record.logical_key, record.state.value] for _, record in report.resolved],
            "findings": [[finding.record.logical_key, finding.verdict.value] for finding in report.findings],
            "unreachable": len(report.unreachable),
            "changed_meanwhile": len(report.changed_meanwhile),
            "wrapped": report.next_after is None,
        }


def _record_dict(record, record_revision: int) -> dict:
    return {
        "logical_key": record.logical_key,
        "export": record.export,
        "tenant": record.tenant,
        "business_date": record.business_date.isoformat(),
        "state": record.state.value,
        "location": record.location,
        "sha256": record.sha256,
        "row_count": record.row_count,
        "committed_attempt": record.committed_attempt,
        "lease_owner": record.lease_owner,
        "lease_expires_at": record.lease_expires_at.timestamp() if record.lease_expires_at else None,
        "fencing_token": record.fencing_token,
        "revision": record_revision,
        "updated_at": record.updated_at.timestamp(),
    }


def holders(url: str, export: str) -> dict[str, dict]:
    """The export's ``in_progress`` keys: ``{logical key: {"owner", "token", "tenant", "business_date"}}``."""
    ledger = ExportLedger(url)
    return {
        record.logical_key: {
            "owner": record.lease_owner,
            "token": record.fencing_token,
            "tenant": record.tenant,
            "business_date": record.business_date.isoformat(),
        }
        for record in ledger.queries.records(export=export, states=[ExportState.IN_PROGRESS])
    }


def snapshot(url: str, export: str) -> dict:
    """The ledger as plain data: every key's record, every attempt row, and the escalated keys with why.

    Escalated is the library's own list (``needs_attention``): in conflict, or failed with its automatic reruns
    spent. ``stuck_after`` is a day, so that waiting alone escalates nothing within the test.
    """
    ledger = ExportLedger(url)
    records = ledger.queries.records(export=export)
    attempts = [
        {
            "logical_key": row.logical_key,
            "attempt_id": row.attempt_id,
            "fencing_token": row.fencing_token,
            "outcome": row.outcome.value,
            "error_class": row.error_class,
            "started_at": row.started_at.timestamp(),
            "finished_at": row.finished_at.timestamp(),
        }
        for row in ledger.queries.all_attempts()
    ]
    escalated = {
        escalation.name: escalation.why
        for escalation in ledger.attention.needs_attention(
            dt.timedelta(days=1), max_attempts=MAX_ATTEMPTS, exports=[export], limit=10_000
        )
    }
    revisions = {}
    for record in records:
        current = ledger.restatements.current_revision(record.logical_key)
        revisions[record.logical_key] = current.revision if current is not None else 1
    return {
        "records": [_record_dict(r, revisions[r.logical_key]) for r in records],
        "attempts": attempts,
        "escalated": escalated,
    }


def dispose() -> None:
    """Closes the host's ledger connections (before the test's schema is dropped)."""
    dispose_engines()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = json.loads(Path(argv[0]).read_text())
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
