"""Restatements from the outside: recording requests for a key or a business date, and reading which revision of a
key is current. Plain Python, no Dagster; ``export-ledger restate``, the export asset's run config, the drift sensor
and the reconciliation sensor call these (the ledger's side is :mod:`export_ledger.ledger.revisions`).

A request is recorded first and changes nothing published: the partition's next materialization (launched from the
UI, by the command :func:`materialize_command` prints, or by the reconciliation sensor) publishes revision N + 1 beside
revision N and moves the key's current pointer.

Example:
    >>> done = request_for_date(ledger, "orders", dt.date(2026, 3, 2), reason="late invoices", requested_by="ops")
    ... # doctest: +SKIP
"""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from export_ledger.destinations.base import Destination, ExportTarget, Verdict, place_of_location
from export_ledger.errors import safe_message
from export_ledger.ledger import (
    CompletionEvidence,
    DriftRecord,
    ExportLedger,
    ExportRecord,
    ExportState,
    FencedOut,
    Finish,
    Restatement,
    RestatementRefused,
)
from export_ledger.ledger import transitions as T
from export_ledger.ledger.errors import OperatorResolution
from export_ledger.ledger.operators import append_in
from export_ledger.tenants import zone_slug

#: Who records the requests of ``restate_stale`` exports.
DRIFT_REQUESTER = "drift-sensor"


@dataclass
class RequestReport:
    """What one ``restate`` of several keys did: the requests recorded, and each key refused with the ledger's why."""

    requested: list[Restatement] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def request_for_date(
    ledger: ExportLedger,
    export: str,
    business_date: dt.date,
    *,
    reason: str,
    requested_by: str,
    tenants: Sequence[str] = (),
) -> RequestReport:
    """Records a request for every completed key of ``export`` on ``business_date`` (only ``tenants``' when given).

    A key that is not completed, or already has an open request, is refused with the ledger's message; the others
    are still requested (each request is its own transaction).

    Raises:
        RestatementRefused: no reason, or no key of the export on that date at all (nothing to restate).
    """
    if not (reason or "").strip():
        raise RestatementRefused(f'a restatement of {export} on {business_date} needs a reason (--reason "...")')
    records = ledger.queries.records(export=export, date_from=business_date, date_to=business_date, tenants=tenants)
    if not records:
        whose = f" for tenant(s) {', '.join(tenants)}" if tenants else ""
        raise RestatementRefused(f"the ledger has no key of {export} on {business_date}{whose}: nothing to restate")
    return request_each(ledger, [(record.logical_key, reason) for record in records], requested_by=requested_by)


def request_each(ledger: ExportLedger, wanted: Sequence[tuple[str, str]], *, requested_by: str) -> RequestReport:
    """Records a request for each ``(logical key, reason)``, each in its own transaction: a key the ledger refuses
    (not completed, a request already open) is reported with the ledger's why, and the others are still requested."""
    report = RequestReport()
    for logical_key, reason in wanted:
        try:
            report.requested.append(ledger.restatements.request(logical_key, reason=reason, requested_by=requested_by))
        except RestatementRefused as exc:
            report.refused.append((logical_key, str(exc)))
    return report


def published_revisions(
    ledger: ExportLedger, logical_keys: Sequence[str] = (), *, export: str | None = None
) -> dict[str, Restatement]:
    """Per key (of ``logical_keys``, or every key of ``export``), the request whose revision is the key's newest
    published one; keys never restated are absent.

    One read of the requests table (never of every key): a published request's revision row was written in the
    transaction that closed it, so the newest published request names the key's newest revision.
    """
    newest: dict[str, Restatement] = {}
    for request in ledger.restatements.requests(export=export, logical_keys=logical_keys, open_only=False):
        known = newest.get(request.logical_key)
        if request.outcome == "published" and (known is None or request.revision > known.revision):
            newest[request.logical_key] = request
    return newest


def current_revisions(ledger: ExportLedger, logical_keys: Sequence[str]) -> dict[str, int]:
    """Each key's newest recorded revision (1 for a key never restated), in one read."""
    if not logical_keys:
        return {}
    published = published_revisions(ledger, logical_keys)
    return {key: published[key].revision if key in published else 1 for key in logical_keys}


