"""``OOMRecovery``: dynamic micro-batching that survives out-of-memory errors mid-training.

The loader batch stays one optimizer step; it is split into micro-batches whose size shrinks on
an OOM (the same samples are retried) and grows back when memory allows, on every rank alike.
"""

from __future__ import annotations

import functools
import gc
import inspect
import types
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_memopt.callbacks._micro_batching import (
    RankAgreement,
    all_reduce_gradients,
    call_with_autocast_disabled,
    grow_size,
    infer_batch_size,
    micro_batch_bounds,
    per_sample_tokens,
    shrink_size,
    slice_batch,
)
from lit_memopt.memory.oom import is_oom_error

__all__ = ["OOMRecovery", "OOMRecoveryError"]

# Status codes exchanged between ranks (element-wise MAX: the worst outcome wins).
_OK, _OOM, _ERROR = 0, 1, 2
_PHASES = {0: "unknown", 1: "forward", 2: "backward", 3: "optimizer"}
_PHASE_CODES = {v: k for k, v in _PHASES.items()}
_SHRINK_POLICIES = ("halve", "divisor")
_LOSS_WEIGHTINGS = ("samples", "tokens", "none")
_MAX_BACKOFF_EXPONENT = 10


# Share of free memory kept in reserve when sizing the first micro-batch from an estimate.
DEFAULT_ESTIMATE_MARGIN = 0.1


class OOMRecoveryError(RuntimeError):
    """Training cannot go on: an out-of-memory error that ``OOMRecovery`` could not recover from."""


