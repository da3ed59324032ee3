"""``lit-memopt plan``: the fastest configuration of a recipe that fits a GPU, and the command that runs it.

``lit-memopt plan recipe=R model=M gpu_memory=24GiB [trainer=fsdp2 trainer.devices=N trainer.num_nodes=K]
[plan.device=h100] [plan.out=FILE.yaml] [safety_margin=0.1]``. The recipe is built as ``estimate`` builds it
(fake weights, 1 and 2 blocks traced and extrapolated); ``memory.plan`` searches the levers that keep the maths
exact and ``memory.plan_time`` ranks them. Exit code 0 when a plan fits, 2 when none does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lit_memopt.cli_estimate import (
    RecipeEstimator,
    data_parallel_plan,
    estimate_options,
    recipe_batch,
    strategy_cpu_offload,
)
from lit_memopt.cli_fake_run import activation_checkpointing_callbacks, block_count
from lit_memopt.cli_plan_rank import rank_confirmer, with_overrides
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
from lit_memopt.models.hf import checkpoint_period
from lit_memopt.models.sharding import replicated_parameter_bytes

__all__ = ["MATHS_LEVERS", "PlanTracer", "candidate_overrides", "plan_overrides", "plan_recipe", "recipe_shape"]

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
# Activation offload: the callback the plan adds (offload only; checkpointing stays the module switch's lever).
ACTIVATION_OFFLOAD_KEY = "callbacks.activation_offload"
ACTIVATION_OFFLOAD = {"_target_": "lit_memopt.callbacks.ActivationCheckpointing", "recompute": False, "offload_to_cpu": True}
# Command-line keys that configure the plan itself, not the run it plans.
PLAN_ONLY_KEYS = ("gpu_memory=", "safety_margin=", "plan.", "+plan.", "check_linearity=", "trace_all_blocks=", "trace_rank=",
              "search_micro_batch=")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def plan_section(cfg: Any) -> dict[str, Any]:
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
    seconds = section.get("rank_seconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0):
        raise ValueError(f"plan.rank_seconds must be a number of seconds >= 0 (0: no rank traced), got {seconds!r}")
    return {"device": device_spec(section.get("device") or "h100"), "out": out,
            "allow": [a for a in SEARCHED_MATHS_LEVERS if a in allow], "rank_seconds": seconds}


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


def plan_recipe(cfg: Any, argv: Sequence[str] | None = None) -> PlanResult:
    """Everything ``lit-memopt plan`` prints, without printing it.

    ``argv``: the command line ``cfg`` was composed from. With it, the fastest fitting FSDP2 plan over several GPUs is
    checked by tracing one of its ranks (``cli_plan_rank``), composed from it; without it, per-rank figures are
    arithmetic on one-device traces.
    """
    opts = estimate_options(cfg)
    if opts["gpu_bytes"] is None:
        raise ValueError("plan needs the memory of one device: add gpu_memory=24GiB (or 40GiB, 80GiB, ...)")
    if opts["trace_all_blocks"] or opts["trace_rank"]:
        option = "trace_all_blocks" if opts["trace_all_blocks"] else "trace_rank"
        raise ValueError(f"{option} is an estimate option: plan shares one-device 1- and 2-block traces across its "
                         f"candidates. Check the plan it prints with `lit-memopt estimate <its overrides> {option}=true`")
    section = plan_section(cfg)
    from hydra.utils import instantiate

    blocks = block_count(instantiate(cfg.model)) or 1
    result = _search(cfg, blocks, (), opts, section, argv)
    if result.fits or not section["allow"]:
        return result
    # Nothing exact fits: the allowed maths levers, alone and together (lora, shorter_seq, both), each a variant of
    # the recipe searched like the recipe itself.
    allow = section["allow"]
    combos = [(a,) for a in allow] + ([tuple(allow)] if len(allow) > 1 else [])
    variants = []
    for combo in combos:
        overrides = maths_overrides(cfg, combo)
        variant = compose_variant(cfg, overrides)
        variants.append(_search(variant, blocks, combo, opts, section,
                                None if argv is None else with_overrides(argv, overrides)))
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


def _search(cfg: Any, blocks: int, maths: Sequence[str], opts: dict, section: dict[str, Any],
            argv: Sequence[str] | None) -> PlanResult:
    """One recipe (or ``plan.allow`` variant) searched; ``section``: the plan's own settings (:func:`plan_section`)."""
    device = section["device"]
    cpu_target = device.name.startswith("CPU")
    # A GPU's traces model its allocator on the usable bytes, as `estimate gpu_memory=` does (a CPU target judges
    # live bytes: no allocator).
    tracer = PlanTracer(cfg, cpu_target, None if cpu_target else usable_bytes(opts["gpu_bytes"], opts["margin"]))
    try:
        shape = tracer.recipe_shape(blocks, maths)
        confirm = rank_confirmer(argv, lambda c: candidate_overrides(cfg, shape, c), world_size=shape.world_size,
                                 gpu_target=not cpu_target, seconds=section["rank_seconds"])
        result = search_plans(tracer, shape, opts["gpu_bytes"], device=device, margin=opts["margin"],
                              use_reserved=not cpu_target, offload=not cpu_target, confirm_rank=confirm)
    finally:
        tracer.close()
    regions = tracer.shared_regions
    result.shared_regions = (regions.recorded, regions.replayed, regions.stretched)
    if confirm is not None:
        result.notes += confirm.notes
    return result


# ============================================================================ what to run
def plan_overrides(cfg: Any, result: PlanResult, plan: Prediction) -> list[str]:
    """The overrides that turn the recipe into ``plan`` (empty: the recipe as given)."""
    return candidate_overrides(cfg, result.shape, plan.candidate)


def candidate_overrides(cfg: Any, shape: RecipeShape, c: Candidate) -> list[str]:
    """The overrides that turn the recipe of ``shape`` into candidate ``c`` (empty: the recipe as given)."""
    recipe = shape.recipe
    out: list[str] = []
    levers = changed_levers(c, recipe)
    if c.strategy != recipe.strategy:
        out.append(f"trainer={c.strategy}")
        if recipe.strategy == "single":
            out.append("trainer.devices=1")  # FSDP2 on the one device (trainer=fsdp2 defaults to two)
    if "cpu offload" in levers:
        out.append(f"trainer.strategy.cpu_offload={str(c.offload).lower()}")
    if "micro-batch" in levers:
        key = shape.micro_batch_key
        out += ([f"{key}={c.micro_batch}"] if key else
                [f"data.batch_size={c.micro_batch}", f"trainer.accumulate_grad_batches={c.accumulation}"])
    if "checkpointing" in levers:
        out.append(f"module.{_checkpoint_key(cfg)}={str(c.checkpointing).lower()}")
    if "activation offload" in levers:
        fields = ",".join(f"{k}:{str(v).lower() if isinstance(v, bool) else v}" for k, v in ACTIVATION_OFFLOAD.items())
        out.append(f"+{ACTIVATION_OFFLOAD_KEY}={{{fields}}}")
    out += maths_overrides(cfg, [m for m in c.maths if m not in recipe.maths])
    return out
