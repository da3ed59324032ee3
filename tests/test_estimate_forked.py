"""The check trace in a forked copy of the process (``memory.forked``), and the tracker's lean per-op path."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import lit_memopt.memory.blocks as blocks
from lit_memopt.memory import estimate_peak, fake_mode
from lit_memopt.memory.blocks import estimate_with_blocks
from lit_memopt.memory.forked import ForkedCall, ForkedCallFailed, can_fork
from lit_memopt.memory.tracker import StepTracker
from lit_memopt.models import ModelConfig
from lit_memopt.modules.sft import SFTModule

needs_fork = pytest.mark.skipif(not can_fork(), reason="forking needs Linux, two cores and a single thread")
ARCH = {
    "model_type": "qwen3", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 192,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1,
}


def _fake_sft(blocks_built: int) -> SFTModule:
    with fake_mode():
        return SFTModule(ModelConfig(name="t", arch={**ARCH, "num_hidden_layers": blocks_built}), lr=1e-3,
                         gradient_checkpointing=True)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 384, (4, 40), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _same(a, b) -> None:  # noqa: ANN001
    assert (a.peak_bytes, a.peak_phase, a.phase_peaks, a.phase_breakdowns, a.reserved_peak_bytes) == (
        b.peak_bytes, b.peak_phase, b.phase_peaks, b.phase_breakdowns, b.reserved_peak_bytes)
    assert [m.as_dict() for m in a.modules] == [m.as_dict() for m in b.modules]


@needs_fork
def test_forked_call_returns_the_childs_value() -> None:
    parent = os.getpid()
    pid, threads = ForkedCall(lambda: (os.getpid(), torch.get_num_threads())).result(timeout=60)
    assert pid != parent and threads == 1


@needs_fork
def test_forked_call_reraises_the_childs_exception_or_reports_what_it_cannot_send() -> None:
    def bad_value():  # noqa: ANN202
        raise ValueError("bad value in the child")

    with pytest.raises(ValueError, match="bad value in the child"):
        ForkedCall(bad_value).result(timeout=60)

    class Unpicklable(Exception):
        def __reduce__(self):  # noqa: ANN204
            raise TypeError("cannot pickle")

    def unpicklable():  # noqa: ANN202
        raise Unpicklable("local class")

    with pytest.raises(ForkedCallFailed, match="Unpicklable"):
        ForkedCall(unpicklable).result(timeout=60)
    with pytest.raises(ForkedCallFailed, match="sent no result"):
        ForkedCall(lambda: os._exit(3)).result(timeout=60)


@needs_fork
def test_a_child_past_its_timeout_is_killed() -> None:
    call = ForkedCall(lambda: time.sleep(60))
    started = time.monotonic()
    with pytest.raises(ForkedCallFailed, match="within 1 s"):
        call.result(timeout=1)
    assert time.monotonic() - started < 10
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(call._pid, 0)


@needs_fork
def test_a_cancelled_child_is_killed_and_reaped() -> None:
    call = ForkedCall(lambda: time.sleep(60))
    call.cancel()
    with pytest.raises(ProcessLookupError):
        os.kill(call._pid, 0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_failing_trace_here_cancels_the_forked_one(monkeypatch) -> None:  # noqa: ANN001
    cancelled = []

    class Recording:
        def __init__(self, fn) -> None:  # noqa: ANN001
            pass

        def cancel(self) -> None:
            cancelled.append(True)

    monkeypatch.setattr(blocks, "ForkedCall", Recording)
    monkeypatch.setattr(blocks, "can_fork", lambda: True)
    monkeypatch.setattr(blocks, "estimate_peak", lambda *a, **k: (_ for _ in ()).throw(ValueError("trace failed")))
    with pytest.raises(ValueError, match="trace failed"):
        estimate_with_blocks(_fake_sft(3), _batch(), 9, parallel=True)
    assert cancelled == [True]


def test_no_fork_while_another_thread_runs() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork()
    finally:
        stop.set()
        thread.join()


def test_no_fork_once_this_process_holds_a_cuda_context(monkeypatch) -> None:  # noqa: ANN001
    # A forked child cannot use its parent's CUDA context (every CUDA call fails there).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not can_fork()


def test_a_step_is_built_from_a_composed_config_outside_a_hydra_run(monkeypatch) -> None:  # noqa: ANN001
    # The measurement on a GPU builds the real module from the same step config as the estimate: no
    # logger or callbacks, whose ${hydra:...} directories exist only inside a `lit-memopt` run.
    from hydra.core.hydra_config import HydraConfig

    from lit_memopt.cli import compose_config, instantiate_run
    from lit_memopt.cli_fake_run import step_config

    # Outside a run, whatever an earlier in-process `lit-memopt` command of this test worker left behind.
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    cfg = compose_config(["recipe=sft"])
    with pytest.raises(Exception, match="HydraConfig was not set"):
        instantiate_run(cfg)
    run = instantiate_run(step_config(cfg))
    assert isinstance(run.module, SFTModule) and run.logger is False and run.callbacks == []


@pytest.mark.filterwarnings("ignore::UserWarning")
@needs_fork
def test_the_check_trace_in_a_forked_copy_gives_the_sequential_result(monkeypatch) -> None:  # noqa: ANN001
    batch = _batch()
    sequential = estimate_with_blocks(_fake_sft(3), batch, 9, optimizer_foreach=True)
    forks = []

    class Counting(ForkedCall):
        def __init__(self, fn) -> None:  # noqa: ANN001
            forks.append(fn)
            super().__init__(fn)

    monkeypatch.setattr(blocks, "ForkedCall", Counting)
    # Earlier tests in this process may have left threads (torch.compile's workers) that make can_fork() say
    # no; the child here only traces fake tensors, and the question is whether its result is the sequential one.
    monkeypatch.setattr(blocks, "can_fork", lambda: True)
    parallel = estimate_with_blocks(_fake_sft(3), batch, 9, optimizer_foreach=True, parallel=True)
    assert len(forks) == 1
    _same(parallel, sequential)
    assert parallel.method == sequential.method


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_failed_child_falls_back_to_tracing_here(monkeypatch) -> None:  # noqa: ANN001
    batch = _batch()
    sequential = estimate_with_blocks(_fake_sft(3), batch, 9, optimizer_foreach=True)

    class Failing:
        def __init__(self, fn) -> None:  # noqa: ANN001
            pass

        def result(self, timeout: float):  # noqa: ANN201
            raise ForkedCallFailed("simulated crash")

    monkeypatch.setattr(blocks, "ForkedCall", Failing)
    monkeypatch.setattr(blocks, "can_fork", lambda: True)
    _same(estimate_with_blocks(_fake_sft(3), batch, 9, optimizer_foreach=True, parallel=True), sequential)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lean_per_op_bookkeeping_matches_the_stock_tracker(monkeypatch) -> None:  # noqa: ANN001
    """Skipping peak updates after ops that add no memory, and `.device` reads, changes no number."""
    batch = _batch()
    lean = estimate_peak(_fake_sft(2), batch, optimizer_foreach=True)

    def stock(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
        if kwargs and kwargs.get("generator") is not None:
            kwargs = {**kwargs, "generator": None}
        return MemTracker.__torch_dispatch__(self, func, types, args, kwargs)

    monkeypatch.setattr(StepTracker, "__torch_dispatch__", stock)
    _same(lean, estimate_peak(_fake_sft(2), batch, optimizer_foreach=True))


def _random_log(events: int, seed: int = 0) -> list[tuple[int, int, int]]:
    import random

    rng = random.Random(seed)
    log, live, key = [], [], 0
    for _ in range(events):
        if live and rng.random() < 0.5:
            k, n = live.pop(rng.randrange(len(live)))
            log.append((-1, k, n))
        else:
            n = rng.choice([512, 3000, 1 << 20, 3 << 20, 24 << 20, rng.randint(1, 40 << 20)])
            log.append((1, key, n))
            live.append((key, n))
            key += 1
    return log


@pytest.mark.parametrize("device_mib", [None, 4096, 300])
def test_the_least_device_replayed_in_a_forked_child_equals_replaying_it_here(monkeypatch, device_mib) -> None:  # noqa: ANN001
    # a long log's two replays run side by side (the least device in a child); 300 MiB: the on-device replay runs out
    import lit_memopt.memory.step as step
    from lit_memopt.memory.allocator import AllocatorOutOfMemory, reserved_peak

    log = _random_log(4000)
    device = None if device_mib is None else device_mib << 20
    forks = []
    monkeypatch.setattr(step, "FORK_REPLAY_EVENTS", 1000)
    monkeypatch.setattr(step, "ForkedCall", lambda fn: forks.append(fn) or ForkedCall(fn))
    if device is None:
        expected = (reserved_peak(log), None)
    else:
        least = reserved_peak(log, release_before_growing=True)
        try:
            expected = (reserved_peak(log, device), least)
        except AllocatorOutOfMemory as exc:
            expected = (max(least, exc.needed_bytes),) * 2
            assert device_mib == 300
    assert step.reserved_peaks(log, device) == expected
    assert len(forks) == (0 if device is None or not can_fork() else 1)
    # the check replay asks for no least device: nothing forked, none returned (unless the device runs out)
    forks.clear()
    on_device, least = step.reserved_peaks(log, device, least=False)
    assert on_device == expected[0] and forks == []
    assert least == (expected[1] if device_mib == 300 else None)


def test_a_forked_child_forks_no_further() -> None:
    # it runs on the core its parent left it: a grandchild would only compete with both
    if not can_fork():
        pytest.skip("forking is off on this machine (one core or not Linux): nothing to check")
    assert ForkedCall(can_fork).result(timeout=60) is False
    assert can_fork()
