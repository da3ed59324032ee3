"""Supervised fine-tuning data from a user's files (``data=text_dataset``): TRL's dataset formats, tokenized once
into memory-mapped Arrow with a cache, loss on the completions or assistant turns, optional packing.

Formats, detected from the columns (the first that fits):
- conversational ``messages`` (role/content lists; ShareGPT ``conversations`` with ``from``/``value`` is mapped),
  rendered with the tokenizer's chat template;
- prompt-completion ``prompt`` + ``completion`` (strings, or lists of messages);
- language modelling ``text``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from lit_memopt.data.loading import cache_file, hash_of, load_train_and_eval
from lit_memopt.data.resumable import train_or_eval_loader
from lit_memopt.models.tokens import padding_id

__all__ = ["FORMATS", "TextDatasetDataModule", "detect_format", "segments_of_row", "tokenize_segments", "pack_rows",
           "SFTCollate"]

IGNORE = -100
FORMATS = {
    "messages": "conversational: a `messages` column of {role, content} lists (ShareGPT `conversations` of "
                "{from, value} accepted)",
    "prompt_completion": "prompt-completion: `prompt` and `completion` columns (strings, or lists of messages)",
    "text": "language modelling: a `text` column",
}
LOSS_ON = ("completion", "all")
OVERLONG = ("truncate", "drop")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                   "tool": "tool", "function_call": "assistant", "observation": "tool"}
# Bump when the tokenized layout changes, so that old cache files are not reused.
_LAYOUT_VERSION = 1


def detect_format(columns: Sequence[str], key: str = "data") -> str:
    """The TRL dataset format the columns fit, or one line naming the columns found and the formats accepted."""
    found = set(columns)
    if "messages" in found or "conversations" in found:
        return "messages"
    if {"prompt", "completion"} <= found:
        return "prompt_completion"
    if "text" in found:
        return "text"
    accepted = "; ".join(FORMATS.values())
    raise ValueError(f"{key}: the columns {sorted(found)} fit no dataset format. Accepted: {accepted}. "
                     f"Rename yours with {key}.columns={{yours: text}}.")


def _as_messages(value: Any, where: str) -> list[dict[str, str]]:
    """Role/content messages, from either the OpenAI layout or ShareGPT's ``from``/``value``."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of messages, got {type(value).__name__}.")
    messages = []
    for message in value:
        if "role" in message and message.get("role") is not None:
            messages.append({"role": str(message["role"]), "content": str(message.get("content") or "")})
        elif "from" in message:
            role = _SHAREGPT_ROLES.get(str(message["from"]).lower())
            if role is None:
                raise ValueError(f"{where}: unknown ShareGPT speaker {message['from']!r}; "
                                 f"known: {', '.join(_SHAREGPT_ROLES)}.")
            messages.append({"role": role, "content": str(message.get("value") or "")})
        else:
            raise ValueError(f"{where}: a message needs `role` and `content` (or ShareGPT `from` and `value`), "
                             f"got keys {sorted(message)}.")
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _chat_segments(tokenizer: Any, messages: list[dict[str, str]], learn_from: int) -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, learned)`` pieces: assistant turns at ``learn_from`` or later are
    learned, from the end of the generation prompt before them to the end of the turn (end-of-turn token included).

    The cut points are the renderings of each prefix, which are prefixes of the whole rendering for ChatML-style
    templates. A template that rewrites earlier turns (Qwen3 drops past reasoning) is cut at the turn's content.
    """
    full = _render(tokenizer, messages)
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < learn_from:
            continue
        start_text = _render(tokenizer, messages[:index], generation_prompt=True) if index else ""
        end_text = _render(tokenizer, messages[: index + 1])
        if full.startswith(start_text) and full.startswith(end_text) and cursor <= len(start_text) <= len(end_text):
            start, end = len(start_text), len(end_text)
        else:
            start = full.find(message["content"], cursor)
            if start < 0:
                raise ValueError("the chat template changes an assistant turn's text; cannot find which tokens to "
                                 "learn. Use data.loss_on=all, or a template that keeps each turn as written.")
            end = start + len(message["content"])
            eos = tokenizer.eos_token or ""
            if eos and full[end:].lstrip(" ").startswith(eos):  # learn to end the turn
                end = full.index(eos, end) + len(eos)
        pieces += [(full[cursor:start], False), (full[start:end], True)]
        cursor = end
    pieces.append((full[cursor:], False))
    return [(text, learned) for text, learned in pieces if text]


def segments_of_row(row: Mapping[str, Any], form: str, tokenizer: Any, loss_on: str = "completion",
                    where: str = "row") -> tuple[list[tuple[str, bool]], bool]:
    """A row as ``(text, learned)`` pieces, and whether it is plain text (that needs BOS and EOS added).

    Plain ``text`` rows are learned whole; a completion or an assistant turn is learned, the rest not
    (``loss_on="all"``: everything). Chat formats are rendered with the tokenizer's chat template, whose own
    special tokens mark the turns.
    """
    learn_all = loss_on == "all"
    if form == "text":
        return [(str(row["text"]), True)], True
    if form == "messages":
        raw = row["messages"] if row.get("messages") is not None else row.get("conversations")
        messages = _as_messages(raw, f"{where} messages")
        segments = _chat_segments(tokenizer, messages, learn_from=0)
    else:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return [(prompt, learn_all), (completion, True)], True
        if isinstance(prompt, str) or isinstance(completion, str):
            raise ValueError(f"{where}: prompt and completion must both be strings or both be message lists.")
        prompt_messages = _as_messages(prompt, f"{where} prompt")
        messages = prompt_messages + _as_messages(completion, f"{where} completion")
        segments = _chat_segments(tokenizer, messages, learn_from=len(prompt_messages))
    if learn_all:
        segments = [(text, True) for text, _ in segments]
    return segments, False


def tokenize_segments(tokenizer: Any, rows: list[tuple[list[tuple[str, bool]], bool]]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and labels of many rows, each tokenized piece by piece in one batched tokenizer call.

    Pieces are tokenized apart (as TRL tokenizes prompt and completion apart): the learned tokens are exactly those a
    model generates after the prompt's tokens. Plain-text rows get the tokenizer's BOS (when it adds one) and EOS.
    """
    texts = [text for segments, _ in rows for text, _ in segments]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    bos = _bos_id(tokenizer)
    eos = tokenizer.eos_token_id
    ids_rows, label_rows, at = [], [], 0
    for segments, plain in rows:
        ids: list[int] = [bos] if plain and bos is not None else []
        labels: list[int] = [IGNORE] * len(ids)
        for _, learned in segments:
            piece = list(encoded[at])
            at += 1
            ids += piece
            labels += piece if learned else [IGNORE] * len(piece)
        if plain and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            labels.append(eos if segments[-1][1] else IGNORE)
        ids_rows.append(ids)
        label_rows.append(labels)
    return ids_rows, label_rows


