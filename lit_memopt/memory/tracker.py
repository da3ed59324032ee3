"""The one memory tracker of the pack: PyTorch's ``MemTracker`` with phases, frozen weights and an allocation log.

``StepTracker`` is used by the training-step estimator (``memory.step``) and by ``memory.fake.peak_during``
alike. Beyond the stock tracker it records the phase each peak fell in (forward, backward, optimizer step)
with the category breakdown at each phase's own peak, tolerates frozen parameters, and optionally logs
every allocation and free so that ``memory.allocator`` can replay them through a caching-allocator model.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, asdict
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lit_memopt._compat.mem_tracker import MemRefType, MemTrackerBase, ModState, UpdateType, wait_tensor_op
from lit_memopt._compat.torch import FakeTensor, active_fake_mode, current_fake_mode, fake_dispatch, tree_leaves

__all__ = ["StepTracker", "ModuleMemory", "net_events", "snapshot_total", "snapshot_categories", "module_rows"]

_DEVICE_QUERY = torch.ops.prim.device.default
_WAIT_TENSOR = wait_tensor_op()


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
        return asdict(self)


def snapshot_total(snapshot: dict[Any, dict[Any, int]]) -> int:
    """Bytes of a MemTracker snapshot, summed over devices."""
    return sum(int(per_device.get("Total", 0)) for per_device in snapshot.values())


def snapshot_categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A MemTracker snapshot as ``{category name: bytes}`` summed over devices (``Total`` left out)."""
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = str(getattr(key, "value", key))
            if name != "Total":
                out[name] = out.get(name, 0) + int(value)
    return out


def net_events(events: list[tuple[int, Any, int]]) -> list[tuple[int, Any, int]]:
    """What a stretch of an allocation log leaves behind, in order: its allocations not freed within it and its frees
    of storages allocated before it (an allocation and its free within the stretch cancel)."""
    kept: dict[int, tuple[int, Any, int]] = {}
    opened: dict[Any, int] = {}
    for i, (sign, key, nbytes) in enumerate(events):
        if sign > 0:
            opened[key] = i
            kept[i] = (sign, key, nbytes)
        elif key in opened:
            del kept[opened.pop(key)]
        else:
            kept[i] = (sign, key, nbytes)
    return [kept[i] for i in sorted(kept)]


