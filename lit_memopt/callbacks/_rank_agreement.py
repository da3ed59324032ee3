"""How every rank takes the same decision: one small ``all_reduce`` of a few integers.

Used by every part of ``OOMRecovery`` (the micro-batch loop, the size policy, the optimizer-step
retry and the FSDP2 collective guards), so that the number and order of agreement collectives is
the same on every rank whatever happened locally.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RankAgreement", "PeerFailure", "OK", "OOM", "ERROR", "PHASES", "PHASE_CODES"]

# Status codes exchanged between ranks (element-wise MAX: the worst outcome wins).
OK, OOM, ERROR = 0, 1, 2
PHASES = {0: "unknown", 1: "forward", 2: "backward", 3: "optimizer"}
PHASE_CODES = {name: code for code, name in PHASES.items()}


class PeerFailure(RuntimeError):
    """Raised on a healthy rank at an agreement point where another rank reported a failure.

    It carries the agreed ``(status, phase_code)``, so the rank that raises it does not agree a
    second time: the agreement already happened (inside an FSDP2 collective guard).
    """

    def __init__(self, status: int, phase_code: int) -> None:
        super().__init__(f"another rank failed ({'out of memory' if status == OOM else 'error'} in {PHASES.get(phase_code, 'unknown')})")
        self.status = status
        self.phase_code = phase_code


class RankAgreement:
    """Element-wise MAX / MIN over all ranks of a few numbers: how the callbacks decide together.

    How ``OOMRecovery`` and ``EmptyCacheScheduler`` agree across ranks (``MemoryMonitor`` only reports, and
    gathers its values by name with ``LightningModule.all_gather``). It runs on the Lightning strategy's own
    collectives (``strategy.reduce`` with ``"max"``), on its root device; a single process returns its input.
    Every call is one collective of the same shape; callers must make the same calls in the same order
    on every rank.

    Args:
        strategy: the ``Trainer``'s strategy (``trainer.strategy``); ``None`` for a single process.
    """

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy
        self.enabled = strategy is not None and int(getattr(strategy, "world_size", 1)) > 1

    @classmethod
    def for_trainer(cls, trainer: Any) -> RankAgreement:
        return cls(getattr(trainer, "strategy", None))

    @property
    def device(self) -> torch.device:
        return getattr(self.strategy, "root_device", None) or torch.device("cpu")

    def max(self, *values: int) -> list[int]:
        if not self.enabled:
            return [int(v) for v in values]
        flags = torch.tensor(values, dtype=torch.int64, device=self.device)
        return [int(v) for v in self.strategy.reduce(flags, reduce_op="max").tolist()]

    def min(self, *values: int) -> list[int]:
        return [-v for v in self.max(*(-int(v) for v in values))]

    def max_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max of a (float) tensor over ranks, on the CPU."""
        if not self.enabled:
            return values
        return self.strategy.reduce(values.to(self.device), reduce_op="max").cpu()

    def status(self, status: int, phase_code: int) -> tuple[int, int]:
        """Agree on ``(status, phase)``: only a failing rank names its phase, so MAX carries it to all ranks."""
        agreed, phase = self.max(status, phase_code if status != OK else 0)
        return agreed, phase

    def check_peers(self) -> None:
        """An agreement point for a rank that is fine: raises :class:`PeerFailure` when another rank is not."""
        agreed, phase = self.status(OK, 0)
        if agreed != OK:
            raise PeerFailure(agreed, phase)