def records_of(ledger: ExportLedger, requests: Sequence[Restatement]) -> dict[str, ExportRecord]:
    """The ledger records of the requests' keys, by key: one read per export and business date, not one per key."""
    by_day: dict[tuple[str, dt.date], set[str]] = {}
    for request in requests:
        by_day.setdefault((request.export, request.business_date), set()).add(request.tenant)
    found: dict[str, ExportRecord] = {}
    for (export, day), tenants in sorted(by_day.items()):
        for record in ledger.queries.records(export=export, date_from=day, date_to=day, tenants=sorted(tenants)):
            found[record.logical_key] = record
    return found


def stale_reason(record: DriftRecord) -> str:
    """The reason recorded for an automatic restatement: ``source changed: +A -R ~C rows`` (``~?``: unknown)."""
    return f"source changed: {record.changes} rows"


def restate_stale(
    ledger: ExportLedger, stale: Sequence[DriftRecord], *, requested_by: str = DRIFT_REQUESTER
) -> RequestReport:
    """Records a request, with :func:`stale_reason`, for each of ``stale`` (keys drift just found stale, of exports
    that declare ``restate_stale``). A key that already has an open request, or is no longer completed, is left as
    it is and reported refused: the request under way, or the operator's decision, stands."""
    return request_each(
        ledger, [(record.logical_key, stale_reason(record)) for record in stale], requested_by=requested_by
    )


def asset_name_for(ledger: ExportLedger, record: ExportRecord) -> tuple[str, bool]:
    """The Dagster asset that exports ``record``'s key, as far as the ledger can tell, and whether it is certain.

    The attempt that completed the key names it: an attempt id is ``<run id>/<step key>``, and an export asset's step
    is the asset (:func:`export_ledger.keys.attempt_id`). Without that (an attempt id of another form), tenants in the
    export's own zone are the asset named like the export and tenants elsewhere ``<export>__<zone slug>``
    (:func:`export_ledger.tenants.tenant_groups`); the ledger does not record which zone is the export's own, so the
    zone most tenants' calendar contracts name is taken for it (a guess, said so) unless they all name one.
    """
    _, sep, step = (record.committed_attempt or "").partition("/")
    if sep and step and "/" not in step and (step == record.export or step.startswith(f"{record.export}__")):
        return step, True
    return asset_name_of_zone(ledger, record.export, record.timezone)


def asset_name_of_zone(ledger: ExportLedger, export: str, zone: str) -> tuple[str, bool]:
    """The asset of ``export``'s partitions in ``zone``, and whether it is certain: the asset that exported a key of
    that zone (its committed attempt names the step: one row read), else a guess from the zones its contracts name
    (see :func:`asset_name_for`)."""
    step = ledger.queries.committed_step_of_zone(export, zone)
    if step is not None:
        return step, True
    zones = [contract.get("timezone") for contract in ledger.contracts.tenant_contracts(export).values()]
    wide = ledger.contracts.recorded(export)
    if wide is not None and wide.get("timezone") == zone:
        return export, True
    if wide is not None:
        zones.append(wide.get("timezone"))
    counts = {z: zones.count(z) for z in set(zones) if z is not None}
    if not counts:  # no contract names a zone (a ledger of tests, or written before contracts): a guess
        return export, False
    if set(counts) <= {zone}:
        return export, True
    most = max(counts.values())
    own = counts.get(zone) == most and list(counts.values()).count(most) == 1
    return (export if own else f"{export}__{zone_slug(zone)}"), False


#: The code location :func:`materialize_command` names when it is not told one (this repository's layout).
DEFAULT_LOCATION = ("-f", "definitions.py")


def materialize_command(
    asset: str, partition: str, location: Sequence[str] = DEFAULT_LOCATION, *, program: str = "dagster"
) -> str:
    """The command that materializes one partition of an export's asset in process (what the CLI prints), in the
    code location named by ``location``: Dagster's own options, e.g. ``("-m", "shop.defs")`` or
    ``("-f", "shop.py", "-a", "defs")``, repeated exactly (quoted for the shell). ``program``: the ``dagster`` to run
    (the CLI names the one of its own virtualenv, :func:`export_ledger.operations.dagster_program`)."""
    return shlex.join([program, "asset", "materialize", *location, "--select", asset, "--partition", partition])


