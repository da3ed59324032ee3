"""GRADE: align a causal LM by backpropagating a reward model's score through Gumbel-softmax generation.

The optimized path never holds a ``[batch, steps, vocab]`` tensor: top-k Gumbel weights, sparse soft
embeddings, an online KL from hidden states and incrementally decoded KV caches.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lit_memopt._compat.lightning import attached_trainer
from lit_memopt.models.hf import ModelConfig, decoder_outputs, lm_head_weight
from lit_memopt.modules.heldout import MeanAndStderr
from lit_memopt.modules._optim import adamw_with_warmup
from lit_memopt.modules.rollout import is_peft_model, position_ids_from_mask
from lit_memopt.ops import linear_kl, soft_embedding, topk_gumbel_softmax
from lit_memopt.rewards.grade_reward import build_rule_reward_model, sequence_reward
from lit_memopt.models.adapters import reference_model
from lit_memopt.seeding import derive_seed, generator_for
from lit_memopt.models.sharding import RootCall, is_fsdp_sharded, shard_for_fsdp2

MEMORY_MODES = ("optimized", "legacy")


@dataclass
class GradeOutput:
    """One GRADE forward pass.

    Attributes:
        loss: ``-reward.mean() + kl_coef * kl.mean()`` (scalar, differentiable).
        reward: per-sequence reward ``[B]``.
        kl: per-step ``KL(pi || pi_ref)`` ``[B, T]``.
        tokens: the hard tokens (argmax of each soft token) ``[B, T]``.
        soft_entropy: entropy of each soft token's weights ``[B, T]`` (0 under straight-through).
        policy_entropy: entropy of the policy's next-token distribution ``[B, T]``.
        weights: the soft tokens' weights ``[B, T, k]`` (``k = V`` in legacy mode).
        ids: the token ids those weights belong to ``[B, T, k]``.
    """

    loss: Tensor
    reward: Tensor
    kl: Tensor
    tokens: Tensor
    soft_entropy: Tensor
    policy_entropy: Tensor
    weights: Tensor
    ids: Tensor


def _head_bias(model: nn.Module) -> Tensor | None:
    return getattr(model.get_output_embeddings(), "bias", None)


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One position's logits, at least in fp32 (Gumbel noise on bf16 logits would be coarse)."""
    logits = F.linear(hidden, weight, bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _entropy(logits: Tensor) -> Tensor:
    logp = logits.detach().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)



