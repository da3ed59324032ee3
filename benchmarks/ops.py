"""Naive (full logits) vs fused LM-head ops: peak memory at a real shape measured with fake tensors,
and wall time on the CPU (and on CUDA when present). Writes ``benchmarks/results/ops_<device>.{md,json}``.

Run ``python benchmarks/ops.py [--quick]`` or call :func:`run`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):  # `python benchmarks/ops.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_memopt.memory.fake import fake_mode, peak_during  # noqa: E402
from lit_memopt.ops import (  # noqa: E402
    linear_entropy,
    linear_kl,
    linear_logprobs,
    linear_logprobs_and_entropy,
    linear_self_certainty,
)

from benchmarks._results import write_results  # noqa: E402
MEMORY_SHAPE = {"tokens": 8192, "hidden": 2560, "vocab": 151936}  # Qwen3-4B head, 8k tokens
# --quick: the same head with fewer tokens (fewer row tiles to trace under fake tensors).
MEMORY_SHAPE_QUICK = {"tokens": 1024, "hidden": 2560, "vocab": 151936}
CPU_SHAPE = {"tokens": 2048, "hidden": 512, "vocab": 32000}
CPU_SHAPE_QUICK = {"tokens": 512, "hidden": 256, "vocab": 8000}
MEMORY_TARGET = 0.02  # fused extra bytes <= 2% of naive
CPU_TIME_TARGET = 1.5
CUDA_TIME_TARGET = 1.0
TEMPERATURE = 1.0

Inputs = dict[str, torch.Tensor]


# ------------------------------------------------------------------ the naive baselines


def _naive_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # What a HF model + a typical RL loss does: logits in the model dtype, upcast for the softmax.
    logits = (hidden @ weight.t()).float()
    return logits / TEMPERATURE if TEMPERATURE != 1.0 else logits


def naive_logprobs(x: Inputs) -> torch.Tensor:
    logp = torch.log_softmax(_naive_logits(x["hidden"], x["weight"]), dim=-1)
    return logp.gather(-1, x["targets"].unsqueeze(-1)).squeeze(-1).sum()


def naive_entropy(x: Inputs) -> torch.Tensor:
    logp = torch.log_softmax(_naive_logits(x["hidden"], x["weight"]), dim=-1)
    return (-(logp.exp() * logp).sum(-1)).sum()


def naive_logprobs_and_entropy(x: Inputs) -> torch.Tensor:
    logp = torch.log_softmax(_naive_logits(x["hidden"], x["weight"]), dim=-1)
    picked = logp.gather(-1, x["targets"].unsqueeze(-1)).squeeze(-1)
    return picked.sum() + (-(logp.exp() * logp).sum(-1)).sum()


def naive_self_certainty(x: Inputs) -> torch.Tensor:
    z = _naive_logits(x["hidden"], x["weight"])
    return (torch.logsumexp(z, dim=-1) - z.mean(-1)).sum()


def naive_kl(x: Inputs) -> torch.Tensor:
    with torch.no_grad():
        logq = torch.log_softmax(_naive_logits(x["ref_hidden"], x["ref_weight"]), dim=-1)
    logp = torch.log_softmax(_naive_logits(x["hidden"], x["weight"]), dim=-1)
    return (logp.exp() * (logp - logq)).sum()


# ------------------------------------------------------------------ the fused ops


def fused_logprobs(x: Inputs) -> torch.Tensor:
    return linear_logprobs(x["hidden"], x["weight"], x["targets"], temperature=TEMPERATURE).sum()


def fused_entropy(x: Inputs) -> torch.Tensor:
    return linear_entropy(x["hidden"], x["weight"], temperature=TEMPERATURE).sum()


def fused_logprobs_and_entropy(x: Inputs) -> torch.Tensor:
    logp, ent = linear_logprobs_and_entropy(x["hidden"], x["weight"], x["targets"], temperature=TEMPERATURE)
    return logp.sum() + ent.sum()


def fused_self_certainty(x: Inputs) -> torch.Tensor:
    return linear_self_certainty(x["hidden"], x["weight"], temperature=TEMPERATURE).sum()


def fused_kl(x: Inputs) -> torch.Tensor:
    return linear_kl(x["hidden"], x["weight"], x["ref_hidden"], x["ref_weight"], temperature=TEMPERATURE).sum()


CASES: dict[str, tuple[Callable[[Inputs], torch.Tensor], Callable[[Inputs], torch.Tensor]]] = {
    "linear_logprobs": (naive_logprobs, fused_logprobs),
    "linear_entropy": (naive_entropy, fused_entropy),
    "linear_logprobs_and_entropy": (naive_logprobs_and_entropy, fused_logprobs_and_entropy),
    "linear_self_certainty": (naive_self_certainty, fused_self_certainty),
    "linear_kl": (naive_kl, fused_kl),
}


def make_inputs(shape: dict[str, int], dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    gen = torch.Generator(device=device).manual_seed(seed) if device != "meta" else None
    kw = {"dtype": dtype, "device": device}
    scale = h**-0.5
    hidden = torch.randn(n, h, generator=gen, **kw).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, **kw) * scale).requires_grad_()
    return {
        "hidden": hidden,
        "weight": weight,
        "targets": torch.randint(0, v, (n,), generator=gen, device=device),
        "ref_hidden": torch.randn(n, h, generator=gen, **kw),
        "ref_weight": torch.randn(v, h, generator=gen, **kw) * scale,
    }


def _grad_bytes(x: Inputs) -> int:
    return sum(t.numel() * t.element_size() for t in x.values() if t.requires_grad)


def _clear_grads(x: Inputs) -> None:
    for t in x.values():
        t.grad = None


# ------------------------------------------------------------------ measurements


def measure_fake_memory(shape: dict[str, int], dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Peak live bytes of forward+backward beyond the inputs and their gradients, with fake tensors."""
    rows = []
    for name, (naive, fused) in CASES.items():
        row: dict[str, Any] = {"op": name}
        for label, fn in (("naive", naive), ("fused", fused)):
            with fake_mode():
                x = make_inputs(shape, dtype, "cpu")
                # The closure drops the loss before returning, so only what fn needs is counted.
                stats = peak_during(lambda: fn(x).backward(), *x.values())
                row[f"{label}_bytes"] = int(stats.extra_bytes - _grad_bytes(x))
        row["ratio"] = row["fused_bytes"] / row["naive_bytes"]
        # The 2% target is defined at the reference shape; smaller shapes keep fixed-size tiles.
        row["target_met"] = row["ratio"] <= MEMORY_TARGET if shape == MEMORY_SHAPE else None
        rows.append(row)
    return rows


