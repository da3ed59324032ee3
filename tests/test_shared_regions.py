"""Regions shared between the traces of a plan (``memory.replay``): a replayed region gives the estimate a traced one
gives, a region that cannot be replayed exactly is refused and runs in full, and the plan's traces of a generation
recipe give the same numbers with and without sharing."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lit_memopt.memory.replay import SharedRegions, module_fingerprint, shared_region
from lit_memopt.memory.step import estimate_peak

FILLER = 7  # the worst case's sampled token: the values mode follows the batch's ids through the step


class _StepWithRegion(pl.LightningModule):
    """A step whose region makes temporaries of several sizes (its peak is the step's) and returns ids that the
    step reads afterwards (``.item()``), the way a rollout's token ids are read; ``misbehave`` breaks one rule."""

    def __init__(self, misbehave: str = "") -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.misbehave = misbehave
        self.kept: list[torch.Tensor] = []
        self.calls = 0

    def region(self, ids: torch.Tensor, pool: list[torch.Tensor]) -> torch.Tensor | tuple:
        self.calls += 1
        a = torch.ones(64, 16)
        b = torch.ones(1024, 16)  # 64 KiB: above anything else the step holds
        del a
        out = ids * 2 + 1
        c = torch.zeros(8)
        del b
        if self.misbehave == "keeps":
            self.kept.append(c)
        if self.misbehave == "frees":
            pool.pop()
        if self.misbehave == "tuple":
            return out, out
        return out

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["ids"]
        pool = [torch.ones(32)]
        out = shared_region("toy", lambda: self.region(ids, pool), inputs=(ids,),
                            key=lambda: module_fingerprint(self.lin))
        if isinstance(out, tuple):
            out = out[0]
        rows = int(out.max().item())  # a value the replay must give back
        return self.lin(torch.randn(rows, 16)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _numbers(est) -> tuple:  # noqa: ANN001
    return est.peak_bytes, est.reserved_peak_bytes, est.phase_peaks, est.phase_breakdowns, est.worst_case_tokens


def _estimate(batch: dict, regions: SharedRegions | None = None, misbehave: str = "") -> tuple:
    holder: list[_StepWithRegion] = []

    def build() -> _StepWithRegion:
        holder.append(_StepWithRegion(misbehave))
        return holder[0]

    est = estimate_peak(build, batch, worst_case_filler=FILLER, shared_regions=regions)
    return est, holder[0].calls


def test_a_replayed_region_gives_the_traced_estimate() -> None:
    batch = {"ids": torch.arange(6).reshape(2, 3)}
    plain, calls = _estimate(batch)
    assert calls == 1
    regions = SharedRegions()
    recorded, calls_recorded = _estimate(batch, regions)
    replayed, calls_replayed = _estimate(batch, regions)
    assert (calls_recorded, calls_replayed) == (1, 0), "the second trace must not run the region"
    assert (regions.recorded, regions.replayed, regions.refused) == (1, 1, [])
    assert _numbers(recorded) == _numbers(plain) and _numbers(replayed) == _numbers(plain)
    # the region's 64 KiB temporary is the step's peak: the replay had to make it again
    assert plain.peak_bytes >= 1024 * 16 * 4 and plain.reserved_peak_bytes >= plain.peak_bytes
    # the ids' values came back: the step read max(ids * 2 + 1) = 11 rows for its forward
    assert plain.phase_peaks == replayed.phase_peaks


def test_other_input_values_are_another_key() -> None:
    regions = SharedRegions()
    _estimate({"ids": torch.arange(6).reshape(2, 3)}, regions)
    other = {"ids": torch.arange(6).reshape(2, 3) + 40}  # 91 rows after the region, not 11
    shared, calls = _estimate(other, regions)
    assert calls == 1 and regions.recorded == 2 and regions.replayed == 0
    assert _numbers(shared) == _numbers(_estimate(other)[0])


@pytest.mark.parametrize(("misbehave", "reason"), [
    ("keeps", "it left 1 more tensor(s) alive than its output"),
    ("frees", "it freed a tensor made before it"),
    ("tuple", "it returned a tuple, not one tensor"),
])
def test_a_region_that_cannot_be_replayed_exactly_is_refused_and_runs(misbehave: str, reason: str) -> None:
    batch = {"ids": torch.arange(6).reshape(2, 3)}
    plain, _ = _estimate(batch, misbehave=misbehave)
    regions = SharedRegions()
    first, calls_first = _estimate(batch, regions, misbehave)
    second, calls_second = _estimate(batch, regions, misbehave)
    assert (calls_first, calls_second) == (1, 1)
    assert regions.recorded == 0 and regions.replayed == 0 and len(regions) == 0
    assert regions.refused == [f"toy: {reason}"]
    assert _numbers(first) == _numbers(plain) and _numbers(second) == _numbers(plain)


def test_outside_a_shared_trace_the_region_is_the_call() -> None:
    calls: list[int] = []
    out = shared_region("plain", lambda: calls.append(1) or torch.ones(3), key=lambda: 1 / 0)  # key never computed
    assert calls == [1] and out.tolist() == [1.0, 1.0, 1.0]


def test_module_fingerprint_sees_what_changes_a_rollout() -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    def model(layers: int = 2, **kwargs) -> torch.nn.Module:  # noqa: ANN003
        config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8, **kwargs)
        return AutoModelForCausalLM.from_config(config)

    base = module_fingerprint(model())
    assert module_fingerprint(model()) == base
    assert module_fingerprint(model(layers=3)) != base  # another block count
    assert module_fingerprint(model().to(torch.bfloat16)) != base
    frozen = model()
    frozen.model.embed_tokens.weight.requires_grad_(False)
    assert module_fingerprint(frozen) != base
    evaluating = model().eval()
    assert module_fingerprint(evaluating) != base
    # transformers' activation checkpointing: measured to change what generate leaves alive (six more tensors)
    checkpointing = model()
    checkpointing.gradient_checkpointing_enable()
    assert module_fingerprint(checkpointing.eval()) != module_fingerprint(model().eval())
    assert module_fingerprint(model(use_cache=False)) != base


def test_a_plans_traces_of_a_generation_recipe_give_the_same_numbers_shared() -> None:
    """Intuitor's tiny step (its rollouts are ``rollout.generate``), traced by a plan's tracer as given, as one
    micro-batch of several (gradients live from the start), and with checkpointing, with shared rollouts and without:
    the same estimates. The accumulating trace replays the rollout of the first; checkpointing is another key
    (transformers' checkpointing turns ``use_cache`` off in the config), recorded too."""
    from lit_memopt import cli
    from lit_memopt.cli_plan import PlanTracer

    cfg = cli.compose_config(["recipe=intuitor", "module.warm_start.steps=0", "module.max_new_tokens=6",
                              "plan.device=cpu", "safety_margin=0"])
    settings = [(False, False), (False, True), (True, False)]  # (checkpointing, accumulating)

    methods: list[str] = []

    def traced(share: bool) -> tuple[list[tuple], SharedRegions]:
        tracer = PlanTracer(cfg, cpu_target=True)
        if not share:
            tracer.shared_regions = SharedRegions(share=False, stretch=False)
        try:
            shape = tracer.recipe_shape(4)
            estimates = [tracer(ckpt, shape.rows, acc) for ckpt, acc in settings]
            methods.extend(est.method for est in estimates)
            return [_numbers(est) for est in estimates], tracer.shared_regions
        finally:
            tracer.close()

    plain, _ = traced(False)
    shared, regions = traced(True)
    assert shared == plain
    # the reserved figures come from stitched logs, shared or not: a replayed rollout keeps the log segments its
    # model calls start (else its probes' logs do not align with a traced one's and the line is used)
    assert all("allocation log stitched from the probes'" in m for m in methods), methods
    # one rollout per block count traced in this process (a trace run in a forked copy records there, not here):
    # the first setting's recorded, the second's replayed, the checkpointed one another key (recorded)
    counts = (regions.recorded, regions.replayed, regions.refused)
    assert regions.replayed >= 1 and regions.recorded == 2 * regions.replayed and regions.refused == [], counts
