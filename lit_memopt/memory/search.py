"""Fitting a batch into memory: the largest micro-batch whose predicted peak fits, and memory sizes from text."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lit_memopt._compat.lightning import attached_trainer
from lit_memopt._compat.torch import FakeTensorMode
from lit_memopt.memory.batch import batch_geometry, resize_batch
from lit_memopt.memory.step import estimate_peak

__all__ = ["BatchFit", "largest_micro_batch", "usable_bytes", "initial_micro_batch_from_estimate", "parse_memory_size", "DEFAULT_SAFETY_MARGIN"]

# Share of the device kept free for what the allocator model does not see (see the README's "Will it fit?").
DEFAULT_SAFETY_MARGIN = 0.1
# Instance attributes that Lightning or a callback may have put on a module (wrappers bound to the
# real module); a fake copy must use its class's methods instead.
_HOOK_NAMES = (
    "training_step", "backward", "optimizer_step", "optimizer_zero_grad", "log", "log_dict",
    "optimizers", "lr_schedulers", "manual_backward", "toggle_optimizer", "untoggle_optimizer", "clip_gradients",
)


@dataclass
class BatchFit:
    """The outcome of :func:`largest_micro_batch`.

    Attributes:
        micro_batch_size: largest batch whose peak fits (0: not even one row fits).
        usable_bytes: the memory the peak had to fit in (after the safety margin and resident bytes).
        peak_bytes: predicted peak at ``micro_batch_size`` (``None`` when 0).
        next_peak_bytes: predicted peak at ``micro_batch_size + 1`` (``None`` when the search hit ``max_batch_size``).
        probes: batch size -> peak of every step that was run.
    """

    micro_batch_size: int
    usable_bytes: int
    peak_bytes: int | None
    next_peak_bytes: int | None
    probes: dict[int, int] = field(default_factory=dict)


def usable_bytes(memory_bytes: int, safety_margin: float) -> int:
    """What a step may take of ``memory_bytes`` after the safety margin: the budget every fit is judged on, and the
    device size the allocator model releases its cache at (``estimate_peak``'s ``device_bytes``)."""
    return int(memory_bytes * (1.0 - float(safety_margin)))


def largest_micro_batch(
    peak_for: Callable[[int], int],
    memory_bytes: int,
    *,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    resident_bytes: int = 0,
    max_batch_size: int = 1 << 16,
) -> BatchFit:
    """The largest batch size ``b`` with ``peak_for(b) - resident_bytes <= memory_bytes * (1 - safety_margin)``.

    ``peak_for`` is usually a fake-tensor estimate (seconds per call at real scale), so the search
    keeps calls few: the peak is close to affine in the batch size, so each guess is the
    secant through the two nearest probes, kept strictly inside the bracket of known
    fitting/not-fitting sizes (bisection when the secant stalls). The answer is exact for a
    peak that grows with the batch: ``b`` was run and fits, ``b + 1`` was run and does not.

    Args:
        peak_for: batch size -> predicted peak bytes (non-decreasing in the batch size).
        memory_bytes: the memory to fit in (a device's size, or what is free of it).
        safety_margin: share of ``memory_bytes`` kept free for what tensors do not show (CUDA
            context, allocator rounding and fragmentation, kernels' workspaces). In ``[0, 1)``.
        resident_bytes: bytes already held on the device that ``peak_for`` also counts (a loaded
            model when ``memory_bytes`` is the free memory).
        max_batch_size: the search stops here.

    Raises:
        ValueError: a non-positive ``memory_bytes``/``max_batch_size`` or a margin outside ``[0, 1)``.
    """
    if not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise ValueError(f"largest_micro_batch: memory_bytes must be a positive int, got {memory_bytes!r}")
    if not 0.0 <= float(safety_margin) < 1.0:
        raise ValueError(f"largest_micro_batch: safety_margin must be in [0, 1), got {safety_margin!r}")
    if max_batch_size < 1:
        raise ValueError(f"largest_micro_batch: max_batch_size must be >= 1, got {max_batch_size!r}")
    usable = usable_bytes(memory_bytes, safety_margin)
    probes: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in probes:
            probes[b] = int(peak_for(b))
        return probes[b] - resident_bytes <= usable

    if not fits(1):
        return BatchFit(0, usable, None, probes[1], probes)
    lo, hi = 1, None  # lo fits; hi (when known) does not
    while hi is None or hi - lo > 1:
        if hi is None and lo >= max_batch_size:
            break
        guess, on_line = _secant_guess(probes, lo, hi, usable + resident_bytes)
        if hi is None:
            # do not trust a line far beyond the probes; a flat peak (e.g. the optimizer step
            # dominating small batches) grows the batch geometrically instead
            guess = min(max(guess, lo + 1), lo * 8, max_batch_size)
        else:
            guess = min(max(guess, lo + 1), hi - 1)
            # a stalled secant (probes near a bracket end) falls back to bisection
            if guess in probes or (hi - lo > 4 and min(guess - lo, hi - guess) < (hi - lo) // 8):
                guess, on_line = (lo + hi) // 2, False
        if fits(guess):
            lo = guess
            # a guess from the line is usually the answer itself: settle it with one more probe
            if on_line and (hi is None or guess + 1 < hi) and guess + 1 <= max_batch_size:
                if fits(guess + 1):
                    lo = guess + 1
                else:
                    hi = guess + 1
        else:
            hi = guess
    return BatchFit(lo, usable, probes.get(lo), probes.get(lo + 1), probes)


def _secant_guess(probes: dict[int, int], lo: int, hi: int | None, target: int) -> tuple[int, bool]:
    """Where the line through the probes nearest the bracket reaches ``target``, and whether a line was used."""
    sizes = sorted(probes)
    below = [b for b in sizes if b <= lo]
    b1 = below[-1]
    b2 = hi if hi is not None else (below[-2] if len(below) >= 2 else None)
    if b2 is None:
        return 2 * lo, False
    p1, p2 = probes[b1], probes[b2]
    slope = (p2 - p1) / (b2 - b1) if b2 != b1 else 0.0
    if slope <= 0:
        return (4 * lo, False) if hi is None else ((lo + hi) // 2, False)
    return int(math.floor(b1 + (target - p1) / slope)), True


def initial_micro_batch_from_estimate(
    trainer: Any,
    pl_module: Any,
    batch: Any,
    free_bytes: int,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    *,
    optimizer_foreach: bool | None = None,
) -> int:
    """The micro-batch size to start training with: the largest slice of ``batch`` whose step fits in ``free_bytes``.

    For ``OOMRecovery(initial_micro_batch_size="estimate")``. ``pl_module`` (real weights,
    already on the device) is copied under fake tensors, so the search allocates no device
    memory and leaves the module, its optimizers and the trainer untouched. Micro-batches smaller
    than the batch are estimated with gradients live from the start (they accumulate across
    micro-batches). ``free_bytes`` is what the device has free now; the module's parameters,
    buffers and existing gradients/optimizer states are already resident and are not counted
    twice. Returns a size in ``[1, len(batch)]``; 1 when even one row does not fit (the run will
    then meet OOMRecovery's own limits).

    Raises:
        EstimateError: the module's training step cannot run on fake tensors.
    """
    from lit_memopt.memory.budget import storage_bytes

    rows, _ = batch_geometry(batch)
    if rows is None or rows < 1:
        raise ValueError("initial_micro_batch_from_estimate: cannot tell the batch's size (no tensor or list of samples)")
    real_optimizers = list(getattr(trainer, "optimizers", None) or []) if trainer is not None else []
    resident = storage_bytes(pl_module, *real_optimizers)
    was_training = pl_module.training

    clone = _fake_copy(pl_module, trainer)

    def peak_for(b: int) -> int:
        micro = resize_batch(batch, batch_size=b)
        est = estimate_peak(clone, micro, optimizer_foreach=optimizer_foreach, accumulating=b < rows)
        return est.peak_bytes

    try:
        fit = largest_micro_batch(peak_for, int(free_bytes), safety_margin=safety_margin, resident_bytes=resident, max_batch_size=rows)
    finally:
        pl_module.train(was_training)
    return max(1, min(fit.micro_batch_size, rows))


def _fake_copy(pl_module: Any, trainer: Any) -> Any:
    """A deep copy of ``pl_module`` whose parameters and buffers are fake: same shapes, dtypes, devices; no memory."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    for shared in (trainer, attached_trainer(pl_module), getattr(pl_module, "tokenizer", None)):
        if shared is not None:
            memo[id(shared)] = shared
    # Pre-filled copies: deepcopy then never touches the real storages (tied weights stay tied).
    for _, p in pl_module.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for _, b in pl_module.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            memo[id(b)] = mode.from_tensor(b)
    clone = copy.deepcopy(pl_module, memo)
    for name in _HOOK_NAMES:
        if callable(clone.__dict__.get(name)):
            del clone.__dict__[name]
    return clone



_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}


def parse_memory_size(value: Any, *, key: str = "gpu_memory") -> int:
    """Bytes from ``80GiB``, ``80GB`` (10^9), ``80G`` (= GiB), ``24000MiB`` or a plain number of bytes.

    Raises:
        ValueError: unparsable text, an unknown unit or a non-positive size (the message names ``key``).
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not a memory size; use e.g. {key}=80GiB")
    if isinstance(value, (int, float)):
        size = float(value)
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{key}={value!r} is not a memory size; use a number with a unit: "
                "80GiB, 80GB (10^9 bytes), 80G (GiB), 24000MiB, or bytes"
            )
        size = float(match.group(1)) * _UNITS[unit]
    if size <= 0:
        raise ValueError(f"{key} must be positive, got {value!r}")
    return int(size)


