"""Synthetic prompts for generation-based recipes (GRADE, RL): generated offline, left-padded batches."""

from __future__ import annotations

import random
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lit_memopt.data.resumable import ResumableDataLoader
from lit_memopt.models.tokens import left_pad

# Word list the prompts are drawn from: plain lowercase English, so byte-level tokenizers see ordinary text.
_WORDS = (
    "the a one this that my your our some every small large old new quiet bright dark warm cold red blue green "
    "cat dog bird fish tree river mountain city road house garden book letter song story idea question answer "
    "morning evening night day week year friend teacher child farmer sailor writer painter robot engine "
    "walks runs sings writes reads builds finds opens closes watches remembers imagines explains carries "
    "slowly quickly gently again always never often today tomorrow here there near far under over with "
    "and but because while after before when where why how what who"
).split()


class _PromptDataset(Dataset):
    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, texts: list[str]) -> None:
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.texts = texts

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # "index": the sample's identity, from which per-sample randomness is derived (split-invariant)
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index], "index": index}


class PromptDataModule(LightningDataModule):
    """Synthetic text prompts, tokenized and left-padded to a fixed length, for methods that generate.

    Prompts are random word sequences drawn with a fixed seed at construction (no downloads). Each
    batch is ``{"input_ids": [B, P], "attention_mask": [B, P], "index": [B]}`` (``index``: each prompt's
    position in its split, from which per-sample noise is derived) with padding on the left, so a
    causal LM can append new tokens directly after the last prompt token. Prompts longer than
    ``prompt_length`` tokens keep their last ``prompt_length`` tokens.

    Args:
        tokenizer: any Hugging Face tokenizer (the byte-level default needs no files). Its
            ``pad_token_id`` is used for padding (0 when it has none).
        num_prompts: training prompts.
        num_val_prompts: validation prompts (0 disables the validation loader).
        prompt_length: padded prompt length ``P`` in tokens.
        min_prompt_length: shortest prompt in tokens before padding; equal to ``prompt_length``
            gives unpadded, fixed-length prompts.
        batch_size: prompts per batch.
        seed: seed of the prompt generator and of the training shuffle.
        num_workers: DataLoader workers.

    Raises:
        ValueError: a size is not positive, or ``min_prompt_length`` is outside ``[1, prompt_length]``.

    Example::

        from lit_memopt.models import build_tokenizer
        dm = PromptDataModule(build_tokenizer(), num_prompts=64, prompt_length=16, batch_size=8)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))  # input_ids [8, 16], attention_mask [8, 16]
    """

    def __init__(
        self,
        tokenizer: Any,
        num_prompts: int = 512,
        num_val_prompts: int = 32,
        prompt_length: int = 16,
        min_prompt_length: int = 8,
        batch_size: int = 8,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("num_prompts", num_prompts), ("prompt_length", prompt_length), ("batch_size", batch_size)):
            if int(value) < 1:
                raise ValueError(f"data.{name} must be a positive integer, got {value!r}.")
        if int(num_val_prompts) < 0:
            raise ValueError(f"data.num_val_prompts must be >= 0, got {num_val_prompts!r}.")
        if not 1 <= int(min_prompt_length) <= int(prompt_length):
            raise ValueError(
                f"data.min_prompt_length must be in [1, prompt_length={prompt_length}], got {min_prompt_length!r}."
            )
        if int(num_workers) < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers!r}.")
        self.tokenizer = tokenizer
        self.num_prompts = int(num_prompts)
        self.num_val_prompts = int(num_val_prompts)
        self.prompt_length = int(prompt_length)
        self.min_prompt_length = int(min_prompt_length)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.num_workers = int(num_workers)
        self.pad_token_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.train_set: _PromptDataset | None = None
        self.val_set: _PromptDataset | None = None

    def _make(self, count: int, rng: random.Random) -> _PromptDataset:
        rows: list[list[int]] = []
        texts: list[str] = []
        for _ in range(count):
            target = rng.randint(self.min_prompt_length, self.prompt_length)
            words: list[str] = []
            ids: list[int] = []
            # Grow the text word by word until it reaches the drawn token length, whatever the tokenizer.
            while len(ids) < target:
                words.append(rng.choice(_WORDS))
                ids = list(self.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"])
            ids = ids[-target:]
            rows.append(ids)
            texts.append(" ".join(words))
        input_ids, attention_mask = left_pad(rows, self.pad_token_id, length=self.prompt_length)
        return _PromptDataset(input_ids, attention_mask, texts)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        rng = random.Random(self.seed)
        self.train_set = self._make(self.num_prompts, rng)
        self.val_set = self._make(self.num_val_prompts, rng) if self.num_val_prompts else None

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        # The shuffle's generator is seeded with data.seed; a resume goes on with the next batch of the same shuffle.
        return ResumableDataLoader(
            self.train_set,
            seed=self.seed,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=len(self.train_set) >= self.batch_size,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
