"""Private names of core torch (not ``torch.distributed``), each behind one function or re-export that says why.

Pure PyTorch: ``lit_memopt.ops`` imports this module, so it never imports Lightning. The modules imported at the top
are the ones ``import torch`` has loaded already; the rest are imported where they are used. ``tests/test_compat.py``
checks every name listed in :data:`PRIVATE_NAMES` against the installed torch.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

# Fake tensors (shapes, dtypes and devices, no storage) are how an estimate runs a 4B model's step on a CPU. torch has
# them only under torch._subclasses (torch.export and torch.compile use them inside); no public module re-exports them.
from torch._subclasses import fake_tensor as _fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

# The fake mode active now (the one an op runs under), which a tracker compares with the one it was entered in. torch
# keeps it in its tracing guards; there is no public getter.
from torch._guards import active_fake_mode

# Dispatch modes see every ATen op (forward, autograd's backward, optimizer updates): the memory-budget simulator and
# the worst-case value follower are modes. Documented by torch (``__torch_dispatch__``), but only under this module.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

# torch's pytree flattens op arguments and outputs exactly as the dispatcher does (its registered node types) and
# unflattens them with a spec; torch 2.13 has no public pytree module, and Lightning's ``apply_to_collection``
# keeps no spec to rebuild an op's ``(args, kwargs)`` from.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "is_fake",
    "active_fake_mode",
    "TorchDispatchMode",
    "is_traceable_wrapper_subclass",
    "disable_current_modes",
    "tree_flatten",
    "tree_unflatten",
    "tree_map",
    "tree_leaves",
    "storage_key",
    "op_schema",
    "local_scalar_dense_op",
    "raised_recompile_limit",
    "cpu_has_native_low_precision_matmul",
    "start_cuda_memory_history",
    "stop_cuda_memory_history",
    "dump_cuda_memory_snapshot",
    "reset_grad_scaler_step",
    "tensor_version",
    "is_counted_by_lr_scheduler",
    "mark_counted_by_lr_scheduler",
    "PRIVATE_NAMES",
]


# ------------------------------------------------------------------------------------ tensors and ops
def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor, or a wrapper subclass (DTensor) around one: torch has no public predicate."""
    return bool(_fake_tensor.is_fake(t))


def storage_key(storage: torch.UntypedStorage) -> int:
    """A key that tells storages apart while they live, fake and meta ones included.

    ``untyped_storage()`` returns a new Python object at every call, so ``id`` cannot key it, and ``data_ptr()`` is 0
    for every empty, meta or fake storage; ``_cdata`` is the address of the storage itself.
    """
    return storage._cdata


def op_schema(func: Any) -> Any:
    """The ``FunctionSchema`` of an ATen op overload (its arguments, which ones it writes): no public accessor."""
    return func._schema


def local_scalar_dense_op() -> Any:
    """The ATen op that ``Tensor.item()`` dispatches to: a dispatch mode that answers ``.item()`` must match it."""
    return torch.ops.aten._local_scalar_dense.default


@contextlib.contextmanager
def raised_recompile_limit(graphs: int | None) -> Iterator[None]:
    """Let torch.compile keep at least ``graphs`` graphs per function inside the block; the user's limit is back after.

    ``torch.compiler`` exposes no setting for it; dynamo's config does, under ``recompile_limit`` (``cache_size_limit``
    before torch 2.6). Past the limit a function runs eagerly without a word.
    """
    if graphs is None:  # nothing to raise: dynamo is not even imported
        yield
        return
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    previous = getattr(config, name)
    raise_it = previous < graphs
    if raise_it:
        setattr(config, name, graphs)
    try:
        yield
    finally:
        if raise_it:
            setattr(config, name, previous)


