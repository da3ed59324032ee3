"""Differentiable reward models for GRADE: modules that score sequences from their input embeddings.

A GRADE reward model is called as ``reward_model(inputs_embeds=[B, T, H], attention_mask=[B, T])`` and
returns an object with ``.logits`` (or a tensor) of shape ``[B, num_labels]``; its input embedding
matrix, ``reward_model.get_input_embeddings().weight``, turns soft tokens into those embeddings.
Any transformers ``*ForSequenceClassification`` model has this interface.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn


class RuleRewardModel(nn.Module):
    """A tiny sequence classifier that scores how much of a text is made of a target token set.

    Embedding -> per-token MLP -> masked mean pool -> linear score. It is trained at construction
    (``fit_rule``), on random sequences labelled by a synthetic rule: positive when at least
    ``threshold`` of the tokens belong to ``target_ids``. Frozen afterwards, it is an honest,
    pretrained-model-free differentiable reward: it reads embeddings (so soft tokens work), and its
    score rises smoothly as a generator puts more mass on the target tokens. Returns the raw score
    (one logit per sequence), which has useful gradients even far from the decision boundary.

    Args:
        vocab_size: number of token ids.
        target_ids: the token ids the rule counts.
        hidden_size: embedding and MLP width.
        threshold: fraction of target tokens at and above which a sequence is labelled positive.
        margin: width of the soft labels the score is trained on (see ``soft_labels``); the trained
            score is about ``(fraction - threshold) / margin``.

    Raises:
        ValueError: ``target_ids`` is empty or holds ids outside ``[0, vocab_size)``, or
            ``threshold`` is not in ``(0, 1)``.

    Example::

        rm = RuleRewardModel(384, target_ids=[100, 104, 108, 114, 120])
        rm.fit_rule(seq_len=16)
        score = rm(inputs_embeds=rm.get_input_embeddings()(ids)).logits  # [B, 1]
    """

    def __init__(
        self, vocab_size: int, target_ids: list[int], hidden_size: int = 32, threshold: float = 0.5, margin: float = 0.1
    ) -> None:
        super().__init__()
        target_ids = sorted({int(i) for i in target_ids})
        if not target_ids:
            raise ValueError("RuleRewardModel: target_ids is empty; give at least one token id.")
        if target_ids[0] < 0 or target_ids[-1] >= vocab_size:
            raise ValueError(f"RuleRewardModel: target_ids must lie in [0, {vocab_size}), got {target_ids}.")
        if not 0.0 < float(threshold) < 1.0:
            raise ValueError(f"RuleRewardModel: threshold must be in (0, 1), got {threshold!r}.")
        self.vocab_size = int(vocab_size)
        if not float(margin) > 0.0:
            raise ValueError(f"RuleRewardModel: margin must be > 0, got {margin!r}.")
        self.threshold = float(threshold)
        self.margin = float(margin)
        self.register_buffer("target_ids", torch.tensor(target_ids, dtype=torch.long), persistent=False)
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.token_mlp = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))
        self.score = nn.Linear(hidden_size, 1)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> Any:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("RuleRewardModel: pass exactly one of input_ids or inputs_embeds.")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + self.token_mlp(x)
        if attention_mask is None:
            pooled = x.mean(dim=1)
        else:
            m = attention_mask.to(x.dtype).unsqueeze(-1)
            pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
        return _ScoreOutput(self.score(pooled))

    def rule_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The synthetic rule itself: 1.0 where the fraction of target tokens is at least ``threshold``."""
        frac = torch.isin(input_ids, self.target_ids.to(input_ids.device)).float().mean(dim=-1)
        return (frac >= self.threshold).float()

    def soft_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training targets: ``sigmoid((fraction - threshold) / margin)``, a calibrated version of the rule.

        Hard 0/1 targets would push the logits to saturate (scores of +-40 on clear cases); soft
        targets keep the score about ``(fraction - threshold) / margin``, a reward on a scale where a
        KL penalty of about 0.1 still matters.
        """
        frac = torch.isin(input_ids, self.target_ids.to(input_ids.device)).float().mean(dim=-1)
        return torch.sigmoid((frac - self.threshold) / self.margin)

    def sample_rule_batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """Random sequences whose target fraction is uniform in [0, 1], so both labels are well represented."""
        device = self.target_ids.device
        frac = torch.rand(batch_size, 1, generator=generator, device=device)
        is_target = torch.rand(batch_size, seq_len, generator=generator, device=device) < frac
        other = torch.randint(0, self.vocab_size, (batch_size, seq_len), generator=generator, device=device)
        pick = torch.randint(0, self.target_ids.numel(), (batch_size, seq_len), generator=generator, device=device)
        return torch.where(is_target, self.target_ids[pick], other)

    @torch.enable_grad()
    def fit_rule(self, seq_len: int = 16, steps: int = 300, batch_size: int = 128, lr: float = 3e-3, seed: int = 0) -> float:
        """Train on the rule with binary cross-entropy, then freeze. Returns accuracy on fresh samples."""
        generator = torch.Generator(device=self.target_ids.device).manual_seed(seed)
        optimizer = torch.optim.Adam(self.parameters(), lr=lr)
        self.train()
        for _ in range(steps):
            ids = self.sample_rule_batch(batch_size, seq_len, generator)
            loss = F.binary_cross_entropy_with_logits(self(input_ids=ids).logits.squeeze(-1), self.soft_labels(ids))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        # Frozen from here on: the last step's gradients would stay allocated for the whole run.
        optimizer.zero_grad(set_to_none=True)
        self.eval().requires_grad_(False)
        with torch.no_grad():
            ids = self.sample_rule_batch(1024, seq_len, generator)
            predicted = (self(input_ids=ids).logits.squeeze(-1) > 0).float()
            return float((predicted == self.rule_labels(ids)).float().mean())


class _ScoreOutput:
    """Minimal stand-in for transformers' ``SequenceClassifierOutput`` (only ``.logits``)."""

    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def build_rule_reward_model(
    model_config: Any = None,
    tokenizer: Any = None,
    *,
    vocab_size: int | None = None,
    target_text: str = "aeiou",
    threshold: float = 0.5,
    margin: float = 0.1,
    hidden_size: int = 32,
    seq_len: int = 16,
    train_steps: int = 200,
    seed: int = 0,
) -> RuleRewardModel:
    """The embedded GRADE reward: a ``RuleRewardModel`` whose targets are the tokens of ``target_text``.

    ``vocab_size`` defaults to the policy's (``model_config.hf_config().vocab_size``); the target ids
    come from ``tokenizer(target_text)`` (byte ids with the default tokenizer). The classifier is
    trained on the rule here, deterministically from ``seed``, and returned frozen.
    """
    if vocab_size is None:
        if model_config is None:
            raise ValueError("build_rule_reward_model: give vocab_size or model_config.")
        vocab_size = int(model_config.hf_config().vocab_size)
    if tokenizer is None:
        from lit_memopt.models import build_tokenizer

        tokenizer = build_tokenizer()
    target_ids = list(tokenizer(target_text, add_special_tokens=False)["input_ids"])
    if not target_ids:
        raise ValueError(f"reward target_text={target_text!r} tokenizes to nothing; give a non-empty text.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = RuleRewardModel(vocab_size, target_ids, hidden_size=hidden_size, threshold=threshold, margin=margin)
    accuracy = model.fit_rule(seq_len=seq_len, steps=train_steps, seed=seed)
    rank_zero_info(
        f"GRADE rule reward: classifier of 'fraction of {target_text!r} tokens >= {threshold}' "
        + (f"trained at start, accuracy {accuracy:.3f} on fresh samples; frozen." if train_steps
           else "untrained (train_steps=0, as in a memory estimate); frozen.")
    )
    return model


def build_sequence_classifier(
    model_config: Any,
    tokenizer: Any = None,
    *,
    num_labels: int = 1,
    pretrained: str | None = None,
) -> nn.Module:
    """A frozen transformers ``*ForSequenceClassification`` reward model of the policy's architecture.

    With ``pretrained`` (a local directory) its weights are loaded; otherwise it is built from
    ``model_config``'s architecture with random weights (for memory estimates and smoke tests).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lit_memopt.models.hf import require_local_path

    if int(num_labels) < 1:
        raise ValueError(f"reward num_labels must be >= 1, got {num_labels!r}.")
    kwargs = model_config.load_kwargs()
    if pretrained is not None:
        path = require_local_path(pretrained, "module.reward_model.pretrained")
        config = AutoConfig.from_pretrained(path, num_labels=int(num_labels))
    else:
        config = model_config.hf_config()
        config.num_labels = int(num_labels)
    # Batched scoring needs a pad id; transformers refuses batches above 1 without one.
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
    if pretrained is not None:
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config, **kwargs)
    else:
        model = AutoModelForSequenceClassification.from_config(config, **kwargs)
    return model.eval().requires_grad_(False)


def sequence_reward(output: Any, reward_label: int | None = None) -> torch.Tensor:
    """Per-sequence reward ``[B]`` from a reward model's output.

    One logit: the logit itself. Several: the probability of ``reward_label`` (the paper's
    sentiment reward); ``reward_label=None`` with several labels is an error.
    """
    logits = output.logits if hasattr(output, "logits") else output
    if not torch.is_tensor(logits) or logits.dim() != 2:
        raise ValueError(f"the reward model must return logits of shape [batch, num_labels], got {getattr(logits, 'shape', type(logits))}.")
    if logits.shape[-1] == 1 and reward_label is None:
        return logits[:, 0].float()
    if reward_label is None:
        raise ValueError(
            f"the reward model returns {logits.shape[-1]} labels; set module.reward_label to the index of the rewarded label."
        )
    if not 0 <= reward_label < logits.shape[-1]:
        raise ValueError(f"module.reward_label={reward_label} is outside [0, {logits.shape[-1]}).")
    return logits.float().softmax(dim=-1)[:, reward_label]


__all__ = ["RuleRewardModel", "build_rule_reward_model", "build_sequence_classifier", "sequence_reward"]
