"""A small TTT language model: blocks of causal conv + TTT layer + SwiGLU MLP, and its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lit_memopt.models.hf import build_tokenizer, resolve_dtype
from lit_memopt.models.ttt.layers import TTTLayer, resolve_inner_base_lr, ttt_layer_class
from lit_memopt.models.ttt.planning import check_group_size
from lit_memopt.models.ttt.recompute import recompute_in_backward

__all__ = ["TTTConfig", "TTTBlock", "TTTForCausalLM"]


@dataclass
class TTTConfig:
    """Architecture of a small TTT language model (blocks of causal conv + TTT layer + SwiGLU MLP).

    Hydra-instantiable like :class:`~lit_memopt.models.ModelConfig`: it is cheap to create;
    ``build_model()`` makes the network and ``build_tokenizer()`` the tokenizer, so the CLI's
    ``model_config.build_tokenizer()`` contract holds.

    Each block is pre-norm: ``x += conv(norm(x))`` (a short causal depthwise convolution that lets
    a token's keys see its predecessors, as in the paper's Mamba backbone; ``conv_kernel=0`` drops
    it), ``x += TTT(norm(x))``, ``x += SwiGLU(norm(x))``. There are no position embeddings: order
    reaches the model through the convolution and the causal inner updates.

    Args:
        name: short name for logs.
        vocab_size: embedding rows (the byte tokenizer needs 384).
        hidden_size: model width.
        num_layers: blocks.
        num_heads: TTT heads per layer.
        intermediate_size: SwiGLU width.
        layer_type: ``linear`` (TTT-Linear) or ``mlp`` (TTT-MLP).
        mini_batch_size: tokens per inner gradient step.
        inner_base_lr: ``eta_base``; ``None`` takes the paper's value for ``layer_type``
            (:func:`~lit_memopt.models.ttt.resolve_inner_base_lr`).
        mlp_expansion: TTT-MLP inner width / head width.
        conv_kernel: width of the causal token-mixing convolution (0: none).
        checkpoint_group_size: layer and scan checkpointing, see :class:`TTTLinear` (``"auto"``
            accepted; it plans for all ``num_layers`` TTT layers at once).
        checkpoint_conv: when checkpointing is on, recompute each block's causal convolution with its
            TTT layer (the block's whole sequence-mixing half keeps only its input for backward);
            ``False`` stores the convolution's activations and checkpoints the TTT layer alone.
        rms_norm_eps: epsilon of the RMSNorms.
        tie_word_embeddings: share the input embedding with the LM head.
        initializer_range: std of the normal initialisation.
        tokenizer: local tokenizer directory, ``None`` for the byte-level ByT5 tokenizer.
        dtype: parameter dtype: ``float32`` or ``bfloat16``.

    Raises:
        ValueError: on an unknown ``layer_type``/``dtype`` or inconsistent sizes.

    Example::

        config = TTTConfig(hidden_size=128, num_layers=2, num_heads=4, mini_batch_size=8)
        model = config.build_model()
        hidden = model(torch.randint(0, 384, (2, 40)))        # [2, 40, 128]
    """

    name: str = "ttt"
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 352
    layer_type: str = "linear"
    mini_batch_size: int = 16
    inner_base_lr: float | None = None
    mlp_expansion: int = 4
    conv_kernel: int = 4
    checkpoint_group_size: int | str = 0
    checkpoint_conv: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    tokenizer: str | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        ttt_layer_class(self.layer_type)
        resolve_dtype(self.dtype)
        check_group_size(self.checkpoint_group_size)
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "mini_batch_size"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"TTTConfig.{key} must be a positive integer, got {getattr(self, key)!r}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TTTConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})."
            )
        if self.conv_kernel < 0:
            raise ValueError(f"TTTConfig.conv_kernel must be >= 0, got {self.conv_kernel}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def resolved_inner_base_lr(self) -> float:
        """``inner_base_lr``, or the paper's value for ``layer_type`` when it is ``None``."""
        return resolve_inner_base_lr(self.layer_type, self.inner_base_lr)

    def build_model(self) -> "TTTForCausalLM":
        """A randomly initialised :class:`TTTForCausalLM` in ``dtype``."""
        model = TTTForCausalLM(self)
        # skip a no-op .to(): under FakeTensorMode it would try (and fail) to swap parameters
        return model if self.torch_dtype == torch.float32 else model.to(self.torch_dtype)

    def build_tokenizer(self):
        return build_tokenizer(self.tokenizer)

    def hf_config(self):
        """The sizes as a transformers ``PretrainedConfig`` (for tools that read ``vocab_size``,
        ``hidden_size``, ``num_hidden_layers``... the way they do for :class:`ModelConfig`)."""
        from transformers import PretrainedConfig

        return PretrainedConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            tie_word_embeddings=self.tie_word_embeddings,
            ttt_layer_type=self.layer_type,
            mini_batch_size=self.mini_batch_size,
        )


