"""LoRA adapters (peft) switched on and off around a block: the reference policy and per-role adapters.

One place for what GRADE, the rollout helpers and CRSP each need: the frozen reference is either a
separate copy or the policy itself with its adapters disabled (sharing every base weight), and a
role's adapter is active only inside its block, the previous one restored after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["is_peft_model", "reference_model", "active_adapter", "base_weights_trainable", "add_named_adapters",
           "adapter_parameters"]


def is_peft_model(model: nn.Module) -> bool:
    """True for a peft-wrapped model, whose ``disable_adapter()`` yields the base (reference) policy."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def reference_model(policy: nn.Module, reference: nn.Module | None = None) -> Iterator[nn.Module]:
    """The reference network: ``reference`` when given, else ``policy`` with its LoRA adapters disabled.

    Raises:
        ValueError: with no ``reference`` and a policy that is not a peft model (nothing to disable).
    """
    if reference is not None:
        yield reference
        return
    if not is_peft_model(policy):
        raise ValueError(
            "a reference model is needed: the policy is not a peft model (no adapter to disable), so pass a frozen "
            "copy, or enable LoRA (model.lora) to share the base weights."
        )
    with policy.disable_adapter():
        yield policy


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str | None) -> Iterator[nn.Module]:
    """Make adapter ``name`` the active one inside the block and restore the previous one after it.

    ``name=None`` (or a model without adapters) changes nothing.
    """
    if name is None or not is_peft_model(model):
        yield model
        return
    previous = model.active_adapter
    model.set_adapter(name)
    try:
        yield model
    finally:
        model.set_adapter(previous)


@contextlib.contextmanager
def base_weights_trainable(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block a peft model trains its base weights with every adapter off; elsewhere nothing changes.

    A supervised warm start must change the base: the reference policy is the base under ``disable_adapter()``,
    and LoRA adapters start as the identity (their ``B`` is zero), so after the block policy and reference are
    both the warm-started model. Training the adapters instead would leave the reference untrained. Which
    parameters need gradients is restored after the block.
    """
    if not is_peft_model(model):
        yield model
        return
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        with model.disable_adapter():
            for name, p in model.named_parameters():
                p.requires_grad_("lora_" not in name)
            yield model
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(before[name])


def add_named_adapters(model: nn.Module, names: tuple[str, ...], active: str) -> None:
    """Give a peft model one adapter per name (initialised in this order), each configured as its ``"default"``
    adapter, drop that one (it would never be trained) and leave ``active`` active."""
    from peft import LoraConfig

    base = model.peft_config["default"]
    for name in names:
        model.add_adapter(name, LoraConfig(r=base.r, lora_alpha=base.lora_alpha, lora_dropout=base.lora_dropout,
                                           target_modules=base.target_modules, task_type="CAUSAL_LM"))
    model.set_adapter(active)
    model.delete_adapter("default")


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The LoRA parameters of adapter ``name``, selected by name: peft marks only the active adapter trainable."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]
