"""Tripwires for the private Lightning names used through ``lit_memopt/_compat.py``: a rename fails here, by name."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lit_memopt import _compat
from lit_memopt.callbacks.run_checkpoint import RunCheckpoint

WHERE = f"Lightning {lightning.__version__} changed it; update lit_memopt/_compat.py"


@pytest.mark.parametrize("name", _compat.PRIVATE_METHODS)
def test_model_checkpoint_still_has_the_private_methods_we_use(name: str) -> None:
    assert callable(getattr(ModelCheckpoint, name, None)), f"ModelCheckpoint.{name} is gone: {WHERE}"


@pytest.mark.parametrize("name", _compat.PRIVATE_ATTRIBUTES)
def test_model_checkpoint_instances_still_have_the_private_attributes_we_set(name: str) -> None:
    assert hasattr(ModelCheckpoint(), name), f"ModelCheckpoint()._{name.lstrip('_')} is gone: {WHERE}"


def test_the_write_hook_we_override_keeps_its_signature() -> None:
    hook = getattr(ModelCheckpoint, _compat.MODEL_CHECKPOINT_WRITE_HOOK)
    assert list(inspect.signature(hook).parameters) == ["self", "trainer", "filepath"], (
        f"ModelCheckpoint.{_compat.MODEL_CHECKPOINT_WRITE_HOOK} changed its arguments: {WHERE}")
    assert _compat.MODEL_CHECKPOINT_WRITE_HOOK in vars(RunCheckpoint), "RunCheckpoint no longer overrides the write hook"


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self.layer(batch).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_trigger_of_one_run_checkpoint_fires_through_lightning(tmp_path: Path) -> None:
    """Behaviour, not only names: steps, validation and the end all save, every write goes through our hook."""
    writes: list[str] = []

    class Recording(RunCheckpoint):
        def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
            writes.append(Path(filepath).name)
            super()._save_checkpoint(trainer, filepath)

    callback = Recording(tmp_path, every_n_steps=3, every_n_minutes=None, keep_last=2)
    data = DataLoader(torch.randn(40, 2), batch_size=4)
    trainer = Trainer(max_steps=8, val_check_interval=5, limit_val_batches=1, callbacks=[callback], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(_Tiny(), data, data)
    assert writes == ["step_000003.ckpt", "step_000005.ckpt", "step_000006.ckpt", "step_000008.ckpt"], writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step_000006.ckpt", "step_000008.ckpt"]
    assert (tmp_path / "last.ckpt").resolve().name == "step_000008.ckpt"


def test_the_time_trigger_fires_alongside_the_step_trigger(tmp_path: Path) -> None:
    callback = RunCheckpoint(tmp_path, every_n_steps=100, every_n_minutes=1e-9, keep_last=None, on_validation=False)
    trainer = Trainer(max_steps=3, callbacks=[callback], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0)
    trainer.fit(_Tiny(), DataLoader(torch.randn(40, 2), batch_size=4))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000001.ckpt", "step_000002.ckpt", "step_000003.ckpt"]
