"""The multi-host test's survey (tests/multihost/survey.py) on a bucket written by hand: it reads both layouts as
readers do (the 0.4 key folder and protocol version 2's pointer and places) and reports each kind of problem it is
meant to find. The multi-host test itself needs root and namespaces; this part of it runs everywhere, in the default
tier, so that the survey stays right while the library is reworked under it."""

from __future__ import annotations

import hashlib
import json

import boto3
import pytest
from multihost import survey

PREFIX = "mh"
EXPORT = "mh_export"


def _key(tenant: str, day: str) -> str:
    return f"{EXPORT}/{tenant}/{day}T05:00:00Z"


def _folder(tenant: str, day: str) -> str:
    return f"{PREFIX}/{EXPORT}/tenant={tenant}/date={day}"


def _manifest(tenant: str, day: str, data: bytes, *, data_file: str, attempt: str, token: int, revision: int = 1):
    values = {
        "logical_key": _key(tenant, day),
        "export": EXPORT,
        "tenant": tenant,
        "business_date": day,
        "sha256": hashlib.sha256(data).hexdigest(),
        "row_count": 1,
        "attempt_id": attempt,
        "fencing_token": token,
        "data_file": data_file,
    }
    if revision != 1:
        values["revision"] = revision
    return values


@pytest.fixture
def bucket(s3_server, s3_credentials, s3_bucket):
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)

    def put(key: str, body) -> None:
        client.put_object(Bucket=s3_bucket, Key=key, Body=body if isinstance(body, bytes) else json.dumps(body))

    yield client, s3_bucket, put
    client.close()


def _record(tenant: str, day: str, state: str, **values) -> dict:
    return {
        "logical_key": _key(tenant, day),
        "export": EXPORT,
        "tenant": tenant,
        "business_date": day,
        "state": state,
        "location": None,
        "sha256": None,
        "committed_attempt": None,
        "lease_owner": None,
        "fencing_token": 1,
        "revision": 1,
        **values,
    }


