"""``lit-memopt plan``'s levers that change the maths (``plan.allow``) and ``plan.out``'s experiment file.

The truth test plans the tiny SFT recipe into a live-tensor budget that no exact lever fits (the optimizer step
alone passes it), takes the LoRA plan it prints, and trains 3 steps under ``fit memory_budget=`` with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_memopt import cli
from lit_memopt.cli_plan import (
    LORA_OVERRIDE,
    maths_overrides,
    plan_overrides,
    plan_recipe,
    plan_section,
)
from lit_memopt.cli_plan_output import _write_out, experiment_command

FIT = ["trainer.max_steps=3", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
       "trainer.enable_checkpointing=false", "trainer.val_check_interval=null", "validate_first=false"]
BUDGET = "40MiB"  # the tiny SFT step's optimizer step alone holds 51.8 MiB of live tensors


def _main(args: list[str]) -> int:
    try:
        return cli.main(args)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_lora_plan_fits_where_no_exact_lever_does_and_runs_under_the_budget(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    args = ["recipe=sft", f"gpu_memory={BUDGET}", "plan.device=cpu", "safety_margin=0"]
    exact = plan_recipe(cli.compose_config(args))
    assert not exact.fits  # the exact levers alone: nothing fits
    cfg = cli.compose_config([*args, "plan.allow=[lora]"])
    result = plan_recipe(cfg)
    assert result.fits and result.best.traced
    best = result.best
    assert best.candidate.maths == ("lora",) and "lora" in best.levers
    assert best.peak_bytes <= 40 * 2**20
    overrides = plan_overrides(cfg, result, best)
    assert LORA_OVERRIDE in overrides
    # the plan holds: three steps under the budget, no simulated out-of-memory error
    capsys.readouterr()
    code = _main(["fit", "recipe=sft", *FIT, *overrides, f"memory_budget={BUDGET}", f"hydra.run.dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 0 and "simulated out-of-memory errors: 0" in out, out[-2000:]

    # plan.out: an experiment config that `fit --config-dir DIR +experiment=NAME` composes into the same overrides
    path = tmp_path / "plans" / "experiment" / "tiny_lora.yaml"
    argv = ["recipe=sft", f"gpu_memory={BUDGET}", "plan.device=cpu", "plan.allow=[lora]", f"plan.out={path}"]
    _write_out(str(path), cfg, argv, result)
    text = path.read_text()
    assert text.startswith("# @package _global_\n# lit-memopt plan") and "lora:" in text
    command = experiment_command(argv, str(path))
    assert command.endswith(f"--config-dir {tmp_path / 'plans'} +experiment=tiny_lora")
    assert "plan." not in command and "gpu_memory" not in command
    capsys.readouterr()
    assert _main(["fit", "recipe=sft", "--config-dir", str(tmp_path / "plans"), "+experiment=tiny_lora", "--cfg", "job"]) == 0
    composed = capsys.readouterr().out
    for line in ("r: 16", "alpha: 32", "- q_proj"):
        assert line in composed, composed
    # written again over its own earlier plan: fine; over a file the user owns: refused, the file unchanged
    _write_out(str(path), cfg, argv, result)
    own = tmp_path / "plans" / "experiment" / "mine.yaml"
    own.write_text("model:\n  name: mine\n")
    with pytest.raises(ValueError, match="exists and is not a plan"):
        _write_out(str(own), cfg, argv, result)
    assert own.read_text() == "model:\n  name: mine\n"


def test_shorter_seq_halves_the_recipes_own_length() -> None:
    sft = cli.compose_config(["recipe=sft"])
    assert maths_overrides(sft, ["shorter_seq"]) == [f"data.seq_len={sft.data.seq_len // 2}"]
    grade = cli.compose_config(["recipe=grade"])
    assert maths_overrides(grade, ["shorter_seq"]) == [f"module.max_new_tokens={grade.module.max_new_tokens // 2}"]
    assert maths_overrides(sft, ["lora"]) == [LORA_OVERRIDE]
    with pytest.raises(ValueError, match="already trains LoRA"):
        maths_overrides(cli.compose_config(["recipe=grade_qwen3_4b"]), ["lora"])


@pytest.mark.parametrize(("value", "message"), [
    ("[optim8bit]", "no 8-bit optimizer"),
    ("[fp4]", "unknown lever 'fp4'"),
])
def test_bad_allow_values_are_one_line(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_section(cli.compose_config(["recipe=sft", f"plan.allow={value}"]))


def test_plan_out_must_be_yaml() -> None:
    with pytest.raises(ValueError, match="give a .yaml file"):
        plan_section(cli.compose_config(["recipe=sft", "plan.out=plan.txt"]))


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("true", True), ("1", True), ("2", 2), ("0", False)])
def test_the_checkpoint_switch_is_read_as_the_module_reads_it(value: str, expected: bool | int) -> None:
    import torch

    from lit_memopt.cli_plan import recipe_shape

    cfg = cli.compose_config(["recipe=sft", f"module.gradient_checkpointing={value}"])
    shape = recipe_shape(cfg, {"input_ids": torch.zeros(2, 16, dtype=torch.long)}, blocks=4)
    assert shape.checkpointing == expected and type(shape.checkpointing) is type(expected)
    with pytest.raises(ValueError, match=r"module.gradient_checkpointing must be true, false or k >= 2.*got -1"):
        recipe_shape(cli.compose_config(["recipe=sft", "module.gradient_checkpointing=-1"]),
                     {"input_ids": torch.zeros(2, 16, dtype=torch.long)}, blocks=4)


def test_the_recipes_first_estimator_is_the_one_its_trace_uses() -> None:
    """The estimator built to read the recipe's shape has the recipe's own checkpointing (every 2nd block here), so the
    search's trace of the recipe reuses it instead of building a second fake model."""
    from lit_memopt.cli_plan import PlanTracer

    tracer = PlanTracer(cli.compose_config(["recipe=sft", "module.gradient_checkpointing=2"]), cpu_target=True)
    try:
        shape = tracer.recipe_shape(4)
        assert shape.checkpointing == 2 and list(tracer.estimators) == [(2, None, False)]
        tracer(shape.recipe.checkpointing, shape.rows, False)
        assert list(tracer.estimators) == [(2, None, False)]
    finally:
        tracer.close()


