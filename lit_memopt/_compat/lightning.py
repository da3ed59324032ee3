"""Private Lightning names, each behind one function that says why no public API does the job.

Imported by callbacks, memory and models; never by ``lit_memopt.ops`` (pure PyTorch). ``tests/test_compat.py`` checks
every name listed in :data:`PRIVATE_NAMES` against the installed Lightning.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

__all__ = [
    "MODEL_CHECKPOINT_WRITE_HOOK",
    "set_checkpoint_triggers",
    "save_checkpoint_now",
    "record_checkpoint_written",
    "should_accumulate",
    "attached_trainer",
    "set_device_mesh",
    "callback_state_key",
    "PROGRESS_BAR_DESCRIPTION_HOOK",
    "default_train_description",
    "PRIVATE_NAMES",
]

# ------------------------------------------------------------------------------------ ModelCheckpoint

# ModelCheckpoint funnels every write (top-k, last, on exception) through this method. Overriding it is the only way to
# make all of them atomic (write a temporary name, then rename): the public CheckpointIO plugin is bypassed by
# ModelParallelStrategy's sharded (distributed) saves, and it never sees the final name of a directory.
MODEL_CHECKPOINT_WRITE_HOOK = "_save_checkpoint"


def set_checkpoint_triggers(callback: ModelCheckpoint, *, every_n_train_steps: int | None,
                            train_time_interval: timedelta | None, every_n_epochs: int | None) -> None:
    """Arm several of ``ModelCheckpoint``'s triggers on one instance.

    Lightning evaluates the step and the time trigger independently in ``on_train_batch_end`` and the epoch trigger
    at validation end, but its ``__init__`` refuses more than one. Several instances would write the same step twice
    and delete each other's files when each keeps its own last k; one instance keeps one list and one file per step.
    """
    callback._every_n_train_steps = int(every_n_train_steps or 0)
    callback._train_time_interval = train_time_interval
    callback._every_n_epochs = int(every_n_epochs or 0)


def save_checkpoint_now(callback: ModelCheckpoint, trainer: Trainer) -> bool:
    """Save a top-k and a ``last`` checkpoint now, as ``ModelCheckpoint``'s triggers do; ``False`` if this step has one.

    Collective: every rank calls it at the same point (a sharded save writes on every rank). Used at the end of
    training and after a stop signal, where Lightning has no trigger of its own (``save_on_exception`` saves from an
    exception handler, which ranks do not reach together).
    """
    if callback._last_global_step_saved == trainer.global_step:
        return False
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)
    return True


def record_checkpoint_written(callback: ModelCheckpoint, trainer: Trainer, filepath: str) -> None:
    """The bookkeeping ``ModelCheckpoint._save_checkpoint`` does after its write, for an override that writes elsewhere.

    ``_last_global_step_saved`` keeps a step from being saved twice; ``_last_checkpoint_saved`` is the file that
    ``save_last="link"`` points ``last.ckpt`` at (the final name, never the temporary one).
    """
    callback._last_global_step_saved = trainer.global_step
    callback._last_checkpoint_saved = filepath


# For the tripwire test: the private methods of ModelCheckpoint and the private attributes of its instances used above.
PRIVATE_METHODS = ("_save_checkpoint", "_save_topk_checkpoint", "_save_last_checkpoint", "_monitor_candidates")
PRIVATE_ATTRIBUTES = ("_every_n_train_steps", "_train_time_interval", "_every_n_epochs", "_last_global_step_saved",
                      "_last_checkpoint_saved")

# ------------------------------------------------------------------------------------ the fit loop and the module


def should_accumulate(trainer: Trainer) -> bool:
    """Whether the batch running now only accumulates gradients (no optimizer step after it).

    Lightning decides this in its loop (``fit_loop._should_accumulate``): the accumulation window, the last batch of
    the epoch (which the loop alone knows, from its data fetcher) and strategies that accumulate themselves. No public
    property exposes it; recomputing it from ``accumulate_grad_batches`` would miss the short last window. When the
    loop has no such method the answer is ``False``: gradients are then synchronised every batch, still exact.
    """
    try:
        return bool(trainer.fit_loop._should_accumulate())
    except AttributeError:  # pragma: no cover - the tripwire test names this function first
        return False


def attached_trainer(module: LightningModule | Any) -> Trainer | None:
    """The ``Trainer`` a ``LightningModule`` is attached to, or ``None`` (also for an object that is no module).

    The public ``module.trainer`` raises when no trainer is attached and, under Fabric, returns a stand-in that is
    no ``Trainer`` (no callbacks, no precision plugin); the attribute behind it answers both cases without raising.
    """
    return getattr(module, "_trainer", None)


def set_device_mesh(module: LightningModule, mesh: Any) -> None:
    """Give ``module`` the device mesh its ``configure_model`` shards over, as ``ModelParallelStrategy`` does in setup.

    The public ``device_mesh`` property has no setter; the strategy writes the attribute behind it. The estimator does
    the same to shard a module outside a Trainer, over a fake process group (``memory.fake_ranks``).
    """
    module._device_mesh = mesh


def callback_state_key(callback: Callback, **arguments: Any) -> str:
    """A callback's ``state_key`` from the arguments that make two instances different (``Name{'every_n_steps': 5}``).

    The format Lightning's own callbacks use, so checkpoints written by them and by ours look alike; the
    ``Callback.state_key`` docs point to this helper, which is underscored.
    """
    return callback._generate_state_key(**arguments)


# ------------------------------------------------------------------------------------ the progress bar

# RichProgressBar builds the label of the training bar in this method, the one place it can be changed (its public
# hooks redraw the bar but take the label from here). StepAwareProgressBar overrides it.
PROGRESS_BAR_DESCRIPTION_HOOK = "_get_train_description"


def default_train_description(bar: RichProgressBar, current_epoch: int) -> str:
    """Lightning's own label of the training bar (``Epoch 3/9``), for an override that keeps it in some runs."""
    return RichProgressBar._get_train_description(bar, current_epoch)


# ------------------------------------------------------------------------------------ the registry
# private name (as Lightning spells it) -> the function or constant of this module that wraps it
PRIVATE_NAMES: dict[str, str] = {
    **{f"ModelCheckpoint.{name}": "save_checkpoint_now" for name in PRIVATE_METHODS[1:]},
    "ModelCheckpoint._save_checkpoint": "MODEL_CHECKPOINT_WRITE_HOOK",
    "ModelCheckpoint()._every_n_train_steps": "set_checkpoint_triggers",
    "ModelCheckpoint()._train_time_interval": "set_checkpoint_triggers",
    "ModelCheckpoint()._every_n_epochs": "set_checkpoint_triggers",
    "ModelCheckpoint()._last_global_step_saved": "record_checkpoint_written",
    "ModelCheckpoint()._last_checkpoint_saved": "record_checkpoint_written",
    "Trainer().fit_loop._should_accumulate": "should_accumulate",
    "LightningModule()._trainer": "attached_trainer",
    "LightningModule()._device_mesh": "set_device_mesh",
    "Callback._generate_state_key": "callback_state_key",
    "RichProgressBar._get_train_description": "PROGRESS_BAR_DESCRIPTION_HOOK",
}
