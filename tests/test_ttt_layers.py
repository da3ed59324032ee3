"""TTT layers: dual form vs a primal autograd reference, scan checkpointing, causality, remainders, gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_memopt.models.ttt import TTTConfig, TTTLinear, TTTMLP, auto_checkpoint_group_size



@pytest.fixture(autouse=True)
def _float64():
    """The comparisons below are about maths, not rounding: run them in float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _heads(layer, t):
    B, T, _ = t.shape
    return t.reshape(B, T, layer.num_heads, layer.head_dim).transpose(1, 2)


def _inner_model(layer, params, x):
    if isinstance(layer, TTTLinear):
        W, b = params
        return x @ W + b
    W1, b1, W2, b2 = params
    return F.gelu(x @ W1 + b1) @ W2 + b2


def _inner_ln(layer, z):
    w = layer.inner_norm_weight[None, :, None, :]
    b = layer.inner_norm_bias[None, :, None, :]
    return F.layer_norm(z, (z.shape[-1],), eps=1e-6) * w + b


def primal_reference(layer, x):
    """Plain mini-batch TTT: per-token inner gradients by autograd, then explicit weights W_i per token."""
    B, T, _ = x.shape
    q, k, v = _heads(layer, layer.q_proj(x)), _heads(layer, layer.k_proj(x)), _heads(layer, layer.v_proj(x))
    lr = layer.base_lr * torch.sigmoid(torch.einsum("btc,hc->bht", x, layer.lr_weight) + layer.lr_bias[:, None])
    lr = lr / layer.head_dim
    state = [p.unsqueeze(0).expand(B, *p.shape) for p in layer.inner_parameters()]
    outs = []
    for start in range(0, T, layer.mini_batch_size):
        end = min(start + layer.mini_batch_size, T)
        grads = []
        for j in range(start, end):
            kj, vj = k[:, :, j : j + 1], v[:, :, j : j + 1]
            loss = 0.5 * (_inner_ln(layer, _inner_model(layer, state, kj)) - (vj - kj)).pow(2).sum()
            grads.append(torch.autograd.grad(loss, state, create_graph=True))
        running = [torch.zeros_like(s) for s in state]
        for i in range(start, end):
            pos = i - start
            scale = torch.clamp_min(1.0 / (pos + 1) + layer.token_scale_offset[pos], 0.0)
            lr_i = lr[:, :, i].reshape(B, layer.num_heads, 1, 1)
            running = [r + lr_i * g for r, g in zip(running, grads[pos])]
            weights = [s - scale * r for s, r in zip(state, running)]
            qi = q[:, :, i : i + 1]
            outs.append(qi + _inner_ln(layer, _inner_model(layer, weights, qi)))
        state = weights
    out = torch.cat(outs, dim=2).transpose(1, 2).reshape(B, T, layer.hidden_size)
    return layer.o_proj(layer.post_norm(out))


