"""Block stitching: the allocation log of an n-block step, made from the logs of two traced block counts.

Block extrapolation (``memory.blocks``) makes every allocated figure of an n-block step exact from traces of 1 and
2 blocks, because live bytes are affine in the block count. The reserved figure is not: the caching allocator's
rounding and reuse depend on the order of every allocation, and where the step's peak moves from backward (few
blocks) to the optimizer step (many) the line through the probes' reserved figures misses the later phase's slack
(Qwen3-4B SFT, 16 x 64: 37.46 GiB on the line against 40.72 GiB replayed from a trace of all 36 blocks).

So the n-block log itself is made and replayed. The 2-block log is the 1-block log with the second block's events
inserted (its forward, its backward, its parameters' share of every per-parameter optimizer op); aligning the two
logs' allocations segment by segment finds those runs, and repeating each run in place gives the log of any block
count. A segment is a phase, cut again where each outermost model call and its backward start (the tracker marks
them): a rollout calls its model once per token, and each call gains one block's run. A size that grows with the
block count (a list of per-parameter norms) grows on its line. Frees follow their allocations, except where a block
frees what another one made: a segment's one run is repeated whole, and each copy frees what the copy before it
handed on (:class:`_Run`). The alignment is a heuristic (sizes repeat), so the caller checks the stitched log
before trusting it: each phase's allocated peak must be the one block extrapolation computed at the check trace's
block count, and no lower than its line at the target's (``memory.blocks``).
"""

from __future__ import annotations

import bisect
import difflib
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PhasedLog", "BlockStitch", "stitch_log", "phase_peaks", "MAX_ALIGNED_EVENTS"]

# The most allocations of one segment that a general alignment (``difflib``) is run on (quadratic in the worst case):
# GRPO at 1.7B aligns 2,166 in its rollout; GRADE at 4B, before its log was cut at each model call, 6,685 in one
# phase (3.9 s), then refused by the checks.
MAX_ALIGNED_EVENTS = 4_000

Event = tuple[int, Any, int]  # (+1 allocation / -1 free, key, bytes)


@dataclass(frozen=True)
class PhasedLog:
    """A step's allocation log (``memory.tracker.StepTracker.allocation_log``) with where each phase's events start.

    Attributes:
        events: ``(+1, key, bytes)`` allocations and ``(-1, key, bytes)`` frees in program order.
        phases: ``(index of the first event, phase)`` where a segment starts (the phase changes, or an outermost
            model call or its backward starts), in order.
    """

    events: list[Event]
    phases: list[tuple[int, str]]

    def segments(self) -> list[tuple[str, int, int]]:
        """``(phase, start, end)`` of each segment."""
        marks = self.phases or [(0, "setup")]
        ends = [start for start, _ in marks[1:]] + [len(self.events)]
        return [(phase, start, end) for (start, phase), end in zip(marks, ends)]


def _unique_keys(events: list[Event]) -> list[tuple[int, int | None, int]]:
    """``events`` with each allocation under a key of its own (a tracker key is an ``id()``, reused once freed); a
    free of a storage the log never saw allocated keeps ``None``."""
    live: dict[Any, int] = {}
    fresh = itertools.count()
    out: list[tuple[int, int | None, int]] = []
    for sign, key, nbytes in events:
        if sign > 0:
            live[key] = uid = next(fresh)
            out.append((1, uid, nbytes))
        else:
            out.append((-1, live.pop(key, None), nbytes))
    return out


