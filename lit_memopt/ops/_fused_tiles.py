"""The per-tile maths of the fused LM head, written once as plain functions of tensors.

Every head pass (the eager and compiled tiles of ``_head_passes.py``, the whole pass of ``_whole_pass.py`` and the
gradient-in-forward passes of ``_forward_grads.py``) folds its logits tiles and builds its logit gradients with the
functions here: the online-softmax update (:func:`fold_tile`), a tile's logit gradient
(:func:`tile_logit_gradient`), the logit transform and its chain rule (:func:`transform_logits`,
:func:`chain_to_raw`), and the per-row outputs of the finished statistics (:func:`row_outputs`). A pass either
calls them eagerly or through their compiled versions (``torch.compile``); which, is settled per call by
``linear_head.plan_pass`` from the switches of ``_settings.py``.

Why compile: eagerly, folding one logits tile into the running softmax statistics takes about ten elementwise ops
and as many passes over the tile, and building one tile's logit gradient as many again. On a GPU each op is a
kernel launched from Python, and the pass is bound by that Python work per tile. With these functions compiled (a
few fused kernels per tile) and tiles twice as large, bf16 log-probs at a Qwen3-4B head (8192 x 2560 x 151936,
fwd+bwd, H200) took 57 ms against 104 ms for the eager tiles and 42 ms for the naive full-logits path
(``benchmarks/results/peers_cuda_nvidia_h200.md``). They are compiled on CUDA by default, never for fake tensors
(the peak-memory estimator) nor on the CPU unless asked (compiling costs seconds, and the CPU's eager path is
already bound by its exponentials).

The tiled pass's eager tiles on the CPU still run their own in-place forms of :func:`fold_tile` and
:func:`tile_logit_gradient` (``_head_passes._RunningSoftmax.update`` and ``_logit_gradient_``: tile buffers
reused, ``exp2`` for ``exp``), for speed; the tests run both on the same tiles against float64 references. Where the
gradient-in-forward pass holds a block's whole rows and nothing needs the logits after the softmax, it runs the
in-place forms defined here (:func:`softmax_numerators_`, :func:`numerator_gradient_`): one exponential per logit.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lit_memopt._compat.torch import raised_recompile_limit
from lit_memopt.ops._settings import FUSED_TILES_ENV, head_settings


def use_fused_tiles(device: torch.device, fake: bool) -> bool:
    """Whether the head's tiles run through the compiled functions on ``device`` (``LIT_MEMOPT_FUSED_TILES``)."""
    return head_settings().compiled_tiles(device, fake)


def compiled_once(fn: Callable, *, graphs: Optional[int] = None) -> Callable:
    """``fn`` compiled once per process (dynamic shapes: full and edge tiles share one kernel).

    ``graphs``: how many graphs of ``fn`` the compiler may keep (its recompile limit, raised for ``fn``'s calls
    only; torch's default is 8). Past the limit torch runs ``fn`` eagerly for the new case without a word: same
    results, slower. The whole pass (``_whole_pass.py``) compiles a graph per vocabulary tile size and set of
    outputs, and an RL run's changing row counts choose several tile sizes.

    Where compiling fails (no working Triton or C++ compiler, an unsupported device) the process warns
    once and runs ``fn`` eagerly from then on: same results, more passes over each tile. An
    out-of-memory error is never swallowed: OOMRecovery and the caller must see it.
    """
    compiled: Optional[Callable] = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        if compiled is fn:
            return fn(*args, **kwargs)
        try:
            with raised_recompile_limit(graphs):
                return compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager maths are the same
            warnings.warn(
                f"lit_memopt: compiling the fused head's tile kernels failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); running them eagerly from now on "
                f"(same results, slower on a GPU). Set {FUSED_TILES_ENV}=0 to skip the attempt.",
                RuntimeWarning,
                stacklevel=2,
            )
            compiled = fn
            return fn(*args, **kwargs)

    return call


def transform_logits(raw: Tensor, softcap: Optional[float], logit_scale: float, inv_temperature: float, *,
                     out: Optional[Tensor] = None) -> Tensor:
    """``z = softcap(raw * logit_scale) / temperature`` with ``softcap(s) = cap * tanh(s / cap)``.

    ``out=raw`` transforms a tile buffer in place (the eager tiles); ``None`` (compiled graphs) makes a new tensor.
    """
    if softcap is None:
        scale = logit_scale * inv_temperature
        return raw if scale == 1.0 else torch.mul(raw, scale, out=out)
    capped = torch.tanh(torch.mul(raw, logit_scale / softcap, out=out), out=out)
    return torch.mul(capped, softcap * inv_temperature, out=out)


