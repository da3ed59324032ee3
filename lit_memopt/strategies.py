"""Lightning strategies of the pack: ``ModelParallelStrategy`` with FSDP2's CPU offload as a switch.

``trainer=fsdp2`` (``conf/trainer/fsdp2.yaml``) instantiates :class:`ModelParallelStrategy`: Lightning's own, plus
``cpu_offload``. With ``cpu_offload=True`` every ``fully_shard`` of the pack's modules
(:func:`lit_memopt.models.sharding.shard_for_fsdp2`) gets torch's ``CPUOffloadPolicy``: the sharded parameters, their
gradients and the optimizer state live in host memory, each block's shard is copied to the device for its
all-gather, gradient shards are copied back after their reduce-scatter, and the optimizer step runs on the CPU.

The class keeps Lightning's name, so code that recognises FSDP2 by the strategy's class name (``_target_`` ending in
``ModelParallelStrategy``, ``type(strategy).__name__``) sees it as the same strategy. What it changes for offloading:

- ``model_to_device`` leaves FSDP's sharded parameters (``DTensor``\\ s) in host memory (Lightning's moves the whole
  module to the device, which FSDP2 refuses for offloaded parameters); every other parameter and buffer moves as
  before;
- after ``setup`` the optimizer's state tensors are put next to their parameters (Lightning moves them to the device;
  they are empty on a fresh fit, and a resumed state is loaded after ``setup`` onto the parameters' devices).

Checkpoints need nothing more: Lightning gathers the model and optimizer state dicts with torch's
``get_model_state_dict``/``get_optimizer_state_dict`` (``cpu_offload=True``: host tensors either way), and sharded
(distributed) checkpoints load into the host shards in place.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy

__all__ = ["ModelParallelStrategy", "states_next_to_parameters"]


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, data parallel in the pack) with ``cpu_offload``.

    Args:
        cpu_offload: offload the sharded parameters, gradients and optimizer state to host memory (torch's
            ``CPUOffloadPolicy``, pinned memory when CUDA is available); the modules read it when they shard.
        **kwargs: Lightning's ``ModelParallelStrategy`` arguments (``data_parallel_size``, ``tensor_parallel_size``,
            ``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).

    Raises:
        ValueError: ``cpu_offload`` is not a bool (``trainer.strategy.cpu_offload=true`` or ``false``).
    """

    def __init__(self, cpu_offload: bool = False, **kwargs: Any) -> None:
        if not isinstance(cpu_offload, bool):
            raise ValueError(
                f"trainer.strategy.cpu_offload must be true or false, got {cpu_offload!r} ({type(cpu_offload).__name__})"
            )
        super().__init__(**kwargs)
        self._cpu_offload = cpu_offload

    @property
    def cpu_offload(self) -> bool:
        """Whether ``fully_shard`` offloads parameters, gradients and optimizer state to host memory."""
        return self._cpu_offload

    def model_to_device(self) -> None:
        if not self._cpu_offload:
            super().model_to_device()
            return
        from torch.distributed.tensor import DTensor

        assert self.model is not None
        device = self.root_device
        with torch.no_grad():
            for module in self.model.modules():
                for param in module.parameters(recurse=False):
                    # FSDP's sharded parameters stay on the host; anything left out of fully_shard moves as usual
                    if not isinstance(param, DTensor) and param.device != device:
                        param.data = param.data.to(device)
                for name, buffer in list(module.named_buffers(recurse=False)):
                    if not isinstance(buffer, DTensor) and buffer.device != device:
                        setattr(module, name, buffer.to(device))

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self._cpu_offload:
            states_next_to_parameters(self.optimizers)


def states_next_to_parameters(optimizers: Any) -> None:
    """Move each optimizer state tensor to its parameter's device (``step`` counters stay where they are)."""
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        for param, state in inner.state.items():
            if not isinstance(state, dict):
                continue
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device != param.device:
                    state[key] = value.to(param.device)
