"""``lit-memopt plan``: the fastest configuration of a recipe that fits a GPU, and the command that runs it.

``lit-memopt plan recipe=R model=M gpu_memory=24GiB [trainer=fsdp2 trainer.devices=N trainer.num_nodes=K]
[plan.device=h100] [plan.out=FILE.yaml] [safety_margin=0.1]``. The recipe is built as ``estimate`` builds it
(fake weights, 1 and 2 blocks traced and extrapolated); ``memory.plan`` searches the levers that keep the maths
exact and ``memory.plan_time`` ranks them. Exit code 0 when a plan fits, 2 when none does.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from lit_memopt.cli_estimate import (
    RecipeEstimator,
    cpu_seconds,
    data_parallel_plan,
    estimate_options,
    recipe_batch,
    strategy_cpu_offload,
)
from lit_memopt.cli_fake_run import activation_checkpointing_callbacks, block_count
from lit_memopt.memory.batch import batch_geometry, resize_batch
from lit_memopt.memory.plan import (
    Candidate,
    PlanResult,
    Prediction,
    RecipeShape,
    changed_levers,
    merge_variants,
    search_plans,
)
from lit_memopt.memory.plan_time import device_spec
from lit_memopt.memory.replay import SharedRegions
from lit_memopt.memory.search import usable_bytes
from lit_memopt.memory.units import format_bytes
from lit_memopt.models.hf import checkpoint_period
from lit_memopt.models.sharding import replicated_parameter_bytes

__all__ = ["MATHS_LEVERS", "PlanTracer", "plan_overrides", "plan_recipe", "recipe_shape", "render_plan", "run_plan_command"]

# The levers that change the maths, searched only when named in plan.allow and only when the exact levers alone
# fit nothing (see docs/planning.md). optim8bit is named but not searched: the pack has no 8-bit optimizer yet.
MATHS_LEVERS = ("lora", "optim8bit", "shorter_seq")
SEARCHED_MATHS_LEVERS = ("lora", "shorter_seq")
# plan.allow=[lora] on a model without adapters: these, the common choice for instruction and RL tuning
LORA_OVERRIDE = "model.lora={r:16,alpha:32,dropout:0.0,target_modules:[q_proj,k_proj,v_proj,o_proj]}"
# plan.allow=[shorter_seq]: the first of these keys the recipe has is halved (a row's tokens, or the generated ones)
SEQUENCE_KEYS = ("data.max_length", "data.seq_len", "module.max_new_tokens")
# What each maths lever changes, said under the table whenever a listed plan uses it.
MATHS_EFFECTS = {
    "lora": "lora: trains rank-16 adapters on the attention projections instead of every weight (a different, "
            "smaller update; the frozen base also serves as the reference model where the method has one)",
    "shorter_seq": "shorter_seq: {key} halved to {value} (rows are cut, or fewer tokens generated: the loss sees less)",
}
# The module switches that checkpoint every decoder block, by recipe module (the first one the module has).
CHECKPOINT_KEYS = ("gradient_checkpointing", "checkpoint_steps")
# The switches that also take k >= 2, every k-th decoder block (transformers' every_n_layers), and the k searched.
PERIODIC_CHECKPOINT_KEYS = ("gradient_checkpointing",)
CHECKPOINT_PERIODS = (2,)
# A plan whose reserved peak is within this share of the usable bytes, with a least device below it, gets a note: the
# allocator model replayed on the device fills it before it releases its cache (tiny Intuitor, 128-token rollouts, on
# 656 MiB: 590.00 of 590.40 MiB usable reserved, 574 MiB the least device).
NEAR_FULL = 0.02
# Activation offload: the callback the plan adds (offload only; checkpointing stays the module switch's lever).
ACTIVATION_OFFLOAD_KEY = "callbacks.activation_offload"
ACTIVATION_OFFLOAD = {"_target_": "lit_memopt.callbacks.ActivationCheckpointing", "recompute": False, "offload_to_cpu": True}
# Command-line keys that configure the plan itself, not the run it plans.
_PLAN_ONLY = ("gpu_memory=", "safety_margin=", "plan.", "+plan.", "check_linearity=", "trace_all_blocks=", "trace_rank=")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _plan_section(cfg: Any) -> dict[str, Any]:
    section = cfg.get("plan") or {}
    allow = section.get("allow") or []
    if isinstance(allow, str):
        allow = [allow]
    allow = [str(a) for a in allow]
    for name in allow:
        if name not in MATHS_LEVERS:
            raise ValueError(f"plan.allow: unknown lever {name!r}; choose from: {', '.join(MATHS_LEVERS)}")
        if name not in SEARCHED_MATHS_LEVERS:
            raise ValueError(f"plan.allow: {name!r} is not searched: lit-memopt has no 8-bit optimizer to run it with; "
                             f"allow {' or '.join(SEARCHED_MATHS_LEVERS)}, or drop it")
    out = section.get("out")
    if out is not None and not str(out).endswith((".yaml", ".yml")):
        raise ValueError(f"plan.out={out!r}: give a .yaml file (it is written as an experiment config: +experiment=NAME)")
    return {"device": device_spec(section.get("device") or "h100"), "out": out,
            "allow": [a for a in SEARCHED_MATHS_LEVERS if a in allow]}


def sequence_key(cfg: Any) -> str | None:
    """The key ``shorter_seq`` halves: the first of :data:`SEQUENCE_KEYS` that holds an integer above 1."""
    from omegaconf import OmegaConf

    for key in SEQUENCE_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return key
    return None


def maths_overrides(cfg: Any, levers: Sequence[str]) -> list[str]:
    """The overrides that apply the ``plan.allow`` ``levers`` to the recipe ``cfg``.

    Raises:
        ValueError: a lever that cannot apply to this recipe (LoRA already on, no sequence length to halve).
    """
    from omegaconf import OmegaConf

    out = []
    for lever in levers:
        if lever == "lora":
            if cfg.model.get("lora"):
                raise ValueError("plan.allow=[lora]: the model already trains LoRA adapters (model.lora is set)")
            out.append(LORA_OVERRIDE)
        elif lever == "shorter_seq":
            key = sequence_key(cfg)
            if key is None:
                raise ValueError(f"plan.allow=[shorter_seq]: recipe={cfg.get('recipe_name')} has none of "
                                 f"{', '.join(SEQUENCE_KEYS)} to halve; shorten its sequences yourself")
            out.append(f"{key}={int(OmegaConf.select(cfg, key)) // 2}")
    return out


def _checkpoint_key(cfg: Any) -> str | None:
    module = cfg.get("module") or {}
    return next((k for k in CHECKPOINT_KEYS if k in module), None)


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"plan: {key} must be a positive integer, got {value!r}")
    return int(value)


def micro_batch_key(module: Any) -> str | None:
    """What the micro-batch lever changes (``RecipeShape.micro_batch_key``): ``None``, the loader's batch with
    Lightning's accumulation; for a module that optimizes manually (CRSP), whose step Lightning cannot split, its
    own setting (``module.`` + its ``micro_batch_setting``), or ``""`` where it has none (the step is not split)."""
    if module is None or getattr(module, "automatic_optimization", True):
        return None
    setting = getattr(module, "micro_batch_setting", None)
    return f"module.{setting}" if setting else ""


def recipe_checkpointing(cfg: Any) -> bool | int | None:
    """The recipe's checkpointing setting as the search keys it: ``None`` where the module has no switch, else off
    (``False``), every block (``True``) or every k-th (``k``), read as the module reads the switch (a bad value is one
    line)."""
    key = _checkpoint_key(cfg)
    module = cfg.get("module") or {}
    if key in PERIODIC_CHECKPOINT_KEYS:
        period = checkpoint_period(module.get(key) or False, f"module.{key}")
        return period if period >= 2 else bool(period)
    return None if key is None else bool(module.get(key))


def recipe_shape(cfg: Any, batch: Any, blocks: int, maths: Sequence[str] = (), replicated: int = 0,
                 built: Any = None, activation_offload: bool = False) -> RecipeShape:
    """The recipe as given on the command line, for the search; ``built``: the recipe's LightningModule (whether
    it optimizes manually, and how it splits its own step, see :func:`micro_batch_key`); ``activation_offload``:
    search it (see :func:`offloadable`)."""
    from omegaconf import OmegaConf

    data = cfg.get("data") or {}
    rows = _positive(data.get("batch_size"), "data.batch_size")
    accumulation = _positive(cfg.trainer.get("accumulate_grad_batches", 1), "trainer.accumulate_grad_batches")
    inner = micro_batch_key(built)
    if inner is not None and accumulation > 1:
        raise ValueError(f"plan: {cfg.module.get('_target_')} optimizes manually, and Lightning refuses "
                         f"trainer.accumulate_grad_batches={accumulation} there; drop it"
                         + (f" (the module splits its own step: {inner})" if inner else ""))
    key = _checkpoint_key(cfg)
    parallel = data_parallel_plan(cfg)
    strategy, world = parallel if parallel is not None else ("single", 1)
    offload = strategy_cpu_offload(cfg, parallel)
    module = cfg.get("module") or {}
    _, seq = batch_geometry(batch)
    # generation recipes run each row's prompt and its new tokens, and GRPO-style ones sample a group per prompt
    tokens = float((seq or 1) + int(module.get("max_new_tokens") or 0)) * int(module.get("num_samples") or 1)
    step_sequences = 0
    if inner:
        # rows become the module's sequences per forward/backward, and accumulation its passes over the largest role
        value = _positive(OmegaConf.select(cfg, inner), inner)
        step_sequences = int(built.largest_pass_sequences(rows))
        rows, accumulation = value, -(-step_sequences // value)
        new_tokens = OmegaConf.select(cfg, "module.generation.max_new_tokens", default=None)
        if OmegaConf.is_dict(new_tokens):  # one cap per role: a sequence is at most the longest
            tokens = float((seq or 1) + max(int(v) for v in new_tokens.values()))
    checkpointing = recipe_checkpointing(cfg)
    # every k-th block: the blocks must come in whole groups of k (the estimator traces them so)
    periods = tuple(k for k in CHECKPOINT_PERIODS if blocks % k == 0 and blocks > k) if key in PERIODIC_CHECKPOINT_KEYS else ()
    return RecipeShape(
        rows=rows, accumulation=accumulation, checkpointing=checkpointing, checkpoint_periods=periods,
        strategy=strategy, world_size=world, nodes=int(cfg.trainer.get("num_nodes") or 1), blocks=blocks,
        tokens_per_row=tokens, dtype_bytes=DTYPE_BYTES.get(str(cfg.model.get("dtype", "float32")), 4),
        offload=offload, maths=tuple(maths), replicated_bytes=int(replicated), micro_batch_key=inner,
        step_sequences=step_sequences, activation_offload=False if activation_offload else None,
    )


def offloadable(cfg: Any, module: Any) -> bool:
    """Whether the plan can add activation offload to this recipe: the module has decoder blocks the callback finds,
    and the recipe configures no ``ActivationCheckpointing`` of its own (kept as given, never combined with ours)."""
    from lit_memopt.callbacks.activation_checkpointing import ActivationCheckpointing

    if activation_checkpointing_callbacks(cfg):
        return False
    return bool(ActivationCheckpointing(recompute=False, offload_to_cpu=True).select_layers(module))


class PlanTracer:
    """``(checkpointing, rows, accumulating[, activation_offload]) -> PeakEstimate``: one estimator (one fake module)
    per checkpointing setting, activation offload and (CRSP) pass size."""

    def __init__(self, cfg: Any, cpu_target: bool, device_bytes: int | None = None) -> None:
        from omegaconf import open_dict

        self.cfg = cfg
        self.cpu_target = cpu_target
        # The usable bytes of a device (GPU targets): the allocator model releases its cache there, as in `estimate`.
        self.device_bytes = device_bytes
        self.key = _checkpoint_key(cfg)
        # set by recipe_shape once the module turns out to optimize manually: then `rows` are its own micro-batch
        self.inner_key: str | None = None
        self.estimators: dict[tuple[bool | int, int | None, bool], RecipeEstimator] = {}
        self.batch: Any = None
        self._open_dict = open_dict
        # The rollouts every setting's trace runs alike (memory.replay): traced once per block count, then replayed.
        self.shared_regions = SharedRegions()

    def estimator(self, ckpt: bool | int, inner: int | None = None, offload: bool = False) -> RecipeEstimator:
        """The estimator of the recipe with checkpointing ``ckpt``, (``inner``) the module's micro-batch setting and
        (``offload``) the activation-offload callback the plan would add."""
        if (ckpt, inner, offload) not in self.estimators:
            from omegaconf import OmegaConf

            cfg = self.cfg.copy()
            with self._open_dict(cfg):
                if self.key is not None:
                    cfg.module[self.key] = ckpt
                if inner is not None:
                    OmegaConf.update(cfg, self.inner_key, inner, merge=False)
                if offload:
                    OmegaConf.update(cfg, ACTIVATION_OFFLOAD_KEY, dict(ACTIVATION_OFFLOAD), merge=False)
            est = RecipeEstimator(cfg, False, None)
            # a CPU run (memory_budget) steps AdamW with its per-parameter loop, CUDA with foreach
            est.optimizer_foreach = not self.cpu_target
            est.device_bytes = self.device_bytes
            est.shared_regions = self.shared_regions
            if self.batch is None:
                self.batch = recipe_batch(est.run.datamodule)
            self.estimators[(ckpt, inner, offload)] = est
        return self.estimators[(ckpt, inner, offload)]

    def recipe_shape(self, blocks: int, maths: Sequence[str] = ()) -> RecipeShape:
        """The recipe's :class:`RecipeShape`, from its own estimator (built here): whether its module optimizes
        manually sets what the micro-batch lever changes, and so what ``rows`` mean to this tracer from now on."""
        cfg = self.cfg
        # the recipe's own setting: its estimator is the one the search traces the recipe with
        setting = recipe_checkpointing(cfg)
        est = self.estimator(False if setting is None else setting)
        module = est.run.module
        shape = recipe_shape(cfg, self.batch, blocks, maths, replicated_parameter_bytes(module, blocks), built=module,
                             activation_offload=not self.cpu_target and offloadable(cfg, module))
        self.inner_key = shape.micro_batch_key
        return shape

    def __call__(self, ckpt: bool, rows: int, accumulating: bool, activation_offload: bool = False) -> Any:
        if self.inner_key:
            # the module's own micro-batches: the recipe's batch, split by the module in one step (its gradients are
            # live across them as the trace shows, so no accumulating flag)
            from omegaconf import OmegaConf

            # the recipe's own value is the estimator already built for it (a fake build is seconds at 7B)
            est = self.estimator(ckpt, None if rows == OmegaConf.select(self.cfg, self.inner_key) else rows,
                                 activation_offload)
            est.accumulating = False
            est.cache.clear()
            return est.trace(self.batch, None)
        est = self.estimator(ckpt, None, activation_offload)
        est.accumulating = accumulating
        est.cache.clear()  # keyed by rows only; memory.plan keeps its own cache by (checkpointing, rows, accumulating)
        return est.trace(resize_batch(self.batch, batch_size=rows), rows)

    def close(self) -> None:
        for est in self.estimators.values():
            est.close()


def plan_recipe(cfg: Any) -> PlanResult:
    """Everything ``lit-memopt plan`` prints, without printing it."""
    opts = estimate_options(cfg)
    if opts["gpu_bytes"] is None:
        raise ValueError("plan needs the memory of one device: add gpu_memory=24GiB (or 40GiB, 80GiB, ...)")
    if opts["trace_all_blocks"] or opts["trace_rank"]:
        option = "trace_all_blocks" if opts["trace_all_blocks"] else "trace_rank"
        raise ValueError(f"{option} is an estimate option: plan shares one-device 1- and 2-block traces across its "
                         f"candidates. Check the plan it prints with `lit-memopt estimate <its overrides> {option}=true`")
    section = _plan_section(cfg)
    device = section["device"]
    cpu_target = device.name.startswith("CPU")
    from hydra.utils import instantiate

    blocks = block_count(instantiate(cfg.model)) or 1
    result = _search(cfg, blocks, (), opts, device, cpu_target)
    if result.fits or not section["allow"]:
        return result
    # Nothing exact fits: the allowed maths levers, alone and together (lora, shorter_seq, both), each a variant of
    # the recipe searched like the recipe itself.
    allow = section["allow"]
    combos = [(a,) for a in allow] + ([tuple(allow)] if len(allow) > 1 else [])
    variants = []
    for combo in combos:
        variant = compose_variant(cfg, maths_overrides(cfg, combo))
        variants.append(_search(variant, blocks, combo, opts, device, cpu_target))
    return merge_variants(result, variants)


def compose_variant(cfg: Any, overrides: Sequence[str]) -> Any:
    """``cfg`` with Hydra-style ``key=value`` overrides applied (the values parsed as the command line would)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    cfg = cfg.copy()
    parser = OverridesParser.create()
    with open_dict(cfg):
        for override in parser.parse_overrides(list(overrides)):
            OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False)
    return cfg


