"""One rank of an FSDP2 plan traced with its own allocator: ``memory.plan.search_plans``' ``confirm_rank`` for
``lit-memopt plan``.

The search prices FSDP2 candidates with arithmetic on one-device traces (``memory.sharding``), which carries the
one-device step's allocator overhead over to a rank. That is off both ways: a rank far from the device's size keeps
a cache the one-device trace, near the size, released (Qwen3-4B SFT over 8 ranks of 40 GiB: 13.01 GiB reserved as a
traced rank, 11.22 by the arithmetic), and GRADE's rank reads less (23.23 against 24.50). So the fastest fitting
FSDP2 plan is checked as ``lit-memopt estimate <the plan's overrides> trace_rank=true`` would check it (the same
composed config, the same function), and the plan prints that rank's figure.

Within a time budget: a rank whose block probes stitch takes seconds (the 4B SFT rank above: 7.6 s; GRPO 1.7B's:
about 20 s); one that must be traced whole (GRADE's soft-token generation runs inside one call of its FSDP2 root,
which the stitch cannot split: GRADE 4B, 43 s) is left to the command the plan prints, with a note saying why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from lit_memopt.memory.plan import Candidate
from lit_memopt.memory.step import PeakEstimate

__all__ = ["PLAN_KEYS", "PLAN_RANK_SECONDS", "RANK_CHECK", "RankConfirmer", "rank_confirmer", "rank_estimate_args",
           "with_overrides"]

# What one plan spends at most on tracing ranks (all its confirmations together): the plan stays a matter of
# seconds (its must-show: 30 s for Qwen3-4B GRADE over 8 ranks on a 2-core CPU).
PLAN_RANK_SECONDS = 20.0
# The command-line keys of the plan itself, left out of the estimate that checks one of its plans.
PLAN_KEYS = ("plan.", "+plan.")
# What makes that estimate check one rank of the plan: traced under a fake process group, the step as planned only
# (with gpu_memory= it would also search the largest micro-batch, one whole rank traced per size: GRADE 4B over 8
# ranks took 416 s so).
RANK_CHECK = ("trace_rank=true", "search_micro_batch=false")


def rank_estimate_args(argv: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """The ``lit-memopt estimate`` arguments that trace one rank of the plan ``overrides`` make of the recipe the
    plan's ``argv`` names."""
    return with_overrides([a for a in argv if not a.startswith(PLAN_KEYS)], [*overrides, *RANK_CHECK])


def with_overrides(argv: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """The user's arguments less those ``overrides`` set again, then ``overrides`` (``key=value`` strings; a
    leading ``+`` is ignored when matching keys)."""
    replaced = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    return [*(a for a in argv if a.split("=", 1)[0].lstrip("+") not in replaced), *overrides]


class RankConfirmer:
    """``candidate -> PeakEstimate | None``: one rank of the candidate traced, as ``estimate ... trace_rank=true``.

    Args:
        argv: the plan's command-line overrides (``recipe=... gpu_memory=... trainer=fsdp2 ...``).
        overrides: ``candidate -> [key=value, ...]``: what turns the recipe into that candidate.
        seconds: the time budget of all this confirmer's traces (default :data:`PLAN_RANK_SECONDS`).

    After a ``None`` (budget spent, a rank that is not traced, an error) the reason is in :attr:`notes`.
    """

    def __init__(self, argv: Sequence[str], overrides: Callable[[Candidate], list[str]],
                 seconds: float | None = None) -> None:
        self.argv = list(argv)
        self.overrides = overrides
        self.budget = PLAN_RANK_SECONDS if seconds is None else seconds
        self.left = self.budget
        self.notes: list[str] = []

    def command(self, c: Candidate) -> list[str]:
        """The ``estimate`` arguments that trace one rank of ``c``."""
        return rank_estimate_args(self.argv, self.overrides(c))

    def __call__(self, c: Candidate) -> PeakEstimate | None:
        from lit_memopt.cli import compose_config
        from lit_memopt.cli_estimate import estimate_recipe

        if self.left <= 0:
            self.notes.append("no FSDP2 plan was traced as a rank (plan.rank_seconds=0): per-rank figures are arithmetic "
                              "on one-device traces" if self.budget <= 0 else
                              "the plan's time for tracing ranks (plan.rank_seconds) was spent; the next plan's per-rank "
                              "figure is arithmetic on a one-device trace")
            return None
        started = time.perf_counter()
        try:
            report = estimate_recipe(compose_config(self.command(c)), rank_whole_seconds=self.left)
        except Exception as exc:  # noqa: BLE001 - the plan keeps its arithmetic and says why
            first = str(exc).splitlines()[0] if str(exc) else "no message"
            self.notes.append(f"one rank of the plan could not be traced ({type(exc).__name__}: {first}); its "
                              "per-rank figure is arithmetic on a one-device trace")
            return None
        finally:
            self.left -= time.perf_counter() - started
        if report.rank_fallback is not None:
            # estimate fell back to the arithmetic (probes that do not stitch and a whole rank too slow, say)
            self.notes.append(f"an FSDP2 plan's rank was not traced here (a plan spends at most {self.budget:.0f} s on "
                              f"ranks): {report.rank_fallback}")
            return None
        return report.estimate


def rank_confirmer(argv: Sequence[str] | None, overrides: Callable[[Candidate], list[str]], *, world_size: int,
                   gpu_target: bool, seconds: float | None = None) -> RankConfirmer | None:
    """A :class:`RankConfirmer` where a plan has FSDP2 ranks to confirm: several ranks on a GPU, and the plan's
    command line to compose them from (``plan_recipe`` called without ``argv`` keeps the arithmetic). ``seconds``:
    its budget (``plan.rank_seconds``; ``None``: :data:`PLAN_RANK_SECONDS`)."""
    if argv is None or world_size <= 1 or not gpu_target:
        return None
    return RankConfirmer(argv, overrides, seconds)

