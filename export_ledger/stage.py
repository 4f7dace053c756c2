"""What a claimed key's rows become at its destination before anything is visible: read (after the claim), validated
against the schema and the window the ledger recorded, staged at the attempt's own place, and, for a restatement,
compared with the revision it would supersede. The protocol (:mod:`export_ledger.protocol`) calls these; none of
them records anything in the ledger or changes what readers see.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
from collections.abc import Callable
from dataclasses import dataclass

from export_ledger.destinations.base import DestinationError, ExportTarget, Verdict, place_of_location
from export_ledger.destinations.pointer import Pointer, PointerDestination, StagedExport, pointer_otherwise
from export_ledger.errors import safe_message
from export_ledger.fingerprint import Fingerprint
from export_ledger.frames import (
    ExportSchema,
    FrameBatches,
    Manifest,
    TableStream,
    data_file_name,
    validate_batches,
    validate_frame,
    validate_frame_in_two_steps,
)
from export_ledger.keys import LogicalKey
from export_ledger.lazy import lazy_module
from export_ledger.ledger import Claim, CompletionEvidence, ExportLedger, LedgerError

pd = lazy_module("pandas", globals(), "pd")
pa = lazy_module("pyarrow", globals(), "pa")

#: A whole frame of at least this many rows is written while its ids are hashed and checked (on a second thread:
#: pyarrow's writers release the GIL); a smaller one is checked first, as a thread would cost more than it saves.
OVERLAP_ROWS = 50_000


@dataclass(frozen=True)
class Stager:
    """How one run's keys are staged: the export's schema, the file format, and where warnings go."""

    schema: ExportSchema
    file_format: str
    log: Callable[[str, str], None]

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.schema.id_columns, self.schema.version_column)

    def validated(self, claim: Claim, rows, key: LogicalKey, fingerprint: Fingerprint) -> pa.Table | TableStream:
        """The key's rows, read now if they are read lazily, checked against the schema and the claim's window: a
        whole table for a DataFrame, a stream of validated tables (checked while they are written) for batches.
        ``fingerprint`` accumulates the rows' source fingerprint (complete once a stream has been written)."""
        return self._checked(read_rows(claim, rows), claim, key, fingerprint)

    def validated_in_two_steps(
        self, claim: Claim, rows, key: LogicalKey, fingerprint: Fingerprint
    ) -> tuple[pa.Table | TableStream, Callable[[], pa.Table] | None]:
        """:meth:`validated`, for a whole frame of at least :data:`OVERLAP_ROWS` rows in two steps
        (:func:`~export_ledger.frames.validate_frame_in_two_steps`): its table checked for everything but the ids,
        and the step that checks the ids, for :meth:`stage` to run while the file is written. Otherwise the rows
        validated whole, and None."""
        rows = read_rows(claim, rows)
        if isinstance(rows, pd.DataFrame) and len(rows) >= OVERLAP_ROWS:
            checks = dict(what=claim.logical_key, tenant=key.tenant, fingerprint=fingerprint)
            return validate_frame_in_two_steps(rows, self.schema, claim.window, **checks)
        return self._checked(rows, claim, key, fingerprint), None

    def stage(
        self, destination: PointerDestination, target: ExportTarget, token: int, table: pa.Table | TableStream,
        finish: Callable[[], pa.Table] | None, template: Manifest,
    ) -> StagedExport:  # fmt: skip
        """Stages ``table``; with ``finish`` (the ids' check), writes it on a second thread while ``finish`` runs on
        this one (pyarrow's writers and hashing release the GIL). A refusal by ``finish`` removes what was staged
        and is raised: the place is this attempt's own and no pointer names it, so nothing of it was ever visible."""
        if finish is None:
            return destination.stage(target, token, table, self.file_format, template)
        context = contextvars.copy_context()  # the group's deferred durability (a context variable) goes along
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-ledger-stage") as pool:
            writing = pool.submit(context.run, destination.stage, target, token, table, self.file_format, template)
            try:
                final = finish()
            except BaseException:
                try:
                    self.unstage(destination, writing.result())
                except Exception:  # noqa: BLE001 - its write failed too: the refusal is the key's outcome
                    pass
                raise
            staged = writing.result()
        if final is not table and not final.equals(table):
            # Decided on the values after a hash collision, as pandas orders them: the file is written again.
            self.unstage(destination, staged)
            staged = destination.stage(target, token, final, self.file_format, template)
        return staged

    def unstage(self, destination: PointerDestination, staged: StagedExport) -> None:
        """Removes the place of a revision that will not be committed. A failure changes nothing readers see (no
        pointer names the place, and none can: only this attempt could commit it), so it is logged, and the key's
        next claim sweeps the place."""
        try:
            destination.unstage(staged)
        except DestinationError as exc:
            self.log(
                "warning",
                f"{staged.manifest.logical_key}: could not remove the unpublished place "
                f"{destination.location(staged.target)} ({safe_message(exc)}); readers never see it, and the key's "
                "next claim sweeps it",
            )

    def manifest_template(self, claim: Claim, key: LogicalKey) -> Manifest:
        return Manifest.build(
            logical_key=claim.logical_key,
            export=key.export,
            tenant=key.tenant,
            window=claim.window,
            row_count=0,
            sha256="",
            attempt_id=claim.attempt_id,
            fencing_token=claim.fencing_token,
            data_file=data_file_name(self.file_format),
            tz_database=claim.tz_database,
            revision=claim.revision,
            supersedes=claim.supersedes,
        )

    def unchanged(
        self, ledger: ExportLedger, destination: PointerDestination, claim: Claim, staged: StagedExport,
        fingerprint: Fingerprint, pointer: Pointer,
    ) -> CompletionEvidence | None:  # fmt: skip
        """For a restatement whose staged data is the revision it supersedes, byte for byte (the same sha256 and row
        count), and that revision what readers see, intact: the evidence of that revision, to record again instead
        of publishing a copy of it. None otherwise: a revision whose data was lost or changed at the destination, or
        that the pointer (``pointer``, read after this attempt's fence) no longer names as recorded, is restated by
        publishing the next one (the way out of ``partition_health``'s ``differs``). A destination that cannot say
        leaves the revision as it is (as before the check), with a warning.

        Decided where the commit would be: under the key's lease, after this attempt's fence was raised and the
        pointer read back naming that revision, so no earlier party can still move it, and nothing was committed.
        """
        if claim.supersedes is None:
            return None
        revision, sha256 = claim.supersedes
        if staged.manifest.sha256 != sha256:
            return None
        current = ledger.restatements.current_revision(claim.logical_key)
        if current is None or current.revision != revision or current.row_count != staged.manifest.row_count:
            return None
        recorded = staged.target.at_revision(revision, place_of_location(current.location))
        if (otherwise := pointer_otherwise(pointer, recorded, current.sha256)) is not None:
            self.log("warning", f"{claim.logical_key}: {otherwise}; revision {claim.revision} is published")
            return None
        try:
            intact = destination.verify_recorded(recorded, logical_key=claim.logical_key, sha256=current.sha256)
        except DestinationError as exc:
            self.log("warning", f"{claim.logical_key}: revision {revision} could not be read back to check it is "
                                f"intact ({safe_message(exc)}); it stays current unchanged")  # fmt: skip
            intact = None
        if intact is not None and intact.verdict is not Verdict.PUBLISHED:
            self.log("warning", f"{claim.logical_key}: revision {revision} is not intact at the destination "
                                f"({intact.detail}); revision {claim.revision} is published")  # fmt: skip
            return None
        return CompletionEvidence(
            current.location, current.sha256, current.row_count, current.published_by, claim.fencing_token,
            source_fingerprint=fingerprint.encode(), revision=revision, unchanged=True,
        )  # fmt: skip

    def _checked(self, rows, claim: Claim, key: LogicalKey, fingerprint: Fingerprint) -> pa.Table | TableStream:
        checks = dict(what=claim.logical_key, tenant=key.tenant, fingerprint=fingerprint)
        if isinstance(rows, FrameBatches):
            return validate_batches(rows, self.schema, claim.window, **checks)
        return validate_frame(rows, self.schema, claim.window, **checks)


def read_rows(claim: Claim, rows):
    """A key's rows, read now if they are read lazily (after the claim: a source's failure is this key's)."""
    if rows is None:
        raise LedgerError(
            f"{claim.logical_key} was completed when the asset planned this run but is claimable now; "
            "rerun to read its source"
        )
    if callable(rows) and not isinstance(rows, (pd.DataFrame, FrameBatches)):
        rows = rows()
    return rows
