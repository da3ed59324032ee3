"""Policy-gradient losses on per-token (or per-sequence) log-probs: CRSP's TR-RPG and the
PPO/GRPO clipped surrogate with a k3 KL penalty."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["tr_rpg_loss", "ppo_clip_loss"]


def _check_logps(name: str, t: object, like: Optional[Tensor] = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {t.dtype}")
    if like is not None:
        if t.shape != like.shape:
            raise ValueError(f"`{name}` must have the shape of `logp_new` {tuple(like.shape)}, got {tuple(t.shape)}")
        if t.device != like.device:
            raise ValueError(f"`{name}` is on {t.device} but `logp_new` is on {like.device}")
    elif t.dim() not in (1, 2):
        raise ValueError(f"`{name}` must be [B] (per sequence) or [B, T] (per token), got shape {tuple(t.shape)}")
    return t


def _check_per_sequence_or_token(name: str, t: object, logp_new: Tensor) -> Tensor:
    """Accept ``[B]`` (broadcast over tokens) or exactly ``logp_new``'s shape."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != logp_new.device:
        raise ValueError(f"`{name}` is on {t.device} but `logp_new` is on {logp_new.device}")
    if t.shape == logp_new.shape:
        return t
    if t.shape == logp_new.shape[:1]:
        return t.reshape(t.shape + (1,) * (logp_new.dim() - 1))
    raise ValueError(
        f"`{name}` must have shape {tuple(logp_new.shape[:1])} (one per sequence) or {tuple(logp_new.shape)}, got {tuple(t.shape)}"
    )


def _check_mask(mask: Optional[Tensor], logp_new: Tensor) -> Optional[Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"`mask` must be a torch.Tensor (bool or 0/1), got {type(mask).__name__}")
    if mask.shape != logp_new.shape:
        raise ValueError(f"`mask` must have the shape of `logp_new` {tuple(logp_new.shape)}, got {tuple(mask.shape)}")
    if mask.device != logp_new.device:
        raise ValueError(f"`mask` is on {mask.device} but `logp_new` is on {logp_new.device}")
    return mask


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _masked_mean(values: Tensor, mask: Optional[Tensor]) -> Tensor:
    if mask is None:
        return values.mean()
    m = mask.to(values.dtype)
    # An all-padding batch gives 0 rather than NaN.
    return (values * m).sum() / m.sum().clamp_min(1.0)


def tr_rpg_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    rewards: Tensor,
    beta: float,
    *,
    mask: Optional[Tensor] = None,
    clamp: float = 2.3,
) -> Tensor:
    """Task-relative regularized policy-gradient loss (CRSP): ``mean(w * (-R + beta * log w))``.

    ``log w = clamp(logp_new - logp_old, -clamp, clamp)`` is the (clipped) log importance weight of
    the current policy against the sampling policy. Its gradient with respect to ``logp_new`` is
    ``-w * (R - beta * (log w + 1))`` inside the clamp and 0 outside, i.e. a reward-weighted policy
    gradient with a KL(pi || pi_old) regularizer of strength ``beta``.

    Args:
        logp_new: ``[B]`` sequence log-probs, or ``[B, T]`` token log-probs, under the current policy.
        logp_old: same shape, under the policy that sampled the data (treated as a constant).
        rewards: ``[B]`` rewards (or ``logp_new``'s shape); treated as constants. For ``[B, T]``
            inputs each sequence's reward applies to each of its tokens.
        beta: regularization strength, ``>= 0``.
        mask: optional, ``logp_new``'s shape; 1/True marks positions that count. The loss is the
            mean over counted positions (tokens for ``[B, T]``).
        clamp: bound on ``|log w|``, ``> 0``.

    Returns:
        A scalar (fp32, or float64 for float64 inputs).

    Raises:
        TypeError, ValueError: bad shapes, dtypes, devices, or ``beta < 0`` / ``clamp <= 0``.

    Example::

        loss = tr_rpg_loss(seq_logp, seq_logp.detach(), rewards, beta=0.05)
    """
    _check_logps("logp_new", logp_new)
    _check_logps("logp_old", logp_old, like=logp_new)
    rewards = _check_per_sequence_or_token("rewards", rewards, logp_new)
    mask = _check_mask(mask, logp_new)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"`beta` must be a finite number >= 0, got {beta!r}")
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp > 0:
        raise ValueError(f"`clamp` must be a number > 0, got {clamp!r}")

    dtype = _compute_dtype(logp_new)
    per_position = tr_rpg_per_position(logp_new.to(dtype), logp_old.detach().to(dtype), rewards.detach().to(dtype), beta, clamp)
    return _masked_mean(per_position, mask)


