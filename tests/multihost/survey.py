"""What readers see in the bucket, compared with the ledger and with what the workers journaled. No export_ledger.

The bucket is read directly (a listing and plain GETs on the server), never through the destination's own code. Two
layouts are understood, as docs/protocol.md describes them:

* **Protocol version 2**: a key's pointer ``date=D/_current.json`` with ``"format": 2``, a ``fence`` and
  ``revision`` (0: nothing published), naming one place ``r<rev>-t<token>/`` (its ``manifest`` and ``data_file``,
  relative to the key folder). Readers see only what the pointer names; every other place is invisible.
* **The 0.4 layout** (what the code before the rework writes): no pointer and a ``_manifest.json`` in the key folder
  is revision 1 at the key folder (``path: "."``), its data object the one the manifest names; a pointer without
  ``format`` names ``path: "revision=N"`` (or ``"."``). Every ``revision=N/`` place stays readable.

A key's **current revision** is what a reader resolves: the pointer's, or revision 1 at the key folder when there is
no pointer and the key folder has a manifest, or nothing.

Checks (each a list of problems; the test asserts every list is empty):

* ``manifest_without_data``: a manifest a reader can reach names a data object that does not exist;
* ``data_mismatch``: a reachable data object whose sha256 is not its manifest's (or the pointer's);
* ``bad_place``: a reachable manifest of another key or revision than its place says, or unreadable;
* ``two_current``: the pointer and the manifest it names disagree on the revision, export or sha256, or a version-2
  pointer says nothing is published while the key folder holds a 0.4 manifest (two answers to "what is current");
* ``ledger_mismatch``: a ``completed`` key whose recorded sha256, location, committed attempt or revision is not what
  the reader's current revision is (or nothing is current);
* ``failed_but_visible``: a ``failed`` key never completed whose export a reader can see;
* ``visible_without_record``: a key folder a reader can read with no ledger row;
* ``duplicate``: a key with two published exports of one revision: two reachable manifests of one revision, two
  attempt rows that committed it (``completed`` or ``repaired``) for one revision, or two different committed
  attempts reported by workers' results;
* ``live_lease_taken``: by the host's clock (the journals' true times), a worker claimed a key while another worker's
  lease on it was live and that worker was still exporting, or an attempt was fenced out within its own lease;
* ``unsettled``: a key neither ``completed`` nor escalated (``conflict``, or on the ledger's own escalation list).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

POINTER = "_current.json"
MANIFEST = "_manifest.json"
_DATE = re.compile(r"^date=\d{4}-\d{2}-\d{2}$")
_V2_PLACE = re.compile(r"^r(\d+)-t(\d+)$")
_OLD_PLACE = re.compile(r"^revision=(\d+)$")
#: Error classes of an attempt refused at its completion because its lease was taken (the rework may rename them).
FENCED_ERRORS = frozenset({"FencedOut", "Fenced"})
#: Slack when comparing journal times with a lease (journal stamps are taken around the ledger calls).
LEASE_MARGIN_SECONDS = 0.25
CHECKS = (
    "manifest_without_data",
    "data_mismatch",
    "bad_place",
    "two_current",
    "ledger_mismatch",
    "failed_but_visible",
    "visible_without_record",
    "duplicate",
    "live_lease_taken",
    "unsettled",
)


@dataclass
class Reachable:
    """One manifest a reader can reach, and what its data object turned out to be."""

    place: str  # relative to the key folder: "." , "revision=N" or "r<rev>-t<token>"
    revision: int | None  # as the place's name says (None: not a place name)
    manifest_key: str
    manifest: dict | None
    data_key: str | None
    data_present: bool = False
    data_sha256: str | None = None
    problem: str | None = None


@dataclass
class KeyView:
    """One key folder as readers see it."""

    folder: str
    export: str
    tenant: str
    business_date: str
    objects: set[str] = field(default_factory=set)  # names relative to the key folder
    pointer: dict | None = None
    pointer_problem: str | None = None
    layout: str = "empty"  # "v2", "0.4" (pointer without format), "legacy" (no pointer), "empty"
    current: Reachable | None = None
    reachable: list[Reachable] = field(default_factory=list)

    @property
    def day(self) -> tuple[str, str, str]:
        return (self.export, self.tenant, self.business_date)

    def hidden(self) -> set[str]:
        """Objects of the key folder that no reader reads: neither the pointer nor a reachable manifest or data."""
        seen = {POINTER} | {r.manifest_key for r in self.reachable} | {r.data_key for r in self.reachable}
        return {name for name in self.objects if name not in seen and f"{self.folder}/{name}" not in seen}

    @property
    def current_revision(self) -> int:
        return 0 if self.current is None else int(self.current.revision or 0)


def _body(client, bucket: str, key: str) -> bytes | None:
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return None


def _json(payload: bytes | None) -> tuple[dict | None, str | None]:
    if payload is None:
        return None, "absent"
    try:
        values = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, "not JSON"
    if not isinstance(values, dict):
        return None, "not a JSON object"
    return values, None


def _place_revision(place: str) -> int | None:
    if place == ".":
        return 1
    if match := _OLD_PLACE.match(place):
        return int(match.group(1))
    if match := _V2_PLACE.match(place):
        return int(match.group(1))
    return None


def read_bucket(client, bucket: str, prefix: str) -> tuple[dict[str, KeyView], list[str]]:
    """Every key folder under ``prefix`` as readers see it, and the objects outside any key folder."""
    views: dict[str, KeyView] = {}
    strays: list[str] = []
    start = prefix.strip("/") + "/" if prefix.strip("/") else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start):
        for item in page.get("Contents", []):
            parts = item["Key"].split("/")
            at = next((i for i, part in enumerate(parts) if _DATE.match(part)), None)
            if at is None or at < 2 or not parts[at - 1].startswith("tenant=") or at == len(parts) - 1:
                if ".export-ledger-probe" not in item["Key"]:
                    strays.append(item["Key"])
                continue
            folder = "/".join(parts[: at + 1])
            view = views.get(folder)
            if view is None:
                view = views[folder] = KeyView(
                    folder, parts[at - 2], parts[at - 1].removeprefix("tenant="), parts[at].removeprefix("date=")
                )
            view.objects.add("/".join(parts[at + 1 :]))
    for view in views.values():
        _resolve(client, bucket, view)
    return views, strays


def _resolve(client, bucket: str, view: KeyView) -> None:
    """Fills in the pointer, the current revision and every reachable manifest (with its data) of one key folder."""
    base = view.folder
    if POINTER in view.objects:
        view.pointer, view.pointer_problem = _json(_body(client, bucket, f"{base}/{POINTER}"))
        view.layout = "v2" if view.pointer is not None and view.pointer.get("format") == 2 else "0.4"
    elif MANIFEST in view.objects:
        view.layout = "legacy"
    pointer = view.pointer or {}
    if view.layout == "v2":
        revision = pointer.get("revision")
        if revision not in (0, None):
            place = str(pointer.get("path", ""))
            view.current = _reach(client, bucket, base, place, pointer.get("manifest"), pointer.get("data_file"))
            view.reachable.append(view.current)
        return  # readers of protocol version 2 see nothing but what the pointer names
    if view.layout == "0.4" and view.pointer is not None:
        place = str(pointer.get("path", "."))
        manifest = MANIFEST if place == "." else f"{place}/{MANIFEST}"
        data = pointer.get("data_file")
        view.current = _reach(
            client,
            bucket,
            base,
            place,
            manifest,
            None if data is None else (data if place == "." else f"{place}/{data}"),
        )
        view.reachable.append(view.current)
    # The 0.4 layout keeps every revision readable: the key folder's manifest and each revision=N/ manifest.
    places = ["."] if MANIFEST in view.objects else []
    places += sorted(
        {
            name.split("/")[0]
            for name in view.objects
            if _OLD_PLACE.match(name.split("/")[0]) and name.endswith(MANIFEST)
        }
    )
    for place in places:
        if view.current is not None and view.current.place == place:
            continue
        manifest = MANIFEST if place == "." else f"{place}/{MANIFEST}"
        reached = _reach(client, bucket, base, place, manifest, None)
        view.reachable.append(reached)
        if view.pointer is None and place == ".":
            view.current = reached  # no pointer: revision 1 at the key folder is current


def _reach(client, bucket: str, base: str, place: str, manifest_name, data_name) -> Reachable:
    """Reads a manifest and the data object a reader would read with it (``data_name`` relative to the key folder,
    or None: the one the manifest names, in the manifest's folder)."""
    reached = Reachable(place, _place_revision(place), f"{base}/{manifest_name}", None, None)
    if not manifest_name:
        reached.problem = "the pointer names no manifest"
        return reached
    reached.manifest, problem = _json(_body(client, bucket, reached.manifest_key))
    if reached.manifest is None:
        reached.problem = f"manifest {reached.manifest_key}: {problem}"
        return reached
    if data_name is None:
        named = reached.manifest.get("data_file")
        if not isinstance(named, str) or not named:
            reached.problem = f"manifest {reached.manifest_key} names no data file"
            return reached
        folder = reached.manifest_key.rpartition("/")[0]
        data_name = f"{folder}/{named}"[len(base) + 1 :]
    reached.data_key = f"{base}/{data_name}"
    payload = _body(client, bucket, reached.data_key)
    reached.data_present = payload is not None
    reached.data_sha256 = hashlib.sha256(payload).hexdigest() if payload is not None else None
    return reached


_DATA_TOKEN = re.compile(r"^data-t(\d+)-")


def staged_tokens(client, bucket: str, prefix: str) -> dict[str, set[int]]:
    """``{key folder: tokens}`` of data objects whose place holds no manifest yet: attempts that uploaded their data
    and have not created their manifest (or never will). Both layouts: a ``data-t<token>-...`` object in a place
    without ``_manifest.json`` (0.4), a place ``r<rev>-t<token>/`` without one (version 2)."""
    places: dict[tuple[str, str], set[str]] = defaultdict(set)
    start = prefix.strip("/") + "/" if prefix.strip("/") else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start):
        for item in page.get("Contents", []):
            parts = item["Key"].split("/")
            at = next((i for i, part in enumerate(parts) if _DATE.match(part)), None)
            if at is None or at == len(parts) - 1:
                continue
            rest = parts[at + 1 :]
            place = rest[0] if len(rest) > 1 else "."
            places[("/".join(parts[: at + 1]), place)].add(rest[-1])
    staged: dict[str, set[int]] = defaultdict(set)
    for (folder, place), names in places.items():
        if MANIFEST in names:
            continue
        if match := _V2_PLACE.match(place):
            if names - {POINTER}:
                staged[folder].add(int(match.group(2)))
            continue
        for name in names:
            if match := _DATA_TOKEN.match(name):
                staged[folder].add(int(match.group(1)))
    return dict(staged)


