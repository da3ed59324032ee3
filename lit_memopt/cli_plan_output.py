"""``lit-memopt plan``'s output: the ranked table, the commands that run or check a plan, and ``plan.out``'s
experiment file (``cli_plan`` finds the plans; this prints them)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from lit_memopt.cli_estimate import cpu_seconds
from lit_memopt.cli_plan import (
    MATHS_EFFECTS,
    PLAN_ONLY_KEYS,
    plan_overrides,
    plan_recipe,
    plan_section,
    sequence_key,
)
from lit_memopt.cli_plan_rank import rank_estimate_args, with_overrides
from lit_memopt.memory.plan import Candidate, PlanResult, Prediction, RecipeShape
from lit_memopt.memory.units import format_bytes

__all__ = ["experiment_command", "experiment_yaml", "fit_command", "render_plan", "run_plan_command"]

# A plan whose reserved peak is within this share of the usable bytes, with a least device below it, gets a note: the
# allocator model replayed on the device fills it before it releases its cache (tiny Intuitor, 128-token rollouts, on
# 656 MiB: 590.00 of 590.40 MiB usable reserved, 574 MiB the least device).
NEAR_FULL = 0.02


def fit_command(argv: Sequence[str], cfg: Any, result: PlanResult, plan: Prediction) -> str:
    """``lit-memopt fit ...``: the user's overrides (less the plan's own and a replaced trainer) and the plan's."""
    extra = [f"memory_budget={format_bytes(result.memory_bytes).replace(' ', '')}"] if result.device.name.startswith("CPU") else []
    return _command("fit", [a for a in argv if not a.startswith(PLAN_ONLY_KEYS)], [*plan_overrides(cfg, result, plan), *extra])


def _command(verb: str, argv: Sequence[str], overrides: Sequence[str]) -> str:
    """``lit-memopt VERB``: the user's arguments less those ``overrides`` set again, then ``overrides``."""
    return _shell(verb, with_overrides(argv, overrides))


def _shell(verb: str, args: Sequence[str]) -> str:
    """``lit-memopt VERB ARGS...`` as one shell line."""
    return " ".join(["lit-memopt", verb, *(shlex.quote(a) for a in args)])


def _describe(p: Prediction, shape: RecipeShape) -> str:
    return _describe_candidate(p.candidate, shape)


def _describe_candidate(c: Candidate, shape: RecipeShape) -> str:
    ck = c.checkpointing
    checkpointing = ("no checkpointing" if not ck else "checkpointing" if ck is True
                     else f"checkpointing every {_ordinal(int(ck))} block")
    batch = (f"micro-batch {c.micro_batch} × {c.accumulation}" if not shape.micro_batch_key
             else f"{c.micro_batch} sequence{'' if c.micro_batch == 1 else 's'} per pass")  # the module's own micro-batches (CRSP)
    parts = [batch, checkpointing]
    if c.activation_offload:
        parts.append("activation offload")
    if c.strategy != "single":
        parts.append(c.strategy + (" + cpu offload" if c.offload else ""))
    parts += list(c.maths)
    return ", ".join(parts)


def _source(p: Prediction) -> str:
    """Where a plan's peak comes from: one rank's own trace, a trace, or the line between two."""
    return "traced rank" if p.rank_traced else "traced" if p.traced else "interpolated"


