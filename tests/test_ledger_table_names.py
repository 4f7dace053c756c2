"""``ledger-table:exported_{export}`` is checked with each export's real name (issue 26): before, the check replaced
``{export}`` by ``x``, so an export name of 45 to 63 characters loaded and then every run failed on PostgreSQL with a
bare ``IdentifierError`` (``<table>_manifests`` over PostgreSQL's 63 bytes). Now the code location refuses to load,
naming the export, the table, its length and the limit; the destination refuses the same before writing anything.
The limit (53 for the rows table, so that its ``_manifests`` and ``_revisions`` fit 63) applies on SQLite too, which
has none of its own, as it always did for a table named outright."""

from __future__ import annotations

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from builders import open_ledger

from export_ledger import ConfigurationError, ExportSpec
from export_ledger.dagster import ledgered_definitions
from export_ledger.destinations import DestinationError
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.keys import LogicalKey
from export_ledger.ledger import dispose_engines
from export_ledger.ledger.schema import ExportState
from export_ledger.protocol import ExportBatch, ExportItem, export_batch

PARTITION = "2026-03-08"
LONGEST = "o" * 44  # exported_ + 44 = 53 characters: exported_..._manifests is 63 bytes, PostgreSQL's limit
TOO_LONG = "o" * 45  # 54 and 64: one byte over


def _orders(tenant, start, end) -> pd.DataFrame:
    times = pd.date_range(pd.Timestamp(start).ceil("h"), pd.Timestamp(end), freq="h", inclusive="left").as_unit("us")
    return pd.DataFrame({"order_id": [f"{tenant}-{i:03d}" for i in range(len(times))], "placed_at": times})


def _spec(name: str, **overrides) -> ExportSpec:
    return ExportSpec(
        name=name,
        source=_orders,
        columns={"order_id": "string", "placed_at": "timestamp"},
        id_columns=["order_id"],
        time_column="placed_at",
        tenants=["acme"],
        timezone="America/New_York",
        start_date="2026-03-01",
        **overrides,
    )