def timeline(journal: list[dict], key: str, start: float) -> list[str]:
    """One key's story from the workers' journals (claims, refusals, outcomes), true times from ``start``."""
    lines = []
    for event in journal:
        if event.get("key") != key or event["event"] not in ("claim", "result", "error", "refused"):
            continue
        what = {
            "claim": lambda e: f"claims token {e['token']} (from {e.get('previous_state')})",
            "result": lambda e: f"-> {e['status']} (committed by {e['committed_attempt']})",
            "error": lambda e: f"-> {e['error_class']}: {e['error'][:150]}",
            "refused": lambda e: f"refused: {e['error_class']}",
        }[event["event"]](event)
        lines.append(f"t={event['t'] - start:7.2f}s {event['attempt']:>8} {what}")
    return lines


# -- the checks ----------------------------------------------------------------------------------------------------


@dataclass
class Findings:
    problems: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in CHECKS})
    counts: dict[str, object] = field(default_factory=dict)

    def add(self, check: str, message: str) -> None:
        self.problems[check].append(message)

    @property
    def failed(self) -> dict[str, list[str]]:
        return {name: items for name, items in self.problems.items() if items}

    def report(self) -> str:
        lines = ["counts:"]
        lines += [f"  {name}: {value}" for name, value in self.counts.items()]
        lines.append("checks (problems found):")
        for name in CHECKS:
            items = self.problems[name]
            keys = {item.split(":")[0].split(" ")[0] for item in items}
            lines.append(f"  {name}: {len(items)}" + (f" (on {len(keys)} keys)" if len(keys) > 1 else ""))
            lines += [f"    - {item}" for item in items[:12]]
            if len(items) > 12:
                lines.append(f"    ... and {len(items) - 12} more")
        return "\n".join(lines)


