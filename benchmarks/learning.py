"""Each RL recipe's embedded default, run as a user runs it, judged on its held-out metric.

``lit-memopt fit recipe=NAME`` in a fresh run directory (warm start included), then the first validation (right
after any warm start, before any RL step) against the last, from the run's ``metrics.csv``:

* ``crsp``: held-out solve rate up by at least 0.15, proposal validity still >= 0.9;
* ``intuitor``: held-out accuracy up, KL to the reference bounded (last ``train/kl`` <= 1 nat);
* ``grade``: held-out reward up, ``val/kl`` <= 1 nat;
* ``ttt``: held-out recall accuracy up by at least 0.5.

Where the issue names a margin (CRSP's +0.15, TTT's +0.5 here) the gain must reach it. Where it asks only for "up"
(Intuitor, GRADE), the gain must exceed twice the standard error of the difference, from the standard errors over
prompts the recipe logs (``<metric>_stderr``), taken as independent: the first and last validation score the same
prompts, so this bar is conservative. Every recipe must also finish within 15 minutes. One run per recipe at its
default seed; the verdicts are the targets of issue 15.

Run ``python benchmarks/learning.py [--quick] [--only crsp,ttt]`` (also ``python -m benchmarks --only learning``);
``--quick`` runs the two short recipes (``grade``, ``ttt``; about two minutes together on a 2-core CPU). Writes
``benchmarks/results/learning_cpu[_quick].{md,json}`` (``learning_cpu_<names>`` with ``--only``); exits 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

if __package__ in (None, ""):  # `python benchmarks/learning.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import write_results  # noqa: E402

TIME_LIMIT_S = 15 * 60  # each default recipe, warm start included, on a 2-core CPU
QUICK = ("grade", "ttt")


@dataclass(frozen=True)
class Target:
    """What a recipe's held-out metric must do between its first and last validation."""

    metric: str
    min_gain: float = 0.0  # the last value minus the first, at least; 0: above the noise bar (twice the stderr)
    guard: Optional[str] = None  # a second logged metric that must stay within ``guard_bound`` at the end
    guard_bound: float = math.inf
    guard_at_least: bool = False  # the guard is a floor (validity) rather than a ceiling (KL)


