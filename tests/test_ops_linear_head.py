"""Fused LM-head ops vs plain log_softmax/softmax references: values and gradients."""

from __future__ import annotations

import pytest
import torch

from lit_memopt.ops import (
    linear_entropy,
    linear_kl,
    linear_logprobs,
    linear_logprobs_and_entropy,
    linear_self_certainty,
)

IGNORE = -100


# ---------------------------------------------------------------- plain references (full logits)


def ref_logits(hidden, weight, bias=None, temperature=1.0):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    return z / temperature


def ref_logprobs(hidden, weight, targets, bias=None, temperature=1.0):
    logp = torch.log_softmax(ref_logits(hidden, weight, bias, temperature), dim=-1)
    valid = targets != IGNORE
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def ref_entropy(hidden, weight, bias=None, temperature=1.0):
    logp = torch.log_softmax(ref_logits(hidden, weight, bias, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def ref_self_certainty(hidden, weight, bias=None, temperature=1.0):
    z = ref_logits(hidden, weight, bias, temperature)
    return torch.logsumexp(z, dim=-1) - z.mean(-1)


def ref_kl(hidden, weight, ref_hidden, ref_weight, temperature=1.0):
    logp = torch.log_softmax(ref_logits(hidden, weight, None, temperature), dim=-1)
    logq = torch.log_softmax(ref_logits(ref_hidden, ref_weight, None, temperature), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def make(shape=(3, 5), hidden_size=16, vocab=37, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g)).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, shape, generator=g)
    return hidden, weight, b, targets


def grads_of(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * upstream).sum(), [t for t in inputs if t is not None], retain_graph=True)


OPS = {
    "logprobs": (
        lambda h, w, b, t, T, c, **kw: linear_logprobs(h, w, t, bias=b, temperature=T, chunk_size=c, **kw),
        lambda h, w, b, t, T: ref_logprobs(h, w, t, b, T),
    ),
    "entropy": (
        lambda h, w, b, t, T, c, **kw: linear_entropy(h, w, bias=b, temperature=T, chunk_size=c, **kw),
        lambda h, w, b, t, T: ref_entropy(h, w, b, T),
    ),
    "self_certainty": (
        lambda h, w, b, t, T, c, **kw: linear_self_certainty(h, w, bias=b, temperature=T, chunk_size=c, **kw),
        lambda h, w, b, t, T: ref_self_certainty(h, w, b, T),
    ),
    "logprobs_and_entropy": (
        lambda h, w, b, t, T, c, **kw: torch.stack(linear_logprobs_and_entropy(h, w, t, bias=b, temperature=T, chunk_size=c, **kw)),
        lambda h, w, b, t, T: torch.stack(
            [ref_logprobs(h, w, t, b, T), torch.where(t != IGNORE, ref_entropy(h, w, b, T), 0.0)]
        ),
    ),
}


# ---------------------------------------------------------------- fp32 forward + backward


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize(
    "chunk, temperature, bias",
    [((4, 7), 1.0, False), ((3, 10), 0.7, True), (None, 1.3, True), (1, 1.0, False)],
)
def test_fp32_matches_reference(name, chunk, temperature, bias):
    fused, ref = OPS[name]
    hidden, weight, b, targets = make(bias=bias)
    targets[0, 1] = IGNORE
    targets[2, 4] = IGNORE
    out = fused(hidden, weight, b, targets, temperature, chunk)
    expected = ref(hidden, weight, b, targets, temperature)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    got = grads_of(out, (hidden, weight, b))
    want = grads_of(expected.float(), (hidden, weight, b))
    for g_got, g_want, t in zip(got, want, (hidden, weight, b)):
        assert g_got.dtype == t.dtype
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)


