"""The optimizer-step retry of ``OOMRecovery``: an OOM inside ``optimizer.step`` is retried once.

Only when nothing was updated yet (parameters and optimizer state unchanged, checked through
tensor version counters) is a retry exact; otherwise the step is reported. Ranks agree on the
outcome, so an OOM on one rank stops or retries every rank alike.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.tensor import DTensor

from lit_memopt._compat.torch import is_counted_by_lr_scheduler, mark_counted_by_lr_scheduler, tensor_version
from lit_memopt.callbacks._rank_agreement import ERROR, OK, OOM, RankAgreement
from lit_memopt.memory.oom import is_oom_error

__all__ = ["OptimizerStepRetry", "OptimizerSnapshot"]


class OptimizerStepRetry:
    """Patches ``optimizer.step`` of a run's optimizers to retry an OOM in the update once.

    ``on_oom(message)`` records the OOM; ``fatal(message, retryable, local)`` builds the error
    raised when the step cannot be retried; ``error_type(message, oom_recorded=...)`` builds the exception raised;
    ``current_step()`` names the step in messages.
    """

    def __init__(
        self,
        agree: Callable[[], RankAgreement],
        on_oom: Callable[[str], None],
        fatal: Callable[[str, bool, bool], str],
        error_type: Callable[..., Exception],
        free_memory: Callable[[], None],
        current_step: Callable[[], int],
    ) -> None:
        self._agree = agree
        self._on_oom = on_oom
        self._fatal = fatal
        self._error_type = error_type
        self._free_memory = free_memory
        self._current_step = current_step
        self._patched: list[tuple[torch.optim.Optimizer, Any]] = []

    def patch(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self._patched:
            return
        for optimizer in optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                rank_zero_warn("OOMRecovery: LBFGS re-evaluates its closure; optimizer-step OOMs are not retried for it.")
                continue
            previous = optimizer.__dict__.get("step")
            inner = optimizer.step  # bound; may already be an LR scheduler's counting wrapper
            optimizer.step = types.MethodType(self._guarded(inner), optimizer)  # type: ignore[method-assign]
            self._patched.append((optimizer, previous))

    def unpatch(self) -> None:
        for optimizer, previous in self._patched:
            if previous is None:
                optimizer.__dict__.pop("step", None)
            else:
                optimizer.step = previous
        self._patched.clear()

    def _guarded(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                # The closure runs the micro-batch loop (which handles its own OOMs); only the update
                # itself is guarded below, so a retry never re-runs forward/backward.
                with torch.enable_grad():
                    loss = closure()
            self._step_with_retry(optimizer, inner, kwargs)
            return loss

        if is_counted_by_lr_scheduler(inner):
            # An LR scheduler's counting wrapper is still called inside: keep its mark, or the scheduler
            # warns that optimizer.step() was overridden after it was created.
            mark_counted_by_lr_scheduler(step)
        return step

    def _step_with_retry(self, optimizer: torch.optim.Optimizer, inner: Callable[..., Any], kwargs: dict) -> None:
        agree = self._agree()
        snapshot = OptimizerSnapshot(optimizer)
        status, retryable, message, error = _try_step(inner, kwargs, snapshot)
        (agreed, any_fatal) = agree.max(status, 0 if status != OOM or retryable else 1)
        if agreed == OK:
            return
        if status == ERROR:
            raise error  # type: ignore[misc]
        if agreed == ERROR:
            raise self._error_type(
                f"OOMRecovery: another rank failed in the optimizer step at step {self._current_step()}; stopping this rank too."
            )
        if status == OOM:
            self._on_oom(message)
        if any_fatal:
            raise self._error_type(self._fatal(message, False, status == OOM), oom_recorded=status == OOM)
        # Every failing rank can retry exactly: nothing was updated. Free memory and try once more.
        if status == OOM:
            self._free_memory()
            status, retryable, message2, error = _try_step(inner, kwargs, snapshot)
            message = message2 or message
        (agreed,) = agree.max(status)
        if agreed == OK:
            rank_zero_info(f"OOMRecovery: the optimizer step at step {self._current_step()} ran out of memory and succeeded on retry")
            return
        if status == ERROR:
            raise error  # type: ignore[misc]
        raise self._error_type(self._fatal(message, True, status == OOM), oom_recorded=status == OOM)


def _try_step(inner: Callable[..., Any], kwargs: dict, snapshot: OptimizerSnapshot) -> tuple[int, bool, str, Any]:
    status, message, error = OK, "", None
    try:
        inner(**kwargs)
    except Exception as e:  # noqa: BLE001 - classified right below
        if is_oom_error(e):
            status, message = OOM, oom_message(e)
        else:
            status, error = ERROR, e
    if status != OOM:
        return status, False, message, error
    retryable = not snapshot.modified()
    snapshot.drop_new_state()
    return status, retryable, message, None


def oom_message(error: BaseException) -> str:
    """The first line of an OOM's message (bounded), for events and error reports."""
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else repr(error)


def _version(t: torch.Tensor) -> int:
    # A DTensor's in-place updates move its own counter (torch 2.13) or its local shard's (older releases): the sum
    # of both moves when either does. Without grad, ``to_local`` is the shard or a view of it (views share the counter).
    if isinstance(t, DTensor):
        with torch.no_grad():
            return tensor_version(t) + tensor_version(t.to_local())
    return tensor_version(t)


class OptimizerSnapshot:
    """Version counters of parameters and optimizer state before a step: tells whether a failed step changed anything."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state_keys = {p: set(s.keys()) for p, s in optimizer.state.items()}
        self.versions: list[tuple[torch.Tensor, int]] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.versions.append((p, _version(p)))
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        self.versions.append((v, _version(v)))

    def modified(self) -> bool:
        return any(_version(t) != v for t, v in self.versions)

    def drop_new_state(self) -> None:
        """Forget state created by the failed attempt (fresh zeros), so a retry initialises it again."""
        state = self.optimizer.state
        for p in list(state.keys()):
            if p not in self.state_keys:
                del state[p]
            else:
                for key in set(state[p].keys()) - self.state_keys[p]:
                    del state[p][key]
