"""TTTModule: train a small TTT language model, or gated TTT branches inside a pretrained causal LM."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_memopt._compat.lightning import attached_trainer
from lit_memopt.models.hf import plain_container, decoder_hidden_states, lm_head_weight
from lit_memopt.models.ttt import TTTConfig, TTTIntegrationConfig, add_ttt_layers
from lit_memopt.ops import linear_cross_entropy
from lit_memopt.models.sharding import shard_for_fsdp2

IGNORE_INDEX = -100


def _argmax_tokens(hidden: torch.Tensor, weight: torch.Tensor, max_elements: int = 1 << 24) -> torch.Tensor:
    """``argmax(hidden @ weight.T)`` row by row in tiles of at most ``max_elements`` logits."""
    rows = max(1, max_elements // max(weight.shape[0], 1))
    return torch.cat([(h @ weight.T).argmax(dim=-1) for h in hidden.split(rows)]) if hidden.numel() else hidden.new_zeros(0, dtype=torch.long)


class TTTModule(pl.LightningModule):
    """Test-time-training language modelling, in one of two modes chosen by ``model_config``.

    * **TTT LM** (``model_config`` is a :class:`~lit_memopt.models.ttt.TTTConfig`): a small LM of
      TTT blocks (causal conv + TTT-Linear/TTT-MLP + SwiGLU) trained from scratch; ``lr`` applies to
      every parameter.
    * **Integration** (``model_config`` is a :class:`~lit_memopt.models.ModelConfig`): the
      transformers causal LM is built (``pretrained`` weights when given) and gated TTT branches
      ``x + tanh(alpha) * TTT(norm(x))`` are added after the attention of ``integration.layers``.
      The new parameters train at ``lr``; the host's trainable parameters at ``base_lr``
      (``0`` freezes them).

    The loss is ``-mean log p(target)`` over the non-ignored labels, from
    :func:`lit_memopt.ops.linear_cross_entropy` (no ``[tokens, vocab]`` logits). Batches hold
    ``input_ids`` and already-shifted ``labels`` (``-100`` = ignored), as
    :class:`~lit_memopt.data.recall.RecallDataModule` yields them. ``recall_acc`` is the greedy
    accuracy on the labelled (queried) tokens; only those few rows get vocabulary logits, in tiles.

    Args:
        model_config: :class:`TTTConfig` or :class:`~lit_memopt.models.ModelConfig`.
        tokenizer: the run's tokenizer (kept for users; not saved in checkpoints).
        lr: AdamW learning rate of the TTT model, or of the new TTT parameters in integration mode.
        base_lr: integration mode: learning rate of the host model's parameters (``0``: frozen).
        weight_decay: AdamW weight decay on matrices (never on norms, biases, gates, 1-D parameters).
        betas: AdamW betas.
        warmup_steps: linear warm-up steps, then cosine decay to ``min_lr_ratio * lr``.
        min_lr_ratio: final learning-rate fraction of the cosine schedule.
        integration: integration mode: a :class:`TTTIntegrationConfig` or a dict of its fields
            (``layers``, ``layer_type``, ``num_heads``, ``mini_batch_size``, ``inner_base_lr``,
            ``gate_init``, ``checkpoint_group_size``). Ignored (with a note) for a TTT LM.
        chunk_size: tile size of the fused log-prob op (``None``: automatic).

    Raises:
        ValueError: on a non-positive ``lr``, negative ``base_lr``/``warmup_steps``, a
            ``min_lr_ratio`` outside ``[0, 1]``, or an unusable ``model_config``.

    Example::

        from lit_memopt.models.ttt import TTTConfig
        config = TTTConfig(hidden_size=64, num_layers=2, num_heads=4, mini_batch_size=8)
        module = TTTModule(config, config.build_tokenizer(), lr=3e-3)
    """

    summary_keys = ("train/loss", "train/recall_acc", "val/loss", "val/recall_acc")

    def __init__(
        self,
        model_config: Any,
        tokenizer: Any = None,
        lr: float = 3e-3,
        base_lr: float = 0.0,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        integration: TTTIntegrationConfig | dict[str, Any] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"module.lr must be > 0, got {lr!r}.")
        if base_lr < 0:
            raise ValueError(f"module.base_lr must be >= 0 (0 freezes the host model), got {base_lr!r}.")
        if warmup_steps < 0:
            raise ValueError(f"module.warmup_steps must be >= 0, got {warmup_steps!r}.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"module.min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}.")
        self.save_hyperparameters(ignore=["model_config", "tokenizer", "integration"])
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.is_integration = not isinstance(model_config, TTTConfig)
        if self.is_integration:
            if not hasattr(model_config, "build_model"):
                raise ValueError(
                    f"module.model_config must be a TTTConfig or a ModelConfig, got {type(model_config).__name__}."
                )
            if integration is None:
                integration = TTTIntegrationConfig()
            elif not isinstance(integration, TTTIntegrationConfig):
                integration = TTTIntegrationConfig(**plain_container(integration))
            self.integration = integration
            self.model = model_config.build_model()
            # the host's own trainable set (all weights, or LoRA adapters) before the branches exist
            host_params = [p for p in self.model.parameters() if p.requires_grad]
            self.branches = add_ttt_layers(self.model, integration)
            if base_lr == 0:
                for p in host_params:
                    p.requires_grad_(False)
            self._host_param_ids = {id(p) for p in host_params}
        else:
            if integration is not None:
                rank_zero_info("TTTModule: `integration` is ignored when training a TTT LM from a TTTConfig.")
            self.integration = None
            self.model = model_config.build_model()
            self.branches = []
            self._host_param_ids = set()
        self.hparams["integration"] = None if self.integration is None else dict(vars(self.integration))

    def configure_model(self) -> None:
        """Under FSDP2 (``trainer=fsdp2``) shard each decoder block and the root; elsewhere nothing to do."""
        shard_for_fsdp2(self, self.model)

    # ------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, T, H]`` (no LM head)."""
        if self.is_integration:
            return decoder_hidden_states(self.model, input_ids)
        return self.model(input_ids)

    def head_weight(self) -> torch.Tensor:
        return lm_head_weight(self.model) if self.is_integration else self.model.lm_head_weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hidden_states(input_ids)

    def _loss_and_accuracy(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        input_ids, labels = batch["input_ids"], batch["labels"]
        mask = labels != IGNORE_INDEX
        count = int(mask.sum())
        if count == 0:
            raise ValueError("TTTModule: a batch has no labelled tokens (all labels are -100).")
        hidden = self.hidden_states(input_ids)[mask]  # only the supervised rows go to the head
        weight = self.head_weight()
        targets = labels[mask]
        # A scalar loss: its head gradients are made in the forward (three head products instead of four).
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=self.hparams.chunk_size)
        with torch.no_grad():
            accuracy = (_argmax_tokens(hidden.detach(), weight.detach()) == targets).float().mean()
        return loss, accuracy, count

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, accuracy, _ = self._loss_and_accuracy(batch)
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/recall_acc", accuracy, prog_bar=True, batch_size=size)
        if self.branches:
            gate = torch.stack([torch.tanh(b.gate.detach()).abs().mean() for b in self.branches]).mean()
            self.log("train/gate_abs_mean", gate, batch_size=size)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, accuracy, _ = self._loss_and_accuracy(batch)
        size = batch["input_ids"].shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=size, sync_dist=True)
        self.log("val/recall_acc", accuracy, prog_bar=True, batch_size=size, sync_dist=True)

    # ------------------------------------------------------------------ optimisation
    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: (new/TTT-LM, host) x (decayed matrices, undecayed rest); empty groups dropped."""
        hp = self.hparams
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            is_host = id(p) in self._host_param_ids
            decay = p.dim() >= 2 and "embed" not in name and not name.endswith(("W1", "W2"))
            groups.setdefault((is_host, decay), []).append(p)
        out = []
        for (is_host, decay), params in sorted(groups.items()):
            out.append(
                {
                    "params": params,
                    "lr": hp.base_lr if is_host else hp.lr,
                    "weight_decay": hp.weight_decay if decay else 0.0,
                    "name": f"{'host' if is_host else 'ttt'}_{'decay' if decay else 'no_decay'}",
                }
            )
        return out

    def configure_optimizers(self) -> Any:
        groups = self.parameter_groups()
        if not groups:
            raise ValueError("TTTModule: no trainable parameters (check module.base_lr and the integration layers).")
        optimizer = torch.optim.AdamW(groups, betas=tuple(self.hparams.betas))
        from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

        warmup = int(self.hparams.warmup_steps)
        total = self.trainer.estimated_stepping_batches if attached_trainer(self) is not None else float("inf")
        if math.isfinite(total) and int(total) > warmup:
            # linear warm-up, then cosine decay to min_lr_ratio of each group's rate at the last step
            scheduler = get_cosine_with_min_lr_schedule_with_warmup(
                optimizer, num_warmup_steps=warmup, num_training_steps=int(total), min_lr_rate=float(self.hparams.min_lr_ratio)
            )
        else:
            scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
