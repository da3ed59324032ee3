"""Step-time overhead of MemoryMonitor and EmptyCacheScheduler (default settings) on a CPU training run.

Trains the tiny Qwen3 model with each callback and with both, the callbacks active on every other
step (so steps with and without them interleave within one run), and reports (a) the end-to-end
ratio of median step times with / without and (b) the time spent inside the callbacks' hooks per
step, timed directly (precise where (a) is noisy on a shared machine). Target: <= 2% of step time.
Writes ``benchmarks/results/callbacks_cpu{_quick}.{md,json}``.

Run ``python benchmarks/callback_overhead.py [--quick]`` or call :func:`run`.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):  # `python benchmarks/callback_overhead.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lit_memopt.callbacks import EmptyCacheScheduler, MemoryMonitor  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGET_OVERHEAD = 0.02
BATCH, SEQ = 8, 64
# Hooks whose time counts as per-step overhead; the end-of-fit report is a one-time cost, reported apart.
STEP_HOOKS = (
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end",
)
ONCE_HOOKS = ("setup", "on_fit_start", "on_train_start", "on_train_end", "on_fit_end", "teardown")


class _LM(LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _StepClock(Callback):
    """Wall time from one ``on_train_batch_start`` to the next: the whole step, every callback included."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def step_times(self, skip: int) -> tuple[list[float], list[float]]:
        """Durations of the (even, odd) batches after the first ``skip``: without and with the callbacks."""
        times = [(i, b - a) for i, (a, b) in enumerate(zip(self.starts, self.starts[1:])) if i >= skip]
        return [t for i, t in times if i % 2 == 0], [t for i, t in times if i % 2 == 1]


class _EveryOtherStep(Callback):
    """Forward the per-step hooks to ``inner`` on odd batches only; the once-per-fit hooks always.

    Steps with and without the callbacks then alternate inside one run, so their step times are
    compared under the same machine load (a shared machine drifts a lot between separate runs).
    """

    def __init__(self, inner: list[Callback]) -> None:
        self.inner = inner
        self.active = False
        for name in STEP_HOOKS:
            setattr(self, name, self._forward(name, step_hook=True))
        for name in ONCE_HOOKS:
            setattr(self, name, self._forward(name, step_hook=False))

    def _forward(self, name: str, *, step_hook: bool) -> Callable[..., Any]:
        def hook(*args: Any, **kwargs: Any) -> None:
            if name == "on_train_batch_start":
                self.active = args[-1] % 2 == 1  # batch_idx
            if step_hook and not self.active:
                return
            for callback in self.inner:
                getattr(callback, name)(*args, **kwargs)

        return hook


