#!/usr/bin/env bash
# Create (or reuse) a virtual environment in .venv and install lit-memopt with its test tools.
#
# torch: a build already in the environment is kept (users bring their own CUDA build). Otherwise
# TORCH_SPEC is installed first (default torch==2.13.0, which on the project's CPU machines is a
# local CPU wheel), so that the package's torch range is already satisfied and pip pulls nothing more.
# That range (pyproject.toml) is the one CI tests, torch 2.13.x: a build outside it is replaced by pip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

# The code sandbox (lit_memopt.rewards.sandbox) uses bubblewrap for namespaces and the minimal filesystem and
# libseccomp for its syscall filter. Installed when apt is there and we may use it; otherwise the sandbox
# falls back to its own launcher and says at start which isolation features are off.
have_libseccomp() { ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || ls /usr/lib/*/libseccomp.so.2 >/dev/null 2>&1; }
if ! command -v bwrap >/dev/null 2>&1 || ! have_libseccomp; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing bubblewrap and libseccomp2 (apt)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap libseccomp2; } \
      || echo "[setup] warning: apt-get could not install bubblewrap/libseccomp2; the sandbox will report what is off" >&2
  else
    echo "[setup] note: bubblewrap/libseccomp2 not installed (needs root and apt-get); the sandbox will report what is off" >&2
  fi
fi

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
# The test extra brings every extra the suite exercises (recipes, data, sandbox, plot, tensorboard; pyproject.toml).
echo "[setup] installing lit-memopt[test] (editable)"
pip_install -e ".[test]"
if [ "${WITH_BENCH:-0}" = 1 ]; then
  # The peers of benchmarks/peers.py (the `bench` extra), without their dependencies so that torch is
  # never replaced; then the small packages TRL's trainer utilities import. None of them asks for torch.
  echo "[setup] installing the benchmark peers (--no-deps)"
  pip_install --no-deps cut-cross-entropy liger-kernel trl
  pip_install --no-deps datasets pandas pyarrow dill xxhash multiprocess
fi
"$PY" -c "import torch, lightning, lit_memopt; print(f'[setup] ready: torch {torch.__version__}, lightning {lightning.__version__}, lit-memopt {lit_memopt.__version__}')"
