"""Peak-memory measurement of any computation under fake tensors: real shapes, no memory, no GPU.

``fake_mode()`` makes every tensor created inside it a ``FakeTensor``; ``peak_during(fn)`` runs ``fn`` under PyTorch's ``MemTracker`` and reports the
peak of live tensor bytes (with the pack's one tracker, ``memory.tracker.StepTracker``), what was already live when it started, and the difference.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from lit_memopt._compat.torch import FakeTensor, FakeTensorMode, FastFakeTensorMode
from lit_memopt.memory.tracker import StepTracker
from lit_memopt.memory.tracker import snapshot_categories as _categories
from lit_memopt.memory.tracker import snapshot_total as _total

GIB = 1024**3


@contextlib.contextmanager
def fake_mode(*, allow_non_fake_inputs: bool = False) -> Iterator[FakeTensorMode]:
    """Enter ``FakeTensorMode``: tensors and modules built inside have shapes and dtypes but no storage.

    Build fake tensors on the CPU device: byte counts do not depend on the device, and on a
    CPU-only PyTorch build autograd aborts the process on fake CUDA tensors.

    The mode is a :class:`~lit_memopt._compat.torch.FastFakeTensorMode`: torch's fake mode with a cheaper
    dispatch-cache key (the same outputs).
    """
    mode = FastFakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)
    with mode:
        yield mode


def adopt_fakes(module: torch.nn.Module, mode: FakeTensorMode) -> int:
    """Re-make in ``mode`` each parameter and buffer of ``module`` that is a fake tensor of another fake mode.

    A module whose models were built in several fake modes (each ``with_fake_weights`` build has its own), or copied
    under a mode other than :class:`~lit_memopt._compat.torch.FastFakeTensorMode` (whose deep copies stay in it: torch's
    ``copy.deepcopy`` of a fake gives a fake of a new mode), has fakes that are not ``mode``'s. A step traced in
    ``mode`` converts such a tensor on every use it does not memoize, and the tracker counts each conversion as a new
    allocation (GRADE's tied reference head: 0.72 GiB of phantom activations at Qwen3-4B).
    Re-made here once, with the same shape, strides, dtype, device and ``requires_grad``; tensors shared by several
    modules (tied weights) stay shared. Returns how many distinct tensors were re-made.
    """
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (old, new): old kept alive, so ids stay unique
    owners = {name: sub for name, sub in module.named_modules(remove_duplicate=False)}
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for qualified, t in tensors:
        if not isinstance(t, FakeTensor) or t.fake_mode is mode:
            continue
        if id(t) not in made:
            with mode:
                data = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=t.fake_device)
            new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
            made[id(t)] = (t, new)
        owner_name, _, name = qualified.rpartition(".")
        setattr(owners[owner_name], name, made[id(t)][1])  # nn.Module.__setattr__ keeps it a parameter / buffer
    return len(made)


@dataclass
class PeakStats:
    """Live-tensor bytes seen while a function ran, summed over devices.

    Attributes:
        peak_bytes: highest total of live tensor bytes during the call.
        baseline_bytes: bytes already live at the start (the ``track`` arguments: modules,
            optimizers, tensors).
        extra_bytes: ``peak_bytes - baseline_bytes``: what the call itself needed on top.
        by_category: the peak split by MemTracker's categories (Parameter, Gradient, Activation,
            Temp, Optstate, Buffer, Other), as they stood at each category's own peak.
        result: what ``fn`` returned.
    """

    peak_bytes: int
    baseline_bytes: int
    extra_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    result: Any = None

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def extra_gib(self) -> float:
        return self.extra_bytes / GIB


def peak_during(
    fn: Callable[[], Any],
    *track: torch.nn.Module | torch.optim.Optimizer | torch.Tensor,
) -> PeakStats:
    """Run ``fn()`` and measure the peak of live tensor bytes (fake or real tensors).

    Tensors created before the call are invisible to the tracker unless passed in ``track``:
    pass the model(s), optimizer(s) and input tensors that should count as already live, so that
    ``baseline_bytes`` holds them and ``extra_bytes`` is what ``fn`` adds. Keep references to
    ``fn``'s outputs out of the closure's scope if they should be freed inside it.

    Example::

        with fake_mode():
            hidden = torch.randn(8192, 2560, dtype=torch.bfloat16, requires_grad=True)
            weight = torch.randn(151936, 2560, dtype=torch.bfloat16, requires_grad=True)
            targets = torch.randint(0, 151936, (8192,))
            stats = peak_during(lambda: linear_logprobs(hidden, weight, targets).sum().backward(),
                                hidden, weight)
        print(stats.extra_gib)
    """
    tracker = StepTracker()
    if track:
        tracker.track_external(*track)
    with tracker:
        baseline = _total(tracker.get_tracker_snapshot("current"))
        result = fn()
        peak_snapshot = tracker.get_tracker_snapshot("peak")
    peak = max(_total(peak_snapshot), baseline)
    return PeakStats(
        peak_bytes=peak,
        baseline_bytes=baseline,
        extra_bytes=peak - baseline,
        by_category=_categories(peak_snapshot),
        result=result,
    )