def restating(record: ExportRecord, request: Restatement | None) -> bool:
    """A completed key with an open request: its next claim restates it, so the export asset must read it."""
    return request is not None and record.state is ExportState.COMPLETED


def withdraw(ledger: ExportLedger, destination: Destination, logical_key: str, *, operator: str, reason: str
             ) -> ExportRecord:  # fmt: skip
    """Withdraws a key's open restatement: the way out of a restatement that cannot succeed (or was asked by mistake).

    A ``completed`` key whose request was never claimed: the request is closed. A ``failed`` one: the operator holds
    the key, fences the destination, and the key is completed again at its recorded revision **only if the
    destination's pointer still names that revision**; a pointer naming the withdrawn revision (published and never
    recorded) is refused, with the resolutions to run, and the key goes back to ``failed``. The withdrawn revision's
    number is never given to a later request. Recorded in ``export_operator_log``.

    Raises:
        RestatementRefused: no reason or no open request; the key is held or its outcome unknown (reconciliation
            decides first); the pointer names the withdrawn revision.
    """
    if not (reason or "").strip():
        raise RestatementRefused(f"withdrawing the restatement of {logical_key} needs a reason")
    record = ledger.queries.get(logical_key)
    request = ledger.restatements.open_requests([logical_key]).get(logical_key)
    if record is None or request is None:
        raise RestatementRefused(f"{logical_key} has no open restatement to withdraw")
    if record.state is ExportState.COMPLETED:
        return ledger.restatements.withdraw_unclaimed(logical_key, operator=operator, reason=reason)
    if record.state is not ExportState.FAILED:
        raise RestatementRefused(
            f"{logical_key} is {record.state.value}: its restatement is under way; withdraw it once it has failed "
            "(reconciliation decides an unknown outcome first)"
        )
    claim = ledger.claims.hold(logical_key, operator)
    current = ledger.restatements.current_revision(logical_key)
    target = ExportTarget.of_record(record, claim.revision)
    try:
        seen = destination.open(
            target, claim.fencing_token, logical_key=logical_key, superseded=claim.superseded_revision
        ).verification
        if seen.verdict is not Verdict.ABSENT:
            raise RestatementRefused(
                f"{logical_key}: {seen.detail}; the withdrawn revision {request.revision} may be what readers see. "
                f"Record it (export-ledger resolve {logical_key} --accept-destination --reason ...) or remove it "
                f"(--discard-destination) first"
            )
        evidence = CompletionEvidence(
            current.location, current.sha256, current.row_count, current.published_by, claim.fencing_token,
            revision=current.revision,
        )  # fmt: skip
        note = (OperatorResolution.__name__, f"{operator} withdrew revision {request.revision}: {reason.strip()}")
        return ledger.completions.finish(
            Finish(claim, T.WITHDRAW, evidence, note=note),
            then=lambda conn, now, item: ledger.restatements.withdraw_in(conn, logical_key, now, operator, reason),
        )
    except Exception as exc:
        refused = exc if isinstance(exc, RestatementRefused) else RestatementRefused(
            f"withdrawing {logical_key} failed: {safe_message(exc)}"
        )  # fmt: skip
        back = claim.previous_state.value if claim.previous_state is not ExportState.IN_PROGRESS else "remote_unknown"
        try:
            ledger.completions.release(
                claim, (OperatorResolution.__name__, f"{operator}: {refused}; the key is back to {back}"),
                then=lambda conn, now, item: append_in(
                    conn, now, operator, "withdraw-refused", str(refused), reason, export=record.export,
                    logical_key=logical_key,
                ),
            )  # fmt: skip
        except FencedOut as lost:
            raise RestatementRefused(f"{refused}; meanwhile another party took the key: {lost}") from None
        raise refused from None


__all__ = [
    "DEFAULT_LOCATION",
    "DRIFT_REQUESTER",
    "RequestReport",
    "asset_name_for",
    "current_revisions",
    "materialize_command",
    "place_of_location",
    "published_revisions",
    "records_of",
    "request_each",
    "request_for_date",
    "restate_stale",
    "restating",
    "stale_reason",
    "withdraw",
]
