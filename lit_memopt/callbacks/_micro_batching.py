"""Micro-batching pieces behind ``OOMRecovery``: splitting any batch into micro-batches and choosing their sizes.

Nothing here knows about Lightning; ``oom_recovery.py`` wires it into the training loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = [
    "infer_batch_size",
    "slice_batch",
    "micro_batch_bounds",
    "per_sample_tokens",
    "shrink_size",
    "grow_size",
    "call_with_autocast_disabled",
]


# ---------------------------------------------------------------------------------------- batches
def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _contains_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_contains_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_contains_tensor(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_contains_tensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


def _first_tensor_rows(obj: Any) -> int | None:
    if isinstance(obj, torch.Tensor):
        return int(obj.shape[0]) if obj.ndim > 0 else None
    children: Any = ()
    if isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    for child in children:
        rows = _first_tensor_rows(child)
        if rows is not None:
            return rows
    return None


def _first_item_list_length(obj: Any) -> int | None:
    if isinstance(obj, (list, tuple)) and not _is_namedtuple(obj) and obj and not _contains_tensor(obj):
        return len(obj)
    children: Any = ()
    if isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    for child in children:
        n = _first_item_list_length(child)
        if n is not None:
            return n
    return None


def infer_batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor of rank >= 1.

    Not Lightning's ``extract_batch_size``: that counts a 0-dim tensor as a batch of 1 and cannot
    size a batch of non-tensor items (prompts, programs), both of which RL batches hold.

    A batch with no tensors (e.g. a list of prompts) has the length of its first list of items.

    Raises:
        ValueError: when neither exists.
    """
    rows = _first_tensor_rows(batch)
    if rows is None:
        rows = _first_item_list_length(batch)
    if rows is None:
        raise ValueError(
            f"OOMRecovery cannot infer the batch size of a {type(batch).__name__}: it has no tensor with a batch "
            "dimension and no list of items. Pass `split_fn` (and `batch_size_fn`) to OOMRecovery."
        )
    return rows


def _rebuild_mapping(original: Mapping, items: dict) -> Mapping:
    try:
        return type(original)(items)  # dict, OrderedDict, transformers.BatchEncoding
    except Exception:  # noqa: BLE001 - mapping types with other constructors fall back to a dict
        return dict(items)


def slice_batch(batch: Any, start: int, end: int, batch_size: int) -> Any:
    """Samples ``start:end`` of ``batch``, keeping its structure.

    Neither torch's pytree ``tree_map`` nor Lightning's ``apply_to_collection``: a list of ``batch_size``
    non-tensor items is one leaf to slice here, where both would descend into it; dataclasses and
    ``BatchEncoding`` are not registered pytree nodes, and ``apply_to_collection`` deep-copies dataclasses
    and refuses frozen ones.

    Tensors whose first dimension is ``batch_size`` are sliced (views, no copy); lists/tuples of
    non-tensor items of length ``batch_size`` (prompts, ids, ragged token lists) are sliced; mappings
    (``dict``, ``BatchEncoding``), tuples, named tuples, lists and dataclasses are rebuilt around
    their sliced members; everything else (0-dim tensors, scalars, strings) is passed unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return batch[start:end] if batch.ndim > 0 and batch.shape[0] == batch_size else batch
    if isinstance(batch, Mapping):
        return _rebuild_mapping(batch, {k: slice_batch(v, start, end, batch_size) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        if not _is_namedtuple(batch) and len(batch) == batch_size and not _contains_tensor(batch):
            return batch[start:end]
        items = [slice_batch(v, start, end, batch_size) for v in batch]
        if _is_namedtuple(batch):
            return type(batch)(*items)
        return type(batch)(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: slice_batch(getattr(batch, f.name), start, end, batch_size)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def micro_batch_bounds(batch_size: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(batch_size)`` in chunks of ``micro_batch_size`` (last may be shorter)."""
    step = max(1, min(micro_batch_size, batch_size))
    return [(s, min(s + step, batch_size)) for s in range(0, batch_size, step)]


def per_sample_tokens(batch: Any, key: str) -> torch.Tensor:
    """Per-sample token counts (a CPU int64 tensor) from the mask ``batch[key]`` (``[B, ...]``)."""
    mask = batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)
    if not isinstance(mask, torch.Tensor):
        raise KeyError(
            f"OOMRecovery(loss_weighting='tokens') needs a tensor mask under key {key!r} in every batch; "
            f"this {type(batch).__name__} has none. Set `token_mask_key` to the key of your loss mask."
        )
    counts = (mask != 0).reshape(mask.shape[0], -1).sum(dim=1)
    return counts.to("cpu", torch.int64)  # one host sync per step, not per micro-batch


# ------------------------------------------------------------------------------------- sizes
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shrink_size(current: int, batch_size: int, policy: str) -> int:
    """The next smaller micro-batch size: half (rounded up), or the next smaller divisor of ``batch_size``."""
    current = min(current, batch_size)
    if policy == "divisor":
        smaller = [d for d in _divisors(batch_size) if d < current]
        return smaller[-1] if smaller else 1
    return max(1, (current + 1) // 2)


def grow_size(current: int, batch_size: int, policy: str) -> int:
    """The next larger micro-batch size (double, or the next larger divisor), capped at ``batch_size``."""
    if current >= batch_size:
        return batch_size
    if policy == "divisor":
        larger = [d for d in _divisors(batch_size) if d > current]
        return larger[0] if larger else batch_size
    return min(batch_size, current * 2)


# ------------------------------------------------------------------------------- autocast
def call_with_autocast_disabled(fn: Callable[[], Any], device_type: str) -> Any:
    """Run ``fn`` with autocast off for ``device_type``: backward must not run under the forward's autocast."""
    if device_type in ("cuda", "cpu", "xpu", "mps", "hpu") and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type=device_type, enabled=False):
            return fn()
    return fn()
