"""Activation offload: the tensors autograd saves for backward kept in host memory, for real and as the estimator
models it.

Both are ``torch.autograd.graph.saved_tensors_hooks`` pairs that share one rule, :func:`offloads`: every saved tensor
is moved except a parameter (or a view of one). ``torch.autograd.graph.save_on_cpu`` copies parameters too, so every
linear layer's weight would be copied to the host in forward and back in backward: a full copy of the model's
weights over PCIe per micro-batch that saves no device memory, since the parameter stays on the device anyway.

- :func:`host_offload` (training): each saved tensor is copied into host memory (pinned when asked) in forward and
  copied back to its device when backward unpacks it.
- :func:`modelled_host_offload` (the fake-tensor estimator): the device memory of the same mechanics without a host
  copy. A saved tensor is dropped in forward (its device storage is freed once nothing else holds it, exactly as
  after a real copy to the host) and a new device tensor of its size is allocated when backward unpacks it (the
  real copy back). The values are gone, which only a trace on fake tensors can afford; the bytes moved to the host
  are counted in :data:`OFFLOAD_METER`, which the estimator reads per step for the plan's time model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lit_memopt._compat.torch import view_base

__all__ = ["OFFLOAD_METER", "OffloadMeter", "host_offload", "modelled_host_offload", "offloads"]


def offloads(tensor: torch.Tensor) -> bool:
    """Whether activation offload moves this saved tensor to the host: everything but parameters and their views."""
    return not (isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter))


@contextlib.contextmanager
def host_offload(pin_memory: bool = False) -> Iterator[None]:
    """Keep the tensors autograd saves in this context in host memory until backward needs them.

    ``pin_memory``: pin the host copies (needs CUDA), so that both copies run asynchronously on the current stream.
    """

    def pack(tensor: torch.Tensor):
        if not offloads(tensor):
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
        host.copy_(tensor, non_blocking=pin_memory)
        return tensor.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=pin_memory)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class OffloadMeter:
    """Bytes :func:`modelled_host_offload` moved to the host since the last :meth:`take`."""

    def __init__(self) -> None:
        self.bytes = 0

    def take(self) -> int:
        """The bytes counted so far, and start again from zero."""
        counted, self.bytes = self.bytes, 0
        return counted


# The one meter the estimator reads: a trace runs one step at a time in its process (a forked trace has its own copy).
OFFLOAD_METER = OffloadMeter()


@dataclass(frozen=True)
class _Dropped:
    """What a modelled offload keeps of a saved tensor: enough to allocate its copy back."""

    size: torch.Size
    dtype: torch.dtype
    device: torch.device


@contextlib.contextmanager
def modelled_host_offload(meter: OffloadMeter = OFFLOAD_METER) -> Iterator[None]:
    """:func:`host_offload` as device memory sees it, for fake tensors: a saved tensor is dropped in forward and a
    device tensor of its size is allocated when backward unpacks it; ``meter`` counts the bytes a real run moves."""

    def pack(tensor: torch.Tensor):
        if not offloads(tensor):
            return tensor
        meter.bytes += tensor.numel() * tensor.element_size()
        return _Dropped(tensor.size(), tensor.dtype, tensor.device)

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        # the copy back is contiguous, as host_offload's is
        return torch.empty(packed.size, dtype=packed.dtype, device=packed.device)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