def _search(cfg: Any, blocks: int, maths: Sequence[str], opts: dict, device: Any, cpu_target: bool) -> PlanResult:
    # A GPU's traces model its allocator on the usable bytes, as `estimate gpu_memory=` does (a CPU target judges
    # live bytes: no allocator).
    tracer = PlanTracer(cfg, cpu_target, None if cpu_target else usable_bytes(opts["gpu_bytes"], opts["margin"]))
    try:
        result = search_plans(tracer, tracer.recipe_shape(blocks, maths), opts["gpu_bytes"], device=device,
                              margin=opts["margin"], use_reserved=not cpu_target, offload=not cpu_target)
    finally:
        tracer.close()
    regions = tracer.shared_regions
    result.shared_regions = (regions.recorded, regions.replayed, regions.stretched)
    return result


# ============================================================================ what to run
def plan_overrides(cfg: Any, result: PlanResult, plan: Prediction) -> list[str]:
    """The overrides that turn the recipe into ``plan`` (empty: the recipe as given)."""
    c, recipe = plan.candidate, result.shape.recipe
    out: list[str] = []
    levers = changed_levers(c, recipe)
    if c.strategy != recipe.strategy:
        out.append(f"trainer={c.strategy}")
        if recipe.strategy == "single":
            out.append("trainer.devices=1")  # FSDP2 on the one device (trainer=fsdp2 defaults to two)
    if "cpu offload" in levers:
        out.append(f"trainer.strategy.cpu_offload={str(c.offload).lower()}")
    if "micro-batch" in levers:
        key = result.shape.micro_batch_key
        out += ([f"{key}={c.micro_batch}"] if key else
                [f"data.batch_size={c.micro_batch}", f"trainer.accumulate_grad_batches={c.accumulation}"])
    if "checkpointing" in levers:
        out.append(f"module.{_checkpoint_key(cfg)}={str(c.checkpointing).lower()}")
    if "activation offload" in levers:
        fields = ",".join(f"{k}:{str(v).lower() if isinstance(v, bool) else v}" for k, v in ACTIVATION_OFFLOAD.items())
        out.append(f"+{ACTIVATION_OFFLOAD_KEY}={{{fields}}}")
    out += maths_overrides(cfg, [m for m in c.maths if m not in recipe.maths])
    return out


