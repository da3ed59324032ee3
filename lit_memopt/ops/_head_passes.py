"""The two tiled passes of the fused LM head (``linear_head.py``): the forward's running softmax
statistics per row, and the backward's logit-gradient tiles and their products into the hidden,
weight and bias gradients. Each tile is one ``[row tile, vocab tile]`` block of logits, computed,
used and dropped; the per-tile softmax maths run as eager ops or as compiled kernels
(``_fused_tiles.py``, the CUDA default), and a call with one row tile may run each pass as one compiled
graph (``_whole_pass.py``). ``linear_head.plan_pass`` settles which, in the spec (:class:`_HeadSpec`); a pass
reads its tensors from :class:`HeadTensors` and the backward the forward's :class:`RowStatistics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from lit_memopt.ops._fused_tiles import finish_rows, fold_tile, start_rows, tile_logit_gradient
from lit_memopt.ops._head_tiles import LogitTransform, TileMath, exp_, is_fake, tile_starts
from lit_memopt.ops._whole_pass import whole_backward, whole_forward

# Backward walks the rows in super-blocks of this many row tiles, so its fp32 hidden-gradient
# accumulator is [super-block, H] (a few tile budgets) instead of [N, H]. More row tiles per block
# mean fewer re-casts of the weight tiles and fewer low-precision additions into a bf16/fp16 weight
# gradient; fewer mean a smaller accumulator.
_SUPER_BLOCK_ROW_TILES = 4

# Per-row outputs, in the order the Function returns them.
OUTPUTS = ("logprobs", "entropy", "self_certainty", "kl", "logsumexp")


@dataclass(frozen=True)
class _HeadSpec:
    """What one fused pass computes and how it tiles (non-tensor arguments of the autograd Function)."""

    outputs: frozenset
    transform: LogitTransform
    row_tile: int
    vocab_tile: int
    low_precision: Optional[torch.dtype]  # the tile matmuls' dtype for "fast"; None: fp32 tiles ("exact")
    fused: bool = False  # tile maths as compiled kernels (ops/_fused_tiles.py), decided once for forward and backward
    whole_pass: bool = False  # each pass one compiled graph over all vocabulary tiles (ops/_whole_pass.py; one row tile)

    def wants(self, name: str) -> bool:
        return name in self.outputs


@dataclass(frozen=True)
class HeadTensors:
    """The tensors one head pass reads: ``hidden`` rows ``[N, H]`` and the head, the rows' target ids (log-probs),
    the reference's rows and head (KL) and ``keep``, the indices of the rows that count (``None``: all of them)."""

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor] = None
    targets: Optional[Tensor] = None
    ref_hidden: Optional[Tensor] = None
    ref_weight: Optional[Tensor] = None
    ref_bias: Optional[Tensor] = None
    keep: Optional[Tensor] = None

    @property
    def rows(self) -> int:
        """How many rows the pass computes (:func:`_pass_rows`)."""
        return _pass_rows(self.hidden, self.keep)


@dataclass(frozen=True)
class RowStatistics:
    """What the backward reads of the forward's per-row statistics: ``lse``, ``mu`` (= E_p[z], entropy) and
    ``mu_d`` (= E_p[z - z_ref], KL); ``None`` where no output needs them."""

    lse: Tensor
    mu: Optional[Tensor] = None
    mu_d: Optional[Tensor] = None


