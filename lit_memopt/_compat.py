"""The one seam through which the pack touches private Lightning names; ``tests/test_compat.py`` trips when one changes.

Each function wraps one private name (or one group that Lightning uses together) and says why no public API does
the job. When Lightning renames something, the tripwire test names the function to fix here, and nothing else in
the pack changes.
"""

from __future__ import annotations

from datetime import timedelta
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["MODEL_CHECKPOINT_WRITE_HOOK", "set_checkpoint_triggers", "save_checkpoint_now", "record_checkpoint_written"]

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
