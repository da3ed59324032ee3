"""The fused LM-head ops beside the peers on a CUDA GPU: time, exactness and real peak memory.

The CPU benchmark (``benchmarks/peers.py``) times one thread and sizes memory with fake tensors; here
every method runs on the GPU, as its users run it:

* **time**: forward+backward, ``torch.cuda.synchronize`` around each step, every repetition running every
  method once (order rotated); the median of the per-repetition ratios against the naive path;
* **exactness**: max abs error of values and gradients against the naive maths in float64 on the same
  (rounded) inputs, at the time shape;
* **memory**: ``torch.cuda.max_memory_allocated`` during the step, beyond the inputs and their gradients.

Shapes: the issue's N=2048, H=512, V=32000 (fp32 and bf16), and a Qwen3-4B head at 8192 tokens
(N=8192, H=2560, V=151936, bf16). lit-memopt's tile maths run as compiled kernels on CUDA, each pass of a call
with one row tile as one compiled graph (its defaults); the ``"fast", compiled tile by tile`` row is the same op
with ``LIT_MEMOPT_WHOLE_PASS=0`` and the ``"fast", eager tiles`` row with ``LIT_MEMOPT_FUSED_TILES=0``. Cut Cross-Entropy runs its Triton kernel (``impl="cce"``), Liger its
Triton fused linear cross-entropy and its chunked GRPO loss. Writes ``results/peers_cuda_<gpu>.{md,json}``.
Run ``python -m benchmarks.peers_cuda [--quick | --must-show]`` on a GPU machine; ``--must-show`` runs only issue 43's
GPU targets (the Qwen3-4B head in bf16, each path's bare head products timed beside it) and judges them
(``benchmarks/_cuda_targets.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any, Optional

import torch

from benchmarks._peer_measure import exactness, interleaved_times, paired_ratio
from benchmarks._peer_methods import (
    FAKE_MEMORY_SHAPE,
    LIT_FAST,
    NAIVE,
    OPS,
    SEQUENCE_LENGTH,
    TIME_SHAPE,
    Inputs,
    Method,
    _clear_grads,
    _inputs_in,
    add_grpo_logps,
    make_inputs,
    methods_for,
    objective,
    own_floor,
    product_floors,
)
from benchmarks._cuda_targets import judge_cuda, verdict_lines
from benchmarks._results import gpu_stem, write_results
from benchmarks.peers import load_peers

BIG_SHAPE = FAKE_MEMORY_SHAPE  # Qwen3-4B head, 8192 tokens
REPS, BIG_REPS = 20, 8


def inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    x = _inputs_in(make_inputs(shape, dtype, sequence_length=SEQUENCE_LENGTH), device=device)
    add_grpo_logps(x, SEQUENCE_LENGTH)
    return x


def _sync(x: Inputs) -> None:
    """Wait for the inputs' device (a CUDA GPU; nothing on the CPU, where the plumbing tests run)."""
    if x["hidden"].is_cuda:
        torch.cuda.synchronize()


def timed_step(m: Method, x: Inputs) -> float:
    """Seconds of one forward+backward of ``m`` on ``x``, the GPU synchronised on both sides."""
    _clear_grads(x)
    _sync(x)
    start = time.perf_counter()
    objective(m.fn(x), x).backward()
    _sync(x)
    return time.perf_counter() - start


