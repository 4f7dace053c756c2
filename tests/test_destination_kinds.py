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
from pathlib import Path

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


def every_kind() -> list[type[Destination]]:
    """Every concrete destination class the destinations package defines (its modules imported, no registry)."""
    for info in pkgutil.iter_modules(destinations.__path__):
        importlib.import_module(f"{destinations.__name__}.{info.name}")
    found, todo = [], [Destination]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith(destinations.__name__) and not sub.__abstractmethods__:
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


def test_the_publishing_kinds_are_the_object_store_template_and_delta() -> None:
    names = [kind.__name__ for kind in PUBLISHED_KINDS]
    assert names == ["AzureDestination", "DeltaDestination", "GCSDestination", "LocalDestination", "S3Destination"]
    assert [kind.__name__ for kind in every_kind() if issubclass(kind, TransactionalDestination)] == [
        "SqlTableDestination"
    ]


#: The publishing kinds, named rather than found: a kind that leaves a step unwritten is abstract, and would drop out
#: of :func:`every_kind`.
PUBLISHING_KINDS = (LocalDestination, S3Destination, GCSDestination, AzureDestination, DeltaDestination)


@pytest.mark.parametrize("kind", PUBLISHING_KINDS, ids=lambda kind: kind.__name__)
def test_every_publishing_kind_writes_every_step_of_the_contract(kind: type[PointerDestination]) -> None:
    assert issubclass(kind, PointerDestination), f"{kind.__name__} is a publishing kind"
    assert not kind.__abstractmethods__, f"{kind.__name__} leaves {sorted(kind.__abstractmethods__)} unwritten"


def test_delta_is_a_publishing_kind_of_its_own_not_the_object_store_template(tmp_path: Path) -> None:
    """Delta publishes over its table's log: it is no object store, and inherits only what the contract writes once
    over its steps and what every destination shares; an operator's discard is refused naming the way out."""
    assert DeltaDestination.__mro__[1:] == PointerDestination.__mro__, "Delta derives from the contract only"
    assert not issubclass(DeltaDestination, PublishingDestination)
    assert "store" not in dir(DeltaDestination), "a Delta table is not an object store"
    delta = DeltaDestination(table=str(tmp_path / "{export}"))
    target = ExportTarget("invoice_export", "acme", "2026-03-08", 2, "r2-t2")
    with pytest.raises(DestinationError, match=r"not discarded by export-ledger; restore the table"):
        delta.discard_key(target, 3, logical_key="invoice_export/acme/2026-03-08T05:00:00Z", recorded=None)
    assert not (tmp_path / "invoice_export").exists(), "refused before anything is read or written"


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


def documented_bases() -> dict[type, tuple[list[str], ...]]:
    """docs/destinations.md's table of the kinds: for each base, the names (and the number stated) of its abstract
    methods, of what it writes, and of its optional hooks."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = line.split("|")[1:-1]
        if len(cells) != 6 or not cells[0].strip().startswith("`"):
            continue
        base = next(b for b in BASES if cells[0].strip().startswith(f"`{b.__name__}`"))
        rows[base] = tuple(
            (int(re.match(r"\s*(\d+)", cell).group(1)), re.findall(r"`(\w+)`", cell)) for cell in cells[2:5]
        )
    return rows


_DESCRIBED = (property, staticmethod)


def methods(cls: type) -> set[str]:
    """The public methods (and properties) of ``cls``, its own and inherited."""
    found = {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}
    return {name for name, value in found.items() if inspect.isfunction(value) or isinstance(value, _DESCRIBED)}


def test_the_docs_say_each_bases_true_numbers_of_abstract_methods_and_hooks() -> None:
    """Each row names the base's abstract methods exactly, what it writes itself, and its optional hooks; with what
    its ancestors write, that is every public method of it, each once. Every number stated is the names' count."""
    rows = documented_bases()
    assert set(rows) == set(BASES), "docs/destinations.md has a row for each base"
    for base, ((abstract_count, abstract), (written_count, written), (hooks_count, hooks)) in rows.items():
        where = f"docs/destinations.md, {base.__name__}"
        assert set(abstract) == base.__abstractmethods__ and abstract_count == len(abstract), f"{where}: abstract"
        assert (written_count, hooks_count) == (len(written), len(hooks)), f"{where}: the numbers stated"
        concrete = methods(base) - base.__abstractmethods__
        assert set(written) <= concrete & set(vars(base)), f"{where}: what it writes is written in it"
        assert set(hooks) <= concrete, f"{where}: a hook has a default"
        inherited = {name for b in base.__mro__[1:] if b in rows for name in rows[b][1][1]}
        named = [*abstract, *written, *hooks, *inherited]
        assert sorted(named) == sorted(methods(base)), f"{where}: every public method named once"
