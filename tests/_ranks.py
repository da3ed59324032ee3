"""The multi-process tests' launcher: ranks spawned on a free port, under a deadline (a hang fails, never blocks CI)."""

from __future__ import annotations

import socket
import time
from typing import Any, Callable

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
