"""The invoice export for tenants in three zones: each tenant's business day is its own."""

from definitions import build_definitions

defs = build_definitions(
    tenants={
        "acme": "America/New_York",
        "bombay-traders": "Asia/Kolkata",
        "apia-foods": "Pacific/Apia",
    }
)
