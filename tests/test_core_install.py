"""The core install (``pip install lit-memopt``) is torch and Lightning: ops, memory and callbacks work in a fresh
environment without any extra, and each recipe package says in one line which extra to install.

The fresh environment borrows the development environment's torch (a folder of links on its path, so that nothing
ever downloads a CUDA build) and installs the rest as a user would: pip, the wheel, its declared dependencies, with
Lightning at the floor of its declared range (from PyPI: these tests are marked slow).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from lit_memopt._extras import EXTRAS, MissingExtraError, require_extra

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
RECIPE_PACKAGES = ("lit_memopt.modules", "lit_memopt.models", "lit_memopt.data", "lit_memopt.rewards")
# What the core install must not pull: every extra's packages (tensorboard is an extra of its own), less what
# Lightning itself requires (torchmetrics, which the recipes also import).
LIGHTNING_REQUIRES = {Requirement(r).name.lower() for r in importlib.metadata.requires("lightning") or []
                      if Requirement(r).marker is None}
NOT_IN_CORE = sorted(({dist for packages in EXTRAS.values() for dist in packages} | {"tensorboard"}) - LIGHTNING_REQUIRES)


def _name(requirement: str) -> str:
    return Requirement(requirement).name.lower()


def _extra_distributions(extra: str) -> set[str]:
    """The distributions ``pip install 'lit-memopt[extra]'`` adds, the extra's references to other extras followed."""
    found: set[str] = set()
    for entry in PROJECT["optional-dependencies"][extra]:
        requirement = Requirement(entry)
        if requirement.name == PROJECT["name"]:
            for referenced in requirement.extras:
                found |= _extra_distributions(referenced)
        else:
            found.add(requirement.name.lower())
    return found


def _floor(distribution: str) -> str:
    """The lowest version the core dependencies allow for ``distribution`` (its ``>=`` bound)."""
    requirement = next(Requirement(r) for r in PROJECT["dependencies"] if _name(r) == distribution)
    return next(spec.version for spec in requirement.specifier if spec.operator == ">=")


# ----------------------------------------------------------------------------- declared (fast)
def test_core_dependencies_are_torch_lightning_and_what_the_core_imports() -> None:
    assert sorted(_name(r) for r in PROJECT["dependencies"]) == ["lightning", "numpy", "psutil", "torch"]
    torch_range = next(Requirement(r) for r in PROJECT["dependencies"] if _name(r) == "torch").specifier
    assert torch.__version__ in torch_range, f"the torch under test ({torch.__version__}) is outside {torch_range}"
    lightning_range = next(Requirement(r) for r in PROJECT["dependencies"] if _name(r) == "lightning").specifier
    assert importlib.metadata.version("lightning") in lightning_range


def test_extras_table_matches_pyproject() -> None:
    """``_extras.EXTRAS`` checks what each extra installs: the hint it prints fixes the error, and no package is missed."""
    for extra, packages in EXTRAS.items():
        referenced = {e for r in PROJECT["optional-dependencies"][extra] if Requirement(r).name == PROJECT["name"]
                      for e in Requirement(r).extras}
        via_other_extras = {dist for e in referenced if e in EXTRAS for dist in EXTRAS[e]}
        assert set(packages) | via_other_extras == _extra_distributions(extra), extra
    assert _extra_distributions("data") <= _extra_distributions("recipes")  # `data` is an alias within `recipes`
    for extra in ("recipes", "sandbox", "plot"):
        assert _extra_distributions(extra) <= _extra_distributions("test"), f"the tests need the {extra!r} extra"


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("hydra", "peft") else real(name, *a))
    with pytest.raises(ImportError) as info:
        require_extra("recipes", "lit_memopt.modules")
    assert isinstance(info.value, MissingExtraError) and info.value.name == "hydra"
    assert str(info.value) == ("lit_memopt.modules needs the 'recipes' extra (missing: hydra-core, peft): "
                               "pip install 'lit-memopt[recipes]'")
    require_extra("plot", "lit_memopt.callbacks.memory_monitor")  # installed: nothing happens


