"""Per-rank peak memory under DDP and FSDP2, from a single-device estimate: arithmetic on its phase breakdowns.

Data parallelism gives every rank the same micro-batch shape, so activations, temporaries of forward and
backward and the input batch are those of one device. What changes is the model state:

- ``ddp``: parameters, gradients and optimizer state are replicated; DDP also holds gradient buckets, a
  second copy of the trainable gradients (``gradient_as_bucket_view=False``, Lightning's default), for the
  whole run.
- ``fsdp2``: parameters, gradients and optimizer state are sharded by the world size (so are the optimizer
  step's foreach temporaries, which are parameter-sized). In forward and backward a rank also holds, whole:
  the root group (embeddings, final norm, head: FSDP2 does not reshard the root after forward), the block
  being computed and the next one (FSDP2 prefetches one all-gather ahead); in backward, the unsharded
  gradients of the current block and of the root wait for their reduce-scatter (never more than the
  gradients that exist at the backward's peak).

- ``fsdp2`` with ``cpu_offload=True`` (torch's ``CPUOffloadPolicy``, ``trainer.strategy.cpu_offload=true``): the
  sharded parameters, gradients and optimizer state live in host memory, so between uses the device holds none of
  them (``parameters``, ``gradients`` and ``optimizer_state`` rows are 0). In forward and backward the device holds
  what it gathers, whole: the root group and two blocks, as without offload, plus the local shards of those two
  blocks while they are copied in for their all-gather (``2 x block / W``, small). In backward it also holds the
  unsharded gradients awaiting their reduce-scatter (as without offload) and their reduce-scatter output, one
  shard, until it is copied out to the host. The optimizer step runs on the host (torch's CPU AdamW): its device
  bytes are 0 for model state and the update's temporaries; what is left on the device in that phase is what the
  single-device step held besides them (buffers, the batch). The host holds the shards of parameters, gradients
  and optimizer state and the step's temporaries (one rank's share: ``method`` says how much).

Mixed-precision all-gathers (``MixedPrecisionPolicy``) are not modelled: the gathered blocks count at the
parameters' dtype, which over-counts a bf16 all-gather of fp32 weights.

The reserved figure keeps the one-device trace's allocator overhead over its live bytes, as does the least device a
step needs. Where the trace had a device size (``device_bytes``: the whole model traced on the device the rank has,
whose allocator released its cache where the whole model pressed on it) a rank's figure past that size is mended
the same way as a one-device one (``memory.step.within_device``). A rank holds less than the whole model, so its
allocator may cache more than the trace's did before it has to release: its reserved peak can be above the figure
given (never above the device's size where the least device fits).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lit_memopt.memory.step import PeakEstimate, within_device

__all__ = ["STRATEGIES", "per_rank_estimate", "block_parameter_bytes", "COMMUNICATION_ROW"]

STRATEGIES = ("ddp", "fsdp2")
# The breakdown row that holds what sharding adds: gathered blocks, buckets awaiting a collective.
COMMUNICATION_ROW = "communication"


def block_parameter_bytes(estimate: PeakEstimate) -> tuple[int, int]:
    """``(largest block, all blocks)`` parameter bytes, from the per-module rows (``...layers.*`` groups)."""
    largest, total = 0, 0
    for row in estimate.modules:
        if row.name.endswith("layers.*") and row.count > 0:
            largest = max(largest, row.parameter_bytes // row.count)
            total += row.parameter_bytes
    return largest, total


def per_rank_estimate(estimate: PeakEstimate, strategy: str, world_size: int, *, cpu_offload: bool = False,
                      replicated_bytes: int = 0) -> PeakEstimate:
    """The peak of one rank of ``world_size`` data-parallel ranks, from the single-device ``estimate``.

    Args:
        estimate: a single-device estimate with its phase breakdowns (``estimate_peak`` and block
            extrapolation fill them).
        strategy: ``"ddp"`` or ``"fsdp2"``.
        world_size: data-parallel ranks (``trainer.devices * trainer.num_nodes``), >= 1.
        cpu_offload: FSDP2 with ``CPUOffloadPolicy`` (``"fsdp2"`` only; see the module docstring): the
            device's bytes; the host's are in ``method``.
        replicated_bytes: parameter bytes of frozen models the method keeps whole on every rank under FSDP2
            (a full reference copy, a reward model: ``fsdp2_replicated`` of the pack's modules); they are neither
            sharded nor offloaded, and their blocks are never gathered.

    Returns:
        A :class:`PeakEstimate` whose breakdowns are per rank (with a ``communication`` row), whose
        ``method`` says what was assumed, and whose reserved peak keeps the allocator's overhead of the
        single-device replay.

    Raises:
        ValueError: an unknown strategy, a world size below 1, an estimate without phase breakdowns, or
            ``cpu_offload`` that is not a bool or is set with a strategy other than ``"fsdp2"``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"per_rank_estimate: strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not isinstance(cpu_offload, bool):
        raise ValueError(f"per_rank_estimate: cpu_offload must be a bool, got {cpu_offload!r}")
    if cpu_offload and strategy != "fsdp2":
        raise ValueError(f"per_rank_estimate: cpu_offload is FSDP2's (CPUOffloadPolicy); strategy={strategy!r} has none")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"per_rank_estimate: world_size must be a positive integer, got {world_size!r}")
    if not estimate.phase_breakdowns:
        raise ValueError("per_rank_estimate: the estimate has no phase breakdowns to scale")
    step = estimate.phase_breakdowns.get("optimizer step") or max(estimate.phase_breakdowns.values(), key=lambda b: sum(b.values()))
    params, grads = step.get("parameters", 0), step.get("gradients", 0)
    if isinstance(replicated_bytes, bool) or not isinstance(replicated_bytes, int) or not 0 <= replicated_bytes <= params:
        raise ValueError(f"per_rank_estimate: replicated_bytes must be an integer in [0, {params}], got {replicated_bytes!r}")
    replicated = replicated_bytes if strategy == "fsdp2" else 0
    sharded = params - replicated
    trainable_share = grads / sharded if sharded else 0.0
    largest_block, all_blocks = block_parameter_bytes(estimate)
    # the frozen replicated models have the policy's architecture or none of its blocks: what is left of the block
    # rows after them is the policy's, and its root the rest of its parameters
    all_blocks = max(all_blocks - replicated, 0) if replicated else all_blocks
    root = max(sharded - all_blocks, 0)

    phase_breakdowns: dict[str, dict[str, int]] = {}
    for phase, single in estimate.phase_breakdowns.items():
        rank = {k: int(v) for k, v in single.items()}
        rank.setdefault(COMMUNICATION_ROW, 0)
        if cpu_offload:
            phase_breakdowns[phase] = _offloaded_phase(phase, single, rank, world_size, root, largest_block, trainable_share)
            rank["parameters"] += replicated  # frozen models kept whole on the device
            continue
        if strategy == "ddp":
            rank[COMMUNICATION_ROW] += grads  # gradient buckets, allocated with the DDP wrapper
        else:
            w = world_size
            for key in ("parameters", "gradients", "optimizer_state"):
                rank[key] = -(-rank.get(key, 0) // w)
            rank["parameters"] = -(-(single.get("parameters", 0) - replicated) // w) + replicated
            if phase == "optimizer step":
                rank["temporaries"] = -(-rank.get("temporaries", 0) // w)  # foreach buffers of the local shards
            else:
                # gathered on top of the local shards: the root group, the current block and the prefetched one
                gathered = root + 2 * largest_block
                rank[COMMUNICATION_ROW] += gathered - gathered // w
                if phase == "backward":
                    # Gradients of the block just computed (and of the root) are whole until their reduce-scatter:
                    # no more than existed at the backward's peak, which the local shards above count once.
                    pending = min(single.get("gradients", 0), int(trainable_share * (root + largest_block)))
                    rank[COMMUNICATION_ROW] += pending - pending // w
        phase_breakdowns[phase] = rank

    phase_peaks = {p: sum(b.values()) for p, b in phase_breakdowns.items()}
    peak_phase = max(phase_peaks, key=lambda p: phase_peaks[p])
    peak = phase_peaks[peak_phase]
    # The allocator's overhead over the live bytes is the one-device trace's (its reserved figure, and with a device
    # size the least device it needs); a device size is then judged per rank (memory.step.within_device).
    reserved = least = None
    if estimate.reserved_peak_bytes is not None:
        reserved = peak + max(estimate.reserved_peak_bytes - estimate.peak_bytes, 0)
    if estimate.least_reserved_bytes is not None:
        least = peak + max(estimate.least_reserved_bytes - estimate.peak_bytes, 0)
    if strategy == "ddp":
        how = f"per rank of {world_size} (ddp): model state replicated, plus gradient buckets ({_mib(grads)})"
    elif cpu_offload:
        w = world_size
        host = sum(-(-step.get(k, 0) // w) for k in ("parameters", "gradients", "optimizer_state", "temporaries"))
        how = (f"per rank of {world_size} (fsdp2, cpu offload): parameters, gradients and optimizer state sharded in host "
               f"memory ({_mib(host)} per rank with the step's temporaries as traced), none on the device between uses; "
               f"forward/backward hold the root group ({_mib(root)}) and two gathered blocks ({_mib(largest_block)} each) "
               f"plus their shards being copied in, backward the unsharded gradients awaiting reduce-scatter and their "
               f"shard until copied out; the optimizer step runs on the host (no device bytes for model state)")
    else:
        how = (f"per rank of {world_size} (fsdp2): parameters, gradients and optimizer state sharded; forward/backward "
               f"also hold the root group ({_mib(root)}) and two gathered blocks ({_mib(largest_block)} each)")
    if replicated:
        how += f"; frozen models kept whole on every rank: {_mib(replicated)}"
    return within_device(dataclasses.replace(
        estimate,
        peak_bytes=peak,
        breakdown=dict(phase_breakdowns[peak_phase]),
        peak_phase=peak_phase,
        phase_peaks=phase_peaks,
        phase_breakdowns=phase_breakdowns,
        reserved_peak_bytes=reserved,
        least_reserved_bytes=least,
        method=f"{estimate.method}; {how}",
    ))


def _offloaded_phase(phase: str, single: dict[str, int], rank: dict[str, int], world_size: int, root: int,
                     largest_block: int, trainable_share: float) -> dict[str, int]:
    """One phase's device bytes under FSDP2 with CPU offload (the module docstring says what is assumed)."""
    w = world_size
    for key in ("parameters", "gradients", "optimizer_state"):
        rank[key] = 0  # sharded in host memory between uses
    if phase == "optimizer step":
        rank["temporaries"] = 0  # the update's temporaries are made on the host, next to the shards
        return rank
    blocks = 2 * largest_block  # the block being computed and the prefetched one
    # gathered whole on the device, plus the two blocks' shards while they are copied in for their all-gather
    rank[COMMUNICATION_ROW] += root + blocks + -(-blocks // w)
    if phase == "backward":
        # the unsharded gradients of the root and the current block awaiting their reduce-scatter (no more than
        # existed at the single device's backward peak), and the reduce-scatter's shard until it is copied out
        pending = min(single.get("gradients", 0), int(trainable_share * (root + largest_block)))
        rank[COMMUNICATION_ROW] += pending + -(-pending // w)
    return rank


def _mib(n: Any) -> str:
    return f"{int(n) / 2**20:.1f} MiB"