def test_the_survey_reads_both_layouts_and_finds_each_kind_of_problem(bucket):
    client, name, put = bucket
    data = b"event_id,tenant\n1,acme\n"
    sha = hashlib.sha256(data).hexdigest()

    # 0.4 layout, intact: no pointer, revision 1 at the key folder, an orphan of a fenced attempt beside it.
    ok = _folder("acme", "2026-01-05")
    put(f"{ok}/data-t2-aaaa.csv", data)
    put(f"{ok}/data-t1-bbbb.csv", b"orphan")
    put(
        f"{ok}/_manifest.json",
        _manifest("acme", "2026-01-05", data, data_file="data-t2-aaaa.csv", attempt="w1/a1", token=2),
    )
    # 0.4 layout, a manifest whose data object was deleted (issue #18, item 4), on a key the ledger has failed.
    swept = _folder("acme", "2026-01-06")
    put(
        f"{swept}/_manifest.json",
        _manifest("acme", "2026-01-06", data, data_file="data-t1-cccc.csv", attempt="w2/a1", token=1),
    )
    put(f"{swept}/data-t2-dddd.csv", data)
    # Version 2, intact: the pointer names r1-t3; r1-t2 is a fenced attempt's place, invisible.
    v2 = _folder("globex", "2026-01-05")
    put(f"{v2}/r1-t3/data.csv", data)
    put(
        f"{v2}/r1-t3/_manifest.json",
        _manifest("globex", "2026-01-05", data, data_file="data.csv", attempt="w3/a4", token=3),
    )
    put(f"{v2}/r1-t2/data.csv", b"fenced")
    put(
        f"{v2}/r1-t2/_manifest.json",
        _manifest("globex", "2026-01-05", b"fenced", data_file="data.csv", attempt="w1/a2", token=2),
    )
    pointer = {
        "format": 2,
        "logical_key": _key("globex", "2026-01-05"),
        "fence": 3,
        "revision": 1,
        "path": "r1-t3",
        "manifest": "r1-t3/_manifest.json",
        "data_file": "r1-t3/data.csv",
        "sha256": sha,
        "row_count": 1,
    }
    put(f"{v2}/_current.json", pointer)
    # Version 2, the pointer and the manifest it names disagree (revision), and a stale token above the fence.
    torn = _folder("globex", "2026-01-06")
    put(f"{torn}/r1-t4/data.csv", data)
    put(
        f"{torn}/r1-t4/_manifest.json",
        _manifest("globex", "2026-01-06", data, data_file="data.csv", attempt="w1/a9", token=4),
    )
    moved = {
        "revision": 2,
        "fence": 3,
        "path": "r1-t4",
        "manifest": "r1-t4/_manifest.json",
        "data_file": "r1-t4/data.csv",
    }
    put(f"{torn}/_current.json", {**pointer, "logical_key": _key("globex", "2026-01-06"), **moved})
    # Version 2, nothing published yet (fenced at 5), an attempt's data staged without its manifest.
    staged = _folder("globex", "2026-01-07")
    put(
        f"{staged}/_current.json", {"format": 2, "logical_key": _key("globex", "2026-01-07"), "fence": 5, "revision": 0}
    )
    put(f"{staged}/r1-t5/data.csv", data)
    # A 0.4 key folder the ledger has no row for.
    put(
        f"{_folder('acme', '2026-01-08')}/_manifest.json",
        _manifest("acme", "2026-01-08", data, data_file="x.csv", attempt="w9/a1", token=1),
    )
    put(f"{_folder('acme', '2026-01-08')}/x.csv", data)

    views, strays = survey.read_bucket(client, name, PREFIX)
    assert strays == []
    assert {v.layout for v in views.values()} == {"legacy", "v2"}
    assert views[ok].current.data_key == f"{ok}/data-t2-aaaa.csv" and views[ok].hidden() == {"data-t1-bbbb.csv"}
    assert [r.place for r in views[v2].reachable] == ["r1-t3"]  # the fenced place is not reachable
    assert views[v2].hidden() == {"r1-t2/data.csv", "r1-t2/_manifest.json"}
    assert views[staged].current is None
    # Only the version-2 place without a manifest is staged: the 0.4 key folders hold their manifests.
    assert survey.staged_tokens(client, name, PREFIX) == {staged: {5}}
    assert survey.staged_tokens(client, name, staged) == {staged: {5}}

    records = [
        _record(
            "acme", "2026-01-05", "completed", location=f"s3://{name}/{ok}/", sha256=sha, committed_attempt="w1/a1"
        ),
        _record("acme", "2026-01-06", "failed", fencing_token=4),
        _record(
            "globex",
            "2026-01-05",
            "completed",
            location=f"s3://{name}/{v2}/r1-t3/",
            sha256=sha,
            committed_attempt="w3/a4",
        ),
        # Completed as another attempt than the manifest names: the ledger and the reader disagree.
        _record(
            "globex",
            "2026-01-06",
            "completed",
            location=f"s3://{name}/{torn}/r1-t4/",
            sha256=sha,
            committed_attempt="w2/a7",
        ),
        _record("globex", "2026-01-07", "in_progress", lease_owner="w2/a3", fencing_token=5),
        _record(
            "globex",
            "2026-01-09",
            "completed",
            location=f"s3://{name}/{_folder('globex', '2026-01-09')}/",
            sha256=sha,
            committed_attempt="w1/a5",
        ),
        _record("acme", "2026-01-09", "conflict"),
        _record("acme", "2026-01-10", "failed", fencing_token=3),
    ]
    attempts = [
        {"logical_key": _key("acme", "2026-01-05"), "attempt_id": attempt, "outcome": "completed"}
        for attempt in ("w1/a1", "w3/a2")
    ]
    expected = {r["logical_key"]: {} for r in records} | {_key("globex", "2026-01-10"): {}}
    escalated = {_key("acme", "2026-01-10"): "failed after 3 claims"}
    key = _key("acme", "2026-01-05")
    journal = [
        {"event": "claim", "worker": "w3", "key": key, "attempt": "w3/a2", "token": 1, "before": 100.0, "after": 100.01,
         "previous_state": None, "t": 100.01},
        # Taken over one second into a five-second lease: a live lease taken.
        {"event": "claim", "worker": "w1", "key": key, "attempt": "w1/a1", "token": 2, "before": 101.0, "after": 101.02,
         "previous_state": "in_progress", "t": 101.02},
        {"event": "result", "worker": "w1", "key": key, "attempt": "w1/a1", "status": "exported", "revision": 1,
         "committed_attempt": "w1/a1", "t": 102.0},
        # Fenced out two seconds into its own lease.
        {"event": "error", "worker": "w3", "key": key, "attempt": "w3/a2", "error_class": "FencedOut", "error": "",
         "t": 102.1},
        # A takeover after the lease (token 2's, until 106.0) ran out is fine; so is a retry of a failed key.
        {"event": "claim", "worker": "w2", "key": key, "attempt": "w2/a8", "token": 3, "before": 107.0, "after": 107.1,
         "previous_state": "in_progress", "t": 107.1},
        {"event": "claim", "worker": "w2", "key": key, "attempt": "w2/a9", "token": 4, "before": 107.5, "after": 107.6,
         "previous_state": "failed", "t": 107.6},
        # Another worker told it committed the key: with the attempt rows, a duplicate.
        {"event": "result", "worker": "w2", "key": key, "attempt": "w2/a9", "status": "exported", "revision": 1,
         "committed_attempt": "w2/a9", "t": 108.0},
    ]  # fmt: skip
    found = survey.check(
        bucket=name,
        views=views,
        strays=strays,
        expected=expected,
        ledger={"records": records, "attempts": attempts, "escalated": escalated},
        journal=journal,
        lease_seconds=5.0,
    )
    problems = found.problems
    print(found.report())
    assert [p.split(":")[0] for p in problems["manifest_without_data"]] == ["mh_export/acme/2026-01-06 ."]
    assert problems["data_mismatch"] == []
    assert [p.split(":")[0] for p in problems["failed_but_visible"]] == ["mh_export/acme/2026-01-06"]
    assert len(problems["two_current"]) == 1 and "revision 2 vs the manifest's 1" in problems["two_current"][0]
    assert "above the fence" in problems["two_current"][0]
    assert sorted(p.split(":")[0] for p in problems["ledger_mismatch"]) == [
        "mh_export/globex/2026-01-06",
        "mh_export/globex/2026-01-09",
    ]
    assert "committed by w2/a7 vs the manifest's w1/a9" in " ".join(problems["ledger_mismatch"])
    assert [p.split(":")[0] for p in problems["visible_without_record"]] == ["mh_export/acme/2026-01-08"]
    assert len(problems["duplicate"]) == 2 and all(p.startswith(key) for p in problems["duplicate"])
    assert len(problems["live_lease_taken"]) == 2
    assert "took over token 2 4.0s before" in problems["live_lease_taken"][0]
    assert problems["live_lease_taken"][0].endswith("and then exported")
    assert "w3/a2 (token 1) was fenced out 2.9s before" in problems["live_lease_taken"][1]
    assert sorted(p.split(":")[0] for p in problems["unsettled"]) == [
        "mh_export/acme/2026-01-06T05",  # failed, its reruns not spent
        "mh_export/globex/2026-01-07T05",  # in_progress
        "mh_export/globex/2026-01-10T05",  # no row at all
    ]
    assert problems["bad_place"] == []
