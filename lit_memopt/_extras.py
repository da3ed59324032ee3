"""The optional parts of lit-memopt and the one-line error that names the extra to install when one is missing.

The core install (``pip install lit-memopt``) is ``ops``, ``memory`` and ``callbacks``: torch and Lightning.
The recipes (CLI, modules, models, rewards, data), the sandbox and the plots are extras (pyproject.toml).
Only the standard library is imported here: every layer, and the verifier's worker process, may use it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import TracebackType

__all__ = ["EXTRAS", "MissingExtraError", "missing_packages", "extra_is_installed", "require_extra"]

# extra -> {distribution (as pyproject.toml lists it): the module it installs}. tests/test_core_install.py checks
# this table against pyproject.toml's [project.optional-dependencies]. `recipes` also installs `plot` (for the
# recipes' MemoryMonitor report), which importing a recipe package does not need, so it is not checked there.
EXTRAS: dict[str, dict[str, str]] = {
    "recipes": {
        "hydra-core": "hydra",
        "omegaconf": "omegaconf",
        "transformers": "transformers",
        "peft": "peft",
        "torchmetrics": "torchmetrics",
        "rich": "rich",
        "datasets": "datasets",
        "math-verify": "math_verify",
    },
    "sandbox": {"pyseccomp": "pyseccomp"},
    "plot": {"matplotlib": "matplotlib"},
}


class MissingExtraError(ImportError, ValueError):
    """An optional package is not installed; a ``ValueError`` too, so the CLI prints it as one line."""

    one_line: bool = False  # printed without a traceback when uncaught (require_extra(..., one_line_exit=True))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a half-installed package, or a module whose __spec__ is None
        return False


def missing_packages(extra: str) -> list[str]:
    """The distributions of ``extra`` that cannot be imported here (empty when the extra is installed)."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; choose one of: {', '.join(EXTRAS)}")
    return [dist for dist, module in EXTRAS[extra].items() if not _importable(module)]


def extra_is_installed(extra: str) -> bool:
    """Whether every package of ``extra`` can be imported (nothing is imported to find out)."""
    return not missing_packages(extra)


def require_extra(extra: str, user: str, *, one_line_exit: bool = False) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` when one of its packages is missing.

    ``user`` is what needs the extra (a module name). Call it at the top of a package ``__init__``::

        require_extra("recipes", __name__)
        # ImportError: lit_memopt.modules needs the 'recipes' extra (missing: hydra-core, transformers):
        #              pip install 'lit-memopt[recipes]'

    ``one_line_exit``: a command-line entry point's module; when the error is not caught, the interpreter prints
    its one line instead of a traceback (set ``LIT_MEMOPT_DEBUG=1`` for the traceback).
    """
    missing = missing_packages(extra)
    if not missing:
        return
    error = MissingExtraError(
        f"{user} needs the {extra!r} extra (missing: {', '.join(missing)}): pip install 'lit-memopt[{extra}]'",
        name=EXTRAS[extra][missing[0]],
    )
    if one_line_exit and not os.environ.get("LIT_MEMOPT_DEBUG"):
        error.one_line = True
        _install_one_line_hook()
    raise error


def _install_one_line_hook() -> None:
    # A console script imports its module before any code of ours runs, so no try/except of ours surrounds that
    # import: this hook prints a marked error as one line if it reaches the top, and hands every other exception
    # to the hook that was there before. Installed once; it holds no reference to any error.
    previous = sys.excepthook
    if getattr(previous, "_lit_memopt_one_line", False):
        return

    def one_line(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        if isinstance(value, MissingExtraError) and value.one_line:
            print(f"ImportError: {value}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    one_line._lit_memopt_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = one_line
