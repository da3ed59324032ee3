"""One training step of a LightningModule under the memory tracker: the peak, its breakdown, where it happened.

``estimate_peak`` runs Lightning's order of a step (hooks, ``training_step``, backward, optimizer step,
``zero_grad``) outside a fit loop. On a module built under fake tensors no weights exist, so a 4B model is
measured on a laptop CPU; on real tensors the same code measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from lightning.fabric.utilities.apply_func import move_data_to_device

from lit_memopt._compat.torch import DataDependentOutputException, DynamicOutputShapeException, FakeTensor, storage_key
from lit_memopt.memory.allocator import AllocatorOutOfMemory, reserved_peak
from lit_memopt.memory.batch import batch_geometry, batch_tensors, resize_batch, to_fake
from lit_memopt.memory.units import format_bytes
from lit_memopt.memory.fake import fake_mode
from lit_memopt.memory.forked import ForkedCall, ForkedCallFailed, can_fork
from lit_memopt.memory.worst_case import UnknownValueError
from lit_memopt.memory.offload import OFFLOAD_METER
from lit_memopt.memory.replay import SharedRegions, sharing_regions
from lit_memopt.memory.stitch import PhasedLog
from lit_memopt.memory.tracker import ModuleMemory, StepTracker, module_rows, snapshot_categories, snapshot_total

__all__ = ["BREAKDOWN_LABELS", "PeakEstimate", "EstimateError", "ValueDependentStepError", "estimate_peak", "reserved_peaks", "format_bytes", "breakdown_from_categories", "measure_on_cuda",
           "within_device"]

# A log this long is replayed for its least device in a forked child beside the on-device replay (shorter ones take
# less than the fork costs), which gets this long before the replay is made here instead.
FORK_REPLAY_EVENTS = 200_000
FORKED_REPLAY_SECONDS = 900.0

GIB = 1024**3
# MemTracker's categories -> the rows of the breakdown.
_CATEGORY_ROWS = {
    "Parameter": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Buffer": "other",
    "Other": "other",
}
BREAKDOWN_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (kept for backward)",
    "temporaries": "temporaries",
    "other": "buffers and input batch",
    # per rank under DDP/FSDP2 only (memory.sharding): gathered layers, buffers awaiting a collective
    "communication": "gathered layers and collective buffers",
}





@dataclass
class PeakEstimate:
    """The peak of live tensor bytes during one training step, with where it came from.

    Attributes:
        peak_bytes: highest total of live tensor bytes (forward, backward or optimizer step).
        breakdown: the peak split into ``parameters``, ``gradients``, ``optimizer_state``,
            ``activations``, ``temporaries`` and ``other`` (buffers, the input batch); sums to ``peak_bytes``.
        peak_phase: ``forward``, ``backward`` or ``optimizer step``: where the peak happened.
        phase_peaks: the highest total inside each phase.
        modules: per-module memory (grouped over repeated blocks), largest activations first.
        batch_size: rows of the batch the step ran on.
        seq_len: tokens per row (``None`` when the batch has no 2-D tensor).
        fake: ``True`` when the step ran on fake tensors (a prediction), ``False`` on real ones.
        seconds: wall time of the measured step.
        optimizer_foreach: the optimizer implementation that was simulated (``None``: as configured).
        accumulating: gradients were live from the start (one micro-batch of several).
        phase_breakdowns: the breakdown at each phase's own peak (what block extrapolation and
            per-rank sharding scale).
        reserved_peak_bytes: what PyTorch's CUDA caching allocator would have reserved at its peak
            for the same allocations (``memory.allocator``); ``None`` when not modelled.
        device_bytes: the device size the allocator model had (``None``: unlimited). Given one, it releases its
            cached segments before passing it, as PyTorch's does before an out-of-memory error, and a step that
            needs more even then has ``reserved_peak_bytes`` above it.
        least_reserved_bytes: with ``device_bytes``, the reserved peak of an allocator that releases its cache
            before every new segment: about the smallest device the step runs on (``None`` without a device size).
        num_blocks: decoder blocks of the model the numbers are for (``None``: not known).
        method: how the numbers were obtained, in words (a full trace, or which block counts were
            traced and extrapolated; worst-case generation; per-rank sharding).
        worst_case_tokens: tokens sampled during the step when generation ran at its worst case (every
            sampled token a non-EOS filler, every response at ``max_new_tokens``); ``None``: not a worst case.
        offloaded_bytes: bytes of saved activations the step moved to host memory and back (activation offload,
            ``memory.offload``; counted on fake tensors, 0 without offload).
        allocation_log: the step's allocations and frees by phase (``memory.stitch.PhasedLog``), kept only when
            :func:`estimate_peak` was asked to (block stitching); never in :meth:`as_dict`.
    """

    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    phase_peaks: dict[str, int]
    modules: list[ModuleMemory]
    batch_size: int | None
    seq_len: int | None
    fake: bool
    seconds: float
    optimizer_foreach: bool | None = None
    accumulating: bool = False
    phase_breakdowns: dict[str, dict[str, int]] = field(default_factory=dict)
    reserved_peak_bytes: int | None = None
    device_bytes: int | None = None
    least_reserved_bytes: int | None = None
    num_blocks: int | None = None
    method: str = "full trace"
    worst_case_tokens: int | None = None
    offloaded_bytes: int = 0
    allocation_log: Any = field(default=None, repr=False, compare=False)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def top_modules(self, n: int = 8) -> list[ModuleMemory]:
        """The ``n`` leaf-module groups keeping the most activations (where the memory lives)."""
        leaves = [m for m in self.modules if m.is_leaf and (m.activation_bytes > 0 or m.forward_peak_bytes > 0)]
        return sorted(leaves, key=lambda m: (m.activation_bytes, m.forward_peak_bytes), reverse=True)[:n]

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(dataclasses.replace(self, allocation_log=None))
        del out["allocation_log"]
        out["top_modules"] = [m.as_dict() for m in self.top_modules()]
        return out



class EstimateError(ValueError):
    """The step could not run under fake tensors (it reads tensor values, e.g. text generation).

    A ``ValueError``: the command line reports it in one line, like a bad setting.
    """



def _fake_mode_of(module: torch.nn.Module) -> Any | None:
    for t in list(module.parameters()) + list(module.buffers()):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def _optimizers_from(config: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (Lightning's accepted forms)."""
    if config is None:
        return []
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, Mapping):
        return _optimizers_from(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in config[0]):
            return list(config[0])  # ([optimizers], [schedulers])
        found: list[torch.optim.Optimizer] = []
        for item in config:
            found.extend(_optimizers_from(item))
        return found
    inner = getattr(config, "optimizer", None)  # LightningOptimizer
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def _set_foreach(optimizers: Sequence[torch.optim.Optimizer], foreach: bool | None) -> None:
    if foreach is None:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = foreach


