"""Masked rows cost nothing: the fused log-prob head with 75% of its rows masked (an RL batch is mostly
prompt) against the same call with none masked, time and memory (issue target: <= 0.35x of unmasked).

Time: fwd+bwd on one thread, the two variants interleaved, median of the per-pair ratios. Memory: peak of
new tensor bytes (``lit_memopt.memory.memory_budget``) beyond the inputs' gradients, real tensors.
Rows are masked as in RL: in each sequence, the first 75% (the prompt) carry no loss.

    python benchmarks/masked_rows.py [--quick]      # also: python -m benchmarks --only masked_rows
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # `python benchmarks/masked_rows.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import quick_command, write_results  # noqa: E402
from lit_memopt.memory import memory_budget  # noqa: E402
from lit_memopt.ops import linear_logprobs  # noqa: E402

SHAPE = {"tokens": 2048, "hidden": 512, "vocab": 32000}
QUICK_SHAPE = {"tokens": 512, "hidden": 256, "vocab": 8000}
SEQUENCE_LENGTH = 256
MASKED_SHARE = 0.75
TARGET = 0.35
CASES = (("fp32", torch.float32, "exact"), ("bf16", torch.bfloat16, "fast"))


def make_inputs(shape: dict[str, int], dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * h**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    # Per sequence of SEQUENCE_LENGTH tokens, the prompt part is masked and only the response counts.
    position = torch.arange(n) % min(SEQUENCE_LENGTH, n)
    mask = position >= int(MASKED_SHARE * min(SEQUENCE_LENGTH, n))
    return {"hidden": hidden, "weight": weight, "targets": targets, "mask": mask}


def step(x: dict[str, torch.Tensor], precision: str, masked: bool) -> None:
    x["hidden"].grad = x["weight"].grad = None
    logp = linear_logprobs(x["hidden"], x["weight"], x["targets"], mask=x["mask"] if masked else None,
                           precision=precision)
    logp.sum().backward()


def measure(shape: dict[str, int], dtype: torch.dtype, precision: str, reps: int) -> dict[str, Any]:
    x = make_inputs(shape, dtype)
    grads = sum(x[k].numel() * x[k].element_size() for k in ("hidden", "weight"))
    memory = {}
    for masked in (False, True):
        with memory_budget(None) as probe:
            step(x, precision, masked)
        memory[masked] = int(probe.peak_bytes - grads)
    times: dict[bool, list[float]] = {False: [], True: []}
    step(x, precision, False)  # warm-up
    step(x, precision, True)
    for _ in range(reps):
        for masked in (False, True):
            start = time.perf_counter()
            step(x, precision, masked)
            times[masked].append(time.perf_counter() - start)
    time_ratio = statistics.median(m / u for m, u in zip(times[True], times[False]))
    memory_ratio = memory[True] / memory[False]
    return {
        "unmasked_s": statistics.median(times[False]), "masked_s": statistics.median(times[True]),
        "time_ratio": time_ratio, "unmasked_extra_bytes": memory[False], "masked_extra_bytes": memory[True],
        "memory_ratio": memory_ratio, "target_met": time_ratio <= TARGET and memory_ratio <= TARGET,
    }


def to_markdown(result: dict[str, Any]) -> str:
    s = result["shape"]
    lines = [
        "# Masked rows: the fused log-prob head with 75% of rows masked vs none (CPU)", "",
        f"`python benchmarks/masked_rows.py{' --quick' if result['quick'] else ''}` · torch {result['torch']} · "
        f"{result['machine']} · one thread · N={s['tokens']}, H={s['hidden']}, V={s['vocab']}, the first 75% of each "
        f"{SEQUENCE_LENGTH}-token sequence masked · {result['reps']} interleaved repetitions · load at start "
        f"{result['load']}.", "",
        f"Target: masked time and extra memory <= {TARGET}x of unmasked.", "",
        "| dtype · precision | unmasked s | masked s | time ratio | unmasked extra MiB | masked extra MiB | memory ratio | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in result["cases"].items():
        lines.append(f"| {name} | {r['unmasked_s']:.3f} | {r['masked_s']:.3f} | {r['time_ratio']:.3f} | "
                     f"{r['unmasked_extra_bytes'] / 2**20:.1f} | {r['masked_extra_bytes'] / 2**20:.1f} | "
                     f"{r['memory_ratio']:.3f} | {'met' if r['target_met'] else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def run(quick: bool = False, write: bool = True) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape, reps = (QUICK_SHAPE, 3) if quick else (SHAPE, 7)
        load = f"{os.getloadavg()[0]:.1f}"
        cases = {f"{name} · {precision}": measure(shape, dtype, precision, reps) for name, dtype, precision in CASES}
    finally:
        torch.set_num_threads(threads)
    result = {"quick": quick, "shape": shape, "reps": reps, "torch": torch.__version__, "machine": platform.platform(),
              "load": load, "cases": cases}
    if write:
        write_results(f"masked_rows_cpu{'_quick' if quick else ''}", result, to_markdown(result))
    rows = []
    for name, r in cases.items():
        rows.append({"case": "masked_rows", "metric": f"{name}: fwd+bwd time, 75% rows masked", "baseline": r["unmasked_s"],
                     "baseline_label": "unmasked", "optimized": r["masked_s"], "unit": "s", "ratio": r["time_ratio"],
                     "target": f"<= {TARGET}x", "pass": r["time_ratio"] <= TARGET})
        rows.append({"case": "masked_rows", "metric": f"{name}: extra memory, 75% rows masked",
                     "baseline": r["unmasked_extra_bytes"], "baseline_label": "unmasked",
                     "optimized": r["masked_extra_bytes"], "unit": "B", "ratio": r["memory_ratio"],
                     "target": f"<= {TARGET}x", "pass": r["memory_ratio"] <= TARGET})
    return {"report_rows": rows, **result}


def main(argv: list[str] | None = None) -> int:
    return quick_command(argv, __doc__, run, to_markdown, "a small shape and fewer repetitions")


if __name__ == "__main__":
    raise SystemExit(main())
