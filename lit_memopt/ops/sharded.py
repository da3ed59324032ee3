"""Sharded (FSDP2 / DTensor) LM-head weights reaching the fused head ops.

Outside the model's forward, FSDP2 keeps a parameter as a ``DTensor`` sharded over its rows. The head
ops gather it once per call in its own dtype (a bf16 weight stays bf16: no fp32 ``[V, H]`` copy) and
compute on the plain tensor. The gather's backward is a reduce-scatter that averages over the data
parallel ranks, as FSDP2 does for every other gradient, so the gradient lands in the shard.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["gather_if_sharded"]


def gather_if_sharded(tensor: Optional[Tensor]) -> Optional[Tensor]:
    """``tensor`` unchanged, or, for a ``DTensor``, the full tensor whose gradient is averaged into the shard."""
    if tensor is None or not torch.distributed.is_available():  # a torch built without distributed has no DTensor
        return tensor
    from torch.distributed.tensor import DTensor, Partial  # public in every torch of the declared range

    if not isinstance(tensor, DTensor):
        return tensor
    # Every rank computed its own loss on its own data: the gradients are partial sums to average.
    return tensor.full_tensor(grad_placements=[Partial("avg")] * tensor.device_mesh.ndim)