def _time_hooks(callback: Callback) -> dict[str, float]:
    """Wrap ``callback``'s hooks (instance attributes shadow the class methods) and sum their time."""
    totals = {"step": 0.0, "once": 0.0}

    def wrap(fn: Callable[..., Any], bucket: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[bucket] += time.perf_counter() - start

        return timed

    for name in STEP_HOOKS:
        setattr(callback, name, wrap(getattr(callback, name), "step"))
    for name in ONCE_HOOKS:
        setattr(callback, name, wrap(getattr(callback, name), "once"))
    return totals


def _make_callbacks(kind: str) -> list[Callback]:
    if kind == "baseline":
        return []
    if kind == "memory_monitor":
        return [MemoryMonitor()]
    if kind == "empty_cache":
        return [EmptyCacheScheduler()]
    return [MemoryMonitor(), EmptyCacheScheduler()]


def _one_run(kind: str, model: torch.nn.Module, data: DataLoader, steps: int, warmup: int, root: str) -> dict[str, Any]:
    clock = _StepClock()
    callbacks = _make_callbacks(kind)
    hook_times = [_time_hooks(c) for c in callbacks]
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=10, logger=CSVLogger(root, name=kind),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock, _EveryOtherStep(callbacks)], default_root_dir=root,
    )
    trainer.fit(_LM(copy.deepcopy(model)), train_dataloaders=data)
    without, with_callbacks = clock.step_times(warmup)
    return {
        "median_step_without_s": statistics.median(without),
        "median_step_with_s": statistics.median(with_callbacks),
        "end_to_end_ratio": statistics.median(with_callbacks) / statistics.median(without),
        "hook_step_s": sum(h["step"] for h in hook_times) / (steps // 2),  # per step with the callbacks active
        "hook_once_s": sum(h["once"] for h in hook_times),
    }


def run(quick: bool = False) -> dict[str, Any]:
    """Measure the overhead; returns the results dict (also written as markdown + JSON)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    torch.manual_seed(0)
    # One thread: on a shared machine extra OpenMP threads only add spin-waiting noise to the ratio.
    torch.set_num_threads(1)
    steps, warmup = (20, 4) if quick else (60, 6)
    config = instantiate(OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny_qwen3.yaml"))
    model = config.build_model()
    ids = torch.randint(3, 384, (BATCH * steps, SEQ), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids), batch_size=BATCH)
    kinds = ["memory_monitor", "empty_cache", "both"]
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        _one_run("both", model, data, warmup + 2, 0, root)  # warm caches (imports, allocator, threads)
        for kind in kinds:
            r = _one_run(kind, model, data, steps, warmup, root)
            summary[kind] = {
                **r,
                "hook_overhead_fraction": r["hook_step_s"] / r["median_step_without_s"],
                "within_target": r["hook_step_s"] / r["median_step_without_s"] <= TARGET_OVERHEAD,
            }
    out = {
        "benchmark": "callback_overhead",
        "quick": quick,
        "device": "cpu",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "model": "tiny_qwen3",
        "batch": BATCH,
        "seq": SEQ,
        "steps_per_run": steps,
        "warmup_steps": warmup,
        "target_overhead_fraction": TARGET_OVERHEAD,
        "results": summary,
    }
    _write(out)
    return out


def _write(out: dict[str, Any]) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = "callbacks_cpu_quick" if out["quick"] else "callbacks_cpu"
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(out, indent=2))
    lines = [
        "# Callback overhead on a CPU training run (default settings)",
        "",
        f"tiny_qwen3, batch {out['batch']} x {out['seq']} tokens, AdamW, {out['steps_per_run']} steps per run "
        f"({out['warmup_steps']} warm-up steps not counted), torch {out['torch']}, {out['threads']} thread. "
        "In each run the callbacks are active on odd steps only, so steps with and without them alternate.",
        "",
        "| callbacks | median step without | median step with | end-to-end ratio | time in hooks per step | share of step time | one-time cost (setup + report) | <= 2% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in out["results"].items():
        lines.append(
            f"| {kind} | {r['median_step_without_s'] * 1e3:.1f} ms | {r['median_step_with_s'] * 1e3:.1f} ms | "
            f"{r['end_to_end_ratio']:.4f} | {r['hook_step_s'] * 1e3:.3f} ms | {r['hook_overhead_fraction']:.3%} | "
            f"{r['hook_once_s']:.2f} s | {'yes' if r['within_target'] else 'NO'} |"
        )
    lines += [
        "",
        "Share of step time: time measured inside the callbacks' per-step hooks over the median step time",
        "without them (the target, <= 2%). End-to-end ratio: median step time with / without, from the",
        "alternating steps of the same run; on a shared machine it carries a few percent of noise either way.",
        "The one-time cost (MemoryMonitor's end-of-fit table, JSON and PNG) is paid once per fit.",
        "",
    ]
    (RESULTS_DIR / f"{stem}.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    out = run(quick=args.quick)
    print((RESULTS_DIR / ("callbacks_cpu_quick.md" if args.quick else "callbacks_cpu.md")).read_text())
    sys.exit(0 if all(r["within_target"] for r in out["results"].values()) else 1)


if __name__ == "__main__":
    main()