def chain_to_raw(grad_z: Tensor, z: Optional[Tensor], softcap: Optional[float], linear_scale: float,
                 inv_temperature: float, *, out: Optional[Tensor] = None, scratch: Optional[Tensor] = None) -> Tensor:
    """``d/draw`` from ``d/dz`` (the chain rule of :func:`transform_logits`); ``z`` is the transformed tile, needed
    with a softcap only. ``out=grad_z`` works in place and ``scratch`` is a tile buffer for the slope (eager tiles)."""
    if softcap is None:
        return grad_z if linear_scale == 1.0 else torch.mul(grad_z, linear_scale, out=out)
    # dz/draw = logit_scale / T * (1 - tanh^2), and tanh = z * T / cap
    tanh = torch.mul(z, 1.0 / (softcap * inv_temperature), out=scratch)  # a new tensor or the scratch: ours to overwrite
    slope = tanh.square_().neg_().add_(1.0)
    return torch.mul(torch.mul(grad_z, slope, out=out), linear_scale, out=out)


# Each per-row output from the finished statistics of :func:`finish_rows` (``target_z`` where a pass found it).
_ROW_OUTPUTS: dict[str, Callable[[dict[str, Tensor]], Tensor]] = {
    "logprobs": lambda s: s["target_z"] - s["lse"],
    "entropy": lambda s: s["lse"] - s["mu"],
    "self_certainty": lambda s: s["lse"] - s["mean_z"],
    "kl": lambda s: s["mu_d"] - s["lse"] + s["ref_lse"],  # KL(p || q) = E_p[z - z_ref] - lse + lse_ref
    "logsumexp": lambda s: s["lse"],
}


def row_outputs(stats: dict[str, Tensor], names) -> dict[str, Tensor]:
    """The per-row outputs ``names`` (in that order) of a row tile's statistics; ``logsumexp`` is ``stats["lse"]``
    itself, not a copy."""
    return {name: _ROW_OUTPUTS[name](stats) for name in names}


def _hits(z: Tensor, targets: Tensor, v0: int) -> Tensor:
    """``[rows, cols]``: whether column ``c`` of the tile (vocabulary id ``v0 + c``) is the row's target."""
    columns = torch.arange(z.shape[1], device=z.device) + v0
    return columns.unsqueeze(0) == targets.unsqueeze(1)


def start_rows(rows: int, dtype: torch.dtype, device: torch.device, *, entropy: bool, self_certainty: bool,
               logprobs: bool, kl: bool):
    """The running statistics of ``rows`` rows before any tile, in the order :func:`_fold_tile` takes and returns
    them: ``(max, sum, sum_ez, sum_z, target_z, ref_max, ref_sum, sum_ed)``, ``None`` for what no output needs."""
    new = lambda fill: torch.full((rows,), fill, dtype=dtype, device=device)  # noqa: E731
    return (new(-math.inf), new(0.0), new(0.0) if entropy else None, new(0.0) if self_certainty else None,
            new(0.0) if logprobs else None, *((new(-math.inf), new(0.0), new(0.0)) if kl else (None, None, None)))


def finish_rows(run_max: Tensor, run_sum: Tensor, sum_ez: Optional[Tensor], sum_z: Optional[Tensor],
                target_z: Optional[Tensor], ref_max: Optional[Tensor], ref_sum: Optional[Tensor],
                sum_ed: Optional[Tensor], vocab: int) -> dict[str, Tensor]:
    """The per-row statistics of a finished pass from its running ones: ``lse`` and, where accumulated,
    ``mu`` (= E_p[z]), ``mean_z``, ``target_z``, ``ref_lse`` and ``mu_d`` (= E_p[z - z_ref])."""
    stats = {"lse": run_max + torch.log(run_sum)}
    if sum_ez is not None:
        stats["mu"] = sum_ez / run_sum
    if sum_z is not None:
        stats["mean_z"] = sum_z / vocab
    if target_z is not None:
        stats["target_z"] = target_z
    if sum_ed is not None:
        stats["ref_lse"] = ref_max + torch.log(ref_sum)
        stats["mu_d"] = sum_ed / run_sum
    return stats


