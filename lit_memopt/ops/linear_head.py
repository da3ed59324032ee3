"""LM-head quantities (log-probs, entropy, self-certainty, KL, logsumexp) computed from hidden states
and the head weight tile by tile, so that no ``[tokens, vocab]`` logits tensor ever exists.

Softmax statistics are always kept in fp32 (float64 for float64 inputs). The tile matmuls follow
the ``precision`` argument (see :func:`lit_memopt.ops._head_tiles.resolve_precision`): ``"exact"``
multiplies fp32 copies of each tile; ``"fast"`` (the default for bf16/fp16 heads) multiplies in the
inputs' dtype. Rows that count for nothing (``ignore_index`` targets, ``mask`` False) are dropped
before the first matmul, so prompt and padding tokens cost neither time nor memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lit_memopt.ops._fused_tiles import fold_tile, tile_logit_gradient, use_fused_tiles
from lit_memopt.ops._head_tiles import MAX_TILE_ELEMENTS as _MAX_TILE_ELEMENTS  # noqa: F401 (tests read the policy)
from lit_memopt.ops._head_tiles import (
    ChunkSize,
    LogitTransform,
    TileMath,
    check_bias,
    check_mask,
    check_positive,
    check_same_device,
    check_targets,
    check_weight_pair,
    exp_,
    is_fake,
    tile_starts,
    resolve_precision,
    tile_sizes,
)
from lit_memopt.ops.sharded import gather_if_sharded

__all__ = [
    "linear_logprobs",
    "linear_entropy",
    "linear_logprobs_and_entropy",
    "linear_self_certainty",
    "linear_kl",
]

# Backward walks the rows in super-blocks of this many row tiles, so its fp32 hidden-gradient
# accumulator is [super-block, H] (a few tile budgets) instead of [N, H]. More row tiles per block
# mean fewer re-casts of the weight tiles and fewer low-precision additions into a bf16/fp16 weight
# gradient; fewer mean a smaller accumulator.
_SUPER_BLOCK_ROW_TILES = 4
_tile_sizes = tile_sizes  # the tiling policy under the name tests read

# Per-row outputs, in the order the Function returns them.
OUTPUTS = ("logprobs", "entropy", "self_certainty", "kl", "logsumexp")


@dataclass(frozen=True)
class _HeadSpec:
    """What one fused pass computes and how it tiles (non-tensor arguments of the autograd Function)."""

    outputs: frozenset
    transform: LogitTransform
    row_tile: int
    vocab_tile: int
    fast: bool
    fused: bool = False  # tile maths as compiled kernels (ops/_fused_tiles.py), decided once for forward and backward

    def wants(self, name: str) -> bool:
        return name in self.outputs


class _NoAutocast:
    """Disable autocast on ``device_type`` so the tiles are computed in the dtype the plan chose."""

    def __init__(self, device_type: str) -> None:
        self._ctx = torch.autocast(device_type=device_type, enabled=False) if device_type in ("cpu", "cuda", "xpu", "mps", "hpu") else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _tile_math(spec: _HeadSpec, rows: int, hidden: Tensor, *others: Optional[Tensor]) -> TileMath:
    stat_dtype = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in (hidden, *others)) else torch.float32
    matmul_dtype = hidden.dtype if spec.fast else stat_dtype
    return TileMath(stat_dtype, matmul_dtype, hidden.device, spec.transform, spec.row_tile, spec.vocab_tile,
                    rows, others[0].shape[0], fused=spec.fused)


def _pass_rows(hidden: Tensor, keep: Optional[Tensor]) -> int:
    """How many rows the pass computes: all of ``hidden``'s, or only the ``keep`` ones."""
    return hidden.shape[0] if keep is None else keep.shape[0]


def _row_tile(math_: TileMath, name: str, hidden: Tensor, keep: Optional[Tensor], r0: int, r1: int) -> Tensor:
    """Rows ``r0:r1`` of the pass as a matmul operand: a slice of ``hidden``, or, when only the rows
    ``keep`` count, those rows gathered into a tile buffer (never a compacted copy of all of them)."""
    if keep is None:
        return math_.operand(name, hidden[r0:r1], math_.row_tile)
    gathered = math_.ws.get(name + "_rows", r1 - r0, hidden.shape[1], math_.row_tile * hidden.shape[1], hidden.dtype)
    torch.index_select(hidden, 0, keep[r0:r1], out=gathered)
    return math_.operand(name, gathered, math_.row_tile)


