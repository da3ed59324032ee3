"""PNG plots of a benchmark report (matplotlib, Agg backend): ratios per case, and the predicted peak breakdowns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COLORS = {True: "#2e7d32", False: "#c62828", None: "#757575"}
_BREAKDOWN_ORDER = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_BREAKDOWN_COLORS = ("#1565c0", "#6a1b9a", "#ef6c00", "#2e7d32", "#c62828", "#9e9e9e")


def _short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def write_plots(report: dict[str, Any], out_dir: Path, device: str) -> list[Path]:
    """Write ``<device>_ratios.png`` (and ``<device>_estimates.png`` when estimates ran); return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    rows = [r for e in report["cases"] for r in e["rows"] if isinstance(r.get("ratio"), (int, float)) and r["ratio"] > 0]
    groups = [("memory (optimized / naive peak)", [r for r in rows if r.get("unit") == "bytes"]),
              ("time (optimized / naive)", [r for r in rows if r.get("unit") == "s"])]
    groups = [(title, rs) for title, rs in groups if rs]
    if groups:
        heights = [max(1.5, 0.32 * len(rs) + 0.8) for _, rs in groups]
        fig, axes = plt.subplots(len(groups), 1, figsize=(11, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False)
        for ax, (title, rs) in zip(axes[:, 0], groups):
            labels = [_short(f"{r['case']}: {r['metric']}") for r in rs]
            values = [r["ratio"] for r in rs]
            colors = [_COLORS[r.get("pass") if isinstance(r.get("pass"), bool) else None] for r in rs]
            y = list(range(len(rs)))[::-1]
            ax.barh(y, values, color=colors)
            ax.set_yticks(y)
            ax.set_yticklabels(labels, fontsize=7)
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_title(title, fontsize=9)
            for yi, v in zip(y, values):
                ax.text(v, yi, f" {v:.3g}", va="center", fontsize=7)
        fig.suptitle(f"lit-memopt benchmarks on {device}: green = target met, red = missed, grey = no target", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{device}_ratios.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    estimates = next((e.get("result", {}).get("estimates") for e in report["cases"] if e["case"] == "estimates" and e["status"] == "ok"), None)
    estimates = [e for e in (estimates or []) if e.get("breakdown")]
    if estimates:
        fig, ax = plt.subplots(figsize=(11, max(2.0, 0.45 * len(estimates) + 1.2)))
        labels = [_short(e["label"], 60) for e in estimates]
        y = list(range(len(estimates)))[::-1]
        left = [0.0] * len(estimates)
        for key, color in zip(_BREAKDOWN_ORDER, _BREAKDOWN_COLORS):
            widths = [e["breakdown"].get(key, 0) / 2**30 for e in estimates]
            ax.barh(y, widths, left=left, color=color, label=key.replace("_", " "))
            left = [a + b for a, b in zip(left, widths)]
        for yi, e, total in zip(y, estimates, left):
            measured = e.get("measured_peak_bytes")
            text = f" {total:.1f} GiB" + (f" (measured {measured / 2**30:.1f})" if measured else "")
            ax.text(total, yi, text, va="center", fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("predicted peak of one training step (GiB)")
        ax.legend(fontsize=7, ncol=6, loc="lower center", bbox_to_anchor=(0.5, 1.0))
        fig.tight_layout()
        path = out_dir / f"{device}_estimates.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
