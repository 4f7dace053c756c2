"""Harnesses for issue #5: crash-anywhere, export races, fencing, bad input and secrets (pytest-free helpers).

``protocol`` runs one export attempt from a JSON-able spec and surveys what a reader can see at a destination;
``forkserver`` starts a process that imports the export code once and forks one fresh child per attempt;
``fixtures`` shares that process between test modules.
"""
