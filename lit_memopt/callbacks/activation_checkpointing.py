"""``ActivationCheckpointing``: non-reentrant activation checkpointing (and optional CPU offload) of chosen layers."""

from __future__ import annotations

import functools
import re
from typing import Callable, ContextManager, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lit_memopt._compat.distributed import (
    CHECKPOINT_WRAPPED_MODULE,
    ActivationWrapper,
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    wrapped_module,
)
from lit_memopt._compat.lightning import callback_state_key
from lit_memopt.memory.offload import host_offload

__all__ = ["ActivationCheckpointing"]

_WRAPPED_PREFIX = "." + CHECKPOINT_WRAPPED_MODULE


class _HostOffloadWrapper(ActivationWrapper):
    """Run the wrapped module under ``offload()`` (``memory.offload.host_offload``): the tensors autograd saves,
    parameters excepted, go to host memory.

    PyTorch's own ``OffloadWrapper`` (``save_on_cpu``) always pins host memory, which needs an accelerator, and
    copies every saved weight to the host and back as well; this one pins only when asked and leaves parameters
    where they are. Subclassing ``ActivationWrapper`` keeps its state-dict hooks, so checkpoints carry the
    unwrapped parameter names.
    """

    def __init__(self, module: nn.Module, offload: Callable[[], ContextManager]) -> None:
        super().__init__(module)
        self.offload = offload

    def forward(self, *args, **kwargs):
        with self.offload():
            return wrapped_module(self)(*args, **kwargs)


def _clean_name(name: str) -> str:
    """A module's name as the user wrote the model, without the wrappers' inner-module segments."""
    return name.replace(_WRAPPED_PREFIX, "")


