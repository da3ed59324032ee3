"""The step-time model of ``lit-memopt plan``: FLOPs and bytes against a device's peak rates.

A plan is ranked by a *predicted* step time, relative to the recipe's own step on the same devices, so the
model only has to order configurations correctly, not to predict seconds. It is a roofline per
micro-batch plus what each lever adds:

- compute: ``2·P`` FLOPs per token forward for every parameter (frozen copies included: a reference
  model runs forward), ``4·P_trainable`` backward (input and weight gradients), and one more forward of the
  trainable model where activations are recomputed (checkpointing), at ``MFU`` of the dense BF16 peak;
- memory traffic: every micro-batch reads the weights in forward, recomputation and backward and
  reads-writes the gradient accumulator; the optimizer step reads and writes weights, gradients and
  states once per step, at ``BANDWIDTH_EFFICIENCY`` of the HBM peak. A micro-batch costs the larger of its
  compute and its traffic, plus a launch overhead per kernel (what makes tiny micro-batches slow);
- FSDP2: per micro-batch, parameters are all-gathered twice (forward, backward) and gradients
  reduce-scattered once, ``(W-1)/W`` of their bytes each over the link (NVLink in a node, the network
  across nodes), overlapped with compute; DDP all-reduces the gradients once per step (Lightning skips the
  sync while accumulating), overlapped with the last backward.
- FSDP2 with CPU offload (``StepWork.cpu_offload``, torch's ``CPUOffloadPolicy``): per micro-batch every
  parameter shard (``1/W`` of the weights) is copied host-to-device twice (its forward and its backward
  all-gather both read the host shard) and every gradient shard device-to-host once, over PCIe at
  ``BANDWIDTH_EFFICIENCY`` of the per-direction peak (pinned memory). FSDP2 issues each copy just before the
  all-gather it feeds, on the same prefetching stream, so copies and collectives are assumed serial with each
  other and overlapped with compute as the all-gathers are: a micro-batch costs the larger of its compute and
  its copies plus collectives. A micro-batch that accumulates into existing gradients (all but the first of a
  step) copies its gradient shards out synchronously (torch does not overlap that copy when a CPU add follows)
  and adds them on the host: both are added unoverlapped. The optimizer step runs on the host: torch's CPU
  AdamW, bandwidth bound, moves :data:`HOST_ADAMW_TRAFFIC` times the bytes of one fused pass (read weight,
  gradient and both moments, write weight and moments) at ``HOST_BANDWIDTH_EFFICIENCY`` of the node's host
  memory bandwidth (``DeviceSpec.host_bytes_per_second``), shared by the node's ranks, which all step at
  once; the device's memory does no optimizer traffic.
- Activation offload (``StepWork.activation_offload_bytes``, ``memory.offload``): per micro-batch the bytes its
  trace copied to the host go out in forward and come back in backward, over PCIe at ``BANDWIDTH_EFFICIENCY`` of
  the per-direction peak. The copies are issued on the compute stream, between the kernels that make and use the
  tensors, so they are added to the micro-batch, not overlapped (an upper bound: no side stream is modelled).
- Frozen models FSDP2 leaves whole on every rank (``StepWork.replicated_bytes``: a reference copy, a reward
  model) cost their FLOPs and weight reads like any model, but are neither gathered nor copied to or from the host.

The numbers in :data:`DEVICES` are the vendors' datasheet peaks, with the source of each; host memory
bandwidth is the DDR peak of the reference server named in each source.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceSpec", "DEVICES", "StepWork", "step_seconds", "device_spec", "MFU", "BANDWIDTH_EFFICIENCY",
           "HOST_BANDWIDTH_EFFICIENCY", "HOST_ADAMW_TRAFFIC"]

# Shares of the peaks a training step reaches. One constant each: the ranking depends on ratios of
# compute, traffic and communication, which these scale alike for every candidate of one plan.
MFU = 0.45
BANDWIDTH_EFFICIENCY = 0.8
# A decoder block runs about this many kernels forward (norms, projections, attention, MLP, residuals);
# backward about twice as many. At ~5 µs each this is what a micro-batch of one row mostly costs on a GPU.
KERNELS_PER_BLOCK = 30
KERNEL_LAUNCH_SECONDS = 5e-6
# Between nodes each GPU is assumed to have one 400 Gb/s NIC (a common InfiniBand NDR layout): 50 GB/s.
INTERNODE_BYTES_PER_SECOND = 50e9
# CPU offload. Share of the host's DDR peak that the optimizer step reaches (an assumption: streaming kernels
# reach 60-80% of a two-socket server's peak with every core and socket-local memory; a rank's process is pinned to
# neither, so the low end).
HOST_BANDWIDTH_EFFICIENCY = 0.6
# torch's AdamW on CPU tensors is the per-tensor loop (``foreach`` defaults on only for CUDA tensors): per
# parameter 8 elementwise kernels (weight decay, lerp of the first moment, mul and addcmul of the second, sqrt, div
# and add of the denominator, addcdiv of the weight) read or write 20 tensor-sized buffers, against 7 for one fused
# pass (read weight, gradient and two moments; write weight and two moments). Counted from torch 2.13's
# ``_single_tensor_adam``.
HOST_ADAMW_TRAFFIC = 20.0 / 7.0


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one accelerator (dense BF16 tensor FLOP/s; bytes/s per direction).

    ``host_bytes_per_second`` is the host memory (DDR) bandwidth of the whole node the device sits in, which its
    ranks share (CPU offload's optimizer step); the default is a single socket of 8 DDR4-3200 channels.
    """

    name: str
    bf16_flops: float
    hbm_bytes_per_second: float
    link_bytes_per_second: float  # GPU-to-GPU inside a node (NVLink; PCIe where there is none)
    pcie_bytes_per_second: float  # host <-> device
    memory_bytes: int
    source: str
    host_bytes_per_second: float = 204.8e9  # the node's host memory, all sockets


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        "NVIDIA H100 SXM5 80GB", 989e12, 3.35e12, 450e9, 64e9, 80 * 10**9,
        "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): BF16 989 TFLOPS dense "
        "(1979 with sparsity), HBM3 3.35 TB/s, NVLink 900 GB/s bidirectional, PCIe Gen5 128 GB/s bidirectional; "
        "host: a DGX H100 (2x Xeon Platinum 8480C, 8 DDR5-4800 channels each: 614.4 GB/s)",
        host_bytes_per_second=614.4e9,
    ),
    "h200": DeviceSpec(
        "NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 450e9, 64e9, 141 * 10**9,
        "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): BF16 989 TFLOPS dense, "
        "HBM3e 4.8 TB/s, NVLink 900 GB/s bidirectional, PCIe Gen5 128 GB/s bidirectional; "
        "host: a DGX H200 (2x Xeon Platinum 8480C, 8 DDR5-4800 channels each: 614.4 GB/s)",
        host_bytes_per_second=614.4e9,
    ),
    "a100": DeviceSpec(
        "NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, 300e9, 32e9, 80 * 10**9,
        "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100): BF16 312 TFLOPS dense, "
        "HBM2e 2039 GB/s, NVLink 600 GB/s bidirectional, PCIe Gen4 64 GB/s bidirectional; "
        "host: a DGX A100 (2x EPYC 7742, 8 DDR4-3200 channels each: 409.6 GB/s)",
        host_bytes_per_second=409.6e9,
    ),
    "l4": DeviceSpec(
        "NVIDIA L4 24GB", 121e12, 300e9, 32e9, 32e9, 24 * 10**9,
        "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4): BF16 121 TFLOPS dense "
        "(242 with sparsity), GDDR6 300 GB/s, no NVLink (peers over PCIe Gen4 x16, 64 GB/s bidirectional); "
        "host assumed: one socket of 8 DDR4-3200 channels (204.8 GB/s)",
        host_bytes_per_second=204.8e9,
    ),
    # `plan.device=cpu`: a laptop trying a plan under `fit memory_budget=`; nominal rates, only the order matters.
    "cpu": DeviceSpec("CPU (nominal rates)", 1e12, 50e9, 10e9, 10e9, 0,
                      "nominal: a CPU run under memory_budget has no allocator and no interconnect to model",
                      host_bytes_per_second=50e9),
}


