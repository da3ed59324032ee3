"""CRSP rewards: solver (correctness + reasoning length), critique (agreement + creativity), proposer
(learnability), the alpha schedule over training progress, and a running per-role reward normaliser.

Each reward is a small pure function of already-executed verdicts; nothing here runs generated code.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch

__all__ = [
    "AlphaSchedule",
    "RunningNormalizer",
    "creativity_score",
    "critique_reward",
    "length_reward",
    "proposer_reward",
    "solver_reward",
    "think_text",
]

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_WORD = re.compile(r"\w+|[^\w\s]")


def think_text(text: str) -> str:
    """The reasoning span: everything inside ``<think>...</think>`` (all spans joined), else ``text`` itself."""
    spans = _THINK.findall(text)
    return "\n".join(spans) if spans else text


def length_reward(
    num_tokens: int | float,
    max_tokens: int,
    *,
    penalty_threshold: int | None = None,
    penalty_scale: float | None = None,
) -> float:
    """``min(1, ln n / ln L)``, times ``exp(-(n - threshold) / scale)`` once ``n`` passes the threshold.

    The log makes the first reasoning tokens worth the most and saturates at ``n = L``; the
    exponential factor then pulls very long reasoning back down. ``n <= 1`` gives 0.

    Args:
        num_tokens: ``n``, tokens inside ``<think>...</think>`` (see :func:`think_text`).
        max_tokens: ``L > 1``, the length at which the log term reaches 1.
        penalty_threshold: length after which the penalty starts (default: ``L``).
        penalty_scale: tokens over the threshold that divide the reward by ``e`` (default: ``L / 2``).

    Raises:
        ValueError: ``max_tokens <= 1``, a negative ``num_tokens``, or a non-positive threshold/scale.

    Example::

        length_reward(32, 1024)   # ln 32 / ln 1024 = 0.5
    """
    if int(max_tokens) <= 1:
        raise ValueError(f"length_reward(max_tokens={max_tokens!r}) must be > 1 (it is the base of a log ratio).")
    if num_tokens < 0:
        raise ValueError(f"length_reward(num_tokens={num_tokens!r}) must be >= 0.")
    threshold = int(max_tokens) if penalty_threshold is None else int(penalty_threshold)
    scale = float(max_tokens) / 2.0 if penalty_scale is None else float(penalty_scale)
    if threshold <= 0 or scale <= 0:
        raise ValueError(f"penalty_threshold={penalty_threshold!r} and penalty_scale={penalty_scale!r} must be > 0.")
    if num_tokens <= 1:
        return 0.0
    base = min(1.0, math.log(num_tokens) / math.log(max_tokens))
    if num_tokens > threshold:
        base *= math.exp(-(num_tokens - threshold) / scale)
    return base


def solver_reward(correct: float, length: float, alpha_s: float) -> float:
    """``alpha_s * correct + (1 - alpha_s) * length``; ``correct`` in {0, 1}, ``length`` from :func:`length_reward`."""
    _check_unit("alpha_s", alpha_s)
    return float(alpha_s) * float(correct) + (1.0 - float(alpha_s)) * float(length)


def critique_reward(agrees: float, creativity: float, alpha_c: float) -> float:
    """``alpha_c * agreement + (1 - alpha_c) * creativity``; agreement with the executed verdict is 0 or 1."""
    _check_unit("alpha_c", alpha_c)
    return float(alpha_c) * float(agrees) + (1.0 - float(alpha_c)) * float(creativity)


def proposer_reward(num_correct: int, num_samples: int) -> float:
    """Learnability of a proposed task: ``1 - solve_rate`` when ``0 < solve_rate < 1``, else 0.

    Tasks every solver sample gets right (too easy) or none does (too hard, or broken) earn nothing;
    among the rest, harder ones earn more.

    Raises:
        ValueError: ``num_samples < 1`` or ``num_correct`` outside ``[0, num_samples]``.
    """
    if int(num_samples) < 1 or not 0 <= int(num_correct) <= int(num_samples):
        raise ValueError(f"proposer_reward needs 0 <= num_correct <= num_samples and num_samples >= 1, "
                         f"got num_correct={num_correct!r}, num_samples={num_samples!r}.")
    rate = int(num_correct) / int(num_samples)
    return 1.0 - rate if 0.0 < rate < 1.0 else 0.0


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _bigrams(words: Sequence[str]) -> list[tuple[str, str]]:
    return list(zip(words, words[1:]))


def creativity_score(text: str, siblings: Sequence[str] = (), *, min_words: int = 8) -> float:
    """A deterministic, purely lexical creativity score in ``[0, 1]``.

    What it measures (and nothing more): the mean of

    * **variety**: distinct word bigrams / all word bigrams of ``text`` (1 = no phrase repeated),
      scaled by ``min(1, words / min_words)`` so a two-word reply cannot score full marks; and
    * **novelty**: ``1 - max`` Jaccard overlap between the bigram set of ``text`` and that of each
      sibling (other critiques of the same answer); 1 when there are no siblings.

    It rewards critiques that do not loop and do not copy their siblings' template. It says nothing
    about whether the critique is right (the agreement term does that) or insightful. Words are
    runs of ``\\w`` and single punctuation marks, lower-cased.

    Example::

        creativity_score("the the the the")            # low: one repeated bigram, short
        creativity_score("f reverses s; the slice is fine", ["looks right to me"])
    """
    if int(min_words) < 1:
        raise ValueError(f"creativity_score(min_words={min_words!r}) must be >= 1.")
    words = _words(text)
    grams = _bigrams(words)
    if not grams:
        return 0.0
    variety = (len(set(grams)) / len(grams)) * min(1.0, len(words) / int(min_words))
    mine = set(grams)
    overlaps = []
    for other in siblings:
        theirs = set(_bigrams(_words(other)))
        union = mine | theirs
        overlaps.append(len(mine & theirs) / len(union) if union else 0.0)
    novelty = 1.0 - max(overlaps) if overlaps else 1.0
    return 0.5 * (variety + novelty)


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name}={value!r} must be in [0, 1].")


class AlphaSchedule:
    """Piecewise-linear weights ``(alpha_s, alpha_c)`` of correctness/agreement over training progress.

    Default breakpoints (progress -> alpha_s, alpha_c): flat ``0.3 / 0.1`` until 20%, linear to
    ``0.8 / 0.6`` at 60%, then linear to ``0.95 / 0.8`` at 100%: shaping terms (length, creativity)
    dominate early, execution-checked terms late. Values are cached per global step.

    Args:
        breakpoints: ``[(progress, alpha_s, alpha_c), ...]`` with strictly increasing progress in
            ``[0, 1]``; before the first and after the last point the value is held constant.

    Raises:
        ValueError: unsorted progress values, or an alpha outside ``[0, 1]``.

    Example::

        schedule = AlphaSchedule()
        schedule.at_step(50, total_steps=100)   # (0.675, 0.475)
    """

    DEFAULT = ((0.0, 0.3, 0.1), (0.2, 0.3, 0.1), (0.6, 0.8, 0.6), (1.0, 0.95, 0.8))

    def __init__(self, breakpoints: Sequence[Sequence[float]] | None = None) -> None:
        points = [tuple(float(v) for v in p) for p in (breakpoints or self.DEFAULT)]
        if not points or any(len(p) != 3 for p in points):
            raise ValueError(f"AlphaSchedule(breakpoints={breakpoints!r}) needs (progress, alpha_s, alpha_c) triples.")
        for (p0, *_), (p1, *_) in zip(points, points[1:]):
            if not p1 > p0:
                raise ValueError(f"AlphaSchedule breakpoints must have strictly increasing progress, got {points}.")
        for p, a_s, a_c in points:
            _check_unit("breakpoint progress", p)
            _check_unit("alpha_s", a_s)
            _check_unit("alpha_c", a_c)
        self.breakpoints = points
        self._cache: tuple[int, int, tuple[float, float]] | None = None

    def __call__(self, progress: float) -> tuple[float, float]:
        """``(alpha_s, alpha_c)`` at ``progress`` (clipped to ``[0, 1]``)."""
        p = min(max(float(progress), 0.0), 1.0)
        pts = self.breakpoints
        if p <= pts[0][0]:
            return pts[0][1], pts[0][2]
        for (p0, s0, c0), (p1, s1, c1) in zip(pts, pts[1:]):
            if p <= p1:
                t = (p - p0) / (p1 - p0)
                return s0 + t * (s1 - s0), c0 + t * (c1 - c0)
        return pts[-1][1], pts[-1][2]

    def at_step(self, step: int, total_steps: int) -> tuple[float, float]:
        """The value at ``step / total_steps``, computed once per step (all roles of a step share it)."""
        if int(total_steps) < 1:
            raise ValueError(f"AlphaSchedule.at_step(total_steps={total_steps!r}) must be >= 1.")
        if self._cache is None or self._cache[:2] != (int(step), int(total_steps)):
            self._cache = (int(step), int(total_steps), self(int(step) / int(total_steps)))
        return self._cache[2]


class RunningNormalizer(torch.nn.Module):
    """Running mean/std of a reward stream; ``normalize`` standardises a batch with the updated stats.

    Statistics are merged batch by batch (Chan et al.'s parallel variance), kept in float64 buffers
    so they are saved in the module's ``state_dict`` and survive a restart.

    Args:
        eps: added to the std before dividing.
        min_count: until this many rewards have been seen, only the mean is removed (the std of a
            handful of samples is too noisy to divide by).

    Example::

        norm = RunningNormalizer()
        advantages = norm.normalize(torch.tensor([0.0, 1.0, 1.0]))
    """

    def __init__(self, eps: float = 1e-6, min_count: int = 2) -> None:
        super().__init__()
        if not eps > 0:
            raise ValueError(f"RunningNormalizer(eps={eps!r}) must be > 0.")
        self.eps = float(eps)
        self.min_count = int(min_count)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("m2", torch.zeros((), dtype=torch.float64))

    @property
    def std(self) -> torch.Tensor:
        return (self.m2 / self.count.clamp(min=1.0)).sqrt()

    @torch.no_grad()
    def update(self, values: torch.Tensor) -> None:
        values = values.detach().to(torch.float64).flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.mean()
        batch_m2 = ((values - batch_mean) ** 2).sum()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean.add_(delta * n / total)
        self.m2.add_(batch_m2 + delta**2 * self.count * n / total)
        self.count.copy_(total)

    @torch.no_grad()
    def normalize(self, values: torch.Tensor, update: bool = True) -> torch.Tensor:
        """``(values - mean) / (std + eps)`` after folding ``values`` into the running stats."""
        if update:
            self.update(values)
        centred = values.to(torch.float64) - self.mean
        if self.count < self.min_count:
            return centred.to(values.dtype)
        return (centred / (self.std + self.eps)).to(values.dtype)
