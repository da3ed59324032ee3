"""Version-dependent code is gated on declared versions (``RequirementCache``), and what CI runs is what
pyproject.toml declares."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import torch
from lightning_utilities.core.imports import RequirementCache
from packaging.requirements import Requirement

from lit_memopt.models import ModelConfig
from lit_memopt.models import hf

REPO = Path(__file__).resolve().parent.parent
ARCH = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def test_the_installed_torch_and_lightning_are_in_the_declared_range() -> None:
    declared = {Requirement(r).name: Requirement(r) for r in
                tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    for name in ("torch", "lightning"):
        installed = importlib.metadata.version(name)
        assert declared[name].specifier.contains(installed.split("+")[0]), (name, installed, str(declared[name]))


def test_the_dtype_argument_follows_the_installed_transformers() -> None:
    expected = "dtype" if RequirementCache("transformers>=4.56") else "torch_dtype"
    assert hf.TRANSFORMERS_DTYPE_ARG == expected
    assert ModelConfig(arch=ARCH, dtype="bfloat16").load_kwargs()[expected] is torch.bfloat16


@pytest.mark.parametrize("source", ["config", "checkpoint"])
def test_the_model_is_built_in_the_configured_dtype(source: str, tmp_path: Path) -> None:
    """The gated keyword reaches transformers and sets the weights' dtype, from a config and from a checkpoint."""
    config = ModelConfig(arch=ARCH, dtype="bfloat16")
    if source == "checkpoint":
        ModelConfig(arch=ARCH).build_model().save_pretrained(tmp_path)
        config = ModelConfig(pretrained=str(tmp_path), dtype="bfloat16")
    model = config.build_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
