"""What ``lit-memopt plan`` searches over and answers with: a candidate configuration, the recipe's shape, a
candidate's prediction and the search's result, and the levers that tell a candidate from the recipe
(``memory.plan`` searches them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lit_memopt.memory.plan_time import DeviceSpec
from lit_memopt.memory.step import PeakEstimate

__all__ = ["Candidate", "PlanResult", "Prediction", "RecipeShape", "changed_levers", "divisors", "like_peaks",
           "recompute_share", "revert_lever"]


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration: ``micro_batch`` rows per forward, ``accumulation`` micro-batches per optimizer step."""

    micro_batch: int
    accumulation: int
    checkpointing: bool | int  # False: none; True: every decoder block; k >= 2: every k-th block
    strategy: str  # single | ddp | fsdp2
    offload: bool = False  # FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state in host memory
    maths: tuple[str, ...] = ()  # the plan.allow levers this candidate's recipe variant applies (lora, shorter_seq)
    activation_offload: bool = False  # the decoder blocks' saved activations in host memory (memory.offload)


@dataclass(frozen=True)
class RecipeShape:
    """What the search needs to know of the recipe as given.

    Attributes:
        rows: rows of one loader batch per rank (``data.batch_size``).
        accumulation: the recipe's ``trainer.accumulate_grad_batches``.
        checkpointing: the recipe's checkpointing setting (``None``: the module has no such switch; ``k >= 2``:
            every k-th block).
        checkpoint_periods: the partial checkpointing settings the module's switch takes (every k-th block), searched
            beside none and all of them.
        strategy / world_size / nodes: as given on the command line (``single`` on one device).
        blocks: decoder blocks of the model.
        tokens_per_row: positions one row runs through the model (prompt and generated tokens).
        dtype_bytes: bytes per parameter element (2 for bf16).
    """

    rows: int
    accumulation: int
    checkpointing: bool | int | None
    strategy: str
    world_size: int
    nodes: int
    blocks: int
    tokens_per_row: float
    dtype_bytes: int
    offload: bool = False
    maths: tuple[str, ...] = ()
    replicated_bytes: int = 0  # frozen models' parameters kept whole on every rank under FSDP2 (per_rank_estimate)
    checkpoint_periods: tuple[int, ...] = ()
    # The setting the micro-batch lever changes: None for the loader's batch with Lightning's gradient accumulation
    # (``rows`` x ``accumulation``); a module key (CRSP's ``module.generation.micro_batch_size``) for a module that
    # optimizes manually and runs its own micro-batches in one step: ``rows`` sequences per forward/backward,
    # ``accumulation`` passes. "" : the step cannot be split (manual optimization without such a setting).
    micro_batch_key: str | None = None
    # With a module's own micro-batches: the sequences of the step's largest pass, which ``accumulation`` passes of
    # ``rows`` cover (0 otherwise).
    step_sequences: int = 0
    # Activation offload: None where it is not searched (the recipe configures its own ActivationCheckpointing, the
    # module has no decoder blocks to offload, or the device is the host), else whether the recipe offloads (never).
    activation_offload: bool | None = None

    @property
    def global_rows(self) -> int:
        return self.rows * self.accumulation

    @property
    def recipe(self) -> Candidate:
        ck = self.checkpointing if recompute_share(self.checkpointing) not in (0.0, 1.0) else bool(self.checkpointing)
        return Candidate(self.rows, self.accumulation, ck, self.strategy, self.offload, self.maths,
                         bool(self.activation_offload))


@dataclass
class Prediction:
    """A candidate's predicted per-rank peak (reserved, or live bytes on ``plan.device=cpu``) and step time."""

    candidate: Candidate
    peak_bytes: int
    seconds: float
    traced: bool
    estimate: PeakEstimate
    relative_time: float = 1.0
    # the peak is one rank's own trace under a fake process group (search_plans' confirm_rank), not arithmetic on a
    # one-device trace
    rank_traced: bool = False
    # with ``rank_traced``: the arithmetic figure the rank's trace replaced, kept so that a lever's saving compares like
    # with like (the plan without the lever is priced by the arithmetic: its rank is not traced)
    arithmetic_peak_bytes: int | None = None
    # lever name -> (bytes saved against the recipe's value of that lever, relative time cost); None where the plan
    # without that lever was not predicted
    levers: dict[str, tuple[int, float] | None] = field(default_factory=dict)
    # the levers whose saving compares the arithmetic figures (this plan's rank is traced, the plan without the lever's
    # is not: :func:`like_peaks`)
    arithmetic_levers: tuple[str, ...] = ()

    @property
    def arithmetic_bytes(self) -> int:
        """The peak as the one-device trace's arithmetic puts it (the rank's own trace set aside)."""
        return self.peak_bytes if self.arithmetic_peak_bytes is None else self.arithmetic_peak_bytes


