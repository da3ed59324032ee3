"""The command line's progress bar: Lightning's rich bar, labelled by steps when a run is step-bounded."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar

from lit_memopt._compat.lightning import default_train_description


class StepAwareProgressBar(RichProgressBar):
    """``RichProgressBar`` whose label reads ``Epoch 0 · max_steps 150`` for a ``max_steps`` run.

    Lightning labels the bar ``Epoch {e}/{max_epochs - 1}``, which reads ``Epoch 0/-2`` for the recipes'
    ``max_epochs=-1`` (train until ``max_steps``). The label is built by a private method of Lightning's
    bar, the one place it can be changed (``lit_memopt._compat.lightning.PROGRESS_BAR_DESCRIPTION_HOOK``).
    """

    def _get_train_description(self, current_epoch: int) -> str:  # _compat.lightning.PROGRESS_BAR_DESCRIPTION_HOOK
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return default_train_description(self, current_epoch)
        description = f"Epoch {current_epoch}"
        if trainer.max_steps is not None and trainer.max_steps > 0:
            description += f" · max_steps {trainer.max_steps}"
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"  # aligned with the validation bar
        return description
