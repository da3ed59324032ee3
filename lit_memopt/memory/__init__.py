"""Memory probes and planning: device stats, OOM detection, the budget simulator, the peak estimator."""

from __future__ import annotations

from lit_memopt._lazy import lazy_exports

# name -> submodule (relative to this package). Add new public names here.
_EXPORTS = {
    "MemorySnapshot": ".stats",
    "memory_snapshot": ".stats",
    "is_oom_error": ".oom",
    "memory_budget": ".budget",
    "MemoryBudget": ".budget",
    "storage_bytes": ".budget",
    "estimate_peak": ".estimate",
    "fake_mode": ".fake",
    "peak_during": ".fake",
    "PeakStats": ".fake",
    "fake_process_group": ".fake_ranks",
    "estimate_rank": ".fake_ranks",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
