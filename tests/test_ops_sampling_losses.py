"""Top-k Gumbel-softmax, soft embeddings and the policy losses vs plain references."""

from __future__ import annotations

import math

import pytest
import torch

from lit_memopt.ops import ppo_clip_loss, soft_embedding, topk_gumbel_softmax, tr_rpg_loss

# ---------------------------------------------------------------- top-k Gumbel-softmax


def test_topk_gumbel_weights_sum_to_one_on_topk_indices():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=g)
    weights, idx = topk_gumbel_softmax(logits, tau=0.7, k=5, generator=g)
    assert weights.shape == idx.shape == (3, 4, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4))
    assert (weights > 0).all()
    torch.testing.assert_close(idx, logits.topk(5, dim=-1).indices)


def test_topk_gumbel_matches_plain_formula_with_same_noise():
    logits = torch.randn(2, 30, requires_grad=True)
    gen_a = torch.Generator().manual_seed(7)
    weights, idx = topk_gumbel_softmax(logits, tau=0.5, k=4, generator=gen_a)
    gen_b = torch.Generator().manual_seed(7)
    gumbel = -torch.empty(2, 4).exponential_(generator=gen_b).log()
    expected = torch.softmax((logits.gather(-1, idx) + gumbel) / 0.5, dim=-1)
    torch.testing.assert_close(weights, expected)
    up = torch.randn(2, 4)
    (g1,) = torch.autograd.grad((weights * up).sum(), logits)
    (g2,) = torch.autograd.grad((expected * up).sum(), logits)
    torch.testing.assert_close(g1, g2)
    # Only the k picked logits receive gradient.
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)
    assert (g1[~mask] == 0).all()


def test_topk_gumbel_hard_is_exact_one_hot_with_soft_gradient():
    logits = torch.randn(6, 40, requires_grad=True)
    soft, _ = topk_gumbel_softmax(logits, tau=0.9, k=8, generator=torch.Generator().manual_seed(3))
    hard, idx = topk_gumbel_softmax(logits, tau=0.9, k=8, hard=True, generator=torch.Generator().manual_seed(3))
    assert set(hard.detach().unique().tolist()) <= {0.0, 1.0}
    assert (hard.sum(-1) == 1).all()
    assert (hard.argmax(-1) == soft.argmax(-1)).all()
    up = torch.randn(6, 8)
    (g_hard,) = torch.autograd.grad((hard * up).sum(), logits)
    (g_soft,) = torch.autograd.grad((soft * up).sum(), logits)
    torch.testing.assert_close(g_hard, g_soft)


def test_topk_gumbel_k_equals_vocab_and_generator_reproducible():
    logits = torch.randn(5, 9)
    a = topk_gumbel_softmax(logits, 1.0, 9, generator=torch.Generator().manual_seed(1))
    b = topk_gumbel_softmax(logits, 1.0, 9, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[0].sum(-1), torch.ones(5))


def test_topk_gumbel_bf16_keeps_dtype():
    w, _ = topk_gumbel_softmax(torch.randn(3, 20).bfloat16(), 0.5, 3)
    assert w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float().sum(-1), torch.ones(3), atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tau=0.0, k=2), "`tau`"),
        (dict(tau=-1.0, k=2), "`tau`"),
        (dict(tau=1.0, k=0), "`k`"),
        (dict(tau=1.0, k=11), "`k`"),
        (dict(tau=1.0, k=2.0), "`k`"),
    ],
)
def test_topk_gumbel_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        topk_gumbel_softmax(torch.randn(2, 10), **kwargs)
    with pytest.raises(TypeError, match="`logits`"):
        topk_gumbel_softmax(torch.arange(10), 1.0, 2)


# ---------------------------------------------------------------- soft embeddings


def test_soft_embedding_matches_gather_sum_forward_and_backward():
    torch.manual_seed(0)
    emb = torch.randn(23, 6, requires_grad=True)
    weights = torch.rand(2, 3, 4, requires_grad=True)
    idx = torch.randint(0, 23, (2, 3, 4))
    out = soft_embedding(weights, idx, emb)
    expected = (weights.unsqueeze(-1) * emb[idx]).sum(-2)
    torch.testing.assert_close(out, expected)
    up = torch.randn(2, 3, 6)
    got = torch.autograd.grad((out * up).sum(), (weights, emb))
    want = torch.autograd.grad((expected * up).sum(), (weights, emb))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_soft_embedding_gradcheck_and_module_input():
    emb = torch.nn.Embedding(7, 3).double()
    weights = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 7, (4, 2))
    assert torch.autograd.gradcheck(lambda w, e: soft_embedding(w, idx, e), (weights, emb.weight))
    assert soft_embedding(weights, idx, emb).shape == (4, 3)