def _perturbed(layer):
    """Non-trivial values for parameters that start at 0/1, so the test exercises them."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.token_scale_offset.copy_(0.1 * torch.randn(layer.token_scale_offset.shape, generator=g))
        layer.lr_bias.copy_(torch.randn(layer.lr_bias.shape, generator=g))
        layer.inner_norm_weight.add_(0.2 * torch.randn(layer.inner_norm_weight.shape, generator=g))
        layer.inner_norm_bias.add_(0.2 * torch.randn(layer.inner_norm_bias.shape, generator=g))
        for p in layer.inner_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return layer


def _make(kind, **kw):
    torch.manual_seed(0)
    cls = {"linear": TTTLinear, "mlp": TTTMLP}[kind]
    extra = {"expansion": 2} if kind == "mlp" else {}
    return _perturbed(cls(16, 2, mini_batch_size=4, base_lr=kw.pop("base_lr", 1.0), **extra, **kw))


def _grads(layer, x, fn):
    x = x.clone().requires_grad_(True)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    (fn(x) * w).sum().backward()
    out = {n: p.grad.clone() for n, p in layer.named_parameters()}
    out["input"] = x.grad.clone()
    layer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("T", [10])  # two full mini-batches, then a remainder starting from their state
def test_dual_form_matches_primal_outputs_and_gradients(kind, T):
    layer = _make(kind, base_lr=3.0)
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), primal_reference(layer, x), rtol=1e-9, atol=1e-10)
    dual = _grads(layer, x, layer)
    primal = _grads(layer, x, lambda t: primal_reference(layer, t))
    assert dual.keys() == primal.keys()
    for name in dual:
        torch.testing.assert_close(dual[name], primal[name], rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_scan_checkpointing_gives_identical_gradients(kind):
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(2))  # 4 mini-batches + 3
    plain = _make(kind)
    ref_out = plain(x)
    ref = _grads(plain, x, plain)
    # 4 full mini-batches: groups of one, groups of 3 + 1, and the whole layer in one recomputation
    for group in (1, 3, 4, 100):
        layer = _make(kind, checkpoint_group_size=group)
        assert torch.equal(layer(x), ref_out)
        got = _grads(layer, x, layer)
        for name in ref:
            assert torch.equal(got[name], ref[name]), (group, name)
        # the input also feeding something outside the layer (a residual): still bit-identical
        got = _grads(layer, x, lambda t: 2 * t + layer(t))
        want = _grads(plain, x, lambda t: 2 * t + plain(t))
        for name in want:
            assert torch.equal(got[name], want[name]), (group, name, "residual")


def _saved_bytes_recorded(fn):
    """Bytes autograd saves for backward through the hooks seen by the caller (a checkpoint's
    own hooks take over inside it, so what a checkpoint recomputes is not counted)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_scan_checkpointing_saves_fewer_tensors():
    """With checkpointing, backward holds only group-boundary states: count saved-tensor bytes."""
    x = torch.randn(2, 64, 16, requires_grad=True)

    def saved_bytes(group):
        layer = _make("linear", checkpoint_group_size=group)
        return _saved_bytes_recorded(lambda: layer(x))

    assert saved_bytes(4) < 0.6 * saved_bytes(0)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_layer_checkpointing_with_input_norm_gives_identical_gradients(kind):
    """``layer(x, norm)`` == ``layer(norm(x))``, and with checkpointing (the whole layer, input
    norm included, recomputed in backward) outputs and gradients stay bit-identical."""
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(8))
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(16, generator=torch.Generator().manual_seed(9)))
    plain = _make(kind)
    ref_out = plain(norm(x))
    ref = _grads(plain, x, lambda t: plain(norm(t)))
    ref_norm = norm.weight.grad.clone()
    norm.zero_grad(set_to_none=True)
    assert torch.equal(plain(x, norm), ref_out)
    for group in (1, 3, 4):
        layer = _make(kind, checkpoint_group_size=group)
        assert torch.equal(layer(x, norm), ref_out)
        got = _grads(layer, x, lambda t: layer(t, norm))
        for name in ref:
            assert torch.equal(got[name], ref[name]), (group, name)
        assert torch.equal(norm.weight.grad, ref_norm), group
        norm.zero_grad(set_to_none=True)


def test_checkpointing_covers_the_whole_layer_and_its_input_norm():
    """Nothing of the layer (input norm, q/k/v, learning-rate gate, scan, output norm and
    projection) is saved outside the checkpoint: backward keeps only the layer input."""
    x = torch.randn(2, 22, 16, requires_grad=True)
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    input_bytes = x.numel() * x.element_size()
    assert _saved_bytes_recorded(lambda: _make("linear")(x, norm)) > 10 * input_bytes
    for kind in ("linear", "mlp"):
        assert _saved_bytes_recorded(lambda: _make(kind, checkpoint_group_size=2)(x, norm)) == input_bytes, kind


def test_checkpointing_under_bf16_autocast_is_bit_identical():
    """The recomputation in backward re-enters the forward's autocast (projections in bf16, the
    scan in float32), so outputs and gradients still match the plain layer exactly."""
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(12)).float()
    results = []
    for group in (0, 2, 100):
        layer = _make("linear", checkpoint_group_size=group).float()
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(xg)
        assert out.dtype == torch.bfloat16
        out.float().pow(2).sum().backward()
        results.append((out, xg.grad, {n: p.grad for n, p in layer.named_parameters()}))
    ref_out, ref_x, ref = results[0]
    for out, gx, got in results[1:]:
        assert torch.equal(out, ref_out) and torch.equal(gx, ref_x)
        assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_checkpointing_with_a_plain_function_norm_and_frozen_parameters():
    """A non-module ``input_norm`` is applied outside the checkpoint (its closed-over parameters
    still get gradients); frozen layer parameters get none; with nothing requiring grad the layer
    runs plainly."""
    x = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(13))
    scale = torch.full((16,), 1.5, requires_grad=True)

    def norm(t):
        return t * scale

    grads = []
    for group in (0, 3):
        layer = _make("mlp", checkpoint_group_size=group)
        layer.q_proj.weight.requires_grad_(False)
        scale.grad = None
        xg = x.clone().requires_grad_(True)
        layer(xg, norm).sum().backward()
        assert layer.q_proj.weight.grad is None
        grads.append((xg.grad, scale.grad.clone(), layer.k_proj.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    frozen = _make("linear", checkpoint_group_size=2).requires_grad_(False)
    out = frozen(x)
    assert not out.requires_grad and out.grad_fn is None


def test_checkpointed_model_gives_identical_gradients():
    cfg = dict(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=24, mini_batch_size=4, conv_kernel=2)
    ids = torch.randint(0, 384, (2, 22), generator=torch.Generator().manual_seed(10))

    def run(group, conv=True):
        torch.manual_seed(0)
        model = TTTConfig(**cfg, checkpoint_group_size=group, checkpoint_conv=conv).build_model().double()
        out = model(ids)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(11))).sum().backward()
        return out, {n: p.grad for n, p in model.named_parameters()}

    ref_out, ref = run(0)
    # 5 full mini-batches of 4 (+ a remainder of 2): 5 is the whole layer; the conv recomputed with
    # the TTT layer or stored
    for group, conv in ((1, True), (2, True), (5, True), (2, False), (5, False)):
        out, got = run(group, conv)
        assert torch.equal(out, ref_out)
        for name in ref:
            assert torch.equal(got[name], ref[name]), (group, conv, name)