def _target_in_tile(targets: Tensor, v0: int, cols: int) -> tuple[Tensor, Tensor]:
    """Column of each row's target inside the vocabulary tile starting at ``v0`` (clamped), and whether it is there."""
    local = targets - v0
    return local.clamp(0, cols - 1).unsqueeze(1), (local >= 0) & (local < cols)


class _RunningSoftmax:
    """Online softmax statistics of one row tile, updated one vocabulary tile at a time."""

    def __init__(self, spec: _HeadSpec, rows: int, dtype: torch.dtype, device: torch.device, fused: bool = False) -> None:
        new = lambda fill: torch.full((rows,), fill, dtype=dtype, device=device)  # noqa: E731
        self.spec, self.fused = spec, fused
        self.max, self.sum = new(-math.inf), new(0.0)
        self.sum_ez = new(0.0) if spec.wants("entropy") else None  # sum_v e_v z_v (entropy)
        self.sum_z = new(0.0) if spec.wants("self_certainty") else None
        self.target_z = new(0.0) if spec.wants("logprobs") else None
        self.ref_max = new(-math.inf) if spec.wants("kl") else None
        self.ref_sum = new(0.0) if spec.wants("kl") else None
        self.sum_ed = new(0.0) if spec.wants("kl") else None  # sum_v e_v (z_v - zref_v) (KL)

    def update(self, z: Tensor, scratch: Tensor, v0: int, targets: Optional[Tensor], ref_z: Optional[Tensor]) -> None:
        """Fold the logits tile ``z`` (and the reference tile ``ref_z``) in; ``scratch`` is a tile buffer."""
        if self.fused:  # the same maths in one compiled kernel (ops/_fused_tiles.py)
            (self.max, self.sum, self.sum_ez, self.sum_z, self.target_z, self.ref_max, self.ref_sum, self.sum_ed) = fold_tile(
                z, ref_z, self.max, self.sum, self.sum_ez, self.sum_z, self.target_z,
                targets if self.target_z is not None else None, v0, self.ref_max, self.ref_sum, self.sum_ed)
            return
        if self.target_z is not None:
            column, inside = _target_in_tile(targets, v0, z.shape[1])
            self.target_z = torch.where(inside, z.gather(1, column).squeeze(1), self.target_z)
        if self.sum_z is not None:
            self.sum_z += z.sum(1)
        new_max = torch.maximum(self.max, z.amax(1))
        rescale = torch.exp(self.max - new_max)
        if ref_z is not None:
            new_ref_max = torch.maximum(self.ref_max, ref_z.amax(1))
            ref_e = exp_(torch.sub(ref_z, new_ref_max.unsqueeze(1), out=scratch))
            self.ref_sum = self.ref_sum * torch.exp(self.ref_max - new_ref_max) + ref_e.sum(1)
            self.ref_max = new_ref_max
        e = exp_(torch.sub(z, new_max.unsqueeze(1), out=scratch))
        self.sum = self.sum * rescale + e.sum(1)
        self.max = new_max
        if ref_z is not None:
            d = ref_z.neg_().add_(z)  # z - z_ref, in place of the reference tile
            self.sum_ed = self.sum_ed * rescale + d.mul_(e).sum(1)
        if self.sum_ez is not None:
            self.sum_ez = self.sum_ez * rescale + e.mul_(z).sum(1)


