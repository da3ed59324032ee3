"""Memory snapshots: CPU RSS and system numbers track real allocations; peak counters reset; CUDA fields are the allocator's."""

from __future__ import annotations

import psutil
import pytest
import torch

from lit_memopt.memory import MemorySnapshot, memory_snapshot
from lit_memopt.memory.stats import cpu_peak_is_resettable, current_memory_bytes, peak_memory_bytes, reset_peak_memory

MIB = 1024**2


def test_cpu_snapshot_fields_are_consistent():
    snap = memory_snapshot("cpu")
    assert isinstance(snap, MemorySnapshot) and snap.device == "cpu" and not snap.is_cuda
    assert snap.allocated_bytes == snap.reserved_bytes == snap.active_bytes > 0
    assert snap.peak_bytes >= snap.allocated_bytes
    assert snap.num_alloc_retries == 0
    assert snap.total_bytes == psutil.virtual_memory().total and 0 < snap.free_bytes <= snap.total_bytes
    assert 0.0 <= snap.used_fraction <= 1.0
    assert snap.efficiency == 1.0 and snap.fragmentation == 0.0
    # The process RSS as psutil sees it (a few MiB apart: the two reads are not simultaneous).
    assert abs(snap.allocated_bytes - psutil.Process().memory_info().rss) < 64 * MIB
    assert set(snap.as_dict()) >= {"allocated_bytes", "reserved_bytes", "peak_bytes", "total_bytes", "free_bytes"}


def test_cpu_rss_follows_a_tensor():
    before = current_memory_bytes("cpu")
    block = torch.ones(128 * MIB // 4)  # written, so resident
    during = current_memory_bytes("cpu")
    del block
    after = current_memory_bytes("cpu")
    assert during - before > 120 * MIB
    assert during - after > 120 * MIB  # large blocks go back to the OS when freed


@pytest.mark.skipif(not cpu_peak_is_resettable(), reason="needs a resettable peak RSS (Linux /proc/self/clear_refs)")
def test_cpu_peak_resets():
    assert reset_peak_memory("cpu") is True
    base = peak_memory_bytes("cpu")
    block = torch.ones(160 * MIB // 4)
    del block
    peak = peak_memory_bytes("cpu")
    assert peak - base > 150 * MIB  # the freed block is still in the peak...
    assert memory_snapshot("cpu").peak_bytes >= peak - 8 * MIB
    reset_peak_memory("cpu")
    assert peak_memory_bytes("cpu") < peak - 120 * MIB  # ...until the peak is reset


def test_fragmentation_and_used_fraction_maths():
    snap = MemorySnapshot("cuda:0", allocated_bytes=600, reserved_bytes=1000, active_bytes=600, peak_bytes=900,
                          peak_reserved_bytes=1000, num_alloc_retries=2, total_bytes=4000, free_bytes=1000)
    assert snap.is_cuda
    assert snap.efficiency == pytest.approx(0.6) and snap.fragmentation == pytest.approx(0.4)
    assert snap.used_fraction == pytest.approx(0.75)


def test_unsupported_device_is_rejected():
    with pytest.raises(ValueError, match="'cuda' and 'cpu'"):
        memory_snapshot("meta")


@pytest.mark.cuda  # skips itself without a GPU (conftest.py); `pytest -m cuda` selects it
def test_cuda_snapshot_matches_allocator():
    reset_peak_memory("cuda")
    x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    snap = memory_snapshot("cuda")
    assert snap.allocated_bytes == torch.cuda.memory_allocated()
    assert snap.reserved_bytes == torch.cuda.memory_reserved() >= snap.allocated_bytes
    assert snap.peak_bytes >= 64 * MIB and snap.total_bytes > snap.free_bytes > 0
    del x
    assert peak_memory_bytes("cuda") >= 64 * MIB
    reset_peak_memory("cuda")
    assert peak_memory_bytes("cuda") == torch.cuda.memory_allocated()
