"""Benchmarks of export-ledger against plain baselines measured in the same run. Entry point: ``benchmarks.run``."""