def _trainable(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    seen.setdefault(id(p), p)
    return list(seen.values())


def _initialise_optimizer_states(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Run one step on zero gradients so that lazily created states (Adam moments) exist and count.

    In steady-state training the states live through every forward and backward; a first step
    would create them only at its very end and so underestimate every later step.
    """
    params = _trainable(optimizers)
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    for opt in optimizers:
        opt.step()
    for p in params:
        p.grad = None


def _overridden(module: torch.nn.Module, name: str) -> bool:
    import lightning.pytorch as pl

    impl = getattr(type(module), name, None)
    return impl is not None and impl is not getattr(pl.LightningModule, name, None)


@contextlib.contextmanager
def _standalone(module: Any, optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """Let ``training_step`` run outside a fit loop: logging is a no-op, optimizer helpers are local."""

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)

    def clip_gradients(optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None) -> None:
        if gradient_clip_val:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    @contextlib.contextmanager
    def toggled_optimizer(optimizer: Any) -> Iterator[None]:
        yield

    patches: dict[str, Any] = {
        "log": lambda *a, **k: None,
        "log_dict": lambda *a, **k: None,
        "optimizers": lambda use_pl_optimizer=True: optimizers[0] if len(optimizers) == 1 else list(optimizers),
        "lr_schedulers": lambda: None,
        "manual_backward": manual_backward,
        "toggle_optimizer": lambda optimizer: None,
        "untoggle_optimizer": lambda optimizer: None,
        "toggled_optimizer": toggled_optimizer,
        "clip_gradients": clip_gradients,
    }
    saved = {name: module.__dict__[name] for name in patches if name in module.__dict__}
    for name, fn in patches.items():
        object.__setattr__(module, name, fn)
    try:
        yield
    finally:
        for name in patches:
            module.__dict__.pop(name, None)
        for name, fn in saved.items():
            object.__setattr__(module, name, fn)


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def _run_training_step(module: Any, batch: Any, optimizers: list[torch.optim.Optimizer], tracker: StepTracker, batch_idx: int) -> None:
    """Lightning's order of one training step: hooks, forward, backward, optimizer step, zero_grad."""
    automatic = bool(getattr(module, "automatic_optimization", True))
    tracker.phase = "forward"
    if _overridden(module, "on_train_batch_start"):
        module.on_train_batch_start(batch, batch_idx)
    output = module.training_step(batch, batch_idx)
    if automatic:
        loss = _loss_of(output)
        if loss is not None:
            tracker.phase = "backward"
            if _overridden(module, "on_before_backward"):
                module.on_before_backward(loss)
            loss.backward()
            del loss
            if _overridden(module, "on_after_backward"):
                module.on_after_backward()
        output = None
        tracker.phase = "optimizer step"
        for opt in optimizers:
            if _overridden(module, "on_before_optimizer_step"):
                module.on_before_optimizer_step(opt)
            opt.step()
            if _overridden(module, "on_before_zero_grad"):
                module.on_before_zero_grad(opt)
            opt.zero_grad(set_to_none=True)
    if _overridden(module, "on_train_batch_end"):
        module.on_train_batch_end(output, batch, batch_idx)


class ValueDependentStepError(EstimateError):
    """The step reads tensor values (text generation stopping at end-of-sequence): estimate it at its worst case."""


def _explain_value_dependence(exc: BaseException, module: Any) -> EstimateError:
    return ValueDependentStepError(
        f"estimate_peak: the training step of {type(module).__name__} reads tensor values "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'data-dependent operation'}); "
        "fake tensors have shapes but no values. Text generation that stops at an end-of-sequence token is "
        "the usual cause: estimate it at its worst case with estimate_peak(..., worst_case_filler=TOKEN_ID) "
        "(what `lit-memopt estimate` does), or measure on the device."
    )


