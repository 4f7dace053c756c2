"""The test suite's own shape (issue 29): what tests share lives in support modules (``builders.py``, ``conftest.py``
and the like), never in a test module another one imports, so a test module can be moved or renamed alone."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_test_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        found += [name for name in names if name.rpartition(".")[2].startswith("test_")]
    return found


def test_no_test_module_imports_another_test_module():
    importing = {
        str(path.relative_to(TESTS)): modules
        for path in sorted(TESTS.rglob("*.py"))
        if (modules := _imported_test_modules(path))
    }
    assert importing == {}


def test_the_import_check_sees_both_spellings(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("from tests.test_a import A\nimport test_b\nfrom builders import key_for\n")
    assert _imported_test_modules(module) == ["tests.test_a", "test_b"]
