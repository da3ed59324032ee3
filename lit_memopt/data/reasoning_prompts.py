"""Synthetic short-reasoning prompts (arithmetic, comparisons, string copy/reversal) with an exact-answer
checker, generated offline from a seed: the prompt set of the RL recipes (Intuitor)."""

from __future__ import annotations

import random
import re
from typing import Any, Callable

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lit_memopt.data.resumable import train_or_eval_loader
from lit_memopt.models.tokens import left_pad, padding_id

TASKS = ("add", "sub", "mul", "max", "copy", "reverse")
TASK_GROUPS = {"arithmetic": ("add", "sub", "mul", "max"), "strings": ("copy", "reverse"), "mixed": TASKS}
PROMPT_STYLES = ("compact", "instruct")

_LETTERS = "abcdefghij"
RESTATE_SEPARATOR = "|"
_NUMBER = re.compile(r"-?\d+")
_WORD = re.compile(r"[a-z]+")


def make_problem(
    rng: random.Random, task: str, max_operand: int = 20, max_word_length: int = 5, min_word_length: int = 2
) -> tuple[str, str]:
    """One ``(question, answer)`` pair, e.g. ``("12+7", "19")`` or ``("reverse abc", "cba")``; words have
    ``min_word_length`` to ``max_word_length`` letters."""
    if task in ("add", "sub", "mul", "max"):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if task == "add":
            return f"{a}+{b}", str(a + b)
        if task == "sub":
            a, b = max(a, b), min(a, b)  # keep answers non-negative: one fewer thing for a small model to learn
            return f"{a}-{b}", str(a - b)
        if task == "mul":
            a, b = a % 10, b % 10
            return f"{a}*{b}", str(a * b)
        return f"max({a},{b})", str(max(a, b))
    if task in ("copy", "reverse"):
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(min_word_length, max_word_length)))
        return f"{task} {word}", word if task == "copy" else word[::-1]
    raise ValueError(f"unknown task {task!r}; use one of {list(TASKS)}.")


def guess_like(rng: random.Random, answer: str) -> str:
    """A random answer of the same kind and length as ``answer``: digits for a number, letters for a word.

    The warm start's stand-in for an unsure guess (``warm_start_guess_rate``): same length, so a guess cannot be told
    from a right answer by its length.
    """
    alphabet = "0123456789" if answer.lstrip("-").isdigit() else _LETTERS
    guess = "".join(rng.choice(alphabet) for _ in answer.lstrip("-"))
    if alphabet == "0123456789" and len(guess) > 1:  # no leading zero: a number as the tasks write it
        guess = rng.choice("123456789") + guess[1:]
    return ("-" if answer.startswith("-") else "") + guess


def restatement(rng: random.Random, question: str, guess: str | None = None) -> str:
    """What a ``restate_input`` response writes after its answer: the input word of a copy/reverse ``question``.

    After a guessed answer (the warm start's ``guess``) the input word and the word the guess implies (the guess
    for ``copy``, its reverse for ``reverse``) disagree, and each letter of the restatement is one of the two,
    drawn at random: a policy that guessed is unsure how to restate, as a calibrated model is.
    """
    task, word = question.split(" ", 1)
    if guess is None:
        return word
    implied = guess if task == "copy" else guess[::-1]
    return "".join(rng.choice(pair) for pair in zip(word, implied))


def format_prompt(question: str, style: str = "compact") -> str:
    """The text the model continues: ``compact`` for byte-level tiny models, ``instruct`` for real checkpoints."""
    if style == "compact":
        return f"{question}="
    if style == "instruct":
        return (
            "Solve the problem. Think briefly, then give the final result on its own line as 'Answer: <result>'.\n"
            f"Problem: {question}\n"
        )
    raise ValueError(f"prompt style {style!r} is not supported; use one of {list(PROMPT_STYLES)}.")


def extract_answer(response: str) -> str | None:
    """The final answer in a response: the text after the last ``Answer:`` when present, else the whole
    response; from it the first integer (numeric answers) or first lowercase word. ``None`` if nothing."""
    text = response
    marker = text.lower().rfind("answer:")
    if marker >= 0:
        text = text[marker + len("answer:") :]
    text = text.strip().lower()
    number = _NUMBER.match(text)
    if number:
        return number.group(0)
    word = _WORD.match(text)
    return word.group(0) if word else None


