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


def test_releasing_before_growing_keeps_only_segments_in_use() -> None:
    events = [(1, 1, 30 * MIB), (-1, 1, 30 * MIB), (1, 2, 36 * MIB), (1, 3, 12 * MIB), (-1, 3, 12 * MIB), (1, 4, 11 * MIB)]
    # cached, the freed 30 MiB segment serves the 12 MiB and then the 11 MiB block
    assert reserved_peak(events) == 30 * MIB + 36 * MIB
    # released before the 36 MiB segment is made: 12 MiB needs a segment of its own, whose cached block serves 11 MiB
    assert reserved_peak(events, release_before_growing=True) == 36 * MIB + 12 * MIB


def test_reserved_peak_replays_events() -> None:
    events = [(1, 1, 5 * MIB), (1, 2, 5 * MIB), (-1, 1, 5 * MIB), (1, 3, 4 * MIB), (1, 4, 0), (-1, 2, 5 * MIB)]
    assert reserved_peak(events) == 20 * MIB  # all inside one 20 MiB segment, the freed block reused
    assert reserved_peak([(1, 1, 11 * MIB), (-1, 1, 11 * MIB), (1, 2, 13 * MIB)]) == 12 * MIB + 14 * MIB


def _growing_caches(blocks: int, steps: int = 8):
    """A LightningModule whose step grows one cache per block a few rows at a time under no_grad (a rollout's KV
    caches), then trains its blocks: without a device size the allocator model keeps a new segment for every longer
    cache, far above what is live."""
    import lightning.pytorch as pl
    import torch

    class GrowingCaches(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(blocks))

        def training_step(self, batch, batch_idx):
            with torch.no_grad():
                caches = [torch.zeros(4096, 1024) for _ in self.layers]  # 16 MiB each
                for _ in range(steps):  # 2 MiB longer each step: never fits a freed segment
                    caches = [torch.cat([c, torch.zeros(512, 1024)]) for c in caches]
            x = batch + sum(c[0, :64] for c in caches)
            del caches
            for layer in self.layers:
                x = layer(x)
            return x.square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return GrowingCaches()


def test_a_device_size_stops_a_growing_cache_from_reserving_without_limit() -> None:
    import torch

    from lit_memopt.memory import estimate_peak, fake_mode

    batch = torch.randn(8, 64)

    def estimate(device_bytes):
        with fake_mode():
            module = _growing_caches(4)
        return estimate_peak(module, batch, device_bytes=device_bytes)

    unlimited = estimate(None)
    assert unlimited.device_bytes is None
    assert unlimited.reserved_peak_bytes > 3 * unlimited.peak_bytes  # a segment per cache length per block
    roomy = 2 * unlimited.peak_bytes
    on_device = estimate(roomy)
    assert on_device.peak_bytes == unlimited.peak_bytes and on_device.device_bytes == roomy
    # the cache is released at the device's size: reserved stays within it, and holds at least what is live
    assert unlimited.peak_bytes <= on_device.reserved_peak_bytes <= roomy
    # a device smaller than what is live: even a released cache is not enough, and the figure says so
    tight = unlimited.peak_bytes // 2
    assert estimate(tight).reserved_peak_bytes > tight


def test_block_extrapolation_does_not_carry_reserved_past_the_device() -> None:
    """Where the reserved line passes the device's size and the least device the step needs (an allocator releasing
    its cache before every new segment, extrapolated too) does not, the step runs within the device: its reserved
    peak is the device's size, as a full trace on that device confirms. A device below that least one does not fit."""
    import torch

    from lit_memopt.memory import estimate_peak, fake_mode
    from lit_memopt.memory.blocks import estimate_with_blocks
    from lit_memopt.memory.step import within_device

    batch = torch.randn(8, 64)
    with fake_mode():
        built = _growing_caches(3)
    line = estimate_with_blocks(built, batch, 12)
    assert line.reserved_peak_bytes > 3 * line.peak_bytes and line.least_reserved_bytes is None
    device = (line.peak_bytes + line.reserved_peak_bytes) // 2
    unjudged = estimate_with_blocks(built, batch, 12, device_bytes=device)
    # the line is left for the caller to judge (a rank holds less than the whole model the trace is of)
    assert unjudged.reserved_peak_bytes == line.reserved_peak_bytes and unjudged.device_bytes == device
    est = within_device(unjudged)
    assert est.peak_bytes == line.peak_bytes
    assert est.reserved_peak_bytes == device and "releases its cached segments" in est.method
    with fake_mode():
        whole = _growing_caches(12)
    full = estimate_peak(whole, batch, device_bytes=device)
    assert abs(full.peak_bytes - line.peak_bytes) <= 0.02 * line.peak_bytes
    assert full.peak_bytes <= full.reserved_peak_bytes <= device  # it does run within the device
    assert full.peak_bytes <= est.least_reserved_bytes <= device
    assert abs(est.least_reserved_bytes - full.least_reserved_bytes) <= 0.05 * full.least_reserved_bytes
    # a device above the line: extrapolated as without one
    assert within_device(estimate_with_blocks(built, batch, 12, device_bytes=2 * line.reserved_peak_bytes)
                         ).reserved_peak_bytes == line.reserved_peak_bytes
    # below the least device: it needs that much, as the full trace on that device says too
    small = (line.peak_bytes + est.least_reserved_bytes) // 2 if est.least_reserved_bytes > line.peak_bytes else line.peak_bytes // 2
    tight = within_device(estimate_with_blocks(built, batch, 12, device_bytes=small))
    assert tight.reserved_peak_bytes == tight.least_reserved_bytes > small and "more than the device's" in tight.method
    assert estimate_peak(whole, batch, device_bytes=small).reserved_peak_bytes > small


def test_the_free_lists_stay_sorted_and_coalesced_over_a_long_random_log() -> None:
    """The model's invariants after every event of a random log (both pools, splits, merges, reuse): each free list
    sorted by (size, segment, offset) and naming exactly the free blocks, no two neighbouring free blocks, every
    segment's blocks tiling it, and the allocated bytes the sum of the blocks in use."""
    import random

    from lit_memopt.memory.allocator import CachingAllocatorModel

    rng = random.Random(1)
    model = CachingAllocatorModel(capacity_bytes=2 << 30)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            model.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(model.malloc(rng.choice([1, 512, 3000, 600_000, 1 << 20, 3 << 20, rng.randint(1, 30 << 20)])))
        blocks = []
        for head in model._head.values():
            b, offset = head, 0
            while b is not None:
                assert b.offset == offset and (b.next is None or not (b.free and b.next.free))
                offset += b.size
                blocks.append(b)
                b = b.next
            assert offset == model.segments[head.segment]
        for small in (True, False):
            entries = model._free[small]
            assert [e[:3] for e in entries] == sorted(e[:3] for e in entries)
            assert {id(e[3]) for e in entries} == {id(b) for b in blocks if b.free and b.small == small}
        assert model.allocated_bytes == sum(b.size for b in blocks if not b.free)
