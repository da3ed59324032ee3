"""``lit-memopt estimate``: the predicted peak memory of one training step of a recipe, per rank, allocated and reserved.

The recipe is built as ``lit-memopt fit`` builds it (:func:`lit_memopt.cli.instantiate_run`), except that the
language models get fake weights. A decoder with more than 3 blocks is traced with 1, 2 and 3 blocks and
extrapolated (``memory.blocks``); generation recipes are estimated at their worst case (``memory.worst_case``);
``trainer=ddp``/``trainer=fsdp2`` turn the single-device numbers into per-rank ones (``memory.sharding``), or with
``trace_rank=true`` (FSDP2) one rank is traced under a fake process group (``memory.fake_ranks``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_memopt.cli_fake_run import (
    activation_checkpointing_callbacks,
    block_count,
    build_fake_run,
    build_measured_module,
    checkpoint_period_of,
)
from lit_memopt.memory.batch import resize_batch
from lit_memopt.memory.blocks import (
    CHECK_BLOCKS,
    SHIFTED_CHECK_BLOCKS,
    LinearityError,
    estimate_with_blocks,
)
from lit_memopt.memory.fake_ranks import estimate_rank
from lit_memopt.memory.search import (
    DEFAULT_SAFETY_MARGIN,
    BatchFit,
    largest_micro_batch,
    parse_memory_size,
    usable_bytes,
)
from lit_memopt.memory.sharding import COMMUNICATION_ROW, per_rank_estimate
from lit_memopt.memory.step import (
    BREAKDOWN_LABELS,
    PeakEstimate,
    ValueDependentStepError,
    estimate_peak,
    format_bytes,
    measure_on_cuda,
    within_device,
)
from lit_memopt.memory.worst_case import filler_token_id
from lit_memopt.models.sharding import replicated_parameter_bytes

__all__ = ["EstimateReport", "estimate_recipe", "render_report", "run_estimate_command"]


def _positive_int_or_none(cfg: Any, key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _recipe_batch(datamodule: Any) -> Any:
    """One training batch of a DataModule, as its DataLoader yields it."""
    if hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    if hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    try:
        return next(iter(loader))
    except StopIteration:
        raise ValueError(f"{type(datamodule).__name__}.train_dataloader() yielded no batch; check the data.* settings") from None


@dataclass
class EstimateReport:
    """What ``lit-memopt estimate`` computed (also returned to the caller for scripting)."""

    recipe: str
    model: str
    estimate: PeakEstimate
    gpu_memory_bytes: int | None = None
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    fit: BatchFit | None = None
    measured_peak_bytes: int | None = None
    device: str = "cpu"
    build_seconds: float = 0.0
    cpu_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    per_rank: tuple[str, int] | None = None
    cpu_offload: bool = False  # FSDP2 keeps parameters, gradients and optimizer state in host memory
    # trace_rank=true that fell back to the per-rank arithmetic: why (also among the notes); None: traced, or not asked
    rank_fallback: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["estimate"] = self.estimate.as_dict()
        return out


# ============================================================================ estimating
def data_parallel_plan(cfg: Any) -> tuple[str, int] | None:
    """``(strategy, world size)`` for a per-rank estimate, or ``None`` on one device.

    Raises:
        ValueError: ``trainer.devices``/``trainer.num_nodes`` that are not positive integers with a
            distributed strategy, or a strategy whose per-rank memory is not modelled.
    """
    trainer = cfg.get("trainer") or {}
    strategy = trainer.get("strategy")
    target = strategy.get("_target_", "") if hasattr(strategy, "get") else str(strategy or "")
    if target.endswith("ModelParallelStrategy"):
        name = "fsdp2"
    elif target in ("ddp", "ddp_spawn", "ddp_fork") or target.endswith("DDPStrategy"):
        name = "ddp"
    elif target in ("", "auto", "single_device") or target.endswith("SingleDeviceStrategy"):
        return None
    else:
        raise ValueError(
            f"estimate: trainer.strategy={target!r} has no per-rank model; estimate with trainer=default, trainer=ddp or trainer=fsdp2"
        )
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    for key, value in (("trainer.devices", devices), ("trainer.num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"estimate: {key} must be a positive integer for a per-rank {name} estimate, got {value!r} "
                f"(e.g. {key}=8)"
            )
    return name, int(devices) * int(nodes)


def strategy_cpu_offload(cfg: Any, per_rank: tuple[str, int] | None) -> bool:
    """Whether the run offloads FSDP2's model state to the host (``trainer.strategy.cpu_offload``).

    Raises:
        ValueError: a value that is not a bool, or ``true`` with a strategy other than FSDP2.
    """
    strategy = (cfg.get("trainer") or {}).get("strategy")
    value = strategy.get("cpu_offload", False) if hasattr(strategy, "get") else False
    if not isinstance(value, bool):
        raise ValueError(f"estimate: trainer.strategy.cpu_offload must be true or false, got {value!r}")
    if value and (per_rank is None or per_rank[0] != "fsdp2"):
        raise ValueError("estimate: trainer.strategy.cpu_offload is FSDP2's; use it with trainer=fsdp2")
    return value


def _options(cfg: Any) -> dict[str, Any]:
    gpu_memory = cfg.get("gpu_memory")
    margin = cfg.get("safety_margin")
    margin = DEFAULT_SAFETY_MARGIN if margin is None else float(margin)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"safety_margin must be in [0, 1), got {margin!r}")
    check = cfg.get("check_linearity")
    if check is not None and not isinstance(check, bool):
        raise ValueError(f"check_linearity must be true or false, got {check!r}")
    whole = cfg.get("trace_all_blocks")
    if whole is not None and not isinstance(whole, bool):
        raise ValueError(f"trace_all_blocks must be true or false, got {whole!r}")
    per_rank = data_parallel_plan(cfg)
    rank = cfg.get("trace_rank")
    if rank is not None and not isinstance(rank, bool):
        raise ValueError(f"trace_rank must be true or false, got {rank!r}")
    search = cfg.get("search_micro_batch")
    if search is not None and not isinstance(search, bool):
        raise ValueError(f"search_micro_batch must be true or false, got {search!r}")
    cpu_offload = strategy_cpu_offload(cfg, per_rank)
    if rank and (per_rank is None or per_rank[0] != "fsdp2" or cpu_offload):
        raise ValueError("trace_rank=true traces one FSDP2 rank with its state on the device: use it with trainer=fsdp2 "
                         "trainer.devices=N (and without trainer.strategy.cpu_offload)")
    return {
        "batch_size": _positive_int_or_none(cfg, "batch_size"),
        "seq_len": _positive_int_or_none(cfg, "seq_len"),
        "gpu_bytes": parse_memory_size(gpu_memory) if gpu_memory is not None else None,
        "margin": margin,
        "check": True if check is None else check,
        "trace_all_blocks": bool(whole),
        "per_rank": per_rank,
        "cpu_offload": cpu_offload,
        "trace_rank": bool(rank),
        "search_micro_batch": search is not False,
    }


# A rank whose block probes do not check out is traced whole (trace_rank) only where that takes about this long at
# most: a rank of a generation recipe traces every rollout token through every block (CRSP 7B over 8 ranks: 764 s).
RANK_WHOLE_TRACE_SECONDS = 120.0
# Above this share of the allocated peak, a reserved figure modelled without a device size gets a note.
RESERVED_NOTE_RATIO = 1.5


class _Estimator:
    """One recipe's module (built once) and a cache of its estimates by batch size."""

    def __init__(self, cfg: Any, check: bool, per_rank: tuple[str, int] | None = None, cpu_offload: bool = False,
                 trace_all_blocks: bool = False, trace_rank: bool = False) -> None:
        self.cfg = cfg
        self.check = check
        self.per_rank = per_rank
        self.cpu_offload = cpu_offload
        # trace_rank (FSDP2 with the state on the device): each estimate traces rank 0 under a fake process group
        # (memory.fake_ranks), FSDP2's own allocations and the rank's allocator; else memory.sharding's arithmetic.
        self.rank_world = per_rank[1] if trace_rank and per_rank is not None and per_rank[0] == "fsdp2" else None
        # A rank whose block probes do not check out is traced whole only where that is predicted this quick.
        self.rank_whole_seconds = RANK_WHOLE_TRACE_SECONDS
        self.rank_fallback: str | None = None  # why the rank was not traced after all (then the arithmetic's figures)
        # One micro-batch of several (trainer.accumulate_grad_batches > 1): gradients are live from the start.
        self.accumulating = _accumulates(cfg)
        self.optimizer_foreach = True  # the peak reported is a CUDA device's: foreach is its default
        self.notes: list[str] = []
        from hydra.utils import instantiate

        self.total_blocks = block_count(instantiate(cfg.model))
        # Built once: they set the trace period, wrap the module's layers, and may need a note.
        self.checkpointing_callbacks = activation_checkpointing_callbacks(cfg)
        # Every k-th block checkpointed: the step repeats in groups of k blocks, traced as such.
        self.period = checkpoint_period_of(cfg, self.checkpointing_callbacks)
        # Built with 4 blocks (groups): 1, 2 and 3 are traced, and 4 when the 1-block trace is off the line.
        total, p = self.total_blocks, self.period
        # trace_all_blocks: the whole model, for a reserved figure that is replayed rather than a line through
        # probes (allocator rounding and a peak moving between phases bend it: docs/will-it-fit.md).
        self.blocks = (min(total, SHIFTED_CHECK_BLOCKS * p)
                       if not trace_all_blocks and total is not None and total > CHECK_BLOCKS * p and total % p == 0
                       else None)
        self.run = build_fake_run(cfg, self.blocks, self.checkpointing_callbacks)
        if any(c.offload_to_cpu for c in self.checkpointing_callbacks):
            # The first block's input is the embedding output, which the decoder keeps for its whole forward, so an
            # offloaded 1-block step is off the line through longer ones: the check finds that kink and moves the
            # probes up a block (measured: the forward peaks of 1, 2, 3, 4 offloaded tiny blocks fall on a line
            # only from 2 on).
            self.check = True
            self.notes.append("ActivationCheckpointing(offload_to_cpu=true): the activations its layers save (not their "
                              "parameters) leave the device in forward and come back one at a time in backward, as "
                              "traced; the copies' time is not in the estimate")
        self.cache: dict[int | None, PeakEstimate] = {}
        # A plan's traces share their rollouts (memory.replay): set by cli_plan.PlanTracer, one for all its estimators.
        self.shared_regions: Any = None
        # The device the allocator model releases its cache at (memory.step.estimate_peak's device_bytes): set by
        # estimate_recipe from gpu_memory, by cli_plan.PlanTracer from the plan's budget; None: no limit.
        self.device_bytes: int | None = None
        # Set once the step turns out to generate text until end-of-sequence: then every estimate is its worst case.
        self.worst_case_filler: int | None = None
        if getattr(self.run.module, "generates_until_eos", False):
            # The module says so itself: start at the worst case instead of a first attempt that stops on a value.
            self.worst_case_filler = self._filler()

    def close(self) -> None:
        """Stop what ``build_fake_run`` started (CRSP's sandbox workers)."""
        _stop_sandbox(self.run.module)

    def _arithmetic_from_now(self, note: str) -> None:
        """A rank is not traced after all: per-rank figures are memory.sharding's arithmetic from here on (said in
        ``note``), and the traced ranks cached so far are dropped."""
        self.notes.append(note)
        self.rank_fallback = note
        self.rank_world = None
        self.cache.clear()

    def _filler(self) -> int:
        module = self.run.module
        config = getattr(getattr(module, "model", None), "config", None)
        return filler_token_id(getattr(module, "tokenizer", None), config, getattr(config, "vocab_size", None))

    def trace(self, batch: Any, rows: int | None, *, check: bool | None = None) -> PeakEstimate:
        """The whole model's step on one device, its reserved figure not yet judged against ``device_bytes``."""
        try:
            return self._estimate(batch, rows, check=check)
        except ValueDependentStepError:
            if self.worst_case_filler is not None:
                raise
            self.worst_case_filler = self._filler()
            return self._estimate(batch, rows, check=check)

    def estimate(self, batch: Any, rows: int | None, *, check: bool | None = None) -> PeakEstimate:
        """The step on one device or (``per_rank``) one rank, judged on the device where it has a size."""
        est = self.trace(batch, rows, check=check)
        if self.per_rank is None or self.rank_world is not None:
            return within_device(est)
        strategy, world = self.per_rank
        # Frozen models the method keeps whole on every rank (GRADE's reference and reward model) are not sharded.
        replicated = replicated_parameter_bytes(self.run.module, self.total_blocks) if strategy == "fsdp2" else 0
        return per_rank_estimate(est, strategy, world, cpu_offload=self.cpu_offload, replicated_bytes=replicated)

    def _estimate(self, batch: Any, rows: int | None, *, check: bool | None = None) -> PeakEstimate:
        if rows in self.cache:
            return self.cache[rows]
        kwargs: dict[str, Any] = {"optimizer_foreach": self.optimizer_foreach, "worst_case_filler": self.worst_case_filler,
                                  "accumulating": self.accumulating, "shared_regions": self.shared_regions,
                                  "device_bytes": self.device_bytes}
        est = None
        if self.rank_world is not None:
            est = self._rank_estimate(batch, check, kwargs)
        if est is None and self.blocks is not None:
            try:
                # The check trace runs in a forked copy alongside the probes where that is safe; not with a
                # sandbox, whose worker pipes the two processes would share.
                parallel = getattr(self.run.module, "sandbox", None) is None
                est = estimate_with_blocks(self.run.module, batch, self.total_blocks, built_blocks=self.blocks,
                                           check=self.check if check is None else check, parallel=parallel,
                                           period=self.period, **kwargs)
            except LinearityError as exc:
                self.notes.append(f"block extrapolation did not check out ({exc}); traced all {self.total_blocks} blocks")
                self.blocks = None
                self.run = build_fake_run(self.cfg, None, self.checkpointing_callbacks)
        if est is None:
            est = estimate_peak(self.run.module, batch, **kwargs)
            est.num_blocks = self.total_blocks
        self.cache[rows] = est
        return est


    def _rank_estimate(self, batch: Any, check: bool | None, kwargs: dict[str, Any]) -> PeakEstimate | None:
        """One rank's step traced under a fake process group, or ``None`` (with a note, for good) where that fails."""
        built: list[Any] = []

        def build(blocks: int | None, mesh: Any) -> Any:
            run = build_fake_run(self.cfg, blocks, self.checkpointing_callbacks, mesh=mesh)
            built.append(run.module)
            return run.module

        blocks = None if self.blocks is None else self.total_blocks
        started = time.perf_counter()
        try:
            try:
                return estimate_rank(build, batch, self.rank_world, num_blocks=blocks, period=self.period,
                                     check=self.check if check is None else check,
                                     parallel=getattr(self.run.module, "sandbox", None) is None, **kwargs)
            except LinearityError as exc:
                # The probes traced at least 1, 2 and 3 groups of `period` blocks: the whole rank takes about this.
                whole = (time.perf_counter() - started) * (self.total_blocks or 1) / (6 * self.period)
                if whole > self.rank_whole_seconds:
                    self._arithmetic_from_now(
                        f"one rank's block probes did not check out ({exc}); a trace of all {self.total_blocks} blocks "
                        f"of a rank would take about {whole:.0f} s, so per-rank figures are memory.sharding's arithmetic "
                        "on the one-device step (trace_all_blocks=true traces the whole rank)")
                    return None
                self.notes.append(f"block extrapolation did not check out ({exc}); traced all {self.total_blocks} blocks")
                self.blocks = None
                return estimate_rank(build, batch, self.rank_world, **kwargs)
        except ValueDependentStepError:
            raise  # trace() retries at the worst case
        except Exception as exc:  # noqa: BLE001 - any failure of the sharded trace falls back to the arithmetic
            self._arithmetic_from_now(
                f"one rank could not be traced under a fake process group ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else 'no message'}); per-rank figures are memory.sharding's "
                "arithmetic on the one-device step")
            return None
        finally:
            for module in built:  # the sandboxes of the modules built here (CRSP)
                _stop_sandbox(module)