def _location_names(bucket: str, view: KeyView, reached: Reachable) -> set[str]:
    """The spellings of a place's location a ledger may record: its folder (with and without the slash) and its
    manifest object."""
    folder = view.folder if reached.place == "." else f"{view.folder}/{reached.place}"
    return {f"s3://{bucket}/{folder}/", f"s3://{bucket}/{folder}", f"s3://{bucket}/{reached.manifest_key}"}


def check(
    *,
    bucket: str,
    views: dict[str, KeyView],
    strays: list[str],
    expected: dict[str, dict],
    ledger: dict,
    journal: list[dict],
    lease_seconds: float,
) -> Findings:
    found = Findings()
    records = {r["logical_key"]: r for r in ledger["records"]}
    by_day = {(r["export"], r["tenant"], r["business_date"]): r for r in records.values()}
    _check_reader(found, bucket, views, by_day)
    seen_days = {view.day for view in views.values()}
    for day, record in sorted(by_day.items()):
        if record["state"] == "completed" and day not in seen_days:
            found.add("ledger_mismatch", f"{'/'.join(day)}: completed in the ledger, but its key folder is empty")
    _check_duplicates(found, views, records, ledger["attempts"], journal)
    _check_settled(found, expected, records, ledger["escalated"])
    states = Counter(r["state"] for r in records.values())
    results = Counter(e["status"] for e in journal if e["event"] == "result")
    errors = Counter(e["error_class"] for e in journal if e["event"] == "error")
    refused = Counter(e["error_class"] for e in journal if e["event"] == "refused")
    found.counts.update(
        {
            "keys expected": len(expected),
            "ledger states": dict(sorted(states.items())),
            "escalated (ledger's list)": len(ledger["escalated"]),
            "key folders in the bucket": len(views),
            "layouts": dict(Counter(v.layout for v in views.values())),
            "objects in key folders": sum(len(v.objects) for v in views.values()),
            "objects outside key folders": len(strays),
            "manifests reachable by readers": sum(len(v.reachable) for v in views.values()),
            "objects readers never see": sum(len(v.hidden()) for v in views.values()),
            "claims journaled": sum(1 for e in journal if e["event"] == "claim"),
            "results journaled": dict(sorted(results.items())),
            "attempts ended by an error (refusals included)": dict(sorted(errors.items())),
            "refusals journaled": dict(sorted(refused.items())),
            "attempt rows": dict(sorted(Counter(a["outcome"] for a in ledger["attempts"]).items())),
        }
    )
    _check_leases(found, journal, lease_seconds)
    return found