def _tables(url: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return sorted(t for t in sa.inspect(conn).get_table_names() if not t.startswith("export_"))
    finally:
        engine.dispose()


def test_an_export_name_too_long_for_its_ledger_table_is_refused_when_the_code_location_loads(ledger_url):
    environ = {"EXPORTS_LEDGER_URL": ledger_url, "EXPORTS_DESTINATION": "ledger-table:exported_{export}"}
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([_spec("orders"), _spec(TOO_LONG)], environ=environ)

    message = str(refused.value)
    assert message.startswith("EXPORTS_DESTINATION 'ledger-table:exported_{export}': "), message
    assert f"export '{TOO_LONG}' would be stored in the table 'exported_{TOO_LONG}' (54 bytes)" in message, message
    assert f"'exported_{TOO_LONG}_manifests' (64 bytes), over the limit of 63 bytes" in message, message
    assert "at most 53" in message, "the limit on the table's own name is said"
    assert _tables(ledger_url) == [], "refused before anything runs"


def test_an_export_whose_own_destination_names_a_table_too_long_is_refused_naming_that_setting(sqlite_url):
    declared = _spec(TOO_LONG, destination="ledger-table:rows_{export}_v2")  # 5 + 45 + 3 = 53: fits
    assert ledgered_definitions([declared], environ={"EXPORTS_LEDGER_URL": sqlite_url})
    declared = _spec(TOO_LONG, destination="ledger-table:rows_of_{export}_v2")  # 56: over
    setting = f"destination of export {TOO_LONG} 'ledger-table:rows_of_{{export}}_v2'"
    with pytest.raises(ConfigurationError, match=setting):
        ledgered_definitions([declared], environ={"EXPORTS_LEDGER_URL": sqlite_url})


def test_a_template_that_makes_one_of_the_ledgers_own_tables_is_refused(sqlite_url):
    environ = {"EXPORTS_LEDGER_URL": sqlite_url, "EXPORTS_DESTINATION": "ledger-table:export_{export}"}
    with pytest.raises(ConfigurationError, match="export 'runs' would be stored in the ledger's own table 'export_ru"):
        ledgered_definitions([_spec("runs")], environ=environ)


@pytest.mark.parametrize(
    ("first", "second", "shared", "roles"),
    [
        # The reviewer's case (issue 26): t_inv's manifests table is t_inv_manifests, the rows table of the other.
        (_spec("inv"), _spec("inv_manifests"), "t_inv_manifests", "inv's manifests table, inv_manifests's rows table"),
        (_spec("inv"), _spec("inv_revisions"), "t_inv_revisions", "inv's revisions table, inv_revisions's rows table"),
        # A table named outright beside a template.
        (_spec("inv", destination="ledger-table:shared_manifests"), _spec("shared"), "t_shared_manifests", None),
        (
            _spec("inv", destination="ledger-table:t_shared_manifests"),
            _spec("shared"),
            "t_shared_manifests",
            "inv's rows table, shared's manifests table",
        ),
    ],
)
def test_exports_whose_ledger_tables_collide_are_refused_at_load_naming_both(sqlite_url, first, second, shared,
                                                                            roles):  # fmt: skip
    """Before, only specs without ``{export}`` were compared (by the rows table alone): these loaded, then every run
    of both exports failed on the other's table."""
    environ = {"EXPORTS_LEDGER_URL": sqlite_url, "EXPORTS_DESTINATION": "ledger-table:t_{export}"}
    if roles is None:  # shared_manifests and t_shared_manifests: no collision, loads
        assert ledgered_definitions([first, second], environ=environ)
        return
    with pytest.raises(ConfigurationError) as refused:
        ledgered_definitions([first, second], environ=environ)
    message = str(refused.value)
    assert f"exports ['{first.name}', '{second.name}'] would share the ledger table '{shared}'" in message, message
    assert roles in message, f"the message says which table of each export it is: {message}"
    assert _tables(sqlite_url) == [], "refused before anything runs"


def test_the_longest_export_name_that_fits_exports_into_its_ledger_table(ledger_url):
    environ = {"EXPORTS_LEDGER_URL": ledger_url, "EXPORTS_DESTINATION": "ledger-table:exported_{export}"}
    defs = ledgered_definitions([_spec(LONGEST)], environ=environ)
    result = defs.resolve_job_def(f"{LONGEST}_job").execute_in_process(
        partition_key=PARTITION, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False
    )
    assert result.success, [e.step_failure_data.error.message for e in result.all_events if e.is_step_failure]
    (record,) = open_ledger(ledger_url).queries.records()
    assert record.state is ExportState.COMPLETED and record.row_count == 23
    assert _tables(ledger_url) == [f"exported_{LONGEST}", f"exported_{LONGEST}_manifests"]


def test_the_destination_refuses_a_table_name_too_long_before_writing_anything(ledger_url):
    destination = SqlTableDestination(url=ledger_url, table="exported_{export}")
    spec = _spec(TOO_LONG)
    key = LogicalKey(TOO_LONG, "acme", spec.calendar.window(PARTITION))
    ledger = open_ledger(ledger_url)
    frame = _orders("acme", key.window.start_utc, key.window.end_utc)

    with pytest.raises(DestinationError, match="over the limit of 63 bytes"):  # a key's own refusal, as it is
        export_batch(ledger, destination, ExportBatch(spec.schema, [ExportItem(key, PARTITION, frame)]), "run-1/x")

    (attempt,) = ledger.queries.attempts(str(key))
    assert attempt.error_class == DestinationError.__name__
    assert f"would be stored in the table 'exported_{TOO_LONG}' (54 bytes)" in attempt.error_message
    assert "over the limit of 63 bytes" in attempt.error_message and "nothing was written" in attempt.error_message
    assert ledger.queries.get(str(key)).state is ExportState.FAILED, "failed, not an unknown outcome: safe to retry"
    assert _tables(ledger_url) == [], "no table was made"
    dispose_engines()
