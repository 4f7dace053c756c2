"""From a destination spec (``EXPORTS_DESTINATION``, ``ExportSpec.destination``) to a destination, through the schemes
each destination module declares: a new store is one file under ``export_ledger/destinations/`` with a ``SCHEME``.

A module declares ``SCHEME = Scheme(...)``: the spec's prefix (``s3://``; ``""`` for a plain folder path), its
destination class (which builds itself with ``from_spec`` and checks a spec with ``check_spec``), the Dagster pool kind
its exports run in, and the credential settings it takes (passed as Dagster ``EnvVar`` s, never values).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass

from export_ledger.errors import ConfigurationError

#: Spec prefixes that look like a URL: a folder path never starts with one.
_URL_SCHEMES = ("s3", "gs", "az", "abfs", "ftp", "http", "https", "delta", "file")


@dataclass(frozen=True)
class Scheme:
    """One kind of destination, as its module declares it.

    Attributes:
        prefix: What a spec of this kind starts with (``""``: a local folder path, the default).
        destination: The destination class's name in the declaring module.
        example: A spec of this kind, for messages.
        credentials: The credential settings the destination takes (names of ``DestinationResource`` fields).
    """

    prefix: str
    destination: str
    example: str
    credentials: tuple[str, ...] = ()
    module: str = ""

    def load(self):
        return getattr(importlib.import_module(self.module), self.destination)


@functools.cache
def schemes() -> tuple[Scheme, ...]:
    """Every scheme the destination modules declare, the longest prefix first (the folder path last)."""
    import export_ledger.destinations as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        scheme = getattr(module, "SCHEME", None)
        if isinstance(scheme, Scheme):
            found.append(Scheme(scheme.prefix, scheme.destination, scheme.example, scheme.credentials, module.__name__))
    return tuple(sorted(found, key=lambda s: -len(s.prefix)))


def scheme_of(spec: str) -> Scheme:
    for scheme in schemes():
        if spec.startswith(scheme.prefix):
            return scheme
    raise ConfigurationError(f"no destination takes {spec!r}")  # the folder path (prefix "") takes everything


def kinds() -> str:
    """The kinds of spec, for messages: ``a folder path, s3://bucket/prefix or ledger-table:<table>``."""
    examples = [s.example for s in schemes()]
    return ", ".join(examples[:-1]) + f" or {examples[-1]}" if len(examples) > 1 else examples[0]


def destination_from(
    spec: str,
    *,
    ledger_url: str,
    credentials: Mapping[str, object] | None = None,
    what: str = "destination",
):
    """Builds a destination from its spec.

    Args:
        spec: The spec.
        ledger_url: The ledger's URL (a ``ledger-table:`` destination lives in the ledger's database).
        credentials: Settings for the destination's kind (for S3: ``endpoint_url``, ``region_name``,
            ``access_key_id``, ...); None values are left to the destination's own lookup.
        what: The setting's name in error messages.

    Raises:
        ConfigurationError: naming the setting and what is wrong with it.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError(f"{what} must be {kinds()}")
    scheme = scheme_of(spec)
    if not scheme.prefix and ("://" in spec or spec.split(":", 1)[0] in _URL_SCHEMES):
        raise ConfigurationError(f"{what} scheme {spec.split(':', 1)[0]!r} is not supported; use {kinds()}")
    cls = scheme.load()
    problem = cls.check_spec(spec)
    if problem:
        raise ConfigurationError(f"{what} {spec!r}: {problem}")
    given = {k: v for k, v in (credentials or {}).items() if v is not None and k in scheme.credentials}
    return cls.from_spec(spec, ledger_url=ledger_url, credentials=given)