class GradeModule(pl.LightningModule):
    """GRADE (Nel, 2025): reward maximisation by backpropagation through Gumbel-softmax generation.

    The policy generates ``max_new_tokens`` soft tokens: at each step its last hidden state gives the
    next-token logits, ``topk_gumbel_softmax`` draws relaxed weights over the top-k candidates (with
    a temperature annealed from ``tau_start`` to ``tau_end``), and ``soft_embedding`` of those weights
    is the next input. A frozen reward model reads the soft tokens through its own embedding matrix,
    so its score is differentiable in the policy's parameters. The loss is
    ``-reward + kl_coef * KL(pi || pi_ref)``, the KL taken at every step against a reference policy
    that decodes the hard tokens (the argmax of each soft token) with its own KV cache.

    ``memory_mode="optimized"`` (default) keeps only ``[B, T, k]`` weights and ids, the per-step
    ``[B, V]`` logits of the current position, the policy's KV cache as per-step chunks (recomputed
    under ``checkpoint_steps``) and per-token KL values from ``linear_kl``. ``"legacy"`` is the
    original formulation, for comparison: full-vocabulary Gumbel-softmax, dense ``[B, T, V]`` soft
    tokens and stored logits, policy and reference re-run over the whole sequence at every step, and
    a dense ``soft @ embedding`` reward input. With ``top_k`` equal to the vocabulary size and the same
    noise, both give the same loss and gradients.

    Models: the policy is ``model_config.build_model()`` (LoRA when ``model_config.lora`` is set). The
    reference is the same network with its adapters disabled under LoRA (no second copy of the
    weights), else a frozen deep copy. The reward model must take ``inputs_embeds`` and
    ``attention_mask`` and return ``[B, num_labels]`` logits, and expose ``get_input_embeddings()``
    over the policy's vocabulary (any transformers ``*ForSequenceClassification`` does).

    Args:
        model_config: the policy (``lit_memopt.models.ModelConfig``).
        tokenizer: the tokenizer (used by the default reward's rule; not saved in checkpoints).
        reward_model: an ``nn.Module`` with the interface above; or a factory called as
            ``factory(model_config=..., tokenizer=...)`` (e.g. a Hydra ``_partial_`` of
            ``lit_memopt.rewards.grade_reward.build_sequence_classifier``); ``None`` builds the
            embedded rule classifier (``build_rule_reward_model``). Frozen either way.
        lr: AdamW learning rate. weight_decay: AdamW weight decay. betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up steps (then constant).
        max_new_tokens: soft tokens generated per prompt ``T``.
        top_k: Gumbel candidates per step ``k``; ``None`` means the full vocabulary. Ignored by
            ``legacy`` (always the full vocabulary).
        hard: straight-through Gumbel (one-hot forward, soft gradient) instead of soft weights.
        tau_start: Gumbel temperature at step 0. tau_end: temperature after annealing.
        tau_anneal_steps: optimizer steps of the linear annealing from ``tau_start`` to ``tau_end``.
        kl_coef: weight of ``KL(pi || pi_ref)`` in the loss.
        memory_mode: ``"optimized"`` or ``"legacy"``.
        checkpoint_steps: recompute each generation step's policy forward in the backward pass
            (non-reentrant activation checkpointing) instead of storing its activations.
        reward_label: for a reward model with several labels, the index whose probability is the
            reward; ``None`` for a one-logit model, whose logit is the reward.
        noise_seed: seed of the Gumbel noise (one generator per step and batch, derived from it).
        head_vocab_tile: vocabulary rows per tile of the fused KL (``linear_kl``); its fp32
            temporaries are about ``head_vocab_tile * hidden_size * 4`` bytes.

    Raises:
        ValueError: an argument outside its accepted values (named in the message), or a reward
            model whose vocabulary differs from the policy's.
        TypeError: ``reward_model`` is neither a module, a factory nor ``None``.

    Example::

        from lit_memopt.models import ModelConfig
        cfg = ModelConfig(name="tiny", arch={"model_type": "qwen3", "vocab_size": 384, "hidden_size": 64,
                          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "head_dim": 32})
        module = GradeModule(cfg, cfg.build_tokenizer(), max_new_tokens=8, top_k=32)
        out = module.generate_and_score(input_ids, attention_mask, tau=1.0)
        out.loss.backward()
    """

    # frozen models configure_model leaves whole on every rank under FSDP2 (the estimator's per-rank arithmetic)
    fsdp2_replicated = ("reference", "reward_model")

    summary_keys = ("train/reward", "train/kl", "val/reward", "val/reward_stderr", "val/kl",
                    "val/accuracy", "val/accuracy_stderr")  # the last two: data with answers and a checker

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any = None,
        reward_model: nn.Module | Callable[..., nn.Module] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_new_tokens: int = 16,
        top_k: int | None = 64,
        hard: bool = True,
        tau_start: float = 2.0,
        tau_end: float = 0.5,
        tau_anneal_steps: int = 200,
        kl_coef: float = 0.1,
        memory_mode: str = "optimized",
        checkpoint_steps: bool = False,
        reward_label: int | None = None,
        noise_seed: int = 0,
        head_vocab_tile: int = 4096,
    ) -> None:
        super().__init__()
        self._validate_arguments(
            lr=lr, warmup_steps=warmup_steps, max_new_tokens=max_new_tokens, top_k=top_k, tau_start=tau_start,
            tau_end=tau_end, tau_anneal_steps=tau_anneal_steps, kl_coef=kl_coef, memory_mode=memory_mode,
            head_vocab_tile=head_vocab_tile,
        )
        self.save_hyperparameters(ignore=["model_config", "tokenizer", "reward_model"])
        self.val_reward = MeanAndStderr()  # over held-out prompts
        self.val_accuracy = MeanAndStderr()  # the hard tokens' answers, where the data has answers and a checker
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.policy = model_config.build_model()
        # Under LoRA the reference is the base network with adapters switched off: no weight copy.
        self.reference = None if is_peft_model(self.policy) else copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.reward_model = self._build_reward_model(reward_model, model_config, tokenizer).eval().requires_grad_(False)

        vocab = lm_head_weight(self.policy).shape[0]
        reward_vocab = self.reward_model.get_input_embeddings().weight.shape[0]
        if reward_vocab != vocab:
            raise ValueError(
                f"module.reward_model has a vocabulary of {reward_vocab} ids but the policy has {vocab}; "
                "the reward model must read the policy's tokens (same tokenizer)."
            )
        if top_k is not None and int(top_k) > vocab:
            raise ValueError(f"module.top_k={top_k} exceeds the vocabulary size {vocab}; use 1 <= top_k <= {vocab} or null.")
        if memory_mode == "legacy" and top_k is not None and int(top_k) != vocab:
            rank_zero_info(f"GRADE legacy mode samples over the full vocabulary ({vocab}); module.top_k={top_k} is not used.")
        self._batch_start: float | None = None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _validate_arguments(**kw: Any) -> None:
        if kw["lr"] <= 0:
            raise ValueError(f"module.lr must be > 0, got {kw['lr']!r}.")
        if kw["warmup_steps"] < 0:
            raise ValueError(f"module.warmup_steps must be >= 0, got {kw['warmup_steps']!r}.")
        if int(kw["max_new_tokens"]) < 1:
            raise ValueError(f"module.max_new_tokens must be >= 1, got {kw['max_new_tokens']!r}.")
        if kw["top_k"] is not None and int(kw["top_k"]) < 1:
            raise ValueError(f"module.top_k must be >= 1 or null (full vocabulary), got {kw['top_k']!r}.")
        for name in ("tau_start", "tau_end"):
            if not kw[name] > 0:
                raise ValueError(f"module.{name} must be > 0, got {kw[name]!r}.")
        if int(kw["tau_anneal_steps"]) < 0:
            raise ValueError(f"module.tau_anneal_steps must be >= 0, got {kw['tau_anneal_steps']!r}.")
        if kw["kl_coef"] < 0:
            raise ValueError(f"module.kl_coef must be >= 0, got {kw['kl_coef']!r}.")
        if int(kw["head_vocab_tile"]) < 1:
            raise ValueError(f"module.head_vocab_tile must be >= 1, got {kw['head_vocab_tile']!r}.")
        if kw["memory_mode"] not in MEMORY_MODES:
            raise ValueError(f"module.memory_mode={kw['memory_mode']!r} is not supported; use one of {list(MEMORY_MODES)}.")

    def _build_reward_model(self, reward_model: Any, model_config: ModelConfig, tokenizer: Any) -> nn.Module:
        if reward_model is None:
            return build_rule_reward_model(model_config, tokenizer, seq_len=int(self.hparams.max_new_tokens))
        if isinstance(reward_model, nn.Module):
            return reward_model
        if callable(reward_model):
            built = reward_model(model_config=model_config, tokenizer=tokenizer)
            if not isinstance(built, nn.Module):
                raise TypeError(f"module.reward_model factory returned {type(built).__name__}, expected an nn.Module.")
            return built
        raise TypeError(
            f"module.reward_model must be an nn.Module, a factory (e.g. a Hydra _partial_) or null, got {type(reward_model).__name__}."
        )

    def train(self, mode: bool = True) -> GradeModule:
        # Lightning switches every submodule to train mode; the frozen models must stay deterministic.
        super().train(mode)
        self.reward_model.eval()
        if self.reference is not None:
            self.reference.eval()
        return self

    # ------------------------------------------------------------------ schedule
    def current_tau(self, step: int | None = None) -> float:
        """Gumbel temperature at optimizer step ``step`` (default: the current one), linearly annealed."""
        step = self.global_step if step is None else step
        anneal = int(self.hparams.tau_anneal_steps)
        frac = 1.0 if anneal == 0 else min(1.0, step / anneal)
        return float(self.hparams.tau_start + (self.hparams.tau_end - self.hparams.tau_start) * frac)

    def noise_generators(
        self, like: Tensor, step: int, batch_idx: int, sample_index: Tensor | None = None
    ) -> list[torch.Generator] | torch.Generator | None:
        """The Gumbel noise of one step: a generator per sample, or ``None`` for fake/meta tensors (memory
        estimates), which cannot draw from a generator.

        With ``sample_index`` (the dataset index of each row, ``[B]``) each row's noise depends on (seed, rank,
        step, sample) only, so a step split into micro-batches draws exactly the noise of the unsplit step.
        Without it, one generator per (rank, step, batch) draws the batch's noise.
        """
        from lit_memopt._compat.torch import is_fake

        if like.device.type == "meta" or is_fake(like):
            return None
        base, rank = int(self.hparams.noise_seed), int(self.global_rank)
        if sample_index is None:
            return generator_for(like.device, derive_seed(base, rank=rank, step=step, index=batch_idx, stream="grade/batch"))
        return [
            generator_for(like.device, derive_seed(base, rank=rank, step=step, index=int(i), stream="grade/sample"))
            for i in sample_index.tolist()
        ]

    @staticmethod
    def _sample_topk(logits: Tensor, tau: float, k: int, hard: bool, generator: Any) -> tuple[Tensor, Tensor]:
        """``topk_gumbel_softmax`` with one generator, or row by row with one generator per sample."""
        if not isinstance(generator, list):
            return topk_gumbel_softmax(logits, tau, k, hard=hard, generator=generator)
        rows = [topk_gumbel_softmax(logits[b : b + 1], tau, k, hard=hard, generator=g) for b, g in enumerate(generator)]
        return torch.cat([w for w, _ in rows]), torch.cat([i for _, i in rows])

    # ------------------------------------------------------------------ models
    @contextlib.contextmanager
    def _reference_mode(self) -> Iterator[nn.Module]:
        """The reference network, without grad (adapters disabled on a LoRA policy)."""
        with torch.no_grad(), reference_model(self.policy, self.reference) as reference:
            yield reference

    def _reference_head(self) -> tuple[Tensor, Tensor | None]:
        model = self.reference if self.reference is not None else self.policy
        return lm_head_weight(model), _head_bias(model)

    def _maybe_checkpoint(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.hparams.checkpoint_steps and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _policy_chunk(self, embeds: Tensor, attention_mask: Tensor, position_ids: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        """Policy forward of ``q`` new positions given earlier per-chunk K/V; returns (last hidden, new K/V...).

        ``embeds`` are input embeddings ``[B, q, H]``, or token ids ``[B, q]`` (the prompt).

        The cache is rebuilt from the chunks inside, and only the new positions' K/V leave: stored
        chunks total ``O(T)``, and under checkpointing the concatenated cache is a recomputed temporary.
        """
        from transformers import DynamicCache

        n_layers = self._num_layers()
        if past:
            n_chunks = len(past) // (2 * n_layers)
            layers = []
            for layer in range(n_layers):
                keys = [past[2 * (c * n_layers + layer)] for c in range(n_chunks)]
                values = [past[2 * (c * n_layers + layer) + 1] for c in range(n_chunks)]
                layers.append((torch.cat(keys, dim=-2), torch.cat(values, dim=-2)))
            cache = DynamicCache(ddp_cache_data=layers)
        else:
            cache = DynamicCache()
        inputs = {"inputs_embeds": embeds} if embeds.is_floating_point() else {"input_ids": embeds}
        out = decoder_outputs(
            self.policy, **inputs, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True,
        )
        q = embeds.shape[1]
        new: list[Tensor] = []
        for layer in cache.layers:
            new.append(layer.keys[:, :, -q:].clone())
            new.append(layer.values[:, :, -q:].clone())
        return (out.last_hidden_state[:, -1], *new)

    def _policy_full(self, embeds: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        out = decoder_outputs(self.policy, inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state[:, -1]

    def _num_layers(self) -> int:
        config = self.policy.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        return int(text.num_hidden_layers)

    def _reward(self, inputs_embeds: Tensor) -> Tensor:
        mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        return sequence_reward(self.reward_model(inputs_embeds=inputs_embeds, attention_mask=mask), self.hparams.reward_label)

    # ------------------------------------------------------------------ GRADE
    def generate_and_score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        tau: float,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> GradeOutput:
        """Generate soft tokens from left-padded prompts, score them and return the GRADE loss."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must both be [batch, prompt_len], got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}."
            )
        if self.hparams.memory_mode == "legacy":
            return self._legacy(input_ids, attention_mask, tau, generator)
        root = self.__dict__.get("_policy_root")
        if root is not None:  # FSDP2: the whole generation runs as the root's forward
            return root(self._optimized, input_ids, attention_mask, tau, generator)
        return self._optimized(input_ids, attention_mask, tau, generator)

    def _optimized(self, input_ids: Tensor, attention_mask: Tensor, tau: float, generator: Any) -> GradeOutput:
        hp = self.hparams
        steps = int(hp.max_new_tokens)
        batch = input_ids.shape[0]
        mask = attention_mask.long()
        positions = position_ids_from_mask(mask)
        next_position = mask.sum(dim=-1, keepdim=True)

        # The prompt goes in as token ids, and the embedding and head weights are read only after this
        # first forward: under FSDP2 the root's forward is what gathers them (and keeps them gathered).
        hidden, *chunks = self._maybe_checkpoint(self._policy_chunk, input_ids, mask, positions)
        weight, bias = lm_head_weight(self.policy), _head_bias(self.policy)
        ref_weight, ref_bias = self._reference_head()
        embedding = self.policy.get_input_embeddings().weight
        k = weight.shape[0] if hp.top_k is None else int(hp.top_k)
        # All B rows in one tile and wide vocabulary tiles: with a handful of rows, the automatic
        # tiling (sized for [tokens, vocab] workloads) would cut the head into thousands of slivers.
        head_tiles = (batch, int(hp.head_vocab_tile))
        with self._reference_mode() as reference:
            from transformers import DynamicCache

            ref_cache = DynamicCache()
            ref_hidden = decoder_outputs(reference, 
                input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=ref_cache, use_cache=True
            ).last_hidden_state[:, -1]

        weights_steps, ids_steps, kl_steps, tokens, soft_entropy, policy_entropy = [], [], [], [], [], []
        for t in range(steps):
            # Only this position's [B, V] logits exist, and only until top-k has picked from them.
            logits = _logits(hidden, weight, bias)
            weights, ids = self._sample_topk(logits, tau, k, bool(hp.hard), generator)
            with torch.no_grad():
                policy_entropy.append(_entropy(logits))
            del logits
            kl_steps.append(
                linear_kl(hidden, weight, ref_hidden, ref_weight, bias=bias, ref_bias=ref_bias, chunk_size=head_tiles)
            )
            token = ids.gather(-1, weights.argmax(dim=-1, keepdim=True)).squeeze(-1)
            weights_steps.append(weights)
            ids_steps.append(ids)
            tokens.append(token)
            with torch.no_grad():
                soft_entropy.append(torch.special.entr(weights.detach().float()).sum(dim=-1))
            if t == steps - 1:
                break
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            step_position = next_position + t
            step_embeds = soft_embedding(weights, ids, embedding).unsqueeze(1)
            hidden, *new = self._maybe_checkpoint(self._policy_chunk, step_embeds, mask, step_position, *chunks)
            chunks.extend(new)
            with self._reference_mode() as reference:
                ref_hidden = decoder_outputs(reference, 
                    input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=step_position,
                    past_key_values=ref_cache, use_cache=True,
                ).last_hidden_state[:, -1]
        del chunks, ref_cache

        all_weights, all_ids = torch.stack(weights_steps, dim=1), torch.stack(ids_steps, dim=1)
        reward = self._reward(soft_embedding(all_weights, all_ids, self.reward_model.get_input_embeddings().weight))
        kl = torch.stack(kl_steps, dim=1)
        loss = -reward.mean() + float(hp.kl_coef) * kl.mean()
        return GradeOutput(
            loss=loss, reward=reward, kl=kl, tokens=torch.stack(tokens, dim=1),
            soft_entropy=torch.stack(soft_entropy, dim=1), policy_entropy=torch.stack(policy_entropy, dim=1),
            weights=all_weights, ids=all_ids,
        )

    def _legacy(self, input_ids: Tensor, attention_mask: Tensor, tau: float, generator: Any) -> GradeOutput:
        if is_fsdp_sharded(self.policy):
            raise ValueError("module.memory_mode=legacy (the dense baseline) does not run on trainer=fsdp2; use memory_mode=optimized")
        hp = self.hparams
        steps = int(hp.max_new_tokens)
        weight, bias = lm_head_weight(self.policy), _head_bias(self.policy)
        ref_weight, ref_bias = self._reference_head()
        embedding = self.policy.get_input_embeddings().weight
        vocab = weight.shape[0]
        batch = input_ids.shape[0]
        mask = attention_mask.long()
        positions = position_ids_from_mask(mask)
        ids_so_far = input_ids
        embeds = self.policy.get_input_embeddings()(input_ids)

        logits_steps, ref_logits_steps, soft_steps = [], [], []
        for t in range(steps):
            # The original recipe: no KV cache, the whole sequence again at every step.
            hidden = self._maybe_checkpoint(self._policy_full, embeds, mask, positions)
            logits = _logits(hidden, weight, bias)
            with self._reference_mode() as reference:
                ref_hidden = decoder_outputs(reference, 
                    input_ids=ids_so_far, attention_mask=mask, position_ids=positions, use_cache=False
                ).last_hidden_state[:, -1]
                ref_logits = _logits(ref_hidden, ref_weight, ref_bias)
            weights, ids = self._sample_topk(logits, tau, vocab, bool(hp.hard), generator)
            soft = logits.new_zeros(batch, vocab).scatter(-1, ids, weights)
            logits_steps.append(logits)
            ref_logits_steps.append(ref_logits)
            soft_steps.append(soft)
            if t == steps - 1:
                break
            token = soft.argmax(dim=-1, keepdim=True)
            embeds = torch.cat([embeds, (soft.to(embedding.dtype) @ embedding).unsqueeze(1)], dim=1)
            ids_so_far = torch.cat([ids_so_far, token], dim=1)
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)

        logits_all = torch.stack(logits_steps, dim=1)
        ref_logp = torch.stack(ref_logits_steps, dim=1).log_softmax(dim=-1)
        soft_all = torch.stack(soft_steps, dim=1)
        logp = logits_all.log_softmax(dim=-1)
        kl = (logp.exp() * (logp - ref_logp)).sum(dim=-1)
        reward_embedding = self.reward_model.get_input_embeddings().weight
        reward = self._reward(soft_all.to(reward_embedding.dtype) @ reward_embedding)
        loss = -reward.mean() + float(hp.kl_coef) * kl.mean()
        with torch.no_grad():
            policy_entropy = _entropy(logits_all)
            soft_entropy = torch.special.entr(soft_all.detach()).sum(dim=-1)
        return GradeOutput(
            loss=loss, reward=reward, kl=kl, tokens=soft_all.argmax(dim=-1),
            soft_entropy=soft_entropy, policy_entropy=policy_entropy,
            weights=soft_all, ids=torch.arange(vocab, device=soft_all.device).expand_as(soft_all),
        )

    # ------------------------------------------------------------------ Lightning hooks
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tau = self.current_tau()
        generator = self.noise_generators(batch["input_ids"], self.global_step, batch_idx, batch.get("index"))
        out = self.generate_and_score(batch["input_ids"], batch.get("attention_mask"), tau=tau, generator=generator)
        size = batch["input_ids"].shape[0]
        self.log("train/loss", out.loss.detach(), batch_size=size)
        self.log("train/reward", out.reward.detach().mean(), prog_bar=True, batch_size=size)
        self.log("train/kl", out.kl.detach().mean(), prog_bar=True, batch_size=size)
        self.log("train/tau", tau, batch_size=size)
        self.log("train/soft_token_entropy", out.soft_entropy.mean(), batch_size=size)
        self.log("train/policy_entropy", out.policy_entropy.mean(), batch_size=size)
        return out.loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        generator = self.noise_generators(batch["input_ids"], -1, batch_idx, batch.get("index"))
        out = self.generate_and_score(batch["input_ids"], batch.get("attention_mask"), tau=self.current_tau(), generator=generator)
        size = batch["input_ids"].shape[0]
        self.val_reward.update(out.reward)
        self.log("val/kl", out.kl.mean(), batch_size=size, sync_dist=True)
        accuracy = self._accuracy(batch, out.tokens)
        if accuracy is not None:
            self.val_accuracy.update(accuracy)
        return out.loss

    def _accuracy(self, batch: dict[str, Any], tokens: Tensor) -> Tensor | None:
        """The data's checker on the decoded hard tokens, one score per prompt (``None`` without answers or checker).

        Only logged: GRADE's reward is its reward model's, never the answers'.
        """
        checker = getattr(getattr(attached_trainer(self), "datamodule", None), "checker", None)
        answers = batch.get("answers")
        if checker is None or answers is None or self.tokenizer is None:
            return None
        texts = self.tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
        scores = [float(checker(text, answer)) if answer is not None else 0.0 for text, answer in zip(texts, answers)]
        return torch.tensor(scores, dtype=torch.float32, device=tokens.device)

    def on_validation_epoch_end(self) -> None:
        """``val/reward`` (and ``val/accuracy`` with answers) over every rank's held-out prompts, with standard errors."""
        self.val_reward.log_and_reset(self, "val/reward")
        self.val_accuracy.log_and_reset(self, "val/accuracy")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._batch_start is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._batch_start
        self._batch_start = None
        tokens = batch["input_ids"].shape[0] * int(self.hparams.max_new_tokens)
        self.log("train/tokens_per_s", tokens / max(elapsed, 1e-9), batch_size=batch["input_ids"].shape[0])

    def configure_model(self) -> None:
        """Under FSDP2 (``trainer=fsdp2``) shard the policy's decoder blocks, with a :class:`RootCall` around
        the whole generation as the root (the policy is called once per soft token, with inputs that need
        gradients); the frozen reference and reward models stay replicated."""
        if getattr(self, "device_mesh", None) is None or is_fsdp_sharded(self.policy):
            return
        root = RootCall(self.policy)
        self.__dict__["_policy_root"] = root  # not a submodule: the policy is registered once, as self.policy
        shard_for_fsdp2(self, self.policy, root=root)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError("GradeModule: the policy has no trainable parameters (check model.lora).")
        return adamw_with_warmup(
            params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=self.hparams.betas,
            warmup_steps=self.hparams.warmup_steps,
        )
