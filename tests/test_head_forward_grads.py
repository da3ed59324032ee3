"""The head passes that make their gradients in the forward (ops/_forward_grads.py): the frozen-head path of the
per-token ops, and the scalar losses (linear_cross_entropy, linear_policy_loss). float64 gradients equal the
naive full-logits maths; backward multiplies nothing; accumulation, checkpointing and an OOM retry compose."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from lit_memopt._compat.torch import TorchDispatchMode
from lit_memopt.ops import (
    _forward_grads,
    linear_cross_entropy,
    linear_entropy,
    linear_logprobs,
    linear_logprobs_and_entropy,
    linear_policy_loss,
    linear_self_certainty,
    ppo_clip_loss,
    tr_rpg_loss,
)
from lit_memopt.ops.linear_head import choose_pass

N_SEQ, T, H, V = 3, 5, 8, 37
OPTIONS = [dict(), dict(temperature=0.7, logit_scale=1.3, final_logit_softcapping=2.0), dict(temperature=1.4, logit_scale=0.8)]
TILES = [(4, 5), None]


def make(seed=0, bias=False, frozen=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N_SEQ, T, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.6).requires_grad_(not frozen)
    b = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(not frozen) if bias else None
    targets = torch.randint(0, V, (N_SEQ, T), generator=g)
    mask = torch.rand(N_SEQ, T, generator=g) > 0.3
    return hidden, weight, b, targets, mask


def logits(hidden, weight, bias=None, temperature=1.0, logit_scale=1.0, final_logit_softcapping=None):
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    z = z * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    return z / temperature


def naive_outputs(hidden, weight, targets, bias=None, **opts):
    z = logits(hidden, weight, bias, **opts)
    logp = torch.log_softmax(z, -1)
    return {"logprobs": logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1),
            "entropy": -(logp.exp() * logp).sum(-1), "self_certainty": torch.logsumexp(z, -1) - z.mean(-1),
            "logsumexp": torch.logsumexp(z, -1)}


class CountProducts(TorchDispatchMode):
    """Counts matrix products (ATen's mm/addmm/bmm/baddbmm) run while it is active. A dispatch mode: it sees the
    products inside an autograd Function's backward, which a ``TorchFunctionMode`` does not."""

    NAMES = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def backward_products(loss, inputs):
    with CountProducts() as counter:
        grads = torch.autograd.grad(loss, inputs)
    return grads, counter.count


# ---------------------------------------------------------------- frozen head: directions made in forward


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("op", ["logprobs", "entropy", "self_certainty", "both"])
def test_frozen_head_gradients_equal_naive_and_backward_multiplies_nothing(op, opts):
    hidden, weight, bias, targets, mask = make(bias=True, frozen=True)
    targets[0, 1] = -100
    up = torch.randn(N_SEQ, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    valid = mask & (targets != -100)
    fused = {"logprobs": lambda: {"logprobs": linear_logprobs(hidden, weight, targets, bias=bias, mask=mask, chunk_size=(4, 5), **opts)},
             "entropy": lambda: {"entropy": linear_entropy(hidden, weight, bias=bias, mask=valid, chunk_size=(4, 5), **opts)},
             "self_certainty": lambda: {"self_certainty": linear_self_certainty(hidden, weight, bias=bias, mask=valid, **opts)},
             "both": lambda: dict(zip(("logprobs", "entropy"), linear_logprobs_and_entropy(
                 hidden, weight, targets, bias=bias, mask=mask, chunk_size=(2, 16), **opts)))}[op]()
    assert choose_pass(tuple(fused), hidden, weight, bias, False) == "frozen"
    naive = naive_outputs(hidden, weight, targets, bias, **opts)
    loss = sum(((out * up * (1 + i)).sum() for i, out in enumerate(fused.values())))
    ref = sum(((torch.where(valid, naive[name], 0.0) * up * (1 + i)).sum() for i, name in enumerate(fused)))
    (grad,), products = backward_products(loss, [hidden])
    (ref_grad,) = torch.autograd.grad(ref, [hidden])
    for name, out in fused.items():
        torch.testing.assert_close(out, torch.where(valid, naive[name], 0.0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert products == 0


def test_frozen_path_is_taken_only_where_it_applies():
    hidden, weight, _, _, _ = make(frozen=True)
    assert choose_pass(("logprobs",), hidden, weight, None, False) == "frozen"
    assert choose_pass(("kl",), hidden, weight, None, False) == "tiled"  # its reference would have to be held
    with torch.no_grad():
        assert choose_pass(("logprobs",), hidden, weight, None, False) == "tiled"  # no backward will come
    assert choose_pass(("logprobs",), hidden, weight.detach().requires_grad_(), None, False) == "tiled"
    assert _forward_grads.product_count(frozenset({"logprobs"}), frozen=True) == 2
    assert _forward_grads.product_count(frozenset({"logprobs"}), frozen=False, need_w=True) == 3


# ---------------------------------------------------------------- cross-entropy: gradients made in forward


def naive_cross_entropy(hidden, weight, targets, bias=None, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                        mask=None, **opts):
    z = logits(hidden, weight, bias, **opts).reshape(-1, V)
    t = targets.reshape(-1).clone()
    if mask is not None:
        t[~mask.reshape(-1)] = -100
    loss = F.cross_entropy(z, t, reduction="sum", label_smoothing=label_smoothing)
    counted = t != -100
    loss = loss + z_loss * (torch.logsumexp(z, -1).square() * counted).sum()
    return loss / counted.sum().clamp_min(1) if reduction == "mean" else loss


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("reduction,smoothing,z_loss,masked", [
    ("mean", 0.0, 0.0, False), ("sum", 0.1, 1e-2, True), ("mean", 0.2, 1e-3, True), ("sum", 0.0, 0.0, False)])
def test_cross_entropy_gradients_equal_naive_and_backward_multiplies_nothing(opts, reduction, smoothing, z_loss, masked):
    hidden, weight, bias, targets, mask = make(seed=1, bias=True)
    targets[1, 2] = -100
    kw = dict(bias=bias, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, mask=mask if masked else None, **opts)
    for tiles in TILES:
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=tiles, **kw)
        assert type(loss.grad_fn).__name__ == "ForwardGradientLossBackward"
        ref = naive_cross_entropy(hidden, weight, targets, **kw)
        grads, products = backward_products(loss * 0.5, [hidden, weight, bias])
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        for got, want in zip(grads, torch.autograd.grad(ref * 0.5, [hidden, weight, bias])):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert products == 0


class CountExponentials(TorchDispatchMode):
    """Sums the elements that ``exp``/``exp2`` ops (in place or not) run over while it is active."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("exp", "exp_", "exp2", "exp2_"):
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", [
    dict(label_smoothing=0.1, z_loss=1e-2, temperature=1.4, logit_scale=0.8),
    dict(final_logit_softcapping=2.0), dict(frozen=True), dict(frozen=True, entropy=True)])
def test_the_held_block_takes_one_exponential_per_logit_and_equals_the_two_exponential_pass(case, monkeypatch):
    """Where nothing needs the logits after the softmax, the block is overwritten by its softmax numerators; where
    something does (softcap, entropy), the two-exponential pass runs. Both give the naive float64 gradients."""
    case = dict(case)
    frozen, entropy = case.pop("frozen", False), case.pop("entropy", False)
    hidden, weight, bias, targets, mask = make(seed=12, bias=not frozen, frozen=frozen)
    targets[2, 0] = -100
    decisions = []
    real = _forward_grads.holds_probabilities
    monkeypatch.setattr(_forward_grads, "holds_probabilities", lambda spec, sets: decisions.append(real(spec, sets)) or decisions[-1])

    def run():
        if entropy:
            out = linear_logprobs_and_entropy(hidden, weight, targets, mask=mask, chunk_size=(4, 5), **case)
            loss = (out[0] * 0.3 + out[1] * 0.7).sum()
        elif frozen:
            loss = (linear_logprobs(hidden, weight, targets, mask=mask, chunk_size=(4, 5), **case) * 0.3).sum()
        else:
            loss = linear_cross_entropy(hidden, weight, targets, bias=bias, mask=mask, chunk_size=(4, 5), **case)
        return loss, torch.autograd.grad(loss, [t for t in (hidden, weight, bias) if t is not None and t.requires_grad])

    with CountExponentials() as counter:
        loss, grads = run()
    held = not entropy and "final_logit_softcapping" not in case
    assert decisions == [held]
    counted = int((mask & (targets != -100)).sum())
    if held:  # exactly one exponential per logit of the counted rows (plus a few per row: the log of the sums)
        assert counted * V <= counter.elements < counted * (V + 4)
    else:
        assert counter.elements >= 2 * counted * V
    monkeypatch.setattr(_forward_grads, "holds_probabilities", lambda spec, sets: False)
    other_loss, other_grads = run()
    torch.testing.assert_close(loss, other_loss, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, other_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_cross_entropy_with_a_frozen_head_and_without_gradients():
    hidden, weight, _, targets, _ = make(seed=2, frozen=True)
    loss = linear_cross_entropy(hidden, weight, targets, label_smoothing=0.1, chunk_size=(4, 5))
    ref = naive_cross_entropy(hidden, weight, targets, label_smoothing=0.1)
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0], torch.autograd.grad(ref, hidden)[0], rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # the tiled pass, one product: same value
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, label_smoothing=0.1), ref.detach(), rtol=1e-12, atol=0)


def test_gradient_accumulation_two_forwards_before_backward():
    hidden, weight, _, targets, mask = make(seed=4)
    halves = [(hidden[:2], targets[:2], mask[:2]), (hidden[2:], targets[2:], mask[2:])]
    losses = [linear_cross_entropy(h, weight, t, mask=m, reduction="sum", chunk_size=(3, 7)) for h, t, m in halves]
    (losses[0] * 0.25 + losses[1] * 0.75).backward()  # both forwards' gradients held, then scaled
    ref = sum(naive_cross_entropy(h, weight, t, mask=m, reduction="sum") * s for (h, t, m), s in zip(halves, (0.25, 0.75)))
    ref_h, ref_w = torch.autograd.grad(ref, [hidden, weight])
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, ref_w, rtol=1e-10, atol=1e-12)


def test_backward_twice_through_a_fused_loss_is_refused():
    hidden, weight, _, targets, _ = make()
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_checkpointed_body_then_fused_loss():
    hidden, weight, _, targets, mask = make(seed=5)
    layer = torch.nn.Linear(H, H).double()

    def body(x):
        return torch.tanh(layer(x))

    loss = linear_cross_entropy(torch.utils.checkpoint.checkpoint(body, hidden, use_reentrant=False), weight, targets,
                                mask=mask, z_loss=1e-2, chunk_size=(4, 5))
    got = torch.autograd.grad(loss, [hidden, weight, layer.weight])
    want = torch.autograd.grad(naive_cross_entropy(body(hidden), weight, targets, mask=mask, z_loss=1e-2),
                               [hidden, weight, layer.weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_an_oom_mid_pass_leaves_no_gradient_behind_and_the_retry_is_exact(monkeypatch):
    hidden, weight, _, targets, mask = make(seed=6)
    real, calls = _forward_grads.forward_gradient_pass, {"n": 0}
    held = []

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        out = real(*args, **kwargs)
        held.extend(weakref.ref(t) for t in (*out[1], out[2]) if t is not None)
        if calls["n"] == 2:  # the second micro-batch's head finished its forward, then the step runs out of memory
            raise torch.OutOfMemoryError("injected")
        return out

    monkeypatch.setattr(_forward_grads, "forward_gradient_pass", failing_once)
    first = linear_cross_entropy(hidden[:1], weight, targets[:1], mask=mask[:1], reduction="sum", chunk_size=(2, 5))
    first.backward()
    with pytest.raises(torch.OutOfMemoryError):
        linear_cross_entropy(hidden[1:], weight, targets[1:], mask=mask[1:], reduction="sum", chunk_size=(2, 5))
    gc.collect()
    assert all(r() is None for r in held[2:])  # the failed micro-batch's gradients died with it
    for i in (1, 2):  # OOMRecovery's retry: the same samples in smaller micro-batches
        linear_cross_entropy(hidden[i:i + 1], weight, targets[i:i + 1], mask=mask[i:i + 1], reduction="sum",
                             chunk_size=(2, 5)).backward()
    ref_h, ref_w = torch.autograd.grad(naive_cross_entropy(hidden, weight, targets, mask=mask, reduction="sum"), [hidden, weight])
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, ref_w, rtol=1e-10, atol=1e-12)


def test_bf16_cross_entropy_within_bf16_tolerance():
    hidden, weight, _, targets, _ = make(seed=7)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    loss = linear_cross_entropy(h16, w16, targets, chunk_size=(4, 8))
    ref = naive_cross_entropy(hidden, weight, targets)
    loss.backward()
    ref_h, ref_w = torch.autograd.grad(ref, [hidden, weight])
    assert loss.dtype == torch.float32 and h16.grad.dtype == w16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h16.grad.double(), ref_h, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(w16.grad.double(), ref_w, rtol=5e-2, atol=5e-3)


# ---------------------------------------------------------------- policy losses on hidden states


@pytest.mark.parametrize("case", [
    dict(loss_type="bnpo"), dict(loss_type="grpo", clip_eps_high=0.28), dict(loss_type="dr_grpo", max_completion_length=7),
    dict(loss_type="dapo", num_items_in_batch=40.0, kl_coef=0.04, ref=True), dict(loss_type="bnpo", level="sequence")])
@pytest.mark.parametrize("frozen", [False, True])
def test_ppo_loss_on_hidden_states_equals_ppo_clip_loss_of_naive_logprobs(case, frozen):
    hidden, weight, _, targets, mask = make(seed=8, frozen=frozen)
    g = torch.Generator().manual_seed(9)
    opts = OPTIONS[1]
    logp = naive_outputs(hidden, weight, targets, **opts)["logprobs"].detach()
    old = logp + 0.3 * torch.randn(N_SEQ, T, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.2 * torch.randn(N_SEQ, T, generator=g, dtype=torch.float64) if case.get("ref") else None
    adv = torch.randn(N_SEQ, generator=g, dtype=torch.float64)
    kw = dict(mask=mask, clip_eps=0.2, clip_eps_high=case.get("clip_eps_high"), loss_type=case["loss_type"],
              kl_coef=case.get("kl_coef", 0.0), ref_logp=ref_logp, num_items_in_batch=case.get("num_items_in_batch"),
              max_completion_length=case.get("max_completion_length"), importance_sampling_level=case.get("level", "token"))
    loss = linear_policy_loss(hidden, weight, targets, old, adv, chunk_size=(4, 5), **kw, **opts)
    ref = ppo_clip_loss(naive_outputs(hidden, weight, targets, **opts)["logprobs"], old, adv, **kw)
    inputs = [hidden] if frozen else [hidden, weight]
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(ref, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("per_token_rewards", [False, True])
def test_tr_rpg_loss_on_hidden_states_equals_tr_rpg_loss_of_naive_logprobs(per_token_rewards):
    hidden, weight, _, targets, mask = make(seed=10)
    g = torch.Generator().manual_seed(11)
    logp = naive_outputs(hidden, weight, targets)["logprobs"].detach()
    old = logp + 0.5 * torch.randn(N_SEQ, T, generator=g, dtype=torch.float64)  # some log-ratios outside the clamp
    rewards = torch.randn(*((N_SEQ, T) if per_token_rewards else (N_SEQ,)), generator=g, dtype=torch.float64)
    loss = linear_policy_loss(hidden, weight, targets, old, rewards, objective="tr_rpg", beta=0.05, clamp=0.4, mask=mask, chunk_size=(4, 5))
    ref = tr_rpg_loss(naive_outputs(hidden, weight, targets)["logprobs"], old, rewards, 0.05, mask=mask, clamp=0.4)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(ref, [hidden, weight])):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_policy_loss_errors_name_the_argument():
    hidden, weight, _, targets, _ = make()
    old = torch.zeros(N_SEQ, T, dtype=torch.float64)
    with pytest.raises(ValueError, match="objective"):
        linear_policy_loss(hidden, weight, targets, old, torch.zeros(N_SEQ), objective="reinforce")
    with pytest.raises(ValueError, match="advantages"):
        linear_policy_loss(hidden, weight, targets, old, torch.zeros(N_SEQ + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="ref_logp"):
        linear_policy_loss(hidden, weight, targets, old, torch.zeros(N_SEQ, dtype=torch.float64), kl_coef=0.1)
