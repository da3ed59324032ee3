"""Peak-memory planning: one training step of a LightningModule under fake tensors, its breakdown, and batch fitting.

``estimate_peak`` runs forward, backward and the optimizer step of any LightningModule under
PyTorch's ``MemTracker``; with a module built inside ``fake_mode()`` no weights exist, so a 4B
model is measured on a laptop CPU. ``largest_micro_batch`` searches the largest batch under a memory
size, and ``run_estimate_command`` is ``lit-memopt estimate``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _ModState
from torch.utils._pytree import tree_flatten

from lit_memopt.memory.fake import fake_mode

__all__ = [
    "ModuleMemory",
    "PeakEstimate",
    "BatchFit",
    "estimate_peak",
    "resize_batch",
    "largest_micro_batch",
    "initial_micro_batch_from_estimate",
    "parse_memory_size",
    "format_bytes",
    "run_estimate_command",
]

GIB = 1024**3
DEFAULT_SAFETY_MARGIN = 0.1
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
_BREAKDOWN_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations (kept for backward)",
    "temporaries": "temporaries",
    "other": "buffers and input batch",
}
# Instance attributes that Lightning or a callback may have put on a module (wrappers bound to the
# real module); a fake copy must use its class's methods instead.
_HOOK_NAMES = (
    "training_step", "backward", "optimizer_step", "optimizer_zero_grad", "log", "log_dict",
    "optimizers", "lr_schedulers", "manual_backward", "toggle_optimizer", "untoggle_optimizer", "clip_gradients",
)


# ============================================================================ results
def format_bytes(n: float) -> str:
    """``12.34 GiB``-style text for a byte count."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class ModuleMemory:
    """Memory of one module (or of a group of same-named repeated modules, ``layers.*.mlp``) in the step.

    Attributes:
        name: qualified name below the LightningModule; repeated blocks' indices become ``*``.
        count: how many modules the row groups (e.g. 36 decoder layers).
        parameter_bytes: parameters of the modules (all of them together).
        activation_bytes: bytes the forward passes left alive (kept for backward), summed.
        forward_peak_bytes: the largest rise over the entry level inside one forward call.
        backward_peak_bytes: the largest rise over the entry level inside one backward call.
        is_leaf: the modules have no sub-modules.
    """

    name: str
    count: int
    parameter_bytes: int
    activation_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    is_leaf: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def top_modules(self, n: int = 8) -> list[ModuleMemory]:
        """The ``n`` leaf-module groups keeping the most activations (where the memory lives)."""
        leaves = [m for m in self.modules if m.is_leaf and (m.activation_bytes > 0 or m.forward_peak_bytes > 0)]
        return sorted(leaves, key=lambda m: (m.activation_bytes, m.forward_peak_bytes), reverse=True)[:n]

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["top_modules"] = [m.as_dict() for m in self.top_modules()]
        return out


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


class EstimateError(ValueError):
    """The step could not run under fake tensors (it reads tensor values, e.g. text generation).

    A ``ValueError``: the command line reports it in one line, like a bad setting.
    """