def estimate_peak(
    module: Any,
    batch: Any,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    optimizer_foreach: bool | None = None,
    accumulating: bool = False,
    batch_idx: int = 0,
    model_allocator: bool = True,
    worst_case_filler: int | None = None,
    shared_regions: SharedRegions | None = None,
    device_bytes: int | None = None,
    keep_allocation_log: bool = False,
) -> PeakEstimate:
    """Peak live tensor bytes of one training step (forward, backward, optimizer step) of ``module`` on ``batch``.

    ``module`` is a LightningModule or a zero-argument function returning one. A function is
    called inside ``fake_mode()``, so a real-size model is built without memory and the result is
    a prediction; a module already built inside ``fake_mode()`` is estimated the same way. A
    module with real tensors runs the step for real and the result is a measurement (this is how
    the estimate is checked against reality). The step is Lightning's: ``on_train_batch_start``,
    ``training_step``, ``backward``, ``optimizer.step`` and ``zero_grad(set_to_none=True)`` for
    each optimizer of ``configure_optimizers`` (manual optimization: ``training_step`` drives
    them); ``self.log`` is a no-op. Optimizer states are created before the step (a zero-gradient
    step), so they count as they do in every step after the first. The module's weights change.

    Args:
        module: the LightningModule, or a function building it (built under fake tensors).
        batch: a batch as the module's DataLoader yields it (real tensors; converted to fake ones).
        batch_size: resize the batch to this many rows first (see :func:`resize_batch`).
        seq_len: resize the batch to this many tokens per row first.
        optimizer_foreach: force the optimizers' ``foreach`` implementation where it is unset
            (``True`` mimics CUDA, where it is PyTorch's default and needs a temporary of the size
            of the parameters); ``None`` keeps the configured behaviour.
        accumulating: the step is one micro-batch of several: gradients are live from the start.
        batch_idx: passed to ``training_step``.
        model_allocator: replay the step's allocations through the CUDA caching-allocator model
            (``memory.allocator``) to fill ``reserved_peak_bytes``.
        worst_case_filler: estimate text generation at its worst case: the batch's values are followed
            through the step and every sampled token is this (non-EOS) id, so every response runs to
            ``max_new_tokens`` (``memory.worst_case``). ``None``: shapes only; a step that reads values fails.
        shared_regions: a :class:`~lit_memopt.memory.replay.SharedRegions` that the traces of one plan share: the
            step's ``shared_region`` calls (rollouts) are recorded into it, or replayed from an earlier trace's
            recording (``memory.replay``). ``None``: this trace's own (on fake tensors), so that a long generation
            loop is stretched from short probes (``memory.stretch``); ``SharedRegions(share=False, stretch=False)``:
            every region runs in full.
        device_bytes: the device size for ``model_allocator``: the model releases its cached segments when a new
            one would pass it (a real allocator does so before an out-of-memory error; a rollout whose cache grows
            a token at a time otherwise keeps reserving). ``None``: no limit.
        keep_allocation_log: return the step's allocation log with it (``PeakEstimate.allocation_log``), for
            ``memory.blocks`` to stitch the log of more blocks from it; needs ``model_allocator``.

    Returns:
        A :class:`PeakEstimate`.

    Raises:
        EstimateError: the step reads tensor values, which fake tensors do not have.
        ValueError: bad ``batch_size``/``seq_len``, or a module without optimizers.

    Example::

        from lit_memopt.memory import estimate_peak
        est = estimate_peak(lambda: SFTModule(ModelConfig(...qwen3_4b...)), batch, batch_size=8, seq_len=2048,
                            optimizer_foreach=True)
        print(est.peak_gib, est.breakdown, est.peak_phase)
    """
    if not isinstance(module, torch.nn.Module):
        if not callable(module):
            raise TypeError(f"estimate_peak: module must be a LightningModule or a function building one, got {type(module).__name__}")
        with fake_mode() as mode:
            module = module()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"estimate_peak: the module factory returned {type(module).__name__}, not a LightningModule")
    else:
        mode = _fake_mode_of(module)
    if batch_size is not None or seq_len is not None:
        batch = resize_batch(batch, batch_size, seq_len)
    rows, seq = batch_geometry(batch)
    context = mode if mode is not None else contextlib.nullcontext()
    values = None
    if worst_case_filler is not None and mode is not None:
        from lit_memopt.memory.worst_case import WorstCaseValues

        values = WorstCaseValues(worst_case_filler)
    with context:
        if mode is not None:
            real_batch, batch = batch, to_fake(batch, mode)
            if values is not None:
                for fake, real in zip(batch_tensors(batch), batch_tensors(real_batch)):
                    values.track(fake, real)
        module.train()
        optimizers = _optimizers_from(module.configure_optimizers())
        if not optimizers:
            raise ValueError(f"estimate_peak: {type(module).__name__}.configure_optimizers() returned no optimizer")
        _set_foreach(optimizers, optimizer_foreach)
        try:
            _initialise_optimizer_states(optimizers)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise _explain_value_dependence(exc, module) from exc
        if accumulating:
            with torch.no_grad():
                for p in _trainable(optimizers):
                    p.grad = torch.zeros_like(p)
        for opt in optimizers:
            if not accumulating:
                opt.zero_grad(set_to_none=True)
        tracker = StepTracker(record_allocations=model_allocator)
        tracker.track_external(module, *optimizers, *batch_tensors(batch))
        OFFLOAD_METER.take()  # the step's own offloaded bytes only
        started = time.perf_counter()
        try:
            # The value mode goes inside the tracker: the tensors it creates for value-dependent shapes are counted.
            with _standalone(module, optimizers), tracker, values if values is not None else contextlib.nullcontext(), \
                    (sharing_regions(shared_regions, tracker, values) if shared_regions is not None
                     else sharing_regions(SharedRegions(), tracker, values) if mode is not None
                     else contextlib.nullcontext()):
                tracker.mark_phase_start("setup")
                _run_training_step(module, batch, optimizers, tracker, batch_idx)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise _explain_value_dependence(exc, module) from exc
        except UnknownValueError as exc:
            raise EstimateError(f"estimate_peak: the training step of {type(module).__name__} has no worst case: {exc}") from exc
        except (AssertionError, AttributeError, RuntimeError, TypeError) as exc:
            if mode is None:
                raise  # real tensors: the module's own error, unchanged
            raise EstimateError(
                f"estimate_peak: the training step of {type(module).__name__} failed on fake tensors outside a Trainer "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no message'}). Steps that need "
                "fit-time setup (a sandbox, trainer.datamodule) or generate text until an end-of-sequence token cannot "
                "be estimated; set LIT_MEMOPT_DEBUG=1 for the traceback."
            ) from exc
        seconds = time.perf_counter() - started
        offloaded = OFFLOAD_METER.take()
        peak_snapshot = tracker.get_tracker_snapshot("peak")
        state_bytes = _optimizer_state_bytes(optimizers)

    breakdown = breakdown_from_categories(snapshot_categories(peak_snapshot), state_bytes)
    phase_breakdowns = {k: breakdown_from_categories(v, state_bytes) for k, v in tracker.phase_breakdowns.items() if k != "setup"}
    reserved = least = None
    if tracker.allocation_log is not None:
        reserved, least = reserved_peaks(tracker.allocation_log, device_bytes)
    peak = snapshot_total(peak_snapshot)
    return PeakEstimate(
        peak_bytes=peak,
        breakdown=breakdown,
        peak_phase=tracker.peak_phase,
        phase_peaks={k: v for k, v in tracker.phase_peaks.items() if k != "setup"},
        modules=module_rows(tracker),
        batch_size=rows,
        seq_len=seq,
        fake=mode is not None,
        seconds=seconds,
        optimizer_foreach=optimizer_foreach,
        accumulating=accumulating,
        phase_breakdowns=phase_breakdowns,
        reserved_peak_bytes=reserved,
        device_bytes=device_bytes if reserved is not None else None,
        least_reserved_bytes=least,
        worst_case_tokens=None if values is None else values.sampled_tokens,
        offloaded_bytes=offloaded,
        allocation_log=(PhasedLog(tracker.allocation_log, tracker.log_phases)
                        if keep_allocation_log and tracker.allocation_log is not None else None),
    )