def test_checkpointed_block_keeps_only_its_input_for_the_mixing_half():
    """With checkpointing on, a block saves its input for the conv + TTT half (plus what its MLP
    half saves, the same in both); with ``checkpoint_conv=False`` the conv's activations too."""
    cfg = dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=24, mini_batch_size=4, conv_kernel=2)
    x = torch.randn(2, 22, 16, requires_grad=True)

    def saved(**kw):
        block = TTTConfig(**cfg, **kw).build_model().layers[0]
        mlp_half = _saved_bytes_recorded(lambda: block.mlp(block.ffn_norm(x)) + x)
        return _saved_bytes_recorded(lambda: block(x)) - mlp_half

    input_bytes = x.numel() * x.element_size()
    assert saved(checkpoint_group_size=2) == input_bytes
    assert saved(checkpoint_group_size=2, checkpoint_conv=False) > 2 * input_bytes
    assert saved(checkpoint_group_size=0) > 10 * input_bytes


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_causal_within_and_across_mini_batches(kind):
    layer = _make(kind)
    x = torch.randn(1, 14, 16, generator=torch.Generator().manual_seed(4))
    base = layer(x)
    for t in (1, 5, 9, 12):  # inside the first mini-batch, mid-sequence, inside the remainder
        changed = x.clone()
        changed[:, t:] = torch.randn(changed[:, t:].shape)
        out = layer(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.parametrize("T", [1, 3, 4, 5, 13])
def test_remainder_lengths_equal_prefix_of_longer_sequence(T):
    layer = _make("linear")
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(layer(x[:, :T]), layer(x)[:, :T], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_gradients_reach_inner_initial_weights_and_learning_rate_parameters(kind):
    layer = _make(kind)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(6))
    grads = _grads(layer, x, layer)
    names = [n for n in ("W1", "b1", "W2", "b2") if hasattr(layer, n)]
    for name in [*names, "lr_weight", "lr_bias", "token_scale_offset", "inner_norm_weight", "inner_norm_bias"]:
        assert torch.isfinite(grads[name]).all(), name
        assert grads[name].abs().sum() > 0, name
    # the remainder (positions 8, 9) uses token-scale entries 0 and 1 only; all 4 entries are used
    assert (grads["token_scale_offset"] != 0).all()


def test_bf16_autocast_runs_inner_loop_in_float32():
    torch.manual_seed(0)
    layer = TTTLinear(16, 2, mini_batch_size=4).float()
    x = torch.randn(2, 10, 16, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    ref = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.05)
    assert layer.W1.grad is not None and torch.isfinite(layer.W1.grad).all()


def test_auto_group_size_follows_available_memory():
    kw = dict(num_mini_batches=128, mini_batch_bytes=1000, state_bytes=4000, num_layers=4)
    # budget 1/4 of free: all 4 layers' scans need 512 kB, one layer's 128 kB
    assert auto_checkpoint_group_size(**kw, available_bytes=10**9) == 0  # everything fits: no recompute
    assert auto_checkpoint_group_size(**kw, available_bytes=2_048_000) == 0
    assert auto_checkpoint_group_size(**kw, available_bytes=2_047_999) == 128  # one layer at a time, one pass
    assert auto_checkpoint_group_size(**kw, available_bytes=512_000) == 128
    g = auto_checkpoint_group_size(**kw, available_bytes=511_999)  # grouped recomputation of the scan
    assert g == round((128 * 4000 / 1000) ** 0.5)
    assert auto_checkpoint_group_size(**kw, available_bytes=0) == g
    layer = TTTLinear(16, 2, mini_batch_size=4, checkpoint_group_size="auto")
    layer(torch.randn(1, 16, 16))
    assert layer.last_group_size is not None and layer.last_group_size >= 0


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="checkpoint_group_size"):
        TTTLinear(16, 2, checkpoint_group_size=-1)
    with pytest.raises(ValueError, match="num_heads"):
        TTTLinear(15, 2)
    with pytest.raises(ValueError, match="layer_type"):
        TTTConfig(layer_type="conv")
    with pytest.raises(ValueError, match="budget_fraction"):
        auto_checkpoint_group_size(4, 1, 1, budget_fraction=0.0)