def _check_reader(found: Findings, bucket: str, views: dict[str, KeyView], by_day: dict) -> None:
    for view in views.values():
        name = f"{view.export}/{view.tenant}/{view.business_date}"
        if view.pointer_problem is not None:
            found.add("two_current", f"{name}: the pointer is unreadable ({view.pointer_problem})")
        for reached in view.reachable:
            where = f"{name} {reached.place}"
            if reached.problem is not None:
                target = "manifest_without_data" if reached.manifest is not None else "bad_place"
                found.add(target, f"{where}: {reached.problem}")
                continue
            manifest = reached.manifest
            if not reached.data_present:
                found.add(
                    "manifest_without_data",
                    f"{where}: manifest (attempt {manifest.get('attempt_id')}, token {manifest.get('fencing_token')}) "
                    f"names {reached.data_key.rpartition('/')[2]}, which does not exist",
                )
            elif reached.data_sha256 != manifest.get("sha256"):
                found.add("data_mismatch", f"{where}: data sha256 {reached.data_sha256} is not the manifest's")
            if manifest.get("revision", 1) != reached.revision:
                found.add("bad_place", f"{where}: a manifest of revision {manifest.get('revision', 1)} in this place")
            if manifest.get("export") not in (None, view.export) or manifest.get("tenant") not in (None, view.tenant):
                found.add("bad_place", f"{where}: a manifest of {manifest.get('logical_key')}")
            if match := _V2_PLACE.match(reached.place):
                if manifest.get("fencing_token") != int(match.group(2)):
                    found.add("bad_place", f"{where}: a manifest of token {manifest.get('fencing_token')} here")
        _check_current(found, view, name)
        _check_against_ledger(found, bucket, view, name, by_day.get(view.day))


