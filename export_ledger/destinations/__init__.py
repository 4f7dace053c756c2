"""Destinations of two kinds: publishing ones (:class:`PointerDestination`: a local folder, S3, GCS, Azure and SFTP, one
template over an object store's hooks, :class:`PublishingDestination`; and a Delta table), and a transactional one (a
table of the ledger's own database, :class:`TransactionalDestination`); built from a spec string by
:func:`destination_from` through the schemes each destination module declares
(:mod:`export_ledger.destinations.registry`)."""

from __future__ import annotations

from export_ledger.destinations.base import (
    Destination,
    DestinationConflict,
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    Fenced,
    PointerMoved,
    PublishOutcomeUnknown,
    TransactionalDestination,
    Verdict,
    Verification,
    judge,
    place_name,
    place_of_location,
)
from export_ledger.destinations.local import LocalDestination
from export_ledger.destinations.pointer import Pointer, PointerDestination, StagedExport
from export_ledger.destinations.publishing import POINTER_NAME, PublishingDestination
from export_ledger.destinations.registry import destination_from, kinds, schemes

__all__ = [
    "POINTER_NAME",
    "Destination",
    "DestinationConflict",
    "DestinationError",
    "DestinationUnreachable",
    "ExportTarget",
    "Fenced",
    "LocalDestination",
    "Pointer",
    "PointerDestination",
    "PointerMoved",
    "PublishOutcomeUnknown",
    "PublishingDestination",
    "StagedExport",
    "TransactionalDestination",
    "Verdict",
    "Verification",
    "destination_from",
    "judge",
    "kinds",
    "place_name",
    "place_of_location",
    "schemes",
]
