"""How every rank takes the same decision: one small ``all_reduce`` of a few integers.

Used by every part of ``OOMRecovery`` (the micro-batch loop, the size policy, the optimizer-step
retry and the FSDP2 collective guards), so that the number and order of agreement collectives is
the same on every rank whatever happened locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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
    """Element-wise MAX (or MIN) over all ranks of a few integers.

    A no-op (returns its input) in a single process. Every call is one ``all_reduce`` of the same
    shape and dtype; callers must make the same calls in the same order on every rank.
    """

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def max(self, *values: int) -> list[int]:
        if not self.enabled:
            return [int(v) for v in values]
        flags = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [int(v) for v in flags.tolist()]

    def min(self, *values: int) -> list[int]:
        return [-v for v in self.max(*(-int(v) for v in values))]

    def status(self, status: int, phase_code: int) -> tuple[int, int]:
        """Agree on ``(status, phase)``: only a failing rank names its phase, so MAX carries it to all ranks."""
        agreed, phase = self.max(status, phase_code if status != OK else 0)
        return agreed, phase

    def check_peers(self) -> None:
        """An agreement point for a rank that is fine: raises :class:`PeerFailure` when another rank is not."""
        agreed, phase = self.status(OK, 0)
        if agreed != OK:
            raise PeerFailure(agreed, phase)