def device_spec(name: str) -> DeviceSpec:
    """The :data:`DEVICES` entry ``name`` (case-insensitive).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    key = str(name).lower()
    if key not in DEVICES:
        raise ValueError(f"plan.device={name!r} is not known; choose one of: {', '.join(DEVICES)}")
    return DEVICES[key]


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step of a candidate computes and moves (per rank).

    Attributes:
        parameters: parameters of every model the step runs (policy, frozen reference, reward model).
        trainable: trainable parameters.
        parameter_bytes / trainable_bytes / optimizer_state_bytes: their sizes on one device, unsharded.
        tokens: tokens one micro-batch runs through the model (rows × positions).
        micro_batches: micro-batches per optimizer step (gradient accumulation).
        blocks: decoder blocks (kernel count).
        recompute: share of the trainable forward run again in backward (0: none, 1: all blocks).
        strategy: ``single``, ``ddp`` or ``fsdp2``; world_size: data-parallel ranks; nodes: machines.
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (``fsdp2`` only, any world size): parameter, gradient and
            optimizer-state shards in host memory, the optimizer step on the host.
        replicated_bytes: bytes of ``parameter_bytes`` in frozen models FSDP2 leaves whole on every rank (a
            reference copy, a reward model): never gathered, never copied to or from the host.
        activation_offload_bytes: saved activations one micro-batch copies to the host and back (0: no offload).
    """

    parameters: float
    trainable: float
    parameter_bytes: float
    trainable_bytes: float
    optimizer_state_bytes: float
    tokens: float
    micro_batches: int
    blocks: int
    recompute: float = 0.0
    strategy: str = "single"
    world_size: int = 1
    nodes: int = 1
    cpu_offload: bool = False
    replicated_bytes: float = 0.0
    activation_offload_bytes: float = 0.0