class BlockStitch:
    """The events ``high`` adds over ``low`` (the step with one block, or group of blocks, fewer), found once;
    :meth:`log` repeats them any number of times.

    ``aligned`` is ``False`` where the two logs do not differ by insertions alone (other segments, allocations of
    ``low`` missing from ``high``), or where a segment needs a general alignment of more than
    :data:`MAX_ALIGNED_EVENTS` allocations; :meth:`log` is then ``None``.
    """

    def __init__(self, low: PhasedLog, high: PhasedLog) -> None:
        self.high = high
        self.events = b = _unique_keys(high.events)
        self.inserted = inserted = [False] * len(b)
        self.growth: dict[int, int] = {}  # index in b -> bytes added per copy
        # segment start -> its one inserted run, where a segment gains exactly one (see :class:`_Run`)
        self.runs: dict[int, _Run] = {}
        self.born = born = {uid: j for j, (sign, uid, _) in enumerate(b) if sign > 0}
        self.aligned = ([p for _, p in low.phases] == [p for _, p in high.phases]
                        and self._align(_unique_keys(low.events), low))
        if not self.aligned:
            return
        # earlier runs' allocations that a later run's copies free, bar one: where high frees them, only the last copy
        self.freed_once = {x for run in self.runs.values() for x in run.freed_once}
        self.freed_first = {x for run in self.runs.values() for x in run.freed_first}
        for j, (sign, uid, _) in enumerate(b):
            if sign < 0 and uid is not None:  # a free goes where its allocation went
                inserted[j] = inserted[born[uid]]
                if born[uid] in self.growth:
                    self.growth[j] = self.growth[born[uid]]

    def _align(self, a: list[tuple[int, int | None, int]], low: PhasedLog) -> bool:
        b, inserted, growth = self.events, self.inserted, self.growth
        for (_, a0, a1), (phase, b0, b1) in zip(low.segments(), self.high.segments()):
            # Allocations only: a free is placed by its allocation (a free of an unseen storage is aligned like one).
            ia = [i for i in range(a0, a1) if a[i][0] > 0 or a[i][1] is None]
            ib = [j for j in range(b0, b1) if b[j][0] > 0 or b[j][1] is None]
            ta = [(a[i][0], a[i][2]) for i in ia]
            tb = [(b[j][0], b[j][2]) for j in ib]
            opcodes = _alignment(ta, tb, _FreeOrder(a, ia, a1, b, ib, b1))
            if opcodes is None:
                return False
            changes = [op for op in opcodes if op[0] != "equal" and op[2:] != (op[1], op[4], op[4])]
            if len(changes) == 1 and changes[0][0] == "insert":
                _, _, _, j1, j2 = changes[0]
                self.runs[b0] = _Run.of(b, ib, j1, j2, b1, inserted, self.born, blocks=phase != "optimizer step",
                                        trailing=a1 - (ia[-1] + 1 if ia else a0))
            for op, i1, i2, j1, j2 in opcodes:
                if op == "equal":
                    continue
                if op == "insert":
                    for j in range(j1, j2):
                        inserted[ib[j]] = True
                elif op == "replace" and i2 - i1 == j2 - j1 and all(
                        ta[i][0] == tb[j][0] > 0 for i, j in zip(range(i1, i2), range(j1, j2))):
                    for i, j in zip(range(i1, i2), range(j1, j2)):
                        growth[ib[j]] = tb[j][1] - ta[i][1]
                else:
                    return False
        return True

    def log(self, copies: int) -> PhasedLog | None:
        """``high``'s events with the inserted runs repeated ``copies`` times in place (``copies=1``: ``high``)."""
        if not self.aligned or copies < 1:
            return None
        b, inserted, growth = self.events, self.inserted, self.growth
        events: list[Event] = []
        phases: list[tuple[int, str]] = []
        for phase, start, end in self.high.segments():
            phases.append((len(events), phase))
            j = start
            run = self.runs.get(start)
            while j < end:
                if run is not None and j == run.first:
                    events.extend(run.copies(b, inserted, copies))
                    j = run.end
                    continue
                if not inserted[j]:
                    sign, uid, nbytes = b[j]
                    events.append((sign, (uid, 0), nbytes + (copies - 1) * growth.get(j, 0)))
                    j += 1
                    continue
                k = j
                while k < end and inserted[k]:
                    k += 1
                for copy in range(copies):
                    events.extend((sign, (uid, copy), nbytes) for sign, uid, nbytes in b[j:k]
                                  if sign > 0 or _frees_here(uid, copy, copies, self.freed_once, self.freed_first))
                j = k
        return PhasedLog(events, phases)


