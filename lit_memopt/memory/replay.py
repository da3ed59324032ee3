"""Regions of a fake-tensor step that every trace of a plan runs alike: traced once, replayed after that.

``lit-memopt plan`` traces one recipe many times: per checkpointing setting, activation offload and micro-batch.
In a generation recipe most of each trace is its rollouts, token by token on fake tensors (nine tenths of a CRSP
trace), and none of those settings changes them: generation runs under no gradient, in eval mode, on the batch's
prompts. A module marks such a call with :func:`shared_region`; under :func:`sharing_regions` (entered by
:func:`~lit_memopt.memory.step.estimate_peak` when given a :class:`SharedRegions`) the first call with a given key
runs and records, through the tracker, every allocation and free it made, in order; a later call with the same key,
in this trace or another, hands the tracker the same allocations and frees in the same order as bookkeeping
(``StepTracker.replay_update``; only the output is made as a fake tensor) and returns a tensor of the recorded
output's layout (with its followed values, ``memory.worst_case``). The live bytes, the peaks
of each phase and the allocation log that the reserved-memory model replays are then the ones the region would give:
the same numbers at a small share of the cost (the tiny CRSP recipe's proposer rollout, one block: 28,259 allocations
and frees, traced in 19.9 s, replayed in 0.36 s on a 2-core CPU). Per-module rows (``PeakEstimate.modules``) do not
see a replayed region's module calls.

What keeps this exact is the key and what a recording must be. The key is the region's name, the phase it runs in,
every input tensor's layout and followed values, and what the caller adds (its arguments, the model's
:func:`module_fingerprint`: parameter shapes and dtypes, config, active adapters). A region is recorded only when it
frees nothing it did not allocate, changes no storage's size or category, and leaves exactly one new storage
alive: its output tensor's. Anything else (a cache kept on the model, an input freed) is *refused*: that key runs in
full every time, as without sharing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from lit_memopt._compat.torch import disable_current_modes
from lit_memopt.memory.stretch import PROBE_STEPS, Recording as _Recording, Template as _Template, template_from_probes

__all__ = ["Repeats", "SharedRegions", "shared_region", "sharing_regions", "module_fingerprint"]

_ACTIVE: contextvars.ContextVar["_Scope | None"] = contextvars.ContextVar("lit_memopt_shared_regions", default=None)


class _StandIn:
    """What the tracker reads of a storage's record, for an allocation replayed without a tensor."""

    __slots__ = ("device", "reftype", "mem_consumed")

    def __init__(self, device: Any, reftype: Any, mem_consumed: int) -> None:
        self.device, self.reftype, self.mem_consumed = device, reftype, mem_consumed


class SharedRegions:
    """The recordings that the traces of one plan share (see the module docstring), with counts of what happened.

    Args:
        share: replay a recording for a later call with the same key (``False``: every call runs, or is stretched).
        stretch: stretch a long loop (:class:`Repeats`) from short probes instead of running it.

    Attributes:
        recorded: regions traced and recorded.
        replayed: regions replayed from a recording.
        stretched: loops replayed at their full length from a template of short probes.
        refused: why a region could not be recorded or stretched, one line per key (that key then always runs in
            full).
    """

    def __init__(self, *, share: bool = True, stretch: bool = True) -> None:
        self._recordings: dict[Hashable, _Recording | None] = {}
        self._templates: dict[Hashable, _Template | None] = {}
        self.share = share
        self.stretch = stretch
        self.recorded = 0
        self.replayed = 0
        self.stretched = 0
        self.refused: list[str] = []

    def __len__(self) -> int:
        return sum(r is not None for r in self._recordings.values())