def step_seconds(work: StepWork, device: DeviceSpec) -> float:
    """Predicted seconds of one optimizer step of ``work`` on ``device`` (see the module docstring).

    Raises:
        ValueError: ``cpu_offload`` with a strategy other than ``fsdp2``.
    """
    if work.cpu_offload and work.strategy != "fsdp2":
        raise ValueError(f"step_seconds: cpu_offload is FSDP2's (CPUOffloadPolicy); strategy={work.strategy!r} has none")
    w = max(int(work.world_size), 1)
    flops = work.tokens * (2.0 * work.parameters + 4.0 * work.trainable + 2.0 * work.trainable * work.recompute)
    compute = flops / (device.bf16_flops * MFU)
    # weights read in forward, recomputation and backward; the gradient accumulator read and written
    traffic = work.parameter_bytes * (2.0 + work.recompute) + 2.0 * work.trainable_bytes
    memory = traffic / (device.hbm_bytes_per_second * BANDWIDTH_EFFICIENCY)
    launches = KERNELS_PER_BLOCK * work.blocks * (3.0 + work.recompute) * KERNEL_LAUNCH_SECONDS
    micro = max(compute, memory) + launches
    link = device.link_bytes_per_second if work.nodes <= 1 else min(device.link_bytes_per_second, INTERNODE_BYTES_PER_SECOND)
    share = (w - 1) / w
    pcie = device.pcie_bytes_per_second * BANDWIDTH_EFFICIENCY
    sharded = max(work.parameter_bytes - work.replicated_bytes, 0.0)  # what FSDP2 shards, gathers and offloads
    copy_in = 2.0 * sharded / w  # offload: parameter shards in, for the forward and the backward all-gather
    copy_out = work.trainable_bytes / w  # offload: gradient shards out after their reduce-scatter
    if work.strategy == "fsdp2" and (w > 1 or work.cpu_offload):
        gathered = 2.0 * sharded * share + work.trainable_bytes * share
        streams = gathered / link  # prefetched all-gathers overlap the compute they feed
        if work.cpu_offload:
            streams += (copy_in + copy_out) / pcie  # each copy runs just before its collective, on the same stream
        micro = max(micro, streams)
    micro += 2.0 * work.activation_offload_bytes / pcie  # out in forward, back in backward, on the compute stream
    total = work.micro_batches * micro
    if work.strategy == "ddp" and w > 1:
        allreduce = 2.0 * work.trainable_bytes * share / link
        total += max(0.0, allreduce - micro * 2.0 / 3.0)  # overlapped with the last backward (2/3 of a micro-batch)
    state = work.optimizer_state_bytes / (w if work.strategy == "fsdp2" else 1)
    own = 1.0 / w if work.strategy == "fsdp2" else 1.0
    # AdamW reads weight, gradient and states and writes weight and states
    adamw_bytes = 2.0 * work.trainable_bytes * own + work.trainable_bytes * own + 2.0 * state
    if not work.cpu_offload:
        return total + adamw_bytes / (device.hbm_bytes_per_second * BANDWIDTH_EFFICIENCY)
    # the node's ranks step (and accumulate) on the host at once, sharing its memory bandwidth
    ranks_per_node = max(w // max(int(work.nodes), 1), 1)
    host = device.host_bytes_per_second * HOST_BANDWIDTH_EFFICIENCY / ranks_per_node
    # accumulating micro-batches: a synchronous copy out, then the host adds the shard (read two, write one)
    total += max(int(work.micro_batches) - 1, 0) * (copy_out / pcie + 3.0 * copy_out / host)
    return total + HOST_ADAMW_TRAFFIC * adamw_bytes / host
