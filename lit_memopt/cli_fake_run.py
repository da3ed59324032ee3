"""The recipe as ``lit-memopt fit`` builds it, with fake language-model weights, for the estimator and the planner.

``build_fake_run`` is :func:`lit_memopt.cli.instantiate_run` with the language models built on fake tensors (with fewer
blocks for block extrapolation), the recipe's ``ActivationCheckpointing`` callbacks applied as their ``setup`` would,
and (given a device mesh, ``memory.fake_ranks``) the module sharded by its ``configure_model``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any

from lit_memopt._compat.lightning import set_device_mesh
from lit_memopt.memory.fake import adopt_fakes
from lit_memopt.memory.offload import modelled_host_offload
from lit_memopt.memory.step import EstimateError
from lit_memopt.models.hf import checkpoint_period

__all__ = [
    "activation_checkpointing_callbacks",
    "block_count",
    "build_fake_run",
    "build_measured_module",
    "checkpoint_period_of",
    "step_config",
    "with_blocks",
    "with_fake_weights",
]


def block_count(model_config: Any) -> int | None:
    """Decoder blocks the config builds (``None``: not known from the config, e.g. a local checkpoint)."""
    if getattr(model_config, "pretrained", None) is not None:
        return None
    arch = getattr(model_config, "arch", None)
    if isinstance(arch, dict) and isinstance(arch.get("num_hidden_layers"), int):
        return int(arch["num_hidden_layers"])
    value = getattr(model_config, "num_layers", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def with_blocks(model_config: Any, blocks: int) -> Any:
    """A copy of ``model_config`` that builds ``blocks`` decoder blocks."""
    arch = getattr(model_config, "arch", None)
    if isinstance(arch, dict) and "num_hidden_layers" in arch:
        out = copy.copy(model_config)
        object.__setattr__(out, "arch", {**arch, "num_hidden_layers": blocks})
        return out
    return dataclasses.replace(model_config, num_layers=blocks)


def with_fake_weights(model_config: Any) -> Any:
    """A copy of ``model_config`` whose ``build_model`` makes the language model with fake weights.

    Everything else the module builds (a small reward classifier GRADE trains at start, LoRA adapters)
    stays real: a step that mixes the two converts the real tensors to fake ones on use.
    """
    from lit_memopt._compat.torch import FastFakeTensorMode

    build_model = model_config.build_model
    mode = FastFakeTensorMode(allow_non_fake_inputs=True)

    def fake_build_model(*args: Any, apply_lora: bool = True, **kwargs: Any) -> Any:
        lora = getattr(model_config, "lora", None)
        with mode:
            if lora:
                model = build_model(*args, apply_lora=False, **kwargs)
            else:
                model = build_model(*args, **kwargs)
        if lora and apply_lora:
            # Adapters are small: peft creates them with real tensors next to the fake base weights.
            model = model_config.apply_lora(model)
        return model

    out = copy.copy(model_config)
    object.__setattr__(out, "build_model", fake_build_model)
    object.__setattr__(out, "fake_mode", mode)  # build_fake_run re-makes fakes of other modes in it (adopt_fakes)
    return out


def checkpoint_period_of(cfg: Any, callbacks: list[Any] | None = None) -> int:
    """The recipe's checkpointing period: ``k`` where ``module.gradient_checkpointing=k`` or an
    ``ActivationCheckpointing(every_k_layers=k)`` callback checkpoints every k-th decoder block (k >= 2), else 1
    (every block, or none: either is the same for each block); both: their least common multiple.

    ``callbacks``: the recipe's ``ActivationCheckpointing`` callbacks when already built (else built here)."""
    value = (cfg.get("module") or {}).get("gradient_checkpointing")
    period = checkpoint_period(value, "module.gradient_checkpointing") if value not in (None, False, True) else 1
    for callback in activation_checkpointing_callbacks(cfg) if callbacks is None else callbacks:
        if callback.recompute:  # an offload-only callback treats every block alike
            period = math.lcm(period, callback.every_k_layers)
    return max(period, 1)


