"""CRSP's text protocol: the prompts of the three roles and the parsers of what they write.

Pure string work: generated text is never evaluated in the trainer's process (programs run in the
sandbox). ``CRSPModule`` (``crsp.py``) drives the roles with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lit_memopt.data.code_tasks import CodeTask

__all__ = ["ROLES", "TASK_KINDS", "parse_proposal", "parse_answer", "parse_program", "parse_judgement"]

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
def _propose_prompt(example: CodeTask, example_output: str) -> str:
    return ("# Role: propose\n# Write a new Python function f and an input for it, like this example.\n"
            f"```python\n{example.program}```\nInput: {example.inputs[0]}\n# Output: {example_output}\n# Your task:\n")


def _solve_prompt(task: "_Task") -> str:
    if task.kind == "output":
        return ("# Role: solve\n# Predict the output of f(input); answer inside <answer></answer>.\n"
                f"```python\n{task.program}```\nInput: {task.inputs[0]}\n")
    pairs = "".join(f"Input: {i} -> Output: {o}\n" for i, o in zip(task.inputs, task.outputs))
    return "# Role: solve\n# Write a Python function f with these input/output pairs, in a ```python block.\n" + pairs


def _critique_prompt(task: "_Task", answer: str) -> str:
    return ("# Role: critique\n# Is the proposed answer correct? End with 'Verdict: correct' or 'Verdict: incorrect'.\n"
            + _solve_prompt(task).split("\n", 2)[2] + f"Proposed answer: {answer[:_MAX_FIELD_CHARS]}\n")


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
