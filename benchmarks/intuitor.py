"""Intuitor's LM-head work per step (self-certainty of every response token + log-prob recomputation for the
GRPO loss, backward included): naive full logits vs the fused ops. Peak memory at the Qwen2.5-1.5B head
(batch 64 x 6144 tokens) measured with fake tensors; wall time on a small CPU shape.
Writes ``benchmarks/results/intuitor_<device>[_quick].{md,json}``.

Run ``python benchmarks/intuitor.py [--quick]`` or call :func:`run`.
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

if __package__ in (None, ""):  # `python benchmarks/intuitor.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_memopt.memory.fake import fake_mode, peak_during  # noqa: E402
from lit_memopt.ops import linear_logprobs, linear_self_certainty, ppo_clip_loss  # noqa: E402

from benchmarks._results import write_results  # noqa: E402
MODEL_CONF = Path(__file__).resolve().parents[1] / "conf" / "model" / "qwen2_5_1_5b.yaml"
BATCH, TOKENS = 64, 6144  # the setting: 64 responses of 6144 tokens
MICRO_BATCH = 8  # one prompt's group of responses per backward (the paper's G is 7-8)
BATCH_QUICK = 16  # --quick: 16 responses (fake-tensor tiling of the full batch takes minutes of CPU)
CPU_SHAPE = {"batch": 8, "tokens": 256, "hidden": 256, "vocab": 16000}
CPU_SHAPE_QUICK = {"batch": 4, "tokens": 128, "hidden": 128, "vocab": 8000}
MEMORY_TARGET_BYTES = 2 * 1024**3  # fused extra memory (gradients of hidden and head included) under 2 GiB
TEMPERATURE = 0.9
CLIP_EPS, KL_COEF = 0.2, 0.005

Inputs = dict[str, torch.Tensor]


def qwen2_5_1_5b_head() -> dict[str, int]:
    """Hidden size and vocabulary of the Qwen2.5-1.5B config shipped in ``conf/model``."""
    from omegaconf import OmegaConf

    arch = OmegaConf.load(MODEL_CONF).arch
    return {"hidden": int(arch.hidden_size), "vocab": int(arch.vocab_size)}


def make_inputs(shape: dict[str, int], dtype: torch.dtype, seed: int = 0) -> Inputs:
    """Final hidden states of the rollouts, the tied head, sampled tokens and the loss's constants."""
    b, t, h, v = shape["batch"], shape["tokens"], shape["hidden"], shape["vocab"]
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(b * t, h, generator=gen, dtype=dtype).requires_grad_(),
        "weight": (torch.randn(v, h, generator=gen, dtype=dtype) * h**-0.5).requires_grad_(),
        "targets": torch.randint(0, v, (b * t,), generator=gen),
        "ref_logp": -torch.rand(b, t, generator=gen) * 10,
        "mask": torch.ones(b, t, dtype=torch.bool),
    }


def _grpo_loss(token_logp: torch.Tensor, certainty: torch.Tensor, x: Inputs) -> torch.Tensor:
    b, t = x["mask"].shape
    logp = token_logp.view(b, t)
    reward = certainty.view(b, t).mean(-1)
    groups = reward.view(-1, 8 if b % 8 == 0 else b)
    advantages = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True, correction=0) + 1e-6)).view(-1)
    return ppo_clip_loss(logp, logp.detach(), advantages, clip_eps=CLIP_EPS, mask=x["mask"], ref_logp=x["ref_logp"], kl_coef=KL_COEF)


def naive_step(x: Inputs) -> None:
    """What a plain implementation does: full logits, upcast, log_softmax, gather; self-certainty from them."""
    logits = (x["hidden"] @ x["weight"].t()).float() / TEMPERATURE
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, x["targets"][:, None])[:, 0]
    with torch.no_grad():
        certainty = torch.logsumexp(logits, dim=-1) - logits.mean(dim=-1)
    del logits
    _grpo_loss(token_logp, certainty, x).backward()


