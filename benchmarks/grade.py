"""GRADE legacy vs optimized: peak memory of one training step at the Qwen3-4B architecture (fake
tensors, no GPU, no weights) and measured for real on the tiny model, plus step time on the CPU.

One step = soft generation + reward + KL + backward + AdamW step, for a LoRA policy whose reference
is the adapter-free base, and a frozen Qwen3 sequence classifier of the same architecture as the
reward model. Writes ``benchmarks/results/grade_cpu.{md,json}`` (``--quick``: ``grade_cpu_quick.{md,json}``).

Run ``python benchmarks/grade.py [--quick]`` or call :func:`run`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

if __package__ in (None, ""):  # `python benchmarks/grade.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_memopt.memory.budget import MemoryBudget, memory_budget  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
GIB = 1024**3
MIB = 1024**2
STEP = {"batch": 4, "prompt": 32, "new_tokens": 64, "top_k": 256}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
FIT_LAYERS = (1, 2)  # decoder layers measured at real shape; the 4B's 36 are extrapolated from these
EXTRA_RATIO_TARGET = 0.2  # optimized bytes beyond the weights <= 1/5 of legacy's
WHOLE_STEP_TARGET_GIB = 40.0
# (label, memory_mode, checkpoint_steps)
VARIANTS = [
    ("legacy", "legacy", False),
    ("optimized", "optimized", False),
    ("optimized + step checkpointing", "optimized", True),
]


class _FakeAwareBudget(MemoryBudget):
    """``memory_budget`` that also counts meta and fake tensors (whose storages live on the meta device).

    ``lit_memopt.memory.peak_during`` (MemTracker) cannot be used here: it installs gradient hooks
    on every parameter of every module it runs and fails on the frozen base weights of a LoRA model.
    """

    def _counts(self, st: torch.UntypedStorage) -> bool:
        return True


def _model_config(name: str, *, layers: int | None = None, lora: bool = True):
    from omegaconf import OmegaConf

    from lit_memopt.models import ModelConfig

    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    raw.pop("_target_", None)
    if layers is not None:
        raw["arch"]["num_hidden_layers"] = int(layers)
    raw["lora"] = dict(LORA) if lora else None
    return ModelConfig(**raw)


def _module_bytes(*modules: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _meta_to_fake(module: torch.nn.Module) -> None:
    """Replace meta parameters and buffers by fake CPU tensors (inside ``fake_mode``), keeping ties."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                sub._parameters[name] = memo[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
                sub._buffers[name] = memo[id(b)]


def _build(model_config, mode: str, checkpoint_steps: bool, steps: dict[str, int], reward_classifier: bool):
    from lit_memopt.modules.grade import GradeModule
    from lit_memopt.rewards.grade_reward import build_sequence_classifier

    reward = functools.partial(build_sequence_classifier, num_labels=1) if reward_classifier else None
    return GradeModule(
        model_config, None, reward_model=reward, max_new_tokens=steps["new_tokens"], top_k=steps["top_k"],
        memory_mode=mode, checkpoint_steps=checkpoint_steps, lr=1e-5, hard=True,
    )


def _one_step(module, optimizer, input_ids, attention_mask, generator) -> None:
    out = module.generate_and_score(input_ids, attention_mask, tau=1.0, generator=generator)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _all_ones_masks_skip_materialisation() -> Iterator[None]:
    """Meta tensors have no values, so transformers cannot test whether an attention mask is all ones
    (``.all().item()``); the benchmark's prompts are unpadded, and for all-ones masks transformers
    skips building a 4-D mask (causal SDPA instead). Answer that question for it, as it would."""
    import transformers.masking_utils as masking

    original = masking._ignore_causal_mask_sdpa
    masking._ignore_causal_mask_sdpa = lambda *args, **kwargs: True
    try:
        yield
    finally:
        masking._ignore_causal_mask_sdpa = original


