"""``lit-memopt estimate`` applies the recipe's ``ActivationCheckpointing`` callback to the step it traces, as the
callback's ``setup`` would: its peak is the module switch's, every k-th layer traced in groups of k."""

from __future__ import annotations

import pytest

from lit_memopt.cli import compose_config
from lit_memopt.cli_estimate import estimate_recipe
from lit_memopt.cli_fake_run import activation_checkpointing_callbacks, build_measured_module, checkpoint_period_of

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
def test_activation_offload_is_traced_off_the_device() -> None:
    """The callback's offload is traced as device memory sees it: what the layers save leaves the device (alone, or
    on top of checkpointing, where only the layers' inputs are saved) and the bytes copied are counted."""
    offload = "callbacks.activation_checkpointing.offload_to_cpu=true"
    only = [CALLBACK, offload, "callbacks.activation_checkpointing.recompute=false"]
    plain = estimate_recipe(compose_config(BASE)).estimate
    offloaded = estimate_recipe(compose_config([*BASE, *only]))
    checkpointed = estimate_recipe(compose_config([*BASE, CALLBACK])).estimate
    both = estimate_recipe(compose_config([*BASE, CALLBACK, offload])).estimate
    assert any("offload_to_cpu=true" in n and "leave the device" in n for n in offloaded.notes)
    assert plain.offloaded_bytes == checkpointed.offloaded_bytes == 0
    assert offloaded.estimate.phase_peaks["forward"] < 0.8 * plain.phase_peaks["forward"]
    assert both.phase_peaks["forward"] < checkpointed.phase_peaks["forward"]
    # with checkpointing only the layers' inputs are saved, hence copied: far fewer bytes than every activation
    assert 0 < both.offloaded_bytes < 0.25 * offloaded.estimate.offloaded_bytes
    # an offload-only callback checkpoints nothing: every block alike, no period
    assert checkpoint_period_of(compose_config([*BASE, *only, "callbacks.activation_checkpointing.every_k_layers=3"])) == 1


def test_the_measured_module_is_checkpointed_as_the_traced_one() -> None:
    """``estimate`` on a GPU measures the real step beside its trace: the callback's layers are wrapped there too."""
    from lit_memopt._compat.distributed import ActivationWrapper

    def wrapped(*overrides: str) -> int:
        module = build_measured_module(compose_config([*BASE, *overrides]))
        return sum(isinstance(m, ActivationWrapper) for m in module.modules())

    assert wrapped() == 0
    assert wrapped(CALLBACK) == 12
    assert wrapped(CALLBACK, "callbacks.activation_checkpointing.every_k_layers=3") == 4