@dataclass(frozen=True)
class _Run:
    """The one run a segment of ``high`` gains over ``low``: its events from the first inserted allocation
    (``first``) up to the next kept allocation (``end``), frees of earlier allocations included, repeated whole.

    Repeating only the inserted events would run every copy's first part, then the kept events between, then
    every copy's rest (Qwen3-4B SFT, 4 x 1024, checkpointed: a 36-block backward of 41.59 GiB against the 31.42
    of a whole trace). Repeated whole, what the events around the run free of the run's allocations, or of an
    earlier run's, ``high`` frees once: the block next to the run frees what the run handed on (the hidden state
    in forward, its gradient in backward), or the saved activations of its own forward. With more copies, each
    copy but the first frees the instance the copy before it stands for, as many allocations into the copy as
    the block next to the run is when it frees it (``handoffs``), and the events around the run free only the
    last copy's (``freed_once``). The kept frees inside the run are the first copy's. The optimizer step's runs
    (``blocks=False``: one parameter's share of a per-parameter op, handing nothing on) keep their frees where
    ``high`` has them, every copy's.
    """

    first: int
    end: int
    # (allocations into the run, events after the last of them) -> (uid, bytes) the next copy frees there
    handoffs: dict[tuple[int, int], list[tuple[int, int]]]
    freed_once: frozenset[int]
    # of those, an earlier run's allocations: the copies free them last made first (autograd frees a block's saved
    # activations in the reverse order of forward), so where high frees one, the first copy's is left. Which instance
    # goes first moves the allocator's blocks, not the live bytes: first made first, Qwen3-4B SFT's least device
    # (16 x 64, on 21.6 GiB) replayed 38.08 GiB, where its whole trace replays 37.77 and this order 37.77.
    freed_first: frozenset[int]

    @staticmethod
    def of(b: list[tuple[int, int | None, int]], tokens: list[int], j1: int, j2: int, seg_end: int,
           inserted: list[bool], born: dict[int, int], blocks: bool, trailing: int) -> "_Run":
        first = tokens[j1]
        end = tokens[j2] if j2 < len(tokens) else seg_end
        extra = j2 - j1
        seg_start = tokens[0]
        ours = {b[j][1] for j in range(first, end) if b[j][0] > 0}
        # A run that ends the segment: the kept frees at its end that the segment of one block fewer ends with too
        # (``trailing``: the frees after its last allocation) follow the copies, not each one (the embedding's output
        # after the last block's backward).
        while j2 == len(tokens) and trailing > 0 and end > first and b[end - 1][0] < 0 and b[end - 1][1] not in ours \
                and not (b[end - 1][1] is not None and inserted[born[b[end - 1][1]]]):
            end -= 1
            trailing -= 1
        handoffs: dict[tuple[int, int], list[tuple[int, int]]] = {}
        freed_once: set[int] = set()
        freed_first: set[int] = set()
        kept_inside: list[tuple[tuple[int, int], int]] = []  # (position in the run, bytes) of the run's kept frees

        def position(j: int, at: int, base: int) -> tuple[int, int]:
            """Where free ``j`` (``at`` tokens before it) falls in a block starting at token ``base``: allocations of
            the block before it, and events after the last of them."""
            return (at - base, j - tokens[at - 1] - 1 if at > base else 0)

        earlier: list[tuple[int, int, int]] = []  # (allocations into its block, bytes, uid): earlier runs' frees
        for j in range(seg_start, seg_end):
            sign, uid, nbytes = b[j]
            if sign > 0 or uid is None:
                continue
            at = bisect.bisect_left(tokens, j)
            if first <= j < end:
                if uid not in ours and not inserted[born[uid]]:
                    here = position(j, at, j1)
                    # handed on by the kept block before the run, at the position of one of the run's own: each
                    # later copy frees the previous copy's (where the run ends the segment, none follows it)
                    t = bisect.bisect_left(tokens, born[uid]) + extra
                    new = b[tokens[t]] if blocks and born[uid] >= seg_start and j1 <= t < j2 else None
                    if new is not None and new[0] > 0 and new[2] == nbytes and new[1] not in freed_once:
                        handoffs.setdefault(here, []).append((new[1], nbytes))
                        freed_once.add(new[1])
                    else:
                        kept_inside.append((here, nbytes))
            elif blocks and uid in ours and j >= end and at - j2 <= extra and uid not in freed_once:
                # handed on: the block after the run frees it (what is freed later, as the optimizer's per-parameter
                # temporaries after its loop, every copy's is freed there)
                handoffs.setdefault(position(j, at, j2), []).append((uid, nbytes))
                freed_once.add(uid)
            elif blocks and born[uid] < seg_start and inserted[born[uid]]:
                earlier.append((at - (j2 if j >= end else j1 - extra), nbytes, uid))
        # An earlier run's allocation freed beside this run stands for one the run frees itself where the run frees a
        # kept one of its size (a block's saved activations, where backward's run is not the block forward's run
        # was); else every copy's is freed where high frees it (gradients at the optimizer's zero_grad). Pairs are
        # taken closest first over all of a size: taken in the run's order, a kept free that repeats nowhere (the
        # final norm's input, freed where backward starts) took a block's partner, and Qwen3-4B SFT's 3-block log
        # freed a saved activation a block early.
        pairs = sorted((abs(o - offset[0]), y, k) for y, (offset, nbytes) in enumerate(kept_inside)
                       for k, (o, n, _) in enumerate(earlier) if n == nbytes)
        matched: set[int] = set()
        for _, y, k in pairs:
            uid = earlier[k][2]
            if y in matched or uid in freed_once:
                continue
            matched.add(y)
            handoffs.setdefault(kept_inside[y][0], []).append((uid, kept_inside[y][1]))
            freed_once.add(uid)
            freed_first.add(uid)
        return _Run(first, end, handoffs, frozenset(freed_once), frozenset(freed_first))

    def copies(self, b: list[tuple[int, int | None, int]], inserted: list[bool], copies: int) -> list[Event]:
        out: list[Event] = []
        for copy in range(copies):
            pending = sorted(self.handoffs) if copy else []
            allocations = since = 0
            for j in range(self.first, self.end):
                while pending and pending[0] <= (allocations, since):  # what the copy before this one handed on
                    out.extend(self._handed(pending.pop(0), copy, copies))
                sign, uid, nbytes = b[j]
                if inserted[j]:  # the run's allocations, and frees of its or an earlier run's: each copy its own
                    if sign > 0 or _frees_here(uid, copy, copies, self.freed_once, self.freed_first):
                        out.append((sign, (uid, copy), nbytes))
                elif copy == 0:
                    out.append((sign, (uid, 0), nbytes))  # what the kept events before the run handed on
                allocations, since = (allocations + 1, 0) if sign > 0 else (allocations, since + 1)
            for key in pending:
                out.extend(self._handed(key, copy, copies))
        return out

    def _handed(self, key: tuple[int, int], copy: int, copies: int) -> list[Event]:
        """The frees copy ``copy`` makes at ``key`` of what another copy stands for."""
        return [(-1, (x, copies - copy if x in self.freed_first else copy - 1), n) for x, n in self.handoffs[key]]


