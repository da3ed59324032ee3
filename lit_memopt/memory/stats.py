"""Device memory snapshots (CUDA allocator stats, or process RSS on CPU) and resettable peak counters."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "MemorySnapshot",
    "memory_snapshot",
    "reset_peak_memory",
    "peak_memory_bytes",
    "cpu_peak_is_resettable",
]

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory of one device at one instant, with the same fields on CUDA and on CPU.

    On CUDA the numbers come from PyTorch's caching allocator and ``cudaMemGetInfo``. On CPU there
    is no caching allocator to look into, so ``allocated_bytes``, ``reserved_bytes`` and
    ``active_bytes`` all hold the process resident set size (RSS): what the process really holds
    in RAM, tensors and everything else.

    Args:
        device: the device, e.g. ``"cuda:0"`` or ``"cpu"``.
        allocated_bytes: CUDA: bytes held by live tensors. CPU: process RSS.
        reserved_bytes: CUDA: bytes the caching allocator holds from the driver. CPU: process RSS.
        active_bytes: CUDA: bytes in active allocator blocks (allocated plus rounding). CPU: process RSS.
        peak_bytes: CUDA: peak allocated bytes since the last :func:`reset_peak_memory`. CPU: peak
            RSS (``VmHWM``) since the last reset on Linux, where it can be reset; elsewhere the
            process-lifetime ``ru_maxrss``, which never resets.
        peak_reserved_bytes: CUDA: peak reserved bytes since the last reset. CPU: same as ``peak_bytes``.
        num_alloc_retries: CUDA: how often the allocator had to free its cache and retry a
            ``cudaMalloc`` (a sign of memory pressure or fragmentation). CPU: always 0.
        total_bytes: CUDA: device memory. CPU: system RAM.
        free_bytes: CUDA: free device memory (all processes counted). CPU: available system RAM.
    """

    device: str
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    peak_bytes: int
    peak_reserved_bytes: int
    num_alloc_retries: int
    total_bytes: int
    free_bytes: int

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def used_fraction(self) -> float:
        """Share of the device (CUDA) or system RAM (CPU) in use by anyone: ``1 - free / total``."""
        return 1.0 - self.free_bytes / self.total_bytes if self.total_bytes > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """``allocated / reserved``: 1.0 when the allocator's cache holds nothing unused (always 1.0 on CPU)."""
        return self.allocated_bytes / self.reserved_bytes if self.reserved_bytes > 0 else 1.0

    @property
    def fragmentation(self) -> float:
        """``(reserved - allocated) / reserved``: the share of reserved memory no tensor uses."""
        return 1.0 - self.efficiency

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _read_proc_status_kib(*fields: str) -> dict[str, int] | None:
    """Values (in KiB) of ``VmRSS``/``VmHWM``-style lines of ``/proc/self/status``; ``None`` off Linux."""
    try:
        with open(_PROC_STATUS, "rb") as f:
            text = f.read()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(b":")
        name = key.decode()
        if name in fields:
            out[name] = int(value.split()[0])
    return out


def _ru_maxrss_bytes() -> int:
    try:
        import resource
    except ImportError:  # Windows: no lifetime peak available
        return 0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


_CPU_PEAK_RESETTABLE: bool | None = None


def cpu_peak_is_resettable() -> bool:
    """Whether this OS lets the process reset its peak RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``).

    Where it cannot, CPU peaks are process-lifetime maxima (``ru_maxrss``) and per-phase peaks
    only see RSS at phase boundaries.
    """
    global _CPU_PEAK_RESETTABLE
    if _CPU_PEAK_RESETTABLE is None:
        try:
            with open(_PROC_CLEAR_REFS, "w") as f:
                f.write("5")
            _CPU_PEAK_RESETTABLE = _read_proc_status_kib("VmHWM") is not None
        except OSError:
            _CPU_PEAK_RESETTABLE = False
    return _CPU_PEAK_RESETTABLE


def _cpu_rss_and_peak() -> tuple[int, int]:
    values = _read_proc_status_kib("VmRSS", "VmHWM")
    if values and "VmRSS" in values:
        rss = values["VmRSS"] * 1024
        peak = values.get("VmHWM", 0) * 1024
        return rss, max(rss, peak)
    import psutil

    rss = psutil.Process().memory_info().rss
    return rss, max(rss, _ru_maxrss_bytes())


def reset_peak_memory(device: torch.device | str | int | None = None) -> bool:
    """Reset the peak counters of ``device`` so the next :func:`peak_memory_bytes` covers only what follows.

    CUDA: ``torch.cuda.reset_peak_memory_stats``. CPU: resets the process peak RSS (``VmHWM``)
    through ``/proc/self/clear_refs`` on Linux. Returns ``False`` where the peak cannot be reset
    (CPU off Linux); peaks then stay process-lifetime maxima.
    """
    device = _as_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if not cpu_peak_is_resettable():
        return False
    try:
        with open(_PROC_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_memory_bytes(device: torch.device | str | int | None = None) -> int:
    """Peak bytes since the last :func:`reset_peak_memory`: CUDA max allocated, or CPU peak RSS.

    Cheaper than a full :func:`memory_snapshot`; meant for phase boundaries in a training step.
    """
    device = _as_device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _cpu_rss_and_peak()[1]


def current_memory_bytes(device: torch.device | str | int | None = None) -> int:
    """Bytes in use now: CUDA allocated, or CPU process RSS."""
    device = _as_device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _cpu_rss_and_peak()[0]


def memory_snapshot(device: torch.device | str | int | None = None) -> MemorySnapshot:
    """Take a :class:`MemorySnapshot` of ``device`` (default: the current CUDA device, else the CPU).

    Example::

        snap = memory_snapshot("cuda:0")
        print(snap.allocated_bytes / 2**30, snap.fragmentation, snap.used_fraction)
    """
    device = _as_device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        free, total = torch.cuda.mem_get_info(device)
        return MemorySnapshot(
            device=str(device),
            allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
            reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
            active_bytes=int(stats.get("active_bytes.all.current", 0)),
            peak_bytes=int(stats.get("allocated_bytes.all.peak", 0)),
            peak_reserved_bytes=int(stats.get("reserved_bytes.all.peak", 0)),
            num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
            total_bytes=int(total),
            free_bytes=int(free),
        )
    if device.type != "cpu":
        raise ValueError(f"memory_snapshot(device={str(device)!r}): only 'cuda' and 'cpu' devices are supported.")
    import psutil

    rss, peak = _cpu_rss_and_peak()
    vm = psutil.virtual_memory()
    return MemorySnapshot(
        device="cpu",
        allocated_bytes=rss,
        reserved_bytes=rss,
        active_bytes=rss,
        peak_bytes=peak,
        peak_reserved_bytes=peak,
        num_alloc_retries=0,
        total_bytes=int(vm.total),
        free_bytes=int(vm.available),
    )

