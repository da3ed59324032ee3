"""A newcomer's first run: no warning caused by the pack, and a progress bar that makes sense for max_steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import run_cli


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_step_sft_run_prints_no_pack_warning_and_a_sane_progress_bar(tmp_path: Path) -> None:
    result = run_cli(["fit", "recipe=sft", "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                     env={"COLUMNS": "120"})
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Epoch 0 · max_steps 3" in output and "/-2" not in output
    # Warnings raised by our code name a lit_memopt file; the LR scheduler's warning is the one an
    # optimizer.step patch would cause.
    pack_warnings = [line for line in output.splitlines() if "Warning" in line and "lit_memopt" in line]
    assert pack_warnings == [], pack_warnings
    assert "overridden after learning rate scheduler" not in output
    assert "steps: 3" in output


def test_threads_auto_uses_one_thread_for_small_models_on_cpu() -> None:
    import torch

    from lit_memopt.cli import SMALL_MODEL_PARAMETERS, UsageError, compose_config, set_cpu_threads

    before = torch.get_num_threads()
    small, large = torch.nn.Linear(4, 4), torch.nn.Module()
    large.register_parameter("w", torch.nn.Parameter(torch.empty(SMALL_MODEL_PARAMETERS, device="meta")))
    try:
        torch.set_num_threads(2)
        cpu = compose_config(["recipe=sft", "trainer.accelerator=cpu"])
        assert set_cpu_threads(cpu, small) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert set_cpu_threads(cpu, large) is None and torch.get_num_threads() == 2
        assert set_cpu_threads(compose_config(["recipe=sft", "trainer.accelerator=cpu", "threads=2"]), small) == 2
        assert set_cpu_threads(compose_config(["recipe=sft", "trainer.accelerator=cpu", "threads=null"]), small) is None
        with pytest.raises(UsageError, match="threads must be auto, null or an int >= 1"):
            set_cpu_threads(compose_config(["recipe=sft", "trainer.accelerator=cpu", "threads=0"]), small)
    finally:
        torch.set_num_threads(before)
