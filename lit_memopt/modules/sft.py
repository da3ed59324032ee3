"""Causal-LM fine-tuning whose loss comes from ``linear_cross_entropy``: no ``[tokens, vocab]`` logits."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lit_memopt.models.hf import (
    ModelConfig,
    checkpoint_period,
    decoder_hidden_states,
    enable_gradient_checkpointing,
    lm_head_weight,
)
from lit_memopt.models.sharding import shard_for_fsdp2
from lit_memopt.modules._optim import adamw_with_warmup
from lit_memopt.ops import linear_cross_entropy


def next_token_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token negative log-likelihood over labelled tokens, and the number of those tokens.

    A packed batch (``data.packing``) brings ``position_ids`` that restart at each row and no attention mask:
    transformers then keeps each row's attention to itself.
    """
    input_ids = batch["input_ids"]
    labels = batch.get("labels", input_ids)
    extra = {"position_ids": batch["position_ids"]} if batch.get("position_ids") is not None else {}
    hidden = decoder_hidden_states(model, input_ids, attention_mask=batch.get("attention_mask"), **extra)
    targets = labels[:, 1:]
    # A scalar loss: its head gradients are made in the forward (three head products instead of four; two for a
    # frozen LoRA head), and it is the mean over labelled tokens, 0 where there are none.
    loss = linear_cross_entropy(hidden[:, :-1], lm_head_weight(model), targets, chunk_size=chunk_size)
    return loss, (targets != -100).sum()


class SFTModule(pl.LightningModule):
    """Supervised causal-LM fine-tuning of any transformers model, with the fused log-prob head.

    The plain case: a user's model with the pack's callbacks. The loss is exactly the usual
    cross-entropy, computed without materialising the ``[batch, tokens, vocab]`` logits.

    Args:
        model_config: what to build (``lit_memopt.models.ModelConfig``).
        tokenizer: the tokenizer (kept for generation and logging; not saved in checkpoints).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear warm-up steps of the learning rate (then constant).
        chunk_size: rows per tile of the fused head op; ``None`` chooses automatically.
        gradient_checkpointing: transformers' non-reentrant activation checkpointing: ``true`` of every decoder
            layer, an integer ``k >= 2`` of every k-th (less recomputation, less saved), ``false`` none.

    Raises:
        ValueError: on a non-positive ``lr`` or a negative ``warmup_steps``.

    Example::

        from lit_memopt.models import ModelConfig
        cfg = ModelConfig(name="tiny", arch={"model_type": "qwen3", "vocab_size": 384, "hidden_size": 64,
                          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "head_dim": 32})
        module = SFTModule(cfg, cfg.build_tokenizer(), lr=1e-3)
    """

    summary_keys = ("train/loss", "val/loss")

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        chunk_size: int | None = None,
        gradient_checkpointing: bool | int = False,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"module.lr must be > 0, got {lr!r}.")
        if warmup_steps < 0:
            raise ValueError(f"module.warmup_steps must be >= 0, got {warmup_steps!r}.")
        self.save_hyperparameters(ignore=["model_config", "tokenizer"])
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model = model_config.build_model()
        period = checkpoint_period(gradient_checkpointing, "module.gradient_checkpointing")
        if period:
            enable_gradient_checkpointing(self.model, every_n_layers=period)

    def configure_model(self) -> None:
        """Under FSDP2 (``trainer=fsdp2``) shard each decoder block and the root; elsewhere nothing to do."""
        shard_for_fsdp2(self, self.model)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return next_token_nll(self.model, batch, self.hparams.chunk_size)[0]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, tokens = next_token_nll(self.model, batch, self.hparams.chunk_size)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log("train/tokens", tokens.float(), reduce_fx="sum", batch_size=1)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = next_token_nll(self.model, batch, self.hparams.chunk_size)
        self.log("val/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return adamw_with_warmup(
            params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=self.hparams.betas,
            warmup_steps=self.hparams.warmup_steps,
        )
