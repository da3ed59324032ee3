"""Predicted peak memory of one training step of each method recipe at real scale (fake tensors; CUDA: measured too).

Pairs put a memory technique against its baseline at the same scale: GRADE optimized vs legacy,
SFT with vs without activation checkpointing. Run alone with ``python -m benchmarks.estimates [--quick]``.

Each case also gives the reserved peak two ways: the estimate's (the whole step's allocation log stitched from the 1-
and 2-block traces' and replayed, or where that does not check out a line through their replayed figures; the table
says which) and, for the ``--quick`` cases, the whole model's (``trace_all_blocks=true``: every block traced, the
whole step replayed); the line can miss by several GiB (docs/will-it-fit.md). On CUDA the step's
``torch.cuda.max_memory_reserved`` is recorded beside them, to say how close a real allocator comes.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import torch

from benchmarks._results import quick_command, write_results  # noqa: E402
# On a GPU the measured peak should sit within this share of the prediction.
MEASURED_TOLERANCE = 0.10

# (label, overrides); pairs are (baseline label, optimized label, metric).
CASES_QUICK: list[tuple[str, list[str]]] = [
    ("sft · Qwen3-4B · 4×1024", ["recipe=sft", "model=qwen3_4b", "batch_size=4", "seq_len=1024"]),
    ("sft · Qwen3-4B · 4×1024 · activation checkpointing",
     ["recipe=sft", "model=qwen3_4b", "batch_size=4", "seq_len=1024", "module.gradient_checkpointing=true"]),
]
CASES_FULL: list[tuple[str, list[str]]] = [
    ("sft · Qwen3-4B · 8×2048", ["recipe=sft", "model=qwen3_4b", "batch_size=8", "seq_len=2048"]),
    ("sft · Qwen3-4B · 8×2048 · activation checkpointing",
     ["recipe=sft", "model=qwen3_4b", "batch_size=8", "seq_len=2048", "module.gradient_checkpointing=true"]),
    ("grade · Qwen3-4B · legacy", ["recipe=grade_legacy", "model=qwen3_4b"]),
    ("grade · Qwen3-4B · optimized", ["recipe=grade", "model=qwen3_4b"]),
    ("ttt · TTT-125M", ["recipe=ttt", "model=ttt_125m"]),
    ("intuitor · Qwen2.5-1.5B", ["recipe=intuitor", "model=qwen2_5_1_5b"]),
    # full fine-tuning, as measured before the tiny default took one LoRA adapter per role
    ("crsp · Qwen2.5-7B", ["recipe=crsp", "model=qwen2_5_7b", "model.lora=null", "module.roles.adapters=false"]),
]
PAIRS = [
    ("sft · Qwen3-4B · 4×1024", "sft · Qwen3-4B · 4×1024 · activation checkpointing", "SFT step, activation checkpointing: predicted peak (Qwen3-4B, 4×1024)", "plain"),
    ("sft · Qwen3-4B · 8×2048", "sft · Qwen3-4B · 8×2048 · activation checkpointing", "SFT step, activation checkpointing: predicted peak (Qwen3-4B, 8×2048)", "plain"),
    ("grade · Qwen3-4B · legacy", "grade · Qwen3-4B · optimized", "GRADE step: predicted peak (Qwen3-4B, recipe batch)", "legacy"),
]


def compose(overrides: list[str]) -> Any:
    """The composed lit-memopt config for ``overrides``, exactly as the command line builds it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lit_memopt.cli import check_overrides, conf_dir, register_recipes

    register_recipes()
    check_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return hydra_compose(config_name="config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _error_text(exc: Exception) -> str:
    """An estimate's failure as one line for the results: its type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def estimate_case(label: str, overrides: list[str], whole: bool = True) -> dict[str, Any]:
    """One recipe's estimate as a JSON-ready dict (``error`` set when it could not be estimated); with ``whole``, the
    reserved peak of the whole model's trace too."""
    from lit_memopt.cli_estimate import estimate_recipe

    started = time.perf_counter()
    entry: dict[str, Any] = {"label": label, "overrides": overrides}
    try:
        report = estimate_recipe(compose(overrides))
    except Exception as exc:  # noqa: BLE001 - a recipe that cannot be estimated is a result, not a crash
        entry["error"] = _error_text(exc)
        entry["seconds"] = time.perf_counter() - started
        return entry
    est = report.estimate
    # The measured step ran last (estimate_recipe resets the peak statistics before it): its reserved high-water mark.
    measured_reserved = torch.cuda.max_memory_reserved() if report.measured_peak_bytes is not None else None
    traced = None
    if whole:
        try:
            traced = estimate_recipe(compose([*overrides, "trace_all_blocks=true"])).estimate
        except Exception as exc:  # noqa: BLE001 - the block line's figures stand on their own
            entry["whole_error"] = _error_text(exc)
    entry.update(
        reserved_peak_bytes=est.reserved_peak_bytes,
        # how the estimate's reserved figure was made (memory.blocks): a stitched log replayed, or the line
        reserved_how=("stitched" if "allocation log stitched" in est.method
                      else "line" if "extrapolated to" in est.method else "traced"),
        whole_reserved_peak_bytes=None if traced is None else traced.reserved_peak_bytes,
        whole_peak_bytes=None if traced is None else traced.peak_bytes,
        measured_reserved_bytes=measured_reserved,
        recipe=report.recipe,
        model=report.model,
        batch_size=est.batch_size,
        seq_len=est.seq_len,
        peak_bytes=est.peak_bytes,
        breakdown=est.breakdown,
        peak_phase=est.peak_phase,
        phase_peaks=est.phase_peaks,
        top_modules=[m.as_dict() for m in est.top_modules(5)],
        measured_peak_bytes=report.measured_peak_bytes,
        device=report.device,
        seconds=time.perf_counter() - started,
    )
    return entry


def report_rows(estimates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in the benchmark runner's format (see ``benchmarks/__main__.py:row``)."""
    by_label = {e["label"]: e for e in estimates}
    rows: list[dict[str, Any]] = []
    for base, opt, metric, base_label in PAIRS:
        b, o = by_label.get(base), by_label.get(opt)
        if b is None or o is None:
            continue
        if "peak_bytes" in b and "peak_bytes" in o:
            rows.append({"case": "estimates", "metric": metric, "baseline": b["peak_bytes"], "baseline_label": base_label,
                         "optimized": o["peak_bytes"], "unit": "bytes", "ratio": o["peak_bytes"] / b["peak_bytes"],
                         "target": "< 1×", "pass": o["peak_bytes"] < b["peak_bytes"]})
    for e in estimates:
        if "error" in e:
            rows.append({"case": "estimates", "metric": f"{e['label']}: not estimable on fake tensors ({e['error'][:120]})",
                         "baseline": None, "optimized": None, "unit": "bytes", "ratio": None, "target": "", "pass": None})
            continue
        shape = f"{e['batch_size']}×{e['seq_len']}" if e.get("seq_len") else f"{e['batch_size']} rows"
        measured = e.get("measured_peak_bytes")
        if measured:
            ratio = measured / e["peak_bytes"]
            rows.append({"case": "estimates", "metric": f"{e['label']} ({shape}): measured (CUDA allocator) vs predicted peak",
                         "baseline": e["peak_bytes"], "baseline_label": "predicted", "optimized": measured, "unit": "bytes",
                         "ratio": ratio, "target": f"within ±{MEASURED_TOLERANCE:.0%}", "pass": abs(ratio - 1) <= MEASURED_TOLERANCE})
        else:
            rows.append({"case": "estimates", "metric": f"{e['label']} ({shape}): predicted peak, peak during the {e['peak_phase']}",
                         "baseline": None, "optimized": e["peak_bytes"], "unit": "bytes", "ratio": None, "target": "", "pass": None})
    return rows


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Predicted peak memory of one training step, per recipe at real scale",
        "",
        f"torch {result['torch']}, {result['platform']}"
        + (f", measured on {result['gpu']} (`torch.cuda.max_memory_allocated` of the same step with real weights)" if result.get("gpu") else "")
        + ". `lit-memopt estimate` machinery: fake tensors and PyTorch's "
        "MemTracker; optimizer states exist before the step (steady state), foreach optimizer as on CUDA.",
        "",
        "| recipe | batch | predicted peak | params | grads | optimizer | activations | temporaries | peak during | measured "
        "| reserved: estimate | traced whole | measured | s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]

    def gib(n: Any) -> str:
        return f"{n / 2**30:.2f} GiB" if isinstance(n, (int, float)) else "—"

    for e in result["estimates"]:
        if "error" in e:
            lines.append(f"| {e['label']} | | not estimable: {e['error'][:140]} | | | | | | | | | | | {e['seconds']:.0f} |")
            continue
        b = e["breakdown"]
        shape = f"{e['batch_size']}×{e['seq_len']}" if e.get("seq_len") else str(e["batch_size"])
        lines.append(
            f"| {e['label']} | {shape} | {gib(e['peak_bytes'])} | {gib(b['parameters'])} | {gib(b['gradients'])} | "
            f"{gib(b['optimizer_state'])} | {gib(b['activations'])} | {gib(b['temporaries'])} | {e['peak_phase']} | "
            f"{gib(e.get('measured_peak_bytes'))} | {gib(e.get('reserved_peak_bytes'))}"
            f"{' (' + e['reserved_how'] + ')' if e.get('reserved_how') else ''} | "
            f"{gib(e.get('whole_reserved_peak_bytes'))} | {gib(e.get('measured_reserved_bytes'))} | {e['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def run(quick: bool = False, write: bool = True) -> dict[str, Any]:
    """Estimate every case; write ``results/estimates_<device>[_quick].{md,json}``; return the data with ``report_rows``."""
    cases = CASES_QUICK if quick else CASES_FULL
    # Whole-model traces for the quick cases only: the full list's GRADE and CRSP would take many minutes each.
    estimates = [estimate_case(label, overrides, whole=quick) for label, overrides in cases]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {
        "benchmark": "estimates",
        "quick": quick,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "estimates": estimates,
    }
    result["report_rows"] = report_rows(estimates)
    if write:
        stem = f"estimates_{device}" + ("_quick" if quick else "")
        result["written"] = write_results(stem, result, to_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    return quick_command(argv, __doc__, run, to_markdown, "SFT at Qwen3-4B only (with and without activation checkpointing)")


if __name__ == "__main__":
    raise SystemExit(main())
