"""memory_budget: measured peaks are exact thresholds — at the peak a step passes, one byte below it
raises a real torch.OutOfMemoryError in the phase (forward, backward, optimizer step) that reaches it."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from lit_memopt.memory import is_oom_error, memory_budget
from lit_memopt.memory.budget import MemoryBudget, storage_bytes

PHASES = ("forward", "backward", "optimizer")


def _make() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    # Wide layers and a small batch: Adam's state (2x params) makes the optimizer step the peak,
    # the gradients (1x params) on top of activations make backward higher than forward.
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 32))
    return model, torch.randn(6, 32)


BASE_MODEL, BATCH = _make()


def _step(budget: int | None) -> tuple[str | None, list[int], MemoryBudget]:
    """Run one step on a fresh copy under ``budget``; return (phase that OOMed or None, cumulative peaks)."""
    model = copy.deepcopy(BASE_MODEL)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    peaks: list[int] = []
    phase = "forward"
    try:
        with memory_budget(budget) as mb:
            loss = model(BATCH).square().mean()
            peaks.append(mb.peak_bytes)
            phase = "backward"
            loss.backward()
            peaks.append(mb.peak_bytes)
            phase = "optimizer"
            opt.step()
            peaks.append(mb.peak_bytes)
    except torch.OutOfMemoryError:
        return phase, peaks, mb
    return None, peaks, mb


@pytest.fixture(scope="module")
def cumulative_peaks() -> list[int]:
    phase, peaks, _ = _step(None)
    assert phase is None
    # The model was chosen so that each phase sets a new peak; the boundaries below rely on it.
    assert peaks[0] < peaks[1] < peaks[2], peaks
    return peaks


def test_tracking_only_never_raises_and_is_deterministic(cumulative_peaks: list[int]) -> None:
    assert _step(None)[1] == cumulative_peaks


@pytest.mark.parametrize("phase_index", [0, 1, 2], ids=PHASES)
def test_raises_in_the_phase_that_passes_the_budget(cumulative_peaks: list[int], phase_index: int) -> None:
    threshold = cumulative_peaks[phase_index]
    # One byte below this phase's peak: it must raise here and not earlier.
    failed_in, peaks_before, mb = _step(threshold - 1)
    assert failed_in == PHASES[phase_index]
    assert peaks_before == cumulative_peaks[:phase_index]
    assert mb.num_ooms == 1 and mb.last_oom is not None
    assert mb.last_oom["current_bytes"] + mb.last_oom["requested_bytes"] > threshold - 1
    # Exactly at the peak this phase passes (and the next one, if any, fails or the step completes).
    failed_in, _, _ = _step(threshold)
    assert failed_in == (PHASES[phase_index + 1] if phase_index < 2 else None)


def test_every_budget_at_or_above_the_peak_passes(cumulative_peaks: list[int]) -> None:
    peak = cumulative_peaks[-1]
    for budget in (peak, peak + 1, 2 * peak):
        assert _step(budget)[0] is None
    for budget in (peak - 1, peak // 2, 0):
        assert _step(budget)[0] is not None


def test_frees_are_counted_over_many_steps() -> None:
    model = copy.deepcopy(BASE_MODEL)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(BATCH).square().mean().backward()
        opt.step()

    with memory_budget(None) as probe:
        step()
        step()  # the second step has gradients + Adam state from the first as its steady state
    steady_peak = probe.peak_bytes
    live_after = probe.current_bytes
    assert 0 < live_after < steady_peak
    # If frees were missed, live bytes would grow every step and pass the budget.
    with memory_budget(steady_peak) as mb:
        for _ in range(20):
            step()
    assert mb.num_ooms == 0


def test_live_bytes_follow_allocation_and_free_and_views_are_free() -> None:
    outside = torch.zeros(1000)
    with memory_budget(None) as mb:
        a = torch.zeros(256)  # 1 KiB
        assert mb.current_bytes == 1024
        view = a[10:20].view(2, 5)  # a view: no new storage
        alias = outside.t()  # a view of a tensor from before the budget: the baseline's
        outside.add_(1)  # in-place on the baseline: free
        assert mb.current_bytes == 1024
        b = a * 2
        assert mb.current_bytes == 2048
        del a
        assert mb.current_bytes == 2048  # the view still holds a's storage
        del view
        assert mb.current_bytes == 1024  # a's storage is freed with its last view
        del b
        gc.collect()
        assert mb.current_bytes == 0
        assert mb.peak_bytes == 2048
        mb.reset_peak()
        assert mb.peak_bytes == 0
    del alias
    # Storages created inside keep counting after exit until freed, and their frees still count.
    with mb:
        c = torch.ones(8)
    assert mb.current_bytes == 32
    del c
    assert mb.current_bytes == 0


def test_baseline_and_storage_bytes() -> None:
    model = copy.deepcopy(BASE_MODEL)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert storage_bytes(model) == params
    assert storage_bytes(model, list(model.parameters())) == params  # shared storages count once
    with memory_budget(params + 100, baseline_bytes=params) as mb:
        assert mb.current_bytes == params
        torch.zeros(25)  # exactly 100 bytes, immediately freed
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(26)
    assert mb.peak_bytes == params + 100


def test_message_is_cuda_like_and_detectable() -> None:
    with pytest.raises(torch.OutOfMemoryError) as info, memory_budget(1024, device="cpu"):
        torch.empty(2048, dtype=torch.uint8)
    message = str(info.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 2.00 KiB.")
    assert "aten.empty" in message and "simulated" in message
    assert is_oom_error(info.value)


def test_device_filter_ignores_other_devices() -> None:
    with memory_budget(0, device="cuda"):
        torch.ones(1000)  # CPU storage: not counted against a CUDA budget
    with memory_budget(0, device="cpu"), pytest.raises(torch.OutOfMemoryError):
        torch.ones(1)
    with memory_budget(0):
        torch.ones(10, device="meta")  # meta tensors have no memory


def test_budget_can_change_between_steps() -> None:
    with memory_budget(None) as mb:
        torch.ones(100)
        mb.budget_bytes = 100
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(100)
        mb.budget_bytes = None
        torch.ones(100)


@pytest.mark.parametrize("kwargs", [{"budget_bytes": -1}, {"budget_bytes": 1.5}, {"budget_bytes": 10, "baseline_bytes": -3}])
def test_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="budget_bytes|baseline_bytes"):
        memory_budget(**kwargs)


def test_fsdp2s_gathered_blocks_count_while_gathered_and_refuse_past_the_budget() -> None:
    """FSDP2 gathers each block into storages it keeps between uses and resizes in place (no ATen op): the budget
    counts them while they are gathered, as the step tracker does, and refuses a gather that passes it."""
    from torch.distributed.fsdp import fully_shard

    from lit_memopt.memory.fake_ranks import fake_process_group
    from lit_memopt.memory.tracker import StepTracker

    torch.manual_seed(0)
    with fake_process_group(2) as mesh:
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(8, 256)

        def step() -> None:
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)

        step()  # FSDP2's lazy init and buffers of the first step
        tracker = StepTracker()
        tracker.track_external(model)
        with tracker:
            step()
        baseline = storage_bytes(model)  # the local shards
        with memory_budget(None, baseline_bytes=baseline) as probe:
            step()
        # equal to the byte (1,866,760 here; 1,603,592 when the budget did not follow FSDP2's storage)
        assert probe.peak_bytes == max(tracker.phase_peaks.values())
        with memory_budget(probe.peak_bytes - 1, baseline_bytes=baseline), pytest.raises(torch.OutOfMemoryError):
            step()