def test_kl_fp32_matches_reference_and_is_policy_only():
    hidden, weight, _, _ = make()
    ref_hidden, ref_weight, _, _ = make(seed=5)
    ref_hidden.requires_grad_(True)
    ref_weight.requires_grad_(True)
    out = linear_kl(hidden, weight, ref_hidden, ref_weight, temperature=0.8, chunk_size=(4, 9))
    expected = ref_kl(hidden, weight, ref_hidden.detach(), ref_weight.detach(), temperature=0.8)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert (out > -1e-6).all()
    got = grads_of(out, (hidden, weight))
    want = grads_of(expected.float(), (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert ref_hidden.grad is None and ref_weight.grad is None


def test_kl_with_shared_weight_gets_policy_gradient_only():
    # A LoRA policy's reference shares the head weight: only the policy side may contribute.
    hidden, weight, _, _ = make()
    ref_hidden = torch.randn_like(hidden).detach()
    out = linear_kl(hidden, weight, ref_hidden, weight, chunk_size=(5, 8))
    (g_fused,) = torch.autograd.grad(out.sum(), weight)
    expected = ref_kl(hidden, weight, ref_hidden, weight.detach())
    (g_ref,) = torch.autograd.grad(expected.float().sum(), weight)
    torch.testing.assert_close(g_fused, g_ref, rtol=1e-4, atol=1e-5)
    # Identical policy and reference -> KL 0.
    zero = linear_kl(hidden, weight, hidden.detach(), weight)
    torch.testing.assert_close(zero, torch.zeros_like(zero), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- float64 gradcheck


@pytest.mark.parametrize("name", sorted(OPS) + ["kl"])
def test_gradcheck_float64(name):
    # 3 rows x 7 vocab in (2, 3) tiles: crosses both tile boundaries with ragged last tiles.
    hidden, weight, b, targets = make(shape=(3,), hidden_size=3, vocab=7, dtype=torch.float64, bias=name != "kl")
    targets[1] = IGNORE
    if name == "kl":
        ref_h = torch.randn(3, 3, dtype=torch.float64)
        ref_w = torch.randn(7, 3, dtype=torch.float64)

        def fn(h, w):
            return linear_kl(h, w, ref_h, ref_w, temperature=0.9, chunk_size=(2, 3))

        assert torch.autograd.gradcheck(fn, (hidden, weight))
        return
    fused, _ = OPS[name]
    assert torch.autograd.gradcheck(lambda h, w, bb: fused(h, w, bb, targets, 0.9, (2, 3)), (hidden, weight, b))


# ---------------------------------------------------------------- dtypes, autocast, grads


@pytest.mark.parametrize("name", ["logprobs", "entropy", "self_certainty"])
def test_bf16_inputs_within_bf16_tolerance(name):
    fused, ref = OPS[name]
    hidden, weight, b, targets = make(shape=(4, 6), hidden_size=32, vocab=101, dtype=torch.bfloat16, bias=True)
    out = fused(hidden, weight, b, targets, 1.0, (5, 16), precision="exact")
    assert out.dtype == torch.float32
    expected = ref(hidden, weight, b, targets, 1.0)  # exact maths on the same bf16 values
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    got = grads_of(out, (hidden, weight, b))
    want = grads_of(expected.float(), (hidden, weight, b))
    for g_got, g_want, t in zip(got, want, (hidden, weight, b)):
        assert g_got.dtype == torch.bfloat16
        torch.testing.assert_close(g_got.float(), g_want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", ["exact", "auto"])
def test_autocast_still_computes_in_fp32(precision):
    """Under bf16 autocast, "exact" keeps fp32 tiles; "auto" does too unless the CPU multiplies bf16 natively
    (AVX512-BF16, AMX), where it multiplies bf16 tiles as the autocast lm_head would (fp32 outputs either way)."""
    from lit_memopt.ops._head_tiles import native_low_precision_matmul

    hidden, weight, _, targets = make(shape=(2, 9), hidden_size=24, vocab=53)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_logprobs(hidden, weight, targets, chunk_size=(4, 8), precision=precision)
    assert out.dtype == torch.float32
    bf16_tiles = precision == "auto" and native_low_precision_matmul(hidden.device, torch.bfloat16)
    tolerance = 3e-2 if bf16_tiles else 1e-5  # logits rounded to bf16 (8 bits of mantissa) vs fp32 tiles
    torch.testing.assert_close(out.double(), ref_logprobs(hidden, weight, targets), rtol=tolerance, atol=tolerance)
    out.sum().backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


def test_mixed_dtypes_bf16_hidden_fp32_weight():
    hidden, weight, _, targets = make()
    h16 = hidden.detach().bfloat16().requires_grad_()
    out = linear_logprobs(h16, weight, targets, chunk_size=(4, 8))
    torch.testing.assert_close(out.double(), ref_logprobs(h16, weight, targets), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert h16.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_only_one_input_requires_grad(which):
    hidden, weight, _, targets = make()
    (hidden if which == "weight" else weight).requires_grad_(False)
    out = linear_entropy(hidden, weight, chunk_size=(4, 6))
    out.sum().backward()
    expected = ref_entropy(hidden.detach(), weight.detach())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    leaf = hidden if which == "hidden" else weight
    other = weight if which == "hidden" else hidden
    assert leaf.grad is not None and other.grad is None
    leaf2 = leaf.detach().clone().requires_grad_()
    args = (leaf2, weight.detach()) if which == "hidden" else (hidden.detach(), leaf2)
    ref_entropy(*args).float().sum().backward()
    torch.testing.assert_close(leaf.grad, leaf2.grad, rtol=1e-4, atol=1e-5)


def test_no_grad_inputs_give_plain_tensor():
    hidden, weight, _, targets = make()
    out = linear_logprobs(hidden.detach(), weight.detach(), targets)
    assert not out.requires_grad


def test_tied_embedding_accumulates_both_paths():
    torch.manual_seed(0)
    vocab, size = 29, 12
    emb = torch.nn.Embedding(vocab, size)
    ids = torch.randint(0, vocab, (3, 7))
    targets = torch.randint(0, vocab, (3, 7))
    hidden = torch.tanh(emb(ids))
    linear_logprobs(hidden, emb.weight, targets, chunk_size=(5, 6)).sum().backward()
    fused_grad = emb.weight.grad.clone()
    emb.weight.grad = None
    hidden = torch.tanh(emb(ids))
    ref_logprobs(hidden, emb.weight, targets).float().sum().backward()
    torch.testing.assert_close(fused_grad, emb.weight.grad, rtol=1e-4, atol=1e-5)


def test_ignore_index_gives_zero_and_no_gradient():
    hidden, weight, _, targets = make(shape=(2, 4))
    targets[0] = IGNORE
    logp, ent = linear_logprobs_and_entropy(hidden, weight, targets, chunk_size=(3, 5))
    assert (logp[0] == 0).all() and (ent[0] == 0).all() and (ent[1] > 0).all()
    (logp.sum() + ent.sum()).backward()
    assert (hidden.grad[0] == 0).all() and (hidden.grad[1] != 0).any()
    # all-ignored batch: zero output and zero weight gradient
    weight.grad = None
    linear_logprobs(hidden, weight, torch.full_like(targets, IGNORE)).sum().backward()
    assert (weight.grad == 0).all()


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 5), (0, 4)])
def test_arbitrary_leading_dims_and_noncontiguous(shape):
    hidden, weight, b, targets = make(shape=shape, bias=True)
    out = linear_logprobs(hidden, weight, targets, bias=b, chunk_size=(4, 10))
    assert out.shape == shape
    torch.testing.assert_close(out.double(), ref_logprobs(hidden, weight, targets, b), rtol=1e-5, atol=1e-5)
    got = grads_of(out, (hidden, weight, b))
    want = grads_of(ref_logprobs(hidden, weight, targets, b).float(), (hidden, weight, b))
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)
    # a transposed (non-contiguous) hidden view
    h = torch.randn(16, 6).T.requires_grad_() if shape == () else None
    if h is not None:
        t = torch.randint(0, 37, (6,))
        torch.testing.assert_close(
            linear_logprobs(h, weight, t).double(), ref_logprobs(h, weight, t), rtol=1e-5, atol=1e-5
        )


def test_odd_tile_sizes_and_auto_tiles_agree():
    hidden, weight, b, targets = make(shape=(17,), hidden_size=8, vocab=131, bias=True)
    outs = [linear_entropy(hidden, weight, bias=b, chunk_size=c) for c in (None, 1, (17, 131), (3, 17), (16, 64))]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


def test_extreme_logits_are_finite():
    hidden, weight, _, targets = make(shape=(4,), hidden_size=4, vocab=19)
    with torch.no_grad():
        hidden.mul_(300.0)
    for fn in (
        lambda: linear_logprobs(hidden, weight, targets, chunk_size=(2, 5)),
        lambda: linear_entropy(hidden, weight, chunk_size=(2, 5)),
        lambda: linear_self_certainty(hidden, weight, chunk_size=(2, 5)),
    ):
        out = fn()
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(hidden.grad).all()
        hidden.grad = None
    torch.testing.assert_close(
        linear_entropy(hidden, weight, chunk_size=(2, 5)).double(), ref_entropy(hidden, weight), rtol=1e-4, atol=1e-4
    )


def test_self_certainty_relation_to_uniform_kl():
    hidden, weight, _, _ = make()
    sc = linear_self_certainty(hidden, weight).double()
    logp = torch.log_softmax(ref_logits(hidden, weight), -1)
    kl_uniform_to_p = (-logp).mean(-1) - torch.log(torch.tensor(37.0, dtype=torch.float64))
    torch.testing.assert_close(sc, kl_uniform_to_p + torch.log(torch.tensor(37.0, dtype=torch.float64)), rtol=1e-5, atol=1e-5)


def test_double_backward_raises():
    hidden, weight, _, targets = make()
    out = linear_logprobs(hidden, weight, targets)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), hidden, create_graph=True)