def within_device(estimate: PeakEstimate) -> PeakEstimate:
    """``estimate`` mended where its reserved figure passes its device's size (``device_bytes``), with its ``method``
    saying so; unchanged where it does not (or has no device size).

    A line through traces (more blocks, per-rank sharding of a one-device trace) can pass the device where a real
    allocator would release its cache rather than reserve more: then the step runs if the least device it needs
    (``least_reserved_bytes``, carried along the same line) is within it, and its reserved peak is the device's size;
    else the reserved figure is that least device.
    """
    device, reserved, needs = estimate.device_bytes, estimate.reserved_peak_bytes, estimate.least_reserved_bytes
    if device is None or reserved is None or needs is None or reserved <= device:
        return estimate
    if needs <= device:
        return dataclasses.replace(estimate, reserved_peak_bytes=device, method=(
            f"{estimate.method}; the reserved line passes the device's {format_bytes(device)} ({format_bytes(reserved)}), "
            f"where the allocator releases its cached segments: the step runs within it, needing at least "
            f"{format_bytes(needs)}"))
    return dataclasses.replace(estimate, reserved_peak_bytes=needs, method=(
        f"{estimate.method}; even releasing its cached segments, the allocator needs {format_bytes(needs)}, "
        f"more than the device's {format_bytes(device)}"))


