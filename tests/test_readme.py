"""The README's own-data example (a recipe on a checkpoint and data files, then a Hugging Face model out) runs as
written. Every other README example, and every page under docs/, is run or checked by tests/test_docs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
REPO = README.parent


def test_the_readme_is_an_entry_not_a_notebook() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "pip install" in text and "## Quick start" in text
    assert not re.search(r"\bstop \d+\b", text), "development-session references belong in docs/, not the README"


def test_own_data_commands_run_as_written(tmp_path: Path) -> None:
    """The "Your model, your data" block runs as written, in a scratch folder that sees the repository's tests/."""
    (block,) = re.findall(r"```bash own-data\n(.*?)```", README.read_text(), re.S)
    (tmp_path / "tests").symlink_to(REPO / "tests")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HF_DATASETS_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    assert "largest |logit difference| from the trained model 0" in result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"
    assert (tmp_path / "demo" / "exported" / "model.safetensors").is_file()
