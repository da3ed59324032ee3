"""The shipped Intuitor recipe: composes, builds through the CLI's contract, and raises self-certainty
on held-out prompts within a few steps (fixed seed)."""

from __future__ import annotations

from pathlib import Path

import torch

from lit_memopt.modules import IntuitorModule


def test_embedded_recipe_self_certainty_rises(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lit_memopt import cli

    # The recipe as shipped (tiny_qwen3, byte tokenizer), with smaller groups and shorter responses for speed.
    cfg = cli.compose_config(
        [
            "recipe=intuitor", "data.batch_size=2", "module.num_samples=4", "module.max_new_tokens=8",
            f"logger.save_dir={tmp_path}",
        ]
    )
    pl.seed_everything(0)
    objects = cli.instantiate_run(cfg)
    module = objects.module
    assert isinstance(module, IntuitorModule) and module.summary_keys == ("train/self_certainty", "train/kl", "val/accuracy", "val/self_certainty")
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
