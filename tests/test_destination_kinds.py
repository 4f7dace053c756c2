"""The kinds of destination and what each is asked (docs/destinations.md, "The kinds").

A destination whose exports are published behind a pointer implements
:class:`~export_ledger.destinations.PointerDestination`: the object-store template
(:class:`~export_ledger.destinations.PublishingDestination`: the local folder, S3, GCS, Azure) and Delta, each on its
own. These tests hold the contract to what the protocol asks of such a destination, every publishing kind to every
step of it, and the callers to never asking a destination which kind it is.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from abc import ABC
from pathlib import Path
from typing import NamedTuple

import pytest

import export_ledger.destinations as destinations
from export_ledger.destinations import (
    Destination,
    DestinationError,
    ExportTarget,
    PointerDestination,
    PublishingDestination,
    TransactionalDestination,
)
from export_ledger.destinations.azure import AzureDestination
from export_ledger.destinations.delta import DeltaDestination
from export_ledger.destinations.gcs import GCSDestination
from export_ledger.destinations.local import LocalDestination
from export_ledger.destinations.s3 import S3Destination
from export_ledger.destinations.sftp import SftpDestination
from export_ledger.destinations.warehouse import WarehouseDestination
from export_ledger.steps import PUBLISHING_STEPS

PACKAGE = Path(destinations.__file__).parents[1]
DOCS = PACKAGE.parent / "docs" / "destinations.md"
#: The modules that ask a destination something, by the name they hold it under (``destination``).
CALLERS = ("steps.py", "stage.py", "protocol.py", "reconcile.py", "resolve.py", "restate.py", "drift.py")


def asked(*modules: str) -> set[str]:
    """Every attribute the modules read on ``destination`` or ``self.destination``."""
    names = set()
    for module in modules:
        for node in ast.walk(ast.parse((PACKAGE / module).read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            held = node.value
            if (isinstance(held, ast.Name) and held.id == "destination") or (
                isinstance(held, ast.Attribute) and held.attr == "destination"
            ):
                names.add(node.attr)
    return names


def _shipped(kind: type) -> bool:
    """Whether a class comes from a module file of the package itself: a test's throwaway store (a module dropped on
    the package's path, then removed) stays among ``Destination``'s subclasses for the rest of the process."""
    module = sys.modules.get(kind.__module__)
    package = Path(destinations.__file__).parent
    return module is not None and Path(getattr(module, "__file__", "") or "/").parent == package


def every_kind() -> list[type[Destination]]:
    """Every concrete destination class the destinations package defines (its modules imported, no registry)."""
    for info in pkgutil.iter_modules(destinations.__path__):
        importlib.import_module(f"{destinations.__name__}.{info.name}")
    found, todo = [], [Destination]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if _shipped(sub) and not sub.__abstractmethods__:
                found.append(sub)
    return sorted(set(found), key=lambda kind: kind.__name__)


PUBLISHED_KINDS = [kind for kind in every_kind() if issubclass(kind, PointerDestination)]


def test_the_published_kinds_contract_is_what_the_protocol_asks_of_it() -> None:
    """The abstract methods of :class:`PointerDestination` are the protocol's steps on one key, and what every
    destination answers (less the current revision, written once over the pointer); every one is asked by a caller,
    and a caller asks a published kind nothing the contract does not declare."""
    contract = PointerDestination.__abstractmethods__
    answered_by_all = Destination.__abstractmethods__ - {"current_revision"}
    assert contract == set(PUBLISHING_STEPS) | answered_by_all, "the steps, and what every destination answers"
    assert set(PUBLISHING_STEPS) <= asked("steps.py", "stage.py"), "each step is one the protocol takes on a key"
    every_ask = asked(*CALLERS)
    assert contract <= every_ask, f"abstract, never asked: {sorted(contract - every_ask)}"
    undeclared = every_ask - {"write_in_transaction"} - set(dir(PointerDestination))  # the other kind's one step
    assert undeclared == set(), "a caller asks a published kind only what its contract declares"


def test_the_publishing_kinds_are_the_object_store_template_delta_and_the_warehouse() -> None:
    names = [kind.__name__ for kind in PUBLISHED_KINDS]
    assert names == [
        "AzureDestination", "DeltaDestination", "GCSDestination", "LocalDestination", "S3Destination",
        "SftpDestination", "WarehouseDestination",
    ]  # fmt: skip
    assert [kind.__name__ for kind in every_kind() if issubclass(kind, TransactionalDestination)] == [
        "SqlTableDestination"
    ]


#: The publishing kinds, named rather than found: a kind that leaves a step unwritten is abstract, and would drop out
#: of :func:`every_kind`.
PUBLISHING_KINDS = (
    LocalDestination, S3Destination, GCSDestination, AzureDestination, SftpDestination, DeltaDestination,
    WarehouseDestination,
)  # fmt: skip


@pytest.mark.parametrize("kind", PUBLISHING_KINDS, ids=lambda kind: kind.__name__)
def test_every_publishing_kind_writes_every_step_of_the_contract(kind: type[PointerDestination]) -> None:
    assert issubclass(kind, PointerDestination), f"{kind.__name__} is a publishing kind"
    assert not kind.__abstractmethods__, f"{kind.__name__} leaves {sorted(kind.__abstractmethods__)} unwritten"


def test_delta_is_a_publishing_kind_of_its_own_not_the_object_store_template(tmp_path: Path) -> None:
    """Delta publishes over its table's log: it is no object store, and inherits only what the contract writes once
    over its steps and what every destination shares; its discard_key refuses, naming the way out, before reading or
    writing the table (called through resolve_key, the operator's hold has fenced the key first: a commit)."""
    assert DeltaDestination.__mro__[1:] == PointerDestination.__mro__, "Delta derives from the contract only"
    assert not issubclass(DeltaDestination, PublishingDestination)
    assert "store" not in dir(DeltaDestination), "a Delta table is not an object store"
    delta = DeltaDestination(table=str(tmp_path / "{export}"))
    target = ExportTarget("invoice_export", "acme", "2026-03-08", 2, "r2-t2")
    with pytest.raises(DestinationError, match=r"not discarded by export-ledger; restore the table"):
        delta.discard_key(target, 3, logical_key="invoice_export/acme/2026-03-08T05:00:00Z", recorded=None)
    assert not (tmp_path / "invoice_export").exists(), "discard_key alone neither reads nor writes the table"


#: The calls that would ask an object which class it is.
_KIND_CHECKS = {"isinstance", "issubclass"}
#: The calls that would ask an object whether it has a member only one kind has: the object-store template's store.
_MEMBER_CHECKS = {"hasattr", "getattr"}


def _named(node: ast.expr) -> list[str]:
    """The names ``node`` gives: a class (``Kind``, ``module.Kind``), a string (``"Kind"``), or a collection of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for element in node.elts for name in _named(element)]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    return [node.id] if isinstance(node, ast.Name) else []


def _type_of(node: ast.expr) -> bool:
    """``type(x)``, or its name: ``type(x).__name__``, ``type(x).__qualname__``."""
    if isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__"):
        node = node.value
    return isinstance(node, ast.Call) and _named(node.func) == ["type"] and len(node.args) == 1


def kind_checks(tree: ast.AST, kinds: set[str]) -> list[tuple[int, list[str]]]:
    """Where ``tree`` asks an object which of ``kinds`` it is: ``isinstance``/``issubclass`` against one,
    ``type(x) is``/``==``/``in`` one (or its name), or ``hasattr``/``getattr`` of ``store``, the template's own
    member. Each as its line and the kinds (or member) it names."""
    found = []
    for node in ast.walk(tree):
        checked = []
        if isinstance(node, ast.Call) and _named(node.func)[:1] and _named(node.func)[0] in _KIND_CHECKS:
            checked = [name for arg in node.args[1:] for name in _named(arg) if name in kinds]
        elif isinstance(node, ast.Call) and _named(node.func)[:1] and _named(node.func)[0] in _MEMBER_CHECKS:
            checked = [name for name in _named(node.args[1]) if name == "store"] if len(node.args) > 1 else []
        elif isinstance(node, ast.Compare) and any(_type_of(side) for side in (node.left, *node.comparators)):
            checked = [name for side in (node.left, *node.comparators) for name in _named(side) if name in kinds]
        if checked:
            found.append((node.lineno, checked))
    return found


def test_no_module_outside_the_destinations_asks_a_destination_which_kind_it_is() -> None:
    """Callers ask ``takes_effect`` and the contract's methods, never the class: ``isinstance(x, Destination)`` (is it
    a destination at all) is fine; ``isinstance``/``issubclass`` against any kind of it, ``type(x) is`` or ``==`` a
    kind (or its name), and ``hasattr(x, "store")`` (is it the object-store template) are not."""
    kinds = {cls.__name__ for cls in every_kind()} | {
        PointerDestination.__name__, PublishingDestination.__name__, TransactionalDestination.__name__,
    }  # fmt: skip
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "destinations") in path.parents:
            continue
        for line, checked in kind_checks(ast.parse(path.read_text()), kinds):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line} {', '.join(checked)}")
    assert found == [], "the protocol asks takes_effect, never a destination's kind"


def test_the_kind_check_finds_each_way_of_asking_which_kind() -> None:
    """What the test above looks for, shown on each form it must see, and on the questions it must let pass."""
    asking = """
