"""A run or a backfill of some tenants (issue 27, item 3): the run tag ``export-ledger/tenants`` (what the UI's
Materialize dialog sets for every run of a backfill) or the run config's ``tenants`` (what ``dagster asset materialize
--config-json`` passes) scope a run to those tenants of the asset. Nothing else is read or claimed; each date's
``partition_health`` still judges every tenant of the date, so a date exported for one tenant shows the others
missing; a bad scope is refused before anything is exported, naming the problem."""

from __future__ import annotations

from collections import Counter

import dagster as dg
import pytest
from builders import open_ledger
from pipeline_helpers import JOB, failure_message, make_defs, tick

from export_ledger import Tenant
from export_ledger.calendar import ZoneMove
from export_ledger.dagster import TENANTS_TAG
from export_ledger.errors import ConfigurationError, SourceError
from export_ledger.tenants import run_tenants, tenant_groups
from resources.invoices import SampleInvoiceSource

ASSET = dg.AssetKey("invoice_export")
TENANTS = ("acme", "globex", "initech")
FIRST, BAD, LAST = "2026-03-02", "2026-03-03", "2026-03-04"
RANGE = {"dagster/asset_partition_range_start": FIRST, "dagster/asset_partition_range_end": LAST}


class CountedSource(SampleInvoiceSource):
    """The sample invoices, counting each tenant's reads; ``failing``'s read (globex's) fails on ``fails_on``."""

    def __init__(self, fails_on: str | None = None) -> None:
        super().__init__()
        self.fails_on = fails_on
        self.failing = "globex"
        self.reads: Counter[str] = Counter()

    def rows(self, tenant, start_utc, end_utc):
        self.reads[tenant] += 1
        if tenant == self.failing and start_utc.date().isoformat() == self.fails_on:
            raise SourceError("the source refused the query")
        return super().rows(tenant, start_utc, end_utc)


def _run(defs: dg.Definitions, instance, *, tags=None, config=None) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def(JOB).execute_in_process(
        instance=instance, raise_on_error=False, tags={**RANGE, **(tags or {})}, run_config=config
    )


def _config(**fields) -> dict:
    return {"ops": {"invoice_export": {"config": fields}}}


def _states(tmp_path) -> dict[tuple[str, str], str]:
    book = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    return {
        (r.tenant, r.business_date.isoformat()): r.state.value for r in book.queries.records(export="invoice_export")
    }


def _health(instance) -> dict[str, tuple[str, str]]:
    """Each date's latest partition_health: (status, the verdict's description)."""
    latest = {}
    key = dg.AssetCheckKey(ASSET, "partition_health")
    for record in instance.event_log_storage.get_asset_check_execution_history(key, 100):
        if record.partition not in latest:
            evaluation = record.event.dagster_event.event_specific_data
            latest[record.partition] = (record.status.value, evaluation.description)
    return latest


@pytest.mark.parametrize("how", ["tag", "config"])
def test_a_backfill_of_one_tenant_exports_and_reads_that_tenant_alone_and_each_dates_health_names_the_others(
    tmp_path, instance, how
):
    source = CountedSource()
    defs = make_defs(tmp_path, tenants=TENANTS, source=source)

    if how == "tag":
        result = _run(defs, instance, tags={TENANTS_TAG: " globex "})
    else:
        result = _run(defs, instance, config=_config(tenants=["globex"]))

    assert result.success, failure_message(result)
    assert _states(tmp_path) == {("globex", d): "completed" for d in (FIRST, BAD, LAST)}, "globex's keys alone"
    assert set(source.reads) == {"globex"}, "no other tenant's source is read"
    health = _health(instance)
    for day in (FIRST, BAD, LAST):
        status, summary = health[day]
        # Passed would say the date is healthy; two of its three tenants were never exported.
        assert status == "FAILED" and summary == "missing: 2 of 3 tenants (acme, initech)", (day, health[day])
    materialized = instance.get_status_by_partition(ASSET, [FIRST, LAST], defs.get_assets_def(ASSET).partitions_def)
    assert set(materialized.values()) == {dg.AssetPartitionStatus.MATERIALIZED}

    # The rest of the tenants later, by an unscoped run: globex is skipped unread, the dates become healthy.
    source.reads.clear()
    assert _run(defs, instance).success
    assert set(source.reads) == {"acme", "initech"}
    assert {status for status, _ in _health(instance).values()} == {"SUCCEEDED"}


