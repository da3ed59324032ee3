"""LM-head quantities (log-probs, entropy, self-certainty, KL, logsumexp) computed from hidden states
and the head weight tile by tile, so that no ``[tokens, vocab]`` logits tensor ever exists.

Softmax statistics are always kept in fp32 (float64 for float64 inputs). The tile matmuls follow
the ``precision`` argument (see :func:`lit_memopt.ops._head_tiles.resolve_precision`): ``"exact"``
multiplies fp32 copies of each tile; ``"fast"`` multiplies in the inputs' dtype. ``"auto"`` is
``"fast"`` for bf16/fp16 heads on devices that multiply that dtype natively (CUDA, CPUs with
AVX512-BF16/AMX) and ``"exact"`` where bf16 matmuls are emulated (AVX2-only CPUs), which is faster
there. Rows that count for nothing (``ignore_index`` targets, ``mask`` False) are dropped before the
first matmul, so prompt and padding tokens cost neither time nor memory.

This module holds the public ops, their argument handling (``run_head``) and the autograd Function;
the tiled passes themselves are in ``_head_passes.py``, the tile planning and casting in ``_head_tiles.py``.
A frozen head (``weight`` and ``bias`` needing no gradient) and scalar losses take the passes of
``_forward_grads.py`` instead, which make their gradient products in the forward; :func:`choose_pass` decides.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lit_memopt.ops._forward_grads import FORWARD_GRAD_OUTPUTS, ForwardGradientLoss, FrozenHeadFunction, block_tiles
from lit_memopt.ops._fused_tiles import row_outputs, use_fused_tiles
from lit_memopt.ops._head_passes import _SUPER_BLOCK_ROW_TILES  # noqa: F401 (tests read the block size)
from lit_memopt.ops._head_passes import (
    OUTPUTS,
    GradientsWanted,
    HeadTensors,
    RowStatistics,
    _backward_tiles,
    _forward_statistics,
    _HeadSpec,
    _NoAutocast,
    _pass_rows,
    _tile_math,
)
from lit_memopt.ops._head_tiles import MAX_TILE_ELEMENTS as _MAX_TILE_ELEMENTS  # noqa: F401 (tests read the policy)
from lit_memopt.ops._head_tiles import (
    ChunkSize,
    LogitTransform,
    check_bias,
    check_mask,
    check_positive,
    check_same_device,
    check_targets,
    check_weight_pair,
    counted_row_indices,
    is_fake,
    resolve_precision,
    target_range_error,
    targets_out_of_range,
    tile_sizes,
)
from lit_memopt.ops._whole_pass import whole_pass_vocab_tile
from lit_memopt.ops.sharded import gather_if_sharded

__all__ = [
    "linear_logprobs",
    "linear_entropy",
    "linear_logprobs_and_entropy",
    "linear_self_certainty",
    "linear_kl",
]

_tile_sizes = tile_sizes  # the tiling policy under the name tests read
# A scalar loss's share from some counted rows' outputs and their constants (see run_head).
RowLoss = Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor]

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
        tensors = HeadTensors(hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, keep)
        math_ = _tile_math(spec, tensors.rows, hidden, weight, bias, ref_hidden, ref_weight, ref_bias)
        with _NoAutocast(hidden.device.type), torch.no_grad():
            s = _forward_statistics(spec, math_, tensors)
        outputs = row_outputs(s, [name for name in OUTPUTS if spec.wants(name)])
        if "logsumexp" in outputs:
            outputs["logsumexp"] = outputs["logsumexp"].clone()  # lse is also saved for backward: not the same tensor
        ctx.spec = spec
        ctx.save_for_backward(hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, s["lse"], s.get("mu"), s.get("mu_d"), keep)
        return tuple(outputs.values())

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
        wanted = GradientsWanted(*ctx.needs_input_grad[1:4])
        need_h, need_w, need_b = wanted
        nothing = (None,) * 9
        if not (need_h or need_w or need_b) or all(g is None for g in grads):
            return nothing
        if _pass_rows(hidden, keep) == 0:  # no rows: the tile loops would leave the gradients unwritten
            zeros = lambda t, need: torch.zeros_like(t) if need else None  # noqa: E731
            return None, zeros(hidden, need_h), zeros(weight, need_w), zeros(bias, need_b), None, None, None, None, None
        grad_h, grad_w, grad_b = _backward_tiles(
            spec, grads, HeadTensors(hidden, weight, bias, targets, ref_hidden, ref_weight, ref_bias, keep),
            RowStatistics(lse, mu, mu_d), wanted)
        if need_h and keep is not None:
            # Only now, with the tile buffers gone (they died with _backward_tiles' frame), the full-size
            # gradient of all rows is made and the counted rows' gradient scattered into it.
            grad_h = torch.zeros_like(hidden, memory_format=torch.contiguous_format).index_copy_(0, keep, grad_h)
        return None, grad_h, grad_w, grad_b, None, None, None, None, None


def choose_pass(outputs: tuple[str, ...], hidden: Tensor, weight: Tensor, bias: Optional[Tensor], scalar_loss: bool) -> str:
    """The one place that picks a head call's pass: ``"loss"`` (gradients made in forward, three products or two),
    ``"frozen"`` (a frozen head's directions made in forward, no product in backward) or ``"tiled"`` (the
    recomputing pass of ``_head_passes.py``: one product without gradients, four with).

    Gradients in forward only pay where a backward will come: grad mode on and some input needing a gradient.
    A frozen head is one whose weight and bias need none while ``hidden`` does (LoRA).
    """
    need_h, need_w = hidden.requires_grad, weight.requires_grad
    need_b = bias is not None and bias.requires_grad
    if not torch.is_grad_enabled() or not (need_h or need_w or need_b) or not set(outputs) <= FORWARD_GRAD_OUTPUTS:
        return "tiled"
    if scalar_loss:
        return "loss"
    return "frozen" if need_h and not (need_w or need_b) else "tiled"


def plan_pass(outputs: tuple[str, ...], hidden: Tensor, weight: Tensor, bias: Optional[Tensor], scalar_loss: bool, *,
              transform: LogitTransform, low_precision: Optional[torch.dtype], chunk_size: ChunkSize, counted_rows: int,
              total_rows: int, hidden_size: int, weight_copied: bool, fake: bool) -> tuple[str, _HeadSpec]:
    """The one place a head call's variant is settled, for its device and shapes: ``(path, spec)``.

    ``path`` is :func:`choose_pass`'s; the spec says how its tile maths run: eagerly or compiled
    (``spec.fused``, from ``LIT_MEMOPT_FUSED_TILES`` and the device, ``_settings.py``), and for the tiled path
    whether each pass is one compiled graph (``spec.whole_pass``, ``LIT_MEMOPT_WHOLE_PASS``, one row tile only),
    with the tiles of that variant: ``tile_sizes`` for the tiled pass (the whole pass rounds its vocabulary tile,
    ``whole_pass_vocab_tile``), ``block_tiles`` for the gradient-in-forward passes (an explicit ``chunk_size``
    sets both). ``counted_rows`` reach the matmuls out of ``total_rows``; ``hidden_size`` is the wider of the
    policy's and the reference's.
    """
    vocab, device = weight.shape[0], hidden.device
    fused = use_fused_tiles(device, fake)
    row_tile, vocab_tile = tile_sizes(chunk_size, counted_rows, hidden_size, vocab, device, fast=low_precision is not None,
                                      total_rows=total_rows, fused=fused, weight_copied=weight_copied)
    path = choose_pass(outputs, hidden, weight, bias, scalar_loss)
    if path != "tiled":
        explicit = None if chunk_size is None else (row_tile, vocab_tile)
        return path, _HeadSpec(frozenset(outputs), transform, *block_tiles(explicit, counted_rows, vocab), low_precision, fused)
    whole_tile = whole_pass_vocab_tile(fused, device, counted_rows, row_tile, hidden_size, vocab, vocab_tile,
                                       explicit=chunk_size is not None)
    return path, _HeadSpec(frozenset(outputs), transform, row_tile, whole_tile or vocab_tile, low_precision, fused,
                           whole_pass=whole_tile is not None)


def run_head(hidden: Tensor, weight: Tensor, targets: Optional[Tensor], outputs: tuple[str, ...], *,
             bias: Optional[Tensor] = None, temperature: float = 1.0, chunk_size: ChunkSize = None,
             ignore_index: int = -100, mask: Optional[Tensor] = None, logit_scale: float = 1.0,
             final_logit_softcapping: Optional[float] = None, precision: str = "auto",
             ref_hidden: Optional[Tensor] = None, ref_weight: Optional[Tensor] = None,
             ref_bias: Optional[Tensor] = None, row_loss: Optional[RowLoss] = None,
             row_constants: Optional[dict[str, Tensor]] = None) -> tuple[Tensor, ...]:
    """Validate, drop rows that count for nothing, run the fused pass, and put rows back in place.

    Returns the requested ``outputs`` (names from :data:`OUTPUTS`), each fp32 with ``hidden``'s
    leading shape and 0 (no gradient) at rows excluded by ``ignore_index`` or ``mask``.

    With ``row_loss`` it returns ``(loss,)`` instead: ``row_loss(outputs, constants)`` is the (differentiable)
    scalar share of the loss of some counted rows, given their outputs and their slices of ``row_constants``
    (tensors of ``hidden``'s leading shape). Which pass runs is :func:`choose_pass`'s decision.
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
        check_targets(targets, hidden)
    mask = check_mask(mask, hidden)
    low_precision = resolve_precision(precision, hidden, weight, bias, *((ref_hidden, ref_weight, ref_bias) if kl else ()))

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
    if valid is not None and not is_fake(valid):
        # What the plan needs from the data, read in one host sync (on a GPU each sync stalls the
        # host until the queued kernels finish): how many rows count, and whether a target is
        # outside the vocabulary (checked on every row, counted or not).
        facts = [valid.sum()]
        if flat_targets is not None:
            facts.append(targets_out_of_range(flat_targets, vocab, ignore_index).any().long())
        counted_rows, *bad = torch.stack(facts).tolist()
        if bad and bad[0]:
            raise target_range_error(flat_targets, vocab, ignore_index)
        if counted_rows < valid.numel():
            # Only the rows that count reach the matmuls: the pass gathers them tile by tile and
            # scatters their hidden gradient back (the rest get exact zeros), so neither a compacted
            # copy of them nor of their gradient ever exists. The count is known, so finding them
            # needs no second sync.
            keep = counted_row_indices(valid, counted_rows)
    if flat_targets is not None:  # then `valid` is set too
        flat_targets = torch.where(valid, flat_targets, 0)
        if keep is not None:
            flat_targets = flat_targets.index_select(0, keep)
    widest = max(size, ref_hidden.shape[-1]) if kl else size
    counted = rows.shape[0] if keep is None else keep.shape[0]
    # Under autocast an fp32 weight is copied into the matmul dtype tile by tile: those copies count as tiles.
    weight_copied = low_precision is not None and any(w is not None and w.dtype != low_precision for w in (weight, ref_weight))
    path, spec = plan_pass(outputs, hidden, weight, bias, row_loss is not None, transform=transform,
                           low_precision=low_precision, chunk_size=chunk_size, counted_rows=counted,
                           total_rows=rows.shape[0], hidden_size=widest, weight_copied=weight_copied, fake=is_fake(rows))
    constants = {}
    for name, t in (row_constants or {}).items():
        flat = t.reshape(-1)
        constants[name] = flat if keep is None else flat.index_select(0, keep)
    if path != "tiled":
        if path == "loss":
            share = lambda r0, r1, out: row_loss(out, {k: v[r0:r1] for k, v in constants.items()})  # noqa: E731
            return (ForwardGradientLoss.apply(spec, share, rows, weight, bias, flat_targets, keep),)
        results = FrozenHeadFunction.apply(spec, rows, weight, bias, flat_targets, keep)
    else:
        results = _LinearHeadFunction.apply(spec, rows, weight, bias, flat_targets, ref_rows, ref_weight, ref_bias, keep)
    by_name = dict(zip([o for o in OUTPUTS if o in outputs], results))
    if row_loss is not None:  # the tiled pass's outputs of the counted rows, through the same loss maths
        return (row_loss(by_name, constants),)
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

def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Optional[Tensor] = None,
                    temperature: float = 1.0, chunk_size: ChunkSize = None, ignore_index: int = -100,
                    mask: Optional[Tensor] = None, logit_scale: float = 1.0,
                    final_logit_softcapping: Optional[float] = None, precision: str = "auto") -> Tensor:
    """Log-probability of ``targets`` under ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / temperature)``.

    Args:
        hidden: ``[..., H]`` final hidden states (any float dtype, any leading dims; a DTensor weight is gathered).
        weight: ``[V, H]`` LM-head weight (may be tied to the input embedding, may be an FSDP2 DTensor).
        targets: ``[...]`` integer token ids; positions equal to ``ignore_index`` give 0 and no gradient.
        ignore_index: target value that marks padding.
        bias: optional ``[V]`` head bias.
        temperature: logits are divided by this (> 0), after the softcap.
        chunk_size: ``None`` picks tiles from the shapes (and free CUDA memory); an int sets both
            the row and vocabulary tile; a ``(row_tile, vocab_tile)`` pair sets them separately.
        mask: optional bool ``[...]``; rows where it is False give 0, get no gradient and are never multiplied.
        logit_scale: raw logits are multiplied by this (> 0) first (Cohere/Granite-style heads).
        final_logit_softcapping: ``cap`` (> 0) applies ``cap * tanh(z / cap)`` (Gemma-style); ``None`` for none.
        precision: ``"exact"`` multiplies fp32 tiles; ``"fast"`` multiplies bf16/fp16 tiles (fp32
            accumulation on CUDA, logits rounded to the input dtype on the CPU) with fp32 softmax
            statistics; ``"auto"`` (default) is ``"fast"`` when the head tensors share a bf16/fp16 dtype
            that the device multiplies natively (CUDA; CPUs with AVX512-BF16/AMX), else ``"exact"``.
            Under ``torch.autocast`` to bf16/fp16 (``"bf16-mixed"``), fp32 inputs count as the autocast
            dtype: their tiles are cast to it, and their gradients stay fp32.
            On CUDA each tile's softmax maths run as kernels compiled by ``torch.compile`` (the first
            call compiles them; ``LIT_MEMOPT_FUSED_TILES=0`` keeps them eager, ``=1`` compiles them on a CPU too).
            On CUDA each pass of a call with one row tile is one compiled graph over all its vocabulary tiles
            (faster for small calls; ``LIT_MEMOPT_WHOLE_PASS=0`` calls the compiled tile kernels tile by tile).
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

