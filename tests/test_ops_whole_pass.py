"""Each pass of the fused head as one compiled graph (ops/_whole_pass.py, the CUDA default; ``LIT_MEMOPT_WHOLE_PASS=1``)
gives the values and gradients of the tiled pass and of plain float64 references; compiled for the CPU here
(``LIT_MEMOPT_FUSED_TILES=1``), where torch.compile builds C++ kernels of the same graphs."""

from __future__ import annotations

import warnings

import pytest
import torch
import test_ops_fused_tiles as tiled_cases
import test_ops_linear_head as head_cases

from lit_memopt.ops import linear_logprobs, linear_logprobs_and_entropy, linear_kl, linear_self_certainty
from lit_memopt.ops._whole_pass import MAX_WEIGHT_TILE_ELEMENTS, MAX_WHOLE_PASS_TILES, whole_pass_vocab_tile

# One row tile (37 rows) and four vocabulary tiles of 32 (the last partial): the calls the whole pass takes.
TILES = dict(chunk_size=(64, 32))


@pytest.fixture(autouse=True)
def whole_pass_calls(monkeypatch) -> dict[str, int]:
    """How often each whole-pass graph ran, so that no test compares the tiled pass with itself."""
    import lit_memopt.ops._head_passes as passes

    calls = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(passes, "whole_forward", counted("forward", passes.whole_forward))
    monkeypatch.setattr(passes, "whole_backward", counted("backward", passes.whole_backward))
    return calls


def run_all(whole: bool, monkeypatch, dtype=torch.float64, precision="auto"):
    """Every output of the head in one call per op, and the gradients of a random projection of all of them."""
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "1")
    monkeypatch.setenv("LIT_MEMOPT_WHOLE_PASS", "1" if whole else "0")
    hidden, weight, bias, targets, ref_hidden, ref_weight = tiled_cases.make(dtype)
    outs = [
        *linear_logprobs_and_entropy(hidden, weight, targets, bias=bias, temperature=0.7, final_logit_softcapping=3.0,
                                     precision=precision, **TILES),
        linear_self_certainty(hidden, weight, bias=bias, logit_scale=0.5, precision=precision, **TILES),
        linear_kl(hidden, weight, ref_hidden, ref_weight, precision=precision, **TILES),
    ]
    out = torch.stack([o.float() if dtype != torch.float64 else o for o in outs])
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * up).sum(), (hidden, weight, bias))
    return out.detach(), grads


def test_the_whole_pass_matches_the_tiled_pass_in_float64(monkeypatch, whole_pass_calls):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compiler failure would fall back to eager maths with a warning
        out, grads = run_all(True, monkeypatch)
    assert whole_pass_calls == {"forward": 3, "backward": 3}  # three calls, each one graph per pass
    want_out, want_grads = run_all(False, monkeypatch)
    assert whole_pass_calls == {"forward": 3, "backward": 3}
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("case", ["logprobs_entropy", "kl", "self_certainty"])
def test_the_whole_pass_matches_float64_references(case, monkeypatch, whole_pass_calls):
    monkeypatch.setenv("LIT_MEMOPT_WHOLE_PASS", "1")
    monkeypatch.setattr(tiled_cases, "run", _one_row_tile(tiled_cases.run))
    out, grads = tiled_cases.run(case, True, monkeypatch)
    assert whole_pass_calls == {"forward": 1, "backward": 1}
    want_out, want_grads = tiled_cases.reference(case)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-11)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def _one_row_tile(run):
    """``run`` with every tile request widened to one row tile (the whole pass's calls)."""
    def wrapped(case, fused, monkeypatch, dtype=torch.float64):
        import lit_memopt.ops.linear_head as head

        plan = head.tile_sizes

        def one_row_tile(chunk_size, rows, *args, **kwargs):
            return plan((max(rows, 1), 32), rows, *args, **kwargs)

        monkeypatch.setattr(head, "tile_sizes", one_row_tile)
        return run(case, fused, monkeypatch, dtype)
    return wrapped


