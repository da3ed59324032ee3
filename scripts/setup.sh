#!/usr/bin/env bash
# Create (or reuse) a virtual environment in .venv and install lit-memopt with its test tools.
#
# torch: a build already in the environment is kept (users bring their own CUDA build). Otherwise
# TORCH_SPEC is installed first (default torch==2.13.0, which on the project's CPU machines is a
# local CPU wheel), so that the package's torch range is already satisfied and pip pulls nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# pip's warnings about this machine's extra local indexes are noise; its exit status is kept.
pip_install() { "$PY" -m pip install --quiet "$@" 2> >(grep -v "is ignored" >&2); }
pip_install --upgrade pip
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $TORCH_SPEC"
  pip_install "$TORCH_SPEC"
fi
echo "[setup] installing lit-memopt[test] (editable)"
pip_install -e ".[test]"
"$PY" -c "import torch, lightning, lit_memopt; print(f'[setup] ready: torch {torch.__version__}, lightning {lightning.__version__}, lit-memopt {lit_memopt.__version__}')"