isinstance(d, LocalDestination)
issubclass(type(d), (S3Destination, PointerDestination))
type(d) is DeltaDestination
type(d) == GCSDestination
type(d) is not AzureDestination
type(d) in (LocalDestination, S3Destination)
type(d).__name__ == "SqlTableDestination"
hasattr(d, "store")
getattr(d, "store", None)
"""
    kinds = {"LocalDestination", "S3Destination", "PointerDestination", "DeltaDestination", "GCSDestination",
             "AzureDestination", "SqlTableDestination"}  # fmt: skip
    assert [line for line, _ in kind_checks(ast.parse(asking), kinds)] == list(range(2, 11))
    allowed = """
isinstance(d, Destination)
type(d).__name__
type(value).__name__ == "Definitions"
hasattr(own, "spec")
d.takes_effect == "published"
"""
    assert kind_checks(ast.parse(allowed), kinds) == [], "asking for a destination, or its takes_effect, is fine"


BASES = (Destination, PointerDestination, PublishingDestination, TransactionalDestination)


class Row(NamedTuple):
    """A row of docs/destinations.md's table of the kinds, as the names (and numbers) it states."""

    heading: list[str]  # the base, its module, its takes_effect
    derives_from: list[str]
    abstract: tuple[int, list[str]]
    written: tuple[int, list[str]]
    hooks: tuple[int, list[str]]
    kinds: list[str]


