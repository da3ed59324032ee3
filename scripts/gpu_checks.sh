#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the `cuda`-marked tests, the fused ops beside their peers
# on the GPU (also at RL-sized token counts), the head's time against its tile size, and the peak-memory
# estimate against the measured peak of the same step.
# Usage (repository root, torch with CUDA installed): bash scripts/gpu_checks.sh [OUT_DIR]
# Logs go to OUT_DIR (default gpu_checks/); results to benchmarks/results/ (copied to OUT_DIR too).
set -u
out=${1:-gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
  timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider -rs tests/test_cuda.py tests/test_memory_stats.py
} 2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout "${PEERS_TIMEOUT:-260}" python3 -m benchmarks.peers_cuda ${PEERS_ARGS:-} >"$out/peers.log" 2>&1 || status=1
tail -n 5 "$out/peers.log"
timeout "${SWEEP_TIMEOUT:-150}" python3 -m benchmarks.tile_sweep_cuda >"$out/tile_sweep.log" 2>&1 || status=1
grep -E '^\| lit-memopt "fast", automatic' "$out/tile_sweep.log"
timeout "${RL_SHAPES_TIMEOUT:-240}" python3 -m benchmarks.rl_shapes_cuda >"$out/rl_shapes.log" 2>&1 || status=1
timeout "${ESTIMATES_TIMEOUT:-180}" python3 -m benchmarks.estimates --quick >"$out/estimates.log" 2>&1 || status=1
tail -n 8 "$out/estimates.log"
cp benchmarks/results/peers_cuda_* benchmarks/results/tile_sweep_cuda_* benchmarks/results/rl_shapes_cuda_* benchmarks/results/estimates_cuda* "$out"/ 2>/dev/null
exit $status
