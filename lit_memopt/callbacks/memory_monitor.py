"""``MemoryMonitor``: per-phase memory peaks of every training step, pressure levels, rank-aggregated logs and an end-of-fit report."""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import asdict
from typing import Any, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.imports import module_available

from lit_memopt._compat.torch import dump_cuda_memory_snapshot, start_cuda_memory_history, stop_cuda_memory_history
from lit_memopt.callbacks._memory_metrics import BatchSizeChange, MemoryMetrics, OOMEvent
from lit_memopt.memory.stats import (
    MemorySnapshot,
    cpu_peak_is_resettable,
    current_memory_bytes,
    memory_snapshot,
    peak_memory_bytes,
    reset_peak_memory,
)
from lit_memopt.memory.units import format_bytes

__all__ = ["MemoryMonitor", "MemoryMetrics", "OOMEvent", "BatchSizeChange", "PRESSURE_LEVELS"]

MIB = 1024**2
PHASES = ("forward", "backward", "optimizer")
PRESSURE_LEVELS = ("ok", "warning", "critical")

# The logged keys (``memory/<name>``), in the order they are logged and gathered. Every logged row has all of them.
_STEP_FIELDS = (
    "forward_peak_mib",
    "backward_peak_mib",
    "optimizer_peak_mib",
    "step_peak_mib",
    "allocated_mib",
    "reserved_mib",
    "efficiency",
    "fragmentation",
    "used_fraction",
    "pressure",
    "num_alloc_retries",
    "oom_events",
)
LOGGED_KEYS = tuple(f"memory/{name}" for name in _STEP_FIELDS) + ("memory/peak_rank",)
# Plotted per-step history: (forward, backward, optimizer, step peak, allocated, reserved), in MiB.
_HISTORY_FIELDS = ("forward_peak_mib", "backward_peak_mib", "optimizer_peak_mib", "step_peak_mib", "allocated_mib", "reserved_mib")


