"""Preemption and resume: checkpoints during the run, atomic writes, ``ckpt_path=last``, ``resume=auto``, a SIGTERM
that saves and stops, and a run killed with SIGKILL that resumes to the very weights of the uninterrupted run."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _resume import assert_same_weights, checkpoint_state, kill_after, start, wait_for
from test_cli import run_cli

# A tiny SFT run: 12 steps, a checkpoint every 4, a validation at step 6 (the run spans both kinds of saves).
SFT = ["fit", "recipe=sft", "trainer.max_steps=12", "checkpoint.every_n_steps=4", "checkpoint.keep_last=2",
       "trainer.val_check_interval=6", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
       "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same run, never stopped."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_cli([*SFT, f"hydra.run.dir={run_dir}"], run_dir.parent, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoints_during_the_run_keep_the_newest_and_link_last(uninterrupted: Path) -> None:
    folder = uninterrupted / "checkpoints"
    # saved at 4, 6 (validation), 8, 12; the newest two are kept
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_000008.ckpt", "step_000012.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step_000012.ckpt"
    assert checkpoint_state(folder / "step_000012.ckpt")["global_step"] == 12


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_then_resume_gives_the_uninterrupted_weights(uninterrupted: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    kill_after([*SFT, f"hydra.run.dir={run_dir}"], tmp_path, run_dir / "checkpoints" / "step_000008.ckpt", timeout_s=150)
    assert not (run_dir / "checkpoints" / "step_000012.ckpt").exists(), "the run finished before the kill"

    result = run_cli([*SFT, "ckpt_path=last", f"hydra.run.dir={run_dir}"], tmp_path, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states" in result.stdout + result.stderr
    assert "dataloader is not resumable" not in result.stdout + result.stderr  # ResumableDataLoader: mid-epoch
    final = run_dir / "checkpoints" / "step_000012.ckpt"
    assert_same_weights(final, uninterrupted / "checkpoints" / "step_000012.ckpt")
    # The callbacks' counters went on from the checkpoint: the same totals as the run that was never stopped.
    resumed = checkpoint_state(final)["callbacks"]
    reference = checkpoint_state(uninterrupted / "checkpoints" / "step_000012.ckpt")["callbacks"]
    assert resumed["OOMRecovery"] == reference["OOMRecovery"]
    for key in ("steps", "micro_batches", "samples"):
        assert resumed["MemoryMonitor"]["metrics"][key] == reference["MemoryMonitor"]["metrics"][key] == \
            {"steps": 12, "micro_batches": 12, "samples": 192}[key]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_saves_at_the_next_batch_and_stops_then_resume_auto_goes_on(uninterrupted: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SFT, "resume=auto", f"hydra.run.dir={run_dir}"]
    process = start(args, tmp_path)
    wait_for(run_dir / "checkpoints" / "step_000004.ckpt", process, timeout_s=150)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0
    log = (tmp_path / "killed.log").read_text()
    assert "RunCheckpoint: SIGTERM received; saved" in log, log[-3000:]
    steps = sorted(int(p.name[5:-5]) for p in (run_dir / "checkpoints").glob("step_*.ckpt"))
    assert steps and steps[-1] < 12, steps  # stopped early, with a checkpoint of the step it stopped at

    result = run_cli(args, tmp_path, timeout=200)  # the same command: it resumes by itself
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resume=auto: resuming from {run_dir / 'checkpoints' / f'step_{steps[-1]:06d}.ckpt'}" in result.stdout + result.stderr
    assert_same_weights(run_dir / "checkpoints" / "step_000012.ckpt", uninterrupted / "checkpoints" / "step_000012.ckpt")


def test_ckpt_path_last_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    result = run_cli(["fit", "recipe=sft", "ckpt_path=last", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert result.returncode == 2
    err = result.stderr.strip()
    assert err.startswith(f"lit-memopt: error: ckpt_path=last: no checkpoint in {tmp_path / 'run' / 'checkpoints'}"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("override, expected", [
    ("resume=always", "resume='always' is not supported; use resume=auto"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be a positive integer or null, got 0."),
    ("checkpoint.save_on_signals=[SIGFOO]", "checkpoint.save_on_signals has ['SIGFOO']"),
])
def test_bad_checkpoint_settings_are_one_line(tmp_path: Path, override: str, expected: str) -> None:
    result = run_cli(["fit", "recipe=sft", override, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert err[-1].startswith("lit-memopt: error:") and expected in err[-1], err
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- per-rank random generators
def _rank_worker(rank: int, port: int) -> None:
    """Each rank's generators differ (seeded with its rank); the saved states are gathered, each rank restores its own."""
    import random

    import numpy as np
    import torch.distributed as dist

    from lit_memopt.callbacks.random_state import RandomState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(100 + rank), np.random.seed(100 + rank), random.seed(100 + rank)
        saved = RandomState().state_dict()  # on every rank together, as Lightning takes it at each save
        expected = (torch.rand(3), np.random.rand(3), random.random())
        assert len(saved["ranks"]) == 2 and not torch.equal(saved["ranks"][0]["torch"], saved["ranks"][1]["torch"])
        torch.manual_seed(7), np.random.seed(7), random.seed(7)  # the fresh process of a resumed run
        restored = RandomState()
        restored.load_state_dict(saved)  # what every rank reads: rank zero's file holds the gathered states
        restored.on_train_start(SimpleNamespace(global_rank=rank, world_size=2), None)
        drawn = (torch.rand(3), np.random.rand(3), random.random())
        assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_each_rank_resumes_its_own_random_generators() -> None:
    from _ranks import free_port, run_ranks

    failure = run_ranks(_rank_worker, (free_port(),), nprocs=2, timeout_s=90)
    assert failure is None, failure


