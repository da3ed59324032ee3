"""The fused head beside its peers at RL-sized token counts on a GPU: a Qwen2.5-1.5B head (H=1536, V=151936)
at N = 512, 2048 and 8192 tokens, bf16, log-probs and the GRPO loss.

RL steps often score a few hundred to a few thousand tokens per micro-batch, where a GPU pass is bound by the host
work per tile rather than by the matmuls (see ``tile_sweep_cuda.py``). Same measurement as ``peers_cuda.py``
(``compare``: interleaved forward+backward times, CUDA-synchronised; peak extra memory), without the float64
exactness check at these sizes. Run ``python -m benchmarks.rl_shapes_cuda`` on a GPU machine; writes
``results/rl_shapes_cuda_<gpu>.{md,json}``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from benchmarks import peers_cuda
from benchmarks._results import gpu_stem, write_results
from benchmarks.peers import load_peers

TOKENS = (512, 2048, 8192)
HEAD = {"hidden": 1536, "vocab": 151936}  # Qwen2.5-1.5B
REPS = 10


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/rl_shapes_cuda.py needs a CUDA device")
    peers = load_peers()
    result: dict[str, Any] = {"benchmark": "rl_shapes_cuda", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": None, "command": "python -m benchmarks.rl_shapes_cuda", "peers": [], "cases": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in TOKENS:
            for op in ("logprobs", "grpo"):
                shape = {"tokens": n, **HEAD}
                print(f"[rl_shapes] {op} {shape}", flush=True)
                try:
                    result["cases"].append(peers_cuda.compare(op, torch.bfloat16, shape, REPS, peers, exact=False, memory=True))
                except torch.OutOfMemoryError as exc:
                    print(f"[rl_shapes] {op} {shape}: out of memory ({exc})".splitlines()[0], flush=True)
                    torch.cuda.empty_cache()
    markdown = peers_cuda.to_markdown(result)
    print(markdown)
    gpu = gpu_stem(result["gpu"])
    for path in write_results(f"rl_shapes_cuda_{gpu}", result, markdown):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
