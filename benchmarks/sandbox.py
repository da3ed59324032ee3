"""Code sandbox throughput: benign programs per second per worker, this sandbox vs the previous one, in one run.

The baseline is the previous implementation kept verbatim as ``benchmarks/_sandbox_legacy.py`` (the
module ``lit_memopt/rewards/sandbox.py`` at commit e4e8ee6: a new interpreter per run, ctypes
bootstrap, polled waits). Both run the same distinct programs with the cache off, one worker each,
in interleaved blocks; the ratio is of medians. Writes ``benchmarks/results/sandbox_cpu[_quick].{md,json}``.

Run ``python benchmarks/sandbox.py [--quick]`` or call :func:`run`.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/sandbox.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _sandbox_legacy as legacy  # noqa: E402
from benchmarks._results import quick_command, write_results  # noqa: E402
from lit_memopt.rewards import sandbox as current  # noqa: E402
from lit_memopt.rewards.sandbox.probe import summary_line  # noqa: E402

SPEEDUP_TARGET = 2.0

# Benign programs of the kind CRSP runs: a small function called on one input, its repr printed.
_BODIES = (
    "def f(x):\n    return sorted(x)[::-1]\n",
    "def f(x):\n    return sum(i * i for i in x)\n",
    "def f(s):\n    return ''.join(reversed(s))\n",
    "import collections\ndef f(s):\n    return collections.Counter(s).most_common(2)\n",
    "def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "import math\ndef f(n):\n    return [k for k in range(2, n) if all(k % d for d in range(2, int(math.sqrt(k)) + 1))]\n",
)
_INPUTS = ("[3, 1, 2]", "[5, 4, 9, 1]", "'abcdef'", "'mississippi'", "25", "60")


def programs(count: int, tag: str) -> list[str]:
    """``count`` distinct programs (a comment makes each unique, so nothing is served from a cache)."""
    out = []
    for i in range(count):
        body, arg = _BODIES[i % len(_BODIES)], _INPUTS[i % len(_INPUTS)]
        out.append(f"{body}print(repr(f({arg})))\n# {tag} {i}\n")
    return out


def _block(box: Any, progs: list[str]) -> float:
    """Seconds per program over one block of serial runs (one worker)."""
    start = time.perf_counter()
    for p in progs:
        verdict = box.run(p)
        if verdict.status != "ok":
            raise RuntimeError(f"benign program failed in the sandbox: {verdict}")
    return (time.perf_counter() - start) / len(progs)


def run(quick: bool = False, write: bool = True) -> dict[str, Any]:
    """Measure seconds per benign program for both implementations; write ``results/sandbox_cpu[_quick]``."""
    repeats, per_block = (3, 20) if quick else (6, 40)
    limits = dict(wall_time_s=5.0, cpu_time_s=3.0, memory_mb=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each sandbox announces what isolation it has; recorded below instead
        t0 = time.perf_counter()
        new = current.Sandbox(current.SandboxLimits(**limits), max_workers=1, cache_size=0)
        new.run("print(0)")  # starts the slot's fork server
        new_start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        old = legacy.Sandbox(legacy.SandboxLimits(**limits), max_workers=1, cache_size=0)
        old.run("print(0)")
        old_start_s = time.perf_counter() - t0
        # The fallback where bubblewrap is absent: the host tree visible, the same bootstrap and fork server.
        direct = current.Sandbox(current.SandboxLimits(**limits), max_workers=1, cache_size=0, use_bwrap=False)
        direct.run("print(0)")
    times: dict[str, list[float]] = {"legacy": [], "current": [], "current_direct": []}
    try:
        for r in range(repeats):
            order = [("legacy", old), ("current", new), ("current_direct", direct)]
            order = order if r % 2 == 0 else order[::-1]
            for name, box in order:
                times[name].append(_block(box, programs(per_block, f"{name}-{r}")))
        # The pool (one worker per core) as the trainer uses it: throughput of run_many.
        pool = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, mod in (("legacy", legacy), ("current", current)):
                box = mod.Sandbox(mod.SandboxLimits(**limits), max_workers=2, cache_size=0)
                box.run_many([("print(0)", ""), ("print(1)", "")])
                jobs = [(p, "") for p in programs(per_block * 2, f"pool-{name}")]
                start = time.perf_counter()
                verdicts = box.run_many(jobs)
                pool[name] = len(jobs) / (time.perf_counter() - start)
                assert all(v.ok for v in verdicts)
                box.close()
    finally:
        new.close()
        old.close()
        direct.close()
    legacy_s, current_s = statistics.median(times["legacy"]), statistics.median(times["current"])
    direct_s = statistics.median(times["current_direct"])
    speedup = legacy_s / current_s
    result: dict[str, Any] = {
        "quick": quick,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "repeats": repeats,
        "programs_per_block": per_block,
        "seconds_per_program": times,
        "legacy_s": legacy_s,
        "current_s": current_s,
        "legacy_programs_per_s": 1.0 / legacy_s,
        "current_programs_per_s": 1.0 / current_s,
        "speedup": speedup,
        "current_direct_s": direct_s,
        "direct_speedup": legacy_s / direct_s,
        "target_speedup": SPEEDUP_TARGET,
        "target_met": speedup >= SPEEDUP_TARGET,
        "pool_2_workers_programs_per_s": pool,
        "startup_s": {"legacy": old_start_s, "current": new_start_s},
        "isolation": {"current": summary_line(new.isolation), "current_direct": summary_line(direct.isolation),
                      "legacy": str(old.isolation)},
    }
    result["report_rows"] = [
        {"metric": "benign program, one worker: seconds per program (programs/s = 1 / this)", "baseline": legacy_s,
         "baseline_label": "legacy", "optimized": current_s, "unit": "s", "ratio": current_s / legacy_s,
         "target": f"≤ {1 / SPEEDUP_TARGET:g}× (≥ {SPEEDUP_TARGET:g}× programs/s)", "pass": result["target_met"]},
        {"metric": "benign program, one worker, fallback launcher (no bubblewrap): seconds per program",
         "baseline": legacy_s, "baseline_label": "legacy", "optimized": direct_s, "unit": "s",
         "ratio": direct_s / legacy_s, "target": "", "pass": None},
        {"metric": "benign programs, pool of 2 workers (run_many): seconds per program", "baseline": 1 / pool["legacy"],
         "baseline_label": "legacy", "optimized": 1 / pool["current"], "unit": "s",
         "ratio": pool["legacy"] / pool["current"], "target": "", "pass": None},
    ]
    if write:
        result["written"] = write_results("sandbox_cpu_quick" if quick else "sandbox_cpu", result, to_markdown(result))
    return result


def to_markdown(result: dict[str, Any]) -> str:
    pool = result["pool_2_workers_programs_per_s"]
    return "\n".join([
        f"# Code sandbox throughput ({result['machine']}{', quick' if result['quick'] else ''})",
        "",
        f"Generated by `python -m benchmarks --only sandbox{' --quick' if result['quick'] else ''}`. Benign CRSP-like "
        f"programs, all distinct, cache off; {result['repeats']} interleaved blocks of {result['programs_per_block']} "
        "serial runs per implementation, medians. Legacy = `benchmarks/_sandbox_legacy.py` (the sandbox at e4e8ee6).",
        "",
        "| implementation | seconds / program | programs / s per worker | pool of 2: programs / s | start (probe + first run) |",
        "|---|---:|---:|---:|---:|",
        f"| legacy | {result['legacy_s'] * 1e3:.1f} ms | {result['legacy_programs_per_s']:.1f} | {pool['legacy']:.1f} | "
        f"{result['startup_s']['legacy']:.2f} s |",
        f"| current | {result['current_s'] * 1e3:.1f} ms | {result['current_programs_per_s']:.1f} | {pool['current']:.1f} | "
        f"{result['startup_s']['current']:.2f} s |",
        f"| current, fallback launcher (no bubblewrap) | {result['current_direct_s'] * 1e3:.1f} ms | "
        f"{1 / result['current_direct_s']:.1f} | | |",
        "",
        f"Speed-up per worker: **{result['speedup']:.2f}×** (target ≥ {result['target_speedup']:g}×: "
        f"{'met' if result['target_met'] else 'missed'}); fallback launcher {result['direct_speedup']:.2f}×.",
        "",
        f"Current isolation: {result['isolation']['current']}",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    return quick_command(argv, __doc__, run, to_markdown, "fewer, shorter blocks",
                         passed=lambda result: result["target_met"])


if __name__ == "__main__":
    raise SystemExit(main())