class MemoryMonitor(Callback):
    """Measure the memory of every training step, phase by phase, and warn before it runs out.

    For each optimizer step it records the peak of the forward pass (``on_train_batch_start`` to
    ``on_before_backward``), of the backward pass (to ``on_after_backward``) and of the optimizer
    step (``on_before_optimizer_step`` to ``on_train_batch_end``), resetting the peak counter at
    each boundary, plus allocated and reserved memory at the step's end. With gradient
    accumulation the peaks are the maxima over the micro-batches of the step; work between a
    backward and the next backward or optimizer step (manual optimization) counts as forward.

    On CUDA the peaks are the caching allocator's peak allocated bytes. On CPU they are the
    process's peak resident set size (``VmHWM``), which Linux lets a process reset
    (``/proc/self/clear_refs``): a kernel-maintained high-water mark, so phase peaks are exact
    for RSS at no sampling cost. RSS counts everything the process holds (the Python heap, freed
    memory the C allocator keeps, libraries), so CPU numbers include a constant baseline and
    small allocations may be served from already-resident memory. Where the peak cannot be reset
    (not Linux), ``ru_maxrss`` never decreases, so phase peaks fall back to RSS sampled at the
    phase boundaries, a lower bound; this is said once at setup.

    Logged keys (all of them from the first logged step, through every logger of the Trainer,
    at steps ``0, n, 2n, ...`` with ``n = log_every_n_steps``): ``memory/forward_peak_mib``,
    ``memory/backward_peak_mib``, ``memory/optimizer_peak_mib``, ``memory/step_peak_mib``,
    ``memory/allocated_mib``, ``memory/reserved_mib``, ``memory/efficiency`` (allocated / reserved),
    ``memory/fragmentation``, ``memory/used_fraction`` (of device memory, or of system RAM on CPU,
    used by anyone), ``memory/pressure`` (0 ok, 1 warning, 2 critical), ``memory/num_alloc_retries``,
    ``memory/oom_events`` and ``memory/peak_rank``. Under a distributed strategy each value is
    the worst over ranks (maximum; minimum for the efficiency) gathered by name with
    ``LightningModule.all_gather``, which every rank issues at the same steps, and ``memory/peak_rank`` is the
    rank with the highest step peak.

    At the end of fit it writes, in the run directory (``trainer.log_dir`` or
    ``default_root_dir``), ``memory_summary.txt`` (a table of peaks per phase, efficiency, OOM
    events, batch-size changes and throughput; also sent to the log), ``memory_summary.json``
    and ``memory_plot.png`` (memory over steps, worst over ranks).

    Args:
        warning_threshold: fraction of device memory (system RAM on CPU) in use above which
            :attr:`pressure` is ``"warning"`` and a warning is issued once; in ``(0, 1]``.
        critical_threshold: fraction above which :attr:`pressure` is ``"critical"``; in
            ``[warning_threshold, 1]``.
        log_every_n_steps: logging cadence in optimizer steps; ``None`` uses the Trainer's
            ``log_every_n_steps``; ``0`` logs nothing (the report is still written).
        snapshot_on_oom: CUDA only: record the allocator's history and, when an out-of-memory
            error ends the fit, dump ``memory_snapshot_oom_rank{r}.pickle`` for
            https://pytorch.org/memory_viz.
        snapshot_at_step: CUDA only: optimizer step(s) after which to dump
            ``memory_snapshot_step{s}_rank{r}.pickle``.
        max_snapshot_entries: allocator events kept in the recorded history.
        write_report: write the summary table, JSON and plot at the end of fit.
        output_dir: where the report goes; ``None`` uses the run directory.

    Raises:
        ValueError: for thresholds outside ``0 < warning <= critical <= 1``, a negative
            ``log_every_n_steps``, negative ``snapshot_at_step`` values or a non-positive
            ``max_snapshot_entries``.

    Example::

        from lightning.pytorch import Trainer
        from lit_memopt.callbacks import MemoryMonitor

        monitor = MemoryMonitor(warning_threshold=0.8)
        trainer = Trainer(max_steps=100, callbacks=[monitor])
        trainer.fit(model, datamodule=dm)
        print(monitor.metrics.peak_backward_bytes, monitor.pressure)
    """

    def __init__(
        self,
        warning_threshold: float = 0.85,
        critical_threshold: float = 0.95,
        log_every_n_steps: int | None = None,
        snapshot_on_oom: bool = False,
        snapshot_at_step: int | Sequence[int] | None = None,
        max_snapshot_entries: int = 100_000,
        write_report: bool = True,
        output_dir: str | None = None,
    ) -> None:
        super().__init__()
        if not (0.0 < float(warning_threshold) <= 1.0):
            raise ValueError(f"MemoryMonitor(warning_threshold={warning_threshold!r}): use a fraction in (0, 1].")
        if not (float(warning_threshold) <= float(critical_threshold) <= 1.0):
            raise ValueError(
                f"MemoryMonitor(critical_threshold={critical_threshold!r}): use a fraction in "
                f"[warning_threshold={warning_threshold}, 1]."
            )
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 0):
            raise ValueError(
                f"MemoryMonitor(log_every_n_steps={log_every_n_steps!r}): use None (the Trainer's cadence), "
                "0 (no logging) or a positive integer."
            )
        if snapshot_at_step is None:
            steps: tuple[int, ...] = ()
        elif isinstance(snapshot_at_step, int):
            steps = (snapshot_at_step,)
        else:
            steps = tuple(snapshot_at_step)
        if any(not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(
                f"MemoryMonitor(snapshot_at_step={snapshot_at_step!r}): use None, a step number >= 0 or a list of them."
            )
        if int(max_snapshot_entries) <= 0:
            raise ValueError(f"MemoryMonitor(max_snapshot_entries={max_snapshot_entries!r}): use a positive integer.")
        self.warning_threshold = float(warning_threshold)
        self.critical_threshold = float(critical_threshold)
        self.log_every_n_steps = log_every_n_steps
        self.snapshot_on_oom = bool(snapshot_on_oom)
        self.snapshot_at_step = frozenset(steps)
        self.max_snapshot_entries = int(max_snapshot_entries)
        self.write_report = bool(write_report)
        self.output_dir = output_dir

        self.metrics = MemoryMetrics()
        self.pressure: str = "ok"
        self.last_snapshot: MemorySnapshot | None = None
        self.last_logged: dict[str, float] = {}
        self.report_paths: dict[str, str] = {}
        self._device = torch.device("cpu")
        self._peak_resettable = True
        self._recording_history = False
        self._resolved_run_dir: str | None = None
        self._warned_level = 0
        self._history: list[tuple[float, ...]] = []
        self._phase: str | None = None
        self._phase_peaks = dict.fromkeys(PHASES, 0)
        self._step_open = False
        self._step_start_global = 0
        self._batch_t0 = 0.0

    # --- discovery --------------------------------------------------------------------------------
    @staticmethod
    def find(trainer: Trainer) -> MemoryMonitor | None:
        """The ``MemoryMonitor`` among ``trainer.callbacks``, or ``None``: how other callbacks report events."""
        for callback in trainer.callbacks:
            if isinstance(callback, MemoryMonitor):
                return callback
        return None

    @property
    def pressure_level(self) -> int:
        """:attr:`pressure` as a number: 0 ok, 1 warning, 2 critical."""
        return PRESSURE_LEVELS.index(self.pressure)

    # --- setup / teardown -------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._device = trainer.strategy.root_device
        self.metrics.device = str(self._device)
        if self._device.type not in ("cuda", "cpu"):
            rank_zero_warn(
                f"MemoryMonitor: device type {self._device.type!r} has no memory statistics here; "
                "it reports the host process RSS instead."
            )
            self._device = torch.device("cpu")
        if self._device.type == "cpu":
            self._peak_resettable = cpu_peak_is_resettable()
            if not self._peak_resettable:
                rank_zero_info(
                    "MemoryMonitor: this OS cannot reset the process peak RSS, so CPU phase peaks are RSS "
                    "sampled at phase boundaries (a lower bound), and peaks are process-lifetime maxima."
                )
            if self.snapshot_on_oom or self.snapshot_at_step:
                rank_zero_warn(
                    "MemoryMonitor: snapshot_on_oom / snapshot_at_step record the CUDA allocator's history; "
                    "training runs on the CPU, so no snapshot will be written."
                )
        if self._log_cadence(trainer) and not trainer.loggers:
            rank_zero_warn("MemoryMonitor: the Trainer has no logger, so memory/* metrics are not logged; "
                           "the end-of-fit report is still written.")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # `trainer.log_dir` broadcasts under DDP: resolve it here, where every rank calls it, and never on one rank only.
        self._resolved_run_dir = self.output_dir or trainer.log_dir or trainer.default_root_dir
        if self._device.type == "cuda" and (self.snapshot_on_oom or self.snapshot_at_step):
            try:
                start_cuda_memory_history(self.max_snapshot_entries)
                self._recording_history = True
            except Exception as error:  # private API: say so rather than fail the run
                rank_zero_warn(f"MemoryMonitor: cannot record the CUDA allocator history ({error}); no snapshots.")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._recording_history:
            try:
                stop_cuda_memory_history()
            except Exception:  # pragma: no cover - best effort on shutdown
                pass
            self._recording_history = False

    # --- phases -----------------------------------------------------------------------------------
    def _enter(self, phase: str | None) -> None:
        """Credit the peak since the last boundary to the current phase, reset it, and switch to ``phase``."""
        if self._phase is not None:
            if self._peak_resettable:
                peak = peak_memory_bytes(self._device)
            else:
                peak = current_memory_bytes(self._device)
            if peak > self._phase_peaks[self._phase]:
                self._phase_peaks[self._phase] = peak
        if phase is not None and self._peak_resettable:
            reset_peak_memory(self._device)
        self._phase = phase

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._step_open:
            self._step_open = True
            self._step_start_global = trainer.global_step
            self._phase_peaks = dict.fromkeys(PHASES, 0)
        self._batch_t0 = time.perf_counter()
        self._enter("forward")

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._phase is not None:
            self._enter("backward")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._phase is not None:
            self._enter("forward")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._phase is not None:
            self._enter("optimizer")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._phase is None:
            return
        self._enter(None)
        self.metrics.micro_batches += 1
        # Totals over the whole run (summed over ranks in the report): Lightning's ThroughputMonitor logs
        # windowed rates and syncs ranks itself, which the end-of-fit table does not need.
        self.metrics.samples += _batch_size(batch)
        self.metrics.train_seconds += time.perf_counter() - self._batch_t0
        if trainer.global_step == self._step_start_global:
            return  # accumulating: the optimizer step is not done yet
        self._step_open = False
        self._finish_step(trainer)

    def _finish_step(self, trainer: Trainer) -> None:
        step = trainer.global_step - 1
        snapshot = memory_snapshot(self._device)
        self.last_snapshot = snapshot
        self.metrics.record_step(self._phase_peaks, snapshot)
        level = self._pressure_of(snapshot.used_fraction)
        self.pressure = PRESSURE_LEVELS[level]
        if trainer.is_global_zero:
            self._warn_pressure(level, snapshot.used_fraction, trainer.global_rank, step)
        values = self._step_values(snapshot, level)
        self._history.append(tuple(values[name] for name in _HISTORY_FIELDS))

        cadence = self._log_cadence(trainer)
        if cadence and step % cadence == 0:
            self._log(trainer, values, step)
        if step in self.snapshot_at_step and self._recording_history:
            self.dump_memory_snapshot(trainer, f"step{step}")

    def _pressure_of(self, used_fraction: float) -> int:
        if used_fraction >= self.critical_threshold:
            return 2
        if used_fraction >= self.warning_threshold:
            return 1
        return 0

    def _warn_pressure(self, level: int, used_fraction: float, rank: int, step: int) -> None:
        if level <= self._warned_level:
            return
        self._warned_level = level
        what = "device memory" if self._device.type == "cuda" else "system RAM"
        threshold = self.critical_threshold if level == 2 else self.warning_threshold
        rank_zero_warn(
            f"MemoryMonitor: memory pressure is {PRESSURE_LEVELS[level]!r} at step {step} on rank {rank}: "
            f"{used_fraction:.1%} of {what} in use (threshold {threshold:.0%}). Consider a smaller micro-batch, "
            "activation checkpointing (ActivationCheckpointing) or OOMRecovery."
        )

    def _step_values(self, snapshot: MemorySnapshot, level: int) -> dict[str, float]:
        peaks = self._phase_peaks
        return {
            "forward_peak_mib": peaks["forward"] / MIB,
            "backward_peak_mib": peaks["backward"] / MIB,
            "optimizer_peak_mib": peaks["optimizer"] / MIB,
            "step_peak_mib": max(peaks.values()) / MIB,
            "allocated_mib": snapshot.allocated_bytes / MIB,
            "reserved_mib": snapshot.reserved_bytes / MIB,
            "efficiency": snapshot.efficiency,
            "fragmentation": snapshot.fragmentation,
            "used_fraction": snapshot.used_fraction,
            "pressure": float(level),
            "num_alloc_retries": float(snapshot.num_alloc_retries),
            "oom_events": float(len(self.metrics.oom_events)),
        }

    def _log_cadence(self, trainer: Trainer) -> int:
        return trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps

    # --- distributed aggregation and logging ------------------------------------------------------
    @staticmethod
    def _gather(trainer: Trainer, values: dict[str, float | torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's ``values`` by name, ``{name: [world, ...]}`` on the CPU; all ranks call it at the same point.

        A dict through ``LightningModule.all_gather`` (one collective per name, in the dict's order on every rank):
        each value is read back by its name, so adding or reordering fields cannot shift one onto another's label.
        """
        local = {name: torch.as_tensor(value, dtype=torch.float64) for name, value in values.items()}
        gathered = trainer.lightning_module.all_gather(local)
        # one process: Lightning returns the values without the leading world dimension
        return {name: gathered[name].reshape(trainer.world_size, *t.shape).cpu() for name, t in local.items()}

    def _log(self, trainer: Trainer, values: dict[str, float], step: int) -> None:
        gathered = self._gather(trainer, {name: values[name] for name in _STEP_FIELDS})
        metrics = {f"memory/{name}": float(per_rank.max()) for name, per_rank in gathered.items()}
        metrics["memory/efficiency"] = float(gathered["efficiency"].min())
        peak_rank = int(gathered["step_peak_mib"].argmax())
        metrics["memory/peak_rank"] = float(peak_rank)
        self.last_logged = metrics
        if trainer.is_global_zero:
            self._warn_pressure(int(metrics["memory/pressure"]), metrics["memory/used_fraction"], peak_rank, step)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # --- OOM and allocator snapshots --------------------------------------------------------------
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        from lit_memopt.memory.oom import is_oom_error

        if not is_oom_error(exception):
            return
        # An error that says its OOM was recorded already (OOMRecovery's, which reported the OOM to this
        # monitor before giving up) is not counted a second time.
        if not getattr(exception, "oom_recorded", False):
            self.metrics.record_oom(trainer.global_step, str(exception), rank=trainer.global_rank, phase=self._phase)
        if self.snapshot_on_oom and self._recording_history:
            path = self.dump_memory_snapshot(trainer, "oom")
            if path:
                rank_zero_warn(f"MemoryMonitor: out of memory; allocator snapshot written to {path} "
                               "(open it at https://pytorch.org/memory_viz).")

    def dump_memory_snapshot(self, trainer: Trainer, tag: str) -> str | None:
        """Write this rank's CUDA allocator snapshot as ``memory_snapshot_{tag}_rank{r}.pickle``; its path, or ``None``.

        Needs CUDA and the history recording started by ``snapshot_on_oom``/``snapshot_at_step``.
        """
        if not self._recording_history:
            return None
        directory = self._run_dir(trainer)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"memory_snapshot_{tag}_rank{trainer.global_rank}.pickle")
        try:
            dump_cuda_memory_snapshot(path)
        except Exception as error:  # private API: report, never fail the run over a diagnostic
            rank_zero_warn(f"MemoryMonitor: could not write the allocator snapshot {path}: {error}")
            return None
        return path

    # --- end of fit -------------------------------------------------------------------------------
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.write_report:
            return
        m = self.metrics
        per_rank = self._gather(trainer, {
            "peak_forward_bytes": m.peak_forward_bytes,
            "peak_backward_bytes": m.peak_backward_bytes,
            "peak_optimizer_bytes": m.peak_optimizer_bytes,
            "peak_step_bytes": m.peak_bytes,
            "average_step_peak_bytes": m.average_peak_bytes,
            "average_allocated_bytes": m.average_allocated_bytes,
            "average_reserved_bytes": m.average_reserved_bytes,
            "efficiency": m.efficiency,
            "oom_events": float(len(m.oom_events)),
            "samples": float(m.samples),
            "train_seconds": m.train_seconds,
            "optimizer_steps": float(m.steps),
            "history_length": float(len(self._history)),
            "grad_accum_ratio": m.grad_accum_ratio,
            "batch_size_changes": float(len(m.batch_size_changes)),
        })
        # Pad the histories to one length so every rank sends the same shape.
        length = int(per_rank["history_length"].max())
        history = torch.zeros(length, len(_HISTORY_FIELDS), dtype=torch.float64)
        if self._history:
            history[: len(self._history)] = torch.tensor(self._history[:length], dtype=torch.float64)
        histories = self._gather(trainer, {name: history[:, i].contiguous() for i, name in enumerate(_HISTORY_FIELDS)})
        if trainer.is_global_zero:
            self._write_report(trainer, per_rank, {name: h.max(dim=0).values for name, h in histories.items()})

    def _run_dir(self, trainer: Trainer) -> str:
        return self._resolved_run_dir or self.output_dir or trainer.default_root_dir

    def _write_report(self, trainer: Trainer, per_rank: dict[str, torch.Tensor],
                      history: dict[str, torch.Tensor]) -> None:
        """The report from the gathered values (``{name: [world]}``) and the worst ``history`` of each field."""
        directory = self._run_dir(trainer)
        os.makedirs(directory, exist_ok=True)
        world = per_rank["efficiency"].shape[0]
        what = "allocated" if self._device.type == "cuda" else "RSS"

        def worst(name: str) -> tuple[float, int]:
            rank = int(per_rank[name].argmax())
            return float(per_rank[name][rank]), rank

        title = f"Memory summary ({self.metrics.device}, {world} rank(s), {what})"
        table = _ReportTable()
        summary: dict[str, Any] = {"device": self.metrics.device, "world_size": world, "measure": what}
        for phase in PHASES + ("step",):
            value, rank = worst(f"peak_{phase}_bytes")
            table.add_row(f"peak {phase}", format_bytes(value), str(rank))
            summary[f"peak_{phase}_bytes"] = value
            summary[f"peak_{phase}_rank"] = rank
        for label in ("average step peak", "average allocated", "average reserved"):
            key = label.replace(" ", "_") + "_bytes"
            value, rank = worst(key)
            table.add_row(label, format_bytes(value), str(rank))
            summary[key] = value
        efficiency = float(per_rank["efficiency"].min())
        oom_events = int(per_rank["oom_events"].sum())
        samples = float(per_rank["samples"].sum())
        seconds = float(per_rank["train_seconds"].max())
        steps = int(per_rank["optimizer_steps"].max())
        grad_accum_ratio = float(per_rank["grad_accum_ratio"].max())
        table.add_row("efficiency (allocated/reserved)", f"{efficiency:.3f}", "min")
        table.add_row("OOM events", str(oom_events), "sum")
        table.add_row("batch-size changes", str(int(per_rank["batch_size_changes"].max())), "max")
        table.add_row("grad-accumulation ratio", f"{grad_accum_ratio:.2f}", "")
        table.add_row("optimizer steps", str(steps), "")
        table.add_row("throughput", f"{steps / seconds if seconds else 0.0:.2f} steps/s", "")
        table.add_row("", f"{samples / seconds if seconds else 0.0:.1f} samples/s", "all ranks")
        summary.update(
            efficiency=efficiency,
            oom_events=oom_events,
            optimizer_steps=steps,
            grad_accum_ratio=grad_accum_ratio,
            steps_per_second=steps / seconds if seconds else 0.0,
            samples_per_second=samples / seconds if seconds else 0.0,
            device_total_bytes=self.metrics.device_total_bytes,
            oom_event_list=[asdict(e) for e in self.metrics.oom_events],
            batch_size_changes=[asdict(c) for c in self.metrics.batch_size_changes],
        )

        text = table.render(title)
        paths = {
            "summary_txt": os.path.join(directory, "memory_summary.txt"),
            "summary_json": os.path.join(directory, "memory_summary.json"),
            "plot": os.path.join(directory, "memory_plot.png"),
        }
        with open(paths["summary_txt"], "w") as f:
            f.write(text)
        with open(paths["summary_json"], "w") as f:
            json.dump(summary, f, indent=2)
        if module_available("matplotlib"):
            _plot_history(history, paths["plot"], title=f"Memory over steps ({self.metrics.device}, worst over ranks)",
                          ylabel=f"MiB ({what})")
        else:  # the core install has no matplotlib: the table and the JSON are the report
            paths.pop("plot")
            rank_zero_warn("MemoryMonitor: no memory_plot.png (matplotlib is missing: pip install 'lit-memopt[plot]').")
        self.report_paths = paths
        rank_zero_info("\n" + text + f"Memory report written to {directory}")

    # --- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"metrics": self.metrics.to_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "metrics" in state_dict:
            self.metrics = MemoryMetrics.from_dict(state_dict["metrics"])


class _ReportTable:
    """The report's rows, drawn with rich when it is installed (the recipes extra), else as aligned plain text."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add_row(self, metric: str, value: str, rank: str) -> None:
        self.rows.append((metric, value, rank))

    def render(self, title: str) -> str:
        if module_available("rich"):
            from rich.console import Console
            from rich.table import Table

            table = Table(title=title)
            table.add_column("metric")
            table.add_column("value", justify="right")
            table.add_column("rank", justify="right")
            for row in self.rows:
                table.add_row(*row)
            buffer = io.StringIO()
            Console(file=buffer, width=100, force_terminal=False, color_system=None).print(table)
            return buffer.getvalue()
        widths = [max(len(row[i]) for row in self.rows + [("metric", "value", "rank")]) for i in range(3)]
        lines = [title, f"{'metric':<{widths[0]}}  {'value':>{widths[1]}}  {'rank':>{widths[2]}}"]
        lines += [f"{m:<{widths[0]}}  {v:>{widths[1]}}  {r:>{widths[2]}}" for m, v, r in self.rows]
        return "\n".join(lines) + "\n"


def _batch_size(batch: Any) -> int:
    """Samples in a batch, counted as OOMRecovery counts them (1 when the batch has no batch dimension)."""
    from lit_memopt.callbacks._micro_batching import infer_batch_size

    try:
        return infer_batch_size(batch)
    except ValueError:
        return 1


def _plot_history(history: dict[str, torch.Tensor], path: str, *, title: str, ylabel: str) -> None:
    # An explicit Agg canvas: no pyplot, so the user's matplotlib backend is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = list(range(len(history[_HISTORY_FIELDS[0]])))
    for name in _HISTORY_FIELDS:
        series = history[name].tolist()
        if any(not math.isclose(v, 0.0) for v in series):
            ax.plot(steps, series, label=name.replace("_mib", "").replace("_", " "),
                    marker="." if len(steps) < 50 else None)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
