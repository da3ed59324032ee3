"""A short supervised warm start of a policy before its RL phase, on examples of the recipe's own task family.

RL methods improve a model that can already attempt the task: the papers start from pretrained checkpoints.
The embedded defaults build a random-init model of a few M parameters, so each RL recipe that needs it
first fits ``(prompt, answer)`` pairs drawn from the datamodule's synthetic task family (never its
validation prompts), then runs the method. The weights are cached next to the run (or at a path the user
gives) and reused when they exist, so a second run of the recipe skips the warm start.

A datamodule offers its examples through ``warm_start_examples(count, seed) -> list[(prompt, answer)]``;
the loss is the next-token negative log-likelihood of ``answer + eos`` after ``prompt`` (prompt tokens are
not scored), computed with the fused head (:func:`lit_memopt.modules.sft.next_token_nll`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_memopt._compat.lightning import attached_trainer
from lit_memopt.memory.forked import usable_cpu_cores
from lit_memopt.models.adapters import base_weights_trainable
from lit_memopt.models.tokens import left_pad
from lit_memopt.modules.sft import next_token_nll

__all__ = ["WarmStart", "ExampleSource", "fit_examples", "warm_start_policy", "copy_policy_into", "warm_start_in_setup",
           "cpu_threads_at_least", "local_cpu_share", "length_parts", "backward_by_length"]

ExampleSource = Callable[[int, int], list[tuple[str, str]]]
IGNORE = -100


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """How to warm-start a policy (``module.warm_start`` in the RL recipes).

    Attributes:
        steps: optimizer steps of the supervised phase; 0 turns the warm start off.
        lr: AdamW learning rate (linear warm-up over the first 10% of steps, then cosine to 10%).
        batch_size: examples per step.
        path: weights file to reuse when it exists and to write otherwise; ``None``: ``warm_start.pt`` in the
            run directory (a second run of the same recipe in the same directory reuses it).
        seed: seed of the example draw and the batch order.
        on_checkpoint: also warm-start when the model comes from a checkpoint (``model.pretrained``). Off by
            default: the warm starts exist for the random-init toy defaults, and a real checkpoint can already
            attempt the task (and a user's data may have no examples to fit).
    """

    steps: int = 0
    lr: float = 3e-3
    batch_size: int = 32
    path: str | None = None
    seed: int = 0
    on_checkpoint: bool = False

    def __post_init__(self) -> None:
        for name, ok, accepted in (
            ("steps", isinstance(self.steps, int) and self.steps >= 0, "an integer >= 0"),
            ("lr", isinstance(self.lr, (int, float)) and self.lr > 0, "> 0"),
            ("batch_size", isinstance(self.batch_size, int) and self.batch_size >= 1, "an integer >= 1"),
        ):
            if not ok:
                raise ValueError(f"module.warm_start.{name}={getattr(self, name)!r} is invalid: must be {accepted}.")

    @classmethod
    def from_any(cls, value: Any) -> "WarmStart":
        """A ``WarmStart`` from ``None`` (off), a mapping of its fields (Hydra config) or a ``WarmStart``."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"module.warm_start has unknown keys {sorted(unknown)}; "
                                 f"use {[f.name for f in dataclasses.fields(cls)]}.")
            return cls(**dict(value))
        raise ValueError(f"module.warm_start must be null or a mapping of {[f.name for f in dataclasses.fields(cls)]}, "
                         f"got {type(value).__name__}.")


