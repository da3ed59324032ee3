"""The inner loop's maths: closed-form gradients of the inner loss and one dual-form mini-batch step
of TTT-Linear and TTT-MLP (see the package docstring for the notation).

The gradients are written out rather than taken with autograd so that the dual form needs no
nested autograd graph; the tests check them against a primal reference that does use autograd.
All tensors are ``[batch * heads, ...]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["INNER_LN_EPS", "normalize", "layer_norm_l2_grad", "gelu_grad", "linear_step", "mlp_step"]

# epsilon of the per-head LayerNorm inside the inner loss and on the inner model's output
INNER_LN_EPS = 1e-6


def normalize(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z_hat, rstd)`` of a LayerNorm over the last dim. Written as mean / centred square mean:
    ``torch.var_mean`` is several times slower on the CPU for these short rows."""
    centred = z - z.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((centred * centred).mean(dim=-1, keepdim=True) + INNER_LN_EPS)
    return centred * rstd, rstd


def layer_norm_l2_grad(z: torch.Tensor, bias_minus_target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``d/dz 0.5 * ||LN(z) - target||^2`` row by row (LayerNorm's backward written out), for a
    LayerNorm with ``weight`` and ``bias``; takes ``bias - target``, computed once per scan."""
    z_hat, rstd = normalize(z)
    grad_hat = torch.addcmul(bias_minus_target, z_hat, weight) * weight
    projection = torch.addcmul(grad_hat.mean(dim=-1, keepdim=True), z_hat, (grad_hat * z_hat).mean(dim=-1, keepdim=True))
    return rstd * (grad_hat - projection)


def gelu_grad(z: torch.Tensor) -> torch.Tensor:
    """Derivative of the exact (erf) GELU: ``Phi(z) + z * phi(z)``."""
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def linear_step(
    state: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    eta_mix: torch.Tensor,
    last: torch.Tensor,
    bias_minus_target: torch.Tensor,
    norm_w: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One mini-batch of TTT-Linear (``f(x) = x W + b``) in dual form.

    Args:
        state: ``(W [.., d, d], b [.., 1, d])`` at the start of the mini-batch.
        q, k: queries and keys ``[.., m, d]``.
        eta_mix: ``E * Q K^T + E`` ``[.., m, m]``.
        last: the last row of ``E``, transposed ``[.., m, 1]``.
        bias_minus_target: the inner LayerNorm's bias minus the reconstruction target ``[.., m, d]``.
        norm_w: the inner LayerNorm's weight ``[.., 1, d]``.

    Returns:
        The state after the mini-batch's last token, and ``Z_bar = f(q_i; W_i)`` for every token
        (before the output LayerNorm).
    """
    W, bias = state
    z = torch.baddbmm(bias, k, W)
    grad = layer_norm_l2_grad(z, bias_minus_target, norm_w)
    # dual form: Z_bar = Q W0 - (E * Q K^T) G + b0 - E G
    z_bar = torch.baddbmm(bias, q, W) - torch.bmm(eta_mix, grad)
    # the state after the last token: W0 - K^T diag(e) G, b0 - sum_j e_j g_j (e: E's last row)
    scaled = last * grad
    W_next = W - torch.bmm(k.transpose(-1, -2), scaled)
    b_next = bias - scaled.sum(dim=-2, keepdim=True)
    return (W_next, b_next), z_bar


def mlp_step(
    state: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    eta: torch.Tensor,
    eta_mix: torch.Tensor,
    last: torch.Tensor,
    bias_minus_target: torch.Tensor,
    norm_w: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One mini-batch of TTT-MLP (``f(x) = GELU(x W1 + b1) W2 + b2``) in dual form.

    Arguments as :func:`linear_step`, with ``state = (W1, b1, W2, b2)`` and ``eta = E`` ``[.., m, m]``
    (the second layer's mixing matrix is built from it).
    """
    W1, b1, W2, b2 = state
    z1 = torch.baddbmm(b1, k, W1)
    x2 = F.gelu(z1)
    z2 = torch.baddbmm(b2, x2, W2)
    grad2 = layer_norm_l2_grad(z2, bias_minus_target, norm_w)
    grad1 = torch.bmm(grad2, W2.transpose(-1, -2)) * gelu_grad(z1)
    # dual form, layer by layer: the second layer's "keys" are x2, its "queries" x2_bar
    z1_bar = torch.baddbmm(b1, q, W1) - torch.bmm(eta_mix, grad1)
    x2_bar = F.gelu(z1_bar)
    eta_x2 = torch.addcmul(eta, eta, torch.bmm(x2_bar, x2.transpose(-1, -2)))  # E * X2_bar X2^T + E
    z2_bar = torch.baddbmm(b2, x2_bar, W2) - torch.bmm(eta_x2, grad2)
    scaled1, scaled2 = last * grad1, last * grad2  # rows scaled by E's last row
    W1_next = W1 - torch.bmm(k.transpose(-1, -2), scaled1)
    b1_next = b1 - scaled1.sum(dim=-2, keepdim=True)
    W2_next = W2 - torch.bmm(x2.transpose(-1, -2), scaled2)
    b2_next = b2 - scaled2.sum(dim=-2, keepdim=True)
    return (W1_next, b1_next, W2_next, b2_next), z2_bar
