"""The layers of the architecture hold in substance, not only by convention.

- ``lint-imports`` (import-linter, contracts in pyproject.toml) keeps the layers; CI runs it too.
- No package imports another package's private (``_underscore``) names: a helper two packages need
  moves down a layer and becomes public.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_memopt"


def _private_cross_package_imports() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = relative.parts
        own_package = ".".join(parts[:2])  # lit_memopt.<package>
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module or not node.module.startswith("lit_memopt."):
                continue
            target_package = ".".join(node.module.split(".")[:2])
            if target_package == own_package or node.module.split(".")[1].startswith("_"):
                continue  # its own package, or a private module or package of the root (shared by all: _lazy, _compat)
            for alias in node.names:
                private_module = any(p.startswith("_") and not p.startswith("__") for p in node.module.split(".")[1:])
                if alias.name.startswith("_") or private_module:
                    problems.append(f"{relative}.py:{node.lineno} imports {alias.name} from {node.module}")
    return problems


def test_no_private_names_are_imported_across_packages() -> None:
    assert _private_cross_package_imports() == []


@pytest.mark.skipif(shutil.which("lint-imports") is None and not Path(sys.executable).with_name("lint-imports").exists(),
                    reason="import-linter is installed by the test extra")
def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    result = subprocess.run([exe], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
