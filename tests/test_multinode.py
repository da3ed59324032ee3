"""Several machines: two ``torchrun`` nodes of one CPU process each on 127.0.0.1 (gloo), for ``trainer=fsdp2`` and
``trainer=ddp``; each trains a few steps with checkpoints, then a relaunch with ``resume=auto`` goes on from the newest.

A launch whose ``trainer.devices x trainer.num_nodes`` does not match torchrun's processes stops in one line.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from _ranks import run_torchrun_nodes
from test_cli import run_cli

# The README's "Several machines" command, as run here (one CPU process per node).
NODES = ["trainer.devices=1", "trainer.num_nodes=2", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2"]


def _losses(run_dir: Path) -> list[float]:
    rows = csv.DictReader((sorted(run_dir.glob("logs/version_*"))[-1] / "metrics.csv").open())
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def _launch(tmp_path: Path, args: list[str]) -> str:
    results = run_torchrun_nodes(["fit", "recipe=sft", *args], nnodes=2, cwd=tmp_path, timeout_s=150)
    for node, (code, output) in enumerate(results):
        assert code == 0, f"node {node} exit {code}:\n{output[-4000:]}"
    return "\n".join(output for _, output in results)


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_torchrun_nodes_train_checkpoint_and_resume(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / "run"  # the same folder on both nodes (a shared filesystem, as a real cluster needs)
    common = [f"trainer={strategy}", *NODES, f"hydra.run.dir={run_dir}", "resume=auto"]
    output = _launch(tmp_path, [*common, "trainer.max_steps=4"])
    assert "resume=auto: no checkpoint in" in output and "starting fresh" in output
    assert "MEMBER: 2/2" in output  # one process group across the two nodes
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000002.ckpt", "step_000004.ckpt"]
    if strategy == "fsdp2":
        # sharded: each node wrote its own shard into the same checkpoint directory
        assert (checkpoints / "step_000004.ckpt").is_dir() and len(list((checkpoints / "step_000004.ckpt").glob("*.distcp"))) == 2
    first = _losses(run_dir)
    assert len(first) == 4

    output = _launch(tmp_path, [*common, "trainer.max_steps=6"])  # the same command, relaunched: it goes on
    assert f"resume=auto: resuming from {checkpoints / 'step_000004.ckpt'}" in output
    assert "Restored all states" in output
    resumed = _losses(run_dir)
    assert len(resumed) == 2 and resumed[0] < first[0] - 0.5, (first, resumed)  # steps 5 and 6 only, from trained weights
    assert (checkpoints / "step_000006.ckpt").exists() and (checkpoints / "last.ckpt").resolve().name == "step_000006.ckpt"


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp", "default"])
def test_devices_times_nodes_that_miss_torchruns_processes_is_one_line(tmp_path: Path, strategy: str) -> None:
    # What torchrun puts in each worker's environment for --nnodes=2 --nproc-per-node=1 (node 0).
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "test"}
    result = run_cli(["fit", "recipe=sft", f"trainer={strategy}", "trainer.devices=1", "trainer.accelerator=cpu",
                      f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120, env=torchrun)
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr.strip().splitlines()
    assert err[-1] == ("lit-memopt: error: torchrun started 2 processes (1 per node) but trainer.devices=1 x "
                       "trainer.num_nodes=1 = 1; set trainer.devices=1 trainer.num_nodes=2 (torchrun's --nproc-per-node "
                       "and --nnodes)"), err
    assert "Traceback" not in result.stderr


def test_fsdp2_sizes_its_data_parallel_group_from_every_node() -> None:
    from omegaconf import OmegaConf

    from lit_memopt.cli import compose_config

    cfg = compose_config(["recipe=sft", "trainer=fsdp2", "trainer.devices=8", "trainer.num_nodes=4"])
    assert OmegaConf.to_container(cfg.trainer.strategy, resolve=True)["data_parallel_size"] == 32
    cfg = compose_config(["recipe=sft", "trainer=fsdp2", "trainer.devices=[0,1]", "trainer.num_nodes=3"])
    assert OmegaConf.to_container(cfg.trainer.strategy, resolve=True)["data_parallel_size"] == 6


def test_fsdp2_with_devices_auto_says_what_to_set(tmp_path: Path) -> None:
    result = run_cli(["fit", "recipe=sft", "trainer=fsdp2", "trainer.devices=auto", f"hydra.run.dir={tmp_path / 'r'}"],
                     tmp_path, timeout=120)
    assert result.returncode == 2
    assert "trainer=fsdp2: the process groups are sized as trainer.devices x trainer.num_nodes" in result.stderr
    assert "Traceback" not in result.stderr