def reserved_peaks(log: list[tuple[int, int, int]], device_bytes: int | None, *,
                   least: bool = True) -> tuple[int, int | None]:
    """The allocator model's reserved peak for ``log`` on a device of ``device_bytes``, and (given one, and ``least``)
    the peak of one that releases its cache before every new segment, about the least device the step runs on. Where
    even a released cache leaves too little, the first is what the step needs: that least device, or the reservation
    that failed.

    The two replays are independent, and a long log (a rollout of thousands of tokens: millions of events) takes
    seconds each: where a second core is free (``forked.can_fork``), the least device is replayed in a forked child
    alongside.
    """
    if device_bytes is None:
        return reserved_peak(log), None
    releasing = lambda: reserved_peak(log, release_before_growing=True)  # noqa: E731
    child = ForkedCall(releasing) if least and len(log) >= FORK_REPLAY_EVENTS and can_fork() else None

    def least_device() -> int:
        if child is not None:
            try:
                return child.result(timeout=FORKED_REPLAY_SECONDS)
            except ForkedCallFailed:
                pass  # replayed here instead
        return releasing()

    try:
        on_device = reserved_peak(log, device_bytes)
    except AllocatorOutOfMemory as exc:
        # the reservation that failed is needed whatever the cache held: the least device is no smaller
        needed = max(least_device(), exc.needed_bytes)
        return needed, needed
    except BaseException:
        if child is not None:
            child.cancel()
        raise
    return on_device, least_device() if least else None