# ---------------------------------------------------------------- errors


def test_clear_errors():
    hidden, weight, b, targets = make()
    with pytest.raises(ValueError, match="`weight` has hidden size"):
        linear_entropy(hidden, weight[:, :5])
    with pytest.raises(ValueError, match="`weight` must have at least 2"):
        linear_entropy(hidden, weight[0])
    with pytest.raises(TypeError, match="`hidden` must be a floating-point"):
        linear_entropy(targets.unsqueeze(-1).expand(3, 5, 16), weight)
    with pytest.raises(ValueError, match="`targets` must have shape"):
        linear_logprobs(hidden, weight, targets[0])
    with pytest.raises(TypeError, match="`targets` must be an integer"):
        linear_logprobs(hidden, weight, targets.float())
    with pytest.raises(ValueError, match=r"`targets` must be in \[0, 37\)"):
        linear_logprobs(hidden, weight, torch.full_like(targets, 37))
    with pytest.raises(ValueError, match="`bias` must have shape"):
        linear_entropy(hidden, weight, bias=torch.zeros(5))
    with pytest.raises(ValueError, match="`temperature`"):
        linear_entropy(hidden, weight, temperature=0.0)
    with pytest.raises(ValueError, match="`chunk_size`"):
        linear_entropy(hidden, weight, chunk_size=0)
    with pytest.raises(TypeError, match="`chunk_size`"):
        linear_entropy(hidden, weight, chunk_size="auto")
    with pytest.raises(ValueError, match="`weight` is on meta"):
        linear_entropy(hidden, weight.detach().to("meta"))
    with pytest.raises(ValueError, match="`ref_weight` has vocabulary size"):
        linear_kl(hidden, weight, hidden.detach(), weight.detach()[:5])
    with pytest.raises(ValueError, match="`ref_hidden` leading shape"):
        linear_kl(hidden, weight, hidden.detach()[0], weight.detach())