def documented_bases() -> dict[type, Row]:
    """docs/destinations.md's table of the kinds, by base."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = line.split("|")[1:-1]
        if len(cells) != 6 or not cells[0].strip().startswith("`"):
            continue
        base = next(b for b in BASES if cells[0].strip().startswith(f"`{b.__name__}`"))
        counted = [(int(re.match(r"\s*(\d+)", cell).group(1)), re.findall(r"`(\w+)`", cell)) for cell in cells[2:5]]
        named = [re.findall(r"`([^`]+)`", cell) for cell in (cells[0], cells[1], cells[5])]
        rows[base] = Row(named[0], named[1], *counted, named[2])
    return rows


_DESCRIBED = (property, staticmethod)


def _method(value: object) -> bool:
    return inspect.isfunction(value) or isinstance(value, _DESCRIBED)


def methods(cls: type) -> set[str]:
    """The public methods (and properties) of ``cls``, its own and inherited."""
    return {name for name in dir(cls) if not name.startswith("_") and _method(inspect.getattr_static(cls, name))}


def own_methods(cls: type) -> set[str]:
    """The public methods (and properties) defined in ``cls`` itself, abstract ones excepted."""
    return {
        name for name, value in vars(cls).items()
        if not name.startswith("_") and _method(value) and name not in cls.__abstractmethods__
    }  # fmt: skip


def test_the_docs_say_each_bases_true_numbers_of_abstract_methods_and_hooks() -> None:
    """Each row names the base's abstract methods exactly, what it writes itself, and its optional hooks; with what
    its ancestors write, that is every public method of it, each once. Every number stated is the names' count."""
    rows = documented_bases()
    assert set(rows) == set(BASES), "docs/destinations.md has a row for each base"
    for base, row in rows.items():
        (abstract_count, abstract), (written_count, written), (hooks_count, hooks) = row[2:5]
        where = f"docs/destinations.md, {base.__name__}"
        assert set(abstract) == base.__abstractmethods__ and abstract_count == len(abstract), f"{where}: abstract"
        assert (written_count, hooks_count) == (len(written), len(hooks)), f"{where}: the numbers stated"
        concrete = methods(base) - base.__abstractmethods__
        assert set(hooks) <= concrete, f"{where}: a hook has a default"
        inherited = {name for b in base.__mro__[1:] if b in rows for name in rows[b].written[1]}
        named = [*abstract, *written, *hooks, *inherited]
        assert sorted(named) == sorted(methods(base)), f"{where}: every public method named once"


def test_the_docs_say_what_each_base_writes_derives_from_and_is_derived_by() -> None:
    """The other columns of each row: its module and the ``takes_effect`` it sets; what it writes is every public
    method defined in the base itself, less the hooks it introduces (a hook it replaces is written here); what it
    derives from is its ``__bases__``; and its kinds are the concrete destinations whose nearest base in the table it
    is."""
    rows = documented_bases()
    for base, row in rows.items():
        where = f"docs/destinations.md, {base.__name__}"
        said = vars(base).get("takes_effect", ...)  # stated where the base sets it
        effect = [] if said is ... else ["None" if said is None else f'"{said}"']
        heading = [base.__name__, Path(inspect.getfile(base)).name, *effect]
        assert row.heading == heading, f"{where}: its module, and the takes_effect it sets"
        own, hooks = own_methods(base), set(row.hooks[1])
        replaced = {name for name in own if any(name in vars(ancestor) for ancestor in base.__mro__[1:])}
        assert hooks.isdisjoint(replaced), f"{where}: a hook it replaces is written here: {sorted(hooks & replaced)}"
        assert set(row.written[1]) == own - hooks, f"{where}: written here is what is defined here"
        assert row.derives_from == [b.__name__ for b in base.__bases__ if b is not ABC], f"{where}: derives from"
        nearest = {kind.__name__ for kind in every_kind() if next(b for b in kind.__mro__ if b in rows) is base}
        assert set(row.kinds) == nearest, f"{where}: its kinds"