def cpu_has_native_low_precision_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bf16/fp16) matrices in hardware (oneDNN's check of the ISA).

    ``torch.backends.mkldnn`` says only whether oneDNN is built in, not what the CPU runs natively.
    """
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# ------------------------------------------------------------------------------------ CUDA allocator history
def start_cuda_memory_history(max_entries: int) -> None:
    """Record the CUDA allocator's events (with stack traces) for a later snapshot.

    The memory-snapshot API documented at https://pytorch.org/docs/stable/torch_cuda_memory.html has only these
    underscore names; ``torch.accelerator.memory`` has no recorder.
    """
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    """Stop recording the CUDA allocator's events (see :func:`start_cuda_memory_history`)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded allocator history as a pickle for https://pytorch.org/memory_viz (see above)."""
    torch.cuda.memory._dump_snapshot(path)


# ------------------------------------------------------------------------------------ optimizers
def reset_grad_scaler_step(scaler: Any) -> None:
    """Forget what a ``GradScaler`` recorded about this step's optimizers (``unscale_`` done, infs found).

    After a micro-batch that ran out of memory the step starts again; ``GradScaler.update()`` would clear this too but
    also changes the scale. A scaler without this state (not torch's) is left alone.
    """
    if not hasattr(scaler, "_per_optimizer_states"):
        return
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (views share it with their base): whether an update touched ``t``.

    Autograd keeps it to detect in-place changes of saved tensors and exposes it only as ``_version``.
    """
    return t._version


def is_counted_by_lr_scheduler(step: Callable[..., Any]) -> bool:
    """Whether ``optimizer.step`` is an LR scheduler's counting wrapper (it marks it with an attribute)."""
    return hasattr(step, "_wrapped_by_lr_sched")


def mark_counted_by_lr_scheduler(step: Callable[..., Any]) -> None:
    """Mark a wrapper of ``optimizer.step`` that still calls the scheduler's counting wrapper inside.

    Without the mark the scheduler warns at its first step that ``optimizer.step()`` was overridden after it was
    created; the attribute is what it checks, with no public way to say so.
    """
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ the registry
# private name (as torch spells it) -> the function or re-export of this module that wraps it
PRIVATE_NAMES: dict[str, str] = {
    "torch._subclasses.fake_tensor.FakeTensor": "FakeTensor",
    "torch._subclasses.fake_tensor.FakeTensorMode": "FakeTensorMode",
    "torch._subclasses.fake_tensor.DataDependentOutputException": "DataDependentOutputException",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException": "DynamicOutputShapeException",
    "torch._subclasses.fake_tensor.is_fake": "is_fake",
    "torch._guards.active_fake_mode": "active_fake_mode",
    "torch.utils._python_dispatch.TorchDispatchMode": "TorchDispatchMode",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass": "is_traceable_wrapper_subclass",
    "torch.utils._python_dispatch._disable_current_modes": "disable_current_modes",
    "torch.utils._pytree.tree_flatten": "tree_flatten",
    "torch.utils._pytree.tree_unflatten": "tree_unflatten",
    "torch.utils._pytree.tree_map": "tree_map",
    "torch.utils._pytree.tree_leaves": "tree_leaves",
    "torch.UntypedStorage()._cdata": "storage_key",
    "torch._ops.OpOverload._schema": "op_schema",
    "torch.ops.aten._local_scalar_dense": "local_scalar_dense_op",
    "torch._dynamo.config.recompile_limit": "raised_recompile_limit",
    "torch.ops.mkldnn._is_mkldnn_bf16_supported": "cpu_has_native_low_precision_matmul",
    "torch.ops.mkldnn._is_mkldnn_fp16_supported": "cpu_has_native_low_precision_matmul",
    "torch.cuda.memory._record_memory_history": "start_cuda_memory_history",
    "torch.cuda.memory._dump_snapshot": "dump_cuda_memory_snapshot",
    "torch.amp.GradScaler()._per_optimizer_states": "reset_grad_scaler_step",
    "torch.amp.grad_scaler._refresh_per_optimizer_state": "reset_grad_scaler_step",
    "torch.Tensor()._version": "tensor_version",
    "torch.optim.lr_scheduler (optimizer.step)._wrapped_by_lr_sched": "mark_counted_by_lr_scheduler",
}
