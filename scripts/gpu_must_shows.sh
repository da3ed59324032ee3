#!/usr/bin/env bash
# On a lent GPU machine: the open issues' GPU must-shows in one command of under ten minutes (docs/developing.md,
# "On a lent GPU"), fastest first:
#   1. python -m benchmarks.peers_cuda --must-show   issue 43: the fused head at the Qwen3-4B head, bf16, beside the peers
#   2. python -m benchmarks.plan_cuda --deadline     issue 40: the plans lit-memopt plan chooses for Qwen3-4B at 24 and
#                                                    40 GiB, each run capped at its budget, and their time order
# Wheels in .whl/ (scripts/gpu_wheels.sh, made here beforehand) are installed to /tmp/site first. Everything lands in
# OUT (the device tool's $OUT; default gpu_must_shows/): 7 files, none deeper, so that all of them come back.
# PARTS="peers plan" chooses the parts; PEERS_TIMEOUT, PLAN_TIMEOUT and PLAN_DEADLINE their seconds.
set -u
out=${OUT:-gpu_must_shows}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "[gpu_must_shows] the wheels in .whl/ did not install" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# each must work (chained: `set -e` does not hold in a list that `||` tests): the GPU answers, the parts' packages import
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv &&
  python3 -c "import torch, lightning, transformers, hydra, datasets; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__, 'hydra', hydra.__version__)" &&
  nproc; } >"$out/device.txt" 2>&1 || { cat "$out/device.txt"; echo "[gpu_must_shows] the machine is not ready (see device.txt)" >&2; exit 1; }
cat "$out/device.txt"
status=0
parts=${PARTS:-"peers plan"}
if [[ " $parts " == *" peers "* ]]; then
  start=$SECONDS
  timeout "${PEERS_TIMEOUT:-200}" python3 -m benchmarks.peers_cuda --must-show >"$out/peers.log" 2>&1 || status=1
  cp benchmarks/results/peers_cuda_*_must_show.md benchmarks/results/peers_cuda_*_must_show.json "$out"/ 2>/dev/null
  echo "[gpu_must_shows] peers: $((SECONDS - start)) s"
  sed -n '/^## Issue 43/,$p' "$out"/peers_cuda_*_must_show.md 2>/dev/null || tail -n 20 "$out/peers.log"
fi
if [[ " $parts " == *" plan "* ]]; then
  start=$SECONDS
  deadline=${PLAN_DEADLINE:-320}
  timeout "${PLAN_TIMEOUT:-$((deadline + 60))}" python3 -m benchmarks.plan_cuda --deadline "$deadline" --out "$out" \
    --workdir /tmp/plan_cuda_runs >"$out/plan.log" 2>&1 || status=1
  echo "[gpu_must_shows] plan: $((SECONDS - start)) s"
  grep -E '^\[plan_cuda\]|Must show met' "$out/plan.log" || tail -n 30 "$out/plan.log"
fi
exit $status