class StepTracker(MemTrackerBase):
    """``MemTracker`` that knows the step's phases, with per-op cost independent of model size.

    The stock tracker walks every module it has ever seen on every op to update module peaks; a
    36-layer model has hundreds of modules, which made a 4B step take minutes. Only the modules
    currently running (``ModTracker.parents``) can change their peaks, so only those are visited.

    Args:
        record_allocations: keep ``allocation_log``, a list of ``(+1, key, bytes)`` / ``(-1, key, bytes)``
            events in program order, for the caching-allocator model.
    """

    def __init__(self, record_allocations: bool = False) -> None:
        super().__init__()
        self._stats_by_name: dict[str, Any] = {}
        self.phase = "setup"
        self.peak_phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        # category bytes at each phase's own peak: what block extrapolation and per-rank sharding scale
        self.phase_breakdowns: dict[str, dict[str, int]] = {}
        self.allocation_log: list[tuple[int, int, int]] | None = [] if record_allocations else None
        # ``(index in allocation_log, phase)`` where the phase of the logged events changes, and where an outermost
        # model call or its backward starts (a new segment of the same phase): block stitching (``memory.stitch``)
        # aligns the logs of two block counts segment by segment and checks each phase's peak.
        self.log_phases: list[tuple[int, str]] = []
        self.segment_marks = 0  # how many times :meth:`mark_segment` marked one (``memory.replay`` records them)
        # modules called outermost, whose calls start log segments (weakly: a module the step drops must die as it would)
        self._outermost: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # Set when memory was added since the last peak update (see __torch_dispatch__).
        self._grew = True
        self._last_phase: str | None = None
        self._entry_fake_mode: Any = None  # set by __enter__
        self._fake_mode_in_slot = False
        # Called with every update, after the tracker's own bookkeeping: ``(update type, record, old bytes, old
        # category)`` (``memory.replay`` records a region's allocations through it).
        self.listeners: list[Any] = []

    def __enter__(self) -> "StepTracker":
        # The fake mode the tracker is entered in: only its ops count (DTensor's shape propagation runs
        # under a nested one), and under fake tensors seeded draws lose their generator (see below).
        # torch >= 2.12's MemTracker records this itself; older ones (2.11) do not, so it is kept here.
        if self.depth == 0:
            self._entry_fake_mode = active_fake_mode()
            # Where the dispatcher's fake-mode slot holds it (always, for torch's fake modes), reading the slot
            # is the same question as walking the mode stack, and far cheaper per op.
            self._fake_mode_in_slot = current_fake_mode() is self._entry_fake_mode
        super().__enter__()
        return self

    # ------------------------------------------------------------------ allocation log
    def on_memory_update(self, u_type: Any, winfo: Any, old_mem_consumed: int | None, old_reftype: Any) -> None:
        log = self.allocation_log
        if log is not None:
            phase = self.current_phase()
            if not self.log_phases or self.log_phases[-1][1] != phase:
                self.log_phases.append((len(log), phase))
            if u_type == UpdateType.ADD:
                log.append((1, id(winfo), winfo.mem_consumed))
            elif u_type == UpdateType.DEL:
                log.append((-1, id(winfo), winfo.mem_consumed))
            elif u_type == UpdateType.SIZE:  # a resize_: the old storage is released, a new one taken
                log.append((-1, id(winfo), int(old_mem_consumed or 0)))
                log.append((1, id(winfo), winfo.mem_consumed))
        if u_type == UpdateType.ADD or u_type == UpdateType.SIZE:
            self._grew = True
        super().on_memory_update(u_type, winfo, old_mem_consumed, old_reftype)
        for listener in self.listeners:
            listener(u_type, winfo, old_mem_consumed, old_reftype)

    # ------------------------------------------------------------------ repeated calls, generators, frozen weights
    def pre_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        if self.allocation_log is not None and not self.in_backward and len(self.running_module_names) <= 2:
            # An outermost call (only the global scope and this module are running) starts a segment of the log:
            # a generation loop calls its model once per token, and each call adds one more block's events when a
            # block is added, so block stitching (``memory.stitch``) aligns the logs call by call. So does the
            # backward of each such call (GRADE differentiates through its decoding steps).
            self._outermost.add(module)
            self.mark_segment()
        if module in self.memory_tracking and not self.in_backward:
            # A repeated call: a generation loop runs the same decoder once per token. The stock
            # tracker refuses a top-level module called twice; record each call like a reused submodule.
            stats = self.memory_tracking[module]
            stats.mod_fqn = self.known_name(module) or stats.mod_fqn
            stats.input_mem = self.track_inputs(inputs)
            # Two copies of the current snapshot ({device: {category: bytes}}), as get_tracker_snapshot() and a
            # deepcopy of it gave them, at a fraction of the cost (a generation loop repeats this per module and token).
            snapshot = {dev: dict(dev_snap) for dev, dev_snap in self.current_snapshot.items()}
            stats.local_peak = {dev: dev_snap["Total"] for dev, dev_snap in snapshot.items()}
            stats.snapshots.setdefault(ModState.PEAK_FW, []).append(snapshot)
            stats.snapshots.setdefault(ModState.PRE_FW, []).append({dev: dict(dev_snap) for dev, dev_snap in snapshot.items()})
        else:
            super().pre_forward(module, inputs)
            stats = self.memory_tracking[module]
        self._stats_by_name[stats.mod_fqn] = stats

    def pre_backward(self, module: torch.nn.Module | None, grad_outputs: Any) -> None:
        if module is not None and module in self._outermost:
            self.mark_segment()
        super().pre_backward(module, grad_outputs)

    def mark_segment(self) -> None:
        """Start a segment of the allocation log here, in the current phase (see :meth:`pre_forward`; ``memory.replay``
        replays the marks a recorded region made)."""
        log, phase = self.allocation_log, self.current_phase()
        if log is None:
            return
        self.segment_marks += 1
        if self.log_phases and self.log_phases[-1][0] == len(log):
            self.log_phases[-1] = (len(log), phase)  # nothing logged since the last mark
        else:
            self.log_phases.append((len(log), phase))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DEVICE_QUERY:
            # Every `.device` read of a fake tensor is dispatched (over half the ops of a generation
            # step's trace); it allocates nothing, so it skips the bookkeeping of an op, and the answer
            # is the fake mode's own (its device handler: the fake device, meta inside a kernel).
            t = args[0]
            if type(t) is FakeTensor and not t.fake_mode.in_kernel_invocation:
                return t.fake_device
            return func(*args, **(kwargs or {}))
        # Fake tensors cannot draw from an explicit torch.Generator (e.g. seeded Gumbel noise);
        # random values are irrelevant to memory, so such draws use the default generator.
        if kwargs and kwargs.get("generator") is not None and self._entry_fake_mode is not None:
            kwargs = {**kwargs, "generator": None}
        if func is _WAIT_TENSOR or any(t is DTensor for t in types):
            return super().__torch_dispatch__(func, types, args, kwargs)
        # The stock bookkeeping of an op, made cheaper: the per-op cost of this method was a third of
        # an estimate's time. Same rules: outputs are tracked under the reference type of the region;
        # only ops of the fake mode the tracker was entered in count (DTensor's shape propagation runs
        # under a nested one).
        kwargs = kwargs or {}
        entry_mode = self._entry_fake_mode
        # Most ops are answered from the fake mode's dispatch cache: read it here rather than dispatch again.
        res = func(*args, **kwargs) if entry_mode is None else fake_dispatch(entry_mode, func, args, kwargs)
        if (current_fake_mode() if self._fake_mode_in_slot else active_fake_mode()) is entry_mode:
            is_bw = self.in_backward
            reftype = (MemRefType.OPT if self.in_optimizer_step
                       else MemRefType.TEMP if is_bw and not self.in_activation_checkpoint else MemRefType.ACT)
            if isinstance(res, torch.Tensor):
                self.track_tensor(reftype, res)
            else:
                for leaf in tree_leaves(res):
                    if isinstance(leaf, torch.Tensor):
                        self.track_tensor(reftype, leaf)
            self._after_op()
        return res

    def _after_op(self) -> None:
        # Peaks can only rise when memory was added; an op that only viewed or freed cannot move
        # one, except as the first op of a phase (where that phase's level is first recorded).
        phase = self.current_phase()
        if self._grew or phase != self._last_phase:
            self._grew = False
            self._last_phase = phase
            self.update_peak_stats(ModState.PEAK_BW if self.in_backward else ModState.PEAK_FW)

    def replay_update(self, u_type: Any, record: Any) -> None:
        """Count an allocation (``UpdateType.ADD``) or free (``DEL``) that no tensor stands behind, as an op making
        or dropping a storage of ``record`` (``device``, ``reftype``, ``mem_consumed``) would have been counted:
        ``memory.replay`` replays a recorded region through here. ``record`` is the allocation's identity: the same
        object frees it."""
        self.on_memory_update(u_type, record, None, None)
        if u_type == UpdateType.ADD:
            self._after_op()

    def save_counts(self) -> tuple:
        """The peaks, phase peaks and allocation log as they are now, for :meth:`restore_counts`: ``memory.replay``
        runs a loop a few times to measure it (``memory.stretch``), and those runs must not count in the step.
        Per-module rows are not saved (they are not exact under replay either)."""
        return ({d: dict(s) for d, s in self.peak_snapshot.items()}, dict(self.peak_bytes), self.peak_phase,
                dict(self.phase_peaks), {k: dict(v) for k, v in self.phase_breakdowns.items()},
                None if self.allocation_log is None else len(self.allocation_log), self._grew, self._last_phase,
                list(self.log_phases))

    def restore_counts(self, saved: tuple) -> None:
        """Put back the peaks :meth:`save_counts` saved, and its allocation log: the events since are dropped, but
        for what they leave behind (a storage made since and still live, a free of one made before), which the live
        bytes still hold and so the log keeps, in order, from here (FSDP2 gathers its root on a first call and keeps
        it gathered: a loop measured on its first call leaves that behind)."""
        snapshot, peaks, self.peak_phase, phase_peaks, breakdowns, log_length, self._grew, self._last_phase, marks = saved
        self.peak_snapshot.clear()
        self.peak_snapshot.update(snapshot)
        self.peak_bytes.clear()
        self.peak_bytes.update(peaks)
        self.phase_peaks, self.phase_breakdowns = phase_peaks, breakdowns
        if log_length is not None:
            left = net_events(self.allocation_log[log_length:])
            del self.allocation_log[log_length:]
            self.log_phases = list(marks)  # (a mark made since at the same place, where a probe started, is not kept)
            if left:
                phase = self.current_phase()
                if not self.log_phases or self.log_phases[-1][1] != phase:
                    self.log_phases.append((len(self.allocation_log), phase))
                self.allocation_log.extend(left)

    def track_parameters_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool) -> tuple[int, int]:
        # The stock version registers gradient hooks on every parameter, which fails on frozen
        # ones (a reference model, a reward model): those get no hook, they never get a gradient.
        def grad_hook(grad: torch.Tensor) -> None:
            self.track_storages_of(grad, MemRefType.GRAD)

        param_memory = 0
        for param in module.parameters():
            winfos = self.track_storages_of(param, MemRefType.PARAM)
            param_memory += sum(w.mem_consumed for w in winfos)
            if param.grad is not None:
                self.track_storages_of(param.grad, MemRefType.GRAD)
            if install_grad_hooks and param.requires_grad and self.grad_hook_handles.get(param, None) is None:
                self.grad_hook_handles[param] = (
                    param.register_hook(grad_hook),
                    param.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)),
                )
        buffer_memory = 0
        for buffer in module.buffers():
            winfos = self.track_storages_of(buffer, MemRefType.BUFFER)
            buffer_memory += sum(w.mem_consumed for w in winfos)
        return param_memory, buffer_memory

    # ------------------------------------------------------------------ peaks
    def current_phase(self) -> str:
        # Manual optimization runs backward and the optimizer inside training_step: ask the tracker.
        return "optimizer step" if self.in_optimizer_step else "backward" if self.in_backward else self.phase

    def update_peak_stats(self, peak_state: Any) -> None:
        current = self.current_snapshot
        for name in self.running_module_names:
            stats = self._stats_by_name.get(name)
            if stats is None or peak_state not in stats.snapshots:
                continue
            for dev, dev_snap in current.items():
                total = dev_snap["Total"]
                if stats.local_peak.get(dev, 0) < total:
                    stats.local_peak[dev] = total
                    stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        phase = self.current_phase()
        grand_total = 0
        for dev, dev_snap in current.items():
            total = dev_snap["Total"]
            grand_total += total
            if self.peak_bytes.get(dev, 0) < total:
                self.peak_bytes[dev] = total
                self.peak_snapshot[dev] = dict(dev_snap)
                self.peak_phase = phase
        if grand_total > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = grand_total
            self.phase_breakdowns[phase] = snapshot_categories(current)

    def mark_phase_start(self, phase: str) -> None:
        """Count what is live when ``phase`` starts as that phase's first level (a phase may only free)."""
        current = self.current_snapshot
        total = sum(int(d.get("Total", 0)) for d in current.values())
        if total > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = total
            self.phase_breakdowns[phase] = snapshot_categories(current)


