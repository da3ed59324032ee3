"""Private names of core torch (not ``torch.distributed``), each behind one function or re-export that says why.

Pure PyTorch: ``lit_memopt.ops`` imports this module, so it never imports Lightning. The modules imported at the top
are the ones ``import torch`` has loaded already; the rest are imported where they are used. ``tests/test_compat.py``
checks every name listed in :data:`PRIVATE_NAMES` against the installed torch.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

# Fake tensors (shapes, dtypes and devices, no storage) are how an estimate runs a 4B model's step on a CPU. torch has
# them only under torch._subclasses (torch.export and torch.compile use them inside); no public module re-exports them.
from torch._subclasses import fake_tensor as _fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

# The fake mode active now (the one an op runs under), which a tracker compares with the one it was entered in. torch
# keeps it in its tracing guards; there is no public getter.
from torch._guards import active_fake_mode

# The state torch threads through building a dispatch-cache key (see FastFakeTensorMode below).
from torch._subclasses._fake_tensor_utils import _CacheKeyState

# Dispatch modes see every ATen op (forward, autograd's backward, optimizer updates): the memory-budget simulator and
# the worst-case value follower are modes. Documented by torch (``__torch_dispatch__``), but only under this module.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

# torch's pytree flattens op arguments and outputs exactly as the dispatcher does (its registered node types) and
# unflattens them with a spec; torch 2.13 has no public pytree module, and Lightning's ``apply_to_collection``
# keeps no spec to rebuild an op's ``(args, kwargs)`` from.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "FastFakeTensorMode",
    "fake_dispatch",
    "current_fake_mode",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "is_fake",
    "active_fake_mode",
    "TorchDispatchMode",
    "is_traceable_wrapper_subclass",
    "disable_current_modes",
    "tree_flatten",
    "tree_unflatten",
    "tree_map",
    "tree_leaves",
    "storage_key",
    "op_schema",
    "local_scalar_dense_op",
    "raised_recompile_limit",
    "cpu_has_native_low_precision_matmul",
    "start_cuda_memory_history",
    "stop_cuda_memory_history",
    "dump_cuda_memory_snapshot",
    "reset_grad_scaler_step",
    "tensor_version",
    "view_base",
    "is_counted_by_lr_scheduler",
    "mark_counted_by_lr_scheduler",
    "PRIVATE_NAMES",
]


# ------------------------------------------------------------------------------------ tensors and ops
def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor, or a wrapper subclass (DTensor) around one: torch has no public predicate."""
    return bool(_fake_tensor.is_fake(t))


def storage_key(storage: torch.UntypedStorage) -> int:
    """A key that tells storages apart while they live, fake and meta ones included.

    ``untyped_storage()`` returns a new Python object at every call, so ``id`` cannot key it, and ``data_ptr()`` is 0
    for every empty, meta or fake storage; ``_cdata`` is the address of the storage itself.
    """
    return storage._cdata


def op_schema(func: Any) -> Any:
    """The ``FunctionSchema`` of an ATen op overload (its arguments, which ones it writes): no public accessor."""
    return func._schema


def local_scalar_dense_op() -> Any:
    """The ATen op that ``Tensor.item()`` dispatches to: a dispatch mode that answers ``.item()`` must match it."""
    return torch.ops.aten._local_scalar_dense.default


@contextlib.contextmanager
def raised_recompile_limit(graphs: int | None) -> Iterator[None]:
    """Let torch.compile keep at least ``graphs`` graphs per function inside the block; the user's limit is back after.

    ``torch.compiler`` exposes no setting for it; dynamo's config does, under ``recompile_limit`` (``cache_size_limit``
    before torch 2.6). Past the limit a function runs eagerly without a word.
    """
    if graphs is None:  # nothing to raise: dynamo is not even imported
        yield
        return
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    previous = getattr(config, name)
    raise_it = previous < graphs
    if raise_it:
        setattr(config, name, graphs)
    try:
        yield
    finally:
        if raise_it:
            setattr(config, name, previous)


