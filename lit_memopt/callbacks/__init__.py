"""Lightning callbacks that any user adds to any ``Trainer`` to see, shape and survive GPU memory."""

from __future__ import annotations

from lit_memopt._lazy import lazy_exports

# name -> submodule (relative to this package). One callback per file.
_EXPORTS = {
    "MemoryMonitor": ".memory_monitor",
    "MemoryMetrics": ".memory_monitor",
    "EmptyCacheScheduler": ".empty_cache",
    "ActivationCheckpointing": ".activation_checkpointing",
    "OOMRecovery": ".oom_recovery",
    "OOMRecoveryError": ".oom_recovery",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
