"""Private names of ``torch.distributed`` (FSDP2's param groups and collectives, the activation-checkpoint wrapper).

Each behind one function or re-export that says why no public API does the job; ``tests/test_compat.py`` checks every
name listed in :data:`PRIVATE_NAMES` against the installed torch. No Lightning here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

# torch's activation-checkpoint wrapper (non-reentrant ``torch.utils.checkpoint`` around a module, with state-dict
# hooks that keep the unwrapped parameter names) and its selection walk. Lightning's strategies and torchtitan use it
# from this module; torch has no public home for it.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    ActivationWrapper,
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

__all__ = [
    "ActivationWrapper",
    "CheckpointImpl",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "CHECKPOINT_WRAPPED_MODULE",
    "wrapped_module",
    "fsdp_comm_base_classes",
    "fsdp_param_groups",
    "fsdp_comms",
    "set_fsdp_comms",
    "is_fsdp_root",
    "drop_unsharded_gradients",
    "fake_backend",
    "observed_fsdp_storage",
    "PRIVATE_NAMES",
]

# ------------------------------------------------------------------------------------ activation checkpointing

#: The attribute an ``ActivationWrapper`` keeps its module under: a segment of every wrapped module's qualified name.
CHECKPOINT_WRAPPED_MODULE: str = _CHECKPOINT_WRAPPED_MODULE


def wrapped_module(wrapper: ActivationWrapper) -> nn.Module:
    """The module an ``ActivationWrapper`` wraps: torch keeps it in a private attribute and has no accessor."""
    return getattr(wrapper, CHECKPOINT_WRAPPED_MODULE)


# ------------------------------------------------------------------------------------ FSDP2 (fully_shard)
def fsdp_comm_base_classes() -> tuple[type, type]:
    """``(AllGather, ReduceScatter)``: the interfaces of FSDP2's custom collectives.

    ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` are public and take instances of these, but
    torch exports the classes only from ``torch.distributed.fsdp._fully_shard._fsdp_api``.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def fsdp_param_groups(fsdp_module: nn.Module) -> list[Any]:
    """The parameter groups of one ``fully_shard``-ed module (one per mesh; usually one): FSDP2's internal state."""
    return list(fsdp_module._get_fsdp_state()._fsdp_param_groups)


def fsdp_comms(group: Any) -> tuple[Any, Any]:
    """``(all-gather, reduce-scatter)`` a param group runs now (torch's defaults, or a user's custom ones).

    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` have no getter, and a guard must wrap whatever is
    installed; they also refuse modules with several param groups, so the guards are set per group here.
    """
    return group._all_gather_comm, group._reduce_scatter_comm


def set_fsdp_comms(group: Any, all_gather: Any, reduce_scatter: Any) -> None:
    """Install ``all_gather`` and ``reduce_scatter`` on one param group (see :func:`fsdp_comms` for why per group)."""
    group._all_gather_comm = all_gather
    group._reduce_scatter_comm = reduce_scatter


def is_fsdp_root(fsdp_module: nn.Module) -> bool:
    """Whether FSDP2 made this module a root (the one ``reset_iter_state`` must be called on).

    FSDP2 decides the roots lazily, at the first forward; the decision is kept in its state, not exposed.
    """
    return bool(fsdp_module._get_fsdp_state()._is_root)


def drop_unsharded_gradients(fsdp_module: nn.Module) -> None:
    """Drop the unsharded gradients FSDP2 keeps for the parameters of one module after an aborted backward.

    ``reset_iter_state`` reshards parameters but keeps these buffers (``unsharded_accumulated_grad`` and the
    ``.grad`` of the unsharded parameter), and the next backward would add the failed attempt's partial gradients
    to them. They live on FSDP2's internal ``FSDPParam`` objects; no public call clears them.
    """
    for group in fsdp_param_groups(fsdp_module):
        for fsdp_param in group.fsdp_params:
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


@contextlib.contextmanager
def observed_fsdp_storage(allocating: Callable[[torch.Tensor, int], None],
                          freed: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within the block, FSDP2's in-place storage changes are reported: ``allocating(tensor, nbytes)`` before it gives a
    tensor's storage ``nbytes`` (it may raise to refuse), ``freed(tensor)`` after it empties one.

    FSDP2 gathers a block into storages it keeps between uses, and frees and re-allocates them with
    ``UntypedStorage.resize_`` (its gathered parameters and all-gather buffers), which no ATen op reports; a dispatch
    mode (``memory.budget``) sees neither. Both go through two module functions of ``_fsdp_param`` (one also imported
    by ``_fsdp_param_group``), replaced here and put back after. Nested blocks wrap each other.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    group_alloc = _fsdp_param_group.alloc_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.itemsize  # what FSDP2's own function gives the storage
        if tensor.untyped_storage().size() != nbytes:
            allocating(tensor, nbytes)
        alloc(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        had = tensor.untyped_storage().size()
        free(tensor)
        if had:
            freed(tensor)

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc_storage, free_storage
    _fsdp_param_group.alloc_storage = alloc_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
        _fsdp_param_group.alloc_storage = group_alloc


# ------------------------------------------------------------------------------------ the fake process group
def fake_backend() -> str:
    """The name of torch's ``fake`` process-group backend, registered: one process stands in for a rank of any world size.

    Its collectives do nothing, yet FSDP2 allocates what it would (gathered blocks, reduce-scatter buffers), so a rank's
    step traced under fake tensors holds what a real rank holds. ``dist.Backend.FAKE`` is public, but torch registers the
    backend only when ``torch.testing._internal.distributed.fake_pg`` is imported (torchtitan's memory estimator does the
    same); its ``FakeStore`` is not needed (``dist.HashStore`` does the job).
    """
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the backend

    return str(dist.Backend.FAKE)


# ------------------------------------------------------------------------------------ the registry
# private name (as torch spells it) -> the function or re-export of this module that wraps it
PRIVATE_NAMES: dict[str, str] = {
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper": "ActivationWrapper",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointImpl": "CheckpointImpl",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing":
        "apply_activation_checkpointing",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper": "checkpoint_wrapper",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE": "CHECKPOINT_WRAPPED_MODULE",
    "ActivationWrapper()._checkpoint_wrapped_module": "wrapped_module",
    "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather": "fsdp_comm_base_classes",
    "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter": "fsdp_comm_base_classes",
    "FSDPModule._get_fsdp_state": "fsdp_param_groups",
    "FSDPState()._fsdp_param_groups": "fsdp_param_groups",
    "FSDPParamGroup()._all_gather_comm": "fsdp_comms",
    "FSDPParamGroup()._reduce_scatter_comm": "fsdp_comms",
    "FSDPState()._is_root": "is_fsdp_root",
    "FSDPParamGroup().fsdp_params": "drop_unsharded_gradients",
    "FSDPParam().unsharded_accumulated_grad": "drop_unsharded_gradients",
    "FSDPParam()._unsharded_param": "drop_unsharded_gradients",
    "torch.testing._internal.distributed.fake_pg": "fake_backend",
    "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage": "observed_fsdp_storage",
    "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage": "observed_fsdp_storage",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.alloc_storage": "observed_fsdp_storage",
}
