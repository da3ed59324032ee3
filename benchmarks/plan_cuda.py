"""``lit-memopt plan`` checked on a GPU: the plans it chooses for Qwen3-4B fit, and their predicted time order holds.

For each case and budget (24 and 40 GiB by default) the script plans the case (random init, real shapes), takes up
to ``--plans`` fitting plans (the ranked table, then other fitting candidates, fastest predicted first), and runs
each one in a fresh process capped at the budget (``torch.cuda.set_per_process_memory_fraction``) for ``--steps``
optimizer steps. It records ``torch.cuda.max_memory_reserved`` and the median optimizer-step time of the steps after
the first, and checks:

* every plan fits: no out-of-memory error and a reserved peak at most the budget;
* the predicted order of the fitting plans matches the measured one: no pair whose measured times differ by more
  than 10% is ordered the other way round;
* some case and budget has at least 4 fitting plans whose order was checked.

The cases (:data:`CASES`): Qwen3-4B full fine-tuning, where on one 24 or 40 GiB GPU only FSDP2's CPU offload leaves
room for the optimizer step (one plan), and LoRA on 16 rows of 1024 tokens, where the budget binds the activations
(micro-batching, checkpointing, offload: plans far enough apart in time to order). A plan chosen at several budgets
runs once, capped at the smallest of them (what fits there fits the larger ones). With ``--deadline`` no run starts
that the time left cannot hold; the result is written after every run, so a run cut short leaves what it measured.

Writes ``results/plan_cuda_<gpu>.{md,json}`` (or under ``--out``). Run ``python -m benchmarks.plan_cuda`` on a GPU
machine; ``--dry-run`` runs the same logic on the CPU with the tiny model under ``memory_budget`` (what the CPU tests
can check of it).
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

from lit_memopt.cli_plan import LORA_OVERRIDE

HERE = Path(__file__).resolve().parent
FIT = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "trainer.enable_checkpointing=false",
       "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "validate_first=false", "~callbacks.oom_recovery"]
MISORDER_TOLERANCE = 0.10
ORDERED_PLANS = 4  # the must-show: the time order of at least this many fitting plans
MIN_RUN_SECONDS = 45.0  # a plan's run that the time left cannot give this much is not started
# (LoRA first: its four runs are the time-order check, the one the must-show cannot do without)
CASES = {"lora": ["recipe=sft", "model=qwen3_4b", LORA_OVERRIDE, "data.seq_len=1024", "data.batch_size=16"],
         "full": ["recipe=sft", "model=qwen3_4b"]}
# --dry-run: the tiny model; its LoRA at 256 tokens binds micro-batch and checkpointing at tens of MiB
DRY_RUN_CASES = {"full": ["recipe=sft"], "lora": ["recipe=sft", LORA_OVERRIDE, "data.seq_len=256"]}


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


def plan_case(base: list[str], budget: str, count: int, dry_run: bool) -> dict[str, Any]:
    """Plan ``base`` at ``budget``: the chosen plans (:func:`choose`) with their overrides and predictions."""
    from lit_memopt import cli
    from lit_memopt.cli_plan import plan_overrides, plan_recipe
    from lit_memopt.cli_plan_output import _describe

    started = time.perf_counter()
    cfg = cli.compose_config([*base, f"gpu_memory={budget}", *(["plan.device=cpu", "safety_margin=0"] if dry_run else [])])
    result = plan_recipe(cfg)
    rows = [{"plan": _describe(p, result.shape), "overrides": plan_overrides(cfg, result, p), "predicted_peak_bytes": p.peak_bytes,
             "traced": p.traced, "predicted_s": p.seconds, "predicted_relative": p.relative_time}
            for p in choose(result, count)]
    return {"budget": budget, "planning_s": time.perf_counter() - started, "plans_fitting_predicted": len(result.plans),
            "rows": rows}


def schedule(planned: dict[str, list[dict[str, Any]]]) -> list[tuple[str, tuple[str, ...], str]]:
    """The runs to make, ``(case, overrides, budget)``: each case's distinct plans once, capped at the smallest budget
    that chose it; in the order the plans were chosen (case by case, smallest budget first, fastest predicted first)."""
    from lit_memopt.memory.search import parse_memory_size

    runs: dict[tuple[str, tuple[str, ...]], str] = {}
    for case, budgets in planned.items():
        for b in sorted(budgets, key=lambda b: parse_memory_size(b["budget"])):
            for row in b["rows"]:
                runs.setdefault((case, tuple(row["overrides"])), b["budget"])
    return [(case, overrides, budget) for (case, overrides), budget in runs.items()]


def run_plan(base: list[str], overrides: tuple[str, ...], budget: str, steps: int, dry_run: bool, workdir: Path,
             name: str, timeout: float | None) -> dict[str, Any]:
    """``lit-memopt fit`` of one plan in a fresh process under ``budget``: its return code, out-of-memory error,
    reserved peak and median step time (``None`` where it did not get that far)."""
    from lit_memopt.memory.search import parse_memory_size

    out = workdir / f"{name}.json"
    out.unlink(missing_ok=True)
    args = [*base, *overrides, *FIT, f"trainer.max_steps={steps}", f"hydra.run.dir={workdir / name}"]
    fraction = None
    if dry_run:
        args.append(f"memory_budget={budget}")
    else:
        fraction = min(1.0, parse_memory_size(budget) / torch.cuda.get_device_properties(0).total_memory)
    code = f"from benchmarks.plan_cuda import run_one; run_one({args!r}, {fraction!r}, {str(out)!r})"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=HERE.parent,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE.parent), os.environ.get("PYTHONPATH"))))},
                              timeout=timeout)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, stderr = None, f"timed out after {timeout:.0f} s\n" + (exc.stderr or b"").decode(errors="replace")[-1500:]
    measured = json.loads(out.read_text()) if out.exists() else {}
    times = measured.get("step_seconds", [])[1:]  # the first step warms up kernels and the allocator
    return {"budget_run": budget, "returncode": returncode, "oom": "OutOfMemoryError" in stderr,
            "max_memory_reserved": measured.get("max_memory_reserved"),
            "measured_s": statistics.median(times) if times else None, "wall_s": time.perf_counter() - t0,
            "stderr_tail": stderr[-1500:] if returncode else ""}


def judge(planned: dict[str, list[dict[str, Any]]]) -> None:
    """Each case and budget's verdicts, from its rows' measurements (set in place): every plan fits, mis-ordered
    pairs among the fitting ones, and how many fitting plans were ordered."""
    from lit_memopt.memory.search import parse_memory_size

    for budgets in planned.values():
        for b in budgets:
            limit = parse_memory_size(b["budget"])
            ran = [r for r in b["rows"] if "returncode" in r]
            fits = [r for r in ran if r["returncode"] == 0 and not r["oom"]
                    and (r["max_memory_reserved"] is None or r["max_memory_reserved"] <= limit)]
            b.update(runs=len(ran), all_fit=bool(b["rows"]) and len(fits) == len(b["rows"]), misordered=misordered(fits),
                     ordered_plans=sum(r["measured_s"] is not None for r in fits))


def check(planned: dict[str, list[dict[str, Any]]]) -> bool:
    """The GPU must-show: every plan of every case and budget fits, none mis-ordered, and some case and budget
    ordered at least :data:`ORDERED_PLANS` fitting plans."""
    groups = [b for budgets in planned.values() for b in budgets]
    return (bool(groups) and all(b["all_fit"] and not b["misordered"] for b in groups)
            and max(b["ordered_plans"] for b in groups) >= ORDERED_PLANS)


def to_markdown(report: dict[str, Any]) -> str:
    lines = [f"# `lit-memopt plan` on {report['device']}", "",
             (f"{report['steps']} optimizer steps per plan (median of all but the first); reserved = "
              "`torch.cuda.max_memory_reserved` (none on the CPU: `memory_budget` counts live bytes). A plan chosen at "
              "several budgets ran once, capped at the smallest."), "",
             f"**Must show met: {report.get('passed')}** (every plan fits, no pair mis-ordered by more than 10%, at least "
             f"{ORDERED_PLANS} fitting plans ordered in one case and budget); {report.get('wall_s', 0):.0f} s wall.", ""]
    for case, budgets in report["cases"].items():
        for b in budgets:
            lines += [f"## {case} (`{' '.join(report['bases'][case])}`) at {b['budget']}: every plan fits: {b.get('all_fit')}; "
                      f"mis-ordered pairs (>10%): {len(b.get('misordered', []))}; planned in {b['planning_s']:.1f} s", "",
                      "| plan | predicted peak GiB | reserved GiB | capped at | predicted × | measured s/step | fits |",
                      "|---|---|---|---|---|---|---|"]
            for r in b["rows"]:
                reserved = "" if r.get("max_memory_reserved") is None else f"{r['max_memory_reserved'] / 2**30:.2f}"
                measured = "" if r.get("measured_s") is None else f"{r['measured_s']:.3f}"
                fits = "not run" if "returncode" not in r else r["returncode"] == 0 and not r["oom"]
                lines.append(f"| {r['plan']} | {r['predicted_peak_bytes'] / 2**30:.2f} | {reserved} | {r.get('budget_run', '')} | "
                             f"{r['predicted_relative']:.2f} | {measured} | {fits} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="24GiB,40GiB")
    parser.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    parser.add_argument("--plans", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole script: no run starts "
                        "that the time left cannot hold (--run-seconds)")
    parser.add_argument("--run-seconds", type=float, default=150.0, help="the longest one plan's run may take")
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU under memory_budget")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--workdir", default=None, help="the runs' folders (default: OUT/plan_cuda_runs)")
    opts = parser.parse_args(argv)
    started = time.perf_counter()
    table = DRY_RUN_CASES if opts.dry_run else CASES
    names = list(table) if opts.cases is None else [c.strip() for c in opts.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}: choose from {', '.join(table)}")
    if opts.dry_run:
        device = "cpu (dry run, tiny model)"
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --dry-run)")
        device = torch.cuda.get_device_name()
    bases = {n: table[n] for n in names}
    workdir = Path(opts.workdir) if opts.workdir else Path(opts.out) / "plan_cuda_runs"
    workdir.mkdir(parents=True, exist_ok=True)
    slug = "dry_run" if opts.dry_run else "".join(c if c.isalnum() else "_" for c in device.lower())
    report: dict[str, Any] = {"device": device, "bases": bases, "steps": opts.steps, "cases": {}}

    def write() -> None:
        judge(report["cases"])
        report["passed"] = check(report["cases"])
        report["wall_s"] = time.perf_counter() - started
        Path(opts.out, f"plan_cuda_{slug}.json").write_text(json.dumps(report, indent=1))
        Path(opts.out, f"plan_cuda_{slug}.md").write_text(to_markdown(report))

    for name, base in bases.items():
        report["cases"][name] = [plan_case(base, b, opts.plans, opts.dry_run) for b in opts.budgets.split(",")]
        print(f"[plan_cuda] {name} planned: " + "; ".join(f"{b['budget']} {len(b['rows'])} plans" for b in report["cases"][name]),
              flush=True)
    write()
    for i, (case, overrides, budget) in enumerate(schedule(report["cases"])):
        left = None if opts.deadline is None else opts.deadline - (time.perf_counter() - started)
        if left is not None and left < min(opts.run_seconds, MIN_RUN_SECONDS):
            print(f"[plan_cuda] out of time: {case} {' '.join(overrides)} not run", flush=True)
            continue
        timeout = opts.run_seconds if left is None else min(opts.run_seconds, left)
        measured = run_plan(bases[case], overrides, budget, opts.steps, opts.dry_run, workdir, f"{case}_{i}", timeout)
        for b in report["cases"][case]:
            for row in b["rows"]:
                if tuple(row["overrides"]) == overrides:
                    row.update(measured)
        print(f"[plan_cuda] {case} {' '.join(overrides) or '(as given)'} under {budget}: rc {measured['returncode']}, "
              f"{measured['measured_s']} s/step, {measured['wall_s']:.0f} s", flush=True)
        write()
    write()
    print(to_markdown(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
