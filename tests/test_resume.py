"""Preemption and resume: checkpoints during the run, atomic writes, ``ckpt_path=last``, ``resume=auto``, a SIGTERM
that saves and stops, and a run killed with SIGKILL that resumes to the very weights of the uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_cli import run_cli

# A tiny SFT run: 12 steps, a checkpoint every 4, a validation at step 6 (the run spans both kinds of saves).
SFT = ["fit", "recipe=sft", "trainer.max_steps=12", "checkpoint.every_n_steps=4", "checkpoint.keep_last=2",
       "trainer.val_check_interval=6", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
       "trainer.log_every_n_steps=1"]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log = open(cwd / "killed.log", "w")  # noqa: SIM115 - closed by the child's exit; a pipe could fill up and block it
    return subprocess.Popen([sys.executable, "-m", "lit_memopt", *args], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            pytest.fail(f"{path.name} never appeared (exit {process.returncode})")
        time.sleep(0.02)


def _state(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_same_weights(a: Path, b: Path) -> None:
    first, second = _state(a)["state_dict"], _state(b)["state_dict"]
    assert first.keys() == second.keys()
    worst = max((first[k].float() - second[k].float()).abs().max().item() for k in first)
    assert worst <= 1e-6, f"largest weight difference {worst:g}"


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
    assert _state(folder / "step_000012.ckpt")["global_step"] == 12


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_then_resume_gives_the_uninterrupted_weights(uninterrupted: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    process = _start([*SFT, f"hydra.run.dir={run_dir}"], tmp_path)
    _wait_for(run_dir / "checkpoints" / "step_000008.ckpt", process, timeout_s=150)
    process.send_signal(signal.SIGKILL)  # no handler, no save: what a lost machine looks like
    process.wait()
    assert not (run_dir / "checkpoints" / "step_000012.ckpt").exists(), "the run finished before the kill"

    result = run_cli([*SFT, "ckpt_path=last", f"hydra.run.dir={run_dir}"], tmp_path, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states" in result.stdout + result.stderr
    assert "dataloader is not resumable" not in result.stdout + result.stderr  # ResumableDataLoader: mid-epoch
    final = run_dir / "checkpoints" / "step_000012.ckpt"
    _assert_same_weights(final, uninterrupted / "checkpoints" / "step_000012.ckpt")
    # The callbacks' counters went on from the checkpoint: the same totals as the run that was never stopped.
    resumed, reference = _state(final)["callbacks"], _state(uninterrupted / "checkpoints" / "step_000012.ckpt")["callbacks"]
    assert resumed["OOMRecovery"] == reference["OOMRecovery"]
    for key in ("steps", "micro_batches", "samples"):
        assert resumed["MemoryMonitor"]["metrics"][key] == reference["MemoryMonitor"]["metrics"][key] == \
            {"steps": 12, "micro_batches": 12, "samples": 192}[key]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_saves_at_the_next_batch_and_stops_then_resume_auto_goes_on(uninterrupted: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SFT, "resume=auto", f"hydra.run.dir={run_dir}"]
    process = _start(args, tmp_path)
    _wait_for(run_dir / "checkpoints" / "step_000004.ckpt", process, timeout_s=150)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0
    log = (tmp_path / "killed.log").read_text()
    assert "RunCheckpoint: SIGTERM received; saved" in log, log[-3000:]
    steps = sorted(int(p.name[5:-5]) for p in (run_dir / "checkpoints").glob("step_*.ckpt"))
    assert steps and steps[-1] < 12, steps  # stopped early, with a checkpoint of the step it stopped at

    result = run_cli(args, tmp_path, timeout=200)  # the same command: it resumes by itself
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resume=auto: resuming from {run_dir / 'checkpoints' / f'step_{steps[-1]:06d}.ckpt'}" in result.stdout + result.stderr
    _assert_same_weights(run_dir / "checkpoints" / "step_000012.ckpt", uninterrupted / "checkpoints" / "step_000012.ckpt")


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
