"""Write the public API tables of docs/ops.md and docs/callbacks.md from the live signatures.

Run ``python scripts/api_tables.py`` after changing a public signature; ``tests/test_docs.py`` fails while a
table differs from what this prints, so the docs cannot drift from the code.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
# page -> (package, the public names in the order a reader meets them)
TABLES = {
    "ops.md": ("lit_memopt.ops", ["linear_logprobs", "linear_entropy", "linear_logprobs_and_entropy",
                                  "linear_self_certainty", "linear_kl", "linear_cross_entropy", "linear_policy_loss",
                                  "ppo_clip_loss",
                                  "tr_rpg_loss", "topk_gumbel_softmax", "soft_embedding"]),
    "callbacks.md": ("lit_memopt.callbacks", ["MemoryMonitor", "EmptyCacheScheduler", "ActivationCheckpointing",
                                              "OOMRecovery"]),
}
START, END = "<!-- api-table:start -->", "<!-- api-table:end -->"


def _signature(obj: object) -> str:
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = list(inspect.signature(target).parameters.values())
    if inspect.isclass(obj):
        params = params[1:]  # self
    out, star_done = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            out.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            out.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        elif p.default is inspect.Parameter.empty:
            out.append(p.name)
        else:
            out.append(f"{p.name}={p.default!r}")
    return ", ".join(out)


def _summary(obj: object) -> str:
    # The first paragraph of the docstring; a pipe would end the table cell (GitHub and MkDocs differ on escapes).
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").replace("||", "‖").replace("|", "/")


def table(package: str, names: list[str]) -> str:
    module = importlib.import_module(package)
    rows = ["| name | signature | what it does |", "|---|---|---|"]
    for name in names:
        obj = getattr(module, name)
        rows.append(f"| `{name}` | `({_signature(obj)})` | {_summary(obj)} |")
    return "\n".join(rows)


def render(page: str) -> str:
    """The page's text with its table replaced by the one the live signatures give."""
    text = (DOCS / page).read_text()
    package, names = TABLES[page]
    new = f"{START}\n{table(package, names)}\n{END}"
    updated, count = re.subn(re.escape(START) + r".*?" + re.escape(END), lambda _m: new, text, flags=re.S)
    if count != 1:
        raise SystemExit(f"docs/{page} must hold one {START} ... {END} block")
    return updated


if __name__ == "__main__":
    for page in TABLES:
        (DOCS / page).write_text(render(page))
        print(f"wrote docs/{page}", file=sys.stderr)
