"""``lit-memopt plan`` checked on a GPU: the plans it chooses for Qwen3-4B fit, and their predicted time order holds.

For each budget (24 and 40 GiB by default) the script plans ``recipe=sft model=qwen3_4b`` (random init, real shapes),
takes up to ``--plans`` fitting plans (the ranked table, then other fitting candidates, fastest predicted first), and
runs each one in a fresh process capped at the budget (``torch.cuda.set_per_process_memory_fraction``) for
``--steps`` optimizer steps. It records ``torch.cuda.max_memory_reserved`` and the median optimizer-step time of
the steps after the first, and checks:

* every plan fits: no out-of-memory error and a reserved peak at most the budget;
* the predicted order of the fitting plans matches the measured one: no pair whose measured times differ by more
  than 10% is ordered the other way round.

Writes ``results/plan_cuda_<gpu>.{md,json}``. Run ``python -m benchmarks.plan_cuda`` on a GPU machine (about
1 minute per plan on an H100); ``--dry-run`` runs the same logic on the CPU with the tiny model under
``memory_budget`` (what the CPU tests can check of it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

HERE = Path(__file__).resolve().parent
FIT = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "trainer.enable_checkpointing=false",
       "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "validate_first=false", "~callbacks.oom_recovery"]
MISORDER_TOLERANCE = 0.10


class StepTimer(Callback):
    """The wall time of each optimizer step (CUDA synchronised) and the reserved peak, written at the end of fit."""

    def __init__(self, out: str) -> None:
        self.out, self.times, self.last, self.step = out, [], 0.0, 0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.last, self.step = self._now(), trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:  # an optimizer step ended with this batch
            now = self._now()
            self.times.append(now - self.last)
            self.last, self.step = now, trainer.global_step

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        reserved = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None
        Path(self.out).write_text(json.dumps({"step_seconds": self.times, "max_memory_reserved": reserved}))


def run_one(args: list[str], fraction: float | None, out: str) -> None:
    """In a fresh process: cap the CUDA memory, then ``lit-memopt fit`` with a step timer."""
    if fraction is not None and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)
    from lit_memopt import cli

    code = cli.main(["fit", *args, "+callbacks.step_timer._target_=benchmarks.plan_cuda.StepTimer",
                     f"+callbacks.step_timer.out={out}"])
    raise SystemExit(code)


def choose(result: Any, count: int) -> list[Any]:
    """The ranked plans, then the other fitting candidates, fastest predicted first: up to ``count`` of them."""
    chosen = list(result.plans)
    for p in result.predictions:
        if len(chosen) >= count:
            break
        if p.peak_bytes <= result.usable_bytes and p not in chosen:
            chosen.append(p)
    return sorted(chosen[:count], key=lambda p: p.seconds)


def misordered(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs predicted in one order and measured, by more than the tolerance, in the other."""
    bad = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:  # a is predicted no slower than b
            if a["measured_s"] is None or b["measured_s"] is None:
                continue
            if a["measured_s"] > b["measured_s"] * (1 + MISORDER_TOLERANCE) and a["predicted_s"] < b["predicted_s"]:
                bad.append((a["plan"], b["plan"]))
    return bad