# ---------------------------------------------------------------- layout and memory


def test_non_contiguous_weight_and_bf16_single_tile():
    torch.manual_seed(0)
    weight_t = torch.randn(16, 37, requires_grad=True)  # stored [H, V]; the head uses its transpose
    hidden, _, b, targets = make(bias=True)
    out = linear_logprobs(hidden, weight_t.t(), targets, bias=b)
    out.sum().backward()
    g = weight_t.grad.clone()
    weight_t.grad = None
    ref_logprobs(hidden, weight_t.t(), targets, b).float().sum().backward()
    torch.testing.assert_close(g, weight_t.grad, rtol=1e-4, atol=1e-5)
    h16, w16, _, t16 = make(dtype=torch.bfloat16)
    out16 = linear_entropy(h16, w16, precision="exact")  # automatic tiles: one row tile, bf16 weight-gradient tile
    out16.sum().backward()
    w_ref = w16.detach().clone().requires_grad_()
    ref_entropy(h16.detach(), w_ref).float().sum().backward()
    torch.testing.assert_close(w16.grad.float(), w_ref.grad.float(), rtol=2e-2, atol=2e-2)


def test_automatic_tiles_stay_small_at_real_scale():
    from lit_memopt.ops.linear_head import _MAX_TILE_ELEMENTS, _tile_sizes

    for n, h, v in [(8192, 2560, 151936), (64 * 6144, 4096, 151936), (3, 7, 11), (100000, 64, 50)]:
        rows, cols = _tile_sizes(None, n, h, v, torch.device("cpu"))
        assert 1 <= rows <= n and 1 <= cols <= v
        budget = max(min(n * h, _MAX_TILE_ELEMENTS), 1 << 18)
        assert rows * cols <= budget and rows * h <= max(budget, h) and cols * h <= max(budget, h)


