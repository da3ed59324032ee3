"""A memory-budget simulator: raise a real ``torch.OutOfMemoryError`` when live tensor bytes pass a budget.

It makes every out-of-memory path (forward, backward, optimizer step) testable on any device,
CPU included, deterministically.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

from lit_memopt._compat.distributed import observed_fsdp_storage
from lit_memopt._compat.torch import TorchDispatchMode, is_traceable_wrapper_subclass, storage_key, tree_flatten
from lit_memopt.memory.units import format_bytes

__all__ = ["MemoryBudget", "memory_budget", "storage_bytes", "training_budget"]

# The CUDA caching allocator rounds every block up to 512 bytes; mirroring it keeps budgets
# measured on CPU meaningful for CUDA and vice versa.
_CUDA_BLOCK_BYTES = 512


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that back ``t`` (the inner tensors of a wrapper subclass such as DTensor)."""
    stack, found = [t], []
    while stack:
        x = stack.pop()
        if is_traceable_wrapper_subclass(x):
            names, _ = x.__tensor_flatten__()
            stack.extend(v for v in (getattr(x, n) for n in names) if isinstance(v, torch.Tensor))
            continue
        try:
            found.append(x.untyped_storage())
        except (RuntimeError, NotImplementedError):
            pass  # sparse and other storage-less layouts: nothing to count here
    return found