def _check_current(found: Findings, view: KeyView, name: str) -> None:
    pointer, current = view.pointer, view.current
    if view.layout == "v2" and pointer.get("revision") == 0 and MANIFEST in view.objects:
        found.add("two_current", f"{name}: the pointer says nothing is published, the key folder holds a manifest")
    if pointer is None or current is None or current.manifest is None:
        if pointer is not None and pointer.get("revision") not in (0, None) and current is not None:
            found.add("two_current", f"{name}: the pointer names {current.place}, which holds no readable manifest")
        return
    manifest = current.manifest
    disagreements = []
    if pointer.get("revision") != manifest.get("revision", 1):
        disagreements.append(f"revision {pointer.get('revision')} vs the manifest's {manifest.get('revision', 1)}")
    if pointer.get("sha256") not in (None, manifest.get("sha256")):
        disagreements.append("sha256")
    if pointer.get("logical_key") not in (None, manifest.get("logical_key")):
        disagreements.append(f"key {pointer.get('logical_key')} vs {manifest.get('logical_key')}")
    if view.layout == "v2" and pointer.get("fence") is not None and manifest.get("fencing_token") is not None:
        if manifest["fencing_token"] > pointer["fence"]:
            disagreements.append(f"the manifest's token {manifest['fencing_token']} is above the fence")
    if view.layout == "v2" and isinstance(manifest.get("data_file"), str):
        # The pointer names the data object for readers; the manifest names its own, relative to its place (or,
        # spelled as the pointer does, to the key folder).
        named = manifest["data_file"]
        own = {named, named if current.place == "." else f"{current.place}/{named}"}
        if pointer.get("data_file") not in own:
            disagreements.append(f"data file {pointer.get('data_file')} vs the manifest's {named}")
    if disagreements:
        found.add("two_current", f"{name}: the pointer and the manifest it names disagree: {', '.join(disagreements)}")


def _check_against_ledger(found: Findings, bucket: str, view: KeyView, name: str, record: dict | None) -> None:
    current = view.current
    visible = current is not None and current.manifest is not None
    if record is None:
        if visible or view.reachable:
            found.add("visible_without_record", f"{name}: readers see an export the ledger has no row for")
        return
    state = record["state"]
    if state == "completed":
        if not visible:
            found.add("ledger_mismatch", f"{name}: completed in the ledger, but no current export is readable")
            return
        manifest = current.manifest
        wrong = []
        if record["sha256"] != manifest.get("sha256"):
            wrong.append(f"sha256 {str(record['sha256'])[:12]} vs the reader's {str(manifest.get('sha256'))[:12]}")
        locations = _location_names(bucket, view, current)
        key_folder = f"s3://{bucket}/{view.folder}/"
        if record["location"] not in locations and not (view.layout == "v2" and record["location"] == key_folder):
            wrong.append(f"location {record['location']} vs the reader's {sorted(locations)[0]}")
        if record["committed_attempt"] != manifest.get("attempt_id"):
            wrong.append(f"committed by {record['committed_attempt']} vs the manifest's {manifest.get('attempt_id')}")
        if record.get("revision", 1) != view.current_revision:
            wrong.append(f"revision {record.get('revision', 1)} vs the reader's {view.current_revision}")
        if wrong:
            found.add("ledger_mismatch", f"{name}: {'; '.join(wrong)}")
    elif state == "failed" and record["committed_attempt"] is None and visible:
        manifest = current.manifest
        found.add(
            "failed_but_visible",
            f"{name}: failed (never completed) in the ledger, but readers see revision {view.current_revision} by "
            f"attempt {manifest.get('attempt_id')}",
        )


