"""``ResumableDataLoader``: a DataLoader whose position in the epoch is saved in the checkpoint, so a resume goes on
with the very next batch of the same shuffle."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["ResumableDataLoader", "train_or_eval_loader"]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes mid-epoch: Lightning saves its ``state_dict`` and loads it on resume.

    The shuffle is drawn from the loader's own generator (seeded with ``seed``), never from the global one, so the
    order of an epoch is a function of the seed and the epochs before it. The state is that generator's state at the
    start of the current epoch and the number of batches handed out since; on resume the loader replays the epoch's
    shuffle and skips those batches. Under DDP/FSDP2 Lightning puts a ``DistributedSampler`` (seeded, set to the
    epoch) in place of the shuffle; the count of batches works the same.

    Skipping reads the skipped batches and drops them (public DataLoader API only): cheap for in-memory and
    memory-mapped rows, the cost of one partial epoch of loading otherwise.

    Args:
        dataset: any map-style dataset.
        seed: seed of the shuffle (and of the workers' base seed).
        **kwargs: the arguments of ``torch.utils.data.DataLoader`` (``batch_size``, ``shuffle``, ``num_workers``...).

    Example::

        loader = ResumableDataLoader(train_set, seed=1234, batch_size=16, shuffle=True, drop_last=True)
    """

    def __init__(self, dataset: Dataset, seed: int = 0, **kwargs: Any) -> None:
        # Lightning re-creates the loader with a distributed sampler and passes the generator it had: keep it.
        generator = kwargs.pop("generator", None)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
        super().__init__(dataset, generator=generator, **kwargs)
        self.seed = int(seed)
        self._epoch_start_state = generator.get_state()
        self._batches_out = 0
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        skip = 0
        if self._resume is not None:
            self.generator.set_state(self._resume["generator"])
            skip = int(self._resume["batches"])
            self._resume = None
        self._epoch_start_state = self.generator.get_state()
        self._batches_out = 0
        return self._counted(super().__iter__(), skip)

    def _counted(self, batches: Iterator[Any], skip: int) -> Iterator[Any]:
        for _ in range(skip):
            if next(batches, _END) is _END:
                return
        self._batches_out = skip
        for batch in batches:
            self._batches_out += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch stands: its shuffle's generator state and the batches handed out."""
        if self._batches_out and self._batches_out >= _length(self):
            # The epoch is complete: the generator now holds the next epoch's start, from which a resume begins.
            return {"generator": self.generator.get_state(), "batches": 0}
        return {"generator": self._epoch_start_state, "batches": self._batches_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict``'s position on the next ``iter()``."""
        self._resume = dict(state_dict)


_END = object()


def _length(loader: DataLoader) -> float:
    try:
        return len(loader)
    except TypeError:  # an iterable dataset without a length: an epoch ends when it ends
        return float("inf")


def train_or_eval_loader(dataset: Dataset, *, train: bool, seed: int, batch_size: int, drop_last: bool = True,
                         **kwargs: Any) -> DataLoader:
    """The data modules' loaders: for training a :class:`ResumableDataLoader` shuffled from ``seed`` (a resume goes
    on with the next batch of the same shuffle, never drawn from the global generator); for evaluation a plain
    ``DataLoader`` in order. ``kwargs`` (``num_workers``, ``collate_fn``...) go to both."""
    if train:
        return ResumableDataLoader(dataset, seed=seed, batch_size=batch_size, shuffle=True, drop_last=drop_last,
                                   **kwargs)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, **kwargs)
