"""The shipped CRSP recipe through the CLI: grammar tasks, a warm start of the three roles before the first
held-out validation, held-out solve rate and proposal validity in the summary, the warm weights cached and reused."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lit_memopt.models import ModelConfig
from lit_memopt.modules import CRSPModule


def test_recipe_warm_starts_validates_first_and_caches(tmp_path: Path) -> None:
    from test_cli import run_cli

    args = ["fit", "recipe=crsp", "module.warm_start.steps=3", "module.warm_start.batch_size=4", "data.batch_size=2",
            "data.num_val=2", "module.validation.solver_samples=2", "module.roles.num_solver_samples=2",
            "module.roles.critiques_per_task=1", "module.generation.max_new_tokens.propose=16",
            "module.generation.max_new_tokens.solve=8", "module.generation.max_new_tokens.critique=8",
            "trainer.max_steps=1", "trainer.val_check_interval=1", "trainer.log_every_n_steps=1",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_cli(args, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    output = first.stdout + first.stderr
    assert "CRSPModule warm start: 3 supervised steps on the task family" in output
    assert (tmp_path / "run" / "warm_start.pt").is_file()
    rows = list(csv.DictReader(next((tmp_path / "run").glob("logs/version_*/metrics.csv")).open()))
    val_steps = [int(r["step"]) for r in rows if r.get("val/solve_rate")]
    assert val_steps[0] == 0 and len(val_steps) == 2, val_steps  # validate_first, then after the step
    assert all(r.get("val/proposal_valid_rate") and r.get("val/solve_rate_stderr") and r.get("val/solve_rate_greedy")
               for r in rows if r.get("val/solve_rate"))
    assert "val/solve_rate" in first.stdout and "val/proposal_valid_rate" in first.stdout
    assert "±" in first.stdout and "val/solve_rate_stderr" not in first.stdout  # the error printed with its metric

    second = run_cli(args, cwd=tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "CRSPModule warm start: loaded" in second.stdout + second.stderr


def tiny_lora_config() -> ModelConfig:
    """A one-layer Qwen3 with LoRA adapters: builds in milliseconds."""
    return ModelConfig(name="tiny", arch=dict(model_type="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=16),
                       lora={"r": 4, "alpha": 8})


def test_a_lora_policy_may_be_warm_started_and_bad_settings_are_named() -> None:
    config = tiny_lora_config()
    # the warm start trains the base under disable_adapter(), which is the reference (test_warm_start.py)
    assert CRSPModule(config, config.build_tokenizer(), warm_start={"steps": 5},
                      roles={"adapters": True}).warm_start.steps == 5
    with pytest.raises(ValueError, match="module.validation.solver_samples must be an integer >= 1, got 0"):
        CRSPModule(config, config.build_tokenizer(), validation={"solver_samples": 0})
    with pytest.raises(ValueError, match=r"module.prompt_style must be one of \['instruct', 'compact'\], got 'short'"):
        CRSPModule(config, config.build_tokenizer(), prompt_style="short")


def test_role_adapters_each_get_their_own_learning_rate_from_the_role_weight() -> None:
    """With one adapter per role, each adapter gets only its role's loss, whose constant scale AdamW ignores: the role
    weights scale the adapters' learning rates instead (weight 0 freezes that role's adapter)."""
    config = tiny_lora_config()
    module = CRSPModule(config, config.build_tokenizer(), optim={"lr": 1e-3},
                        roles={"adapters": True, "propose": {"weight": 0.5}, "critique": {"weight": 0.0}})
    groups = module.configure_optimizers().param_groups
    assert [g["lr"] for g in groups] == [5e-4, 1e-3, 0.0]  # propose, solve, critique
    named = {id(p): n for n, p in module.model.named_parameters()}
    for role, group in zip(("propose", "solve", "critique"), groups):
        names = [named[id(p)] for p in group["params"]]
        assert names and all(f".lora_A.{role}." in n or f".lora_B.{role}." in n for n in names), (role, names[:3])
    assert sum(len(g["params"]) for g in groups) == sum("lora_" in n for n in named.values())
    shared = CRSPModule(config, config.build_tokenizer(), optim={"lr": 1e-3}, roles={"propose": {"weight": 0.5}})  # one group
    assert [g["lr"] for g in shared.configure_optimizers().param_groups] == [1e-3]