def test_soft_embedding_of_one_hot_equals_lookup():
    logits = torch.randn(5, 30)
    emb = torch.randn(30, 4)
    w, idx = topk_gumbel_softmax(logits, 0.5, 6, hard=True)
    chosen = idx.gather(-1, w.argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(soft_embedding(w, idx, emb), emb[chosen])


def test_soft_embedding_validation():
    emb = torch.randn(10, 3)
    with pytest.raises(ValueError, match="same shape"):
        soft_embedding(torch.rand(2, 3), torch.zeros(2, 4, dtype=torch.long), emb)
    with pytest.raises(TypeError, match="`indices` must be an integer"):
        soft_embedding(torch.rand(2, 3), torch.zeros(2, 3), emb)
    with pytest.raises(ValueError, match=r"`indices` must be in \[0, 10\)"):
        soft_embedding(torch.rand(2, 3), torch.full((2, 3), 10), emb)
    with pytest.raises(ValueError, match="`embedding` must be a 2-D"):
        soft_embedding(torch.rand(2, 3), torch.zeros(2, 3, dtype=torch.long), emb[0])


# ---------------------------------------------------------------- TR-RPG


def test_tr_rpg_value_and_closed_form_gradient_sequence_level():
    torch.manual_seed(0)
    logp_old = torch.randn(8) * 3
    logp_new = (logp_old + torch.tensor([0.1, -0.5, 3.0, -3.0, 0.0, 1.2, -2.2, 2.29])).requires_grad_()
    rewards = torch.randn(8)
    beta, clamp = 0.3, 2.3
    loss = tr_rpg_loss(logp_new, logp_old, rewards, beta, clamp=clamp)
    log_w = (logp_new - logp_old).detach().clamp(-clamp, clamp)
    w = log_w.exp()
    torch.testing.assert_close(loss, (w * (-rewards + beta * log_w)).mean())
    (grad,) = torch.autograd.grad(loss, logp_new)
    inside = (logp_new - logp_old).detach().abs() < clamp
    closed_form = torch.where(inside, -w * (rewards - beta * (log_w + 1)), 0.0) / 8
    torch.testing.assert_close(grad, closed_form)
    assert (grad[~inside] == 0).all() and inside.sum() == 6


def test_tr_rpg_token_level_with_mask():
    torch.manual_seed(1)
    logp_new = torch.randn(3, 5, requires_grad=True)
    logp_old = logp_new.detach() + 0.2 * torch.randn(3, 5)
    rewards = torch.randn(3)
    mask = torch.rand(3, 5) > 0.3
    loss = tr_rpg_loss(logp_new, logp_old, rewards, 0.1, mask=mask)
    log_w = (logp_new - logp_old).clamp(-2.3, 2.3)
    per_token = log_w.exp() * (-rewards[:, None] + 0.1 * log_w)
    torch.testing.assert_close(loss, per_token[mask].mean())
    loss.backward()
    assert (logp_new.grad[~mask] == 0).all()


def test_tr_rpg_validation():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="`beta`"):
        tr_rpg_loss(x, x, x, -0.1)
    with pytest.raises(ValueError, match="`clamp`"):
        tr_rpg_loss(x, x, x, 0.1, clamp=0)
    with pytest.raises(ValueError, match="`logp_old` must have the shape"):
        tr_rpg_loss(x, x[:3], x, 0.1)
    with pytest.raises(ValueError, match="`rewards` must have shape"):
        tr_rpg_loss(torch.randn(4, 2), torch.randn(4, 2), torch.randn(3), 0.1)
    with pytest.raises(ValueError, match="`mask` must have the shape"):
        tr_rpg_loss(x, x, x, 0.1, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="`logp_new`"):
        tr_rpg_loss(torch.arange(4), x, x, 0.1)


# ---------------------------------------------------------------- PPO / GRPO


def plain_ppo(logp_new, logp_old, adv, eps, mask, ref, kl_coef):
    losses = []
    for b in range(logp_new.shape[0]):
        for t in range(logp_new.shape[1]):
            if not mask[b, t]:
                continue
            r = math.exp(logp_new[b, t] - logp_old[b, t])
            a = float(adv[b])
            term = -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            x = float(ref[b, t] - logp_new[b, t])
            losses.append(term + kl_coef * (math.exp(x) - x - 1))
    return sum(losses) / len(losses)


def test_ppo_clip_matches_plain_loop_and_gradient():
    torch.manual_seed(2)
    logp_new = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    logp_old = logp_new.detach() + 0.4 * torch.randn(4, 6, dtype=torch.float64)
    ref = logp_new.detach() + 0.3 * torch.randn(4, 6, dtype=torch.float64)
    adv = torch.randn(4, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.25
    loss = ppo_clip_loss(logp_new, logp_old, adv, clip_eps=0.2, mask=mask, ref_logp=ref, kl_coef=0.05)
    expected = plain_ppo(logp_new.detach(), logp_old, adv, 0.2, mask, ref, 0.05)
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    loss.backward()
    assert (logp_new.grad[~mask] == 0).all()
    # Without the KL term, clipped tokens carry no gradient.
    (grad,) = torch.autograd.grad(ppo_clip_loss(logp_new, logp_old, adv, clip_eps=0.2, mask=mask), logp_new)
    ratio = (logp_new - logp_old).exp().detach()
    a = adv[:, None].expand(4, 6)
    clipped = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    assert clipped.any() and (grad[clipped | ~mask] == 0).all() and (grad[~clipped & mask] != 0).all()
    assert torch.autograd.gradcheck(
        lambda x: ppo_clip_loss(x, logp_old, adv, mask=mask, ref_logp=ref, kl_coef=0.05), (logp_new.detach().requires_grad_(),)
    )


def test_ppo_on_policy_gradient_is_minus_advantage():
    logp = torch.randn(3, 4, requires_grad=True)
    adv = torch.randn(3, 4)
    ppo_clip_loss(logp, logp.detach(), adv).backward()
    torch.testing.assert_close(logp.grad, -adv / 12)


def test_ppo_validation():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="`ref_logp` is required"):
        ppo_clip_loss(x, x, torch.randn(2), kl_coef=0.1)
    with pytest.raises(ValueError, match="`clip_eps`"):
        ppo_clip_loss(x, x, torch.randn(2), clip_eps=0)
    with pytest.raises(ValueError, match="`kl_coef`"):
        ppo_clip_loss(x, x, torch.randn(2), kl_coef=-1.0, ref_logp=x)
    with pytest.raises(ValueError, match="`advantages` must have shape"):
        ppo_clip_loss(x, x, torch.randn(3))
