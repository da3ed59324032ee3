"""RL prompts from a user's files (``data=prompt_dataset``) for the ``grpo`` and ``intuitor`` recipes: TRL's prompt
format (``prompt`` as text or chat messages, an optional ``answer``/``solution``), tokenized once into memory-mapped
Arrow with a cache, served left-padded for generation, with an answer checker and the extra columns that a user's
reward function receives."""

from __future__ import annotations

import inspect
import random
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_memopt.data.loading import cache_file, hash_of, load_train_and_eval, require_datasets
from lit_memopt.data.resumable import train_or_eval_loader
from lit_memopt.models.tokens import left_pad, padding_id

__all__ = ["PromptDatasetDataModule", "PromptCollate", "ANSWER_COLUMNS", "OVERLONG", "prompt_kind"]

ANSWER_COLUMNS = ("answer", "solution")  # the first found is the gold answer
OVERLONG = ("error", "drop")
FORMAT = ("`prompt` (text, or a list of {role, content} messages) with an optional `answer` (or `solution`) column; "
          "any other column is passed to module.reward_fn")
# Columns the tokenization adds; a user's columns keep their names (and reach reward functions by them).
TEXT, IDS, LENGTH = "__prompt_text", "__prompt_ids", "__prompt_length"
# Bump when the tokenized layout changes, so that old cache files are not reused.
_LAYOUT_VERSION = 1
# Rows whose characters are checked against a character tokenizer's alphabet (a sample: the data may be huge).
_ALPHABET_SAMPLE_ROWS = 1000


def prompt_kind(feature: Any) -> str | None:
    """``"text"`` for a string column, ``"messages"`` for a list of ``{role, content}`` structs, else ``None``."""
    datasets = require_datasets()
    if isinstance(feature, datasets.Value):
        return "text" if feature.dtype in ("string", "large_string") else None
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    if isinstance(inner, Mapping) and {"role", "content"} <= set(inner):
        return "messages"
    return None


def _synthetic_data_keys() -> set[str]:
    """Keys of the synthetic default data (``data=reasoning_prompts``), which the RL recipes set for it."""
    from lit_memopt.data.reasoning_prompts import ReasoningPromptsDataModule

    return set(inspect.signature(ReasoningPromptsDataModule.__init__).parameters) - {"self", "tokenizer"}


def _answer_text(value: Any) -> str | None:
    return None if value is None else str(value)


class _TokenizePrompts:
    """The ``datasets.map`` function: a batch of prompts -> their text (chat rendered), token ids and length.

    A class rather than a closure so that ``datasets`` can hash it for its cache.
    """

    def __init__(self, tokenizer: Any, kind: str) -> None:
        self.tokenizer, self.kind = tokenizer, kind

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self.kind == "messages":
            texts = [self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                     for messages in batch["prompt"]]
        else:
            texts = ["" if text is None else str(text) for text in batch["prompt"]]
        # No special tokens of the tokenizer's own: a chat template writes the ones it wants into the text.
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return {TEXT: texts, IDS: [list(row) for row in ids], LENGTH: [len(row) for row in ids]}


class PromptCollate:
    """Batches prompts left-padded to the longest of the batch (generation continues every prompt), with their
    texts, gold answers (when the data has them) and the other columns, as ``reward_kwargs``."""

    def __init__(self, pad_id: int, answer_column: str | None, kwarg_columns: list[str]) -> None:
        self.pad_id, self.answer_column, self.kwarg_columns = int(pad_id), answer_column, list(kwarg_columns)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        input_ids, attention_mask = left_pad([row[IDS] for row in rows], self.pad_id)
        batch: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "prompts": [row[TEXT] for row in rows],
            "reward_kwargs": {name: [row[name] for row in rows] for name in self.kwarg_columns},
        }
        if self.answer_column is not None:
            batch["answers"] = [_answer_text(row[self.answer_column]) for row in rows]
        return batch


