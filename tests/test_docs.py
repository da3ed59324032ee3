"""The documentation: the site builds strictly, the API tables match the code, and every example in the README and in
``docs/`` runs.

Examples, by fence:
- ```` ```python ````: run as a script in a scratch folder; a last ``print(...)  # expected`` must print ``expected``.
- ```` ```bash ````: run as written (``bash -euo pipefail``) in a scratch folder that sees the repository's files. A
  block whose first line is ``# not run here: <why>`` says why it cannot run in a test (it installs packages, needs a
  GPU, a checkpoint of yours or several machines) and is checked statically only: its ``lit-memopt`` overrides must
  be valid and the repository paths it names must exist. When an estimate's printed output follows the block, the
  peak lines printed now must equal the documented ones.
- ```` ```bash own-data ```` (the README's third example) runs in ``tests/test_readme.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NOT_RUN = "# not run here:"
_FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks(path: Path) -> list[tuple[str, str, str, str]]:
    """(language, info after it, code, the next block's code or '') for every fenced block of a page."""
    found = [(m.group(1), m.group(2).strip(), m.group(3)) for m in _FENCE.finditer(path.read_text())]
    return [(lang, info, code, found[i + 1][2] if i + 1 < len(found) else "") for i, (lang, info, code)
            in enumerate(found)]


def _examples(language: str) -> list:
    params = []
    for path in DOC_FILES:
        numbered = [b for b in _blocks(path) if b[0] == language and not b[1]]
        for index, (_, _, code, following) in enumerate(numbered, 1):
            name = f"{path.relative_to(REPO)}:{index}"
            params.append(pytest.param(code, following, id=name))
    return params


def _env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                PYTHONUNBUFFERED="1")


def _scratch(tmp_path: Path) -> Path:
    """A folder that sees the repository's files (links) but keeps what a run writes to itself."""
    for entry in REPO.iterdir():
        if entry.name not in {".git", ".venv", "outputs", "multirun", "site", "demo"}:
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


# ---------------------------------------------------------------------- the site
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=dict(_env(), NO_MKDOCS_2_WARNING="1"))
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "reference" / "ops" / "index.html").read_text()
    assert "linear_logprobs" in api and "ignore_index" in api, "the API page should hold the docstrings"


def test_the_api_tables_match_the_signatures() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import api_tables
    finally:
        sys.path.remove(str(REPO / "scripts"))
    for page in api_tables.TABLES:
        assert (REPO / "docs" / page).read_text() == api_tables.render(page), (
            f"docs/{page}'s API table differs from the code: run `python scripts/api_tables.py`")


def test_every_page_is_in_the_navigation() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert sorted(p for p in pages if f": {p}" not in nav) == []


# ---------------------------------------------------------------------- examples that run
def _expected_output(code: str) -> str | None:
    prints = re.findall(r"^print\(.*\)\s+#\s*(.+)$", code, re.M)
    return prints[-1].split("  ")[0].strip() if prints else None


@pytest.mark.slow
@pytest.mark.parametrize(("code", "following"), _examples("python"))
def test_python_example_runs(code: str, following: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=400,
                            env=dict(_env(), OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-4000:]
    expected = _expected_output(code)
    if expected is not None:
        assert result.stdout.strip().splitlines()[-1] == expected


def _peak_lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if "peak (allocated)" in line or "reserved by" in line]


@pytest.mark.slow
@pytest.mark.parametrize(("code", "following"), _examples("bash"))
def test_shell_example_runs(code: str, following: str, tmp_path: Path) -> None:
    if any(line.startswith(NOT_RUN) for line in code.splitlines()[:2]):  # after a shebang too
        reason = next(line for line in code.splitlines()[:2] if line.startswith(NOT_RUN))[len(NOT_RUN):].strip()
        assert len(reason) > 10, "say why the block cannot run in a test"
        return  # checked by the static tests below
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=_scratch(tmp_path), env=_env(),
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    documented = _peak_lines(following)
    if documented:
        assert _peak_lines(result.stdout) == documented


# ---------------------------------------------------------------------- static checks of every page
_REPO_DIRS = ("scripts/", "tests/", "benchmarks/", "conf/", "recipes/", "lit_memopt/", "docs/", ".ci/")


def _commands(block: str) -> list[str]:
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.split("  #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        current += line.rstrip("\\").strip() + " " if line else ""
        if line and not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return lines


@pytest.mark.parametrize("page", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_a_page_names_exists(page: Path) -> None:
    missing = []
    for token in re.findall(r"[\w./*<>{}-]+", page.read_text()):  # with the glob and placeholder characters
        token = token.rstrip(".")
        if token.startswith(_REPO_DIRS) and not any(c in token for c in "<>*{}") and not (REPO / token).exists():
            missing.append(token)
    assert missing == []


def test_every_lit_memopt_command_has_valid_overrides() -> None:
    from lit_memopt.cli import check_overrides

    checked = 0
    for page in DOC_FILES:
        for lang, _info, code, _ in _blocks(page):
            if lang != "bash":
                continue
            for command in _commands(code):
                match = re.search(r"lit[-_]memopt (fit|estimate|validate) (.*)", command)
                if not match or any(placeholder in command for placeholder in ("...", "$", "<")):
                    continue
                args = [a for a in shlex.split(match.group(2)) if "=" in a and not a.startswith("-")]
                check_overrides(args)  # raises UsageError on an unknown recipe, group option or key
                checked += 1
    assert checked >= 15


def test_the_several_machines_command_is_the_one_the_test_runs() -> None:
    from test_multinode import NODES

    block = next(code for lang, _, code, _ in _blocks(REPO / "docs" / "distributed.md")
                 if lang == "bash" and "torchrun --nnodes=2" in code)
    command = " ".join(_commands(block))
    shown = {"trainer.devices=1", "trainer.num_nodes=2", "trainer.accelerator=cpu", "checkpoint.every_n_steps=2"}
    assert shown <= set(NODES) and all(arg in command.split() for arg in shown)
    assert "resume=auto" in command and "trainer=fsdp2" in command
