"""``OOMRecovery.run_micro_batches(..., sample_weights=...)``: the caller says how its loss is normalised.

A token-mean loss split by an OOM equals the unsplit step when the weights are token counts, whatever
the callback's global ``loss_weighting`` (here the default, ``samples``, which alone would be wrong).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lit_memopt.callbacks import OOMRecovery
from lit_memopt.memory import memory_budget

B, T, D = 4, 6, 3


class TokenMeanManual(LightningModule):
    """Manual optimization, a token-mean loss over ragged masks, an OOM on more than 2 samples."""

    def __init__(self, use_weights: bool, oom: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = torch.nn.Linear(D, 1).double()
        self.use_weights, self.oom = use_weights, oom
        self.grads: dict[str, torch.Tensor] = {}

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.oom and batch["x"].shape[0] > 2:
            with memory_budget(0):
                torch.empty(1024)
        per_token = self.net(batch["x"]).squeeze(-1) ** 2
        mask = batch["mask"]
        return (per_token * mask).sum() / mask.sum()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        weights = batch["mask"].sum(dim=-1) if self.use_weights else None
        OOMRecovery.run_micro_batches(self, batch, self.loss, sample_weights=weights)
        self.grads = {n: p.grad.detach().clone() for n, p in self.named_parameters()}
        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _grads(use_weights: bool, oom: bool) -> tuple[dict[str, torch.Tensor], OOMRecovery]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float64)
    data = [{"x": x[i], "mask": mask[i]} for i in range(B)]
    module, recovery = TokenMeanManual(use_weights, oom), OOMRecovery(grow_after_steps=None)
    Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[recovery]).fit(module, DataLoader(data, batch_size=B))
    return module.grads, recovery


@pytest.mark.parametrize("use_weights", [True, False])
def test_token_weights_make_a_split_token_mean_exact(use_weights: bool) -> None:
    unsplit, _ = _grads(use_weights, oom=False)
    split, recovery = _grads(use_weights, oom=True)
    assert recovery.oom_events == 1 and recovery.micro_batch_size == 2
    exact = all(torch.allclose(split[n], unsplit[n], rtol=1e-12, atol=1e-14) for n in unsplit)
    # With the caller's token counts the split is exact; with sample shares (ragged masks) it is not.
    assert exact is use_weights


def test_sample_weights_of_the_wrong_length_are_refused() -> None:
    class Bad(TokenMeanManual):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            OOMRecovery.run_micro_batches(self, batch, self.loss, sample_weights=[1.0, 2.0])

    with pytest.raises(ValueError, match="sample_weights has 2 entries for a batch of 4"):
        Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[OOMRecovery()]).fit(
            Bad(True, False), DataLoader([{"x": torch.zeros(T, D, dtype=torch.float64), "mask": torch.ones(T)}] * B,
                                         batch_size=B))
