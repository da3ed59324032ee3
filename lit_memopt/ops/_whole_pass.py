"""The fused head's two passes, each as one compiled graph over all its vocabulary tiles (the CUDA default for
calls with one row tile; ``LIT_MEMOPT_WHOLE_PASS``, see ``_settings.py``).

A tiled pass on a GPU costs host work per tile: slicing, a matmul launch or three, and a call into the
compiled tile kernels (``_fused_tiles.py``). For the calls RL steps make (a few hundred to a few thousand
rows) that host work, not the GPU, sets the time. Here each pass is one function with the vocabulary loop
written out, compiled once (``torch.compile`` unrolls the loop: cuBLAS products and a few fused kernels
per tile, launched by one call), so the host work per call is two compiled calls.

Keeping the tiled pass's memory took two things the loop does not say by itself (both measured on an H100):

* The tiles must run in order. Every tile's matmul reads only the inputs, and the compiler ran all of them
  first, holding every logits tile at once: 1.03 GiB at N=4096, H=1024, V=50000 (13 tiles), against
  0.14 GiB tile by tile. Each tile's hidden operand now depends on the previous tile's results
  (:func:`_after`): 0.12 GiB.
* Each weight-gradient tile is written into the gradient's rows by an operator the compiler does not look into
  (:func:`write_weight_gradient_rows`). Collected and concatenated at the end, all the tiles were alive at once:
  0.40 GiB at N=512, H=1536, V=151936 bf16, against 0.13 GiB tile by tile. Copied into the gradient by slice
  assignment, they left two weight-sized buffers on that H100 (torch 2.11): 0.85 GiB. With the operator: 0.10 GiB.

bf16 log-probs fwd+bwd, tile by tile against one graph per pass, in one interleaved probe on that H100 (before
the operator): 6.54 -> 4.92 ms at N=4096, H=1024, V=50000; 3.92 -> 2.88 ms at N=2048, H=512, V=32000. At N=512,
H=1536, V=151936 the two take about the same time (5.43 against 5.50 ms in ``rl_shapes_cuda``; README, "On a GPU").

The maths per tile are the pure functions of ``_fused_tiles.py`` (the same as the eager tiles'), on the
tiles of the tiled pass. The tiled passes (``_head_passes.py``) keep every call this one does not take:
several row tiles, more than :data:`MAX_WHOLE_PASS_TILES` vocabulary tiles (a long unrolled graph
compiles slowly), fake tensors (the estimator), and tile maths that are not compiled.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from lit_memopt.ops._fused_tiles import _fold_tile, _tile_logit_gradient, compiled_once, finish_rows, start_rows, transform_logits
from lit_memopt.ops._settings import head_settings

# More vocabulary tiles than this and a pass runs tile by tile: each unrolled tile adds to the compile
# time (seconds for ten tiles on an H100), and calls with that many tiles are long enough to hide their
# host work behind the GPU's.
MAX_WHOLE_PASS_TILES = 16
# Where the weight's dtype differs from the operands' (an fp32 head multiplied in bf16), a weight-gradient tile
# ``[vocab tile, H]`` is a temporary before it is rounded into the gradient; a tile may have at most this many
# elements (256 MiB in fp32). Without the cap a call with few rows and a wide head would take one vocabulary tile
# and a temporary the size of the weight. Qwen2.5-1.5B's head at 512 rows (tiles of 32768 x 1536, 48M elements)
# stays under it.
MAX_WEIGHT_TILE_ELEMENTS = 1 << 26


def whole_pass_vocab_tile(fused: bool, device: torch.device, rows: int, row_tile: int, hidden_size: int, vocab: int,
                          vocab_tile: int, *, explicit: bool) -> Optional[int]:
    """The vocabulary tile of a whole-pass call, or ``None`` where the call runs tile by tile.

    Automatic tiles are rounded down to a power of two: the compiled graph depends on the tile, and the
    tile on the row count, so a few sizes serve an RL run's changing row counts without a compile each.
    Automatic tiles also shrink until a weight-gradient tile fits :data:`MAX_WEIGHT_TILE_ELEMENTS`; an
    explicit tile that does not fit runs tile by tile.
    """
    if not head_settings().whole_pass_allowed(device) or not fused or rows > row_tile or rows == 0:
        return None
    widest_tile = max(MAX_WEIGHT_TILE_ELEMENTS // max(hidden_size, 1), 1)
    if explicit:
        tile = vocab_tile if vocab_tile <= widest_tile else None
    else:
        tile = min(vocab_tile, vocab)
        tile = tile if tile == vocab and tile <= widest_tile else 1 << int(math.log2(min(tile, widest_tile)))
    return tile if tile is not None and math.ceil(vocab / tile) <= MAX_WHOLE_PASS_TILES else None


def _product(a: Tensor, b: Tensor, stat_dtype: torch.dtype, fp32_out: bool) -> Tensor:
    """``a @ b`` in the statistics dtype: fp32 operands multiply as they are; bf16/fp16 ones accumulate into fp32
    on CUDA (``out_dtype``) or come out in their own dtype first elsewhere (as the tiled pass's ``TileMath``)."""
    if a.dtype == stat_dtype:
        return a @ b
    if fp32_out:
        return torch.mm(a, b, out_dtype=stat_dtype)
    return (a @ b).to(stat_dtype)


def _after(x: Tensor, *results: Optional[Tensor]) -> Tensor:
    """``x``, but computable only once ``results`` exist: a data dependency the compiler must respect.

    The vocabulary loop is unrolled into one graph whose matmuls all read only the inputs, and the GPU
    compiler ran every tile's matmul first, keeping all logits tiles alive at once (at N=4096, H=1024,
    V=50000 on an H100: 1.03 GiB where the tiled pass keeps 0.14 GiB). Making each tile's hidden operand
    depend on the previous tile's results orders the tiles as the loop does: a tile's buffers die before
    the next one's exist. The dependency adds NaN where the first element of a result is NaN (its
    statistics are NaN then anyway) and 0 elsewhere. ``0 * token`` would not do: the compiler folds it
    to 0 and drops the dependency (seen in its generated code). It costs one elementwise copy of ``x``
    per tile.
    """
    token = sum(r.reshape(-1)[:1].float() for r in results if r is not None)
    return x + torch.where(torch.isnan(token), token, 0.0).to(x.dtype)


def _logits(h: Tensor, w: Tensor, bias: Optional[Tensor], stat_dtype: torch.dtype, fp32_out: bool,
            softcap: Optional[float], logit_scale: float, inv_temperature: float) -> Tensor:
    """The transformed logits tile (``TileMath.logits`` as one expression of the graph)."""
    raw = _product(h, w.t(), stat_dtype, fp32_out)
    if bias is not None:
        raw = raw + bias
    return transform_logits(raw, softcap, logit_scale, inv_temperature)


def _forward(h: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Optional[Tensor], ref_h: Optional[Tensor],
             ref_weight: Optional[Tensor], ref_bias: Optional[Tensor], vocab_tile: int, matmul_dtype: torch.dtype,
             stat_dtype: torch.dtype, fp32_out: bool, softcap: Optional[float], logit_scale: float, inv_temperature: float,
             want_entropy: bool, want_self_certainty: bool):
    """The per-row statistics of ``_head_passes._forward_statistics`` (``finish_rows``): ``target_z`` with
    ``targets``, the reference's with ``ref_h``."""
    vocab, kl = weight.shape[0], ref_h is not None
    state = start_rows(h.shape[0], stat_dtype, h.device, entropy=want_entropy, self_certainty=want_self_certainty,
                       logprobs=targets is not None, kl=kl)
    h = h.to(matmul_dtype)
    ref_h = ref_h.to(matmul_dtype) if kl else None
    for v0 in range(0, vocab, vocab_tile):
        v1 = min(v0 + vocab_tile, vocab)
        at = lambda b: None if b is None else b[v0:v1]  # noqa: E731
        h_tile = h if v0 == 0 else _after(h, *state)
        z = _logits(h_tile, weight[v0:v1].to(matmul_dtype), at(bias), stat_dtype, fp32_out, softcap, logit_scale, inv_temperature)
        ref_z = None
        if kl:
            ref_z = _logits(ref_h if v0 == 0 else _after(ref_h, *state), ref_weight[v0:v1].to(matmul_dtype), at(ref_bias),
                            stat_dtype, fp32_out, softcap, logit_scale, inv_temperature)
        run_max, run_sum, sum_ez, sum_z, target_z, ref_max, ref_sum, sum_ed = state
        state = _fold_tile(z, ref_z, run_max, run_sum, sum_ez, sum_z, target_z, targets, v0, ref_max, ref_sum, sum_ed)
    return finish_rows(*state, vocab)


# The operator below is defined on a plain operator library, not with ``torch.library.custom_op``: the compiled graph
# calls it once per vocabulary tile, and custom_op's Python autograd and version-counter wrappers cost about 35 us a
# call on the host against about 7 us for this registration (measured on the CPU, bf16 64 x 1024 tiles). These calls
# are host-bound on a GPU: on an H100, bf16 log-probs fwd+bwd went from 8.8-8.9 to 7.9-8.1 ms at N=4096, H=1024,
# V=50000 (13 tiles) and from 4.9 to 3.9-4.5 ms at N=512, H=1536, V=151936, with the same memory (stop 36, README).
# Nothing here needs autograd: the backward runs without a graph, on gradient buffers it made itself.
_LIBRARY = torch.library.Library("lit_memopt", "FRAGMENT")
_LIBRARY.define("write_weight_gradient_rows(Tensor(a!) grad_w, SymInt start, Tensor operand, Tensor h, bool fp32_out) -> ()")


def _write_weight_gradient_rows(grad_w: Tensor, start: int, operand: Tensor, h: Tensor, fp32_out: bool) -> None:
    """``grad_w[start:start + len(operand.T)] = operand.T @ h``, the product written straight into those rows.

    One operator the compiler cannot see into, on purpose. Written as a slice assignment in the compiled graph,
    each tile's product was a temporary copied into the rows, and on an H100 (torch 2.11) the compiler kept the
    gradient's old and new values apart, two weight-sized buffers: 0.85 GiB of extra memory at N=512, H=1536,
    V=151936 bf16, where the tiled pass takes 0.13 GiB. Collected and concatenated at the end instead, all the
    tiles were alive at once (0.40 GiB). An operator that declares the rows it writes is applied to the
    gradient in place, and its product needs no temporary where the operands have the gradient's dtype.
    """
    rows = grad_w[start:start + operand.shape[1]]
    if operand.dtype == grad_w.dtype and h.dtype == grad_w.dtype:
        torch.mm(operand.t(), h, out=rows)  # one rounding of the fp32 accumulation, into the weight's dtype
    else:
        rows.copy_(_product(operand.t(), h, torch.promote_types(grad_w.dtype, torch.float32), fp32_out))


_LIBRARY.impl("write_weight_gradient_rows", _write_weight_gradient_rows, "CompositeExplicitAutograd")


@torch.library.register_fake("lit_memopt::write_weight_gradient_rows", lib=_LIBRARY)
def _(grad_w: Tensor, start: int, operand: Tensor, h: Tensor, fp32_out: bool) -> None:
    return None


write_weight_gradient_rows = torch.ops.lit_memopt.write_weight_gradient_rows.default


def _backward(h: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Optional[Tensor], ref_h: Optional[Tensor],
              ref_weight: Optional[Tensor], ref_bias: Optional[Tensor], lse: Tensor, mu: Optional[Tensor],
              mu_d: Optional[Tensor], alpha: Tensor, g_lp: Optional[Tensor], g_ent: Optional[Tensor], g_kl: Optional[Tensor],
              uniform: Optional[Tensor], vocab_tile: int, matmul_dtype: torch.dtype, stat_dtype: torch.dtype,
              fp32_out: bool, softcap: Optional[float], logit_scale: float, inv_temperature: float,
              need_h: bool, grad_w: Optional[Tensor], need_b: bool):
    """``(grad_h, grad_b)`` of ``_head_passes._backward_tiles`` for one row tile, and the weight gradient written
    into ``grad_w`` (``[V, H]`` in the weight's dtype, or ``None`` when not needed): the hidden gradient
    accumulated in the statistics dtype and returned in ``h``'s, each weight-gradient tile one product written
    into its rows by :func:`write_weight_gradient_rows`, the bias gradient in the statistics dtype."""
    vocab = weight.shape[0]
    h_op = h.to(matmul_dtype)
    ref_h = ref_h.to(matmul_dtype) if g_kl is not None else None
    grad_h = torch.zeros(h.shape, dtype=stat_dtype, device=h.device) if need_h else None
    bias_tiles = []
    previous: tuple = ()  # the last tile's results, which the next tile's products wait for (_after)
    for v0 in range(0, vocab, vocab_tile):
        v1 = min(v0 + vocab_tile, vocab)
        at = lambda b: None if b is None else b[v0:v1]  # noqa: E731
        w = weight[v0:v1].to(matmul_dtype)
        z = _logits(_after(h_op, *previous) if previous else h_op, w, at(bias), stat_dtype, fp32_out, softcap,
                    logit_scale, inv_temperature)
        ref_z = None
        if ref_h is not None:
            ref_z = _logits(_after(ref_h, *previous) if previous else ref_h, ref_weight[v0:v1].to(matmul_dtype),
                            at(ref_bias), stat_dtype, fp32_out, softcap, logit_scale, inv_temperature)
        operand, column_sums = _tile_logit_gradient(
            z, ref_z, lse, mu, mu_d, alpha, g_ent, g_kl, uniform, g_lp, targets, v0, softcap,
            logit_scale * inv_temperature, inv_temperature, matmul_dtype, need_b)
        if need_h:
            grad_h = grad_h + _product(operand, w, stat_dtype, fp32_out)
        weight_tile = None
        if grad_w is not None:
            write_weight_gradient_rows(grad_w, v0, operand, h_op, fp32_out)
            weight_tile = grad_w[v0:v1]  # the next tile waits for this tile's product
        if need_b:
            bias_tiles.append(column_sums)
        previous = (grad_h, weight_tile, column_sums, operand)
    grad_b = torch.cat(bias_tiles) if need_b else None
    return (grad_h.to(h.dtype) if need_h else None), grad_b


# A graph per vocabulary tile size (a power of two, from the row count) and set of outputs: an RL run that calls
# log-probs alone and with entropy at four tile sizes already needs 8, torch's default limit.
WHOLE_PASS_GRAPHS = 32
whole_forward = compiled_once(_forward, graphs=WHOLE_PASS_GRAPHS)
whole_backward = compiled_once(_backward, graphs=WHOLE_PASS_GRAPHS)
