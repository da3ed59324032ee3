"""Preparing a user's chat data does not hold it in RAM: ``data=text_dataset`` on 1M short chat rows, peak RSS and
time, at several row counts (target: the peak anonymous RSS, the process's own heap, grows by less than 15% from the
smallest count to 1M rows; the file-backed part is the memory-mapped Arrow tables, page cache the kernel can drop).

Each count runs in a fresh process (peak RSS is per process): it builds the datamodule (``datasets`` converts the
jsonl to Arrow), tokenizes with the chat template into the cache (``Dataset.map``), then draws 200 shuffled batches.
A second run of the largest count measures the cached start. The tokenizer and chat template are the tests'
(``tests/_user_assets.py``: a BPE tokenizer trained with ``tokenizers``, ChatML template).

    python benchmarks/data_prep.py [--quick]      # also: python -m benchmarks --only data_prep
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/data_prep.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import quick_command, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COUNTS = (100_000, 300_000, 1_000_000)
QUICK_COUNTS = (10_000, 30_000)
RSS_GROWTH_TARGET = 1.15
BATCHES = 200

# One fresh process per measurement: build, tokenize (or read the cache), draw batches; print a JSON line.
_CHILD = r"""
import json, resource, sys, threading, time
sys.path.insert(0, sys.argv[4])
peaks = {"RssAnon": 0, "RssFile": 0}

def sample():  # /proc/self/status every 20 ms: anonymous (heap) and file-backed (memory-mapped Arrow) resident pages
    while True:
        for line in open("/proc/self/status"):
            name, _, value = line.partition(":")
            if name in peaks:
                peaks[name] = max(peaks[name], int(value.split()[0]) * 1024)
        time.sleep(0.02)

threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
from transformers import AutoTokenizer
from lit_memopt.data.text_dataset import TextDatasetDataModule
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
imported = time.perf_counter()
dm = TextDatasetDataModule(tokenizer, path=sys.argv[2], cache_dir=sys.argv[3], max_length=128, batch_size=32)
dm.setup("fit")
prepared = time.perf_counter()
loader = iter(dm.train_dataloader())
tokens = sum(int(next(loader)["attention_mask"].sum()) for _ in range(int(sys.argv[5])))
done = time.perf_counter()
print(json.dumps({"rows": len(dm.train_set), "prepare_s": prepared - imported, "batches_s": done - prepared,
                  "tokens_drawn": tokens, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak_anon_bytes": peaks["RssAnon"], "peak_file_bytes": peaks["RssFile"]}))
"""


def write_rows(path: Path, count: int) -> None:
    """``count`` short chats (a question and its answer), written in chunks."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _user_assets import problems

    pairs = problems(1000, seed=3)
    with path.open("w") as handle:
        for start in range(0, count, 1000):
            handle.write("".join(
                json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
                for q, a in pairs[: min(1000, count - start)]))


def measure(tokenizer_dir: Path, data: Path, cache: Path, batches: int) -> dict[str, Any]:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tokenizer_dir), str(data), str(cache), str(ROOT), str(batches)],
                          capture_output=True, text=True, env=env, check=True, timeout=3600)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def run(quick: bool = False, write: bool = True) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from _user_assets import train_tokenizer

    counts = QUICK_COUNTS if quick else COUNTS
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        tokenizer_dir = root / "tokenizer"
        train_tokenizer(tokenizer_dir)
        for count in counts:
            data = root / f"chats_{count}.jsonl"
            write_rows(data, count)
            cases[str(count)] = measure(tokenizer_dir, data, root / f"cache_{count}", BATCHES)
        largest = counts[-1]
        cases[f"{largest} cached"] = measure(tokenizer_dir, root / f"chats_{largest}.jsonl", root / f"cache_{largest}", BATCHES)
    first, last = cases[str(counts[0])], cases[str(counts[-1])]
    growth = last["peak_anon_bytes"] / first["peak_anon_bytes"]
    result = {"quick": quick, "counts": list(counts), "machine": platform.platform(), "cpus": os.cpu_count(),
              "load": f"{os.getloadavg()[0]:.1f}", "cases": cases, "rss_growth": growth,
              "target_met": growth <= RSS_GROWTH_TARGET}
    if write:
        write_results(f"data_prep_cpu{'_quick' if quick else ''}", result, to_markdown(result))
    rows = [{"case": "data_prep", "metric": f"peak anonymous RSS preparing {counts[-1]:,} chat rows vs {counts[0]:,}",
             "baseline": first["peak_anon_bytes"], "baseline_label": f"{counts[0]:,} rows", "optimized": last["peak_anon_bytes"],
             "unit": "B", "ratio": growth, "target": f"<= {RSS_GROWTH_TARGET}x", "pass": growth <= RSS_GROWTH_TARGET}]
    return {"report_rows": rows, **result}


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Preparing a user's chat data (data=text_dataset)",
        "",
        f"Machine: {result['machine']}, {result['cpus']} CPUs, load {result['load']} at start. One fresh process per row:",
        "build the datamodule (jsonl -> Arrow), tokenize with the chat template into the cache, draw "
        f"{BATCHES} shuffled batches of 32. `cached`: the same file again, its tables read from the cache.",
        "",
        "| rows | prepare (s) | rows/s | 200 batches (s) | wall incl. imports (s) | peak RSS (MiB) | peak anonymous (MiB) | peak file-backed (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["cases"].items():
        lines.append(f"| {name} | {r['prepare_s']:.1f} | {r['rows'] / max(r['prepare_s'], 1e-9):,.0f} | {r['batches_s']:.2f} | "
                     f"{r['wall_s']:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} | {r['peak_anon_bytes'] / 2**20:.0f} | "
                     f"{r['peak_file_bytes'] / 2**20:.0f} |")
    lines += ["", "Peak RSS counts the memory-mapped Arrow pages the process touched (file-backed: page cache the kernel "
              "can drop); the anonymous part is the process's own heap.",
              "", f"Peak anonymous RSS growth from {result['counts'][0]:,} to {result['counts'][-1]:,} rows: "
              f"**{result['rss_growth']:.3f}x** (target <= {RSS_GROWTH_TARGET}x): "
              f"{'met' if result['target_met'] else 'MISSED'}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return quick_command(argv, __doc__, run, to_markdown, "10k and 30k rows", passed=lambda r: r["target_met"])


if __name__ == "__main__":
    raise SystemExit(main())