def _frees_here(uid: int | None, copy: int, copies: int, freed_once: frozenset[int] | set[int],
                freed_first: frozenset[int] | set[int]) -> bool:
    """Whether copy ``copy`` of a free of ``uid`` is made where ``high`` makes it: every copy's, but for what a run's
    copies free themselves (``freed_once``), where only the one copy left is, the last (the first of ``freed_first``,
    freed last-made first)."""
    if uid not in freed_once:
        return True
    return copy == (0 if uid in freed_first else copies - 1)


def stitch_log(low: PhasedLog, high: PhasedLog, copies: int) -> PhasedLog | None:
    """``BlockStitch(low, high).log(copies)``."""
    return BlockStitch(low, high).log(copies)


# How many entries the [points, kept allocations] array of ``_FreeOrder.fewest_mismatches`` holds at a time.
POINT_ROWS_ENTRIES = 1 << 22


class _FreeOrder:
    """Where a run inserted into a segment may go at several points (the allocations around it repeat: a block's last
    sizes are those the next one starts with), each point pairs the allocations kept from ``low`` with other ones of
    ``high``. The right pairing keeps each allocation's free where ``low`` has it; :meth:`mismatches` counts the kept
    allocations that a point would free elsewhere (measured on GRPO at 1.7B: the last point put the stitched forward
    peak 3.25 MiB per block below the exact one, where the point that keeps the frees in order gives it exactly)."""

    def __init__(self, a: list[tuple[int, int | None, int]], ia: list[int], a_end: int,
                 b: list[tuple[int, int | None, int]], ib: list[int], b_end: int) -> None:
        self.low = _tokens_before_free(a, ia, a_end)
        self.high = _tokens_before_free(b, ib, b_end)

    def mismatches(self, at: int, extra: int) -> int:
        """Kept allocations freed elsewhere (counted in kept allocations made before the free) with the ``extra``
        allocations of ``high`` from its ``at``-th inserted."""
        count = 0
        for k, want in enumerate(self.low):
            got = self.high[k if k < at else k + extra]
            if got is not None:
                got -= min(max(got - at, 0), extra)  # the inserted allocations made before the free do not count
            count += got != want
        return count

    def fewest_mismatches(self, points: range, extra: int) -> int:
        """The first of ``points`` with the fewest :meth:`mismatches`, counted for all points at once in numpy (a
        decoding loop's segment has thousands of points and of kept allocations: the loop above, point by point, was a
        tenth of a long rollout's estimate)."""
        none = -1  # no free within the segment (counts are >= 0)
        low = np.array([none if w is None else w for w in self.low], dtype=np.int64)
        high = np.array([none if g is None else g for g in self.high], dtype=np.int64)
        k = np.arange(len(low), dtype=np.int64)
        best, best_count = points[0], None
        step = max(1, POINT_ROWS_ENTRIES // max(len(low), 1))  # points a [points, kept] array holds at a time
        for start in range(points.start, points.stop, step):
            ats = np.arange(start, min(start + step, points.stop), dtype=np.int64)[:, None]
            got = high[np.where(k < ats, k, k + extra)]
            adjusted = np.where(got == none, none, got - np.clip(got - ats, 0, extra))
            counts = (adjusted != low).sum(axis=1)
            i = int(counts.argmin())
            if best_count is None or counts[i] < best_count:
                best, best_count = int(ats[i, 0]), int(counts[i])
        return best


def _tokens_before_free(events: list[tuple[int, int | None, int]], tokens: list[int], end: int) -> list[int | None]:
    """Per aligned event (``tokens``: indices into ``events`` of the segment ending at ``end``, in order): for an
    allocation freed within the segment, how many of ``tokens`` precede its free; else ``None``."""
    if not tokens:
        return []
    freed_at: dict[int, int] = {}
    for j in range(tokens[0], end):
        sign, uid, _ = events[j]
        if sign < 0 and uid is not None:
            freed_at.setdefault(uid, j)
    out: list[int | None] = []
    for j in tokens:
        sign, uid, _ = events[j]
        at = freed_at.get(uid) if sign > 0 else None
        out.append(None if at is None else bisect.bisect_left(tokens, at))
    return out


def _alignment(ta: list[tuple[int, int]], tb: list[tuple[int, int]],
               order: _FreeOrder) -> list[tuple[str, int, int, int, int]] | None:
    """Opcodes (``difflib``'s) turning ``ta`` into ``tb``. One block's forward or backward is one contiguous run of
    events: where ``tb`` is ``ta`` with one run inserted, that run is taken whole (a general alignment can split it
    among equal sizes, leaving some of the block's frees apart from the rest), at the point that keeps the most
    frees in ``order``; else ``difflib``'s, up to :data:`MAX_ALIGNED_EVENTS` (``None`` beyond)."""
    prefix = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    suffix = next((i for i, (x, y) in enumerate(zip(reversed(ta), reversed(tb))) if x != y), min(len(ta), len(tb)))
    extra = len(tb) - len(ta)
    if extra >= 0 and prefix + suffix >= len(ta):
        # Any point between len(ta) - suffix and prefix gives the same sizes. Of those that keep the most frees in
        # order, the first: a kept block then follows the run, and where it frees what the run handed on tells each
        # copy where to free the one before it (:class:`_Run`). The last put Qwen3-4B SFT's 3-block backward peak (8 x
        # 1024) 40 MiB below its trace, and its 36-block reserved figure 0.4% above a whole trace; the first: equal.
        points = range(max(len(ta) - suffix, 0), min(prefix, len(ta)) + 1)
        at = order.fewest_mismatches(points, extra) if extra and len(points) > 1 else prefix
        return [("equal", 0, at, 0, at), ("insert", at, at, at, at + extra), ("equal", at, len(ta), at + extra, len(tb))]
    if len(tb) > MAX_ALIGNED_EVENTS:
        return None
    return difflib.SequenceMatcher(None, ta, tb, autojunk=False).get_opcodes()


def phase_peaks(log: PhasedLog) -> dict[str, int]:
    """The highest live bytes in each phase of ``log`` (what is live when a phase starts counts for it)."""
    live: dict[Any, int] = {}
    level = 0
    peaks: dict[str, int] = {}
    for phase, start, end in log.segments():
        top = level
        for sign, key, nbytes in log.events[start:end]:
            if sign > 0:
                level += nbytes - live.pop(key, 0)
                live[key] = nbytes
                top = max(top, level)
            else:
                level -= live.pop(key, 0)
        peaks[phase] = max(peaks.get(phase, 0), top)
    return peaks
