"""``RandomState``: each rank's torch, CUDA, numpy and Python generators in the checkpoint, restored on resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["RandomState"]


class RandomState(Callback):
    """Put every rank's global random generators into every checkpoint and restore each rank's own on resume.

    Lightning restores weights, optimizer, loops and callbacks, not the global generators, so a resumed run would
    draw other dropout masks, shuffles or samples than the run it continues. The states are restored in
    ``on_train_start``, after the data loaders were set up and just before the first step, which is where the
    uninterrupted run stood when the checkpoint was written.

    Per rank: Lightning takes the callbacks' states on every rank but writes rank zero's only (the single file of
    one device or DDP, the metadata of a sharded FSDP2 checkpoint). So ``state_dict`` gathers every rank's states
    (``all_gather_object``: Lightning calls it on every rank together, as each save is collective) into
    ``{"ranks": [rank 0's, rank 1's, ...]}``, and on resume rank ``r`` restores entry ``r``. A resume with another
    number of processes cannot continue each rank's draws (the data is split differently too): every rank then
    takes rank zero's states, with a warning. A checkpoint of one state (before the per-rank layout) is taken by
    every rank.

    Example::

        from lit_memopt.callbacks.random_state import RandomState
        trainer = Trainer(callbacks=[RandomState()])
    """

    def __init__(self) -> None:
        self._to_restore: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        own = _capture()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, own)
            return {"ranks": ranks}
        return {"ranks": [own]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint of one flat state (written before the per-rank layout) serves every rank.
        self._to_restore = list(state_dict["ranks"]) if "ranks" in state_dict else [dict(state_dict)]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._to_restore is None:
            return
        states, self._to_restore = self._to_restore, None
        rank = trainer.global_rank
        if len(states) != trainer.world_size and len(states) > 1:
            rank_zero_warn(f"RandomState: the checkpoint holds the random generators of {len(states)} processes, this "
                           f"run has {trainer.world_size}; every rank resumes with rank 0's (draws differ from an "
                           "uninterrupted run)")
        _restore(states[rank] if len(states) == trainer.world_size else states[0])


def _capture() -> dict[str, Any]:
    """This process's generator states, as plain lists, ints and tensors (checkpoints load with weights_only=True)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [str(kind), keys.tolist(), int(position), int(has_gauss), float(cached)],
        "python": _plain(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's device (one per rank)
    return state


def _restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
