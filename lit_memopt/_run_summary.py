"""End-of-run summary of the ``lit-memopt`` command: where things went and how the key metrics moved."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lit_memopt.modules.heldout import STDERR_SUFFIX  # "<key>_stderr" is printed with "<key>" as "value ± error"


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


class RunSummary(pl.Callback):
    """Records the module's ``summary_keys`` at every training step so the summary can compare start and end."""

    def __init__(self, window: int = 5) -> None:
        self.window = window
        self.history: dict[str, list[float]] = {}

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> None:
        for key in getattr(pl_module, "summary_keys", ()):
            if not key.startswith(prefix):
                continue
            value = _scalar(trainer.callback_metrics.get(key))
            if value is not None:
                self.history.setdefault(key, []).append(value)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._record(trainer, pl_module, "train/")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, pl_module, "val/")

    def collect(self, trainer: pl.Trainer, module: pl.LightningModule, *, run_dir: Path, seconds: float, command: str) -> dict[str, Any]:
        metrics = {}
        for key, values in self.history.items():
            n = min(self.window, max(1, len(values) // 4))
            metrics[key] = {"start": sum(values[:n]) / n, "end": sum(values[-n:]) / n, "steps": len(values)}
        final = {k: v for k, v in ((k, _scalar(v)) for k, v in trainer.callback_metrics.items()) if v is not None}
        checkpoint = None
        for cb in trainer.callbacks:
            if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.last_model_path:
                checkpoint = cb.last_model_path
        logger_dir = None
        if trainer.logger is not None:
            logger_dir = getattr(trainer.logger, "log_dir", None) or getattr(trainer.logger, "save_dir", None)
        return {
            "command": command,
            "module": type(module).__name__,
            "run_dir": str(run_dir),
            "logs": str(logger_dir) if logger_dir else None,
            "checkpoint": checkpoint,
            "global_step": trainer.global_step,
            "seconds": seconds,
            "metrics": metrics,
            "final_metrics": final,
        }


def print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"lit-memopt {result['command']}: {result['module']}", show_header=True)
    table.add_column("metric")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right")
    metrics = result["metrics"]
    for key, stats in metrics.items():
        if key.endswith(STDERR_SUFFIX) and key[: -len(STDERR_SUFFIX)] in metrics:
            continue  # shown with its metric
        error = metrics.get(key + STDERR_SUFFIX)
        cells = [f"{stats[end]:.4f}" + (f" ± {error[end]:.4f}" if error else "") for end in ("start", "end")]
        table.add_row(key, *cells)
    if result["command"] == "validate":
        for key, value in result["final_metrics"].items():
            if key not in result["metrics"]:  # the recorded ones are in the table already
                table.add_row(key, "", f"{value:.4f}")
    console.print(table)
    console.print(f"steps: {result['global_step']}   time: {result['seconds']:.1f} s")
    console.print(f"run directory: {result['run_dir']}")
    if result["logs"]:
        console.print(f"logs:          {result['logs']}")
    if result["checkpoint"]:
        console.print(f"checkpoint:    {result['checkpoint']}")
