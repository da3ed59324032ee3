"""The README's runnable examples run and print what the README says they print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_oom_recovery_example_recovers_as_documented(tmp_path: Path) -> None:
    block = next(b for b in _python_blocks() if "OOMRecovery(grow_after_steps" in b)
    expected = re.search(r"print\(recovery\.micro_batch_size, recovery\.oom_events\)\s*#\s*(\d+) (\d+)", block)
    assert expected, "the example should document what it prints"
    script = tmp_path / "example.py"
    script.write_text(block)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"{expected.group(1)} {expected.group(2)}"


# ---------------------------------------------------------------------- commands and paths
REPO = README.parent
_REPO_DIRS = ("scripts/", "tests/", "benchmarks/", "conf/", "recipes/", "lit_memopt/", "docs/", ".ci/")


def _bash_blocks(marker: str = "") -> list[str]:
    return re.findall(r"```bash" + re.escape(marker) + r"[^\n]*\n(.*?)```", README.read_text(), re.S)


def _commands(block: str) -> list[str]:
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.split("  #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        current += line.rstrip("\\").strip() + " " if line else ""
        if line and not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return lines


def test_every_repository_path_the_readme_names_exists() -> None:
    missing = []
    for token in re.findall(r"[\w./-]+", README.read_text()):
        token = token.rstrip(".")
        if token.startswith(_REPO_DIRS) and not any(c in token for c in "<>*{}") and not (REPO / token).exists():
            missing.append(token)
    assert missing == []


def test_every_readme_lit_memopt_command_has_valid_overrides() -> None:
    import shlex

    from lit_memopt.cli import check_overrides

    checked = 0
    for block in _bash_blocks():
        for command in _commands(block):
            match = re.search(r"lit[-_]memopt (fit|estimate|validate) (.*)", command)
            if not match or any(placeholder in command for placeholder in ("...", "$", "<")):
                continue
            args = [a for a in shlex.split(match.group(2)) if "=" in a and not a.startswith("-")]
            check_overrides(args)  # raises UsageError on an unknown recipe, group option or key
            checked += 1
    assert checked >= 10


def test_runnable_shell_blocks_run(tmp_path: Path) -> None:
    """Blocks fenced as ```bash runnable run as written (from the repository root, the venv first on PATH)."""
    import os

    blocks = _bash_blocks(" runnable")
    assert blocks, "the README marks its cheap shell examples as runnable"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for block in blocks:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=240)
        assert result.returncode == 0, (block, result.stdout[-2000:], result.stderr[-2000:])


def test_own_data_commands_run_as_written(tmp_path: Path) -> None:
    """The "Your model, your data" block runs as written, in a scratch folder that sees the repository's tests/."""
    import os

    (block,) = _bash_blocks(" own-data")
    (tmp_path / "tests").symlink_to(REPO / "tests")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               HF_DATASETS_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    assert "largest |logit difference| from the trained model 0" in result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"
    assert (tmp_path / "demo" / "exported" / "model.safetensors").is_file()
