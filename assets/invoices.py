"""The reference export: each tenant's invoices of one business day, declared with export_ledger's public API."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from export_ledger import ExportSchema, ExportSource, ExportSpec, Tenant

EXPORT_NAME = "invoice_export"
INVOICE_COLUMNS = {
    "invoice_id": "string",
    "tenant": "string",
    "occurred_at": "timestamp",
    "amount": "float",
    "currency": "string",
    "customer_email": "string",
}
INVOICE_SCHEMA = ExportSchema(INVOICE_COLUMNS, "occurred_at", ("invoice_id",), tenant_column="tenant")


def invoice_export(
    *,
    source: ExportSource,
    tenants: Sequence[str | Tenant] | Mapping[str, str | Tenant | None],
    timezone: str,
    start_date: str,
    schedule_time: str = "04:30",
    file_format: str = "csv",
    deadline: str | None = None,
) -> ExportSpec:
    """The ``invoice_export`` declaration: invoices by ``occurred_at``, unique ``invoice_id``, one tenant per file.

    ``tenants`` are ids in ``timezone``, or a mapping of id to each tenant's own zone (or :class:`Tenant` values).
    """
    return ExportSpec(
        name=EXPORT_NAME,
        source=source,
        columns=INVOICE_COLUMNS,
        id_columns=["invoice_id"],
        time_column="occurred_at",
        tenant_column="tenant",
        tenants=tenants,
        timezone=timezone,
        start_date=start_date,
        schedule_time=schedule_time,
        file_format=file_format,
        deadline=deadline,
        description="Invoice events of each tenant inside the partition's business-day window, exported once.",
    )
