"""Drift detection: which completed keys no longer match their source. Plain Python, no Dagster.

One pass (:func:`drift_pass`) takes a page of completed keys within each export's lookback horizon, reads each key's
source again the way the export read it (one frame, or batches for ``stream_rows``), and fingerprints it
(:mod:`export_ledger.fingerprint`). A key whose fingerprint equals the one stored at completion is unchanged. Any
other key (a different fingerprint, or none stored: a key repaired from its manifest, or completed before schema
version 4) is compared with the export actually published, read back through its destination, ids matched:

* **added**: ids in the source and not in the export (late rows);
* **removed**: ids in the export and no longer in the source;
* **changed**: ids in both whose version column differs; None (unknown) when the export declares no version column.

A key with any of these is **stale**: it stays ``completed`` in the ledger and gets an open record in
``export_drift`` (counts only, never values); a key that matches again has its open record cleared. The remedy is a
restatement published as a new revision (:mod:`export_ledger.restate`): an export that declares ``restate_stale``
gets a request recorded for each key a pass newly finds stale (reason ``source changed: +A -R ~C rows``), which the
reconciliation sensor then launches. A key is compared with its current revision, whichever that is.

The sensor (:func:`export_ledger.dagster.sensors.build_drift_sensor`) and ``export-ledger drift`` both call
:func:`drift_pass`; only they know the sources, so the CLI loads the declared exports from a module (``--specs``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from export_ledger.calendar import load_zone
from export_ledger.destinations.base import (
    Destination,
    ExportTarget,
    Verdict,
    place_of_location,
)
from export_ledger.errors import safe_message
from export_ledger.fingerprint import Fingerprint, id_hashes, version_hashes
from export_ledger.frames import ExportSchema, FrameBatches, _to_arrow, read_table
from export_ledger.lazy import lazy_module
from export_ledger.ledger import DriftChanges, DriftFinding, DriftRecord, ExportLedger, ExportRecord
from export_ledger.placement import recorded_destinations
from export_ledger.restate import DRIFT_REQUESTER, RequestReport, current_revisions, restate_stale
from export_ledger.sources import readable
from export_ledger.spec import ExportSpec

np = lazy_module("numpy", globals(), "np")
pd = lazy_module("pandas", globals(), "pd")

#: Default lookback: completed keys of the last this many business dates (in each export's zone) are checked.
DEFAULT_LOOKBACK_DAYS = 7
#: Default keys re-read per pass (per sensor tick).
DEFAULT_DRIFT_BATCH = 50


@dataclass(frozen=True)
class DriftCounts:
    """How a key's current source differs from its published export, by ids: counts, never values."""

    added: int
    removed: int
    changed: int | None  # None: unknown, the export declares no version column

    @property
    def stale(self) -> bool:
        return bool(self.added or self.removed or self.changed)


@dataclass
class DriftReport:
    """What one pass found. ``unchecked`` are keys it could not check (source or destination failed), with why."""

    checked: int = 0
    stale: list[DriftFinding] = field(default_factory=list)
    matching: list[str] = field(default_factory=list)
    unchecked: list[tuple[str, str]] = field(default_factory=list)
    changes: DriftChanges = field(default_factory=lambda: DriftChanges([], []))
    next_after: str | None = None  # where the next pass continues; None: the sweep starts over
    #: Requests recorded for newly stale keys of exports with ``restate_stale`` (and those refused, with why).
    restatements: RequestReport = field(default_factory=RequestReport)


def horizon(spec: ExportSpec, now: dt.datetime, lookback_days: int) -> dt.date:
    """The first business date checked: ``lookback_days`` days before today in the export's zone (inclusive of
    today's date, so 7 covers today and the six days before)."""
    if lookback_days < 1:
        raise ValueError(f"lookback_days must be at least 1, got {lookback_days}")
    today = now.astimezone(load_zone(spec.timezone)).date()
    return today - dt.timedelta(days=lookback_days - 1)


def _normalized(frame: pd.DataFrame, schema: ExportSchema, what: str) -> pd.DataFrame:
    # The published file is read back through Arrow with the schema's types; the source goes through the same
    # conversion so that equal values hash equally on both sides.
    return _to_arrow(frame[list(schema.columns)], schema, what).to_pandas()


@dataclass
class _SourceRead:
    fingerprint: str
    ids: np.ndarray  # per row, of normalized values
    versions: np.ndarray | None


