"""Validation on Arrow (issue #21) gives the bytes, fingerprints and refusals that validation on pandas gave.

``validate_frame`` checks a frame on its Arrow table and leaves every frame it would not accept to the pandas checks
(``_validated_on_pandas``, the code that ran before). Fingerprints are stored in ledgers and data files' sha256 in
manifests: both are compared with values computed by the code before the change, and the whole table and Parquet
file with what the pandas checks make of the same frame.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pandas as pd
import pytest
from builders import INVOICE_WINDOW as WINDOW
from builders import INVOICES_SCHEMA as INVOICES
from builders import invoices_frame as invoices

from export_ledger.errors import FrameError
from export_ledger.fingerprint import Fingerprint
from export_ledger.frames import (
    ExportSchema,
    _validated_on_arrow,
    _validated_on_pandas,
    validate_frame,
    write_table,
)

VERSIONED = ExportSchema(
    {
        "order_id": "string",
        "line": "int",
        "placed_at": "timestamp",
        "updated_at": "timestamp",
        "paid": "bool",
        "note": "string",
        "weight": "float",
    },
    "placed_at",
    ("order_id", "line"),
    nullable={"note", "weight"},
    version_column="updated_at",
)


def versioned(rows: int) -> pd.DataFrame:
    """Order lines with two id columns, a version column, non-ASCII ids and nulls in the nullable columns."""
    k = np.arange(rows, dtype=np.int64)
    start = pd.Timestamp(WINDOW.start_utc)
    return pd.DataFrame(
        {
            "order_id": [f"ord-ü{i // 3:06d}" for i in k],
            "line": (k % 3).astype(np.int64),
            "placed_at": start + pd.to_timedelta(k // 3, unit="s"),
            "updated_at": start + pd.to_timedelta(k * 2, unit="s"),
            "paid": k % 2 == 0,
            "note": [None if i % 5 == 0 else f"n{i}" for i in k],
            "weight": np.where(k % 4 == 0, np.nan, k / 10.0),
        }
    )


# Computed by validate_frame and write_table before validation moved to Arrow (pandas 3.1.1, pyarrow 26.0.1):
# name -> (fingerprint, sha256 of the CSV file). Fingerprints are stored in ledgers: they may never change.
GOLDEN = {
    "invoices_in_order": (
        "fp1 rows=20000 ids=4169e7ca285978dd versions=-",
        "2a9830ebf0b252768a3e9cf731afd9d56d8f242b826e3cec4d150a2996718d52",
    ),
    "invoices_ties": (
        "fp1 rows=5000 ids=24331cc7144b223b versions=-",
        "e089567dc588258b248619500a39bdb339ef6f5c95b5898731956082f0d9fab4",
    ),
    "invoices_shuffled": (
        "fp1 rows=5000 ids=4a11e59294d4d633 versions=-",
        "b2461766a48a6d47ce3dc35c8228ff46882b13885b7d512dbdd100b2c18e213d",
    ),
    "invoices_str_dtype": (
        "fp1 rows=5000 ids=4a11e59294d4d633 versions=-",
        "b2461766a48a6d47ce3dc35c8228ff46882b13885b7d512dbdd100b2c18e213d",
    ),
    "versioned_nullable": (
        "fp1 rows=6000 ids=2959f1ee998b3928 versions=68c0fbea67ceaf9b",
        "4d6a6e45e4d9097d90f14b1ab8d2488acff65d6648113e0cda9a99174a122f1c",
    ),
}
CASES = {
    "invoices_in_order": (INVOICES, lambda: invoices(20_000)),
    "invoices_ties": (INVOICES, lambda: invoices(5_000, ties=True)),
    "invoices_shuffled": (INVOICES, lambda: invoices(5_000, shuffled=True)),
    "invoices_str_dtype": (INVOICES, lambda: invoices(5_000, dtype="str")),
    "versioned_nullable": (VERSIONED, lambda: versioned(6_000)),
}
# Frames in file order: the Arrow checks must accept these themselves (else this file would test pandas twice).
ACCEPTED_ON_ARROW = {"invoices_in_order", "invoices_ties", "invoices_str_dtype", "versioned_nullable"}


def _tenant(schema: ExportSchema) -> str | None:
    return "acme" if schema.tenant_column else None


def _sha256(table, file_format: str) -> str:
    sink = io.BytesIO()
    assert write_table(table, file_format, sink) == hashlib.sha256(sink.getvalue()).hexdigest()
    return hashlib.sha256(sink.getvalue()).hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_arrow_validation_keeps_fingerprints_and_data_files_byte_identical(name):
    schema, build = CASES[name]
    fingerprint = Fingerprint(schema.id_columns, schema.version_column)
    table = validate_frame(build(), schema, WINDOW, name, _tenant(schema), fingerprint=fingerprint)

    golden_fingerprint, golden_csv = GOLDEN[name]
    assert fingerprint.encode() == golden_fingerprint, "a stored fingerprint would no longer match its source"
    assert _sha256(table, "csv") == golden_csv, "the CSV file must be byte for byte what the pandas path wrote"

    on_pandas = Fingerprint(schema.id_columns, schema.version_column)
    reference = _validated_on_pandas(build(), schema, WINDOW, name, _tenant(schema), on_pandas)
    assert table.equals(reference, check_metadata=True), "the same table, schema metadata included"
    assert _sha256(table, "parquet") == _sha256(reference, "parquet")
    assert on_pandas.encode() == fingerprint.encode()


@pytest.mark.parametrize("name", sorted(ACCEPTED_ON_ARROW))
def test_frames_in_file_order_are_validated_on_arrow(name):
    schema, build = CASES[name]
    assert _validated_on_arrow(build(), schema, WINDOW, _tenant(schema), None) is not None


def _set(frame: pd.DataFrame, row: int, column: str, value) -> pd.DataFrame:
    values = frame[column].astype(object).to_numpy().copy()
    values[row] = value
    frame[column] = pd.Series(values, index=frame.index, dtype=object)
    return frame


def _late(frame: pd.DataFrame) -> pd.DataFrame:
    frame.loc[len(frame) - 1, "occurred_at"] = pd.Timestamp(WINDOW.end_utc)
    return frame


BAD = {
    "none_in_required_string": lambda f: _set(f, 3, "customer_email", None),
    "nan_in_required_string": lambda f: _set(f, 3, "currency", float("nan")),
    "pd_na_in_required_string": lambda f: _set(f, 3, "currency", pd.NA),
    "nat_in_required_string": lambda f: _set(f, 3, "currency", pd.NaT),
    "nan_amount": lambda f: f.assign(amount=f["amount"].where(f.index != 5)),
    "nat_time": lambda f: f.assign(occurred_at=f["occurred_at"].where(f.index != 7)),
    "event_at_window_end": _late,
    "event_before_window": lambda f: f.assign(occurred_at=f["occurred_at"] - pd.Timedelta(hours=1)),
    "foreign_tenant": lambda f: _set(f, 9, "tenant", "globex"),
    "duplicate_id": lambda f: _set(f, 1, "invoice_id", f.loc[0, "invoice_id"]),
    "number_among_strings": lambda f: _set(f, 4, "customer_email", 12),
    "sub_microsecond_time": lambda f: f.assign(occurred_at=f["occurred_at"] + pd.Timedelta(nanoseconds=1)),
    "naive_times": lambda f: f.assign(occurred_at=f["occurred_at"].dt.tz_localize(None)),
    "text_amounts": lambda f: f.assign(amount=f["amount"].astype(str)),
    "missing_column": lambda f: f.drop(columns=["currency"]),
    "not_a_frame": lambda f: f.to_dict(),
}


@pytest.mark.parametrize("defect", sorted(BAD))
def test_bad_frames_are_refused_in_the_words_of_the_pandas_checks(defect):
    def outcome(check):
        frame = BAD[defect](invoices(2_000))
        fingerprint = Fingerprint(INVOICES.id_columns, None)
        try:
            return check(frame, fingerprint), fingerprint.encode()
        except FrameError as exc:
            return str(exc), fingerprint.encode()

    expected = outcome(lambda frame, fp: _validated_on_pandas(frame, INVOICES, WINDOW, "k", "acme", fp))
    actual = outcome(lambda frame, fp: validate_frame(frame, INVOICES, WINDOW, "k", "acme", fingerprint=fp))
    assert isinstance(expected[0], str), f"{defect} is a defect the pandas checks refuse"
    assert actual == expected, "the same refusal, and the fingerprint left as the pandas checks leave it"


def test_values_arrow_converts_as_pandas_did_are_accepted_alike():
    frame = _set(invoices(2_000), 4, "customer_email", b"bytes@example.com")
    on_pandas = _validated_on_pandas(frame.copy(), INVOICES, WINDOW, "k", "acme", None)
    assert validate_frame(frame, INVOICES, WINDOW, "k", "acme").equals(on_pandas)


def test_null_like_values_in_a_nullable_column_are_accepted_on_arrow_as_on_pandas():
    frame = versioned(600)
    frame["note"] = pd.Series([pd.NA if i % 3 == 0 else f"n{i}" for i in range(600)], dtype=object)
    on_arrow = _validated_on_arrow(frame.copy(), VERSIONED, WINDOW, None, None)
    assert on_arrow is not None
    assert on_arrow.column("note").null_count == 200
    assert on_arrow.equals(_validated_on_pandas(frame, VERSIONED, WINDOW, "k", None, None))
