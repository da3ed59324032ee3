"""Memory planning for TTT layers: the scan's ``checkpoint_group_size`` from the free memory, which
comes from :func:`lit_memopt.memory.memory_snapshot`."""

from __future__ import annotations

import math

import torch

from lit_memopt.memory import memory_snapshot

__all__ = ["auto_checkpoint_group_size", "check_group_size", "free_bytes"]


def check_group_size(value: int | str) -> int | str:
    """``value`` if it is a valid ``checkpoint_group_size`` (0, a positive int or ``"auto"``), else ``ValueError``."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"checkpoint_group_size must be 0 (off), a positive number of mini-batches, or 'auto'; got {value!r}."
        )
    return value


def free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (``memory_snapshot(device).free_bytes``), or ``None`` for devices
    with no probe (a CUDA device on a machine without CUDA, ``meta``, ``mps``...)."""
    if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()):
        return int(memory_snapshot(device).free_bytes)
    return None


def auto_checkpoint_group_size(
    num_mini_batches: int,
    mini_batch_bytes: int,
    state_bytes: int,
    *,
    num_layers: int = 1,
    device: torch.device | str = "cpu",
    budget_fraction: float = 0.25,
    available_bytes: int | None = None,
) -> int:
    """Choose the scan's ``checkpoint_group_size`` from the memory available.

    Without checkpointing, backward needs ``num_layers * num_mini_batches * mini_batch_bytes`` of
    saved scan intermediates. If that fits into ``budget_fraction`` of the free memory, return 0
    (no checkpointing: no recomputation).
    Checkpointing keeps only each layer's input for backward and recomputes one layer at a time.
    If one layer's whole scan (``num_mini_batches * mini_batch_bytes``) fits into the budget, return
    ``num_mini_batches``: the layer is recomputed in one pass (the fastest checkpointed setting).
    Otherwise the recomputed scan is itself checkpointed in groups of ``g`` mini-batches: backward
    holds ``n / g`` boundary states plus one group, ``(n / g) * state_bytes + g * mini_batch_bytes``,
    smallest at ``g = sqrt(n * state_bytes / mini_batch_bytes)``; that ``g`` is returned (at least 1).

    Free memory comes from :func:`lit_memopt.memory.memory_snapshot` (CUDA: free device memory;
    CPU: available RAM); on a device it cannot measure the conservative choice (checkpointing)
    is made.

    Args:
        num_mini_batches: full mini-batches in the scan of one layer.
        mini_batch_bytes: bytes one mini-batch saves for backward in one layer.
        state_bytes: bytes of one inner state (all heads, whole batch).
        num_layers: TTT layers whose scans are alive together in backward.
        device: where the layer runs.
        budget_fraction: share of the free memory the saved scan may use.
        available_bytes: override the measured free memory (tests, planning).

    Raises:
        ValueError: if a size is negative or ``budget_fraction`` is not in ``(0, 1]``.
    """
    if num_mini_batches < 0 or mini_batch_bytes < 0 or state_bytes < 0 or num_layers < 1:
        raise ValueError(
            "auto_checkpoint_group_size: num_mini_batches, mini_batch_bytes, state_bytes must be >= 0 and "
            f"num_layers >= 1; got {num_mini_batches}, {mini_batch_bytes}, {state_bytes}, {num_layers}."
        )
    if not 0.0 < budget_fraction <= 1.0:
        raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction}.")
    if num_mini_batches <= 1:
        return 0
    free = available_bytes if available_bytes is not None else free_bytes(torch.device(device))
    needed = num_layers * num_mini_batches * mini_batch_bytes
    if free is not None and needed <= budget_fraction * free:
        return 0
    if free is not None and num_mini_batches * mini_batch_bytes <= budget_fraction * free:
        return num_mini_batches
    best = math.sqrt(num_mini_batches * state_bytes / max(mini_batch_bytes, 1))
    return int(min(max(round(best), 1), num_mini_batches))
