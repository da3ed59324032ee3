"""TTT scan checkpointing: peak memory of a training step with vs without it, and the step-time cost.

* Fake tensors (no memory, no GPU): the 125M TTT-Linear configuration (``conf/model/ttt_125m.yaml``)
  at sequence 2048, forward + backward of the next-token loss, peaks from ``MemTracker``.
* Real tensors on the CPU: the tiny model (``conf/model/ttt_tiny.yaml`` widths) at a longer
  sequence, peak live-tensor bytes from ``MemTracker`` and the step-time ratio, interleaved in one run.

Writes ``benchmarks/results/ttt_cpu[_quick].{md,json}``. Run ``python benchmarks/ttt.py [--quick]``
or call :func:`run`.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # `python benchmarks/ttt.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_memopt.memory.fake import fake_mode, peak_during  # noqa: E402
from lit_memopt.models.ttt import TTTConfig, auto_checkpoint_group_size  # noqa: E402
from lit_memopt.ops import linear_logprobs  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MEMORY_TARGET = 0.5  # checkpointed peak <= 0.5x of the plain scan's
TIME_TARGET = 1.25  # checkpointed step time <= 1.25x

CONFIG_125M = dict(
    name="ttt_125m", vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12,
    intermediate_size=2048, layer_type="linear", mini_batch_size=16,
)
# Fake tensors cost milliseconds of Python per op and the scan is 128 sequential mini-batches per
# layer, so by default the 12-layer step is measured at 0 (embedding + head) and 1 block and
# extrapolated linearly (see measure_fake); --full measures all 12 blocks.
FAKE_SHAPE = {"batch": 4, "seq_len": 2048}
FAKE_SHAPE_QUICK = {"batch": 4, "seq_len": 512}
FAKE_LAYERS = (0, 1)
CONFIG_TINY = dict(
    name="ttt_tiny", vocab_size=384, hidden_size=64, num_layers=2, num_heads=4,
    intermediate_size=128, layer_type="linear", mini_batch_size=8,
)
REAL_MEMORY_SHAPE = {"batch": 8, "seq_len": 256}
REAL_TIME_SHAPE = {"batch": 8, "seq_len": 1024}
REAL_TIME_SHAPE_QUICK = {"batch": 8, "seq_len": 256}


def _train_step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    hidden = model(input_ids)
    loss = -linear_logprobs(hidden[:, :-1], model.lm_head_weight, input_ids[:, 1:]).mean()
    loss.backward()


def _set_group(model: torch.nn.Module, group: int) -> None:
    for layer in model.ttt_layers():
        layer.checkpoint_group_size = group


def memory_saving_group(config: TTTConfig, batch: int, seq_len: int) -> int:
    """The group size :func:`auto_checkpoint_group_size` picks when memory is short (its memory minimum)."""
    from lit_memopt.models.ttt import ttt_layer_class

    probe = ttt_layer_class(config.layer_type)(config.hidden_size, config.num_heads, mini_batch_size=config.mini_batch_size)
    per_mb = 4 * batch * probe.num_heads * probe._saved_floats_per_mini_batch(config.mini_batch_size)
    state = 4 * batch * sum(p.numel() for p in probe.inner_parameters())
    return auto_checkpoint_group_size(
        seq_len // config.mini_batch_size, per_mb, state, num_layers=config.num_layers, available_bytes=0
    )


def _fake_peaks(config: TTTConfig, shape: dict[str, int], group: int, num_layers: int) -> dict[str, int]:
    """Fake-tensor peaks of one training step with ``num_layers`` blocks (0: embedding + head only)."""
    with fake_mode():
        model = TTTConfig(**{**vars(config), "num_layers": max(num_layers, 1)}).build_model()
        if num_layers == 0:
            model.layers = torch.nn.ModuleList()
        _set_group(model, group)
        input_ids = torch.randint(0, config.vocab_size, (shape["batch"], shape["seq_len"]))
        stats = peak_during(lambda: _train_step(model, input_ids), model)
        params = sum(p.numel() for p in model.parameters())
    return {
        "parameters": params,
        "peak_bytes": stats.peak_bytes,
        "extra_bytes": stats.extra_bytes,
        "activation_bytes": int(stats.by_category.get("Activation", 0)),
    }


def _fake_point(args: tuple[dict[str, Any], dict[str, int], int, int]) -> dict[str, Any]:
    config, shape, group, layers = args
    torch.set_num_threads(1)
    return {"checkpoint_group_size": group, "num_layers": layers, **_fake_peaks(TTTConfig(**config), shape, group, layers)}


def measure_fake(
    config: TTTConfig,
    shape: dict[str, int],
    groups: list[int],
    layers: tuple[int, ...] = FAKE_LAYERS,
    workers: int = 1,
) -> dict[str, Any]:
    """Fake-tensor peaks of forward + backward for each ``checkpoint_group_size``.

    Measured with ``layers`` blocks (real widths, real sequence). Parameters, gradients and the
    activations each block saves are linear in the number of blocks (the embedding/head part is
    constant), so the ``config.num_layers`` value is extrapolated as ``m_a + (L - a) * (m_b - m_a) / (b - a)``.
    With ``(0, 1)`` a transient that exists once (one recomputed layer in backward) is counted
    ``L`` times, which overstates the checkpointed peak: the ratio is conservative.
    ``layers=(config.num_layers,)`` measures the full model directly instead. ``workers > 1``
    measures the points in parallel processes.
    """
    jobs = [(vars(config), shape, group, n) for group in groups for n in layers]
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            measured = list(pool.map(_fake_point, jobs))
    else:
        measured = [_fake_point(job) for job in jobs]
    rows = []
    for group in groups:
        points = {r["num_layers"]: r for r in measured if r["checkpoint_group_size"] == group}
        if config.num_layers in points:
            row = dict(points[config.num_layers])
            row["extrapolated"] = False
        else:
            lo, hi = sorted(points)[:2]
            row = {"checkpoint_group_size": group, "num_layers": config.num_layers, "extrapolated": True}
            for key in ("parameters", "peak_bytes", "extra_bytes", "activation_bytes"):
                per_layer = (points[hi][key] - points[lo][key]) / (hi - lo)
                row[key] = int(round(points[lo][key] + (config.num_layers - lo) * per_layer))
        rows.append(row)
    return {"measured": measured, "rows": _with_ratios(rows)}


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = rows[0]
    for row in rows:
        row["peak_ratio"] = row["peak_bytes"] / base["peak_bytes"]
        row["extra_ratio"] = row["extra_bytes"] / base["extra_bytes"]
    return rows


def measure_real(config: TTTConfig, memory_shape: dict[str, int], time_shape: dict[str, int], group: int, reps: int) -> dict[str, Any]:
    """Real CPU tensors: MemTracker peaks, exact-gradient check and interleaved step times."""
    torch.manual_seed(0)
    model = config.build_model()
    input_ids = torch.randint(0, config.vocab_size, (memory_shape["batch"], memory_shape["seq_len"]))
    rows = []
    grads = []
    for g in (0, group):
        _set_group(model, g)
        stats = peak_during(lambda: _train_step(model, input_ids), model)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        rows.append({"checkpoint_group_size": g, "peak_bytes": stats.peak_bytes, "extra_bytes": stats.extra_bytes})
    rows = _with_ratios(rows)
    identical = all(torch.equal(a, b) for a, b in zip(*grads))
    del grads
    input_ids = torch.randint(0, config.vocab_size, (time_shape["batch"], time_shape["seq_len"]))
    time_group = memory_saving_group(config, **time_shape)
    times: dict[int, list[float]] = {0: [], time_group: []}
    for g in times:  # warm-up
        _set_group(model, g)
        _train_step(model, input_ids)
        model.zero_grad(set_to_none=True)
    for _ in range(reps):
        for g in times:  # interleaved, so that machine load hits both alike
            _set_group(model, g)
            gc.collect()
            start = time.perf_counter()
            _train_step(model, input_ids)
            times[g].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    plain, ckpt = statistics.median(times[0]), statistics.median(times[time_group])
    rows[0]["step_s"], rows[1]["step_s"] = plain, ckpt  # timed at time_shape, see "time_shape"
    return {
        "memory_shape": memory_shape,
        "time_shape": time_shape,
        "rows": rows,
        "gradients_identical": identical,
        "time_group": time_group,
        "step_s": {"plain": plain, "checkpointed": ckpt},
        "time_ratio": ckpt / plain,
        "reps": reps,
    }


def run(quick: bool = False, write: bool = True, full: bool = False, workers: int = 1) -> dict[str, Any]:
    """Run both measurements; write ``results/ttt_cpu[_quick].{md,json}`` and return the data.

    ``full=True`` measures the 12-layer model under fake tensors directly (slow: ~10^5 fake ops);
    ``workers`` runs the fake measurements in that many processes.
    """
    fake_shape = FAKE_SHAPE_QUICK if quick else FAKE_SHAPE
    big = TTTConfig(**CONFIG_125M)
    tiny = TTTConfig(**CONFIG_TINY)
    big_group = memory_saving_group(big, **fake_shape)
    tiny_group = memory_saving_group(tiny, **REAL_MEMORY_SHAPE)
    fake = measure_fake(big, fake_shape, [0, big_group], layers=(big.num_layers,) if full else FAKE_LAYERS, workers=workers)
    real = measure_real(tiny, REAL_MEMORY_SHAPE, REAL_TIME_SHAPE_QUICK if quick else REAL_TIME_SHAPE, tiny_group, reps=3 if quick else 7)
    result: dict[str, Any] = {
        "benchmark": "ttt",
        "quick": quick,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "memory_target": MEMORY_TARGET,
        "time_target": TIME_TARGET,
        "memory_fake": {"config": CONFIG_125M, "shape": fake_shape, "dtype": "float32", "chosen_group": big_group, **fake},
        "real_cpu": {"config": CONFIG_TINY, "dtype": "float32", "chosen_group": tiny_group, **real},
    }
    chosen = result["memory_fake"]["rows"][1]
    result["summary"] = {
        "fake_125m_peak_ratio": chosen["peak_ratio"],
        "fake_125m_extra_ratio": chosen["extra_ratio"],
        "real_tiny_peak_ratio": real["rows"][1]["peak_ratio"],
        "real_tiny_extra_ratio": real["rows"][1]["extra_ratio"],
        "cpu_time_ratio": real["time_ratio"],
        "memory_target_met": chosen["peak_ratio"] <= MEMORY_TARGET,
        "time_target_met": real["time_ratio"] <= TIME_TARGET,
    }
    if write:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        stem = "ttt_cpu" + ("_quick" if quick else "")
        (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS_DIR / f"{stem}.md").write_text(to_markdown(result))
        result["written"] = [str(RESULTS_DIR / f"{stem}.md"), str(RESULTS_DIR / f"{stem}.json")]
    return result


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f}"


def _mib(n: int) -> str:
    return f"{n / 1024**2:.1f}"


def to_markdown(result: dict[str, Any]) -> str:
    fake, real, summary = result["memory_fake"], result["real_cpu"], result["summary"]
    extrapolated = fake["rows"][0]["extrapolated"]
    lines = [
        "# TTT: scan checkpointing vs the plain scan",
        "",
        f"torch {result['torch']}, {result['platform']}, {result['threads']} threads"
        + (" (quick run)" if result["quick"] else ""),
        "",
        f"## Peak memory, 125M TTT-Linear ({fake['rows'][0]['parameters'] / 1e6:.0f}M parameters), fake tensors",
        "",
        f"Forward + backward of the next-token loss (fused log-prob head), batch {fake['shape']['batch']} x sequence "
        f"{fake['shape']['seq_len']}, {fake['dtype']}, mini-batch 16 ({fake['shape']['seq_len'] // 16} mini-batches per layer), "
        "measured by `lit_memopt.memory.fake.peak_during` (MemTracker). Peak = all live tensors (parameters included); "
        "extra = peak minus what was live before the step (activations, temporaries, gradients). Group 0 = no checkpointing; "
        f"group {fake['chosen_group']} is what `auto_checkpoint_group_size` picks when memory is short."
        + (
            f" The 12-layer values are extrapolated linearly from measurements at "
            f"{sorted({m['num_layers'] for m in fake['measured']})} blocks (0 = embedding + head only): parameters, gradients "
            "and saved activations are linear in depth; a once-only transient (one TTT layer recomputed in backward, its scan one group "
            "at a time) is counted per block, "
            "which overstates the checkpointed peak, but where in the step the peak falls can change with depth, so "
            "linearity is not guaranteed (see the 2-block cross-check below when present)."
            if extrapolated
            else ""
        ),
        "",
        "| checkpoint_group_size | blocks | peak GiB | extra GiB | peak ratio | extra ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in fake["measured"]:
        lines.append(
            f"| {r['checkpoint_group_size']} | {r['num_layers']} (measured) | {_gib(r['peak_bytes'])} | {_gib(r['extra_bytes'])} | | |"
        )
    for r in fake["rows"]:
        tag = "extrapolated" if r["extrapolated"] else "measured"
        lines.append(
            f"| {r['checkpoint_group_size']} | **{r['num_layers']} ({tag})** | {_gib(r['peak_bytes'])} | {_gib(r['extra_bytes'])} | "
            f"{r['peak_ratio']:.3f} | {r['extra_ratio']:.3f} |"
        )
    ms, ts = real["memory_shape"], real["time_shape"]
    lines += [
        "",
        f"## Real tensors on the CPU: tiny TTT LM ({real['config']['hidden_size']} wide, {real['config']['num_layers']} layers)",
        "",
        f"Peak live tensor bytes (MemTracker, real tensors) at batch {ms['batch']} x sequence {ms['seq_len']}. "
        f"Gradients bit-identical with and without checkpointing: {real['gradients_identical']}.",
        "",
        "| checkpoint_group_size | peak MiB | extra MiB | peak ratio | extra ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in real["rows"]:
        lines.append(
            f"| {r['checkpoint_group_size']} | {_mib(r['peak_bytes'])} | {_mib(r['extra_bytes'])} | "
            f"{r['peak_ratio']:.3f} | {r['extra_ratio']:.3f} |"
        )
    lines += [
        "",
        f"Step time (forward + backward), batch {ts['batch']} x sequence {ts['seq_len']}, median of {real['reps']} interleaved "
        f"repetitions: plain {real['step_s']['plain']:.3f} s, checkpointed (group {real['time_group']}) "
        f"{real['step_s']['checkpointed']:.3f} s.",
        "",
    ]
    check = result.get("cross_check")
    if check:
        lines += [
            "## Cross-check: 2 blocks measured (125M widths, same shape)",
            "",
            check["note"],
            "",
            "| checkpoint_group_size | blocks | peak GiB | extra GiB |",
            "|---:|---:|---:|---:|",
            *(
                f"| {m['checkpoint_group_size']} | {m['num_layers']} | {_gib(m['peak_bytes'])} | {_gib(m['extra_bytes'])} |"
                for m in check["measured"]
            ),
            "",
        ]
    lines += [
        "## Summary",
        "",
        f"- 125M peak ratio (group {fake['chosen_group']}): **{summary['fake_125m_peak_ratio']:.3f}** "
        f"(extra {summary['fake_125m_extra_ratio']:.3f}); target <= {result['memory_target']}: "
        f"{'met' if summary['memory_target_met'] else 'NOT met'}",
        f"- tiny model, real tensors: peak ratio {summary['real_tiny_peak_ratio']:.3f}, extra ratio {summary['real_tiny_extra_ratio']:.3f}",
        f"- CPU step-time ratio: **{summary['cpu_time_ratio']:.3f}**; target <= {result['time_target']}: "
        f"{'met' if summary['time_target_met'] else 'NOT met'}",
        "- No CUDA device in this run: GPU timings were not measured.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter fake sequence, smaller timing shape, fewer repetitions")
    parser.add_argument("--full", action="store_true", help="measure all 12 layers under fake tensors (slow)")
    parser.add_argument("--workers", type=int, default=1, help="processes for the fake-tensor measurements")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, full=args.full, workers=args.workers)
    print(to_markdown(result))
    for path in result.get("written", []):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
