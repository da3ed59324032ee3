"""CRSP's text protocol: the prompts of the three roles (in two styles), the parsers of what they write, and
the supervised warm-start pairs written in it.

Pure string work: generated text is never evaluated in the trainer's process (programs run in the
sandbox). ``CRSPModule`` (``crsp.py``) drives the roles with it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from lit_memopt.data.code_tasks import CodeTask

__all__ = ["ROLES", "TASK_KINDS", "PROMPT_STYLES", "warm_start_pairs", "parse_proposal", "parse_answer", "parse_program",
           "parse_judgement"]

ROLES = ("propose", "solve", "critique")
TASK_KINDS = ("output", "function")

# Canonicalises a predicted output inside the sandbox: literal_eval never runs code, and even the
# parsing of generated text happens outside the trainer.
_CANONICAL = "import ast, sys\nprint(repr(ast.literal_eval(sys.stdin.read().strip())))\n"
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_INPUT_LINE = re.compile(r"^\s*Input:\s*(.+?)\s*$", re.MULTILINE)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_VERDICT = re.compile(r"verdict\s*:\s*(incorrect|correct)", re.IGNORECASE)
_JUDGEMENT_WORD = re.compile(r"\b(incorrect|correct)\b", re.IGNORECASE)
_MAX_FIELD_CHARS = 300


# ------------------------------------------------------------------------------------ parsing
# Pure string extraction: generated text is never evaluated in the trainer's process.
def parse_program(text: str) -> str | None:
    """The function ``f`` a response defines: its first fenced code block, else from ``def f(`` onwards."""
    match = _CODE_BLOCK.search(text)
    code = match.group(1) if match else None
    if code is None:
        start = text.find("def f(")
        if start < 0:
            return None
        code = text[start:]
        stop = _INPUT_LINE.search(code)
        code = code[: stop.start()] if stop else code
    return code if "def f(" in code else None


def parse_proposal(text: str, max_inputs: int = 3) -> tuple[str, list[str]] | None:
    """``(program, inputs)`` from a proposer response (a code block or ``def f(...)``, then ``Input:`` lines)."""
    program = parse_program(text)
    if program is None or len(program) > 4 * _MAX_FIELD_CHARS:
        return None
    inputs = [i for i in _INPUT_LINE.findall(text) if 0 < len(i) <= _MAX_FIELD_CHARS][: int(max_inputs)]
    return (program, inputs) if inputs else None


def parse_answer(text: str) -> str:
    """A solver's predicted output: inside ``<answer>...</answer>``, else after ``</think>``, else the first line."""
    match = _ANSWER.search(text)
    if match:
        answer = match.group(1)
    else:
        answer = text.split("</think>")[-1]
    lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
    return lines[0][:_MAX_FIELD_CHARS] if lines else ""


def parse_judgement(text: str) -> bool | None:
    """A critique's judgement: the last ``Verdict: correct|incorrect`` (else the last such word); ``None`` if absent."""
    found = _VERDICT.findall(text) or _JUDGEMENT_WORD.findall(text)
    if not found:
        return None
    return found[-1].lower() == "correct"


# ------------------------------------------------------------------------------------ prompts
# "instruct": a comment line that tells the role what to write, and fenced code (real checkpoints follow it).
# "compact": a one-word role tag and the bare program: about 45 bytes a solve prompt instead of about 130, for
# a tiny model that learns the protocol in its warm start (the instruction bytes are the same in every prompt
# and only cost it sequence length). Answers are written and parsed the same way in both styles.
PROMPT_STYLES = ("instruct", "compact")
_HEADERS = {
    "instruct": {
        "propose": "# Role: propose\n# Write a new Python function f and an input for it, like this example.\n",
        "output": "# Role: solve\n# Predict the output of f(input); answer inside <answer></answer>.\n",
        "function": "# Role: solve\n# Write a Python function f with these input/output pairs, in a ```python block.\n",
        "critique": "# Role: critique\n# Is the proposed answer correct? End with 'Verdict: correct' or "
                    "'Verdict: incorrect'.\n",
    },
    "compact": {"propose": "#propose\n", "output": "#solve\n", "function": "#induce\n", "critique": "#critique\n"},
}


def _program_text(program: str, style: str) -> str:
    return f"```python\n{program}```\n" if style == "instruct" else program


def _task_text(task: "_Task", style: str) -> str:
    """What a solver (and a critic) is shown of a task, without the role header."""
    if task.kind == "output":
        return f"{_program_text(task.program, style)}Input: {task.inputs[0]}\n"
    return "".join(f"Input: {i} -> Output: {o}\n" for i, o in zip(task.inputs, task.outputs))


def _propose_prompt(example: CodeTask, example_output: str, style: str = "instruct") -> str:
    return (f"{_HEADERS[style]['propose']}{_program_text(example.program, style)}Input: {example.inputs[0]}\n"
            f"# Output: {example_output}\n# Your task:\n")


def _solve_prompt(task: "_Task", style: str = "instruct") -> str:
    return _HEADERS[style][task.kind] + _task_text(task, style)


def _critique_prompt(task: "_Task", answer: str, style: str = "instruct") -> str:
    return f"{_HEADERS[style]['critique']}{_task_text(task, style)}Proposed answer: {answer[:_MAX_FIELD_CHARS]}\n"


@dataclass
class _Task:
    """A solvable task: the program, its inputs and their executed outputs (``repr`` strings)."""

    program: str
    inputs: list[str]
    outputs: list[str]
    kind: str
    source: str
    proposal: int | None = None  # index of the proposal it came from (None: task bank fallback)
    answers: list[str] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)