def _check_duplicates(found: Findings, views: dict[str, KeyView], records: dict, attempts: list, journal: list) -> None:
    for view in views.values():
        per_revision = Counter(r.revision for r in view.reachable if r.manifest is not None)
        for revision, count in per_revision.items():
            if count > 1:
                found.add(
                    "duplicate",
                    f"{view.export}/{view.tenant}/{view.business_date}: {count} reachable manifests of revision "
                    f"{revision}",
                )
    committed = defaultdict(list)
    for row in attempts:
        if row["outcome"] in ("completed", "repaired"):
            committed[row["logical_key"]].append(row["attempt_id"])
    for key, rows in committed.items():
        revisions = max(1, int((records.get(key) or {}).get("revision") or 1))
        if len(rows) > revisions:
            found.add("duplicate", f"{key}: {len(rows)} attempt rows committed it ({', '.join(rows)})")
    # What workers were told: an exported or repaired result names the attempt whose export was recorded; an
    # already-completed one, the record's. Two different ones for one key (one revision) are two exports.
    recorded = defaultdict(set)
    every = defaultdict(set)
    for event in journal:
        if event["event"] == "result" and event["status"] in ("exported", "repaired", "already_completed"):
            every[event["key"]].add(event["committed_attempt"])
            if event["status"] != "already_completed":
                recorded[(event["key"], event.get("revision", 1))].add(event["committed_attempt"])
    for (key, revision), seen in sorted(recorded.items()):
        if len(seen) > 1:
            found.add("duplicate", f"{key}: workers were told revision {revision} was committed by {sorted(seen)}")
    for key, seen in sorted(every.items()):
        revisions = max(1, int((records.get(key) or {}).get("revision") or 1))
        if len(seen) > revisions and not any(len(recorded[(key, r)]) > 1 for r in range(1, revisions + 1)):
            found.add("duplicate", f"{key}: workers saw it committed by {sorted(seen)}")


def _check_leases(found: Findings, journal: list, lease_seconds: float) -> None:
    """Leases judged by one clock (the host's): the journals' true times."""
    claims = defaultdict(dict)  # key -> token -> claim event
    ends = {}  # attempt -> the event its export_key call ended with (a result or an error)
    for event in journal:
        if event["event"] == "claim":
            claims[event["key"]][event["token"]] = event
        elif event["event"] in ("result", "error"):
            ends[event["attempt"]] = event
    taken = exported_after = fenced = 0
    for key, by_token in claims.items():
        for token, claim in sorted(by_token.items()):
            taker = by_token.get(token + 1)
            if taker is None:
                continue
            expiry = claim["before"] + lease_seconds
            # A takeover (the key was still in_progress under the holder) must wait for the holder's lease; a retry
            # of a key its holder recorded failed need not. Without the claim's previous state, the holder's own
            # journal says whether it was still exporting.
            if taker.get("previous_state") is not None:
                takeover = taker["previous_state"] == "in_progress"
            else:
                holder_end = ends.get(claim["attempt"])
                takeover = holder_end is None or holder_end["t"] > taker["after"]
            if takeover and taker["after"] < expiry - LEASE_MARGIN_SECONDS:
                taken += 1
                outcome = ends.get(taker["attempt"], {})
                exported_after += outcome.get("status") in ("exported", "repaired")
                found.add(
                    "live_lease_taken",
                    f"{key}: {taker['attempt']} ({taker['worker']}) took over token {token + 1} "
                    f"{expiry - taker['after']:.1f}s before the lease of {claim['attempt']} (token {token}) ran out "
                    f"by the host's clock, and then {outcome.get('status') or outcome.get('error_class') or 'stopped'}",
                )
    for key, by_token in claims.items():
        for token, claim in by_token.items():
            end = ends.get(claim["attempt"])
            if end is not None and end["event"] == "error" and end["error_class"] in FENCED_ERRORS:
                if end["t"] < claim["before"] + lease_seconds - LEASE_MARGIN_SECONDS:
                    fenced += 1
                    found.add(
                        "live_lease_taken",
                        f"{key}: {claim['attempt']} (token {token}) was fenced out "
                        f"{claim['before'] + lease_seconds - end['t']:.1f}s before its own lease ran out by the "
                        "host's clock",
                    )
    found.counts["live leases taken over by a worker"] = taken
    found.counts["... after which the taker exported or repaired the key"] = exported_after
    found.counts["attempts fenced out inside their own lease"] = fenced


def _check_settled(found: Findings, expected: dict, records: dict, escalated: dict) -> None:
    for key in sorted(expected):
        record = records.get(key)
        if record is None:
            found.add("unsettled", f"{key}: no ledger row (never claimed)")
        elif record["state"] not in ("completed", "conflict") and key not in escalated:
            found.add(
                "unsettled",
                f"{key}: {record['state']} (token {record['fencing_token']}, lease owner {record['lease_owner']})",
            )