def _verdict(met: bool | None) -> str:
    return "n/a (not the reference shape)" if met is None else ("met" if met else "MISSED")


def _timed_step(fn: Callable[[Inputs], torch.Tensor], x: Inputs, sync: Callable[[], None]) -> float:
    _clear_grads(x)
    sync()
    start = time.perf_counter()
    fn(x).backward()
    sync()
    return time.perf_counter() - start


def measure_time(
    shape: dict[str, int], dtype: torch.dtype, device: str, reps: int, target: float
) -> list[dict[str, Any]]:
    """Forward+backward wall time; naive and fused alternate so both see the same machine load."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = make_inputs(shape, dtype, device)
    rows = []
    for name, (naive, fused) in CASES.items():
        _timed_step(naive, x, sync)  # warm-up (allocator, kernels, thread pools)
        _timed_step(fused, x, sync)
        naive_times, fused_times = [], []
        for _ in range(reps):
            naive_times.append(_timed_step(naive, x, sync))
            fused_times.append(_timed_step(fused, x, sync))
        pair_ratios = [f / n for f, n in zip(fused_times, naive_times)]
        ratio = statistics.median(pair_ratios)
        rows.append(
            {
                "op": name,
                "naive_s": statistics.median(naive_times),
                "fused_s": statistics.median(fused_times),
                "ratio": ratio,
                "target_met": ratio <= target,
            }
        )
    _clear_grads(x)
    return rows


def measure_cuda_memory(shape: dict[str, int], dtype: torch.dtype) -> list[dict[str, Any]]:
    """Peak CUDA allocator bytes beyond inputs and their gradients (real tensors)."""
    rows = []
    for name, (naive, fused) in CASES.items():
        row: dict[str, Any] = {"op": name}
        for label, fn in (("naive", naive), ("fused", fused)):
            x = make_inputs(shape, dtype, "cuda")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn(x).backward()
            torch.cuda.synchronize()
            row[f"{label}_bytes"] = int(torch.cuda.max_memory_allocated() - base - _grad_bytes(x))
            del x
        row["ratio"] = row["fused_bytes"] / row["naive_bytes"]
        row["target_met"] = row["ratio"] <= MEMORY_TARGET if shape == MEMORY_SHAPE else None
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ report


def _gib(n: int) -> str:
    return f"{n / 1024**3:.3f} GiB" if n >= 1024**3 / 10 else f"{n / 1024**2:.1f} MiB"


def _shape_str(shape: dict[str, int]) -> str:
    return f"N={shape['tokens']}, H={shape['hidden']}, V={shape['vocab']}"


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Fused LM-head ops vs naive full-logits path",
        "",
        f"torch {result['torch']}, {result['platform']}, {result['threads']} CPU threads"
        + (" (quick run)" if result["quick"] else ""),
        "",
    ]
    mem = result["memory_fake"]
    lines += [
        f"## Peak memory beyond inputs and their gradients, forward+backward ({_shape_str(mem['shape'])}, {mem['dtype']})",
        "",
        "Measured with fake tensors (FakeTensorMode + MemTracker via `lit_memopt.memory.fake`).",
        f"Target: fused <= {MEMORY_TARGET:.0%} of naive.",
        "",
        "| op | naive | fused | fused/naive | target |",
        "|---|---:|---:|---:|---|",
    ]
    for r in mem["rows"]:
        lines.append(
            f"| {r['op']} | {_gib(r['naive_bytes'])} | {_gib(r['fused_bytes'])} | {r['ratio']:.2%} | {_verdict(r['target_met'])} |"
        )
    for key, title, target in (("time_cpu", "CPU", CPU_TIME_TARGET), ("time_cuda", "CUDA", CUDA_TIME_TARGET)):
        t = result.get(key)
        if not t:
            continue
        lines += [
            "",
            f"## {title} wall time, forward+backward ({_shape_str(t['shape'])}, {t['dtype']}, median of {t['reps']})",
            "",
            f"Target: fused <= {target}x naive (ratio = median of per-pair ratios, naive and fused alternating).",
            "",
            "| op | naive | fused | fused/naive | target |",
            "|---|---:|---:|---:|---|",
        ]
        for r in t["rows"]:
            lines.append(
                f"| {r['op']} | {r['naive_s'] * 1e3:.1f} ms | {r['fused_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x | {_verdict(r['target_met'])} |"
            )
    cm = result.get("memory_cuda")
    if cm:
        lines += [
            "",
            f"## CUDA allocator peak beyond inputs and gradients ({_shape_str(cm['shape'])}, {cm['dtype']})",
            "",
            "| op | naive | fused | fused/naive | target |",
            "|---|---:|---:|---:|---|",
        ]
        for r in cm["rows"]:
            lines.append(
                f"| {r['op']} | {_gib(r['naive_bytes'])} | {_gib(r['fused_bytes'])} | {r['ratio']:.2%} | {_verdict(r['target_met'])} |"
            )
    if result.get("cuda_note"):
        lines += ["", result["cuda_note"]]
    return "\n".join(lines) + "\n"


def run(quick: bool = False, write: bool = True) -> dict[str, Any]:
    """Run every measurement; write ``results/ops_<device>[_quick].{md,json}`` and return the data."""
    has_cuda = torch.cuda.is_available()
    device_tag = "cuda" if has_cuda else "cpu"
    result: dict[str, Any] = {
        "benchmark": "ops",
        "quick": quick,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if has_cuda else "cpu",
    }
    mem_shape = MEMORY_SHAPE_QUICK if quick else MEMORY_SHAPE
    result["memory_fake"] = {"shape": mem_shape, "dtype": "bfloat16", "rows": measure_fake_memory(mem_shape)}

    cpu_shape = CPU_SHAPE_QUICK if quick else CPU_SHAPE
    reps = 2 if quick else 3
    result["time_cpu"] = {
        "shape": cpu_shape,
        "dtype": "float32",
        "reps": reps,
        "rows": measure_time(cpu_shape, torch.float32, "cpu", reps, CPU_TIME_TARGET),
    }
    if has_cuda:
        cuda_shape = CPU_SHAPE if quick else MEMORY_SHAPE
        result["time_cuda"] = {
            "shape": cuda_shape,
            "dtype": "bfloat16",
            "reps": reps,
            "rows": measure_time(cuda_shape, torch.bfloat16, "cuda", reps, CUDA_TIME_TARGET),
        }
        result["memory_cuda"] = {"shape": cuda_shape, "dtype": "bfloat16", "rows": measure_cuda_memory(cuda_shape, torch.bfloat16)}
    else:
        result["cuda_note"] = "No CUDA device in this run: the CUDA timing and allocator-peak sections were not measured."

    if write:
        stem = f"ops_{device_tag}" + ("_quick" if quick else "")
        result["written"] = write_results(stem, result, to_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small CPU timing shape and fewer repetitions")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for the timing (default: torch's choice); 1 gives steadier ratios on a busy machine",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run(quick=args.quick)
    print(to_markdown(result))
    for path in result.get("written", []):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