def fit_command(argv: Sequence[str], cfg: Any, result: PlanResult, plan: Prediction) -> str:
    """``lit-memopt fit ...``: the user's overrides (less the plan's own and a replaced trainer) and the plan's."""
    extra = [f"memory_budget={format_bytes(result.memory_bytes).replace(' ', '')}"] if result.device.name.startswith("CPU") else []
    return _command("fit", [a for a in argv if not a.startswith(_PLAN_ONLY)], [*plan_overrides(cfg, result, plan), *extra])


def _command(verb: str, argv: Sequence[str], overrides: Sequence[str]) -> str:
    """``lit-memopt VERB``: the user's arguments less those ``overrides`` set again, then ``overrides``."""
    replaced = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    kept = [a for a in argv if a.split("=", 1)[0].lstrip("+") not in replaced]
    return " ".join(["lit-memopt", verb, *(shlex.quote(a) for a in [*kept, *overrides])])


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
                  f"{p.relative_time:>8.2f}×  {'traced' if p.traced else 'interpolated':<12} {levers}", file=out)
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
        print(f"Step time is relative to the recipe as given ({result.device.name}, memory.plan_time); "
              f"{result.traces} steps traced{shared}.", file=out)
        if result.fastest_not_fitting is not None:
            q = result.fastest_not_fitting
            print(f"Fastest plan that does not fit: {_describe(q, shape)} ({format_bytes(q.peak_bytes)}, "
                  f"{'traced' if q.traced else 'interpolated'}).", file=out)
        best = result.plans[0].candidate
        if best.strategy == "fsdp2" and not best.offload and not result.device.name.startswith("CPU"):
            # memory.sharding carries the one-device trace's allocator overhead over to a rank; a traced rank has its own
            overrides = plan_overrides(cfg, result, result.plans[0])
            estimate_argv = [a for a in argv if not a.startswith(("plan.", "+plan."))]
            print("Plan 1's per-rank figure is arithmetic on a one-device trace (memory.sharding); one rank traced with "
                  f"its own allocator: {_command('estimate', estimate_argv, overrides)} trace_rank=true", file=out)
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
              f"{what} {format_bytes(result.closest.peak_bytes)}, {'traced' if result.closest.traced else 'interpolated'})", file=out)
        if result.traces == 1:
            offloaded = "" if result.device.name.startswith("CPU") else " even with FSDP2's CPU offload (what stays on the device)"
            print(f"The optimizer step alone holds {format_bytes(result.floor_bytes)} per rank{offloaded}, which no "
                  "micro-batch or checkpointing changes; more devices "
                  "with trainer=fsdp2 trainer.devices=N shard it.", file=out)
        if not result.closest.candidate.maths and not _plan_section(cfg)["allow"]:
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
        (f"# predicted {what} {format_bytes(plan.peak_bytes)} per rank ({'traced' if plan.traced else 'interpolated'}), "
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
    kept = [a for a in argv if not a.startswith(_PLAN_ONLY)]
    return " ".join(["lit-memopt", "fit", *(shlex.quote(a) for a in kept), "--config-dir", shlex.quote(str(file.parent.parent)),
                     shlex.quote(f"+{file.parent.name}={file.stem}")])


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
    result = plan_recipe(cfg)
    render_plan(result, cfg, argv)
    out = _plan_section(cfg)["out"]
    if out:
        _write_out(str(out), cfg, argv, result)
    # timings on stderr: stdout stays the same from run to run
    print(f"Planned in {time.perf_counter() - started:.1f} s ({cpu_seconds() - cpu:.1f} s of CPU time) on fake tensors.",
          file=sys.stderr)
    return 0 if result.fits else 2
