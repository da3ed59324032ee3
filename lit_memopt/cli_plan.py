"""``lit-memopt plan``: the fastest configuration of a recipe that fits a GPU, and the command that runs it.

``lit-memopt plan recipe=R model=M gpu_memory=24GiB [trainer=fsdp2 trainer.devices=N trainer.num_nodes=K]
[plan.device=h100] [plan.out=FILE.yaml] [safety_margin=0.1]``. The recipe is built as ``estimate`` builds it
(fake weights, 1 and 2 blocks traced and extrapolated); ``memory.plan`` searches the levers that keep the maths
exact and ``memory.plan_time`` ranks them. Exit code 0 when a plan fits, 2 when none does.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

from lit_memopt.cli_estimate import (
    RecipeEstimator,
    block_count,
    cpu_seconds,
    data_parallel_plan,
    estimate_options,
    recipe_batch,
)
from lit_memopt.memory.batch import batch_geometry, resize_batch
from lit_memopt.memory.plan import PlanResult, Prediction, RecipeShape, changed_levers, search_plans
from lit_memopt.memory.plan_time import device_spec
from lit_memopt.memory.units import format_bytes

__all__ = ["MATHS_LEVERS", "PlanTracer", "plan_overrides", "plan_recipe", "recipe_shape", "render_plan", "run_plan_command"]

# The levers that change the maths, searched only when named in plan.allow (not searched yet: see docs/planning.md).
MATHS_LEVERS = ("lora", "optim8bit", "shorter_seq")
# The module switches that checkpoint every decoder block, by recipe module (the first one the module has).
CHECKPOINT_KEYS = ("gradient_checkpointing", "checkpoint_steps")
# Command-line keys that configure the plan itself, not the run it plans.
_PLAN_ONLY = ("gpu_memory=", "safety_margin=", "plan.", "+plan.", "check_linearity=")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _plan_section(cfg: Any) -> dict[str, Any]:
    section = cfg.get("plan") or {}
    allow = list(section.get("allow") or [])
    for name in allow:
        if name not in MATHS_LEVERS:
            raise ValueError(f"plan.allow: unknown lever {name!r}; choose from: {', '.join(MATHS_LEVERS)}")
    if allow:
        raise ValueError(f"plan.allow={allow}: the levers that change the maths ({', '.join(MATHS_LEVERS)}) are not "
                         "searched yet; plan without plan.allow (see docs/planning.md)")
    return {"device": device_spec(section.get("device") or "h100"), "out": section.get("out")}


def _checkpoint_key(cfg: Any) -> str | None:
    module = cfg.get("module") or {}
    return next((k for k in CHECKPOINT_KEYS if k in module), None)


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"plan: {key} must be a positive integer, got {value!r}")
    return int(value)


def recipe_shape(cfg: Any, batch: Any, blocks: int) -> RecipeShape:
    """The recipe as given on the command line, for the search."""
    data = cfg.get("data") or {}
    rows = _positive(data.get("batch_size"), "data.batch_size")
    accumulation = _positive(cfg.trainer.get("accumulate_grad_batches", 1), "trainer.accumulate_grad_batches")
    key = _checkpoint_key(cfg)
    parallel = data_parallel_plan(cfg)
    strategy, world = parallel if parallel is not None else ("single", 1)
    module = cfg.get("module") or {}
    _, seq = batch_geometry(batch)
    # generation recipes run each row's prompt and its new tokens, and GRPO-style ones sample a group per prompt
    tokens = float((seq or 1) + int(module.get("max_new_tokens") or 0)) * int(module.get("num_samples") or 1)
    return RecipeShape(
        rows=rows, accumulation=accumulation, checkpointing=None if key is None else bool(module.get(key)),
        strategy=strategy, world_size=world, nodes=int(cfg.trainer.get("num_nodes") or 1), blocks=blocks,
        tokens_per_row=tokens, dtype_bytes=DTYPE_BYTES.get(str(cfg.model.get("dtype", "float32")), 4),
    )


class PlanTracer:
    """``(checkpointing, rows, accumulating) -> PeakEstimate``: one estimator (one fake module) per checkpointing setting."""

    def __init__(self, cfg: Any, cpu_target: bool) -> None:
        from omegaconf import open_dict

        self.cfg = cfg
        self.cpu_target = cpu_target
        self.key = _checkpoint_key(cfg)
        self.estimators: dict[bool, RecipeEstimator] = {}
        self.batch: Any = None
        self._open_dict = open_dict

    def estimator(self, ckpt: bool) -> RecipeEstimator:
        if ckpt not in self.estimators:
            cfg = self.cfg.copy()
            if self.key is not None:
                with self._open_dict(cfg):
                    cfg.module[self.key] = ckpt
            est = RecipeEstimator(cfg, False, None)
            # a CPU run (memory_budget) steps AdamW with its per-parameter loop, CUDA with foreach
            est.optimizer_foreach = not self.cpu_target
            if self.batch is None:
                self.batch = recipe_batch(est.run.datamodule)
            self.estimators[ckpt] = est
        return self.estimators[ckpt]

    def __call__(self, ckpt: bool, rows: int, accumulating: bool) -> Any:
        est = self.estimator(ckpt)
        est.accumulating = accumulating
        est.cache.clear()  # keyed by rows only; memory.plan keeps its own cache by (checkpointing, rows, accumulating)
        return est.estimate(resize_batch(self.batch, batch_size=rows), rows)

    def close(self) -> None:
        for est in self.estimators.values():
            est.close()


def plan_recipe(cfg: Any) -> PlanResult:
    """Everything ``lit-memopt plan`` prints, without printing it."""
    opts = estimate_options(cfg)
    if opts["gpu_bytes"] is None:
        raise ValueError("plan needs the memory of one device: add gpu_memory=24GiB (or 40GiB, 80GiB, ...)")
    section = _plan_section(cfg)
    device = section["device"]
    cpu_target = device.name.startswith("CPU")
    from hydra.utils import instantiate

    blocks = block_count(instantiate(cfg.model)) or 1
    tracer = PlanTracer(cfg, cpu_target)
    try:
        tracer.estimator(bool((cfg.get("module") or {}).get(tracer.key))) if tracer.key else tracer.estimator(False)
        shape = recipe_shape(cfg, tracer.batch, blocks)
        return search_plans(tracer, shape, opts["gpu_bytes"], device=device, margin=opts["margin"],
                            use_reserved=not cpu_target)
    finally:
        tracer.close()


# ============================================================================ what to run
def plan_overrides(cfg: Any, result: PlanResult, plan: Prediction) -> list[str]:
    """The overrides that turn the recipe into ``plan`` (empty: the recipe as given)."""
    c, recipe = plan.candidate, result.shape.recipe
    out: list[str] = []
    levers = changed_levers(c, recipe)
    if "strategy" in levers:
        out.append(f"trainer={c.strategy}")
    if "micro-batch" in levers:
        out += [f"data.batch_size={c.micro_batch}", f"trainer.accumulate_grad_batches={c.accumulation}"]
    if "checkpointing" in levers:
        out.append(f"module.{_checkpoint_key(cfg)}={str(c.checkpointing).lower()}")
    return out


def fit_command(argv: Sequence[str], cfg: Any, result: PlanResult, plan: Prediction) -> str:
    """``lit-memopt fit ...``: the user's overrides (less the plan's own and a replaced trainer) and the plan's."""
    overrides = plan_overrides(cfg, result, plan)
    replaced = {o.split("=", 1)[0] for o in overrides}
    kept = [a for a in argv if not a.startswith(_PLAN_ONLY) and a.split("=", 1)[0].lstrip("+") not in replaced]
    extra = [f"memory_budget={format_bytes(result.memory_bytes).replace(' ', '')}"] if result.device.name.startswith("CPU") else []
    return " ".join(["lit-memopt", "fit", *kept, *overrides, *extra])