def _forward_statistics(spec: _HeadSpec, math_: TileMath, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                        targets: Optional[Tensor], ref_hidden: Optional[Tensor], ref_weight: Optional[Tensor],
                        ref_bias: Optional[Tensor], keep: Optional[Tensor]) -> dict[str, Tensor]:
    """Per-row ``lse`` plus what the requested outputs need: ``target_z``, ``mu`` (= E_p[z]),
    ``mean_z``, ``ref_lse`` and ``mu_d`` (= E_p[z - z_ref]), for the rows ``keep`` (all when ``None``)."""
    n, vocab = _pass_rows(hidden, keep), weight.shape[0]
    rt, vt = spec.row_tile, spec.vocab_tile
    stats: dict[str, Tensor] = {k: hidden.new_zeros(n, dtype=math_.stat_dtype) for k in ("lse", "target_z", "mu", "mean_z", "ref_lse", "mu_d")}
    values = not is_fake(hidden)
    for r0 in tile_starts(0, n, rt, values=values):
        r1 = min(r0 + rt, n)
        h = _row_tile(math_, "h", hidden, keep, r0, r1)
        ref_h = _row_tile(math_, "ref_h", ref_hidden, keep, r0, r1) if ref_weight is not None else None
        run = _RunningSoftmax(spec, r1 - r0, math_.stat_dtype, hidden.device, math_.fused)
        for v0 in tile_starts(0, vocab, vt, values=values):
            v1 = min(v0 + vt, vocab)
            z = math_.logits("z", h, math_.operand("w", weight[v0:v1], vt), bias, v0, v1)
            ref_z = None
            if ref_h is not None:
                ref_z = math_.logits("ref_z", ref_h, math_.operand("ref_w", ref_weight[v0:v1], vt), ref_bias, v0, v1)
            run.update(z, math_.stat_buffer("e", r1 - r0, v1 - v0), v0, None if targets is None else targets[r0:r1], ref_z)
        stats["lse"][r0:r1] = run.max + torch.log(run.sum)
        if run.target_z is not None:
            stats["target_z"][r0:r1] = run.target_z
        if run.sum_ez is not None:
            stats["mu"][r0:r1] = run.sum_ez / run.sum
        if run.sum_z is not None:
            stats["mean_z"][r0:r1] = run.sum_z / vocab
        if run.sum_ed is not None:
            stats["ref_lse"][r0:r1] = run.ref_max + torch.log(run.ref_sum)
            stats["mu_d"][r0:r1] = run.sum_ed / run.sum
    return stats


@dataclass
class _RowGradients:
    """Upstream gradients folded into per-row coefficients of ``d out / d z``:
    ``p * (alpha + g_ent (mu - z) + g_kl (z - z_ref - mu_d)) - g_sc / V + g_lp onehot(target)``."""

    alpha: Tensor
    g_lp: Optional[Tensor]
    g_ent: Optional[Tensor]
    g_kl: Optional[Tensor]
    uniform: Optional[Tensor]

    @staticmethod
    def from_upstream(spec: _HeadSpec, grads: tuple, n: int, vocab: int, dtype: torch.dtype, device: torch.device) -> "_RowGradients":
        pending = iter(grads)
        g = {name: next(pending) for name in OUTPUTS if spec.wants(name)}
        g = {k: None if v is None else v.reshape(-1).to(dtype) for k, v in g.items()}
        alpha = torch.zeros(n, dtype=dtype, device=device)
        # d logprob / dz = onehot - p; d self_certainty / dz = p - 1/V; d logsumexp / dz = p
        for name, sign in (("logprobs", -1.0), ("self_certainty", 1.0), ("logsumexp", 1.0)):
            if g.get(name) is not None:
                alpha.add_(g[name], alpha=sign)
        g_sc = g.get("self_certainty")
        return _RowGradients(alpha, g.get("logprobs"), g.get("entropy"), g.get("kl"), None if g_sc is None else g_sc / vocab)


def _logit_gradient_(spec: _HeadSpec, math_: TileMath, z: Tensor, ref_z: Optional[Tensor], rows: slice, v0: int,
                     lse: Tensor, mu: Tensor, mu_d: Tensor, coeffs: _RowGradients, targets: Optional[Tensor]) -> Tensor:
    """``d out / d raw`` for one tile (raw = hidden @ W.T + b), built in tile buffers; ``z`` is consumed."""
    n_rows, cols = z.shape
    col = lambda t: t[rows].unsqueeze(1)  # noqa: E731
    # The softcap's slope needs the untouched z; any other user of z below may overwrite it.
    slope_src = z
    if spec.transform.softcap is not None and coeffs.g_ent is not None:
        slope_src = math_.stat_buffer("z_copy", n_rows, cols).copy_(z)
    keep_z = coeffs.g_ent is not None or ref_z is not None or spec.transform.softcap is not None
    p = exp_(torch.sub(z, col(lse), out=math_.stat_buffer("p", n_rows, cols)) if keep_z else z.sub_(col(lse)))
    extra = None
    if ref_z is not None:
        extra = ref_z.neg_().add_(z).sub_(col(mu_d)).mul_(col(coeffs.g_kl))
    if coeffs.g_ent is not None:
        z.sub_(col(mu)).mul_(-col(coeffs.g_ent))  # g_ent (mu - z), in z's storage
        extra = z if extra is None else extra.add_(z)
    p.mul_(col(coeffs.alpha) if extra is None else extra.add_(col(coeffs.alpha)))
    if coeffs.uniform is not None:
        p.sub_(col(coeffs.uniform))
    if coeffs.g_lp is not None:
        column, inside = _target_in_tile(targets[rows], v0, cols)
        p.scatter_add_(1, column, (coeffs.g_lp[rows] * inside.to(p.dtype)).unsqueeze(1))
    return spec.transform.chain_(p, slope_src, math_.stat_buffer("slope", n_rows, cols))


