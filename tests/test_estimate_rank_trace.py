"""One FSDP2 rank traced under a fake process group (``memory.fake_ranks``, ``estimate ... trace_rank=true``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lit_memopt.memory.fake_ranks import DATA_PARALLEL_DIM, fake_process_group
from lit_memopt.memory.sharding import per_rank_estimate

WORLD = 2
# The embedded tiny model with 2 blocks (a full trace) on a batch large enough for activations to matter.
BASE = ["recipe=sft", "trainer.accelerator=cpu", "model.arch.num_hidden_layers=2", "data.batch_size=8"]


def _estimate(*overrides: str):
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_estimate import estimate_recipe

    return estimate_recipe(compose_config([*BASE, *overrides])).estimate


def test_a_fake_process_group_stands_in_for_a_rank_and_is_gone_after() -> None:
    with fake_process_group(4) as mesh:
        assert dist.get_world_size() == 4 and dist.get_rank() == 0
        assert mesh.mesh_dim_names == (DATA_PARALLEL_DIM,) and mesh.size() == 4
        with pytest.raises(RuntimeError, match="already has a process group"):
            with fake_process_group(2):
                pass
    assert not dist.is_initialized()
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="world_size must be a positive integer"):
            with fake_process_group(bad):  # type: ignore[arg-type]
                pass


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_traced_rank_holds_its_shards_and_what_fsdp2_gathers() -> None:
    single = _estimate()
    traced = _estimate("trainer=fsdp2", f"trainer.devices={WORLD}", "trace_rank=true")
    arithmetic = per_rank_estimate(single, "fsdp2", WORLD)
    assert "traced as rank 0 of 2 on a fake process group" in traced.method
    assert not dist.is_initialized()
    # The optimizer step runs on the local shards only: parameters, gradients, states and foreach temporaries are the
    # one-device step's halved, as the arithmetic has them (FSDP2 pads each parameter's rows to a multiple of the
    # world size: a few bytes more).
    step, one = traced.phase_breakdowns["optimizer step"], single.phase_breakdowns["optimizer step"]
    for key in ("parameters", "gradients", "optimizer_state", "temporaries"):
        assert 0 <= step[key] - one[key] / WORLD <= 0.001 * one[key], (key, step[key], one[key])
    assert 0 <= traced.phase_peaks["optimizer step"] - arithmetic.phase_peaks["optimizer step"] <= 1024
    # In forward and backward the rank also holds the blocks FSDP2 gathers (filed as parameters), between its shards
    # and the whole model; the reserved figure is the rank's own log replayed.
    forward = traced.phase_breakdowns["forward"]["parameters"]
    assert step["parameters"] < forward < one["parameters"] + step["parameters"]
    assert traced.reserved_peak_bytes is not None and traced.reserved_peak_bytes >= traced.peak_bytes
    # Against the arithmetic: the same step within 10% (measured 45.92 MiB traced, 42.73 MiB arithmetic: the
    # trace also holds the reduce-scatter's input next to the unsharded gradients).
    assert abs(traced.peak_bytes - arithmetic.peak_bytes) <= 0.10 * traced.peak_bytes


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_traced_rank_on_fake_tensors_matches_the_same_rank_on_real_ones() -> None:
    """The sharded step traced on fake tensors against the tracker over the same rank's step on real tensors (the
    real FSDP2 code, with the fake group's collectives): each phase differs by what the one-device step's fake and
    real traces differ by (measured 45.92 vs 44.67 MiB in backward: the activations), nothing of the sharding's."""
    from lit_memopt._compat.lightning import set_device_mesh
    from lit_memopt.cli import compose_config, instantiate_run
    from lit_memopt.cli_estimate import recipe_batch
    from lit_memopt.cli_fake_run import step_config
    from lit_memopt.memory.step import estimate_peak

    traced = _estimate("trainer=fsdp2", f"trainer.devices={WORLD}", "trace_rank=true")
    single = _estimate()

    def real_step(mesh=None):
        run = instantiate_run(step_config(compose_config(BASE)))
        if mesh is not None:
            set_device_mesh(run.module, mesh)
            run.module.configure_model()
        return estimate_peak(run.module, recipe_batch(run.datamodule), optimizer_foreach=True)

    with fake_process_group(WORLD) as mesh:
        real = real_step(mesh)
    single_real = real_step()
    assert not real.fake and real.peak_phase == traced.peak_phase
    for phase, peak in real.phase_peaks.items():
        fake_minus_real = single.phase_peaks[phase] - single_real.phase_peaks[phase]
        assert abs(traced.phase_peaks[phase] - peak - fake_minus_real) <= 2**16, (phase, traced.phase_peaks,
                                                                                 real.phase_peaks, fake_minus_real)
    assert traced.phase_breakdowns["forward"]["parameters"] == real.phase_breakdowns["forward"]["parameters"]


