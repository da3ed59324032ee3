"""``lit-memopt plan`` on the tiny recipes: the round trip through ``estimate``, the exit code when nothing fits, and
the truth on a CPU: the planned command runs under ``fit memory_budget=B`` and the fastest plan predicted not to
fit runs out of memory under the same budget.

In this process (``cli.main``, ``compose_config``): an interpreter start with Lightning is ten seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_memopt import cli
from lit_memopt.cli_estimate import estimate_recipe
from lit_memopt.cli_plan import PlanTracer, plan_overrides, plan_recipe
from lit_memopt.memory.plan import state_floor, search_plans
from lit_memopt.memory.plan_time import DEVICES

FIT = ["trainer.max_steps=3", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
       "trainer.enable_checkpointing=false", "trainer.val_check_interval=null", "validate_first=false"]


def _main(args: list[str]) -> int:
    try:
        return cli.main(args)
    except SystemExit as exc:  # Hydra and the plan command end with sys.exit
        return int(exc.code or 0)


@pytest.mark.parametrize("budget", ["100MiB", "40MiB"])
def test_round_trip_through_estimate(budget: str) -> None:
    # 100 MiB binds the tiny SFT step (178 MiB reserved as given): the plan accumulates and checkpoints; at 40 MiB
    # the optimizer step's model state alone does not fit: FSDP2 offloads it to the host on the one device
    cfg = cli.compose_config(["recipe=sft", f"gpu_memory={budget}"])
    result = plan_recipe(cfg)
    best = result.best
    assert best is not None and best.traced
    assert best.candidate.offload == (budget == "40MiB"), best.candidate
    overrides = plan_overrides(cfg, result, best)
    assert overrides, "the budget binds: the plan changes something"
    report = estimate_recipe(cli.compose_config(["recipe=sft", f"gpu_memory={budget}", *overrides]))
    assert report.cpu_offload == best.candidate.offload
    reserved = report.estimate.reserved_peak_bytes
    assert reserved <= int(budget.removesuffix("MiB")) * 2**20 * (1 - report.safety_margin)
    assert abs(reserved - best.peak_bytes) <= 0.02 * best.peak_bytes, (reserved, best.peak_bytes)


def test_an_activation_offload_plan_round_trips_through_estimate() -> None:
    """At 60 MiB the offloading candidates are traced (each could beat the fastest fitting plan on its time without
    the copies); the overrides printed for one, the callback the plan adds included, give ``estimate`` the same step."""
    cfg = cli.compose_config(["recipe=sft", "gpu_memory=60MiB"])
    result = plan_recipe(cfg)
    offloading = [p for p in result.predictions if p.candidate.activation_offload and p.traced]
    assert offloading and result.shape.activation_offload is False
    plan = offloading[0]
    overrides = plan_overrides(cfg, result, plan)
    assert any(o.startswith("+callbacks.activation_offload=") for o in overrides), overrides
    report = estimate_recipe(cli.compose_config(["recipe=sft", "gpu_memory=60MiB", *overrides]))
    assert report.estimate.offloaded_bytes > 0
    reserved = report.estimate.reserved_peak_bytes
    assert abs(reserved - plan.peak_bytes) <= 0.02 * plan.peak_bytes, (reserved, plan.peak_bytes)


def test_impossible_budget_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _main(["plan", "recipe=sft", "gpu_memory=20MiB", f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 2
    assert "does not fit: needs at least" in out and "with every lever" in out and "closest plan:" in out


def _truth_plan(overrides: list[str], share: float, offload: bool = True):
    """A CPU plan (live tensor bytes, no margin) under a budget ``share`` of the way from what no lever changes (the
    optimizer step's model state) to the recipe's own predicted peak."""
    cfg = cli.compose_config([*overrides, "plan.device=cpu", "safety_margin=0"])
    tracer = PlanTracer(cfg, cpu_target=True)
    memo: dict = {}

    def trace(*key):  # the recipe's trace, made to size the budget, is not made again by the search
        if key not in memo:
            memo[key] = tracer(*key)
        return memo[key]

    try:
        # as `plan` does: a module that optimizes manually (CRSP) splits its step by its own setting
        shape = tracer.recipe_shape(4)
        recipe = trace(False, shape.rows, shape.accumulation > 1)
        floor = state_floor(recipe)
        budget = int(floor + share * (recipe.peak_bytes - floor))
        result = search_plans(trace, shape, budget, device=DEVICES["cpu"], margin=0.0, use_reserved=False, offload=offload)
    finally:
        tracer.close()
    return cfg, result, budget


@pytest.mark.parametrize(("overrides", "share"), [
    (["recipe=sft"], 0.6),
    # two rows of 512 tokens: the plan checkpoints every 2nd block (module.gradient_checkpointing=2)
    (["recipe=sft", "data.batch_size=2", "data.seq_len=512"], 0.3),
    (["recipe=grade", "module.max_new_tokens=8"], 0.6),
    (["recipe=intuitor", "module.warm_start.steps=0", "module.max_new_tokens=6"], 0.6),
    # CRSP optimizes manually (no Lightning accumulation): the plan splits its role passes instead
    # (module.generation.micro_batch_size); short rollouts and 4 sequences per role keep the traces to seconds
    (["recipe=crsp", "module.warm_start.steps=0", "data.batch_size=2", "module.roles.num_solver_samples=2",
      "module.roles.critiques_per_task=1", "module.generation.max_new_tokens.propose=16",
      "module.generation.max_new_tokens.solve=8", "module.generation.max_new_tokens.critique=8"], 0.6),
], ids=["sft", "sft-every-2nd-block", "grade", "intuitor", "crsp"])
def test_plan_holds_and_is_tight_under_memory_budget(overrides: list[str], share: float, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    every_2nd = "data.seq_len=512" in overrides  # searched without FSDP2's offload, as the command plans for a CPU
    cfg, result, budget = _truth_plan(overrides, share, offload=not every_2nd)
    assert result.fits and result.fastest_not_fitting is not None
    best, tight = result.best, result.fastest_not_fitting
    assert best.traced and tight.traced
    if every_2nd:
        assert best.candidate.checkpointing == 2 and "module.gradient_checkpointing=2" in plan_overrides(cfg, result, best)
    if "recipe=crsp" in overrides:
        planned = plan_overrides(cfg, result, best)
        assert any(o.startswith("module.generation.micro_batch_size=") for o in planned), planned
        assert not any("accumulate_grad_batches" in o or o.startswith("data.batch_size") for o in planned), planned
    capsys.readouterr()
    code = _main(["fit", *overrides, *FIT, *plan_overrides(cfg, result, best), f"memory_budget={budget}",
                  f"hydra.run.dir={tmp_path / 'fits'}"])
    out = capsys.readouterr().out
    assert code == 0 and "simulated out-of-memory errors: 0" in out, out[-2000:]
    # the fastest plan predicted not to fit does run out of memory (no OOMRecovery to rescue it)
    code = _main(["fit", *overrides, *FIT, *plan_overrides(cfg, result, tight), f"memory_budget={budget}",
                  "~callbacks.oom_recovery", f"hydra.run.dir={tmp_path / 'oom'}"])
    err = capsys.readouterr().err
    assert code == 1 and "torch.OutOfMemoryError" in err, err[-2000:]


def test_a_growing_cache_fits_where_its_allocator_releases_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Tiny Intuitor with 128-token rollouts: the allocator model without a device size reserves a new segment for
    each cache one token longer (598 MiB reserved for 537 MiB allocated, measured, as a trace of every block replays
    it), one releasing its cache before every new segment needs about 574 MiB. At 656 MiB (590 MiB usable) the recipe
    fits as given: replayed on that device, the allocator releases its cache when it is full and reserves 590 MiB,
    and ``estimate`` of the same step on that device reads the same."""
    from lit_memopt.cli_estimate import RecipeEstimator, recipe_batch
    from lit_memopt.cli_plan_output import render_plan
    from lit_memopt.memory.search import usable_bytes

    overrides = ["recipe=intuitor", "module.max_new_tokens=128", "gpu_memory=656MiB"]
    cfg = cli.compose_config(overrides)
    result = plan_recipe(cfg)
    usable = usable_bytes(656 * 2**20, result.margin)
    best = result.best
    assert result.fits and best.candidate == result.shape.recipe and result.traces == 1
    assert best.estimate.least_reserved_bytes < best.peak_bytes <= usable
    assert "allocation log stitched from the probes'" in best.estimate.method
    render_plan(result, cfg, overrides)
    out = capsys.readouterr().out
    assert "Plan 1 reserves" in out and "releases its cached segments when the device is full" in out
    assert "the step needs at least 574" in out, out

    def estimated(device_bytes: int | None):  # noqa: ANN202 - the estimate's first figure, before its search
        est = RecipeEstimator(cli.compose_config(overrides), False, None)
        est.device_bytes = device_bytes
        try:
            return est.estimate(recipe_batch(est.run.datamodule), None)
        finally:
            est.close()

    # the round trip: the same step on the same device reads the same
    report = estimated(usable)
    assert report.reserved_peak_bytes == best.peak_bytes
    assert report.least_reserved_bytes == best.estimate.least_reserved_bytes
    # without a device size the growing caches take new segments past the usable bytes: it fits only released
    assert estimated(None).reserved_peak_bytes > usable
