"""PyTorch's ``MemTracker`` with the private state and hooks the pack's tracker needs, under public names.

``torch.distributed._tools.mem_tracker.MemTracker`` measures a step's memory by category (parameters, gradients,
activations, optimizer state) per module, under fake tensors. Its public surface is a context manager and snapshots;
what ``memory.tracker.StepTracker`` adds (phases, repeated calls, frozen weights, an allocation log, a cheaper per-op
path) needs its hooks and state, which are all private. :class:`MemTrackerBase` is the one place that names them: each
property or method below wraps one private name and says why. ``tests/test_compat.py`` checks every name in
:data:`PRIVATE_NAMES` against the installed torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from lit_memopt._compat.torch import tree_map

# The tracker's enums, used by its hooks and snapshots: the category of a tracked tensor, a module's snapshot points
# (pre/peak/post forward and backward), and what a bookkeeping update did (add, delete, resize).
from torch.distributed._tools.mem_tracker import _MemRefType as MemRefType
from torch.distributed._tools.mem_tracker import _ModState as ModState
from torch.distributed._tools.mem_tracker import _UpdateType as UpdateType

__all__ = ["MemTracker", "MemTrackerBase", "MemRefType", "ModState", "UpdateType", "wait_tensor_op", "PRIVATE_NAMES"]


def wait_tensor_op() -> Any:
    """The functional collectives' wait op (``torch.ops._c10d_functional.wait_tensor``): DTensor's collectives end in
    it, and the tracker must let the stock bookkeeping see it. Its namespace is private; there is no public handle."""
    return torch.ops._c10d_functional.wait_tensor.default


class MemTrackerBase(MemTracker):
    """``MemTracker`` whose private hooks call overridable public methods, and whose private state has public names.

    Subclasses override :meth:`on_memory_update`, :meth:`pre_forward`, :meth:`pre_backward`,
    :meth:`track_parameters_and_buffers` and :meth:`update_peak_stats` (each defaults to the stock behaviour) and read
    the properties below.
    """

    def __init__(self) -> None:
        super().__init__()
        # The tracker's ModTracker registers, in its pre-forward hook, a multi-grad hook on every module input that
        # requires grad (to see the module's backward begin). Under no_grad there is no backward, yet transformers'
        # gradient checkpointing marks the embedding output as requiring grad even in a rollout: each hook and its
        # tensor then make a reference cycle, alive until Python's cycle collector runs, memory the real step never
        # holds (measured: one embedding output per generated token). Without grad, the hook sees detached inputs.
        mod_tracker = self._mod_tracker
        stock = mod_tracker._fw_pre_hook

        def pre_forward_hook(module: nn.Module, inputs: Any) -> Any:
            if not torch.is_grad_enabled() and not mod_tracker.is_bw:
                inputs = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t, inputs)
            return stock(module, inputs)

        mod_tracker._fw_pre_hook = pre_forward_hook

    # ---------------------------------------------------------------- state
    @property
    def depth(self) -> int:
        """How deep ``with tracker:`` is nested now; the stock ``__enter__`` counts it privately."""
        return self._depth

    @property
    def in_backward(self) -> bool:
        """Whether autograd's backward is running now, as the tracker's own ``ModTracker`` sees it."""
        return self._mod_tracker.is_bw

    @property
    def in_optimizer_step(self) -> bool:
        """Whether an optimizer step is running now (set by the tracker's global optimizer hooks)."""
        return self._in_opt

    @property
    def in_activation_checkpoint(self) -> bool:
        """Whether a forward under activation checkpointing is running now (its outputs are recomputed, not kept)."""
        return self._in_ac

    @property
    def running_module_names(self) -> Any:
        """Qualified names of the modules running now (the stack of the tracker's ``ModTracker``)."""
        return self._mod_tracker.parents

    def known_name(self, module: nn.Module) -> str | None:
        """The qualified name the tracker's ``ModTracker`` gave ``module``, if it saw it."""
        return self._mod_tracker.get_known_fqn(module)

    @property
    def current_snapshot(self) -> dict[Any, dict[Any, int]]:
        """Bytes live now per device and category (the dict the tracker updates in place)."""
        return self._curr_mem_snap

    @property
    def peak_bytes(self) -> dict[Any, int]:
        """Peak total bytes per device so far (mutable: an override of :meth:`update_peak_stats` writes it)."""
        return self._peak_mem

    @property
    def peak_snapshot(self) -> dict[Any, dict[Any, int]]:
        """Per device, the category breakdown at its peak (mutable, like :attr:`peak_bytes`)."""
        return self._peak_mem_snap

    def storage_record(self, storage: torch.UntypedStorage) -> Any:
        """The tracker's record of ``storage`` (its ``_WeakRefInfo``: size, device, category), or ``None`` when untracked.
        ``memory.replay`` asks which record a region's output lives in; the stock tracker keeps them privately."""
        record, _ = self._WINFO.get(storage, (None, None))
        return record

    @property
    def grad_hook_handles(self) -> Any:
        """Parameter -> its gradient hooks' handles: the tracker removes them on exit, so new hooks are kept here."""
        return self._param_to_grad_hook_handles

    # ---------------------------------------------------------------- bookkeeping the stock tracker does
    def track_tensor(self, reftype: Any, t: torch.Tensor) -> None:
        """Count ``t``'s storage under ``reftype`` (the stock per-op bookkeeping of one output)."""
        self._track(reftype, t)

    def track_inputs(self, inputs: Any) -> int:
        """Count the tensors in a module's inputs; their bytes (the stock pre-forward bookkeeping)."""
        return self._track_inputs_or_outputs(inputs)

    def track_storages_of(self, t: torch.Tensor, reftype: Any) -> list[Any]:
        """Count ``t``'s storages under ``reftype`` (created if new); the records, with ``mem_consumed``."""
        return self._update_and_maybe_create_winfos(t, reftype)

    # ---------------------------------------------------------------- hooks: stock private names -> public overrides
    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                     old_reftype: Any = None) -> None:
        self.on_memory_update(u_type, winfo, old_mem_consumed, old_reftype)

    def on_memory_update(self, u_type: Any, winfo: Any, old_mem_consumed: int | None, old_reftype: Any) -> None:
        """Every change of live bytes (``UpdateType.ADD``, ``DEL``, ``SIZE``, ``REF``) goes through here."""
        MemTracker._update_snap(self, u_type, winfo, old_mem_consumed, old_reftype)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        self.pre_forward(module, inputs)

    def pre_forward(self, module: nn.Module, inputs: Any) -> None:
        """Before a module's forward: the stock version records its entry snapshot (and refuses a repeated call)."""
        MemTracker._pre_fw_hook(self, module, inputs)

    def _pre_bw_hook(self, module: nn.Module | None, grad_outputs: Any) -> None:
        self.pre_backward(module, grad_outputs)

    def pre_backward(self, module: nn.Module | None, grad_outputs: Any) -> None:
        """Before a module's backward (``module`` may be ``None`` where it is no longer alive): the stock version
        records its entry snapshot."""
        MemTracker._pre_bw_hook(self, module, grad_outputs)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        return self.track_parameters_and_buffers(module, install_grad_hooks)

    def track_parameters_and_buffers(self, module: nn.Module, install_grad_hooks: bool) -> tuple[int, int]:
        """Count a module's parameters and buffers; ``(parameter bytes, buffer bytes)``."""
        return MemTracker._track_module_params_and_buffers(self, module, install_grad_hooks)

    def _update_peak_stats(self, peak_state: Any) -> None:
        self.update_peak_stats(peak_state)

    def update_peak_stats(self, peak_state: Any) -> None:
        """After an op: raise the running modules' and the global peaks (``ModState.PEAK_FW`` or ``PEAK_BW``)."""
        MemTracker._update_peak_stats(self, peak_state)


