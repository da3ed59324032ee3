"""Text generation at its worst case under fake tensors: every response runs to ``max_new_tokens``.

Fake tensors have shapes but no values, while a generation loop reads values (has every row emitted its
end-of-sequence token yet?), and so do the steps built on it (which tokens are responses, how many there are).
:class:`WorstCaseValues` is a dispatch mode that keeps the real values of the small tensors whose values are
knowable without weights (token ids, masks, counters: computed from the batch and from constants) and fixes
the one value that depends on the weights and that generation branches on: every sampled token is a filler
token that is not end-of-sequence. A generation stop then answers "continue" exactly as a real run that never
samples EOS would, and every response is ``max_new_tokens`` long: the step's largest memory for that batch.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from lit_memopt._compat.torch import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    TorchDispatchMode,
    current_fake_mode,
    disable_current_modes,
    fake_dispatch,
    local_scalar_dense_op,
    op_schema,
    storage_key,
    tree_flatten,
    tree_map,
    tree_unflatten,
)

__all__ = ["WorstCaseValues", "UnknownValueError", "filler_token_id", "VALUE_NUMEL_LIMIT", "WORST_CASE_METHOD"]

aten = torch.ops.aten

# Values are kept only for tensors up to this many elements: token ids and masks of any real batch
# (a 64 x 32k rollout is 2M), never activations, so following values costs little next to the trace.
VALUE_NUMEL_LIMIT = 1 << 22
# The ops whose output is the policy's choice of token: forced to the filler.
_SAMPLERS = (aten.multinomial.default,)
# What ``Tensor.item()`` dispatches to.
_ITEM = local_scalar_dense_op()
WORST_CASE_METHOD = "generation at its worst case: every response runs to max_new_tokens (sampled tokens forced to a non-EOS filler)"


class UnknownValueError(RuntimeError):
    """The step reads a value that depends on the weights (other than a sampled token): no worst case for it."""


def filler_token_id(tokenizer: Any, model_config: Any = None, vocab_size: int | None = None) -> int:
    """A token id that is no special token (not EOS, pad, BOS): what every sampled token becomes.

    A printable letter where the tokenizer has one, so that decoded responses are as long as their
    tokens (no whitespace stripped away by a reward parser).
    """
    special: set[int] = set()
    for owner in (tokenizer, model_config):
        for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
            value = getattr(owner, name, None) if owner is not None else None
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int):
                    special.add(v)
        special.update(int(i) for i in (getattr(owner, "all_special_ids", None) or []) if owner is not None)
    if tokenizer is not None:
        try:
            ids = tokenizer("a", add_special_tokens=False)["input_ids"]
        except Exception:  # noqa: BLE001 - any tokenizer that cannot encode falls back to the first plain id
            ids = []
        if len(ids) == 1 and int(ids[0]) not in special and (vocab_size is None or int(ids[0]) < vocab_size):
            return int(ids[0])
    candidate = 0
    while candidate in special:
        candidate += 1
    if vocab_size is not None and candidate >= vocab_size:
        raise ValueError(f"no token id below vocab_size={vocab_size} is free of special tokens {sorted(special)}")
    return candidate


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an in-place or ``out=`` op writes to."""
    schema = op_schema(func)
    if not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
            written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


def _same_layout(fake: torch.Tensor, real: torch.Tensor) -> bool:
    return (
        tuple(fake.shape) == tuple(real.shape)
        and tuple(fake.stride()) == tuple(real.stride())
        and fake.storage_offset() == real.storage_offset()
        and fake.dtype == real.dtype
        and fake.untyped_storage().nbytes() <= real.untyped_storage().nbytes()
    )


def _storage_key(t: torch.Tensor) -> int:
    return storage_key(t.untyped_storage())


