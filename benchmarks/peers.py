"""lit-memopt's fused LM-head ops side by side with the peers a user would pick instead: exactness
against float64, CPU time interleaved in one run, and peak memory (real tensors at a small shape,
fake tensors at the real one). Writes ``benchmarks/results/peers_<device>[_quick].{md,json}``.

The peers are optional (``pip install -e ".[bench]"``, see the README); one that cannot be imported
or cannot run here is reported as absent with its error, never replaced by something else.
Run ``python benchmarks/peers.py [--quick]`` or ``python -m benchmarks --only peers``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

if __package__ in (None, ""):  # `python benchmarks/peers.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The names below are this module's interface (tests and `python -m benchmarks` read them here).
from benchmarks._peer_measure import (  # noqa: E402,F401
    count_products,
    exactness,
    fake_memory,
    interleaved_times,
    one_thread,
    paired_ratio,
    real_memory,
)
from benchmarks._peer_methods import (  # noqa: E402,F401
    COUNT_SEQUENCE_LENGTH,
    COUNT_SHAPE,
    FAKE_MEMORY_SHAPE,
    FAKE_MEMORY_SHAPE_QUICK,
    FLOOR_BY_PRODUCTS,
    FLOOR_FROZEN,
    FLOOR_FROZEN_RECOMPUTING,
    FLOOR_HOLDING,
    FLOOR_RECOMPUTING,
    GRPO,
    LIT_EXACT,
    LIT_FAST,
    LIT_FP32_PRODUCTS,
    LIT_FUSED_GRPO,
    LIT_FUSED_GRPO_FAST,
    LIT_METHODS,
    NAIVE,
    OPS,
    PEER_LOADERS,
    REAL_MEMORY_SHAPE,
    REAL_MEMORY_SHAPE_QUICK,
    REPS,
    REPS_QUICK,
    SEQUENCE_LENGTH,
    SEQUENCE_LENGTH_QUICK,
    TIME_SHAPE,
    TIME_SHAPE_QUICK,
    Inputs,
    Method,
    Peer,
    _load,
    _version,
    add_grpo_logps,
    make_inputs,
    methods_for,
    objective,
    own_floor,
    product_floors,
)
from benchmarks._peer_report import (  # noqa: E402,F401
    BF16_FAST_VS_CCE_TIME,
    FP32_VS_FASTEST_PEER_TIME,
    FROZEN_VS_CCE_TIME,
    MEMORY_VS_BEST_PEER,
    MEMORY_VS_NAIVE,
    SFT_VS_CCE_TIME,
    VS_OWN_FLOOR_TIME,
    _load_avg,
    judge,
    machine,
    report_rows,
    to_markdown,
)
from benchmarks._results import write_results  # noqa: E402


def load_peers(names: Optional[list[str]] = None) -> dict[str, Peer]:
    """Import each peer (all of :data:`PEER_LOADERS` by default); never raises."""
    out = {}
    for name in names or list(PEER_LOADERS):
        package, loader = PEER_LOADERS[name]
        out[name] = _load(name, package, loader)
    return out


def compare(op: str, dtype: torch.dtype, shape: dict[str, int], reps: int, peers: dict[str, Peer], *,
            sequence_length: int = SEQUENCE_LENGTH, only: Optional[list[str]] = None, count: bool = True) -> dict[str, Any]:
    """Exactness and interleaved one-thread time of every method of ``op`` at ``shape``, each beside the bare head
    products of its own path (:func:`product_floors`, :func:`own_floor`), timed in the same repetitions.

    ``count``: also count each method's head products by FLOPs (:func:`count_products`) at :data:`COUNT_SHAPE`,
    after the timing, as a check of the product count its floor assumes."""
    methods, absent = methods_for(op, dtype, peers)
    methods += product_floors(op)  # each path's bare head products, timed beside it
    if only is not None:
        methods = [m for m in methods if m.name in only or m.name == NAIVE]
    x = make_inputs(shape, dtype, sequence_length=sequence_length)
    add_grpo_logps(x, sequence_length)
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        errors = exactness([m for m in methods if not m.floor], x)
        failed = {name for name, e in errors.items() if "error" in e}
        for m in methods:
            if m.name in failed:
                absent.append({"peer": m.peer or m.name, "method": m.name, "error": errors[m.name]["error"]})
        runnable = [m for m in methods if m.name not in failed]
        times = interleaved_times(runnable, x, reps) if reps > 0 else {}
    counts: dict[str, dict[str, Any]] = {}
    if count:
        small = make_inputs(COUNT_SHAPE, dtype, sequence_length=COUNT_SEQUENCE_LENGTH)
        add_grpo_logps(small, COUNT_SEQUENCE_LENGTH)
        with one_thread(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Not the methods whose count is read from their code: a compiled graph does not compile under the
            # counting mode, and a failed compile there leaves torch.compile refusing that function for the run.
            counts = {m.name: count_products(m, small) for m in runnable if not m.floor and not m.products_from}
    rows = []
    for m in runnable:
        r: dict[str, Any] = {"method": m.name, "peer": m.peer, **({"floor": True} if m.floor else errors[m.name])}
        r["products"] = m.products
        if not m.floor:
            r["products_from"] = m.products_from
            r.update(counts.get(m.name, {}))
            r["own_floor"] = own_floor(m)
        if times:
            r["median_s"] = statistics.median(times[m.name])
            r["ratio_vs_naive"] = paired_ratio(times, m.name, NAIVE)
            if r.get("own_floor") in times:
                r["ratio_vs_own_floor"] = paired_ratio(times, m.name, r["own_floor"])
        rows.append(r)
    return {"op": op, "dtype": str(dtype).replace("torch.", ""), "shape": shape, "reps": reps, "rows": rows,
            "absent": absent, "times": times, "reference_scale": errors["_reference_scale"]}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def result_stem(device: str, quick: bool, ops: tuple[str, ...] = OPS, dtypes: tuple[str, ...] = tuple(DTYPES),
                memory: bool = True) -> str:
    """``peers_<device>[_quick]`` for the whole run; a partial one (some ops or dtypes, or no memory part) adds what
    it ran, ``peers_cpu_bfloat16_cross_entropy``, so that it never overwrites the whole run's file."""
    stem = f"peers_{device}" + ("_quick" if quick else "")
    if tuple(ops) == OPS and tuple(dtypes) == tuple(DTYPES) and memory:
        return stem
    parts = ([] if tuple(dtypes) == tuple(DTYPES) else list(dtypes)) + ([] if tuple(ops) == OPS else list(ops))
    return "_".join([stem, *parts] + ([] if memory else ["time_only"]))