# ------------------------------------------------------------------------------------ the registry
# private name (as torch spells it) -> the name in this module that wraps it
PRIVATE_NAMES: dict[str, str] = {
    "torch.distributed._tools.mem_tracker.MemTracker": "MemTracker",
    "torch.distributed._tools.mem_tracker._MemRefType": "MemRefType",
    "torch.distributed._tools.mem_tracker._ModState": "ModState",
    "torch.distributed._tools.mem_tracker._UpdateType": "UpdateType",
    "torch.ops._c10d_functional.wait_tensor": "wait_tensor_op",
    "MemTracker()._depth": "MemTrackerBase.depth",
    "MemTracker()._mod_tracker": "MemTrackerBase.in_backward",
    "ModTracker()._fw_pre_hook": "MemTrackerBase.__init__",
    "MemTracker()._in_opt": "MemTrackerBase.in_optimizer_step",
    "MemTracker()._in_ac": "MemTrackerBase.in_activation_checkpoint",
    "MemTracker()._curr_mem_snap": "MemTrackerBase.current_snapshot",
    "MemTracker()._peak_mem": "MemTrackerBase.peak_bytes",
    "MemTracker()._peak_mem_snap": "MemTrackerBase.peak_snapshot",
    "MemTracker()._param_to_grad_hook_handles": "MemTrackerBase.grad_hook_handles",
    "MemTracker()._WINFO": "MemTrackerBase.storage_record",
    "MemTracker._track": "MemTrackerBase.track_tensor",
    "MemTracker._track_inputs_or_outputs": "MemTrackerBase.track_inputs",
    "MemTracker._update_and_maybe_create_winfos": "MemTrackerBase.track_storages_of",
    "MemTracker._update_snap": "MemTrackerBase.on_memory_update",
    "MemTracker._pre_fw_hook": "MemTrackerBase.pre_forward",
    "MemTracker._pre_bw_hook": "MemTrackerBase.pre_backward",
    "MemTracker._track_module_params_and_buffers": "MemTrackerBase.track_parameters_and_buffers",
    "MemTracker._update_peak_stats": "MemTrackerBase.update_peak_stats",
}