# ============================================================================ the tracker
class _StepTracker(MemTracker):
    """``MemTracker`` that records which phase the peak fell in, with per-op cost independent of model size.

    The stock tracker walks every module it has ever seen on every op to update module peaks; a
    36-layer model has hundreds of modules, which made a 4B step take minutes. Only the modules
    currently running (``ModTracker.parents``) can change their peaks, so only those are visited.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stats_by_name: dict[str, Any] = {}
        self.phase = "setup"
        self.peak_phase = "setup"
        self.phase_peaks: dict[str, int] = {}

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            # A repeated call: a generation loop runs the same decoder once per token. The stock
            # tracker refuses a top-level module called twice; record each call like a reused submodule.
            stats = self.memory_tracking[module]
            stats.mod_fqn = self._mod_tracker.get_known_fqn(module) or stats.mod_fqn
            stats.input_mem = self._track_inputs_or_outputs(inputs)
            snapshot = self.get_tracker_snapshot()
            stats.local_peak = {dev: dev_snap["Total"] for dev, dev_snap in snapshot.items()}
            stats.snapshots.setdefault(_ModState.PEAK_FW, []).append(snapshot)
            stats.snapshots.setdefault(_ModState.PRE_FW, []).append(copy.deepcopy(snapshot))
        else:
            super()._pre_fw_hook(module, inputs)
            stats = self.memory_tracking[module]
        self._stats_by_name[stats.mod_fqn] = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Fake tensors cannot draw from an explicit torch.Generator (e.g. seeded Gumbel noise);
        # random values are irrelevant to memory, so such draws use the default generator.
        if kwargs and kwargs.get("generator") is not None and self._fake_mode_on_entry is not None:
            kwargs = {**kwargs, "generator": None}
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # The stock version registers gradient hooks on every parameter, which fails on frozen
        # ones (a reference model, a reward model): those get no hook, they never get a gradient.
        from torch.distributed._tools.mem_tracker import _MemRefType

        def grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        param_memory = 0
        for param in module.parameters():
            winfos = self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
            param_memory += sum(w.mem_consumed for w in winfos)
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
            if install_grad_hooks and param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(grad_hook),
                    param.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)),
                )
        buffer_memory = 0
        for buffer in module.buffers():
            winfos = self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
            buffer_memory += sum(w.mem_consumed for w in winfos)
        return param_memory, buffer_memory

    def _update_peak_stats(self, peak_state: Any) -> None:
        current = self._curr_mem_snap
        for name in self._mod_tracker.parents:
            stats = self._stats_by_name.get(name)
            if stats is None or peak_state not in stats.snapshots:
                continue
            for dev, dev_snap in current.items():
                total = dev_snap["Total"]
                if stats.local_peak.get(dev, 0) < total:
                    stats.local_peak[dev] = total
                    stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        # Manual optimization runs backward and the optimizer inside training_step: ask the tracker.
        phase = "optimizer step" if self._in_opt else "backward" if self._mod_tracker.is_bw else self.phase
        grand_total = 0
        for dev, dev_snap in current.items():
            total = dev_snap["Total"]
            grand_total += total
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)
                self.peak_phase = phase
        if grand_total > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = grand_total


def _snapshot_total(snapshot: dict[Any, dict[Any, int]]) -> int:
    return sum(int(per_device.get("Total", 0)) for per_device in snapshot.values())


def _module_rows(tracker: _StepTracker) -> list[ModuleMemory]:
    """Per-module stats from the tracker, grouped over numbered repeats (``layers.0`` .. ``layers.35``)."""
    groups: dict[str, dict[str, Any]] = {}
    for module, stats in list(tracker.memory_tracking.items()):
        name = stats.mod_fqn
        root, _, rest = name.partition(".")
        if not rest:
            continue  # the LightningModule itself: that is the whole step
        key = re.sub(r"\.\d+(?=\.|$)", ".*", rest)
        snaps = stats.snapshots
        pre_fw = [_snapshot_total(s) for s in snaps.get(_ModState.PRE_FW, [])]
        post_fw = [_snapshot_total(s) for s in snaps.get(_ModState.POST_FW, [])]
        peak_fw = [_snapshot_total(s) for s in snaps.get(_ModState.PEAK_FW, [])]
        pre_bw = [_snapshot_total(s) for s in snaps.get(_ModState.PRE_BW, [])]
        peak_bw = [_snapshot_total(s) for s in snaps.get(_ModState.PEAK_BW, [])]
        kept = sum(max(b - a, 0) for a, b in zip(pre_fw, post_fw))
        fw_peak = max((max(b - a, 0) for a, b in zip(pre_fw, peak_fw)), default=0)
        bw_peak = max((max(b - a, 0) for a, b in zip(pre_bw, peak_bw)), default=0)
        g = groups.setdefault(key, {"count": 0, "params": 0, "kept": 0, "fw": 0, "bw": 0, "leaf": True})
        g["count"] += 1
        g["params"] += int(getattr(stats, "parameter_mem", 0))
        g["kept"] += kept
        g["fw"] = max(g["fw"], fw_peak)
        g["bw"] = max(g["bw"], bw_peak)
        g["leaf"] = g["leaf"] and not any(True for _ in module.children())
    rows = [
        ModuleMemory(k, g["count"], g["params"], g["kept"], g["fw"], g["bw"], g["leaf"]) for k, g in groups.items()
    ]
    rows.sort(key=lambda m: (m.activation_bytes, m.forward_peak_bytes), reverse=True)
    return rows


# ============================================================================ batches
def _batch_geometry(batch: Any) -> tuple[int | None, int | None]:
    """(rows, tokens per row) of a batch: from ``input_ids`` when present, else the first 2-D tensor."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].ndim >= 2:
        ids = batch["input_ids"]
        return int(ids.shape[0]), int(ids.shape[1])
    leaves, _ = tree_flatten(batch)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1]
    rows = int(tensors[0].shape[0]) if tensors else None
    seq = next((int(t.shape[1]) for t in tensors if t.ndim >= 2), None)
    if rows is None:
        rows = next((len(x) for x in _item_lists(batch)), None)
    return rows, seq


