"""The multi-process tests' launchers: ranks spawned on a free port, or torchrun "machines" on 127.0.0.1, under a
deadline (a hang fails, never blocks CI)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], *, nprocs: int = 2, timeout_s: float) -> str | None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; ``None`` when every rank finished.

    Otherwise a line saying why not (a rank raised or died, or the ranks were still running after
    ``timeout_s``); every process left is killed either way.
    """
    context = mp.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                return f"the {nprocs} processes did not finish in {timeout_s:g} s"
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        return f"a rank failed: {error}"
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    return None


def run_torchrun_nodes(args: list[str], *, nnodes: int, cwd: Path, timeout_s: float,
                       env: dict[str, str] | None = None) -> list[tuple[int | None, str]]:
    """Launch ``nnodes`` ``torchrun`` "machines" of one process each on 127.0.0.1 running ``python -m lit_memopt ARGS``.

    Returns ``(exit code, output)`` per node; ``None`` for a node still running at ``timeout_s`` or after another node
    failed, whose whole process group (torchrun and its worker) is then killed.
    """
    port = free_port()
    base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    nodes, logs = [], []
    for rank in range(nnodes):
        log = open(cwd / f"node{rank}.log", "w+")  # a file, not a pipe: a full pipe would block the node
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={rank}",
                   "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "lit_memopt", *args]
        nodes.append(subprocess.Popen(command, cwd=cwd, env=base, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    try:
        # One node failing leaves the others waiting at a rendezvous or a collective: stop waiting at the first failure.
        while time.monotonic() < deadline and any(n.poll() is None for n in nodes):
            if any(n.poll() not in (None, 0) for n in nodes):
                break
            time.sleep(0.2)
    finally:
        codes = [node.poll() for node in nodes]
        for node in nodes:
            if node.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, signal.SIGKILL)  # torchrun and its worker
            node.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return list(zip(codes, outputs))


def this_workers_core() -> set[int]:
    """One core for a run that must not spin two threads on a shared machine: under pytest-xdist, each worker its
    own (``gw0`` the first usable core, ``gw1`` the next, ...), so two workers' pinned runs never share one."""
    cores = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return {cores[index % len(cores)]}


@contextlib.contextmanager
def pinned_to_one_core() -> Iterator[None]:
    """This process, and every process it starts meanwhile, on :func:`this_workers_core` (restored after)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, this_workers_core())
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