def test_a_checkpoint_of_one_flat_state_serves_every_rank() -> None:
    from lit_memopt.callbacks.random_state import RandomState

    torch.manual_seed(3)
    flat = {k: v for k, v in RandomState().state_dict()["ranks"][0].items()}  # the layout before per-rank states
    expected = torch.rand(4)
    for rank in (0, 1):
        torch.manual_seed(9)
        callback = RandomState()
        callback.load_state_dict(flat)
        callback.on_train_start(SimpleNamespace(global_rank=rank, world_size=2), None)
        assert torch.equal(torch.rand(4), expected)


# ----------------------------------------------------------------------------- atomic writes
class _Writer:
    """The parts of a Trainer that ``RunCheckpoint._save_checkpoint`` uses; ``save_checkpoint`` may be cut midway."""

    def __init__(self, sharded: bool) -> None:
        self.sharded, self.global_step, self.cut = sharded, 0, False
        self.is_global_zero, self.loggers = True, []
        self.strategy = SimpleNamespace(barrier=lambda *args: None)

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        state = {"global_step": self.global_step, "weights": torch.full((1000,), float(self.global_step))}
        target = Path(path) / "shard_0.pt" if self.sharded else Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if self.cut:  # a process killed while writing: half a file, then nothing more
            target.write_bytes(b"half a checkpoint")
            raise KeyboardInterrupt("killed while writing")
        torch.save(state, target)


@pytest.mark.parametrize("sharded", [False, True], ids=["single_file", "sharded_directory"])
def test_a_write_cut_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path, sharded: bool) -> None:
    from lit_memopt.callbacks.run_checkpoint import RunCheckpoint
    from lit_memopt.cli_checkpoint import newest_checkpoint

    callback = RunCheckpoint(tmp_path, every_n_steps=1)
    writer = _Writer(sharded)

    def load(path: Path) -> dict[str, Any]:
        return torch.load(path / "shard_0.pt" if sharded else path, weights_only=True)

    writer.global_step = 4
    callback._save_checkpoint(writer, str(tmp_path / "step_000004.ckpt"))
    writer.global_step, writer.cut = 8, True
    with pytest.raises(KeyboardInterrupt):
        callback._save_checkpoint(writer, str(tmp_path / "step_000008.ckpt"))
    assert not (tmp_path / "step_000008.ckpt").exists() and (tmp_path / "step_000008.ckpt.tmp").exists()
    assert newest_checkpoint(tmp_path) == tmp_path / "step_000004.ckpt"  # the cut write is never chosen
    assert load(tmp_path / "step_000004.ckpt")["global_step"] == 4

    writer.cut = False  # the relaunched run saves the same step again: the leftover is replaced, then published
    callback._save_checkpoint(writer, str(tmp_path / "step_000008.ckpt"))
    assert load(tmp_path / "step_000008.ckpt")["global_step"] == 8 and not (tmp_path / "step_000008.ckpt.tmp").exists()
    callback._save_checkpoint(writer, str(tmp_path / "step_000008.ckpt"))  # over an existing one: replaced whole
    assert newest_checkpoint(tmp_path) == tmp_path / "step_000008.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004.ckpt", "step_000008.ckpt"]
