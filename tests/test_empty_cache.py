"""EmptyCacheScheduler: its triggers fire at the right steps (allocator scripted), and on CPU it does nothing."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

import lit_memopt.callbacks.empty_cache as empty_cache_module
from lit_memopt.callbacks import EmptyCacheScheduler
from lit_memopt.memory.stats import MemorySnapshot


class _Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4)


def _fit(callback, **kwargs) -> Trainer:
    options = dict(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   limit_val_batches=1)
    options.update(kwargs)
    trainer = Trainer(callbacks=[callback], **options)
    trainer.fit(_Model(), train_dataloaders=_loader(), val_dataloaders=_loader())
    return trainer


def _snapshot(fragmentation: float, retries: int) -> MemorySnapshot:
    reserved = 1000
    return MemorySnapshot("cuda:0", int(reserved * (1 - fragmentation)), reserved, 0, 0, 0, retries, 10_000, 5_000)


@pytest.fixture
def scripted_cuda(monkeypatch):
    """Pretend the CPU has a CUDA caching allocator whose stats follow a script; count the cache empties."""
    script: list[MemorySnapshot] = []
    calls = {"snapshots": 0, "empties": 0}

    def fake_snapshot(device):
        index = min(calls["snapshots"], len(script) - 1)
        calls["snapshots"] += 1
        return script[index]

    def fake_empty_cache():
        calls["empties"] += 1

    monkeypatch.setattr(empty_cache_module, "_has_cuda_cache", lambda device: True)
    monkeypatch.setattr(empty_cache_module, "memory_snapshot", fake_snapshot)
    monkeypatch.setattr(empty_cache_module, "_empty_cuda_cache", fake_empty_cache)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return script, calls


def test_triggers_fire_at_the_expected_steps(scripted_cuda):
    script, calls = scripted_cuda
    # Snapshot 0 is read at setup; snapshot k at the end of optimizer step k.
    script[:] = [_snapshot(0.1, 0), _snapshot(0.1, 0), _snapshot(0.7, 0), _snapshot(0.1, 0),
                 _snapshot(0.1, 0), _snapshot(0.2, 1), _snapshot(0.1, 1)]
    # gc_collect=False: a full collection of this test process costs more than the rest of the test.
    scheduler = EmptyCacheScheduler(every_n_steps=3, fragmentation_threshold=0.5, on_alloc_retries=True,
                                    gc_collect=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(scheduler, val_check_interval=4)
    assert scheduler.empties_by_reason == {
        "every_n_steps": 2,  # steps 3 and 6
        "after_backward": 0,
        "validation_start": 1,  # one validation run, after step 4
        "validation_end": 1,
        "fragmentation": 1,  # step 2
        "alloc_retries": 1,  # step 5: 0 -> 1; step 6 stays at 1
    }
    assert calls["empties"] == 6  # steps 2, 3, 5, 6 and the two validation edges
    assert calls["snapshots"] == 7
    suggestions = [w for w in caught if "expandable_segments" in str(w.message)]
    assert len(suggestions) == 1
    assert scheduler.seconds_spent >= 0.0

    restored = EmptyCacheScheduler(every_n_steps=3, fragmentation_threshold=0.5)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.empties_by_reason == scheduler.empties_by_reason


def test_after_backward_with_accumulation_and_no_suggestion_when_expandable(scripted_cuda, monkeypatch):
    script, calls = scripted_cuda
    script[:] = [_snapshot(0.9, 0)]  # always fragmented
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    scheduler = EmptyCacheScheduler(after_backward=True, around_validation=False, fragmentation_threshold=0.5,
                                    on_alloc_retries=False, gc_collect=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(scheduler, max_steps=3, accumulate_grad_batches=2, limit_val_batches=0)
    assert scheduler.empties_by_reason["after_backward"] == 6  # 3 steps x 2 micro-batches
    assert scheduler.empties_by_reason["fragmentation"] == 3  # decided once per optimizer step
    assert calls["empties"] == 9
    assert not [w for w in caught if "expandable_segments" in str(w.message)]


def test_cpu_does_nothing_and_says_so_once(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(empty_cache_module, "_empty_cuda_cache", lambda: calls.append(1))
    scheduler = EmptyCacheScheduler(every_n_steps=1, after_backward=True, fragmentation_threshold=0.1)
    with caplog.at_level(logging.INFO):
        trainer = _fit(scheduler, max_steps=3, val_check_interval=2)
        trainer.validate(trainer.lightning_module, dataloaders=_loader(), verbose=False)
    assert calls == [] and scheduler.num_empties == 0
    assert sum("nothing to empty" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(every_n_steps=0), "every_n_steps"),
        (dict(every_n_steps=2.5), "every_n_steps"),
        (dict(fragmentation_threshold=1.0), "fragmentation_threshold"),
        (dict(fragmentation_threshold=0.0), "fragmentation_threshold"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmptyCacheScheduler(**kwargs)
