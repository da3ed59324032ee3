"""The micro-batch size policy of ``OOMRecovery``: the size, shrinking on OOM, growing back, back-off.

Every input of a decision is identical on all ranks (sizes come from the largest batch over ranks,
counters change only on agreed outcomes), so every rank reaches the same decision; the one local
input (CUDA headroom) is agreed through :class:`RankAgreement` before it is used.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memopt.callbacks._micro_batching import grow_size, shrink_size
from lit_memopt.callbacks._rank_agreement import RankAgreement

__all__ = ["MicroBatchSizePolicy", "SHRINK_POLICIES", "estimated_initial_size"]

SHRINK_POLICIES = ("halve", "divisor")
_MAX_BACKOFF_EXPONENT = 10


class MicroBatchSizePolicy:
    """Size, clean-batch count and back-off of the micro-batch, with a record of every change and OOM.

    ``micro_batch_size`` is ``None`` while the whole batch is used. ``events`` holds one record per
    OOM, ``history`` one per size change; both survive a restart through :meth:`state_dict`.
    ``on_change(record)`` / ``on_oom(record)`` tell listeners (the callback forwards them to a
    ``MemoryMonitor``).
    """

    def __init__(
        self,
        micro_batch_size: int | None,
        min_size: int,
        max_size: int | None,
        shrink: str,
        grow_after_steps: int | None,
        max_memory_fraction: float,
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.min_size = min_size
        self.max_size = max_size
        self.shrink = shrink
        self.grow_after_steps = grow_after_steps
        self.max_memory_fraction = max_memory_fraction
        self.oom_events = 0
        self.events: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self.clean_batches = 0
        self.grow_failures = 0
        self.grow_wait = grow_after_steps or 0
        self.on_change: Callable[[dict[str, Any]], None] | None = None
        self.on_oom: Callable[[dict[str, Any]], None] | None = None
        # (base, peak, micro size, device index) of the last clean CUDA batch: predicts growth headroom
        self._cuda_last: tuple[int, int, int, int] | None = None
        self._cuda_base = 0

    # ------------------------------------------------------------------ decisions
    def plan(self, batch_size: int, agree: RankAgreement) -> tuple[int, int | None]:
        """The size to try for a batch of ``batch_size`` (largest over ranks), and the size grown from (or ``None``)."""
        size = min(self.micro_batch_size or batch_size, batch_size)
        size = max(size, min(self.min_size, batch_size))
        if self.grow_after_steps is None or self.micro_batch_size is None:
            return size, None
        cap = min(batch_size, self.max_size or batch_size)
        if size >= cap or self.clean_batches < self.grow_wait:
            return size, None
        target = min(cap, grow_size(size, batch_size, self.shrink))
        (blocked,) = agree.max(0 if self._headroom_allows(target) else 1)
        if blocked:
            self.clean_batches = 0
            return size, None
        return target, size

    def can_shrink(self, size: int) -> bool:
        return size > self.min_size and size > 1

    def shrunk(self, size: int, batch_size: int, step: int) -> int:
        """Shrink after an OOM at ``size`` and return the new size."""
        new_size = max(self.min_size, shrink_size(size, batch_size, self.shrink))
        self._set(step, size, new_size, "oom")
        return new_size

    def growth_failed(self, step: int, tried: int, previous: int) -> int:
        """An OOM at a grown size: step back and double the wait before the next try."""
        self.grow_failures += 1
        self.grow_wait = (self.grow_after_steps or 0) * 2 ** min(self.grow_failures, _MAX_BACKOFF_EXPONENT)
        self.clean_batches = 0
        self.history.append({"step": step, "from": tried, "to": previous, "reason": "grow_failed"})
        rank_zero_info(
            f"OOMRecovery: growing the micro-batch to {tried} ran out of memory at step {step}; "
            f"back to {previous}, next try after {self.grow_wait} clean batches"
        )
        return previous

    def succeeded(self, step: int, size: int, grow_from: int | None, had_oom: bool) -> None:
        if grow_from is not None:
            self._set(step, grow_from, size, "grow")
        elif not had_oom:
            self.clean_batches += 1
            return
        self.clean_batches = 0  # a recovered or grown batch is not a clean one

    def record_oom(self, step: int, phase: str, size: int, message: str) -> None:
        self.oom_events += 1
        event = {"step": step, "phase": phase, "micro_batch_size": size, "message": message}
        self.events.append(event)
        if self.on_oom is not None:
            self.on_oom(event)

    def _set(self, step: int, old: int, new: int, reason: str) -> None:
        self.micro_batch_size = new
        self.clean_batches = 0
        record = {"step": step, "from": old, "to": new, "reason": reason}
        self.history.append(record)
        rank_zero_info(f"OOMRecovery: micro-batch size {old} -> {new} at step {step} ({reason})")
        if self.on_change is not None:
            self.on_change(record)

    # ------------------------------------------------------------------ CUDA headroom
    def measure_start(self, device: torch.device, reset_peak: bool) -> None:
        if device.type == "cuda":
            self._cuda_base = torch.cuda.memory_allocated(device)
            if reset_peak:
                torch.cuda.reset_peak_memory_stats(device)

    def measure_end(self, device: torch.device, size: int) -> None:
        if device.type == "cuda":
            self._cuda_last = (self._cuda_base, torch.cuda.max_memory_allocated(device), size, device.index or 0)

    def _headroom_allows(self, target: int) -> bool:
        if self._cuda_last is None:
            return True  # no device statistics: try, and step back on OOM
        base, peak, measured_size, index = self._cuda_last
        total = torch.cuda.get_device_properties(index).total_memory
        predicted = base + (peak - base) * target / max(measured_size, 1)
        return predicted <= self.max_memory_fraction * total

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "oom_events": self.oom_events,
            "events": [dict(e) for e in self.events],
            "history": [dict(h) for h in self.history],
            "clean_batches": self.clean_batches,
            "grow_failures": self.grow_failures,
            "grow_wait": self.grow_wait,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size = state.get("micro_batch_size", self.micro_batch_size)
        self.oom_events = int(state.get("oom_events", 0))
        self.events = [dict(e) for e in state.get("events", [])]
        self.history = [dict(h) for h in state.get("history", [])]
        self.clean_batches = int(state.get("clean_batches", 0))
        self.grow_failures = int(state.get("grow_failures", 0))
        self.grow_wait = int(state.get("grow_wait", self.grow_after_steps or 0))


def estimated_initial_size(
    trainer: Any, module: Any, batch: Any, batch_size: int, free_bytes: int, margin: float, min_size: int,
    agree: RankAgreement,
) -> int | None:
    """The first micro-batch size from a fake-tensor estimate of the step against ``free_bytes``.

    Every rank estimates its own batch against its own free memory; the ranks then agree on the
    smallest result, so that they all start from the same size. ``None`` means the whole batch.
    """
    from lit_memopt.memory.estimate import EstimateError, initial_micro_batch_from_estimate

    try:
        size = initial_micro_batch_from_estimate(trainer, module, batch, free_bytes, margin)
    except EstimateError as exc:
        rank_zero_warn(f"OOMRecovery: initial_micro_batch_size='estimate' cannot size this step ({exc}); starting with the whole batch.")
        size = batch_size
    (size,) = agree.min(int(size))
    size = max(min_size, min(size, batch_size))
    rank_zero_info(f"OOMRecovery: estimated starting micro-batch size {size} of {batch_size}")
    return None if size >= batch_size else size