def test_trace_rank_is_refused_where_it_means_nothing(capsys) -> None:
    from lit_memopt.cli import main

    for args, message in (
        (["trace_rank=true"], "use it with trainer=fsdp2"),
        (["trainer=ddp", "trainer.devices=2", "trace_rank=true"], "use it with trainer=fsdp2"),
        (["trainer=fsdp2", "trainer.devices=2", "trainer.strategy.cpu_offload=true", "trace_rank=true"],
         "without trainer.strategy.cpu_offload"),
        (["trainer=fsdp2", "trainer.devices=2", "trace_rank=yes"], "trace_rank must be true or false"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["estimate", *BASE, *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err, args
    with pytest.raises(SystemExit) as exc:
        main(["plan", *BASE, "gpu_memory=1GiB", "trainer=fsdp2", "trainer.devices=2", "trace_rank=true"])
    assert exc.value.code == 2 and "trace_rank is an estimate option" in capsys.readouterr().err
    assert torch.distributed.is_initialized() is False


@pytest.mark.timeout(360)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_ranks_probes_move_up_to_where_the_deep_step_peaks() -> None:
    """Qwen3-4B SFT over 8 ranks: with few blocks a rank's backward peaks at the head's temporaries, with all 36 on
    the blocks' activations (6.74 GiB on the line through the first probes, 11.06 GiB traced). The stitched log sees
    it; the probes move up to where it runs on a line, and agree with a trace of all 36 blocks."""
    rank = ["model=qwen3_4b", "trainer=fsdp2", "trainer.devices=8", "trace_rank=true"]
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_estimate import estimate_recipe

    probed = estimate_recipe(compose_config(["recipe=sft", *rank])).estimate
    whole = estimate_recipe(compose_config(["recipe=sft", *rank, "trace_all_blocks=true"])).estimate
    assert "runs on that line from" in probed.method and "full trace" in whole.method
    assert probed.peak_phase == whole.peak_phase == "backward"
    assert probed.phase_peaks == whole.phase_peaks  # bytes, every phase
    assert abs(probed.reserved_peak_bytes - whole.reserved_peak_bytes) <= 0.001 * whole.reserved_peak_bytes


def _plan(*overrides: str):
    """``plan`` on the tiny model over 2 ranks, as the command runs it (its argv given: FSDP2 plans are confirmed)."""
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_plan import plan_recipe

    args = [*BASE, "trainer=fsdp2", "trainer.devices=2", "plan.device=a100", *overrides]
    cfg = compose_config(args)
    return cfg, args, plan_recipe(cfg, args)


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_fsdp2_plan_is_one_rank_traced_and_its_estimate_command_reads_the_same(capsys, tmp_path) -> None:  # noqa: ANN001
    """The round trip through the estimate the plan prints: the same reserved bytes (one function, one config)."""
    import io
    import shlex

    from lit_memopt.cli import compose_config, main
    from lit_memopt.cli_estimate import estimate_recipe
    from lit_memopt.cli_plan_output import render_plan

    cfg, args, result = _plan("gpu_memory=1GiB")
    best = result.best
    assert best.rank_traced and result.rank_traces == 1 and "traced as rank 0 of 2" in best.estimate.method
    out = io.StringIO()
    render_plan(result, cfg, args, out)
    text = out.getvalue()
    assert "traced rank" in text.splitlines()[4]  # plan 1's row says where its peak comes from
    hint = next(line for line in text.splitlines() if line.startswith("Plan 1's per-rank figure is one rank traced"))
    command = shlex.split(hint.split(", as ", 1)[1].removesuffix(" prints it."))
    assert command[:2] == ["lit-memopt", "estimate"] and command[-2:] == ["trace_rank=true", "search_micro_batch=false"]
    assert not any(a.startswith("plan.") for a in command), command  # the plan's own keys are left out
    estimate = estimate_recipe(compose_config(command[2:])).estimate
    assert estimate.reserved_peak_bytes == best.peak_bytes
    # and the command runs as printed
    assert main([*command[1:], f"hydra.run.dir={tmp_path}"]) == 0
    assert "traced as rank 0 of 2 on a fake process group" in capsys.readouterr().out.replace("\n", " ")


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_plan_that_fits_by_the_arithmetic_and_not_as_a_rank_is_replaced(monkeypatch) -> None:  # noqa: ANN001
    """57.5 MiB (51.75 usable): the recipe's rank reads 51.62 MiB by the arithmetic and 52.00 traced. The plan traces
    the rank, finds it does not fit, and answers with the fastest plan whose own rank fits; with no time left for
    ranks (plan.rank_seconds) it keeps the arithmetic, and says so."""
    from lit_memopt import cli_plan_rank

    _, _, result = _plan("gpu_memory=57.5MiB")
    recipe = result.shape.recipe
    assert result.fastest_not_fitting.candidate == recipe and result.fastest_not_fitting.rank_traced
    assert result.fastest_not_fitting.peak_bytes > result.usable_bytes
    best = result.best
    assert best.candidate != recipe and best.rank_traced and best.peak_bytes <= result.usable_bytes
    assert not best.candidate.offload and result.rank_traces == 2
    # time for one rank only: the recipe's is traced and does not fit; the next plan keeps the arithmetic, with a note
    monkeypatch.setattr(cli_plan_rank, "PLAN_RANK_SECONDS", 1e-3)
    _, _, spent = _plan("gpu_memory=57.5MiB")
    assert spent.rank_traces == 1 and spent.fastest_not_fitting.rank_traced and not spent.best.rank_traced
    assert any("time for tracing ranks (plan.rank_seconds) was spent" in note for note in spent.notes), spent.notes
    # none: the arithmetic's answer, the recipe
    _, _, off = _plan("gpu_memory=57.5MiB", "plan.rank_seconds=0")
    assert off.best.candidate == recipe and off.rank_traces == 0 and "plan.rank_seconds=0" in off.notes[0]
    with pytest.raises(ValueError, match="plan.rank_seconds must be a number of seconds >= 0"):
        _plan("gpu_memory=57.5MiB", "plan.rank_seconds=-1")


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rank_whose_probes_do_not_stitch_is_traced_whole_only_where_that_is_quick(monkeypatch) -> None:  # noqa: ANN001
    """Tiny GRADE over 2 ranks: its generation under FSDP2 is one model call whose logs the stitch cannot align, so the
    rank is traced whole; where that would take longer than RANK_WHOLE_TRACE_SECONDS (CRSP 7B: about 926 s predicted,
    764 s measured) the per-rank figures are the arithmetic's, with a note."""
    from lit_memopt import cli_estimate
    from lit_memopt.cli import compose_config

    args = ["recipe=grade", "module.max_new_tokens=4", "trainer=fsdp2", "trainer.devices=2", "trace_rank=true"]
    report = cli_estimate.estimate_recipe(compose_config(args))
    assert "traced as rank 0 of 2" in report.estimate.method and "full trace" in report.estimate.method
    assert any("traced all 4 blocks" in note for note in report.notes), report.notes
    assert report.rank_fallback is None
    monkeypatch.setattr(cli_estimate, "RANK_WHOLE_TRACE_SECONDS", 0.0)
    report = cli_estimate.estimate_recipe(compose_config(args))
    assert "traced as rank" not in report.estimate.method and "per rank of 2 (fsdp2)" in report.estimate.method
    assert "of a rank would take about" in report.rank_fallback and "trace_all_blocks=true" in report.rank_fallback
    assert report.rank_fallback in report.notes


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_plans_rank_that_would_take_too_long_keeps_the_arithmetic_with_a_note(monkeypatch) -> None:  # noqa: ANN001
    """Tiny GRADE over 2 ranks: its rank's probes do not stitch, so the rank is traced whole where the plan's time for
    ranks allows it, else the plan keeps the arithmetic and says why."""
    from lit_memopt import cli_plan_rank
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_plan import plan_recipe

    args = ["recipe=grade", "module.max_new_tokens=4", "trainer=fsdp2", "trainer.devices=2", "gpu_memory=1GiB",
            "plan.device=a100"]
    traced = plan_recipe(compose_config(args), args)
    assert traced.best.rank_traced and "full trace" in traced.best.estimate.method and not traced.notes
    monkeypatch.setattr(cli_plan_rank, "PLAN_RANK_SECONDS", 1e-3)
    kept = plan_recipe(compose_config(args), args)
    assert kept.best.candidate == traced.best.candidate and not kept.best.rank_traced and kept.rank_traces == 0
    assert len(kept.notes) == 1 and "of a rank would take about" in kept.notes[0], kept.notes


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_ranks_log_keeps_what_a_stretched_rollouts_probes_leave_behind() -> None:
    """FSDP2 gathers its root on the first model call and keeps it gathered. A rollout long enough to be stretched
    (memory.stretch) makes that first call in its probes, whose log entries are dropped: the gather must stay in the
    log, or the log's phase peaks fall short of the tracker's by the root's size (Qwen3-1.7B GRPO over 8 ranks: 593.5
    MiB, and its rank probes refused to stitch) and its reserved figure misses it (9.25 GiB replayed, 9.83 now)."""
    from lit_memopt.cli import compose_config
    from lit_memopt.cli_estimate import RecipeEstimator, recipe_batch
    from lit_memopt.cli_fake_run import build_fake_run
    from lit_memopt.memory.fake_ranks import estimate_rank
    from lit_memopt.memory.replay import SharedRegions
    from lit_memopt.memory.stitch import phase_peaks

    cfg = compose_config(["recipe=grpo", "module.max_new_tokens=16", "trainer=fsdp2", "trainer.devices=2"])
    estimator = RecipeEstimator(cfg, True, ("fsdp2", 2), trace_rank=True)
    assert estimator.worst_case_filler is not None  # (GRPO generates until end-of-sequence: its worst case is traced)

    def build(blocks, mesh):  # noqa: ANN001, ANN202
        return build_fake_run(cfg, blocks, estimator.checkpointing_callbacks, mesh=mesh).module

    regions = SharedRegions()
    est = estimate_rank(build, recipe_batch(estimator.run.datamodule), 2, keep_allocation_log=True,
                        worst_case_filler=estimator.worst_case_filler, shared_regions=regions)
    estimator.close()
    # the rollout's probes ran (and, FSDP2 having resized a storage in place, were not used: it was traced in full)
    assert any("(stretched)" in r for r in regions.refused), regions.refused
    logged = phase_peaks(est.allocation_log)
    assert {p: logged[p] for p in est.phase_peaks} == est.phase_peaks