class GradientsWanted(NamedTuple):
    """Which of the head's gradients a backward makes (``ctx.needs_input_grad`` of hidden, weight and bias)."""

    hidden: bool
    weight: bool
    bias: bool


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
    matmul_dtype = spec.low_precision or stat_dtype
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

    def __init__(self, spec: _HeadSpec, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        # sum_ez = sum_v e_v z_v (entropy), sum_ed = sum_v e_v (z_v - zref_v) (KL); None where no output needs it
        (self.max, self.sum, self.sum_ez, self.sum_z, self.target_z, self.ref_max, self.ref_sum, self.sum_ed) = start_rows(
            rows, dtype, device, entropy=spec.wants("entropy"), self_certainty=spec.wants("self_certainty"),
            logprobs=spec.wants("logprobs"), kl=spec.wants("kl"))

    def finish(self, vocab: int) -> dict[str, Tensor]:
        """The row tile's statistics once every vocabulary tile is folded in (``finish_rows``)."""
        return finish_rows(self.max, self.sum, self.sum_ez, self.sum_z, self.target_z, self.ref_max, self.ref_sum,
                           self.sum_ed, vocab)

    def update(self, z: Tensor, scratch: Tensor, v0: int, targets: Optional[Tensor], ref_z: Optional[Tensor]) -> None:
        """Fold the logits tile ``z`` (and the reference tile ``ref_z``) in; ``scratch`` is a tile buffer."""
        if self.spec.fused:  # the same maths in one compiled kernel (ops/_fused_tiles.py)
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


# Which per-row statistic (besides ``lse``) each output needs.
_STAT_OF_OUTPUT = (("target_z", "logprobs"), ("mu", "entropy"), ("mean_z", "self_certainty"), ("ref_lse", "kl"), ("mu_d", "kl"))


def _stat_bias(math_: TileMath, bias: Optional[Tensor]) -> Optional[Tensor]:
    """A head bias in the statistics dtype: added to fp32 logits tiles without a bf16 rounding of the sum."""
    return None if bias is None else bias.to(math_.stat_dtype)


def _forward_statistics(spec: _HeadSpec, math_: TileMath, t: HeadTensors) -> dict[str, Tensor]:
    """Per-row ``lse`` plus what the requested outputs need: ``target_z``, ``mu`` (= E_p[z]),
    ``mean_z``, ``ref_lse`` and ``mu_d`` (= E_p[z - z_ref]), for the rows ``t.keep`` (all when ``None``)."""
    bias, ref_bias = _stat_bias(math_, t.bias), _stat_bias(math_, t.ref_bias)
    if spec.whole_pass:
        kl, transform = spec.wants("kl"), spec.transform
        return whole_forward(
            _counted(t.hidden, t.keep), t.weight, bias, t.targets if spec.wants("logprobs") else None,
            _counted(t.ref_hidden, t.keep) if kl else None, t.ref_weight if kl else None, ref_bias if kl else None,
            spec.vocab_tile, math_.matmul_dtype, math_.stat_dtype, math_.fp32_out,
            transform.softcap, transform.logit_scale, transform.inv_temperature, spec.wants("entropy"),
            spec.wants("self_certainty"))
    n, vocab = t.rows, t.weight.shape[0]
    rt, vt = spec.row_tile, spec.vocab_tile
    # Only the statistics the requested outputs read (each is a kernel launch per call on a GPU).
    needed = {"lse"} | {stat for stat, output in _STAT_OF_OUTPUT if spec.wants(output)}
    stats: dict[str, Tensor] = {k: t.hidden.new_zeros(n, dtype=math_.stat_dtype) for k in sorted(needed)}
    values = not is_fake(t.hidden)
    for r0 in tile_starts(0, n, rt, values=values):
        r1 = min(r0 + rt, n)
        h = _row_tile(math_, "h", t.hidden, t.keep, r0, r1)
        ref_h = _row_tile(math_, "ref_h", t.ref_hidden, t.keep, r0, r1) if t.ref_weight is not None else None
        run = _RunningSoftmax(spec, r1 - r0, math_.stat_dtype, t.hidden.device)
        for v0 in tile_starts(0, vocab, vt, values=values):
            v1 = min(v0 + vt, vocab)
            z = math_.logits("z", h, math_.operand("w", t.weight[v0:v1], vt), bias, v0, v1)
            ref_z = None
            if ref_h is not None:
                ref_z = math_.logits("ref_z", ref_h, math_.operand("ref_w", t.ref_weight[v0:v1], vt), ref_bias, v0, v1)
            run.update(z, math_.stat_buffer("e", r1 - r0, v1 - v0), v0, None if t.targets is None else t.targets[r0:r1], ref_z)
        for name, value in run.finish(vocab).items():
            stats[name][r0:r1] = value
    return stats


def _counted(t: Optional[Tensor], keep: Optional[Tensor]) -> Optional[Tensor]:
    """The rows of ``t`` that reach the matmuls (all, or those in ``keep``); one row tile's worth in a whole pass."""
    return t if t is None or keep is None else t.index_select(0, keep)


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
                     stats: RowStatistics, coeffs: _RowGradients, targets: Optional[Tensor]) -> Tensor:
    """``d out / d raw`` for one tile (raw = hidden @ W.T + b), built in tile buffers; ``z`` is consumed."""
    n_rows, cols = z.shape
    lse, mu, mu_d = stats.lse, stats.mu, stats.mu_d
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


