"""LM-head quantities (log-probs, entropy, self-certainty, KL) computed from hidden states and the
head weight tile by tile, so that no ``[tokens, vocab]`` logits tensor ever exists.

Tiles are computed in fp32 (float64 for float64 inputs). On CUDA the fp32 tile matmuls follow
``torch.backends.cuda.matmul.allow_tf32`` / ``torch.set_float32_matmul_precision``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lit_memopt.ops.sharded import gather_if_sharded

__all__ = [
    "linear_logprobs",
    "linear_entropy",
    "linear_logprobs_and_entropy",
    "linear_self_certainty",
    "linear_kl",
]

ChunkSize = Optional[Union[int, Sequence[int]]]

# Automatic tiling keeps every temporary (a logits tile, an fp32 weight tile, an fp32 hidden tile)
# at most this many elements, but never less than the floor: tiny problems then run in one tile.
_MAX_TILE_ELEMENTS = 1 << 23  # 32 MiB in fp32
_MIN_TILE_ELEMENTS = 1 << 18
# Tiles bigger than this are rounded down to a multiple of it, which matmul kernels prefer.
_TILE_ALIGN = 128
# On CUDA no tile may take more than this fraction of the currently free memory.
_CUDA_FREE_FRACTION = 16
# Backward walks the rows in super-blocks of this many row tiles, so its fp32 hidden-gradient
# accumulator is [super-block, H] (a few tile budgets) instead of [N, H]. More row tiles per block
# mean fewer re-casts of the weight tiles and fewer low-precision additions into a bf16/fp16 weight
# gradient; fewer mean a smaller accumulator.
_SUPER_BLOCK_ROW_TILES = 4


@dataclass(frozen=True)
class _HeadSpec:
    """What one fused pass computes and how it tiles (non-tensor arguments of the autograd Function)."""

    logprobs: bool
    entropy: bool
    self_certainty: bool
    kl: bool
    inv_temperature: float
    row_tile: int
    vocab_tile: int
    ignore_index: int


# --------------------------------------------------------------------------------------------
# validation and tiling
# --------------------------------------------------------------------------------------------


def _is_fake(t: Tensor) -> bool:
    # Fake and meta tensors carry no values, so value checks (target range) must be skipped.
    if t.device.type == "meta":
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake

        return bool(is_fake(t))
    except ImportError:  # pragma: no cover - very old torch
        return False


def _check_float(name: str, t: object, min_dim: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor (float16/bfloat16/float32/float64), got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"`{name}` must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    return t


def _check_same_device(reference: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"`{name}` is on {t.device} but `hidden` is on {reference.device}; move them to one device")


def _check_weight_pair(hidden_name: str, hidden: Tensor, weight_name: str, weight: Tensor) -> None:
    _check_float(hidden_name, hidden, 1)
    _check_float(weight_name, weight, 2)
    if weight.dim() != 2:
        raise ValueError(f"`{weight_name}` must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"`{weight_name}` must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"`{weight_name}` has hidden size {weight.shape[1]} but `{hidden_name}` has {hidden.shape[-1]} "
            f"(shapes {tuple(weight.shape)} and {tuple(hidden.shape)}); expected {weight_name}[V, H] and {hidden_name}[..., H]"
        )


def _check_bias(name: str, bias: Optional[Tensor], vocab: int) -> None:
    if bias is None:
        return
    _check_float(name, bias, 1)
    if bias.shape != (vocab,):
        raise ValueError(f"`{name}` must have shape ({vocab},) to match the head weight, got {tuple(bias.shape)}")


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, Tensor):
        if temperature.numel() != 1:
            raise ValueError("`temperature` must be a positive scalar")
        temperature = float(temperature.item())
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"`temperature` must be a positive float, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"`temperature` must be a finite number > 0, got {temperature}")
    return float(temperature)


def _check_targets(targets: object, hidden: Tensor, vocab: int, ignore_index: int) -> Tensor:
    if not isinstance(targets, Tensor):
        raise TypeError(f"`targets` must be a torch.Tensor of token ids, got {type(targets).__name__}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"`targets` must be an integer tensor (e.g. torch.long), got {targets.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"`targets` must have shape {tuple(hidden.shape[:-1])} (the leading dims of `hidden` {tuple(hidden.shape)}), "
            f"got {tuple(targets.shape)}"
        )
    if targets.device != hidden.device:
        raise ValueError(f"`targets` is on {targets.device} but `hidden` is on {hidden.device}; move them to one device")
    if targets.numel() and not _is_fake(targets):
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            first = targets[bad].flatten()[0].item()
            raise ValueError(
                f"`targets` must be in [0, {vocab}) or equal ignore_index={ignore_index}; found {first}"
            )
    return targets


def _tile_sizes(chunk_size: ChunkSize, rows: int, hidden_size: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """Pick ``(row_tile, vocab_tile)``: explicit when given, else from the shapes and free memory."""
    if chunk_size is not None:
        if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
            row_tile = vocab_tile = chunk_size
        elif isinstance(chunk_size, Sequence) and len(chunk_size) == 2 and all(
            isinstance(c, int) and not isinstance(c, bool) for c in chunk_size
        ):
            row_tile, vocab_tile = chunk_size
        else:
            raise TypeError(
                f"`chunk_size` must be None (automatic), an int, or a (row_tile, vocab_tile) pair of ints, got {chunk_size!r}"
            )
        if row_tile < 1 or vocab_tile < 1:
            raise ValueError(f"`chunk_size` entries must be >= 1, got {chunk_size!r}")
        return row_tile, vocab_tile

    # Budget: about the size of `hidden` itself, clamped to a fixed window so that huge batches
    # still tile finely and tiny ones run in a single tile.
    budget = min(max(rows * hidden_size, _MIN_TILE_ELEMENTS), _MAX_TILE_ELEMENTS)
    if device.type == "cuda" and torch.cuda.is_available():
        try:
            free_bytes, _ = torch.cuda.mem_get_info(device)
            budget = min(budget, max(free_bytes // (4 * _CUDA_FREE_FRACTION), 1 << 14))
        except RuntimeError:  # fake/meta device contexts cannot query the allocator
            pass

    def align(n: int) -> int:
        return n if n <= _TILE_ALIGN else n - n % _TILE_ALIGN

    row_tile = align(max(1, min(rows, budget // hidden_size)))
    # A vocab tile is bounded both as a logits tile [row_tile, vocab_tile] and as a weight tile [vocab_tile, H].
    vocab_tile = align(max(1, min(vocab, budget // max(row_tile, 1), budget // hidden_size)))
    return max(row_tile, 1), max(vocab_tile, 1)


def _compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    # At least fp32 inside; float64 inputs stay float64 so that gradcheck is meaningful.
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


class _NoAutocast:
    """Disable autocast on ``device_type`` so the tiles really are computed in fp32."""

    def __init__(self, device_type: str) -> None:
        self._ctx = None
        if device_type in ("cpu", "cuda", "xpu", "mps", "hpu"):
            self._ctx = torch.autocast(device_type=device_type, enabled=False)

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


# --------------------------------------------------------------------------------------------
# the fused pass
# --------------------------------------------------------------------------------------------


class _Workspace:
    """Tile buffers allocated once per pass and reused by every tile.

    Allocating a fresh multi-megabyte tile per step costs page faults on the CPU and allocator
    traffic on CUDA; reusing flat buffers (viewed to each tile's shape) avoids both.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, rows: int, cols: int, capacity: int) -> Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = torch.empty(capacity, dtype=self.dtype, device=self.device)
        return buf[: rows * cols].view(rows, cols)


def _cast_tile(ws: _Workspace, name: str, src: Tensor, scale: float, capacity: int) -> Tensor:
    """``src * scale`` in the compute dtype; a view (no copy) when nothing needs changing."""
    if src.dtype == ws.dtype and scale == 1.0:
        return src
    out = ws.get(name, src.shape[0], src.shape[1], capacity)
    # Upcast first, then scale: multiplying a bf16 tile into an fp32 buffer would round src * scale
    # to bf16 before the cast (a ~2^-9 relative error in every logit when temperature != 1).
    return out.copy_(src) if scale == 1.0 else out.copy_(src).mul_(scale)


def _logits_into(out: Tensor, h: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b, h, w.t(), out=out)


def _bias_tile(bias: Optional[Tensor], v0: int, v1: int, inv_t: float, dtype: torch.dtype) -> Optional[Tensor]:
    if bias is None:
        return None
    b = bias[v0:v1].to(dtype)
    return b * inv_t if inv_t != 1.0 else b


class _LinearHeadFunction(torch.autograd.Function):
    """Per-row statistics of ``softmax((hidden @ weight.T + bias) / T)`` without materializing the logits.

    Forward keeps, per row, the running max/sum of the softmax (hence logsumexp) and whatever
    expectation each requested quantity needs; backward walks the rows in super-blocks of a few
    row tiles and, per super-block, recomputes one logits tile at a time, accumulating the block's
    hidden gradient (compute dtype, [block, H]) and the weight/bias gradient of one vocab tile,
    which is added into the weight gradient before the next tile starts.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        spec: _HeadSpec,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        targets: Optional[Tensor],
        ref_hidden: Optional[Tensor],
        ref_weight: Optional[Tensor],
        ref_bias: Optional[Tensor],
    ):
        ctx.set_materialize_grads(False)
        cdt = _compute_dtype(hidden, weight, bias, ref_hidden, ref_weight, ref_bias)
        n, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        inv_t = spec.inv_temperature
        rt, vt = spec.row_tile, spec.vocab_tile
        tile_cap = min(rt, max(n, 1)) * min(vt, vocab)
        ws = _Workspace(cdt, device)
        zeros = lambda: torch.zeros(n, dtype=cdt, device=device)  # noqa: E731
        lse = zeros()
        mu = zeros() if spec.entropy else None
        mean_z = zeros() if spec.self_certainty else None
        target_z = zeros() if spec.logprobs else None
        ref_lse = zeros() if spec.kl else None
        mu_d = zeros() if spec.kl else None

        with _NoAutocast(device.type), torch.no_grad():
            for r0 in range(0, n, rt):
                r1 = min(r0 + rt, n)
                rows = r1 - r0
                h = _cast_tile(ws, "h", hidden[r0:r1], 1.0, rt * hidden.shape[1])
                hr = _cast_tile(ws, "hr", ref_hidden[r0:r1], 1.0, rt * ref_hidden.shape[1]) if spec.kl else None
                run_max = torch.full((rows,), -math.inf, dtype=cdt, device=device)
                run_sum = torch.zeros(rows, dtype=cdt, device=device)
                run_ez = torch.zeros(rows, dtype=cdt, device=device) if spec.entropy else None
                run_ed = torch.zeros(rows, dtype=cdt, device=device) if spec.kl else None
                ref_max = torch.full((rows,), -math.inf, dtype=cdt, device=device) if spec.kl else None
                ref_sum = torch.zeros(rows, dtype=cdt, device=device) if spec.kl else None
                sum_z = torch.zeros(rows, dtype=cdt, device=device) if spec.self_certainty else None
                tz = torch.zeros(rows, dtype=cdt, device=device) if spec.logprobs else None
                tgt = targets[r0:r1] if spec.logprobs else None

                for v0 in range(0, vocab, vt):
                    v1 = min(v0 + vt, vocab)
                    cols = v1 - v0
                    w = _cast_tile(ws, "w", weight[v0:v1], inv_t, vt * weight.shape[1])
                    z = _logits_into(ws.get("z", rows, cols, tile_cap), h, w, _bias_tile(bias, v0, v1, inv_t, cdt))
                    if spec.logprobs:
                        local = tgt - v0
                        in_tile = (local >= 0) & (local < cols)
                        picked = z.gather(1, local.clamp(0, cols - 1).unsqueeze(1)).squeeze(1)
                        tz = torch.where(in_tile, picked, tz)
                    if sum_z is not None:
                        sum_z += z.sum(1)
                    new_max = torch.maximum(run_max, z.amax(1))
                    rescale = torch.exp(run_max - new_max)
                    e = ws.get("e", rows, cols, tile_cap)
                    if spec.kl:
                        wr = _cast_tile(ws, "wr", ref_weight[v0:v1], inv_t, vt * ref_weight.shape[1])
                        zr = _logits_into(ws.get("zr", rows, cols, tile_cap), hr, wr, _bias_tile(ref_bias, v0, v1, inv_t, cdt))
                        new_ref_max = torch.maximum(ref_max, zr.amax(1))
                        torch.sub(zr, new_ref_max.unsqueeze(1), out=e).exp_()
                        ref_sum = ref_sum * torch.exp(ref_max - new_ref_max) + e.sum(1)
                        ref_max = new_ref_max
                    torch.sub(z, new_max.unsqueeze(1), out=e).exp_()
                    run_sum = run_sum * rescale + e.sum(1)
                    run_max = new_max
                    if spec.kl:
                        d = zr.neg_().add_(z)  # z - z_ref, in place of the reference tile
                        run_ed = run_ed * rescale + d.mul_(e).sum(1)
                    if spec.entropy:
                        run_ez = run_ez * rescale + e.mul_(z).sum(1)

                lse[r0:r1] = run_max + torch.log(run_sum)
                if spec.entropy:
                    mu[r0:r1] = run_ez / run_sum
                if sum_z is not None:
                    mean_z[r0:r1] = sum_z / vocab
                if spec.logprobs:
                    target_z[r0:r1] = tz
                if spec.kl:
                    ref_lse[r0:r1] = ref_max + torch.log(ref_sum)
                    mu_d[r0:r1] = run_ed / run_sum
        del ws

        valid = None if targets is None else targets != spec.ignore_index
        outputs = []
        if spec.logprobs:
            outputs.append(torch.where(valid, target_z - lse, 0.0))
        if spec.entropy:
            ent = lse - mu
            outputs.append(ent if valid is None else torch.where(valid, ent, 0.0))
        if spec.self_certainty:
            outputs.append(lse - mean_z)
        if spec.kl:
            # KL(p || q) = E_p[z - z_ref] - lse + lse_ref
            outputs.append(mu_d - lse + ref_lse)

        ctx.spec = spec
        ctx.save_for_backward(hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, lse, mu, mu_d)
        return tuple(outputs)

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
        hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, lse, mu, mu_d = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        nothing = (None,) * 8
        if not (need_h or need_w or need_b) or all(g is None for g in grads):
            return nothing

        cdt = lse.dtype
        n, vocab = hidden.shape[0], weight.shape[0]
        size = weight.shape[1]
        if n == 0:  # no rows: the tile loops would leave the gradients unwritten
            return (
                None,
                torch.zeros_like(hidden) if need_h else None,
                torch.zeros_like(weight) if need_w else None,
                torch.zeros_like(bias) if need_b else None,
                None, None, None, None,
            )
        device = hidden.device
        inv_t = spec.inv_temperature
        rt, vt = spec.row_tile, spec.vocab_tile
        tile_cap = min(rt, max(n, 1)) * min(vt, vocab)
        single_row_tile = n <= rt

        # Outputs come in the order logprobs, entropy, self_certainty, kl (only those requested).
        pending = iter(grads)
        per_output = []
        for flag in (spec.logprobs, spec.entropy, spec.self_certainty, spec.kl):
            g = next(pending) if flag else None
            per_output.append(None if g is None else g.reshape(-1).to(cdt))
        g_lp, g_ent, g_sc, g_kl = per_output
        if targets is not None:
            valid = (targets != spec.ignore_index).to(cdt)
            g_lp = None if g_lp is None else g_lp * valid
            g_ent = None if g_ent is None else g_ent * valid
        # d out / d z for one row: p * (alpha + g_ent (mu - z) + g_kl (d - mu_d)) - g_sc / V + g_lp onehot(target)
        alpha = torch.zeros(n, dtype=cdt, device=device)
        if g_lp is not None:
            alpha -= g_lp
        if g_sc is not None:
            alpha += g_sc
        uniform = None if g_sc is None else g_sc / vocab
        needs_z_after_p = g_ent is not None or g_kl is not None

        ws = _Workspace(cdt, device)
        # The hidden gradient is accumulated in the compute dtype one row super-block at a time and
        # written into the output (hidden's dtype) when the block is done, so the fp32 accumulator
        # never spans all N rows. With fp32 hidden states the output itself is the accumulator.
        sb = rt * _SUPER_BLOCK_ROW_TILES
        direct_gh = need_h and hidden.dtype == cdt
        if need_h:
            grad_h = torch.zeros(hidden.shape, dtype=cdt, device=device) if direct_gh else torch.empty_like(
                hidden, memory_format=torch.contiguous_format
            )
        else:
            grad_h = None
        # Contiguous gradients (whatever the parameters' strides) so that tiles can be written with out=.
        grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_w else None
        grad_b = torch.empty(bias.shape, dtype=bias.dtype, device=device) if need_b else None
        # The bias gradient is only [V]: it is accumulated over every row in the compute dtype.
        gb_acc = torch.zeros(vocab, dtype=cdt, device=device) if need_b else None
        direct_gw = need_w and weight.dtype == cdt

        with _NoAutocast(device.type), torch.no_grad():
            for s0 in range(0, n, sb):
                s1 = min(s0 + sb, n)
                first_block = s0 == 0
                single_row_tile = s1 - s0 <= rt
                if direct_gh:
                    gh_block = grad_h[s0:s1]
                elif need_h:
                    gh_block = ws.get("gh", s1 - s0, hidden.shape[1], min(sb, n) * hidden.shape[1]).zero_()
                for v0 in range(0, vocab, vt):
                    v1 = min(v0 + vt, vocab)
                    cols = v1 - v0
                    w = _cast_tile(ws, "w", weight[v0:v1], inv_t, vt * size)
                    b = _bias_tile(bias, v0, v1, inv_t, cdt)
                    if g_kl is not None:
                        wr = _cast_tile(ws, "wr", ref_weight[v0:v1], inv_t, vt * ref_weight.shape[1])
                        br = _bias_tile(ref_bias, v0, v1, inv_t, cdt)
                    gw_tile = None
                    # Whether this block's first row tile overwrites gw_tile (mm out=) or adds to it.
                    overwrite_gw = False
                    if need_w:
                        if direct_gw:
                            # fp32 weights: accumulate straight into the gradient, across all blocks.
                            gw_tile = grad_w[v0:v1]
                            overwrite_gw = first_block
                        else:
                            # Low-precision weights: this block's contribution to the tile is summed
                            # in fp32 and added into the gradient once per block (see below).
                            gw_tile = ws.get("gw", cols, size, vt * size)
                            overwrite_gw = True
                        if overwrite_gw and not single_row_tile:
                            gw_tile.zero_()
                    for r0 in range(s0, s1, rt):
                        r1 = min(r0 + rt, s1)
                        rows = r1 - r0
                        h = _cast_tile(ws, "h", hidden[r0:r1], 1.0, rt * hidden.shape[1])
                        z = _logits_into(ws.get("z", rows, cols, tile_cap), h, w, b)
                        # softmax probabilities of this tile; they become d out / d z in place
                        if needs_z_after_p:
                            coef = torch.sub(z, lse[r0:r1].unsqueeze(1), out=ws.get("p", rows, cols, tile_cap)).exp_()
                        else:
                            coef = z.sub_(lse[r0:r1].unsqueeze(1)).exp_()
                        extra = None
                        if g_kl is not None:
                            hr = _cast_tile(ws, "hr", ref_hidden[r0:r1], 1.0, rt * ref_hidden.shape[1])
                            zr = _logits_into(ws.get("zr", rows, cols, tile_cap), hr, wr, br)
                            extra = zr.neg_().add_(z).sub_(mu_d[r0:r1].unsqueeze(1)).mul_(g_kl[r0:r1].unsqueeze(1))
                        if g_ent is not None:
                            # z becomes g_ent * (mu - z), reusing its storage
                            z.sub_(mu[r0:r1].unsqueeze(1)).mul_(-g_ent[r0:r1].unsqueeze(1))
                            extra = z if extra is None else extra.add_(z)
                        if extra is not None:
                            coef.mul_(extra.add_(alpha[r0:r1].unsqueeze(1)))
                        else:
                            coef.mul_(alpha[r0:r1].unsqueeze(1))
                        if uniform is not None:
                            coef.sub_(uniform[r0:r1].unsqueeze(1))
                        if g_lp is not None:
                            local = targets[r0:r1] - v0
                            in_tile = (local >= 0) & (local < cols)
                            coef.scatter_add_(
                                1,
                                local.clamp(0, cols - 1).unsqueeze(1),
                                (g_lp[r0:r1] * in_tile.to(cdt)).unsqueeze(1),
                            )
                        # coef is d out / d z; z = (h W^T + b) / T and w already holds W / T.
                        if need_h:
                            gh_block[r0 - s0 : r1 - s0].addmm_(coef, w)
                        if need_w:
                            if overwrite_gw and single_row_tile:
                                torch.mm(coef.t(), h, out=gw_tile)
                            else:
                                gw_tile.addmm_(coef.t(), h)
                        if need_b:
                            gb_acc[v0:v1] += coef.sum(0)
                    if need_w and not direct_gw:
                        if inv_t != 1.0:
                            gw_tile.mul_(inv_t)
                        # Precision trade-off: each block's fp32 tile sum is rounded once into the
                        # bf16/fp16 gradient, so a call spanning k super-blocks accumulates the weight
                        # gradient in the parameter dtype k times - exactly what gradient
                        # accumulation over k micro-batches does. One block (small N) rounds once,
                        # as an fp32 copy of the whole weight gradient is deliberately never made.
                        # add_ computes in fp32 (type promotion) and rounds once per element.
                        if first_block:
                            grad_w[v0:v1].copy_(gw_tile)
                        else:
                            grad_w[v0:v1].add_(gw_tile)
                if need_h and not direct_gh:
                    grad_h[s0:s1].copy_(gh_block)
            if direct_gw and inv_t != 1.0:
                grad_w.mul_(inv_t)
            if need_b:
                grad_b.copy_(gb_acc.mul_(inv_t) if inv_t != 1.0 else gb_acc)
        del ws

        return None, grad_h, grad_w, grad_b, None, None, None, None


def _run(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Optional[Tensor],
    temperature: float,
    chunk_size: ChunkSize,
    ignore_index: int,
    *,
    logprobs: bool = False,
    entropy: bool = False,
    self_certainty: bool = False,
    ref_hidden: Optional[Tensor] = None,
    ref_weight: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
) -> tuple[Tensor, ...]:
    # FSDP2-sharded (DTensor) head weights are gathered here, in their own dtype (ops/sharded.py).
    gathered_weight = gather_if_sharded(weight)
    ref_weight = gathered_weight if ref_weight is weight else gather_if_sharded(ref_weight)  # tied: one gather
    weight, bias, ref_bias = gathered_weight, gather_if_sharded(bias), gather_if_sharded(ref_bias)
    _check_weight_pair("hidden", hidden, "weight", weight)
    vocab, size = weight.shape
    _check_bias("bias", bias, vocab)
    _check_same_device(hidden, weight=weight, bias=bias)
    inv_t = 1.0 / _check_temperature(temperature)
    kl = ref_weight is not None
    if kl:
        _check_weight_pair("ref_hidden", ref_hidden, "ref_weight", ref_weight)
        if ref_weight.shape[0] != vocab:
            raise ValueError(
                f"`ref_weight` has vocabulary size {ref_weight.shape[0]} but `weight` has {vocab}; both heads must share a vocabulary"
            )
        if ref_hidden.shape[:-1] != hidden.shape[:-1]:
            raise ValueError(
                f"`ref_hidden` leading shape {tuple(ref_hidden.shape[:-1])} must equal `hidden` leading shape {tuple(hidden.shape[:-1])}"
            )
        _check_bias("ref_bias", ref_bias, vocab)
        _check_same_device(hidden, ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias)
    if targets is not None:
        _check_targets(targets, hidden, vocab, ignore_index)

    lead = hidden.shape[:-1]
    hidden2d = hidden.reshape(-1, size)
    ref2d = ref_hidden.reshape(-1, ref_hidden.shape[-1]) if kl else None
    targets1d = targets.reshape(-1) if targets is not None else None
    widest = max(size, ref_hidden.shape[-1]) if kl else size
    row_tile, vocab_tile = _tile_sizes(chunk_size, hidden2d.shape[0], widest, vocab, hidden.device)
    spec = _HeadSpec(
        logprobs=logprobs,
        entropy=entropy,
        self_certainty=self_certainty,
        kl=kl,
        inv_temperature=inv_t,
        row_tile=row_tile,
        vocab_tile=vocab_tile,
        ignore_index=ignore_index,
    )
    if kl:
        # The reference is a constant: its tensors enter the Function detached so that nothing
        # flows back into them, even when ref_weight is the policy's own (LoRA-shared) weight.
        ref2d = ref2d.detach()
        ref_weight = ref_weight.detach()
        ref_bias = None if ref_bias is None else ref_bias.detach()
    outs = _LinearHeadFunction.apply(spec, hidden2d, weight, bias, targets1d, ref2d, ref_weight, ref_bias)
    return tuple(o.reshape(lead) for o in outs)


# --------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: ChunkSize = None,
    ignore_index: int = -100,
) -> Tensor:
    """Log-probability of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: ``[..., H]`` final hidden states (any float dtype, any leading dims).
        weight: ``[V, H]`` LM-head weight (may be tied to the input embedding).
        targets: ``[...]`` integer token ids; positions equal to ``ignore_index`` give 0 and no gradient.
        bias: optional ``[V]`` head bias.
        temperature: logits are divided by this (> 0).
        chunk_size: ``None`` picks tiles from the shapes (and free CUDA memory); an int sets both
            the row and vocabulary tile; a ``(row_tile, vocab_tile)`` pair sets them separately.
        ignore_index: target value that marks padding.

    Returns:
        fp32 ``[...]`` log-probs (float64 for float64 inputs). Gradients come back in the inputs' dtypes.

    Raises:
        TypeError, ValueError: bad dtypes, shapes, devices, temperature, chunk size or target ids.

    Example::

        logp = linear_logprobs(hidden, model.lm_head.weight, input_ids[:, 1:])
    """
    return _run(hidden, weight, bias, targets, temperature, chunk_size, ignore_index, logprobs=True)[0]


def linear_entropy(
    hidden: Tensor,
    weight: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: ChunkSize = None,
) -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` of the next-token distribution, per position, as fp32 ``[...]``.

    Arguments are those of :func:`linear_logprobs` (no targets).

    Example::

        ent = linear_entropy(hidden, lm_head_weight).mean()
    """
    return _run(hidden, weight, bias, None, temperature, chunk_size, -100, entropy=True)[0]


def linear_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: ChunkSize = None,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor]:
    """Target log-probs and entropy in one pass over the head (cheaper than two calls).

    Both outputs are 0, with no gradient, where ``targets == ignore_index`` (padding).

    Example::

        logp, ent = linear_logprobs_and_entropy(hidden, weight, targets, temperature=0.7)
    """
    logp, ent = _run(hidden, weight, bias, targets, temperature, chunk_size, ignore_index, logprobs=True, entropy=True)
    return logp, ent