def _rows(tokenizer: Any, pairs: list[tuple[str, str]]) -> tuple[list[list[int]], list[list[int]]]:
    """``prompt + answer + eos`` token rows and their labels (the answer and eos tokens only)."""
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    answers = tokenizer([a for _, a in pairs], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows = [list(p) + list(a) + eos for p, a in zip(prompts, answers)]
    label_rows = [[IGNORE] * len(p) + list(a) + eos for p, a in zip(prompts, answers)]
    return rows, label_rows


def _pad(rows: list[list[int]], label_rows: list[list[int]], tokenizer: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The rows left-padded into a batch."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids, attention_mask = left_pad(rows, pad_id, device=device)
    labels, _ = left_pad(label_rows, IGNORE, device=device)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _encode(tokenizer: Any, pairs: list[tuple[str, str]], device: torch.device) -> dict[str, torch.Tensor]:
    """``prompt + answer + eos`` rows, left-padded; labels are the answer and eos tokens only."""
    return _pad(*_rows(tokenizer, pairs), tokenizer, device)


# A forward/backward of the tiny CPU models costs about as much as this many padded tokens (measured on the
# 2-core development CPU: Intuitor's 32 rows of ~20 tokens take 130 ms in one part, 190 ms in four).
_PART_COST_TOKENS = 128


def length_parts(lengths: list[int], max_parts: int = 4) -> list[list[int]]:
    """Row indices grouped by length into the parts (at most ``max_parts``) that cost least to pad.

    Each part is padded to its own longest row; the cost of ``k`` parts is their padded tokens plus
    ``k * _PART_COST_TOKENS``. CRSP's proposer rows are twice as long as its solver rows (three parts), Intuitor's
    rows are all short (one part).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    # One part keeps the rows' own order: the batch is exactly the single padded batch of before.
    best: list[list[int]] = [list(range(len(lengths)))]
    best_cost = len(lengths) * max(lengths, default=0) + _PART_COST_TOKENS
    for k in range(2, min(max_parts, len(order)) + 1):
        parts = [order[j * len(order) // k:(j + 1) * len(order) // k] for j in range(k)]
        cost = sum(len(p) * lengths[p[-1]] for p in parts) + k * _PART_COST_TOKENS
        if cost < best_cost:
            best, best_cost = parts, cost
    return best


def local_cpu_share(processes_per_machine: int) -> int:
    """The CPU cores this process may use when ``processes_per_machine`` processes share the machine (>= 1)."""
    return max(1, usable_cpu_cores() // max(1, int(processes_per_machine)))


@contextlib.contextmanager
def cpu_threads_at_least(threads: int | None) -> Any:
    """Raise torch's intra-op thread count to ``threads`` inside the block (never lower it), then restore it.

    The RL recipes run their CPU steps on one thread (``threads=auto``: a few-M-parameter step is dominated by
    per-op overhead, and the sandbox workers want the other core), but the warm start's batches are large
    enough to use every core: on the 2-core development CPU, 2 threads take the CRSP warm-start step from
    2.6 to 1.5 s and Intuitor's from 185 to 110 ms.
    """
    before = torch.get_num_threads()
    if threads is None or threads <= before:
        yield
        return
    torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def backward_by_length(model: torch.nn.Module, tokenizer: Any, pairs: list[tuple[str, str]], device: torch.device) -> float:
    """Backpropagate the mean next-token NLL of the pairs' answers; returns it.

    Short rows go with short rows: each part (:func:`length_parts`) is padded to its own longest row, not the
    batch's. Each part's loss is weighted by its share of the batch's answer tokens, so the gradient is that of
    the single padded batch.
    """
    rows, label_rows = _rows(tokenizer, pairs)
    parts = length_parts([len(row) for row in rows])
    batches = [_pad([rows[i] for i in part], [label_rows[i] for i in part], tokenizer, device) for part in parts]
    total = sum(int((batch["labels"][:, 1:] != IGNORE).sum()) for batch in batches)
    loss = 0.0
    for batch in batches:
        mean, count = next_token_nll(model, batch)
        share = mean * (count / max(1, total))
        share.backward()
        loss += float(share.detach())
    return loss


def fit_examples(model: torch.nn.Module, tokenizer: Any, examples: ExampleSource, config: WarmStart,
                 device: torch.device | None = None) -> list[float]:
    """Train ``model`` in place on ``config.steps`` batches of fresh examples; returns the per-step losses."""
    from transformers import get_cosine_schedule_with_warmup

    device = device or next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, config.steps // 10), config.steps, num_cycles=0.45)
    # Fresh examples every step, drawn from a seed stream of their own: the family, never the validation set.
    rng = random.Random(config.seed)
    was_training = model.training
    model.train()
    losses = []
    for _ in range(config.steps):
        loss = backward_by_length(model, tokenizer, examples(config.batch_size, rng.randrange(2**31)), device)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    model.train(was_training)
    return losses


def warm_start_policy(model: torch.nn.Module, tokenizer: Any, examples: ExampleSource | None, config: WarmStart,
                      run_dir: str | Path | None, *, describe: str = "policy", cache: bool = True,
                      cpu_threads: int | None = None) -> str | None:
    """Warm-start ``model`` in place: load cached weights when they exist, else fit and cache them.

    Returns a one-line account of what happened (``None`` when ``config.steps == 0``). ``cache=False`` (several
    processes: every rank fits the same examples from the same seed, so the weights agree without a file
    race) neither reads nor writes the file. ``cpu_threads``: torch threads of the fit on a CPU (raised to it for
    the fit only, never lowered; ``None``: as they are).

    Raises:
        ValueError: the warm start is on but ``examples`` is ``None`` (the datamodule has no
            ``warm_start_examples``), or a cached file does not match the model.
    """
    if config.steps == 0:
        return None
    if examples is None:
        raise ValueError("module.warm_start.steps > 0 needs examples of the task: the datamodule has no "
                         "warm_start_examples(count, seed); set module.warm_start.steps=0 or use a datamodule with one.")
    path = Path(config.path) if config.path is not None else (Path(run_dir or ".") / "warm_start.pt")
    if cache and path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"the warm-start weights at {path} do not fit this model ({str(err).splitlines()[0]}); "
                             "delete the file, or point module.warm_start.path elsewhere.") from err
        message = f"warm start: loaded {path} (delete it to warm-start again)"
    else:
        on_cpu = next(model.parameters()).device.type == "cpu"
        # With LoRA the base weights are trained, adapters off: the reference is the base (models/adapters.py).
        with cpu_threads_at_least(cpu_threads if on_cpu else None), base_weights_trainable(model):
            losses = fit_examples(model, tokenizer, examples, config)
        head = sum(losses[:10]) / min(10, len(losses))
        tail = sum(losses[-10:]) / min(10, len(losses))
        message = f"warm start: {config.steps} supervised steps on the task family, loss {head:.3f} -> {tail:.3f}"
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written beside, then renamed: a kill mid-write leaves the previous file (or none), never a torn one.
            partial = path.with_name(path.name + ".tmp")
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, partial)
            os.replace(partial, path)
            message += f"; weights cached at {path}"
    rank_zero_info(f"{describe} {message}")
    return message


def copy_policy_into(reference: torch.nn.Module, policy: torch.nn.Module) -> None:
    """Load the (warm-started) policy's weights into its frozen reference copy (both unsharded: before
    ``configure_model``)."""
    reference.load_state_dict(policy.state_dict())


def warm_start_in_setup(module: Any, model: torch.nn.Module, config: WarmStart,
                        reference: torch.nn.Module | None = None, examples: ExampleSource | None = None) -> None:
    """The warm start as a ``LightningModule.setup`` step: once per module, before any sharding or validation.

    ``setup`` runs before ``configure_model`` (FSDP2 sharding) and before a ``validate`` that precedes ``fit``,
    so the first held-out numbers are those of the warm-started policy. The model moves to the strategy's
    device for the fit. Skipped when resuming (``trainer.ckpt_path``: the checkpoint holds the warm weights)
    and when already done. ``examples`` (default: the datamodule's ``warm_start_examples``) is for a module
    that writes its own prompts around the datamodule's tasks. Every rank fits the same examples from the same seed (no file shared between
    processes); a single process caches the weights (``config.path`` or ``warm_start.pt`` in the run dir).
    """
    trainer = attached_trainer(module)
    # Without a Trainer (a module set up by hand, e.g. to start CRSP's sandbox) there is no fit to prepare.
    if config.steps == 0 or getattr(module, "_warm_started", False) or trainer is None:
        return
    if trainer.ckpt_path is not None:
        return
    module._warm_started = True
    model_config = getattr(module, "model_config", None)
    if getattr(model_config, "is_checkpoint", False) and not config.on_checkpoint:
        rank_zero_info(f"{type(module).__name__} warm start: skipped, the policy is the checkpoint "
                       f"{model_config.pretrained} (module.warm_start.on_checkpoint=true runs it anyway)")
        return
    model.to(trainer.strategy.root_device)
    if examples is None:
        examples = getattr(trainer.datamodule, "warm_start_examples", None)
    # Every core this process's share of the machine offers (the processes of one machine split them).
    warm_start_policy(model, module.tokenizer, examples, config, trainer.default_root_dir,
                      describe=type(module).__name__, cache=trainer.world_size == 1,
                      cpu_threads=local_cpu_share(trainer.num_devices))
    if reference is not None:
        reference.to(trainer.strategy.root_device)
        copy_policy_into(reference, model)
