"""``EmptyCacheScheduler``: empty the CUDA caching allocator at chosen points, the same way on every rank."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memopt._compat.lightning import callback_state_key
from lit_memopt.memory.stats import memory_snapshot

__all__ = ["EmptyCacheScheduler"]

_REASONS = ("every_n_steps", "after_backward", "validation_start", "validation_end", "fragmentation", "alloc_retries")


def _has_cuda_cache(device: torch.device) -> bool:
    """Whether ``device`` has a caching allocator this callback can empty."""
    return device.type == "cuda"


def _empty_cuda_cache() -> None:
    torch.cuda.empty_cache()


def _expandable_segments_enabled() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


class EmptyCacheScheduler(Callback):
    """Return cached, unused CUDA memory to the driver at chosen points of training.

    PyTorch's caching allocator keeps freed blocks for reuse. That is fast, but blocks cut for
    one shape may not fit the next (fragmentation), and memory cached by training is not
    available to validation with other shapes, or to other processes. This callback calls
    ``torch.cuda.empty_cache()`` (after ``gc.collect()`` when asked, so that tensors kept only by
    reference cycles are freed first) at the points you choose.

    Every rank takes the same decision at the same point: the fixed triggers (every N steps,
    after backward, around validation) are the same on every rank by construction, and the
    measured ones (fragmentation, allocator retries) are combined with a max-reduction through
    the strategy, issued by every rank at the end of every optimizer step, so if one rank needs
    it all ranks empty their cache together (an empty cache costs a synchronisation; doing it on
    one rank only would make the others wait at the next collective anyway).

    Fragmentation is ``(reserved - allocated) / reserved`` at the end of an optimizer step, when
    activations are freed but their blocks are still cached: values around 0.3 to 0.6 are normal
    there, so thresholds below 0.5 empty the cache nearly every step. When a measured trigger
    fires and ``expandable_segments`` is not enabled, it suggests once to set
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which lets the allocator grow segments
    in place instead of caching fixed-size blocks. The time spent is counted and reported at the
    end of training. On CPU there is no cache: it says so once and does nothing.

    Args:
        every_n_steps: empty the cache after every N-th optimizer step; ``None`` to disable.
        after_backward: empty the cache after every backward pass (costly: for debugging
            fragmentation, or when the optimizer step needs the activations' memory).
        around_validation: empty the cache before and after each validation run.
        fragmentation_threshold: empty the cache when ``(reserved - allocated) / reserved`` at
            the end of a step passes this fraction, in ``(0, 1)``; ``None`` to disable.
        on_alloc_retries: empty the cache when the allocator's ``num_alloc_retries`` rose
            during the step (it had to free its cache and retry a ``cudaMalloc``: the sign that
            the cache stands in the way).
        gc_collect: run ``gc.collect()`` before emptying the cache.

    Raises:
        ValueError: when ``every_n_steps`` is not ``None`` or a positive integer, or
            ``fragmentation_threshold`` is not ``None`` or a fraction in ``(0, 1)``.

    Example::

        from lightning.pytorch import Trainer
        from lit_memopt.callbacks import EmptyCacheScheduler

        trainer = Trainer(callbacks=[EmptyCacheScheduler(every_n_steps=500, fragmentation_threshold=0.7)])
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        after_backward: bool = False,
        around_validation: bool = True,
        fragmentation_threshold: float | None = None,
        on_alloc_retries: bool = True,
        gc_collect: bool = True,
    ) -> None:
        super().__init__()
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"EmptyCacheScheduler(every_n_steps={every_n_steps!r}): use None or a positive integer.")
        if fragmentation_threshold is not None and not (0.0 < float(fragmentation_threshold) < 1.0):
            raise ValueError(
                f"EmptyCacheScheduler(fragmentation_threshold={fragmentation_threshold!r}): "
                "use None or a fraction of reserved memory in (0, 1)."
            )
        self.every_n_steps = every_n_steps
        self.after_backward = bool(after_backward)
        self.around_validation = bool(around_validation)
        self.fragmentation_threshold = None if fragmentation_threshold is None else float(fragmentation_threshold)
        self.on_alloc_retries = bool(on_alloc_retries)
        self.gc_collect = bool(gc_collect)

        self.seconds_spent = 0.0
        self.empties_by_reason: dict[str, int] = dict.fromkeys(_REASONS, 0)
        self._active = False
        self._device = torch.device("cpu")
        self._last_retries = 0
        self._last_global_step = 0
        self._suggested_expandable = False
        self._said_nothing_to_do = False
        self._train_t0: float | None = None

    @property
    def num_empties(self) -> int:
        """How many times the cache was emptied (a point with several reasons counts once per reason)."""
        return sum(self.empties_by_reason.values())

    @property
    def state_key(self) -> str:
        return callback_state_key(
            self,
            every_n_steps=self.every_n_steps,
            after_backward=self.after_backward,
            around_validation=self.around_validation,
            fragmentation_threshold=self.fragmentation_threshold,
            on_alloc_retries=self.on_alloc_retries,
        )

    # --- setup ------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._device = trainer.strategy.root_device
        self._active = _has_cuda_cache(self._device)
        if not self._active:
            if self._said_nothing_to_do:
                return
            self._said_nothing_to_do = True
            rank_zero_info(
                f"EmptyCacheScheduler: training runs on {self._device.type!r}, which has no CUDA caching "
                "allocator; there is nothing to empty, so this callback does nothing."
            )
            return
        self._last_retries = memory_snapshot(self._device).num_alloc_retries if self._watches_memory else 0
        self._last_global_step = trainer.global_step

    @property
    def _watches_memory(self) -> bool:
        return self.fragmentation_threshold is not None or self.on_alloc_retries

    # --- decision points --------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_t0 = time.perf_counter()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active and self.after_backward:
            self._empty(("after_backward",))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active or trainer.global_step == self._last_global_step:
            return  # accumulating gradients: decide once per optimizer step
        self._last_global_step = trainer.global_step
        reasons: list[str] = []
        if self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0:
            reasons.append("every_n_steps")
        if self._watches_memory:
            snapshot = memory_snapshot(self._device)
            local = torch.tensor(
                [
                    float(self.fragmentation_threshold is not None
                          and snapshot.reserved_bytes > 0
                          and snapshot.fragmentation > self.fragmentation_threshold),
                    float(self.on_alloc_retries and snapshot.num_alloc_retries > self._last_retries),
                ]
            )
            self._last_retries = snapshot.num_alloc_retries
            agreed = self._agree(trainer, local)
            if agreed[0] > 0:
                reasons.append("fragmentation")
            if agreed[1] > 0:
                reasons.append("alloc_retries")
            if agreed.any():
                self._suggest_expandable_segments(snapshot.fragmentation)
        if reasons:
            self._empty(tuple(reasons))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active and self.around_validation:
            self._empty(("validation_start",))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active and self.around_validation:
            self._empty(("validation_end",))

    # --- helpers ----------------------------------------------------------------------------------
    def _agree(self, trainer: Trainer, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise max of ``flags`` over ranks: every rank must call this at the same point."""
        from lit_memopt.callbacks._rank_agreement import RankAgreement

        return RankAgreement.for_trainer(trainer).max_tensor(flags)

    def _empty(self, reasons: tuple[str, ...]) -> None:
        start = time.perf_counter()
        if self.gc_collect:
            gc.collect()
        _empty_cuda_cache()
        self.seconds_spent += time.perf_counter() - start
        for reason in reasons:
            self.empties_by_reason[reason] += 1

    def _suggest_expandable_segments(self, fragmentation: float) -> None:
        if self._suggested_expandable or _expandable_segments_enabled():
            return
        self._suggested_expandable = True
        rank_zero_warn(
            f"EmptyCacheScheduler: the CUDA cache is fragmented ({fragmentation:.0%} of reserved memory unused) or "
            "the allocator had to retry allocations. Setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "before the process starts lets the allocator grow segments instead of caching fixed-size blocks, "
            "which usually removes both."
        )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:
            return
        elapsed = time.perf_counter() - self._train_t0 if self._train_t0 is not None else 0.0
        share = self.seconds_spent / elapsed if elapsed > 0 else 0.0
        used = {reason: n for reason, n in self.empties_by_reason.items() if n}
        rank_zero_info(
            f"EmptyCacheScheduler: emptied the CUDA cache {self.num_empties} time(s) {used or ''}, "
            f"spending {self.seconds_spent:.3f} s ({share:.2%} of training time)."
        )
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"empty_cache/count": float(self.num_empties), "empty_cache/seconds": self.seconds_spent},
                    step=max(trainer.global_step - 1, 0),
                )

    # --- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"seconds_spent": self.seconds_spent, "empties_by_reason": dict(self.empties_by_reason)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seconds_spent = float(state_dict.get("seconds_spent", 0.0))
        self.empties_by_reason.update(state_dict.get("empties_by_reason", {}))
