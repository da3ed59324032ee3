"""``memory.plan``'s search on a synthetic step (no tracing): sanity properties of the ranking.

The trace function is arithmetic: model state, activations that grow with the rows and shrink with
checkpointing, gradients live from the start when accumulating.
"""

from __future__ import annotations

import dataclasses

import pytest

from lit_memopt.memory.plan import Candidate, RecipeShape, changed_levers, merge_variants, search_plans
from lit_memopt.memory.plan_time import DEVICES, StepWork, step_seconds
from lit_memopt.memory.step import PeakEstimate

MIB = 2**20
PARAMS, STATES, ACT = 400 * MIB, 800 * MIB, 100 * MIB  # per row


def _estimate(ckpt: bool, rows: int, acc: bool) -> PeakEstimate:
    act = rows * ACT // (4 if ckpt else 1)
    fwd = {"parameters": PARAMS, "gradients": PARAMS if acc else 0, "optimizer_state": STATES, "activations": act,
           "temporaries": rows * MIB, "other": rows * 1024, "communication": 0}
    bwd = dict(fwd, gradients=PARAMS, activations=act // 2, temporaries=2 * rows * MIB)
    step = {"parameters": PARAMS, "gradients": PARAMS, "optimizer_state": STATES, "activations": 0,
            "temporaries": PARAMS // 4, "other": 0, "communication": 0}
    phases = {"forward": fwd, "backward": bwd, "optimizer step": step}
    peaks = {k: sum(v.values()) for k, v in phases.items()}
    top = max(peaks, key=peaks.get)
    return PeakEstimate(peak_bytes=peaks[top], breakdown=dict(phases[top]), peak_phase=top, phase_peaks=peaks, modules=[],
                        batch_size=rows, seq_len=128, fake=True, seconds=0.0, phase_breakdowns=phases,
                        reserved_peak_bytes=peaks[top] + 64 * MIB, num_blocks=8)


SHAPE = RecipeShape(rows=16, accumulation=1, checkpointing=False, strategy="single", world_size=1, nodes=1, blocks=8,
                    tokens_per_row=128, dtype_bytes=2)


def _plan(memory: int, shape: RecipeShape = SHAPE, trace=_estimate, offload: bool = True):
    return search_plans(trace, shape, memory, device=DEVICES["h100"], margin=0.1, offload=offload)


def test_a_budget_that_does_not_bind_gives_the_recipe_unchanged() -> None:
    result = _plan(80 * 2**30)
    assert result.fits and result.best.candidate == SHAPE.recipe
    assert changed_levers(result.best.candidate, SHAPE.recipe) == [] and result.best.relative_time == 1.0
    assert result.traces == 1  # nothing else was traced: no other plan can be faster


def test_more_memory_never_gives_a_slower_plan() -> None:
    times = []
    for gib in (2.0, 2.2, 2.4, 2.6, 2.8, 3.0, 3.3, 8.0):
        result = _plan(int(gib * 2**30))
        assert result.fits, gib
        times.append(result.best.seconds)
    assert times == sorted(times, reverse=True), times
    assert times[0] > times[-1]


def test_the_table_is_a_pareto_front_and_levers_are_attributed() -> None:
    result = _plan(int(2.4 * 2**30))
    assert len(result.plans) >= 2
    for faster, slower in zip(result.plans, result.plans[1:]):
        assert faster.seconds <= slower.seconds and faster.peak_bytes > slower.peak_bytes
    best = result.best
    assert best.candidate.micro_batch * best.candidate.accumulation == SHAPE.global_rows
    for lever, (saved, cost) in best.levers.items():
        assert saved > 0 and cost >= 0, (lever, saved, cost)
    assert result.fastest_not_fitting is not None and result.fastest_not_fitting.seconds <= best.seconds


def test_deterministic() -> None:
    one, two = _plan(int(2.6 * 2**30)), _plan(int(2.6 * 2**30))
    assert [(p.candidate, p.peak_bytes, p.seconds) for p in one.plans] == [(p.candidate, p.peak_bytes, p.seconds) for p in two.plans]


def test_cpu_offload_fits_what_no_other_exact_lever_does() -> None:
    # 1.8 GiB: the optimizer step alone holds 1700 MiB on the device; FSDP2's CPU offload moves it to the host
    result = _plan(int(1.8 * 2**30))
    assert result.fits
    best = result.best
    assert best.candidate.offload and best.candidate.strategy == "fsdp2" and best.traced
    assert "cpu offload" in best.levers and best.levers["cpu offload"][0] > 0 and best.levers["cpu offload"][1] > 0
    assert best.relative_time > 1.0  # the copies over PCIe and the host's optimizer step cost time


def test_impossible_budget() -> None:
    result = _plan(int(1.8 * 2**30), offload=False)  # the optimizer step alone holds 1700 MiB of weights, gradients, states, temporaries
    assert not result.fits and result.best is None
    assert result.floor_bytes == 2 * PARAMS + STATES + PARAMS // 4 and result.traces == 1


def test_fsdp2_is_searched_over_the_given_devices() -> None:
    shape = RecipeShape(rows=16, accumulation=1, checkpointing=False, strategy="ddp", world_size=8, nodes=1, blocks=8,
                        tokens_per_row=128, dtype_bytes=2)
    result = _plan(int(2.5 * 2**30), shape)
    assert result.fits and result.best.candidate.strategy == "fsdp2"
    assert "strategy" in result.best.levers


def _rebuilt(est: PeakEstimate, phases: dict[str, dict[str, int]]) -> PeakEstimate:
    """``est`` with its phases replaced by ``phases``: peaks, breakdown and reserved peak (64 MiB over) follow."""
    peaks = {k: sum(v.values()) for k, v in phases.items()}
    top = max(peaks, key=peaks.get)
    return dataclasses.replace(est, peak_bytes=peaks[top], breakdown=dict(phases[top]), peak_phase=top, phase_peaks=peaks,
                               phase_breakdowns=phases, reserved_peak_bytes=peaks[top] + 64 * MIB)


def _lora_estimate(ckpt: bool, rows: int, acc: bool) -> PeakEstimate:
    """The synthetic step with a frozen base: gradients and optimizer states of 1% of the parameters."""
    est = _estimate(ckpt, rows, acc)
    phases = {k: dict(v, gradients=v["gradients"] // 100, optimizer_state=v["optimizer_state"] // 100,
                      temporaries=v["temporaries"] // (100 if k == "optimizer step" else 1))
              for k, v in est.phase_breakdowns.items()}
    return _rebuilt(est, phases)


def test_maths_levers_merge_against_the_recipe_as_given() -> None:
    memory = int(1.2 * 2**30)  # no exact lever fits without offload; LoRA's frozen base does
    base = _plan(memory, offload=False)
    assert not base.fits
    lora = _plan(memory, dataclasses.replace(SHAPE, maths=("lora",)), trace=_lora_estimate, offload=False)
    merged = merge_variants(base, [lora])
    assert merged.fits and merged.best.candidate.maths == ("lora",)
    assert "lora" in changed_levers(merged.best.candidate, SHAPE.recipe)
    assert merged.recipe.candidate == SHAPE.recipe and merged.traces == base.traces + lora.traces
    # times are relative to the recipe as given, not to the variant's own recipe
    assert merged.best.relative_time == pytest.approx(merged.best.seconds / base.recipe.seconds)
    for faster, slower in zip(merged.plans, merged.plans[1:]):
        assert faster.seconds <= slower.seconds and faster.peak_bytes > slower.peak_bytes


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_step_time_model_orders_the_levers(device: str) -> None:
    spec = DEVICES[device]
    work = StepWork(parameters=4e9, trainable=4e9, parameter_bytes=8e9, trainable_bytes=8e9, optimizer_state_bytes=16e9,
                    tokens=16 * 2048, micro_batches=1, blocks=36)
    base = step_seconds(work, spec)
    assert step_seconds(StepWork(**{**work.__dict__, "recompute": 1.0}), spec) > base
    assert step_seconds(StepWork(**{**work.__dict__, "tokens": 2048, "micro_batches": 16}), spec) > base
    assert Candidate(1, 16, False, "single") < Candidate(2, 8, False, "single")  # a total order: deterministic ties


def test_the_gpu_check_counts_misordered_pairs_beyond_ten_percent() -> None:
    from benchmarks.plan_cuda import choose, misordered

    rows = [{"plan": "a", "predicted_s": 1.0, "measured_s": 1.05}, {"plan": "b", "predicted_s": 2.0, "measured_s": 1.0},
            {"plan": "c", "predicted_s": 3.0, "measured_s": 0.5}, {"plan": "d", "predicted_s": 4.0, "measured_s": None}]
    # a before b: measured 5% apart, within the tolerance; a and b before c: c measured 2x faster, both mis-ordered
    assert misordered(rows) == [("a", "c"), ("b", "c")]
    result = _plan(int(2.6 * 2**30))
    chosen = choose(result, 4)
    assert len(chosen) == 4 and all(p.peak_bytes <= result.usable_bytes for p in chosen)
    assert [p.seconds for p in chosen] == sorted(p.seconds for p in chosen)


def _convex(ckpt: bool, rows: int, acc: bool) -> PeakEstimate:
    """``_estimate`` with activations that also grow with the square of the rows: a line between two traced
    micro-batches over-predicts every one between them (as the allocator's segments can)."""
    est = _estimate(ckpt, rows, acc)
    phases = {k: dict(v) for k, v in est.phase_breakdowns.items()}
    for k in ("forward", "backward"):
        phases[k]["activations"] += rows * rows * 8 * MIB
    return _rebuilt(est, phases)


@pytest.mark.parametrize("mib", range(2000, 2700, 50))
def test_a_near_miss_on_the_line_is_traced_and_the_fastest_true_fit_found(mib: int) -> None:
    result = _plan(mib * MIB, trace=_convex, offload=False)
    truly_fitting = [p.seconds for p in result.predictions
                     if _convex(p.candidate.checkpointing, p.candidate.micro_batch, p.candidate.accumulation > 1)
                     .reserved_peak_bytes <= result.usable_bytes]
    assert truly_fitting and result.best is not None and result.best.traced
    assert result.best.seconds == min(truly_fitting)


def _periodic(ckpt: bool | int, rows: int, acc: bool) -> PeakEstimate:
    """``_estimate`` where checkpointing every 2nd block keeps half the activations (all of them: a quarter)."""
    est = _estimate(bool(ckpt), rows, acc)
    if ckpt is True or not ckpt:
        return est
    assert ckpt == 2
    phases = {k: dict(v) for k, v in est.phase_breakdowns.items()}
    for k in ("forward", "backward"):
        phases[k]["activations"] *= 2  # a half kept instead of a quarter
    return _rebuilt(est, phases)


def test_checkpointing_every_other_block_sits_between_none_and_all() -> None:
    from lit_memopt.memory.plan import recompute_share

    shape = dataclasses.replace(SHAPE, checkpoint_periods=(2,))
    assert [recompute_share(v) for v in (False, True, 2, 3)] == [0.0, 1.0, 0.5, 1 / 3]
    seen = set()
    for gib in (2.3, 2.5, 2.8, 3.2, 3.6):
        result = _plan(int(gib * 2**30), shape=shape, trace=_periodic, offload=False)
        assert result.fits
        best = result.best
        seen.add(best.candidate.checkpointing)
        # the fastest true fit among every candidate of the search (each traced here, exactly)
        truth = min(p.seconds for p in result.predictions
                    if _periodic(p.candidate.checkpointing, p.candidate.micro_batch, p.candidate.accumulation > 1)
                    .reserved_peak_bytes <= result.usable_bytes)
        assert best.seconds == truth, gib
        if best.candidate.checkpointing == 2:
            assert "checkpointing" in best.levers and best.levers["checkpointing"][1] > 0
    assert 2 in seen  # some budget is best served by checkpointing every other block
    # every other block costs half the recomputation of all of them, in the time model
    result = _plan(int(2.8 * 2**30), shape=shape, trace=_periodic, offload=False)
    by_ck = {p.candidate.checkpointing: p.seconds for p in result.predictions
             if (p.candidate.micro_batch, p.candidate.strategy) == (4, "single")}
    assert set(by_ck) == {False, True, 2} and by_ck[False] < by_ck[2] < by_ck[True]
    assert abs((by_ck[2] - by_ck[False]) - (by_ck[True] - by_ck[False]) / 2) < 1e-9 * by_ck[True]


def test_a_step_that_cannot_be_split_keeps_its_batch() -> None:
    """A module that optimizes manually and has no micro-batch setting of its own: Lightning refuses gradient
    accumulation there, so no plan may split the loader's batch; checkpointing and strategy still apply."""
    shape = dataclasses.replace(SHAPE, micro_batch_key="")
    for gib in (2.0, 2.3, 3.0):
        result = _plan(int(gib * 2**30), shape=shape)
        assert {p.candidate.micro_batch for p in result.predictions} == {SHAPE.rows}, gib
        assert all(p.candidate.accumulation == 1 for p in result.predictions)
    # the same budget with the lever open splits the batch (the test above would pass vacuously otherwise)
    assert _plan(int(2.0 * 2**30)).best.candidate.micro_batch < SHAPE.rows


def test_a_module_splitting_its_own_step_is_planned_over_its_sequences() -> None:
    """CRSP's own micro-batches: 16 sequences in the step's largest pass, given as 3 per pass (6 passes, the last
    short). The plans try the divisors of 16 and the recipe's 3, each with the passes that cover 16; none runs more
    sequences per pass than the step has."""
    shape = dataclasses.replace(SHAPE, rows=3, accumulation=6, micro_batch_key="module.generation.micro_batch_size",
                                step_sequences=16)
    for gib in (2.0, 2.3, 3.0, 80.0):
        result = _plan(int(gib * 2**30), shape=shape)
        sizes = {(p.candidate.micro_batch, p.candidate.accumulation) for p in result.predictions}
        assert sizes <= {(1, 16), (2, 8), (3, 6), (4, 4), (8, 2), (16, 1)}, (gib, sizes)
    assert _plan(80 * 2**30, shape=shape).best.candidate == shape.recipe  # room to spare: the recipe as given
    assert {(p.candidate.micro_batch, p.candidate.accumulation)
            for p in _plan(int(2.0 * 2**30), shape=shape).predictions} - {(3, 6)}  # smaller budgets: other sizes


BIG_ACT = 800 * MIB  # per row: long rows, whose activations bind even at one row with every block checkpointed


def _offloading_estimate(ckpt: bool, rows: int, acc: bool, activation_offload: bool = False) -> PeakEstimate:
    """The synthetic step with long rows; activation offload keeps an eighth of the saved activations on the device
    and copies the rest (all of them, checkpointed or not, counted as moved)."""
    est = _estimate(ckpt, rows, acc)
    saved = rows * BIG_ACT // (4 if ckpt else 1)
    kept = saved // 8 if activation_offload else saved
    phases = {k: dict(v, activations=0 if k == "optimizer step" else kept // (2 if k == "backward" else 1))
              for k, v in est.phase_breakdowns.items()}
    return dataclasses.replace(_rebuilt(est, phases), offloaded_bytes=saved if activation_offload else 0)


def test_activation_offload_fits_where_checkpointing_one_row_does_not() -> None:
    # 2 GiB (1843 MiB usable): one row with every block checkpointed peaks at 1801 MiB live + 64 reserved; offloaded,
    # the optimizer step's 1700 MiB (+64) is the peak. FSDP2's offload (which would also fit) is left out here.
    shape = dataclasses.replace(SHAPE, activation_offload=False)
    memory = 2 * 2**30
    without = search_plans(_offloading_estimate, SHAPE, memory, device=DEVICES["h100"], margin=0.1, offload=False)
    assert not without.fits
    result = search_plans(_offloading_estimate, shape, memory, device=DEVICES["h100"], margin=0.1, offload=False)
    assert result.fits
    best = result.best
    assert best.candidate.activation_offload and best.traced and best.candidate.checkpointing is True
    assert best.levers["activation offload"][0] > 0 and best.levers["activation offload"][1] > 0  # saves, and costs
    # the copies are priced: the same plan without them is predicted faster
    twin = dataclasses.replace(best.candidate, activation_offload=False)
    assert best.seconds > next(p.seconds for p in result.predictions if p.candidate == twin)


def test_activation_offload_is_traced_only_where_it_could_beat_the_fastest_fitting_plan() -> None:
    # 6 GiB: 16 rows with every block checkpointed fit. Checkpointed and offloaded can only be slower (its twin fits):
    # never traced. Offloaded without checkpointing could be faster (lower bound: no copies): its fastest candidate is
    # traced, and its copies (12800 MiB per micro-batch over PCIe) price every other micro-batch of that setting out.
    memory = 6 * 2**30
    shape = dataclasses.replace(SHAPE, activation_offload=False)
    plain = search_plans(_offloading_estimate, SHAPE, memory, device=DEVICES["h100"], margin=0.1, offload=False)
    searched = search_plans(_offloading_estimate, shape, memory, device=DEVICES["h100"], margin=0.1, offload=False)
    assert plain.fits and plain.best.candidate.checkpointing is True and plain.best.candidate.micro_batch == 16
    assert searched.best.candidate == plain.best.candidate
    offloading = [p for p in searched.predictions if p.candidate.activation_offload]
    assert offloading and {p.candidate.checkpointing for p in offloading} == {False}
    assert all(p.seconds > searched.best.seconds for p in offloading)
    assert searched.traces == plain.traces + 1


def test_activation_offload_adds_its_copies_to_each_micro_batch() -> None:
    h100 = DEVICES["h100"]
    work = StepWork(parameters=4e9, trainable=4e9, parameter_bytes=8e9, trainable_bytes=8e9, optimizer_state_bytes=16e9,
                    tokens=8192, micro_batches=4, blocks=36)
    moved = 3e9
    extra = step_seconds(dataclasses.replace(work, activation_offload_bytes=moved), h100) - step_seconds(work, h100)
    from lit_memopt.memory.plan_time import BANDWIDTH_EFFICIENCY

    assert extra == pytest.approx(4 * 2 * moved / (h100.pcie_bytes_per_second * BANDWIDTH_EFFICIENCY))


def _cached(device: int | None):  # noqa: ANN202
    """A step whose allocator keeps 1000 MiB of cache over its live bytes without a device size (a cache that
    outgrows its freed segments); one releasing before each new segment needs only 64 MiB over them."""

    def trace(ckpt: bool, rows: int, acc: bool) -> PeakEstimate:
        est = _estimate(ckpt, rows, acc)
        return dataclasses.replace(est, reserved_peak_bytes=est.peak_bytes + 1000 * MIB, device_bytes=device,
                                   least_reserved_bytes=None if device is None else est.peak_bytes + 64 * MIB)

    return trace


def test_a_reserved_line_past_the_device_is_judged_as_the_allocator_would() -> None:
    """With the device's size the traces tell the least device a step needs: the recipe's step, whose reserved line
    passes the usable bytes, runs within them (its allocator releases its cache), so it is the plan, at the device's
    size. Without it the same line says the recipe does not fit and a slower plan is chosen."""
    from lit_memopt.memory.search import usable_bytes

    memory = int(3.3 * 2**30)
    usable = usable_bytes(memory, 0.1)
    recipe_live = _estimate(False, 16, False).peak_bytes
    assert recipe_live + 64 * MIB <= usable < recipe_live + 1000 * MIB
    judged = _plan(memory, trace=_cached(usable))
    assert judged.fits and judged.best.candidate == SHAPE.recipe and judged.best.peak_bytes == usable
    assert "releases its cached segments" in judged.best.estimate.method
    unjudged = _plan(memory, trace=_cached(None))
    assert unjudged.fits and unjudged.best.candidate != SHAPE.recipe
    assert unjudged.best.seconds > judged.best.seconds
    # a device under even the least the recipe needs: the recipe does not fit, and is reported at that least
    tight = _plan(int((recipe_live + 30 * MIB) / 0.9), trace=_cached(usable_bytes(int((recipe_live + 30 * MIB) / 0.9), 0.1)))
    recipe = next(p for p in [*tight.plans, tight.fastest_not_fitting] if p is not None and p.candidate == SHAPE.recipe)
    assert recipe.peak_bytes == recipe_live + 64 * MIB and not tight.best.candidate == SHAPE.recipe


def test_a_recipe_that_fits_with_costly_levers_is_kept_and_the_faster_step_named() -> None:
    """A recipe that checkpoints and accumulates, on a budget that does not bind: it is kept as given (one trace), and
    the fastest candidate the time model puts before it is named, untraced, for a plan from there."""
    shape = dataclasses.replace(SHAPE, rows=4, accumulation=4, checkpointing=True)
    result = _plan(80 * 2**30, shape)
    assert result.fits and result.best.candidate == shape.recipe and result.traces == 1
    assert result.untried is not None
    faster, relative = result.untried
    assert relative < 1.0 and not faster.checkpointing and faster.micro_batch > 4
    # the lever-free recipe has nothing faster to name
    assert _plan(80 * 2**30).untried is None
    # a module without the checkpointing switch: only the micro-batch can be named
    fixed = dataclasses.replace(shape, checkpointing=None)
    named = _plan(80 * 2**30, fixed).untried
    assert named is not None and named[0].checkpointing == fixed.recipe.checkpointing and named[0].micro_batch == 16


def test_a_checkpointed_recipe_that_does_not_fit_is_planned_as_if_it_did_not_checkpoint() -> None:
    """Checkpointing off is searched too: for a recipe that checkpoints every block and does not fit, the plan is the
    same as for the recipe without checkpointing (same candidates), which takes it off where accumulation fits faster."""
    plain_shape = dataclasses.replace(SHAPE, tokens_per_row=4096)  # compute-bound: accumulating costs less than recomputing
    ckpt = dataclasses.replace(plain_shape, checkpointing=True)
    took_off = 0
    for gib in (1.9, 2.0, 2.2, 2.4, 2.6, 2.8, 3.0, 3.3):
        plain, checkpointed = _plan(int(gib * 2**30), plain_shape), _plan(int(gib * 2**30), ckpt)
        if checkpointed.best is None or checkpointed.best.candidate == ckpt.recipe:
            continue  # the recipe fits as given: kept unchanged
        assert plain.best.candidate == checkpointed.best.candidate, gib
        assert plain.best.peak_bytes == checkpointed.best.peak_bytes
        if checkpointed.best.candidate.checkpointing is False:
            took_off += 1
            # priced against the same plan checkpointed (predicted from the traces made, not ranked)
            saved, cost = checkpointed.best.levers["checkpointing"]
            assert saved < 0 and cost < 0, (saved, cost)  # taking it off costs memory and saves time
            assert checkpointed.best.relative_time < 1.0  # faster than the checkpointed step as given
    assert took_off


# ---------------------------------------------------------------------------- FSDP2 plans confirmed as one rank
FSDP2_SHAPE = RecipeShape(rows=16, accumulation=1, checkpointing=False, strategy="fsdp2", world_size=8, nodes=1,
                          blocks=8, tokens_per_row=128, dtype_bytes=2)


def _rank_trace(extra: int, asked: list):
    """A stand-in for one rank's own trace: the sharding arithmetic on the synthetic step, ``extra`` bytes more
    reserved (a rank that keeps a cache the one-device trace released)."""
    from lit_memopt.memory.sharding import per_rank_estimate

    def confirm(c: Candidate) -> PeakEstimate:
        asked.append(c)
        est = per_rank_estimate(_estimate(c.checkpointing, c.micro_batch, c.accumulation > 1), "fsdp2", 8)
        return dataclasses.replace(est, reserved_peak_bytes=est.reserved_peak_bytes + extra)

    return confirm


def _fsdp2_plan(memory: int, confirm=None):
    return search_plans(_estimate, FSDP2_SHAPE, memory, device=DEVICES["h100"], margin=0.1, confirm_rank=confirm)


def test_the_fastest_fsdp2_plan_is_confirmed_by_its_own_rank() -> None:
    asked: list = []
    arithmetic = _fsdp2_plan(80 * 2**30)
    result = _fsdp2_plan(80 * 2**30, _rank_trace(300 * MIB, asked))
    assert asked == [FSDP2_SHAPE.recipe] and result.rank_traces == 1
    assert result.best.candidate == FSDP2_SHAPE.recipe and result.best.rank_traced and result.recipe.rank_traced
    assert result.best.peak_bytes == arithmetic.best.peak_bytes + 300 * MIB
    # the other plans keep their arithmetic (CPU offload: no rank is traced with its state in host memory)
    assert [p.rank_traced for p in result.plans[1:]] == [False] * (len(result.plans) - 1)


def test_a_plan_whose_rank_does_not_fit_opens_the_plans_the_search_had_pruned() -> None:
    """The recipe fits by the arithmetic, so the search traced nothing else; its rank does not: the answer is the
    fastest plan that fits as a rank (a smaller micro-batch or checkpointing), not FSDP2's CPU offload."""
    extra = 300 * MIB
    arithmetic = _fsdp2_plan(80 * 2**30).best.peak_bytes
    memory = int((arithmetic + extra // 2) / 0.9) + 1
    assert _fsdp2_plan(memory).best.candidate == FSDP2_SHAPE.recipe  # by the arithmetic alone
    asked: list = []
    result = _fsdp2_plan(memory, _rank_trace(extra, asked))
    assert asked[0] == FSDP2_SHAPE.recipe and len(asked) == result.rank_traces >= 2
    best = result.best
    assert best.rank_traced and best.peak_bytes <= result.usable_bytes
    assert best.candidate.strategy == "fsdp2" and not best.candidate.offload and best.candidate != FSDP2_SHAPE.recipe
    assert result.fastest_not_fitting.candidate == FSDP2_SHAPE.recipe and result.fastest_not_fitting.rank_traced
    assert result.untried is None  # "the recipe fits as given" no longer holds
    # every rank here reads `extra` more than the arithmetic: the answer is the fastest FSDP2 plan the arithmetic
    # fits in `extra` less
    shifted = _fsdp2_plan(int(memory - extra / 0.9))
    on_device = [p.candidate for p in shifted.plans if p.candidate.strategy == "fsdp2" and not p.candidate.offload]
    assert on_device and best.candidate == on_device[0]


def test_a_rank_not_traced_leaves_the_arithmetic() -> None:
    asked: list = []

    def declined(c: Candidate):
        asked.append(c)

    arithmetic = _fsdp2_plan(80 * 2**30)
    result = _fsdp2_plan(80 * 2**30, declined)
    assert asked == [FSDP2_SHAPE.recipe] and result.rank_traces == 0
    assert [(p.candidate, p.peak_bytes, p.rank_traced) for p in result.plans] == [
        (p.candidate, p.peak_bytes, False) for p in arithmetic.plans]


def test_no_rank_is_traced_on_one_device_nor_for_ddp_or_offload() -> None:
    asked: list = []
    assert _plan(int(2.6 * 2**30)).best is not None  # one device: no confirm_rank asked
    result = search_plans(_estimate, SHAPE, int(2.6 * 2**30), device=DEVICES["h100"], margin=0.1,
                          confirm_rank=_rank_trace(0, asked))
    assert asked == [] and result.rank_traces == 0
    ddp = dataclasses.replace(FSDP2_SHAPE, strategy="ddp")
    result = search_plans(_estimate, ddp, 80 * 2**30, device=DEVICES["h100"], margin=0.1,
                          confirm_rank=_rank_trace(0, asked))
    # a DDP recipe's plans are confirmed only where the best is FSDP2 with its state on the device
    assert all(c.strategy == "fsdp2" and not c.offload for c in asked)
    assert bool(asked) == (result.best.candidate.strategy == "fsdp2")


def test_a_traced_ranks_levers_are_priced_against_like_figures() -> None:
    """A plan whose peak is its own rank's trace, against the plan without one of its levers, priced by the
    arithmetic (its rank is not traced): the saving compares the two arithmetic figures, not the rank's `extra`
    allocator bytes with the arithmetic (which read `extra` too little of a saving)."""
    from lit_memopt.memory.plan_candidates import revert_lever

    extra = 300 * MIB
    # the recipe does not fit even by the arithmetic: the best plan (checkpointing) is traced as a rank, its twin
    # without checkpointing (the recipe) is not
    memory = int(_fsdp2_plan(80 * 2**30).best.peak_bytes * 0.95 / 0.9)
    result = _fsdp2_plan(memory, _rank_trace(extra, []))
    best = result.best
    assert best.rank_traced and best.arithmetic_peak_bytes == best.peak_bytes - extra
    by_candidate = {p.candidate: p for p in result.predictions}
    priced = 0
    for lever, value in best.levers.items():
        twin = by_candidate[revert_lever(best.candidate, lever, FSDP2_SHAPE.recipe)]
        assert value is not None
        if twin.rank_traced:  # both ranks traced: their own figures
            assert value[0] == twin.peak_bytes - best.peak_bytes
        else:
            assert value[0] == twin.peak_bytes - best.arithmetic_peak_bytes
            priced += 1
    assert priced >= 1 and best.levers["checkpointing"][0] == result.recipe.peak_bytes - (best.peak_bytes - extra)

    # the table says so under the plan: which savings compare arithmetic figures, and plan 1's
    import io

    from lit_memopt.cli import compose_config
    from lit_memopt.cli_plan_output import render_plan
    from lit_memopt.memory.units import format_bytes

    argv = ["recipe=sft", "trainer=fsdp2", "trainer.devices=8", f"gpu_memory={memory}"]
    out = io.StringIO()
    render_plan(result, compose_config(argv), argv, out)
    lines = out.getvalue().splitlines()
    assert "traced rank" in lines[4] and f"checkpointing {best.levers['checkpointing'][0] / 2**20:.2f}" in lines[4]
    assert (f"Plan 1's checkpointing saving compares arithmetic figures (plan 1's: "
            f"{format_bytes(best.arithmetic_peak_bytes)}): the plan without it is not traced as a rank.") in lines, lines
