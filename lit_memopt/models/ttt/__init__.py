"""Test-time-training (TTT) sequence layers, a small TTT language model, and gated TTT branches for
pretrained transformers causal LMs (Sun et al., "Learning to (Learn at Test Time)", 2024).

A TTT layer keeps a small model ``f(.; W)`` (linear, or a two-layer MLP) as its hidden state and
trains it on the sequence itself with one gradient step per mini-batch of ``b`` tokens. For head
``h`` and a mini-batch with keys ``K``, values ``V`` and queries ``Q`` (rows ``k_j``, ``v_j``, ``q_i``):

* inner loss: ``l_j(W) = 0.5 * || LN(f(k_j; W)) - (v_j - k_j) ||^2`` with a learnable per-head
  LayerNorm ``LN`` (the layer-normalised reconstruction target of the paper);
* per-token inner learning rate: ``lr_j = base_lr * sigmoid(theta_h . x_j + beta_h) / head_dim``
  (a learned projection of the token), scaled by the token-index factor
  ``s_i = max(1 / (i + 1) + delta_i, 0)`` with learnable ``delta``;
* mini-batch update (all gradients taken at the mini-batch's initial state ``W0``):
  ``W_i = W0 - s_i * sum_{j <= i} lr_j * grad l_j(W0)``, output ``o_i = q_i + LN(f(q_i; W_i))``;
  the next mini-batch starts from ``W_b`` (the state after its last token).

The *dual form* computes all ``o_i`` of a mini-batch with matrix products and never materialises
the per-token ``W_i``: with ``G = dl/dZ`` at ``W0`` and ``E[i, j] = s_i * lr_j`` for ``j <= i`` (else 0),
``Z_bar = Q W0 - (E * Q K^T) G + b0 - E G``. Both forms give the same result; the tests check it
against a primal reference that steps the inner model with autograd.

Memory: the scan over mini-batches stores each mini-batch's intermediates for backward (the
44 GB-vs-20 GB problem of naive TTT training). With ``checkpoint_group_size=g > 0`` the whole layer
(input norm, projections, learning-rate gate, the scan, output norm and projection) runs without
recording a graph and backward keeps only its input; when backward reaches the layer it runs it
again, recording, and back-propagates through that. The recomputation is bounded by ``g``: with
``g`` smaller than the number of mini-batches ``n``, the recomputed scan is itself checkpointed
every ``g`` mini-batches (non-reentrant ``torch.utils.checkpoint``), so at most ``g`` mini-batches'
intermediates are alive at once, for one more scan forward; with ``g >= n`` the layer is recomputed
in one pass (fastest; one layer's scan intermediates alive while its backward runs). In a
:class:`TTTBlock` the causal convolution before the layer is recomputed with it by default
(``TTTConfig.checkpoint_conv``), so the block's whole sequence-mixing half keeps only its input. The
same ops run in the same order, so outputs and gradients are bit-identical to the plain layer.

The package, one job per module:

* :mod:`.inner`: the inner loop's maths (closed-form gradients, one dual-form mini-batch step);
* :mod:`.layers`: :class:`TTTLinear` and :class:`TTTMLP` (projections, learning-rate gate, scan);
* :mod:`.recompute`: the activation checkpointing the layers and blocks use;
* :mod:`.planning`: ``checkpoint_group_size="auto"`` from the free memory (:mod:`lit_memopt.memory`);
* :mod:`.model`: the small TTT language model (:class:`TTTConfig`, :class:`TTTForCausalLM`);
* :mod:`.integration`: gated TTT branches in a pretrained transformers causal LM.
"""

from __future__ import annotations

from lit_memopt.models.ttt.integration import (
    AttentionWithTTT,
    GatedTTT,
    TTTIntegrationConfig,
    add_ttt_layers,
    ttt_branches,
)
from lit_memopt.models.ttt.layers import (
    LAYER_TYPES,
    TTTLayer,
    TTTLinear,
    TTTMLP,
    resolve_inner_base_lr,
    ttt_layer_class,
)
from lit_memopt.models.ttt.model import TTTBlock, TTTConfig, TTTForCausalLM
from lit_memopt.models.ttt.planning import auto_checkpoint_group_size

__all__ = [
    "LAYER_TYPES",
    "TTTLayer",
    "TTTLinear",
    "TTTMLP",
    "TTTConfig",
    "TTTBlock",
    "TTTForCausalLM",
    "TTTIntegrationConfig",
    "GatedTTT",
    "AttentionWithTTT",
    "add_ttt_layers",
    "ttt_branches",
    "ttt_layer_class",
    "resolve_inner_base_lr",
    "auto_checkpoint_group_size",
]
