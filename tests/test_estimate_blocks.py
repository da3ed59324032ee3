"""Block extrapolation (trace 1, 2 and 3 blocks, scale to N) against a full trace of the N-block model."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lit_memopt.memory import estimate_peak, fake_mode
from lit_memopt.memory.blocks import LinearityError, count_blocks, estimate_with_blocks, truncated_blocks
from lit_memopt.models import ModelConfig
from lit_memopt.modules.sft import SFTModule

ARCH = {
    "model_type": "qwen3", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 192,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1,
}


def _fake_sft(blocks: int, **module_kwargs) -> SFTModule:
    with fake_mode():
        return SFTModule(ModelConfig(name="t", arch={**ARCH, "num_hidden_layers": blocks}), lr=1e-3, **module_kwargs)


def _batch(rows: int = 4, tokens: int = 48) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 384, (rows, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_extrapolated_peak_matches_a_full_trace(checkpointing: bool) -> None:
    batch = _batch()
    full = estimate_peak(_fake_sft(7, gradient_checkpointing=checkpointing), batch, optimizer_foreach=True)
    est = estimate_with_blocks(_fake_sft(3, gradient_checkpointing=checkpointing), batch, 7, optimizer_foreach=True)
    assert "checked with a trace of 3" in est.method and est.num_blocks == 7
    assert abs(est.peak_bytes - full.peak_bytes) <= 0.02 * full.peak_bytes, (est.peak_bytes, full.peak_bytes)
    assert est.peak_phase == full.peak_phase
    for phase, value in full.phase_peaks.items():
        assert abs(est.phase_peaks[phase] - value) <= 0.02 * value, (phase, est.phase_peaks, full.phase_peaks)
    for key, value in full.breakdown.items():
        assert abs(est.breakdown[key] - value) <= 0.02 * full.peak_bytes, (key, est.breakdown, full.breakdown)
    # the per-module table is kept and counts all 7 blocks
    rows = {m.name: m for m in est.modules}
    full_rows = {m.name: m for m in full.modules}
    assert rows["layers.*.mlp.down_proj"].count == 7
    assert rows["layers.*.mlp.down_proj"].parameter_bytes == full_rows["layers.*.mlp.down_proj"].parameter_bytes
    assert rows["layers.*.mlp.down_proj"].activation_bytes == full_rows["layers.*.mlp.down_proj"].activation_bytes
    # the reserved peak is extrapolated too, and close to a full replay of the allocator model: within
    # 5%, or two 2 MiB segments on a model this small, where one segment more or less is 15%
    assert est.reserved_peak_bytes >= est.peak_bytes
    assert abs(est.reserved_peak_bytes - full.reserved_peak_bytes) <= max(0.05 * full.reserved_peak_bytes, 4 << 20)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("period", [2, 3])
def test_every_kth_block_checkpointed_extrapolates_in_groups_of_k(period: int) -> None:
    """Every k-th block checkpointed: traces of k and 2k blocks (checked with 3k) give a 12-block step's peaks, which
    lie between no checkpointing and all of it; a step traced block by block (period 1) is not linear and refused."""
    batch = _batch()
    full = estimate_peak(_fake_sft(12, gradient_checkpointing=period), batch, optimizer_foreach=True)
    est = estimate_with_blocks(_fake_sft(3 * period, gradient_checkpointing=period), batch, 12, built_blocks=3 * period,
                               period=period, optimizer_foreach=True)
    assert f"blocks traced: {period} and {2 * period}" in est.method and f"checked with a trace of {3 * period}" in est.method
    for phase, value in full.phase_peaks.items():
        assert abs(est.phase_peaks[phase] - value) <= 0.001 * value, (phase, est.phase_peaks, full.phase_peaks)
    none = estimate_peak(_fake_sft(12), batch, optimizer_foreach=True)
    every = estimate_peak(_fake_sft(12, gradient_checkpointing=True), batch, optimizer_foreach=True)
    assert every.phase_peaks["forward"] < full.phase_peaks["forward"] < none.phase_peaks["forward"]
    with pytest.raises(LinearityError):  # blocks 1, 2, 3: checkpointed, not, checkpointed
        estimate_with_blocks(_fake_sft(3, gradient_checkpointing=2), batch, 12, optimizer_foreach=True)
    with pytest.raises(ValueError, match="period must be a positive integer dividing num_blocks=13"):
        estimate_with_blocks(_fake_sft(3 * period, gradient_checkpointing=period), batch, 13, period=period)


def test_gradient_checkpointing_takes_true_false_or_a_period() -> None:
    from lit_memopt.models.hf import checkpoint_period

    assert [checkpoint_period(v) for v in (False, True, 0, 1, 2, 5)] == [0, 1, 0, 1, 2, 5]
    for bad in (-1, 1.5, "2", None):
        with pytest.raises(ValueError, match="gradient_checkpointing must be true, false or k >= 2"):
            checkpoint_period(bad)
    with pytest.raises(ValueError, match="module.gradient_checkpointing must be"):
        _fake_sft(2, gradient_checkpointing=-2)
    module = _fake_sft(4, gradient_checkpointing=2)
    flags = [layer.gradient_checkpointing for layer in module.model.model.layers]
    assert flags == [True, False, True, False]


def test_truncation_restores_the_module() -> None:
    module = _fake_sft(3)
    params = sum(p.numel() for p in module.parameters())
    assert count_blocks(module, 3) == 1
    with truncated_blocks(module, 1, 3):
        assert len(module.model.model.layers) == 1 and module.model.config.num_hidden_layers == 1
        assert sum(p.numel() for p in module.parameters()) < params
    assert len(module.model.model.layers) == 3 and module.model.config.num_hidden_layers == 3
    assert sum(p.numel() for p in module.parameters()) == params


class _Quadratic(pl.LightningModule):
    """A step whose memory grows with the square of the block count: extrapolation must refuse it."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(blocks))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        n = len(self.layers)
        scratch = torch.ones(n * n, 4096, requires_grad=False)
        out = batch
        for layer in self.layers:
            out = layer(out)
        return out.sum() + scratch.sum() * 0

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_step_that_is_not_linear_in_the_blocks_is_refused() -> None:
    with fake_mode():
        module = _Quadratic(3)
    with pytest.raises(LinearityError, match="peak with 3 blocks"):
        estimate_with_blocks(module, torch.randn(2, 8), 12)
    with pytest.raises(ValueError, match="built_blocks"):
        estimate_with_blocks(module, torch.randn(2, 8), 12, built_blocks=5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_head_tiles_skipped_on_fake_tensors_leave_the_same_peak(monkeypatch) -> None:  # noqa: ANN001
    """Fake tensors trace the first two and the last tile of the fused head only: the peak must not change."""
    import lit_memopt.ops._head_tiles as tiles
    import lit_memopt.ops._head_passes as head  # where the tiled passes walk their tiles
    from lit_memopt.memory import peak_during
    from lit_memopt.ops import linear_logprobs_and_entropy

    def peak(skip: bool) -> int:
        with fake_mode():
            hidden = torch.randn(300, 64, requires_grad=True)
            weight = torch.randn(1000, 64, requires_grad=True)
            targets = torch.randint(0, 1000, (300,))

            def step() -> None:
                logp, ent = linear_logprobs_and_entropy(hidden, weight, targets, chunk_size=(64, 96))
                (logp.sum() + ent.sum()).backward()

            return peak_during(step, hidden, weight).peak_bytes

    sampled = peak(True)
    calls = []
    original = tiles.tile_starts

    def every_tile(start: int, stop: int, step: int, *, values: bool = True):  # noqa: ANN202
        calls.append(len(range(start, stop, step)))
        return original(start, stop, step, values=True)

    monkeypatch.setattr(head, "tile_starts", every_tile)
    assert peak(False) == sampled
    assert max(calls) > 3  # the full loop really had interior tiles to skip
    assert len(original(0, 1000, 96, values=False)) == 3 and list(original(0, 1000, 96)) == list(range(0, 1000, 96))


class _KinkAtOneBlock(pl.LightningModule):
    """A forward whose peak is a fixed scratch buffer with 1 block and the blocks' activations from 2 on."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(blocks))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        # more than one block's forward adds, less than two: alive only before the blocks run
        scratch = torch.ones(int(2.5 * batch.shape[0]), 64)
        out = batch + scratch[: batch.shape[0]].sum() * 0
        del scratch
        for layer in self.layers:
            out = torch.tanh(layer(out))
        return out.square().sum()

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_one_block_trace_off_the_line_moves_the_window_up() -> None:
    batch = torch.randn(4096, 64)
    with fake_mode():
        module = _KinkAtOneBlock(4)
    est = estimate_with_blocks(module, batch, 12, built_blocks=4)
    assert "blocks traced: 2 and 3" in est.method and "checked with a trace of 4" in est.method
    with fake_mode():
        full = estimate_peak(_KinkAtOneBlock(12), batch)
    assert est.phase_peaks == full.phase_peaks and est.peak_bytes == full.peak_bytes
    with fake_mode():
        three = _KinkAtOneBlock(3)
    with pytest.raises(LinearityError, match="peak with 3 blocks"):  # no 4th block to move to
        estimate_with_blocks(three, batch, 12)