def _describe(p: Prediction) -> str:
    c = p.candidate
    parts = [f"micro-batch {c.micro_batch} × {c.accumulation}", "checkpointing" if c.checkpointing else "no checkpointing"]
    if c.strategy != "single":
        parts.append(c.strategy)
    return ", ".join(parts)


def _unit(memory_bytes: int) -> tuple[str, int]:
    """GiB for GPUs; MiB for the small budgets of CPU trials, where GiB would round every plan alike."""
    return ("GiB", 2**30) if memory_bytes >= 4 * 2**30 else ("MiB", 2**20)


def render_plan(result: PlanResult, cfg: Any, argv: Sequence[str], out: Any = None) -> None:
    """Print the ranked table of fitting plans and the command to run (deterministic: no timings)."""
    out = out or sys.stdout
    shape = result.shape
    what = "live tensor bytes (fit memory_budget=)" if result.device.name.startswith("CPU") else "reserved peak"
    ranks = f"{shape.world_size} × " if shape.world_size > 1 else ""
    print(f"Plan for recipe={cfg.get('recipe_name')} model={cfg.model.get('name')}: {ranks}{format_bytes(result.memory_bytes)} "
          f"({format_bytes(result.usable_bytes)} usable after a {result.margin:.0%} margin), step time modelled on "
          f"{result.device.name}; global batch {shape.global_rows * shape.world_size} rows "
          f"({shape.global_rows} per rank and step)", file=out)
    rec = result.recipe
    print(f"The recipe as given ({_describe(rec)}): {what} {format_bytes(rec.peak_bytes)} per rank.", file=out)
    unit, scale = _unit(result.memory_bytes)
    if result.fits:
        header = (f"{'#':>2}  {'plan':<44} {'peak ' + unit:>9} {'headroom':>9} {'step time':>9}  {'peak from':<12} "
                  f"levers ({unit} saved, time cost)")
        print(header, file=out)
        print("-" * len(header), file=out)
        for i, p in enumerate(result.plans, 1):
            levers = "; ".join(f"{k} {saved / scale:.2f}, {cost:+.0%}" for k, (saved, cost) in p.levers.items()) or "none (the recipe)"
            print(f"{i:>2}  {_describe(p):<44} {p.peak_bytes / scale:>9.2f} {(result.usable_bytes - p.peak_bytes) / scale:>9.2f} "
                  f"{p.relative_time:>8.2f}×  {'traced' if p.traced else 'interpolated':<12} {levers}", file=out)
        print(f"Step time is relative to the recipe as given ({result.device.name}, memory.plan_time); "
              f"{result.traces} steps traced.", file=out)
        if result.fastest_not_fitting is not None:
            q = result.fastest_not_fitting
            print(f"Fastest plan that does not fit: {_describe(q)} ({format_bytes(q.peak_bytes)}, "
                  f"{'traced' if q.traced else 'interpolated'}).", file=out)
        print(fit_command(argv, cfg, result, result.plans[0]), file=out)
    else:
        # every plan was predicted (the closest's peak), or the optimizer step alone rules them all out (its floor)
        least = result.closest.peak_bytes if result.traces > 1 else max(result.floor_bytes, 1)
        need = least / (1.0 - result.margin)
        print(f"does not fit: needs at least {need / 2**30:.2f} GiB with every lever (closest plan: {_describe(result.closest)}, "
              f"{what} {format_bytes(result.closest.peak_bytes)}, {'traced' if result.closest.traced else 'interpolated'})", file=out)
        if result.traces == 1:
            print(f"The optimizer step alone holds {format_bytes(result.floor_bytes)} per rank (weights, gradients, optimizer "
                  "states and the update's temporaries), which no micro-batch or checkpointing changes; more devices "
                  "with trainer=fsdp2 trainer.devices=N shard it.", file=out)


