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

The numbers in :data:`DEVICES` are the vendors' datasheet peaks, with the source of each.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceSpec", "DEVICES", "StepWork", "step_seconds", "device_spec", "MFU", "BANDWIDTH_EFFICIENCY"]

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


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one accelerator (dense BF16 tensor FLOP/s; bytes/s per direction)."""

    name: str
    bf16_flops: float
    hbm_bytes_per_second: float
    link_bytes_per_second: float  # GPU-to-GPU inside a node (NVLink; PCIe where there is none)
    pcie_bytes_per_second: float  # host <-> device
    memory_bytes: int
    source: str


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        "NVIDIA H100 SXM5 80GB", 989e12, 3.35e12, 450e9, 64e9, 80 * 10**9,
        "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): BF16 989 TFLOPS dense "
        "(1979 with sparsity), HBM3 3.35 TB/s, NVLink 900 GB/s bidirectional, PCIe Gen5 128 GB/s bidirectional",
    ),
    "h200": DeviceSpec(
        "NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 450e9, 64e9, 141 * 10**9,
        "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): BF16 989 TFLOPS dense, "
        "HBM3e 4.8 TB/s, NVLink 900 GB/s bidirectional, PCIe Gen5 128 GB/s bidirectional",
    ),
    "a100": DeviceSpec(
        "NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, 300e9, 32e9, 80 * 10**9,
        "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100): BF16 312 TFLOPS dense, "
        "HBM2e 2039 GB/s, NVLink 600 GB/s bidirectional, PCIe Gen4 64 GB/s bidirectional",
    ),
    "l4": DeviceSpec(
        "NVIDIA L4 24GB", 121e12, 300e9, 32e9, 32e9, 24 * 10**9,
        "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4): BF16 121 TFLOPS dense "
        "(242 with sparsity), GDDR6 300 GB/s, no NVLink (peers over PCIe Gen4 x16, 64 GB/s bidirectional)",
    ),
    # `plan.device=cpu`: a laptop trying a plan under `fit memory_budget=`; nominal rates, only the order matters.
    "cpu": DeviceSpec("CPU (nominal rates)", 1e12, 50e9, 10e9, 10e9, 0,
                      "nominal: a CPU run under memory_budget has no allocator and no interconnect to model"),
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


def step_seconds(work: StepWork, device: DeviceSpec) -> float:
    """Predicted seconds of one optimizer step of ``work`` on ``device`` (see the module docstring)."""
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
    if work.strategy == "fsdp2" and w > 1:
        gathered = 2.0 * work.parameter_bytes * share + work.trainable_bytes * share
        micro = max(micro, gathered / link)  # prefetched all-gathers overlap the compute they feed
    total = work.micro_batches * micro
    if work.strategy == "ddp" and w > 1:
        allreduce = 2.0 * work.trainable_bytes * share / link
        total += max(0.0, allreduce - micro * 2.0 / 3.0)  # overlapped with the last backward (2/3 of a micro-batch)
    state = work.optimizer_state_bytes / (w if work.strategy == "fsdp2" else 1)
    own = 1.0 / w if work.strategy == "fsdp2" else 1.0
    # AdamW reads weight, gradient and states and writes weight and states
    total += (2.0 * work.trainable_bytes * own + work.trainable_bytes * own + 2.0 * state) / (
        device.hbm_bytes_per_second * BANDWIDTH_EFFICIENCY)
    return total
