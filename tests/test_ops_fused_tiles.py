"""The compiled per-tile kernels of the fused head (ops/_fused_tiles.py, CUDA's default) give the same
values and gradients as the eager tile maths and as plain float64 references; forced on the CPU here
(``LIT_MEMOPT_FUSED_TILES=1``), where torch.compile builds C++ kernels of the same functions."""

from __future__ import annotations

import types

import pytest
import torch
from torch._dynamo.utils import counters

from lit_memopt.ops import linear_kl, linear_logprobs, linear_logprobs_and_entropy, linear_self_certainty
from lit_memopt.ops._fused_tiles import use_fused_tiles

IGNORE = -100


def make(dtype=torch.float64, n=37, h=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(v, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[3] = IGNORE
    ref_hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    ref_weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype)
    return hidden, weight, bias, targets, ref_hidden, ref_weight


def run(case: str, fused: bool, monkeypatch, dtype=torch.float64):
    """Outputs and (hidden, weight, bias) gradients of one op, tiled into 16 x 32 tiles (several of each, edges partial)."""
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "1" if fused else "0")
    hidden, weight, bias, targets, ref_hidden, ref_weight = make(dtype)
    tiles = dict(chunk_size=(16, 32))
    if case == "logprobs_entropy":
        out = torch.stack(linear_logprobs_and_entropy(hidden, weight, targets, bias=bias, temperature=0.7,
                                                      final_logit_softcapping=3.0, **tiles))
    elif case == "kl":
        out = linear_kl(hidden, weight, ref_hidden, ref_weight, **tiles)
    elif case == "self_certainty":
        out = linear_self_certainty(hidden, weight, bias=bias, logit_scale=0.5, **tiles)
    elif case == "logprobs_fast":
        out = linear_logprobs(hidden, weight, targets, bias=bias, precision="fast", **tiles)
    else:
        raise ValueError(case)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    inputs = [t for t in (hidden, weight, bias) if t.grad_fn is None and t.requires_grad]
    grads = torch.autograd.grad((out * up).sum(), inputs, allow_unused=True)
    return out.detach(), [g for g in grads if g is not None]


def reference(case: str):
    hidden, weight, bias, targets, ref_hidden, ref_weight = make()
    raw = hidden @ weight.T + (bias if case != "kl" else 0)
    if case == "logprobs_entropy":
        z = 3.0 * torch.tanh(raw / 3.0) / 0.7
    elif case == "self_certainty":
        z = raw * 0.5
    else:
        z = raw
    logp = torch.log_softmax(z, -1)
    if case == "logprobs_entropy":
        valid = targets != IGNORE
        picked = logp.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1) * valid
        out = torch.stack([picked, -(logp.exp() * logp).sum(-1) * valid])  # ignored rows give 0 for every output
    elif case == "kl":
        logq = torch.log_softmax(ref_hidden @ ref_weight.T, -1)
        out = (logp.exp() * (logp - logq)).sum(-1)
    else:
        out = torch.logsumexp(z, -1) - z.mean(-1)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = [hidden, weight] + ([bias] if case != "kl" else [])
    return out.detach(), list(torch.autograd.grad((out * up).sum(), inputs))


