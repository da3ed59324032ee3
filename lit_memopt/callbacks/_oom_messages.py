"""The messages ``OOMRecovery`` stops training with: where it failed, the memory state, what to do next."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["micro_batch_fatal_message", "optimizer_fatal_message", "memory_state", "checkpoint_note"]


def micro_batch_fatal_message(trainer: Any, device: torch.device, phase: str, size: int, min_size: int, message: str) -> str:
    """An OOM at the smallest micro-batch: nothing left to shrink."""
    return (
        f"OOMRecovery: out of memory in {phase} at step {trainer.global_step} (epoch {trainer.current_epoch}) "
        f"with micro-batch size {size}, which is min_micro_batch_size={min_size}: cannot shrink "
        f"further. Memory: {memory_state(device)}. Error: {message}. "
        "Weights are those of the last completed optimizer step; this step's gradients were freed. "
        f"{checkpoint_note(trainer)} Reduce the sequence length or model size, enable activation "
        "checkpointing, or use a device with more memory."
    )


def optimizer_fatal_message(step: int, message: str, retryable: bool, local: bool, device: torch.device, trainer: Any) -> str:
    """An OOM in the optimizer update that cannot be retried (again)."""
    where = "on this rank" if local else "on another rank"
    why = (
        "it ran out of memory again after freeing memory and retrying"
        if retryable
        else "it had already updated parameters or optimizer state in place, so retrying would apply part of the update twice"
    )
    return (
        f"OOMRecovery: out of memory in the optimizer step at step {step} {where}; {why}. "
        f"Memory: {memory_state(device)}. Error: {message or 'n/a'}. "
        "Micro-batching cannot shrink the optimizer's memory: use an optimizer with less state, "
        "`foreach=False`, or a sharded strategy. Weights are those of the last completed step; "
        f"{checkpoint_note(trainer)}"
    )


def memory_state(device: torch.device) -> str:
    try:
        from lit_memopt.memory.stats import memory_snapshot

        snap = memory_snapshot(device)
        gib = 2**30
        return (
            f"{snap.device}: allocated {snap.allocated_bytes / gib:.2f} GiB, reserved {snap.reserved_bytes / gib:.2f} GiB, "
            f"peak {snap.peak_bytes / gib:.2f} GiB, free {snap.free_bytes / gib:.2f} of {snap.total_bytes / gib:.2f} GiB"
        )
    except Exception as e:  # noqa: BLE001 - the error message must not fail because a probe did
        return f"unavailable ({type(e).__name__})"


def checkpoint_note(trainer: Trainer | None) -> str:
    callback = getattr(trainer, "checkpoint_callback", None) if trainer is not None else None
    path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") if callback else ""
    if path:
        return f"The last good checkpoint is {path} (not overwritten)."
    return "No checkpoint was written by this failure."
