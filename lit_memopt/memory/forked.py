"""Run one independent piece of an estimate in a forked copy of this process, alongside the rest.

An estimate's traces are pure Python over fake tensors (one core each), and block extrapolation needs
three of them that do not depend on each other. A forked child already holds the built module, so it
can run one trace while the parent runs the others, on the second core: the check trace no longer adds
its time to the estimate's.

Forking is only done where it is safe and useful (``can_fork``): Linux, at least two usable cores,
no other Python thread alive (a lock held by a thread at the moment of the fork stays held forever in
the child). Anything that goes wrong in the child (an exception that does not pickle, a crash, a hang
past the timeout) is reported as ``ForkedCallFailed`` and the caller runs the piece itself instead.
"""

from __future__ import annotations

import os
import pickle
import select
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable

__all__ = ["ForkedCall", "ForkedCallFailed", "can_fork", "usable_cpu_cores"]


class ForkedCallFailed(RuntimeError):
    """The forked child produced no result (it crashed, hung, or its result could not be sent back)."""


def usable_cpu_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS tells it, else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Set in a ForkedCall's child: it runs beside its parent on the core the parent left it, so it forks no further.
_IN_FORKED_CHILD = False


def can_fork() -> bool:
    """Whether ``ForkedCall`` may fork here: Linux, two or more usable cores, a single Python thread, not
    inside a forked child already, and no CUDA context in this process (a forked child cannot use its parent's:
    every CUDA call there fails with "initialization error", as a benchmark loop that measured one recipe on the
    GPU before estimating the next found)."""
    if _IN_FORKED_CHILD or not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    if _cuda_initialized():
        return False
    return usable_cpu_cores() >= 2 and threading.active_count() == 1


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


class ForkedCall:
    """``fn()`` evaluated in a forked child; ``result()`` returns its value or re-raises its exception.

    Exceptions raised by ``fn`` in the child come back as themselves (when they pickle), so the caller
    sees what a call in its own process would have raised.
    """

    def __init__(self, fn: Callable[[], Any]) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compute, send back, leave without running the parent's exit handlers
            global _IN_FORKED_CHILD
            _IN_FORKED_CHILD = True
            os.close(read_fd)
            status = 0
            try:
                import torch

                torch.set_num_threads(1)  # the parent keeps the other core
                # The parent runs the same code and shows the same warnings: do not print them twice.
                warnings.simplefilter("ignore")
                try:
                    payload = pickle.dumps(("value", fn()))
                except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
                    try:
                        payload = pickle.dumps(("error", exc))
                    except Exception:  # noqa: BLE001 - an exception that does not pickle
                        payload = pickle.dumps(("failed", "".join(traceback.format_exception(exc))))
                with os.fdopen(write_fd, "wb") as out:
                    out.write(payload)
            except BaseException:  # noqa: BLE001
                status = 1
            finally:
                os._exit(status)
        os.close(write_fd)
        self._pid = pid
        self._read_fd = read_fd

    def result(self, timeout: float) -> Any:
        """Wait up to ``timeout`` seconds for the child; its value, or its exception raised here.

        Raises:
            ForkedCallFailed: the child crashed, sent nothing usable or did not finish in time (it is killed).
        """
        chunks = []
        finished = False
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._read_fd], [], [], left)[0]:
                    raise ForkedCallFailed(f"the forked child did not finish within {timeout:.0f} s")
                chunk = os.read(self._read_fd, 1 << 20)
                if not chunk:
                    finished = True
                    break
                chunks.append(chunk)
        finally:
            os.close(self._read_fd)
            self._reap(kill=not finished)
        try:
            kind, value = pickle.loads(b"".join(chunks))
        except Exception as exc:  # noqa: BLE001 - a truncated payload: the child died while writing
            raise ForkedCallFailed(f"the forked child sent no result ({type(exc).__name__})") from None
        if kind == "value":
            return value
        if kind == "error":
            raise value
        raise ForkedCallFailed(f"the forked child failed:\n{value}")

    def cancel(self) -> None:
        """Kill the child and reap it (its result is not wanted: the caller failed first)."""
        try:
            os.close(self._read_fd)
        except OSError:
            pass
        self._reap(kill=True)

    def _reap(self, kill: bool) -> None:
        if kill:
            try:
                os.kill(self._pid, 9)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(self._pid, 0)
        except ChildProcessError:
            pass