class PromptDatasetDataModule(pl.LightningDataModule):
    """A user's RL prompts from local files (``data=prompt_dataset``), for the ``grpo`` and ``intuitor`` recipes.

    The split is read with ``datasets`` (memory-mapped Arrow) and checked when the module is built (bad data stops the
    run before a model is), tokenized once with ``Dataset.map`` (a progress bar; cached under ``cache_dir`` and reused
    by later runs with the same files, tokenizer and settings), and served row by row: a million-row file is never
    held as Python lists.

    Rows: a ``prompt`` column, text or a list of ``{role, content}`` messages (rendered with the tokenizer's chat
    template and its generation prompt); an optional gold ``answer`` (or ``solution``) column; any other column is
    kept and reaches a reward function (``module.reward_fn``) as a keyword argument, as in TRL. Prompts are encoded
    without the tokenizer's own special tokens (a chat template writes the ones it wants).

    Batches are dicts like ``data=reasoning_prompts``': ``input_ids`` and ``attention_mask`` (``[B, P]``, left-padded
    to the batch's longest prompt), ``prompts`` (texts), ``answers`` (strings, ``None`` where a row has none; absent
    when the data has no answer column) and ``reward_kwargs`` (column name -> values of the batch's rows).

    Args:
        tokenizer: the model's tokenizer; message prompts need its chat template.
        path: ``json``/``parquet``/``csv``/``arrow`` (with ``data_files``), a local data file, a local folder, or a
            ``save_to_disk`` folder. Never a hub name: nothing is downloaded.
        data_files: the files of a builder ``path`` (a path, a list, or a ``{split: files}`` map).
        split: the training split.
        eval_split: a split to validate on; or ``eval_fraction``: a seeded share of the training rows. Neither: no
            validation (no ``val/accuracy``).
        eval_fraction: see ``eval_split``.
        columns: a ``{yours: ours}`` rename map applied first, e.g. ``{question: prompt, gold: answer}``.
        max_prompt_length: prompt tokens at most; with ``module.max_new_tokens`` it must fit the model's positions.
        overlong: ``error`` (longer prompts stop the run, counted) or ``drop`` (dropped, counted).
        checker: ``checker(response, answer) -> float`` in ``[0, 1]`` (``val/accuracy``, and grpo's reward), e.g.
            :func:`lit_memopt.rewards.verifiers.make_verifier`'s; the config builds it from ``verifier``. ``None``:
            none.
        verifier: the name ``checker`` was built from (``math_verify``, ``exact`` or ``None``), for messages.
        verifier_timeout: seconds one ``math_verify`` answer may take (used where ``checker`` is built).
        require_answers: fail at once when the data has no answer column (grpo checks it by itself: its reward needs
            answers unless ``module.reward_fn`` is set).
        batch_size: prompts per loader batch (each becomes ``module.num_samples`` rollouts).
        seed: shuffle and ``eval_fraction`` seed.
        num_workers: DataLoader worker processes.
        num_proc: processes for tokenizing (``None``: one).
        cache_dir: where ``datasets`` and the tokenized tables cache (``None``: ``datasets``' cache folder).
        **synthetic_settings: the settings the RL recipes give their synthetic default data (``data.task``,
            ``data.restate_input``, ...); they describe no user data and are ignored.

    Raises:
        FileNotFoundError: a path or data file that does not exist (no download is tried).
        ValueError: columns that fit no format (the columns found and the format accepted are named), an empty
            split, message prompts with a tokenizer that has no chat template, ``require_answers`` without an
            answer column, characters a character tokenizer cannot encode, an unknown key or a bad setting; at
            ``setup``, prompts longer than ``max_prompt_length`` (with ``overlong=error``). Each names the fix.

    Example::

        from lit_memopt.rewards.verifiers import make_verifier
        dm = PromptDatasetDataModule(tokenizer, path="/data/math.jsonl", eval_fraction=0.05,
                                     checker=make_verifier("math_verify"))
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        dm.checker("... so \\\\boxed{0.5}", batch["answers"][0])
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
        max_prompt_length: int = 512,
        overlong: str = "error",
        checker: Callable[[str, Any], float] | None = None,
        verifier: str | None = None,
        verifier_timeout: float = 5.0,
        require_answers: bool = False,
        batch_size: int = 8,
        seed: int = 1234,
        num_workers: int = 0,
        num_proc: int | None = None,
        cache_dir: str | None = None,
        **synthetic_settings: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(synthetic_settings) - _synthetic_data_keys())
        if unknown:
            own = [name for name in inspect.signature(type(self).__init__).parameters
                   if name not in ("self", "tokenizer", "synthetic_settings")]
            raise ValueError(f"data=prompt_dataset has no key {', '.join(unknown)}; its keys: {', '.join(own)}.")
        if synthetic_settings:
            rank_zero_info(f"data=prompt_dataset: ignoring the recipe's settings of the synthetic default data "
                           f"({', '.join(sorted(synthetic_settings))}).")
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong={overlong!r} is not supported; use one of {list(OVERLONG)}.")
        for name, value in (("max_prompt_length", max_prompt_length), ("batch_size", batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"data.{name} must be a positive integer, got {value!r}.")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"data.num_workers must be an integer >= 0, got {num_workers!r}.")
        self.tokenizer, self.checker, self.verifier = tokenizer, checker, verifier
        self.max_prompt_length, self.overlong = int(max_prompt_length), overlong
        self.batch_size, self.seed, self.num_workers = int(batch_size), int(seed), int(num_workers)
        self.num_proc, self.cache_dir = num_proc, cache_dir

        # Read (memory-mapped) and checked now, so that bad data stops the run before a model is built.
        train, raw_eval, signature = load_train_and_eval(path, data_files, split, eval_split=eval_split,
                                                         eval_fraction=eval_fraction, columns=columns, seed=self.seed,
                                                         cache_dir=cache_dir)
        self.columns_found = list(train.column_names)
        self.kind = self._check_format(train)
        self.answer_column = next((name for name in ANSWER_COLUMNS if name in train.column_names), None)
        # Every column but the prompt and the answer (passed as `answer`) reaches reward functions by its name.
        self.kwarg_columns = [name for name in train.column_names if name not in ("prompt", "answer")]
        if require_answers:
            self.check_answers("data.require_answers=true")
        self._check_alphabet(train)
        self._raw = {"train": train, "eval": raw_eval}
        self._key = hash_of(signature, tokenizer, self.kind, _LAYOUT_VERSION)
        self.train_set: Any = None
        self.val_set: Any = None
        self.report: dict[str, dict[str, int]] = {}

    # ------------------------------------------------------------------ checks
    def _check_format(self, raw: Any) -> str:
        found = ", ".join(raw.column_names)
        if "prompt" not in raw.column_names:
            hint = " (a `messages` column is chat data for SFT: data=text_dataset)" if "messages" in raw.column_names else ""
            raise ValueError(f"data: the columns [{found}] fit no prompt format{hint}. Accepted: {FORMAT}. Rename "
                             "yours with data.columns={your_prompt_column: prompt, your_answer_column: answer}.")
        kind = prompt_kind(raw.features["prompt"])
        if kind is None:
            raise ValueError(f"data: the prompt column holds {raw.features['prompt']}, neither text nor a list of "
                             "{role, content} messages; point data.columns at a column that is.")
        if kind == "messages" and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("data: the prompts are chat messages (role/content lists) but the tokenizer has no chat "
                             "template to render them; use a checkpoint whose tokenizer has one (model.pretrained=DIR), "
                             "set model.tokenizer=/folder/with/a/chat_template, or give text prompts.")
        return kind

    def _check_alphabet(self, raw: Any) -> None:
        """A character tokenizer (the toy default models) encodes only its alphabet: say so rather than train on
        unknown-character tokens."""
        from lit_memopt.models.char_tokenizer import CharTokenizer, unknown_characters

        if not isinstance(self.tokenizer, CharTokenizer) or self.kind != "text":
            return
        sample = raw.select(range(min(len(raw), _ALPHABET_SAMPLE_ROWS)))
        texts = [str(text) for text in sample["prompt"]]
        if self.answer_column is not None:
            texts += [str(answer) for answer in sample[self.answer_column] if answer is not None]
        unknown = unknown_characters(self.tokenizer, texts)
        if unknown:
            raise ValueError(f"data: the model's character tokenizer cannot encode {''.join(unknown[:20])!r}, which "
                             "the prompts use; give a checkpoint (model.pretrained=DIR) or a byte-level model "
                             "(model=tiny_qwen3).")

    def check_answers(self, needed_by: str) -> None:
        """Fail in one line when the data has no answer column (``needed_by`` says what needs one)."""
        if self.answer_column is None:
            raise ValueError(f"data: {needed_by} needs a gold answer per prompt, but the data's columns are "
                             f"[{', '.join(self.columns_found)}]: add an `answer` (or `solution`) column, rename yours "
                             "with data.columns={your_column: answer}, or reward with module.reward_fn=pkg.module:fn.")

    # ------------------------------------------------------------------ preparation
    def prepare_data(self) -> None:
        """Tokenize into the cache once (rank zero of each machine); ``setup`` on the other ranks then reads the
        cached tables."""
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self._prepare()

    def _prepare(self) -> tuple[Any, Any]:
        train = self._tokenized("train")
        val = self._tokenized("eval") if self._raw["eval"] is not None else None
        if val is None:
            rank_zero_info("data: no validation set (no val/accuracy); set data.eval_fraction=0.05 or "
                           "data.eval_split=NAME for one.")
        return train, val

    def _tokenized(self, part: str) -> Any:
        import pyarrow.compute as pc

        raw = self._raw[part]
        fingerprint = hash_of(self._key, part)
        table = raw.map(
            _TokenizePrompts(self.tokenizer, self.kind), batched=True, num_proc=self.num_proc,
            desc=f"tokenizing {part} prompts", cache_file_name=cache_file(self.cache_dir, f"prompts-{part}", fingerprint),
            new_fingerprint=fingerprint,
        )
        limit = self.max_prompt_length
        overlong = int(pc.sum(pc.greater(table.data.column(LENGTH), limit)).as_py() or 0)
        rows = len(table)
        if overlong and self.overlong == "error":
            longest = int(pc.max(table.data.column(LENGTH)).as_py())
            raise ValueError(f"data: {overlong:,} of {rows:,} {part} prompts are longer than data.max_prompt_length="
                             f"{limit} tokens (the longest: {longest}); raise data.max_prompt_length (with "
                             "module.max_new_tokens it must fit the model's max_position_embeddings) or set "
                             "data.overlong=drop to drop them.")
        if overlong:
            table = table.filter(lambda n: n <= limit, input_columns=LENGTH, keep_in_memory=True)
            if not len(table):
                raise ValueError(f"data: every {part} prompt is longer than data.max_prompt_length={limit} tokens; "
                                 "raise it.")
        # The longest prompt served: with the module's response budget it must fit the model (IntuitorModule.setup).
        self.longest_prompt = max(getattr(self, "longest_prompt", 0), int(pc.max(table.data.column(LENGTH)).as_py()))
        served = [TEXT, IDS] + ([self.answer_column] if self.answer_column else []) + self.kwarg_columns
        table = table.with_format(columns=list(dict.fromkeys(served)))
        self.report[part] = {"rows": rows, "overlong": overlong, "kept": len(table)}
        answers = f"answers from `{self.answer_column}`" if self.answer_column else "no answers"
        rank_zero_info(
            f"data ({part}): {rows:,} prompts ({self.kind}), {answers}, checker {self.verifier or 'none'}; "
            f"{overlong:,} longer than data.max_prompt_length={limit}"
            + (" (dropped)" if overlong else "")
            + (f"; reward-function columns: {', '.join(self.kwarg_columns)}" if self.kwarg_columns else "")
        )
        return table

    def warm_start_examples(self, count: int, seed: int) -> list[tuple[str, str]]:
        """``count`` ``(prompt text, answer)`` pairs drawn (seeded, with replacement) from the training rows that
        have an answer, for the RL recipes' supervised warm start (``module.warm_start``).

        Raises:
            ValueError: the data has no answers, or too few rows with one to draw from.
        """
        self.check_answers("module.warm_start (a supervised start on (prompt, answer) pairs; steps=0 turns it off)")
        self.setup("fit")
        rng = random.Random(seed)
        pairs: list[tuple[str, str]] = []
        for _ in range(50 * count):
            if len(pairs) == count:
                return pairs
            row = self.train_set[rng.randrange(len(self.train_set))]
            answer = _answer_text(row[self.answer_column])
            if answer is not None and answer.strip():
                pairs.append((row[TEXT], answer))
        raise ValueError(f"data: too few training rows have an answer in `{self.answer_column}` to draw warm-start "
                         "examples from; set module.warm_start.steps=0.")

    # ------------------------------------------------------------------ loaders
    def _loader(self, dataset: Any, shuffle: bool) -> DataLoader:
        collate = PromptCollate(padding_id(self.tokenizer), self.answer_column, self.kwarg_columns)
        return train_or_eval_loader(dataset, train=shuffle, seed=self.seed, batch_size=self.batch_size,
                                    drop_last=len(dataset) >= self.batch_size, num_workers=self.num_workers,
                                    collate_fn=collate)

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        return self._loader(self.val_set, shuffle=False) if self.val_set is not None else []