def _ordinal(k: int) -> str:
    return f"{k}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(k if k < 20 else k % 10, 'th') }"


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
          f"{result.device.name}; " + (
              f"global batch {shape.global_rows * shape.world_size} rows ({shape.global_rows} per rank and step)"
              if not shape.micro_batch_key else
              f"the module splits its step itself: the largest role's {shape.step_sequences} "
              f"sequences per rank in "
              f"passes of {shape.micro_batch_key}"), file=out)
    rec = result.recipe
    print(f"The recipe as given ({_describe(rec, shape)}): {what} {format_bytes(rec.peak_bytes)} per rank.", file=out)
    unit, scale = _unit(result.memory_bytes)
    if result.fits:
        width = max([58, *(len(_describe(p, shape)) for p in result.plans)])
        header = (f"{'#':>2}  {'plan':<{width}} {'peak ' + unit:>9} {'headroom':>9} {'step time':>9}  {'peak from':<12} "
                  f"levers ({unit} saved, time cost)")
        print(header, file=out)
        print("-" * len(header), file=out)
        for i, p in enumerate(result.plans, 1):
            levers = "; ".join(k if v is None else f"{k} {v[0] / scale:.2f}, {v[1]:+.0%}" for k, v in p.levers.items())
            levers = levers or "none (the recipe)"
            print(f"{i:>2}  {_describe(p, shape):<{width}} {p.peak_bytes / scale:>9.2f} {(result.usable_bytes - p.peak_bytes) / scale:>9.2f} "
                  f"{p.relative_time:>8.2f}×  {_source(p):<12} {levers}", file=out)
        for i, p in enumerate(result.plans, 1):
            least = p.estimate.least_reserved_bytes
            if least is None or least >= p.peak_bytes:
                continue
            if p.peak_bytes == p.estimate.device_bytes:
                # memory.step.within_device: a headroom of 0 here is the allocator using its room, not a tight fit
                print(f"Plan {i} reaches the usable {format_bytes(p.peak_bytes)}: its allocator would cache more, and "
                      f"releases its cached segments there instead; the step needs at least {format_bytes(least)}.",
                      file=out)
            elif result.usable_bytes - p.peak_bytes <= NEAR_FULL * result.usable_bytes:
                # a replay on the device: the allocator fills it before it releases its cache, so little headroom is
                # not a tight fit either
                print(f"Plan {i} reserves {format_bytes(p.peak_bytes)} of the usable {format_bytes(result.usable_bytes)}: "
                      f"its allocator releases its cached segments when the device is full; the step needs at least "
                      f"{format_bytes(least)}.", file=out)
        recorded, replayed, stretched = result.shared_regions
        rollouts = ([f"{recorded} generate calls traced, {replayed} replayed from those"] if replayed else []) + (
            [f"{stretched} made from short runs (memory.stretch)"] if stretched else [])
        shared = f" (their rollouts: {'; '.join(rollouts)})" if rollouts else ""
        ranks = f"; {result.rank_traces} plan{'' if result.rank_traces == 1 else 's'} traced as one rank" if result.rank_traces else ""
        print(f"Step time is relative to the recipe as given ({result.device.name}, memory.plan_time); "
              f"{result.traces} steps traced{shared}{ranks}.", file=out)
        if result.fastest_not_fitting is not None:
            q = result.fastest_not_fitting
            print(f"Fastest plan that does not fit: {_describe(q, shape)} ({format_bytes(q.peak_bytes)}, "
                  f"{_source(q)}).", file=out)
        for note in dict.fromkeys(result.notes):
            print(f"Note: {note}.", file=out)
        best_plan = result.plans[0]
        best = best_plan.candidate
        if best.strategy == "fsdp2" and not best.offload and not result.device.name.startswith("CPU"):
            command = _shell("estimate", rank_estimate_args(argv, plan_overrides(cfg, result, best_plan)))
            if best_plan.rank_traced:
                print(f"Plan 1's per-rank figure is one rank traced with its own allocator, as {command} prints it.",
                      file=out)
                levers = best_plan.arithmetic_levers
                if levers:
                    # the plans without those levers are priced by the arithmetic only: a saving between a traced rank
                    # and arithmetic would be the allocator models' difference as much as the lever's
                    many = len(levers) > 1
                    print(f"Plan 1's {' and '.join(levers)} saving{'s compare' if many else ' compares'} arithmetic "
                          f"figures (plan 1's: {format_bytes(best_plan.arithmetic_bytes)}): the plan{'s' if many else ''} "
                          f"without {'them are' if many else 'it is'} not traced as {'ranks' if many else 'a rank'}.",
                          file=out)
            else:
                # memory.sharding carries the one-device trace's allocator overhead over to a rank; a traced rank has
                # its own
                print("Plan 1's per-rank figure is arithmetic on a one-device trace (memory.sharding); one rank traced "
                      f"with its own allocator: {command}", file=out)
        for lever in dict.fromkeys(m for p in result.plans for m in p.candidate.maths):
            print(f"Changes the maths: {_effect(cfg, lever)}.", file=out)
        if result.untried is not None:
            faster, relative = result.untried
            overrides = plan_overrides(cfg, result, dataclasses.replace(result.recipe, candidate=faster))
            print(f"The recipe fits as given, so it is kept; untraced, {_describe_candidate(faster, shape)} is predicted "
                  f"at {relative:.2f}× its step time. To plan from there: {_command('plan', argv, overrides)}", file=out)
        print(fit_command(argv, cfg, result, result.plans[0]), file=out)
    else:
        # every plan was predicted (the closest's peak), or the optimizer step alone rules them all out (its floor)
        least = result.closest.peak_bytes if result.traces > 1 else max(result.floor_bytes, 1)
        need = least / (1.0 - result.margin)
        print(f"does not fit: needs at least {format_bytes(need)} with every lever (closest plan: {_describe(result.closest, shape)}, "
              f"{what} {format_bytes(result.closest.peak_bytes)}, {_source(result.closest)})", file=out)
        for note in dict.fromkeys(result.notes):
            print(f"Note: {note}.", file=out)
        if result.traces == 1:
            offloaded = "" if result.device.name.startswith("CPU") else " even with FSDP2's CPU offload (what stays on the device)"
            print(f"The optimizer step alone holds {format_bytes(result.floor_bytes)} per rank{offloaded}, which no "
                  "micro-batch or checkpointing changes; more devices "
                  "with trainer=fsdp2 trainer.devices=N shard it.", file=out)
        if not result.closest.candidate.maths and not plan_section(cfg)["allow"]:
            print("Levers that change the maths may fit: plan.allow=[lora,shorter_seq] searches them.", file=out)


