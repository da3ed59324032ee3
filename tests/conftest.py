"""Shared pytest set-up: quiet, deterministic, CPU-friendly."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process: the tests run tiny shapes, spawn DDP workers and subprocesses,
# and two spinning OpenMP threads per process on a 2-core machine cost far more than they give.
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test starts on one intra-op thread, whatever an earlier test (or a benchmark it ran)
    set: tiny models are dominated by per-op overhead, and threads spinning on a shared CPU make
    generation loops several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip themselves where no CUDA device is present (run them with ``-m cuda`` on a GPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def user_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A user's local checkpoint: a tiny Qwen3 and a trained BPE tokenizer with a chat template (tests/_user_assets.py)."""
    from _user_assets import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("user") / "tiny-qwen3")
