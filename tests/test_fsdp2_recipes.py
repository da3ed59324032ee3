"""Recipes on FSDP2 (``trainer=fsdp2``: Lightning's ModelParallelStrategy, gloo, 2 CPU processes).

Each module shards its decoder blocks and root in ``configure_model``; the recipe trains, its loss
moves, the sharded checkpoint resumes, and a module without ``configure_model`` gets one clear line.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
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
