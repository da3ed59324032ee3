"""CRSP (Cognition via Rewarded Self-Play): one policy proposes, solves and critiques code I/O tasks,
trained per role with the TR-RPG loss on rewards decided by executing code in the sandbox."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import random
from typing import Any, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_memopt._compat.lightning import attached_trainer
from lit_memopt.callbacks.oom_recovery import OOMRecovery
from lit_memopt.data.code_tasks import CodeTask, batch_call_program, call_program
from lit_memopt.models import lm_head_weight
from lit_memopt.modules.crsp_config import (
    MOVED_KEYS,
    Generation,
    Optim,
    Reward,
    Roles,
    SandboxSettings,
    Validation,
    moved_key_error,
)
from lit_memopt.modules.crsp_protocol import (  # the roles' text protocol (re-exported)
    _CANONICAL,
    ROLES,
    TASK_KINDS,
    PROMPT_STYLES,
    _critique_prompt,
    _propose_prompt,
    _solve_prompt,
    _split_list_repr,
    _Task,
    parse_answer,
    parse_judgement,
    parse_program,
    parse_proposal,
    warm_start_pairs,
)
from lit_memopt.modules.rollout import (
    Rollout,
    generate,
    is_peft_model,
    reference_logprobs,
    response_hidden_states,
)
from lit_memopt.rewards.crsp_rewards import (
    AlphaSchedule,
    RunningNormalizer,
    creativity_score,
    critique_reward,
    length_reward,
    proposer_reward,
    solver_reward,
    think_text,
)
from lit_memopt.rewards.sandbox import Sandbox, SandboxLimits
from lit_memopt.models.adapters import active_adapter, adapter_parameters, add_named_adapters
from lit_memopt.models.sharding import shard_for_fsdp2
from lit_memopt.modules.warm_start import WarmStart, warm_start_in_setup
from lit_memopt.modules.heldout import MeanAndStderr
from lit_memopt.seeding import derive_seed

__all__ = ["CRSPModule", "warm_start_pairs", "parse_proposal", "parse_answer", "parse_program", "parse_judgement"]


class CRSPModule(pl.LightningModule):
    """CRSP self-play on code input/output tasks: propose, solve, critique, each trained with TR-RPG.

    Every step, one shared policy plays three roles, one after another:

    1. **propose**: for each seed task of the batch (shown as an example), write a function ``f``
       and input(s). The proposal is executed in the :class:`~lit_memopt.rewards.sandbox.Sandbox`;
       it is valid when ``f(input)`` runs and prints a short output. An invalid proposal (the
       common case for a small or untrained model) earns 0 and the seed task from the built-in
       bank is used in its place, so the solver and critique roles always train.
    2. **solve**: ``roles.num_solver_samples`` answers per task. Task kind ``output``: predict
       ``f(input)``; kind ``function`` (share ``roles.function_task_ratio``): write ``f`` from
       input/output pairs. Correctness is decided by execution (the prediction is canonicalised
       with ``ast.literal_eval`` in the sandbox; a written ``f`` is run on every input).
    3. **critique**: ``roles.critiques_per_task`` solver answers per task are judged; the critique earns
       agreement with the executed verdict plus a lexical creativity score.

    Rewards (see :mod:`lit_memopt.rewards.crsp_rewards`): solver ``alpha_s * correct + (1 - alpha_s)
    * length`` (log-length of the ``<think>`` span with an exponential penalty past a threshold);
    critique ``alpha_c * agreement + (1 - alpha_c) * creativity``; proposer ``1 - solve_rate`` when
    ``0 < solve_rate < 1``, else 0. ``(alpha_s, alpha_c)`` follow :class:`AlphaSchedule` over
    ``global_step / max_steps``. Each role's rewards are standardised by its own running mean/std.

    Loss: ``tr_rpg_loss(logp, logp_ref, reward, roles.<role>.beta, mask=response tokens)`` per role, where
    ``logp_ref`` comes from the reference policy, so the ``beta`` term regularises towards it (data
    are on-policy: one update per rollout). The step's loss is the sum of the three role losses, each
    times its ``roles.<role>.weight``.

    Memory: the loss comes from decoder hidden states through ``linear_policy_loss(objective="tr_rpg")`` (no
    ``[B, T, V]`` logits; the head's gradients are made in the forward pass), reference log-probs without grad
    in micro-batches. With LoRA (``model.lora``) the
    reference is the base model under ``disable_adapter()``, sharing every weight; without LoRA it
    is a frozen copy of the initial policy (one more copy of the weights, announced at setup).
    Roles are processed one after another and each in micro-batches of ``generation.micro_batch_size``
    sequences with a backward pass per micro-batch, so the autograd graph alive at any time is
    that of one micro-batch of one role. This needs **manual optimization** (Lightning's automatic
    optimization takes one loss per step): set ``trainer.gradient_clip_val=null`` and use
    ``optim.gradient_clip_val``. Micro-batch losses are weighted by their share of the role's
    response tokens, so the gradient equals that of the whole role batch. Each micro-batch goes
    through ``OOMRecovery.run_micro_batches`` (the callback's manual-optimization helper): with an
    ``OOMRecovery`` callback an out-of-memory micro-batch is split further and retried (its parts
    weighted as that callback's ``loss_weighting`` says); without one it is a plain backward.

    With ``roles.adapters=True`` (needs LoRA) each role gets its own LoRA adapter (peft multi-adapter,
    same base weights); the reference is still the adapter-free base.

    Args:
        model_config: what to build (``lit_memopt.models.ModelConfig``).
        tokenizer: encodes prompts, decodes responses, counts ``<think>`` tokens.
        optim: AdamW and the manual step's gradient clip (:class:`~lit_memopt.modules.crsp_config.Optim`).
        roles: each role's TR-RPG ``beta`` and loss ``weight``, the clamp, samples and critiques per task, the
            share of function tasks, one adapter per role (:class:`~lit_memopt.modules.crsp_config.Roles`).
        generation: each role's ``max_new_tokens``, the temperature, the micro-batch of the log-prob passes and
            the fused-head tile (:class:`~lit_memopt.modules.crsp_config.Generation`).
        reward: the length reward, the alpha schedule and the reward normaliser
            (:class:`~lit_memopt.modules.crsp_config.Reward`).
        sandbox: the sandbox's limits, workers and required isolation, and the longest valid proposal output
            (:class:`~lit_memopt.modules.crsp_config.SandboxSettings`).
        validation: answers per held-out task and the greedy solve rate
            (:class:`~lit_memopt.modules.crsp_config.Validation`).
        warm_start: a supervised warm start of all three roles on the datamodule's grammar tasks
            (``CodeTaskDataModule(family="grammar")``) before RL; see :meth:`warm_start_examples`
            (:class:`~lit_memopt.modules.warm_start.WarmStart` or its fields; ``None``: off).
        seed: base seed of sampling and task-kind draws.
        prompt_style: ``"instruct"`` (each role prompt says what to write, code in fenced blocks: for real
            checkpoints) or ``"compact"`` (a role tag and the bare program, a third of the bytes: for a tiny
            model that learns the protocol in its warm start).

    Each group is its dataclass or a mapping of its fields (Hydra passes the recipe's ``module.<group>`` as
    one); fields left out keep their defaults.

    Raises:
        ValueError: a setting outside its accepted range (its recipe key named in the message), a flat key of
            before the groups (``module.weight_propose moved to module.roles.propose.weight``), or
            ``roles.adapters`` without ``model.lora``.

    Example::

        module = CRSPModule(ModelConfig(arch={...}, lora={"r": 8}), tokenizer, roles={"num_solver_samples": 4})
        pl.Trainer(max_steps=20, gradient_clip_val=None).fit(module, datamodule=CodeTaskDataModule(tokenizer))
    """

    # frozen models configure_model leaves whole on every rank under FSDP2 (the estimator's per-rank arithmetic)
    fsdp2_replicated = ("reference",)

    # Responses are sampled until end-of-sequence: `lit-memopt estimate` sizes the worst case (all at max_new_tokens).
    generates_until_eos = True

    # Flat key of before the groups -> its key under `module.` now: for the error a stale command line gets.
    moved_keys = MOVED_KEYS

    summary_keys = ("train/reward_propose", "train/reward_solve", "train/reward_critique", "train/solve_rate",
                    "train/proposal_valid_rate", "train/sandbox_cache_hit_rate", "val/solve_rate",
                    "val/solve_rate_stderr", "val/solve_rate_greedy", "val/solve_rate_greedy_stderr",
                    "val/proposal_valid_rate")

    # Where a run sets this module's own micro-batches (under ``module.``): it optimizes manually, so Lightning's
    # gradient accumulation cannot split its step, and ``lit-memopt plan`` searches this setting instead.
    micro_batch_setting = "generation.micro_batch_size"

    def __init__(
        self,
        model_config: Any,
        tokenizer: Any,
        optim: Mapping[str, Any] | Optim | None = None,
        roles: Mapping[str, Any] | Roles | None = None,
        generation: Mapping[str, Any] | Generation | None = None,
        reward: Mapping[str, Any] | Reward | None = None,
        sandbox: Mapping[str, Any] | SandboxSettings | None = None,
        validation: Mapping[str, Any] | Validation | None = None,
        warm_start: Mapping[str, Any] | WarmStart | None = None,
        seed: int = 0,
        prompt_style: str = "instruct",
        **moved: Any,  # the flat keys of before the groups: each gets an error naming its new key
    ) -> None:
        super().__init__()
        if moved:
            raise moved_key_error(moved)
        self.optim = Optim.build(optim)
        self.roles = Roles.build(roles)
        self.generation = Generation.build(generation)
        self.reward = Reward.build(reward)
        self.sandbox_settings = SandboxSettings.build(sandbox)  # `self.sandbox` is the running Sandbox
        self.validation = Validation.build(validation)
        self.warm_start = WarmStart.from_any(warm_start)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"module.seed must be an integer, got {seed!r}.")
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"module.prompt_style must be one of {list(PROMPT_STYLES)}, got {prompt_style!r}.")
        if self.roles.adapters and getattr(model_config, "lora", None) is None:
            raise ValueError("module.roles.adapters=true needs LoRA adapters: set model.lora (e.g. {r: 8}).")
        self.seed, self.prompt_style = seed, prompt_style
        # The settings as the recipe spells them, for the logger's hparams.yaml and the checkpoint.
        self.save_hyperparameters({**{name: dataclasses.asdict(getattr(self, attr)) for name, attr in (
            ("optim", "optim"), ("roles", "roles"), ("generation", "generation"), ("reward", "reward"),
            ("sandbox", "sandbox_settings"), ("validation", "validation"), ("warm_start", "warm_start"))},
            "seed": seed, "prompt_style": prompt_style})
        self.automatic_optimization = False
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model = model_config.build_model()
        if self.roles.adapters:
            add_named_adapters(self.model, ROLES, active="solve")
        self.reference: torch.nn.Module | None = None
        if not is_peft_model(self.model):
            self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.alpha = AlphaSchedule(self.reward.alpha_breakpoints)
        self.normalizers = torch.nn.ModuleDict({role: RunningNormalizer(eps=self.reward.normalizer_eps) for role in ROLES})
        self.sandbox: Sandbox | None = None
        self.val_solve_rate = MeanAndStderr()  # over held-out tasks, whose sampled answers are not independent
        self.val_solve_rate_greedy = MeanAndStderr()

    def largest_pass_sequences(self, tasks: int) -> int:
        """Sequences in the step's largest role pass for a batch of ``tasks`` seed tasks (one proposal each,
        ``roles.num_solver_samples`` answers, ``roles.critiques_per_task`` critiques): the value of
        :attr:`micro_batch_setting` that makes every pass one micro-batch."""
        return tasks * max(1, self.roles.num_solver_samples, self.roles.critiques_per_task)

    # ------------------------------------------------------------------------------ set-up
    def setup(self, stage: str) -> None:
        if self.sandbox is None:
            box = self.sandbox_settings
            self.sandbox = Sandbox(SandboxLimits(wall_time_s=box.wall_time_s, cpu_time_s=box.cpu_time_s,
                                                 memory_mb=box.memory_mb), max_workers=box.workers, require=box.require)
        # Before sharding and before a validation that precedes fit: the first held-out numbers are the warm start's.
        warm_start_in_setup(self, self.model, self.warm_start, reference=self.reference, examples=self.warm_start_examples)
        if stage == "fit":
            clip = getattr(self.trainer, "gradient_clip_val", None) if attached_trainer(self) is not None else None
            if clip is not None:
                raise ValueError(f"CRSPModule uses manual optimization (one backward per micro-batch per role), which "
                                 f"Lightning cannot clip for you: set trainer.gradient_clip_val=null (got {clip}) and "
                                 f"use module.optim.gradient_clip_val instead.")
            reference = ("base weights under disable_adapter()" if self.reference is None
                         else "a frozen copy of the initial policy (set model.lora to share the base weights instead)")
            rank_zero_info(f"CRSPModule: reference policy = {reference}; sandbox isolation = {self.sandbox.isolation}.")

    def teardown(self, stage: str) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def configure_model(self) -> None:
        """Under FSDP2 (``trainer=fsdp2``) shard each decoder block and the root; elsewhere nothing to do."""
        shard_for_fsdp2(self, self.model)

    def configure_optimizers(self) -> Any:
        optim = self.optim
        if self.roles.adapters:
            # One group per role's adapter (peft marks only the active adapter trainable at any moment, so select by
            # name). Each adapter gets the gradient of its own role's loss only, and AdamW ignores a constant scale
            # of that loss: here a role's weight scales its learning rate instead, so it still slows that role.
            params = [{"params": adapter_parameters(self.model, role), "lr": optim.lr * self.roles.of(role).weight}
                      for role in ROLES]
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas))

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # A batch is text (CodeTask) plus an index tensor; prompts become tensors on the right device later.
        return batch

    # ------------------------------------------------------------------------------- helpers
    def _role(self, role: str) -> contextlib.AbstractContextManager:
        """The role's LoRA adapter active inside the block (the previous one restored after it)."""
        return active_adapter(self.model, role if self.roles.adapters else None)

    @property
    def _style(self) -> str:
        return self.prompt_style

    def _seed(self, role: str, stream: str = "") -> int:
        # distinct per rank, step, role (and validation batch); the same on a resumed or retried step
        return derive_seed(self.seed, rank=self.global_rank, step=self.global_step,
                           stream=f"crsp/{stream}/{role}" if stream else f"crsp/{role}")

    def _generate(self, role: str, prompts: list[str], num_samples: int, max_new_tokens: int,
                  stream: str = "", greedy: bool = False) -> tuple[Rollout, list[str]]:
        with self._role(role):
            rollout = generate(self.model, prompts, tokenizer=self.tokenizer, num_samples=num_samples,
                               max_new_tokens=max_new_tokens, temperature=self.generation.temperature,
                               seed=self._seed(role, stream), greedy=greedy)
        return rollout, rollout.decode_responses(self.tokenizer)

    def _total_steps(self) -> int:
        trainer = attached_trainer(self)
        if trainer is None:
            return 1
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        return max(1, int(trainer.estimated_stepping_batches))

    def _think_tokens(self, text: str) -> int:
        return len(self.tokenizer(think_text(text), add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------------------ the roles
    def _propose(self, batch: list[CodeTask], stream: str = "") -> tuple[Rollout, list[str], list[_Task | None], list[_Task]]:
        """Proposer rollouts, the valid proposals (``None`` where invalid) and the bank fallback tasks."""
        sandbox = self.sandbox
        assert sandbox is not None
        examples = sandbox.run_many([(call_program(t.program, t.inputs[0]), "") for t in batch])
        prompts = [_propose_prompt(t, v.stdout.strip(), self._style) for t, v in zip(batch, examples)]
        rollout, texts = self._generate("propose", prompts, 1, self.generation.max_new_tokens.propose, stream=stream)
        rng = random.Random(self._seed("solve", stream))
        kinds = ["function" if rng.random() < self.roles.function_task_ratio else "output" for _ in batch]

        parsed = [parse_proposal(text) for text in texts]
        jobs, owners = [], []
        for i, item in enumerate(parsed):
            if item is not None:
                jobs += [(call_program(item[0], argument), "") for argument in item[1]]
                owners += [i] * len(item[1])
        outputs: dict[int, list[str]] = {i: [] for i, item in enumerate(parsed) if item is not None}
        for i, verdict in zip(owners, sandbox.run_many(jobs)):
            out = verdict.stdout.strip()
            # Valid: every input runs and prints one short line (a task a solver can be asked about).
            if i in outputs and verdict.ok and out and len(out) <= self.sandbox_settings.max_output_chars and "\n" not in out:
                outputs[i].append(out)
            else:
                outputs.pop(i, None)

        proposals: list[_Task | None] = []
        for i, item in enumerate(parsed):
            if i not in outputs:
                proposals.append(None)
                continue
            kind = kinds[i] if len(item[1]) >= 2 else "output"  # induction needs several pairs
            proposals.append(_Task(item[0], list(item[1]), outputs[i], kind, "proposer", proposal=i))

        # Fallback tasks from the bank, outputs by execution as well (cache hits after the first step).
        fallback_jobs = [(batch_call_program(t.program, t.inputs), "") for t in batch]
        fallback: list[_Task] = []
        for t, kind, verdict in zip(batch, kinds, sandbox.run_many(fallback_jobs)):
            outs = _split_list_repr(verdict.stdout.strip(), len(t.inputs)) if verdict.ok else None
            if outs is None:  # a broken bank task should never happen; make it loud rather than train on it
                raise RuntimeError(f"task bank entry {t.name!r} failed in the sandbox: {verdict.status} {verdict.detail}")
            fallback.append(_Task(t.program, list(t.inputs), outs, kind, "bank"))
        return rollout, texts, proposals, fallback

    def _check_answers(self, tasks: list[_Task]) -> None:
        """Fill ``task.correct`` by execution (batched through the sandbox pool)."""
        sandbox = self.sandbox
        assert sandbox is not None
        jobs, where = [], []
        for ti, task in enumerate(tasks):
            task.correct = [False] * len(task.answers)
            for ai, answer in enumerate(task.answers):
                if task.kind == "output":
                    prediction = parse_answer(answer)
                    if not prediction:
                        continue
                    if prediction == task.outputs[0]:  # the very text the executed program printed
                        task.correct[ai] = True
                        continue
                    jobs.append((_CANONICAL, prediction, task.outputs[0]))
                else:
                    program = parse_program(answer)
                    if program is None:
                        continue
                    jobs.append((batch_call_program(program, task.inputs), "", "[" + ", ".join(task.outputs) + "]"))
                where.append((ti, ai))
        for (ti, ai), verdict in zip(where, sandbox.run_many(jobs)):
            tasks[ti].correct[ai] = verdict.ok

    # ---------------------------------------------------------------------------------- loss
    def _role_backward(self, role: str, rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
        """TR-RPG loss of one role, backpropagated micro-batch by micro-batch (its adapter active); returns its value."""
        with self._role(role):
            return self._role_backward_active(role, rollout, rewards)

    def _role_backward_active(self, role: str, rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
        from lit_memopt.ops import linear_policy_loss

        gen = self.generation
        ids, attn, resp = rollout.input_ids, rollout.attention_mask, rollout.response_mask
        counted = resp.clone()
        counted[:, 0] = False
        total = int(counted.sum())
        role_weight = self.roles.of(role).weight
        if total == 0 or role_weight == 0:  # nothing to learn: skip the reference pass too
            return torch.zeros((), device=ids.device)
        mb = gen.micro_batch_size
        ref = reference_logprobs(self.model, ids, attn, resp, reference_model=self.reference,
                                 temperature=gen.temperature, micro_batch_size=mb, chunk_size=gen.chunk_size)
        advantages = self.normalizers[role].normalize(rewards.to(ids.device, torch.float32))
        weight = lm_head_weight(self.model)
        value = torch.zeros((), device=ids.device)
        beta, clamp = self.roles.of(role).beta, self.roles.clamp

        def micro_batch_loss(part: dict[str, torch.Tensor], share: float) -> torch.Tensor:
            hidden, targets, positions = response_hidden_states(self.model, part["input_ids"], part["attention_mask"],
                                                                part["response_mask"])
            # TR-RPG's mean over the response tokens, on their gathered rows (each carrying its sequence's reward),
            # its head gradients made in the forward pass: three head products per tile instead of the four of
            # log-probs then tr_rpg_loss (a frozen head, as under LoRA: two, as the frozen log-probs already made).
            rewards_of_rows = part["advantages"][:, None].expand_as(positions)[positions]
            return linear_policy_loss(hidden, weight, targets, part["ref"][positions], rewards_of_rows,
                                      objective="tr_rpg", beta=beta, clamp=clamp, temperature=gen.temperature,
                                      chunk_size=gen.chunk_size) * share

        for start in range(0, ids.shape[0], mb):
            rows = slice(start, start + mb)
            share = role_weight * int(counted[rows].sum()) / total
            if share == 0:
                continue
            part = {"input_ids": ids[rows], "attention_mask": attn[rows], "response_mask": resp[rows],
                    "ref": ref[rows], "advantages": advantages[rows]}
            # With an OOMRecovery callback this micro-batch is split further (and retried) on an OOM;
            # without one it is one forward + manual_backward.
            # The loss is a token mean: an OOM split weights its pieces by their response tokens.
            loss = OOMRecovery.run_micro_batches(self, part, functools.partial(micro_batch_loss, share=share),
                                                 sample_weights=counted[rows].sum(dim=-1))
            if loss is not None:
                value = value + loss
        return value

    # ---------------------------------------------------------------------------------- step
    def training_step(self, batch: dict[str, Any] | list[CodeTask], batch_idx: int) -> torch.Tensor:
        """Propose, solve, critique (each role's rollouts and rewards), then one update from the three role losses."""
        seeds = _tasks_of(batch)
        self._running_sandbox().reset_stats()
        alpha_s, alpha_c = self.alpha.at_step(self.global_step, self._total_steps())
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)

        propose, proposals, tasks = self._propose_step(seeds)
        solve = self._solve_step(tasks, alpha_s)
        propose.rewards = [proposer_reward(sum(t.correct), self.roles.num_solver_samples) if p is not None else 0.0
                           for p, t in zip(proposals, tasks)]  # rewarded by how hard the solver found it
        critique = self._critique_step(tasks, alpha_c)
        played = {"propose": propose, "solve": solve, "critique": critique}
        losses = self._update(optimizer, played)
        self._log_step(seeds, tasks, proposals, played, losses, alpha_s, alpha_c)
        return sum(losses.values())

    def _running_sandbox(self) -> Sandbox:
        assert self.sandbox is not None, "the sandbox starts in setup()"
        return self.sandbox

    def _propose_step(self, seeds: list[CodeTask]) -> tuple[_Played, list[_Task | None], list[_Task]]:
        """The proposer's rollouts (rewarded after the solve step), its valid proposals and the step's tasks: each
        valid proposal, or its seed task from the bank where the proposal is invalid."""
        rollout, _, proposals, fallback = self._propose(seeds)
        tasks = [p if p is not None else f for p, f in zip(proposals, fallback)]
        return _Played(rollout, []), proposals, tasks

    def _solve_step(self, tasks: list[_Task], alpha_s: float) -> _Played:
        """``roles.num_solver_samples`` answers per task, checked by execution; rewards correctness and length."""
        n, reward = self.roles.num_solver_samples, self.reward
        rollout, texts = self._generate("solve", [_solve_prompt(t, self._style) for t in tasks], n,
                                        self.generation.max_new_tokens.solve)
        for i, task in enumerate(tasks):
            task.answers = texts[i * n:(i + 1) * n]
        self._check_answers(tasks)
        played = _Played(rollout, [], {"lengths": []})
        for task in tasks:
            for answer, correct in zip(task.answers, task.correct):
                length = length_reward(self._think_tokens(answer), reward.length_max_tokens,
                                       penalty_threshold=reward.length_penalty_threshold,
                                       penalty_scale=reward.length_penalty_scale)
                played.stats["lengths"].append(length)
                played.rewards.append(solver_reward(float(correct), length, alpha_s))
        return played

    def _critique_step(self, tasks: list[_Task], alpha_c: float) -> _Played:
        """``roles.critiques_per_task`` answers per task judged; rewards agreement with execution and creativity."""
        c_prompts, c_truth, c_group = [], [], []
        for ti, task in enumerate(tasks):
            for ai in range(self.roles.critiques_per_task):
                shown = parse_answer(task.answers[ai]) if task.kind == "output" else (parse_program(task.answers[ai]) or
                                                                                     task.answers[ai].strip())
                c_prompts.append(_critique_prompt(task, shown, self._style))
                c_truth.append(task.correct[ai])
                c_group.append(ti)
        rollout, texts = self._generate("critique", c_prompts, 1, self.generation.max_new_tokens.critique)
        played = _Played(rollout, [], {"agreements": [], "creativities": []})
        for i, text in enumerate(texts):
            siblings = [texts[j] for j in range(len(texts)) if c_group[j] == c_group[i] and j != i]
            judged = parse_judgement(text)
            agrees = float(judged is not None and judged == c_truth[i])
            creativity = creativity_score(text, siblings)
            played.stats["agreements"].append(agrees)
            played.stats["creativities"].append(creativity)
            played.rewards.append(critique_reward(agrees, creativity, alpha_c))
        return played

    def _update(self, optimizer: Any, played: dict[str, _Played]) -> dict[str, torch.Tensor]:
        """The role losses, role after role (each backpropagated in micro-batches), then one clipped optimizer step."""
        losses = {role: self._role_backward(role, played[role].rollout, torch.tensor(played[role].rewards,
                                                                                      dtype=torch.float32))
                  for role in ROLES}
        if self.optim.gradient_clip_val is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.optim.gradient_clip_val, gradient_clip_algorithm="norm")
        optimizer.step()
        return losses

    def _log_step(self, seeds: list[CodeTask], tasks: list[_Task], proposals: list[_Task | None],
                  played: dict[str, _Played], losses: dict[str, torch.Tensor], alpha_s: float, alpha_c: float) -> None:
        bs, device, sandbox = len(seeds), self.device, self._running_sandbox()

        def mean(values: list[float] | list[bool]) -> torch.Tensor:
            return torch.tensor(sum(values) / max(1, len(values)), device=device)

        self.log("train/loss", sum(losses.values()), prog_bar=True, batch_size=bs)
        for role in ROLES:
            self.log(f"train/loss_{role}", losses[role], batch_size=bs)
            self.log(f"train/reward_{role}", torch.tensor(played[role].rewards, dtype=torch.float32).mean().to(device),
                     prog_bar=role == "solve", batch_size=bs)
        self.log("train/solve_rate", mean([c for t in tasks for c in t.correct]), prog_bar=True, batch_size=bs)
        self.log("train/proposal_valid_rate", torch.tensor(sum(p is not None for p in proposals) / bs, device=device),
                 batch_size=bs)
        self.log("train/critique_agreement", mean(played["critique"].stats["agreements"]), batch_size=bs)
        self.log("train/solve_length_reward", mean(played["solve"].stats["lengths"]), batch_size=bs)
        self.log("train/critique_creativity", mean(played["critique"].stats["creativities"]), batch_size=bs)
        self.log("train/alpha_s", torch.tensor(alpha_s, device=device), batch_size=bs)
        self.log("train/alpha_c", torch.tensor(alpha_c, device=device), batch_size=bs)
        for name, count in sandbox.verdict_counts.items():
            self.log(f"train/sandbox_{name}", torch.tensor(float(count), device=device), batch_size=bs)
        self.log("train/sandbox_cache_hit_rate", torch.tensor(sandbox.cache_hit_rate, device=device), batch_size=bs)

    def validation_step(self, batch: dict[str, Any] | list[CodeTask], batch_idx: int) -> None:
        """Held-out solve rate (output prediction, ``validation.solver_samples`` answers per task) and proposal validity."""
        batch = _tasks_of(batch)
        sandbox = self.sandbox
        assert sandbox is not None
        n = self.validation.solver_samples
        verdicts = sandbox.run_many([(batch_call_program(t.program, t.inputs), "") for t in batch])
        tasks = [_Task(t.program, list(t.inputs), _split_list_repr(v.stdout.strip(), len(t.inputs)) or [""], "output", "bank")
                 for t, v in zip(batch, verdicts)]
        self.val_solve_rate.update(self._held_out_solve_rates(tasks, n, stream=f"val/{batch_idx}"))
        if self.validation.greedy:
            self.val_solve_rate_greedy.update(self._held_out_solve_rates(tasks, 1, stream=f"val/{batch_idx}", greedy=True))
        _, _, proposals, _ = self._propose(batch, stream=f"val/{batch_idx}")
        valid = sum(p is not None for p in proposals) / len(batch)
        self.log("val/proposal_valid_rate", torch.tensor(valid, device=self.device), batch_size=len(batch),
                 sync_dist=True)

    def _held_out_solve_rates(self, tasks: list[_Task], n: int, stream: str, greedy: bool = False) -> torch.Tensor:
        """Each task's share of right answers among ``n`` sampled ones (or its one greedy answer); sets their answers."""
        _, texts = self._generate("solve", [_solve_prompt(t, self._style) for t in tasks], n,
                                  self.generation.max_new_tokens.solve, stream=stream, greedy=greedy)
        for i, task in enumerate(tasks):
            task.answers = texts[i * n:(i + 1) * n]
        self._check_answers(tasks)
        return torch.tensor([sum(t.correct) / n for t in tasks], device=self.device)

    def on_validation_epoch_end(self) -> None:
        """``val/solve_rate`` over every rank's held-out tasks, with its standard error over tasks."""
        self.val_solve_rate.log_and_reset(self, "val/solve_rate")
        self.val_solve_rate_greedy.log_and_reset(self, "val/solve_rate_greedy")

    # ------------------------------------------------------------------------------ warm start
    def warm_start_examples(self, count: int, seed: int) -> list[tuple[str, str]]:
        """``count`` warm-start pairs (:func:`warm_start_pairs`) on fresh tasks of the datamodule's ``warm_start_tasks``.

        Raises:
            ValueError: the datamodule offers no ``warm_start_tasks`` (e.g. not ``CodeTaskDataModule``).
        """
        source = getattr(self.trainer.datamodule, "warm_start_tasks", None) if attached_trainer(self) is not None else None
        if source is None:
            raise ValueError("a CRSP warm start needs CodeTaskDataModule(family='grammar') (data=code_tasks "
                             "data.family=grammar); or set module.warm_start.steps=0.")
        return warm_start_pairs(source(2 * count, seed), random.Random(seed), float(self.roles.function_task_ratio),
                                self._style, getattr(self.trainer.datamodule, "warm_start_guess_rate", 0.0))


def _tasks_of(batch: dict[str, Any] | list[CodeTask]) -> list[CodeTask]:
    """The tasks of a :class:`~lit_memopt.data.code_tasks.CodeTaskDataModule` batch (or a plain list of them)."""
    tasks = batch["tasks"] if isinstance(batch, dict) else batch
    if not tasks or not all(isinstance(t, CodeTask) for t in tasks):
        raise TypeError(f"CRSPModule expects batches of CodeTask (CodeTaskDataModule); got {type(batch).__name__}.")
    return list(tasks)


@dataclasses.dataclass
class _Played:
    """One role's rollouts in a training step, the reward of each, and what the logs average over them."""

    rollout: Rollout
    rewards: list[float]
    stats: dict[str, list[float]] = dataclasses.field(default_factory=dict)