def _storage_cost(st: torch.UntypedStorage, nbytes: int | None = None) -> int:
    """What ``st`` counts for, at its size or (``nbytes``) at a size it is about to take."""
    n = st.nbytes() if nbytes is None else nbytes
    if st.device.type == "cuda":
        return -(-n // _CUDA_BLOCK_BYTES) * _CUDA_BLOCK_BYTES
    return n


def storage_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``objs``.

    Accepts tensors, ``nn.Module``s (parameters, their gradients and buffers), optimizers (their
    state) and any nesting of lists, tuples and dicts of those. Storages shared between objects
    (tied weights, views) count once. Handy as ``memory_budget``'s ``baseline_bytes``.

    Example::

        baseline = storage_bytes(model, optimizer)
        with memory_budget(baseline + 64 * 2**20, baseline_bytes=baseline):
            ...
    """
    seen: dict[int, int] = {}

    def visit(t: torch.Tensor) -> None:
        for st in _storages(t):
            if st.device.type != "meta":
                seen[storage_key(st)] = _storage_cost(st)

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            visit(obj)
            if obj.grad is not None:
                visit(obj.grad)
        elif isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                walk(p)
            for b in obj.buffers():
                visit(b)
        elif isinstance(obj, torch.optim.Optimizer):
            walk(list(obj.state.values()))
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v)

    for o in objs:
        walk(o)
    return sum(seen.values())


class MemoryBudget(TorchDispatchMode):
    """Track live tensor storage bytes and raise ``torch.OutOfMemoryError`` past ``budget_bytes``.

    A ``TorchDispatchMode``: every ATen op run inside it (forward, autograd's backward, the
    optimizer step, collectives) is seen after it runs. Each new storage it returns is recorded
    by identity with a weak-reference finalizer, so its bytes count while it is alive and stop
    counting when it is freed, wherever that happens (also after the context has exited). When
    an op's new storages would take the live total past the budget, they are dropped and a real
    ``torch.OutOfMemoryError`` with a CUDA-like message is raised from that op — the same type
    and place a GPU would raise, so ``except torch.OutOfMemoryError`` and ``is_oom_error`` work.

    What counts: ``current_bytes = baseline_bytes + tracked bytes``, where tracked bytes are the
    storages created by ops inside the context (re-entering the same object keeps counting what is
    still alive from earlier entries). Tensors that already existed when the context was entered
    (parameters, the input batch, gradients from an earlier step) are *not* tracked; they are the
    baseline, which you declare with ``baseline_bytes`` (e.g. ``storage_bytes(model, optimizer)``)
    if you want ``budget_bytes`` to read like a device's total memory. Views share their base's
    storage and cost nothing; in-place ops cost nothing unless they grow a tracked storage.
    Storages on CUDA are rounded up to 512 bytes like the caching allocator; meta tensors are free.
    Temporaries that a backend kernel allocates internally (not through an ATen op) are invisible, and so are
    storages resized in place outside ATen ops, except FSDP2's: it frees and re-allocates its gathered parameters and
    all-gather buffers with ``UntypedStorage.resize_``, which the budget follows through FSDP2's own two functions for it
    (``_compat.distributed.observed_fsdp_storage``; without them a rank's step on the tiny model over 2 ranks read
    41.29 MiB, the tracker 44.67 MiB, the difference the gathered blocks).

    Args:
        budget_bytes: the limit on ``current_bytes``; ``None`` only tracks (never raises). Settable
            on the object between steps (``mb.budget_bytes = ...``).
        device: count only storages on this device (``"cuda"``, ``"cuda:1"``, ``torch.device``);
            ``None`` counts every device except meta.
        baseline_bytes: bytes assumed live before entering (see above). Default 0.

    Raises:
        ValueError: a negative ``budget_bytes`` or ``baseline_bytes``.
        torch.OutOfMemoryError: inside the context, at the op that would pass the budget.

    Example::

        model, opt = torch.nn.Linear(512, 512), torch.optim.Adam(...)
        with memory_budget(None) as probe:          # measure the step's peak
            train_step(model, opt, batch)
        with memory_budget(probe.peak_bytes - 1):   # one byte less: OOM, like a GPU would
            train_step(model, opt, batch)           # raises torch.OutOfMemoryError
    """

    def __init__(
        self,
        budget_bytes: int | None,
        *,
        device: str | torch.device | None = None,
        baseline_bytes: int = 0,
    ) -> None:
        super().__init__()
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"memory_budget: budget_bytes must be a non-negative int or None, got {budget_bytes!r}")
        if not isinstance(baseline_bytes, int) or baseline_bytes < 0:
            raise ValueError(f"memory_budget: baseline_bytes must be a non-negative int, got {baseline_bytes!r}")
        self.budget_bytes = budget_bytes
        self.device = torch.device(device) if device is not None else None
        self.baseline_bytes = baseline_bytes
        self.num_ooms = 0
        self.last_oom: dict[str, Any] | None = None
        # storage key (StorageImpl address) -> (weakref with finalizer, counted bytes)
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._tracked = 0
        self._peak = baseline_bytes
        # RLock: a finalizer can run on this thread while we hold the lock (GC during dispatch).
        self._lock = threading.RLock()
        self._fsdp_hooks: list[contextlib.ExitStack] = []  # one per entry (the object can be re-entered)

    def __enter__(self) -> "MemoryBudget":
        stack = contextlib.ExitStack()
        stack.enter_context(observed_fsdp_storage(self._fsdp_allocating, self._fsdp_freed))
        self._fsdp_hooks.append(stack)
        try:
            super().__enter__()
        except BaseException:
            self._fsdp_hooks.pop().close()
            raise
        return self

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._fsdp_hooks.pop().close()

    # ------------------------------------------------------------------ reporting
    @property
    def tracked_bytes(self) -> int:
        """Bytes of the live storages created inside this budget."""
        return self._tracked

    @property
    def current_bytes(self) -> int:
        """``baseline_bytes`` plus the live tracked bytes: what the budget is compared with."""
        return self.baseline_bytes + self._tracked

    @property
    def peak_bytes(self) -> int:
        """The highest ``current_bytes`` seen since creation or the last ``reset_peak()``."""
        return self._peak

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (e.g. at a phase boundary)."""
        self._peak = self.current_bytes

    def __repr__(self) -> str:
        budget = "None" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"MemoryBudget(budget={budget}, current={format_bytes(self.current_bytes)}, "
            f"peak={format_bytes(self.peak_bytes)}, ooms={self.num_ooms})"
        )

    # ------------------------------------------------------------------ tracking
    def _counts(self, st: torch.UntypedStorage) -> bool:
        dev = st.device
        if dev.type == "meta":
            return False
        if self.device is None:
            return True
        if dev.type != self.device.type:
            return False
        return self.device.index is None or dev.index == self.device.index

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live.get(key)
            # The address may already belong to a newer storage: only drop our own entry.
            if entry is not None and entry[0] is ref:
                del self._live[key]
                self._tracked -= entry[1]

    def _register(self, st: torch.UntypedStorage, cost: int) -> None:
        key = storage_key(st)
        ref = weakref.ref(st, lambda r, k=key: self._on_free(k, r))
        self._live[key] = (ref, cost)
        self._tracked += cost

    def _fsdp_allocating(self, tensor: torch.Tensor, nbytes: int) -> None:
        """FSDP2 is about to give ``tensor``'s storage ``nbytes`` in place: counted as an allocation (refused past the
        budget, before it happens)."""
        st = tensor.untyped_storage()
        if not self._counts(st):
            return
        cost = _storage_cost(st, nbytes)
        with self._lock:
            key = storage_key(st)
            entry = self._live.get(key)
            delta = cost - (entry[1] if entry is not None else 0)
            if delta > 0 and self.budget_bytes is not None and self.current_bytes + delta > self.budget_bytes:
                self._raise_oom("FSDP2's alloc_storage (UntypedStorage.resize_)", delta)
            if entry is None:
                self._register(st, cost)
            else:
                self._tracked += delta
                self._live[key] = (entry[0], cost)
            self._peak = max(self._peak, self.current_bytes)

    def _fsdp_freed(self, tensor: torch.Tensor) -> None:
        """FSDP2 emptied ``tensor``'s storage in place: its bytes stop counting (the storage object lives on)."""
        with self._lock:
            key = storage_key(tensor.untyped_storage())
            entry = self._live.get(key)
            if entry is not None:
                self._tracked -= entry[1]
                self._live[key] = (entry[0], 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not out_tensors:
            return out
        with self._lock:
            new: dict[int, tuple[torch.UntypedStorage, int]] = {}
            grown: list[tuple[int, int]] = []  # (key, new cost) of tracked storages that grew
            input_keys: set[int] | None = None
            for t in out_tensors:
                for st in _storages(t):
                    if not self._counts(st):
                        continue
                    key = storage_key(st)
                    entry = self._live.get(key)
                    if entry is not None:
                        cost = _storage_cost(st)
                        if cost != entry[1]:
                            grown.append((key, cost))
                        continue
                    if key in new:
                        continue
                    if input_keys is None:
                        input_keys = {
                            storage_key(s)
                            for a in tree_flatten((args, kwargs))[0]
                            if isinstance(a, torch.Tensor)
                            for s in _storages(a)
                        }
                    if key in input_keys:
                        continue  # a view or in-place result of a tensor from before the budget
                    new[key] = (st, _storage_cost(st))
            delta = sum(c for _, c in new.values()) + sum(c - self._live[k][1] for k, c in grown)
            if delta > 0 and self.budget_bytes is not None and self.current_bytes + delta > self.budget_bytes:
                self._raise_oom(func, delta)
            for key, cost in grown:
                ref, _ = self._live[key]
                self._tracked += cost - self._live[key][1]
                self._live[key] = (ref, cost)
            for st, cost in new.values():
                self._register(st, cost)
            if self.current_bytes > self._peak:
                self._peak = self.current_bytes
        return out

    def _raise_oom(self, func: Any, requested: int) -> None:
        self.num_ooms += 1
        budget = self.budget_bytes or 0
        current = self.current_bytes
        device = str(self.device) if self.device is not None else "all devices"
        self.last_oom = {
            "op": str(func),
            "requested_bytes": requested,
            "current_bytes": current,
            "budget_bytes": budget,
            "peak_bytes": self._peak,
        }
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_bytes(requested)}. "
            f"Budget of {format_bytes(budget)} on {device} "
            f"({format_bytes(current)} already allocated: {format_bytes(self._tracked)} tracked + "
            f"{format_bytes(self.baseline_bytes)} baseline; {format_bytes(max(budget - current, 0))} free; "
            f"peak {format_bytes(self._peak)}) while running {func}. "
            f"[simulated by lit_memopt.memory.memory_budget; no real device ran out of memory]"
        )