def breakdown_from_categories(categories: dict[str, int], optimizer_state_bytes: int) -> dict[str, int]:
    """MemTracker's categories as the rows of the breakdown (sums to the same total).

    Inside the optimizer step MemTracker files every new tensor as optimizer state: what exceeds
    the real states (``optimizer_state_bytes``) are the step's temporaries (e.g. foreach buffers).
    """
    breakdown = dict.fromkeys(BREAKDOWN_LABELS, 0)
    for name, value in categories.items():
        row = _CATEGORY_ROWS.get(name)
        if row is not None:
            breakdown[row] += int(value)
    if breakdown["optimizer_state"] > optimizer_state_bytes:
        breakdown["temporaries"] += breakdown["optimizer_state"] - optimizer_state_bytes
        breakdown["optimizer_state"] = optimizer_state_bytes
    return breakdown


def _optimizer_state_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    seen: dict[int, int] = {}
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    # a sharded state (DTensor) holds its local shard: the wrapper's storage has the global size
                    st = (value.to_local() if isinstance(value, DTensor) else value).untyped_storage()
                    seen[storage_key(st)] = st.nbytes()
    return sum(seen.values())



def measure_on_cuda(build_module: Callable[[], Any], batch: Any, optimizer_foreach: bool | None) -> int | None:
    """Real peak of the same step on the current CUDA device (``torch.cuda.max_memory_allocated``), or None if it OOMs."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    module = None
    try:
        with torch.device(device):
            module = build_module()
        module.to(device)
        moved = move_data_to_device(batch, device)
        optimizers = _optimizers_from(module.configure_optimizers())
        _set_foreach(optimizers, optimizer_foreach)
        _initialise_optimizer_states(optimizers)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        tracker = StepTracker()
        with _standalone(module, optimizers):
            module.train()
            _run_training_step(module, moved, optimizers, tracker, 0)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    except torch.OutOfMemoryError:
        return None
    finally:
        del module
        torch.cuda.empty_cache()


