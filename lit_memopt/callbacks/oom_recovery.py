"""``OOMRecovery``: dynamic micro-batching that survives out-of-memory errors mid-training.

The loader batch stays one optimizer step; it is split into micro-batches whose size shrinks on
an OOM (the same samples are retried) and grows back when memory allows, on every rank alike.

This file wires Lightning's hooks. The pieces it runs, each readable alone:
``_micro_batch_loop`` (the loop), ``_size_policy`` (sizes, back-off, state), ``_log_replay``
(``self.log`` inside the step), ``_optimizer_retry`` (an OOM in ``optimizer.step``),
``_gradient_sync`` (single device / DDP / FSDP2) and ``_rank_agreement`` (how ranks decide together).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memopt._compat.lightning import attached_trainer, should_accumulate
from lit_memopt._compat.torch import reset_grad_scaler_step
from lit_memopt.callbacks._gradient_sync import GradientSync, SingleDeviceSync, select_gradient_sync
from lit_memopt.callbacks._log_replay import LogReplay
from lit_memopt.callbacks._micro_batch_loop import (
    LOSS_WEIGHTINGS,
    SplitOptions,
    add_gradients,
    restore_gradients,
    empty_cache,
    run_attempt,
    split_batch,
)
from lit_memopt.callbacks._micro_batching import per_sample_tokens
from lit_memopt.callbacks._oom_messages import micro_batch_fatal_message, optimizer_fatal_message
from lit_memopt.callbacks._optimizer_retry import OptimizerStepRetry
from lit_memopt.callbacks._rank_agreement import ERROR, OK, RankAgreement
from lit_memopt.callbacks._size_policy import SHRINK_POLICIES, MicroBatchSizePolicy, estimated_initial_size

__all__ = ["OOMRecovery", "OOMRecoveryError"]

# Share of free memory kept in reserve when sizing the first micro-batch from an estimate.
DEFAULT_ESTIMATE_MARGIN = 0.1


class OOMRecoveryError(RuntimeError):
    """Training cannot go on: an out-of-memory error that ``OOMRecovery`` could not recover from.

    ``oom_recorded`` is true when the OOM behind it was already recorded as an event (in
    ``OOMRecovery.events`` and a ``MemoryMonitor``), so the monitor does not count it a second time.
    """

    def __init__(self, message: str, *, oom_recorded: bool = False) -> None:
        super().__init__(message)
        self.oom_recorded = oom_recorded


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
    ``"16-mixed"`` (the ``GradScaler`` scales every micro-batch), and with single-device, DDP and
    FSDP2 (Lightning's ``ModelParallelStrategy`` with data parallelism, ``fully_shard`` in
    ``configure_model``) strategies. Under DeepSpeed, FSDP1 or tensor parallelism it says in one line
    why at ``setup`` and stays inactive. Manual optimization opts in with :meth:`run_micro_batches`.

    DDP: every decision is taken by all ranks together through one small ``all_reduce`` (MAX) per
    micro-batch attempt, issued in the same order by every rank, so an OOM on one rank only neither
    hangs nor desynchronises the others. Micro-batch backward passes never synchronise; gradients
    are averaged once per optimizer step by this callback (in buckets, like DDP's reducer; DDP's own
    reducer and communication hooks are bypassed and buffers are broadcast from rank 0 each batch).

    FSDP2: every FSDP all-gather and reduce-scatter is preceded by the same agreement (guarded
    collectives installed with ``set_custom_all_gather`` / ``set_custom_reduce_scatter``), so a rank
    that fails mid-forward or mid-backward is met by the others at their next collective instead of
    leaving them inside it. After a failed attempt the FSDP roots are reset (``reset_iter_state``) and
    the unsharded gradient buffers dropped; gradients stay reduce-scattered per micro-batch. The
    strategy-specific parts live in ``lit_memopt/callbacks/_gradient_sync.py``.

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
        if shrink not in SHRINK_POLICIES:
            raise ValueError(f"OOMRecovery: shrink must be one of {SHRINK_POLICIES}, got {shrink!r}")
        if grow_after_steps is not None and (not isinstance(grow_after_steps, int) or grow_after_steps < 1):
            raise ValueError(f"OOMRecovery: grow_after_steps must be None or an int >= 1, got {grow_after_steps!r}")
        if not isinstance(max_memory_fraction, (int, float)) or not 0.0 < max_memory_fraction <= 1.0:
            raise ValueError(f"OOMRecovery: max_memory_fraction must be in (0, 1], got {max_memory_fraction!r}")
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"OOMRecovery: loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}")
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

        # State that survives a restart lives in the policy (state_dict below).
        self.policy = MicroBatchSizePolicy(
            initial_micro_batch_size if isinstance(initial_micro_batch_size, int) else None,
            min_micro_batch_size, max_micro_batch_size, shrink, grow_after_steps, self.max_memory_fraction,
        )
        self.policy.on_change = self._notify_size_change
        self.policy.on_oom = self._notify_oom
        self._initial_resolved = initial_micro_batch_size is None or isinstance(initial_micro_batch_size, int)
        self._split_options = SplitOptions(loss_weighting, split_fn, batch_size_fn)

        # --- per-run wiring ---
        self._module: LightningModule | None = None
        self._trainer: Trainer | None = None
        self._originals: dict[str, Any] = {}
        self._original_backward: Callable[..., Any] | None = None
        self._pending_grads: list[torch.Tensor | None] | None = None
        self._pending_sync = False
        self._agree = RankAgreement()
        self._sync: GradientSync = SingleDeviceSync(self._agree)
        self._optimizer_retry = OptimizerStepRetry(
            agree=lambda: self._agree, on_oom=self._record_optimizer_oom, fatal=self._optimizer_fatal_message,
            error_type=OOMRecoveryError, free_memory=empty_cache, current_step=self._current_step,
        )
        self._log_replay = LogReplay()
        self._last_effective_size: int | None = None
        self._last_written: tuple[float, float] | None = None
        self._batch_step = 0
        self._disabled = False

    # Public views of the policy's state (read by users, tests and MemoryMonitor).
    @property
    def micro_batch_size(self) -> int | None:
        return self.policy.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value: int | None) -> None:
        self.policy.micro_batch_size = value

    @property
    def oom_events(self) -> int:
        return self.policy.oom_events

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.policy.events

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.policy.history

    @property
    def _grow_wait(self) -> int:
        # Clean batches the policy waits for before the next growth try (tests shorten it).
        return self.policy.grow_wait

    @_grow_wait.setter
    def _grow_wait(self, value: int) -> None:
        self.policy.grow_wait = value

    @property
    def gradient_sync(self) -> str:
        """The active backend: ``"single device"``, ``"DDP"`` or ``"FSDP2"``."""
        return self._sync.name

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
        self._agree = RankAgreement.for_trainer(trainer)
        sync = select_gradient_sync(trainer, self._agree)
        self._disabled = isinstance(sync, str)
        if isinstance(sync, str):
            # A warning, not an error: OOMRecovery is in the default callbacks, and a recipe run with
            # an unsupported strategy should still train (without micro-batching).
            rank_zero_warn(sync)
            return
        self._sync = sync
        self._trainer, self._module = trainer, pl_module
        self._last_written = None  # every fit writes its first row
        self._install_module_wrappers(pl_module)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._disabled:
            return
        # The strategy has set the model up by now (DDP wrapper, FSDP2 shards): attach to it.
        self._sync.attach(trainer, pl_module)
        if self._sync.name != "single device":
            rank_zero_info(f"OOMRecovery: {self._sync.name} gradient sync; ranks agree before every collective that can fail")
        if self.retry_optimizer_step:
            self._optimizer_retry.patch(trainer.optimizers)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.log_metrics or self._disabled:
            return
        size = self._last_effective_size
        if size is None:
            try:
                size = self.micro_batch_size or self._split_options.batch_size(batch)
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
        self._optimizer_retry.unpatch()
        self._sync.detach()
        self._pending_grads = None
        self._trainer = self._module = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**self.policy.state_dict(), "initial_resolved": self._initial_resolved}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict)
        self._initial_resolved = bool(state_dict.get("initial_resolved", self.micro_batch_size is not None))
        if self.micro_batch_size is not None:
            rank_zero_info(f"OOMRecovery: resuming with micro-batch size {self.micro_batch_size} ({self.oom_events} OOMs so far)")

    # ================================================================== manual optimization
    @staticmethod
    def run_micro_batches(
        module: LightningModule,
        batch: Any,
        step_fn: Callable[[Any], torch.Tensor | None],
        sample_weights: Sequence[float] | torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward ``batch`` in micro-batches for a module with manual optimization.

        ``step_fn(micro_batch)`` returns the loss of a micro-batch, normalised as the whole batch's
        loss is: a mean over its samples, or over its tokens, or a sum. This helper scales it by the
        micro-batch's share, runs ``module.manual_backward`` on it and, on an OOM, frees the attempt's
        gradients (keeping those from before the call), shrinks the micro-batch and retries the same
        samples. Under DDP the new gradients are averaged over ranks before returning; under FSDP2
        they were reduce-scattered in backward. Without an ``OOMRecovery`` in
        ``module.trainer.callbacks`` it runs the whole batch once. Call ``zero_grad`` before and
        ``step`` after it, as usual.

        Args:
            sample_weights: how much each sample counts in the batch's loss: ``None`` takes the
                callback's ``loss_weighting``; per-sample token counts for a token-mean loss, ones for a
                sample-mean loss. Shares are ``sum(weights[micro]) / sum(weights)``, so the split step
                equals the unsplit one whatever the callback's configuration.

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
        trainer = attached_trainer(module)
        callback = OOMRecovery.find(trainer) if trainer is not None else None
        if callback is None or callback._module is not module:
            loss = step_fn(batch)
            if loss is not None:
                module.manual_backward(loss)
                return loss.detach()
            return None
        weights = None
        if sample_weights is not None:
            weights = torch.as_tensor(sample_weights, dtype=torch.float64).reshape(-1).cpu()
        loss, _ = callback._run_step(module, batch, batch_idx=-1, compute=step_fn, mode="manual", weights=weights)
        return loss

    @staticmethod
    def find(trainer: Trainer) -> OOMRecovery | None:
        """The ``OOMRecovery`` among ``trainer.callbacks``, or ``None``."""
        for callback in trainer.callbacks:
            if isinstance(callback, OOMRecovery):
                return callback
        return None

    # ================================================================== wiring
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

    # ================================================================== one batch
    def _resolve_initial_micro_batch_size(self, trainer: Trainer, module: LightningModule, batch: Any, batch_size: int) -> int | None:
        """The size the first batch starts with (``"estimate"``: from a fake-tensor estimate, smallest over ranks)."""
        if self.initial_micro_batch_size != "estimate":
            return self.initial_micro_batch_size
        return estimated_initial_size(
            trainer, module, batch, batch_size, self._free_bytes(module), DEFAULT_ESTIMATE_MARGIN, self.min_micro_batch_size,
            self._agree,
        )

    @staticmethod
    def _free_bytes(module: LightningModule) -> int:
        """Memory free on the module's device now (CUDA: free device memory; CPU: available RAM)."""
        from lit_memopt.memory.stats import memory_snapshot

        return int(memory_snapshot(module.device).free_bytes)

    @staticmethod
    def _params(module: LightningModule) -> list[torch.nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]

    def _run_step(
        self,
        module: LightningModule,
        batch: Any,
        batch_idx: int,
        compute: Callable[[Any], Any],
        mode: str,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, Any]:
        trainer = module.trainer
        batch_size = self._split_options.batch_size(batch)
        # Sizes are decided from the largest batch over ranks, so that every rank takes the same
        # decisions (and issues the same collectives) even when the last batches differ in size.
        (global_batch_size,) = self._agree.max(batch_size)
        if not self._initial_resolved:
            self.micro_batch_size = self._resolve_initial_micro_batch_size(trainer, module, batch, global_batch_size)
            self._initial_resolved = True
        self._sync.before_batch(trainer, module)
        options = self._split_options
        if weights is not None:
            if weights.numel() != batch_size:
                raise ValueError(
                    f"OOMRecovery.run_micro_batches: sample_weights has {weights.numel()} entries for a batch of "
                    f"{batch_size} samples; give one weight per sample"
                )
            options = SplitOptions("tokens", options.split_fn, options.batch_size_fn)
        elif self.loss_weighting == "tokens":
            weights = per_sample_tokens(batch, self.token_mask_key)
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
        backward = self._original_backward if mode == "automatic" else module.manual_backward
        cuda_peak_reset = _memory_monitor(trainer) is None  # MemoryMonitor resets peaks per phase itself

        size, grow_from = self.policy.plan(global_batch_size, self._agree)
        had_oom = False
        while True:
            self.policy.measure_start(module.device, reset_peak=cuda_peak_reset)
            micro_batches, shares = split_batch(batch, batch_size, min(size, batch_size), weights, options)
            attempt = run_attempt(module, micro_batches, shares, normalize, compute, backward, self._agree, self._sync)
            if attempt.status == OK:
                break
            self._free_attempt(params, trainer, module)
            if attempt.status == ERROR:
                restore_gradients(params, stash)
                if attempt.error is not None:
                    raise attempt.error
                raise OOMRecoveryError(
                    f"OOMRecovery: another rank failed with an error at step {trainer.global_step}; stopping this rank too."
                )
            had_oom = True
            self.policy.record_oom(trainer.global_step, attempt.phase, size, attempt.message)
            if grow_from is not None:
                size, grow_from = self.policy.growth_failed(trainer.global_step, size, grow_from), None
                continue
            if not self.policy.can_shrink(size):
                restore_gradients(params, stash)
                raise OOMRecoveryError(
                    self._fatal_message(trainer, module, attempt.phase, size, attempt.message), oom_recorded=True
                )
            size = self.policy.shrunk(size, global_batch_size, trainer.global_step)

        new_grads = [p.grad for p in params]
        restore_gradients(params, stash)
        self._last_effective_size = min(size, batch_size)
        self.policy.measure_end(module.device, self._last_effective_size)
        self.policy.succeeded(trainer.global_step, size, grow_from, had_oom)
        self._log_replay.replay(module, attempt.logs or [])
        if mode == "manual":
            self._add_grads(params, new_grads, average=self._sync.averages_after_step, device=module.device)
        elif attempt.loss is not None:
            self._pending_grads = new_grads
            self._pending_sync = self._sync.averages_after_step and not should_accumulate(trainer)
        else:
            # Every micro-batch returned None: Lightning skips backward, so there is nothing to hand over.
            self._pending_grads = None
        return attempt.loss, attempt.output

    # ------------------------------------------------------------------ gradients
    def _add_grads(self, params: list[torch.nn.Parameter], new_grads: list[torch.Tensor | None], average: bool, device: torch.device) -> None:
        add_gradients(params, new_grads, (lambda: self._sync.average(params, device)) if average else None)

    def _deliver_pending_grads(self, module: LightningModule) -> None:
        pending, self._pending_grads = self._pending_grads, None
        params = self._params(module)
        self._add_grads(params, pending or [], average=False, device=module.device)
        if self._pending_sync:
            self._sync.average(params, module.device)

    def _free_attempt(self, params: list[torch.nn.Parameter], trainer: Trainer, module: LightningModule) -> None:
        for p in params:
            p.grad = None
        self._sync.after_failed_attempt(module)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            # No unscale_ has happened in this step yet; start the step's scaler bookkeeping afresh.
            reset_grad_scaler_step(scaler)
        empty_cache()

    # ------------------------------------------------------------------ events
    def _notify_size_change(self, record: dict[str, Any]) -> None:
        monitor = _memory_monitor(self._trainer) if self._trainer is not None else None
        if monitor is not None:
            monitor.metrics.record_batch_size_change(
                record["step"], record["from"], record["to"],
                accumulate_grad_batches=self._trainer.accumulate_grad_batches, reason=record["reason"],
            )

    def _notify_oom(self, event: dict[str, Any]) -> None:
        monitor = _memory_monitor(self._trainer) if self._trainer is not None else None
        if monitor is not None:
            monitor.metrics.record_oom(
                event["step"], event["message"], rank=self._trainer.global_rank, phase=event["phase"],
                batch_size=event["micro_batch_size"],
            )

    def _record_optimizer_oom(self, message: str) -> None:
        self.policy.record_oom(self._current_step(), "optimizer", self._last_effective_size or 0, message)

    def _current_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else -1

    # ------------------------------------------------------------------ messages
    def _optimizer_fatal_message(self, message: str, retryable: bool, local: bool) -> str:
        device = self._module.device if self._module is not None else torch.device("cpu")
        return optimizer_fatal_message(self._current_step(), message, retryable, local, device, self._trainer)

    def _fatal_message(self, trainer: Trainer, module: LightningModule, phase: str, size: int, message: str) -> str:
        return micro_batch_fatal_message(trainer, module.device, phase, size, self.min_micro_batch_size, message)


# ---------------------------------------------------------------------------------- helpers
def _memory_monitor(trainer: Trainer | None) -> Any:
    """The MemoryMonitor of this run, if any."""
    if trainer is None:
        return None
    from lit_memopt.callbacks.memory_monitor import MemoryMonitor

    return MemoryMonitor.find(trainer)