def cpu_has_native_low_precision_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bf16/fp16) matrices in hardware (oneDNN's check of the ISA).

    ``torch.backends.mkldnn`` says only whether oneDNN is built in, not what the CPU runs natively.
    """
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# ------------------------------------------------------------------------------------ the fake-tensor dispatch cache
# An estimate runs tens of thousands of fake ops; almost all of them are answered from FakeTensorMode's dispatch cache
# (output metadata keyed by the op and its arguments' metadata). Building torch's key costs more than the rest of a
# cache hit (a dataclass of 17 fields per tensor, flattened element by element): FastFakeTensorMode builds an
# equivalent key in one pass, and fake_dispatch answers a hit from a mode right above the fake one without dispatching
# again (and a few calls torch never caches, each from what torch itself answered the first time). They use the cache
# torch keeps and its own code to make the outputs, so every output is the one torch would have made.
class _KeyFallback(Exception):
    """An argument the lean key does not describe (symbolic sizes, a nested dict, a graph): torch's key is used."""


_LEAN_KEY = object()  # first element of every lean key: never equal to one of torch's keys


class FastFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose dispatch-cache key is built in one pass (same cache, same outputs, about 20x cheaper).

    torch's key (``FakeTensorMode._cache_key``) describes each fake argument by dtype, shape, stride, device, layout,
    memory format, storage offset and size, ``requires_grad``, conjugate/negative/inference bits and sparse fields, and
    every other argument by its type and value. The lean key keeps the same facts: the memory format follows from the
    shape and strides, the sparse fields and ``is_quantized`` from a strided layout and the dtype, so leaving them out
    tells no two calls apart that torch's key tells apart. Anything else (a shape environment, symbolic sizes, sparse
    tensors, graph or function arguments) takes torch's own key. Checked against the stock mode by the tripwire of
    ``FakeTensorMode._cache_key`` in ``tests/test_compat.py``.

    A deep copy of one of its fakes (a frozen reference copied from the policy) stays in this mode, see
    :meth:`__deepcopy__`.
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> FastFakeTensorMode:
        """The mode itself: a mode is the context its fakes live in, not data of theirs.

        ``Tensor.__deepcopy__`` deep-copies a fake's ``__dict__``, and with it the ``fake_mode`` held there. A copied
        mode copies its converter's ``constant_storage_mapping``, whose ``StorageWeakRef`` keys are copied field by
        field: the copy holds the same raw weak pointer without taking a weak reference of its own, so the storage's
        weak count is released twice, once by each key's ``__del__``, and the storage is freed while a key still
        points at it. Released later, that key read freed memory: the segmentation faults of a plan's or an
        estimate's teardown after a traced Intuitor step (valgrind: an invalid read in ``THPStorage_freeWeakRef``
        from ``StorageWeakRef.__del__``). Shared, the copy's fakes are also this mode's own: no conversion on use.
        """
        memo[id(self)] = self
        return self

    def _cache_key(self, state: Any, func: Any, args: Any, kwargs: Any) -> Any:
        if self.shape_env is None:
            key: list[object] = [_LEAN_KEY, func, torch.get_default_dtype(), torch._C._get_default_device(),
                                 torch.is_inference_mode_enabled(), _proxy_mode() is not None]
            try:
                if args:
                    self._lean_into(key, args)
                if kwargs:
                    key.append(len(kwargs))
                    key.extend(kwargs)
                    self._lean_into(key, kwargs.values())
            except _KeyFallback:
                pass
            else:
                return _fake_tensor._DispatchCacheKey(tuple(key))
        return super()._cache_key(state, func, args, kwargs)

    def _lean_into(self, key: list[object], args: Any) -> None:
        for arg in args:
            if isinstance(arg, FakeTensor):
                if arg.fake_mode is not self:
                    raise _fake_tensor._BypassDispatchCache("not our fake")
                if arg.constant is not None:
                    raise _fake_tensor._BypassDispatchCache("constant attribute")
                if arg.layout is not torch.strided or arg._has_symbolic_sizes_strides:
                    raise _KeyFallback
                key.append((arg.dtype, tuple(arg.shape), arg.stride(), arg.fake_device, arg.storage_offset(),
                            arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                            arg.is_inference()))
            elif isinstance(arg, (list, tuple)):
                key.append(type(arg))
                key.append(len(arg))
                self._lean_into(key, arg)
            elif isinstance(arg, torch.Tensor):
                raise _fake_tensor._BypassDispatchCache("non-fake tensor")
            elif isinstance(arg, (dict, torch.SymInt, torch.SymFloat, torch.SymBool, torch.fx.GraphModule)) or callable(arg):
                raise _KeyFallback
            else:
                key.append(type(arg))  # 1 and 1.0 are equal keys but give different dtypes
                key.append(arg)