def step_peak(model: str, mode: str, checkpoint_steps: bool, *, layers: int | None = None, steps: dict[str, int] = STEP, backend: str = "meta") -> dict[str, Any]:
    """Peak live bytes of one GRADE training step at ``model``'s real architecture, without real memory.

    ``backend="meta"``: shape-only meta tensors (fast); ``"fake"``: ``lit_memopt.memory.fake_mode``
    fake tensors (the same accounting, about 20x slower per op). Both count storages with
    ``memory_budget``'s live-bytes tracker.
    """
    from lit_memopt.memory.fake import fake_mode

    torch.set_num_threads(1)
    config = _model_config(model, layers=layers)
    start = time.perf_counter()
    with torch.device("meta"):
        module = _build(config, mode, checkpoint_steps, steps, reward_classifier=True)
    context = fake_mode() if backend == "fake" else torch.device("meta")
    with context:
        if backend == "fake":
            _meta_to_fake(module)
        module.train()
        optimizer = module.configure_optimizers()["optimizer"]
        weights = _module_bytes(module)
        vocab = config.hf_config().vocab_size
        input_ids = torch.randint(3, vocab, (steps["batch"], steps["prompt"]))
        attention_mask = torch.ones_like(input_ids)
        masks = _all_ones_masks_skip_materialisation() if backend == "meta" else contextlib.nullcontext()
        # Shape-only tensors cannot draw from a torch.Generator; the noise values do not change the memory.
        with masks, _FakeAwareBudget(None, baseline_bytes=weights) as probe:
            _one_step(module, optimizer, input_ids, attention_mask, None)
    trainable = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    return {
        "model": model, "layers": config.hf_config().num_hidden_layers, "mode": mode, "checkpoint_steps": checkpoint_steps,
        "backend": backend, "weights_bytes": weights, "peak_bytes": probe.peak_bytes, "extra_bytes": probe.peak_bytes - weights,
        "trainable_params": trainable, "measure_seconds": time.perf_counter() - start,
    }