def peak_extra(m: Method, x: Inputs) -> int:
    """Peak bytes the step allocates beyond the inputs and their gradients."""
    _clear_grads(x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    objective(m.fn(x), x).backward()
    torch.cuda.synchronize()
    grads = sum(x[k].numel() * x[k].element_size() for k in ("hidden", "weight"))
    extra = torch.cuda.max_memory_allocated() - before - grads
    _clear_grads(x)
    return int(extra)


def timed_rows(methods: list[Method], x: Inputs, reps: int) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Interleaved forward+backward times of ``methods`` on ``x``, and a row per method with its median and peak extra memory."""
    times = interleaved_times(methods, x, reps, step=timed_step, warmups=2)
    rows = [{"method": m.name, "median_ms": 1e3 * statistics.median(times[m.name]), "extra_bytes": peak_extra(m, x)}
            for m in methods]
    return times, rows


def runnable(methods: list[Method], x: Inputs, absent: list[dict[str, str]]) -> list[Method]:
    """The methods whose step runs at this shape (a failing peer is reported with its error)."""
    ok = []
    for m in methods:
        try:
            timed_step(m, x)
            ok.append(m)
        except Exception as exc:  # noqa: BLE001 - reported, never faked
            absent.append({"peer": m.peer or m.name, "method": m.name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]})
            torch.cuda.empty_cache()
    _clear_grads(x)
    return ok


LIT_FAST_EAGER = 'lit-memopt "fast", eager tiles'
LIT_FAST_TILE_BY_TILE = 'lit-memopt "fast", compiled tile by tile'


def _with_env(method: Method, name: str, variable: str, value: str) -> Method:
    """``method`` run with the environment ``variable`` set to ``value`` (lit-memopt reads its tile settings at the
    forward), under ``name``; the user's setting is restored after each call."""
    def fn(x: Inputs) -> Any:
        before = os.environ.get(variable)
        os.environ[variable] = value
        try:
            return method.fn(x)
        finally:
            if before is None:
                del os.environ[variable]
            else:
                os.environ[variable] = before
    return Method(name, fn)


def lit_variants(fast: Method) -> list[Method]:
    """The same ``"fast"`` op with its compiled tile kernels called tile by tile instead of one compiled graph per
    pass (``LIT_MEMOPT_WHOLE_PASS=0``), and with eager tile maths (``LIT_MEMOPT_FUSED_TILES=0``)."""
    return [_with_env(fast, LIT_FAST_TILE_BY_TILE, "LIT_MEMOPT_WHOLE_PASS", "0"),
            _with_env(fast, LIT_FAST_EAGER, "LIT_MEMOPT_FUSED_TILES", "0")]


def compare(op: str, dtype: torch.dtype, shape: dict[str, int], reps: int, peers: dict, *, exact: bool, memory: bool,
            device: str = "cuda", floors: bool = False, variants: bool = True) -> dict[str, Any]:
    """One case: every method of ``op`` timed in the same repetitions; ``floors``: each path's bare head products
    too (:func:`product_floors`), and each method's time against its own (``ratio_vs_own_floor``); ``variants``:
    the ``"fast"`` op's other tile settings beside it (:func:`lit_variants`)."""
    methods, absent = methods_for(op, dtype, peers, device=device)
    fast = next((m for m in methods if m.name == LIT_FAST), None)
    if fast is not None and variants:  # compiled tiles against one compiled pass and the eager tile loop, in the same repetitions
        at = methods.index(fast) + 1
        methods[at:at] = lit_variants(fast)
    x = inputs(shape, dtype, torch.device(device))
    errors = exactness(methods, x) if exact else {}
    methods = [m for m in methods if "error" not in errors.get(m.name, {})]
    absent += [{"peer": n, "method": n, "error": e["error"]} for n, e in errors.items() if "error" in e]
    if floors:
        methods += product_floors(op)
    methods = runnable(methods, x, absent)
    times = interleaved_times(methods, x, reps, step=timed_step, warmups=2)
    rows = []
    for m in methods:
        row: dict[str, Any] = {"method": m.name, "peer": m.peer, **errors.get(m.name, {}),
                               "median_ms": 1e3 * statistics.median(times[m.name]),
                               "ratio_vs_naive": paired_ratio(times, m.name, NAIVE)}
        if m.floor:
            row["floor"] = True
        elif floors and own_floor(m) in times:
            row.update(products=m.products, own_floor=own_floor(m), ratio_vs_own_floor=paired_ratio(times, m.name, own_floor(m)))
        if memory:
            row["extra_bytes"] = peak_extra(m, x)
        rows.append(row)
    del x
    torch.cuda.empty_cache()
    return {"op": op, "dtype": str(dtype).replace("torch.", ""), "shape": shape, "reps": reps, "rows": rows,
            "absent": absent, "times": times, "reference_scale": errors.get("_reference_scale")}


def fmt_bytes(n: Optional[int]) -> str:
    """``n`` bytes as the result tables print them (GiB from a tenth of one, else MiB; a dash for none)."""
    return "—" if n is None else (f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 10 else f"{n / 2**20:.1f} MiB")


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"# Fused LM-head ops vs the peers on {result['gpu']}", "",
             f"torch {result['torch']}, triton {result['triton']}. Command: `{result['command']}`. "
             "Forward+backward of each method; times are medians of interleaved repetitions (CUDA-synchronised), "
             "ratios the median of per-repetition ratios against the naive path in the same repetition; memory is "
             "`torch.cuda.max_memory_allocated` during one step beyond the inputs and their gradients.", "",
             "Peers: " + "; ".join(f"{p['name']} ({p['package']} {p['version']}): " + ("available" if not p["error"] else f"**absent** — `{p['error']}`")
                                   for p in result["peers"]), ""]
    for c in result["cases"]:
        s = c["shape"]
        lines += [f"## {c['op']} · {c['dtype']} · N={s['tokens']}, H={s['hidden']}, V={s['vocab']} ({c['reps']} repetitions)", ""]
        lines += ["| method | median ms | vs naive | vs fastest peer | vs own floor | value err | grad hidden err | "
                  "grad weight err | extra memory |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        peer_rows = [r for r in c["rows"] if r.get("peer")]
        fastest = min(peer_rows, key=lambda r: r["ratio_vs_naive"]) if peer_rows else None
        for r in c["rows"]:
            vs_peer = f"{paired_ratio(c['times'], r['method'], fastest['method']):.2f}x" if fastest else "—"
            vs_floor = f"{r['ratio_vs_own_floor']:.2f}x" if "ratio_vs_own_floor" in r else "—"
            errs = [f"{r[k]:.2e}" if r.get(k) is not None else "—" for k in ("value_err", "grad_hidden_err", "grad_weight_err")]
            lines.append(f"| {r['method']} | {r['median_ms']:.2f} | {r['ratio_vs_naive']:.2f}x | {vs_peer} | {vs_floor} | "
                         + " | ".join(errs) + f" | {fmt_bytes(r.get('extra_bytes'))} |")
        for a in c["absent"]:
            lines.append(f"\n{a['method']}: absent here — `{a['error']}`")
        lines.append("")
    if result.get("verdicts"):
        lines += ["## Issue 43's GPU targets", "", *verdict_lines(result["verdicts"]), ""]
    return "\n".join(lines)


def result_header(benchmark: str, command: str, peers: dict) -> dict[str, Any]:
    """What a GPU benchmark's result records before its cases: the machine, the versions, the peers."""
    import importlib.metadata as md

    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = None
    return {"benchmark": benchmark, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton_version,
            "command": command, "cases": [],
            "peers": [{"name": p.name, "package": p.package, "version": p.version, "error": p.error} for p in peers.values()]}


# --must-show: issue 43's GPU targets alone (benchmarks/_cuda_targets.py), at the Qwen3-4B head in bf16, with each
# path's product floor timed beside it: minutes less than the whole benchmark, for a short GPU lease.
MUST_SHOW_OPS = ("cross_entropy", "grpo", "frozen_logprobs", "logprobs")


def run(quick: bool = False, must_show: bool = False) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/peers_cuda.py needs a CUDA device; on the CPU run benchmarks/peers.py")
    peers = load_peers()
    flag = " --quick" if quick else " --must-show" if must_show else ""
    result = result_header("peers_cuda", "python -m benchmarks.peers_cuda" + flag, peers)
    result["quick"] = quick
    if must_show:
        plan = [(op, torch.bfloat16, BIG_SHAPE, BIG_REPS, False, True) for op in MUST_SHOW_OPS]
    else:
        plan = [(op, dt, TIME_SHAPE, REPS, True, True) for dt in (torch.float32, torch.bfloat16) for op in OPS]
        if not quick:
            plan += [(op, torch.bfloat16, BIG_SHAPE, BIG_REPS, False, True) for op in OPS]
    for op, dtype, shape, reps, exact, memory in plan:
        print(f"[peers_cuda] {op} {dtype} {shape}", flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result["cases"].append(compare(op, dtype, shape, reps, peers, exact=exact, memory=memory,
                                               floors=shape == BIG_SHAPE, variants=not must_show))
            except torch.OutOfMemoryError as exc:
                print(f"[peers_cuda] {op} {dtype} {shape}: out of memory ({exc})".splitlines()[0], flush=True)
                torch.cuda.empty_cache()
    result["verdicts"] = judge_cuda(result)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small shape")
    parser.add_argument("--must-show", action="store_true",
                        help="issue 43's GPU targets alone: the Qwen3-4B head in bf16, product floors beside each path")
    args = parser.parse_args(argv)
    if args.quick and args.must_show:
        parser.error("--quick and --must-show are two different runs: choose one")
    result = run(quick=args.quick, must_show=args.must_show)
    gpu = gpu_stem(result["gpu"])
    suffix = "_quick" if args.quick else "_must_show" if args.must_show else ""
    written = write_results(f"peers_cuda_{gpu}{suffix}", result, to_markdown(result))
    print(to_markdown(result))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