@pytest.mark.parametrize("case", ["logprobs_entropy", "kl", "self_certainty"])
def test_compiled_tiles_match_eager_and_float64(case, monkeypatch):
    torch._dynamo.reset()  # compile afresh, whichever test compiled the tile functions before (the counters see it)
    counters.clear()
    fused_out, fused_grads = run(case, True, monkeypatch)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # compiled, in one piece each
    eager_out, eager_grads = run(case, False, monkeypatch)
    want_out, want_grads = reference(case)
    torch.testing.assert_close(fused_out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused_out, eager_out, rtol=1e-12, atol=1e-12)
    assert len(fused_grads) == len(want_grads) == len(eager_grads)
    for got, eager, want in zip(fused_grads, eager_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(got, eager, rtol=1e-11, atol=1e-12)


def test_compiled_fast_bf16_tiles_match_the_eager_fast_path(monkeypatch):
    fused_out, fused_grads = run("logprobs_fast", True, monkeypatch, dtype=torch.bfloat16)
    eager_out, eager_grads = run("logprobs_fast", False, monkeypatch, dtype=torch.bfloat16)
    torch.testing.assert_close(fused_out, eager_out, rtol=1e-5, atol=1e-5)
    for got, eager in zip(fused_grads, eager_grads):
        assert got.dtype == torch.bfloat16
        # bf16 operands of the backward products: at most a bf16 rounding apart
        torch.testing.assert_close(got.float(), eager.float(), rtol=1e-2, atol=1e-2)


def test_where_the_compiled_tiles_run(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("LIT_MEMOPT_FUSED_TILES", raising=False)
    assert use_fused_tiles(cuda, fake=False) and not use_fused_tiles(cpu, fake=False)
    assert not use_fused_tiles(cuda, fake=True)  # the peak-memory estimator traces the eager ops
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "0")
    assert not use_fused_tiles(cuda, fake=False)
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "1")
    assert use_fused_tiles(cpu, fake=False) and not use_fused_tiles(cpu, fake=True)
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "yes")
    with pytest.raises(ValueError, match="LIT_MEMOPT_FUSED_TILES must be one of"):
        use_fused_tiles(cuda, fake=False)


def test_a_compiler_failure_falls_back_to_the_eager_maths_with_one_warning(monkeypatch):
    import lit_memopt.ops._fused_tiles as fused_tiles

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no working C++ compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(fused_tiles, "fold_tile", fused_tiles.compiled_once(fused_tiles._fold_tile))
    monkeypatch.setattr(fused_tiles, "tile_logit_gradient", fused_tiles.compiled_once(fused_tiles._tile_logit_gradient))
    import lit_memopt.ops._head_passes as passes

    monkeypatch.setattr(passes, "fold_tile", fused_tiles.fold_tile)
    monkeypatch.setattr(passes, "tile_logit_gradient", fused_tiles.tile_logit_gradient)
    with pytest.warns(RuntimeWarning, match="compiling the fused head's tile kernels failed") as caught:
        out, grads = run("logprobs_entropy", True, monkeypatch)
    assert len(caught) == 2  # once per function, not once per tile
    want_out, want_grads = reference("logprobs_entropy")
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


def test_an_out_of_memory_error_inside_a_compiled_kernel_reaches_the_caller(monkeypatch):
    import lit_memopt.ops._fused_tiles as fused_tiles

    def oom_compile(fn, **kwargs):
        def run(*args, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run

    monkeypatch.setattr(torch, "compile", oom_compile)
    call = fused_tiles.compiled_once(fused_tiles._fold_tile)
    z = torch.zeros(2, 3)
    with pytest.raises(torch.OutOfMemoryError):
        call(z, None, z[:, 0], z[:, 0], None, None, None, None, 0, None, None, None)


def _add_k_times(x: torch.Tensor, k: int) -> torch.Tensor:
    for _ in range(k):  # the compiler unrolls the loop: one graph per k, as the whole pass's tiles
        x = x + 1
    return x


@pytest.mark.parametrize("graphs", [None, 4])
def test_compiled_once_may_keep_more_graphs_than_torchs_limit_during_its_calls(graphs):
    """Past dynamo's recompile limit a function runs eagerly without a word; ``graphs`` raises the limit for the
    function's own calls only (the whole pass needs a graph per tile size and set of outputs)."""
    from lit_memopt.ops._fused_tiles import compiled_once

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    # a fresh code object per case: the compiler keeps its graphs (and its verdict at the limit) on the code
    fresh = types.FunctionType(_add_k_times.__code__.replace(co_name=f"add_k_times_{graphs}"), globals())
    add = compiled_once(fresh, graphs=graphs)
    with config.patch(**{name: 2}):
        before = counters["stats"]["unique_graphs"]
        for k in range(1, 5):
            assert add(torch.zeros(3), k).tolist() == [float(k)] * 3
        assert counters["stats"]["unique_graphs"] - before == (4 if graphs else 2)
        assert getattr(config, name) == 2  # the user's limit is back
