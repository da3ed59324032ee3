"""How ``benchmarks/peers.py`` measures a method: exactness against float64, interleaved one-thread
time, and peak memory with real tensors and with fake tensors at the real shape."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from lit_memopt.memory import memory_budget
from lit_memopt.memory.fake import fake_mode, peak_during

from benchmarks._peer_methods import NAIVE, Inputs, Method, Peer, _clear_grads, _inputs_in, make_inputs, methods_for, objective


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
            # None for a frozen head (no weight gradient anywhere)
            "grad_weight_err": None if ref_gw is None else float((x["weight"].grad.double() - ref_gw).abs().max()),
            "out_dtype": str(values[0].dtype).replace("torch.", ""),
        }
    _clear_grads(x)
    out["_reference_scale"] = {
        "value_max": max(float(r.abs().max()) for r in ref_values),
        "grad_hidden_max": float(ref_gh.abs().max()),
        "grad_weight_max": None if ref_gw is None else float(ref_gw.abs().max()),
    }
    return out


class _ProductFlops(TorchDispatchMode):
    """FLOPs of the matrix products (ATen's mm, addmm, bmm, baddbmm, in place or ``out=`` too) that run while it is
    active, and the name of any op outside ATen (a custom op whose products it cannot see). A dispatch mode sees the
    products inside an autograd Function's backward as well as the forward's."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.opaque: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        if name == "mm":
            a, b = args[0], args[1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif name in ("addmm", "addmm_"):
            a, b = args[1], args[2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif name == "bmm":
            a, b = args[0], args[1]
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        elif name in ("baddbmm", "baddbmm_"):
            a, b = args[1], args[2]
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        elif func.namespace not in ("aten", "prims"):
            self.opaque.add(str(func))
        return func(*args, **(kwargs or {}))


def count_products(method: Method, x: Inputs) -> dict[str, Any]:
    """Head-sized matrix products of one forward+backward of ``method`` on ``x``: FLOPs of every matrix product
    over those of one ``[N, H] x [H, V]`` product (``{"counted": 3.0}``), or why they could not be counted
    (``{"count_error": ...}``: a custom op hides its products; torch.compile does not compile under a dispatch mode)."""
    n, h = x["hidden"].shape
    unit = 2 * n * h * x["weight"].shape[0]
    _clear_grads(x)
    try:
        with _ProductFlops() as counter:
            objective(method.fn(x), x).backward()
    except Exception as exc:  # noqa: BLE001 - a compiled peer cannot run under the mode: its count is read instead
        return {"count_error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    finally:
        _clear_grads(x)
    if counter.opaque:
        return {"count_error": "custom ops hide their products: " + ", ".join(sorted(counter.opaque))}
    return {"counted": round(counter.flops / unit, 3)}


def _timed_step(method: Method, x: Inputs) -> float:
    _clear_grads(x)
    start = time.perf_counter()
    objective(method.fn(x), x).backward()
    return time.perf_counter() - start


def interleaved_times(methods: list[Method], x: Inputs, reps: int, *,
                      step: Callable[[Method, Inputs], float] = _timed_step, warmups: int = 1) -> dict[str, list[float]]:
    """Forward+backward seconds per repetition; every repetition runs every method once (order rotated).

    ``step`` times one forward+backward (the GPU benchmark's synchronises the device around it)."""
    for m in methods:  # warm-up: allocator, thread pools, torch.compile, Triton autotuning
        for _ in range(warmups):
            step(m, x)
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for rep in range(reps):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            times[m.name].append(step(m, x))
    _clear_grads(x)
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over repetitions of ``time(a) / time(b)`` measured in the same repetition."""
    return statistics.median(ta / tb for ta, tb in zip(times[a], times[b]))


def real_memory(methods: list[Method], x: Inputs, *, frozen: bool = False) -> dict[str, Any]:
    """Peak bytes of new tensors during forward+backward, beyond the inputs' gradients (real tensors; ``frozen``:
    the weight gets none)."""
    grad_bytes = x["hidden"].numel() * x["hidden"].element_size() + (0 if frozen else x["weight"].numel() * x["weight"].element_size())
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
                leaves = [x["hidden"]] + ([] if op == "frozen_logprobs" else [x["weight"]])  # a frozen head has no weight gradient
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
