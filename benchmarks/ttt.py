"""TTT scan checkpointing: peak memory of a training step with vs without it, and the step-time cost.

* Fake tensors (no memory, no GPU): the 125M TTT-Linear configuration (``conf/model/ttt_125m.yaml``)
  at sequence 2048, forward + backward of the next-token loss, peaks from ``MemTracker``.
* Real tensors on the CPU, the 125M configuration at one sequence of 2048 and the tiny model
  (``conf/model/ttt_tiny.yaml`` widths): peak live-tensor bytes from ``MemTracker``, gradients
  compared bit for bit, and step-time ratios, the modes interleaved in one run.

Three modes: no checkpointing; the whole TTT layer recomputed in backward in one pass
(``checkpoint_group_size`` = mini-batches per layer); and the whole layer recomputed with its scan
in checkpointed groups (the memory-minimum group size ``auto`` picks when memory is short).

Writes ``benchmarks/results/ttt_cpu[_quick].{md,json}``. Run ``python benchmarks/ttt.py [--quick]``
or call :func:`run`.
"""

from __future__ import annotations

import argparse
import gc
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
from lit_memopt.models.ttt import TTTConfig  # noqa: E402
from lit_memopt.ops import linear_logprobs  # noqa: E402

from benchmarks._results import write_results  # noqa: E402
MEMORY_TARGET = 0.5  # checkpointed peak <= 0.5x of the plain scan's
TIME_TARGET = 1.25  # checkpointed step time <= 1.25x

CONFIG_125M = dict(
    name="ttt_125m", vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12,
    intermediate_size=2048, layer_type="linear", mini_batch_size=16,
)
# Fake tensors cost milliseconds of Python per op and the scan is 128 sequential mini-batches per
# layer, so by default the 12-layer step is measured at 1 and 2 blocks and extrapolated linearly
# (see measure_fake); --full measures all 12 blocks.
FAKE_SHAPE = {"batch": 4, "seq_len": 2048}
FAKE_SHAPE_QUICK = {"batch": 4, "seq_len": 512}
FAKE_LAYERS = (1, 2)
# Real tensors at the 125M configuration: memory at the fake-tensor shape (about 12 GiB and 100 s
# a step on one core), time at one sequence of 2048 (about 25 s a step).
REAL_125M_MEMORY_SHAPE = FAKE_SHAPE
REAL_125M_TIME_SHAPE = {"batch": 1, "seq_len": 2048}
REAL_125M_SHAPE_QUICK = {"batch": 1, "seq_len": 256}
CONFIG_TINY = dict(
    name="ttt_tiny", vocab_size=384, hidden_size=64, num_layers=2, num_heads=4,
    intermediate_size=128, layer_type="linear", mini_batch_size=8,
)
# one shape for memory and time: long enough that the scan, not the head, dominates the TTT layers
REAL_MEMORY_SHAPE = {"batch": 8, "seq_len": 1024}
REAL_TIME_SHAPE = {"batch": 8, "seq_len": 1024}
REAL_SHAPE_QUICK = {"batch": 8, "seq_len": 256}

MODES = ("plain", "layer", "grouped", "layer_conv_stored")
MODE_TEXT = {
    "plain": "no checkpointing",
    "layer": "each block's causal conv + TTT layer recomputed in backward in one pass (group size = mini-batches "
    "per layer; the default `checkpoint_conv=true`)",
    "grouped": "the same, the recomputed scan itself checkpointed in groups (the memory-minimum group size)",
    "layer_conv_stored": "as layer, but the conv's activations stored and the TTT layer alone recomputed "
    "(`checkpoint_conv=false`)",
}


def _train_step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    hidden = model(input_ids)
    loss = -linear_logprobs(hidden[:, :-1], model.lm_head_weight, input_ids[:, 1:]).mean()
    loss.backward()


def _set_mode(model: torch.nn.Module, mode: str, group: int) -> None:
    for block in model.layers:
        block.ttt.checkpoint_group_size = group
        block.checkpoint_conv = mode != "layer_conv_stored"