def _item_lists(obj: Any) -> Iterator[list]:
    if isinstance(obj, list) and obj and not any(isinstance(x, torch.Tensor) for x in obj):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _item_lists(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _item_lists(v)


def _cycle(n: int, target: int) -> list[int]:
    return [i % n for i in range(target)]


def resize_batch(batch: Any, batch_size: int | None = None, seq_len: int | None = None) -> Any:
    """A batch with ``batch_size`` rows and ``seq_len`` tokens per row, made by cycling the given rows/tokens.

    Rows are repeated or cut (tensors whose first dimension is the batch's row count, and lists of
    that length); token dimensions (dimension 1 of tensors whose dimension 1 is the batch's
    sequence length) are tiled or cut. Other leaves are kept. Values stay valid token ids, which
    is all a memory estimate needs.

    Raises:
        ValueError: a non-positive size, or a ``seq_len`` for a batch without 2-D tensors.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    rows, seq = _batch_geometry(batch)
    if seq_len is not None and seq is None:
        raise ValueError("seq_len was given but the batch has no [batch, tokens] tensor to resize")
    new_rows = rows if batch_size is None else batch_size
    new_seq = seq if seq_len is None else seq_len

    def visit(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj
            if rows is not None and t.ndim >= 1 and t.shape[0] == rows and new_rows != rows:
                t = t[torch.tensor(_cycle(rows, new_rows), device=t.device)]
            if seq is not None and t.ndim >= 2 and t.shape[1] == seq and new_seq != seq:
                t = t[:, torch.tensor(_cycle(seq, new_seq), device=t.device)]
            return t
        if isinstance(obj, Mapping):
            return type(obj)({k: visit(v) for k, v in obj.items()}) if type(obj) is not dict else {k: visit(v) for k, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(visit(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            items = [visit(v) for v in obj]
            if isinstance(obj, list) and rows is not None and len(obj) == rows and new_rows != rows and not any(
                isinstance(v, torch.Tensor) for v in obj
            ):
                items = [items[i] for i in _cycle(rows, new_rows)]
            return type(obj)(items)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: visit(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init})
        return obj

    return visit(batch)


def _to_fake(batch: Any, mode: Any) -> Any:
    from torch._subclasses.fake_tensor import is_fake

    def visit(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj if is_fake(obj) else mode.from_tensor(obj)
        if isinstance(obj, Mapping):
            return {k: visit(v) for k, v in obj.items()} if type(obj) is dict else type(obj)({k: visit(v) for k, v in obj.items()})
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(visit(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(visit(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: visit(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init})
        return obj

    return visit(batch)


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(batch)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


# ============================================================================ running one step
def _fake_mode_of(module: torch.nn.Module) -> Any | None:
    from torch._subclasses.fake_tensor import FakeTensor

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


def _run_training_step(module: Any, batch: Any, optimizers: list[torch.optim.Optimizer], tracker: _StepTracker, batch_idx: int) -> None:
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


def _explain_value_dependence(exc: BaseException, module: Any) -> EstimateError:
    return EstimateError(
        f"estimate_peak: the training step of {type(module).__name__} reads tensor values "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'data-dependent operation'}); "
        "fake tensors have shapes but no values, so this step cannot be estimated without running it. "
        "Text generation with an end-of-sequence stop is the usual cause; estimate the training "
        "forward/backward with a module whose step is value-independent, or measure on the device."
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
    rows, seq = _batch_geometry(batch)
    context = mode if mode is not None else contextlib.nullcontext()
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    with context:
        if mode is not None:
            batch = _to_fake(batch, mode)
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
        tracker = _StepTracker()
        tracker.track_external(module, *optimizers, *_batch_tensors(batch))
        started = time.perf_counter()
        try:
            with _standalone(module, optimizers), tracker:
                tracker.phase_peaks["setup"] = _snapshot_total(tracker.get_tracker_snapshot("current"))
                _run_training_step(module, batch, optimizers, tracker, batch_idx)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise _explain_value_dependence(exc, module) from exc
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
        peak_snapshot = tracker.get_tracker_snapshot("peak")
        state_bytes = _optimizer_state_bytes(optimizers)

    breakdown = dict.fromkeys(_BREAKDOWN_LABELS, 0)
    for per_device in peak_snapshot.values():
        for key, value in per_device.items():
            row = _CATEGORY_ROWS.get(str(getattr(key, "value", key)))
            if row is not None:
                breakdown[row] += int(value)
    # Inside the optimizer step MemTracker files every new tensor as optimizer state: what exceeds
    # the real states are the step's temporaries (e.g. the foreach implementation's buffers).
    if breakdown["optimizer_state"] > state_bytes:
        breakdown["temporaries"] += breakdown["optimizer_state"] - state_bytes
        breakdown["optimizer_state"] = state_bytes
    peak = _snapshot_total(peak_snapshot)
    return PeakEstimate(
        peak_bytes=peak,
        breakdown=breakdown,
        peak_phase=tracker.peak_phase,
        phase_peaks={k: v for k, v in tracker.phase_peaks.items() if k != "setup"},
        modules=_module_rows(tracker),
        batch_size=rows,
        seq_len=seq,
        fake=mode is not None,
        seconds=seconds,
        optimizer_foreach=optimizer_foreach,
        accumulating=accumulating,
    )


def _optimizer_state_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    seen: dict[int, int] = {}
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    st = value.untyped_storage()
                    seen[id(st) if not hasattr(st, "_cdata") else st._cdata] = st.nbytes()
    return sum(seen.values())


# ============================================================================ fitting a batch
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
    usable = int(memory_bytes * (1.0 - float(safety_margin)))
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

    rows, _ = _batch_geometry(batch)
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    for shared in (trainer, getattr(pl_module, "_trainer", None), getattr(pl_module, "tokenizer", None)):
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


# ============================================================================ the command
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


def _positive_int_or_none(cfg: Any, key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _recipe_batch(datamodule: Any) -> Any:
    """One training batch of a DataModule, as its DataLoader yields it."""
    if hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    if hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    try:
        return next(iter(loader))
    except StopIteration:
        raise ValueError(f"{type(datamodule).__name__}.train_dataloader() yielded no batch; check the data.* settings") from None


def _measure_on_cuda(build_module: Callable[[], Any], batch: Any, optimizer_foreach: bool | None) -> int | None:
    """Real peak of the same step on the current CUDA device (``torch.cuda.max_memory_allocated``), or None if it OOMs."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    module = None
    try:
        with torch.device(device):
            module = build_module()
        module.to(device)
        moved = _move(batch, device)
        optimizers = _optimizers_from(module.configure_optimizers())
        _set_foreach(optimizers, optimizer_foreach)
        _initialise_optimizer_states(optimizers)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        tracker = _StepTracker()
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


def _move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _move(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_move(v, device) for v in batch)
    return batch


@dataclass
class EstimateReport:
    """What ``lit-memopt estimate`` computed (also returned to the caller for scripting)."""

    recipe: str
    model: str
    estimate: PeakEstimate
    gpu_memory_bytes: int | None = None
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    fit: BatchFit | None = None
    measured_peak_bytes: int | None = None
    device: str = "cpu"
    build_seconds: float = 0.0
    cpu_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["estimate"] = self.estimate.as_dict()
        return out


@dataclass
class RecipeParts:
    """What an estimate of a recipe needs: module builders (fake and real), one real batch, names."""

    build_fake: Callable[[], Any]
    build_real: Callable[[], Any]
    batch: Any
    recipe: str
    model: str


def build_recipe_estimator(cfg: Any) -> RecipeParts:
    """Module builders and one real batch from a composed lit-memopt config, as ``lit-memopt fit`` builds them."""
    from hydra.utils import instantiate

    if "module" not in cfg or cfg.module is None:
        raise ValueError("the config has no 'module' section; pick a recipe with recipe=NAME")
    model_config = instantiate(cfg.model)
    tokenizer = model_config.build_tokenizer()
    datamodule = instantiate(cfg.data, _partial_=True)(tokenizer=tokenizer)
    batch = _recipe_batch(datamodule)
    module_factory = instantiate(cfg.module, _partial_=True)

    def build_fake() -> Any:
        return build_fake_module(module_factory, model_config, tokenizer)

    def build_real() -> Any:
        return module_factory(model_config=model_config, tokenizer=tokenizer)

    return RecipeParts(build_fake, build_real, batch, str(cfg.get("recipe_name") or "?"), str(getattr(model_config, "name", "model")))


def build_fake_module(module_factory: Callable[..., Any], model_config: Any, tokenizer: Any) -> Any:
    """``module_factory(model_config=..., tokenizer=...)`` with fake weights, allocating no real memory for them.

    The whole module is built inside ``fake_mode()``. A module whose constructor needs values
    (e.g. GRADE trains its small rule reward classifier at start) is built again with real
    tensors except for the language models, which ``model_config.build_model`` makes fake.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    try:
        with fake_mode():
            return module_factory(model_config=model_config, tokenizer=tokenizer)
    except (DataDependentOutputException, DynamicOutputShapeException, RuntimeError):
        # RuntimeError: peft cannot convert adapters it creates under fake tensors ("Couldn't swap")
        pass
    build_model = getattr(model_config, "build_model", None)
    if build_model is None:
        raise EstimateError(
            f"estimate: {type(model_config).__name__} has no build_model() and the module's constructor reads tensor values"
        )
    # Real and fake tensors then meet in one step: the mode turns the real ones into fakes on use.
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake_build_model(*args: Any, apply_lora: bool = True, **kwargs: Any) -> Any:
        lora = getattr(model_config, "lora", None)
        with mode:
            model = build_model(*args, apply_lora=apply_lora and not lora, **kwargs) if lora else build_model(*args, **kwargs)
        if lora and apply_lora:
            # Adapters are small: peft creates them with real tensors next to the fake base weights.
            model = model_config.apply_lora(model)
        return model

    proxy = copy.copy(model_config)
    object.__setattr__(proxy, "build_model", fake_build_model)
    return module_factory(model_config=proxy, tokenizer=tokenizer)


def estimate_recipe(cfg: Any) -> EstimateReport:
    """Everything ``lit-memopt estimate`` prints, without printing it."""
    batch_size = _positive_int_or_none(cfg, "batch_size")
    seq_len = _positive_int_or_none(cfg, "seq_len")
    gpu_memory = cfg.get("gpu_memory")
    gpu_bytes = parse_memory_size(gpu_memory) if gpu_memory is not None else None
    margin = cfg.get("safety_margin")
    margin = DEFAULT_SAFETY_MARGIN if margin is None else float(margin)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"safety_margin must be in [0, 1), got {margin!r}")

    started, cpu_started = time.perf_counter(), time.process_time()
    parts = build_recipe_estimator(cfg)
    batch = resize_batch(parts.batch, batch_size, seq_len)
    # Built once: a step changes fake weights, which have no values to change, so probes can share it.
    module = parts.build_fake()
    # The peak reported is a CUDA device's: there PyTorch's optimizers default to foreach.
    estimate = estimate_peak(module, batch, optimizer_foreach=True)
    fit = None
    if gpu_bytes is not None:
        known = {estimate.batch_size: estimate.peak_bytes} if estimate.batch_size else {}

        def peak_for(b: int) -> int:
            if b not in known:
                known[b] = estimate_peak(module, resize_batch(batch, batch_size=b), optimizer_foreach=True).peak_bytes
            return known[b]

        fit = largest_micro_batch(peak_for, gpu_bytes, safety_margin=margin)
    measured = None
    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
        free, _ = torch.cuda.mem_get_info()
        if estimate.peak_bytes < free:
            measured = _measure_on_cuda(parts.build_real, batch, None)
    return EstimateReport(
        recipe=parts.recipe,
        model=parts.model,
        estimate=estimate,
        gpu_memory_bytes=gpu_bytes,
        safety_margin=margin,
        fit=fit,
        measured_peak_bytes=measured,
        device=device,
        build_seconds=time.perf_counter() - started,
        cpu_seconds=time.process_time() - cpu_started,
    )


def render_report(report: EstimateReport, console: Any = None) -> None:
    """Print an :class:`EstimateReport` as rich tables."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and READMEs: wide enough for module names
            console = Console(width=110)
    est = report.estimate
    shape = f"{est.batch_size} × {est.seq_len} tokens" if est.seq_len else f"{est.batch_size} rows"
    console.print(f"[bold]Predicted peak memory of one training step[/]: recipe={report.recipe} model={report.model}, batch {shape}")
    table = Table()
    table.add_column("at the peak", style="bold")
    table.add_column("predicted", justify="right")
    table.add_column("share", justify="right")
    if report.measured_peak_bytes is not None:
        table.add_column(f"measured ({report.device})", justify="right")
    for key, label in _BREAKDOWN_LABELS.items():
        value = est.breakdown.get(key, 0)
        row = [label, format_bytes(value), f"{100 * value / max(est.peak_bytes, 1):.0f}%"]
        if report.measured_peak_bytes is not None:
            row.append("")
        table.add_row(*row)
    total = ["peak", format_bytes(est.peak_bytes), "100%"]
    if report.measured_peak_bytes is not None:
        total.append(format_bytes(report.measured_peak_bytes))
    table.add_section()
    table.add_row(*total, style="bold")
    console.print(table)
    phases = ", ".join(f"{k} {format_bytes(v)}" for k, v in est.phase_peaks.items())
    console.print(f"Peak reached during the {est.peak_phase} (highest per phase: {phases}).")

    top = est.top_modules(8)
    if top:
        mods = Table(title="Where the activations live (leaf modules, repeated blocks grouped)", title_justify="left")
        mods.add_column("module", no_wrap=True)
        mods.add_column("×", justify="right")
        mods.add_column("parameters", justify="right")
        mods.add_column("activations kept", justify="right")
        mods.add_column("forward transient", justify="right")
        mods.add_column("backward transient", justify="right")
        for m in top:
            mods.add_row(m.name, str(m.count), format_bytes(m.parameter_bytes), format_bytes(m.activation_bytes),
                         format_bytes(m.forward_peak_bytes), format_bytes(m.backward_peak_bytes))
        console.print(mods)

    if report.fit is not None and report.gpu_memory_bytes is not None:
        fit = report.fit
        budget = f"{format_bytes(report.gpu_memory_bytes)} with a {report.safety_margin:.0%} safety margin ({format_bytes(fit.usable_bytes)} usable)"
        if fit.micro_batch_size == 0:
            console.print(f"[bold red]Not even a micro-batch of 1 fits in {budget}[/]: it needs {format_bytes(fit.next_peak_bytes or 0)}.")
        else:
            nxt = f"; {fit.micro_batch_size + 1} would need {format_bytes(fit.next_peak_bytes)}" if fit.next_peak_bytes else ""
            console.print(
                f"[bold green]Largest micro-batch that fits in {budget}: {fit.micro_batch_size}[/] "
                f"(peak {format_bytes(fit.peak_bytes or 0)}{nxt}; {len(fit.probes)} steps estimated)."
            )
    console.print(
        f"Estimated in {report.build_seconds:.0f} s ({report.cpu_seconds:.0f} s of CPU time) on fake tensors: "
        "no weights, no device memory."
    )


def run_estimate_command(cfg: Any) -> EstimateReport:
    """``lit-memopt estimate recipe=NAME model=NAME [gpu_memory=80GiB] [batch_size=N] [seq_len=N] [safety_margin=0.1]``."""
    report = estimate_recipe(cfg)
    render_report(report)
    return report
