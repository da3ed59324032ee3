"""FSDP2 with CPU offload (``trainer=fsdp2 trainer.strategy.cpu_offload=true``: torch's ``CPUOffloadPolicy``).

The SFT recipe on two gloo ranks trains to the very weights of the same run without offload, and a callback reads,
inside the run, what FSDP2 really did: every parameter group carries the offload policy and every sharded parameter
and optimizer state lives in host memory. The pack's strategy keeps Lightning's class name (the checks that
recognise FSDP2 by name still do), refuses a non-bool switch in one line, and the step-time model prices offload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import free_port
from _resume import kill_all, largest_difference, weights
from lightning.pytorch import Callback

TESTS = Path(__file__).resolve().parent
STEPS = 2
# The embedded tiny Qwen3 with 2 blocks, a short epoch, no validation and no memory report (its plots take seconds).
# The run's final checkpoint (sharded: offloaded state goes through a save) holds the weights compared.
FSDP2_RUN = ["fit", "recipe=sft", "trainer=fsdp2", "trainer.devices=2", "trainer.accelerator=cpu",
             "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"trainer.max_steps={STEPS}",
             "trainer.limit_val_batches=0", "trainer.val_check_interval=null", "trainer.log_every_n_steps=1",
             "model.arch.num_hidden_layers=2", "data.num_train=64", "data.num_val=16", "~callbacks.memory_monitor"]


class OffloadProbe(Callback):
    """Writes ``<out>/rank<N>.json`` at the end of training: what FSDP2 holds where, read from its own state."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.initial: float | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.initial = _digest(pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        from lit_memopt._compat.distributed import fsdp_param_groups

        groups = [g for m in pl_module.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups(m)]
        fsdp_params = [p for g in groups for p in g.fsdp_params]
        optimizer = trainer.optimizers[0]
        states = [v for s in optimizer.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v)]
        report = {
            "strategy": type(trainer.strategy).__name__,
            "cpu_offload": getattr(trainer.strategy, "cpu_offload", None),
            "policies": sorted({type(g.offload_policy).__name__ for g in groups}),
            "pin_memory": sorted({bool(getattr(g.offload_policy, "pin_memory", False)) for g in groups}),
            "offload_flags": sorted({bool(p.offload_to_cpu) for p in fsdp_params}),
            "sharded_parameters": len(fsdp_params),
            "parameters": sum(1 for _ in pl_module.parameters()),
            "dtensor_parameters": sum(isinstance(p, DTensor) for p in pl_module.parameters()),
            "parameter_devices": sorted({p.to_local().device.type for p in pl_module.parameters() if isinstance(p, DTensor)}),
            "pinned": sorted({p.to_local().is_pinned() for p in pl_module.parameters() if isinstance(p, DTensor)}),
            "states": len(states),
            "state_devices": sorted({(v.to_local() if isinstance(v, DTensor) else v).device.type for v in states}),
            "initial": self.initial,
            "final": _digest(pl_module),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def _digest(module: Any) -> float:
    """A sum over this rank's parameter shards: it moves when the weights do."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return sum(float((p.to_local() if isinstance(p, DTensor) else p).double().abs().sum()) for p in module.parameters())


def _launch(args: list[str], cwd: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``lit-memopt ARGS`` in its own session (its ranks are killed together), with this folder on the import path
    (for :class:`OffloadProbe`) and a port of its own (two runs at once)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **env)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "lit_memopt", *args], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _run_both(runs: dict[str, list[str]], tmp_path: Path, timeout_s: float, env: dict[str, str] | None = None) -> None:
    """Start every run at once; fail (killing them all) when one fails or any still runs after ``timeout_s``."""
    processes = {name: _launch(args, tmp_path, tmp_path / f"{name}.log", env or {}) for name, args in runs.items()}
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in processes.values()):
            failed = [n for n, p in processes.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"{failed[0]} failed" if failed else f"still running after {timeout_s:g} s"
                name = failed[0] if failed else next(n for n, p in processes.items() if p.poll() is None)
                pytest.fail(f"{why}:\n{(tmp_path / f'{name}.log').read_text()[-4000:]}")
            time.sleep(0.1)
    finally:
        for process in processes.values():
            if process.poll() is None:
                kill_all(process)
    for name, process in processes.items():
        assert process.returncode == 0, (tmp_path / f"{name}.log").read_text()[-4000:]


def _probe(run: str, out: Path) -> list[str]:
    return [f"+callbacks.offload_probe._target_={__name__}.OffloadProbe", f"+callbacks.offload_probe.out={out}",
            f"hydra.run.dir={run}"]


def _reports(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _losses(run: Path) -> list[float]:
    import csv

    rows = csv.DictReader((next(run.glob("logs/version_*")) / "metrics.csv").open())
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sft_with_cpu_offload_trains_to_the_weights_of_the_run_without(tmp_path: Path) -> None:
    """Two 2-rank runs at once (gloo), offloaded and not."""
    _run_both({
        "resident": [*FSDP2_RUN, "trainer.strategy.cpu_offload=false", *_probe(tmp_path / "resident", tmp_path / "probe_r")],
        "offload": [*FSDP2_RUN, "trainer.strategy.cpu_offload=true", *_probe(tmp_path / "offload", tmp_path / "probe_o")],
    }, tmp_path, timeout_s=200)

    for report in _reports(tmp_path / "probe_o", 2):
        assert report["strategy"] == "ModelParallelStrategy" and report["cpu_offload"] is True, report
        # every fully_shard call got the policy, and FSDP2 copies every parameter in and out of host memory
        assert report["policies"] == ["CPUOffloadPolicy"] and report["pin_memory"] == [False], report  # no CUDA here
        assert report["offload_flags"] == [True], report
        assert report["sharded_parameters"] == report["parameters"] == report["dtensor_parameters"] > 0, report
        assert report["parameter_devices"] == ["cpu"] and report["state_devices"] == ["cpu"], report
        assert report["states"] == 2 * report["parameters"], report  # AdamW's two moments per (trainable) parameter
        assert report["final"] != report["initial"], report  # the weights moved: equality below is not vacuous
    for report in _reports(tmp_path / "probe_r", 2):  # the same probe sees no offload without the switch
        assert report["cpu_offload"] is False and report["policies"] == ["OffloadPolicy"], report
        assert report["offload_flags"] == [False], report

    last = f"step_{STEPS:06d}.ckpt"
    resident, offload = tmp_path / "resident" / "checkpoints" / last, tmp_path / "offload" / "checkpoints" / last
    assert offload.is_dir()  # a sharded checkpoint of offloaded state
    a, b = weights(resident), weights(offload)
    assert a.keys() == b.keys()
    for key in a:  # offload only moves where tensors live: the same float32 maths, bit for bit
        assert torch.equal(a[key], b[key]), (key, (a[key] - b[key]).abs().max().item())
    losses = _losses(tmp_path / "resident")
    assert len(losses) == STEPS and _losses(tmp_path / "offload") == losses


def test_the_fsdp2_trainer_builds_the_packs_strategy_under_lightnings_name() -> None:
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import ModelParallelStrategy as LightningModelParallelStrategy

    from lit_memopt.cli import compose_config
    from lit_memopt.cli_estimate import data_parallel_plan
    from lit_memopt.strategies import ModelParallelStrategy

    cfg = compose_config(["recipe=sft", "trainer=fsdp2"])
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy) is ModelParallelStrategy and isinstance(strategy, LightningModelParallelStrategy)
    # what the CLI, the estimator and OOMRecovery's backend choice test
    assert type(strategy).__name__ == "ModelParallelStrategy" and cfg.trainer.strategy._target_.endswith("ModelParallelStrategy")
    assert strategy.cpu_offload is False and strategy._save_distributed_checkpoint is True
    cfg = compose_config(["recipe=sft", "trainer=fsdp2", "trainer.strategy.cpu_offload=true"])
    assert instantiate(cfg.trainer.strategy).cpu_offload is True
    assert data_parallel_plan(cfg) == ("fsdp2", 2)
    for bad in ("yes", "1", "null"):
        cfg = compose_config(["recipe=sft", "trainer=fsdp2", f"trainer.strategy.cpu_offload={bad}"])
        with pytest.raises(Exception, match=r"trainer.strategy.cpu_offload must be true or false, got"):
            instantiate(cfg.trainer.strategy)


def test_sharding_reads_the_switch_from_the_attached_strategy() -> None:
    from types import SimpleNamespace

    from torch.distributed.fsdp import CPUOffloadPolicy

    from lit_memopt.models.sharding import offload_policy, strategy_offloads

    assert strategy_offloads(None) is False  # no trainer (a module used on its own)
    assert strategy_offloads(SimpleNamespace(strategy=object())) is False  # another strategy has no switch
    assert strategy_offloads(SimpleNamespace(strategy=SimpleNamespace(cpu_offload=True))) is True
    with pytest.raises(ValueError, match="must be true or false"):
        strategy_offloads(SimpleNamespace(strategy=SimpleNamespace(cpu_offload="true")))
    policy = offload_policy(True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory == torch.cuda.is_available()
    assert offload_policy(False) is None


def _qwen3_4b(scale: float = 1.0, **fields: Any) -> Any:
    from lit_memopt.memory.plan_time import StepWork

    # Qwen3-4B (4.0e9 parameters, 36 blocks) in bf16 with fp32 AdamW moments, 8k tokens per micro-batch
    n = 4.0e9 * scale
    shape: dict[str, Any] = {"tokens": 8192, "micro_batches": 1, "blocks": 36, "strategy": "fsdp2", **fields}
    return StepWork(parameters=n, trainable=n, parameter_bytes=2 * n, trainable_bytes=2 * n, optimizer_state_bytes=8 * n,
                    **shape)


def test_the_time_model_prices_cpu_offload() -> None:
    from dataclasses import replace

    from lit_memopt.memory.plan_time import DEVICES, step_seconds

    for device in ("h100", "a100", "l4"):
        spec = DEVICES[device]
        for shape in ({"world_size": 1}, {"world_size": 8}, {"world_size": 16, "nodes": 2}, {"world_size": 8, "micro_batches": 4}):
            resident = _qwen3_4b(**shape)
            offloaded = replace(resident, cpu_offload=True)
            assert step_seconds(offloaded, spec) > step_seconds(resident, spec), (device, shape)
            # the copies and the host's optimizer step grow with the parameters, and so does their cost over no offload
            extra = [step_seconds(replace(offloaded, **_scaled(offloaded, s)), spec)
                     - step_seconds(replace(resident, **_scaled(resident, s)), spec) for s in (0.5, 1.0, 2.0)]
            assert 0 < extra[0] < extra[1] < extra[2], (device, shape, extra)
    with pytest.raises(ValueError, match="cpu_offload is FSDP2's"):
        step_seconds(replace(_qwen3_4b(world_size=8), strategy="ddp", cpu_offload=True), DEVICES["h100"])


def test_frozen_models_kept_whole_are_neither_gathered_nor_copied() -> None:
    """A frozen reference as large as the policy (GRADE, full fine-tuning): its forward costs compute and memory
    reads as before, but FSDP2 leaves it whole on every rank, so it adds no all-gather and no PCIe copy."""
    from dataclasses import replace

    from lit_memopt.memory.plan_time import DEVICES, step_seconds

    spec = DEVICES["h100"]
    for world, offload in ((1, True), (8, True), (8, False)):
        policy = _qwen3_4b(world_size=world, cpu_offload=offload, tokens=512)  # few tokens: the copies and gathers bind
        # the reference's bytes and FLOPs on top of the policy's, trained parameters unchanged
        both = replace(policy, parameters=2 * policy.parameters, parameter_bytes=2 * policy.parameter_bytes)
        counted_sharded = step_seconds(both, spec)
        kept_whole = step_seconds(replace(both, replicated_bytes=policy.parameter_bytes), spec)
        assert step_seconds(policy, spec) <= kept_whole < counted_sharded, (world, offload)
        # on one device without offload nothing is gathered or copied: the split changes nothing
    single = replace(_qwen3_4b(world_size=1), parameters=2 * _qwen3_4b().parameters)
    assert step_seconds(single, spec) == step_seconds(replace(single, replicated_bytes=single.parameter_bytes / 2), spec)


def _scaled(work: Any, scale: float) -> dict[str, float]:
    return {k: getattr(work, k) * scale for k in ("parameters", "trainable", "parameter_bytes", "trainable_bytes",
                                                   "optimizer_state_bytes")}


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sft_with_cpu_offload_on_one_gpu_keeps_the_state_in_pinned_host_memory(tmp_path: Path) -> None:
    """One CUDA device (NCCL, a mesh of one): Lightning's setup must leave the offloaded shards on the host, the
    optimizer steps there, and the weights agree with the resident run's (CPU and CUDA AdamW round differently)."""
    gpu = [a.replace("trainer.devices=2", "trainer.devices=1").replace("trainer.accelerator=cpu", "trainer.accelerator=gpu")
           for a in FSDP2_RUN]
    _run_both({
        "resident": [*gpu, "trainer.strategy.cpu_offload=false", *_probe(tmp_path / "resident", tmp_path / "probe_r")],
        "offload": [*gpu, "trainer.strategy.cpu_offload=true", *_probe(tmp_path / "offload", tmp_path / "probe_o")],
    }, tmp_path, timeout_s=240)
    (report,) = _reports(tmp_path / "probe_o", 1)
    assert report["policies"] == ["CPUOffloadPolicy"] and report["pin_memory"] == [True], report
    assert report["parameter_devices"] == ["cpu"] and report["pinned"] == [True], report
    assert report["state_devices"] == ["cpu"], report
    (resident,) = _reports(tmp_path / "probe_r", 1)
    assert resident["parameter_devices"] == ["cuda"] and resident["state_devices"] == ["cuda"], resident
    last = f"step_{STEPS:06d}.ckpt"
    worst = largest_difference(tmp_path / "resident" / "checkpoints" / last, tmp_path / "offload" / "checkpoints" / last)
    assert worst <= 1e-5, worst