def test_a_failing_tenant_does_not_hold_back_a_backfill_of_the_others(tmp_path, instance):
    source = CountedSource(fails_on=BAD)
    defs = make_defs(tmp_path, tenants=TENANTS, source=source)

    whole = _run(defs, instance)
    assert not whole.success and "the source refused the query" in failure_message(whole)
    status = instance.get_status_by_partition(ASSET, [BAD], defs.get_assets_def(ASSET).partitions_def)
    assert status == {BAD: dg.AssetPartitionStatus.FAILED}
    assert _health(instance)[BAD][1] == "failed: 1 of 3 tenants (globex)", "the red date says whose key failed"

    # acme and initech's keys of that date were exported by the failed run already: a run of them alone skips them
    # and succeeds; only globex's key is left, and the date says so.
    scoped = _run(defs, instance, tags={TENANTS_TAG: "acme,initech"})
    assert scoped.success, failure_message(scoped)
    states = _states(tmp_path)
    assert states[("globex", BAD)] == "failed"
    assert all(states[(t, d)] == "completed" for t in ("acme", "initech") for d in (FIRST, BAD, LAST))
    assert _health(instance)[BAD][1] == "failed: 1 of 3 tenants (globex)"


@pytest.mark.parametrize(
    ("tags", "config", "words"),
    [
        ({TENANTS_TAG: "globex,typo"}, None, "typo (not a tenant of the export invoice_export)"),
        ({TENANTS_TAG: ""}, None, "the run's tenants are empty or have an empty name"),
        ({TENANTS_TAG: "acme,,globex"}, None, "an empty name"),
        ({TENANTS_TAG: "acme,acme"}, None, "name acme more than once"),
        (None, _config(tenants=["nobody"]), "nobody (not a tenant of the export invoice_export)"),
        ({TENANTS_TAG: "acme"}, _config(tenants=["globex"]), "its config's tenants (globex) differ"),
        (None, _config(tenants=["acme"], restate_reason="fix", restate_tenants=["globex"]), "not among the run's"),
    ],
)
def test_a_bad_scope_is_refused_naming_it_before_anything_is_exported(tmp_path, instance, tags, config, words):
    source = CountedSource()
    defs = make_defs(tmp_path, tenants=TENANTS, source=source)

    result = _run(defs, instance, tags=tags, config=config)

    assert not result.success
    assert words in failure_message(result), failure_message(result)
    assert _states(tmp_path) == {} and not source.reads, "nothing read, claimed or exported"


def test_a_tenant_of_another_zones_asset_is_left_to_that_asset_and_an_unknown_name_is_refused_listing_the_tenants():
    tenants = [Tenant("acme"), Tenant("bombay", "Asia/Kolkata")] + [Tenant(f"t{i:02d}") for i in range(12)]
    groups = tenant_groups("orders", "America/New_York", None, tenants)
    new_york = next(g for g in groups if g.timezone == "America/New_York")

    with pytest.raises(ConfigurationError) as refused:
        run_tenants(["bombay", "x" * 500], new_york, groups)

    message = str(refused.value)
    assert "bombay" not in message, "a tenant of another zone is not an error: its own zone's asset exports it"
    assert "x" * 64 + " (not a tenant" in message and "x" * 65 not in message, "a long name is cut, not echoed whole"
    assert "Its tenants: acme, t00, t01" in message and "(13 in all)" in message
    assert run_tenants(["t03", "acme"], new_york, groups) == ("acme", "t03"), "in the asset's order"
    assert run_tenants(["bombay"], new_york, groups) == (), "nothing of this asset's"


def _checks(instance) -> dict[tuple[str, str], tuple[str, bool]]:
    """The partitioned check's latest status per date, and whether it judged the date's latest materialization."""
    out = {}
    for name in ("partition_health",):
        for info in instance.event_log_storage.get_asset_check_partition_info([dg.AssetCheckKey(ASSET, name)]):
            out[(name, info.partition_key)] = (info.latest_execution_status.value, info.is_current)
    return out


