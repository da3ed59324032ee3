"""Token-id batches: left padding, so that generation continues every prompt from its last token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["left_pad", "padding_id"]


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, length: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[N, length]`` long tensors, each row right-aligned.

    ``length=None`` pads to the longest row. Padding comes from torch's ``pad_sequence(padding_side="left")``;
    the fixed ``length`` is then reached with one more left pad. Empty rows are all padding (mask 0).

    Raises:
        ValueError: a row longer than ``length``.
    """
    tensors = [torch.as_tensor(list(row), dtype=torch.long) for row in rows]
    longest = max((len(t) for t in tensors), default=0)
    length = longest if length is None else int(length)
    if longest > length:
        raise ValueError(f"left_pad: a row has {longest} tokens, more than length={length}; raise the length or truncate")
    ids = pad_sequence(tensors, batch_first=True, padding_value=pad_id, padding_side="left")
    mask = pad_sequence([torch.ones_like(t) for t in tensors], batch_first=True, padding_value=0, padding_side="left")
    if ids.shape[1] < length:
        ids = torch.nn.functional.pad(ids, (length - ids.shape[1], 0), value=pad_id)
        mask = torch.nn.functional.pad(mask, (length - mask.shape[1], 0), value=0)
    return ids.to(device), mask.to(device)


def padding_id(tokenizer: Any) -> int:
    """The id batches are padded with: the tokenizer's pad id, else its EOS id (Llama-style tokenizers have no pad
    token; padded positions are masked out anyway), else 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0