def _fused_logit_gradient(spec: _HeadSpec, math_: TileMath, z: Tensor, ref_z: Optional[Tensor], rows: slice, v0: int,
                          lse: Tensor, mu: Tensor, mu_d: Tensor, coeffs: _RowGradients, targets: Optional[Tensor],
                          want_column_sums: bool) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`_logit_gradient_` as one compiled kernel: the tile's gradient as a matmul operand, and its column sums."""
    at = lambda t: None if t is None else t[rows]  # noqa: E731
    transform = spec.transform
    return tile_logit_gradient(
        z, ref_z, lse[rows], at(mu) if coeffs.g_ent is not None else None, at(mu_d) if coeffs.g_kl is not None else None,
        coeffs.alpha[rows], at(coeffs.g_ent), at(coeffs.g_kl), at(coeffs.uniform), at(coeffs.g_lp),
        at(targets) if coeffs.g_lp is not None else None, v0,
        transform.softcap, transform.linear_scale, transform.inv_temperature, math_.matmul_dtype, want_column_sums)


def _backward_tiles(spec: _HeadSpec, grads: tuple, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                    targets: Optional[Tensor], ref_hidden: Optional[Tensor], ref_weight: Optional[Tensor],
                    ref_bias: Optional[Tensor], lse: Tensor, mu: Tensor, mu_d: Tensor, keep: Optional[Tensor],
                    need_h: bool, need_w: bool, need_b: bool) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The tiled backward: ``(grad_hidden, grad_weight, grad_bias)``, the hidden gradient of the counted rows only.

    Its own function so that every tile buffer (the workspace and each view of it) is released when it
    returns, before the caller makes the full-size hidden gradient of a masked call.
    """
    n, vocab, size = _pass_rows(hidden, keep), weight.shape[0], weight.shape[1]
    math_ = _tile_math(spec, n, hidden, weight, bias, ref_hidden, ref_weight, ref_bias)
    stat_dtype, device = math_.stat_dtype, hidden.device
    coeffs = _RowGradients.from_upstream(spec, grads, n, vocab, stat_dtype, device)
    stat_bias = None if bias is None else bias.to(stat_dtype)
    stat_ref_bias = None if ref_bias is None else ref_bias.to(stat_dtype)
    rt, vt = spec.row_tile, spec.vocab_tile
    block_rows = rt * _SUPER_BLOCK_ROW_TILES
    # fp32 hidden states: the output itself is the accumulator; otherwise one super-block's
    # fp32 accumulator is written into the output when the block is done. When only the rows
    # ``keep`` count, the output is first theirs alone, scattered into a zero gradient of all
    # rows at the very end, once the tile buffers are gone.
    direct_gh = need_h and hidden.dtype == stat_dtype
    grad_h = None
    if need_h:
        shape = hidden.shape if keep is None else (n, size)
        grad_h = torch.zeros(shape, dtype=stat_dtype, device=device) if direct_gh else torch.empty(shape, dtype=hidden.dtype, device=device)
    # Contiguous gradients (whatever the parameters' strides) so that tiles can be written with out=.
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_w else None
    direct_gw = need_w and weight.dtype == stat_dtype
    grad_b_acc = torch.zeros(vocab, dtype=stat_dtype, device=device) if need_b else None

    with _NoAutocast(device.type), torch.no_grad():
        values = not is_fake(hidden)
        for s0 in tile_starts(0, n, block_rows, values=values):
            s1 = min(s0 + block_rows, n)
            first_block, one_row_tile = s0 == 0, s1 - s0 <= rt
            gh_block = None
            if need_h:
                gh_block = grad_h[s0:s1] if direct_gh else math_.ws.get("gh", s1 - s0, size, min(block_rows, n) * size, stat_dtype).zero_()
            for v0 in tile_starts(0, vocab, vt, values=values):
                v1 = min(v0 + vt, vocab)
                w = math_.operand("w", weight[v0:v1], vt)
                ref_w = math_.operand("ref_w", ref_weight[v0:v1], vt) if coeffs.g_kl is not None else None
                gw_tile, overwrite_gw = None, False
                # One row-tile product per vocabulary tile, already in the weight's dtype: it
                # goes straight into the gradient (the fp32 tile would only round-trip it).
                straight_gw = (need_w and not direct_gw and first_block and one_row_tile
                               and weight.dtype == math_.matmul_dtype and not math_.fp32_out)
                if need_w and not straight_gw:
                    # fp32 weights accumulate straight into the gradient across all blocks; a
                    # low-precision weight gets each block's fp32 tile sum added once (below).
                    gw_tile = grad_w[v0:v1] if direct_gw else math_.ws.get("gw", v1 - v0, size, vt * size, stat_dtype)
                    overwrite_gw = first_block or not direct_gw
                    if overwrite_gw and not one_row_tile:
                        gw_tile.zero_()
                for r0 in tile_starts(s0, s1, rt, values=values):
                    r1 = min(r0 + rt, s1)
                    h = _row_tile(math_, "h", hidden, keep, r0, r1)
                    z = math_.logits("z", h, w, stat_bias, v0, v1)
                    ref_z = None
                    if ref_w is not None:
                        ref_z = math_.logits("ref_z", _row_tile(math_, "ref_h", ref_hidden, keep, r0, r1), ref_w, stat_ref_bias, v0, v1)
                    if math_.fused:
                        operand, column_sums = _fused_logit_gradient(spec, math_, z, ref_z, slice(r0, r1), v0, lse, mu, mu_d,
                                                                     coeffs, targets, need_b)
                    else:
                        grad_raw = _logit_gradient_(spec, math_, z, ref_z, slice(r0, r1), v0, lse, mu, mu_d, coeffs, targets)
                        operand, column_sums = math_.grad_operand(grad_raw), grad_raw.sum(0) if need_b else None
                    if need_h:
                        math_.accumulate("gh_p", gh_block[r0 - s0 : r1 - s0], operand, w, overwrite=False)
                    if straight_gw:
                        torch.mm(operand.t(), h, out=grad_w[v0:v1])
                    elif need_w:
                        math_.accumulate("gw_p", gw_tile, operand.t(), h, overwrite=overwrite_gw and one_row_tile)
                    if need_b:
                        grad_b_acc[v0:v1] += column_sums
                if need_w and not direct_gw and not straight_gw:
                    # Each block's fp32 tile sum is rounded once into the bf16/fp16 gradient, as
                    # gradient accumulation over micro-batches would; an fp32 copy of the whole
                    # weight gradient is deliberately never made.
                    grad_w[v0:v1].copy_(gw_tile) if first_block else grad_w[v0:v1].add_(gw_tile)
            if need_h and not direct_gh:
                grad_h[s0:s1].copy_(gh_block)
    grad_b = grad_b_acc.to(bias.dtype) if need_b else None
    return grad_h, grad_w, grad_b


class _LinearHeadFunction(torch.autograd.Function):
    """Per-row statistics of ``softmax(transform(hidden @ weight.T + bias))`` without materializing the logits.

    Forward keeps, per row, the running max/sum of the softmax and whatever expectation each
    requested output needs. Backward walks the rows in super-blocks of a few row tiles and, per
    super-block, recomputes one logits tile at a time, accumulating the block's hidden gradient
    (fp32, [block, H]) and one vocabulary tile's weight/bias gradient.
    """

    @staticmethod
    def forward(ctx, spec: _HeadSpec, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],  # type: ignore[override]
                targets: Optional[Tensor], ref_hidden: Optional[Tensor], ref_weight: Optional[Tensor], ref_bias: Optional[Tensor],
                keep: Optional[Tensor]):
        ctx.set_materialize_grads(False)
        math_ = _tile_math(spec, _pass_rows(hidden, keep), hidden, weight, bias, ref_hidden, ref_weight, ref_bias)
        stat_bias = None if bias is None else bias.to(math_.stat_dtype)
        stat_ref_bias = None if ref_bias is None else ref_bias.to(math_.stat_dtype)
        with _NoAutocast(hidden.device.type), torch.no_grad():
            s = _forward_statistics(spec, math_, hidden, weight, stat_bias, targets, ref_hidden, ref_weight, stat_ref_bias, keep)
        outputs = {
            "logprobs": s["target_z"] - s["lse"],
            "entropy": s["lse"] - s["mu"],
            "self_certainty": s["lse"] - s["mean_z"],
            "kl": s["mu_d"] - s["lse"] + s["ref_lse"],  # KL(p || q) = E_p[z - z_ref] - lse + lse_ref
            "logsumexp": s["lse"].clone(),
        }
        ctx.spec = spec
        ctx.save_for_backward(hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, s["lse"], s["mu"], s["mu_d"], keep)
        return tuple(outputs[name] for name in OUTPUTS if spec.wants(name))

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        if torch.is_grad_enabled():
            # create_graph=True: the tiled backward is not itself differentiable, and silently
            # returning gradients without a graph would make a second derivative wrong.
            raise RuntimeError(
                "lit_memopt linear-head ops (linear_logprobs, linear_entropy, ...) support a single backward pass; "
                "double backward / autograd.grad(create_graph=True) is not supported. Use the plain "
                "log_softmax path if you need higher-order gradients."
            )
        return _LinearHeadFunction._backward(ctx, *grads)

    @staticmethod
    @once_differentiable
    def _backward(ctx, *grads: Optional[Tensor]):
        spec: _HeadSpec = ctx.spec
        hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, lse, mu, mu_d, keep = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        nothing = (None,) * 9
        if not (need_h or need_w or need_b) or all(g is None for g in grads):
            return nothing
        if _pass_rows(hidden, keep) == 0:  # no rows: the tile loops would leave the gradients unwritten
            zeros = lambda t, need: torch.zeros_like(t) if need else None  # noqa: E731
            return None, zeros(hidden, need_h), zeros(weight, need_w), zeros(bias, need_b), None, None, None, None, None
        grad_h, grad_w, grad_b = _backward_tiles(
            spec, grads, hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, lse, mu, mu_d, keep,
            need_h, need_w, need_b)
        if need_h and keep is not None:
            # Only now, with the tile buffers gone (they died with _backward_tiles' frame), the full-size
            # gradient of all rows is made and the counted rows' gradient scattered into it.
            grad_h = torch.zeros_like(hidden, memory_format=torch.contiguous_format).index_copy_(0, keep, grad_h)
        return None, grad_h, grad_w, grad_b, None, None, None, None, None


def run_head(hidden: Tensor, weight: Tensor, targets: Optional[Tensor], outputs: tuple[str, ...], *,
             bias: Optional[Tensor] = None, temperature: float = 1.0, chunk_size: ChunkSize = None,
             ignore_index: int = -100, mask: Optional[Tensor] = None, logit_scale: float = 1.0,
             final_logit_softcapping: Optional[float] = None, precision: str = "auto",
             ref_hidden: Optional[Tensor] = None, ref_weight: Optional[Tensor] = None,
             ref_bias: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """Validate, drop rows that count for nothing, run the fused pass, and put rows back in place.

    Returns the requested ``outputs`` (names from :data:`OUTPUTS`), each fp32 with ``hidden``'s
    leading shape and 0 (no gradient) at rows excluded by ``ignore_index`` or ``mask``.
    """
    # FSDP2-sharded (DTensor) head weights are gathered here, in their own dtype (ops/sharded.py).
    gathered_weight = gather_if_sharded(weight)
    ref_weight = gathered_weight if ref_weight is weight else gather_if_sharded(ref_weight)  # tied: one gather
    weight, bias, ref_bias = gathered_weight, gather_if_sharded(bias), gather_if_sharded(ref_bias)
    check_weight_pair("hidden", hidden, "weight", weight)
    vocab, size = weight.shape
    check_bias("bias", bias, vocab)
    check_same_device(hidden, weight=weight, bias=bias)
    transform = LogitTransform(
        logit_scale=check_positive("logit_scale", logit_scale),
        softcap=check_positive("final_logit_softcapping", final_logit_softcapping, allow_none=True),
        inv_temperature=1.0 / check_positive("temperature", temperature),
    )
    kl = "kl" in outputs
    if kl:
        check_weight_pair("ref_hidden", ref_hidden, "ref_weight", ref_weight)
        if ref_weight.shape[0] != vocab:
            raise ValueError(f"`ref_weight` has vocabulary size {ref_weight.shape[0]} but `weight` has {vocab}; both heads must share a vocabulary")
        if ref_hidden.shape[:-1] != hidden.shape[:-1]:
            raise ValueError(f"`ref_hidden` leading shape {tuple(ref_hidden.shape[:-1])} must equal `hidden` leading shape {tuple(hidden.shape[:-1])}")
        check_bias("ref_bias", ref_bias, vocab)
        check_same_device(hidden, ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias)
        # The reference is a constant: detached, so nothing flows back into it even when it is
        # the policy's own (LoRA-shared) weight.
        ref_hidden, ref_weight = ref_hidden.detach(), ref_weight.detach()
        ref_bias = None if ref_bias is None else ref_bias.detach()
    if targets is not None:
        check_targets(targets, hidden, vocab, ignore_index)
    mask = check_mask(mask, hidden)
    fast = resolve_precision(precision, hidden, weight, bias, *((ref_hidden, ref_weight, ref_bias) if kl else ()))

    lead = hidden.shape[:-1]
    rows = hidden.reshape(-1, size)
    ref_rows = ref_hidden.reshape(-1, ref_hidden.shape[-1]) if kl else None
    flat_targets = targets.reshape(-1) if targets is not None else None
    valid = None
    if flat_targets is not None:
        valid = flat_targets != ignore_index
    if mask is not None:
        valid = mask.reshape(-1) if valid is None else valid & mask.reshape(-1)
    keep = None
    if valid is not None:
        if flat_targets is not None:
            flat_targets = torch.where(valid, flat_targets, 0)
        if not is_fake(valid) and not bool(valid.all()):
            # Only the rows that count reach the matmuls: the pass gathers them tile by tile and
            # scatters their hidden gradient back (the rest get exact zeros), so neither a compacted
            # copy of them nor of their gradient ever exists.
            keep = valid.nonzero().squeeze(1)
            flat_targets = None if flat_targets is None else flat_targets.index_select(0, keep)
    widest = max(size, ref_hidden.shape[-1]) if kl else size
    counted = rows.shape[0] if keep is None else keep.shape[0]
    fused = use_fused_tiles(rows.device, is_fake(rows))
    row_tile, vocab_tile = tile_sizes(chunk_size, counted, widest, vocab, hidden.device, fast=fast, total_rows=rows.shape[0],
                                      fused=fused)
    spec = _HeadSpec(frozenset(outputs), transform, row_tile, vocab_tile, fast, fused)
    results = _LinearHeadFunction.apply(spec, rows, weight, bias, flat_targets, ref_rows, ref_weight, ref_bias, keep)
    by_name = dict(zip([o for o in OUTPUTS if o in outputs], results))
    shaped = []
    for name in outputs:
        out = by_name[name]
        if keep is not None:
            out = out.new_zeros(valid.shape[0]).index_copy(0, keep, out)
        elif valid is not None:
            out = torch.where(valid, out, 0.0)
        shaped.append(out.reshape(lead))
    return tuple(shaped)


# --------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------

_COMMON_ARGS = """
        bias: optional ``[V]`` head bias.
        temperature: logits are divided by this (> 0), after the softcap.
        chunk_size: ``None`` picks tiles from the shapes (and free CUDA memory); an int sets both
            the row and vocabulary tile; a ``(row_tile, vocab_tile)`` pair sets them separately.
        mask: optional bool ``[...]``; rows where it is False give 0, get no gradient and are never multiplied.
        logit_scale: raw logits are multiplied by this (> 0) first (Cohere/Granite-style heads).
        final_logit_softcapping: ``cap`` (> 0) applies ``cap * tanh(z / cap)`` (Gemma-style); ``None`` for none.
        precision: ``"exact"`` multiplies fp32 tiles; ``"fast"`` multiplies bf16/fp16 tiles (fp32
            accumulation on CUDA, logits rounded to the input dtype on the CPU) with fp32 softmax
            statistics; ``"auto"`` (default) is ``"fast"`` when the head tensors share a bf16/fp16 dtype.
