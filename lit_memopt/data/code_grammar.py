"""A small grammar of one-line Python functions: CRSP's learnable synthetic task family.

The built-in bank (``code_tasks.TASK_BANK``: Fibonacci, Collatz, Caesar ciphers...) is far beyond a
random-init model of a few M parameters, so on the embedded default CRSP would only show a pipeline.
This family is meant to be within such a model's reach after a warm start, but not solved by it:
``def f(x): return x + 3`` on small integers, ``def f(s): return s[::-1]`` on short strings. Predicting
an output needs reading the program and computing (copy, reverse, small arithmetic). Measured on the
embedded default (3.2M parameters, 600 warm-start steps; a probe script with an early form of the compact
prompts, 96 held-out tasks): solve rate 0.40 greedy, 0.30 sampled, with ``len``/``count``/``first``/``head``
mostly right, ``upper``/``reverse`` right about 40% of the time greedily, and ``add``/``sub``/``repeat``/
``tail`` not yet (after 300 steps: 0.20 and 0.19, the copy-type ones not at all).

Every task's outputs are known without running generated code: each template carries its own
pure-Python meaning (``GrammarTemplate.meaning``), used for the warm-start answers. During training the
outputs still come from executing the program in the sandbox, as for any task.

Held out: a deterministic 1-in-8 split of ``(program, input)`` pairs (a hash, not Python's salted
``hash``). Validation asks only held-out pairs; warm-start and training tasks never contain one.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from lit_memopt.data.code_tasks import CodeTask

__all__ = ["GrammarTemplate", "TEMPLATES", "templates_named", "is_held_out", "sample_task", "sample_tasks", "held_out_tasks"]

_LETTERS = "abcde"  # a small alphabet, so that s.count('c') and friends are often non-zero
_MAX_INT = 12
HELD_OUT_ONE_IN = 8


@dataclass(frozen=True)
class GrammarTemplate:
    """One production of the grammar: ``def f(<arg>): return <body>`` with integer slots ``{a}``/``{b}``/``{c}``.

    Attributes:
        name: short identifier.
        arg: ``"x"`` (an int in ``[0, 12]``) or ``"s"`` (2-4 letters of ``abcde``).
        body: the returned expression, with ``{a}``, ``{b}`` (small ints) and ``{c}`` (a letter) slots.
        meaning: ``meaning(value, a, b, c)`` -> the function's result (what ``f`` returns).
        a_range: the values ``{a}`` takes (inclusive).
    """

    name: str
    arg: str
    body: str
    meaning: Callable[..., object]
    a_range: tuple[int, int] = (1, 9)

    def program(self, a: int, b: int, c: str) -> str:
        return f"def f({self.arg}):\n    return {self.body.format(a=a, b=b, c=c)}\n"


TEMPLATES: tuple[GrammarTemplate, ...] = (
    GrammarTemplate("add", "x", "x + {a}", lambda x, a, b, c: x + a),
    GrammarTemplate("sub", "x", "x - {a}", lambda x, a, b, c: x - a),
    GrammarTemplate("max", "x", "max(x, {a})", lambda x, a, b, c: max(x, a)),
    GrammarTemplate("min", "x", "min(x, {a})", lambda x, a, b, c: min(x, a)),
    GrammarTemplate("double", "x", "x + x", lambda x, a, b, c: x + x),
    GrammarTemplate("reverse", "s", "s[::-1]", lambda s, a, b, c: s[::-1]),
    GrammarTemplate("upper", "s", "s.upper()", lambda s, a, b, c: s.upper()),
    GrammarTemplate("repeat", "s", "s * 2", lambda s, a, b, c: s * 2),
    GrammarTemplate("tail", "s", "s[1:]", lambda s, a, b, c: s[1:]),
    GrammarTemplate("head", "s", "s[:{a}]", lambda s, a, b, c: s[:a], (1, 3)),
    GrammarTemplate("first", "s", "s[0]", lambda s, a, b, c: s[0]),
    GrammarTemplate("length", "s", "len(s)", lambda s, a, b, c: len(s)),
    GrammarTemplate("append", "s", "s + '{c}'", lambda s, a, b, c: s + c),
    GrammarTemplate("count", "s", "s.count('{c}')", lambda s, a, b, c: s.count(c)),
)


def templates_named(names: Sequence[str] | None) -> tuple[GrammarTemplate, ...]:
    """The templates called ``names`` (``None``: all of them, in their order).

    Raises:
        ValueError: a name no template has.
    """
    if names is None:
        return TEMPLATES
    known = {t.name for t in TEMPLATES}
    unknown = sorted(set(names) - known)
    if unknown or not names:
        problem = f"has unknown grammar templates {unknown}" if unknown else "is empty"
        raise ValueError(f"data.tasks {problem}; choose one or more of {[t.name for t in TEMPLATES]}, or null for all.")
    return tuple(t for t in TEMPLATES if t.name in set(names))


def is_held_out(program: str, argument: str) -> bool:
    """Whether ``f(argument)`` of ``program`` belongs to the held-out split (deterministic, about 1 in 8)."""
    digest = hashlib.sha1(f"{program}|{argument}".encode()).digest()
    return digest[0] % HELD_OUT_ONE_IN == 0


def _argument(rng: random.Random, arg: str) -> tuple[object, str]:
    if arg == "x":
        value: object = rng.randint(0, _MAX_INT)
    else:
        value = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 4)))
    return value, repr(value)


def sample_task(rng: random.Random, num_inputs: int = 3, held_out: bool | None = False,
                templates: Sequence[GrammarTemplate] = TEMPLATES) -> CodeTask:
    """One grammar task with ``num_inputs`` distinct inputs; ``meta["outputs"]`` holds the ``repr`` of each result.

    ``held_out=False`` (training and warm start): no ``(program, input)`` pair of the task is held out.
    ``held_out=True`` (validation): the first input (the one an output-prediction task asks about) is.
    ``None``: no constraint. ``templates``: the productions to draw from (all of them by default).
    """
    while True:
        template = rng.choice(templates)
        a, b, c = rng.randint(*template.a_range), rng.randint(0, 9), rng.choice(_LETTERS)
        program = template.program(a, b, c)
        values: list[object] = []
        texts: list[str] = []
        for _ in range(20 * num_inputs):
            value, text = _argument(rng, template.arg)
            if text not in texts:
                values.append(value)
                texts.append(text)
            if len(texts) == num_inputs:
                break
        if len(texts) < num_inputs:
            continue
        held = [is_held_out(program, t) for t in texts]
        if held_out is False and any(held):
            continue
        if held_out is True and not held[0]:
            continue
        outputs = tuple(repr(template.meaning(v, a, b, c)) for v in values)
        return CodeTask(name=template.name, program=program, inputs=tuple(texts), source="grammar",
                        meta={"outputs": outputs})


def sample_tasks(count: int, seed: int, num_inputs: int = 3,
                 templates: Sequence[GrammarTemplate] = TEMPLATES) -> list[CodeTask]:
    """``count`` training tasks (no held-out pair) from the seed."""
    rng = random.Random(seed)
    return [sample_task(rng, num_inputs, held_out=False, templates=templates) for _ in range(int(count))]


def held_out_tasks(count: int, seed: int, num_inputs: int = 3,
                   templates: Sequence[GrammarTemplate] = TEMPLATES) -> list[CodeTask]:
    """``count`` distinct validation tasks whose asked pair (program, first input) is held out."""
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    tasks: list[CodeTask] = []
    while len(tasks) < int(count):
        task = sample_task(rng, num_inputs, held_out=True, templates=templates)
        key = (task.program, task.inputs[0])
        if key not in seen:
            seen.add(key)
            tasks.append(task)
    return tasks
