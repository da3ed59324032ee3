"""The GRPO/PPO and TR-RPG policy losses computed from hidden states and the head weight in one fused call, so
that their gradients are made in the forward pass (three head products, two for a frozen head)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from lit_memopt.ops._head_tiles import ChunkSize, check_float
from lit_memopt.ops.linear_head import linear_logprobs, run_head
from lit_memopt.ops.losses import ppo_clip_loss, ppo_per_token, token_weights, tr_rpg_loss, tr_rpg_per_position

__all__ = ["linear_policy_loss"]

OBJECTIVES = ("ppo_clip", "tr_rpg")


def linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    *,
    objective: str = "ppo_clip",
    mask: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    loss_type: str = "bnpo",
    importance_sampling_level: str = "token",
    num_items_in_batch: Optional[Union[int, float, Tensor]] = None,
    max_completion_length: Optional[int] = None,
    beta: float = 0.0,
    clamp: float = 2.3,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: Optional[float] = None,
    chunk_size: ChunkSize = None,
    precision: str = "auto",
) -> Tensor:
    """``ppo_clip_loss(linear_logprobs(hidden, weight, targets), logp_old, advantages, ...)`` (``objective="ppo_clip"``:
    PPO, GRPO and its variants, DAPO, Intuitor's self-certainty advantages) or
    ``tr_rpg_loss(linear_logprobs(...), logp_old, advantages, beta, ...)`` (``"tr_rpg"``: CRSP, ``advantages`` being
    the rewards), as one fused call whose gradients are made in the forward.

    Each token's loss depends on its own log-prob, and its weight in the reduction on the mask alone, so every
    row's upstream gradient is known once its softmax is: the hidden and weight gradients are made while each
    logits block is live and backward only scales them. GSPO (``importance_sampling_level="sequence"``) couples the
    tokens of a sequence; it runs as the two calls above (a stated fallback, four head products).

    Args:
        hidden: ``[B, T, H]`` (or ``[N, H]``) final hidden states. This and ``weight``, ``targets``, ``bias``,
            ``temperature``, ``logit_scale``, ``final_logit_softcapping``, ``chunk_size`` and ``precision`` are as
            in :func:`lit_memopt.ops.linear_logprobs`. Rows whose target is -100 count for nothing, as rows
            outside ``mask`` do.
        logp_old: the sampling policy's log-probs, ``hidden``'s leading shape. This and ``advantages``, ``mask``,
            ``ref_logp``, ``kl_coef``, ``clip_eps``, ``clip_eps_high``, ``loss_type``, ``importance_sampling_level``,
            ``num_items_in_batch`` and ``max_completion_length`` are as in :func:`lit_memopt.ops.ppo_clip_loss`.
        objective: ``"ppo_clip"`` or ``"tr_rpg"``.
        beta: as in :func:`lit_memopt.ops.tr_rpg_loss`, with ``clamp`` (``objective="tr_rpg"``; per-token rewards
            or one per sequence).

    Returns:
        A scalar (fp32; float64 for float64 inputs).

    Raises:
        ValueError, TypeError: an unknown ``objective``, and whatever the two calls above reject.

    Example::

        loss = linear_policy_loss(hidden, model.lm_head.weight, completion_ids, old_logp, advantages,
                                  mask=completion_mask, ref_logp=ref_logp, kl_coef=0.04, loss_type="dapo")
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"`objective` must be one of {OBJECTIVES}, got {objective!r}")
    check_float("hidden", hidden, 1)
    check_float("weight", weight, 2)
    dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    # The plain losses check every loss argument (same messages) on a stand-in for the log-probs: cheap, [B, T].
    probe = torch.zeros(hidden.shape[:-1], dtype=dtype, device=hidden.device)
    head = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, final_logit_softcapping=final_logit_softcapping,
                chunk_size=chunk_size, precision=precision)
    if objective == "ppo_clip":
        loss_args = dict(clip_eps=clip_eps, mask=mask, ref_logp=ref_logp, kl_coef=kl_coef, clip_eps_high=clip_eps_high,
                         loss_type=loss_type, importance_sampling_level=importance_sampling_level,
                         num_items_in_batch=num_items_in_batch, max_completion_length=max_completion_length)
        ppo_clip_loss(probe, logp_old, advantages, **loss_args)
        if importance_sampling_level == "sequence" and probe.dim() == 2:
            return ppo_clip_loss(linear_logprobs(hidden, weight, targets, **head), logp_old, advantages, **loss_args)
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = float(num_items_in_batch.item())
        weights = token_weights(probe, mask, loss_type, num_items_in_batch, max_completion_length)
    else:
        tr_rpg_loss(probe, logp_old, advantages, beta, mask=mask, clamp=clamp)
        weights = token_weights(probe, mask, "bnpo", None, None)  # tr_rpg_loss's masked mean
    per_sequence = advantages.shape != probe.shape
    expanded = advantages.reshape(advantages.shape + (1,) * (probe.dim() - 1)) if per_sequence else advantages
    constants = {"old": logp_old.detach().to(dtype), "adv": expanded.detach().to(dtype).expand_as(probe), "w": weights}
    if objective == "ppo_clip" and ref_logp is not None:
        constants["ref"] = ref_logp.detach().to(dtype)
    eps_low = float(clip_eps)
    eps_high = eps_low if clip_eps_high is None else float(clip_eps_high)

    def share(results: dict[str, Tensor], c: dict[str, Tensor]) -> Tensor:
        new = results["logprobs"]
        if objective == "ppo_clip":
            per_token = ppo_per_token(new, new - c["old"], c["adv"], eps_low, eps_high, c.get("ref"), float(kl_coef))[0]
        else:
            per_token = tr_rpg_per_position(new, c["old"], c["adv"], float(beta), float(clamp))
        return (per_token * c["w"]).sum()

    return run_head(hidden, weight, targets, ("logprobs",), mask=mask, row_loss=share, row_constants=constants, **head)[0]