def test_bf16_fast_whole_pass_matches_the_tiled_fast_pass(monkeypatch, whole_pass_calls):
    # The same products and roundings as the tiled pass: bf16 logits on the CPU, fp32 statistics.
    out, grads = run_all(True, monkeypatch, torch.bfloat16, "fast")
    assert whole_pass_calls["backward"] == 3
    want_out, want_grads = run_all(False, monkeypatch, torch.bfloat16, "fast")
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_masked_rows_in_a_whole_pass(monkeypatch, whole_pass_calls):
    # Ignored rows never reach the graph: their outputs and gradients are exact zeros, the rest as the tiled pass.
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "1")
    hidden, weight, _, targets, _, _ = tiled_cases.make()
    targets = targets.clone()
    targets[::2] = -100
    results = []
    for whole in ("1", "0"):
        monkeypatch.setenv("LIT_MEMOPT_WHOLE_PASS", whole)
        logp = linear_logprobs(hidden, weight, targets, **TILES)
        results.append((logp.detach(), *torch.autograd.grad(logp.sum(), (hidden, weight))))
    assert whole_pass_calls == {"forward": 1, "backward": 1}
    (logp, g_h, g_w), (want_logp, want_g_h, want_g_w) = results
    assert torch.all(logp[::2] == 0) and torch.all(g_h[::2] == 0)
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_h, want_g_h, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(g_w, want_g_w, rtol=1e-11, atol=1e-12)


def test_which_calls_take_the_whole_pass(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def tile(fused=True, device=cuda, rows=100, row_tile=128, hidden=64, vocab=1000, vocab_tile=300, explicit=False):
        return whole_pass_vocab_tile(fused, device, rows, row_tile, hidden, vocab, vocab_tile, explicit=explicit)

    monkeypatch.delenv("LIT_MEMOPT_WHOLE_PASS", raising=False)  # "auto": on CUDA only
    assert tile() == 256 and tile(device=cpu) is None
    monkeypatch.setenv("LIT_MEMOPT_WHOLE_PASS", "1")
    # automatic tiles round down to a power of two (few compiled graphs across changing row counts); explicit ones stay
    assert tile(device=cpu) == 256
    assert tile(explicit=True) == 300
    assert tile(vocab_tile=5000) == 1000  # one tile covers the vocabulary
    # a weight-gradient tile [tile, H] may be a temporary (an fp32 head multiplied in bf16): at most MAX_WEIGHT_TILE_ELEMENTS
    wide = MAX_WEIGHT_TILE_ELEMENTS // 1024
    assert tile(hidden=1024, vocab=4 * wide, vocab_tile=8 * wide) == wide
    assert tile(hidden=1024, vocab=wide + 1, vocab_tile=2 * wide) == wide  # not one tile: capped, two tiles
    assert tile(hidden=1024, vocab=64 * wide, vocab_tile=wide) is None  # too many tiles once capped
    assert tile(hidden=1024, vocab=4 * wide, vocab_tile=2 * wide, explicit=True) is None
    assert tile(fused=False) is None  # eager tile maths
    assert tile(rows=200) is None  # several row tiles
    assert tile(rows=0) is None  # no rows
    assert tile(vocab=64 * (MAX_WHOLE_PASS_TILES + 1), vocab_tile=64, explicit=True) is None  # too many tiles to unroll
    monkeypatch.setenv("LIT_MEMOPT_WHOLE_PASS", "0")
    assert tile() is None
    monkeypatch.setenv("LIT_MEMOPT_WHOLE_PASS", "yes")
    with pytest.raises(ValueError, match="LIT_MEMOPT_WHOLE_PASS must be one of"):
        tile()


@pytest.mark.parametrize("rows, hidden_size, what", [(256, 64, "logits tiles"), (16, 1024, "weight-gradient tiles")])
def test_the_whole_pass_keeps_the_tiled_memory(rows, hidden_size, what, monkeypatch, whole_pass_calls):
    """The compiled graph keeps about the tiled pass's extra memory, a few tiles whatever the vocabulary: 13
    vocabulary tiles of 4096, whose logits tiles (4 MiB each) or weight-gradient tiles (16 MiB each, few rows and
    a wide hidden size) must not all be alive at once. On an H100 the compiler ran every tile's matmul first
    (1.03 GiB at N=4096, H=1024, V=50000), until each tile waited for the last (``_whole_pass._after``); and the
    weight-gradient tiles of a 512-row call lived until the end (0.39 GiB against 0.13 GiB tile by tile), or, copied
    into the gradient one by one, left two weight-sized buffers (0.85 GiB), until an operator wrote them in place."""
    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "1")
    v, vocab_tile = 50000, 4096
    hidden, weight, targets = head_cases.random_head(rows, hidden_size, v)

    def step():
        linear_logprobs(hidden, weight, targets, chunk_size=(rows, vocab_tile)).sum().backward()

    extra = {}
    for whole in ("1", "0"):
        monkeypatch.setenv("LIT_MEMOPT_WHOLE_PASS", whole)
        step()  # compiles outside the measurement
        extra[whole] = head_cases.step_extra_bytes(step, hidden, weight, targets)
    logits_tile, weight_tile = rows * vocab_tile * 4, hidden_size * vocab_tile * 4
    assert whole_pass_calls == {"forward": 2, "backward": 2}
    # each weight-gradient tile is written straight into the gradient (``write_weight_gradient_rows``), as tile by tile
    assert extra["1"] <= 1.25 * extra["0"], (what, extra, weight_tile)
    assert extra["1"] <= 8 * max(logits_tile, weight_tile), (what, extra, logits_tile, weight_tile)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad_dtype, operand_dtype", [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)],
                         ids=["same-dtype", "bf16-into-fp32"])
