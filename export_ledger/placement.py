"""Where a key's export is: the destination its contract records, never the one the caller's environment names.

Plain Python. Every edge that acts on a key's published export (reconciliation, an operator's resolution, a withdrawn
restatement) asks :func:`recorded_destinations`: a run worker, an operator's shell or a later deploy may name another
folder or bucket, and acting there would fence the wrong place and judge a published export absent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from export_ledger.contract import destination_of
from export_ledger.destinations import Destination, destination_from
from export_ledger.errors import ExportLedgerError
from export_ledger.ledger import ExportLedger, ExportRecord


class DestinationMismatch(ExportLedgerError):
    """``--destination`` names another place than the one a key's contract records (the command acts on neither)."""


def recorded_destinations(
    ledger: ExportLedger,
    records: Sequence[ExportRecord],
    *,
    environ: Mapping[str, str] | None = None,
    known: Mapping[str, Destination] | Destination | None = None,
    given: Destination | None = None,
    fallback: Callable[[str], Destination] | None = None,
) -> dict[str, Destination]:
    """Where each key's export is: the destination its contract records (the contract it was last claimed under), by
    logical key, never whatever the caller's environment names.

    Args:
        ledger: The ledger.
        records: The keys.
        environ: The environment a destination built from a recorded root reads its settings from (credentials
            never are recorded), by the variables its scheme declares; a known destination's own settings win.
        known: Destinations at hand, by export (a code location's), or one for every export: used where they are the
            recorded one, and their settings lend credentials to a recorded root of the same kind.
        given: A destination an operator named (``--destination``): refused unless it is the recorded one.
        fallback: For a key whose ledger records no destination (claimed before schema version 9 under a contract of
            an older release): the destination to use, by export (it decides whether ``given`` answers). None:
            ``given`` answers for such a key, else it is refused.

    Raises:
        DestinationMismatch: ``given`` is not where a key's contract says its export is (both named).
        ExportLedgerError: a key has no recorded destination and there is no fallback.
    """
    contracts = ledger.contracts.of_keys(records)
    chosen: dict[str, Destination] = {}
    built: dict[str, Destination] = {}
    for record in records:
        place = destination_of(contracts.get(record.logical_key))
        if place is None:
            if fallback is not None:
                chosen[record.logical_key] = fallback(record.export)
            elif given is not None:
                chosen[record.logical_key] = given
            else:
                raise ExportLedgerError(
                    f"{record.logical_key}: the ledger records no destination for it (claimed before release 0.6): "
                    "name it with --destination"
                )
            continue
        if given is not None and given.identity(record.export) != place:
            raise DestinationMismatch(
                f"--destination is {_place(given.identity(record.export))}, but {record.logical_key} was claimed under "
                f"a contract that publishes to {_place(place)}: the command acts where the ledger says the export is. "
                "Leave --destination out"
            )
        own = known if isinstance(known, Destination) else (known or {}).get(record.export)
        if given is not None:
            chosen[record.logical_key] = given
        elif own is not None and own.identity(record.export) == place:
            chosen[record.logical_key] = own
        else:
            key = repr(sorted(place.items()))
            if key not in built:
                lent = {}
                mine: Mapping = {}
                if own is not None and own.kind == place["kind"] and hasattr(own, "spec"):
                    lent.update({k: v for k, v in own.spec()[1].items() if v is not None})
                    mine = own.identity(record.export)
                # The store the contract records (its endpoint, its account), whatever the environment names: only
                # credentials come from here. A setting that names the recorded store already is kept as it is (a
                # warehouse URL carries its password, which the recorded locator leaves out).
                lent.update({k: v for k, v in place.items() if k not in ("kind", "root") and mine.get(k) != v})
                built[key] = destination_from(
                    place["root"], ledger_url=ledger.url, settings=lent, environ=environ,
                    what=f"the destination {record.export}'s contract records",
                )  # fmt: skip
            chosen[record.logical_key] = built[key]
    return chosen


def _place(identity: Mapping) -> str:
    return f"{identity.get('kind')} {identity.get('root')}"
