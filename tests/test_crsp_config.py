"""CRSPModule's setting groups: each names its recipe key in its errors, the recipes' ``module:`` sections map onto
them field for field, and the flat keys of before the groups say where they moved."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lit_memopt.modules.crsp_config import (
    MOVED_KEYS,
    Generation,
    MaxNewTokens,
    Optim,
    Reward,
    RoleLoss,
    Roles,
    SandboxSettings,
    Validation,
    moved_key_error,
)

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("crsp*.yaml"))
GROUPS = {"optim": Optim, "roles": Roles, "generation": Generation, "reward": Reward, "sandbox": SandboxSettings,
          "validation": Validation}
TOP_LEVEL = {"_target_", "warm_start", "seed", "prompt_style"}  # module keys that are not a group of crsp_config


@pytest.mark.parametrize(("group", "given", "message"), [
    (Roles, {"propose": {"weight": -1}}, "module.roles.propose.weight must be >= 0, got -1."),
    (Roles, {"critique": {"beta": "high"}}, "module.roles.critique.beta must be >= 0, got 'high'."),
    (Roles, {"num_solver_samples": 2, "critiques_per_task": 3},
     "module.roles.critiques_per_task must be an integer in [1, num_solver_samples=2], got 3."),
    (Roles, {"function_task_ratio": 1.5}, "module.roles.function_task_ratio must be in [0, 1], got 1.5."),
    (Roles, {"solve": {"wieght": 1}}, "module.roles.solve has unknown key(s) ['wieght']; its keys are ['beta', 'weight']."),
    (Optim, {"lr": 0}, "module.optim.lr must be > 0, got 0."),
    (Optim, {"betas": [0.9]}, "module.optim.betas must be two numbers in [0, 1), got (0.9,)."),
    (Optim, {"gradient_clip_val": -1.0}, "module.optim.gradient_clip_val must be > 0 or null, got -1.0."),
    (Generation, {"max_new_tokens": {"solve": 0}}, "module.generation.max_new_tokens.solve must be an integer >= 1, got 0."),
    (Generation, {"temperature": 0.0}, "module.generation.temperature must be > 0, got 0.0."),
    (Generation, {"micro_batch_size": 2.5}, "module.generation.micro_batch_size must be an integer >= 1, got 2.5."),
    (Reward, {"length_max_tokens": 1}, "module.reward.length_max_tokens must be an integer > 1, got 1."),
    (SandboxSettings, {"workers": 0}, "module.sandbox.workers must be an integer >= 1, got 0."),
    (SandboxSettings, {"wall_time": 3}, "module.sandbox has unknown key(s) ['wall_time']; its keys are "
                                        "['wall_time_s', 'cpu_time_s', 'memory_mb', 'workers', 'require', 'max_output_chars']."),
    (Validation, {"solver_samples": 0}, "module.validation.solver_samples must be an integer >= 1, got 0."),
    (Validation, [4], "module.validation must be a mapping of ['solver_samples', 'greedy'], got list [4]."),
])
def test_each_group_names_the_recipe_key_of_a_bad_setting(group, given, message) -> None:
    with pytest.raises(ValueError) as error:
        group.build(given)
    assert str(error.value) == message


def test_a_mapping_keeps_the_defaults_of_what_it_leaves_out() -> None:
    roles = Roles.build({"propose": {"weight": 0.3}, "num_solver_samples": 8})
    # a role keeps its own default beta (propose 0.01, not RoleLoss's), lists of Hydra become tuples
    assert roles.propose == RoleLoss(beta=0.01, weight=0.3) and roles.critique == RoleLoss(beta=0.1)
    assert roles.num_solver_samples == 8 and roles.critiques_per_task == Roles().critiques_per_task
    assert Optim.build({"betas": [0.8, 0.9]}).betas == (0.8, 0.9)
    assert Reward.build({"alpha_breakpoints": [[0.0, 1.0, 0.9]]}).alpha_breakpoints == ((0.0, 1.0, 0.9),)
    assert Generation.build(None) == Generation() and Generation.build(Generation()) == Generation()
    with pytest.raises(dataclasses.FrozenInstanceError):  # settings are fixed once built: replace() makes a new one
        Roles().clamp = 1.0  # type: ignore[misc]


def test_flat_keys_of_before_the_groups_name_their_new_key() -> None:
    assert str(moved_key_error({"weight_propose": 0.3})) == "module.weight_propose moved to module.roles.propose.weight."
    assert str(moved_key_error({"role_adapters": True, "colour": 1})) == (
        "module.role_adapters moved to module.roles.adapters; unknown module key(s) ['colour'].")
    # every moved key points at a field that exists
    for old, new in MOVED_KEYS.items():
        group, *path = new.split(".")
        node = GROUPS[group]()
        for part in path:
            assert hasattr(node, part), (old, new)
            node = getattr(node, part)


def _dataclass_tree(group) -> dict:
    """Every field of ``group``, nested groups as sub-dicts, for comparison with a recipe's keys."""
    return {f.name: _dataclass_tree(type(getattr(group, f.name))) if dataclasses.is_dataclass(getattr(group, f.name))
            else None for f in dataclasses.fields(group)}


def _key_tree(node) -> dict:
    return {k: _key_tree(v) if isinstance(v, dict) else None for k, v in node.items()}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_the_recipes_module_groups_map_onto_the_dataclasses_key_for_key(recipe: Path) -> None:
    module = OmegaConf.to_container(OmegaConf.load(recipe).module)
    assert set(module) - TOP_LEVEL == set(GROUPS), set(module) ^ (set(GROUPS) | TOP_LEVEL)
    for name, group in GROUPS.items():
        # every field written out (the recipe documents each knob), none unknown, and the values pass the checks
        assert _key_tree(module[name]) == _dataclass_tree(group()), name
        built = group.build(module[name])
        assert isinstance(built, group)
    assert isinstance(Roles.build(module["roles"]).propose, RoleLoss)
    assert isinstance(Generation.build(module["generation"]).max_new_tokens, MaxNewTokens)



def test_the_command_line_names_where_a_moved_key_went() -> None:
    from lit_memopt.cli import UsageError, check_overrides

    with pytest.raises(UsageError, match=r"module\.weight_propose moved to module\.roles\.propose\.weight"):
        check_overrides(["recipe=crsp", "module.weight_propose=0.3"])
    with pytest.raises(UsageError, match="unknown key 'module.bogus'"):
        check_overrides(["recipe=crsp", "module.bogus=1"])