def memory_saving_group(config: TTTConfig, batch: int, seq_len: int) -> int:
    """The group size :func:`auto_checkpoint_group_size` picks when memory is short (its memory minimum)."""
    from lit_memopt.models.ttt import ttt_layer_class

    probe = ttt_layer_class(config.layer_type)(
        config.hidden_size, config.num_heads, mini_batch_size=config.mini_batch_size, auto_num_layers=config.num_layers
    )
    return probe.auto_group_size(seq_len // config.mini_batch_size, batch, available_bytes=0)


def mode_groups(config: TTTConfig, batch: int, seq_len: int) -> dict[str, int]:
    """``checkpoint_group_size`` of each mode in :data:`MODES` at this shape."""
    n = seq_len // config.mini_batch_size
    return {"plain": 0, "layer": n, "grouped": memory_saving_group(config, batch, seq_len), "layer_conv_stored": n}


def _fake_peaks(config: TTTConfig, shape: dict[str, int], mode: str, group: int, num_layers: int) -> dict[str, int]:
    """Fake-tensor peaks of one training step with ``num_layers`` blocks (0: embedding + head only)."""
    with fake_mode():
        model = TTTConfig(**{**vars(config), "num_layers": max(num_layers, 1)}).build_model()
        if num_layers == 0:
            model.layers = torch.nn.ModuleList()
        _set_mode(model, mode, group)
        input_ids = torch.randint(0, config.vocab_size, (shape["batch"], shape["seq_len"]))
        stats = peak_during(lambda: _train_step(model, input_ids), model)
        params = sum(p.numel() for p in model.parameters())
    return {
        "parameters": params,
        "peak_bytes": stats.peak_bytes,
        "extra_bytes": stats.extra_bytes,
        "activation_bytes": int(stats.by_category.get("Activation", 0)),
    }


def _fake_point(args: tuple[dict[str, Any], dict[str, int], str, int, int]) -> dict[str, Any]:
    config, shape, mode, group, layers = args
    torch.set_num_threads(1)
    peaks = _fake_peaks(TTTConfig(**config), shape, mode, group, layers)
    return {"mode": mode, "checkpoint_group_size": group, "num_layers": layers, **peaks}


def measure_fake(
    config: TTTConfig,
    shape: dict[str, int],
    groups: dict[str, int],
    layers: tuple[int, ...] = FAKE_LAYERS,
    workers: int = 1,
) -> dict[str, Any]:
    """Fake-tensor peaks of forward + backward for each mode (``{mode: checkpoint_group_size}``).

    Measured with ``layers`` blocks (real widths, real sequence). Parameters, gradients and the
    activations each block saves are linear in the number of blocks, and the transient of the one
    layer being recomputed in backward is there once whatever the depth, so the
    ``config.num_layers`` value is extrapolated as ``m_a + (L - a) * (m_b - m_a) / (b - a)`` from two
    depths that both have that transient (``a, b >= 1``). ``layers=(config.num_layers,)`` measures
    the full model directly instead. ``workers > 1`` measures the points in parallel processes.
    """
    jobs = [(vars(config), shape, mode, group, n) for mode, group in groups.items() for n in layers]
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            measured = list(pool.map(_fake_point, jobs))
    else:
        measured = [_fake_point(job) for job in jobs]
    rows = []
    for mode, group in groups.items():
        points = {r["num_layers"]: r for r in measured if r["mode"] == mode}
        if config.num_layers in points:
            row = dict(points[config.num_layers])
            row["extrapolated"] = False
        else:
            lo, hi = sorted(points)[:2]
            row = {"mode": mode, "checkpoint_group_size": group, "num_layers": config.num_layers, "extrapolated": True}
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


class _NoTTT(torch.nn.Module):
    """Stands in for a TTT layer to measure the rest of the model: output 0 (through autograd)."""

    def forward(self, x: torch.Tensor, input_norm: Any = None) -> torch.Tensor:
        return x * 0.0


def _floor_peak(model: torch.nn.Module, input_ids: torch.Tensor) -> Any:
    """MemTracker peak of the same step with every TTT layer replaced by :class:`_NoTTT`: what the
    embedding, convolutions, MLPs and head need whatever the TTT layers do (the floor of any
    TTT checkpointing)."""
    saved = [(block.ttt, block.checkpoint_conv) for block in model.layers]
    for block in model.layers:
        block.ttt, block.checkpoint_conv = _NoTTT(), False
    try:
        return peak_during(lambda: _train_step(model, input_ids), model)
    finally:
        for block, (layer, conv) in zip(model.layers, saved):
            block.ttt, block.checkpoint_conv = layer, conv
        model.zero_grad(set_to_none=True)


def measure_real(
    config: TTTConfig, memory_shape: dict[str, int], time_shape: dict[str, int], reps: int
) -> dict[str, Any]:
    """Real CPU tensors: MemTracker peaks and gradients of each mode at ``memory_shape`` (gradients
    compared bit for bit with the plain mode), the same step without TTT layers (the floor), then
    step times at ``time_shape``, the modes interleaved in every repetition so that machine load
    hits them alike."""
    torch.manual_seed(0)
    model = config.build_model()
    input_ids = torch.randint(0, config.vocab_size, (memory_shape["batch"], memory_shape["seq_len"]))
    groups = mode_groups(config, **memory_shape)
    rows, reference, identical = [], None, True
    for mode, group in groups.items():
        _set_mode(model, mode, group)
        stats = peak_during(lambda: _train_step(model, input_ids), model)
        grads = [p.grad for p in model.parameters()]
        if reference is None:
            reference = grads
        else:
            identical = identical and all(torch.equal(a, b) for a, b in zip(reference, grads))
        model.zero_grad(set_to_none=True)
        rows.append({"mode": mode, "checkpoint_group_size": group, "peak_bytes": stats.peak_bytes, "extra_bytes": stats.extra_bytes})
    rows = _with_ratios(rows)
    del reference, grads
    floor = _floor_peak(model, input_ids)
    floor_row = {"peak_bytes": floor.peak_bytes, "extra_bytes": floor.extra_bytes}
    floor_row["peak_ratio"] = floor.peak_bytes / rows[0]["peak_bytes"]
    floor_row["extra_ratio"] = floor.extra_bytes / rows[0]["extra_bytes"]
    input_ids = torch.randint(0, config.vocab_size, (time_shape["batch"], time_shape["seq_len"]))
    time_groups = mode_groups(config, **time_shape)
    times: dict[str, list[float]] = {mode: [] for mode in time_groups}
    for mode, group in time_groups.items():  # warm-up
        _set_mode(model, mode, group)
        _train_step(model, input_ids)
        model.zero_grad(set_to_none=True)
    for _ in range(reps):
        for mode, group in time_groups.items():
            _set_mode(model, mode, group)
            gc.collect()
            start = time.perf_counter()
            _train_step(model, input_ids)
            times[mode].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    step_s = {mode: statistics.median(t) for mode, t in times.items()}
    return {
        "memory_shape": memory_shape,
        "time_shape": time_shape,
        "rows": rows,
        "floor": floor_row,
        "gradients_identical": identical,
        "time_groups": time_groups,
        "step_s": step_s,
        "time_ratio": {mode: step_s[mode] / step_s["plain"] for mode in step_s},
        "reps": reps,
    }


def run(quick: bool = False, write: bool = True, full: bool = False, workers: int = 1) -> dict[str, Any]:
    """Run the measurements; write ``results/ttt_cpu[_quick].{md,json}`` and return the data.

    ``full=True`` measures the 12-layer model under fake tensors directly (slow: ~10^5 fake ops);
    ``workers`` runs the fake measurements in that many processes.
    """
    fake_shape = FAKE_SHAPE_QUICK if quick else FAKE_SHAPE
    big = TTTConfig(**CONFIG_125M)
    tiny = TTTConfig(**CONFIG_TINY)
    fake_groups = mode_groups(big, **fake_shape)
    fake = measure_fake(big, fake_shape, fake_groups, layers=(big.num_layers,) if full else FAKE_LAYERS, workers=workers)
    real_big = measure_real(
        big,
        REAL_125M_SHAPE_QUICK if quick else REAL_125M_MEMORY_SHAPE,
        REAL_125M_SHAPE_QUICK if quick else REAL_125M_TIME_SHAPE,
        reps=2 if quick else 3,
    )
    real = measure_real(
        tiny,
        REAL_SHAPE_QUICK if quick else REAL_MEMORY_SHAPE,
        REAL_SHAPE_QUICK if quick else REAL_TIME_SHAPE,
        reps=3 if quick else 7,
    )
    result: dict[str, Any] = {
        "benchmark": "ttt",
        "quick": quick,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "memory_target": MEMORY_TARGET,
        "time_target": TIME_TARGET,
        "memory_fake": {"config": CONFIG_125M, "shape": fake_shape, "dtype": "float32", "groups": fake_groups, **fake},
        "real_cpu_125m": {"config": CONFIG_125M, "dtype": "float32", **real_big},
        "real_cpu": {"config": CONFIG_TINY, "dtype": "float32", **real},
    }
    by_mode = {r["mode"]: r for r in fake["rows"]}
    result["summary"] = {
        "fake_125m_peak_ratio": {m: by_mode[m]["peak_ratio"] for m in MODES},
        "fake_125m_extra_ratio": {m: by_mode[m]["extra_ratio"] for m in MODES},
        "real_125m_peak_ratio": {r["mode"]: r["peak_ratio"] for r in real_big["rows"]},
        "real_125m_floor_ratio": real_big["floor"]["peak_ratio"],
        "real_tiny_floor_ratio": real["floor"]["peak_ratio"],
        "real_125m_time_ratio": real_big["time_ratio"],
        "real_tiny_peak_ratio": {r["mode"]: r["peak_ratio"] for r in real["rows"]},
        "real_tiny_time_ratio": real["time_ratio"],
        "gradients_identical": real["gradients_identical"] and real_big["gradients_identical"],
        # the targets, checked on the 125M configuration with the whole-layer recomputation
        "memory_target_met": by_mode["layer"]["peak_ratio"] <= MEMORY_TARGET,
        "time_target_met": real_big["time_ratio"]["layer"] <= TIME_TARGET,
    }
    if write:
        result["written"] = write_results("ttt_cpu" + ("_quick" if quick else ""), result, to_markdown(result))
    return result


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f}"