def _read_source(spec: ExportSpec, record: ExportRecord) -> _SourceRead:
    """The key's rows as the export read them: fingerprinted as at completion, hashed normalized for comparison."""
    schema = spec.schema
    start, end = record.window_start_utc, record.window_end_utc
    if spec.stream_rows is not None:
        frames = FrameBatches(
            spec.source.batches(record.tenant, start, end, schema=schema, batch_rows=spec.stream_rows)
        )
    else:
        rows = spec.read(record.tenant, start, end)
        frames = [rows] if isinstance(rows, pd.DataFrame) else rows  # what the export validated: one frame
    fingerprint = Fingerprint(schema.id_columns, schema.version_column)
    ids, versions = [], []
    for frame in frames:
        fingerprint.add(frame)
        normal = _normalized(frame, schema, record.logical_key)
        hashed = id_hashes(normal, schema.id_columns)
        ids.append(hashed)
        if schema.version_column is not None:
            versions.append(version_hashes(normal, hashed, schema.version_column))
    return _SourceRead(
        fingerprint.encode(),
        np.concatenate(ids) if ids else np.empty(0, dtype=np.uint64),
        (np.concatenate(versions) if versions else np.empty(0, dtype=np.uint64))
        if schema.version_column is not None
        else None,
    )


def compare(
    source_ids: np.ndarray,
    source_versions: np.ndarray | None,
    published_ids: np.ndarray,
    published_versions: np.ndarray | None,
) -> DriftCounts:
    """Counts of rows added, removed and changed, from per-row id hashes (and (id, version) hashes) of each side."""
    added = int(np.count_nonzero(~np.isin(source_ids, published_ids)))
    removed = int(np.count_nonzero(~np.isin(published_ids, source_ids)))
    if source_versions is None or published_versions is None:
        return DriftCounts(added, removed, None)
    # A row is changed when its id is on both sides and its (id, version) hash is not.
    kept = np.isin(source_ids, published_ids)
    changed = int(np.count_nonzero(kept & ~np.isin(source_versions, published_versions)))
    return DriftCounts(added, removed, changed)