def warm_start_pairs(tasks: list[CodeTask], rng: random.Random, function_task_ratio: float,
                     style: str = "instruct", guess_rate: float = 0.0) -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs of the three roles in CRSP's text protocol (prompts and programs in ``style``), one
    per two tasks with known outputs (``task.meta["outputs"]``; the second task of each two is the proposer's example
    or a source of wrong answers):

    - propose (15%): the example -> the task's program and its ``Input:`` lines;
    - solve (65%, split by ``function_task_ratio``): predict ``f(input)`` -> ``<answer>output</answer>``, or write
      ``f`` from the input/output pairs -> the program;
    - critique (20%): the task with a correct or a wrong output (another input's) -> ``Verdict: correct|incorrect``.

    ``guess_rate``: the share of output predictions answered with a plausible wrong output (another input's) instead
    of the right one, a stand-in for the guesses of an imperfect pretrained model that the sandbox reward can unlearn.
    """
    roles = ("propose", "output", "function", "critique")
    weights = (0.15, 0.65 * (1 - function_task_ratio), 0.65 * function_task_ratio, 0.2)
    pairs: list[tuple[str, str]] = []
    for task, other in zip(tasks[0::2], tasks[1::2]):
        outputs = list(task.meta["outputs"])
        role = rng.choices(roles, weights)[0]
        if role == "propose":
            inputs = "".join(f"Input: {i}\n" for i in task.inputs)
            pairs.append((_propose_prompt(other, other.meta["outputs"][0], style),
                          _program_text(task.program, style) + inputs))
            continue
        solvable = _Task(task.program, list(task.inputs), outputs, "function" if role == "function" else "output",
                         task.source)
        wrong = [o for o in outputs[1:] + list(other.meta["outputs"]) if o != outputs[0]]
        if role == "output":
            guess = guess_rate > 0 and rng.random() < guess_rate and wrong  # rate 0: the draws of before
            pairs.append((_solve_prompt(solvable, style), f"<answer>{rng.choice(wrong) if guess else outputs[0]}</answer>"))
        elif role == "function":
            pairs.append((_solve_prompt(solvable, style), _program_text(task.program, style)))
        else:
            correct = rng.random() < 0.5 or not wrong
            shown = outputs[0] if correct else rng.choice(wrong)
            pairs.append((_critique_prompt(solvable, shown, style), f"Verdict: {'correct' if correct else 'incorrect'}"))
    return pairs


def _split_list_repr(text: str, count: int) -> list[str] | None:
    """Split ``repr([a, b, ...])`` printed by the sandbox into the items' reprs (no eval).

    Items are separated at top-level ``", "``; brackets and quotes are tracked so nested values
    and strings with commas survive. Returns ``None`` when the count does not match.
    """
    if not (text.startswith("[") and text.endswith("]")):
        return None
    body, items, depth, quote, start, i = text[1:-1], [], 0, None, 0, 0
    while i < len(body):
        ch = body[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i].strip())
            start = i + 1
        i += 1
    if body.strip():
        items.append(body[start:].strip())
    return items if len(items) == count else None
