"""``RandomState``: the torch, CUDA, numpy and Python random generators in the checkpoint, restored on resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["RandomState"]


class RandomState(Callback):
    """Put the global random generators into every checkpoint and restore them when training resumes.

    Lightning restores weights, optimizer, loops and callbacks, not the global generators, so a resumed run would
    draw other dropout masks, shuffles or samples than the run it continues. The states are restored in
    ``on_train_start``, after the data loaders were set up and just before the first step, which is where the
    uninterrupted run stood when the checkpoint was written.

    A single-file checkpoint (one device, DDP) holds rank zero's states, and so does a sharded one's metadata: every
    rank resumes with them. Lightning's ``seed_everything`` seeds every rank alike, and the pack derives per-rank
    randomness from (seed, rank, step) (``lit_memopt.seeding``), so the ranks' global generators agree unless code
    draws from them a rank-dependent number of times.

    Example::

        from lit_memopt.callbacks.random_state import RandomState
        trainer = Trainer(callbacks=[RandomState()])
    """

    def __init__(self) -> None:
        self._to_restore: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        kind, keys, position, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            # plain lists and ints: checkpoints load with torch.load(weights_only=True)
            "numpy": [str(kind), keys.tolist(), int(position), int(has_gauss), float(cached)],
            "python": _plain(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # this process's device (one per rank)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = dict(state_dict)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._to_restore is None:
            return
        state, self._to_restore = self._to_restore, None
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
