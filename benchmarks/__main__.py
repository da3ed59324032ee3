"""The one benchmark entry point: ``python -m benchmarks [--quick] [--only NAME,...]`` (also ``lit-memopt benchmark``).

Runs every case module of this folder that has ``run(quick: bool) -> dict``, keeps going when one
fails, and writes ``benchmarks/results/<device>.json``, ``<device>.md`` (one table: case, metric,
naive/legacy, optimized, ratio, target, pass) and PNG plots next to them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import inspect
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
# Report order; any other case module found in this folder runs after these, alphabetically.
CASE_ORDER = ("ops", "peers", "callback_overhead", "oom_overhead", "grade", "ttt", "crsp", "sandbox", "intuitor", "estimates")
_NOT_CASES = {"__init__", "__main__", "plots", "report"}


# ============================================================================ discovery
def discover_cases() -> list[str]:
    """Names of the case modules in ``benchmarks/`` (files with a top-level ``def run(``)."""
    found = []
    for path in HERE.glob("*.py"):
        name = path.stem
        if name in _NOT_CASES or name.startswith("_"):
            continue
        if re.search(r"^def run\(", path.read_text(encoding="utf-8"), flags=re.MULTILINE):
            found.append(name)
    ordered = [n for n in CASE_ORDER if n in found]
    return ordered + sorted(n for n in found if n not in CASE_ORDER)


def device_name() -> str:
    """``cpu``, or the CUDA device's name made file-safe (``nvidia-h100-80gb-hbm3``)."""
    if torch.cuda.is_available():
        return slugify(torch.cuda.get_device_name())
    return "cpu"


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


# ============================================================================ normalising results
def row(
    case: str,
    metric: str,
    baseline: float | None,
    optimized: float | None,
    unit: str,
    *,
    ratio: float | None = None,
    target: str = "",
    passed: bool | None = None,
    baseline_label: str = "naive",
) -> dict[str, Any]:
    """One line of the report. ``ratio`` defaults to optimized / baseline."""
    if ratio is None and baseline not in (None, 0) and optimized is not None:
        ratio = float(optimized) / float(baseline)
    return {
        "case": case,
        "metric": metric,
        "baseline": baseline,
        "baseline_label": baseline_label,
        "optimized": optimized,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "pass": passed,
    }


def _get(d: Any, *keys: Any, default: Any = None) -> Any:
    for k in keys:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return default
    return d


def _target_le(value: Any, fmt: str = "{:g}") -> str:
    return f"≤ {fmt.format(value)}×" if isinstance(value, (int, float)) else ""


def _rows_ops(result: dict[str, Any], module: Any) -> list[dict[str, Any]]:
    out = []
    mem_target = _target_le(getattr(module, "MEMORY_TARGET", None))
    shape = _get(result, "memory_fake", "shape", default={})
    where = f"{shape.get('tokens', '?')} tokens, vocab {shape.get('vocab', '?')}" if shape else ""
    for r in _get(result, "memory_fake", "rows", default=[]) or []:
        # The ops case judges its target at the full shape only (target_met None at the quick one).
        judged = r.get("target_met") is not None
        out.append(row("ops", f"{r.get('op')}: extra memory, fake tensors ({where})", r.get("naive_bytes"), r.get("fused_bytes"), "bytes",
                       ratio=r.get("ratio"), target=mem_target if judged else f"{mem_target} (full shape only)",
                       passed=r.get("target_met")))
    for key, label, target_name in (("time_cpu", "CPU time", "CPU_TIME_TARGET"), ("time_cuda", "CUDA time", "CUDA_TIME_TARGET")):
        for r in _get(result, key, "rows", default=[]) or []:
            out.append(row("ops", f"{r.get('op')}: {label}", r.get("naive_s"), r.get("fused_s"), "s",
                           ratio=r.get("ratio"), target=_target_le(getattr(module, target_name, None)), passed=r.get("target_met")))
    for r in _get(result, "memory_cuda", "rows", default=[]) or []:
        out.append(row("ops", f"{r.get('op')}: CUDA allocator peak", r.get("naive_bytes"), r.get("fused_bytes"), "bytes",
                       ratio=r.get("ratio"), target=mem_target, passed=r.get("target_met")))
    return out


def _rows_crsp(result: dict[str, Any], module: Any) -> list[dict[str, Any]]:
    mem = result.get("memory_fake", {})
    by_path = {r.get("path"): r for r in mem.get("rows", [])}
    naive = next((r for p, r in by_path.items() if p and p.startswith("naive") and "after" in p), None)
    fused = next((r for p, r in by_path.items() if p and p.startswith("fused")), None)
    out = []
    if naive and fused:
        out.append(row("crsp", f"3-role log-prob recomputation: extra memory, fake tensors ({mem.get('tokens_per_role')} tokens/role, Qwen2.5-7B head)",
                       naive.get("extra_bytes"), fused.get("extra_bytes"), "bytes", ratio=mem.get("fused_over_naive"),
                       target=_target_le(mem.get("target_ratio")), passed=mem.get("target_met")))
    cpu = result.get("cpu", {})
    if cpu:
        out.append(row("crsp", "3-role log-prob recomputation: CPU time", cpu.get("naive_s"), cpu.get("fused_s"), "s",
                       ratio=cpu.get("fused_over_naive")))
    return out


def _rows_intuitor(result: dict[str, Any], module: Any) -> list[dict[str, Any]]:
    mem = result.get("memory_fake", {})
    rows = mem.get("rows", [])
    out = []
    if len(rows) >= 2:
        target = mem.get("target_bytes")
        out.append(row("intuitor", "head step (log-probs + self-certainty + GRPO): extra memory, fake tensors (Qwen2.5-1.5B head)",
                       rows[0].get("extra_bytes"), rows[-1].get("extra_bytes"), "bytes", ratio=mem.get("fused_over_naive"),
                       target=f"< {target / 2**30:g} GiB" if isinstance(target, (int, float)) else "", passed=mem.get("target_met")))
    t = result.get("time_cpu", {})
    if t:
        out.append(row("intuitor", "head step: CPU time", t.get("naive_s"), t.get("fused_s"), "s", ratio=t.get("fused_over_naive")))
    return out


def _rows_ttt(result: dict[str, Any], module: Any) -> list[dict[str, Any]]:
    out = []
    summary = result.get("summary", {})
    fake = result.get("memory_fake", {})
    by_mode = {r.get("mode"): r for r in fake.get("rows", [])}
    if "plain" in by_mode and "layer" in by_mode:
        shape = fake.get("shape", {})
        layer = by_mode["layer"]
        out.append(row("ttt", f"TTT-125M step, whole-layer checkpointing: peak, fake tensors ({shape.get('batch')}×{shape.get('seq_len')})",
                       by_mode["plain"].get("peak_bytes"), layer.get("peak_bytes"), "bytes", ratio=layer.get("peak_ratio"),
                       target=_target_le(result.get("memory_target")), passed=summary.get("memory_target_met"),
                       baseline_label="plain layer"))
    for key, label, target in (("real_cpu_125m", "TTT-125M", True), ("real_cpu", "tiny TTT", False)):
        real = result.get(key, {})
        step = real.get("step_s", {})
        if "plain" in step and "layer" in step:
            shape = real.get("time_shape", {})
            out.append(row("ttt", f"{label} step, whole-layer checkpointing: CPU time ({shape.get('batch')}×{shape.get('seq_len')})",
                           step["plain"], step["layer"], "s", ratio=real.get("time_ratio", {}).get("layer"),
                           target=_target_le(result.get("time_target")) if target else "",
                           passed=summary.get("time_target_met") if target else None, baseline_label="plain layer"))
    return out


def _rows_oom(result: dict[str, Any], module: Any) -> list[dict[str, Any]]:
    rows = result.get("rows", [])
    if not rows:
        return []
    base = rows[0]
    out = []
    for i, r in enumerate(rows[1:]):
        first = i == 0
        out.append(row("oom_overhead", f"{r.get('variant')}: step time ({result.get('model', 'tiny model')})",
                       base.get("median_step_s"), r.get("median_step_s"), "s", ratio=r.get("ratio_vs_without"),
                       target=_target_le(result.get("target")) if first else "",
                       passed=result.get("passed") if first else None, baseline_label="without callback"))
    return out


def _rows_grade(result: dict[str, Any], module: Any) -> list[dict[str, Any]]:
    out = []
    fake = result.get("qwen3_4b_fake", [])
    summary = result.get("summary", {})
    targets = result.get("targets", {})
    step = result.get("fake_step", result.get("step", {}))
    shape = f"batch {step.get('batch')}, {step.get('new_tokens')} new tokens, top-k {step.get('top_k')}" if step else ""
    if len(fake) >= 2:
        legacy = fake[0]
        for r in fake[1:]:
            best = r.get("label") == summary.get("best_optimized")
            out.append(row("grade", f"GRADE step, Qwen3-4B ({shape}), {r.get('label')}: memory beyond the weights",
                           legacy.get("extra_bytes"), r.get("extra_bytes"), "bytes", baseline_label="legacy",
                           target=_target_le(targets.get("extra_ratio")) if best else "",
                           passed=summary.get("extra_ratio_ok") if best else None))
        best = next((r for r in fake if r.get("label") == summary.get("best_optimized")), None)
        if best:
            limit = targets.get("whole_step_gib")
            out.append(row("grade", f"GRADE step, Qwen3-4B, {best.get('label')}: whole-step peak", legacy.get("peak_bytes"),
                           best.get("peak_bytes"), "bytes", baseline_label="legacy",
                           target=f"≤ {limit:g} GiB" if isinstance(limit, (int, float)) else "", passed=summary.get("whole_step_ok")))
    tiny = result.get("tiny_real", [])
    if len(tiny) >= 2:
        for r in tiny[1:]:
            out.append(row("grade", f"GRADE step, tiny model, {r.get('label')}: CPU time", tiny[0].get("step_seconds"),
                           r.get("step_seconds"), "s", baseline_label="legacy"))
    return out


def _rows_callbacks(result: dict[str, Any], module: Any) -> list[dict[str, Any]]:
    out = []
    target = result.get("target_overhead_fraction")
    for kind, r in (result.get("results") or {}).items():
        base = r.get("median_step_without_s")
        hooks = r.get("hook_step_s")
        if base is None or hooks is None:
            continue
        out.append(row("callback_overhead", f"{kind}: step time + hook time ({result.get('model', 'tiny model')})", base, base + hooks, "s",
                       baseline_label="without callbacks",
                       target=f"≤ {1 + target:g}×" if isinstance(target, (int, float)) else "", passed=r.get("within_target")))
    return out


ADAPTERS: dict[str, Callable[[dict[str, Any], Any], list[dict[str, Any]]]] = {
    "grade": _rows_grade,
    "callback_overhead": _rows_callbacks,
    "ops": _rows_ops,
    "crsp": _rows_crsp,
    "intuitor": _rows_intuitor,
    "ttt": _rows_ttt,
    "oom_overhead": _rows_oom,
}

_BASE_WORDS = ("naive", "legacy", "baseline", "plain", "without", "dense")
_OPT_WORDS = ("fused", "optimized", "optimised", "checkpointed", "with", "sparse")


def _generic_rows(case: str, result: Any, path: str = "") -> list[dict[str, Any]]:
    """Rows from any dict holding a ``<naive|legacy|...>_<bytes|s>`` / ``<fused|optimized|...>_<same>`` pair."""
    out: list[dict[str, Any]] = []
    if isinstance(result, dict):
        for unit_suffix, unit in (("_bytes", "bytes"), ("_s", "s"), ("_seconds", "s")):
            base_key = next((f"{w}{unit_suffix}" for w in _BASE_WORDS if f"{w}{unit_suffix}" in result), None)
            opt_key = next((f"{w}{unit_suffix}" for w in _OPT_WORDS if f"{w}{unit_suffix}" in result), None)
            if base_key and opt_key and isinstance(result[base_key], (int, float)) and isinstance(result[opt_key], (int, float)):
                label = next((str(result[k]) for k in ("metric", "name", "op", "path", "variant", "case") if k in result), path or case)
                target = result.get("target", result.get("target_ratio", ""))
                passed = result.get("pass", result.get("passed", result.get("target_met")))
                out.append(row(case, label, result[base_key], result[opt_key], unit,
                               ratio=result.get("ratio") if isinstance(result.get("ratio"), (int, float)) else None,
                               target=_target_le(target) if isinstance(target, (int, float)) else str(target or ""),
                               passed=passed if isinstance(passed, bool) else None,
                               baseline_label=base_key[: -len(unit_suffix)]))
        for key, value in result.items():
            if key in ("report_rows", "written"):
                continue
            out.extend(_generic_rows(case, value, f"{path}.{key}" if path else str(key)))
    elif isinstance(result, list):
        for i, value in enumerate(result):
            out.extend(_generic_rows(case, value, f"{path}[{i}]"))
    return out


def normalise(case: str, result: Any, module: Any = None) -> list[dict[str, Any]]:
    """The report rows of one case's ``run()`` result.

    A case may return them itself under ``"report_rows"`` (a list of :func:`row` dicts, the
    preferred contract); otherwise a known adapter or the generic pair finder makes them.
    """
    if not isinstance(result, dict):
        return []
    if isinstance(result.get("report_rows"), list):
        return [dict(row(case, "?", None, None, ""), **r) for r in result["report_rows"]]
    adapter = ADAPTERS.get(case)
    if adapter is not None:
        try:
            rows = adapter(result, module)
            if rows:
                return rows
        except Exception:  # noqa: BLE001 - a changed result shape falls back to the generic finder
            pass
    return _generic_rows(case, result)


# ============================================================================ running
def run_case(name: str, quick: bool) -> dict[str, Any]:
    """Import and run one case; never raises: an error is recorded in the returned entry."""
    started = time.perf_counter()
    entry: dict[str, Any] = {"case": name, "status": "ok"}
    module = None
    try:
        module = importlib.import_module(f"benchmarks.{name}")
        run = getattr(module, "run", None)
        if not callable(run):
            raise AttributeError(f"benchmarks/{name}.py has no run(quick) function")
        params = inspect.signature(run).parameters
        kwargs: dict[str, Any] = {"quick": quick} if "quick" in params else {}
        result = run(**kwargs)
        entry["rows"] = normalise(name, result, module)
        entry["result"] = _jsonable(result)
    except BaseException as exc:  # noqa: BLE001 - one case failing must not stop the others
        if isinstance(exc, KeyboardInterrupt):
            raise
        entry["status"] = "error"
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["traceback"] = traceback.format_exc(limit=8)
        entry["rows"] = []
    entry["seconds"] = time.perf_counter() - started
    return entry


def _jsonable(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)


def _format_value(value: Any, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "bytes":
        v = float(value)
        for suffix, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(v) >= scale:
                return f"{v / scale:,.2f} {suffix}"
        return f"{int(v)} B"
    if unit == "s":
        v = float(value)
        return f"{v * 1e3:,.1f} ms" if v < 10 else f"{v:,.1f} s"
    if isinstance(value, float):
        return f"{value:,.4g} {unit}".strip()
    return f"{value} {unit}".strip()


def _format_ratio(ratio: Any) -> str:
    if not isinstance(ratio, (int, float)):
        return "—"
    return f"{ratio:.3f}" if ratio >= 0.01 else f"{ratio:.2e}"


def to_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# lit-memopt benchmarks: {report['device']}{' (quick)' if report['quick'] else ''}",
        "",
        f"Generated by `python -m benchmarks{' --quick' if report['quick'] else ''}` on {report['started']} "
        f"(torch {report['torch']}, {report['platform']}, {report['threads']} threads). Memory is peak live tensor "
        "bytes (fake tensors: real shapes, no memory; or the CUDA allocator on a GPU); time ratios compare paths "
        "within the same run. Ratio = optimized / naive (or legacy, plain): lower is better.",
        "",
        "| case | metric | naive / legacy | optimized | ratio | target | pass |",
        "|---|---|---:|---:|---:|---|:---:|",
    ]
    for entry in report["cases"]:
        for r in entry["rows"]:
            base = _format_value(r.get("baseline"), r.get("unit", ""))
            label = r.get("baseline_label") or "naive"
            if r.get("baseline") is not None and label not in ("naive", "legacy"):
                base = f"{base} ({label})"
            passed = {True: "✅", False: "❌", None: ""}[r.get("pass") if isinstance(r.get("pass"), bool) else None]
            lines.append(
                f"| {r['case']} | {r['metric']} | {base} | {_format_value(r.get('optimized'), r.get('unit', ''))} | "
                f"{_format_ratio(r.get('ratio'))} | {r.get('target') or ''} | {passed} |"
            )
        if entry["status"] != "ok":
            lines.append(f"| {entry['case']} | **error**: {entry['error'].splitlines()[0][:160]} | | | | | ❌ |")
    lines += ["", "| case | status | seconds |", "|---|---|---:|"]
    for entry in report["cases"]:
        lines.append(f"| {entry['case']} | {entry['status']} | {entry['seconds']:.1f} |")
    extra = report.get("notes") or []
    if extra:
        lines += [""] + [f"- {n}" for n in extra]
    if report.get("plots"):
        lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in report["plots"]]]
    return "\n".join(lines) + "\n"


