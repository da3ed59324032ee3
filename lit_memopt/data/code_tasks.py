"""A built-in bank of small Python input/output tasks (CRSP's seed and fallback tasks) and its DataModule.

A task is a function ``f`` plus argument expressions; its outputs are never computed here: they come
from executing ``call_program(...)`` in :class:`lit_memopt.rewards.sandbox.Sandbox`.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lit_memopt.data.resumable import ResumableDataLoader

__all__ = ["CodeTask", "CodeTaskDataModule", "TASK_BANK", "call_program", "batch_call_program"]


@dataclass(frozen=True)
class CodeTask:
    """A Python function named ``f`` and argument expressions to call it with.

    Attributes:
        name: short identifier (for logs).
        program: source defining ``f`` (standard library only).
        inputs: argument lists as source text, e.g. ``"3"``, ``"'abc'"``, ``"[1, 2], 3"``.
        source: ``"bank"`` for the built-in tasks, ``"proposer"`` for model-proposed ones.
    """

    name: str
    program: str
    inputs: tuple[str, ...]
    source: str = "bank"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


def call_program(program: str, argument: str) -> str:
    """Program text that defines ``f`` and prints ``repr(f(<argument>))``: what the sandbox runs."""
    return f"{program.rstrip()}\n\nprint(repr(f({argument})))\n"


def batch_call_program(program: str, arguments: Sequence[str]) -> str:
    """Program text that prints ``repr([f(a1), f(a2), ...])`` (function-induction checks, one run)."""
    calls = ", ".join(f"f({a})" for a in arguments)
    return f"{program.rstrip()}\n\nprint(repr([{calls}]))\n"


def _t(name: str, program: str, *inputs: str) -> CodeTask:
    return CodeTask(name=name, program=program.strip() + "\n", inputs=tuple(inputs))


TASK_BANK: tuple[CodeTask, ...] = (
    _t("affine", "def f(x):\n    return 3 * x + 1", "2", "5", "-4"),
    _t("reverse", "def f(s):\n    return s[::-1]", "'abc'", "'racecar'", "'lit'"),
    _t("sum_list", "def f(xs):\n    return sum(xs)", "[1, 2, 3]", "[10, -4]", "[]"),
    _t("max_pair", "def f(a, b):\n    return a if a > b else b", "3, 9", "7, 2", "-1, -5"),
    _t("count_vowels", "def f(s):\n    return sum(c in 'aeiou' for c in s)", "'banana'", "'sky'", "'queue'"),
    _t("squares", "def f(n):\n    return [i * i for i in range(n)]", "4", "1", "6"),
    _t("evens", "def f(xs):\n    return [x for x in xs if x % 2 == 0]", "[1, 2, 3, 4]", "[7, 9]", "[0, 10, 11]"),
    _t("fib", "def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", "5", "10", "1"),
    _t("digits_sum", "def f(n):\n    return sum(int(d) for d in str(abs(n)))", "123", "9999", "-45"),
    _t("upper_first", "def f(s):\n    return s[:1].upper() + s[1:]", "'hello'", "'x'", "'Abc'"),
    _t("dedupe", "def f(xs):\n    seen = []\n    for x in xs:\n        if x not in seen:\n            seen.append(x)\n"
       "    return seen", "[1, 1, 2, 3, 2]", "['a', 'b', 'a']", "[]"),
    _t("word_count", "def f(s):\n    return len(s.split())", "'a b c'", "'  spaced   out '", "''"),
    _t("clip", "def f(x, lo, hi):\n    return max(lo, min(hi, x))", "5, 0, 3", "-2, 0, 3", "2, 0, 3"),
    _t("is_palindrome", "def f(s):\n    t = s.lower()\n    return t == t[::-1]", "'Level'", "'abc'", "''"),
    _t("factorial", "def f(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out", "5", "0", "7"),
    _t("zip_sum", "def f(a, b):\n    return [x + y for x, y in zip(a, b)]", "[1, 2], [3, 4]", "[5], [6, 7]", "[], []"),
    _t("char_freq", "def f(s):\n    out = {}\n    for c in s:\n        out[c] = out.get(c, 0) + 1\n    return out",
       "'hello'", "'aab'", "'z'"),
    _t("running_sum", "def f(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n        out.append(total)\n"
       "    return out", "[1, 2, 3]", "[5, -5, 5]", "[0]"),
    _t("gcd", "def f(a, b):\n    while b:\n        a, b = b, a % b\n    return a", "12, 18", "7, 5", "100, 75"),
    _t("swap_case", "def f(s):\n    return s.swapcase()", "'AbC'", "'hello World'", "'123'"),
    _t("nested_len", "def f(xs):\n    return [len(x) for x in xs]", "[[1, 2], [], [3]]", "['ab', 'c']", "[]"),
    _t("binary", "def f(n):\n    return bin(n)[2:]", "5", "0", "255"),
    _t("rotate", "def f(xs, k):\n    if not xs:\n        return xs\n    k %= len(xs)\n    return xs[k:] + xs[:k]",
       "[1, 2, 3, 4], 1", "[1, 2, 3], 5", "[], 2"),
    _t("mult_table", "def f(n):\n    return [[i * j for j in range(1, n + 1)] for i in range(1, n + 1)]", "2", "3", "1"),
    _t("collatz_steps", "def f(n):\n    steps = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
       "        steps += 1\n    return steps", "6", "1", "7"),
    _t("join_words", "def f(words, sep):\n    return sep.join(sorted(words))", "['b', 'a', 'c'], '-'", "['x'], ','",
       "[], '+'"),
    _t("second_largest", "def f(xs):\n    ys = sorted(set(xs))\n    return ys[-2] if len(ys) > 1 else None",
       "[3, 1, 4, 1, 5]", "[2, 2]", "[10, 20]"),
    _t("caesar", "def f(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)",
       "'abc', 1", "'xyz', 3", "'Hi!', 2"),
)


class _TaskSampler(Dataset):
    """``length`` seeded draws (a map-style dataset: reproducible and resumable).

    Item ``i`` is ``draw(random.Random(seed * 1_000_003 + i))``: from the bank (:func:`_draw_from_bank`)
    or from the grammar family (``code_grammar.sample_task``).
    """

    def __init__(self, draw: Callable[[random.Random], CodeTask], length: int, seed: int) -> None:
        self.draw = draw
        self.length = int(length)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> CodeTask:
        return self.draw(random.Random(self.seed * 1_000_003 + int(index)))


def _draw_from_bank(bank: Sequence[CodeTask], rng: random.Random) -> CodeTask:
    return bank[rng.randrange(len(bank))]


def _collate(tasks: list[CodeTask]) -> dict[str, Any]:
    # The leading tensor gives callbacks that size batches by their first tensor (MemoryMonitor,
    # OOMRecovery) the number of tasks; the tasks themselves are text.
    return {"task_index": torch.tensor([TASK_BANK.index(t) if t in TASK_BANK else -1 for t in tasks]), "tasks": tasks}


FAMILIES = ("bank", "grammar")


class CodeTaskDataModule(pl.LightningDataModule):
    """Batches of seed tasks for CRSP (offline, deterministic): the built-in bank or the grammar family.

    Each batch is ``{"task_index": LongTensor[B], "tasks": list[CodeTask]}`` (indices into
    :data:`TASK_BANK`, -1 for grammar tasks): the proposer is shown each task as an example, and the
    solver and critique roles fall back to it when a proposal is invalid.

    ``family="bank"``: :data:`TASK_BANK` (real little programs; for pretrained models).
    ``family="grammar"``: one-line functions of :mod:`lit_memopt.data.code_grammar`, learnable by a
    tiny model after a warm start; validation uses its held-out ``(program, input)`` pairs, and
    :meth:`warm_start_tasks` gives fresh training tasks with their outputs for a supervised warm start.

    Args:
        tokenizer: unused (kept for the CLI's uniform ``DataModule(tokenizer, ...)`` contract).
        batch_size: seed tasks per step.
        num_samples: draws per epoch (the loader cycles through epochs as needed).
        seed: sampling seed.
        tasks: restrict the family to these names: bank tasks, or grammar templates (``code_grammar.TEMPLATES``:
            ``length``, ``count``...); ``None``: all of them.
        family: ``"bank"`` or ``"grammar"``.
        num_val: validation tasks (``None``: ``max(batch_size, 8)`` for the bank, 48 for the grammar).
        warm_start_guess_rate: share of the CRSP warm start's output predictions answered with a plausible wrong
            output (another input's), so the warm-started solver guesses where an imperfect pretrained model would
            (read by ``CRSPModule.warm_start_examples``; only the warm start sees it).

    Raises:
        ValueError: non-positive ``batch_size``/``num_samples``/``num_val``, an unknown ``family``,
            unknown names in ``tasks``, or a ``warm_start_guess_rate`` outside ``[0, 1)``.

    Example::

        dm = CodeTaskDataModule(tokenizer=None, batch_size=2)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))   # {"task_index": tensor([i, j]), "tasks": [CodeTask, CodeTask]}
    """

    def __init__(
        self,
        tokenizer: Any = None,
        batch_size: int = 2,
        num_samples: int = 10_000,
        seed: int = 0,
        tasks: Sequence[str] | None = None,
        family: str = "bank",
        num_val: int | None = None,
        warm_start_guess_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"data.family={family!r} is not supported; use one of {list(FAMILIES)}.")
        if num_val is not None and int(num_val) < 1:
            raise ValueError(f"data.num_val must be a positive integer or null, got {num_val!r}.")
        if not 0.0 <= float(warm_start_guess_rate) < 1.0:
            raise ValueError(f"data.warm_start_guess_rate must be in [0, 1), got {warm_start_guess_rate!r}.")
        if int(batch_size) < 1:
            raise ValueError(f"data.batch_size must be a positive integer, got {batch_size!r}.")
        if int(num_samples) < 1:
            raise ValueError(f"data.num_samples must be a positive integer, got {num_samples!r}.")
        names = {t.name for t in TASK_BANK}
        self.grammar_templates: tuple = ()
        if family == "grammar":
            # The grammar module builds on CodeTask (this module): imported here, not at the top.
            from lit_memopt.data.code_grammar import templates_named

            self.grammar_templates = templates_named(tasks)
        elif tasks is not None:
            unknown = sorted(set(tasks) - names)
            if unknown:
                raise ValueError(f"data.tasks has unknown names {unknown}; choose from {sorted(names)}.")
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.tasks = [t for t in TASK_BANK if tasks is None or t.name in set(tasks)]
        self.family = family
        self.warm_start_guess_rate = float(warm_start_guess_rate)
        self.num_val = int(num_val) if num_val is not None else (48 if family == "grammar" else max(self.batch_size, 8))

    def setup(self, stage: str | None = None) -> None:
        if self.family == "grammar":
            # The grammar module builds on CodeTask (this module): imported here, not at the top.
            from lit_memopt.data.code_grammar import held_out_tasks, sample_task

            draw = functools.partial(sample_task, held_out=False, templates=self.grammar_templates)
            self.train_set = _TaskSampler(draw, self.num_samples, self.seed)
            self.val_set = held_out_tasks(self.num_val, self.seed + 1, templates=self.grammar_templates)
        else:
            draw = functools.partial(_draw_from_bank, self.tasks)
            self.train_set = _TaskSampler(draw, self.num_samples, self.seed)
            self.val_set = _TaskSampler(draw, self.num_val, self.seed + 1)

    def warm_start_tasks(self, count: int, seed: int) -> list[CodeTask]:
        """``count`` fresh grammar tasks with their outputs (``task.meta["outputs"]``), none held out.

        Raises:
            ValueError: ``family="bank"`` (bank outputs exist only by execution; the bank is for
                pretrained models, which need no warm start).
        """
        if self.family != "grammar":
            raise ValueError("a CRSP warm start needs data.family=grammar (tasks whose outputs are known); "
                             "set data.family=grammar or module.warm_start.steps=0.")
        from lit_memopt.data.code_grammar import sample_tasks

        return sample_tasks(count, seed, templates=self.grammar_templates)

    def train_dataloader(self) -> DataLoader:
        # Not shuffled (task i is drawn from (seed, i)); resumable, so a run killed mid-epoch goes on at its next batch.
        return ResumableDataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, collate_fn=_collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, collate_fn=_collate)