def plan_budget(base: list[str], budget: str, count: int, steps: int, dry_run: bool, workdir: Path) -> dict[str, Any]:
    from lit_memopt import cli
    from lit_memopt.cli_plan import plan_overrides, plan_recipe
    from lit_memopt.cli_plan_output import _describe
    from lit_memopt.memory.search import parse_memory_size

    started = time.perf_counter()
    cfg = cli.compose_config([*base, f"gpu_memory={budget}", *(["plan.device=cpu", "safety_margin=0"] if dry_run else [])])
    result = plan_recipe(cfg)
    planning = time.perf_counter() - started
    budget_bytes = parse_memory_size(budget)
    rows = []
    for i, p in enumerate(choose(result, count)):
        overrides = plan_overrides(cfg, result, p)
        out = workdir / f"{budget}_{i}.json"
        args = [*base, *overrides, *FIT, f"trainer.max_steps={steps}", f"hydra.run.dir={workdir / f'{budget}_{i}'}"]
        fraction = None
        if dry_run:
            args.append(f"memory_budget={budget}")
        else:
            fraction = min(1.0, budget_bytes / torch.cuda.get_device_properties(0).total_memory)
        code = f"from benchmarks.plan_cuda import run_one; run_one({args!r}, {fraction!r}, {str(out)!r})"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=HERE.parent,
                              env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        measured = json.loads(out.read_text()) if out.exists() else {}
        times = measured.get("step_seconds", [])[1:]  # the first step warms up kernels and the allocator
        oom = "OutOfMemoryError" in proc.stderr
        rows.append({
            "plan": _describe(p, result.shape), "overrides": overrides, "predicted_peak_bytes": p.peak_bytes, "traced": p.traced,
            "predicted_s": p.seconds, "predicted_relative": p.relative_time, "returncode": proc.returncode, "oom": oom,
            "max_memory_reserved": measured.get("max_memory_reserved"),
            "measured_s": statistics.median(times) if times else None, "wall_s": time.perf_counter() - t0,
            "stderr_tail": proc.stderr[-1500:] if proc.returncode else "",
        })
    fits = [r for r in rows if r["returncode"] == 0 and not r["oom"]
            and (r["max_memory_reserved"] is None or r["max_memory_reserved"] <= budget_bytes)]
    return {"budget": budget, "planning_s": planning, "plans_fitting_predicted": len(result.plans), "rows": rows,
            "all_fit": len(fits) == len(rows) and bool(rows), "misordered": misordered(fits)}


def to_markdown(report: dict[str, Any]) -> str:
    lines = [f"# `lit-memopt plan` on {report['device']}", "",
             (f"Recipe `{' '.join(report['base'])}`, {report['steps']} optimizer steps per plan (median of all but the "
             "first); reserved = `torch.cuda.max_memory_reserved`."), ""]
    for b in report["budgets"]:
        lines += [f"## {b['budget']}: every plan fits: {b['all_fit']}; mis-ordered pairs (>10%): {len(b['misordered'])}", "",
                  "| plan | predicted peak GiB | reserved GiB | predicted × | measured s/step | fits |", "|---|---|---|---|---|---|"]
        for r in b["rows"]:
            reserved = "" if r["max_memory_reserved"] is None else f"{r['max_memory_reserved'] / 2**30:.2f}"
            measured = "" if r["measured_s"] is None else f"{r['measured_s']:.3f}"
            lines.append(f"| {r['plan']} | {r['predicted_peak_bytes'] / 2**30:.2f} | {reserved} | {r['predicted_relative']:.2f} | "
                         f"{measured} | {r['returncode'] == 0 and not r['oom']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="24GiB,40GiB")
    parser.add_argument("--plans", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU under memory_budget")
    parser.add_argument("--out", default=str(HERE / "results"))
    opts = parser.parse_args(argv)
    if opts.dry_run:
        base, device, budgets = ["recipe=sft"], "cpu (dry run, tiny model)", opts.budgets
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --dry-run)")
        base, device, budgets = ["recipe=sft", "model=qwen3_4b"], torch.cuda.get_device_name(), opts.budgets
    workdir = Path(opts.out) / "plan_cuda_runs"
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "base": base, "steps": opts.steps,
              "budgets": [plan_budget(base, b, opts.plans, opts.steps, opts.dry_run, workdir) for b in budgets.split(",")]}
    slug = "dry_run" if opts.dry_run else "".join(c if c.isalnum() else "_" for c in device.lower())
    Path(opts.out, f"plan_cuda_{slug}.json").write_text(json.dumps(report, indent=1))
    Path(opts.out, f"plan_cuda_{slug}.md").write_text(to_markdown(report))
    print(to_markdown(report))
    ok = all(b["all_fit"] and not b["misordered"] for b in report["budgets"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
