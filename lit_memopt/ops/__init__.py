"""Fused LM-head ops and policy losses that never hold a ``[tokens, vocab]`` tensor."""

from __future__ import annotations

from lit_memopt._lazy import lazy_exports

# name -> submodule (relative to this package). Add new public ops here.
_EXPORTS = {
    "linear_logprobs": ".linear_head",
    "linear_entropy": ".linear_head",
    "linear_logprobs_and_entropy": ".linear_head",
    "linear_self_certainty": ".linear_head",
    "linear_kl": ".linear_head",
    "linear_cross_entropy": ".cross_entropy",
    "linear_policy_loss": ".policy_loss",
    "topk_gumbel_softmax": ".gumbel",
    "soft_embedding": ".gumbel",
    "tr_rpg_loss": ".losses",
    "ppo_clip_loss": ".losses",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
