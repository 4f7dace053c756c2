"""Source fingerprints: what a key's source held when it was exported, as counts and digests, never values.

A fingerprint is the row count, an order-independent digest of the rows' ids and, when the export declares a
version column, of each row's (ids, version). Each row's ids are hashed to 64 bits with pandas'
``hash_array`` (the hashes the duplicate check uses anyway) and the hashes are summed modulo 2**64: the sum
does not depend on the order of the rows, and batches of a stream add up to the whole. Encoded as a short versioned
string, ``fp1 rows=N ids=<16 hex> versions=<16 hex or ->``, stored in ``export_runs.source_fingerprint``.

Two reads of the same rows give the same fingerprint only if the values arrive with the same types: the drift pass
(:mod:`export_ledger.drift`) reads the source the way the export did (whole frame or batches).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from export_ledger.lazy import lazy_module

np = lazy_module("numpy", globals(), "np")
pd = lazy_module("pandas", globals(), "pd")

PREFIX = "fp1"
_MASK = (1 << 64) - 1
# Mixes the version's hash into the ids' so that (id a, version x) and (id b, version y) do not cancel out with
# (id a, version y) and (id b, version x) in the sum: a multiply by an odd constant, then xor.
_MIX = 0x9E3779B97F4A7C15  # a numpy uint64 where it is used
_PATTERN = re.compile(r"^fp1 rows=(\d+) ids=([0-9a-f]{16}) versions=([0-9a-f]{16}|-)$")


def id_hashes(frame: pd.DataFrame, id_columns: Sequence[str]) -> np.ndarray:
    """One ``uint64`` per row for its id values (what the duplicate check and the fingerprint share).

    ``categorize=False``: ids are (nearly) unique, so factorizing them first, pandas' default, only costs time (twice
    as long at a million string ids).
    """
    columns = list(id_columns)
    if len(columns) == 1:
        return pd.util.hash_array(frame[columns[0]].to_numpy(), categorize=False)
    return pd.util.hash_pandas_object(frame[columns], index=False, categorize=False).to_numpy()


def version_hashes(frame: pd.DataFrame, ids: np.ndarray, version_column: str) -> np.ndarray:
    """One ``uint64`` per row for (its ids, its version), from the rows' id hashes."""
    versions = pd.util.hash_pandas_object(frame[version_column], index=False, categorize=False).to_numpy()
    with np.errstate(over="ignore"):
        return ids ^ (versions * np.uint64(_MIX))


def _sum(values: np.ndarray) -> int:
    # uint64 addition wraps around: the sum modulo 2**64, whatever the order.
    with np.errstate(over="ignore"):
        return int(values.sum(dtype=np.uint64)) if len(values) else 0


@dataclass
class Fingerprint:
    """An accumulating source fingerprint: add each frame (or batch) of a key, then :meth:`encode`.

    Example:
        >>> fp = Fingerprint(("order_id",), None)
        >>> fp.add(pd.DataFrame({"order_id": ["a", "b"]}))
        >>> fp.encode().startswith("fp1 rows=2 ids=")
        True
    """

    id_columns: tuple[str, ...]
    version_column: str | None
    rows: int = 0
    ids: int = 0
    versions: int = 0

    def add(self, frame: pd.DataFrame, ids: np.ndarray | None = None) -> None:
        """Adds the rows of ``frame``; ``ids`` are their :func:`id_hashes` when the caller has them already."""
        if ids is None:
            ids = id_hashes(frame, self.id_columns)
        self.rows += len(frame)
        self.ids = (self.ids + _sum(ids)) & _MASK
        if self.version_column is not None:
            self.versions = (self.versions + _sum(version_hashes(frame, ids, self.version_column))) & _MASK

    def encode(self) -> str:
        versions = "-" if self.version_column is None else f"{self.versions:016x}"
        return f"{PREFIX} rows={self.rows} ids={self.ids:016x} versions={versions}"


@dataclass(frozen=True)
class ParsedFingerprint:
    rows: int
    ids: str
    versions: str | None


def parse(text: str) -> ParsedFingerprint:
    """The parts of an encoded fingerprint.

    Raises:
        ValueError: not a fingerprint this release can read (a newer encoding, or damage).
    """
    match = _PATTERN.match(text or "")
    if match is None:
        raise ValueError(f"not a source fingerprint this release reads (expected {PREFIX} rows=N ids=... ...)")
    versions = None if match.group(3) == "-" else match.group(3)
    return ParsedFingerprint(int(match.group(1)), match.group(2), versions)


def of_frame(frame: pd.DataFrame, id_columns: Sequence[str], version_column: str | None) -> str:
    """The encoded fingerprint of one whole frame."""
    fingerprint = Fingerprint(tuple(id_columns), version_column)
    fingerprint.add(frame)
    return fingerprint.encode()
