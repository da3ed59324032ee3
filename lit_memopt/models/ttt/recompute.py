"""Activation checkpointing for TTT layers: recompute a whole layer (or a block's conv + TTT half,
or a group of scan steps) in backward, bit-identically to the plain call."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["Recomputed", "recompute_in_backward"]


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The caller's autocast setting for ``device_type``, to re-enter it in backward."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return {"device_type": device_type if torch.amp.is_autocast_available(device_type) else "cpu", "enabled": False}
    return {"device_type": device_type, "dtype": torch.get_autocast_dtype(device_type), "enabled": True}


class Recomputed(torch.autograd.Function):
    """Activation checkpointing without saved-tensor hooks, for a whole TTT layer (or a block's
    conv + TTT half) and for a group of scan steps.

    ``Recomputed.apply(fn, num_args, *args, *params)``: forward runs ``fn(*args)`` without
    recording (autograd functions' forwards never record) and saves only ``args``. Backward runs
    ``fn`` again with autograd on (under the forward's autocast setting), then ``torch.autograd.grad``
    of that with the incoming gradients, with respect to ``args`` and ``params`` (the parameters
    ``fn`` uses). The recomputation builds the same graph the plain call builds, so the gradients
    are bit-identical. Compared with ``torch.utils.checkpoint`` this skips a Python hook per saved
    tensor and records nothing in forward. Outputs that get no gradient (an unused final scan
    state) are left out of backward, as without checkpointing.
    """

    @staticmethod
    def forward(ctx, fn: Callable[..., Any], num_args: int, *tensors: torch.Tensor):
        args = tensors[:num_args]
        ctx.fn, ctx.params = fn, tensors[num_args:]
        ctx.autocast = _autocast_state(args[0].device.type)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*args)
        # detached: a view of an input made here would claim to require grad without a grad_fn,
        # which module hooks that watch inputs (e.g. MemTracker's) reject
        return fn(*(a.detach() for a in args))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        needs = ctx.needs_input_grad[2:]
        args = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            outputs = ctx.fn(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        inputs = (*args, *ctx.params)
        wanted = [t for t, need in zip(inputs, needs) if need]
        if not pairs or not wanted:
            return (None, None, *(None for _ in inputs))
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return (None, None, *(next(got) if need else None for need in needs))


def recompute_in_backward(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, modules: Sequence[nn.Module | None]
) -> torch.Tensor:
    """``fn(x)`` with activation checkpointing: nothing but ``x`` is kept for backward, which
    runs ``fn`` again with autograd on and back-propagates through it. ``modules`` are the
    modules ``fn`` uses: their parameters get their gradients. Bit-identical to ``fn(x)``."""
    params = tuple(p for m in modules if m is not None for p in m.parameters() if p.requires_grad)
    if not (x.requires_grad or params):
        return fn(x)
    return Recomputed.apply(fn, 1, x, *params)
