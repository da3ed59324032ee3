"""Multi-query associative recall (MQAR): a synthetic in-context memory task, generated offline.

Each sequence lists ``num_pairs`` key-value pairs, then asks ``num_queries`` of the keys again;
the model must produce each queried key's value, which appeared only earlier in the same sequence::

    K1 v1 K2 v2 ... KN vN | Q1 a1 Q2 a2 ... QM aM        (every Qi is one of the Ki, ai its vi)

Tokens are single characters of the tokenizer in use: keys from ``key_alphabet`` (upper-case
letters by default) and values from ``value_alphabet`` (lower-case letters), each of which must
encode to exactly one id (true for the byte-level tokenizer and for most BPE vocabularies' ASCII
letters). ``labels`` are already shifted: ``labels[t]`` is the token to predict after reading
``input_ids[: t + 1]``; it holds ``a_i`` at each query position and ``-100`` (ignored) elsewhere,
so the loss and accuracy measure recall only.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lit_memopt.data.resumable import train_or_eval_loader

IGNORE_INDEX = -100

__all__ = ["RecallDataModule", "RecallDataset", "IGNORE_INDEX"]


def _single_token_ids(tokenizer: Any, alphabet: str, argument: str) -> list[int]:
    ids = []
    for char in alphabet:
        encoded = tokenizer(char, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ValueError(
                f"{argument}: character {char!r} encodes to {len(encoded)} tokens with {type(tokenizer).__name__}; "
                "every character must be exactly one token. Use ASCII letters or digits."
            )
        ids.append(int(encoded[0]))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{argument}={alphabet!r} has repeated characters or characters sharing a token id.")
    return ids


class RecallDataset(Dataset):
    """Deterministic MQAR samples: item ``i`` is generated from ``seed`` and ``i`` alone.

    Args:
        key_ids: token ids keys are drawn from (distinct within a sequence).
        value_ids: token ids values are drawn from (with replacement).
        num_pairs: key-value pairs per sequence.
        num_queries: queries per sequence (distinct keys when ``num_queries <= num_pairs``).
        size: number of samples.
        seed: base seed of the generator.
    """

    def __init__(
        self, key_ids: list[int], value_ids: list[int], num_pairs: int, num_queries: int, size: int, seed: int
    ) -> None:
        self.key_ids = torch.tensor(key_ids, dtype=torch.long)
        self.value_ids = torch.tensor(value_ids, dtype=torch.long)
        self.num_pairs = num_pairs
        self.num_queries = num_queries
        self.size = size
        self.seed = seed

    @property
    def seq_len(self) -> int:
        return 2 * (self.num_pairs + self.num_queries)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        keys = self.key_ids[torch.randperm(len(self.key_ids), generator=g)[: self.num_pairs]]
        values = self.value_ids[torch.randint(len(self.value_ids), (self.num_pairs,), generator=g)]
        if self.num_queries <= self.num_pairs:
            asked = torch.randperm(self.num_pairs, generator=g)[: self.num_queries]
        else:
            asked = torch.randint(self.num_pairs, (self.num_queries,), generator=g)
        context = torch.stack([keys, values], dim=1).flatten()
        queries = torch.stack([keys[asked], values[asked]], dim=1).flatten()
        input_ids = torch.cat([context, queries])
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        query_positions = 2 * self.num_pairs + 2 * torch.arange(self.num_queries)
        labels[query_positions] = values[asked]
        return {"input_ids": input_ids, "labels": labels}


class RecallDataModule(LightningDataModule):
    """Multi-query associative recall, generated at setup (no files, no downloads).

    Args:
        tokenizer: the run's tokenizer; only used to map the alphabets' characters to ids.
        num_pairs: key-value pairs per sequence (the memory load).
        num_queries: keys asked again per sequence.
        key_alphabet: characters used as keys (at least ``num_pairs`` of them).
        value_alphabet: characters used as values.
        batch_size: sequences per batch.
        train_size: training samples per epoch (fresh ones each index: there is no reuse within an epoch).
        val_size: validation samples (disjoint seed).
        seed: data seed (also of the training shuffle, which a resume replays mid-epoch).
        num_workers: DataLoader workers.

    Raises:
        ValueError: on non-positive sizes, an alphabet with fewer keys than ``num_pairs``, or
            characters that are not single tokens.

    Example::

        dm = RecallDataModule(ByT5Tokenizer(), num_pairs=8, num_queries=8, batch_size=32)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))   # input_ids, labels: [32, 32]
    """

    def __init__(
        self,
        tokenizer: Any,
        num_pairs: int = 8,
        num_queries: int = 8,
        key_alphabet: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        value_alphabet: str = "abcdefghijklmnopqrstuvwxyz",
        batch_size: int = 32,
        train_size: int = 100_000,
        val_size: int = 512,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_pairs", num_pairs),
            ("num_queries", num_queries),
            ("batch_size", batch_size),
            ("train_size", train_size),
            ("val_size", val_size),
        ):
            if int(value) <= 0:
                raise ValueError(f"data.{name} must be a positive integer, got {value!r}.")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}.")
        if len(key_alphabet) < num_pairs:
            raise ValueError(
                f"data.key_alphabet has {len(key_alphabet)} characters but num_pairs={num_pairs} distinct keys are needed."
            )
        self.key_ids = _single_token_ids(tokenizer, key_alphabet, "data.key_alphabet")
        self.value_ids = _single_token_ids(tokenizer, value_alphabet, "data.value_alphabet")
        if set(self.key_ids) & set(self.value_ids):
            raise ValueError("data.key_alphabet and data.value_alphabet must not share characters.")
        self.num_pairs = num_pairs
        self.num_queries = num_queries
        self.batch_size = batch_size
        self.train_size = train_size
        self.val_size = val_size
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: RecallDataset | None = None
        self.val_set: RecallDataset | None = None

    @property
    def seq_len(self) -> int:
        return 2 * (self.num_pairs + self.num_queries)

    def setup(self, stage: str | None = None) -> None:
        make = lambda size, seed: RecallDataset(  # noqa: E731
            self.key_ids, self.value_ids, self.num_pairs, self.num_queries, size, seed
        )
        self.train_set = make(self.train_size, 2 * self.seed)
        self.val_set = make(self.val_size, 2 * self.seed + 1)

    def _loader(self, dataset: RecallDataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            self.setup()
            return self._loader(self.train_set if shuffle else self.val_set, shuffle)
        return train_or_eval_loader(dataset, train=shuffle, seed=self.seed, batch_size=self.batch_size,
                                    num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
