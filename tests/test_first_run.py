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
