"""Benchmark 5: ``dagster definitions validate`` on this project against a one-asset project, same run.

Each variant is a fresh process (what a code server or the CLI pays at every start), interleaved; medians.
``import dagster`` alone is timed beside them: the floor that every Dagster code location pays. Beside them, the
invoice export with 1,000 tenants in one zone and in 40 zones (40 assets, jobs and schedules): its load time, and
the reconciliation sensor's tick in process on the same ledger (1,000 tenants x 30 completed days, nothing stuck).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import warnings
from pathlib import Path

from benchmarks.common import PROJECT_ROOT, Settings, interleaved, median, scratch_dir

TENANTS = 1_000
ZONES = 40
DAYS = 30

NAME = "code_location"
ONE_ASSET = """import dagster as dg


@dg.asset
def one() -> int:
    return 1


defs = dg.Definitions(assets=[one])
"""


def zone_tenants(zones: int, tenants: int = TENANTS) -> dict[str, str]:
    """``tenants`` tenants spread round-robin over ``zones`` real zones (a fixed, sorted choice)."""
    from export_ledger.calendar import known_zones

    chosen = sorted(z for z in known_zones() if z.startswith(("America/", "Europe/", "Asia/", "Africa/")))
    step = max(1, len(chosen) // zones)
    picked = chosen[::step][:zones]
    return {f"t{i:05d}": picked[i % zones] for i in range(tenants)}


def _zones_file(zones: int) -> str:
    return (
        "from benchmarks.code_location import zone_tenants\n"
        "from definitions import build_definitions\n\n"
        f"defs = build_definitions(tenants=zone_tenants({zones}))\n"
    )


def _fill_ledger(url: str, tenants: dict[str, str]) -> None:
    """Completed keys for every tenant on ``DAYS`` days, bulk-inserted (the sensor's routine, nothing-stuck tick)."""
    import sqlalchemy as sa

    from export_ledger.calendar import tz_database_version, window_for
    from export_ledger.ledger import ExportLedger
    from export_ledger.ledger.schema import export_runs

    ledger = ExportLedger(url)
    now = dt.datetime.now(dt.timezone.utc)
    rows = []
    for tenant, zone in tenants.items():
        for d in range(DAYS):
            window = window_for(dt.date(2026, 1, 1) + dt.timedelta(days=d), zone)
            start = window.start_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
            rows.append(
                dict(
                    logical_key=f"invoice_export/{tenant}/{start}", export="invoice_export", tenant=tenant,
                    business_date=window.business_date, timezone=zone, window_start_utc=window.start_utc,
                    window_end_utc=window.end_utc, tz_database=tz_database_version(zone), state="completed",
                    location="bench", sha256="0" * 64, row_count=1, committed_attempt="bench", fencing_token=1,
                    created_at=now, updated_at=now,
                )
            )  # fmt: skip
    with ledger.atomic() as conn:
        conn.execute(sa.insert(export_runs), rows)


def _tick_variants(folder: Path, instance) -> dict:
    """The whole reconciliation sensor evaluation for 1,000 tenants in one zone and in 40 zones, same ledger shape."""
    import dagster as dg

    from definitions import build_definitions
    from export_ledger import LocalDestination
    from export_ledger.dagster import DestinationResource, LedgerResource

    variants = {}
    for zones in (1, ZONES):
        tenants = zone_tenants(zones) if zones > 1 else dict.fromkeys(zone_tenants(1), "America/New_York")
        url = f"sqlite:///{folder / f'ledger-{zones}.sqlite3'}"
        _fill_ledger(url, tenants)
        root = folder / f"exports-{zones}"
        defs = build_definitions(
            tenants=tenants, ledger_url=url, destination=str(root), environ={"EXPORTS_SOURCE": "sample"}
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sensor = defs.get_sensor_def("reconciliation_sensor")
        resources = {
            "ledger": LedgerResource(url=url),
            "invoice_export__destination": DestinationResource.of(LocalDestination(str(root))),
        }

        def tick(_rep, sensor=sensor, resources=resources):
            sensor(dg.build_sensor_context(instance=instance, resources=resources))

        variants[f"tick_{zones}_zones"] = tick
    return variants


def _environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_") and k != "DAGSTER_HOME"}
    env["DAGSTER_HOME"] = str(home)
    env["EXPORTS_SOURCE"] = "sample"  # the reference location has no default source
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")


def run(settings: Settings) -> dict:
    repeats = settings.reps(full=7)
    with scratch_dir(settings.scratch, NAME) as folder:
        home = folder / "dagster_home"
        home.mkdir()
        one_asset = folder / "one_asset"
        one_asset.mkdir()
        (one_asset / "definitions.py").write_text(ONE_ASSET, encoding="utf-8")
        env = _environment(home)
        validate = [sys.executable, "-m", "dagster", "definitions", "validate", "-f", "definitions.py"]
        for zones in (1, ZONES):
            (folder / f"zones_{zones}.py").write_text(_zones_file(zones), encoding="utf-8")
        variants = {
            "import_dagster": lambda _rep: _run([sys.executable, "-c", "import dagster"], folder, env),
            "one_asset": lambda _rep: _run(validate, one_asset, env),
            "export_ledger": lambda _rep: _run(validate, PROJECT_ROOT, env),
            "tenants_1_zone": lambda _rep: _run([*validate[:-1], str(folder / "zones_1.py")], folder, env),
            f"tenants_{ZONES}_zones": lambda _rep: _run(
                [*validate[:-1], str(folder / f"zones_{ZONES}.py")], folder, env
            ),
        }
        times = interleaved(variants, repeats, warmup=not settings.smoke)
        import dagster as dg

        with dg.instance_for_test() as instance:
            times.update(interleaved(_tick_variants(folder, instance), repeats, warmup=not settings.smoke))
    medians = {name: median(values) for name, values in times.items()}
    ratio = medians["export_ledger"] / medians["one_asset"]
    return {
        "description": "dagster definitions validate: this project vs a one-asset project (fresh process each)",
        "repeats": repeats,
        "median_s": {k: round(v, 3) for k, v in medians.items()},
        "all_s": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
        "ratio_project_vs_one_asset": round(ratio, 4),
        "extra_s_vs_one_asset": round(medians["export_ledger"] - medians["one_asset"], 3),
        "table": [
            {
                "variant": "import dagster",
                "median s": round(medians["import_dagster"], 3),
                "x one-asset": round(medians["import_dagster"] / medians["one_asset"], 3),
            },
            {"variant": "one-asset project", "median s": round(medians["one_asset"], 3), "x one-asset": 1.0},
            {
                "variant": "export-ledger",
                "median s": round(medians["export_ledger"], 3),
                "x one-asset": round(ratio, 3),
            },
            *(
                {
                    "variant": f"{TENANTS:,} tenants in {name.split('_')[1]} zone(s)",
                    "median s": round(medians[name], 3),
                    "x one-asset": round(medians[name] / medians["one_asset"], 3),
                }
                for name in ("tenants_1_zone", f"tenants_{ZONES}_zones")
            ),
            *(
                {
                    "variant": f"sensor tick, {TENANTS:,} tenants in {name.split('_')[1]} zone(s), in process",
                    "median s": round(medians[name], 4),
                    "x one-asset": None,
                }
                for name in ("tick_1_zones", f"tick_{ZONES}_zones")
            ),
        ],
        "zones": {
            "load_s_40_vs_1_zone": round(medians[f"tenants_{ZONES}_zones"] / medians["tenants_1_zone"], 3),
            "tick_40_vs_1_zone": round(medians[f"tick_{ZONES}_zones"] / medians["tick_1_zones"], 3),
        },
        "targets": [],
        "notes": ["no target in the issue: reported for comparison only"],
    }