def _variant_in_subprocess(mode: str, checkpoint_steps: bool, plan: list[tuple[int, dict[str, int], str]]):
    # One process per variant (measurements run one after another inside it; each has its own tracker),
    # so the three variants proceed in parallel.
    code = (
        "import json, sys; sys.path.insert(0, %r); from benchmarks.grade import step_peak; "
        "print('RESULT' + json.dumps([step_peak('qwen3_4b', %r, %r, layers=l, steps=s, backend=b) for l, s, b in %r]))"
        % (str(REPO), mode, checkpoint_steps, plan)
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _tiny_in_subprocess(steps: dict[str, int], repeats: int):
    code = (
        "import json, sys; sys.path.insert(0, %r); from benchmarks.grade import real_tiny, VARIANTS; "
        "rows = [dict(real_tiny(m, c, steps=%r, repeats=%r), label=l) for l, m, c in VARIANTS]; "
        "print('RESULT' + json.dumps(rows))" % (str(REPO), steps, repeats)
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(proc) -> dict[str, Any]:
    out, err = proc.communicate()
    for line in out.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT"):])
    raise RuntimeError(f"fake-tensor measurement failed:\n{err[-3000:]}")


def real_tiny(mode: str, checkpoint_steps: bool, *, steps: dict[str, int], repeats: int) -> dict[str, Any]:
    """Measured on real tensors: tiny Qwen3 policy (LoRA), same-architecture classifier reward."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = _model_config("tiny_qwen3")
    module = _build(config, mode, checkpoint_steps, steps, reward_classifier=True).train()
    optimizer = module.configure_optimizers()["optimizer"]
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.hf_config().vocab_size, (steps["batch"], steps["prompt"]), generator=g)
    attention_mask = torch.ones_like(input_ids)
    weights = _module_bytes(module)
    with memory_budget(None, baseline_bytes=weights) as probe:
        _one_step(module, optimizer, input_ids, attention_mask, torch.Generator().manual_seed(2))
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        _one_step(module, optimizer, input_ids, attention_mask, torch.Generator().manual_seed(3 + i))
        times.append(time.perf_counter() - start)
    return {
        "mode": mode, "checkpoint_steps": checkpoint_steps, "weights_bytes": weights,
        "peak_bytes": probe.peak_bytes, "extra_bytes": probe.peak_bytes - weights, "step_seconds": min(times),
    }


def _fmt_gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _fmt_mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def run(quick: bool = False, *, write: bool = True) -> dict[str, Any]:
    """Measure every variant.

    The 4B architecture is measured with the full step shape at 1 and 2 decoder layers and
    extrapolated linearly to its 36: every decoder layer has the same weights and keeps the same
    per-step tensors, so the step's live bytes are affine in the layer count (checked: the fit from
    1 and 2 layers predicts a measured 4-layer step). Tensors are shape-only (meta device); the
    same step is also measured with ``fake_mode`` fake tensors at a small shape as a cross-check.
    ``quick`` generates 16 tokens instead of 64 and skips the checks.
    """
    main_steps = dict(STEP) if not quick else dict(STEP, new_tokens=16)
    tiny_steps = dict(STEP, new_tokens=32) if not quick else dict(STEP, new_tokens=16)
    results: dict[str, Any] = {
        "step": STEP, "lora": LORA, "torch": torch.__version__, "platform": platform.platform(), "quick": quick,
        "targets": {"extra_ratio": EXTRA_RATIO_TARGET, "whole_step_gib": WHOLE_STEP_TARGET_GIB},
    }

    # --- Qwen3-4B architecture, shape-only tensors; tiny model, real tensors; all in parallel.
    lo, hi = FIT_LAYERS
    check_steps = dict(STEP, new_tokens=8)  # linearity in the layer count, checked at 4 layers
    cross_steps = dict(STEP, new_tokens=2)  # meta vs fake tensors, same accounting
    plan = [(lo, main_steps, "meta"), (hi, main_steps, "meta")]
    if not quick:
        plan += [(lo, check_steps, "meta"), (hi, check_steps, "meta"), (4, check_steps, "meta"),
                 (1, cross_steps, "meta"), (1, cross_steps, "fake")]
    tiny_proc = _tiny_in_subprocess(tiny_steps, 1)
    procs = [(label, mode, ckpt, _variant_in_subprocess(mode, ckpt, plan)) for label, mode, ckpt in VARIANTS]
    full_layers = _model_config("qwen3_4b", lora=False).hf_config().num_hidden_layers

    def extrapolate(a: dict[str, Any], b: dict[str, Any], layers: int) -> dict[str, int]:
        return {k: int(a[k] + (b[k] - a[k]) / (hi - lo) * (layers - lo)) for k in ("weights_bytes", "peak_bytes", "extra_bytes")}

    fake_rows, checks = [], []
    for label, mode, ckpt, proc in procs:
        measured = _collect(proc)
        row = extrapolate(measured[0], measured[1], full_layers)
        row.update(
            label=label, mode=mode, checkpoint_steps=ckpt, layers=full_layers, extrapolated_from_layers=[lo, hi],
            measured=measured[:2], measure_seconds=sum(m["measure_seconds"] for m in measured[:2]),
        )
        fake_rows.append(row)
        if not quick:
            predicted = extrapolate(measured[2], measured[3], 4)["peak_bytes"]
            checks.append({
                "label": label, "predicted_peak_4_layers": predicted, "measured_peak_4_layers": measured[4]["peak_bytes"],
                "linearity_error": abs(predicted - measured[4]["peak_bytes"]) / measured[4]["peak_bytes"],
                "meta_extra_1_layer": measured[5]["extra_bytes"], "fake_extra_1_layer": measured[6]["extra_bytes"],
            })
    results["qwen3_4b_fake"] = fake_rows
    results["fake_step"] = main_steps
    results["checks"] = checks

    # --- tiny model, real tensors.
    tiny_rows = _collect(tiny_proc)
    results["tiny_real"] = tiny_rows
    results["tiny_step"] = tiny_steps

    legacy = fake_rows[0]
    best = min(fake_rows[1:], key=lambda r: r["peak_bytes"])
    legacy_tiny = tiny_rows[0]
    results["summary"] = {
        "best_optimized": best["label"],
        "extra_ratio_4b": best["extra_bytes"] / legacy["extra_bytes"],
        "whole_step_gib_4b": best["peak_bytes"] / GIB,
        "extra_ratio_tiny": min(r["extra_bytes"] for r in tiny_rows[1:]) / legacy_tiny["extra_bytes"],
        "time_ratio_tiny": {r["label"]: r["step_seconds"] / legacy_tiny["step_seconds"] for r in tiny_rows[1:]},
    }
    s = results["summary"]
    s["extra_ratio_ok"] = s["extra_ratio_4b"] <= EXTRA_RATIO_TARGET
    s["whole_step_ok"] = s["whole_step_gib_4b"] <= WHOLE_STEP_TARGET_GIB
    if write:
        _write(results)
    return results


def results_stem(quick: bool) -> str:
    """``grade_cpu`` for the full run; a quick run writes ``grade_cpu_quick`` and never overwrites it."""
    return "grade_cpu_quick" if quick else "grade_cpu"


def _write(results: dict[str, Any]) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = results_stem(results["quick"])
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    step, s = results["step"], results["summary"]
    lines = [
        "# GRADE: legacy vs optimized, one training step",
        "",
        f"Step: batch {step['batch']}, prompt {step['prompt']}, {step['new_tokens']} new tokens, top-k {step['top_k']}; "
        f"LoRA r{LORA['r']} alpha{LORA['alpha']} on q/k/v/o; reference = the adapter-free base (no copy); reward = a frozen "
        "Qwen3 sequence classifier of the same architecture. Forward (soft generation, reward, online KL), backward and AdamW step.",
        "",
        "## Qwen3-4B architecture (bf16), shape-only tensors on the CPU",
        "",
        f"Step shape above{' (quick run: ' + str(results['fake_step']['new_tokens']) + ' new tokens)' if results['quick'] else ''}. "
        "Tensors are shape-only (meta device; no memory, no GPU, no weights) and every storage created by the step is "
        "counted while alive by `memory_budget`'s tracker. Measured at "
        f"{FIT_LAYERS[0]} and {FIT_LAYERS[1]} decoder layers with everything else at full size (vocabulary 151,936, "
        "hidden 2,560), extrapolated linearly to 36 layers: each layer adds the same weights and per-step tensors.",
        "Peak = live tensor bytes (weights + activations + gradients + optimizer state + temporaries).",
        "",
        "| variant | weights GiB | peak GiB | beyond weights GiB | vs legacy |",
        "|---|---:|---:|---:|---:|",
    ]
    legacy = results["qwen3_4b_fake"][0]
    for r in results["qwen3_4b_fake"]:
        lines.append(
            f"| {r['label']} | {_fmt_gib(r['weights_bytes'])} | {_fmt_gib(r['peak_bytes'])} | {_fmt_gib(r['extra_bytes'])} "
            f"| {r['extra_bytes'] / legacy['extra_bytes']:.3f} |"
        )
    if results.get("checks"):
        lines += [
            "",
            "Checks: the 1/2-layer fit predicts a measured 4-layer step (8 new tokens); meta tensors and",
            "`lit_memopt.memory.fake_mode` fake tensors count the same step alike (1 layer, 2 new tokens).",
            "",
            "| variant | 4-layer peak predicted GiB | measured GiB | error | beyond weights, meta MiB | fake MiB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for c in results["checks"]:
            lines.append(
                f"| {c['label']} | {_fmt_gib(c['predicted_peak_4_layers'])} | {_fmt_gib(c['measured_peak_4_layers'])} "
                f"| {100 * c['linearity_error']:.2f}% | {_fmt_mib(c['meta_extra_1_layer'])} | {_fmt_mib(c['fake_extra_1_layer'])} |"
            )
    tiny = results["tiny_step"]
    lines += [
        "",
        f"## tiny_qwen3 (fp32), real tensors (batch {tiny['batch']}, prompt {tiny['prompt']}, {tiny['new_tokens']} new tokens, "
        f"top-k {tiny['top_k']})",
        "",
        "Peak measured with `lit_memopt.memory.memory_budget` (live tensor storages, the first step, optimizer state included); "
        "step time = a second step. The CPU is shared with other jobs: read time ratios, not absolute times.",
        "",
        "| variant | weights MiB | peak MiB | beyond weights MiB | vs legacy | step s | time vs legacy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    legacy_t = results["tiny_real"][0]
    for r in results["tiny_real"]:
        lines.append(
            f"| {r['label']} | {_fmt_mib(r['weights_bytes'])} | {_fmt_mib(r['peak_bytes'])} | {_fmt_mib(r['extra_bytes'])} "
            f"| {r['extra_bytes'] / legacy_t['extra_bytes']:.3f} | {r['step_seconds']:.2f} | {r['step_seconds'] / legacy_t['step_seconds']:.2f} |"
        )
    lines += [
        "",
        "## Targets",
        "",
        f"- optimized memory beyond the weights <= {EXTRA_RATIO_TARGET:g} x legacy's (Qwen3-4B, {s['best_optimized']}): "
        f"{s['extra_ratio_4b']:.3f} -> {'met' if s['extra_ratio_ok'] else 'NOT met'}",
        f"- whole optimized step for Qwen3-4B with LoRA <= {WHOLE_STEP_TARGET_GIB:g} GiB predicted: "
        f"{s['whole_step_gib_4b']:.2f} GiB -> {'met' if s['whole_step_ok'] else 'NOT met'}",
        "",
        f"torch {results['torch']}, {results['platform']}.",
    ]
    (RESULTS_DIR / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2/4-layer fake runs extrapolated to 36 layers; shorter tiny runs")
    args = parser.parse_args(argv)
    results = run(quick=args.quick)
    print((RESULTS_DIR / f"{results_stem(args.quick)}.md").read_text())
    return 0 if results["summary"]["extra_ratio_ok"] and results["summary"]["whole_step_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
