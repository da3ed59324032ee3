"""Block extrapolation: trace a decoder with 1 and 2 blocks, check linearity at 3, scale to all of them.

A decoder is a stack of identical blocks; every quantity of a training step that a block adds (its
weights, gradients and optimizer states, the activations it keeps, its KV cache in generation) is the
same for each block, so each phase's peak and its breakdown are affine in the number of blocks
``N``: ``f(N) = f(1) + (N - 1) * (f(2) - f(1))``. Tracing 1 and 2 blocks therefore gives the numbers
for 36 exactly, as long as the peak of each phase stays at the same point of the step, which a third
trace (3 blocks) checks: when it does not agree, the caller falls back to a full trace. The allocator's reserved
figure is not affine (rounding, and slack that moves between phases), so it is replayed from the whole step's
allocation log, stitched from the probes' logs (``memory.stitch``) and checked against the exact figures.

The module is built once with the largest block count needed; smaller counts are obtained by
truncating its ``layers`` lists (and the configs that say how many there are), so a module whose
constructor does real work (GRADE trains a small reward classifier) is built once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from lit_memopt.memory.forked import ForkedCall, ForkedCallFailed, can_fork
from lit_memopt.memory.step import PeakEstimate, estimate_peak, reserved_peaks
from lit_memopt.memory.stitch import BlockStitch, phase_peaks
from lit_memopt.memory.tracker import ModuleMemory

__all__ = ["count_blocks", "truncated_blocks", "extrapolate", "estimate_with_blocks", "stitched_reserved", "LinearityError",
           "PROBE_BLOCKS", "CHECK_BLOCKS", "SHIFTED_PROBE_BLOCKS", "SHIFTED_CHECK_BLOCKS", "LINEARITY_TOLERANCE",
           "STITCH_TOLERANCE"]

PROBE_BLOCKS = (1, 2)
CHECK_BLOCKS = 3
# Where the 1-block trace is off the line (its peak falls elsewhere), the window moves up one block.
SHIFTED_PROBE_BLOCKS = (2, 3)
SHIFTED_CHECK_BLOCKS = 4
# Relative disagreement allowed at the check point. Live bytes are integers that are exactly affine
# for a stack of identical blocks; the tolerance only absorbs a block count that changes a chunk size.
LINEARITY_TOLERANCE = 0.001
# A stitched allocation log (``memory.stitch``) replaces the line's reserved figure only where its replay at the
# check trace's block count is within this share of that trace's own reserved figure (measured at 3 blocks: 0 for
# Qwen3-4B SFT and GRADE, Qwen3 GRPO and Qwen2.5-1.5B Intuitor), every phase's allocated peak is the traced one there,
# and at the target's block count none is below its line and the step's peak is the line's (``_phases_bounded``).
STITCH_TOLERANCE = 0.01


class LinearityError(ValueError):
    """The check trace disagrees with the line through the probes: the step is not affine in the blocks."""


def _block_lists(module: torch.nn.Module, built: int) -> list[tuple[torch.nn.Module, str, torch.nn.ModuleList]]:
    """Every ``layers`` ModuleList of ``built`` blocks in ``module`` (policy, reference models), with its owner.

    Lists of another length (a small reward classifier's layers) do not follow the model's block count.
    """
    found = []
    for owner in module.modules():
        layers = dict(owner.named_children()).get("layers")
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == built:
            found.append((owner, "layers", layers))
    return found


def count_blocks(module: torch.nn.Module, built: int) -> int:
    """How many decoders of ``built`` blocks ``module`` holds (0: block extrapolation does not apply)."""
    return len(_block_lists(module, built))


@contextlib.contextmanager
def truncated_blocks(module: torch.nn.Module, keep: int, built: int) -> Iterator[torch.nn.Module]:
    """Within the block, every decoder of ``built`` blocks in ``module`` keeps its first ``keep`` (restored after).

    The transformers configs that say how many layers there are (``num_hidden_layers``, ``layer_types``)
    are truncated alike, since the decoders iterate ``layers[: config.num_hidden_layers]``.
    """
    lists = _block_lists(module, built)
    saved_lists = [(owner, name, layers) for owner, name, layers in lists]
    configs: dict[int, tuple[Any, dict[str, Any]]] = {}
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "num_hidden_layers", None) == built and id(config) not in configs:
            configs[id(config)] = (config, {k: getattr(config, k) for k in ("num_hidden_layers", "layer_types") if hasattr(config, k)})
    try:
        for owner, name, layers in lists:
            setattr(owner, name, torch.nn.ModuleList(list(layers)[:keep]))
        for config, values in configs.values():
            config.num_hidden_layers = min(keep, values["num_hidden_layers"])
            if isinstance(values.get("layer_types"), list):
                config.layer_types = values["layer_types"][:keep]
        yield module
    finally:
        for owner, name, layers in saved_lists:
            setattr(owner, name, layers)
        for config, values in configs.values():
            for key, value in values.items():
                setattr(config, key, value)


def _line(values: Sequence[int], at: Sequence[int], n: int) -> int:
    (a, b), (fa, fb) = at, values
    return int(fa + (fb - fa) * (n - a) // (b - a))


def extrapolate(estimates: Sequence[PeakEstimate], blocks: Sequence[int], num_blocks: int) -> PeakEstimate:
    """The estimate for ``num_blocks`` blocks from two traces with ``blocks`` blocks (affine in the count)."""
    e1, e2 = estimates
    phases = [p for p in e2.phase_breakdowns if p in e1.phase_breakdowns]
    phase_breakdowns = {
        p: {k: _line((e1.phase_breakdowns[p].get(k, 0), e2.phase_breakdowns[p].get(k, 0)), blocks, num_blocks)
            for k in e2.phase_breakdowns[p]}
        for p in phases
    }
    phase_peaks = {p: sum(b.values()) for p, b in phase_breakdowns.items()}
    peak_phase = max(phase_peaks, key=lambda p: phase_peaks[p]) if phase_peaks else e2.peak_phase
    rows_1 = {m.name: m for m in e1.modules}
    modules = []
    for m in e2.modules:
        o = rows_1.get(m.name, dataclasses.replace(m, count=0, parameter_bytes=0, activation_bytes=0))
        modules.append(ModuleMemory(
            m.name,
            _line((o.count, m.count), blocks, num_blocks),
            _line((o.parameter_bytes, m.parameter_bytes), blocks, num_blocks),
            _line((o.activation_bytes, m.activation_bytes), blocks, num_blocks),
            m.forward_peak_bytes, m.backward_peak_bytes, m.is_leaf,
        ))
    modules.sort(key=lambda m: (m.activation_bytes, m.forward_peak_bytes), reverse=True)
    reserved = least = None
    if e1.reserved_peak_bytes is not None and e2.reserved_peak_bytes is not None:
        reserved = max(_line((e1.reserved_peak_bytes, e2.reserved_peak_bytes), blocks, num_blocks), 0)
    if e1.least_reserved_bytes is not None and e2.least_reserved_bytes is not None:
        least = max(_line((e1.least_reserved_bytes, e2.least_reserved_bytes), blocks, num_blocks), 0)
    peak = phase_peaks.get(peak_phase, e2.peak_bytes)
    return dataclasses.replace(
        e2,
        peak_bytes=peak,
        breakdown=dict(phase_breakdowns.get(peak_phase, e2.breakdown)),
        peak_phase=peak_phase,
        phase_peaks=phase_peaks,
        phase_breakdowns=phase_breakdowns,
        modules=modules,
        seconds=e1.seconds + e2.seconds,
        reserved_peak_bytes=None if reserved is None else max(reserved, peak),
        least_reserved_bytes=None if least is None else max(least, peak),
        num_blocks=num_blocks,
        offloaded_bytes=max(_line((e1.offloaded_bytes, e2.offloaded_bytes), blocks, num_blocks), 0),
        allocation_log=None,
    )


def _check_line(traces: dict[int, PeakEstimate], probes: Sequence[int], at: int) -> None:
    """Raise ``LinearityError`` unless every phase peak of ``traces[at]`` is on the line through ``probes``."""
    predicted = extrapolate([traces[k] for k in probes], probes, at)
    for phase, value in traces[at].phase_peaks.items():
        line = predicted.phase_peaks.get(phase)
        if line is None or abs(line - value) > LINEARITY_TOLERANCE * max(value, 1):
            raise LinearityError(
                f"the {phase} peak with {at} blocks is {value} bytes, the line through {tuple(probes)} blocks says {line}"
            )


def _phases_agree(log_peaks: dict[str, int], exact: dict[str, int]) -> bool:
    return all(abs(log_peaks.get(phase, -1) - value) <= LINEARITY_TOLERANCE * max(value, 1) for phase, value in exact.items())


def _phases_bounded(log_peaks: dict[str, int], line: dict[str, int]) -> bool:
    """Whether a log stitched past the probes agrees with the extrapolated phase peaks: none below its line, and the
    step's peak the line's. A phase's peak is the highest of its events' live bytes, each affine in the block count:
    past the probes it can leave the line through them upward, where another event takes the top (GRPO on
    Qwen3-0.6B: the backward phase of 28 blocks peaks at 6.45 GiB when it starts, where the line through 1 and 2
    blocks reads 6.13; a trace of all 28 blocks says 6.45), never downward. The step's peak is what the estimate
    reports, so a log whose peak passes it is not taken."""
    tol = LINEARITY_TOLERANCE
    if any(log_peaks.get(phase, -1) < value - tol * max(value, 1) for phase, value in line.items()):
        return False
    top, step = max((log_peaks.get(phase, 0) for phase in line), default=0), max(line.values(), default=0)
    return abs(top - step) <= tol * max(step, 1)


def _checked_stitch(traces: dict[int, PeakEstimate], probes: Sequence[int], checked_at: int | None,
                    device_bytes: int | None) -> BlockStitch | str:
    """The probes' logs stitched (``memory.stitch``), checked against the check trace where there is one (its phase
    peaks, and its reserved figure within :data:`STITCH_TOLERANCE`); or why not (a phrase)."""
    low, high = (traces[k].allocation_log for k in probes)
    if low is None or high is None:
        return "the probes kept no allocation log"
    stitch = BlockStitch(low, high)
    if checked_at is not None:
        at_check = stitch.log((checked_at - probes[0]) // (probes[1] - probes[0]))
        check = traces[checked_at]
        if at_check is None:
            return "the probes' logs did not align"
        if not _phases_agree(phase_peaks(at_check), check.phase_peaks):
            return f"the log stitched to {checked_at} blocks has other phase peaks than its trace"
        traced = check.reserved_peak_bytes
        replayed, _ = reserved_peaks(at_check.events, device_bytes, least=False)
        if traced is None or abs(replayed - traced) > STITCH_TOLERANCE * max(traced, 1):
            return f"the log stitched to {checked_at} blocks replays to {replayed} reserved bytes, its trace to {traced}"
    return stitch


def _affine_window(stitch: BlockStitch, probes: Sequence[int], num_blocks: int) -> int | None:
    """The fewest blocks ``n`` (past the probes, a step of blocks apart) from which the stitched logs' phase peaks run on
    a line to ``num_blocks``: the line through ``n`` and the next count gives every phase peak of the
    ``num_blocks``-block log. ``None`` where no such ``n`` is short of ``num_blocks``."""
    step = probes[1] - probes[0]

    def peaks(n: int) -> dict[str, int] | None:
        log = stitch.log((n - probes[0]) // step)
        return None if log is None else phase_peaks(log)

    target = peaks(num_blocks)
    if target is None:
        return None
    n, here = probes[1], peaks(probes[1])
    while n + step < num_blocks and here is not None:
        after = peaks(n + step)
        if after is None:
            return None
        line = {p: _line((here.get(p, 0), after.get(p, 0)), (n, n + step), num_blocks) for p in target}
        if _phases_agree(line, target):
            return n
        n, here = n + step, after
    return None


def _moved_window(stitch: BlockStitch, traces: dict[int, PeakEstimate], probes: Sequence[int], num_blocks: int,
                  trace: Callable[[int], PeakEstimate], device_bytes: int | None
                  ) -> tuple[PeakEstimate, tuple[int, int | None], tuple[int, int]] | None:
    """Where the line through the probes misses a phase peak of the whole step that their checked stitched log has (a
    rank's backward peaks at the head's temporaries with few blocks and on the blocks' activations with many), two
    more traces where the stitched log (checked: :func:`_checked_stitch`) is on a line (:func:`_affine_window`) give the
    estimate: ``(estimate, (reserved, least device), window)``, or ``None``. The window's traces must have their
    stitched logs' phase peaks, and the line through them the whole step's."""
    start = _affine_window(stitch, probes, num_blocks)
    if start is None:
        return None
    step = probes[1] - probes[0]
    window = (start, start + step)
    for k in window:
        if k not in traces:
            traces[k] = trace(k)
        at_k = stitch.log((k - probes[0]) // step)
        if at_k is None or not _phases_agree(phase_peaks(at_k), traces[k].phase_peaks):
            return None
    result = extrapolate([traces[k] for k in window], window, num_blocks)
    target = stitch.log((num_blocks - probes[0]) // step)
    if target is None or not _phases_agree(phase_peaks(target), result.phase_peaks):
        return None
    return result, reserved_peaks(target.events, device_bytes), window


def stitched_reserved(traces: dict[int, PeakEstimate], probes: Sequence[int], checked_at: int | None, num_blocks: int,
                      line: PeakEstimate, device_bytes: int | None, *,
                      stitch: BlockStitch | str | None = None) -> tuple[int, int | None] | str:
    """The reserved peak (and least device, given ``device_bytes``) of ``num_blocks`` blocks from the probes'
    allocation logs stitched into that step's log (``memory.stitch``) and replayed; or, where that is not trusted,
    why (a phrase).

    Trusted where the stitched log's allocated peaks agree with ``line``'s (block extrapolation: see
    :func:`_phases_bounded`) and, with a check trace (``checked_at``), the log stitched to its block count has that
    trace's phase peaks and a reserved figure within :data:`STITCH_TOLERANCE` of it. ``stitch``: that check's result
    when the caller made it already (:func:`_checked_stitch`).
    """
    if stitch is None:
        stitch = _checked_stitch(traces, probes, checked_at, device_bytes)
    if isinstance(stitch, str):
        return stitch
    target = stitch.log((num_blocks - probes[0]) // (probes[1] - probes[0]))
    if target is None:
        return "the probes' logs did not align"
    if not _phases_bounded(phase_peaks(target), line.phase_peaks):
        return f"the log stitched to {num_blocks} blocks has other phase peaks than the extrapolation"
    return reserved_peaks(target.events, device_bytes)


def _import_what_a_trace_imports(module: torch.nn.Module) -> None:
    """Import here, before forking, what a trace imports on first use, so that the forked copy inherits it.

    ``configure_optimizers`` (called by every trace) reaches transformers' learning-rate schedulers, whose import pulls
    in peft: about 250 modules, 0.6 s, which the copy would import again on the critical path of the estimate.
    """
    import lit_memopt.memory.allocator  # noqa: F401 - the reserved-memory model, imported by each trace

    try:
        module.configure_optimizers()
    except Exception:  # noqa: BLE001 - the trace calls it again and reports what went wrong there
        pass


def estimate_with_blocks(
    module: torch.nn.Module | None,
    batch: Any,
    num_blocks: int,
    *,
    built_blocks: int = CHECK_BLOCKS,
    check: bool = True,
    parallel: bool = False,
    period: int = 1,
    build: Callable[[int], torch.nn.Module] | None = None,
    require_stitch: bool = False,
    **kwargs: Any,
) -> PeakEstimate:
    """:func:`estimate_peak` of ``module`` as if it had ``num_blocks`` blocks, from traces of 1 and 2 (and 3).

    ``module`` was built with ``built_blocks`` blocks per decoder (3; 2 is enough when ``check=False``;
    with 4, a 3-block trace off the line through 1 and 2 gets a second chance: probes 2 and 3, checked with 4).
    ``parallel=True`` runs the largest trace (the check, or the second probe when ``check=False``) in a
    forked copy of the process while this one runs the others (``memory.forked``; where forking is
    unsafe, or the copy fails, it runs here after them). Keyword arguments go to :func:`estimate_peak`.

    ``build``: ``blocks -> module`` built with that many blocks, for each trace, instead of truncating ``module`` (then
    ``None``): a module whose blocks cannot be dropped after it was built (sharded by FSDP2, which keeps its blocks'
    states from its first forward on).

    ``require_stitch``: the stitched log must check out, or :class:`LinearityError` is raised (trace the whole model):
    for a step whose phase peak can move to another point of the phase past the probes (a sharded rank: its backward
    peaks at the head's temporaries with few blocks, on the blocks' activations with 36), which the stitched log sees
    and the line through the probes does not.

    ``period``: the blocks repeat in groups of ``period`` (every ``period``-th block checkpointed): every trace
    count above is multiplied by it (probes ``period`` and ``2 * period``, checked with ``3 * period``; built with
    that many), and ``num_blocks`` must be a multiple of it.

    The reserved figure (and, with ``device_bytes``, ``least_reserved_bytes``) is the replay of the probes'
    allocation logs stitched into the ``num_blocks``-block step's (:func:`stitched_reserved`), where that log checks
    out; else the line through the probes' figures, and ``method`` says which. Where it passes the device,
    :func:`memory.step.within_device` says what the step does there; that is left to the caller, who knows whether the
    device holds this step or one rank's share of it.

    Raises:
        LinearityError: the 3-block trace disagrees with the line through 1 and 2 blocks (by more
            than ``LINEARITY_TOLERANCE`` in a phase's peak), and, when built with 4, the 4-block trace
            with the line through 2 and 3: trace the whole model instead.
        ValueError: the module has fewer blocks than the traces need, or ``num_blocks`` is not a multiple of
            ``period``.
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1 or num_blocks % period:
        raise ValueError(f"estimate_with_blocks: period must be a positive integer dividing num_blocks={num_blocks}, "
                         f"got {period!r}")
    p = period
    probe_blocks, check_blocks = tuple(k * p for k in PROBE_BLOCKS), CHECK_BLOCKS * p
    shifted_probes, shifted_check = tuple(k * p for k in SHIFTED_PROBE_BLOCKS), SHIFTED_CHECK_BLOCKS * p
    need = check_blocks if check else max(probe_blocks)
    if build is None and (module is None or built_blocks < need or count_blocks(module, built_blocks) == 0):
        raise ValueError(
            f"estimate_with_blocks: the module needs decoders built with at least {need} blocks (a `layers` list "
            f"of length built_blocks={built_blocks}); none found"
        )

    # Each trace keeps its allocation log: the probes' are stitched into the whole step's (the reserved figure).
    keep_log = kwargs.get("model_allocator", True)

    def trace(k: int) -> PeakEstimate:
        if build is not None:
            return estimate_peak(build(k), batch, keep_allocation_log=keep_log, **kwargs)
        with truncated_blocks(module, k, built_blocks):
            return estimate_peak(module, batch, keep_allocation_log=keep_log, **kwargs)

    counts = (*probe_blocks, check_blocks) if check else probe_blocks
    # The traces are independent: the largest goes to a forked copy of this process while the others
    # run here (two cores busy; a third process on a 2-core machine measured slower, not faster).
    largest = counts[-1]
    forking = parallel and can_fork()
    if forking and module is not None:
        _import_what_a_trace_imports(module)
    child = ForkedCall(lambda: trace(largest)) if forking else None
    started = time.perf_counter()
    try:
        traces = {k: trace(k) for k in counts[:-1]}
    except BaseException:
        if child is not None:  # this process's trace failed: the copy's result would be thrown away
            child.cancel()
        raise
    if child is not None:
        try:
            # It has one block more than the largest trace here: the margin absorbs a busy machine.
            traces[largest] = child.result(timeout=60 + 3 * (time.perf_counter() - started))
        except ForkedCallFailed:
            pass
    if largest not in traces:
        traces[largest] = trace(largest)
    probes, checked_at, kink = probe_blocks, check_blocks, ""
    if check:
        try:
            _check_line(traces, probe_blocks, check_blocks)
        except LinearityError as first:
            # A 1-block step can peak somewhere else than every longer stack (measured: a LoRA 7B
            # model's forward peak), a kink the line through 1 and 2 blocks cannot see. Moving the
            # window up one block keeps the same check: probes 2 and 3, checked with 4.
            if build is None and built_blocks < shifted_check:
                raise
            traces[shifted_check] = trace(shifted_check)
            try:
                _check_line(traces, shifted_probes, shifted_check)
            except LinearityError as second:
                raise LinearityError(f"{first}; and {second}") from None
            probes, checked_at, kink = shifted_probes, shifted_check, f"; the {p}-block trace peaked off that line"
    method = f"blocks traced: {probes[0]} and {probes[1]}, extrapolated to {num_blocks}"
    if check:
        method += f" (linear in the block count: checked with a trace of {checked_at}{kink})"
    result = extrapolate([traces[k] for k in probes], probes, num_blocks)
    if keep_log:
        device_bytes = kwargs.get("device_bytes")
        stitch = _checked_stitch(traces, probes, checked_at if check else None, device_bytes)
        stitched = stitched_reserved(traces, probes, checked_at if check else None, num_blocks, result, device_bytes,
                                     stitch=stitch)
        if isinstance(stitched, str) and build is not None and not isinstance(stitch, str):
            moved = _moved_window(stitch, traces, probes, num_blocks, trace, device_bytes)
            if moved is not None:
                result, stitched, window = moved
                method = (f"blocks traced: {window[0]} and {window[1]}, extrapolated to {num_blocks} (the log stitched from "
                          f"traces of {probes[0]} and {probes[1]} blocks" + (f", checked with {checked_at}," if check else "")
                          + f" runs on that line from {window[0]} blocks on, not from {probes[0]}: each phase peak agrees)")
        if isinstance(stitched, str):
            if require_stitch:
                raise LinearityError(f"the stitched allocation log did not check out: {stitched}")
            method += f"; reserved: the line through the probes ({stitched})"
        else:
            reserved, least = stitched
            result.reserved_peak_bytes = max(reserved, result.peak_bytes)
            result.least_reserved_bytes = None if least is None else max(least, result.peak_bytes)
            method += (f"; reserved: the {num_blocks}-block allocation log stitched from the probes' and replayed"
                       + (f" (checked with the {checked_at}-block trace)" if check else ""))
    # The reserved figure may pass a device size the probes had (device_bytes): memory.step.within_device judges it
    # where the device applies (one device here, or each rank after memory.sharding).
    result.method = method
    result.seconds = sum(t.seconds for t in traces.values())
    return result
