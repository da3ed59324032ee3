"""Answer verifiers for a user's prompt data (``data.verifier``: ``math_verify`` or ``exact``) and the loading and
calling of a user's own reward function (``module.reward_fn``, TRL's reward-function signature).

Kept free of torch and Lightning at import time: the ``math_verify`` worker process imports this module and nothing
more than the ``math-verify`` package.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import math
import multiprocessing
import os
import sys
import threading
from typing import Any, Callable, Mapping, Sequence

from lit_memopt._extras import MissingExtraError  # re-exported: raised here when math-verify is missing

__all__ = ["VERIFIERS", "MissingExtraError", "final_answer", "exact_match", "math_verify_score", "MathVerifier",
           "make_verifier", "load_reward_fn", "call_reward_fn"]

VERIFIERS = ("math_verify", "exact")
INSTALL_HINT = "pip install 'lit-memopt[data]'"
# The worker's imports (sympy, the LaTeX grammar) take a second or two; on a busy machine several. They are waited
# for apart from the per-answer limit, which would otherwise time out the first answer of every (re)start.
_STARTUP_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- exact
def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces nested), or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index]
    return None  # unclosed: the response was cut off inside the box


def final_answer(response: str) -> str:
    """The final answer of a response: the rest of the line after the last ``Answer:``, else the content of the last
    ``\\boxed{...}``, else the whole response; stripped.

    Example::

        final_answer("2+2 is four.\\nAnswer: 4")  # "4"
        final_answer("so \\\\boxed{\\\\frac{1}{2}}")  # "\\\\frac{1}{2}"
    """
    marker = response.rfind("Answer:")
    if marker >= 0:
        # The line after the marker: a model that writes on after its answer line is still judged by that line.
        return response[marker + len("Answer:"):].strip().split("\n", 1)[0].strip()
    boxed = _last_boxed(response)
    return (boxed if boxed is not None else response).strip()


def exact_match(response: str, answer: Any) -> float:
    """1.0 when the final answer of ``response`` (:func:`final_answer`) equals the stripped ``answer``, else 0.0.

    A missing or empty gold answer scores 0: an empty response must not match it.
    """
    gold = "" if answer is None else str(answer).strip()
    return float(bool(gold) and final_answer(str(response)) == gold)


# ----------------------------------------------------------------------------- math_verify
def math_verify_score(response: str, answer: str) -> float:
    """math-verify's verdict, with its own (signal-based) time limits off: ``parse`` the gold answer, then the
    response, then ``verify(gold, prediction)``. Runs inside :class:`MathVerifier`'s worker process."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None)
    prediction = parse(response, parsing_timeout=None)
    return float(verify(gold, prediction, timeout_seconds=None))


def _worker_loop(conn: Any, score_fn: Callable[[str, str], float]) -> None:
    """The worker process: score one ``(response, answer)`` at a time until ``None`` or a closed pipe."""
    # math-verify warns once that its timeouts are off: the parent process enforces the limit.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        import math_verify  # noqa: F401 - imported before "ready", so startup is not charged to the first answer
    except ImportError:
        pass  # a custom score_fn may not need it
    conn.send("ready")
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        try:
            score = float(score_fn(*item))
        except Exception:  # noqa: BLE001 - an answer that cannot be parsed or compared is simply not verified
            score = 0.0
        conn.send(score if math.isfinite(score) else 0.0)


class _Worker:
    """One spawned worker process and its end of the pipe."""

    def __init__(self, score_fn: Callable[[str, str], float]) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process that holds CUDA or threads
        self.conn, child = context.Pipe()
        # A daemonic process (a DataLoader worker) may not have daemonic children.
        self.process = context.Process(target=_worker_loop, args=(child, score_fn), name="math_verify",
                                       daemon=not multiprocessing.current_process().daemon)
        self.process.start()
        child.close()
        atexit.register(self.close)
        try:
            ready = self.conn.poll(_STARTUP_TIMEOUT_S) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.close()
            # spawn re-imports the main script in the child: an unguarded script starts itself again and dies.
            raise RuntimeError(f"the math_verify worker process did not start within {_STARTUP_TIMEOUT_S:.0f} s (a "
                               "script that calls the verifier must run its code under `if __name__ == '__main__':`)")

    def close(self, wait_s: float = 1.0) -> None:
        """Ask the worker to end, wait up to ``wait_s`` seconds, then kill it."""
        atexit.unregister(self.close)
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=wait_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.conn.close()