def test_the_command_without_hydra_prints_one_line(tmp_path: Path) -> None:
    # hydra hidden (a None entry in sys.modules makes it unimportable), then the console script's own two lines.
    code = "import sys; sys.modules['hydra'] = None; from lit_memopt.cli import console_main; console_main()"
    env = {k: v for k, v in os.environ.items() if k != "LIT_MEMOPT_DEBUG"}
    result = subprocess.run([sys.executable, "-c", code, "fit", "recipe=sft"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == ("ImportError: lit_memopt.cli needs the 'recipes' extra (missing: hydra-core): "
                             "pip install 'lit-memopt[recipes]'\n")


# ----------------------------------------------------------------------------- a fresh core install (slow)
@dataclass
class CoreEnv:
    python: Path
    bin: Path
    site: Path
    cwd: Path
    env: dict[str, str]
    install_s: float

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)


def _borrow_torch(folder: Path) -> None:
    """Links to the installed torch (its packages and metadata, not its dependencies) in ``folder``."""
    torch_dist = importlib.metadata.distribution("torch")
    folder.mkdir()
    site = Path(torch_dist.locate_file(""))
    for top in sorted({f.parts[0] for f in torch_dist.files or [] if f.parts[0] != ".."}):
        if (site / top).exists():
            (folder / top).symlink_to(site / top)


@pytest.fixture(scope="module")
def core_env(tmp_path_factory: pytest.TempPathFactory) -> CoreEnv:
    started = time.perf_counter()
    root = tmp_path_factory.mktemp("core_install")
    # An sdist, then the wheel built from that sdist (build's default): the wheel users install is what the sdist holds.
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(root / "dist"),
                            str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((root / "dist").glob("lit_memopt-*.whl"))
    with tarfile.open(next((root / "dist").glob("lit_memopt-*.tar.gz"))) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "mkdocs.yml", "docs/index.md", "conf/config.yaml"} <= names

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    _borrow_torch(root / "torch")
    (site / "borrowed_torch.pth").write_text(f"{root / 'torch'}\n")
    # torch pinned to the borrowed build: pip keeps it, or fails (never downloads) if the declared range excludes it.
    (root / "constraints.txt").write_text(f"torch=={torch.__version__}\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--disable-pip-version-check",
         "--constraint", str(root / "constraints.txt"), f"lightning=={_floor('lightning')}", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    elsewhere = root / "elsewhere"  # not the repository: its lit_memopt must not shadow the installed one
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LIT_MEMOPT_DEBUG")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return CoreEnv(python, venv / "bin", site, elsewhere, env, time.perf_counter() - started)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_core_install_pulls_torch_and_lightning_only(core_env: CoreEnv) -> None:
    listing = core_env.run(core_env.python, "-c", textwrap.dedent("""
        import importlib.metadata as m, lit_memopt
        print(lit_memopt.__file__)
        for d in sorted(m.distributions(), key=lambda d: d.metadata["Name"].lower()):
            print(d.metadata["Name"].lower().replace("_", "-"), d.version)
    """))
    assert listing.returncode == 0, listing.stderr
    where, *lines = listing.stdout.splitlines()
    assert where.startswith(str(core_env.site)), where
    installed = dict(line.split() for line in lines)
    assert installed["lit-memopt"] == PROJECT["version"]
    assert installed["torch"] == torch.__version__
    assert Version(installed["lightning"]) == Version(_floor("lightning"))  # the floor of the declared range
    pulled = sorted(set(installed) & set(NOT_IN_CORE))
    assert pulled == [], f"the core install pulled {pulled}; installed: {installed}"
    for module in sorted({m for packages in EXTRAS.values() for d, m in packages.items() if d in NOT_IN_CORE}):
        assert core_env.run(core_env.python, "-c", f"import {module}").returncode != 0, f"{module} is importable"


# A tiny language model whose head is linear_logprobs, fitted with OOMRecovery: the micro-batch halves on a real
# OOM (memory_budget) until it fits, and the weights end equal to those of a run without OOMs.
FIT_WITH_OOM_RECOVERY = """
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lit_memopt.callbacks import OOMRecovery
from lit_memopt.memory import memory_budget
from lit_memopt.ops import linear_logprobs

class TinyLM(LightningModule):
    def __init__(self, fits=None):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 11, bias=False)
        self.fits = fits

    def training_step(self, batch, batch_idx):
        x, targets = batch
        if self.fits is not None and x.shape[0] > self.fits:
            with memory_budget(0):
                self.body(x)
        loss = -linear_logprobs(self.body(x), self.head.weight, targets).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 11, (32,), generator=g))

def fit(module, callbacks):
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, DataLoader(data, batch_size=8))
    return trainer

reference = TinyLM()
fit(reference, [])
module, recovery = TinyLM(fits=2), OOMRecovery(grow_after_steps=None)
trainer = fit(module, [recovery])
assert trainer.global_step == 4, trainer.global_step
assert [h["to"] for h in recovery.history] == [4, 2], recovery.history
for (name, a), b in zip(reference.named_parameters(), module.parameters()):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
print("fit ok")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_callbacks_and_ops_fit_in_the_core_install(core_env: CoreEnv) -> None:
    imports = core_env.run(core_env.python, "-c", "from lit_memopt.callbacks import OOMRecovery; "
                                                  "from lit_memopt.ops import linear_logprobs")
    assert imports.returncode == 0, imports.stderr
    every_name = core_env.run(core_env.python, "-c", "import importlib\nfor p in ('ops', 'memory', 'callbacks'):\n"
                              "    m = importlib.import_module('lit_memopt.' + p)\n    [getattr(m, n) for n in m.__all__]")
    assert every_name.returncode == 0, every_name.stderr
    fit = core_env.run(core_env.python, "-c", FIT_WITH_OOM_RECOVERY, timeout=240)
    assert fit.returncode == 0 and "fit ok" in fit.stdout, fit.stdout[-3000:] + fit.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recipe_packages_and_the_command_name_the_extra(core_env: CoreEnv) -> None:
    for package in RECIPE_PACKAGES:
        result = core_env.run(core_env.python, "-c", f"import {package}")
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 1 and "MissingExtraError" in last, result.stderr[-2000:]
        assert f"{package} needs the 'recipes' extra (missing: hydra-core" in last, last
        assert last.endswith("pip install 'lit-memopt[recipes]'"), last
    command = core_env.run(core_env.bin / "lit-memopt", "fit", "recipe=sft")
    assert command.returncode == 1
    assert command.stderr.startswith("ImportError: lit_memopt.cli needs the 'recipes' extra (missing: hydra-core")
    assert command.stderr.count("\n") == 1 and command.stderr.endswith("pip install 'lit-memopt[recipes]'\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_memory_monitor_report_in_the_core_install(core_env: CoreEnv) -> None:
    code = FIT_WITH_OOM_RECOVERY.replace("fit(module, [recovery])", "fit(module, [recovery, MemoryMonitor()])").replace(
        "from lit_memopt.callbacks import OOMRecovery", "from lit_memopt.callbacks import MemoryMonitor, OOMRecovery")
    fit = core_env.run(core_env.python, "-c", code, timeout=240)
    assert fit.returncode == 0 and "fit ok" in fit.stdout, fit.stderr[-3000:]
    # the report is a plain-text table and JSON without rich and matplotlib, and says why there is no plot
    assert "Memory summary (" in fit.stdout + fit.stderr and "OOM events" in fit.stdout + fit.stderr
    assert "pip install 'lit-memopt[plot]'" in fit.stderr