def tr_rpg_per_position(new: Tensor, old: Tensor, rewards: Tensor, beta: float, clamp: float) -> Tensor:
    """``w * (beta * log w - R)`` with ``log w = clamp(new - old)``: :func:`tr_rpg_loss` before its mean (and the
    fused ``linear_policy_loss``'s, on blocks of rows)."""
    log_w = (new - old).clamp(-clamp, clamp)
    return log_w.exp() * (beta * log_w - rewards)


LOSS_TYPES = ("bnpo", "grpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")


def _check_number(name: str, value: object, *, lower: float, strict: bool) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= lower if strict else value < lower):
        raise ValueError(f"`{name}` must be a finite number {'>' if strict else '>='} {lower:g}, got {value!r}")
    return float(value)


def token_weights(like: Tensor, mask: Optional[Tensor], loss_type: str, num_items_in_batch: Optional[float],
                  max_completion_length: Optional[int]) -> Tensor:
    """Each position's weight in the loss, ``like``'s shape and dtype: the GRPO variants (see :func:`ppo_clip_loss`)
    all reduce per-token losses to ``sum(per_token * weights)``, weights that depend on the mask alone. The fused
    ``linear_policy_loss`` needs them before it has seen every token."""
    m = torch.ones_like(like) if mask is None else mask.to(like.dtype)
    if loss_type == "grpo" and like.dim() == 2:
        # mean over each sequence's own tokens, then over sequences
        return m / (m.sum(-1, keepdim=True).clamp_min(1.0) * like.shape[0])
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else (like.shape[-1] if like.dim() == 2 else 1)
        return m / (like.shape[0] * length)
    if num_items_in_batch is not None:  # bnpo / dapo over a batch larger than this call sees
        return m / num_items_in_batch
    return m / m.sum().clamp_min(1.0)


def _aggregate(per_token: Tensor, mask: Optional[Tensor], loss_type: str, num_items_in_batch: Optional[float],
               max_completion_length: Optional[int]) -> Tensor:
    """Reduce per-token losses the way each GRPO variant does (see :func:`ppo_clip_loss`)."""
    return (per_token * token_weights(per_token, mask, loss_type, num_items_in_batch, max_completion_length)).sum()


