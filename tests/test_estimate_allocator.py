"""The CUDA caching-allocator model reproduces PyTorch's documented rounding and caching rules, one test per rule."""

from __future__ import annotations

import pytest

from lit_memopt.memory.allocator import AllocatorOutOfMemory, CachingAllocatorModel, reserved_peak, round_size, segment_size

KIB, MIB = 1 << 10, 1 << 20


def test_requests_round_up_to_512_bytes() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1536)] == [512, 512, 512, 1024, 1024, 1536]
    model = CachingAllocatorModel()
    assert model.malloc(1).size == 512 and model.allocated_bytes == 512


def test_small_requests_share_2_mib_segments() -> None:
    assert segment_size(round_size(1)) == 2 * MIB and segment_size(MIB) == 2 * MIB  # <= 1 MiB: small pool
    model = CachingAllocatorModel()
    blocks = [model.malloc(100 * KIB) for _ in range(20)]  # 20 x 100 KiB = 2000 KiB fit one 2048 KiB segment
    assert model.reserved_bytes == 2 * MIB and len(model.segments) == 1
    model.malloc(100 * KIB)
    assert model.reserved_bytes == 4 * MIB
    assert all(not b.free for b in blocks)


def test_large_requests_under_10_mib_get_a_20_mib_segment_and_larger_ones_round_to_2_mib() -> None:
    assert segment_size(MIB + 512) == 20 * MIB and segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB and segment_size(11 * MIB) == 12 * MIB
    model = CachingAllocatorModel()
    model.malloc(3 * MIB)
    model.malloc(3 * MIB)  # split off the first 20 MiB segment: no new segment
    assert model.reserved_bytes == 20 * MIB
    model.malloc(11 * MIB)  # fits the 14 MiB left of that segment
    assert model.reserved_bytes == 20 * MIB
    model.malloc(15 * MIB)  # does not: a segment of its size rounded up to 2 MiB
    assert model.reserved_bytes == 36 * MIB


def test_small_and_large_pools_do_not_share_blocks() -> None:
    model = CachingAllocatorModel()
    big = model.malloc(5 * MIB)
    model.free(big)  # a free 20 MiB large-pool segment
    model.malloc(4 * KIB)
    assert model.reserved_bytes == 22 * MIB  # the small request made its own 2 MiB segment


def test_split_thresholds_differ_between_pools() -> None:
    a = CachingAllocatorModel().malloc(2 * MIB)  # large pool: 20 MiB segment, the 18 MiB rest (> 1 MiB) is split off
    assert a.size == 2 * MIB and a.next is not None and a.next.size == 18 * MIB
    whole = CachingAllocatorModel().malloc(19 * MIB)  # a 20 MiB segment; its 1 MiB rest is not > 1 MiB: no split
    assert whole.size == 20 * MIB and whole.next is None
    s = CachingAllocatorModel()
    b = s.malloc(MIB)  # small pool, 2 MiB segment, 1 MiB rest >= 512 B: split
    assert b.size == MIB and b.next is not None and b.next.size == MIB
    c = s.malloc(MIB - 512)  # takes the 1 MiB rest; its 512 B rest is still split off (>= 512)
    assert c.size == MIB - 512 and c.next is not None and c.next.size == 512


def test_best_fit_picks_the_smallest_cached_block_that_fits() -> None:
    model = CachingAllocatorModel()
    blocks = [model.malloc(n * MIB) for n in (12, 16, 14)]  # three segments of their own sizes
    for b in blocks:
        model.free(b)
    chosen = model.malloc(13 * MIB)
    assert chosen.segment == blocks[2].segment  # 14 MiB, not 16 MiB
    assert model.reserved_bytes == 42 * MIB


def test_freed_neighbours_merge_and_segments_stay_reserved() -> None:
    model = CachingAllocatorModel()
    a, b, c = (model.malloc(600 * KIB) for _ in range(3))
    assert len(model.segments) == 1  # 1800 KiB in one 2 MiB segment
    for block in (a, c, b):
        model.free(block)
    assert model.allocated_bytes == 0 and model.reserved_bytes == 2 * MIB  # cached, not returned
    whole = model.malloc(MIB)  # the three blocks and the rest merged back into one free 2 MiB block
    assert whole.offset == 0 and whole.next is not None and whole.next.size == MIB and model.reserved_bytes == 2 * MIB


def test_capacity_releases_cached_segments_before_running_out() -> None:
    model = CachingAllocatorModel(capacity_bytes=40 * MIB)
    a = model.malloc(30 * MIB)
    model.free(a)
    model.malloc(36 * MIB)  # does not fit the cached 30 MiB block: the cache is released first
    assert model.reserved_bytes == 36 * MIB and model.peak_reserved_bytes == 36 * MIB
    with pytest.raises(AllocatorOutOfMemory, match="reserved"):
        model.malloc(8 * MIB)


def test_reserved_peak_replays_events() -> None:
    events = [(1, 1, 5 * MIB), (1, 2, 5 * MIB), (-1, 1, 5 * MIB), (1, 3, 4 * MIB), (1, 4, 0), (-1, 2, 5 * MIB)]
    assert reserved_peak(events) == 20 * MIB  # all inside one 20 MiB segment, the freed block reused
    assert reserved_peak([(1, 1, 11 * MIB), (-1, 1, 11 * MIB), (1, 2, 13 * MIB)]) == 12 * MIB + 14 * MIB
