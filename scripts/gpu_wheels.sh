#!/usr/bin/env bash
# Here, on a machine that reaches the package registry: fill .whl/ (git ignores it) with the Python packages that the
# lent GPU machine's image lacks, for scripts/gpu_must_shows.sh there (docs/developing.md, "On a lent GPU").
# That machine has no network; its python3 (3.12) has torch, Lightning, transformers, peft, torchmetrics, rich,
# pandas, pyarrow and accelerate, not Hydra, datasets, math-verify or the benchmarks' peers.
# The recipes' packages are taken at the versions installed in .venv (the ones the tests ran with); the peers at
# PEERS' versions (those of the committed GPU results) unless .venv has them (WITH_BENCH=1 scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.whl}
RECIPES="hydra-core omegaconf antlr4-python3-runtime datasets dill multiprocess math-verify latex2sympy2_extended"
PEERS=${PEERS:-"cut-cross-entropy==25.1.1 liger-kernel==0.8.5 trl==1.16.0"}
mkdir -p "$DEST"
installed() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null; }
specs=()
for name in $RECIPES; do
  version=$(installed "$name") || { echo "[gpu_wheels] $name is not installed in $PY: run scripts/setup.sh first" >&2; exit 1; }
  specs+=("$name==$version")
done
for spec in $PEERS; do
  version=$(installed "${spec%%==*}") && specs+=("${spec%%==*}==$version") || specs+=("$spec")
done
for spec in "${specs[@]}"; do
  # a pure-Python wheel where there is one (every package here), built from its sdist where PyPI has none (antlr4)
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DEST" "$spec" 2>/dev/null; then
    "$PY" -m pip wheel -q --no-deps -w "$DEST" "$spec" 2> >(grep -v "is ignored" >&2)
  fi
done
ls "$DEST"
du -sh "$DEST"
