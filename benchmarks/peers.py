"""lit-memopt's fused LM-head ops side by side with the peers a user would pick instead: exactness
against float64, CPU time interleaved in one run, and peak memory (real tensors at a small shape,
fake tensors at the real one). Writes ``benchmarks/results/peers_<device>[_quick].{md,json}``.

The peers are optional (``pip install -e ".[bench]"``, see the README); one that cannot be imported
or cannot run here is reported as absent with its error, never replaced by something else.
Run ``python benchmarks/peers.py [--quick]`` or ``python -m benchmarks --only peers``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # `python benchmarks/peers.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: E402

from lit_memopt.memory import memory_budget  # noqa: E402
from lit_memopt.memory.fake import fake_mode, peak_during  # noqa: E402
from lit_memopt.ops import linear_logprobs, linear_logprobs_and_entropy, ppo_clip_loss  # noqa: E402

from benchmarks._results import write_results  # noqa: E402

TIME_SHAPE = {"tokens": 2048, "hidden": 512, "vocab": 32000}
TIME_SHAPE_QUICK = {"tokens": 256, "hidden": 128, "vocab": 4000}
REAL_MEMORY_SHAPE = TIME_SHAPE
REAL_MEMORY_SHAPE_QUICK = {"tokens": 128, "hidden": 64, "vocab": 2000}
FAKE_MEMORY_SHAPE = {"tokens": 8192, "hidden": 2560, "vocab": 151936}  # Qwen3-4B head, 8k tokens
FAKE_MEMORY_SHAPE_QUICK = {"tokens": 1024, "hidden": 2560, "vocab": 151936}
SEQUENCE_LENGTH = 256  # GRPO: tokens are [tokens // 256, 256] sequences
SEQUENCE_LENGTH_QUICK = 64
REPS, REPS_QUICK = 5, 2
# GRPO settings shared by every implementation (Liger's defaults, with our k3 KL weight).
GRPO = {"clip_eps": 0.2, "kl_coef": 0.04, "loss_type": "dapo"}

# The "Must show" targets.
BF16_FAST_VS_CCE_TIME = 1.0
FP32_VS_FASTEST_PEER_TIME = 1.0
MEMORY_VS_BEST_PEER = 0.2
MEMORY_VS_NAIVE = 0.02

OPS = ("logprobs", "logprobs_entropy", "grpo")
NAIVE = "naive (full logits)"
LIT_EXACT = 'lit-memopt "exact"'
LIT_FAST = 'lit-memopt "fast"'

Inputs = dict[str, torch.Tensor]


# ------------------------------------------------------------------ the peers


@dataclass
class Peer:
    """One optional package: the callables it offers, or why it is absent."""

    name: str
    package: str
    version: Optional[str] = None
    error: Optional[str] = None
    api: dict[str, Any] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.error is None


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _load(name: str, package: str, loader: Callable[[], dict[str, Any]]) -> Peer:
    peer = Peer(name, package, version=_version(package))
    try:
        peer.api = loader()
    except Exception as exc:  # noqa: BLE001 - any import failure makes the peer absent, with its reason
        peer.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return peer


def _load_torch_chunked() -> dict[str, Any]:
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        raise ImportError(f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions (new in 2.13)")
    return {"linear_cross_entropy": F.linear_cross_entropy, "options": torch.nn.LinearCrossEntropyOptions}


def _load_cce() -> dict[str, Any]:
    # Cut Cross-Entropy imports triton at package import, even for impl="torch_compile".
    module = importlib.import_module("cut_cross_entropy")
    return {"linear_cross_entropy": module.linear_cross_entropy}


def _load_liger_grpo() -> dict[str, Any]:
    module = importlib.import_module("liger_kernel.chunked_loss")
    return {"grpo_loss": module.LigerFusedLinearGRPOLoss}


def _load_liger_flce() -> dict[str, Any]:
    module = importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy")
    function = module.LigerFusedLinearCrossEntropyFunction
    # Its kernels are Triton: importable with triton installed, but they need a GPU driver to run.
    probe = torch.zeros(2, 2, requires_grad=True)
    function.apply(probe, torch.zeros(3, 2), torch.zeros(2, dtype=torch.long))
    return {"function": function}


def _load_trl_full_logits() -> dict[str, Any]:
    module = importlib.import_module("trl.trainer.utils")
    return {"selective_log_softmax": module.selective_log_softmax, "entropy_from_logits": module.entropy_from_logits}


def _load_trl_chunked() -> dict[str, Any]:
    importlib.import_module("trl.trainer.utils")  # its backward imports this module; fail here, not mid-benchmark
    module = importlib.import_module("trl.kernels")
    return {"function": module.ChunkedLogProbFunction}


PEER_LOADERS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "torch chunked": ("torch", _load_torch_chunked),
    "Cut Cross-Entropy": ("cut-cross-entropy", _load_cce),
    "Liger chunked_loss": ("liger-kernel", _load_liger_grpo),
    "Liger fused linear CE": ("liger-kernel", _load_liger_flce),
    "TRL full logits": ("trl", _load_trl_full_logits),
    "TRL chunked": ("trl", _load_trl_chunked),
}


def load_peers(names: Optional[list[str]] = None) -> dict[str, Peer]:
    """Import each peer (all of :data:`PEER_LOADERS` by default); never raises."""
    out = {}
    for name in names or list(PEER_LOADERS):
        package, loader = PEER_LOADERS[name]
        out[name] = _load(name, package, loader)
    return out


# ------------------------------------------------------------------ inputs and the methods


def make_inputs(shape: dict[str, int], dtype: torch.dtype, seed: int = 0, sequence_length: int = SEQUENCE_LENGTH) -> Inputs:
    """Head inputs in ``dtype`` (drawn in fp32, then cast), plus what each op's objective needs."""
    n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    gen = torch.Generator().manual_seed(seed)
    seqs = max(1, n // sequence_length)
    x = {
        "hidden": torch.randn(n, h, generator=gen).to(dtype).requires_grad_(),
        "weight": (torch.randn(v, h, generator=gen) * h**-0.5).to(dtype).requires_grad_(),
        "targets": torch.randint(0, v, (n,), generator=gen),
        # per-token upstream weights: the objective is sum(out * w), so gradients are generic
        "w_logprobs": torch.randn(n, generator=gen),
        "w_entropy": torch.randn(n, generator=gen),
        "advantages": torch.randn(seqs, generator=gen),
        "old_noise": 0.1 * torch.randn(n, generator=gen),
        "ref_noise": 0.1 * torch.randn(n, generator=gen),
    }
    return x


def add_grpo_logps(x: Inputs, sequence_length: int) -> None:
    """Old and reference log-probs near the current policy's (exact float64 log-probs plus noise)."""
    with torch.no_grad():
        logits = x["hidden"].double() @ x["weight"].double().t()
        logp = torch.log_softmax(logits, -1).gather(-1, x["targets"].unsqueeze(-1)).squeeze(-1).float()
    seqs = max(1, x["hidden"].shape[0] // sequence_length)
    x["old_logp"] = (logp + x["old_noise"]).view(seqs, -1)
    x["ref_logp"] = (logp + x["ref_noise"]).view(seqs, -1)


def _inputs_in(x: Inputs, dtype: torch.dtype) -> Inputs:
    """The same values in another float dtype (the float64 reference), as fresh leaves."""
    out = {}
    for key, t in x.items():
        if t.is_floating_point() and key in ("hidden", "weight"):
            out[key] = t.detach().to(dtype).requires_grad_()
        elif t.is_floating_point():
            out[key] = t.to(dtype)
        else:
            out[key] = t
    return out


def _naive_logits(x: Inputs) -> torch.Tensor:
    # What a HF model + a typical RL loss does: logits in the model dtype, upcast for the softmax.
    return (x["hidden"] @ x["weight"].t()).float() if x["hidden"].dtype != torch.float64 else x["hidden"] @ x["weight"].t()


def _naive_logprobs(x: Inputs) -> torch.Tensor:
    return torch.log_softmax(_naive_logits(x), -1).gather(-1, x["targets"].unsqueeze(-1)).squeeze(-1)


def _naive_logprobs_entropy(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(_naive_logits(x), -1)
    picked = logp_all.gather(-1, x["targets"].unsqueeze(-1)).squeeze(-1)
    return picked, -(logp_all.exp() * logp_all).sum(-1)


def _grpo_from_logprobs(logp: torch.Tensor, x: Inputs) -> torch.Tensor:
    seqs = x["advantages"].shape[0]
    return ppo_clip_loss(logp.view(seqs, -1), x["old_logp"], x["advantages"], ref_logp=x["ref_logp"],
                         clip_eps=GRPO["clip_eps"], kl_coef=GRPO["kl_coef"], loss_type=GRPO["loss_type"])


@dataclass
class Method:
    """One implementation of one op: ``fn(x)`` gives per-token outputs (a tuple) or, for GRPO, the loss."""

    name: str
    fn: Callable[[Inputs], Any]
    peer: Optional[str] = None  # None: naive or lit-memopt
    # The forward computes the gradients and the backward only hands them out (Liger's chunked losses):
    # under fake tensors the forward alone is measured, its peak is the step's.
    grads_in_forward: bool = False


def methods_for(op: str, dtype: torch.dtype, peers: dict[str, Peer]) -> tuple[list[Method], list[dict[str, str]]]:
    """The methods that compute ``op`` here, and the peers that could not (name, reason)."""
    lit = [(LIT_EXACT, "exact")] + ([(LIT_FAST, "fast")] if dtype in (torch.bfloat16, torch.float16) else [])
    methods: list[Method] = []
    absent: list[dict[str, str]] = []

    def peer_method(peer_name: str, label: str, make: Callable[[dict[str, Any]], Callable[[Inputs], Any]],
                    grads_in_forward: bool = False) -> None:
        peer = peers.get(peer_name)
        if peer is None:
            return
        if peer.available:
            methods.append(Method(label, make(peer.api), peer_name, grads_in_forward))
        else:
            absent.append({"peer": peer_name, "method": label, "error": peer.error or ""})

    if op == "logprobs":
        methods.append(Method(NAIVE, lambda x: (_naive_logprobs(x),)))
        for label, precision in lit:
            methods.append(Method(label, lambda x, p=precision: (linear_logprobs(x["hidden"], x["weight"], x["targets"], precision=p),)))
        peer_method("torch chunked", "torch F.linear_cross_entropy (chunked)", lambda api: (
            lambda x, lce=api["linear_cross_entropy"], opts=api["options"](): (
                -lce(x["hidden"], x["weight"], x["targets"], reduction="none", options=opts),)))
        peer_method("Cut Cross-Entropy", "Cut Cross-Entropy (torch_compile)", lambda api: (
            lambda x, lce=api["linear_cross_entropy"]: (
                -lce(x["hidden"], x["weight"], x["targets"], reduction="none", impl="torch_compile"),)))
        peer_method("Liger fused linear CE", "Liger fused linear CE", lambda api: (
            lambda x, fn=api["function"]: (-fn.apply(x["hidden"], x["weight"], x["targets"]),)))
        peer_method("TRL full logits", "TRL selective_log_softmax", lambda api: (
            lambda x, sls=api["selective_log_softmax"]: (sls(x["hidden"] @ x["weight"].t(), x["targets"]),)))
        peer_method("TRL chunked", "TRL ChunkedLogProbFunction", lambda api: (
            lambda x, fn=api["function"]: (fn.apply(x["hidden"], x["weight"], None, x["targets"], 1.0, 32768, None, 1.0, ())[0],)))
    elif op == "logprobs_entropy":
        methods.append(Method(NAIVE, _naive_logprobs_entropy))
        for label, precision in lit:
            methods.append(Method(label, lambda x, p=precision: linear_logprobs_and_entropy(
                x["hidden"], x["weight"], x["targets"], precision=p)))

        def trl_full(api: dict[str, Any]) -> Callable[[Inputs], Any]:
            def fn(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
                logits = x["hidden"] @ x["weight"].t()
                return api["selective_log_softmax"](logits, x["targets"]), api["entropy_from_logits"](logits)
            return fn

        peer_method("TRL full logits", "TRL selective_log_softmax + entropy_from_logits", trl_full)
        peer_method("TRL chunked", "TRL ChunkedLogProbFunction", lambda api: (
            lambda x, fn=api["function"]: fn.apply(x["hidden"], x["weight"], None, x["targets"], 1.0, 32768, None, 1.0, ("entropy",))[:2]))
    elif op == "grpo":
        methods.append(Method(NAIVE, lambda x: _grpo_from_logprobs(_naive_logprobs(x), x)))
        for label, precision in lit:
            methods.append(Method(label, lambda x, p=precision: _grpo_from_logprobs(
                linear_logprobs(x["hidden"], x["weight"], x["targets"], precision=p), x)))

        def liger_grpo(api: dict[str, Any]) -> Callable[[Inputs], Any]:
            loss_module = api["grpo_loss"](beta=GRPO["kl_coef"], epsilon_low=GRPO["clip_eps"], epsilon_high=GRPO["clip_eps"],
                                           loss_type=GRPO["loss_type"], use_ref_model=True)

            def fn(x: Inputs) -> torch.Tensor:
                seqs = x["advantages"].shape[0]
                hidden = x["hidden"].view(seqs, -1, x["hidden"].shape[-1])
                targets = x["targets"].view(seqs, -1)
                out = loss_module(hidden, x["weight"], targets, torch.ones_like(targets), x["advantages"],
                                  ref_per_token_logps=x["ref_logp"], old_per_token_logps=x["old_logp"])
                return out[0] if isinstance(out, tuple) else out
            return fn

        peer_method("Liger chunked_loss", "Liger LigerFusedLinearGRPOLoss", liger_grpo, grads_in_forward=True)
    else:
        raise ValueError(f"`op` must be one of {OPS}, got {op!r}")
    return methods, absent


def objective(out: Any, x: Inputs) -> torch.Tensor:
    """The scalar each method's backward starts from: the GRPO loss, or per-token outputs weighted."""
    if isinstance(out, torch.Tensor):
        return out
    weights = (x["w_logprobs"], x["w_entropy"])
    return sum((o.to(w.dtype) * w).sum() for o, w in zip(out, weights))


def _clear_grads(x: Inputs) -> None:
    x["hidden"].grad = None
    x["weight"].grad = None


# ------------------------------------------------------------------ measurements


def exactness(methods: list[Method], x: Inputs) -> dict[str, dict[str, Any]]:
    """Max abs error of each method's outputs and gradients against the naive path in float64."""
    ref_x = _inputs_in(x, torch.float64)
    naive = next(m for m in methods if m.name == NAIVE)
    ref_out = naive.fn(ref_x)
    objective(ref_out, ref_x).backward()
    ref_values = (ref_out,) if isinstance(ref_out, torch.Tensor) else tuple(ref_out)
    ref_values = tuple(v.detach() for v in ref_values)
    ref_gh, ref_gw = ref_x["hidden"].grad, ref_x["weight"].grad
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        _clear_grads(x)
        try:
            values = m.fn(x)
            objective(values, x).backward()
        except Exception as exc:  # noqa: BLE001 - a peer failing here is reported, and skipped below
            out[m.name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            continue
        values = (values,) if isinstance(values, torch.Tensor) else tuple(values)
        out[m.name] = {
            "value_err": max(float((v.detach().double() - r).abs().max()) for v, r in zip(values, ref_values)),
            "grad_hidden_err": float((x["hidden"].grad.double() - ref_gh).abs().max()),
            "grad_weight_err": float((x["weight"].grad.double() - ref_gw).abs().max()),
            "out_dtype": str(values[0].dtype).replace("torch.", ""),
        }
    _clear_grads(x)
    out["_reference_scale"] = {
        "value_max": max(float(r.abs().max()) for r in ref_values),
        "grad_hidden_max": float(ref_gh.abs().max()),
        "grad_weight_max": float(ref_gw.abs().max()),
    }
    return out


def _timed_step(method: Method, x: Inputs) -> float:
    _clear_grads(x)
    start = time.perf_counter()
    objective(method.fn(x), x).backward()
    return time.perf_counter() - start


def interleaved_times(methods: list[Method], x: Inputs, reps: int) -> dict[str, list[float]]:
    """Forward+backward seconds per repetition; every repetition runs every method once (order rotated)."""
    for m in methods:  # warm-up: allocator, thread pools, torch.compile
        _timed_step(m, x)
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for rep in range(reps):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            times[m.name].append(_timed_step(m, x))
    _clear_grads(x)
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over repetitions of ``time(a) / time(b)`` measured in the same repetition."""
    return statistics.median(ta / tb for ta, tb in zip(times[a], times[b]))


def real_memory(methods: list[Method], x: Inputs) -> dict[str, Any]:
    """Peak bytes of new tensors during forward+backward, beyond the inputs' gradients (real tensors)."""
    grad_bytes = x["hidden"].numel() * x["hidden"].element_size() + x["weight"].numel() * x["weight"].element_size()
    out: dict[str, Any] = {}
    for m in methods:
        _clear_grads(x)
        try:
            with memory_budget(None) as probe:
                objective(m.fn(x), x).backward()
            out[m.name] = {"extra_bytes": int(probe.peak_bytes - grad_bytes)}
        except Exception as exc:  # noqa: BLE001
            out[m.name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    _clear_grads(x)
    return out


def fake_memory(op: str, dtype: torch.dtype, shape: dict[str, int], peers: dict[str, Peer], sequence_length: int) -> dict[str, Any]:
    """Peak live bytes beyond inputs and their gradients at a real shape, under FakeTensorMode."""
    out: dict[str, Any] = {}
    methods, _ = methods_for(op, dtype, peers)
    for m in methods:
        kept: list[torch.Tensor] = []

        def step(m: Method = m, x: Optional[Inputs] = None) -> None:
            if m.grads_in_forward:
                kept.append(objective(m.fn(x), x))  # the graph (and the gradients it saved) stays alive
            else:
                objective(m.fn(x), x).backward()

        try:
            # Liger's forward reads a scalar (`.item()`): a ShapeEnv lets fake tensors carry it as a symbol.
            mode = FakeTensorMode(shape_env=ShapeEnv()) if m.grads_in_forward else fake_mode()
            with mode:
                x = make_inputs(shape, dtype, sequence_length=sequence_length)
                seqs = x["advantages"].shape[0]
                x["old_logp"] = torch.zeros(seqs, shape["tokens"] // seqs)
                x["ref_logp"] = torch.zeros(seqs, shape["tokens"] // seqs)
                leaves = [x["hidden"], x["weight"]]
                grad_bytes = sum(t.numel() * t.element_size() for t in leaves)
                stats = peak_during(lambda: step(x=x), *x.values())
                kept.clear()
            out[m.name] = {"extra_bytes": int(stats.extra_bytes - grad_bytes)}
            if m.grads_in_forward:
                out[m.name]["note"] = "forward only: it computes the gradients; its backward returns them when the loss gradient is 1"
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run under fake tensors is reported
            out[m.name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return out


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compare(op: str, dtype: torch.dtype, shape: dict[str, int], reps: int, peers: dict[str, Peer], *,
            sequence_length: int = SEQUENCE_LENGTH, only: Optional[list[str]] = None) -> dict[str, Any]:
    """Exactness and interleaved one-thread time of every method of ``op`` at ``shape``."""
    methods, absent = methods_for(op, dtype, peers)
    if only is not None:
        methods = [m for m in methods if m.name in only or m.name == NAIVE]
    x = make_inputs(shape, dtype, sequence_length=sequence_length)
    add_grpo_logps(x, sequence_length)
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        errors = exactness(methods, x)
        failed = {name for name, e in errors.items() if "error" in e}
        for m in methods:
            if m.name in failed:
                absent.append({"peer": m.peer or m.name, "method": m.name, "error": errors[m.name]["error"]})
        runnable = [m for m in methods if m.name not in failed]
        times = interleaved_times(runnable, x, reps) if reps > 0 else {}
    rows = []
    for m in runnable:
        r: dict[str, Any] = {"method": m.name, "peer": m.peer, **errors[m.name]}
        if times:
            r["median_s"] = statistics.median(times[m.name])
            r["ratio_vs_naive"] = paired_ratio(times, m.name, NAIVE)
        rows.append(r)
    return {"op": op, "dtype": str(dtype).replace("torch.", ""), "shape": shape, "reps": reps, "rows": rows,
            "absent": absent, "times": times, "reference_scale": errors["_reference_scale"]}


# ------------------------------------------------------------------ targets


def judge(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's "Must show" targets that this benchmark measures, each with its numbers."""
    verdicts = []
    by_key = {(c["op"], c["dtype"]): c for c in result["time"]}
    cce_error = next((p["error"] for p in result.get("peers", []) if p["name"] == "Cut Cross-Entropy" and p["error"]), None)
    for op in ("logprobs", "logprobs_entropy"):
        c = by_key.get((op, "bfloat16"))
        if not c:
            continue
        rows = {r["method"]: r for r in c["rows"]}
        cce = next((r for r in c["rows"] if r.get("peer") == "Cut Cross-Entropy"), None)
        fast = rows.get(LIT_FAST)
        if cce is None or fast is None or not c["times"]:
            verdicts.append({"target": f"bf16 {op}: fast <= {BF16_FAST_VS_CCE_TIME}x Cut Cross-Entropy time, errors no larger",
                             "met": None, "detail": (f"Cut Cross-Entropy absent: {cce_error}" if cce_error else
                                                     "Cut Cross-Entropy does not compute this op") if cce is None else "not timed"})
            continue
        judged = c["shape"] == TIME_SHAPE  # the targets are defined at this shape
        ratio = paired_ratio(c["times"], LIT_FAST, cce["method"])
        errors_ok = all(fast[k] <= cce[k] for k in ("value_err", "grad_hidden_err", "grad_weight_err"))
        verdicts.append({
            "target": f"bf16 {op}: fast <= {BF16_FAST_VS_CCE_TIME}x Cut Cross-Entropy time, errors no larger",
            "met": ratio <= BF16_FAST_VS_CCE_TIME and errors_ok if judged else None, "ratio": ratio,
            "detail": f"time {ratio:.2f}x CCE; errors (value, grad hidden, grad weight) fast "
                      f"{fast['value_err']:.2e}, {fast['grad_hidden_err']:.2e}, {fast['grad_weight_err']:.2e} vs CCE "
                      f"{cce['value_err']:.2e}, {cce['grad_hidden_err']:.2e}, {cce['grad_weight_err']:.2e}"
                      + ("" if judged else " (quick shape: not judged)"),
        })
    for op in OPS:
        c = by_key.get((op, "float32"))
        if not c or not c["times"]:
            continue
        peer_rows = [r for r in c["rows"] if r.get("peer")]
        if not peer_rows:
            verdicts.append({"target": f"fp32 {op}: <= {FP32_VS_FASTEST_PEER_TIME}x the fastest peer", "met": None,
                             "detail": "no peer computes this op here"})
            continue
        fastest = min(peer_rows, key=lambda r: r["ratio_vs_naive"])
        ratio = paired_ratio(c["times"], LIT_EXACT, fastest["method"])
        judged = c["shape"] == TIME_SHAPE
        verdicts.append({"target": f"fp32 {op}: <= {FP32_VS_FASTEST_PEER_TIME}x the fastest peer",
                         "met": ratio <= FP32_VS_FASTEST_PEER_TIME if judged else None, "ratio": ratio,
                         "detail": f"{ratio:.2f}x {fastest['method']}" + ("" if judged else " (quick shape: not judged)")})
    for m in result["memory_fake"]:
        naive = m["methods"].get(NAIVE, {}).get("extra_bytes")
        peers_ok = {k: v["extra_bytes"] for k, v in m["methods"].items() if k not in (NAIVE, LIT_EXACT, LIT_FAST) and "extra_bytes" in v}
        for lit in (LIT_EXACT, LIT_FAST):
            ours = m["methods"].get(lit, {}).get("extra_bytes")
            if ours is None or not naive:
                continue
            if not peers_ok:
                verdicts.append({"target": f"memory {m['op']} {lit}: <= {MEMORY_VS_BEST_PEER}x best peer, <= {MEMORY_VS_NAIVE:.0%} naive",
                                 "met": ours / naive <= MEMORY_VS_NAIVE if m["full_shape"] else None,
                                 "detail": f"{ours / naive:.2%} of naive; no peer ran under fake tensors"})
                continue
            best_name, best = min(peers_ok.items(), key=lambda kv: kv[1])
            ratio = ours / best if best else float("inf")
            verdicts.append({
                "target": f"memory {m['op']} {lit}: <= {MEMORY_VS_BEST_PEER}x best peer, <= {MEMORY_VS_NAIVE:.0%} naive",
                "met": (ratio <= MEMORY_VS_BEST_PEER and ours / naive <= MEMORY_VS_NAIVE) if m["full_shape"] else None,
                "ratio": ratio, "detail": f"{ratio:.3f}x {best_name}, {ours / naive:.2%} of naive"
                + ("" if m["full_shape"] else " (quick shape: not judged)"),
            })
    return verdicts


# ------------------------------------------------------------------ report


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "—"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def _shape_str(shape: dict[str, int]) -> str:
    return f"N={shape['tokens']}, H={shape['hidden']}, V={shape['vocab']}"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor() or "?"}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["processor"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    return info


def _load_avg() -> Optional[float]:
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()[0]
    return None


def to_markdown(result: dict[str, Any]) -> str:
    mach = result["machine"]
    loads = [v for v in result.get("load_avg_1min", []) if v is not None]
    lines = [
        "# Fused LM-head ops vs the peers" + (" (quick run)" if result["quick"] else ""),
        "",
        f"Machine: {mach['processor']}, {mach['cpus']} cores, {mach.get('memory_gib', '?')} GiB; torch {result['torch']}, "
        f"{mach['platform']}. Command: `{result['command']}`.",
        "",
        "Peers: " + "; ".join(f"{p['name']} ({p['package']} {p['version'] or 'not installed'}): "
                              + ("available" if p["error"] is None else f"**absent** — `{p['error']}`") for p in result["peers"]) + ".",
    ]
    if result.get("triton"):
        lines += ["", f"triton {result['triton']} was importable (Cut Cross-Entropy needs it at import, even for impl=\"torch_compile\")."]
    if loads:
        shared = max(loads) > 1.5
        lines += ["", f"1-minute load average sampled during the run: {min(loads):.2f} to {max(loads):.2f} "
                  f"(the timing uses one thread{'; the 2-core machine was shared with another job, so absolute times are noisy, and the interleaved repetitions keep the ratios fair' if shared else ''})."]
    if result.get("note"):
        lines += ["", result["note"]]
    lines += [
        "",
        "Each method computes per-token outputs (log-probs, entropy) and backpropagates `sum(out * w)` with fixed random "
        "per-token weights `w` (cross-entropy peers run with `reduction=\"none\"`, negated); GRPO is the loss itself "
        f"({GRPO['loss_type']} normalisation, clip {GRPO['clip_eps']}, k3 KL weight {GRPO['kl_coef']}, old and reference "
        "log-probs given). Errors are max abs differences from the naive path in float64 on the same (rounded) inputs.",
        "",
        "## Must-show targets",
        "",
        "| target | measured | met |",
        "|---|---|:---:|",
    ]
    for v in result["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[v["met"]]
        lines.append(f"| {v['target']} | {v['detail']} | {met} |")
    for c in result["time"]:
        scale = c["reference_scale"]
        lines += [
            "",
            f"## {c['op']}, {c['dtype']}, {_shape_str(c['shape'])}: fwd+bwd, one thread, median of {c['reps']} interleaved repetitions",
            "",
            f"Reference magnitudes (float64): values up to {scale['value_max']:.3g}, hidden grad {scale['grad_hidden_max']:.3g}, "
            f"weight grad {scale['grad_weight_max']:.3g}.",
            "",
            "| method | time | vs naive | value err | grad hidden err | grad weight err | output dtype |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in c["rows"]:
            t = f"{r['median_s'] * 1e3:,.0f} ms" if "median_s" in r else "—"
            ratio = f"{r['ratio_vs_naive']:.2f}x" if "ratio_vs_naive" in r else "—"
            lines.append(f"| {r['method']} | {t} | {ratio} | {r['value_err']:.2e} | {r['grad_hidden_err']:.2e} | "
                         f"{r['grad_weight_err']:.2e} | {r['out_dtype']} |")
        for a in c["absent"]:
            lines.append(f"| {a['method']} | absent: `{a['error'][:160]}` | | | | | |")
    for title, key in (("real tensors (`lit_memopt.memory.memory_budget`)", "memory_real"),
                       ("fake tensors (FakeTensorMode + MemTracker)", "memory_fake")):
        for m in result[key]:
            lines += [
                "",
                f"## Peak memory beyond inputs and their gradients, {m['op']}, {m['dtype']}, {_shape_str(m['shape'])}: {title}",
                "",
                "| method | extra memory | vs naive |",
                "|---|---:|---:|",
            ]
            naive = m["methods"].get(NAIVE, {}).get("extra_bytes")
            for name, r in m["methods"].items():
                if "error" in r:
                    lines.append(f"| {name} | could not run: `{r['error'][:160]}` | |")
                else:
                    ratio = f"{r['extra_bytes'] / naive:.2%}" if naive else "—"
                    note = f" ({r['note']})" if r.get("note") else ""
                    lines.append(f"| {name}{note} | {_bytes(r['extra_bytes'])} | {ratio} |")
    lines += ["", "Why a peer could not run where it says so:", "",
              "- *found no compiled frames* (real tensors): memory is counted by a `TorchDispatchMode`, and torch.compile "
              "does not compile while one is active; Cut Cross-Entropy's `torch_compile` path asks for `fullgraph=True` and stops.",
              "- *DynamicOutputShapeException: aten.nonzero* (fake tensors): Cut Cross-Entropy drops ignored targets with "
              "`nonzero`, whose output shape depends on values fake tensors do not have.",
              "- *0 active drivers* (Liger fused linear CE): its kernels are Triton, which needs a GPU driver to run."]
    return "\n".join(lines) + "\n"


def report_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for ``python -m benchmarks``' table: each lit-memopt time against naive, and each target."""
    rows = []
    for c in result["time"]:
        for r in c["rows"]:
            if "median_s" not in r or r["method"] == NAIVE or r.get("peer"):  # the peers' own rows: peers_<device>.md
                continue
            naive_s = next(x["median_s"] for x in c["rows"] if x["method"] == NAIVE)
            rows.append({"metric": f"{c['op']} {c['dtype']} {r['method']}: CPU time, one thread", "baseline": naive_s,
                         "optimized": r["median_s"], "unit": "s", "ratio": r["ratio_vs_naive"], "target": "", "pass": None,
                         "baseline_label": "naive"})
    for m in result["memory_fake"]:
        naive = m["methods"].get(NAIVE, {}).get("extra_bytes")
        for name in (LIT_EXACT, LIT_FAST):
            ours = m["methods"].get(name, {}).get("extra_bytes")
            if ours is not None and naive:
                rows.append({"metric": f"{m['op']} {name}: extra memory, fake tensors ({_shape_str(m['shape'])}, bf16)",
                             "baseline": naive, "optimized": ours, "unit": "bytes", "ratio": ours / naive, "target": "",
                             "pass": None, "baseline_label": "naive"})
    for v in result["targets"]:
        rows.append({"metric": f"target: {v['target']} ({v['detail']})", "baseline": None, "optimized": None, "unit": "",
                     "ratio": v.get("ratio"), "target": "", "pass": v["met"], "baseline_label": "peer"})
    return rows


def run(quick: bool = False, write: bool = True, ops: tuple[str, ...] = OPS, fake: bool = True) -> dict[str, Any]:
    """Every comparison; writes ``results/peers_<device>[_quick].{md,json}`` and returns the data."""
    peers = load_peers()
    triton_version = _version("triton")
    if triton_version is None or importlib.util.find_spec("triton") is None:
        triton_version = None
    shape = TIME_SHAPE_QUICK if quick else TIME_SHAPE
    seq = SEQUENCE_LENGTH_QUICK if quick else SEQUENCE_LENGTH
    reps = REPS_QUICK if quick else REPS
    result: dict[str, Any] = {
        "benchmark": "peers",
        "quick": quick,
        "command": "python -m benchmarks --only peers" + (" --quick" if quick else ""),
        "torch": torch.__version__,
        "machine": machine(),
        "triton": triton_version,
        "peers": [{"name": p.name, "package": p.package, "version": p.version, "error": p.error} for p in peers.values()],
        "load_avg_1min": [_load_avg()],
        "time": [],
        "memory_real": [],
        "memory_fake": [],
    }
    for dtype in (torch.float32, torch.bfloat16):
        for op in ops:
            print(f"[peers] time + exactness: {op} {dtype}", flush=True)
            result["time"].append(compare(op, dtype, shape, reps, peers, sequence_length=seq))
            result["load_avg_1min"].append(_load_avg())
    real_shape = REAL_MEMORY_SHAPE_QUICK if quick else REAL_MEMORY_SHAPE
    for op in ops:
        methods, _ = methods_for(op, torch.bfloat16, peers)
        x = make_inputs(real_shape, torch.bfloat16, sequence_length=seq)
        add_grpo_logps(x, seq)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result["memory_real"].append({"op": op, "dtype": "bfloat16", "shape": real_shape, "methods": real_memory(methods, x)})
    if fake:
        fake_shape = FAKE_MEMORY_SHAPE_QUICK if quick else FAKE_MEMORY_SHAPE
        for op in ops:
            print(f"[peers] fake-tensor memory: {op}", flush=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                methods = fake_memory(op, torch.bfloat16, fake_shape, peers, SEQUENCE_LENGTH)
            result["memory_fake"].append({"op": op, "dtype": "bfloat16", "shape": fake_shape, "methods": methods,
                                          "full_shape": fake_shape == FAKE_MEMORY_SHAPE})
            result["load_avg_1min"].append(_load_avg())
    result["targets"] = judge(result)
    result["report_rows"] = report_rows(result)
    if write:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        stem = f"peers_{'cpu' if device == 'cpu' else 'cuda'}" + ("_quick" if quick else "")
        result["written"] = write_results(stem, result, to_markdown(result))
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions, fake tensors at 1024 tokens")
    parser.add_argument("--note", default=None, help="a line for the report (e.g. that the machine was shared)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, write=False)
    result["command"] = "python benchmarks/peers.py" + (" --quick" if args.quick else "")
    if args.note:
        result["note"] = args.note
    device = "cpu" if not torch.cuda.is_available() else "cuda"
    result["written"] = write_results(f"peers_{device}" + ("_quick" if args.quick else ""), result, to_markdown(result))
    print(to_markdown(result))
    for path in result["written"]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
