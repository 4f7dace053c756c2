"""Real processes: the code location validates, racing materializations export once, a SIGKILL is repaired."""

from __future__ import annotations

import subprocess
import time

import dagster as dg
import pytest
from builders import open_ledger
from pipeline_helpers import (
    DAGSTER,
    PROJECT,
    completed_without_export,
    finish,
    materialize,
    published_dirs,
    read_export,
)
from restatement_support import process_env

from export_ledger.ledger.schema import AttemptOutcome, ExportState

pytestmark = pytest.mark.process

KEY = "invoice_export/acme/2026-03-08T05:00:00Z"


def test_code_location_validates(tmp_path):
    result = subprocess.run(
        [DAGSTER, "definitions", "validate", "-w", "workspace.yaml"],
        cwd=PROJECT,
        env=process_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All code locations passed validation" in result.stdout + result.stderr


def test_two_processes_materializing_one_partition_export_it_once(tmp_path):
    # Each attempt pauses after its claim, so the second process arrives while the first holds the lease.
    env = process_env(tmp_path, EXPORTS_FAILPOINTS="after_claim=pause:4")
    second_env = process_env(tmp_path, "dagster_home_2", EXPORTS_FAILPOINTS=env["EXPORTS_FAILPOINTS"])
    first, second = materialize(env), materialize(second_env)
    (code_a, out_a), (code_b, out_b) = finish(first), finish(second)

    assert sorted([code_a, code_b]) in ([0, 0], [0, 1]), out_a[-2000:] + out_b[-2000:]
    loser = out_b if code_b else out_a
    if sorted([code_a, code_b]) == [0, 1]:
        assert f"{KEY} is being exported by attempt" in loser, "the loser is refused, naming the holder"
    assert len(published_dirs(tmp_path / "exports")) == 1
    ledger = open_ledger(env["EXPORTS_LEDGER_URL"])
    assert ledger.queries.get(KEY).state is ExportState.COMPLETED
    outcomes = sorted(a.outcome.value for a in ledger.queries.attempts(KEY))
    assert outcomes in (["completed", "refused"], ["already_completed", "completed"]), outcomes


def test_sigkill_after_publish_is_repaired_by_the_next_attempt_once_the_lease_expires(tmp_path):
    env = process_env(tmp_path, EXPORTS_LEASE_TTL_SECONDS="2", EXPORTS_FAILPOINTS="after_publish=kill")
    code, output = finish(materialize(env))
    assert code != 0, "the process was killed"
    (folder,) = published_dirs(tmp_path / "exports")
    killed_manifest, _ = read_export(folder)
    ledger = open_ledger(env["EXPORTS_LEDGER_URL"])
    assert ledger.queries.get(KEY).state is ExportState.IN_PROGRESS
    assert completed_without_export(ledger) == []

    time.sleep(2.5)  # let the dead attempt's 2-second lease run out (not a timing assertion)
    env.pop("EXPORTS_FAILPOINTS")
    code, output = finish(materialize(env))
    assert code == 0, output[-3000:]
    (folder_after,) = published_dirs(tmp_path / "exports")
    assert read_export(folder_after)[0] == killed_manifest, "the published copy is recorded, not rewritten"
    record = ledger.queries.get(KEY)
    assert record.state is ExportState.COMPLETED and record.committed_attempt == killed_manifest.attempt_id
    assert [a.outcome for a in ledger.queries.attempts(KEY)] == [AttemptOutcome.ABANDONED, AttemptOutcome.REPAIRED]
    assert "customer" not in output and "@example.com" not in output, "no customer data in CLI output"


def test_materializing_the_export_from_the_cli_is_one_step_whose_checks_name_its_materialization(tmp_path):
    """``dagster asset materialize --select invoice_export`` selects the asset and every check of it: all are the
    asset's own, so the run is one step in one process, and the partition's checks judge what it materialized."""
    env = process_env(tmp_path)
    code, output = finish(materialize(env, partition="2026-03-08"))
    assert code == 0, output[-3000:]
    assert "did not yield or return expected outputs" not in output, "every check the step was asked for is answered"

    instance = dg.DagsterInstance.from_config(env["DAGSTER_HOME"])
    try:
        (run,) = instance.get_runs()
        events = [e for e in instance.all_logs(run.run_id) if e.dagster_event is not None]
        steps = [e for e in events if e.dagster_event.event_type is dg.DagsterEventType.STEP_START]
        assert [e.step_key for e in steps] == ["invoice_export"], "one step: no check has a step of its own"
        (worker,) = [e for e in events if e.dagster_event.event_type is dg.DagsterEventType.STEP_WORKER_STARTED]
        judged = (dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        assert {e.dagster_event.pid for e in events if e.dagster_event.event_type in judged} == {
            worker.dagster_event.pid
        }, "one worker process exports and judges"
        # Its storage id as the asset's materializations are indexed (what a check's target names).
        (materialization,) = instance.fetch_materializations(dg.AssetKey("invoice_export"), limit=10).records
        assert materialization.run_id == run.run_id and materialization.partition_key == "2026-03-08"
        planned = {
            e.dagster_event.event_specific_data.check_name
            for e in events
            if e.dagster_event.event_type is dg.DagsterEventType.ASSET_CHECK_EVALUATION_PLANNED
        }
        evaluations = {
            e.dagster_event.event_specific_data.check_name: e.dagster_event.event_specific_data
            for e in events
            if e.dagster_event.event_type is dg.DagsterEventType.ASSET_CHECK_EVALUATION
        }
        assert sorted(evaluations) == sorted(planned), "every check the run planned has its verdict"
        for check in ("partition_health",):
            verdict = evaluations[check]
            assert verdict.passed and verdict.partition == "2026-03-08", (check, verdict.description)
            target = verdict.target_materialization_data
            assert (target.run_id, target.storage_id) == (run.run_id, materialization.storage_id), (
                f"{check} names this run's materialization of the partition"
            )
    finally:
        instance.dispose()
