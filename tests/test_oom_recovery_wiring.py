"""OOMRecovery's place among other callbacks and Lightning's own machinery.

- A fatal OOM is counted once by OOMRecovery and once by MemoryMonitor (a keyed record, not text matching).
- Patching ``optimizer.step`` keeps an LR scheduler's mark: no "optimizer.step() has been overridden" warning.
- The gradient-sync backend is chosen from the strategy, and unsupported strategies say why in one line.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from test_oom_recovery import PlannedOOMModule, fit

from lit_memopt.callbacks import MemoryMonitor, OOMRecovery
from lit_memopt.callbacks._gradient_sync import select_gradient_sync
from lit_memopt.callbacks._rank_agreement import RankAgreement
from lit_memopt.callbacks.oom_recovery import OOMRecoveryError


def test_a_fatal_oom_is_counted_once_by_both_callbacks() -> None:
    # Batch 1 recovers (8 -> 4 -> 2); batch 2 runs out of memory even at min_micro_batch_size=2.
    module = PlannedOOMModule(plan={(0, 0, 1): ("forward", 2), (0, 0, 2): ("forward", 1)})
    recovery = OOMRecovery(grow_after_steps=None, min_micro_batch_size=2)
    monitor = MemoryMonitor(log_every_n_steps=1)
    with pytest.raises(OOMRecoveryError, match="cannot shrink further") as error:
        fit(module, [recovery, monitor], max_steps=5)
    assert error.value.oom_recorded
    assert recovery.oom_events == 3  # 8 and 4 at batch 1, 2 at batch 2 (fatal)
    assert len(monitor.metrics.oom_events) == recovery.oom_events
    assert [(e.step, e.phase) for e in monitor.metrics.oom_events] == [(1, "forward"), (1, "forward"), (2, "forward")]


def test_an_oom_without_oom_recovery_is_still_counted_by_memory_monitor() -> None:
    module = PlannedOOMModule(plan={(0, 0, 1): ("forward", 2)})
    monitor = MemoryMonitor(log_every_n_steps=1)
    with pytest.raises(torch.OutOfMemoryError):
        fit(module, [monitor], max_steps=3)
    assert [(e.step, e.phase) for e in monitor.metrics.oom_events] == [(1, "forward")]


class _WithScheduler(PlannedOOMModule):
    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)}


def test_no_lr_scheduler_warning_from_the_optimizer_step_patch() -> None:
    recovery = OOMRecovery()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(_WithScheduler(), [recovery], max_steps=3)
    assert not [w for w in caught if "overridden after learning rate scheduler" in str(w.message)]
    # The patch is really in place while training (and gone after): it is what retries optimizer OOMs.
    assert recovery.retry_optimizer_step


@pytest.mark.parametrize(
    "strategy_name, expected",
    [("DeepSpeedStrategy", "inactive under DeepSpeed"), ("FSDPStrategy", "does not support FSDP1")],
)
def test_unsupported_strategies_say_why(strategy_name: str, expected: str) -> None:
    strategy = type(strategy_name, (), {})()
    reason = select_gradient_sync(SimpleNamespace(strategy=strategy), RankAgreement())
    assert isinstance(reason, str) and expected in reason


def test_single_device_backend_is_chosen_for_one_device() -> None:
    recovery = OOMRecovery(grow_after_steps=None)
    fit(PlannedOOMModule(), [recovery], max_steps=1)
    assert recovery.gradient_sync == "single device"
