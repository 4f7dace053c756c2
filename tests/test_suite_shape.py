"""The test suite's own shape (issue 29): what tests share lives in support modules (``builders.py``, ``conftest.py``
and the like), never in a test module another one imports, so a test module can be moved or renamed alone; and the
long searches' sizes come from one place (``depth.py``); and ruff's lint holds on the whole tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from depth import sized

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


def test_the_long_searches_run_at_ci_depth_unless_told_full_and_a_bad_setting_names_its_variable(monkeypatch):
    monkeypatch.delenv("EXPORTS_TEST_DEPTH", raising=False)
    monkeypatch.delenv("EXPORTS_X_TRIALS", raising=False)
    monkeypatch.delenv("EXPORTS_X_ALL", raising=False)
    assert sized("EXPORTS_X_TRIALS", ci=5, full=50) == 5
    monkeypatch.setenv("EXPORTS_TEST_DEPTH", "full")
    assert sized("EXPORTS_X_TRIALS", ci=5, full=50) == 50
    monkeypatch.setenv("EXPORTS_X_ALL", "7")
    assert sized("EXPORTS_X_TRIALS", ci=5, full=50, fallback="EXPORTS_X_ALL") == 7
    monkeypatch.setenv("EXPORTS_X_TRIALS", "3")
    assert sized("EXPORTS_X_TRIALS", ci=5, full=50, fallback="EXPORTS_X_ALL") == 3
    monkeypatch.setenv("EXPORTS_X_TRIALS", "lots")
    with pytest.raises(ValueError, match=r"EXPORTS_X_TRIALS='lots': a positive whole number"):
        sized("EXPORTS_X_TRIALS", ci=5, full=50)
    monkeypatch.setenv("EXPORTS_X_TRIALS", "0")
    with pytest.raises(ValueError, match="EXPORTS_X_TRIALS='0'"):
        sized("EXPORTS_X_TRIALS", ci=5, full=50)
    monkeypatch.delenv("EXPORTS_X_TRIALS")
    monkeypatch.setenv("EXPORTS_TEST_DEPTH", "deep")
    with pytest.raises(ValueError, match=r"EXPORTS_TEST_DEPTH='deep': use one of ci, full"):
        sized("EXPORTS_X_TRIALS", ci=5, full=50)


def test_ruff_finds_nothing_anywhere_in_the_tree():
    """pyproject's ``[tool.ruff]`` lint on every file, not only the ones a change touched: a finding fails here, where
    it was made, instead of accumulating until a review."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"ruff check found:\n{done.stdout[-4000:]}{done.stderr[-1000:]}"
