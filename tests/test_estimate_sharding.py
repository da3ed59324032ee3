"""Per-rank estimates (``memory.sharding``) against a real 2-process FSDP2 run (gloo, CPU) measured with memory_budget."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from _ranks import free_port, run_ranks

from lit_memopt.memory.sharding import per_rank_estimate
from lit_memopt.memory.step import PeakEstimate, within_device
from lit_memopt.memory.tracker import ModuleMemory

WORLD = 2
# The embedded tiny model with 2 blocks (a full trace) on a batch large enough for activations to matter.
OVERRIDES = ["recipe=sft", "trainer=fsdp2", f"trainer.devices={WORLD}", "trainer.accelerator=cpu",
             "model.arch.num_hidden_layers=2", "data.batch_size=8"]


def _compose(*extra: str):  # noqa: ANN202
    from omegaconf import open_dict

    from lit_memopt.cli import compose_config

    cfg = compose_config([*OVERRIDES, *extra])
    with open_dict(cfg):  # no run directory: no logger, no callbacks
        cfg.logger = None
        cfg.callbacks = None
    return cfg


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    from datetime import timedelta

    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_memopt.cli import instantiate_run
    from lit_memopt.memory import memory_budget
    from lit_memopt.memory.batch import batch_tensors
    from lit_memopt.memory.budget import storage_bytes

    class PeakOfSecondStep(Callback):
        """Per-rank peak of batch 1 (the Adam moments exist by then), measured from its start to its end."""

        def __init__(self) -> None:
            self.peak: int | None = None
            self._probe = None

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            for opt in trainer.optimizers:  # as the estimate: CUDA's default foreach AdamW
                for group in opt.param_groups:
                    group["foreach"] = True

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx != 1:
                return
            # Lightning zeroes gradients after the forward; the estimate's step starts without them.
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
            baseline = storage_bytes(pl_module, *trainer.optimizers, *batch_tensors(batch))
            self._probe = memory_budget(None, baseline_bytes=baseline)
            self._probe.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == 1 and self._probe is not None:
                self._probe.__exit__(None, None, None)
                self.peak = int(self._probe.peak_bytes)

    cfg = _compose()
    run = instantiate_run(cfg)
    probe = PeakOfSecondStep()
    strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, timeout=timedelta(seconds=60))
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=2, callbacks=[probe], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(run.module, datamodule=run.datamodule)
    torch.save({"peak": probe.peak}, Path(out_dir) / f"rank{rank}.pt")


def _run_two_ranks(out_dir: Path, timeout_s: float) -> list[int]:
    failure = run_ranks(_worker, (free_port(), str(out_dir)), nprocs=WORLD, timeout_s=timeout_s)
    assert failure is None, f"the 2-process FSDP2 run: {failure}"
    return [torch.load(out_dir / f"rank{r}.pt")["peak"] for r in range(WORLD)]


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp2_per_rank_estimate_matches_a_two_process_run(tmp_path: Path) -> None:
    from lit_memopt.cli_estimate import estimate_recipe

    report = estimate_recipe(_compose())
    assert report.per_rank == ("fsdp2", WORLD)
    est = report.estimate
    assert "per rank of 2 (fsdp2)" in est.method and est.breakdown["communication"] > 0
    traced = estimate_recipe(_compose("trace_rank=true")).estimate
    assert "traced as rank 0 of 2" in traced.method
    peaks = _run_two_ranks(tmp_path, timeout_s=240)
    print(f"measured per rank {peaks}, arithmetic {est.peak_bytes}, traced rank {traced.peak_bytes}")
    for rank, measured in enumerate(peaks):
        assert measured is not None and measured > 0
        assert abs(est.peak_bytes - measured) <= 0.10 * measured, (rank, est.peak_bytes, measured, est.breakdown)
        # the traced rank runs FSDP2's own code: off only by the one-device estimator's fake/real difference
        assert abs(traced.peak_bytes - measured) <= 0.04 * measured, (rank, traced.peak_bytes, measured)


def _single_device() -> PeakEstimate:
    mib = 2**20
    forward = {"parameters": 100 * mib, "gradients": 0, "optimizer_state": 200 * mib, "activations": 50 * mib,
               "temporaries": 5 * mib, "other": mib}
    backward = {**forward, "gradients": 60 * mib, "activations": 20 * mib}
    step = {**forward, "gradients": 100 * mib, "activations": 0, "temporaries": 100 * mib}
    phases = {"forward": forward, "backward": backward, "optimizer step": step}
    peaks = {p: sum(b.values()) for p, b in phases.items()}
    # 4 blocks of 20 MiB, 20 MiB of root group (embeddings, norm, head)
    modules = [ModuleMemory("model.layers.*", 4, 80 * mib, 0, 0, 0, False)]
    return PeakEstimate(peak_bytes=max(peaks.values()), breakdown=dict(step), peak_phase="optimizer step",
                        phase_peaks=peaks, modules=modules, batch_size=1, seq_len=8, fake=True, seconds=0.0,
                        phase_breakdowns=phases, reserved_peak_bytes=max(peaks.values()) + 10 * mib)


def test_sharding_arithmetic_by_phase() -> None:
    mib = 2**20
    single = _single_device()
    fsdp = per_rank_estimate(single, "fsdp2", 4)
    fwd = fsdp.phase_breakdowns["forward"]
    assert fwd["parameters"] == 25 * mib and fwd["optimizer_state"] == 50 * mib and fwd["activations"] == 50 * mib
    # the root group (20 MiB) and two blocks (20 MiB each) whole, less the quarter already counted as local shards
    assert fwd["communication"] == 60 * mib - 15 * mib
    bwd = fsdp.phase_breakdowns["backward"]
    # + the root's and the current block's whole gradients (40 MiB, capped by the 60 MiB that exist), less their shard
    assert bwd["gradients"] == 15 * mib and bwd["communication"] == 45 * mib + 30 * mib
    opt = fsdp.phase_breakdowns["optimizer step"]
    assert opt["communication"] == 0 and opt["temporaries"] == 25 * mib and opt["gradients"] == 25 * mib
    assert fsdp.peak_bytes == max(sum(b.values()) for b in fsdp.phase_breakdowns.values())
    assert fsdp.reserved_peak_bytes == fsdp.peak_bytes + 10 * mib
    ddp = per_rank_estimate(single, "ddp", 4)
    for phase, b in ddp.phase_breakdowns.items():
        assert b["communication"] == 100 * mib  # gradient buckets
        assert b["parameters"] == 100 * mib
    assert ddp.peak_bytes == single.peak_bytes + 100 * mib
    assert per_rank_estimate(single, "fsdp2", 1).phase_peaks["optimizer step"] == single.phase_peaks["optimizer step"]
    with pytest.raises(ValueError, match="strategy"):
        per_rank_estimate(single, "zero3", 4)
    with pytest.raises(ValueError, match="world_size"):
        per_rank_estimate(single, "fsdp2", 0)


def test_a_device_size_is_judged_per_rank() -> None:
    """The one-device trace's reserved line passes its device; per rank the same overhead over the live bytes is
    judged again: an FSDP2 rank within the device keeps the line's overhead (its allocator need not release), a DDP
    rank past it runs within it where its least device fits, and is reported at that least device where not."""
    mib = 2**20
    single = _single_device()  # peak 506 MiB (the optimizer step), line 516 MiB
    single = dataclasses.replace(single, reserved_peak_bytes=single.peak_bytes + 300 * mib,
                                 least_reserved_bytes=single.peak_bytes + 20 * mib, device_bytes=single.peak_bytes + 150 * mib)
    assert within_device(single).reserved_peak_bytes == single.device_bytes  # one device: the line passes, least fits
    fsdp = per_rank_estimate(single, "fsdp2", 4)
    assert fsdp.reserved_peak_bytes == fsdp.peak_bytes + 300 * mib <= single.device_bytes
    assert fsdp.least_reserved_bytes == fsdp.peak_bytes + 20 * mib and "releases" not in fsdp.method
    ddp = per_rank_estimate(single, "ddp", 4)  # + 100 MiB of buckets: 806 MiB line past the 656 MiB device
    assert ddp.least_reserved_bytes == single.peak_bytes + 120 * mib <= single.device_bytes
    assert ddp.reserved_peak_bytes == single.device_bytes and "releases its cached segments" in ddp.method
    tight = per_rank_estimate(dataclasses.replace(single, device_bytes=single.peak_bytes + 110 * mib), "ddp", 4)
    assert tight.reserved_peak_bytes == tight.least_reserved_bytes == single.peak_bytes + 120 * mib
    assert "more than the device's" in tight.method
    # without a device size nothing is judged: the line's figure per rank, as before
    unlimited = per_rank_estimate(dataclasses.replace(single, device_bytes=None, least_reserved_bytes=None), "ddp", 4)
    assert unlimited.reserved_peak_bytes == ddp.peak_bytes + 300 * mib


def test_cli_rejects_devices_it_cannot_count(capsys) -> None:  # noqa: ANN001
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_estimate import data_parallel_plan

    assert data_parallel_plan(compose_config(["recipe=sft", "trainer=ddp", "trainer.devices=8"])) == ("ddp", 8)
    assert data_parallel_plan(compose_config(["recipe=sft", "trainer=fsdp2", "trainer.devices=4", "trainer.num_nodes=2"])) == ("fsdp2", 8)
    assert data_parallel_plan(compose_config(["recipe=sft"])) is None
    for bad in ("auto", "0", "-1"):
        with pytest.raises(ValueError, match=r"trainer.devices must be a positive integer .*e.g. trainer.devices=8"):
            data_parallel_plan(compose_config(["recipe=sft", "trainer=fsdp2", f"trainer.devices={bad}"]))


def test_cpu_offload_keeps_model_state_off_the_device() -> None:
    """FSDP2 with CPUOffloadPolicy: what the module docstring of ``memory.sharding`` says each phase holds."""
    mib = 2**20
    single = _single_device()
    for world in (1, 4):
        sharded = per_rank_estimate(single, "fsdp2", world)
        offloaded = per_rank_estimate(single, "fsdp2", world, cpu_offload=True)
        assert offloaded.peak_bytes < sharded.peak_bytes, (world, offloaded.phase_peaks, sharded.phase_peaks)
        assert offloaded.reserved_peak_bytes == offloaded.peak_bytes + 10 * mib  # the allocator's overhead is kept
        assert "cpu offload" in offloaded.method and "runs on the host" in offloaded.method
        for phase, rows in offloaded.phase_breakdowns.items():
            # between uses parameters, gradients and optimizer state are sharded in host memory
            assert rows["parameters"] == rows["gradients"] == rows["optimizer_state"] == 0, (phase, rows)
            # what compute holds is unchanged
            assert rows["activations"] == single.phase_breakdowns[phase]["activations"]
            assert rows["other"] == single.phase_breakdowns[phase]["other"]
        assert offloaded.peak_bytes == max(sum(b.values()) for b in offloaded.phase_breakdowns.values())

    offloaded = per_rank_estimate(single, "fsdp2", 4, cpu_offload=True)
    fwd, bwd, opt = (offloaded.phase_breakdowns[p] for p in ("forward", "backward", "optimizer step"))
    # the root group (20 MiB) and two blocks (20 MiB each) gathered whole, plus the two blocks' shards being copied in
    assert fwd["communication"] == 20 * mib + 40 * mib + 10 * mib
    assert fwd["temporaries"] == 5 * mib
    # + the root's and the current block's whole gradients (40 MiB, capped by the 60 MiB that exist) and their
    # reduce-scatter shard (a quarter) until it is copied out
    assert bwd["communication"] == 70 * mib + 40 * mib + 10 * mib
    # the optimizer step runs on the host: neither model state nor the update's temporaries on the device
    assert opt == {**single.phase_breakdowns["optimizer step"], "parameters": 0, "gradients": 0, "optimizer_state": 0,
                   "temporaries": 0, "communication": 0}
    assert offloaded.peak_phase == "backward"
    # the host holds one rank's shards of parameters, gradients, optimizer state and the step's temporaries
    assert "125.0 MiB per rank" in offloaded.method

    # the existing signature keeps its meaning; offload is FSDP2's only
    assert per_rank_estimate(single, "fsdp2", 4, cpu_offload=False) == per_rank_estimate(single, "fsdp2", 4)
    with pytest.raises(ValueError, match="cpu_offload is FSDP2's"):
        per_rank_estimate(single, "ddp", 4, cpu_offload=True)
    with pytest.raises(ValueError, match="cpu_offload must be a bool"):
        per_rank_estimate(single, "fsdp2", 4, cpu_offload="yes")  # type: ignore[arg-type]


def test_frozen_models_kept_whole_on_every_rank() -> None:
    # 40 of the 100 MiB of parameters are a frozen reference the method does not shard: 2 of its 4 blocks rows'
    # worth of blocks are the reference's, so the policy's blocks are 40 MiB and its root 20 MiB
    mib = 2**20
    single = _single_device()
    plain = per_rank_estimate(single, "fsdp2", 4)
    kept = per_rank_estimate(single, "fsdp2", 4, replicated_bytes=40 * mib)
    for phase, b in kept.phase_breakdowns.items():
        assert b["parameters"] == 15 * mib + 40 * mib, phase  # a quarter of the policy's 60 MiB, the reference whole
        assert b["optimizer_state"] == plain.phase_breakdowns[phase]["optimizer_state"]
    assert kept.peak_bytes > plain.peak_bytes and "kept whole on every rank: 40.0 MiB" in kept.method
    offloaded = per_rank_estimate(single, "fsdp2", 4, cpu_offload=True, replicated_bytes=40 * mib)
    for phase, b in offloaded.phase_breakdowns.items():
        assert b["parameters"] == 40 * mib and b["gradients"] == 0 and b["optimizer_state"] == 0, phase
    # DDP replicates everything anyway: the argument changes nothing
    assert per_rank_estimate(single, "ddp", 4, replicated_bytes=40 * mib).phase_breakdowns == \
        per_rank_estimate(single, "ddp", 4).phase_breakdowns
    with pytest.raises(ValueError, match="replicated_bytes"):
        per_rank_estimate(single, "fsdp2", 4, replicated_bytes=200 * mib)


def test_grade_names_its_reference_and_reward_model_as_replicated() -> None:
    from lit_memopt.cli import compose_config, instantiate_run
    from lit_memopt.cli_fake_run import step_config
    from lit_memopt.models.sharding import decoder_blocks, replicated_parameter_bytes

    module = instantiate_run(step_config(compose_config(["recipe=grade"]))).module

    def size(m: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    assert module.fsdp2_replicated == ("reference", "reward_model")
    built = replicated_parameter_bytes(module)
    assert built == size(module.reference) + size(module.reward_model) > 0
    blocks = decoder_blocks(module.reference)
    # at twice the depth the reference counts its blocks twice (the estimator's fake module is built shallower)
    assert replicated_parameter_bytes(module, 2 * len(blocks)) == built + sum(size(b) for b in blocks)


def test_estimate_reads_the_offload_switch_and_refuses_it_where_it_means_nothing() -> None:
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_estimate import data_parallel_plan, strategy_cpu_offload

    def offload(*overrides: str) -> bool:
        cfg = compose_config(["recipe=sft", *overrides])
        return strategy_cpu_offload(cfg, data_parallel_plan(cfg))

    assert offload("trainer=fsdp2", "trainer.strategy.cpu_offload=true") is True
    assert offload("trainer=fsdp2") is False and offload() is False
    with pytest.raises(ValueError, match=r"cpu_offload must be true or false, got 'yes'"):
        offload("trainer=fsdp2", "trainer.strategy.cpu_offload=yes")
    with pytest.raises(ValueError, match=r"cpu_offload is FSDP2's; use it with trainer=fsdp2"):
        offload("trainer=ddp", "+trainer.strategy.cpu_offload=true")


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp2_estimate_keeps_grades_frozen_models_whole_on_every_rank() -> None:
    """GRADE's reference copy and reward model are not sharded by ``configure_model``: the per-rank parameters are
    the policy's shard plus both frozen models whole, as ``plan`` counts them."""
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_estimate import estimate_recipe

    base = ["recipe=grade", "module.max_new_tokens=4", "check_linearity=false"]
    single = estimate_recipe(compose_config(base)).estimate
    report = estimate_recipe(compose_config([*base, "trainer=fsdp2", "trainer.devices=2"]))
    assert report.per_rank == ("fsdp2", 2) and "frozen models kept whole on every rank" in report.estimate.method
    params = single.phase_breakdowns["optimizer step"]["parameters"]
    rank = report.estimate.phase_breakdowns["optimizer step"]["parameters"]
    replicated = 2 * rank - params  # rank = (params - replicated) / 2 + replicated
    assert 0 < replicated < params and abs(rank - (-(-(params - replicated) // 2) + replicated)) <= 1
