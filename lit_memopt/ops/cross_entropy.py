"""Fused linear cross-entropy (label smoothing, z-loss, reductions) on top of the tiled head pass."""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from lit_memopt.ops._head_tiles import ChunkSize, check_mask
from lit_memopt.ops.linear_head import run_head

__all__ = ["linear_cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def _check_fraction(name: str, value: object, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0.0 <= value <= upper:
        raise ValueError(f"`{name}` must be a number in [0, {upper:g}], got {value!r}")
    return float(value)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    mask: Optional[Tensor] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: Optional[float] = None,
    chunk_size: ChunkSize = None,
    precision: str = "auto",
) -> Tensor:
    """Cross-entropy of ``targets`` under the LM head, without ever holding ``[tokens, vocab]`` logits.

    Per counted row: ``(1 - eps) * (lse - z_target) + eps * (lse - mean_v z_v) + z_loss * lse**2``,
    i.e. ``torch.nn.functional.cross_entropy(..., label_smoothing=eps)`` plus the PaLM z-loss, where
    ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature``.

    Args:
        hidden: ``[..., H]`` final hidden states. This and ``weight``, ``targets``, ``bias``, ``ignore_index``,
            ``mask``, ``temperature``, ``logit_scale``, ``final_logit_softcapping``, ``chunk_size`` and
            ``precision`` are as in :func:`linear_logprobs`.
        reduction: ``"mean"`` (over counted rows; 0 when none count), ``"sum"`` or ``"none"`` (per row, 0 where ignored).
        label_smoothing: ``eps`` in [0, 1].
        z_loss: coefficient (>= 0) of ``logsumexp(z)**2``.

    Returns:
        fp32 scalar (or ``[...]`` for ``reduction="none"``); float64 for float64 inputs.

    Raises:
        ValueError: unknown ``reduction``, ``label_smoothing`` outside [0, 1], ``z_loss < 0``, and
        everything :func:`linear_logprobs` rejects.

    Example::

        loss = linear_cross_entropy(hidden, model.lm_head.weight, labels, label_smoothing=0.1, z_loss=1e-4)
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}")
    eps = _check_fraction("label_smoothing", label_smoothing, 1.0)
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"`z_loss` must be a finite number >= 0, got {z_loss!r}")
    outputs = ("logprobs",) + (("self_certainty",) if eps > 0 else ()) + (("logsumexp",) if z_loss > 0 else ())
    common = dict(bias=bias, temperature=temperature, chunk_size=chunk_size, ignore_index=ignore_index, mask=mask,
                  logit_scale=logit_scale, final_logit_softcapping=final_logit_softcapping, precision=precision)

    def per_row(results: dict[str, Tensor]) -> Tensor:
        loss = -results["logprobs"] if eps == 0 else -(1.0 - eps) * results["logprobs"] + eps * results["self_certainty"]
        return loss + z_loss * results["logsumexp"].square() if z_loss > 0 else loss

    if reduction == "none":
        # Rows excluded by ignore_index / mask come back as exact zeros from run_head.
        return per_row(dict(zip(outputs, run_head(hidden, weight, targets, outputs, **common))))
    count = None
    if reduction == "mean":
        counted = targets != ignore_index
        m = check_mask(mask, hidden)
        if m is not None:
            counted = counted & m
        count = counted.sum().clamp_min(1)

    def share(results: dict[str, Tensor], _: dict[str, Tensor]) -> Tensor:
        total = per_row(results).sum()
        return total if count is None else total / count.to(total.dtype)

    # A scalar: run_head makes its gradients in the forward where a backward will come (three head products, or
    # two for a frozen head), and otherwise sums the rows of the tiled pass; the maths are per_row's either way.
    return run_head(hidden, weight, targets, outputs, row_loss=share, **common)[0]