def _mib(n: int) -> str:
    return f"{n / 1024**2:.1f}"


def _real_section(title: str, real: dict[str, Any], size: Any) -> list[str]:
    ms, ts = real["memory_shape"], real["time_shape"]
    lines = [
        f"## {title}",
        "",
        f"Peak live tensor bytes (MemTracker, real tensors) at batch {ms['batch']} x sequence {ms['seq_len']}; step time "
        f"(forward + backward) at batch {ts['batch']} x sequence {ts['seq_len']}, median of {real['reps']} repetitions, the "
        f"modes interleaved. Gradients bit-identical to the plain mode in every mode: {real['gradients_identical']}.",
        "",
        f"| mode | checkpoint_group_size | peak {size} | extra {size} | peak ratio | extra ratio | step s | time ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = _mib if size == "MiB" else _gib
    for r in real["rows"]:
        mode = r["mode"]
        lines.append(
            f"| {mode} | {r['checkpoint_group_size']} / {real['time_groups'][mode]} | {fmt(r['peak_bytes'])} | "
            f"{fmt(r['extra_bytes'])} | {r['peak_ratio']:.3f} | {r['extra_ratio']:.3f} | {real['step_s'][mode]:.3f} | "
            f"**{real['time_ratio'][mode]:.3f}** |"
        )
    f = real["floor"]
    lines.append(
        f"| floor: TTT layers replaced by a zero | | {fmt(f['peak_bytes'])} | {fmt(f['extra_bytes'])} | "
        f"{f['peak_ratio']:.3f} | {f['extra_ratio']:.3f} | | |"
    )
    lines += [
        "",
        "(group sizes: at the memory shape / at the time shape. The floor is the same step with the TTT layers "
        "replaced by a zero output, the convolutions stored: what the embedding, convolutions, MLPs and head "
        "need, the least that checkpointing the TTT layers alone can reach; recomputing the convolutions too "
        "goes below it.)",
        "",
    ]
    return lines


def to_markdown(result: dict[str, Any]) -> str:
    fake, summary = result["memory_fake"], result["summary"]
    extrapolated = fake["rows"][0]["extrapolated"]
    n_mb = fake["shape"]["seq_len"] // 16
    lines = [
        "# TTT: layer and scan checkpointing vs the plain layer",
        "",
        f"torch {result['torch']}, {result['platform']}, {result['threads']} threads"
        + (" (quick run)" if result["quick"] else ""),
        "",
        "Modes: " + "; ".join(f"**{m}**: {MODE_TEXT[m]}" for m in MODES) + ".",
        "",
        f"## Peak memory, 125M TTT-Linear ({fake['rows'][0]['parameters'] / 1e6:.0f}M parameters), fake tensors",
        "",
        f"Forward + backward of the next-token loss (fused log-prob head), batch {fake['shape']['batch']} x sequence "
        f"{fake['shape']['seq_len']}, {fake['dtype']}, mini-batch 16 ({n_mb} mini-batches per layer), "
        "measured by `lit_memopt.memory.fake.peak_during` (MemTracker). Peak = all live tensors (parameters included); "
        "extra = peak minus what was live before the step (activations, temporaries, gradients)."
        + (
            f" The 12-block values are extrapolated linearly from measurements at "
            f"{sorted({m['num_layers'] for m in fake['measured']})} blocks: parameters, gradients and saved activations "
            "are linear in depth and both depths include the one-layer recomputation transient."
            if extrapolated
            else " All 12 blocks measured."
        ),
        "",
        "| mode | checkpoint_group_size | blocks | peak GiB | extra GiB | peak ratio | extra ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    if extrapolated:
        for r in fake["measured"]:
            lines.append(
                f"| {r['mode']} | {r['checkpoint_group_size']} | {r['num_layers']} (measured) | {_gib(r['peak_bytes'])} | "
                f"{_gib(r['extra_bytes'])} | | |"
            )
    for r in fake["rows"]:
        tag = "extrapolated" if r["extrapolated"] else "measured"
        lines.append(
            f"| {r['mode']} | {r['checkpoint_group_size']} | **{r['num_layers']} ({tag})** | {_gib(r['peak_bytes'])} | "
            f"{_gib(r['extra_bytes'])} | **{r['peak_ratio']:.3f}** | {r['extra_ratio']:.3f} |"
        )
    lines.append("")
    lines += _real_section("Real tensors on the CPU: 125M TTT-Linear", result["real_cpu_125m"], "GiB")
    tiny = result["real_cpu"]
    lines += _real_section(
        f"Real tensors on the CPU: tiny TTT LM ({tiny['config']['hidden_size']} wide, {tiny['config']['num_layers']} blocks)",
        tiny,
        "MiB",
    )
    lines += [
        "## Summary",
        "",
        f"- 125M, fake tensors, peak ratio: layer **{summary['fake_125m_peak_ratio']['layer']:.3f}**, grouped "
        f"{summary['fake_125m_peak_ratio']['grouped']:.3f}; target <= {result['memory_target']} (layer mode): "
        f"{'met' if summary['memory_target_met'] else 'NOT met'}",
        f"- 125M, real CPU step-time ratio: layer **{summary['real_125m_time_ratio']['layer']:.3f}**, grouped "
        f"{summary['real_125m_time_ratio']['grouped']:.3f}; target <= {result['time_target']} (layer mode): "
        f"{'met' if summary['time_target_met'] else 'NOT met'}",
        f"- 125M, fake tensors, the TTT layer alone checkpointed (conv stored): peak ratio "
        f"{summary['fake_125m_peak_ratio']['layer_conv_stored']:.3f}",
        f"- 125M, real tensors, peak ratio: layer {summary['real_125m_peak_ratio']['layer']:.3f}, grouped "
        f"{summary['real_125m_peak_ratio']['grouped']:.3f}, conv stored "
        f"{summary['real_125m_peak_ratio']['layer_conv_stored']:.3f} (floor without TTT layers, conv stored: "
        f"{summary['real_125m_floor_ratio']:.3f})",
        f"- tiny model, real tensors: peak ratio layer {summary['real_tiny_peak_ratio']['layer']:.3f}, grouped "
        f"{summary['real_tiny_peak_ratio']['grouped']:.3f}, conv stored {summary['real_tiny_peak_ratio']['layer_conv_stored']:.3f} "
        f"(floor without TTT layers {summary['real_tiny_floor_ratio']:.3f}); time ratio layer "
        f"{summary['real_tiny_time_ratio']['layer']:.3f}, grouped {summary['real_tiny_time_ratio']['grouped']:.3f}",
        f"- gradients bit-identical to the plain layer in every mode: {summary['gradients_identical']}",
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
