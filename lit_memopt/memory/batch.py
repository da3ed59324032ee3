"""Batches for memory estimates: their geometry, resizing by cycling rows and tokens, fake and device copies."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from lit_memopt._compat.torch import is_fake, tree_flatten

__all__ = ["batch_geometry", "resize_batch", "to_fake", "batch_tensors"]


def batch_geometry(batch: Any) -> tuple[int | None, int | None]:
    """(rows, tokens per row) of a batch: from ``input_ids`` when present, else the first 2-D tensor."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].ndim >= 2:
        ids = batch["input_ids"]
        return int(ids.shape[0]), int(ids.shape[1])
    leaves, _ = tree_flatten(batch)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1]
    rows = int(tensors[0].shape[0]) if tensors else None
    seq = next((int(t.shape[1]) for t in tensors if t.ndim >= 2), None)
    if rows is None:
        rows = next((len(x) for x in _item_lists(batch)), None)
    return rows, seq


def _item_lists(obj: Any) -> Iterator[list]:
    if isinstance(obj, list) and obj and not any(isinstance(x, torch.Tensor) for x in obj):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _item_lists(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _item_lists(v)


def _cycle(n: int, target: int) -> list[int]:
    return [i % n for i in range(target)]


def resize_batch(batch: Any, batch_size: int | None = None, seq_len: int | None = None) -> Any:
    """A batch with ``batch_size`` rows and ``seq_len`` tokens per row, made by cycling the given rows/tokens.

    Rows are repeated or cut (tensors whose first dimension is the batch's row count, and lists of
    that length); token dimensions (dimension 1 of tensors whose dimension 1 is the batch's
    sequence length) are tiled or cut. Other leaves are kept. Values stay valid token ids, which
    is all a memory estimate needs.

    Raises:
        ValueError: a non-positive size, or a ``seq_len`` for a batch without 2-D tensors.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    rows, seq = batch_geometry(batch)
    if seq_len is not None and seq is None:
        raise ValueError("seq_len was given but the batch has no [batch, tokens] tensor to resize")
    new_rows = rows if batch_size is None else batch_size
    new_seq = seq if seq_len is None else seq_len

    def visit(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj
            if rows is not None and t.ndim >= 1 and t.shape[0] == rows and new_rows != rows:
                t = t[torch.tensor(_cycle(rows, new_rows), device=t.device)]
            if seq is not None and t.ndim >= 2 and t.shape[1] == seq and new_seq != seq:
                t = t[:, torch.tensor(_cycle(seq, new_seq), device=t.device)]
            return t
        if isinstance(obj, Mapping):
            return type(obj)({k: visit(v) for k, v in obj.items()}) if type(obj) is not dict else {k: visit(v) for k, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(visit(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            items = [visit(v) for v in obj]
            if isinstance(obj, list) and rows is not None and len(obj) == rows and new_rows != rows and not any(
                isinstance(v, torch.Tensor) for v in obj
            ):
                items = [items[i] for i in _cycle(rows, new_rows)]
            return type(obj)(items)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: visit(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init})
        return obj

    return visit(batch)


def to_fake(batch: Any, mode: Any) -> Any:
    def visit(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj if is_fake(obj) else mode.from_tensor(obj)
        if isinstance(obj, Mapping):
            return {k: visit(v) for k, v in obj.items()} if type(obj) is dict else type(obj)({k: visit(v) for k, v in obj.items()})
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(visit(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(visit(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: visit(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init})
        return obj

    return visit(batch)


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(batch)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
