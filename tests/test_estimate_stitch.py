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
    # each block's backward frees one of the four activations, after its gradient: as a 4-block step does
    frees = [key for sign, key, size in four.events if sign < 0 and size == 10]
    activations = [key for sign, key, size in four.events if sign > 0 and size == 10]
    assert len(frees) == 4 and set(frees) == set(activations)
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


class _DecodingSFT(SFTModule):
    """A GRADE-shaped step: the model decodes a few tokens one call at a time (a growing cache), each next input the
    expected embedding under the last token's distribution, and the loss is differentiated through every call."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from transformers import DynamicCache

        embed = self.model.get_input_embeddings()
        cache, inputs, loss = DynamicCache(), embed(batch["input_ids"]), 0.0
        for _ in range(4):
            logits = self.model(inputs_embeds=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            probs = logits.float().softmax(-1)
            loss = loss - (probs * probs).sum()
            inputs = (probs @ embed.weight.float()).to(embed.weight.dtype)
        return loss


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_step_that_decodes_call_by_call_is_stitched_call_by_call() -> None:
    """Each call of the model adds one block's events where a block is added: the tracker starts a log segment at
    each outermost call and at each one's backward, and the logs are aligned segment by segment (GRADE at 4B: 46.77
    GiB stitched, equal to a trace of all 36 blocks, where one alignment of each phase's log had failed)."""
    def decoding(num_blocks: int) -> _DecodingSFT:
        with fake_mode():
            return _DecodingSFT(ModelConfig(name="t", arch={**ARCH, "num_hidden_layers": num_blocks}), lr=1e-3)

    ids = torch.randint(3, 4096, (4, 48), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    one = estimate_peak(decoding(1), batch, optimizer_foreach=True, keep_allocation_log=True)
    segments = [phase for _, phase in one.allocation_log.phases]
    assert segments.count("forward") >= 4 and segments.count("backward") >= 4, segments  # a segment per call
    whole = estimate_peak(decoding(6), batch, optimizer_foreach=True)
    est = estimate_with_blocks(decoding(3), batch, 6, optimizer_foreach=True)
    assert "6-block allocation log stitched from the probes' and replayed (checked with the 3-block trace)" in est.method
    assert est.peak_bytes == whole.peak_bytes
    assert est.reserved_peak_bytes == whole.reserved_peak_bytes, (est.reserved_peak_bytes, whole.reserved_peak_bytes)


def test_an_inserted_run_goes_where_the_kept_allocations_keep_their_frees() -> None:
    # A block makes and frees a temporary (5); after the blocks, a buffer of the same size (p) lives to the end. Two
    # blocks' allocations read 5, 5, 5, 7 against 5, 5, 7: the new 5 may be any of the first three. Taken as the
    # last (p), p's copies would all live at once; only the second keeps p freed after the head as in one block.
    low = _log(("forward", [(1, "t1", 5), (-1, "t1", 5), (1, "p", 5), (1, "h", 7), (-1, "p", 5)]))
    high = _log(("forward", [(1, "t1", 5), (-1, "t1", 5), (1, "t2", 5), (-1, "t2", 5), (1, "p", 5), (1, "h", 7),
                             (-1, "p", 5)]))
    three = stitch_log(low, high, 2)
    assert [(sign, size) for sign, _, size in three.events] == [(1, 5), (-1, 5), *[(1, 5), (-1, 5)] * 2, (1, 5), (1, 7),
                                                                (-1, 5)]
    assert phase_peaks(three) == {"forward": 12}  # p and h, as a 3-block step holds them


def _blocks_step(n: int) -> PhasedLog:
    """The allocation log of an n-block step, in MiB: what the stitched log of n blocks must reproduce.

    Forward: each block saves an activation, makes and frees a temporary, and hands its hidden state on to the next
    block, which frees it at its end (the embedding's output lives to the head). Backward, last block first: each
    block makes a temporary and the gradient of its input, frees the gradient it was handed, its temporary and its
    saved activation, and keeps its weight's gradient. Optimizer step: a temporary per weight, all freed after the
    loop, then the gradients (``zero_grad``)."""
    mib = 1 << 20
    fwd: list[tuple[int, str, int]] = [(1, "emb", 40 * mib)]
    for k in range(1, n + 1):
        fwd += [(1, f"a{k}", 30 * mib), (1, f"t{k}", 50 * mib), (-1, f"t{k}", 50 * mib), (1, f"h{k}", 40 * mib)]
        if k > 1:
            fwd.append((-1, f"h{k - 1}", 40 * mib))
    fwd += [(1, "logits", 100 * mib), (-1, f"h{n}", 40 * mib)]
    bwd: list[tuple[int, str, int]] = [(-1, "logits", 100 * mib), (1, f"g{n}", 40 * mib)]
    for k in range(n, 0, -1):
        bwd += [(1, f"r{k}", 60 * mib), (1, f"g{k - 1}", 40 * mib), (-1, f"g{k}", 40 * mib), (-1, f"r{k}", 60 * mib),
                (-1, f"a{k}", 30 * mib), (1, f"p{k}", 20 * mib)]
    bwd += [(-1, "g0", 40 * mib), (-1, "emb", 40 * mib)]
    opt = [(1, f"s{k}", 8 * mib) for k in range(1, n + 1)] + [(-1, f"s{k}", 8 * mib) for k in range(1, n + 1)]
    opt += [(-1, f"p{k}", 20 * mib) for k in range(1, n + 1)]
    return _log(("forward", fwd), ("backward", bwd), ("optimizer step", opt))


@pytest.mark.parametrize("blocks", [3, 8, 36])
def test_blocks_that_hand_on_to_the_next_are_stitched_as_a_longer_step_runs(blocks: int) -> None:
    """Each block frees what the one before it handed on (forward's hidden state, backward's gradient), so a block's
    run holds frees of allocations it did not make: the n-block log made from 1 and 2 blocks has the n-block step's
    events in its order, and so its peaks (Qwen3-4B SFT, 4 x 1024, checkpointed: the backward of 36 blocks read 41.59
    GiB where a whole trace reads 31.42, before a run was repeated whole)."""
    from lit_memopt.memory.allocator import reserved_peak

    stitched = stitch_log(_blocks_step(1), _blocks_step(2), blocks - 1)
    exact = _blocks_step(blocks)
    assert [(sign, size) for sign, _, size in stitched.events] == [(sign, size) for sign, _, size in exact.events]
    assert phase_peaks(stitched) == phase_peaks(exact)
    assert reserved_peak(stitched.events) == reserved_peak([(s, k, n) for s, k, n in exact.events])


def _crossing(n: int) -> PhasedLog:
    """n blocks: forward keeps an activation (10) per block; backward holds the head's temporary (100) on top of them,
    then each block, last first, makes its gradient (15, kept) and frees its activation. Backward peaks at the head
    (10 n + 100) up to 18 blocks and at its last block (15 n + 10) from there: the line through few blocks misses the
    deep step's peak."""
    forward = [(1, f"x{i}", 10) for i in range(n)]
    backward = [(1, "head", 100), (-1, "head", 100)]
    for i in reversed(range(n)):
        backward += [(1, f"g{i}", 15), (-1, f"x{i}", 10)]
    step = [(1, "update", 1)] + [(-1, f"g{i}", 15) for i in range(n)]
    return _log(("forward", forward), ("backward", backward), ("optimizer step", step))


def test_the_window_moves_to_where_the_stitched_logs_run_on_a_line() -> None:
    class Stitched:
        """The logs a stitch of the logs of ``first`` and one more block gives: ``copies`` blocks past ``first``."""

        def __init__(self, first: int) -> None:
            self.first = first

        def log(self, copies: int) -> PhasedLog:
            return _crossing(self.first + copies)

    assert phase_peaks(_crossing(36)) == {"forward": 360, "backward": 550, "optimizer step": 541}
    assert phase_peaks(_crossing(3))["backward"] == 130  # the head's line: 460 at 36 blocks
    # from 18 blocks on the line through n and n + 1 gives the 36-block peaks; through 17 and 18 it says 460
    assert blocks._affine_window(Stitched(1), (1, 2), 36) == 18
    assert blocks._affine_window(Stitched(2), (2, 3), 36) == 18
    assert blocks._affine_window(Stitched(1), (1, 2), 10) == 2  # up to 10 blocks the head's line holds throughout
    # 19 blocks peak past the head's line (295 against 290), and no two counts short of 19 are on the line to it
    assert blocks._affine_window(Stitched(1), (1, 2), 19) is None


@pytest.mark.parametrize("rows_entries", [1 << 22, 50])  # 50: a few points at a time, the chunks' minima compared
def test_the_insertion_point_counted_at_once_is_the_one_counted_point_by_point(monkeypatch, rows_entries) -> None:  # noqa: ANN001
    """``_FreeOrder.fewest_mismatches`` (numpy, every point at once) against ``min`` over ``mismatches``, point by
    point, on random free orders: the same first point with the fewest kept allocations freed elsewhere."""
    import random

    import lit_memopt.memory.stitch as stitch
    from lit_memopt.memory.stitch import _FreeOrder

    monkeypatch.setattr(stitch, "POINT_ROWS_ENTRIES", rows_entries)

    rng = random.Random(3)
    for _ in range(200):
        kept, extra = rng.randint(1, 60), rng.randint(1, 12)
        order = _FreeOrder.__new__(_FreeOrder)
        order.low = [None if rng.random() < 0.3 else rng.randint(0, kept) for _ in range(kept)]
        order.high = [None if rng.random() < 0.3 else rng.randint(0, kept + extra) for _ in range(kept + extra)]
        lo = rng.randint(0, kept)
        points = range(lo, rng.randint(lo + 1, kept + 1) + 1) if lo < kept else range(lo, lo + 1)
        expected = min(points, key=lambda p: order.mismatches(p, extra))
        assert order.fewest_mismatches(points, extra) == expected