def test_fast_tiles_are_wider_only_below_the_cap():
    from lit_memopt.ops.linear_head import _MAX_TILE_ELEMENTS, _tile_sizes

    cpu = torch.device("cpu")
    # Below the cap "fast" may double the vocabulary tile (fewer bf16-rounded partial products).
    assert _tile_sizes(None, 2048, 512, 32000, cpu, fast=True) == (2048, 1024)
    assert _tile_sizes(None, 2048, 512, 32000, cpu) == (2048, 512)
    for n, h, v in [(8192, 2560, 151936), (64 * 6144, 4096, 151936), (3, 7, 11), (100000, 64, 50)]:
        rows, cols = _tile_sizes(None, n, h, v, cpu, fast=True)
        assert rows * cols <= _MAX_TILE_ELEMENTS and cols * h <= max(_MAX_TILE_ELEMENTS, h)
        if n * h >= _MAX_TILE_ELEMENTS:  # at the cap: the same tiles as "exact", so the same memory
            assert (rows, cols) == _tile_sizes(None, n, h, v, cpu)


def test_cuda_tiles_have_a_larger_floor_and_the_same_cap(monkeypatch):
    """Small shapes get fewer, larger tiles on CUDA (a GPU pass is bound by the work per tile); shapes at the
    cap tile as on a CPU. The policy is pure arithmetic on the device type, so it is checked here without a GPU
    (the free-memory cap needs one: tests/test_cuda.py)."""
    from lit_memopt.ops._head_tiles import CUDA_MIN_TILE_ELEMENTS, MAX_TILE_ELEMENTS, tile_sizes

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no free-memory cap, GPU or not
    rows, cols = tile_sizes(None, 2048, 512, 32000, cuda)
    assert rows == 2048 and rows * cols == CUDA_MIN_TILE_ELEMENTS  # 8x the CPU's 2048 x 512 tile
    assert tile_sizes(None, 2048, 512, 32000, cpu) == (2048, 512)
    for n, h, v in [(8192, 2560, 151936), (64 * 6144, 4096, 151936)]:  # at the cap
        for fast in (False, True):
            assert tile_sizes(None, n, h, v, cuda, fast=fast) == tile_sizes(None, n, h, v, cpu, fast=fast)
    for n, h, v in [(3, 7, 11), (100000, 64, 50), (4096, 1024, 50000)]:
        rows, cols = tile_sizes(None, n, h, v, cuda, fast=True)
        assert 1 <= rows <= n and 1 <= cols <= v and rows * cols <= MAX_TILE_ELEMENTS
    # Masking takes no CUDA tile below the floor (smaller tiles would only add host work per row): 512 counted
    # rows of 2048 get the floor's tile, and fewer row tiles than the unmasked call.
    rows, cols = tile_sizes(None, 512, 512, 32000, cuda, total_rows=2048)
    assert rows == 512 and rows * cols == CUDA_MIN_TILE_ELEMENTS
    # At the cap, a quarter of the rows counted: "fast" keeps a floor-sized logits tile, "exact" the tile of an
    # unmasked 2048-row call (its fp32 weight tile binds first); both smaller than the unmasked tile.
    masked = {fast: tile_sizes(None, 2048, 2560, 151936, cuda, fast=fast, total_rows=8192, fused=True) for fast in (False, True)}
    assert masked[True] == (2048, CUDA_MIN_TILE_ELEMENTS // 2048)
    assert masked[False] == tile_sizes(None, 2048, 2560, 151936, cuda, fused=True)
    for fast in (False, True):
        unmasked = tile_sizes(None, 8192, 2560, 151936, cuda, fast=fast, fused=True)
        assert masked[fast][0] * masked[fast][1] <= unmasked[0] * unmasked[1]


def test_fast_tiles_in_one_row_tile_are_bounded_as_logits_tiles_only(monkeypatch):
    """With "fast" and every row in one row tile, no [vocab_tile, H] buffer exists (weight tiles are views,
    each weight-gradient tile goes straight into the gradient), so a wide hidden size does not narrow the
    vocabulary tile; "exact" (an fp32 copy of each weight tile) and several row tiles still bound it."""
    from lit_memopt.ops._head_tiles import CUDA_MIN_TILE_ELEMENTS, MIN_TILE_ELEMENTS, tile_sizes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no free-memory cap, GPU or not
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    budget = 2 * CUDA_MIN_TILE_ELEMENTS  # "fast" vocabulary budget on CUDA
    assert tile_sizes(None, 512, 1536, 151936, cuda, fast=True, fused=True) == (512, budget // 512)
    rows, cols = tile_sizes(None, 512, 1536, 151936, cuda, fast=False, fused=True)
    assert cols * 1536 <= CUDA_MIN_TILE_ELEMENTS
    rows, cols = tile_sizes(None, 512, 1536, 151936, cuda, fast=True, fused=True, weight_copied=True)  # fp32 weight, autocast
    assert cols * 1536 <= budget
    rows, cols = tile_sizes(None, 64, 4096, 50000, cpu, fast=True)  # one row tile on a CPU too
    assert rows == 64 and rows * cols <= 2 * MIN_TILE_ELEMENTS and cols * 4096 > 2 * MIN_TILE_ELEMENTS
    rows, cols = tile_sizes(None, 100000, 4096, 50000, cpu, fast=True)  # several row tiles: bounded both ways
    assert rows < 100000 and cols * 4096 <= tile_sizes(None, 100000, 4096, 50000, cpu, fast=False)[0] * 4096 * 2


def test_tiles_shrink_with_the_share_of_rows_that_count():
    """With 75% of the rows masked the tile budget is a quarter of the unmasked one, even at the cap."""
    from lit_memopt.ops.linear_head import _tile_sizes

    cpu = torch.device("cpu")
    for n, h, v in [(8192, 2560, 151936), (2048, 512, 32000), (64 * 6144, 4096, 151936)]:
        for fast in (False, True):
            full = _tile_sizes(None, n, h, v, cpu, fast=fast)
            assert _tile_sizes(None, n, h, v, cpu, fast=fast, total_rows=n) == full
            rows, cols = _tile_sizes(None, n // 4, h, v, cpu, fast=fast, total_rows=n)
            assert rows <= n // 4
            # a quarter of the unmasked logits tile (up to the 128-row alignment), and no wider weight tile
            assert rows * cols <= full[0] * full[1] / 4 * 1.2 and cols <= full[1]


def random_head(n: int, h: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 hidden states ``[n, h]`` and head weight ``[v, h]`` that need gradients, and targets, from seed 0."""
    torch.manual_seed(0)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    return hidden, weight, torch.randint(0, v, (n,))


def step_extra_bytes(step, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak bytes ``step`` (a forward and backward) allocates beyond its inputs and their fp32 gradients."""
    from lit_memopt.memory.fake import peak_during

    hidden.grad = weight.grad = None
    extra = peak_during(step, hidden, weight, targets).extra_bytes - (hidden.numel() + weight.numel()) * 4
    hidden.grad = weight.grad = None
    return extra


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-tiles", "compiled-tiles"])
def test_fused_peak_memory_is_a_fraction_of_naive(compiled, monkeypatch):
    """Eager tiles (the CPU default) and compiled ones (the CUDA default, here compiled for the CPU) both keep the
    extra memory to a few tiles, whatever the vocabulary size."""
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "1" if compiled else "0")
    n, h = 64, 32

    def extras(v: int) -> tuple[int, int]:
        hidden, weight, targets = random_head(n, h, v)

        def naive():
            ref_logprobs(hidden, weight, targets).sum().backward()

        def fused():
            linear_logprobs(hidden, weight, targets).sum().backward()

        fused()  # compiles the tile functions (once per process) outside the measurement
        return step_extra_bytes(naive, hidden, weight, targets), step_extra_bytes(fused, hidden, weight, targets)

    naive_extra, fused_extra = extras(20000)
    assert naive_extra > 2 * n * 20000 * 8  # several float64 [n, v] tensors
    # Tiles of the automatic budget (1 << 18 elements here): eager updates them in place, the compiled functions return
    # new ones so that the compiler can fuse them (measured: 2 MiB eager, 6 MiB compiled).
    tile = (1 << 18) * 4
    assert fused_extra <= (8 if compiled else 4) * tile
    assert fused_extra <= (0.2 if compiled else 0.1) * naive_extra
    # four times the vocabulary: the naive extra grows with it, the fused one stays a few tiles
    naive_wide, fused_wide = extras(80000)
    assert naive_wide > 3 * naive_extra and fused_wide <= fused_extra + tile // 4


# ---------------------------------------------------------------- backward row super-blocks


@pytest.mark.parametrize("name", sorted(OPS) + ["kl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_row_super_blocks_match_reference(name, dtype):
    # A small explicit row tile makes the backward walk the rows in several super-blocks (the last
    # one partial), so the per-block hidden-gradient accumulator and the weight gradient summed
    # across blocks are both exercised.
    from lit_memopt.ops.linear_head import _SUPER_BLOCK_ROW_TILES

    shape, row_tile, vocab_tile = (6, 7), 2, 9
    rows = shape[0] * shape[1]
    block = row_tile * _SUPER_BLOCK_ROW_TILES
    assert rows > 3 * block and rows % block != 0
    bias = name != "kl"
    hidden, weight, b, targets = make(shape=shape, hidden_size=24, vocab=61, dtype=dtype, bias=bias, seed=3)
    targets[1, 2] = IGNORE
    # bf16 runs at T=1: with T != 1 the bf16 weight tile is scaled by 1/T before it reaches fp32, a
    # separate ~2^-9 relative forward error that this test is not about.
    temperature = 0.7 if dtype == torch.float32 else 1.0
    if name == "kl":
        ref_h = (hidden.detach().float() + 0.3 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4))).to(dtype)
        ref_w = (weight.detach().float() * 0.9).to(dtype)
        out = linear_kl(hidden, weight, ref_h, ref_w, temperature=temperature, chunk_size=(row_tile, vocab_tile), precision="exact")
        expected = ref_kl(hidden, weight, ref_h, ref_w, temperature)
    else:
        fused, ref = OPS[name]
        out = fused(hidden, weight, b, targets, temperature, (row_tile, vocab_tile), precision="exact")
        expected = ref(hidden, weight, b, targets, temperature)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    inputs = (hidden, weight, b)
    got = grads_of(out, inputs)
    want = grads_of(expected.float(), inputs)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for g_got, g_want, t in zip(got, want, [t for t in inputs if t is not None]):
        assert g_got.dtype == t.dtype and g_got.shape == t.shape
        torch.testing.assert_close(g_got.float(), g_want.float(), **tol)


def test_bf16_weight_with_temperature_is_scaled_in_fp32() -> None:
    """With a bf16 head and temperature != 1, W / T must not be rounded to bf16 before the fp32 maths."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 32).bfloat16()
    weight = torch.randn(300, 32).bfloat16()
    from lit_memopt.ops import linear_entropy

    got = linear_entropy(hidden, weight, temperature=0.7, chunk_size=(16, 64), precision="exact")
    z = (hidden.double() @ weight.double().T) / 0.7
    want = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)