def linear_self_certainty(
    hidden: Tensor,
    weight: Tensor,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: ChunkSize = None,
) -> Tensor:
    """Self-certainty ``logsumexp(z) - mean_v(z)`` per position (the Intuitor score), fp32 ``[...]``.

    It equals ``KL(U || p) + log V`` (``U`` uniform over the vocabulary), so it is ``>= log V``
    with equality only for a flat ``p``; higher means more confident. Arguments are those of
    :func:`linear_entropy`.

    Example::

        certainty = linear_self_certainty(hidden, weight)  # [B, T]
    """
    return _run(hidden, weight, bias, None, temperature, chunk_size, -100, self_certainty=True)[0]


def linear_kl(
    hidden: Tensor,
    weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: ChunkSize = None,
    bias: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
) -> Tensor:
    """Exact per-position ``KL(pi || pi_ref)`` over the full vocabulary, fp32 ``[...]``.

    ``pi = softmax((hidden @ weight.T + bias) / T)`` and ``pi_ref`` likewise from the reference's
    hidden states and head. Gradients flow to ``hidden``, ``weight`` and ``bias`` only; the reference
    is treated as a constant (it may share ``weight``, as a LoRA policy's frozen head does).

    Example::

        with torch.no_grad(), model.disable_adapter():
            ref_hidden = decoder_hidden_states(model, input_ids)
        kl = linear_kl(hidden, weight, ref_hidden, weight)
    """
    return _run(
        hidden, weight, bias, None, temperature, chunk_size, -100,
        ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias,
    )[0]
