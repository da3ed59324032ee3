"""A long loop stretched from three short probes (``memory.stretch``): the estimate it gives is the one tracing the
whole loop gives, a loop whose steps are not regular is refused and traced in full, and the probes leave nothing
behind in the step's numbers."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lit_memopt.memory.replay import Repeats, SharedRegions, shared_region
from lit_memopt.memory.step import estimate_peak

FILLER = 7


class _Loop(pl.LightningModule):
    """A step whose region is a decoding-like loop: each step runs ``marker``, appends a row block to a cache (a new,
    larger storage, the old one freed) and a column to the ids; ``irregular`` makes the 8th step allocate more."""

    def __init__(self, steps: int, irregular: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.marker = torch.nn.Identity()
        self.steps, self.irregular = steps, irregular
        self.loops: list[int] = []

    def loop(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        self.loops.append(n)
        cache = torch.zeros(0, 8)
        x = torch.ones(4, 8)
        for t in range(n):
            x = self.marker(x)
            cache = torch.cat([cache, self.lin(x)])
            if self.irregular and t == 7:
                spike = torch.ones(4096)
                del spike
            ids = torch.cat([ids, torch.full((ids.shape[0], 1), FILLER)], dim=1)
        return ids

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["ids"]
        with torch.no_grad():
            out = shared_region("loop", lambda: self.loop(ids, self.steps), inputs=(ids,),
                                repeats=Repeats(self.steps, lambda k: self.loop(ids, k), self.marker))
        rows = int(out[0, -1].item()) + out.shape[1]  # values and length the stretched output must give back
        return self.lin(torch.ones(rows, 8)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _numbers(est) -> tuple:  # noqa: ANN001
    return est.peak_bytes, est.reserved_peak_bytes, est.phase_peaks, est.phase_breakdowns, est.worst_case_tokens


def _estimate(steps: int, regions: SharedRegions, irregular: bool = False) -> tuple:
    holder: list[_Loop] = []

    def build() -> _Loop:
        holder.append(_Loop(steps, irregular))
        return holder[0]

    est = estimate_peak(build, {"ids": torch.arange(6).reshape(2, 3)}, worst_case_filler=FILLER, shared_regions=regions)
    return est, holder[0].loops


@pytest.mark.parametrize("steps", [9, 25, 60])
def test_a_stretched_loop_gives_the_traced_estimate(steps: int) -> None:
    full, loops = _estimate(steps, SharedRegions(share=False, stretch=False))
    assert loops == [steps]
    regions = SharedRegions()
    stretched, probes = _estimate(steps, regions)
    assert probes == [6, 7, 8], "only the probes run"
    assert (regions.stretched, regions.refused) == (1, [])
    assert _numbers(stretched) == _numbers(full)
    # the loop's cache is the step's peak, and grows with its length: the stretch had to make it
    assert _numbers(full) != _numbers(_estimate(8, SharedRegions(share=False, stretch=False))[0])


def test_a_loop_with_an_irregular_step_is_refused_and_traced_in_full() -> None:
    full, _ = _estimate(20, SharedRegions(share=False, stretch=False), irregular=True)
    regions = SharedRegions()
    est, loops = _estimate(20, regions, irregular=True)
    assert loops == [6, 7, 8, 20]
    assert regions.stretched == 0
    assert regions.refused == ["loop (stretched): its events at 8 steps are not those the shorter runs predict"]
    assert _numbers(est) == _numbers(full), "the probes left something in the step's numbers"


def test_a_short_loop_runs_as_it_is() -> None:
    regions = SharedRegions()
    _, loops = _estimate(8, regions)
    assert loops == [8] and regions.stretched == 0


_TRACE = """
import sys
from lit_memopt import cli
from lit_memopt.cli_plan import PlanTracer
from lit_memopt.memory.replay import SharedRegions
checkpointing, stretch = sys.argv[1] == "1", sys.argv[2] == "1"
cfg = cli.compose_config(["recipe=intuitor", "module.warm_start.steps=0", "module.max_new_tokens=14",
                          "plan.device=cpu", "safety_margin=0"])
tracer = PlanTracer(cfg, cpu_target=True)
tracer.shared_regions = SharedRegions() if stretch else SharedRegions(share=False, stretch=False)
e = tracer(checkpointing, tracer.recipe_shape(4).rows, False)
r = tracer.shared_regions
print(repr((e.peak_bytes, e.reserved_peak_bytes, e.phase_peaks, e.phase_breakdowns, e.worst_case_tokens, r.stretched,
            r.refused)), flush=True)
# The interpreter's teardown releases the traced module too: a crash there (a deep copy's fake mode released its
# storages' weak references twice, see FastFakeTensorMode.__deepcopy__) fails the test.
"""


@pytest.mark.parametrize("checkpointing", [False, True])
def test_intuitors_rollouts_stretched_give_the_traced_estimate(checkpointing: bool) -> None:
    """The tiny Intuitor recipe's step (its rollouts are ``rollout.generate``, 14 new tokens), through a plan's tracer,
    with transformers' activation checkpointing and without: the same numbers stretched and traced in full. Each
    trace runs in a process of its own: building a second tracer in a process after a checkpointed trace of 30 new
    tokens crashed the interpreter (a segmentation fault), with stretching and without, before it too."""
    import ast
    import subprocess
    import sys

    def traced(stretch: bool) -> tuple:
        done = subprocess.run([sys.executable, "-c", _TRACE, str(int(checkpointing)), str(int(stretch))],
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return ast.literal_eval(done.stdout.strip().splitlines()[-1])

    stretched, full = traced(True), traced(False)
    assert stretched[:5] == full[:5]
    assert stretched[5] >= 1 and stretched[6] == [] and full[5] == 0


def test_a_sliding_window_cache_is_never_stretched() -> None:
    """Its memory stops growing at the window, which probes of 6 to 8 tokens cannot see: ``generate`` passes no
    ``Repeats`` for such a model."""
    from transformers import Qwen2Config, Qwen3Config

    from lit_memopt.modules.rollout import _sliding_window

    def model(config: object) -> torch.nn.Module:
        m = torch.nn.Module()
        m.config = config
        return m

    small = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    assert not _sliding_window(model(Qwen3Config(**small)))
    assert _sliding_window(model(Qwen2Config(**small, use_sliding_window=True, sliding_window=4, max_window_layers=0)))
    assert _sliding_window(model(Qwen3Config(**small, layer_types=["sliding_attention", "full_attention"])))
    assert not _sliding_window(torch.nn.Linear(2, 2))


def test_what_a_measured_stretch_leaves_behind_stays_in_the_log() -> None:
    from lit_memopt.memory.tracker import StepTracker, net_events, snapshot_total

    assert net_events([(1, "a", 8), (1, "b", 4), (-1, "a", 8), (-1, "old", 2), (1, "a", 16)]) == [
        (1, "b", 4), (-1, "old", 2), (1, "a", 16)]
    tracker = StepTracker(record_allocations=True)
    with tracker:
        before = torch.ones(1000)
        saved = tracker.save_counts()
        kept = torch.ones(2000)  # made in the measured stretch, still live after it
        scratch = torch.ones(3000)
        del scratch, before  # freed in it: one made in it, one made before it
        tracker.restore_counts(saved)
        after = torch.ones(10)
        live = snapshot_total(tracker.current_snapshot)
        logged = sum(sign * nbytes for sign, _, nbytes in tracker.allocation_log)
    assert logged == live == kept.untyped_storage().nbytes() + after.untyped_storage().nbytes()