class _CausalConv(nn.Module):
    """Depthwise causal 1-D convolution over the sequence (left padding only)."""

    def __init__(self, hidden_size: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel, groups=hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))
        return self.conv(y).transpose(1, 2)


class _SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TTTBlock(nn.Module):
    """One pre-norm block: causal conv (optional), TTT layer, SwiGLU MLP, each on the residual stream.

    With checkpointing on and ``config.checkpoint_conv``, the conv and the TTT layer are recomputed
    in backward as one piece (the block's sequence-mixing half keeps only its input).

    Args:
        config: the :class:`TTTConfig`; ``auto`` checkpoint planning counts its ``num_layers``.
    """

    def __init__(self, config: TTTConfig) -> None:
        super().__init__()
        C = config.hidden_size
        self.conv_norm = nn.RMSNorm(C, eps=config.rms_norm_eps) if config.conv_kernel else None
        self.conv = _CausalConv(C, config.conv_kernel) if config.conv_kernel else None
        self.seq_norm = nn.RMSNorm(C, eps=config.rms_norm_eps)
        kwargs: dict[str, Any] = dict(
            mini_batch_size=config.mini_batch_size,
            base_lr=config.resolved_inner_base_lr,
            checkpoint_group_size=config.checkpoint_group_size,
            auto_num_layers=config.num_layers,
            initializer_range=config.initializer_range,
        )
        if config.layer_type == "mlp":
            kwargs["expansion"] = config.mlp_expansion
        self.ttt = ttt_layer_class(config.layer_type)(C, config.num_heads, **kwargs)
        self.ffn_norm = nn.RMSNorm(C, eps=config.rms_norm_eps)
        self.mlp = _SwiGLU(C, config.intermediate_size)
        self.checkpoint_conv = bool(config.checkpoint_conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv is not None and self.checkpoint_conv:
            group = self.ttt.resolve_group_size(x)
            if group > 0 and torch.is_grad_enabled():
                # the sequence-mixing half (conv + TTT) checkpointed as one: only x is kept
                x = recompute_in_backward(
                    lambda t: self._mixing(t, group), x, (self.conv_norm, self.conv, self.seq_norm, self.ttt)
                )
                return x + self.mlp(self.ffn_norm(x))
        if self.conv is not None:
            x = x + self.conv(self.conv_norm(x))
        x = x + self.ttt(x, self.seq_norm)
        return x + self.mlp(self.ffn_norm(x))

    def _mixing(self, x: torch.Tensor, group: int) -> torch.Tensor:
        x = x + self.conv(self.conv_norm(x))
        return x + self.ttt.compute(x, group, self.seq_norm)


class TTTForCausalLM(nn.Module):
    """Embedding, :class:`TTTBlock` stack, final RMSNorm and an LM head weight.

    ``forward(input_ids)`` returns the final hidden states ``[B, T, C]``, never logits: feed them
    with :attr:`lm_head_weight` to :func:`lit_memopt.ops.linear_logprobs`.

    Args:
        config: the :class:`TTTConfig`.
    """

    def __init__(self, config: TTTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TTTBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        std = config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not isinstance(module, TTTLayer):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The ``[V, C]`` output-embedding weight."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def ttt_layers(self) -> list[TTTLayer]:
        """The TTT layer of every block, in order."""
        return [block.ttt for block in self.layers]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x)
        return self.norm(x)