class WorstCaseValues(TorchDispatchMode):
    """Follow the values of small weight-independent tensors through a fake-tensor step; sampled tokens are the filler.

    Enter it inside ``FakeTensorMode`` (and inside a memory tracker, so that the tensors it creates for
    value-dependent shapes are counted). Value-dependent ops (``.item()``, ``nonzero``, boolean indexing,
    ``unique``) whose inputs have known values are answered from those values; boolean indexing of an
    activation by a known mask becomes indexing by the mask's positions (the same output shape). Anything
    else that reads a value computed from the weights raises :class:`UnknownValueError`.

    Args:
        filler_token_id: the id every sampled token gets (see :func:`filler_token_id`).

    Example::

        with fake_mode(allow_non_fake_inputs=True) as mode:
            values = WorstCaseValues(filler_token_id=97)
            fake_ids = mode.from_tensor(ids)
            values.track(fake_ids, ids)
            with values:
                rollout = generate(model, fake_ids, max_new_tokens=64)   # 64 new tokens, always
    """

    def __init__(self, filler_token_id: int) -> None:
        super().__init__()
        self.filler_token_id = int(filler_token_id)
        self.sampled_tokens = 0
        self._values = WeakTensorKeyDictionary()
        # Storages written by an op with an unknown input: every view of them has lost its value.
        self._stale: set[int] = set()

    # ------------------------------------------------------------------ values
    def track(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Record that ``fake`` holds the values of ``real`` (e.g. a batch converted to fake tensors)."""
        with disable_current_modes():  # called inside fake mode: the copy must stay real
            self._set(fake, real.detach().to("cpu"))

    def _set(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        # Same layout or nothing: a later as_strided/_reshape_alias replays the fake's strides and offset on
        # the values, which must then address the same elements (else a real kernel reads past their storage).
        if not _same_layout(fake, real):
            with disable_current_modes():  # a batch tensor or a filler: same values in the fake's layout
                laid_out = torch.empty_strided(tuple(fake.shape), tuple(fake.stride()), dtype=fake.dtype)
                if fake.storage_offset() != 0 or laid_out.untyped_storage().nbytes() < fake.untyped_storage().nbytes():
                    return  # a view into a larger storage: its values are not followed
                real = laid_out.copy_(real)
        self._values[fake] = real
        # Its storage is fresh or known: a storage address marked stale belonged to a tensor since freed.
        self._stale.discard(_storage_key(fake))

    def value_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real values of ``t``, or ``None`` when they depend on the weights (or were not followed)."""
        if not isinstance(t, FakeTensor):
            return t  # a real tensor next to fake ones (LoRA adapters, constants): its values are known
        if _storage_key(t) in self._stale:
            return None
        return self._values.get(t)

    def _known_arguments(self, args: tuple, kwargs: dict) -> tuple[list[Any], Any, bool]:
        """``(values, spec, known)``: the arguments with each tensor's values, when all are known (``known``);
        at the first unknown one the rest is not looked at (callers use the values only when all are known)."""
        flat, spec = tree_flatten((args, kwargs))
        values = []
        for a in flat:
            if isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
                return values, spec, False  # a fake tensor's storage has no memory behind it: never hand it to a real kernel
            elif isinstance(a, torch.Tensor):
                v = self.value_of(a)
                # Values are replayed with the fake's own sizes and strides (as_strided, views): a value whose layout
                # has drifted from its fake tensor's (an in-place view op on an aliased value) is not used.
                if v is None or not (v is a or _same_layout(a, v)):
                    return values, spec, False
                values.append(v)
            elif isinstance(a, torch.device):
                values.append(torch.device("cpu"))  # values live on the CPU whatever the fake device
            else:
                values.append(a)
        return values, spec, True

    def _run_on_values(self, func: Any, values: list[Any], spec: Any) -> Any:
        args, kwargs = tree_unflatten(values, spec)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        # Outside every mode: a real computation, neither tracked as memory nor turned into fake tensors.
        with disable_current_modes(), torch.no_grad():
            return func(*args, **kwargs)

    def _remember(self, fake_out: Any, real_out: Any) -> None:
        fakes = [t for t in tree_flatten(fake_out)[0] if isinstance(t, torch.Tensor)]
        reals = [t for t in tree_flatten(real_out)[0] if isinstance(t, torch.Tensor)]
        if len(fakes) != len(reals):
            return
        for fake, real in zip(fakes, reals):
            if isinstance(fake, FakeTensor) and tuple(fake.shape) == tuple(real.shape):
                self._set(fake, real)

    def _lose(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, FakeTensor):
                self._stale.add(_storage_key(t))

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _ITEM:
            value = self.value_of(args[0])
            if value is None:
                try:
                    return func(*args, **kwargs)  # fake mode knows its own one-element constants (optimizer step counts)
                except DataDependentOutputException:
                    pass
                raise UnknownValueError(
                    "the step reads the value of a tensor computed from the weights (.item(), a comparison in an "
                    "if, .tolist()); only sampled tokens have a worst case (the filler), other values have none"
                )
            with disable_current_modes():
                return value.item()
        try:
            # Right above the fake mode: an op its dispatch cache answers is read from it, not dispatched again.
            mode = current_fake_mode()
            out = func(*args, **kwargs) if mode is None else fake_dispatch(mode, func, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return self._value_dependent_shape(func, args, kwargs)
        if func in _SAMPLERS:
            self.sampled_tokens += out.numel()
            with disable_current_modes():
                self._set(out, torch.full(tuple(out.shape), self.filler_token_id, dtype=out.dtype))
            return out
        self._follow(func, args, kwargs, out)
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        written = _written_arguments(func, args, kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outputs and not written:
            return
        # Followed only where every input's values are known; the cheap reasons not to follow are asked first:
        # a real tensor written by the op (a LoRA weight in an optimizer step) is the user's: never replayed on;
        # unchecked indexing kernels trust their indices: a replay on values must never write out of bounds.
        if (any(t.numel() > VALUE_NUMEL_LIMIT for t in (*outputs, *written)) or torch.Tag.nondeterministic_seeded in func.tags
                or func.__name__.startswith("_unsafe") or not all(isinstance(t, FakeTensor) for t in written)):
            self._lose(written)
            return
        values, spec, known = self._known_arguments(args, kwargs)
        if not known:
            self._lose(written)
            return
        try:
            real_out = self._run_on_values(func, values, spec)
        except Exception:  # noqa: BLE001 - an op the values cannot replay: its outputs are simply not followed
            self._lose(written)
            return
        self._remember(out, real_out)

    def _fake_like(self, real: torch.Tensor, device: torch.device) -> torch.Tensor:
        # Through the modes below this one: the memory tracker counts it and fake mode makes it fake.
        fake = torch.empty(tuple(real.shape), dtype=real.dtype, device=device)
        self._set(fake, real)
        return fake

    def _value_dependent_shape(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op whose output shape depends on values (``nonzero``, ``x[mask]``, ``unique``)."""
        fakes = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, FakeTensor)]
        device = fakes[0].device if fakes else torch.device("cpu")
        values, spec, known = self._known_arguments(args, kwargs)
        if known:
            real_out = self._run_on_values(func, values, spec)
            return tree_map(lambda r: self._fake_like(r, device) if isinstance(r, torch.Tensor) else r, real_out)
        if func is aten.index.Tensor:
            data, indices = args[0], list(args[1])
            positions: list[Any] = []
            for index in indices:
                mask = self.value_of(index) if isinstance(index, torch.Tensor) else None
                if index is not None and index.dtype in (torch.bool, torch.uint8):
                    if mask is None:
                        break
                    with disable_current_modes():
                        columns = mask.bool().nonzero().unbind(1)
                    positions.extend(self._fake_like(column, device) for column in columns)
                elif index is None or mask is not None:
                    positions.append(index)
                else:
                    break
            else:
                out = func(data, positions)
                self._follow(func, (data, positions), {}, out)
                return out
        if func is aten.masked_select.default:
            mask = self.value_of(args[1])
            if mask is not None:
                with disable_current_modes():
                    count = int(torch.broadcast_to(mask.bool(), torch.broadcast_shapes(args[0].shape, mask.shape)).sum())
                return torch.empty(count, dtype=args[0].dtype, device=device)
        raise UnknownValueError(
            f"{func} has an output whose shape depends on values computed from the weights; the worst case of "
            "generation does not say what they are"
        )
