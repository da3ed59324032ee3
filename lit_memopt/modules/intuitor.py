"""Intuitor (Zhao et al., 2025): GRPO whose reward is the policy's own self-certainty, computed with the
fused head ops so no ``[tokens, vocab]`` logits are ever held."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memopt._compat.lightning import attached_trainer
from lit_memopt.models import lm_head_weight
from lit_memopt.models.hf import checkpoint_period, enable_gradient_checkpointing
from lit_memopt.models.sharding import shard_for_fsdp2
from lit_memopt.modules._optim import adamw_with_warmup
from lit_memopt.modules.heldout import MeanAndStderr
from lit_memopt.modules.rollout import (
    SCALE_REWARDS,
    Rollout,
    generate,
    group_advantages,
    is_peft_model,
    masked_mean,
    reference_logprobs,
    response_hidden_states,
    scatter_response,
    share_rewards_of_identical_responses,
)
from lit_memopt.modules.warm_start import WarmStart, warm_start_in_setup
from lit_memopt.rewards.verifiers import call_reward_fn, load_reward_fn
from lit_memopt.seeding import derive_seed


class IntuitorModule(pl.LightningModule):
    """GRPO with the self-certainty reward (Intuitor), memory-efficient, with automatic optimization.

    Each training step takes a batch of prompts and, per prompt, samples ``num_samples`` (``G``)
    responses with transformers' KV-cached ``generate`` (no grad). Each response's reward is its
    self-certainty: the mean over its tokens of ``KL(U || p)`` at the sampling temperature, where
    ``U`` is uniform over the vocabulary and ``p`` the current policy's next-token distribution
    (``linear_self_certainty(...) - log V``, without grad). With ``accuracy_weight = w > 0`` the
    reward is ``(1 - w) * self_certainty + w * accuracy`` from the data's checker (``w = 1`` is plain
    GRPO with a verifiable reward), or with ``reward_fn`` set, ``w`` times that function's reward in
    place of the accuracy. Advantages are normalised within each prompt's group, and the
    loss is the clipped PPO loss (``ppo_clip_loss``'s maths, clip ``clip_eps``) plus ``kl_coef`` times the k3 estimate of
    ``KL(pi || pi_ref)``.

    Memory: the loss comes from the decoder's hidden states through ``linear_policy_loss`` (no
    ``[tokens, vocab]`` logits; its head gradients made in the forward), on response tokens only; one pass
    without gradients before it gives the sampling log-probs and the self-certainty reward; the reference pass runs without grad, in micro-batches of
    ``reference_micro_batch_size`` rollouts, *before* the policy forward, so the two never coexist.
    With LoRA (``model.lora``) the reference is the base model under ``disable_adapter()``: no extra
    weights. Without LoRA the reference is a frozen copy of the initial policy: one more copy of the
    parameters (for Qwen2.5-1.5B in bf16 about 3.1 GB; the tiny default, 13 MB); it is saved in
    checkpoints so a resumed run keeps the same reference.

    One optimisation step per rollout batch (``mu = 1`` in GRPO terms): the "old" log-probs are the
    detached current ones, so the importance ratio is 1 at the update and the clip guards only
    against numerical drift; the same holds when a callback splits the prompt batch into
    micro-batches, because groups are formed per prompt. The responses of the whole loader batch are
    sampled once in ``on_train_batch_start``, and the loss is a token mean over the whole step's
    responses: a step that ``OOMRecovery`` splits on an OOM (weighting micro-batches by their share of
    prompts) trains on the same responses with the same loss as the unsplit step.

    Args:
        model_config: what to build (``lit_memopt.models.ModelConfig``).
        tokenizer: the tokenizer (EOS/pad ids for generation; decodes responses for the checker).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up steps (then constant).
        num_samples: responses per prompt (``G``), >= 2 (a group of one has no advantage).
        max_new_tokens: response length cap.
        temperature: sampling temperature; self-certainty and log-probs use the same one.
        top_p: nucleus sampling mass (1.0 keeps sampling on-policy).
        clip_eps: PPO clip range.
        kl_coef: weight ``beta`` of the k3 KL penalty to the reference; 0 skips the reference pass.
        accuracy_weight: weight ``w`` in ``[0, 1]`` of the verifiable-accuracy reward.
        advantage_eps: added to each group's reward std before dividing.
        scale_rewards: ``"group"`` divides each group's centred rewards by the group's std (GRPO);
            ``"none"`` does not (Dr. GRPO; see :func:`~lit_memopt.modules.rollout.group_advantages`).
        reference_micro_batch_size: rollouts per reference forward (``None``: all at once).
        chunk_size: tile of the fused head ops (``None``: automatic).
        gradient_checkpointing: transformers' non-reentrant activation checkpointing: ``true`` of every decoder
            layer, an integer ``k >= 2`` of every k-th (less recomputation, less saved), ``false`` none.
        seed: base seed of the rollouts (each step samples with ``seed + step``-derived seeds).
        checker: ``checker(response_text, answer) -> float`` in ``[0, 1]``; ``None`` uses the
            datamodule's ``checker`` attribute when it has one. Accuracy needs ``answers`` in the batch.
        warm_start: a supervised warm start on the datamodule's task family before RL
            (:class:`lit_memopt.modules.warm_start.WarmStart` or its fields as a mapping; ``None``: off).
            The reference policy is the warm-started one.
        val_greedy: also answer each held-out prompt by greedy decoding (``val/accuracy_greedy``): how far
            sharpening the sampled answers towards the policy's mode could take ``val/accuracy``.
        reward_fn: ``"package.module:function"`` (or ``"package.module.function"``): a reward function with TRL's
            signature ``fn(prompts, completions, **kwargs) -> list[float]``, called on the decoded responses
            with the batch's ``answer`` and other data columns (``reward_kwargs``) as keyword lists, one item
            per response. Its reward replaces the checker's accuracy in the reward (``accuracy_weight``
            still mixes it with self-certainty); accuracy is still logged. ``None``: the checker's accuracy.

    Raises:
        ValueError: on an out-of-range hyper-parameter or a ``reward_fn`` that cannot be imported; at ``setup``,
            ``accuracy_weight > 0`` without a checker or reward function, data without answers that the reward
            needs, or prompts (``data.max_prompt_length``) plus responses (``max_new_tokens``) longer than the
            model's ``max_position_embeddings``.

    Example::

        from lit_memopt.models import ModelConfig
        cfg = ModelConfig(name="tiny", arch={"model_type": "qwen3", "vocab_size": 384, "hidden_size": 64,
                          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "head_dim": 32})
        module = IntuitorModule(cfg, cfg.build_tokenizer(), num_samples=4, max_new_tokens=8)
    """

    # frozen models configure_model leaves whole on every rank under FSDP2 (the estimator's per-rank arithmetic)
    fsdp2_replicated = ("reference",)

    # Responses are sampled until end-of-sequence: `lit-memopt estimate` sizes the worst case (all at max_new_tokens).
    generates_until_eos = True

    summary_keys = ("train/self_certainty", "train/kl", "val/accuracy", "val/accuracy_stderr", "val/accuracy_greedy",
                    "val/accuracy_greedy_stderr", "val/self_certainty", "train/accuracy",  # with a checker
                    "train/reward_fn")  # with module.reward_fn

    def __init__(
        self,
        model_config: Any,
        tokenizer: Any = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 0,
        num_samples: int = 8,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        clip_eps: float = 0.2,
        kl_coef: float = 0.005,
        accuracy_weight: float = 0.0,
        advantage_eps: float = 1e-6,
        scale_rewards: str = "group",
        reference_micro_batch_size: int | None = None,
        chunk_size: int | None = None,
        gradient_checkpointing: bool | int = False,
        seed: int = 0,
        checker: Callable[[str, str], float] | None = None,
        warm_start: dict[str, Any] | WarmStart | None = None,
        val_greedy: bool = False,
        reward_fn: str | None = None,
    ) -> None:
        super().__init__()
        self.warm_start = WarmStart.from_any(warm_start)
        self.reward_fn = load_reward_fn(reward_fn) if reward_fn is not None else None
        _check(lr > 0, "lr", lr, "> 0")
        _check(weight_decay >= 0, "weight_decay", weight_decay, ">= 0")
        _check(int(warmup_steps) >= 0, "warmup_steps", warmup_steps, ">= 0")
        _check(int(num_samples) >= 2, "num_samples", num_samples, ">= 2 (GRPO compares responses within a group)")
        _check(int(max_new_tokens) >= 1, "max_new_tokens", max_new_tokens, ">= 1")
        _check(temperature > 0, "temperature", temperature, "> 0")
        _check(0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
        _check(clip_eps > 0, "clip_eps", clip_eps, "> 0")
        _check(kl_coef >= 0, "kl_coef", kl_coef, ">= 0")
        _check(0 <= accuracy_weight <= 1, "accuracy_weight", accuracy_weight, "in [0, 1]")
        _check(advantage_eps > 0, "advantage_eps", advantage_eps, "> 0")
        _check(scale_rewards in SCALE_REWARDS, "scale_rewards", scale_rewards, f"one of {list(SCALE_REWARDS)}")
        if reference_micro_batch_size is not None:
            _check(int(reference_micro_batch_size) >= 1, "reference_micro_batch_size", reference_micro_batch_size, ">= 1 or null")
        if self.reward_fn is not None and accuracy_weight == 0:
            rank_zero_warn(f"module.reward_fn={reward_fn!r} does not enter the reward with module.accuracy_weight=0 "
                           "(self-certainty alone; it is only logged, as train/reward_fn); set module.accuracy_weight > 0.")
        self.save_hyperparameters(ignore=["model_config", "tokenizer", "checker", "warm_start"])
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.checker = checker
        self.model = model_config.build_model()
        self.val_accuracy = MeanAndStderr()  # over held-out prompts
        self.val_accuracy_greedy = MeanAndStderr()
        period = checkpoint_period(gradient_checkpointing, "module.gradient_checkpointing")
        if period:
            enable_gradient_checkpointing(self.model, every_n_layers=period)
        self.reference: torch.nn.Module | None = None
        if kl_coef > 0 and not is_peft_model(self.model):
            # No adapter to switch off: keep a frozen copy of the initial policy as the reference.
            self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()

    # ------------------------------------------------------------------ setup

    def setup(self, stage: str) -> None:
        datamodule = getattr(attached_trainer(self), "datamodule", None)
        if self.checker is None:
            self.checker = getattr(datamodule, "checker", None)
        # Checked before the warm start: a run that cannot reward its responses stops before any training.
        _check_data_fits(self, datamodule)
        warm_start_in_setup(self, self.model, self.warm_start, reference=self.reference)
        reference = "base weights under disable_adapter()" if self.reference is None else "a frozen copy of the initial policy"
        if self.hparams.kl_coef > 0:
            rank_zero_info(f"IntuitorModule: reference policy = {reference}.")

    # ------------------------------------------------------------------ rollouts and rewards

    def _rollout_seed(self, batch_idx: int) -> int:
        # Distinct per step and rank, reproducible for a fixed module seed.
        return derive_seed(self.hparams.seed, rank=self.global_rank, step=self.global_step, index=batch_idx,
                           stream="intuitor/rollout")

    def _rollout(self, batch: dict[str, Any], num_samples: int, seed: int | None, greedy: bool = False) -> Rollout:
        return generate(
            self.model,
            batch["input_ids"],
            tokenizer=self.tokenizer,
            attention_mask=batch.get("attention_mask"),
            num_samples=num_samples,
            max_new_tokens=self.hparams.max_new_tokens,
            temperature=self.hparams.temperature,
            top_p=self.hparams.top_p,
            seed=seed,
            greedy=greedy,
        )

    def _truncated(self, rollout: Rollout) -> torch.Tensor:
        """``[N]`` bool: responses cut at ``max_new_tokens`` without an end-of-sequence token."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        lengths = rollout.response_lengths
        at_cap = lengths >= int(self.hparams.max_new_tokens)
        if eos is None or not bool(at_cap.any()):
            return at_cap
        last = rollout.response_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        return at_cap & (last != eos)  # a response whose last allowed token is EOS finished

    def _accuracy(self, batch: dict[str, Any], rollout: Rollout, texts: list[str] | None = None) -> torch.Tensor | None:
        answers = batch.get("answers")
        if self.checker is None or answers is None or self.tokenizer is None:
            return None
        texts = rollout.decode_responses(self.tokenizer) if texts is None else texts
        repeated = [a for a in answers for _ in range(rollout.num_samples)]
        scores = [float(self.checker(text, answer)) for text, answer in zip(texts, repeated)]
        return torch.tensor(scores, dtype=torch.float32, device=rollout.input_ids.device)

    def _rewards(self, batch: dict[str, Any], rollout: Rollout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(accuracy, external reward)`` per response: the checker's verdicts (``None`` without a checker or
        answers), and the reward mixed in by ``accuracy_weight``: ``reward_fn``'s when set, else the accuracy."""
        checked = self.checker is not None and batch.get("answers") is not None
        decode = self.tokenizer is not None and (checked or self.reward_fn is not None)
        texts = rollout.decode_responses(self.tokenizer) if decode else None
        accuracy = self._accuracy(batch, rollout, texts)
        if self.reward_fn is None or texts is None:
            return accuracy, accuracy
        values = call_reward_fn(self.reward_fn, batch.get("prompts") or [], texts, rollout.num_samples,
                                answers=batch.get("answers"), columns=batch.get("reward_kwargs"))
        return accuracy, torch.tensor(values, dtype=torch.float32, device=rollout.input_ids.device)

    def _log_vocab(self) -> float:
        return math.log(lm_head_weight(self.model).shape[0])

    # ------------------------------------------------------------------ steps

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Sample the whole loader batch's responses before any micro-batching.

        A step that ``OOMRecovery`` splits (on an OOM) then trains on exactly the responses of the
        unsplit step, and every micro-batch knows the step's total response tokens (its loss share).
        """
        self._batch_rollout = None
        if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
            rollout = self._rollout(batch, int(self.hparams.num_samples), self._rollout_seed(batch_idx))
            self._batch_rollout = _BatchRollout(batch_idx, batch["input_ids"], rollout)

    def _rollout_for(self, batch: dict[str, Any], batch_idx: int) -> tuple[Rollout, float]:
        """This (micro-)batch's rows of the step's rollout and its loss scale (1.0 for the whole batch)."""
        cached = getattr(self, "_batch_rollout", None)
        if cached is not None and cached.batch_idx == batch_idx:
            found = cached.select(batch["input_ids"])
            if found is not None:
                return found
        # No whole-batch rollout (training_step called directly): sample this batch on its own.
        return self._rollout(batch, int(self.hparams.num_samples), self._rollout_seed(batch_idx)), 1.0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        from lit_memopt.ops import linear_policy_loss
        from lit_memopt.ops.linear_head import run_head

        hp = self.hparams
        group = int(hp.num_samples)
        rollout, loss_scale = self._rollout_for(batch, batch_idx)
        args = (rollout.input_ids, rollout.attention_mask, rollout.response_mask)

        ref_logp = None
        if hp.kl_coef > 0:
            ref_logp = reference_logprobs(
                self.model,
                *args,
                reference_model=self.reference,
                temperature=hp.temperature,
                micro_batch_size=hp.reference_micro_batch_size,
                chunk_size=hp.chunk_size,
            )

        hidden, targets, positions = response_hidden_states(self.model, *args)
        weight = lm_head_weight(self.model)
        head = {"temperature": hp.temperature, "chunk_size": hp.chunk_size}
        with torch.no_grad():
            # The sampling policy's log-probs (this step samples on-policy) and the reward, a fixed number per
            # response, in one pass over the head without gradients: one product.
            logp_tokens, certainty_tokens = run_head(hidden.detach(), weight.detach(), targets,
                                                     ("logprobs", "self_certainty"), **head)
            logp = scatter_response(logp_tokens, positions)
            certainty = masked_mean(scatter_response(certainty_tokens, positions), positions, dim=-1) - self._log_vocab()
            accuracy, external = self._rewards(batch, rollout)
            # identical responses of a group get one reward, not rounding-noise rivals (see the function)
            reward = share_rewards_of_identical_responses(certainty, rollout)
            if external is not None and hp.accuracy_weight > 0:
                reward = (1.0 - hp.accuracy_weight) * reward + hp.accuracy_weight * external
            truncated = self._truncated(rollout)
            advantages = group_advantages(reward, group, hp.advantage_eps, scale=hp.scale_rewards)

        # The clipped loss on the response rows, its head gradients made in the forward pass (three products instead
        # of the four of log-probs then ppo_clip_loss): each row carries its response's advantage.
        loss = linear_policy_loss(
            hidden,
            weight,
            targets,
            logp_tokens,
            advantages[:, None].expand_as(positions)[positions],
            clip_eps=hp.clip_eps,
            ref_logp=None if ref_logp is None else ref_logp[positions],
            kl_coef=hp.kl_coef,
            **head,
        ) * loss_scale  # a token mean over the whole step's responses, whatever the split (see _BatchRollout)

        num_prompts = batch["input_ids"].shape[0]
        with torch.no_grad():
            if ref_logp is not None:
                delta = ref_logp - logp
                kl = masked_mean(torch.exp(delta) - delta - 1.0, positions)  # k3, as in the loss
            else:
                kl = torch.zeros((), device=logp.device)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=num_prompts)
        self.log("train/self_certainty", certainty.mean(), prog_bar=True, batch_size=num_prompts)
        self.log("train/reward", reward.mean(), batch_size=num_prompts)
        self.log("train/kl", kl, prog_bar=True, batch_size=num_prompts)
        self.log("train/response_length", rollout.response_lengths.float().mean(), batch_size=num_prompts)
        self.log("train/truncated", truncated.float().mean(), batch_size=num_prompts)
        if accuracy is not None:
            self.log("train/accuracy", accuracy.mean(), prog_bar=True, batch_size=num_prompts)
        if self.reward_fn is not None and external is not None:
            self.log("train/reward_fn", external.mean(), batch_size=num_prompts)
        return loss

    @torch.no_grad()
    def sample_self_certainty(self, batch: dict[str, Any], num_samples: int = 1, seed: int = 0) -> tuple[Rollout, torch.Tensor]:
        """Sample ``num_samples`` responses per prompt (seeded) and return them with their self-certainty ``[N]``.

        The score is the reward of :meth:`training_step`: the mean over response tokens of
        ``KL(U || p)`` at the module's temperature. Useful for evaluation on fixed prompts.
        """
        from lit_memopt.ops import linear_self_certainty

        hp = self.hparams
        rollout = self._rollout(batch, num_samples, seed)
        hidden, _, positions = response_hidden_states(self.model, rollout.input_ids, rollout.attention_mask, rollout.response_mask)
        tokens = linear_self_certainty(hidden, lm_head_weight(self.model), temperature=hp.temperature, chunk_size=hp.chunk_size)
        return rollout, masked_mean(scatter_response(tokens, positions), positions, dim=-1) - self._log_vocab()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Fixed seeds per batch index: validation numbers are comparable across steps and runs.
        rollout, certainty = self.sample_self_certainty(
            batch, 1, derive_seed(self.hparams.seed, rank=self.global_rank, index=batch_idx, stream="intuitor/val")
        )
        num_prompts = batch["input_ids"].shape[0]
        self.log("val/self_certainty", certainty.mean(), batch_size=num_prompts, sync_dist=True)
        self.log("val/response_length", rollout.response_lengths.float().mean(), batch_size=num_prompts, sync_dist=True)
        accuracy = self._accuracy(batch, rollout)
        if accuracy is not None:
            self.val_accuracy.update(accuracy.view(num_prompts, -1).mean(dim=-1))
            if self.hparams.get("val_greedy", False):
                self.val_accuracy_greedy.update(self._accuracy(batch, self._rollout(batch, 1, seed=None, greedy=True)))

    def on_validation_epoch_end(self) -> None:
        """``val/accuracy`` over every rank's held-out prompts, with its standard error over prompts."""
        self.val_accuracy.log_and_reset(self, "val/accuracy")
        self.val_accuracy_greedy.log_and_reset(self, "val/accuracy_greedy")

    def configure_model(self) -> None:
        """Under FSDP2 (``trainer=fsdp2``) shard each decoder block and the root; elsewhere nothing to do."""
        shard_for_fsdp2(self, self.model)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return adamw_with_warmup(
            params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=self.hparams.betas,
            warmup_steps=self.hparams.warmup_steps,
        )


