"""The multi-host fault test (issue #18, item 5): three export workers on three test hosts, with skewed clocks, cut
links and pauses longer than a lease, sharing one PostgreSQL ledger and one S3 bucket; afterwards readers see each
key exported once, and the ledger agrees with them.

Each test host is a network namespace joined to the host by a veth pair (:mod:`multihost.netns`). The workers reach
PostgreSQL through a forwarder and moto's S3 server directly, both on the host side of their pair
(:mod:`multihost.services`). Each worker runs under Debian's ``faketime`` with its own offset: +20 minutes, -20
minutes, none; every S3 request of a worker waits 30 to 120 ms before it is sent (latency the veth pairs lack). A
seeded schedule (printed) cuts links and SIGSTOPs workers in the middle of exports while the host runs reconciliation
passes; ``EXPORTS_MULTIHOST_SEED`` replays the schedule and the workers' random choices, not the interleaving of real
processes, so a finding may take a few runs of its seed to come back. Then the faults stop, the workers go on until
every key is settled (or a deadline), stop, and reconciliation runs until a round changes nothing. The survey
(:mod:`multihost.survey`) then reads the bucket as readers do, in the 0.4 layout or protocol version 2's, and
compares it with the ledger and the workers' journals.

Needs root, ``ip`` (iproute2), ``faketime`` and the PostgreSQL server; skips without them, except with ``CI=true``,
where it fails. 70 to 110 s on the 2-core test machine (the longer when a key never settles and the wait for it runs
out). The survey itself is tested on its own, everywhere, in test_multihost_survey.py.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import signal
import time

import pytest
from multihost import survey
from multihost import worker as adapter
from multihost.cluster import EXPORT, Cluster, ReconcileLoop
from multihost.faults import FaultRunner, draw_schedule
from multihost.netns import NetworkError, missing_requirements

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.postgres]

#: +20 minutes, -20 minutes, none: the skews the issue reproduced with (a lease is a few seconds here).
CLOCK_OFFSETS = (20 * 60.0, -20 * 60.0, 0.0)
#: Other offsets, in seconds, comma-separated (``0,0,0`` tells clock defects apart from the others).
OFFSETS_ENV = "EXPORTS_MULTIHOST_CLOCK_OFFSETS"
LEASE_SECONDS = 5.0
DATES = [(dt.date(2026, 1, 5) + dt.timedelta(days=i)).isoformat() for i in range(30)]
FAULT_PHASE_SECONDS = 55.0
SETTLE_SECONDS = 40.0  # after the faults: until every key is completed or in conflict, at most this long


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


class Terminated(Exception):
    """SIGTERM arrived during the test (a CI timeout, say): raised so that the teardown still runs."""


def _terminated(signum, frame):
    raise Terminated(f"signal {signum} during the multi-host test")


@pytest.fixture
def cluster(tmp_path, postgres_admin_url):
    reason = missing_requirements()
    if reason is not None:
        _unavailable(reason)
    seed = int(os.environ.get("EXPORTS_MULTIHOST_SEED") or random.SystemRandom().randrange(1, 10**6))
    offsets = tuple(float(x) for x in os.environ[OFFSETS_ENV].split(",")) if os.environ.get(OFFSETS_ENV) else None
    made = Cluster(tmp_path, postgres_admin_url, offsets or CLOCK_OFFSETS, LEASE_SECONDS, DATES, seed)
    # Processes in sessions of their own and namespaces outlive a killed pytest: on SIGTERM, tear down first.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        try:
            made.start()
        except NetworkError as exc:
            _unavailable(f"cannot make the test hosts' namespaces and links: {exc}")
        yield made
    finally:
        try:
            errors = made.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
        assert not errors, f"teardown left something behind: {errors}"


def test_three_hosts_with_skewed_clocks_cut_links_and_paused_workers_export_every_key_once(cluster):
    began = time.monotonic()
    seed = cluster.seed
    schedule = draw_schedule(
        seed, workers=len(cluster.offsets), phase_seconds=FAULT_PHASE_SECONDS, lease_seconds=LEASE_SECONDS
    )
    print(f"\nseed {seed} (replay: EXPORTS_MULTIHOST_SEED={seed})")
    print(
        f"{len(adapter.key_names(cluster.config))} keys ({len(DATES)} dates x 2 tenants), lease {LEASE_SECONDS:.0f}s, "
        "workers: "
        + ", ".join(
            f"w{h.index} in {h.namespace} at {h.ns_addr} (clock {offset / 60:+.0f} min)"
            for h, offset in zip(cluster.network.hosts, cluster.offsets, strict=True)
        )
    )
    print("fault schedule:")
    for fault in schedule:
        print(f"  {fault.describe()}")

    cluster.start_workers()
    cluster.wait_ready(timeout=60)
    print(f"workers ready after {time.monotonic() - began:.1f}s")
    reconciling = ReconcileLoop(cluster, interval=1.0).start()
    applied: list[str] = []

    def apply(fault):
        (cluster.cut if fault.kind == "cut" else cluster.pause)(fault.worker)

    def undo(fault):
        (cluster.restore if fault.kind == "cut" else cluster.resume)(fault.worker)

    runner = FaultRunner(schedule, apply, undo, cluster.moment, log=applied.append)
    try:
        runner.run(time.monotonic())
    finally:
        runner.undo_all()
    print("faults applied:")
    for line in applied:
        print(f"  {line}")

    keys = adapter.key_names(cluster.config)
    settle_deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < settle_deadline:
        states = {r["logical_key"]: r["state"] for r in adapter.snapshot(cluster.host_ledger_url, EXPORT)["records"]}
        if all(states.get(key) in ("completed", "conflict") for key in keys):
            break
        time.sleep(1.0)
    print(f"settled (or gave up) {time.monotonic() - began:.1f}s in")
    reconciling.stop()
    codes = cluster.stop_workers(grace=15)
    print(f"workers stopped: exit codes {codes}")
    time.sleep(LEASE_SECONDS + 0.5)  # every lease the host's clock can see end has ended
    rounds = reconciling.until_quiet()
    print(
        f"reconciliation: {reconciling.passes} passes, resolved {reconciling.resolved}, "
        f"{len(reconciling.errors)} passes failed, quiet after {rounds} final round(s)"
    )

    views, strays = survey.read_bucket(cluster.s3_client, cluster.bucket, cluster.prefix)
    ledger = adapter.snapshot(cluster.host_ledger_url, EXPORT)
    journal = cluster.journal()
    findings = survey.check(
        bucket=cluster.bucket,
        views=views,
        strays=strays,
        expected=keys,
        ledger=ledger,
        journal=journal,
        lease_seconds=LEASE_SECONDS,
    )
    findings.counts["faults applied"] = len(runner.applied)
    findings.counts["faults that found their moment (a held key, a staged upload)"] = sum(
        1 for a in runner.applied if a["holding"]
    )
    findings.counts["runtime seconds"] = round(time.monotonic() - began, 1)
    print(findings.report())
    _print_stories(findings, journal, keys)
    assert not findings.failed, (
        f"seed {seed}: {sum(len(v) for v in findings.failed.values())} problems "
        f"({', '.join(f'{k}: {len(v)}' for k, v in findings.failed.items())}); replay with "
        f"EXPORTS_MULTIHOST_SEED={seed}"
    )


def _print_stories(findings: survey.Findings, journal: list[dict], keys: dict[str, dict]) -> None:
    """The journals' timeline of a few keys with a problem readers can see (not only a lease taken early)."""
    start = min((e["t"] for e in journal), default=0.0)
    by_day = {(v["tenant"], v["business_date"]): key for key, v in keys.items()}
    shown = []
    for check in ("manifest_without_data", "duplicate", "two_current", "ledger_mismatch", "failed_but_visible"):
        for item in findings.problems[check]:
            head = item.split(":")[0].split(" ")[0]
            key = head if head in keys else by_day.get(tuple(head.split("/")[1:3]))
            if key and key not in shown and len(shown) < 3:
                shown.append(key)
    for key in shown:
        print(f"timeline of {key} (workers' journals, true time since the first event):")
        for line in survey.timeline(journal, key, start):
            print(f"  {line}")
