"""Shared pytest set-up: quiet, deterministic, CPU-friendly."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
