"""A user's dataset from local files, through ``datasets`` (memory-mapped Arrow), with one-line errors for bad input.

Shared by the data modules that read user data (``text_dataset`` for SFT, ``prompt_dataset`` for the RL recipes).
Nothing here reaches a hub: a ``path`` is a builder name with local ``data_files``, a local data file, a local
folder, or a folder written by ``Dataset.save_to_disk``.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["BUILDERS", "require_datasets", "load_user_dataset", "rename_columns", "split_off_eval", "cache_file",
           "hash_of", "source_signature", "load_train_and_eval"]

# Builder names of `datasets.load_dataset` that read local files, and the file endings that pick them.
BUILDERS = ("json", "parquet", "csv", "arrow")
_BUILDER_OF_SUFFIX = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def require_datasets() -> Any:
    """The ``datasets`` package, or one line naming the extra to install."""
    try:
        import datasets
    except ImportError:
        raise ImportError("reading your own data needs the `datasets` package: pip install 'lit-memopt[data]'") from None
    return datasets


def _files_of(data_files: Any) -> list[str]:
    if data_files is None:
        return []
    if isinstance(data_files, (str, os.PathLike)):
        return [str(data_files)]
    if isinstance(data_files, Mapping):
        return [f for value in data_files.values() for f in _files_of(value)]
    return [str(f) for f in data_files]


def _check_files_exist(files: Sequence[str], key: str) -> None:
    for name in files:
        expanded = os.path.expanduser(name)
        if not (glob.glob(expanded) if glob.has_magic(expanded) else os.path.exists(expanded)):
            raise FileNotFoundError(f"{key}: {name!r} does not exist; give a local file ({', '.join(_BUILDER_OF_SUFFIX)}) "
                                    "or folder (this pack never downloads datasets).")


def _is_saved_dataset(folder: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def load_user_dataset(path: str | None, data_files: Any = None, split: str = "train", *, cache_dir: str | None = None,
                      key: str = "data") -> Any:
    """One split of a local dataset as a memory-mapped ``datasets.Dataset``.

    ``path`` is ``json``/``parquet``/``csv``/``arrow`` with ``data_files``, a local data file (the builder comes from
    its ending), a local folder of data files, or a ``save_to_disk`` folder (read with ``load_from_disk``).

    Raises:
        FileNotFoundError: a path or data file that does not exist locally.
        ValueError: a missing ``path``, an unknown split (the splits found are named) or an empty split.
    """
    datasets = require_datasets()
    if not path:
        raise ValueError(f"{key}.path is not set: give a local file (e.g. {key}.path=/data/train.jsonl), a folder, or "
                         f"a builder name ({'|'.join(BUILDERS)}) with {key}.data_files.")
    files = _files_of(data_files)
    _check_files_exist(files, f"{key}.data_files")
    local = Path(os.path.expanduser(str(path)))
    where = ", ".join(files) or str(path)

    def load(source: str, files: Any) -> Any:
        named = _files_of(files)
        if named and all(os.path.isfile(os.path.expanduser(f)) and os.path.getsize(os.path.expanduser(f)) == 0 for f in named):
            raise ValueError(f"{key}: {where!r} is empty (no rows); check the file or pick another one.")
        try:
            return datasets.load_dataset(source, data_files=_plain(files), split=split, cache_dir=cache_dir)
        except ValueError as err:  # datasets names the splits it found: keep its first line, add the key to set
            if "split" not in str(err).lower():
                raise
            raise ValueError(f"{key}.split={split!r} does not fit {where!r}: {str(err).splitlines()[0]}") from None
        except (StopIteration, datasets.exceptions.DatasetGenerationError) as err:
            # A file the builder cannot parse (bad JSON lines, a truncated parquet): name it, not datasets' internals.
            cause = err.__cause__ or err
            detail = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
            raise ValueError(f"{key}: cannot read {where!r} as {source} ({detail}); check the file's format.") from None

    if str(path) in BUILDERS:
        if not files:
            raise ValueError(f"{key}.path={path!r} reads {key}.data_files, which is not set: add "
                             f"{key}.data_files=/path/to/file.{path if path != 'json' else 'jsonl'}.")
        dataset = load(str(path), data_files)
    elif local.is_file():
        builder = _BUILDER_OF_SUFFIX.get(local.suffix.lower())
        if builder is None:
            raise ValueError(f"{key}.path={path!r}: cannot tell the format of a '{local.suffix}' file; use one of "
                             f"{', '.join(_BUILDER_OF_SUFFIX)}, or set {key}.path to a builder ({'|'.join(BUILDERS)}) "
                             f"and {key}.data_files to the file.")
        dataset = load(builder, str(local))
    elif local.is_dir() and _is_saved_dataset(local):
        dataset = datasets.load_from_disk(str(local))
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise ValueError(f"{key}.split={split!r} is not in {path!r}; its splits: {', '.join(dataset)}.")
            dataset = dataset[split]
    elif local.is_dir():
        dataset = load(str(local), data_files)
    else:
        raise FileNotFoundError(f"{key}.path={path!r} is neither a local file or folder nor a builder name "
                                f"({'|'.join(BUILDERS)} with {key}.data_files); this pack never downloads datasets.")
    if isinstance(dataset, datasets.IterableDataset):  # not produced by the calls above; a guard for the future
        raise ValueError(f"{key}: streaming datasets are not supported here; give local files.")
    if len(dataset) == 0:
        raise ValueError(f"{key}.split={split!r} of {where!r} has no rows; check the file or pick another split.")
    return dataset


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain lists/dicts (``datasets`` checks their types)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def rename_columns(dataset: Any, columns: Mapping[str, str] | None, key: str = "data") -> Any:
    """Apply a ``{found: wanted}`` rename map (``data.columns``), naming any column that is not there."""
    if not columns:
        return dataset
    missing = [name for name in columns if name not in dataset.column_names]
    if missing:
        raise ValueError(f"{key}.columns renames {missing}, which the dataset does not have; its columns: "
                         f"{', '.join(dataset.column_names)}.")
    return dataset.rename_columns({str(k): str(v) for k, v in columns.items()})


def split_off_eval(train: Any, *, path: str | None, data_files: Any, eval_split: str | None, eval_fraction: float | None,
                   seed: int, cache_dir: str | None = None, key: str = "data") -> tuple[Any, Any | None]:
    """``(train, eval)``: a named split loaded like the training one, or a seeded fraction of the training rows.

    The fraction's indices stay in memory (``keep_in_memory``): no index files are written, least of all into a
    user's ``save_to_disk`` folder.
    """
    if eval_split and eval_fraction:
        raise ValueError(f"set one of {key}.eval_split and {key}.eval_fraction, not both.")
    if eval_split:
        return train, load_user_dataset(path, data_files, eval_split, cache_dir=cache_dir, key=key)
    if eval_fraction:
        if not 0.0 < float(eval_fraction) < 1.0:
            raise ValueError(f"{key}.eval_fraction must be in (0, 1), got {eval_fraction!r}.")
        if len(train) < 2:
            raise ValueError(f"{key}.eval_fraction needs at least 2 rows; the split has {len(train)}.")
        import numpy as np

        # A seeded permutation and two in-memory selections (train_test_split would write index files).
        order = np.random.default_rng(int(seed)).permutation(len(train))
        size = max(1, int(round(len(train) * float(eval_fraction))))
        return (train.select(np.sort(order[size:]), keep_in_memory=True),
                train.select(np.sort(order[:size]), keep_in_memory=True))
    return train, None


def hash_of(*parts: Any) -> str:
    """A stable hash of plain values, tokenizers included (``datasets``' own fingerprint hasher)."""
    from datasets.fingerprint import Hasher

    return Hasher.hash(parts)


def cache_file(cache_dir: str | None, stage: str, fingerprint: str) -> str:
    """Where a prepared (tokenized) table is cached: under ``cache_dir`` or ``datasets``' cache, never beside the
    user's files (a ``save_to_disk`` folder would otherwise receive them)."""
    datasets = require_datasets()
    root = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "lit_memopt"
    root.mkdir(parents=True, exist_ok=True)
    return str(root / f"{stage}-{fingerprint}.arrow")


def source_signature(path: str | None, data_files: Any, split: str) -> tuple:
    """What identifies the rows read: the paths, each file's size and modification time, and the split."""
    files = _files_of(data_files) or ([str(path)] if path and os.path.exists(os.path.expanduser(str(path))) else [])
    stats = []
    for name in files:
        for found in sorted(glob.glob(os.path.expanduser(name))) or [name]:
            target = Path(found)
            if target.is_dir():
                entries = sorted(p for p in target.rglob("*") if p.is_file())
                stats += [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in entries]
            elif target.exists():
                stats.append((str(target), target.stat().st_size, target.stat().st_mtime_ns))
    return (str(path), tuple(stats), split)


def load_train_and_eval(path: str | None, data_files: Any, split: str, *, eval_split: str | None,
                        eval_fraction: float | None, columns: Mapping[str, str] | None, seed: int,
                        cache_dir: str | None = None, key: str = "data") -> tuple[Any, Any | None, tuple]:
    """The renamed training rows, the validation rows (or ``None``) and what identifies them (for cache keys).

    A validation split of its own is renamed like the training split and must have its columns; a fraction is
    cut from the renamed training rows.
    """
    raw = rename_columns(load_user_dataset(path, data_files, split, cache_dir=cache_dir, key=key), columns, key)
    train, evaluation = split_off_eval(raw, path=path, data_files=data_files, eval_split=eval_split,
                                       eval_fraction=eval_fraction, seed=seed, cache_dir=cache_dir, key=key)
    if eval_split:
        evaluation = rename_columns(evaluation, columns, key)
        missing = sorted(set(raw.column_names) - set(evaluation.column_names))
        if missing:
            raise ValueError(f"{key}.eval_split={eval_split!r} lacks the columns {missing} of the training split; "
                             f"its columns: {', '.join(evaluation.column_names)}.")
    signature = (source_signature(path, data_files, split), eval_split, eval_fraction, int(seed),
                 dict(columns or {}))
    return train, evaluation, signature