def _tile_gradient(spec: _HeadSpec, math_: TileMath, z: Tensor, ref_z: Optional[Tensor], rows: slice, v0: int,
                   stats: RowStatistics, coeffs: _RowGradients, targets: Optional[Tensor],
                   want_column_sums: bool) -> tuple[Tensor, Optional[Tensor]]:
    """One tile's logit gradient as a matmul operand, and its column sums (the bias gradient) when wanted: the
    compiled :func:`tile_logit_gradient` where the spec says so, else :func:`_logit_gradient_` (``z`` consumed)."""
    if not math_.fused:
        grad_raw = _logit_gradient_(spec, math_, z, ref_z, rows, v0, stats, coeffs, targets)
        return math_.grad_operand(grad_raw), grad_raw.sum(0) if want_column_sums else None
    at = lambda t: None if t is None else t[rows]  # noqa: E731
    transform = spec.transform
    return tile_logit_gradient(
        z, ref_z, stats.lse[rows], at(stats.mu) if coeffs.g_ent is not None else None,
        at(stats.mu_d) if coeffs.g_kl is not None else None,
        coeffs.alpha[rows], at(coeffs.g_ent), at(coeffs.g_kl), at(coeffs.uniform), at(coeffs.g_lp),
        at(targets) if coeffs.g_lp is not None else None, v0,
        transform.softcap, transform.linear_scale, transform.inv_temperature, math_.matmul_dtype, want_column_sums)


def _weight_gradient_mode(math_: TileMath, weight: Tensor, rows: int, row_tile: int) -> str:
    """How the tiled backward sums each vocabulary tile's weight gradient over the row tiles:

    * ``"accumulate"``: a weight in the statistics dtype is its own accumulator; every product adds into it.
    * ``"straight"``: the call has one row tile and the weight has the matmul dtype: one product per vocabulary
      tile, written straight into the gradient (an fp32 tile would only round-trip it). ``tile_sizes`` relies on
      this: such vocabulary tiles are not bounded as weight tiles.
    * ``"rounded"``: a bf16/fp16 weight gets each super-block's fp32 tile sum added once, as gradient
      accumulation over micro-batches would; an fp32 copy of the whole weight gradient is never made.
    """
    if weight.dtype == math_.stat_dtype:
        return "accumulate"
    return "straight" if rows <= row_tile and weight.dtype == math_.matmul_dtype else "rounded"


