"""The per-tile softmax maths of the fused LM head as pure functions, compiled into fused kernels on CUDA.

Eagerly, folding one logits tile into the running softmax statistics takes about ten elementwise ops
and as many passes over the tile, and building one tile's logit gradient as many again. On a GPU
each op is a kernel launched from Python, and the pass is bound by that Python work per tile. With
these functions compiled (``torch.compile``: a few fused kernels per tile) and tiles twice as large,
bf16 log-probs at a Qwen3-4B head (8192 x 2560 x 151936, fwd+bwd, H200) took 57 ms against 104 ms
for the eager tiles and 42 ms for the naive full-logits path
(``benchmarks/results/peers_cuda_nvidia_h200.md``).

The functions are the same maths as the eager code in ``linear_head.py`` (``_RunningSoftmax.update``
and ``_logit_gradient_``), written without in-place tricks so that the compiler can fuse them; the
tests run both on the same tiles. :func:`use_fused_tiles` decides where they run: on CUDA by
default, never on fake tensors (the peak-memory estimator) nor on the CPU unless asked
(compiling costs seconds, and the CPU's eager path is already bound by its exponentials).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from lit_memopt._compat.torch import raised_recompile_limit

# ``LIT_MEMOPT_FUSED_TILES``: "auto" (default: CUDA only), "1" (everywhere torch.compile works), "0" (never).
_ENV = "LIT_MEMOPT_FUSED_TILES"
_MODES = ("auto", "0", "1")


def use_fused_tiles(device: torch.device, fake: bool) -> bool:
    """Whether the head's tiles run through the compiled functions on ``device``."""
    mode = os.environ.get(_ENV, "auto")
    if mode not in _MODES:
        raise ValueError(f"{_ENV} must be one of {_MODES}, got {mode!r}")
    if fake or mode == "0":
        return False
    return mode == "1" or device.type == "cuda"


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
                f"(same results, slower on a GPU). Set {_ENV}=0 to skip the attempt.",
                RuntimeWarning,
                stacklevel=2,
            )
            compiled = fn
            return fn(*args, **kwargs)

    return call


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
    if softcap is not None:  # dz/draw = logit_scale / T * (1 - tanh^2), tanh = z * T / cap
        tanh = z * (1.0 / (softcap * inv_temperature))
        grad = grad * (1.0 - tanh * tanh) * linear_scale
    elif linear_scale != 1.0:
        grad = grad * linear_scale
    return grad.to(out_dtype), (grad.sum(0) if want_column_sums else None)


fold_tile = compiled_once(_fold_tile)
tile_logit_gradient = compiled_once(_tile_logit_gradient)