def _check(ok: bool, name: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ValueError(f"module.{name} must be {accepted}, got {value!r}.")


def _check_data_fits(module: IntuitorModule, datamodule: Any) -> None:
    """The data can reward the module's responses, and its longest prompt plus a response fits the model."""
    hp = module.hparams
    if hp.accuracy_weight > 0 and module.reward_fn is None:
        if module.checker is None:
            raise ValueError(
                f"module.accuracy_weight={hp.accuracy_weight} needs an answer checker: pass checker=..., use a "
                "datamodule with a `checker` attribute (data=reasoning_prompts; data=prompt_dataset with "
                "data.verifier=math_verify|exact), or set module.reward_fn=package.module:function."
            )
        check_answers = getattr(datamodule, "check_answers", None)  # data that may lack answers (data=prompt_dataset)
        if check_answers is not None:
            check_answers(f"module.accuracy_weight={hp.accuracy_weight} (a reward from the answer checker)")
    # The longest prompt the data serves (set up before the module), else the limit it allows.
    prompt_tokens = getattr(datamodule, "longest_prompt", None) or getattr(datamodule, "max_prompt_length", None)
    positions = getattr(getattr(module.model, "config", None), "max_position_embeddings", None)
    if prompt_tokens is not None and positions is not None and prompt_tokens + hp.max_new_tokens > positions:
        raise ValueError(
            f"the longest prompt ({prompt_tokens} tokens) + module.max_new_tokens={hp.max_new_tokens} exceeds the "
            f"model's max_position_embeddings={positions}; lower module.max_new_tokens, or data.max_prompt_length "
            "with data.overlong=drop."
        )


class _BatchRollout:
    """The responses of one loader batch, sampled once, and how a micro-batch of it is weighted.

    ``OOMRecovery`` weights a micro-batch of ``b`` of the batch's ``B`` prompts by ``b / B``. Scaling its
    token-mean loss by ``(B / b) * (its response tokens / the step's response tokens)`` makes the sum
    over micro-batches the token mean over the whole step, as without the split.
    """

    def __init__(self, batch_idx: int, prompt_ids: torch.Tensor, rollout: Rollout) -> None:
        self.batch_idx = batch_idx
        self.prompt_ids = prompt_ids
        self.rollout = rollout
        counted = rollout.response_mask.clone()
        counted[:, 0] = False  # the loss positions (response_hidden_states drops column 0)
        self.tokens_per_row = counted.sum(dim=-1)
        self.total_tokens = max(1, int(self.tokens_per_row.sum()))
        self._cursor = 0

    def select(self, prompt_ids: torch.Tensor) -> tuple[Rollout, float] | None:
        """The rows of a contiguous slice of the batch's prompts (as OOMRecovery cuts it), or ``None``."""
        full, size = self.prompt_ids, prompt_ids.shape[0]
        if prompt_ids.shape[1:] != full.shape[1:] or prompt_ids.device != full.device:
            return None
        # Micro-batches come in order (and restart from 0 after an OOM): look from where the last one ended.
        starts = list(range(self._cursor, full.shape[0] - size + 1)) + list(range(self._cursor))
        start = next((i for i in starts if torch.equal(full[i : i + size], prompt_ids)), None)
        if start is None:
            return None
        self._cursor = (start + size) % full.shape[0]
        group = self.rollout.num_samples
        rows = slice(start * group, (start + size) * group)
        part = Rollout(
            input_ids=self.rollout.input_ids[rows], attention_mask=self.rollout.attention_mask[rows],
            response_mask=self.rollout.response_mask[rows], prompt_length=self.rollout.prompt_length, num_samples=group,
        )
        share_of_prompts = size / full.shape[0]
        share_of_tokens = int(self.tokens_per_row[rows].sum()) / self.total_tokens
        return part, share_of_tokens / share_of_prompts
