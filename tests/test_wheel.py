"""A wheel built from the repository, installed in a fresh environment, runs a recipe from elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installs_and_runs_a_recipe(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("lit_memopt-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_memopt/_configs/conf/config.yaml" in names
    assert "lit_memopt/_configs/recipes/sft.yaml" in names

    # A fresh environment whose only link to this one is the third-party packages (torch, lightning, ...):
    # a .pth adds their folder to sys.path without running its .pth files, so the editable
    # lit_memopt of the development environment is invisible there.
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    fresh_python = env_dir / "bin" / "python"
    fresh_site = Path(subprocess.check_output(
        [str(fresh_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    deps = sysconfig.get_paths()["purelib"]
    (fresh_site / "deps.pth").write_text(deps + "\n")
    with zipfile.ZipFile(wheel) as zf:  # installing a wheel is unpacking it (pip is not in the fresh env)
        zf.extractall(fresh_site)
    script = env_dir / "bin" / "lit-memopt"
    script.write_text(f"#!{fresh_python}\nimport sys\nfrom lit_memopt.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(fresh_python), "-c", "import lit_memopt; print(lit_memopt.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert str(fresh_site) in where.stdout, where.stdout

    result = subprocess.run(
        [str(script), "fit", "recipe=sft", "trainer.max_steps=2", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list((elsewhere / "outputs" / "sft").rglob("last.ckpt")), "no checkpoint in the run directory"

    # The benchmarks stay in the repository: from a wheel the command says so in one line.
    bench = subprocess.run([str(script), "benchmark", "--list"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert bench.returncode == 2 and "source repository" in bench.stderr and "Traceback" not in bench.stderr
