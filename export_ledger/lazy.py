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

from export_ledger.errors import ConfigurationError

#: The libraries this package imports on first use: each is a declared dependency of export-ledger.
FRAME_LIBRARIES = ("pandas", "numpy", "pyarrow")


def _missing(name: str) -> ConfigurationError:
    return ConfigurationError(
        f"export-ledger needs {name} (a declared dependency), which this Python cannot import: install export-ledger "
        "with its dependencies into this environment"
    )


class LazyModule:
    """Stands for a module (``name``) under ``alias`` in ``namespace`` (a module's globals) until its first use."""

    __slots__ = ("_alias", "_name", "_namespace")

    def __init__(self, name: str, namespace: MutableMapping[str, Any], alias: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_namespace", namespace)
        object.__setattr__(self, "_alias", alias)

    def _module(self) -> Any:
        try:
            module = importlib.import_module(self._name)
        except ModuleNotFoundError as exc:
            # A ConfigurationError's text is shown where a library's is withheld: the missing module is named.
            raise _missing(exc.name or self._name) from None
        if self._namespace.get(self._alias) is self:
            self._namespace[self._alias] = module  # later uses of the name find the module itself
        return module

    def __getattr__(self, attribute: str) -> Any:
        if attribute in LazyModule.__slots__:  # a copy or unpickle asks before the slots are set: never recurse
            raise AttributeError(attribute)
        return getattr(self._module(), attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:
        if attribute in LazyModule.__slots__:  # a copy or unpickle restoring the placeholder's own state
            object.__setattr__(self, attribute, value)
            return
        setattr(self._module(), attribute, value)  # a patch in a test sets the module's attribute, as on the module

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def require_frame_libraries() -> None:
    """Refuses, naming it, a process that cannot import one of :data:`FRAME_LIBRARIES`: found, not imported (a few
    hundred microseconds), so a code location without them fails when it loads rather than in each run's keys.

    Raises:
        ConfigurationError: one of them cannot be found.
    """
    import importlib.util

    for name in FRAME_LIBRARIES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module without a spec, or one a finder refuses
            found = False
        if not found:
            raise _missing(name)


def lazy_module(name: str, namespace: MutableMapping[str, Any], alias: str) -> Any:
    """A placeholder for module ``name``, bound as ``alias`` in ``namespace``: ``pd = lazy_module("pandas",
    globals(), "pd")`` imports pandas at the first ``pd.<attribute>``, not when the module defining ``pd`` is."""
    return LazyModule(name, namespace, alias)