def softmax_numerators_(block: Tensor, tiles: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """Overwrite a held block of logits ``z`` (``[rows, V]``, every column) with ``e = exp(z - max_v z)``, tile
    by tile, and return ``(row max, row sums of e)``: ``lse = max + log(sum)`` and ``p = e / sum``.

    One exponential per logit, where a pass that cannot hold the row (:func:`_fold_tile`'s running softmax,
    then :func:`_tile_logit_gradient`'s ``p``) takes two. ``tiles`` are the ``(v0, v1)`` column ranges that
    cover the block, cache-sized so each is read and written once while it is in cache.
    """
    row_max = block.amax(1)
    sums = torch.zeros_like(row_max)
    shift = row_max.unsqueeze(1)
    for v0, v1 in tiles:
        sums += block[:, v0:v1].sub_(shift).exp_().sum(1)
    return row_max, sums


def numerator_gradient_(numerators: Tensor, row_scale: Tensor, row_shift: Optional[Tensor]) -> Tensor:
    """``d out / d raw`` in place over a tile of :func:`softmax_numerators_`, for outputs whose logit gradient
    is ``alpha p - uniform`` (log-prob without its one-hot term, self-certainty, logsumexp: no softcap, no
    entropy, whose gradients need ``z`` itself). ``row_scale`` is ``alpha / sum`` and ``row_shift``
    ``uniform``, both ``[rows, 1]`` and already through :func:`chain_to_raw`."""
    numerators.mul_(row_scale)
    return numerators if row_shift is None else numerators.sub_(row_shift)


def add_target_term_(grad_tile: Tensor, targets: Tensor, at_target: Tensor, v0: int, v1: int, vocab: int) -> Tensor:
    """Add each row's one-hot term ``at_target`` (``[rows, 1]``, already through :func:`chain_to_raw`) in place at its
    target's column of a held block's gradient tile of vocabulary ids ``v0 ... v1 - 1`` (of ``vocab``); rows whose
    target lies in another tile add nothing here. One scatter of ``rows`` values per tile, where adding the term after
    the products (``W[y]`` gathered, and ``h`` scattered into the weight gradient) costs ``rows x hidden`` three times:
    at a small vocabulary that is most of the call."""
    if v0 == 0 and v1 == vocab:
        return grad_tile.scatter_add_(1, targets.unsqueeze(1), at_target)
    inside = ((targets >= v0) & (targets < v1)).unsqueeze(1)
    columns = (targets - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1)
    return grad_tile.scatter_add_(1, columns, at_target * inside)


def _fold_tile(z: Tensor, ref_z: Optional[Tensor], run_max: Tensor, run_sum: Tensor, sum_ez: Optional[Tensor],
               sum_z: Optional[Tensor], target_z: Optional[Tensor], targets: Optional[Tensor], v0: int,
               ref_max: Optional[Tensor], ref_sum: Optional[Tensor], sum_ed: Optional[Tensor]):
    """Online-softmax update of one row tile's statistics with the logits tile ``z`` of vocabulary ids
    ``v0 ...`` (see ``_RunningSoftmax``); ``targets`` are the rows' target ids.

    Returns the new ``(max, sum, sum_ez, sum_z, target_z, ref_max, ref_sum, sum_ed)``; ``None`` stays ``None``.
    """
    new_max = torch.maximum(run_max, z.amax(1))
    rescale = torch.exp(run_max - new_max)
    e = torch.exp(z - new_max.unsqueeze(1))
    new_sum = run_sum * rescale + e.sum(1)
    if sum_ez is not None:
        sum_ez = sum_ez * rescale + (e * z).sum(1)
    if sum_z is not None:
        sum_z = sum_z + z.sum(1)
    if target_z is not None:
        inside = (targets >= v0) & (targets < v0 + z.shape[1])
        picked = torch.where(_hits(z, targets, v0), z, torch.zeros((), dtype=z.dtype, device=z.device)).sum(1)
        target_z = torch.where(inside, picked, target_z)
    if ref_z is not None:
        new_ref_max = torch.maximum(ref_max, ref_z.amax(1))
        ref_sum = ref_sum * torch.exp(ref_max - new_ref_max) + torch.exp(ref_z - new_ref_max.unsqueeze(1)).sum(1)
        ref_max = new_ref_max
        sum_ed = sum_ed * rescale + ((z - ref_z) * e).sum(1)
    return new_max, new_sum, sum_ez, sum_z, target_z, ref_max, ref_sum, sum_ed


def _tile_logit_gradient(z: Tensor, ref_z: Optional[Tensor], lse: Tensor, mu: Optional[Tensor], mu_d: Optional[Tensor],
                         alpha: Tensor, g_ent: Optional[Tensor], g_kl: Optional[Tensor], uniform: Optional[Tensor],
                         g_lp: Optional[Tensor], targets: Optional[Tensor], v0: int,
                         softcap: Optional[float], linear_scale: float, inv_temperature: float,
                         out_dtype: torch.dtype, want_column_sums: bool):
    """``d out / d raw`` of one tile in ``out_dtype`` (the matmul operand), and its column sums in ``z``'s
    dtype when ``want_column_sums`` (the bias gradient). Arguments are row slices ``[rows]`` of the
    per-row statistics and coefficients of ``_RowGradients``; ``z`` is the transformed logits tile of
    vocabulary ids ``v0 ...`` and ``targets`` the rows' target ids."""
    p = torch.exp(z - lse.unsqueeze(1))
    coefficient = alpha.unsqueeze(1)
    if g_kl is not None:
        coefficient = coefficient + (z - ref_z - mu_d.unsqueeze(1)) * g_kl.unsqueeze(1)
    if g_ent is not None:
        coefficient = coefficient + (mu.unsqueeze(1) - z) * g_ent.unsqueeze(1)
    grad = p * coefficient
    if uniform is not None:
        grad = grad - uniform.unsqueeze(1)
    if g_lp is not None:
        grad = grad + torch.where(_hits(z, targets, v0), g_lp.unsqueeze(1), torch.zeros((), dtype=grad.dtype, device=grad.device))
    grad = chain_to_raw(grad, z, softcap, linear_scale, inv_temperature)
    return grad.to(out_dtype), (grad.sum(0) if want_column_sums else None)


fold_tile = compiled_once(_fold_tile)
tile_logit_gradient = compiled_once(_tile_logit_gradient)