def _bos_id(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer puts one in front of a text by itself (Llama), else ``None`` (Qwen, ByT5)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def pack_rows(ids_rows: list[list[int]], label_rows: list[list[int]], max_length: int) -> dict[str, list[list[int]]]:
    """Rows (each at most ``max_length``) packed in order into blocks of at most ``max_length`` tokens.

    Each block carries per-row ``position_ids`` (restarting at 0), from which transformers builds an attention mask
    that keeps every row to itself. A row's first label is dropped: unpacked, nothing predicts a row's first token,
    so packed, the previous row's last token must not either. The loss is then that of the rows unpacked.
    """
    blocks: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for row_ids, row_labels in zip(ids_rows, label_rows):
        if ids and len(ids) + len(row_ids) > max_length:
            blocks["input_ids"].append(ids)
            blocks["labels"].append(labels)
            blocks["position_ids"].append(positions)
            ids, labels, positions = [], [], []
        ids = ids + list(row_ids)
        labels = labels + [IGNORE] + list(row_labels[1:])
        positions = positions + list(range(len(row_ids)))
    if ids:
        blocks["input_ids"].append(ids)
        blocks["labels"].append(labels)
        blocks["position_ids"].append(positions)
    return blocks


class SFTCollate:
    """Right-pads token rows into a batch, cutting each to ``max_length`` (``data.overlong=truncate``).

    Packed rows come with ``position_ids`` and no ``attention_mask``: transformers reads the row boundaries from the
    positions (an attention mask would make it ignore them). Their padding continues as one more short row whose
    labels are ignored.
    """

    def __init__(self, pad_id: int, max_length: int) -> None:
        self.pad_id, self.max_length = int(pad_id), int(max_length)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        cut = self.max_length
        ids = [torch.as_tensor(row["input_ids"][:cut], dtype=torch.long) for row in rows]
        labels = [torch.as_tensor(row["labels"][:cut], dtype=torch.long) for row in rows]
        batch = {"input_ids": pad_sequence(ids, batch_first=True, padding_value=self.pad_id),
                 "labels": pad_sequence(labels, batch_first=True, padding_value=IGNORE)}
        if "position_ids" in rows[0]:
            width = batch["input_ids"].shape[1]
            positions = []
            for row in rows:
                own = list(row["position_ids"][:cut])
                positions.append(torch.as_tensor(own + list(range(width - len(own))), dtype=torch.long))
            batch["position_ids"] = torch.stack(positions)
        else:
            batch["attention_mask"] = pad_sequence([torch.ones_like(t) for t in ids], batch_first=True, padding_value=0)
        return batch


class _Tokenize:
    """The ``datasets.map`` function: a batch of rows -> ``input_ids``, ``labels`` and their length.

    A class rather than a closure so that ``datasets`` can hash it for its cache.
    """

    def __init__(self, tokenizer: Any, form: str, loss_on: str, max_length: int) -> None:
        self.tokenizer, self.form, self.loss_on, self.max_length = tokenizer, form, loss_on, int(max_length)

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        names = list(batch)
        rows = [segments_of_row({n: batch[n][i] for n in names}, self.form, self.tokenizer, self.loss_on,
                                where=f"row {index}")
                for i, index in enumerate(indices)]
        ids_rows, label_rows = tokenize_segments(self.tokenizer, rows)
        learned_in_budget = [sum(1 for label in labels[1 : self.max_length] if label != IGNORE) for labels in label_rows]
        return {"input_ids": ids_rows, "labels": label_rows, "length": [len(ids) for ids in ids_rows],
                "learned_in_budget": learned_in_budget}


class _Pack:
    def __init__(self, max_length: int) -> None:
        self.max_length = int(max_length)

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        cut = self.max_length
        return pack_rows([ids[:cut] for ids in batch["input_ids"]], [labels[:cut] for labels in batch["labels"]], cut)


class TextDatasetDataModule(pl.LightningDataModule):
    """A user's SFT data from local files (``data=text_dataset``), in TRL's formats, for the ``sft`` recipe.

    The split is read with ``datasets`` (memory-mapped Arrow), tokenized once with ``Dataset.map`` (a progress bar;
    the result is cached under ``cache_dir`` and reused by later runs with the same files, tokenizer and settings),
    and served row by row: a million-row file is never held as Python lists.

    Args:
        tokenizer: the model's tokenizer; conversational rows need its chat template.
        path: ``json``/``parquet``/``csv``/``arrow`` (with ``data_files``), a local data file, a local folder, or a
            ``save_to_disk`` folder.
        data_files: the files of a builder ``path`` (a path, a list, or a ``{split: files}`` map).
        split: the training split.
        eval_split: a split to validate on; or ``eval_fraction``: a seeded share of the training rows.
        columns: a ``{yours: ours}`` rename map applied first, e.g. ``{body: text}``.
        loss_on: ``completion`` (the completion or the assistant turns; plain text is learned whole) or ``all``.
        max_length: tokens per row; longer rows are counted and reported at start, then cut or dropped.
        overlong: ``truncate`` (keep the first ``max_length`` tokens) or ``drop``.
        packing: pack rows into ``max_length`` blocks, each row attending only to itself.
        batch_size: rows (or packed blocks) per loader batch.
        seed: shuffle and ``eval_fraction`` seed.
        num_workers: DataLoader worker processes.
        num_proc: processes for tokenizing (``None``: one).
        cache_dir: where prepared tables go (``None``: ``datasets``' cache folder).

    Raises:
        FileNotFoundError: a path or data file that does not exist.
        ValueError: columns that fit no format, an empty split, conversational rows with a tokenizer that has no chat
            template, or a bad setting; each names the fix.

    Example::

        dm = TextDatasetDataModule(tokenizer, path="/data/chats.jsonl", max_length=1024, packing=True)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))  # input_ids, labels, position_ids
    """

    def __init__(
        self,
        tokenizer: Any,
        path: str | None = None,
        data_files: Any = None,
        split: str = "train",
        eval_split: str | None = None,
        eval_fraction: float | None = None,
        columns: Mapping[str, str] | None = None,
        loss_on: str = "completion",
        max_length: int = 1024,
        overlong: str = "truncate",
        packing: bool = False,
        batch_size: int = 8,
        seed: int = 1234,
        num_workers: int = 0,
        num_proc: int | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if loss_on not in LOSS_ON:
            raise ValueError(f"data.loss_on={loss_on!r} is not supported; use one of {list(LOSS_ON)}.")
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong={overlong!r} is not supported; use one of {list(OVERLONG)}.")
        for name, value in (("max_length", max_length), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name} must be a positive integer, got {value!r}.")
        if int(num_workers) < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers!r}.")
        self.tokenizer = tokenizer
        self.loss_on, self.max_length, self.overlong, self.packing = loss_on, int(max_length), overlong, bool(packing)
        self.batch_size, self.seed, self.num_workers = int(batch_size), int(seed), int(num_workers)
        self.num_proc, self.cache_dir = num_proc, cache_dir
        # Read (memory-mapped) and checked now, so that bad data stops the run before a model is built.
        train, raw_eval, signature = load_train_and_eval(path, data_files, split, eval_split=eval_split,
                                                         eval_fraction=eval_fraction, columns=columns, seed=self.seed,
                                                         cache_dir=cache_dir)
        self.format = detect_format(train.column_names)
        if self.format != "text" and not _renders_chats(train, tokenizer):
            raise ValueError(f"data: the rows are conversations ({self.format} with message lists) but the tokenizer has "
                             "no chat template; use a checkpoint whose tokenizer has one, or set "
                             "model.tokenizer=/folder/with/a/chat_template.")
        self._raw = {"train": train, "eval": raw_eval}
        self._key = hash_of(signature, tokenizer, self.format, loss_on, self.max_length, _LAYOUT_VERSION)
        self.train_set: Any = None
        self.val_set: Any = None
        self.report: dict[str, Any] = {}

    # ------------------------------------------------------------------ preparation
    def prepare_data(self) -> None:
        """Tokenize into the cache (Lightning calls this on one process per machine first); the other processes'
        ``setup`` then read the cached tables instead of tokenizing again."""
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = self._tokenized("train")
            self.val_set = self._tokenized("eval") if self._raw["eval"] is not None else None

    def _tokenized(self, part: str) -> Any:
        raw = self._raw[part]
        fingerprint = hash_of(self._key, part)
        table = raw.map(
            _Tokenize(self.tokenizer, self.format, self.loss_on, self.max_length), batched=True, with_indices=True,
            remove_columns=raw.column_names, num_proc=self.num_proc, desc=f"tokenizing {part} rows",
            cache_file_name=cache_file(self.cache_dir, f"sft-{part}", fingerprint), new_fingerprint=fingerprint,
        )
        lengths = table.data.column("length")
        import pyarrow.compute as pc

        overlong = int(pc.sum(pc.greater(lengths, self.max_length)).as_py() or 0)
        rows = len(table)
        if self.overlong == "drop" and overlong:
            table = table.filter(lambda n: n <= self.max_length, input_columns="length", keep_in_memory=True)
        nothing = int(pc.sum(pc.equal(table.data.column("learned_in_budget"), 0)).as_py() or 0)
        if nothing:
            # All-prompt rows (or completions cut off by the length limit) carry no loss: train on the rest.
            table = table.filter(lambda n: n > 0, input_columns="learned_in_budget", keep_in_memory=True)
        if not len(table):
            raise ValueError(f"data: no {part} row keeps a token to learn within data.max_length={self.max_length}; "
                             "raise data.max_length or check data.loss_on.")
        columns = ["input_ids", "labels"]
        if self.packing:
            pack_key = hash_of(fingerprint, self.overlong, "packed")
            table = table.map(_Pack(self.max_length), batched=True, remove_columns=table.column_names,
                              desc=f"packing {part} rows", cache_file_name=cache_file(self.cache_dir, f"sft-{part}-packed", pack_key),
                              new_fingerprint=pack_key)
            columns.append("position_ids")
        table = table.with_format(columns=columns)
        action = {"truncate": "cut to it", "drop": "dropped"}[self.overlong]
        self.report[part] = {"rows": rows, "overlong": overlong, "nothing_to_learn": nothing, "kept": len(table)}
        rank_zero_info(
            f"data ({part}): {rows:,} rows, {self.format} format, loss on "
            f"{'everything' if self.loss_on == 'all' or self.format == 'text' else 'completions' if self.format == 'prompt_completion' else 'assistant turns'}; "
            f"{overlong:,} longer than data.max_length={self.max_length} ({action}); "
            f"{nothing:,} with nothing to learn (dropped)"
            + (f"; packed into {len(table):,} blocks" if self.packing else "")
        )
        return table

    # ------------------------------------------------------------------ loaders
    def _loader(self, dataset: Any, shuffle: bool) -> DataLoader:
        collate = SFTCollate(padding_id(self.tokenizer), self.max_length)
        return train_or_eval_loader(dataset, train=shuffle, seed=self.seed, batch_size=self.batch_size,
                                    drop_last=len(dataset) >= self.batch_size, num_workers=self.num_workers,
                                    collate_fn=collate)

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        return self._loader(self.val_set, shuffle=False) if self.val_set is not None else []


def _renders_chats(dataset: Any, tokenizer: Any) -> bool:
    """Whether conversational rows can be rendered: plain prompt/completion strings need no template."""
    if getattr(tokenizer, "chat_template", None):
        return True
    if "messages" in dataset.column_names or "conversations" in dataset.column_names:
        return False
    first = dataset[0]
    return isinstance(first.get("prompt"), str) and isinstance(first.get("completion"), str)
