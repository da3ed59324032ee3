"""Policy-gradient losses on per-token (or per-sequence) log-probs: CRSP's TR-RPG and the
PPO/GRPO clipped surrogate with a k3 KL penalty."""

from __future__ import annotations

import math
from typing import Optional

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
    log_w = (logp_new.to(dtype) - logp_old.detach().to(dtype)).clamp(-clamp, clamp)
    w = log_w.exp()
    per_position = w * (beta * log_w - rewards.detach().to(dtype))
    return _masked_mean(per_position, mask)


def ppo_clip_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    *,
    clip_eps: float = 0.2,
    mask: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """PPO / GRPO clipped surrogate with an optional k3 KL penalty, averaged over valid tokens.

    Per token: ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with ``r = exp(logp_new - logp_old)``,
    plus ``kl_coef * (exp(ref - new) - (ref - new) - 1)``, the non-negative, low-variance "k3"
    estimator of KL(pi || pi_ref). The result is the mean over all valid tokens of the batch
    (token-mean aggregation).

    Args:
        logp_new: ``[B, T]`` (or ``[B]``) log-probs under the current policy.
        logp_old: same shape, under the sampling policy (constant).
        advantages: ``[B]`` (one per sequence, broadcast over tokens) or ``logp_new``'s shape (constant).
        clip_eps: clip range, ``> 0``.
        mask: optional ``logp_new``-shaped bool/0-1 tensor of tokens that count.
        ref_logp: reference-policy log-probs, ``logp_new``'s shape (constant); required when ``kl_coef > 0``.
        kl_coef: weight of the k3 KL term, ``>= 0``.

    Returns:
        A scalar (fp32, or float64 for float64 inputs).

    Raises:
        TypeError, ValueError: bad shapes, dtypes, devices, ``clip_eps <= 0``, ``kl_coef < 0``, or
        ``kl_coef > 0`` without ``ref_logp``.

    Example::

        loss = ppo_clip_loss(logp, old_logp, adv, mask=completion_mask, ref_logp=ref, kl_coef=0.04)
    """
    _check_logps("logp_new", logp_new)
    _check_logps("logp_old", logp_old, like=logp_new)
    advantages = _check_per_sequence_or_token("advantages", advantages, logp_new)
    mask = _check_mask(mask, logp_new)
    if isinstance(clip_eps, bool) or not isinstance(clip_eps, (int, float)) or not clip_eps > 0:
        raise ValueError(f"`clip_eps` must be a number > 0, got {clip_eps!r}")
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"`kl_coef` must be a finite number >= 0, got {kl_coef!r}")
    if ref_logp is not None:
        _check_logps("ref_logp", ref_logp, like=logp_new)
    elif kl_coef > 0:
        raise ValueError("`ref_logp` is required when `kl_coef` > 0 (the KL penalty needs reference log-probs)")

    dtype = _compute_dtype(logp_new)
    new = logp_new.to(dtype)
    adv = advantages.detach().to(dtype)
    ratio = (new - logp_old.detach().to(dtype)).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    per_token = -surrogate
    if ref_logp is not None and kl_coef > 0:
        log_ref_ratio = ref_logp.detach().to(dtype) - new
        per_token = per_token + kl_coef * (log_ref_ratio.exp() - log_ref_ratio - 1.0)
    return _masked_mean(per_token, mask)