def _stop_sandbox(module: Any) -> None:
    """Stop the sandbox workers ``build_fake_run`` started for ``module`` (CRSP), if any."""
    if getattr(module, "sandbox", None) is not None and callable(getattr(module, "teardown", None)):
        module.teardown("validate")


def _accumulates(cfg: Any) -> bool:
    trainer = cfg.get("trainer") or {}
    value = trainer.get("accumulate_grad_batches", 1)
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (a trace may run in a forked copy)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def estimate_recipe(cfg: Any, *, rank_whole_seconds: float | None = None) -> EstimateReport:
    """Everything ``lit-memopt estimate`` prints, without printing it.

    Args:
        rank_whole_seconds: with ``trace_rank``, trace a rank whose block probes do not check out whole only where
            that is predicted to take at most this long (default :data:`RANK_WHOLE_TRACE_SECONDS`).
    """
    opts = _options(cfg)
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    estimator = _Estimator(cfg, opts["check"], opts["per_rank"], opts["cpu_offload"], opts["trace_all_blocks"],
                           opts["trace_rank"])
    if rank_whole_seconds is not None:
        estimator.rank_whole_seconds = rank_whole_seconds
    if opts["gpu_bytes"] is not None:
        # The fit is judged on the usable bytes: the allocator model releases its cache there, as a real one does at
        # the device's size (per rank: the whole model's trace on that device, judged again per rank in
        # memory.sharding).
        estimator.device_bytes = usable_bytes(opts["gpu_bytes"], opts["margin"])
    try:
        batch = resize_batch(_recipe_batch(estimator.run.datamodule), opts["batch_size"], opts["seq_len"])
        estimate = estimator.estimate(batch, None)
        fit = None
        if opts["gpu_bytes"] is not None and opts["search_micro_batch"]:
            if estimate.batch_size:
                estimator.cache[estimate.batch_size] = estimate

            def reserved_for(b: int) -> int:
                # The search probes run without the linearity check: the recipe's batch was checked above.
                est = estimator.estimate(resize_batch(batch, batch_size=b), b, check=False)
                return int(est.reserved_peak_bytes or est.peak_bytes)

            fit = largest_micro_batch(reserved_for, opts["gpu_bytes"], safety_margin=opts["margin"])
    finally:
        estimator.close()
    if estimate.device_bytes is None and (estimate.reserved_peak_bytes or 0) > RESERVED_NOTE_RATIO * estimate.peak_bytes:
        estimator.notes.append(
            f"the reserved figure is {estimate.reserved_peak_bytes / max(estimate.peak_bytes, 1):.1f}x the allocated one "
            "because the allocator model had no device size: it keeps new segments for tensors that outgrow the freed "
            "ones (a cache one token longer every step), where a real allocator releases its cache at the device's "
            "size. Add gpu_memory= (one device) to model that")
    measured, device = None, "cpu"
    # A real run stops at end-of-sequence: it measures a different step from the worst case.
    if torch.cuda.is_available() and estimate.worst_case_tokens is None and opts["per_rank"] is None:
        device = torch.cuda.get_device_name()
        free, _ = torch.cuda.mem_get_info()
        if estimate.peak_bytes < free:
            measured = measure_on_cuda(lambda: build_measured_module(cfg), batch, None)
    model = estimator.run.model_config
    return EstimateReport(
        recipe=str(cfg.get("recipe_name") or "?"),
        model=str(getattr(model, "name", "model")),
        estimate=estimate,
        gpu_memory_bytes=opts["gpu_bytes"],
        safety_margin=opts["margin"],
        fit=fit,
        measured_peak_bytes=measured,
        device=device,
        build_seconds=time.perf_counter() - started,
        cpu_seconds=_cpu_seconds() - cpu_started,
        notes=estimator.notes,
        per_rank=opts["per_rank"],
        cpu_offload=opts["cpu_offload"],
        rank_fallback=estimator.rank_fallback,
    )


