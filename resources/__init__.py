"""The reference code location's sources (the invoice sample and the invoices SQL table)."""
