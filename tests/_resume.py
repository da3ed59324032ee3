"""The kill-and-resume tests' helpers: start a ``lit-memopt`` run in its own process group, kill it after a given
checkpoint, run the resume under a deadline, and compare the weights of two checkpoints (single files or sharded
FSDP2 directories)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import this_workers_core


def start(args: list[str], cwd: Path, log_name: str = "killed.log", one_core: bool = False) -> subprocess.Popen:
    """``python -m lit_memopt ARGS`` in a new session: every process it starts (the ranks Lightning launches too) can
    be killed together with :func:`kill_all`.

    ``one_core``: the run may use one core only. The RL warm start raises torch's threads to the cores it may use
    (``cpu_threads_at_least``); on a shared 2-core machine two spinning threads made a warm-start step 9x slower
    than one (8.6 s against 0.94 s, measured under a load of 5).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log = open(cwd / log_name, "w")  # noqa: SIM115 - closed by the child's exit; a pipe could fill up and block it
    core = this_workers_core()
    pin = (lambda: os.sched_setaffinity(0, core)) if one_core else None
    process = subprocess.Popen([sys.executable, "-m", "lit_memopt", *args], cwd=cwd, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin)
    process.log_path = cwd / log_name  # type: ignore[attr-defined]
    return process


def _tail(process: subprocess.Popen) -> str:
    return process.log_path.read_text()[-3000:]  # type: ignore[attr-defined]


def kill_all(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the run's whole process group (a rank left alive would wait for the others forever)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    process.wait()


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float) -> None:
    """Wait until ``path`` exists; fail (killing the run) when the run ends first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            kill_all(process)
            pytest.fail(f"{path.name} never appeared (exit {process.returncode}):\n{_tail(process)}")
        time.sleep(0.02)


def kill_after(args: list[str], cwd: Path, checkpoint: Path, timeout_s: float, one_core: bool = False) -> None:
    """Start the run, SIGKILL it (all its processes) as soon as ``checkpoint`` is complete: a lost machine, no handler
    runs and nothing more is saved."""
    process = start(args, cwd, one_core=one_core)
    wait_for(checkpoint, process, timeout_s)
    kill_all(process)


def run(args: list[str], cwd: Path, timeout_s: float, log_name: str = "run.log", one_core: bool = False) -> str:
    """Run ``lit-memopt ARGS`` to its end; returns its output. Fails on a non-zero exit, and on a run still going after
    ``timeout_s`` (a hang), whose processes are all killed."""
    process = start(args, cwd, log_name, one_core=one_core)
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_all(process)
        pytest.fail(f"lit-memopt {' '.join(args)} still ran after {timeout_s:g} s:\n{_tail(process)}")
    output = process.log_path.read_text()  # type: ignore[attr-defined]
    assert code == 0, output[-4000:]
    return output


def checkpoint_state(path: Path) -> dict[str, Any]:
    """A single-file checkpoint, or a sharded one's metadata (loops, callbacks: written by rank zero)."""
    return torch.load(path / "meta.pt" if path.is_dir() else path, map_location="cpu", weights_only=True)


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's weights in a checkpoint; a sharded FSDP2 directory is gathered into one file first (torch's
    ``dcp_to_torch_save``, no process group needed)."""
    if not path.is_dir():
        return checkpoint_state(path)["state_dict"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(path, Path(folder) / "whole.pt")
        return torch.load(Path(folder) / "whole.pt", map_location="cpu", weights_only=True)["state_dict"]


def largest_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between the weights of two checkpoints (same names required)."""
    first, second = weights(a), weights(b)
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first)


def assert_same_weights(a: Path, b: Path) -> float:
    """The two checkpoints' weights agree to 1e-6 (float32); returns the largest difference (printed: ``pytest -rP``)."""
    worst = largest_difference(a, b)
    print(f"largest weight difference {worst:g} ({a.parent.parent.name} vs {b.parent.parent.name})")
    assert worst <= 1e-6, f"largest weight difference {worst:g}"
    return worst
