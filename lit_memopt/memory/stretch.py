"""A long loop's allocations and frees, made from three short runs of it instead of traced step by step.

A generation recipe's rollout is a loop: one decoding step per new token, each the same ops on a KV cache one token
longer. Traced on fake tensors it costs a few hundred milliseconds per token on a 2-core CPU, so the 3,072-token
rollouts of the Qwen2.5-1.5B Intuitor recipe made one estimate take about half an hour. The memory of such a loop
has a simple shape: the ops of every step after the first two are the same, and the size of each allocation grows
by a fixed number of bytes per step (the cache, the attention mask, the sequences). ``memory.replay`` runs the loop
at :data:`PROBE_STEPS` steps, recording each run's allocations and frees and where each step starts; this module
builds from those records the events of the loop at any length and checks them before use:

- the events before the first step, and of steps 0 (the prompt) and 1, are the same in every probe;
- every later step but the last has the same allocations and frees (which earlier step's storage each free
  releases, counted back from the step), with sizes on one line in the step number;
- the last step (with what the loop frees on its way out) and the output's slot, size and layout are on one line
  in the step count, taken from the first two probes;
- the events the template makes for the third probe's length are that probe's own, event for event, as are its
  output and sampled tokens. Anything else is refused, and the loop is traced in full.

Replaying the made events through the tracker gives the same numbers as tracing the loop (tested on the tiny
Intuitor recipe at several lengths: peak, reserved peak, phase peaks and breakdowns equal).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lit_memopt._compat.torch import disable_current_modes

__all__ = ["PROBE_STEPS", "Recording", "Template", "template_from_probes"]

# The loop lengths a template is made from: 2 steps that are always the same (prompt, first decode), at least 3 steps
# on the line (to check it), the last step; the third probe checks what the first two predict.
PROBE_STEPS = (6, 7, 8)

# (+1, slot, bytes, device) an allocation, (-1, slot, 0, None) a free, (0, slot, 0, None) where a log segment starts
Event = tuple[int, int, int, Any]


@dataclass(frozen=True)
class Recording:
    """What a region did: ``(+1, slot, bytes counted, device)`` / ``(-1, slot, 0, None)`` per allocation and free, in
    order, the slot, storage size and layout of its output, the output's followed values, and the tokens it sampled."""

    events: Any  # an iterable of Event (a stretched loop's are made as they are read)
    out_slot: int
    out_bytes: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    value: torch.Tensor | None
    sampled_tokens: int


def _relative(events: Sequence[Event], made_before: int) -> list[Event]:
    """Events with slots counted from the first storage made in them (a free of an earlier one is negative)."""
    return [(sign, slot - made_before, nbytes, device) for sign, slot, nbytes, device in events]


def _emit(events: Sequence[Event], made_before: int) -> Iterator[Event]:
    for sign, slot, nbytes, device in events:
        yield sign, slot + made_before, nbytes, device


def _made(events: Sequence[Event]) -> int:
    return sum(1 for e in events if e[0] > 0)


def _shape_of(events: Sequence[Event]) -> list[tuple[int, int, Any]]:
    return [(sign, slot, device) for sign, slot, _, device in events]


def _line(a: Sequence[int], b: Sequence[int], steps: int) -> tuple[int, ...]:
    """The values ``steps`` past ``b`` on the line through ``a`` (one step before) and ``b``."""
    return tuple(y + (y - x) * steps for x, y in zip(a, b))


class Template:
    """The events of a loop at any step count ``n >= 3`` (see the module docstring)."""

    def __init__(self, head: list[Event], step: list[Event], growth: list[int], last: tuple[list[Event], list[Event]],
                 first: int, outputs: tuple[Recording, Recording], value_slice: tuple[int, torch.Tensor] | None) -> None:
        self.head = head  # before the first step, and steps 0 and 1 (relative to slot 0)
        self.step = step  # step 2 (relative to its first storage)
        self.growth = growth  # bytes each of its events grows by per step
        self.last = last  # the last step with the loop's exit, at the first two probes' lengths (relative)
        self.first = first  # the first probe's step count
        self.outputs = outputs  # the first two probes' recordings (output slot, size, layout, sampled tokens)
        self.value_slice = value_slice  # (dimension, the slice each step appends) of the output's followed values

    def events(self, n: int) -> Iterator[Event]:
        made = 0
        yield from _emit(self.head, made)
        made += _made(self.head)
        per_step = _made(self.step)
        for j in range(2, n - 1):
            grow = j - 2
            for (sign, slot, nbytes, device), g in zip(self.step, self.growth):
                yield sign, slot + made, nbytes + g * grow, device
            made += per_step
        a, b = self.last
        past = n - self.first - 1  # steps past the second probe's length
        for (sign, _, _, device), (_, s0, b0, _), (_, s1, b1, _) in zip(a, a, b):
            slot, nbytes = _line((s0, b0), (s1, b1), past)
            yield sign, slot + made, nbytes, device

    def recording(self, n: int) -> Recording:
        """The loop's recording at ``n`` steps (its events made as they are read)."""
        a, b = self.outputs
        past = n - self.first - 1
        (out_slot, out_bytes, offset, sampled), shape, stride = (
            _line((a.out_slot, a.out_bytes, a.offset, a.sampled_tokens), (b.out_slot, b.out_bytes, b.offset, b.sampled_tokens), past),
            _line(a.shape, b.shape, past), _line(a.stride, b.stride, past))
        value = None
        if self.value_slice is not None and b.value is not None:
            dim, piece = self.value_slice
            with disable_current_modes():
                value = torch.cat([b.value, *([piece] * past)], dim=dim) if past > 0 else b.value.narrow(
                    dim, 0, b.value.shape[dim] + past * piece.shape[dim])
        return Recording(_Events(self, n), out_slot, out_bytes, shape, stride, offset, a.dtype, value, sampled)


