"""The held-out metric with its standard error: the textbook formula, any split of the updates, the summary line."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lit_memopt._run_summary import print_summary
from lit_memopt.modules.heldout import MeanAndStderr

from _ranks import free_port, run_ranks


def test_mean_and_stderr_match_the_formula_whatever_the_batches() -> None:
    values = [1.0, 0.0, 0.5, 0.25, 1.0, 0.0, 0.75]
    metric = MeanAndStderr()
    metric.update(torch.tensor(values[:3]))
    metric.update(torch.tensor(values[3:4]))
    metric.update(torch.tensor(values[4:]))
    mean, stderr = metric.compute()
    assert mean.item() == pytest.approx(statistics.fmean(values), abs=1e-6)
    assert stderr.item() == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)), abs=1e-6)

    metric.reset()
    assert not metric.updated
    metric.update(torch.tensor([]))  # an empty batch adds nothing
    assert not metric.updated
    metric.update(torch.tensor([[0.3]]))
    mean, stderr = metric.compute()
    assert mean.item() == pytest.approx(0.3) and stderr.item() == 0.0  # one unit: no spread to measure


def test_summary_prints_the_error_with_its_metric(capsys) -> None:
    result = {"command": "fit", "module": "M", "run_dir": "r", "logs": None, "checkpoint": None, "global_step": 3,
              "seconds": 1.0, "final_metrics": {},
              "metrics": {"val/solve_rate": {"start": 0.25, "end": 0.5, "steps": 2},
                          "val/solve_rate_stderr": {"start": 0.0625, "end": 0.125, "steps": 2},
                          "train/kl": {"start": 0.0, "end": 0.1, "steps": 3}}}
    print_summary(result)
    out = capsys.readouterr().out
    assert "0.2500 ± 0.0625" in out and "0.5000 ± 0.1250" in out
    assert "val/solve_rate_stderr" not in out and "train/kl" in out


RANK_VALUES = ([1.0, 0.0, 1.0], [0.0, 0.5])  # uneven: a padded last batch gives one rank fewer units


def _worker(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    metric = MeanAndStderr()
    metric.update(torch.tensor(RANK_VALUES[rank]))
    mean, stderr = metric.compute()
    torch.save({"mean": mean, "stderr": stderr}, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_report_the_mean_and_error_of_all_units(tmp_path) -> None:
    failure = run_ranks(_worker, (free_port(), str(tmp_path)), nprocs=2, timeout_s=100)
    assert failure is None, failure
    values = [v for part in RANK_VALUES for v in part]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["mean"].item() == pytest.approx(statistics.fmean(values), abs=1e-6)
        assert got["stderr"].item() == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)), abs=1e-6)