def test_auto_planning_counts_the_layers_given_at_construction():
    """``auto_num_layers`` is a constructor argument: the model passes its ``num_layers``, and with
    free memory that holds one layer's saved scan but not three, one layer keeps everything (0)
    while a layer planned for three recomputes itself in one pass (n)."""
    n, batch = 8, 2
    single = TTTLinear(16, 2, mini_batch_size=4, checkpoint_group_size="auto")
    triple = TTTLinear(16, 2, mini_batch_size=4, checkpoint_group_size="auto", auto_num_layers=3)
    assert single.auto_num_layers == 1 and triple.auto_num_layers == 3
    low, high = 0, 10**9  # the least free memory at which one layer stores its whole scan
    assert single.auto_group_size(n, batch, available_bytes=high) == 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if single.auto_group_size(n, batch, available_bytes=mid) == 0 else (mid, high)
    assert triple.auto_group_size(n, batch, available_bytes=high) == n
    assert triple.auto_group_size(n, batch, available_bytes=3 * high) == 0
    assert 1 <= triple.auto_group_size(n, batch, available_bytes=0) < n
    model = TTTConfig(hidden_size=16, num_layers=3, num_heads=2, intermediate_size=24, checkpoint_group_size="auto").build_model()
    assert [layer.auto_num_layers for layer in model.ttt_layers()] == [3, 3, 3]
    with pytest.raises(ValueError, match="auto_num_layers"):
        TTTLinear(16, 2, auto_num_layers=0)


def test_free_memory_comes_from_the_memory_probe():
    """``"auto"`` reads the CPU's free memory from ``lit_memopt.memory``; a device with no probe
    (``meta``) gives the conservative choice, as if no memory were free."""
    from lit_memopt.memory import memory_snapshot
    from lit_memopt.models.ttt.planning import free_bytes

    assert free_bytes(torch.device("cpu")) > 0
    assert abs(free_bytes(torch.device("cpu")) - memory_snapshot("cpu").free_bytes) < 2**30
    assert free_bytes(torch.device("meta")) is None
    kw = dict(num_mini_batches=128, mini_batch_bytes=1000, state_bytes=4000)
    assert auto_checkpoint_group_size(**kw, device="meta") == auto_checkpoint_group_size(**kw, available_bytes=0)


def test_paper_inner_learning_rate_is_the_default_everywhere():
    from lit_memopt.models.ttt import resolve_inner_base_lr

    assert (TTTLinear.paper_base_lr, TTTMLP.paper_base_lr) == (1.0, 0.1)
    for kind, cls in (("linear", TTTLinear), ("mlp", TTTMLP)):
        assert resolve_inner_base_lr(kind) == cls.paper_base_lr
        assert resolve_inner_base_lr(kind, 0.5) == 0.5
        model = TTTConfig(hidden_size=16, num_layers=1, num_heads=2, layer_type=kind).build_model()
        assert model.ttt_layers()[0].base_lr == cls.paper_base_lr
    with pytest.raises(ValueError, match="layer_type"):
        resolve_inner_base_lr("conv")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_compute_is_the_layer_without_its_checkpoint(kind):
    """``compute(x, group, norm)`` (what a block recomputes inside its own checkpoint) gives the
    layer's output and, when recorded, its gradients exactly."""
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(14))
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    layer = _make(kind, checkpoint_group_size=2)
    group = layer.resolve_group_size(x)
    assert group == 2 and layer.last_group_size == 2
    assert torch.equal(layer.compute(x, group, norm), layer(x, norm))
    want = _grads(layer, x, lambda t: layer(t, norm))
    got = _grads(layer, x, lambda t: layer.compute(t, group, norm))
    assert all(torch.equal(got[name], want[name]) for name in want)