TARGETS = {
    "crsp": Target("val/solve_rate", 0.15, guard="val/proposal_valid_rate", guard_bound=0.9, guard_at_least=True),
    "intuitor": Target("val/accuracy", guard="train/kl", guard_bound=1.0),
    "grade": Target("val/reward", guard="val/kl", guard_bound=1.0),
    "ttt": Target("val/recall_acc", 0.5),
}


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of the run's CSV log (``logs/version_*/metrics.csv``, the newest), each key with a value."""
    logs = sorted(run_dir.glob("logs/version_*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not logs:
        raise FileNotFoundError(f"no logs/version_*/metrics.csv under {run_dir}: did the run use the csv logger?")
    with logs[-1].open(newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]


def _last(rows: list[dict[str, float]], key: str) -> Optional[float]:
    values = [row[key] for row in rows if key in row]
    return values[-1] if values else None


def judge(name: str, rows: list[dict[str, float]], seconds: float) -> dict[str, Any]:
    """The recipe's verdict from its logged rows: first and last held-out value, their standard errors, the gain,
    the noise bar, the guard, and which targets were met."""
    target = TARGETS[name]
    validations = [row for row in rows if target.metric in row]
    if len(validations) < 2:
        raise ValueError(f"{name}: {target.metric} was logged {len(validations)} time(s); the judgement needs a first "
                         "and a last validation (validate_first and a val_check_interval below max_steps)")
    first, last = validations[0], validations[-1]
    gain = last[target.metric] - first[target.metric]
    stderr_key = target.metric + "_stderr"
    noise = None
    if stderr_key in first and stderr_key in last:
        noise = 2 * math.hypot(first[stderr_key], last[stderr_key])
    guard = _last(rows, target.guard) if target.guard else None
    checks = {
        "gain": gain > 0 and gain >= target.min_gain,
        "beyond noise": target.min_gain > 0 or noise is None or gain > noise,  # a named margin is the bar itself
        "time": seconds <= TIME_LIMIT_S,
    }
    if target.guard:
        checks["guard"] = guard is not None and (guard >= target.guard_bound if target.guard_at_least
                                                 else guard <= target.guard_bound)
    return {
        "recipe": name, "target": asdict(target), "seconds": seconds,
        "first": first[target.metric], "first_step": int(first.get("step", 0)), "first_stderr": first.get(stderr_key),
        "last": last[target.metric], "last_step": int(last.get("step", 0)), "last_stderr": last.get(stderr_key),
        "trajectory": [row[target.metric] for row in validations], "gain": gain, "noise": noise, "guard": guard,
        "checks": checks, "passed": all(checks.values()),
    }


def run_recipe(name: str, run_dir: Path, overrides: tuple[str, ...] = ()) -> float:
    """``lit-memopt fit recipe=NAME`` in ``run_dir``, as a user runs it; its wall time in seconds. The run's
    output goes to ``run_dir/run.log``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "lit_memopt", "fit", f"recipe={name}", f"hydra.run.dir={run_dir}", *overrides]
    start = time.perf_counter()
    with (run_dir / "run.log").open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=2 * TIME_LIMIT_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = (run_dir / "run.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"`{' '.join(command[1:])}` exited with {done.returncode}:\n" + "\n".join(tail))
    return seconds


def describe(target: dict[str, Any]) -> tuple[str, str]:
    """What a target (``asdict(Target)``) asks of the gain and of its guard's last value (``""`` without a guard),
    as the report writes them."""
    wanted = f">= {target['min_gain']:g}" if target["min_gain"] else "> 0 and > noise bar"
    bound = f"{'>=' if target['guard_at_least'] else '<='} {target['guard_bound']:g}" if target["guard"] else ""
    return wanted, bound


def _report_target(target: dict[str, Any]) -> str:
    wanted, bound = describe(target)
    guard = f", {target['guard']} {bound}" if bound else ""
    return f"gain {wanted}{guard}, <= {TIME_LIMIT_S // 60} min"


def _value(value: Optional[float], stderr: Optional[float]) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" + (f" ± {stderr:.3f}" if stderr is not None else "")


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Held-out learning of each recipe's embedded default",
        "",
        f"`{result['command']}` · torch {result['torch']} · {result['machine']} · {result['cpus']} CPUs · one run "
        "per recipe at its default seed. First: the first validation (right after any warm start, before any RL "
        "step); last: the end of the run; ± the standard error over held-out prompts where the recipe logs it. "
        "Noise bar: twice the standard error of the difference.",
        "",
        "| recipe | held-out metric | first | last | gain | noise bar | target | guard at the end | wall time | verdict |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in result["recipes"]:
        t = r["target"]
        wanted, bound = describe(t)
        guard = f"{t['guard']} {_value(r['guard'], None)} ({bound})" if bound else "—"
        noise = "—" if r["noise"] is None else f"{r['noise']:.3f}"
        missed = [k for k, ok in r["checks"].items() if not ok]
        verdict = "met" if r["passed"] else "MISSED: " + ", ".join(missed)
        lines.append(f"| {r['recipe']} | {t['metric']} | {_value(r['first'], r['first_stderr'])} | "
                     f"{_value(r['last'], r['last_stderr'])} | {r['gain']:+.3f} | {noise} | {wanted} | {guard} | "
                     f"{r['seconds'] / 60:.1f} min | {verdict} |")
    lines += ["", "The noise bar gates the recipes without a named margin (intuitor, grade).", "",
              "Trajectories (every validation): "
              + "; ".join(f"{r['recipe']} " + " → ".join(f"{v:.3f}" for v in r["trajectory"]) for r in result["recipes"]),
              ""]
    for failure in result["failures"]:
        lines.append(f"- {failure}")
    return "\n".join(lines) + "\n"


def results_name(quick: bool = False, only: Optional[list[str]] = None) -> str:
    """``learning_cpu``, ``learning_cpu_quick``, or ``learning_cpu_<names>`` for ``--only``."""
    if only:
        return "learning_cpu_" + "_".join(only)
    return f"learning_cpu{'_quick' if quick else ''}"


def run(quick: bool = False, write: bool = True, only: Optional[list[str]] = None,
        workdir: Optional[Path] = None) -> dict[str, Any]:
    names = list(only or (QUICK if quick else TARGETS))
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; the learning benchmark judges {sorted(TARGETS)}")
    recipes, failures = [], []
    with tempfile.TemporaryDirectory(prefix="lit-memopt-learning-") as scratch:
        root = Path(workdir or scratch)
        for name in names:
            print(f"[learning] lit-memopt fit recipe={name}", flush=True)
            try:
                seconds = run_recipe(name, root / name)
                recipes.append(judge(name, read_metrics(root / name), seconds))
            except (RuntimeError, ValueError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
                failures.append(f"{name}: {exc}")
    command = "python benchmarks/learning.py" + (" --quick" if quick else "") + (f" --only {','.join(only)}" if only else "")
    result = {"command": command, "quick": quick, "torch": torch.__version__, "machine": platform.platform(),
              "cpus": os.cpu_count(), "recipes": recipes, "failures": failures}
    if write:  # a partial run (--only) keeps its own file: the full run's table stays whole
        write_results(results_name(quick, only), result, to_markdown(result))
    rows = [{"case": "learning", "metric": f"{r['recipe']}: held-out {r['target']['metric']}, last − first",
             "baseline": r["first"], "baseline_label": "first validation", "optimized": r["last"], "unit": "",
             "ratio": None, "target": _report_target(r["target"]), "pass": r["passed"]} for r in recipes]
    rows += [{"case": "learning", "metric": failure.splitlines()[0], "baseline": None, "baseline_label": "",
              "optimized": None, "unit": "", "ratio": None, "target": "runs", "pass": False} for failure in failures]
    return {"report_rows": rows, **result}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only the short recipes ({', '.join(QUICK)})")
    parser.add_argument("--only", default=None, help=f"comma-separated recipes out of {','.join(TARGETS)}")
    parser.add_argument("--workdir", default=None, help="keep the run directories here (default: a temporary folder)")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    result = run(quick=args.quick, only=only, workdir=Path(args.workdir) if args.workdir else None)
    print(to_markdown(result))
    return 0 if result["recipes"] and not result["failures"] and all(r["passed"] for r in result["recipes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