def _write_out(path: str, cfg: Any, argv: Sequence[str], result: PlanResult) -> None:
    """``plan.out=FILE.yaml``: the best plan's overrides and predictions (``lit-memopt fit $(...)`` reads the list)."""
    import yaml

    best = result.best
    data = {
        "recipe": str(cfg.get("recipe_name")),
        "fits": result.fits,
        "command": fit_command(argv, cfg, result, best) if best else None,
        "overrides": plan_overrides(cfg, result, best) if best else [],
        "predicted_peak_bytes": int((best or result.closest).peak_bytes),
        "relative_step_time": float((best or result.closest).relative_time),
        "memory_bytes": int(result.memory_bytes),
        "device": result.device.name,
    }
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(data, handle, sort_keys=False)


def run_plan_command(cfg: Any, argv: Sequence[str] = ()) -> int:
    """``lit-memopt plan``: print the plan; 0 when one fits, 2 when none does."""
    started, cpu = time.perf_counter(), cpu_seconds()
    result = plan_recipe(cfg)
    render_plan(result, cfg, argv)
    out = _plan_section(cfg)["out"]
    if out:
        _write_out(str(out), cfg, argv, result)
    # timings on stderr: stdout stays the same from run to run
    print(f"Planned in {time.perf_counter() - started:.1f} s ({cpu_seconds() - cpu:.1f} s of CPU time) on fake tensors.",
          file=sys.stderr)
    return 0 if result.fits else 2