def like_peaks(p: Prediction, ref: Prediction) -> tuple[int, int]:
    """The peaks of ``p`` and ``ref`` from the same source: both ranks' own traces where both have one, else both
    the arithmetic's (a traced rank against an arithmetic twin differs by the allocator model, not the lever)."""
    if p.rank_traced == ref.rank_traced:
        return p.peak_bytes, ref.peak_bytes
    return p.arithmetic_bytes, ref.arithmetic_bytes


@dataclass
class PlanResult:
    """What ``lit-memopt plan`` found. ``plans``: the fitting, non-dominated plans, fastest first."""

    shape: RecipeShape
    memory_bytes: int
    usable_bytes: int
    margin: float
    device: DeviceSpec
    plans: list[Prediction]
    closest: Prediction  # the smallest peak of all candidates (every lever)
    fastest_not_fitting: Prediction | None
    recipe: Prediction
    traces: int
    floor_bytes: int = 0  # live bytes of the optimizer step that no exact lever changes (a lower bound on every plan)
    predictions: list[Prediction] = field(default_factory=list)  # every candidate predicted, fastest first
    # (recorded, replayed, stretched): rollouts traced once and replayed in the other traces (memory.replay), and
    # long ones made from short runs (memory.stretch), set by the caller
    shared_regions: tuple[int, int, int] = (0, 0, 0)
    # When the recipe fits as given, its one trace is the answer (a budget that does not bind changes nothing), even
    # where it pulls levers that cost time (checkpointing, accumulation): then the fastest candidate the time model puts
    # before it, untraced, and its time relative to the recipe's, for a plan from there (``None``: there is none).
    untried: tuple[Candidate, float] | None = None
    rank_traces: int = 0  # FSDP2 plans traced as one rank (search_plans' confirm_rank)
    notes: list[str] = field(default_factory=list)  # set by the caller: why a plan's rank was not traced, say

    @property
    def fits(self) -> bool:
        return bool(self.plans)

    @property
    def best(self) -> Prediction | None:
        return self.plans[0] if self.plans else None


def recompute_share(checkpointing: bool | int | None) -> float:
    """Share of the decoder blocks run again in backward: 0 (none), 1 (every block) or 1/k (every k-th)."""
    if not checkpointing:
        return 0.0
    return 1.0 if checkpointing is True else 1.0 / int(checkpointing)


def divisors(n: int) -> list[int]:
    """The micro-batch sizes that split ``n`` rows evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def changed_levers(c: Candidate, recipe: Candidate) -> list[str]:
    """The levers of ``c`` that differ from the recipe's, in a fixed order."""
    out = []
    if (c.micro_batch, c.accumulation) != (recipe.micro_batch, recipe.accumulation):
        out.append("micro-batch")
    if c.checkpointing != recipe.checkpointing:
        out.append("checkpointing")
    if c.strategy != recipe.strategy and not (recipe.strategy == "single" and c.offload):
        out.append("strategy")  # (on one device, FSDP2 is only there for its offload: one lever, "cpu offload")
    if c.offload != recipe.offload:
        out.append("cpu offload")
    if c.activation_offload != recipe.activation_offload:
        out.append("activation offload")
    out += [m for m in c.maths if m not in recipe.maths]
    return out


def revert_lever(c: Candidate, lever: str, recipe: Candidate) -> Candidate:
    """``c`` with ``lever`` (a :func:`changed_levers` name) set back to the recipe's value."""
    if lever == "micro-batch":
        return dataclasses.replace(c, micro_batch=recipe.micro_batch, accumulation=recipe.accumulation)
    if lever == "checkpointing":
        return dataclasses.replace(c, checkpointing=recipe.checkpointing)
    if lever == "cpu offload":
        # on one device the offloading FSDP2 "strategy" is the lever itself: reverting it is the recipe's strategy
        return dataclasses.replace(c, offload=recipe.offload, strategy=recipe.strategy if recipe.strategy == "single" else c.strategy)
    if lever == "strategy":
        return dataclasses.replace(c, strategy=recipe.strategy)
    if lever == "activation offload":
        return dataclasses.replace(c, activation_offload=recipe.activation_offload)
    return dataclasses.replace(c, maths=tuple(m for m in c.maths if m != lever))
