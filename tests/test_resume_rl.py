"""Exact resume of the RL recipes (``grpo``, ``grade``, ``ttt``): a run killed with SIGKILL after a checkpoint and
resumed ends with the very weights of the run that was never stopped (float32, CPU, largest difference <= 1e-6).

What has to come back for that (docs/preemption.md): the data position (each recipe's loader is a
``ResumableDataLoader``), the global generators (``RandomState``), the optimizer and the loops; the rollouts and the
Gumbel noise derive their seeds from (seed, rank, step, sample) and need nothing saved. For ``grpo`` the warm-started
policy and its frozen reference come from the checkpoint: the resumed run must not warm-start again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _resume import assert_same_weights, kill_after, largest_difference, run, weights

COMMON = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "trainer.log_every_n_steps=1",
          "checkpoint.keep_last=null"]  # every checkpoint stays: the test compares the first with the last

# recipe -> (overrides, checkpoint interval, max steps). Tiny runs; each recipe's held-out validation before the first
# step (validate_first) stays on, cut to one or two batches.
RUNS = {
    # The warm start (cached in a file the runs share: the uninterrupted run fits it, the killed run loads it) must
    # make some sampled answers right and some wrong, so that groups have mixed rewards and the weights move: with
    # every answer wrong (or right) every advantage is 0 and GRPO leaves the weights where they are, and equality
    # would prove nothing. The recipe's 5-letter copy/reverse needs hundreds of warm-start steps for that; copying
    # 3 letters is right about 60% of the time after 40 steps of 16 examples (measured).
    "grpo": (["module.warm_start.steps=40", "module.warm_start.batch_size=16", "data.task=copy",
              "data.min_word_length=3", "data.max_word_length=3", "data.num_val=8", "resume=auto"], 4, 8),
    "grade": (["trainer.limit_val_batches=1"], 4, 8),
    # ~45 ms a step: 30 steps after the first checkpoint leave time to kill the run before it ends
    "ttt": (["trainer.limit_val_batches=1"], 10, 40),
}


def _args(recipe: str, run_dir: Path, warm_start: Path) -> list[str]:
    overrides, every, steps = RUNS[recipe]
    args = [f"recipe={recipe}", f"trainer.max_steps={steps}", f"checkpoint.every_n_steps={every}", *COMMON, *overrides]
    if recipe == "grpo":
        args.append(f"module.warm_start.path={warm_start}")
    return ["fit", *args, f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warm") / "warm_start.pt"


@pytest.fixture(scope="module", params=list(RUNS))
def uninterrupted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  warm_start: Path) -> tuple[str, Path]:
    """The reference of each recipe: the same run, never stopped."""
    recipe = request.param
    folder = tmp_path_factory.mktemp(f"uninterrupted_{recipe}")
    run(_args(recipe, folder / "run", warm_start), folder, timeout_s=300, one_core=recipe == "grpo")
    return recipe, folder / "run"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_then_resume_gives_the_uninterrupted_weights(uninterrupted: tuple[str, Path], tmp_path: Path,
                                                            warm_start: Path) -> None:
    recipe, reference = uninterrupted
    _, every, steps = RUNS[recipe]
    first, last = f"step_{every:06d}.ckpt", f"step_{steps:06d}.ckpt"
    # Equality is only worth something if the weights moved after the checkpoint the run resumes from (by more than
    # ten times the tolerance of the comparison).
    moved = largest_difference(reference / "checkpoints" / first, reference / "checkpoints" / last)
    assert moved > 1e-5, f"{recipe}: the weights barely moved from step {every} to step {steps} ({moved:g})"
    if recipe in ("grpo", "grade"):  # the frozen reference is in the checkpoint: the resumed run gets the same one
        assert any(name.startswith("reference.") for name in weights(reference / "checkpoints" / first))

    run_dir = tmp_path / "run"
    args = _args(recipe, run_dir, warm_start)
    cached = warm_start.stat().st_mtime_ns if recipe == "grpo" else None
    kill_after(args, tmp_path, run_dir / "checkpoints" / first, timeout_s=240, one_core=recipe == "grpo")
    assert not (run_dir / "checkpoints" / last).exists(), "the run finished before the kill"
    if recipe == "grpo":
        # the killed run started fresh: it loaded the warm start the uninterrupted run cached (same weights)
        assert "warm start: loaded" in (tmp_path / "killed.log").read_text()

    resume = [] if recipe == "grpo" else ["ckpt_path=last"]  # grpo relaunches the same command (resume=auto)
    output = run([*args, *resume], tmp_path, timeout_s=300, one_core=recipe == "grpo")
    assert "Restored all states" in output
    assert_same_weights(run_dir / "checkpoints" / last, reference / "checkpoints" / last)
    assert "dataloader is not resumable" not in output  # every recipe's loader goes on mid-epoch
    if recipe == "grpo":
        assert "resume=auto: resuming from" in output
        # The policy and its reference come from the checkpoint: the resumed run skips the warm start altogether
        # (the CLI sets trainer.ckpt_path before fit, so the module's setup sees it), and leaves the cache as it was.
        assert "warm start" not in output and warm_start.stat().st_mtime_ns == cached
