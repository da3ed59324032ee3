"""``lit-memopt estimate`` applies the recipe's ``ActivationCheckpointing`` callback to the step it traces, as the
callback's ``setup`` would: its peak is the module switch's, every k-th layer traced in groups of k."""

from __future__ import annotations

import pytest

from lit_memopt.cli import compose_config
from lit_memopt.cli_estimate import activation_checkpointing_callbacks, build_measured_module, checkpoint_period_of, estimate_recipe

BASE = ["recipe=sft", "model.arch.num_hidden_layers=12", "check_linearity=false"]
CALLBACK = "callbacks=[default,activation_checkpointing]"


def _peaks(*overrides: str) -> dict[str, int]:
    return estimate_recipe(compose_config([*BASE, *overrides])).estimate.phase_peaks


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_callback_checkpoints_the_traced_step_like_the_module_switch() -> None:
    none = _peaks()
    by_switch, by_callback = _peaks("module.gradient_checkpointing=true"), _peaks(CALLBACK)
    assert by_callback == by_switch and by_callback["forward"] < none["forward"]
    every_2nd_switch = _peaks("module.gradient_checkpointing=2")
    every_2nd_callback = _peaks(CALLBACK, "callbacks.activation_checkpointing.every_k_layers=2")
    assert by_switch["forward"] < every_2nd_callback["forward"] < none["forward"]
    assert abs(every_2nd_callback["forward"] - every_2nd_switch["forward"]) <= 0.01 * every_2nd_switch["forward"]


def test_the_period_and_the_offload_note_come_from_the_callback() -> None:
    cfg = compose_config([*BASE, CALLBACK, "callbacks.activation_checkpointing.every_k_layers=3"])
    assert [c.every_k_layers for c in activation_checkpointing_callbacks(cfg)] == [3]
    assert checkpoint_period_of(cfg) == 3
    assert checkpoint_period_of(compose_config([*BASE, CALLBACK, "callbacks.activation_checkpointing.every_k_layers=3",
                                                "module.gradient_checkpointing=2"])) == 6
    assert checkpoint_period_of(compose_config(BASE)) == 1 and activation_checkpointing_callbacks(compose_config(BASE)) == []


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_activation_offload_is_said_to_be_counted_on_the_device() -> None:
    report = estimate_recipe(compose_config([*BASE, CALLBACK, "callbacks.activation_checkpointing.offload_to_cpu=true"]))
    assert any("offload_to_cpu=true" in n and "not modelled" in n for n in report.notes)


def test_the_measured_module_is_checkpointed_as_the_traced_one() -> None:
    """``estimate`` on a GPU measures the real step beside its trace: the callback's layers are wrapped there too."""
    from lit_memopt._compat.distributed import ActivationWrapper

    def wrapped(*overrides: str) -> int:
        module = build_measured_module(compose_config([*BASE, *overrides]))
        return sum(isinstance(m, ActivationWrapper) for m in module.modules())

    assert wrapped() == 0
    assert wrapped(CALLBACK) == 12
    assert wrapped(CALLBACK, "callbacks.activation_checkpointing.every_k_layers=3") == 4
