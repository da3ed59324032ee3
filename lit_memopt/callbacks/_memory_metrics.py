"""The records of a run kept by ``MemoryMonitor``: OOM events, batch-size changes, per-rank memory metrics.

Other callbacks (``OOMRecovery``) write events here through ``MemoryMonitor.find(trainer).metrics``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lit_memopt.memory.stats import MemorySnapshot

__all__ = ["OOMEvent", "BatchSizeChange", "MemoryMetrics"]


@dataclass
class OOMEvent:
    """One out-of-memory error seen during training (raised, or caught and recovered from)."""

    step: int
    message: str
    rank: int = 0
    phase: str | None = None
    batch_size: int | None = None


@dataclass
class BatchSizeChange:
    """One change of the micro-batch size (e.g. by ``OOMRecovery``), with the accumulation that keeps the global batch."""

    step: int
    old_batch_size: int
    new_batch_size: int
    accumulate_grad_batches: int | None = None
    reason: str = ""


@dataclass
class MemoryMetrics:
    """Memory and throughput of a run, filled in step by step by :class:`MemoryMonitor` (local to one rank).

    Other callbacks report events through :meth:`record_oom` and :meth:`record_batch_size_change`,
    finding the monitor with :meth:`MemoryMonitor.find`. Byte values are CUDA allocated bytes or,
    on CPU, process RSS.

    Example::

        monitor = MemoryMonitor.find(trainer)
        if monitor is not None:
            monitor.metrics.record_oom(trainer.global_step, str(error), rank=trainer.global_rank)
    """

    device: str = "cpu"
    steps: int = 0
    micro_batches: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    peak_forward_bytes: int = 0
    peak_backward_bytes: int = 0
    peak_optimizer_bytes: int = 0
    peak_bytes: int = 0
    sum_step_peak_bytes: float = 0.0
    sum_allocated_bytes: float = 0.0
    sum_reserved_bytes: float = 0.0
    device_total_bytes: int = 0
    oom_events: list[OOMEvent] = field(default_factory=list)
    batch_size_changes: list[BatchSizeChange] = field(default_factory=list)

    # --- derived values -------------------------------------------------------------------------
    @property
    def average_peak_bytes(self) -> float:
        """Mean over optimizer steps of each step's peak."""
        return self.sum_step_peak_bytes / self.steps if self.steps else 0.0

    @property
    def average_allocated_bytes(self) -> float:
        return self.sum_allocated_bytes / self.steps if self.steps else 0.0

    @property
    def average_reserved_bytes(self) -> float:
        return self.sum_reserved_bytes / self.steps if self.steps else 0.0

    @property
    def efficiency(self) -> float:
        """Mean allocated over mean reserved memory at step ends (1.0 on CPU, where both are RSS)."""
        return self.average_allocated_bytes / self.average_reserved_bytes if self.average_reserved_bytes else 1.0

    @property
    def grad_accum_ratio(self) -> float:
        """Micro-batches per optimizer step, as measured."""
        return self.micro_batches / self.steps if self.steps else 0.0

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else 0.0

    # --- recording --------------------------------------------------------------------------------
    def record_step(self, phase_peaks: dict[str, int], snapshot: MemorySnapshot) -> None:
        """Account one finished optimizer step (called by :class:`MemoryMonitor`)."""
        self.steps += 1
        self.peak_forward_bytes = max(self.peak_forward_bytes, phase_peaks["forward"])
        self.peak_backward_bytes = max(self.peak_backward_bytes, phase_peaks["backward"])
        self.peak_optimizer_bytes = max(self.peak_optimizer_bytes, phase_peaks["optimizer"])
        step_peak = max(phase_peaks.values())
        self.peak_bytes = max(self.peak_bytes, step_peak)
        self.sum_step_peak_bytes += step_peak
        self.sum_allocated_bytes += snapshot.allocated_bytes
        self.sum_reserved_bytes += snapshot.reserved_bytes
        self.device_total_bytes = snapshot.total_bytes

    def record_oom(
        self,
        step: int,
        message: str = "",
        *,
        rank: int = 0,
        phase: str | None = None,
        batch_size: int | None = None,
    ) -> OOMEvent:
        """Record an out-of-memory error at optimizer step ``step`` (whether or not it was recovered from).

        Args:
            step: the optimizer step (``trainer.global_step``) it happened at.
            message: the error text (shortened to its first line).
            rank: the global rank that saw it.
            phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``None`` when unknown.
            batch_size: the micro-batch size at the time, if known.
        """
        event = OOMEvent(step=int(step), message=str(message).strip().splitlines()[0][:300] if message else "",
                         rank=int(rank), phase=phase, batch_size=batch_size)
        self.oom_events.append(event)
        return event

    def record_batch_size_change(
        self,
        step: int,
        old_batch_size: int,
        new_batch_size: int,
        *,
        accumulate_grad_batches: int | None = None,
        reason: str = "",
    ) -> BatchSizeChange:
        """Record that the micro-batch size changed from ``old_batch_size`` to ``new_batch_size`` at ``step``.

        Args:
            step: the optimizer step it took effect at.
            old_batch_size: micro-batch size before.
            new_batch_size: micro-batch size after.
            accumulate_grad_batches: the gradient accumulation used from then on, if it changed with it.
            reason: a short word on why (``"oom"``, ``"grow"``, ...).
        """
        change = BatchSizeChange(int(step), int(old_batch_size), int(new_batch_size), accumulate_grad_batches, reason)
        self.batch_size_changes.append(change)
        return change

    # --- persistence ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> MemoryMetrics:
        state = dict(state)
        state["oom_events"] = [OOMEvent(**e) for e in state.get("oom_events", [])]
        state["batch_size_changes"] = [BatchSizeChange(**c) for c in state.get("batch_size_changes", [])]
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in state.items() if k in known})
