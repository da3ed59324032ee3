"""One process standing in for one rank of many: torch's fake process group, for tracing a sharded step.

Under FSDP2 a rank holds its shards of the model state plus what the sharding adds while it runs: blocks gathered
whole (with one prefetched), gradients awaiting their reduce-scatter, the collectives' buffers. Traced under fake
tensors inside :func:`fake_process_group`, a module sharded over the yielded mesh runs FSDP2's own code: its
collectives do nothing, but every buffer they would fill is allocated where and when a real rank allocates it. The
rank's allocation log then replays through the allocator model like a one-device step's, so its reserved figure is
that rank's own rather than the one-device step's overhead carried over (``memory.sharding``).

What it does not see: CUDA streams (FSDP2 gathers on a side stream and the caching allocator keeps a block used on
two streams until both are done with it, which a real rank can hold a little longer than the trace does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lit_memopt._compat.distributed import fake_backend
from lit_memopt.memory.blocks import estimate_with_blocks
from lit_memopt.memory.step import PeakEstimate, estimate_peak

__all__ = ["DATA_PARALLEL_DIM", "estimate_rank", "fake_process_group"]

# The mesh dimension name Lightning's ModelParallelStrategy gives data parallelism (models.sharding reads it).
DATA_PARALLEL_DIM = "data_parallel"


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[DeviceMesh]:
    """Within the block this process is rank 0 of ``world_size`` fake ranks; yields their 1-D data-parallel mesh.

    Raises:
        ValueError: ``world_size`` is not a positive integer.
        RuntimeError: a process group already exists (a real run's, or another fake one): the fake one would
            replace it for everything in this process.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fake_process_group: world_size must be a positive integer, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError("fake_process_group: this process already has a process group; a fake one cannot stand in "
                           "for a rank here (estimate outside the distributed run)")
    dist.init_process_group(fake_backend(), store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=(DATA_PARALLEL_DIM,))
    finally:
        dist.destroy_process_group()


def estimate_rank(build: Callable[[int | None, DeviceMesh], torch.nn.Module], batch: Any, world_size: int, *,
                  num_blocks: int | None = None, period: int = 1, check: bool = True, parallel: bool = False,
                  **kwargs: Any) -> PeakEstimate:
    """The step of rank 0 of ``world_size`` data-parallel ranks, traced under a fake process group.

    Args:
        build: ``(blocks, mesh) -> module``: the module built with ``blocks`` decoder blocks (``None``: as configured)
            and sharded over ``mesh`` (its ``configure_model``, as the strategy would run it).
        batch: one rank's batch.
        world_size: data-parallel ranks, >= 1.
        num_blocks: the model's real block count, for block extrapolation (``memory.blocks``: the probes are built
            with 1, 2 and 3 blocks, or ``period`` times that); ``None``: the whole model is built and traced.
        period, check, parallel: as :func:`memory.blocks.estimate_with_blocks`.
        **kwargs: to :func:`memory.step.estimate_peak`.

    Raises:
        RuntimeError: this process already has a process group (see :func:`fake_process_group`).
    """
    with fake_process_group(world_size) as mesh, warnings.catch_warnings():
        # FSDP2 asks its fake buffers for a data pointer (torch warns: deprecated on fake tensors); the trace needs none
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        if num_blocks is None:
            est = estimate_peak(build(None, mesh), batch, **kwargs)
        else:
            # Where the line through the probes misses where a phase peaks at the full depth, the whole model is
            # traced (the caller's LinearityError fallback): a rank's backward peaks at the head's temporaries with
            # few blocks and on the blocks' activations with all of them (Qwen3-4B SFT over 8 ranks: 6.74 GiB on
            # the line, 11.06 traced).
            est = estimate_with_blocks(None, batch, num_blocks, build=lambda k: build(k, mesh), check=check,
                                       parallel=parallel, period=period, require_stitch=True, **kwargs)
    return dataclasses.replace(est, method=(
        f"{est.method}; traced as rank 0 of {world_size} on a fake process group (fsdp2: its shards, gathered blocks and "
        "gradients awaiting reduce-scatter as FSDP2 allocates them; allocator replayed per rank)"))
