"""FSDP2 sharding of the pack's models: each decoder block, then the root, with ``fully_shard``.

Modules call :func:`shard_for_fsdp2` from ``configure_model``; it does nothing unless Lightning's
``ModelParallelStrategy`` set a device mesh, so the same module runs on one device, DDP and FSDP2.
The root group (embeddings, final norm, LM head) stays unsharded from the root's forward until its
backward (FSDP2 does not reshard the root after forward), which is why every forward goes through the
root (:func:`lit_memopt.models.hf.decoder_outputs`) and the fused head ops then see a plain weight.

With ``trainer.strategy.cpu_offload=true`` (the pack's :class:`lit_memopt.strategies.ModelParallelStrategy`) every
``fully_shard`` call also gets torch's ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state stay
in host memory and the optimizer step runs on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_memopt._compat.lightning import attached_trainer

__all__ = ["RootCall", "is_fsdp_sharded", "mixed_precision_policy", "offload_policy", "replicated_parameter_bytes",
           "strategy_offloads", "shard_blocks_and_root",
           "shard_for_fsdp2", "decoder_blocks"]


def is_fsdp_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or one of its submodules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def mixed_precision_policy(precision: Any) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning ``precision`` value (``None`` for full precision).

    bf16/fp16 precisions all-gather parameters in the half dtype and reduce gradients in fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    text = str(precision)
    if text.startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if text.startswith("16"):
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return None


def offload_policy(cpu_offload: bool) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` when ``cpu_offload`` (pinned host memory when CUDA is available), else ``None``."""
    if not cpu_offload:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def strategy_offloads(trainer: Any) -> bool:
    """Whether the trainer's strategy asks for CPU offload (``trainer.strategy.cpu_offload``; ``False`` without one).

    Raises:
        ValueError: a ``cpu_offload`` attribute that is not a bool.
    """
    value = getattr(getattr(trainer, "strategy", None), "cpu_offload", False)
    if not isinstance(value, bool):
        raise ValueError(f"trainer.strategy.cpu_offload must be true or false, got {value!r} ({type(value).__name__})")
    return value


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of the pack's TTT LM (``layers``) or of a transformers causal LM (its decoder's ``layers``)."""
    layers = getattr(model, "layers", None)  # the pack's TTTForCausalLM
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    from lit_memopt.models.hf import decoder_of

    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} to shard (expected .layers or .blocks)")
    return list(layers)


class RootCall(nn.Module):
    """An FSDP2 root that runs a whole function as its forward: ``RootCall(model)(fn, *args)``.

    For methods that call their model several times per step with inputs that need gradients (GRADE's
    soft tokens): FSDP2 would reshard a root after the backward of its first finished call while the
    other calls' backward still needs the gathered weights. With this root around the whole step, the
    model's top-level parameters are gathered once, stay gathered through every inner call, and are
    reduce-scattered at the end of backward. Keep it out of the module tree (it only wraps ``model``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


def shard_blocks_and_root(model: nn.Module, mesh: Any, precision: Any = None, root: nn.Module | None = None,
                          cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` each decoder block, then the root: ``root`` if given (a :class:`RootCall` around
    ``model``), else the causal LM (the base model under peft). ``cpu_offload``: every call gets
    :func:`offload_policy` (parameters, gradients and optimizer state in host memory)."""
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    policy = mixed_precision_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if cpu_offload:
        kwargs["offload_policy"] = offload_policy(True)
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    if root is None:
        root = model.get_base_model() if hasattr(model, "get_base_model") else model
    fully_shard(root, **kwargs)
    return model


def shard_for_fsdp2(module: Any, *models: nn.Module, root: nn.Module | None = None) -> None:
    """From a LightningModule's ``configure_model``: shard ``models`` when the strategy is FSDP2.

    A no-op without a device mesh (single device, DDP) and for models already sharded (a second
    ``fit`` on the same module). Frozen reference models are passed or not as the method needs.
    The strategy's ``cpu_offload`` (``trainer.strategy.cpu_offload``) offloads every sharded model.
    ``root`` (with one model) replaces the model's own root, e.g. a :class:`RootCall`.
    """
    mesh = getattr(module, "device_mesh", None)
    if mesh is None:
        return
    dims = mesh.mesh_dim_names or ()
    data_mesh = mesh["data_parallel"] if "data_parallel" in dims else mesh
    if "tensor_parallel" in dims and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "lit-memopt modules shard with data parallelism only: set tensor_parallel_size=1 in ModelParallelStrategy "
            f"(got {mesh['tensor_parallel'].size()})."
        )
    trainer = attached_trainer(module)
    precision = getattr(trainer, "precision", None)
    cpu_offload = strategy_offloads(trainer)
    if root is not None and len(models) != 1:
        raise ValueError("shard_for_fsdp2: `root` replaces the root of exactly one model")
    for model in models:
        if not is_fsdp_sharded(model):
            shard_blocks_and_root(model, data_mesh, precision, root=root, cpu_offload=cpu_offload)


def replicated_parameter_bytes(module: Any, total_blocks: int | None = None) -> int:
    """Parameter bytes of the frozen models ``module`` keeps whole on every rank under FSDP2.

    A pack module names them in its ``fsdp2_replicated`` attribute (GRADE's full reference copy and reward model,
    Intuitor's and CRSP's reference when there is no LoRA to share the base): ``configure_model`` shards only the
    trained model. ``total_blocks``: the real decoder depth when the module was built with fewer blocks (the
    estimator's fake module); a replicated model with fewer blocks counts its blocks at that depth.
    """
    total = 0
    for name in getattr(module, "fsdp2_replicated", ()):
        model = getattr(module, name, None)
        if not isinstance(model, nn.Module):
            continue
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        try:
            blocks = decoder_blocks(model)
        except ValueError:  # no decoder blocks (a small reward head): counted as built
            blocks = []
        if total_blocks and blocks and len(blocks) < total_blocks:
            per_block = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters()) // len(blocks)
            nbytes += per_block * (total_blocks - len(blocks))
        total += nbytes
    return total
