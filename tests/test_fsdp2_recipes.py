"""Recipes on FSDP2 (``trainer=fsdp2``: Lightning's ModelParallelStrategy, gloo, 2 CPU processes).

Each module shards its decoder blocks and root in ``configure_model``; the recipe trains, its loss
moves, the sharded checkpoint resumes (after a SIGKILL, to the very weights of the run never stopped), and a module
without ``configure_model`` gets one clear line.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from _resume import assert_same_weights, checkpoint_state, kill_after, largest_difference, run
from test_cli import run_cli

FSDP2 = ["trainer=fsdp2", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]


def _metric(run_dir: Path, name: str) -> list[float]:
    rows = csv.DictReader((next(run_dir.glob("logs/version_*")) / "metrics.csv").open())
    return [float(r[name]) for r in rows if r.get(name)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sft_trains_on_fsdp2_and_resumes_from_the_sharded_checkpoint(tmp_path: Path) -> None:
    first = tmp_path / "first"
    result = run_cli(["fit", "recipe=sft", *FSDP2, "trainer.max_steps=6", "trainer.log_every_n_steps=1",
                      f"hydra.run.dir={first}"], cwd=tmp_path, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OOMRecovery: FSDP2 gradient sync" in result.stdout + result.stderr
    assert "FSDPQwen3ForCausalLM" in result.stdout  # the model really is sharded
    losses = _metric(first, "train/loss")
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses
    checkpoint = first / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir()  # a sharded (distributed) checkpoint: no rank gathered the full model

    resumed = tmp_path / "resumed"
    result = run_cli(["fit", "recipe=sft", *FSDP2, "trainer.max_steps=8", "trainer.log_every_n_steps=1",
                      f"ckpt_path={checkpoint}", f"hydra.run.dir={resumed}"], cwd=tmp_path, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states" in result.stdout + result.stderr
    resumed_losses = _metric(resumed, "train/loss")
    # Only the 2 remaining steps ran, starting from the trained weights (below the first run's start).
    assert len(resumed_losses) == 2 and resumed_losses[0] < losses[0] - 0.5, (losses, resumed_losses)


# 8 steps, a sharded checkpoint every 4 (all kept); no validation within them (sft validates every 50).
SFT_RESUME = ["fit", "recipe=sft", *FSDP2, "trainer.max_steps=8", "checkpoint.every_n_steps=4", "checkpoint.keep_last=null",
              "trainer.enable_model_summary=false", "trainer.log_every_n_steps=1"]


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_sft_on_fsdp2_killed_with_sigkill_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    """Two gloo ranks; every process of the run is killed after the step-4 checkpoint, as when a machine is lost. Each
    launch runs under a deadline: a rank waiting forever in a collective fails the test."""
    (tmp_path / "reference").mkdir()
    reference = tmp_path / "reference" / "run"
    run([*SFT_RESUME, f"hydra.run.dir={reference}"], tmp_path / "reference", timeout_s=150)
    # the weights moved after the checkpoint the run resumes from: equality below is not vacuous
    moved = largest_difference(reference / "checkpoints" / "step_000004.ckpt", reference / "checkpoints" / "step_000008.ckpt")
    assert moved > 1e-5, moved

    run_dir = tmp_path / "run"
    kill_after([*SFT_RESUME, f"hydra.run.dir={run_dir}"], tmp_path, run_dir / "checkpoints" / "step_000004.ckpt",
               timeout_s=150)
    assert not (run_dir / "checkpoints" / "step_000008.ckpt").exists(), "the run finished before the kill"
    output = run([*SFT_RESUME, "ckpt_path=last", f"hydra.run.dir={run_dir}"], tmp_path, timeout_s=150)
    assert "Restored all states" in output and "dataloader is not resumable" not in output
    final = run_dir / "checkpoints" / "step_000008.ckpt"
    assert final.is_dir()  # sharded: each rank wrote its own part
    assert_same_weights(final, reference / "checkpoints" / "step_000008.ckpt")
    # rank zero's metadata holds both ranks' random generators, each rank resumed with its own
    assert len(checkpoint_state(final)["callbacks"]["RandomState"]["ranks"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "recipe, metric", [("ttt", "train/loss"), ("intuitor", "train/self_certainty"), ("grade", "train/reward")]
)
def test_recipes_train_on_fsdp2(tmp_path: Path, recipe: str, metric: str) -> None:
    # Intuitor's warm start runs on every rank before sharding (a few steps here, not the recipe's 400).
    extra = ["module.warm_start.steps=4", "validate_first=false"] if recipe == "intuitor" else []
    result = run_cli(["fit", f"recipe={recipe}", *FSDP2, "trainer.max_steps=3", "trainer.log_every_n_steps=1",
                      "trainer.val_check_interval=null", "trainer.limit_val_batches=0", *extra,
                      f"hydra.run.dir={tmp_path / 'run'}"],
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if recipe == "intuitor":
        assert "IntuitorModule warm start: 4 supervised steps" in result.stdout + result.stderr
        assert not (tmp_path / "run" / "warm_start.pt").exists()  # several processes: no shared file
    assert "OOMRecovery: FSDP2 gradient sync" in result.stdout + result.stderr
    values = _metric(tmp_path / "run", metric)
    assert len(values) == 3 and len(set(values)) > 1, values  # the metric moves as training goes


def test_fsdp2_with_a_module_without_configure_model_says_what_to_add() -> None:
    import lightning.pytorch as pl

    from lit_memopt.cli import UsageError, check_module_fits_strategy, compose_config

    class Plain(pl.LightningModule):
        pass

    cfg = compose_config(["recipe=sft", "trainer=fsdp2"])
    with pytest.raises(UsageError, match=r"trainer=fsdp2 needs Plain to shard its model in configure_model\(\); add"):
        check_module_fits_strategy(cfg, Plain())
    check_module_fits_strategy(compose_config(["recipe=sft", "trainer=ddp"]), Plain())  # nothing needed there