def _proxy_mode() -> Any:
    """The active proxy (tracing) mode, which torch's key records; looked up once (an import per op cost 1.5%)."""
    global _get_proxy_mode
    if _get_proxy_mode is None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        _get_proxy_mode = get_proxy_mode
    return _get_proxy_mode()


_get_proxy_mode: Callable[[], Any] | None = None


# The dispatcher keeps the active fake mode in a slot of its own (not on the stack of user modes).
_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE
# Lean keys of ``out=`` ops (which torch never caches) seen to return their ``out`` argument unchanged, and of
# ``_unsafe_view`` calls seen to give exactly what ``view`` gives.
_RETURNS_OUT: set[Any] = set()
_VIEW_LIKE: set[Any] = set()
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_VIEW = torch.ops.aten.view.default


def fake_dispatch(mode: FakeTensorMode, func: Any, args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` from a dispatch mode stacked right above fake mode ``mode``, answered from its cache.

    For the memory tracker: a cache hit skips the second trip through the dispatcher into the fake mode, which cost as
    much as the hit itself. The answer is torch's (its cache entry and ``_output_from_cache_entry``: new fake tensors,
    views sharing their base's storage, in-place ops returning their argument). An ``out=`` op, which torch does not
    cache, returns its ``out`` tensor when the same call (same lean key) did so before with ``out`` unchanged: its fake
    kernel computes a result, copies it into ``out`` and returns ``out``, inside the fake mode, touching nothing else.
    ``_unsafe_view``, which torch does not cache either, is answered by ``view`` (see :func:`_unsafe_view`); inputs that
    are not the mode's fakes are converted as the mode converts them (see :func:`_with_inputs_converted`). Everything
    else (another mode in between, another fake mode active, an op the cache has not seen or bypasses, the cache off
    or cross-checked) dispatches as usual.
    """
    if (torch._C._len_torch_dispatch_stack() != 1 or torch._C._get_dispatch_mode(_FAKE_MODE_KEY) is not mode
            or not isinstance(mode, FastFakeTensorMode) or not mode.cache_enabled or mode.cache_crosscheck_enabled
            or mode.shape_env is not None):
        return func(*args, **kwargs)
    state = _CacheKeyState(None)
    try:
        key = mode._cache_key(state, func, args, kwargs)
    except _fake_tensor._BypassDispatchCache:
        converted = _with_inputs_converted(mode, func, args, kwargs)
        if converted is None:
            return func(*args, **kwargs)
        try:
            state = _CacheKeyState(None)
            key = mode._cache_key(state, func, *converted)
        except _fake_tensor._BypassDispatchCache:
            return func(*args, **kwargs)
        args, kwargs = converted
    entry = FakeTensorMode.cache.get(key)
    if entry is not None and not isinstance(entry, _fake_tensor._DispatchCacheBypassEntry):
        FakeTensorMode.cache_hits += 1
        return mode._output_from_cache_entry(state, entry, key, func, args)
    if func is _UNSAFE_VIEW:
        return _unsafe_view(mode, key, args, kwargs)
    out = kwargs.get("out")
    if type(out) is not FakeTensor:
        return func(*args, **kwargs)
    if key in _RETURNS_OUT:
        return out
    before = _layout(out)
    result = func(*args, **kwargs)
    if result is out and _layout(out) == before:
        _RETURNS_OUT.add(key)
    return result


def _unsafe_view(mode: FakeTensorMode, key: Any, args: Any, kwargs: Any) -> Any:
    """``aten._unsafe_view`` (what ``linear`` and ``matmul`` reshape their products with), which torch never caches.

    Under fake tensors it is ``view`` (the same sizes, strides and offset, on the input's storage); it is only not
    a view to autograd, which sits above the tracker and sees the op that was called. Answered by the cached ``view``
    once a first call with the same lean key was seen to give exactly what ``view`` gives.
    """
    as_view = (args[0], list(args[1]))
    if key in _VIEW_LIKE:
        return fake_dispatch(mode, _VIEW, as_view, {})
    result = _UNSAFE_VIEW(*args, **kwargs)
    try:
        view = fake_dispatch(mode, _VIEW, as_view, {})
    except Exception:  # noqa: BLE001 - not viewable: keep dispatching it as it is
        return result
    same_storage = storage_key(view.untyped_storage()) == storage_key(result.untyped_storage()) == storage_key(
        args[0].untyped_storage())
    if same_storage and type(view) is type(result) and _layout(view) + _flags(view) == _layout(result) + _flags(result):
        _VIEW_LIKE.add(key)
    return result


def _flags(t: torch.Tensor) -> tuple[Any, ...]:
    return t.requires_grad, t.is_conj(), t.is_neg(), getattr(t, "fake_device", None), getattr(t, "constant", None) is None


def _with_inputs_converted(mode: FakeTensorMode, func: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """``(args, kwargs)`` with each tensor that is not ``mode``'s fake (a real LoRA adapter, a frozen copy's weight made
    under another fake mode) replaced by the fake tensor ``mode`` converts it to, or ``None``.

    torch never caches such a call: it converts those tensors (``validate_and_convert_non_fake_tensors``: the
    converter's memo gives the same fake tensor for the same tensor every time) and then treats the call as one on its
    own fakes. Calling with the converted tensors is that same call, now cacheable, wherever nothing before the
    conversion could decide otherwise: no constant propagation on real values (one of the mode's own fakes is among
    the inputs, or the op is not one that binds Python numbers to tensors: ``t`` of a real adapter weight), the op
    writes none of its inputs (a real one would be written through its copy) and is no lift, real inputs are plain
    tensors or parameters (no subclass to hand back to), and the mode accepts real inputs.
    """
    if (not mode.allow_non_fake_inputs or _fake_tensor.fake_tensor_tls.allow_non_fake_inputs_override is not None
            or func in mode.lift_fns or op_schema(func).is_mutable or torch.Tag.inplace_view in func.tags):
        return None
    flat, spec = tree_flatten((args, kwargs))
    others = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and not mode.is_our_fake(a)]
    if not others or (len(others) == sum(isinstance(a, torch.Tensor) for a in flat)
                      and _fake_tensor.should_allow_numbers_as_tensors(func)):
        return None
    if any(not isinstance(flat[i], FakeTensor) and type(flat[i]) not in (torch.Tensor, torch.nn.Parameter) for i in others):
        return None
    # Converted as inside the fake mode's own dispatch: with the fake mode out of its slot.
    previous = torch._C._unset_dispatch_mode(_FAKE_MODE_KEY)
    try:
        for i in others:
            flat[i] = mode.fake_tensor_converter.from_real_tensor(mode, flat[i])
    finally:
        torch._C._set_dispatch_mode(previous)
    return tree_unflatten(flat, spec)


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes()


def current_fake_mode() -> FakeTensorMode | None:
    """The fake mode active now: :func:`active_fake_mode` without walking the mode stack (a fake mode is always held
    in the dispatcher's one slot for it, which a nested fake mode takes over while it is entered)."""
    return torch._C._get_dispatch_mode(_FAKE_MODE_KEY)


# ------------------------------------------------------------------------------------ CUDA allocator history
def start_cuda_memory_history(max_entries: int) -> None:
    """Record the CUDA allocator's events (with stack traces) for a later snapshot.

    The memory-snapshot API documented at https://pytorch.org/docs/stable/torch_cuda_memory.html has only these
    underscore names; ``torch.accelerator.memory`` has no recorder.
    """
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    """Stop recording the CUDA allocator's events (see :func:`start_cuda_memory_history`)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded allocator history as a pickle for https://pytorch.org/memory_viz (see above)."""
    torch.cuda.memory._dump_snapshot(path)


# ------------------------------------------------------------------------------------ optimizers
def reset_grad_scaler_step(scaler: Any) -> None:
    """Forget what a ``GradScaler`` recorded about this step's optimizers (``unscale_`` done, infs found).

    After a micro-batch that ran out of memory the step starts again; ``GradScaler.update()`` would clear this too but
    also changes the scale. A scaler without this state (not torch's) is left alone.
    """
    if not hasattr(scaler, "_per_optimizer_states"):
        return
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (views share it with their base): whether an update touched ``t``.

    Autograd keeps it to detect in-place changes of saved tensors and exposes it only as ``_version``.
    """
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``None`` when ``t`` owns its storage): how activation offload tells a saved
    ``weight.t()`` from an activation. Autograd exposes it only as ``_base``."""
    return t._base


def is_counted_by_lr_scheduler(step: Callable[..., Any]) -> bool:
    """Whether ``optimizer.step`` is an LR scheduler's counting wrapper (it marks it with an attribute)."""
    return hasattr(step, "_wrapped_by_lr_sched")


def mark_counted_by_lr_scheduler(step: Callable[..., Any]) -> None:
    """Mark a wrapper of ``optimizer.step`` that still calls the scheduler's counting wrapper inside.

    Without the mark the scheduler warns at its first step that ``optimizer.step()`` was overridden after it was
    created; the attribute is what it checks, with no public way to say so.
    """
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ the registry
# private name (as torch spells it) -> the function or re-export of this module that wraps it
PRIVATE_NAMES: dict[str, str] = {
    "torch._subclasses.fake_tensor.FakeTensorMode._cache_key": "FastFakeTensorMode",
    "torch._subclasses.fake_tensor._DispatchCacheKey": "FastFakeTensorMode",
    "torch._subclasses.fake_tensor._BypassDispatchCache": "FastFakeTensorMode",
    "torch.Tensor()._has_symbolic_sizes_strides": "FastFakeTensorMode",
    "torch._C._get_default_device": "FastFakeTensorMode",
    "torch._subclasses._fake_tensor_utils._CacheKeyState": "fake_dispatch",
    "torch._subclasses.fake_tensor.FakeTensorMode._output_from_cache_entry": "fake_dispatch",
    "torch._subclasses.fake_tensor._DispatchCacheBypassEntry": "fake_dispatch",
    "torch._C._len_torch_dispatch_stack": "fake_dispatch",
    "torch.ops.aten._unsafe_view": "fake_dispatch",
    "torch._C._unset_dispatch_mode": "fake_dispatch",
    "torch._subclasses.fake_tensor.should_allow_numbers_as_tensors": "fake_dispatch",
    "torch._subclasses.fake_tensor.fake_tensor_tls": "fake_dispatch",
    "torch._C._set_dispatch_mode": "fake_dispatch",
    "torch._C._get_dispatch_mode": "current_fake_mode",
    "torch._C._TorchDispatchModeKey": "current_fake_mode",
    "torch._subclasses.fake_tensor.FakeTensor": "FakeTensor",
    "torch._subclasses.fake_tensor.FakeTensorMode": "FakeTensorMode",
    "torch._subclasses.fake_tensor.DataDependentOutputException": "DataDependentOutputException",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException": "DynamicOutputShapeException",
    "torch._subclasses.fake_tensor.is_fake": "is_fake",
    "torch._guards.active_fake_mode": "active_fake_mode",
    "torch.utils._python_dispatch.TorchDispatchMode": "TorchDispatchMode",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass": "is_traceable_wrapper_subclass",
    "torch.utils._python_dispatch._disable_current_modes": "disable_current_modes",
    "torch.utils._pytree.tree_flatten": "tree_flatten",
    "torch.utils._pytree.tree_unflatten": "tree_unflatten",
    "torch.utils._pytree.tree_map": "tree_map",
    "torch.utils._pytree.tree_leaves": "tree_leaves",
    "torch.UntypedStorage()._cdata": "storage_key",
    "torch._ops.OpOverload._schema": "op_schema",
    "torch.ops.aten._local_scalar_dense": "local_scalar_dense_op",
    "torch._dynamo.config.recompile_limit": "raised_recompile_limit",
    "torch.ops.mkldnn._is_mkldnn_bf16_supported": "cpu_has_native_low_precision_matmul",
    "torch.ops.mkldnn._is_mkldnn_fp16_supported": "cpu_has_native_low_precision_matmul",
    "torch.cuda.memory._record_memory_history": "start_cuda_memory_history",
    "torch.cuda.memory._dump_snapshot": "dump_cuda_memory_snapshot",
    "torch.amp.GradScaler()._per_optimizer_states": "reset_grad_scaler_step",
    "torch.amp.grad_scaler._refresh_per_optimizer_state": "reset_grad_scaler_step",
    "torch.Tensor()._version": "tensor_version",
    "torch.Tensor()._base": "view_base",
    "torch.optim.lr_scheduler (optimizer.step)._wrapped_by_lr_sched": "mark_counted_by_lr_scheduler",
}
