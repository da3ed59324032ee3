"""``lit-memopt plan``'s search: the fastest configuration of a recipe whose predicted peak fits a memory size.

The levers searched keep the maths of a step exact:

- the micro-batch ``m`` with gradient accumulation ``G / m``, where ``G`` (the recipe's rows per rank and
  optimizer step) stays the same, so the global batch does;
- activation checkpointing: none, of every decoder block, or of every k-th (``RecipeShape.checkpoint_periods``: half
  the recomputation and about half the saving for k=2), through the module's own switch, whatever the recipe's own
  setting (a checkpointed recipe that does not fit may fit faster without, at a smaller micro-batch);
- the data-parallel strategy: FSDP2 instead of DDP over the same devices, or the reverse;
- FSDP2 with its parameters, gradients and optimizer state offloaded to host memory (``CPUOffloadPolicy``),
  on one device as well as several (not for ``plan.device=cpu``, whose device is the host);
- activation offload: what the decoder blocks save for backward kept in host memory (``memory.offload``; on top
  of any checkpointing setting, where only the blocks' inputs are saved), where the recipe can take it
  (``RecipeShape.activation_offload``). It only adds time, so it is searched after the rest, for the candidates
  that do not fit without it and could still beat the fastest plan that fits: one checkpointing setting at a
  time, the most promising first, each traced like the others (``memory.plan_time`` prices its copies).

The levers that change the maths (``plan.allow``) are searched by ``cli_plan`` as variants of the recipe,
each searched here like the recipe itself and stamped with its ``maths`` name.

Memory comes from the estimator through a ``trace(checkpointing, rows, accumulating)`` function (one
single-device :class:`PeakEstimate` at the real block count, itself extrapolated from 1 and 2 blocks);
traces are shared: per checkpointing setting the step is traced at the recipe's batch (no accumulation)
and at the smallest and largest accumulating micro-batch, and every micro-batch between them is the line
through those two (a step's live bytes are affine in its rows). DDP and FSDP2 are arithmetic on a trace
(``memory.sharding``). The best candidates found by interpolation are traced again before they are
reported, and every number says which it is. Given a ``confirm_rank`` function, the fastest fitting FSDP2 plan
(state on the device, several ranks) is then traced as one rank with its own allocator (``memory.fake_ranks``),
whose figure replaces the arithmetic's; where it no longer fits, the next plan is confirmed. Time comes from
``memory.plan_time``.

Dominance pruning: a fitting plan that is not faster than a plan with a smaller peak is dropped from
the table. Ties are broken by fewer changed levers, then by the candidate's fields, so the output is
deterministic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from lit_memopt.memory.blocks import extrapolate
from lit_memopt.memory.plan_candidates import (
    Candidate,
    PlanResult,
    Prediction,
    RecipeShape,
    changed_levers,
    divisors,
    like_peaks,
    recompute_share,
    revert_lever,
)
from lit_memopt.memory.plan_time import DeviceSpec, StepWork, step_seconds
from lit_memopt.memory.search import usable_bytes
from lit_memopt.memory.sharding import per_rank_estimate
from lit_memopt.memory.step import PeakEstimate, within_device

__all__ = ["RETRACE", "Candidate", "PlanResult", "Prediction", "RecipeShape", "changed_levers", "divisors", "merge_variants",
           "recompute_share", "search_plans", "state_floor"]

# How many of the best interpolated candidates are traced again per round before the answer is trusted.
RETRACE = 3
# A slower plan is listed only if it needs at least this share less memory than every faster one: plans whose peaks
# an optimizer step sets (the same for every micro-batch) would otherwise tie by a few bytes.
PARETO_STEP = 0.01
# How many FSDP2 plans a plan traces as a rank at most (each is seconds to a minute): the best, and where its traced
# rank does not fit, the next ones.
RANK_CONFIRMS = 3
# A candidate predicted (not traced) to pass the budget by no more than this share, and faster than the best fitting
# plan, is traced too: the allocator's reserved peak moves in segments, so a line between two traced micro-batches
# can put one just over the budget that fits (tiny SFT at 40 MiB: 4 x 4 read 36.3 MiB on the line, 28.4 traced).
NEAR_MISS = 0.15


# What a trace is keyed by beside its rows: the checkpointing setting and whether activations are offloaded.
Setting = tuple[bool | int, bool]


class _Traces:
    """Single-device estimates by ``((checkpointing, activation offload), rows, accumulating)``, traced once each."""

    def __init__(self, trace: Callable[..., PeakEstimate]) -> None:
        self._trace = trace
        self.done: dict[tuple[Setting, int, bool], PeakEstimate] = {}

    def get(self, setting: Setting, rows: int, acc: bool) -> PeakEstimate:
        key = (setting, rows, acc)
        if key not in self.done:
            ckpt, offloaded = setting
            # the offload keyword only where it is on: a trace function of the exact levers alone needs no new argument
            self.done[key] = (self._trace(ckpt, rows, acc, activation_offload=True) if offloaded
                              else self._trace(ckpt, rows, acc))
        return self.done[key]

    def probes(self, setting: Setting, acc: bool) -> list[int]:
        return sorted(r for (s, r, a) in self.done if s == setting and a == acc)


def _setting(c: Candidate) -> Setting:
    return (c.checkpointing, c.activation_offload)


def search_plans(
    trace: Callable[[bool, int, bool], PeakEstimate],
    shape: RecipeShape,
    memory_bytes: int,
    *,
    device: DeviceSpec,
    margin: float,
    use_reserved: bool = True,
    offload: bool = True,
    confirm_rank: Callable[[Candidate], PeakEstimate | None] | None = None,
) -> PlanResult:
    """Search the exact levers of ``shape`` for the fastest plan whose peak fits ``memory_bytes * (1 - margin)``.

    Args:
        trace: ``(checkpointing, rows, accumulating) -> PeakEstimate`` of one device at the real block count.
        shape: the recipe as given.
        memory_bytes: memory per device.
        device: the step-time model's rates.
        margin: share of ``memory_bytes`` kept free.
        use_reserved: compare the CUDA allocator's reserved peak (GPUs); ``False``: live tensor bytes (the
            ``memory_budget`` simulator of a CPU run).
        offload: also search FSDP2 with CPU offload (``False`` for a CPU target, whose device is the host).
        confirm_rank: ``candidate -> PeakEstimate`` of one FSDP2 rank of that candidate traced with its own
            allocator, or ``None`` where it will not trace one (then nothing more is asked of it). Asked for the
            fastest fitting FSDP2 plan with its state on the device (several ranks) until one fits as traced, at most
            :data:`RANK_CONFIRMS` times.
    """
    usable = usable_bytes(memory_bytes, margin)
    search = _PlanSearch(trace, shape, usable, device=device, use_reserved=use_reserved, offload=offload)
    search.run()
    if confirm_rank is not None:
        search.confirm_ranks(confirm_rank)
    result = _rank(shape, memory_bytes, usable, margin, device, search.preds, search.recipe, search.preds[search.recipe],
                   len(search.traces.done), search.floor, search.untraced_reference)
    if search.untried is not None:
        result.untried = (search.untried, search.seconds(search.untried) / result.recipe.seconds)
    result.rank_traces = search.rank_traces
    return result


class _PlanSearch:
    """The state of one :func:`search_plans`: the grid of candidates, their traces and their predictions."""

    def __init__(self, trace: Callable[..., PeakEstimate], shape: RecipeShape, usable: int, *, device: DeviceSpec,
                 use_reserved: bool, offload: bool) -> None:
        self.shape = shape
        self.usable = usable
        self.device = device
        self.use_reserved = use_reserved
        self.traces = _Traces(trace)
        self.recipe = recipe = shape.recipe
        self.g = g = shape.global_rows
        # What the micro-batches cover: the step's rows, or a module's own passes over its step's sequences (CRSP).
        # The sizes are its divisors and the recipe's own value, which need not divide it (its last pass is then
        # short; rows x accumulation always divide); the passes cover it, never more sequences per pass than the
        # step has.
        self.covered = shape.step_sequences if shape.micro_batch_key and shape.step_sequences else g
        self.sizes = [g] if shape.micro_batch_key == "" else sorted(set(divisors(self.covered)) | {recipe.micro_batch})
        self.all_sizes = self.sizes
        # checkpointing off too: a recipe that checkpoints and does not fit may fit faster with smaller micro-batches
        self.checkpointing = ([recipe.checkpointing] if shape.checkpointing is None
                              else sorted({False, True, *shape.checkpoint_periods}, key=recompute_share))
        if shape.world_size <= 1:
            strategies = [(shape.strategy, shape.offload)]
        else:
            strategies = [(s, shape.offload if s == shape.strategy else False)
                          for s in sorted({shape.strategy, "ddp", "fsdp2"} - {"single"})]
        if offload and ("fsdp2", True) not in strategies:
            strategies.append(("fsdp2", True))  # FSDP2 over the same devices (one included), state in host memory
        self.strategies = sorted(set(strategies))
        # The recipe's own parameter counts (for the time model), from its trace.
        base = (self.traces.get(_setting(recipe), g, False) if recipe.accumulation == 1
                else self.traces.get(_setting(recipe), recipe.micro_batch, True))
        self.work = _work_from(base, shape)
        self.preds: dict[Candidate, Prediction] = {}
        self.floor = 0
        self.untried: Candidate | None = None
        self.rank_traces = 0

    def passes(self, m: int) -> int:
        return -(-self.covered // m)

    def grid(self, activation_offload: bool, checkpointing: Iterable[bool | int] | None = None) -> list[Candidate]:
        """Every candidate of the current sizes, checkpointing settings (``checkpointing``: these instead) and
        strategies."""
        settings = self.checkpointing if checkpointing is None else checkpointing
        return sorted(Candidate(m, self.passes(m), ck, st, off, self.shape.maths, activation_offload)
                      for m in self.sizes for ck in settings for st, off in self.strategies)

    def predict(self, c: Candidate, *, exact: bool = False) -> Prediction:
        acc = c.accumulation > 1
        key = (_setting(c), c.micro_batch, acc)
        if exact or key in self.traces.done:
            est, traced = self.traces.get(*key), True
        else:
            est, traced = _interpolate(self.traces, _setting(c), c.micro_batch, acc), False
        if c.strategy == "single":
            est = within_device(est)  # (per rank, the sharding judges it)
        else:
            est = per_rank_estimate(est, c.strategy, max(self.shape.world_size, 1), cpu_offload=c.offload,
                                    replicated_bytes=min(self.shape.replicated_bytes, est.phase_breakdowns.get(
                                        "optimizer step", {}).get("parameters", self.shape.replicated_bytes)))
        peak = int(est.reserved_peak_bytes or est.peak_bytes) if self.use_reserved else int(est.peak_bytes)
        return Prediction(c, peak, self.seconds(c, est.offloaded_bytes), traced, est)

    def seconds(self, c: Candidate, offloaded: int = 0) -> float:
        """The time model needs no trace of the candidate, only the recipe's, and for activation offload the bytes
        its trace copied (``offloaded``: 0 gives a lower bound, the time without the copies)."""
        # a trace is one micro-batch, or with a module's own micro-batches the whole step (all its passes)
        per_micro_batch = offloaded / c.accumulation if self.shape.micro_batch_key else offloaded
        return step_seconds(dataclasses.replace(
            self.work, tokens=c.micro_batch * self.shape.tokens_per_row, micro_batches=c.accumulation,
            recompute=recompute_share(c.checkpointing), strategy=c.strategy, cpu_offload=c.offload,
            activation_offload_bytes=float(per_micro_batch) if c.activation_offload else 0.0), self.device)

    def order(self, p: Prediction) -> tuple:
        return (round(p.seconds, 12), len(changed_levers(p.candidate, self.recipe)), p.peak_bytes, p.candidate)

    def probe(self, setting: Setting) -> None:
        """Trace a setting's probes: the recipe's batch unaccumulated, and the ends of the accumulating range."""
        self.traces.get(setting, self.g, False)
        accumulating = [m for m in self.sizes if m < self.g]
        if accumulating:
            self.traces.get(setting, accumulating[0], True)
            self.traces.get(setting, accumulating[-1], True)

    def run(self) -> None:
        """Predict the candidates worth predicting into ``preds``, the fastest fitting ones traced."""
        recipe, usable, strategies = self.recipe, self.usable, self.strategies
        candidates = self.grid(recipe.activation_offload)
        # Cheapest answers first. The recipe fits: its own trace is the answer (what the time model puts before it is
        # named, not traced). The step with every lever does not fit: nothing does. Otherwise trace the rest.
        recipe_fits = self.predict(recipe, exact=True).peak_bytes <= usable
        floors = {(s, o): state_floor(self.predict(dataclasses.replace(recipe, strategy=s, offload=o)).estimate)
                  for s, o in strategies}
        self.floor = floor = min(floors.values())
        # The recipe's micro-batch and checkpointing under each strategy whose optimizer step leaves room: predicted
        # from the recipe's own trace. When one fits, only candidates the time model puts before it need tracing.
        at_recipe = [dataclasses.replace(recipe, strategy=s, offload=o) for (s, o), f in floors.items() if f <= usable]
        fitting_at_recipe = [c for c in at_recipe if self.predict(c).peak_bytes <= usable]
        bound = min((self.seconds(c) for c in fitting_at_recipe), default=None)
        faster = [] if bound is None else [c for c in candidates
                                           if floors[(c.strategy, c.offload)] <= usable and self.seconds(c) < bound]
        smallest = Candidate(self.sizes[0], self.passes(self.sizes[0]), max(self.checkpointing, key=recompute_share),
                             recipe.strategy, recipe.offload, self.shape.maths, recipe.activation_offload)
        same_step = [c for c in candidates if (c.micro_batch, c.checkpointing) == (recipe.micro_batch, recipe.checkpointing)]
        if not recipe_fits and floor > usable:
            # The optimizer step holds the weights, gradients, states and the update's temporaries whatever the
            # micro-batch or checkpointing: when they alone pass the budget, no exact lever can help (one trace).
            candidates = [dataclasses.replace(recipe, strategy=s, offload=o) for s, o in strategies]
        elif recipe_fits or (fitting_at_recipe and not faster):
            # the recipe fits (a budget that does not bind changes nothing; a faster step is only named), or it fits
            # under a strategy before which no other open candidate is predicted faster: its one trace is the answer
            if recipe_fits:
                self.untried = self.fastest_untried(floors)
            self.sizes = [recipe.micro_batch]
            candidates = same_step
        elif fitting_at_recipe:
            # only the candidates predicted faster than the recipe's step under the best fitting strategy can beat it
            for ck in sorted({c.checkpointing for c in faster}, key=recompute_share):
                self.probe((ck, recipe.activation_offload))
            candidates = sorted(set(faster) | set(same_step))
        elif all(self.predict(dataclasses.replace(smallest, strategy=s, offload=o), exact=True).peak_bytes > usable
                 for s, o in strategies):
            candidates = [dataclasses.replace(smallest, strategy=s, offload=o) for s, o in strategies] + [
                dataclasses.replace(recipe, strategy=s, offload=o) for s, o in strategies]
        else:
            for ck in self.checkpointing:
                self.probe((ck, recipe.activation_offload))
        self.preds = {c: self.predict(c) for c in candidates}
        self.settle()
        if self.shape.activation_offload is False and floor <= usable:
            self.search_activation_offload(
                [c for c in self.grid(True) if floors[(c.strategy, c.offload)] <= usable], smallest)

    def untraced_reference(self, c: Candidate) -> Prediction | None:
        """``c`` predicted from the traces already made (a plan's lever priced against the plan without it), or
        ``None`` where that would take a new trace, or where ``c`` is no candidate of the search (reverting one lever of
        a plan can leave another without its ground: CPU offload under DDP)."""
        if (c.strategy, c.offload) not in self.strategies or c.checkpointing not in self.checkpointing:
            return None
        key = (_setting(c), c.micro_batch, c.accumulation > 1)
        if key in self.traces.done or len(self.traces.probes(key[0], key[2])) >= 2:
            return self.predict(c)
        return None

    def fastest_untried(self, floors: dict[tuple[str, bool], int]) -> Candidate | None:
        """The fastest candidate the time model puts before the recipe, where its optimizer step leaves room; ``None``:
        none is."""
        bound = self.seconds(self.recipe)
        timed = [(self.seconds(c), c) for c in self.grid(self.recipe.activation_offload)
                 if floors[(c.strategy, c.offload)] <= self.usable]
        faster = [(t, c) for t, c in timed if t < bound]
        return min(faster)[1] if faster else None

    def settle(self) -> None:
        """Trace the best interpolated candidates (and the fastest that does not fit, the plan's tightness) until the
        fastest fitting plan rests on a trace of its own."""
        usable, preds = self.usable, self.preds
        for _ in range(len(preds)):
            ranked = sorted(preds.values(), key=self.order)
            fitting = [p for p in ranked if p.peak_bytes <= usable]
            todo = [p.candidate for p in fitting[:RETRACE] if not p.traced]
            missing = next((p for p in ranked if p.peak_bytes > usable), None)
            if missing is not None and not missing.traced:
                todo.append(missing.candidate)
            best = fitting[0] if fitting else None
            todo += [p.candidate for p in ranked if not p.traced and usable < p.peak_bytes <= usable * (1.0 + NEAR_MISS)
                     and (best is None or self.order(p) < self.order(best))]
            if not todo:
                return
            for c in todo:
                for other in list(preds):  # a trace serves every strategy of the same step
                    if preds[other].rank_traced:
                        continue  # its own rank's trace, not arithmetic on the one-device one
                    if (_setting(other), other.micro_batch, other.accumulation) == (_setting(c), c.micro_batch, c.accumulation):
                        preds[other] = self.predict(other, exact=True)

    def rank_confirmable(self, c: Candidate) -> bool:
        return c.strategy == "fsdp2" and not c.offload and self.shape.world_size > 1 and self.use_reserved

    def confirm_ranks(self, confirm: Callable[[Candidate], PeakEstimate | None]) -> None:
        """Replace the arithmetic per-rank peak of the fastest fitting FSDP2 plan by one rank's own trace, until the
        fastest fitting plan is no such plan or is confirmed (a traced rank can read more than the arithmetic, or
        less: Qwen3-4B SFT over 8 ranks 13.01 GiB reserved against 11.22, GRADE 23.23 against 24.50)."""
        preds, usable = self.preds, self.usable
        for _ in range(RANK_CONFIRMS):
            self.settle()
            fitting = sorted((p for p in preds.values() if p.peak_bytes <= usable), key=self.order)
            if not fitting or fitting[0].rank_traced or not self.rank_confirmable(fitting[0].candidate):
                return
            c = fitting[0].candidate
            est = confirm(c)
            if est is None:
                return
            self.rank_traces += 1
            peak = int(est.reserved_peak_bytes or est.peak_bytes)
            preds[c] = Prediction(c, peak, self.seconds(c, est.offloaded_bytes), True, est, rank_traced=True,
                                  arithmetic_peak_bytes=preds[c].peak_bytes)
            if peak > usable:
                if c == self.recipe:
                    self.untried = None  # "the recipe fits as given" no longer holds
                self.widen()
        self.settle()

    def widen(self) -> None:
        """Predict every candidate of the exact levers: the search was narrowed on a plan that a traced rank has now
        ruled out (the recipe, say, which fits by the arithmetic and not as a rank), so the plans it pruned as slower
        than that one are open again."""
        self.sizes = self.all_sizes
        for ck in self.checkpointing:
            self.probe((ck, self.recipe.activation_offload))
        for c in self.grid(self.recipe.activation_offload):
            if c not in self.preds:
                self.preds[c] = self.predict(c)

    def search_activation_offload(self, grid: list[Candidate], smallest: Candidate) -> None:
        """Add the activation-offload candidates of ``grid`` worth tracing to ``preds``: offloading only adds time
        (host copies), so a candidate is open only where its twin without offload does not fit (or was never a
        contender) and a lower bound of its time beats the fastest plan that fits. That bound is its time without the
        copies until one candidate of its checkpointing setting is traced; then the copies are priced from that trace
        (bytes in proportion to the rows of a micro-batch; with a module's own passes, as CRSP's, a trace is the
        whole step whatever the pass size). The fastest open candidate is traced alone first, its whole setting only
        if candidates stay open, one setting at a time: a generation recipe's trace is minutes, so most settings cost
        one trace or none."""
        preds, usable = self.preds, self.usable
        per_step = bool(self.shape.micro_batch_key)
        probed: set[Setting] = set()
        sampled: dict[Setting, Prediction] = {}
        if not any(p.peak_bytes <= usable for p in preds.values()):
            # the smallest step with every lever, offloading too: when it does not fit, no offloading candidate does
            ends = [dataclasses.replace(smallest, strategy=s, offload=o, activation_offload=True) for s, o in self.strategies]
            ends = [c for c in ends if c in grid]
            for c in ends:
                preds[c] = self.predict(c, exact=True)
                sampled.setdefault(_setting(c), preds[c])
            if all(preds[c].peak_bytes > usable for c in ends):
                return

        def bound(c: Candidate) -> float:
            sample = sampled.get(_setting(c))
            if sample is None:
                return self.seconds(c)
            moved = sample.estimate.offloaded_bytes
            return self.seconds(c, moved if per_step else moved * c.micro_batch // max(sample.candidate.micro_batch, 1))

        while True:
            fitting = [p for p in preds.values() if p.peak_bytes <= usable]
            best = min(fitting, key=self.order) if fitting else None

            def is_open(c: Candidate) -> bool:
                twin = preds.get(dataclasses.replace(c, activation_offload=False))
                if twin is not None and twin.peak_bytes <= usable:
                    return False  # it fits without: offloading would only add the copies
                if c in preds and preds[c].traced:
                    return False
                return best is None or bound(c) < best.seconds

            candidates = [c for c in grid if _setting(c) not in probed and is_open(c)]
            if not candidates:
                if best is not None and best.candidate.activation_offload:
                    # what the offload saves and costs: the same plan without it (one trace at most; it does not fit)
                    twin = dataclasses.replace(best.candidate, activation_offload=False)
                    preds.setdefault(twin, self.predict(twin))
                return
            first = min(candidates, key=lambda c: (bound(c), c))
            setting = _setting(first)
            if setting not in sampled:
                preds[first] = sampled[setting] = self.predict(first, exact=True)
                continue
            probed.add(setting)
            self.probe(setting)
            for c in grid:
                if _setting(c) == setting:
                    preds[c] = self.predict(c)
            self.settle()


def merge_variants(base: PlanResult, variants: Sequence[PlanResult]) -> PlanResult:
    """One answer over the recipe's search and its ``plan.allow`` variants' (each searched by :func:`search_plans`):
    times relative to the recipe as given, levers named against it, one Pareto front over all of them."""
    preds: dict[Candidate, Prediction] = {}
    for result in (base, *variants):
        for p in result.predictions:
            preds.setdefault(p.candidate, p)
    traces = base.traces + sum(v.traces for v in variants)
    floor = min([base.floor_bytes, *(v.floor_bytes for v in variants)])
    merged = _rank(base.shape, base.memory_bytes, base.usable_bytes, base.margin, base.device, preds, base.shape.recipe,
                   base.recipe, traces, floor)
    merged.rank_traces = sum(r.rank_traces for r in (base, *variants))
    merged.notes = [n for r in (base, *variants) for n in r.notes]
    return merged


def _rank(shape: RecipeShape, memory_bytes: int, usable: int, margin: float, device: DeviceSpec,
          preds: dict[Candidate, Prediction], recipe: Candidate, recipe_pred: Prediction, traces: int, floor: int,
          reference: Callable[[Candidate], Prediction | None] | None = None) -> PlanResult:
    """Rank ``preds`` against ``recipe``: the Pareto front of fitting plans with each lever's saving and cost.

    ``reference`` predicts, without tracing, a plan without one of its levers that the search never predicted (the
    search prunes what cannot be fastest), so the lever can still be priced; it is not ranked.
    """

    def order(p: Prediction) -> tuple:
        # Fewer changes to the maths first (a plan.allow lever only where the exact ones do not fit, and one where
        # one is enough), then the fastest.
        return (len(p.candidate.maths), round(p.seconds, 12), len(changed_levers(p.candidate, recipe)), p.peak_bytes, p.candidate)

    ranked = sorted(preds.values(), key=order)
    for p in ranked:
        p.relative_time = p.seconds / recipe_pred.seconds
        p.levers, p.arithmetic_levers = {}, ()
    fitting = [p for p in ranked if p.peak_bytes <= usable]
    plans: list[Prediction] = []
    for p in fitting:  # fastest first: keep a plan only if it needs clearly less memory than every faster one
        if not plans or p.peak_bytes < min(q.peak_bytes for q in plans) * (1.0 - PARETO_STEP):
            plans.append(p)
    for p in plans:
        for lever in changed_levers(p.candidate, recipe):
            without = revert_lever(p.candidate, lever, recipe)
            ref = preds.get(without) or (reference(without) if reference is not None else None)
            # None: the plan without this lever was not predicted and would take a trace (or a maths lever searched
            # only with another one)
            if ref is None:
                p.levers[lever] = None
            else:
                mine, theirs = like_peaks(p, ref)
                p.levers[lever] = (theirs - mine, p.seconds / ref.seconds - 1.0)
                if p.rank_traced != ref.rank_traced:
                    p.arithmetic_levers += (lever,)
    # the closest plan: the fastest of those within 1% of the smallest peak (peaks an optimizer step dominates tie)
    least = min(p.peak_bytes for p in ranked)
    closest = next(p for p in ranked if p.peak_bytes <= least * 1.01)
    not_fitting = next((p for p in ranked if p.peak_bytes > usable), None)
    return PlanResult(shape, memory_bytes, usable, margin, device, plans, closest, not_fitting, recipe_pred, traces,
                      floor, ranked)


def state_floor(est: PeakEstimate) -> int:
    """Bytes of the optimizer step that no exact lever changes: model state, the update's temporaries, collectives."""
    step = est.phase_breakdowns.get("optimizer step") or {}
    return int(sum(step.get(k, 0) for k in ("parameters", "gradients", "optimizer_state", "temporaries", "communication")))


def _interpolate(traces: _Traces, setting: Setting, rows: int, acc: bool) -> PeakEstimate:
    """The estimate at ``rows`` on the line through the two nearest traced micro-batches of the same kind."""
    probes = traces.probes(setting, acc)
    if len(probes) < 2:
        return traces.get(setting, rows, acc)
    below = [r for r in probes if r <= rows]
    above = [r for r in probes if r >= rows]
    lo = below[-1] if below else probes[0]
    hi = above[0] if above and above[0] != lo else next((r for r in probes if r > lo), probes[-1])
    if lo == hi:
        lo = probes[-2]
    est = extrapolate([traces.done[(setting, lo, acc)], traces.done[(setting, hi, acc)]], (lo, hi), rows)
    base = traces.done[(setting, hi, acc)]
    return dataclasses.replace(est, num_blocks=base.num_blocks, batch_size=rows,
                               method=f"{base.method}; interpolated in the micro-batch between {lo} and {hi} rows")


def _work_from(est: PeakEstimate, shape: RecipeShape) -> StepWork:
    step = est.phase_breakdowns.get("optimizer step") or est.breakdown
    params = float(step.get("parameters", 0))
    grads = float(step.get("gradients", 0)) or float(est.breakdown.get("gradients", 0))
    # gradients are freed by zero_grad at the step's end: the trainable bytes are the optimizer's parameters,
    # which its states (2 per parameter for Adam) measure when the gradient row reads 0
    states = float(step.get("optimizer_state", 0))
    trainable = grads if grads > 0 else states / 2.0
    size = float(max(shape.dtype_bytes, 1))
    return StepWork(parameters=params / size, trainable=trainable / size, parameter_bytes=params,
                    trainable_bytes=trainable, optimizer_state_bytes=states, tokens=0.0, micro_batches=1,
                    blocks=shape.blocks, world_size=shape.world_size, nodes=shape.nodes,
                    replicated_bytes=float(min(shape.replicated_bytes, params)))
