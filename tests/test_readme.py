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