def answer_is_correct(response: str, answer: str) -> float:
    """1.0 when the answer extracted from ``response`` equals ``answer`` exactly, else 0.0."""
    return float(extract_answer(response) == answer.strip().lower())


class _PromptDataset(Dataset):
    def __init__(self, prompts: list[str], answers: list[str], token_ids: list[list[int]]) -> None:
        self.prompts, self.answers, self.token_ids = prompts, answers, token_ids

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"prompt": self.prompts[i], "answer": self.answers[i], "ids": self.token_ids[i]}


class _LeftPadCollate:
    """Batches prompts left-padded to the longest in the batch, so generation continues every prompt."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        input_ids, attention_mask = left_pad([item["ids"] for item in items], self.pad_id)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "prompts": [item["prompt"] for item in items],
            "answers": [item["answer"] for item in items],
        }


class ReasoningPromptsDataModule(LightningDataModule):
    """Short reasoning prompts with known answers, generated from a seed (no downloads).

    Batches are dicts: ``input_ids`` and ``attention_mask`` (``[B, P]``, left-padded), ``prompts``
    (texts) and ``answers`` (reference answers). RL modules sample responses to the prompts; the
    ``checker`` attribute (:func:`answer_is_correct`) scores a response against its answer, for
    logging accuracy or as a verifiable reward.

    Args:
        tokenizer: any Hugging Face tokenizer (prompts are encoded without special tokens).
        task: one task (``add``, ``sub``, ``mul``, ``max``, ``copy``, ``reverse``) or a group
            (``arithmetic``, ``strings``, ``mixed``).
        prompt_style: ``compact`` (``12+7=``, for tiny byte-level models) or ``instruct`` (a one-line
            instruction asking for ``Answer: <result>``, for real checkpoints).
        num_train: training prompts.
        num_val: validation prompts.
        batch_size: prompts per loader batch (each becomes ``num_samples`` rollouts in the module).
        max_operand: largest operand of the arithmetic tasks.
        max_word_length: longest word of the string tasks.
        min_word_length: shortest word of the string tasks (equal to ``max_word_length``: every answer
            has the same length, so a response cannot be rewarded for its length).
        seed: generator seed; the same seed gives the same prompts (and the same training shuffle, which a resume
            replays mid-epoch).
        num_workers: DataLoader worker processes.
        warm_start_guess_rate: share of :meth:`warm_start_examples` answered with a random guess of the right kind
            and length (:func:`guess_like`) instead of the answer: a warm-started policy that knows the answers but
            samples guesses, for an RL phase to improve (the ``grpo`` recipe). Only the warm start sees it.
        restate_input: the warm-start responses restate the input word after the answer, ``answer|word``
            (copy/reverse tasks only); after a guess the restatement mixes the input and the guess letter by letter
            (:func:`restatement`). The checker still scores the answer, the text before the ``|``.

    Raises:
        ValueError: on an unknown ``task`` or ``prompt_style``, a non-positive size, a
            ``warm_start_guess_rate`` outside ``[0, 1)``, ``restate_input`` with arithmetic tasks, or (at
            ``setup``) characters the tokenizer cannot encode.

    Example::

        dm = ReasoningPromptsDataModule(tokenizer, task="arithmetic", batch_size=4)
        batch = next(iter(dm.train_dataloader()))
        dm.checker("19", batch["answers"][0])
    """

    checker: Callable[[str, str], float] = staticmethod(answer_is_correct)

    def __init__(
        self,
        tokenizer: Any,
        task: str = "mixed",
        prompt_style: str = "compact",
        num_train: int = 2048,
        num_val: int = 128,
        batch_size: int = 8,
        max_operand: int = 20,
        max_word_length: int = 5,
        min_word_length: int = 2,
        seed: int = 1234,
        num_workers: int = 0,
        warm_start_guess_rate: float = 0.0,
        restate_input: bool = False,
    ) -> None:
        super().__init__()
        if task not in TASKS and task not in TASK_GROUPS:
            raise ValueError(f"data.task={task!r} is not supported; use one of {list(TASKS) + list(TASK_GROUPS)}.")
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"data.prompt_style={prompt_style!r} is not supported; use one of {list(PROMPT_STYLES)}.")
        for name, value in (
            ("num_train", num_train),
            ("num_val", num_val),
            ("batch_size", batch_size),
            ("max_operand", max_operand),
            ("max_word_length", max_word_length),
        ):
            if int(value) <= 0:
                raise ValueError(f"data.{name} must be a positive integer, got {value!r}.")
        if not 1 <= int(min_word_length) <= int(max_word_length):
            raise ValueError(
                f"data.min_word_length must be between 1 and data.max_word_length ({max_word_length!r}), "
                f"got {min_word_length!r}."
            )
        if int(num_workers) < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers!r}.")
        if not 0.0 <= float(warm_start_guess_rate) < 1.0:
            raise ValueError(f"data.warm_start_guess_rate must be in [0, 1), got {warm_start_guess_rate!r}.")
        self.tokenizer = tokenizer
        self.task, self.prompt_style = task, prompt_style
        self.num_train, self.num_val, self.batch_size = int(num_train), int(num_val), int(batch_size)
        self.max_operand, self.max_word_length = int(max_operand), int(max_word_length)
        self.min_word_length = int(min_word_length)
        self.seed, self.num_workers = int(seed), int(num_workers)
        self.warm_start_guess_rate = float(warm_start_guess_rate)
        arithmetic = set(TASK_GROUPS.get(task, (task,))) - set(TASK_GROUPS["strings"])
        if restate_input and arithmetic:
            raise ValueError(f"data.restate_input restates the input word of copy/reverse prompts; data.task={task!r} "
                             f"includes {sorted(arithmetic)}. Use data.task=strings, copy or reverse.")
        self.restate_input = bool(restate_input)
        self.train_set: _PromptDataset | None = None
        self.val_set: _PromptDataset | None = None

    def _problem(self, rng: random.Random, tasks: tuple[str, ...]) -> tuple[str, str]:
        return make_problem(rng, rng.choice(tasks), self.max_operand, self.max_word_length, self.min_word_length)

    def _make(self, rng: random.Random, count: int) -> _PromptDataset:
        tasks = TASK_GROUPS.get(self.task, (self.task,))
        prompts, answers = [], []
        for _ in range(count):
            question, answer = self._problem(rng, tasks)
            prompts.append(format_prompt(question, self.prompt_style))
            answers.append(answer)
        token_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        return _PromptDataset(prompts, answers, [list(ids) for ids in token_ids])

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        rng = random.Random(self.seed)
        from lit_memopt.models.char_tokenizer import unknown_characters  # imports transformers: only when set up

        train_set, val_set = self._make(rng, self.num_train), self._make(rng, self.num_val)
        texts = train_set.prompts + train_set.answers + val_set.prompts + val_set.answers
        unknown = unknown_characters(self.tokenizer, texts + [RESTATE_SEPARATOR] * self.restate_input)
        if unknown:
            raise ValueError(f"the tokenizer cannot encode {unknown}, which the data.task={self.task!r} prompts or "
                             "answers use: add them to model.alphabet.")
        self.train_set, self.val_set = train_set, val_set

    def warm_start_examples(self, count: int, seed: int) -> list[tuple[str, str]]:
        """``count`` fresh ``(prompt, answer)`` pairs of the same task family for a supervised warm start.

        Drawn from their own seed stream; questions of the validation set are redrawn, so the held-out
        accuracy stays held out.
        """
        self.setup()
        held_out = set(self.val_set.prompts)
        rng = random.Random(seed)
        tasks = TASK_GROUPS.get(self.task, (self.task,))
        pairs: list[tuple[str, str]] = []
        while len(pairs) < count:
            question, answer = self._problem(rng, tasks)
            prompt = format_prompt(question, self.prompt_style)
            if prompt in held_out:
                continue
            guess = None
            if self.warm_start_guess_rate and rng.random() < self.warm_start_guess_rate:  # rate 0: the draw of before
                guess = guess_like(rng, answer)
            if self.restate_input:
                answer = (guess or answer) + RESTATE_SEPARATOR + restatement(rng, question, guess)
            elif guess is not None:
                answer = guess
            pairs.append((prompt, answer if self.prompt_style == "compact" else f"Answer: {answer}"))
        return pairs

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        collate = _LeftPadCollate(padding_id(self.tokenizer))
        return train_or_eval_loader(dataset, train=shuffle, seed=self.seed, batch_size=self.batch_size,
                                    num_workers=self.num_workers, collate_fn=collate)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.val_set, shuffle=False)
