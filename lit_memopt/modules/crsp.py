"""CRSP (Cognition via Rewarded Self-Play): one policy proposes, solves and critiques code I/O tasks,
trained per role with the TR-RPG loss on rewards decided by executing code in the sandbox."""

from __future__ import annotations

import contextlib

import copy
import functools
import random
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_memopt._compat.lightning import attached_trainer
from lit_memopt.callbacks.oom_recovery import OOMRecovery
from lit_memopt.data.code_tasks import CodeTask, batch_call_program, call_program
from lit_memopt.models import lm_head_weight
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
    scatter_response,
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
    2. **solve**: ``num_solver_samples`` answers per task. Task kind ``output``: predict
       ``f(input)``; kind ``function`` (share ``function_task_ratio``): write ``f`` from
       input/output pairs. Correctness is decided by execution (the prediction is canonicalised
       with ``ast.literal_eval`` in the sandbox; a written ``f`` is run on every input).
    3. **critique**: ``critiques_per_task`` solver answers per task are judged; the critique earns
       agreement with the executed verdict plus a lexical creativity score.

    Rewards (see :mod:`lit_memopt.rewards.crsp_rewards`): solver ``alpha_s * correct + (1 - alpha_s)
    * length`` (log-length of the ``<think>`` span with an exponential penalty past a threshold);
    critique ``alpha_c * agreement + (1 - alpha_c) * creativity``; proposer ``1 - solve_rate`` when
    ``0 < solve_rate < 1``, else 0. ``(alpha_s, alpha_c)`` follow :class:`AlphaSchedule` over
    ``global_step / max_steps``. Each role's rewards are standardised by its own running mean/std.

    Loss: ``tr_rpg_loss(logp, logp_ref, reward, beta_role, mask=response tokens)`` per role, where
    ``logp_ref`` comes from the reference policy, so the ``beta`` term regularises towards it (data
    are on-policy: one update per rollout). The step's loss is the sum of the three role losses, each
    times its ``weight_<role>``.

    Memory: log-probs come from decoder hidden states through ``linear_logprobs`` (no ``[B, T, V]``
    logits), reference log-probs without grad in micro-batches. With LoRA (``model.lora``) the
    reference is the base model under ``disable_adapter()``, sharing every weight; without LoRA it
    is a frozen copy of the initial policy (one more copy of the weights, announced at setup).
    Roles are processed one after another and each in micro-batches of ``micro_batch_size``
    sequences with a backward pass per micro-batch, so the autograd graph alive at any time is
    that of one micro-batch of one role. This needs **manual optimization** (Lightning's automatic
    optimization takes one loss per step): set ``trainer.gradient_clip_val=null`` and use this
    module's ``gradient_clip_val``. Micro-batch losses are weighted by their share of the role's
    response tokens, so the gradient equals that of the whole role batch. Each micro-batch goes
    through ``OOMRecovery.run_micro_batches`` (the callback's manual-optimization helper): with an
    ``OOMRecovery`` callback an out-of-memory micro-batch is split further and retried (its parts
    weighted as that callback's ``loss_weighting`` says); without one it is a plain backward.

    With ``role_adapters=True`` (needs LoRA) each role gets its own LoRA adapter (peft multi-adapter,
    same base weights); the reference is still the adapter-free base.

    Args:
        model_config: what to build (``lit_memopt.models.ModelConfig``).
        tokenizer: encodes prompts, decodes responses, counts ``<think>`` tokens.
        lr, weight_decay, betas: AdamW settings.
        beta_propose, beta_solve, beta_critique: TR-RPG regularisation per role.
        weight_propose, weight_solve, weight_critique: each role's weight in the step's loss (>= 0; 0 stops
            that role learning, its rollouts still run): with one optimizer for the shared policy, a lower
            weight slows a role relative to the others; with ``role_adapters`` it scales the learning rate of
            that role's adapter (AdamW would ignore a constant scale of the only loss an adapter gets).
        clamp: TR-RPG bound on ``|log(pi / pi_ref)|``.
        num_solver_samples: answers per task (the ``n`` of the solve rate), >= 1.
        critiques_per_task: solver answers critiqued per task, in ``[1, num_solver_samples]``.
        function_task_ratio: share of tasks of kind ``function`` (the rest predict outputs).
        max_new_tokens_propose, max_new_tokens_solve, max_new_tokens_critique: response caps.
        temperature: sampling temperature (the log-probs use the same).
        micro_batch_size: sequences per forward/backward (and per reference pass).
        length_max_tokens: ``L`` of the length reward.
        length_penalty_threshold, length_penalty_scale: the length penalty (``None``: ``L`` and ``L / 2``).
        alpha_breakpoints: ``[(progress, alpha_s, alpha_c), ...]`` (``None``: the CRSP defaults).
        normalizer_eps: added to each role's running reward std.
        sandbox_wall_time_s, sandbox_cpu_time_s, sandbox_memory_mb, sandbox_workers: sandbox limits.
        sandbox_require: isolation features training must not start without (``Sandbox(require=...)``).
        max_output_chars: executed outputs longer than this make a proposal invalid.
        gradient_clip_val: global-norm clip applied in the manual step (``None``: off).
        role_adapters: one LoRA adapter per role.
        chunk_size: fused-head tile (``None``: automatic).
        seed: base seed of sampling and task-kind draws.
        warm_start: a supervised warm start of all three roles on the datamodule's grammar tasks
            (``CodeTaskDataModule(family="grammar")``) before RL; see :meth:`warm_start_examples`
            (:class:`~lit_memopt.modules.warm_start.WarmStart` or its fields; ``None``: off).
        val_solver_samples: answers sampled per held-out task in validation (``val/solve_rate`` is
            their mean: pass@1 at the sampling temperature; ``val/solve_rate_stderr`` its standard error
            over tasks).
        val_greedy: also solve each held-out task by greedy decoding (``val/solve_rate_greedy``): how far
            sharpening the sampled answers towards the policy's mode could take ``val/solve_rate``.
        prompt_style: ``"instruct"`` (each role prompt says what to write, code in fenced blocks: for real
            checkpoints) or ``"compact"`` (a role tag and the bare program, a third of the bytes: for a tiny
            model that learns the protocol in its warm start).

    Raises:
        ValueError: any argument outside its accepted range (named in the message), or
            ``role_adapters`` without ``model.lora``.

    Example::

        module = CRSPModule(ModelConfig(arch={...}, lora={"r": 8}), tokenizer, num_solver_samples=4)
        pl.Trainer(max_steps=20, gradient_clip_val=None).fit(module, datamodule=CodeTaskDataModule(tokenizer))
    """

    # Responses are sampled until end-of-sequence: `lit-memopt estimate` sizes the worst case (all at max_new_tokens).
    generates_until_eos = True

    summary_keys = ("train/reward_propose", "train/reward_solve", "train/reward_critique", "train/solve_rate",
                    "train/proposal_valid_rate", "train/sandbox_cache_hit_rate", "val/solve_rate",
                    "val/solve_rate_stderr", "val/solve_rate_greedy", "val/solve_rate_greedy_stderr",
                    "val/proposal_valid_rate")

    def __init__(
        self,
        model_config: Any,
        tokenizer: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.99),
        beta_propose: float = 0.01,
        beta_solve: float = 0.05,
        beta_critique: float = 0.1,
        weight_propose: float = 1.0,
        weight_solve: float = 1.0,
        weight_critique: float = 1.0,
        clamp: float = 2.3,
        num_solver_samples: int = 4,
        critiques_per_task: int = 2,
        function_task_ratio: float = 0.5,
        max_new_tokens_propose: int = 96,
        max_new_tokens_solve: int = 32,
        max_new_tokens_critique: int = 24,
        temperature: float = 1.0,
        micro_batch_size: int = 8,
        length_max_tokens: int = 64,
        length_penalty_threshold: int | None = None,
        length_penalty_scale: float | None = None,
        alpha_breakpoints: Sequence[Sequence[float]] | None = None,
        normalizer_eps: float = 1e-6,
        sandbox_wall_time_s: float = 3.0,
        sandbox_cpu_time_s: float = 2.0,
        sandbox_memory_mb: int = 512,
        sandbox_workers: int = 4,
        sandbox_require: Sequence[str] | str = (),
        max_output_chars: int = 200,
        gradient_clip_val: float | None = 1.0,
        role_adapters: bool = False,
        chunk_size: int | None = None,
        seed: int = 0,
        warm_start: dict[str, Any] | WarmStart | None = None,
        val_solver_samples: int = 1,
        val_greedy: bool = False,
        prompt_style: str = "instruct",
    ) -> None:
        super().__init__()
        self.warm_start = WarmStart.from_any(warm_start)
        _check(int(val_solver_samples) >= 1, "val_solver_samples", val_solver_samples, "an integer >= 1")
        _check(prompt_style in PROMPT_STYLES, "prompt_style", prompt_style, f"one of {list(PROMPT_STYLES)}")
        for name, value in (("beta_propose", beta_propose), ("beta_solve", beta_solve), ("beta_critique", beta_critique),
                            ("weight_propose", weight_propose), ("weight_solve", weight_solve),
                            ("weight_critique", weight_critique)):
            _check(value >= 0, name, value, ">= 0")
        _check(lr > 0, "lr", lr, "> 0")
        _check(clamp > 0, "clamp", clamp, "> 0")
        _check(int(num_solver_samples) >= 1, "num_solver_samples", num_solver_samples, "an integer >= 1")
        _check(1 <= int(critiques_per_task) <= int(num_solver_samples), "critiques_per_task", critiques_per_task,
               f"in [1, num_solver_samples={num_solver_samples}]")
        _check(0.0 <= function_task_ratio <= 1.0, "function_task_ratio", function_task_ratio, "in [0, 1]")
        for name, value in (("max_new_tokens_propose", max_new_tokens_propose), ("max_new_tokens_solve", max_new_tokens_solve),
                            ("max_new_tokens_critique", max_new_tokens_critique), ("micro_batch_size", micro_batch_size),
                            ("max_output_chars", max_output_chars)):
            _check(int(value) >= 1, name, value, "an integer >= 1")
        _check(temperature > 0, "temperature", temperature, "> 0")
        _check(int(length_max_tokens) > 1, "length_max_tokens", length_max_tokens, "an integer > 1")
        _check(gradient_clip_val is None or gradient_clip_val > 0, "gradient_clip_val", gradient_clip_val, "> 0 or null")
        if role_adapters and getattr(model_config, "lora", None) is None:
            raise ValueError("module.role_adapters=true needs LoRA adapters: set model.lora (e.g. {r: 8}).")
        self.save_hyperparameters(ignore=["model_config", "tokenizer", "warm_start"])
        self.automatic_optimization = False
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model = model_config.build_model()
        if role_adapters:
            add_named_adapters(self.model, ROLES, active="solve")
        self.reference: torch.nn.Module | None = None
        if not is_peft_model(self.model):
            self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.alpha = AlphaSchedule(alpha_breakpoints)
        self.normalizers = torch.nn.ModuleDict({role: RunningNormalizer(eps=normalizer_eps) for role in ROLES})
        self.betas_by_role = {"propose": float(beta_propose), "solve": float(beta_solve), "critique": float(beta_critique)}
        self.weights_by_role = {"propose": float(weight_propose), "solve": float(weight_solve),
                                "critique": float(weight_critique)}
        self.sandbox: Sandbox | None = None
        self.val_solve_rate = MeanAndStderr()  # over held-out tasks, whose sampled answers are not independent
        self.val_solve_rate_greedy = MeanAndStderr()

    # ------------------------------------------------------------------------------ set-up
    def setup(self, stage: str) -> None:
        if self.sandbox is None:
            hp = self.hparams
            self.sandbox = Sandbox(SandboxLimits(wall_time_s=hp.sandbox_wall_time_s, cpu_time_s=hp.sandbox_cpu_time_s,
                                                 memory_mb=hp.sandbox_memory_mb), max_workers=int(hp.sandbox_workers),
                                   require=hp.get("sandbox_require", ()))
        # Before sharding and before a validation that precedes fit: the first held-out numbers are the warm start's.
        warm_start_in_setup(self, self.model, self.warm_start, reference=self.reference, examples=self.warm_start_examples)
        if stage == "fit":
            clip = getattr(self.trainer, "gradient_clip_val", None) if attached_trainer(self) is not None else None
            if clip is not None:
                raise ValueError(f"CRSPModule uses manual optimization (one backward per micro-batch per role), which "
                                 f"Lightning cannot clip for you: set trainer.gradient_clip_val=null (got {clip}) and "
                                 f"use module.gradient_clip_val instead.")
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
        hp = self.hparams
        if hp.role_adapters:
            # One group per role's adapter (peft marks only the active adapter trainable at any moment, so select by
            # name). Each adapter gets the gradient of its own role's loss only, and AdamW ignores a constant scale
            # of that loss: here a role's weight scales its learning rate instead, so it still slows that role.
            params = [{"params": adapter_parameters(self.model, role), "lr": hp.lr * self.weights_by_role[role]}
                      for role in ROLES]
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # A batch is text (CodeTask) plus an index tensor; prompts become tensors on the right device later.
        return batch

    # ------------------------------------------------------------------------------- helpers
    def _role(self, role: str) -> contextlib.AbstractContextManager:
        """The role's LoRA adapter active inside the block (the previous one restored after it)."""
        return active_adapter(self.model, role if self.hparams.role_adapters else None)

    @property
    def _style(self) -> str:
        return self.hparams.get("prompt_style", "instruct")  # checkpoints saved before the option: instruct

    def _seed(self, role: str, stream: str = "") -> int:
        # distinct per rank, step, role (and validation batch); the same on a resumed or retried step
        return derive_seed(self.hparams.seed, rank=self.global_rank, step=self.global_step,
                           stream=f"crsp/{stream}/{role}" if stream else f"crsp/{role}")

    def _generate(self, role: str, prompts: list[str], num_samples: int, max_new_tokens: int,
                  stream: str = "", greedy: bool = False) -> tuple[Rollout, list[str]]:
        with self._role(role):
            rollout = generate(self.model, prompts, tokenizer=self.tokenizer, num_samples=num_samples,
                               max_new_tokens=max_new_tokens, temperature=self.hparams.temperature,
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
        rollout, texts = self._generate("propose", prompts, 1, int(self.hparams.max_new_tokens_propose),
                                            stream=stream)
        rng = random.Random(self._seed("solve", stream))
        kinds = ["function" if rng.random() < self.hparams.function_task_ratio else "output" for _ in batch]

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
            if i in outputs and verdict.ok and out and len(out) <= int(self.hparams.max_output_chars) and "\n" not in out:
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
        from lit_memopt.ops import linear_logprobs, tr_rpg_loss

        hp = self.hparams
        ids, attn, resp = rollout.input_ids, rollout.attention_mask, rollout.response_mask
        counted = resp.clone()
        counted[:, 0] = False
        total = int(counted.sum())
        role_weight = self.weights_by_role[role]
        if total == 0 or role_weight == 0:  # nothing to learn: skip the reference pass too
            return torch.zeros((), device=ids.device)
        mb = int(hp.micro_batch_size)
        ref = reference_logprobs(self.model, ids, attn, resp, reference_model=self.reference,
                                 temperature=hp.temperature, micro_batch_size=mb, chunk_size=hp.chunk_size)
        advantages = self.normalizers[role].normalize(rewards.to(ids.device, torch.float32))
        weight = lm_head_weight(self.model)
        value = torch.zeros((), device=ids.device)
        beta = self.betas_by_role[role]

        def micro_batch_loss(part: dict[str, torch.Tensor], share: float) -> torch.Tensor:
            hidden, targets, positions = response_hidden_states(self.model, part["input_ids"], part["attention_mask"],
                                                                part["response_mask"])
            logp = scatter_response(linear_logprobs(hidden, weight, targets, temperature=hp.temperature,
                                                    chunk_size=hp.chunk_size), positions)
            return tr_rpg_loss(logp, part["ref"], part["advantages"], beta, mask=positions, clamp=hp.clamp) * share

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
        batch = _tasks_of(batch)
        hp = self.hparams
        optimizer = self.optimizers()
        sandbox = self.sandbox
        assert sandbox is not None
        sandbox.reset_stats()
        alpha_s, alpha_c = self.alpha.at_step(self.global_step, self._total_steps())
        optimizer.zero_grad(set_to_none=True)
        device = self.device

        # 1. propose (+ execution of the proposals)
        p_rollout, _, proposals, fallback = self._propose(batch)
        tasks = [p if p is not None else f for p, f in zip(proposals, fallback)]

        # 2. solve
        n = int(hp.num_solver_samples)
        s_rollout, s_texts = self._generate("solve", [_solve_prompt(t, self._style) for t in tasks], n,
                                            int(hp.max_new_tokens_solve))
        for i, task in enumerate(tasks):
            task.answers = s_texts[i * n:(i + 1) * n]
        self._check_answers(tasks)
        solve_rewards, lengths = [], []
        for task in tasks:
            for answer, correct in zip(task.answers, task.correct):
                length = length_reward(self._think_tokens(answer), int(hp.length_max_tokens),
                                       penalty_threshold=hp.length_penalty_threshold, penalty_scale=hp.length_penalty_scale)
                lengths.append(length)
                solve_rewards.append(solver_reward(float(correct), length, alpha_s))
        propose_rewards = [proposer_reward(sum(t.correct), n) if p is not None else 0.0 for p, t in zip(proposals, tasks)]

        # 3. critique
        k = int(hp.critiques_per_task)
        c_prompts, c_truth, c_group = [], [], []
        for ti, task in enumerate(tasks):
            for ai in range(k):
                shown = parse_answer(task.answers[ai]) if task.kind == "output" else (parse_program(task.answers[ai]) or
                                                                                     task.answers[ai].strip())
                c_prompts.append(_critique_prompt(task, shown, self._style))
                c_truth.append(task.correct[ai])
                c_group.append(ti)
        c_rollout, c_texts = self._generate("critique", c_prompts, 1, int(hp.max_new_tokens_critique))
        critique_rewards, agreements, creativities = [], [], []
        for i, text in enumerate(c_texts):
            siblings = [c_texts[j] for j in range(len(c_texts)) if c_group[j] == c_group[i] and j != i]
            judged = parse_judgement(text)
            agrees = float(judged is not None and judged == c_truth[i])
            agreements.append(agrees)
            creativities.append(creativity_score(text, siblings))
            critique_rewards.append(critique_reward(agrees, creativities[-1], alpha_c))

        # 4. losses, role after role (each backpropagated in micro-batches), one optimizer step
        rewards = {
            "propose": torch.tensor(propose_rewards, dtype=torch.float32),
            "solve": torch.tensor(solve_rewards, dtype=torch.float32),
            "critique": torch.tensor(critique_rewards, dtype=torch.float32),
        }
        rollouts = {"propose": p_rollout, "solve": s_rollout, "critique": c_rollout}
        losses = {role: self._role_backward(role, rollouts[role], rewards[role]) for role in ROLES}
        if hp.gradient_clip_val is not None:
            self.clip_gradients(optimizer, gradient_clip_val=hp.gradient_clip_val, gradient_clip_algorithm="norm")
        optimizer.step()

        # 5. logs
        bs = len(batch)
        total_loss = sum(losses.values())
        solved = [c for t in tasks for c in t.correct]
        self.log("train/loss", total_loss, prog_bar=True, batch_size=bs)
        for role in ROLES:
            self.log(f"train/loss_{role}", losses[role], batch_size=bs)
            self.log(f"train/reward_{role}", rewards[role].mean().to(device), prog_bar=role == "solve", batch_size=bs)
        self.log("train/solve_rate", torch.tensor(sum(solved) / max(1, len(solved)), device=device), prog_bar=True,
                 batch_size=bs)
        self.log("train/proposal_valid_rate", torch.tensor(sum(p is not None for p in proposals) / bs, device=device),
                 batch_size=bs)
        self.log("train/critique_agreement", torch.tensor(sum(agreements) / max(1, len(agreements)), device=device),
                 batch_size=bs)
        self.log("train/solve_length_reward", torch.tensor(sum(lengths) / max(1, len(lengths)), device=device),
                 batch_size=bs)
        self.log("train/critique_creativity", torch.tensor(sum(creativities) / max(1, len(creativities)), device=device),
                 batch_size=bs)
        self.log("train/alpha_s", torch.tensor(alpha_s, device=device), batch_size=bs)
        self.log("train/alpha_c", torch.tensor(alpha_c, device=device), batch_size=bs)
        for name, count in sandbox.verdict_counts.items():
            self.log(f"train/sandbox_{name}", torch.tensor(float(count), device=device), batch_size=bs)
        self.log("train/sandbox_cache_hit_rate", torch.tensor(sandbox.cache_hit_rate, device=device), batch_size=bs)
        return total_loss

    def validation_step(self, batch: dict[str, Any] | list[CodeTask], batch_idx: int) -> None:
        """Held-out solve rate (output prediction, ``val_solver_samples`` answers per task) and proposal validity."""
        batch = _tasks_of(batch)
        sandbox = self.sandbox
        assert sandbox is not None
        n = int(self.hparams.get("val_solver_samples", 1))
        verdicts = sandbox.run_many([(batch_call_program(t.program, t.inputs), "") for t in batch])
        tasks = [_Task(t.program, list(t.inputs), _split_list_repr(v.stdout.strip(), len(t.inputs)) or [""], "output", "bank")
                 for t, v in zip(batch, verdicts)]
        self.val_solve_rate.update(self._held_out_solve_rates(tasks, n, stream=f"val/{batch_idx}"))
        if self.hparams.get("val_greedy", False):
            self.val_solve_rate_greedy.update(self._held_out_solve_rates(tasks, 1, stream=f"val/{batch_idx}", greedy=True))
        _, _, proposals, _ = self._propose(batch, stream=f"val/{batch_idx}")
        valid = sum(p is not None for p in proposals) / len(batch)
        self.log("val/proposal_valid_rate", torch.tensor(valid, device=self.device), batch_size=len(batch),
                 sync_dist=True)

    def _held_out_solve_rates(self, tasks: list[_Task], n: int, stream: str, greedy: bool = False) -> torch.Tensor:
        """Each task's share of right answers among ``n`` sampled ones (or its one greedy answer); sets their answers."""
        _, texts = self._generate("solve", [_solve_prompt(t, self._style) for t in tasks], n,
                                  int(self.hparams.max_new_tokens_solve), stream=stream, greedy=greedy)
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
        return warm_start_pairs(source(2 * count, seed), random.Random(seed), float(self.hparams.function_task_ratio),
                                self._style, getattr(self.trainer.datamodule, "warm_start_guess_rate", 0.0))


def _tasks_of(batch: dict[str, Any] | list[CodeTask]) -> list[CodeTask]:
    """The tasks of a :class:`~lit_memopt.data.code_tasks.CodeTaskDataModule` batch (or a plain list of them)."""
    tasks = batch["tasks"] if isinstance(batch, dict) else batch
    if not tasks or not all(isinstance(t, CodeTask) for t in tasks):
        raise TypeError(f"CRSPModule expects batches of CodeTask (CodeTaskDataModule); got {type(batch).__name__}.")
    return list(tasks)


def _check(ok: bool, name: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ValueError(f"module.{name} must be {accepted}, got {value!r}.")
