"""pandas, numpy and pyarrow, imported where they are first used rather than when a module of this package is.

A code location's process only loads its definitions: ``dagster asset materialize`` and ``dagster dev`` build the
assets, resources and sensors and read none of the export's data, so they need none of these libraries (about half a
second of imports, dagster itself needs none of them). A module of this package that works on frames names them as
usual (``pd.DataFrame``, ``pa.Table``) through a :func:`lazy_module` placeholder, which imports the library on its
first attribute access and then puts the real module in its place, so later uses cost nothing extra.
"""

from __future__ import annotations

import importlib
from collections.abc import MutableMapping
from typing import Any


class LazyModule:
    """Stands for a module (``name``) under ``alias`` in ``namespace`` (a module's globals) until its first use."""

    __slots__ = ("_alias", "_name", "_namespace")

    def __init__(self, name: str, namespace: MutableMapping[str, Any], alias: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_namespace", namespace)
        object.__setattr__(self, "_alias", alias)

    def __getattr__(self, attribute: str) -> Any:
        module = importlib.import_module(self._name)
        if self._namespace.get(self._alias) is self:
            self._namespace[self._alias] = module  # later uses of the name find the module itself
        return getattr(module, attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:
        raise AttributeError(f"{self._name} is not imported yet: set {attribute} on the module itself")

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_module(name: str, namespace: MutableMapping[str, Any], alias: str) -> Any:
    """A placeholder for module ``name``, bound as ``alias`` in ``namespace``: ``pd = lazy_module("pandas",
    globals(), "pd")`` imports pandas at the first ``pd.<attribute>``, not when the module defining ``pd`` is."""
    return LazyModule(name, namespace, alias)