def module_rows(tracker: StepTracker) -> list[ModuleMemory]:
    """Per-module stats from the tracker, grouped over numbered repeats (``layers.0`` .. ``layers.35``)."""
    groups: dict[str, dict[str, Any]] = {}
    for module, stats in list(tracker.memory_tracking.items()):
        name = stats.mod_fqn
        _, _, rest = name.partition(".")
        if not rest:
            continue  # the LightningModule itself: that is the whole step
        key = re.sub(r"\.\d+(?=\.|$)", ".*", rest)
        snaps = stats.snapshots
        pre_fw = [snapshot_total(s) for s in snaps.get(ModState.PRE_FW, [])]
        post_fw = [snapshot_total(s) for s in snaps.get(ModState.POST_FW, [])]
        peak_fw = [snapshot_total(s) for s in snaps.get(ModState.PEAK_FW, [])]
        pre_bw = [snapshot_total(s) for s in snaps.get(ModState.PRE_BW, [])]
        peak_bw = [snapshot_total(s) for s in snaps.get(ModState.PEAK_BW, [])]
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
    rows = [ModuleMemory(k, g["count"], g["params"], g["kept"], g["fw"], g["bw"], g["leaf"]) for k, g in groups.items()]
    rows.sort(key=lambda m: (m.activation_bytes, m.forward_peak_bytes), reverse=True)
    return rows
