"""The peers of ``benchmarks/peers.py`` and the methods it compares: which packages it imports (each
optional, absent with its error when it cannot import), the inputs, and each op as every method computes it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from lit_memopt.ops import linear_cross_entropy, linear_logprobs, linear_logprobs_and_entropy, linear_policy_loss, ppo_clip_loss

TIME_SHAPE = {"tokens": 2048, "hidden": 512, "vocab": 32000}
TIME_SHAPE_QUICK = {"tokens": 256, "hidden": 128, "vocab": 4000}
REAL_MEMORY_SHAPE = TIME_SHAPE
REAL_MEMORY_SHAPE_QUICK = {"tokens": 128, "hidden": 64, "vocab": 2000}
FAKE_MEMORY_SHAPE = {"tokens": 8192, "hidden": 2560, "vocab": 151936}  # Qwen3-4B head, 8k tokens
FAKE_MEMORY_SHAPE_QUICK = {"tokens": 1024, "hidden": 2560, "vocab": 151936}
SEQUENCE_LENGTH = 256  # GRPO: tokens are [tokens // 256, 256] sequences
SEQUENCE_LENGTH_QUICK = 64
# Where each method's head products are counted (by FLOPs, see benchmarks/_peer_measure.py): small, so the count
# costs well under a second a method; the count is in units of one [N, H] x [H, V] product, whatever the shape.
COUNT_SHAPE = {"tokens": 256, "hidden": 64, "vocab": 4000}
COUNT_SEQUENCE_LENGTH = 64
REPS, REPS_QUICK = 5, 2
# GRPO settings shared by every implementation (Liger's defaults, with our k3 KL weight).
GRPO = {"clip_eps": 0.2, "kl_coef": 0.04, "loss_type": "dapo"}

# cross_entropy: the SFT loss (a scalar: lit-memopt makes its gradients in the forward); frozen_logprobs: a LoRA
# run's frozen head (no weight gradient: lit-memopt's forward makes the hidden gradient's direction).
OPS = ("logprobs", "logprobs_entropy", "grpo", "cross_entropy", "frozen_logprobs")
NAIVE = "naive (full logits)"
LIT_EXACT = 'lit-memopt "exact"'
LIT_FAST = 'lit-memopt "fast"'
LIT_FUSED_GRPO = 'lit-memopt linear_policy_loss "exact"'
LIT_FUSED_GRPO_FAST = 'lit-memopt linear_policy_loss "fast"'
# Every lit-memopt path (the targets judge each against its own floor).
LIT_METHODS = (LIT_EXACT, LIT_FAST, LIT_FUSED_GRPO, LIT_FUSED_GRPO_FAST)
# The "exact" paths multiply fp32 tiles whatever the inputs' dtype (only the inputs' rounding remains).
LIT_FP32_PRODUCTS = (LIT_EXACT, LIT_FUSED_GRPO)

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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probe = torch.zeros(2, 2, requires_grad=True, device=device)
    function.apply(probe, torch.zeros(3, 2, device=device), torch.zeros(2, dtype=torch.long, device=device))
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


def _inputs_in(x: Inputs, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> Inputs:
    """The same values in another float dtype (the float64 reference) and/or on another device, with
    ``hidden`` and ``weight`` as fresh leaves."""
    out = {}
    for key, t in x.items():
        t = t.to(device=device, dtype=dtype if t.is_floating_point() else None)
        out[key] = t.detach().requires_grad_() if key in ("hidden", "weight") else t
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
    # A timing reference, not an implementation (see :func:`product_floors`): timed beside the methods, never
    # checked for exactness.
    floor: bool = False
    # Head-sized matrix products ([N, H] x [H, V] each) in one forward+backward: the path's own floor
    # (:func:`own_floor`). The benchmark also counts them by FLOPs where a dispatch mode sees them; ``products_from``
    # says where the number comes from when it cannot (a compiled graph, a custom op).
    products: Optional[int] = None
    products_from: str = ""
    # The head is frozen (no weight gradient): its floors multiply without one.
    frozen: bool = False


FLOOR_HOLDING = "floor: 3 head products (logits held)"
FLOOR_RECOMPUTING = "floor: 4 head products (logits recomputed)"
FLOOR_FROZEN = "floor: 2 head products (frozen head)"
FLOOR_FROZEN_RECOMPUTING = "floor: 3 head products (frozen head, logits recomputed)"
# (products, frozen head) -> the floor row that times exactly those products.
FLOOR_BY_PRODUCTS = {(3, False): FLOOR_HOLDING, (4, False): FLOOR_RECOMPUTING, (2, True): FLOOR_FROZEN,
                     (3, True): FLOOR_FROZEN_RECOMPUTING}


class _HeadProducts(torch.autograd.Function):
    """Only the head-sized matrix products of a log-prob step, none of its softmax maths: the forward's logits
    ``h @ W.T`` and, in the backward, the hidden and weight gradients from a logits-shaped gradient (the logits
    themselves stand in for it). ``recompute``: the backward multiplies the logits again instead of keeping them,
    as any path that never holds ``[N, V]`` logits must for per-token outputs: the weight gradient needs every
    row's softmax normaliser, known only once the forward has seen the whole vocabulary, and its upstream gradient,
    known only in the backward. (A fused scalar loss, whose gradient is known in the forward, can get by with three
    products over row chunks, as Liger's chunked losses do; the outputs benchmarked here are per token.)"""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, recompute: bool):  # type: ignore[override]
        logits = hidden @ weight.t()
        ctx.recompute = recompute
        ctx.save_for_backward(hidden, weight, None if recompute else logits)
        return logits[:, 0].float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hidden, weight, logits = ctx.saved_tensors
        if ctx.recompute:
            logits = hidden @ weight.t()
        return logits @ weight, logits.t() @ hidden if ctx.needs_input_grad[1] else None, None


def _floor(name: str, products: int, frozen: bool, recompute: bool) -> Method:
    return Method(name, lambda x: (_HeadProducts.apply(x["hidden"], x["weight"].detach() if frozen else x["weight"], recompute),),
                  floor=True, products=products, frozen=frozen)


def product_floors(op: str = "logprobs") -> list[Method]:
    """Timing references: the head products alone of each path, beside its time (each method's own floor is the
    one with its product count, :func:`own_floor`). A trainable head: three products where the logits are held
    (the naive path, Cut Cross-Entropy's CPU implementation) or where a scalar loss makes its gradients in the
    forward (lit-memopt's cross-entropy and linear_policy_loss, torch's chunked scalar loss); four where per-token
    outputs recompute them (lit-memopt's tiled pass, TRL's and Liger's chunked log-probs). A frozen head: two
    (the logits and the hidden gradient: the naive path, lit-memopt's frozen pass), three recomputed (torch's
    chunked per-token loss). What no softmax code can win back."""
    if op == "frozen_logprobs":
        return [_floor(FLOOR_FROZEN, 2, True, False), _floor(FLOOR_FROZEN_RECOMPUTING, 3, True, True)]
    holding = _floor(FLOOR_HOLDING, 3, False, False)
    if op == "cross_entropy":  # every method makes three
        return [holding]
    return [holding, _floor(FLOOR_RECOMPUTING, 4, False, True)]


def own_floor(method: Method) -> Optional[str]:
    """The floor row that times ``method``'s own head products (None where its count is unknown)."""
    return None if method.products is None else FLOOR_BY_PRODUCTS.get((method.products, method.frozen))


def methods_for(op: str, dtype: torch.dtype, peers: dict[str, Peer], device: str = "cpu") -> tuple[list[Method], list[dict[str, str]]]:
    """The methods that compute ``op`` on ``device``, and the peers that could not (name, reason).

    Cut Cross-Entropy runs its Triton kernel (``impl="cce"``, its default) on CUDA and its
    ``torch_compile`` implementation elsewhere (its kernel needs a GPU).

    Each method carries its head-product count (:attr:`Method.products`, its own floor). Where the benchmark's
    FLOP count cannot see the products (a compiled graph, a custom op), ``products_from`` says how the number was
    read from the peer's code."""
    cce_impl = "cce" if device == "cuda" else "torch_compile"
    # torch_compile: one compiled graph over full logits (three products, two frozen); cce: a forward that keeps
    # only the log-sum-exp and a backward that multiplies the logits again (four, three frozen).
    cce_products, cce_from = ((3, "read: a compiled full-logits graph") if cce_impl == "torch_compile"
                              else (4, "read: backward recomputes the logits"))
    lit = [(LIT_EXACT, "exact")] + ([(LIT_FAST, "fast")] if dtype in (torch.bfloat16, torch.float16) else [])
    fused_grpo = [(LIT_FUSED_GRPO, "exact")] + ([(LIT_FUSED_GRPO_FAST, "fast")] if dtype in (torch.bfloat16, torch.float16) else [])
    frozen_op = op == "frozen_logprobs"
    methods: list[Method] = []
    absent: list[dict[str, str]] = []

    def add(name: str, fn: Callable[[Inputs], Any], products: int, *, peer: Optional[str] = None,
            grads_in_forward: bool = False, products_from: str = "") -> None:
        methods.append(Method(name, fn, peer, grads_in_forward, products=products, products_from=products_from, frozen=frozen_op))

    def peer_method(peer_name: str, label: str, make: Callable[[dict[str, Any]], Callable[[Inputs], Any]], products: int,
                    grads_in_forward: bool = False, products_from: str = "") -> None:
        peer = peers.get(peer_name)
        if peer is None:
            return
        if peer.available:
            add(label, make(peer.api), products, peer=peer_name, grads_in_forward=grads_in_forward, products_from=products_from)
        else:
            absent.append({"peer": peer_name, "method": label, "error": peer.error or ""})

    # torch's chunked loss: reduction="none" keeps no gradient in the forward, and its backward recomputes each
    # chunk's logits; a scalar reduction makes the gradients in the forward (torch/nn/modules/linear_cross_entropy.py).
    torch_none_from = "read: its per-token backward recomputes each chunk's logits (a custom op hides them)"
    # Liger's fused linear CE makes its gradients in the forward over row chunks (Triton: GPU only).
    liger_from = "read: gradients made in the forward over row chunks"
    if op == "logprobs":
        add(NAIVE, lambda x: (_naive_logprobs(x),), 3)
        for label, precision in lit:
            add(label, lambda x, p=precision: (linear_logprobs(x["hidden"], x["weight"], x["targets"], precision=p),), 4)
        peer_method("torch chunked", "torch F.linear_cross_entropy (chunked)", lambda api: (
            lambda x, lce=api["linear_cross_entropy"], opts=api["options"](): (
                -lce(x["hidden"], x["weight"], x["targets"], reduction="none", options=opts),)), 4, products_from=torch_none_from)
        peer_method("Cut Cross-Entropy", f"Cut Cross-Entropy ({cce_impl})", lambda api: (
            lambda x, lce=api["linear_cross_entropy"]: (
                -lce(x["hidden"], x["weight"], x["targets"], reduction="none", impl=cce_impl),)), cce_products, products_from=cce_from)
        # Positional (autograd Functions take no keywords): bias, ce_weight, ignore_index, lse_square_scale,
        # label_smoothing, reduction; the first output is the per-token loss.
        peer_method("Liger fused linear CE", "Liger fused linear CE", lambda api: (
            lambda x, fn=api["function"]: (-fn.apply(x["hidden"], x["weight"], x["targets"], None, None, -100, 0.0, 0.0, "none")[0],)),
            3, products_from=liger_from)
        peer_method("TRL full logits", "TRL selective_log_softmax", lambda api: (
            lambda x, sls=api["selective_log_softmax"]: (sls(x["hidden"] @ x["weight"].t(), x["targets"]),)), 3)
        peer_method("TRL chunked", "TRL ChunkedLogProbFunction", lambda api: (
            lambda x, fn=api["function"]: (fn.apply(x["hidden"], x["weight"], None, x["targets"], 1.0, 32768, None, 1.0, ())[0],)), 4)
    elif op == "logprobs_entropy":
        add(NAIVE, _naive_logprobs_entropy, 3)
        for label, precision in lit:
            add(label, lambda x, p=precision: linear_logprobs_and_entropy(x["hidden"], x["weight"], x["targets"], precision=p), 4)

        def trl_full(api: dict[str, Any]) -> Callable[[Inputs], Any]:
            def fn(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
                logits = x["hidden"] @ x["weight"].t()
                return api["selective_log_softmax"](logits, x["targets"]), api["entropy_from_logits"](logits)
            return fn

        peer_method("TRL full logits", "TRL selective_log_softmax + entropy_from_logits", trl_full, 3)
        peer_method("TRL chunked", "TRL ChunkedLogProbFunction", lambda api: (
            lambda x, fn=api["function"]: fn.apply(x["hidden"], x["weight"], None, x["targets"], 1.0, 32768, None, 1.0, ("entropy",))[:2]), 4)
    elif op == "grpo":
        add(NAIVE, lambda x: _grpo_from_logprobs(_naive_logprobs(x), x), 3)
        for label, precision in lit:  # per-token log-probs, then the loss: the tiled pass's four products
            add(label, lambda x, p=precision: _grpo_from_logprobs(linear_logprobs(x["hidden"], x["weight"], x["targets"], precision=p), x), 4)

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

        peer_method("Liger chunked_loss", "Liger LigerFusedLinearGRPOLoss", liger_grpo, 4, grads_in_forward=True)
        # TRL's GRPO trainer takes per-token log-probs from the head (full logits and selective_log_softmax, or its
        # chunked kernel behind `fused_lm_head`) and applies its loss inside the trainer; the same loss
        # (ppo_clip_loss, the settings above) is applied here on top of each.
        peer_method("TRL full logits", "TRL selective_log_softmax + GRPO loss", lambda api: (
            lambda x, sls=api["selective_log_softmax"]: _grpo_from_logprobs(sls(x["hidden"] @ x["weight"].t(), x["targets"]), x)), 3)
        peer_method("TRL chunked", "TRL ChunkedLogProbFunction + GRPO loss", lambda api: (
            lambda x, fn=api["function"]: _grpo_from_logprobs(
                fn.apply(x["hidden"], x["weight"], None, x["targets"], 1.0, 32768, None, 1.0, ())[0], x)), 4)
        for label, precision in fused_grpo:  # gradients made in the forward: three products
            add(label, lambda x, p=precision: linear_policy_loss(
                x["hidden"].view(*x["old_logp"].shape, -1), x["weight"], x["targets"].view(x["old_logp"].shape), x["old_logp"],
                x["advantages"], ref_logp=x["ref_logp"], precision=p, **GRPO), 3, grads_in_forward=True)
    elif op == "cross_entropy":  # the SFT loss: mean over tokens, a trainable head
        add(NAIVE, lambda x: F.cross_entropy(_naive_logits(x), x["targets"]), 3)
        for label, precision in lit:
            add(label, lambda x, p=precision: linear_cross_entropy(x["hidden"], x["weight"], x["targets"], reduction="mean", precision=p),
                3, grads_in_forward=True)
        peer_method("torch chunked", "torch F.linear_cross_entropy (chunked)", lambda api: (
            lambda x, lce=api["linear_cross_entropy"], opts=api["options"](): lce(x["hidden"], x["weight"], x["targets"], reduction="mean", options=opts)),
            3, products_from="read: the scalar loss makes its gradients in the forward (a custom op hides them)")
        peer_method("Cut Cross-Entropy", f"Cut Cross-Entropy ({cce_impl})", lambda api: (
            lambda x, lce=api["linear_cross_entropy"]: lce(x["hidden"], x["weight"], x["targets"], reduction="mean", impl=cce_impl)),
            cce_products, products_from=cce_from)
        peer_method("Liger fused linear CE", "Liger fused linear CE", lambda api: (
            lambda x, fn=api["function"]: fn.apply(x["hidden"], x["weight"], x["targets"], None, None, -100, 0.0, 0.0, "mean")[0]),
            3, grads_in_forward=True, products_from=liger_from)
    elif op == "frozen_logprobs":  # a LoRA run's head: weight.requires_grad is False, gradients reach hidden only
        frozen = lambda x: {**x, "weight": x["weight"].detach()}  # noqa: E731
        add(NAIVE, lambda x: (_naive_logprobs(frozen(x)),), 2)
        for label, precision in lit:
            add(label, lambda x, p=precision: (linear_logprobs(x["hidden"], x["weight"].detach(), x["targets"], precision=p),), 2)
        peer_method("torch chunked", "torch F.linear_cross_entropy (chunked)", lambda api: (
            lambda x, lce=api["linear_cross_entropy"], opts=api["options"](): (
                -lce(x["hidden"], x["weight"].detach(), x["targets"], reduction="none", options=opts),)), 3, products_from=torch_none_from)
        # Cut Cross-Entropy with a frozen classifier: no gradient to it, one fewer product than with a trained one.
        peer_method("Cut Cross-Entropy", f"Cut Cross-Entropy ({cce_impl}, frozen classifier)", lambda api: (
            lambda x, lce=api["linear_cross_entropy"]: (
                -lce(x["hidden"], x["weight"].detach(), x["targets"], reduction="none", impl=cce_impl),)), cce_products - 1, products_from=cce_from)
        peer_method("TRL full logits", "TRL selective_log_softmax", lambda api: (
            lambda x, sls=api["selective_log_softmax"]: (sls(x["hidden"] @ x["weight"].detach().t(), x["targets"]),)), 2)
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

