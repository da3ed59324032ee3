"""Where the benchmark cases write their results, and how."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def gpu_stem(gpu_name: str) -> str:
    """A GPU's name as it appears in result file names: ``NVIDIA H200`` -> ``nvidia_h200``."""
    return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_")


def write_results(stem: str, result: dict[str, Any], markdown: str) -> list[str]:
    """Write ``results/<stem>.json`` (``result``; values JSON cannot hold as ``str``) and
    ``results/<stem>.md`` (``markdown``); return both paths, markdown first."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md_path, json_path = RESULTS_DIR / f"{stem}.md", RESULTS_DIR / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md_path.write_text(markdown)
    return [str(md_path), str(json_path)]


def quick_command(argv: Optional[list[str]], doc: str, run: Callable[..., dict[str, Any]],
                  to_markdown: Callable[[dict[str, Any]], str], quick_help: str,
                  passed: Optional[Callable[[dict[str, Any]], bool]] = None) -> int:
    """The command line of a benchmark case run alone (``python benchmarks/<case>.py [--quick]``):
    run it, print its markdown report; exit 1 when ``passed`` says its target was missed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    print(to_markdown(result))
    return 0 if passed is None or passed(result) else 1