def test_the_weight_gradient_operator_writes_only_its_rows(compiled, grad_dtype, operand_dtype):
    """``write_weight_gradient_rows`` (a plain operator-library op, cheaper per call than ``custom_op``) writes
    ``operand.T @ h`` into rows ``[start, start + tile)`` of the gradient, in place, and nothing else: eagerly (the
    fallback when compiling fails) and inside a compiled graph, where the gradient is a mutated input."""
    from lit_memopt.ops._whole_pass import write_weight_gradient_rows

    gen = torch.Generator().manual_seed(0)
    rows, hidden, vocab, start, tile = 5, 6, 20, 8, 7
    operand = torch.randn(rows, tile, generator=gen).to(operand_dtype)
    h = torch.randn(rows, hidden, generator=gen).to(operand_dtype)
    before = torch.randn(vocab, hidden, generator=gen).to(grad_dtype)

    def write(grad_w, operand, h):
        write_weight_gradient_rows(grad_w, start, operand, h, False)
        return grad_w.sum()  # a graph output, so the compiler cannot drop the write

    grad_w = before.clone()
    storage = grad_w.data_ptr()
    (torch.compile(write, dynamic=True) if compiled else write)(grad_w, operand, h)
    expected = before.clone()
    expected[start:start + tile] = (operand.double().t() @ h.double()).to(grad_dtype)
    assert grad_w.data_ptr() == storage
    if grad_dtype == torch.float64:
        torch.testing.assert_close(grad_w, expected, rtol=0, atol=0)
    else:  # a bf16 product (rounded to bf16 on a CPU) into an fp32 gradient: bf16 rounding, not a misplaced row
        scale = expected[start:start + tile].abs().max().item()
        torch.testing.assert_close(grad_w, expected, rtol=2**-7, atol=2**-7 * scale)
    assert torch.equal(torch.cat([grad_w[:start], grad_w[start + tile:]]), torch.cat([before[:start], before[start + tile:]]))