def ppo_per_token(new: Tensor, log_ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                  ref_logp: Optional[Tensor], kl_coef: float) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(per-token loss, ratio, k3)`` of :func:`ppo_clip_loss` before its reduction (and of the fused
    ``linear_policy_loss``, on blocks of rows): the clipped surrogate plus ``kl_coef`` times k3."""
    ratio = log_ratio.exp()
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages)
    per_token = -surrogate.expand_as(new) if surrogate.shape != new.shape else -surrogate
    k3 = None
    if ref_logp is not None:
        log_ref_ratio = ref_logp - new
        k3 = log_ref_ratio.exp() - log_ref_ratio - 1.0
        if kl_coef > 0:
            per_token = per_token + kl_coef * k3
    return per_token, ratio, k3


def ppo_clip_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    *,
    clip_eps: float = 0.2,
    mask: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    clip_eps_high: Optional[float] = None,
    loss_type: str = "bnpo",
    importance_sampling_level: str = "token",
    num_items_in_batch: Optional[Union[int, float, Tensor]] = None,
    max_completion_length: Optional[int] = None,
    return_metrics: bool = False,
) -> Union[Tensor, tuple[Tensor, dict[str, Tensor]]]:
    """PPO / GRPO clipped surrogate with an optional k3 KL penalty and the usual GRPO variants.

    Per token: ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` with ``r = exp(logp_new - logp_old)``,
    plus ``kl_coef * (exp(ref - new) - (ref - new) - 1)``, the non-negative, low-variance "k3"
    estimator of KL(pi || pi_ref).

    Args:
        logp_new: ``[B, T]`` (or ``[B]``) log-probs under the current policy.
        logp_old: same shape, under the sampling policy (constant).
        advantages: ``[B]`` (one per sequence, broadcast over tokens) or ``logp_new``'s shape (constant).
        clip_eps: lower clip range ``eps_low`` (and the upper one unless ``clip_eps_high`` is given), ``> 0``.
        mask: optional ``logp_new``-shaped bool/0-1 tensor of tokens that count.
        ref_logp: reference-policy log-probs, ``logp_new``'s shape (constant); required when ``kl_coef > 0``.
        kl_coef: weight of the k3 KL term, ``>= 0``.
        clip_eps_high: upper clip range ``eps_high`` (DAPO's clip-higher), ``> 0``; ``None`` means ``clip_eps``.
        loss_type: how token losses become one number: ``"bnpo"`` (default; mean over the counted
            tokens of the batch), ``"grpo"`` (mean per sequence, then over sequences), ``"dr_grpo"``
            (sum over ``B * max_completion_length``), ``"dapo"`` (sum over ``num_items_in_batch``,
            the counted tokens of the whole global batch; the local count when not given).
        importance_sampling_level: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO: one ratio per
            sequence, ``exp(mean_t(logp_new - logp_old))`` over its counted tokens).
        num_items_in_batch: counted tokens across all micro-batches and ranks (``"bnpo"``/``"dapo"``), ``> 0``.
        max_completion_length: the ``"dr_grpo"`` constant; default ``logp_new.shape[-1]``.
        return_metrics: also return detached metrics: ``clip_ratio``, ``clip_ratio_low``,
            ``clip_ratio_high`` (fractions of counted tokens whose gradient the clip removes),
            ``ratio_mean`` and, with ``ref_logp``, ``kl`` (mean k3 over counted tokens).

    Returns:
        A scalar (fp32, or float64 for float64 inputs); ``(loss, metrics)`` with ``return_metrics``.

    Raises:
        TypeError, ValueError: bad shapes, dtypes, devices, clip ranges, ``kl_coef < 0``, ``kl_coef > 0``
            without ``ref_logp``, an unknown ``loss_type`` / ``importance_sampling_level``, or
            ``num_items_in_batch`` with ``"grpo"`` / ``"dr_grpo"``.

    Example::

        loss, metrics = ppo_clip_loss(logp, old_logp, adv, mask=completion_mask, clip_eps_high=0.28,
                                      loss_type="dapo", num_items_in_batch=tokens_in_step, return_metrics=True)
    """
    _check_logps("logp_new", logp_new)
    _check_logps("logp_old", logp_old, like=logp_new)
    advantages = _check_per_sequence_or_token("advantages", advantages, logp_new)
    mask = _check_mask(mask, logp_new)
    eps_low = _check_number("clip_eps", clip_eps, lower=0.0, strict=True)
    eps_high = eps_low if clip_eps_high is None else _check_number("clip_eps_high", clip_eps_high, lower=0.0, strict=True)
    kl_coef = _check_number("kl_coef", kl_coef, lower=0.0, strict=False)
    if ref_logp is not None:
        _check_logps("ref_logp", ref_logp, like=logp_new)
    elif kl_coef > 0:
        raise ValueError("`ref_logp` is required when `kl_coef` > 0 (the KL penalty needs reference log-probs)")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"`importance_sampling_level` must be one of {IMPORTANCE_LEVELS}, got {importance_sampling_level!r}")
    if num_items_in_batch is not None:
        if loss_type in ("grpo", "dr_grpo"):
            raise ValueError(f"`num_items_in_batch` applies to loss_type 'bnpo' or 'dapo', not {loss_type!r}")
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = float(num_items_in_batch.item())
        num_items_in_batch = _check_number("num_items_in_batch", num_items_in_batch, lower=0.0, strict=True)
    if max_completion_length is not None and (isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int) or max_completion_length < 1):
        raise ValueError(f"`max_completion_length` must be an int >= 1, got {max_completion_length!r}")

    dtype = _compute_dtype(logp_new)
    new = logp_new.to(dtype)
    adv = advantages.detach().to(dtype)
    log_ratio = new - logp_old.detach().to(dtype)
    if importance_sampling_level == "sequence" and new.dim() == 2:
        m = torch.ones_like(new) if mask is None else mask.to(dtype)
        log_ratio = ((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0))
    ref = None if ref_logp is None else ref_logp.detach().to(dtype)
    per_token, ratio, k3 = ppo_per_token(new, log_ratio, adv, eps_low, eps_high, ref, kl_coef)
    loss = _aggregate(per_token, mask, loss_type, num_items_in_batch, max_completion_length)
    if not return_metrics:
        return loss
    with torch.no_grad():
        r = ratio.expand_as(new)
        a = adv.expand_as(new)
        metrics = {
            "clip_ratio_low": _masked_mean(((r < 1.0 - eps_low) & (a < 0)).to(dtype), mask),
            "clip_ratio_high": _masked_mean(((r > 1.0 + eps_high) & (a > 0)).to(dtype), mask),
            "ratio_mean": _masked_mean(r, mask),
        }
        metrics["clip_ratio"] = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
        if k3 is not None:
            metrics["kl"] = _masked_mean(k3.detach(), mask)
    return loss, metrics
