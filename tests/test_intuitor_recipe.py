"""The shipped Intuitor recipe: composes, builds through the CLI's contract, and raises self-certainty
on held-out prompts within a few steps (fixed seed)."""

from __future__ import annotations

from pathlib import Path

import torch

from lit_memopt.modules import IntuitorModule


def test_embedded_recipe_self_certainty_rises(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lit_memopt import cli

    # The recipe's pipeline (tiny_qwen3 over the task's characters) from random init, without its warm start, at
    # a from-scratch learning rate; smaller groups for speed.
    cfg = cli.compose_config(
        [
            "recipe=intuitor", "data.batch_size=2", "module.num_samples=4", "module.warm_start.steps=0",
            "module.lr=1e-3", f"logger.save_dir={tmp_path}",
        ]
    )
    pl.seed_everything(0)
    objects = cli.instantiate_run(cfg)
    module = objects.module
    assert isinstance(module, IntuitorModule) and module.summary_keys[:4] == ("train/self_certainty", "train/kl", "val/accuracy", "val/accuracy_stderr")
    datamodule = objects.datamodule
    datamodule.setup("fit")
    held_out = next(iter(datamodule.val_dataloader()))

    def held_out_certainty() -> float:
        module.eval()
        _, certainty = module.sample_self_certainty(held_out, num_samples=4, seed=123)
        return float(certainty.mean())

    start = held_out_certainty()
    trainer = pl.Trainer(
        max_steps=12, accelerator="cpu", logger=pl.loggers.CSVLogger(tmp_path), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, log_every_n_steps=1,
        gradient_clip_val=1.0,
    )
    trainer.fit(module, datamodule=datamodule)
    end = held_out_certainty()
    print(f"held-out self-certainty: {start:.4f} -> {end:.4f}")
    assert end > 1.5 * start and end > start + 0.03, (start, end)
    logged = trainer.logged_metrics
    for key in ("train/self_certainty", "train/kl", "train/response_length", "train/accuracy"):
        assert key in logged and torch.isfinite(logged[key]), key
    assert float(logged["train/kl"]) > 0  # the policy moved away from the reference


def test_recipe_warm_starts_validates_first_and_caches(tmp_path: Path) -> None:
    """Through the CLI: the warm start runs before the first validation, the reference is the warm policy
    (KL 0 at the first step), the first held-out accuracy is in the summary, and a second run reuses the file."""
    from test_cli import run_cli

    args = ["fit", "recipe=intuitor", "module.warm_start.steps=10", "module.num_samples=4", "module.max_new_tokens=6",
            "data.num_val=8", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_cli(args, cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    output = first.stdout + first.stderr
    assert "IntuitorModule warm start: 10 supervised steps on the task family" in output
    assert (tmp_path / "run" / "warm_start.pt").is_file()
    import csv

    rows = list(csv.DictReader(next((tmp_path / "run").glob("logs/version_*/metrics.csv")).open()))
    val_steps = [int(r["step"]) for r in rows if r.get("val/accuracy")]
    assert val_steps[0] == 0 and len(val_steps) == 2, val_steps  # validate_first, then after step 2
    first_kl = [float(r["train/kl"]) for r in rows if r.get("train/kl")][0]
    assert first_kl < 1e-6, first_kl  # the reference is the warm-started policy
    assert "val/accuracy" in first.stdout
    assert all(r.get("val/accuracy_stderr") and r.get("val/accuracy_greedy") for r in rows if r.get("val/accuracy"))

    second = run_cli(args, cwd=tmp_path, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "IntuitorModule warm start: loaded" in second.stdout + second.stderr
