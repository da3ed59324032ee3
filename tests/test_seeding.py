"""Seeds come from (base, rank, step, sample, stream): ranks differ, splits do not.

- ``derive_seed`` separates every component (a DDP rank never reuses another rank's noise).
- GRADE's Gumbel noise is per sample, so a step that an injected OOM splits into micro-batches
  produces the gradients of the unsplit step.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from test_grade import make_module, prompts, reward_model, tokenizer  # noqa: F401 - fixtures
from torch.utils.data import DataLoader

from lit_memopt.callbacks import OOMRecovery
from lit_memopt.memory import memory_budget
from lit_memopt.modules.grade import GradeModule
from lit_memopt.seeding import derive_seed


def test_derive_seed_separates_every_component_and_repeats() -> None:
    base = derive_seed(0, rank=0, step=3, index=5, stream="grade/sample")
    assert base == derive_seed(0, rank=0, step=3, index=5, stream="grade/sample")
    others = [
        derive_seed(1, rank=0, step=3, index=5, stream="grade/sample"),
        derive_seed(0, rank=1, step=3, index=5, stream="grade/sample"),
        derive_seed(0, rank=0, step=4, index=5, stream="grade/sample"),
        derive_seed(0, rank=0, step=3, index=6, stream="grade/sample"),
        derive_seed(0, rank=0, step=3, index=5, stream="crsp/solve"),
        derive_seed(0, rank=0, step=-1, index=5, stream="grade/sample"),
    ]
    assert base not in others and len(set(others)) == len(others)
    assert all(0 <= s < 2**63 for s in [base, *others])


def test_two_ranks_draw_different_grade_noise(reward_model) -> None:  # noqa: F811
    module = make_module(reward_model)
    ids, _ = prompts(batch=2)
    draws = []
    for rank in (0, 1):
        module._trainer = SimpleNamespace(global_rank=rank)  # what LightningModule.global_rank reads
        generators = module.noise_generators(ids, step=0, batch_idx=0, sample_index=torch.tensor([0, 1]))
        draws.append(torch.stack([torch.rand(4, generator=g) for g in generators]))
    module._trainer = None
    assert not torch.equal(draws[0], draws[1])
    # Within a rank, two samples get different noise too.
    assert not torch.equal(draws[0][0], draws[0][1])


class _GradeOOMWhenLarge(GradeModule):
    """GRADE whose forward runs out of memory (a real torch.OutOfMemoryError) on more than 2 samples."""

    def training_step(self, batch: dict, batch_idx: int) -> Any:
        if batch["input_ids"].shape[0] > 2:
            with memory_budget(0):
                torch.empty(1024)
        return super().training_step(batch, batch_idx)


class _Grads(Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.policy.named_parameters() if p.grad is not None}


def _one_step(module: GradeModule, callbacks: list) -> dict[str, torch.Tensor]:
    ids, mask = prompts(batch=4)
    data = [{"input_ids": ids[i], "attention_mask": mask[i], "index": i} for i in range(4)]
    grads = _Grads()
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[*callbacks, grads])
    trainer.fit(module, DataLoader(data, batch_size=4))
    return grads.grads


@pytest.mark.parametrize("hard", [True, False])
def test_grade_step_split_by_an_oom_equals_the_unsplit_step(reward_model, hard: bool) -> None:  # noqa: F811
    unsplit = _one_step(make_module(reward_model, hard=hard), [OOMRecovery()])
    module = make_module(reward_model, hard=hard)
    split_module = _GradeOOMWhenLarge.__new__(_GradeOOMWhenLarge)
    split_module.__dict__.update(copy.deepcopy(module).__dict__)
    recovery = OOMRecovery()
    split = _one_step(split_module, [recovery])
    assert recovery.oom_events == 1 and recovery.micro_batch_size == 2  # the step really was split
    assert unsplit.keys() == split.keys() and unsplit
    for name in unsplit:
        torch.testing.assert_close(split[name], unsplit[name], rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------- Intuitor
class _IntuitorOOMWhenLarge:
    """Mixin: the training step runs out of memory on more than 2 prompts (the rollout came before it)."""

    def training_step(self, batch: dict, batch_idx: int) -> Any:
        if batch["input_ids"].shape[0] > 2:
            with memory_budget(0):
                torch.empty(1024)
        return super().training_step(batch, batch_idx)


def _intuitor_step(split: bool) -> tuple[dict[str, torch.Tensor], OOMRecovery]:
    from test_intuitor import _batch, _config

    from lit_memopt.data.reasoning_prompts import answer_is_correct
    from lit_memopt.modules import IntuitorModule

    torch.manual_seed(0)
    config = _config()
    cls = type("Split", (_IntuitorOOMWhenLarge, IntuitorModule), {}) if split else IntuitorModule
    module = cls(config, config.build_tokenizer(), num_samples=3, max_new_tokens=6, kl_coef=0.05, checker=answer_is_correct)
    batch = _batch(module.tokenizer, ["1+2=", "30+4=", "5+6=", "7+80="], ["3", "34", "11", "87"])
    data = [{"input_ids": batch["input_ids"][i], "attention_mask": batch["attention_mask"][i], "answers": a}
            for i, a in enumerate(batch["answers"])]

    def collate(items: list[dict]) -> dict:
        return {"input_ids": torch.stack([x["input_ids"] for x in items]),
                "attention_mask": torch.stack([x["attention_mask"] for x in items]),
                "answers": [x["answers"] for x in items]}

    grads, recovery = _IntuitorGrads(), OOMRecovery(grow_after_steps=None)
    Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[recovery, grads]).fit(module, DataLoader(data, batch_size=4, collate_fn=collate))
    return grads.grads, recovery


class _IntuitorGrads(Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}


def test_intuitor_step_split_by_an_oom_equals_the_unsplit_step() -> None:
    unsplit, _ = _intuitor_step(split=False)
    split, recovery = _intuitor_step(split=True)
    assert recovery.oom_events == 1 and recovery.micro_batch_size == 2  # the step really was split
    assert unsplit.keys() == split.keys() and unsplit
    for name in unsplit:
        torch.testing.assert_close(split[name], unsplit[name], rtol=1e-5, atol=1e-6, msg=name)
