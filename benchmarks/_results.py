"""Where the benchmark cases write their results, and how."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_results(stem: str, result: dict[str, Any], markdown: str) -> list[str]:
    """Write ``results/<stem>.json`` (``result``; values JSON cannot hold as ``str``) and
    ``results/<stem>.md`` (``markdown``); return both paths, markdown first."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md_path, json_path = RESULTS_DIR / f"{stem}.md", RESULTS_DIR / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md_path.write_text(markdown)
    return [str(md_path), str(json_path)]