def experiment_yaml(cfg: Any, result: PlanResult, plan: Prediction) -> str:
    """``plan``'s overrides as a Hydra experiment config (``# @package _global_``): group choices in its defaults
    list, keys nested, and the plan's predictions as comments."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    groups, values = [], OmegaConf.create({})
    for override in OverridesParser.create().parse_overrides(plan_overrides(cfg, result, plan)):
        key = override.key_or_group
        if "." not in key and key in ("trainer", "model", "data", "callbacks", "logger"):
            groups.append({f"override /{key}": override.value()})
        else:
            OmegaConf.update(values, key, override.value(), merge=True)
    body: dict[str, Any] = {"defaults": [*groups, "_self_"]} if groups else {}
    body.update(OmegaConf.to_container(values))
    what = "live tensor bytes" if result.device.name.startswith("CPU") else "reserved peak"
    head = [
        "# @package _global_",
        (f"# lit-memopt plan for recipe={cfg.get('recipe_name')} model={cfg.model.get('name')} in "
        f"{format_bytes(result.memory_bytes)} per device: {_describe(plan, result.shape)}"),
        (f"# predicted {what} {format_bytes(plan.peak_bytes)} per rank ({_source(plan)}), "
        f"step time {plan.relative_time:.2f}x the recipe's ({result.device.name}, memory.plan_time)"),
        *(f"# {_effect(cfg, m)}" for m in plan.candidate.maths),
    ]
    return "\n".join(head) + "\n" + (yaml.safe_dump(body, sort_keys=False) if body else "{}\n")


def experiment_command(argv: Sequence[str], path: str) -> str:
    """The ``lit-memopt fit`` command that runs an experiment file written at ``path``: its folder's parent is a
    config directory and the folder's name the group (``plans/experiment/x.yaml``: ``--config-dir plans
    +experiment=x``)."""
    from pathlib import Path

    file = Path(path).resolve()
    kept = [a for a in argv if not a.startswith(PLAN_ONLY_KEYS)]
    return _shell("fit", [*kept, "--config-dir", str(file.parent.parent), f"+{file.parent.name}={file.stem}"])


def _effect(cfg: Any, lever: str) -> str:
    if lever == "shorter_seq":
        from omegaconf import OmegaConf

        key = sequence_key(cfg)
        return MATHS_EFFECTS[lever].format(key=key, value=int(OmegaConf.select(cfg, key)) // 2)
    return MATHS_EFFECTS[lever]


def _write_out(path: str, cfg: Any, argv: Sequence[str], result: PlanResult, out: Any = None) -> None:
    """``plan.out=DIR/GROUP/NAME.yaml``: the best plan as an experiment config, and the command that uses it.

    Refuses to replace a file that is not an earlier plan (nothing a user owns is overwritten silently).
    """
    from pathlib import Path

    best = result.best
    file = Path(path)
    if file.exists() and not file.read_text(encoding="utf-8", errors="replace").startswith("# @package _global_\n# lit-memopt plan"):
        raise ValueError(f"plan.out={path}: the file exists and is not a plan written by lit-memopt; choose a new name")
    if best is None:
        print(f"plan.out={path} not written: no plan fits", file=out or sys.stdout)
        return
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(experiment_yaml(cfg, result, best), encoding="utf-8")
    tmp.replace(file)
    print(f"Wrote {path}; run it with: {experiment_command(argv, path)}", file=out or sys.stdout)


def run_plan_command(cfg: Any, argv: Sequence[str] = ()) -> int:
    """``lit-memopt plan``: print the plan; 0 when one fits, 2 when none does."""
    started, cpu = time.perf_counter(), cpu_seconds()
    result = plan_recipe(cfg, argv)
    render_plan(result, cfg, argv)
    out = plan_section(cfg)["out"]
    if out:
        _write_out(str(out), cfg, argv, result)
    # timings on stderr: stdout stays the same from run to run
    print(f"Planned in {time.perf_counter() - started:.1f} s ({cpu_seconds() - cpu:.1f} s of CPU time) on fake tensors.",
          file=sys.stderr)
    return 0 if result.fits else 2
