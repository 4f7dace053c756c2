"""Harnesses for issue #5 (and protocol v2, issue #18): crash-anywhere, export races, fencing, the simulation, bad input
and secrets (pytest-free helpers).

``protocol`` runs one export attempt from a JSON-able spec, surveys a destination as its readers see the layout of
docs/protocol.md (a key's pointer and the places it may name), and checks the protocol's invariants against the
ledger; ``simulation`` drives seeded schedules of attempts, faults and reconciliation over the real ledger and
destinations; ``forkserver`` starts a process that imports the export code once and forks one fresh child per
attempt; ``fixtures`` shares that process between test modules.
"""