"""


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Optional[Tensor] = None,
                    temperature: float = 1.0, chunk_size: ChunkSize = None, ignore_index: int = -100,
                    mask: Optional[Tensor] = None, logit_scale: float = 1.0,
                    final_logit_softcapping: Optional[float] = None, precision: str = "auto") -> Tensor:
    """Log-probability of ``targets`` under ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / temperature)``.

    Args:
        hidden: ``[..., H]`` final hidden states (any float dtype, any leading dims; a DTensor weight is gathered).
        weight: ``[V, H]`` LM-head weight (may be tied to the input embedding, may be an FSDP2 DTensor).
        targets: ``[...]`` integer token ids; positions equal to ``ignore_index`` give 0 and no gradient.
        ignore_index: target value that marks padding.{common}
    Returns:
        fp32 ``[...]`` log-probs (float64 for float64 inputs). Gradients come back in the inputs' dtypes.

    Raises:
        TypeError, ValueError: bad dtypes, shapes, devices, scales, precision, chunk size or target ids.

    Example::

        logp = linear_logprobs(hidden, model.lm_head.weight, input_ids[:, 1:], mask=completion_mask)
    """
    return run_head(hidden, weight, targets, ("logprobs",), bias=bias, temperature=temperature, chunk_size=chunk_size,
                    ignore_index=ignore_index, mask=mask, logit_scale=logit_scale,
                    final_logit_softcapping=final_logit_softcapping, precision=precision)[0]


def linear_entropy(hidden: Tensor, weight: Tensor, *, bias: Optional[Tensor] = None, temperature: float = 1.0,
                   chunk_size: ChunkSize = None, mask: Optional[Tensor] = None, logit_scale: float = 1.0,
                   final_logit_softcapping: Optional[float] = None, precision: str = "auto") -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` of the next-token distribution, per position, as fp32 ``[...]``.

    Arguments are those of :func:`linear_logprobs` (no targets).

    Example::

        ent = linear_entropy(hidden, lm_head_weight).mean()
    """
    return run_head(hidden, weight, None, ("entropy",), bias=bias, temperature=temperature, chunk_size=chunk_size,
                    mask=mask, logit_scale=logit_scale, final_logit_softcapping=final_logit_softcapping,
                    precision=precision)[0]