def _write_plots(report: dict[str, Any], out_dir: Path, device: str) -> None:
    try:
        from benchmarks.plots import write_plots

        report["plots"] = [str(p) for p in write_plots(report, out_dir, device)]
    except Exception as exc:  # noqa: BLE001 - plots are a courtesy; the table is the result
        report["plots"] = []
        report.setdefault("notes", []).append(f"plots not written: {type(exc).__name__}: {exc}")


def render(json_path: Path) -> int:
    """Rebuild ``<device>.md`` and the plots from a saved report, re-normalising each case's stored result."""
    report = json.loads(json_path.read_text())
    for entry in report["cases"]:
        if entry.get("status") == "ok" and isinstance(entry.get("result"), dict):
            try:
                module = importlib.import_module(f"benchmarks.{entry['case']}")
            except ImportError:
                module = None
            entry["rows"] = normalise(entry["case"], entry["result"], module)
    report["notes"] = [n for n in report.get("notes", []) if not n.startswith("plots not written")]
    _write_plots(report, json_path.parent, report["device"])
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(to_markdown(report))
    print(f"wrote {md_path}" + (f" and {len(report['plots'])} plots" if report["plots"] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the cases; write ``results/<device>.{json,md}`` and plots; 1 if any case failed (or, with ``--strict``, missed a target)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few repetitions: about 13 minutes on a 2-core CPU")
    parser.add_argument("--only", default=None, help="comma-separated case names (default: all); see --list")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--out", default=str(RESULTS_DIR), help="folder for <device>.json/.md and the plots")
    parser.add_argument("--strict", action="store_true", help="also exit 1 when a measured target is missed")
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="run nothing: rebuild the table and plots from a <device>.json written earlier")
    args = parser.parse_args(argv)
    if args.render:
        return render(Path(args.render))

    cases = discover_cases()
    if args.list:
        print("\n".join(cases))
        return 0
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in cases]
        if unknown:
            print(f"python -m benchmarks: error: unknown case(s) {', '.join(unknown)}; choose from: {', '.join(cases)}", file=sys.stderr)
            return 2
        cases = [n for n in cases if n in wanted]

    device = device_name()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "quick": bool(args.quick),
        "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cases": [],
    }
    json_path = out_dir / f"{device}.json"
    md_path = out_dir / f"{device}.md"
    total_start = time.perf_counter()
    for name in cases:
        print(f"[benchmarks] {name} ...", flush=True)
        entry = run_case(name, args.quick)
        report["cases"].append(entry)
        status = "ok" if entry["status"] == "ok" else f"FAILED ({entry['error'].splitlines()[0][:200]})"
        print(f"[benchmarks] {name}: {status} in {entry['seconds']:.1f} s, {len(entry['rows'])} rows", flush=True)
        # Written after every case: an interrupted run still leaves the cases it finished.
        report["seconds"] = time.perf_counter() - total_start
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        md_path.write_text(to_markdown(report))

    _write_plots(report, out_dir, device)
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path.write_text(to_markdown(report))
    print(to_markdown(report))
    print(f"wrote {md_path}, {json_path}" + (f" and {len(report['plots'])} plots" if report["plots"] else ""))

    failed = [e["case"] for e in report["cases"] if e["status"] != "ok"]
    missed = [f"{r['case']}: {r['metric']}" for e in report["cases"] for r in e["rows"] if r.get("pass") is False]
    if failed:
        print(f"[benchmarks] failed cases: {', '.join(failed)}", file=sys.stderr)
    if missed:
        print(f"[benchmarks] missed targets: {'; '.join(missed)}", file=sys.stderr)
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
