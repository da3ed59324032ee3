"""Options of the fused head ops and policy losses (precision, masking, logit scale/softcap, cross-entropy
variants, GRPO variants) against plain float64 references, forward and backward."""

from __future__ import annotations

import pytest
import torch

from lit_memopt.ops import (
    linear_cross_entropy,
    linear_entropy,
    linear_kl,
    linear_logprobs,
    linear_logprobs_and_entropy,
    linear_self_certainty,
    ppo_clip_loss,
)
from lit_memopt.ops._head_tiles import native_low_precision_matmul

IGNORE = -100


def make(shape=(3, 5), hidden_size=16, vocab=37, dtype=torch.float64, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 3 / hidden_size**0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, shape, generator=g)
    return hidden, weight, b, targets


def ref_logits(hidden, weight, bias=None, temperature=1.0, logit_scale=1.0, softcap=None):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def grads(out, inputs, seed=1):
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * up).sum(), [t for t in inputs if t is not None], retain_graph=True)


def assert_same(fused_out, ref_out, inputs, tol=1e-9):
    torch.testing.assert_close(fused_out, ref_out, rtol=tol, atol=tol)
    for a, b in zip(grads(fused_out, inputs), grads(ref_out, inputs)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------- logit_scale and softcapping


@pytest.mark.parametrize("scale, cap, temperature", [(0.5, None, 1.0), (1.0, 3.0, 1.0), (2.0, 1.5, 0.7)])
@pytest.mark.parametrize("op", ["logprobs", "entropy", "self_certainty", "kl", "logprobs_and_entropy"])
def test_logit_scale_and_softcap_match_reference(op, scale, cap, temperature):
    hidden, weight, b, targets = make(bias=op != "kl")
    kw = dict(logit_scale=scale, final_logit_softcapping=cap, temperature=temperature, chunk_size=(4, 10))
    z = ref_logits(hidden, weight, b, temperature, scale, cap)
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    if op == "logprobs":
        got, want = linear_logprobs(hidden, weight, targets, bias=b, **kw), logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    elif op == "entropy":
        got, want = linear_entropy(hidden, weight, bias=b, **kw), entropy
    elif op == "self_certainty":
        got, want = linear_self_certainty(hidden, weight, bias=b, **kw), torch.logsumexp(z, -1) - z.mean(-1)
    elif op == "logprobs_and_entropy":
        got = torch.stack(linear_logprobs_and_entropy(hidden, weight, targets, bias=b, **kw))
        want = torch.stack([logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy])
    else:
        ref_h = (hidden.detach() + 0.5).requires_grad_(False)
        ref_w = weight.detach() * 0.8
        logq = torch.log_softmax(ref_logits(ref_h, ref_w, None, temperature, scale, cap), -1)
        got, want = linear_kl(hidden, weight, ref_h, ref_w, **kw), (logp.exp() * (logp - logq)).sum(-1)
    assert_same(got, want, (hidden, weight, b))


# ---------------------------------------------------------------- masked rows are skipped


def test_masked_and_ignored_rows_give_zero_and_never_reach_the_head(monkeypatch):
    from lit_memopt.ops import linear_head

    hidden, weight, _, targets = make(shape=(4, 6))
    targets[0, :3] = IGNORE
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2] = False
    seen = []
    original = linear_head._LinearHeadFunction.apply
    # the pass gets all rows and the indices of those that count: only those are gathered into tiles
    monkeypatch.setattr(linear_head._LinearHeadFunction, "apply", lambda *a: seen.append((a[1].shape[0], a[-1].tolist())) or original(*a))
    logp, ent = linear_logprobs_and_entropy(hidden, weight, targets, mask=mask, chunk_size=(5, 8))
    counted = (targets != IGNORE) & mask
    assert seen == [(24, counted.reshape(-1).nonzero().squeeze(1).tolist())] and len(seen[0][1]) == 24 - 3 - 6
    z = ref_logits(hidden, weight)
    ref_lp = torch.log_softmax(z, -1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    want = torch.stack([torch.where(counted, ref_lp, 0.0), torch.where(counted, ref_ent, 0.0)])
    assert_same(torch.stack([logp, ent]), want, (hidden, weight))
    g_hidden = grads(logp + ent, (hidden,))[0]
    assert torch.all(g_hidden[~counted] == 0)


def test_everything_masked_gives_zeros_and_zero_gradients():
    hidden, weight, _, targets = make()
    out = linear_entropy(hidden, weight, mask=torch.zeros(3, 5, dtype=torch.bool))
    out.sum().backward()
    assert torch.all(out == 0) and torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


# ---------------------------------------------------------------- precision


@pytest.mark.parametrize("op", ["logprobs", "entropy", "logprobs_and_entropy"])
def test_fast_precision_bf16_is_as_accurate_as_bf16_logits(op):
    # "fast" on the CPU rounds each logits tile to bf16 (as full-logits bf16 code does) and keeps fp32
    # statistics: its values must equal the float64 maths on bf16-rounded logits, and its gradients
    # must stay at the bf16 rounding floor of the float64 gradients.
    hidden, weight, b, targets = make(shape=(8, 9), hidden_size=64, vocab=300, dtype=torch.bfloat16, bias=True)
    fns = {
        "logprobs": lambda **kw: linear_logprobs(hidden, weight, targets, bias=b, chunk_size=(16, 64), **kw),
        "entropy": lambda **kw: linear_entropy(hidden, weight, bias=b, chunk_size=(16, 64), **kw),
        "logprobs_and_entropy": lambda **kw: torch.stack(linear_logprobs_and_entropy(hidden, weight, targets, bias=b, chunk_size=(16, 64), **kw)),
    }
    raw_bf16 = (hidden @ weight.T).double() + b.double()  # the bf16 product, bias added in higher precision
    exact_z = ref_logits(hidden, weight, b)

    def reference(z):
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        return {"logprobs": lp, "entropy": ent, "logprobs_and_entropy": torch.stack([lp, ent])}[op]

    fast, exact = fns[op](precision="fast"), fns[op](precision="exact")
    assert fast.dtype == exact.dtype == torch.float32
    torch.testing.assert_close(fast.double(), reference(raw_bf16.detach()), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(exact.double(), reference(exact_z.detach()), rtol=1e-5, atol=1e-5)
    # "auto" is "fast" for bf16 where the CPU multiplies bf16 natively, "exact" where it would emulate it
    auto_is = fast if native_low_precision_matmul(hidden.device, torch.bfloat16) else exact
    torch.testing.assert_close(fns[op]().double(), auto_is.double(), rtol=0, atol=0)
    want = grads(reference(exact_z), (hidden, weight, b))
    for got in (grads(fast, (hidden, weight, b)), grads(exact, (hidden, weight, b))):
        for g, w in zip(got, want):
            assert g.dtype == torch.bfloat16
            scale = w.abs().max().item()
            assert (g.double() - w).abs().max().item() <= 0.02 * scale


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_follows_native_low_precision_matmuls(native, monkeypatch):
    # Emulated bf16 matmuls (an AVX2-only CPU) are far slower than fp32 ones: "auto" then multiplies fp32
    # tiles, while an explicit "fast" is always honoured and fp32 inputs never go low.
    from lit_memopt.ops import _head_tiles

    monkeypatch.setattr(_head_tiles, "native_low_precision_matmul", lambda device, dtype: native)
    low = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert _head_tiles.resolve_precision("auto", low, low) is (torch.bfloat16 if native else None)
    assert _head_tiles.resolve_precision("fast", low, low) is torch.bfloat16
    assert _head_tiles.resolve_precision("exact", low, low) is None
    assert _head_tiles.resolve_precision("auto", low.float(), low.float()) is None
    assert _head_tiles.resolve_precision("fast", low, low.float()) is None  # mixed dtypes: fp32 tiles


@pytest.mark.parametrize("native", [True, False])
def test_precision_follows_autocast_to_a_low_precision_dtype(native, monkeypatch):
    # Mixed-precision training (fp32 weights under autocast to bf16) asks for bf16 matmuls: "auto" and "fast"
    # multiply tiles cast to the autocast dtype, on the same terms as bf16 inputs; float64 never goes low.
    from lit_memopt.ops import _head_tiles

    monkeypatch.setattr(_head_tiles, "native_low_precision_matmul", lambda device, dtype: native)
    fp32, bf16 = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _head_tiles.resolve_precision("auto", fp32, fp32) is (torch.bfloat16 if native else None)
        assert _head_tiles.resolve_precision("fast", bf16, fp32) is torch.bfloat16
        assert _head_tiles.resolve_precision("exact", fp32, fp32) is None
        assert _head_tiles.resolve_precision("fast", fp32.double(), fp32) is None
        assert _head_tiles.resolve_precision("fast", torch.zeros(2, 3, dtype=torch.float16), fp32) is None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert _head_tiles.resolve_precision("fast", fp32, fp32) is None


@pytest.mark.parametrize("masked", [False, True])
def test_fast_under_autocast_multiplies_in_the_autocast_dtype_and_returns_fp32_gradients(masked):
    """fp32 hidden states and weight under autocast to bf16: the same values as the op on bf16 inputs (the same
    bf16 operands and tile products), and fp32 gradients that match the bf16 inputs' to bf16 rounding."""
    hidden, weight, _, targets = make(shape=(4, 6), hidden_size=32, vocab=300, dtype=torch.float32, seed=3)
    mask = (torch.arange(24).reshape(4, 6) % 3 != 0) if masked else None
    upstream = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_logprobs(hidden, weight, targets, mask=mask, precision="fast", chunk_size=(8, 64))
    (out * upstream).sum().backward()
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    want = linear_logprobs(h16, w16, targets, mask=mask, precision="fast", chunk_size=(8, 64))
    (want * upstream).sum().backward()
    assert out.dtype == torch.float32 and hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad, h16.grad.float(), rtol=1e-2, atol=1e-2 * h16.grad.abs().max().item())
    torch.testing.assert_close(weight.grad, w16.grad.float(), rtol=1e-2, atol=1e-2 * w16.grad.abs().max().item())
    # and not the fp32 tiles: bf16 operands move the values by far more than fp32 rounding
    exact = linear_logprobs(hidden.detach(), weight.detach(), targets, mask=mask, precision="exact")
    assert (out.detach() - exact).abs().max() > 1e-4


def test_fp32_inputs_ignore_precision():
    hidden, weight, _, targets = make(dtype=torch.float32)
    a = linear_logprobs(hidden, weight, targets, precision="fast")
    b = linear_logprobs(hidden, weight, targets, precision="exact")
    assert torch.equal(a, b)


# ---------------------------------------------------------------- cross-entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing, z_loss", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.2, 3e-2)])
def test_cross_entropy_matches_torch(reduction, smoothing, z_loss):
    hidden, weight, b, targets = make(shape=(4, 5), bias=True)
    targets[1, 1:4] = IGNORE
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[3, 0] = False
    got = linear_cross_entropy(hidden, weight, targets, bias=b, reduction=reduction, label_smoothing=smoothing,
                               z_loss=z_loss, mask=mask, logit_scale=1.3, final_logit_softcapping=4.0, chunk_size=(3, 7))
    z = ref_logits(hidden, weight, b, 1.0, 1.3, 4.0)
    masked_targets = torch.where(mask, targets, IGNORE)
    per_row = torch.nn.functional.cross_entropy(z.reshape(-1, 37), masked_targets.reshape(-1), ignore_index=IGNORE,
                                                label_smoothing=smoothing, reduction="none").reshape(4, 5)
    counted = masked_targets != IGNORE
    per_row = per_row + torch.where(counted, z_loss * torch.logsumexp(z, -1) ** 2, 0.0)
    want = {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / counted.sum()}[reduction]
    assert_same(got, want, (hidden, weight, b))


# ---------------------------------------------------------------- errors


def test_option_errors_name_the_argument():
    hidden, weight, _, targets = make()
    with pytest.raises(ValueError, match="`precision` must be one of"):
        linear_logprobs(hidden, weight, targets, precision="bf16")
    with pytest.raises(ValueError, match="`logit_scale`"):
        linear_entropy(hidden, weight, logit_scale=0.0)
    with pytest.raises(ValueError, match="`final_logit_softcapping`"):
        linear_entropy(hidden, weight, final_logit_softcapping=-1.0)
    with pytest.raises(ValueError, match="`mask` must have shape"):
        linear_entropy(hidden, weight, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="`mask` must be a bool"):
        linear_entropy(hidden, weight, mask=torch.ones(3, 5))
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        linear_cross_entropy(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="`label_smoothing`"):
        linear_cross_entropy(hidden, weight, targets, label_smoothing=1.5)
    with pytest.raises(ValueError, match="`z_loss`"):
        linear_cross_entropy(hidden, weight, targets, z_loss=-1.0)


# ---------------------------------------------------------------- policy-loss variants


def ref_policy_loss(new, old, adv, mask, eps_low, eps_high, loss_type, level, num_items, ref=None, kl_coef=0.0):
    """Plain per-variant formulas written out one by one."""
    m = mask.double()
    if level == "sequence":
        log_r = ((new - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
        log_r = log_r.expand_as(new)
    else:
        log_r = new - old
    r = torch.exp(log_r)
    a = adv.unsqueeze(-1).expand_as(new)
    per_tok = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
    if ref is not None:
        per_tok = per_tok + kl_coef * (torch.exp(ref - new) - (ref - new) - 1)
    if loss_type == "grpo":
        return torch.stack([(per_tok[i] * m[i]).sum() / m[i].sum() for i in range(new.shape[0])]).mean()
    if loss_type == "dr_grpo":
        return (per_tok * m).sum() / (new.shape[0] * new.shape[1])
    denom = num_items if num_items is not None else m.sum()
    return (per_tok * m).sum() / denom


@pytest.mark.parametrize("loss_type, num_items", [("bnpo", None), ("grpo", None), ("dr_grpo", None), ("dapo", 40), ("bnpo", 33)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_loss_variants_match_reference(loss_type, num_items, level):
    g = torch.Generator().manual_seed(0)
    new = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    old = new.detach() + 0.2 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    ref = new.detach() + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[:, 0] = True
    got, metrics = ppo_clip_loss(new, old, adv, mask=mask, clip_eps=0.1, clip_eps_high=0.25, loss_type=loss_type,
                                 importance_sampling_level=level, num_items_in_batch=num_items, ref_logp=ref,
                                 kl_coef=0.05, return_metrics=True)
    want = ref_policy_loss(new, old, adv, mask, 0.1, 0.25, loss_type, level, num_items, ref, 0.05)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got, = torch.autograd.grad(got, new)
    g_want, = torch.autograd.grad(want, new)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)
    # metrics: fractions of counted tokens where each clip bound removes the gradient
    if level == "token":
        r = torch.exp(new.detach() - old)
        a = adv.unsqueeze(-1).expand_as(r)
        low = ((r < 0.9) & (a < 0) & mask).sum() / mask.sum()
        high = ((r > 1.25) & (a > 0) & mask).sum() / mask.sum()
        torch.testing.assert_close(metrics["clip_ratio_low"], low.double())
        torch.testing.assert_close(metrics["clip_ratio_high"], high.double())
        assert 0 < metrics["clip_ratio"] <= 1  # the perturbation above is large enough to clip something
    k3 = torch.exp(ref - new.detach()) - (ref - new.detach()) - 1
    torch.testing.assert_close(metrics["kl"], (k3 * mask).sum() / mask.sum())
    assert not any(v.requires_grad for v in metrics.values())


def test_policy_loss_option_errors():
    new = torch.zeros(2, 3, requires_grad=True)
    adv = torch.zeros(2)
    with pytest.raises(ValueError, match="`loss_type` must be one of"):
        ppo_clip_loss(new, new.detach(), adv, loss_type="gspo")
    with pytest.raises(ValueError, match="`importance_sampling_level` must be one of"):
        ppo_clip_loss(new, new.detach(), adv, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="`clip_eps_high`"):
        ppo_clip_loss(new, new.detach(), adv, clip_eps_high=0.0)
    with pytest.raises(ValueError, match="`num_items_in_batch` applies to"):
        ppo_clip_loss(new, new.detach(), adv, loss_type="grpo", num_items_in_batch=5)
    with pytest.raises(ValueError, match="`num_items_in_batch` must be"):
        ppo_clip_loss(new, new.detach(), adv, loss_type="dapo", num_items_in_batch=0)


def test_counted_rows_are_found_without_nonzero_static_too(monkeypatch):
    # torch.nonzero_static (no host sync) may lack a kernel for a device on older torch: nonzero finds the same rows.
    from lit_memopt.ops import _head_tiles

    valid = torch.tensor([True, False, True, True, False])
    assert _head_tiles.counted_row_indices(valid, 3).tolist() == [0, 2, 3]

    def missing(*args, **kwargs):
        raise NotImplementedError("nonzero_static: no kernel for this device")

    monkeypatch.setattr(torch, "nonzero_static", missing)
    assert _head_tiles.counted_row_indices(valid, 3).tolist() == [0, 2, 3]
    hidden, weight, _, targets = make(shape=(2, 5), dtype=torch.float64)
    targets[0, :3] = IGNORE
    out = linear_logprobs(hidden, weight, targets)
    want = torch.log_softmax(ref_logits(hidden, weight), -1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, torch.where(targets != IGNORE, want, 0.0))