class OOMRecovery(Callback):
    """Survive CUDA (or any device's) out-of-memory errors by splitting each batch into micro-batches.

    Each loader batch stays the unit of one optimizer step. Inside ``training_step`` the batch is
    split into micro-batches; forward and backward run per micro-batch and each micro-batch loss is
    scaled by its share of the batch (samples, or tokens of ``token_mask_key``), so the accumulated
    gradient equals the whole-batch gradient. On an OOM in forward or backward the half-done step is
    freed (outputs, this step's gradients — gradients accumulated from earlier batches of the same
    optimizer step are kept —, the cache), the micro-batch shrinks and the **same samples** are
    retried; the optimizer steps only once every micro-batch succeeded. An OOM inside the
    optimizer update is retried once after freeing memory when nothing was updated yet, otherwise
    reported. After ``grow_after_steps`` clean batches the micro-batch grows back if memory headroom
    allows; an OOM while growing steps back and doubles the wait (no thrash). At
    ``min_micro_batch_size`` an OOM stops training with an :class:`OOMRecoveryError` saying where
    (phase, step, micro-batch size) and the memory state; the weights are those of the last
    optimizer step and no checkpoint is written over.

    Works with automatic optimization for any unchanged ``LightningModule`` (its ``training_step``
    is wrapped at ``setup``), with ``accumulate_grad_batches``, ``precision="bf16-mixed"`` and
    ``"16-mixed"`` (the ``GradScaler`` scales every micro-batch), and with single-device and DDP
    strategies (under any other strategy it warns at ``setup`` and stays inactive). Manual
    optimization opts in with :meth:`run_micro_batches`.

    DDP: every decision is taken by all ranks together through one small ``all_reduce`` (MAX) per
    micro-batch attempt, issued in the same order by every rank, so an OOM on one rank only neither
    hangs nor desynchronises the others. Micro-batch backward passes never synchronise; gradients
    are averaged once per optimizer step by this callback (in buckets, like DDP's reducer; DDP's own
    reducer and communication hooks are bypassed and buffers are broadcast from rank 0 each batch).

    Batches may be tensors, dicts, ``BatchEncoding``, (named) tuples, lists, dataclasses, nested,
    and lists of non-tensor items of batch length; other structures need ``split_fn``.

    Logged from the first step: ``memopt/micro_batch_size`` and ``memopt/oom_events`` (every step
    through ``self.log``; and written to the loggers at once at the first step and whenever they
    change, whatever ``log_every_n_steps`` is). Values the module logs with ``self.log`` inside
    ``training_step`` are combined over micro-batches (``mean`` weighted by share, ``sum``, ``max``,
    ``min``) and logged once per batch, so ``train/loss`` is the whole-batch loss. Extra keys of a dict returned by ``training_step``: 0-dim tensors are combined
    like the loss, other values come from the last micro-batch. A torchmetrics ``Metric`` updated in
    a failed attempt keeps that update.

    Args:
        initial_micro_batch_size: micro-batch size to start with (an int), ``None`` to start with
            the whole batch, or ``"estimate"``: on the first batch, the largest micro-batch whose step
            a fake-tensor estimate (``lit_memopt.memory.estimate``) fits in the device's free memory
            with a 10% margin, the smallest over ranks. Restored from a checkpoint on resume.
        min_micro_batch_size: the smallest size tried; an OOM at this size ends training.
        max_micro_batch_size: the largest size growth goes to (``None``: the whole batch).
        shrink: ``"halve"`` (``ceil(m / 2)``) or ``"divisor"`` (the next smaller divisor of the batch
            size, so all micro-batches are equal; growth then goes to the next larger divisor).
        grow_after_steps: clean training batches before trying a larger micro-batch; ``None``
            never grows.
        max_memory_fraction: on CUDA, growth is tried only when the predicted peak at the larger size
            stays under this fraction of device memory. Other devices try and step back on OOM.
        loss_weighting: how each micro-batch loss is weighted: ``"samples"`` (losses that are means
            over samples), ``"tokens"`` (means over the tokens of ``token_mask_key``) or ``"none"``
            (losses that are sums: weight 1).
        token_mask_key: batch key of the mask whose non-zeros are the loss tokens (``"tokens"`` only).
        split_fn: ``split_fn(batch, micro_batch_size) -> list of micro-batches`` for batches that the
            built-in splitter does not understand. Shares then come from ``batch_size_fn``.
        batch_size_fn: ``batch_size_fn(batch) -> int`` (default: the first tensor's first dimension).
        retry_optimizer_step: retry an OOM in the optimizer update once after freeing memory.
        log_metrics: log ``memopt/micro_batch_size`` and ``memopt/oom_events``.

    Raises:
        ValueError: an argument outside its accepted values (named in the message).
        OOMRecoveryError: during training, an OOM at ``min_micro_batch_size`` or an unrecoverable
            OOM in the optimizer step.

    Example::

        from lightning.pytorch import Trainer
        from lit_memopt.callbacks import OOMRecovery

        trainer = Trainer(callbacks=[OOMRecovery(initial_micro_batch_size=None, grow_after_steps=100)])
        trainer.fit(model, datamodule)   # model unchanged: OOMs shrink the micro-batch, not the batch
    """

    def __init__(
        self,
        initial_micro_batch_size: int | None = None,
        min_micro_batch_size: int = 1,
        max_micro_batch_size: int | None = None,
        shrink: str = "halve",
        grow_after_steps: int | None = 50,
        max_memory_fraction: float = 0.9,
        loss_weighting: str = "samples",
        token_mask_key: str = "attention_mask",
        split_fn: Callable[[Any, int], list[Any]] | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        retry_optimizer_step: bool = True,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        self._validate_initial(initial_micro_batch_size)
        if not isinstance(min_micro_batch_size, int) or isinstance(min_micro_batch_size, bool) or min_micro_batch_size < 1:
            raise ValueError(f"OOMRecovery: min_micro_batch_size must be an int >= 1, got {min_micro_batch_size!r}")
        if max_micro_batch_size is not None and (
            not isinstance(max_micro_batch_size, int) or max_micro_batch_size < min_micro_batch_size
        ):
            raise ValueError(
                f"OOMRecovery: max_micro_batch_size must be None or an int >= min_micro_batch_size "
                f"({min_micro_batch_size}), got {max_micro_batch_size!r}"
            )
        if isinstance(initial_micro_batch_size, int) and initial_micro_batch_size < min_micro_batch_size:
            raise ValueError(
                f"OOMRecovery: initial_micro_batch_size ({initial_micro_batch_size}) must be >= "
                f"min_micro_batch_size ({min_micro_batch_size})"
            )
        if shrink not in _SHRINK_POLICIES:
            raise ValueError(f"OOMRecovery: shrink must be one of {_SHRINK_POLICIES}, got {shrink!r}")
        if grow_after_steps is not None and (not isinstance(grow_after_steps, int) or grow_after_steps < 1):
            raise ValueError(f"OOMRecovery: grow_after_steps must be None or an int >= 1, got {grow_after_steps!r}")
        if not isinstance(max_memory_fraction, (int, float)) or not 0.0 < max_memory_fraction <= 1.0:
            raise ValueError(f"OOMRecovery: max_memory_fraction must be in (0, 1], got {max_memory_fraction!r}")
        if loss_weighting not in _LOSS_WEIGHTINGS:
            raise ValueError(f"OOMRecovery: loss_weighting must be one of {_LOSS_WEIGHTINGS}, got {loss_weighting!r}")
        if loss_weighting == "tokens" and (not isinstance(token_mask_key, str) or not token_mask_key):
            raise ValueError(f"OOMRecovery: token_mask_key must be a non-empty str, got {token_mask_key!r}")
        for name, fn in (("split_fn", split_fn), ("batch_size_fn", batch_size_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"OOMRecovery: {name} must be callable or None, got {type(fn).__name__}")

        self.initial_micro_batch_size = initial_micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.shrink = shrink
        self.grow_after_steps = grow_after_steps
        self.max_memory_fraction = float(max_memory_fraction)
        self.loss_weighting = loss_weighting
        self.token_mask_key = token_mask_key
        self.split_fn = split_fn
        self.batch_size_fn = batch_size_fn
        self.retry_optimizer_step = retry_optimizer_step
        self.log_metrics = log_metrics

        # --- state that survives a restart (state_dict) ---
        # None: the whole batch ("estimate" is resolved on the first batch)
        self.micro_batch_size: int | None = initial_micro_batch_size if isinstance(initial_micro_batch_size, int) else None
        self.oom_events = 0
        self.events: list[dict[str, Any]] = []  # one per OOM seen (recovered or not)
        self.history: list[dict[str, Any]] = []  # one per micro-batch size change
        self._clean_batches = 0
        self._grow_failures = 0
        self._grow_wait = grow_after_steps or 0
        self._initial_resolved = initial_micro_batch_size is None or isinstance(initial_micro_batch_size, int)

        # --- per-run wiring ---
        self._module: LightningModule | None = None
        self._trainer: Trainer | None = None
        self._originals: dict[str, Any] = {}
        self._patched_optimizers: list[tuple[torch.optim.Optimizer, Any]] = []
        self._pending_grads: list[torch.Tensor | None] | None = None
        self._pending_sync = False
        self._ddp = False
        self._agree = RankAgreement(torch.device("cpu"), enabled=False)
        self._last_effective_size: int | None = None
        self._cuda_last: tuple[int, int, int, int] | None = None  # (base, peak, micro size, device index) of the last clean batch
        self._cuda_base = 0
        self._log_signature: inspect.Signature | None = None
        self._original_backward: Callable[..., Any] | None = None
        self._last_written: tuple[float, float] | None = None
        self._batch_step = 0
        self._disabled = False
        self._ddp_model: Any = None

    @staticmethod
    def _validate_initial(value: Any) -> None:
        if value is None or value == "estimate" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return
        raise ValueError(
            "OOMRecovery: initial_micro_batch_size must be None (whole batch), an int >= 1, or 'estimate' "
            f"(sized from a fake-tensor estimate of the step and the device's free memory), got {value!r}"
        )

    # ================================================================== Lightning hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        problem = self._unsupported_strategy(trainer)
        self._disabled = problem is not None
        if problem is not None:
            # A warning, not an error: OOMRecovery is in the default callbacks, and a recipe run with
            # a sharded strategy should still train (without micro-batching).
            rank_zero_warn(problem)
            return
        self._trainer, self._module = trainer, pl_module
        self._last_written = None  # every fit writes its first row
        self._install_module_wrappers(pl_module)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._disabled:
            return
        self._ddp = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        self._agree = RankAgreement(pl_module.device, enabled=self._ddp)
        self._bypass_ddp_reducer(trainer)
        self._patch_optimizers(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.log_metrics or self._disabled:
            return
        size = self._last_effective_size
        if size is None:
            try:
                size = self.micro_batch_size or self._batch_size(batch)
            except ValueError:
                size = self.micro_batch_size or 0
        pl_module.log("memopt/micro_batch_size", float(size), on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("memopt/oom_events", float(self.oom_events), on_step=True, on_epoch=False, batch_size=1)
        # The logger's cadence (log_every_n_steps) would hide the first step and the moments that
        # matter; write those rows straight away (values are identical on every rank).
        current = (float(size), float(self.oom_events))
        if current != self._last_written and trainer.is_global_zero:
            metrics = {"memopt/micro_batch_size": current[0], "memopt/oom_events": current[1]}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._batch_step)  # the step the events are recorded at
        self._last_written = current

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._pending_grads = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._uninstall_module_wrappers()
        for optimizer, previous in self._patched_optimizers:
            if previous is None:
                optimizer.__dict__.pop("step", None)
            else:
                optimizer.step = previous
        self._patched_optimizers.clear()
        if self._ddp_model is not None:
            self._ddp_model.require_backward_grad_sync = True
            self._ddp_model = None
        self._pending_grads = None
        self._trainer = self._module = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "oom_events": self.oom_events,
            "events": [dict(e) for e in self.events],
            "history": [dict(h) for h in self.history],
            "clean_batches": self._clean_batches,
            "grow_failures": self._grow_failures,
            "grow_wait": self._grow_wait,
            "initial_resolved": self._initial_resolved,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.micro_batch_size = state_dict.get("micro_batch_size", self.micro_batch_size)
        self.oom_events = int(state_dict.get("oom_events", 0))
        self.events = [dict(e) for e in state_dict.get("events", [])]
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self._clean_batches = int(state_dict.get("clean_batches", 0))
        self._grow_failures = int(state_dict.get("grow_failures", 0))
        self._grow_wait = int(state_dict.get("grow_wait", self.grow_after_steps or 0))
        self._initial_resolved = bool(state_dict.get("initial_resolved", self.micro_batch_size is not None))
        if self.micro_batch_size is not None:
            rank_zero_info(f"OOMRecovery: resuming with micro-batch size {self.micro_batch_size} ({self.oom_events} OOMs so far)")

    # ================================================================== manual optimization
    @staticmethod
    def run_micro_batches(module: LightningModule, batch: Any, step_fn: Callable[[Any], torch.Tensor | None]) -> torch.Tensor | None:
        """Forward and backward ``batch`` in micro-batches for a module with manual optimization.

        ``step_fn(micro_batch)`` returns the loss of a micro-batch (a mean over its samples/tokens, as
        for the whole batch); this helper scales it by the micro-batch's share, runs
        ``module.manual_backward`` on it and, on an OOM, frees the attempt's gradients (keeping
        those from before the call), shrinks the micro-batch and retries the same samples. Under
        DDP the new gradients are averaged over ranks before returning. Without an ``OOMRecovery``
        in ``module.trainer.callbacks`` it runs the whole batch once. Call ``zero_grad`` before and
        ``step`` after it, as usual.

        Returns:
            the whole-batch loss (detached), or ``None`` when ``step_fn`` returned ``None`` throughout.

        Example::

            def training_step(self, batch, batch_idx):
                opt = self.optimizers()
                opt.zero_grad()
                loss = OOMRecovery.run_micro_batches(self, batch, lambda mb: self.loss(mb))
                opt.step()
                self.log("train/loss", loss)
        """
        callback = OOMRecovery.find(module.trainer) if module._trainer is not None else None
        if callback is None or callback._module is not module:
            loss = step_fn(batch)
            if loss is not None:
                module.manual_backward(loss)
                return loss.detach()
            return None
        loss, _ = callback._run_step(module, batch, batch_idx=-1, compute=step_fn, mode="manual")
        return loss

    @staticmethod
    def find(trainer: Trainer) -> OOMRecovery | None:
        """The ``OOMRecovery`` among ``trainer.callbacks``, or ``None``."""
        for callback in trainer.callbacks:
            if isinstance(callback, OOMRecovery):
                return callback
        return None

    # ================================================================== wiring
    @staticmethod
    def _unsupported_strategy(trainer: Trainer) -> str | None:
        """Why OOMRecovery cannot run under this trainer's strategy, or ``None`` when it can."""
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        strategy = trainer.strategy
        supported = isinstance(strategy, SingleDeviceStrategy) or (
            isinstance(strategy, DDPStrategy)
            and not strategy.handles_gradient_accumulation
            and "deepspeed" not in type(strategy).__name__.lower()
        )
        if supported:
            return None
        return (
            f"OOMRecovery supports the single-device and DDP strategies (strategy='auto'|'ddp'|'ddp_spawn'), "
            f"got {type(strategy).__name__}: it is disabled for this run. Sharded strategies (FSDP, DeepSpeed) "
            "manage gradients themselves; remove OOMRecovery from the callbacks to silence this warning."
        )

    def _install_module_wrappers(self, module: LightningModule) -> None:
        if self._originals:
            return
        self._originals = {name: module.__dict__.get(name) for name in ("training_step", "backward")}
        original_training_step = module.training_step
        original_backward = module.backward
        callback = self

        @functools.wraps(original_training_step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if not module.automatic_optimization or not module.trainer.training:
                return original_training_step(*args, **kwargs)
            batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
            batch_idx = rest[0] if rest else kwargs.get("batch_idx", 0)

            def compute(micro: Any) -> Any:
                return original_training_step(micro, *rest, **kwargs)

            loss, output = callback._run_step(module, batch, batch_idx=int(batch_idx), compute=compute, mode="automatic")
            return output

        @functools.wraps(original_backward)
        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if callback._pending_grads is not None:
                # Lightning's backward of the detached whole-batch loss: the micro-batches already
                # produced the gradients; hand them over now, where Lightning expects them.
                callback._deliver_pending_grads(module)
                return None
            return original_backward(loss, *args, **kwargs)

        self._original_backward = original_backward
        module.training_step = training_step  # type: ignore[method-assign]
        module.backward = backward  # type: ignore[method-assign]

    def _uninstall_module_wrappers(self) -> None:
        module = self._module
        if module is None or not self._originals:
            return
        for name, previous in self._originals.items():
            if previous is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, previous)
        self._originals = {}

    def _bypass_ddp_reducer(self, trainer: Trainer) -> None:
        if not self._ddp:
            return
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            # Gradients are averaged by this callback once all micro-batches of all ranks succeeded;
            # the reducer would start collectives inside a backward that may still OOM on one rank.
            if self._ddp_model is None:
                self._ddp_model = model
            model.require_backward_grad_sync = False

    def _patch_optimizers(self, trainer: Trainer) -> None:
        if not self.retry_optimizer_step or self._patched_optimizers:
            return
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                rank_zero_warn("OOMRecovery: LBFGS re-evaluates its closure; optimizer-step OOMs are not retried for it.")
                continue
            previous = optimizer.__dict__.get("step")
            inner = optimizer.step  # bound; may already be an LR scheduler's counting wrapper
            optimizer.step = types.MethodType(self._guarded_step_function(inner), optimizer)  # type: ignore[method-assign]
            self._patched_optimizers.append((optimizer, previous))

    # ================================================================== the micro-batch loop
    def _batch_size(self, batch: Any) -> int:
        return int(self.batch_size_fn(batch)) if self.batch_size_fn is not None else infer_batch_size(batch)

    def _resolve_initial_micro_batch_size(self, trainer: Trainer, module: LightningModule, batch: Any, batch_size: int) -> int | None:
        """The size the first batch starts with; ``"estimate"`` sizes it from a fake-tensor estimate.

        Every rank estimates its own batch against its own free memory; the ranks then agree on the
        smallest result, so that they all start from the same size.
        """
        if self.initial_micro_batch_size != "estimate":
            return self.initial_micro_batch_size
        from lit_memopt.memory.estimate import EstimateError, initial_micro_batch_from_estimate

        try:
            size = initial_micro_batch_from_estimate(trainer, module, batch, self._free_bytes(module), DEFAULT_ESTIMATE_MARGIN)
        except EstimateError as exc:
            rank_zero_warn(f"OOMRecovery: initial_micro_batch_size='estimate' cannot size this step ({exc}); starting with the whole batch.")
            size = batch_size
        (negated,) = self._agree.max(-int(size))
        size = max(self.min_micro_batch_size, min(-negated, batch_size))
        rank_zero_info(f"OOMRecovery: estimated starting micro-batch size {size} of {batch_size}")
        return None if size >= batch_size else size

    @staticmethod
    def _free_bytes(module: LightningModule) -> int:
        """Memory free on the module's device now (CUDA: free device memory; CPU: available RAM)."""
        from lit_memopt.memory.stats import memory_snapshot

        return int(memory_snapshot(module.device).free_bytes)

    def _params(self, module: LightningModule) -> list[torch.nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]

    def _run_step(
        self,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        compute: Callable[[Any], Any],
        mode: str,
    ) -> tuple[torch.Tensor | None, Any]:
        trainer = module.trainer
        batch_size = self._batch_size(batch)
        # Sizes are decided from the largest batch over ranks, so that every rank takes the same
        # decisions (and issues the same collectives) even when the last batches differ in size.
        (global_batch_size,) = self._agree.max(batch_size)
        if not self._initial_resolved:
            self.micro_batch_size = self._resolve_initial_micro_batch_size(trainer, module, batch, global_batch_size)
            self._initial_resolved = True
        if self._ddp:
            self._bypass_ddp_reducer(trainer)
            self._broadcast_buffers(trainer, module)
        tokens = per_sample_tokens(batch, self.token_mask_key) if self.loss_weighting == "tokens" else None
        normalize = trainer.accumulate_grad_batches if mode == "automatic" else 1
        params = self._params(module)
        if mode == "automatic" and batch_idx % trainer.accumulate_grad_batches == 0:
            # Lightning zeroes gradients right after this training_step on the first batch of an
            # accumulation window: free them now instead of carrying them through the forward.
            for p in params:
                p.grad = None
        # Gradients from earlier batches of this optimizer step are set aside so that an OOM can
        # drop exactly this batch's partial gradients.
        stash = [p.grad for p in params]
        for p in params:
            p.grad = None

        size, grow_from = self._plan_size(trainer, global_batch_size)
        had_oom = False
        while True:
            self._cuda_measure_start(module.device)
            local_size = min(size, batch_size)
            status, phase, message, result = self._attempt(module, batch, batch_size, local_size, tokens, normalize, compute)
            if status == _OK:
                break
            self._free_attempt(params, trainer)
            if status == _ERROR:
                self._restore(params, stash)
                if isinstance(result, BaseException):
                    raise result
                raise OOMRecoveryError(
                    f"OOMRecovery: another rank failed with an error at step {trainer.global_step}; stopping this rank too."
                )
            had_oom = True
            self._record_oom(trainer, phase, size, message)
            if grow_from is not None:
                size = self._growth_failed(trainer, size, grow_from)
                grow_from = None
                continue
            if size <= self.min_micro_batch_size or (size <= 1):
                self._restore(params, stash)
                raise OOMRecoveryError(self._fatal_message(trainer, module, phase, size, message))
            new_size = max(self.min_micro_batch_size, shrink_size(size, global_batch_size, self.shrink))
            self._set_size(trainer, size, new_size, "oom")
            size = new_size

        total_loss, output, logs = result
        new_grads = [p.grad for p in params]
        self._restore(params, stash)
        self._after_success(trainer, module, size, min(size, batch_size), grow_from, had_oom)
        self._replay_logs(module, logs)
        if mode == "manual":
            self._add_grads(params, new_grads, sync=self._ddp, device=module.device)
        elif total_loss is not None:
            self._pending_grads = new_grads
            self._pending_sync = self._ddp and not self._should_accumulate(trainer, batch_idx)
        else:
            # Every micro-batch returned None: Lightning skips backward, so there is nothing to hand over.
            self._pending_grads = None
        return total_loss, output

    def _attempt(
        self,
        module: LightningModule,
        batch: Any,
        batch_size: int,
        size: int,
        tokens: torch.Tensor | None,
        normalize: int,
        compute: Callable[[Any], Any],
    ) -> tuple[int, str, str, Any]:
        """Run every micro-batch at ``size``; stop at the first failure on any rank."""
        micro_batches, shares = self._split(batch, batch_size, size, tokens)
        (count,) = self._agree.max(len(micro_batches))
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)
        device_type = module.device.type
        total: torch.Tensor | None = None
        outputs: list[tuple[Any, float]] = []
        logs: list[tuple[float, list[tuple[str, Any, tuple, dict]]]] = []
        for i in range(count):
            status, phase_code, message, error = _OK, 0, "", None
            if i < len(micro_batches):
                micro, share = micro_batches[i], shares[i]
                sink: list[tuple[str, Any, tuple, dict]] = []
                phase_code = _PHASE_CODES["forward"]
                out = loss = scaled = None
                try:
                    with self._capture_logs(module, sink):
                        out = compute(micro)
                    loss = self._loss_of(out)
                    if loss is not None:
                        phase_code = _PHASE_CODES["backward"]
                        scaled = loss * (share / normalize)
                        if module.automatic_optimization:
                            if scaler is not None:
                                scaled = scaler.scale(scaled)
                            call_with_autocast_disabled(lambda: self._original_backward(scaled), device_type)
                        else:
                            call_with_autocast_disabled(lambda: module.manual_backward(scaled), device_type)
                        contribution = loss.detach() * share
                        total = contribution if total is None else total + contribution
                    outputs.append((self._detach_output(out), share))
                    logs.append((share, sink))
                except Exception as e:  # noqa: BLE001 - classified right below, re-raised if not an OOM
                    if is_oom_error(e):
                        status, message = _OOM, str(e).strip().splitlines()[0][:500] if str(e).strip() else repr(e)
                    else:
                        status, error = _ERROR, e
                # Outside the except block: the OOM's traceback (and the frames holding activations)
                # is gone; drop this attempt's tensors before anything else allocates.
                out = loss = scaled = None
            # Only a failing rank names a phase: the MAX then carries the failing phase to every rank.
            status, phase_code = self._agree.max(status, phase_code if status != _OK else 0)
            if status != _OK:
                return status, _PHASES.get(phase_code, "unknown"), message or "OOM on another rank", error
        return _OK, "", "", (total, self._combine_outputs(outputs, total, normalize), logs)

    def _split(self, batch: Any, batch_size: int, size: int, tokens: torch.Tensor | None) -> tuple[list[Any], list[float]]:
        if self.split_fn is not None:
            micro_batches = list(self.split_fn(batch, size))
            sizes = [self._batch_size(mb) for mb in micro_batches]
            if sum(sizes) != batch_size:
                raise ValueError(
                    f"OOMRecovery: split_fn returned micro-batches of {sizes} samples for a batch of {batch_size}; "
                    "they must cover every sample exactly once"
                )
            bounds, start = [], 0
            for n in sizes:
                bounds.append((start, start + n))
                start += n
        else:
            bounds = micro_batch_bounds(batch_size, size)
            micro_batches = [slice_batch(batch, s, e, batch_size) if (s, e) != (0, batch_size) else batch for s, e in bounds]
        if self.loss_weighting == "none":
            shares = [1.0] * len(bounds)
        elif self.loss_weighting == "tokens" and tokens is not None and int(tokens.sum()) > 0:
            total = float(tokens.sum())
            shares = [float(tokens[s:e].sum()) / total for s, e in bounds]
        else:
            shares = [(e - s) / batch_size for s, e in bounds]
        return micro_batches, shares

    @staticmethod
    def _loss_of(output: Any) -> torch.Tensor | None:
        if output is None:
            return None
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, Mapping):
            if "loss" not in output:
                raise MisconfigurationException("training_step returned a dict without a 'loss' key")
            return output["loss"]
        raise MisconfigurationException(
            f"training_step must return a Tensor, a dict with 'loss', or None; got {type(output).__name__}"
        )

    @staticmethod
    def _detach_output(output: Any) -> Any:
        if isinstance(output, Mapping):
            return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in output.items()}
        return None if output is None else True

    @staticmethod
    def _combine_outputs(outputs: list[tuple[Any, float]], total: torch.Tensor | None, normalize: int) -> Any:
        if total is None:
            return None
        dicts = [(o, s) for o, s in outputs if isinstance(o, Mapping)]
        if not dicts:
            return total
        combined: dict[str, Any] = {"loss": total}
        for key in dicts[-1][0]:
            if key == "loss":
                continue
            values = [(o[key], s) for o, s in dicts if key in o]
            if all(isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point() for v, _ in values):
                weight = sum(s for _, s in values)
                combined[key] = sum(v * s for v, s in values) / weight
            else:
                combined[key] = values[-1][0]
        return combined

    # ------------------------------------------------------------------ logging inside the step
    @contextmanager
    def _capture_logs(self, module: LightningModule, sink: list) -> Iterator[None]:
        previous = module.__dict__.get("log")

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            sink.append((name, value, args, kwargs))

        module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            if previous is None:
                module.__dict__.pop("log", None)
            else:
                module.log = previous  # type: ignore[method-assign]

    def _replay_logs(self, module: LightningModule, logs: list[tuple[float, list]]) -> None:
        if not any(sink for _, sink in logs):
            return
        names: dict[str, list[tuple[Any, float, tuple, dict]]] = {}
        for share, sink in logs:
            for name, value, args, kwargs in sink:
                names.setdefault(name, []).append((value, share, args, kwargs))
        for name, calls in names.items():
            value, _, args, kwargs = calls[-1]
            if len(calls) == 1:
                module.log(name, value, *args, **kwargs)  # one micro-batch: nothing to combine
                continue
            if self._log_signature is None:
                self._log_signature = inspect.signature(type(module).log)
            try:
                bound = self._log_signature.bind(module, name, value, *args, **kwargs)
                reduce_fx = bound.arguments.get("reduce_fx", "mean")
            except TypeError:
                reduce_fx = "mean"
            combined = self._reduce_logged([(v, s) for v, s, _, _ in calls], reduce_fx)
            module.log(name, combined, *args, **kwargs)

    @staticmethod
    def _reduce_logged(values: list[tuple[Any, float]], reduce_fx: Any) -> Any:
        last = values[-1][0]
        if len(values) == 1 or not all(isinstance(v, (torch.Tensor, int, float)) and not isinstance(v, bool) for v, _ in values):
            return last  # e.g. a torchmetrics Metric: it accumulated its own state per micro-batch
        device = last.device if isinstance(last, torch.Tensor) else None
        tensors = torch.stack([torch.as_tensor(v, device=device).detach().float().reshape(()) for v, _ in values])
        fx = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
        if fx == "mean":
            weights = torch.tensor([s for _, s in values], dtype=tensors.dtype, device=tensors.device)
            return (tensors * weights).sum() / weights.sum()
        if fx == "sum":
            return tensors.sum()
        if fx in ("max", "amax"):
            return tensors.max()
        if fx in ("min", "amin"):
            return tensors.min()
        return last

    # ------------------------------------------------------------------ gradients
    @staticmethod
    def _restore(params: list[torch.nn.Parameter], stash: list[torch.Tensor | None]) -> None:
        for p, g in zip(params, stash):
            p.grad = g

    def _add_grads(self, params: list[torch.nn.Parameter], new_grads: list[torch.Tensor | None], sync: bool, device: torch.device) -> None:
        if sync:
            # Average only this batch's gradients: earlier accumulated ones were averaged already.
            stash = [p.grad for p in params]
            for p, g in zip(params, new_grads):
                p.grad = g
            all_reduce_gradients(params, device)
            new_grads = [p.grad for p in params]
            self._restore(params, stash)
        for p, g in zip(params, new_grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def _deliver_pending_grads(self, module: LightningModule) -> None:
        pending, self._pending_grads = self._pending_grads, None
        params = self._params(module)
        self._add_grads(params, pending or [], sync=False, device=module.device)
        if self._pending_sync:
            all_reduce_gradients(params, module.device)

    @staticmethod
    def _should_accumulate(trainer: Trainer, batch_idx: int) -> bool:
        try:
            return bool(trainer.fit_loop._should_accumulate())
        except AttributeError:  # pragma: no cover - older/newer loop internals: sync every batch (still exact)
            return False

    def _broadcast_buffers(self, trainer: Trainer, module: LightningModule) -> None:
        model = trainer.strategy.model
        if getattr(model, "broadcast_buffers", False):
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)

    def _free_attempt(self, params: list[torch.nn.Parameter], trainer: Trainer) -> None:
        for p in params:
            p.grad = None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
            # No unscale_ has happened in this step yet; start the step's scaler bookkeeping afresh.
            from torch.amp.grad_scaler import _refresh_per_optimizer_state
            from collections import defaultdict

            scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        _empty_cache()

    # ------------------------------------------------------------------ sizes
    def _size_cap(self, batch_size: int) -> int:
        return min(batch_size, self.max_micro_batch_size or batch_size)

    def _plan_size(self, trainer: Trainer, batch_size: int) -> tuple[int, int | None]:
        size = min(self.micro_batch_size or batch_size, batch_size)
        size = max(size, min(self.min_micro_batch_size, batch_size))
        if self.grow_after_steps is None or self.micro_batch_size is None:
            return size, None
        cap = self._size_cap(batch_size)
        # Every input here is identical on all ranks, so either all ranks reach the collective or none.
        if size >= cap or self._clean_batches < self._grow_wait:
            return size, None
        target = min(cap, grow_size(size, batch_size, self.shrink))
        (blocked,) = self._agree.max(0 if self._headroom_allows(size, target) else 1)
        if blocked:
            self._clean_batches = 0
            return size, None
        return target, size

    def _after_success(
        self, trainer: Trainer, module: LightningModule, size: int, local_size: int, grow_from: int | None, had_oom: bool
    ) -> None:
        self._last_effective_size = local_size
        self._cuda_measure_end(module.device, local_size)
        if grow_from is not None:
            self._set_size(trainer, grow_from, size, "grow")
            self._clean_batches = 0
        elif had_oom:
            self._clean_batches = 0  # a recovered batch is not a clean one
        else:
            self._clean_batches += 1

    def _growth_failed(self, trainer: Trainer, tried: int, previous: int) -> int:
        self._grow_failures += 1
        self._grow_wait = (self.grow_after_steps or 0) * 2 ** min(self._grow_failures, _MAX_BACKOFF_EXPONENT)
        self._clean_batches = 0
        self.history.append({"step": trainer.global_step, "from": tried, "to": previous, "reason": "grow_failed"})
        rank_zero_info(
            f"OOMRecovery: growing the micro-batch to {tried} ran out of memory at step {trainer.global_step}; "
            f"back to {previous}, next try after {self._grow_wait} clean batches"
        )
        return previous

    def _set_size(self, trainer: Trainer, old: int, new: int, reason: str) -> None:
        self.micro_batch_size = new
        self._clean_batches = 0
        self.history.append({"step": trainer.global_step, "from": old, "to": new, "reason": reason})
        rank_zero_info(f"OOMRecovery: micro-batch size {old} -> {new} at step {trainer.global_step} ({reason})")
        monitor = _memory_monitor(trainer)
        if monitor is not None:
            monitor.metrics.record_batch_size_change(
                trainer.global_step, old, new, accumulate_grad_batches=trainer.accumulate_grad_batches, reason=reason
            )

    def _record_oom(self, trainer: Trainer, phase: str, size: int, message: str) -> None:
        self.oom_events += 1
        event = {"step": trainer.global_step, "phase": phase, "micro_batch_size": size, "message": message}
        self.events.append(event)
        monitor = _memory_monitor(trainer)
        if monitor is not None:
            monitor.metrics.record_oom(trainer.global_step, message, rank=trainer.global_rank, phase=phase, batch_size=size)

    # ------------------------------------------------------------------ CUDA headroom
    def _cuda_measure_start(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._cuda_base = torch.cuda.memory_allocated(device)
            if self._trainer is None or _memory_monitor(self._trainer) is None:
                # MemoryMonitor resets the peak at each phase itself; the loop is inside its forward phase.
                torch.cuda.reset_peak_memory_stats(device)

    def _cuda_measure_end(self, device: torch.device, size: int) -> None:
        if device.type == "cuda":
            self._cuda_last = (self._cuda_base, torch.cuda.max_memory_allocated(device), size, device.index or 0)

    def _headroom_allows(self, size: int, target: int) -> bool:
        if self._cuda_last is None:
            return True  # no device statistics: try, and step back on OOM
        base, peak, measured_size, index = self._cuda_last
        total = torch.cuda.get_device_properties(index).total_memory
        predicted = base + (peak - base) * target / max(measured_size, 1)
        return predicted <= self.max_memory_fraction * total

    # ------------------------------------------------------------------ optimizer step
    def _guarded_step_function(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        callback = self

        def step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                # The closure runs the micro-batch loop (which handles its own OOMs); only the update
                # itself is guarded below, so a retry never re-runs forward/backward.
                with torch.enable_grad():
                    loss = closure()
            callback._step_with_retry(optimizer, inner, kwargs)
            return loss

        return step

    def _step_with_retry(self, optimizer: torch.optim.Optimizer, inner: Callable[..., Any], kwargs: dict) -> None:
        trainer = self._trainer
        snapshot = _OptimizerSnapshot(optimizer)
        status, retryable, message, error = self._try_step(inner, kwargs, snapshot)
        (agreed, any_fatal) = self._agree.max(status, 0 if status != _OOM or retryable else 1)
        if agreed == _OK:
            return
        step = trainer.global_step if trainer is not None else -1
        if status == _ERROR:
            raise error  # type: ignore[misc]
        if agreed == _ERROR:
            raise OOMRecoveryError(f"OOMRecovery: another rank failed in the optimizer step at step {step}; stopping this rank too.")
        if status == _OOM and trainer is not None:
            self._record_oom(trainer, "optimizer", self._last_effective_size or 0, message)
        if any_fatal:
            raise OOMRecoveryError(self._optimizer_fatal_message(step, message, retryable=False, local=status == _OOM))
        # Every failing rank can retry exactly: nothing was updated. Free memory and try once more.
        if status == _OOM:
            _empty_cache()
            status, retryable, message2, error = self._try_step(inner, kwargs, snapshot)
            message = message2 or message
        (agreed,) = self._agree.max(status)
        if agreed == _OK:
            rank_zero_info(f"OOMRecovery: the optimizer step at step {step} ran out of memory and succeeded on retry")
            return
        if status == _ERROR:
            raise error  # type: ignore[misc]
        raise OOMRecoveryError(self._optimizer_fatal_message(step, message, retryable=True, local=status == _OOM))

    def _try_step(self, inner: Callable[..., Any], kwargs: dict, snapshot: _OptimizerSnapshot) -> tuple[int, bool, str, Any]:
        status, message, error = _OK, "", None
        try:
            inner(**kwargs)
        except Exception as e:  # noqa: BLE001 - classified right below
            if is_oom_error(e):
                status, message = _OOM, str(e).strip().splitlines()[0][:500] if str(e).strip() else repr(e)
            else:
                status, error = _ERROR, e
        if status != _OOM:
            return status, False, message, error
        retryable = not snapshot.modified()
        snapshot.drop_new_state()
        return status, retryable, message, None

    def _optimizer_fatal_message(self, step: int, message: str, retryable: bool, local: bool) -> str:
        where = "on this rank" if local else "on another rank"
        why = (
            "it ran out of memory again after freeing memory and retrying"
            if retryable
            else "it had already updated parameters or optimizer state in place, so retrying would apply part of the update twice"
        )
        device = self._module.device if self._module is not None else torch.device("cpu")
        return (
            f"OOMRecovery: out of memory in the optimizer step at step {step} {where}; {why}. "
            f"Memory: {_memory_state(device)}. Error: {message or 'n/a'}. "
            "Micro-batching cannot shrink the optimizer's memory: use an optimizer with less state, "
            "`foreach=False`, or a sharded strategy. Weights are those of the last completed step; "
            f"{_checkpoint_note(self._trainer)}"
        )

    def _fatal_message(self, trainer: Trainer, module: LightningModule, phase: str, size: int, message: str) -> str:
        return (
            f"OOMRecovery: out of memory in {phase} at step {trainer.global_step} (epoch {trainer.current_epoch}) "
            f"with micro-batch size {size}, which is min_micro_batch_size={self.min_micro_batch_size}: cannot shrink "
            f"further. Memory: {_memory_state(module.device)}. Error: {message}. "
            "Weights are those of the last completed optimizer step; this step's gradients were freed. "
            f"{_checkpoint_note(trainer)} Reduce the sequence length or model size, enable activation "
            "checkpointing, or use a device with more memory."
        )


class _OptimizerSnapshot:
    """Version counters of parameters and optimizer state before a step: tells whether a failed step changed anything."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state_keys = {p: set(s.keys()) for p, s in optimizer.state.items()}
        self.versions: list[tuple[torch.Tensor, int]] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.versions.append((p, p._version))
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        self.versions.append((v, v._version))

    def modified(self) -> bool:
        return any(t._version != v for t, v in self.versions)

    def drop_new_state(self) -> None:
        """Forget state created by the failed attempt (fresh zeros), so a retry initialises it again."""
        state = self.optimizer.state
        for p in list(state.keys()):
            if p not in self.state_keys:
                del state[p]
            else:
                for key in set(state[p].keys()) - self.state_keys[p]:
                    del state[p][key]


# ---------------------------------------------------------------------------------- helpers
def _empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


def _memory_monitor(trainer: Trainer) -> Any:
    """The MemoryMonitor of this run, if any (found by duck typing: no import dependency)."""
    for callback in trainer.callbacks:
        metrics = getattr(callback, "metrics", None)
        if type(callback).__name__ == "MemoryMonitor" and hasattr(metrics, "record_oom"):
            return callback
    return None


def _memory_state(device: torch.device) -> str:
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


def _checkpoint_note(trainer: Trainer | None) -> str:
    callback = getattr(trainer, "checkpoint_callback", None) if trainer is not None else None
    path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") if callback else ""
    if path:
        return f"The last good checkpoint is {path} (not overwritten)."
    return "No checkpoint was written by this failure."

