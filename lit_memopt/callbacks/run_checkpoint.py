"""``RunCheckpoint``: checkpoints during training (steps, minutes, validations, the end, a stop signal), written atomically."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence
from weakref import proxy

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lit_memopt._compat.lightning import record_checkpoint_written, save_checkpoint_now, set_checkpoint_triggers

__all__ = ["RunCheckpoint", "CHECKPOINT_FILENAME", "TEMPORARY_SUFFIX"]

CHECKPOINT_FILENAME = "step_{step:06d}"  # step_000120.ckpt: sorts by step; no "=", which Hydra overrides would need quoted
TEMPORARY_SUFFIX = ".tmp"  # a checkpoint being written; renamed to its final name once complete
_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


class RunCheckpoint(ModelCheckpoint):
    """Save a run's checkpoints while it trains, so that a killed or preempted run loses little.

    One ``ModelCheckpoint`` with all its triggers armed at once: every ``every_n_steps`` optimizer steps, when
    ``every_n_minutes`` of training passed since the last save, after each validation (``on_validation``), and at the
    end of ``fit``. Files are ``step_NNNNNN.ckpt`` in ``dirpath`` (directories for the sharded checkpoints of
    ``trainer=fsdp2``); ``last.ckpt`` is a link to the newest; the newest ``keep_last`` are kept (``save_top_k`` on
    the step) and the checkpoint a run resumed from is never deleted.

    Every write is atomic: the checkpoint is written to ``NAME.tmp`` and renamed to ``NAME`` once complete
    (``os.replace``), so a run killed while writing leaves the previous checkpoints loadable and no partial ``NAME``.

    On one of ``save_on_signals`` (e.g. SIGTERM from a scheduler, SIGUSR1 from a preemption notice), the handler only
    records the signal; at the next batch boundary the ranks agree (a max-reduction, so a signal to any rank counts),
    every rank saves its part of the checkpoint together, and the trainer stops (``trainer.should_stop``). Under SLURM
    with auto-requeue Lightning's own handlers stay in charge (they save ``hpc_ckpt_N.ckpt`` and requeue the job).

    Args:
        dirpath: folder of the checkpoints.
        every_n_steps: save every N optimizer steps; ``None`` turns the step trigger off.
        every_n_minutes: save when this many minutes of training passed since the last save; ``None`` turns it off.
        keep_last: keep the newest k checkpoints; ``None`` keeps all.
        on_validation: also save after each validation.
        save_on_signals: names of the signals that save and stop (``SIGTERM``, ``SIGUSR1``, ...); empty for none.
        save_weights_only: save the weights alone (no optimizer, loops or callbacks: such a checkpoint cannot resume).

    Raises:
        ValueError: a non-positive ``every_n_steps``, ``every_n_minutes`` or ``keep_last``, or an unknown signal name.

    Example::

        from lit_memopt.callbacks.run_checkpoint import RunCheckpoint
        trainer = Trainer(callbacks=[RunCheckpoint("run/checkpoints", every_n_steps=500, keep_last=3)])
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, every_n_steps: int | None = None,
                 every_n_minutes: float | None = 30.0, keep_last: int | None = 3, on_validation: bool = True,
                 save_on_signals: Sequence[str] = ("SIGTERM", "SIGUSR1"), save_weights_only: bool = False) -> None:
        _check_positive("checkpoint.every_n_steps", every_n_steps, integer=True)
        _check_positive("checkpoint.every_n_minutes", every_n_minutes, integer=False)
        _check_positive("checkpoint.keep_last", keep_last, integer=True)
        unknown = [name for name in save_on_signals if str(name).upper() not in _SIGNALS or not hasattr(signal, str(name).upper())]
        if unknown:
            raise ValueError(f"checkpoint.save_on_signals has {unknown}; use names among {list(_SIGNALS)} (or [] for none).")
        super().__init__(dirpath=str(dirpath), filename=CHECKPOINT_FILENAME, monitor="step", mode="max",
                         save_top_k=-1 if keep_last is None else int(keep_last), save_last="link",
                         auto_insert_metric_name=False, save_weights_only=save_weights_only,
                         every_n_train_steps=every_n_steps, save_on_train_epoch_end=False, enable_version_counter=False)
        interval = timedelta(minutes=float(every_n_minutes)) if every_n_minutes is not None else None
        set_checkpoint_triggers(self, every_n_train_steps=every_n_steps, train_time_interval=interval,
                                every_n_epochs=1 if on_validation else 0)
        self.every_n_steps, self.every_n_minutes, self.keep_last = every_n_steps, every_n_minutes, keep_last
        self.on_validation = bool(on_validation)
        self.save_on_signals = tuple(str(name).upper() for name in save_on_signals)
        self.stopped_by_signal: str | None = None  # the signal that stopped the run, for the end-of-run summary
        self._received: str | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._start_step = 0

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start_step = trainer.global_step
        self.stopped_by_signal = self._received = None
        if self.save_on_signals and not _slurm_requeues(trainer):
            self._install_handlers()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if not self._previous_handlers:
            return
        # Every rank takes part in this reduction at every batch, so all of them see a signal that reached any one.
        if trainer.strategy.reduce_boolean_decision(self._received is not None, all=False):
            self._stop_after_signal(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._uninstall_handlers()
        if trainer.global_step > self._start_step:  # the final weights, unless this step is saved or nothing trained
            save_checkpoint_now(self, trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._uninstall_handlers()
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._uninstall_handlers()

    # ------------------------------------------------------------------ atomic writes
    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:  # noqa: D401 - the compat MODEL_CHECKPOINT_WRITE_HOOK
        """Write ``filepath + '.tmp'`` on every rank, then rename it to ``filepath`` on rank zero."""
        temporary = filepath + TEMPORARY_SUFFIX
        if trainer.is_global_zero:
            _remove(temporary)  # left by a run killed while writing
        trainer.strategy.barrier("RunCheckpoint.clear")
        trainer.save_checkpoint(temporary, self.save_weights_only)  # ends with a barrier: every shard is written
        if trainer.is_global_zero:
            publish(temporary, filepath)
        trainer.strategy.barrier("RunCheckpoint.publish")
        record_checkpoint_written(self, trainer, filepath)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    # ------------------------------------------------------------------ signals
    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for name in self.save_on_signals:
            number = getattr(signal, name)
            self._previous_handlers[number] = signal.signal(number, self._on_signal)

    def _uninstall_handlers(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def _on_signal(self, number: int, frame: Any) -> None:
        # Only a flag: no I/O and no collective inside a handler, which may run in the middle of one.
        self._received = signal.Signals(number).name

    def _stop_after_signal(self, trainer: Trainer) -> None:
        self.stopped_by_signal = self._received or "a signal on another rank"
        save_checkpoint_now(self, trainer)
        trainer.should_stop = True
        self._uninstall_handlers()  # a second signal now gets the default action (e.g. SIGTERM ends the process)
        rank_zero_info(f"RunCheckpoint: {self.stopped_by_signal} received; saved {self.last_model_path} at step "
                       f"{trainer.global_step} and stopped (relaunch with resume=auto to go on)")


def publish(temporary: str, final: str) -> None:
    """Give a complete checkpoint (file or directory) its final name; the old one under that name goes only after."""
    if not os.path.isdir(temporary) and not os.path.isdir(final):
        os.replace(temporary, final)  # atomic: readers see the old file or the new one
        return
    if not os.path.lexists(final):
        os.replace(temporary, final)  # a directory renamed in one step
        return
    # Replacing an existing directory takes two renames: between them the complete old one is NAME.old.
    old = final + ".old"
    _remove(old)
    os.replace(final, old)
    os.replace(temporary, final)
    _remove(old)


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _slurm_requeues(trainer: Trainer) -> bool:
    """Whether Lightning's SLURM environment handles the requeue signal (then its handlers are kept)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return isinstance(environment, SLURMEnvironment) and bool(environment.auto_requeue)


def _check_positive(key: str, value: float | None, *, integer: bool) -> None:
    if value is None:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        wanted = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{key} must be {wanted} or null, got {value!r}.")


def is_checkpoint_name(path: Path) -> bool:
    """A complete checkpoint written by :class:`RunCheckpoint` (``step_NNNNNN.ckpt``, not a ``.tmp`` or ``.old``)."""
    return path.name.startswith("step_") and path.name.endswith(".ckpt") and path.name[5:-5].isdigit()