def module_fingerprint(module: torch.nn.Module) -> tuple:
    """What a module's memory in a region depends on, beyond its inputs: its class and mode, every parameter's and
    buffer's shape, dtype and ``requires_grad``, which submodules checkpoint their activations, its config and
    generation config, and (peft) its active adapters.

    Why the checkpointing flags and the whole config count: transformers' activation checkpointing turns ``use_cache``
    off in the config (though the call passes ``use_cache=True``) and marks the embedding output as requiring grad,
    even in a rollout (which once kept one embedding output per token alive in the tracker's hooks: fixed in
    ``_compat.mem_tracker``)."""
    parts: list[Any] = [type(module).__qualname__, module.training]
    parts.append(tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in module.parameters()))
    parts.append(tuple((tuple(b.shape), b.dtype) for b in module.buffers()))
    parts.append(tuple(bool(getattr(m, "gradient_checkpointing", False)) for m in module.modules()))
    for name in ("config", "generation_config"):
        config = getattr(module, name, None)
        to_dict = getattr(config, "to_dict", None)
        parts.append(repr(sorted(to_dict().items())) if callable(to_dict) else repr(config))
    adapters = getattr(module, "active_adapters", None)
    if callable(adapters):  # transformers' method (raises without peft); peft's is a property
        try:
            adapters = adapters()
        except (ValueError, AttributeError, ImportError):
            adapters = None
    parts.append(tuple(adapters) if isinstance(adapters, (list, tuple)) else repr(adapters))
    return tuple(parts)


@dataclass(frozen=True)
class Repeats:
    """A region that is a loop: ``count`` steps, each one call of ``marker`` (a generation loop: one forward of the
    input embedding per token), and ``run(k)`` the same region with ``k`` steps. See :mod:`memory.stretch`."""

    count: int
    run: Callable[[int], torch.Tensor]
    marker: torch.nn.Module


def shared_region(name: str, run: Callable[[], torch.Tensor], *, inputs: Sequence[torch.Tensor] = (),
                  key: Callable[[], Hashable] = tuple, repeats: Repeats | None = None) -> torch.Tensor:
    """``run()``; inside a trace that shares regions, the recording of an earlier call with the same key, replayed.

    Outside :func:`sharing_regions` (training, a plain estimate) this is exactly ``run()``.

    Args:
        name: what the region is (part of the key).
        run: the region: a function of no arguments returning one tensor.
        inputs: the tensors it reads; their layouts and followed values are part of the key.
        key: a function returning everything else its memory depends on, hashable (called only when sharing):
            its arguments, and :func:`module_fingerprint` of the model it runs; not ``repeats.count``.
        repeats: the region is a loop of ``repeats.count`` steps: a long one is stretched from short probes
            (:mod:`memory.stretch`) rather than traced step by step.

    Example::

        sequences = shared_region("generate", lambda: model.generate(input_ids=ids, max_new_tokens=64),
                                  inputs=(ids,), key=lambda: (64, module_fingerprint(model)))
    """
    scope = _ACTIVE.get()
    if scope is None:
        return run()
    return scope.call(name, run, inputs, key, repeats)


@contextlib.contextmanager
def sharing_regions(regions: SharedRegions, tracker: Any, values: Any = None) -> Iterator[SharedRegions]:
    """Within the block, :func:`shared_region` calls record into and replay from ``regions``, through ``tracker`` (a
    ``memory.tracker.StepTracker`` already entered) and ``values`` (the step's ``WorstCaseValues``, or ``None``)."""
    token = _ACTIVE.set(_Scope(regions, tracker, values))
    try:
        yield regions
    finally:
        _ACTIVE.reset(token)