def test_a_manually_optimized_module_splits_its_own_step() -> None:
    """CRSP optimizes manually: Lightning refuses gradient accumulation there, so the micro-batch lever is the
    module's own setting, sequences per forward/backward, over its largest role (4 tasks x 4 solver answers here).
    The module says both (``micro_batch_setting``, ``largest_pass_sequences``); the planner knows no CRSP key."""
    import torch
    from test_crsp import _module

    from lit_memopt.cli_plan import micro_batch_key, recipe_shape

    crsp_module = _module(roles={"num_solver_samples": 4, "critiques_per_task": 3})
    assert crsp_module.largest_pass_sequences(4) == 16
    crsp = cli.compose_config(["recipe=crsp", "module.generation.micro_batch_size=4"])
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
    assert micro_batch_key(None) is None
    assert micro_batch_key(crsp_module) == "module.generation.micro_batch_size"
    assert micro_batch_key(torch.nn.Module()) is None  # Lightning's accumulation splits the step
    unsplittable = type("Manual", (), {"automatic_optimization": False})()
    assert micro_batch_key(unsplittable) == ""  # manual, and nothing to split
    shape = recipe_shape(crsp, batch, blocks=4, built=crsp_module)
    assert (shape.rows, shape.accumulation, shape.micro_batch_key, shape.step_sequences) == (
        4, 4, "module.generation.micro_batch_size", 16)
    # a value that does not divide the sequences: its passes are rounded up, and the recipe stays a candidate
    odd = recipe_shape(cli.compose_config(["recipe=crsp", "module.generation.micro_batch_size=3"]), batch, 4, built=crsp_module)
    assert (odd.rows, odd.accumulation) == (3, 6)
    with pytest.raises(ValueError, match="optimizes manually.*accumulate_grad_batches=2"):
        recipe_shape(cli.compose_config(["recipe=crsp", "trainer.accumulate_grad_batches=2"]), batch, 4, built=crsp_module)


@pytest.mark.parametrize("overrides, cpu_target, expected", [
    ([], False, False),  # searched; the recipe does not offload
    (["callbacks=[default,activation_checkpointing]"], False, None),  # the recipe's own callback is kept as given
    ([], True, None),  # plan.device=cpu: the device is the host, there is nowhere to offload to
])
def test_activation_offload_is_searched_where_the_recipe_can_take_it(overrides: list[str], cpu_target: bool,
                                                                     expected: bool | None) -> None:
    from lit_memopt.cli_plan import PlanTracer

    tracer = PlanTracer(cli.compose_config(["recipe=sft", *overrides]), cpu_target=cpu_target)
    try:
        assert tracer.recipe_shape(4).activation_offload is expected
    finally:
        tracer.close()