def fused_step(x: Inputs) -> None:
    """The IntuitorModule path: tiled log-probs with grad, tiled self-certainty without."""
    token_logp = linear_logprobs(x["hidden"], x["weight"], x["targets"], temperature=TEMPERATURE)
    with torch.no_grad():
        certainty = linear_self_certainty(x["hidden"].detach(), x["weight"].detach(), temperature=TEMPERATURE)
    _grpo_loss(token_logp, certainty, x).backward()


CASES: dict[str, Callable[[Inputs], None]] = {"naive": naive_step, "fused": fused_step}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure(fn: Callable[[Inputs], None], shape: dict[str, int], dtype: torch.dtype) -> tuple[Any, int]:
    with fake_mode():
        x = make_inputs(shape, dtype)
        grad_bytes = _bytes(x["hidden"]) + _bytes(x["weight"])
        stats = peak_during(lambda: fn(x), *x.values())
    return stats, grad_bytes


def measure_fake_memory(shape: dict[str, int], micro_batch: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Peak live bytes of one head step (forward + backward) beyond its inputs, with fake tensors.

    Three rows: the naive path and the fused path on the whole batch in one call, and the fused
    path on one micro-batch of ``micro_batch`` responses (one prompt's group: what each backward
    handles when ``OOMRecovery`` or gradient accumulation splits the prompt batch).
    """
    rows = []
    grad_bytes = 0
    # The whole-batch fused row comes last: it is the like-for-like comparison with the naive row.
    runs = [("naive", naive_step, shape), ("fused, per micro-batch", fused_step, dict(shape, batch=micro_batch)), ("fused", fused_step, shape)]
    for label, fn, run_shape in runs:
        stats, grads = _measure(fn, run_shape, dtype)
        if run_shape is shape:
            grad_bytes = grads
        rows.append(
            {
                "path": label,
                "batch": run_shape["batch"],
                "extra_bytes": int(stats.extra_bytes),
                "input_gradient_bytes": grads,
                "extra_beyond_grads_bytes": int(stats.extra_bytes - grads),
                "peak_bytes": int(stats.peak_bytes),
                "baseline_bytes": int(stats.baseline_bytes),
            }
        )
    naive, micro, fused = rows
    return {
        "shape": dict(shape, rows=shape["batch"] * shape["tokens"]),
        "dtype": str(dtype).replace("torch.", ""),
        "input_gradient_bytes": grad_bytes,
        "rows": rows,
        "fused_over_naive": fused["extra_bytes"] / naive["extra_bytes"],
        "target_bytes": MEMORY_TARGET_BYTES,
        "target_met": fused["extra_bytes"] < MEMORY_TARGET_BYTES,  # whole batch in one backward
        "target_met_whole_batch": fused["extra_bytes"] < MEMORY_TARGET_BYTES,
        "target_met_per_micro_batch": micro["extra_bytes"] < MEMORY_TARGET_BYTES,
    }


def measure_time(shape: dict[str, int], reps: int) -> dict[str, Any]:
    """Median wall time of one head step on the CPU (fp32), and the fused/naive ratio."""
    x = make_inputs(shape, torch.float32)
    times: dict[str, float] = {}
    for label, fn in CASES.items():
        samples = []
        for _ in range(reps + 1):  # the first run warms up
            x["hidden"].grad = x["weight"].grad = None
            start = time.perf_counter()
            fn(x)
            samples.append(time.perf_counter() - start)
        times[label] = statistics.median(samples[1:])
    x["hidden"].grad = x["weight"].grad = None
    naive_grads = None
    for label, fn in CASES.items():  # the two paths must agree before their times mean anything
        x["hidden"].grad = x["weight"].grad = None
        fn(x)
        grads = (x["hidden"].grad.clone(), x["weight"].grad.clone())
        if naive_grads is None:
            naive_grads = grads
    max_grad_diff = max(float((a - b).abs().max()) for a, b in zip(naive_grads, grads))
    return {
        "shape": shape,
        "dtype": "float32",
        "reps": reps,
        "threads": torch.get_num_threads(),
        "naive_s": times["naive"],
        "fused_s": times["fused"],
        "fused_over_naive": times["fused"] / times["naive"],
        "max_grad_abs_diff": max_grad_diff,
    }


def _gib(n: int) -> str:
    return f"{n / 1024**3:,.2f} GiB"


def to_markdown(result: dict[str, Any]) -> str:
    mem = result["memory_fake"]
    s = mem["shape"]
    lines = [
        "# Intuitor head step: naive vs fused",
        "",
        f"torch {result['torch']}, {result['platform']}. Step = log-probs of the sampled tokens (with grad) + "
        "self-certainty of every token (no grad) + GRPO clipped loss with k3 KL + backward, from the final hidden states.",
        "",
        f"## Peak memory by fake tensors: Qwen2.5-1.5B head, batch {s['batch']} x {s['tokens']} tokens "
        f"(hidden [{s['rows']}, {s['hidden']}], weight [{s['vocab']}, {s['hidden']}], {mem['dtype']})",
        "",
        "Extra = peak live bytes during the step minus the inputs already live (hidden, weight, targets, reference "
        "log-probs, mask). It includes the gradients of hidden and weight, which every path must produce "
        "(last column: extra minus those gradients).",
        "",
        "| path | responses per backward | extra memory | input gradients | extra beyond the input gradients |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in mem["rows"]:
        lines.append(
            f"| {row['path']} | {row['batch']} | {_gib(row['extra_bytes'])} | {_gib(row['input_gradient_bytes'])} "
            f"| {_gib(row['extra_beyond_grads_bytes'])} |"
        )
    lines += [
        "",
        f"Fused / naive (whole batch): {mem['fused_over_naive']:.5f}. Target, fused extra < {_gib(mem['target_bytes'])}: "
        f"whole batch in one backward {'met' if mem['target_met_whole_batch'] else 'NOT met'}; "
        f"per micro-batch of one prompt's group {'met' if mem['target_met_per_micro_batch'] else 'NOT met'}.",
        "",
        "The fused op's backward walks rows in super-blocks, so its fp32 hidden-gradient accumulator is bounded by a "
        "few row tiles rather than [rows, hidden]; what grows with the batch is the hidden-state gradient itself "
        "(in the inputs' dtype). Split by prompt group (the OOMRecovery callback, or smaller loader batches with "
        "accumulate_grad_batches), each backward needs only the per-micro-batch row.",
    ]
    t = result["time_cpu"]
    ts = t["shape"]
    lines += [
        "",
        f"## CPU wall time (fp32, batch {ts['batch']} x {ts['tokens']} tokens, hidden {ts['hidden']}, vocab {ts['vocab']}, "
        f"{t['threads']} threads, median of {t['reps']})",
        "",
        "| naive | fused | fused / naive | max abs gradient difference |",
        "|---:|---:|---:|---:|",
        f"| {t['naive_s'] * 1e3:.1f} ms | {t['fused_s'] * 1e3:.1f} ms | {t['fused_over_naive']:.2f} | {t['max_grad_abs_diff']:.2e} |",
        "",
        "Times on a shared CPU are indicative only; the memory numbers do not depend on the machine.",
    ]
    return "\n".join(lines) + "\n"


def run(quick: bool = False, write: bool = True) -> dict[str, Any]:
    """Measure; write ``results/intuitor_cpu[_quick].{md,json}``; return the data."""
    head = qwen2_5_1_5b_head()
    mem_shape = {"batch": BATCH_QUICK if quick else BATCH, "tokens": TOKENS, **head}
    result: dict[str, Any] = {
        "benchmark": "intuitor",
        "quick": quick,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "memory_fake": measure_fake_memory(mem_shape, micro_batch=MICRO_BATCH),
        "time_cpu": measure_time(CPU_SHAPE_QUICK if quick else CPU_SHAPE, reps=2 if quick else 3),
    }
    if write:
        result["written"] = write_results("intuitor_cpu" + ("_quick" if quick else ""), result, to_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small CPU timing shape and fewer repetitions")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    print(to_markdown(result))
    for path in result.get("written", []):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