def test_a_scoped_run_judges_every_date_it_ran_even_one_where_its_tenant_has_no_key_here(tmp_path, instance):
    """globex's business day is Chicago's until 2026-03-03 (exported by that zone's asset), New York's from then on.
    A New York run scoped to globex over 03-02..03-04 has no key on 03-02; Dagster still records the date's new
    materialization, so the date is judged again (acme's key, healthy) rather than left with its checks planned.
    Guard: health_days over every date of the run."""
    globex = Tenant("globex", "America/New_York", moves=(ZoneMove("2026-03-03", "America/Chicago"),))
    defs = make_defs(tmp_path, tenants=[Tenant("acme"), globex])
    assert _run(defs, instance).success

    scoped = _run(defs, instance, tags={TENANTS_TAG: "globex"})

    assert scoped.success, failure_message(scoped)
    checks = _checks(instance)
    assert checks[("partition_health", FIRST)] == ("SUCCEEDED", True), checks
    said = " ".join(str(e.message) for e in instance.all_logs(scoped.run_id))
    assert f"nothing to export on {FIRST}: none of the run's tenants (globex)" in said, said


def test_a_scoped_run_does_not_pass_a_date_whose_other_tenant_failed(tmp_path, instance):
    """acme's key of BAD failed; a run of globex alone on BAD materializes the date again: its partition_health
    still fails for acme's key, judged from the ledger beside the run's own; acme's completed key of FIRST, which the
    run did not export, is verified at the destination all the same.
    Guard: health_days over every tenant of the run's dates."""
    source = CountedSource(fails_on=BAD)
    source.failing = "acme"
    defs = make_defs(tmp_path, tenants=TENANTS, source=source)
    assert not _run(defs, instance).success

    scoped = _run(defs, instance, tags={TENANTS_TAG: "globex"})

    assert scoped.success, failure_message(scoped)
    checks = _checks(instance)
    assert checks[("partition_health", BAD)] == ("FAILED", True), checks
    assert checks[("partition_health", FIRST)] == ("SUCCEEDED", True), checks
    verdicts = {e.partition: e for e in scoped.get_asset_check_evaluations()}
    assert verdicts[BAD].description == "failed: 1 of 3 tenants (acme)", verdicts[BAD]
    assert verdicts[FIRST].metadata["verified_at_destination"].value == 3, "the other tenant's key verified too"


def test_restating_within_a_scoped_run_restates_only_its_tenants(tmp_path, instance):
    source = CountedSource()
    defs = make_defs(tmp_path, tenants=TENANTS, source=source)
    assert _run(defs, instance).success
    source.reads.clear()

    result = _run(defs, instance, config=_config(tenants=["acme"], restate_reason="late corrections"))

    assert result.success, failure_message(result)
    # A completed key is read again only for its restatement: acme's three dates, nobody else's.
    assert source.reads == Counter({"acme": 3})


# -- what the reconciliation sensor launches again for a scoped run -----------------------------------------------

LEDGER_DOWN = "postgresql+psycopg2://postgres@127.0.0.1:1/test"  # nothing listens on port 1


def test_a_scoped_run_that_failed_before_claiming_is_launched_again_for_its_tenants_alone(tmp_path, instance):
    """Guard: the relaunch pass reads the failed run's scope (``_scope_of``) and counts and tags by it; without it,
    the relaunch exported every tenant of the date, the ones the person left out too."""
    down = make_defs(tmp_path, tenants=TENANTS, ledger_url=LEDGER_DOWN)
    failed = down.resolve_job_def(JOB).execute_in_process(
        instance=instance, partition_key=FIRST, tags={TENANTS_TAG: "globex"}, raise_on_error=False
    )
    assert not failed.success
    good = make_defs(tmp_path, tenants=TENANTS)

    (request,) = tick(good, instance).result.run_requests

    assert (request.partition_key, request.tags[TENANTS_TAG]) == (FIRST, "globex")
    relaunched = good.resolve_job_def(request.job_name).execute_in_process(
        instance=instance, partition_key=request.partition_key, tags=request.tags, raise_on_error=False
    )
    assert relaunched.success, failure_message(relaunched)
    assert _states(tmp_path) == {("globex", FIRST): "completed"}, "acme and initech stay as the person left them"


def test_a_run_refused_for_its_tenants_is_not_launched_again(tmp_path, instance):
    """A typo in the tag would be refused again, and launching its dates without the tag would export every tenant:
    the sensor leaves it to the person and says why."""
    defs = make_defs(tmp_path, tenants=TENANTS)
    assert not _run(defs, instance, tags={TENANTS_TAG: "globx"}).success

    found = tick(defs, instance)

    assert not found.result.run_requests
    said = " ".join(record.getMessage() for record in found.logs)
    assert "is not launched again" in said and "globx (not a tenant of the export invoice_export)" in said, said
    assert _states(tmp_path) == {}