def _backward_tiles(spec: _HeadSpec, grads: tuple, t: HeadTensors, stats: RowStatistics, wanted: GradientsWanted
                    ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The backward: ``(grad_hidden, grad_weight, grad_bias)``, the hidden gradient of the counted rows only.

    Its own function so that every tile buffer (the workspace and each view of it) is released when it
    returns, before the caller makes the full-size hidden gradient of a masked call.
    """
    n, weight = t.rows, t.weight
    math_ = _tile_math(spec, n, t.hidden, weight, t.bias, t.ref_hidden, t.ref_weight, t.ref_bias)
    coeffs = _RowGradients.from_upstream(spec, grads, n, weight.shape[0], math_.stat_dtype, t.hidden.device)
    # Contiguous gradients (whatever the parameters' strides) so that tiles can be written with out= or into slices.
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=t.hidden.device) if wanted.weight else None
    with _NoAutocast(t.hidden.device.type), torch.no_grad():
        if spec.whole_pass:
            grad_h, grad_b = _whole_backward(spec, math_, t, stats, coeffs, wanted, grad_w)
        else:
            grad_h, grad_b = _tiled_backward(spec, math_, t, stats, coeffs, wanted, grad_w)
    return grad_h, grad_w, grad_b.to(t.bias.dtype) if wanted.bias else None


def _whole_backward(spec: _HeadSpec, math_: TileMath, t: HeadTensors, stats: RowStatistics, coeffs: _RowGradients,
                    wanted: GradientsWanted, grad_w: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """:func:`_tiled_backward` as one compiled call (``_whole_pass.py``): ``(grad_h, grad_b)``, ``grad_w`` filled."""
    transform, g_kl = spec.transform, coeffs.g_kl
    kl = g_kl is not None
    return whole_backward(
        _counted(t.hidden, t.keep), t.weight, _stat_bias(math_, t.bias), t.targets if coeffs.g_lp is not None else None,
        _counted(t.ref_hidden, t.keep) if kl else None, t.ref_weight if kl else None,
        _stat_bias(math_, t.ref_bias) if kl else None, stats.lse, stats.mu if coeffs.g_ent is not None else None,
        stats.mu_d if kl else None, coeffs.alpha, coeffs.g_lp, coeffs.g_ent, g_kl, coeffs.uniform,
        spec.vocab_tile, math_.matmul_dtype, math_.stat_dtype, math_.fp32_out,
        transform.softcap, transform.logit_scale, transform.inv_temperature, wanted.hidden, grad_w, wanted.bias)


def _tiled_backward(spec: _HeadSpec, math_: TileMath, t: HeadTensors, stats: RowStatistics, coeffs: _RowGradients,
                    wanted: GradientsWanted, grad_w: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The backward tile by tile: ``(grad_h, grad_b)`` (the bias gradient in the statistics dtype), ``grad_w`` filled."""
    hidden, weight, keep, targets = t.hidden, t.weight, t.keep, t.targets
    need_h, need_w, need_b = wanted
    n, vocab, size = t.rows, weight.shape[0], weight.shape[1]
    stat_dtype, device = math_.stat_dtype, hidden.device
    stat_bias, stat_ref_bias = _stat_bias(math_, t.bias), _stat_bias(math_, t.ref_bias)
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
    gw_mode = _weight_gradient_mode(math_, weight, n, rt) if need_w else None
    grad_b_acc = torch.zeros(vocab, dtype=stat_dtype, device=device) if need_b else None

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
            ref_w = math_.operand("ref_w", t.ref_weight[v0:v1], vt) if coeffs.g_kl is not None else None
            gw_tile, overwrite_gw = None, False
            if gw_mode in ("accumulate", "rounded"):
                # The weight itself accumulates over all blocks from the first; a block's fp32 tile sum starts afresh.
                gw_tile = grad_w[v0:v1] if gw_mode == "accumulate" else math_.ws.get("gw", v1 - v0, size, vt * size, stat_dtype)
                overwrite_gw = first_block or gw_mode == "rounded"
                if overwrite_gw and not one_row_tile:
                    gw_tile.zero_()
            for r0 in tile_starts(s0, s1, rt, values=values):
                r1 = min(r0 + rt, s1)
                h = _row_tile(math_, "h", hidden, keep, r0, r1)
                z = math_.logits("z", h, w, stat_bias, v0, v1)
                ref_z = None
                if ref_w is not None:
                    ref_z = math_.logits("ref_z", _row_tile(math_, "ref_h", t.ref_hidden, keep, r0, r1), ref_w, stat_ref_bias, v0, v1)
                operand, column_sums = _tile_gradient(spec, math_, z, ref_z, slice(r0, r1), v0, stats, coeffs, targets, need_b)
                if need_h:
                    math_.accumulate("gh_p", gh_block[r0 - s0 : r1 - s0], operand, w, overwrite=False)
                if gw_mode == "straight":
                    torch.mm(operand.t(), h, out=grad_w[v0:v1])
                elif gw_mode is not None:
                    math_.accumulate("gw_p", gw_tile, operand.t(), h, overwrite=overwrite_gw and one_row_tile)
                if need_b:
                    grad_b_acc[v0:v1] += column_sums
            if gw_mode == "rounded":  # the block's fp32 tile sum, rounded once into the bf16/fp16 gradient
                grad_w[v0:v1].copy_(gw_tile) if first_block else grad_w[v0:v1].add_(gw_tile)
        if need_h and not direct_gh:
            grad_h[s0:s1].copy_(gh_block)
    return grad_h, grad_b_acc
