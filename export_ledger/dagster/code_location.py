"""A code location named the way Dagster's CLI names one (``-f FILE`` or ``-m MODULE``, optionally ``-a ATTRIBUTE``):
its Definitions, the exports they declare and the destinations they publish to.

``export-ledger`` imports this only when it is given ``-f`` or ``-m``, so its other commands never load Dagster.

Example:
    >>> location = load_code_location(python_file="definitions.py")  # doctest: +SKIP
    >>> [spec.name for spec in location.specs]  # doctest: +SKIP
    ['invoice_export']
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import dagster as dg

from export_ledger.dagster.definitions import declared_exports
from export_ledger.dagster.resources import SourceResource, built_spec, resource_keys, source_key
from export_ledger.errors import ConfigurationError
from export_ledger.operations import CodeLocation


def load_code_location(
    *, python_file: str | None = None, module_name: str | None = None, attribute: str | None = None
) -> CodeLocation:
    """Imports the code location, finds its Definitions and returns its declared exports and destinations.

    As ``dagster asset materialize`` does, the working directory is importable (a definitions.py that imports
    ``assets.invoices`` loads from its project folder), and so is the file's own folder.

    Raises:
        ConfigurationError: the file or module cannot be imported, holds no Definitions (or several, without
            ``attribute``), or its Definitions declare no ledgered export.
    """
    if (python_file is None) == (module_name is None):
        raise ValueError("name the code location with exactly one of python_file and module_name")
    named = f"-f {python_file}" if python_file is not None else f"-m {module_name}"
    module = _import(python_file, module_name, named)
    defs = _definitions(module, attribute, named)
    try:
        specs = _with_sources(defs, declared_exports(defs))
    except ConfigurationError as exc:
        raise ConfigurationError(f"{named}: {exc}") from None
    return CodeLocation(
        dagster_args=_args(python_file, module_name, attribute),
        specs=specs,
        destinations=_destinations(defs, specs),
        ledger_url=_ledger_url(defs),
    )


def load_workspace_location(workspace: str) -> CodeLocation:
    """The code location of a ``workspace.yaml`` that declares one (``python_file`` or ``python_module``), loaded as
    :func:`load_code_location` loads it; the printed ``dagster`` commands repeat ``-w workspace``.

    Raises:
        ConfigurationError: the file cannot be read, or declares no location or several (name one with -f or -m).
    """
    import yaml  # Dagster's own dependency

    path = Path(workspace).expanduser()
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigurationError(f"-w {workspace}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError:
        raise ConfigurationError(f"-w {workspace}: not valid YAML") from None
    entries = (loaded or {}).get("load_from") if isinstance(loaded, dict) else None
    found = [e for e in entries or [] if isinstance(e, dict) and ({"python_file", "python_module"} & set(e))]
    if len(found) != 1:
        raise ConfigurationError(
            f"-w {workspace}: declares {len(found)} python_file or python_module locations; export-ledger reads one "
            "(name it with -f FILE or -m MODULE)"
        )
    kind, entry = next(iter(found[0].items()))
    entry = {"relative_path": entry} if isinstance(entry, str) and kind == "python_file" else entry
    entry = {"module_name": entry} if isinstance(entry, str) else entry
    folder = path.resolve().parent
    working = entry.get("working_directory")
    if working:
        os.chdir(folder / working)  # as Dagster runs the code location: its imports and relative paths are from there
    if kind == "python_file":
        location = load_code_location(
            python_file=str(folder / entry["relative_path"]), attribute=entry.get("attribute")
        )
    else:
        location = load_code_location(module_name=entry["module_name"], attribute=entry.get("attribute"))
    return dataclasses.replace(location, dagster_args=("-w", workspace))


def _ledger_url(defs: dg.Definitions) -> str | None:
    """The URL of the code location's ``ledger`` resource, resolved as a run resolves it (an ``EnvVar`` read now);
    None when it has no such resource."""
    from export_ledger.dagster.resources import LedgerResource

    resource = (defs.resources or {}).get("ledger")
    if not isinstance(resource, LedgerResource):
        return None
    with dg.build_resources({"ledger": resource}) as built:
        return built.ledger.url


def _with_sources(defs: dg.Definitions, specs) -> tuple:
    """The exports with each source declared as a resource resolved as a run resolves it (an ``EnvVar`` read now):
    the CLI reads what a run of this location reads, or names the setting it lacks here
    (:class:`~export_ledger.sources.UnusableSource`)."""
    return tuple(_with_source(defs, spec) if isinstance(spec.source, SourceResource) else spec for spec in specs)


def _with_source(defs: dg.Definitions, spec):
    return built_spec(spec, (defs.resources or {}).get(source_key(spec)))


def _args(python_file: str | None, module_name: str | None, attribute: str | None) -> tuple[str, ...]:
    """The options as the operator gave them: the printed ``dagster`` commands repeat them exactly."""
    named = ("-f", python_file) if python_file is not None else ("-m", module_name)
    return (*named, "-a", attribute) if attribute is not None else named


def _import(python_file: str | None, module_name: str | None, named: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        if module_name is not None:
            return importlib.import_module(module_name)
        path = Path(python_file).expanduser().resolve()
        if not path.is_file():
            raise ConfigurationError(f"{named}: no such file ({path})")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # as an import would: the module's own dataclasses and pickles need it
        spec.loader.exec_module(module)
        return module
    except ConfigurationError:
        raise
    except Exception as exc:  # the user's code failed to import: say which, and how
        raise ConfigurationError(f"{named}: cannot import it: {type(exc).__name__}: {exc}") from None


def _definitions(module: ModuleType, attribute: str | None, named: str) -> dg.Definitions:
    if attribute is not None:
        if not hasattr(module, attribute):
            raise ConfigurationError(f"{named} has no attribute {attribute!r} (-a names its Definitions)")
        value = getattr(module, attribute)
        if not isinstance(value, dg.Definitions):
            raise ConfigurationError(f"{named} -a {attribute}: a {type(value).__name__}, not a dagster Definitions")
        return value
    found = sorted(name for name, value in vars(module).items() if isinstance(value, dg.Definitions))
    if len(found) != 1:
        what = f"{len(found)} Definitions ({', '.join(found)})" if found else "no Definitions"
        raise ConfigurationError(f"{named} holds {what}: name the one to use with -a ATTRIBUTE")
    return getattr(module, found[0])


def _destinations(defs: dg.Definitions, specs) -> dict:
    """Each export's destination as the code location configured it: its destination resource, resolved (an
    ``EnvVar`` read now, as a run would)."""
    keys = {spec.name: resource_keys(spec)[0] for spec in specs}
    resources = {key: defs.resources[key] for key in keys.values() if key in (defs.resources or {})}
    with dg.build_resources(resources) as built:
        return {name: getattr(built, key).get_destination() for name, key in keys.items() if key in resources}
