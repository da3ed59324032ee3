"""A held-out metric with its standard error: a run's start and end values come with their noise.

Held-out sets here are small (48 CRSP tasks, 128 Intuitor prompts), so a move of a few hundredths
between the first and the last validation can be sampling noise. Logging the standard error next to
the mean lets the end-of-run summary say so.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics.aggregation import MeanMetric, SumMetric

# The standard error of "<name>" is logged as "<name>_stderr" (the run summary prints the two together).
STDERR_SUFFIX = "_stderr"


class MeanAndStderr(torch.nn.Module):
    """Mean of per-unit values and its standard error ``sqrt(sample variance / n)``, over every rank.

    A unit is one independent draw of the held-out set: a task (with its solve rate over the answers
    sampled for it, which are not independent of each other) or a prompt. Built on torchmetrics'
    aggregation metrics, which gather the ranks' states in ``compute``.

    Example::

        metric = MeanAndStderr()
        metric.update(torch.tensor([1.0, 0.0, 0.5]))  # three tasks' solve rates
        mean, stderr = metric.compute()
        metric.reset()
    """

    def __init__(self) -> None:
        super().__init__()
        self.values = MeanMetric()
        self.squares = MeanMetric()
        self.count = SumMetric()

    def update(self, values: torch.Tensor) -> None:
        """Add one value per unit (any shape; flattened)."""
        values = values.detach().to(torch.float32).flatten()
        if values.numel() == 0:
            return
        self.values.update(values)
        self.squares.update(values * values)
        self.count.update(torch.tensor(float(values.numel()), device=values.device))

    @property
    def updated(self) -> bool:
        """Whether any unit was added since the last reset (on this rank)."""
        return bool(self.count.update_called)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, standard error)``; the error is 0 for a single unit."""
        mean, squares, n = self.values.compute(), self.squares.compute(), self.count.compute()
        if float(n) < 2:
            return mean, torch.zeros_like(mean)
        variance = (squares - mean * mean).clamp_min(0.0) * n / (n - 1)
        return mean, (variance / n).sqrt()

    def log_and_reset(self, module: Any, name: str) -> None:
        """Log ``name`` and ``name + STDERR_SUFFIX`` through ``module.log`` (if any unit was added), then reset.

        Call it from ``on_validation_epoch_end`` on every rank: ``compute`` gathers the ranks.
        """
        if self.updated:
            mean, stderr = self.compute()
            module.log(name, mean, sync_dist=True)  # already global: syncing averages equal values
            module.log(name + STDERR_SUFFIX, stderr, sync_dist=True)
        self.reset()

    def reset(self) -> None:
        # Lightning validates under inference mode in `trainer.validate` but not always inside `fit`: states
        # made here must be normal tensors, or the next update outside inference mode cannot add to them.
        with torch.inference_mode(False):
            for metric in (self.values, self.squares, self.count):
                metric.reset()
