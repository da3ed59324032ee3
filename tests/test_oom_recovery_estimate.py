"""OOMRecovery(initial_micro_batch_size="estimate"): a first micro-batch that fits, exact weights, no OOM."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_memopt.callbacks import OOMRecovery
from lit_memopt.memory import memory_budget

BATCH = 512


class WideRegression(pl.LightningModule):
    """Activations (batch x 2048) dominate the step's memory, so the micro-batch size matters."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, callbacks: list, budget_bytes: int | None = None):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * 2, 64), torch.randn(BATCH * 2, 64))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    loader = DataLoader(data, batch_size=BATCH, shuffle=False)
    if budget_bytes is None:
        with memory_budget(1 << 40) as budget:
            trainer.fit(module, loader)
        return budget
    with memory_budget(budget_bytes) as budget:
        trainer.fit(module, loader)
    return budget


@pytest.mark.timeout(300)
def test_estimate_starts_with_a_micro_batch_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    template = WideRegression()
    reference = copy.deepcopy(template)
    whole_batch_peak = _fit(reference, []).peak_bytes

    free = int(whole_batch_peak * 0.55)  # the whole batch does not fit; about half of it does
    monkeypatch.setattr(OOMRecovery, "_free_bytes", staticmethod(lambda module: free))
    recovery = OOMRecovery(initial_micro_batch_size="estimate", grow_after_steps=None)
    module = copy.deepcopy(template)
    budget = _fit(module, [recovery], budget_bytes=free)

    assert recovery.micro_batch_size is not None and 1 <= recovery.micro_batch_size < BATCH
    assert recovery.oom_events == 0, "the estimated size should fit the budget it was sized for"
    assert budget.peak_bytes <= free
    for got, want in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_estimate_with_room_to_spare_keeps_the_whole_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OOMRecovery, "_free_bytes", staticmethod(lambda module: 1 << 40))
    recovery = OOMRecovery(initial_micro_batch_size="estimate", grow_after_steps=None)
    _fit(WideRegression(), [recovery])
    assert recovery.micro_batch_size is None and recovery.oom_events == 0


def test_bad_initial_value_is_named() -> None:
    with pytest.raises(ValueError, match="'estimate'"):
        OOMRecovery(initial_micro_batch_size="auto")
