"""Sparse relaxed sampling: Gumbel-softmax restricted to the top-k logits, and the embedding of
such a sparse distribution, neither of which ever writes a ``[..., vocab]`` tensor."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_memopt._compat.torch import is_fake as is_fake_tensor

__all__ = ["topk_gumbel_softmax", "soft_embedding"]


def _is_fake(t: Tensor) -> bool:
    if t.device.type == "meta":
        return True
    return is_fake_tensor(t)


def _check_index_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"`{name}` must be an integer tensor (e.g. torch.long), got {t.dtype}")
    return t


def topk_gumbel_softmax(
    logits: Tensor,
    tau: float,
    k: int,
    *,
    hard: bool = False,
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, Tensor]:
    """Gumbel-softmax over the ``k`` largest logits only: a sparse, differentiable sample.

    The ``k`` largest logits are perturbed with independent Gumbel(0, 1) noise and passed through
    ``softmax(. / tau)``; the rest of the vocabulary gets weight 0. This is a deliberate
    approximation of the full Gumbel-softmax (tokens outside the top-k can never be drawn) that
    costs ``O(k)`` per position instead of ``O(V)``, and the result is never scattered back to a
    ``[..., V]`` tensor: use :func:`soft_embedding` to consume it.

    Args:
        logits: ``[..., V]`` unnormalized scores (any float dtype). Gradients flow to the k picked entries.
        tau: softmax temperature, ``> 0``; small values approach a one-hot sample.
        k: number of candidates, ``1 <= k <= V``.
        hard: straight-through: the forward value is exactly one-hot on the noisy argmax among the
            k, the gradient is that of the soft weights.
        generator: optional ``torch.Generator`` (on ``logits``' device) for reproducible noise.

    Returns:
        ``(weights[..., k], indices[..., k])``: weights in ``logits.dtype`` summing to 1 over the last
        dim (noise and softmax are computed in fp32), and the vocabulary ids they belong to.

    Raises:
        TypeError, ValueError: non-float logits, ``tau <= 0``, ``k`` outside ``[1, V]``, a generator on another device.

    Example::

        weights, ids = topk_gumbel_softmax(logits, tau=0.5, k=32)
        inputs_embeds = soft_embedding(weights, ids, model.get_input_embeddings().weight)
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"`logits` must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"`logits` must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError(f"`logits` must have a vocabulary dimension [..., V], got shape {tuple(logits.shape)}")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"`tau` must be a finite number > 0, got {tau!r}")
    vocab = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"`k` must be an int with 1 <= k <= V={vocab}, got {k!r}")
    if generator is not None and torch.device(generator.device).type != logits.device.type:
        raise ValueError(f"`generator` is on {generator.device} but `logits` is on {logits.device}")

    top_values, indices = logits.topk(k, dim=-1)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    # Gumbel(0, 1) = -log(Exp(1)); the clamp keeps an exact-zero draw from becoming +inf.
    exp_draw = torch.empty(top_values.shape, dtype=compute, device=logits.device).exponential_(generator=generator)
    gumbel = -exp_draw.clamp_min_(torch.finfo(compute).tiny).log_()
    scores = (top_values.to(compute) + gumbel) / tau
    soft = scores.softmax(dim=-1)
    if hard:
        one_hot = F.one_hot(scores.argmax(dim=-1), k).to(compute)
        # soft - soft.detach() is exactly zero, so the forward value is exactly one-hot.
        weights = one_hot + (soft - soft.detach())
    else:
        weights = soft
    return weights.to(logits.dtype), indices


def soft_embedding(weights: Tensor, indices: Tensor, embedding: Union[Tensor, nn.Embedding]) -> Tensor:
    """Weighted sum of ``k`` embedding rows per position: ``sum_j weights[..., j] * embedding[indices[..., j]]``.

    Uses ``F.embedding_bag`` with ``per_sample_weights``, so only the ``k`` gathered rows are read
    and no ``[..., V]`` one-hot or dense probability tensor is built.

    Args:
        weights: ``[..., k]`` float weights (e.g. from :func:`topk_gumbel_softmax`); cast to the embedding dtype.
        indices: ``[..., k]`` integer ids in ``[0, V)``.
        embedding: ``[V, H]`` embedding matrix, or an ``nn.Embedding`` whose ``weight`` is used.

    Returns:
        ``[..., H]`` in the embedding's dtype; gradients flow to ``weights`` and ``embedding``.

    Raises:
        TypeError, ValueError: mismatched shapes, non-integer indices, ids out of range, mixed devices.

    Example::

        embeds = soft_embedding(weights, ids, model.get_input_embeddings())
    """
    if isinstance(embedding, nn.Embedding):
        embedding = embedding.weight
    if not isinstance(embedding, Tensor) or not embedding.is_floating_point() or embedding.dim() != 2:
        got = tuple(embedding.shape) if isinstance(embedding, Tensor) else type(embedding).__name__
        raise ValueError(f"`embedding` must be a 2-D float tensor [V, H] or an nn.Embedding, got {got}")
    if not isinstance(weights, Tensor) or not weights.is_floating_point():
        raise TypeError(f"`weights` must be a floating-point tensor [..., k], got {getattr(weights, 'dtype', type(weights).__name__)}")
    _check_index_tensor("indices", indices)
    if weights.dim() < 1 or weights.shape != indices.shape:
        raise ValueError(
            f"`weights` and `indices` must have the same shape [..., k], got {tuple(weights.shape)} and {tuple(indices.shape)}"
        )
    for name, t in (("weights", weights), ("indices", indices)):
        if t.device != embedding.device:
            raise ValueError(f"`{name}` is on {t.device} but `embedding` is on {embedding.device}")
    vocab, size = embedding.shape
    if indices.numel() and not _is_fake(indices):
        if bool(((indices < 0) | (indices >= vocab)).any()):
            raise ValueError(f"`indices` must be in [0, {vocab}) (the embedding's vocabulary)")

    k = indices.shape[-1]
    lead = indices.shape[:-1]
    out = F.embedding_bag(
        indices.reshape(-1, k),
        embedding,
        per_sample_weights=weights.reshape(-1, k).to(embedding.dtype),
        mode="sum",
    )
    return out.reshape(*lead, size)