def activation_checkpointing_callbacks(cfg: Any) -> list[Any]:
    """The recipe's ``ActivationCheckpointing`` callbacks (``callbacks.*``), built: they change a step's memory, so
    the estimator applies them to its module as the run's ``setup`` would."""
    from hydra.utils import instantiate

    from lit_memopt.callbacks.activation_checkpointing import ActivationCheckpointing

    found = []
    for value in (cfg.get("callbacks") or {}).values():
        target = value.get("_target_", "") if hasattr(value, "get") else ""
        if str(target).rsplit(".", 1)[-1] == ActivationCheckpointing.__name__:
            found.append(instantiate(value))
    return found


def step_config(cfg: Any) -> Any:
    """The recipe's config for one training step, estimated or measured: no logger or callbacks (a step
    trains nothing, and they need a Hydra run directory), and nothing trained before it."""
    from omegaconf import OmegaConf, open_dict

    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k not in ("logger", "callbacks", "hydra")])
    with open_dict(cfg):
        cfg.logger = None
        cfg.callbacks = None
        reward = OmegaConf.select(cfg, "module.reward_model")
        if OmegaConf.is_dict(reward) and "train_steps" in reward:
            # A reward classifier trained at start (GRADE's rule reward) has the same tensors untrained:
            # its weights' values do not change the memory of a step, and training it took most of the
            # estimate's time at a 150k vocabulary.
            reward.train_steps = 0
        if OmegaConf.is_dict(OmegaConf.select(cfg, "module.warm_start")):
            # The supervised warm start happens before training: it changes weight values, not a step's memory.
            cfg.module.warm_start.steps = 0
    return cfg


def build_fake_run(cfg: Any, blocks: int | None, callbacks: list[Any] | None = None, mesh: Any = None) -> Any:
    """``instantiate_run(cfg)`` with fake language-model weights and ``blocks`` blocks (``None``: as configured).

    ``callbacks``: the recipe's ``ActivationCheckpointing`` callbacks when already built (else built here). ``mesh``: a
    device mesh (``memory.fake_ranks``) the module's ``configure_model`` shards it over, as ``ModelParallelStrategy``
    has it do."""
    from lit_memopt.cli import instantiate_run

    modes = []

    def prepare(model_config: Any) -> Any:
        if not hasattr(model_config, "build_model"):
            raise EstimateError(f"estimate: {type(model_config).__name__} has no build_model(); cannot build it with fake weights")
        prepared = with_fake_weights(model_config if blocks is None else with_blocks(model_config, blocks))
        modes.append(prepared.fake_mode)
        return prepared

    with warnings.catch_warnings():
        # A module that copies its policy for a frozen reference (Intuitor, GRPO) deep-copies fake weights here, and
        # torch's Tensor.__deepcopy__ asks each for a data pointer, which it warns is deprecated on fake tensors.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        run = instantiate_run(step_config(cfg), prepare_model_config=prepare)
    module = run.module
    if modes:
        # One mode for the module's fakes: each model built here has its own (a reference copied from the policy
        # stays in the policy's, see FastFakeTensorMode.__deepcopy__).
        adopt_fakes(module, modes[-1])
    for callback in activation_checkpointing_callbacks(cfg) if callbacks is None else callbacks:
        # as the callback's setup wraps the layers; its activation offload as device memory sees it (memory.offload)
        callback.apply(module, offload_hooks=modelled_host_offload)
    if hasattr(module, "sandbox") and module.sandbox is None and callable(getattr(module, "setup", None)):
        # A module that executes generated code (CRSP) starts its sandbox in setup; outside "fit", setup
        # does nothing else, in particular nothing that needs a Trainer.
        module.setup("validate")
    if mesh is not None:
        set_device_mesh(module, mesh)
    if callable(getattr(module, "configure_model", None)):
        # Where modules build or shard their model (a no-op without a device mesh).
        module.configure_model()
    return run


def build_measured_module(cfg: Any) -> Any:
    """The recipe's module with real weights, as ``fit`` runs it: its ``ActivationCheckpointing`` callbacks applied
    as their ``setup`` would (offload included), so that a CUDA measurement runs the step the estimate traced."""
    from lit_memopt.cli import instantiate_run

    module = instantiate_run(step_config(cfg)).module
    for callback in activation_checkpointing_callbacks(cfg):
        callback.apply(module)
    return module