class _Scope:
    def __init__(self, regions: SharedRegions, tracker: Any, values: Any) -> None:
        self.regions, self.tracker, self.values = regions, tracker, values

    def call(self, name: str, run: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor],
             key: Callable[[], Hashable], repeats: Repeats | None = None) -> torch.Tensor:
        regions = self.regions
        full_key = (name, self.tracker.current_phase(), tuple(self._describe(t) for t in inputs), key())
        if repeats is not None and regions.stretch and repeats.count > max(PROBE_STEPS):
            out = self._stretched(name, full_key, repeats)
            if out is not None:
                return out
        if repeats is not None:  # a loop too short to stretch, or refused: recorded and replayed at its length
            full_key = (*full_key, repeats.count)
        recordings = regions._recordings
        if full_key not in recordings or not regions.share:
            out, recording, refusal = self._record(run)
            if regions.share:
                recordings[full_key] = recording
            if recording is None:
                regions.refused.append(f"{name}: {refusal}")
            else:
                regions.recorded += 1
            return out
        recording = recordings[full_key]
        if recording is None:
            return run()
        regions.replayed += 1
        return self._replay(recording)

    def _stretched(self, name: str, full_key: Hashable, repeats: Repeats) -> torch.Tensor | None:
        """The loop at its full length, replayed from the template of its short probes (made on the first call);
        ``None`` where it has none (the probes were refused)."""
        templates = self.regions._templates
        if full_key not in templates or not self.regions.share:
            template, refusal = self._probe_template(repeats)
            if self.regions.share:
                templates[full_key] = template
            if template is None:
                self.regions.refused.append(f"{name} (stretched): {refusal}")
        else:
            template = templates[full_key]
        if template is None:
            return None
        self.regions.stretched += 1
        return self._replay(template.recording(repeats.count))

    def _probe_template(self, repeats: Repeats) -> tuple[_Template | None, str]:
        """Run the loop at each of :data:`PROBE_STEPS` steps, recording it and where each step starts, and leave the
        tracker's counts as they were (the probes are measurements, not part of the step); their template, or why
        there is none."""
        saved = self.tracker.save_counts()
        live = self._live()
        sampled = getattr(self.values, "sampled_tokens", 0)
        probes: list[tuple[_Recording, list[int]]] = []
        refusal = ""
        for k in PROBE_STEPS:
            starts: list[int] = []
            events: list[Any] = []

            def mark(module: torch.nn.Module, args: Any, starts: list[int] = starts, events: list[Any] = events) -> None:
                starts.append(len(events))

            handle = repeats.marker.register_forward_pre_hook(mark)
            try:
                out, recording, refusal = self._record(functools.partial(repeats.run, k), events)
            finally:
                handle.remove()
            del out  # freed now: the probe leaves nothing alive
            if recording is None:
                break
            probes.append((recording, starts))
        if self._live() != live:
            gc.collect()  # a reference cycle in the loop's outputs
        if self._live() != live:
            # cannot happen for a recorded probe (it leaves only its output); a refused one is not stretched anyway
            refusal = refusal or "its probes left memory alive"
            probes.clear()
        self.tracker.restore_counts(saved)
        if self.values is not None:
            self.values.sampled_tokens = sampled
        if len(probes) < len(PROBE_STEPS):
            return None, refusal
        return template_from_probes(PROBE_STEPS, probes)

    def _live(self) -> int:
        from lit_memopt.memory.tracker import snapshot_total  # (imported here, as in _record)

        return snapshot_total(self.tracker.current_snapshot)

    def _value(self, t: torch.Tensor) -> torch.Tensor | None:
        return None if self.values is None else self.values.value_of(t)

    def _describe(self, t: torch.Tensor) -> tuple:
        value = self._value(t)
        if value is not None:
            with disable_current_modes():  # real values: these copies must not become fake tensors
                value = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, str(t.device), value

    def _record(self, run: Callable[[], torch.Tensor], events: list[tuple[int, int, int, Any]] | None = None,
                ) -> tuple[torch.Tensor, _Recording | None, str]:
        # imported here: the tracker's module pulls in torch.distributed, which training a rollout does not need
        from lit_memopt._compat.mem_tracker import MemRefType, UpdateType

        events = [] if events is None else events
        live: dict[int, int] = {}  # id(tracker record) -> slot, for the storages the region made and still holds
        refusals: list[str] = []
        made = 0  # slots are numbered in the order the region made its storages

        tracker = self.tracker
        # The allocation log's segment marks (the model called once per token) are replayed too, or block stitching
        # would align a replayed rollout's log with a traced one's in vain: one made in the region is recorded before
        # the event it starts (a phase's start is not: the tracker marks it wherever the phase changes).
        marked = tracker.segment_marks

        def listen(u_type: Any, record: Any, old_bytes: Any, old_category: Any) -> None:
            nonlocal made, marked
            if tracker.segment_marks != marked:
                marked = tracker.segment_marks
                events.append((0, made, 0, None))
            if u_type == UpdateType.ADD:
                if record.reftype != MemRefType.ACT:
                    refusals.append(f"it made a {record.reftype} tensor")
                live[id(record)] = made
                events.append((1, made, record.mem_consumed, record.device))
                made += 1
            elif u_type == UpdateType.DEL:
                slot = live.pop(id(record), None)
                if slot is None:
                    refusals.append("it freed a tensor made before it")
                else:
                    events.append((-1, slot, 0, None))
            else:  # a storage resized, or re-filed under another category
                refusals.append(f"it changed a storage ({u_type})")

        sampled = getattr(self.values, "sampled_tokens", 0)
        self.tracker.listeners.append(listen)
        try:
            out = run()
        finally:
            self.tracker.listeners.remove(listen)
        if refusals:
            return out, None, refusals[0]
        if not isinstance(out, torch.Tensor):
            return out, None, f"it returned a {type(out).__name__}, not one tensor"
        record = self.tracker.storage_record(out.untyped_storage())
        if record is None or id(record) not in live:
            return out, None, "its output is not a storage it made"
        if len(live) != 1:
            return out, None, f"it left {len(live) - 1} more tensor(s) alive than its output"
        nbytes = record.size * record.element_size
        if nbytes % out.element_size():
            return out, None, "its output's storage is not a whole number of its elements"
        value = self._value(out)
        if value is not None:
            with disable_current_modes():
                value = value.detach().clone()
        recording = _Recording(tuple(events), live[id(record)], nbytes, tuple(out.shape), tuple(out.stride()),
                               out.storage_offset(), out.dtype, value,
                               getattr(self.values, "sampled_tokens", 0) - sampled)
        return out, recording, ""

    def _replay(self, recording: _Recording) -> torch.Tensor:
        # The same allocations and frees, in the same order: the tracker counts them as it counted the region's own
        # (same phase, same category; the peak checked after each allocation, as after each op), and its allocation
        # log feeds the reserved-memory model the same sizes. Only the output is a tensor: making tens of thousands
        # of fake tensors through the dispatch modes took a third of the time the region itself did.
        from lit_memopt._compat.mem_tracker import MemRefType, UpdateType

        tracker = self.tracker
        held: dict[int, Any] = {}
        out_slot, dtype = recording.out_slot, recording.dtype
        out = None
        for sign, slot, nbytes, device in recording.events:  # (a stretched loop's are made as they are read)
            if sign == 0:
                tracker.mark_segment()
            elif sign < 0:
                record = held.pop(slot)
                if record is not None:
                    tracker.replay_update(UpdateType.DEL, record)
            elif slot == out_slot:
                held[slot] = None  # a real tensor: the tracker counts it as it counts any op's output
                out = torch.empty(recording.out_bytes // dtype.itemsize, dtype=dtype, device=device)
            else:
                record = held[slot] = _StandIn(device, MemRefType.ACT, nbytes)
                tracker.replay_update(UpdateType.ADD, record)
        assert out is not None  # a recording always makes its output
        out = out.as_strided(recording.shape, recording.stride, recording.offset)
        if self.values is not None:
            if recording.value is not None:
                self.values.track(out, recording.value)
            self.values.sampled_tokens += recording.sampled_tokens
        return out