def _published(
    spec: ExportSpec, destination: Destination, record: ExportRecord, revision: int = 1
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-row hashes of the export as published (its current ``revision``, read through the destination and
    checked against the ledger's sha256)."""
    target = ExportTarget.of_record(record, revision, place_of_location(record.location))
    seen = destination.verify_recorded(target, logical_key=record.logical_key, sha256=record.sha256)
    if seen.verdict is not Verdict.PUBLISHED:
        raise LookupError(f"{record.logical_key}: {seen.detail}")
    payload = destination.read_data(target, seen.manifest)
    if hashlib.sha256(payload).hexdigest() != record.sha256:  # read twice: it must not have changed between
        raise LookupError(f"{destination.location(target)} does not hold the export the ledger recorded (sha256)")
    schema = spec.schema
    file_format = destination.data_format(spec.file_format)
    frame = read_table(payload, file_format, schema)
    ids = id_hashes(frame, schema.id_columns)
    versions = version_hashes(frame, ids, schema.version_column) if schema.version_column is not None else None
    return ids, versions


def check_key(
    spec: ExportSpec,
    destination: Destination,
    record: ExportRecord,
    stored: str | None,
    revision: int | Callable[[], int] = 1,
) -> DriftFinding | None:
    """None when the key's source matches its export; else the finding with its counts.

    ``revision`` is the key's current revision (or a function giving it, called only when the published export must
    be read back): the one the ledger's sha256 is of.

    Raises:
        Exception: the source or the destination could not be read (the key is left as it was).
    """
    source = _read_source(spec, record)
    if stored is not None and source.fingerprint == stored:
        return None  # the cheap answer: the source is what was exported, nothing else is read
    published_ids, published_versions = _published(
        spec, destination, record, revision() if callable(revision) else revision
    )
    counts = compare(source.ids, source.versions, published_ids, published_versions)
    if not counts.stale:
        return None
    return DriftFinding(record, counts.added, counts.removed, counts.changed, source.fingerprint)


def drift_pass(
    ledger: ExportLedger,
    specs: Sequence[ExportSpec],
    destinations: Mapping[str, Destination],
    *,
    lookback_days: int = DEFAULT_LOOKBACK_DAYS,
    limit: int = DEFAULT_DRIFT_BATCH,
    after: str | None = None,
    now: dt.datetime | None = None,
    requested_by: str = DRIFT_REQUESTER,
) -> DriftReport:
    """Checks at most ``limit`` completed keys (after ``after``, in logical key order) and records what it finds.

    Only exports with a source are checked (an export fed by an asset of your own has no source to re-read).

    Args:
        ledger: The ledger (opened to write: findings are recorded).
        specs: The declared exports; their sources are re-read.
        destinations: Per export name, its destination (to read the published export back).
        lookback_days: Business dates checked per export, ending today in the export's zone.
        limit: Keys checked in this pass.
        after: The previous pass's ``next_after``.
        now: The current time (default the ledger's clock).
        requested_by: Who the restatements of ``restate_stale`` exports are recorded as asked by.

    Returns:
        The report, with ``next_after`` for the next pass.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    now = now or ledger.now()
    by_name = {spec.name: spec for spec in specs if readable(spec.source) and spec.name in destinations}
    since = {name: horizon(spec, now, lookback_days) for name, spec in by_name.items()}
    records = ledger.drift.completed_since(since, limit=limit, after=after)
    stored = ledger.drift.fingerprints([r.logical_key for r in records])
    report = DriftReport(next_after=records[-1].logical_key if len(records) == limit else None)
    # Each key's export is read where its contract says it is, not where the code would publish it now.
    places = recorded_destinations(ledger, records, known=destinations, fallback=destinations.__getitem__)
    for record in records:
        spec = by_name[record.export]
        try:
            finding = check_key(
                spec, places[record.logical_key], record, stored[record.logical_key],
                lambda key=record.logical_key: current_revisions(ledger, [key])[key],
            )  # fmt: skip
        except Exception as exc:  # one key's unreadable source or export never stops the others
            report.unchecked.append((record.logical_key, safe_message(exc)))
            continue
        report.checked += 1
        if finding is None:
            report.matching.append(record.logical_key)
        else:
            report.stale.append(finding)
    report.changes = ledger.drift.record(report.stale, report.matching)
    automatic = {name for name, spec in by_name.items() if spec.restate_stale}
    newly = set(report.changes.opened)
    # Only keys this pass newly found stale (or stale differently): a request withdrawn by an operator is not asked
    # for again while the drift stays the same.
    wanted = (
        [r for r in ledger.drift.open_records(logical_keys=sorted(newly)) if r.export in automatic] if newly else []
    )
    report.restatements = restate_stale(ledger, wanted, requested_by=requested_by)
    return report


@dataclass(frozen=True)
class LookbackGap:
    """Completed keys older than a pass's lookback (never checked by it), and the lookback that would reach them."""

    keys: int
    oldest: dt.date | None
    lookback_days_needed: int | None


def beyond_lookback(
    ledger: ExportLedger, specs: Sequence[ExportSpec], *, lookback_days: int, now: dt.datetime | None = None
) -> LookbackGap:
    """The completed keys of ``specs`` (those with a source) that :func:`drift_pass` with ``lookback_days`` skips."""
    now = now or ledger.now()
    checked = [spec for spec in specs if readable(spec.source)]
    count, oldest = ledger.drift.completed_before({spec.name: horizon(spec, now, lookback_days) for spec in checked})
    if oldest is None:
        return LookbackGap(count, None, None)
    # The lookback whose horizon reaches the oldest key in every export's zone (today's date differs by zone).
    needed = max((horizon(spec, now, 1) - oldest).days + 1 for spec in checked)
    return LookbackGap(count, oldest, needed)


def stale_digest(summary: Mapping[str, tuple[int, int]]) -> str:
    """A short digest of the open drift records, from the ledger's count and newest record id per export: records are
    never rewritten (a change closes one and opens another), so it changes exactly when the stale set does."""
    text = "\n".join(f"{export}:{count}:{newest}" for export, (count, newest) in sorted(summary.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(record: DriftRecord) -> str:
    """``+added -removed ~changed`` (``~?`` when changes are unknown)."""
    return record.changes


__all__ = [
    "DEFAULT_DRIFT_BATCH",
    "DEFAULT_LOOKBACK_DAYS",
    "DriftCounts",
    "DriftReport",
    "LookbackGap",
    "beyond_lookback",
    "check_key",
    "compare",
    "describe",
    "drift_pass",
    "horizon",
    "stale_digest",
]
