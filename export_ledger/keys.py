"""Logical export keys: (export, tenant, window start UTC). Plain Python, no Dagster."""

from __future__ import annotations

import re
from dataclasses import dataclass

from export_ledger.calendar import ExportWindow, utc_iso
from export_ledger.errors import InvalidIdentifier

_SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def validate_slug(value: object, what: str) -> str:
    """Returns ``value`` when it is a safe slug (lowercase letters, digits, ``-``, ``_``; 1-63 characters).

    Slugs become path segments and object keys, so anything else (``../x``, spaces, empty) is refused.
    """
    if not isinstance(value, str) or not _SLUG_RE.fullmatch(value):
        raise InvalidIdentifier(
            f"invalid {what} {value!r}: use 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit"
        )
    return value


def parse_tenants(text: str) -> tuple[str, ...]:
    """Parses a comma-separated tenant list such as ``EXPORTS_TENANTS``; every entry must be a slug, no duplicates."""
    items = [item.strip() for item in text.split(",")]
    tenants = tuple(validate_slug(item, "tenant id") for item in items)
    if len(set(tenants)) != len(tenants):
        raise InvalidIdentifier(f"duplicate tenant id in {text!r}")
    return tenants


@dataclass(frozen=True)
class LogicalKey:
    """Identity of one logical export: everything that may happen at most once.

    Example:
        >>> import datetime as dt
        >>> from export_ledger.calendar import window_for
        >>> str(LogicalKey("invoice_export", "acme", window_for(dt.date(2026, 3, 8), "America/New_York")))
        'invoice_export/acme/2026-03-08T05:00:00Z'
    """

    export: str
    tenant: str
    window: ExportWindow

    def __post_init__(self) -> None:
        validate_slug(self.export, "export name")
        validate_slug(self.tenant, "tenant id")
        # The name is asked for several times per key and claim (statements, ordering, records): made once. Not a
        # field, so equality and hashing stay the three fields'.
        object.__setattr__(self, "_name", f"{self.export}/{self.tenant}/{utc_iso(self.window.start_utc)}")

    def __str__(self) -> str:
        return self._name


def attempt_id(run_id: str, step_key: str | None = None) -> str:
    """An attempt is one Dagster run (and step): ``<run id>/<step key>``."""
    return f"{run_id}/{step_key}" if step_key else run_id
