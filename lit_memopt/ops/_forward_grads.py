"""Head passes that do their gradient work in the forward, while each logits tile is live.

A per-token head output whose upstream gradient arrives only in backward costs four head products when the
``[N, V]`` logits are never held: the logits, then in backward the recomputed logits, the hidden gradient and the
weight gradient (``_head_passes.py``). Two common cases need fewer, and this pass serves both:

* **Frozen head** (LoRA: ``weight.requires_grad`` is False). The hidden gradient of each output is
  ``g_row * D_row`` with a direction ``D = sum_v c_v s_v W_v`` fixed once the row's softmax is known
  (``c = onehot - p`` for a log-prob, ``p (mu - z)`` for entropy, ``p - 1/V`` for self-certainty, ``p`` for
  logsumexp; ``s = dz/draw`` carries temperature, softcap and logit scale). The forward multiplies once for the
  logits and once per output kind for its direction; backward only scales the directions: no product.
* **Scalar losses** (cross-entropy; the policy losses on hidden states). The upstream gradient of every row is
  known in forward, so the hidden and weight gradients are made there: three products, and backward scales them
  by ``grad_output``.

Both need each row's whole softmax before any gradient, so the pass walks the rows in blocks and holds one
block's logits over the whole vocabulary (``[block rows, V]`` in the statistics dtype; Liger's chunked losses do
the same). The per-tile maths are the pure functions of ``_fused_tiles.py`` that the other passes use
(``fold_tile``, ``tile_logit_gradient``): compiled on CUDA, eager elsewhere; nothing here restates them. Where
nothing needs the logits after the softmax (:func:`holds_probabilities`), the eager pass overwrites the held
block with its softmax numerators and builds the gradient from them in place (``softmax_numerators_``,
``numerator_gradient_``, and each row's target term scattered in by ``add_target_term_``): one exponential per
logit instead of two, no tile temporaries, and no ``rows x hidden`` work for the target term. On one CPU thread the
float32 SFT loss at 2048 x 512 x 32000 then took 2.61 s, against 3.13 s for Cut Cross-Entropy and 2.83 s for three
bare head products (``benchmarks/results/peers_cpu_float32_cross_entropy_frozen_logprobs_time_only.md``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from lit_memopt.ops._fused_tiles import (
    _fold_tile,
    _tile_logit_gradient,
    add_target_term_,
    finish_rows,
    fold_tile,
    numerator_gradient_,
    row_outputs,
    softmax_numerators_,
    start_rows,
    tile_logit_gradient,
)
from lit_memopt.ops._head_passes import OUTPUTS, _HeadSpec, _pass_rows, _row_tile, _RowGradients, _tile_math
from lit_memopt.ops._head_tiles import TILE_ALIGN, is_fake, tile_starts

# Outputs whose hidden gradient is a fixed-weight vocabulary sum once the row's softmax is known. KL is not one
# of them here: its reference tile would have to be held as well.
FORWARD_GRAD_OUTPUTS = frozenset({"logprobs", "entropy", "self_certainty", "logsumexp"})
# A block's logits [rows, V] are at most this many elements (64 MiB in fp32), but never fewer rows than
# MIN_BLOCK_ROWS where the call has them: each block adds a rank-`rows` update to every row of the weight gradient,
# which is memory-bound below about a hundred rows. At the Qwen3-4B head (V = 151936) that is 110 rows, 64 MiB,
# against 4.6 GiB for the [8192, V] bf16 logits a naive step holds (1.4%).
BLOCK_ELEMENTS = 1 << 24
MIN_BLOCK_ROWS = 64
# Vocabulary tiles inside a block: the tile maths' temporaries are [rows, tile], kept cache-sized.
STAT_TILE_ELEMENTS = 1 << 20

# One block's coefficient sets (``_RowGradients``), from its per-row outputs; see :func:`forward_gradient_pass`.
Coefficients = Callable[[int, int, dict[str, Tensor]], list[_RowGradients]]


def block_tiles(explicit: Optional[tuple[int, int]], rows: int, vocab: int) -> tuple[int, int]:
    """``(block rows, vocabulary tile)``: an explicit ``chunk_size`` pair sets both; else from the budgets above."""
    if explicit is not None:
        return explicit
    align = lambda n: n if n <= TILE_ALIGN else n - n % TILE_ALIGN  # noqa: E731
    block = align(max(1, min(max(rows, 1), max(BLOCK_ELEMENTS // vocab, MIN_BLOCK_ROWS))))
    return block, align(max(1, min(vocab, STAT_TILE_ELEMENTS // block)))


def product_count(outputs: frozenset, *, frozen: bool, need_h: bool = True, need_w: bool = False) -> int:
    """Head-sized products of one forward-gradient call (its floor): the logits, then one per direction (frozen)
    or one per gradient made (scalar loss). The benchmark prints it beside the time."""
    if frozen:
        return 1 + len(outputs & FORWARD_GRAD_OUTPUTS)
    return 1 + int(need_h) + int(need_w)


def holds_probabilities(spec: _HeadSpec, sets: int) -> bool:
    """Whether a block's logits may be overwritten by their softmax numerators (:func:`softmax_numerators_`):
    one exponential per logit instead of two, no tile temporaries.

    Where the tile maths run eagerly (the compiled tiles fuse their exponentials already), and where nothing
    needs ``z`` after the softmax: no softcap (its chain rule reads ``z``), no entropy (``p (mu - z)``), and one
    coefficient set (several would each need the numerators). That is cross-entropy with any label smoothing and
    z-loss, the policy losses, and a frozen head's log-probs.
    """
    return not spec.fused and spec.transform.softcap is None and not spec.wants("entropy") and sets == 1


def forward_gradient_pass(spec: _HeadSpec, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                          targets: Optional[Tensor], keep: Optional[Tensor], coefficients: Coefficients, *,
                          sets: int, need_h: bool, need_w: bool, need_b: bool
                          ) -> tuple[dict[str, Tensor], list[Tensor], Optional[Tensor], Optional[Tensor]]:
    """One pass over the counted rows (all, or ``keep``): per-row outputs, and the products of each row's logit
    gradient with the head.

    ``coefficients(r0, r1, outputs)`` turns a block's per-row outputs into ``sets`` coefficient sets
    (``_RowGradients``: which ``d out / d z`` the block's rows carry). Set ``k``'s logit gradient times ``W`` is
    hidden product ``k`` (``[counted rows, H]`` in ``hidden``'s dtype; none without ``need_h``); set 0's also
    gives the weight gradient (``need_w``, ``weight``'s dtype) and bias gradient (``need_b``, statistics dtype).
    Returns ``(outputs, hidden products, grad_weight, grad_bias)``. Runs under ``no_grad`` with autocast off.
    """
    n, vocab, size = _pass_rows(hidden, keep), weight.shape[0], weight.shape[1]
    math_ = _tile_math(spec, n, hidden, weight, bias)
    stat, device, transform = math_.stat_dtype, hidden.device, spec.transform
    # The one choice of how the tile maths run (compiled or eager) is the spec's, as in the other passes.
    fold, gradient = (fold_tile, tile_logit_gradient) if spec.fused else (_fold_tile, _tile_logit_gradient)
    held = holds_probabilities(spec, sets)
    stat_bias = None if bias is None else bias.to(stat)
    rb, vt = spec.row_tile, spec.vocab_tile
    values = not is_fake(hidden)
    tiles = [(v0, min(v0 + vt, vocab)) for v0 in tile_starts(0, vocab, vt, values=values)]
    outputs = {name: hidden.new_zeros(n, dtype=stat) for name in OUTPUTS if spec.wants(name)}
    products = [torch.empty((n, size), dtype=hidden.dtype, device=device) for _ in range(sets)] if need_h else []
    # Contiguous, whatever the parameter's strides, so that vocabulary tiles are row slices of it. The first
    # block's products overwrite it (no fill); zeros where there is no block.
    grad_w = None
    if need_w:
        grad_w = (torch.empty if n else torch.zeros)(weight.shape, dtype=weight.dtype, device=device)
    grad_b = torch.zeros(vocab, dtype=stat, device=device) if need_b else None
    for r0 in tile_starts(0, n, rb, values=values):
        r1 = min(r0 + rb, n)
        rows = r1 - r0
        h = _row_tile(math_, "h", hidden, keep, r0, r1)
        z = math_.ws.get("z_block", rows, vocab, min(rb, n) * vocab, stat)
        for v0, v1 in tiles:
            math_.logits("z", h, math_.operand("w", weight[v0:v1], vt), stat_bias, v0, v1, out=z[:, v0:v1])
        block_targets = None if targets is None else targets[r0:r1]
        # The held block makes the target logit one gather.
        target_z = None if block_targets is None else z.gather(1, block_targets.unsqueeze(1)).squeeze(1)
        if held:
            sum_z = z.sum(1) if spec.wants("self_certainty") else None
            row_max, sums = softmax_numerators_(z, tiles)  # z now holds exp(z - max)
            stats = finish_rows(row_max, sums, None, sum_z, target_z, None, None, None, vocab)
        else:
            state = start_rows(rows, stat, device, entropy=spec.wants("entropy"),
                               self_certainty=spec.wants("self_certainty"), logprobs=False, kl=False)
            for v0, v1 in tiles:
                state = fold(z[:, v0:v1], None, *state[:4], None, None, v0, None, None, None)
            stats = finish_rows(*state, vocab)
            if target_z is not None:
                stats["target_z"] = target_z
        lse = stats["lse"]
        block = row_outputs(stats, outputs)
        for name, out in outputs.items():
            out[r0:r1] = block[name]
        coeff_sets = coefficients(r0, r1, block)
        # Each accumulator is overwritten by its first vocabulary tile's product: no fill.
        accs = [math_.ws.get(f"gh{k}", rows, size, min(rb, n) * size, stat) for k in range(sets)] if need_h else []
        if held:
            (c,) = coeff_sets
            # p * alpha - uniform over the numerators e = p * sum, chained to raw once per row, not per logit.
            row_scale = transform.chain_((c.alpha / sums).unsqueeze(1), None, None)
            row_shift = None if c.uniform is None else transform.chain_(c.uniform.unsqueeze(1).clone(), None, None)
            # The target's one-hot term goes into the held block, before the products carry it to the gradients.
            at_target = None if c.g_lp is None else transform.chain_(c.g_lp.unsqueeze(1).clone(), None, None)
        for v0, v1 in tiles:
            w = math_.operand("w", weight[v0:v1], vt)
            for k, c in enumerate(coeff_sets):
                weight_set = k == 0 and (need_w or need_b)
                if not (need_h or weight_set):
                    continue
                # Unless the block holds probabilities (then it is scattered into the tile above), the target's
                # one-hot term is left out of the tile (the tile maths would take a pass over it to find one column
                # per row) and added below, from the target's logit and row of W.
                if held:
                    grad_raw = numerator_gradient_(z[:, v0:v1], row_scale, row_shift)
                    if at_target is not None:
                        add_target_term_(grad_raw, block_targets, at_target, v0, v1, vocab)
                    operand = math_.grad_operand(grad_raw)
                    column_sums = grad_raw.sum(0) if need_b else None
                else:
                    operand, column_sums = gradient(
                        z[:, v0:v1], None, lse, stats.get("mu") if c.g_ent is not None else None, None, c.alpha,
                        c.g_ent, None, c.uniform, None, None, v0,
                        transform.softcap, transform.linear_scale, transform.inv_temperature, math_.matmul_dtype,
                        need_b and k == 0)
                if need_h:
                    math_.accumulate("gh_p", accs[k], operand, w, overwrite=v0 == 0)
                if need_w and k == 0:
                    first = r0 == 0
                    if grad_w.dtype == stat:
                        math_.accumulate("gw_p", grad_w[v0:v1], operand.t(), h, overwrite=first)
                    elif first:  # a bf16/fp16 weight: each block's product is rounded once into it, as micro-batches would
                        grad_w[v0:v1].copy_(torch.mm(operand.t(), h))
                    else:
                        grad_w[v0:v1] += torch.mm(operand.t(), h)
                if need_b and k == 0:
                    grad_b[v0:v1] += column_sums
        for k, c in enumerate(coeff_sets):
            if c.g_lp is None or held:  # held: the term is in the block already
                continue
            # d logprob / d raw at the target: g_lp times dz/draw there (the same chain rule as every tile's).
            at_target = transform.chain_(c.g_lp.unsqueeze(1).clone(), target_z.unsqueeze(1), None)
            if need_h:
                accs[k].add_(weight.index_select(0, block_targets).to(stat).mul_(at_target))
            if need_w and k == 0:
                grad_w.index_add_(0, block_targets, (h.to(stat) * at_target).to(grad_w.dtype))
            if need_b and k == 0:
                grad_b.index_add_(0, block_targets, at_target.squeeze(1))
        for product, acc in zip(products, accs):
            product[r0:r1].copy_(acc)
    return outputs, products, grad_w, grad_b


def unit_coefficients(spec: _HeadSpec, vocab: int, stat: torch.dtype, device: torch.device) -> Coefficients:
    """One coefficient set per requested output, each with upstream gradient 1: the frozen head's directions."""
    names = [name for name in OUTPUTS if spec.wants(name)]

    def coefficients(r0: int, r1: int, block: dict[str, Tensor]) -> list[_RowGradients]:
        ones = torch.ones(r1 - r0, dtype=stat, device=device)
        return [_RowGradients.from_upstream(spec, tuple(ones if other == name else None for other in names),
                                            r1 - r0, vocab, stat, device) for name in names]

    return coefficients


def loss_coefficients(spec: _HeadSpec, vocab: int, stat: torch.dtype, device: torch.device,
                      row_loss: Callable[[int, int, dict[str, Tensor]], Tensor], parts: list[Tensor]) -> Coefficients:
    """The one coefficient set of a scalar loss: ``row_loss(r0, r1, outputs)`` is the block's (differentiable)
    share of the loss; its gradients with respect to the block's outputs, by autograd on ``[rows]``-sized
    tensors, are the upstream gradients. Each block's share is appended to ``parts``."""
    names = [name for name in OUTPUTS if spec.wants(name)]

    def coefficients(r0: int, r1: int, block: dict[str, Tensor]) -> list[_RowGradients]:
        with torch.enable_grad():
            leaves = {name: block[name].detach().requires_grad_() for name in names}
            share = row_loss(r0, r1, leaves)
            grads = torch.autograd.grad(share, [leaves[name] for name in names], allow_unused=True)
        parts.append(share.detach())
        return [_RowGradients.from_upstream(spec, tuple(grads), r1 - r0, vocab, stat, device)]

    return coefficients


def _no_double_backward() -> None:
    if torch.is_grad_enabled():
        # create_graph=True: these backwards are not themselves differentiable (as _LinearHeadFunction's).
        raise RuntimeError("lit_memopt linear-head ops support a single backward pass; double backward / "
                           "autograd.grad(create_graph=True) is not supported. Use the plain log_softmax path.")


class FrozenHeadFunction(torch.autograd.Function):
    """Per-row head outputs whose backward is ``sum_k g_k * D_k``: the directions ``D_k`` of the frozen head
    (no gradient to ``weight`` or ``bias``) are made in forward, one product each."""

    @staticmethod
    def forward(ctx, spec: _HeadSpec, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],  # type: ignore[override]
                targets: Optional[Tensor], keep: Optional[Tensor]):
        ctx.set_materialize_grads(False)
        stat = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        coefficients = unit_coefficients(spec, weight.shape[0], stat, hidden.device)
        sets = sum(1 for name in OUTPUTS if spec.wants(name))
        with torch.no_grad():
            outputs, directions, _, _ = forward_gradient_pass(spec, hidden, weight, bias, targets, keep, coefficients,
                                                              sets=sets, need_h=True, need_w=False, need_b=False)
        # Attributes, not saved tensors: they are neither inputs nor outputs, and die with the graph.
        ctx.directions, ctx.stat = directions, stat
        ctx.save_for_backward(hidden, keep)
        return tuple(outputs.values())

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        _no_double_backward()
        hidden, keep = ctx.saved_tensors
        grad = None
        for g, direction in zip(grads, ctx.directions):
            if g is not None:
                term = direction.to(ctx.stat) * g.to(ctx.stat).unsqueeze(1)
                grad = term if grad is None else grad.add_(term)
        if grad is None:
            return (None,) * 6
        grad = grad.to(hidden.dtype)
        if keep is not None:
            grad = torch.zeros_like(hidden, memory_format=torch.contiguous_format).index_copy_(0, keep, grad)
        return None, grad, None, None, None, None


class ForwardGradientLoss(torch.autograd.Function):
    """A scalar loss of per-row head outputs whose gradients are made in forward; backward scales them."""

    @staticmethod
    def forward(ctx, spec: _HeadSpec, row_loss: Callable[[int, int, dict[str, Tensor]], Tensor],  # type: ignore[override]
                hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Optional[Tensor], keep: Optional[Tensor]):
        need_h, need_w, need_b = ctx.needs_input_grad[2:5]
        stat = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        parts: list[Tensor] = []
        coefficients = loss_coefficients(spec, weight.shape[0], stat, hidden.device, row_loss, parts)
        with torch.no_grad():
            _, products, grad_w, grad_b = forward_gradient_pass(spec, hidden, weight, bias, targets, keep, coefficients,
                                                                sets=1, need_h=need_h, need_w=need_w, need_b=need_b)
        grad_h = products[0] if need_h else None
        if grad_h is not None and keep is not None:
            grad_h = torch.zeros_like(hidden, memory_format=torch.contiguous_format).index_copy_(0, keep, grad_h)
        # Held on the context, so they live exactly as long as the graph: a micro-batch whose step fails (an OOM
        # retry drops its loss) frees them with it, and two forwards before a backward keep one set each.
        ctx.grads = (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype))
        return torch.stack(parts).sum() if parts else hidden.new_zeros((), dtype=stat)

    @staticmethod
    def backward(ctx, grad_output: Optional[Tensor]):
        _no_double_backward()
        if ctx.grads is None:
            raise RuntimeError("lit_memopt: the gradients of a fused loss were handed out by an earlier backward; "
                               "backward through it twice (retain_graph=True) is not supported")
        grads, ctx.grads = ctx.grads, None
        # Scaled in place: the stored gradients are handed out once, so no copy of them is needed.
        scaled = [None if g is None else g.mul_(grad_output) for g in grads]
        return None, None, *scaled, None, None