class ActivationCheckpointing(Callback):
    """Trade compute for memory: recompute chosen layers' activations in backward instead of keeping them.

    Wraps the selected layers with PyTorch's ``checkpoint_wrapper`` in its non-reentrant mode
    (``torch.utils.checkpoint(use_reentrant=False)``): only each layer's inputs are kept, and its
    forward runs again during backward. Gradients are the same as without it (the RNG state is
    restored for the recomputation, so dropout matches). With ``every_k_layers=k`` only every
    k-th selected layer is checkpointed (selective checkpointing: less recomputation, less
    saving). With ``offload_to_cpu`` the tensors autograd keeps for the selected layers (the
    inputs of the checkpointed ones, all saved activations of the others; never the parameters)
    are moved to host memory (``memory.offload.host_offload``) and copied back for backward; on a
    CPU run there is nothing to offload to, so it says so and skips that part. With
    ``recompute=False`` nothing is checkpointed and only the offload applies (it must then be on).

    Layers are chosen by class name (``layer_classes``) or by a regular expression searched in
    the module's qualified name (``name_pattern``); a module matching either is selected, and
    modules inside a selected one are not selected again. By default it takes the decoder
    layers of a transformers model: the classes in the model's ``_no_split_modules`` (e.g.
    ``Qwen3DecoderLayer``), or failing that the children of a ``ModuleList`` named ``layers``.

    The layers are wrapped in ``setup`` (or, for modules that build their model in
    ``configure_model``, in ``on_fit_start``): parameters keep their identity, so optimizers
    are unaffected, and ``state_dict`` keys keep their unwrapped names. Applying it again
    (another ``fit``, or a model already wrapped by the user or a strategy) changes nothing.
    Transformers models get ``config.use_cache = False`` (a key/value cache filled in forward would be
    filled twice by the recomputation); ``generate`` still uses its own cache setting.
    Under FSDP prefer the strategy's ``activation_checkpointing_policy``, which wraps before sharding.

    Args:
        layer_classes: class name(s) of the layers to checkpoint, e.g. ``"Qwen3DecoderLayer"``.
        name_pattern: regular expression searched in qualified module names, e.g. ``r"layers\\.\\d+$"``.
        every_k_layers: checkpoint the 1st, (k+1)-th, (2k+1)-th, ... selected layer; ``1`` checkpoints all.
        offload_to_cpu: move the tensors saved for backward by the selected layers to host memory.
        recompute: checkpoint (recompute) the layers; ``False`` with ``offload_to_cpu``: offload only.
        pin_memory: pin the host copies (faster copies back; needs CUDA, ignored without it).
        preserve_rng_state: restore the RNG state when recomputing (needed for identical dropout).

    Raises:
        ValueError: in ``__init__`` for ``every_k_layers < 1``, an invalid ``name_pattern``,
            empty class names or ``recompute=False`` without ``offload_to_cpu``; in
            ``setup``/``on_fit_start`` when no layer matches.

    Example::

        from lightning.pytorch import Trainer
        from lit_memopt.callbacks import ActivationCheckpointing

        # every other decoder layer, the others' activations offloaded to host memory
        trainer = Trainer(callbacks=[ActivationCheckpointing(every_k_layers=2, offload_to_cpu=True)])
    """

    def __init__(
        self,
        layer_classes: str | Sequence[str] | None = None,
        name_pattern: str | None = None,
        every_k_layers: int = 1,
        offload_to_cpu: bool = False,
        pin_memory: bool = True,
        preserve_rng_state: bool = True,
        recompute: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(layer_classes, str):
            layer_classes = [layer_classes]
        classes = tuple(layer_classes) if layer_classes is not None else ()
        if any(not isinstance(c, str) or not c for c in classes):
            raise ValueError(f"ActivationCheckpointing(layer_classes={layer_classes!r}): give class names as non-empty strings.")
        if name_pattern is not None:
            try:
                re.compile(name_pattern)
            except re.error as error:
                raise ValueError(f"ActivationCheckpointing(name_pattern={name_pattern!r}) is not a valid regular expression: {error}") from None
        if isinstance(every_k_layers, bool) or not isinstance(every_k_layers, int) or every_k_layers < 1:
            raise ValueError(f"ActivationCheckpointing(every_k_layers={every_k_layers!r}): use a positive integer (1: every layer).")
        if not recompute and not offload_to_cpu:
            raise ValueError("ActivationCheckpointing(recompute=False, offload_to_cpu=False) would change nothing: "
                             "set offload_to_cpu=True to offload only, or keep recompute=True.")
        self.recompute = bool(recompute)
        self.layer_classes = classes
        self.name_pattern = name_pattern
        self.every_k_layers = every_k_layers
        self.offload_to_cpu = bool(offload_to_cpu)
        self.pin_memory = bool(pin_memory)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.checkpointed: list[str] = []
        self.offloaded: list[str] = []
        self.layer_types: list[str] = []
        self._applied = False

    @property
    def state_key(self) -> str:
        return callback_state_key(
            self, layer_classes=self.layer_classes, name_pattern=self.name_pattern, every_k_layers=self.every_k_layers
        )

    # --- selection --------------------------------------------------------------------------------
    def select_layers(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs this callback would wrap in ``root``, in forward order, outermost only."""
        classes = set(self.layer_classes)
        pattern = re.compile(self.name_pattern) if self.name_pattern is not None else None
        default_lists: list[str] = []
        if not classes and pattern is None:
            classes = _no_split_classes(root)
            if not classes:
                default_lists = [n for n, m in root.named_modules() if isinstance(m, nn.ModuleList) and n.split(".")[-1] == "layers"]
        selected: list[tuple[str, nn.Module]] = []
        for name, module in root.named_modules():
            if not name or isinstance(module, ActivationWrapper):
                continue
            clean = _clean_name(name)
            if any(clean.startswith(s + ".") for s, _ in selected):
                continue
            parent = clean.rpartition(".")[0]
            hit = (
                type(module).__name__ in classes
                or (pattern is not None and pattern.search(clean) is not None)
                or parent in default_lists
            )
            if hit:
                selected.append((clean, module))
        return selected

    # --- application ------------------------------------------------------------------------------
    def apply(self, root: nn.Module, *, offload: bool | None = None,
              offload_hooks: Callable[[], ContextManager] | None = None) -> list[str]:
        """Wrap the selected layers of ``root`` in place; returns the names of the checkpointed layers.

        Returns an empty list when ``root`` already holds activation wrappers (applied before).
        ``offload`` overrides ``offload_to_cpu`` (the callback turns it off on CPU runs); ``offload_hooks`` replaces
        the context the offloaded layers run in (the estimator's ``memory.offload.modelled_host_offload``).

        Raises:
            ValueError: when no layer matches the selection.
        """
        if any(isinstance(m, ActivationWrapper) for m in root.modules()):
            self._applied = True
            return []
        layers = self.select_layers(root)
        if not layers:
            raise ValueError(
                f"ActivationCheckpointing found no layer to checkpoint in {type(root).__name__} "
                f"(layer_classes={list(self.layer_classes)}, name_pattern={self.name_pattern!r}); "
                "pass layer_classes=['MyBlock'] or name_pattern=r'blocks\\.\\d+$'."
            )
        offload = self.offload_to_cpu if offload is None else offload
        pin = self.pin_memory and torch.cuda.is_available()
        hooks = offload_hooks or functools.partial(host_offload, pin_memory=pin)
        self.layer_types = sorted({type(m).__name__ for _, m in layers})
        # id(module) -> (checkpoint it?, offload it?): every k-th layer is checkpointed, all are offloaded when asked
        plan = {id(module): (self.recompute and index % self.every_k_layers == 0, offload)
                for index, (_, module) in enumerate(layers)}
        plan = {key: todo for key, todo in plan.items() if any(todo)}

        def wrap(module: nn.Module) -> nn.Module:
            checkpoint_it, offload_it = plan[id(module)]
            wrapped: nn.Module = module
            if checkpoint_it:
                wrapped = checkpoint_wrapper(
                    module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=self.preserve_rng_state
                )
            if offload_it:
                # Outside the checkpoint wrapper: its saved inputs go to the host; inside it nothing else is saved.
                wrapped = _HostOffloadWrapper(wrapped, hooks)
            return wrapped

        # torch's own selection-and-wrap walk; the selection (outermost matches, every k-th) is ours.
        apply_activation_checkpointing(root, checkpoint_wrapper_fn=wrap, check_fn=lambda m: id(m) in plan)
        checkpointed = [name for index, (name, _) in enumerate(layers) if self.recompute and index % self.every_k_layers == 0]
        offloaded = [name for name, _ in layers] if offload else []
        _disable_kv_cache(root)
        self.checkpointed, self.offloaded = checkpointed, offloaded
        self._applied = True
        return checkpointed

    def _apply_to(self, trainer: Trainer, pl_module: LightningModule, *, required: bool) -> None:
        if self._applied and any(isinstance(m, ActivationWrapper) for m in pl_module.modules()):
            return
        if not required and not self.select_layers(pl_module):
            return  # the model may be built later, in configure_model
        offload = self.offload_to_cpu
        if offload and trainer.strategy.root_device.type == "cpu":
            if not self.recompute and self._applied:
                return  # offload only, skipped on this run: said once already, nothing to wrap
            rank_zero_info("ActivationCheckpointing: training runs on the CPU, where activations already live in host "
                           "memory; offload_to_cpu is skipped.")
            offload = False
        names = self.apply(pl_module, offload=offload)
        if names or self.offloaded:
            every = f"; every {self.every_k_layers}" if names else ""
            rank_zero_info(
                f"ActivationCheckpointing: checkpointing {len(names)} layer(s) ({', '.join(self.layer_types)}{every}), "
                f"CPU offload of saved activations for {len(self.offloaded)}."
            )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._apply_to(trainer, pl_module, required=False)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._applied:
            strategy = type(trainer.strategy).__name__
            if "FSDP" in strategy or "DeepSpeed" in strategy:
                rank_zero_warn(
                    f"ActivationCheckpointing: the layers appeared only after {strategy} set up the model; "
                    "prefer the strategy's own activation checkpointing option, which wraps before sharding."
                )
        self._apply_to(trainer, pl_module, required=True)


def _no_split_classes(root: nn.Module) -> set[str]:
    for module in root.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def _disable_kv_cache(root: nn.Module) -> None:
    for module in root.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False) and hasattr(module, "get_input_embeddings"):
            config.use_cache = False
