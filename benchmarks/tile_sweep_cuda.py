"""How the fused head's time on a GPU depends on its tile size, at the issue's small shape.

At N=2048, H=512, V=32000 a GPU pass is bound by the work per tile (Python, guards, launches), not by
the matmuls, so the smallest automatic CUDA tile (``CUDA_MIN_TILE_ELEMENTS`` in ``ops/_head_tiles.py``)
trades memory for time. This sweep measures that trade in one run: log-probs forward+backward with
explicit ``chunk_size=(2048, vocab_tile)`` for a range of vocabulary tiles, the automatic choice, the
full-logits path and Cut Cross-Entropy where it imports, interleaved (order rotated each repetition),
each with its peak extra memory; then a profile of the automatic ``"fast"`` step (where its host time goes).

Run ``python -m benchmarks.tile_sweep_cuda`` on a GPU machine; writes ``results/tile_sweep_cuda_<gpu>.{md,json}``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

from benchmarks._peer_measure import paired_ratio
from benchmarks._peer_methods import NAIVE, TIME_SHAPE, Inputs, Method, methods_for
from benchmarks._results import gpu_stem, write_results
from benchmarks.peers import load_peers
from benchmarks.peers_cuda import fmt_bytes, inputs, result_header, runnable, timed_rows, timed_step
from lit_memopt.ops import linear_logprobs
from lit_memopt.ops._fused_tiles import use_fused_tiles
from lit_memopt.ops._head_tiles import CUDA_MIN_TILE_ELEMENTS, tile_sizes

VOCAB_TILES = (1024, 2048, 4096, 8192, 16384, 32000)
REPS = 15
CCE = "Cut Cross-Entropy (cce)"


def _lit(precision: str, vocab_tile: Optional[int], rows: int) -> Method:
    chunk = None if vocab_tile is None else (rows, vocab_tile)
    label = f'lit-memopt "{precision}", ' + ("automatic tiles" if chunk is None else f"tiles {rows}x{vocab_tile}")
    return Method(label, lambda x: (linear_logprobs(x["hidden"], x["weight"], x["targets"], precision=precision, chunk_size=chunk),))


def sweep_case(dtype: torch.dtype, precision: str, peers: dict, *, shape: dict[str, int] = TIME_SHAPE,
               vocab_tiles: tuple[int, ...] = VOCAB_TILES, reps: int = REPS, device: str = "cuda") -> dict[str, Any]:
    """One dtype/precision: every method's time, ratios and peak extra memory, and the automatic step's profile."""
    device = torch.device(device)
    x = inputs(shape, dtype, device)
    n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    auto = tile_sizes(None, n, h, v, device, fast=precision == "fast", fused=use_fused_tiles(device, fake=False))
    baseline, _ = methods_for("logprobs", dtype, peers, device=device.type)
    methods = [m for m in baseline if m.name in (NAIVE, CCE)]
    methods += [_lit(precision, None, n)] + [_lit(precision, vt, n) for vt in vocab_tiles]
    absent: list[dict[str, str]] = []
    runs = runnable(methods, x, absent)  # a method that cannot run here is dropped, its reason printed
    for a in absent:
        print(f"[tile_sweep] {a['method']}: {a['error']}", flush=True)
    times, rows = timed_rows(runs, x, reps)
    for r in rows:
        r["ratio_vs_naive"] = paired_ratio(times, r["method"], NAIVE)
        r["ratio_vs_cce"] = paired_ratio(times, r["method"], CCE) if CCE in times else None
    profile = _profile(next(m for m in runs if "automatic" in m.name), x)
    del x
    torch.cuda.empty_cache()
    return {"dtype": str(dtype).replace("torch.", ""), "precision": precision, "shape": shape, "reps": reps,
            "automatic_tiles": list(auto), "rows": rows, "profile": profile}


def _profile(m: Method, x: Inputs) -> str:
    """The profiler's table of one step (after warm-up), by host time: where a tile's time goes."""
    from torch.profiler import ProfilerActivity, profile

    timed_step(m, x)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x["hidden"].is_cuda else [])
    with profile(activities=activities) as prof:
        timed_step(m, x)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"# Fused head time against tile size on {result['gpu']}", "",
             f"torch {result['torch']}. Command: `python -m benchmarks.tile_sweep_cuda`. Log-probs forward+backward; "
             "medians of interleaved repetitions (CUDA-synchronised); ratios are medians of per-repetition ratios in the "
             "same run; memory is the step's peak beyond inputs and gradients. "
             f"`CUDA_MIN_TILE_ELEMENTS` = {result['cuda_min_tile_elements']}.", ""]
    fmt: Callable[[Optional[float]], str] = lambda r: "—" if r is None else f"{r:.2f}x"  # noqa: E731
    for case in result["cases"]:
        n, h, v = (case["shape"][k] for k in ("tokens", "hidden", "vocab"))
        lines += [f"## {case['dtype']} · \"{case['precision']}\" · N={n}, H={h}, V={v} ({case['reps']} repetitions; "
                  f"automatic tiles here: {case['automatic_tiles']})", "",
                  "| method | median ms | vs naive | vs CCE | extra memory |", "|---|---:|---:|---:|---:|"]
        for r in case["rows"]:
            lines.append(f"| {r['method']} | {r['median_ms']:.2f} | {fmt(r['ratio_vs_naive'])} | {fmt(r['ratio_vs_cce'])} | "
                         f"{fmt_bytes(r['extra_bytes'])} |")
        lines += ["", "Profile of the automatic step (by host time):", "", "```", case["profile"], "```", ""]
    return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/tile_sweep_cuda.py needs a CUDA device")
    peers = load_peers()
    result = result_header("tile_sweep_cuda", "python -m benchmarks.tile_sweep_cuda", peers)
    result["cuda_min_tile_elements"] = CUDA_MIN_TILE_ELEMENTS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype, precision in ((torch.bfloat16, "fast"), (torch.float32, "exact")):
            print(f"[tile_sweep] {dtype} {precision}", flush=True)
            result["cases"].append(sweep_case(dtype, precision, peers))
    markdown = to_markdown(result)
    print(markdown)
    for path in write_results(f"tile_sweep_cuda_{gpu_stem(result['gpu'])}", result, markdown):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
