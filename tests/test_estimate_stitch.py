"""Block stitching (``memory.stitch``): the reserved figure of an N-block step replayed from a log made of the 1- and
2-block traces' logs, against a trace of all N blocks."""

from __future__ import annotations

import pytest
import torch

import lit_memopt.memory.blocks as blocks
from lit_memopt.memory import estimate_peak, fake_mode
from lit_memopt.memory.blocks import estimate_with_blocks
from lit_memopt.memory.stitch import BlockStitch, PhasedLog, phase_peaks, stitch_log
from lit_memopt.models import ModelConfig
from lit_memopt.modules.sft import SFTModule

# Large enough that the allocator's segments and rounding matter, small enough to trace all 8 blocks in seconds.
ARCH = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1}


def _fake_sft(num_blocks: int) -> SFTModule:
    with fake_mode():
        return SFTModule(ModelConfig(name="t", arch={**ARCH, "num_hidden_layers": num_blocks}), lr=1e-3)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_stitched_log_replays_to_the_whole_steps_reserved_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(3, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    whole = estimate_peak(_fake_sft(8), batch, optimizer_foreach=True)
    est = estimate_with_blocks(_fake_sft(3), batch, 8, optimizer_foreach=True)
    assert "8-block allocation log stitched from the probes' and replayed (checked with the 3-block trace)" in est.method
    assert est.peak_bytes == whole.peak_bytes and est.peak_phase == whole.peak_phase == "optimizer step"
    assert est.reserved_peak_bytes == whole.reserved_peak_bytes  # 595,591,168 bytes, replayed alike
    assert est.allocation_log is None and "allocation_log" not in est.as_dict()  # the logs stay inside the estimate
    # The line through the probes' reserved figures, which the stitched log replaces, misses it: the probes peak in
    # backward and the 8-block step in its optimizer step, whose allocator slack the probes never show.
    monkeypatch.setattr(blocks, "stitched_reserved", lambda *args, **kwargs: "switched off")
    line = estimate_with_blocks(_fake_sft(3), batch, 8, optimizer_foreach=True)
    assert "reserved: the line through the probes (switched off)" in line.method
    assert line.reserved_peak_bytes < 0.95 * whole.reserved_peak_bytes, (line.reserved_peak_bytes, whole.reserved_peak_bytes)


def _log(*phases: tuple[str, list[tuple[int, str, int]]]) -> PhasedLog:
    events, marks = [], []
    for phase, phase_events in phases:
        marks.append((len(events), phase))
        events.extend(phase_events)
    return PhasedLog(events, marks)


def test_each_run_the_larger_step_adds_is_repeated_in_place() -> None:
    # one block: its weight (100), an activation (10) kept until backward; the head (7) after it
    low = _log(("forward", [(1, "w0", 100), (1, "x0", 10), (1, "head", 7)]),
               ("backward", [(-1, "head", 7), (1, "g0", 100), (-1, "x0", 10)]),
               ("optimizer step", [(1, "norms", 512), (-1, "norms", 512)]))
    # two blocks: the second's events inserted; a per-parameter list grows by one entry per block
    high = _log(("forward", [(1, "w0", 100), (1, "x0", 10), (1, "w1", 100), (1, "x1", 10), (1, "head", 7)]),
                ("backward", [(-1, "head", 7), (1, "g1", 100), (-1, "x1", 10), (1, "g0", 100), (-1, "x0", 10)]),
                ("optimizer step", [(1, "norms", 1024), (-1, "norms", 1024)]))
    four = stitch_log(low, high, 3)
    assert [(sign, size) for sign, _, size in four.events] == [
        (1, 100), (1, 10), (1, 100), (1, 10), (1, 100), (1, 10), (1, 100), (1, 10), (1, 7),
        (-1, 7), *[(1, 100), (-1, 10)] * 4,
        (1, 2048), (-1, 2048)]
    assert [phase for _, phase in four.phases] == ["forward", "backward", "optimizer step"]
    # each copy frees its own activation, after the gradient of the block before it: as a 4-block step does
    frees = [key for sign, key, _ in four.events if sign < 0]
    assert frees[1:5] == [(3, 0), (3, 1), (3, 2), (1, 0)]  # x1's three copies, then x0
    assert phase_peaks(four) == {"forward": 4 * 110 + 7, "backward": 4 * 110 + 4 * 100 - 3 * 10,
                                 "optimizer step": 4 * 200 + 2048}
    assert stitch_log(low, high, 1).events == [(s, (uid, 0), n) for s, uid, n in BlockStitch(low, high).events]


def test_logs_that_differ_by_more_than_insertions_are_not_stitched() -> None:
    low = _log(("forward", [(1, "a", 100), (1, "b", 30)]))
    dropped = _log(("forward", [(1, "a", 100), (1, "c", 50), (1, "d", 70)]))  # b is gone: not one more block
    assert not BlockStitch(low, dropped).aligned and stitch_log(low, dropped, 5) is None
    other_phases = _log(("forward", [(1, "a", 100), (1, "b", 30)]), ("backward", [(1, "c", 5)]))
    assert stitch_log(low, other_phases, 2) is None
    with_more = _log(("forward", [(1, "a", 100), (1, "e", 1), (1, "b", 30)]))
    assert stitch_log(with_more, with_more, 0) is None  # no copies: nothing to build


def test_phase_peaks_count_what_is_live_when_a_phase_starts_and_reused_keys() -> None:
    log = _log(("forward", [(1, "k", 40), (1, "m", 20), (-1, "k", 40), (1, "k", 5)]),  # an id() reused once freed
               ("backward", [(-1, "m", 20)]))
    assert phase_peaks(log) == {"forward": 60, "backward": 25}
