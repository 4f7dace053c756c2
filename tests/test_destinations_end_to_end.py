"""Every destination end to end from the reference code location, against its own server: a partition, a three-day
backfill, a restatement (revision 2 beside revision 1), and an attempt that died after publishing, settled by the
reconciliation sensor from the destination's evidence. The same steps, the same assertions, for each kind."""

from __future__ import annotations

import dagster as dg
import pytest
from builders import key_for
from object_buckets import delta_destination, object_destination
from pipeline_helpers import check_evaluations, failure_message, make_defs, run_partition, run_range, tick
from warehouse_fixtures import warehouse_destination

from export_ledger.calendar import parse_business_date
from export_ledger.destinations import Verdict
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.ledger import AttemptOutcome, ExportState
from export_ledger.protocol import target_for
from resources.invoices import SampleInvoiceSource

FIRST, BACKFILL, CRASHED = "2026-03-08", ("2026-03-09", "2026-03-11"), "2026-03-12"


class CorrectedInvoices(SampleInvoiceSource):
    """The sample invoices; once ``corrected``, each window's last invoice is gone (voided at the source), so a
    restatement has new rows to publish."""

    corrected: bool = False

    def rows(self, tenant, start_utc, end_utc):
        rows = super().rows(tenant, start_utc, end_utc)
        return rows.iloc[:-1] if self.corrected else rows

    def count(self, tenant, start_utc, end_utc):
        return super().count(tenant, start_utc, end_utc) - (1 if self.corrected else 0)


def _destination(kind: str, request, tmp_path):
    """The destination object of one kind, on a server of its own where it has one."""
    if kind == "local":
        return str(tmp_path / "exports")
    if kind in ("delta", "delta-s3"):
        return delta_destination(request, tmp_path, on_s3=kind == "delta-s3")
    if kind.startswith("warehouse-"):
        return warehouse_destination(kind.removeprefix("warehouse-"), request, tmp_path)
    return object_destination(kind, request, prefix="e2e")


# Delta on moto's S3 takes about 12 s (its log listing is slow there): in the slow tier with the crash harness.
KINDS = [
    "local", "s3", "gcs", "azure", "sftp", "delta", pytest.param("delta-s3", marks=pytest.mark.slow),
    "warehouse-postgres", "warehouse-mariadb", "warehouse-duckdb",
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_partition_a_backfill_a_restatement_and_a_crash_after_publish_on_each_destination(
    kind, request, tmp_path, instance, monkeypatch, clocked_ledger, clock
):
    destination = _destination(kind, request, tmp_path)
    if kind.startswith("warehouse-"):
        # A secret: Dagster gets it by name (EnvVar), from the code location's environment.
        monkeypatch.setenv("EXPORTS_WAREHOUSE_URL", destination.warehouse_url)
    source = CorrectedInvoices()
    defs = make_defs(
        tmp_path, tenants=["acme", "globex"], ledger=clocked_ledger, destination=destination, source=source
    )
    ledger = clocked_ledger.get_ledger()
    with dg.build_resources({"destination": defs.resources["invoice_export__destination"]}) as built:
        target_destination = built.destination.get_destination()  # its EnvVars read, as a run reads them

    first = run_partition(defs, instance, FIRST)
    assert first.success, failure_message(first)
    health = check_evaluations(first, "partition_health")[FIRST]
    assert health.passed and health.metadata["verified_at_destination"].value > 0, "what landed is the ledger's"

    backfill = run_range(defs, instance, *BACKFILL)
    assert backfill.success, failure_message(backfill)
    health = check_evaluations(backfill, "partition_health")
    assert sorted(health) == ["2026-03-09", "2026-03-10", "2026-03-11"] and all(v.passed for v in health.values())
    assert len(ledger.queries.records(states=[ExportState.COMPLETED])) == 2 + 3 * 2

    acme = str(key_for(parse_business_date(FIRST)))
    object.__setattr__(source, "corrected", True)
    ledger.restatements.request(acme, reason="an invoice was voided", requested_by="ops")
    restated = run_partition(defs, instance, FIRST)
    assert restated.success, failure_message(restated)
    revisions = ledger.restatements.revisions(acme)
    assert [r.revision for r in revisions] == [1, 2] and revisions[1].row_count == revisions[0].row_count - 1
    old = target_destination.verify_recorded(
        target_for(key_for(parse_business_date(FIRST)), 1, _place(revisions[0].location)),
        logical_key=acme, sha256=revisions[0].sha256,
    )  # fmt: skip
    if kind.startswith("warehouse-"):
        # A warehouse restatement replaces the key's rows; revision 1's marker is kept, its rows are not.
        assert old.verdict is Verdict.CONFLICT and "superseded" in old.detail, old.detail
    else:
        assert old.verdict is Verdict.PUBLISHED, f"revision 1 stays readable beside revision 2: {old.detail}"
    record = ledger.queries.get(acme)
    current = ledger.restatements.current_revision(acme)
    seen = target_destination.verify_recorded(
        target_for(key_for(parse_business_date(FIRST)), current.revision, _place(current.location)),
        logical_key=acme, sha256=current.sha256,
    )  # fmt: skip
    assert seen.verdict is Verdict.PUBLISHED and record.state is ExportState.COMPLETED, seen.detail

    monkeypatch.setenv(FAILPOINTS, "before_commit=raise")  # published at the destination, never recorded
    assert not run_partition(defs, instance, CRASHED).success
    monkeypatch.delenv(FAILPOINTS)
    crashed = str(key_for(parse_business_date(CRASHED)))
    assert ledger.queries.get(crashed).state is ExportState.IN_PROGRESS
    clock.advance(seconds=clocked_ledger.lease_ttl_seconds + 1)
    settled = tick(defs, instance)
    assert ledger.queries.get(crashed).state is ExportState.COMPLETED, settled.skip_message
    assert [a.outcome for a in ledger.queries.attempts(crashed)][-1] is AttemptOutcome.REPAIRED
    assert CRASHED in [e.partition for e in settled.materializations], "recorded in Dagster by reconciliation"


def _place(location: str | None):
    from export_ledger.destinations import place_of_location

    return place_of_location(location)
