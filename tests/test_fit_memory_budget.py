"""``lit-memopt fit ... memory_budget=SIZE``: training under the live-tensor-bytes simulator, on a CPU.

Run in this process (``cli.main``), not in a subprocess: each fit is a few seconds, an interpreter start
with Lightning and transformers is ten.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_memopt import cli

FAST = ["recipe=sft", "trainer.max_steps=3", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "trainer.enable_checkpointing=false", "logger=csv"]


def _fit(args: list[str], tmp_path: Path) -> int:
    try:
        return cli.main(["fit", *FAST, *args, f"hydra.run.dir={tmp_path / 'run'}"])
    except SystemExit as exc:  # Hydra ends a failed task with sys.exit
        return int(exc.code or 0)


def test_fit_under_a_budget_that_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _fit(["memory_budget=200MiB"], tmp_path) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("memory_budget:"))
    # the tiny SFT step peaks at about 144 MiB of live tensors (146.5 MiB estimated)
    assert "of 200.00 MiB" in line and "live tensor bytes" in line and line.endswith("errors: 0")


def test_fit_past_the_budget_raises_a_real_oom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # without OOMRecovery the simulated error ends the run as the type a GPU raises (Hydra prints it, exit 1)
    assert _fit(["memory_budget=60MiB", "~callbacks.oom_recovery"], tmp_path) == 1
    err = capsys.readouterr().err
    assert "torch.OutOfMemoryError: CUDA out of memory" in err and "simulated by lit_memopt.memory.memory_budget" in err


def test_oom_recovery_acts_on_the_simulated_oom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 16 rows do not fit in 120 MiB, 8 do: OOMRecovery halves the micro-batch and the run completes
    assert _fit(["memory_budget=120MiB"], tmp_path) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory_budget:"))
    assert not line.endswith("errors: 0"), line


@pytest.mark.parametrize(("value", "expected"), [
    ("lots", "memory_budget='lots' is not a memory size"),
    ("-5MiB", "memory_budget='-5MiB' is not a memory size"),
    ("1MiB", "memory_budget='1MiB' (1.00 MiB) is not more than the model's weights"),
])
def test_bad_budget_is_one_line(value: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _fit([f"memory_budget={value}"], tmp_path) == 2
    err = capsys.readouterr().err
    # (in-process, Lightning's log handler may still hold an earlier test's closed stream: "--- Logging error ---")
    errors = [x for x in err.splitlines() if x.startswith("lit-memopt: error:")]
    assert len(errors) == 1 and expected in errors[0], err
    assert "ValueError: memory_budget" not in err, err  # no traceback of the check