# ============================================================================ printing
def render_report(report: EstimateReport, console: Any = None) -> None:
    """Print an :class:`EstimateReport` as rich tables."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and READMEs: wide enough for module names
            console = Console(width=110)
    est = report.estimate
    shape = f"{est.batch_size} × {est.seq_len} tokens" if est.seq_len else f"{est.batch_size} rows"
    offload = ", cpu offload" if report.cpu_offload else ""
    where = f", per rank of {report.per_rank[1]} ({report.per_rank[0]}{offload})" if report.per_rank else ""
    console.print(f"[bold]Predicted peak memory of one training step[/]: recipe={report.recipe} model={report.model}, batch {shape}{where}")
    table = Table()
    table.add_column("at the peak", style="bold")
    table.add_column("predicted", justify="right")
    table.add_column("share", justify="right")
    if report.measured_peak_bytes is not None:
        table.add_column(f"measured ({report.device})", justify="right")
    extra = [""] if report.measured_peak_bytes is not None else []
    for key, label in BREAKDOWN_LABELS.items():
        value = est.breakdown.get(key, 0)
        if key == COMMUNICATION_ROW and (report.per_rank is None or not value):
            continue  # a row of the per-rank arithmetic only (a traced rank's gathered blocks are parameters)
        table.add_row(label, format_bytes(value), f"{100 * value / max(est.peak_bytes, 1):.0f}%", *extra)
    table.add_section()
    measured = [format_bytes(report.measured_peak_bytes)] if report.measured_peak_bytes is not None else []
    table.add_row("peak (allocated)", format_bytes(est.peak_bytes), "100%", *measured, style="bold")
    if est.reserved_peak_bytes is not None:
        table.add_row("reserved by the CUDA caching allocator", format_bytes(est.reserved_peak_bytes),
                      f"{100 * est.reserved_peak_bytes / max(est.peak_bytes, 1):.0f}%", *extra, style="bold")
    console.print(table)
    phases = ", ".join(f"{k} {format_bytes(v)}" for k, v in est.phase_peaks.items())
    console.print(f"Peak reached during the {est.peak_phase} (highest per phase: {phases}).")
    console.print(f"How: {est.method}.")
    if est.worst_case_tokens is not None:
        console.print(
            f"[bold]Worst case[/]: text generation never stops early: every response runs to max_new_tokens "
            f"({est.worst_case_tokens} tokens sampled in the step, none of them end-of-sequence); shorter responses need less."
        )
    for note in report.notes:
        console.print(f"Note: {note}.")

    top = est.top_modules(8)
    if top:
        mods = Table(title="Where the activations live (leaf modules, repeated blocks grouped)", title_justify="left")
        mods.add_column("module", no_wrap=True)
        mods.add_column("×", justify="right")
        mods.add_column("parameters", justify="right")
        mods.add_column("activations kept", justify="right")
        mods.add_column("forward transient", justify="right")
        mods.add_column("backward transient", justify="right")
        for m in top:
            mods.add_row(m.name, str(m.count), format_bytes(m.parameter_bytes), format_bytes(m.activation_bytes),
                         format_bytes(m.forward_peak_bytes), format_bytes(m.backward_peak_bytes))
        console.print(mods)

    if report.fit is not None and report.gpu_memory_bytes is not None:
        fit = report.fit
        budget = f"{format_bytes(report.gpu_memory_bytes)} with a {report.safety_margin:.0%} safety margin ({format_bytes(fit.usable_bytes)} usable)"
        if fit.micro_batch_size == 0:
            console.print(f"[bold red]Not even a micro-batch of 1 fits in {budget}[/]: it needs {format_bytes(fit.next_peak_bytes or 0)} reserved.")
        else:
            nxt = f"; {fit.micro_batch_size + 1} would need {format_bytes(fit.next_peak_bytes)}" if fit.next_peak_bytes else ""
            console.print(
                f"[bold green]Largest micro-batch that fits in {budget}: {fit.micro_batch_size}[/] "
                f"(reserved peak {format_bytes(fit.peak_bytes or 0)}{nxt}; {len(fit.probes)} batch sizes estimated)."
            )
    console.print(
        f"Estimated in {report.build_seconds:.1f} s ({report.cpu_seconds:.1f} s of CPU time) on fake tensors: "
        "no weights, no device memory."
    )


def run_estimate_command(cfg: Any) -> EstimateReport:
    """``lit-memopt estimate recipe=NAME model=NAME [gpu_memory=80GiB] [batch_size=N] [seq_len=N] [safety_margin=0.1]``."""
    report = estimate_recipe(cfg)
    render_report(report)
    return report


# The same building and tracing, under public names, for `lit-memopt plan` (lit_memopt/cli_plan.py).
RecipeEstimator = _Estimator
estimate_options = _options
recipe_batch = _recipe_batch
cpu_seconds = _cpu_seconds