def memory_budget(
    budget_bytes: int | None,
    *,
    device: str | torch.device | None = None,
    baseline_bytes: int = 0,
) -> MemoryBudget:
    """A context manager that raises ``torch.OutOfMemoryError`` when live tensor bytes pass a budget.

    Returns a :class:`MemoryBudget` (use it in ``with``; ``as`` gives the tracker with
    ``current_bytes``, ``peak_bytes``, ``reset_peak()``, ``num_ooms``). See :class:`MemoryBudget`
    for what is counted: storages created inside the context; tensors that existed before entering
    are the baseline, declared with ``baseline_bytes``.

    Example::

        from lit_memopt.memory import memory_budget

        with memory_budget(8 * 2**20) as mb:     # 8 MiB of new tensors at most
            loss = model(x).sum()
            loss.backward()                      # may raise torch.OutOfMemoryError
        print(mb.peak_bytes)
    """
    return MemoryBudget(budget_bytes, device=device, baseline_bytes=baseline_bytes)



def training_budget(value: Any, *objs: Any, device: str | torch.device | None = None, key: str = "memory_budget") -> MemoryBudget | None:
    """The :class:`MemoryBudget` that ``lit-memopt fit ... memory_budget=200MiB`` trains under, or ``None`` for ``None``.

    ``value`` is a size as text (``200MiB``, ``2GiB``, ``5e8``; see :func:`~lit_memopt.memory.search.parse_memory_size`).
    The tensors of ``objs`` that exist now (the module's weights, built before ``fit``) are the baseline, so
    the budget reads like a device's whole memory: weights, gradients, optimizer states, activations,
    temporaries and batches, all as live tensor bytes. It is not the CUDA caching allocator: no block
    rounding on CPU, no cached-but-free segments, no CUDA context; compare a budget with an estimate's
    *allocated* peak, not its reserved one.

    Raises:
        ValueError: ``value`` is not a memory size (one line naming ``key``).
    """
    if value is None:
        return None
    # parse_memory_size lives with the search that reads gpu_memory; imported here to keep this module's imports light
    from lit_memopt.memory.search import parse_memory_size

    size = parse_memory_size(value, key=key)
    baseline = storage_bytes(*objs)
    if size <= baseline:
        raise ValueError(
            f"{key}={value!r} ({format_bytes(size)}) is not more than the model's weights already built "
            f"({format_bytes(baseline)}); give a larger budget"
        )
    return MemoryBudget(size, device=device, baseline_bytes=baseline)