class MathVerifier:
    """``checker(response, answer) -> float``: math-verify's symbolic equality, with a time limit per answer that
    works from any thread.

    math-verify's own limits use ``signal.alarm``, which only the main thread may set (Lightning's strategies and
    dataloader workers may call from elsewhere). Here each answer goes to a persistent worker process (``spawn``)
    over a pipe, with math-verify's limits off; the caller waits ``timeout_s`` for the verdict. An answer that takes
    longer scores 0, and its worker is killed and restarted (a warning, once). The worker starts on the first call
    and ends with the process (or :meth:`close`).

    Args:
        timeout_s: seconds one answer may take (parsing both sides and comparing them).
        score_fn: what the worker computes, a picklable ``(response, answer) -> float``; default
            :func:`math_verify_score`. For tests.

    Raises:
        MissingExtraError: ``math-verify`` is not installed (the default ``score_fn``).
        ValueError: a non-positive ``timeout_s``.

    Example::

        verifier = MathVerifier(timeout_s=5)
        verifier("so the answer is \\\\boxed{0.5}", "\\\\frac{1}{2}")  # 1.0
    """

    def __init__(self, timeout_s: float = 5.0, score_fn: Callable[[str, str], float] | None = None) -> None:
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"data.verifier_timeout must be a number of seconds > 0, got {timeout_s!r}.")
        if score_fn is None:
            if importlib.util.find_spec("math_verify") is None:
                raise MissingExtraError(f"data.verifier=math_verify needs the math-verify package: {INSTALL_HINT} "
                                        "(or set data.verifier=exact).")
            score_fn = math_verify_score
        self.timeout_s = float(timeout_s)
        self.score_fn = score_fn
        self.timeouts = 0  # answers that ran out of time
        self._worker: _Worker | None = None
        self._lock = threading.Lock()

    def __call__(self, response: str, answer: Any) -> float:
        gold = "" if answer is None else str(answer).strip()
        if not gold:
            return 0.0
        with self._lock:  # one answer at a time on the pipe
            if self._worker is None or not self._worker.process.is_alive():
                self._worker = _Worker(self.score_fn)
            worker = self._worker
            try:
                worker.conn.send((str(response), gold))
                if worker.conn.poll(self.timeout_s):
                    return float(worker.conn.recv())
            except (EOFError, OSError):
                pass  # the worker died (out of memory, killed): restart it below and score 0
            else:
                self.timeouts += 1
                if self.timeouts == 1:
                    _warn(f"math_verify: an answer took longer than data.verifier_timeout={self.timeout_s:g} s; it "
                          "scores 0 and the verifier's worker restarts (further timeouts are not reported).")
            worker.close(wait_s=0.0)  # busy with the slow answer (or dead): nothing to wait for
            self._worker = None
            return 0.0

    def close(self) -> None:
        """End the worker process (a later call starts a new one)."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a pickled module or datamodule) starts its own worker when first called.
        state = dict(self.__dict__)
        state["_worker"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MathVerifier(timeout_s={self.timeout_s:g})"


def _warn(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(message)


def make_verifier(name: str | None, timeout_s: float = 5.0) -> Callable[[str, Any], float] | None:
    """The checker of ``data.verifier``: ``math_verify`` (:class:`MathVerifier`), ``exact`` (:func:`exact_match`),
    or ``None`` for none.

    Raises:
        ValueError: an unknown name (the accepted ones are named), or a bad ``timeout_s``.
        MissingExtraError: ``math_verify`` without the ``math-verify`` package.
    """
    if name is None:
        return None
    if name == "exact":
        return exact_match
    if name == "math_verify":
        return MathVerifier(timeout_s)
    raise ValueError(f"data.verifier={name!r} is not a verifier; use one of {list(VERIFIERS)} or null (none).")


# ----------------------------------------------------------------------------- reward functions
def load_reward_fn(spec: str, key: str = "module.reward_fn") -> Callable[..., Sequence[float]]:
    """The callable named by ``"package.module:function"`` or ``"package.module.function"``.

    Modules are imported as installed, else from the working directory (as ``python -m`` would find them).

    Raises:
        ValueError: a malformed name, a module that cannot be imported, or a name that is missing or not callable.
    """
    text = str(spec).strip()
    module_name, sep, attribute = text.partition(":") if ":" in text else text.rpartition(".")
    if not module_name or not attribute or (sep == ":" and ":" in attribute):
        raise ValueError(f"{key}={spec!r} is not a dotted path to a function; write 'package.module:function' "
                         "(or 'package.module.function').")
    try:
        module = _import_from_cwd(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import is the user's module: name it in one line
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{key}={spec!r}: cannot import {module_name!r} ({type(err).__name__}: {reason}); make it "
                         f"importable (installed, or a .py file in the working directory {os.getcwd()}).") from None
    function = module
    for part in attribute.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise ValueError(f"{key}={spec!r}: module {module_name!r} has no {attribute!r}.")
    if not callable(function):
        raise ValueError(f"{key}={spec!r} is a {type(function).__name__}, not a function "
                         "fn(prompts, completions, **kwargs) -> list[float].")
    return function


def _import_from_cwd(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # The console script does not put the working directory on sys.path (python -m does): try it there.
        top = module_name.split(".")[0]
        if err.name != top or os.getcwd() in sys.path:
            raise
        sys.path.insert(0, os.getcwd())
        return importlib.import_module(module_name)


def call_reward_fn(fn: Callable[..., Sequence[float]], prompts: Sequence[str], completions: Sequence[str],
                   num_samples: int, answers: Sequence[Any] | None = None,
                   columns: Mapping[str, Sequence[Any]] | None = None, key: str = "module.reward_fn") -> list[float]:
    """Rewards of ``completions`` (``num_samples`` per prompt, prompt-major) from a TRL-style reward function.

    Called as TRL calls it: ``fn(prompts=..., completions=..., answer=..., **columns)``, every per-prompt list
    repeated once per sample so that item ``i`` of each describes completion ``i``. A ``None`` reward counts as 0.

    Raises:
        ValueError: the function returned the wrong number of rewards, or a value that is not a number.
    """
    def repeated(values: Sequence[Any]) -> list[Any]:
        return [value for value in values for _ in range(num_samples)]

    kwargs = {name: repeated(values) for name, values in (columns or {}).items()}
    if answers is not None:
        kwargs["answer"] = repeated(answers)
    rewards = fn(prompts=repeated(prompts), completions=list(completions), **kwargs)
    rewards = rewards.tolist() if hasattr(rewards, "tolist") else list(rewards)
    if len(rewards) != len(completions):
        raise ValueError(f"{key} returned {len(rewards)} rewards for {len(completions)} completions; return one "
                         "float per completion.")
    try:
        return [0.0 if value is None else float(value) for value in rewards]
    except (TypeError, ValueError):
        raise ValueError(f"{key} returned {rewards[:3]!r}...: rewards must be numbers (or None).") from None
