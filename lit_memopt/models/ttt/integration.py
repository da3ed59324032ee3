"""Gated TTT branches added after the attention of a pretrained transformers causal LM (by
composition: nothing in transformers is patched)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from lit_memopt.models.hf import decoder_of
from lit_memopt.models.ttt.layers import TTTLayer, resolve_inner_base_lr, ttt_layer_class
from lit_memopt.models.ttt.planning import check_group_size

__all__ = ["TTTIntegrationConfig", "GatedTTT", "AttentionWithTTT", "add_ttt_layers", "ttt_branches"]


@dataclass
class TTTIntegrationConfig:
    """Where and how to add gated TTT branches to a pretrained causal LM.

    Args:
        layers: decoder-layer indices that get a branch after their attention (negative indices
            count from the end); ``None`` means every layer.
        layer_type: ``linear`` or ``mlp``.
        num_heads: TTT heads; ``None`` uses the host's ``num_attention_heads``.
        mini_batch_size: tokens per inner step.
        inner_base_lr: ``eta_base``; ``None`` takes the paper's value for ``layer_type``
            (:func:`~lit_memopt.models.ttt.resolve_inner_base_lr`).
        gate_init: initial ``alpha`` of the gate ``tanh(alpha)`` (per channel). 0 leaves the
            pretrained model's function exactly unchanged at the start.
        checkpoint_group_size: layer and scan checkpointing of each branch (0, a positive int,
            ``"auto"``; ``"auto"`` plans for all the branches at once).

    Raises:
        ValueError: on an unknown ``layer_type`` or bad sizes.
    """

    layers: Sequence[int] | None = None
    layer_type: str = "linear"
    num_heads: int | None = None
    mini_batch_size: int = 16
    inner_base_lr: float | None = None
    gate_init: float = 0.01
    checkpoint_group_size: int | str = 0

    def __post_init__(self) -> None:
        ttt_layer_class(self.layer_type)
        check_group_size(self.checkpoint_group_size)
        if self.layers is not None:
            self.layers = [int(i) for i in self.layers]
        if self.mini_batch_size <= 0:
            raise ValueError(f"integration.mini_batch_size must be positive, got {self.mini_batch_size}.")


class GatedTTT(nn.Module):
    """A tanh-gated TTT branch: ``x + tanh(alpha) * TTT(RMSNorm(x))``.

    At ``alpha = 0`` it is the identity, so inserting it keeps a pretrained model's outputs.

    Args:
        layer: the TTT layer (:class:`TTTLinear` or :class:`TTTMLP`).
        gate_init: initial value of every channel of ``alpha``.
        eps: epsilon of the input RMSNorm.

    Example::

        branch = GatedTTT(TTTLinear(256, 4), gate_init=0.0)
        x = torch.randn(2, 32, 256)
        assert torch.equal(branch(x), x)
    """

    def __init__(self, layer: TTTLayer, *, gate_init: float = 0.01, eps: float = 1e-6) -> None:
        super().__init__()
        self.ttt = layer
        self.norm = nn.RMSNorm(layer.hidden_size, eps=eps)
        self.gate = nn.Parameter(torch.full((layer.hidden_size,), float(gate_init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.gate).to(x.dtype) * self.ttt(x, self.norm)


class AttentionWithTTT(nn.Module):
    """Composition of a decoder layer's attention module and a :class:`GatedTTT` on its output.

    Replaces ``decoder_layer.self_attn`` (same call signature, same return structure): the
    attention runs unchanged, then its output goes through the gated TTT branch before the
    decoder layer adds it to the residual stream. Attributes not found here are looked up on the
    wrapped attention, so code reading e.g. ``self_attn.layer_idx`` keeps working.

    Args:
        attention: the original attention module.
        branch: the gated TTT branch.
    """

    def __init__(self, attention: nn.Module, branch: GatedTTT) -> None:
        super().__init__()
        self.attention = attention
        self.ttt_branch = branch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.attention(*args, **kwargs)
        if isinstance(out, tuple):
            return (self.ttt_branch(out[0]), *out[1:])
        return self.ttt_branch(out)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("attention"), name)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers (expected `decoder.layers`).")
    return layers


def add_ttt_layers(model: nn.Module, config: TTTIntegrationConfig | dict[str, Any] | None = None) -> list[GatedTTT]:
    """Insert gated TTT branches after the attention of chosen decoder layers of a transformers causal LM.

    The model is modified in place by composition: ``layer.self_attn`` becomes
    :class:`AttentionWithTTT` wrapping the original module (nothing in transformers is patched).
    The new modules take the dtype and device of the host's parameters.

    Args:
        model: a transformers ``*ForCausalLM`` (peft-wrapped or not).
        config: a :class:`TTTIntegrationConfig` or a dict of its fields.

    Returns:
        The inserted :class:`GatedTTT` branches (their parameters are the new ones to train).

    Raises:
        ValueError: if a layer index is out of range or a layer has no ``self_attn``.

    Example::

        model = ModelConfig(arch={...}).build_model()
        branches = add_ttt_layers(model, {"layers": [1, 3], "gate_init": 0.0})
    """
    if config is None:
        config = TTTIntegrationConfig()
    elif isinstance(config, dict):
        config = TTTIntegrationConfig(**config)
    layers = _decoder_layers(model)
    n = len(layers)
    indices = list(range(n)) if config.layers is None else list(config.layers)
    for i in indices:
        if not -n <= i < n:
            raise ValueError(f"integration.layers contains {i}, but the model has {n} decoder layers (0..{n - 1}).")
    indices = sorted({i % n for i in indices})
    host = getattr(model, "config", None)
    hidden_size = int(getattr(host, "hidden_size"))
    num_heads = config.num_heads or int(getattr(host, "num_attention_heads"))
    reference = next(model.parameters())
    cls = ttt_layer_class(config.layer_type)
    base_lr = resolve_inner_base_lr(config.layer_type, config.inner_base_lr)
    branches = []
    for i in indices:
        layer = layers[i]
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no `self_attn` to follow.")
        if isinstance(attention, AttentionWithTTT):
            raise ValueError(f"decoder layer {i} already has a TTT branch.")
        ttt = cls(
            hidden_size,
            num_heads,
            mini_batch_size=config.mini_batch_size,
            base_lr=base_lr,
            checkpoint_group_size=config.checkpoint_group_size,
            auto_num_layers=len(indices),
        )
        branch = GatedTTT(ttt, gate_init=config.gate_init).to(device=reference.device, dtype=reference.dtype)
        layer.self_attn = AttentionWithTTT(attention, branch)
        branches.append(branch)
    return branches


def ttt_branches(model: nn.Module) -> list[GatedTTT]:
    """The :class:`GatedTTT` branches inside ``model`` (in module order)."""
    return [m for m in model.modules() if isinstance(m, GatedTTT)]
