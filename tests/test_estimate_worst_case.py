"""Generation recipes estimated at their worst case, against a real step forced to generate to max_new_tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from lit_memopt.cli import compose_config, instantiate_run
from lit_memopt.cli_estimate import _recipe_batch, estimate_recipe
from lit_memopt.memory import memory_budget
from lit_memopt.memory.budget import storage_bytes
from lit_memopt.memory.batch import batch_tensors
from lit_memopt.memory.step import (
    _initialise_optimizer_states,
    _optimizers_from,
    _run_training_step,
    _set_foreach,
    _standalone,
)
from lit_memopt.memory.worst_case import WorstCaseValues, filler_token_id

_CHILD = "LIT_MEMOPT_WORST_CASE_CHILD"


def _ran_in_a_fresh_interpreter(request: pytest.FixtureRequest) -> bool:
    """Run this test in a child pytest process and check it passed there; ``False`` inside that child.

    Why: a CI run once died of a segmentation fault in a later, unrelated test of the same process, and the
    suspect is this module's WorstCaseValues (it replays ops on real values next to fake tensors); in a child
    process a memory fault fails this test by name instead of killing whatever runs next. Root cause open.
    """
    if os.environ.get(_CHILD) == "1":
        return False
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=request.config.rootpath, env={**os.environ, _CHILD: "1"}, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    return True


# The embedded tiny model with 2 blocks (a full trace, no extrapolation) and short responses: seconds, not minutes.
SMALL = ["model.arch.num_hidden_layers=2", "trainer.accelerator=cpu"]
RECIPES = {
    "intuitor": ["module.num_samples=4", "module.max_new_tokens=12", "data.batch_size=2", "module.warm_start.steps=0"],
    "crsp": ["module.generation.max_new_tokens.propose=24", "module.generation.max_new_tokens.solve=12",
             "module.generation.max_new_tokens.critique=12", "module.roles.num_solver_samples=2",
             "module.roles.critiques_per_task=1", "data.batch_size=1", "module.warm_start.steps=0"],
}


def _compose(overrides: list[str]):  # noqa: ANN202
    """The recipe's config without logger and callbacks (they need a Hydra run directory), as the estimate builds it."""
    from omegaconf import open_dict

    cfg = compose_config(overrides)
    with open_dict(cfg):
        cfg.logger = None
        cfg.callbacks = None
    return cfg


def _measured_worst_case_peak(cfg, filler: int, monkeypatch) -> tuple[int, object]:  # noqa: ANN001
    """Peak live bytes (memory_budget) of a real step whose every sampled token is ``filler``: no response ends early."""
    torch.manual_seed(0)
    run = instantiate_run(cfg)
    module = run.module
    if hasattr(module, "sandbox"):
        module.setup("validate")  # CRSP's sandbox, as the estimate starts it
    batch = _recipe_batch(run.datamodule)

    def multinomial(probs: torch.Tensor, num_samples: int, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        return torch.full((*probs.shape[:-1], num_samples), filler, dtype=torch.long, device=probs.device)

    monkeypatch.setattr(torch, "multinomial", multinomial)
    optimizers = _optimizers_from(module.configure_optimizers())
    _set_foreach(optimizers, True)  # as the estimate: CUDA's default AdamW
    _initialise_optimizer_states(optimizers)
    module.train()
    baseline = storage_bytes(module, *optimizers, *batch_tensors(batch))
    try:
        with memory_budget(None, baseline_bytes=baseline) as probe, _standalone(module, optimizers):
            _run_training_step(module, batch, optimizers, types.SimpleNamespace(phase=None), 0)
    finally:
        if hasattr(module, "sandbox"):
            module.teardown("validate")
    return probe.peak_bytes, batch


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_worst_case_estimate_matches_a_real_step_generating_to_max_new_tokens(recipe: str, monkeypatch, request) -> None:  # noqa: ANN001
    if _ran_in_a_fresh_interpreter(request):
        return
    cfg = _compose([f"recipe={recipe}", *SMALL, *RECIPES[recipe]])
    report = estimate_recipe(cfg)
    est = report.estimate
    # the module samples until end-of-sequence (generates_until_eos): the estimate is its worst case
    assert est.worst_case_tokens is not None and est.worst_case_tokens > 0
    hp = cfg.module
    if recipe == "intuitor":  # every one of the B x G responses has max_new_tokens tokens
        assert est.worst_case_tokens == cfg.data.batch_size * hp.num_samples * hp.max_new_tokens
    else:  # propose 1, solve num_solver_samples, critique critiques_per_task responses per task
        tokens, roles = hp.generation.max_new_tokens, hp.roles
        assert est.worst_case_tokens == cfg.data.batch_size * (
            tokens.propose + roles.num_solver_samples * tokens.solve + roles.critiques_per_task * tokens.critique)
    tokenizer = instantiate_run(cfg).tokenizer
    filler = filler_token_id(tokenizer, None, cfg.model.arch.vocab_size)
    measured, batch = _measured_worst_case_peak(cfg, filler, monkeypatch)
    assert abs(est.peak_bytes - measured) <= 0.10 * measured, (recipe, est.peak_bytes, measured)


def test_values_are_followed_and_unknown_values_are_refused(request) -> None:  # noqa: ANN001
    if _ran_in_a_fresh_interpreter(request):
        return
    from lit_memopt.memory import fake_mode
    from lit_memopt.memory.worst_case import UnknownValueError

    ids = torch.tensor([[5, 6, 1], [7, 1, 1]])
    with fake_mode(allow_non_fake_inputs=True) as mode:
        fake_ids = mode.from_tensor(ids)
        weight = torch.empty(4, 3)  # fake: no values
        values = WorstCaseValues(filler_token_id=9)
        values.track(fake_ids, ids)
        with values:
            is_eos = fake_ids == 1
            assert is_eos.sum().item() == 3  # known: computed from the ids
            assert (fake_ids[~is_eos]).tolist() == [5, 6, 7]  # boolean indexing of known values
            hidden = torch.empty(2, 3, 4)  # an activation (unknown values) indexed by a known mask
            assert hidden[~is_eos].shape == (3, 4)
            sampled = torch.multinomial(torch.ones(2, 4), 1)
            assert sampled.flatten().tolist() == [9, 9]  # sampling is forced to the filler
            assert int((sampled != 1).all()) == 1  # so a stop on EOS says "continue"
            with pytest.raises(UnknownValueError):
                bool((weight > 0).any())  # a value that depends on the weights has no worst case
            with pytest.raises(UnknownValueError):
                torch.nonzero(weight)
    assert values.sampled_tokens == 2