def run(quick: bool = False, write: bool = True, ops: tuple[str, ...] = OPS, fake: bool = True,
        dtypes: tuple[str, ...] = tuple(DTYPES), memory: bool = True) -> dict[str, Any]:
    """Every comparison of ``ops`` in ``dtypes`` (names of :data:`DTYPES`); writes
    ``results/<result_stem(...)>.{md,json}`` and returns the data. ``memory=False`` skips the memory part (real
    and fake), ``fake=False`` its fake-tensor half."""
    peers = load_peers()
    triton_version = _version("triton")
    if triton_version is None or importlib.util.find_spec("triton") is None:
        triton_version = None
    shape = TIME_SHAPE_QUICK if quick else TIME_SHAPE
    seq = SEQUENCE_LENGTH_QUICK if quick else SEQUENCE_LENGTH
    reps = REPS_QUICK if quick else REPS
    result: dict[str, Any] = {
        "benchmark": "peers",
        "quick": quick,
        "command": "python -m benchmarks --only peers" + (" --quick" if quick else ""),
        "torch": torch.__version__,
        "machine": machine(),
        "triton": triton_version,
        "peers": [{"name": p.name, "package": p.package, "version": p.version, "error": p.error} for p in peers.values()],
        "load_avg_1min": [_load_avg()],
        "time": [],
        "memory_real": [],
        "memory_fake": [],
    }
    for dtype in (DTYPES[name] for name in dtypes):
        for op in ops:
            print(f"[peers] time + exactness: {op} {dtype}", flush=True)
            result["time"].append(compare(op, dtype, shape, reps, peers, sequence_length=seq))
            result["load_avg_1min"].append(_load_avg())
    real_shape = REAL_MEMORY_SHAPE_QUICK if quick else REAL_MEMORY_SHAPE
    for op in ops if memory else ():
        methods, _ = methods_for(op, torch.bfloat16, peers)
        x = make_inputs(real_shape, torch.bfloat16, sequence_length=seq)
        add_grpo_logps(x, seq)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result["memory_real"].append({"op": op, "dtype": "bfloat16", "shape": real_shape, "methods": real_memory(methods, x, frozen=op == "frozen_logprobs")})
    if fake and memory:
        fake_shape = FAKE_MEMORY_SHAPE_QUICK if quick else FAKE_MEMORY_SHAPE
        for op in ops:
            print(f"[peers] fake-tensor memory: {op}", flush=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                methods = fake_memory(op, torch.bfloat16, fake_shape, peers, SEQUENCE_LENGTH)
            result["memory_fake"].append({"op": op, "dtype": "bfloat16", "shape": fake_shape, "methods": methods,
                                          "full_shape": fake_shape == FAKE_MEMORY_SHAPE})
            result["load_avg_1min"].append(_load_avg())
    result["targets"] = judge(result)
    result["report_rows"] = report_rows(result)
    if write:
        stem = result_stem("cuda" if torch.cuda.is_available() else "cpu", quick, ops, dtypes, memory)
        result["written"] = write_results(stem, result, to_markdown(result))
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions, fake tensors at 1024 tokens")
    parser.add_argument("--note", default=None, help="a line for the report (e.g. that the machine was shared)")
    # A whole full-shape CPU run takes hours on one thread: these split it into pieces that each fit a sitting.
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP",
                        help=f"only these comparisons (of {', '.join(OPS)}); the results file names them")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), metavar="DTYPE",
                        help="only these dtypes (float32, bfloat16); the results file names them")
    parser.add_argument("--no-memory", action="store_true", help="time and exactness only (no memory part)")
    args = parser.parse_args(argv)
    # in the order of OPS and DTYPES, whatever the command line's, so that a stem names one selection
    ops = tuple(op for op in OPS if op in args.ops)
    dtypes = tuple(d for d in DTYPES if d in args.dtypes)
    result = run(quick=args.quick, write=False, ops=ops, dtypes=dtypes, memory=not args.no_memory)
    result["command"] = " ".join(["python benchmarks/peers.py", *(["--quick"] if args.quick else []),
                                  *(["--ops", *ops] if ops != OPS else []),
                                  *(["--dtypes", *dtypes] if dtypes != tuple(DTYPES) else []),
                                  *(["--no-memory"] if args.no_memory else [])])
    if args.note:
        result["note"] = args.note
    device = "cpu" if not torch.cuda.is_available() else "cuda"
    stem = result_stem(device, args.quick, ops, dtypes, not args.no_memory)
    result["written"] = write_results(stem, result, to_markdown(result))
    print(to_markdown(result))
    for path in result["written"]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())