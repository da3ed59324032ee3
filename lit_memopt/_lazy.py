"""Lazy attribute exports for the package's ``__init__`` files (PEP 562).

Importing ``lit_memopt.callbacks`` must not import transformers or every callback, and each
submodule can be written independently of the ``__init__`` that re-exports it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` that import ``exports[name]`` (a submodule path) on first use."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(exports[name], package)
        return getattr(module, name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
