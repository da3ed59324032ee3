"""The ``lit-memopt`` command: help, clear one-line errors, a real short fit and validate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_memopt import cli

REPO = Path(__file__).resolve().parent.parent


def run_cli(args: list[str], cwd: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    base = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "lit_memopt", *args], cwd=cwd, env=base, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_commands_recipes_and_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("fit", "validate", "estimate", "benchmark", "sft", "tiny_qwen3", "qwen3_4b", "ddp", "tensorboard"):
        assert word in out


@pytest.mark.parametrize(
    "args,expected",
    [
        (["fit", "recipe=nope"], "unknown recipe 'nope'"),
        (["fit", "model=qwen3_5b"], "did you mean 'qwen3_4b'"),
        (["fit", "trainer=tpu9"], "choose one of: "),
        (["fit", "trainer.max_stepz=3"], "did you mean 'max_steps'"),
        (["fit", "data.seq_lenn=3"], "unknown key 'data.seq_lenn'"),
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["fit", "model.lora.r=3"], ""),  # lora is null: adding a sub-key needs '+'; must still be one line
    ],
)
def test_bad_overrides_fail_in_one_line(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lit-memopt: error:"), err
    assert len(err.splitlines()) == 1, err
    assert expected in err
    assert "Traceback" not in err


def test_bad_value_fails_before_training(tmp_path: Path) -> None:
    result = run_cli(["fit", "recipe=sft", "model.dtype=float8", "hydra.run.dir=" + str(tmp_path / "run")], tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model.dtype='float8' is not supported" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_checkpoint_is_named(tmp_path: Path) -> None:
    result = run_cli(["validate", "recipe=sft", "ckpt_path=/nonexistent/x.ckpt", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path, timeout=120)
    assert result.returncode == 2
    assert "ckpt_path='/nonexistent/x.ckpt' is not a file" in result.stderr


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    # an override after a Hydra flag too (Hydra's own parser stops at the flag; the CLI puts flags first)
    result = run_cli(["fit", "recipe=sft", "--cfg", "job", "model=qwen3_4b"], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hidden_size: 2560" in result.stdout and "SFTModule" in result.stdout


def test_fit_then_validate_sft(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        ["fit", "recipe=sft", "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.log_every_n_steps=1",
         "trainer.enable_progress_bar=false",
         f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run directory:" in result.stdout and "checkpoint:" in result.stdout
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file()
    metrics = next(run_dir.rglob("metrics.csv")).read_text()
    assert "train/loss" in metrics and "val/loss" in metrics
    assert (run_dir / ".hydra" / "config.yaml").is_file()

    result = run_cli(
        ["validate", "recipe=sft", f"ckpt_path={last}", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'val'}"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val/loss" in result.stdout


def test_multirun_sweeps(tmp_path: Path) -> None:
    result = run_cli(
        ["fit", "-m", "recipe=sft", "module.lr=1e-3,2e-3", "trainer.max_steps=1", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "sweep" / "0").is_dir() and (tmp_path / "sweep" / "1").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_two_cpu_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "ddp"
    result = run_cli(
        ["fit", "recipe=sft", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.max_steps=3",
         "trainer.val_check_interval=3", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"],
        tmp_path,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "world_size: 2" in (result.stdout + result.stderr) or "GLOBAL_RANK: 1" in (result.stdout + result.stderr)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def test_a_multi_process_run_ends_its_process_group(tmp_path: Path) -> None:
    """After the last collective (a barrier first), the run's process group is destroyed rather than left to the
    interpreter's exit, where gloo's threads made a rank abort (``tests/test_multinode.py``, 2 runs in 7)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from lit_memopt.cli import _close_process_group

    barriers: list[str] = []
    trainer = SimpleNamespace(strategy=SimpleNamespace(barrier=barriers.append))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        _close_process_group(trainer)
        assert barriers == ["lit-memopt.end"] and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _close_process_group(trainer)  # a one-process run has no group: nothing to wait for
    assert barriers == ["lit-memopt.end"]


def test_compose_config_inside_a_running_command_leaves_its_hydra_in_place(tmp_path) -> None:  # noqa: ANN001
    """``plan`` composes the config of each plan it checks while its own Hydra run is live: the run's global Hydra
    state must outlive that compose (it used to be cleared)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lit_memopt.cli import compose_config

    (tmp_path / "outer.yaml").write_text("outer: 1\n", encoding="utf-8")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        before = GlobalHydra.instance().hydra
        assert compose_config(["recipe=sft"]).recipe_name == "sft"
        assert GlobalHydra.instance().is_initialized()
        # the outer run's config source, not the pack's: its own config still composes
        from hydra import compose

        assert compose(config_name="outer").outer == 1 and GlobalHydra.instance().hydra is not None
        assert type(GlobalHydra.instance().hydra) is type(before)
    assert not GlobalHydra.instance().is_initialized()
