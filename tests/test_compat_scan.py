"""No module of the pack outside ``lit_memopt/_compat/`` uses a private torch or Lightning name: the sources are read
(``ast``) and each use is listed with the compat function to call instead. The tripwires of the names themselves are
in ``tests/test_compat.py``."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from lit_memopt import _compat

PACKAGE = Path(__file__).resolve().parents[1] / "lit_memopt"


def _registered() -> dict[str, tuple[str, str]]:
    """Every private name of the seam -> (compat module, the function or re-export that wraps it)."""
    seams = {name: importlib.import_module(f"lit_memopt._compat.{name}") for name in _compat.SUBMODULES}
    return {private: (module, wrapper) for module, seam in seams.items() for private, wrapper in seam.PRIVATE_NAMES.items()}


# ======================================================================================== no private name elsewhere
# Private uses allowed outside the seam for now, each with the compat function it is to move to (none today). The
# test fails when one listed is gone too, so the list only shrinks.
KNOWN_ELSEWHERE: dict[tuple[str, str], str] = {}
_EXTERNAL_ROOTS = {"torch", "lightning", "lightning_fabric", "lightning_utilities", "pytorch_lightning"}
# Underscored names of the standard library (os._exit, namedtuple's API) that the pack may use.
_STANDARD_LIBRARY = {"_exit", "_fields", "_asdict", "_replace", "_make"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _registered_attributes() -> dict[str, str]:
    """Each underscored segment of a registered private name -> ``module.wrapper`` to use instead."""
    found: dict[str, str] = {}
    for private, (module, wrapper) in _registered().items():
        for segment in private.replace("()", "").replace(" ", ".").split("."):
            if _private(segment):
                found.setdefault(segment, f"{module}.{wrapper}")
    return found


def _sources() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_compat" not in path.relative_to(PACKAGE).parts
    ]


def _own_private_names(sources: list[tuple[str, ast.Module]]) -> set[str]:
    """Underscored names the pack itself defines: functions, classes, attributes it assigns, names it binds."""
    own: set[str] = set()
    for _, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    return {name for name in own if _private(name)}


def _assigned_in(cls: ast.ClassDef) -> set[str]:
    names = {n.name for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    names |= {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    return names


def _external_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to torch/Lightning modules or objects by imports -> their dotted path."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _EXTERNAL_ROOTS:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _EXTERNAL_ROOTS:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _private_uses() -> dict[tuple[str, str], list[str]]:
    """``{(file, private name or module): ["file:line: what, use ..."]}`` for every private torch/Lightning use."""
    registered = _registered_attributes()
    exact = {private: f"{module}.{wrapper}" for private, (module, wrapper) in _registered().items()}
    sources = _sources()
    own = _own_private_names(sources) - set(registered)
    found: dict[tuple[str, str], list[str]] = {}

    def report(path: str, line: int, key: str, what: str, names: tuple[str, ...] = ()) -> None:
        hint = next((exact[name] for name in (*names, key) if name in exact), None)
        hint = hint or next((registered[part] for part in key.split(".") if part in registered), None)
        advice = f"use lit_memopt._compat.{hint}" if hint else "wrap it in lit_memopt/_compat/ (one function, a tripwire)"
        found.setdefault((path, key), []).append(f"{path}:{line}: {what}; {advice}")

    for path, tree in sources:
        aliases = _external_aliases(tree)
        enclosing: dict[ast.AST, ast.ClassDef] = {}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for child in ast.walk(cls):
                enclosing[child] = cls
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _EXTERNAL_ROOTS:
                private_module = next((p for p in node.module.split(".") if _private(p)), None)
                names = [a.name for a in node.names if _private(a.name)]
                if private_module or names:
                    key = node.module if private_module else names[0]
                    report(path, node.lineno, key, f"imports {names or [a.name for a in node.names]} from {node.module}",
                           tuple(f"{node.module}.{a.name}" for a in node.names))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in _EXTERNAL_ROOTS and any(_private(p) for p in alias.name.split(".")):
                        report(path, node.lineno, alias.name, f"imports {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                dotted = _dotted(node, aliases)
                if dotted is not None:  # torch._dynamo, torch.ops.mkldnn._x, lightning....: a private torch/Lightning path
                    report(path, node.lineno, dotted, f"reads {dotted}")
                    continue
                is_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                cls = enclosing.get(node)
                if is_self and cls is not None and node.attr in _assigned_in(cls):
                    continue  # the class's own attribute
                if node.attr in registered or (node.attr not in own and node.attr not in _STANDARD_LIBRARY):
                    report(path, node.lineno, node.attr, f"reads {ast.unparse(node)}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in registered:
                report(path, node.lineno, node.value, f"names {node.value!r} in a string")
    return found


def test_no_private_torch_or_lightning_name_outside_the_compat_seam() -> None:
    found = _private_uses()
    unexpected = sorted(line for key, lines in found.items() if key not in KNOWN_ELSEWHERE for line in lines)
    assert not unexpected, "private torch/Lightning names outside lit_memopt/_compat/:\n" + "\n".join(unexpected)
    gone = sorted(set(KNOWN_ELSEWHERE) - set(found))
    assert not gone, f"no longer used, remove from KNOWN_ELSEWHERE: {gone}"


def test_the_scan_finds_each_kind_of_private_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan above is only as good as what it catches: one of each kind, in a module of its own."""
    package = tmp_path / "lit_memopt"
    (package / "_compat").mkdir(parents=True)
    (package / "_compat" / "skipped.py").write_text("import torch\nx = torch._dynamo\n")
    (package / "probe.py").write_text(
        "import torch\n"
        "from torch.utils._pytree import tree_map\n"          # a private module
        "from torch.amp.grad_scaler import _refresh_per_optimizer_state\n"  # a private name
        "import torch.ops as ops\n"
        "class Tracker(object):\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"                            # its own: fine
        "    def peak(self, module, trainer):\n"
        "        self._mine, self._mod_tracker\n"             # a registered private of a torch base class
        "        self._inherited_unknown\n"                   # a private name the pack never defines
        "        getattr(module, '_trainer', None)\n"         # a registered name in a string
        "        trainer.fit_loop._should_accumulate()\n"     # a registered private of a Lightning object
        "        return torch._dynamo.config, ops.mkldnn._is_mkldnn_bf16_supported\n"  # private paths
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    found = {key for key in _private_uses()}
    assert found == {
        ("lit_memopt/probe.py", "torch.utils._pytree"),
        ("lit_memopt/probe.py", "_refresh_per_optimizer_state"),
        ("lit_memopt/probe.py", "_mod_tracker"),
        ("lit_memopt/probe.py", "_inherited_unknown"),
        ("lit_memopt/probe.py", "_trainer"),
        ("lit_memopt/probe.py", "_should_accumulate"),
        ("lit_memopt/probe.py", "torch._dynamo"),
        ("lit_memopt/probe.py", "torch.ops.mkldnn._is_mkldnn_bf16_supported"),
    }, found