def linear_logprobs_and_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Optional[Tensor] = None,
                                temperature: float = 1.0, chunk_size: ChunkSize = None, ignore_index: int = -100,
                                mask: Optional[Tensor] = None, logit_scale: float = 1.0,
                                final_logit_softcapping: Optional[float] = None,
                                precision: str = "auto") -> tuple[Tensor, Tensor]:
    """Target log-probs and entropy in one pass over the head (cheaper than two calls).

    Both outputs are 0, with no gradient, where ``targets == ignore_index`` or ``mask`` is False.

    Example::

        logp, ent = linear_logprobs_and_entropy(hidden, weight, targets, temperature=0.7)
    """
    logp, ent = run_head(hidden, weight, targets, ("logprobs", "entropy"), bias=bias, temperature=temperature,
                         chunk_size=chunk_size, ignore_index=ignore_index, mask=mask, logit_scale=logit_scale,
                         final_logit_softcapping=final_logit_softcapping, precision=precision)
    return logp, ent


def linear_self_certainty(hidden: Tensor, weight: Tensor, *, bias: Optional[Tensor] = None, temperature: float = 1.0,
                          chunk_size: ChunkSize = None, mask: Optional[Tensor] = None, logit_scale: float = 1.0,
                          final_logit_softcapping: Optional[float] = None, precision: str = "auto") -> Tensor:
    """Self-certainty ``logsumexp(z) - mean_v(z)`` per position (the Intuitor score), fp32 ``[...]``.

    It equals ``KL(U || p) + log V`` (``U`` uniform over the vocabulary), so it is ``>= log V``
    with equality only for a flat ``p``; higher means more confident. Arguments are those of
    :func:`linear_entropy`.

    Example::

        certainty = linear_self_certainty(hidden, weight)  # [B, T]
    """
    return run_head(hidden, weight, None, ("self_certainty",), bias=bias, temperature=temperature,
                    chunk_size=chunk_size, mask=mask, logit_scale=logit_scale,
                    final_logit_softcapping=final_logit_softcapping, precision=precision)[0]


