"""The fused head beside its peers at RL-sized token counts on a GPU: a Qwen2.5-1.5B head (H=1536, V=151936)
at N = 512, 2048 and 8192 tokens, bf16, log-probs and the GRPO loss; and the same log-probs with 75% of the rows
ignored (``ignore_index``: the prompt part of each sequence, as in an RL batch) against the unmasked call; and
log-probs of an fp32 head under autocast to bf16 (Lightning's ``"bf16-mixed"``), lit-memopt's ``"auto"`` against
the same maths from full logits under the same autocast.

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
from benchmarks._peer_measure import paired_ratio
from benchmarks._peer_methods import LIT_FAST, SEQUENCE_LENGTH, Method
from benchmarks._results import gpu_stem, write_results
from benchmarks.peers import load_peers
from lit_memopt.ops import linear_logprobs

TOKENS = (512, 2048, 8192)
HEAD = {"hidden": 1536, "vocab": 151936}  # Qwen2.5-1.5B
REPS = 10
MASKED_SHARE = 0.75  # the prompt share of each sequence
MASKED = f'{LIT_FAST}, {MASKED_SHARE:.0%} of rows ignored'


def masked_case(n: int, reps: int = REPS, *, head: dict[str, int] = HEAD, device: str = "cuda",
                sequence_length: int = SEQUENCE_LENGTH) -> dict[str, Any]:
    """``"fast"`` log-probs with the first 75% of every sequence's targets set to ``ignore_index``, against the
    same call with every row counted, interleaved; times and peak extra memory of each."""
    x = peers_cuda.inputs({"tokens": n, **head}, torch.bfloat16, torch.device(device))
    prompt = torch.arange(n, device=x["targets"].device) % sequence_length < int(sequence_length * MASKED_SHARE)
    masked_targets = x["targets"].masked_fill(prompt, -100)
    methods = [
        Method(LIT_FAST, lambda x: (linear_logprobs(x["hidden"], x["weight"], x["targets"], precision="fast"),)),
        Method(MASKED, lambda x: (linear_logprobs(x["hidden"], x["weight"], masked_targets, precision="fast"),)),
    ]
    times, rows = peers_cuda.timed_rows(methods, x, reps)
    del x
    torch.cuda.empty_cache()
    return {"tokens": n, "counted_rows": int((~prompt).sum()), "rows": rows, "time_ratio": paired_ratio(times, MASKED, LIT_FAST),
            "memory_ratio": rows[1]["extra_bytes"] / max(rows[0]["extra_bytes"], 1)}


AUTOCAST_NAIVE = "naive (full logits), fp32 head under bf16 autocast"
AUTOCAST_LIT = 'lit-memopt "auto", fp32 head under bf16 autocast'


def autocast_case(n: int, reps: int = REPS, *, head: dict[str, int] = HEAD, device: str = "cuda") -> dict[str, Any]:
    """fp32 hidden states and head weight, the forward under ``torch.autocast(dtype=bfloat16)``: the naive
    head (its matmul runs in bf16, the log-softmax in fp32) against lit-memopt's default precision."""
    x = peers_cuda.inputs({"tokens": n, **head}, torch.float32, torch.device(device))

    def under_autocast(fn):
        def run(x):
            with torch.autocast(device, dtype=torch.bfloat16):
                return fn(x)
        return run

    def naive(x):
        logits = x["hidden"] @ x["weight"].t()
        return (torch.log_softmax(logits.float(), -1).gather(-1, x["targets"].unsqueeze(-1)).squeeze(-1),)

    methods = [Method(AUTOCAST_NAIVE, under_autocast(naive)),
               Method(AUTOCAST_LIT, under_autocast(lambda x: (linear_logprobs(x["hidden"], x["weight"], x["targets"]),)))]
    times, rows = peers_cuda.timed_rows(methods, x, reps)
    del x
    torch.cuda.empty_cache()
    return {"tokens": n, "rows": rows, "time_ratio": paired_ratio(times, AUTOCAST_LIT, AUTOCAST_NAIVE)}


def _section(title: str, columns: list[str], rows: list[list[str]]) -> str:
    """One markdown section: a heading and a table of right-aligned (numeric) columns."""
    lines = ["", f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def autocast_markdown(cases: list[dict[str, Any]]) -> str:
    def cells(c: dict[str, Any]) -> list[str]:
        naive, lit = c["rows"]
        return [str(c["tokens"]), f"{naive['median_ms']:.2f}", f"{lit['median_ms']:.2f}", f"{c['time_ratio']:.2f}x",
                peers_cuda.fmt_bytes(naive["extra_bytes"]), peers_cuda.fmt_bytes(lit["extra_bytes"])]
    return _section(f"logprobs · fp32 head under bf16 autocast · H=1536, V=151936 ({REPS} repetitions)",
                    ["N", "naive ms", 'lit-memopt "auto" ms', "vs naive", "naive extra memory", "lit-memopt extra memory"],
                    [cells(c) for c in cases])


def masked_markdown(cases: list[dict[str, Any]]) -> str:
    def cells(c: dict[str, Any]) -> list[str]:
        full, masked = c["rows"]
        return [str(c["tokens"]), str(c["counted_rows"]), f"{full['median_ms']:.2f}", f"{masked['median_ms']:.2f}",
                f"{c['time_ratio']:.2f}x", peers_cuda.fmt_bytes(full["extra_bytes"]), peers_cuda.fmt_bytes(masked["extra_bytes"]),
                f"{c['memory_ratio']:.2f}x"]
    return _section(f"logprobs · bfloat16 · H=1536, V=151936 · {MASKED_SHARE:.0%} of rows ignored vs none ({REPS} repetitions)",
                    ["N", "counted rows", "unmasked ms", "masked ms", "time ratio", "unmasked extra memory",
                     "masked extra memory", "memory ratio"],
                    [cells(c) for c in cases])


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/rl_shapes_cuda.py needs a CUDA device")
    peers = load_peers()
    result = peers_cuda.result_header("rl_shapes_cuda", "python -m benchmarks.rl_shapes_cuda", peers)
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
        result["masked"] = []
        for n in TOKENS:
            print(f"[rl_shapes] masked logprobs N={n}", flush=True)
            result["masked"].append(masked_case(n))
        result["autocast"] = []
        for n in TOKENS:
            print(f"[rl_shapes] fp32 head under bf16 autocast N={n}", flush=True)
            result["autocast"].append(autocast_case(n))
    markdown = peers_cuda.to_markdown(result) + masked_markdown(result["masked"]) + autocast_markdown(result["autocast"])
    print(markdown)
    gpu = gpu_stem(result["gpu"])
    for path in write_results(f"rl_shapes_cuda_{gpu}", result, markdown):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