class _Events:
    """A stretched loop's events, made each time they are read (hundreds of thousands for a long rollout)."""

    def __init__(self, template: Template, n: int) -> None:
        self.template, self.n = template, n

    def __iter__(self) -> Iterator[Event]:
        return self.template.events(self.n)


def _split(events: Sequence[Event], starts: list[int]) -> tuple[list[Event], list[list[Event]]]:
    """``(head, steps)``: the events before step 2 and each later step, relative to its first storage."""
    bounds = [*starts, len(events)]
    head = list(events[:starts[2]])
    steps, made = [], _made(head)
    for j in range(2, len(starts)):
        part = events[bounds[j]:bounds[j + 1]]
        steps.append(_relative(part, made))
        made += _made(part)
    return head, steps


def template_from_probes(counts: Sequence[int], probes: Sequence[tuple[Recording, list[int]]]) -> tuple[Template | None, str]:
    """The template of a loop run at ``counts`` steps (consecutive, the first >= 6), each recorded with the event index
    where each of its steps started; or ``None`` and why not."""
    split = []
    for n, (rec, starts) in zip(counts, probes):
        if len(starts) != n:
            return None, f"its marker ran {len(starts)} times in {n} steps"
        split.append(_split(list(rec.events), starts))
    (head, steps), (head_b, steps_b), _ = split
    if head != head_b:
        return None, "its first steps differ between runs of different lengths"
    middle = steps[:-1]  # steps 2 .. n-2 of the first probe
    if len(middle) < 3 or any(_shape_of(s) != _shape_of(middle[0]) for s in middle):
        return None, "its steps do not repeat the same allocations and frees"
    growth = [b[2] - a[2] for a, b in zip(middle[0], middle[1])]
    for j, s in enumerate(middle):
        if [e[2] for e in s] != [e[2] + g * j for e, g in zip(middle[0], growth)]:
            return None, "its steps' sizes do not grow by the same bytes each step"
    last_a, last_b = steps[-1], steps_b[-1]
    if [(e[0], e[3]) for e in last_a] != [(e[0], e[3]) for e in last_b]:
        return None, "its last step differs between runs of different lengths"
    a, b, c = (rec for rec, _ in probes)
    value_slice = None
    if (a.value is None) != (b.value is None) or (b.value is None) != (c.value is None):
        return None, "its output's values are followed at one length and not another"
    if a.value is not None:
        grown = [d for d, (x, y) in enumerate(zip(a.value.shape, b.value.shape)) if x != y]
        if len(grown) != 1:
            return None, "its output does not grow along one dimension"
        dim = grown[0]
        with disable_current_modes():
            piece = b.value.narrow(dim, a.value.shape[dim], b.value.shape[dim] - a.value.shape[dim]).clone()
            if not torch.equal(b.value.narrow(dim, 0, a.value.shape[dim]), a.value):
                return None, "its output's values change with its length"
        value_slice = (dim, piece)
    template = Template(head, middle[0], growth, (last_a, last_b), counts[0], (a, b), value_slice)
    # What the template makes for the third probe's length must be that probe, event for event.
    made = template.recording(counts[2])
    if list(made.events) != list(c.events):
        return None, f"its events at {counts[2]} steps are not those the shorter runs predict"
    same = (made.out_slot, made.out_bytes, made.shape, made.stride, made.offset, made.sampled_tokens) == (
        c.out_slot, c.out_bytes, c.shape, c.stride, c.offset, c.sampled_tokens)
    with disable_current_modes():
        same = same and (c.value is None or torch.equal(made.value, c.value))
    if not same:
        return None, f"its output at {counts[2]} steps is not the one the shorter runs predict"
    return template, ""