def linear_kl(hidden: Tensor, weight: Tensor, ref_hidden: Tensor, ref_weight: Tensor, *, temperature: float = 1.0,
              chunk_size: ChunkSize = None, bias: Optional[Tensor] = None, ref_bias: Optional[Tensor] = None,
              mask: Optional[Tensor] = None, logit_scale: float = 1.0,
              final_logit_softcapping: Optional[float] = None, precision: str = "auto") -> Tensor:
    """Exact per-position ``KL(pi || pi_ref)`` over the full vocabulary, fp32 ``[...]``.

    ``pi`` and ``pi_ref`` are the head distributions of the policy and the reference (the same
    ``logit_scale`` / softcap / temperature apply to both). Gradients flow to ``hidden``, ``weight``
    and ``bias`` only; the reference is a constant (it may share ``weight``, as a LoRA policy's frozen head does).

    Example::

        with torch.no_grad(), model.disable_adapter():
            ref_hidden = decoder_hidden_states(model, input_ids)
        kl = linear_kl(hidden, weight, ref_hidden, weight)
    """
    return run_head(hidden, weight, None, ("kl",), bias=bias, temperature=temperature, chunk_size=chunk_size,
                    mask=mask, logit_scale=logit_scale, final_logit_softcapping=final_logit_softcapping,
                    precision=precision, ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias)[0]


for _op in (linear_logprobs,):
    _op.__doc__ = _op.__doc__.format(common=_COMMON_ARGS.rstrip())
