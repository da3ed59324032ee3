"""A model of PyTorch's CUDA caching allocator: from a sequence of allocations and frees, what it reserves.

A GPU runs out of memory when the allocator cannot *reserve* another segment, not when live tensors
reach the device size: every request is rounded up, small and large requests live in separate pools
of cudaMalloc'd segments, and a freed block is cached for reuse rather than returned. ``CachingAllocatorModel``
replays the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch's documented defaults: one stream,
no ``expandable_segments``, no ``max_split_size_mb``, no ``roundup_power2_divisions``):

* sizes are rounded up to a multiple of 512 bytes (``kMinBlockSize``), at least 512;
* requests up to 1 MiB (``kSmallSize``) come from the small pool, larger ones from the large pool;
* a new segment for the small pool is 2 MiB (``kSmallBuffer``); for the large pool a request under
  10 MiB (``kMinLargeAlloc``) gets a 20 MiB segment (``kLargeBuffer``), a larger one its size rounded
  up to 2 MiB (``kRoundLarge``);
* a request takes the smallest cached free block of its pool that is large enough (best fit);
* a block is split when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool);
* a freed block merges with free neighbours of its segment and stays cached;
* when a new segment would pass the device's capacity, fully free cached segments are released
  first (what the allocator does before reporting an out-of-memory error).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Iterable

__all__ = [
    "MIN_BLOCK_SIZE", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE",
    "round_size", "segment_size", "CachingAllocatorModel", "AllocatorOutOfMemory", "reserved_peak",
]

MIN_BLOCK_SIZE = 512  # every block is a multiple of this
SMALL_SIZE = 1 << 20  # requests up to 1 MiB use the small pool
SMALL_BUFFER = 2 << 20  # segment size of the small pool
LARGE_BUFFER = 20 << 20  # segment size for large-pool requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20  # larger segments are rounded up to this


def round_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` takes (``round_size`` in the allocator)."""
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def segment_size(block_bytes: int) -> int:
    """The segment cudaMalloc'd when no cached block fits a rounded request (``get_allocation_size``)."""
    if block_bytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if block_bytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((block_bytes + ROUND_LARGE - 1) // ROUND_LARGE)


class AllocatorOutOfMemory(RuntimeError):
    """The model could not reserve a segment within ``capacity_bytes``, even after releasing its cache.

    ``needed_bytes``: what the model would have had reserved with that segment (more than the capacity).
    """

    def __init__(self, message: str, needed_bytes: int = 0) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


@dataclass(eq=False, slots=True)  # slots: a long log makes millions of blocks, and reads their fields as often
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: "_Block | None" = field(default=None, repr=False)
    next: "_Block | None" = field(default=None, repr=False)


@dataclass
class CachingAllocatorModel:
    """Replays allocations and frees; ``reserved_bytes`` / ``peak_reserved_bytes`` are what ``torch.cuda`` would report.

    Args:
        capacity_bytes: device memory the segments may take (``None``: unlimited, the peak is what the
            allocator would ask for).
        release_before_growing: release every fully free cached segment before each new one, as if the device
            were always full: the peak is then about the smallest device the allocations run on.

    Example::

        model = CachingAllocatorModel()
        a = model.malloc(3000)        # rounded to 3072 B, from a new 2 MiB small-pool segment
        model.free(a)                 # cached, still reserved
        model.peak_reserved_bytes     # 2097152
    """

    capacity_bytes: int | None = None
    release_before_growing: bool = False
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    segments: dict[int, int] = field(default_factory=dict)  # segment id -> size
    _free: dict[bool, list[tuple[int, int, int, _Block]]] = field(default_factory=lambda: {True: [], False: []})
    _ids: "itertools.count[int]" = field(default_factory=itertools.count)
    _head: dict[int, _Block] = field(default_factory=dict)

    # ------------------------------------------------------------------ free lists (sorted by size, then address)
    # An entry is (size, segment, offset, block). No two free blocks share a segment and offset, so comparing two
    # entries is settled before the block, and a search key of three elements sorts just before the entry it names:
    # the lists are searched with plain tuple comparisons, no key function (millions of calls in a long log).
    def _remove(self, block: _Block) -> None:
        entries = self._free[block.small]
        i = bisect.bisect_left(entries, (block.size, block.segment, block.offset))
        assert entries[i][3] is block
        del entries[i]

    # ------------------------------------------------------------------ public
    # malloc and free run once per event of a logged step (millions for a long rollout), so their free-list searches
    # and insertions are written out in them rather than called (a merge, rarer, goes through _remove and _absorb).
    def malloc(self, nbytes: int) -> _Block:
        """Allocate ``nbytes``; returns the block (pass it to :meth:`free`)."""
        size = round_size(int(nbytes))
        small = size <= SMALL_SIZE
        entries = self._free[small]
        i = bisect.bisect_left(entries, (size, -1, -1))
        if i < len(entries):
            block = entries[i][3]
            del entries[i]
        else:
            block = self._new_segment(segment_size(size), small)
        block.free = False
        rest = block.size - size
        if (rest >= MIN_BLOCK_SIZE) if small else (rest > SMALL_SIZE):
            after = block.next
            offset = block.offset + size
            tail = _Block(block.segment, offset, rest, small, True, block, after)
            if after is not None:
                after.prev = tail
            block.next = tail
            block.size = size
            bisect.insort(entries, (rest, block.segment, offset, tail))
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block

    def free(self, block: _Block) -> None:
        """Return ``block`` to its pool, merged with free neighbours (the segment stays reserved)."""
        if block.free:
            raise ValueError("CachingAllocatorModel.free: block already free")
        self.allocated_bytes -= block.size
        block.free = True
        before = block.prev
        if before is not None and before.free:
            self._remove(before)
            self._absorb(before, block)
            block = before
        after = block.next
        if after is not None and after.free:
            self._remove(after)
            self._absorb(block, after)
        bisect.insort(self._free[block.small], (block.size, block.segment, block.offset, block))

    def _absorb(self, left: _Block, right: _Block) -> None:
        """Merge ``right`` into its free neighbour ``left`` (both out of the free lists)."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        if self._head.get(right.segment) is right:
            self._head[right.segment] = left

    def empty_cache(self) -> None:
        """Release every fully free segment (``torch.cuda.empty_cache``)."""
        for small in (True, False):
            for entry in list(self._free[small]):
                block = entry[3]
                if block.prev is None and block.next is None:
                    self._remove(block)
                    self.reserved_bytes -= self.segments.pop(block.segment)
                    self._head.pop(block.segment, None)

    # ------------------------------------------------------------------ segments
    def _new_segment(self, nbytes: int, small: bool) -> _Block:
        if self.release_before_growing:
            self.empty_cache()
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            self.empty_cache()
            if self.reserved_bytes + nbytes > self.capacity_bytes:
                raise AllocatorOutOfMemory(
                    f"cannot reserve {nbytes} bytes: {self.reserved_bytes} reserved of {self.capacity_bytes}",
                    self.reserved_bytes + nbytes,
                )
        seg = next(self._ids)
        self.segments[seg] = nbytes
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        block = _Block(seg, 0, nbytes, small, True)
        self._head[seg] = block
        return block


def reserved_peak(events: Iterable[tuple[int, int, int]], capacity_bytes: int | None = None, *,
                  release_before_growing: bool = False) -> int:
    """Peak reserved bytes for ``(+1, key, bytes)`` allocations and ``(-1, key, bytes)`` frees in order
    (``capacity_bytes`` and ``release_before_growing``: see :class:`CachingAllocatorModel`).

    Zero-byte allocations take no block (PyTorch returns a null pointer for them).
    """
    model = CachingAllocatorModel(capacity_bytes=capacity_bytes, release_before_growing=release_before_growing)
    live: dict[int, _Block] = {}
    for sign, key, nbytes in events:
        if sign > 0:
            if nbytes > 0:
                if key in live:  # a key reused after an unseen free: release the old block first
                    model.free(live.pop(key))
                live[key] = model.malloc(nbytes)
        else:
            block = live.pop(key, None)
            if block is not None:
                model.free(block)
    return model.peak_reserved_bytes
