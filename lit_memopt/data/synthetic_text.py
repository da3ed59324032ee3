"""Synthetic causal-LM text generated at start (no downloads): arithmetic facts and string copies."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lit_memopt.data.resumable import train_or_eval_loader

TASKS = ("arithmetic", "copy", "mixed")


def make_text(rng: random.Random, task: str, min_chars: int) -> str:
    """One training text of at least ``min_chars`` characters made of ``task`` items separated by ``;``."""
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < min_chars:
        kind = task if task != "mixed" else rng.choice(("arithmetic", "copy"))
        if kind == "arithmetic":
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            parts.append(f"{a}+{b}={a + b}")
        else:
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
            parts.append(f"copy {word}>{word}")
    return ";".join(parts) + "."


class TokenizedTexts(Dataset):
    """Fixed-length token sequences with ``labels`` = ``input_ids`` and -100 on padding."""

    def __init__(self, texts: list[str], tokenizer: Any, seq_len: int) -> None:
        enc = tokenizer(texts, max_length=seq_len, truncation=True, padding="max_length", return_tensors="pt")
        self.input_ids = enc["input_ids"]
        self.attention_mask = enc["attention_mask"]
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


class SyntheticTextDataModule(pl.LightningDataModule):
    """Causal-LM texts generated from a seed: learnable patterns so a tiny model's loss visibly falls.

    Args:
        tokenizer: any Hugging Face tokenizer (the byte-level default needs no files).
        task: ``arithmetic`` (``12+30=42``), ``copy`` (``copy abc>abc``) or ``mixed``.
        num_train: training sequences.
        num_val: validation sequences.
        seq_len: tokens per sequence (padded or truncated).
        batch_size: sequences per loader batch.
        seed: generator seed of the texts and of the training shuffle; the same seed gives the same texts and order.
        num_workers: DataLoader worker processes.

    Raises:
        ValueError: on an unknown ``task`` or a non-positive size.
    """

    def __init__(
        self,
        tokenizer: Any,
        task: str = "mixed",
        num_train: int = 4096,
        num_val: int = 256,
        seq_len: int = 64,
        batch_size: int = 16,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"data.task={task!r} is not supported; use one of {list(TASKS)}.")
        for name, value in (("num_train", num_train), ("num_val", num_val), ("seq_len", seq_len), ("batch_size", batch_size)):
            if int(value) <= 0:
                raise ValueError(f"data.{name} must be a positive integer, got {value!r}.")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers!r}.")
        self.tokenizer = tokenizer
        self.task, self.num_train, self.num_val = task, int(num_train), int(num_val)
        self.seq_len, self.batch_size, self.seed, self.num_workers = int(seq_len), int(batch_size), int(seed), int(num_workers)
        self.train_set: TokenizedTexts | None = None
        self.val_set: TokenizedTexts | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        rng = random.Random(self.seed)
        texts = [make_text(rng, self.task, self.seq_len) for _ in range(self.num_train + self.num_val)]
        self.train_set = TokenizedTexts(texts[: self.num_train], self.tokenizer, self.seq_len)
        self.val_set = TokenizedTexts(texts[self.num_train :], self.tokenizer, self.seq_len)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return train_or_eval_loader(dataset, train=shuffle, seed=self.seed, batch_size=self.batch_size,
                                    num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.val_set, shuffle=False)
