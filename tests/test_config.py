"""Every recipe and every config-group option composes, and the composed configs are well formed."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lit_memopt import cli

cli.register_recipes()
GROUPS = cli.list_groups()


def _compose(overrides: list[str]):
    return cli.compose_config(overrides)


def test_groups_and_recipes_are_discovered() -> None:
    for group in ("trainer", "model", "callbacks", "logger", "data", "recipe"):
        assert GROUPS[group], group
    assert {"default", "gpu", "ddp", "fsdp", "deepspeed"} <= set(GROUPS["trainer"])
    assert {"tiny_qwen3", "qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen2_5_1_5b", "qwen2_5_7b", "llama3_2_1b"} <= set(GROUPS["model"])
    assert {"default", "none"} <= set(GROUPS["callbacks"])
    assert {"csv", "tensorboard"} <= set(GROUPS["logger"])
    assert "sft" in GROUPS["recipe"]


@pytest.mark.parametrize("recipe", GROUPS["recipe"])
def test_every_recipe_composes(recipe: str) -> None:
    cfg = _compose([f"recipe={recipe}"])
    assert cfg.recipe_name, recipe
    assert "_target_" in cfg.module and "_target_" in cfg.model and "_target_" in cfg.data
    OmegaConf.to_container(cfg.module, resolve=True)


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g, options in GROUPS.items() if g != "recipe" for o in options],
)
def test_every_group_option_composes(group: str, option: str) -> None:
    cfg = _compose([f"{group}={option}"])
    node = cfg.get(group)
    if group == "callbacks":
        for name, callback in (node or {}).items():
            assert "_target_" in callback, f"callbacks/{option}: entry {name} has no _target_"
    else:
        assert node is not None and "_target_" in node, f"{group}/{option}.yaml has no _target_"


def test_every_yaml_key_is_commented() -> None:
    """Each key line of a conf/ or recipes/ YAML carries a comment (the config is the documentation)."""
    missing = []
    for path in sorted(list(cli.conf_dir().rglob("*.yaml")) + list(cli.recipes_dir().glob("*.yaml"))):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith(("#", "-")) or ":" not in text or text in ("{}",):
                continue
            key, _, value = text.partition(":")
            is_block = not value.strip()  # a mapping header: its children carry the comments
            if "#" not in line and not is_block and not key.startswith(("_target_", "defaults")):
                missing.append(f"{path.name}:{number}: {text}")
    assert not missing, "keys without a comment:\n" + "\n".join(missing[:40])


@pytest.mark.parametrize("name", [o for o in GROUPS["model"]])
def test_model_configs_instantiate(name: str) -> None:
    from hydra.utils import instantiate

    model_config = instantiate(_compose([f"model={name}"]).model)
    hf_config = model_config.hf_config()
    # every id the tokenizer makes has an embedding row (384 for the byte-level one, 22 for tiny_qwen3_strings)
    ids = 3 + len(model_config.alphabet) if getattr(model_config, "alphabet", None) else 384
    assert hf_config.vocab_size >= ids and hf_config.num_hidden_layers >= 1
